"""Stage *pipeline*: the `logitdiff run` job — reference, floors, candidates, comparisons,
flips and reports in one go (this module). Imports every stage below it; only `api` and
`cli` import it.

`logitdiff run`: reference capture, noise floor, candidates, one report each, a summary.

    reference  --capture (greedy, then teacher-forced distributions)-->  OUT/runs/reference
    reference again, teacher-forced            --> noise floor (reproducibility; when that rerun
                                                   is bit-identical, a rerun with other batch mates
                                                   unless provably the same: floors.shift_skip_reason)
    the cross-engine floor (--floor, floors.py) --> scored like a candidate, every row read against it
    each candidate, teacher-forced, scored live --> OUT/reports/<candidate>/
    all candidates                              --> OUT/summary.json, OUT/summary.md
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np

from ..capture import SCORE_BATCH, LiveRun, capture_candidate, capture_reference, items_in_prompt_form, items_in_tool_form, preflight_tokenization
from ..compare import DEFAULT_TOP_LOGPROBS, compare_runs
from ..defaults import DEFAULT_MAX_BRANCHES
from ..contracts import (SUMMARY_SCHEMA_VERSION, CandidateRow, CrossEngineFloor, Measure, NoiseFloor, Outcome, PromptForm, Report, RunSummary,
                         ToolForm, summary_json)
from ..errors import LogitdiffError
from ..contracts import RUN_SUMMARY_SCHEMA
from ..store.files import Kind, atomic_write_bytes, check_output, is_kind, report_names, safe_name, writing  # noqa: F401 (safe_name: API)
from ..report import build_report, noise_floor_section, write_report_dir
from ..report.markdown import render_markdown
from ..report.metric_registry import ACCURACY_PAIR, ATTRIBUTED, DRIFT_TABLE, METRICS, consequence_columns, header
from ..report.verdict import attributed_cell
from ..sources.served_floor import SHIFT_TEXT, floor_side, is_served, served_floor
from ..sources import applied_threads, open_source
from ..store import ResumeMismatch, RunReader, read_manifest
from ..store.kinds import AUTO, reference_store_choices
from ..numerics.summarize import DEFAULT_BOOTSTRAP, DEFAULT_RANGES
from ..workload import read_workload, workload_file, workload_sha256
from . import floors


def default_candidates() -> list[str]:
    from ..builtin import LADDER

    return ["builtin:tiny-BF16"] + [f"builtin:tiny-{q}" for q in LADDER]


@dataclass
class RunConfig:
    reference: str = "builtin:tiny"
    candidates: list[str] = field(default_factory=default_candidates)
    workload: str | None = None
    out: str = "logitdiff-out"
    max_tokens: int | None = None
    positions: str = "all"
    noise_floor: bool = True
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0
    ranges: tuple[int, ...] = DEFAULT_RANGES
    top_logprobs: int = DEFAULT_TOP_LOGPROBS
    fresh: bool = False
    # what the flips do, and correctness (budgeted: the default run stays within minutes)
    flips: bool = True
    flip_select: str = "first"
    max_branches: int = DEFAULT_MAX_BRANCHES
    correctness: bool = True
    similarity: str = "auto"
    judge: str | None = None  # --judge SOURCE: the diverged branches' meaning (flips/judge.py); None: not judged
    html: bool = True
    gates: list | None = None  # logitdiff.report.gates.Gate; crossed gates are listed in summary.json
    logprob_floor: float | None = None  # stated floor for top-K (served) candidates: compare.check_floor
    # a lossless store kind (kinds.reference_store_choices), or AUTO: the most compact one
    # the reference allows (kinds.auto_kind)
    reference_store: str = AUTO
    # the cross-engine floor: auto (the rule in pipeline/floors.py), none, or a source spec,
    # scored like a candidate (its own report); every row's x_cross_engine_floor reads against it
    floor: str = floors.AUTO
    # a model (GGUF file or transformers directory) quantized to ``types`` with llama.cpp's
    # quantizer into the cache; each file is added as a gguf: candidate (the one-line ladder)
    candidates_from: str | None = None
    types: list[str] | None = None


@dataclass
class FloorPlan:
    """The cross-engine floor of one run: its spec (None: none) and how it was chosen."""

    spec: str | None
    how: str
    chosen_here: bool = False  # chosen by --floor auto and not a candidate: dropped, not fatal, if unusable


class Hooks:
    """Progress callbacks; the CLI passes rich-backed ones."""

    def stage(self, text: str) -> None:  # pragma: no cover - trivial
        pass

    def bar(self, total: int, text: str) -> Callable[[int], None]:  # pragma: no cover - trivial
        def advance(n: int = 1) -> None:
            pass

        return advance

    def done(self) -> None:  # pragma: no cover - trivial
        pass


def _workload_inputs(cfg: RunConfig) -> list[Path]:
    """The workload file among a writer's inputs (none for a benchmark read from its package)."""
    f = workload_file(_workload_path(cfg))
    return [f] if f is not None else []


