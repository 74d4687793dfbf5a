"""Speculation on vs off in generation mode (logitdiff speculate), on real llama-servers
started here on 127.0.0.1: the bundled model's F32 GGUF as target, its Q2_K or itself as
draft (--spec-type draft-simple), and --spec-type ngram-simple (no draft model).

A server that cannot start FAILS the test with its log tail (run scripts/build_llama_server.sh).
"""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from servers import llama_server, start_or_fail
from logitdiff import speculation as S
from logitdiff.api import speculate
from logitdiff.errors import LogitdiffError
from logitdiff.sources.served.generate import LlamaServer, Scored, Trace, parse_generation

N = 32  # tokens per item: short, but long enough for several verify batches
ITEMS = 3


# ------------------------------------------------------------------ numerics (no server)
def test_survival_and_first_divergence():
    a = np.array([5, 6, 7, 8])
    assert S.first_divergence(a, a.copy()) is None
    assert S.first_divergence(a, np.array([5, 6, 0, 8])) == 2
    assert S.first_divergence(a, np.array([0, 6, 7, 8])) == 0
    s = S.survival([None, 2, 0], 4)
    # t=0: items 1,2 identical (item 3 diverged at 0); t=2: only item 1
    np.testing.assert_allclose(s, [2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert np.all(np.diff(s) <= 0)


def test_margin_is_exact_or_a_lower_bound():
    ids = np.array([3, 9, 1, -1])
    lps = np.log(np.array([0.5, 0.3, 0.1, 1.0]))
    m, exact = S.margin(ids, lps, 3, 9)
    assert exact and m == pytest.approx(np.log(0.5 / 0.3), abs=1e-15)
    m, exact = S.margin(ids, lps, 3, 42)  # other side's token not listed: >= ln(0.5/0.1)
    assert not exact and m == pytest.approx(np.log(0.5 / 0.1), abs=1e-15)
    m, exact = S.margin(ids, lps, 42, 3)
    assert not exact and np.isnan(m)


def test_probability_not_reported_is_never_p1():
    """A speculative token (logprob 0.0, empty top list) and a token with no entry at all
    are 'not reported'; a real p = 1 with a full top list is reported."""
    K = 2
    ans = {"tokens": [7, 8, 9, 10], "timings": {"draft_n": 3, "draft_n_accepted": 2},
           "completion_probabilities": [
               {"id": 7, "logprob": -0.1, "top_logprobs": [{"id": 7, "logprob": -0.1}, {"id": 1, "logprob": -2.4}]},
               {"id": 8, "logprob": 0.0, "top_logprobs": []},
               # token 9 has no entry (its text ends in an incomplete UTF-8 sequence)
               {"id": 10, "logprob": 0.0, "top_logprobs": [{"id": 10, "logprob": 0.0}, {"id": 2, "logprob": -40.0}]}]}
    tr = parse_generation(ans, 4, K, "test")
    assert tr.reported.tolist() == [True, False, False, True]
    assert tr.no_entry.tolist() == [False, False, True, False]
    assert np.isnan(tr.logprob[1]) and np.isnan(tr.logprob[2]) and tr.logprob[3] == 0.0
    assert tr.draft_n == 3 and tr.draft_n_accepted == 2
    with pytest.raises(LogitdiffError, match="not n_predict"):
        parse_generation(ans, 5, K, "test")


def _trace(ids, lps, reported):
    """A generation with top-1 lists: the token itself at its logprob where reported."""
    ids, rep = np.asarray(ids, np.int64), np.asarray(reported, bool)
    lp = np.where(rep, np.asarray(lps, np.float64), np.nan)
    return Trace(ids=ids, logprob=lp, reported=rep, no_entry=np.zeros(len(ids), bool),
                 top_ids=np.where(rep, ids, -1)[:, None], top_lps=np.where(rep, lp, -np.inf)[:, None])


def test_f0_with_nothing_compared_is_null_with_its_reason_never_0():
    """F0's largest |Δlogprob| is the largest over the positions both runs reported; with no
    such position (no rerun items; only speculative steps, whose probabilities are not
    reported) it is null with the reason, and the verdict's F0 line says so."""
    a = _trace([5, 6, 7], [-0.5, -0.25, -1.0], [True, True, True])
    b = _trace([5, 6, 7], [-0.5, -0.75, -1.0], [True, True, True])
    f0 = S._f0([a], [b], 3)
    assert f0["max_abs_dlogprob"] == 0.5 and f0["positions_compared"] == 3 and "not_evaluated" not in f0
    unreported = _trace([5, 6, 7], [0, 0, 0], [False, False, False])
    for first, again, why in (([], [], "no items rerun"), ([unreported], [unreported], "no position where both runs reported")):
        f0 = S._f0(first, again, 3)
        assert f0["max_abs_dlogprob"] is None and f0["positions_compared"] == 0
        assert f0["not_evaluated"].startswith("not evaluated: no positions compared") and why in f0["not_evaluated"]
    # the reported positions of one run only: nothing compared either
    f0 = S._f0([a], [unreported], 3)
    assert f0["max_abs_dlogprob"] is None and "no position where both" in f0["not_evaluated"]


def test_f1_with_nothing_compared_is_null_with_its_reason_never_0():
    """F1's largest |Δlogprob| and the near-tie threshold (twice it) are null with the reason
    when F1 compared no position (no items re-scored), never 0: a 0 threshold classes every
    divergence material. A measured F1 of exactly 0 stays 0 (that is evidence)."""
    f1 = S._f1([], [], 16, 3, 4)
    assert f1["positions"] == 0 and f1["max_abs_dlogprob"] is None and f1["near_tie_nats"] is None
    assert f1["not_evaluated"].startswith(S.F1_NOT_EVALUATED) and "floor items 0" in f1["not_evaluated"]
    a = _trace([5, 6, 7], [-0.5, -0.25, -1.0], [True, True, True])
    scored = Scored(a.top_ids, a.top_lps, np.array([4, 4, 4]))
    f1 = S._f1([a], [scored], 16, 3, 4)
    assert f1["positions"] == 3 and f1["max_abs_dlogprob"] == 0.0 and f1["near_tie_nats"] == 0.0 and "not_evaluated" not in f1


def test_chance_above_max_is_the_hypergeometric_tail():
    """P(j or more of n exchangeable values above the largest of m others) = the j largest of
    the pooled n + m all among the n: scipy's hypergeometric pmf, and n / (n + m) for j = 1."""
    from scipy.stats import hypergeom

    for n, m in ((936, 256), (6072, 2048), (5, 1), (1, 40)):
        assert S.chance_above_max(n, m, 0) == 1.0 and S.chance_above_max(n, m, n + 1) == 0.0
        assert S.chance_above_max(n, m, 1) == pytest.approx(n / (n + m), rel=1e-12)
        js = np.arange(1, min(n, 60) + 1)
        ps = [S.chance_above_max(n, m, int(j)) for j in js]
        ref = hypergeom.pmf(js, n + m, n, js)
        np.testing.assert_allclose(ps, ref, rtol=1e-9, atol=1e-300)
        assert np.all(np.diff(ps) <= 0)
    # by simulation: the max of 50 iid values beats the max of 10 in ~50/60 of draws
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20000, 60))
    assert np.mean(x[:, :50].max(1) > x[:, 50:].max(1)) == pytest.approx(S.chance_above_max(50, 10, 1), abs=0.01)


