"""`compare`: comparability checks, report.json / tokens.parquet / report.md contents."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy.special import log_softmax, rel_entr

from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.store import RunItem, RunReader, RunWriter

V = 300


def make_run(path, logits_by_item, teacher_by_item, *, tok_hash="sha256:t", vocab=V, store="full", tags=None, finish=True, dtype="float32",
             source=None, chunk_rows=16):
    w = RunWriter(path, source=source or {"spec": f"test:{path.name}"}, vocab_size=vocab, tokenizer_hash=tok_hash, store=store, dtype=dtype,
                  chunk_rows=chunk_rows, vocab=[f"t{i}" for i in range(vocab)])
    for iid, lg in logits_by_item.items():
        T = lg.shape[0]
        it = RunItem(id=iid, prompt_ids=[1, 2], teacher_ids=list(teacher_by_item[iid]), positions=list(range(T)), tags=(tags or {}).get(iid, []))
        if store == "full":
            w.add(it, logits=lg)
        else:
            k = int(store.split(":")[1])
            lp = log_softmax(lg.astype(np.float64), axis=1)
            ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
            w.add(it, stored={"ids": ids, "logprobs": np.take_along_axis(lp, ids, 1)})
    if finish:
        w.finish()
    else:
        w.flush()
    return path


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(0)
    lens = {"a": 40, "b": 3, "c": 12, "d": 7}
    ref = {k: rng.normal(0, 3, (n, V)).astype(np.float32) for k, n in lens.items()}
    cand = {k: (v + rng.normal(0, 0.4, v.shape)).astype(np.float32) for k, v in ref.items()}
    teacher = {k: rng.integers(0, V, n) for k, n in lens.items()}
    tags = {"a": ["code"], "b": ["math"], "c": ["code", "tool"], "d": []}
    r = make_run(tmp_path / "ref", ref, teacher, tags=tags)
    c = make_run(tmp_path / "cand", cand, teacher, tags=tags)
    return r, c, ref, cand, teacher, tmp_path


def test_report_numbers_match_scipy(pair):
    r, c, ref, cand, teacher, tmp = pair
    assert main(["compare", str(r), str(c), "--out", str(tmp / "rep"), "--bootstrap", "200"]) == 0
    rep = json.loads((tmp / "rep" / "report.json").read_text())
    assert set(rep) >= {"reference", "candidate", "method", "rows", "summary"}
    kls, t1 = [], []
    for iid in ref:
        lp = log_softmax(ref[iid].astype(np.float64), axis=1)
        lq = log_softmax(cand[iid].astype(np.float64), axis=1)
        kls.append(rel_entr(np.exp(lp), np.exp(lq)).sum(1))
        t1.append(lp.argmax(1) == lq.argmax(1))
    kls, t1 = np.concatenate(kls), np.concatenate(t1)
    s = rep["summary"]
    assert s["kl_nats_mean"] == pytest.approx(kls.mean(), rel=1e-9)
    assert s["kl_nats_max"] == pytest.approx(kls.max(), rel=1e-9)
    assert s["kl_nats_p95"] == pytest.approx(np.percentile(kls, 95), rel=1e-9)
    assert s["kl_bits_mean"] == pytest.approx(kls.mean() / np.log(2), rel=1e-9)
    assert s["top1_matches"] == int(t1.sum()) and s["top1_mismatches"] == int((~t1).sum())
    assert s["paired_prompts"] == 4 and s["positions"] == len(kls)
    lo, hi = s["metrics"]["kl_nats"]["ci95"]
    assert lo < kls.mean() < hi
    # Rows: seed fields + position + every metric.
    row = rep["rows"][0]
    for f in ("reference_top_mass", "reference_top_token", "reference_top_token_id", "candidate_top_mass", "candidate_top_token",
              "candidate_top_token_id", "kl_bits", "kl_nats", "shared_reference_mass", "shared_candidate_mass", "shared_tokens",
              "source_id", "top1_match", "position", "kl_rev_nats", "jsd_nats", "margin_ref", "p_ref_token", "delta_p",
              "nll_ref", "entropy_cand", "topk_overlap", "kl_topk_nats"):
        assert f in row, f
    assert [x["kl_nats"] for x in rep["rows"]] == pytest.approx(kls.tolist(), rel=1e-9)
    # Ranges [0,1) holds exactly one position per item.
    r01 = next(g for g in rep["ranges"] if g["group"] == "[0,1)")
    assert r01["n"] == 4
    assert r01["kl_nats"]["mean"] == pytest.approx(np.mean([kls[0], kls[40], kls[43], kls[55]]), rel=1e-9)
    tags = {g["group"]: g for g in rep["tags"]}
    assert tags["code"]["n"] == 52 and tags["math"]["n"] == 3 and tags["tool"]["n"] == 12
    assert len(rep["items"]) == 4


def test_parquet_matches_report(pair):
    r, c, *_, tmp = pair
    assert main(["compare", str(r), str(c), "--out", str(tmp / "rep"), "--bootstrap", "20"]) == 0
    df = pd.read_parquet(tmp / "rep" / "tokens.parquet")
    rep = json.loads((tmp / "rep" / "report.json").read_text())
    assert len(df) == rep["summary"]["positions"]
    assert df["kl_nats"].mean() == pytest.approx(rep["summary"]["kl_nats_mean"], rel=1e-12)
    assert (1 - df["top1_match"].mean()) == pytest.approx(rep["summary"]["top1_disagreement"]["rate"])
    by_item = df.groupby("item_id")["kl_nats"].mean()
    for it in rep["items"]:
        assert by_item[it["id"]] == pytest.approx(it["kl_nats"]["mean"], rel=1e-12)
    assert list(df.loc[df.item_id == "c", "tags"].iloc[0]) == ["code", "tool"]
    md = (tmp / "rep" / "report.md").read_text()
    assert "By output range" in md and "top-1 disagreement" in md


def test_self_compare_is_exactly_zero(pair):
    r, *_ , tmp = pair
    comp = compare_runs(RunReader(r), RunReader(r))
    assert np.all(comp.columns["kl_nats"] == 0) and np.all(comp.columns["jsd_nats"] == 0)
    assert comp.columns["top1_match"].all()


def test_token_lists_are_read_only_when_the_tokenizer_hashes_differ(pair, monkeypatch):
    """Equal tokenizer hashes settle the vocabulary: the V token strings of each side
    (tokens.json) are not parsed; different hashes read both lists (and refuse here)."""
    r, c, *_ = pair
    read = []
    real = RunReader.tokens
    monkeypatch.setattr(RunReader, "tokens", lambda self: read.append(self.path) or real(self))
    compare_runs(RunReader(r), RunReader(c))
    assert read == []
    cand = RunReader(c)
    cand.tokenizer_hash = "sha256:other"
    with pytest.raises(LogitdiffError):
        compare_runs(RunReader(r), cand)
    assert len(read) == 2


def test_the_vocabulary_is_read_only_when_a_token_text_is_wanted(pair, monkeypatch):
    """A comparison's figures need no token text: compare_runs parses no vocab.json (V
    strings of JSON a side); the first token text asked for (a report's token columns) reads
    the reference's, once, and the candidate's only when the reference has none."""
    r, c, *_ = pair
    read = []
    real = RunReader.vocab
    monkeypatch.setattr(RunReader, "vocab", lambda self: read.append(self.path) or real(self))
    comp = compare_runs(RunReader(r), RunReader(c))
    assert read == []
    assert [comp.token_text(t) for t in (5, 7, V, -1)] == ["t5", "t7", f"<{V}>", "<-1>"]
    assert read == [r]
    (r / "vocab.json").unlink()
    read.clear()
    comp = compare_runs(RunReader(r), RunReader(c))
    assert read == [] and comp.token_text(5) == "t5" and comp.vocab == [f"t{i}" for i in range(V)]
    assert read == [r, c]


def test_no_rows_and_ranges_option(pair):
    r, c, *_, tmp = pair
    assert main(["compare", str(r), str(c), "--out", str(tmp / "rep"), "--no-rows", "--ranges", "0,10", "--bootstrap", "10"]) == 0
    rep = json.loads((tmp / "rep" / "report.json").read_text())
    assert rep["rows"] == [] and rep["rows_omitted"] is True
    assert [g["group"] for g in rep["ranges"]] == ["[0,10)", "[10,inf)"]


def test_bootstrap_is_seeded(pair):
    r, c, *_, tmp = pair
    for out in ("r1", "r2"):
        assert main(["compare", str(r), str(c), "--out", str(tmp / out), "--bootstrap", "100", "--seed", "3"]) == 0
    a = json.loads((tmp / "r1" / "report.json").read_text())["summary"]["metrics"]["kl_nats"]["ci95"]
    b = json.loads((tmp / "r2" / "report.json").read_text())["summary"]["metrics"]["kl_nats"]["ci95"]
    assert a == b


def test_topk_compare_matches_full_at_large_k(tmp_path):
    rng = np.random.default_rng(1)
    ref = {"a": rng.normal(0, 3, (6, V)).astype(np.float32)}
    cand = {"a": (ref["a"] + rng.normal(0, 0.3, (6, V))).astype(np.float32)}
    teacher = {"a": rng.integers(0, V, 6)}
    r = make_run(tmp_path / "r", ref, teacher, store=f"topk:{V}")
    c = make_run(tmp_path / "c", cand, teacher, store=f"topk:{V}")
    comp = compare_runs(RunReader(r), RunReader(c))
    assert comp.kind == "top_k" and comp.method["top_logprobs"] == V
    lp = log_softmax(ref["a"].astype(np.float64), axis=1)
    lq = log_softmax(cand["a"].astype(np.float64), axis=1)
    np.testing.assert_allclose(comp.columns["kl_nats"], rel_entr(np.exp(lp), np.exp(lq)).sum(1), rtol=1e-9, atol=1e-12)
    # Top-K (K=8) against the full reference: seed method, mixed kinds.
    c8 = make_run(tmp_path / "c8", cand, teacher, store="topk:8")
    comp8 = compare_runs(RunReader(r), RunReader(c8))
    assert comp8.method["top_logprobs"] == 8 and comp8.method["description"].startswith("Approximate KL")
    assert np.all(comp8.columns["shared_tokens"] <= 8)


# ---------------------------------------------------------------------------- bad input
def _expect_error(args, capsys, *needles, out=None):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    if out is not None:
        assert not out.exists()


def test_vocab_mismatch(tmp_path, capsys):
    rng = np.random.default_rng(0)
    t = {"a": [1, 2]}
    r = make_run(tmp_path / "r", {"a": rng.normal(size=(2, V)).astype(np.float32)}, t)
    c = make_run(tmp_path / "c", {"a": rng.normal(size=(2, V + 1)).astype(np.float32)}, t, vocab=V + 1)
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "vocab", f"V={V + 1}", out=tmp_path / "rep")


def test_tokenizer_mismatch(tmp_path, capsys):
    rng = np.random.default_rng(0)
    t = {"a": [1, 2]}
    lg = rng.normal(size=(2, V)).astype(np.float32)
    r = make_run(tmp_path / "r", {"a": lg}, t)
    c = make_run(tmp_path / "c", {"a": lg}, t, tok_hash="sha256:other")
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "tokenizer", out=tmp_path / "rep")


def test_teacher_mismatch_names_item_and_position(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(5, V)).astype(np.float32)
    r = make_run(tmp_path / "r", {"a": lg, "b": lg}, {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 5]})
    c = make_run(tmp_path / "c", {"a": lg, "b": lg}, {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 9, 5]})
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "item 'b'", "position 3", out=tmp_path / "rep")


def test_missing_and_extra_items(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(2, V)).astype(np.float32)
    r = make_run(tmp_path / "r", {"a": lg, "b": lg}, {"a": [1, 2], "b": [1, 2]})
    c = make_run(tmp_path / "c", {"a": lg}, {"a": [1, 2]})
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "item 'b'", "missing")
    _expect_error(["compare", str(c), str(r), "--out", str(tmp_path / "rep")], capsys, "item 'b'", "not in the reference")


def test_nan_logits_name_item_and_position(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(4, V)).astype(np.float32)
    r = make_run(tmp_path / "r", {"a": lg, "b": lg}, {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    c = make_run(tmp_path / "c", {"a": lg, "b": lg}, {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    # Corrupt the candidate's stored logits after the fact (the writer refuses NaN).
    chunk = next((c / "chunks").glob("*.npy"))
    arr = np.load(chunk)
    arr[6, 10] = np.nan  # item b, position 2
    np.save(chunk, arr)
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "item 'b'", "position 2", "NaN", out=tmp_path / "rep")


def test_partial_run_refused_unless_allowed(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(2, V)).astype(np.float32)
    r = make_run(tmp_path / "r", {"a": lg}, {"a": [1, 2]})
    c = make_run(tmp_path / "c", {"a": lg}, {"a": [1, 2]}, finish=False)
    _expect_error(["compare", str(r), str(c), "--out", str(tmp_path / "rep")], capsys, "partial", out=tmp_path / "rep")
    assert main(["compare", str(r), str(c), "--out", str(tmp_path / "rep"), "--allow-partial", "--bootstrap", "10"]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert any("partial" in n for n in rep["method"]["notes"])


def test_failed_compare_keeps_previous_report(pair, capsys):
    r, c, *_, tmp = pair
    assert main(["compare", str(r), str(c), "--out", str(tmp / "rep"), "--bootstrap", "10"]) == 0
    before = (tmp / "rep" / "report.json").read_text()
    capsys.readouterr()
    _expect_error(["compare", str(r), str(tmp / "nope"), "--out", str(tmp / "rep")], capsys, "nope")
    assert (tmp / "rep" / "report.json").read_text() == before


def test_fail_on_gates_set_exit_status_and_report(pair, capsys):
    r, c, *_, tmp = pair
    rep_dir = tmp / "gated"
    # random logits: mean KL is large, so kl_mean>0.01 is crossed; jsd_mean>10 is not.
    code = main(["compare", str(r), str(c), "--out", str(rep_dir), "--bootstrap", "10", "--fail-on", "kl_mean>0.01, jsd_mean>10"])
    assert code == 3
    rep = json.loads((rep_dir / "report.json").read_text())
    assert rep["gates"]["crossed"] == ["kl_mean>0.01"] and not rep["gates"]["passed"]
    kl = pd.read_parquet(rep_dir / "tokens.parquet")["kl_nats"].mean()
    assert rep["gates"]["gates"][0]["value"] == pytest.approx(kl, rel=1e-12)
    assert "gates crossed: kl_mean>0.01" in (rep_dir / "report.md").read_text()
    assert "gate crossed" in capsys.readouterr().err
    assert main(["compare", str(r), str(c), "--out", str(rep_dir), "--bootstrap", "10", "--fail-on", "kl_mean>1e9"]) == 0
    # a gate on a metric this report lacks (no flips were run) is not evaluated: its own status, never "crossed"
    capsys.readouterr()
    assert main(["compare", str(r), str(c), "--out", str(rep_dir), "--bootstrap", "10", "--fail-on", "meaning_changed>0"]) == 4
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "gate not evaluated" in err and "no flips section" in err and "gate crossed" not in err
    assert main(["compare", str(r), str(c), "--out", str(rep_dir), "--fail-on", "kl_avg>1"]) == 2
    assert "kl_avg" in capsys.readouterr().err


def test_segments_summarised_from_teacher_text(tmp_path):
    vocab = ["<think>", "</think>", "<tool_call>", "</tool_call>", "x", " y", "{}", "<|im_end|>"]
    rng = np.random.default_rng(1)
    teacher = {"r": [0, 4, 5, 1, 5, 2, 6, 3, 7], "p": [4, 5, 4]}
    ref = {k: rng.normal(0, 2, (len(t), len(vocab))).astype(np.float32) for k, t in teacher.items()}
    cand = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) for k, v in ref.items()}

    def run(path, logits):
        w = RunWriter(path, source={"spec": "t"}, vocab_size=len(vocab), tokenizer_hash="h", vocab=vocab)
        for iid, lg in logits.items():
            w.add(RunItem(id=iid, prompt_ids=[4], teacher_ids=teacher[iid], positions=list(range(len(teacher[iid])))), logits=lg)
        w.finish()
        return path

    assert main(["compare", str(run(tmp_path / "a", ref)), str(run(tmp_path / "b", cand)), "--out", str(tmp_path / "rep"), "--bootstrap", "10"]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    df = pd.read_parquet(tmp_path / "rep" / "tokens.parquet")
    r = df[df.item_id == "r"].sort_values("position")
    assert list(r.segment) == ["think"] * 4 + ["answer"] + ["tool_call"] * 3 + ["answer"]
    assert (df[df.item_id == "p"].segment == "answer").all()
    seg = {g["group"]: g for g in rep["segments"]}
    for name, g in seg.items():
        sub = df[df.segment == name]
        assert g["n"] == len(sub)
        assert g["kl_nats"]["mean"] == pytest.approx(sub.kl_nats.mean(), rel=1e-12)
    assert "By segment" in (tmp_path / "rep" / "report.md").read_text()


def test_report_names_the_machine(pair):
    import os

    r, c, *_, tmp = pair
    assert main(["compare", str(r), str(c), "--out", str(tmp / "m"), "--bootstrap", "10"]) == 0
    rep = json.loads((tmp / "m" / "report.json").read_text())
    assert rep["machine"]["cpu_count"] == os.cpu_count() and rep["machine"]["python"]
    # the CPU's class (vendor, widest SIMD level): figures differ between classes (README, readme_figures)
    from logitdiff.report import cpu_class

    assert (rep["machine"]["cpu_class"], rep["machine"]["simd"]) == cpu_class()
    assert "compared on:" in (tmp / "m" / "report.md").read_text()
    assert "<th>machine</th>" in (tmp / "m" / "report.html").read_text() or ">machine<" in (tmp / "m" / "report.html").read_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compare_blocks_across_unaligned_chunks(tmp_path, dtype):
    """Two RUNs of the same rows in different chunk layouts (16 and 7 rows per chunk, items
    running across chunks) are paired as views cut at both layouts' boundaries and the block
    size (`store.aligned_blocks`); bf16 rows reach the kernel as stored bits. The per-row
    results equal one `full_vocab` call on all rows (per-row results do not depend on the
    blocking, and bf16 -> float32 is exact, so equality is exact)."""
    from logitdiff.numerics import metrics as M

    rng = np.random.default_rng(5)
    lens = {"a": 9, "b": 1, "c": 20, "d": 5}
    ref = {k: rng.normal(0, 3, (n, V)).astype(np.float32) for k, n in lens.items()}
    cand = {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in ref.items()}
    teacher = {k: rng.integers(0, V, n) for k, n in lens.items()}
    paths = []
    for name, rows, logits in (("ref", 16, ref), ("cand", 7, cand)):
        w = RunWriter(tmp_path / name, source={"spec": f"test:{name}"}, vocab_size=V, tokenizer_hash="sha256:t", dtype=dtype, chunk_rows=rows)
        for iid, lg in logits.items():
            w.add(RunItem(id=iid, prompt_ids=[1], teacher_ids=list(teacher[iid]), positions=list(range(len(lg)))), logits=lg)
        w.finish()
        paths.append(tmp_path / name)
    rr, rc = RunReader(paths[0]), RunReader(paths[1])
    comp = compare_runs(rr, rc, max_batch_rows=6, threads=2)
    zr = np.concatenate([rr.logits(it) for it in rr.items()])
    zc = np.concatenate([rc.logits(it) for it in rc.items()])
    assert zr.dtype == np.float32  # bf16 runs: the stored values, converted exactly
    want = M.full_vocab(zr, zc, np.concatenate([teacher[k] for k in lens]), k=10, top_k_out=64, threads=1)
    for f in ("kl_nats", "kl_rev_nats", "jsd_nats", "entropy_ref", "nll_cand", "top1_ref", "topk_overlap"):
        if dtype == "bfloat16" and comp.columns[f].dtype.kind == "f":
            # bf16 bits reach the kernel through torch, float32 rows (want) through numpy: the
            # same kernel, but the formulas after it use each library's log/log1p/exp, which may
            # differ by one ulp; the terms are < 100 nats, so at most ~3e-14 (metrics._full_vocab_numpy)
            np.testing.assert_allclose(comp.columns[f], want[f], rtol=0, atol=1e-12, err_msg=f)
        else:
            np.testing.assert_array_equal(comp.columns[f], want[f], err_msg=f)


@pytest.mark.parametrize("store", ["full", "topk:5"])
def test_zero_positions_give_a_null_report_with_its_reason(tmp_path, capsys, store):
    """Paired items with no scored position (every position excluded, empty outputs): a
    valid report (the writer validates it against the schema, tests/conftest.py) whose
    figures are null, never 0, with the reason in report.json, the console, report.md and the
    page; a gate on those figures is not evaluated, never passed or crossed."""
    empty = {"a": np.zeros((0, V), np.float32), "b": np.zeros((0, V), np.float32)}
    teacher: dict = {"a": [], "b": []}
    r = make_run(tmp_path / "ref", empty, teacher, store=store)
    c = make_run(tmp_path / "cand", empty, teacher, store=store)
    out = tmp_path / "rep"
    assert main(["compare", str(r), str(c), "--out", str(out), "--fail-on", "kl_mean>0.1"]) == 4  # 4: a gate not evaluated
    err = " ".join(capsys.readouterr().err.split())
    assert "no positions compared" in err and "gate not evaluated" in err and "Traceback" not in err
    rep = json.loads((out / "report.json").read_text())
    s = rep["summary"]
    assert s["positions"] == 0 and s["paired_prompts"] == 2
    for key in ("kl_nats_mean", "kl_nats_max", "kl_bits_mean", "top1_match_rate", "reference_top_mass_mean", "max_kl_source_id"):
        assert s[key] is None, key
    assert s["top1_disagreement"]["rate"] is None and s["top1_disagreement"]["ci95"] == [None, None]
    assert s["metrics"]["kl_nats"]["mean"] is None and s["metrics"]["kl_nats"]["n"] == 0
    assert any(n.startswith("no positions compared") for n in rep["method"]["notes"])
    assert rep["gates"]["crossed"] == [] and rep["gates"]["not_evaluated"]
    md = (out / "report.md").read_text()
    assert "no positions compared" in md.split("## Summary")[0]  # the verdict and the notes, above any table
    assert "item `None`" not in md
    assert "no positions compared" in (out / "report.html").read_text()
    assert len(pd.read_parquet(out / "tokens.parquet")) == 0
