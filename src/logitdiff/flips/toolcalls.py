"""Tool calls: find them in model output, check them against tool schemas, compare two sets.

Pure functions, no I/O.  A *call* is a function name plus an arguments object
(:class:`ToolCall`).  Three questions are answered separately, because a quantized model can
fail at each one on its own:

* :func:`parse_tool_calls` - did the output contain a call, in which serving format, and was
  it well formed?  (malformed tool call)
* :func:`validate_call` - does a parsed call fit the offered tool's JSON Schema?
* :func:`compare_calls` - is it the *same* call as the expected / reference one?
  (wrong tool call)

Accepted output formats (exactly)
---------------------------------
Every call object below is a JSON object with a non-empty string ``"name"`` and an
``"arguments"`` object; ``"parameters"`` is accepted as an alias of ``"arguments"`` (not both).
Other keys (``"id"``, ``"type"``) are ignored.  A missing arguments key, arguments that are a
string (double-encoded JSON) or any other non-object is an error.

``hermes`` (Hermes, Qwen 2/2.5/3, the bundled ``builtin:tiny`` model)
    One or more ``<tool_call>JSON</tool_call>`` blocks anywhere in the text; each block holds
    exactly one call object (surrounding whitespace allowed).  Several blocks are parallel
    calls, in order.  Text outside the blocks (prose, ``<think>`` reasoning) is ignored.
    Attempted when either tag occurs.  Errors: a block without its closing tag (also when
    another ``<tool_call>`` opens first), a ``</tool_call>`` with no open block, JSON that
    does not parse or is not one call object.
``mistral``
    Attempted when ``[TOOL_CALLS]`` occurs; text before the first marker is ignored.  What
    follows each marker (up to the next marker or the end) is either
    (a) a JSON list of call objects (a single call object is also accepted), e.g.
    ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo), or
    (b) ``NAME[ARGS]{json object}``, optionally ``NAME[CALL_ID]ID[ARGS]{...}``, with NAME made
    of letters, digits, ``_ . -`` (tokenizer v11+, Mistral Small 3.x); one call per marker.
    Errors: nothing after the marker, an empty list, bad/truncated JSON, anything but
    whitespace after the JSON, form (b) without ``[ARGS]``.
``llama3`` (Llama 3.1/3.2 JSON tool calling)
    The *whole* reply, after optional leading ``<|python_tag|>`` and whitespace, is one or more
    JSON values separated by whitespace or ``;``; each value is a call object or a list of
    call objects.  It counts as attempted only when the stripped reply starts with ``{`` or
    ``[`` *and* contains a ``"name":`` key somewhere, so prose (even prose with braces) and
    plain JSON answers without a ``name`` are never calls.  A JSON answer that does have a
    ``name`` key (``{"name": "Ada", "age": 36}``) is read as a malformed call: leave
    ``llama3`` out of ``formats`` for models that do not use this format.  Errors: bad or
    truncated JSON, text after the JSON, a value that is not a call object.
    Llama's ``<function=NAME>{...}</function>`` form is not accepted.

In the text formats, trailing end-of-turn tokens (``<|eot_id|>``, ``<|eom_id|>``,
``<|im_end|>``, ``<|endoftext|>``, ``</s>``) are ignored.  When special tokens were dropped
while decoding, ``<tool_call>`` tags vanish and a Hermes call reads as ``llama3``: decode
with special tokens kept.

``openai`` (a served chat completion)
    ``output`` is a message dict or a list of ``tool_calls`` entries.  Each entry is
    ``{"type": "function", "function": {"name": ..., "arguments": ...}}`` where arguments is
    a JSON string that must parse to an object (an empty string means ``{}``) or an object.
    A message without ``tool_calls`` but with the legacy ``function_call`` object is read the
    same way; a message with neither has its string ``content`` parsed as text with
    ``formats`` (servers without a tool parser return the raw text there).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from jsonschema.validators import validator_for

from ..errors import LogitdiffError
from ..workload.checks import NO_PARAMS, check_tools_schema, function_of, json_type, one_line  # noqa: F401 (check_tools_schema: the schema check beside the call checks)

TEXT_FORMATS = ("hermes", "mistral", "llama3")
_END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "</s>")


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``name`` and its ``arguments`` object (a dict from JSON)."""

    name: str
    arguments: dict

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ParsedCalls:
    """What :func:`parse_tool_calls` found.

    ``format`` is the format whose marker/shape was seen (None when none was); ``calls`` the
    calls parsed, in order (when ``error`` is set, the ones parsed before the fault);
    ``error`` one line saying why an attempted call could not be parsed.
    """

    format: str | None
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None

    @property
    def attempted(self) -> bool:
        """A call marker or call-shaped JSON was seen (so there are calls or an error)."""
        return bool(self.calls) or self.error is not None

    @property
    def ok(self) -> bool:
        """Attempted, parsed without error, at least one call."""
        return self.error is None and bool(self.calls)

    def to_json(self) -> dict:
        return {"format": self.format, "calls": [c.to_json() for c in self.calls], "error": self.error}