# ------------------------------------------------------------------ real servers
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from logitdiff.builtin import gguf_path

    root = tmp_path_factory.mktemp("spec")
    wl = root / "wl.jsonl"
    from logitdiff.builtin import WORKLOAD

    lines = WORKLOAD.read_text().splitlines()
    wl.write_text("\n".join(lines[:ITEMS]) + "\n")
    return {"f32": gguf_path("F32"), "q2k": gguf_path("Q2_K"), "root": root, "logs": root / "logs", "wl": wl}


@pytest.fixture(scope="module")
def servers(env):
    started = {}

    def get(name):
        if name not in started:
            f32, q2k = env["f32"], env["q2k"]
            extra = {
                "ref": [],
                "self": ["--spec-type", "draft-simple", "-md", f32, "--spec-draft-n-max", "3"],
                "q2k": ["--spec-type", "draft-simple", "-md", q2k, "--spec-draft-n-max", "3"],
                "ngram": ["--spec-type", "ngram-simple"],
                "md_only": ["-md", q2k],
                "q2k_target": ["--spec-type", "draft-simple", "-md", q2k],
            }[name]
            target = q2k if name == "q2k_target" else f32
            started[name] = start_or_fail(llama_server, target, env["logs"], parallel=1, threads=1, extra=[str(x) for x in extra])
        return started[name]

    yield get
    for s in started.values():
        s.stop()


