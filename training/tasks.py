"""Seeded synthetic tasks for the bundled ``builtin:tiny`` model, and its evaluation workload.

Build-time code, outside the installed package. Pure Python (no torch): the training script
(``training/train_tiny.py``) draws its chat/tool data from here, and :func:`build_workload` writes the bundled workload with a held-out seed.

Task families
-------------
* ``math``   - small addition / subtraction (single-digit operands, results >= 0), labelled answer;
* ``copy``   - "Repeat exactly: ..." , labelled answer;
* ``lookup`` - "a=3, b=7. What is b?", labelled answer;
* ``tool``   - a request that needs one of :data:`TOOLS`; the reply is exactly
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``json.dumps`` default separators).

The chat format is ChatML; :data:`CHAT_TEMPLATE` (jinja) and :func:`render_chat` (Python) render
the same string.  Tool schemas are stored with keys sorted at every level and contain only ASCII
without ``<>&'`` so that jinja2's own ``tojson`` (sorted keys, HTML-safe) and transformers'
``tojson`` (insertion order) produce identical text.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOL_INSTRUCTIONS = (
    "To call a function, reply with <tool_call>"
    '{"name": NAME, "arguments": ARGUMENTS}'
    "</tool_call> where ARGUMENTS is a JSON object."
)

# Jinja chat template.  Every block tag strips whitespace on both sides and every newline is
# emitted by an expression, so the output does not depend on trim_blocks / lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] -}}"
    "{%- set ns.start = 1 -%}"
    "{%- else -%}"
    "{{- '" + DEFAULT_SYSTEM + "' -}}"
    "{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou can call these functions:\\n' -}}"
    "{%- for t in tools -%}"
    "{{- t | tojson -}}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '" + TOOL_INSTRUCTIONS + "' -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.start:] -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def _sorted(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True))


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return _sorted(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": props, "required": required},
            },
        }
    )


TOOLS: list[dict] = [
    _tool(
        "get_weather",
        "Get the current weather for a city.",
        {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        ["city", "unit"],
    ),
    _tool(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        {
            "amount": {"type": "number", "description": "Amount to convert"},
            "from_currency": {"type": "string", "description": "Currency code, e.g. USD"},
            "to_currency": {"type": "string", "description": "Currency code, e.g. EUR"},
        },
        ["amount", "from_currency", "to_currency"],
    ),
    _tool(
        "set_timer",
        "Start a countdown timer.",
        {
            "minutes": {"type": "integer", "description": "Duration in minutes"},
            "label": {"type": "string", "description": "Name of the timer"},
        },
        ["minutes", "label"],
    ),
    _tool(
        "search_files",
        "Search local files by text.",
        {
            "query": {"type": "string", "description": "Text to search for"},
            "max_results": {"type": "integer", "description": "Maximum number of results"},
        },
        ["query", "max_results"],
    ),
    _tool(
        "send_email",
        "Send an email message.",
        {
            "to": {"type": "string", "description": "Recipient address"},
            "subject": {"type": "string"},
            "body": {"type": "string"},
        },
        ["to", "subject", "body"],
    ),
    _tool(
        "set_light",
        "Switch the lights in a room on or off.",
        {
            "room": {"type": "string", "description": "Room name"},
            "on": {"type": "boolean", "description": "True to switch on"},
        },
        ["room", "on"],
    ),
]
TOOLS_BY_NAME = {t["function"]["name"]: t for t in TOOLS}


# --------------------------------------------------------------------------------------------
# rendering


def render_chat(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
    """Python twin of :data:`CHAT_TEMPLATE`."""
    out = []
    start = 0
    if tools:
        out.append("<|im_start|>system\n")
        if messages and messages[0]["role"] == "system":
            out.append(messages[0]["content"])
            start = 1
        else:
            out.append(DEFAULT_SYSTEM)
        out.append("\n\n# Tools\n\nYou can call these functions:\n")
        for t in tools:
            out.append(json.dumps(t) + "\n")
        out.append(TOOL_INSTRUCTIONS)
        out.append("<|im_end|>\n")
    for m in messages[start:]:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def tool_call_text(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def parse_tool_call(text: str) -> dict | None:
    """Parse the first ``<tool_call>{...}</tool_call>`` in ``text``; None if absent or invalid."""
    a = text.find("<tool_call>")
    if a < 0:
        return None
    b = text.find("</tool_call>", a)
    if b < 0:
        return None
    try:
        obj = json.loads(text[a + len("<tool_call>") : b])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return obj


# --------------------------------------------------------------------------------------------
# generators (each returns (user_text, expected) where expected is {"answer"} or {"tool_call"})

WORDS = (
    "apple river stone green blue cloud seven table window garden music paper light quiet "
    "orange silver north basket candle forest summer winter yellow rabbit mirror pencil ocean "
    "thunder castle bridge little golden purple monkey rocket planet coffee butter violet"
).split()
VARS = list("abcdefghkmnpqrstuvwxyz")


def gen_math(rng: random.Random) -> tuple[str, dict]:
    a, b = rng.randrange(10), rng.randrange(10)
    if rng.random() < 0.5:
        op, r = "+", a + b
    else:
        if a < b:
            a, b = b, a
        op, r = "-", a - b
    form = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Calculate {a} {op} {b}."])
    return form.format(a=a, op=op, b=b), {"answer": str(r)}


def gen_copy(rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
    form = rng.choice(["Repeat exactly: {w}", "Repeat exactly: {w}", "Copy this text: {w}"])
    return form.format(w=words), {"answer": words}


def gen_lookup(rng: random.Random) -> tuple[str, dict]:
    n = rng.randint(2, 3)
    names = rng.sample(VARS, n)
    vals = [rng.randrange(100) for _ in names]
    q = rng.randrange(n)
    facts = ", ".join(f"{k}={v}" for k, v in zip(names, vals))
    return f"{facts}. What is {names[q]}?", {"answer": str(vals[q])}


CITIES = (
    "Paris London Berlin Madrid Rome Tokyo Sydney Toronto Chicago Boston Dublin Oslo Vienna Prague "
    "Lisbon Athens Cairo Lima Seoul Delhi Moscow Warsaw Zurich Denver Austin Miami Seattle Havana "
    "Nairobi Helsinki"
).split()
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK"]
LABELS = ["tea", "pasta", "laundry", "eggs", "break", "workout", "meeting", "bread", "pizza", "study", "nap", "rice"]
QUERIES = [
    "invoice", "budget report", "holiday photos", "meeting notes", "tax return", "resume",
    "project plan", "recipe", "contract", "todo list", "slides", "draft",
]
PEOPLE = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
DOMAINS = ["example.com", "mail.org", "work.net"]
SUBJECTS = ["Lunch", "Meeting", "Report", "Hello", "Party", "Update", "Trip", "Invoice"]
BODIES = [
    "See you at noon.", "The report is ready.", "Thanks for your help.", "Call me later.",
    "The meeting is moved to Friday.", "Happy birthday!", "Please review the draft.", "I am running late.",
]
ROOMS = ["kitchen", "bedroom", "office", "garage", "hallway", "bathroom", "living room", "garden"]


def _tool_request(rng: random.Random, name: str) -> tuple[str, dict]:
    if name == "get_weather":
        city, unit = rng.choice(CITIES), rng.choice(["celsius", "fahrenheit"])
        u = unit  # argument values appear verbatim in the request
        form = rng.choice([
            "What is the weather in {c} in {u}?",
            "How warm is it in {c}? Use {u}.",
            "Weather for {c} please, in {u}.",
            "Tell me the temperature in {c} in {u}.",
        ])
        return form.format(c=city, u=u), {"city": city, "unit": unit}
    if name == "convert_currency":
        amount: int | float = rng.randint(1, 999)
        if rng.random() < 0.25:
            amount = amount + 0.5
        fr, to = rng.sample(CURRENCIES, 2)
        form = rng.choice([
            "Convert {a} {f} to {t}.",
            "How much is {a} {f} in {t}?",
            "Please change {a} {f} into {t}.",
        ])
        return form.format(a=amount, f=fr, t=to), {"amount": amount, "from_currency": fr, "to_currency": to}
    if name == "set_timer":
        minutes, label = rng.randint(1, 90), rng.choice(LABELS)
        form = rng.choice([
            "Set a timer for {m} minutes called {l}.",
            "Start a {m} minute timer for {l}.",
            "Timer: {m} minutes, label it {l}.",
        ])
        return form.format(m=minutes, l=label), {"label": label, "minutes": minutes}
    if name == "search_files":
        q, n = rng.choice(QUERIES), rng.randint(1, 20)
        form = rng.choice([
            "Find files about {q}, at most {n} results.",
            "Search my files for {q} and show {n} results.",
            "Look for {q} in my files (max {n}).",
        ])
        return form.format(q=q, n=n), {"max_results": n, "query": q}
    if name == "send_email":
        to = f"{rng.choice(PEOPLE)}@{rng.choice(DOMAINS)}"
        subj, body = rng.choice(SUBJECTS), rng.choice(BODIES)
        form = rng.choice([
            "Email {to} with subject {s} saying: {b}",
            "Send an email to {to}, subject {s}, body: {b}",
            "Write to {to}. Subject: {s}. Message: {b}",
        ])
        return form.format(to=to, s=subj, b=body), {"body": body, "subject": subj, "to": to}
    if name == "set_light":
        room, on = rng.choice(ROOMS), rng.random() < 0.5
        form = rng.choice([
            "Turn {o} the lights in the {r}.",
            "Switch the {r} lights {o}.",
            "Please turn the {r} light {o}.",
        ])
        return form.format(o="on" if on else "off", r=room), {"on": on, "room": room}
    raise ValueError(name)


def gen_tool(rng: random.Random) -> tuple[str, list[dict], dict]:
    """A request, the tools offered (1-3, including the right one, shuffled) and the expected call."""
    target = rng.choice(TOOLS)
    name = target["function"]["name"]
    others = [t for t in TOOLS if t is not target]
    offered = [target] + rng.sample(others, rng.randint(0, 2))
    rng.shuffle(offered)
    user, args = _tool_request(rng, name)
    # argument order follows the schema's property order (sorted)
    props = target["function"]["parameters"]["properties"]
    args = {k: args[k] for k in props if k in args}
    return user, offered, {"tool_call": {"name": name, "arguments": args}}


def answer_text(expected: dict) -> str:
    if "tool_call" in expected:
        return tool_call_text(expected["tool_call"]["name"], expected["tool_call"]["arguments"])
    return expected["answer"]


def gen_chat(rng: random.Random, kind: str) -> dict:
    """One training/eval chat example: {"kind", "messages", "tools"?, "expected"}."""
    tools = None
    if kind == "tool":
        user, tools, expected = gen_tool(rng)
    else:
        user, expected = {"math": gen_math, "copy": gen_copy, "lookup": gen_lookup}[kind](rng)
    messages = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": DEFAULT_SYSTEM})
    messages.append({"role": "user", "content": user})
    ex = {"kind": kind, "messages": messages, "expected": expected}
    if tools is not None:
        ex["tools"] = tools
    return ex


# --------------------------------------------------------------------------------------------
# text sources

CODE_MODULES = [
    "textwrap.py", "json/encoder.py", "shutil.py", "posixpath.py", "functools.py", "string.py",
    "base64.py", "fnmatch.py", "glob.py", "heapq.py", "bisect.py", "calendar.py", "difflib.py",
    "csv.py", "random.py", "statistics.py", "colorsys.py", "ipaddress.py", "fractions.py", "shlex.py",
]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def prose_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def _code_prompts(rng: random.Random, n: int) -> list[str]:
    cands = []
    for rel in CODE_MODULES:
        p = stdlib_dir() / rel
        if not p.exists():
            continue
        src = p.read_text(encoding="utf-8")
        lines = src.splitlines(keepends=True)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.col_offset == 0:
                doc = node.body[0]
                text = "".join(lines[node.lineno - 1 : doc.end_lineno])
                if 80 <= len(text) <= 600:
                    cands.append(text)
    rng.shuffle(cands)
    return cands[:n]


def _prose_prompts(rng: random.Random, n: int) -> list[str]:
    paras = []
    for key, text in sorted(prose_topics().items()):
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= 250 and para[0].isalpha() and "::" not in para and "*" not in para:
                paras.append(para)
                break
    rng.shuffle(paras)
    out = []
    for p in paras[:n]:
        cut = p[:220]
        cut = cut[: cut.rfind(" ")]
        out.append(cut)
    return out


# --------------------------------------------------------------------------------------------
# workload

WORKLOAD_SEED = 20260529  # held out: training uses its own seed and also skips these prompts


def build_workload(seed: int = WORKLOAD_SEED) -> list[dict]:
    rng = random.Random(seed)
    items: list[dict] = []
    for k, p in enumerate(_code_prompts(rng, 16)):
        items.append({"id": f"code-{k:02d}", "prompt": p, "tags": ["code"], "max_tokens": 48})
    for k, p in enumerate(_prose_prompts(rng, 12)):
        items.append({"id": f"prose-{k:02d}", "prompt": p, "tags": ["prose"], "max_tokens": 48})
    counts = {"math": 8, "tool": 12, "copy": 10, "lookup": 10}
    max_tokens = {"math": 8, "tool": 48, "copy": 24, "lookup": 8}
    seen: set[str] = set()
    for kind, n in counts.items():
        k = 0
        while k < n:
            ex = gen_chat(rng, kind)
            ex["messages"] = [m for m in ex["messages"] if m["role"] != "system"]
            user = ex["messages"][-1]["content"]
            if user in seen:
                continue
            seen.add(user)
            it = {"id": f"{kind}-{k:02d}", "messages": ex["messages"]}
            if "tools" in ex:
                it["tools"] = ex["tools"]
            it["tags"] = [kind]
            it["max_tokens"] = max_tokens[kind]
            it["expected"] = ex["expected"]
            items.append(it)
            k += 1
    return items


def write_workload(path: str | Path, seed: int = WORKLOAD_SEED) -> list[dict]:
    items = build_workload(seed)
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    return items


if __name__ == "__main__":  # python training/tasks.py [OUT]
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "src" / "logitdiff" / "builtin" / "workload.jsonl")
    print(len(write_workload(out)), "items ->", out)
