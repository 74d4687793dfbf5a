"""Correctness per candidate, attributed (issue #37, point 2; issue #40's verdict line).

A real `logitdiff run` (the bundled model against its real llama.cpp Q2_K, on the bundled
workload's 40 labelled items, branches capped at 1 so some changed answers have no branch):
every attribution record in report.json is checked against a recomputation made here from
the RUN's stored top-1 columns (tokens.parquet), the free-running outputs (the reference RUN's
teacher ids, and the candidate's regenerated greedily) and flips.parquet. Then: the verdict
line of a report where only right→truncated occurred, the same counts on report.md, the page
and the terminal, and an older report migrated.
"""

import io
import json
import math
import re
from html import unescape

import pandas as pd
import pytest

from logitdiff import contracts as C
from logitdiff.builtin import WORKLOAD
from logitdiff.cli import main
from logitdiff.store import RunReader
from logitdiff.workload import read_workload

CAND = "builtin:tiny-Q2_K"
NAME = "tiny-Q2_K"
MAX_BRANCHES = 1


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attribution")
    wl = tmp / "labelled.jsonl"
    wl.write_text("".join(json.dumps(it.to_json()) + "\n" for it in read_workload(WORKLOAD) if it.expected is not None))
    out = tmp / "out"
    assert main(["run", "--candidate", CAND, "--floor", "none", "--no-noise-floor", "--bootstrap", "50", "--similarity", "edit",
                 "--max-branches", str(MAX_BRANCHES), "--workload", str(wl), "--out", str(out)]) == 0
    return out


def _tie(margin: float, p_top1: float) -> bool:
    """A tie at the reference, as docs/flips.md defines it: a margin within the bf16 spacing at p(top1)."""
    if not (math.isfinite(p_top1) and p_top1 > 0):
        return margin <= 0
    return margin <= 2.0 ** (math.floor(math.log2(min(p_top1, 1.0))) - 7)


def _first_flips(tok: pd.DataFrame) -> dict[str, pd.Series]:
    """The first teacher-forced top-1 flip per item, from the stored columns: the two top-1s
    differ, the candidate's is not the token the reference wrote, and it is not a tie."""
    flips = tok[~tok.top1_match & (tok.top1_cand != tok.token_id)]
    flips = flips[[not _tie(m, p) for m, p in zip(flips.margin_ref, flips.p_top1_ref)]]
    return {iid: g.sort_values("position").iloc[0] for iid, g in flips.groupby("item_id")}


def _directions(cr: pd.DataFrame) -> dict[str, str]:
    out = {}
    for r in cr.itertuples():
        if r.ref_correct and not r.cand_correct:
            out[r.item_id] = "right_to_truncated" if r.cand_verdict == "truncated" else "right_to_wrong"
        elif r.cand_correct and not r.ref_correct:
            out[r.item_id] = "wrong_to_right"
    return out


