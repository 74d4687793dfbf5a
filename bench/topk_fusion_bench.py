"""The seed's top-K fields of a full-vocabulary compare: one pass or three.

``compare`` of two full-logit runs needs the exact metrics (``metrics.full_vocab``) and each
side's top-K (ids and log-probabilities) for the seed's fields. Before, it ran
``full_vocab`` and then ``row_stats`` on each side (two more passes, two more
log-softmaxes); now ``full_vocab(..., top_k_out=K)`` returns the top-K from its own pass.
This times both ways on the same synthetic logits (reference ~ N(0, 2^2), candidate =
reference + N(0, 0.05^2)), interleaved, median of ``--repeats``, and checks that the
outputs are identical.

    python bench/topk_fusion_bench.py --vocab 248320 --n 256 --k 64 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from logitdiff import metrics as M

    rng = np.random.default_rng(0)
    zr = (rng.standard_normal((args.n, args.vocab), dtype=np.float32) * 2.0)
    zc = zr + rng.standard_normal((args.n, args.vocab), dtype=np.float32) * 0.05
    y = rng.integers(0, args.vocab, args.n)

    def three_pass():
        m = M.full_vocab(zr, zc, y, k=10)
        a, b = M.row_stats(zr, k=args.k), M.row_stats(zc, k=args.k)
        return m, a["topk_ids"], a["topk_logprobs"], b["topk_ids"], b["topk_logprobs"]

    def one_pass():
        m = M.full_vocab(zr, zc, y, k=10, top_k_out=args.k)
        return m, m.pop("topk_ids_ref"), m.pop("topk_logprobs_ref"), m.pop("topk_ids_cand"), m.pop("topk_logprobs_cand")

    a, b = three_pass(), one_pass()  # warm-up, and the outputs must agree
    assert all(np.array_equal(a[0][k], b[0][k], equal_nan=True) for k in a[0])
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[3], b[3])
    assert np.abs(a[2] - b[2]).max() <= 1e-12 and np.abs(a[4] - b[4]).max() <= 1e-12
    t = {"three passes (full_vocab + row_stats x 2)": [], "one pass (full_vocab top_k_out)": []}
    for _ in range(args.repeats):
        for name, fn in zip(t, (three_pass, one_pass)):
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; V={args.vocab:,}, "
          f"N={args.n}, K={args.k}, float32 logits, median of {args.repeats}")
    print("| variant | seconds | positions/s | vs three passes |")
    print("|---|---:|---:|---:|")
    base = statistics.median(next(iter(t.values())))
    for name, xs in t.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.3f} | {args.n / med:,.0f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
