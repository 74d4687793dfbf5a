"""Stage *speculation*: speculative decoding's drift — a served target with and without a
draft, compared (this module). Imports `sources` and `numerics` and below.

Speculation on vs off, in generation mode: what speculative decoding changes in a served
model's greedy output, read against the noise floors that exist without a drafter.

Why a mode of its own: the prompt and the first generated token come from the ordinary
prefill, and teacher-forced scoring sends the whole sequence as a prompt; neither ever runs
a verify batch, so a teacher-forced or first-token comparison of a speculative candidate
measures nothing about speculation ("speculation not exercised", never "KL 0"). Here both
servers generate greedily from the same prompt token ids, fixed length, one request at a
time, prompt cache off (:mod:`logitdiff.sources.served.generate` has the protocol), and then:

* **Preconditions**: the reference must not draft; a candidate declared speculative
  (``speculative=1``, or a server whose /slots says it can speculate) whose answers show
  no drafting over the run (``draft_n == 0`` everywhere) is refused: speculation never ran.
  Tokens whose logprob is exactly 0.0 with a short or empty top list are *probability not
  reported*, never p = 1.
* **Floors**: F0, each side against a rerun of itself (tokens and logprobs); F1, the shape
  floor without a drafter: the reference's greedy tokens re-scored teacher-forced in prefill
  batches of ``shape_width`` tokens (the verify-batch width) against its own decode
  logprobs. ``near_tie_nats`` = 2 x the largest |Δlogprob| F1 saw on shared top-K entries,
  a bound on how far a batch-shape change moved any gap between two listed tokens.
* **Until the first divergence**: per item the first differing token, the identical-output
  flag, the shared-prefix fraction, both sides' margins there (nats: ln p(own token) -
  ln p(other side's token)) and the class: *near-tie* (both margins within
  ``near_tie_nats``) or *material*; the survival curve (share of items still identical at
  position t) next to the floors' own curves.
* **Same context everywhere**: on the aligned prefix, per-position top-K KL (the seed's
  estimate and its proven interval, :func:`logitdiff.numerics.bounds.topk_vs_topk`), top-1 and
  Δlogprob between the candidate's logprobs where it reported them and the reference's
  decode logprobs; after the divergence each side's tokens are teacher-forced through the
  other server (one-token steps, the decode shape), so every position still has a
  same-context comparison (token-only where the candidate reported nothing).
* **Verdict** in words: "speculation numerically lossless", "changes output by batch-shape
  numerics only", "defect", "speculation not exercised" (a candidate that never drafted),
  "floor not measured" (a floor compared nothing) or "floor too small to judge" (prefix
  positions whose proven KL lower bound is above F1's largest KL, but no more of them than a
  floor of that size leaves by chance: :func:`chance_above_max`). A reference position
  without a probability is a measurement gap (said in the reasons), not a defect.
"""

from __future__ import annotations

import pickle
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import LogitdiffError
from ..sources.served.generate import LlamaServer, Trace

LOSSLESS = "speculation numerically lossless"
SHAPE_ONLY = "changes output by batch-shape numerics only"
DEFECT = "defect"
NOT_EXERCISED = "speculation not exercised"
FLOOR_NOT_MEASURED = "floor not measured"
FLOOR_TOO_SMALL = "floor too small to judge"
VERDICTS = (LOSSLESS, SHAPE_ONLY, DEFECT, NOT_EXERCISED, FLOOR_NOT_MEASURED, FLOOR_TOO_SMALL)
# a prefix-KL defect needs its exceedances of F1's maximum to be this improbable from
# positions that behave like F1's own (chance_above_max)
PREFIX_KL_ALPHA = 1e-3
NEAR_TIE, MATERIAL = "near-tie", "material"
# a position a server sent no probability for, where the request asked for one (not a defect)
MEASUREMENT_GAP = "measurement gap, not a speculation defect"
UNCLASSIFIED = "not evaluated"  # a divergence's class when there is no near-tie threshold (F1 compared nothing)

from ..defaults import DEFAULT_FLOOR_ITEMS, DEFAULT_N_PREDICT, DEFAULT_SHAPE_WIDTH, DEFAULT_TOP_K  # noqa: E402,F401


