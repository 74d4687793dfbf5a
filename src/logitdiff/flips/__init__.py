"""Stage *flips*: what a top-1 flip does — branch classification (this module), free-running
consequences (`consequences`), salient changes (`salient`), grading against labels
(`grading`), tool calls (`toolcalls`) and the sandbox that executes them (`sandbox`).
Imports `report`, `compare`, `capture` and below.

What a flip does: branch at top-1 flips, continue with the candidate, classify.

A *flip* is a teacher-forced output position t where the candidate's winner differs from
the reference's (``top1_match`` false) and from the token the reference wrote there (the
teacher token; where the candidate picked that token although it is not the reference's
scored top-1, a branch would replay the reference: :func:`reference_self_consistency`). Because the teacher sequence is the reference's own
greedy output, the reference's continuation from ``teacher[:t]`` is ``teacher[t:]``: the
control. The *branch* is the candidate continuing greedily from
``prompt + teacher[:t] + candidate_top1``. Both outputs have the same total budget (the
item's), so their ends are comparable. With ``both``, the reference also continues from
the candidate's token, which separates "the token was poison" (the reference, given that
token, goes astray too) from "the candidate drifts anyway".

A flip where the reference's own top two are tied within rounding (``tie_tolerance``) is a
*tie*: the engines broke it, the candidate did not flip. Ties are counted apart and not
branched unless asked, and never enter outcome counts or gates.

Outcomes, decided only by rules anyone can re-run (checked in this order; every branch
stores the signals that decided it; the definitions are in docs/flips.md):

``tool_call_malformed``  the reference made a schema-valid tool call and the branch's call
                         does not parse, is missing, or violates the tool's JSON schema;
``tool_call_changed``    the branch's call is valid but names another function or other
                         arguments (AST comparison, `toolcalls.compare_calls`);
``recovered``            the branch re-joins the reference at an aligned point and stays
                         joined (:func:`align`) for at least ``MIN_RUN`` tokens, and the
                         item's checker, where it has one, gives both the same verdict
                         (re-joined word salad with a content word on one side only is not:
                         a blind reader did not read it as the reference coming back);
``answer_same`` /        otherwise, an item whose checker decides (an answer / numeric /
``answer_changed``       regex label, a tool-call label or a valid reference call, a BFCL
                         label): the checker's verdicts on both outputs, same or not;
``tests_passed`` /       otherwise, an item with a ``tests`` label (HumanEval): the branch's
``tests_failed``         program run by the item's tests in the sandbox;
``diverged``             otherwise: an unlabelled text that did not come back. No claim about
                         its meaning; ``decided_by`` records what was observed (where it left,
                         the salient differences, the similarity) as observations.

``benign`` / ``meaning_changed`` are never produced here: only a named judge (``--judge``)
turns a diverged branch into one of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import salient
from ..contracts import Flips, Outcome
from ..errors import LogitdiffError
from .grading import grade, grade_tests, last_number, normalise_answer
from ..numerics.summarize import range_label
from .toolcalls import ParsedCalls, compare_calls, parse_tool_calls, validate_call

OUTCOMES = Outcome.ALL  # declared in contracts (gates, reports and summaries read the same names)
# Most consequential first: used to rank flips for the report. Diverged (meaning not judged)
# ranks above the harmless classes and below every checker's bad verdict.
SEVERITY = {Outcome.TOOL_CALL_MALFORMED: 7, Outcome.TOOL_CALL_CHANGED: 6, Outcome.TESTS_FAILED: 5, Outcome.ANSWER_CHANGED: 5,
            Outcome.MEANING_CHANGED: 4, Outcome.DIVERGED: 3, Outcome.BENIGN: 2, Outcome.ANSWER_SAME: 1,
            Outcome.TESTS_PASSED: 1, Outcome.RECOVERED: 0}
MARGIN_BUCKETS = (0.0, 0.05, 0.2, 0.5, 1.0000001)

# Recovery (docs/flips.md). A re-join is MIN_RUN common tokens at offsets in the branch and
# the reference at most MAX_SHIFT apart; after it, a detour must re-join within MAX_DETOUR
# tokens on each side, and at least MIN_JOINED_SHARE of the tokens after the flip (to the
# end of the shorter output) must be joined. Eight tokens of the bundled tokenizer are a
# few words or one short line.
from ..defaults import MAX_DETOUR, MAX_SHIFT, MIN_RUN  # noqa: E402 (the values, defined for the CLI's --help)
MIN_JOINED_SHARE = 0.8
# ... or at most this many tokens of it not joined (a word of the bundled tokenizer: local
# whatever the share, which matters only for the last few tokens of the budget).
LOCAL_TOKENS = 2
# Last thirds of two continuations this dissimilar (difflib ratio) end differently: a
# recovered branch must not (the summary counts any that do, so a wrong class shows on the
# page), and on character-scored text (code) neither may a benign one.
END_RATIO_DISSIMILAR = 0.5


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
    tie: bool = False  # the reference's top two were tied within rounding (see tie_tolerance)
    written_token_id: int | None = None  # the token the reference wrote here (teacher), None when unknown


def tie_tolerance(p_top1: float) -> float:
    """Largest reference margin p(top1) - p(top2) that is a tie, not a decision.

    The spacing of bf16 numbers at p(top1): 2^(floor(log2 p) - 7) (8 significant bits).
    Two probabilities closer than that would be stored as the same or as neighbouring bf16
    values; a BF16 reference (and any bf16/quantized candidate) cannot order them, so which
    one wins is the engine's tie-break (argmax takes the lowest id), not drift. For a float32
    reference the bound is generous but still below 1 % of p. Exact ties (margin 0, as when
    two bf16 logits are equal) are always ties; without p(top1) only those are.
    """
    if not np.isfinite(p_top1) or p_top1 <= 0:
        return 0.0
    return float(2.0 ** (np.floor(np.log2(min(p_top1, 1.0))) - 7))


def is_tie(margin_ref: float, p_top1: float) -> bool:
    return bool(margin_ref <= tie_tolerance(p_top1))


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


def find_flips(columns: dict, tags_of: dict[str, list[str]] | None = None,
               teacher_of: dict[str, Sequence[int]] | None = None) -> list[Flip]:
    """Every flip of a comparison, in item/position order.

    A flip is a position where the candidate's winner differs from the reference's scored
    winner (``top1_match`` false) *and* from the token the reference wrote (the teacher
    token: ``token_id`` in the columns, else ``teacher_of[item][position]``). Where the
    reference's written token is not its own scored top-1 (generation and scoring ran in
    other batch shapes) and the candidate picked the written token, branching would replay
    the reference's own continuation: that is not a flip (:func:`reference_self_consistency`
    counts those positions).
    """
    match = np.asarray(columns["top1_match"], dtype=bool)
    idx = np.nonzero(~match)[0]
    p_ref = columns.get("p_top1_ref")
    p_cand = columns.get("p_top1_cand")
    written = _written_tokens(columns, teacher_of)
    out = []
    for i in idx:
        iid = str(columns["item_id"][i])
        cand = int(columns["top1_cand"][i])
        w = None if written is None else written[i]
        if w is not None and cand == w:
            continue
        p1 = float(p_ref[i]) if p_ref is not None else float("nan")
        margin = float(columns["margin_ref"][i])
        out.append(
            Flip(
                item_id=iid,
                position=int(columns["position"][i]),
                ref_token_id=int(columns["top1_ref"][i]),
                cand_token_id=cand,
                p_ref=p1,
                p_cand=float(p_cand[i]) if p_cand is not None else float("nan"),
                margin_ref=margin,
                kl_nats=float(columns["kl_nats"][i]),
                tags=list((tags_of or {}).get(iid, [])),
                tie=is_tie(margin, p1),
                written_token_id=w,
            )
        )
    return out


def _written_tokens(columns: dict, teacher_of: dict[str, Sequence[int]] | None) -> list[int | None] | None:
    """The token the reference wrote at each row (None where unknown)."""
    if "token_id" in columns:
        return [int(x) for x in columns["token_id"]]
    if teacher_of is None:
        return None
    out: list[int | None] = []
    for iid, pos in zip(columns["item_id"], columns["position"]):
        t = teacher_of.get(str(iid))
        out.append(int(t[int(pos)]) if t is not None and int(pos) < len(t) else None)
    return out


def reference_self_consistency(columns: dict, teacher_of: dict[str, Sequence[int]] | None = None,
                               token_text: Callable[[int], str] | None = None, n_list: int = 20) -> dict:
    """Positions where the token the reference wrote is not its own scored top-1.

    The teacher is the reference's greedy (incremental) output, the distributions come from
    teacher-forced scoring in other batch shapes: in low precision the two can pick different
    near-tied winners. ``n_candidate_wrote_it`` counts those where the candidate's winner is
    the written token (a top-1 "flip" that is no flip: not branched).
    """
    written = _written_tokens(columns, teacher_of)
    n = len(columns["position"])
    if written is None:
        return {"n_positions": n, "n_written_not_top1": None, "rate": None, "n_candidate_wrote_it": None, "list": []}
    top1_ref = [int(x) for x in columns["top1_ref"]]
    top1_cand = [int(x) for x in columns["top1_cand"]]
    # (position index, written token) where the written token is not the reference's top-1
    bad = [(i, w) for i, w in zip(range(n), written) if w is not None and w != top1_ref[i]]
    show = token_text or (lambda t: str(t))
    rows = [{"item_id": str(columns["item_id"][i]), "position": int(columns["position"][i]),
             "written_token": show(w), "top1_ref_token": show(top1_ref[i]), "top1_cand_token": show(top1_cand[i]),
             "margin_ref": float(columns["margin_ref"][i])} for i, w in bad[:n_list]]
    return {
        "n_positions": n,
        "n_written_not_top1": len(bad),
        "rate": len(bad) / n if n else None,
        "n_candidate_wrote_it": sum(top1_cand[i] == w for i, w in bad),
        "list": rows,
    }


def _first_per_item(flips: Sequence[Flip], skip: set[str] | None = None) -> list[Flip]:
    """The first flip of each item, in order, leaving out the items in ``skip``."""
    seen = set(skip or ())
    out = []
    for f in flips:
        if f.item_id not in seen:
            seen.add(f.item_id)
            out.append(f)
    return out


def select_flips(
    flips: Sequence[Flip], select: str = "first", max_branches: int | None = None, seed: int = 0, branch_ties: bool = False,
    priority: dict[str, int | None] | None = None,
) -> tuple[list[Flip], str, list[Flip]]:
    """The flips to branch from, a sentence saying what was chosen, and the selected flips
    the cap left out.

    Ties (``Flip.tie``) are not the candidate's flips and are left out unless
    ``branch_ties``. ``priority`` names the items whose answer or tool call changed (item ->
    the output position where the free-running outputs first differ, or None): their flips
    always join the selection (the flip at that position, else the item's first), so the
    flip behind a changed answer is never dropped for another. When the selection is larger
    than ``max_branches`` it is ranked: the changed items' flips first, then one flip per
    other item (its highest-KL one), then the rest by KL; the cap keeps the head of that
    ranking. A budget larger than the flips is not an error.
    """
    mode, n = parse_select(select)
    n_ties = sum(f.tie for f in flips)
    if not branch_ties:
        flips = [f for f in flips if not f.tie]
    priority = priority or {}
    chosen = list(flips)
    if mode == "first":
        chosen = _first_per_item(flips)
    elif mode == "top-kl":
        chosen = sorted(flips, key=lambda f: -f.kl_nats)[:n]
    elif mode == "low-margin":
        chosen = sorted(flips, key=lambda f: f.margin_ref)[:n]
    elif mode == "sample":
        assert n is not None  # parse_select gives N with top-kl, low-margin and sample
        chosen = random.Random(seed).sample(list(flips), min(n, len(flips)))
    note = f"{len(chosen)} of {len(flips)} flips selected by '{select}'"
    # the flip behind each changed answer / tool call
    behind: list[Flip] = []
    for iid, pos in priority.items():
        own = [f for f in flips if f.item_id == iid]
        if not own:
            continue
        at = [f for f in own if f.position == pos]
        before = [f for f in own if pos is not None and f.position <= pos]
        behind.append((at or before[-1:] or own[:1])[0])
    key = lambda f: (f.item_id, f.position)  # noqa: E731
    have = {key(f) for f in chosen}
    added = [f for f in behind if key(f) not in have]
    chosen += added
    behind_keys = {key(f) for f in behind}
    if added:
        note += f", plus {len(added)} behind changed answers or tool calls"
    if n_ties:
        note += f" ({n_ties} tie{'s' if n_ties != 1 else ''} at the reference " + ("branched too" if branch_ties else "not branched") + ")"
    left_out: list[Flip] = []
    if max_branches is not None and len(chosen) > max_branches:
        first = sorted((f for f in chosen if key(f) in behind_keys), key=lambda f: -f.kl_nats)
        rest = sorted((f for f in chosen if key(f) not in behind_keys), key=lambda f: -f.kl_nats)
        one_each = _first_per_item(rest, skip={f.item_id for f in first})
        once = {key(f) for f in one_each}
        ranked = first + one_each + [f for f in rest if key(f) not in once]
        chosen, left_out = ranked[:max_branches], ranked[max_branches:]
        note += (f", capped at --max-branches {max_branches} (kept: flips behind changed answers or tool calls, "
                 f"then one per item, then the highest KL; {len(left_out)} left out)")
    chosen.sort(key=lambda f: (f.item_id, f.position))
    left_out.sort(key=lambda f: (f.item_id, f.position))
    return chosen, note, left_out


# --------------------------------------------------------------------------------------------
# comparing two outputs


def _run(b: Sequence[int], r: Sequence[int], i: int, j: int, cap: int | None = None) -> int:
    """Length of the common run of ``b[i:]`` and ``r[j:]`` (stopping at ``cap`` when given)."""
    n = 0
    while i + n < len(b) and j + n < len(r) and b[i + n] == r[j + n] and (cap is None or n < cap):
        n += 1
    return n


@dataclass(frozen=True)
class Alignment:
    """How a branch's tail lines up with the reference's tail.

    Offsets count from the token after the flip (both tails start there). ``rejoin`` is the
    first aligned common run, ``left`` where the branch left the reference for good (None
    when it stayed joined to the end of the shorter tail), ``joined`` the tokens in common
    from the re-join on and ``remainder`` the length of the shorter tail (everything after
    the flip token), so ``joined / remainder`` is the joined share of the remainder: a
    branch that re-joins only for the last few tokens has a small one.
    """

    rejoin: tuple[int, int] | None
    left: tuple[int, int] | None = None
    joined: int = 0
    remainder: int = 0
    detours: int = 0

    @property
    def joined_share(self) -> float | None:
        if self.rejoin is None:
            return None
        return self.joined / self.remainder if self.remainder else 1.0  # nothing after the flip: all of it joined

    def stays_joined(self, min_share: float = MIN_JOINED_SHARE) -> bool:
        """Re-joined, never left for good, and joined for at least ``min_share`` of the
        remainder, or all but ``LOCAL_TOKENS`` of it: near the end of the budget (a tail of
        six tokens) a word's difference is a large share but still a local one."""
        return (self.rejoin is not None and self.left is None
                and ((self.joined_share or 0.0) >= min_share or self.remainder - self.joined <= LOCAL_TOKENS))


def _first_rejoin(b, r, min_run: int, max_shift: int, cut: bool = False) -> tuple[int, int] | None:
    """First branch offset where ``min_run`` tokens match the reference at most ``max_shift``
    tokens away; of several such reference offsets (repetitive text) the nearest. Where the
    budget cut both tails (``cut``), a shorter run that reaches the end of both will do: the
    budget left no room for ``min_run`` tokens (``retrieve`` | `` the supported`` against
    ``get`` | `` the supported``)."""
    for i in range(len(b)):
        lo, hi = max(0, i - max_shift), min(len(r) - 1, i + max_shift)
        for j in sorted(range(lo, hi + 1), key=lambda j: (abs(i - j), j)):
            if b[i] == r[j]:
                n = _run(b, r, i, j, cap=min_run)
                if n >= min_run or (cut and i + n == len(b) and j + n == len(r)):
                    return i, j
    return None


def _next_rejoin(b, r, i: int, j: int, min_run: int, max_shift: int, max_detour: int) -> tuple[int, int] | None:
    """After a mismatch at (i, j): the nearest aligned point within ``max_detour`` tokens on
    each side where the tails match again for ``min_run`` tokens or to the end of either."""
    best = None
    for i2 in range(i, min(len(b), i + max_detour + 1)):
        for j2 in range(max(j, i2 - max_shift), min(len(r), j + max_detour + 1, i2 + max_shift + 1)):
            if b[i2] != r[j2]:
                continue
            n = _run(b, r, i2, j2, cap=min_run)
            if n >= min_run or i2 + n == len(b) or j2 + n == len(r):
                key = ((i2 - i) + (j2 - j), abs(i2 - j2))
                if best is None or key < best[0]:
                    best = (key, (i2, j2))
    return None if best is None else best[1]


def align(
    ref_tail: Sequence[int],
    branch_tail: Sequence[int],
    *,
    min_run: int = MIN_RUN,
    max_shift: int = MAX_SHIFT,
    max_detour: int = MAX_DETOUR,
    end_ids: Sequence[int] = (),
) -> Alignment:
    """Where the branch re-joins the reference, whether it stays, and where it leaves again.

    A re-join is a run of ``min_run`` common tokens whose offsets in the branch and the
    reference differ by at most ``max_shift`` (a run matching text from far elsewhere, as
    every ``#\\n`` of a repetitive tail does, is not a re-join). From there the tails are
    walked side by side; at a mismatch the branch may take a short detour: it must match
    again (aligned, ``min_run`` tokens or to the end of either tail) within ``max_detour``
    tokens on each side. A detour that runs into the end of both budgets (no end token on
    either side) is cut short, not a departure. Otherwise the branch left for good there.
    """
    b, r = list(branch_tail), list(ref_tail)
    ends = set(end_ids)
    # neither output stopped (known only when the end tokens are): the budget cut both
    cut = bool(ends) and not ends.intersection(b + r)
    if cut and not b and not r:
        # the flip token was the last one both budgets allowed: nothing after it differs
        return Alignment((0, 0), None, 0, 0, 0)
    start = _first_rejoin(b, r, min_run, max_shift, cut)
    if start is None:
        return Alignment(None)
    i, j = start
    remainder = min(len(b), len(r))
    joined = detours = 0
    left = None
    while i < len(b) and j < len(r):
        if b[i] == r[j]:
            joined += 1
            i += 1
            j += 1
            continue
        nxt = _next_rejoin(b, r, i, j, min_run, max_shift, max_detour)
        if nxt is None:
            cut_short = min(len(b) - i, len(r) - j) <= max_detour and not ends.intersection(b[i:] + r[j:])
            if not cut_short:
                left = (i, j)
            break
        detours += 1
        i, j = nxt
    return Alignment(start, left, joined, remainder, detours)


def numbers_agree(ref_text: str, branch_text: str, ref_cut: bool = False, branch_cut: bool = False) -> bool:
    """The numbers of both texts agree, in order, on both full sides: a number added,
    missing or changed is a disagreement, except past the end of a text cut by the token
    budget (the other may go on there; a cut text may end inside its last number, which is
    left out) and lines skipped right after the flip (a pure shift, :mod:`logitdiff.flips.salient`)."""
    return not salient.compare(ref_text, branch_text, code=False, ref_cut=ref_cut, branch_cut=branch_cut,
                               kinds=("number",), start=_divergence(ref_text, branch_text))["changed"]


def _divergence(a: str, b: str) -> int:
    """Character offset of the start of the word where two texts first differ (their shared
    prefix would only add equal parts, and would hide where a shift starts)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    while n > 0 and (a[n - 1].isalnum() or a[n - 1] in "_."):
        n -= 1
    return n


def end_ratio(ref_continuation: str, branch_continuation: str) -> float:
    """difflib ratio of the last thirds of two continuations: do they end alike?"""
    from difflib import SequenceMatcher

    a = ref_continuation[2 * len(ref_continuation) // 3 :]
    b = branch_continuation[2 * len(branch_continuation) // 3 :]
    return SequenceMatcher(None, a, b, autojunk=False).ratio()


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
    min_run: int = MIN_RUN,
    max_shift: int = MAX_SHIFT,
    max_detour: int = MAX_DETOUR,
    end_ids: Sequence[int] = (),
    end_similarity: float | None = None,
    exec_check: Callable[[list, list], dict] | None = None,
    code: bool = False,
    word_similarity: Callable | None = None,
) -> tuple[str, dict]:
    """Outcome of one branch and the signals that decided it, by rules anyone can re-run:
    the token alignment (:func:`align`) and, where the item has one, its checker (tool-call
    parse and schema, an answer label, a BFCL label, the item's tests). Meaning is never
    judged here: an unlabelled text that did not come back is ``diverged`` (a named judge,
    ``--judge``, may turn it into benign / meaning_changed).

    ``ref_ids``/``branch_ids`` are whole outputs (token ids after the prompt, with the end
    token when the model stopped) that agree before ``position``; ``ref_text``/``branch_text``
    their decoded text without the end token. ``similarity`` / ``threshold``,
    ``end_similarity`` (:func:`end_ratio` of the continuations, on character-scored text),
    ``code`` and ``word_similarity`` feed the *observations* recorded on a diverged or
    recovered unlabelled branch (salient differences, :mod:`logitdiff.flips.salient`, and the
    similarity), never its class. ``exec_check(ref_calls, branch_calls)`` runs both calls
    (optional).
    """
    t = position
    sig: dict[str, Any] = {"similarity": float(similarity), "similarity_threshold": threshold,
                           "end_similarity": end_similarity}
    al = align(ref_ids[t + 1 :], branch_ids[t + 1 :], min_run=min_run, max_shift=max_shift, max_detour=max_detour, end_ids=end_ids)
    sig["rejoin_position"] = None if al.rejoin is None else t + 1 + al.rejoin[0]
    sig["rejoin_ref_position"] = None if al.rejoin is None else t + 1 + al.rejoin[1]
    sig["left_position"] = None if al.left is None else t + 1 + al.left[0]
    sig["left_ref_position"] = None if al.left is None else t + 1 + al.left[1]
    sig["joined_share"] = al.joined_share
    sig["detours"] = al.detours
    tools = item.get("tools") or []
    expected = item.get("expected") or {}
    same: bool | None = None
    checker = ""
    if tools:
        decided, same = _tool_calls_step(ref_text, branch_text, tools, exec_check, sig)
        if decided is not None:
            return decided, sig
        checker = "tool call" if same is not None else ""
    if same is None and expected:
        same, checker = _answer_step(expected, tools, item.get("prompt") or "", ref_text, branch_text, sig)
    sig["same_answer"] = same
    sig["checker"] = checker or None
    if same is None:
        _observe(ref_ids, branch_ids, ref_text, branch_text, end_ids, code, word_similarity, sig)
    return _decide(al, sig, same=same, checker=checker, ends=end_ids, branch_ids=branch_ids, position=t, min_run=min_run), sig


def _tool_calls_step(ref_text: str, branch_text: str, tools: list, exec_check: Callable[[list, list], dict] | None,
                     sig: dict[str, Any]) -> tuple[str | None, bool | None]:
    """An item with tools: the two outputs' tool calls. Returns (the outcome when the calls
    decide it, else None; whether the answers are the same, None when the calls say nothing)."""
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
            return Outcome.TOOL_CALL_MALFORMED, None
        cmp = compare_calls(pb.calls, pr.calls, tools)
        sig["call_differences"] = cmp.reasons
        if exec_check is not None:
            sig["exec"] = exec_check(pr.calls, pb.calls)
        if not cmp.equal:
            sig["decided_by"] = "valid call, different: " + cmp.reasons[0]
            return Outcome.TOOL_CALL_CHANGED, None
        return None, True
    if pb.attempted:
        # The reference made no valid call; the branch's call is a behaviour change.
        return None, pr.ok and pb.ok and compare_calls(pb.calls, pr.calls, tools).equal
    return None, None


def _answer_step(expected: dict, tools: list, prompt: str, ref_text: str, branch_text: str,
                 sig: dict[str, Any]) -> tuple[bool | None, str]:
    """The item's checker on both outputs, where the tool calls did not decide: (whether its
    verdicts are the same, None where the label has no checker; which checker). A ``tests``
    label runs both programs in the sandbox and records both verdicts."""
    if "tests" in expected:
        gr, gb = grade_tests(expected["tests"], prompt, ref_text), grade_tests(expected["tests"], prompt, branch_text)
        sig["ref_tests"], sig["branch_tests"] = gr.extracted, gb.extracted
        sig["branch_tests_detail"] = gb.detail
        return gr.extracted == gb.extracted, "tests"
    if "bfcl" in expected:
        gr, gb = grade(expected, ref_text, tools, prompt=prompt), grade(expected, branch_text, tools, prompt=prompt)
        sig["ref_verdict"], sig["branch_verdict"] = gr.verdict, gb.verdict
        sig["branch_verdict_detail"] = gb.detail
        return gr.correct == gb.correct, "BFCL's checker"
    if "answer" in expected or "numeric" in expected or "regex" in expected:
        key_r, key_b = _answer_key(expected, ref_text), _answer_key(expected, branch_text)
        sig["ref_answer"], sig["branch_answer"] = key_r, key_b
        return key_r == key_b, "the label's extracted answer"
    if "tool_call" in expected or "tool_calls" in expected:
        gr, gb = grade(expected, ref_text, tools), grade(expected, branch_text, tools)
        sig["ref_answer"], sig["branch_answer"] = gr.extracted, gb.extracted
        return gr.extracted == gb.extracted, "the label's tool call"
    return None, ""


def _observe(ref_ids: Sequence[int], branch_ids: Sequence[int], ref_text: str, branch_text: str, end_ids: Sequence[int],
             code: bool, word_similarity: Callable | None, sig: dict[str, Any]) -> None:
    """What an unlabelled branch shows beside the alignment, recorded as observations (never
    a verdict on its meaning): the salient differences (:mod:`logitdiff.flips.salient`:
    numbers, names, literals, negations, content words) and whether the branch is word salad
    or a pure shift."""
    ends = set(end_ids)
    sal = salient.compare(ref_text, branch_text, code=code, ref_cut=not (ref_ids and ref_ids[-1] in ends),
                          branch_cut=not (branch_ids and branch_ids[-1] in ends),
                          start=_divergence(ref_text, branch_text), word_similarity=word_similarity)
    sig["salient_changes"] = sal["changed"]
    sig["shifted"] = sal["shifted"]
    sig["content_share"] = sal["content_share"]
    sig["word_salad"] = sal.get("word_salad", False)


def _observations(sig: dict[str, Any]) -> str:
    """The observations of an unlabelled branch in words: salient differences, similarity."""
    parts = []
    changes = sig.get("salient_changes")
    if changes is not None:
        more = f" (+{len(changes) - 3} more)" if len(changes) > 3 else ""
        parts.append("salient differences observed: " + ("; ".join(changes[:3]) + more if changes else "none"))
    if sig.get("shifted"):
        parts.append("whole lines of the reference skipped after the flip")
    sim, thr = sig["similarity"], sig["similarity_threshold"]
    parts.append(f"similarity {sim:.3f} (threshold {thr:g}, not used to decide)")
    end = sig.get("end_similarity")
    if end is not None:
        parts.append(f"last thirds {end:.2f} alike")
    return ", ".join(parts)


def _decide(al: Alignment, sig: dict[str, Any], *, same: bool | None, checker: str, ends: Sequence[int],
            branch_ids: Sequence[int], position: int, min_run: int = MIN_RUN) -> str:
    """The outcome from what the steps found (sets ``decided_by``): recovered when the branch
    re-joined and stayed and the checker (where there is one) gives the same verdict; else
    the checker's verdict (answer same / changed, tests passed / failed); else diverged."""
    after = None if al.rejoin is None else al.rejoin[0] + 1
    rejoin = f"re-joined the reference {after} token{'s' if after != 1 else ''} after the flip" if after is not None else ""
    if al.rejoin is None:
        stopped = position < len(branch_ids) and branch_ids[position] in set(ends)
        how = "stopped at the flip where the reference goes on" if stopped else "no aligned re-join"
    elif al.left is not None:
        how = f"{rejoin}, left again {al.left[0] - al.rejoin[0]} tokens later"
    elif not al.stays_joined():
        how = f"{rejoin}, only {100 * (al.joined_share or 0):.0f} % joined"
    elif al.joined < min_run:
        # a flip near the end of both budgets: too few tokens after it to see the reference's
        # text come back (a reader shown it sees a different last word, not a return)
        how = f"{rejoin}, but only {al.joined} token{'s' if al.joined != 1 else ''} joined before the budget ended"
    else:
        share = f"{100 * (al.joined_share or 0.0):.0f} %"  # stays: re-joined, so a share (never the 0)
        detours = f", {al.detours} short detour{'s' if al.detours != 1 else ''}" if al.detours else ""
        how = f"{rejoin} and stayed ({share} joined{detours})"
    # Word salad (salient.is_word_salad) says what it says by which of its few words it uses:
    # re-joined salad with a content word on one side only keeps re-writing the reference with
    # another word, which a blind reader does not call the reference's text coming back
    # (docs/flips.md, "Recovered, checked by a reader": 3 of the 33 recovered branches, all such).
    salad_changed = not checker and bool(sig.get("word_salad")) and bool(sig.get("salient_changes"))
    if salad_changed and al.stays_joined() and al.joined >= min_run:
        how += ", but in word salad with a content word on one side only"
    verdict = _checker_words(sig, same, checker)
    if al.stays_joined() and al.joined >= min_run and same is not False and not salad_changed:
        sig["decided_by"] = f"{how}; " + (verdict if checker else _observations(sig))
        return Outcome.RECOVERED
    if not checker:
        sig["decided_by"] = f"{how}; meaning not judged; " + _observations(sig)
        return Outcome.DIVERGED
    sig["decided_by"] = f"{how}; {verdict}"
    if checker == "tests":
        return Outcome.TESTS_PASSED if sig.get("branch_tests") == "pass" else Outcome.TESTS_FAILED
    return Outcome.ANSWER_SAME if same else Outcome.ANSWER_CHANGED


