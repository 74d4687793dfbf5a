"""``logitdiff judge``: the judge of ``--judge SOURCE`` -- its prompt, and its measured agreement."""

from __future__ import annotations

from .console import Bars, console, table_console

NAME = "judge"
HELP = "the judge of --judge: print its prompt, measure its agreement with blind readers"

AGREEMENT_DESCRIPTION = """\
Run a judge (any source that generates: served:URL, gguf:PATH, hf:DIR, builtin:...) on the
blind-labelled branches of real runs, with the prompt and parse rule of `flips --judge` and
`run --judge`, and print how far it agrees with the readers: per class (same = the reader
said benign or recovered, different = meaning_changed) the cases it answers alike with a
Wilson 95 % interval, its unparsed answers (never agreeing), and Cohen's kappa, against the
first reader and against both readers' consensus where a second reader labelled the set.

Sets: smollm and smollm_b (180 branches each of SmolLM2-135M-Instruct quantizations, two
readers), real (268 branches of the bundled tiny model, one reader). They are files of the
logitdiff repository (tests/data/flip_labels_*.jsonl) and are NOT in the installed package:
run this from a checkout (the default --labels is the checkout's tests/data), or pass
--labels DIR holding them. docs/flips.md ("Judges") records every judge measured so."""


def register(sub) -> None:
    import argparse

    from ..defaults import JUDGE_HELP

    p = sub.add_parser(NAME, help=HELP, description=HELP + ".")
    jsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    pr = jsub.add_parser("prompt", help="print the judge's fixed prompt and parse rule")
    pr.set_defaults(func=run_prompt)
    ag = jsub.add_parser("agreement", help="measure a judge's agreement with the blind-labelled flip sets",
                         description=AGREEMENT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ag.add_argument("--judge", metavar="SOURCE", required=True, help=JUDGE_HELP.split(": YES")[0])
    ag.add_argument("--set", dest="sets", default="smollm_b", choices=("smollm", "smollm_b", "real", "all"),
                    help="the labelled set (default: %(default)s)")
    ag.add_argument("--limit", type=int, default=None, metavar="N",
                    help="N cases of each set, spread evenly through it (default: every case)")
    ag.add_argument("--labels", metavar="DIR", default=None, help="the directory of flip_labels_*.jsonl (default: the checkout's tests/data)")
    ag.set_defaults(func=run_agreement)


def run_prompt(args) -> int:
    from ..flips.judge import JUDGE_MAX_TOKENS, JUDGE_PROMPT, PARSE_RULE

    print(JUDGE_PROMPT)
    print(f"\n(greedy, at most {JUDGE_MAX_TOKENS} tokens, the judge's chat template; parse rule: {PARSE_RULE})")
    return 0


def run_agreement(args) -> int:
    from pathlib import Path

    from ..errors import LogitdiffError
    from ..flips.judge import open_judge
    from ..flips.judge_agreement import SETS, default_labels_dir, load_set, measure, spread
    from ..sources import applied_threads

    if args.limit is not None and args.limit < 1:
        raise LogitdiffError(f"--limit {args.limit}: must be at least 1")
    labels = Path(args.labels) if args.labels else default_labels_dir()
    names = SETS if args.sets == "all" else (args.sets,)
    cases = {n: spread(load_set(n, labels), args.limit) for n in names}  # every file read before the judge opens
    with open_judge(args.judge) as judge, applied_threads([judge.source]):
        model = judge.model
        console().print(f"judge {judge.spec}: {model.get('model')} ({model.get('sha256') or 'no sha256'})")
        for name in names:
            with Bars() as bars:
                result = measure(judge, cases[name], progress=bars.bar(len(cases[name]), f"{name}: judging"))
            _print_result(name, len(cases[name]), args.limit, result)
    return 0


def _print_result(name: str, n: int, limit: int | None, result: dict) -> None:
    from rich.table import Table

    def pct(ci):
        return "n/a" if ci[0] is None else f"{100 * ci[0]:.0f}-{100 * ci[1]:.0f} %"

    con = table_console()
    sample = f", {n} spread through the set (--limit {limit})" if limit is not None else ""
    for against in ("reader", "consensus"):
        r = result.get(against)
        if r is None:
            continue
        who = "the first reader" if against == "reader" else "both readers' consensus"
        con.print(f"\n{name}: the judge against {who} ({r['n']} cases{sample})")
        t = Table()
        t.add_column("class")
        t.add_column("agree", justify="right")
        t.add_column("Wilson 95 %", justify="right")
        for c, d in r["per_class"].items():
            t.add_row(c, f"{d['agree']}/{d['n']}", pct(d["ci"]))
        con.print(t)
        kappa = "n/a" if r["kappa"] is None else f"{r['kappa']:.3f}"
        con.print(f"{name}, against {who}: Cohen's kappa {kappa}; {r['unparsed']} unparsed answers (counted as disagreeing)")
    con.print(f"{name}: {n} cases judged in {result['seconds']:.0f} s")
