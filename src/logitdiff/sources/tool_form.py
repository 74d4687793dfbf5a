"""Whether a source's chat template takes tools, and the form benchmark items are shown in.

A chat template receives ``tools=`` from every renderer (transformers' ``apply_chat_template``,
the GGUF jinja2 render, a server's template endpoint), and one written without tool support
(SmolLM2-135M-Instruct's) drops them without a word: the model is asked to call functions
it never sees. BFCL documents a form for such models, its prompting mode (the functions in
its own system prompt, the answer a Python call list): an item with a BFCL label is shown in
that form where the template takes no tools (:func:`in_source_tool_form`; the text and the
decoder are BFCL's own, logitdiff.workload.bfcl.in_tool_form).

The rule (:func:`takes_tools`): a fixed probe conversation, one user turn, rendered through the
source's own ``render`` with one probe tool and without it. Different prompt ids: the template
renders tools. The same ids: it ignores them. A render that fails with the tool but not without
it: the template refuses tools (no support either). The probe is the same for every source, so
the answer depends only on the template and its renderer: it is kept per template text on the
source (:func:`source_takes_tools`), probed once however many items follow.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

from ..contracts import ToolForm
from ..errors import LogitdiffError
from ..workload.bfcl import in_tool_form
from ..workload.items import Item

PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris today?"}]
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}]


def takes_tools(render: Callable[[Item], Sequence[int]]) -> bool:
    """Whether ``render`` (a source's item -> prompt ids) shows a tool to the model: the probe
    rendered with :data:`PROBE_TOOLS` differs from the probe rendered without (module docstring).
    A probe that fails without tools is the template's own error, raised."""
    bare = list(render(Item(id="tool-support-probe", messages=PROBE_MESSAGES)))
    try:
        with_tools = list(render(Item(id="tool-support-probe", messages=PROBE_MESSAGES, tools=PROBE_TOOLS)))
    except LogitdiffError:
        return False  # the template refuses tools (raise_exception in it, a type it cannot format)
    return with_tools != bare


def template_key(source: Any) -> str:
    """What the answer of :func:`takes_tools` is kept under: the source's template text where
    it holds one (``gguf:`` its ``tokenizer.chat_template``, ``hf:`` its tokenizer's), else
    its spec (a served model's template lives on its server)."""
    text = getattr(source, "chat_template", None)
    if text is None:
        text = getattr(getattr(source, "tok", None), "chat_template", None)
    kind = type(source).__name__
    return f"{kind}:{hashlib.sha256(str(text).encode()).hexdigest()}" if text is not None else f"{kind}:{source.spec}"


def source_takes_tools(source: Any) -> bool:
    """:func:`takes_tools` of the source's render, probed once per template text (kept on the source)."""
    known: dict[str, bool] = source.__dict__.setdefault("tool_support_by_template", {})
    key = template_key(source)
    if key not in known:
        known[key] = takes_tools(source.render)
    return known[key]


def needs_tool_form(items: Sequence[Item]) -> bool:
    """Whether any item is a benchmark item whose form a source decides (a BFCL label with
    tools and no form yet): only then is the template probed."""
    return any(isinstance((it.expected or {}).get("bfcl"), dict) and ToolForm.FIELD not in it.expected["bfcl"]  # type: ignore[index]
               for it in items)


def in_source_tool_form(source: Any, items: Sequence[Item]) -> tuple[list[Item], str | None]:
    """The items as ``source`` shows them, and the ToolForm chosen (None when no item is a
    benchmark item still to be given one): BFCL items in the chat-template form where the
    template takes tools, in BFCL's plain prompt where it does not; other items as they are."""
    if not needs_tool_form(items):
        return list(items), None
    form = ToolForm.CHAT_TEMPLATE if source_takes_tools(source) else ToolForm.BFCL_PROMPT
    return [in_tool_form(it, form) for it in items], form
