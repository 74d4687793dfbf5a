"""Stage *capture*: a source and a workload make a RUN — the reference's greedy outputs and
every candidate's teacher-forced rows (this module), and RUNs captured in shards (`shards`).
Imports `sources`, `workload`, `store` and below.

Capture: run a source over a workload (reference) or over a reference's token ids
(candidate, teacher-forced) and keep the per-position distributions in a RUN.

Every capture stores distributions from one teacher-forced prefill over
``prompt + teacher`` — the reference too, after it generated its teacher sequence
greedily — so reference, rerun and candidates are computed the same way and a
deterministic rerun of the reference is bit-identical (noise floor 0).

Batch layout: a batched backend's numbers depend on which sequences share a forward pass
(padding width and matrix shapes change the float rounding; on the bundled model in bf16 a
changed grouping moves logits by up to 0.125). So items are scored in fixed blocks of
``batch`` consecutive items of the workload order (:func:`batch_blocks`), never "the next
``batch`` items still to do": a resumed capture rescores the whole block it stopped in and
keeps only the missing items, ``--shard`` hands out whole blocks, and each stored item lists
the ids it was scored with (``extra["scored_with"]``); the manifest's settings record
``batch`` and ``batch_layout``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import AbstractSet, Any, Callable, Sequence, cast

import numpy as np

from ..store import validate
from ..store.files import DOCUMENT_MAX_BYTES, read_input_bytes
from ..store import tokenizer_identity
from ..errors import LogitdiffError, renamed_parameters
from ..store.files import Kind, writing
from ..sources import RowKind, Source, TopKRows, is_full, is_topk
from ..sources.prompt_form import in_source_prompt_form, needs_prompt_form
from ..sources.tool_form import in_source_tool_form, needs_tool_form
from ..store import FORWARD_CHUNKS, RunItem, RunReader, RunWriter, bf16_to_f32, first_difference, reblock
from ..store.kinds import AUTO, StoreKind, auto_kind, given_rows_kind, store_kind
from ..workload import Item
from .ahead import ahead
from ..numerics.metrics import default_threads

from ..defaults import DEFAULT_MAX_TOKENS, SCORE_BATCH  # noqa: F401 (SCORE_BATCH: items per score_many call)
BATCH_LAYOUT = "blocks of `batch` consecutive items in workload order"


def batch_blocks(n: int, batch: int, offset: int = 0) -> list[range]:
    """The batch layout: index ranges of the items scored together, blocks of ``batch``
    consecutive items; with ``offset`` the first block is ``[0, offset)`` and every
    boundary moves by ``offset`` (another composition of the same batch size)."""
    if batch < 1:
        raise LogitdiffError(f"batch {batch}: must be at least 1")
    edges = sorted({0, n, *range(offset % batch or batch, n, batch)})
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def layout_text(settings: dict) -> str:
    """The batch layout a run's settings record, in words (for noise-floor notes)."""
    if settings.get("batch") is None:
        return "batch layout not recorded"
    off = settings.get("batch_offset")
    return f"scored in blocks of {settings['batch']} items" + (f", boundaries moved by {off}" if off else "")


def _layout(source: Source, batch: int) -> dict:
    """Manifest settings that say which items were scored together."""
    d = {"batch": batch, "batch_layout": BATCH_LAYOUT}
    if source.batch is not None:  # the backend's own sequences per forward pass
        d["source_batch"] = source.batch
    return d


def parse_positions(mode: str) -> tuple[str, float]:
    """``all``, ``first`` or ``sample:FRAC`` with 0 < FRAC <= 1 -> (kind, frac); else a one-line error."""
    if mode in ("all", "first"):
        return mode, 1.0
    if isinstance(mode, str) and mode.startswith("sample:"):
        return "sample", _parse_sample(mode)[0]  # also refuses nan and inf
    raise LogitdiffError(f"--positions {mode!r}: expected all, first or sample:FRAC[:SEED]")


def check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise LogitdiffError(f"--max-tokens {max_tokens}: must be at least 1")


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
    kind, frac = parse_positions(mode)
    seed = _parse_sample(mode)[1] if kind == "sample" else None
    if n <= 0:
        return []
    if kind == "all":
        return list(range(n))
    if kind == "first":
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


