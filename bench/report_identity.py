"""Are two `logitdiff run` outputs byte-identical? (a refactoring must not change the numbers)

    python bench/report_identity.py BEFORE AFTER [--allow-added schema_version]

Compares summary.json and every reports/*/report.json of two OUT directories as raw bytes,
after replacing only what must differ between two runs: the OUT directory itself (paths),
``created`` (a date), ``seconds`` (a duration) and ``tool.version``. Fields named by
``--allow-added`` may be present in AFTER only (one line each, e.g. a new ``schema_version``);
anything else that differs is printed with its first differing line, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_VOLATILE = (
    (re.compile(r'^( *"created": )"[^"]*"', re.M), r'\1"<date>"'),
    (re.compile(r'^( *"seconds": )[-+0-9.eE]+', re.M), r"\1<seconds>"),
    (re.compile(r'("tool": \{\n *"name": "logitdiff",\n *"version": )"[^"]*"'), r'\1"<version>"'),
)


def normalise(text: str, out_dir: Path, allow_added: list[str], added: list[str]) -> str:
    for root in {str(out_dir), str(out_dir.resolve())}:
        text = text.replace(root, "<OUT>")
    for pat, rep in _VOLATILE:
        text = pat.sub(rep, text)
    for name in allow_added:
        line = re.compile(rf'^ *"{re.escape(name)}": [^\n]*\n', re.M)
        if line.search(text):
            added.append(name)
            text = line.sub("", text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--allow-added", action="append", default=[], metavar="FIELD",
                    help="a field that only AFTER may have (repeatable)")
    args = ap.parse_args(argv)
    names = ["summary.json"] + sorted(str(p.relative_to(args.before)) for p in args.before.glob("reports/*/report.json"))
    after_names = ["summary.json"] + sorted(str(p.relative_to(args.after)) for p in args.after.glob("reports/*/report.json"))
    bad = 0
    if names != after_names:
        print(f"different files: before {names}, after {after_names}")
        bad += 1
    for name in names:
        a, b = args.before / name, args.after / name
        if not b.is_file():
            continue
        added_a: list[str] = []
        added_b: list[str] = []
        ta = normalise(a.read_text(), args.before, args.allow_added, added_a)
        tb = normalise(b.read_text(), args.after, args.allow_added, added_b)
        added = sorted(set(added_b) - set(added_a))
        if ta == tb:
            print(f"identical  {name} ({len(b.read_bytes()):,} bytes{'; added in AFTER: ' + ', '.join(added) if added else ''})")
            continue
        bad += 1
        la, lb = ta.splitlines(), tb.splitlines()
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        print(f"DIFFERENT  {name}: first at line {i + 1}\n  before: {la[i] if i < len(la) else '<end>'}\n"
              f"  after:  {lb[i] if i < len(lb) else '<end>'}")
    print("all identical" if not bad else f"{bad} difference(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
