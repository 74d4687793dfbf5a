"""Quality gates: thresholds on report.json figures, with one grammar and two explicit kinds.

A clause is ``METRIC OP NUMBER`` with OP one of ``>``, ``>=``, ``<``, ``<=`` (whitespace
anywhere between the parts is ignored); a list of clauses is comma-separated,

    kl_mean>0.05, top1_disagreement>0.02, tool_call_malformed>0, accuracy_drop>=0.05

The grammar has one meaning; what a clause *is* is said by the name it is given under,
never by the clause itself, so a clause pasted from one place to another keeps its meaning:

* ``fail_on`` (CLI ``--fail-on``): the clause is a **failure condition**. ``kl_mean>0.05``
  is *crossed* when the mean KL is above 0.05.
* ``require`` (CLI ``--require``): the clause **must hold**. ``kl_mean<=0.05`` is *crossed*
  when the mean KL is above 0.05.

Both kinds are accepted under the same two names by the CLI (``--fail-on``/``--require``)
and by :func:`logitdiff.testing.assert_drift_within` (``fail_on=``/``require=``).

**Not evaluated.** A clause on a metric the report does not have (no ``flips`` section for
``diverged``, no ``correctness`` section for ``accuracy_drop``, a ``null`` such as
``x_noise_floor`` when the noise floor is exactly zero, ``benign`` / ``meaning_changed`` on
flips no judge classified: only ``--judge`` decides those) is neither crossed nor passed: it is
*not evaluated*, reported as such with the reason, and the CLI exits with its own status
(:data:`NOT_EVALUATED_EXIT`) so a CI job sees that the gate did not check anything. A
gate list *passes* only when every clause was evaluated and none was crossed.
Two definitions close gaps that are not missing data: an outcome rate (``*_rate``, a share
of the branched flips) is 0 when the run saw no top-1 flip at all, and ``accuracy_drop``
is rounded to 12 decimals so that k/n accuracies compare as written.

An empty gate string (``--fail-on ''``, ``fail_on=""``, only commas) is an error: it would
check nothing while looking like a check.

:func:`evaluate`'s result is what a report.json ``gates`` section holds; report.html shows
each candidate's crossed and not-evaluated gates in its header.

Pure functions, no I/O. :func:`judge` is the one place that evaluates gates and decides:
every caller (``compare``, ``flips``, ``run``, ``logitdiff.testing``) goes through it, and
:func:`exit_status` (which it calls) is the one rule from gates sections to an exit status.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..contracts import Gates, GateResult, Outcome, Report
from ..errors import LogitdiffError
from .metric_registry import GATE_METRICS

OPS: dict[str, Callable[[float, float], bool]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}

# name -> (one-line description, report.json paths tried in order), from the metric registry
_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {name: (m.describe(), m.paths) for name, m in GATE_METRICS.items()}

METRICS: dict[str, str] = {
    name: f"{desc} [report.json {' - '.join(paths) if name == 'accuracy_drop' else ' | '.join(paths)}]"
    for name, (desc, paths) in _SOURCES.items()
}


# Exit statuses of a command run with gates (0: every clause evaluated, none crossed; 2: an error).
CROSSED_EXIT = 3  # at least one clause crossed
NOT_EVALUATED_EXIT = 4  # none crossed, but at least one clause's metric is not in the report


class GateKind:
    """What a clause is: a failure condition (``--fail-on``) or a requirement (``--require``)."""

    FAIL_ON = "fail_on"
    REQUIRE = "require"
    ALL = (FAIL_ON, REQUIRE)
    FLAG = {FAIL_ON: "--fail-on", REQUIRE: "--require"}


@dataclass
class Gate:
    metric: str
    op: str
    threshold: float
    text: str  # the clause as shown in reports: "kl_mean>0.05", or "require kl_mean<=0.05"
    kind: str = GateKind.FAIL_ON

    @property
    def clause(self) -> str:
        """The clause as written, without the kind."""
        return self.text[len("require "):] if self.kind == GateKind.REQUIRE else self.text

    def crossed_by(self, value: float) -> bool:
        holds = OPS[self.op](value, self.threshold)
        return holds if self.kind == GateKind.FAIL_ON else not holds


# the metric and the operator at the start of a stripped clause; the number is the rest,
# stripped (a pattern over the whole clause, ``\s*(.*?)\s*$``, backtracked quadratically over
# a run of spaces inside it)
_CLAUSE_HEAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*([<>=!]+)")
_QUOTED_MAX = 80  # characters of a bad clause quoted in its error line


def _quoted(clause: str) -> str:
    """A clause as an error line quotes it: its start, and how long it is when that is cut."""
    if len(clause) <= _QUOTED_MAX:
        return repr(clause)
    return f"{clause[:_QUOTED_MAX]!r}... ({len(clause)} characters)"


def _known() -> str:
    return "known metrics: " + ", ".join(METRICS)


def parse_gates(text: str, kind: str = GateKind.FAIL_ON) -> list[Gate]:
    """``"kl_mean>0.05, top1_disagreement>0.02"`` -> gates of ``kind`` (fail_on: failure
    conditions; require: clauses that must hold); a one-line LogitdiffError naming the bad
    clause otherwise (unknown metric, bad operator, bad number), and for a string with no
    clause at all."""
    if kind not in GateKind.ALL:
        raise ValueError(f"gate kind {kind!r}: one of {GateKind.ALL}")
    flag = GateKind.FLAG[kind]
    if text is None or not str(text).replace(",", "").strip():
        raise LogitdiffError(f"{flag} {str(text or '')!r}: no clause; give METRIC OP NUMBER clauses, e.g. "
                             f"{'kl_mean>0.05' if kind == GateKind.FAIL_ON else 'kl_mean<=0.05'}, or leave {flag} out")
    gates = []
    for raw in str(text).split(","):
        clause = raw.strip()
        if not clause:
            continue
        m = _CLAUSE_HEAD.match(clause)
        if not m:
            raise LogitdiffError(f"gate {_quoted(clause)}: expected METRIC OP NUMBER with OP one of > >= < <=, e.g. kl_mean>0.05; {_known()}")
        metric, op = m.groups()
        num = clause[m.end():].strip()
        if metric not in METRICS:
            raise LogitdiffError(f"gate {_quoted(clause)}: unknown metric {_quoted(metric)}; {_known()}")
        if op not in OPS:
            raise LogitdiffError(f"gate {_quoted(clause)}: bad operator {_quoted(op)} (use one of > >= < <=); {_known()}")
        try:
            threshold = float(num)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold):
            raise LogitdiffError(f"gate {_quoted(clause)}: threshold {_quoted(num)} is not a finite number; {_known()}")
        written = f"{metric}{op}{num}"
        gates.append(Gate(metric=metric, op=op, threshold=threshold,
                          text=written if kind == GateKind.FAIL_ON else f"require {written}", kind=kind))
    return gates


def parse_gate_options(fail_on: str | None = None, require: str | None = None) -> list[Gate]:
    """Both kinds of clauses, failure conditions first; None (the option not given) adds none,
    an empty string is an error (see :func:`parse_gates`)."""
    gates: list[Gate] = []
    if fail_on is not None:
        gates += parse_gates(fail_on, GateKind.FAIL_ON)
    if require is not None:
        gates += parse_gates(require, GateKind.REQUIRE)
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
    if _judged_without_judge(report, metric):
        return None  # benign / meaning_changed without a judge: not decided, never a 0 (missing_reason says why)
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


_SECTION_HINT = {
    "flips": "the report has no flips section (run `logitdiff flips REPORT`, or `run` without --no-flips)",
    "correctness": "the report has no correctness section (labelled items graded by `logitdiff flips` or `run`)",
}


def _outcome_of(metric: str) -> str | None:
    """The flip outcome a gate metric counts (``meaning_changed``, ``diverged_rate``...), else None."""
    o = metric[: -len("_rate")] if metric.endswith("_rate") else metric
    return o if o in Outcome.ALL else None


def _judged_without_judge(report: Report, metric: str) -> bool:
    """A clause on benign / meaning_changed (or their rates) against a flips section that has
    no count of it: no judge classified its branches (those classes are decided only by a
    named judge, ``--judge``), so the count is not 0 but undecided, also where nothing flipped.
    A report before 2.1 carries its own classifier's counts, and they are read."""
    flips = report.get("flips")
    outcome = _outcome_of(metric)
    return (outcome in Outcome.JUDGED and isinstance(flips, Mapping)
            and outcome not in (flips.get("outcomes") or {}) and not flips.get("meaning_judged_by"))