def _write_scored(source: Source, writer: RunWriter, run_items: list[RunItem], pairs: list, chunk_bytes: int | None,
                  progress: Callable[[int], None] | None, skip: AbstractSet[str] = frozenset()) -> None:
    """Score ``pairs`` (prompt, teacher) at each item's positions and hand every block to
    the writer as it comes: memory is a block and the writer's chunk, not an output.
    Items in ``skip`` (already on disk) are scored with their batch mates, not written."""
    positions = [it.positions for it in run_items]
    cur = -1

    def advance_to(k: int) -> None:
        nonlocal cur
        while cur < k:
            if cur >= 0 and run_items[cur].id not in skip:
                writer.end_item()
                if progress:
                    progress(1)
            cur += 1
            if cur < len(run_items) and run_items[cur].id not in skip:
                writer.begin_item(run_items[cur])

    kw = {"with_hidden": True} if writer.kind.needs_hidden_states else {}
    for b in source.score_blocks(pairs, positions, chunk_bytes=chunk_bytes, **kw):
        advance_to(b.pair)
        if run_items[b.pair].id in skip:
            continue
        # the store kind encodes the block (top-K, compact...) as it comes: never more than a block of full rows
        if source.row_kind is RowKind.TOPK:
            top = cast(TopKRows, b.rows)  # Block.rows has the type of the source's row kind
            writer.add_topk(top.ids, top.logprobs)
        else:
            writer.add_rows(b.rows, hidden=b.hidden)
    advance_to(len(run_items))


def _source_meta(source: Source) -> dict:
    return {"spec": source.spec, "identity": source.identity()}


def _store_for(source: Source, store: str | StoreKind) -> StoreKind:
    """The store kind a capture uses, bound to the source's vocabulary and rows dtype: a kind
    the caller parsed (kinds.store_kind), or a ``--store`` text parsed here, once (``auto``:
    the kind kinds.auto_kind picks). A top-K (served) source cannot give full rows, so the
    kind that keeps full rows as given keeps its top-K lists as given instead."""
    if not isinstance(store, StoreKind):
        store = store_kind(auto_kind(source) if store == AUTO else store)
    if is_topk(source) and isinstance(store, type(given_rows_kind(0))):
        return given_rows_kind(int(source.top_k), source.vocab_size, _rows_dtype(source))
    return store.bound(source.vocab_size, _rows_dtype(source))


def _writer(source: Source, out, kind: StoreKind, resume: bool, settings: dict, chunk_bytes: int | None = None) -> RunWriter:
    head = None
    if kind.needs_hidden_states:
        head = source.output_head()
        if head is None:
            raise LogitdiffError(f"{source.spec}: a hidden-state store (capture --store {kind.text}, run --reference-store "
                                 f"{kind.text}) needs a transformers model whose bf16 or float16 logits are its output head's "
                                 "output (no bias, scaling or soft-capping); use another --store")
    return RunWriter(
        out,
        source=_source_meta(source),
        vocab_size=source.vocab_size,
        tokenizer_hash=source.tokenizer_hash,
        store=kind,
        dtype=_rows_dtype(source),
        settings={**settings, "distributions": "teacher-forced prefill over prompt + teacher",
                  "source_dtype": "served top-K logprobs" if source.row_kind is RowKind.TOPK else _rows_dtype(source)},
        resume=resume,
        vocab=None if resume else source.token_texts(),
        chunk_bytes=chunk_bytes,
        head=head,
        tokens=None if resume else source.tokenizer_tokens,
    )


def _rows_dtype(source: Source) -> str:
    """The dtype a RUN records for the source's rows: a full-logit source's ``logits_dtype``;
    float32 for a top-K source (its logprobs are stored as float32)."""
    return source.logits_dtype if is_full(source) else "float32"


def _close_quietly(writer: RunWriter) -> None:
    """Stop the writer thread after a failure (its error, if any, is not the one to report)."""
    try:
        writer.close()
    except Exception:
        pass