def _workload_path(cfg: RunConfig) -> Path:
    if cfg.workload:
        return Path(cfg.workload)
    from ..builtin import WORKLOAD

    return WORKLOAD


def _reference_run(cfg: RunConfig, items, wl_hash: str, hooks: Hooks, prefetch=None) -> RunReader:
    """Capture the reference, or reuse/resume a matching capture in OUT/runs/reference.

    ``prefetch``: a served candidate source whose scoring of each generated block starts while
    the reference generates the next one (ServedSource.prefetch; a fresh capture only: a
    resumed block keeps its stored tokens)."""
    path = Path(cfg.out) / "runs" / "reference"
    want = {"workload_sha256": wl_hash, "spec": cfg.reference, "max_tokens": cfg.max_tokens, "positions": cfg.positions,
            "store": cfg.reference_store}
    resume = False
    if is_kind(path, Kind.RUN) and not cfg.fresh:
        m = read_manifest(path / "manifest.json")
        have = {"workload_sha256": m["settings"].get("workload_sha256"), "spec": m["source"]["spec"],
                "max_tokens": m["settings"].get("max_tokens"), "positions": m["settings"].get("positions"),
                "store": m["settings"].get("store")}
        if cfg.reference_store == AUTO and have["store"] in reference_store_choices():
            have["store"] = AUTO  # what auto picks depends only on the spec, compared above
        if have == want:
            if m.get("status") == "complete":
                hooks.stage(f"reference: reusing {path}")
                return RunReader(path)
            resume = True
    hooks.stage(f"reference: {cfg.reference} generating greedily on {len(items)} items")
    with open_source(cfg.reference) as src, applied_threads([src]):
        # another server only, and by default another host (ServedSource.scores_ahead_of)
        if prefetch is not None and not resume and hasattr(src, "on_generated") and prefetch.scores_ahead_of(src):
            src.on_generated = prefetch.prefetch
        advance = hooks.bar(len(items), "reference")
        settings = {"workload_sha256": wl_hash, "workload": str(_workload_path(cfg))}
        try:
            capture_reference(src, items, path, max_tokens=cfg.max_tokens, positions=cfg.positions, resume=resume,
                              overwrite=not resume, settings=settings, progress=advance, inputs=_workload_inputs(cfg),
                              store=cfg.reference_store)
        except ResumeMismatch as e:
            # The partial capture was made with another model or settings: start again
            # rather than mix the two (the old one is replaced only when the new is whole).
            hooks.stage(f"reference: not resuming ({str(e).split('cannot resume, ', 1)[-1]}); capturing afresh")
            capture_reference(src, items, path, max_tokens=cfg.max_tokens, positions=cfg.positions, overwrite=True,
                              settings=settings, progress=hooks.bar(len(items), "reference"), inputs=_workload_inputs(cfg),
                              store=cfg.reference_store)
    return RunReader(path)


def run_pipeline(cfg: RunConfig, hooks: Hooks | None = None) -> RunSummary:
    hooks = hooks or Hooks()
    wl_path = _workload_path(cfg)
    out = Path(cfg.out)
    # OUT is new, empty or an earlier run's OUT; each report dir in it new or a REPORT.
    check_output(out, Kind.RUN_OUT, inputs=_workload_inputs(cfg), resume=True)
    items = read_workload(wl_path)
    cfg, plan = _plan_candidates(cfg, hooks)
    names = report_names(cfg.candidates)
    for name in names:
        check_output(out / "reports" / name, Kind.REPORT)
    # One `run` per OUT at a time; a new OUT that fails is removed, an interrupted one kept
    # (its reference capture resumes).
    with writing(out, Kind.RUN_OUT, inputs=_workload_inputs(cfg), resume=True, in_place_when_new=True):
        return _run_locked(cfg, hooks, wl_path, items, names, plan)