# ----------------------------------------------------------------------------------------
# pure numerics: arrays in, arrays out


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First index where two equally long token sequences differ; None when identical."""
    ne = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(ne[0]) if ne.size else None


def survival(first_div: Sequence[int | None], n: int) -> np.ndarray:
    """Share of items still identical at each position t = 0..n-1 (an item with first
    divergence d is identical at t < d)."""
    if not first_div:
        return np.ones(n)
    d = np.array([n if x is None else x for x in first_div], np.int64)
    return (d[None, :] > np.arange(n)[:, None]).mean(1)


def logprob_of(top_ids: np.ndarray, top_lps: np.ndarray, token: int) -> tuple[float, bool]:
    """ln p(token) from one top-K row; a token outside the list gets the row's lowest listed
    logprob as an upper bound (second value False: not exact)."""
    hit = np.flatnonzero(top_ids == token)
    if hit.size:
        return float(top_lps[hit[0]]), True
    valid = top_ids >= 0
    return (float(top_lps[valid].min()) if valid.any() else float("-inf")), False


def margin(top_ids: np.ndarray, top_lps: np.ndarray, own: int, other: int) -> tuple[float, bool]:
    """ln p(own) - ln p(other) of one row; second value False when ``other`` is outside the
    list (then the margin is a lower bound) or ``own`` is (then nothing is known: NaN)."""
    lo, ok_o = logprob_of(top_ids, top_lps, own)
    lx, ok_x = logprob_of(top_ids, top_lps, other)
    if not ok_o:
        return float("nan"), False
    return lo - lx, ok_x


def shared_abs_delta(ids_a, lps_a, ids_b, lps_b) -> np.ndarray:
    """Per row, max |ln p_a - ln p_b| over the ids listed in both rows (0 when none)."""
    ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
    eq = (ids_a[:, :, None] == ids_b[:, None, :]) & (ids_a[:, :, None] >= 0)
    d = np.abs(np.asarray(lps_a)[:, :, None] - np.asarray(lps_b)[:, None, :])
    return np.where(eq, d, 0.0).max(axis=(1, 2)) if ids_a.size else np.zeros(len(ids_a))


def same_context(ref_ids, ref_lps, cand_ids, cand_lps, vocab_size: int, tokens) -> dict[str, np.ndarray]:
    """Per position: top-K KL(P_ref || P_cand) (seed estimate, proven lower/upper bound), top-1
    match and Δlogprob of the context's next token (NaN where a side does not list it)."""
    from ..numerics.bounds import KL, topk_vs_topk
    from ..numerics.metrics import topk

    ref_ids, cand_ids = np.asarray(ref_ids, np.int64), np.asarray(cand_ids, np.int64)
    ref_lps, cand_lps = np.asarray(ref_lps, np.float64), np.asarray(cand_lps, np.float64)
    n = len(ref_ids)
    if n == 0:
        z = np.zeros(0)
        return {"kl_nats": z, "kl_lower_nats": z, "kl_upper_nats": z, "top1_match": np.zeros(0, bool), "dlogprob": z}
    rl = np.where(ref_ids >= 0, ref_lps, 0.0)
    cl = np.where(cand_ids >= 0, cand_lps, 0.0)
    seed = topk(ref_ids, rl, cand_ids, cl, vocab_size)
    iv = topk_vs_topk(ref_ids, rl, cand_ids, cl, vocab_size, divergences=(KL,))[KL]
    dl = np.full(n, np.nan)
    for r, t in enumerate(np.asarray(tokens, np.int64)):
        a, ok_a = logprob_of(ref_ids[r], ref_lps[r], int(t))
        b, ok_b = logprob_of(cand_ids[r], cand_lps[r], int(t))
        if ok_a and ok_b:
            dl[r] = b - a
    return {"kl_nats": seed["kl_nats"], "kl_lower_nats": iv.lower, "kl_upper_nats": iv.upper,
            "top1_match": seed["top1_match"], "dlogprob": dl}


def chance_above_max(n: int, m: int, j: int) -> float:
    """Probability that j or more of n values exceed the largest of m others when all n + m
    are exchangeable (the same distribution, no ties): the j largest of the pooled n + m all
    among the n, C(n, j) / C(n + m, j). Why the prefix-KL check needs it: the largest of n
    prefix positions exceeds the largest of m floor positions with probability n / (n + m)
    when speculation changes nothing at all (936 prefix positions against a one-item F1 of
    256: 0.79), so "prefix KL max above F1's max" alone is no evidence."""
    if j <= 0:
        return 1.0
    if j > n:
        return 0.0
    i = np.arange(j, dtype=np.float64)
    return float(np.exp(np.sum(np.log((n - i) / (n + m - i)))))


def _stat(x) -> dict:
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {"n": int(x.size), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
            "max": float(x.max())}


# ----------------------------------------------------------------------------------------
# the run


@dataclass
class Prompt:
    id: str
    ids: list[int]


def prepare_prompts(ref: LlamaServer, cand: LlamaServer, items) -> list[Prompt]:
    """Workload items as prompt token ids, rendered and tokenized by the reference server; the
    candidate must tokenize the same text to the same ids (a text prompt is never sent)."""
    out = []
    for it in items:
        text = it.prompt if it.messages is None else ref.apply_template(it.messages, it.tools)
        a = ref.tokenize(text)
        b = cand.tokenize(text)
        if a != b:
            d = first_divergence(np.array(a[: min(len(a), len(b))]), np.array(b[: min(len(a), len(b))]))
            at = d if d is not None else min(len(a), len(b))
            raise LogitdiffError(
                f"item {it.id}: the two servers tokenize the prompt differently ({len(a)} vs {len(b)} tokens, first difference at "
                f"token {at}); generation mode sends the same token ids to both, so it needs one tokenizer"
            )
        if not a:
            raise LogitdiffError(f"item {it.id}: the prompt tokenizes to nothing")
        out.append(Prompt(it.id, a))
    return out


def _trace_sums(t: Trace) -> dict:
    """One request's counters, to be added up by :func:`_trace_counts` (a few numbers per
    request: the run keeps these, not the request's arrays)."""
    return {"requests": 1, "draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted,
            "requests_that_drafted": int(t.draft_n > 0), "positions": len(t.ids), "positions_reported": int(t.reported.sum()),
            "not_reported_logprob_zero_no_top": int((~t.reported & ~t.no_entry).sum()), "not_reported_no_entry": int(t.no_entry.sum()),
            "server_prompt_ms": float(t.timings.get("prompt_ms") or 0), "server_predicted_ms": float(t.timings.get("predicted_ms") or 0)}


