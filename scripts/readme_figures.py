#!/usr/bin/env python
"""The bundled default's figures (docs/figures.md, README's table), regenerated from a run rather than remembered.

    .venv/bin/python scripts/readme_figures.py                 # fresh `logitdiff run`, rewrite docs/figures.md (+ README's table)
    .venv/bin/python scripts/readme_figures.py --from OUT      # an existing run's OUT directory
    .venv/bin/python scripts/readme_figures.py --print         # print the block, leave the files alone
    .venv/bin/python scripts/readme_figures.py --check --from OUT   # exit 1 when the files' figures differ

Two files hold figures. docs/figures.md (``--readme FILE``; the name is historical: any file
with the markers) holds one full section per machine class. README.md (``--summary FILE``)
holds, between ``<!-- readme_figures:summary:begin -->`` and ``<!-- readme_figures:summary:end -->``,
the first table (the candidates' KL) of the one class README was written on, opened by that
class's marker: the script rewrites it, and ``--check`` compares it row by row, only on a
machine of that class (another class's run says it did not compare it). ``--readme FILE``
without ``--summary`` touches that file only (so a test's copy never reaches README.md).

Without ``--from`` it runs ``logitdiff run --out DIR`` (DIR: ``--out``, else a new temporary
directory, removed afterwards; with --out, the timing is kept in DIR/readme_figures.timing.json
for a later --from DIR) with this Python, timing it, and states the machine: CPU
model, cores, memory, the load average before and after, the llama.cpp and torch versions
the reports record. It then writes README's two run tables and every figure quoted in the
paragraphs below them (noise floor, × floor, ties, recovered count, McNemar p) between the
markers ``<!-- readme_figures:begin -->`` and ``<!-- readme_figures:end -->``, replacing what
was there (atomically: logitdiff.store.files.atomic_write_bytes). Every number comes from the
run's summary.json, report.json files and flips.parquet; fields that a run does not have
are left out with the sentence that would quote them.

The figures depend on the CPU's instruction set (torch's and llama.cpp's kernels take other
paths with AVX-512 than with AVX2: other rounding, so other logits, ties and noise floor), so
README keeps one section per machine class (vendor and widest SIMD level, e.g. ``amd-avx2``,
``amd-avx512bf16``), each opened by ``<!-- readme_figures:class KEY -->``. The script rewrites
only this machine's section (added when README has none), and ``--check`` compares only it,
and in it only what must match (:func:`pinned`): the machine class and cores, the tables and
the figures of the paragraphs; not the header sentence's wall time, load, CPU model, memory or
library versions (the run's, not the method's; a run read with ``--from`` words its header
otherwise). Versions that differ from README's are named in a warning line, not a failure;
figures that differ are printed as a unified diff of the compared lines (exit 1). A class
README has no section for is reported as such (exit 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- readme_figures:begin -->", "<!-- readme_figures:end -->"
CLASS_MARK = re.compile(r"<!-- readme_figures:class ([a-z0-9-]+) -->\n")
# the machine's words as render() writes them: CPU model (ISA words), N cores[, M GiB] (versions)
ISA_WORDS = r"(AVX[^()]*|no AVX2[^()]*|instruction set unknown)"
MACHINE = re.compile(r"on [^`]*? \(" + ISA_WORDS + r"\), (\d+) cores(?:, \d+ GiB)? \(")
FLOOR_MACHINE = re.compile(r"on [^`]*? \(" + ISA_WORDS + r", (\d+) cores\)\.")
# the run's own wall time and load: not compared by --check (whitespace is collapsed first)
TIMING = re.compile(r"took \d+ s wall \(`summary\.json` seconds: [^)]*\); load average \(1/5/15 min\) \S+ before and \S+ after, "
                    r"so (?:other work shared the machine|the machine was otherwise quiet)\.")
SIGNIFICANCE = 0.05
# the header sentence render() opens a section with (fresh run or --from): not compared as text
HEADER = re.compile(r"(Measured|Figures) by `scripts/readme_figures\.py`")
# the library versions the header names, "(llama-cpp-python 0.3.36, torch 2.13.0+cpu, transformers 5.24.0)"
VERSION = re.compile(r"\b(llama-cpp-python|torch|transformers) ([^\s,()]+)")


# ----------------------------------------------------------------------------- the machine
def machine() -> dict:
    """The CPU, usable cores and memory (GiB, whole) of this machine, as reports record it."""
    from logitdiff.report import machine_info

    info = machine_info()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = info["cpu_count"]
    mem = info["memory_gib"]
    return {"cpu": info["cpu"] or "unknown CPU", "cores": cores, "memory_gib": round(mem) if mem else None,
            "class": info["cpu_class"], "isa": info["simd"]}


def machine_class(cpuinfo: str | None = None) -> tuple[str, str]:
    """(key, words) of this machine's class: `logitdiff.report.cpu_class` (vendor and widest
    SIMD level), as report.json's machine section records it."""
    from logitdiff.report import cpu_class

    return cpu_class(cpuinfo)


