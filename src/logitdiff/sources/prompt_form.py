"""Which form HumanEval items are put to a source in (contracts.PromptForm).

Instruct models are evaluated on HumanEval in EvalPlus's chat form (a ``messages`` item,
logitdiff.workload.benchmarks); EvalPlus itself falls back to the raw prompt where the
tokenizer has no chat template (provider/utility.py ``make_raw_chat_prompt``). The same rule
here: a source that renders a one-turn probe conversation takes the instruct form; one whose
render refuses chat messages (no chat template: a ``LogitdiffError``) gets the raw completion form.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..contracts import PromptForm
from ..errors import LogitdiffError
from ..workload.benchmarks import in_prompt_form
from ..workload.items import Item

PROBE = Item(id="chat-template-probe", messages=[{"role": "user", "content": "Write a Python function."}])


def renders_chat(source: Any) -> bool:
    """Whether ``source`` renders chat messages (has a chat template), probed once and kept on the source."""
    known = source.__dict__.get("renders_chat")
    if known is None:
        try:
            source.render(PROBE)
            known = True
        except LogitdiffError:
            known = False
        source.__dict__["renders_chat"] = known
    return bool(known)


def needs_prompt_form(items: Sequence[Item]) -> bool:
    """Whether any item is a HumanEval item in the instruct form (one a source may need in another)."""
    return any(isinstance((it.expected or {}).get("tests"), dict)
               and it.expected["tests"].get(PromptForm.FIELD) == PromptForm.EVALPLUS_INSTRUCT  # type: ignore[index]
               for it in items)


def in_source_prompt_form(source: Any, items: Sequence[Item]) -> tuple[list[Item], str | None]:
    """The items as ``source`` takes them and the PromptForm chosen (None where no item needed a
    choice): instruct-form HumanEval items stay so where the source renders chat messages and
    become the raw completion form where it does not; other items as they are."""
    if not needs_prompt_form(items):
        return list(items), None
    form = PromptForm.EVALPLUS_INSTRUCT if renders_chat(source) else PromptForm.COMPLETION
    return [in_prompt_form(it, form) for it in items], form
