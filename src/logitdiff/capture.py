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
from .store import RunItem, RunReader, RunWriter, first_difference
from .workload import Item

DEFAULT_MAX_TOKENS = 64


def select_positions(n: int, mode: str, item_id: str) -> list[int]:
    """Output positions to score: ``all``, ``first`` or ``sample:FRAC`` (seeded per item)."""
    if n <= 0:
        return []
    if mode == "all":
        return list(range(n))
    if mode == "first":
        return [0]
    if mode.startswith("sample:"):
        try:
            frac = float(mode.split(":", 1)[1])
        except ValueError:
            frac = -1.0
        if not 0.0 < frac <= 1.0:
            raise LogitdiffError(f"--positions {mode!r}: FRAC must be in (0, 1]")
        k = max(1, math.ceil(frac * n))
        seed = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "little")
        return sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())
    raise LogitdiffError(f"--positions {mode!r}: expected all, first or sample:FRAC")


def _select(scored, positions):
    """Rows of a score result at the given positions: full logits or a top-K dict."""
    if isinstance(scored, dict):
        return {k: np.asarray(v)[positions] for k, v in scored.items()}
    scored = np.asarray(scored)
    if len(positions) == len(scored) and (not len(positions) or (positions[0] == 0 and positions[-1] == len(scored) - 1)):
        return scored  # every position, in order: no copy
    return scored[positions]


def _rows_for_store(writer: RunWriter, logits, next_tokens=None) -> dict:
    if isinstance(logits, dict):  # a top-K source (served model): ids + logprobs per row
        if writer.compact:
            raise LogitdiffError("a top-K source cannot fill a compact store (it needs full logits)")
        if not writer.k:
            raise LogitdiffError("a top-K source can only be stored with --store topk:K")
        k = writer.k
        if logits["ids"].shape[1] < k:
            raise LogitdiffError(f"the source returned {logits['ids'].shape[1]} logprobs per position, fewer than K={k}")
        return {"topk": {"ids": logits["ids"][:, :k], "logprobs": logits["logprobs"][:, :k]}}
    if writer.compact:
        from . import compact

        return {"compact": compact.encode(logits, next_tokens, writer.compact)}
    if writer.k:
        st = M.row_stats(logits, k=writer.k)
        return {"topk": {"ids": st["topk_ids"], "logprobs": st["topk_logprobs"], "logsumexp": st["logsumexp"],
                         "tail_mass": st["tail_mass"], "entropy": st["entropy"]}}
    return {"logits": logits}


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


