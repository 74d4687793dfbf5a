"""Compare a candidate capture with a reference capture, position by position.

``compare_runs`` checks that the two runs are comparable (vocabulary, tokenizer, the same
items with the same teacher tokens at the same positions), streams both through the
metrics in bounded batches of rows and returns a :class:`Comparison`: per-position
columns plus the descriptions the report needs. No file is written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import metrics as M
from . import tokenizer_identity
from .bounds import METHOD_COMPACT, METHOD_EXACT, METHOD_LLAMACPP, METHOD_TOPK
from .contracts import MethodKind
from .errors import LogitdiffError
from .store import RunItem, RunReader, aligned_blocks, bf16_to_f32, first_difference, rows_per_block

# K of the seed's top-K fields when both runs hold full rows (and the vocabulary is larger).
DEFAULT_TOP_LOGPROBS = 64

TOPK_DESCRIPTION = (
    "Approximate KL(P_{ref} || P_{cand}) over next-token top-K distributions. Missing candidate "
    "top-K tokens receive candidate tail_mass/(vocab_size - K). A single explicit tail bucket is included."
)
COMPACT_DESCRIPTION = (
    "KL(P_ref || P_cand), reverse KL and Jensen-Shannon divergence between a compact reference "
    "(exact top entries, a quantised band, exact mass of the rest) and a full candidate: each "
    "figure comes with a proven interval [*_lower_nats, *_upper_nats] that contains the exact "
    "full-vocabulary value (docs/bounds.md); the figure itself is the divergence at the placement "
    "of the unstored mass closest to the candidate (the interval's lower end). Top-1, margin, teacher-token p and entropy of "
    "the reference are exact."
)
TOPK_BOUNDS = (
    " Each divergence also carries a proven interval [*_lower_nats, *_upper_nats] "
    "(docs/bounds.md): the lower bound by data processing over the shared tokens; the upper "
    "bound of forward and reverse KL is inf: nothing bounds a probability outside the top-K lists "
    "from below (no logit floor is known)."
)
TOPK_BOUNDS_FLOOR = (
    " Each divergence also carries a proven interval [*_lower_nats, *_upper_nats] "
    "(docs/bounds.md): the lower bound by data processing over the shared tokens; the upper "
    "bound of forward and reverse KL from the stated log-probability floor (--logprob-floor "
    "{floor:g} nats on every entry of both distributions, method.logprob_floor_nats): it holds "
    "only as far as that statement does."
)
LLAMACPP_BOUNDS = (
    " The reference is an imported llama.cpp --kl-divergence-base file: its log-probabilities are "
    "uint16-quantised with a floor at max - 16 nats, so each divergence also carries a proven interval "
    "[*_lower_nats, *_upper_nats] from the quantisation step and the floor (docs/bounds.md, section 4); "
    "reverse KL has no finite upper bound (floored entries may have p -> 0)."
)
# what compare does for what the two runs hold (docs/bounds.md, section 5)
METHOD_OF_KIND = {MethodKind.FULL_VOCAB: METHOD_EXACT, MethodKind.COMPACT: METHOD_COMPACT, MethodKind.TOP_K: METHOD_TOPK}


def run_dtype(run) -> str:
    """What a run's distributions are, in words: the logits dtype (stored, or of the source
    for a top-K store), with the GGUF file type when there is one; served top-K logprobs
    say so; "unknown" when the run does not tell (imports)."""
    settings = run.manifest.get("settings") or {}
    ident = (run.manifest.get("source") or {}).get("identity") or {}
    d = settings.get("dtype") or settings.get("source_dtype") or ident.get("logits_dtype") or ident.get("dtype")
    if not d:
        return "unknown"
    return f"{d} logits of GGUF {ident['file_type']}" if ident.get("file_type") else str(d)


def topk_description(ref, cand) -> str:
    """The seed's method text, naming what the two sides really are (not always bf16 vs a quant)."""
    return TOPK_DESCRIPTION.format(ref=run_dtype(ref), cand=run_dtype(cand))


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
FULL_DESCRIPTION = (
    "Exact KL(P_ref || P_cand), reverse KL and Jensen-Shannon divergence over the full vocabulary, "
    "in float64 after log_softmax of the captured logits, per teacher-forced output position. "
    "The seed's top-K fields (top masses, shared tokens) are computed from the full logits at "
    "K = top_logprobs, and kl_topk_nats is the top-K approximation of the same position."
)