class _Bad(Exception):
    """An attempted call that does not parse; the message is the ParsedCalls.error line."""


# --------------------------------------------------------------------------------------------
# parsing


def _call_from_obj(obj: Any, where: str) -> ToolCall:
    if not isinstance(obj, dict):
        raise _Bad(f"{where}: expected a call object, got {json_type(obj)}")
    name = obj.get("name")
    if name is None:
        raise _Bad(f"{where}: missing function name")
    if not isinstance(name, str) or not name.strip():
        raise _Bad(f"{where}: 'name' is not a non-empty string")
    if "arguments" in obj and "parameters" in obj:
        raise _Bad(f"{where} ({name}): both 'arguments' and 'parameters' given")
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj:
        raise _Bad(f"{where} ({name}): missing 'arguments'")
    args = obj[key]
    if not isinstance(args, dict):
        raise _Bad(f"{where} ({name}): '{key}' is {json_type(args)}, not an object")
    return ToolCall(name, args)


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _Bad(f"{where}: invalid or truncated JSON ({e.msg} at char {e.pos})") from None


def _strip_end(text: str) -> str:
    text = text.rstrip()
    while True:
        for tok in _END_TOKENS:
            if text.endswith(tok):
                text = text[: -len(tok)].rstrip()
                break
        else:
            return text


def _parse_hermes(text: str, calls: list[ToolCall]) -> bool:
    o, c = "<tool_call>", "</tool_call>"
    if o not in text and c not in text:
        return False
    pos = k = 0
    while True:
        a, stray = text.find(o, pos), text.find(c, pos)
        if 0 <= stray and (a < 0 or stray < a):
            raise _Bad(f"'</tool_call>' at char {stray} without an opening '<tool_call>'")
        if a < 0:
            return True
        start = a + len(o)
        b, nxt = text.find(c, start), text.find(o, start)
        if b < 0 or 0 <= nxt < b:
            raise _Bad(f"<tool_call> block {k}: no closing </tool_call>")
        calls.append(_call_from_obj(_loads(text[start:b].strip(), f"<tool_call> block {k}"), f"<tool_call> block {k}"))
        pos, k = b + len(c), k + 1


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?\[ARGS\]")


def _parse_mistral(text: str, calls: list[ToolCall]) -> bool:
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return False
    for s, seg in enumerate(text.split(marker)[1:]):
        where = f"[TOOL_CALLS] {s}"
        seg = _strip_end(seg).strip()
        if not seg:
            raise _Bad(f"{where}: nothing after the marker")
        if seg[0] in "[{":
            value = _loads(seg, where)
            items = value if isinstance(value, list) else [value]
            if not items:
                raise _Bad(f"{where}: empty call list")
            for j, obj in enumerate(items):
                calls.append(_call_from_obj(obj, f"{where} item {j}"))
            continue
        m = _MISTRAL_NAMED.match(seg)
        if not m:
            raise _Bad(f"{where}: expected a JSON list of calls or NAME[ARGS]{{...}}")
        args = _loads(seg[m.end():].strip(), f"{where} ({m.group(1)})")
        if not isinstance(args, dict):
            raise _Bad(f"{where} ({m.group(1)}): arguments are {json_type(args)}, not an object")
        calls.append(ToolCall(m.group(1), args))
    return True


