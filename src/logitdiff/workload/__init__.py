"""Stage *workload*: what is asked — a workload's items and their format (`items`), the rules
their fields are checked by (`checks`: an ``expected`` label's check, tool schemas), checking
a file a user wrote (`validate`), the bundled workloads by name (`catalog`) and benchmarks read
from their own packages (`benchmarks`). Imports `store`, `numerics` and the base modules only.
"""

from __future__ import annotations

from pathlib import Path

from .benchmarks import benchmark_items
from .catalog import resolve_workload
from .items import Item, parse_line, read_file, records

__all__ = ["Item", "parse_line", "read_file", "read_workload", "records"]


def read_workload(path: str | Path) -> list[Item]:
    """The items of ``path``: a workload file, else a bundled workload's name
    (``builtin``) or a benchmark's ``NAME[:N]`` where no such file exists."""
    if not Path(path).exists():
        bench = benchmark_items(str(path))
        if bench is not None:
            return bench
    return read_file(resolve_workload(path))
