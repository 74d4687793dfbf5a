"""Argument checks and options shared by several commands; their defaults are the
library's own (one place for each), so a command's ``--help`` and the Python API agree."""

from __future__ import annotations

from ..errors import LogitdiffError

MAX_BOOTSTRAP = 100_000
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


def check_bootstrap(n: int) -> None:
    """0 (no confidence intervals) .. MAX_BOOTSTRAP (the resample index array is n x items)."""
    if not 0 <= n <= MAX_BOOTSTRAP:
        raise LogitdiffError(f"--bootstrap {n}: must be between 0 (no confidence intervals) and {MAX_BOOTSTRAP}")


def check_device(device: str | None) -> None:
    """``--device``: cpu, cuda or cuda:N, and CUDA only where torch can reach a GPU."""
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise LogitdiffError(f"--device {device!r}: not a device (expected cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise LogitdiffError(f"--device {device!r}: unsupported (expected cpu, cuda or cuda:N)")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no usable GPU"
            raise LogitdiffError(f"--device {device!r}: CUDA is not available (torch {torch.__version__}, {build}); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise LogitdiffError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")


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