_NAME_KEY = re.compile(r'"name"\s*:')


def _parse_llama3(text: str, calls: list[ToolCall]) -> bool:
    t = _strip_end(text).strip()
    if t.startswith("<|python_tag|>"):
        t = t[len("<|python_tag|>"):].strip()
    if not t or t[0] not in "[{" or not _NAME_KEY.search(t):
        return False
    dec = json.JSONDecoder()
    pos, n = 0, 0
    while True:
        try:
            value, pos = dec.raw_decode(t, pos)
        except json.JSONDecodeError as e:
            raise _Bad(f"llama3 JSON {n}: invalid or truncated JSON ({e.msg} at char {e.pos})") from None
        for obj in value if isinstance(value, list) else [value]:
            calls.append(_call_from_obj(obj, f"llama3 call {len(calls)}"))
        n += 1
        # values may be separated by whitespace and/or one ';' (a trailing ';' is fine)
        while pos < len(t) and t[pos].isspace():
            pos += 1
        if pos < len(t) and t[pos] == ";":
            pos += 1
            while pos < len(t) and t[pos].isspace():
                pos += 1
        if pos >= len(t):
            break
        if t[pos] not in "[{":
            raise _Bad(f"llama3: unexpected text after the JSON at char {pos}: {t[pos:pos + 20]!r}")
    if not calls:
        raise _Bad("llama3: JSON holds no call")
    return True


_TEXT_PARSERS = {"hermes": _parse_hermes, "mistral": _parse_mistral, "llama3": _parse_llama3}


def _parse_openai(output: dict | list, formats) -> ParsedCalls:
    if isinstance(output, dict):
        entries = output.get("tool_calls")
        if not entries and isinstance(output.get("function_call"), dict):
            entries = [{"type": "function", "function": output["function_call"]}]
        if not entries:
            content = output.get("content")
            return parse_tool_calls(content, formats) if isinstance(content, str) else ParsedCalls(None)
    else:
        entries = output
    if not entries:
        return ParsedCalls(None)
    calls: list[ToolCall] = []
    if not isinstance(entries, list):
        return ParsedCalls("openai", calls, f"tool_calls is {json_type(entries)}, not a list")
    for k, e in enumerate(entries):
        where = f"tool_calls[{k}]"
        fn = e.get("function") if isinstance(e, dict) else None
        if not isinstance(fn, dict):
            return ParsedCalls("openai", calls, f"{where}: missing 'function' object")
        if e.get("type", "function") != "function":
            return ParsedCalls("openai", calls, f"{where}: type {e.get('type')!r} is not 'function'")
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not name.strip():
            return ParsedCalls("openai", calls, f"{where}: missing function name")
        if isinstance(args, str):
            if not args.strip():
                args = {}  # what servers send for a call without arguments
            else:
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e2:
                    return ParsedCalls("openai", calls, f"{where} ({name}): arguments are not valid JSON "
                                                        f"({e2.msg} at char {e2.pos})")
        if not isinstance(args, dict):
            return ParsedCalls("openai", calls, f"{where} ({name}): arguments are {json_type(args)}, not an object")
        calls.append(ToolCall(name, args))
    return ParsedCalls("openai", calls)


def parse_tool_calls(output: str | dict | list, formats=TEXT_FORMATS) -> ParsedCalls:
    """Find the tool calls in ``output`` (see the module docstring for the exact formats).

    Text is tried against ``formats`` in order and the first format whose marker or shape is
    seen decides: its calls, or its error.  A dict/list is an OpenAI message / tool_calls
    list (format ``"openai"``).  No marker at all gives ``ParsedCalls(None, [], None)``.
    """
    for f in formats:
        if f not in _TEXT_PARSERS and f != "openai":
            raise LogitdiffError(f"unknown tool-call format {f!r} (known: {', '.join(TEXT_FORMATS)}, openai)")
    if isinstance(output, (dict, list)):
        return _parse_openai(output, formats)
    if not isinstance(output, str):
        raise TypeError(f"parse_tool_calls: expected str, dict or list, got {type(output).__name__}")
    for f in formats:
        if f == "openai":
            continue
        calls: list[ToolCall] = []
        try:
            seen = _TEXT_PARSERS[f](output, calls)
        except _Bad as e:
            return ParsedCalls(f, calls, str(e))
        if seen:
            return ParsedCalls(f, calls)
    return ParsedCalls(None)