@dataclass
class Comparison:
    kind: str  # "full_vocab" | "top_k"
    columns: dict[str, np.ndarray]  # one entry per position
    items: list[RunItem]
    ref: RunReader
    cand: RunReader
    method: dict
    vocab: list[str] | None = None
    notes: list[str] = field(default_factory=list)
    served_floor: dict | None = None  # servedfloor.served_floor, set by whoever measured it (run)

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


def speculation_notes(ref: RunReader, cand: RunReader) -> list[str]:
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


def check_comparable(ref: RunReader, cand: RunReader, *, allow_partial: bool = False) -> tuple[list[RunItem], list[RunItem], list[str]]:
    """Pair items of both runs; raise a one-line error at the first mismatch."""
    notes: list[str] = []
    if ref.vocab_size != cand.vocab_size:
        raise LogitdiffError(
            f"vocab sizes differ: {ref.path} has V={ref.vocab_size}, {cand.path} has V={cand.vocab_size}"
        )
    # token strings compared under converter spellings; the per-item id checks below decide
    spelled = tokenizer_identity.check(str(ref.path), ref.tokenizer_hash, _tokens(ref), str(cand.path),
                                       cand.tokenizer_hash, _tokens(cand))
    if spelled:
        notes.append(spelled)
    if not (ref.tokenizer_hash and cand.tokenizer_hash):
        notes.append("tokenizer hash unknown on one side; identity rests on equal teacher token ids")
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


def _topk_blocks(run, items, rows: int, k: int, threads: int | None = None):
    """(ids [r, k], logprobs [r, k]) blocks of one side: stored top-K sliced to k, or the
    exact top-k of full rows, reduced a block at a time. The run's declared ``k`` (its
    store, or a live source's top-K) says which its blocks are."""
    for b in run.row_blocks(items, rows):
        if run.k:
            yield b["ids"][:, :k], b["logprobs"][:, :k]
        else:
            st = M.row_stats(b, k=k, threads=threads)
            yield st["topk_ids"], st["topk_logprobs"]


def _float32_rows(z: np.ndarray) -> np.ndarray:
    """A raw row block (bf16 bits as uint16, or a float array) as float32 values."""
    return bf16_to_f32(z) if z.dtype == np.uint16 else np.asarray(z, np.float32)


def _raw_row_pairs(ref, items_r, cand, items_c, rows: int):
    """(reference rows, candidate rows) blocks of at most ``rows`` rows in the stored dtypes:
    views of both RUNs' chunks (`store.aligned_blocks`, no concatenation), or a live
    candidate's blocks re-cut next to the reference's."""
    if isinstance(ref, RunReader) and isinstance(cand, RunReader):
        return aligned_blocks(ref.row_pieces(items_r), cand.row_pieces(items_c), rows)
    return zip(ref.row_blocks(items_r, rows, raw=True), cand.row_blocks(items_c, rows, raw=True))


def _kernel_pair(zr: np.ndarray, zc: np.ndarray):
    """Two raw row blocks as `metrics.full_vocab` reads them in place: bf16 bits as bfloat16
    views (no float32 copy) when both sides hold the same dtype; float32 copies of the
    block when the dtypes differ (the compiled kernel reads one dtype for both sides)."""
    if zr.dtype == zc.dtype:
        return (M.bfloat16_view(z) if z.dtype == np.uint16 else z for z in (zr, zc))
    return _float32_rows(zr), _float32_rows(zc)


def _owner(items: list[RunItem], row: int) -> tuple[RunItem, int]:
    """The item holding global row ``row`` of a row stream over ``items``, and its index."""
    for it in items:
        if row < len(it.positions):
            return it, row
        row -= len(it.positions)
    raise IndexError(row)