def _trace_counts(sums: Iterable[dict]) -> dict:
    """A side's counters over its requests (each from :func:`_trace_sums`)."""
    tot: dict = {}
    for one in sums:
        for k, v in one.items():
            tot[k] = tot.get(k, 0) + v
    g = lambda k: tot.get(k, 0)  # noqa: E731
    dn, da, pos, rep = g("draft_n"), g("draft_n_accepted"), g("positions"), g("positions_reported")
    return {"requests": g("requests"), "draft_n": dn, "draft_n_accepted": da, "acceptance_rate": (da / dn) if dn else None,
            "requests_that_drafted": g("requests_that_drafted"), "positions": pos, "positions_reported": rep,
            "positions_not_reported": pos - rep, "not_reported_logprob_zero_no_top": g("not_reported_logprob_zero_no_top"),
            "not_reported_no_entry": g("not_reported_no_entry"), "server_prompt_ms": g("server_prompt_ms"),
            "server_predicted_ms": g("server_predicted_ms")}


def _spilled(spill) -> Iterator[tuple[Trace, Trace]]:
    """The (reference, candidate) traces of each item, in order, read back one item at a
    time from the spill file :func:`compare_generation` wrote."""
    spill.seek(0)
    while True:
        try:
            yield pickle.load(spill)
        except EOFError:
            return


NO_POSITIONS = "not evaluated: no positions compared"
F0_NOT_EVALUATED = F1_NOT_EVALUATED = NO_POSITIONS
# what a figure read against F1's near-tie threshold says when F1 compared nothing: a
# divergence's class, the near-tie/material counts, the prefix-KL check
NO_THRESHOLD = "not evaluated: the near-tie threshold (F1) was not measured"


def _f0(first: Sequence[Trace], again: Sequence[Trace], n: int) -> dict:
    """A side against its own rerun: identical tokens, and |Δlogprob| where both reported.
    With no position reported by both runs (no rerun items, or only speculative steps, whose
    probabilities a server does not report) the largest |Δlogprob| is null with the reason in
    ``not_evaluated``: nothing was compared, which 0 would hide; ``bit_identical`` is then
    null too (never vacuously true: a verdict of lossless needs a compared position),
    unless the runs already differ (tokens, or which positions were reported): False."""
    fd = [first_divergence(a.ids, b.ids) for a, b in zip(first, again)]
    dmax = 0.0
    compared = 0
    top_equal = True
    for a, b in zip(first, again):
        m = len(a.ids) if first_divergence(a.ids, b.ids) is None else first_divergence(a.ids, b.ids)
        both = a.reported[:m] & b.reported[:m]
        compared += int(both.sum())
        if both.any():
            dmax = max(dmax, float(np.abs(a.logprob[:m][both] - b.logprob[:m][both]).max()))
            top_equal &= bool(np.array_equal(a.top_ids[:m][both], b.top_ids[:m][both])
                              and np.array_equal(a.top_lps[:m][both], b.top_lps[:m][both]))
        top_equal &= bool(np.array_equal(a.reported[:m], b.reported[:m]))
    out = {"items": len(fd), "identical_outputs": sum(d is None for d in fd), "positions_compared": compared,
           "max_abs_dlogprob": dmax if compared else None,
           "bit_identical": (False if not (all(d is None for d in fd) and top_equal)
                             else None if not compared else dmax == 0.0),
           "survival": survival(fd, n).tolist()}
    if not compared:
        why = "no items rerun (floor items 0)" if not fd else "no position where both runs reported a probability"
        out["not_evaluated"] = f"{NO_POSITIONS} ({why})"
    return out


def _f1(ref_traces: Sequence[Trace], scored, vocab: int, n: int, width: int) -> dict:
    """The shape floor: decode logprobs vs the same tokens teacher-forced in width-w batches.
    With no position compared (no floor items) its largest |Δlogprob| and the near-tie
    threshold (twice it) are null with the reason in ``not_evaluated``, never 0: a 0
    threshold would class every divergence material."""
    deltas, kls, flips_first, gaps = [], [], [], []
    widths = []
    for tr, sc in zip(ref_traces, scored):
        rep = tr.reported
        widths.append(sc.widths)
        d = shared_abs_delta(tr.top_ids[rep], tr.top_lps[rep], sc.top_ids[rep], sc.top_lps[rep])
        deltas.append(d)
        sc_ = same_context(tr.top_ids[rep], tr.top_lps[rep], sc.top_ids[rep], sc.top_lps[rep], vocab, tr.ids[rep])
        kls.append(sc_["kl_nats"])
        top1 = sc.top_ids[:, 0]
        flip = np.flatnonzero(top1 != tr.ids)
        flips_first.append(int(flip[0]) if flip.size else None)
        for r in np.flatnonzero(top1 != tr.ids):
            g, _ = margin(tr.top_ids[r], tr.top_lps[r], int(tr.ids[r]), int(top1[r]))
            gaps.append(g)
    d_all = np.concatenate(deltas) if deltas else np.zeros(0)
    kl_all = np.concatenate(kls) if kls else np.zeros(0)
    w_all = np.concatenate(widths) if widths else np.zeros(0, np.int64)
    dmax = float(d_all.max()) if d_all.size else None
    uniq, cnt = np.unique(w_all, return_counts=True)
    out = {"items": len(scored), "positions": int(d_all.size), "shape_width": width,
           "widths_seen": {str(int(u)): int(c) for u, c in zip(uniq, cnt)},
           "max_abs_dlogprob": dmax, "abs_dlogprob": _stat(d_all), "kl_nats": _stat(kl_all),
           "top1_flips": sum(1 for _ in gaps), "flip_margins_nats": [float(g) for g in gaps],
           "near_tie_nats": None if dmax is None else 2.0 * dmax, "survival": survival(flips_first, n).tolist()}
    if dmax is None:
        why = "no items re-scored (floor items 0)" if not scored else "no position where the reference reported a probability"
        out["not_evaluated"] = f"{NO_POSITIONS} ({why})"
    return out