# --------------------------------------------------------------------------------------------
# schemas


def _find(tools: list[dict] | None, name: str) -> dict | None:
    for tool in tools or []:
        fn = function_of(tool)
        if fn is not None and fn.get("name") == name:
            return fn
    return None


def _path(parts) -> str:
    return "arguments" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def validate_call(call: ToolCall, tools: list[dict]) -> list[str]:
    """Why ``call`` does not fit ``tools`` (assumed checked by :func:`check_tools_schema`).

    Errors, sorted, one line each: ``unknown function 'f'``; every JSON Schema violation of
    the arguments as ``<path>: <message>`` (e.g. ``arguments.unit: 'kelvin' is not one of
    [...]``); and, beyond plain JSON Schema, ``arguments: unknown argument 'x'`` for a name
    not in ``properties`` unless the schema says what extra properties may be (sets
    ``additionalProperties`` or ``patternProperties``) - a hallucinated argument name breaks a
    real function call even where the schema's default would allow it.  Empty = valid.
    """
    fn = _find(tools, call.name)
    if fn is None:
        return [f"unknown function {call.name!r}"]
    params = fn.get("parameters", NO_PARAMS)
    errors = {f"{_path(e.absolute_path)}: {one_line(e.message)}"
              for e in validator_for(params)(params).iter_errors(call.arguments)}
    props = params.get("properties")
    if isinstance(props, dict) and "additionalProperties" not in params and "patternProperties" not in params:
        errors.update(f"arguments: unknown argument {k!r}" for k in call.arguments if k not in props)
    return sorted(errors)


# --------------------------------------------------------------------------------------------
# comparing calls


@dataclass
class CallComparison:
    """``equal`` iff ``reasons`` is empty; reasons are one short line each."""

    equal: bool
    reasons: list[str] = field(default_factory=list)


# BFCL's standardize_string removes spaces and , . / - _ * ^ and lower-cases; here also any
# whitespace, both quote characters and ! ? ; : (trailing sentence punctuation is noise too).
_DROP = re.compile(r"[\s,./\-_*^'\"!?;:]+")


def normalize_string(s: str) -> str:
    """Case-folded ``s`` without whitespace and the characters ``, . / - _ * ^ ' " ! ? ; :``."""
    return _DROP.sub("", s.casefold())