def _invariants(rep):
    """What holds for every report, whatever the servers did."""
    items, s = rep["items"], rep["summary"]
    n = rep["method"]["n_predict"]
    assert s["identical_output_rate"] == pytest.approx(np.mean([r["identical"] for r in items]))
    sv = np.array(rep["survival"]["candidate"])
    assert len(sv) == n and np.all(np.diff(sv) <= 0) and np.all((0 <= sv) & (sv <= 1))
    for r in items:
        d = r["first_divergence"]
        assert r["identical"] == (d is None)
        assert r["shared_prefix_fraction"] == pytest.approx((n if d is None else d) / n)
        if d is not None:
            # a class needs F1's near-tie threshold; without it, never a guess
            assert r["class"] in ((S.UNCLASSIFIED,) if rep["method"]["near_tie_nats"] is None else (S.NEAR_TIE, S.MATERIAL))
            assert r["reference_token"] != r["candidate_token"]
    cc = rep["candidate"]["counters"]
    assert cc["draft_n"] == sum(r["draft_n"] for r in items) and cc["draft_n_accepted"] == sum(r["draft_n_accepted"] for r in items)
    assert cc["positions"] == n * len(items)
    # F0 on a one-slot llama-server: bit-identical reruns of the reference; not measured
    # (null, never a vacuous True) without reruns
    f0 = rep["floors"]["F0"]["reference"]
    assert f0["bit_identical"] is (True if f0["items"] else None)
    assert rep["verdict"]["label"] in S.VERDICTS


def test_self_draft_runs_verify_batches_and_reports_no_probabilities(env, servers, tmp_path):
    """The same GGUF as its own draft: drafting runs, nearly every draft token is accepted,
    and every token of a speculative step comes back without probabilities (marked so)."""
    ref, cand = servers("ref"), servers("self")
    out = tmp_path / "self"
    rep = speculate(ref.url, cand.url + ",speculative=1", out, workload=env["wl"], n_predict=N, floor_items=2, top_k=8)
    _invariants(rep)
    cc = rep["candidate"]["counters"]
    assert cc["draft_n"] > 0 and cc["acceptance_rate"] >= 0.9, cc
    assert cc["not_reported_logprob_zero_no_top"] > 0  # llama-server's "TODO: set result.probs"
    assert rep["reference"]["counters"]["positions_not_reported"] == 0
    assert rep["candidate"]["declared_speculative"] is True
    # records: where the candidate did not report, logprob is null, never 0.0 (p = 1)
    recs = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    cand_recs = [r for r in recs if r["side"] == "candidate"]
    assert any(lp is None for r in cand_recs for lp in r["logprob"])
    assert all(lp is None or lp < 0.0 or len(top) == 8 for r in cand_recs for lp, top in zip(r["logprob"], r["top"]))
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", "generations.jsonl"}
    assert rep["verdict"]["label"] in (S.LOSSLESS, S.SHAPE_ONLY, S.DEFECT)
    assert rep["verdict"]["label"] in (out / "report.md").read_text() and rep["verdict"]["label"] in (out / "report.html").read_text()


def test_no_floor_items_reads_f0_not_evaluated_everywhere(env, servers, tmp_path):
    """--floor-items 0 reruns nothing: F0's largest |Δlogprob| is null with its reason in
    report.json (valid against the schema, tests/conftest.py), report.md, the page and the
    verdict's reasons, never 0."""
    out = tmp_path / "nofloor"
    rep = speculate(servers("ref").url, servers("self").url, out, workload=env["wl"], n_predict=8, floor_items=0, top_k=8)
    saved = json.loads((out / "report.json").read_text())
    for side in ("reference", "candidate"):
        for f0 in (rep["floors"]["F0"][side], saved["floors"]["F0"][side]):
            assert f0["items"] == 0 and f0["positions_compared"] == 0 and f0["max_abs_dlogprob"] is None
            assert f0["not_evaluated"].startswith(S.F0_NOT_EVALUATED)
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    f0_rows = [ln for ln in md.splitlines() if ln.startswith("| F0 ")]
    assert len(f0_rows) == 2 and all(S.F0_NOT_EVALUATED in ln and "dlogprob 0" not in ln for ln in f0_rows), f0_rows
    assert page.count(S.F0_NOT_EVALUATED) >= 3  # both F0 rows (the page's report) and the verdict's reasons
    assert any(S.F0_NOT_EVALUATED in r for r in rep["verdict"]["reasons"])
    # the schema holds the rule: a null F0 figure carries its reason
    from logitdiff.contracts import validate

    del saved["floors"]["F0"]["candidate"]["not_evaluated"]
    with pytest.raises(LogitdiffError, match="F0.candidate"):
        validate(saved, "speculation")


