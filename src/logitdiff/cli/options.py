"""Argument checks and options shared by several commands; their defaults are the
library's own (one place for each), so a command's ``--help`` and the Python API agree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from ..api import MAX_BOOTSTRAP
from ..errors import LogitdiffError

from ..report.gates import CROSSED_EXIT as GATES_EXIT, NOT_EVALUATED_EXIT

if TYPE_CHECKING:
    from ..contracts import Report

GATES_HELP = f"""\
Gates: --fail-on and --require take comma-separated METRIC OP NUMBER clauses (OP: > >= < <=);
each may be given more than once, and every clause of every one counts.
A --fail-on clause is a failure condition (--fail-on 'kl_mean>0.05' is crossed when the mean
KL is above 0.05); a --require clause must hold (--require 'kl_mean<=0.05' is crossed when it
does not). The same grammar, names and meaning as assert_drift_within(REPORT, fail_on=...,
require=...) in logitdiff.testing. A clause on a metric the report does not have (e.g.
tool_call_malformed on a compare report, which has no flips section) is NOT EVALUATED: never
counted as crossed, printed with the reason. An empty clause list is an error.
Exit status: 0 every clause evaluated and none crossed; {GATES_EXIT} a clause crossed; {NOT_EVALUATED_EXIT} no
clause crossed but one not evaluated; 2 an error."""
FAIL_ON_HELP = "failure conditions, e.g. 'kl_mean>0.05,top1_disagreement>0.02': exit status 3 when any holds"
REQUIRE_HELP = "clauses that must hold, e.g. 'kl_mean<=0.05,top1_disagreement<=0.02': exit status 3 when any does not"


def parse_ranges_arg(text: str):
    from ..numerics.summarize import parse_ranges

    try:
        return parse_ranges(text)
    except ValueError as e:
        raise LogitdiffError(str(e)) from None


def check_at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise LogitdiffError(f"{flag} {value}: must be at least {low}")


def parse_gate_args(args):
    """The gates of every ``--fail-on`` and ``--require`` given (each repeatable: all their
    clauses count, failure conditions first; None when neither is given); an empty clause
    list or a bad clause is a one-line error."""
    from ..report.gates import GateKind, parse_gates

    given = {GateKind.FAIL_ON: getattr(args, "fail_on", None) or [], GateKind.REQUIRE: getattr(args, "require", None) or []}
    if not any(given.values()):
        return None
    return [g for kind, texts in given.items() for text in texts for g in parse_gates(text, kind)]


def gate_exit(reports: Sequence[Report]) -> int:
    """The gates' exit status (gates.exit_status) over ``reports``, each crossed or
    not-evaluated gate printed with its candidate."""
    from ..report.gates import exit_status
    from .console import console

    sections = [(r["candidate"].get("spec") or r["candidate"].get("path"), r.get("gates")) for r in reports]
    print_gates(console(), [(who, g) for who, g in sections if g])
    return exit_status([g for _, g in sections])


def print_gates(con, per_candidate: list) -> None:
    """``gate crossed`` (red) and ``gate not evaluated`` (yellow, with the reason) lines for
    (candidate, report.json gates section) pairs: ``compare`` and ``run`` print the same lines."""
    for who, g in per_candidate:
        for line in gate_lines(who, g):
            con.print(line)


def gate_lines(who: str, g: Mapping) -> list[str]:
    """The console lines of one report.json ``gates`` section: each crossed gate with the
    metric's value, each not-evaluated gate with the reason its metric is missing."""
    from ..report.gates import crossed_of, not_evaluated_of

    results = {x["gate"]: x for x in g.get("gates") or []}
    lines = []
    for text in crossed_of(g):
        x = results.get(text) or {}
        value = "" if x.get("value") is None else f" (value {x['value']:.6g})"
        lines.append(f"[bold red]gate crossed[/]: {who}: {text}{value}")
    for text in not_evaluated_of(g):
        why = (results.get(text) or {}).get("reason") or "the report does not have this metric"
        lines.append(f"[bold yellow]gate not evaluated[/]: {who}: {text}: {why}")
    return lines