def _item_analysis(p: Prompt, r: Trace, c: Trace, ref: LlamaServer, cand: LlamaServer, vocab: int, near: float | None) -> tuple[dict, dict]:
    """One item: divergence, margins, class; the same-context rows (prefix and cross-scored)."""
    n = len(r.ids)
    d = first_divergence(r.ids, c.ids)
    m = n if d is None else d
    # aligned prefix: candidate logprobs where it reported them vs reference decode logprobs
    both = np.flatnonzero(r.reported[:m] & c.reported[:m])
    pre = same_context(r.top_ids[both], r.top_lps[both], c.top_ids[both], c.top_lps[both], vocab, r.ids[both])
    row = {"id": p.id, "prompt_tokens": len(p.ids), "n": n, "identical": d is None, "first_divergence": d,
           "shared_prefix_fraction": m / n if n else 1.0, "draft_n": c.draft_n, "draft_n_accepted": c.draft_n_accepted,
           "candidate_reported": int(c.reported.sum()), "candidate_not_reported": int((~c.reported).sum()),
           "reference_not_reported": int((~r.reported).sum()),
           "prefix_positions_compared": int(both.size), "prefix_kl_max": float(pre["kl_nats"].max()) if both.size else None,
           "prefix_top1_disagreements": int((~pre["top1_match"]).sum()), "prefix_max_abs_dlogprob":
               float(np.nanmax(np.abs(pre["dlogprob"]))) if both.size and np.isfinite(pre["dlogprob"]).any() else None}
    cross = {"prefix": pre}
    if d is not None:
        rt, ct = int(r.ids[d]), int(c.ids[d])
        rm, rm_exact = margin(r.top_ids[d], r.top_lps[d], rt, ct) if r.reported[d] else (float("nan"), False)
        # each side's tokens through the other server from the divergence on (decode shape)
        r_on_c = cand.score(p.ids, r.ids, start=d, width=1, item=p.id)
        c_on_r = ref.score(p.ids, c.ids, start=d, width=1, item=p.id)
        if c.reported[d]:
            cm, cm_exact = margin(c.top_ids[d], c.top_lps[d], ct, rt)
            src = "candidate generation"
        else:
            cm, cm_exact = margin(r_on_c.top_ids[0], r_on_c.top_lps[0], ct, rt)
            src = "candidate server, teacher-forced (the verify batch's own probabilities are not reported)"
        if near is None:
            cls = UNCLASSIFIED
        else:
            tie = (np.isfinite(rm) and abs(rm) <= near) and (not np.isfinite(cm) or abs(cm) <= near)
            cls = NEAR_TIE if tie else MATERIAL
        # reference tokens in the candidate's (teacher-forced) distributions vs the reference's decode rows
        rr = np.flatnonzero(r.reported[d:])
        x1 = same_context(r.top_ids[d:][rr], r.top_lps[d:][rr], r_on_c.top_ids[rr], r_on_c.top_lps[rr], vocab, r.ids[d:][rr])
        # candidate tokens through the reference: token-only agreement, and KL where the candidate reported
        cr = np.flatnonzero(c.reported[d:])
        x2 = same_context(c_on_r.top_ids[cr], c_on_r.top_lps[cr], c.top_ids[d:][cr], c.top_lps[d:][cr], vocab, c.ids[d:][cr])
        agree = c_on_r.top_ids[:, 0] == c.ids[d:]
        row.update({
            "reference_token": rt, "candidate_token": ct,
            "reference_margin_nats": rm, "reference_margin_exact": rm_exact,
            "candidate_margin_nats": cm, "candidate_margin_exact": cm_exact, "candidate_margin_source": src,
            "class": cls,
            "cross_reference_on_candidate_kl_max": float(x1["kl_nats"].max()) if rr.size else None,
            "cross_reference_on_candidate_top1_agreement": float((r_on_c.top_ids[:, 0] == r.ids[d:]).mean()),
            "cross_candidate_on_reference_top1_agreement": float(agree.mean()),
            "cross_candidate_on_reference_kl_max": float(x2["kl_nats"].max()) if cr.size else None,
        })
        cross.update({"ref_on_cand": x1, "cand_on_ref": x2, "cand_on_ref_agree": agree})
    return row, cross


def _no_bar(total, label):
    return lambda n=1: None


