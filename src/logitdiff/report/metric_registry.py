"""Every metric logitdiff reports, declared once.

A :class:`Metric` says what a figure means, its unit, which way is bad, how the per-position
(or per-item) values are summarised into it, which functions compute it, and where it sits in
report.json. The gates (:mod:`logitdiff.report.gates`: which names a clause may use, their
descriptions and paths), the page's table headers and tooltips (:mod:`logitdiff.report.html`),
report.md's summary table, :func:`logitdiff.testing.assert_drift_within`'s messages and
the docs' metric and gate tables (``scripts/docs_tables.py``) are all generated from :data:`METRICS`
and :data:`SERIES`; tests/test_metric_registry.py checks that every metric in a real
report.json is registered and every registered one is in it.

Pure declarations: no I/O, nothing computed here (the formulas: docs/formulas.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..contracts import Outcome


class Direction:
    """Which way a metric is bad."""

    HIGHER_WORSE = "higher is worse"
    HIGHER_BETTER = "higher is better"
    NEUTRAL = "neutral"  # a context figure (a count of what was examined, a test's p-value)
    ALL = (HIGHER_WORSE, HIGHER_BETTER, NEUTRAL)


@dataclass(frozen=True)
class Series:
    """A per-position metric: one value per scored position (a tokens.parquet column), summarised
    under ``summary.metrics.<name>`` and ``items[].<name>`` as a :class:`~logitdiff.contracts.Stats`."""

    name: str  # the report.json / tokens.parquet key
    label: str  # report.md's row label
    meaning: str
    unit: str
    computed_by: tuple[str, ...]  # dotted names of the functions that compute it


@dataclass(frozen=True)
class Metric:
    """One summary figure of a report (a gate name when ``gate``)."""

    name: str  # the gate / column name
    header: str  # the short column header on the page and in tables
    meaning: str  # one line: what it is
    unit: str
    direction: str  # a Direction
    aggregate: str  # how it is summarised from per-position or per-item values
    computed_by: tuple[str, ...]  # dotted names: the per-position function, then the summarising one
    paths: tuple[str, ...]  # report.json paths tried in order ("summary.json:" for a summary.json field)
    fmt: str = "g"  # how the page prints it: g, int (a count), p (a p-value), pct, pct1, x, ratio, bytes
    gate: bool = True  # a --fail-on / --require clause may name it
    item: tuple[str, str | None] | None = None  # per-item figure ranking the worst items: (items[] field, key)
    html_key: str | None = None  # the page's column key when it differs from ``name``
    short_fmt: str | None = None  # how the terse summary tables (terminal, summary.md) print it, when not as ``fmt``

    @property
    def table_fmt(self) -> str:
        """The format of its column in the summary tables."""
        return self.short_fmt or self.fmt

    @property
    def key(self) -> str:
        return self.html_key or self.name

    def describe(self) -> str:
        """One line: meaning, unit, direction, aggregate."""
        return f"{self.meaning}; {self.unit}, {self.direction}; {self.aggregate}"


SERIES: dict[str, Series] = {s.name: s for s in (
    Series("kl_nats", "KL(ref‖cand) nats", "forward KL divergence D_KL(P_ref‖P_cand) at one position", "nats",
           ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.metrics.topk")),
    Series("kl_rev_nats", "KL(cand‖ref) nats", "reverse KL divergence D_KL(P_cand‖P_ref) at one position", "nats",
           ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.metrics.topk")),
    Series("jsd_nats", "JSD nats", "Jensen-Shannon divergence of the two distributions at one position", "nats",
           ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.metrics.topk")),
)}

_KL = ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.summarize.describe")
_BOOT = "mean over positions, 95 % CI from an item bootstrap"
_FLIPS = ("logitdiff.flips.find_flips", "logitdiff.flips.summarize_branches")
_CORR = ("logitdiff.flips.grading.grade", "logitdiff.flips.consequences.correctness_section")
_W, _B, _N = Direction.HIGHER_WORSE, Direction.HIGHER_BETTER, Direction.NEUTRAL


def _m(*args, **kw) -> Metric:
    return Metric(*args, **kw)


_DECLARED: tuple[Metric, ...] = (
    # how far the candidate drifts (per-position metrics, summarised)
    _m("kl_mean", "mean KL", "mean forward KL(P_ref‖P_cand) per position", "nats", _W, _BOOT,
       (*_KL, "logitdiff.numerics.summarize.bootstrap_mean_ci"), ("summary.metrics.kl_nats.mean", "summary.kl_nats_mean"),
       item=("kl_nats", "mean")),
    _m("kl_p95", "p95 KL", "95th percentile of per-position forward KL", "nats", _W, "95th percentile over positions",
       _KL, ("summary.metrics.kl_nats.p95", "summary.kl_nats_p95"), item=("kl_nats", "p95")),
    _m("kl_p99", "p99 KL", "99th percentile of per-position forward KL", "nats", _W, "99th percentile over positions",
       _KL, ("summary.metrics.kl_nats.p99",), item=("kl_nats", "p99")),
    _m("kl_max", "max KL", "largest per-position forward KL", "nats", _W, "maximum over positions",
       _KL, ("summary.metrics.kl_nats.max", "summary.kl_nats_max"), item=("kl_nats", "max")),
    _m("kl_rev_mean", "mean reverse KL", "mean reverse KL(P_cand‖P_ref) per position", "nats", _W, _BOOT,
       (*_KL, "logitdiff.numerics.summarize.bootstrap_mean_ci"), ("summary.metrics.kl_rev_nats.mean",), item=("kl_rev_nats", "mean")),
    _m("kl_rev_p95", "p95 reverse KL", "95th percentile of per-position reverse KL", "nats", _W, "95th percentile over positions",
       _KL, ("summary.metrics.kl_rev_nats.p95",), gate=False, item=("kl_rev_nats", "p95")),
    _m("kl_rev_p99", "p99 reverse KL", "99th percentile of per-position reverse KL", "nats", _W, "99th percentile over positions",
       _KL, ("summary.metrics.kl_rev_nats.p99",), gate=False, item=("kl_rev_nats", "p99")),
    _m("jsd_mean", "mean JSD", "mean Jensen-Shannon divergence per position", "nats", _W, _BOOT,
       (*_KL, "logitdiff.numerics.summarize.bootstrap_mean_ci"), ("summary.metrics.jsd_nats.mean",), item=("jsd_nats", "mean")),
    _m("top1_disagreement", "top-1 disagreement", "share of positions whose top-1 token differs", "share (0-1)", _W,
       "share of positions, 95 % CI from an item bootstrap",
       ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.summarize.summarize_group"), ("summary.top1_disagreement.rate",),
       fmt="pct", item=("top1_disagreement", "rate"), html_key="top1"),
    _m("x_noise_floor", "× noise floor", "mean KL / mean KL of the reference against a rerun of itself (other batch mates on CPU)", "ratio", _W,
       "mean KL divided by the noise floor's mean KL (null when that floor is 0: not evaluated)",
       ("logitdiff.report.build_report",), ("summary.kl_mean_x_noise_floor",), fmt="x"),
    _m("x_cross_engine_floor", "× cross-engine floor", "mean KL / mean KL of the reference's own weights in another engine "
       "(the BF16 GGUF through llama.cpp in the default run)", "ratio", _W,
       "mean KL divided by the cross-engine floor's mean KL (a `logitdiff run` figure)",
       ("logitdiff.pipeline.run_pipeline",), ("summary.json:candidates[].x_cross_engine_floor",), fmt="x", gate=False),
    _m("ppl_ratio", "PPL ratio", "candidate perplexity / reference perplexity on the teacher tokens", "ratio", _W,
       "exp(mean NLL of the candidate - mean NLL of the reference) over positions",
       ("logitdiff.numerics.metrics.full_vocab", "logitdiff.numerics.summarize.summarize_group"), ("summary.ppl_ratio",),
       fmt="ratio", item=("ppl_ratio", None)),
    # what the drift does: flips and their branches
    _m("flips", "top-1 flips", "top-1 flips (positions where the two top-1 tokens differ), ties at the reference "
       "(flips.n_ties) excluded", "count", _W, "count over positions", _FLIPS, ("flips.n_flips",), html_key="flips_n_flips"),
    _m("flip_branches", "branches", "flips the candidate continued from (flips.selection says which, and the cap)",
       "count", _N, "count of branched flips", _FLIPS, ("flips.n_branches",), gate=False, html_key="flips_n_branches", fmt="int"),
    *(_m(o, o.replace("_", " "), f"branched flips (ties excluded) whose outcome is {o}: {Outcome.TEXT[o]}", "count",
         _W if o in Outcome.BAD else _N, "count of branched flips", ("logitdiff.flips.classify", _FLIPS[1]),
         (f"flips.outcomes.{o}",), html_key=f"flips_{o}") for o in Outcome.ALL),
    *(_m(f"{o}_rate", f"{o.replace('_', ' ')} rate", f"share of branched flips whose outcome is {o}; 0 when there were no flips at all",
         "share (0-1)", _W if o in Outcome.BAD else _N, "share of branched flips", ("logitdiff.flips.classify", _FLIPS[1]),
         (f"flips.rates.{o}",), fmt="pct") for o in Outcome.ALL),
    _m("flip_ties", "ties (not flips)", "positions where the reference's own top two are tied: the engines broke the tie; "
       "not branched", "count", _N, "count over positions", _FLIPS, ("flips.n_ties",), gate=False, html_key="flips_n_ties", fmt="int"),
    _m("flips_left_out", "over the cap", "selected flips the --max-branches cap left out (the flips section lists them)",
       "count", _N, "count of selected flips", _FLIPS, ("flips.left_out.n",), gate=False),
    _m("flips_ref_not_top1", "not own top-1", "positions where the token the reference wrote is not its own scored top-1 "
       "(generation and scoring in other batch shapes): the reference's self-consistency", "count", _N, "count over positions",
       ("logitdiff.flips.reference_self_consistency",), ("flips.reference_self_consistency.n_written_not_top1",), gate=False),
    # what the drift does: labelled answers and tool calls
    _m("accuracy_ref", "reference accuracy", "share of labelled items the reference's free-running answer gets right", "share (0-1)", _B,
       "share of labelled items, Wilson 95 % CI", _CORR, ("correctness.accuracy_ref",), fmt="pct1"),
    _m("accuracy_cand", "candidate accuracy", "share of labelled items the candidate's free-running answer gets right", "share (0-1)", _B,
       "share of labelled items, Wilson 95 % CI", _CORR, ("correctness.accuracy_cand",), fmt="pct1"),
    _m("accuracy_drop", "accuracy drop", "accuracy_ref - accuracy_cand (positive: the candidate is worse)", "share (0-1)", _W,
       "difference of the two shares, rounded to 12 decimals", _CORR, ("correctness.accuracy_ref", "correctness.accuracy_cand"),
       fmt="pct1"),
    _m("accuracy_diff", "accuracy change", "accuracy_cand - accuracy_ref (negative: the candidate is worse)", "share (0-1)", _B,
       "difference of the two shares, 95 % CI from a paired item bootstrap", ("logitdiff.flips.grading.paired_diff_ci", _CORR[1]),
       ("correctness.accuracy_diff",), fmt="pct1", gate=False),
    _m("right_to_wrong", "right→wrong", "labelled items the reference gets right and the candidate wrong", "count", _W,
       "count of labelled items", _CORR, ("correctness.right_to_wrong",), fmt="int"),
    _m("right_to_truncated", "right→truncated", "labelled items the reference gets right and the candidate's output is cut at the "
       "token budget, not right (an answer that changed, apart from right→wrong)", "count", _W, "count of labelled items", _CORR,
       ("correctness.right_to_truncated",), fmt="int"),
    _m("wrong_to_right", "wrong→right", "labelled items the reference gets wrong and the candidate right", "count", _B,
       "count of labelled items", _CORR, ("correctness.wrong_to_right",), fmt="int"),
    _m("mcnemar_p", "McNemar p", "exact McNemar test of the correctness flips (below 0.05: the accuracy change is "
       "significant)", "p-value", _N, "two-sided exact binomial test of right→wrong vs wrong→right",
       ("logitdiff.flips.grading.mcnemar_exact", _CORR[1]), ("correctness.mcnemar_p",), gate=False, fmt="p"),
    _m("tool_call_valid_ref", "valid tool calls (reference)", "share of tool items whose reference tool call parses and validates",
       "share (0-1)", _B, "share of tool items", ("logitdiff.flips.toolcalls.parse_tool_calls", _CORR[1]),
       ("correctness.tool_call_valid_ref",), fmt="pct1", gate=False),
    _m("tool_call_valid_cand", "valid tool calls", "share of tool items whose candidate tool call parses and "
       "validates", "share (0-1)", _B, "share of tool items", ("logitdiff.flips.toolcalls.parse_tool_calls", _CORR[1]),
       ("correctness.tool_call_valid_cand",), fmt="pct1", short_fmt="pct0"),
    _m("cut_cand", "cut at budget", "the candidate's free-running outputs that hit the token budget: graded truncated, not wrong",
       "count", _W, "count of labelled items", _CORR, ("correctness.cut_cand",), gate=False),
)

METRICS: dict[str, Metric] = {m.name: m for m in _DECLARED}
assert len(METRICS) == len(_DECLARED), "a metric name is declared twice"

GATE_METRICS: dict[str, Metric] = {n: m for n, m in METRICS.items() if m.gate}


@dataclass(frozen=True)
class PairedColumn:
    """A summary-table column that shows two metrics side by side (reference → candidate),
    each in its own format."""

    name: str
    header: str
    ref: str  # the reference side's metric
    cand: str  # the candidate side's metric


ACCURACY_PAIR = PairedColumn("accuracy", "accuracy (reference → candidate)", "accuracy_ref", "accuracy_cand")
# A summary-table column of the attribution counts (correctness.attributed, summary.json
# candidates[].attributed): of the changed answers, how many have a teacher-forced flip, and
# how many a branch (report.verdict.attributed_cell words one).
ATTRIBUTED = "attributed"
ATTRIBUTED_HEADER = "changed answers at a flip, branched"

# The summary tables of `logitdiff run` (its terminal tables and summary.md): the metric
# (summary.json candidate-row field) of each column, in order; headers and formats are the
# metrics' own. DRIFT_TABLE's come from the comparison, CONSEQUENCE_TABLE's from flips and
# correctness (each outcome from the row's flip_outcomes).
DRIFT_TABLE = ("kl_mean", "kl_p99", "jsd_mean", "top1_disagreement", "ppl_ratio", "x_noise_floor", "x_cross_engine_floor")
CONSEQUENCE_TABLE = ("flip_branches", *Outcome.ALL, "flip_ties", ACCURACY_PAIR.name, "right_to_wrong", "right_to_truncated",
                     "wrong_to_right", "mcnemar_p", ATTRIBUTED, "tool_call_valid_cand")


def consequence_columns(rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """CONSEQUENCE_TABLE for these summary.json candidate rows: of the outcome columns, those
    that occur in some row's flip_outcomes (ten would not fit a terminal, and a table names no
    class its run does not have: without a judge, never benign or meaning_changed)."""
    occurring = set(Outcome.occurring(*(r.get("flip_outcomes") or {} for r in rows)))
    return tuple(n for n in CONSEQUENCE_TABLE if n not in Outcome.ALL or n in occurring)


def header(name: str, measure: str | None = None) -> str:
    """The one header of a summary column, on every surface (terminal, summary.md, report.md,
    report.html, the verdict lines). ``measure`` (contracts.Measure) names the accuracy pair's
    share where the workload is a benchmark: "pass rate (reference → candidate)"."""
    if name == ACCURACY_PAIR.name:
        return ACCURACY_PAIR.header.replace("accuracy", measure, 1) if measure else ACCURACY_PAIR.header
    return ATTRIBUTED_HEADER if name == ATTRIBUTED else METRICS[name].header


def markdown_table() -> str:
    """The metric table of docs/compare.md (scripts/docs_tables.py writes it between its markers)."""
    lines = ["| metric | what it is | unit | direction | summarised as | gate | report.json |",
             "|---|---|---|---|---|---|---|"]
    for m in METRICS.values():
        where = " − ".join(m.paths) if m.name == "accuracy_drop" else " \\| ".join(m.paths)
        lines.append(f"| `{m.name}` | {m.meaning.replace('|', chr(92) + '|')} | {m.unit} | {m.direction} | {m.aggregate} | "
                     f"{'yes' if m.gate else 'no'} | `{where}` |")
    lines += ["", "Per-position series (`summary.metrics.*`, `items[].*`, tokens.parquet columns; each summarised as mean, "
              "p50, p90, p95, p99, p99.9, max and the mean's item-bootstrap 95 % CI):", "",
              "| series | what it is | unit |", "|---|---|---|"]
    lines += [f"| `{s.name}` | {s.meaning} | {s.unit} |" for s in SERIES.values()]
    return "\n".join(lines) + "\n"