def load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_logitdiff(out: Path) -> dict:
    """``logitdiff run --out OUT`` with this interpreter; wall time and load around it."""
    before = load()
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "logitdiff.cli", "run", "--out", str(out)]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=str(out.parent), stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"readme_figures: `logitdiff run` exited with status {r.returncode}")
    return {"wall_s": wall, "load_before": before, "load_after": load()}


# ----------------------------------------------------------------------------- formatting
def e2(x) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def g3(x) -> str:
    """3 significant digits, no exponent below 1e9 (456, 14,600)."""
    if x is None:
        return "n/a"
    return f"{float(f'{x:.3g}'):,.0f}" if 1e3 <= abs(x) < 1e9 else f"{x:.3g}"


def pct(x, d=2) -> str:
    return "n/a" if x is None else f"{100 * x:.{d}f} %"


def pval(p) -> str:
    return "n/a" if p is None else f"{p:.2g}"


def _get(d, path):
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _first(d, paths):
    for p in paths:
        v = _get(d, p)
        if v is not None:
            return v
    return None


def _count(v):
    if isinstance(v, list):
        return len(v)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# ----------------------------------------------------------------------------- the block
def figures(out: Path) -> dict:
    """Everything the block quotes, read from a run's OUT directory (a report of schema 1.x
    read as 2.0: contracts.load_report migrates it)."""
    from logitdiff.contracts import load_report

    s = json.loads((out / "summary.json").read_text())
    reports = {}
    for c in s["candidates"]:
        rdir = Path(c["report"])
        if not rdir.is_absolute() and not rdir.exists():
            rdir = out / "reports" / c["name"]
        if not (rdir / "report.json").exists():
            rdir = out / "reports" / c["name"]
        reports[c["name"]] = (rdir, load_report(rdir))
    return {"summary": s, "reports": reports}


def _flips_frames(reports):
    """flips.parquet of each report, when present (pandas is a dependency of logitdiff)."""
    import pandas as pd

    frames = {}
    for name, (rdir, _) in reports.items():
        p = rdir / "flips.parquet"
        if p.exists():
            frames[name] = pd.read_parquet(p)
    return frames


