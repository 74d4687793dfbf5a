"""The compact reference store: what later candidates need to be compared with proven
bounds, at a fraction of the full store's size (docs/bounds.md, section 2).

Per position: the ``exact`` largest entries (ids + raw logits, with the row's max logit and
ln sum exp(z - max), so their log-probabilities are computed as the full path computes
them), the next ``band`` entries (ids + a ``bits``-wide code of the log-probability on the
row's band range), and of everything else the exact mass and the largest and smallest
log-probability; plus the exact log-probability of the teacher token and the entropy.

Spec: ``compact`` or ``compact:exact=E,band=B,bits=16`` (any subset). Ids are stored sorted
per row as gaps (uint16 where every gap of the chunk fits, else uint32) and the chunk file
is deflate-compressed, so the bytes per position depend on the data; bench/store_bench.py
measures them.

``encode`` (logits -> arrays) and ``decode`` (arrays -> :class:`bounds.CompactRows`) are pure;
``save_chunk``/``load_chunk`` are the only I/O, used by store.py.
"""

from __future__ import annotations

import io
import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..numerics.bounds import CompactRows
from ..errors import LogitdiffError

STORE_PREFIX = "compact"
CHUNK_SUFFIX = "compact.npz"
DEFAULT_EXACT = 512
DEFAULT_BAND = 5632
DEFAULT_BITS = 16
# Widening of every decoded box, in nats: the codes and the rest's extremes are computed
# in float64 from log-probabilities of magnitude <= ~1e3, whose rounding is < 1e-13 nats.
BOX_SLACK = 1e-12
ROW_FIELDS = ("max_logit", "log_sum", "band_top", "band_step", "band_mass", "rest_mass", "rest_max",
              "rest_min", "token_logp", "entropy")


@dataclass(frozen=True)
class CompactSpec:
    exact: int = DEFAULT_EXACT
    band: int = DEFAULT_BAND
    bits: int = DEFAULT_BITS

    @property
    def text(self) -> str:
        return f"{STORE_PREFIX}:exact={self.exact},band={self.band},bits={self.bits}"


def is_compact(store: str | None) -> bool:
    return store is not None and (store == STORE_PREFIX or store.startswith(STORE_PREFIX + ":"))


def parse_spec(store: str) -> CompactSpec:
    """``compact[:exact=E,band=B,bits=8|16]`` -> CompactSpec; one-line error otherwise."""
    if not is_compact(store):
        raise LogitdiffError(f"--store {store!r}: not a compact store spec")
    fields = {}
    rest = store[len(STORE_PREFIX) + 1:] if ":" in store else ""
    for part in filter(None, rest.split(",")):
        key, _, val = part.partition("=")
        if key not in ("exact", "band", "bits") or not val.isdigit():
            raise LogitdiffError(f"--store {store!r}: expected compact[:exact=E,band=B,bits=8|16], got {part!r}")
        fields[key] = int(val)
    spec = CompactSpec(**fields)
    if spec.exact < 2:
        raise LogitdiffError(f"--store {store!r}: exact must be >= 2 (top-1 and the margin are read from it)")
    if spec.bits not in (8, 16):
        raise LogitdiffError(f"--store {store!r}: bits must be 8 or 16")
    return spec


