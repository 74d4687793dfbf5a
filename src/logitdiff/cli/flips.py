"""``logitdiff flips``: what the top-1 flips of a comparison do, and correctness flips."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import LogitdiffError
from .console import Bars, console, table_console
from .options import add_gate_options, add_judge, add_max_branches, check_max_branches, gate_exit, parse_gate_args

if TYPE_CHECKING:
    from ..contracts import Report

NAME = "flips"
HELP = "branch at top-1 flips and classify what they do; grade labelled answers"

FLIPS_DESCRIPTION = """\
Branch at the top-1 flips of a REPORT (positions where the candidate's winner differs from
the reference's and from the token the reference wrote): from prompt + teacher[:t] + the
candidate's winner, the candidate continues greedily; the reference's own continuation (the
teacher) is the control. Flips behind answers or tool calls that changed come first, then
one per item, then the highest KL; what --max-branches leaves out is listed. Each branch is
classified, with the signals that decided it, by rules anyone can re-run, as

  recovered            re-joins the reference (--resync common tokens, at most --max-shift
                       tokens out of line) and stays joined to the end of the shorter output
                       (later detours re-join within --max-detour tokens, >= 80 % of the
                       tokens after the flip joined, or all but 2 of them near the end of the
                       budget; at least --resync tokens joined), and the item's checker, where
                       it has one, gives both outputs the same verdict (re-joined word salad
                       with a content word on one side only is not recovered)
  answer_same          did not stay joined; the item's checker (answer / numeric / regex
  answer_changed       label, tool-call label or the reference's valid call, BFCL's own
                       checker) finds the same answer / another answer
  tests_passed         did not stay joined, item with a 'tests' label (HumanEval): the
  tests_failed         branch's program run by the item's tests in the sandbox (the
                       reference's verdict is recorded beside it)
  tool_call_malformed  the reference's call was schema-valid; the branch's does not parse
                       or violates the tool's JSON schema
  tool_call_changed    valid, but another function or other arguments (AST check, BFCL-style)
  diverged             did not stay joined, and the item has no checker: its meaning is not
                       judged. decided_by records what was observed (where it left, salient
                       differences in numbers, names, literals and negations, similarity)

benign / meaning_changed are not decided by these rules: only a named judge (--judge) turns
a diverged branch into one of them, and the report names the judge.

Similarity (--similarity auto), recorded as an observation: edit similarity on items tagged
code or tool, on repetitive text and on texts of a word or two; MiniLM on prose when the
optional extra is installed.

{agreement}

Ties are not flips: where the reference's margin p(top1) - p(top2) is within the bf16
spacing at p(top1) (0 included), the engines only broke a tie. Ties are counted and listed
apart, not branched (unless --branch-ties), and never counted in outcomes or gates.

Labelled items are also graded free-running (both models, greedy; an output that hit its
token budget and is not right is graded 'truncated', not wrong): accuracy of each,
correctness flips right->wrong / wrong->right with an exact McNemar test, and whether
each correctness flip starts at a teacher-forced top-1 flip.

Writes REPORT/flips.parquet (one row per branch, texts and signals),
REPORT/correctness.parquet, and adds "flips" and "correctness" sections to
REPORT/report.json and report.md. The candidate is re-opened from the report's
candidate spec (override with --candidate).
"""


def register(sub) -> None:
    import argparse
    import textwrap

    from ..defaults import MAX_DETOUR, MAX_SHIFT, MIN_RUN, FLIP_AGREEMENT_TEXT
    from ..defaults import DEFAULT_THRESHOLDS
    from ..defaults import SANDBOX_HELP

    description = FLIPS_DESCRIPTION.replace("{agreement}", textwrap.fill(FLIP_AGREEMENT_TEXT, 92))
    f = sub.add_parser(NAME, help=HELP, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=SANDBOX_HELP)
    f.add_argument("report", metavar="REPORT", help="REPORT directory written by compare or run")
    f.add_argument("--select", default="first",
                   help="first (first flip of each item) | all | top-kl:N | low-margin:N | sample:N (default: %(default)s)")
    add_max_branches(f)
    f.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per branch (default: what is left of the item's budget, so both outputs end alike)")
    f.add_argument("--both", action="store_true",
                   help="also let the reference continue from the candidate's token (separates a poisoned token from drift)")
    f.add_argument("--resync", type=int, default=MIN_RUN, help="common tokens that count as re-joining the reference (default: %(default)s)")
    f.add_argument("--max-shift", type=int, default=MAX_SHIFT,
                   help="a re-join is aligned when its offsets in branch and reference differ by at most this many tokens (default: %(default)s)")
    f.add_argument("--max-detour", type=int, default=MAX_DETOUR,
                   help="after re-joining, a detour must re-join within this many tokens, else the branch left (default: %(default)s)")
    f.add_argument("--branch-ties", action="store_true",
                   help="also branch at ties of the reference (reported apart, never in outcomes or gates)")
    f.add_argument("--similarity", default="auto", choices=("auto", "minilm", "edit"),
                   help="MiniLM embeddings (optional extra 'similarity'), normalised edit similarity, or auto (default: %(default)s)")
    f.add_argument("--similarity-threshold", type=float, default=None,
                   help="below this, meaning changed; replaces every default "
                   f"({DEFAULT_THRESHOLDS['minilm']:.2f} for MiniLM, {DEFAULT_THRESHOLDS['edit']:.2f} for edit)")
    f.add_argument("--candidate", metavar="SPEC", help="candidate source (default: the report's candidate spec)")
    f.add_argument("--reference", metavar="SPEC", help="reference source for --both (default: the report's reference spec)")
    f.add_argument("--no-correctness", action="store_true", help="skip grading free-running answers")
    f.add_argument("--exec-timeout", type=float, default=5.0, help="seconds per executed tool call (items with tools_module)")
    f.add_argument("--seed", type=int, default=0, help="seed of sample:N and the bootstrap (default: %(default)s)")
    add_judge(f)
    add_gate_options(f)
    f.set_defaults(func=run)


def run(args) -> int:
    from ..flips.consequences import Settings, analyse_report_dir
    from ..report import rewrite_report_dir
    from ..flips import parse_select
    from ..store.files import Kind, is_kind, locked

    settings = Settings(
        select=args.select,
        max_branches=args.max_branches,
        max_tokens=args.max_tokens,
        both=args.both,
        resync=args.resync,
        max_shift=args.max_shift,
        max_detour=args.max_detour,
        branch_ties=args.branch_ties,
        seed=args.seed,
        exec_timeout=args.exec_timeout,
    )
    parse_select(args.select)
    gates = parse_gate_args(args)
    if args.resync < 1:
        raise LogitdiffError("--resync must be >= 1")
    if args.max_shift < 0 or args.max_detour < 0:
        raise LogitdiffError("--max-shift and --max-detour must be >= 0")
    check_max_branches(args.max_branches)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise LogitdiffError("--max-tokens must be >= 1")
    if not args.exec_timeout > 0:
        raise LogitdiffError("--exec-timeout must be > 0 seconds")
    if args.similarity_threshold is not None and not 0.0 <= args.similarity_threshold <= 1.0:
        raise LogitdiffError("--similarity-threshold must be in [0, 1]")

    if not is_kind(Path(args.report), Kind.REPORT):
        from ..report import read_report

        read_report(args.report)  # the one-line error saying what is wrong with it

    # flips rewrites files of the REPORT it reads: one writer per REPORT at a time.
    with locked(Path(args.report)), _judge(args.judge) as judge, Bars() as bars:
        result = analyse_report_dir(
            args.report, candidate=args.candidate, reference=args.reference, settings=settings,
            similarity=args.similarity, similarity_threshold=args.similarity_threshold,
            correctness=not args.no_correctness, bar=bars.bar, gates=gates, judge=judge,
        )
        rewrite_report_dir(args.report, result.report, result.columns, result.files, remove=result.remove)
    report = result.report
    print_flips(report)
    console().print(f"wrote {args.report}/flips.parquet" + (", correctness.parquet" if report.get("correctness") else "")
                    + " and updated report.json, report.md, report.html")
    return gate_exit([report])


def _judge(spec: str | None):
    """The open judge of --judge (opened and asked once before any work), or none."""
    import contextlib

    if spec is None:
        return contextlib.nullcontext()
    from ..flips.judge import open_judge

    return open_judge(spec)


def print_flips(report: Report) -> None:
    from rich.table import Table

    from ..contracts import Outcome

    f = report["flips"]
    ties = f" and {f['n_ties']} ties" if f.get("n_ties") else ""
    t = Table(title=f"{f['n_flips']} flips{ties}, {f['n_branches']} branches ({f['selection']})")
    t.add_column("outcome")
    t.add_column("branches", justify="right")
    t.add_column("rate", justify="right")
    for o in (o for o in Outcome.ALL if o in f["outcomes"]):
        r = f["rates"].get(o)
        t.add_row(o, str(f["outcomes"][o]), "n/a" if r is None else f"{100 * r:.1f}%")
    con = table_console()
    con.print(t)
    judge = f.get("meaning_judged_by")
    con.print(f"meaning judged by {judge}" if judge else
              "meaning not judged (no --judge): diverged branches carry what was observed in decided_by")
    c = report.get("correctness")
    if c:
        from ..report.verdict import answers_part

        # the verdict's words (every change listed, right->truncated included, and what each is attributed to)
        said = answers_part(report)
        con.print(f"correctness: {said[1] if said else 'no labelled answers graded'}; {c['flips_starting_at_top1_flip']} of "
                  f"{c['correctness_flips']} start at a top-1 flip", highlight=False)
    for line in consequence_notes(report):
        con.print(line)
    j = f.get("judge")
    if j:
        con.print(f"judge {j['spec']} ({j['model'].get('model')}): {j['n_judged']} diverged branches judged "
                  f"({j['verdicts']['same']} same, {j['verdicts']['different']} different, {j['verdicts']['unparsed']} unparsed); "
                  f"{j['agreement_text']}")


TOOL_FORM_NOTE = "functions shown to the model"  # the note on correctness.tool_forms (contracts.ToolForm)


def consequence_notes(report: Mapping[str, Any]) -> list[str]:
    """Warnings and notes a reader of the terminal needs: outputs cut by the budget, flips
    left out by the cap, changed answers without a branch, the reference's self-consistency
    (read leniently: any report.json, sections missing or from an older version)."""
    out = []
    f = report.get("flips") or {}
    c = report.get("correctness") or {}
    cut = f.get("outputs_cut") or {}
    if cut.get("n_items") and cut["reference_cut"] * 2 > cut["n_items"]:
        out.append(f"[yellow]warning:[/] {cut['reference_cut']} of {cut['n_items']} reference outputs hit the token budget: "
                   "most outputs were cut, so answers and tool calls are incomplete (graded 'truncated', not wrong); "
                   "capture with a larger max_tokens")
    if c.get("n_labelled") and c.get("cut_cand", 0) * 2 > c["n_labelled"]:
        out.append(f"[yellow]warning:[/] {c['cut_cand']} of {c['n_labelled']} candidate answers hit the token budget "
                   f"({c.get('budget_tokens') or 'per item'} tokens): {c['truncated_cand']} graded 'truncated', not wrong")
    for d in (c.get("tool_forms") or {}).values():
        out.append(f"{TOOL_FORM_NOTE} ({d['n']} benchmark items): {d['means']}")
    lo = f.get("left_out") or {}
    if lo.get("n"):
        out.append(f"{lo['n']} selected flips in {lo['n_items']} items left out by --max-branches (listed in report.json flips.left_out)")
    missed = [x for x in f.get("changed_items") or [] if not x["branched"]]
    if missed:
        out.append(f"{len(missed)} items whose answer or tool call changed have no branch: "
                   + "; ".join(f"{x['item_id']} ({x['why_not']})" for x in missed[:5]))
    sc = f.get("reference_self_consistency") or {}
    if sc.get("n_written_not_top1"):
        out.append(f"reference self-consistency: at {sc['n_written_not_top1']} of {sc['n_positions']} positions the reference "
                   f"wrote a token that is not its own scored top-1 ({sc['n_candidate_wrote_it']} of them not flips: the "
                   "candidate picked the written token)")
    return out