def compare_generation(
    ref: LlamaServer,
    cand: LlamaServer,
    prompts: Sequence[Prompt],
    *,
    n_predict: int = DEFAULT_N_PREDICT,
    speculative: bool | None = None,
    floor_items: int = DEFAULT_FLOOR_ITEMS,
    shape_width: int = DEFAULT_SHAPE_WIDTH,
    vocab_size: int | None = None,
    bar: Callable = _no_bar,
) -> tuple[dict, Iterator[dict]]:
    """Generation-mode comparison (see the module doc). Returns the report (without the
    tool/created header) and the per-token generation records (a generator: iterate once).

    ``speculative`` is the candidate's *declaration*, not a switch: None reads it from the
    candidate's /slots; True or False overrides that. It decides only what a run in which the
    candidate never drafted gets: declared, a refusal ("speculation never ran"); not declared,
    a report with the verdict "speculation not exercised". It changes nothing else: a
    candidate that drafts is compared the same way either way (False does not turn the
    candidate's speculation off; only its llama-server flags do).

    ``floor_items``: the first items also get the floors F0 and F1. Fewer floor positions than
    prefix positions make F1's maximum an easy bar to pass by chance; the verdict then says
    "floor too small to judge" rather than "defect" (:func:`chance_above_max`)."""
    if n_predict < 1:
        raise LogitdiffError(f"n_predict {n_predict}: must be at least 1")
    if not prompts:
        raise LogitdiffError("no items to generate from")
    declared = bool(speculative) if speculative is not None else bool(cand.can_speculate)
    V = int(vocab_size or 0) or None
    # Memory is bounded by one item, not by the run: each item's two traces (n_predict x K
    # top lists) go to a spill file as they come and are read back one item at a time for
    # the comparison and for the records; the run keeps counters, the floor items' traces
    # (--floor-items), a row per item and a few per-position scalars (KL, its lower bound,
    # top-1, dlogprob: the exact percentiles' inputs, <= 34 bytes a position, as `compare`
    # keeps its metric columns), where the traces were 2 x K x 16 bytes a position and more.
    spill = tempfile.TemporaryFile(prefix="logitdiff-speculate-")
    try:
        return _compare(ref, cand, prompts, spill, n_predict=n_predict, declared=declared, floor_items=floor_items,
                        shape_width=shape_width, V=V, bar=bar)
    except BaseException:
        spill.close()
        raise


def _compare(ref: LlamaServer, cand: LlamaServer, prompts: Sequence[Prompt], spill: IO[bytes], *, n_predict: int, declared: bool,
             floor_items: int, shape_width: int, V: int | None, bar: Callable) -> tuple[dict, Iterator[dict]]:
    t0 = time.perf_counter()
    n_floor = min(max(floor_items, 0), len(prompts))
    gen = _generate_all(ref, cand, prompts, spill, n_predict, n_floor, bar)
    rc, cc = gen.rc, gen.cc
    _check_drafting(ref, cand, rc, cc, declared)
    if V is None:
        V = gen.top_id + 1
    t1 = time.perf_counter()
    f0, f1 = _floors(ref, cand, prompts[:n_floor], gen, n_predict, shape_width, V, bar)
    del gen.ref_kept, gen.cand_kept
    t_floor = time.perf_counter() - t1
    t2 = time.perf_counter()
    rows, per_pos = _compare_items(ref, cand, prompts, spill, V, f1["near_tie_nats"], bar)
    t_cmp = time.perf_counter() - t2
    summary = _summary(rows, per_pos, f1, n_predict)
    verdict = decide(summary, f0, f1, rc, cc, rows, declared)
    wall = time.perf_counter() - t0
    server_s = (cc["server_prompt_ms"] + cc["server_predicted_ms"] + rc["server_prompt_ms"] + rc["server_predicted_ms"]) / 1e3
    fd = [row["first_divergence"] for row in rows]
    report = {
        "reference": {**ref.identity(), "counters": rc},
        "candidate": {**cand.identity(), "declared_speculative": declared, "counters": cc},
        "method": _method(ref, n_predict, V, n_floor, shape_width, f1["near_tie_nats"]),
        "floors": {"F0": f0, "F1": f1},
        "summary": summary,
        "survival": {"candidate": survival(fd, n_predict).tolist(), "F0_reference": f0["reference"]["survival"],
                     "F0_candidate": f0["candidate"]["survival"], "F1": f1["survival"]},
        "items": rows,
        "verdict": verdict,
        "timing": {"wall_s": wall, "generations_s": gen.t_gen, "floors_s": t_floor, "compare_s": t_cmp,
                   "server_generation_s": server_s, "wall_over_generations": wall / gen.t_gen if gen.t_gen else None,
                   "wall_over_server_generation": wall / server_s if server_s else None},
    }
    return report, _records(prompts, spill)


@dataclass
class _Generated:
    """What the generation pass keeps: each side's counters, the floor items' traces, the
    largest token id seen and the seconds spent generating (the traces are in the spill)."""

    rc: dict
    cc: dict
    ref_kept: list[Trace]
    cand_kept: list[Trace]
    top_id: int
    t_gen: float


def _generate_all(ref: LlamaServer, cand: LlamaServer, prompts: Sequence[Prompt], spill: IO[bytes], n_predict: int, n_floor: int,
                  bar: Callable) -> _Generated:
    """Both servers generate every item; each item's two traces go to ``spill``."""
    ref_kept, cand_kept = [], []  # the floor items' traces
    ref_sums, cand_sums = [], []
    top_id = -1
    t_gen = 0.0
    adv = bar(len(prompts), "generating (reference, candidate)")
    for i, p in enumerate(prompts):
        a = time.perf_counter()
        r = ref.generate(p.ids, n_predict, p.id)
        c = cand.generate(p.ids, n_predict, p.id)
        t_gen += time.perf_counter() - a
        ref_sums.append(_trace_sums(r))
        cand_sums.append(_trace_sums(c))
        top_id = max([top_id] + [int(t.top_ids.max()) for t in (r, c) if t.top_ids.size])
        if i < n_floor:
            ref_kept.append(r)
            cand_kept.append(c)
        pickle.dump((r, c), spill, protocol=pickle.HIGHEST_PROTOCOL)
        del r, c
        adv()
    return _Generated(_trace_counts(ref_sums), _trace_counts(cand_sums), ref_kept, cand_kept, top_id, t_gen)


