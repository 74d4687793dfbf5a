"""``logitdiff run``: the whole job (reference, noise floor, candidates, reports, flips);
with no arguments, the bundled default."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, cast

from ..api import check_bootstrap
from .console import Bars, console, table_console
from .options import add_bootstrap, add_gate_options, add_judge, add_logprob_floor, add_max_branches, add_ranges, check_max_branches, parse_gate_args, parse_ranges_arg

if TYPE_CHECKING:
    from rich.console import Console

    from ..contracts import CandidateRow, RunSummary
    from ..pipeline import Hooks

NAME = "run"
HELP = "the whole job: reference, noise floor, candidates, reports (no arguments: the bundled default)"
DESCRIPTION = (
    "Capture the reference on the workload, rerun it for the noise floor (when that rerun is "
    "bit-identical, as on CPU, the floor comes from a rerun with the batch boundaries moved by half a "
    "batch: other batch mates, other float rounding), teacher-force every "
    "candidate on the reference's tokens and write one report per candidate plus a summary table. "
    "With no arguments: the bundled tiny Llama through transformers in BF16 as the reference, and "
    "its llama.cpp GGUF BF16 (cross-engine floor) and quant ladder Q8_0, Q6_K, Q4_K_M, IQ4_XS, "
    "Q3_K_M, Q2_K as candidates, on the bundled workload — offline, in minutes. "
    "A served candidate on another host than a served reference is scored on each reference block "
    "while the reference generates the next (its overlap=auto|on|off; auto: only across hosts)."
)


def _wrapped(text: str) -> str:
    """``text`` wrapped by hand: the raw formatter that keeps the epilog's columns keeps this
    paragraph's lines as they are too."""
    import textwrap

    return textwrap.fill(text, width=100, break_on_hyphens=False)