def test_records_match_a_recomputation_from_the_stored_columns(real_run):
    d = real_run / "reports" / NAME
    rep = C.load_report(d)
    c = rep["correctness"]
    records = c["attribution"]
    cr = pd.read_parquet(d / "correctness.parquet")
    tok = pd.read_parquet(d / "tokens.parquet")
    fl = pd.read_parquet(d / "flips.parquet")
    # one record per changed answer, in right->wrong, right->truncated, wrong->right order
    want = _directions(cr)
    assert want, "the Q2_K run changes no answer: nothing to attribute"
    assert [(r["item_id"], r["direction"]) for r in records] == sorted(want.items(), key=lambda kv: C.AnswerChange.ALL.index(kv[1]))
    for direction in C.AnswerChange.ALL:
        assert [r["item_id"] for r in records if r["direction"] == direction] == c[C.AnswerChange.ITEMS_FIELD[direction]]
    first = _first_flips(tok)
    ref = RunReader(rep["reference"]["path"])
    items = {it.id: it for it in ref.items()}
    from logitdiff.sources import open_source

    left_out = {(x["item_id"], x["position"]) for x in rep["flips"]["left_out"]["list"]}
    with open_source(CAND) as src:
        for r in records:
            iid, f = r["item_id"], first.get(r["item_id"])
            if f is None:
                assert r["first_flip"] is None and r["no_flip"].startswith("no teacher-forced flip on this item"), r
            else:
                ff = r["first_flip"]
                assert ff["position"] == f.position and ff["ref_token_id"] == f.top1_ref and ff["cand_token_id"] == f.top1_cand
                assert ff["kl_nats"] == f.kl_nats and ff["margin_ref"] == f.margin_ref
                assert ff["p_ref"] == f.p_top1_ref and ff["p_cand"] == f.p_top1_cand
                assert ff["ref_token"] == src.token_text(int(f.top1_ref)) and ff["cand_token"] == src.token_text(int(f.top1_cand))
            # the free-running outputs: the reference's is its teacher, the candidate's regenerated here
            it = items[iid]
            teacher = list(it.teacher_ids)
            budget = int(cr.set_index("item_id").loc[iid, "budget_tokens"])
            gen = list(src.generate(list(it.prompt_ids), budget).token_ids)
            div = next((k for k, (a, b) in enumerate(zip(teacher, gen)) if a != b), min(len(teacher), len(gen)))
            div = div if div < max(len(teacher), len(gen)) else None
            assert r["first_divergence"] == div, (iid, r["first_divergence"], div)
            assert r["divergence_at_first_flip"] == (None if f is None or div is None else div == f.position)
            # the branch at that flip (flips.parquet: item_id + position), or why none
            at = fl[(fl.item_id == iid) & (fl.position == (f.position if f is not None else -1))]
            if len(at):
                b = r["branch"]
                assert b["position"] == f.position and b["at_first_flip"] is True and r["not_branched"] is None
                assert b["outcome"] == at.outcome.iloc[0] and b["decided_by"] == at.decided_by.iloc[0]
            else:
                assert r["not_branched"], r
                if f is not None and (iid, int(f.position)) in left_out:
                    assert r["not_branched"] == f"not selected: left out by --max-branches {MAX_BRANCHES}"
                other = fl[fl.item_id == iid]
                assert (r["branch"] is None) == (len(other) == 0)
                if r["branch"] is not None:
                    assert r["branch"]["at_first_flip"] is False and r["branch"]["position"] in set(other.position)
    # the counts are the records counted
    a = c["attributed"]
    assert a == C.attributed_counts(records) and a["n"] == len(want)
    assert a["with_flip"] == sum(r["item_id"] in first for r in records)
    assert a["branched"] == sum(r["branch"] is not None for r in records) <= MAX_BRANCHES
    assert sum(a["outcomes"].values()) == a["branched"]
    # the cap left at least one changed answer's flip without a branch, said so
    if a["with_flip"] > MAX_BRANCHES:
        assert any(r["not_branched"] == f"not selected: left out by --max-branches {MAX_BRANCHES}" for r in records)
    assert c["measure"] == "accuracy" and c["benchmark"] is None  # a workload file, not a benchmark


def _terminal(summary, monkeypatch, capsys) -> str:
    from rich.console import Console

    import logitdiff.cli.run as cli_run

    monkeypatch.setattr(cli_run, "table_console", lambda width=400: Console(width=400))
    cli_run.print_run_summary(summary)
    return " ".join(capsys.readouterr().out.split())


def _page_verdict(page: str) -> str:
    li = re.search(r'<li data-name="[^"]+"><code>[^<]+</code> (.*?)</li>', page, re.S).group(1)
    return " ".join(unescape(re.sub(r"<[^>]+>", "", li)).split())


def test_the_same_counts_on_report_md_page_and_terminal(real_run, monkeypatch, capsys):
    d = real_run / "reports" / NAME
    rep = C.load_report(d)
    c = rep["correctness"]
    a = c["attributed"]
    n = {k: c[C.AnswerChange.COUNT_FIELD[k]] for k in C.AnswerChange.ALL}
    said = (f"{n['right_to_wrong']} right→wrong, " + (f"{n['right_to_truncated']} right→truncated, " if n["right_to_truncated"] else "")
            + f"{n['wrong_to_right']} wrong→right")
    counts = f"{a['with_flip']} of {a['n']} changed answers have a teacher-forced top-1 flip ({a['divergence_at_first_flip']} part there), {a['branched']} branched"
    md = " ".join((d / "report.md").read_text().split())
    page = (real_run / "report.html").read_text()
    verdict = _page_verdict(page)
    terminal = _terminal(C.load_summary(real_run), monkeypatch, capsys)
    for where, text in (("report.md", md), ("page", verdict), ("terminal", terminal)):
        assert said in text and counts in text, where
        assert f"McNemar p = {c['mcnemar_p']:.2g}" in text, where
        assert f"free-running accuracy {100 * c['accuracy_ref']:.1f} % [{100 * c['accuracy_ref_ci'][0]:.1f}–" in text, where
    # report.md's table: one row per record, its direction and first-flip position
    rows = [ln for ln in (d / "report.md").read_text().splitlines() if re.match(r"\| \S+ \| (right|wrong)→", ln)]
    assert [ln.split(" | ")[0].strip("| ") for ln in rows] == [r["item_id"] for r in c["attribution"]]
    for ln, r in zip(rows, c["attribution"]):
        cells = [x.strip() for x in ln.strip("|").split("|")]
        assert cells[1] == C.AnswerChange.ARROW[r["direction"]]
        assert cells[2] == (str(r["first_flip"]["position"]) if r["first_flip"] else "—")
    # the page: every changed item in the verdict line, linked to its branch's row where the page shows it
    for r in c["attribution"]:
        assert r["item_id"] in verdict
        b = r["branch"]
        shown = b is not None and any(t["item_id"] == r["item_id"] and t["position"] == b["position"] for t in rep["flips"]["top"])
        anchor = f'href="#flip-{NAME}-{r["item_id"]}-{b["position"]}"' if b else None
        assert (anchor is not None and anchor in page) == shown, r
        if shown:
            assert f'<tr id="flip-{NAME}-{r["item_id"]}-{b["position"]}">' in page
    # the terminal's table: the attributed cell
    assert f"{a['with_flip']}/{a['n']}, {a['branched']}" in terminal