def missing_reason(report: Report, metric: str) -> str:
    """Why ``metric`` has no value in ``report``, in words (for a clause that is not evaluated)."""
    paths = _SOURCES[metric][1]
    section = paths[0].split(".")[0]
    if section in _SECTION_HINT and not isinstance(report.get(section), Mapping):
        return _SECTION_HINT[section]
    outcome = _outcome_of(metric)
    if _judged_without_judge(report, metric):
        return (f"{outcome} is decided only by a named judge (--judge SOURCE) and this report's flips were not judged: "
                f"gate the rule-decided classes instead (diverged, answer_changed, tests_failed, tool_call_changed, "
                f"tool_call_malformed)")
    flips = report.get("flips")
    if outcome in Outcome.RULE and isinstance(flips, Mapping) and outcome not in (flips.get("outcomes") or {}):
        return (f"the report's flips were classified before report 2.1 ({flips.get('meaning_judged_by')}), "
                f"which has no {outcome} class: classify them again (`logitdiff flips REPORT`)")
    if metric == "x_noise_floor":
        nf = get_path(report, "summary.noise_floor")
        if not isinstance(nf, Mapping):
            return "the report has no noise floor (compare --noise-floor RUN, or run without --no-noise-floor)"
        return "the noise floor is exactly 0 (a bit-identical rerun), so no ratio to it exists"
    if metric.endswith("_rate"):
        return "no flip was branched, so no share of branches exists"
    return f"report.json has no number at {' / '.join(paths)}"


