"""The ``logitdiff`` command line: one function per command, no logic of its own."""

from __future__ import annotations

import argparse
import signal
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
  logitdiff flips reports/q4                      # what the top-1 flips do; correctness flips
  logitdiff report reports/q8 reports/q4 --out q.html
  logitdiff import llamacpp-kld base.kld --out runs/base

Outputs: --out is replaced only when it holds the same kind of logitdiff output (and,
where a command has --overwrite, only with it), never when it is another directory or
file or one of the command's inputs; a new output is built beside the old one and swapped
in when complete, and a second writer to the same output is refused (naming its pid).
Errors are one line on stderr, exit status 2.

Every divergence is in nats (natural log) with a bits twin; drift is measured against the
reference, which is a numerical-fidelity reference, not an oracle of correctness.
"""


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _stdout_console():
    """Tables go to stdout; when piped (no terminal) use a width that fits them."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


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
    from .outputs import Kind, check_output
    from .report import build_report, write_report_dir
    from .report.markdown import render_markdown
    from .store import RunReader, parse_chunk_size
    from .summarize import parse_ranges

    # Every argument and input is checked before anything is computed or written.
    try:
        ranges = parse_ranges(args.ranges)
    except ValueError as e:
        raise LogitdiffError(str(e)) from None
    gates = parse_fail_on(args.fail_on)
    check_bootstrap(args.bootstrap)
    check_at_least("--top-logprobs", args.top_logprobs, 1)
    check_device(args.device)
    chunk_bytes = parse_chunk_size(args.chunk_size)
    live = not Path(args.candidate).exists() and ":" in args.candidate
    inputs = [args.reference, args.noise_floor] + ([] if live else [args.candidate])
    check_output(args.out, Kind.REPORT, inputs=inputs)
    ref = RunReader(args.reference, allow_partial=args.allow_partial)
    if args.top_logprobs is None:
        args.top_logprobs = min(DEFAULT_TOP_LOGPROBS, ref.vocab_size)
    elif args.top_logprobs > ref.vocab_size:
        raise LogitdiffError(f"--top-logprobs {args.top_logprobs}: exceeds the vocabulary size {ref.vocab_size} of {args.reference}")
    live_source = None
    if live:
        # A source spec: score it live against the reference, store nothing.
        from .capture import LiveRun
        from .sources import open_source

        live_source = open_source(args.candidate)
        cand = LiveRun(live_source, ref, chunk_bytes=chunk_bytes)
    else:
        cand = RunReader(args.candidate, allow_partial=args.allow_partial)
    noise_run = RunReader(args.noise_floor, allow_partial=args.allow_partial) if args.noise_floor else None
    noise = None
    if noise_run is not None:
        import numpy as np

        from .capture import layout_text
        from .pipeline import identical_distributions

        nf_run = noise_run
        nf = compare_runs(ref, nf_run, top_logprobs=args.top_logprobs, chunk_bytes=chunk_bytes)
        # Any rerun of the reference works; one with other batch mates (capture --batch N) is
        # the floor of a deterministic backend, whose plain rerun is bit-identical.
        rerun = f"rerun {nf_run.path} ({layout_text(nf_run.manifest.get('settings') or {})}; reference {layout_text(ref.manifest.get('settings') or {})})"
        if identical_distributions(nf):
            rerun += "; bit-identical: capture the rerun with another --batch for other batch mates"
        noise = {"path": str(args.noise_floor), "rerun": rerun, "kl_nats_mean": float(np.mean(nf.columns["kl_nats"])),
                 "top1_disagreement": float(1 - np.mean(nf.columns["top1_match"]))}
    total = sum(len(it.positions) for it in ref.items())
    prog, advance = _progress(total, "comparing")
    with prog:
        comp = compare_runs(
            ref, cand, top_logprobs=args.top_logprobs, allow_partial=args.allow_partial, progress=advance,
            device=args.device, chunk_bytes=chunk_bytes,
        )
    report, columns = build_report(
        comp, ranges=ranges, n_boot=args.bootstrap, seed=args.seed, include_rows=not args.no_rows, noise_floor=noise
    )
    if args.allow_partial and (ref.is_partial or cand.is_partial):
        report["method"]["notes"].append("--allow-partial: at least one run is marked partial")
    if live_source is not None:
        live_source.close()
    from .report.html import render_html

    apply_gates(report, gates)
    html = render_html([report], [columns], paths=[args.out])
    write_report_dir(args.out, report, columns, markdown=render_markdown(report), extra_files={"report.html": html.encode()},
                     inputs=inputs)
    print_summary(report)
    _console().print(f"wrote {args.out}/report.json, tokens.parquet, report.md, report.html")
    return gate_exit([report])