def capture_reference(
    source: Source,
    items: list[Item],
    out: str | Path,
    *,
    max_tokens: int | None = None,
    store: str | StoreKind = "full",
    positions: str = "all",
    resume: bool = False,
    overwrite: bool = False,
    settings: dict | None = None,
    progress: Callable[[int], None] | None = None,
    batch: int = SCORE_BATCH,
    inputs: Sequence[str | Path] = (),
    chunk_bytes: int | None = None,
) -> Path:
    """Greedy generation (the teacher sequence, token ids only), then one streamed
    teacher-forced scoring per block of :func:`batch_blocks` whose row blocks go straight
    to the writer (a resumed block is generated and scored whole, written only where
    missing: the same batch mates as a clean capture).

    ``out`` is guarded and locked (:mod:`logitdiff.store.files`); ``inputs`` are paths the
    capture reads (the workload), which ``out`` must not be, hold or sit inside."""
    check_resume_flags(resume, overwrite)
    check_max_tokens(max_tokens)
    parse_positions(positions)
    kind = _store_for(source, store)
    items = in_source_prompt_form(source, items)[0]  # HumanEval as this source takes it (sources.prompt_form)
    items = in_source_tool_form(source, items)[0]  # benchmark items as this template takes tools (sources.tool_form)
    # Render every item first: a prompt the source refuses (too long, bad template) is a
    # one-line error before any RUN file exists, not a half-written run.
    rendered = dict(zip((it.id for it in items), source.render_many(items)))
    settings = {"role": "reference", "max_tokens": max_tokens, "positions": positions, **_sampling(positions),
                "decoding": "greedy (temperature 0)", **(settings or {}), **_layout(source, batch)}
    with writing(out, Kind.RUN, inputs=inputs, overwrite=overwrite, resume=resume, in_place_when_new=True) as path:
        writer = _writer(source, path, kind, resume, settings, chunk_bytes)
        try:
            _reference_rows(writer, source, items, rendered, max_tokens=max_tokens, positions=positions, resume=resume,
                            progress=progress, batch=batch, chunk_bytes=chunk_bytes)
        except BaseException:
            _close_quietly(writer)
            raise
    return Path(out)