def _checker_words(sig: dict[str, Any], same: bool | None, checker: str) -> str:
    """What the item's checker said on both outputs, in words."""
    if checker == "tests":
        return f"the item's tests: branch {sig['branch_tests']}, reference {sig['ref_tests']}"
    if checker == "BFCL's checker":
        return f"BFCL's checker: branch {sig['branch_verdict']}, reference {sig['ref_verdict']}"
    if checker == "tool call":
        return "the same tool call" if same else "a tool call where the reference made no valid one, or another"
    if checker:
        return f"{checker}: " + ("the same" if same else f"{sig.get('ref_answer')!r} -> {sig.get('branch_answer')!r}")
    return ""


# --------------------------------------------------------------------------------------------
# summaries


def margin_bucket(m: float) -> str:
    for a, b in zip(MARGIN_BUCKETS, MARGIN_BUCKETS[1:]):
        if a <= m < b:
            return f"[{a:g},{min(b, 1.0):g}" + ("]" if b > 1 else ")")
    return "n/a"


def reported_outcomes(rows: Sequence[dict]) -> tuple[str, ...]:
    """The outcomes a summary counts: every rule-decided one (Outcome.RULE, zero or not) and a
    judge's (benign / meaning_changed) only where a judge gave one: a report without a judge
    names neither."""
    judged = {r.get(k) for r in rows for k in ("outcome", "outcome_ref_from_cand_token")} & set(Outcome.JUDGED)
    return tuple(o for o in Outcome.ALL if o in Outcome.RULE or o in judged)


