#!/usr/bin/env python
"""The generated tables of the docs and README, from what the package declares once:

* ``sources``      (docs/sources.md): every source option, from logitdiff.sources.options;
* ``metrics``      (docs/compare.md): every metric a report carries, from logitdiff.report.metric_registry;
* ``gates``        (docs/reports.md): the metrics a gate clause may name (metric_registry.GATE_METRICS, what gates accept);
* ``judge_prompt``, ``judges`` (docs/flips.md): the judge's prompt and parse rule, and every judge
  model measured, from logitdiff.flips.judge (JUDGE_PROMPT, PARSE_RULE, MEASURED);
* ``architecture`` (README.md and docs/architecture.md): one row per stage of the package, in
  the order of tests/test_structure.py's STAGES (the import rule the tests hold), each row the
  stage's own docstring.

    .venv/bin/python scripts/docs_tables.py            # rewrite the tables in place
    .venv/bin/python scripts/docs_tables.py --print    # print them, change nothing
    .venv/bin/python scripts/docs_tables.py --check    # exit 1 naming each file whose table differs

Each table sits between ``<!-- generated:NAME:begin -->`` and ``<!-- generated:NAME:end -->``;
a file is replaced atomically (logitdiff.store.files.atomic_write_bytes), and only when a table
in it changed. tests/test_docs.py fails when a table is stale.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from logitdiff.report import metric_registry  # noqa: E402
from logitdiff.sources import options  # noqa: E402
from logitdiff.store.files import atomic_write_bytes  # noqa: E402

PKG = ROOT / "src" / "logitdiff"
STRUCTURE_TEST = ROOT / "tests" / "test_structure.py"


def _cell(text: str) -> str:
    """Docstring prose as one markdown table cell: reST literals and roles as code spans,
    whitespace collapsed, pipes escaped."""
    text = re.sub(r":(?:mod|func|class|meth|attr|data):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def _docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        raise SystemExit(f"docs_tables: {path.relative_to(ROOT)}: no docstring to describe its stage with")
    return doc


def stages() -> list[tuple[str, tuple[str, ...]]]:
    """tests/test_structure.py's STAGES (lowest first), read from its source, not imported."""
    for node in ast.parse(STRUCTURE_TEST.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "STAGES" and node.value:
            return [(name, tuple(mods)) for name, mods in ast.literal_eval(node.value)]
    raise SystemExit(f"docs_tables: {STRUCTURE_TEST.relative_to(ROOT)}: no STAGES list")


def _module_file(module: str) -> Path:
    rel = module.split(".")[1:]
    pkg = PKG.joinpath(*rel, "__init__.py") if rel else PKG / "__init__.py"
    return pkg if pkg.exists() else PKG.joinpath(*rel[:-1], rel[-1] + ".py")


def _stage_row(name: str, modules: tuple[str, ...]) -> str:
    """A package stage: its docstring's first paragraph (``Stage *name*: ...``). A stage of
    top-level modules: the first sentence of each module's docstring."""
    paths = [_module_file(m) for m in modules]
    is_package = len(modules) == 1 and paths[0].name == "__init__.py" and modules[0] != "logitdiff"
    where = ", ".join(f"`{p.relative_to(PKG.parent).as_posix().removesuffix('__init__.py' if is_package else '')}`" for p in paths)
    if is_package:
        first = _docstring(paths[0]).split("\n\n")[0]
        prefix = f"Stage *{name}*:"
        if not first.startswith(prefix):
            raise SystemExit(f"docs_tables: {paths[0].relative_to(ROOT)}: the docstring must open with '{prefix}'")
        what = first[len(prefix):].strip().replace("(this module)", "(its `__init__`)")
        what = what[0].upper() + what[1:]
    else:
        parts = []
        for m, p in zip(modules, paths):
            short = m.removeprefix("logitdiff.") if m != "logitdiff" else "__init__"
            sentence = re.split(r"(?<=\.)\s", " ".join(_docstring(p).split("\n\n")[0].split()), maxsplit=1)[0].rstrip(".")
            sentence = sentence.removeprefix(f"{m}: ")  # the package's own docstring opens with its name
            parts.append(f"`{short}`: {sentence[0].lower() + sentence[1:]}")
        what = "; ".join(parts) + "."
    return f"| {name} | {where} | {_cell(what)} |"


def architecture_table() -> str:
    lines = ["| stage | where | what it owns and what it may import |", "|---|---|---|"]
    lines += [_stage_row(name, mods) for name, mods in stages()]
    return "\n".join(lines) + "\n"


def gates_table() -> str:
    lines = ["| metric | what it is | unit | direction |", "|---|---|---|---|"]
    lines += [f"| `{m.name}` | {_cell(m.meaning)} | {m.unit} | {m.direction} |" for m in metric_registry.GATE_METRICS.values()]
    return "\n".join(lines) + "\n"


def judge_prompt_block() -> str:
    """The judge's fixed prompt and parse rule (logitdiff.flips.judge), quoted as they are."""
    from logitdiff.flips import judge

    return (f"```text\n{judge.JUDGE_PROMPT}\n```\n\nGreedy, at most {judge.JUDGE_MAX_TOKENS} tokens, the judge's own chat "
            f"template; each text cut to {judge.CHARS} characters (the context's end, each continuation's start). "
            f"Parse rule: {judge.PARSE_RULE}.\n")


def judges_table() -> str:
    """Every judge model tried (logitdiff.flips.judge.MEASURED): its agreement with the blind readers."""
    from logitdiff.flips import judge

    def frac(kn) -> str:
        return "—" if kn is None else f"{kn[0]}/{kn[1]}" + (f" ({100 * kn[0] / kn[1]:.0f} %)" if kn[1] else "")

    def num(x, fmt="{:.2f}") -> str:
        return "—" if x is None else fmt.format(x)

    lines = ["| judge | source | set, cases | same | different | unparsed | κ (reader 1) | κ (consensus) | time | command |",
             "|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for m in judge.MEASURED:
        lines.append(f"| {_cell(m['judge'])} | {m['kind']} | {m['set']}, {m['n']} | {frac(m['same'])} | {frac(m['different'])} | "
                     f"{m['unparsed']} | {num(m['kappa'])} | {num(m.get('consensus_kappa'))} | {num(m['seconds'], '{:.0f} s')} | "
                     f"`{_cell(m['command'])}` |")
    return "\n".join(lines) + "\n"


TABLES: dict[str, Callable[[], str]] = {
    "sources": options.markdown_table,
    "metrics": metric_registry.markdown_table,
    "gates": gates_table,
    "architecture": architecture_table,
    "judge_prompt": judge_prompt_block,
    "judges": judges_table,
}
# which files hold which tables (a table may sit in more than one)
FILES: dict[str, tuple[str, ...]] = {
    "docs/sources.md": ("sources",),
    "docs/compare.md": ("metrics",),
    "docs/reports.md": ("gates",),
    "docs/architecture.md": ("architecture",),
    "docs/flips.md": ("judge_prompt", "judges"),
    "README.md": ("architecture",),
}


def replaced(text: str, name: str, table: str, where: str) -> str:
    """``text`` with the block between NAME's markers replaced by ``table``."""
    begin, end = f"<!-- generated:{name}:begin -->", f"<!-- generated:{name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"docs_tables: {where}: expected one {begin} before one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}{end}{tail}"


def regenerated(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """{file: (its text now, its text with every table generated afresh)}, in memory."""
    made = {name: make() for name, make in TABLES.items()}
    out = {}
    for rel, names in FILES.items():
        path = root / rel
        if not path.is_file():
            raise SystemExit(f"docs_tables: {rel}: missing (it holds the generated tables {', '.join(names)})")
        text = new = path.read_text(encoding="utf-8")
        for name in names:
            new = replaced(new, name, made[name], rel)
        out[path] = (text, new)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The files (relative to ``root``) whose generated tables differ from the declarations."""
    return [str(p.relative_to(root)) for p, (old, new) in regenerated(root).items() if old != new]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose README.md and docs/ to read (default: %(default)s)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--print", action="store_true", help="print the tables, change nothing")
    g.add_argument("--check", action="store_true", help="exit 1 when a generated table differs from its declaration")
    args = ap.parse_args(argv)
    if args.print:
        sys.stdout.write("\n".join(f"<!-- {name} -->\n{make()}" for name, make in TABLES.items()))
        return 0
    if args.check:
        bad = stale(args.root)
        for rel in bad:
            print(f"{rel}: a generated table differs from its declaration; run scripts/docs_tables.py", file=sys.stderr)
        return 1 if bad else 0
    for path, (old, new) in regenerated(args.root).items():
        if new != old:
            atomic_write_bytes(path, new.encode("utf-8"))
            print(f"{path.relative_to(args.root)}: tables rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
