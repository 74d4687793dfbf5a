"""Checks to call from your own tests.

:func:`assert_drift_within` turns a logitdiff REPORT into a pytest assertion, the way
vLLM's ``check_logprobs_close`` turns two logprob lists into one::

    from logitdiff.testing import assert_drift_within

    def test_q4_is_close_enough(tmp_path):
        ...  # capture + compare, or logitdiff.run(...)
        assert_drift_within(tmp_path / "reports" / "q4", require="kl_mean<0.01, top1_disagreement<0.02")
        assert_drift_within(tmp_path / "reports" / "q4", fail_on="kl_p99>0.5")

The clauses are the gates' (:mod:`logitdiff.report.gates`): one grammar, one meaning per name,
the same as the CLI's. ``fail_on=`` takes failure conditions, as ``--fail-on`` does (the
check fails when one holds); ``require=`` takes clauses that must hold, as ``--require``
does (the check fails when one does not). A bare clause string without either name is
refused, since it would not say which it is. A clause whose metric the report does not have
is *not evaluated*, and the check fails saying so (an unevaluated check is no pass; the
CLI gives it its own exit status). The failure message names every clause that failed, the
value, and the worst items for that metric, so a red test says where to look.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .report.gates import Gate, GateKind, judge, parse_gate_options
from .report.metric_registry import GATE_METRICS

if TYPE_CHECKING:
    from .contracts import Report

__all__ = ["DriftCheckFailed", "DriftFailure", "assert_drift_within", "drift_failures"]

# Per-item figure that ranks the worst items for a metric: (field of report.items[*], key).
_ITEM_FIELD = {name: m.item for name, m in GATE_METRICS.items() if m.item is not None}
WORST_SHOWN = 3


class DriftFailure(TypedDict):
    """One clause a report fails (:func:`drift_failures`, ``DriftCheckFailed.failures``)."""

    clause: str  # as written, e.g. "kl_mean<0.05"
    kind: str  # gates.GateKind: fail_on (a failure condition that holds) or require (a clause that does not)
    metric: str
    value: float | None  # None: not evaluated
    not_evaluated: bool  # the metric is missing from the report
    reason: str | None  # why it is missing
    worst_items: list[tuple[str, float]]  # (item id, the item's figure for the metric), worst first


class DriftCheckFailed(AssertionError):
    """Raised by :func:`assert_drift_within`; ``failures`` holds one entry per failed clause."""

    def __init__(self, message: str, failures: list[DriftFailure]):
        super().__init__(message)
        self.failures = failures


def _load(report_or_dir: Report | str | os.PathLike[str]) -> tuple[Report, str]:
    if isinstance(report_or_dir, Mapping):
        return report_or_dir, "report"
    from .report import read_report

    path = Path(report_or_dir)
    if path.is_file():
        path = path.parent
    return read_report(path), str(path)


def _worst_items(report: Report, metric: str, n: int = WORST_SHOWN) -> list[tuple[str, float]]:
    field = _ITEM_FIELD.get(metric)
    if field is None:
        return []
    scored = []
    for item in report.get("items") or []:
        v = item.get(field[0])
        if field[1] is not None:
            v = v.get(field[1]) if isinstance(v, Mapping) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            scored.append((str(item.get("id")), float(v)))
    return sorted(scored, key=lambda t: -t[1])[:n]


def drift_failures(report_or_dir: Report | str | os.PathLike[str], *, fail_on: str | None = None,
                   require: str | None = None) -> list[DriftFailure]:
    """The clauses that ``report_or_dir`` (a REPORT directory, its report.json, or the
    loaded report) fails: ``[{"clause", "kind", "metric", "value", "not_evaluated", "reason",
    "worst_items"}]``, empty when every clause was evaluated and none crossed. Bad or empty
    clause strings raise ``LogitdiffError``."""
    gates = _gates(fail_on, require)
    report, _ = _load(report_or_dir)
    return _failures(report, gates)


def _failures(report: Report, gates: list[Gate]) -> list[DriftFailure]:
    res, status = judge(report, gates)
    failures: list[DriftFailure] = []
    if status == 0:
        return failures
    for g, r in zip(gates, res["gates"]):
        if r["crossed"] or r["missing"]:
            failures.append({"clause": g.clause, "kind": g.kind, "metric": g.metric, "value": r["value"], "not_evaluated": r["missing"],
                             "reason": r.get("reason"), "worst_items": _worst_items(report, g.metric)})
    return failures


def _gates(fail_on: str | None, require: str | None) -> list[Gate]:
    if fail_on is None and require is None:
        raise TypeError("give fail_on='...' (failure conditions, as --fail-on) or require='...' (clauses that must hold, "
                        "as --require)")
    return parse_gate_options(fail_on, require)


def assert_drift_within(report_or_dir: Report | str | os.PathLike[str], clauses: Any = None, /, *, fail_on: str | None = None,
                        require: str | None = None) -> None:
    """Fail (``DriftCheckFailed``, an ``AssertionError``) when a ``fail_on`` clause holds
    (e.g. ``fail_on="kl_mean>0.05"``, as ``--fail-on``), a ``require`` clause does not hold
    (e.g. ``require="kl_mean<=0.05"``, as ``--require``), or a clause's metric is not in the
    report (not evaluated). A clause string passed without a name is refused (TypeError)."""
    if clauses is not None:
        raise TypeError(f"assert_drift_within(report, {clauses!r}): say what the clauses are: fail_on={clauses!r} "
                        f"(failure conditions, as --fail-on) or require={clauses!r} (clauses that must hold, as --require)")
    gates = _gates(fail_on, require)  # bad clauses fail before the report is read
    report, where = _load(report_or_dir)
    failures = _failures(report, gates)
    if not failures:
        return
    cand = (report.get("candidate") or {}).get("spec") or (report.get("candidate") or {}).get("path") or "candidate"
    asked = "; ".join(f"{k}={v!r}" for k, v in (("fail_on", fail_on), ("require", require)) if v is not None)
    lines = [f"drift of {cand} ({where}) fails {asked}:"]
    for f in failures:
        worst = ", ".join(f"{i} ({v:.4g})" for i, v in f["worst_items"])
        if f["not_evaluated"]:
            lines.append(f"  {f['kind']} {f['clause']}: not evaluated, {f['metric']} is missing from the report: {f['reason']}")
            continue
        what = "holds" if f["kind"] == GateKind.FAIL_ON else "does not hold"
        m = GATE_METRICS[f["metric"]]
        lines.append(f"  {f['kind']} {f['clause']} {what}: {f['metric']} = {f['value']:.6g} ({m.unit}, {m.direction}: {m.meaning})"
                     + (f"; worst items: {worst}" if worst else ""))
    raise DriftCheckFailed("\n".join(lines), failures)
