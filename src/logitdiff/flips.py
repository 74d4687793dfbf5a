"""What a flip does: branch at top-1 flips, continue with the candidate, classify.

A *flip* is a teacher-forced output position t where the candidate's winner differs from
the reference's (``top1_match`` false). Because the teacher sequence is the reference's own
greedy output, the reference's continuation from ``teacher[:t]`` is ``teacher[t:]``: the
control. The *branch* is the candidate continuing greedily from
``prompt + teacher[:t] + candidate_top1``. Both outputs have the same total budget (the
item's), so their ends are comparable. With ``both``, the reference also continues from
the candidate's token, which separates "the token was poison" (the reference, given that
token, goes astray too) from "the candidate drifts anyway".

Outcomes (checked in this order; every branch stores the signals that decided it):

``tool_call_malformed``  the reference made a schema-valid tool call and the branch's call
                         does not parse, is missing, or violates the tool's JSON schema;
``tool_call_changed``    the branch's call is valid but names another function or other
                         arguments (AST comparison, `toolcalls.compare_calls`);
``recovered``            the branch re-synchronises with the reference (a common run of at
                         least ``resync`` tokens, or both ends identical when shorter) and
                         its final answer / tool call is the same (items without a label
                         or tool call have no answer: re-synchronising is enough);
``benign``               no re-synchronisation, but the same answer / tool call and a
                         similarity >= the threshold;
``meaning_changed``      everything else: a different answer or a similarity below it.

Similarity is measured on the text from the flip onward (the shared prefix would inflate
it): MiniLM cosine when the optional extra is installed, else a normalised edit
similarity; the report names which.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .errors import LogitdiffError
from .grading import Similarity, expected_calls, grade, last_number, normalise_answer
from .toolcalls import ParsedCalls, compare_calls, parse_tool_calls, validate_call

OUTCOMES = ("recovered", "benign", "meaning_changed", "tool_call_malformed", "tool_call_changed")
# Most consequential first: used to rank flips for the report.
SEVERITY = {"tool_call_malformed": 4, "tool_call_changed": 3, "meaning_changed": 2, "benign": 1, "recovered": 0}
MARGIN_BUCKETS = (0.0, 0.05, 0.2, 0.5, 1.0000001)


@dataclass
class Flip:
    item_id: str
    position: int
    ref_token_id: int
    cand_token_id: int
    p_ref: float  # reference's probability of its own winner
    p_cand: float  # candidate's probability of its own winner
    margin_ref: float
    kl_nats: float
    tags: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# selection


def parse_select(text: str) -> tuple[str, int | None]:
    """``first`` | ``all`` | ``top-kl:N`` | ``low-margin:N`` | ``sample:N``."""
    if text in ("first", "all"):
        return text, None
    if ":" in text:
        mode, n = text.split(":", 1)
        if mode in ("top-kl", "low-margin", "sample"):
            try:
                k = int(n)
            except ValueError:
                k = -1
            if k > 0:
                return mode, k
    raise LogitdiffError(f"--select {text!r}: expected first, all, top-kl:N, low-margin:N or sample:N (N > 0)")


def find_flips(columns: dict, tags_of: dict[str, list[str]] | None = None) -> list[Flip]:
    """Every flip of a comparison, in item/position order."""
    match = np.asarray(columns["top1_match"], dtype=bool)
    idx = np.nonzero(~match)[0]
    p_ref = columns.get("p_top1_ref")
    p_cand = columns.get("p_top1_cand")
    out = []
    for i in idx:
        iid = str(columns["item_id"][i])
        out.append(
            Flip(
                item_id=iid,
                position=int(columns["position"][i]),
                ref_token_id=int(columns["top1_ref"][i]),
                cand_token_id=int(columns["top1_cand"][i]),
                p_ref=float(p_ref[i]) if p_ref is not None else float("nan"),
                p_cand=float(p_cand[i]) if p_cand is not None else float("nan"),
                margin_ref=float(columns["margin_ref"][i]),
                kl_nats=float(columns["kl_nats"][i]),
                tags=list((tags_of or {}).get(iid, [])),
            )
        )
    return out


def select_flips(flips: Sequence[Flip], select: str = "first", max_branches: int | None = None, seed: int = 0) -> tuple[list[Flip], str]:
    """The flips to branch from, and a sentence saying what was chosen.

    When the selection is larger than ``max_branches``, the flips with the highest KL are
    kept (they are the likeliest to matter); a budget larger than the flips is not an error.
    """
    mode, n = parse_select(select)
    chosen = list(flips)
    if mode == "first":
        seen: set[str] = set()
        chosen = [f for f in flips if not (f.item_id in seen or seen.add(f.item_id))]
    elif mode == "top-kl":
        chosen = sorted(flips, key=lambda f: -f.kl_nats)[:n]
    elif mode == "low-margin":
        chosen = sorted(flips, key=lambda f: f.margin_ref)[:n]
    elif mode == "sample":
        chosen = random.Random(seed).sample(list(flips), min(n, len(flips)))
    note = f"{len(chosen)} of {len(flips)} flips selected by '{select}'"
    if max_branches is not None and len(chosen) > max_branches:
        chosen = sorted(chosen, key=lambda f: -f.kl_nats)[:max_branches]
        note += f", capped at --max-branches {max_branches} (highest KL kept)"
    chosen.sort(key=lambda f: (f.item_id, f.position))
    return chosen, note


# --------------------------------------------------------------------------------------------
# comparing two outputs


def resync(ref_tail: Sequence[int], branch_tail: Sequence[int], min_run: int) -> tuple[int, int, int] | None:
    """First (branch offset, reference offset, run length) where the tails re-join.

    A re-join is a common run of at least ``min_run`` tokens, or - when both whole tails
    are shorter than that (a one-token answer and its end token) - both tails being
    identical from some point to their ends.
    """
    r, b = list(ref_tail), list(branch_tail)
    grams: dict[tuple, int] = {}
    for j in range(len(r) - min_run + 1):
        grams.setdefault(tuple(r[j : j + min_run]), j)
    for i in range(len(b)):
        j = grams.get(tuple(b[i : i + min_run])) if len(b) - i >= min_run else None
        if j is not None:
            n = min_run
            while i + n < len(b) and j + n < len(r) and b[i + n] == r[j + n]:
                n += 1
            return i, j, n
        rest = len(b) - i
        if len(b) < min_run and len(r) < min_run and 0 < rest <= len(r) and b[i:] == r[len(r) - rest :]:
            return i, len(r) - rest, rest
    return None


def _answer_key(expected: dict | None, text: str) -> Any:
    """What "the same final answer" compares for a labelled item (None: no label)."""
    if not expected:
        return None
    if "answer" in expected:
        return normalise_answer(text)
    if "numeric" in expected:
        return last_number(text)
    if "regex" in expected:
        import re

        m = re.search(expected["regex"], text)
        return m.group(0) if m else None
    return None


def _call_state(parsed: ParsedCalls, tools: list[dict]) -> tuple[bool, list[str]]:
    if not parsed.ok:
        return False, [parsed.error or "no tool call"]
    errs = [e for c in parsed.calls for e in validate_call(c, tools)]
    return not errs, errs


def classify(
    *,
    item: dict,
    ref_ids: Sequence[int],
    branch_ids: Sequence[int],
    position: int,
    ref_text: str,
    branch_text: str,
    similarity: float,
    threshold: float,
    min_run: int = 4,
    exec_check: Callable[[list, list], dict] | None = None,
) -> tuple[str, dict]:
    """Outcome of one branch and the signals that decided it.

    ``ref_ids``/``branch_ids`` are whole outputs (token ids after the prompt) that agree
    before ``position``; ``ref_text``/``branch_text`` their decoded text without the end
    token. ``exec_check(ref_calls, branch_calls)`` runs both calls (optional).
    """
    t = position
    sig: dict[str, Any] = {"similarity": float(similarity), "similarity_threshold": threshold}
    rs = resync(ref_ids[t + 1 :], branch_ids[t + 1 :], min_run)
    sig["resync_branch_offset"] = None if rs is None else t + 1 + rs[0]
    sig["resync_ref_offset"] = None if rs is None else t + 1 + rs[1]
    sig["resync_run"] = None if rs is None else rs[2]
    tools = item.get("tools") or []
    expected = item.get("expected") or {}
    same: bool | None = None
    if tools:
        pr, pb = parse_tool_calls(ref_text), parse_tool_calls(branch_text)
        ref_valid, ref_errs = _call_state(pr, tools)
        br_valid, br_errs = _call_state(pb, tools)
        sig.update(
            ref_call=[c.to_json() for c in pr.calls] or None,
            branch_call=[c.to_json() for c in pb.calls] or None,
            ref_call_valid=ref_valid,
            branch_call_valid=br_valid,
            branch_call_errors=br_errs if pb.attempted or ref_valid else [],
        )
        if ref_valid:
            if not br_valid:
                sig["decided_by"] = "reference call valid, branch call " + ("invalid" if pb.ok else "unparsable or absent")
                return "tool_call_malformed", sig
            cmp = compare_calls(pb.calls, pr.calls, tools)
            sig["call_differences"] = cmp.reasons
            if exec_check is not None:
                sig["exec"] = exec_check(pr.calls, pb.calls)
            if not cmp.equal:
                sig["decided_by"] = "valid call, different: " + cmp.reasons[0]
                return "tool_call_changed", sig
            same = True
        elif pb.attempted:
            # The reference made no valid call; the branch's call is a behaviour change.
            same = pr.ok and pb.ok and compare_calls(pb.calls, pr.calls, tools).equal
    if same is None:
        key_r, key_b = _answer_key(expected, ref_text), _answer_key(expected, branch_text)
        if expected and ("answer" in expected or "numeric" in expected or "regex" in expected):
            same = key_r == key_b
            sig["ref_answer"], sig["branch_answer"] = key_r, key_b
        elif expected and ("tool_call" in expected or "tool_calls" in expected):
            gr, gb = grade(expected, ref_text, tools), grade(expected, branch_text, tools)
            same = gr.extracted == gb.extracted
        else:
            # No label, no tool call: there is no final answer to compare, so re-joining
            # the reference text is what "the same" can mean.
            same = rs is not None
    sig["same_answer"] = bool(same)
    # Without a label or a valid reference call there is no answer to compare: similarity
    # alone separates benign from changed when the branch never re-joins.
    label_free = not expected and not sig.get("ref_call_valid")
    if rs is not None and same:
        what = "" if label_free else "; same answer"
        sig["decided_by"] = f"re-joined the reference {rs[0] + 1} tokens after the flip for {rs[2]} tokens{what}"
        return "recovered", sig
    if (same or label_free) and similarity >= threshold:
        sig["decided_by"] = ("same answer, " if same else "no re-join, ") + f"similarity {similarity:.3f} >= {threshold}"
        return "benign", sig
    if same or label_free:
        sig["decided_by"] = ("same answer but " if same else "no re-join, ") + f"similarity {similarity:.3f} < {threshold}"
    else:
        sig["decided_by"] = "different answer" + ("" if rs is None else " (re-joined the text, not the answer)")
    return "meaning_changed", sig


# --------------------------------------------------------------------------------------------
# summaries


def margin_bucket(m: float) -> str:
    for a, b in zip(MARGIN_BUCKETS, MARGIN_BUCKETS[1:]):
        if a <= m < b:
            return f"[{a:g},{min(b, 1.0):g}" + ("]" if b > 1 else ")")
    return "n/a"


def range_label(pos: int, edges: Sequence[int]) -> str:
    for a, b in zip(edges, list(edges[1:]) + [None]):
        if pos >= a and (b is None or pos < b):
            return f"[{a},{b})" if b is not None else f"[{a},inf)"
    return "n/a"


def _counts(rows: list[dict], key: Callable[[dict], Any]) -> dict:
    out: dict[str, dict] = {}
    for r in rows:
        for k in key(r):
            d = out.setdefault(k, {o: 0 for o in OUTCOMES} | {"n": 0})
            d[r["outcome"]] += 1
            d["n"] += 1
    for d in out.values():
        d["rates"] = {o: d[o] / d["n"] for o in OUTCOMES}
    return dict(sorted(out.items()))


def summarize_branches(rows: list[dict], *, n_flips: int, n_positions: int, note: str, similarity_name: str, ranges: Sequence[int], settings: dict, n_top: int = 10) -> dict:
    """The ``flips`` section of report.json."""
    n = len(rows)
    outcomes = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    top = sorted(rows, key=lambda r: (-SEVERITY[r["outcome"]], -r["kl_nats"]))[:n_top]
    sec = {
        "n_flips": n_flips,
        "flip_rate": (n_flips / n_positions) if n_positions else None,
        "n_branches": n,
        "selection": note,
        "similarity": similarity_name,
        "settings": settings,
        "outcomes": outcomes,
        "rates": {o: (c / n if n else None) for o, c in outcomes.items()},
        "by_tag": _counts(rows, lambda r: r["tags"] or ["(untagged)"]),
        "by_range": _counts(rows, lambda r: [range_label(r["position"], ranges)]),
        "by_margin": _counts(rows, lambda r: [margin_bucket(r["margin_ref"])]),
        "top": [
            {k: r[k] for k in (
                "item_id", "position", "outcome", "kl_nats", "margin_ref", "p_ref", "p_cand",
                "ref_token", "cand_token", "ref_continuation", "branch_continuation", "decided_by",
            ) if k in r}
            for r in top
        ],
    }
    if any("outcome_ref_from_cand_token" in r for r in rows):
        both = [r for r in rows if r.get("outcome_ref_from_cand_token")]
        bad = ("meaning_changed", "tool_call_malformed", "tool_call_changed")
        sec["both"] = {
            "outcomes_ref_from_cand_token": {o: sum(r["outcome_ref_from_cand_token"] == o for r in both) for o in OUTCOMES},
            "token_was_poison": sum(r["outcome"] in bad and r["outcome_ref_from_cand_token"] in bad for r in both),
            "candidate_drifts_anyway": sum(r["outcome"] in bad and r["outcome_ref_from_cand_token"] not in bad for r in both),
        }
    return sec
