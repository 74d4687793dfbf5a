"""The compact reference store end to end: RunWriter/RunReader round trip, compare's method
dispatch, intervals in report.json / tokens.parquet / report.md / report.html, and the
bundled model's real rows (transformers BF16 reference, F32 candidate)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from scipy.special import log_softmax, rel_entr

from logitdiff.numerics import bounds as B
from logitdiff.store import compact as C
from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.store import RunItem, RunReader, RunWriter

V = 400
EPS = np.finfo(np.float64).eps


def make_run(path, logits_by_item, teacher_by_item, store="full"):
    w = RunWriter(path, source={"spec": f"test:{path.name}"}, vocab_size=V, tokenizer_hash="sha256:t", store=store,
                  chunk_rows=16, vocab=[f"t{i}" for i in range(V)])
    for iid, lg in logits_by_item.items():
        T = lg.shape[0]
        it = RunItem(id=iid, prompt_ids=[1, 2], teacher_ids=list(teacher_by_item[iid]), positions=list(range(T)))
        if w.kind.name == "compact":
            w.add(it, stored=C.encode(lg, it.next_tokens, w.kind.spec))
        elif w.kind.k:
            lp = log_softmax(lg.astype(np.float64), axis=1)
            ids = np.argsort(-lp, axis=1, kind="stable")[:, :w.kind.k]
            w.add(it, stored={"ids": ids, "logprobs": np.take_along_axis(lp, ids, 1)})
        else:
            w.add(it, logits=lg)
    w.finish()
    return path


@pytest.fixture
def runs(tmp_path):
    rng = np.random.default_rng(0)
    lens = {"a": 30, "b": 5, "c": 17}
    ref = {k: (rng.normal(0, 3, (n, V)) + 8 * (rng.random((n, V)) < 0.01)).astype(np.float32) for k, n in lens.items()}
    cand = {k: (v + rng.normal(0, 0.2, v.shape)).astype(np.float32) for k, v in ref.items()}
    teacher = {k: rng.integers(0, V, n) for k, n in lens.items()}
    return tmp_path, ref, cand, teacher


def exact_cols(ref, cand):
    lp = log_softmax(np.concatenate(list(ref.values())).astype(np.float64), 1)
    lq = log_softmax(np.concatenate(list(cand.values())).astype(np.float64), 1)
    p, q = np.exp(lp), np.exp(lq)
    m = (p + q) / 2
    tol = 64 * EPS * (1 + (p * np.abs(lp - lq)).sum(1) + (q * np.abs(lp - lq)).sum(1))
    return lp, lq, {"kl": rel_entr(p, q).sum(1), "kl_rev": rel_entr(q, p).sum(1),
                    "jsd": 0.5 * (rel_entr(p, m).sum(1) + rel_entr(q, m).sum(1))}, tol


@pytest.mark.parametrize("store", ["compact:exact=8,band=40", "compact:exact=16,band=64,bits=8", "compact:exact=400"])
def test_compact_run_round_trip_and_compare_intervals(runs, store):
    tmp, ref, cand, teacher = runs
    r = RunReader(make_run(tmp / "ref", ref, teacher, store=store))
    c = RunReader(make_run(tmp / "cand", cand, teacher))
    assert r.kind.spec == C.parse_spec(store) and r.manifest["settings"]["dtype"] is None
    assert all(ch["data"].endswith(C.CHUNK_SUFFIX) for ch in r.manifest["chunks"])
    with pytest.raises(LogitdiffError, match="compact reference"):
        r.logits(r.items()[0])
    comp = compare_runs(r, c, top_logprobs=5)
    assert comp.kind == "compact" and comp.method["bounds"] == B.METHOD_COMPACT
    lp, lq, ex, tol = exact_cols(ref, cand)
    col = comp.columns
    for name, d in (("kl", "kl"), ("kl_rev", "kl_rev"), ("jsd", "jsd")):
        lo, hi, mid = col[f"{name}_lower_nats"], col[f"{name}_upper_nats"], col[f"{name}_nats"]
        assert (lo <= ex[d] + tol).all() and (ex[d] <= hi + tol).all(), name
        assert (lo <= mid).all() and (mid <= hi).all()
    if store.endswith("exact=400"):  # everything exact: zero width, the exact value
        assert (col["kl_upper_nats"] == col["kl_lower_nats"]).all()
        np.testing.assert_allclose(col["kl_nats"], ex["kl"], rtol=1e-12, atol=1e-14)
    # exact columns of the reference: top-1 (flips), margin, teacher token, entropy
    y = np.concatenate([teacher[k] for k in ref])
    assert (col["top1_ref"] == lp.argmax(1)).all() and (col["top1_cand"] == lq.argmax(1)).all()
    np.testing.assert_allclose(col["p_ref_token"], np.exp(lp[np.arange(len(y)), y]), rtol=1e-12)
    np.testing.assert_allclose(col["entropy_ref"], -(np.exp(lp) * lp).sum(1), rtol=1e-10, atol=1e-13)
    top2 = -np.sort(-np.exp(lp), 1)[:, :2]
    np.testing.assert_allclose(col["margin_ref"], top2[:, 0] - top2[:, 1], rtol=1e-10, atol=1e-15)


def test_method_dispatch_refuses_mixtures(runs):
    tmp, ref, cand, teacher = runs
    rc = RunReader(make_run(tmp / "ref", ref, teacher, store="compact:exact=8,band=8"))
    cc = RunReader(make_run(tmp / "cc", cand, teacher, store="compact:exact=8,band=8"))
    ck = RunReader(make_run(tmp / "ck", cand, teacher, store="topk:8"))
    with pytest.raises(LogitdiffError, match="reference store"):
        compare_runs(rc, cc)
    with pytest.raises(LogitdiffError, match="no bounded method"):
        compare_runs(rc, ck)


def test_topk_compare_carries_intervals(runs):
    tmp, ref, cand, teacher = runs
    r = RunReader(make_run(tmp / "rk", ref, teacher, store="topk:16"))
    c = RunReader(make_run(tmp / "ck", cand, teacher, store="topk:16"))
    comp = compare_runs(r, c)
    assert comp.kind == "top_k" and comp.method["bounds"] == B.METHOD_TOPK and "inf" in comp.method["description"]
    _, _, ex, tol = exact_cols(ref, cand)
    col = comp.columns
    assert (col["kl_lower_nats"] <= ex["kl"] + tol).all() and np.isinf(col["kl_upper_nats"]).all()
    assert (col["jsd_lower_nats"] <= ex["jsd"] + tol).all() and (ex["jsd"] <= col["jsd_upper_nats"] + tol).all()
    out = tmp / "rep"
    assert main(["compare", str(tmp / "rk"), str(tmp / "ck"), "--out", str(out), "--bootstrap", "10"]) == 0
    md = (out / "report.md").read_text()
    assert "topk-bounded" in md and "inf (no finite upper bound" in md
    assert json.loads((out / "report.json").read_text())["summary"]["kl_upper_nats_mean"] is None  # inf
    assert "proven interval" in (out / "report.html").read_text()


def test_topk_compare_with_a_stated_logprob_floor(runs, capsys):
    """--logprob-floor: a true floor gives forward and reverse KL a finite upper bound that
    still covers the exact value; a statement a listed logprob disproves, one no
    distribution over V tokens can meet, or one for a comparison that needs none is a
    one-line error with nothing written."""
    tmp, ref, cand, teacher = runs
    make_run(tmp / "rk", ref, teacher, store="topk:16")
    make_run(tmp / "ck", cand, teacher, store="topk:16")
    lp, lq, ex, tol = exact_cols(ref, cand)
    floor = float(min(lp.min(), lq.min()))  # the tightest true floor of both models
    comp = compare_runs(RunReader(tmp / "rk"), RunReader(tmp / "ck"), logprob_floor=floor)
    col = comp.columns
    for name in ("kl", "kl_rev", "jsd"):
        lo, hi = col[f"{name}_lower_nats"], col[f"{name}_upper_nats"]
        assert np.isfinite(hi).all(), name
        assert (lo <= ex[name] + tol).all() and (ex[name] <= hi + tol).all(), name
    assert comp.method["logprob_floor_nats"] == floor and f"{floor:g}" in comp.method["description"]
    # a looser (lower) true floor: still covered, wider
    loose = compare_runs(RunReader(tmp / "rk"), RunReader(tmp / "ck"), logprob_floor=floor - 5).columns
    assert (loose["kl_upper_nats"] >= col["kl_upper_nats"]).all() and (loose["kl_upper_nats"] > col["kl_upper_nats"]).any()
    out = tmp / "rep"
    assert main(["compare", str(tmp / "rk"), str(tmp / "ck"), "--out", str(out), "--bootstrap", "10",
                 "--logprob-floor", repr(floor)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["method"]["logprob_floor_nats"] == floor and rep["schema_version"] >= "1.1"  # 1.1 added logprob_floor_nats
    assert rep["summary"]["kl_lower_nats_mean"] <= rep["summary"]["kl_nats_mean"] <= rep["summary"]["kl_upper_nats_mean"]
    html = (out / "report.html").read_text()
    assert "stated log-probability floor" in html and "· floor " in html  # header, and the cell with the interval
    assert f"{floor:g}" in (out / "report.md").read_text()
    # one page of a floored and an unfloored report of the same pair: the header says they differ
    assert main(["compare", str(tmp / "rk"), str(tmp / "ck"), "--out", str(tmp / "rep0"), "--bootstrap", "10"]) == 0
    page = tmp / "both.html"
    assert main(["report", str(out), str(tmp / "rep0"), "--out", str(page)]) == 0
    assert "floors differ per report" in page.read_text()
    # statements that cannot hold
    listed = min(float(np.sort(lp, 1)[:, -16:].min()), float(np.sort(lq, 1)[:, -16:].min()))
    assert listed + 0.01 < -np.log(V)  # the fixture's lists reach below -ln V
    full_ref, full_cand = make_run(tmp / "fr", ref, teacher), make_run(tmp / "fc", cand, teacher)
    bad = [
        (["--logprob-floor", "0.5"], "finite negative"),
        (["--logprob-floor", "nan"], "finite negative"),
        (["--logprob-floor", "-1"], "above -ln V"),
        (["--logprob-floor", repr(listed + 0.01)], "is below --logprob-floor"),
    ]
    bad.append((["--logprob-floor", repr(floor)], "applies to top-K comparisons"))
    for extra, msg in bad:
        o = tmp / "bad"
        pair = (full_ref, full_cand) if msg.startswith("applies") else (tmp / "rk", tmp / "ck")
        capsys.readouterr()
        assert main(["compare", *map(str, pair), "--out", str(o), "--bootstrap", "10", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
        assert not o.exists(), extra
    # `run` refuses it before capturing anything when reference and candidates all give full logits
    capsys.readouterr()
    argv = ["run", "--candidate", "builtin:tiny-Q8_0", "--logprob-floor", "-40", "--out", str(tmp / "run-out")]
    assert main(argv) == 2 and not (tmp / "run-out").exists()
    assert "gives full logits" in capsys.readouterr().err
    from logitdiff.sources.base import RowKind
    from logitdiff.sources.registry import declared_row_kind

    assert declared_row_kind("openai:http://127.0.0.1:1") == RowKind.TOPK and declared_row_kind("hf:/m") == RowKind.FULL


def test_reports_show_interval_and_method(runs):
    tmp, ref, cand, teacher = runs
    make_run(tmp / "ref", ref, teacher, store="compact:exact=8,band=40")
    make_run(tmp / "cand", cand, teacher)
    out = tmp / "rep"
    assert main(["compare", str(tmp / "ref"), str(tmp / "cand"), "--out", str(out), "--bootstrap", "20"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["method"]["kind"] == "compact" and rep["method"]["bounds"] == B.METHOD_COMPACT
    s = rep["summary"]
    assert s["kl_lower_nats_mean"] <= s["kl_nats_mean"] <= s["kl_upper_nats_mean"]
    row = rep["rows"][0]
    assert row["kl_lower_nats"] <= row["kl_nats"] <= row["kl_upper_nats"]
    df = pd.read_parquet(out / "tokens.parquet")
    assert {"kl_lower_nats", "kl_upper_nats", "jsd_lower_nats", "jsd_upper_nats"} <= set(df.columns)
    md = (out / "report.md").read_text()
    assert "compact-bounded" in md and "interval" in md
    html = (out / "report.html").read_text()
    assert "compact-bounded" in html and "proven interval" in html


def test_bad_compact_specs_are_one_line_errors(tmp_path, capsys):
    for spec, needle in (("compact:exact=1", "exact must be"), ("compact:bits=12", "bits must be"), ("compact:foo=3", "expected compact")):
        with pytest.raises(LogitdiffError, match=needle):
            C.parse_spec(spec)


# ------------------------------------------------------------------------------------
# the bundled model's real rows
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rows():
    """Real rows of the bundled trained model: BF16 reference and F32 candidate (both
    transformers), teacher-forced on three bundled prompts."""
    from logitdiff.builtin import WORKLOAD
    from logitdiff.sources import open_source
    from logitdiff.workload import read_workload

    items = read_workload(WORKLOAD)[:3]
    ref = open_source("builtin:tiny")
    cand = open_source("builtin:tiny,dtype=float32")
    zr, zc, ys = [], [], []
    for it in items:
        ids = ref.render(it)
        gen = ref.generate(ids, 12)
        (a,) = ref.score_many([(ids, gen.token_ids)])
        (b,) = cand.score_many([(ids, gen.token_ids)])
        zr.append(np.asarray(a, np.float32))
        zc.append(np.asarray(b, np.float32))
        ys.append(np.asarray(gen.token_ids))
    return np.concatenate(zr), np.concatenate(zc), np.concatenate(ys)


@pytest.mark.parametrize("spec", ["compact:exact=16,band=128", "compact:exact=256,band=1024", "compact:exact=512,band=3584"])
def test_bundled_model_rows_are_covered(tiny_rows, spec):
    zr, zc, y = tiny_rows
    lp, lq = log_softmax(zr.astype(np.float64), 1), log_softmax(zc.astype(np.float64), 1)
    p, q = np.exp(lp), np.exp(lq)
    tol = 64 * EPS * (1 + (p * np.abs(lp - lq)).sum(1) + (q * np.abs(lp - lq)).sum(1))
    block = C.encode(zr, y, C.parse_spec(spec))
    res = B.compact_vs_full(C.decode(block), lq)
    ex = {"kl": rel_entr(p, q).sum(1), "kl_rev": rel_entr(q, p).sum(1), "jsd": 0.5 * (rel_entr(p, (p + q) / 2).sum(1) + rel_entr(q, (p + q) / 2).sum(1))}
    for d in B.DIVERGENCES:
        assert (res[d].lower <= ex[d] + tol).all() and (ex[d] <= res[d].upper + tol).all(), (spec, d)
    if spec.endswith("band=3584"):  # every entry stored: only the band's 16-bit step is left
        assert res["kl"].width.mean() <= 0.01 * ex["kl"].mean()


def test_merge_keeps_compact_rows(runs):
    from logitdiff.capture.shards import merge_runs

    tmp, ref, cand, teacher = runs
    store = "compact:exact=8,band=40"
    a = make_run(tmp / "a", {"a": ref["a"]}, teacher, store=store)
    b = make_run(tmp / "b", {k: ref[k] for k in ("b", "c")}, teacher, store=store)
    m = RunReader(merge_runs([a, b], tmp / "m"))
    assert m.store == store and [it.id for it in m.items()] == ["a", "b", "c"]
    for src in (RunReader(a), RunReader(b)):
        for it in src.items():
            got = m.compact_rows(next(x for x in m.items() if x.id == it.id))
            for k, v in src.compact_rows(it).items():
                np.testing.assert_array_equal(got[k], v)


def test_encode_reads_bf16_bits_like_float32():
    from logitdiff.store import bf16_to_f32, f32_to_bf16

    rng = np.random.default_rng(9)
    bits = f32_to_bf16(rng.normal(0, 3, (4, 200)).astype(np.float32))
    spec = C.parse_spec("compact:exact=8,band=32")
    a, b = C.encode(bits, None, spec), C.encode(bf16_to_f32(bits), None, spec)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_imported_llamacpp_base_is_compared_with_intervals(tmp_path):
    from logitdiff.store.importers import import_llamacpp_kld, write_llamacpp_kld

    rng = np.random.default_rng(11)
    n_chunk, n_ctx, Vb = 2, 10, 300
    z = (rng.normal(size=(n_chunk, n_ctx, Vb)) * 4).astype(np.float32)
    tokens = rng.integers(0, Vb, size=(n_chunk, n_ctx))
    write_llamacpp_kld(tmp_path / "base.kld", z, tokens)
    ref = RunReader(import_llamacpp_kld(tmp_path / "base.kld", tmp_path / "ref"))
    first = n_ctx // 2
    w = RunWriter(tmp_path / "cand", source={"spec": "test:cand"}, vocab_size=Vb, tokenizer_hash=None, store="full")
    zc_all = []
    for c, it in enumerate(ref.items()):
        zc = z[c, first:n_ctx - 1] + rng.normal(size=(n_ctx - 1 - first, Vb)).astype(np.float32) * 0.3
        zc_all.append(zc)
        w.add(RunItem(id=it.id, prompt_ids=it.prompt_ids, teacher_ids=it.teacher_ids, positions=it.positions), logits=zc)
    w.finish()
    comp = compare_runs(ref, RunReader(tmp_path / "cand"))
    assert comp.method["bounds"] == B.METHOD_LLAMACPP and "kl-divergence-base" in comp.method["description"]
    lp = log_softmax(z[:, first:n_ctx - 1].reshape(-1, Vb).astype(np.float64), 1)
    lq = log_softmax(np.concatenate(zc_all).astype(np.float64), 1)
    p, q = np.exp(lp), np.exp(lq)
    tol = 64 * EPS * (1 + (p * np.abs(lp - lq)).sum(1) + (q * np.abs(lp - lq)).sum(1))
    col = comp.columns
    for name, ex in (("kl", rel_entr(p, q).sum(1)), ("jsd", 0.5 * (rel_entr(p, (p + q) / 2).sum(1) + rel_entr(q, (p + q) / 2).sum(1))),
                     ("kl_rev", rel_entr(q, p).sum(1))):
        assert (col[f"{name}_lower_nats"] <= ex + tol).all() and (ex <= col[f"{name}_upper_nats"] + tol).all(), name
    assert np.isinf(col["kl_rev_upper_nats"]).all()


def test_topk_compare_at_k_equal_v_gives_the_exact_values(runs):
    """Two top-K RUNs with K = V (full served rows as lists): compare's top-K path gives the
    exact full-vocabulary KL, reverse KL and JSD, with zero-width intervals under a true floor."""
    tmp, ref, cand, teacher = runs
    r = RunReader(make_run(tmp / "rk", ref, teacher, store=f"topk:{V}"))
    c = RunReader(make_run(tmp / "ck", cand, teacher, store=f"topk:{V}"))
    lp, lq, ex, tol = exact_cols(ref, cand)
    comp = compare_runs(r, c, logprob_floor=float(min(lp.min(), lq.min())), chunk_bytes=1 << 16)  # several row blocks
    assert comp.kind == "top_k" and comp.method["top_logprobs"] == V
    col = comp.columns
    for name in ("kl", "kl_rev", "jsd"):
        np.testing.assert_allclose(col[f"{name}_lower_nats"], ex[name], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(col[f"{name}_upper_nats"], ex[name], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(col["kl_nats"], ex["kl"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("field,damage", [("band_gaps", "id"), ("exact_gaps", "id"), ("rest_mass", np.nan),
                                          ("band_mass", np.inf), ("exact_logits", np.nan), ("log_sum", -np.inf)])
def test_damaged_compact_chunk_is_a_one_line_error(tmp_path, field, damage):
    """A compact reference chunk with an id outside the vocabulary or a NaN/inf figure is
    refused on load, naming the file, the item and position and the field (it used to reach
    the kernel as a bare ValueError, or give NaN intervals without a word)."""
    import io

    rng = np.random.default_rng(8)
    ref = {"a": rng.normal(0, 3, (6, 400)).astype(np.float32)}
    teacher = {"a": rng.integers(0, 400, 6)}
    comp = make_run(tmp_path / "comp", ref, teacher, store="compact:exact=8,band=40")
    cand = make_run(tmp_path / "cand", {"a": ref["a"] + 0.1}, teacher)
    r = RunReader(comp)
    chunk = r.path / "chunks" / r.manifest["chunks"][-1]["data"]
    with np.load(chunk) as z:
        d = {k: z[k].copy() for k in z.files}
    if damage == "id":
        d[field] = d[field].astype(np.uint32)
        d[field][3, -1] += 400  # the row's last (largest) id moves past V
    else:
        d[field][3] = damage
    bio = io.BytesIO()
    np.savez_compressed(bio, **d)
    chunk.write_bytes(bio.getvalue())
    with pytest.raises(LogitdiffError) as ei:
        compare_runs(RunReader(comp), RunReader(cand))
    msg = str(ei.value)
    assert "\n" not in msg and str(chunk) in msg and "item 'a' output position 3" in msg, msg
    assert repr(field.replace("_gaps", "_ids")) in msg, msg
