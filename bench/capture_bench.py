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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model dir (default: the bundled tiny model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--items", type=int, default=0, help="use the first N workload items (0 = all)")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    from logitdiff.builtin import TINY_DIR, WORKLOAD
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.quantize import build_ladder
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
