"""Each engine's layer hooks: where an architecture family's per-layer residual stream is in
transformers and in llama.cpp, and the reader that hands out a window's hidden states of
every such point with the window's logits (what stage *layers* compares).

The point compared is the same in both engines: transformers' decoder layer ``i`` output
(a forward hook on ``model.layers[i]``; ``hidden_states[-1]`` of a transformers forward is
*after* the final norm, so it is not used: :mod:`.layer_hooks_hf`) and llama.cpp's
``l_out-i`` (the graph evaluation callback ``cb_eval`` of a second llama.cpp context on the
same loaded model: :mod:`.layer_hooks_gguf`).

A reader (:class:`LayerHooks`) has ``engine``, ``family``, ``n_layer``, ``hidden``, ``src``
and ``begin()`` (a new sequence: empty KV cache), ``window(tokens, n_past, sel)`` ->
(hidden states ``[points, len(sel), H]`` float32, logits ``[len(sel), V]`` float32) and
``close()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import LogitdiffError

NOT_IN_PROCESS = "per-layer hidden states need an in-process hf:, gguf: or builtin: source"


@dataclass(frozen=True)
class Family:
    """Where one architecture family's per-layer residual stream is, in each engine: the
    decoder layers' outputs (transformers: ``model.layers[i]``; llama.cpp: ``l_out-i``) and,
    when ``embedding``, the token embedding before any scaling (transformers:
    ``model.embed_tokens``; llama.cpp: ``embd``)."""

    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    embedding: bool  # both engines expose the same embedding point


# Gemma scales the embedding by sqrt(H) in a place that differs between transformers
# versions (inside embed_tokens or in the model's forward), so only its layers are compared.
FAMILIES = (
    Family("llama", ("llama", "mistral"), ("llama",), True),
    Family("qwen", ("qwen2", "qwen3"), ("qwen2", "qwen3"), True),
    Family("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"), ("gemma", "gemma2", "gemma3"), False),
)


def family_of(engine: str, arch: str | None, spec: str) -> Family:
    """The family of a transformers ``model_type`` or a GGUF ``general.architecture``."""
    for f in FAMILIES:
        if arch in (f.hf_model_types if engine == "hf" else f.gguf_archs):
            return f
    known = sorted({a for f in FAMILIES for a in (f.hf_model_types if engine == "hf" else f.gguf_archs)})
    raise LogitdiffError(f"{spec}: architecture {arch!r} has no per-layer mapping (layers knows {', '.join(known)})")


def point_names(family: Family, n_layer: int) -> list[str]:
    return (["embedding"] if family.embedding else []) + [f"layer {i}" for i in range(n_layer)]


class LayerHooks(Protocol):
    """What stage *layers* reads from an engine (see the module doc)."""

    engine: str
    family: Family
    n_layer: int
    hidden: int
    src: Any

    def begin(self) -> None: ...

    def window(self, tokens: Sequence[int], n_past: int, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def close(self) -> None: ...


def geometry_of(source) -> tuple[Family, int, int]:
    """(family, decoder layers, hidden size) of an open source, without running it."""
    from .gguf import GGUFSource
    from .hf import HFSource

    if isinstance(source, HFSource):
        cfg = source.config
        return family_of("hf", getattr(cfg, "model_type", None), source.spec), len(source.base.layers), int(cfg.hidden_size)
    if isinstance(source, GGUFSource):
        import llama_cpp

        model = source.llm._model.model
        return (family_of("gguf", source.arch, source.spec), int(llama_cpp.llama_model_n_layer(model)),
                int(llama_cpp.llama_model_n_embd(model)))
    raise LogitdiffError(f"{source.spec}: {NOT_IN_PROCESS}")


def layer_hooks(source, *, window: int, split: bool = False) -> LayerHooks:
    """The per-layer reader of an open source (transformers or llama.cpp): ``window`` tokens
    per forward pass at most; ``split``: each window in two forward passes (the floor's other
    layout, other float rounding)."""
    from .gguf import GGUFSource
    from .hf import HFSource

    if isinstance(source, HFSource):
        from .layer_hooks_hf import HFLayers

        return HFLayers(source, split=split)
    if isinstance(source, GGUFSource):
        from .layer_hooks_gguf import GGUFLayers

        return GGUFLayers(source, window=window, split=split)
    raise LogitdiffError(f"{source.spec}: {NOT_IN_PROCESS}")


