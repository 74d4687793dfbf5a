"""``logitdiff workloads``: the workloads a run can take, and checking one you wrote."""

from __future__ import annotations

import json
import sys
from collections import Counter

from .console import console, progress, table_console

NAME = "workloads"
HELP = "list the bundled workloads, check a workload file, print its JSON Schema"

FORMAT = """\
A workload is a JSONL file: one JSON object per line (an item), blank lines skipped.
  id            string, required, unique in the file
  prompt        raw text fed as is            } exactly one of the two
  messages      [{"role", "content"}, ...]    } (a chat, rendered with the model's chat template)
  tags          ["code", "math", ...]         groups the report summarises by (optional)
  max_tokens    positive integer              the item's output budget (default: --max-tokens)
  tools         [{"type": "function", "function": {"name", "description", "parameters"}}]
  tools_module  path of a Python file implementing the tools (relative to the workload)
  expected      a label, exactly one of:  {"answer": "42"}  {"regex": "..."}
                {"numeric": 3.5, "tol": 1e-6}  {"tool_call": {"name", "arguments"}}
                {"tool_calls": [...]}  (answers are graded against it; see docs)
Example:
  {"id": "add-1", "prompt": "2 + 2 =", "tags": ["math"], "max_tokens": 8, "expected": {"numeric": 4}}
  {"id": "chat-1", "messages": [{"role": "user", "content": "Name a prime."}], "tags": ["prose"]}
"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser(NAME, help=HELP, description=HELP + ".", epilog=FORMAT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    wsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = wsub.add_parser("validate", help="check every record of a workload file (one line per problem)",
                        description="Check every record of a workload file: one line per bad record naming the "
                                    "line, the item and the field; exit status 2 when any record is bad.",
                        epilog=FORMAT, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("file", help="workload JSONL file")
    v.set_defaults(func=run_validate)
    ls = wsub.add_parser("list", help="the workloads bundled with logitdiff (usable as --workload NAME)")
    ls.set_defaults(func=run_list)
    sc = wsub.add_parser("schema", help="print the JSON Schema of a workload record")
    sc.set_defaults(func=run_schema)
    ck = wsub.add_parser("check", help="grade a benchmark's own ground truth through logitdiff's grader (all must pass)",
                         description="Grade a benchmark's ground truth (HumanEval's canonical solutions, BFCL's "
                                     "possible answers written as tool calls) through the same path a model's answers "
                                     "take; every item must pass. A grader that fails its "
                                     "ground truth is a bug: the items that failed are named, exit status 1.")
    ck.add_argument("name", metavar="NAME[:N]", help="a benchmark (logitdiff workloads list)")
    ck.set_defaults(func=run_check)


def run_validate(args) -> int:
    from ..workload.validate import validate_workload

    check = validate_workload(args.file)
    out = console()
    for line in check.errors:
        out.print(f"[red]error:[/] {line}", markup=True, highlight=False, soft_wrap=True)
    for line in check.warnings:
        out.print(f"[yellow]warning:[/] {line}", markup=True, highlight=False, soft_wrap=True)
    if not check.ok:
        out.print(f"{args.file}: {len(check.errors)} bad record(s), {len(check.items)} good", highlight=False)
        return 2
    tags = Counter(t for item in check.items for t in item.tags)
    labelled = sum(item.expected is not None for item in check.items)
    tag_text = ", ".join(f"{t} {n}" for t, n in sorted(tags.items())) or "none"
    print(f"{args.file}: {len(check.items)} items valid; {labelled} labelled; tags: {tag_text}")
    return 0


def run_list(args) -> int:
    from rich.table import Table

    from ..workload.catalog import bundled_workloads

    table = Table(title="bundled workloads (--workload NAME)")
    for col in ("name", "items", "labelled", "tags", "file"):
        table.add_column(col)
    for w in bundled_workloads():
        table.add_row(w.name, str(w.items), str(w.labelled), w.tags, w.path)
    table_console().print(table)
    from ..workload.benchmarks import BENCHMARKS, installed

    bt = Table(title="benchmarks (--workload NAME[:N]: the first N items), graded by their own rules")
    for col in ("name", "package", "installed", "what"):
        bt.add_column(col)
    for b in BENCHMARKS.values():
        bt.add_row(b.name, b.package, "yes" if installed(b) else f"no ({b.install_hint})", b.about)
    table_console().print(bt)
    return 0


def run_check(args) -> int:
    """Every ground truth through the grader; a benchmark shown in several tool forms
    (ToolForm: BFCL's chat-template tools and its plain prompt) is checked in each, one line each."""
    from ..contracts import ToolForm
    from ..flips.groundtruth import check_ground_truth
    from ..workload.benchmarks import parse_benchmark

    parsed = parse_benchmark(args.name)
    forms: tuple[str | None, ...] = (parsed[0].tool_forms if parsed else ()) or (None,)
    bad = 0
    for form in forms:
        bar, advance = progress(None, f"grading {args.name}'s ground truth" + (f" ({ToolForm.MEANS[form]})" if form else ""))
        with bar:
            result = check_ground_truth(args.name, progress=advance, tool_form=form)
        for item_id, why in result.failed:
            console().print(f"[red]fail:[/] {item_id}: {why}", highlight=False, soft_wrap=True)
        for item_id, why in result.unpassable:
            console().print(f"[yellow]no answer can pass:[/] {item_id}: {why}", highlight=False, soft_wrap=True)
        n, failed, none = result.n_items, len(result.failed), len(result.unpassable)
        bad += failed
        print(f"{args.name}: {n - failed - none} of {n - none} ground-truth answers pass the grader"
              + ("" if not failed else f"; {failed} fail")
              + ("" if not none else f"; {none} more the benchmark's own data leaves no passing answer for (rejected, as it must)")
              + (f" [{ToolForm.MEANS[form]}]" if form else ""))
    return 1 if bad else 0


def run_schema(args) -> int:
    from ..workload.validate import workload_schema

    json.dump(workload_schema(), sys.stdout, indent=1)
    print()
    return 0
