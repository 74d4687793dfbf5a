"""summary.json rows and summary.md of ``logitdiff run`` (pipeline._summary_row,
_cross_engine_floor, render_summary_md) on real reports, with and without the figures a
report may lack (JSON null): a candidate that scored no positions has no mean KL, no top-1
disagreement and no CI; one whose free-running answers had no labelled items has no
accuracy. Each undefined figure reads n/a, the defined ones keep their numbers, and the
summary stays valid against schemas/summary.schema.json (tests/conftest.py turns the
writers' validation on). No model: runs written with the store from numpy logits."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
from test_compare import make_run  # runs written with the store from numpy logits

from logitdiff.compare import compare_runs
from logitdiff.contracts import RUN_SUMMARY_SCHEMA, SUMMARY_SCHEMA_VERSION, summary_json
from logitdiff.pipeline import _cross_engine_floor, _summary_row, render_summary_md
from logitdiff.report import build_report
from logitdiff.store import RunReader
from logitdiff.numerics.summarize import describe

V = 32
LENS = {"a": 12, "b": 7, "c": 9}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Real reports of two candidates (small and large drift) against one reference."""
    tmp = tmp_path_factory.mktemp("summary")
    rng = np.random.default_rng(1)
    ref = {k: rng.normal(0, 3, (n, V)).astype(np.float32) for k, n in LENS.items()}
    teacher = {k: lg.argmax(1) for k, lg in ref.items()}
    ref_run = RunReader(make_run(tmp / "ref", ref, teacher, vocab=V))  # spec test:ref
    out = {}
    for name, s in (("Q8_0", 0.05), ("BF16", 0.01), ("Q2_K", 1.5)):
        cand = {k: (v + rng.normal(0, s, v.shape)).astype(np.float32) for k, v in ref.items()}
        rep, _ = build_report(compare_runs(ref_run, RunReader(make_run(tmp / name, cand, teacher, vocab=V))), n_boot=100)
        out[name] = rep
    return tmp, out


def _undefined(rep):
    """The report as a candidate without scored positions has it: every mean and CI null."""
    rep = copy.deepcopy(rep)
    s = rep["summary"]
    s["metrics"] = {k: describe(np.array([])) for k in s["metrics"]}
    s["top1_disagreement"] = None
    s.pop("ppl_ratio", None)
    rep["correctness"] = {"accuracy_ref": None, "accuracy_cand": None, "right_to_wrong": 0, "wrong_to_right": 0,
                          "mcnemar_p": None, "tool_call_valid_cand": None}
    return rep


def _summary(tmp, rows, noise, cross):
    return {"schema": RUN_SUMMARY_SCHEMA, "schema_version": SUMMARY_SCHEMA_VERSION, "reference": "test:ref", "workload": "w.jsonl",
            "workload_sha256": "0" * 64, "items": len(LENS), "positions": sum(LENS.values()), "noise_floor": noise,
            "cross_engine_floor": cross, "candidates": rows, "seconds": 0.0}


