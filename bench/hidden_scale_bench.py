"""The hidden-state store at a real model's shape: V = 248,320 and hidden size H (default
4,096, e.g. Qwen3-8B's), on a random bf16 Llama with one decoder layer (the head is what
matters here: its size, the exceptions per position and the cost of decoding). Random
weights: the distributions are flat, which does not change what is measured — the store is
exact for any distribution, and its exceptions come from the model's float32 rounding.

    python bench/hidden_scale_bench.py WORK [--hidden 4096] [--items 2] [--tokens 32] [--repeats 3]

Captures the same items with --store full and --store hidden, checks that the two read
back bit for bit, and prints bytes per position, exceptions per position, and the median
over --repeats of reading every row back (full: memory-mapped bf16 -> float32; hidden:
decoded), in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--items", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import WIDE_VOCAB, make_wide_llama

    from logitdiff.capture import capture_reference
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader, aligned_blocks
    from logitdiff.workload import read_workload

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    H = args.hidden
    t = time.perf_counter()
    d = make_wide_llama(work / f"model-h{H}", hidden=H, layers=1, heads=max(1, H // 128), kv_heads=max(1, H // 512),
                        dtype="bfloat16", never_eos=True)
    print(json.dumps({"step": "model", "s": round(time.perf_counter() - t, 1)}), flush=True)
    wl = work / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Item {i}: list the numbers", "max_tokens": args.tokens}) + "\n"
                          for i in range(args.items)))
    src = open_source(f"hf:{d}")
    items = read_workload(wl)
    runs = {}
    for store in ("full", "hidden"):
        out = work / f"ref-{store}-h{H}"
        if not (out / "manifest.json").exists():
            t = time.perf_counter()
            capture_reference(src, items, out, store=store)
            print(json.dumps({"step": f"capture {store}", "s": round(time.perf_counter() - t, 1)}), flush=True)
        runs[store] = RunReader(out)
    full, hid = runs["full"], runs["hidden"]
    n = full.manifest["n_positions"]
    same = 0
    for a, b in aligned_blocks(full.row_pieces(full.items()), hid.row_pieces(hid.items()), 1 << 30):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            sys.exit("hidden rows differ from the full rows")
        same += len(a)
    assert same == n

    def chunk_bytes(r):
        return sum((r.path / "chunks" / c["data"]).stat().st_size for c in r.manifest["chunks"])

    exc = sum(int(np.load(hid.path / "chunks" / c["data"])["exc_row"].size) for c in hid.manifest["chunks"])
    times = {"full": [], "hidden": []}
    for _ in range(args.repeats):
        for store, r in (("full", RunReader(full.path)), ("hidden", RunReader(hid.path))):
            t = time.perf_counter()
            for b in r.row_blocks(r.items(), 64):
                float(b[:, 0].sum())
            times[store].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"vocab_size": WIDE_VOCAB, "hidden_size": H, "positions": n, "identical_rows": same,
           "bytes_per_position": {"full": chunk_bytes(full) / n, "hidden": chunk_bytes(hid) / n},
           "hidden_head_bytes": (hid.path / "head.npy").stat().st_size, "exceptions_per_position": exc / n,
           "read_ms_per_position_median": {k: 1000 * v / n for k, v in med.items()},
           "read_ratio_hidden_over_full": med["hidden"] / med["full"], "repeats": args.repeats}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
