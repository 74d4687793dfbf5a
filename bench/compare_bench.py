"""Benchmark of `logitdiff.numerics.metrics.full_vocab` against a naive scipy float64 peer.

Full-vocabulary comparison at V = 248,320 on synthetic logits (reference ~ N(0, 2^2),
candidate = reference + N(0, 0.05^2) noise, i.e. quantisation-sized differences), stored
as memory-mapped ``.npy`` files in a temp dir (float32, or bfloat16 stored as uint16 bits),
so the input is not held twice. Each variant runs in its own subprocess: the parent polls
its ``/proc/<pid>/status`` for the peak anonymous RSS (the working memory; file-backed
pages of the memory-mapped input are page cache and grow with N by nature) and reads
``ru_maxrss`` (peak total RSS, mapped input included).

The peer does the same work the naive way, in float64 with scipy, 8 rows at a time:
``scipy.special.log_softmax`` of both sides, ``p = exp``, ``rel_entr`` sums for KL and
reverse KL, ``scipy.spatial.distance.jensenshannon(...)**2``, ``scipy.stats.entropy``,
argmax, margin and top-K overlap with ``argpartition``/sort, token metrics by indexing.

    python bench/compare_bench.py --n 1024 --repeats 3 --dtype float32,bfloat16

Runs are interleaved (ours, peer, ours, peer, ...), each one timed run in a fresh
subprocess after an untimed warm-up on 8 rows. Prints a markdown table: median positions/s and GB/s of input logits (both sides), the
ratio ours/peer, the max relative error of our kl_nats vs the peer's, peak RSS; then a
peak-RSS-vs-N check of ours (``--rss-n 1024,4096``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

V_DEFAULT = 248_320


# --------------------------------------------------------------------------- data


def make_inputs(path: str, n: int, vocab: int, dtype: str, seed: int = 0) -> dict:
    """Write ref.npy / cand.npy ([n, vocab]) and tok.npy under ``path``; 64 distinct base
    rows, each file row = a base row + a row-specific offset (cheap to write for large n)."""
    import torch

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    nb = min(64, n)
    base = rng.standard_normal((nb, vocab), dtype=np.float32) * 2.0
    noise = rng.standard_normal((nb, vocab), dtype=np.float32) * 0.05
    store = np.float32 if dtype == "float32" else np.uint16
    files = {}
    for name in ("ref", "cand"):
        f = os.path.join(path, f"{name}.npy")
        mm = np.lib.format.open_memmap(f, mode="w+", dtype=store, shape=(n, vocab))
        for i0 in range(0, n, nb):
            i1 = min(n, i0 + nb)
            blk = base[: i1 - i0] + np.arange(i0, i1, dtype=np.float32)[:, None] * 1e-3
            if name == "cand":
                blk = blk + np.roll(noise, i0 // nb, axis=0)[: i1 - i0]
            if dtype == "float32":
                mm[i0:i1] = blk
            else:
                mm[i0:i1] = torch.from_numpy(blk).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        mm.flush()
        del mm
        files[name] = f
    tok = rng.integers(0, vocab, n)
    np.save(os.path.join(path, "tok.npy"), tok)
    files["tok"] = os.path.join(path, "tok.npy")
    return files


def load(path: str, dtype: str):
    """Memory-mapped inputs: numpy float32, or torch bfloat16 over the uint16 map (no copy)."""
    import torch

    out = []
    for name in ("ref", "cand"):
        mm = np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")
        if dtype == "bfloat16":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                mm = torch.from_numpy(mm.view(np.int16)).view(torch.bfloat16)
        out.append(mm)
    return out[0], out[1], np.load(os.path.join(path, "tok.npy"))


# --------------------------------------------------------------------------- peer


def naive_full_vocab(zp, zq, y, k: int = 10, rows: int = 8) -> dict:
    """The same metrics, computed the straightforward way with scipy in float64."""
    import torch
    from scipy.spatial.distance import jensenshannon
    from scipy.special import log_softmax, rel_entr
    from scipy.stats import entropy

    n = zp.shape[0]
    res = {f: [] for f in ("kl_nats", "kl_rev_nats", "jsd_nats", "entropy_ref", "entropy_cand", "top1_match", "margin_ref", "topk_overlap", "nll_ref", "delta_p")}
    for a in range(0, n, rows):
        b = min(n, a + rows)
        if isinstance(zp, torch.Tensor):
            p64 = zp[a:b].to(torch.float64).numpy()
            q64 = zq[a:b].to(torch.float64).numpy()
        else:
            p64 = np.asarray(zp[a:b], dtype=np.float64)
            q64 = np.asarray(zq[a:b], dtype=np.float64)
        lp = log_softmax(p64, axis=1)
        lq = log_softmax(q64, axis=1)
        p, q = np.exp(lp), np.exp(lq)
        res["kl_nats"].append(rel_entr(p, q).sum(1))
        res["kl_rev_nats"].append(rel_entr(q, p).sum(1))
        res["jsd_nats"].append(jensenshannon(p, q, axis=1) ** 2)
        res["entropy_ref"].append(entropy(p, axis=1))
        res["entropy_cand"].append(entropy(q, axis=1))
        res["top1_match"].append(p.argmax(1) == q.argmax(1))
        top2 = -np.partition(-p, 1, axis=1)[:, :2]
        res["margin_ref"].append(top2[:, 0] - top2[:, 1])
        kp = np.argpartition(-p, k, axis=1)[:, :k]
        kq = np.argpartition(-q, k, axis=1)[:, :k]
        res["topk_overlap"].append(np.array([len(set(x) & set(z)) / k for x, z in zip(kp, kq)]))
        yy = np.asarray(y[a:b])[:, None]
        res["nll_ref"].append(-np.take_along_axis(lp, yy, 1)[:, 0])
        res["delta_p"].append(np.take_along_axis(q, yy, 1)[:, 0] - np.take_along_axis(p, yy, 1)[:, 0])
    return {f: np.concatenate(v) for f, v in res.items()}


# --------------------------------------------------------------------------- child


def child(args) -> None:
    """One timed run (after an untimed warm-up on 8 rows) of one implementation."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    zp, zq, y = load(args.data, args.dtype)
    n = zp.shape[0]
    if args.child == "ours":
        from logitdiff.numerics import metrics

        # the thread count is full_vocab's parameter (its default is the process's CPUs, not torch's)
        fn = lambda a, b, t: metrics.full_vocab(a, b, t, k=10, threads=args.threads or None)  # noqa: E731
    else:
        fn = lambda a, b, t: naive_full_vocab(a, b, t, k=10)  # noqa: E731
    fn(zp[:8], zq[:8], y[:8])
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    res = fn(zp, zq, y)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    np.save(args.kl_out, res["kl_nats"])
    print(json.dumps({"n": n, "time": wall, "cpu": cpu, "maxrss_kb": ru1.ru_maxrss, "threads": torch.get_num_threads()}))


