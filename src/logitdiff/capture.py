"""Capture: run a source over a workload (reference) or over a reference's token ids
(candidate, teacher-forced) and keep the per-position distributions in a RUN.

Every capture stores distributions from one teacher-forced prefill over
``prompt + teacher`` — the reference too, after it generated its teacher sequence
greedily — so reference, rerun and candidates are computed the same way and a
deterministic rerun of the reference is bit-identical (noise floor 0).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import metrics as M
from .errors import LogitdiffError
from .sources import Source
from .store import RunItem, RunReader, RunWriter, bf16_to_f32, first_difference, reblock
from .workload import Item

DEFAULT_MAX_TOKENS = 64


def _parse_sample(mode: str) -> tuple[float, int | None]:
    """``sample:FRAC[:SEED]`` -> (FRAC, SEED or None)."""
    parts = mode.split(":")
    try:
        frac = float(parts[1]) if len(parts) in (2, 3) else -1.0
        seed = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        frac, seed = -1.0, None
    if not 0.0 < frac <= 1.0 or (seed is not None and seed < 0):
        raise LogitdiffError(f"--positions {mode!r}: expected sample:FRAC[:SEED], FRAC in (0, 1], SEED >= 0")
    return frac, seed


SAMPLE_RULE = (
    "per item, ceil(FRAC x output length) positions without replacement, numpy default_rng seeded by the "
    "first 8 bytes (little-endian) of sha256(item id), or of sha256('SEED:' + item id) when a SEED is given"
)


def select_positions(n: int, mode: str, item_id: str) -> list[int]:
    """Output positions to score: ``all``, ``first`` or ``sample:FRAC[:SEED]`` (seeded per
    item, see ``SAMPLE_RULE``)."""
    if mode.startswith("sample:"):
        frac, seed = _parse_sample(mode)
    elif mode not in ("all", "first"):
        raise LogitdiffError(f"--positions {mode!r}: expected all, first or sample:FRAC[:SEED]")
    if n <= 0:
        return []
    if mode == "all":
        return list(range(n))
    if mode == "first":
        return [0]
    k = max(1, math.ceil(frac * n))
    key = item_id if seed is None else f"{seed}:{item_id}"
    rng_seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return sorted(np.random.default_rng(rng_seed).choice(n, size=k, replace=False).tolist())


def _sampling(mode: str) -> dict:
    """How positions were sampled, for the manifest (and from there the reports)."""
    if not mode.startswith("sample:"):
        return {}
    frac, seed = _parse_sample(mode)
    return {"positions_sampling": {"fraction": frac, "seed": seed, "rule": SAMPLE_RULE}}


def _rows_for_store(writer: RunWriter, rows) -> dict:
    """One block of a source's rows in the form the writer stores: top-K reduced here, a
    block at a time, so ``--store topk:K`` never holds more than a block of full rows."""
    if isinstance(rows, dict):  # a top-K source (served model): ids + logprobs per row
        if not writer.k:
            raise LogitdiffError("a top-K source can only be stored with --store topk:K")
        k = writer.k
        if rows["ids"].shape[1] < k:
            raise LogitdiffError(f"the source returned {rows['ids'].shape[1]} logprobs per position, fewer than K={k}")
        return {"topk": {"ids": rows["ids"][:, :k], "logprobs": rows["logprobs"][:, :k]}}
    if writer.k:
        z = bf16_to_f32(rows) if rows.dtype == np.uint16 else rows
        st = M.row_stats(z, k=writer.k)
        return {"topk": {"ids": st["topk_ids"], "logprobs": st["topk_logprobs"], "logsumexp": st["logsumexp"],
                         "tail_mass": st["tail_mass"], "entropy": st["entropy"]}}
    return {"logits": rows}


def _write_scored(source: Source, writer: RunWriter, run_items: list[RunItem], pairs: list, chunk_bytes: int | None,
                  progress: Callable[[int], None] | None) -> None:
    """Score ``pairs`` (prompt, teacher) at each item's positions and hand every block to
    the writer as it comes: memory is a block and the writer's chunk, not an output."""
    positions = [it.positions for it in run_items]
    cur = -1

    def advance_to(k: int) -> None:
        nonlocal cur
        while cur < k:
            if cur >= 0:
                writer.end_item()
                if progress:
                    progress(1)
            cur += 1
            if cur < len(run_items):
                writer.begin_item(run_items[cur])

    for b in source.score_blocks(pairs, positions, chunk_bytes=chunk_bytes):
        advance_to(b.pair)
        writer.add_rows(**_rows_for_store(writer, b.rows))
    advance_to(len(run_items))


def _source_meta(source: Source) -> dict:
    return {"spec": source.spec, "identity": source.identity()}


def _vocab(source: Source) -> list[str]:
    # Printable token strings, computed once per open source (a capture per candidate).
    cached = getattr(source, "_logitdiff_vocab", None)
    if cached is None or len(cached) != source.vocab_size:
        cached = [source.token_text(i) for i in range(source.vocab_size)]
        try:
            source._logitdiff_vocab = cached
        except AttributeError:  # pragma: no cover - a source with __slots__
            pass
    return cached