def _plan_candidates(cfg: RunConfig, hooks: Hooks) -> tuple[RunConfig, FloorPlan]:
    """The candidates to score: the ladder of --candidates-from (quantized, or found in the
    cache), the cross-engine floor first unless it is a candidate already (never scored
    twice), then the candidates as given."""
    candidates = list(cfg.candidates)
    if cfg.candidates_from:
        hooks.stage(f"ladder: {cfg.candidates_from} quantized to {', '.join(cfg.types or [])} with llama.cpp's quantizer")
        ladder, where = floors.ladder_candidates(cfg.candidates_from, cfg.types or [])
        hooks.stage(f"ladder: {len(ladder)} GGUF candidates in {where}")
        candidates += [c for c in ladder if c not in candidates]
    if cfg.floor == floors.AUTO and not is_served(cfg.reference):
        hooks.stage(f"cross-engine floor: choosing the same weights in another engine for {cfg.reference}")
    spec, how = floors.choose_floor(cfg.floor, cfg.reference)
    chosen_here = spec is not None and spec not in candidates and cfg.floor == floors.AUTO
    if spec is not None and spec not in candidates:
        candidates.insert(0, spec)
    hooks.stage(f"cross-engine floor: {spec} ({how})" if spec else f"cross-engine floor: none ({how})")
    return dataclasses.replace(cfg, candidates=candidates), FloorPlan(spec, how, chosen_here)


def _preflight(cfg: RunConfig, items, names: list[str], plan: FloorPlan, hooks: Hooks) -> None:
    """Each candidate tokenizes every prompt as the reference does. An automatic floor that
    does not is dropped (from cfg.candidates and names), the reason kept in ``plan``: the
    user asked for the candidates, not for that floor."""
    hooks.stage("preflight: each candidate tokenizes every prompt as the reference does")
    if plan.chosen_here and plan.spec is not None:
        try:
            preflight_tokenization(cfg.reference, [plan.spec], items)
        except LogitdiffError as e:
            hooks.stage(f"cross-engine floor: {plan.spec} dropped ({e})")
            cfg.candidates.remove(plan.spec)
            names.pop(0)
            plan.how = f"auto: no cross-engine floor, {plan.spec} was dropped ({e}); name one with --floor SPEC"
            plan.spec = None
    rest = [c for c in cfg.candidates if not (plan.chosen_here and c == plan.spec)]
    preflight_tokenization(cfg.reference, rest, items)  # seconds, not after the reference capture


def _run_locked(cfg: RunConfig, hooks: Hooks, wl_path: Path, items, names: list[str], plan: FloorPlan) -> RunSummary:
    import contextlib

    with contextlib.ExitStack() as opened:  # a source opened ahead is closed whatever happens
        judge = None
        if cfg.judge and (cfg.flips or cfg.correctness):  # opened and asked once before any work
            from ..flips.judge import open_judge

            judge = opened.enter_context(open_judge(cfg.judge))
        return _run_opened(cfg, hooks, wl_path, items, names, opened, plan, judge)


def _run_opened(cfg: RunConfig, hooks: Hooks, wl_path: Path, items, names: list[str], opened, plan: FloorPlan,
                judge=None) -> RunSummary:
    """The job, step by step: the ladder and the preflight, the reference, its floor, one
    report per candidate, then the summary and the pages."""
    t0 = time.time()
    # HumanEval as the reference takes it (the raw prompt where it renders no chat messages)
    items, prompt_form = items_in_prompt_form(cfg.reference, items)
    if prompt_form is not None:
        hooks.stage(f"HumanEval prompt form: {PromptForm.MEANS[prompt_form]}")
    # benchmark items as the reference's template takes tools (BFCL's plain prompt where it has no tool support)
    items, form = items_in_tool_form(cfg.reference, items)
    if form is not None:
        hooks.stage(f"tool form: {ToolForm.MEANS[form]} ({cfg.reference}'s chat template "
                    f"{'renders' if form == ToolForm.CHAT_TEMPLATE else 'ignores'} tools)")
    wl_hash = workload_sha256(wl_path, items)  # a file's bytes; a benchmark's items
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _prebuild_builtin_ladder(cfg, hooks)  # before the preflight, which renders with those GGUFs
    _preflight(cfg, items, names, plan, hooks)
    # A served reference and a served (first) candidate: the candidate is opened first and
    # scores each reference block (another server) while the reference generates the next.
    early = None
    first_served = next((c for c in cfg.candidates if is_served(c)), None)
    if is_served(cfg.reference) and first_served is not None:
        early = opened.enter_context(open_source(first_served))
    job = _Job(cfg, hooks, _reference_run(cfg, items, wl_hash, hooks, prefetch=early), out)
    job.judge = judge
    noise = job.noise_floor()
    rows: list[CandidateRow] = []
    for spec, name in zip(cfg.candidates, names):
        rows.append(job.candidate(spec, name, noise, wl_path, opened=early if spec == first_served else None))
        if spec == first_served:
            early = None
    summary = _run_summary(cfg, wl_path, wl_hash, len(items), job.n_pos, noise, rows, t0, plan)
    _write_summary(cfg, out, summary, rows, hooks)
    hooks.done()
    return summary