def _check_drafting(ref: LlamaServer, cand: LlamaServer, rc: dict, cc: dict, declared: bool) -> None:
    """The preconditions: the reference never drafted; a candidate declared speculative did."""
    if rc["draft_n"] > 0:
        raise LogitdiffError(f"reference server {ref.url}: it drafted ({rc['draft_n']} draft tokens); the reference must run without speculation")
    if declared and cc["draft_n"] == 0:
        raise LogitdiffError(
            f"candidate server {cand.url}: declared speculative, but speculation never ran (timings.draft_n = 0 on all "
            f"{cc['requests']} requests: no draft was ever proposed; llama-server drafts only with --spec-type, e.g. --spec-type "
            "draft-simple -md DRAFT.gguf, and an n-gram type only where the text repeats itself)"
        )


def _floors(ref: LlamaServer, cand: LlamaServer, floor_prompts: Sequence[Prompt], gen: _Generated, n_predict: int,
            shape_width: int, V: int, bar: Callable) -> tuple[dict, dict]:
    """F0 (each side against its rerun) and F1 (the reference's tokens teacher-forced in
    ``shape_width`` batches) over the floor items."""
    adv = bar(len(floor_prompts), "floors (F0 reruns, F1 teacher-forced)")
    ref_again, cand_again, f1_scored = [], [], []
    for i, p in enumerate(floor_prompts):
        ref_again.append(ref.generate(p.ids, n_predict, p.id))
        cand_again.append(cand.generate(p.ids, n_predict, p.id))
        f1_scored.append(ref.score(p.ids, gen.ref_kept[i].ids, start=0, width=shape_width, item=p.id))
        adv()
    f0 = {"reference": _f0(gen.ref_kept, ref_again, n_predict), "candidate": _f0(gen.cand_kept, cand_again, n_predict)}
    return f0, _f1(gen.ref_kept, f1_scored, V, n_predict, shape_width)


def _compare_items(ref: LlamaServer, cand: LlamaServer, prompts: Sequence[Prompt], spill: IO[bytes], V: int, near: float | None,
                   bar: Callable) -> tuple[list[dict], dict[str, list]]:
    """Per item (read back from the spill) its row, and the per-position figures kept for
    the summary: the aligned prefix's KL, its lower bound, top-1 and Δlogprob; the
    cross-scored KL and agreement after a divergence."""
    rows: list[dict] = []
    per_pos: dict[str, list] = {"kl": [], "klo": [], "top1": [], "dl": [], "x1_kl": [], "x2_agree": []}
    adv = bar(len(prompts), "comparing (cross-scoring after each divergence)")
    for p, (r, c) in zip(prompts, _spilled(spill)):
        row, x = _item_analysis(p, r, c, ref, cand, V, near)
        rows.append(row)
        per_pos["kl"].append(x["prefix"]["kl_nats"])
        per_pos["klo"].append(x["prefix"]["kl_lower_nats"])
        per_pos["top1"].append(x["prefix"]["top1_match"])
        per_pos["dl"].append(x["prefix"]["dlogprob"])
        if "ref_on_cand" in x:
            per_pos["x1_kl"].append(x["ref_on_cand"]["kl_nats"])
            per_pos["x2_agree"].append(x["cand_on_ref_agree"])
        adv()
    return rows, per_pos


def _summary(rows: list[dict], per_pos: dict[str, list], f1: dict, n_predict: int) -> dict:
    """The run's summary from the item rows and the per-position figures (_compare_items)."""
    kl_all = np.concatenate(per_pos["kl"]) if per_pos["kl"] else np.zeros(0)
    klo_all = np.concatenate(per_pos["klo"]) if per_pos["klo"] else np.zeros(0)
    t1_all = np.concatenate(per_pos["top1"]) if per_pos["top1"] else np.zeros(0, bool)
    # prefix positions whose KL provably exceeds F1's largest: their proven lower bound is
    # above it (decide's comment; the relative slack is for float64 summation order)
    f1_kl = f1["kl_nats"]["max"]
    above = None if f1_kl is None else int((klo_all > f1_kl * (1 + 1e-9) + 1e-15).sum())
    dl_all = np.concatenate(per_pos["dl"]) if per_pos["dl"] else np.zeros(0)
    x1_kl, x2_agree = per_pos["x1_kl"], per_pos["x2_agree"]
    div = [row for row in rows if not row["identical"]]
    summary = {
        "items": len(rows), "n_predict": n_predict,
        "identical_output_rate": sum(row["identical"] for row in rows) / len(rows),
        "divergent_items": len(div), "near_tie_divergences": sum(row["class"] == NEAR_TIE for row in div),
        "material_divergences": sum(row["class"] == MATERIAL for row in div),
        "unclassified_divergences": sum(row["class"] == UNCLASSIFIED for row in div),
        "mean_shared_prefix_fraction": float(np.mean([row["shared_prefix_fraction"] for row in rows])),
        "prefix": {"positions_compared": int(kl_all.size), "kl_nats": _stat(kl_all), "kl_lower_nats": _stat(klo_all),
                   "top1_disagreements": int((~t1_all).sum()), "abs_dlogprob": _stat(np.abs(dl_all)),
                   # how many positions' proven KL lower bound exceeds F1's largest KL, against how many
                   # F1 compared, and the chance of that many when speculation changes nothing (null without F1)
                   "kl_above_floor_max": None if above is None else {
                       "positions": above, "of": int(kl_all.size), "floor_positions": f1["kl_nats"]["n"],
                       "chance": chance_above_max(int(kl_all.size), f1["kl_nats"]["n"], above)}},
        "cross": {"items": len(x1_kl),
                  "reference_on_candidate_kl_nats": _stat(np.concatenate(x1_kl) if x1_kl else []),
                  "candidate_on_reference_top1_agreement": float(np.concatenate(x2_agree).mean()) if x2_agree else None},
    }
    if summary["unclassified_divergences"]:
        # no threshold: how many divergences are near-tie or material is unknown, not 0
        summary["near_tie_divergences"] = summary["material_divergences"] = None
        summary["classes_not_evaluated"] = NO_THRESHOLD
    return summary