def check_resume_flags(resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise LogitdiffError("--resume and --overwrite exclude each other: continue the run, or replace it")


def _reference_rows(writer: RunWriter, source: Source, items, rendered, *, max_tokens, positions, resume, progress, batch,
                    chunk_bytes) -> None:
    done = _done_ids(writer, resume, batch)
    stored = _stored_items(writer.path, items, done, batch)
    if progress and done:
        progress(len(done & {it.id for it in items}))
    for block in batch_blocks(len(items), batch):
        group = [items[k] for k in block]
        if all(it.id in done for it in group):
            continue
        prompts = [rendered[it.id] for it in group]
        gens = source.generate_many(prompts, [max_tokens or it.max_tokens or DEFAULT_MAX_TOKENS for it in group])
        with_ids = [it.id for it in group]
        run_items = []
        for it, prompt_ids, gen in zip(group, prompts, gens):
            if it.id in done:  # scored again with its block, not written again
                run_items.append(stored[it.id])
                continue
            if not gen.token_ids:
                raise LogitdiffError(f"item {it.id!r}: the reference generated no token")
            validate.check_ids(list(gen.token_ids), source.vocab_size, f"{source.spec}: item {it.id!r}", what="generated")
            validate.check_ids(list(prompt_ids), source.vocab_size, f"{source.spec}: item {it.id!r}", what="prompt")
            run_items.append(RunItem(
                id=it.id, prompt_ids=list(prompt_ids), teacher_ids=list(gen.token_ids),
                positions=select_positions(len(gen.token_ids), positions, it.id),
                tags=list(it.tags), prompt=it.prompt if it.prompt is not None else it.messages,
                extra={"item": it.to_json(), "stopped_by": gen.stopped_by, "text": source.detokenize(gen.token_ids),
                       "scored_with": with_ids},
            ))
        _write_scored(source, writer, run_items, [(it.prompt_ids, it.teacher_ids) for it in run_items], chunk_bytes,
                      progress, skip=done)
    writer.finish()


def _done_ids(writer: RunWriter, resume: bool, batch: int) -> set[str]:
    """Items already on disk; a resume must keep the batch layout it started with."""
    if not resume:
        return set()
    had = writer.manifest["settings"].get("batch")
    if had is not None and had != batch:
        raise LogitdiffError(f"{writer.path}: cannot resume, setting 'batch' is {had} here but {batch} now")
    return writer.done_ids()


def _stored_items(out, items: Sequence, done: set[str], batch: int) -> dict[str, RunItem]:
    """Stored items of a resumed run that share a block with an item still to do."""
    ids = [it.id for it in items]
    want = {ids[k] for block in batch_blocks(len(ids), batch) if not all(ids[k] in done for k in block)
            for k in block if ids[k] in done}
    if not want:
        return {}
    return {it.id: it for it in RunReader(out, allow_partial=True).items() if it.id in want}


@renamed_parameters(teacher="reference")
def verified_prompts(source: Source, reference: RunReader, shard=None, block: int = 1) -> list[tuple[RunItem, list[int]]]:
    """Check vocab, tokenizer and every item's tokenization against the reference run
    (only the items of ``shard`` when given, in blocks of ``block`` items)."""
    from .shards import shard_items

    if source.vocab_size != reference.vocab_size:
        raise LogitdiffError(
            f"{source.spec}: vocab size {source.vocab_size} differs from the reference run {reference.path} ({reference.vocab_size})"
        )
    # token strings compared under converter spellings; the item-by-item id check below decides.
    # The reference's token list is read only when the hashes differ (the check needs it only
    # then): at V = 248,320 parsing its tokens.json cost every capture ~0.04 CPU s.
    differ = bool(source.tokenizer_hash and reference.tokenizer_hash and source.tokenizer_hash != reference.tokenizer_hash)
    tokenizer_identity.check(source.spec, source.tokenizer_hash, source.tokenizer_tokens,
                             f"the reference run {reference.path}", reference.tokenizer_hash, reference.tokens() if differ else None)
    out = []
    mine = shard_items(reference.items(), shard, block=block)
    for it in mine:
        validate.check_ids(list(it.teacher_ids), source.vocab_size, f"reference run {reference.path}: item {it.id!r}", what="teacher")
    wl_items = [Item.from_json(it.extra["item"]) for it in mine if it.extra.get("item") is not None]
    rendered = iter(source.render_many(wl_items))  # in order (a served source overlaps the requests)
    for it in mine:
        wl = it.extra.get("item")
        if wl is not None:
            check_same_prompt(it.id, it.prompt_ids, next(rendered), source.spec)
        out.append((it, list(it.prompt_ids)))
    return out


def check_same_prompt(item_id: str, reference_ids: Sequence[int], ids: Sequence[int], spec: str,
                      reference: str = "reference") -> None:
    """Raise, naming the item, the first differing position and both sources (``reference``:
    how the reference is named), unless ``spec`` rendered the item's prompt to the
    reference's ids."""
    if list(ids) != list(reference_ids):
        j = first_difference(ids, reference_ids)
        a = reference_ids[j] if j < len(reference_ids) else "end"
        b = ids[j] if j < len(ids) else "end"
        raise LogitdiffError(f"item {item_id!r}: tokenization differs at prompt position {j} ({reference} id {a}, {spec} id {b})")


def items_in_prompt_form(reference: str, items: Sequence[Item]) -> tuple[list[Item], str | None]:
    """HumanEval items in the form the reference takes (sources.prompt_form: the raw completion
    prompt where it renders no chat messages), and the PromptForm chosen (None where no item
    needed one). The reference is opened tokenizer-only, and only then."""
    from ..sources.registry import open_tokenizer

    if not needs_prompt_form(items):
        return list(items), None
    with open_tokenizer(reference) as src:
        return in_source_prompt_form(src, items)


def items_in_tool_form(reference: str, items: Sequence[Item]) -> tuple[list[Item], str | None]:
    """Benchmark items in the form the reference's chat template takes (sources.tool_form:
    BFCL's plain prompt where the template has no tool support), and the ToolForm chosen
    (None where no item needed one). The reference is opened tokenizer-only, and only then."""
    from ..sources.registry import open_tokenizer

    if not needs_tool_form(items):
        return list(items), None
    with open_tokenizer(reference) as src:
        return in_source_tool_form(src, items)


def preflight_tokenization(reference: str, candidates: Sequence[str], items: Sequence[Item]) -> None:
    """Before any capture: every item's prompt rendered by the reference and by each candidate
    spec gives the same ids (the check :func:`verified_prompts` makes against a captured
    reference, seconds instead of after it), and the token lists where both sources know theirs
    (:func:`~logitdiff.store.tokenizer_identity.check`, as the capture checks them). Sources
    are opened tokenizer-only where their kind allows
    (:func:`~logitdiff.sources.registry.open_tokenizer`: no weights), one at a time. Errors
    name the item (or token id) and both specs.

    A candidate whose ``render_identity`` is that of a source already rendered here (the
    reference, or a candidate that passed) is not rendered again: its renderer reads the same
    bytes, so every item gives the ids already compared (a GGUF's tokenizer is loaded lazily,
    so such a candidate costs its cached metadata read, not a llama.cpp load)."""
    from ..sources.registry import open_tokenizer

    if not candidates:
        return
    with open_tokenizer(reference) as src:
        want = [list(ids) for ids in src.render_many(items)]
        proven = {src.render_identity} - {None}
        ref_tokens = (getattr(src, "tokenizer_hash", None), src.tokenizer_tokens)
    for spec in dict.fromkeys(candidates):
        if spec == reference:
            continue
        with open_tokenizer(spec) as src:
            tokenizer_identity.check(reference, ref_tokens[0], ref_tokens[1],
                                     spec, getattr(src, "tokenizer_hash", None), src.tokenizer_tokens)
            if src.render_identity in proven:
                continue
            for it, ref_ids, ids in zip(items, want, src.render_many(items)):
                check_same_prompt(it.id, ref_ids, ids, spec, reference=f"reference {reference}")
            proven |= {src.render_identity} - {None}


@renamed_parameters(teacher="reference")
def capture_candidate(
    source: Source,
    reference: RunReader,
    out: str | Path,
    *,
    store: str | StoreKind = "full",
    resume: bool = False,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    batch: int = SCORE_BATCH,
    shard: str | tuple[int, int] | None = None,
    settings: dict | None = None,
    chunk_bytes: int | None = None,
) -> Path:
    """Teacher-forced capture at exactly the reference's positions, scored in the blocks of
    :func:`batch_blocks` (of one shard: blocks k of ``batch`` items with k mod n == i, see
    ``logitdiff merge``; a resumed block is rescored whole). ``out`` is guarded and locked;
    it must not be, hold or sit inside the reference run."""
    check_resume_flags(resume, overwrite)
    kind = _store_for(source, store)
    pairs = verified_prompts(source, reference, shard=shard, block=batch)
    # "teacher": the RUN format's name for the reference RUN (manifest settings; --resume compares them)
    settings = {"role": "candidate", "teacher": str(reference.path), "teacher_manifest_sha256": _manifest_sha256(reference),
                "positions": reference.manifest["settings"].get("positions"),
                **{k: v for k, v in reference.manifest["settings"].items() if k == "positions_sampling"},
                **(settings or {}), **_layout(source, batch)}
    with writing(out, Kind.RUN, inputs=[reference.path], overwrite=overwrite, resume=resume, in_place_when_new=True) as path:
        writer = _writer(source, path, kind, resume, settings, chunk_bytes)
        try:
            _candidate_rows(writer, source, pairs, resume=resume, progress=progress, batch=batch, chunk_bytes=chunk_bytes)
        except BaseException:
            _close_quietly(writer)
            raise
    return Path(out)


def _manifest_sha256(run: RunReader) -> str:
    """Which teacher a candidate was scored on (a recapture at the same path differs)."""
    raw = read_input_bytes(Path(run.path) / "manifest.json", max_bytes=DOCUMENT_MAX_BYTES, inside=run.path)
    return hashlib.sha256(raw).hexdigest()


def _candidate_rows(writer: RunWriter, source: Source, pairs, *, resume, progress, batch, chunk_bytes) -> None:
    done = _done_ids(writer, resume, batch)
    if progress and done:
        progress(sum(it.id in done for it, _ in pairs))
    for block in batch_blocks(len(pairs), batch):
        group = [pairs[k] for k in block]
        if all(it.id in done for it, _ in group):
            continue
        with_ids = [it.id for it, _ in group]
        run_items = [RunItem(id=it.id, prompt_ids=p, teacher_ids=list(it.teacher_ids), positions=list(it.positions),
                             tags=list(it.tags), prompt=it.prompt,
                             extra={**{k: v for k, v in it.extra.items() if k == "item"}, "scored_with": with_ids})
                     for it, p in group]
        # done items are scored too (same batch mates as a clean capture), not written again
        _write_scored(source, writer, run_items, [(p, it.teacher_ids) for it, p in group], chunk_bytes, progress, skip=done)
    writer.finish()


class LiveRun:
    """A candidate scored on demand against a reference run, nothing stored.

    Quacks like :class:`RunReader` for :func:`logitdiff.compare.compare_runs`: its
    ``row_blocks`` streams the source's blocks, so a live compare holds a block, not an
    item, of candidate rows. Items are scored in the blocks of :func:`batch_blocks`
    (``offset`` shifts every boundary: the noise floor's rerun with other batch mates).
    """

    is_partial = False

    @renamed_parameters(teacher="reference")
    def __init__(self, source: Source, reference: RunReader, *, batch: int = SCORE_BATCH, offset: int = 0,
                 chunk_bytes: int | None = None):
        self.source = source
        # Served sources return top-K ids + logprobs per position instead of full logits.
        self.k = int(source.top_k) if is_topk(source) else 0
        # what a stored capture of the source would be: the comparison method is chosen from it
        self.kind = given_rows_kind(self.k, source.vocab_size, _rows_dtype(source))
        self.reference = reference
        self.batch = batch
        self.offset = offset
        # blocks made ahead on a worker (`_made_ahead`) only where the source leaves a CPU for
        # the caller's metrics: beside a forward pass that takes every core, the two would
        # contend (llama.cpp's threads wait for each other at every op), so then the metrics
        # run between forward passes on all the cores, as llama-perplexity does
        self.overlap = source.forward_on_worker and not is_topk(source) and source.forward_threads() < default_threads()
        self.chunk_bytes = chunk_bytes
        self._pairs = verified_prompts(source, reference)
        self._layout_blocks = batch_blocks(len(self._pairs), batch, offset)
        self.path = source.spec
        self.vocab_size = source.vocab_size
        self.tokenizer_hash = source.tokenizer_hash
        self.dtype = _rows_dtype(source)
        self.manifest: dict[str, Any] = {  # what a RunReader's manifest.json holds
            "source": _source_meta(source),
            "status": "complete",
            "tokenizer_hash": source.tokenizer_hash,
            "settings": {"store": self.kind.text, "live": True, "dtype": self.dtype,
                         **_layout(source, batch), **({"batch_offset": offset} if offset else {})},
            "n_items": len(self._pairs),
            "n_positions": sum(len(it.positions) for it, _ in self._pairs),
        }

    def items(self) -> list[RunItem]:
        return [it for it, _ in self._pairs]

    def vocab(self):
        return None

    def tokens(self):
        return self.source.tokenizer_tokens

    def _blocks(self, items: list[RunItem]):
        """Rows of ``items`` (a subsequence of the teacher's items, in order), scored in the
        layout's blocks with all their batch mates; rows of other items are dropped. Top-K
        rows come as a RUN's top-K store reads them back (``{"ids", "logprobs"}``)."""
        wanted = {it.id for it in items}
        for block in self._layout_blocks:
            group = self._pairs[block.start : block.stop]
            if not any(it.id in wanted for it, _ in group):
                continue
            pairs = [(p, it.teacher_ids) for it, p in group]
            for b in self.source.score_blocks(pairs, [it.positions for it, _ in group], chunk_bytes=self.chunk_bytes):
                if group[b.pair][0].id in wanted:
                    # a top-K source's rows are TopKRows (Block.rows has the type of the row kind)
                    yield cast(TopKRows, b.rows).as_dict() if self.k else b.rows

    def _made_ahead(self, items: list[RunItem]):
        """``_blocks``, a full-row source's next block made while the caller computes on
        this one (`ahead`: a decode beside the metrics), up to one forward pass's blocks
        waiting (FORWARD_CHUNKS: the source is not held up while the caller works through
        them); only where ``overlap`` (a CPU left for the metrics). A top-K (served) source's
        blocks are not: its requests are already concurrent on the server's side."""
        if not self.overlap:
            return self._blocks(items)
        return ahead(self._blocks(items), depth=FORWARD_CHUNKS + 1, name=f"logitdiff-live:{self.path}")

    def row_pieces(self, items):
        """The candidate's full rows at the items' positions, as the source made them
        (stored dtype: bf16 bits as uint16), in pieces of at most a source block, each a
        fresh array; pair them with a RUN's ``row_pieces`` through `aligned_blocks` (no
        concatenation)."""
        if self.k:
            raise LogitdiffError(f"{self.path}: a top-{self.k} source has no full rows")
        return self._made_ahead(list(items))

    def row_blocks(self, items, rows: int, *, raw: bool = False):
        """The candidate's rows at the items' positions, as ``RunReader.row_blocks``."""
        for b in reblock(self._made_ahead(list(items)), rows):
            if not self.k and b.dtype == np.uint16 and not raw:
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
