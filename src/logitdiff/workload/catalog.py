"""The workloads that ship with logitdiff, by name: ``--workload NAME`` takes one of these
where no file of that name exists (``logitdiff workloads list``). A new bundled workload is
one line in :data:`BUNDLED`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]

# name -> (file inside the package, what it is)
BUNDLED: dict[str, tuple[Path, str]] = {
    "builtin": (_PKG / "builtin" / "workload.jsonl",
                "the bundled default's workload: code, prose, math, copy/lookup and tool-call items"),
}


@dataclass(frozen=True)
class BundledWorkload:
    name: str
    path: str
    about: str
    items: int
    labelled: int
    tags: str


def resolve_workload(text: str | Path) -> Path:
    """``text`` as a path; a bundled name when no such file exists."""
    path = Path(text)
    if not path.exists() and str(text) in BUNDLED:
        return BUNDLED[str(text)][0]
    return path


def bundled_workloads() -> list[BundledWorkload]:
    from .items import read_file as read_workload

    out = []
    for name, (path, about) in BUNDLED.items():
        items = read_workload(path)
        tags = Counter(t for item in items for t in item.tags)
        out.append(BundledWorkload(name, str(path), about, len(items), sum(i.expected is not None for i in items),
                                   ", ".join(f"{t} {n}" for t, n in sorted(tags.items()))))
    return out
