"""Quality gates: parsing, reading metrics out of report.json, fail-closed evaluation."""

import copy
import json

import pytest

from logitdiff.errors import LogitdiffError
from logitdiff.gates import METRICS, Gate, evaluate, metric_value, parse_gates

# The gate-relevant sections of a real report.json (`logitdiff run`, builtin:tiny vs its
# Q2_K GGUF, 68 items, flips and correctness on), trimmed to what gates read.
REAL = {
    "schema": "logitdiff.report/1",
    "summary": {
        "kl_nats_mean": 0.028858870190727477, "kl_nats_p95": 0.07487545996687463, "kl_nats_max": 2.055422647269395,
        "top1_disagreement": {"rate": 0.10546448087431694, "mismatches": 193, "ci95": [0.08376642613607925, 0.12654283776543598]},
        "ppl_ratio": 1.0451556980655374,
        "kl_mean_x_noise_floor": None,  # the reference's rerun is bit-identical: the floor is 0
        "noise_floor": {"spec": "builtin:tiny", "kl_nats_mean": 0.0, "kl_nats_max": 0.0, "top1_disagreement": 0.0, "top1_flips": 0, "positions": 1830},
        "metrics": {
            "kl_nats": {"mean": 0.028858870190727477, "p95": 0.07487545996687463, "p99": 0.2572089350887027, "max": 2.055422647269395},
            "kl_rev_nats": {"mean": 0.03087795234588471, "p95": 0.07470102637116537, "p99": 0.32489982411449264, "max": 2.9131390588913115},
            "jsd_nats": {"mean": 0.006931526747970643, "p95": 0.01826154244509399, "p99": 0.06935734067045146, "max": 0.4544933472645107},
        },
    },
    "flips": {
        "n_flips": 193, "flip_rate": 0.10546448087431694, "n_branches": 24,
        "outcomes": {"recovered": 10, "benign": 0, "meaning_changed": 13, "tool_call_malformed": 0, "tool_call_changed": 1},
        "rates": {"recovered": 0.4166666666666667, "benign": 0.0, "meaning_changed": 0.5416666666666666, "tool_call_malformed": 0.0,
                  "tool_call_changed": 0.041666666666666664},
    },
    "correctness": {
        "n_labelled": 40, "accuracy_ref": 0.65, "accuracy_cand": 0.575, "accuracy_diff": -0.07500000000000007, "right_to_wrong": 5,
        "wrong_to_right": 2, "mcnemar_p": 0.453125, "tool_call_valid_ref": 0.6666666666666666, "tool_call_valid_cand": 0.6666666666666666,
        "n_tool_items": 12,
    },
}

EXPECTED = {
    "kl_mean": 0.028858870190727477, "kl_p95": 0.07487545996687463, "kl_p99": 0.2572089350887027, "kl_max": 2.055422647269395,
    "kl_rev_mean": 0.03087795234588471, "jsd_mean": 0.006931526747970643, "top1_disagreement": 0.10546448087431694,
    "ppl_ratio": 1.0451556980655374, "x_noise_floor": None, "flips": 193,
    "recovered": 10, "benign": 0, "meaning_changed": 13, "tool_call_malformed": 0, "tool_call_changed": 1,
    "recovered_rate": 0.4166666666666667, "benign_rate": 0.0, "meaning_changed_rate": 0.5416666666666666,
    "tool_call_malformed_rate": 0.0, "tool_call_changed_rate": 0.041666666666666664,
    "accuracy_ref": 0.65, "accuracy_cand": 0.575, "accuracy_drop": 0.075, "right_to_wrong": 5, "wrong_to_right": 2,
    "tool_call_valid_cand": 0.6666666666666666,
}


def test_every_metric_is_read_from_the_real_report():
    assert set(METRICS) == set(EXPECTED)
    for name, want in EXPECTED.items():
        got = metric_value(REAL, name)
        if want is None:
            assert got is None, name
        else:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), name
    # Every description is one line and says where in report.json the value comes from.
    for name, desc in METRICS.items():
        assert "\n" not in desc and "[report.json " in desc, name
    assert "summary.metrics.kl_nats.mean" in METRICS["kl_mean"] and "flips.outcomes.meaning_changed" in METRICS["meaning_changed"]
    assert "summary.kl_mean_x_noise_floor" in METRICS["x_noise_floor"] and "correctness.accuracy_ref" in METRICS["accuracy_drop"]


