"""Stage *layers*: where in the network a candidate's drift starts — per-layer attribution
through each engine's layer hooks (:mod:`logitdiff.sources.layer_hooks`: the only way in;
this module holds the attribution, no engine code). Imports `capture`, `sources`, `store` and
below.

Where the drift starts: per-layer attribution between a candidate and its reference.

For every teacher-forced position of a reference RUN's tokens, the residual stream after
each decoder layer (and after the token embedding, where both engines name it) of the
reference and of each candidate, compared per layer:

* ``rel_l2``  = ‖c − r‖ / ‖r‖ (relative L2 error of the candidate's hidden state),
* ``cosine``  = r·c / (‖r‖ ‖c‖),
* ``sqnr_db`` = 10 log10(‖r‖² / ‖c − r‖²) (inf where the states are identical),

all in float64 from the engines' float32 (or bf16) states; per layer the median and p95
over positions, the growth (median ``rel_l2`` of a layer / that of the layer before), the
first layer where a candidate leaves the floor band, and per item the rank correlation
between a layer's error and the final KL of the position (the KL from the same forward
passes' logits, :func:`logitdiff.numerics.metrics.full_vocab`).

The point compared is the same in both engines (:mod:`logitdiff.sources.layer_hooks`):
transformers' decoder layer ``i`` output and llama.cpp's ``l_out-i``. The final norm and the output head are not a layer: their effect is the
KL itself.

Memory: sequences are prefilled a window of tokens at a time over a KV cache (the window
sized from ``--chunk-size``); a window's hidden states of every compared point,
``[points, rows, H]`` float32, exist for the reference and for one candidate at a time,
plus their logits ``[rows, V]``. Per position only scalars are kept (``points`` floats per
figure), never ``[layers x positions x H]``.

The floor (what arithmetic noise alone does per layer): by default the reference rerun with
every window prefilled in two forward passes instead of one (other matrix shapes, other
float rounding: the analogue of the noise floor's moved batch boundaries); or any source
spec compared like a candidate (e.g. ``builtin:tiny-BF16``: the cross-engine floor).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import LogitdiffError, renamed_parameters
from ..contracts import LAYERS_SCHEMA
from ..sources.layer_hooks import LayerHooks, geometry_of, layer_hooks, point_names

if TYPE_CHECKING:
    from ..contracts import LayersComparison, LayersDoc, LayersGeometry, LayersItem, LayersMethod, LayersPerPoint

LAYERS_SCHEMA_VERSION = "1.0"
from ..defaults import FLOOR_RERUN  # noqa: E402
FLOOR_NONE = "none"
FLOOR_SPEC = "spec"  # another source, compared like a candidate
TOP_LAYERS = 3  # "the layers that add the most error": how many are named
SERVED_KINDS = ("served", "openai")  # openai: the old name of served:


# ------------------------------------------------------------------------------- numerics
def layer_errors(ref, cand) -> dict[str, np.ndarray]:
    """Per row of two ``[n, H]`` hidden-state blocks (any float dtype): ``rel_l2``,
    ``cosine`` and ``sqnr_db``, float64 ``[n]``, accumulated in float64.

    A reference row of norm 0 gives ``rel_l2`` inf (nan when the candidate's is 0 too);
    identical rows give ``rel_l2`` 0, ``cosine`` 1 and ``sqnr_db`` inf."""
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if r.shape != c.shape or r.ndim != 2:
        raise ValueError(f"layer_errors: shapes {r.shape} and {c.shape} differ or are not [n, H]")
    rr = np.einsum("ij,ij->i", r, r)
    cc = np.einsum("ij,ij->i", c, c)
    rc = np.einsum("ij,ij->i", r, c)
    d = c - r
    dd = np.einsum("ij,ij->i", d, d)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.sqrt(dd / rr)
        cos = rc / np.sqrt(rr * cc)
        sqnr = 10.0 * np.log10(rr / dd)
    cos = np.where(dd == 0, 1.0, cos)
    return {"rel_l2": rel, "cosine": cos, "sqnr_db": sqnr}


def added_error(ref, cand, prev_ref=None, prev_cand=None) -> np.ndarray:
    """Per row: the error a point adds to the stream, ‖e − e_prev‖ / ‖r‖ with e = c − r at
    this point and e_prev at the point before (0 for the first point): what the layer's own
    update changed in the error, whether from its weights or from its input's error passing
    through it. Relative errors alone can fall across a layer that adds error (the stream's
    norm grows), so this, not ``growth``, names the layers that add the most."""
    r = np.asarray(ref, dtype=np.float64)
    e = np.asarray(cand, dtype=np.float64) - r
    if prev_ref is not None:
        e -= np.asarray(prev_cand, dtype=np.float64) - np.asarray(prev_ref, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("ij,ij->i", e, e) / np.einsum("ij,ij->i", r, r))


def growth(medians: Sequence[float]) -> list[float | None]:
    """Each point's median error over the previous point's (None for the first; inf where
    the previous is 0 and this one is not: error that appears from nothing; nan for 0/0)."""
    m = [float(x) for x in medians]
    out: list[float | None] = [None]
    for a, b in zip(m, m[1:]):
        if a == 0:
            out.append(math.inf if b > 0 else math.nan)
        else:
            out.append(b / a)
    return out


def first_beyond(medians: Sequence[float], band: Sequence[float | None] | None) -> int | None:
    """Index of the first point whose median error exceeds the floor band's top (its p95),
    or None when none does (or no floor was measured; a point whose band is undefined,
    None as read back from layers.json, is not judged)."""
    if band is None:
        return None
    for j, (m, b) in enumerate(zip(medians, band)):
        if b is not None and np.isfinite(m) and m > b:
            return j
    return None


def top_added(added: Sequence[float], n: int = TOP_LAYERS) -> list[int]:
    """Indices of the ``n`` points whose median added error is largest (zeros and undefined
    values left out): the layers that add the most error."""
    keyed = [(j, x) for j, x in enumerate(added) if x is not None and math.isfinite(x) and x > 0]
    keyed.sort(key=lambda jx: (-jx[1], jx[0]))
    return [j for j, _ in keyed[:n]]


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), float64."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x), np.float64)
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e - 1) / 2.0
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equal-length vectors (nan when fewer than 3 finite
    pairs or either side is constant)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else math.nan


def _q(x: np.ndarray, q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default) of the non-nan values;
    inf where both neighbours are inf (numpy's own gives nan there: inf - inf)."""
    xs = np.sort(x[~np.isnan(x)])
    if not len(xs):
        return math.nan
    pos = q / 100.0 * (len(xs) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    a, b = float(xs[lo]), float(xs[hi])
    return a if a == b or pos == lo else a + (b - a) * (pos - lo)


def summarize_points(rel: np.ndarray, cos: np.ndarray, sqnr: np.ndarray, added: np.ndarray) -> dict[str, list[float]]:
    """Per point (column) of ``[positions, points]`` figures: median and p95 of rel_l2, mean
    rel_l2, median and p5 of cosine, median SQNR (dB), median added error."""
    cols = range(rel.shape[1])
    return {
        "added_rel_l2_median": [_q(added[:, j], 50) for j in cols],
        "rel_l2_median": [_q(rel[:, j], 50) for j in cols],
        "rel_l2_p95": [_q(rel[:, j], 95) for j in cols],
        "rel_l2_mean": [float(np.nanmean(rel[:, j])) if np.isfinite(rel[:, j]).any() else math.nan for j in cols],
        "cosine_median": [_q(cos[:, j], 50) for j in cols],
        "cosine_p5": [_q(cos[:, j], 5) for j in cols],
        "sqnr_db_median": [_q(sqnr[:, j], 50) for j in cols],
    }


def check_layer_specs(specs: Sequence[str]) -> None:
    """A served source cannot do this: one line, before anything opens."""
    from ..sources import parse_spec

    for s in specs:
        if parse_spec(s).kind in SERVED_KINDS:
            raise LogitdiffError(
                f"{s}: a served source hands out top-K log-probabilities, not hidden states; per-layer attribution "
                "needs an in-process hf:, gguf: or builtin: source"
            )


def check_same_geometry(ref, other) -> None:
    """Family, layer count and hidden size must match: one line naming both sources."""
    a, b = ref.src.spec, other.src.spec
    if ref.family.name != other.family.name:
        raise LogitdiffError(f"{b}: architecture family {other.family.name} differs from the reference {a} ({ref.family.name})")
    if ref.n_layer != other.n_layer:
        raise LogitdiffError(f"{b}: {other.n_layer} layers, the reference {a} has {ref.n_layer}")
    if ref.hidden != other.hidden:
        raise LogitdiffError(f"{b}: hidden size {other.hidden}, the reference {a} has {ref.hidden}")


def window_tokens(chunk_bytes: int, points: int, hidden: int, vocab: int) -> int:
    """Tokens per forward pass so that two sides' hidden states of every point and their
    logits, float32, fit ``chunk_bytes``: 2 x (points x H + V) x 4 bytes per row.

    Not counted: the engines' own copies of a window's logits (torch's head output and its
    float32 cast; each llama.cpp context -- reference, floor, every candidate -- keeps its
    own [window, V] output and compute buffers). Measured (hf, V = 248,320, 3 points): peak
    RSS above the loaded models 206 MiB at 64 MiB, 846 MiB at 512 MiB: about 1.7-3x."""
    return max(1, min(2048, int(chunk_bytes // (2 * 4 * (points * hidden + vocab)))))


# ---------------------------------------------------------------------------------- the job
@dataclass
class _Side:
    """Per-position figures of one comparison with the reference (a candidate or the floor)."""

    spec: str
    engine: LayerHooks
    rel: np.ndarray
    cos: np.ndarray
    sqnr: np.ndarray
    added: np.ndarray
    kl: np.ndarray
    top1: np.ndarray


@renamed_parameters(teacher="reference_run")
def layer_attribution(
    ref_src,
    cand_srcs: Sequence,
    reference_run,
    *,
    floor_src=None,
    floor: str = FLOOR_RERUN,
    chunk_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> LayersDoc:
    """The layers.json object for open sources over the open reference RUN (``RunReader``).

    ``floor``: ``FLOOR_RERUN`` (the reference, each window in two forward passes),
    ``FLOOR_NONE``, or ``FLOOR_SPEC``: ``floor_src``, an open source compared like a candidate."""
    from ..capture import verified_prompts
    from ..store import DEFAULT_CHUNK_BYTES

    chunk_bytes = int(chunk_bytes or DEFAULT_CHUNK_BYTES)
    pairs = verified_prompts(ref_src, reference_run)
    for s in list(cand_srcs) + ([floor_src] if floor_src is not None else []):
        verified_prompts(s, reference_run)
    family, n_layer, hidden = geometry_of(ref_src)
    win = window_tokens(chunk_bytes, len(point_names(family, n_layer)), hidden, ref_src.vocab_size)
    n_pos = sum(len(it.positions) for it, _ in pairs)
    with contextlib.ExitStack() as stack:
        ref = layer_hooks(ref_src, window=win)
        stack.callback(ref.close)
        names = point_names(ref.family, ref.n_layer)
        floor_side, sides = _open_sides(stack, ref, cand_srcs, floor, floor_src, win, (n_pos, len(names)))
        everyone = ([floor_side] if floor_side else []) + sides
        item_rows: list[tuple[str, int, int]] = []
        row0 = 0
        for it, prompt in pairs:
            _measure_item(ref, everyone, it, prompt, win, row0)
            item_rows.append((it.id, row0, row0 + len(it.positions)))
            row0 += len(it.positions)
            if progress and len(it.positions):
                progress(1)
        geometry: LayersGeometry = {"family": ref.family.name, "n_layer": ref.n_layer, "hidden_size": ref.hidden, "points": names,
                                    "window_tokens": win, "chunk_bytes": chunk_bytes}
    floor_doc = _comparison(floor_side, item_rows, None) if floor_side else None
    band = floor_doc["per_point"]["rel_l2_p95"] if floor_doc else None
    return {
        "schema": LAYERS_SCHEMA,
        "schema_version": LAYERS_SCHEMA_VERSION,
        "reference": {"spec": ref_src.spec, "engine": ref.engine},
        "teacher": str(reference_run.path),  # layers.json 1.x's name for the reference RUN
        "n_items": len(pairs),
        "n_positions": n_pos,
        "geometry": geometry,
        "method": _method(floor, floor_side, win),
        "floor": floor_doc,
        "candidates": [_comparison(s, item_rows, band) for s in sides],
    }


def _open_sides(stack: contextlib.ExitStack, ref: LayerHooks, cand_srcs: Sequence, floor: str, floor_src, win: int,
                shape: tuple[int, int]) -> tuple[_Side | None, list[_Side]]:
    """The floor's side (None without one) and each candidate's: its engine's layer hooks
    (closed by ``stack``), checked against the reference's geometry, and its figures
    ``[positions, points]`` not yet measured (nan)."""

    def side(spec: str, eng: LayerHooks) -> _Side:
        stack.callback(eng.close)
        check_same_geometry(ref, eng)
        return _Side(spec, eng, np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan),
                     np.full(shape, np.nan), np.full(shape[0], np.nan), np.zeros(shape[0], bool))

    floor_side = None
    if floor == FLOOR_RERUN:
        floor_side = side(f"{ref.src.spec} (rerun, each window in two forward passes)", layer_hooks(ref.src, window=win, split=True))
    elif floor == FLOOR_SPEC:
        floor_side = side(floor_src.spec, layer_hooks(floor_src, window=win))
    return floor_side, [side(c.spec, layer_hooks(c, window=win)) for c in cand_srcs]


def _measure_item(ref: LayerHooks, everyone: Sequence[_Side], it, prompt: Sequence[int], win: int, row0: int) -> None:
    """One teacher item, ``win`` tokens per forward pass over each engine's KV cache: every
    side's per-point figures and final KL at the item's positions, in rows ``row0..``."""
    from ..numerics import metrics as M

    teacher_ids = list(it.teacher_ids)
    pos = np.asarray(it.positions, np.int64)
    if not len(pos):
        return
    seq = (list(prompt) + teacher_ids[:-1])[: len(prompt) + int(pos.max())]
    sel_all = len(prompt) - 1 + pos
    nxt = np.asarray(teacher_ids, np.int64)[pos]
    ref.begin()
    for s in everyone:
        s.engine.begin()
    done = 0
    for a in range(0, len(seq), win):
        b = min(len(seq), a + win)
        hi = int(np.searchsorted(sel_all, b))
        sel = sel_all[done:hi] - a
        h_ref, z_ref = ref.window(seq[a:b], a, sel)
        rows = slice(row0 + done, row0 + hi)
        for s in everyone:
            h, z = s.engine.window(seq[a:b], a, sel)
            for j in range(len(h_ref)):
                e = layer_errors(h_ref[j], h[j])
                s.rel[rows, j], s.cos[rows, j], s.sqnr[rows, j] = e["rel_l2"], e["cosine"], e["sqnr_db"]
                s.added[rows, j] = added_error(h_ref[j], h[j], *((h_ref[j - 1], h[j - 1]) if j else ()))
            if len(sel):
                m = M.full_vocab(z_ref, z, nxt[done:hi], k=1)
                s.kl[rows] = m["kl_nats"]
                s.top1[rows] = m["top1_match"]
            del h, z
        done = hi


def _method(floor: str, floor_side: _Side | None, win: int) -> LayersMethod:
    return {
        "point": "residual stream after each decoder layer (before the final norm); 'embedding': the token "
                 "embedding before any scaling. transformers: model.layers[i] outputs (forward hooks); llama.cpp: "
                 "l_out-i (graph evaluation callback)",
        "metrics": "rel_l2 = |c - r| / |r|; cosine = r.c / (|r| |c|); sqnr_db = 10 log10(|r|^2 / |c - r|^2); float64 "
                   "from the engines' float32 (bf16) states; growth = median rel_l2 of a point / that of the point before; "
                   "added_rel_l2 = |e - e_prev| / |r| with e = c - r (the error a layer's own update adds; the layers that "
                   "add the most error are ranked by its median)",
        "floor": _floor_text(floor, floor_side),
        "beyond_floor": "a point leaves the floor band where a candidate's median rel_l2 exceeds the floor's p95",
        "kl": "forward KL(P_ref || P_cand) of each position's final logits, from the same forward passes "
              "(metrics.full_vocab); correlation per item: Spearman's rank correlation across the item's positions",
        "layout": f"each sequence prefilled {win} tokens per forward pass over a KV cache, one sequence at a time",
    }


def _floor_text(floor: str, floor_side) -> str:
    if floor == FLOOR_NONE or floor_side is None:
        return "none: no floor was measured; no layer can be read against arithmetic noise"
    if floor == FLOOR_RERUN:
        return ("the reference rerun with every window prefilled in two forward passes instead of one (other matrix "
                "shapes, other float rounding): the arithmetic noise of the reference's own engine")
    return f"{floor_side.spec} compared with the reference like a candidate (e.g. the same weights in another engine)"


def _comparison(s: _Side, item_rows: Sequence[tuple[str, int, int]], band: Sequence[float | None] | None) -> LayersComparison:
    pts = summarize_points(s.rel, s.cos, s.sqnr, s.added)
    names_n = s.rel.shape[1]
    items: list[LayersItem] = []
    for item_id, a, b in item_rows:
        kl = s.kl[a:b]
        items.append({
            "id": item_id, "n": int(b - a),
            "kl_mean_nats": float(np.mean(kl)) if b > a else math.nan,
            "spearman_rel_l2_kl": [spearman(s.rel[a:b, j], kl) for j in range(names_n)],
        })
    rho = np.array([it["spearman_rel_l2_kl"] for it in items], np.float64).reshape(len(items), names_n)
    # the figures are floats (nan/inf where undefined); layers_json writes those as null
    per: LayersPerPoint = {
        "rel_l2_median": list(pts["rel_l2_median"]), "rel_l2_p95": list(pts["rel_l2_p95"]),
        "rel_l2_mean": list(pts["rel_l2_mean"]), "cosine_median": list(pts["cosine_median"]),
        "cosine_p5": list(pts["cosine_p5"]), "sqnr_db_median": list(pts["sqnr_db_median"]),
        "growth": growth(pts["rel_l2_median"]), "added_rel_l2_median": list(pts["added_rel_l2_median"]),
        "spearman_kl_median": [_q(rho[:, j], 50) for j in range(names_n)],
    }
    identical = bool(np.all(np.nan_to_num(s.rel, nan=0.0) == 0) and np.all(np.nan_to_num(s.kl) == 0))
    first = first_beyond(pts["rel_l2_median"], band)
    return {
        "spec": s.spec,
        "engine": s.engine.engine,
        "identical": identical,
        "per_point": per,
        "first_beyond_floor": first,
        "top_added": top_added(pts["added_rel_l2_median"]),
        "kl_mean_nats": float(np.nanmean(s.kl)) if len(s.kl) else math.nan,
        "top1_disagreement": float(1.0 - np.mean(s.top1)) if len(s.top1) else math.nan,
        "items": items,
    }
