"""``logitdiff capture``: a source's distributions over a workload (reference) or over a
reference RUN's tokens (candidate) -> RUN."""

from __future__ import annotations

from .console import Bars, console
from ..sources.options import spec_help
from .options import add_chunk_size, add_reference_run, reference_run_arg

NAME = "capture"
HELP = "capture a source's distributions over a workload (reference) or a reference's tokens (candidate)"
DESCRIPTION = (
    "Without --reference: the source generates greedily (temperature 0) for every workload item; "
    "the output token ids are the teacher sequence and the source's distribution at every output "
    "position is kept. With --reference RUN: the source is fed exactly the reference RUN's token ids "
    "(teacher forcing) and scored at the same positions; its tokenization of every item is first "
    "checked against the reference's. Distributions always come from one prefill over prompt + "
    "teacher, so reference, rerun and candidates are computed alike. A killed capture resumes "
    "with --resume."
)
EPILOG = (
    spec_help()  # from the declared source options (logitdiff.sources.options)
    + "vLLM: start it with --max-logprobs K and, for speed, --skip-tokenizer-init (then pass tokenizer=PATH); "
    "without that flag vLLM decodes the text of every returned logprob entry, which logitdiff never reads."
)


def register(sub) -> None:
    from ..defaults import SCORE_BATCH
    from ..store.kinds import store_help

    cap = sub.add_parser(NAME, help=HELP, description=DESCRIPTION, epilog=EPILOG)
    cap.add_argument("spec", metavar="SPEC", help="source spec")
    cap.add_argument("--workload", help="workload JSONL (reference capture; default: the bundled workload), or text:FILE: "
                     "a plain text scored in llama-perplexity's chunks, no generation (--ctx, --chunks)")
    cap.add_argument("--ctx", type=int, default=None, metavar="N",
                     help="text: workloads: tokens per chunk, llama-perplexity's -c; the second half of each chunk is "
                          "scored (default: 512, as llama-perplexity)")
    cap.add_argument("--chunks", type=int, default=None, metavar="N",
                     help="text: workloads: score at most the first N chunks, llama-perplexity's --chunks (default: all)")
    add_reference_run(cap, "reference RUN whose token ids the source is fed (candidate capture); --teacher is its "
                           "deprecated name")
    cap.add_argument("--out", required=True, help="RUN directory to write: new or empty (written in place, so --resume can "
                     "continue it), or a RUN with --resume / --overwrite; never anything else")
    cap.add_argument("--max-tokens", type=int, default=None, help="generation budget per item, >= 1 (default: the item's max_tokens, else 64)")
    cap.add_argument("--store", default="full",
                     help=f"{store_help()}; docs/bounds.md (default: %(default)s)")
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
                          f"(default: {SCORE_BATCH}). A batched backend's numbers depend on the batch mates; --resume and --shard "
                          "keep them. A rerun of the reference with another N is a noise floor for `compare --noise-floor`")
    cap.add_argument("--endpoint", action="append", default=[], metavar="URL",
                     help="another replica of a served: server, shared round-robin (repeatable)")
    add_chunk_size(cap)
    cap.set_defaults(func=run)


def run(args) -> int:
    from ..api import capture_run

    reference = reference_run_arg(args)
    with Bars() as bars:
        capture_run(args.spec, args.out, workload=args.workload, reference=reference, max_tokens=args.max_tokens, store=args.store,
                positions=args.positions, resume=args.resume, overwrite=args.overwrite, shard=args.shard, batch=args.batch,
                endpoints=args.endpoint, chunk_size=args.chunk_size, bar=bars.bar, ctx=args.ctx, chunks=args.chunks)
    console().print(f"wrote RUN {args.out}")
    return 0