def render(fig: dict, timing: dict | None, mach: dict) -> str:
    from logitdiff.contracts import Outcome
    from logitdiff.report.metric_registry import header  # the tables' one name per column

    s, reports = fig["summary"], fig["reports"]
    cands = s["candidates"]
    r0 = next(iter(reports.values()))[1]
    ident = _get(r0, "candidate.identity") or {}
    ref_ident = _get(r0, "reference.identity") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (("llama-cpp-python", ident.get("llama_cpp_python")), ("torch", ref_ident.get("torch")),
                                                  ("transformers", ref_ident.get("transformers"))) if v)
    cpu = f"{mach['cpu']} ({mach['isa']})" if mach.get("isa") else mach["cpu"]
    where = f"{cpu}, {mach['cores']} cores" + (f", {mach['memory_gib']} GiB" if mach.get("memory_gib") else "")
    lines = []
    if timing:
        lines.append(
            f"Measured by `scripts/readme_figures.py` on {where} ({versions}): `logitdiff run --out DIR` into a fresh "
            f"directory (GGUF ladder cached) took {timing['wall_s']:.0f} s wall (`summary.json` seconds: {s.get('seconds')}); "
            f"load average (1/5/15 min) {timing['load_before']} before and {timing['load_after']} after, so "
            + ("other work shared the machine." if _busy(timing, mach) else "the machine was otherwise quiet.")
        )
    else:
        lines.append(f"Figures by `scripts/readme_figures.py` from an existing run on {where} ({versions}); "
                     f"`summary.json` seconds: {s.get('seconds')} (not re-timed).")
    lines += ["", f"| candidate | {header('kl_mean')} (nats) | 95 % CI | {header('kl_p99')} | "
              f"{header('top1_disagreement')} | {header('x_cross_engine_floor')} |", "|---|---:|---|---:|---:|---:|"]
    for c in cands:
        ci = c.get("kl_mean_ci95") or [None, None]
        lines.append(f"| `{c['candidate']}` | {e2(c['kl_mean'])} | [{e2(ci[0])}, {e2(ci[1])}] | {e2(c.get('kl_p99'))} | "
                     f"{pct(c.get('top1_disagreement'))} | {g3(c.get('x_cross_engine_floor'))} |")

    has_flips = any("flip_outcomes" in c for c in cands)
    has_corr = any(c.get("accuracy_cand") is not None for c in cands)
    frames = _flips_frames(reports) if has_flips else {}
    if has_flips or has_corr:
        sel = sorted({str(_get(r, "flips.selection")) for _, r in reports.values() if _get(r, "flips.selection")})
        mb = sorted({_get(r, "flips.settings.max_branches") for _, r in reports.values() if _get(r, "flips.settings.max_branches") is not None})
        n_lab = sorted({_get(r, "correctness.n_labelled") for _, r in reports.values() if _get(r, "correctness.n_labelled") is not None})
        said = []
        if mb:
            said.append(f"{mb[-1]} branches at most per candidate")
        said.append("how each candidate's flips were selected is `flips.selection` in its report.json"
                    + (f", e.g. \"{sel[-1]}\"" if sel else ""))
        if n_lab:
            said.append(f"correctness on the {n_lab[-1]} labelled items")
        said.append("ties are positions where the reference's own top two are tied, which the engines break differently: "
                    "counted apart, not branched")
        lines += ["", f"and what the drift does ({'; '.join(said)}):", ""]
        # the columns schema 1.2 adds, under the page's names and paths (report.html.OPTIONAL_COLUMNS)
        from logitdiff.report.html import OPTIONAL_COLUMNS

        opt = [(h, paths) for _, h, _, paths, _ in OPTIONAL_COLUMNS
               if any(_count(_first(r, paths)) is not None for _, r in reports.values())]
        # the rule-decided classes (a judge's benign / meaning changed only where a judge ran)
        judged = any((c.get("flip_outcomes") or {}).get(o) is not None for c in cands for o in Outcome.JUDGED)
        head = (f"| candidate | {header('flip_branches')} | recovered | diverged | answer same / changed | tool call malformed / changed | "
                + ("benign / meaning changed (judge) | " if judged else "")
                + f"{header('flip_ties')} | " + "".join(f"{h} | " for h, _ in opt)
                + f"{header('accuracy')} | {header('right_to_wrong')} | {header('mcnemar_p')} | {header('tool_call_valid_cand')} |")
        lines += [head, "|---|" + "---:|" * (6 + judged + len(opt)) + "---|---:|---:|---:|"]
        for c in cands:
            o = c.get("flip_outcomes") or {}
            rep = reports[c["name"]][1]
            acc = "n/a" if c.get("accuracy_cand") is None else f"{pct(c['accuracy_ref'], 1)} → {pct(c['accuracy_cand'], 1)}"
            lines.append(
                f"| `{c['candidate']}` | {c.get('flip_branches', 'n/a')} | {o.get(Outcome.RECOVERED, 'n/a')} | {o.get(Outcome.DIVERGED, 'n/a')} | "
                f"{o.get(Outcome.ANSWER_SAME, 'n/a')} / {o.get(Outcome.ANSWER_CHANGED, 'n/a')} | "
                f"{o.get(Outcome.TOOL_CALL_MALFORMED, 'n/a')} / {o.get(Outcome.TOOL_CALL_CHANGED, 'n/a')} | "
                + (f"{o.get(Outcome.BENIGN, 'n/a')} / {o.get(Outcome.MEANING_CHANGED, 'n/a')} | " if judged else "")
                + f"{c.get('flip_ties', 'n/a')} | " + "".join(f"{_count(_first(rep, p)) if _count(_first(rep, p)) is not None else 'n/a'} | " for _, p in opt)
                + f"{acc} | {c.get('right_to_wrong', 'n/a')} | {pval(c.get('mcnemar_p'))} | "
                + ("n/a" if c.get("tool_call_valid_cand") is None else f"{100 * c['tool_call_valid_cand']:.0f} %") + " |"
            )
        lines += ["", *_flip_sentences(cands, reports, frames)]
    lines += ["", _floor_paragraph(s, cands, mach, has_corr)]
    return "\n".join(lines)