def run_child(impl: str, data: str, dtype: str, threads: int, kl_out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--data", data, "--dtype", dtype, "--kl-out", kl_out]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak_anon = 0
    status = f"/proc/{proc.pid}/status"
    while proc.poll() is None:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak_anon = max(peak_anon, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.005)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{impl} child failed ({proc.returncode})")
    r = json.loads(out.strip().splitlines()[-1])
    r["peak_anon_kb"] = peak_anon
    return r


def run_repeats(impls, data, dtype, repeats, threads, tmp) -> dict:
    """``repeats`` runs of each implementation, interleaved (ours, peer, ours, peer, ...) so
    that both see the same background load; one subprocess per run."""
    runs = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            runs[impl].append(run_child(impl, data, dtype, threads if impl == "ours" else 0, os.path.join(tmp, f"kl_{impl}.npy")))
    return {
        impl: {
            "times": [r["time"] for r in rs],
            "cpu": [r["cpu"] for r in rs],
            "maxrss_kb": max(r["maxrss_kb"] for r in rs),
            "peak_anon_kb": max(r["peak_anon_kb"] for r in rs),
            "threads": rs[0]["threads"],
        }
        for impl, rs in runs.items()
    }


# --------------------------------------------------------------------------- main


def load_line() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load n/a"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="positions (rows) per input")
    ap.add_argument("--vocab", type=int, default=V_DEFAULT)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each implementation (interleaved)")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma list of float32,bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="threads for ours and torch (0: the defaults; ours: the CPUs this process may run on)")
    ap.add_argument("--rss-n", default="1024,4096", help="N values of the peak-RSS-vs-N check ('' to skip)")
    ap.add_argument("--rss-dtype", default="bfloat16")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--tmp", default=None, help="directory for the temp .npy files")
    ap.add_argument("--child", choices=("ours", "peer"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--kl-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    print(f"# compare_bench: V={args.vocab}, N={args.n}, repeats={args.repeats} ({load_line()} at start)\n")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for dtype in [d for d in args.dtype.split(",") if d]:
            data = os.path.join(tmp, f"{dtype}-{args.n}")
            make_inputs(data, args.n, args.vocab, dtype)
            isz = 4 if dtype == "float32" else 2
            gb = 2 * args.n * args.vocab * isz / 1e9
            res = run_repeats(["ours"] if args.no_peer else ["ours", "peer"], data, dtype, args.repeats, args.threads, tmp)
            r = {"dtype": dtype, "gb": gb, **res}
            if not args.no_peer:
                kl_o = np.load(os.path.join(tmp, "kl_ours.npy"))
                kl_p = np.load(os.path.join(tmp, "kl_peer.npy"))
                r["rel_err"] = float(np.max(np.abs(kl_o - kl_p) / np.abs(kl_p)))
                r["kl_range"] = (float(kl_p.min()), float(kl_p.max()))
            rows.append(r)
            for f in os.listdir(data):
                os.remove(os.path.join(data, f))

        print("| input | impl | median s | positions/s | GB/s (input) | ours/peer | max rel. err kl_nats | median CPU s | peak anon RSS | peak RSS (incl. mapped input) | runs (s) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            for impl in ("ours", "peer"):
                if impl not in r:
                    continue
                x = r[impl]
                med = statistics.median(x["times"])
                ratio = ""
                err = ""
                if "peer" in r:
                    ratio = f"{statistics.median(r['peer']['times']) / statistics.median(r['ours']['times']):.1f}x" if impl == "ours" else "1.0x"
                    err = f"{r['rel_err']:.1e}" if impl == "ours" else "(reference)"
                label = f"ours ({x['threads']} thr)" if impl == "ours" else "naive scipy f64"
                print(
                    f"| {r['dtype']} [{args.n}, {args.vocab}] | {label} | {med:.2f} | {args.n / med:.0f} | {r['gb'] / med:.2f} | {ratio} | {err} |"
                    f" {statistics.median(x['cpu']):.2f} | {x['peak_anon_kb'] / 1024:.0f} MiB | {x['maxrss_kb'] / 1024:.0f} MiB | {', '.join(f'{t:.2f}' for t in x['times'])} |"
                )
        if rows and "kl_range" in rows[0]:
            print(f"\nkl_nats of the peer ranges over {rows[0]['kl_range'][0]:.3g} .. {rows[0]['kl_range'][1]:.3g} nats ({rows[0]['dtype']}).")

        ns = [int(x) for x in args.rss_n.split(",") if x]
        if ns:
            print(f"\n| peak RSS vs N (ours, {args.rss_dtype}, 1 run) | N | median s | peak anon RSS | peak RSS (incl. mapped input) | input size |")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            for n in ns:
                data = os.path.join(tmp, f"rss-{n}")
                make_inputs(data, n, args.vocab, args.rss_dtype)
                x = run_child("ours", data, args.rss_dtype, args.threads, os.path.join(tmp, "kl_rss.npy"))
                x["times"] = [x["time"]]
                isz = 4 if args.rss_dtype == "float32" else 2
                print(
                    f"| | {n} | {statistics.median(x['times']):.2f} | {x['peak_anon_kb'] / 1024:.0f} MiB | {x['maxrss_kb'] / 1024:.0f} MiB |"
                    f" {2 * n * args.vocab * isz / 2**20:.0f} MiB |"
                )
                for f in os.listdir(data):
                    os.remove(os.path.join(data, f))
    print(f"\n({load_line()} at end)")


if __name__ == "__main__":
    main()
