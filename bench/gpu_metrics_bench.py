"""`metrics.full_vocab` on a GPU at V = 248,320: positions/s by ``chunk_bytes`` (the rows
handed to the device at once), with the logits already on the device and with host
(numpy) input that crosses to it, against the compiled CPU kernel on the same rows in the
same invocation (the peer), and the two checked against each other.

    python bench/gpu_metrics_bench.py [--n 4096] [--repeats 5] [--chunks 64M,1G,4G]
    python bench/gpu_metrics_bench.py --device cpu --n 64 --chunks 64M   # tests the script

Broad logits (N(0, 3^2)), float32 and bfloat16. The GPU path processes a chunk of rows
batched, with about six float64 [rows, V] temporaries inside ``chunk_bytes``; the CPU
kernel works row by row on all the CPUs this process may use. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from logitdiff.numerics import metrics  # noqa: E402
from logitdiff.store import parse_chunk_size  # noqa: E402

V = 248_320


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="positions on the device (default: %(default)s)")
    ap.add_argument("--n-host", type=int, default=1024, help="positions of the host-input runs (default: %(default)s)")
    ap.add_argument("--n-cpu", type=int, default=512, help="positions of the CPU kernel peer (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default="default,64M,1G,4G",
                    help="chunk_bytes values, comma-separated; default = full_vocab's own (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    chunks = [(c, None if c == "default" else parse_chunk_size(c)) for c in args.chunks.split(",")]
    threads = len(os.sched_getaffinity(0))
    g = torch.Generator(device=dev).manual_seed(0)
    zp = torch.randn(args.n, V, generator=g, device=dev) * 3.0
    zq = zp + torch.randn(args.n, V, generator=g, device=dev) * 0.3
    y = torch.randint(0, V, (args.n,), generator=g, device=dev).cpu().numpy()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    dflt = metrics.default_chunk_bytes(dev)
    print(f"device {name}; default chunk_bytes there {dflt / 2**20:,.0f} MiB; V = {V:,}; N = {args.n} on the device, {args.n_host} from host memory, "
          f"{args.n_cpu} on the CPU kernel ({threads} threads); median of {args.repeats}\n")
    print("| dtype | input | chunk_bytes | positions/s | / CPU kernel |")
    print("| --- | --- | --- | ---: | ---: |")
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        a, b = zp.to(dtype), zq.to(dtype)
        ha = a[: args.n_cpu].cpu()
        hb = b[: args.n_cpu].cpu()
        ca, cb = ha, hb  # CPU tensors: the kernel reads float32 and bfloat16 in place
        yc = y[: args.n_cpu]
        t_cpu = timed(lambda: metrics.full_vocab(ca, cb, yc, k=10, top_k_out=64, threads=threads), args.repeats)
        cpu_rate = args.n_cpu / t_cpu
        label = "float32" if dtype == torch.float32 else "bfloat16"
        print(f"| {label} | CPU kernel (peer) | - | {cpu_rate:,.0f} | 1.00x |")
        want = metrics.full_vocab(ca, cb, yc, k=10, top_k_out=64, threads=threads)
        host_a = a[: args.n_host].cpu()
        host_b = b[: args.n_host].cpu()
        yh = y[: args.n_host]
        for text, cb_ in chunks:
            t = timed(lambda: metrics.full_vocab(a, b, y, k=10, top_k_out=64, device=dev, chunk_bytes=cb_), args.repeats)
            print(f"| {label} | on the device | {text} | {args.n / t:,.0f} | {args.n / t / cpu_rate:.2f}x |")
            t = timed(lambda: metrics.full_vocab(host_a, host_b, yh, k=10, top_k_out=64, device=dev, chunk_bytes=cb_), args.repeats)
            print(f"| {label} | host memory | {text} | {args.n_host / t:,.0f} | {args.n_host / t / cpu_rate:.2f}x |")
            got = metrics.full_vocab(a[: args.n_cpu], b[: args.n_cpu], yc, k=10, top_k_out=64, device=dev, chunk_bytes=cb_)
            for f in ("kl_nats", "kl_rev_nats", "jsd_nats", "entropy_ref", "nll_cand"):
                worst = max(worst, float(np.max(np.abs(got[f] - want[f]) / (1e-12 + 1e-9 * np.abs(want[f])))))
            for f in ("top1_ref", "top1_cand", "topk_ids_ref"):
                if not np.array_equal(got[f], want[f]):
                    print(f"MISMATCH: {f} differs between the device and the CPU kernel ({label}, {text})")
                    return 1
    print(f"\ndevice vs CPU kernel on the same rows: worst field error {worst:.3g} of the contract "
          "(rtol 1e-9, atol 1e-12; <= 1 passes); top-1 and top-64 ids identical")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
