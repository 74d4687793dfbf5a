"""A GGUF's tensors checked against its own metadata before llama.cpp or transformers reads it.

llama.cpp trusts the header: a ``{arch}.block_count`` of 0 or above its ``LLAMA_MAX_LAYERS``
(512) aborts the process (SIGABRT, no message) while it loads the weights, and transformers
builds a model of that many layers from the same field (minutes and gigabytes before it
notices). Neither says which field is wrong. :func:`check_gguf_layout` refuses such a file with
one line naming the file and the field: the layer count against the ``blk.N`` tensors the file
holds, the token embedding's and the output head's shapes against ``{arch}.embedding_length``
and the tokenizer's size, and every tensor's bytes inside the file.

It reads what a ``gguf.GGUFReader`` already parsed (the caller's one read of the header: a
262,144-token vocabulary takes seconds to parse, and is not parsed twice); it touches no tensor
data.
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


def _array_len(reader: Any, key: str) -> int | None:
    """The element count of an array field, without decoding its elements."""
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def check_gguf_layout(reader: Any, path: str | Path) -> None:
    """Raise a one-line LogitdiffError where ``path``'s tensors do not cover what its metadata
    claims (see the module's text); return None for a consistent file."""
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise LogitdiffError(f"{path}: GGUF has no general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    _check_blocks(reader, path, arch, tensors)
    _check_embedding(reader, path, arch, tensors)
    _check_extents(reader, path)


def _check_blocks(reader: Any, path: str | Path, arch: str, tensors: dict) -> None:
    key = f"{arch}.block_count"
    count = _scalar(reader, key)
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


def _check_embedding(reader: Any, path: str | Path, arch: str, tensors: dict) -> None:
    key = f"{arch}.embedding_length"
    width = _scalar(reader, key)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise LogitdiffError(f"{path}: GGUF has no positive integer {key}")
    vocab = _array_len(reader, "tokenizer.ggml.tokens")
    if "token_embd.weight" not in tensors:
        raise LogitdiffError(f"{path}: GGUF has no token_embd.weight tensor")
    for name in ("token_embd.weight", "output.weight"):
        t = tensors.get(name)
        if t is None:  # no output.weight: the head is tied to the embedding
            continue
        shape = [int(n) for n in t.shape]  # ggml order: [embedding, vocabulary]
        if len(shape) != 2 or shape[0] != width:
            raise LogitdiffError(f"{path}: tensor {name} has shape {shape}, not [{key} = {width}, vocabulary]")
        if vocab is not None and shape[1] != vocab:
            raise LogitdiffError(f"{path}: tensor {name} has {shape[1]} rows but tokenizer.ggml.tokens holds {vocab} tokens")


def _check_extents(reader: Any, path: str | Path) -> None:
    size = Path(path).stat().st_size
    outside = [t.name for t in reader.tensors if int(t.data_offset) + int(t.n_bytes) > size]
    if outside:
        raise LogitdiffError(f"{path}: tensor data of {named(outside)} lies beyond the file's end ({size} bytes)")