def compare_runs(
    ref: RunReader,
    cand: RunReader,
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
    items_r, items_c, notes = check_comparable(ref, cand, allow_partial=allow_partial)
    notes += speculation_notes(ref, cand)
    vocab = ref.vocab() or cand.vocab()
    V = ref.vocab_size
    kind = select_kind(ref, cand)
    check_floor(logprob_floor, kind, V, ref, cand)
    # an imported llama.cpp base file is a full run whose values are quantised: bound it
    bounded_import = kind == "full_vocab" and (ref.manifest.get("settings") or {}).get("imported_from") == "llamacpp-kld"
    # K of the top-K fields: what the top-K side(s) stored; for two full runs, top_logprobs.
    stored_k = [x for x in (ref.k, cand.k) if x]
    k_eff = min(stored_k + [V]) if stored_k else min(top_logprobs, V)
    if kind == "compact":  # the reference's top-K comes from its exact entries
        k_eff = min(top_logprobs, ref.compact.exact, V)
        overlap_k = min(overlap_k, ref.compact.exact)
    if max_batch_rows is None:
        # two top-K stores: a block of K ids + logprobs per row (any K up to V in bounded
        # memory); full rows on either side: a block of V float32 values per row
        topk_only = kind == "top_k" and ref.k and cand.k
        max_batch_rows = rows_per_block(k_eff, chunk_bytes, 16) if topk_only else rows_per_block(V, chunk_bytes)
    cols: dict[str, list] = {}

    def push(name, arr):
        cols.setdefault(name, []).append(np.asarray(arr))

    push("item_id", np.concatenate([np.array([it.id] * len(it.positions), dtype=object) for it in items_r]))
    push("position", np.concatenate([np.asarray(it.positions, dtype=np.int64) for it in items_r]))
    next_all = np.concatenate([it.next_tokens for it in items_r])
    push("token_id", next_all)
    a = 0
    if kind == "compact":
        # a compact reference against a full candidate, both streamed in the same row blocks
        for blk, zc in zip(ref.row_blocks(items_r, max_batch_rows), cand.row_blocks(items_c, max_batch_rows)):
            b = a + len(zc)
            _compact_rows(push, cand, items_c, a, blk, zc, next_all[a:b], k_eff, min(overlap_k, V), eps, threads)
            if progress:
                progress(b - a)
            a = b
    elif kind == "full_vocab":
        # stored dtype as is (bf16 bits stay uint16): the kernel reads them in place
        for zr, zc in _raw_row_pairs(ref, items_r, cand, items_c, max_batch_rows):
            b = a + len(zr)
            try:
                m = M.full_vocab(*_kernel_pair(zr, zc), next_all[a:b], k=min(overlap_k, V), top_k_out=k_eff, device=device,
                                 threads=threads)
            except M.NonFiniteLogits as e:
                owner, row = _owner(items_r, a + e.row)
                run = ref if e.side == "reference" else cand
                raise LogitdiffError(
                    f"{run.path}: item {owner.id!r} has NaN/inf logits at output position {owner.positions[row]}"
                ) from None
            ir, lr = m.pop("topk_ids_ref"), m.pop("topk_logprobs_ref")
            ic, lc = m.pop("topk_ids_cand"), m.pop("topk_logprobs_cand")
            for key, v in m.items():
                push(key, v)
            if bounded_import:  # llama.cpp base rows: intervals from the uint16 step and floor
                _push_llamacpp_intervals(push, _float32_rows(zr), _float32_rows(zc))
            # the seed's top-K fields from the same pass (no second log-softmax per side)
            t = M.topk(ir, lr, ic, lc, V, eps=eps)
            for key in ("baseline_top_mass", "candidate_top_mass", "shared_tokens", "shared_baseline_mass", "shared_candidate_mass"):
                push(key, t[key])
            push("kl_topk_nats", t["kl_nats"])
            _push_tops(push, ir, lr, ic, lc)
            del zr, zc
            a = b
            if progress:
                progress(len(ir))
    else:
        for (ir, lr), (ic, lc) in zip(_topk_blocks(ref, items_r, max_batch_rows, k_eff, threads), _topk_blocks(cand, items_c, max_batch_rows, k_eff, threads)):
            b = a + len(ir)
            next_tok = next_all[a:b]
            try:
                t = M.topk(ir, lr, ic, lc, V, eps=eps)
            except ValueError as e:
                raise LogitdiffError(f"{ref.path} vs {cand.path}: {e}") from None
            if logprob_floor is not None:
                _check_above_floor(logprob_floor, ((ref, items_r, ir, lr), (cand, items_c, ic, lc)), a)
            for key, v in t.items():
                if key != "kl_bits":
                    push(key, v)
            # proven intervals next to the seed's estimate (docs/bounds.md, section 3)
            from . import bounds as Bd
            from .compact import INTERVAL_COLUMNS

            ivs = Bd.topk_vs_topk(ir, lr, ic, lc, V, floor_logp_ref=logprob_floor, floor_logp_cand=logprob_floor)
            for name, (lo, hi) in INTERVAL_COLUMNS.items():
                iv = ivs[name[: -len("_nats")]]
                push(lo, iv.lower)
                push(hi, iv.upper)
            # Token metrics where the teacher token is inside a top-K set; NaN otherwise.
            p_ref = _prob_of(ir, lr, next_tok)
            p_cand = _prob_of(ic, lc, next_tok)
            push("p_ref_token", p_ref)
            push("p_cand_token", p_cand)
            push("delta_p", p_cand - p_ref)
            push("nll_ref", -np.log(p_ref))
            push("nll_cand", -np.log(p_cand))
            top2 = np.sort(np.exp(lr), axis=1)[:, ::-1]
            push("margin_ref", top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0.0))
            _push_tops(push, ir, lr, ic, lc)
            a = b
            if progress:
                progress(len(ir))
    if a != len(next_all):
        raise LogitdiffError(f"{ref.path} vs {cand.path}: read {a} rows for {len(next_all)} scored positions (truncated run)")

    columns = {k: np.concatenate(v) for k, v in cols.items()}
    method = {
        "description": (FULL_DESCRIPTION if kind == "full_vocab" else COMPACT_DESCRIPTION if kind == "compact"
                        else topk_description(ref, cand)
                        + (TOPK_BOUNDS if logprob_floor is None else TOPK_BOUNDS_FLOOR.format(floor=logprob_floor))),
        "kind": kind,
        "bounds": METHOD_LLAMACPP if bounded_import else METHOD_OF_KIND[kind],
        "epsilon": eps,
        "top_logprobs": int(k_eff),
        "vocab_size": int(V),
        "topk_overlap_k": int(min(overlap_k, V)) if kind in ("full_vocab", "compact") else None,
        "log": "natural (nats); every *_nats figure has a *_bits twin = nats / ln 2",
        "precision": "float64 after log_softmax",
        "reference_dtype": run_dtype(ref),
        "candidate_dtype": run_dtype(cand),
    }
    if bounded_import:
        method["description"] += LLAMACPP_BOUNDS
    if logprob_floor is not None:
        method["logprob_floor_nats"] = float(logprob_floor)
    batching, bnotes = batching_notes(ref, cand)
    if batching:
        method["served_batching"] = batching
        notes.extend(bnotes)
    sampling = positions_sampling(ref)
    if sampling:
        method["positions"] = sampling
        total = sum(len(it.teacher_ids) for it in items_r)
        seed = sampling.get("seed")
        notes.append(
            f"sampled: --positions {sampling['mode']} scored {len(next_all):,} of {total:,} output positions"
            + (f" (fraction {sampling['fraction']}, seed {'default' if seed is None else seed}: {sampling['rule']})"
               if "fraction" in sampling else "")
        )
    comp = Comparison(kind=kind, columns=columns, items=items_r, ref=ref, cand=cand, method=method, vocab=vocab, notes=notes)
    return comp