def test_lossless_never_from_zero_f0_evidence_cli(env, servers, tmp_path):
    """`logitdiff speculate --floor-items 0` reruns nothing: F0 compared no position, its
    bit-identity is null (not a vacuous True), and the verdict is 'floor not measured', never
    'speculation numerically lossless', on the terminal and in report.json, report.md, the page."""
    out = tmp_path / "cli-nofloor"
    p = subprocess.run([sys.executable, "-m", "logitdiff.cli", "speculate", servers("ref").url, servers("self").url, "--out", str(out),
                        "--workload", str(env["wl"]), "--max-tokens", "8", "--floor-items", "0", "--top-k", "8"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads((out / "report.json").read_text())
    _invariants(rep)
    assert rep["floors"]["F0"]["candidate"]["bit_identical"] is None and rep["floors"]["F0"]["reference"]["bit_identical"] is None
    assert rep["verdict"]["label"] == S.FLOOR_NOT_MEASURED and not rep["verdict"]["defects"], rep["verdict"]
    assert f"verdict: {S.FLOOR_NOT_MEASURED}" in p.stderr and S.LOSSLESS not in p.stderr  # the console is stderr
    assert any("F0 (run-to-run): reference not measured, candidate not measured on 0 items" in r for r in rep["verdict"]["reasons"])
    md = (out / "report.md").read_text()
    assert md.count("bit-identical not evaluated") == 2 and "bit-identical True" not in md
    assert f"Verdict: {S.FLOOR_NOT_MEASURED}" in md and S.FLOOR_NOT_MEASURED in (out / "report.html").read_text()


def test_lossless_needs_a_compared_f0_position_on_each_side(env, servers):
    """The verdict rule on a real run's figures: the run as measured (identical outputs,
    floors on one item), then the same figures with F0 replaced by what no rerun (no items)
    or a rerun with no reported position gives: never 'lossless' from zero evidence."""
    rep = speculate(servers("ref").url, servers("self").url, None, workload=env["wl"], n_predict=8, floor_items=1, top_k=8)
    _invariants(rep)
    s, f0, f1, rc, cc = (rep["summary"], rep["floors"]["F0"], rep["floors"]["F1"], rep["reference"]["counters"],
                         rep["candidate"]["counters"])
    assert s["divergent_items"] == 0 and f0["candidate"]["positions_compared"] >= 1 and f1["positions"] >= 1
    assert S.decide(s, f0, f1, rc, cc, rep["items"], True)["label"] == rep["verdict"]["label"] == S.LOSSLESS
    unreported = _trace([5, 6, 7], [0, 0, 0], [False, False, False])
    for empty in (S._f0([], [], 8), S._f0([unreported], [unreported], 8)):
        assert empty["bit_identical"] is None
        for side in ("reference", "candidate"):
            v = S.decide(s, {**f0, side: empty}, f1, rc, cc, rep["items"], True)
            assert v["label"] == S.FLOOR_NOT_MEASURED, (side, v)
            assert any(f"F0 compared no position on the {side} side" in r for r in v["reasons"]), v["reasons"]
    # a rerun whose reported positions differ is a difference, compared positions or not
    a = _trace([5, 6, 7], [-0.5, -0.25, -1.0], [True, True, True])
    assert S._f0([a], [unreported], 3)["bit_identical"] is False


def test_reference_without_probabilities_is_a_measurement_gap_and_null_figures_say_why(env, servers):
    """On a real run's figures: a reference that sent no probability at some positions
    (logprob 0 and no top list, or no entry at all) is a measurement gap named in the
    reasons and report.md with its counts, never a speculation defect: the label and the
    defects stay those of the run as measured. And report.md's null figures carry their
    reason, never a bare 'n/a' or 'not reported': the aligned prefix with no position
    compared, cross-scoring with no divergence, acceptance with nothing drafted."""
    from logitdiff.report.speculation import render_markdown

    rep = speculate(servers("ref").url, servers("self").url, None, workload=env["wl"], n_predict=8, floor_items=1, top_k=8)
    _invariants(rep)
    s, f0, f1, rc, cc = (rep["summary"], rep["floors"]["F0"], rep["floors"]["F1"], rep["reference"]["counters"],
                         rep["candidate"]["counters"])
    assert rc["positions_not_reported"] == 0
    base = S.decide(s, f0, f1, rc, cc, rep["items"], True)
    gap_words = "measurement gap, not a speculation defect"  # S.MEASUREMENT_GAP
    assert base == rep["verdict"] and not any(gap_words in r for r in base["reasons"])
    for zero_no_top, no_entry in ((3, 0), (0, 2), (3, 2)):
        gap = {**rc, "not_reported_logprob_zero_no_top": zero_no_top, "not_reported_no_entry": no_entry,
               "positions_not_reported": zero_no_top + no_entry, "positions_reported": rc["positions"] - zero_no_top - no_entry}
        v = S.decide(s, f0, f1, gap, cc, rep["items"], True)
        assert v["label"] == base["label"] and v["defects"] == base["defects"], v
        said = [r for r in v["reasons"] if r.startswith(gap_words)]
        assert len(said) == 1 and f"at {zero_no_top + no_entry} of {rc['positions']} positions" in said[0], v["reasons"]
        assert f"({zero_no_top} with logprob 0 and no top list, {no_entry} with no entry)" in said[0]
        md = render_markdown({**rep, "reference": {**rep["reference"], "counters": gap}, "verdict": v})
        assert "Defects:" not in md and said[0] in md
        assert f"reference probabilities not reported at {zero_no_top + no_entry} of {rc['positions']} positions (a measurement gap" in md
    # nothing compared on the aligned prefix (every item diverging at its first token, or only
    # speculative steps there), no divergence, nothing drafted: each null figure says why
    none = S._stat([])
    s0 = {**s, "prefix": {**s["prefix"], "positions_compared": 0, "kl_nats": none, "kl_lower_nats": none, "abs_dlogprob": none,
                          "top1_disagreements": 0, "kl_above_floor_max": None},
          "cross": {"items": 0, "reference_on_candidate_kl_nats": none, "candidate_on_reference_top1_agreement": None}}
    cc0 = {**cc, "draft_n": 0, "draft_n_accepted": 0, "acceptance_rate": None}
    md = render_markdown({**rep, "summary": s0, "candidate": {**rep["candidate"], "counters": cc0}})
    lines = {key: next(ln for ln in md.splitlines() if ln.startswith(key)) for key in
             ("- same context, aligned prefix", "- cross-scoring after divergences", "- drafting:")}
    for key, line in lines.items():
        assert "n/a" not in line and "not reported:" not in line and "KL max not reported" not in line, line
    assert "not evaluated: no positions compared" in lines["- same context, aligned prefix"]
    assert "not evaluated: no divergence to cross-score" in lines["- cross-scoring after divergences"]
    assert "acceptance not evaluated: nothing drafted" in lines["- drafting:"]
    # a divergence whose margins are unknown (NaN before report.json, null in it): the reason
    import html

    from logitdiff.report.speculation import MARGIN_UNKNOWN, render_html

    row = {**rep["items"][0], "identical": False, "first_divergence": 3, "shared_prefix_fraction": 3 / 8, "reference_token": 5,
           "candidate_token": 6, "class": S.NEAR_TIE}
    for rm, cm in ((float("nan"), None), (None, float("nan"))):
        bad = {**row, "reference_margin_nats": rm, "reference_margin_exact": False, "candidate_margin_nats": cm,
               "candidate_margin_exact": False}
        md = render_markdown({**rep, "items": [bad]})
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row['id']} |"))
        assert line.count(MARGIN_UNKNOWN) == 2 and "nan" not in line and "n/a" not in line, line
        assert render_html({**rep, "items": [bad]}).count(html.escape(MARGIN_UNKNOWN)) >= 4  # the table and the report text


def test_traces_are_held_one_item_at_a_time_not_for_the_run(env, servers, tmp_path):
    """Memory is bounded by an item, not by the run: each item's traces (n_predict x K top
    lists per side) are spilled as they come and read back one item at a time. Counted on
    real servers as the live Trace objects (gc) at every server call and while the records
    are consumed: at most the floor items' (kept, and their reruns) plus the current item's,
    whatever the number of items; none once compare_generation has returned."""
    import gc

    from logitdiff.builtin import WORKLOAD
    from logitdiff.workload import read_workload

    items, floor = 8, 1
    wl = tmp_path / "wl.jsonl"
    wl.write_text("\n".join(WORKLOAD.read_text().splitlines()[:items]) + "\n")
    ref = LlamaServer(servers("ref").url, role="reference", top_k=8)
    cand = LlamaServer(servers("self").url, role="candidate", top_k=8)
    live: list[int] = []

    def n_traces() -> int:
        return sum(isinstance(o, Trace) for o in gc.get_objects())

    def counting(fn):
        def call(*a, **kw):
            live.append(n_traces())
            return fn(*a, **kw)
        return call

    try:
        prompts = S.prepare_prompts(ref, cand, read_workload(str(wl)))
        for srv in (ref, cand):
            srv.generate, srv.score = counting(srv.generate), counting(srv.score)  # type: ignore[method-assign]
        base = n_traces()
        rep, records = S.compare_generation(ref, cand, prompts, n_predict=8, floor_items=floor)
        assert n_traces() == base  # nothing held between the report and its records
        during = []
        recs = []
        for r in records:
            during.append(n_traces() - base)
            recs.append(r)
    finally:
        ref.close()
        cand.close()
    bound = 4 * floor + 2  # kept floor traces, their reruns, the current item's pair
    assert max(live) - base <= bound < 2 * items, live
    assert max(during) <= 2, during
    assert [(r["id"], r["side"]) for r in recs] == [(p.id, side) for p in prompts for side in ("reference", "candidate")]
    assert [r["id"] for r in rep["items"]] == [p.id for p in prompts]
    assert rep["candidate"]["counters"]["positions"] == sum(len(r["ids"]) for r in recs if r["side"] == "candidate") == 8 * items


def test_q2k_draft_rejects_some_drafts(env, servers):
    """A Q2_K drafter for the F32 target: drafting runs and some drafts are rejected (the
    target's own token wins), so acceptance is below 1; the output is the target's."""
    rep = speculate(servers("ref").url, servers("q2k").url, None, workload=env["wl"], n_predict=N, floor_items=1, top_k=8)
    _invariants(rep)
    cc = rep["candidate"]["counters"]
    assert rep["candidate"]["declared_speculative"] is True  # from /slots
    assert cc["draft_n"] > 0 and cc["draft_n_accepted"] < cc["draft_n"], cc


def test_ngram_simple(env, servers, tmp_path):
    """--spec-type ngram-simple: drafts from the text's own n-grams, no draft model. Steps
    without a match are plain decode steps whose probabilities are reported: those are
    compared in the same context. Two items whose greedy text repeats within 160 tokens
    (the first three items never draft within 128: that run is refused, see below)."""
    from logitdiff.builtin import WORKLOAD

    wl = tmp_path / "wl.jsonl"
    wl.write_text("\n".join(WORKLOAD.read_text().splitlines()[3:5]) + "\n")
    rep = speculate(servers("ref").url, servers("ngram").url, None, workload=wl, n_predict=160, floor_items=1, top_k=8)
    _invariants(rep)
    cc = rep["candidate"]["counters"]
    assert cc["draft_n"] > 0 and 0 < cc["draft_n_accepted"] < cc["draft_n"], cc
    assert 0 < cc["not_reported_logprob_zero_no_top"] < cc["positions"]
    assert rep["summary"]["prefix"]["positions_compared"] > len(rep["items"])  # more than the prefill's first tokens
    with pytest.raises(LogitdiffError, match="speculation never ran"):
        speculate(servers("ref").url, servers("ngram").url, None, workload=env["wl"], n_predict=N, floor_items=0)


def test_a_different_target_diverges_materially(env, servers):
    """A candidate whose target is not the reference's model (Q2_K, drafting for itself):
    its greedy output leaves the reference's at some token with margins far beyond the shape
    floor: material divergences, verdict "defect", and every divergence carries both
    margins and the cross-scoring of each side's tokens through the other server."""
    rep = speculate(servers("ref").url, servers("q2k_target").url, None, workload=env["wl"], n_predict=N, floor_items=1, top_k=8)
    _invariants(rep)
    div = [r for r in rep["items"] if not r["identical"]]
    assert div and rep["summary"]["material_divergences"] >= 1
    assert rep["verdict"]["label"] == S.DEFECT and any("material divergence" in d for d in rep["verdict"]["defects"])
    near = rep["method"]["near_tie_nats"]
    for r in div:
        assert r["reference_margin_nats"] >= 0 and r["cross_candidate_on_reference_top1_agreement"] is not None
        assert 0 <= r["cross_reference_on_candidate_top1_agreement"] <= 1
        if r["class"] == S.MATERIAL:
            assert r["reference_margin_nats"] > near or abs(r["candidate_margin_nats"]) > near
    assert rep["summary"]["cross"]["items"] == len(div)


def test_no_floor_items_leaves_divergences_unclassified_never_material(env, servers, tmp_path):
    """A candidate that diverges (another target) with --floor-items 0: F1 compared nothing,
    so there is no near-tie threshold. Every divergence's class, the near-tie/material
    counts and the prefix-KL check read 'not evaluated' (report.json valid against the
    schema, report.md, the page), never a threshold of 0 that makes each divergence
    material and the verdict 'defect'; the verdict is 'floor not measured'."""
    out = tmp_path / "nofloor-div"
    rep = speculate(servers("ref").url, servers("q2k_target").url, out, workload=env["wl"], n_predict=N, floor_items=0, top_k=8)
    _invariants(rep)
    saved = json.loads((out / "report.json").read_text())
    for r in (rep, saved):
        f1, s = r["floors"]["F1"], r["summary"]
        assert f1["positions"] == 0 and f1["max_abs_dlogprob"] is None and f1["near_tie_nats"] is None
        assert f1["not_evaluated"].startswith(S.F1_NOT_EVALUATED) and r["method"]["near_tie_nats"] is None
        div = [it for it in r["items"] if not it["identical"]]
        assert div and all(it["class"] == S.UNCLASSIFIED for it in div)
        assert s["near_tie_divergences"] is None and s["material_divergences"] is None
        assert s["unclassified_divergences"] == len(div) and s["classes_not_evaluated"] == S.NO_THRESHOLD
    v = rep["verdict"]
    assert v["label"] == S.FLOOR_NOT_MEASURED and not v["defects"], v
    assert any(S.NO_THRESHOLD in x for x in v["reasons"]) and any(S.F1_NOT_EVALUATED in x for x in v["reasons"])
    assert rep["summary"]["prefix"]["kl_nats"]["max"] > 0  # the Q2_K target: the prefix-KL check had something to read
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    f1_row = [ln for ln in md.splitlines() if ln.startswith("| F1 ")]
    assert len(f1_row) == 1 and S.F1_NOT_EVALUATED in f1_row[0] and "threshold not evaluated" in f1_row[0], f1_row
    assert "threshold 0" not in md and "dlogprob 0 " not in md and "| material |" not in md
    assert md.count(f"| {S.UNCLASSIFIED} |") == len([it for it in rep["items"] if not it["identical"]])
    assert f"- divergences: {rep['summary']['unclassified_divergences']} not classed" in md
    assert S.FLOOR_NOT_MEASURED in page and f"<td>{S.UNCLASSIFIED}</td>" in page
    # the page's survival plot: a floor over no items (1 everywhere by definition) is not drawn
    plot, _ = json.JSONDecoder().raw_decode(page.split("Plotly.newPlot('survival', ", 1)[1])
    assert [t["name"] for t in plot] == ["candidate vs reference", "F0 reference rerun: not measured (no floor items)",
                                         "F0 candidate rerun: not measured (no floor items)",
                                         "F1 shape floor (teacher-forced): not measured (no floor items)"]
    assert len(plot[0]["y"]) == N and all(t["y"] == [] for t in plot[1:])
    # the schema holds the rule: null counts carry their reason
    from logitdiff.contracts import validate

    del saved["summary"]["classes_not_evaluated"]
    with pytest.raises(LogitdiffError, match="summary"):
        validate(saved, "speculation")


def test_declared_speculative_without_drafting_is_refused(env, servers, tmp_path):
    """A candidate declared speculative whose answers show no drafting: one line, no output.
    Both a plain server declared speculative=1 and `-md` without --spec-type (which this
    llama-server does not speculate with) are refused."""
    ref = servers("ref")
    out = tmp_path / "none"
    for cand in (ref.url + ",speculative=1", servers("md_only").url + ",speculative=1"):
        with pytest.raises(LogitdiffError, match="speculation never ran"):
            speculate(ref.url, cand, out, workload=env["wl"], n_predict=8, floor_items=0)
        assert not out.exists()
    # not declared: a report labelled "speculation not exercised", never a figure read as 0
    rep = speculate(ref.url, servers("md_only").url, None, workload=env["wl"], n_predict=8, floor_items=1, top_k=4)
    assert rep["verdict"]["label"] == S.NOT_EXERCISED


def test_text_prompt_that_tokenizes_differently_is_refused(env, servers, tmp_path):
    from _models import make_random_llama
    from logitdiff.sources.quantize import build_ladder

    d = make_random_llama(tmp_path / "m", layers=1, dtype="float32")
    other = start_or_fail(llama_server, build_ladder(d, tmp_path / "cache", [])["F32"], env["logs"], parallel=1, threads=1)
    try:
        with pytest.raises(LogitdiffError, match=r"item code-00: the two servers tokenize the prompt differently"):
            speculate(servers("ref").url, other.url, tmp_path / "out", workload=env["wl"], n_predict=8)
        assert not (tmp_path / "out").exists()
    finally:
        other.stop()


def test_server_killed_mid_generation(env, servers, tmp_path):
    """The candidate dies while the CLI generates: one line on stderr, exit 2, nothing written."""
    ref = servers("ref")
    victim = start_or_fail(llama_server, env["f32"], env["logs"], parallel=1, threads=1,
                           extra=["--spec-type", "draft-simple", "-md", str(env["f32"])])
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "logitdiff.cli", "speculate", ref.url, victim.url, "--out", str(out), "--workload",
                          str(env["wl"]), "--max-tokens", "1536", "--floor-items", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        # kill it while it generates: as soon as its slot is processing a request
        import httpx

        t0 = time.monotonic()
        while not any(s.get("is_processing") for s in httpx.get(victim.url + "/slots", timeout=10).json()):
            assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
            time.sleep(0.02)
        victim.kill()
        _, err = p.communicate(timeout=120)
    finally:
        victim.stop()
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("logitdiff: error: candidate server") and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".killed*"))


