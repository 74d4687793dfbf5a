#!/usr/bin/env python
"""README's generated tables: the metrics (from logitdiff.report.metric_registry) and the source
options (from logitdiff.sources.options), declared once in the package.

    .venv/bin/python scripts/readme_tables.py            # rewrite the tables in README.md
    .venv/bin/python scripts/readme_tables.py --print    # print them, leave README alone
    .venv/bin/python scripts/readme_tables.py --check    # exit 1 when a README table differs

Each table sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (NAME:
readme_metrics, readme_sources); README.md is replaced atomically
(logitdiff.store.files.atomic_write_bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from logitdiff.report import metric_registry  # noqa: E402
from logitdiff.store.files import atomic_write_bytes  # noqa: E402
from logitdiff.sources import options  # noqa: E402

TABLES = {"readme_metrics": metric_registry.markdown_table, "readme_sources": options.markdown_table}


def replaced(readme: str, name: str, table: str) -> str:
    """README's text with the block between NAME's markers replaced by ``table``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if readme.count(begin) != 1 or readme.count(end) != 1 or readme.index(begin) > readme.index(end):
        raise SystemExit(f"README.md: expected one {begin} before one {end}")
    head, rest = readme.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}{end}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--print", action="store_true", help="print the table, leave README alone")
    g.add_argument("--check", action="store_true", help="exit 1 when a README table differs from its declaration")
    args = ap.parse_args(argv)
    if args.print:
        sys.stdout.write("\n".join(make() for make in TABLES.values()))
        return 0
    text = new = args.readme.read_text()
    for name, make in TABLES.items():
        new = replaced(new, name, make())
    if args.check:
        if new != text:
            print(f"{args.readme}: a generated table differs from its declaration; run scripts/readme_tables.py")
            return 1
        return 0
    if new != text:
        atomic_write_bytes(args.readme, new.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
