"""Flip selection, re-synchronisation and classification on hand-made continuations.

Texts are "tokenized" one character per token, so positions are easy to read; every class
and every tool-call format is exercised."""

import json

import numpy as np
import pytest

from logitdiff.builtin.tasks import TOOLS_BY_NAME
from logitdiff.errors import LogitdiffError
from logitdiff.flips import Flip, classify, find_flips, margin_bucket, parse_select, resync, select_flips

TOOLS = [TOOLS_BY_NAME["get_weather"], TOOLS_BY_NAME["set_timer"]]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


def hermes(call):
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def outcome(ref_text, branch_text, item, sim=1.0, threshold=0.8, min_run=4):
    ref_ids, br_ids = [ord(c) for c in ref_text], [ord(c) for c in branch_text]
    t = next((i for i, (a, b) in enumerate(zip(ref_ids, br_ids)) if a != b), min(len(ref_ids), len(br_ids)))
    return classify(item=item, ref_ids=ref_ids, branch_ids=br_ids, position=t, ref_text=ref_text,
                    branch_text=branch_text, similarity=sim, threshold=threshold, min_run=min_run)


def test_resync():
    assert resync([1, 2, 3, 4, 5], [9, 2, 3, 4, 5], 3) == (1, 1, 4)
    assert resync([1, 2, 3, 4, 5], [9, 9, 9, 3, 4, 5], 3) == (3, 2, 3)
    assert resync([1, 2, 3], [7, 8, 9], 2) is None
    # shorter than the run: both ends identical counts, a partial end does not
    assert resync([5, 2], [6, 2], 4) == (1, 1, 1)
    assert resync([2], [2], 4) == (0, 0, 1)
    assert resync([5, 2, 3], [2], 4) is None
    assert resync([5, 2, 3], [2, 3], 4) == (0, 1, 2)
    assert resync(list(range(10)) + [99], [50, 99], 4) is None  # a shared last token of a long output is no re-join
    assert resync([], [], 4) is None


def test_recovered_and_meaning_changed_for_text():
    item = {"id": "p"}
    ref = "The cat sat on the mat and slept."
    rejoin = "The dog sat on the mat and slept."
    o, sig = outcome(ref, rejoin, item, sim=0.9)
    assert o == "recovered" and sig["resync_run"] >= 4 and sig["same_answer"]
    o, sig = outcome(ref, "The zebra ate all of my lunch today.", item, sim=0.3)
    assert o == "meaning_changed" and sig["resync_branch_offset"] is None
    o, _ = outcome(ref, "The kitten napped upon a rug.", item, sim=0.9)
    assert o == "benign"


def test_labelled_answers():
    item = {"id": "m", "expected": {"answer": "12"}}
    o, sig = outcome("12", "13", item)
    assert o == "meaning_changed" and sig["ref_answer"] == "12" and sig["branch_answer"] == "13"
    # numeric label: a different wording of the same number is the same answer
    item = {"id": "n", "expected": {"numeric": 12, "tol": 0.5}}
    o, sig = outcome("x = 12", "x equals 12", item, sim=0.9)
    assert sig["same_answer"] and o in ("recovered", "benign")
    o, _ = outcome("x = 12", "x equals 12", item, sim=0.1)
    assert o == "meaning_changed"  # same number but the text moved too far


