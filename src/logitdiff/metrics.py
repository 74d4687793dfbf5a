"""The metrics of DESIGN.md, vectorised and chunked. Pure: arrays in, arrays out, no I/O.

Full-vocabulary metrics (`full_vocab`) run on torch tensors so the same code path serves
CPU and GPU; numpy inputs are wrapped without a copy. Everything is computed in float64
after ``log_softmax`` of the captured logits, in row chunks so that ``[N, V]`` float64 is
never materialised (V = 248,320 is a real vocabulary).

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
    return torch.from_numpy(np.ascontiguousarray(x))


def _check_finite(side: str, x, row0: int) -> None:
    import torch

    # A float64 row sum of float32-or-narrower values is finite iff every value is:
    # one reduction pass instead of an isfinite() mask over [rows, V].
    s = x.sum(-1)
    if not bool(torch.isfinite(s).all()):
        r = int((~torch.isfinite(s)).nonzero()[0, 0])
        row = x[r]
        v = float(row[~torch.isfinite(row)][0])
        raise NonFiniteLogits(side, row0 + r, v)


def _rows_per_chunk(vocab: int, budget_bytes: int) -> int:
    # About six float64 [rows, V] temporaries are alive at once in the chunk body; small
    # chunks keep them in cache.
    return max(1, int(budget_bytes // (vocab * 8 * 8)))


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

    ``ref_logits``/``cand_logits`` may be numpy arrays or torch tensors of any float dtype
    (bf16/f16/f32/f64); they are upcast to float64 a chunk of rows at a time.
    ``next_tokens`` ([N] ints, the teacher-forced tokens) enables the token metrics
    (``p_ref_token``, ``p_cand_token``, ``delta_p``, ``nll_ref``, ``nll_cand``); without it
    those are NaN. ``k`` is the top-K of ``topk_overlap``. ``device`` (e.g. ``"cuda"``)
    moves each chunk there; the results always come back as numpy arrays.

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
    step = _rows_per_chunk(vocab, chunk_bytes)
    dev = torch.device(device) if device is not None else zp_all.device
    for a in range(0, n, step):
        b = min(n, a + step)
        zp = zp_all[a:b].to(dev, torch.float64)
        zq = zq_all[a:b].to(dev, torch.float64)
        if check_finite:
            _check_finite("reference", zp, a)
            _check_finite("candidate", zq, a)
        lp = torch.log_softmax(zp, dim=-1)
        lq = torch.log_softmax(zq, dim=-1)
        del zp, zq
        p = lp.exp()
        q = lq.exp()
        # Row-wise dot products (no [rows, V] temporaries): entropies and cross terms.
        ent_p = -torch.linalg.vecdot(p, lp)
        ent_q = -torch.linalg.vecdot(q, lq)
        kl = -ent_p - torch.linalg.vecdot(p, lq)  # sum p (lP - lQ)
        kl_rev = -ent_q - torch.linalg.vecdot(q, lp)  # sum q (lQ - lP)
        # JSD = 1/2 sum p (lP - lM) + 1/2 sum q (lQ - lM) = -(H_P + H_Q)/2 - 1/2 sum (p+q) lM,
        # lM = log((p + q)/2). Where p + q underflows to 0 the term is 0 * finite.
        m = p + q
        lm = torch.log(m.clamp_min(torch.finfo(torch.float64).tiny)) - LN2
        jsd = -0.5 * (ent_p + ent_q) - 0.5 * torch.linalg.vecdot(m, lm)
        del m, lm
        # Ties: torch.argmax returns the first maximal index, i.e. the lowest id.
        t1p = torch.argmax(lp, dim=-1)
        t1q = torch.argmax(lq, dim=-1)
        vp, kp = torch.topk(lp, max(k, 2) if vocab >= 2 else 1, dim=-1)
        kq = torch.topk(lq, k, dim=-1).indices
        margin = vp[:, 0].exp() - vp[:, 1].exp() if vocab >= 2 else vp[:, 0].exp()
        kp = kp[:, :k]
        overlap = (kp[:, :, None] == kq[:, None, :]).any(-1).sum(-1).to(torch.float64) / k
        sl = slice(a, b)
        out["kl_nats"][sl] = kl.clamp_min(0.0).cpu().numpy()
        out["kl_rev_nats"][sl] = kl_rev.clamp_min(0.0).cpu().numpy()
        out["jsd_nats"][sl] = jsd.clamp(0.0, LN2).cpu().numpy()
        out["top1_ref"][sl] = t1p.cpu().numpy()
        out["top1_cand"][sl] = t1q.cpu().numpy()
        out["top1_match"][sl] = (t1p == t1q).cpu().numpy()
        out["margin_ref"][sl] = margin.cpu().numpy()
        out["entropy_ref"][sl] = ent_p.clamp_min(0.0).cpu().numpy()
        out["entropy_cand"][sl] = ent_q.clamp_min(0.0).cpu().numpy()
        out["topk_overlap"][sl] = overlap.cpu().numpy()
        if y_all is not None:
            y = y_all[a:b].to(lp.device)[:, None]
            lpy = lp.gather(1, y)[:, 0]
            lqy = lq.gather(1, y)[:, 0]
            out["p_ref_token"][sl] = lpy.exp().cpu().numpy()
            out["p_cand_token"][sl] = lqy.exp().cpu().numpy()
            out["delta_p"][sl] = (lqy.exp() - lpy.exp()).cpu().numpy()
            out["nll_ref"][sl] = (-lpy).cpu().numpy()
            out["nll_cand"][sl] = (-lqy).cpu().numpy()
    return out


def row_stats(logits, *, k: int = 0, device=None, chunk_bytes: int = 256 << 20):
    """Per-row exact quantities of one side, for storing top-K instead of full logits.

    Returns ``logsumexp`` (of the raw logits), ``entropy`` (nats) and, when ``k > 0``,
    ``topk_ids`` [N, k] (descending probability, lowest id first on ties), ``topk_logprobs``
    [N, k] (float64, normalised over the full vocabulary) and ``tail_mass`` = 1 - sum of
    the top-K probabilities (>= 0).
    """
    import torch

    z_all = _as_tensor(logits)
    n, vocab = z_all.shape
    step = _rows_per_chunk(vocab, chunk_bytes)
    lse = np.empty(n, np.float64)
    ent = np.empty(n, np.float64)
    ids = np.empty((n, k), np.int64)
    lps = np.empty((n, k), np.float64)
    dev = torch.device(device) if device is not None else z_all.device
    for a in range(0, n, step):
        b = min(n, a + step)
        z = z_all[a:b].to(dev)
        _check_finite("logits", z, a)
        z = z.to(torch.float64)
        ls = torch.logsumexp(z, dim=-1)
        lp = z - ls[:, None]
        lse[a:b] = ls.cpu().numpy()
        ent[a:b] = (-(lp.exp() * lp).sum(-1)).clamp_min(0.0).cpu().numpy()
        if k:
            i, l = _topk_sorted(lp, k)
            ids[a:b] = i.cpu().numpy()
            lps[a:b] = l.cpu().numpy()
    res = {"logsumexp": lse, "entropy": ent}
    if k:
        res["topk_ids"] = ids
        res["topk_logprobs"] = lps
        res["tail_mass"] = np.maximum(1.0 - np.exp(lps).sum(1), 0.0)
    return res


def _topk_sorted(lp, k: int):
    """Top-k of each row, by descending value and ascending id on ties (deterministic)."""
    import torch

    vals, idx = torch.topk(lp, k, dim=-1, sorted=True)
    # Re-sort by (value desc, id asc): stable sort on id first, then on value.
    o = torch.argsort(idx, dim=-1, stable=True)
    idx, vals = idx.gather(1, o), vals.gather(1, o)
    o = torch.argsort(-vals, dim=-1, stable=True)
    return idx.gather(1, o), vals.gather(1, o)


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
