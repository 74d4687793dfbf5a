"""`topk-error` checks the proven intervals: coverage must be 100 % per K and per compact
store, on adversarial rows and on the bundled model's real quant ladder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from logitdiff.cli import main
from logitdiff.compare.topk_error import topk_error
from logitdiff.store import RunItem, RunReader, RunWriter

from test_bounds import adversarial_rows

COMPACT = ("compact:exact=4,band=16", "compact:exact=32,band=64,bits=8")


def write_full(path, rows_by_item, teacher_by_item, V):
    w = RunWriter(path, source={"spec": f"test:{path.name}"}, vocab_size=V, tokenizer_hash="sha256:t", store="full", dtype="float64")
    for iid, z in rows_by_item.items():
        w.add(RunItem(id=iid, prompt_ids=[1], teacher_ids=list(teacher_by_item[iid]), positions=list(range(len(z)))), logits=z)
    w.finish()
    return path


def assert_all_covered(res):
    for row in res["rows"]:
        for d, b in row["bounds"].items():
            assert b["coverage"] == 1.0, (row["k"], d, b)
    for c in res["compact"]:
        for d, b in c["bounds"].items():
            assert b["coverage"] == 1.0, (c["store"], d, b)
            assert b["lower_mean"] <= b["estimate_mean"] <= b["upper_mean"]


def adversarial_runs(tmp_path, V=300):
    """The adversarial rows of test_bounds as two full runs, one item per row: (rows, ref
    run, candidate run). Log-probabilities are valid logits (log_softmax of them is
    themselves)."""
    rows = adversarial_rows(V=V)
    ref = {name: lp[None].astype(np.float64) for name, lp, _ in rows}
    cand = {name: lq[None].astype(np.float64) for name, _, lq in rows}
    teacher = {name: [int(np.argmax(lp))] for name, lp, _ in rows}
    return rows, RunReader(write_full(tmp_path / "r", ref, teacher, V)), RunReader(write_full(tmp_path / "c", cand, teacher, V))


def test_topk_error_covers_adversarial_rows(tmp_path):
    rows, r, c = adversarial_runs(tmp_path)
    res = topk_error(r, c, [1, 4, 32], compact_specs=COMPACT)
    assert res["n"] == len(rows)
    assert_all_covered(res)
    # forward KL from top-K lists has no finite upper bound; JSD does
    assert all(row["bounds"]["kl"]["upper_mean"] == np.inf for row in res["rows"])
    assert all(np.isfinite(row["bounds"]["jsd"]["upper_mean"]) for row in res["rows"])


def test_topk_error_with_a_stated_floor(tmp_path, capsys):
    """The tightest true floor (the runs' lowest log-probability, which topk-error reports)
    makes every top-K forward and reverse KL upper bound finite, and they still cover the
    adversarial rows; a floor above it is refused, naming the run, item and position."""
    rows, r, c = adversarial_runs(tmp_path)
    from scipy.special import log_softmax

    # of the float32 rows topk-error compares (as a compact store keeps them)
    low = lambda x: float(log_softmax(x.astype(np.float32).astype(np.float64)).min())
    true_min = min(min(low(lp), low(lq)) for _, lp, lq in rows)
    res = topk_error(r, c, [1, 4, 32])
    assert res["exact"]["logprob_min"] == pytest.approx(true_min, abs=1e-9) and res["logprob_floor"] is None
    floor = res["exact"]["logprob_min"] - 1e-9
    res = topk_error(r, c, [1, 4, 32], logprob_floor=floor)
    assert_all_covered(res)
    for row in res["rows"]:
        assert np.isfinite(row["bounds"]["kl"]["upper_mean"]) and np.isfinite(row["bounds"]["kl_rev"]["upper_mean"]), row["k"]
    assert res["logprob_floor"] == floor
    worst = min(rows, key=lambda x: min(low(x[1]), low(x[2])))[0]
    capsys.readouterr()
    js = tmp_path / "floor.json"
    assert main(["topk-error", str(r.path), str(c.path), "--k", "4", "--logprob-floor", repr(true_min + 1e-3), "--json", str(js)]) == 2
    err = capsys.readouterr().err
    assert f"item {worst!r}" in err and "below --logprob-floor" in err and len(err.strip().splitlines()) == 1, err
    assert not js.exists()  # nothing written
    assert main(["topk-error", str(r.path), str(c.path), "--k", "4", "--logprob-floor", repr(floor)]) == 0
    assert "tightest true floor" in capsys.readouterr().out


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """Reference builtin:tiny (transformers BF16) on four bundled items, 16 tokens each, and
    three rungs of its real llama.cpp quant ladder, teacher-forced, full logits."""
    from logitdiff.builtin import WORKLOAD
    from logitdiff.workload import read_workload

    d = tmp_path_factory.mktemp("ladder")
    wl = d / "wl.jsonl"
    items = read_workload(WORKLOAD)
    wl.write_text("".join(json.dumps({**it.to_json(), "max_tokens": 16}) + "\n" for it in items[::12][:4]))
    assert main(["capture", "builtin:tiny", "--workload", str(wl), "--out", str(d / "ref")]) == 0
    for q in ("Q8_0", "Q4_K_M", "Q2_K"):
        assert main(["capture", f"builtin:tiny-{q}", "--reference", str(d / "ref"), "--out", str(d / q)]) == 0
    return d


def test_topk_error_covers_the_bundled_ladder(ladder, capsys):
    for q in ("Q8_0", "Q4_K_M", "Q2_K"):
        out = ladder / f"{q}.json"
        args = ["topk-error", str(ladder / "ref"), str(ladder / q), "--top-k", "8,64", "--json", str(out)]
        for spec in COMPACT + ("compact:exact=512,band=3584",):
            args += ["--compact", spec]
        assert main(args) == 0
        res = json.loads(out.read_text())
        assert_all_covered(res)
        # every entry stored (V = 4096): only the 16-bit band step is left
        full = res["compact"][-1]["bounds"]["kl"]
        assert full["width_over_exact_mean"] <= 0.01, (q, full)
    text = capsys.readouterr().out
    assert "proven intervals" in text and "coverage" in text


def test_capture_compact_and_compare_end_to_end(ladder):
    """`capture --store compact` of the reference (teacher-forced on its own run), then
    `compare` against a real quant: the method is named, every interval contains the value
    of the full/full comparison, top-1 and flips are the same."""
    import pandas as pd

    d = ladder
    assert main(["capture", "builtin:tiny", "--reference", str(d / "ref"), "--store", "compact:exact=64,band=512",
                 "--out", str(d / "refc")]) == 0
    assert RunReader(d / "refc").kind.spec is not None
    assert main(["compare", str(d / "refc"), str(d / "Q2_K"), "--out", str(d / "rep_c"), "--bootstrap", "10"]) == 0
    assert main(["compare", str(d / "ref"), str(d / "Q2_K"), "--out", str(d / "rep_f"), "--bootstrap", "10"]) == 0
    rep = json.loads((d / "rep_c" / "report.json").read_text())
    assert rep["method"]["bounds"] == "compact-bounded"
    a = pd.read_parquet(d / "rep_c" / "tokens.parquet")
    b = pd.read_parquet(d / "rep_f" / "tokens.parquet")
    tol = 1e-12 * (1 + b["kl_nats"].to_numpy())
    for name in ("kl", "kl_rev", "jsd"):
        ex = b[f"{name}_nats"].to_numpy()
        assert (a[f"{name}_lower_nats"].to_numpy() <= ex + tol).all() and (ex <= a[f"{name}_upper_nats"].to_numpy() + tol).all()
    assert (a["top1_ref"].to_numpy() == b["top1_ref"].to_numpy()).all()
    assert (a["top1_match"].to_numpy() == b["top1_match"].to_numpy()).all()