def test_right_to_truncated_alone_is_a_change_in_every_verdict(real_run, monkeypatch, capsys):
    """Issue #40: "accuracy 50 % -> 25 %: no answer changed" while right -> truncated was listed.
    A real report whose only change is right -> truncated (its correctness section recomputed
    from its own rows with one candidate answer cut): report.md, the page and the terminal all
    say it, none says "no answer changed"."""
    from logitdiff.cli.run import print_verdicts
    from logitdiff.flips.consequences import Settings, correctness_section
    from logitdiff.pipeline import _summary_row
    from logitdiff.report.html import render_html
    from logitdiff.report.markdown import render_markdown
    from rich.console import Console

    d = real_run / "reports" / NAME
    rep = C.load_report(d)
    # the rows as run_correctness made them (a parquet column holds every row: tool-call fields only on tool items)
    rows = [{k: v for k, v in r.items() if v is not None or "tool_call" not in k}
            for r in pd.read_parquet(d / "correctness.parquet").to_dict("records")]
    for r in rows:  # no other change: the candidate answers as the reference did
        r.update(cand_correct=r["ref_correct"], cand_verdict=r["ref_verdict"], tags=list(r["tags"]))
    k = next(i for i, r in enumerate(rows) if r["ref_correct"])
    rows[k].update(cand_correct=False, cand_verdict="truncated", cand_cut=True)
    sec = correctness_section(rows, Settings(n_boot=50))
    assert (sec["right_to_wrong"], sec["right_to_truncated"], sec["wrong_to_right"]) == (0, 1, 0)
    assert sec["items_right_to_truncated"] == [rows[k]["item_id"]] and sec["accuracy_cand"] < sec["accuracy_ref"]
    sec["attribution"] = [{"item_id": rows[k]["item_id"], "direction": "right_to_truncated", "first_flip": None,
                           "no_flip": "no teacher-forced flip on this item", "first_divergence": None,
                           "divergence_at_first_flip": None, "branch": None, "not_branched": "no flip to branch"}]
    sec["attributed"] = C.attributed_counts(sec["attribution"])
    rep["correctness"] = sec
    C.validate(json.loads(C.report_json(rep)), "report")
    md = " ".join(render_markdown(rep).split())
    verdict = _page_verdict(render_html([rep], [None], paths=[d]))
    row = _summary_row(CAND, rep, d, None)
    con = Console(file=io.StringIO(), width=1000, record=True)
    print_verdicts({"candidates": [row]}, con)
    terminal = " ".join(con.export_text().split())
    for where, text in (("report.md", md), ("page", verdict), ("terminal", terminal)):
        assert "no answer changed" not in text, where
        assert "0 right→wrong, 1 right→truncated, 0 wrong→right" in text, (where, text)
        assert "0 of 1 changed answers have a teacher-forced top-1 flip (0 part there), 0 branched" in text, where
    assert f"| {rows[k]['item_id']} | right→truncated | — | no teacher-forced flip on this item |" in render_markdown(rep)