def _top_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries of one row, by value descending, lowest id first on ties."""
    V = z.shape[0]
    if k >= V:
        sel = np.arange(V)
    else:
        part = np.argpartition(-z, k - 1)[:k]
        t = z[part].min()
        above = np.nonzero(z > t)[0]
        ties = np.nonzero(z == t)[0][: k - above.size]  # ascending ids
        sel = np.concatenate([above, ties])
    return sel[np.lexsort((sel, -z[sel]))]


def top_ids_rows(z: np.ndarray, k: int) -> np.ndarray:
    """`_top_ids` of every row of ``z`` [n, V] at once (one partition of the block); the
    rare row whose k-th value ties entries beyond the partition takes the row rule."""
    n, V = z.shape
    if n == 0:
        return np.zeros((0, min(k, V)), np.int64)
    if k >= V:
        return np.stack([_top_ids(z[r], k) for r in range(n)])
    part = np.argpartition(-z, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(z, part, 1)
    order = np.lexsort((part, -vals), axis=1)
    out = np.take_along_axis(part, order, 1).astype(np.int64)
    t = vals.min(1)
    tied = (z >= t[:, None]).sum(1) > k  # entries equal to the k-th left out: lowest ids first
    for r in np.nonzero(tied)[0]:
        out[r] = _top_ids(z[r], k)
    return out


def encode(logits, next_tokens, spec: CompactSpec) -> dict[str, np.ndarray]:
    """Rows [N, V] of logits (any float dtype) -> the arrays of one block of a compact store."""
    logits = np.asarray(logits)
    if logits.dtype == np.uint16:  # bf16 bits (the full store's on-disk form): widen exactly
        logits = (logits.astype(np.uint32) << 16).view(np.float32)
    n, V = logits.shape
    E = min(spec.exact, V)
    Bn = min(spec.band, V - E)
    levels = (1 << spec.bits) - 1
    out = {
        "exact_ids": np.zeros((n, E), np.int64),
        "exact_logits": np.zeros((n, E), np.float32),
        "band_ids": np.zeros((n, Bn), np.int64),
        "band_codes": np.zeros((n, Bn), np.uint16 if spec.bits == 16 else np.uint8),
        **{f: np.zeros(n, np.float64) for f in ROW_FIELDS},
    }
    y = None if next_tokens is None else np.asarray(next_tokens, np.int64)
    for r in range(n):
        z32 = logits[r]
        z = z32.astype(np.float64)
        sel = _top_ids(z, E + Bn)
        m = z[sel[0]]
        a = z - m
        ls = float(np.log(np.exp(a).sum()))
        lp = a - ls
        e_ids, b_ids = sel[:E], sel[E:]
        out["exact_ids"][r] = e_ids
        out["exact_logits"][r] = np.asarray(z32[e_ids], np.float32)
        out["max_logit"][r], out["log_sum"][r] = m, ls
        if Bn:
            lpb = lp[b_ids]
            top, bot = lpb[0], lpb[-1]
            step = (top - bot) / levels
            code = np.floor((top - lpb) / step) if step > 0 else np.zeros(Bn)
            out["band_ids"][r] = b_ids
            out["band_codes"][r] = np.clip(code, 0, levels)
            out["band_top"][r], out["band_step"][r] = top, step
            out["band_mass"][r] = np.exp(lpb).sum()
        rest = np.ones(V, bool)
        rest[sel] = False
        if rest.any():
            lpr = lp[rest]
            out["rest_mass"][r] = np.exp(lpr).sum()
            out["rest_max"][r], out["rest_min"][r] = lpr.max(), lpr.min()
        else:
            out["rest_max"][r] = out["rest_min"][r] = -np.inf
        p = np.exp(lp)
        out["entropy"][r] = max(-(p * lp).sum(), 0.0)
        out["token_logp"][r] = lp[y[r]] if y is not None else np.nan
    return out


def decode(block: dict[str, np.ndarray]) -> CompactRows:
    """Arrays of `encode` (or a slice of them) -> the bounds' view of the reference."""
    m = block["max_logit"][:, None]
    ls = block["log_sum"][:, None]
    exact_logp = (block["exact_logits"].astype(np.float64) - m) - ls
    code = block["band_codes"].astype(np.float64)
    top, step = block["band_top"][:, None], block["band_step"][:, None]
    band_hi = top - code * step + BOX_SLACK
    band_lo = top - (code + 1.0) * step - BOX_SLACK
    rest_max, rest_min = decode_rest(block)
    return CompactRows(
        exact_ids=np.asarray(block["exact_ids"], np.int64), exact_logp=exact_logp,
        band_ids=np.asarray(block["band_ids"], np.int64), band_lo=band_lo, band_hi=np.minimum(band_hi, 0.0),
        band_mass=block["band_mass"], rest_mass=block["rest_mass"], rest_max=rest_max, rest_min=rest_min,
    )