def add_ranges(p) -> None:
    from ..numerics.summarize import DEFAULT_RANGES, format_ranges

    p.add_argument("--ranges", default=format_ranges(DEFAULT_RANGES), help="output-position range edges (default: %(default)s)")


def add_bootstrap(p) -> None:
    from ..numerics.summarize import DEFAULT_BOOTSTRAP

    p.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
                   help=f"bootstrap resamples of items for 95%% CIs, 0 (no CIs) to {MAX_BOOTSTRAP} (default: %(default)s)")


def add_logprob_floor(p) -> None:
    p.add_argument("--logprob-floor", type=float, default=None, metavar="NATS",
                   help="top-K comparisons only: a stated lower bound on every log-probability of both models "
                        "(e.g. -2c - ln V for a model whose final logits are soft-capped at c, as Gemma 2's at 30). "
                        "It gives forward and reverse KL a finite proven upper bound; a listed log-probability below it "
                        "is an error. Recorded as method.logprob_floor_nats (default: none; the upper bound is inf)")


def add_reference_run(p, help: str) -> None:
    """``--reference RUN`` (the reference RUN; ``args.reference_run``) and its old name
    ``--teacher``, accepted until DEPRECATED_UNTIL and no longer listed in --help (see
    :func:`reference_run_arg`)."""
    import argparse

    p.add_argument("--reference", dest="reference_run", metavar="RUN", help=help)
    p.add_argument("--teacher", dest="teacher_run", metavar="RUN", help=argparse.SUPPRESS)


def reference_run_arg(args) -> str | None:
    """The reference RUN of ``--reference`` or of its deprecated name ``--teacher`` (then one
    line on stderr says so), None when neither is given; both given is an error."""
    import sys

    from ..errors import DEPRECATED_UNTIL

    new, old = getattr(args, "reference_run", None), getattr(args, "teacher_run", None)
    if new is not None and old is not None:
        raise LogitdiffError(f"--teacher and --reference both given: --teacher is the deprecated name of --reference "
                             f"(accepted until {DEPRECATED_UNTIL}); give --reference only")
    if old is not None:
        print(f"logitdiff: --teacher is deprecated, use --reference (accepted until {DEPRECATED_UNTIL})", file=sys.stderr)
        return str(old)
    return new


def required_reference_run(args, why: str) -> str:
    """:func:`reference_run_arg` for a command that cannot run without the reference RUN
    (``why``: what it is for, in the error)."""
    run = reference_run_arg(args)
    if run is None:
        raise LogitdiffError(f"--reference RUN is required: {why}")
    return run


def add_chunk_size(p) -> None:
    from ..store import CHUNK_SIZE_HELP

    p.add_argument("--chunk-size", default=None, metavar="BYTES", help=CHUNK_SIZE_HELP)


def add_gate_options(p, extra: str = "") -> None:
    """--fail-on and --require (gates.GateKind), documented together in the command's epilog."""
    p.add_argument("--fail-on", metavar="CLAUSES", action="append", help=FAIL_ON_HELP + extra + "; repeatable; see Gates below")
    p.add_argument("--require", metavar="CLAUSES", action="append", help=REQUIRE_HELP + extra + "; repeatable; see Gates below")
    p.epilog = ((p.epilog + "\n\n") if p.epilog else "") + GATES_HELP


def add_max_branches(p) -> None:
    from ..defaults import DEFAULT_MAX_BRANCHES

    p.add_argument("--max-branches", type=int, default=DEFAULT_MAX_BRANCHES,
                   help="branches per candidate at most; the highest-KL flips are kept (default: %(default)s)")


def check_max_branches(n: int | None) -> None:
    if n is not None and n < 0:
        raise LogitdiffError("--max-branches must be >= 0")


def add_judge(p) -> None:
    """--judge SOURCE (flips.judge): ``flips`` and ``run`` alike."""
    from ..defaults import JUDGE_HELP

    p.add_argument("--judge", metavar="SOURCE", default=None, help=JUDGE_HELP)