@pytest.mark.parametrize("counts, lists", [
    ((0, 0, 0), ([], [], [])), ((0, 1, 0), ([], ["a"], [])), ((1, 0, 0), (["a"], [], [])), ((0, 0, 1), ([], [], ["a"])),
    ((0, 0, 0), (["a"], [], [])), ((0, 0, 0), ([], ["a", "b"], [])),  # counts that lag their own lists: the lists count
])
def test_the_verdict_never_contradicts_the_items_it_lists(counts, lists):
    from logitdiff.report.verdict import answers_part

    c = {"accuracy_ref": 0.5, "accuracy_cand": 0.5, "mcnemar_p": 1.0, "n_labelled": 4}
    for field, n in zip(("right_to_wrong", "right_to_truncated", "wrong_to_right"), counts):
        c[field] = n
    for field, items in zip(("items_right_to_wrong", "items_right_to_truncated", "items_wrong_to_right"), lists):
        c[field] = items
    _, text = answers_part({"correctness": c})
    listed = any(lists) or any(counts)
    assert text.endswith("no answer changed") is (not listed), text
    for arrow, n, items in zip(("right→wrong", "right→truncated", "wrong→right"), counts, lists):
        if max(n, len(items)):
            assert f"{max(n, len(items))} {arrow}" in text, text
    # a share that moved with nothing counted (a summary row from before right->truncated was) is no "no answer changed"
    _, text = answers_part({"correctness": {"accuracy_ref": 0.5, "accuracy_cand": 0.25, "right_to_wrong": 0, "wrong_to_right": 0}})
    assert "no answer changed" not in text


def test_a_report_before_2_1_is_migrated(real_run, tmp_path):
    """A 2.0 report (no attribution, no measure): read with one record per listed change, the
    branch from flips.changed_items, the flip itself "not recorded"; valid against 2.2, and the
    verdict says the flips are not recorded rather than inventing counts."""
    from logitdiff.report.verdict import answers_part

    raw = json.loads((real_run / "reports" / NAME / "report.json").read_text())
    old = json.loads(json.dumps(raw))
    old["schema_version"] = "2.0"
    for k in ("attribution", "attributed", "measure", "benchmark"):
        old["correctness"].pop(k)
    (tmp_path / "report.json").write_text(json.dumps(old))
    doc = C.load_report(tmp_path)
    assert doc["schema_version"] == C.SCHEMA_VERSION
    C.validate(doc, "report")
    recs = doc["correctness"]["attribution"]
    assert [(r["item_id"], r["direction"]) for r in recs] == [(r["item_id"], r["direction"]) for r in raw["correctness"]["attribution"]]
    listed = {x["item_id"]: x for x in raw["flips"]["changed_items"]}
    for r in recs:
        assert r["first_flip"] is None and r["no_flip"] == C.NOT_RECORDED and r["first_divergence"] is None
        x = listed[r["item_id"]]
        assert (r["branch"] is not None) == x["branched"]
        if x["branched"]:
            assert (r["branch"]["position"], r["branch"]["outcome"]) == (x["position"], x["outcome"])
        else:
            assert r["not_branched"] == x["why_not"]
    a = doc["correctness"]["attributed"]
    assert a["with_flip"] is None and a["divergence_at_first_flip"] is None and a["branched"] == sum(x["branched"] for x in listed.values())
    _, text = answers_part(doc)
    assert "not recorded" in text and "have a teacher-forced top-1 flip" not in text
    # a report without correctness is left as it is; one with attribution is not touched
    assert C.migrate_report(json.loads(json.dumps(raw)))["correctness"]["attribution"] == raw["correctness"]["attribution"]
    bare = {k: v for k, v in old.items() if k != "correctness"}
    assert "correctness" not in C.migrate_report(bare)


def test_the_measure_is_named_by_the_workload():
    from logitdiff.report.verdict import answers_part
    from logitdiff.workload.benchmarks import benchmark_of

    assert benchmark_of("humaneval:40") == "humaneval" and benchmark_of("humaneval") == "humaneval"
    assert benchmark_of("bfcl:simple_python:3") == "bfcl:simple_python"
    for not_a_benchmark in (None, "", str(WORKLOAD), "builtin", "bfcl:no_such_category", "humaneval:x", "bfcl"):
        assert benchmark_of(not_a_benchmark) is None, not_a_benchmark
    c = {"accuracy_ref": 0.5, "accuracy_cand": 0.25, "right_to_wrong": 1, "wrong_to_right": 0, "mcnemar_p": 1.0,
         "accuracy_ref_ci": [0.15, 0.85], "accuracy_cand_ci": [0.05, 0.7]}
    assert answers_part({"correctness": {**c, "measure": "pass rate"}})[1].startswith("free-running pass rate 50.0 % [15.0–85.0 %] → 25.0 %")
    assert answers_part({"correctness": c})[1].startswith("free-running accuracy 50.0 % [15.0–85.0 %]")