class _Job:
    """The steps of one `run` after its reference is captured, and what they share: the
    reference RUN, its scored positions, the text similarity of the flips and the served
    reference's floor (set by :meth:`noise_floor`, read by each served candidate)."""

    def __init__(self, cfg: RunConfig, hooks: Hooks, ref: RunReader, out: Path) -> None:
        self.cfg, self.hooks, self.ref, self.out = cfg, hooks, ref, out
        self.n_pos = sum(len(it.positions) for it in ref.items())
        self.shift = SCORE_BATCH // 2  # the batch boundaries' move of a rerun with other batch mates
        self.ref_floor: Any = None  # the served reference's floor (servedfloor.py)
        self.similarity = None
        self.judge: Any = None  # the open judge of --judge (flips.judge.Judge), set by the caller
        if cfg.flips or cfg.correctness:
            from ..flips.grading import load_similarity

            self.similarity = load_similarity(cfg.similarity)

    def score(self, spec: str, label: str, after=None, offset: int = 0):
        """``spec`` scored live against the reference (``offset``: batch boundaries moved)."""
        cfg = self.cfg
        with open_source(spec) as src, applied_threads([src]):
            live = LiveRun(src, self.ref, offset=offset)
            advance = self.hooks.bar(self.n_pos, label)
            comp = compare_runs(self.ref, live, top_logprobs=cfg.top_logprobs, progress=advance, logprob_floor=cfg.logprob_floor)
            return comp, (after(src, comp) if after else None)

    def served_candidate(self, spec: str, name: str, opened=None):
        """A served candidate: captured into OUT/runs/<name> (top-K), compared from there,
        then scored again live with other batch mates against that capture: its floor.
        ``opened``: the source, already open (and prefetched on the reference's blocks)."""
        cfg, hooks, ref, shift = self.cfg, self.hooks, self.ref, self.shift
        run_dir = self.out / "runs" / f"candidate-{name}"
        with (opened or open_source(spec)) as src, applied_threads([src]):
            hooks.stage(f"candidate: {spec} -> {run_dir}")
            capture_candidate(src, ref, run_dir, overwrite=True, progress=hooks.bar(len(ref.items()), name))
            cand = RunReader(run_dir)
            comp = compare_runs(ref, cand, top_logprobs=cfg.top_logprobs, progress=hooks.bar(self.n_pos, f"{name}: compare"),
                                logprob_floor=cfg.logprob_floor)
            cand_floor = None
            if cfg.noise_floor:
                hooks.stage(f"served floor: {spec} scored again with batch boundaries moved by {shift} items")
                again = compare_runs(cand, LiveRun(src, ref, offset=shift), top_logprobs=cfg.top_logprobs,
                                     progress=hooks.bar(self.n_pos, f"{name}: served floor"))
                cand_floor = floor_side(again, spec=spec, batching=getattr(src, "batching", None), shift=shift)
            comp.served_floor = served_floor(self.ref_floor, cand_floor)
            return comp, self.consequences(src, comp)

    def consequences(self, src, comp):
        """Flips and correctness of one candidate: (report sections, files)."""
        cfg = self.cfg
        if not (cfg.flips or cfg.correctness):
            return {}, {}
        # imported only here: flips and grading (jsonschema, tool calls) are a third of the
        # import time of a run that does neither
        from ..flips.consequences import Settings, analyse

        assert self.similarity is not None  # loaded whenever flips or correctness is on
        fsettings = Settings(select=cfg.flip_select, max_branches=cfg.max_branches, seed=cfg.seed, ranges=cfg.ranges)
        return analyse(src, self.ref, comp.columns, self.similarity, fsettings, correctness=cfg.correctness, flips=cfg.flips,
                       bar=lambda n, label: self.hooks.bar(n, label), judge=self.judge)

    def noise_floor(self) -> NoiseFloor | None:
        """The reference against itself (:meth:`measure_noise_floor`), or the floor measured by
        an earlier run of this same reference RUN (kept beside it, floors.read_stored_floor)."""
        cfg, ref_dir = self.cfg, self.out / "runs" / "reference"
        if not cfg.noise_floor:
            return None
        stored = floors.read_stored_floor(ref_dir, cfg.top_logprobs)
        if stored is not None:
            self.hooks.stage(f"noise floor: reusing the floor measured with {ref_dir} by an earlier run")
            self.ref_floor = stored["served_side"]
            noise = stored["noise_floor"]
            if noise is not None:
                noise["rerun"] += floors.reused_text(ref_dir)
            return noise
        noise = self.measure_noise_floor()
        floors.write_stored_floor(ref_dir, cfg.top_logprobs, cast("dict | None", noise), cast("dict | None", self.ref_floor))
        return noise

    def measure_noise_floor(self) -> NoiseFloor:
        """A served reference scored again with other batch mates (its floor, kept for the
        served candidates), else a rerun, and when that rerun is bit-identical, a rerun with
        other batch mates (skipped where it cannot differ: floors.shift_skip_reason)."""
        cfg, hooks, shift = self.cfg, self.hooks, self.shift
        if is_served(cfg.reference):
            # A served reference: its rerun has other batch mates by construction (the server's
            # rounds), the floor a served comparison is read against.
            hooks.stage(f"served floor: {cfg.reference} scored again with batch boundaries moved by {shift} items")
            nf, batching = self.score(cfg.reference, "served floor", offset=shift, after=lambda src, comp: getattr(src, "batching", None))
            self.ref_floor = floor_side(nf, spec=cfg.reference, batching=batching, shift=shift)
            return noise_floor_section(nf, spec=cfg.reference, rerun="served: " + SHIFT_TEXT.format(shift=shift))
        hooks.stage(f"noise floor: {cfg.reference} rerun, teacher-forced")
        nf, (alone, engine) = self.score(cfg.reference, "noise floor", after=lambda src, comp: (src.scores_alone, src.engine))
        noise = noise_floor_section(nf, spec=cfg.reference, rerun=f"rerun, same batch layout (blocks of {SCORE_BATCH} items)")
        if not identical_distributions(nf):
            return noise
        skip = floors.shift_skip_reason(alone, engine, len(self.ref.items()), shift)
        if skip is not None:
            hooks.stage(f"noise floor: the rerun is bit-identical; {skip}")
            noise["rerun"] += f"; bit-identical; {skip}, so x noise floor is undefined"
            return noise
        # A deterministic backend reruns bit-identically (CPU): that says nothing about its
        # numerical noise. Other batch mates (what --resume, --shard or a server's batching
        # give) change the float rounding of a batched backend: that is the floor.
        hooks.stage(f"noise floor: the rerun is bit-identical; rerun with batch boundaries moved by {shift} items")
        nf, _ = self.score(cfg.reference, "noise floor, other batch mates", offset=shift)
        noise = noise_floor_section(nf, spec=cfg.reference, rerun=f"rerun with batch boundaries moved by {shift} items "
                                    "(other batch mates); the plain rerun is bit-identical")
        if identical_distributions(nf):
            noise["rerun"] += (f"; bit-identical with other batch mates too: on this workload {engine}'s numbers do "
                               "not depend on the batch, so x noise floor is undefined")
        return noise

    def candidate(self, spec: str, name: str, noise: NoiseFloor | None, wl_path: Path, opened=None) -> CandidateRow:
        """One candidate scored, its report (gates judged) written to OUT/reports/<name>, and
        its summary row."""
        cfg = self.cfg
        self.hooks.stage(f"candidate: {spec}")
        if is_served(spec):
            comp, (sections, files) = self.served_candidate(spec, name, opened=opened)
        else:
            comp, (sections, files) = self.score(spec, name, self.consequences)
            comp.served_floor = served_floor(self.ref_floor, None)
        report, columns = build_report(comp, ranges=cfg.ranges, n_boot=cfg.bootstrap, seed=cfg.seed, noise_floor=noise)
        report["reference"]["spec"] = cfg.reference
        report.update(sections)
        if cfg.gates:
            from ..report.gates import judge

            report["gates"], _ = judge(report, cfg.gates)
        rdir = self.out / "reports" / name
        write_report_dir(rdir, report, columns, markdown=render_markdown(report), extra_files=files, inputs=_workload_inputs(self.cfg))
        row = _summary_row(spec, report, rdir, noise)
        if "served_floor" in report["summary"]:
            row["x_served_floor"] = report["summary"]["kl_mean_x_served_floor"]
            row["within_2x_served_floor"] = report["summary"]["within_2x_served_floor"]
        return row


