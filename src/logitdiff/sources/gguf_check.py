"""A GGUF's tensors checked against its own metadata before llama.cpp or transformers reads it.

llama.cpp trusts the header: a ``{arch}.block_count`` of 0 or above its ``LLAMA_MAX_LAYERS``
(512) aborts the process (SIGABRT, no message) while it loads the weights, and transformers
builds a model of that many layers from the same field (minutes and gigabytes before it
notices). Neither says which field is wrong. :func:`check_gguf_layout` refuses such a file with
one line naming the file and the field: the layer count against the ``blk.N`` tensors the file
holds, the token embedding's and the output head's shapes against ``{arch}.embedding_length``
and the tokenizer's size, and every tensor's bytes inside the file.

It reads a layout (architecture, layer count, width, vocabulary size, every tensor's name,
shape, type and offset) that the caller's one read of the header gave: sources/gguf_meta.py's
fast reader, cached per file version, or a ``gguf.GGUFReader`` the caller already built; it
touches no tensor data.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import LogitdiffError

LLAMA_MAX_LAYERS = 512  # llama.cpp's llama-hparams.h: more layers abort its loader
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_NAMED = 4  # items an error line names before "and N more"


def named(items: list, limit: int = _NAMED) -> str:
    """``a, b, c, d and 7 more``: a few items of a list, and how many are left out."""
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _scalar(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - an unreadable value is reported as absent
        return None


def layout_of_reader(reader: Any) -> dict:
    """The layout :func:`check_gguf_layout` reads, from a ``gguf.GGUFReader`` (the fast reader
    of sources/gguf_meta.py builds the same dict from the header alone)."""
    arch = _scalar(reader, "general.architecture")
    f = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "block_count": _scalar(reader, f"{arch}.block_count") if isinstance(arch, str) else None,
        "embedding_length": _scalar(reader, f"{arch}.embedding_length") if isinstance(arch, str) else None,
        "vocab": None if f is None else len(f.data),
        "tensors": [[t.name, [int(n) for n in t.shape], int(t.tensor_type), int(t.data_offset)] for t in reader.tensors],
    }


def _n_bytes(shape: list[int], ttype: int) -> int:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise LogitdiffError(f"unknown tensor type {ttype}") from None
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


def check_gguf_layout(layout: dict, path: str | Path) -> None:
    """Raise a one-line LogitdiffError where ``path``'s tensors do not cover what its metadata
    claims (see the module's text); return None for a consistent file. ``layout``: from
    :func:`layout_of_reader` or sources.gguf_meta."""
    arch = layout.get("architecture")
    if not isinstance(arch, str) or not arch:
        raise LogitdiffError(f"{path}: GGUF has no general.architecture")
    tensors = {name: shape for name, shape, _, _ in layout["tensors"]}
    _check_blocks(layout, path, arch, tensors)
    _check_embedding(layout, path, arch, tensors)
    _check_extents(layout, path)


def _check_blocks(layout: dict, path: str | Path, arch: str, tensors: dict) -> None:
    key = f"{arch}.block_count"
    count = layout.get("block_count")
    if isinstance(count, bool) or not isinstance(count, int):
        raise LogitdiffError(f"{path}: GGUF has no integer {key}")
    if not 1 <= count <= LLAMA_MAX_LAYERS:
        raise LogitdiffError(f"{path}: {key} = {count} is outside 1..{LLAMA_MAX_LAYERS} (llama.cpp's limit)")
    held = {int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))}
    missing = sorted(set(range(count)) - held)
    extra = sorted(held - set(range(count)))
    if missing:
        raise LogitdiffError(f"{path}: {key} = {count} but the file holds no tensors of layer "
                             f"{named([f'blk.{i}' for i in missing])}")
    if extra:
        raise LogitdiffError(f"{path}: {key} = {count} but the file holds tensors of layer "
                             f"{named([f'blk.{i}' for i in extra])} beyond it")


def _check_embedding(layout: dict, path: str | Path, arch: str, tensors: dict) -> None:
    key = f"{arch}.embedding_length"
    width = layout.get("embedding_length")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise LogitdiffError(f"{path}: GGUF has no positive integer {key}")
    vocab = layout.get("vocab")
    if "token_embd.weight" not in tensors:
        raise LogitdiffError(f"{path}: GGUF has no token_embd.weight tensor")
    for name in ("token_embd.weight", "output.weight"):
        shape = tensors.get(name)
        if shape is None:  # no output.weight: the head is tied to the embedding
            continue
        shape = [int(n) for n in shape]  # ggml order: [embedding, vocabulary]
        if len(shape) != 2 or shape[0] != width:
            raise LogitdiffError(f"{path}: tensor {name} has shape {shape}, not [{key} = {width}, vocabulary]")
        if vocab is not None and shape[1] != vocab:
            raise LogitdiffError(f"{path}: tensor {name} has {shape[1]} rows but tokenizer.ggml.tokens holds {vocab} tokens")


def _check_extents(layout: dict, path: str | Path) -> None:
    size = Path(path).stat().st_size
    outside = []
    for name, shape, ttype, offset in layout["tensors"]:
        try:
            end = int(offset) + _n_bytes(shape, ttype)
        except LogitdiffError as e:
            raise LogitdiffError(f"{path}: tensor {name}: {e}") from None
        if end > size:
            outside.append(name)
    if outside:
        raise LogitdiffError(f"{path}: tensor data of {named(outside)} lies beyond the file's end ({size} bytes)")
