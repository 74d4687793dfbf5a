"""The flips rules' text work per branch (``salient.compare``: numbers, names, negations,
content words, word salad; prose and code) at 1x/2x/4x/8x a base length, this tree against a
peer tree (e.g. main), interleaved in one invocation.

    python bench/flips_text_bench.py [--peer-src /work/main/src] [--rounds 5] [--base-chars 5700]

The texts are real: the blind-labelled SmolLM2 branches (tests/data/flip_labels_smollm.jsonl),
each case's reference and branch continuations joined in file order until the reference holds
``--base-chars`` x the factor characters (the branch side: the same cases' branch texts), so
both sides differ where real branches differ. Each worker process imports logitdiff from one
tree, times ``salient.compare`` (prose, then code) at every length (the median of 3 calls) and
prints JSON; rounds alternate which tree goes first. Prints a table of the medians over the
rounds and the ratio this tree / peer, and checks that both trees return the same results.
Timings on a shared machine are noisy: record the load beside them (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "flip_labels_smollm.jsonl"
FACTORS = (1, 2, 4, 8)


def texts(chars: int) -> tuple[str, str]:
    cases = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    ref, br = [], []
    n = 0
    while n < chars:
        for c in cases:
            ref.append(c["prefix"] + c["ref"])
            br.append(c["prefix"] + c["branch"])
            n += len(ref[-1]) + 2
            if n >= chars:
                break
    return "\n\n".join(ref), "\n\n".join(br)


def worker(base: int) -> None:
    from logitdiff.flips import salient
    from logitdiff.flips import _divergence

    out = []
    for f in FACTORS:
        ref, br = texts(base * f)
        start = _divergence(ref, br)
        row = {"factor": f, "ref_chars": len(ref), "branch_chars": len(br)}
        for mode in ("prose", "code"):
            ts, res = [], None
            for _ in range(3):
                t0 = time.perf_counter()
                res = salient.compare(ref, br, code=mode == "code", ref_cut=False, branch_cut=True, start=start)
                ts.append(time.perf_counter() - t0)
            row[mode] = statistics.median(ts)
            row[mode + "_result"] = res
        out.append(row)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-src", default=None, help="src/ of the tree to compare with (e.g. /work/main/src)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base-chars", type=int, default=5700)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.base_chars)
    trees = {"this": str(REPO / "src")}
    if a.peer_src:
        trees["peer"] = a.peer_src
    got: dict[str, list] = {k: [] for k in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            p = subprocess.run([sys.executable, __file__, "--worker", "--base-chars", str(a.base_chars)], env=env,
                               capture_output=True, text=True, check=True)
            got[name].append(json.loads(p.stdout))
    print(f"load average at the end: {os.getloadavg()}")
    print("| factor | ref chars | mode | " + " | ".join(f"{k} median s" for k in trees) + (" | this / peer |" if a.peer_src else " |"))
    print("| --- " * (4 + len(trees)) + "|")
    same = True
    for i, f in enumerate(FACTORS):
        for mode in ("prose", "code"):
            med = {k: statistics.median(run[i][mode] for run in got[k]) for k in trees}
            cells = " | ".join(f"{med[k]:.4f}" for k in trees)
            ratio = f" | {med['this'] / med['peer']:.2f} |" if a.peer_src else " |"
            print(f"| {f}x | {got['this'][0][i]['ref_chars']} | {mode} | {cells}{ratio}")
            if a.peer_src:
                same &= got["this"][0][i][mode + "_result"] == got["peer"][0][i][mode + "_result"]
    if a.peer_src:
        print("results identical in both trees:", same)


if __name__ == "__main__":
    main()
