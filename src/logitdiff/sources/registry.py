"""Source kinds -> factories: the one place a spec's ``KIND:`` is looked up.

A factory takes the parsed :class:`~logitdiff.sources.base.Spec` and returns an open
source. The built-in kinds are named here as ``"module:function"`` strings and imported
only when a spec of that kind is opened, so this module imports no backend (and
:mod:`logitdiff.builtin`, which imports the backends, does not import it back).
"""

from __future__ import annotations

import importlib
from typing import Callable, Union

from ..errors import LogitdiffError
from .base import RowKind, Source, Spec, parse_spec
from .options import canonical_kind

Factory = Callable[[Spec], Source]

_FACTORIES: dict[str, Union[str, Factory]] = {
    "hf": "logitdiff.sources.hf:open_hf",
    "gguf": "logitdiff.sources.gguf:open_gguf",
    "served": "logitdiff.sources.served:open_served",
    "builtin": "logitdiff.builtin:open_builtin",
}


# Tokenizer-only opens (no weights) of the built-in kinds, for checks that only render
# prompts (capture.preflight_tokenization); a kind without one is opened in full.
_TOKENIZER_FACTORIES: dict[str, str] = {
    "hf": "logitdiff.sources.hf:open_hf_tokenizer",
    "gguf": "logitdiff.sources.gguf:open_gguf_tokenizer",
    "builtin": "logitdiff.builtin:open_builtin_tokenizer",
}


# What each built-in kind's rows are, known before a source opens (a kind registered later
# declares none: None).
_ROW_KINDS: dict[str, RowKind] = {"hf": RowKind.FULL, "gguf": RowKind.FULL, "builtin": RowKind.FULL, "served": RowKind.TOPK}


def declared_row_kind(text: str) -> RowKind | None:
    """The row kind of spec ``text`` without opening it: that of a built-in kind, else None."""
    return _ROW_KINDS.get(canonical_kind(parse_spec(text).kind))


def register(kind: str, factory: Union[str, Factory]) -> None:
    """Make ``KIND:...`` specs open with ``factory`` (a callable taking a :class:`Spec`, or a
    ``"module:function"`` string imported on first use). Re-registering a kind replaces it."""
    if not kind or ":" in kind or "," in kind:
        raise ValueError(f"source kind {kind!r}: must be a non-empty name without ':' or ','")
    _FACTORIES[kind] = factory
    _ROW_KINDS.pop(kind, None)
    _TOKENIZER_FACTORIES.pop(kind, None)


def kinds() -> list[str]:
    """The registered source kinds (``openai``, an alias of ``served``, not listed)."""
    return sorted(_FACTORIES)


def _factory(kind: str, text: str) -> Factory:
    f = _FACTORIES.get(kind) or _FACTORIES.get(canonical_kind(kind))
    if f is None:
        raise LogitdiffError(f"source spec {text!r}: unknown kind {kind!r} (expected one of {', '.join(kinds())})")
    if isinstance(f, str):
        module, _, name = f.partition(":")
        f = getattr(importlib.import_module(module), name)
    return f


def open_source(text: str) -> Source:
    """Build a source from its spec string ``KIND:TARGET[,key=value...]``."""
    spec = parse_spec(text)
    return _factory(spec.kind, text)(spec)


def open_tokenizer(text: str) -> Source:
    """A source of spec ``text`` that renders prompts (``render``/``render_many``) and may do
    nothing else: its kind's tokenizer-only open (no weights) where it has one, else the full
    source (``served:``, kinds registered later)."""
    spec = parse_spec(text)
    kind = canonical_kind(spec.kind)
    f = _TOKENIZER_FACTORIES.get(spec.kind) or _TOKENIZER_FACTORIES.get(kind)
    if f is None:
        return open_source(text)
    module, _, name = f.partition(":")
    return getattr(importlib.import_module(module), name)(spec)