def test_outcome_metrics_follow_flips_py():
    from logitdiff.flips import OUTCOMES

    for o in OUTCOMES:
        assert o in METRICS and f"{o}_rate" in METRICS


def test_metrics_fall_back_to_flat_summary_fields():
    rep = {"summary": {"kl_nats_mean": 0.5, "kl_nats_p95": 1.5, "kl_nats_max": 3.0}}
    assert (metric_value(rep, "kl_mean"), metric_value(rep, "kl_p95"), metric_value(rep, "kl_max")) == (0.5, 1.5, 3.0)
    assert metric_value(rep, "kl_p99") is None


def test_parse_gates_whitespace_and_operators():
    gates = parse_gates(" kl_mean > 0.05 ,top1_disagreement>=2e-2,\ttool_call_malformed>0 , accuracy_drop<= -0.5,kl_max<1,")
    assert gates == [
        Gate("kl_mean", ">", 0.05, "kl_mean>0.05"),
        Gate("top1_disagreement", ">=", 0.02, "top1_disagreement>=2e-2"),
        Gate("tool_call_malformed", ">", 0.0, "tool_call_malformed>0"),
        Gate("accuracy_drop", "<=", -0.5, "accuracy_drop<=-0.5"),
        Gate("kl_max", "<", 1.0, "kl_max<1"),
    ]
    assert parse_gates("") == [] and parse_gates(" , ") == []


@pytest.mark.parametrize("text, clause, why", [
    ("kl_mean>0.05,kl_mena>0.1", "kl_mena>0.1", "unknown metric 'kl_mena'"),
    ("kl_mean=0.05", "kl_mean=0.05", "bad operator '='"),
    ("kl_mean=>0.05", "kl_mean=>0.05", "bad operator '=>'"),
    ("kl_mean!=0.05", "kl_mean!=0.05", "bad operator '!='"),
    ("kl_mean>>0.05", "kl_mean>>0.05", "bad operator '>>'"),
    ("kl_mean>abc", "kl_mean>abc", "not a finite number"),
    ("kl_mean>", "kl_mean>", "not a finite number"),
    ("kl_mean>nan", "kl_mean>nan", "not a finite number"),
    ("kl_mean>inf", "kl_mean>inf", "not a finite number"),
    ("kl_mean>0.05 0.1", "kl_mean>0.05 0.1", "not a finite number"),
    ("kl_mean 0.05", "kl_mean 0.05", "expected METRIC OP NUMBER"),
    (">0.05", ">0.05", "expected METRIC OP NUMBER"),
])
def test_parse_errors_name_the_clause_and_list_the_metrics(text, clause, why):
    with pytest.raises(LogitdiffError) as e:
        parse_gates(text)
    msg = str(e.value)
    assert "\n" not in msg
    assert repr(clause) in msg and why in msg
    assert "known metrics: " in msg and all(m in msg for m in METRICS)


def test_evaluate_real_report():
    gates = parse_gates("kl_mean>0.05, top1_disagreement>0.02, tool_call_malformed>0, meaning_changed_rate>0.5, "
                        "accuracy_drop>=0.05, tool_call_valid_cand<0.9, ppl_ratio>1.1")
    res = evaluate(REAL, gates)
    assert res["passed"] is False
    assert res["crossed"] == ["top1_disagreement>0.02", "meaning_changed_rate>0.5", "accuracy_drop>=0.05", "tool_call_valid_cand<0.9"]
    first = res["gates"][0]
    assert first == {"gate": "kl_mean>0.05", "metric": "kl_mean", "op": ">", "threshold": 0.05, "value": pytest.approx(0.028858870190727477),
                     "crossed": False, "missing": False}
    assert [g["gate"] for g in res["gates"]] == [g.text for g in gates]
    assert not any(g["missing"] for g in res["gates"])
    json.dumps(res, allow_nan=False)  # goes into report.json as is
    assert evaluate(REAL, parse_gates("kl_mean>0.05,tool_call_malformed>0"))["passed"] is True
    assert evaluate(REAL, []) == {"gates": [], "crossed": [], "passed": True}