def _busy(timing, mach) -> bool:
    try:
        return max(float(x) for x in (timing["load_before"].split("/")[0], timing["load_after"].split("/")[0])) > 0.5 * (mach["cores"] or 1)
    except ValueError:
        return True


def _flip_sentences(cands, reports, frames) -> list[str]:
    from logitdiff.contracts import Outcome

    out = []
    n_rec = sum((c.get("flip_outcomes") or {}).get(Outcome.RECOVERED, 0) for c in cands)
    dissimilar = sum(int(_get(r, "flips.recovered_ending_dissimilar") or 0) for _, r in reports.values())
    text = []
    if n_rec:
        alike = (f"every recovered branch of this run ({n_rec}) ends" if not dissimilar
                 else f"{n_rec - dissimilar} of the {n_rec} recovered branches of this run end")
        text.append(alike + " like the reference (last thirds, difflib ratio ≥ 0.5)")
    margins = []
    zero_ties, n_ties_listed = 0, 0
    for name, df in frames.items():
        if "margin_ref" in df and len(df):
            branched = df[~df["tie"]] if "tie" in df else df
            margins += [float(m) for m in branched["margin_ref"] if m is not None and math.isfinite(m)]
    for _, r in reports.values():
        for t in _get(r, "flips.ties.list") or []:
            if "margin_ref" in t:
                n_ties_listed += 1
                zero_ties += t["margin_ref"] == 0
    if margins:
        text.append(f"the smallest reference margin at a branched flip is {min(margins):.1e}")
    n_ties = sum(int(c.get("flip_ties") or 0) for c in cands)
    if n_ties:
        if n_ties_listed == n_ties and zero_ties == n_ties:
            tie = f"all {n_ties} ties (counted apart, not branched) have a reference margin of exactly 0"
        elif n_ties_listed:
            tie = f"{n_ties} ties were counted apart; {zero_ties} of the {n_ties_listed} the reports list have a reference margin of exactly 0"
        else:
            tie = f"{n_ties} ties were counted apart"
        text.append(tie)
    if text:
        out.append(text[0][0].upper() + "; ".join(text)[1:] + ".")
    return out


def _floor_paragraph(s, cands, mach, has_corr) -> str:
    nf = s.get("noise_floor") or {}
    xf = s.get("cross_engine_floor") or {}
    by = {c["name"]: c for c in cands}
    parts = [f"({s['items']}-item workload, {s['positions']:,} teacher-forced positions."]
    if nf:
        rerun = nf.get("rerun") or "a rerun"
        how = ("The plain reference rerun is bit-identical, so `run` takes the noise floor from a rerun with other batch mates"
               if "bit-identical" in rerun else f"The noise floor is the reference against its {rerun}")
        flips = nf.get("top1_flips") or 0
        parts.append(f"{how}: mean KL {e2(nf.get('kl_nats_mean'))} nats and {flips or 'no'} top-1 flip{'' if flips == 1 else 's'} "
                     f"on {mach['cpu']} ({mach['isa'] + ', ' if mach.get('isa') else ''}{mach['cores']} cores).")
        floor_c = by.get(next((c["name"] for c in cands if c["candidate"] == xf.get("candidate")), ""), None)
        worst = max(cands, key=lambda c: c.get("kl_mean") or 0)
        if floor_c and floor_c.get("x_noise_floor"):
            parts.append(f"That puts the cross-engine floor `{floor_c['candidate']}` at {g3(floor_c['x_noise_floor'])}× and "
                         f"`{worst['candidate']}` at {g3(worst.get('x_noise_floor'))}× the noise floor (`summary.md`'s "
                         "× noise floor column)" + (": the reference's own rounding noise is far below any engine or quant here, "
                                                     "and the cross-engine floor is the one to read against."
                                                     if floor_c["x_noise_floor"] >= 10 else
                                                     ": the engine change is within an order of magnitude of the reference's own noise."))
    else:
        parts.append("No noise floor was measured (`--no-noise-floor`).")
    if has_corr:
        sig = [c for c in cands if c.get("mcnemar_p") is not None and c["mcnemar_p"] < SIGNIFICANCE]
        most = max(cands, key=lambda c: c.get("right_to_wrong") or 0)
        if not sig:
            parts.append(f"None of these accuracy changes is significant at {SIGNIFICANCE:g} (largest: `{most['candidate']}`, "
                         f"{most.get('right_to_wrong', 0)} right→wrong, {most.get('wrong_to_right', 0)} wrong→right, McNemar "
                         f"p = {pval(most.get('mcnemar_p'))}), so the flips table shows damage that accuracy alone does not yet resolve.")
        else:
            parts.append("Significant accuracy changes (McNemar p < 0.05): "
                         + ", ".join(f"`{c['candidate']}` p = {pval(c['mcnemar_p'])}" for c in sig) + ".")
    parts.append("Yours is in `logitdiff-out/summary.md` and `logitdiff-out/report.html`.)")
    return " ".join(parts)


