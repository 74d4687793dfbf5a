"""``logitdiff topk-error``: how wrong the top-K KL approximation is on two full-logit
RUNs, and whether the proven intervals hold."""

from __future__ import annotations

import contextlib
import json

from .console import console, table_console
from .options import add_chunk_size

NAME = "topk-error"
HELP = "measure the error of the top-K KL approximation on two full-logit RUNs"


def register(sub) -> None:
    t = sub.add_parser(
        NAME,
        help=HELP,
        description=(
            "For two full-logit RUNs (reference, candidate): exact KL(P_ref || P_cand) over the whole "
            "vocabulary next to the seed report's top-K approximation at each K (missing candidate "
            "tokens share its tail mass, one tail bucket): mean, p95 and max of both, mean absolute "
            "error, relative error of the mean, median per-position relative error, top-1 agreement. "
            "It also checks the proven intervals (docs/bounds.md) against the exact values: per K those "
            "of a top-K/top-K comparison, per --compact SPEC those of a compact reference; coverage, mean "
            "width, and the estimate's error next to the seed's."
        ),
    )
    t.add_argument("run_a", metavar="RUN_A", help="reference RUN (full logits)")
    t.add_argument("run_b", metavar="RUN_B", help="candidate RUN (full logits)")
    t.add_argument("--top-k", "--k", dest="k", default="8,20,64,256", metavar="K,K...",
                   help="comma-separated K values (default: %(default)s; --k is its old name)")
    t.add_argument("--compact", action="append", metavar="SPEC",
                   help="also check a compact reference store, e.g. compact:exact=512,band=3584 (repeatable)")
    t.add_argument("--json", metavar="PATH", help="also write the numbers as JSON (a new file, or one topk-error wrote)")
    t.add_argument("--logprob-floor", type=float, default=None, metavar="NATS",
                   help="check the top-K intervals with this stated floor on every log-probability (as compare "
                        "--logprob-floor), which gives forward and reverse KL finite upper bounds; the runs' full rows must "
                        "satisfy it. The lowest log-probability of either run (the tightest true floor) is printed either way")
    add_chunk_size(t)
    t.set_defaults(func=run)


def run(args) -> int:
    from ..compare import check_floor_value
    from ..store.files import Kind, reserved
    from ..compare.topk_error import parse_ks

    ks = parse_ks(args.k)
    check_floor_value(args.logprob_floor)
    # --json guarded and locked for the whole measurement: a second writer is refused from the start
    with reserved(args.json, Kind.TOPK_JSON, inputs=[args.run_a, args.run_b]) if args.json else contextlib.nullcontext():
        return _run(args, ks)


def _run(args, ks) -> int:
    from rich.table import Table

    from ..contracts import TOPK_ERROR_SCHEMA
    from ..store.files import Kind, writing
    from ..compare.topk_error import topk_error
    from ..store import RunReader, parse_chunk_size

    res = topk_error(RunReader(args.run_a), RunReader(args.run_b), ks, compact_specs=args.compact or (),
                     chunk_bytes=parse_chunk_size(args.chunk_size), logprob_floor=args.logprob_floor)
    ex = res["exact"]
    t = Table(title=f"top-K approximation vs exact KL — {res['n']} positions, {res['items']} items, V={res['vocab_size']} (nats)")
    for col in ("K", "exact mean", "approx mean", "exact p95", "approx p95", "exact max", "approx max", "mean |err|", "rel err of mean",
                "median rel err", "reference top-K mass", "top-1 agree"):
        t.add_column(col, justify="right")
    g = lambda x: f"{x:.4g}"  # noqa: E731
    for row in res["rows"]:
        t.add_row(str(row["k"]), g(ex["mean"]), g(row["approx_mean"]), g(ex["p95"]), g(row["approx_p95"]), g(ex["max"]),
                  g(row["approx_max"]), g(row["mean_abs_err"]), f"{100 * row['rel_err_of_mean']:.2f}%",
                  f"{100 * row['median_rel_err']:.2f}%", f"{row['ref_top_mass_mean']:.4f}", f"{100 * row['top1_agreement']:.2f}%")
    con = table_console(width=200)
    con.print(t)
    con.print(_bounds_table(res))
    floor = res["logprob_floor"]
    con.print(f"lowest log-probability of either run: {ex['logprob_min']:.4g} nats (the tightest true floor); top-K upper bounds "
              + (f"with the stated floor {floor:g}" if floor is not None else "of KL: inf without a stated floor (--logprob-floor)"))
    if args.json:
        with writing(args.json, Kind.TOPK_JSON, inputs=[args.run_a, args.run_b]) as tmp:
            tmp.write_text(json.dumps({"schema": TOPK_ERROR_SCHEMA, **res}, indent=1) + "\n")
        console().print(f"wrote {args.json}")
    return 0


def _bounds_table(res: dict):
    """Coverage and width of the proven intervals (docs/bounds.md), per K and per compact store."""
    from rich.table import Table

    t = Table(title="proven intervals vs exact (coverage must be 100 %; nats)")
    for col in ("store", "divergence", "exact mean", "lower mean", "upper mean", "mean width", "width / exact", "coverage",
                "estimate err of mean"):
        t.add_column(col, justify="right")
    exact = {"kl": res["exact"]["mean"], "kl_rev": res["exact"]["kl_rev_mean"], "jsd": res["exact"]["jsd_mean"]}
    from ..store.kinds import given_rows_kind

    lines = [(given_rows_kind(r["k"]).text, r["bounds"], {"kl": r["rel_err_of_mean"]}) for r in res["rows"]]
    lines += [(c["store"], c["bounds"], {}) for c in res.get("compact", [])]
    for store, b, seed_err in lines:
        for d, x in b.items():
            est = x.get("estimate_rel_err_of_mean", seed_err.get(d))
            w = x["width_over_exact_mean"]
            t.add_row(store, d, f"{exact[d]:.4g}", f"{x['lower_mean']:.4g}", f"{x['upper_mean']:.4g}", f"{x['mean_width']:.4g}",
                      "n/a" if w is None else f"{100 * w:.3g}%", f"{100 * x['coverage']:.2f}%", "" if est is None else f"{100 * est:.2f}%")
    return t
