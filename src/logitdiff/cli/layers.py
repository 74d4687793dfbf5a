"""``logitdiff layers``: where the drift starts, layer by layer."""

from __future__ import annotations

from .console import Bars, table_console
from .options import add_chunk_size, add_reference_run, required_reference_run

NAME = "layers"
HELP = "per-layer attribution: where in the network a candidate's hidden states leave the reference's"


def register(sub) -> None:
    from ..defaults import FLOOR_RERUN

    p = sub.add_parser(
        NAME,
        help=HELP,
        description=(
            "For every teacher-forced position of the reference RUN's tokens (--reference), the residual stream after each decoder "
            "layer (and after the token embedding) of the reference and of each candidate, compared per layer: "
            "relative L2 error, cosine, SQNR (dB) and growth (a layer's median error over the previous layer's), "
            "with the first layer where a candidate leaves the floor band (its median error above the floor's p95), the "
            "layers that add the most error (median |e - e_prev| / |r|, e = cand - ref), and per item the rank "
            "correlation between a layer's error and the position's final KL. Sequences are prefilled a window of "
            "tokens at a time over a KV cache, the window sized so that both sides' hidden states of every layer and "
            "their logits fit --chunk-size (the engines' own logit buffers come on top: peak memory above the "
            "loaded models is about 1.7-3x --chunk-size with hf:). Sources: hf:, "
            "gguf: (llama.cpp's graph evaluation callback on l_out-i) and builtin:; served sources hand out no hidden "
            "states. Writes REPORT/layers.json, layers.md and layers.html (self-contained plots)."
        ),
        epilog=(
            "example: logitdiff layers builtin:tiny builtin:tiny-Q4_K_M builtin:tiny-Q2_K --reference runs/ref "
            "--floor builtin:tiny-BF16 --out reports/layers"
        ),
    )
    p.add_argument("reference", metavar="REF_SPEC", help="the reference's source spec (hf:PATH, gguf:PATH, builtin:tiny...)")
    p.add_argument("candidates", metavar="CAND", nargs="+", help="candidate source spec(s), one line per candidate in the plots")
    add_reference_run(p, "the reference RUN whose tokens (and positions) are teacher-forced (required; REF_SPEC is the reference's "
                         "source spec, e.g. the spec that captured this RUN); --teacher is its deprecated name")
    p.add_argument("--out", metavar="REPORT", help="write layers.json, layers.md and layers.html to this directory")
    p.add_argument("--floor", default=FLOOR_RERUN, metavar="rerun|none|SPEC",
                   help="what arithmetic noise alone does per layer: 'rerun' (default: the reference again, every window "
                        "prefilled in two forward passes instead of one: other float rounding), 'none', or a source spec "
                        "compared like a candidate, e.g. builtin:tiny-BF16 (the same weights in llama.cpp: the cross-engine floor)")
    add_chunk_size(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..api import layers
    from ..report.layers import render_markdown

    reference_run = required_reference_run(args, "the reference RUN whose tokens are teacher-forced")
    with Bars() as bars:
        doc = layers(args.reference, args.candidates, reference_run, args.out, floor=args.floor, chunk_size=args.chunk_size, bar=bars.bar)
    con = table_console()
    con.print(render_markdown(doc).split("\n## ", 1)[0].rstrip())
    if args.out:
        con.print(f"wrote {args.out}/layers.json, layers.md, layers.html")
    return 0