def test_missing_metrics_fail_closed():
    bare = {"summary": copy.deepcopy(REAL["summary"])}  # no flips, no correctness section
    gates = parse_gates("kl_mean>1, meaning_changed>100, accuracy_drop>0.5, x_noise_floor>1000, flips>1000")
    res = evaluate(bare, gates)
    by = {g["gate"]: g for g in res["gates"]}
    assert by["kl_mean>1"]["crossed"] is False and by["kl_mean>1"]["missing"] is False
    for text in ("meaning_changed>100", "accuracy_drop>0.5", "x_noise_floor>1000", "flips>1000"):
        assert by[text] == {**by[text], "value": None, "missing": True, "crossed": True}, text
    assert res["crossed"] == ["meaning_changed>100", "accuracy_drop>0.5", "x_noise_floor>1000", "flips>1000"]
    assert res["passed"] is False
    # Half of accuracy_drop is not enough; nulls, NaN, strings and booleans are missing too.
    half = {"correctness": {"accuracy_ref": 0.5, "accuracy_cand": None}}
    assert metric_value(half, "accuracy_drop") is None
    for junk in (None, float("nan"), float("inf"), "0.1", True):
        assert metric_value({"summary": {"ppl_ratio": junk}}, "ppl_ratio") is None, junk
    with pytest.raises(LogitdiffError):
        metric_value(REAL, "nope")


def test_rates_without_any_flip_are_zero_not_missing():
    # flips.py writes rates as null when nothing branched; with no top-1 flip at all no
    # branch could have had any outcome, so the rate is 0. With flips but no branches, it stays unknown.
    none = {"flips": {"n_flips": 0, "n_branches": 0, "outcomes": {"meaning_changed": 0}, "rates": {"meaning_changed": None}}}
    assert metric_value(none, "meaning_changed_rate") == 0.0
    assert evaluate(none, parse_gates("meaning_changed_rate>0"))["passed"] is True
    unbranched = {"flips": {"n_flips": 5, "n_branches": 0, "outcomes": {"meaning_changed": 0}, "rates": {"meaning_changed": None}}}
    assert metric_value(unbranched, "meaning_changed_rate") is None
    assert evaluate(unbranched, parse_gates("meaning_changed_rate>0"))["crossed"] == ["meaning_changed_rate>0"]


@pytest.mark.parametrize("op, value, crossed", [
    (">", 0.05, False), (">=", 0.05, True), ("<", 0.05, False), ("<=", 0.05, True),
    (">", 0.0500001, True), ("<", 0.0499999, True), (">=", 0.0499999, False), ("<=", 0.0500001, False),
])
def test_boundary(op, value, crossed):
    rep = {"summary": {"metrics": {"kl_nats": {"mean": value}}}}
    res = evaluate(rep, parse_gates(f"kl_mean{op}0.05"))
    assert res["gates"][0]["crossed"] is crossed and res["passed"] is (not crossed)


def test_accuracy_drop_compares_as_written():
    # 0.5 - 0.45 is 0.04999999999999993 in floating point; the drop is rounded so that a
    # gate at exactly the observed drop is crossed by >= and not by >.
    rep = {"correctness": {"accuracy_ref": 0.5, "accuracy_cand": 0.45}}
    assert metric_value(rep, "accuracy_drop") == 0.05
    assert evaluate(rep, parse_gates("accuracy_drop>=0.05"))["passed"] is False
    assert evaluate(rep, parse_gates("accuracy_drop>0.05"))["passed"] is True
    assert metric_value({"correctness": {"accuracy_ref": 0.4, "accuracy_cand": 0.6}}, "accuracy_drop") == pytest.approx(-0.2)
