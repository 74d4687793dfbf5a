"""Benchmark of the full-vocabulary kernel (`metrics.full_vocab`) against llama.cpp's own KLD
pass and against the machine's memory bandwidth, on the same arrays, in one invocation.

Inputs: ``[N, V]`` float32 logits (V = 248,320 by default) in memory-mapped ``.npy`` files,
two regimes:

* ``broad``: reference ~ N(0, 3^2) (about 38 % of the vocabulary within 16 nats of the top);
* ``peaked``: reference ~ N(0, 2^2) plus 25 on a head of 20 random ids per row (a trained
  model's shape: the tail sits ~25 nats below the head, under llama.cpp's -16 cut);

candidate = reference + N(0, 0.05^2) (quantisation-sized differences). Per repeat and
regime, interleaved:

* ``ours``: ``full_vocab(ref, cand, tokens, k=10, threads=T)`` on the float32 maps, and on
  bfloat16 copies (uint16 bits, read in place) — in this process, the library as a user
  calls it (top-K search, all 15 fields, the numpy epilogue);
* ``llama.cpp``: ``process_logits`` of ``tools/perplexity/perplexity.cpp`` (forward KL
  from llama.cpp's uint16 base log-probs, float ``expf``, base entries below -16 nats
  skipped), compiled at -O3 from the llama-cpp-python sdist that this script downloads
  with pip (``bench/llamacpp_kld_driver.cpp`` includes that file; nothing is copied). The
  base pass (what ``--kl-divergence-base`` writes) is not timed;
* ``memory``: a streaming read of the same two float32 files with T threads (AVX2 sums):
  the bandwidth, and the physical limit in positions/s for the 2 x 4 x V bytes a float32
  position needs (2 x 2 x V for bfloat16).

Accuracy: every field of ours (both dtypes) against an independent float64 scipy reference
on the first rows (max error relative to 1e-12 + 1e-9 |x|, the contract: <= 1), and
llama.cpp's KL against the same reference (max relative error).

    python bench/kernel_bench.py --n 384 --threads 2 --repeats 5

Prints a markdown table: median positions/s over the repeats, ratios ours/llama.cpp and
ours/memory limit, load average before and after.

``--e2e`` also writes the broad arrays as RUN directories (float32 and bfloat16 stores,
items of 32 positions) of two sizes (``--e2e-sizes``, default N/4 and N) and times, on the
same rows, interleaved: ``logitdiff compare REF CAND --out DIR`` (in process: reading
chunks, the kernel, tokens.parquet, summaries, bootstrap, report files), the library's
``compare_runs`` alone (reading chunks, the kernel, the per-position columns) and
``full_vocab`` with the arguments compare passes (k=10, top_k_out=64). The two sizes give
the per-position overhead over the kernel apart from the fixed cost of the report files.

``--load-procs N`` runs N busy processes (a float loop each) during the timed repeats: the
loaded regime, on top of whatever else shares the machine. The ratio of every repeat is
printed too (the target is met only when each is >= 1).

Besides wall-clock positions/s, both sides' CPU seconds per position are printed (ours: this
process's CPU time, all threads; llama.cpp: the driver's process CPU time around its timed
call): on a shared machine they depend much less on the other load than wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
V_DEFAULT = 248_320
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "logitdiff", "bench")


# --------------------------------------------------------------------------- data


def make_inputs(path: str, regime: str, n: int, vocab: int, seed: int = 0) -> dict:
    """ref/cand float32 .npy and bfloat16 (uint16 bits) .npy under ``path``, tokens."""
    import torch

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = {k: os.path.join(path, f"{k}.npy") for k in ("ref", "cand", "ref_bf16", "cand_bf16")}
    mm = {k: np.lib.format.open_memmap(f, mode="w+", dtype=np.float32 if "bf16" not in k else np.uint16, shape=(n, vocab)) for k, f in files.items()}
    for i0 in range(0, n, 16):
        i1 = min(n, i0 + 16)
        if regime == "broad":
            ref = rng.standard_normal((i1 - i0, vocab), dtype=np.float32) * 3.0
        else:
            ref = rng.standard_normal((i1 - i0, vocab), dtype=np.float32) * 2.0
            for r in range(i1 - i0):
                ref[r, rng.choice(vocab, 20, replace=False)] += 25.0
        cand = ref + rng.standard_normal((i1 - i0, vocab), dtype=np.float32) * 0.05
        mm["ref"][i0:i1], mm["cand"][i0:i1] = ref, cand
        for k, z in (("ref_bf16", ref), ("cand_bf16", cand)):
            mm[k][i0:i1] = torch.from_numpy(z).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for m in mm.values():
        m.flush()
    del mm
    np.save(os.path.join(path, "tok.npy"), rng.integers(0, vocab, n))
    return files


_HELD: dict = {}


def load(files: dict, dtype: str):
    """The two sides as the kernel reads them, memory-mapped once per file and kept for the
    whole invocation: after the warm-up the pages are mapped, as llama.cpp's driver has them
    (it maps its files once and times its second call), so neither side pays page faults."""
    key = (files["ref"], dtype)
    if key not in _HELD:
        _HELD[key] = _load(files, dtype)
    return _HELD[key]


def _load(files: dict, dtype: str):
    import warnings

    import torch

    sfx = "" if dtype == "float32" else "_bf16"
    out = []
    for side in ("ref", "cand"):
        m = np.load(files[side + sfx], mmap_mode="r")
        if dtype == "bfloat16":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                m = torch.from_numpy(m.view(np.int16)).view(torch.bfloat16)
        out.append(m)
    return out


# --------------------------------------------------------------------------- llama.cpp


def llama_sources(version: str) -> str:
    """llama.cpp of the llama-cpp-python sdist ``version`` (pip download, cached)."""
    root = os.path.join(CACHE, f"llama_cpp_python-{version}")
    src = os.path.join(root, "vendor", "llama.cpp")
    if not os.path.isfile(os.path.join(src, "tools", "perplexity", "perplexity.cpp")):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", CACHE],
            check=True,
        )
        (sdist,) = glob.glob(os.path.join(CACHE, f"llama_cpp_python-{version}.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(CACHE, filter="data")
    return src


def build_driver(version: str) -> str:
    src = llama_sources(version)
    exe = os.path.join(CACHE, f"llamacpp_kld_driver-{version}")
    drv = os.path.join(HERE, "llamacpp_kld_driver.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(drv):
        inc = [f"-I{src}", f"-I{src}/common", f"-I{src}/include", f"-I{src}/ggml/include"]
        # -O3 -DNDEBUG: llama.cpp's Release flags for its tools (no -march=native there).
        # --gc-sections drops perplexity.cpp's model-driving code, which this never calls.
        cmd = ["g++", "-O3", "-DNDEBUG", "-std=c++17", "-ffunction-sections", "-fdata-sections", *inc, drv, "-o", exe, "-Wl,--gc-sections", "-pthread"]
        subprocess.run(cmd, check=True)
    return exe


def installed_llama_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- accuracy


def scipy_reference(zp64, zq64, y, k):
    from scipy.spatial.distance import jensenshannon
    from scipy.special import log_softmax, rel_entr
    from scipy.stats import entropy

    lp, lq = log_softmax(zp64, axis=1), log_softmax(zq64, axis=1)
    p, q = np.exp(lp), np.exp(lq)
    rows = np.arange(len(y))
    ps = np.sort(p, axis=1)
    ids = np.arange(zp64.shape[1])
    op = np.stack([np.lexsort((ids, -r)) for r in zp64])
    oq = np.stack([np.lexsort((ids, -r)) for r in zq64])
    return {
        "kl_nats": rel_entr(p, q).sum(1),
        "kl_rev_nats": rel_entr(q, p).sum(1),
        "jsd_nats": np.nan_to_num(jensenshannon(p, q, axis=1) ** 2),
        "entropy_ref": entropy(p, axis=1),
        "entropy_cand": entropy(q, axis=1),
        "margin_ref": ps[:, -1] - ps[:, -2],
        "p_ref_token": p[rows, y],
        "p_cand_token": q[rows, y],
        "delta_p": q[rows, y] - p[rows, y],
        "nll_ref": -lp[rows, y],
        "nll_cand": -lq[rows, y],
        "top1_ref": op[:, 0],
        "top1_cand": oq[:, 0],
        "topk_overlap": np.array([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(op, oq)]),
    }


def contract_error(got: dict, want: dict) -> float:
    """max over fields and rows of |got - want| / (1e-12 + 1e-9 |want|); <= 1 meets the
    contract (integer fields must be equal: inf otherwise)."""
    worst = 0.0
    for f, w in want.items():
        g = np.asarray(got[f])[: len(w)]
        if f.startswith("top1") or f == "topk_overlap":
            if not np.array_equal(g, w):
                return float("inf")
            continue
        worst = max(worst, float(np.max(np.abs(g - w) / (1e-12 + 1e-9 * np.abs(w)))))
    return worst


# --------------------------------------------------------------------------- runs


def run_ours(files, dtype, threads, y, backend="auto"):
    from logitdiff.numerics import metrics

    zp, zq = load(files, dtype)
    c = time.process_time()
    t = time.perf_counter()
    r = metrics.full_vocab(zp, zq, y, k=10, threads=threads, backend=backend)
    t = time.perf_counter() - t
    _CPU.append(time.process_time() - c)  # CPU seconds of the process, all threads
    return t, r


_CPU: list = []  # CPU seconds of each run_ours call (read right after the call)


def write_runs(files: dict, tmp: str, n: int, vocab: int, tokens: np.ndarray) -> dict:
    """The first ``n`` rows of ``files`` as RUN directories (float32 and bfloat16 stores)."""
    from logitdiff.store import RunItem, RunWriter

    runs = {}
    for dtype in ("float32", "bfloat16"):
        for side in ("ref", "cand"):
            path = os.path.join(tmp, f"run{n}_{side}_{dtype}")
            w = RunWriter(path, source={"spec": f"bench:{side}"}, vocab_size=vocab, tokenizer_hash="sha256:bench", dtype=dtype, chunk_rows=64)
            z = np.load(files[side], mmap_mode="r")
            for i0 in range(0, n, 32):
                i1 = min(n, i0 + 32)
                it = RunItem(id=f"item{i0 // 32}", prompt_ids=[1, 2], teacher_ids=[int(t) for t in tokens[i0:i1]], positions=list(range(i1 - i0)))
                w.add(it, logits=np.asarray(z[i0:i1]))
            w.finish()
            runs[(side, dtype)] = path
    return runs


def run_e2e(files, runs, dtype, threads, y, tmp) -> tuple[float, float, float]:
    """(seconds of ``logitdiff compare``, of the library's ``compare_runs`` alone (reading
    the chunks, the kernel, the per-position columns), of the bare kernel call) on the same
    ``len(y)`` rows."""
    import contextlib
    import io

    import torch

    from logitdiff.numerics import metrics
    from logitdiff.cli import main as cli_main
    from logitdiff.compare import compare_runs
    from logitdiff.store import RunReader

    n = len(y)
    zp, zq = load(files, dtype)
    t = time.perf_counter()
    metrics.full_vocab(zp[:n], zq[:n], y, k=10, top_k_out=64, threads=threads)
    t_kernel = time.perf_counter() - t
    t = time.perf_counter()
    compare_runs(RunReader(runs[("ref", dtype)]), RunReader(runs[("cand", dtype)]), threads=threads)
    t_lib = time.perf_counter() - t
    out = os.path.join(tmp, f"report_{dtype}")
    # the CLI passes no thread count (yet): its kernel calls take the default, which is
    # the CPUs this process may run on; pin it to ``threads`` like the other runs
    torch.set_num_threads(threads)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), _affinity(threads):
        rc = cli_main(["compare", runs[("ref", dtype)], runs[("cand", dtype)], "--out", out])
    t_e2e = time.perf_counter() - t
    if rc not in (0, None):
        raise SystemExit(f"logitdiff compare exited {rc}")
    return t_e2e, t_lib, t_kernel


@contextlib.contextmanager
def _affinity(threads: int):
    """This process limited to ``threads`` CPUs for the block (the CLI's default thread
    count), restored afterwards."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(old)[:threads])
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def run_exe(args) -> dict:
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=384, help="positions per regime")
    ap.add_argument("--vocab", type=int, default=V_DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--regimes", default="broad,peaked")
    ap.add_argument("--check-rows", type=int, default=8, help="rows checked against scipy")
    ap.add_argument("--llama-version", default=None, help="llama-cpp-python sdist (default: the installed version)")
    ap.add_argument("--json", default=None, help="also write the raw timings here")
    ap.add_argument("--e2e", action="store_true", help="also time logitdiff compare end to end (broad regime)")
    ap.add_argument("--e2e-sizes", default=None, help="positions of the end-to-end runs (default: N/4,N): two sizes give the per-position overhead apart from the fixed cost of the report files")
    ap.add_argument("--torch-path", action="store_true", help="also time full_vocab's torch CPU path (the previous kernel)")
    ap.add_argument("--load-procs", type=int, default=0, metavar="N",
                    help="run N busy processes (one core each, a float loop) during the timed repeats: the 'loaded' regime")
    args = ap.parse_args()

    from logitdiff.numerics import kernel

    version = args.llama_version or installed_llama_version()
    if version is None:
        sys.exit("llama-cpp-python is not installed: pass --llama-version")
    exe = build_driver(version)
    load0 = os.getloadavg()
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="kernel_bench_") as tmp:
        data = {}
        for regime in args.regimes.split(","):
            data[regime] = make_inputs(os.path.join(tmp, regime), regime, args.n, args.vocab)
            res[regime] = {"ours_f32": [], "ours_bf16": [], "llama": [], "memory_gbs": []}
            if args.torch_path:
                res[regime]["torch_f32"] = []
        ys = {r: np.load(os.path.join(tmp, r, "tok.npy")) for r in data}
        # untimed warm-up of every path (page cache, lazy imports, the driver binary)
        for regime, files in data.items():
            run_ours(files, "float32", args.threads, ys[regime])
            run_ours(files, "bfloat16", args.threads, ys[regime])
        busy = [subprocess.Popen([sys.executable, "-c", "x = 1.0\nwhile True: x = x * 1.0000001 + 1e-9"])
                for _ in range(args.load_procs)]
        for rep in range(args.repeats):
            for regime, files in data.items():
                d = res[regime]
                d["ours_f32"].append(args.n / run_ours(files, "float32", args.threads, ys[regime])[0])
                d.setdefault("cpu_ours_f32", []).append(_CPU[-1] / args.n)
                lj = run_exe([exe, "kld", files["ref"], files["cand"], str(args.n), str(args.vocab), str(args.threads)])
                d["llama"].append(args.n / lj["seconds"])
                d.setdefault("cpu_llama", []).append(lj["cpu_seconds"] / args.n)
                d["llama_kld"] = lj["kld"]
                d["ours_bf16"].append(args.n / run_ours(files, "bfloat16", args.threads, ys[regime])[0])
                d.setdefault("cpu_ours_bf16", []).append(_CPU[-1] / args.n)
                if args.torch_path:
                    d["torch_f32"].append(args.n / run_ours(files, "float32", args.threads, ys[regime], "torch")[0])
                mj = run_exe([exe, "stream", files["ref"], files["cand"], str(args.threads)])
                d["memory_gbs"].append(mj["bytes"] / mj["seconds"] / 1e9)
            print(f"repeat {rep + 1}/{args.repeats} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for p in busy:
            p.kill()
            p.wait()
        # accuracy on the first rows
        for regime, files in data.items():
            d = res[regime]
            m = args.check_rows
            y = ys[regime][:m]
            for dtype in ("float32", "bfloat16"):
                zp, zq = load(files, dtype)
                zp64, zq64 = (np.asarray(z[:m].float() if dtype == "bfloat16" else z[:m], dtype=np.float64) for z in (zp, zq))
                from logitdiff.numerics import metrics

                got = metrics.full_vocab(zp[:m], zq[:m], y, k=10, threads=args.threads)
                d[f"contract_{dtype}"] = contract_error(got, scipy_reference(zp64, zq64, y, 10))
                if dtype == "float32":
                    want_kl = scipy_reference(zp64, zq64, y, 10)["kl_nats"]
                    d["llama_kl_relerr"] = float(np.max(np.abs(np.asarray(d["llama_kld"][:m]) - want_kl) / want_kl))
            d.pop("llama_kld")
        e2e = {}
        if args.e2e and "broad" in data:
            sizes = [int(x) for x in (args.e2e_sizes or f"{max(1, args.n // 4)},{args.n}").split(",")]
            runs = {m: write_runs(data["broad"], tmp, m, args.vocab, ys["broad"]) for m in sizes}
            for m in sizes:
                for dtype in ("float32", "bfloat16"):
                    run_e2e(data["broad"], runs[m], dtype, args.threads, ys["broad"][:m], tmp)  # warm-up
            for rep in range(args.repeats):
                for m in sizes:
                    for dtype in ("float32", "bfloat16"):
                        e2e.setdefault(f"{dtype}/{m}", []).append(run_e2e(data["broad"], runs[m], dtype, args.threads, ys["broad"][:m], tmp))
            res["e2e"] = e2e
    load1 = os.getloadavg()

    vocab = args.vocab
    print(f"\nV = {vocab:,}, N = {args.n} positions per regime, {args.threads} threads, {args.repeats} interleaved repeats (median); "
          f"{args.load_procs} busy processes during the repeats; "
          f"kernel SIMD: {kernel.has_simd()}; llama-cpp-python {version}; load average {load0[0]:.2f} before, {load1[0]:.2f} after\n")
    print("| regime | ours f32 pos/s | ours bf16 pos/s | llama.cpp KLD pos/s | ours f32 / llama.cpp | ours bf16 / llama.cpp "
          "| memory GB/s | limit f32 pos/s | ours f32 / limit | ours bf16 / limit (bf16 bytes) | ours vs scipy (contract <= 1) f32, bf16 | llama.cpp KL max rel err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for regime, d in res.items():
        if regime == "e2e":
            continue
        med = {k: statistics.median(v) for k, v in d.items() if isinstance(v, list)}
        lim32 = med["memory_gbs"] * 1e9 / (2 * 4 * vocab)
        lim16 = med["memory_gbs"] * 1e9 / (2 * 2 * vocab)
        print(f"| {regime} | {med['ours_f32']:,.0f} | {med['ours_bf16']:,.0f} | {med['llama']:,.0f} | {med['ours_f32'] / med['llama']:.2f}x "
              f"| {med['ours_bf16'] / med['llama']:.2f}x | {med['memory_gbs']:.1f} | {lim32:,.0f} | {med['ours_f32'] / lim32:.2f} "
              f"| {med['ours_bf16'] / lim16:.2f} | {d['contract_float32']:.2g}, {d['contract_bfloat16']:.2g} | {d['llama_kl_relerr']:.1e} |")
    print("\nPer repeat, ours / llama.cpp (wall; each repeat runs both sides back to back):")
    for regime, d in res.items():
        if regime != "e2e":
            for key in ("ours_f32", "ours_bf16"):
                r = [a / b for a, b in zip(d[key], d["llama"])]
                print(f"- {regime} {key}: " + ", ".join(f"{x:.2f}x" for x in r) + f" (min {min(r):.2f}x)")
    print("\n| regime | ours f32 CPU ms/pos | ours bf16 CPU ms/pos | llama.cpp CPU ms/pos | llama.cpp / ours f32 (CPU) "
          "| llama.cpp / ours bf16 (CPU) |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for regime, d in res.items():
        if regime != "e2e":
            cf, cb, cl = (statistics.median(d[k]) * 1e3 for k in ("cpu_ours_f32", "cpu_ours_bf16", "cpu_llama"))
            print(f"| {regime} | {cf:.2f} | {cb:.2f} | {cl:.2f} | {cl / cf:.2f}x | {cl / cb:.2f}x |")
    if args.torch_path:
        print("\n| regime | torch path f32 pos/s | ours f32 / torch path |\n| --- | ---: | ---: |")
        for regime, d in res.items():
            if regime != "e2e":
                t = statistics.median(d["torch_f32"])
                print(f"| {regime} | {t:,.0f} | {statistics.median(d['ours_f32']) / t:.2f}x |")
    if "e2e" in res:
        print("\n| broad, end to end | positions | `logitdiff compare` s | `compare_runs` s | kernel s (same rows) | compare / kernel "
              "| compare_runs / kernel |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        med = {}
        for key, runs_ in res["e2e"].items():
            dtype, m = key.split("/")
            med[key] = [statistics.median(r[j] for r in runs_) for j in range(3)]
            e2e_s, lib_s, k_s = med[key]
            print(f"| {dtype} | {m} | {e2e_s:.2f} | {lib_s:.2f} | {k_s:.2f} | {e2e_s / k_s:.2f}x | {lib_s / k_s:.2f}x |")
        sizes = sorted({int(k.split("/")[1]) for k in med})
        if len(sizes) >= 2:
            lo, hi = sizes[0], sizes[-1]
            print(f"\n| broad, per position ({lo} -> {hi}) | extra compare s / extra kernel s | extra compare_runs s / extra kernel s "
                  "| fixed cost of compare s |\n| --- | ---: | ---: | ---: |")
            for dtype in ("float32", "bfloat16"):
                a, b = med[f"{dtype}/{lo}"], med[f"{dtype}/{hi}"]
                slope = (b[0] - a[0]) / (b[2] - a[2])
                print(f"| {dtype} | {slope:.2f}x | {(b[1] - a[1]) / (b[2] - a[2]):.2f}x | {b[0] - slope * b[2]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": [load0, load1], "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
