"""Stage *cli*: the top; imports the public API and any stage, and nothing imports it.

The ``logitdiff`` command line: a thin layer over the library.

One module per command (``capture``, ``compare``, ``run``, ``flips``, ``speculate``, ``report``, ``merge``,
``topk-error``, ``import``, ``layers``, ``quantize``, ``workloads``, ``judge``), each with ``NAME``, ``HELP``, ``register(subparsers)`` and
``run(args) -> exit status``; they share one console/progress helper (``console.py``) and
the option checks whose defaults are the library's (``options.py``). :func:`main` is the
only place that sets process-wide state (environment, llama.cpp's log level, the SIGTERM
handler), explicitly; torch's thread count is set per job by the sources it opens
(``sources.applied_threads``) and the metrics take theirs as a parameter.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .._version import __version__
from ..errors import LogitdiffError
from . import capture, compare, flips, import_, judge, layers, merge, quantize, report, run, speculate, topk_error, workloads

# In the order `logitdiff --help` lists them.
COMMANDS = (run, capture, compare, flips, judge, speculate, report, import_, merge, topk_error, layers, quantize, workloads)

EPILOG = """\
Typical use:
  logitdiff run                                   # the bundled default: tiny model + GGUF quant ladder
  logitdiff quantize my-model.gguf --types Q8_0,Q4_K_M --out quants/   # candidates, llama.cpp's own quantizer
  logitdiff workloads validate w.jsonl            # every bad record of your workload, one line each
  logitdiff capture hf:./bf16-model --workload w.jsonl --out runs/ref
  logitdiff capture gguf:./q4.gguf --reference runs/ref --out runs/q4
  logitdiff compare runs/ref runs/q4 --out reports/q4
  logitdiff flips reports/q4                      # what the top-1 flips do; correctness flips
  logitdiff speculate http://h:8080 http://h:8081,speculative=1 --out spec/   # speculation on vs off, generating
  logitdiff report reports/q8 reports/q4 --out q.html
  logitdiff import llamacpp-kld base.kld --out runs/base

Outputs: --out is replaced only when it holds the same kind of logitdiff output (and,
where a command has --overwrite, only with it), never when it is another directory or
file or one of the command's inputs; a new output is built beside the old one and swapped
in when complete, and a second writer to the same output is refused (naming its pid).
Errors are one line on stderr, exit status 2. Gates (--fail-on, --require on run, compare
and flips): exit status 3 when a clause is crossed, 4 when none is but a clause's metric is
not in the report (not evaluated).

Every divergence is in nats (natural log) with a bits twin; drift is measured against the
reference, which is a numerical-fidelity reference, not an oracle of correctness.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logitdiff",
        description="How far a candidate LLM (quant, kernel, server) drifts from its reference, token by token.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"logitdiff {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup runs as for Ctrl-C."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _last_resort(e: BaseException, args) -> str:
    """One line for an error no layer named: the path (the error's, else --out) and why."""
    import errno

    if isinstance(e, RecursionError):
        return "input nested too deeply (recursion limit)"
    if isinstance(e, MemoryError):
        return "out of memory (lower --chunk-size, or free memory)"
    path = getattr(e, "filename", None) or getattr(args, "out", None) or getattr(args, "json", None) or "?"
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
        why = "no space left on device"
    else:
        why = getattr(e, "strerror", None) or " ".join(str(e).split())[:200] or type(e).__name__
    return f"{path}: {why}"


def _check_common(args) -> None:
    """Options several commands share, checked once: a bootstrap/sample seed is >= 0."""
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise LogitdiffError(f"--seed {seed}: must be a non-negative integer")


def entry() -> int:
    """The program's entry point (the ``logitdiff`` script, ``python -m logitdiff.cli``):
    :func:`main`, then a prompt exit.

    Python's last garbage collection at exit walks every object the process still holds --
    millions once torch and transformers are imported -- only to free memory the OS takes
    back anyway: 1.5-4 s after "wrote RUN" on a loaded 2-core machine. ``gc.freeze()``
    moves them out of the collector's reach; objects are still freed by reference counting,
    atexit handlers and ``weakref.finalize`` callbacks still run and the streams are
    flushed by the normal exit, so nothing is lost (unlike ``os._exit``). Only here, never
    in :func:`main`: a process that calls main repeatedly (tests) keeps its collector."""
    status = main()
    import gc

    gc.freeze()
    return status


def main(argv: list[str] | None = None) -> int:
    import os

    # Our own progress bars only: silence transformers' weight-loading bars and advisories;
    # nothing is ever fetched from a hub.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Other libraries' tqdm bars (transformers' "Converting and de-quantizing GGUF tensors",
    # drawn once per hf:FILE.gguf load, thousands of characters a line when piped): where
    # stderr is not a terminal there is nobody to watch them; ours (rich) say the same.
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    # llama.cpp's own log only at error level (what the progress bars and tables replace);
    # a process-wide setting, so made here and nowhere else.
    from ..sources.gguf import quiet_llama_log

    quiet_llama_log()
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
        _check_common(args)
        return int(args.func(args) or 0)
    except LogitdiffError as e:
        print(f"logitdiff: error: {e}", file=sys.stderr)
        return 2
    except (OSError, RecursionError, MemoryError) as e:
        # the last resort: a write or read that no layer below turned into its own line
        print(f"logitdiff: error: {_last_resort(e, args)}", file=sys.stderr)
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
