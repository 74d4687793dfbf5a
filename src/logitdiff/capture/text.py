"""A reference RUN of a plain text in llama-perplexity's chunks (``capture SPEC --workload
text:FILE --ctx N``): no generation, the text is the teacher sequence (the chunk rule:
:mod:`logitdiff.workload.text`). Candidates are scored on it like on any reference RUN
(``capture --reference``, or live in ``compare``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import LogitdiffError
from ..sources import Source
from ..store import RunItem
from ..store import validate
from ..store.files import Kind, writing
from ..store.kinds import StoreKind
from ..workload.text import CHUNK_RULE, DEFAULT_CTX, perplexity_chunks, read_text
from . import SCORE_BATCH, _close_quietly, _layout, _store_for, _write_scored, _writer

TAG = "text-chunk"


def text_items(source: Source, path: Path, ctx: int, chunks: int | None) -> tuple[list[RunItem], dict]:
    """The chunks of the text at ``path`` as the source tokenizes it, and the settings that
    say how they were cut (what a resume or a reused reference must match)."""
    text, sha = read_text(path)
    ids, bos = source.document_ids(text)
    validate.check_ids(ids, source.vocab_size, f"{source.spec}: text {path}", what="text")
    parts = perplexity_chunks(ids, ctx, bos, max_chunks=chunks, where=f"{path} ({source.spec})")
    items = [RunItem(id=c.id, prompt_ids=c.prompt_ids, teacher_ids=c.teacher_ids,
                     positions=list(range(len(c.teacher_ids))), tags=[TAG],
                     extra={"text_chunk": k})
             for k, c in enumerate(parts)]
    settings = {"text": {"file": str(path), "sha256": sha, "n_ctx": ctx, "chunks": len(parts), "tokens": len(ids),
                         "first_scored": ctx // 2, "bos_id": bos, "chunk_rule": CHUNK_RULE}}
    return items, settings


def capture_text(
    source: Source,
    path: str | Path,
    out: str | Path,
    *,
    ctx: int = DEFAULT_CTX,
    chunks: int | None = None,
    store: str | StoreKind = "full",
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    batch: int = SCORE_BATCH,
    chunk_bytes: int | None = None,
) -> Path:
    """Score the text at ``path`` in llama-perplexity's chunks and keep every scored row in a
    RUN at ``out`` (guarded and locked as any capture; the text is one of its inputs)."""
    path = Path(path)
    kind = _store_for(source, store)
    items, text_settings = text_items(source, path, ctx, chunks)
    if not items:  # perplexity_chunks refuses a text under two chunks; a guard for callers
        raise LogitdiffError(f"{path}: no chunk to score")
    settings = {"role": "reference", "positions": "all", "decoding": "none (the text is the teacher sequence)",
                **text_settings, **_layout(source, batch)}
    with writing(out, Kind.RUN, inputs=[path], overwrite=overwrite, in_place_when_new=True) as tmp:
        writer = _writer(source, tmp, kind, False, settings, chunk_bytes)
        try:
            for start in range(0, len(items), batch):
                group = items[start : start + batch]
                _write_scored(source, writer, group, [(it.prompt_ids, it.teacher_ids) for it in group], chunk_bytes, progress)
            writer.finish()
        except BaseException:
            _close_quietly(writer)
            raise
    return Path(out)