def check_floor(floor: float | None, kind: str, V: int, ref, cand) -> None:
    """A stated log-probability floor must be a statement that can be true, about a
    comparison that uses it: finite, at most -ln V (V entries of probability >= e^floor
    sum to at most 1), and only for top-K comparisons (full and compact ones have their
    intervals without it)."""
    if floor is None:
        return
    check_floor_value(floor, V)
    if kind != MethodKind.TOP_K:
        raise LogitdiffError(f"--logprob-floor applies to top-K comparisons; {ref.path} and {cand.path} are compared "
                             f"by method {kind!r}, whose intervals need no floor")


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


def _check_above_floor(floor: float, sides, row0: int) -> None:
    """Every listed log-probability of both sides is at or above the stated floor (one
    below it proves the statement false, and with it the upper bounds)."""
    for run, items, ids, logp in sides:
        below = (np.asarray(ids) >= 0) & (np.asarray(logp) < floor)
        if below.any():
            r, j = (int(x[0]) for x in np.nonzero(below))
            owner, row = _owner(items, row0 + r)
            raise LogitdiffError(f"{run.path}: item {owner.id!r} position {owner.positions[row]}: log-probability "
                                 f"{float(logp[r, j]):.4f} of token {int(ids[r, j])} is below --logprob-floor {floor}")


def select_kind(ref, cand) -> str:
    """The comparison method for what the two runs hold: full/full exact, compact/full
    bounded, top-K on either side approximate + bound; anything else refused."""
    if getattr(cand, "compact", None):
        raise LogitdiffError(f"{cand.path}: a compact store is a reference store; capture the candidate with --store full")
    if getattr(ref, "compact", None):
        if cand.k:
            raise LogitdiffError(f"{ref.path} is a compact reference and {cand.path} stores top-{cand.k}: "
                                 "no bounded method for that pair; capture the candidate with --store full")
        return "compact"
    return "top_k" if (ref.k or cand.k) else "full_vocab"