def _run_summary(cfg: RunConfig, wl_path: Path, wl_hash: str, n_items: int, n_pos: int, noise: NoiseFloor | None,
                 rows: list[CandidateRow], t0: float, plan: FloorPlan) -> RunSummary:
    """summary.json of the run (sets each row's x_cross_engine_floor)."""
    cross_engine = _cross_engine_floor(rows, plan.spec)
    summary: RunSummary = {
        "schema": RUN_SUMMARY_SCHEMA,
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "reference": cfg.reference,
        "workload": str(wl_path),
        "workload_sha256": wl_hash,
        "items": n_items,
        "positions": n_pos,
        "noise_floor": noise,
        "cross_engine_floor": cross_engine,
        "cross_engine_floor_rule": plan.how,
        "candidates": rows,
        "seconds": round(time.time() - t0, 1),
    }
    if cfg.gates:
        summary["gates"] = [g.text for g in cfg.gates]
        summary["gates_crossed"] = {r["name"]: r["gates_crossed"] for r in rows if r.get("gates_crossed")}
        summary["gates_not_evaluated"] = {r["name"]: r["gates_not_evaluated"] for r in rows if r.get("gates_not_evaluated")}
    return summary


def _write_summary(cfg: RunConfig, out: Path, summary: RunSummary, rows: list[CandidateRow], hooks: Hooks) -> None:
    """OUT/summary.json, summary.md, and the pages: OUT/report.html with every candidate and
    each candidate's own."""
    atomic_write_bytes(out / "summary.json", summary_json(summary, str(out / "summary.json")).encode())
    atomic_write_bytes(out / "summary.md", render_summary_md(summary).encode())
    if not cfg.html:
        return
    from ..report import write_candidate_page
    from ..report.html import PLOTLY_FILE, plotly_js, plotly_src_for, with_plotly_src, write_html

    hooks.stage("report.html: every candidate on one page, and each candidate's own in reports/<name>/")
    # plotly.js once per RUN, beside the pages that load it (not inlined in each: ~5 MB a page)
    atomic_write_bytes(out / PLOTLY_FILE, plotly_js().encode("utf-8"))
    write_html([Path(r["report"]) for r in rows], out / "report.html", summary=summary, plotly_src=plotly_src_for(out, out))
    if len(rows) == 1:
        # one candidate: its own page is the run's page (the same report, tokens, summary
        # and path rendered), written once and copied with its plotly.js URL, not rendered twice
        page = (out / "report.html").read_text(encoding="utf-8")
        rdir = Path(rows[0]["report"])
        atomic_write_bytes(rdir / "report.html", with_plotly_src(page, plotly_src_for(rdir, out)).encode("utf-8"))
    else:
        for r in rows:
            write_candidate_page(r["report"], summary, plotly_src=plotly_src_for(r["report"], out))