def _method(ref: LlamaServer, n_predict: int, V: int, n_floor: int, shape_width: int, near: float | None) -> dict:
    return {
        "mode": "generation", "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "request": {k: v for k, v in ref.generation_body([0], n_predict).items() if k != "prompt"},
        "n_predict": n_predict, "top_logprobs": ref.k, "vocab_size": V, "concurrency": 1,
        "floor_items": n_floor, "shape_width": shape_width, "near_tie_nats": near,
        "notes": [
            "tokens with logprob exactly 0.0 and a short or empty top list are 'probability not reported' "
            "(llama-server sends prob 1.0 and no top list for every token of a speculative step); never read as p = 1",
            "KL figures (kl_nats) are the seed's top-K estimate of KL(P_ref || P_cand); kl_lower_nats its proven lower bound "
            "(bounds.topk_vs_topk; the upper bound of a top-K/top-K KL is infinite without a stated logprob floor)",
            "candidate margins at a divergence come from its generation when it reported them, else from "
            "teacher forcing on the candidate server (a non-speculative prefill)",
        ],
    }


def _records(prompts: Sequence[Prompt], spill: IO[bytes]) -> Iterator[dict]:
    """The generation records, read back from the spill one item at a time: one item's JSON
    (Python lists, ~10x its arrays) at a time while the writer streams them. Closes the
    spill at the end (or when the generator is closed or collected)."""
    try:
        for p, (r, c) in zip(prompts, _spilled(spill)):
            for side, t in (("reference", r), ("candidate", c)):
                yield {"id": p.id, "side": side, "run": 1, "prompt_ids": p.ids, **t.to_json()}
    finally:
        spill.close()


def _prefix_kl_finding(summary: dict, f1: dict) -> tuple[str, str] | None:
    """What the prefix's KL says against F1's largest, as (``defect`` | ``too_small`` |
    ``unmeasured`` | ``within``, the sentence), or None when there is nothing to say (see
    :func:`decide`'s comment)."""
    f1_kl = f1["kl_nats"]["max"]
    pre_kl = summary["prefix"]["kl_nats"]["max"] or 0.0
    above = summary["prefix"].get("kl_above_floor_max")
    lo = summary["prefix"]["kl_lower_nats"]["max"]
    if pre_kl > 1e-15 and f1_kl is None:
        return "unmeasured", f"prefix KL {pre_kl:.3g} nats at identical contexts against the shape floor F1: {NO_THRESHOLD}"
    if f1_kl is not None and above and above["positions"]:
        j, n, m, p = above["positions"], above["of"], above["floor_positions"], above["chance"]
        said = (f"prefix KL at identical contexts provably above the shape floor F1's largest ({f1_kl:.3g} nats, over {m} positions "
                f"of {f1['items']} floor items) at {j} of {n} positions (proven lower bound max {'not known' if lo is None else f'{lo:.3g}'} nats, "
                f"top-K estimate max {pre_kl:.3g}); that many from positions like F1's own, by chance: p = {p:.2g}")
        if p < PREFIX_KL_ALPHA:
            return "defect", said
        return "too_small", (f"{FLOOR_TOO_SMALL}: {said} (>= {PREFIX_KL_ALPHA:g}), no evidence either way; more --floor-items "
                             "measure F1 on more positions")
    if f1_kl is not None and pre_kl > f1_kl * (1 + 1e-9) + 1e-15 and lo is None:
        # no finite lower bound: "not provably above" would be read as evidence it is not above
        return "unmeasured", (f"prefix KL top-K estimate max {pre_kl:.3g} nats above F1's largest ({f1_kl:.3g}), and no position "
                              "has a finite proven lower bound to decide it")
    if f1_kl is not None and pre_kl > f1_kl * (1 + 1e-9) + 1e-15:
        return "within", (f"prefix KL top-K estimate max {pre_kl:.3g} nats above F1's largest ({f1_kl:.3g}), but no position's proven "
                          f"lower bound is (max {lo:.3g}): not provably above the floor")
    return None


