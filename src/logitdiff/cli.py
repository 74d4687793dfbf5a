"""The ``logitdiff`` command line: one function per command, no logic of its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .errors import LogitdiffError

EPILOG = """\
Typical use:
  logitdiff run                                   # the bundled default: tiny model + GGUF quant ladder
  logitdiff capture hf:./bf16-model --workload w.jsonl --out runs/ref
  logitdiff capture gguf:./q4.gguf --teacher runs/ref --out runs/q4
  logitdiff compare runs/ref runs/q4 --out reports/q4
  logitdiff import llamacpp-kld base.kld --out runs/base

Every divergence is in nats (natural log) with a bits twin; drift is measured against the
reference, which is a numerical-fidelity reference, not an oracle of correctness.
"""


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _progress(total: int | None, description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    p = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console(),
        transient=False,
        disable=not sys.stderr.isatty(),
    )
    task = p.add_task(description, total=total)
    return p, (lambda n=1: p.advance(task, n))


# ----------------------------------------------------------------------------- compare
def cmd_compare(args) -> int:
    from .compare import compare_runs
    from .report import build_report, write_report_dir
    from .report.markdown import render_markdown
    from .store import RunReader
    from .summarize import parse_ranges

    try:
        ranges = parse_ranges(args.ranges)
    except ValueError as e:
        raise LogitdiffError(str(e)) from None
    ref = RunReader(args.reference, allow_partial=args.allow_partial)
    if not Path(args.candidate).is_dir() and ":" in args.candidate:
        raise LogitdiffError(
            f"{args.candidate}: live scoring of a source spec needs the native capture backends; "
            "capture it with `logitdiff capture SPEC --teacher REF_RUN` first"
        )
    cand = RunReader(args.candidate, allow_partial=args.allow_partial)
    noise = None
    if args.noise_floor:
        nf = compare_runs(ref, RunReader(args.noise_floor, allow_partial=args.allow_partial), top_logprobs=args.top_logprobs)
        import numpy as np

        noise = {"path": str(args.noise_floor), "kl_nats_mean": float(np.mean(nf.columns["kl_nats"])),
                 "top1_disagreement": float(1 - np.mean(nf.columns["top1_match"]))}
    total = sum(len(it.positions) for it in ref.items())
    prog, advance = _progress(total, "comparing")
    with prog:
        comp = compare_runs(
            ref, cand, top_logprobs=args.top_logprobs, allow_partial=args.allow_partial, progress=advance,
            device=args.device,
        )
    report, columns = build_report(
        comp, ranges=ranges, n_boot=args.bootstrap, seed=args.seed, include_rows=not args.no_rows, noise_floor=noise
    )
    if args.allow_partial and (ref.is_partial or cand.is_partial):
        report["method"]["notes"].append("--allow-partial: at least one run is marked partial")
    write_report_dir(args.out, report, columns, markdown=render_markdown(report))
    print_summary(report)
    _console().print(f"wrote {args.out}/report.json, tokens.parquet, report.md")
    return 0


def print_summary(report: dict) -> None:
    from rich.table import Table

    s = report["summary"]
    t = Table(title=f"{report['candidate'].get('spec')} vs {report['baseline'].get('spec')}  ({report['method']['kind']})")
    for col in ("positions", "mean KL", "95% CI", "p99 KL", "max KL", "mean JSD", "top-1 disagr."):
        t.add_column(col, justify="right")
    for r in [{"group": "all", **{"n": s["positions"]}, **s["metrics"], "top1_disagreement": s["top1_disagreement"]}] + report["ranges"]:
        kl = r.get("kl_nats") or {}
        js = r.get("jsd_nats") or {}
        t1 = r.get("top1_disagreement") or {}
        ci = kl.get("ci95") or [None, None]
        fmt = lambda x: "n/a" if x is None else f"{x:.4g}"
        t.add_row(
            f"{r['group']}: {r.get('n', 0)}",
            fmt(kl.get("mean")),
            f"[{fmt(ci[0])}, {fmt(ci[1])}]",
            fmt(kl.get("p99")),
            fmt(kl.get("max")),
            fmt(js.get("mean")),
            "n/a" if t1.get("rate") is None else f"{100 * t1['rate']:.2f}%",
        )
    from rich.console import Console

    Console().print(t)


# ----------------------------------------------------------------------------- import
def cmd_import_llamacpp(args) -> int:
    from .importers import import_llamacpp_kld, read_kld_header

    _, _, n_chunk = read_kld_header(Path(args.file)) if Path(args.file).exists() else (0, 0, None)
    prog, advance = _progress(n_chunk, "importing chunks")
    with prog:
        import_llamacpp_kld(args.file, args.out, bos_id=args.bos_id, overwrite=args.overwrite, progress=advance)
    _console().print(f"wrote RUN {args.out}")
    return 0


def cmd_import_npz(args) -> int:
    from .importers import import_npz

    import_npz(args.file, args.out, overwrite=args.overwrite)
    _console().print(f"wrote RUN {args.out}")
    return 0


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logitdiff",
        description="How far a candidate LLM (quant, kernel, server) drifts from its reference, token by token.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"logitdiff {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser(
        "compare",
        help="compare a candidate RUN with a reference RUN and write a REPORT directory",
        description=(
            "Check that two captures are comparable (same vocabulary and tokenizer, same teacher "
            "tokens at every position) and write REPORT/report.json (the seed report's keys and "
            "fields, extended), REPORT/tokens.parquet (one row per position) and REPORT/report.md. "
            "Full logits on both sides give exact full-vocabulary metrics; top-K on either side "
            "uses the seed's top-K approximation with a tail bucket."
        ),
    )
    c.add_argument("reference", help="reference RUN directory")
    c.add_argument("candidate", help="candidate RUN directory")
    c.add_argument("--out", required=True, help="REPORT directory to write (replaced atomically)")
    c.add_argument("--ranges", default="0,1,8,32,128,512", help="output-position range edges (default: %(default)s)")
    c.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of items for 95%% CIs (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    c.add_argument("--top-logprobs", type=int, default=64, help="K of the seed's top-K fields (default: %(default)s)")
    c.add_argument("--noise-floor", metavar="RUN", help="a rerun of the reference: its drift is printed beside the candidate's")
    c.add_argument("--allow-partial", action="store_true", help="accept runs marked partial (stated in the report)")
    c.add_argument("--no-rows", action="store_true", help="omit per-position rows from report.json (tokens.parquet keeps them)")
    c.add_argument("--device", default=None, help="torch device for the metrics (cpu, cuda); default: cpu")
    c.set_defaults(func=cmd_compare)

    imp = sub.add_parser("import", help="import another tool's logits into a RUN", description="Import another tool's logits into a RUN directory.")
    isub = imp.add_subparsers(dest="format", metavar="FORMAT", required=True)
    lk = isub.add_parser(
        "llamacpp-kld",
        help="llama-perplexity --kl-divergence-base file",
        description=(
            "Import the file llama.cpp's llama-perplexity writes with --kl-divergence-base. One item "
            "per chunk; the first half of the chunk (plus the first scored token's context) is the "
            "prompt and the scored second half the teacher sequence, exactly the positions llama.cpp scores."
        ),
    )
    lk.add_argument("file")
    lk.add_argument("--out", required=True, help="RUN directory to create")
    lk.add_argument("--bos-id", type=int, default=None, help="replace token 0 of each chunk by this BOS id, as llama.cpp does for models that add BOS")
    lk.add_argument("--overwrite", action="store_true")
    lk.set_defaults(func=cmd_import_llamacpp)
    nz = isub.add_parser(
        "npz", help="NumPy .npz with logits, token_ids, item_ids, positions",
        description="Import a .npz holding logits [N, V], token_ids [N] (the token each row predicts), item_ids [N], positions [N].",
    )
    nz.add_argument("file")
    nz.add_argument("--out", required=True, help="RUN directory to create")
    nz.add_argument("--overwrite", action="store_true")
    nz.set_defaults(func=cmd_import_npz)

    _add_capture_commands(sub)
    return p


def _add_capture_commands(sub) -> None:
    try:
        from .capture import add_commands
    except ImportError:  # the capture module arrives with the native backends
        return
    add_commands(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except LogitdiffError as e:
        print(f"logitdiff: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("logitdiff: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