def identical_distributions(comp) -> bool:
    """Same distributions at every position (identical rows give exactly 0 both ways)."""
    c = comp.columns
    return not (np.any(c["kl_nats"]) or np.any(c.get("kl_rev_nats", 0))) and bool(np.all(c["top1_match"]))


def _prebuild_builtin_ladder(cfg: RunConfig, hooks: Hooks) -> None:
    """Build the bundled model's GGUFs up front, with progress, into the hash-keyed cache."""
    names = [c.split(",")[0][len("builtin:tiny-"):] for c in cfg.candidates if c.startswith("builtin:tiny-")]
    if not names:
        return
    from ..builtin import LADDER, TINY_DIR, cache_dir
    from ..sources.quantize import build_ladder

    quants = [n for n in names if n in LADDER]
    hooks.stage(f"GGUF ladder of the bundled model (F32, BF16, {', '.join(quants) or 'no quants'}) in {cache_dir()}")
    advance = hooks.bar(2 + len(quants), "ladder")

    def progress(name, index, total, status):
        if status in ("built", "cached"):
            advance(1)

    build_ladder(TINY_DIR, cache_dir(), quants, progress=progress)


def _cross_engine_floor(rows: list[CandidateRow], floor_spec: str | None) -> CrossEngineFloor | None:
    """The cross-engine floor: the reference's own weights in another engine (the row of
    ``floor_spec``, chosen by floors.choose_floor: builtin:tiny-BF16 in the default run). A
    bit-identical rerun gives a noise floor of 0, so this is the floor that says which drift is
    the quantization's and which the engine's. Sets each row's x_cross_engine_floor (None
    without a floor, or for a row without a mean KL)."""
    xf = next((r for r in rows if r["candidate"] == floor_spec), None) if floor_spec else None
    xf_mean = xf["kl_mean"] if xf else None  # None: the floor's run scored no positions, no floor
    for r in rows:
        kl_mean = r["kl_mean"]
        r["x_cross_engine_floor"] = (kl_mean / xf_mean) if (xf_mean and kl_mean is not None) else None
    return {"candidate": xf["candidate"], "kl_nats_mean": xf_mean} if xf and xf_mean is not None else None