def decide(summary: dict, f0: dict, f1: dict, rc: dict, cc: dict, rows: list[dict], declared: bool) -> dict:
    """The verdict in words, with its reasons (each a sentence with the numbers)."""
    reasons: list[str] = []
    defects: list[str] = []
    if cc["draft_n_accepted"] > cc["draft_n"]:
        defects.append(f"the candidate reports {cc['draft_n_accepted']} accepted of {cc['draft_n']} drafted tokens (acceptance without drafting)")
    # A reference position without a probability (logprob 0 and no top list, or no entry at
    # all) is a gap in what was measured, not a fault of speculation: it is left out of every
    # comparison that needs it, and the figures say over how many positions they were read.
    gaps: list[str] = []
    if rc["positions_not_reported"]:
        gaps.append(f"{MEASUREMENT_GAP}: the reference (no speculation) reported no probability at {rc['positions_not_reported']} of "
                    f"{rc['positions']} positions although n_probs was asked ({rc['not_reported_logprob_zero_no_top']} with logprob 0 "
                    f"and no top list, {rc['not_reported_no_entry']} with no entry); F1, the aligned-prefix comparison and the "
                    "margins leave them out")
    unexplained = sum(r["candidate_not_reported"] for r in rows if r["draft_n"] == 0)
    if unexplained:
        defects.append(f"{unexplained} candidate probabilities unreported in requests that never drafted")
    if summary["material_divergences"]:
        defects.append(f"{summary['material_divergences']} material divergence(s): a side's margin exceeds the shape floor's "
                       f"{f1['near_tie_nats']:.3g} nats")
    # what could not be read against a floor F1 never measured: neither passed nor failed
    unmeasured: list[str] = []
    if summary["unclassified_divergences"]:
        unmeasured.append(f"{summary['unclassified_divergences']} divergence(s) not classed near-tie or material: "
                          f"{summary['classes_not_evaluated']}")
    f1_kl = f1["kl_nats"]["max"]
    # The prefix's KL against F1's largest (_prefix_kl_finding). A position counts as above it only when its KL
    # provably is: its proven lower bound (bounds.topk_vs_topk) exceeds F1's largest, not its
    # top-K seed estimate, which a swap of two tokens tied at the K-th place inflates by orders
    # of magnitude (seen: an estimate of 2.6e-3 nats over a lower bound of 3e-11; and the
    # prefix's and F1's largest estimates equal to the last digit, 2.62e-3, so that the
    # verdict hung on the float slack). The slack (1e-9 relative) is for float64 summation
    # order: the same row through two code paths agrees to 1e-12. And a maximum over many
    # prefix positions exceeds the maximum over a few floor positions by chance alone, so a
    # defect needs more positions above than F1's size leaves to chance
    # (chance_above_max < PREFIX_KL_ALPHA); fewer say the floor is too small.
    too_small: list[str] = []
    within: list[str] = []
    finding = _prefix_kl_finding(summary, f1)
    if finding is not None:
        {"defect": defects, "too_small": too_small, "unmeasured": unmeasured, "within": within}[finding[0]].append(finding[1])
    # F0 = 0 is evidence only where a rerun compared at least one position on each side
    f0_zero = f0["reference"]["bit_identical"] is True and f0["candidate"]["bit_identical"] is True
    f0_unmeasured = [side for side in ("reference", "candidate") if f0[side]["bit_identical"] is None]
    word = {True: "bit-identical", False: "NOT identical", None: "not measured"}
    reasons.append(f"F0 (run-to-run): reference {word[f0['reference']['bit_identical']]}, "
                   f"candidate {word[f0['candidate']['bit_identical']]} on {f0['reference']['items']} items"
                   + "".join(f"; {side} |Δlogprob| {f0[side]['not_evaluated']}" for side in ("reference", "candidate")
                             if f0[side].get("not_evaluated")))
    if summary["divergent_items"] == 0 and f0_unmeasured:
        # identical outputs, but lossless also says the runs are bit-identical, and no rerun showed it
        unmeasured.append(f"identical outputs, but F0 compared no position on the {' and '.join(f0_unmeasured)} side: "
                          "lossless needs at least one position compared on each side's rerun")
    if f1["max_abs_dlogprob"] is None:
        reasons.append(f"F1 (shape floor, width {f1['shape_width']}): max |Δlogprob| and the near-tie threshold "
                       f"{f1['not_evaluated']}")
    else:
        reasons.append(f"F1 (shape floor, width {f1['shape_width']}): max |Δlogprob| {f1['max_abs_dlogprob']:.3g} nats, "
                       f"KL max {'not measured' if f1_kl is None else format(f1_kl, '.3g')}, "
                       f"{f1['top1_flips']} top-1 flips over {f1['positions']} positions")
    classes = (f"{summary['divergent_items']} divergences, classes not evaluated" if summary["near_tie_divergences"] is None
               else f"{summary['near_tie_divergences']} near-tie and {summary['material_divergences']} material divergences")
    reasons.append(f"identical outputs {summary['identical_output_rate'] * 100:.1f}% of {summary['items']} items; {classes}")
    if cc["draft_n"]:
        reasons.append(f"drafting ran: {cc['draft_n_accepted']} of {cc['draft_n']} draft tokens accepted "
                       f"({100 * cc['acceptance_rate']:.1f}%) in {cc['requests_that_drafted']} of {cc['requests']} requests")
    reasons += gaps + within + unmeasured + too_small
    if cc["draft_n"] == 0:
        label = NOT_EXERCISED
        reasons.insert(0, "the candidate never drafted (timings.draft_n = 0 on every request): nothing about speculation was measured")
    elif defects:
        label = DEFECT
    elif unmeasured:
        label = FLOOR_NOT_MEASURED
    elif too_small:
        label = FLOOR_TOO_SMALL
    elif summary["divergent_items"] == 0 and f0_zero:
        label = LOSSLESS
    else:
        label = SHAPE_ONLY
        if f0_unmeasured:
            reasons.append(f"F0 not measured ({' and '.join(f0_unmeasured)}): run-to-run noise is not ruled out")
        elif not f0_zero:
            reasons.append("F0 is not zero: part of any difference is run-to-run noise")
    return {"label": label, "defects": defects, "reasons": reasons}
