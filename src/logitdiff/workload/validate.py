"""Checking a workload file a user wrote: every bad record, not only the first.

``logitdiff workloads validate FILE`` prints :func:`validate_workload`'s problems, one line
each, naming the file, the line, the item and the field. The rules are the reader's own
(:func:`logitdiff.workload.records`), so a file this accepts is a file ``run`` and
``capture`` read; the JSON Schema (``schemas/workload.schema.json``) states the same rules
for other tools, and a test holds the two to agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LogitdiffError
from ..store.files import DOCUMENT_MAX_BYTES, read_input_bytes
from .items import Item, records

# The fields an item may have (Item.from_json reads exactly these); any other is ignored by
# the reader, so a misspelt field ("expect") would silently do nothing: validate names it.
FIELDS = ("id", "prompt", "messages", "tools", "tags", "max_tokens", "expected", "tools_module")
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "workload.schema.json"


@dataclass
class WorkloadCheck:
    path: str
    items: list[Item] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.items)


def _unknown_fields(path: Path, lineno: int, raw: bytes) -> list[str]:
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    if not isinstance(d, dict):
        return []
    extra = sorted(k for k in d if k not in FIELDS)
    iid = d.get("id")
    at = f"{path}:{lineno}" + (f" (id {iid!r})" if isinstance(iid, str) else "")
    return [f"{at}: field {k!r} is not a workload field (ignored; the fields are {', '.join(FIELDS)})" for k in extra]


def validate_workload(path: str | Path) -> WorkloadCheck:
    """Every record of ``path`` checked; a file that cannot be read at all raises."""
    from .catalog import resolve_workload

    path = resolve_workload(path)
    check = WorkloadCheck(str(path))
    for lineno, record in records(path):
        if isinstance(record, LogitdiffError):
            check.errors.append(str(record))
        else:
            check.items.append(record)
    if not check.items and not check.errors:
        check.errors.append(f"{path}: workload has no items")
    data = read_input_bytes(path, max_bytes=DOCUMENT_MAX_BYTES)
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            check.warnings.extend(_unknown_fields(path, lineno, raw))
    return check


def workload_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
