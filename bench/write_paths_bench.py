"""The ways a RunWriter can put full rows on disk, apart from any model: 8 chunk files of 2
blocks x 67 rows x V = 248,320 bf16 (537 MB), interleaved rounds, each file made durable
(fsync) with a lag of 4 files as RunWriter's syncer does:

* ``buffered``: write() into the page cache, sync_file_range(WRITE) after each block (main
  before issue 24's O_DIRECT round);
* ``dontneed``: the same, then POSIX_FADV_DONTNEED after each fsync (drop the written pages);
* ``direct``: outputs.atomic_file_direct, O_DIRECT through a 16 MiB page-aligned staging
  buffer, always tried (the full store's writer uses it only where outputs.direct_io_pays:
  on tmpfs, which accepts O_DIRECT since Linux 6.6, this row shows the copy that avoids).

Reported per pattern: wall, this process's CPU (user, system) and the whole machine's busy
CPU (from /proc/stat: the kernel's writeback threads included, and anything else running).

    python bench/write_paths_bench.py DIR [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

ROW = 248_320 * 2
BLOCK_ROWS = 67
CHUNKS = 8
LAG = 4


def _busy() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait, in clock ticks


def _buffered(path: Path, blocks) -> None:
    from logitdiff.store.files import start_writeback

    with open(path, "wb") as f:
        f.write(bytes(128))  # a .npy header's size
        for b in blocks:
            f.write(b.data)
            f.flush()
            start_writeback(f.fileno())


def _direct(path: Path, blocks, stage) -> None:
    from logitdiff.store.files import atomic_file_direct

    with atomic_file_direct(path, stage) as f:
        f.write(bytes(4096))
        for b in blocks:
            f.write(b.data)


def _sync(path: Path, dontneed: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if dontneed:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(where: Path, pattern: str, blocks, stage) -> dict:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    os.sync()
    b0, c0, t0 = _busy(), os.times(), time.perf_counter()
    lagging: list[Path] = []
    for k in range(CHUNKS):
        p = where / f"{k:06d}.logits.npy"
        (_direct(p, blocks, stage) if pattern == "direct" else _buffered(p, blocks))
        lagging.append(p)
        if len(lagging) > LAG:
            _sync(lagging.pop(0), pattern == "dontneed")
    for p in lagging:
        _sync(p, pattern == "dontneed")
    wall, c1 = time.perf_counter() - t0, os.times()
    hz = os.sysconf("SC_CLK_TCK")
    return {"pattern": pattern, "wall": round(wall, 3), "user": round(c1.user - c0.user, 3),
            "sys": round(c1.system - c0.system, 3), "machine_busy": round((_busy() - b0) / hz, 3),
            "load1": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--patterns", default="buffered,dontneed,direct")
    args = ap.parse_args()
    from logitdiff.store.files import direct_io_pays, direct_stage

    where = Path(args.dir) / "write-paths"
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 1 << 16, (BLOCK_ROWS, ROW // 2), dtype=np.uint16) for _ in range(2)]
    stage = direct_stage()
    pats = args.patterns.split(",")
    res: dict[str, list[dict]] = {p: [] for p in pats}
    for r in range(args.rounds):
        for p in pats[r % len(pats):] + pats[: r % len(pats)]:
            x = run(where, p, blocks, stage)
            res[p].append(x)
            print(json.dumps(x), flush=True)
    shutil.rmtree(where, ignore_errors=True)
    med = statistics.median
    mb = CHUNKS * (4096 + 2 * BLOCK_ROWS * ROW) / 1e6
    print(f"\n{mb:,.0f} MB in {CHUNKS} files under {args.dir} (O_DIRECT pays there: {direct_io_pays(args.dir)}), "
          f"median of {args.rounds} interleaved rounds")
    print("| pattern | wall s | MB/s | process CPU s (user + sys) | of it sys | machine busy CPU s |\n|---|---:|---:|---:|---:|---:|")
    for p in pats:
        xs = res[p]
        print(f"| {p} | {med(x['wall'] for x in xs):.2f} | {mb / med(x['wall'] for x in xs):,.0f} "
              f"| {med(x['user'] + x['sys'] for x in xs):.2f} | {med(x['sys'] for x in xs):.2f} "
              f"| {med(x['machine_busy'] for x in xs):.2f} |")


if __name__ == "__main__":
    main()
