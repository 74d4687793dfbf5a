"""The rules an item's fields are checked by when a workload is read: its ``expected``
label names exactly one check, its ``tools`` are valid JSON Schema. Grading an output against
a label (logitdiff.flips.grading) and parsing tool calls (logitdiff.flips.toolcalls) build on
these; the workload reader needs only them."""

from __future__ import annotations

import math
import re
from typing import Any


from ..contracts import PromptForm, ToolForm
from ..errors import LogitdiffError

CHECKS = ("answer", "regex", "numeric", "tool_call", "tool_calls", "tests", "bfcl")
# the Berkeley Function Calling Leaderboard's categories a "bfcl" label may name (logitdiff.workload.bfcl)
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
                   "live_parallel", "live_parallel_multiple", "irrelevance", "live_irrelevance")


def json_type(v: Any) -> str:
    """JSON type name of a decoded value, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object" if isinstance(v, dict) else type(v).__name__


def function_of(tool: Any) -> dict | None:
    """The function object of an OpenAI tool entry, or a bare ``{"name", "parameters"}``."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return tool["function"]
    return tool if isinstance(tool, dict) and "name" in tool else None


def one_line(s: str, limit: int = 200) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


# A function without "parameters" takes no arguments (OpenAI's rule).
NO_PARAMS = {"type": "object", "properties": {}}


def check_tools_schema(tools: list[dict], where: str) -> None:
    """Raise :class:`LogitdiffError` unless every tool has a unique ``function.name`` string and
    its ``parameters`` (when given) is a JSON object that is valid JSON Schema for its draft
    (``$schema``, default 2020-12).  ``where`` names the file/item in the message."""
    if not isinstance(tools, list):
        raise LogitdiffError(f"{where}: 'tools' must be a list")
    seen: dict[str, int] = {}
    for k, tool in enumerate(tools):
        fn = function_of(tool)
        name = fn.get("name") if fn is not None else None
        if fn is None or not isinstance(name, str) or not name:
            raise LogitdiffError(f"{where}: tools[{k}] needs a string function.name")
        if name in seen:
            raise LogitdiffError(f"{where}: tools[{k}] ('{name}') repeats the name of tools[{seen[name]}]")
        seen[name] = k
        params = fn.get("parameters", NO_PARAMS)
        bad = None
        if not isinstance(params, dict):
            bad = f"expected an object, got {json_type(params)}"
        else:
            # imported here: jsonschema costs ~50 ms of every command's start, and only tool items use it
            from jsonschema.exceptions import SchemaError
            from jsonschema.validators import validator_for

            try:
                validator_for(params).check_schema(params)
            except SchemaError as e:
                at = "/".join(str(p) for p in e.path)
                bad = one_line(e.message) + (f" (at {at})" if at else "")
        if bad:
            raise LogitdiffError(f"{where}: tools[{k}] ('{name}') field 'parameters' is not valid JSON Schema: {bad}")



def check_expected(expected: dict, where: str) -> str:
    """The check an ``expected`` label names; a one-line error when it names none or is malformed."""
    if not isinstance(expected, dict):
        raise LogitdiffError(f"{where}: field 'expected' must be an object")
    known = [k for k in CHECKS if k in expected]
    if len(known) != 1:
        raise LogitdiffError(
            f"{where}: field 'expected' must name exactly one check of {', '.join(CHECKS)} "
            f"(got {', '.join(sorted(expected)) or 'nothing'})"
        )
    kind = known[0]
    if kind == "regex":
        try:
            re.compile(expected["regex"])
        except (re.error, TypeError) as e:
            raise LogitdiffError(f"{where}: field 'expected.regex' does not compile: {e}") from None
    if kind == "numeric":
        v, tol = expected["numeric"], expected.get("tol", 1e-9)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (v, tol)):
            raise LogitdiffError(f"{where}: fields 'expected.numeric' and 'expected.tol' must be finite numbers")
    if kind == "tests":
        _check_tests(expected["tests"], where)
    if kind == "bfcl":
        _check_bfcl(expected["bfcl"], where)
    if kind in ("tool_call", "tool_calls"):
        calls = expected[kind] if kind == "tool_calls" else [expected[kind]]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict) for c in calls
        ):
            raise LogitdiffError(f"{where}: field 'expected.{kind}' must be {{'name': str, 'arguments': object}}")
    return kind


def _check_tests(tests: Any, where: str) -> None:
    """``{"tests": {"test": str, "entry_point": str, "timeout_s"?: number > 0, "stop"?: [str],
    "prompt"?: str, "prompt_form"?: PromptForm}}``: a program run against the output (a
    benchmark's own tests, e.g. HumanEval's; flips.grading.check_program)."""
    if not isinstance(tests, dict):
        raise LogitdiffError(f"{where}: field 'expected.tests' must be an object")
    if not isinstance(tests.get("test"), str) or not tests["test"].strip():
        raise LogitdiffError(f"{where}: field 'expected.tests.test' must be the test program's text")
    ep = tests.get("entry_point")
    if not isinstance(ep, str) or not ep.isidentifier():
        raise LogitdiffError(f"{where}: field 'expected.tests.entry_point' must be a Python identifier")
    t = tests.get("timeout_s", 3.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise LogitdiffError(f"{where}: field 'expected.tests.timeout_s' must be a positive number of seconds")
    stop = tests.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise LogitdiffError(f"{where}: field 'expected.tests.stop' must be a list of non-empty strings")
    if "prompt" in tests and not isinstance(tests["prompt"], str):
        raise LogitdiffError(f"{where}: field 'expected.tests.prompt' must be the benchmark's prompt text")
    form = tests.get(PromptForm.FIELD, PromptForm.COMPLETION)
    if form not in PromptForm.ALL:
        raise LogitdiffError(f"{where}: field 'expected.tests.{PromptForm.FIELD}' must be one of {', '.join(PromptForm.ALL)}")
    if form == PromptForm.EVALPLUS_INSTRUCT and not isinstance(tests.get("prompt"), str):
        raise LogitdiffError(f"{where}: field 'expected.tests.prompt' is required in the {form} form (prepended to code without the entry point)")


def _check_bfcl(label: Any, where: str) -> None:
    """``{"bfcl": {"category": str, "id": str, "tool_form"?: ToolForm}}``: an entry of the
    Berkeley Function Calling Leaderboard, graded by BFCL's own checker (logitdiff.workload.bfcl);
    ``tool_form`` says which of BFCL's decoders reads the answer (absent: the chat template's)."""
    if not isinstance(label, dict):
        raise LogitdiffError(f"{where}: field 'expected.bfcl' must be an object")
    if label.get("category") not in BFCL_CATEGORIES:
        raise LogitdiffError(f"{where}: field 'expected.bfcl.category' must be one of {', '.join(BFCL_CATEGORIES)} "
                             f"(got {one_line(repr(label.get('category')), 60)})")
    if not isinstance(label.get("id"), str) or not label["id"]:
        raise LogitdiffError(f"{where}: field 'expected.bfcl.id' must be the BFCL entry's id (a non-empty string)")
    if ToolForm.FIELD in label and label[ToolForm.FIELD] not in ToolForm.ALL:
        raise LogitdiffError(f"{where}: field 'expected.bfcl.{ToolForm.FIELD}' must be one of {', '.join(ToolForm.ALL)} "
                             f"(got {one_line(repr(label[ToolForm.FIELD]), 60)})")
