"""Where each architecture family's per-layer residual stream is, in transformers and in
llama.cpp (the names :mod:`.layer_hooks` reads); data only, imported by the layer hooks of
every engine."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LogitdiffError


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
