"""Drive flips and correctness for one comparison: generate, grade, classify, summarise.

Inputs are the reference RUN (prompts, teacher ids, the workload items), the per-position
columns of a comparison (``tokens.parquet`` or a live :class:`~logitdiff.compare.Comparison`)
and an open candidate source. Outputs are plain dicts/rows: the ``flips`` and
``correctness`` sections of report.json and the rows of ``flips.parquet`` and
``correctness.parquet``. Writing files is left to the caller (report/ and cli).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypedDict

import numpy as np

from ..capture import DEFAULT_MAX_TOKENS
from ..contracts import AnswerChange, Attribution, AttributedBranch, Correctness, FirstFlip, Flips, Measure, MethodKind, Report, \
    attributed_counts
from ..defaults import DEFAULT_MAX_BRANCHES  # noqa: F401 (re-exported)
from ..errors import LogitdiffError
from ..contracts import CallVerdict, PromptForm, ToolForm, Verdict
from . import MAX_DETOUR, MAX_SHIFT, MIN_RUN, Flip, classify, end_ratio, find_flips, reference_self_consistency, select_flips, summarize_branches
from .grading import SimilarityPolicy, call_verdict, check_expected, grade, mcnemar_exact, paired_diff_ci, wilson_ci
from .salient import is_code
from ..sources import Source
from ..store import RunItem, RunReader, first_difference
from ..numerics.summarize import DEFAULT_RANGES

from .toolcalls import ToolCall
from ..workload.benchmarks import benchmark_of
from ..workload.items import check_tools_once

if TYPE_CHECKING:
    from ..report.gates import Gate
    from .judge import Judge


class _Rejoin(TypedDict):
    """The re-join settings of flips.classify (its keywords)."""

    min_run: int
    max_shift: int
    max_detour: int
    end_ids: Sequence[int]


class _Sections(TypedDict, total=False):
    """The report sections analyse adds."""

    flips: Flips
    correctness: Correctness


@dataclass
class ReportFlips:
    """What ``analyse_report_dir`` gives its caller to write: the report with its flips and
    correctness sections (and gates), the comparison's columns (for the page), the files to
    add beside it (flips.parquet, correctness.parquet) and the ones an earlier run left that
    no longer belong (``remove``)."""

    report: Report
    columns: dict[str, np.ndarray]
    files: dict[str, bytes]
    remove: list[str]


@dataclass
class Settings:
    select: str = "first"
    max_branches: int | None = DEFAULT_MAX_BRANCHES
    max_tokens: int | None = None  # branch budget; default: what is left of the item's
    both: bool = False
    resync: int = MIN_RUN
    max_shift: int = MAX_SHIFT
    max_detour: int = MAX_DETOUR
    branch_ties: bool = False
    seed: int = 0
    exec_timeout: float = 5.0
    n_boot: int = 2000
    ranges: Sequence[int] = DEFAULT_RANGES


def _item_json(it: RunItem) -> dict:
    return dict(it.extra.get("item") or {"id": it.id, "tags": it.tags})


def _budget(reader: RunReader, it: RunItem) -> int:
    """The generation budget the reference had for this item."""
    mt = (reader.manifest.get("settings") or {}).get("max_tokens")
    return int(mt or _item_json(it).get("max_tokens") or DEFAULT_MAX_TOKENS)


def hit_budget(ids: Sequence[int], budget: int, eos: set[int]) -> bool:
    """The output used its whole token budget without an end token: cut, not finished."""
    return len(ids) >= budget and not (ids and ids[-1] in eos)


def changed_items(rows: Sequence[dict]) -> dict[str, tuple[str, int | None]]:
    """Items whose graded answer or tool-call verdict differs between the free-running
    outputs (correctness rows): item -> (what changed, where the outputs first differ)."""
    out: dict[str, tuple[str, int | None]] = {}
    for r in rows:
        change = None
        if r.get("ref_verdict") != r.get("cand_verdict"):
            change = f"answer {r.get('ref_verdict')} -> {r.get('cand_verdict')}"
        elif r.get("ref_tool_call") != r.get("cand_tool_call"):
            change = f"tool call {r.get('ref_tool_call')} -> {r.get('cand_tool_call')}"
        if change:
            out[r["item_id"]] = (change, r.get("first_divergence"))
    return out


def _strip_end(ids: Sequence[int], eos: set[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


_MODULES_IMPORTED: set[str] = set()


def check_items(items: Sequence[RunItem], exec_timeout: float = 10.0) -> None:
    """Tools must be valid JSON Schema, labels must name a known check and tools modules
    must import (sandboxed, within the timeout): fail before any work."""
    modules = set()
    for it in items:
        d = _item_json(it)
        where = f"item {it.id!r}"
        if d.get("tools"):
            check_tools_once(d["tools"], where)
        if d.get("expected") is not None:
            check_expected(d["expected"], where)
        if d.get("tools_module"):
            modules.add(d["tools_module"])
    # Each module is imported (in a sandboxed subprocess) once per process, not once per
    # candidate and step: `run` checks the same reference items for every candidate.
    todo = sorted(modules - _MODULES_IMPORTED)
    if todo:
        from .sandbox import load_check

        for m in todo:
            load_check(m, timeout=exec_timeout)
            _MODULES_IMPORTED.add(m)


def exec_checker(item: dict, timeout: float) -> Callable | None:
    mod = item.get("tools_module")
    if not mod:
        return None
    from .sandbox import compare_results, execute_calls

    def run(ref_calls: list[ToolCall], branch_calls: list[ToolCall]) -> dict:
        a = execute_calls(mod, ref_calls, timeout=timeout)
        b = execute_calls(mod, branch_calls, timeout=timeout)
        same, reasons = compare_results(a, b)
        return {
            "same_result": same,
            "reasons": reasons,
            "ref": [{"ok": r.ok, "value": r.value, "error": r.error, "timed_out": r.timed_out} for r in a],
            "branch": [{"ok": r.ok, "value": r.value, "error": r.error, "timed_out": r.timed_out} for r in b],
            "containment": next((r.containment for r in a + b if r.containment), None),  # what held the tool processes
        }

    return run


# --------------------------------------------------------------------------------------------
# flips


def _char_offset(text_of: Callable[[Sequence[int]], str], ids: Sequence[int], n: int | None, whole: str) -> int | None:
    """Characters of ``whole`` (the decoded ``ids``) covered by its first ``n`` tokens."""
    if n is None:
        return None
    return min(len(text_of(ids[:n])), len(whole))


@dataclass
class FlipRun:
    """What branching did (:func:`branch_flips`): the flips section, one row per branch, every
    flip of the comparison (ties included), and the flips selected and left out by the cap."""

    section: Flips
    rows: list[dict[str, Any]]
    all_flips: list[Flip]
    chosen: list[Flip]
    left_out: list[Flip]


def all_flips_of(items: Sequence[RunItem], columns: dict) -> list[Flip]:
    """Every flip of a comparison (flips.find_flips, ties flagged), the reference's items
    giving tags and the written (teacher) tokens."""
    teacher_of: dict[str, Sequence[int]] = {it.id: it.teacher_ids for it in items}
    return find_flips(columns, {it.id: it.tags for it in items}, teacher_of)


def run_flips(source: Source, ref: RunReader, columns: dict, similarity: SimilarityPolicy, settings: Settings,
              **kw: Any) -> tuple[Flips, list[dict[str, Any]]]:
    """Branch at the selected flips; return the report section and one row per branch
    (:func:`branch_flips`, its keywords)."""
    done = branch_flips(source, ref, columns, similarity, settings, **kw)
    return done.section, done.rows


def branch_flips(
    source: Source,
    ref: RunReader,
    columns: dict,
    similarity: SimilarityPolicy,
    settings: Settings,
    *,
    reference_source: Source | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    changed: dict[str, tuple[str, int | None]] | None = None,
    judge: Judge | None = None,
) -> FlipRun:
    """Branch at the selected flips: the report section, one row per branch and the flips.

    ``changed`` (:func:`changed_items`, from the correctness rows) names the items whose
    answer or tool call changed: the flip behind each is always selected and ranked first
    under the cap, and the section lists each with the branch taken or why none was."""
    items = {it.id: it for it in ref.items()}
    check_items(list(items.values()), settings.exec_timeout)
    if settings.both and reference_source is None:
        raise LogitdiffError("--both needs the reference as a source (pass --reference SPEC)")
    all_flips = all_flips_of(list(items.values()), columns)
    teacher_of: dict[str, Sequence[int]] = {i: it.teacher_ids for i, it in items.items()}
    changed = changed or {}
    chosen, note, left_out = select_flips(all_flips, settings.select, settings.max_branches, settings.seed, settings.branch_ties,
                                          priority={i: pos for i, (_, pos) in changed.items()})
    if on_total:
        on_total(len(chosen))
    eos = set(source.eos_token_ids) | set((ref.manifest.get("source") or {}).get("identity", {}).get("eos_token_ids") or [])
    pending = _generate_branches(source, ref, items, chosen, settings, eos, reference_source, progress)
    rows = _classify_branches(source, ref, pending, similarity, settings, eos)
    if judge is not None:  # --judge: the diverged branches' meaning, by a named judge (flips/judge.py)
        from .judge import judge_branches

        rows = judge_branches(rows, judge, [source.detokenize(b.item.teacher_ids[: b.flip.position]) for b in pending])
    ties = [
        {"item_id": f.item_id, "position": f.position, "margin_ref": f.margin_ref, "p_ref": f.p_ref,
         "ref_token": source.token_text(f.ref_token_id), "cand_token": source.token_text(f.cand_token_id)}
        for f in all_flips if f.tie
    ]
    n_pos = len(columns["position"])
    section = summarize_branches(
        rows, n_flips=sum(not f.tie for f in all_flips), n_positions=n_pos, note=note, similarity_name=similarity.name,
        ranges=settings.ranges, ties=ties, judge=judge.spec if judge is not None else None,
        settings={"select": settings.select, "max_branches": settings.max_branches, "max_tokens": settings.max_tokens,
                  "resync_tokens": settings.resync, "max_shift": settings.max_shift, "max_detour": settings.max_detour,
                  "similarity_thresholds": similarity.thresholds, "both": settings.both, "branch_ties": settings.branch_ties},
    )
    section["reference_self_consistency"] = reference_self_consistency(columns, teacher_of, source.token_text)
    if judge is not None:
        section["judge"] = judge.section(rows)
    section["left_out"] = {
        "n": len(left_out), "n_items": len({f.item_id for f in left_out}),
        "list": [{"item_id": f.item_id, "position": f.position, "kl_nats": f.kl_nats, "margin_ref": f.margin_ref}
                 for f in left_out[:100]],
    }
    section["changed_items"] = _changed_items_listed(changed, rows, all_flips, settings)
    section["outputs_cut"] = {
        "n_items": len(items),
        "reference_cut": sum(hit_budget(it.teacher_ids, _budget(ref, it), eos) for it in items.values()),
        "n_branches": len(rows),
        "branches_cut": sum(bool(r["branch_cut"]) for r in rows),
    }
    return FlipRun(section, rows, all_flips, chosen, left_out)


@dataclass
class _Branch:
    """One flip branched: the reference's output and the candidate's branch from the flip
    token on (``alt``: the reference's own continuation from it, ``--both``)."""

    flip: Flip
    item: RunItem
    ref_out: list[int]
    branch: list[int]
    alt: list[int] | None


def _generate_branches(source: Source, ref: RunReader, items: dict[str, RunItem], chosen: Sequence[Flip], settings: Settings,
                       eos: set[int], reference_source: Source | None,
                       progress: Callable[[int], None] | None) -> list[_Branch]:
    """Each chosen flip continued by the candidate (and by the reference, ``--both``) from
    ``prompt + teacher[:t] + candidate token``, within what is left of the item's budget."""
    pending: list[_Branch] = []
    for f in chosen:
        it = items.get(f.item_id)
        if it is None:
            raise LogitdiffError(f"{ref.path}: flip at item {f.item_id!r} is not in the reference run")
        t = f.position
        teacher = list(it.teacher_ids)
        if t >= len(teacher):
            raise LogitdiffError(
                f"{ref.path}: item {f.item_id!r} has {len(teacher)} teacher tokens, the report flips at output "
                f"position {t}; report and run do not belong together"
            )
        # The teacher is the reference's greedy (incremental) output, the distributions come
        # from one prefill: in low precision the two can pick different near-tied winners, so
        # teacher[t] need not be top1_ref. The control is always the teacher.
        left = _budget(ref, it) - t - 1
        if settings.max_tokens is not None:
            left = min(left, settings.max_tokens)
        prefix = list(it.prompt_ids) + teacher[:t] + [f.cand_token_id]
        cont = [] if f.cand_token_id in eos or left <= 0 else source.generate(prefix, left).token_ids
        branch = teacher[:t] + [f.cand_token_id] + list(cont)
        ref_out = teacher[: t + 1 + max(left, 0)]
        alt = None
        if settings.both and reference_source is not None:  # (--both without it was refused by run_flips)
            alt_cont = [] if f.cand_token_id in eos or left <= 0 else reference_source.generate(prefix, left).token_ids
            alt = teacher[:t] + [f.cand_token_id] + list(alt_cont)
        pending.append(_Branch(f, it, ref_out, branch, alt))
        if progress:
            progress(1)
    return pending


def _classify_branches(source: Source, ref: RunReader, pending: list[_Branch], similarity: SimilarityPolicy,
                       settings: Settings, eos: set[int]) -> list[dict[str, Any]]:
    """One flips.parquet row per branch: the continuations as text, their similarity
    (scored in one batch) and the outcome ``classify`` gives."""
    def text(ids):
        return source.detokenize(_strip_end(ids, eos))

    ref_tails = [text(b.ref_out[b.flip.position:]) for b in pending]
    br_tails = [text(b.branch[b.flip.position:]) for b in pending]
    alt_tails = [text(b.alt[b.flip.position:]) if b.alt is not None else "" for b in pending]
    tags = [list(b.flip.tags) for b in pending]
    sims = similarity.score(tags, ref_tails, br_tails)
    alt_sims = similarity.score(tags, ref_tails, alt_tails) if settings.both else None
    rejoin_args = _Rejoin(min_run=settings.resync, max_shift=settings.max_shift, max_detour=settings.max_detour, end_ids=sorted(eos))
    rows = []
    for k, b in enumerate(pending):
        f, t = b.flip, b.flip.position
        item = _item_json(b.item)
        ref_text = text(b.ref_out)
        score, sim = sims[k]
        ends = end_ratio(ref_tails[k], br_tails[k])
        outcome, sig = classify(
            item=item, ref_ids=b.ref_out, branch_ids=b.branch, position=t, ref_text=ref_text,
            branch_text=text(b.branch), similarity=score, threshold=sim.threshold,
            end_similarity=ends if sim.kind == "edit" else None,
            exec_check=exec_checker(item, settings.exec_timeout), code=is_code(f.tags, ref_tails[k]),
            word_similarity=similarity.word_similarity, **rejoin_args,
        )
        row = _branch_row(source, ref, b, outcome, sig, score, sim, ends, ref_tails[k], br_tails[k], text, eos)
        if b.alt is not None and alt_sims is not None:
            a_score, a_sim = alt_sims[k]
            o2, s2 = classify(
                item=item, ref_ids=b.ref_out, branch_ids=b.alt, position=t, ref_text=ref_text,
                branch_text=text(b.alt), similarity=a_score, threshold=a_sim.threshold,
                end_similarity=end_ratio(ref_tails[k], alt_tails[k]) if a_sim.kind == "edit" else None,
                code=is_code(f.tags, ref_tails[k]), word_similarity=similarity.word_similarity, **rejoin_args,
            )
            row["outcome_ref_from_cand_token"] = o2
            row["ref_from_cand_continuation"] = alt_tails[k]
        rows.append(row)
    return rows


def _branch_row(source: Source, ref: RunReader, b: _Branch, outcome: str, sig: dict[str, Any], score: float, sim: Any,
                ends: float, ref_tail: str, br_tail: str, text: Callable[[Sequence[int]], str], eos: set[int]) -> dict[str, Any]:
    """A branch's flips.parquet row: the flip, the outcome and the signals behind it, the
    continuations, and where the page marks them."""
    f, t = b.flip, b.flip.position
    # Where the flip token ends, the branch re-joined and left again, in characters of
    # both continuations (from the flip on): the page highlights them.
    r_ids, b_ids = b.ref_out[t:], b.branch[t:]
    marks = {
        "ref": [_char_offset(text, r_ids, n, ref_tail) for n in (
            1, None if sig["rejoin_ref_position"] is None else sig["rejoin_ref_position"] - t,
            None if sig["left_ref_position"] is None else sig["left_ref_position"] - t)],
        "branch": [_char_offset(text, b_ids, n, br_tail) for n in (
            1, None if sig["rejoin_position"] is None else sig["rejoin_position"] - t,
            None if sig["left_position"] is None else sig["left_position"] - t)],
    }
    return {
        "item_id": f.item_id,
        "tags": list(f.tags),
        "position": t,
        "ref_token_id": f.ref_token_id,
        "cand_token_id": f.cand_token_id,
        "ref_token": source.token_text(f.ref_token_id),
        "cand_token": source.token_text(f.cand_token_id),
        "p_ref": f.p_ref,
        "p_cand": f.p_cand,
        "margin_ref": f.margin_ref,
        "tie": f.tie,
        "kl_nats": f.kl_nats,
        "outcome": outcome,
        "decided_by": sig.get("decided_by", ""),
        "similarity": score,
        "similarity_kind": sim.kind,
        "similarity_threshold": sim.threshold,
        "rejoin_position": sig["rejoin_position"],
        "rejoin_ref_position": sig["rejoin_ref_position"],
        "joined_share": sig["joined_share"],
        "left_position": sig["left_position"],
        "left_ref_position": sig["left_ref_position"],
        "end_ratio": ends,
        "ref_continuation": ref_tail,
        "branch_continuation": br_tail,
        "marks": json.dumps(marks),
        "branch_tokens": len(b.branch) - t,
        # both outputs have the item's budget: one that used it all without an end token was cut
        "ref_cut": hit_budget(b.ref_out, _budget(ref, b.item), eos),
        "branch_cut": hit_budget(b.branch, _budget(ref, b.item), eos),
        "signals": json.dumps(sig, sort_keys=True, default=str),
    }


def _changed_items_listed(changed: dict[str, tuple[str, int | None]], rows: list[dict[str, Any]], all_flips: Sequence[Flip],
                          settings: Settings) -> list[dict[str, Any]]:
    """Each item whose answer or tool call changed, with the branch taken at its flip, or
    why none was (no flip, only ties, the cap)."""
    by_item: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_item.setdefault(r["item_id"], []).append(r)
    flips_of: dict[str, list[Flip]] = {}
    for f in all_flips:
        flips_of.setdefault(f.item_id, []).append(f)
    listed = []
    for iid, (change, pos) in sorted(changed.items()):
        got = by_item.get(iid)
        if got:
            b = next((r for r in got if r["position"] == pos), got[0])
            listed.append({"item_id": iid, "change": change, "branched": True, "position": b["position"], "outcome": b["outcome"],
                           "why_not": None})
            continue
        own = flips_of.get(iid, [])
        if not own:
            why = ("no flip to branch: at every scored position the candidate's teacher-forced top-1 is the written token "
                   "(the free-running outputs part elsewhere, or where the reference's written token is not its own top-1)")
        elif all(f.tie for f in own) and not settings.branch_ties:
            why = "its only flips are ties at the reference (not branched; --branch-ties branches them)"
        else:
            why = "left out by --max-branches"
        listed.append({"item_id": iid, "change": change, "branched": False, "position": pos, "outcome": None, "why_not": why})
    return listed


# --------------------------------------------------------------------------------------------
# correctness


def run_correctness(
    source: Source,
    ref: RunReader,
    columns: dict,
    *,
    settings: Settings,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> tuple[Correctness, list[dict[str, Any]]]:
    """Grade free-running greedy outputs of both models on labelled items; count correctness flips.

    The reference's free-running output is its teacher sequence; the candidate generates
    from the same prompt ids with the same budget. A correctness flip "starts at a top-1
    flip" when the first position where the candidate's output leaves the teacher is a
    scored position whose top-1 differed under teacher forcing.
    """
    items = [it for it in ref.items() if _item_json(it).get("expected") is not None]
    check_items(items, settings.exec_timeout)
    if on_total:
        on_total(len(items))
    eos = set(source.eos_token_ids) | set((ref.manifest.get("source") or {}).get("identity", {}).get("eos_token_ids") or [])
    # (item, position) -> top1_match, to locate where a divergence started
    key = {(str(i), int(p)): bool(m) for i, p, m in zip(columns["item_id"], columns["position"], columns["top1_match"])}
    rows: list[dict[str, Any]] = []
    for it in items:
        d = _item_json(it)
        tools = d.get("tools") or []
        budget = _budget(ref, it)
        gen = source.generate(list(it.prompt_ids), budget)
        cand_ids = list(gen.token_ids)
        ref_ids = list(it.teacher_ids)
        ref_text = source.detokenize(_strip_end(ref_ids, eos))
        cand_text = source.detokenize(_strip_end(cand_ids, eos))
        ref_cut, cand_cut = hit_budget(ref_ids, budget, eos), hit_budget(cand_ids, budget, eos)
        prompt = d.get("prompt") or ""  # a "tests" label's program starts with it (HumanEval)
        gr = grade(d["expected"], ref_text, tools, where=f"item {it.id!r}", truncated=ref_cut, prompt=prompt)
        gc = grade(d["expected"], cand_text, tools, where=f"item {it.id!r}", truncated=cand_cut, prompt=prompt)
        div = first_difference(ref_ids, cand_ids)
        diverged = div < max(len(ref_ids), len(cand_ids))
        at_flip = None
        if diverged and (it.id, div) in key:
            at_flip = not key[(it.id, div)]
        row = {
            "item_id": it.id,
            "tags": list(it.tags),
            "check": gr.check,
            "ref_correct": gr.correct,
            "cand_correct": gc.correct,
            "ref_verdict": gr.verdict,
            "cand_verdict": gc.verdict,
            "ref_cut": ref_cut,
            "cand_cut": cand_cut,
            "budget_tokens": budget,
            "ref_detail": gr.detail,
            "cand_detail": gc.detail,
            "ref_output": ref_text,
            "cand_output": cand_text,
            "first_divergence": div if diverged else None,
            "divergence_at_top1_flip": at_flip,
        }
        prompt_form = prompt_form_of(d["expected"])
        if prompt_form is not None:
            row[PromptForm.FIELD] = prompt_form
        form = tool_form_of(d["expected"])
        if form is not None:
            row[ToolForm.FIELD] = form
        if tools:
            for side, txt, cut in (("ref", ref_text, ref_cut), ("cand", cand_text, cand_cut)):
                v = call_verdict(txt, tools, truncated=cut)
                row[f"{side}_tool_call"] = v
                row[f"{side}_tool_call_valid"] = v == CallVerdict.VALID
        rows.append(row)
        if progress:
            progress(1)
    sec = correctness_section(rows, settings)
    # a benchmark graded by its own tests or checker: the RUN's recorded workload names it
    bench = benchmark_of((ref.manifest.get("settings") or {}).get("workload"))
    sec["measure"] = Measure.PASS_RATE if bench else Measure.ACCURACY
    sec["benchmark"] = bench
    return sec, rows


def answer_changes(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """The correctness rows whose answer changed, by AnswerChange (every one in AnswerChange.ALL
    order). A candidate output cut by the budget is not right, but not wrong either:
    right->truncated is apart from right->wrong (both are changes, and McNemar's discordant
    pairs compare right with not right)."""
    cut = lambda r: r.get("cand_verdict") == Verdict.TRUNCATED  # noqa: E731
    return {
        AnswerChange.RIGHT_TO_WRONG: [r for r in rows if r["ref_correct"] and not r["cand_correct"] and not cut(r)],
        AnswerChange.RIGHT_TO_TRUNCATED: [r for r in rows if r["ref_correct"] and not r["cand_correct"] and cut(r)],
        AnswerChange.WRONG_TO_RIGHT: [r for r in rows if not r["ref_correct"] and r["cand_correct"]],
    }


def correctness_section(rows: list[dict], settings: Settings) -> Correctness:
    n = len(rows)
    r_ok = np.array([r["ref_correct"] for r in rows], dtype=bool)
    c_ok = np.array([r["cand_correct"] for r in rows], dtype=bool)
    cut = lambda r, side: r.get(f"{side}_verdict") == Verdict.TRUNCATED  # noqa: E731
    changes = answer_changes(rows)
    r2w, r2t, w2r = (changes[d] for d in AnswerChange.ALL)
    flips = r2w + r2t + w2r
    # by_tag is added last, after the optional tool-call fields: report.json's key order
    sec: Correctness = {  # type: ignore[typeddict-item]
        "n_labelled": n,
        "accuracy_ref": float(r_ok.mean()) if n else None,
        "accuracy_ref_ci": wilson_ci(int(r_ok.sum()), n),
        "accuracy_cand": float(c_ok.mean()) if n else None,
        "accuracy_cand_ci": wilson_ci(int(c_ok.sum()), n),
        "accuracy_diff": float(c_ok.mean() - r_ok.mean()) if n else None,
        "accuracy_diff_ci": paired_diff_ci(r_ok, c_ok, n_boot=settings.n_boot, seed=settings.seed),
        "both_right": int((r_ok & c_ok).sum()),
        "both_wrong": int((~r_ok & ~c_ok).sum()),
        "right_to_wrong": len(r2w),
        "wrong_to_right": len(w2r),
        "correctness_flips": len(flips),
        "mcnemar_p": mcnemar_exact(len(r2w) + len(r2t), len(w2r)),
        "flips_starting_at_top1_flip": sum(1 for r in flips if r["divergence_at_top1_flip"]),
        "flips_with_unscored_start": sum(1 for r in flips if r["divergence_at_top1_flip"] is None),
        "method": "free-running greedy outputs graded against each item's label (an output cut by the token budget "
        "and not right is graded truncated, not wrong); McNemar exact (binomial) test on the discordant items (right vs "
        "not right); Wilson 95 % CIs; paired bootstrap (items) for the difference",
        "items_right_to_wrong": [r["item_id"] for r in r2w],
        "items_wrong_to_right": [r["item_id"] for r in w2r],
        "budget_tokens": (lambda b: b.pop() if len(b) == 1 else None)({r["budget_tokens"] for r in rows if "budget_tokens" in r}),
        "cut_ref": sum(bool(r.get("ref_cut")) for r in rows),
        "cut_cand": sum(bool(r.get("cand_cut")) for r in rows),
        "truncated_ref": sum(cut(r, "ref") for r in rows),
        "truncated_cand": sum(cut(r, "cand") for r in rows),
        "right_to_truncated": len(r2t),
        "items_right_to_truncated": [r["item_id"] for r in r2t],
    }
    tool_rows = [r for r in rows if "ref_tool_call_valid" in r]
    if tool_rows:
        sec["tool_call_valid_ref"] = float(np.mean([r["ref_tool_call_valid"] for r in tool_rows]))
        sec["tool_call_valid_cand"] = float(np.mean([r["cand_tool_call_valid"] for r in tool_rows]))
        sec["n_tool_items"] = len(tool_rows)
        sec["tool_call_truncated_ref"] = sum(r.get("ref_tool_call") == CallVerdict.TRUNCATED for r in tool_rows)
        sec["tool_call_truncated_cand"] = sum(r.get("cand_tool_call") == CallVerdict.TRUNCATED for r in tool_rows)
    by_tag: dict[str, dict] = {}
    for r in rows:
        for t in r["tags"] or ["(untagged)"]:
            d = by_tag.setdefault(t, {"n": 0, "ref_correct": 0, "cand_correct": 0, "right_to_wrong": 0, "wrong_to_right": 0})
            d["n"] += 1
            d["ref_correct"] += int(r["ref_correct"])
            d["cand_correct"] += int(r["cand_correct"])
            d["right_to_wrong"] += int(r["ref_correct"] and not r["cand_correct"] and not cut(r, "cand"))
            d["wrong_to_right"] += int(r["cand_correct"] and not r["ref_correct"])
    for d in by_tag.values():
        d["accuracy_ref"] = d["ref_correct"] / d["n"]
        d["accuracy_cand"] = d["cand_correct"] / d["n"]
    prompt_forms = [r[PromptForm.FIELD] for r in rows if PromptForm.FIELD in r]
    if prompt_forms:
        sec["prompt_forms"] = {f: {"n": prompt_forms.count(f), "means": PromptForm.MEANS[f]} for f in PromptForm.ALL if f in prompt_forms}
    forms = [r[ToolForm.FIELD] for r in rows if ToolForm.FIELD in r]
    if forms:
        sec["tool_forms"] = {f: {"n": forms.count(f), "means": ToolForm.MEANS[f]} for f in ToolForm.ALL if f in forms}
    sec["by_tag"] = dict(sorted(by_tag.items()))
    return sec


def prompt_form_of(expected: dict) -> str | None:
    """The PromptForm a HumanEval label says its item was put in (a label without one was made
    before the choice: the completion form); None for any other label."""
    tests = expected.get("tests")
    return tests.get(PromptForm.FIELD, PromptForm.COMPLETION) if isinstance(tests, dict) else None


def tool_form_of(expected: dict) -> str | None:
    """The ToolForm a benchmark label says its item was shown in (a BFCL label without one was
    made before the choice: the chat template's); None for any other label."""
    label = expected.get("bfcl")
    return label.get(ToolForm.FIELD, ToolForm.CHAT_TEMPLATE) if isinstance(label, dict) else None


# --------------------------------------------------------------------------------------------
# attribution: each changed answer, its first teacher-forced flip and the branch there


def _first_flip(f: Flip, token_text: Callable[[int], str]) -> FirstFlip:
    opt = lambda x: float(x) if np.isfinite(x) else None  # noqa: E731 (NaN: p(top1) not stored)
    return {"position": f.position, "ref_token_id": f.ref_token_id, "cand_token_id": f.cand_token_id,
            "ref_token": token_text(f.ref_token_id), "cand_token": token_text(f.cand_token_id),
            "p_ref": opt(f.p_ref), "p_cand": opt(f.p_cand), "margin_ref": float(f.margin_ref), "kl_nats": float(f.kl_nats)}


def _no_flip(own: Sequence[Flip], n_scored: int) -> str:
    """Why an item has no first flip, in words."""
    if not n_scored:
        return "no teacher-forced flip on this item: none of its positions was scored"
    if own:  # only ties at the reference (flips.is_tie): the engines broke a tie, the candidate did not flip
        return (f"no teacher-forced flip on this item: its {len(own)} top-1 difference{'s' if len(own) != 1 else ''} "
                "are ties at the reference, not flips")
    return "no teacher-forced flip on this item"


def _branch_of(first: Flip | None, div: int | None, rows: Sequence[dict], done: FlipRun | None,
               settings: Settings) -> tuple[AttributedBranch | None, str | None]:
    """The branch taken on an item (at its first flip, else the one behind its divergence,
    else its first) and why its first flip has none (None: it has one)."""
    at = {int(r["position"]): r for r in rows}
    why: str | None = None
    if first is None:
        why = "no flip to branch"
    elif done is None:
        why = "the flips stage did not run (--no-flips)"
    elif first.position not in at:
        key = (first.item_id, first.position)
        if key in {(f.item_id, f.position) for f in done.left_out}:
            why = f"not selected: left out by --max-branches {settings.max_branches}"
        elif key not in {(f.item_id, f.position) for f in done.chosen}:
            why = f"not selected by --select {settings.select}"
        else:
            why = "selected, but no branch was written"
    if not at:
        return None, why
    pos = first.position if first is not None and first.position in at else (div if div in at else min(at))
    r = at[pos]
    branch: AttributedBranch = {"position": pos, "outcome": str(r["outcome"]), "decided_by": str(r.get("decided_by") or ""),
                                "at_first_flip": first is not None and pos == first.position}
    return branch, why


def attribute(crow: Sequence[dict], all_flips: Sequence[Flip], done: FlipRun | None, settings: Settings,
              token_text: Callable[[int], str], columns: dict) -> list[Attribution]:
    """One record per item whose free-running answer changed (right->wrong, right->truncated,
    wrong->right, in that order): the first teacher-forced top-1 flip on the item (ties are not
    flips), whether the free-running outputs first part there, and the branch the flips stage
    took on the item (flips.parquet: item_id + position) or why the flip has none."""
    flips_of: dict[str, list[Flip]] = {}
    for f in sorted(all_flips, key=lambda f: (f.item_id, f.position)):
        flips_of.setdefault(f.item_id, []).append(f)
    rows_of: dict[str, list[dict]] = {}
    for r in done.rows if done is not None else []:
        rows_of.setdefault(r["item_id"], []).append(r)
    ids, n_scored = np.unique(np.asarray(columns["item_id"]).astype(str), return_counts=True)
    scored = dict(zip(ids.tolist(), n_scored.tolist()))
    out: list[Attribution] = []
    for direction, changed in answer_changes(crow).items():
        for row in changed:
            iid = row["item_id"]
            own = flips_of.get(iid, [])
            first = next((f for f in own if not f.tie), None)
            div = row.get("first_divergence")
            branch, why = _branch_of(first, div, rows_of.get(iid, []), done, settings)
            out.append({
                "item_id": iid, "direction": direction,
                "first_flip": _first_flip(first, token_text) if first is not None else None,
                "no_flip": None if first is not None else _no_flip(own, scored.get(iid, 0)),
                "first_divergence": div,
                "divergence_at_first_flip": None if first is None or div is None else div == first.position,
                "branch": branch, "not_branched": why,
            })
    return out


# --------------------------------------------------------------------------------------------
# files


def rows_table(rows: list[dict]):
    """A pyarrow table of branch/correctness rows (lists of strings for tags)."""
    import pyarrow as pa

    if not rows:
        return pa.table({"item_id": pa.array([], pa.string())})
    names = list(rows[0])
    for r in rows[1:]:
        names += [k for k in r if k not in names]
    cols = {}
    for k in names:
        vals = [r.get(k) for r in rows]
        if k == "tags":
            cols[k] = pa.array(vals, type=pa.list_(pa.string()))
        else:
            cols[k] = pa.array(vals)
    return pa.table(cols)


def parquet_bytes(rows: list[dict]) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(rows_table(rows), buf)
    return buf.getvalue()


# tokens.parquet columns flips read (p_top1_* are optional: reports from before they existed)
FLIP_COLUMNS = ("item_id", "position", "top1_match", "top1_ref", "top1_cand", "p_top1_ref", "p_top1_cand", "margin_ref", "kl_nats")


def analyse(
    source: Source,
    ref: RunReader,
    columns: dict,
    similarity: SimilarityPolicy,
    settings: Settings,
    *,
    reference_source: Source | None = None,
    correctness: bool = True,
    flips: bool = True,
    bar: Callable[[int, str], Callable[[int], None]] | None = None,
    judge: Judge | None = None,
) -> tuple[_Sections, dict[str, bytes]]:
    """Flips (and correctness) for one comparison: report sections and file contents."""
    sections: _Sections = {}
    files: dict[str, bytes] = {}
    state: dict[str, Callable[[int], None] | None] = {}

    def total(label: str) -> Callable[[int], None]:
        def set_total(n: int) -> None:
            state[label] = bar(n, label) if bar else None
        return set_total

    def adv(label: str) -> Callable[[int], None]:
        def advance(n: int = 1) -> None:
            step = state.get(label)
            if step:
                step(n)
        return advance

    # Correctness first: the items whose answer or tool call changed decide which flips are
    # branched first (select_flips' priority), so none of them is dropped by the cap.
    changed: dict[str, tuple[str, int | None]] = {}
    crow: list[dict[str, Any]] = []
    if correctness:
        csec, crow = run_correctness(source, ref, columns, settings=settings, progress=adv("correctness"),
                                     on_total=total("correctness"))
        if crow:
            sections["correctness"] = csec
            files["correctness.parquet"] = parquet_bytes(crow)
            changed = changed_items(crow)
    done = None
    if flips:
        done = branch_flips(source, ref, columns, similarity, settings, reference_source=reference_source,
                            progress=adv("branches"), on_total=total("branches"), changed=changed, judge=judge)
        sections = {"flips": done.section, **sections}  # flips first: report.json's key order
        files["flips.parquet"] = parquet_bytes(done.rows)
    if "correctness" in sections:  # each changed answer linked to its first flip and the branch there
        all_flips = done.all_flips if done is not None else all_flips_of(list(ref.items()), columns)
        records = attribute(crow, all_flips, done, settings, source.token_text, columns)
        sections["correctness"]["attribution"] = records
        sections["correctness"]["attributed"] = attributed_counts(records)
    return sections, files


def analyse_report_dir(
    report_dir: str | Path,
    *,
    candidate: str | None = None,
    reference: str | None = None,
    settings: Settings,
    similarity: str = "auto",
    similarity_threshold: float | None = None,
    correctness: bool = True,
    bar: Callable[[int, str], Callable[[int], None]] | None = None,
    gates: Sequence[Gate] | None = None,
    judge: Judge | None = None,
) -> ReportFlips:
    """``logitdiff flips REPORT/``: flips (+ correctness, gates) of an existing report: the
    report with them and the files to write beside it. Nothing is written or rendered here:
    the caller hands the result to the report stage (``report.rewrite_report_dir``)."""
    from .grading import load_similarity
    from ..report import read_report_and_columns
    from ..sources import applied_threads, open_source

    report, cols = read_report_and_columns(report_dir)  # one version of the REPORT
    if report["method"].get("kind") not in (MethodKind.FULL_VOCAB, MethodKind.TOP_K):
        raise LogitdiffError(f"{report_dir}/report.json: field 'method.kind' is {report['method'].get('kind')!r}")
    missing = [c for c in FLIP_COLUMNS if c not in cols and not c.startswith("p_top1")]
    if missing:
        raise LogitdiffError(f"{report_dir}/tokens.parquet: column {missing[0]!r} is missing")
    ref_path = report["reference"].get("path")
    if not ref_path or not Path(ref_path).exists():
        raise LogitdiffError(f"{report_dir}/report.json: field 'reference.path' ({ref_path}) is not a reference RUN that exists here")
    ref = RunReader(ref_path)
    spec = candidate or report["candidate"].get("spec")
    if not spec:
        raise LogitdiffError(f"{report_dir}/report.json: field 'candidate.spec' is empty; pass --candidate SPEC")
    sim = load_similarity(similarity, similarity_threshold)
    source = open_source(spec)
    ref_spec = reference or report["reference"].get("spec")
    if settings.both and not ref_spec:
        raise LogitdiffError(f"{report_dir}/report.json: field 'reference.spec' is empty; pass --reference SPEC for --both")
    ref_src = open_source(ref_spec) if settings.both and ref_spec else None
    try:
        from ..store.tokenizer_identity import check as check_tokenizers

        check_tokenizers(spec, source.tokenizer_hash, source.tokenizer_tokens, f"the reference run {ref.path}",
                         ref.tokenizer_hash, ref.tokens())
        with applied_threads([source] + ([ref_src] if ref_src is not None else [])):
            sections, files = analyse(source, ref, cols, sim, settings, reference_source=ref_src, correctness=correctness, bar=bar,
                                      judge=judge)
    finally:
        source.close()
        if ref_src is not None:
            ref_src.close()
    # A rerun replaces what an earlier `flips` wrote: no section or file from it survives
    # beside the new ones (e.g. old correctness after --no-correctness, old gates).
    report.pop("flips", None)
    report.pop("correctness", None)
    report.pop("gates", None)
    report.update(sections)
    if gates:
        from ..report.gates import judge as judge_gates

        report["gates"], _ = judge_gates(report, list(gates))
    stale = [n for n in ("flips.parquet", "correctness.parquet") if n not in files]
    return ReportFlips(report=report, columns=cols, files=files, remove=stale)
