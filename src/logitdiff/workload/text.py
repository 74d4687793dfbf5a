"""A plain text scored in chunks, as ``llama-perplexity`` scores it (``--workload text:FILE``).

No generation: the text itself is the teacher sequence. The chunk rule is llama.cpp's
``perplexity()`` in ``tools/perplexity/perplexity.cpp`` (the pass that writes a
``--kl-divergence-base`` file; ``--kl-divergence`` reads the same tokens back from it):

1. the whole text is tokenized once the way ``common_tokenize(ctx, text, add_special=true,
   parse_special=false)`` does: a BOS token first when the model adds one, special-token
   text read as plain text;
2. it needs at least ``2 * n_ctx`` tokens; ``n_chunk = len(tokens) // n_ctx`` (at most
   ``--chunks``), chunk c is ``tokens[c*n_ctx : (c+1)*n_ctx]`` and the tail is dropped;
3. each chunk is evaluated alone (KV cache cleared) with its token 0 replaced by BOS when
   the model adds BOS;
4. only its second half is scored: with ``first = n_ctx // 2``, the logits at positions
   ``first .. n_ctx-2`` predicting tokens ``first+1 .. n_ctx-1``: ``n_ctx - 1 - first``
   positions per chunk.

A chunk becomes one item: prompt ``chunk[0 .. first]`` (token 0 as evaluated), teacher
``chunk[first+1 ..]``, every output position kept; output position t is then the row after
``chunk[0 .. first+t]`` that predicts ``chunk[first+1+t]`` — the same rows and the same
layout as an imported ``--kl-divergence-base`` file (``store/importers.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LogitdiffError
from ..store.files import DOCUMENT_MAX_BYTES, read_input_bytes

PREFIX = "text:"
DEFAULT_CTX = 512  # llama-perplexity's own default (-c 512)
CHUNK_RULE = ("llama-perplexity's: the text tokenized once (BOS first when the model adds one, special tokens as "
              "plain text), n_chunk = tokens // n_ctx consecutive chunks of n_ctx tokens (the tail dropped), token 0 "
              "of each chunk evaluated as BOS when the model adds one, the second half scored: the rows at positions "
              "n_ctx/2 .. n_ctx-2 predicting tokens n_ctx/2+1 .. n_ctx-1")


@dataclass(frozen=True)
class TextChunk:
    id: str
    prompt_ids: list[int]  # chunk[0 .. first], token 0 as evaluated (BOS when the model adds one)
    teacher_ids: list[int]  # chunk[first+1 ..]: the scored tokens


def text_path(workload: str | Path) -> Path | None:
    """The file of ``text:FILE``, or None when ``workload`` names no text."""
    s = str(workload)
    return Path(s[len(PREFIX):]) if s.startswith(PREFIX) else None


def read_text(path: Path) -> tuple[str, str]:
    """The text of ``path`` (UTF-8) and the sha256 of its bytes."""
    if not path.exists():
        raise LogitdiffError(f"{path}: text file not found")
    if not path.is_file():
        raise LogitdiffError(f"{path}: not a regular file (text:FILE takes a plain text file)")
    data = read_input_bytes(path, max_bytes=DOCUMENT_MAX_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogitdiffError(f"{path}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    return text, hashlib.sha256(data).hexdigest()


def perplexity_chunks(ids: list[int], n_ctx: int, bos_id: int | None, *, max_chunks: int | None = None,
                      where: str = "text") -> list[TextChunk]:
    """The chunks of ``ids`` (the whole text tokenized, BOS first when the model adds one) by
    llama-perplexity's rule (module docstring); ``bos_id`` None: the model adds no BOS."""
    if n_ctx < 4:
        raise LogitdiffError(f"--ctx {n_ctx}: must be at least 4 (half of each chunk is context, the rest scored)")
    if max_chunks is not None and max_chunks < 1:
        raise LogitdiffError(f"--chunks {max_chunks}: must be at least 1")
    if len(ids) < 2 * n_ctx:
        raise LogitdiffError(f"{where}: tokenizes to {len(ids)} tokens; a context of {n_ctx} needs at least "
                             f"{2 * n_ctx} (llama-perplexity's rule: two chunks)")
    n_chunk = len(ids) // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, max_chunks)
    first = n_ctx // 2
    out = []
    for c in range(n_chunk):
        chunk = [int(t) for t in ids[c * n_ctx : (c + 1) * n_ctx]]
        if bos_id is not None:
            chunk[0] = int(bos_id)
        out.append(TextChunk(id=f"chunk-{c:05d}", prompt_ids=chunk[: first + 1], teacher_ids=chunk[first + 1 :]))
    return out
