"""``logitdiff import``: another tool's logits -> RUN (llama.cpp's KLD base file, .npz)."""

from __future__ import annotations

from pathlib import Path

from .console import console, progress

NAME = "import"
HELP = "import another tool's logits into a RUN"


def register(sub) -> None:
    imp = sub.add_parser(NAME, help=HELP, description="Import another tool's logits into a RUN directory.")
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
    lk.set_defaults(func=run_llamacpp)
    nz = isub.add_parser(
        "npz", help="NumPy .npz with logits, token_ids, item_ids, positions",
        description="Import a .npz holding logits [N, V], token_ids [N] (the token each row predicts), item_ids [N], positions [N].",
    )
    nz.add_argument("file")
    nz.add_argument("--out", required=True, help="RUN directory to create (or, with --overwrite, a RUN to replace)")
    nz.add_argument("--overwrite", action="store_true", help="replace --out if it holds a RUN (never anything else)")
    nz.set_defaults(func=run_npz)


def run_llamacpp(args) -> int:
    from ..store.importers import import_llamacpp_kld, read_kld_header
    from ..store.files import Kind, reserved

    # locked from the start: the file's rows are all checked before the import writes
    with reserved(args.out, Kind.RUN, inputs=[args.file], overwrite=args.overwrite):
        _, _, n_chunk = read_kld_header(Path(args.file)) if Path(args.file).exists() else (0, 0, None)
        prog, advance = progress(n_chunk, "importing chunks")
        with prog:
            import_llamacpp_kld(args.file, args.out, bos_id=args.bos_id, overwrite=args.overwrite, progress=advance)
    console().print(f"wrote RUN {args.out}")
    return 0


def run_npz(args) -> int:
    from ..store.importers import import_npz
    from ..store.files import Kind, reserved

    with reserved(args.out, Kind.RUN, inputs=[args.file], overwrite=args.overwrite):  # locked while the file is checked
        import_npz(args.file, args.out, overwrite=args.overwrite)
    console().print(f"wrote RUN {args.out}")
    return 0