def _summary_row(spec: str, report: Report, rdir: Path, noise: NoiseFloor | None) -> CandidateRow:
    s = report["summary"]
    m = s["metrics"]
    kl, js, kl_rev = m["kl_nats"], m.get("jsd_nats"), m.get("kl_rev_nats")  # a top-K (served) comparison has no JSD estimate
    kl_mean = kl["mean"]  # None: no positions scored
    t1 = s["top1_disagreement"]  # None: no positions scored
    floor = noise["kl_nats_mean"] if noise else None
    # x_cross_engine_floor is missing on purpose: run() sets it once every row is known, and it
    # stays the last key of a row (summary.json's bytes)
    row: CandidateRow = {  # type: ignore[typeddict-item]
        "candidate": spec,
        "name": rdir.name,
        "report": str(rdir),
        "kl_mean": kl_mean,
        "kl_mean_ci95": kl["ci95"],
        "kl_p99": kl["p99"],
        "kl_max": kl["max"],
        "kl_rev_mean": kl_rev["mean"] if kl_rev else None,
        "jsd_mean": js["mean"] if js else None,
        "top1_disagreement": t1["rate"] if t1 else None,
        "top1_disagreement_ci95": t1["ci95"] if t1 else [None, None],
        "ppl_ratio": s.get("ppl_ratio"),
        "x_noise_floor": (kl_mean / floor) if (floor and kl_mean is not None) else None,
        "within_2x_noise_floor": bool(floor) and kl_mean is not None and kl_mean <= 2 * floor,
    }
    # the optional columns, keys built in _consequence_cols: written through a plain view
    extra = cast("dict[str, Any]", row)
    extra.update(_consequence_cols(report))
    gates = report.get("gates")
    if gates:
        extra.update(gates_crossed=gates["crossed"], gates_not_evaluated=gates.get("not_evaluated", []))
    return row


def _consequence_cols(report: Report) -> dict:
    out: dict = {}
    f = report.get("flips")
    if f:
        out["flip_branches"] = f["n_branches"]
        out["flip_ties"] = f.get("n_ties", 0)
        out["flip_outcomes"] = f["outcomes"]
        out["flips_consequential"] = sum(f["outcomes"].get(o, 0) for o in Outcome.BAD)
        out["flip_meaning_judged_by"] = f.get("meaning_judged_by")
    c = report.get("correctness")
    if c:
        out.update(
            accuracy_ref=c["accuracy_ref"], accuracy_cand=c["accuracy_cand"], right_to_wrong=c["right_to_wrong"],
            wrong_to_right=c["wrong_to_right"], mcnemar_p=c["mcnemar_p"], tool_call_valid_cand=c.get("tool_call_valid_cand"),
            right_to_truncated=c.get("right_to_truncated", 0), accuracy_ref_ci=c.get("accuracy_ref_ci", [None, None]),
            accuracy_cand_ci=c.get("accuracy_cand_ci", [None, None]), correctness_measure=c.get("measure", Measure.ACCURACY),
        )
        if "attributed" in c:
            out["attributed"] = c["attributed"]
    return out


def accuracy_measure(rows: list[CandidateRow]) -> str | None:
    """What the accuracy pair's column is called (contracts.Measure) when every candidate with
    labelled answers says the same (one workload: they do), else None (the generic header)."""
    said = {r.get("correctness_measure") for r in rows if r.get("accuracy_cand") is not None}
    return said.pop() if len(said) == 1 else None


def _f(x, spec=".4g"):
    return "n/a" if x is None else format(x, spec)


def _pct(x, spec=".2f"):
    """A share as a percentage; n/a when undefined (no positions scored, no labelled items)."""
    return "n/a" if x is None else f"{100 * x:{spec}} %"


# summary.md's cells by the metric's table format (metric_registry.Metric.table_fmt)
_MD_FORMAT: dict[str, Callable[[Any], str]] = {
    "g": lambda x: _f(x), "int": lambda x: "n/a" if x is None else str(x), "p": lambda x: _f(x, ".3g"),
    "x": lambda x: _f(x, ".3g"), "ratio": lambda x: _f(x, ".5f"), "pct": lambda x: _pct(x),
    "pct0": lambda x: _pct(x, ".0f"), "pct1": lambda x: _pct(x, ".1f"),
}
# the CI column that follows a drift column in summary.md (its row field)
_MD_CI = {"kl_mean": "kl_mean_ci95", "top1_disagreement": "top1_disagreement_ci95"}


def _md_cell(x, name: str) -> str:
    return _MD_FORMAT[METRICS[name].table_fmt](x)


def _md_consequence(r: CandidateRow, name: str) -> str:
    """A cell of summary.md's consequence table: an outcome from the row's flip_outcomes, the
    two accuracies side by side, or the row's field."""
    row = cast("dict[str, Any]", r)
    if name in Outcome.ALL:
        return str((row.get("flip_outcomes") or {}).get(name, "n/a"))
    if name == ATTRIBUTED:
        return attributed_cell(row.get(ATTRIBUTED))
    if name == ACCURACY_PAIR.name:
        if row.get(ACCURACY_PAIR.cand) is None:
            return "n/a"
        return f"{_md_cell(row.get(ACCURACY_PAIR.ref), ACCURACY_PAIR.ref)} → {_md_cell(row[ACCURACY_PAIR.cand], ACCURACY_PAIR.cand)}"
    return _md_cell(row.get(name), name)


