"""Speculation on vs off on llama-server, in generation mode.

    python bench/speculative_bench.py OUT [--items 32] [--tokens 256] [--drafts F32,Q8_0,Q2_K,ngram] [--floor-items 8]

The bundled model's F32 GGUF is the target on two one-slot llama-servers started here
(tests/servers.py flags: -np 1, -fa off, --no-repack, --cache-ram 0, 2 threads): the
reference without speculation, the candidate with ``--spec-type draft-simple -md
<rung>.gguf --spec-draft-n-max 3`` for each draft rung of the ladder (F32 = the target as its
own draft: the widest verify batches), or ``--spec-type ngram-simple``. For each candidate
``logitdiff.speculate`` runs the whole comparison (items x tokens, F0/F1 on --floor-items
items) and the bench records: verdict, identical-output rate, survival at t = 32/64/128/last,
F0/F1, prefix KL, acceptance rate, the servers' own generation time with and without
speculation, and the wall time of the comparison against the two generations it needs
(goal <= 1.3x). Writes OUT/<draft>/ (the speculate output) and OUT/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--drafts", default="F32,Q8_0,Q2_K,ngram")
    ap.add_argument("--floor-items", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=20)
    a = ap.parse_args()

    from servers import llama_server
    from logitdiff.api import speculate
    from logitdiff.builtin import WORKLOAD, gguf_path

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # the bundled workload, cycled to --items items
    rows = [json.loads(x) for x in WORKLOAD.read_text().splitlines() if x.strip()]
    wl = out / "workload.jsonl"
    with open(wl, "w") as f:
        for i in range(a.items):
            r = dict(rows[i % len(rows)])
            r["id"] = f"{r['id']}#{i}"
            f.write(json.dumps(r) + "\n")
    target = gguf_path("F32")
    logs = out / "logs"
    ref = llama_server(target, logs, parallel=1, threads=1).start()
    results = []
    try:
        for d in a.drafts.split(","):
            extra = ["--spec-type", "ngram-simple"] if d == "ngram" else \
                ["--spec-type", "draft-simple", "-md", str(gguf_path(d)), "--spec-draft-n-max", "3"]
            cand = llama_server(target, logs, parallel=1, threads=1, extra=extra).start()
            try:
                t0 = time.perf_counter()
                rep = speculate(ref.url, cand.url, out / d, workload=wl, n_predict=a.tokens, floor_items=a.floor_items, top_k=a.top_k)
                wall = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 (a refusal is a result too)
                results.append({"draft": d, "error": str(e)})
                print(f"{d}: {e}", flush=True)
                continue
            finally:
                cand.stop()
            s, f0, f1, t = rep["summary"], rep["floors"]["F0"], rep["floors"]["F1"], rep["timing"]
            rc, cc = rep["reference"]["counters"], rep["candidate"]["counters"]
            sv = rep["survival"]["candidate"]
            res = {
                "draft": d, "verdict": rep["verdict"]["label"], "defects": rep["verdict"]["defects"],
                "identical_output_rate": s["identical_output_rate"], "near_tie": s["near_tie_divergences"], "material": s["material_divergences"],
                "survival": {str(x): sv[min(x, len(sv) - 1)] for x in (32, 64, 128, len(sv) - 1)},
                "F1_survival_last": rep["survival"]["F1"][-1],
                "F0_reference_bit_identical": f0["reference"]["bit_identical"], "F0_candidate_bit_identical": f0["candidate"]["bit_identical"],
                "F1_max_abs_dlogprob": f1["max_abs_dlogprob"], "F1_kl_max": f1["kl_nats"]["max"], "F1_top1_flips": f1["top1_flips"],
                "F1_widths_seen": f1["widths_seen"],
                "prefix_positions": s["prefix"]["positions_compared"], "prefix_kl_max": s["prefix"]["kl_nats"]["max"],
                "acceptance_rate": cc["acceptance_rate"], "draft_n": cc["draft_n"],
                "candidate_not_reported": cc["positions_not_reported"], "positions": cc["positions"],
                "server_gen_s_reference": (rc["server_prompt_ms"] + rc["server_predicted_ms"]) / 1e3,
                "server_gen_s_candidate": (cc["server_prompt_ms"] + cc["server_predicted_ms"]) / 1e3,
                "wall_s": wall, "generations_s": t["generations_s"], "floors_s": t["floors_s"], "compare_s": t["compare_s"],
                "wall_over_generations": t["wall_over_generations"], "wall_over_server_generation": t["wall_over_server_generation"],
            }
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        ref.stop()
    print(table(results))
    (out / "bench.json").write_text(json.dumps({"items": a.items, "tokens": a.tokens, "floor_items": a.floor_items,
                                                "load": os.getloadavg(), "results": results}, indent=1) + "\n")


def table(results: list[dict]) -> str:
    """The markdown table of bench/RESULTS.md."""
    g = lambda x, f=".3g": "n/a" if x is None else format(x, f)
    lines = ["| draft | verdict | identical outputs | near-tie / material | survival t=32/64/128/last | F1 survival (last) | "
             "F0 ref / cand bit-identical | F1 max abs dlogprob | F1 KL max | prefix positions | prefix KL max | acceptance | "
             "not reported | server gen s (ref / cand) | wall s | wall / the two generations | wall / server gen |",
             "| --- " * 17 + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['draft']} | refused: {r['error']} |" + " |" * 15)
            continue
        sv = "/".join(g(v, ".2f") for v in r["survival"].values())
        lines.append(
            f"| {r['draft']} | {r['verdict']} | {100 * r['identical_output_rate']:.1f}% | {r['near_tie']} / {r['material']} | {sv} | "
            f"{g(r['F1_survival_last'], '.2f')} | {r['F0_reference_bit_identical']} / {r['F0_candidate_bit_identical']} | "
            f"{g(r['F1_max_abs_dlogprob'])} | {g(r['F1_kl_max'])} | {r['prefix_positions']} | {g(r['prefix_kl_max'])} | "
            f"{g(r['acceptance_rate'])} | {r['candidate_not_reported']}/{r['positions']} | {r['server_gen_s_reference']:.1f} / "
            f"{r['server_gen_s_candidate']:.1f} | {r['wall_s']:.1f} | {g(r['wall_over_generations'], '.2f')} | "
            f"{g(r['wall_over_server_generation'], '.2f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
