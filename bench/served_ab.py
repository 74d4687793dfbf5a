"""Two source trees' served capture + compare against quantdiff, interleaved (order rotated each
repeat), on the same two llama-servers (default flags, bundled ladder F32 / Q4_K_M, the peer
workload of served_bench.py: 20 items x 32 tokens, top-20); each tree with its own compiled
bytecode (as an installed package has).

    PYTHONPATH=src:tests python bench/served_ab.py OUT REPEATS TREE_A TREE_B WORKLOAD
"""
import json, os, statistics, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import llama_server
from logitdiff.builtin import TINY_DIR, cache_dir
from logitdiff.quantize import build_ladder
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
reps, A, B, wl = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
ladder = build_ladder(TINY_DIR, cache_dir(), ["Q4_K_M"])
py = sys.executable
def env(tree):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    e.update(PYTHONPATH=f"{tree}/src", PYTHONPYCACHEPREFIX=str(out / ("pyc-" + ("A" if tree == A else "B"))))
    return e
for tree in (A, B):
    subprocess.run([py, "-m", "compileall", "-q", f"{tree}/src/logitdiff"], env=env(tree), check=True)
def t(cmd, e=None):
    t0 = time.perf_counter(); r = subprocess.run(cmd, capture_output=True, text=True, env=e or dict(os.environ))
    assert r.returncode == 0, r.stderr[-1500:]
    return time.perf_counter() - t0
R = llama_server(ladder["F32"], out / "logs", default_flags=True, threads=2).start()
C = llama_server(ladder["Q4_K_M"], out / "logs", default_flags=True, threads=2).start()
variants = ["quantdiff", "A-rounds", "B-rounds", "A-serial", "B-serial"]
walls = {v: [] for v in variants}; steps = {v: [] for v in variants}
try:
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            d = out / f"{v}-{rep}"
            if v == "quantdiff":
                s = [t(["/tmp/qdvenv/bin/quantdiff", "run", "--ref", f"llamacpp:{R.url}", "--cand", f"llamacpp:{C.url}", "--prompts", wl,
                        "--score-tokens", "32", "--top-k", "20", "--offline", "--no-preflight", "--no-png", "--no-cache", "-q", "--out", str(d)])]
            else:
                tree = A if v.startswith("A") else B
                b = ",batching=serial" if v.endswith("serial") else ""
                e = env(tree); ld = [py, "-m", "logitdiff.cli"]
                s = [t(ld + ["capture", f"openai:{R.url},top_k=20{b}", "--workload", wl, "--max-tokens", "32", "--out", str(d / "ref")], e),
                     t(ld + ["capture", f"openai:{C.url},top_k=20{b}", "--teacher", str(d / "ref"), "--out", str(d / "cand")], e),
                     t(ld + ["compare", str(d / "ref"), str(d / "cand"), "--out", str(d / "rep")], e)]
            walls[v].append(sum(s)); steps[v].append([round(x, 2) for x in s])
            print(v, rep, round(sum(s), 2), steps[v][-1], os.getloadavg()[0], flush=True)
finally:
    R.stop(); C.stop()
med = {v: statistics.median(w) for v, w in walls.items()}
print(json.dumps({"median_s": med, "ratio": {v: med[v] / med["quantdiff"] for v in med}, "walls": walls, "steps": steps}, indent=1))
