"""Where a --store full capture's wall goes beside the bare forward + copy, stage by stage
(issue 24, CPU goal), at V = 248,320 on the model of ``capture_bench.py --wide``.

Interleaved rounds, each an in-process ``capture_candidate`` into a fresh RUN and the bare
forward + copy of the same positions (capture_bench's), timed on one clock:

* capture: setup (call to the first forward), the base model's forward, the head phase (forward
  done to the last block handed to the writer: head, NaN/inf check, hand-off), the tail (last
  block handed to return: the writer's last bytes, fsync, manifest); the writer thread's busy
  time in ``write()`` and in the staging copy, and its CPU;
* bare: the base forward, the head + copy phase;
* for both, the machine's /proc/stat ticks over the step (steal: the hypervisor ran something
  else on a vCPU, e.g. the virtual disk's work; irq+softirq: the guest's interrupt work).

    PYTHONPATH=src python bench/capture_stages.py --wide /tmp/s11/capw [--rounds 5] [--out-dir DIR] [--no-side-files]

``--floor``: instead, the disk's cost to the forward when perfectly overlapped: the bare forward
+ copy alone, against the same while another process writes the same bytes (the rows of one
capture, 1,024 x 2 V) through RunWriter into a RUN on ``--out-dir`` (the full store's path:
O_DIRECT, staging buffer, fsync per chunk, manifest), the writer started just before the forward.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_bench import _bare_forward_copy  # noqa: E402

TICKS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _ticks() -> dict[str, int]:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]
    return dict(zip(TICKS, vals))


def _tick_delta(a: dict, b: dict) -> dict[str, float]:
    hz = os.sysconf("SC_CLK_TCK")
    return {k: (b[k] - a[k]) / hz for k in ("steal", "irq", "softirq", "iowait", "system")}


WRITER = """
import os, sys, time, json
import numpy as np
from logitdiff.store import RunItem, RunWriter
V, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rows = np.random.default_rng(0).integers(0, 0x7F00, (67, V), dtype=np.uint16)  # finite bf16 bits
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
t = time.perf_counter(); c = time.process_time()
w = RunWriter(out, source={"spec": "bench:floor"}, vocab_size=V, tokenizer_hash=None, dtype="bfloat16", overwrite=True)
w.begin_item(RunItem(id="i0", prompt_ids=[1], teacher_ids=[1] * n, positions=list(range(n))))
for a in range(0, n, 67):
    w.add_rows(rows[: min(67, n - a)])