def _writer(source: Source, out, store: str, resume: bool, overwrite: bool, settings: dict, chunk_bytes: int | None = None) -> RunWriter:
    # A served (top-K) source cannot give full logits: store what it has.
    if getattr(source, "distribution", "full") == "topk" and store == "full":
        store = f"topk:{source.top_k}"
    return RunWriter(
        out,
        source=_source_meta(source),
        vocab_size=source.vocab_size,
        tokenizer_hash=source.tokenizer_hash,
        store=store,
        dtype=getattr(source, "logits_dtype", "float32"),
        settings={**settings, "distributions": "teacher-forced prefill over prompt + teacher",
                  "source_dtype": "served top-K logprobs" if getattr(source, "distribution", "full") == "topk"
                  else getattr(source, "logits_dtype", "float32")},
        resume=resume,
        overwrite=overwrite,
        vocab=None if resume else _vocab(source),
        chunk_bytes=chunk_bytes,
    )


def _items_per_call(source: Source, batch: int | None) -> int:
    """Items per generation/scoring call: the caller's ``batch``, else the source's own
    (``hf:...,batch=N`` is sequences per forward pass), else 8. Served (top-K) sources get
    8: their ``batch`` is sequences per request, and a call spreads its items over the
    source's concurrent requests."""
    if batch:
        return int(batch)
    if getattr(source, "distribution", "full") == "topk":
        return 8
    return int(getattr(source, "batch", 0) or 8)


