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

from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import LogitdiffError
from .layer_families import FAMILIES, Family, family_of, point_names

__all__ = ["FAMILIES", "NOT_IN_PROCESS", "Family", "LayerHooks", "family_of", "geometry_of", "layer_hooks", "point_names"]

NOT_IN_PROCESS = "per-layer hidden states need an in-process hf:, gguf: or builtin: source"


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

        return HFLayers(source, family_of("hf", getattr(source.config, "model_type", None), source.spec), split=split)
    if isinstance(source, GGUFSource):
        from .layer_hooks_gguf import GGUFLayers

        return GGUFLayers(source, family_of("gguf", source.arch, source.spec), window=window, split=split)
    raise LogitdiffError(f"{source.spec}: {NOT_IN_PROCESS}")


