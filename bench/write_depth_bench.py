"""O_DIRECT write patterns on one disk, interleaved (issue 24): one capture's 512 MiB as 8 files of 64 MiB,
each fsynced, every buffer first filled by a copy (as the full store's writer does): one 16/32/64 MiB write at a
time, or two 8 or 16 MiB buffers with one write in flight while the other is filled (outputs.DirectFile's
halves). Buffers from
``outputs.direct_stage`` (huge pages where THP allows).

    PYTHONPATH=src python bench/write_depth_bench.py ROUNDS [DIR]   (files in DIR, default /tmp/cap_disk)
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from logitdiff.store.files import direct_stage

M = 1 << 20
FILE = 64 * M
FILES = 8
SRC = np.random.default_rng(0).integers(0, 255, 64 * M, dtype=np.uint8)  # what each buffer is copied from
POOL = ThreadPoolExecutor(1)


def serial(size: int):
    """Fill one buffer, write it, again: the disk idles while the buffer is filled."""
    st = np.frombuffer(direct_stage(size), np.uint8)

    def write_file(fd: int) -> None:
        for _ in range(0, FILE, size):
            st[:] = SRC[:size]
            os.write(fd, st)

    return write_file


def piped(size: int):
    """Two buffers: one filled while the other's write is in flight."""
    sts = [np.frombuffer(direct_stage(size), np.uint8) for _ in range(2)]

    def write_file(fd: int) -> None:
        fut, k = None, 0
        for off in range(0, FILE, size):
            st = sts[k]
            st[:] = SRC[:size]
            if fut is not None:
                fut.result()
            fut = POOL.submit(os.pwrite, fd, st, off)
            k ^= 1
        if fut is not None:
            fut.result()

    return write_file


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    where = sys.argv[2] if len(sys.argv) > 2 else "/tmp/cap_disk"
    os.makedirs(where, exist_ok=True)
    pats = {"serial 16 MiB": serial(16 * M), "2 x 8 MiB, one filled while one is written": piped(8 * M),
            "2 x 16 MiB, one filled while one is written": piped(16 * M), "serial 32 MiB": serial(32 * M),
            "serial 64 MiB": serial(64 * M)}
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in pats}
    for r in range(rounds):
        for name in (list(pats) if r % 2 else list(pats)[::-1]):  # order alternates by round
            os.sync()
            ru0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for k in range(FILES):
                fd = os.open(f"{where}/{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
                pats[name](fd)
                os.fsync(fd)
                os.close(fd)
            w, ru1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            for k in range(FILES):
                os.unlink(f"{where}/{k}.bin")
            cpu = ru1.ru_stime - ru0.ru_stime + ru1.ru_utime - ru0.ru_utime
            res[name].append((FILES * FILE / w / 1e6, cpu))
        print(r, {k: round(v[-1][0]) for k, v in res.items()}, "load", os.getloadavg()[0], flush=True)
    print("| pattern | MB/s (median) | process CPU s | range MB/s |\n|---|---:|---:|---:|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(x[0] for x in v):,.0f} | {statistics.median(x[1] for x in v):.3f} | "
              f"{min(x[0] for x in v):,.0f}-{max(x[0] for x in v):,.0f} |")


if __name__ == "__main__":
    main()
