"""Reading and validating workloads (JSONL, one item per line).

Each line is an object with

* ``id``        string, required, unique in the file;
* ``prompt``    raw text, or ``messages`` (OpenAI-style chat list) - exactly one;
* ``tools``     optional list of OpenAI tool schemas (``{"type": "function", "function":
                {"name", "description", "parameters"}}``);
* ``tags``      optional list of strings (``code``, ``prose``, ``math``, ``tool`` ...);
* ``max_tokens`` optional positive int;
* ``tools_module`` optional path (relative to the workload file) of a Python module whose
                functions implement the tools, for the executable tool-call check;
* ``expected``  optional label: ``{"answer": "42"}``, ``{"regex": "..."}``,
                ``{"numeric": 3.5, "tol": 1e-6}`` or ``{"tool_call": {"name", "arguments"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import LogitdiffError
from ..store.files import DOCUMENT_MAX_BYTES, read_input_bytes



@dataclass
class Item:
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    tags: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    expected: dict | None = None
    tools_module: str | None = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"id": self.id}
        if self.prompt is not None:
            d["prompt"] = self.prompt
        if self.messages is not None:
            d["messages"] = self.messages
        if self.tools is not None:
            d["tools"] = self.tools
        if self.tags:
            d["tags"] = list(self.tags)
        if self.max_tokens is not None:
            d["max_tokens"] = self.max_tokens
        if self.expected is not None:
            d["expected"] = self.expected
        if self.tools_module is not None:
            d["tools_module"] = self.tools_module
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "item") -> "Item":
        if not isinstance(d, dict):
            raise LogitdiffError(f"{where}: expected a JSON object")
        iid = d.get("id")
        if not isinstance(iid, str) or not iid:
            raise LogitdiffError(f"{where}: field 'id' must be a non-empty string")
        where = f"{where} (id {iid!r})"
        has_p, has_m = "prompt" in d, "messages" in d
        if has_p == has_m:
            raise LogitdiffError(f"{where}: exactly one of 'prompt' or 'messages' is required")
        if has_p and not isinstance(d["prompt"], str):
            raise LogitdiffError(f"{where}: field 'prompt' must be a string")
        if has_m:
            msgs = d["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
            ):
                raise LogitdiffError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
            for k, m in enumerate(msgs):
                c = m.get("content")
                if c is not None and not isinstance(c, str) and not (
                        isinstance(c, list) and all(isinstance(p, dict) for p in c)):
                    raise LogitdiffError(f"{where}: messages[{k}].content is {type(c).__name__}; "
                                         "expected a string (or a list of content parts)")
        tools = d.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise LogitdiffError(f"{where}: field 'tools' must be a list")
            for k, t in enumerate(tools):
                fn = t.get("function") if isinstance(t, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise LogitdiffError(f"{where}: tools[{k}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        tags = d.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise LogitdiffError(f"{where}: field 'tags' must be a list of strings")
        mt = d.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt <= 0):
            raise LogitdiffError(f"{where}: field 'max_tokens' must be a positive integer")
        exp = d.get("expected")
        if exp is not None:
            from .checks import check_expected

            check_expected(exp, where)
        if tools:
            check_tools_once(tools, where)
        tm = d.get("tools_module")
        if tm is not None and (not isinstance(tm, str) or not tm):
            raise LogitdiffError(f"{where}: field 'tools_module' must be a path string")
        return cls(
            id=iid,
            prompt=d.get("prompt"),
            messages=d.get("messages"),
            tools=tools,
            tags=list(tags),
            max_tokens=mt,
            expected=exp,
            tools_module=tm,
        )


def parse_line(line: str, where: str) -> Any:
    """One JSON line of text: a one-line error for bad JSON, nesting beyond Python's
    recursion limit, and lone surrogate escapes (``"\\ud800"``: not Unicode text, nothing
    downstream can encode it)."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise LogitdiffError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise LogitdiffError(f"{where}: JSON nested too deeply") from None
    try:
        json.dumps(d, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise LogitdiffError(f"{where}: holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), not Unicode text") from None
    except RecursionError:
        raise LogitdiffError(f"{where}: JSON nested too deeply") from None
    return d


_TOOLS_CHECKED: set[str] = set()


def check_tools_once(tools: list, where: str) -> None:
    """JSON Schema meta-validation of a tools list; the same list (workloads repeat a few
    tool sets over many items) is checked once per process."""
    key = json.dumps(tools, sort_keys=True, default=str)
    if key in _TOOLS_CHECKED:
        return
    from .checks import check_tools_schema

    check_tools_schema(tools, where)
    _TOOLS_CHECKED.add(key)


def records(path: str | Path) -> Iterator[tuple[int, Item | LogitdiffError]]:
    """Every non-blank line of a workload file as ``(line number, Item)``, or ``(line number,
    the one-line error)`` for a bad record: a reader that stops at the first error
    (:func:`read_workload`) and one that lists them all (``logitdiff workloads validate``)
    share one set of rules. A file that cannot be read at all raises."""
    path = Path(path)
    if not path.exists():
        raise LogitdiffError(f"{path}: workload file not found")
    if not path.is_file():
        raise LogitdiffError(f"{path}: not a regular file (a workload is a JSONL file)")
    seen: dict[str, int] = {}
    # opened as a regular file, read whole within the document bound (a file swapped for a
    # FIFO or a device after the checks above is refused too)
    data = read_input_bytes(path, max_bytes=DOCUMENT_MAX_BYTES)
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            item = _record(path, lineno, raw, seen)
        except LogitdiffError as e:
            yield lineno, e
            continue
        if item is not None:
            yield lineno, item


def _record(path: Path, lineno: int, raw: bytes, seen: dict[str, int]) -> Item | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogitdiffError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    d = parse_line(line, f"{path}:{lineno}")
    item = Item.from_json(d, where=f"{path}:{lineno}")
    if item.tools_module is not None:
        tm = (path.parent / item.tools_module).resolve()
        if not tm.is_file():
            raise LogitdiffError(f"{path}:{lineno} (id {item.id!r}): field 'tools_module' {item.tools_module!r} is not a file")
        item.tools_module = str(tm)
    if item.id in seen:
        raise LogitdiffError(f"{path}:{lineno}: duplicate item id {item.id!r} (first on line {seen[item.id]})")
    seen[item.id] = lineno
    return item


def read_file(path: str | Path) -> list[Item]:
    """The items of a workload file; the first bad record raises its one-line error."""
    items: list[Item] = []
    for _, record in records(path):
        if isinstance(record, LogitdiffError):
            raise record
        items.append(record)
    if not items:
        raise LogitdiffError(f"{path}: workload has no items")
    return items
