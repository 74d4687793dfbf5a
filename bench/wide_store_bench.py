"""Issue 13's targets at V = 248,320 on a trained model's distributions: bytes per position
of every reference store, and the width of what each lets `compare` say about the whole
quant ladder (llama.cpp, built at that vocabulary), against the exact full-vocabulary value.

The model: builtin:tiny (trained, H = 256) widened to exactly 248,320 tokens. The 244,224
new output rows are the trained model's own rows of the tokens it ranks lowest (the quarter
of its vocabulary with the lowest mean log-probability over the bundled workload: tokens
training pushed down), each copied with N(0, (0.05 sd)^2) noise per weight (sd: that row's
standard deviation) so no two are equal; new input rows likewise (never used: BPE never
produces the filler tokens). Saved in bf16; F32 and the ladder are built from it by
logitdiff.quantize, and the tokenizer is the bundled one widened (tests/_models.py).

    python bench/wide_store_bench.py WORK [--positions sample:0.25] [--specs compact:...;...]

Steps, each through the CLI: capture the reference (transformers BF16) with --store full,
hidden and each compact spec; capture every rung teacher-forced against the full one;
compare every rung against every reference store. Prints one JSON line per step and a
table; WORK keeps everything (reruns reuse what exists).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
V_WIDE = 248_320
LADDER = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")
SPECS = ("compact:exact=512,band=5632", "compact:exact=512,band=8192")
NOISE = 0.05


def cli(*args: str) -> float:
    """Run `logitdiff ARGS`; seconds taken. Stops the bench on failure."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "logitdiff.cli", *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"logitdiff {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t


def build_model(work: Path) -> Path:
    """The widened trained model (see the module docstring); cached in WORK/model."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from _models import widen_tokenizer

    from logitdiff.builtin import TINY_DIR, WORKLOAD
    from logitdiff.sources import open_source
    from logitdiff.workload import read_workload

    out = work / "model"
    if (out / "config.json").exists():
        return out
    # the tokens the trained model ranks lowest, over the bundled workload's positions
    src = open_source("builtin:tiny")
    items = read_workload(WORKLOAD)
    rendered = [src.render(it) for it in items]
    mean_lp = np.zeros(src.vocab_size)
    n = 0
    # each prompt's second half teacher-forced after its first: distributions over real text
    for b in src.score_blocks([(p[: len(p) // 2], p[len(p) // 2 :]) for p in rendered if len(p) > 3]):
        z = (b.rows.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        z -= z.max(1, keepdims=True)
        mean_lp += (z - np.log(np.exp(z).sum(1, keepdims=True))).sum(0)
        n += len(z)
    pool = np.argsort(mean_lp / n)[: src.vocab_size // 4]
    src.close()

    model = AutoModelForCausalLM.from_pretrained(str(TINY_DIR), dtype=torch.float32)
    V0 = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    pick = torch.as_tensor(np.random.default_rng(0).choice(pool, V_WIDE - V0), dtype=torch.long)
    with torch.no_grad():
        for name in ("lm_head", "embed"):
            w = model.lm_head.weight if name == "lm_head" else model.model.embed_tokens.weight
            base = w[pick]
            sd = base.std(1, keepdim=True)
            new = base + NOISE * sd * torch.randn(base.shape, generator=gen)
            full = torch.cat([w, new])
            if name == "lm_head":
                model.lm_head.weight = torch.nn.Parameter(full)
            else:
                model.model.embed_tokens.weight = torch.nn.Parameter(full)
    model.config.vocab_size = V_WIDE
    model = model.to(torch.bfloat16)
    tmp = work / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    widen_tokenizer(TINY_DIR, tmp, V_WIDE)
    for f in ("generation_config.json",):
        if (TINY_DIR / f).exists():
            shutil.copy(TINY_DIR / f, tmp / f)
    (tmp / "DERIVED.json").write_text(json.dumps({"from": "builtin:tiny", "vocab_size": V_WIDE, "pool": int(len(pool)),
                                                  "noise": NOISE}))
    os.replace(tmp, out)
    return out


def store_bytes(run: Path) -> int:
    """Bytes of a RUN's row data: its chunk data files plus, for a hidden run, the head."""
    man = json.loads((run / "manifest.json").read_text())
    total = sum((run / "chunks" / c["data"]).stat().st_size for c in man["chunks"])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--positions", default="sample:0.25")
    ap.add_argument("--specs", default=";".join(SPECS), help="compact specs, ';'-separated")
    ap.add_argument("--ladder", default=",".join(LADDER))
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    specs = [s for s in args.specs.split(";") if s]
    ladder = [q for q in args.ladder.split(",") if q]

    t = time.perf_counter()
    model = build_model(work)
    from logitdiff.quantize import build_ladder

    paths = build_ladder(model, work / "ggufs", ladder)
    print(json.dumps({"step": "model+ladder", "s": round(time.perf_counter() - t, 1)}), flush=True)

    refs = {"full": work / "ref-full", "hidden": work / "ref-hidden"}
    refs.update({s: work / ("ref-" + s.replace(":", "_").replace(",", "_").replace("=", "")) for s in specs})
    timing = {}
    for store, path in refs.items():
        if not (path / "manifest.json").exists():
            timing[store] = cli("capture", f"hf:{model}", "--out", str(path), "--store", store, "--positions", args.positions)
            print(json.dumps({"step": f"capture ref {store}", "s": round(timing[store], 1)}), flush=True)
    for q in ladder:
        c = work / f"cand-{q}"
        if not (c / "manifest.json").exists():
            s = cli("capture", f"gguf:{paths[q]}", "--teacher", str(refs["full"]), "--out", str(c))
            print(json.dumps({"step": f"capture {q}", "s": round(s, 1)}), flush=True)

    n_pos = json.loads((refs["full"] / "manifest.json").read_text())["n_positions"]
    head_bytes = (refs["hidden"] / "head.npy").stat().st_size
    sizes = {store: store_bytes(path) / n_pos for store, path in refs.items()}
    results = {"n_positions": n_pos, "vocab_size": V_WIDE, "bytes_per_position": sizes, "hidden_head_bytes": head_bytes,
               "llamacpp_base_bytes_per_position": 2 * V_WIDE + 8, "rungs": {}}
    for q in ladder:
        row = {}
        for store, path in refs.items():
            out = work / f"cmp-{q}-{path.name}"
            if not (out / "report.json").exists():
                cli("compare", str(path), str(work / f"cand-{q}"), "--out", str(out))
            rep = json.loads((out / "report.json").read_text())
            s = rep["summary"]
            lo, hi = s.get("kl_lower_nats_mean"), s.get("kl_upper_nats_mean")
            row[store] = {"method": rep["method"]["kind"],
                          "kl_nats_mean": s["kl_nats_mean"], "kl_lower_nats_mean": lo, "kl_upper_nats_mean": hi}
        exact = row["full"]["kl_nats_mean"]
        for store, r in row.items():
            r["estimate_err"] = abs(r["kl_nats_mean"] - exact) / exact
            if r["kl_lower_nats_mean"] is not None:
                r["width_over_exact"] = (r["kl_upper_nats_mean"] - r["kl_lower_nats_mean"]) / exact
        results["rungs"][q] = row
        print(json.dumps({"rung": q, **{k: {kk: vv for kk, vv in v.items() if kk != "method"} for k, v in row.items()}}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))

    print(f"\nV = {V_WIDE:,}, {n_pos} positions; bytes per position (chunk files): "
          + ", ".join(f"{k} {v:,.0f}" for k, v in sizes.items()) + f"; hidden head {head_bytes:,} once")
    print("| store | " + " | ".join(ladder) + " |")
    print("|---|" + "---:|" * len(ladder))
    print("| exact mean KL (nats) | " + " | ".join(f"{results['rungs'][q]['full']['kl_nats_mean']:.3g}" for q in ladder) + " |")
    for store in refs:
        if store == "full":
            continue
        cells = []
        for q in ladder:
            r = results["rungs"][q][store]
            w = r.get("width_over_exact")
            cells.append(f"err {100 * r['estimate_err']:.2g} %" + (f", width {100 * w:.3g} %" if w is not None else ", exact"))
        print(f"| {store} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
