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

__all__ = ["Item", "parse_line", "read_file", "read_workload", "records", "workload_file", "workload_sha256"]


def read_workload(path: str | Path) -> list[Item]:
    """The items of ``path``: a workload file, else a bundled workload's name
    (``builtin``) or a benchmark's ``NAME[:N]`` where no such file exists."""
    if not Path(path).exists():
        bench = benchmark_items(str(path))
        if bench is not None:
            return bench
    return read_file(resolve_workload(path))


def workload_file(path: str | Path) -> Path | None:
    """The file ``read_workload(path)`` reads (a bundled name resolved), or None for a
    benchmark read from its package: what an output guard lists among a command's inputs."""
    if not Path(path).exists() and benchmark_items(str(path)) is not None:
        return None
    return resolve_workload(path)


def workload_sha256(path: str | Path, items: list[Item]) -> str:
    """What decides whether a ``--resume`` or a reused reference continues the same workload:
    a file's bytes; a benchmark's items themselves (canonical JSON: the package's data and
    the labels logitdiff derives from it)."""
    import hashlib
    import json

    from ..store.files import DOCUMENT_MAX_BYTES, read_input_bytes

    f = workload_file(path)
    if f is not None:
        return hashlib.sha256(read_input_bytes(f, max_bytes=DOCUMENT_MAX_BYTES)).hexdigest()
    text = json.dumps([item.to_json() for item in items], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
