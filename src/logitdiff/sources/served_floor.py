"""The served noise floor: how much a server's own arithmetic moves its rows.

A server batches the tasks in flight; on a quantized model a row's float rounding depends
on its batch mates (which items share a decode batch, in which round), so two captures of
the same server at the same positions differ although nothing about the model changed.
``logitdiff run`` measures that for every served side: the same source scored a second
time with other batch mates (batch boundaries moved by half a block, which changes which
items share the server's rounds) and compared with the first capture. A served figure is
then read as a multiple of that floor ("x served floor"); a candidate within 2x of it is
flagged: its drift is not distinguishable from the server's batch arithmetic.

Pure bookkeeping over `compare.Comparison` columns; the scoring is the caller's
(pipeline.py).
"""

from __future__ import annotations

import numpy as np

from ..contracts import ServedFloor, ServedFloorSide

#: a served side's second capture: batch boundaries moved by this many items (half of
#: capture.SCORE_BATCH), so the items share the server's rounds with other items
SHIFT_TEXT = ("scored a second time by the same server with the batch boundaries moved by {shift} items "
              "(other batch mates, other rounds) and compared with the first capture")
RULE = ("the larger of the sides' floors measured (each: mean KL between two captures of the same served "
        "source with other batch mates); x served floor = the candidate's mean KL / this")


def is_served(spec: str | None) -> bool:
    from .options import is_served as served_spec

    return served_spec(spec)


def floor_side(comp, *, spec: str | None, batching: str | None, shift: int) -> ServedFloorSide | None:
    """One side's floor from the comparison of its two captures; None when the second capture
    scored no position (nothing measured: never a floor of 0)."""
    c = comp.columns
    kl = np.asarray(c["kl_nats"], np.float64)
    if not kl.size:
        return None
    return {
        "spec": spec,
        "batching": batching,
        "measured_by": SHIFT_TEXT.format(shift=shift),
        "kl_nats_mean": float(kl.mean()),
        "kl_nats_max": float(kl.max()),
        "top1_disagreement": float(1.0 - np.mean(c["top1_match"])),
        "positions": int(kl.size),
    }


def served_floor(reference: ServedFloorSide | None, candidate: ServedFloorSide | None) -> ServedFloor | None:
    """The floor of a comparison from its served sides' floors (None when neither was measured)."""
    sides = [s for s in (reference, candidate) if s is not None]
    if not sides:
        return None
    return {"kl_nats_mean": max(s["kl_nats_mean"] for s in sides), "rule": RULE, "reference": reference, "candidate": candidate}


def summary_fields(kl_mean: float | None, floor: ServedFloor | None) -> dict:
    """``served_floor``, ``kl_mean_x_served_floor`` and ``within_2x_served_floor`` of a
    report's summary (x is None where the floor is 0: both captures bit-identical)."""
    if floor is None:
        return {}
    f = floor["kl_nats_mean"]
    x = (kl_mean / f) if (f and kl_mean is not None) else None
    return {"served_floor": floor, "kl_mean_x_served_floor": x, "within_2x_served_floor": x is not None and x <= 2.0}


def markdown_lines(summary: dict) -> list[str]:
    """The report.md lines of a served floor (report/markdown.py)."""
    fl = summary.get("served_floor")
    if not fl:
        return []
    parts = []
    for name in ("reference", "candidate"):
        s = fl.get(name)
        if s:
            parts.append(f"{name} `{s['spec']}` (batching {s['batching']}) mean KL {s['kl_nats_mean']:.4g} nats, "
                         f"top-1 disagreement {100 * s['top1_disagreement']:.2f} % over {s['positions']:,} positions")
        else:
            parts.append(f"{name}: not served or not measured")
    x = summary.get("kl_mean_x_served_floor")
    # x is None for a floor of 0 or for no positions measured: say which, never "bit-identical" for nothing
    measured = [fl[n] for n in ("reference", "candidate") if fl.get(n)]
    why = ("the captures are bit-identical: the floor is 0" if fl["kl_nats_mean"] == 0 and all(s["positions"] for s in measured)
           else "no positions measured")
    out = [f"- served floor (each served side {SHIFT_TEXT.split(' and compared')[0].replace('{shift}', 'half a block of')}): "
           + "; ".join(parts) + f". This candidate is **{'n/a' if x is None else f'{x:.3g}'} × served floor**"
           + (f" ({why})" if x is None else "")]
    if summary.get("within_2x_served_floor"):
        out.append("- **warning: within 2× of the served floor** — this drift is not distinguishable from the servers' "
                   "own batch arithmetic (capture with batching=serial for deterministic rows)")
    return out