def render_summary_md(summary: RunSummary) -> str:
    nf = summary.get("noise_floor")
    lines = [
        f"# logitdiff run: drift from `{summary['reference']}`\n",
        f"- workload: `{summary['workload']}` ({summary['items']} items, {summary['positions']} teacher-forced positions)",
    ]
    if nf:
        lines.append(
            f"- noise floor ({nf.get('rerun') or 'reference rerun'}): mean KL {_f(nf['kl_nats_mean'])} nats, top-1 disagreement "
            f"{100 * nf['top1_disagreement']:.2f} %" + (" — the rerun is bit-identical, so × floor is undefined" if nf["kl_nats_mean"] == 0 else "")
        )
    xf = summary.get("cross_engine_floor")
    if xf:
        lines.append(f"- cross-engine floor (same weights, other engine): `{xf['candidate']}`, mean KL {_f(xf['kl_nats_mean'])} nats")
    elif summary.get("cross_engine_floor_rule"):
        lines.append(f"- no cross-engine floor: {summary['cross_engine_floor_rule']}")
    drift: list[tuple[str, str | None]] = []  # (metric, None): its column; (metric, row field): the CI column after it
    for name in DRIFT_TABLE:
        drift += [(name, None)] + ([(name, _MD_CI[name])] if name in _MD_CI else [])
    lines += [
        "",
        "| candidate | " + " | ".join("95 % CI" if ci else header(name) + (" (nats)" if name == "kl_mean" else "") for name, ci in drift)
        + " |",
        "|---|" + "".join("---|" if ci else "---:|" for _, ci in drift),
    ]
    for r in summary["candidates"]:
        row = cast("dict[str, Any]", r)
        cells = [f"[{_md_cell(row[ci][0], name)}, {_md_cell(row[ci][1], name)}]" if ci else _md_cell(row.get(name), name)
                 for name, ci in drift]
        lines.append(f"| `{r['candidate']}` | " + " | ".join(cells) + " |")
    served = [r for r in summary["candidates"] if "x_served_floor" in r]
    if served:
        lines += ["", "Served floor (each served side scored again with other batch mates; see each report):", ""]
        for r in served:
            lines.append(f"- `{r['candidate']}`: {_f(r['x_served_floor'], '.3g')} × served floor"
                         + (" — **within 2×: not distinguishable from the servers' batch arithmetic**"
                            if r["within_2x_served_floor"] else ""))
    if any("flip_branches" in r or "accuracy_cand" in r for r in summary["candidates"]):
        columns = consequence_columns(summary["candidates"])
        lines += [
            "",
            "What the drift does (free-running answers and branches from top-1 flips; see each report):",
            "",
            "| candidate | " + " | ".join(header(name, accuracy_measure(summary["candidates"])) for name in columns) + " |",
            "|---|" + "".join("---|" if name == ACCURACY_PAIR.name else "---:|" for name in columns),
        ]
        for r in summary["candidates"]:
            lines.append(f"| `{r['candidate']}` | " + " | ".join(_md_consequence(r, name) for name in columns) + " |")
    if summary.get("gates"):
        crossed = summary.get("gates_crossed") or {}
        missing = summary.get("gates_not_evaluated") or {}
        said = [f"`{n}` crossed {', '.join(g)}" for n, g in crossed.items()]
        said += [f"`{n}`: not evaluated (metric not in its report) {', '.join(g)}" for n, g in missing.items()]
        lines.append(f"\nGates `{', '.join(summary['gates'])}`: " + ("; ".join(said) if said else "every candidate passed") + ".")
    lines.append(f"\nOne report per candidate under `reports/`. Wall time {summary['seconds']} s.\n")
    return "\n".join(lines)


def check_specs(cfg: RunConfig) -> None:
    if not cfg.candidates and not cfg.candidates_from:
        raise LogitdiffError("logitdiff run: no candidates (pass --candidate SPEC or --candidates-from MODEL --types ...)")
    if bool(cfg.candidates_from) != bool(cfg.types):
        raise LogitdiffError("logitdiff run: --candidates-from MODEL and --types T1,T2,... go together")
    floors.check_floor_arg(cfg.floor)
    from ..compare import check_floor_value

    check_floor_value(cfg.logprob_floor)
    if cfg.logprob_floor is not None:
        # refused before the reference capture, not after it (compare.check_floor): a floor
        # bounds top-K comparisons, and two full-logit sides make an exact one
        from ..sources.base import RowKind
        from ..sources.registry import declared_row_kind

        if declared_row_kind(cfg.reference) == RowKind.FULL:
            full = [c for c in cfg.candidates if declared_row_kind(c) == RowKind.FULL]
            if full:
                raise LogitdiffError(f"--logprob-floor applies to top-K comparisons (served candidates, served:...); "
                                     f"{full[0]} gives full logits, compared exactly with the reference {cfg.reference}")