def decode_rest(block: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The rest's common box [rest_min, rest_max] (ln p) of `decode`, widened by the slack
    (the compiled kernel decodes the exact and band entries itself, per entry, with
    `decode`'s arithmetic: kernel.compact_rows)."""
    return np.minimum(block["rest_max"] + BOX_SLACK, 0.0), block["rest_min"] - BOX_SLACK


def _stable_top(lp: np.ndarray, k: int) -> np.ndarray:
    """``np.argsort(-lp, axis=1, kind="stable")[:, :k]`` without sorting whole rows: the k-th
    largest value t of each row (one partition) selects the entries >= t, in position order;
    where a row has exactly k of them, the stable sort of those k is the answer (every entry
    above them is in, ties keep position order). Rows with more entries equal to t (ties at
    the cut) take the whole-row sort."""
    n, E = lp.shape
    if k >= E or n == 0:
        return np.argsort(-lp, axis=1, kind="stable")[:, :k]
    t = -np.partition(-lp, k - 1, axis=1)[:, k - 1]
    sel = lp >= t[:, None]
    exact = sel.sum(1) == k
    order = np.empty((n, k), np.int64)
    other = np.nonzero(~exact)[0]
    if other.size:
        order[other] = np.argsort(-lp[other], axis=1, kind="stable")[:, :k]
    rows = np.nonzero(exact)[0]
    if rows.size:
        pos = np.nonzero(sel[rows])[1].reshape(rows.size, k)  # ascending positions per row
        sub = np.argsort(-np.take_along_axis(lp[rows], pos, 1), axis=1, kind="stable")
        order[rows] = np.take_along_axis(pos, sub, 1)
    return order


def reference_top(block: dict[str, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's top-k (ids, log-probabilities), descending, lowest id first on
    ties — exact, read from the exact entries (k <= exact)."""
    ids = np.asarray(block["exact_ids"], np.int64)
    if k > ids.shape[1]:
        raise LogitdiffError(f"top-{k} asked of a compact store that keeps {ids.shape[1]} exact entries")
    lp = (block["exact_logits"].astype(np.float64) - block["max_logit"][:, None]) - block["log_sum"][:, None]
    if ids.shape[1] < 2 or (ids[:, 1:] >= ids[:, :-1]).all():  # ids ascending (a stored chunk's): a stable sort keeps them so
        order = _stable_top(lp, k)
    else:
        order = np.lexsort((ids, -lp), axis=1)[:, :k]
    return np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)


# --------------------------------------------------------------------------------------
# chunk files (the only I/O): ids as per-row sorted gaps, deflate-compressed npz
# --------------------------------------------------------------------------------------


def _pack_ids(ids: np.ndarray, *values: np.ndarray):
    """Sort each row's ids ascending (values follow) and store them as gaps."""
    order = np.argsort(ids, axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, 1)
    gaps = np.diff(ids, axis=1, prepend=0)
    dtype = np.uint16 if gaps.size == 0 or gaps.max() < (1 << 16) else np.uint32
    return gaps.astype(dtype), [np.take_along_axis(v, order, 1) for v in values]


def save_chunk(path, blocks: list[dict[str, np.ndarray]]) -> bytes:
    """Bytes of one chunk file holding the row blocks stacked."""
    cat: dict[str, Any] = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    e_gaps, (e_vals,) = _pack_ids(cat.pop("exact_ids"), cat.pop("exact_logits"))
    b_gaps, (b_codes,) = _pack_ids(cat.pop("band_ids"), cat.pop("band_codes"))
    bio = io.BytesIO()
    np.savez_compressed(bio, exact_gaps=e_gaps, exact_logits=e_vals, band_gaps=b_gaps, band_codes=b_codes, **cat)
    return bio.getvalue()


LOAD_THREADS = 4  # members of a chunk file read at once by load_chunk


def load_chunk(path, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """A chunk file's arrays (``max_bytes``: what its members may hold together, the chunk's
    rows as its manifest entry declares them; see npzinflate.read_npz)."""
    from . import npzinflate

    try:
        # libdeflate where the system has it (the same streams, ~2/3 of zlib's instructions);
        # else np.load, members inflated side by side (bench/RESULTS.md)
        data = npzinflate.read_npz(path, max_bytes=max_bytes, threads=LOAD_THREADS)
    # zlib.error: np.load's, a bad stream; SyntaxError, TypeError, TokenError: numpy's .npy
    # header parser on some damaged headers; MemoryError: a header's shape beyond memory
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, SyntaxError, TypeError,
            tokenize.TokenError, MemoryError) as e:
        raise LogitdiffError(f"{path}: unreadable compact chunk ({e})") from None
    missing = [k for k in ("exact_gaps", "exact_logits", "band_gaps", "band_codes", *ROW_FIELDS) if k not in data]
    if missing:
        raise LogitdiffError(f"{path}: compact chunk lacks field {missing[0]!r}")
    data["exact_ids"] = np.cumsum(data.pop("exact_gaps"), axis=1, dtype=np.int64)  # widened as it sums: no int64 copy first
    data["band_ids"] = np.cumsum(data.pop("band_gaps"), axis=1, dtype=np.int64)
    return data


def check_rows(data: dict[str, np.ndarray], vocab_size: int, where: str, label=None) -> None:
    """A loaded chunk's rows as `encode` writes them: ids in [0, V), logits and row figures
    finite (the rest's extremes -inf only where it is empty, the teacher token's log p NaN
    only where none was given). A damaged file would otherwise reach the kernel (an id
    outside the vocabulary) or give NaN intervals without a word. ``label(r)`` names row r."""

    def at(r: int) -> str:
        try:
            return f"{where}: {label(int(r))}" if label is not None else f"{where}: row {int(r)}"
        except Exception:  # noqa: BLE001 - a damaged run may not say which item
            return f"{where}: row {int(r)}"

    for key in ("exact_ids", "band_ids"):
        ids = data[key]
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise LogitdiffError(f"{at(r)}: compact field {key!r}: token id {int(ids[r, c])} outside [0, {vocab_size})")
    # the non-finite values the writer itself produces: -inf extremes of an empty rest, NaN
    # log p where no teacher token was given
    allowed: dict[str, Callable[[np.ndarray], np.ndarray]] = {"rest_max": np.isneginf, "rest_min": np.isneginf,
                                                             "token_logp": np.isnan}
    for key in ("exact_logits", *ROW_FIELDS):
        v = np.asarray(data[key], np.float64)
        legal = allowed[key](v) if key in allowed else np.zeros(v.shape, bool)
        bad = ~np.isfinite(v) & ~legal
        if bad.any():
            r = np.argwhere(bad)[0]
            raise LogitdiffError(f"{at(r[0])}: compact field {key!r} holds {float(v[tuple(r)])}: the chunk is damaged")


def rows_of(data: dict[str, np.ndarray], sl: slice) -> dict[str, np.ndarray]:
    return {k: v[sl] for k, v in data.items()}


# --------------------------------------------------------------------------------------
# compare: a compact reference against a full candidate (pure: arrays in, columns out)
# --------------------------------------------------------------------------------------

# column names of the intervals, next to each estimate (contract shared with reports)
INTERVAL_COLUMNS = {
    "kl_nats": ("kl_lower_nats", "kl_upper_nats"),
    "kl_rev_nats": ("kl_rev_lower_nats", "kl_rev_upper_nats"),
    "jsd_nats": ("jsd_lower_nats", "jsd_upper_nats"),
}
_DIV_OF = {"kl_nats": "kl", "kl_rev_nats": "kl_rev", "jsd_nats": "jsd"}


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = z.max(1, keepdims=True)
    a = z - m
    return a - np.log(np.exp(a).sum(1, keepdims=True))


def _cand_top_ids(cand_logits, lq: np.ndarray, k: int) -> np.ndarray:
    """The candidate's top-k ids, by value descending, lowest id first on ties: from the
    compiled kernel's pass over the raw logits where it is built (its rule; ln softmax is
    increasing and float64 keeps float32/bf16 logits apart, so the ids are `top_ids_rows`
    of ``lq``'s), else `top_ids_rows` (one partition of the block, a row rule for ties)."""
    from ..numerics import kernel
    from ..numerics import metrics as M

    z = np.asarray(cand_logits)
    if kernel.available() and z.dtype == np.float32 and z.ndim == 2 and z.shape[0]:
        return np.asarray(M.row_stats(z, k=k, threads=1)["topk_ids"], np.int64)
    return top_ids_rows(lq, k)


def compare_rows(block: dict[str, np.ndarray], cand_logits, next_tokens, *, top_k: int, overlap_k: int,
                 eps: float = 1e-12, threads: int = 1) -> dict[str, np.ndarray]:
    """Per-position columns for a compact reference (``block``, rows of `encode`) against
    full candidate logits [N, V] (float32, float16, or bf16 bits as uint16): every
    divergence as its estimate (the minimiser) with the interval beside it, and the exact
    columns the store keeps (top-1, margin, p and nll of the teacher token, entropy, top-K
    overlap, the seed's top-K fields). Where the compiled kernel is built, one call does
    the candidate's side and the bounds for the whole block (`kernel.compact_rows`,
    ``threads`` rows at a time, no [N, V] float64 array); else numpy. Raises
    `metrics.NonFiniteLogits` naming the first candidate row with NaN/inf, as the full
    comparison does."""
    from ..numerics import bounds as Bd
    from ..numerics import kernel
    from ..numerics import metrics as M

    kk = max(top_k, overlap_k, 2)
    y = np.asarray(next_tokens, np.int64)
    z = np.asarray(cand_logits)
    fused = (kernel.compact_rows(z, block, kk, threads, rest_box=decode_rest(block), box_slack=BOX_SLACK)
             if kernel.available() else None)
    if fused is None:
        return _compare_rows_numpy(block, z, y, top_k=top_k, overlap_k=overlap_k, eps=eps)
    if fused["bad"].any():
        r = int(np.nonzero(fused["bad"])[0][0])
        zr = _as_float(z[r : r + 1])[0]
        raise M.NonFiniteLogits("candidate", r, float(zr[~np.isfinite(zr)][0]))
    n, V = z.shape
    rows = np.arange(n)
    res = Bd._compact_intervals(fused["lower"], fused["upper"])
    ic = fused["top_ids"]
    # ln q = (z - max) - ln sum exp(z - max), as the kernel forms it
    lc = (_as_float(np.take_along_axis(z, ic, 1)).astype(np.float64) - fused["max"][:, None]) - fused["log_sum"][:, None]
    lqy = ((_as_float(z[rows, y]).astype(np.float64) - fused["max"]) - fused["log_sum"]) if n else np.zeros(0)
    return _columns(block, res, ic, lc, y, lqy, fused["entropy"], V, top_k=top_k, overlap_k=overlap_k, eps=eps, kk=kk)


def _as_float(z: np.ndarray) -> np.ndarray:
    """Raw logits as float32 values (bf16 bits widened exactly; float32/float16 as is)."""
    z = np.asarray(z)
    return (z.astype(np.uint32) << 16).view(np.float32) if z.dtype == np.uint16 else z


def _compare_rows_numpy(block, z, y, *, top_k: int, overlap_k: int, eps: float) -> dict[str, np.ndarray]:
    """`compare_rows` without the compiled kernel (or for a layout it cannot read)."""
    from ..numerics import bounds as Bd

    z = _as_float(z)
    if z.size and not np.isfinite(z).all():
        from ..numerics import metrics as M

        r = int(np.nonzero(~np.isfinite(z).all(1))[0][0])
        raise M.NonFiniteLogits("candidate", r, float(z[r][~np.isfinite(z[r])][0]))
    lq = log_softmax(z)
    n, V = lq.shape
    rows = np.arange(n)
    q = np.exp(lq)  # shared by the bounds and the candidate's entropy
    res = Bd.compact_vs_full(decode(block), lq, cand_p=q)
    kk = max(top_k, overlap_k, 2)
    ic = _cand_top_ids(z, lq, kk)
    lc = np.take_along_axis(lq, ic, 1)
    q *= lq
    entropy = np.maximum(-q.sum(1), 0.0)
    del q
    return _columns(block, res, ic, lc, y, lq[rows, y], entropy, V, top_k=top_k, overlap_k=overlap_k, eps=eps, kk=kk)


def _columns(block, res, ic, lc, y, lqy, entropy_cand, V, *, top_k, overlap_k, eps, kk) -> dict[str, np.ndarray]:
    """The columns of `compare_rows` from the intervals and the candidate's figures."""
    from ..numerics import metrics as M

    cols: dict[str, Any] = {}  # arrays, and "_tops": the (ids, logprobs) pairs of both sides for the caller
    for name, (lo, hi) in INTERVAL_COLUMNS.items():
        iv = res[_DIV_OF[name]]
        cols[name], cols[lo], cols[hi] = iv.estimate, iv.lower, iv.upper
    ir, lr = reference_top(block, kk)
    cols["top1_ref"], cols["top1_cand"] = ir[:, 0], ic[:, 0]
    cols["top1_match"] = ir[:, 0] == ic[:, 0]
    pr = np.exp(lr[:, :2])
    cols["margin_ref"] = pr[:, 0] - pr[:, 1]
    lpy = block["token_logp"]
    cols["p_ref_token"], cols["p_cand_token"] = np.exp(lpy), np.exp(lqy)
    cols["delta_p"] = cols["p_cand_token"] - cols["p_ref_token"]
    cols["nll_ref"], cols["nll_cand"] = -lpy, -lqy
    cols["entropy_ref"] = block["entropy"]
    cols["entropy_cand"] = entropy_cand
    kp, kq = ir[:, :overlap_k], ic[:, :overlap_k]
    cols["topk_overlap"] = (kp[:, :, None] == kq[:, None, :]).any(-1).sum(-1) / overlap_k
    t = M.topk(ir[:, :top_k], lr[:, :top_k], ic[:, :top_k], lc[:, :top_k], V, eps=eps)
    for key in ("reference_top_mass", "candidate_top_mass", "shared_tokens", "shared_reference_mass", "shared_candidate_mass"):
        cols[key] = t[key]
    cols["kl_topk_nats"] = t["kl_nats"]
    cols["_tops"] = (ir, lr, ic, lc)
    return cols
