"""``logitdiff speculate``: speculation on vs off on llama-server, in generation mode."""

from __future__ import annotations

from .console import Bars, console

NAME = "speculate"
HELP = "compare a speculative llama-server with the same model without speculation, generating"


def register(sub) -> None:
    from ..defaults import DEFAULT_FLOOR_ITEMS, DEFAULT_N_PREDICT, DEFAULT_SHAPE_WIDTH, DEFAULT_TOP_K

    t = sub.add_parser(
        NAME,
        help=HELP,
        description=(
            "Both llama-servers generate greedily from the same prompt token ids (never text): fixed length (EOS ignored), one "
            "request at a time, prompt cache off, top-K raw logprobs. A teacher-forced or first-token comparison never runs a "
            "verify batch, so it cannot see speculation; this mode can. Checked first: the reference must not draft, and a "
            "candidate declared speculative (speculative=1, or /slots says it can) whose answers show no drafting "
            "(timings.draft_n = 0 on every request) is refused. Tokens with logprob 0.0 and no top list (llama-server's "
            "speculative tokens) are 'probability not reported', never p = 1. Floors: F0 each side against a rerun; F1 the "
            "reference's tokens teacher-forced in prefill batches of --shape-width tokens against its decode logprobs. Then per "
            "item the first divergence with both margins (near-tie within F1, or material), the survival curve, the "
            "same-context KL/top-1/dlogprob on the aligned prefix, cross-scoring after each divergence, and a verdict: "
            "'speculation numerically lossless', 'changes output by batch-shape numerics only', 'defect', 'speculation not "
            "exercised', or 'floor not measured' (a figure the verdict needs was read against a floor that compared no positions, "
            "e.g. --floor-items 0: never lossless from zero evidence), or 'floor too small to judge' (prefix positions whose KL "
            "provably exceeds F1's largest, by its proven lower bound, but no more of them than chance leaves with F1 measured "
            "on so few positions: raise --floor-items). A reference position without a probability is a measurement gap, said "
            "in the reasons, not a defect. Writes OUT/report.json (schema "
            "logitdiff.speculation/1), report.md, report.html, generations.jsonl."
        ),
    )
    t.add_argument("reference", metavar="REFERENCE", help="llama-server URL without speculation, e.g. http://127.0.0.1:8080")
    t.add_argument("candidate", metavar="CANDIDATE",
                   help="llama-server URL with speculation; append ,speculative=1 to declare it (then no drafting is refused)")
    t.add_argument("--out", required=True, help="output directory (a new one, or one this command wrote)")
    t.add_argument("--workload", default=None, help="workload JSONL (default: the bundled one)")
    t.add_argument("--max-tokens", type=int, default=DEFAULT_N_PREDICT, help="tokens generated per item, EOS ignored (default: %(default)s)")
    t.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="logprobs per position (n_probs; default: %(default)s)")
    t.add_argument("--limit", type=int, default=None, help="only the first N items of the workload")
    t.add_argument("--floor-items", type=int, default=DEFAULT_FLOOR_ITEMS,
                   help="items that get the floors F0 (reruns) and F1 (teacher-forced re-scoring); with few, F1's largest "
                        "KL is a low bar the prefix passes by chance, read as 'floor too small to judge' (default: %(default)s)")
    t.add_argument("--shape-width", type=int, default=DEFAULT_SHAPE_WIDTH,
                   help="prefill batch width of F1: the verify batch's width, draft max + 1 (default: %(default)s)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    t.set_defaults(func=run)


def run(args) -> int:
    from ..api import speculate

    with Bars() as bars:
        rep = speculate(args.reference, args.candidate, args.out, workload=args.workload, n_predict=args.max_tokens, top_k=args.top_k,
                        limit=args.limit, floor_items=args.floor_items, shape_width=args.shape_width, timeout=args.timeout,
                        bar=bars.bar)
    con = console()
    v, s = rep["verdict"], rep["summary"]
    con.print(f"[bold]verdict: {v['label']}[/]")
    for r in v["reasons"]:
        con.print(f"  {r}")
    for d in v["defects"]:
        con.print(f"  [red]defect[/]: {d}")
    con.print(f"identical outputs {100 * s['identical_output_rate']:.1f}% of {s['items']} items; wall {rep['timing']['wall_s']:.1f} s")
    console().print(f"wrote {args.out}/report.json, report.md, report.html, generations.jsonl")
    return 0
