"""Checks to call from your own tests.

:func:`assert_drift_within` turns a logitdiff REPORT into a pytest assertion, the way
vLLM's ``check_logprobs_close`` turns two logprob lists into one::

    from logitdiff.testing import assert_drift_within

    def test_q4_is_close_enough(tmp_path):
        ...  # capture + compare, or logitdiff.run(...)
        assert_drift_within(tmp_path / "reports" / "q4", "kl_mean<0.01, top1_disagreement<0.02")

Each clause is ``METRIC OP NUMBER`` that must HOLD (the reverse of ``--fail-on``, whose
clauses name what must not happen); the metric names are those of ``--fail-on``
(:data:`logitdiff.gates.METRICS`). A metric the report lacks fails the check (fail closed,
as the gates do). The failure message names every clause that failed, the value, and the
worst items for that metric, so a red test says where to look.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .gates import OPS, metric_value, parse_gates

__all__ = ["DriftCheckFailed", "assert_drift_within", "drift_failures"]

# Per-item figure that ranks the worst items for a metric: (field of report.items[*], key).
_ITEM_FIELD = {
    "kl_mean": ("kl_nats", "mean"), "kl_p95": ("kl_nats", "p95"), "kl_p99": ("kl_nats", "p99"), "kl_max": ("kl_nats", "max"),
    "kl_rev_mean": ("kl_rev_nats", "mean"), "jsd_mean": ("jsd_nats", "mean"),
    "top1_disagreement": ("top1_disagreement", "rate"), "ppl_ratio": ("ppl_ratio", None),
}
WORST_SHOWN = 3


class DriftCheckFailed(AssertionError):
    """Raised by :func:`assert_drift_within`; ``failures`` holds one dict per failed clause."""

    def __init__(self, message: str, failures: list[dict]):
        super().__init__(message)
        self.failures = failures


def _load(report_or_dir: Any) -> tuple[Mapping, str]:
    if isinstance(report_or_dir, Mapping):
        return report_or_dir, "report"
    from .report import read_report

    path = Path(report_or_dir)
    if path.is_file():
        path = path.parent
    return read_report(path), str(path)


def _worst_items(report: Mapping, metric: str, n: int = WORST_SHOWN) -> list[tuple[str, float]]:
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


def drift_failures(report_or_dir: Any, requirements: str) -> list[dict]:
    """The clauses of ``requirements`` that ``report_or_dir`` (a REPORT directory, its
    report.json, or the loaded report) does not meet: ``[{"clause", "metric", "value",
    "worst_items"}]``, empty when all hold. Bad clauses raise ``LogitdiffError``."""
    report, _ = _load(report_or_dir)
    failures = []
    for req in parse_gates(requirements):
        value = metric_value(dict(report), req.metric)
        if value is None or not OPS[req.op](value, req.threshold):
            failures.append({"clause": req.text, "metric": req.metric, "value": value,
                             "worst_items": _worst_items(report, req.metric)})
    return failures


def assert_drift_within(report_or_dir: Any, requirements: str) -> None:
    """Fail (``DriftCheckFailed``, an ``AssertionError``) unless every clause of
    ``requirements``, e.g. ``"kl_mean<0.01,top1_disagreement<0.02"``, holds for the report."""
    failures = drift_failures(report_or_dir, requirements)
    if not failures:
        return
    report, where = _load(report_or_dir)
    cand = (report.get("candidate") or {}).get("spec") or (report.get("candidate") or {}).get("path") or "candidate"
    lines = [f"drift of {cand} ({where}) is not within {requirements!r}:"]
    for f in failures:
        value = "missing from the report" if f["value"] is None else f"{f['value']:.6g}"
        worst = ", ".join(f"{i} ({v:.4g})" for i, v in f["worst_items"])
        lines.append(f"  {f['clause']}: {f['metric']} = {value}" + (f"; worst items: {worst}" if worst else ""))
    raise DriftCheckFailed("\n".join(lines), failures)
