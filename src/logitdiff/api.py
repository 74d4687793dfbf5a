"""The public Python API: the same jobs as the CLI commands, as functions
(``capture_run`` is ``logitdiff capture``, ``diff_runs`` is ``logitdiff compare``, ``run`` is
``logitdiff run``; the names differ from the modules ``logitdiff.capture``/``compare``, whose
import would otherwise shadow them).

    import logitdiff

    logitdiff.capture_run("builtin:tiny", "runs/ref", max_tokens=16)             # reference RUN
    logitdiff.capture_run("builtin:tiny-Q4_K_M", "runs/q4", reference="runs/ref") # candidate RUN
    report = logitdiff.diff_runs("runs/ref", "runs/q4", out="reports/q4")        # REPORT
    report["summary"]["kl_nats_mean"]                                          # a contracts.Report

Every function checks its arguments and its output path before it computes anything (the
same one-line ``LogitdiffError`` as the CLI), writes through the same output guard (a
foreign ``out`` is refused, a new one is swapped in when complete), and changes no
process-wide state. ``bar`` arguments are progress callbacks: ``bar(total, label)`` returns
``advance(n=1)`` (the CLI passes rich progress bars; the default draws nothing).
"""

from __future__ import annotations

import contextlib
import threading
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar, cast

from .errors import LogitdiffError, renamed_parameters

if TYPE_CHECKING:  # the types only: importing the modules here would load numpy/torch on `import logitdiff.api`
    from .capture import LiveRun
    from .compare import Comparison
    from .contracts import LayersDoc, NoiseFloor, Report, RunSummary, SpeculationReport
    from .report.gates import Gate
    from .store import RunReader

Bar = Callable[[int | None, str], Callable[..., None]]
_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["capture_run", "diff_runs", "layers", "load_report", "noise_floor_of", "run", "speculate"]

MAX_BOOTSTRAP = 100_000


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


def _type_ok(v: object, t: Any) -> bool:
    """Whether ``v`` fits the annotation ``t`` (the simple types the API takes; anything
    this does not know is not judged here)."""
    import collections.abc
    import os
    import types
    import typing

    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(v, a) for a in args)
    if t is type(None):
        return v is None
    if t is bool:
        return isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is str:
        return isinstance(v, str)
    if t is Path:
        return isinstance(v, os.PathLike)
    if origin in (collections.abc.Sequence, list, tuple):
        if not isinstance(v, (list, tuple)):
            return False
        inner = [a for a in args if a is not Ellipsis]
        return all(_type_ok(x, inner[0]) for x in v) if len(inner) == 1 else True
    if origin is collections.abc.Callable or t is collections.abc.Callable:
        return callable(v)
    if t is dict or origin is dict:
        return isinstance(v, dict)
    return True


def _type_name(t: Any) -> str:
    import typing

    if t is type(None):
        return "None"
    if typing.get_origin(t) is not None:
        return str(t).replace("typing.", "").replace("collections.abc.", "").replace("pathlib.", "")
    return getattr(t, "__name__", str(t))


