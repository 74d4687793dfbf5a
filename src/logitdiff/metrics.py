"""The metrics of DESIGN.md, vectorised and chunked. Pure: arrays in, arrays out, no I/O.

Full-vocabulary metrics (`full_vocab`) run on torch tensors so the same code path serves
CPU and GPU; numpy inputs are wrapped without a copy. Everything is computed in float64
after ``log_softmax`` of the captured logits, a row (or chunk of rows) and a tile of columns at
a time, so that ``[N, V]`` float64 is never materialised (V = 248,320 is a real vocabulary).
Each side is exponentiated once and one log is taken (of p + q); KL is accumulated from
the shift-invariant differences of the logits, not as a difference of entropies.

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
import warnings
from typing import Mapping

import numpy as np

from .errors import LogitdiffError

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

TOPK_FIELDS = (
    "kl_nats",
    "kl_bits",
    "baseline_top_mass",
    "candidate_top_mass",
    "shared_tokens",
    "shared_baseline_mass",
    "shared_candidate_mass",
    "top1_match",
)


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


def _rows_per_chunk(vocab: int, budget_bytes: int) -> int:
    # About six float64 [rows, V] temporaries are alive at once in the batched (GPU) path.
    return max(1, int(budget_bytes // (vocab * 8 * 6)))


# Float64 work on CPU runs one row at a time per worker thread, in column tiles of at most
# this many values: the tile temporaries (~1.5 MB) stay in a core's L2 cache, and an op of
# this size stays below torch's intra-op grain (32768), so the cores are used by the row
# workers, not by a fork/join per op (which stalls badly on a loaded machine).
_CPU_TILE = 32000
# Block width of the exact top-K candidate search (see `_topk_candidates`).
_BLOCK = 256
_TINY = float(np.finfo(np.float64).tiny)


def _tiles(vocab: int, tile: int) -> list[tuple[int, int]]:
    n = -(-vocab // tile)
    w = -(-vocab // n)
    return [(c, min(vocab, c + w)) for c in range(0, vocab, w)]


def _topk_candidates(z, kk: int):
    """The ``kk`` largest logits of each row of ``z`` [R, V] (any float dtype), by
    descending value and lowest id first on ties: (ids [R, kk] int64, values [R, kk] float64).

    Exact without sorting V values: the ``kk`` largest block maxima are ``kk`` distinct
    elements >= the kk-th largest block maximum t, so every top-kk element (ties included)
    is >= t and lies in a block whose maximum is >= t; only those blocks are searched.
    Works on the input dtype (the float64 upcast preserves order and ties).
    """
    import torch

    r, v = z.shape
    if v <= _BLOCK * max(8, 2 * kk):
        ids = torch.arange(v, device=z.device).expand(r, v)
        vals = z
    else:
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
    # ids ascend along each row, so a stable descending sort puts the lowest id first on ties.
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :kk]
    return ids.gather(1, order), vals.gather(1, order).to(torch.float64)


class _Work:
    """Float64 scratch of one worker: exp rows of both sides and four tile temporaries."""

    def __init__(self, rows: int, vocab: int, tile: int, device, pair: bool):
        import torch

        f = dict(dtype=torch.float64, device=device)
        self.rows, self.tile = rows, tile
        self.e = torch.empty(2 if pair else 1, rows, vocab, **f)
        self.t = torch.empty(4, rows * tile, **f)

    def tmp(self, i: int, r: int, n: int):
        return self.t[i, : r * n].view(r, n)


def _rowdot(x, y, out) -> None:
    import torch

    if x.shape[0] == 1:  # BLAS ddot: faster than a batched reduction for one row
        torch.dot(x[0], y[0], out=out[0])
    else:
        torch.linalg.vecdot(x, y, out=out)


def _shifted(z, m, out):
    """out = float64(z) - m[:, None]  (the upcast is exact; two cheap passes beat one
    mixed-dtype op)."""
    import torch

    if z.dtype == torch.float64:
        torch.sub(z, m[:, None], out=out)
    else:
        out.copy_(z)
        out.sub_(m[:, None])


def _side_sums(z, m, w: _Work, tile: int):
    """One side, rows [R, V] with row maxima m: [2, R] = (s, A) with a = z - m, e = exp(a),
    s = sum e, A = sum e*a. (log-sum-exp = m + ln s, entropy = ln s - A/s.)"""
    import torch

    r, v = z.shape
    bounds = _tiles(v, tile)
    acc = torch.empty(len(bounds), 2, r, dtype=torch.float64, device=z.device)
    for j, (c0, c1) in enumerate(bounds):
        a = w.tmp(0, r, c1 - c0)
        _shifted(z[:, c0:c1], m, a)
        e = w.tmp(1, r, c1 - c0)
        torch.exp(a, out=e)
        torch.sum(e, -1, out=acc[j, 0])
        _rowdot(e, a, acc[j, 1])
    return acc.sum(0)


def _pair_sums(zp, zq, mp, mq, w: _Work, tile: int):
    """Both sides, rows [R, V] with row maxima mp, mq. Returns [7, R]:
    s_p, A_p, s_q, A_q (as in `_side_sums`), D_p = sum e_p d, D_q = sum e_q d with
    d = a_p - a_q (shift-invariant, so KL is a sum of small terms, not a difference of
    entropies), and G = sum g ln g with g = e_p + (s_p/s_q) e_q = s_p (p + q).

    Two passes over V: exp of each side is computed once (kept in ``w.e``), ln once (of g).
    """
    import torch

    r, v = zp.shape
    bounds = _tiles(v, tile)
    acc = torch.empty(len(bounds), 7, r, dtype=torch.float64, device=zp.device)
    ep_all, eq_all = w.e[0, :r], w.e[1, :r]
    for j, (c0, c1) in enumerate(bounds):
        n = c1 - c0
        ap, aq, d = w.tmp(0, r, n), w.tmp(1, r, n), w.tmp(2, r, n)
        ep, eq = ep_all[:, c0:c1], eq_all[:, c0:c1]
        _shifted(zp[:, c0:c1], mp, ap)
        torch.exp(ap, out=ep)
        torch.sum(ep, -1, out=acc[j, 0])
        _rowdot(ep, ap, acc[j, 1])
        _shifted(zq[:, c0:c1], mq, aq)
        torch.exp(aq, out=eq)
        torch.sum(eq, -1, out=acc[j, 2])
        _rowdot(eq, aq, acc[j, 3])
        torch.sub(ap, aq, out=d)
        _rowdot(ep, d, acc[j, 4])
        _rowdot(eq, d, acc[j, 5])
    tot = acc[:, :6].sum(0)
    ratio = tot[0] / tot[2]
    for clamp in (False, True):
        for j, (c0, c1) in enumerate(bounds):
            n = c1 - c0
            g, lg = w.tmp(3, r, n), w.tmp(0, r, n)
            ep, eq = ep_all[:, c0:c1], eq_all[:, c0:c1]
            if r == 1:
                torch.add(ep, eq, alpha=float(ratio[0]), out=g)
            else:
                torch.addcmul(ep, eq, ratio[:, None], out=g)
            if clamp:
                g.clamp_min_(_TINY)
            torch.log(g, out=lg)
            _rowdot(g, lg, acc[j, 6])
        gl = acc[:, 6].sum(0)
        # g underflows to 0 only > ~745 nats below both maxima; then 0 * ln 0 = NaN and
        # the pass is redone with g >= tiny (each such term is then ~1e-305, i.e. 0).
        if clamp or bool(torch.isfinite(gl).all()) or not bool(torch.isfinite(tot).all()):
            break
    return torch.cat([tot, gl[None]], 0)


def _row_pool(n_rows: int, dev):
    """Worker threads for the per-row CPU path (torch releases the GIL inside ops)."""
    import torch

    if dev.type != "cpu":
        return None
    nw = min(torch.get_num_threads(), n_rows)
    if nw <= 1:
        return None
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(nw, thread_name_prefix="logitdiff-metrics")


def _map_rows(pool, fn, rows: int, make_work):
    """sums[:, i] = fn(i, work) for each row i, on the pool (thread-local scratch) or inline."""
    import threading

    local = threading.local()

    def one(i):
        w = getattr(local, "w", None)
        if w is None:
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
    device=None,
    chunk_bytes: int = 64 << 20,
    check_finite: bool = True,
) -> dict[str, np.ndarray]:
    """Per-position metrics from two full-vocabulary logit arrays ``[N, V]``.

    ``ref_logits``/``cand_logits`` may be numpy arrays (memory maps included) or torch
    tensors of any float dtype (bf16/f16/f32/f64); they are upcast to float64 a tile at a
    time and never copied whole. ``next_tokens`` ([N] ints, the teacher-forced tokens)
    enables the token metrics (``p_ref_token``, ``p_cand_token``, ``delta_p``, ``nll_ref``,
    ``nll_cand``); without it those are NaN. ``k`` is the top-K of ``topk_overlap`` (top-K
    sets with the lowest id first on ties). ``device`` (e.g. ``"cuda"``) moves each chunk
    there; the results always come back as numpy arrays.

    Memory: on CPU each worker thread (``torch.get_num_threads()`` of them) holds two
    float64 rows of V plus ~1.5 MB of tiles, whatever N; ``chunk_bytes`` bounds the rows
    handed out at once. On other devices a chunk of rows is processed batched, about six
    float64 ``[rows, V]`` temporaries within ``chunk_bytes``. Per-row results do not depend
    on the chunking.

    Raises ``NonFiniteLogits`` naming the first row with NaN/inf.
    """
    import torch

    zp_all = _as_tensor(ref_logits)
    zq_all = _as_tensor(cand_logits)
    if zp_all.dim() != 2 or zq_all.shape != zp_all.shape:
        raise ValueError(
            f"reference and candidate logits must both be [N, V]; got {tuple(zp_all.shape)} and {tuple(zq_all.shape)}"
        )
    n, vocab = zp_all.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be in [1, V={vocab}]")
    y_all = None
    if next_tokens is not None:
        y_all = torch.as_tensor(np.asarray(next_tokens), dtype=torch.int64)
        if y_all.shape != (n,):
            raise ValueError(f"next_tokens must have shape [{n}], got {tuple(y_all.shape)}")
        if n and (int(y_all.min()) < 0 or int(y_all.max()) >= vocab):
            raise ValueError(f"next_tokens out of range [0, {vocab})")

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
    if n == 0:
        return out
    dev = torch.device(device) if device is not None else zp_all.device
    per_row = dev.type == "cpu"
    pool = _row_pool(n, dev) if per_row else None
    nw = pool._max_workers if pool is not None else 1
    if per_row:
        tile = min(vocab, _CPU_TILE)
        in_bytes = vocab * (zp_all.element_size() + zq_all.element_size())
        step = max(nw, int(chunk_bytes // max(1, in_bytes)))
    else:
        tile = vocab
        step = _rows_per_chunk(vocab, chunk_bytes)
    kk = min(vocab, max(k, 2))
    try:
        for a in range(0, n, step):
            b = min(n, a + step)
            zp = zp_all[a:b].to(dev)
            zq = zq_all[a:b].to(dev)
            ids_p, vals_p = _topk_candidates(zp, kk)
            ids_q, vals_q = _topk_candidates(zq, kk)
            mp, mq = vals_p[:, 0].contiguous(), vals_q[:, 0].contiguous()
            if per_row:
                sums = torch.stack(
                    _map_rows(
                        pool,
                        lambda i, w: _pair_sums(zp[i : i + 1], zq[i : i + 1], mp[i : i + 1], mq[i : i + 1], w, tile)[:, 0],
                        b - a,
                        lambda: _Work(1, vocab, tile, dev, True),
                    ),
                    1,
                )
            else:
                sums = _pair_sums(zp, zq, mp, mq, _Work(b - a, vocab, tile, dev, True), tile)
            s_p, a_p, s_q, a_q, d_p, d_q, g = sums
            if check_finite:
                bad_p = ~(torch.isfinite(mp) & torch.isfinite(a_p))
                bad_q = ~(torch.isfinite(mq) & torch.isfinite(a_q))
                if bool((bad_p | bad_q).any()):
                    _raise_nonfinite([("reference", zp, bad_p), ("candidate", zq, bad_q)], a)
            ls_p, ls_q = torch.log(s_p), torch.log(s_q)
            ent_p = ls_p - a_p / s_p  # -sum p lP, lP = a_p - ln s_p
            ent_q = ls_q - a_q / s_q
            c = ls_p - ls_q
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
    finally:
        if pool is not None:
            pool.shutdown()
    return out


def row_stats(logits, *, k: int = 0, device=None, chunk_bytes: int = 256 << 20):
    """Per-row exact quantities of one side, for storing top-K instead of full logits.

    Returns ``logsumexp`` (of the raw logits), ``entropy`` (nats) and, when ``k > 0``,
    ``topk_ids`` [N, k] (descending probability, lowest id first on ties), ``topk_logprobs``
    [N, k] (float64, normalised over the full vocabulary) and ``tail_mass`` = 1 - sum of
    the top-K probabilities (>= 0). Raises ``NonFiniteLogits`` (side ``logits``) naming the
    first row with NaN/inf. Memory as in `full_vocab`, independent of N.
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
    per_row = dev.type == "cpu"
    pool = _row_pool(n, dev) if per_row and n else None
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
            top_i, top_v = _topk_candidates(z, max(k, 1))
            m = top_v[:, 0].contiguous()
            if per_row:
                sums = torch.stack(
                    _map_rows(
                        pool,
                        lambda i, w: _side_sums(z[i : i + 1], m[i : i + 1], w, tile)[:, 0],
                        b - a,
                        lambda: _Work(1, vocab, tile, dev, False),
                    ),
                    1,
                )
            else:
                sums = _side_sums(z, m, _Work(b - a, vocab, tile, dev, False), tile)
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

        baseline_top_mass  = sum_{i in K_P} p_i;   tail_P = max(1 - baseline_top_mass, 0)
        candidate_top_mass = sum_{j in K_Q} q_j;   tail_Q = max(1 - candidate_top_mass, 0)
        qhat_i = q_i if i in K_Q else tail_Q / (V - K)
        tail bucket of Q = max(1 - sum_{i in K_P} qhat_i, 0)
        KL ~ sum_{i in K_P} p_i (ln max(p_i, eps) - ln max(qhat_i, eps))
             + tail_P (ln max(tail_P, eps) - ln max(tailbucket_Q, eps))

    plus ``shared_tokens`` = |K_P & K_Q|, ``shared_baseline_mass`` = sum_{K_P & K_Q} p,
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
    eq = (ref_ids[:, :, None] == cand_ids[:, None, :]) & valid_p[:, :, None] & valid_q[:, None, :]
    in_q = eq.any(2)
    q_at_p = np.where(in_q, (eq * q[:, None, :]).sum(2), 0.0)
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
        "baseline_top_mass": base_mass,
        "candidate_top_mass": cand_mass,
        "shared_tokens": shared.sum(1).astype(np.int64),
        "shared_baseline_mass": np.where(shared, p, 0.0).sum(1),
        "shared_candidate_mass": np.where(shared, q_at_p, 0.0).sum(1),
        "top1_match": top1_p == top1_q,
        "top1_ref": top1_p,
        "top1_cand": top1_q,
    }


def _top1_of(ids: np.ndarray, lps: np.ndarray) -> np.ndarray:
    best = lps.max(1, keepdims=True)
    cand = np.where(lps == best, ids, np.iinfo(np.int64).max)
    return cand.min(1)


def bits(nats) -> np.ndarray:
    """The bits twin of a nats figure."""
    return np.asarray(nats, dtype=np.float64) / LN2


def as_bits(metrics: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{name_nats: x}`` -> ``{name_bits: x / ln 2}`` for every ``*_nats`` entry."""
    return {k[:-5] + "_bits": bits(v) for k, v in metrics.items() if k.endswith("_nats")}
