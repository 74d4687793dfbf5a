"""Stage *compare*: pairing a candidate RUN with its reference and the comparison methods
(`methods/`: exact, top-K, compact), plus the top-K error study (`topk_error`). Imports
`capture`, `store`, `numerics` and below.

Compare a candidate capture with a reference capture, position by position.

``compare_runs`` checks that the two runs speak one vocabulary (`check_same_tokens`), pairs
their items (`pair_items`: the same items with the same teacher tokens at the same
positions), picks the comparison method from what the two runs hold (compare.methods), streams
both through it in bounded blocks of rows and returns a :class:`Comparison`: per-position
columns plus the descriptions the report needs. No file is written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, cast

import numpy as np

from ..store import tokenizer_identity
from .methods import ComparisonMethod, run_dtype, select_method
from ..errors import LogitdiffError
from ..store import RunItem, RunReader, first_difference

if TYPE_CHECKING:
    from ..capture import LiveRun
    from ..contracts import ServedFloor

# K of the seed's top-K fields when both runs hold full rows (and the vocabulary is larger).
DEFAULT_TOP_LOGPROBS = 64


def served_batching(run) -> str | None:
    """How a served (``openai:``) side was batched on its server (``batching=`` of the spec:
    ``rounds`` or ``serial``); None for a side that is not served. A served RUN from before
    the option existed was captured in rounds."""
    ident = (run.manifest.get("source") or {}).get("identity") or {}
    if ident.get("kind") != "openai":
        return None
    return ident.get("batching") or "rounds"


def batching_notes(ref, cand) -> tuple[dict | None, list[str]]:
    """``method.served_batching`` (each side's mode, when one is served) and the note that
    warns when the two sides were captured in different modes."""
    a, b = served_batching(ref), served_batching(cand)
    if a is None and b is None:
        return None, []
    notes = []
    if a and b and a != b:
        notes.append(f"the two sides were captured in different served batching modes (reference {a}, candidate {b}): "
                     "in rounds a row's arithmetic depends on its batch mates, in serial it does not, so part of the "
                     "difference is the batching, not the model; capture both with the same batching=")
    return {"reference": a, "candidate": b}, notes


def positions_sampling(run) -> dict | None:
    """``--positions`` of a sampled capture: mode, fraction, seed and rule; None for all."""
    settings = run.manifest.get("settings") or {}
    mode = settings.get("positions")
    if not mode or mode == "all":
        return None
    out = {"mode": mode}
    out.update(settings.get("positions_sampling") or {})
    return out
_UNREAD = object()  # Comparison's vocabulary before its first use


@dataclass
class Comparison:
    kind: str  # method.kind: "full_vocab" | "compact" | "top_k" (contracts.MethodKind)
    columns: dict[str, np.ndarray]  # one entry per position
    items: list[RunItem]
    ref: RunReader
    cand: RunReader | LiveRun
    method: dict
    notes: list[str] = field(default_factory=list)
    served_floor: ServedFloor | None = None  # servedfloor.served_floor, set by whoever measured it (run)
    _vocab: list[str] | None | object = field(default=_UNREAD, repr=False)

    @property
    def vocab(self) -> list[str] | None:
        """The printable text of every token id (the reference's vocab.json, else the
        candidate's), read on first use: V strings of JSON that the figures never need, only a
        report's token columns do."""
        if self._vocab is _UNREAD:
            self._vocab = self.ref.vocab() or self.cand.vocab()
        return cast("list[str] | None", self._vocab)

    @property
    def n(self) -> int:
        return len(self.columns["position"])

    def token_text(self, token_id: int) -> str:
        if self.vocab is not None and 0 <= token_id < len(self.vocab):
            return self.vocab[token_id]
        return f"<{token_id}>"


SPECULATION_NOT_EXERCISED = (
    "speculation not exercised: {who} is declared speculative (speculative=1), but a teacher-forced comparison scores the "
    "whole sequence as a prefill and never runs a verify batch, so these figures say nothing about speculative decoding "
    "(they are not 'KL 0' for speculation); compare in generation mode: logitdiff speculate"
)


def speculation_notes(ref: RunReader, cand: RunReader | LiveRun) -> list[str]:
    """The label of a teacher-forced comparison whose side was captured from a source declared
    speculative (``openai:URL,speculative=1``): speculation was not exercised."""
    out = []
    for who, run in (("the candidate", cand), ("the reference", ref)):
        ident = ((run.manifest.get("source") or {}).get("identity")) or {}
        if ident.get("speculative"):
            out.append(SPECULATION_NOT_EXERCISED.format(who=who))
    return out


def _tokens(run) -> list | None:
    get = getattr(run, "tokens", None)  # RUN readers and live candidates; other readers have no token list
    return get() if get is not None else None


def check_same_tokens(ref: RunReader, cand: RunReader | LiveRun) -> list[str]:
    """The two runs speak one vocabulary (size, then the tokenizer's strings under converter
    spellings): a one-line error if not; the notes that qualify the match."""
    notes: list[str] = []
    if ref.vocab_size != cand.vocab_size:
        raise LogitdiffError(
            f"vocab sizes differ: {ref.path} has V={ref.vocab_size}, {cand.path} has V={cand.vocab_size}"
        )
    # token strings compared under converter spellings; the per-item id checks (pair_items) decide
    # the token lists (V strings of JSON a side) are read only when the hashes differ
    differ = bool(ref.tokenizer_hash and cand.tokenizer_hash and ref.tokenizer_hash != cand.tokenizer_hash)
    spelled = tokenizer_identity.check(str(ref.path), ref.tokenizer_hash, _tokens(ref) if differ else None, str(cand.path),
                                       cand.tokenizer_hash, _tokens(cand) if differ else None)
    if spelled:
        notes.append(spelled)
    if not (ref.tokenizer_hash and cand.tokenizer_hash):
        notes.append("tokenizer hash unknown on one side; identity rests on equal teacher token ids")
    return notes


def pair_items(ref: RunReader, cand: RunReader | LiveRun, *, allow_partial: bool = False) -> tuple[list[RunItem], list[RunItem], list[str]]:
    """The items of both runs, paired by id in the reference's order: a one-line error at
    the first item that differs (prompt, scored positions, teacher tokens) or is missing
    (``allow_partial``: skipped, with a note)."""
    notes: list[str] = []
    cand_by_id = {it.id: it for it in cand.items()}
    ref_ids = {it.id for it in ref.items()}
    extra = [i for i in cand_by_id if i not in ref_ids]
    if extra:
        raise LogitdiffError(f"{cand.path}: item {extra[0]!r} is not in the reference run {ref.path}")
    pairs_r, pairs_c = [], []
    for r in ref.items():
        c = cand_by_id.get(r.id)
        if c is None:
            if allow_partial:
                continue
            raise LogitdiffError(f"{cand.path}: item {r.id!r} of the reference run is missing")
        if r.prompt_ids and c.prompt_ids and r.prompt_ids != c.prompt_ids:
            j = first_difference(r.prompt_ids, c.prompt_ids)
            raise LogitdiffError(
                f"item {r.id!r}: prompt token ids differ at prompt position {j} "
                f"(reference {r.prompt_ids[j] if j < len(r.prompt_ids) else 'end'}, "
                f"candidate {c.prompt_ids[j] if j < len(c.prompt_ids) else 'end'})"
            )
        if r.positions != c.positions:
            j = first_difference(r.positions, c.positions)
            raise LogitdiffError(
                f"item {r.id!r}: scored positions differ (reference has {len(r.positions)}, candidate "
                f"{len(c.positions)}; first difference at row {j})"
            )
        rt, ct = r.next_tokens, c.next_tokens
        bad = np.nonzero(rt != ct)[0]
        if bad.size:
            j = int(bad[0])
            raise LogitdiffError(
                f"item {r.id!r}: teacher token differs at output position {r.positions[j]} "
                f"(reference {int(rt[j])}, candidate {int(ct[j])}): runs are misaligned"
            )
        pairs_r.append(r)
        pairs_c.append(c)
    if len(pairs_r) < len(ref.items()):
        notes.append(f"--allow-partial: {len(pairs_r)} of {len(ref.items())} reference items compared")
    if not pairs_r:
        raise LogitdiffError(f"{ref.path} and {cand.path} have no items in common")
    return pairs_r, pairs_c, notes


def compare_runs(
    ref: RunReader,
    cand: RunReader | LiveRun,
    *,
    top_logprobs: int = DEFAULT_TOP_LOGPROBS,
    overlap_k: int = 10,
    eps: float = 1e-12,
    allow_partial: bool = False,
    device=None,
    progress: Callable[[int], None] | None = None,
    max_batch_rows: int | None = None,
    chunk_bytes: int | None = None,
    threads: int | None = None,
    logprob_floor: float | None = None,
) -> Comparison:
    """Stream both runs through the metrics in blocks of rows that cross item boundaries
    (``max_batch_rows``, default: a chunk of float32 rows): memory is a few blocks plus the
    per-position columns, whatever the output lengths and the vocabulary. ``threads``: the
    metrics' worker threads (`metrics.full_vocab`'s ``threads``; default there).
    ``logprob_floor``: a stated lower bound (nats) on every log-probability of both
    distributions, which gives top-K comparisons a finite KL upper bound (check_floor)."""
    if decodes_to_float32(ref, cand):
        ref.decode_to_float32()
    # a hidden-state reference's first chunk decodes on the core the checks below leave idle
    ref.prefetch()
    notes = check_same_tokens(ref, cand)
    items_r, items_c, paired_notes = pair_items(ref, cand, allow_partial=allow_partial)
    notes += paired_notes
    notes += speculation_notes(ref, cand)
    V = ref.vocab_size
    method_cls = select_method(ref, cand)
    check_floor(logprob_floor, method_cls, V, ref, cand)
    method = method_cls(ref, cand, items_r, items_c, top_logprobs=top_logprobs, overlap_k=overlap_k, eps=eps, device=device,
                        threads=threads, logprob_floor=logprob_floor)
    if max_batch_rows is None:
        max_batch_rows = method.batch_rows(chunk_bytes)
    cols: dict[str, list] = {}

    def push(name, arr):
        cols.setdefault(name, []).append(np.asarray(arr))

    push("item_id", np.concatenate([np.array([it.id] * len(it.positions), dtype=object) for it in items_r]))
    push("position", np.concatenate([np.asarray(it.positions, dtype=np.int64) for it in items_r]))
    next_all = np.concatenate([it.next_tokens for it in items_r])
    push("token_id", next_all)
    a = 0
    # one loop over blocks of rows of both sides; the method says what its columns are. The
    # stream is closed on the way out, whatever happens: a live candidate's worker thread
    # (capture/ahead.py) is joined here, not when a traceback holding it is freed, so no
    # forward pass outlives the comparison or runs after its model is closed
    blocks = iter(method.blocks(max_batch_rows))
    try:
        for zr, zc in blocks:
            n = method.rows_in(zr, zc)
            for key, v in method.columns(zr, zc, next_all[a : a + n], a).items():
                push(key, v)
            del zr, zc
            a += n
            if progress:
                progress(n)
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            close()
    if a != len(next_all):
        raise LogitdiffError(f"{ref.path} vs {cand.path}: read {a} rows for {len(next_all)} scored positions (truncated run)")

    columns = {k: np.concatenate(v) for k, v in cols.items()}
    info = {
        "description": method.description(),
        "kind": method.kind,
        "bounds": method.bounds,
        "epsilon": eps,
        "top_logprobs": int(method.top_k),
        "vocab_size": int(V),
        "topk_overlap_k": None if method.overlap_k is None else int(method.overlap_k),
        "log": "natural (nats); every *_nats figure has a *_bits twin = nats / ln 2",
        "precision": "float64 after log_softmax",
        "reference_dtype": run_dtype(ref),
        "candidate_dtype": run_dtype(cand),
    }
    if logprob_floor is not None:
        info["logprob_floor_nats"] = float(logprob_floor)
    batching, bnotes = batching_notes(ref, cand)
    if batching:
        info["served_batching"] = batching
        notes.extend(bnotes)
    sampling = positions_sampling(ref)
    if sampling:
        info["positions"] = sampling
        total = sum(len(it.teacher_ids) for it in items_r)
        seed = sampling.get("seed")
        notes.append(
            f"sampled: --positions {sampling['mode']} scored {len(next_all):,} of {total:,} output positions"
            + (f" (fraction {sampling['fraction']}, seed {'default' if seed is None else seed}: {sampling['rule']})"
               if "fraction" in sampling else "")
        )
    comp = Comparison(kind=method.kind, columns=columns, items=items_r, ref=ref, cand=cand, method=info, notes=notes)
    return comp


def decodes_to_float32(ref: RunReader, cand) -> bool:
    """Whether ``ref`` (a reference whose kind decodes its rows: the hidden store) should
    decode them to float32: when the exact comparison would convert them anyway, i.e. when
    the candidate's stored rows are another dtype than the reference's (`exact.kernel_pair`
    compares float32 copies then). Same values, so the same report; the conversion, one
    thread's pass over every block, becomes part of the decode's threads."""
    from .methods.exact import Exact

    if not getattr(ref.kind, "decodes", False) or not isinstance(cand, RunReader):
        return False
    try:
        method = select_method(ref, cand)
    except LogitdiffError:
        return False  # compare_runs says why, after its checks
    return issubclass(method, Exact) and (cand.dtype or "float32") != (ref.dtype or "float32")


def check_floor(floor: float | None, method: type[ComparisonMethod], V: int, ref, cand) -> None:
    """A stated log-probability floor must be a statement that can be true, about a
    comparison that uses it: finite, at most -ln V (V entries of probability >= e^floor
    sum to at most 1), and only for a method that takes it (top-K: full and compact
    comparisons have their intervals without it)."""
    if floor is None:
        return
    check_floor_value(floor, V)
    if not method.takes_floor:
        raise LogitdiffError(f"--logprob-floor applies to top-K comparisons; {ref.path} and {cand.path} are compared "
                             f"by method {method.kind!r}, whose intervals need no floor")


def check_floor_value(floor: float | None, V: int | None = None) -> None:
    """The part of check_floor that needs no runs (for checks before any work); with the
    vocabulary size ``V``, also at most -ln V."""
    if floor is None:
        return
    if not math.isfinite(floor) or floor >= 0:
        raise LogitdiffError(f"--logprob-floor {floor}: must be a finite negative number of nats")
    if V is not None and floor > -math.log(V):
        raise LogitdiffError(f"--logprob-floor {floor}: above -ln V = {-math.log(V):.4f} for V = {V:,}; "
                             "no distribution over V tokens has every log-probability above it")
