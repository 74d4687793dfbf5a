"""The Berkeley Function Calling Leaderboard (``--workload bfcl:CATEGORY[:N]``), its data and
its own checker reached across a process boundary.

BFCL (package ``bfcl-eval``) pins numpy 1.26.4 and its checker imports every provider SDK,
so it lives in its own venv, ``$LOGITDIFF_TOOLS/bfcl-venv`` (``scripts/setup_bfcl.sh``;
``LOGITDIFF_BFCL_VENV`` overrides). :class:`BfclBridge` runs ``bfcl_runner.py`` with that
venv's python, one long-lived process spoken to in JSON lines: it loads a category's entries
and grades one answer with BFCL's own evaluation of an entry (see the runner's docstring).
Grading in a logitdiff process goes through one bridge, started on the first BFCL item and
closed at exit (:func:`shared_bridge`): per item grading calls (``flips.grading.grade``)
carry no session object to hold it.

An item is the question's first turn as ``messages``, the functions as OpenAI tools (BFCL's
own conversion), tags ``["tool", "bfcl", CATEGORY]`` and the label ``{"bfcl": {"category",
"id"}}``. The ground truth of an entry (``logitdiff workloads check bfcl:CATEGORY``) is its
possible answer with one option per parameter (:func:`ground_truth_calls`: the first, but a
required parameter's first that is not "", BFCL's "may be left out"), written as a model
writes a call (a Hermes ``<tool_call>`` JSON block per call, to the tool's name as offered),
so it goes the same text -> parse -> BFCL path a model's answer takes; for irrelevance, a
reply with no call. Four entries of BFCL's data admit no passing answer
(:func:`bfcl_unpassable`); the check names them.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..contracts import ToolForm
from ..errors import LogitdiffError
from .checks import BFCL_CATEGORIES
from .items import Item

# the single-turn Python categories; irrelevance ones are right when the model calls nothing
CATEGORIES = BFCL_CATEGORIES
IRRELEVANCE = ("irrelevance", "live_irrelevance")
# Output budget per category: at least 1.4 x the longest ground-truth answer written as Hermes
# blocks, in SmolLM2's tokens (measured: simple_python 147, multiple 95, parallel 439,
# parallel_multiple 260, live_simple 320, live_multiple 172, live_parallel 369,
# live_parallel_multiple 215), rounded up to a multiple of 128, and 256 at least.
MAX_TOKENS = {"simple_python": 256, "multiple": 256, "parallel": 640, "parallel_multiple": 384, "live_simple": 512,
              "live_multiple": 256, "live_parallel": 640, "live_parallel_multiple": 384, "irrelevance": 256,
              "live_irrelevance": 256}
NO_CALL_ANSWER = "None of the functions offered can answer this, so I will not call any of them."
SETUP = "scripts/setup_bfcl.sh"


def bfcl_venv() -> Path:
    if os.environ.get("LOGITDIFF_BFCL_VENV"):
        return Path(os.environ["LOGITDIFF_BFCL_VENV"])
    tools = Path(os.environ.get("LOGITDIFF_TOOLS") or Path.home() / ".cache" / "logitdiff" / "tools")
    return tools / "bfcl-venv"


def bfcl_installed() -> bool:
    """The BFCL venv has a python and the bfcl_eval package (not imported: that takes seconds)."""
    venv = bfcl_venv()
    return (venv / "bin" / "python").is_file() and any(venv.glob("lib/python*/site-packages/bfcl_eval/__init__.py"))


class BfclBridge:
    """One ``bfcl_runner.py`` process in BFCL's venv; :meth:`request` sends one JSON line and
    reads one back. Its scratch directory (``BFCL_PROJECT_ROOT``: BFCL makes result, score
    and lock folders there on import; the runner's stderr log) is removed on :meth:`close`."""

    def __init__(self, venv: Path | None = None):
        self.venv = venv or bfcl_venv()
        python = self.venv / "bin" / "python"
        if not python.is_file():
            raise LogitdiffError(f"BFCL is not installed: {python} does not exist (run {SETUP})")
        self.scratch = Path(tempfile.mkdtemp(prefix="logitdiff-bfcl-"))
        self.log_path = self.scratch / "bfcl_runner.stderr"
        self._lock = threading.Lock()
        self._items: dict[str, list[dict]] = {}
        env = dict(os.environ, BFCL_PROJECT_ROOT=str(self.scratch))
        with open(self.log_path, "wb") as log:
            # -I: the runner's folder (logitdiff's workload package) is not put on sys.path
            self.proc = subprocess.Popen([str(python), "-I", str(Path(__file__).with_name("bfcl_runner.py"))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         cwd=self.scratch, text=True, encoding="utf-8", bufsize=1)
        try:
            self._read("starting")
        except LogitdiffError:
            self.close()
            raise

    def _stderr_tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def _read(self, what: str) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = self._stderr_tail()
            raise LogitdiffError(f"BFCL bridge ({self.venv}/bin/python) ended while {what} (exit status {code})"
                                 + (f": {tail}" if tail else "") + f"; if the venv is broken, rerun {SETUP}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise LogitdiffError(f"BFCL bridge, {what}: {reply.get('error')}")
        return reply

    def request(self, req: dict, what: str) -> dict:
        with self._lock:
            if self.proc.poll() is not None or self.proc.stdin is None:
                raise LogitdiffError(f"BFCL bridge ({self.venv}/bin/python) is not running ({what})")
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # _read reports the exit and the runner's last line
            return self._read(what)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def items(self, category: str) -> list[dict]:
        """The category's entries as the runner's ``load`` returns them (read once per bridge)."""
        check_category(category)
        if category not in self._items:
            self._items[category] = self.request({"op": "load", "category": category}, f"loading bfcl:{category}")["items"]
        return self._items[category]

    def grade(self, category: str, item_id: str, result: list[dict] | str, tool_form: str | None = None) -> dict:
        """BFCL's evaluation of one entry: ``result`` as BFCL stores an OpenAI function-calling
        model's answer (``[{name: arguments_json}]``, or the reply's text when it called nothing);
        with ``tool_form`` ToolForm.BFCL_PROMPT, the text answer to BFCL's plain prompt, which
        BFCL's prompting decoder reads."""
        check_category(category)
        return self.request({"op": "grade", "category": category, "id": item_id, "result": result,
                             "tool_form": tool_form}, f"grading bfcl:{category} item {item_id!r}")

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> "BfclBridge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: list[BfclBridge] = []  # at most one: the process's bridge, closed at exit
_shared_lock = threading.Lock()


def shared_bridge() -> BfclBridge:
    """The process's bridge, started on first use (and again if it died), closed at exit."""
    with _shared_lock:
        if _shared and _shared[0].alive:
            return _shared[0]
        if _shared:
            _shared.pop().close()
        else:
            atexit.register(close_shared_bridge)
        _shared.append(BfclBridge())
        return _shared[0]


def close_shared_bridge() -> None:
    with _shared_lock:
        while _shared:
            _shared.pop().close()


def check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise LogitdiffError(f"bfcl:{category}: not a BFCL category here (one of {', '.join(CATEGORIES)})")


def bfcl_records(category: str) -> list[dict]:
    """The category's entries as workload records (logitdiff.workload.benchmarks reads them as items)."""
    check_category(category)
    budget = MAX_TOKENS[category]
    return [{"id": e["id"], "messages": e["messages"], "tools": e["tools"], "tags": ["tool", "bfcl", category],
             "max_tokens": budget, "expected": {"bfcl": {"category": category, "id": e["id"]}}}
            for e in shared_bridge().items(category)]


def _concrete(option: Any, schema: dict) -> Any:
    """One option of a parameter made a value, as BFCL's checker reads it (ast_checker's
    simple_function_checker): a dict parameter's option is a dict of key -> options
    (dict_checker), an array-of-dicts parameter's a list of such dicts (list_dict_checker);
    inside them each key takes its first option, "" meaning left out. Any other option is
    the value itself."""
    def one(d: dict) -> dict:
        return {k: opts[0] for k, opts in d.items() if opts and opts[0] != ""}

    kind = schema.get("type")
    if kind == "object" and isinstance(option, dict):
        return one(option)
    if kind == "array" and (schema.get("items") or {}).get("type") == "object" and isinstance(option, list):
        return [one(d) if isinstance(d, dict) else d for d in option]
    return option


def ground_truth_calls(possible_answer: list[dict], names: dict[str, str], tools: list[dict]) -> tuple[list[tuple[str, dict]], list[str]]:
    """(tool name as offered, arguments) per call of a possible answer, and why no answer can
    pass where BFCL's own data rules every one out (else empty). Per parameter: one the
    function requires takes its first option that is not "" (BFCL's mark for "may be left
    out"; "" itself when that is the only one), any other its first option, "" leaving it
    out; a parameter the function does not define is left out (passes only where "" is among
    its options). A parameter with no options at all cannot pass (left out, or given any value)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    calls, why = [], []
    for call in possible_answer:
        ((name, params),) = call.items()
        tool_name = names.get(name, name)
        schema = schemas.get(tool_name, {})
        props, required = schema.get("properties") or {}, set(schema.get("required") or ())
        args = {}
        for p, opts in params.items():
            if not opts:
                why.append(f"{name}: parameter {p!r} has no possible value")
            elif p not in props:
                if "" not in opts:
                    why.append(f"{name}: parameter {p!r} is not the function's, and may not be left out")
            else:
                pick = next((o for o in opts if o != ""), "") if p in required else opts[0]
                if pick != "" or p in required:
                    args[p] = _concrete(pick, props[p])
        calls.append((tool_name, args))
    return calls, why


def hermes_blocks(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def python_calls(calls: list[tuple[str, dict]]) -> str:
    """Calls in the syntax BFCL's default plain prompt asks for (``[func(a=1, b='x'), g()]``,
    Python literals), which its prompting decoder parses."""
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


def bfcl_ground_truth(category: str, tool_form: str = ToolForm.CHAT_TEMPLATE) -> dict[str, str]:
    """Entry id -> its possible answer written as a model writes calls in ``tool_form`` (see
    ground_truth_calls): Hermes blocks to the tools' names for the chat template's tools,
    BFCL's Python call list to the functions' own names for its plain prompt; for
    irrelevance, a reply that calls nothing."""
    check_category(category)
    out = {}
    for e in shared_bridge().items(category):
        if category in IRRELEVANCE:
            out[e["id"]] = NO_CALL_ANSWER
            continue
        calls = ground_truth_calls(e["ground_truth"], e["names"], e["tools"])[0]
        if tool_form == ToolForm.BFCL_PROMPT:
            own = {tool: name for name, tool in e["names"].items()}
            out[e["id"]] = python_calls([(own.get(n, n), a) for n, a in calls])
        else:
            out[e["id"]] = hermes_blocks(calls)
    return out


def in_tool_form(item: Item, tool_form: str) -> Item:
    """A BFCL item as ``tool_form`` shows it to the model, the form written in its label
    (``expected.bfcl.tool_form``, which tells the grader which of BFCL's decoders reads the
    answer). CHAT_TEMPLATE: the item as read (messages, tools for the template's ``tools``).
    BFCL_PROMPT: BFCL's prompting-mode first turn (``prompt_messages``, from BFCL's own code
    across the bridge: its default system prompt with the function docs, then the question),
    no ``tools``. An item in that form already, or one without a BFCL label, is returned as is."""
    label = (item.expected or {}).get("bfcl")
    if tool_form not in ToolForm.ALL:
        raise LogitdiffError(f"item {item.id!r}: tool form {tool_form!r} is not one of {', '.join(ToolForm.ALL)}")
    if not isinstance(label, dict) or ToolForm.FIELD in label:
        return item
    expected = {**(item.expected or {}), "bfcl": {**label, ToolForm.FIELD: tool_form}}
    if tool_form == ToolForm.CHAT_TEMPLATE:
        return dataclasses.replace(item, expected=expected)
    entry = next((e for e in shared_bridge().items(label["category"]) if e["id"] == label["id"]), None)
    if entry is None:
        raise LogitdiffError(f"item {item.id!r}: BFCL has no entry {label['id']!r} in {label['category']}")
    return dataclasses.replace(item, messages=entry["prompt_messages"], tools=None, expected=expected)


def bfcl_unpassable(category: str) -> dict[str, str]:
    """Entry id -> why no answer can pass it, for the entries whose possible answer BFCL's own
    checker can never accept (a parameter with no possible value; one the function does not
    have that may not be left out). BFCL scores them wrong for every model; they stay in the
    workload, and ``workloads check`` names them and confirms the checker rejects them."""
    check_category(category)
    if category in IRRELEVANCE:
        return {}
    out = {}
    for e in shared_bridge().items(category):
        why = ground_truth_calls(e["ground_truth"], e["names"], e["tools"])[1]
        if why:
            out[e["id"]] = "; ".join(why)
    return out