def register(sub) -> None:
    import argparse

    from ..store.files import REPORT_NAMES_HELP
    from ..store.kinds import AUTO, STORE_KINDS, reference_store_choices
    from ..defaults import SANDBOX_HELP
    from .workloads import FORMAT

    run_p = sub.add_parser(NAME, help=HELP, description=_wrapped(DESCRIPTION), epilog=f"{FORMAT}\n{SANDBOX_HELP}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # the workload format's columns kept
    run_p.add_argument("--reference", default="builtin:tiny", metavar="SPEC",
                       help="the reference's source spec (hf:, gguf:, served:, builtin:...), captured into OUT/runs/reference; "
                            "a source, not a RUN (default: %(default)s)")
    run_p.add_argument("--candidate", action="append", dest="candidates", metavar="SPEC",
                       help="candidate spec (repeatable; default: the bundled ladder); " + REPORT_NAMES_HELP)
    run_p.add_argument("--candidates-from", metavar="MODEL",
                       help="your own model (a GGUF file or a transformers directory) quantized to each --types entry with "
                            "llama.cpp's quantizer (as `logitdiff quantize`, made once into the cache), each added as a "
                            "gguf: candidate: the one-line ladder")
    run_p.add_argument("--types", metavar="T1,T2,...", help="the llama.cpp types of --candidates-from, e.g. Q8_0,Q4_K_M,Q2_K")
    run_p.add_argument("--floor", default="auto", metavar="auto|none|SPEC",
                       help="the cross-engine floor: the reference's own weights in another engine, scored like a candidate "
                            "(its own report; not twice when it is a candidate too), every candidate's x cross-engine floor "
                            "read against it. auto: builtin:tiny -> builtin:tiny-BF16; hf:DIR -> its GGUF BF16 export "
                            "(F32 for a float32 model) through llama.cpp; hf:FILE.gguf -> gguf:FILE.gguf; gguf:FILE -> "
                            "hf:FILE (transformers reading the same GGUF); a served reference: none (default: %(default)s)")
    run_p.add_argument("--workload", help="workload JSONL (default: the bundled workload)")
    run_p.add_argument("--out", default="logitdiff-out",
                       help="output directory: new, empty or an earlier run's (its reference capture is reused) (default: %(default)s)")
    run_p.add_argument("--max-tokens", type=int, default=None, help="generation budget per item, >= 1 (default: the item's, else 64)")
    run_p.add_argument("--positions", default="all", help="all | first | sample:FRAC with 0 < FRAC <= 1 (default: %(default)s)")
    run_p.add_argument("--reference-store", choices=reference_store_choices(), default=AUTO,
                       help="how OUT/runs/reference keeps the reference's logits, read back bit for bit whichever is chosen: "
                            + "; ".join(f"{name} ({STORE_KINDS[name].summary})" for name in reference_store_choices()[1:])
                            + f"; or {AUTO}: the most compact of these the reference allows (docs/bounds.md section 6); "
                            "reports are the same either way (default: %(default)s)")
    run_p.add_argument("--no-noise-floor", action="store_true",
                       help="skip the reference reruns (a rerun provably identical to the first is skipped anyway, the "
                            "reason stated; a reused reference capture brings the floor measured with it)")
    add_bootstrap(run_p)
    add_ranges(run_p)
    run_p.add_argument("--fresh", action="store_true", help="recapture the reference even if OUT/runs/reference matches")
    run_p.add_argument("--no-flips", action="store_true", help="skip branching at top-1 flips (and correctness)")
    run_p.add_argument("--no-correctness", action="store_true", help="skip grading free-running answers of labelled items")
    run_p.add_argument("--select", default="first", help="flips to branch from: first | all | top-kl:N | low-margin:N | sample:N (default: %(default)s)")
    add_max_branches(run_p)
    run_p.add_argument("--similarity", default="auto", choices=("auto", "minilm", "edit"), help="text similarity for flips (default: %(default)s)")
    add_judge(run_p)
    add_logprob_floor(run_p)
    add_gate_options(run_p, " (checked for every candidate)")
    run_p.set_defaults(func=run)


def rich_hooks(bars: Bars) -> Hooks:
    """The pipeline's progress callbacks (``pipeline.Hooks``) on the shared console (the
    class is made here: pipeline is imported when a run starts, not with the CLI)."""
    from ..pipeline import Hooks

    class RichHooks(Hooks):
        def __init__(self) -> None:
            self.t0 = time.time()
            self.con = console()

        def stage(self, text: str) -> None:
            self.con.print(f"[bold cyan]▶[/] [dim]{time.time() - self.t0:6.1f}s[/] {text}")

        def bar(self, total: int, text: str) -> Callable[[int], None]:
            return bars.bar(total, text)

    return RichHooks()


def run(args) -> int:
    from ..capture import check_max_tokens, parse_positions
    from ..pipeline import RunConfig, check_specs, default_candidates, run_pipeline

    ranges = parse_ranges_arg(args.ranges)
    check_bootstrap(args.bootstrap)
    check_max_tokens(args.max_tokens)
    parse_positions(args.positions)
    types = [t.strip() for t in (args.types or "").split(",") if t.strip()] or None
    candidates = args.candidates or ([] if args.candidates_from else default_candidates())
    cfg = RunConfig(
        reference=args.reference, candidates=candidates, workload=args.workload, out=args.out,
        max_tokens=args.max_tokens, positions=args.positions, noise_floor=not args.no_noise_floor, bootstrap=args.bootstrap,
        ranges=ranges, fresh=args.fresh, flips=not args.no_flips, correctness=not (args.no_correctness or args.no_flips),
        flip_select=args.select, max_branches=args.max_branches, similarity=args.similarity,
        logprob_floor=args.logprob_floor, reference_store=args.reference_store, floor=args.floor,
        candidates_from=args.candidates_from, types=types, judge=args.judge,
    )
    if not args.no_flips:  # flips.py (and what it imports) only for a run that branches
        from ..flips import parse_select

        parse_select(args.select)
    check_max_branches(args.max_branches)
    cfg.gates = parse_gate_args(args)
    check_specs(cfg)
    with Bars() as bars:
        summary = run_pipeline(cfg, rich_hooks(bars))
    print_run_summary(summary)
    con = console()
    _warn_cut(summary, con)
    con.print(f"wrote {args.out}/report.html, summary.md, summary.json and one report per candidate in {args.out}/reports/")
    if not cfg.gates:
        return 0
    return _gates_exit(summary, con)


def _gates_exit(summary: RunSummary, con: Console) -> int:
    """Each candidate's crossed gates with the metric's value and its not-evaluated gates
    with the reason (read from its report.json gates section; printed as ``compare`` prints
    them), and the exit status they give (gates.exit_status)."""
    from ..report import read_report
    from ..report.gates import exit_status
    from .options import print_gates

    sections = [(r["name"], read_report(r["report"]).get("gates")) for r in summary["candidates"]]
    print_gates(con, [(who, g) for who, g in sections if g])
    return exit_status([g for _, g in sections])


def _warn_cut(summary: RunSummary, con: Console) -> None:
    """Warn when most outputs hit the token budget, and say how benchmark items' functions
    reached the model (ToolForm: the reference's template decides, the same for every
    candidate; from the candidates' report.json), each line once."""
    from pathlib import Path

    from ..contracts import read_input_json
    from ..errors import LogitdiffError
    from .flips import TOOL_FORM_NOTE, consequence_notes

    seen = set()
    for r in summary["candidates"]:
        try:
            report = read_input_json(Path(r["report"]) / "report.json")
        except LogitdiffError:
            continue
        for line in consequence_notes(report):
            if line.startswith(("[yellow]warning", TOOL_FORM_NOTE)) and line not in seen:
                seen.add(line)
                con.print(f"{r['name']}: {line}" if "candidate answers" in line else line)


# the terminal's cells by the metric's table format (metric_registry.Metric.table_fmt)
_TERMINAL_FORMAT: dict[str, Callable[[Any], str]] = {
    "g": lambda x: f"{x:.3g}", "int": str, "p": lambda x: f"{x:.3g}", "x": lambda x: f"{x:.3g}", "ratio": lambda x: f"{x:.4f}",
    "pct": lambda x: f"{100 * x:.2f}%", "pct0": lambda x: f"{100 * x:.0f}%", "pct1": lambda x: f"{100 * x:.1f}%",
}


def _cell(x: Any, name: str) -> str:
    from ..report.metric_registry import METRICS

    return "n/a" if x is None else _TERMINAL_FORMAT[METRICS[name].table_fmt](x)


def _consequence_cell(r: CandidateRow, name: str) -> str:
    """A cell of the consequence table: an outcome from the row's flip_outcomes, the two
    accuracies side by side, or the row's field."""
    from ..contracts import Outcome
    from ..report.metric_registry import ACCURACY_PAIR, ATTRIBUTED
    from ..report.verdict import attributed_cell

    row = cast("dict[str, Any]", r)
    if name in Outcome.ALL:
        return str((row.get("flip_outcomes") or {}).get(name, "n/a"))
    if name == ATTRIBUTED:
        return attributed_cell(row.get(ATTRIBUTED))
    if name == ACCURACY_PAIR.name:
        ref, cand = row.get(ACCURACY_PAIR.ref), row.get(ACCURACY_PAIR.cand)
        return "n/a" if ref is None or cand is None else f"{_cell(ref, ACCURACY_PAIR.ref)} → {_cell(cand, ACCURACY_PAIR.cand)}"
    return _cell(row.get(name), name)


def _print_fitting(con: Console, title: str, labels: list[str], headers: list[str], rows: list[list[str]]) -> None:
    """One table of a candidate column (``labels``) and ``headers``' columns: whole when it fits
    the console on one line a cell, else each column at its narrowest (its longest word:
    headers and cells wrap between words) and, where even that is too wide, as consecutive
    tables of as many columns as fit, each repeating the candidate column. Left to itself, rich
    cuts the widest columns' words ("branc…") and crops the right-hand columns off (a 120-column
    terminal, or a pipe's 160, holds ~12)."""
    from rich.cells import cell_len
    from rich.table import Table

    columns = [[h, *(cells[k] for cells in rows)] for k, h in enumerate(headers)]
    natural = [max(cell_len(t) for t in col) for col in columns]
    least = [max(cell_len(w) for t in col for w in t.split() or [""]) for col in columns]
    # each row shows the part of its name that differs (a shared start folded to …), folded
    # onto more lines rather than cut, so no two rows read alike on a narrow terminal
    width = min(max((cell_len(s) for s in labels), default=9), 28)
    first = max(width, len("candidate")) + 4  # the candidate column, its padding and both rules
    fits = first + sum(n + 3 for n in natural) <= con.width

    def table(cols: list[int], heading: str) -> Table:
        t = Table(title=heading)
        t.add_column("candidate", justify="left", min_width=width, overflow="fold")
        for k in cols:
            t.add_column(headers[k], justify="right", width=None if fits else least[k])
        for label, cells in zip(labels, rows):
            t.add_row(label, *(cells[k] for k in cols))
        return t

    groups: list[list[int]] = [[]]
    used = first
    for k in range(len(headers)):
        if groups[-1] and used + least[k] + 3 > con.width:
            groups.append([])
            used = first
        groups[-1].append(k)
        used += least[k] + 3
    for n, cols in enumerate(groups, 1):
        con.print(table(cols, title if len(groups) == 1 else f"{title} ({n} of {len(groups)})"))


def print_run_summary(summary: RunSummary) -> None:
    """The run's tables on the terminal: drift, then what it does (columns: the metric
    registry's summary tables, with their headers and formats)."""
    from ..report.metric_registry import DRIFT_TABLE, consequence_columns, header
    from ..report.names import distinct_names

    nf = summary.get("noise_floor")
    title = f"drift from {summary['reference']} — {summary['items']} items, {summary['positions']} positions"
    if nf:
        title += f"; noise floor mean KL {nf['kl_nats_mean']:.3g}"
    shown = distinct_names([r.get("name") or r["candidate"] for r in summary["candidates"]])
    headers: list[str] = []
    for name in DRIFT_TABLE:
        headers.append(header(name))
        if name == "kl_mean":
            headers.append("95% CI")
    rows = []
    for r in summary["candidates"]:
        row = cast("dict[str, Any]", r)
        cells = []
        for name in DRIFT_TABLE:
            cells.append(_cell(row.get(name), name))
            if name == "kl_mean":
                ci = r["kl_mean_ci95"]
                cells.append("n/a" if ci[0] is None else f"[{_cell(ci[0], name)}, {_cell(ci[1], name)}]")
        rows.append(cells)
    con = table_console()
    _print_fitting(con, title, shown, headers, rows)
    g = lambda x: "n/a" if x is None else f"{x:.3g}"  # noqa: E731
    # a served candidate's drift is read against the servers' own batch arithmetic (summary.md says the same)
    for r in summary["candidates"]:
        if "x_served_floor" in r:
            con.print(f"{r.get('name') or r['candidate']}: {g(r['x_served_floor'])} × served floor"
                      + (" — within 2×: not distinguishable from the servers' batch arithmetic" if r.get("within_2x_served_floor") else ""),
                      highlight=False)
    if any("flip_outcomes" in r or "accuracy_cand" in r for r in summary["candidates"]):
        from ..pipeline import accuracy_measure

        columns = consequence_columns(summary["candidates"])
        measure = accuracy_measure(summary["candidates"])
        _print_fitting(con, "what the drift does: branches from top-1 flips, and free-running answers", shown,
                       [header(name, measure) for name in columns],
                       [[_consequence_cell(r, name) for name in columns] for r in summary["candidates"]])
    print_verdicts(summary, con)


def _row_as_report(r: CandidateRow) -> dict[str, Any]:
    """The report.json fields a verdict reads, from a summary.json candidate row."""
    rep: dict[str, Any] = {"summary": {"metrics": {"kl_nats": {"mean": r.get("kl_mean")}}, "kl_mean_x_noise_floor": r.get("x_noise_floor")}}
    if "flip_outcomes" in r:
        rep["flips"] = {"n_branches": r.get("flip_branches"), "outcomes": r["flip_outcomes"],
                        "meaning_judged_by": r.get("flip_meaning_judged_by")}
    if r.get("accuracy_cand") is not None:
        rep["correctness"] = {k: r.get(k) for k in ("accuracy_ref", "accuracy_cand", "right_to_wrong", "wrong_to_right", "mcnemar_p",
                                                    "right_to_truncated", "accuracy_ref_ci", "accuracy_cand_ci", "attributed")}
        rep["correctness"]["measure"] = r.get("correctness_measure")
    return rep


def print_verdicts(summary: RunSummary, con: Console) -> None:
    """One verdict line per candidate (report.verdict), as at the top of report.html."""
    from ..report.verdict import verdict_text

    xf = cef["candidate"] if (cef := summary.get("cross_engine_floor")) else None
    for r in summary["candidates"]:
        text = verdict_text(_row_as_report(r), x_cross_engine_floor=r.get("x_cross_engine_floor"),
                            is_cross_engine_floor=r["candidate"] == xf)
        con.print(f"[bold]{r.get('name') or r['candidate']}[/]: {text}", highlight=False)