def _batched(seq: Sequence, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def capture_reference(
    source: Source,
    items: list[Item],
    out: str | Path,
    *,
    max_tokens: int | None = None,
    store: str = "full",
    positions: str = "all",
    resume: bool = False,
    overwrite: bool = False,
    settings: dict | None = None,
    progress: Callable[[int], None] | None = None,
    batch: int | None = None,
    chunk_bytes: int | None = None,
) -> Path:
    """Greedy generation (the teacher sequence), then teacher-forced distributions.

    Items go ``batch`` at a time (default: the source's own ``batch``, see
    ``_items_per_call``) through
    generation, which keeps token ids only, and then through one streamed teacher-forced
    scoring whose blocks go straight to the writer."""
    # Render every item first: a prompt the source refuses (too long, bad template) is a
    # one-line error before any RUN file exists, not a half-written run.
    rendered = {it.id: source.render(it) for it in items}
    select_positions(1, positions, "")  # a bad --positions is an error before any file exists
    writer = _writer(
        source, out, store, resume, overwrite,
        {"role": "reference", "max_tokens": max_tokens, "positions": positions, **_sampling(positions),
         "decoding": "greedy (temperature 0)", **(settings or {})},
        chunk_bytes,
    )
    done = writer.done_ids() if resume else set()
    todo = [it for it in items if it.id not in done]
    if progress and done:
        progress(len(items) - len(todo))
    for group in _batched(todo, _items_per_call(source, batch)):
        prompts = [rendered[it.id] for it in group]
        gens = source.generate_many(prompts, [max_tokens or it.max_tokens or DEFAULT_MAX_TOKENS for it in group])
        run_items = []
        for it, prompt_ids, gen in zip(group, prompts, gens):
            if not gen.token_ids:
                raise LogitdiffError(f"item {it.id!r}: the reference generated no token")
            run_items.append(RunItem(
                id=it.id, prompt_ids=list(prompt_ids), teacher_ids=list(gen.token_ids),
                positions=select_positions(len(gen.token_ids), positions, it.id),
                tags=list(it.tags), prompt=it.prompt if it.prompt is not None else it.messages,
                extra={"item": it.to_json(), "stopped_by": gen.stopped_by, "text": source.detokenize(gen.token_ids)},
            ))
        _write_scored(source, writer, run_items, [(it.prompt_ids, it.teacher_ids) for it in run_items], chunk_bytes, progress)
    writer.finish()
    return Path(out)


def verified_prompts(source: Source, teacher: RunReader, shard=None) -> list[tuple[RunItem, list[int]]]:
    """Check vocab, tokenizer and every item's tokenization against the teacher run
    (only the items of ``shard`` when given)."""
    from .served import shard_items

    if source.vocab_size != teacher.vocab_size:
        raise LogitdiffError(
            f"{source.spec}: vocab size {source.vocab_size} differs from the reference run {teacher.path} ({teacher.vocab_size})"
        )
    if teacher.tokenizer_hash and source.tokenizer_hash and teacher.tokenizer_hash != source.tokenizer_hash:
        raise LogitdiffError(
            f"{source.spec}: tokenizer differs from the reference run {teacher.path} (field 'tokenizer_hash' "
            f"{source.tokenizer_hash[:19]}... vs {teacher.tokenizer_hash[:19]}...)"
        )
    out = []
    for it in shard_items(teacher.items(), shard):
        wl = it.extra.get("item")
        if wl is not None:
            ids = source.render(Item.from_json(wl))
            if list(ids) != list(it.prompt_ids):
                j = first_difference(ids, it.prompt_ids)
                a = it.prompt_ids[j] if j < len(it.prompt_ids) else "end"
                b = ids[j] if j < len(ids) else "end"
                raise LogitdiffError(
                    f"item {it.id!r}: tokenization differs at prompt position {j} (reference id {a}, {source.spec} id {b})"
                )
        out.append((it, list(it.prompt_ids)))
    return out


def capture_candidate(
    source: Source,
    teacher: RunReader,
    out: str | Path,
    *,
    store: str = "full",
    resume: bool = False,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    batch: int | None = None,
    shard: str | tuple[int, int] | None = None,
    settings: dict | None = None,
    chunk_bytes: int | None = None,
) -> Path:
    """Teacher-forced capture at exactly the reference's positions (of one shard: items k
    with k mod n == i, see ``logitdiff merge``)."""

    pairs = verified_prompts(source, teacher, shard=shard)
    writer = _writer(
        source, out, store, resume, overwrite,
        {"role": "candidate", "teacher": str(teacher.path), "positions": teacher.manifest["settings"].get("positions"),
         **{k: v for k, v in teacher.manifest["settings"].items() if k == "positions_sampling"}, **(settings or {})},
        chunk_bytes,
    )
    done = writer.done_ids() if resume else set()
    todo = [(it, p) for it, p in pairs if it.id not in done]
    if progress and done:
        progress(len(pairs) - len(todo))
    # ``batch`` items per scoring call (the source batches within it as its ``batch`` says);
    # each call streams its blocks to the writer.
    for group in _batched(todo, _items_per_call(source, batch)):
        run_items = [RunItem(id=it.id, prompt_ids=p, teacher_ids=list(it.teacher_ids), positions=list(it.positions),
                             tags=list(it.tags), prompt=it.prompt, extra={k: v for k, v in it.extra.items() if k == "item"})
                     for it, p in group]
        _write_scored(source, writer, run_items, [(p, it.teacher_ids) for it, p in group], chunk_bytes, progress)
    writer.finish()
    return Path(out)


class LiveRun:
    """A candidate scored on demand against a reference run, nothing stored.

    Quacks like :class:`RunReader` for :func:`logitdiff.compare.compare_runs`: its
    ``row_blocks`` streams the source's blocks, so a live compare holds a block, not an
    item, of candidate rows.
    """

    is_partial = False

    def __init__(self, source: Source, teacher: RunReader, *, batch: int | None = None, chunk_bytes: int | None = None):
        self.source = source
        # Served sources return top-K ids + logprobs per position instead of full logits.
        self.k = int(source.top_k) if getattr(source, "distribution", "full") == "topk" else 0
        self.teacher = teacher
        self.batch = _items_per_call(source, batch)
        self.chunk_bytes = chunk_bytes
        self._pairs = verified_prompts(source, teacher)
        self._prompts = {it.id: p for it, p in self._pairs}
        self.path = source.spec
        self.vocab_size = source.vocab_size
        self.tokenizer_hash = source.tokenizer_hash
        self.dtype = getattr(source, "logits_dtype", "float32")
        self.manifest = {
            "source": _source_meta(source),
            "status": "complete",
            "tokenizer_hash": source.tokenizer_hash,
            "settings": {"store": f"topk:{self.k}" if self.k else "full", "live": True, "dtype": self.dtype},
            "n_items": len(self._pairs),
            "n_positions": sum(len(it.positions) for it, _ in self._pairs),
        }

    def items(self) -> list[RunItem]:
        return [it for it, _ in self._pairs]

    def vocab(self):
        return None

    def _blocks(self, items: list[RunItem]):
        for a in range(0, len(items), self.batch):
            group = items[a : a + self.batch]
            pairs = [(self._prompts[it.id], it.teacher_ids) for it in group]
            for b in self.source.score_blocks(pairs, [it.positions for it in group], chunk_bytes=self.chunk_bytes):
                yield b.rows

    def row_blocks(self, items, rows: int, *, raw: bool = False):
        """The candidate's rows at the items' positions, as ``RunReader.row_blocks``."""
        for b in reblock(self._blocks(list(items)), rows):
            if not isinstance(b, dict) and b.dtype == np.uint16 and not raw:
                b = bf16_to_f32(b)
            yield b

    def logits(self, item: RunItem) -> np.ndarray:
        if self.k:
            raise LogitdiffError(f"{self.path}: a top-{self.k} source has no full logits")
        blocks = list(self.row_blocks([item], max(1, len(item.positions))))
        return blocks[0] if blocks else np.zeros((0, self.vocab_size), np.float32)

    def topk(self, item: RunItem) -> dict:
        if not self.k:
            raise LogitdiffError(f"{self.path}: a full-logits source, not top-K")
        blocks = list(self.row_blocks([item], max(1, len(item.positions))))
        return blocks[0] if blocks else {"ids": np.zeros((0, self.k), np.int64), "logprobs": np.zeros((0, self.k))}