def _num_eq(a: float, b: float) -> bool:
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def values_equal(a: Any, b: Any, normalize: bool = True) -> bool:
    """Equality of decoded JSON values: bools only equal bools; numbers (int or float) within
    1e-9 relative (two NaN are equal); strings compared after :func:`normalize_string` when
    ``normalize`` (else exactly); lists element by element in order; dicts by the same keys
    and equal values; None only equals None."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return _num_eq(a, b)
    if isinstance(a, str) and isinstance(b, str):
        return normalize_string(a) == normalize_string(b) if normalize else a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equal(x, y, normalize) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], normalize) for k in a)
    return a is None and b is None


_PY = {"integer": "int", "number": "float", "string": "str", "boolean": "bool",
       "array": "list", "object": "dict", "null": "None"}


def _schema_types(v: Any) -> set[str]:
    """The JSON Schema type(s) a want value stands for when there is no schema."""
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer"}
    return {"number"} if isinstance(v, float) else {json_type(v)}


def _type_ok(v: Any, types: set[str]) -> bool:
    # BFCL's rule: an int where a number is expected is fine; a float where an integer is
    # expected is not (even 3.0); a bool is never a number.
    if isinstance(v, bool):
        return "boolean" in types
    if isinstance(v, int):
        return bool(types & {"integer", "number"})
    if isinstance(v, float):
        return "number" in types
    return json_type(v) in types


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _pytype(v: Any) -> str:
    return "None" if v is None else type(v).__name__


def _arg_diffs(got: dict, want: dict, schema: dict | None) -> list[str]:
    given = schema.get("properties") if isinstance(schema, dict) else None
    props: dict[str, Any]
    if isinstance(schema, dict) and isinstance(given, dict):
        props, allowed, required = given, set(given), set(schema.get("required", []))
    else:
        props, allowed, required = {}, set(want), set(want)
    out = [f"missing required argument {k!r}" for k in sorted(required - set(got))]
    out += [f"unknown argument {k!r}" for k in sorted(set(got) - allowed)]
    for k in sorted(allowed & (set(got) | set(want))):
        spec = props.get(k)
        spec = spec if isinstance(spec, dict) else {}
        if k in got and k in want:
            t = spec.get("type")
            types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else _schema_types(want[k])
            if not _type_ok(got[k], types):
                out.append(f"argument {k!r} type {_pytype(got[k])} != {'|'.join(sorted(_PY.get(x, x) for x in types))}")
            elif not values_equal(got[k], want[k]):
                out.append(f"argument {k!r} {_show(got[k])} != {_show(want[k])}")
        elif k in want:  # got left out an optional argument that want gives
            if k not in required and not ("default" in spec and values_equal(spec["default"], want[k])):
                out.append(f"missing argument {k!r} (expected {_show(want[k])})")
        elif not ("default" in spec and values_equal(spec["default"], got[k])):
            out.append(f"argument {k!r} {_show(got[k])} is not in the expected call")
    return out


def _diffs(got: ToolCall, want: ToolCall, j: int, tools: list[dict] | None) -> list[str]:
    if got.name != want.name:
        return [f"call {j}: function {got.name} != {want.name}"]
    fn = _find(tools, want.name)
    return [f"call {j} {want.name}: {r}" for r in _arg_diffs(got.arguments, want.arguments,
                                                             fn.get("parameters", NO_PARAMS) if fn else None)]


def _matching(ok: list[list[bool]]) -> dict[int, int]:
    """Maximum matching want j -> got i over ``ok[j][i]`` (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}

    def take(j: int, seen: set[int]) -> bool:
        for i, can in enumerate(ok[j]):
            if can and i not in seen:
                seen.add(i)
                if i not in owner or take(owner[i], seen):
                    owner[i] = j
                    return True
        return False

    for j in range(len(ok)):
        take(j, set())
    return {j: i for i, j in owner.items()}


def compare_calls(got: list[ToolCall], want: list[ToolCall], tools: list[dict] | None = None) -> CallComparison:
    """Are ``got`` and ``want`` the same calls, in the manner of BFCL's AST checker?

    Two calls match when the function names are equal and, per argument (with the tool's
    ``parameters`` from ``tools`` when found there, else ``want``'s arguments as the spec,
    all of them required): every required argument is present; no argument is outside the
    schema's properties (else outside ``want``); the types fit (schema ``type`` or the type
    of want's value: int is fine for a number, a float is not an integer, bool is not a
    number); the values are :func:`values_equal`.  An optional argument given by only one
    side is fine when its value is the schema ``default``.

    Parallel calls are matched order-free: each want call to a distinct got call (maximum
    matching).  Unmatched ones are paired up for the report (same name first, then in
    order) and explained as ``call J <name>: ...`` (J = index in ``want``; ``got != want``),
    or reported as ``missing call NAME`` / ``extra call NAME``.
    """
    ok = [[not _diffs(g, w, 0, tools) for g in got] for w in want]
    match = _matching(ok)
    left_want = [j for j in range(len(want)) if j not in match]
    used = set(match.values())
    left_got = [i for i in range(len(got)) if i not in used]
    pairs = []
    for j in list(left_want):
        i = next((i for i in left_got if got[i].name == want[j].name), None)
        if i is not None:
            pairs.append((j, i))
            left_want.remove(j)
            left_got.remove(i)
    while left_want and left_got:
        pairs.append((left_want.pop(0), left_got.pop(0)))
    reasons = []
    for j, i in sorted(pairs):
        reasons += _diffs(got[i], want[j], j, tools)
    reasons += [f"missing call {want[j].name}" for j in left_want]
    reasons += [f"extra call {got[i].name}" for i in left_got]
    return CallComparison(not reasons, reasons)
