"""Cost of ``logitdiff layers`` against the plain teacher-forced capture of the same candidate.

Two settings, each a subprocess per measurement (wall time and peak RSS of that process,
``os.wait4``), interleaved, median of ``--repeats``:

* ``ladder``: the bundled model; teacher = ``builtin:tiny`` on the bundled workload; for
  each candidate of ``--candidates`` (default Q4_K_M) ``logitdiff capture CAND --reference REF``
  against ``logitdiff layers builtin:tiny CAND --reference REF --floor none``;
* ``wide``: a random bf16 Llama with V = 248,320 and H = ``--hidden`` (1,024), ``--layers``
  decoder layers; the candidate is the same model in float32 (a dtype change, hf vs hf).

``layers`` runs the reference and the candidate (two forward passes per window) and the
per-layer metrics; the capture runs the candidate alone, so the same invocation also times
the teacher-forced capture of the reference's spec (``capture REF --reference REF_RUN``): the
two captures together are what ``layers`` cannot go below. The goal is <= 2x
the candidate capture's time. Positions/s = teacher-forced positions / wall seconds of the whole command
(model loading included, as a user sees it).

    python bench/layers_bench.py WORK [--repeats 3] [--hidden 1024] [--layers 4] [--items 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hwm_mib(pid: int) -> float | None:
    """The process's peak resident set so far (VmHWM), MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one subprocess. The peak is the child's own VmHWM,
    polled every 50 ms (``ru_maxrss`` of a child counts the parent's memory at the fork: a
    parent that loaded a model would inflate it); a peak in the last 50 ms can be missed."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0.0
    err = []
    import threading

    reader = threading.Thread(target=lambda: err.append(p.stderr.read().decode()))
    reader.start()
    while p.poll() is None:
        peak = max(peak, _hwm_mib(p.pid) or 0.0)
        time.sleep(0.05)
    wall = time.perf_counter() - t
    reader.join()
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{''.join(err)}")
    return wall, peak


def compare(name: str, ref_run: Path, cand: str, ref: str, work: Path, repeats: int, env: dict, positions: int) -> dict:
    py = [sys.executable, "-m", "logitdiff.cli"]
    cap, lay, refcap = [], [], []
    for r in range(repeats):  # interleaved
        out = work / f"cap-{name}"
        shutil.rmtree(out, ignore_errors=True)
        cap.append(timed(py + ["capture", cand, "--reference", str(ref_run), "--out", str(out)], env))
        out = work / f"refcap-{name}"
        shutil.rmtree(out, ignore_errors=True)
        refcap.append(timed(py + ["capture", ref, "--reference", str(ref_run), "--out", str(out)], env))
        out = work / f"lay-{name}"
        shutil.rmtree(out, ignore_errors=True)
        lay.append(timed(py + ["layers", ref, cand, "--reference", str(ref_run), "--floor", "none", "--out", str(out)], env))
    ct, cr = statistics.median(x[0] for x in cap), statistics.median(x[1] for x in cap)
    lt, lr = statistics.median(x[0] for x in lay), statistics.median(x[1] for x in lay)
    rt, rr = statistics.median(x[0] for x in refcap), statistics.median(x[1] for x in refcap)
    doc = json.loads((work / f"lay-{name}" / "layers.json").read_text())
    row = {"setting": name, "candidate": cand, "positions": positions, "window_tokens": doc["geometry"]["window_tokens"],
           "capture_s": round(ct, 2), "layers_s": round(lt, 2), "time_ratio": round(lt / ct, 2),
           "capture_pos_per_s": round(positions / ct, 1), "layers_pos_per_s": round(positions / lt, 1),
           "capture_peak_rss_mib": round(cr), "layers_peak_rss_mib": round(lr), "rss_ratio": round(lr / cr, 2),
           "ref_capture_s": round(rt, 2), "ref_capture_peak_rss_mib": round(rr),
           "time_ratio_vs_both_captures": round(lt / (ct + rt), 2),
           "runs": {"capture": cap, "ref_capture": refcap, "layers": lay}}
    print(json.dumps(row), flush=True)
    return row


def make_deep_llama(out: Path, intermediate: int) -> Path:
    """A random bf16 Llama, H = 4,096, 32 layers, 32 heads (8 KV heads), the bundled tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import BUILTIN_TOKENIZER, widen_tokenizer

    tok = widen_tokenizer(BUILTIN_TOKENIZER, out, 4096)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=4096, intermediate_size=intermediate, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0, dtype="bfloat16")
    with torch.device("cpu"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    m.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--candidates", default="builtin:tiny-Q4_K_M")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip", choices=("ladder", "wide", "deep"), action="append", default=[])
    ap.add_argument("--deep-intermediate", type=int, default=256,
                    help="MLP width of the deep setting (H = 4,096, 32 layers, the bundled 4,096-token tokenizer)")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "python": sys.version.split()[0]}), flush=True)
    sys.path.insert(0, str(ROOT / "src"))
    import logitdiff.api as api
    from logitdiff.store import RunReader

    rows = []
    if "ladder" not in args.skip:
        ref_run = work / "ref-tiny"
        if not (ref_run / "manifest.json").exists():
            api.capture_run("builtin:tiny", ref_run)
        n = RunReader(ref_run).manifest["n_positions"]
        for cand in args.candidates.split(","):
            rows.append(compare(f"ladder-{cand.split('-')[-1]}", ref_run, cand, "builtin:tiny", work, args.repeats, env, n))
    if "wide" not in args.skip:
        sys.path.insert(0, str(ROOT / "tests"))
        from _models import make_wide_llama

        H = args.hidden
        d = make_wide_llama(work / f"wide-h{H}-l{args.layers}", hidden=H, layers=args.layers, heads=max(1, H // 128),
                            kv_heads=max(1, H // 512), dtype="bfloat16", never_eos=True)
        wl = work / "wide.jsonl"
        wl.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Item {i}: list the numbers", "max_tokens": args.tokens}) + "\n"
                              for i in range(args.items)))
        ref_run = work / f"ref-wide-h{H}"
        if not (ref_run / "manifest.json").exists():
            api.capture_run(f"hf:{d},threads=2", ref_run, workload=wl)
        n = RunReader(ref_run).manifest["n_positions"]
        rows.append(compare(f"wide-h{H}", ref_run, f"hf:{d},dtype=float32,threads=2", f"hf:{d},threads=2", work, args.repeats, env, n))
    if "deep" not in args.skip:
        # H = 4,096 and 32 layers (an 8B model's residual stream) with a narrow MLP so that it fits a
        # small machine: what `layers` holds per window depends on points x H, not on the MLP
        d = make_deep_llama(work / "deep-h4096-l32", args.deep_intermediate)
        wl = work / "deep.jsonl"
        wl.write_text("".join(json.dumps({"id": f"d{i}", "prompt": f"Item {i}: list the numbers", "max_tokens": 32}) + "\n"
                              for i in range(2)))
        ref_run = work / "ref-deep"
        if not (ref_run / "manifest.json").exists():
            api.capture_run(f"hf:{d},threads=2", ref_run, workload=wl)
        n = RunReader(ref_run).manifest["n_positions"]
        rows.append(compare("deep-h4096-l32", ref_run, f"hf:{d},threads=2", f"hf:{d},threads=2", work, 1, env, n))
    print(json.dumps({"summary": [{k: v for k, v in r.items() if k != "runs"} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
