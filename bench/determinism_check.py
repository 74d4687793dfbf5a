"""What is bit-exact and what is not: captures of the bundled model compared bit for bit.

    python bench/determinism_check.py [--workload W] [--kill-after K] [--out DIR]

Captures `builtin:tiny` (transformers, BF16, batched) on the bundled workload cleanly, then
(1) a capture SIGKILLed after K items and resumed, (2) two shards merged, (3) a plain
rerun, and the same items with other batch mates: (4) boundaries moved by half a batch
(what `run` takes as the noise floor), (5) blocks of 3, (6) each item alone; and the
llama.cpp F32 GGUF of the same weights rerun with moved boundaries. For each: items whose
logits differ, max |Δlogit|, mean and max KL, top-1 flips against the clean capture.
Prints a markdown table. A measurement, not a timing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from logitdiff.capture import LiveRun
from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.sources import open_source
from logitdiff.store import RunReader


def _cli(*argv) -> None:
    rc = main([str(a) for a in argv])
    if rc != 0:
        raise SystemExit(f"logitdiff {' '.join(map(str, argv))}: exit {rc}")


def _killed_and_resumed(wl: str, out: Path, kill_after: int) -> None:
    code = (
        "import os\n"
        "from logitdiff.store import RunWriter\n"
        "of, oi, n = RunWriter.flush, RunWriter.__init__, [0]\n"
        "def flush(self, wait=True):\n"
        "    of(self, wait=True)\n"
        "    n[0] += 1\n"
        f"    if n[0] == {kill_after}: os.kill(os.getpid(), 9)\n"
        "def init(self, *a, **k):\n"
        "    k['chunk_rows'] = 1\n"
        "    oi(self, *a, **k)\n"
        "RunWriter.flush, RunWriter.__init__ = flush, init\n"
        "from logitdiff.cli import main\n"
        f"main(['capture', 'builtin:tiny', '--workload', {wl!r}, '--out', {str(out)!r}])\n"
    )
    rc = subprocess.run([sys.executable, "-c", code], capture_output=True).returncode
    assert rc == -9, rc
    _cli("capture", "builtin:tiny", "--workload", wl, "--out", out, "--resume")


def _row(name: str, ref: RunReader, other) -> str:
    differ, dmax = 0, 0.0
    for a, b in zip(ref.items(), other.items()):
        x, y = np.asarray(ref.logits(a), np.float64), np.asarray(other.logits(b), np.float64)
        if not np.array_equal(x, y):
            differ += 1
            dmax = max(dmax, float(np.abs(x - y).max()))
    c = compare_runs(ref, other).columns
    kl = np.asarray(c["kl_nats"])
    flips = int(np.sum(~np.asarray(c["top1_match"], dtype=bool)))
    return f"| {name} | {differ} / {len(ref.items())} | {dmax:.4g} | {kl.mean():.3g} | {kl.max():.3g} | {flips} |"


def run(wl: str, root: Path, kill_after: int) -> list[str]:
    clean = root / "clean"
    _cli("capture", "builtin:tiny", "--workload", wl, "--out", clean)
    ref = RunReader(clean)
    _killed_and_resumed(wl, root / "resumed", kill_after)
    for i in range(2):
        _cli("capture", "builtin:tiny", "--workload", wl, "--out", root / f"s{i}", "--shard", f"{i}/2")
    _cli("merge", root / "s0", root / "s1", "--out", root / "merged")
    _cli("capture", "builtin:tiny", "--reference", clean, "--out", root / "rerun")
    _cli("capture", "builtin:tiny", "--reference", clean, "--out", root / "batch3", "--batch", "3")
    _cli("capture", "builtin:tiny", "--reference", clean, "--out", root / "batch1", "--batch", "1")
    rows = [
        "| against the clean capture | items differing | max \\|Δlogit\\| | mean KL (nats) | max KL | top-1 flips |",
        "|---|---:|---:|---:|---:|---:|",
        _row(f"killed after {kill_after} items, `--resume`", ref, RunReader(root / "resumed")),
        _row("2 shards, `merge`", ref, RunReader(root / "merged")),
        _row("plain rerun (`capture --reference`)", ref, RunReader(root / "rerun")),
    ]
    with open_source("builtin:tiny") as src:
        rows.append(_row("boundaries moved by 4 (`run`'s noise floor)", ref, LiveRun(src, ref, offset=4)))
    rows.append(_row("`--batch 3`", ref, RunReader(root / "batch3")))
    rows.append(_row("`--batch 1` (each item alone)", ref, RunReader(root / "batch1")))
    _cli("capture", "builtin:tiny-F32", "--reference", clean, "--out", root / "gguf")
    gref = RunReader(root / "gguf")
    with open_source("builtin:tiny-F32") as src:
        rows.append(_row("llama.cpp F32 GGUF, boundaries moved by 4 (vs its own capture)", gref, LiveRun(src, gref, offset=4)))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=None, help="workload JSONL (default: the bundled one)")
    ap.add_argument("--kill-after", type=int, default=21, help="items on disk when the capture is killed (default: 21)")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args()
    from logitdiff.builtin import WORKLOAD

    wl = a.workload or str(WORKLOAD)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        print("\n".join(run(wl, Path(a.out), a.kill_after)))
    else:
        with tempfile.TemporaryDirectory() as d:
            print("\n".join(run(wl, Path(d), a.kill_after)))
