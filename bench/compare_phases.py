"""Where a compare's time goes, by what runs it (issue 28 item 3): per phase the wall time,
the process CPU (all threads) and the calling thread's CPU, so single-threaded stretches --
one core idle on a quiet 2-core machine, however loaded the machine is when measured --
show apart from the threaded kernel and the decode worker.

    PYTHONPATH=src python bench/compare_phases.py REF_RUN CAND_RUN [--rounds 9]

Phases: the token and item checks, the reader's chunk (a full run: reading the memory map;
a hidden one: waiting for the decode worker, whose CPU is the "other threads" column),
the bf16 -> float32 conversion of exact.kernel_pair (reference rows compared against
float32 candidate rows), the compiled pair kernel (its threads), and the rest (the
metrics' numpy after each kernel call, Python). Means over the rounds after one warm-up
compare.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections import defaultdict

from logitdiff import compare as C
from logitdiff.numerics import kernel as K
from logitdiff.compare.methods import exact as E
from logitdiff.store import RunReader


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ref")
    ap.add_argument("cand")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kw):
            w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
            try:
                return f(*args, **kw)
            finally:
                x = acc[label]
                x[0] += time.perf_counter() - w0
                x[1] += time.process_time() - p0
                x[2] += time.thread_time() - t0

        setattr(owner, name, timed)

    wrap(C, "check_same_tokens", "checks: tokens")
    wrap(C, "pair_items", "checks: items")
    wrap(RunReader, "_chunk", "reader: chunk (full: map; hidden: wait for the decode)")
    wrap(E, "float32_rows", "bf16 -> float32 conversion (kernel_pair)")
    wrap(K, "pair_rows", "pair kernel (its threads)")
    tot = [0.0, 0.0, 0.0]
    for i in range(a.rounds + 1):
        if i == 1:  # the first compare warms the page cache and the head's sha256 cache
            acc.clear()
            tot = [0.0, 0.0, 0.0]
        ref, cand = RunReader(a.ref), RunReader(a.cand)
        w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        C.compare_runs(ref, cand)
        tot = [tot[0] + time.perf_counter() - w0, tot[1] + time.process_time() - p0, tot[2] + time.thread_time() - t0]
    n = a.rounds
    print(f"{a.ref} vs {a.cand}: mean of {n} compares (ms); load average {os.getloadavg()[0]:.1f}")
    print("| phase | wall | process CPU | calling thread CPU | other threads CPU |")
    print("|---|---:|---:|---:|---:|")
    rest = list(tot)
    for k, (w, p, t) in acc.items():
        print(f"| {k} | {w / n * 1e3:.1f} | {p / n * 1e3:.1f} | {t / n * 1e3:.1f} | {(p - t) / n * 1e3:.1f} |")
        rest = [rest[0] - w, rest[1] - p, rest[2] - t]
    print(f"| rest (metrics' numpy after each kernel call, Python) | {rest[0] / n * 1e3:.1f} | {rest[1] / n * 1e3:.1f} | "
          f"{rest[2] / n * 1e3:.1f} | {(rest[1] - rest[2]) / n * 1e3:.1f} |")
    print(f"| **whole compare** | {tot[0] / n * 1e3:.1f} | {tot[1] / n * 1e3:.1f} | {tot[2] / n * 1e3:.1f} | "
          f"{(tot[1] - tot[2]) / n * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
