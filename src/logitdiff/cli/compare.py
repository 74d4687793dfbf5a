"""``logitdiff compare``: a candidate RUN (or a live source) against a reference RUN -> REPORT."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ..api import check_bootstrap, check_device
from .console import Bars, console, table_console

if TYPE_CHECKING:
    from ..contracts import Report
from .options import add_bootstrap, add_chunk_size, add_gate_options, add_logprob_floor, add_ranges, check_at_least, gate_exit, parse_gate_args, parse_ranges_arg

NAME = "compare"
HELP = "compare a candidate RUN with a reference RUN and write a REPORT directory"
DESCRIPTION = (
    "Check that two captures are comparable (same vocabulary and tokenizer, same teacher "
    "tokens at every position) and write REPORT/report.json (the seed report's keys and "
    "fields, extended), REPORT/tokens.parquet (one row per position) and REPORT/report.md. "
    "Full logits on both sides give exact full-vocabulary metrics; top-K on either side "
    "uses the seed's top-K approximation with a tail bucket, plus proven intervals "
    "(*_lower_nats, *_upper_nats; inf where nothing bounds the tail); a compact reference "
    "(capture --store compact) against a full candidate gives each divergence with its proven "
    "interval (docs/bounds.md). The report names the method; other pairings are refused."
)


def register(sub) -> None:
    from ..compare import DEFAULT_TOP_LOGPROBS

    c = sub.add_parser(NAME, help=HELP, description=DESCRIPTION)
    c.add_argument("reference", help="reference RUN directory")
    c.add_argument("candidate", help="candidate RUN directory, or a source SPEC scored live against the reference (nothing stored)")
    c.add_argument("--out", required=True, help="REPORT directory to write: new, empty or a REPORT (replaced only when the new one is "
                   "complete); never another directory, a file or one of the runs read")
    add_ranges(c)
    add_bootstrap(c)
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    c.add_argument("--top-k", "--top-logprobs", dest="top_logprobs", type=int, default=None, metavar="K",
                   help=f"K of the seed's top-K fields, 1..V (default: {DEFAULT_TOP_LOGPROBS}, or V when smaller; "
                   "--top-logprobs is its old name)")
    c.add_argument("--noise-floor", metavar="RUN",
                   help="a rerun of the reference (e.g. `capture REF_SPEC --reference REF_RUN --batch 3`: other batch mates, "
                        "where a plain rerun on CPU is bit-identical): its drift is printed beside the candidate's")
    c.add_argument("--allow-partial", action="store_true", help="accept runs marked partial (stated in the report)")
    c.add_argument("--no-rows", action="store_true", help="omit per-position rows from report.json (tokens.parquet keeps them)")
    c.add_argument("--device", default=None, help="torch device for the metrics: cpu, cuda or cuda:N (default: cpu)")
    c.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the metrics (default: the CPUs this process may run on)")
    add_logprob_floor(c)
    add_gate_options(c)
    add_chunk_size(c)
    c.set_defaults(func=run)


def run(args) -> int:
    from ..api import diff_runs
    from ..compare import check_floor_value

    # Every argument and input is checked before anything is computed or written.
    ranges = parse_ranges_arg(args.ranges)
    gates = parse_gate_args(args)
    check_bootstrap(args.bootstrap)
    check_at_least("--top-k", args.top_logprobs, 1)
    check_at_least("--threads", args.threads, 1)
    check_device(args.device)
    check_floor_value(args.logprob_floor)
    with Bars() as bars:
        report = diff_runs(
            args.reference, args.candidate, args.out, noise_floor=args.noise_floor, ranges=ranges, bootstrap=args.bootstrap,
            seed=args.seed, top_logprobs=args.top_logprobs, allow_partial=args.allow_partial, include_rows=not args.no_rows,
            device=args.device, chunk_size=args.chunk_size, gates=gates, threads=args.threads, bar=bars.bar,
            logprob_floor=args.logprob_floor,
        )
    print_summary(report)
    console().print(f"wrote {args.out}/report.json, tokens.parquet, report.md, report.html")
    return gate_exit([report])


def print_summary(report: Report) -> None:
    from rich.table import Table

    s = report["summary"]
    t = Table(title=f"{report['candidate'].get('spec')} vs {report['reference'].get('spec')}  ({report['method']['kind']})")
    for col in ("positions", "mean KL", "95% CI", "p99 KL", "max KL", "mean JSD", "top-1 disagr."):
        t.add_column(col, justify="right")
    groups: list[Mapping[str, Any]] = [{"group": "all", "n": s["positions"], **s["metrics"],
                                        "top1_disagreement": s["top1_disagreement"]}]
    for r in groups + [g for g in report["ranges"] if g.get("n")]:
        kl = r.get("kl_nats") or {}
        js = r.get("jsd_nats") or {}
        t1 = r.get("top1_disagreement") or {}
        ci = kl.get("ci95") or [None, None]
        fmt = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
        t.add_row(
            f"{r['group']}: {r.get('n', 0)}",
            fmt(kl.get("mean")),
            "n/a" if ci[0] is None else f"[{fmt(ci[0])}, {fmt(ci[1])}]",  # (rich reads "[n/a, n/a]" as markup)
            fmt(kl.get("p99")),
            fmt(kl.get("max")),
            fmt(js.get("mean")),
            "n/a" if t1.get("rate") is None else f"{100 * t1['rate']:.2f}%",
        )
    table_console().print(t)
    # a label that changes what the figures mean belongs beside them, not only in report.json
    for note in report["method"].get("notes") or []:
        if note.startswith(("speculation not exercised", "no positions compared")):
            console().print(f"[yellow]note:[/] {note}")
