"""Instructions of one warm compare_runs (all threads), counted by callgrind: a measure that
a loaded machine does not move (wall times on the shared 2-core VM vary 2x with the load).

    valgrind --tool=callgrind --callgrind-out-file=OUT.%p \\
        python bench/callgrind_compare.py REF_RUN CAND_RUN [--threads 2]
    python bench/callgrind_compare.py --report OUT.PID.1 [--top 25]

The first form runs one compare to warm imports and caches, then zeroes callgrind's counts,
runs the compare again and dumps them (OUT.PID.1: that compare alone, every thread of the
process; its "totals:" line is the count). The counts are switched with callgrind's client
requests, compiled here once into a tiny library (needs gcc and valgrind/callgrind.h); run
outside valgrind, the requests do nothing. The second form lists the functions by their
own (exclusive) instructions. Callgrind does not run AVX-512 code: the kernel's AVX2 paths
are what it counts (valgrind's CPUID hides AVX-512, so "auto" takes them).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CTL = "#include <valgrind/callgrind.h>\nvoid cg_zero(void) { CALLGRIND_ZERO_STATS; }\nvoid cg_dump(void) { CALLGRIND_DUMP_STATS; }\n"


def _ctl():
    d = Path(tempfile.mkdtemp(prefix="cgctl"))
    (d / "cgctl.c").write_text(CTL)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(d / "libcgctl.so"), str(d / "cgctl.c")], check=True)
    return ctypes.CDLL(str(d / "libcgctl.so"))


def report(path: Path, top: int) -> None:
    """Exclusive instructions per function of a callgrind dump (names may be compressed)."""
    names: dict[str, str] = {}
    own: collections.Counter[str] = collections.Counter()
    cur, skip = None, False

    def name(s: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?", s)
        if not m:
            return s
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), s)

    for line in path.read_text().splitlines():
        if line.startswith("fn="):
            cur = name(line[3:])
        elif line.startswith("cfn="):
            name(line[4:])
        elif line.startswith("calls="):
            skip = True  # the next cost line is the call's inclusive cost
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            if skip:
                skip = False
                continue
            parts = line.split()
            if cur and len(parts) > 1:
                own[cur] += int(parts[1])
    total = sum(own.values())
    print(f"{path}: {total:,} instructions")
    for f, c in own.most_common(top):
        print(f"{c:>15,} {100 * c / total:5.1f} %  {f[:120]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="REF_RUN CAND_RUN")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--report", type=Path, default=None, help="list a dump's functions instead")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if a.report:
        report(a.report, a.top)
        return 0
    if len(a.runs) != 2:
        ap.error("give REF_RUN CAND_RUN (or --report DUMP)")
    from logitdiff.compare import compare_runs
    from logitdiff.store import RunReader

    ctl = _ctl()
    ref, cand = a.runs
    compare_runs(RunReader(ref), RunReader(cand), threads=a.threads)  # warm: imports, caches
    ctl.cg_zero()
    compare_runs(RunReader(ref), RunReader(cand), threads=a.threads)
    ctl.cg_dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