w.end_item(); w.finish()
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c}), flush=True)
"""

# The same bytes with no copy at all: the staging buffer, filled once, written again and again
# with O_DIRECT into 64 MiB files, each fsynced (the disk's part of the writer alone).
RAW = """
import os, sys, time, json
import numpy as np
import logitdiff.store.files as outputs
V, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
stage = outputs.direct_stage()
np.frombuffer(stage, np.uint8)[:] = 1
os.makedirs(out, exist_ok=True)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
t = time.perf_counter(); c = time.process_time()
left, k = n * 2 * V, 0
while left > 0:
    fd = os.open(f"{out}/{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    for _ in range(4):
        if left > 0:
            os.write(fd, stage); left -= len(stage)
    os.fsync(fd); os.close(fd); k += 1
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c}), flush=True)
"""

# --small-pages: direct_stage as it was before huge pages (a shared mapping: 4 KiB pages)
SMALL = "import mmap, logitdiff.store.files as o; o.direct_stage = lambda n=None: mmap.mmap(-1, o.DIRECT_STAGE_BYTES)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wide", required=True, metavar="WORK", help="capture_bench --wide's WORK (model and teacher built there)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--items", type=int, default=2)
    ap.add_argument("--out-dir", help="where RUNs go (default WORK)")
    ap.add_argument("--floor", action="store_true", help="the disk's cost to a concurrent forward (see above)")
    ap.add_argument("--no-side-files", action="store_true", help="captures write no vocab.json/tokens.json (what "
                    "they cost the setup; the RUNs are not complete RUNs)")
    ap.add_argument("--small-pages", action="store_true", help="--floor: the writers' staging buffers on 4 KiB pages "
                    "(outputs.direct_stage before huge pages), to compare")
    args = ap.parse_args()
    import torch  # noqa: F401

    from logitdiff.capture import capture_candidate
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader, rows_per_block

    work = Path(args.wide)
    model = work / f"model-h{args.hidden}-v{args.vocab}"
    ref = RunReader(work / f"ref-h{args.hidden}-v{args.vocab}-{args.items}x{args.tokens}")
    if not (model / "config.json").exists() or not ref.path.exists():
        sys.exit(f"run capture_bench.py --wide {work} first (builds the model and the teacher)")
    pairs = [(it.prompt_ids, it.teacher_ids) for it in ref.items()]
    n_pos = sum(len(t) for _, t in pairs)
    src = open_source(f"hf:{model},batch={args.batch}")
    block = rows_per_block(src.vocab_size)
    outdir = Path(args.out_dir) if args.out_dir else work
    outdir.mkdir(parents=True, exist_ok=True)

    def fresh(name: str) -> Path:
        shutil.rmtree(outdir / name, ignore_errors=True)
        os.sync()
        return outdir / name

    if args.floor:
        return floor(args, src, pairs, block, n_pos, fresh)

    import logitdiff.store.files as outputs
    import logitdiff.store as store

    if args.no_side_files:
        store.RunWriter._write_side_files = lambda self, files: None

    marks: dict[str, float] = {}
    acc: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        acc[key] = acc.get(key, 0.0) + v

    real_fg = src._forward_group

    def forward_group(*a, **k):
        marks.setdefault("fwd0", time.perf_counter())
        out = real_fg(*a, **k)
        marks["fwd1"] = time.perf_counter()
        return out

    src._forward_group = forward_group
    real_add_rows = store.RunWriter.add_rows

    def add_rows(self, *a, **k):
        t = time.perf_counter()
        real_add_rows(self, *a, **k)
        marks["last_handed"] = time.perf_counter()
        add("add_rows", marks["last_handed"] - t)

    real_send = store.RunWriter._send

    def send(self, nbytes, fn, *a):
        t = time.perf_counter()
        out = real_send(self, nbytes, fn, *a)
        add("send_wait", time.perf_counter() - t)
        return out

    real_append = store.RunWriter._append_block

    def append_block(self, *a):
        c = time.thread_time()
        real_append(self, *a)
        add("writer_cpu", time.thread_time() - c)

    real_aligned_write = outputs.DirectFile._write_aligned

    def write_aligned(self, mv):  # every O_DIRECT write: staged buffers and blocks written from the caller's memory
        t, c = time.perf_counter(), time.thread_time()
        real_aligned_write(self, mv)
        add("write_wall", time.perf_counter() - t)
        add("write_cpu", time.thread_time() - c)

    real_write = outputs.DirectFile.write

    def dwrite(self, data):
        t = time.perf_counter()
        before = acc.get("write_wall", 0.0)
        out = real_write(self, data)
        add("stage_copy", time.perf_counter() - t - (acc.get("write_wall", 0.0) - before))
        return out

    real_finish = store.RunWriter.finish

    def finish(self, *a, **k):
        marks["finish0"] = time.perf_counter()
        real_finish(self, *a, **k)
        marks["finish1"] = time.perf_counter()

    store.RunWriter.add_rows = add_rows
    store.RunWriter._send = send
    store.RunWriter._append_block = append_block
    store.RunWriter.finish = finish
    outputs.DirectFile._write_aligned = write_aligned
    outputs.DirectFile.write = dwrite

    rows: list[dict] = []
    for r in range(args.rounds + 1):
        marks.clear()
        acc.clear()
        out = fresh("cap")
        k0, c0, t0 = _ticks(), time.process_time(), time.perf_counter()
        capture_candidate(src, ref, out, batch=args.batch)
        t1 = time.perf_counter()
        cap = {"wall": t1 - t0, "cpu": time.process_time() - c0,
               "setup": marks["fwd0"] - t0, "forward": marks["fwd1"] - marks["fwd0"],
               "head_phase": marks["last_handed"] - marks["fwd1"], "tail": t1 - marks["last_handed"],
               "finish": marks["finish1"] - marks["finish0"], **acc,
               **{f"cap_{k}": v for k, v in _tick_delta(k0, _ticks()).items()}}
        # the bare pass, its base forward and head + copy phase apart
        fwd_marks: dict[str, float] = {}
        base = src.model.model
        real_base_forward = base.forward

        def base_forward(*a, **k):
            fwd_marks["fwd0"] = time.perf_counter()
            o = real_base_forward(*a, **k)
            fwd_marks["fwd1"] = time.perf_counter()
            return o

        base.forward = base_forward
        k0, c0, t0 = _ticks(), time.process_time(), time.perf_counter()
        _bare_forward_copy(src.model, pairs, args.batch, block, src.device)
        t1 = time.perf_counter()
        del base.forward
        bare = {"bare_wall": t1 - t0, "bare_cpu": time.process_time() - c0, "bare_forward": fwd_marks["fwd1"] - fwd_marks["fwd0"],
                "bare_head_phase": t1 - fwd_marks["fwd1"], **{f"bare_{k}": v for k, v in _tick_delta(k0, _ticks()).items()}}
        row = {**cap, **bare, "load1": os.getloadavg()[0]}
        print(json.dumps({"round": r, **{k: round(v, 3) for k, v in row.items()}}), flush=True)
        if r:
            rows.append(row)
    med = lambda k: statistics.median(x.get(k, 0.0) for x in rows)  # noqa: E731
    print(f"\n{n_pos} positions, {n_pos * 2 * args.vocab / 1e6:.0f} MB of rows a capture, into {outdir}; "
          f"median of {args.rounds} interleaved rounds, load {min(x['load1'] for x in rows):.1f}-{max(x['load1'] for x in rows):.1f}")
    print("| stage | capture | bare forward + copy |\n|---|---:|---:|")
    for name, a, b in [("wall", "wall", "bare_wall"), ("process CPU", "cpu", "bare_cpu"),
                       ("setup: call to first forward", "setup", None), ("base forward", "forward", "bare_forward"),
                       ("head phase: forward done to last block handed over", "head_phase", "bare_head_phase"),
                       ("tail: last block handed over to return", "tail", None), ("of it finish()", "finish", None),
                       ("main thread in add_rows (checks + hand-off)", "add_rows", None),
                       ("of it waiting for queue room (_send)", "send_wait", None),
                       ("writer: staging copy (wall)", "stage_copy", None), ("writer: O_DIRECT write() calls (wall)", "write_wall", None),
                       ("writer: write() thread CPU", "write_cpu", None), ("writer thread CPU (rows)", "writer_cpu", None),
                       ("machine steal over the step", "cap_steal", "bare_steal"), ("machine irq", "cap_irq", "bare_irq"),
                       ("machine softirq", "cap_softirq", "bare_softirq"), ("machine system", "cap_system", "bare_system")]:
        print(f"| {name} | {med(a):.3f} s | {'' if b is None else f'{med(b):.3f} s'} |")
    print(f"\ncapture / bare, median of per-round ratios: wall {statistics.median(x['wall'] / x['bare_wall'] for x in rows):.3f}x, "
          f"CPU {statistics.median(x['cpu'] / x['bare_cpu'] for x in rows):.3f}x")


def floor(args, src, pairs, block, n_pos, fresh) -> None:
    """The bare forward + copy alone and beside a process writing one capture's bytes (see --floor)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    pre = SMALL if args.small_pages else ""
    writers = {"runwriter": pre + WRITER, "raw": pre + RAW}
    res: dict[str, list[float]] = {}

    def keep(k: str, v: float) -> None:
        res.setdefault(k, []).append(v)

    def bare() -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        _bare_forward_copy(src.model, pairs, args.batch, block, src.device)
        return time.perf_counter() - t0, time.process_time() - c0

    for r in range(args.rounds + 1):
        row: dict[str, float] = {}
        order = list(writers) if r % 2 else list(writers)[::-1]
        row["alone"], row["alone_cpu"] = bare()
        for name in order:
            out = fresh("floor")
            p = subprocess.Popen([sys.executable, "-c", writers[name], str(args.vocab), str(n_pos), str(out)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            assert p.stdout is not None and p.stdin is not None and p.stdout.readline().strip() == "ready"
            p.stdin.write("go\n")
            p.stdin.flush()
            row[name], row[f"{name}_cpu"] = bare()
            w = json.loads(p.stdout.readline())
            p.wait()
            row[f"{name}_writer"], row[f"{name}_writer_cpu"] = w["wall"], w["cpu"]
        row["alone2"], row["alone2_cpu"] = bare()
        print(json.dumps({"round": r, **{k: round(v, 3) for k, v in row.items()}, "load1": os.getloadavg()[0]}), flush=True)
        if r:
            for k, v in row.items():
                keep(k, v)
            keep("load1", os.getloadavg()[0])
    med = statistics.median
    ref = [(a + b) / 2 for a, b in zip(res["alone"], res["alone2"])]  # the passes before and after, averaged
    print(f"\n{n_pos} positions; a writer process writing the {n_pos * 2 * args.vocab / 1e6:.0f} MB of one capture to "
          f"{fresh('floor').parent} beside the bare forward + copy (staging buffer on "
          f"{'4 KiB' if args.small_pages else 'huge'} pages); median of {args.rounds} rounds, load "
          f"{min(res['load1']):.1f}-{max(res['load1']):.1f}")
    print("| bare forward + copy | wall | CPU s | wall - alone (per-round median) | wall / alone (per-round median) | writer wall | writer CPU s |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    print(f"| alone (mean of the passes before and after) | {med(ref):.3f} s | {med(res['alone_cpu']):.3f} | | | | |")
    for name, what in (("runwriter", "beside RunWriter (staging copy + O_DIRECT + fsync + manifest)"),
                       ("raw", "beside O_DIRECT writes of the staging buffer alone (no copy), fsync per 64 MiB")):
        print(f"| {what} | {med(res[name]):.3f} s | {med(res[f'{name}_cpu']):.3f} | "
              f"{med(b - a for a, b in zip(ref, res[name])):+.3f} s | {med(b / a for a, b in zip(ref, res[name])):.3f}x | "
              f"{med(res[f'{name}_writer']):.3f} s | {med(res[f'{name}_writer_cpu']):.3f} |")


if __name__ == "__main__":
    main()
