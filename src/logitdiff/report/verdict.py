"""One line per candidate that answers first: how far it drifts, read against a floor; what
its top-1 flips did; whether its answers changed, and whether that change is significant.

Every figure is report.json's (or summary.json's, for the cross-engine floor); this module
only words them. Pure functions, no I/O; report.html, report.md and the terminal use it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..contracts import AnswerChange, Measure, Outcome
from .metric_registry import header

# What a flip's branch is, in the verdict's words (flips_part).
BRANCHES = "counterfactual branches (the candidate's token forced at a flip)"
# McNemar p below this is called significant (and said so, with the p-value beside it).
SIGNIFICANCE = 0.05


def _num(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _g(x: float) -> str:
    """3 significant digits; ratios from 1,000 to 1e9 without an exponent (14,600, not 1.46e+04)."""
    return f"{float(f'{x:.3g}'):,.0f}" if 1e3 <= abs(x) < 1e9 else f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _get(d: Any, path: str):
    for part in path.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return None
        d = d[part]
    return d


def drift_part(report: Mapping, *, x_cross_engine_floor: float | None = None, is_cross_engine_floor: bool = False) -> tuple[str, str]:
    """(severity, text): the mean KL against the cross-engine floor when one was measured,
    else the noise floor, else no floor (said so). severity: ok | warn | info."""
    if _get(report, "summary.positions") == 0:  # nothing measured: no figure, and no floor to read one against
        return "info", "mean KL n/a: no positions compared"
    kl = _num(_get(report, "summary.metrics.kl_nats.mean"))
    if kl is None:
        kl = _num(_get(report, "summary.kl_nats_mean"))
    xn = _num(_get(report, "summary.kl_mean_x_noise_floor"))
    xc = _num(x_cross_engine_floor)
    kl_text = "mean KL n/a" if kl is None else f"mean KL {_g(kl)} nats"
    noise = f", {_g(xn)}{header('x_noise_floor')}" if xn is not None else ""
    xs = _num(_get(report, "summary.kl_mean_x_served_floor"))
    if xs is not None:  # a served comparison: the servers' own batching is the floor to read it against
        text = f"drifts {_g(xs)}× served floor ({kl_text})"
        return ("ok", text + ": within 2× of the servers' own batch arithmetic") if xs <= 2 else ("warn", text)
    if is_cross_engine_floor:
        return "info", f"the cross-engine floor (reference weights, other engine): {kl_text}{noise}"
    if xc is not None:
        text = f"drifts {_g(xc)}{header('x_cross_engine_floor')} ({kl_text}{noise})"
        return ("ok", text + ": within 2× of the engine change alone") if xc <= 2 else ("warn", text)
    if xn is not None:
        text = f"drifts {_g(xn)}{header('x_noise_floor')} ({kl_text})"
        return ("ok", text + ": within 2× of the reference's own rerun") if xn <= 2 else ("warn", text)
    return "info", f"{kl_text}; no floor measured to read it against"


def flips_part(report: Mapping) -> tuple[str, str] | None:
    """(severity, text) of what the branched top-1 flips did; None without a flips section."""
    f = report.get("flips")
    if not isinstance(f, Mapping):
        return None
    n_b, n_f = f.get("n_branches") or 0, f.get("n_flips") or 0
    if not n_b:
        return "ok" if not n_f else "info", f"no flip branched ({n_f} top-1 flips)"
    o = f.get("outcomes") or {}
    bad = sum(int(o.get(k) or 0) for k in Outcome.BAD)
    # a branch is a counterfactual (the reference's text up to one flip, the candidate's
    # token there, the candidate continuing), not one of its free-running answers: said so, lest
    # "24 of 24 changed" read against "no answer changed" beside it
    judge = f.get("meaning_judged_by")
    kinds = [f"{what} {n}" for n, what in _bad_kinds(o, judge) if n]
    text = (f"{bad} of {n_b} {BRANCHES} with a bad verdict: " + ", ".join(kinds) if kinds else
            f"none of {n_b} {BRANCHES} with a bad verdict (checked answers, tests, tool calls)")
    diverged = int(o.get(Outcome.DIVERGED) or 0)
    if diverged:
        text += f"; {diverged} branch{'es' if diverged != 1 else ''} diverged (meaning not judged: " + ("no --judge)" if not judge else "the judge gave no verdict)")
    changed = [c for c in f.get("changed_items") or [] if isinstance(c, Mapping)]
    unbranched = sum(not c.get("branched") for c in changed)
    if unbranched:
        text += f"; {unbranched} of {len(changed)} changed answers have no branched flip (listed on the page)"
    return ("warn" if bad else "info" if diverged else "ok"), text


def _bad_kinds(o: Mapping, judge: str | None) -> list[tuple[int, str]]:
    """The bad outcomes (Outcome.BAD) of a counts dict, in words: (count, what changed)."""
    tool = int(o.get(Outcome.TOOL_CALL_MALFORMED) or 0) + int(o.get(Outcome.TOOL_CALL_CHANGED) or 0)
    return [(int(o.get(Outcome.ANSWER_CHANGED) or 0), "answer changed"),
            (int(o.get(Outcome.TESTS_FAILED) or 0), "tests failed"),
            (tool, "tool call changed or malformed"),
            (int(o.get(Outcome.MEANING_CHANGED) or 0), "meaning changed" + (f" (judged by {judge})" if judge else ""))]


def answer_changes(c: Mapping) -> dict[str, int]:
    """Each AnswerChange's count in a correctness section (or a summary row): its count field,
    or its item list where that is longer, so the words never say fewer than the items listed
    (right -> truncated is schema 1.2: 0 when absent)."""
    return {d: max(int(_num(c.get(AnswerChange.COUNT_FIELD[d])) or 0), len(c.get(AnswerChange.ITEMS_FIELD[d]) or []))
            for d in AnswerChange.ALL}


def _ci(ci) -> str:
    lo, hi = (_num(x) for x in (ci or [None, None])[:2]) if isinstance(ci, (list, tuple)) and len(ci) >= 2 else (None, None)
    return "" if lo is None or hi is None else f" [{100 * lo:.1f}–{100 * hi:.1f} %]"


def attributed_text(a: Any) -> str | None:
    """The attribution counts (correctness.attributed) in words; None without changed answers."""
    if not isinstance(a, Mapping) or not a.get("n"):
        return None
    n = int(a["n"])
    if a.get("with_flip") is None:
        text = f"first flips of the {n} changed answers not recorded (a report before schema 2.1)"
    else:
        text = (f"{a['with_flip']} of {n} changed answers have a teacher-forced top-1 flip "
                f"({a.get('divergence_at_first_flip') or 0} part there)")
    outcomes = ", ".join(f"{k} {v}" for k, v in (a.get("outcomes") or {}).items())
    return text + f", {a.get('branched') or 0} branched" + (f" ({outcomes})" if outcomes else "")


def attributed_cell(a: Any) -> str:
    """The attribution counts in a summary-table cell: "2/3, 2" (of 3 changed answers, 2 have
    a teacher-forced flip, 2 a branch); "0" without changed answers, n/a without the counts."""
    if not isinstance(a, Mapping) or a.get("n") is None:
        return "n/a"
    if not a["n"]:
        return "0"
    with_flip = "?" if a.get("with_flip") is None else a["with_flip"]
    return f"{with_flip}/{a['n']}, {a.get('branched') or 0}"


def answers_part(report: Mapping) -> tuple[str, str] | None:
    """(severity, text) of the labelled free-running answers: the share right both ways with
    its CI (a pass rate on a benchmark graded by its own tests or checker, else an accuracy),
    the answers that changed each way, the McNemar test said significant or not at
    SIGNIFICANCE, and what they are attributed to; None without correctness."""
    c = report.get("correctness")
    if not isinstance(c, Mapping):
        return None
    ar, ac = _num(c.get("accuracy_ref")), _num(c.get("accuracy_cand"))
    if ar is None or ac is None:
        return None
    counts = answer_changes(c)
    r2w, r2t, w2r = (counts[d] for d in AnswerChange.ALL)
    p = _num(c.get("mcnemar_p"))
    measure = c.get("measure") if c.get("measure") in Measure.ALL else Measure.ACCURACY
    text = (f"free-running {measure} {_pct(ar)}{_ci(c.get('accuracy_ref_ci'))} → {_pct(ac)}{_ci(c.get('accuracy_cand_ci'))}"
            + (f" ({c['n_labelled']} labelled)" if c.get("n_labelled") is not None else ""))
    if not (r2w or w2r or r2t):
        if ar != ac:  # a share moved, but no change is counted (a summary row from before right->truncated was)
            return "warn", text + ": answers changed (which ones is not recorded here)"
        return "ok", text + ": no answer changed"
    sig = p is not None and p < SIGNIFICANCE
    text += (f": {r2w} right→wrong, " + (f"{r2t} right→truncated, " if r2t else "")
             + f"{w2r} wrong→right, McNemar p = {'n/a' if p is None else f'{p:.2g}'} "
             + ("(significant)" if sig else "(not significant)"))
    attributed = attributed_text(c.get("attributed"))
    if attributed:
        text += "; " + attributed
    return ("bad" if sig and r2w + r2t > w2r else "warn" if r2w or r2t else "ok"), text


def extra_parts(report: Mapping) -> list[tuple[str, str]]:
    """Tool-call validity when the candidate's is below the reference's, and truncated outputs."""
    out = []
    c = report.get("correctness") or {}
    tv, tr = _num(c.get("tool_call_valid_cand")), _num(c.get("tool_call_valid_ref"))
    if tv is not None and c.get("n_tool_items") and tr is not None and tv < tr:
        out.append(("warn", f"valid tool calls {_pct(tv)} (reference {_pct(tr)})"))
    trunc = _truncated(report)
    if trunc:
        out.append(("warn", f"{trunc} outputs cut at the token budget"))
    return out


def _truncated(report: Mapping) -> int:
    """The candidate's free-running outputs cut at the token budget (correctness.cut_cand,
    schema 1.2; 0 when absent)."""
    n = _num((report.get("correctness") or {}).get("cut_cand"))
    return int(n) if n else 0


def gates_part(report: Mapping) -> tuple[str, str] | None:
    from .gates import crossed_of, not_evaluated_of

    g = report.get("gates")
    if not g:
        return None
    crossed, missing = crossed_of(g), not_evaluated_of(g)
    if crossed:
        return "bad", "gates crossed: " + ", ".join(crossed) + (f"; not evaluated: {', '.join(missing)}" if missing else "")
    if missing:
        return "warn", "gates not evaluated: " + ", ".join(missing)
    return "ok", f"all {len(g.get('gates') or [])} gates passed"


def verdict(report: Mapping, *, x_cross_engine_floor: float | None = None, is_cross_engine_floor: bool = False) -> list[tuple[str, str]]:
    """The verdict's parts, most important first: [(severity, text)], severity one of
    ok | info | warn | bad."""
    parts = [drift_part(report, x_cross_engine_floor=x_cross_engine_floor, is_cross_engine_floor=is_cross_engine_floor)]
    for p in (flips_part(report), answers_part(report)):
        if p:
            parts.append(p)
    parts += extra_parts(report)
    g = gates_part(report)
    if g:
        parts.append(g)
    return parts


def verdict_text(report: Mapping, **kw) -> str:
    """The verdict as one line of plain text."""
    return "; ".join(t for _, t in verdict(report, **kw))