def _cells(md, spec):
    """The cells of the first table row of candidate ``spec`` in summary.md."""
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| `{spec}` |"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.parametrize("with_floor", [True, False])
def test_rows_without_figures_read_na(reports, with_floor):
    tmp, reps = reports
    noise = ({"spec": "test:ref", "rerun": "test rerun", "kl_nats_mean": 0.01, "kl_nats_max": 0.1, "top1_disagreement": 0.0,
              "top1_flips": 0, "positions": sum(LENS.values())} if with_floor else None)
    none_rep = _undefined(reps["Q2_K"])
    rows = [_summary_row(f"test:{n}", r, tmp / "reports" / n, noise) for n, r in (("Q8_0", reps["Q8_0"]), ("BF16", reps["BF16"]))]
    rows.append(_summary_row("test:none", none_rep, tmp / "reports" / "none", noise))
    cross = _cross_engine_floor(rows, "test:BF16")

    good, bf16, none = rows
    kl_good = reps["Q8_0"]["summary"]["metrics"]["kl_nats"]["mean"]
    kl_bf16 = reps["BF16"]["summary"]["metrics"]["kl_nats"]["mean"]
    assert cross == {"candidate": "test:BF16", "kl_nats_mean": kl_bf16}
    assert good["x_cross_engine_floor"] == pytest.approx(kl_good / kl_bf16) and bf16["x_cross_engine_floor"] == 1.0
    for key in ("kl_mean", "kl_p99", "kl_max", "kl_rev_mean", "jsd_mean", "top1_disagreement", "ppl_ratio", "x_noise_floor",
                "x_cross_engine_floor"):
        assert none[key] is None, key
    assert none["kl_mean_ci95"] == [None, None] and none["top1_disagreement_ci95"] == [None, None]
    assert none["within_2x_noise_floor"] is False
    if with_floor:
        assert good["x_noise_floor"] == pytest.approx(kl_good / 0.01)
        assert good["within_2x_noise_floor"] == (kl_good <= 0.02)
    # x_cross_engine_floor stays the last key of a row (summary.json's key order)
    assert list(good)[-1] == "x_cross_engine_floor" and list(none)[-1] == "x_cross_engine_floor"

    summary = _summary(tmp, rows, noise, cross)
    json.loads(summary_json(summary))  # valid against the schema with the nulls
    md = render_summary_md(summary)
    cells = _cells(md, "test:none")
    assert cells[1:] == ["n/a", "[n/a, n/a]", "n/a", "n/a", "n/a", "[n/a, n/a]", "n/a", "n/a", "n/a"]
    t1 = reps["Q8_0"]["summary"]["top1_disagreement"]
    g = _cells(md, "test:Q8_0")
    assert g[1] == format(kl_good, ".4g") and g[5] == f"{100 * t1['rate']:.2f} %"
    assert g[6] == f"[{100 * t1['ci95'][0]:.2f} %, {100 * t1['ci95'][1]:.2f} %]"
    # the consequences table: the row without labelled items reads n/a for accuracy and tool calls
    conseq = [ln for ln in md.splitlines() if ln.startswith("| `test:none` |")][1]
    assert re.search(r"\| n/a \| 0 \| 0 \| 0 \| n/a \| n/a \| n/a \|$", conseq), conseq  # right→truncated 0, attributed n/a


def test_floor_without_mean_gives_no_cross_engine_floor(reports):
    """A floor candidate without a mean KL is no floor: summary.json says null, not a null mean
    inside a floor (which the schema refuses), and no row gets a ratio."""
    tmp, reps = reports
    rows = [_summary_row("test:Q8_0", reps["Q8_0"], tmp / "reports" / "Q8_0", None),
            _summary_row("test:BF16", _undefined(reps["BF16"]), tmp / "reports" / "BF16", None)]
    assert _cross_engine_floor(rows, "test:BF16") is None
    assert [r["x_cross_engine_floor"] for r in rows] == [None, None]
    summary = _summary(tmp, rows, None, None)
    json.loads(summary_json(summary))
    assert "cross-engine floor" not in render_summary_md(summary).split("\n\n")[0]


def test_floor_is_the_named_spec_never_a_name_suffix(reports):
    """The floor is the row of the floor's spec (floors.choose_floor), whatever the names: a
    candidate named ...BF16 is not the floor unless it is that spec, and no floor spec, or one
    no row holds, gives none; summary.md then says why (cross_engine_floor_rule)."""
    tmp, reps = reports
    rows = [_summary_row("test:Q8_0", reps["Q8_0"], tmp / "reports" / "Q8_0", None),
            _summary_row("test:BF16", reps["BF16"], tmp / "reports" / "BF16", None),
            _summary_row("test:Q2_K", reps["Q2_K"], tmp / "reports" / "Q2_K", None)]
    kl = {n: reps[n]["summary"]["metrics"]["kl_nats"]["mean"] for n in ("Q8_0", "Q2_K")}
    cross = _cross_engine_floor(rows, "test:Q8_0")
    assert cross == {"candidate": "test:Q8_0", "kl_nats_mean": kl["Q8_0"]}
    assert rows[2]["x_cross_engine_floor"] == pytest.approx(kl["Q2_K"] / kl["Q8_0"]) and rows[0]["x_cross_engine_floor"] == 1.0
    for spec in (None, "test:absent"):
        assert _cross_engine_floor(rows, spec) is None
        assert [r["x_cross_engine_floor"] for r in rows] == [None, None, None]
    summary = _summary(tmp, rows, None, None)
    summary["cross_engine_floor_rule"] = "no automatic cross-engine floor for a served reference"
    json.loads(summary_json(summary))
    assert "- no cross-engine floor: no automatic cross-engine floor for a served reference" in render_summary_md(summary)