def check_arguments(fn_name: str, hints: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """A one-line LogitdiffError naming the first argument whose type does not fit its
    annotation (the API's callers get the CLI's kind of error, not a TypeError deep inside)."""
    for name, v in values.items():
        t = hints.get(name)
        if t is not None and not _type_ok(v, t):
            shown = repr(v)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise LogitdiffError(f"{fn_name}: argument {name!r} is {type(v).__name__} {shown}; expected {_type_name(t)}")


class _HintNames(dict):
    """The names an annotation string is evaluated with: this module's, then builtins; a name
    imported for the type checker only (``TYPE_CHECKING``: store, contracts...) reads as
    ``Any`` (not judged at run time), so checking a call imports nothing heavy."""

    def __missing__(self, name: str) -> Any:
        import builtins

        return getattr(builtins, name, Any)


def _parameter_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s parameter annotations evaluated (its return annotation is not needed)."""
    import inspect

    names = _HintNames(globals())
    return {name: eval(p.annotation, {}, names) if isinstance(p.annotation, str) else p.annotation
            for name, p in inspect.signature(fn).parameters.items() if p.annotation is not inspect.Parameter.empty}


def _checked(fn: _F) -> _F:
    """Check the call's arguments against ``fn``'s annotations first (see check_arguments)."""
    import functools
    import inspect

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise LogitdiffError(f"{fn.__name__}: {e}") from None
        check_arguments(fn.__name__, _parameter_hints(fn), bound.arguments)
        return fn(*args, **kwargs)

    return cast(_F, wrapper)


def _no_bar(total: int | None, label: str) -> Callable[..., None]:
    return lambda n=1: None


@renamed_parameters(teacher="reference")
@_checked
def capture_run(
    spec: str,
    out: str | Path,
    *,
    workload: str | Path | None = None,
    reference: str | Path | None = None,
    max_tokens: int | None = None,
    store: str = "full",
    positions: str = "all",
    resume: bool = False,
    overwrite: bool = False,
    shard: str | None = None,
    batch: int | None = None,
    endpoints: Sequence[str] = (),
    chunk_size: str | int | None = None,
    bar: Bar | None = None,
    ctx: int | None = None,
    chunks: int | None = None,
) -> Path:
    """Capture a RUN: without ``reference``, the source generates greedily over ``workload``
    (default: the bundled one) and is scored on its own output (a reference); with
    ``reference`` (a reference RUN), it is teacher-forced on that run's tokens (a candidate).
    ``workload="text:FILE"``: no generation, the text is scored in llama-perplexity's chunks of
    ``ctx`` tokens (at most ``chunks`` of them; :mod:`logitdiff.workload.text`).
    ``spec`` is a source spec (``hf:PATH``, ``gguf:PATH``, ``served:URL``, ``builtin:tiny``...).
    ``teacher=`` is the deprecated name of ``reference=`` (docs/migration.md). Returns ``out``."""
    from .workload.text import text_path

    text = text_path(workload) if workload is not None else None
    if text is not None and not reference:
        return _capture_text_run(spec, out, text, ctx=ctx, chunks=chunks, store=store, overwrite=overwrite,
                                 others={"--resume": resume, "--shard": shard, "--max-tokens": max_tokens,
                                         "--positions": positions != "all", "--endpoint": bool(endpoints)},
                                 batch=batch, chunk_size=chunk_size, bar=bar)
    if ctx is not None or chunks is not None:
        raise LogitdiffError("--ctx and --chunks cut a text: workload into chunks; they need --workload text:FILE")
    from .capture import SCORE_BATCH, capture_candidate, capture_reference, check_max_tokens, check_resume_flags, parse_positions
    from .store.files import Kind, check_output
    from .capture.shards import parse_shard, shard_items, with_endpoints
    from .sources import applied_threads, open_source
    from .store import RunReader, parse_chunk_size
    from .store.kinds import store_kind

    bar = bar or _no_bar
    if reference and workload:
        raise LogitdiffError("--reference and --workload exclude each other: a candidate capture takes its items from the reference run")
    # Arguments first, then the output path, then the inputs; the source (slow) last.
    check_resume_flags(resume, overwrite)
    kind = store_kind(store)  # parsed once; the capture binds it to the source
    check_max_tokens(max_tokens)
    parse_positions(positions)
    full_spec = with_endpoints(spec, list(endpoints))
    shard_ix = parse_shard(shard)
    batch = SCORE_BATCH if batch is None else batch
    if batch < 1:
        raise LogitdiffError(f"--batch {batch}: must be at least 1")
    chunk_bytes = parse_chunk_size(chunk_size)
    # a shard holds whole scoring blocks: its items keep the batch mates of an unsharded capture
    extra = {"shard": shard, "shard_block": batch} if shard_ix else {}
    if reference:
        check_output(out, Kind.RUN, inputs=[reference], overwrite=overwrite, resume=resume)
        reference_run = RunReader(reference)
        reference_run.items()  # a damaged reference is a one-line error before the source loads
        with open_source(full_spec) as src, applied_threads([src]):
            advance = bar(len(shard_items(reference_run.items(), shard_ix, block=batch)), f"scoring {spec}")
            capture_candidate(src, reference_run, out, store=kind, resume=resume, overwrite=overwrite, progress=advance,
                              shard=shard_ix, settings=extra, batch=batch, chunk_bytes=chunk_bytes)
    else:
        from .builtin import WORKLOAD
        from .workload import read_workload, workload_file, workload_sha256

        wl = str(workload) if workload else str(WORKLOAD)
        wl_file = workload_file(wl)  # None: a benchmark read from its package
        inputs = [wl_file] if wl_file is not None else []
        check_output(out, Kind.RUN, inputs=inputs, overwrite=overwrite, resume=resume)
        every = read_workload(wl)
        items = shard_items(every, shard_ix, block=batch)
        # The workload's bytes (a benchmark's items), not its path, decide whether a --resume continues the same capture.
        wl_hash = workload_sha256(wl, every)
        with open_source(full_spec) as src, applied_threads([src]):
            advance = bar(len(items), f"capturing {spec}")
            capture_reference(src, items, out, max_tokens=max_tokens, store=kind, positions=positions, resume=resume,
                              overwrite=overwrite, settings={"workload": wl, "workload_sha256": wl_hash, **extra},
                              progress=advance, inputs=inputs, batch=batch, chunk_bytes=chunk_bytes)
    return Path(out)


def _capture_text_run(spec: str, out: str | Path, text: Path, *, ctx: int | None, chunks: int | None, store: str,
                      overwrite: bool, others: dict[str, Any], batch: int | None, chunk_size: str | int | None,
                      bar: Bar | None) -> Path:
    """``capture SPEC --workload text:FILE``: the text in llama-perplexity's chunks (capture/text.py)."""
    from .capture import SCORE_BATCH
    from .capture.text import capture_text
    from .sources import applied_threads, open_source
    from .store import parse_chunk_size
    from .store.files import Kind, check_output
    from .store.kinds import store_kind
    from .workload.text import DEFAULT_CTX

    given = [flag for flag, value in others.items() if value]
    if given:
        raise LogitdiffError(f"{given[0]}: not available with a text: workload (the text is scored whole, no generation)")
    kind = store_kind(store)
    batch = SCORE_BATCH if batch is None else batch
    if batch < 1:
        raise LogitdiffError(f"--batch {batch}: must be at least 1")
    chunk_bytes = parse_chunk_size(chunk_size)
    check_output(out, Kind.RUN, inputs=[text], overwrite=overwrite)
    with open_source(spec) as src, applied_threads([src]):
        advance = (bar or _no_bar)(None, f"scoring {text} with {spec}")
        return capture_text(src, text, out, ctx=DEFAULT_CTX if ctx is None else ctx, chunks=chunks, store=kind,
                            overwrite=overwrite, progress=advance, batch=batch, chunk_bytes=chunk_bytes)


# identity keys that say which model computed the rows (weights, dtype, quantization, engine,
# served model); a rerun of the reference must agree on each key both sides record. Batch
# layout, threads, batching mode, endpoints and paths may differ: that is what a rerun varies.
_MODEL_IDENTITY = ("kind", "backend", "server", "model", "weight_files", "sha256", "quant", "file_type", "dtype", "logits_dtype",
                   "architecture", "arch", "vocab_size", "tokenizer_hash")


def check_noise_floor_run(ref: RunReader, rerun_run: RunReader) -> None:
    """Refuse a noise-floor RUN that is not a second capture of the reference's model (the
    reference RUN itself, or another model, engine or dtype): its "floor" would be a drift,
    and every "x noise floor" read against it wrong."""
    if Path(ref.path).resolve() == Path(rerun_run.path).resolve():
        raise LogitdiffError(f"--noise-floor {rerun_run.path}: is the reference RUN itself; the noise floor is a second capture "
                             "of the reference (capture it again, e.g. with another --batch)")

    def ident(run: RunReader) -> dict[str, Any]:
        src = run.manifest.get("source")
        src = src if isinstance(src, dict) else {}
        i = src.get("identity")
        i = i if isinstance(i, dict) else {}
        # the engine: a source kind where recorded (gguf, openai), else the backend (hf: transformers)
        kind = i.get("kind") or src.get("kind") or i.get("backend")
        return {**({"kind": kind} if kind is not None else {}), **{k: i[k] for k in _MODEL_IDENTITY if k in i and k != "kind"}}

    a, b = ident(ref), ident(rerun_run)
    for k in _MODEL_IDENTITY:
        if k in a and k in b and a[k] != b[k]:
            va, vb = (repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..." for v in (a[k], b[k]))
            raise LogitdiffError(f"--noise-floor {rerun_run.path}: source identity field {k!r} is {vb}, but {va} in the reference "
                                 f"{ref.path}: not a rerun of the reference's model (a noise floor is the reference captured again)")


@_checked
def noise_floor_of(ref: RunReader, rerun_run: RunReader, *, top_logprobs: int, chunk_bytes: int | None = None,
                   threads: int | None = None) -> NoiseFloor:
    """The ``noise_floor`` section (report.noise_floor_section) of a rerun of the reference
    (two open RUNs): the floor a report prints beside the candidate's."""
    from .capture import layout_text
    from .compare import compare_runs
    from .pipeline import identical_distributions
    from .report import noise_floor_section

    check_noise_floor_run(ref, rerun_run)
    nf = compare_runs(ref, rerun_run, top_logprobs=top_logprobs, chunk_bytes=chunk_bytes, threads=threads)
    # Any rerun of the reference works; one with other batch mates (capture --batch N) is
    # the floor of a deterministic backend, whose plain rerun is bit-identical.
    rerun = (f"rerun {rerun_run.path} ({layout_text(rerun_run.manifest.get('settings') or {})}; "
             f"reference {layout_text(ref.manifest.get('settings') or {})})")
    if identical_distributions(nf):
        rerun += "; bit-identical: capture the rerun with another --batch for other batch mates"
    return noise_floor_section(nf, spec=(rerun_run.manifest.get("source") or {}).get("spec"), rerun=rerun)


@_checked
def diff_runs(
    reference: str | Path,
    candidate: str | Path,
    out: str | Path | None = None,
    *,
    noise_floor: str | Path | None = None,
    ranges: Sequence[int] | None = None,
    bootstrap: int | None = None,
    seed: int = 0,
    top_logprobs: int | None = None,
    allow_partial: bool = False,
    include_rows: bool = True,
    device: str | None = None,
    chunk_size: str | int | None = None,
    gates: str | Sequence[Gate] | None = None,
    threads: int | None = None,
    bar: Bar | None = None,
    logprob_floor: float | None = None,
) -> Report:
    """Compare a candidate (a RUN directory, or a source spec scored live against the
    reference, nothing stored) with a reference RUN. Returns the report: the report.json
    object, typed as :class:`logitdiff.contracts.Report` (a ``TypedDict``, so the object is a
    plain ``dict`` at run time: ``json.dumps``-able after ``contracts.json_clean``, and
    ``contracts.report_json(report)`` gives report.json's exact text); with ``out``, also writes the REPORT directory (report.json, tokens.parquet,
    report.md, report.html). ``gates`` (failure conditions in ``--fail-on`` syntax, or a list of
    ``logitdiff.report.gates.Gate``, e.g. from ``gates.parse_gate_options(fail_on, require)``) are evaluated into the
    report's ``gates`` section. ``threads``: CPU threads of the metrics (default: the CPUs
    this process may run on, ``metrics.default_threads()``). ``logprob_floor``: a stated
    lower bound (nats) on every log-probability of both models, for a finite KL upper bound
    of top-K comparisons (compare.check_floor)."""
    from .report import build_report
    from .store.files import Kind, reserved

    bar = bar or _no_bar
    ranges, bootstrap, gate_list, chunk_bytes = _diff_settings(
        seed=seed, logprob_floor=logprob_floor, ranges=ranges, bootstrap=bootstrap, device=device, gates=gates,
        chunk_size=chunk_size, threads=threads, top_logprobs=top_logprobs)
    live = not Path(candidate).exists() and ":" in str(candidate)
    inputs: list[str | Path] = [p for p in (reference, noise_floor) if p is not None] + ([] if live else [candidate])
    # out guarded and locked for the whole comparison: a second writer is refused from the start
    with reserved(out, Kind.REPORT, inputs=inputs) if out is not None else contextlib.nullcontext():
        # the report writer's first-use costs paid while the inputs open (a model loads on one
        # core) and, beside a live candidate that leaves a CPU idle, while it runs; otherwise
        # finished before the comparison starts, so it never takes a core from it
        warm = _warming_up() if out is not None else None
        try:
            ref, cand, comp, noise = _compared(reference, candidate, live=live, noise_floor=noise_floor, top_logprobs=top_logprobs,
                                               allow_partial=allow_partial, device=device, chunk_bytes=chunk_bytes, threads=threads,
                                               logprob_floor=logprob_floor, bar=bar,
                                               before_compare=_settle(warm))
            report, columns = build_report(comp, ranges=ranges, n_boot=bootstrap, seed=seed, include_rows=include_rows,
                                           noise_floor=noise)
            if allow_partial and (ref.is_partial or cand.is_partial):
                report["method"]["notes"].append("--allow-partial: at least one run is marked partial")
            if gate_list:
                from .report.gates import judge

                report["gates"], _ = judge(report, gate_list)
            if out is not None:
                if warm is not None:
                    warm.join()
                _write_report(out, report, columns, inputs)
            return report
        finally:
            if warm is not None:  # an error exits with no thread still importing at interpreter shutdown
                warm.join()


def _settle(warm: threading.Thread | None) -> Callable[[bool], None] | None:
    """``_compared``'s ``before_compare``: the warm-up finished first unless a CPU stays idle."""
    if warm is None:
        return None

    def settle(spare: bool) -> None:
        if not spare:
            warm.join()

    return settle


def _warming_up() -> threading.Thread:
    """`report.html.warm_up` on a thread of its own, started (the report writer's imports and
    plotly's first-use costs; joined before the report is written, and harmless if it
    fails: the writer then pays them itself)."""

    def warm() -> None:
        try:
            from .report.html import warm_up

            warm_up()
        except Exception:  # noqa: BLE001 - an optimisation only
            pass

    t = threading.Thread(target=warm, name="logitdiff-report-warm-up", daemon=True)
    t.start()
    return t


def _diff_settings(*, seed: int, logprob_floor: float | None, ranges: Sequence[int] | None, bootstrap: int | None,
                   device: str | None, gates: str | Sequence[Gate] | None, chunk_size: str | int | None, threads: int | None,
                   top_logprobs: int | None) -> tuple[tuple[int, ...], int, list[Gate] | None, int | None]:
    """diff_runs' arguments checked before anything is read (one-line errors), with their
    defaults: (ranges, bootstrap resamples, gates, chunk bytes)."""
    from .compare import check_floor_value
    from .numerics.summarize import DEFAULT_BOOTSTRAP, DEFAULT_RANGES
    from .store import parse_chunk_size

    if not 0 <= seed < 2**63:
        raise LogitdiffError(f"--seed {seed}: must be a non-negative integer")
    if logprob_floor is not None and not math.isfinite(logprob_floor):
        raise LogitdiffError(f"--logprob-floor {logprob_floor}: must be a finite number of nats")
    ranges = tuple(DEFAULT_RANGES if ranges is None else ranges)
    bootstrap = DEFAULT_BOOTSTRAP if bootstrap is None else bootstrap
    check_bootstrap(bootstrap)
    check_device(device)
    check_floor_value(logprob_floor)
    gate_list = None
    if isinstance(gates, str):
        from .report.gates import parse_gates

        gate_list = parse_gates(gates)  # an empty string is an error, not "no gates"
    elif gates:
        gate_list = list(gates)
    chunk_bytes = parse_chunk_size(chunk_size)
    if threads is not None and threads < 1:
        raise LogitdiffError(f"--threads {threads}: must be at least 1")
    if top_logprobs is not None and top_logprobs < 1:
        raise LogitdiffError(f"--top-k {top_logprobs}: must be at least 1")
    return ranges, bootstrap, gate_list, chunk_bytes


def _compared(reference: str | Path, candidate: str | Path, *, live: bool, noise_floor: str | Path | None,
              top_logprobs: int | None, allow_partial: bool, device: str | None, chunk_bytes: int | None,
              threads: int | None, logprob_floor: float | None, bar: Bar,
              before_compare: Callable[[bool], None] | None = None) -> tuple[RunReader, RunReader | LiveRun, Comparison, NoiseFloor | None]:
    """The reference RUN and the candidate (a RUN, or a source scored live and closed again)
    opened and compared: (reference, candidate, the Comparison, the noise floor section of
    ``noise_floor``, a rerun of the reference, when given; a served reference's rerun is also
    its served floor). ``before_compare(spare)``: called once both sides are open, right
    before the comparison, ``spare`` saying whether a CPU stays idle while it runs (a live
    candidate whose forward passes leave one)."""
    from .compare import DEFAULT_TOP_LOGPROBS, compare_runs, served_batching
    from .contracts import ServedFloorSide
    from .store import RunReader

    ref = RunReader(reference, allow_partial=allow_partial, device=device)  # a hidden reference decodes there
    if top_logprobs is None:
        top_logprobs = min(DEFAULT_TOP_LOGPROBS, ref.vocab_size)
    elif top_logprobs > ref.vocab_size:
        raise LogitdiffError(f"--top-k {top_logprobs}: exceeds the vocabulary size {ref.vocab_size} of {reference}")
    live_source = None
    cand: RunReader | LiveRun
    threads_scope = contextlib.ExitStack()
    try:
        if live:
            from .capture import LiveRun
            from .sources import applied_threads, open_source

            live_source = open_source(str(candidate))
            threads_scope.enter_context(applied_threads([live_source]))
            cand = LiveRun(live_source, ref, chunk_bytes=chunk_bytes)
            if cand.overlap and threads is None:  # the metrics run beside the candidate's forward passes: the CPUs it leaves
                from .numerics.metrics import default_threads

                threads = max(1, default_threads() - live_source.forward_threads())
        else:
            cand = RunReader(candidate, allow_partial=allow_partial)
        noise: NoiseFloor | None = None
        if noise_floor:
            nf_run = RunReader(noise_floor, allow_partial=allow_partial)
            noise = noise_floor_of(ref, nf_run, top_logprobs=top_logprobs, chunk_bytes=chunk_bytes, threads=threads)
        if before_compare is not None:
            before_compare(bool(getattr(cand, "overlap", False)))
        advance = bar(sum(len(it.positions) for it in ref.items()), "comparing")
        comp = compare_runs(ref, cand, top_logprobs=top_logprobs, allow_partial=allow_partial, progress=advance,
                            device=device, chunk_bytes=chunk_bytes, threads=threads, logprob_floor=logprob_floor)
        if noise and served_batching(ref) and served_batching(nf_run):
            # a served reference captured twice: its rerun is the served floor (servedfloor.py)
            from .sources.served_floor import served_floor

            comp.served_floor = served_floor(ServedFloorSide(
                spec=noise["spec"], batching=served_batching(nf_run), measured_by=f"compare --noise-floor: {noise['rerun']}",
                kl_nats_mean=noise["kl_nats_mean"], kl_nats_max=noise["kl_nats_max"],
                top1_disagreement=noise["top1_disagreement"], positions=noise["positions"]), None)
    finally:
        threads_scope.close()
        if live_source is not None:
            live_source.close()
    return ref, cand, comp, noise


def _write_report(out: str | Path, report: Report, columns: dict, inputs: Sequence[str | Path]) -> None:
    """The REPORT directory: report.json, tokens.parquet, report.md and the page."""
    from .report import write_report_dir
    from .report.html import render_html
    from .report.markdown import render_markdown

    html = render_html([report], [columns], paths=[out])
    write_report_dir(out, report, columns, markdown=render_markdown(report), extra_files={"report.html": html.encode()},
                     inputs=inputs)


@renamed_parameters(teacher="reference_run")
@_checked
def layers(
    reference: str,
    candidates: str | Sequence[str],
    reference_run: str | Path,
    out: str | Path | None = None,
    *,
    floor: str = "rerun",
    chunk_size: str | int | None = None,
    bar: Bar | None = None,
) -> LayersDoc:
    """Where the drift starts (``logitdiff layers``): the residual stream after each decoder
    layer of the reference and of each candidate (source specs: ``hf:``, ``gguf:``,
    ``builtin:``) at every teacher-forced position of the ``reference_run`` RUN's tokens (the
    reference RUN: ``--reference`` of ``logitdiff layers``; ``reference`` is the reference's
    source spec), compared per layer (:mod:`logitdiff.layers`). ``floor``: ``"rerun"`` (the
    reference, each window in two forward passes), ``"none"``, or a source spec compared like a
    candidate (e.g. the BF16 GGUF: the cross-engine floor). Returns layers.json's object; with
    ``out``, also writes the REPORT directory (layers.json, layers.md, layers.html).
    ``teacher=`` is the deprecated name of ``reference_run=`` (docs/migration.md)."""
    from .contracts import layers_json
    from .layers import FLOOR_NONE, FLOOR_RERUN, FLOOR_SPEC, check_layer_specs, layer_attribution
    from .report.layers import render_html, render_markdown
    from .store.files import Kind, reserved, writing
    from .sources import applied_threads, open_source
    from .store import RunReader, parse_chunk_size

    bar = bar or _no_bar
    cands = [candidates] if isinstance(candidates, str) else list(candidates)
    if not cands:
        raise LogitdiffError("layers: name at least one candidate source spec")
    floor_spec = None if floor in (FLOOR_RERUN, FLOOR_NONE) else floor
    if floor_spec is not None and ":" not in floor_spec:
        raise LogitdiffError(f"--floor {floor!r}: expected rerun, none or a source spec (e.g. builtin:tiny-BF16)")
    check_layer_specs([reference, *cands] + ([floor_spec] if floor_spec else []))
    chunk_bytes = parse_chunk_size(chunk_size)
    # out guarded and locked for the whole sweep: a second writer is refused from the start
    with reserved(out, Kind.LAYERS, inputs=[reference_run]) if out is not None else contextlib.nullcontext():
        ref_run = RunReader(reference_run)
        ref_run.items()  # a damaged reference RUN is a one-line error before any source loads
        with contextlib.ExitStack() as stack:
            ref_src = stack.enter_context(open_source(reference))
            cand_srcs = [stack.enter_context(open_source(c)) for c in cands]
            floor_src = stack.enter_context(open_source(floor_spec)) if floor_spec else None
            stack.enter_context(applied_threads([ref_src, *cand_srcs] + ([floor_src] if floor_src else [])))
            advance = bar(len(ref_run.items()), "layers")
            doc = layer_attribution(ref_src, cand_srcs, ref_run, floor_src=floor_src, floor=FLOOR_SPEC if floor_spec else floor,
                                    chunk_bytes=chunk_bytes, progress=advance)
        if out is not None:
            text = layers_json(doc)
            with writing(out, Kind.LAYERS, inputs=[reference_run]) as tmp:
                (tmp / "layers.json").write_text(text)
                (tmp / "layers.md").write_text(render_markdown(doc))
                (tmp / "layers.html").write_text(render_html(doc))
        return doc


@_checked
def load_report(report_dir: str | Path) -> Report:
    """A REPORT directory's report.json (or the file itself), checked (kind, major version;
    against the schema when validation is on) and typed (:class:`logitdiff.contracts.Report`).
    A report of schema 1.x (``baseline``) is read as 2.0 (``reference``): docs/migration.md."""
    from .contracts import load_report as _load

    return _load(report_dir)


def run(**config: Any) -> RunSummary:
    """The whole job of ``logitdiff run`` (keyword arguments: the fields of
    :class:`logitdiff.pipeline.RunConfig`; none: the bundled default into ./logitdiff-out).
    Returns summary.json's object."""
    from .pipeline import Hooks, RunConfig, check_specs, run_pipeline

    import dataclasses
    import typing

    bar = config.pop("bar", None) or _no_bar
    if not callable(bar):
        raise LogitdiffError(f"run: argument 'bar' is {type(bar).__name__}; expected a callable")
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise LogitdiffError(f"run: unknown argument {unknown[0]!r} (takes {', '.join(sorted(fields))})")
    import os

    import logitdiff.pipeline as _pl

    for key in ("workload", "out"):  # paths as Path objects too
        if isinstance(config.get(key), os.PathLike):
            config[key] = os.fspath(config[key])

    check_arguments("run", typing.get_type_hints(RunConfig, globalns=vars(_pl)), config)
    if config.get("candidates_from") and "candidates" not in config:
        config["candidates"] = []  # the ladder alone, not the bundled one beside it
    cfg = RunConfig(**config)
    check_bootstrap(cfg.bootstrap)
    check_specs(cfg)

    class _Bars(Hooks):
        def bar(self, total: int, text: str) -> Callable[[int], None]:
            return bar(total, text)

    return run_pipeline(cfg, _Bars())


def _server_spec(text: str, role: str) -> tuple[str, bool | None]:
    """``URL`` or ``served:URL[,speculative=1|0]`` (or ``openai:URL...``): the llama-server URL and the declared
    speculation (None: not declared, taken from the server's /slots)."""
    parts = str(text).split(",")
    url, declared = parts[0], None
    for opt in parts[1:]:
        k, _, v = opt.partition("=")
        if k.strip() != "speculative" or v.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise LogitdiffError(f"{role} {text!r}: unknown option {opt!r} (generation mode takes speculative=1|0)")
        declared = v.strip().lower() in ("1", "true", "yes", "on")
    return url, declared


def speculate(
    reference: str,
    candidate: str,
    out: str | Path | None = None,
    *,
    workload: str | Path | None = None,
    n_predict: int = 256,
    top_k: int = 20,
    limit: int | None = None,
    floor_items: int = 8,
    shape_width: int = 4,
    speculative: bool | None = None,
    timeout: float = 600.0,
    bar: Bar | None = None,
) -> SpeculationReport:
    """``logitdiff speculate``: two llama-servers (speculation off: ``reference``; on:
    ``candidate``, ``URL`` or ``served:URL[,speculative=1]``) generate greedily from the same
    prompt token ids; floors, first divergences, survival, same-context comparison and a
    verdict (:mod:`logitdiff.speculation`). Writes ``out`` (report.json, report.md,
    report.html, generations.jsonl) when given; returns report.json's object."""
    import json
    import time as _time

    from ._version import __version__
    from .builtin import WORKLOAD
    from .sources.served.generate import LlamaServer
    from .store.files import Kind, reserved, writing
    from .report.speculation import render_html, render_markdown, speculation_json
    from .speculation import compare_generation, prepare_prompts
    from .workload import read_workload, workload_file

    bar = bar or _no_bar
    ref_url, ref_decl = _server_spec(reference, "reference")
    cand_url, cand_decl = _server_spec(candidate, "candidate")
    if ref_decl:
        raise LogitdiffError(f"reference {reference!r}: declared speculative; the reference of generation mode runs without speculation")
    declared = speculative if speculative is not None else cand_decl
    for flag, v, low in (("--max-tokens", n_predict, 1), ("--top-k", top_k, 1), ("--floor-items", floor_items, 0),
                         ("--shape-width", shape_width, 1), ("--limit", limit, 1)):
        if v is not None and v < low:
            raise LogitdiffError(f"{flag} {v}: must be at least {low}")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise LogitdiffError(f"--timeout {timeout}: must be a positive, finite number of seconds")
    wl = str(workload) if workload else str(WORKLOAD)
    # out guarded and locked for the whole generation: a second writer is refused from the start, not
    # replaced (whole) by whichever run finishes last
    wl_file = workload_file(wl)  # None: a benchmark read from its package
    with reserved(out, Kind.SPECULATION, inputs=[wl_file] if wl_file else []) if out is not None else contextlib.nullcontext():
        items = read_workload(wl)[: limit or None]
        ref = LlamaServer(ref_url, role="reference", top_k=top_k, timeout=timeout)
        try:
            cand = LlamaServer(cand_url, role="candidate", top_k=top_k, timeout=timeout)
            try:
                prompts = prepare_prompts(ref, cand, items)
                report, records = compare_generation(ref, cand, prompts, n_predict=n_predict, speculative=declared,
                                                     floor_items=floor_items, shape_width=shape_width, bar=bar)
            finally:
                cand.close()
        finally:
            ref.close()
        report = {"tool": {"name": "logitdiff", "version": __version__},
                  "created": _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()), **report}
        report["method"]["workload"] = wl
        text = speculation_json(report)
        if out is not None:
            with writing(out, Kind.SPECULATION, inputs=[wl]) as tmp:
                (tmp / "report.json").write_text(text)
                (tmp / "report.md").write_text(render_markdown(report))
                (tmp / "report.html").write_text(render_html(report))
                with open(tmp / "generations.jsonl", "w") as f:
                    for rec in records:
                        f.write(json.dumps(rec) + "\n")
        doc: SpeculationReport = json.loads(text)  # the written text, so the returned object equals the file
        return doc
