"""logitdiff: how far a candidate LLM drifts from its reference, token by token.

The public API (everything in ``__all__``; the rest of the package is internal):

    import logitdiff

    logitdiff.capture_run("builtin:tiny", "runs/ref", max_tokens=16)             # reference RUN
    logitdiff.capture_run("builtin:tiny-Q4_K_M", "runs/q4", reference="runs/ref") # candidate RUN
    report = logitdiff.diff_runs("runs/ref", "runs/q4", out="reports/q4")        # REPORT
    logitdiff.testing.assert_drift_within("reports/q4", "kl_mean<0.05")

Names are imported on first use, so ``import logitdiff`` stays cheap (no torch, no
llama.cpp) and changes no process-wide state.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # the same names, for type checkers (at run time __getattr__ imports them on first use)
    from . import testing
    from .api import capture_run, diff_runs, load_report, run, speculate
    from .contracts import Outcome, Report, RunSummary, load_summary
    from .errors import LogitdiffError
    from .numerics.metrics import full_vocab
    from .sources import FullLogitSource, RowKind, Source, TopKRows, TopKSource, open_source, parse_spec
    from .store import RunReader
    from .testing import assert_drift_within
    from .workload import Item, read_workload

# public name -> module that defines it
_EXPORTS = {
    # the jobs
    "capture_run": "api", "diff_runs": "api", "run": "api", "load_report": "api", "speculate": "api",
    # sources: two declared kinds, opened from a spec through the registry
    "open_source": "sources", "parse_spec": "sources", "Source": "sources", "FullLogitSource": "sources",
    "TopKSource": "sources", "RowKind": "sources", "TopKRows": "sources",
    # data
    "read_workload": "workload", "Item": "workload",
    "RunReader": "store", "full_vocab": "numerics.metrics",
    # contracts and checks
    "Report": "contracts", "RunSummary": "contracts", "Outcome": "contracts", "load_summary": "contracts",
    "LogitdiffError": "errors", "assert_drift_within": "testing",
}
_SUBMODULES = ("testing",)

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'logitdiff' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
