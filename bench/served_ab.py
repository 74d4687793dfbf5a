"""Served capture + compare against quantdiff, interleaved (order rotated each repeat), on the
same two llama-servers (default flags, bundled ladder F32 / Q4_K_M) and the peer workload of
served_bench.py (20 items x 32 tokens, top-20); two source trees (A: before, B: after), each
with its own compiled bytecode (as an installed package has).

    PYTHONPATH=src:tests python bench/served_ab.py OUT REPEATS TREE_A TREE_B WORKLOAD [VARIANT ...]

Variants (default: all):

* ``quantdiff``: ``quantdiff run --ref llamacpp:R --cand llamacpp:C --prompts WL --score-tokens 32
  --top-k 20 --offline --no-preflight --no-png --no-cache`` (reference top-K from its greedy
  generation, one request per item; the candidate teacher-forced, one request per position;
  plus a free chat answer per item on both sides, which logitdiff does not do);
* ``A-3step`` / ``B-3step``: ``capture`` reference + ``capture --reference`` candidate +
  ``compare`` (three processes), batching=rounds;
* ``B-run``: ``logitdiff run --reference openai:R --candidate openai:C --no-noise-floor
  --no-flips``: the same work in one process (like for like: no floor);
* ``B-run-floor``: the same with the served floor (logitdiff's default for served sides: each
  side scored again with other batch mates; flips stay off: quantdiff has none);
* ``B-run-serial``: ``B-run`` with batching=serial on both sides (deterministic rows);
* ``B-run-nooverlap``: ``B-run`` with ``overlap=off`` on the candidate: the candidate scored
  after the reference's generation, not on each block while the reference generates the next
  (``B-run`` passes ``overlap=on``: both servers are on this host, where auto means off).

Per variant: the wall of its processes, their CPU time (user + system, children's rusage),
the load average at its start; medians over repeats; the ratio of median walls vs quantdiff.
"""
import json, os, statistics, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import llama_server
from logitdiff.builtin import TINY_DIR, cache_dir
from logitdiff.sources.quantize import build_ladder

ALL = ["quantdiff", "A-3step", "B-3step", "B-run", "B-run-floor", "B-run-serial", "B-run-nooverlap"]
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
reps, A, B, wl = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
variants = sys.argv[6:] or ALL
ladder = build_ladder(TINY_DIR, cache_dir(), ["Q4_K_M"])
py = sys.executable
QD = os.environ.get("QUANTDIFF", "/tmp/qdvenv/bin/quantdiff")


def env(tree):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    e.update(PYTHONPATH=f"{tree}/src", PYTHONPYCACHEPREFIX=str(out / ("pyc-" + ("A" if tree == A else "B"))))
    return e


for tree in (A, B):
    subprocess.run([py, "-m", "compileall", "-q", f"{tree}/src/logitdiff"], env=env(tree), check=True)


def t(cmd, e=None):
    """Wall and CPU (user + system) of one process."""
    before = os.times()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=e or dict(os.environ))
    wall = time.perf_counter() - t0
    after = os.times()
    assert r.returncode == 0, r.stderr[-1500:]
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


R = llama_server(ladder["F32"], out / "logs", default_flags=True, threads=2).start()
C = llama_server(ladder["Q4_K_M"], out / "logs", default_flags=True, threads=2).start()
walls = {v: [] for v in variants}; cpus = {v: [] for v in variants}; steps = {v: [] for v in variants}; loads = {v: [] for v in variants}
try:
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            d = out / f"{v}-{rep}"
            load = os.getloadavg()[0]
            if v == "quantdiff":
                s = [t([QD, "run", "--ref", f"llamacpp:{R.url}", "--cand", f"llamacpp:{C.url}", "--prompts", wl,
                        "--score-tokens", "32", "--top-k", "20", "--offline", "--no-preflight", "--no-png", "--no-cache", "-q", "--out", str(d)])]
            elif v.endswith("3step"):
                e = env(A if v.startswith("A") else B); ld = [py, "-m", "logitdiff.cli"]
                s = [t(ld + ["capture", f"openai:{R.url},top_k=20", "--workload", wl, "--max-tokens", "32", "--out", str(d / "ref")], e),
                     t(ld + ["capture", f"openai:{C.url},top_k=20", "--reference", str(d / "ref"), "--out", str(d / "cand")], e),
                     t(ld + ["compare", str(d / "ref"), str(d / "cand"), "--out", str(d / "rep")], e)]
            else:
                b = ",batching=serial" if v.endswith("serial") else ""
                extra = [] if v.endswith("floor") else ["--no-noise-floor"]
                ov = "" if v.startswith("A") else ",overlap=off" if v.endswith("nooverlap") else ",overlap=on"
                s = [t([py, "-m", "logitdiff.cli", "run", "--reference", f"openai:{R.url},top_k=20{b}", "--candidate",
                        f"openai:{C.url},top_k=20{b}{ov}", "--workload", wl, "--max-tokens", "32", "--no-flips", *extra, "--out", str(d)],
                       env(A if v.startswith("A") else B))]
            walls[v].append(sum(w for w, _ in s)); cpus[v].append(sum(c for _, c in s)); loads[v].append(load)
            steps[v].append([round(w, 2) for w, _ in s])
            print(v, rep, round(walls[v][-1], 2), steps[v][-1], "cpu", round(cpus[v][-1], 2), "load", round(load, 1), flush=True)
finally:
    R.stop(); C.stop()
med = {v: statistics.median(w) for v, w in walls.items()}
res = {"median_s": med, "ratio_vs_quantdiff": {v: med[v] / med["quantdiff"] for v in med} if "quantdiff" in med else None,
       "median_cpu_s": {v: statistics.median(c) for v, c in cpus.items()}, "walls": walls, "steps": steps, "cpu": cpus,
       "load_at_start": loads}
(out / "served_ab.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