def test_teacher_forced_comparison_of_a_speculative_source_is_labelled(env, servers, tmp_path, capfd):
    """The ordinary (teacher-forced) path on a source declared speculative=1: its report says
    'speculation not exercised' (a prefill never runs a verify batch), in report.json and report.md."""
    from logitdiff.api import capture_run, diff_runs

    ref_run = capture_run(f"gguf:{env['f32']}", tmp_path / "ref", workload=env["wl"], max_tokens=6)
    cand_run = capture_run(f"openai:{servers('self').url},top_k=8,speculative=1", tmp_path / "cand", reference=ref_run)
    rep = diff_runs(ref_run, cand_run, out=tmp_path / "rep")
    assert rep["candidate"]["identity"]["speculative"] is True
    assert any(n.startswith("speculation not exercised: the candidate") for n in rep["method"]["notes"])
    assert "speculation not exercised" in (tmp_path / "rep" / "report.md").read_text()
    # and on the terminal of `logitdiff compare`, beside the table
    from logitdiff.cli.compare import print_summary

    capfd.readouterr()
    print_summary(rep)
    assert "speculation not exercised" in "".join(capfd.readouterr())
    # the same server without the declaration: no label
    plain = capture_run(f"openai:{servers('self').url},top_k=8", tmp_path / "plain", reference=ref_run)
    assert not any("speculation not exercised" in n for n in diff_runs(ref_run, plain)["method"]["notes"])


