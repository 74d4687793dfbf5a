"""``logitdiff merge``: shard RUNs (``capture --shard i/n``) -> one RUN."""

from __future__ import annotations

from .console import console
from .options import add_chunk_size

NAME = "merge"
HELP = "merge shard RUNs (capture --shard i/n) into one RUN"


def register(sub) -> None:
    m = sub.add_parser(
        NAME,
        help=HELP,
        description=(
            "Join complete RUNs that are shards of one capture into one RUN. Refuses partial runs, "
            "different vocabularies, tokenizers, stores or capture settings, an item present twice, "
            "and an incomplete shard set (when the runs record their --shard). Shards of i mod n are "
            "interleaved back into workload order. Written to a temporary directory and renamed."
        ),
    )
    m.add_argument("runs", nargs="+", metavar="RUN", help="shard RUN directories")
    m.add_argument("--out", required=True, help="RUN directory to create")
    m.add_argument("--overwrite", action="store_true", help="replace --out if it holds a RUN (never anything else)")
    add_chunk_size(m)
    m.set_defaults(func=run)


def run(args) -> int:
    from ..store.files import Kind, reserved
    from ..capture.shards import merge_runs
    from ..store import RunReader, parse_chunk_size

    chunk_bytes = parse_chunk_size(args.chunk_size)
    with reserved(args.out, Kind.RUN, inputs=args.runs, overwrite=args.overwrite):  # locked while the shards are checked
        out = merge_runs(args.runs, args.out, overwrite=args.overwrite, chunk_bytes=chunk_bytes)
    r = RunReader(out)
    console().print(f"wrote RUN {out} ({len(r.items())} items, {r.manifest['n_positions']} positions from {len(args.runs)} runs)")
    return 0
