"""Capture throughput of each native source against its own bare forward pass.

For every source (transformers BF16/F32, llama.cpp GGUF F32/Q4_K_M) the same teacher
sequences are (a) captured with ``capture_candidate`` into a fresh RUN — rendering and
tokenizer checks, teacher-forced scoring, row selection, writing chunks — and (b) run
through the bare forward pass of the same backend with the same batches (transformers:
``model(input_ids, attention_mask).logits``; llama.cpp: ``Llama.eval`` of the same
tokens), and (c) scored by the source alone (``score``/``score_many``, the same forward
work as the capture, nothing checked or stored). Reported: positions/s of each, median of
``--repeats`` runs, the capture's overhead relative to the bare pass (target <= 10 %) and
relative to (c), which isolates what rendering, checks and writing cost. The bare pass of
both backends computes the logits of every position; the sources compute them at output
positions only, so (a) can be faster than (b).

    python bench/capture_bench.py [--model DIR] [--repeats 3] [--items N]

Without ``--model`` the bundled tiny model is used.

``--wide WORK`` measures instead, at V = 248,320 (a random bf16 Llama, hidden
``--hidden`` (128), 2 layers, the bundled tokenizer widened with filler tokens; built in
WORK once; or the model ``--model`` names, e.g. a GGUF file read by transformers, whose
forward is realistic against its own vocabulary), ``--items`` (2) items x ``--tokens`` (512)
teacher tokens:

* per position, in one process, interleaved: ``capture_candidate`` into a fresh RUN against
  the bare forward + copy of the same model and positions (``model.model`` over
  prompt + teacher, ``lm_head`` on the output positions, the bf16 rows copied to host
  arrays), goal <= 1.1x: the whole calls, and each minus the same call with a 1-token
  teacher (the issue's "per position": what the capture costs per call, the side files,
  setup and last fsync, is its fixed cost, below);
* the fixed cost, in fresh processes, interleaved: ``logitdiff capture`` of a 1-token
  teacher against ``import torch, transformers`` + loading model and tokenizer (goal:
  <= that + 1 s), and the whole ``logitdiff capture`` of the full teacher, from process
  start to exit (the CLI's exit included).

Every step is reported in wall and in CPU seconds (user + system, all threads: on a shared
machine they spread far less than wall time; the in-process steps also in system CPU, where
the kernel's copy of the rows into the page cache and their writeback show), with the fsynced write rate of the output
directory measured in the same invocation (a full bf16 row is 2 V bytes: a slow disk, not
the capture, can be the limit; ``--out-dir /dev/shm/X`` shows the capture apart from it).
``--peer-src DIR`` also times, in the same process and rounds, the capture of another
logitdiff (``DIR/logitdiff``, e.g. main's ``src``: the "before" of a change), with its own
source object over the same model files, and the median of the per-round ratios of the two captures. ``--device cuda`` runs the per-position part on a GPU, ``--hidden-store`` also captures
``--store hidden`` and reads it back, ``--no-fixed`` skips the processes
(bench/gpu_check.sh uses all three), ``--read-back`` reads each captured RUN back at once.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path



def _bare_hf(src, pairs, batch):
    import torch

    model = src.model
    with torch.inference_mode():
        for i in range(0, len(pairs), batch):
            group = pairs[i : i + batch]
            seqs = [list(p) + list(t[:-1]) for p, t in group]
            L = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), L), src.pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), L), dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, : len(s)] = 1
            out = model(input_ids=ids, attention_mask=mask).logits
            _ = out.float()


def _bare_gguf(src, pairs, batch):
    llm = src.llm
    for p, t in pairs:
        llm.reset()
        llm.eval(list(p) + list(t[:-1]))


def _scores_hf(src, pairs, batch):
    for i in range(0, len(pairs), batch):
        src.score_many(pairs[i : i + batch])


def _scores_gguf(src, pairs, batch):
    for p, t in pairs:
        src.score(p, t)


BARE_LOAD = """
import sys, time
t0 = time.perf_counter()
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to(sys.argv[2])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(time.perf_counter() - t0, flush=True)
import os
os._exit(0)  # import + load only: the interpreter's teardown is not counted (conservative)
"""


def _wall(cmd: list[str]) -> tuple[float, float]:
    """Run a command; (wall seconds, CPU seconds of the child: user + system, all threads)."""
    import resource
    import subprocess
    import sys

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    w = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return w, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _timed(fn) -> tuple[float, float, float]:
    """(wall, CPU seconds of this process (all threads), of it system CPU) of ``fn()``."""
    import resource

    s = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    c, t = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.process_time() - c, resource.getrusage(resource.RUSAGE_SELF).ru_stime - s


def _disk_rate(where: Path, mb: int = 256) -> float:
    """MB/s of writing ``mb`` MB to ``where`` in 64 MiB files, each flushed with fsync (as a
    RUN's chunks are)."""
    import os

    buf = os.urandom(1 << 20) * 64
    t = time.perf_counter()
    for k in range(max(1, mb // 64)):
        with open(where / f".disk{k}", "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())
    rate = max(1, mb // 64) * 64 / (time.perf_counter() - t)
    for k in range(max(1, mb // 64)):
        (where / f".disk{k}").unlink()
    return rate


def _direct_rate(where: Path, mb: int = 256) -> tuple[float, bool]:
    """MB/s of the full store's write path alone (outputs.atomic_file_direct: O_DIRECT through a
    staging buffer where it pays, 64 MiB files fsynced by name), and whether O_DIRECT was used."""
    import os

    from logitdiff.store.files import atomic_file_direct, direct_io_pays, direct_stage, fsync_path

    buf = os.urandom(1 << 20) * 64
    direct = direct_io_pays(where)
    stage = direct_stage() if direct else None
    used = False
    t = time.perf_counter()
    for k in range(max(1, mb // 64)):
        with atomic_file_direct(where / f".direct{k}", stage, direct) as f:
            f.write(buf)
            used = f.direct
        fsync_path(where / f".direct{k}")
    rate = max(1, mb // 64) * 64 / (time.perf_counter() - t)
    for k in range(max(1, mb // 64)):
        (where / f".direct{k}").unlink()
    return rate, used


def _bare_forward_copy(model, pairs, batch: int, block: int, device, copy: bool = True) -> int:
    """The least a capture must do: one right-padded forward of ``prompt + teacher[:-1]``,
    the head on the output positions, every bf16 row copied to a host array (``copy``;
    without it the rows stay on the device: the model's own forward)."""
    import numpy as np
    import torch

    n = 0
    with torch.inference_mode():
        for a in range(0, len(pairs), batch):
            group = pairs[a : a + batch]
            seqs = [list(p) + list(t[:-1]) for p, t in group]
            width = max(len(s) for s in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, : len(s)] = 1
            h = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            for j, (p, t) in enumerate(group):
                hs = h[j, len(p) - 1 : len(p) - 1 + len(t)]
                for b in range(0, len(hs), block):
                    rows = model.lm_head(hs[b : b + block])
                    if copy:
                        out = np.empty(tuple(rows.shape), np.uint16)
                        out[...] = rows.view(torch.int16).cpu().numpy().view(np.uint16)
                    n += rows.shape[0]
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return n


def _read_rate(run) -> float:
    """Seconds to read every row of a RUN (a hidden-state run decodes them) in chunk-sized blocks."""
    from logitdiff.store import RunReader, rows_per_block

    r = RunReader(run)
    t = time.perf_counter()
    for _ in r.row_blocks(r.items(), rows_per_block(r.vocab_size, None, 2), raw=True):
        pass
    return time.perf_counter() - t


def _read_all(run) -> int:
    """Every stored row of a RUN read back through RunReader in chunk-sized blocks, each byte
    touched (a full RUN's blocks are memory-mapped: nothing is read until touched)."""
    import numpy as np

    from logitdiff.store import RunReader, rows_per_block

    r = RunReader(run)
    return sum(int(np.asarray(b).sum(dtype=np.uint64)) & 1
               for b in r.row_blocks(r.items(), rows_per_block(r.vocab_size, None, 2), raw=True))


def _peer_package(src_dir: str):
    """The logitdiff package under ``src_dir`` imported as ``logitdiff_peer`` (a copy in a
    temporary directory: its imports are relative), beside this one."""
    import importlib
    import sys

    tmp = Path(tempfile.mkdtemp(prefix="capbench-peer-"))
    shutil.copytree(Path(src_dir) / "logitdiff", tmp / "logitdiff_peer", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(tmp))
    reg = importlib.import_module("logitdiff_peer.sources.registry")

    def open_source(text: str):  # the registry names its factories by absolute module: take the peer's
        spec = reg.parse_spec(text)
        return importlib.import_module(f"logitdiff_peer.sources.{spec.kind}").open_hf(spec)

    return importlib.import_module("logitdiff_peer.capture"), open_source, importlib.import_module("logitdiff_peer.store")


def wide(args) -> None:
    import json
    import os
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _models import make_wide_llama

    work = Path(args.wide)
    work.mkdir(parents=True, exist_ok=True)
    heads = max(4, args.hidden // 128)
    if args.model:  # a real model instead (--model: its forward against its own vocabulary's rows)
        model, tag = Path(args.model).expanduser(), Path(args.model).stem
    else:
        model = make_wide_llama(work / f"model-h{args.hidden}-v{args.vocab}", vocab_size=args.vocab, hidden=args.hidden,
                                heads=heads, kv_heads=max(2, heads // 4), dtype="bfloat16", never_eos=True)
        tag = f"h{args.hidden}-v{args.vocab}"
    wl = work / "w.jsonl"
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": f"Item {k}: def fibonacci(n):\n    "}) + "\n"
                          for k in range(args.items)))
    cli = [sys.executable, "-m", "logitdiff.cli"]
    dev = f",device={args.device}" if args.device != "cpu" else ""
    refs = {}
    for n in (args.tokens, 1):  # teachers: greedy token ids (top-1 stored: only the ids matter here)
        ref = work / f"ref-{tag}-{args.items}x{n}"
        if not (ref / "manifest.json").exists():
            # a GGUF's teacher generated by llama.cpp (same vocabulary; transformers' generation on the CPU is ~100x slower)
            gen = f"gguf:{model}" if model.suffix == ".gguf" else f"hf:{model}{dev},batch={args.batch}"
            _wall(cli + ["capture", gen, "--workload", str(wl), "--max-tokens", str(n),
                         "--store", "topk:1", "--out", str(ref), "--overwrite"])
        refs[n] = ref

    from logitdiff.capture import capture_candidate
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader, rows_per_block

    ref = RunReader(refs[args.tokens])
    ref1 = RunReader(refs[1])  # the same items with 1 teacher token: the capture's cost per call, not per position
    pairs = [(it.prompt_ids, it.teacher_ids) for it in ref.items()]
    pairs1 = [(it.prompt_ids, it.teacher_ids) for it in ref1.items()]
    n_pos = sum(len(t) for _, t in pairs)
    src = open_source(f"hf:{model}{dev},batch={args.batch}")
    block = rows_per_block(src.vocab_size)
    args.vocab = src.vocab_size  # what the rows are (a --model's own)
    outdir = Path(args.out_dir) if args.out_dir else work
    outdir.mkdir(parents=True, exist_ok=True)
    peer = None
    if args.peer_src:
        pcap, psrc, pstore = _peer_package(args.peer_src)
        peer = (pcap.capture_candidate, psrc(f"hf:{model}{dev},batch={args.batch}"),
                pstore.RunReader(refs[args.tokens]))
    keys = ("capture", "capture_peer", "read", "read_peer", "capture_hidden", "read_hidden", "bare", "forward", "fixed",
            "load", "whole", "capture1", "bare1")
    t: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    sys_cpu: dict[str, list[float]] = {k: [] for k in keys}  # in-process steps only

    def fresh(name: str) -> Path:
        shutil.rmtree(outdir / name, ignore_errors=True)  # outside the timed part
        # and so is the deletion's disk work: on a file system mounted with `discard` (this
        # VM's ext4) freeing the last round's 509 MB lands in the next journal commit, i.e.
        # in the capture's first fsync, unless it is flushed here
        os.sync()
        return outdir / name

    for r in range(args.repeats + 1):  # the first round warms caches (files, the ~/.cache/logitdiff facts)
        row = {}
        caps = [("capture", lambda o: capture_candidate(src, ref, o, batch=args.batch))]
        if peer is not None:  # which of the two goes first alternates by round
            caps.append(("capture_peer", lambda o: peer[0](peer[1], peer[2], o, batch=args.batch)))
        for key, fn in caps[r % len(caps):] + caps[: r % len(caps)]:
            out = fresh("cap")
            row[key] = _timed(lambda: fn(out))  # noqa: B023 (called at once)
            if args.read_back:  # at once, as `logitdiff run` compares a candidate it just captured
                row[key.replace("capture", "read")] = _timed(lambda: _read_all(out))  # noqa: B023
        row["bare"] = _timed(lambda: _bare_forward_copy(src.model, pairs, args.batch, block, src.device))
        # per call: the same capture and bare pass of a 1-token teacher (setup, side files, last fsync and manifest)
        out = fresh("cap1")
        row["capture1"] = _timed(lambda: capture_candidate(src, ref1, out, batch=args.batch))  # noqa: B023
        row["bare1"] = _timed(lambda: _bare_forward_copy(src.model, pairs1, args.batch, block, src.device))
        row["forward"] = _timed(lambda: _bare_forward_copy(src.model, pairs, args.batch, block, src.device, copy=False))
        if args.hidden_store:
            out = fresh("caph")
            row["capture_hidden"] = _timed(lambda: capture_candidate(src, ref, out, batch=args.batch, store="hidden"))
            row["read_hidden"] = _timed(lambda: _read_rate(out))
        if args.fixed:
            row["fixed"] = _wall(cli + ["capture", f"hf:{model}{dev}", "--reference", str(refs[1]), "--out", str(fresh("cap1"))])
            row["load"] = _wall([sys.executable, "-c", BARE_LOAD, str(model), args.device])
            row["whole"] = _wall(cli + ["capture", f"hf:{model}{dev},batch={args.batch}", "--reference", str(refs[args.tokens]),
                                        "--out", str(fresh("capw"))])
        if r:
            for k, (w, c, *sy) in row.items():
                t[k].append(w)
                cpu[k].append(c)
                sys_cpu[k].extend(sy)
        print(json.dumps({"round": r, **{k: [round(x, 3) for x in v] for k, v in row.items()},
                          "load1": os.getloadavg()[0]}), flush=True)
    disk = _disk_rate(outdir)
    direct, used = _direct_rate(outdir)
    med = statistics.median
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"\n{args.model + ': ' if args.model else ''}V = {args.vocab:,}, hidden {src.model.config.hidden_size}, {len(pairs)} items x {args.tokens} tokens = {n_pos} positions, "
          f"{where}, median of {args.repeats} interleaved rounds; RUNs written to {outdir} "
          f"({disk:,.0f} MB/s written in 64 MiB fsynced files, measured after the rounds; a full row is "
          f"{2 * args.vocab / 1e3:,.0f} KB: {disk * 1e6 / (2 * args.vocab):,.0f} positions/s at most; through the full "
          f"store's writer ({'O_DIRECT' if used else 'page cache'}): {direct:,.0f} MB/s, "
          f"{direct * 1e6 / (2 * args.vocab):,.0f} positions/s at most)")
    print("| what | wall | positions/s | wall vs forward + copy | CPU s | CPU vs forward + copy | system CPU s |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    rate = lambda k: n_pos / med(t[k])  # noqa: E731
    rows = [("capture_candidate, --store full (in process)", "capture"),
            (f"capture_candidate of {args.peer_src}, --store full (in process)", "capture_peer"),
            ("read back every row of that RUN at once (RunReader, each byte touched)", "read"),
            (f"read back the RUN of {args.peer_src}'s capture", "read_peer"),
            ("bare forward + bf16 rows copied to host", "bare"),
            ("model's own forward (base + head, rows stay on the device)", "forward"),
            ("capture_candidate, --store hidden (in process)", "capture_hidden"), ("read the hidden-state run (decode)", "read_hidden")]
    for name, k in rows:
        if t[k]:
            print(f"| {name} | {med(t[k]):.2f} s | {rate(k):,.0f} | {med(a / b for a, b in zip(t[k], t['bare'])):.3f}x "
                  f"| {med(cpu[k]):.2f} | {med(a / b for a, b in zip(cpu[k], cpu['bare'])):.3f}x "
                  f"| {med(sys_cpu[k]) if sys_cpu[k] else float('nan'):.2f} |")
    for k in ("capture", "capture_peer"):
        if t[k]:
            print(f"\n{k} / bare forward + copy, ratio of medians: {med(t[k]) / med(t['bare']):.3f}x wall, "
                  f"{med(cpu[k]) / med(cpu['bare']):.3f}x CPU")
    if t["capture_peer"]:
        wr = [a / b for a, b in zip(t["capture"], t["capture_peer"])]
        cr = [a / b for a, b in zip(cpu["capture"], cpu["capture_peer"])]
        print(f"\ncapture / capture_peer, median of per-round ratios: {med(wr):.3f}x wall "
              f"(faster in {sum(x < 1 for x in wr)}/{len(wr)} rounds), {med(cr):.3f}x CPU "
              f"(less in {sum(x < 1 for x in cr)}/{len(cr)})")
        if t["read"] and t["read_peer"]:
            both = lambda d, k: [a + b for a, b in zip(d[f"capture{k}"], d[f"read{k}"])]  # noqa: E731
            wr = [a / b for a, b in zip(both(t, ""), both(t, "_peer"))]
            cr = [a / b for a, b in zip(both(cpu, ""), both(cpu, "_peer"))]
            print(f"capture + read back / the same of capture_peer, median of per-round ratios: {med(wr):.3f}x wall "
                  f"(faster in {sum(x < 1 for x in wr)}/{len(wr)}), {med(cr):.3f}x CPU (less in {sum(x < 1 for x in cr)}/{len(cr)})")
    # per position, as the issue reads it: what a capture costs beyond the same call with a
    # 1-token teacher (its per-call part: setup, vocab.json/tokens.json, the last fsync and
    # manifest, which the fixed cost below covers) against the bare pass beyond its own
    mp = [(c - c1) / (b - b1) for c, c1, b, b1 in zip(t["capture"], t["capture1"], t["bare"], t["bare1"]) if b > b1]
    if not mp or med(t["capture"]) <= med(t["capture1"]) or med(t["bare"]) <= med(t["bare1"]) or min(mp) < 0:
        print(f"\nper position: not measurable at this size (capture {med(t['capture']):.3f} s against its 1-token call "
              f"{med(t['capture1']):.3f} s, bare {med(t['bare']):.3f} s against {med(t['bare1']):.3f} s: the per-call part "
              "is not small against the whole; use more --tokens or --repeats)")
    else:
        print(f"\nper position (each minus its 1-token call: capture {med(t['capture1']):.3f} s, bare {med(t['bare1']):.3f} s): "
              f"capture / bare forward + copy, median of per-round ratios {med(mp):.3f}x wall "
              f"(<= 1.1x in {sum(x <= 1.1 for x in mp)}/{len(mp)} rounds), ratio of medians "
              f"{(med(t['capture']) - med(t['capture1'])) / (med(t['bare']) - med(t['bare1'])):.3f}x")
    print(f"\ncapture / model's own forward, positions/s: {rate('capture') / rate('forward'):.1%}")
    if args.fixed:
        print("\n| fixed cost (process start to exit) | wall | CPU s |\n|---|---:|---:|")
        print(f"| `logitdiff capture` of a 1-token teacher | {med(t['fixed']):.2f} s | {med(cpu['fixed']):.2f} |")
        print(f"| python: import torch + transformers, load model + tokenizer | {med(t['load']):.2f} s | {med(cpu['load']):.2f} |")
        print(f"| fixed cost over import + load | {med(f - ld for f, ld in zip(t['fixed'], t['load'])):+.2f} s "
              f"| {med(f - ld for f, ld in zip(cpu['fixed'], cpu['load'])):+.2f} |")
        print(f"| `logitdiff capture` of the whole teacher | {med(t['whole']):.2f} s | {med(cpu['whole']):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model dir or GGUF file (default: the bundled tiny model; with --wide: this model instead of the random V = 248,320 one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--items", type=int, default=0, help="use the first N workload items (0 = all)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--wide", metavar="WORK", help="the V = 248,320 measurement (see above), in WORK")
    ap.add_argument("--tokens", type=int, default=512, help="--wide: teacher tokens per item")
    ap.add_argument("--hidden", type=int, default=128, help="--wide: hidden size of the random model")
    ap.add_argument("--vocab", type=int, default=248_320, help="--wide: vocabulary size")
    ap.add_argument("--device", default="cpu", help="--wide: cpu or cuda")
    ap.add_argument("--hidden-store", action="store_true", help="--wide: also capture --store hidden and read it back")
    ap.add_argument("--no-fixed", dest="fixed", action="store_false", help="--wide: skip the fixed-cost processes")
    ap.add_argument("--read-back", action="store_true", help="--wide: after each capture, read every row of its RUN "
                    "back at once (what a compare right after the capture pays: page cache or disk)")
    ap.add_argument("--peer-src", help="--wide: also time the capture of the logitdiff package under this src dir "
                    "(e.g. main's), same process and rounds")
    ap.add_argument("--out-dir", help="--wide: where the captured RUNs go (default WORK; /dev/shm: apart from the disk)")
    args = ap.parse_args()
    if args.wide:
        args.items = args.items or 2
        return wide(args)

    from logitdiff.builtin import TINY_DIR, WORKLOAD
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.sources.quantize import build_ladder
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader
    from logitdiff.workload import read_workload

    model = Path(args.model or TINY_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="capbench-"))
    items = read_workload(WORKLOAD)
    if args.items:
        items = items[: args.items]
    ladder = build_ladder(model, tmp / "cache", ["Q4_K_M"])
    ref = RunReader(capture_reference(open_source(f"hf:{model},dtype=float32"), items, tmp / "ref"))
    pairs = [(it.prompt_ids, it.teacher_ids) for it in ref.items()]
    n_pos = sum(len(t) for _, t in pairs)
    sources = [
        (f"hf:{model},dtype=bfloat16,batch={args.batch}", _bare_hf, _scores_hf),
        (f"hf:{model},dtype=float32,batch={args.batch}", _bare_hf, _scores_hf),
        (f"gguf:{ladder['F32']}", _bare_gguf, _scores_gguf),
        (f"gguf:{ladder['Q4_K_M']}", _bare_gguf, _scores_gguf),
    ]
    rows = []
    for spec, bare, scores in sources:
        src = open_source(spec)
        cap_t, bare_t, score_t = [], [], []
        for r in range(args.repeats + 1):  # first round warms caches, not counted
            out = tmp / f"cap{r}"
            t0 = time.perf_counter()
            capture_candidate(src, ref, out, batch=args.batch, overwrite=True)
            t1 = time.perf_counter()
            bare(src, pairs, args.batch)
            t2 = time.perf_counter()
            scores(src, pairs, args.batch)
            t3 = time.perf_counter()
            shutil.rmtree(out)
            if r:
                cap_t.append(t1 - t0)
                bare_t.append(t2 - t1)
                score_t.append(t3 - t2)
        c, b, sc = statistics.median(cap_t), statistics.median(bare_t), statistics.median(score_t)
        rows.append((spec.split(",")[0].replace(str(tmp), "…").replace(str(model), Path(model).name), spec.split(",", 1)[1] if "," in spec else "",
                     n_pos / c, n_pos / b, c / b - 1.0, n_pos / sc, c / sc - 1.0))
        src.close()
    print(f"machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores; "
          f"{len(pairs)} items, {n_pos} positions, median of {args.repeats}")
    print("| source | options | capture pos/s | bare forward pos/s | capture overhead | source.score only pos/s | capture vs score only |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, opts, c, b, o, sc, o2 in rows:
        print(f"| `{name}` | {opts} | {c:,.0f} | {b:,.0f} | {100 * o:+.1f} % | {sc:,.0f} | {100 * o2:+.1f} % |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