def _counts(rows: list[dict], key: Callable[[dict], Any], outcomes: Sequence[str]) -> dict:
    out: dict[str, dict] = {}
    for r in rows:
        for k in key(r):
            d = out.setdefault(k, {o: 0 for o in outcomes} | {"n": 0})
            d[r["outcome"]] += 1
            d["n"] += 1
    for d in out.values():
        d["rates"] = {o: d[o] / d["n"] for o in outcomes}
    return dict(sorted(out.items()))


# The fields of a branch that report.json carries for the page (every field is in flips.parquet).
SHOWN_FIELDS = (
    "item_id", "position", "outcome", "kl_nats", "margin_ref", "p_ref", "p_cand", "tie",
    "ref_token", "cand_token", "ref_continuation", "branch_continuation", "decided_by",
    "similarity", "similarity_kind", "joined_share", "end_ratio",
    "rejoin_position", "rejoin_ref_position", "left_position", "left_ref_position", "marks",
    "judge_verdict", "judge_raw",  # --judge (flips/judge.py): only on judged branches
)


def _shown(r: dict) -> dict:
    return {k: r[k] for k in SHOWN_FIELDS if k in r}


def summarize_branches(
    rows: list[dict],
    *,
    n_flips: int,
    n_positions: int,
    note: str,
    similarity_name: str,
    ranges: Sequence[int],
    settings: dict,
    ties: Sequence[dict] = (),
    n_top: int = 10,
    n_examples: int = 3,
    judge: str | None = None,
) -> Flips:
    """The ``flips`` section of report.json.

    ``rows`` are the branches; rows of ties (``tie`` true, branched only on request) are
    reported under ``ties`` and kept out of the outcome counts, rates and groups, which are
    what gates read. ``ties`` lists every tie (branched or not). ``top`` is the ``n_top``
    most consequential branches followed by up to ``n_examples`` more of each outcome, so
    that every class shows examples on the page. ``judge``: the named judge that turned
    diverged branches into benign / meaning_changed (``--judge``), None when none did (the
    section then says the meaning of a diverged branch was not judged).
    """
    tie_rows = [r for r in rows if r.get("tie")]
    rows = [r for r in rows if not r.get("tie")]
    n = len(rows)
    names = reported_outcomes(rows + tie_rows)
    outcomes = {o: sum(r["outcome"] == o for r in rows) for o in names}
    rank = lambda r: (-SEVERITY[r["outcome"]], -r["kl_nats"])  # noqa: E731
    ranked = sorted(rows, key=rank)
    top = ranked[:n_top]
    for o in names:
        top += [r for r in ranked if r["outcome"] == o and r not in top][: max(0, n_examples - sum(t["outcome"] == o for t in top))]
    top.sort(key=rank)
    rec = [r for r in rows if r["outcome"] == Outcome.RECOVERED and r.get("end_ratio") is not None]
    sec: Flips = {
        "n_flips": n_flips,
        "flip_rate": (n_flips / n_positions) if n_positions else None,
        "n_ties": len(ties),
        "n_branches": n,
        "selection": note,
        "similarity": similarity_name,
        "meaning_judged_by": judge,
        "settings": settings,
        "outcomes": outcomes,
        "rates": {o: (c / n if n else None) for o, c in outcomes.items()},
        "recovered_ending_dissimilar": sum(r["end_ratio"] < END_RATIO_DISSIMILAR for r in rec),
        "by_tag": _counts(rows, lambda r: r["tags"] or ["(untagged)"], names),
        "by_range": _counts(rows, lambda r: [range_label(r["position"], ranges)], names),
        "by_margin": _counts(rows, lambda r: [margin_bucket(r["margin_ref"])], names),
        "top": [_shown(r) for r in top],
        "ties": {
            "tolerance": "reference margin <= the bf16 spacing at p(top1), 2^(floor(log2 p) - 7)",
            "n_branched": len(tie_rows),
            "outcomes": {o: sum(r["outcome"] == o for r in tie_rows) for o in names},
            "list": [dict(t) for t in ties[:100]],  # n_ties counts them all
        },
    }
    if any("outcome_ref_from_cand_token" in r for r in rows):
        both = [r for r in rows if r.get("outcome_ref_from_cand_token")]
        bad = Outcome.BAD
        sec["both"] = {
            "outcomes_ref_from_cand_token": {o: sum(r["outcome_ref_from_cand_token"] == o for r in both) for o in names},
            "token_was_poison": sum(r["outcome"] in bad and r["outcome_ref_from_cand_token"] in bad for r in both),
            "candidate_drifts_anyway": sum(r["outcome"] in bad and r["outcome_ref_from_cand_token"] not in bad for r in both),
        }
    return sec