# float64 bytes per sub-batch of a compact comparison: small enough that its ~15 [n, V]
# temporaries come from the heap's free lists rather than a fresh mmap each (SmolLM2,
# V = 49,152: 1.5 s of system time per compare at 8 MiB, 0.04 s at 2 MiB, same user
# time; bench/RESULTS.md); at least one row
COMPACT_SUB_BYTES = 2 << 20


def _compact_rows(push, cand, items_c, row0, blk, zc, next_tok, k_eff, overlap_k, eps, threads=None) -> None:
    """One block of a compact reference against the candidate's rows, in sub-batches of
    ``COMPACT_SUB_BYTES`` of float64 rows, ``threads`` of them at a time (numpy releases
    the GIL in its array work; default: the metrics' `default_threads`, as the full-vocabulary
    kernel uses). ``row0``: the block's first global row, for errors."""
    from concurrent.futures import ThreadPoolExecutor

    from . import compact as C

    zc = np.asarray(zc)
    if zc.size and not (np.isfinite(zc.max()) and np.isfinite(zc.min())):
        owner, row = _owner(items_c, row0 + int(np.nonzero(~np.isfinite(zc).all(1))[0][0]))
        raise LogitdiffError(f"{cand.path}: item {owner.id!r} has NaN/inf logits at output position {owner.positions[row]}")
    step = max(1, COMPACT_SUB_BYTES // (zc.shape[1] * 8))

    def one(a):
        sl = slice(a, a + step)
        return C.compare_rows(C.rows_of(blk, sl), zc[sl], next_tok[sl], top_k=k_eff, overlap_k=overlap_k, eps=eps)

    starts = range(0, zc.shape[0], step)
    workers = max(1, min(len(starts), threads or M.default_threads()))
    with ThreadPoolExecutor(workers) as pool:
        for cols in pool.map(one, starts):  # in order
            ir, lr, ic, lc = cols.pop("_tops")
            for key, v in cols.items():
                push(key, v)
            _push_tops(push, ir, lr, ic, lc)



def _push_llamacpp_intervals(push, zr, zc) -> None:
    from . import bounds as Bd
    from .compact import INTERVAL_COLUMNS, _log_softmax

    zr = np.asarray(zr, np.float32)
    step = max(1, (32 << 20) // (zr.shape[1] * 8))
    for a in range(0, zr.shape[0], step):
        codes, scale, mn = Bd.llamacpp_from_logp(zr[a:a + step])
        ivs = Bd.llamacpp_vs_full(codes, scale, mn, _log_softmax(np.asarray(zc[a:a + step])))
        for name, (lo, hi) in INTERVAL_COLUMNS.items():
            iv = ivs[name[: -len("_nats")]]
            push(lo, iv.lower)
            push(hi, iv.upper)


TOP_SHOWN = 5  # top tokens kept per side for the token view of reports


def _push_tops(push, ids_r, lp_r, ids_c, lp_c) -> None:
    """Each side's winner probability and its top-5 (ids, probabilities), descending.

    Flips are read from these: the reference's winner and how sure it was, the
    candidate's winner and how sure *it* was."""
    push("p_top1_ref", np.exp(np.asarray(lp_r[:, 0], dtype=np.float64)))
    push("p_top1_cand", np.exp(np.asarray(lp_c[:, 0], dtype=np.float64)))
    push("top5_ref_ids", np.asarray(ids_r[:, :TOP_SHOWN], dtype=np.int64))
    push("top5_ref_p", np.exp(np.asarray(lp_r[:, :TOP_SHOWN], dtype=np.float64)))
    push("top5_cand_ids", np.asarray(ids_c[:, :TOP_SHOWN], dtype=np.int64))
    push("top5_cand_p", np.exp(np.asarray(lp_c[:, :TOP_SHOWN], dtype=np.float64)))


def _prob_of(ids: np.ndarray, logprobs: np.ndarray, tok: np.ndarray) -> np.ndarray:
    hit = ids == tok[:, None]
    p = np.where(hit, np.exp(logprobs), 0.0).sum(1)
    return np.where(hit.any(1), p, np.nan)
