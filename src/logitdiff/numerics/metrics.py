"""The metrics of docs/formulas.md, vectorised and chunked. Pure: arrays in, arrays out, no I/O.

Full-vocabulary metrics (`full_vocab`) run, on CPU, in the compiled kernel (``_kernel.cpp``
through `kernel`: one float32 pass for maxima and top-K, one float64 pass for the sums,
SIMD, threads over rows, float32/bfloat16/float16 read in place), and on torch tensors
otherwise (GPUs, float64 input, or where the extension was not built); numpy inputs are
wrapped without a copy. Everything is computed in float64 after ``log_softmax`` of the
captured logits, a row (or chunk of rows) and a tile of columns at a time, so that
``[N, V]`` float64 is never materialised (V = 248,320 is a real vocabulary). Each side is
exponentiated once and one log is taken (of p + q); KL is accumulated from the
shift-invariant differences of the logits and from sum (e_p - e_q), not as a difference
of entropies or of log-sums.

Definitions (natural log; P = reference, Q = candidate, y = teacher-forced next token):

    kl_nats      = sum p * (lP - lQ)                      D_KL(P || Q)
    kl_rev_nats  = sum q * (lQ - lP)                      D_KL(Q || P)
    jsd_nats     = 1/2 sum p (lP - lM) + 1/2 sum q (lQ - lM),  lM = log((p + q) / 2)
    top1_*       = argmax, lowest id on ties
    margin_ref   = p(top1) - p(top2) of the reference
    p_ref_token  = p[y], p_cand_token = q[y], delta_p = q[y] - p[y]
    nll_*        = -lP[y], -lQ[y]
    entropy_*    = -sum p lP, -sum q lQ
    topk_overlap = |topK(P) & topK(Q)| / K

Divergences are clamped at 0: rounding can give -1e-17 and a divergence is never negative.

The top-K approximation (`topk`) is the seed report's method, see its docstring.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from . import kernel
from ..errors import LogitdiffError

LN2 = math.log(2.0)

FULL_VOCAB_FIELDS = (
    "kl_nats",
    "kl_rev_nats",
    "jsd_nats",
    "top1_ref",
    "top1_cand",
    "top1_match",
    "margin_ref",
    "p_ref_token",
    "p_cand_token",
    "delta_p",
    "nll_ref",
    "nll_cand",
    "entropy_ref",
    "entropy_cand",
    "topk_overlap",
)

# Implementations of `full_vocab`: "auto" takes the compiled kernel (kernel.py) for CPU
# inputs it reads in place (float32, bfloat16, float16) and torch otherwise (GPUs,
# float64, or where the extension was not built); the others force one path (tests,
# benchmarks). "native-scalar" is the compiled kernel without SIMD.
BACKENDS = ("auto", "native", "native-scalar", "torch")


class NonFiniteLogits(LogitdiffError):
    """NaN or +-inf in captured logits; ``row`` is the offending row, ``side`` ref|cand."""

    def __init__(self, side: str, row: int, value: float):
        self.side, self.row, self.value = side, row, value
        super().__init__(f"{side} logits at row {row} contain {value} (NaN/inf logits are refused)")


def _as_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"logits must be a float array, got {x.dtype}")
    x = np.ascontiguousarray(x)
    with warnings.catch_warnings():
        # A read-only memory map is wrapped without a copy and never written to.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def bfloat16_view(bits: np.ndarray):
    """A torch bfloat16 tensor over ``bits`` (uint16 bfloat16 bit patterns, as RUN chunks
    store them; memory maps included), without a copy: what `full_vocab` reads in place."""
    import torch

    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bfloat16 bits must be uint16, got {bits.dtype}")
    with warnings.catch_warnings():
        # A read-only memory map is wrapped without a copy and never written to.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _raise_nonfinite(sides, row0: int) -> None:
    """``sides``: [(name, logits [R, V], suspect rows [R] bool)]. Raise for the first row
    (then the first side) that really holds NaN/inf; suspects without one are left alone
    (float64 logits near +-1e308 overflow on subtraction, which is not an input error)."""
    import torch

    suspects = sorted({int(r) for _, _, bad in sides for r in bad.nonzero().flatten().tolist()})
    for r in suspects:
        for name, z, bad in sides:
            if bool(bad[r]):
                row = z[r]
                nf = ~torch.isfinite(row)
                if bool(nf.any()):
                    raise NonFiniteLogits(name, row0 + r, float(row[nf][0]))


# Default chunk budget of the batched path on a CUDA device: a quarter of the device's free
# memory, at most 4 GiB. The batched path's cost is per chunk (kernel launches, one
# top-K), so chunks of a few rows starve a GPU: on an H200 at V = 248,320, 64 MiB chunks
# (5 rows) gave 1,944 positions/s and 4 GiB chunks 29,708 (bench/RESULTS.md,
# gpu_metrics_bench). The CPU paths keep their 64 MiB.
DEVICE_CHUNK_MAX = 4 << 30


def default_chunk_bytes(device) -> int:
    """``chunk_bytes`` when the caller gives none: 64 MiB on the CPU; on a CUDA device a
    quarter of its free memory, at most 4 GiB (and at least 64 MiB)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return max(64 << 20, min(DEVICE_CHUNK_MAX, free // 4))
    return 64 << 20


def _rows_per_chunk(vocab: int, budget_bytes: int) -> int:
    # About six float64 [rows, V] temporaries are alive at once in the batched (GPU) path.
    return max(1, int(budget_bytes // (vocab * 8 * 6)))


# Float64 work on CPU runs one row at a time per worker thread (`default_threads()` or the
# caller's ``threads`` of them, each with one intra-op thread), in column tiles of at most this many values: the
# tile temporaries (~1 MB) stay in a core's L2 cache and the ops are few enough per row
# that their fixed cost is small. (Intra-op fork/join per op instead stalls badly on a
# loaded machine: measured 5-10x slower than this with 2 threads and a busy neighbour.)
_CPU_TILE = 32000
# CPU uses the per-row tiled path; False selects the batched path of other devices (tests).
_CPU_PER_ROW = True
# Block width of the exact top-K candidate search (see `_topk_candidates`).
_BLOCK = 128
_TINY = float(np.finfo(np.float64).tiny)


def _tiles(vocab: int, tile: int) -> list[tuple[int, int]]:
    """Column ranges of at most ``tile`` values, starting on multiples of ``_BLOCK``."""
    n = -(-vocab // tile)
    w = -(-(-(-vocab // n)) // _BLOCK) * _BLOCK  # noqa: B002 (ceiling divisions, not a decrement)
    return [(c, min(vocab, c + w)) for c in range(0, vocab, w)]


def _block_max_row(z, tile: int):
    """Maxima of the ``_BLOCK``-wide blocks of one row ``z`` [V] (the last may be partial),
    a tile at a time so that no op is large."""
    import torch

    bounds = _tiles(z.shape[0], tile)
    parts = []
    for zt in z.split(bounds[0][1] - bounds[0][0]):
        n = zt.shape[0]
        full = n // _BLOCK * _BLOCK
        if full:
            parts.append(zt[:full].reshape(-1, _BLOCK).amax(-1))
        if full < n:
            parts.append(zt[full:].amax(-1, keepdim=True))
    return torch.cat(parts)


def _row_top(z, kk: int, tile: int):
    """`_topk_candidates` of one row [V] with small ops only: (ids [kk], values [kk])."""
    bm = None if z.shape[0] <= _BLOCK * max(8, 2 * kk) else _block_max_row(z, tile)[None]
    ids, vals = _topk_candidates(z[None], kk, bm)
    return ids[0], vals[0]


def _topk_candidates(z, kk: int, bm=None):
    """The ``kk`` largest logits of each row of ``z`` [R, V] (any float dtype), by
    descending value and lowest id first on ties: (ids [R, kk] int64, values [R, kk] float64).

    Exact without sorting V values: the ``kk`` largest block maxima are ``kk`` distinct
    elements >= the kk-th largest block maximum t, so every top-kk element (ties included)
    is >= t and lies in a block whose maximum is >= t; only those blocks are searched.
    Works on the input dtype (the float64 upcast preserves order and ties). ``bm``: the
    block maxima [R, ceil(V / _BLOCK)] if already known.
    """
    import torch

    r, v = z.shape
    if v <= _BLOCK * max(8, 2 * kk):
        ids = torch.arange(v, device=z.device).expand(r, v)
        vals = z
    else:
        if bm is None:
            nb = v // _BLOCK
            bm = z[:, : nb * _BLOCK].reshape(r, nb, _BLOCK).amax(-1)
            if nb * _BLOCK < v:
                bm = torch.cat([bm, z[:, nb * _BLOCK :].amax(-1, keepdim=True)], 1)
        t = torch.topk(bm, kk, dim=-1).values[:, -1:]
        # At least kk blocks: a NaN row (refused later) compares false everywhere.
        m = max(kk, int((bm >= t).sum(-1).max()))
        blk = torch.topk(bm, m, dim=-1, sorted=False).indices.sort(-1).values
        ids = (blk[:, :, None] * _BLOCK + torch.arange(_BLOCK, device=z.device)).reshape(r, -1)
        valid = ids < v
        vals = z.gather(1, ids.clamp(max=v - 1))
        if not bool(valid.all()):
            vals = vals.masked_fill(~valid, float("-inf"))
    # Narrow to the values >= the kk-th largest (ties included), then order those few by
    # (value desc, id asc): ids ascend along each row, so a stable descending sort of the
    # id-sorted survivors puts the lowest id first on ties.
    if vals.shape[1] > kk:
        t = torch.topk(vals, kk, dim=-1).values[:, -1:]
        m = max(kk, int((vals >= t).sum(-1).max()))
        pos = torch.topk(vals, m, dim=-1, sorted=False).indices
        pos = pos.sort(-1).values  # ascending position = ascending id
        ids, vals = ids.gather(1, pos), vals.gather(1, pos)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :kk]
    return ids.gather(1, order), vals.gather(1, order).to(torch.float64)


class _Work:
    """Float64 scratch of one worker: exp of each side (a row for pairs, a tile for one side)
    and [4, tile] matrices: 2 x 8V bytes + ~2 MB, whatever N."""

    def __init__(self, rows: int, vocab: int, tile: int, device, pair: bool):
        import torch

        self.f = dict(dtype=torch.float64, device=device)
        self.pair = pair
        self.e = torch.empty(2 if pair else 1, rows, vocab if pair else min(vocab, tile), **self.f)
        self._mats: dict[int, object] = {}
        self._views: dict[tuple[int, int], list] = {}

    def tiles(self, vocab: int, tile: int) -> list:
        """Per tile of `_tiles`: (width, x [4, n], x[0], x[1], x[2], x[::3], e_p, e_q) views,
        made once per worker (view creation is a noticeable share of the per-op cost)."""
        v = self._views.get((vocab, tile))
        if v is None:
            v = []
            for c0, c1 in _tiles(vocab, tile):
                x = self.mat(c1 - c0)
                if self.pair:
                    e0, e1 = self.e[0, 0, c0:c1], self.e[1, 0, c0:c1]
                else:
                    e0 = e1 = x[1]
                v.append((c1 - c0, x, x[0], x[1], x[2], x[::3], e0, e1))
            self._views[(vocab, tile)] = v
        return v

    def mat(self, n: int):
        """[4, n] tile matrix: rows 0-2 scratch, row 3 all ones (so one matrix-vector
        product gives three dot products and a sum)."""
        import torch

        x = self._mats.get(n)
        if x is None:
            x = self._mats[n] = torch.empty(4, n, **self.f)
            x[3] = 1.0
        return x


def _split(z, views):
    """Row z [V] cut into the column tiles of ``views`` (one call, views of z)."""
    return z.split(views[0][0])


def _side_sums_row(z, m: float, w: _Work, tile: int) -> tuple[float, float]:
    """One row z [V] with maximum m: (s, A), a = z - m, e = exp(a), s = sum e, A = sum e*a.
    (log-sum-exp = m + ln s, entropy = ln s - A/s.)"""
    import torch

    views = w.tiles(z.shape[0], tile)
    parts = []
    for zt, (_, _, a, e, _, x03, _, _) in zip(_split(z, views), views):
        a.copy_(zt)  # exact upcast; copy + in-place shift beat one mixed-dtype op by far
        a.sub_(m)
        torch.exp(a, out=e)
        parts.append(torch.mv(x03, e))  # (sum e*a, sum e)
    sa, s = torch.stack(parts).sum(0).tolist()
    return s, sa


def _pair_sums_row(zp, zq, mp: float, mq: float, w: _Work, tile: int) -> list[float]:
    """Both sides of one row ([V] each, maxima mp, mq): [s_p, A_p, s_q, A_q, D_p, D_q, G, S_d]
    with a, e, s, A as in `_side_sums_row`, D_p = sum e_p d, D_q = sum e_q d for
    d = a_p - a_q (shift-invariant, so KL is a sum of small terms, not a difference of
    entropies), G = sum g ln g for g = e_p + (s_p/s_q) e_q = s_p (p + q) and
    S_d = sum (e_p - e_q) (= s_p - s_q, summed directly: see `full_vocab`).

    Two passes over V in L2-sized tiles (the second, for G, needs s_p/s_q): exp of each
    side is taken once (kept in ``w.e``, measured cheaper than recomputing it) and ln
    once (of g); one matrix-vector product per side gives its four first-pass sums.
    """
    import torch

    views = w.tiles(zp.shape[0], tile)
    parts = []
    sd = []
    for zpt, zqt, (_, x, ap, aq, d, _, ep, eq) in zip(_split(zp, views), _split(zq, views), views):
        ap.copy_(zpt)  # exact upcast; copy + in-place shift beat one mixed-dtype op by far
        ap.sub_(mp)
        torch.exp(ap, out=ep)
        aq.copy_(zqt)
        aq.sub_(mq)
        torch.exp(aq, out=eq)
        torch.sub(ap, aq, out=d)
        parts.append(torch.mv(x, ep))  # sum e_p a_p, sum e_p a_q, D_p, s_p
        parts.append(torch.mv(x, eq))  # sum e_q a_p, A_q, D_q, s_q
        sd.append(torch.sub(ep, eq, out=ap).sum())
    t = torch.stack(parts).view(-1, 2, 4).sum(0).tolist()
    s_p, s_q = t[0][3], t[1][3]
    ratio = s_p / s_q
    g_sum = math.nan
    for clamp in (False, True):
        parts = []
        for _, _, g, lg, _, _, ep, eq in views:
            torch.add(ep, eq, alpha=ratio, out=g)
            if clamp:
                g.clamp_min_(_TINY)
            torch.log(g, out=lg)
            parts.append(torch.dot(g, lg))
        g_sum = float(torch.stack(parts).sum())
        # g underflows to 0 only > ~745 nats below both maxima; then 0 * ln 0 = NaN and
        # the pass is redone with g >= tiny (each such term is then ~1e-305, i.e. 0).
        if math.isfinite(g_sum) or not all(math.isfinite(v) for v in t[0] + t[1]):
            break
    return [s_p, t[0][0], s_q, t[1][1], t[0][2], t[1][2], g_sum, float(torch.stack(sd).sum())]


def _pair_sums_batched(zp, zq, mp, mq):
    """`_pair_sums_row` for a chunk of rows [R, V] at once (GPU path): [8, R] tensor."""
    import torch

    f64 = torch.float64
    ap = zp.to(f64) - mp[:, None]
    aq = zq.to(f64) - mq[:, None]
    ep, eq = ap.exp(), aq.exp()
    s_p, s_q = ep.sum(-1), eq.sum(-1)
    d = ap - aq
    sums = [s_p, torch.linalg.vecdot(ep, ap), s_q, torch.linalg.vecdot(eq, aq)]
    sums += [torch.linalg.vecdot(ep, d), torch.linalg.vecdot(eq, d)]
    del ap, aq, d
    g = torch.addcmul(ep, eq, (s_p / s_q)[:, None])
    g_sum = torch.linalg.vecdot(g, g.clamp_min(_TINY).log())
    return torch.stack(sums + [g_sum, (ep - eq).sum(-1)])


def _side_sums_batched(z, m):
    import torch

    a = z.to(torch.float64) - m[:, None]
    e = a.exp()
    return torch.stack([e.sum(-1), torch.linalg.vecdot(e, a)])


def _use_native(backend: str, dev, zp, zq) -> bool:
    """Whether `full_vocab` runs the compiled kernel (see `BACKENDS`)."""
    if backend == "torch":
        return False
    ok = dev.type == "cpu" and zp.dtype == zq.dtype and kernel.supports(zp) and kernel.supports(zq)
    if backend == "auto":
        return ok and kernel.available()
    if not kernel.available():
        raise RuntimeError("backend='native': the compiled kernel logitdiff.numerics._kernel is not built")
    if not ok:
        raise ValueError(f"backend={backend!r} reads CPU float32/bfloat16/float16 [N, V] rows of one dtype; got {zp.dtype}/{zq.dtype} on {dev}")
    return True


def default_threads() -> int:
    """The metrics' default worker-thread count: the CPUs this process may run on
    (``os.sched_getaffinity``; ``os.cpu_count()`` where that does not exist). It does not
    read torch's thread setting, so whatever a source or library set there does not change
    it; pass ``threads`` to `full_vocab`/`row_stats` to choose."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _row_pool(n_rows: int, dev, n_threads: int):
    """Worker threads for the per-row CPU path (torch releases the GIL inside ops)."""
    if dev.type != "cpu":
        return None
    nw = min(n_threads, n_rows)
    if nw <= 1:
        return None
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(nw, thread_name_prefix="logitdiff-metrics")


def _map_rows(pool, local, fn, rows: int, make_work):
    """[fn(i, work) for each row i], on the pool or inline; ``work`` is per thread, kept in
    ``local`` (a ``threading.local``) across calls."""

    import torch

    def one(i):
        w = getattr(local, "w", None)
        if w is None:
            # Each worker is one stream of small ops: no intra-op fork/join (torch's exp/log
            # fork at 2048 values; with the rows already spread over the cores that only
            # adds barrier waits, ruinous on a loaded machine). This sets the calling
            # thread's OpenMP/MKL thread count and torch's global one, which the caller
            # restores when the call ends (torch path only; the compiled kernel sets nothing).
            torch.set_num_threads(1)
            w = local.w = make_work()
        return fn(i, w)

    if pool is None:
        return [one(i) for i in range(rows)]
    return list(pool.map(one, range(rows)))


def full_vocab(
    ref_logits,
    cand_logits,
    next_tokens=None,
    *,
    k: int = 10,
    top_k_out: int = 0,
    device=None,
    chunk_bytes: int | None = None,
    check_finite: bool = True,
    threads: int | None = None,
    backend: str = "auto",
) -> dict[str, np.ndarray]:
    """Per-position metrics from two full-vocabulary logit arrays ``[N, V]``.

    ``ref_logits``/``cand_logits`` may be numpy arrays (memory maps included) or torch
    tensors of any float dtype (bf16/f16/f32/f64; stored bf16 bits: `bfloat16_view`); they
    are upcast to float64 a tile (kernel: 4 values) at a time and never copied whole.
    ``next_tokens`` ([N] ints, the teacher-forced tokens) enables the token metrics
    (``p_ref_token``, ``p_cand_token``, ``delta_p``, ``nll_ref``, ``nll_cand``); without
    it those are NaN. ``k`` is the top-K of ``topk_overlap`` (top-K
    sets with the lowest id first on ties). ``device`` (e.g. ``"cuda"``) moves each chunk
    there; the results always come back as numpy arrays.

    ``top_k_out`` > 0 also returns each side's top-``top_k_out`` from the same pass
    (``topk_ids_ref``/``topk_ids_cand`` [N, top_k_out], descending, lowest id first on
    ties; ``topk_logprobs_ref``/``topk_logprobs_cand`` float64, normalised over the full
    vocabulary), as `row_stats` would give them, without a second pass over the logits.

    ``threads``: CPU worker threads (default `default_threads()`, the CPUs this process may
    run on; torch's own thread setting is not read, and is left as it was); ``backend``:
    one of `BACKENDS`. The compiled kernel reads float32/bfloat16/float16 rows in place
    (no float32 or float64 copy of a chunk) with a few KB of scratch per thread.

    Memory: on the torch CPU path each worker thread holds two
    float64 rows of V plus ~1.5 MB of tiles, whatever N; ``chunk_bytes`` bounds the rows
    handed out at once. On other devices a chunk of rows is processed batched, about six
    float64 ``[rows, V]`` temporaries within ``chunk_bytes``. Default: `default_chunk_bytes`
    (64 MiB on the CPU; on a GPU a quarter of its free memory, at most 4 GiB). Per-row results do not depend
    on the chunking.

    Raises ``NonFiniteLogits`` naming the first row with NaN/inf.

    Two numpy float32/float16 arrays on the CPU with the kernel built take `_full_vocab_numpy`:
    the same kernel and formulas in numpy, without importing torch (~2-3 s of a short
    command's start on a 2-core machine); its figures equal this path's to ~1e-14 (log,
    log1p and exp of two libraries, each within an ulp: tests/test_metrics.py).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend != "torch" and _numpy_native(ref_logits, cand_logits, device):
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        return _full_vocab_numpy(ref_logits, cand_logits, next_tokens, k=k, top_k_out=top_k_out, chunk_bytes=chunk_bytes,
                                 check_finite=check_finite, threads=threads,
                                 isa="scalar" if backend == "native-scalar" else "auto")
    import torch

    zp_all, zq_all, y_all = _checked_pair(ref_logits, cand_logits, next_tokens, k, top_k_out)
    n, vocab = zp_all.shape
    out = _empty_outputs(n, top_k_out)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    if n == 0:
        return out
    dev = torch.device(device) if device is not None else zp_all.device
    plan = _plan_pass(zp_all, zq_all, dev, backend, threads, chunk_bytes, k, top_k_out)
    torch_threads = torch.get_num_threads()  # restored after the torch per-row path
    pool = _row_pool(n, dev, plan.n_threads) if plan.per_row else None
    local = threading.local()
    try:
        for a in range(0, n, _chunk_rows(plan, pool, zp_all, zq_all, dev, chunk_bytes, k, top_k_out)):
            b = min(n, a + plan.step)
            zp = zp_all[a:b].to(dev)
            zq = zq_all[a:b].to(dev)
            tops = _chunk_tops_and_sums(zp, zq, plan, backend, pool, local)
            _write_chunk(out, a, b, zp, zq, tops, y_all, dev, k, plan.kk, top_k_out, check_finite)
    finally:
        if pool is not None:
            pool.shutdown()
        if plan.per_row:
            torch.set_num_threads(torch_threads)
    return out


def _numpy_native(ref_logits, cand_logits, device) -> bool:
    """Whether `full_vocab` can run the compiled kernel on these inputs without torch: numpy
    arrays of one dtype the kernel reads in place, on the CPU."""
    if device is not None and str(device) != "cpu":
        return False
    return (isinstance(ref_logits, np.ndarray) and isinstance(cand_logits, np.ndarray)
            and ref_logits.dtype == cand_logits.dtype and ref_logits.shape == cand_logits.shape
            and kernel.supports(ref_logits) and kernel.supports(cand_logits) and kernel.available())


def _check_k(k: int, top_k_out: int, vocab: int) -> None:
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be in [1, V={vocab}]")
    if not 0 <= top_k_out <= vocab:
        raise ValueError(f"top_k_out={top_k_out} must be in [0, V={vocab}]")


def _check_next_tokens(y_all, n: int, vocab: int) -> None:
    if tuple(y_all.shape) != (n,):
        raise ValueError(f"next_tokens must have shape [{n}], got {tuple(y_all.shape)}")
    if n and (int(y_all.min()) < 0 or int(y_all.max()) >= vocab):
        raise ValueError(f"next_tokens out of range [0, {vocab})")


def _full_vocab_numpy(zp_all: np.ndarray, zq_all: np.ndarray, next_tokens, *, k: int, top_k_out: int,
                      chunk_bytes: int | None, check_finite: bool, threads: int | None, isa: str) -> dict[str, np.ndarray]:
    """`full_vocab` on numpy rows through the compiled kernel: the torch path's kernel call and
    formulas (`_write_chunk`) in numpy float64, chunked as that path chunks."""
    n, vocab = zp_all.shape
    _check_k(k, top_k_out, vocab)
    y_all = None
    if next_tokens is not None:
        y_all = np.asarray(next_tokens).astype(np.int64, copy=False)
        _check_next_tokens(y_all, n, vocab)
    out = _empty_outputs(n, top_k_out)
    kk = min(vocab, max(k, 2, top_k_out))
    nt = threads or default_threads()
    step = max(nt, int((chunk_bytes or (64 << 20)) // (16 * max(k, 2, top_k_out) + 128)))
    for a in range(0, n, step):
        b = min(n, a + step)
        zp, zq = zp_all[a:b], zq_all[a:b]
        r = kernel.pair_rows(zp, zq, kk, nt, isa)
        _write_chunk_numpy(out, a, b, zp, zq, r, y_all, k, kk, top_k_out, check_finite)
    return out


def _write_chunk_numpy(out: dict, a: int, b: int, zp: np.ndarray, zq: np.ndarray, r: dict, y_all, k: int, kk: int,
                       top_k_out: int, check_finite: bool) -> None:
    """`_write_chunk` in numpy (the same formulas, term for term; the reasons are there)."""
    ids_p, ids_q = r["top_ids"][:, 0], r["top_ids"][:, 1]
    vals_p, vals_q = r["top_vals"][:, 0], r["top_vals"][:, 1]
    mp, mq = vals_p[:, 0], vals_q[:, 0]
    s_p, a_p, s_q, a_q, d_p, d_q, g, s_d = r["sums"].T
    if check_finite:
        bad_p = ~(np.isfinite(mp) & np.isfinite(a_p))
        bad_q = ~(np.isfinite(mq) & np.isfinite(a_q))
        for i in np.nonzero(bad_p | bad_q)[0].tolist():
            for name, z, bad in (("reference", zp, bad_p), ("candidate", zq, bad_q)):
                if bad[i]:
                    nf = ~np.isfinite(z[i])
                    if nf.any():
                        raise NonFiniteLogits(name, a + i, float(z[i][nf][0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        ls_p, ls_q = np.log(s_p), np.log(s_q)
        ent_p = ls_p - a_p / s_p
        ent_q = ls_q - a_q / s_q
        x = s_d / s_q
        c = np.where(np.abs(x) <= 0.5, np.log1p(x), ls_p - ls_q)
    kl = np.maximum(d_p / s_p - c, 0.0)
    kl_rev = np.maximum(c - d_q / s_q, 0.0)
    jsd = LN2 - 0.5 * (ent_p + ent_q) - 0.5 * (g / s_p) + ls_p
    jsd = np.minimum(np.clip(jsd, 0.0, LN2), 0.25 * (kl + kl_rev))
    lp_top = (vals_p[:, :2] - mp[:, None]) - ls_p[:, None]
    margin = np.exp(lp_top[:, 0]) - np.exp(lp_top[:, 1]) if kk >= 2 else np.exp(lp_top[:, 0])
    kp, kq = ids_p[:, :k], ids_q[:, :k]
    overlap = (kp[:, :, None] == kq[:, None, :]).any(-1).sum(-1).astype(np.float64) / k
    t1p, t1q = ids_p[:, 0], ids_q[:, 0]
    sl = slice(a, b)
    out["kl_nats"][sl] = kl
    out["kl_rev_nats"][sl] = kl_rev
    out["jsd_nats"][sl] = jsd
    out["top1_ref"][sl] = t1p
    out["top1_cand"][sl] = t1q
    out["top1_match"][sl] = t1p == t1q
    out["margin_ref"][sl] = margin
    out["entropy_ref"][sl] = np.maximum(ent_p, 0.0)
    out["entropy_cand"][sl] = np.maximum(ent_q, 0.0)
    out["topk_overlap"][sl] = overlap
    if top_k_out:
        out["topk_ids_ref"][sl] = ids_p[:, :top_k_out]
        out["topk_ids_cand"][sl] = ids_q[:, :top_k_out]
        out["topk_logprobs_ref"][sl] = (vals_p[:, :top_k_out] - mp[:, None]) - ls_p[:, None]
        out["topk_logprobs_cand"][sl] = (vals_q[:, :top_k_out] - mq[:, None]) - ls_q[:, None]
    if y_all is not None:
        rows = np.arange(b - a)
        y = y_all[a:b]
        lpy = (zp[rows, y].astype(np.float64) - mp) - ls_p
        lqy = (zq[rows, y].astype(np.float64) - mq) - ls_q
        out["p_ref_token"][sl] = np.exp(lpy)
        out["p_cand_token"][sl] = np.exp(lqy)
        out["delta_p"][sl] = np.exp(lqy) - np.exp(lpy)
        out["nll_ref"][sl] = -lpy
        out["nll_cand"][sl] = -lqy


def _checked_pair(ref_logits, cand_logits, next_tokens, k: int, top_k_out: int):
    """The two sides as tensors ``[N, V]`` and the next tokens (None, or int64 ``[N]`` in
    range), after the shape and range checks of :func:`full_vocab`."""
    import torch

    zp_all = _as_tensor(ref_logits)
    zq_all = _as_tensor(cand_logits)
    if zp_all.dim() != 2 or zq_all.shape != zp_all.shape:
        raise ValueError(
            f"reference and candidate logits must both be [N, V]; got {tuple(zp_all.shape)} and {tuple(zq_all.shape)}"
        )
    n, vocab = zp_all.shape
    _check_k(k, top_k_out, vocab)
    y_all = None
    if next_tokens is not None:
        y_all = torch.as_tensor(np.asarray(next_tokens), dtype=torch.int64)
        _check_next_tokens(y_all, n, vocab)
    return zp_all, zq_all, y_all


def _empty_outputs(n: int, top_k_out: int) -> dict[str, np.ndarray]:
    """:func:`full_vocab`'s result arrays for ``n`` rows (token metrics NaN until filled)."""
    out = {
        "kl_nats": np.empty(n, np.float64),
        "kl_rev_nats": np.empty(n, np.float64),
        "jsd_nats": np.empty(n, np.float64),
        "top1_ref": np.empty(n, np.int64),
        "top1_cand": np.empty(n, np.int64),
        "top1_match": np.empty(n, bool),
        "margin_ref": np.empty(n, np.float64),
        "p_ref_token": np.full(n, np.nan),
        "p_cand_token": np.full(n, np.nan),
        "delta_p": np.full(n, np.nan),
        "nll_ref": np.full(n, np.nan),
        "nll_cand": np.full(n, np.nan),
        "entropy_ref": np.empty(n, np.float64),
        "entropy_cand": np.empty(n, np.float64),
        "topk_overlap": np.empty(n, np.float64),
    }
    if top_k_out:
        for side in ("ref", "cand"):
            out[f"topk_ids_{side}"] = np.empty((n, top_k_out), np.int64)
            out[f"topk_logprobs_{side}"] = np.empty((n, top_k_out), np.float64)
    return out


@dataclass
class _Pass:
    """How :func:`full_vocab` runs: the compiled kernel (``native``), torch a row per worker
    thread (``per_row``, tiles of ``tile`` values) or torch batched over a chunk; ``kk`` the
    size of the one exact top search; ``step`` the rows per chunk (set by _chunk_rows)."""

    native: bool
    per_row: bool
    n_threads: int
    tile: int
    kk: int
    step: int = 0


def _plan_pass(zp_all, zq_all, dev, backend: str, threads: int | None, chunk_bytes: int | None, k: int, top_k_out: int) -> _Pass:
    vocab = zp_all.shape[1]
    native = _use_native(backend, dev, zp_all, zq_all)
    per_row = dev.type == "cpu" and _CPU_PER_ROW and not native
    # One exact top-kk search serves top-1, the margin, the top-k overlap and the stored
    # top-K: its order (value desc, id asc) makes every prefix the top of that size.
    kk = min(vocab, max(k, 2, top_k_out))
    return _Pass(native, per_row, threads or default_threads(), min(vocab, _CPU_TILE) if per_row else vocab, kk)


def _chunk_rows(plan: _Pass, pool, zp_all, zq_all, dev, chunk_bytes: int | None, k: int, top_k_out: int) -> int:
    """Rows per chunk (also kept in ``plan.step``): within ``chunk_bytes`` (default
    `default_chunk_bytes`) of what the pass holds per row."""
    vocab = zp_all.shape[1]
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(dev)
    nw = pool._max_workers if pool is not None else 1
    if plan.native and dev.type == "cpu" and zp_all.device.type == "cpu" and zq_all.device.type == "cpu":
        # The kernel reads the rows in place (views, memory maps): a call holds only its
        # outputs (~16 kk + 100 bytes a row), so a chunk's worth of those, not of rows. Fewer,
        # larger calls: one join of the kernel's threads per call, which on a shared machine
        # waits for the slowest thread's last row.
        step = max(plan.n_threads, int(chunk_bytes // (16 * max(k, 2, top_k_out) + 128)))
    elif plan.native:
        step = max(plan.n_threads, int(chunk_bytes // max(1, vocab * (zp_all.element_size() + zq_all.element_size()))))
    elif plan.per_row:
        in_bytes = vocab * (zp_all.element_size() + zq_all.element_size())
        step = max(nw, int(chunk_bytes // max(1, in_bytes)))
    else:
        step = _rows_per_chunk(vocab, chunk_bytes)
    plan.step = step
    return step


def _chunk_tops_and_sums(zp, zq, plan: _Pass, backend: str, pool, local):
    """Each side's exact top-``kk`` (ids, raw logits) and the eight pair sums of one chunk
    (kernel, per-row torch or batched torch)."""
    import torch

    kk, tile = plan.kk, plan.tile
    if plan.native:
        r = kernel.pair_rows(zp, zq, kk, plan.n_threads, "scalar" if backend == "native-scalar" else "auto")
        ids_p, ids_q = (torch.from_numpy(r["top_ids"][:, j]) for j in (0, 1))
        vals_p, vals_q = (torch.from_numpy(r["top_vals"][:, j]) for j in (0, 1))
        sums = torch.from_numpy(r["sums"].T.copy())
    elif plan.per_row:

        def one_row(i, w):
            zpi, zqi = zp[i], zq[i]
            ip, vp = _row_top(zpi, kk, tile)
            iq, vq = _row_top(zqi, kk, tile)
            sums = _pair_sums_row(zpi, zqi, float(vp[0]), float(vq[0]), w, tile)
            return ip, vp, iq, vq, sums

        vocab = zp.shape[1]
        rows = _map_rows(pool, local, one_row, zp.shape[0], lambda: _Work(1, vocab, tile, zp.device, True))
        ids_p, vals_p, ids_q, vals_q = (torch.stack([r[j] for r in rows]) for j in range(4))
        sums = torch.tensor([r[4] for r in rows], dtype=torch.float64).T
    else:
        ids_p, vals_p = _topk_candidates(zp, kk)
        ids_q, vals_q = _topk_candidates(zq, kk)
        sums = _pair_sums_batched(zp, zq, vals_p[:, 0].contiguous(), vals_q[:, 0].contiguous())
    return ids_p, vals_p, ids_q, vals_q, sums


def _write_chunk(out: dict, a: int, b: int, zp, zq, tops, y_all, dev, k: int, kk: int, top_k_out: int, check_finite: bool) -> None:
    """Rows ``a:b`` of every metric from the chunk's tops and pair sums."""
    import torch

    ids_p, vals_p, ids_q, vals_q, sums = tops
    mp, mq = vals_p[:, 0], vals_q[:, 0]
    s_p, a_p, s_q, a_q, d_p, d_q, g, s_d = sums
    if check_finite:
        bad_p = ~(torch.isfinite(mp) & torch.isfinite(a_p))
        bad_q = ~(torch.isfinite(mq) & torch.isfinite(a_q))
        if bool((bad_p | bad_q).any()):
            _raise_nonfinite([("reference", zp, bad_p), ("candidate", zq, bad_q)], a)
    ls_p, ls_q = torch.log(s_p), torch.log(s_q)
    ent_p = ls_p - a_p / s_p  # -sum p lP, lP = a_p - ln s_p
    ent_q = ls_q - a_q / s_q
    # c = ln(s_p/s_q) = log1p(S_d/s_q), S_d = sum (e_p - e_q) summed directly: its
    # rounding error scales with sum |e_p - e_q| (small for near-identical rows), not
    # with s_p + s_q as ln s_p - ln s_q's does; |x| <= 1/2 bounds log1p's condition.
    x = s_d / s_q
    c = torch.where(x.abs() <= 0.5, torch.log1p(x), ls_p - ls_q)
    kl = (d_p / s_p - c).clamp_min(0.0)  # sum p (lP - lQ) = sum p d - (ln s_p - ln s_q)
    kl_rev = (c - d_q / s_q).clamp_min(0.0)
    # JSD = H(M) - (H_P + H_Q)/2 with H(M) = ln 2 - 1/2 sum (p+q) ln(p+q),
    # sum (p+q) ln(p+q) = G/s_p - 2 ln s_p. Bounded by ln 2 and by (KL + KL_rev)/4
    # (convexity: KL(P||M) <= KL(P||Q)/2), which also makes identical rows give 0.
    jsd = LN2 - 0.5 * (ent_p + ent_q) - 0.5 * (g / s_p) + ls_p
    jsd = torch.minimum(jsd.clamp(0.0, LN2), 0.25 * (kl + kl_rev))
    # Top-1 (lowest id on ties) and margin from the exact top-K search.
    lp_top = (vals_p[:, :2] - mp[:, None]) - ls_p[:, None]
    margin = lp_top[:, 0].exp() - lp_top[:, 1].exp() if kk >= 2 else lp_top[:, 0].exp()
    kp, kq = ids_p[:, :k], ids_q[:, :k]
    overlap = (kp[:, :, None] == kq[:, None, :]).any(-1).sum(-1).to(torch.float64) / k
    t1p, t1q = ids_p[:, 0], ids_q[:, 0]
    sl = slice(a, b)
    out["kl_nats"][sl] = kl.cpu().numpy()
    out["kl_rev_nats"][sl] = kl_rev.cpu().numpy()
    out["jsd_nats"][sl] = jsd.cpu().numpy()
    out["top1_ref"][sl] = t1p.cpu().numpy()
    out["top1_cand"][sl] = t1q.cpu().numpy()
    out["top1_match"][sl] = (t1p == t1q).cpu().numpy()
    out["margin_ref"][sl] = margin.cpu().numpy()
    out["entropy_ref"][sl] = ent_p.clamp_min(0.0).cpu().numpy()
    out["entropy_cand"][sl] = ent_q.clamp_min(0.0).cpu().numpy()
    out["topk_overlap"][sl] = overlap.cpu().numpy()
    if top_k_out:
        out["topk_ids_ref"][sl] = ids_p[:, :top_k_out].cpu().numpy()
        out["topk_ids_cand"][sl] = ids_q[:, :top_k_out].cpu().numpy()
        out["topk_logprobs_ref"][sl] = ((vals_p[:, :top_k_out] - mp[:, None]) - ls_p[:, None]).cpu().numpy()
        out["topk_logprobs_cand"][sl] = ((vals_q[:, :top_k_out] - mq[:, None]) - ls_q[:, None]).cpu().numpy()
    if y_all is not None:
        y = y_all[a:b].to(dev)[:, None]
        # lP[y] = (z[y] - max) - ln s, as log_softmax computes it.
        lpy = (zp.gather(1, y)[:, 0].to(torch.float64) - mp) - ls_p
        lqy = (zq.gather(1, y)[:, 0].to(torch.float64) - mq) - ls_q
        out["p_ref_token"][sl] = lpy.exp().cpu().numpy()
        out["p_cand_token"][sl] = lqy.exp().cpu().numpy()
        out["delta_p"][sl] = (lqy.exp() - lpy.exp()).cpu().numpy()
        out["nll_ref"][sl] = (-lpy).cpu().numpy()
        out["nll_cand"][sl] = (-lqy).cpu().numpy()


def row_stats(logits, *, k: int = 0, device=None, chunk_bytes: int = 256 << 20, threads: int | None = None):
    """Per-row exact quantities of one side, for storing top-K instead of full logits.

    Returns ``logsumexp`` (of the raw logits), ``entropy`` (nats) and, when ``k > 0``,
    ``topk_ids`` [N, k] (descending probability, lowest id first on ties), ``topk_logprobs``
    [N, k] (float64, normalised over the full vocabulary) and ``tail_mass`` = 1 - sum of
    the top-K probabilities (>= 0). Raises ``NonFiniteLogits`` (side ``logits``) naming the
    first row with NaN/inf. Memory as in `full_vocab`, independent of N. ``threads``: CPU
    worker threads (default `default_threads()`; torch's setting is restored afterwards).
    """
    import torch

    z_all = _as_tensor(logits)
    if z_all.dim() != 2:
        raise ValueError(f"logits must be [N, V]; got {tuple(z_all.shape)}")
    n, vocab = z_all.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"k={k} must be in [0, V={vocab}]")
    lse = np.empty(n, np.float64)
    ent = np.empty(n, np.float64)
    ids = np.empty((n, k), np.int64)
    lps = np.empty((n, k), np.float64)
    dev = torch.device(device) if device is not None else z_all.device
    per_row = dev.type == "cpu" and _CPU_PER_ROW
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    torch_threads = torch.get_num_threads()  # restored after the per-row path
    pool = _row_pool(n, dev, threads or default_threads()) if per_row and n else None
    local = threading.local()
    nw = pool._max_workers if pool is not None else 1
    if per_row:
        tile = min(vocab, _CPU_TILE)
        step = max(nw, int(chunk_bytes // max(1, vocab * z_all.element_size())))
    else:
        tile = vocab
        step = max(1, int(chunk_bytes // (vocab * 8 * 3)))
    try:
        for a in range(0, n, step):
            b = min(n, a + step)
            z = z_all[a:b].to(dev)
            if per_row:

                def one_row(i, w):
                    ti, tv = _row_top(z[i], max(k, 1), tile)
                    return ti, tv, _side_sums_row(z[i], float(tv[0]), w, tile)

                rows = _map_rows(pool, local, one_row, b - a, lambda: _Work(1, vocab, tile, dev, False))
                top_i, top_v = (torch.stack([r[j] for r in rows]) for j in range(2))
                sums = torch.tensor([r[2] for r in rows], dtype=torch.float64).T
            else:
                top_i, top_v = _topk_candidates(z, max(k, 1))
                sums = _side_sums_batched(z, top_v[:, 0].contiguous())
            m = top_v[:, 0]
            s, sa = sums
            bad = ~(torch.isfinite(m) & torch.isfinite(sa))
            if bool(bad.any()):
                _raise_nonfinite([("logits", z, bad)], a)
            ls = torch.log(s)
            lse[a:b] = (m + ls).cpu().numpy()
            ent[a:b] = (ls - sa / s).clamp_min(0.0).cpu().numpy()
            if k:
                ids[a:b] = top_i.cpu().numpy()
                lps[a:b] = ((top_v - m[:, None]) - ls[:, None]).cpu().numpy()
    finally:
        if pool is not None:
            pool.shutdown()
        if per_row:
            torch.set_num_threads(torch_threads)
    res = {"logsumexp": lse, "entropy": ent}
    if k:
        res["topk_ids"] = ids
        res["topk_logprobs"] = lps
        res["tail_mass"] = np.maximum(1.0 - np.exp(lps).sum(1), 0.0)
    return res


def topk(
    ref_ids,
    ref_logprobs,
    cand_ids,
    cand_logprobs,
    vocab_size: int,
    eps: float = 1e-12,
) -> dict[str, np.ndarray]:
    """The seed report's top-K approximation of KL(P_ref || P_cand), per position.

    Inputs are ``[N, K]`` token ids and log-probabilities (normalised over the full
    vocabulary, as servers return them). With K_P, K_Q the two top-K sets:

        reference_top_mass = sum_{i in K_P} p_i;   tail_P = max(1 - reference_top_mass, 0)
        candidate_top_mass = sum_{j in K_Q} q_j;   tail_Q = max(1 - candidate_top_mass, 0)
        qhat_i = q_i if i in K_Q else tail_Q / (V - K)
        tail bucket of Q = max(1 - sum_{i in K_P} qhat_i, 0)
        KL ~ sum_{i in K_P} p_i (ln max(p_i, eps) - ln max(qhat_i, eps))
             + tail_P (ln max(tail_P, eps) - ln max(tailbucket_Q, eps))

    plus ``shared_tokens`` = |K_P & K_Q|, ``shared_reference_mass`` = sum_{K_P & K_Q} p,
    ``shared_candidate_mass`` = sum_{K_P & K_Q} q, ``top1_match`` (highest logprob of each
    side, lowest id on ties) and ``kl_bits``. Identical inputs give exactly 0. Padding:
    ids < 0 mark absent entries (a server that returned fewer than K) and are ignored.
    """
    ref_ids = np.asarray(ref_ids, dtype=np.int64)
    cand_ids = np.asarray(cand_ids, dtype=np.int64)
    lp = np.asarray(ref_logprobs, dtype=np.float64)
    lq = np.asarray(cand_logprobs, dtype=np.float64)
    if ref_ids.ndim != 2 or lp.shape != ref_ids.shape or lq.shape != cand_ids.shape or cand_ids.shape[0] != ref_ids.shape[0]:
        raise ValueError(
            f"top-K inputs must be [N, K] with matching shapes; got ids {ref_ids.shape}/{cand_ids.shape},"
            f" logprobs {lp.shape}/{lq.shape}"
        )
    # rows in blocks of TOPK_BLOCK_ENTRIES entries: memory bounded at any K (up to V)
    parts = [_topk_block(ref_ids[s], lp[s], cand_ids[s], lq[s], vocab_size, eps)
             for s in topk_row_blocks(ref_ids.shape[0], max(ref_ids.shape[1], cand_ids.shape[1]))]
    if len(parts) == 1:
        return parts[0]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _topk_block(ref_ids, lp, cand_ids, lq, vocab_size: int, eps: float) -> dict[str, np.ndarray]:
    """`topk` on one block of rows."""
    if not (np.isfinite(lp[ref_ids >= 0]).all() and np.isfinite(lq[cand_ids >= 0]).all()):
        raise ValueError("top-K logprobs contain NaN/inf")
    n, k = ref_ids.shape
    valid_p = ref_ids >= 0
    valid_q = cand_ids >= 0
    p = np.where(valid_p, np.exp(lp), 0.0)
    q = np.where(valid_q, np.exp(lq), 0.0)
    base_mass = p.sum(1)
    cand_mass = q.sum(1)
    tail_p = np.maximum(1.0 - base_mass, 0.0)
    tail_q = np.maximum(1.0 - cand_mass, 0.0)
    k_q = valid_q.sum(1)
    # For each reference top-K id: is it in the candidate's top-K, and with which q?
    in_q, q_at_p = _lookup(ref_ids, valid_p, cand_ids, valid_q, q)
    denom = np.maximum(vocab_size - k_q, 1)
    qhat = np.where(in_q, q_at_p, (tail_q / denom)[:, None])
    qhat = np.where(valid_p, qhat, 0.0)
    tail_bucket_q = np.maximum(1.0 - qhat.sum(1), 0.0)
    terms = np.where(valid_p, p * (np.log(np.maximum(p, eps)) - np.log(np.maximum(qhat, eps))), 0.0)
    kl = terms.sum(1) + tail_p * (np.log(np.maximum(tail_p, eps)) - np.log(np.maximum(tail_bucket_q, eps)))
    kl = np.maximum(kl, 0.0)
    shared = in_q & valid_p
    # Top-1 of each side: highest logprob, lowest id on ties.
    top1_p = _top1_of(ref_ids, np.where(valid_p, lp, -np.inf))
    top1_q = _top1_of(cand_ids, np.where(valid_q, lq, -np.inf))
    return {
        "kl_nats": kl,
        "kl_bits": kl / LN2,
        "reference_top_mass": base_mass,
        "candidate_top_mass": cand_mass,
        "shared_tokens": shared.sum(1).astype(np.int64),
        "shared_reference_mass": np.where(shared, p, 0.0).sum(1),
        "shared_candidate_mass": np.where(shared, q_at_p, 0.0).sum(1),
        "top1_match": top1_p == top1_q,
        "top1_ref": top1_p,
        "top1_cand": top1_q,
    }


# Top-K comparisons (the seed estimate here, the intervals in bounds.py) go in row blocks of
# at most this many entries per side: memory bounded at any K, up to V.
TOPK_BLOCK_ENTRIES = 1 << 20


def topk_row_blocks(n_rows: int, k: int, entries: int = TOPK_BLOCK_ENTRIES):
    """Row slices of at most ``entries`` top-K entries each (at least one row)."""
    step = max(1, entries // max(1, k))
    return [slice(a, min(a + step, n_rows)) for a in range(0, n_rows, step)] or [slice(0, 0)]


def _lookup(ref_ids, valid_p, cand_ids, valid_q, q):
    """Per row: is each valid reference id among the row's valid candidate ids (``in_q``
    [N, K]), and the candidate's probability there (``q_at_p``, 0 elsewhere).

    By one sort of row-offset keys and a binary search: O(N K log(N K)) time and O(N K)
    memory (a [N, K, K] comparison is 17 GB of float64 at K = 1,024). Top-K ids of a row are
    distinct, so there is at most one match."""
    n, k = ref_ids.shape
    kc = cand_ids.shape[1]
    if n == 0 or k == 0 or kc == 0:
        return np.zeros((n, k), bool), np.zeros((n, k))
    span = int(max(ref_ids.max(), cand_ids.max(), 0)) + 2  # ids < span - 1; span - 1 marks absent
    off = np.arange(n, dtype=np.int64)[:, None] * span
    ckey = np.where(valid_q, cand_ids, span - 1) + off
    order = np.argsort(ckey, axis=1, kind="stable")
    ckey = np.take_along_axis(ckey, order, 1).ravel()  # sorted across rows too: rows are offset
    qs = np.take_along_axis(q, order, 1).ravel()
    rkey = (ref_ids + off).ravel()
    at = np.minimum(np.searchsorted(ckey, rkey), ckey.size - 1)
    in_q = ((ckey[at] == rkey) & valid_p.ravel()).reshape(n, k)
    # an absent candidate entry (key span - 1 of its row) never matches a valid reference id
    return in_q, np.where(in_q, qs[at].reshape(n, k), 0.0)


def _top1_of(ids: np.ndarray, lps: np.ndarray) -> np.ndarray:
    best = lps.max(1, keepdims=True)
    cand = np.where(lps == best, ids, np.iinfo(np.int64).max)
    return cand.min(1)