def _writer(source: Source, out, store: str, resume: bool, overwrite: bool, settings: dict) -> RunWriter:
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
        settings={**settings, "distributions": "teacher-forced prefill over prompt + teacher"},
        resume=resume,
        overwrite=overwrite,
        vocab=None if resume else _vocab(source),
    )


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
    batch: int = 8,
) -> Path:
    """Greedy generation (the teacher sequence), then teacher-forced distributions."""
    # Render every item first: a prompt the source refuses (too long, bad template) is a
    # one-line error before any RUN file exists, not a half-written run.
    rendered = {it.id: source.render(it) for it in items}
    writer = _writer(
        source, out, store, resume, overwrite,
        {"role": "reference", "max_tokens": max_tokens, "positions": positions, "decoding": "greedy (temperature 0)", **(settings or {})},
    )
    done = writer.done_ids() if resume else set()
    todo = [it for it in items if it.id not in done]
    if progress and done:
        progress(len(items) - len(todo))
    for group in _batched(todo, batch):
        gens = []
        for it in group:
            prompt_ids = rendered[it.id]
            mt = max_tokens or it.max_tokens or DEFAULT_MAX_TOKENS
            gen = source.generate(prompt_ids, mt)
            if not gen.token_ids:
                raise LogitdiffError(f"item {it.id!r}: the reference generated no token")
            gens.append((it, prompt_ids, gen))
        scored = source.score_many([(p, g.token_ids) for _, p, g in gens])
        for (it, prompt_ids, gen), logits in zip(gens, scored):
            pos = select_positions(len(gen.token_ids), positions, it.id)
            run_item = RunItem(
                id=it.id, prompt_ids=list(prompt_ids), teacher_ids=list(gen.token_ids), positions=pos,
                tags=list(it.tags), prompt=it.prompt if it.prompt is not None else it.messages,
                extra={"item": it.to_json(), "stopped_by": gen.stopped_by, "text": source.detokenize(gen.token_ids)},
            )
            writer.add(run_item, **_rows_for_store(writer, _select(logits, pos), run_item.next_tokens))
            if progress:
                progress(1)
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
    batch: int = 8,
    shard: str | tuple[int, int] | None = None,
    settings: dict | None = None,
) -> Path:
    """Teacher-forced capture at exactly the reference's positions (of one shard: items k
    with k mod n == i, see ``logitdiff merge``)."""

    pairs = verified_prompts(source, teacher, shard=shard)
    writer = _writer(
        source, out, store, resume, overwrite,
        {"role": "candidate", "teacher": str(teacher.path), "positions": teacher.manifest["settings"].get("positions"), **(settings or {})},
    )
    done = writer.done_ids() if resume else set()
    todo = [(it, p) for it, p in pairs if it.id not in done]
    if progress and done:
        progress(len(pairs) - len(todo))
    for group in _batched(todo, batch):
        scored = source.score_many([(p, it.teacher_ids) for it, p in group])
        for (it, p), logits in zip(group, scored):
            ci = RunItem(id=it.id, prompt_ids=p, teacher_ids=list(it.teacher_ids), positions=list(it.positions),
                         tags=list(it.tags), prompt=it.prompt, extra={k: v for k, v in it.extra.items() if k == "item"})
            writer.add(ci, **_rows_for_store(writer, _select(logits, it.positions), ci.next_tokens))
            if progress:
                progress(1)
    writer.finish()
    return Path(out)


class LiveRun:
    """A candidate scored on demand against a reference run, nothing stored.

    Quacks like :class:`RunReader` for :func:`logitdiff.compare.compare_runs`.
    """

    is_partial = False

    def __init__(self, source: Source, teacher: RunReader, *, batch: int = 8):
        self.source = source
        # Served sources return top-K ids + logprobs per position instead of full logits.
        self.k = int(source.top_k) if getattr(source, "distribution", "full") == "topk" else 0
        self.teacher = teacher
        self.batch = batch
        self._pairs = verified_prompts(source, teacher)
        self._order = {it.id: i for i, (it, _) in enumerate(self._pairs)}
        self._cache: dict[str, np.ndarray] = {}
        self.path = source.spec
        self.vocab_size = source.vocab_size
        self.tokenizer_hash = source.tokenizer_hash
        self.manifest = {
            "source": _source_meta(source),
            "status": "complete",
            "tokenizer_hash": source.tokenizer_hash,
            "settings": {"store": f"topk:{self.k}" if self.k else "full", "live": True, "dtype": getattr(source, "logits_dtype", "float32")},
            "n_items": len(self._pairs),
            "n_positions": sum(len(it.positions) for it, _ in self._pairs),
        }

    def items(self) -> list[RunItem]:
        return [it for it, _ in self._pairs]

    def vocab(self):
        return None

    def _rows(self, item: RunItem):
        if item.id not in self._cache:
            i = self._order[item.id]
            group = self._pairs[i : i + self.batch]
            scored = self.source.score_many([(p, it.teacher_ids) for it, p in group])
            self._cache = {it.id: _select(lg, it.positions) for (it, _), lg in zip(group, scored)}
        return self._cache.pop(item.id)

    def logits(self, item: RunItem) -> np.ndarray:
        if self.k:
            raise LogitdiffError(f"{self.path}: a top-{self.k} source has no full logits")
        return self._rows(item)

    def topk(self, item: RunItem) -> dict:
        if not self.k:
            raise LogitdiffError(f"{self.path}: a full-logits source, not top-K")
        return self._rows(item)