def evaluate(report: Report, gates: list[Gate]) -> Gates:
    """Every gate against ``report``: ``{"gates": [...], "crossed": [gate texts],
    "not_evaluated": [gate texts], "passed": bool}``.

    A gate whose metric is missing from the report is not evaluated (neither crossed nor
    passed); ``passed`` is true only when every gate was evaluated and none was crossed."""
    out: list[GateResult] = []
    for g in gates:
        v = metric_value(report, g.metric)
        missing = v is None
        r: GateResult = {"gate": g.text, "metric": g.metric, "op": g.op, "threshold": g.threshold, "value": v,
                         "crossed": bool(v is not None and g.crossed_by(v)), "missing": missing, "kind": g.kind}
        if missing:
            r["reason"] = missing_reason(report, g.metric)
        out.append(r)
    crossed = [r["gate"] for r in out if r["crossed"]]
    not_evaluated = [r["gate"] for r in out if r["missing"]]
    return {"gates": out, "crossed": crossed, "not_evaluated": not_evaluated, "passed": not crossed and not not_evaluated}


def not_evaluated_of(section: Mapping | None) -> list[str]:
    """The not-evaluated gate texts of a report.json ``gates`` section, also of one written
    before schema 1.2 (where a missing metric was listed as crossed)."""
    if not section:
        return []
    if "not_evaluated" in section:
        return list(section["not_evaluated"])
    return [g["gate"] for g in section.get("gates") or [] if g.get("missing")]


def crossed_of(section: Mapping | None) -> list[str]:
    """The crossed gate texts of a ``gates`` section (before 1.2, without the missing ones)."""
    if not section:
        return []
    missing = set() if "not_evaluated" in section else {g["gate"] for g in section.get("gates") or [] if g.get("missing")}
    return [g for g in section.get("crossed") or [] if g not in missing]


def judge(report: Report, gates: list[Gate]) -> tuple[Gates, int]:
    """Every gate against ``report`` (:func:`evaluate`; the report is not changed) and what
    that decides: the report.json ``gates`` section and its exit status (:func:`exit_status`:
    0 when it passes)."""
    section = evaluate(report, list(gates))
    return section, exit_status([section])


def exit_status(sections: list[Mapping | None]) -> int:
    """The exit status of a command that evaluated these ``gates`` sections: CROSSED_EXIT when
    any gate is crossed, else NOT_EVALUATED_EXIT when any is not evaluated, else 0."""
    if any(crossed_of(s) for s in sections):
        return CROSSED_EXIT
    if any(not_evaluated_of(s) for s in sections):
        return NOT_EVALUATED_EXIT
    return 0
