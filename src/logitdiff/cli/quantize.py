"""``logitdiff quantize``: candidates from your own model, with llama.cpp's own quantizer."""

from __future__ import annotations

from .console import console, progress, table_console

NAME = "quantize"
HELP = "quantize your own model (GGUF or transformers directory) into GGUF candidates"
DESCRIPTION = (
    "Write one GGUF per --types entry of MODEL into the QUANT directory --out, with llama.cpp's own "
    "quantizer (llama_model_quantize through llama-cpp-python). MODEL is a GGUF file (already quantized: "
    "requantized, as llama-quantize --allow-requantize) or a transformers model directory (exported to "
    "F32 GGUF first; F32 and BF16 may then be asked for too). As llama-quantize does, a tensor whose rows "
    "are not a multiple of the type's block size is written in a fallback type rather than refused: the "
    "table and OUT/quantize.json list every such tensor. The files are candidates for `logitdiff run "
    "--candidate gguf:OUT/NAME.gguf`."
)
EPILOG = "example: logitdiff quantize SmolLM2-135M-Instruct.Q4_1.gguf --types Q8_0,Q4_K_M,Q2_K --out quants/"


def register(sub) -> None:
    p = sub.add_parser(NAME, help=HELP, description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("model", metavar="MODEL", help="a GGUF file or a transformers model directory (gguf:/hf: specs accepted)")
    p.add_argument("--types", required=True, help="comma-separated llama.cpp types, e.g. Q8_0,Q6_K,Q4_K_M,IQ4_XS,Q3_K_M,Q2_K")
    p.add_argument("--out", required=True, help="QUANT directory to create (or, with --overwrite, an earlier one to replace)")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix (llama-imatrix's file); runs llama-quantize")
    p.add_argument("--threads", type=int, default=0, help="quantizer threads (default: llama.cpp's choice)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it holds a QUANT directory (never anything else)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.table import Table

    from ..sources.quantize_model import quantize_model

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    bar, advance = progress(len(types), "quantizing")

    def step(name: str, status: str) -> None:
        if status == "built":
            advance()

    with bar:
        files = quantize_model(args.model, types, args.out, overwrite=args.overwrite, imatrix=args.imatrix,
                               nthread=args.threads, progress=step)
    table = Table(title=f"{args.out}: llama.cpp quantizations")
    for col in ("type", "file", "weights mostly", "fallback tensors"):
        table.add_column(col, overflow="fold")
    for f in files:
        fb = ", ".join(sorted(set(f.fallbacks.values())))
        table.add_row(f.type, f.file, f.dominant,
                      f"{len(f.fallbacks)} ({fb}): rows not a multiple of the block size" if f.fallbacks else "none")
    table_console().print(table)
    console().print(f"wrote QUANT {args.out}", highlight=False)
    return 0