# ----------------------------------------------------------------------------- README
def wrap(block: str, width: int = 92) -> str:
    """README's prose wrapped like the rest of README; table rows and blank lines as they are."""
    import textwrap

    out = []
    for line in block.split("\n"):
        out.append(line if not line or line.startswith("|") else textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


def sections(region: str, where: str = "README") -> dict[str, str]:
    """README's figures region -> {class key: its section's text}. A region with no class
    marker at all (a README from before the sections) gives {} (its text is replaced); text
    before the first marker, a key twice, or a marker this pattern does not read is refused
    (exit with the reason), so a rewrite never drops a section it could not parse."""
    parts = CLASS_MARK.split(region)
    keys = parts[1::2]
    if region.count("readme_figures:class") != len(keys):
        sys.exit(f"readme_figures: {where}: a `readme_figures:class` marker that is not "
                 f"`<!-- readme_figures:class KEY -->` on a line of its own (KEY: a-z, 0-9, -)")
    if keys and parts[0].strip():
        sys.exit(f"readme_figures: {where}: text before the first `readme_figures:class` marker")
    if len(set(keys)) != len(keys):
        sys.exit(f"readme_figures: {where}: a machine class twice: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts) - 1, 2)}


def comparable(block: str) -> str:
    """A section as --check compares it: whitespace collapsed; the run's wall time and load,
    the CPU's model name and the memory left out (another machine of the same class: same
    vendor, SIMD level and cores, gives the same figures); the class words, the cores and
    the library versions kept."""
    text = TIMING.sub("took (the run's own time and load).", " ".join(block.split()))
    text = MACHINE.sub(r"on (a CPU) (\1), \2 cores (", text)
    return FLOOR_MACHINE.sub(r"on (a CPU) (\1, \2 cores).", text)


def _paragraphs(section: str) -> list[str]:
    return [p for p in re.split(r"\n[ \t]*\n", section.strip("\n")) if p.strip()]


FLIPS_TABLE = "| candidate | branches |"


def flips_header(section: str) -> str | None:
    """The header row of the section's flips table (whitespace collapsed), None without one."""
    for p in _paragraphs(section):
        if p.startswith(FLIPS_TABLE):
            return " ".join(p.splitlines()[0].split())
    return None


def pinned(section: str, skip_flips: bool = False) -> list[str]:
    """The lines --check compares of a section: from the header sentence only the machine
    class words and the cores; every table row (whitespace collapsed) and every other
    paragraph (:func:`comparable`, wrapped again so a difference shows as a line).
    ``skip_flips``: without the flips table, the paragraph introducing it and the one after
    it (the branches' sentences) -- a section written with other flip classes."""
    import textwrap

    paras = _paragraphs(section)
    at = next((i for i, p in enumerate(paras) if p.startswith(FLIPS_TABLE)), None)
    if skip_flips and at is not None:
        paras = paras[:at - 1] + paras[at + 2:]
    lines = []
    if paras and HEADER.match(paras[0]):
        m = MACHINE.search(" ".join(paras[0].split()))
        lines += [f"machine: ({m.group(1)}), {m.group(2)} cores" if m else "machine: (not read from the header)", ""]
        paras = paras[1:]
    for p in paras:
        if p.startswith("|"):
            lines += [" ".join(row.split()) for row in p.splitlines()]
        else:
            lines += textwrap.wrap(comparable(p), 92, break_long_words=False, break_on_hyphens=False)
        lines.append("")
    return lines


def versions(section: str) -> dict[str, str]:
    """The library versions the section's header sentence names (not compared: a warning)."""
    paras = _paragraphs(section)
    return dict(VERSION.findall(" ".join(paras[0].split()))) if paras and HEADER.match(paras[0]) else {}


def check_section(readme: Path, have: str, block: str, key: str) -> int:
    """--check of this machine class's section: 0 when the pinned lines match (version drift
    only warned about), else 1 with the differing lines as a unified diff."""
    import difflib

    said, run = versions(have), versions(block)
    drift = [f"{k} {said.get(k, '(none)')} in README, {run.get(k, '(none)')} in this run"
             for k in sorted(set(said) | set(run)) if said.get(k) != run.get(k)]
    if drift:
        print(f"{readme}: warning: version drift (not compared): {'; '.join(drift)}", file=sys.stderr)
    # A section written by a logitdiff with other flip classes (report schema before 2.1: benign /
    # meaning changed by the old classifier) cannot match any run of this one: a version drift of
    # logitdiff itself, said as such; its drift figures are still compared.
    classes_drift = flips_header(have) != flips_header(block)
    if classes_drift:
        print(f"{readme}: warning: flip classes drift (not compared): the section's flips table has columns "
              f"{flips_header(have)!r}, this run's {flips_header(block)!r} (written by a logitdiff with other flip "
              "classes); the drift figures and the rest are compared; rewrite the section on this class", file=sys.stderr)
    a, b = pinned(have, classes_drift), pinned(block, classes_drift)
    if a != b:
        print(f"{readme}: the figures for this machine class ({key}) differ from this run's (compared: the machine "
              "class and cores, the tables and the figures; not the header's versions, wall time, load, CPU model):",
              file=sys.stderr)
        for line in difflib.unified_diff(a, b, fromfile=f"README ({key})", tofile="this run", lineterm="", n=1):
            print(line, file=sys.stderr)
        return 1
    return 0


def rewrite(readme: Path, block: str, key: str, check: bool) -> int:
    text = readme.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        sys.exit(f"readme_figures: {readme}: expected one {BEGIN} and one {END} after it")
    head, rest = text.split(BEGIN, 1)
    region, tail = rest.split(END, 1)
    have = sections(region, str(readme))
    if check:
        if key not in have:
            print(f"{readme}: no figures for this machine class ({key}; it has: {', '.join(sorted(have)) or 'none'}): "
                  f"run scripts/readme_figures.py to add them", file=sys.stderr)
            return 1
        if check_section(readme, have[key], block, key):
            return 1
        rows = [ln for ln in pinned(have[key]) if ln.startswith("| `")]
        print(f"{readme}: the figures for this machine class ({key}) match this run's (compared: the machine class and "
              f"cores, {len(rows)} table rows and every figure of the paragraphs; not the header's versions, wall time, "
              f"load, CPU model; other classes, not compared: {', '.join(sorted(set(have) - {key})) or 'none'})", file=sys.stderr)
        return 0
    have[key] = block
    body = "\n\n".join(f"<!-- readme_figures:class {k} -->\n{have[k]}" for k in sorted(have))
    new = f"{head}{BEGIN}\n{body}\n{END}{tail}"
    if new != text:
        from logitdiff.store.files import atomic_write_bytes

        atomic_write_bytes(readme, new.encode("utf-8"))
    print(f"{readme}: figures for {key} {'rewritten' if new != text else 'unchanged'}", file=sys.stderr)
    return 0


SUMMARY_BEGIN, SUMMARY_END = "<!-- readme_figures:summary:begin -->", "<!-- readme_figures:summary:end -->"


def first_table(block: str) -> str:
    """The section's first table (the candidates' KL): what README's summary holds."""
    return next((p for p in _paragraphs(block) if p.startswith("|")), "")


def summary(path: Path, block: str, key: str, check: bool) -> int:
    """README's summary table: rewritten (or --check compared row by row) when it is of this
    machine's class; another class's is left alone and said so; a file without the summary
    markers, or a summary that is not one class marker and one table, is refused."""
    text = path.read_text(encoding="utf-8")
    if text.count(SUMMARY_BEGIN) != 1 or text.count(SUMMARY_END) != 1 or text.index(SUMMARY_BEGIN) > text.index(SUMMARY_END):
        sys.exit(f"readme_figures: {path}: expected one {SUMMARY_BEGIN} and one {SUMMARY_END} after it")
    head, rest = text.split(SUMMARY_BEGIN, 1)
    region, tail = rest.split(SUMMARY_END, 1)
    have = sections(region, str(path))
    if len(have) != 1:
        sys.exit(f"readme_figures: {path}: the summary holds {len(have)} machine classes, expected one")
    (said_key, said), = have.items()
    if said_key != key:
        print(f"{path}: its table is of machine class {said_key}, not this one ({key}): not "
              f"{'compared' if check else 'rewritten'}", file=sys.stderr)
        return 0
    table = first_table(block)
    if check:
        import difflib

        a = [" ".join(row.split()) for row in said.strip("\n").splitlines()]
        b = [" ".join(row.split()) for row in table.splitlines()]
        if a != b:
            print(f"{path}: its table ({key}) differs from this run's:", file=sys.stderr)
            for line in difflib.unified_diff(a, b, fromfile=f"{path.name} ({key})", tofile="this run", lineterm="", n=1):
                print(line, file=sys.stderr)
            return 1
        print(f"{path}: its table ({key}) matches this run's ({len(a) - 2} rows compared)", file=sys.stderr)
        return 0
    new = f"{head}{SUMMARY_BEGIN}\n<!-- readme_figures:class {key} -->\n{table}\n{SUMMARY_END}{tail}"
    if new != text:
        from logitdiff.store.files import atomic_write_bytes

        atomic_write_bytes(path, new.encode("utf-8"))
    print(f"{path}: table for {key} {'rewritten' if new != text else 'unchanged'}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", metavar="OUT", help="an existing `logitdiff run` OUT directory (no run)")
    ap.add_argument("--out", metavar="DIR", help="where the fresh run goes (must not exist; default: a temporary directory, removed)")
    ap.add_argument("--readme", metavar="FILE", help="the file of every class's full section, rewritten between the markers "
                    f"(default: {ROOT / 'docs' / 'figures.md'}, with README.md's table as --summary)")
    ap.add_argument("--summary", metavar="FILE", help="the file of one class's table between the summary markers "
                    f"(default: {ROOT / 'README.md'} when --readme is not given; else none)")
    ap.add_argument("--print", action="store_true", help="print the block instead of rewriting README")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when README's section for this machine class differs from this run's (or is missing)")
    args = ap.parse_args(argv)
    mach = machine()
    timing = None
    tmp = None
    if args.src:
        out = Path(args.src)
        if not (out / "summary.json").is_file():
            sys.exit(f"readme_figures: {out}: no summary.json (not a `logitdiff run` OUT directory)")
        saved = out / "readme_figures.timing.json"
        if saved.is_file():
            timing = json.loads(saved.read_text())
            mach = timing.pop("machine", mach)
            if "class" not in mach:  # saved before machine classes: the run was made here, as before
                mach["class"], mach["isa"] = machine_class()
    else:
        if args.out:
            out = Path(args.out).resolve()
            if out.exists():
                sys.exit(f"readme_figures: --out {out} exists; the figures are those of a fresh run")
        else:
            tmp = Path(tempfile.mkdtemp(prefix="readme-figures-"))
            out = tmp / "out"
        timing = run_logitdiff(out)
        # kept beside the run, so a later --from OUT quotes the same timing and load
        (out / "readme_figures.timing.json").write_text(json.dumps({**timing, "machine": mach}) + "\n")
    try:
        block = wrap(render(figures(out), timing, mach))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.print:
        print(block)
        return 0
    page = Path(args.readme) if args.readme else ROOT / "docs" / "figures.md"
    table = Path(args.summary) if args.summary else (None if args.readme else ROOT / "README.md")
    status = rewrite(page, block, mach["class"], args.check)
    if table is not None:
        status = max(status, summary(table, block, mach["class"], args.check))
    return status


if __name__ == "__main__":
    sys.exit(main())
