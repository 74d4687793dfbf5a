"""The tokenizer preflight on a 262,144-token GGUF (issue 40: the metadata read through
``gguf.GGUFReader`` on every open, ~20 s of each command and most of a 191 s preflight).

    PYTHONPATH=src python bench/gguf_metadata_bench.py build /tmp/wide262k
    PYTHONPATH=src python bench/gguf_metadata_bench.py time /tmp/wide262k --rounds 5 --peer-src /work/main/src
    PYTHONPATH=src python bench/gguf_metadata_bench.py read /tmp/wide262k/ref-F32.gguf --rounds 3

``build``: a random tiny Llama whose vocabulary is the bundled tokenizer widened with filler
tokens to V = 262,144 (tests/_models.py, Gemma 3's vocabulary size), exported as two F32
GGUFs (reference and candidate: two files, as a real run has). ``time``: each round runs,
in fresh processes and interleaved, ``capture.preflight_tokenization(gguf:A, [gguf:B],
bundled workload)`` with the code under ``--peer-src`` (before), with this checkout and an
empty cache (after, first command on these files) and with this checkout and the cache the
previous run left (after, every later command); prints the seconds of the preflight call
and of the whole process per case, and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
V = 262_144

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from logitdiff.builtin import WORKLOAD
from logitdiff.capture import preflight_tokenization
from logitdiff.workload import read_workload
items = read_workload(WORKLOAD)
t1 = time.perf_counter()
preflight_tokenization("gguf:" + sys.argv[1], ["gguf:" + sys.argv[2]], items)
t2 = time.perf_counter()
print(json.dumps({"preflight_s": t2 - t1, "items": len(items)}))
"""


def build(out: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _models import make_wide_llama

    from logitdiff.sources.gguf_export import export_gguf

    out.mkdir(parents=True, exist_ok=True)
    d = make_wide_llama(out / "hf", vocab_size=V, hidden=64, layers=1, heads=2, kv_heads=1)
    a = export_gguf(d, out / "ref-F32.gguf", "F32")
    shutil.copy2(a, out / "cand-F32.gguf")
    print(out / "ref-F32.gguf", out / "cand-F32.gguf")


def one(src: str, cache: str, a: Path, b: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=src, LOGITDIFF_CACHE=cache)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, str(a), str(b)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(p.stderr[-2000:])
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_s": wall}


def timing(out: Path, rounds: int, peer_src: str) -> None:
    a, b = out / "ref-F32.gguf", out / "cand-F32.gguf"
    here = str(HERE.parent / "src")
    results: dict[str, list[dict]] = {"before (peer)": [], "after, empty cache": [], "after, cache kept": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            cold = Path(tmp) / f"cold{r}"
            results["before (peer)"].append(one(peer_src, str(Path(tmp) / f"peer{r}"), a, b))
            results["after, empty cache"].append(one(here, str(cold), a, b))
            results["after, cache kept"].append(one(here, str(cold), a, b))  # the cache the run before left
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]['preflight_s']:.2f} s" for k, v in results.items()), flush=True)
    print("| case | preflight s (median) | runs | process s (median) |")
    print("|---|---:|---|---:|")
    for k, v in results.items():
        pf = [x["preflight_s"] for x in v]
        pr = [x["process_s"] for x in v]
        print(f"| {k} | {statistics.median(pf):.2f} | {', '.join(f'{x:.2f}' for x in pf)} | {statistics.median(pr):.2f} |")


def read(path: Path, rounds: int) -> None:
    """The metadata read alone, in this process, interleaved: gguf.GGUFReader (before) and
    the key/value parser (after, empty cache); the two give the same values."""
    from logitdiff.sources.gguf_meta import _read_with_gguf, read_keys

    times: dict[str, list[float]] = {"GGUFReader": [], "key/value parser": []}
    for _ in range(rounds):
        for name, fn in (("GGUFReader", _read_with_gguf), ("key/value parser", read_keys)):
            t = time.perf_counter()
            got = fn(path)
            times[name].append(time.perf_counter() - t)
            assert len(got["tokenizer.ggml.tokens"]) == V
        print(", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    t = sub.add_parser("time")
    t.add_argument("out", type=Path)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--peer-src", required=True, help="src/ of the code before (e.g. /work/main/src)")
    r = sub.add_parser("read")
    r.add_argument("gguf", type=Path)
    r.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
    elif args.cmd == "read":
        read(args.gguf, args.rounds)
    else:
        timing(args.out, args.rounds, args.peer_src)


if __name__ == "__main__":
    main()
