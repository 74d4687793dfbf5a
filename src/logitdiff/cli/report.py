"""``logitdiff report``: one self-contained HTML page from REPORT directories."""

from __future__ import annotations

from pathlib import Path

from ..errors import LogitdiffError
from ..contracts import RunSummary, load_summary, read_input_json
from .console import console

NAME = "report"
HELP = "one self-contained HTML page comparing REPORT directories"

DESCRIPTION = """\
Write one self-contained HTML page (plotly inlined, no network access needed or allowed)
that compares the candidates of one or more REPORT directories, as written by
`logitdiff compare` or `logitdiff run`: first one verdict line per candidate (drift × the
cross-engine floor, else × the noise floor; branched flips that changed the meaning or a
tool call; accuracy, correctness flips and whether McNemar calls the change significant),
then two sortable tables that fit a 1,400 px window: drift (mean/p95/p99 KL forward and
reverse, JSD, top-1 disagreement with 95 % CIs, × noise floor, × cross-engine floor, PPL
ratio, file size) and what the drift does (flips, branches and outcomes, ties, accuracy,
correctness flips, valid tool calls, where recorded); what was compared (reference,
workload, method, noise floor, versions), whether neighbouring candidates can be told
apart on this many items, plots (KL CDF, KL and top-1 disagreement by output range, drift
by the reference's confidence, flip outcomes by tag, KL vs file size) and the worst items
token by token.

A REPORT_DIR may also be the OUT directory of `logitdiff run`: it stands for all its
reports/*, in the run's order, and its summary.json is used for the cross-engine floor.

Reports are refused (exit status 2) unless they share the report schema, the workload
(item ids, reference tokenizer, teacher tokens) and the method (full vocabulary, or top-K
with the same K): make one page per method.
"""

EPILOG = """\
examples:
  logitdiff report logitdiff-out --out ladder.html
  logitdiff report reports/q8 reports/q4 --out q8-vs-q4.html --title "Q8_0 vs Q4_K_M"
"""


def expand_report_dirs(args: list[str]) -> tuple[list[Path], RunSummary | None]:
    """REPORT dirs from the command line; a `run` OUT dir expands to its reports.

    Returns the report dirs and the run summary.json that covers all of them, if any."""
    dirs: list[Path] = []
    summary: RunSummary | None = None
    for a in args:
        p = Path(a)
        if (p / "report.json").is_file():
            dirs.append(p)
        elif (p / "reports").is_dir():
            s = load_summary(p / "summary.json") if (p / "summary.json").is_file() else None
            found = {d.name: d for d in sorted((p / "reports").iterdir()) if (d / "report.json").is_file()}
            if not found:
                raise LogitdiffError(f"{p}/reports: no REPORT directories (no */report.json)")
            cands = (s.get("candidates") or []) if s else []
            order = [n for c in cands if isinstance(n := c.get("name"), str) and n in found]
            dirs.extend(found[n] for n in order + [n for n in found if n not in order])
            summary = summary or s
        elif p.exists():
            raise LogitdiffError(f"{p}: not a REPORT directory (no report.json) nor a `logitdiff run` output (no reports/)")
        else:
            raise LogitdiffError(f"{p}: no such directory")
    if summary is None:
        summary = find_summary(dirs)
    return dirs, summary


def find_summary(dirs: list[Path]) -> RunSummary | None:
    """The run summary.json next to the reports, when every report dir is one of its candidates."""
    parents = {d.resolve().parent for d in dirs}
    if len(parents) != 1:
        return None
    parent = parents.pop()
    f = parent.parent / "summary.json"
    if parent.name != "reports" or not f.is_file():
        return None
    s = load_summary(f)
    names = {c.get("name") for c in s.get("candidates") or []}
    return s if all(d.name in names for d in dirs) else None


def run(args) -> int:
    try:
        return _run(args)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as e:
        raise _damaged_input(args, e) from None