def test_prefix_kl_is_above_the_floor_only_where_its_proven_lower_bound_is(env, servers):
    """ngram-simple on the bundled workload's first 4 items, 256 tokens, top-20, F1 on one
    item (256 positions): a prefix position's top-20 KL estimate (two tokens tied at the 20th
    place swap) is ~1e5 x F1's largest, its proven lower bound is below it. A position counts
    as above F1 only where its KL provably is (the lower bound), so this run reads lossless,
    saying why, not 'floor too small to judge' (nor, before that rule, 'defect') from an
    estimate's artefact. Positions provably above: 'floor too small' while chance allows
    that many, a defect when it does not."""
    from logitdiff.builtin import WORKLOAD

    wl = env["root"] / "wl4.jsonl"
    wl.write_text("\n".join(WORKLOAD.read_text().splitlines()[:4]) + "\n")
    rep = speculate(servers("ref").url, servers("ngram").url, None, workload=wl, n_predict=256, floor_items=1, top_k=20)
    _invariants(rep)
    s, f0, f1, rc, cc, v = (rep["summary"], rep["floors"]["F0"], rep["floors"]["F1"], rep["reference"]["counters"],
                            rep["candidate"]["counters"], rep["verdict"])
    above, pre = s["prefix"]["kl_above_floor_max"], s["prefix"]
    assert cc["draft_n"] > 0 and s["divergent_items"] == 0 and f1["positions"] == above["floor_positions"] == 256
    # the estimate far above F1's largest, the proven lower bound not: no position counted
    assert pre["kl_nats"]["max"] > 100 * f1["kl_nats"]["max"] and pre["kl_lower_nats"]["max"] <= f1["kl_nats"]["max"]
    assert above["positions"] == 0 and above["of"] == pre["positions_compared"] > above["floor_positions"]
    assert v["label"] == S.LOSSLESS and not v["defects"], v
    assert any("but no position's proven lower bound is" in r and "not provably above the floor" in r for r in v["reasons"]), v["reasons"]
    # positions provably above F1's largest: one is what chance allows here, forty are not
    for j, label in ((1, S.FLOOR_TOO_SMALL), (40, S.DEFECT)):
        some = {**s, "prefix": {**pre, "kl_above_floor_max": {**above, "positions": j,
                                                              "chance": S.chance_above_max(above["of"], above["floor_positions"], j)}}}
        d = S.decide(some, f0, f1, rc, cc, rep["items"], True)
        said = [x for x in d["reasons"] + d["defects"] if f"provably above the shape floor F1's largest" in x]
        assert d["label"] == label and len(said) == 1 and f"at {j} of {above['of']} positions" in said[0], d
        assert "over 256 positions" in said[0]
    # no finite lower bound anywhere: the estimate above F1 is not decided, not "lossless"
    unknown = {**s, "prefix": {**pre, "kl_lower_nats": {**pre["kl_lower_nats"], "max": None}}}
    d = S.decide(unknown, f0, f1, rc, cc, rep["items"], True)
    assert d["label"] == S.FLOOR_NOT_MEASURED and any("no position has a finite proven lower bound" in r for r in d["reasons"]), d
