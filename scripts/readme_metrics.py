#!/usr/bin/env python
"""README's metric table, generated from the metric registry (logitdiff.metric_registry).

    .venv/bin/python scripts/readme_metrics.py            # rewrite the table in README.md
    .venv/bin/python scripts/readme_metrics.py --print    # print it, leave README alone
    .venv/bin/python scripts/readme_metrics.py --check    # exit 1 when README's table differs

The table sits between ``<!-- readme_metrics:begin -->`` and ``<!-- readme_metrics:end -->``;
README.md is replaced atomically (logitdiff.outputs.atomic_write_bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from logitdiff.metric_registry import markdown_table  # noqa: E402
from logitdiff.outputs import atomic_write_bytes  # noqa: E402

BEGIN, END = "<!-- readme_metrics:begin -->", "<!-- readme_metrics:end -->"


def replaced(readme: str, table: str) -> str:
    """README's text with the block between the markers replaced by ``table``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SystemExit(f"README.md: expected one {BEGIN} before one {END}")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--print", action="store_true", help="print the table, leave README alone")
    g.add_argument("--check", action="store_true", help="exit 1 when README's table differs from the registry's")
    args = ap.parse_args(argv)
    table = markdown_table()
    if args.print:
        sys.stdout.write(table)
        return 0
    text = args.readme.read_text()
    new = replaced(text, table)
    if args.check:
        if new != text:
            print(f"{args.readme}: the metric table differs from logitdiff.metric_registry; run scripts/readme_metrics.py")
            return 1
        return 0
    if new != text:
        atomic_write_bytes(args.readme, new.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
