"""Quality gates: thresholds on report.json figures that a candidate must not cross.

A gate names a failure condition: ``kl_mean>0.05`` is *crossed* when the candidate's mean
KL is above 0.05. A list of gates is written as comma-separated clauses,

    kl_mean>0.05, top1_disagreement>0.02, tool_call_malformed>0, accuracy_drop>=0.05

each ``METRIC OP NUMBER`` with OP one of ``>``, ``>=``, ``<``, ``<=`` (whitespace anywhere
between the parts is ignored, blank clauses are skipped). :data:`METRICS` lists the metric
names and where in report.json each is read.

**Fail closed.** A gate whose metric the report does not have (no ``flips`` section for
``meaning_changed``, no ``correctness`` section for ``accuracy_drop``, a ``null`` such as
``x_noise_floor`` when the noise floor is exactly zero) cannot be shown to hold, so it is
reported with ``missing: true`` and counts as crossed. Gate only on what the run measures.
Two definitions close gaps that are not missing data: an outcome rate (``*_rate``, a share
of the branched flips) is 0 when the run saw no top-1 flip at all, and ``accuracy_drop``
is rounded to 12 decimals so that k/n accuracies compare as written.

:func:`evaluate`'s result is what a report.json ``gates`` section holds; report.html shows
each candidate's crossed gates in red in its header.

Pure functions, no I/O: the CLI reads report.json, calls :func:`evaluate` and decides.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .contracts import Gates, GateResult, Outcome, Report
from .errors import LogitdiffError

OPS: dict[str, Callable[[float, float], bool]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}

# name -> (one-line description, report.json paths tried in order)
_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kl_mean": ("mean forward KL(P_ref||P_cand) per position, nats", ("summary.metrics.kl_nats.mean", "summary.kl_nats_mean")),
    "kl_p95": ("95th percentile of per-position forward KL, nats", ("summary.metrics.kl_nats.p95", "summary.kl_nats_p95")),
    "kl_p99": ("99th percentile of per-position forward KL, nats", ("summary.metrics.kl_nats.p99",)),
    "kl_max": ("largest per-position forward KL, nats", ("summary.metrics.kl_nats.max", "summary.kl_nats_max")),
    "kl_rev_mean": ("mean reverse KL(P_cand||P_ref), nats", ("summary.metrics.kl_rev_nats.mean",)),
    "jsd_mean": ("mean Jensen-Shannon divergence, nats", ("summary.metrics.jsd_nats.mean",)),
    "top1_disagreement": ("share (0-1) of positions whose top-1 token differs", ("summary.top1_disagreement.rate",)),
    "ppl_ratio": ("candidate perplexity / reference perplexity on the teacher tokens", ("summary.ppl_ratio",)),
    "x_noise_floor": ("mean KL / mean KL of the reference against its own rerun (null, so missing, when that floor is 0)",
                      ("summary.kl_mean_x_noise_floor",)),
    "flips": ("number of top-1 flips (positions where the top-1 tokens differ) counted by `logitdiff flips`, "
              "ties at the reference (flips.n_ties) excluded", ("flips.n_flips",)),
}
for _o in Outcome.ALL:
    _SOURCES[_o] = (f"branched flips (ties excluded) whose outcome is {_o} ({Outcome.TEXT[_o]}), a count", (f"flips.outcomes.{_o}",))
for _o in Outcome.ALL:
    _SOURCES[f"{_o}_rate"] = (f"share (0-1) of branched flips whose outcome is {_o}; 0 when there were no flips at all",
                              (f"flips.rates.{_o}",))
_SOURCES.update({
    "accuracy_ref": ("share (0-1) of labelled items the reference answers correctly", ("correctness.accuracy_ref",)),
    "accuracy_cand": ("share (0-1) of labelled items the candidate answers correctly", ("correctness.accuracy_cand",)),
    "accuracy_drop": ("accuracy_ref - accuracy_cand (positive: the candidate is worse)", ("correctness.accuracy_ref", "correctness.accuracy_cand")),
    "right_to_wrong": ("labelled items the reference gets right and the candidate wrong", ("correctness.right_to_wrong",)),
    "wrong_to_right": ("labelled items the reference gets wrong and the candidate right", ("correctness.wrong_to_right",)),
    "tool_call_valid_cand": ("share (0-1) of tool items where the candidate's tool call is valid", ("correctness.tool_call_valid_cand",)),
})

METRICS: dict[str, str] = {
    name: f"{desc} [report.json {' - '.join(paths) if name == 'accuracy_drop' else ' | '.join(paths)}]"
    for name, (desc, paths) in _SOURCES.items()
}


@dataclass
class Gate:
    metric: str
    op: str
    threshold: float
    text: str

    def crossed_by(self, value: float) -> bool:
        return OPS[self.op](value, self.threshold)


_CLAUSE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*([<>=!]+)\s*(.*?)\s*$")


def _known() -> str:
    return "known metrics: " + ", ".join(METRICS)


def parse_gates(text: str) -> list[Gate]:
    """``"kl_mean>0.05, top1_disagreement>0.02"`` -> gates; a one-line LogitdiffError naming the
    bad clause otherwise (unknown metric, bad operator, bad number)."""
    gates = []
    for raw in str(text).split(","):
        clause = raw.strip()
        if not clause:
            continue
        m = _CLAUSE.match(clause)
        if not m:
            raise LogitdiffError(f"gate {clause!r}: expected METRIC OP NUMBER with OP one of > >= < <=, e.g. kl_mean>0.05; {_known()}")
        metric, op, num = m.groups()
        if metric not in METRICS:
            raise LogitdiffError(f"gate {clause!r}: unknown metric {metric!r}; {_known()}")
        if op not in OPS:
            raise LogitdiffError(f"gate {clause!r}: bad operator {op!r} (use one of > >= < <=); {_known()}")
        try:
            threshold = float(num)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold):
            raise LogitdiffError(f"gate {clause!r}: threshold {num!r} is not a finite number; {_known()}")
        gates.append(Gate(metric=metric, op=op, threshold=threshold, text=f"{metric}{op}{num}"))
    return gates


def get_path(obj: Any, path: str):
    """``get_path(report, "summary.metrics.kl_nats.mean")``; None where any step is missing."""
    for part in path.split("."):
        if not isinstance(obj, Mapping) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _num(x) -> float | None:
    """A finite JSON number as float; None for null, NaN, infinities, booleans and strings."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def metric_value(report: Report, metric: str) -> float | None:
    """The metric's value in ``report`` (a report.json object); None when the report lacks it."""
    if metric not in _SOURCES:
        raise LogitdiffError(f"unknown gate metric {metric!r}; {_known()}")
    paths = _SOURCES[metric][1]
    if metric == "accuracy_drop":
        ref, cand = (_num(get_path(report, p)) for p in paths)
        # Rounded so that k/n fractions compare as written (0.5 - 0.45 is 0.04999999999999993).
        return None if ref is None or cand is None else round(ref - cand, 12)
    for p in paths:
        v = _num(get_path(report, p))
        if v is not None:
            return v
    if metric.endswith("_rate") and _num(get_path(report, "flips.n_flips")) == 0:
        return 0.0  # no top-1 flips at all: nothing branched, so no flip had this outcome
    return None


def evaluate(report: Report, gates: list[Gate]) -> Gates:
    """Every gate against ``report``: ``{"gates": [...], "crossed": [gate texts], "passed": bool}``.

    A gate whose metric is missing from the report counts as crossed (fail closed)."""
    out: list[GateResult] = []
    for g in gates:
        v = metric_value(report, g.metric)
        missing = v is None
        out.append({"gate": g.text, "metric": g.metric, "op": g.op, "threshold": g.threshold, "value": v,
                    "crossed": bool(missing or g.crossed_by(v)), "missing": missing})
    crossed = [r["gate"] for r in out if r["crossed"]]
    return {"gates": out, "crossed": crossed, "passed": not crossed}