def _damaged_input(args, e: BaseException) -> LogitdiffError:
    """A report.json or summary.json that parses but cannot be rendered (doctored, or from
    another tool): only now is every input checked against its JSON Schema, to name the
    first field at fault (the happy path pays nothing for it)."""
    from ..contracts import migrate_report, validate

    docs = []
    for a in args.report_dirs:
        for name, schema in (("report.json", "report"), ("summary.json", "summary")):
            p = Path(a) / name
            docs.append((p, schema))
    if args.summary:
        docs.append((Path(args.summary), "summary"))
    for p, schema in docs:
        if not p.is_file():
            continue
        try:
            doc = read_input_json(p)
        except LogitdiffError:
            return LogitdiffError(f"{p}: not JSON this logitdiff reads (damaged?)")
        try:
            if schema == "report":
                doc = migrate_report(doc, p)  # a 1.x report is checked as the 2.0 report it is read as
            validate(doc, schema, str(p))
        except RecursionError:
            return LogitdiffError(f"{p}: nested too deeply (damaged?)")
        except LogitdiffError as err:
            return err
    msg = " ".join(str(e).split())[:160]
    return LogitdiffError(f"{', '.join(args.report_dirs)[:200]}: report data this logitdiff cannot render "
                          f"({type(e).__name__}: {msg}); was report.json or tokens.parquet edited?")


CHECKED_ROWS = 1000  # rows of a report.json checked against the schema before rendering


def _check_input(path: Path, schema: str) -> None:
    """A report.json against its JSON Schema, after the migration of a 1.x report
    (contracts.migrate_report): every field but the per-position rows, of which the first
    CHECKED_ROWS (a row that breaks rendering later is named then, by _damaged_input); a
    one-line error naming the first field at fault."""
    from ..contracts import migrate_report, validate

    doc = read_input_json(path)  # a regular file of a bounded size, JSON: else one line naming it
    if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
        doc = {**doc, "rows": doc["rows"][:CHECKED_ROWS]}
    if schema == "report":
        doc = migrate_report(doc, path)
    validate(doc, schema, str(path))


def _run(args) -> int:
    from ..contracts import validate
    from ..store.files import Kind, reserved
    from ..report.html import write_html

    dirs, summary = expand_report_dirs(args.report_dirs)
    for d in dirs:  # a doctored report.json is an error, not a page of wrong numbers
        _check_input(d / "report.json", "report")
    # The REPORT directories actually read (a `run` OUT stands for its reports/*, so its
    # report.html may be rewritten) and --summary are inputs --out must stay clear of.
    inputs = [*dirs, *([args.summary] if args.summary else [])]
    # --out guarded and locked while the page is rendered, not only while it is written
    with reserved(args.out, Kind.HTML, inputs=inputs):
        if args.summary:
            summary = load_summary(Path(args.summary))
        if summary is not None:
            validate(summary, "summary", str(args.summary or "summary.json"))
        out = write_html(dirs, args.out, summary=summary, title=args.title, inputs=inputs)
    size = out.stat().st_size
    console().print(f"wrote {out} ({len(dirs)} candidate{'s' if len(dirs) != 1 else ''}, {size / 1e6:.1f} MB)")
    return 0


def register(sub) -> None:
    import argparse

    r = sub.add_parser(
        NAME,
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("report_dirs", nargs="+", metavar="REPORT_DIR", help="REPORT directories, or the OUT directory of `logitdiff run`")
    r.add_argument("--out", required=True, metavar="FILE", help="HTML file to write: new, or a page logitdiff wrote (replaced via a temporary file and a rename); "
                   "never a directory, another file or one of the inputs")
    r.add_argument("--title", metavar="T", help="page title (default: drift from <reference spec>)")
    r.add_argument("--summary", metavar="PATH", help="run summary.json to use (default: found next to the reports when it lists them)")
    r.set_defaults(func=run)
