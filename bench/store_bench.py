"""Store sizes and bound widths: full (bf16), compact at several settings, topk:64 and
llama.cpp's base layout, on the bundled model's real rows (V = 4096) and on those rows
padded to V = 248,320; the interval widths and exact errors for the whole quant ladder;
write and read speed.

Needs full-logit captures of the reference and the ladder (teacher-forced):

    logitdiff capture builtin:tiny --out DIR/ref
    for q in Q8_0 Q6_K Q4_K_M IQ4_XS Q3_K_M Q2_K; do
        logitdiff capture builtin:tiny-$q --teacher DIR/ref --out DIR/$q; done
    python bench/store_bench.py DIR [--padded-rows 256] [--json out.json]

Padding (the bundled model's rows are 4096 wide): each real row keeps its 4096 logits and
gets 244,224 more, drawn as (row max) - TAIL_GAP + TAIL_STD * N(0, 1) — a long tail of tokens
the model never considers, as in a trained large-vocabulary model — and the candidate's
padded entries are the reference's plus its own logit noise (the standard deviation of the
candidate's row-centred logit difference on the real rows of that position). Seeded per row.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from logitdiff import bounds as B
from logitdiff import compact as C
from logitdiff.store import RunReader

LADDER = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")
V_BIG = 248_320
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
    from logitdiff import metrics as M

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

    from logitdiff.importers import read_kld_header, write_llamacpp_kld

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
    """Rows padded to V_BIG (see the module docstring)."""
    V = zr.shape[1]
    idx = np.linspace(0, zr.shape[0] - 1, n_rows).astype(int)
    big_r = np.empty((n_rows, V_BIG), np.float32)
    big_c = {q: np.empty((n_rows, V_BIG), np.float32) for q in cands}
    for j, i in enumerate(idx):
        rng = np.random.default_rng([seed, int(i)])
        tail = zr[i].max() - gap + std * rng.standard_normal(V_BIG - V)
        big_r[j, :V], big_r[j, V:] = zr[i], tail
        for q, zc in cands.items():
            d = zc[i].astype(np.float64) - zr[i]
            noise = (d - d.mean()).std()
            big_c[q][j, :V] = zc[i]
            big_c[q][j, V:] = tail + d.mean() + noise * rng.standard_normal(V_BIG - V)
    return big_r, big_c, idx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
                  "full_bf16_bytes": V_BIG * 2, "topk64_bytes": topk_bytes(V_BIG, 64, 256), "llamacpp_bytes": llamacpp_bytes(V_BIG),
                  "seed_topk64_ratio": seed_topk_err(big_r, lqs.get, big_c), "compact": {}}
    print(f"[V={V_BIG}] {a.padded_rows} padded rows, tail mass mean {tail_mass.mean():.3g}; bytes/position: full bf16 {V_BIG * 2}, "
          f"topk:64 {res['big']['topk64_bytes']:.0f}, llama.cpp base {llamacpp_bytes(V_BIG)}", flush=True)
    fw, fr = full_bf16_speed(big_r)
    res["big"]["full_bf16_write_s"], res["big"]["full_bf16_read_s"] = fw, fr
    print(f"[V={V_BIG}] peer: full bf16 chunk write {fw * 1e3:.2f} ms/pos, read {fr * 1e3:.2f} ms/pos", flush=True)
    for spec in filter(None, a.specs_big.split(";")):
        b, tw, tr, st = compact_eval(spec, big_r, y[idx], big_c, lqs.get, batch=16)
        res["big"]["compact"][spec] = {"bytes": b, "write_s": tw, "read_s": tr, "cands": st}
        print(f"[V={V_BIG}] {spec}: {b:.0f} B/pos, write {tw * 1e3:.1f} ms/pos, read {tr * 1e3:.2f} ms/pos", flush=True)
        for q, s in st.items():
            print(f"    {q:7s} exact {s['exact_mean']:.3g}  width {s['mean_width']:.3g} ({100 * s['width_over_mean_kl']:.2f} %)  "
                  f"coverage {100 * s['coverage']:.1f} %  estimate err {100 * s['estimate_rel_err_of_mean']:.2f} %", flush=True)
    res["load_end"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
