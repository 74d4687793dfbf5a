"""The bundled default, end to end: `logitdiff run` with no arguments on the trained tiny
model, its real llama.cpp quant ladder and the bundled workload."""

import json
import os

import numpy as np
import pandas as pd
import pytest

from logitdiff.builtin import LADDER, TINY_DIR, WORKLOAD
from logitdiff.cli import main
from logitdiff.flips import LOCAL_TOKENS, MIN_JOINED_SHARE
from logitdiff.workload import read_workload


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "out"
    cache = os.environ.get("LOGITDIFF_CACHE")
    cwd = os.getcwd()
    os.chdir(out.parent)
    try:
        assert main(["run", "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    assert cache == os.environ.get("LOGITDIFF_CACHE")
    return out


def test_bundled_workload_is_complete():
    items = read_workload(WORKLOAD)
    assert len(items) >= 48
    tags = {t for it in items for t in it.tags}
    assert {"code", "prose", "math", "tool"} <= tags
    tool_items = [it for it in items if "tool" in it.tags]
    assert tool_items and all(it.tools and it.expected and "tool_call" in it.expected for it in tool_items)
    assert all(it.expected for it in items if "math" in it.tags)
    assert (TINY_DIR / "model.safetensors").stat().st_size + (TINY_DIR / "tokenizer.json").stat().st_size <= 25 * 2**20


def test_default_run_summary(default_run):
    s = json.loads((default_run / "summary.json").read_text())
    names = [c["name"] for c in s["candidates"]]
    assert names == ["tiny-BF16"] + [f"tiny-{q}" for q in LADDER]
    # The plain reference rerun is bit-identical on CPU, so the floor comes from a rerun with
    # other batch mates: BF16 rounding noise, far below every candidate, and x noise floor defined.
    nf = s["noise_floor"]
    assert "boundaries moved by 4" in nf["rerun"] and "plain rerun is bit-identical" in nf["rerun"]
    assert 0 < nf["kl_nats_mean"] < 1e-5 and nf["top1_disagreement"] == 0.0
    assert all(c["x_noise_floor"] == pytest.approx(c["kl_mean"] / nf["kl_nats_mean"], rel=1e-12) for c in s["candidates"])
    kl = {c["name"]: c["kl_mean"] for c in s["candidates"]}
    # The ladder is ordered.
    assert kl["tiny-BF16"] < kl["tiny-Q8_0"] < kl["tiny-Q4_K_M"] < kl["tiny-Q2_K"]
    for c in s["candidates"]:
        lo, hi = c["kl_mean_ci95"]
        assert lo <= c["kl_mean"] <= hi
        assert (default_run / "reports" / c["name"] / "report.json").exists()
    md = (default_run / "summary.md").read_text()
    assert "tiny-Q2_K" in md and "noise floor" in md


def test_default_reports_cross_checked_with_parquet(default_run):
    """Numbers in report.json recomputed independently from tokens.parquet with pandas."""
    for name in ("tiny-Q4_K_M", "tiny-Q2_K"):
        d = default_run / "reports" / name
        rep = json.loads((d / "report.json").read_text())
        df = pd.read_parquet(d / "tokens.parquet")
        assert len(df) == rep["summary"]["positions"] == len(rep["rows"])
        assert df["kl_nats"].mean() == pytest.approx(rep["summary"]["kl_nats_mean"], rel=1e-12)
        assert np.percentile(df["kl_nats"], 95) == pytest.approx(rep["summary"]["kl_nats_p95"], rel=1e-12)
        assert int((~df["top1_match"]).sum()) == rep["summary"]["top1_mismatches"]
        for g in rep["tags"]:
            sub = df[df["tags"].apply(lambda t: g["group"] in list(t))]
            assert len(sub) == g["n"]
            assert sub["kl_nats"].mean() == pytest.approx(g["kl_nats"]["mean"], rel=1e-12)
        for g in rep["ranges"]:
            lo, hi = g["group"].strip("[)").split(",")
            sub = df[(df.position >= int(lo)) & (df.position < (np.inf if hi == "inf" else int(hi)))]
            assert len(sub) == g["n"]
            if g["n"]:
                assert sub["kl_nats"].mean() == pytest.approx(g["kl_nats"]["mean"], rel=1e-12)
        assert rep["method"]["vocab_size"] == 4096
        assert rep["reference"]["spec"] == "builtin:tiny"


def test_cross_engine_f32_agreement(default_run, tmp_path):
    """transformers F32 vs llama.cpp F32 GGUF of the bundled weights over the bundled workload."""
    ref = default_run / "runs" / "reference"
    assert main(["capture", "builtin:tiny,dtype=float32", "--reference", str(ref), "--out", str(tmp_path / "hf32")]) == 0
    assert main(["compare", str(tmp_path / "hf32"), "builtin:tiny-F32", "--out", str(tmp_path / "rep"), "--bootstrap", "50"]) == 0
    s = json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]
    assert s["kl_nats_mean"] <= 1e-4
    assert s["top1_match_rate"] >= 0.995


# what a branch that did not come back does, by rule: a checker's bad verdict, or diverged
# (meaning not judged); the bundled default runs no judge
NOT_BACK = ("answer_changed", "tests_failed", "tool_call_malformed", "tool_call_changed", "diverged")


def tok_written(d, item_id, position):
    """The token the reference wrote at (item, position), from tokens.parquet."""
    tok = pd.read_parquet(d / "tokens.parquet", columns=["item_id", "position", "token_id"])
    return int(tok[(tok.item_id == item_id) & (tok.position == position)].token_id.iloc[0])


def test_default_run_flips_and_correctness(default_run):
    """Issue checks: Q2_K's flips do more damage than Q8_0's; the reference rerun has no flips;
    flips.parquet and correctness.parquet agree with report.json."""
    s = json.loads((default_run / "summary.json").read_text())
    assert s["noise_floor"]["top1_flips"] == 0
    rows = {c["name"]: c for c in s["candidates"]}
    bad = {n: sum(rows[n]["flip_outcomes"][o] for o in NOT_BACK) for n in rows}
    assert bad["tiny-Q2_K"] > bad["tiny-Q8_0"]
    for name in ("tiny-Q8_0", "tiny-Q2_K"):
        d = default_run / "reports" / name
        rep = json.loads((d / "report.json").read_text())
        f = rep["flips"]
        fl = pd.read_parquet(d / "flips.parquet")
        assert len(fl) == f["n_branches"] > 0
        # ties at the reference are flips of top-1 but not of the candidate: counted apart, not
        # branched; so are the positions where the candidate picked the token the reference
        # wrote although it is not the reference's own scored top-1
        sc = f["reference_self_consistency"]
        assert f["n_flips"] + f["n_ties"] + sc["n_candidate_wrote_it"] == rep["summary"]["top1_mismatches"]
        assert sc["n_written_not_top1"] >= sc["n_candidate_wrote_it"] >= 0
        assert all(r.cand_token_id != tok_written(d, r.item_id, r.position) for r in fl.itertuples())
        # every item whose answer changed has its flip branched, or is listed with the reason
        changed = set(rep["correctness"]["items_right_to_wrong"] + rep["correctness"]["items_wrong_to_right"]
                      + rep["correctness"]["items_right_to_truncated"])
        listed = {x["item_id"]: x for x in f["changed_items"]}
        assert changed <= set(listed)
        assert all(x["item_id"] in set(fl.item_id) for x in listed.values() if x["branched"])
        assert all(x["why_not"] for x in listed.values() if not x["branched"])
        assert not fl["tie"].any() and (fl["margin_ref"] > 0).all()
        assert fl["outcome"].value_counts().to_dict() == {k: v for k, v in f["outcomes"].items() if v}
        # every branch starts at a real flip of tokens.parquet, with the same KL
        tok = pd.read_parquet(d / "tokens.parquet").set_index(["item_id", "position"])
        for r in fl.itertuples():
            t = tok.loc[(r.item_id, r.position)]
            assert not t["top1_match"] and t["kl_nats"] == r.kl_nats and int(t["top1_cand"]) == r.cand_token_id
            assert json.loads(r.signals)["decided_by"] == r.decided_by
        c = rep["correctness"]
        cr = pd.read_parquet(d / "correctness.parquet")
        assert len(cr) == c["n_labelled"] == sum(1 for it in read_workload(WORKLOAD) if it.expected)
        assert cr["ref_correct"].mean() == pytest.approx(c["accuracy_ref"])
        assert cr["cand_correct"].mean() == pytest.approx(c["accuracy_cand"])
        assert int((cr.ref_correct & ~cr.cand_correct).sum()) == c["right_to_wrong"] + c["right_to_truncated"]
        assert int((cr.cand_verdict == "truncated").sum()) == c["truncated_cand"] <= c["cut_cand"]
        assert int((~cr.ref_correct & cr.cand_correct).sum()) == c["wrong_to_right"]
        assert 0.0 <= c["mcnemar_p"] <= 1.0
        md = (d / "report.md").read_text()
        assert "What the flips do" in md and "Correctness of free-running answers" in md
    assert "| diverged |" in (default_run / "summary.md").read_text()


def test_default_run_claims_no_meaning_without_a_judge(default_run):
    """With no --judge no report says benign or meaning_changed: not in report.json, report.md,
    either page's text, summary.json or summary.md (the classes are a judge's alone), and each
    says the meaning was not judged."""
    import re

    judged = re.compile(r"\bbenign\b|meaning[_ ]changed|changed (the )?meaning|means the same", re.I)
    texts = {"summary.json": (default_run / "summary.json").read_text(), "summary.md": (default_run / "summary.md").read_text(),
             "report.html": (default_run / "report.html").read_text()}
    for d in sorted((default_run / "reports").iterdir()):
        for f in ("report.json", "report.md", "report.html"):
            texts[f"{d.name}/{f}"] = (d / f).read_text()
        rep = json.loads((d / "report.json").read_text())
        if "flips" in rep:
            assert rep["flips"]["meaning_judged_by"] is None
            assert "meaning: not judged (no --judge)" in texts[f"{d.name}/report.md"]
            fl = pd.read_parquet(d / "flips.parquet")
            texts[f"{d.name}/flips.parquet"] = "\n".join(fl["outcome"]) + "\n".join(fl["decided_by"])
    for where, text in texts.items():
        m = judged.search(text)
        assert m is None, (where, text[max(0, m.start() - 200): m.end() + 200])
    assert "meaning not judged: no --judge" in texts["report.html"]


def test_default_run_recovered_means_recovered(default_run):
    """At most 5 % of the recovered branches end dissimilar to the reference (last
    third, difflib ratio < 0.5, computed here independently of the classifier), no branch at an
    exact tie is a flip outcome, and every recovered branch re-joined and stayed."""
    from difflib import SequenceMatcher

    def last_third_ratio(a, b):
        return SequenceMatcher(None, a[2 * len(a) // 3:], b[2 * len(b) // 3:], autojunk=False).ratio()

    n_rec = n_bad = 0
    for d in sorted((default_run / "reports").iterdir()):
        if not (d / "flips.parquet").exists():
            continue
        fl = pd.read_parquet(d / "flips.parquet")
        if not len(fl):
            continue
        assert not ((fl["margin_ref"] == 0) & ~fl["tie"]).any()
        rec = fl[fl.outcome == "recovered"]
        # joined for >= 80 % of the remainder, or (a short tail near the budget's end) all but
        # LOCAL_TOKENS of it: the remainder is at most the branch's tokens after the flip token
        local = (rec["branch_tokens"] - 1) * (1 - rec["joined_share"]) <= LOCAL_TOKENS + 1e-9
        assert rec["rejoin_position"].notna().all() and rec["left_position"].isna().all()
        assert ((rec["joined_share"] >= MIN_JOINED_SHARE) | local).all()
        # the reference's text came back: at least MIN_RUN tokens joined after the flip
        sig = [json.loads(x) for x in rec["signals"]]
        assert all("joined before the budget ended" not in s["decided_by"] for s in sig)
        n_rec += len(rec)
        n_bad += sum(last_third_ratio(a, b) < 0.5 for a, b in zip(rec.ref_continuation, rec.branch_continuation))
    assert n_rec > 0 and n_bad <= 0.05 * n_rec, (n_bad, n_rec)


def test_flips_command_on_a_report(default_run, tmp_path, capsys):
    """`logitdiff flips` re-opens the candidate, branches with --both, gates, and rewrites
    the report in place; bad input is a one-line error."""
    import shutil

    d = tmp_path / "q2"
    shutil.copytree(default_run / "reports" / "tiny-Q2_K", d)
    code = main(["flips", str(d), "--select", "top-kl:4", "--max-branches", "500", "--both", "--no-correctness",
                 "--similarity", "edit", "--fail-on", "flips>0,tool_call_malformed>100"])
    assert code == 3
    rep = json.loads((d / "report.json").read_text())
    f = rep["flips"]
    assert f["n_branches"] == 4 and "edit" in f["similarity"] and f["settings"]["both"]
    assert rep["gates"]["crossed"] == ["flips>0"]
    fl = pd.read_parquet(d / "flips.parquet")
    from logitdiff.contracts import Outcome

    assert set(fl.outcome_ref_from_cand_token) <= set(Outcome.RULE)  # no judge: rule classes only
    top = pd.read_parquet(d / "tokens.parquet").query("not top1_match and top1_cand != token_id").nlargest(4, "kl_nats")
    assert sorted(fl.kl_nats) == sorted(top.kl_nats)
    assert "report.html" in {p.name for p in d.iterdir()}
    # a REPORT outside a RUN: its rewritten page carries plotly itself
    assert '<script id="plotly-js">' in (d / "report.html").read_text() and not (d.parent / "plotly.min.js").exists()
    # a rerun replaces every section and file an earlier one wrote
    assert main(["flips", str(d), "--select", "top-kl:2", "--similarity", "edit"]) == 0
    rep = json.loads((d / "report.json").read_text())
    # with correctness, the flips behind the changed answers join the two by KL
    changed = rep["correctness"]["items_right_to_wrong"] + rep["correctness"]["items_wrong_to_right"]
    assert "gates" not in rep and (d / "correctness.parquet").exists()
    assert 2 <= rep["flips"]["n_branches"] <= 2 + len(changed)
    assert all(x["branched"] or x["why_not"] for x in rep["flips"]["changed_items"])
    assert {x["item_id"] for x in rep["flips"]["changed_items"]} >= set(changed)
    assert main(["flips", str(d), "--select", "top-kl:2", "--similarity", "edit", "--no-correctness"]) == 0
    rep = json.loads((d / "report.json").read_text())
    assert "correctness" not in rep and not (d / "correctness.parquet").exists()
    assert "Correctness of free-running" not in (d / "report.md").read_text()
    capsys.readouterr()
    for bad, needle in ((["--max-tokens", "0"], "--max-tokens"), (["--exec-timeout", "0"], "--exec-timeout"),
                        (["--similarity-threshold", "1.5"], "--similarity-threshold")):
        assert main(["flips", str(d), *bad]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    assert json.loads((d / "report.json").read_text()) == rep  # nothing was rewritten
    assert main(["flips", str(d), "--select", "worst:3"]) == 2
    assert "--select" in capsys.readouterr().err
    assert main(["flips", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


def test_default_run_html_numbers_match_parquet(default_run):
    """OUT/report.html: its embedded numbers recomputed independently from tokens.parquet."""
    import re

    html = (default_run / "report.html").read_text()
    assert "https://" not in re.sub(r"<script id=\"plotly-js\">.*?</script>", "", html, flags=re.S)
    data = json.loads(re.search(r'<script type="application/json" id="logitdiff-data">(.*?)</script>', html, re.S).group(1))
    assert data["candidates"] == ["tiny-BF16"] + [f"tiny-{q}" for q in LADDER]
    for name in ("tiny-Q8_0", "tiny-Q2_K"):
        df = pd.read_parquet(default_run / "reports" / name / "tokens.parquet")
        rep = json.loads((default_run / "reports" / name / "report.json").read_text())
        m = data["matrix"][name]
        assert m["kl_mean"]["value"] == pytest.approx(df.kl_nats.mean(), rel=1e-12)
        assert m["top1"]["value"] == pytest.approx(1 - df.top1_match.mean(), rel=1e-12)
        # the page shows the outcome columns that occur on it (a count of 0 everywhere is left out)
        shown = {o: m[f"flips_{o}"]["value"] for o in rep["flips"]["outcomes"] if f"flips_{o}" in m}
        assert shown == {o: v for o, v in rep["flips"]["outcomes"].items() if f"flips_{o}" in m}
        assert {o for o, v in rep["flips"]["outcomes"].items() if v} <= set(shown)
        # each candidate's own page, as README's Files section says: the same numbers
        own = (default_run / "reports" / name / "report.html").read_text()
        own_data = json.loads(re.search(r'<script type="application/json" id="logitdiff-data">(.*?)</script>', own, re.S).group(1))
        # (its outcome columns are those occurring on it: a subset of the combined page's)
        own_m = own_data["matrix"][name]
        assert own_data["candidates"] == [name] and set(own_m) <= set(m) and all(own_m[k] == m[k] for k in own_m)
        assert set(m) - set(own_m) <= {f"flips_{o}" for o, v in rep["flips"]["outcomes"].items() if not v}
        worst = df.groupby("item_id").kl_nats.mean().sort_values(ascending=False)
        assert [w["id"] for w in data["worst_items"][name]][:3] == list(worst.index[:3])
        rc = data["ref_confidence"]["by_candidate"][name]
        assert sum(rc["n"]) + rc.get("left_out", 0) == len(df)
        # the most consequential flip, both continuations side by side (the flip token, the
        # joined stretch and the departure are spans inside them)
        import html as html_mod

        top = rep["flips"]["top"][0]
        plain = re.sub(r"<span[^>]*>|</span>", "", html)
        assert html_mod.escape(top["branch_continuation"], quote=True) in plain
        assert html_mod.escape(top["ref_continuation"], quote=True) in plain
        assert 'class="ftok"' in html


def test_every_report_metric_is_registered_and_every_registered_one_reported(default_run):
    """The metric registry against real reports of the bundled default (flips, correctness and
    noise floor present): every registered metric has a number there, and every metric-bearing
    field of report.json (per-position series, summary figures, flip outcomes and rates,
    correctness shares and counts) is registered."""
    import math

    from logitdiff.contracts import Outcome
    from logitdiff.report.gates import get_path, metric_value
    from logitdiff.report.metric_registry import GATE_METRICS, METRICS, SERIES

    summary = json.loads((default_run / "summary.json").read_text())
    registered = {p for m in METRICS.values() for p in m.paths}
    for rdir in sorted((default_run / "reports").iterdir()):
        rep = json.loads((rdir / "report.json").read_text())
        for m in METRICS.values():  # registered -> reported
            if m.paths[0].startswith("summary.json:candidates[]."):
                key = m.paths[0].split(".", 1)[1].split(".", 1)[1]
                row = next(r for r in summary["candidates"] if r["candidate"] == rep["candidate"]["spec"])
                assert key in row, (m.name, rdir.name)
                continue
            v = metric_value(rep, m.name) if m.gate else next(
                (get_path(rep, p) for p in m.paths if get_path(rep, p) is not None), None)
            if m.name.removesuffix("_rate") in Outcome.JUDGED:  # a judge's class: no judge ran, no number
                assert v is None, (m.name, rdir.name, v)
                continue
            assert isinstance(v, (int, float)) and math.isfinite(v), (m.name, rdir.name, v)
        # reported -> registered
        assert set(rep["summary"]["metrics"]) == set(SERIES)
        for item in rep["items"]:
            stats = {k for k, v in item.items() if isinstance(v, dict) and "mean" in v and k != "top1_disagreement"}
            assert stats == set(SERIES), (item["id"], stats)
        assert set(rep["flips"]["outcomes"]) == set(rep["flips"]["rates"]) == set(Outcome.RULE)
        shown = ["summary.top1_disagreement.rate", "summary.ppl_ratio", "summary.kl_mean_x_noise_floor", "flips.n_flips",
                 "flips.n_branches", "flips.n_ties", *(f"flips.outcomes.{o}" for o in rep["flips"]["outcomes"]),
                 *(f"flips.rates.{o}" for o in rep["flips"]["rates"])]
        shown += [f"correctness.{k}" for k, v in rep["correctness"].items() if not k.endswith("_ci")
                  and (k.startswith(("accuracy_", "tool_call_valid_")) or k in ("right_to_wrong", "wrong_to_right", "mcnemar_p"))]
        shown += [f"summary.metrics.{s}.{stat}" for s in SERIES for stat in ("mean", "p95", "p99", "max") if s == "kl_nats"]
        assert [p for p in shown if p not in registered] == []
    assert set(GATE_METRICS) <= set(METRICS)


def test_run_pages_share_one_plotly(default_run, tmp_path):
    """A bundled RUN's pages load one OUT/plotly.min.js (not ~5 MB of plotly each): with it,
    they weigh <= 10 MB in all; a candidate's page draws every plot in Chromium; `flips`
    rewriting a report inside a RUN keeps the page on the shared file."""
    import re
    import shutil

    from logitdiff.report.html import PLOTLY_FILE, plotly_js
    from test_html_report import CHROMIUM, _embedded, _selftest

    shared = default_run / PLOTLY_FILE
    assert shared.read_text(encoding="utf-8") == plotly_js()
    pages = sorted(default_run.rglob("report.html"))
    assert [p.parent.name for p in pages[1:]] == sorted(f"tiny-{q}" for q in ["BF16", *LADDER]) and pages[0] == default_run / "report.html"
    total = sum(p.stat().st_size for p in pages) + shared.stat().st_size
    assert total <= 10_000_000, f"{total:,} bytes"
    for p in pages:
        text = p.read_text(encoding="utf-8")
        src = re.findall(r'<script id="plotly-js" src="([^"]+)"></script>', text)
        assert len(src) == 1 and (p.parent / src[0]).resolve() == shared.resolve(), (p, src)
        assert "<script id=\"plotly-js\">" not in text and len(text) < 2_000_000, p
    page = default_run / "reports" / "tiny-Q4_K_M" / "report.html"
    if CHROMIUM is not None:
        res, refused = _selftest(page.resolve().as_uri())
        figs = [f["id"] for f in _embedded(page.read_text(encoding="utf-8"), "logitdiff-figures")]
        assert res["errors"] == [] and not refused and res["plotly_missing"] is False, (res["errors"], refused)
        assert figs and set(res["plots"]) == set(figs) and all(n >= 1 for n in res["plots"].values()), res["plots"]
    # `flips` on a report of a RUN (summary.json and the shared file two levels up)
    run = tmp_path / "out"
    (run / "reports").mkdir(parents=True)
    shutil.copy(default_run / "summary.json", run)
    shutil.copy(shared, run)
    d = run / "reports" / "tiny-Q2_K"
    shutil.copytree(default_run / "reports" / "tiny-Q2_K", d)
    assert main(["flips", str(d), "--select", "top-kl:1", "--no-correctness", "--similarity", "edit"]) == 0
    text = (d / "report.html").read_text(encoding="utf-8")
    assert '<script id="plotly-js" src="../../plotly.min.js"></script>' in text and len(text) < 2_000_000


def test_readme_figures_check_on_the_run(default_run, tmp_path):
    """scripts/readme_figures.py --check --from RUN on the run whose figures README holds
    passes whatever the header sentence says (README's written from a timed fresh run, the
    check's from --from; other library versions: a warning naming the drift); a figure that
    differs fails with exactly the differing lines as a unified diff."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    shutil.copytree(default_run, out, ignore=shutil.ignore_patterns("runs", "*.html", "plotly.min.js"))
    sys.path.insert(0, str(root / "scripts"))
    import readme_figures as rf

    timing = {"wall_s": 284.0, "load_before": "2.9/3.2/2.6", "load_after": "4.9/4.1/3.1", "machine": rf.machine()}
    (out / "readme_figures.timing.json").write_text(json.dumps(timing))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- readme_figures:begin -->\n<!-- readme_figures:end -->\n")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    script = [sys.executable, str(root / "scripts" / "readme_figures.py"), "--from", str(out), "--readme", str(readme)]

    def run(*extra):
        return subprocess.run(script + list(extra), capture_output=True, text=True, env=env, timeout=300)

    assert run().returncode == 0
    text = readme.read_text()
    assert "Measured by" in text and "took 284 s wall" in text
    (out / "readme_figures.timing.json").unlink()  # now --from words the header "Figures by ... (not re-timed)"
    assert "not re-timed" in run("--print").stdout
    r = run("--check")
    assert r.returncode == 0 and "match this run's" in r.stderr and "warning" not in r.stderr, r.stderr
    assert f"compared: the machine class and cores, {2 * (1 + len(LADDER))} table rows" in r.stderr, r.stderr  # what it compared
    # versions README names that this run does not: the drift named in a warning, not a failure
    have = re.search(r"transformers ([^\s,()]+)", text).group(1)
    readme.write_text(text.replace(f"transformers {have}", "transformers 0.0.0-readme", 1))
    r = run("--check")
    assert r.returncode == 0, r.stderr
    assert f"warning: version drift (not compared): transformers 0.0.0-readme in README, {have} in this run" in r.stderr
    # a figure that differs: exit 1, README's line and the run's as a unified diff, nothing else
    row = next(ln for ln in text.splitlines() if ln.startswith("| `builtin:tiny-Q4_K_M` |"))
    cells = row.split(" | ")
    cells[1] = "9.99e-09"
    readme.write_text(text.replace(row, " | ".join(cells)))
    r = run("--check")
    assert r.returncode == 1 and "differ from this run's" in r.stderr, r.stderr
    diff = r.stderr.split("\n", 1)[1].splitlines()
    assert diff[:2] == [f"--- README ({rf.machine_class()[0]})", "+++ this run"], diff
    assert [ln for ln in diff[2:] if ln[:1] in "+-"] == ["-" + " | ".join(cells), "+" + row], diff
    # a section written with other flip classes (a logitdiff before report schema 2.1: benign / meaning
    # changed by the old classifier): that drift named, the flips part not compared, the drift figures still are
    flips_row = next(ln for ln in text.splitlines() if ln.startswith("| candidate | branches |"))
    old = text.replace(flips_row, flips_row.replace("| diverged |", "| benign | meaning changed |", 1))
    assert old != text
    readme.write_text(old)
    r = run("--check")
    assert r.returncode == 0 and "warning: flip classes drift (not compared)" in r.stderr, r.stderr
    readme.write_text(old.replace(row, " | ".join(cells)))
    r = run("--check")
    assert r.returncode == 1 and "flip classes drift" in r.stderr and "-" + " | ".join(cells) in r.stderr, r.stderr
