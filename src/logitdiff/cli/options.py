"""Argument checks and options shared by several commands; their defaults are the
library's own (one place for each), so a command's ``--help`` and the Python API agree."""

from __future__ import annotations

from ..api import MAX_BOOTSTRAP
from ..errors import LogitdiffError

GATES_EXIT = 3
FAIL_ON_HELP = (
    "quality gates, e.g. 'kl_mean>0.05,top1_disagreement>0.02,tool_call_malformed>0': exit status 3 when "
    "any is crossed (a metric the report lacks counts as crossed); the report says which"
)


def parse_ranges_arg(text: str):
    from ..summarize import parse_ranges

    try:
        return parse_ranges(text)
    except ValueError as e:
        raise LogitdiffError(str(e)) from None


def check_at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise LogitdiffError(f"{flag} {value}: must be at least {low}")


def parse_fail_on(text: str | None):
    if not text:
        return None
    from ..gates import parse_gates

    return parse_gates(text)


def gate_exit(reports: list[dict]) -> int:
    """GATES_EXIT when any report crossed a gate (each crossing printed), else 0."""
    from .console import console

    crossed = [(r["candidate"].get("spec") or r["candidate"].get("path"), g) for r in reports for g in (r.get("gates") or {}).get("crossed", [])]
    if not crossed:
        return 0
    con = console()
    for who, g in crossed:
        con.print(f"[bold red]gate crossed[/]: {who}: {g}")
    return GATES_EXIT


def add_ranges(p) -> None:
    from ..summarize import DEFAULT_RANGES, format_ranges

    p.add_argument("--ranges", default=format_ranges(DEFAULT_RANGES), help="output-position range edges (default: %(default)s)")


def add_bootstrap(p) -> None:
    from ..summarize import DEFAULT_BOOTSTRAP

    p.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
                   help=f"bootstrap resamples of items for 95%% CIs, 0 (no CIs) to {MAX_BOOTSTRAP} (default: %(default)s)")


def add_logprob_floor(p) -> None:
    p.add_argument("--logprob-floor", type=float, default=None, metavar="NATS",
                   help="top-K comparisons only: a stated lower bound on every log-probability of both models "
                        "(e.g. -2c - ln V for a model whose final logits are soft-capped at c, as Gemma 2's at 30). "
                        "It gives forward and reverse KL a finite proven upper bound; a listed log-probability below it "
                        "is an error. Recorded as method.logprob_floor_nats (default: none; the upper bound is inf)")


def add_chunk_size(p) -> None:
    from ..store import CHUNK_SIZE_HELP

    p.add_argument("--chunk-size", default=None, metavar="BYTES", help=CHUNK_SIZE_HELP)


def add_fail_on(p, extra: str = "") -> None:
    p.add_argument("--fail-on", metavar="GATES", help=FAIL_ON_HELP + extra)


def add_max_branches(p) -> None:
    from ..consequences import DEFAULT_MAX_BRANCHES

    p.add_argument("--max-branches", type=int, default=DEFAULT_MAX_BRANCHES,
                   help="branches per candidate at most; the highest-KL flips are kept (default: %(default)s)")


def check_max_branches(n: int | None) -> None:
    if n is not None and n < 0:
        raise LogitdiffError("--max-branches must be >= 0")
