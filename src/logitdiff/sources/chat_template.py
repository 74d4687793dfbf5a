"""Chat templates rendered under a time bound and an output bound.

A chat template is code shipped with a model (jinja2, in a sandbox that stops it reaching the
process but not from looping): two nested loops over ``range(99999)`` run for hours, and a loop
over a long string multiplies the prompt until memory runs out. Every source that renders a
template (``hf:`` through transformers' ``apply_chat_template``, ``gguf:`` through its own
jinja2 environment, a served source's local tokenizer) renders it through
:func:`render_bounded`, which stops the render with one line naming the source and the bound
once it runs past :data:`RENDER_SECONDS` or its output past :data:`RENDER_MAX_CHARS`.

How: the render runs with a trace function (``sys.settrace``) on the calling thread, for the
duration of that one call, the thread's previous trace function put back after it (a debugger's
or coverage's). Template code (jinja2 compiles a template to Python whose frames come from
``<template>``) is traced line by line, so a loop with no call in it is seen too; every other
frame is seen as it is entered only. Every 256 events the clock is read; each piece of output
the template's top-level ``root`` generator yields is counted, so the output bound holds while
the render runs, before the pieces are joined. transformers' render stays transformers' (its
data conversion and globals are part of what a template sees): the bound wraps it, nothing is
re-implemented. What it cannot stop is one expression that is itself huge (``'x' * 10**10``):
the time of a single C operation is not interruptible from Python.

The cost: a template's lines run traced, a few milliseconds per rendered prompt.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from ..errors import LogitdiffError

RENDER_SECONDS = 10.0  # a real template renders a prompt in milliseconds
RENDER_MAX_CHARS = 1 << 24  # 16 Mi characters: beyond any context window's worth of text
_TEMPLATE_FILE = "<template>"  # jinja2's file name of a template compiled from a string
_CHECK_EVERY = 256  # trace events between two readings of the clock


class _BoundExceeded(BaseException):
    """Raised inside the render (a BaseException: no ``except Exception`` in jinja2 or
    transformers turns it into another error on its way out)."""


def render_bounded(render: Callable[[], Any], where: str, *, seconds: float | None = None,
                   max_chars: int | None = None) -> Any:
    """``render()`` (a chat template's render, and what its caller does around it), stopped
    with a one-line LogitdiffError naming ``where`` and the bound once it runs longer than
    ``seconds`` or its template yields more than ``max_chars`` characters (default: the
    module's :data:`RENDER_SECONDS` and :data:`RENDER_MAX_CHARS` as they are at the call); its
    result otherwise."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    max_chars = RENDER_MAX_CHARS if max_chars is None else max_chars
    deadline = time.monotonic() + seconds
    state = {"events": 0, "chars": 0}

    def check() -> None:
        state["events"] += 1
        if state["events"] % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise _BoundExceeded(f"ran past the {seconds:g} s bound")

    def in_template(frame, event, arg):
        check()
        if event == "return" and type(arg) is str and frame.f_code.co_name == "root":
            state["chars"] += len(arg)
            if state["chars"] > max_chars:
                raise _BoundExceeded(f"rendered more than the {max_chars:,} characters bound")
        return in_template

    def on_call(frame, event, arg):
        check()
        return in_template if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        out = render()
    except _BoundExceeded as e:
        raise LogitdiffError(f"{where}: chat template {e}") from None
    finally:
        sys.settrace(previous)
    text = out if isinstance(out, str) else None
    if text is not None and len(text) > max_chars:  # a template whose output the trace did not see
        raise LogitdiffError(f"{where}: chat template rendered more than the {max_chars:,} characters bound")
    return out