@pytest.mark.parametrize(
    "branch, want",
    [
        (hermes(CALL), None),  # identical (no flip in practice) -> not a tool outcome
        (hermes({"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}), "tool_call_changed"),
        (hermes({"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}), "tool_call_changed"),
        # an argument name the function does not have breaks a real call (toolcalls.validate_call)
        (hermes({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}), "tool_call_malformed"),
        (hermes(CALL) + hermes({"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}), "tool_call_changed"),
        (hermes(CALL)[:-14], "tool_call_malformed"),  # truncated JSON / no closing tag
        (hermes({"name": "get_weather", "arguments": {"city": 7, "unit": "celsius"}}), "tool_call_malformed"),  # wrong type
        (hermes({"name": "get_weather", "arguments": {"city": "Paris"}}), "tool_call_malformed"),  # missing required
        (hermes({"name": "get_wether", "arguments": {"city": "Paris", "unit": "celsius"}}), "tool_call_malformed"),  # unknown fn
        ("I cannot call tools today.", "tool_call_malformed"),  # no call at all
    ],
)
def test_tool_call_outcomes(branch, want):
    item = {"id": "t", "tools": TOOLS, "expected": {"tool_call": CALL}}
    ref = hermes(CALL)
    if want is None:
        return
    o, sig = outcome(ref, branch, item, sim=0.95)
    assert o == want, sig
    assert sig["ref_call_valid"] is True
    assert sig["decided_by"]


@pytest.mark.parametrize(
    "branch",
    [
        "[TOOL_CALLS]" + json.dumps([CALL]),  # Mistral
        json.dumps({"name": "get_weather", "parameters": CALL["arguments"]}),  # Llama-3 JSON
        "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": CALL["arguments"]}),
    ],
)
def test_same_call_in_other_formats_is_not_a_tool_failure(branch):
    item = {"id": "t", "tools": TOOLS, "expected": {"tool_call": CALL}}
    o, sig = outcome(hermes(CALL), branch, item, sim=0.95)
    assert o in ("recovered", "benign"), sig
    assert sig["branch_call_valid"]


def test_invalid_reference_call_falls_back_to_answers():
    item = {"id": "t", "tools": TOOLS, "expected": {"tool_call": CALL}}
    bad_ref = hermes({"name": "get_weather", "arguments": {"city": 1}})
    o, sig = outcome(bad_ref, hermes(CALL), item, sim=0.9)
    assert sig["ref_call_valid"] is False
    assert o == "meaning_changed"  # the branch made another (here: the right) call


def _cols():
    return {
        "item_id": np.array(["a", "a", "a", "b", "b", "c"], dtype=object),
        "position": np.array([0, 1, 2, 0, 1, 0]),
        "top1_match": np.array([True, False, False, False, True, True]),
        "top1_ref": np.array([1, 2, 3, 4, 5, 6]),
        "top1_cand": np.array([1, 9, 8, 7, 5, 6]),
        "p_top1_ref": np.array([0.9, 0.5, 0.6, 0.4, 0.9, 0.9]),
        "p_top1_cand": np.array([0.9, 0.5, 0.7, 0.5, 0.9, 0.9]),
        "margin_ref": np.array([0.8, 0.01, 0.3, 0.1, 0.8, 0.8]),
        "kl_nats": np.array([0.0, 0.2, 0.5, 0.1, 0.0, 0.0]),
    }


def test_selection_modes_and_budget():
    flips = find_flips(_cols(), {"a": ["math"]})
    assert [(f.item_id, f.position) for f in flips] == [("a", 1), ("a", 2), ("b", 0)]
    assert flips[0].tags == ["math"] and flips[0].p_cand == 0.5
    first, note = select_flips(flips, "first")
    assert [(f.item_id, f.position) for f in first] == [("a", 1), ("b", 0)]
    top, _ = select_flips(flips, "top-kl:1")
    assert [(f.item_id, f.position) for f in top] == [("a", 2)]
    low, _ = select_flips(flips, "low-margin:2")
    assert {(f.item_id, f.position) for f in low} == {("a", 1), ("b", 0)}
    s1, _ = select_flips(flips, "sample:2", seed=3)
    assert len(s1) == 2 and s1 == select_flips(flips, "sample:2", seed=3)[0]
    capped, note = select_flips(flips, "all", max_branches=2)
    assert {(f.item_id, f.position) for f in capped} == {("a", 2), ("a", 1)} and "capped" in note
    big, note = select_flips(flips, "all", max_branches=100)  # a budget larger than the flips is fine
    assert len(big) == 3 and "3 of 3" in note
    assert select_flips([], "first")[0] == []


@pytest.mark.parametrize("bad", ["top-kl", "top-kl:0", "sample:x", "worst", "low-margin:-2"])
def test_bad_select(bad):
    with pytest.raises(LogitdiffError, match="--select"):
        parse_select(bad)


def test_margin_buckets():
    assert margin_bucket(0.0) == "[0,0.05)"
    assert margin_bucket(0.3) == "[0.2,0.5)"
    assert margin_bucket(1.0) == "[0.5,1]"


def test_executable_check_runs_both_calls(tmp_path):
    """A tools module: both calls really run (sandboxed) and their results are compared."""
    from pathlib import Path

    from logitdiff.consequences import _exec_checker

    impl = Path(__file__).parent / "data" / "tools_impl.py"
    check = _exec_checker({"tools_module": str(impl)}, timeout=5.0)
    item = {"id": "t", "tools": TOOLS, "expected": {"tool_call": CALL}}
    other = {"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}
    ref_ids = [ord(c) for c in hermes(CALL)]
    br = hermes(other)
    t = next(i for i, (a, b) in enumerate(zip(hermes(CALL), br)) if a != b)
    o, sig = classify(item=item, ref_ids=ref_ids, branch_ids=[ord(c) for c in br], position=t, ref_text=hermes(CALL),
                      branch_text=br, similarity=0.9, threshold=0.8, exec_check=check)
    assert o == "tool_call_changed"
    ex = sig["exec"]
    want = lambda city: sum(map(ord, city)) % 35  # noqa: E731 - what tools_impl.get_weather computes
    assert ex["ref"][0]["ok"] and ex["ref"][0]["value"]["temperature"] == want("Paris")
    assert ex["branch"][0]["value"]["temperature"] == want("Lima")
    assert ex["same_result"] is (want("Paris") == want("Lima"))


def test_broken_tools_module_is_refused_before_work(tmp_path):
    from pathlib import Path

    from logitdiff.consequences import _checked_items
    from logitdiff.store import RunItem

    broken = Path(__file__).parent / "data" / "toolexec_broken.py"
    it = RunItem(id="x", prompt_ids=[1], teacher_ids=[2], positions=[0], extra={"item": {"id": "x", "tools_module": str(broken)}})
    with pytest.raises(LogitdiffError, match="failed to import"):
        _checked_items([it])
    bad_schema = RunItem(id="y", prompt_ids=[1], teacher_ids=[2], positions=[0],
                         extra={"item": {"id": "y", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}})
    with pytest.raises(LogitdiffError, match="item 'y'.*not valid JSON Schema"):
        _checked_items([bad_schema])