MAX_BOOTSTRAP = 100_000
DEFAULT_TOP_LOGPROBS = 64


def check_at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise LogitdiffError(f"{flag} {value}: must be at least {low}")


def check_bootstrap(n: int) -> None:
    """0 (no confidence intervals) .. MAX_BOOTSTRAP (the resample index array is n x items)."""
    if not 0 <= n <= MAX_BOOTSTRAP:
        raise LogitdiffError(f"--bootstrap {n}: must be between 0 (no confidence intervals) and {MAX_BOOTSTRAP}")


def check_device(device: str | None) -> None:
    """``--device``: cpu, cuda or cuda:N, and CUDA only where torch can reach a GPU."""
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise LogitdiffError(f"--device {device!r}: not a device (expected cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise LogitdiffError(f"--device {device!r}: unsupported (expected cpu, cuda or cuda:N)")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no usable GPU"
            raise LogitdiffError(f"--device {device!r}: CUDA is not available (torch {torch.__version__}, {build}); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise LogitdiffError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")


GATES_EXIT = 3
FAIL_ON_HELP = (
    "quality gates, e.g. 'kl_mean>0.05,top1_disagreement>0.02,tool_call_malformed>0': exit status 3 when "
    "any is crossed (a metric the report lacks counts as crossed); the report says which"
)


def parse_fail_on(text: str | None):
    if not text:
        return None
    from .gates import parse_gates

    return parse_gates(text)


def apply_gates(report: dict, gates) -> None:
    """Evaluate gates on a report and store the result in it (report.json ``gates``)."""
    if gates:
        from .gates import evaluate

        report["gates"] = evaluate(report, gates)


def gate_exit(reports: list[dict]) -> int:
    crossed = [(r["candidate"].get("spec") or r["candidate"].get("path"), g) for r in reports for g in (r.get("gates") or {}).get("crossed", [])]
    if not crossed:
        return 0
    con = _console()
    for who, g in crossed:
        con.print(f"[bold red]gate crossed[/]: {who}: {g}")
    return GATES_EXIT


def print_summary(report: dict) -> None:
    from rich.table import Table

    s = report["summary"]
    t = Table(title=f"{report['candidate'].get('spec')} vs {report['baseline'].get('spec')}  ({report['method']['kind']})")
    for col in ("positions", "mean KL", "95% CI", "p99 KL", "max KL", "mean JSD", "top-1 disagr."):
        t.add_column(col, justify="right")
    groups = [{"group": "all", **{"n": s["positions"]}, **s["metrics"], "top1_disagreement": s["top1_disagreement"]}]
    for r in groups + [g for g in report["ranges"] if g.get("n")]:
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
    _stdout_console().print(t)


# ----------------------------------------------------------------------------- capture
def cmd_capture(args) -> int:
    from .capture import SCORE_BATCH, capture_candidate, capture_reference, check_max_tokens, check_resume_flags, parse_positions
    from .outputs import Kind, check_output
    from .sources import open_source
    from .store import RunReader, parse_chunk_size, parse_store

    if args.teacher and args.workload:
        raise LogitdiffError("--teacher and --workload exclude each other: a candidate capture takes its items from the teacher run")
    from .served import parse_shard, shard_items, with_endpoints

    # Arguments first, then the output path, then the inputs; the source (slow) last.
    check_resume_flags(args.resume, args.overwrite)
    parse_store(args.store)
    check_max_tokens(args.max_tokens)
    parse_positions(args.positions)
    spec = with_endpoints(args.spec, args.endpoint)
    shard = parse_shard(args.shard)
    batch = SCORE_BATCH if args.batch is None else args.batch
    if batch < 1:
        raise LogitdiffError(f"--batch {batch}: must be at least 1")
    chunk_bytes = parse_chunk_size(args.chunk_size)
    # a shard holds whole scoring blocks: its items keep the batch mates of an unsharded capture
    extra = {"shard": args.shard, "shard_block": batch} if shard else {}
    if args.teacher:
        check_output(args.out, Kind.RUN, inputs=[args.teacher], overwrite=args.overwrite, resume=args.resume)
        teacher = RunReader(args.teacher)
        teacher.items()  # a damaged teacher is a one-line error before the source loads
        with open_source(spec) as src:
            prog, advance = _progress(len(shard_items(teacher.items(), shard, block=batch)), f"scoring {args.spec}")
            with prog:
                capture_candidate(src, teacher, args.out, store=args.store, resume=args.resume, overwrite=args.overwrite,
                                  progress=advance, shard=shard, settings=extra, batch=batch, chunk_bytes=chunk_bytes)
    else:
        import hashlib

        from .builtin import WORKLOAD
        from .workload import read_workload

        wl = args.workload or str(WORKLOAD)
        check_output(args.out, Kind.RUN, inputs=[wl], overwrite=args.overwrite, resume=args.resume)
        items = shard_items(read_workload(wl), shard, block=batch)
        # The workload's bytes, not its path, decide whether a --resume continues the same capture.
        wl_hash = hashlib.sha256(Path(wl).read_bytes()).hexdigest()
        with open_source(spec) as src:
            prog, advance = _progress(len(items), f"capturing {args.spec}")
            with prog:
                capture_reference(src, items, args.out, max_tokens=args.max_tokens, store=args.store, positions=args.positions,
                                  resume=args.resume, overwrite=args.overwrite,
                                  settings={"workload": wl, "workload_sha256": wl_hash, **extra}, progress=advance, inputs=[wl],
                                  batch=batch, chunk_bytes=chunk_bytes)
    _console().print(f"wrote RUN {args.out}")
    return 0


def cmd_run(args) -> int:
    from .pipeline import Hooks, RunConfig, check_specs, default_candidates, run_pipeline
    from .summarize import parse_ranges

    from .capture import check_max_tokens, parse_positions

    try:
        ranges = parse_ranges(args.ranges)
    except ValueError as e:
        raise LogitdiffError(str(e)) from None
    check_bootstrap(args.bootstrap)
    check_max_tokens(args.max_tokens)
    parse_positions(args.positions)
    cfg = RunConfig(
        reference=args.reference, candidates=args.candidates or default_candidates(), workload=args.workload, out=args.out,
        max_tokens=args.max_tokens, positions=args.positions, noise_floor=not args.no_noise_floor, bootstrap=args.bootstrap,
        ranges=ranges, fresh=args.fresh, flips=not args.no_flips, correctness=not (args.no_correctness or args.no_flips),
        flip_select=args.select, max_branches=args.max_branches, similarity=args.similarity,
    )
    from .flips import parse_select

    parse_select(args.select)
    if args.max_branches < 0:
        raise LogitdiffError("--max-branches must be >= 0")
    cfg.gates = parse_fail_on(args.fail_on)
    check_specs(cfg)
    console = _console()

    import time

    class RichHooks(Hooks):
        def __init__(self):
            self.prog = None
            self.t0 = time.time()

        def stage(self, text):
            console.print(f"[bold cyan]▶[/] [dim]{time.time() - self.t0:6.1f}s[/] {text}")

        def bar(self, total, text):
            if self.prog is not None:
                self.prog[0].stop()
            p, adv = _progress(total, text)
            p.start()
            self.prog = (p, adv)
            return adv

        def done(self):
            if self.prog is not None:
                self.prog[0].stop()

    hooks = RichHooks()
    try:
        summary = run_pipeline(cfg, hooks)
    finally:
        hooks.done()
    print_run_summary(summary)
    console.print(f"wrote {args.out}/report.html, summary.md, summary.json and one report per candidate in {args.out}/reports/")
    if summary.get("gates_crossed"):
        for who, gs in summary["gates_crossed"].items():
            console.print(f"[bold red]gate crossed[/]: {who}: {', '.join(gs)}")
        return GATES_EXIT
    return 0


def print_run_summary(summary: dict) -> None:
    from rich.table import Table

    nf = summary.get("noise_floor")
    title = f"drift from {summary['reference']} — {summary['items']} items, {summary['positions']} positions"
    if nf:
        title += f"; noise floor mean KL {nf['kl_nats_mean']:.3g}"
    t = Table(title=title)
    for col in ("candidate", "mean KL", "95% CI", "p99 KL", "mean JSD", "top-1 disagr.", "PPL ratio", "× noise floor", "× BF16 floor"):
        t.add_column(col, justify="right" if col != "candidate" else "left")
    g = lambda x: "n/a" if x is None else f"{x:.3g}"
    for r in summary["candidates"]:
        ci = r["kl_mean_ci95"]
        t.add_row(r.get("name") or r["candidate"], g(r["kl_mean"]), f"[{g(ci[0])}, {g(ci[1])}]", g(r["kl_p99"]), g(r["jsd_mean"]),
                  f"{100 * r['top1_disagreement']:.2f}%", "n/a" if r["ppl_ratio"] is None else f"{r['ppl_ratio']:.4f}",
                  g(r["x_noise_floor"]), g(r.get("x_cross_engine_floor")))
    con = _stdout_console()
    con.print(t)
    if any("flip_outcomes" in r or "accuracy_cand" in r for r in summary["candidates"]):
        t2 = Table(title="what the drift does: branches from top-1 flips, and free-running answers")
        for col in ("candidate", "branches", "recovered", "benign", "meaning changed", "tool call malformed", "tool call changed",
                    "accuracy ref → cand", "right→wrong", "wrong→right", "McNemar p"):
            t2.add_column(col, justify="right" if col != "candidate" else "left")
        for r in summary["candidates"]:
            o = r.get("flip_outcomes") or {}
            acc = "n/a" if r.get("accuracy_cand") is None else f"{100 * r['accuracy_ref']:.1f}% → {100 * r['accuracy_cand']:.1f}%"
            t2.add_row(r.get("name") or r["candidate"], str(r.get("flip_branches", "n/a")),
                       *[str(o.get(k, "n/a")) for k in ("recovered", "benign", "meaning_changed", "tool_call_malformed", "tool_call_changed")],
                       acc, str(r.get("right_to_wrong", "n/a")), str(r.get("wrong_to_right", "n/a")), g(r.get("mcnemar_p")))
        con.print(t2)


# ----------------------------------------------------------------------------- import
def cmd_import_llamacpp(args) -> int:
    from .importers import import_llamacpp_kld, read_kld_header
    from .outputs import Kind, check_output

    check_output(args.out, Kind.RUN, inputs=[args.file], overwrite=args.overwrite)
    _, _, n_chunk = read_kld_header(Path(args.file)) if Path(args.file).exists() else (0, 0, None)
    prog, advance = _progress(n_chunk, "importing chunks")
    with prog:
        import_llamacpp_kld(args.file, args.out, bos_id=args.bos_id, overwrite=args.overwrite, progress=advance)
    _console().print(f"wrote RUN {args.out}")
    return 0


def cmd_import_npz(args) -> int:
    from .importers import import_npz
    from .outputs import Kind, check_output

    check_output(args.out, Kind.RUN, inputs=[args.file], overwrite=args.overwrite)

    import_npz(args.file, args.out, overwrite=args.overwrite)
    _console().print(f"wrote RUN {args.out}")
    return 0


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from .outputs import REPORT_NAMES_HELP
    from .store import CHUNK_SIZE_HELP

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
            "uses the seed's top-K approximation with a tail bucket, plus proven intervals "
            "(*_lower_nats, *_upper_nats; inf where nothing bounds the tail); a compact reference "
            "(capture --store compact) against a full candidate gives each divergence with its proven "
            "interval (docs/bounds.md). The report names the method; other pairings are refused."
        ),
    )
    c.add_argument("reference", help="reference RUN directory")
    c.add_argument("candidate", help="candidate RUN directory")
    c.add_argument("--out", required=True, help="REPORT directory to write: new, empty or a REPORT (replaced only when the new one is "
                   "complete); never another directory, a file or one of the runs read")
    c.add_argument("--ranges", default="0,1,8,32,128,512", help="output-position range edges (default: %(default)s)")
    c.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap resamples of items for 95%% CIs, 0 (no CIs) to 100000 (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    c.add_argument("--top-logprobs", type=int, default=None,
                   help=f"K of the seed's top-K fields, 1..V (default: {DEFAULT_TOP_LOGPROBS}, or V when smaller)")
    c.add_argument("--noise-floor", metavar="RUN",
                   help="a rerun of the reference (e.g. `capture REF_SPEC --teacher REF_RUN --batch 3`: other batch mates, "
                        "where a plain rerun on CPU is bit-identical): its drift is printed beside the candidate's")
    c.add_argument("--allow-partial", action="store_true", help="accept runs marked partial (stated in the report)")
    c.add_argument("--no-rows", action="store_true", help="omit per-position rows from report.json (tokens.parquet keeps them)")
    c.add_argument("--device", default=None, help="torch device for the metrics: cpu, cuda or cuda:N (default: cpu)")
    c.add_argument("--fail-on", metavar="GATES", help=FAIL_ON_HELP)
    c.add_argument("--chunk-size", default=None, metavar="BYTES", help=CHUNK_SIZE_HELP)
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
    lk.add_argument("--out", required=True, help="RUN directory to create (or, with --overwrite, a RUN to replace)")
    lk.add_argument("--bos-id", type=int, default=None, help="replace token 0 of each chunk by this BOS id, as llama.cpp does for models that add BOS")
    lk.add_argument("--overwrite", action="store_true", help="replace --out if it holds a RUN (never anything else)")
    lk.set_defaults(func=cmd_import_llamacpp)
    nz = isub.add_parser(
        "npz", help="NumPy .npz with logits, token_ids, item_ids, positions",
        description="Import a .npz holding logits [N, V], token_ids [N] (the token each row predicts), item_ids [N], positions [N].",
    )
    nz.add_argument("file")
    nz.add_argument("--out", required=True, help="RUN directory to create (or, with --overwrite, a RUN to replace)")
    nz.add_argument("--overwrite", action="store_true", help="replace --out if it holds a RUN (never anything else)")
    nz.set_defaults(func=cmd_import_npz)

    cap = sub.add_parser(
        "capture",
        help="capture a source's distributions over a workload (reference) or a reference's tokens (candidate)",
        description=(
            "Without --teacher: the source generates greedily (temperature 0) for every workload item; "
            "the output token ids are the teacher sequence and the source's distribution at every output "
            "position is kept. With --teacher RUN: the source is fed exactly the reference's token ids "
            "(teacher forcing) and scored at the same positions; its tokenization of every item is first "
            "checked against the reference's. Distributions always come from one prefill over prompt + "
            "teacher, so reference, rerun and candidates are computed alike. A killed capture resumes "
            "with --resume."
        ),
        epilog=(
            "SPEC: hf:PATH[,dtype=bfloat16|float32][,device=cpu|cuda][,batch=N][,prefill=N] | gguf:PATH[,n_ctx=N][,threads=N] | "
            "openai:http://HOST:PORT[/v1][,model=NAME][,kind=auto|llamacpp|vllm|sglang][,top_k=K][,tokenizer=PATH] | "
            "builtin:tiny | builtin:tiny-Q4_K_M ...  "
            "vLLM: start it with --max-logprobs K and, for speed, --skip-tokenizer-init (then pass tokenizer=PATH); "
            "without that flag vLLM decodes the text of every returned logprob entry, which logitdiff never reads."
        ),
    )
    cap.add_argument("spec", metavar="SPEC", help="source spec")
    cap.add_argument("--workload", help="workload JSONL (reference capture; default: the bundled workload)")
    cap.add_argument("--teacher", metavar="RUN", help="reference RUN whose token ids the source is fed (candidate capture)")
    cap.add_argument("--out", required=True, help="RUN directory to write: new or empty (written in place, so --resume can "
                     "continue it), or a RUN with --resume / --overwrite; never anything else")
    cap.add_argument("--max-tokens", type=int, default=None, help="generation budget per item, >= 1 (default: the item's max_tokens, else 64)")
    cap.add_argument("--store", default="full",
                     help="full (native-dtype logits), topk:K with 1 <= K <= V, or compact[:exact=E,band=B,bits=8|16] (a reference "
                          "kept as exact top entries, a quantised band and exact tail mass: candidates compare against it with "
                          "proven KL bounds; docs/bounds.md) (default: %(default)s)")
    cap.add_argument("--positions", default="all",
                     help="all | first | sample:FRAC[:SEED] with 0 < FRAC <= 1 — output positions kept (reference capture; "
                          "default: %(default)s); only those are scored, so sampling saves memory and time as well as disk")
    cap.add_argument("--resume", action="store_true",
                     help="continue a partial capture in --out; refused unless spec, model identity (weight hashes), tokenizer, "
                     "workload hash and every setting match the run's manifest (the first differing field is named)")
    cap.add_argument("--overwrite", action="store_true",
                     help="replace the RUN in --out; the new run is built beside it and swapped in only when complete")
    cap.add_argument("--shard", metavar="I/N",
                     help="only the blocks k of --batch consecutive items with k mod N == I (every item keeps the batch mates "
                          "it has unsharded); join the shards with `logitdiff merge`")
    cap.add_argument("--batch", type=int, default=None, metavar="N",
                     help="items scored together: blocks of N consecutive items in workload order, recorded in the manifest "
                          "(default: 8). A batched backend's numbers depend on the batch mates; --resume and --shard keep them. "
                          "A rerun of the reference with another N is a noise floor for `compare --noise-floor`")
    cap.add_argument("--endpoint", action="append", default=[], metavar="URL",
                     help="another replica of an openai: server, shared round-robin (repeatable)")
    cap.add_argument("--chunk-size", default=None, metavar="BYTES", help=CHUNK_SIZE_HELP)
    cap.set_defaults(func=cmd_capture)

    from .served_cli import add_commands as add_served_commands

    add_served_commands(sub)

    from .flips_cli import add_commands as add_flips_commands

    add_flips_commands(sub)

    from .report_cli import add_commands as add_report_commands

    add_report_commands(sub)

    from .toolexec import SANDBOX_HELP

    run = sub.add_parser(
        "run",
        help="the whole job: reference, noise floor, candidates, reports (no arguments: the bundled default)",
        description=(
            "Capture the reference on the workload, rerun it for the noise floor (when that rerun is "
            "bit-identical, as on CPU, the floor comes from a rerun with the batch boundaries moved by half a "
            "batch: other batch mates, other float rounding), teacher-force every "
            "candidate on the reference's tokens and write one report per candidate plus a summary table. "
            "With no arguments: the bundled tiny Llama through transformers in BF16 as the reference, and "
            "its llama.cpp GGUF BF16 (cross-engine floor) and quant ladder Q8_0, Q6_K, Q4_K_M, IQ4_XS, "
            "Q3_K_M, Q2_K as candidates, on the bundled workload — offline, in minutes."
        ),
        epilog=SANDBOX_HELP,
    )
    run.add_argument("--reference", default="builtin:tiny", help="reference spec (default: %(default)s)")
    run.add_argument("--candidate", action="append", dest="candidates", metavar="SPEC",
                     help="candidate spec (repeatable; default: the bundled ladder); " + REPORT_NAMES_HELP)
    run.add_argument("--workload", help="workload JSONL (default: the bundled workload)")
    run.add_argument("--out", default="logitdiff-out",
                     help="output directory: new, empty or an earlier run's (its reference capture is reused) (default: %(default)s)")
    run.add_argument("--max-tokens", type=int, default=None, help="generation budget per item, >= 1 (default: the item's, else 64)")
    run.add_argument("--positions", default="all", help="all | first | sample:FRAC with 0 < FRAC <= 1 (default: %(default)s)")
    run.add_argument("--no-noise-floor", action="store_true", help="skip the reference reruns")
    run.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of items, 0 to 100000 (default: %(default)s)")
    run.add_argument("--ranges", default="0,1,8,32,128,512", help="output-position range edges (default: %(default)s)")
    run.add_argument("--fresh", action="store_true", help="recapture the reference even if OUT/runs/reference matches")
    run.add_argument("--no-flips", action="store_true", help="skip branching at top-1 flips (and correctness)")
    run.add_argument("--no-correctness", action="store_true", help="skip grading free-running answers of labelled items")
    run.add_argument("--select", default="first", help="flips to branch from: first | all | top-kl:N | low-margin:N | sample:N (default: %(default)s)")
    run.add_argument("--max-branches", type=int, default=24, help="branches per candidate, highest KL kept (default: %(default)s)")
    run.add_argument("--similarity", default="auto", choices=("auto", "minilm", "edit"), help="text similarity for flips (default: %(default)s)")
    run.add_argument("--fail-on", metavar="GATES", help=FAIL_ON_HELP + " (checked for every candidate)")
    run.set_defaults(func=cmd_run)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup runs as for Ctrl-C."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    import os

    # Our own progress bars only: silence transformers' weight-loading bars and advisories.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # SIGTERM unwinds like Ctrl-C, so every temporary output is removed on the way out
    # (the default action would kill the process where it stands). Restored on return.
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        return int(args.func(args) or 0)
    except LogitdiffError as e:
        print(f"logitdiff: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("logitdiff: terminated (SIGTERM); the output was left as it was", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("logitdiff: interrupted; the output was left as it was", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
