"""O_DIRECT write patterns on one disk, interleaved (issue 24): one capture's 512 MiB as 8 files of 64 MiB, each
fsynced, every buffer first filled by a copy (as the full store's writer does): one 16/32/64 MiB write at a time, or two
16 MiB buffers with one write in flight while the other is filled.

    PYTHONPATH=src python bench/write_depth_bench.py ROUNDS   (files in /tmp/cap_disk)
"""
import os, sys, time, resource, statistics
from concurrent.futures import ThreadPoolExecutor
import numpy as np

from logitdiff.outputs import direct_stage
M = 1 << 20
FILE = 64 * M
TOTAL = 8 * FILE
src = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)  # (a source block is 33 MB; a whole buffer copied here)
pool = ThreadPoolExecutor(1)
def serial(size):
    st = np.frombuffer(direct_stage(size), np.uint8)
    def f(fd):
        for o in range(0, FILE, size):
            st[:] = src[: size]; os.write(fd, st)
    return f
def piped(size):
    sts = [np.frombuffer(direct_stage(size), np.uint8) for _ in range(2)]
    def f(fd):
        fut, k = None, 0
        for o in range(0, FILE, size):
            st = sts[k]; st[:] = src[: size]
            if fut: fut.result()
            fut = pool.submit(os.pwrite, fd, st, o); k ^= 1
        fut.result()
    return f
pats = {"serial 16 MiB": serial(16 * M), "2 x 16 MiB in flight": piped(16 * M), "serial 32 MiB": serial(32 * M), "serial 64 MiB": serial(64 * M)}
os.makedirs("/tmp/cap_disk", exist_ok=True)
res = {k: [] for k in pats}
for r in range(int(sys.argv[1])):
    names = list(pats) if r % 2 else list(pats)[::-1]
    for name in names:
        os.sync()
        ru0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
        for k in range(8):
            fd = os.open(f"/tmp/cap_disk/{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
            pats[name](fd); os.fsync(fd); os.close(fd)
        w = time.perf_counter() - t; ru1 = resource.getrusage(resource.RUSAGE_SELF)
        for k in range(8): os.unlink(f"/tmp/cap_disk/{k}.bin")
        res[name].append((TOTAL / w / 1e6, ru1.ru_stime - ru0.ru_stime + ru1.ru_utime - ru0.ru_utime))
    print(r, {k: round(v[-1][0]) for k, v in res.items()}, "load", os.getloadavg()[0], flush=True)
for k, v in res.items():
    print(f"| {k} | {statistics.median(x[0] for x in v):,.0f} MB/s | {statistics.median(x[1] for x in v):.3f} CPU s | "
          f"range {min(x[0] for x in v):,.0f}-{max(x[0] for x in v):,.0f} |")
