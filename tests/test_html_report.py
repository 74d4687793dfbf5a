"""report.html: a self-contained page whose numbers are report.json's, rendered in a real browser.

The REPORT dirs are built here from synthetic RUNs (RunWriter -> compare_runs ->
build_report -> write_report_dir), so the test does not depend on any earlier run.
"""

import html as htmlmod
import json
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pyarrow.parquet as pq
import pytest


from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.report import build_report, write_report_dir
from logitdiff.report.html import REF_CONF_EDGES, readable_token, render_html, write_html
from logitdiff.report.markdown import render_markdown
from logitdiff.store import RunItem, RunReader, RunWriter

V = 64
# Token strings that must be escaped or made readable in the token view.
SPECIAL = {5: "<script>alert(1)</script>", 6: "ĠhelloĠworld", 7: "Ċ", 8: "a&b\"c"}
VOCAB = [SPECIAL.get(i, f"t{i}") for i in range(V)]
LENS = {"code-1": 30, "math-1": 12, "tool-1": 20, "chat-1": 9}
TAGS = {"code-1": ["code"], "math-1": ["math"], "tool-1": ["tool"], "chat-1": []}
NOISE = {"q8": 0.05, "q4": 0.4, "q2": 1.2}
SIZES = {"q8": 8_000_000, "q4": 4_000_000, "q2": None}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]


def _write_run(path, logits, teacher, spec, identity=None):
    w = RunWriter(path, source={"spec": spec, "identity": identity or {"backend": "test"}}, vocab_size=V,
                  tokenizer_hash="sha256:test", chunk_rows=16, vocab=VOCAB)
    for iid, lg in logits.items():
        w.add(RunItem(id=iid, prompt_ids=[1, 2], teacher_ids=list(teacher[iid]), positions=list(range(len(lg))), tags=TAGS[iid]), logits=lg)
    w.finish()
    return RunReader(path)


def _flips_section():
    """A report.json ``flips`` section in the shape flips.summarize_branches writes, with a
    judge's classes (benign / meaning_changed exist only where a judge ran: --judge)."""
    from logitdiff.flips import OUTCOMES

    def group(**c):
        d = {o: c.get(o, 0) for o in OUTCOMES}
        d["n"] = sum(d.values())
        d["rates"] = {o: d[o] / d["n"] for o in OUTCOMES}
        return d

    total = group(recovered=3, benign=2, meaning_changed=1)
    return {"n_flips": 9, "flip_rate": 0.1, "n_ties": 0, "n_branches": 6, "selection": "all flips", "similarity": "test",
            "meaning_judged_by": "test:judge", "settings": {"similarity_thresholds": {"edit": 0.9}, "resync_tokens": 4},
            "outcomes": {o: total[o] for o in OUTCOMES}, "rates": total["rates"], "recovered_ending_dissimilar": 0,
            "by_tag": {"code": group(recovered=2, benign=1), "math": group(recovered=1, meaning_changed=1)},
            "by_range": {}, "by_margin": {}, "top": [],
            "ties": {"tolerance": "test", "n_branched": 0, "outcomes": {o: 0 for o in OUTCOMES}, "list": []}}


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """A reference RUN and three candidate REPORT dirs (q8 < q4 < q2 in drift), plus the page."""
    tmp = tmp_path_factory.mktemp("ladder")
    rng = np.random.default_rng(0)
    ref = {k: rng.normal(0, 3, (n, V)).astype(np.float32) for k, n in LENS.items()}
    # Make the special tokens the reference's top-1 somewhere, so they are teacher tokens.
    for j, tok in enumerate(SPECIAL):
        ref["code-1"][3 + j, tok] += 25.0
    teacher = {k: lg.argmax(1) for k, lg in ref.items()}  # greedy teacher, as a reference capture makes
    ref_run = _write_run(tmp / "runs" / "ref", ref, teacher, "test:ref")
    comps = {}
    for name, s in NOISE.items():
        cand = {k: (v + rng.normal(0, s, v.shape)).astype(np.float32) for k, v in ref.items()}
        ident = {"backend": "test", "quant": name} | ({"size": SIZES[name]} if SIZES[name] else {})
        comps[name] = compare_runs(ref_run, _write_run(tmp / "runs" / name, cand, teacher, f"test:{name}", ident))
    # A noise floor that puts q8 (only) within 2x of it.
    floor = 0.75 * float(np.mean(comps["q8"].columns["kl_nats"]))
    noise = {"spec": "test:ref", "rerun": "test rerun", "kl_nats_mean": floor, "kl_nats_max": floor * 3, "top1_disagreement": 0.0,
             "top1_flips": 0, "positions": 71}
    dirs = []
    for name, comp in comps.items():
        rep, cols = build_report(comp, n_boot=200, noise_floor=noise)
        if name == "q4":
            rep["flips"] = _flips_section()
            rep["correctness"] = {"n_labelled": 4, "accuracy_ref": 0.75, "accuracy_cand": 0.5, "accuracy_ref_ci": [0.25, 1.0],
                                  "accuracy_cand_ci": [0.0, 1.0], "accuracy_diff": -0.25, "accuracy_diff_ci": [-0.75, 0.25],
                                  "both_right": 1, "both_wrong": 0, "right_to_wrong": 2, "wrong_to_right": 1, "mcnemar_p": 1.0,
                                  "correctness_flips": 3, "flips_starting_at_top1_flip": 1, "flips_with_unscored_start": 0,
                                  "method": "test", "items_right_to_wrong": ["code-1", "math-1"], "items_wrong_to_right": ["tool-1"],
                                  "by_tag": {}}
        dirs.append(write_report_dir(tmp / "out" / "reports" / name, rep, cols, markdown=render_markdown(rep)))
    page = write_html(dirs, tmp / "page" / "report.html")
    return {"tmp": tmp, "dirs": dirs, "page": page, "html": page.read_text(encoding="utf-8"),
            "reports": {d.name: json.loads((d / "report.json").read_text()) for d in dirs}}


def _embedded(html_text, element_id):
    m = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html_text, re.S)
    assert m, element_id
    return json.loads(m.group(1))


def _resolve(obj, path):
    for part in path.split("."):
        obj = obj[part]
    return obj


def test_page_is_self_contained(ladder):
    import plotly.offline

    text = ladder["html"]
    js = plotly.offline.get_plotlyjs()
    assert text.count(js) == 1, "plotly.js must be inlined exactly once"
    assert text.count("<script id=\"plotly-js\">") == 1
    # Nothing is loaded from anywhere: no src/href with a scheme or protocol-relative URL, and a
    # CSP that forbids all fetches. Outside plotly.js itself (whose code mentions URLs of map
    # tiles it never loads for these plots) the page holds no URL at all.
    rest = text.replace(js, "")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", rest, re.I)
    assert "<link" not in rest and "@import" not in rest and "url(" not in rest
    assert "http://" not in rest and "https://" not in rest
    assert "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none';" in text
    assert not re.search(r"<script[^>]+src=", text)


def test_every_candidate_and_warning_present(ladder):
    text = ladder["html"]
    data = _embedded(text, "logitdiff-data")
    assert data["candidates"] == ["q8", "q4", "q2"]
    matrix = re.search(r'<table id="matrix".*?</table>', text, re.S).group(0)
    rows = dict(re.findall(r'<tr class="([^"]*)" data-name="([^"]+)"', matrix)[i][::-1] for i in range(3))
    assert set(rows) == {"q8", "q4", "q2"}
    assert rows["q8"] == "warn" and rows["q4"] == "" and rows["q2"] == ""
    assert matrix.count("within 2× noise floor") == 1
    for name in NOISE:
        assert f"<summary>{name}: " in text  # a token view per candidate
    # Flips and correctness of q4 are in the consequences table, a column each; the others show n/a.
    conseq = re.search(r'<table id="consequences".*?</table>', text, re.S).group(0)
    q4 = re.search(r'<tr class="[^"]*" data-name="q4">(.*?)</tr>', conseq, re.S).group(1)
    keys = re.findall(r'<th data-sort="\w+" data-key="(\w+)"', conseq)
    shown = dict(zip(keys, re.findall(r'<td data-v="([^"]*)"', q4)))
    assert {k: shown[k] for k in ("flips_recovered", "flips_benign", "flips_meaning_changed", "flips_n_branches", "flips_n_flips")} == \
        {"flips_recovered": "3.0", "flips_benign": "2.0", "flips_meaning_changed": "1.0", "flips_n_branches": "6.0", "flips_n_flips": "9.0"}
    assert shown["right_to_wrong"] == "2.0" and shown["mcnemar_p"] == "1.0"
    q8 = re.search(r'<tr class="[^"]*" data-name="q8">(.*?)</tr>', conseq, re.S).group(1)
    assert set(re.findall(r'<td data-v="([^"]*)"', q8)[1:]) == {""}  # n/a throughout
    assert "McNemar p" in conseq and "McNemar p" not in matrix and "meaning changed" in conseq
    figs = _embedded(text, "logitdiff-figures")
    ids = [f["id"] for f in figs]
    assert ids == ["plot-kl-cdf", "plot-ranges-kl", "plot-ranges-top1", "plot-ref-confidence", "plot-flips-by-tag", "plot-pareto"]
    for i in ids:
        assert f'<div id="{i}" class="plot">' in text
    pareto = next(f for f in figs if f["id"] == "plot-pareto")
    assert sorted(pareto["data"][0]["text"]) == ["q4", "q8"]  # q2 records no file size


def test_matrix_numbers_are_report_json_numbers(ladder):
    text, reports = ladder["html"], ladder["reports"]
    data = _embedded(text, "logitdiff-data")
    matrix = re.search(r'<table id="matrix".*?</table>', text, re.S).group(0)
    keys = re.findall(r'<th data-sort="\w+" data-key="(\w+)"', matrix)
    assert keys[0] == "order" and "kl_mean" in keys and "top1" in keys and "kl_rev_p99" in keys
    checked = 0
    for name, rep in reports.items():
        cells = data["matrix"][name]
        for key, cell in cells.items():
            if cell["from"].startswith("summary.json"):
                continue
            try:
                want = _resolve(rep, cell["from"])
            except KeyError:
                want = None
            assert cell["value"] == want, (name, key, cell)
            checked += 1
        # The table cells' sort values are the same numbers.
        row = re.search(rf'<tr class="[^"]*" data-name="{name}">(.*?)</tr>', matrix, re.S).group(1)
        shown = dict(zip(keys, re.findall(r'<td data-v="([^"]*)"', row)))
        for key in ("kl_mean", "kl_p95", "kl_p99", "kl_rev_mean", "jsd_mean", "top1", "ppl_ratio"):
            assert float(shown[key]) == _resolve(rep, cells[key]["from"]), (name, key)
        assert float(shown["kl_mean"]) == rep["summary"]["metrics"]["kl_nats"]["mean"]
        assert shown["file_size"] == ("" if SIZES[name] is None else repr(float(SIZES[name])))
    assert checked > 40


def test_token_derived_numbers_match_tokens_parquet(ladder):
    data = _embedded(ladder["html"], "logitdiff-data")
    for d in ladder["dirs"]:
        name, rep = d.name, ladder["reports"][d.name]
        t = pq.read_table(d / "tokens.parquet").to_pandas()
        cdf = data["kl_cdf"][name]
        assert cdf["n"] == len(t) == rep["summary"]["positions"]
        assert cdf["x"][-1] == rep["summary"]["metrics"]["kl_nats"]["max"] and cdf["y"][-1] == 1.0
        assert cdf["x"] == sorted(cdf["x"])
        b = data["ref_confidence"]["by_candidate"][name]
        # The reference's own top-1 probability, at every position (tokens.parquet p_top1_ref).
        assert data["ref_confidence"]["column"].startswith("p_top1_ref")
        conf = t.p_top1_ref
        assert b["left_out"] == 0
        assert sum(b["n"]) + b["left_out"] == len(t)
        edges = REF_CONF_EDGES
        for j, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            m = (conf >= lo) & ((conf <= hi) if j == len(edges) - 2 else (conf < hi))
            assert b["n"][j] == int(m.sum())
            if m.any():
                assert b["kl_mean"][j] == pytest.approx(t.kl_nats[m].mean(), rel=1e-12)
                assert b["top1_disagreement"][j] == pytest.approx((~t.top1_match[m]).mean(), rel=1e-12)
        worst = sorted(rep["items"], key=lambda it: -it["kl_nats"]["mean"])
        assert [w["id"] for w in data["worst_items"][name]] == [it["id"] for it in worst[:5]]
        assert [w["kl_mean"] for w in data["worst_items"][name]] == [it["kl_nats"]["mean"] for it in worst[:5]]
    pairs = data["pairs"]
    assert [(p["a"], p["b"]) for p in pairs] == [("q8", "q4"), ("q4", "q2")]
    assert all(p["kl"]["separable"] for p in pairs)


def test_token_view_escapes_and_reads_bpe(ladder):
    text = ladder["html"]
    assert "<script>alert(1)</script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "ĠhelloĠworld" not in text.split('id="tokens"')[1]
    assert ">a&amp;b&quot;c</span>" in text
    assert "> hello world</span>" in text
    assert ">↵\n</span>" in text
    assert 'class=flip' in text  # the noisiest candidate flips somewhere


def _copy(ladder, name, new):
    dst = ladder["tmp"] / "bad" / new
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(ladder["dirs"][0].parent / name, dst)
    return dst


@pytest.mark.parametrize("what", ["schema", "items", "tokenizer", "teacher", "method"])
def test_mixing_incomparable_reports_is_refused(ladder, what):
    bad = _copy(ladder, "q4", f"q4-{what}")
    rep = json.loads((bad / "report.json").read_text())
    field = {"schema": "schema", "items": "item ids", "tokenizer": "tokenizer_hash", "teacher": "teacher tokens", "method": "method"}[what]
    if what == "schema":
        rep["schema"] = "logitdiff.report/3"
    elif what == "items":
        rep["items"] = rep["items"][1:]
    elif what == "tokenizer":
        rep["reference"]["tokenizer_hash"] = "sha256:other"
    elif what == "method":
        rep["method"]["kind"] = "top_k"
    else:
        import pyarrow as pa

        t = pq.read_table(bad / "tokens.parquet")
        ids = t.column("token_id").to_numpy().copy()
        ids[5] = (ids[5] + 1) % V
        pq.write_table(t.set_column(t.schema.get_field_index("token_id"), "token_id", pa.array(ids)), bad / "tokens.parquet")
    (bad / "report.json").write_text(json.dumps(rep))
    first = ladder["dirs"][0]
    with pytest.raises(LogitdiffError) as e:
        write_html([first, bad], ladder["tmp"] / "bad.html")
    msg = str(e.value)
    if what == "schema":  # another major version is refused on reading, before any mixing
        assert msg.startswith(f"{bad / 'report.json'}: field 'schema' is 'logitdiff.report/3'") and "\n" not in msg
        return
    assert str(first) in msg and str(bad) in msg and field in msg and "\n" not in msg
    assert not (ladder["tmp"] / "bad.html").exists()


def test_render_without_tokens_uses_report_rows(ladder):
    reports = list(ladder["reports"].values())
    page = render_html(reports, [None] * len(reports), title="rows only <x>")
    data = _embedded(page, "logitdiff-data")
    assert data["candidates"] == ["test:q8", "test:q4", "test:q2"]  # no paths: named by candidate spec
    assert data["kl_cdf"]["test:q2"]["n"] == reports[2]["summary"]["positions"]
    assert "<title>rows only &lt;x&gt;</title>" in page


def _parser():
    from logitdiff.cli import build_parser

    return build_parser()


def test_cli_report(ladder, capsys):
    out = ladder["tmp"] / "cli" / "ladder.html"
    args = _parser().parse_args(["report", str(ladder["tmp"] / "out"), "--out", str(out), "--title", "Ladder"])
    assert args.func(args) == 0
    text = out.read_text(encoding="utf-8")
    assert "<title>Ladder</title>" in text
    assert _embedded(text, "logitdiff-data")["candidates"] == ["q2", "q4", "q8"]  # a run dir without summary.json: sorted
    with pytest.raises(SystemExit):
        _parser().parse_args(["report", str(ladder["dirs"][0])])  # --out is required
    from logitdiff.cli import main

    assert main(["report", str(ladder["tmp"] / "nope"), "--out", str(out)]) == 2
    assert "no such directory" in capsys.readouterr().err
    help_text = _parser()._subparsers._group_actions[0].choices["report"].format_help()
    assert "REPORT_DIR" in help_text and "--title" in help_text and "self-contained" in help_text


def _chromium(url, *extra, timeout=120):
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=10000", *extra, url],
            capture_output=True, text=True, timeout=timeout,
        )


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (scripts/install_chromium.sh installs it)")
def test_page_renders_in_headless_chromium(ladder):
    r = _chromium(ladder["page"].resolve().as_uri() + "#selftest", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]
    bad = [ln for ln in console if re.search(r"Uncaught|Error|error|violates|Refused", ln)]
    assert not bad, bad
    m = re.search(r'<pre id="selftest-result">(.*?)</pre>', r.stdout, re.S)
    assert m, "the #selftest hook did not run"
    res = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert res["errors"] == []
    figs = [f["id"] for f in _embedded(ladder["html"], "logitdiff-figures")]
    assert set(res["plots"]) == set(figs)
    assert all(n >= 1 for n in res["plots"].values()), res["plots"]  # plotly drew its main-svg in every plot
    assert r.stdout.count("main-svg") >= len(figs)
    kls = sorted(rep["summary"]["metrics"]["kl_nats"]["mean"] for rep in ladder["reports"].values())
    assert res["sort"]["ok"] and res["sort"]["asc"] == kls and res["sort"]["desc"] == kls[::-1]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (scripts/install_chromium.sh installs it)")
def test_screenshot_is_not_blank(ladder):
    shot = ladder["tmp"] / "shot.png"
    r = _chromium(ladder["page"].resolve().as_uri(), f"--screenshot={shot}", "--window-size=1400,2000")
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000  # a blank page compresses to a few kB


def test_render_from_dataframes_equals_write_html(ladder):
    reports = [ladder["reports"][d.name] for d in ladder["dirs"]]
    frames = [pq.read_table(d / "tokens.parquet").to_pandas() for d in ladder["dirs"]]
    page = render_html(reports, frames, paths=ladder["dirs"])
    a, b = _embedded(page, "logitdiff-data"), _embedded(ladder["html"], "logitdiff-data")
    for key in ("candidates", "matrix", "kl_cdf", "ref_confidence", "worst_items", "pairs", "pareto"):
        assert a[key] == b[key], key


# ----------------------------------------------------------------------------- top-5 hover
def _token_titles(page, candidate, item_id):
    """position -> unescaped title of each token span of ``item_id`` in ``candidate``'s token view."""
    view = page.split(f"<summary>{candidate}: ", 1)[1].split("</details>", 1)[0]
    block = view.split(f"<h3><code>{item_id}</code>", 1)[1].split("</div>", 1)[0]
    titles = [htmlmod.unescape(t) for t in re.findall(r'<span[^>]* title="([^"]*)"', block)]
    return {int(re.match(r"position (\d+) ", t).group(1)): t for t in titles}


def _quoted(tok):
    t = readable_token(tok)
    return "'" + t.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") + "'"


def _worst_flip(ladder, name):
    """tokens.parquet row of the highest-KL top-1 flip inside the candidate's worst item."""
    data = _embedded(ladder["html"], "logitdiff-data")
    worst = data["worst_items"][name][0]["id"]
    t = pq.read_table(ladder["dirs"][0].parent / name / "tokens.parquet").to_pandas()
    sel = t[(t.item_id == worst) & ~t.top1_match]
    assert len(sel), "the noisiest candidate flips in its worst item"
    return worst, sel.loc[sel.kl_nats.idxmax()]


def test_token_view_hover_shows_both_top5(ladder):
    worst, row = _worst_flip(ladder, "q2")
    title = _token_titles(ladder["html"], "q2", worst)[int(row.position)]
    assert len(row.top5_ref_tokens) == len(row.top5_cand_tokens) == 5
    ref_line = next(ln for ln in title.split("\n") if ln.startswith("reference top-5: "))
    cand_line = next(ln for ln in title.split("\n") if ln.startswith("candidate top-5: "))
    want_ref = " · ".join(f"{_quoted(t)} {100 * p:.2f} %" for t, p in zip(row.top5_ref_tokens, row.top5_ref_p))
    want_cand = " · ".join(f"{_quoted(t)} {100 * p:.2f} %" for t, p in zip(row.top5_cand_tokens, row.top5_cand_p))
    assert ref_line == f"reference top-5: {want_ref}  ← FLIP"
    assert cand_line == f"candidate top-5: {want_cand}"
    # Each list is the model's own ranking: the reference's first token is its top-1, and so on.
    assert row.top5_ref_tokens[0] == row.reference_top_token and row.top5_cand_tokens[0] == row.candidate_top_token
    assert list(row.top5_ref_p) == sorted(row.top5_ref_p, reverse=True)
    assert "reference top-1 " not in title  # the top-5 lines replace the top-1 line


def test_token_view_hover_escapes_top5_tokens(ladder):
    # The special tokens are the reference's top-1 at code-1 positions 3..6, so they head its top-5.
    data = _embedded(ladder["html"], "logitdiff-data")
    name = next(n for n in NOISE if "code-1" in [w["id"] for w in data["worst_items"][n]])
    titles = _token_titles(ladder["html"], name, "code-1")
    assert titles[3].split("reference top-5: '<script>alert(1)</script>' ")[1]
    assert "reference top-5: ' hello world' " in titles[4]
    assert "reference top-5: '\\n' " in titles[5]
    assert "reference top-5: 'a&b\"c' " in titles[6]
    assert "<script>alert(1)</script>" not in ladder["html"]


def test_token_view_hover_without_token_strings_or_top5(ladder):
    name = "q2"
    worst, row = _worst_flip(ladder, name)
    reports = [ladder["reports"][d.name] for d in ladder["dirs"]]
    frames = [pq.read_table(d / "tokens.parquet").to_pandas() for d in ladder["dirs"]]
    k = [d.name for d in ladder["dirs"]].index(name)
    # report.json rows carry top-5 ids and probabilities but no strings: ids are shown.
    assert "top5_ref_ids" in reports[k]["rows"][0] and "top5_ref_tokens" not in reports[k]["rows"][0]
    page = render_html(reports, [None] * len(reports), paths=ladder["dirs"])
    title = _token_titles(page, name, worst)[int(row.position)]
    assert f"reference top-5: {' · '.join(f'#{int(i)} {100 * p:.2f} %' for i, p in zip(row.top5_ref_ids, row.top5_ref_p))}" in title
    # A tokens.parquet from before the top-5 columns: today's top-1 line.
    old = [f.drop(columns=[c for c in f.columns if c.startswith("top5_") or c.startswith("p_top1_")]) for f in frames]
    page = render_html(reports, old, paths=ladder["dirs"])
    title = _token_titles(page, name, worst)[int(row.position)]
    assert "top-5" not in title
    assert f"reference top-1 {_quoted(row.reference_top_token)} · candidate top-1 {_quoted(row.candidate_top_token)}  ← FLIP" in title
    # ... and reference confidence falls back to p_ref_token where the teacher is the reference's top-1.
    data = _embedded(page, "logitdiff-data")
    assert data["ref_confidence"]["column"].startswith("p_ref_token where")
    assert "p_top1_ref" in _embedded(ladder["html"], "logitdiff-data")["ref_confidence"]["column"]
    assert "exllamav3" in ladder["html"]


def test_flips_and_tool_calls_columns(ladder):
    """The consequences table shows the outcome columns that occur on the page (here a judge's
    benign / meaning_changed and recovered), not ten columns of which most are 0 everywhere."""
    from logitdiff.contracts import Outcome

    conseq = re.search(r'<table id="consequences".*?</table>', ladder["html"], re.S).group(0)
    for key in ("flips_n_flips", "flips_n_branches", "flips_recovered", "flips_benign", "flips_meaning_changed", "flips_n_ties",
                "tool_call_valid_cand", "accuracy_cand"):
        assert f'data-key="{key}"' in conseq, key
    for o in set(Outcome.ALL) - {"recovered", "benign", "meaning_changed"}:
        assert f'data-key="flips_{o}"' not in conseq, o


# ----------------------------------------------------------------------------- gates
def test_gates_crossed_shown_in_red_per_candidate(ladder):
    from logitdiff.report.gates import evaluate, parse_gates

    gates = parse_gates("kl_mean>0.01, meaning_changed>0, accuracy_drop>=0.25")
    reports = [json.loads(json.dumps(ladder["reports"][d.name])) for d in ladder["dirs"]]
    for r in reports:
        r["gates"] = evaluate(r, gates)
    by = {d.name: r for d, r in zip(ladder["dirs"], reports)}
    assert by["q4"]["gates"]["crossed"] == ["kl_mean>0.01", "meaning_changed>0", "accuracy_drop>=0.25"]
    page = render_html(reports, [None] * len(reports), paths=ladder["dirs"])
    dd = re.search(r"<dt>gates</dt><dd>(.*?)</dd>", page, re.S).group(1)
    lines = dict(re.match(r"<code>([^<]+)</code>: (.*)", ln, re.S).groups() for ln in dd.split("<br>")[:3])
    assert set(lines) == {"q8", "q4", "q2"}
    for name, line in lines.items():
        crossed, missing = by[name]["gates"]["crossed"], by[name]["gates"]["not_evaluated"]
        if crossed:
            assert f'<span class="crossed">✗ crossed {len(crossed)} of 3:</span>' in line
        else:
            assert "crossed" not in line, name
        for g in crossed:
            assert f"{htmlmod.escape(g)} (" in line
        # q8/q2 have no flips or correctness section: those gates are not evaluated, never crossed
        assert missing == ([] if name == "q4" else ["meaning_changed>0", "accuracy_drop>=0.25"]), name
        if missing:
            assert f'<span class="unevaluated">? not evaluated {len(missing)} of 3:</span>' in line
            assert "meaning_changed&gt;0 (the report has no flips section" in line and "meaning_changed&gt;0 (" not in line.split("unevaluated")[0]
    assert "accuracy_drop&gt;=0.25 (0.25)" in lines["q4"]
    assert ".crossed{color:#c62828" in page
    data = _embedded(page, "logitdiff-data")
    assert data["gates"]["q4"] == by["q4"]["gates"]
    matrix = re.search(r'<table id="matrix".*?</table>', page, re.S).group(0)
    assert matrix.count('class="badge bad"') == sum(bool(r["gates"]["crossed"]) for r in reports) >= 2
    assert matrix.count("gates not evaluated</span>") == 2  # q8 and q2: a badge of its own, not the red one
    # A passing candidate says so; a page without gates has no gates row.
    reports[0]["gates"] = evaluate(reports[0], parse_gates("kl_max>100"))
    page = render_html(reports[:1], [None], paths=ladder["dirs"][:1])
    assert '<span class="passed">✓ passed all 1 gates</span>' in page and 'class="badge bad"' not in page
    assert "<dt>gates</dt>" not in ladder["html"]


# ----------------------------------------------------------------------------- answers first, fits the window
# The flips fields schema 1.2 adds (flips.py / consequences.py write them; the page reads them by name).
SCHEMA_1_2_FLIPS = {
    "left_out": {"n": 3, "n_items": 2, "list": [{"item_id": "code-1", "position": 7, "kl_nats": 0.25, "margin_ref": 0.1}]},
    "changed_items": [{"item_id": "math-1", "change": "right→wrong", "branched": True, "position": 4, "outcome": "meaning_changed", "why_not": None},
                      {"item_id": "tool-1", "change": "wrong→right", "branched": False, "position": None, "outcome": None,
                       "why_not": "no top-1 flip before the answer"}],
    "reference_self_consistency": {"n_positions": 71, "n_written_not_top1": 2, "rate": 2 / 71, "n_candidate_wrote_it": 1, "list": []},
    "outputs_cut": {"n_items": 4, "reference_cut": 1, "n_branches": 6, "branches_cut": 2},
}
LADDER_NAMES = ["tiny-BF16", "tiny-Q8_0", "tiny-Q6_K", "tiny-Q4_K_M", "tiny-IQ4_XS", "tiny-Q3_K_M", "tiny-Q2_K"]


def _full_page(ladder):
    """The widest page a default run makes: eight candidates named as `run` names them, every
    one with flips, correctness, gates (crossed and not evaluated), both floors and the
    fields schema 1.2 adds; plus its summary.json's cross-engine floor."""
    from logitdiff.report.gates import evaluate, parse_gate_options

    base = [ladder["reports"][d.name] for d in ladder["dirs"]]
    reports, paths, rows = [], [], []
    for i, name in enumerate(LADDER_NAMES + ["tiny-Q2_K-long-name-x"]):
        r = json.loads(json.dumps(base[i % 3]))
        r["candidate"]["spec"] = f"builtin:{name}"
        r["flips"] = _flips_section()
        r["flips"] |= SCHEMA_1_2_FLIPS
        if i % 2:  # proven intervals under the means, as a bounded method writes them (the widest cells)
            r["method"]["bounds"] = "compact-bounded"
            for m in ("kl", "kl_rev", "jsd"):
                r["summary"][f"{m}_lower_nats_mean"], r["summary"][f"{m}_upper_nats_mean"] = 1.23456e-05, None
        r["correctness"] = json.loads(json.dumps(ladder["reports"]["q4"]["correctness"])) | {
            "tool_call_valid_ref": 1.0, "tool_call_valid_cand": 0.9166, "n_tool_items": 12, "cut_cand": 2, "truncated_cand": 1}
        r["gates"] = evaluate(r, parse_gate_options("kl_mean>0.0001,tool_call_malformed>0", "x_noise_floor<=1000000"))
        reports.append(r)
        paths.append(f"/tmp/out/reports/{name}")
        rows.append({"candidate": r["candidate"]["spec"], "x_cross_engine_floor": 1.0 + 137.3 * i})
    summary = {"cross_engine_floor": {"candidate": "builtin:tiny-BF16", "kl_nats_mean": 5.6e-5}, "candidates": rows,
               "workload": "src/logitdiff/builtin/workload.jsonl"}
    return render_html(reports, [None] * len(reports), paths=paths, summary=summary), reports


def test_verdict_line_per_candidate_first(ladder):
    from logitdiff.report.verdict import verdict

    page, reports = _full_page(ladder)
    body = page.split("<body>", 1)[1]
    # the verdicts come before the tables and before the metadata
    assert body.index('id="verdicts"') < body.index('id="matrix"') < body.index('id="setup"') < body.index("<dt>reference</dt>")
    items = re.findall(r'<li data-name="([^"]+)"><code>[^<]+</code> (.*?)</li>', page, re.S)
    assert [n for n, _ in items] == LADDER_NAMES + ["tiny-Q2_K-long-name-x"]
    by = dict(items)
    plain = {n: htmlmod.unescape(re.sub(r"<[^>]+>", "", t)) for n, t in by.items()}
    assert plain["tiny-BF16"].startswith("the cross-engine floor (reference weights, other engine): mean KL")
    assert plain["tiny-Q8_0"].startswith("drifts 138× cross-engine floor (mean KL ")  # 1 + 137.3, from summary.json
    assert "within 2× of the engine change" not in plain["tiny-Q8_0"]
    for n, text in plain.items():
        assert "1 of 6 counterfactual branches (the candidate's token forced at a flip) with a bad verdict: meaning changed (judged by test:judge) 1; 1 of 2 changed answers have no branched flip (listed on the page)" in text, n
        assert "free-running accuracy 75.0 % [25.0–100.0 %] → 50.0 % [0.0–100.0 %] (4 labelled): 2 right→wrong, 1 wrong→right, McNemar p = 1 (not significant)" in text, text
        assert "valid tool calls 91.7 % (reference 100.0 %)" in text and "2 outputs cut at the token budget" in text
        assert "gates crossed: kl_mean>0.0001" in text and "not evaluated" not in text.split("gates crossed")[0]
    # the same words as report.verdict, from the same numbers
    assert [t for _, t in verdict(reports[3], x_cross_engine_floor=1.0 + 137.3 * 3)] == plain["tiny-Q4_K_M"].split(" · ")


def test_significance_is_said(ladder):
    from logitdiff.report.verdict import answers_part

    c = dict(ladder["reports"]["q4"]["correctness"], right_to_wrong=9, wrong_to_right=0, mcnemar_p=0.0039, accuracy_cand=0.3)
    sev, text = answers_part({"correctness": c})
    assert sev == "bad" and "McNemar p = 0.0039 (significant)" in text
    sev, text = answers_part({"correctness": dict(c, right_to_wrong=0, wrong_to_right=0, accuracy_cand=0.75, items_right_to_wrong=[],
                                                  items_wrong_to_right=[])})
    assert sev == "ok" and text.endswith("no answer changed")
    # counts of 0 beside items listed: the listed items are the changes said (never "no answer changed" beside them)
    sev, text = answers_part({"correctness": dict(c, right_to_wrong=0, wrong_to_right=0, accuracy_cand=0.75, mcnemar_p=1.0)})
    assert sev == "warn" and "2 right→wrong, 1 wrong→right" in text and "no answer changed" not in text


def test_one_name_per_column_everywhere(ladder, capsys, monkeypatch):
    """The floor columns (and the rest of the run table) carry one name on every surface."""
    from logitdiff.cli.run import print_run_summary
    from logitdiff import contracts
    from logitdiff.contracts import schema
    from logitdiff.contracts import Outcome
    from logitdiff.report.metric_registry import CONSEQUENCE_TABLE, DRIFT_TABLE, METRICS, consequence_columns, header
    from logitdiff.pipeline import render_summary_md
    from pathlib import Path

    page, _ = _full_page(ladder)
    row = {"candidate": "builtin:tiny-Q2_K", "name": "tiny-Q2_K", "report": "r", "kl_mean": 0.02, "kl_mean_ci95": [0.01, 0.03],
           "kl_p99": 0.1, "kl_max": 1.0, "kl_rev_mean": 0.02, "jsd_mean": 0.005, "top1_disagreement": 0.1,
           "top1_disagreement_ci95": [0.09, 0.11], "ppl_ratio": 1.01, "x_noise_floor": 1.6e5, "within_2x_noise_floor": False,
           "x_cross_engine_floor": 471.0, "flip_branches": 24, "flip_ties": 5,
           "flip_outcomes": {"recovered": 1, "answer_same": 0, "tests_passed": 0, "diverged": 20, "answer_changed": 3, "tests_failed": 0,
                             "tool_call_changed": 0, "tool_call_malformed": 0}, "flip_meaning_judged_by": None,
           "accuracy_ref": 0.95, "accuracy_cand": 0.875, "right_to_wrong": 3, "wrong_to_right": 0, "mcnemar_p": 0.25,
           "tool_call_valid_cand": 1.0}
    summary = {"reference": "builtin:tiny", "items": 68, "positions": 1806, "workload": "w", "seconds": 1.0, "candidates": [row],
               "noise_floor": {"kl_nats_mean": 1.6e-7, "top1_disagreement": 0.0, "rerun": "r"}, "cross_engine_floor": None}
    from rich.console import Console

    import logitdiff.cli.run as cli_run

    monkeypatch.setattr(cli_run, "table_console", lambda width=400: Console(width=400))  # wide enough not to fold a header
    print_run_summary(summary)
    terminal = " ".join(capsys.readouterr().out.split())
    md = render_summary_md(summary)
    desc = schema("summary")["$defs"]["candidate_row"]["properties"]
    for key in ("x_noise_floor", "x_cross_engine_floor"):
        name = header(key)
        assert name in md and name in page and desc[key]["description"].startswith(name + ":"), key
        assert name in terminal, key
    # the summary tables' columns are the registry's, under the registry's headers: no second table of names
    assert not hasattr(contracts, "Column")
    assert set(DRIFT_TABLE) | (set(CONSEQUENCE_TABLE) - {"accuracy", "attributed"}) <= set(METRICS)
    # of the outcome columns, those that occur in some row (ten would not fit); none of a judge's without one
    shown = consequence_columns([row])
    assert [k for k in shown if k in Outcome.ALL] == ["recovered", "diverged", "answer_changed"]
    for text in (md, terminal):
        assert not re.search(r"\bbenign\b|meaning.changed|tests passed", text), text
    for key in (*DRIFT_TABLE, *shown):
        assert header(key) in md, key
        assert header(key) in terminal, key
        if key in ("kl_mean", "kl_p99", "jsd_mean", "top1_disagreement", "ppl_ratio", "flip_branches", "flip_ties", "right_to_wrong",
                   "wrong_to_right", "mcnemar_p", "tool_call_valid_cand"):  # the page shows accuracy as two columns, ref and cand
            assert f">{htmlmod.escape(header(key))}</th>" in page, key
    # the other names this column once had are gone from every surface and from the sources
    src = Path(__file__).resolve().parents[1] / "src" / "logitdiff"
    for old in ("× BF16 floor", "× engine floor", "BF16 floor"):
        assert old not in page and old not in md and old not in terminal
        for f in src.rglob("*.py"):
            assert old not in f.read_text(encoding="utf-8"), (f, old)


def _layout(page_path, width):
    r = _chromium(page_path.resolve().as_uri() + "#selftest", "--dump-dom", f"--window-size={width},1200")
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<pre id="selftest-result">(.*?)</pre>', r.stdout, re.S)
    assert m, "the #selftest hook did not run"
    return json.loads(htmlmod.unescape(m.group(1)))


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (scripts/install_chromium.sh installs it)")
@pytest.mark.parametrize("width", [1400, 1920])
def test_candidate_tables_fit_the_window_in_chromium(ladder, width):
    page, _ = _full_page(ladder)
    path = ladder["tmp"] / f"full-{width}.html"
    path.write_text(page, encoding="utf-8")
    res = _layout(path, width)
    lay = res["layout"]
    assert res["errors"] == []
    assert lay["width"] == width, lay
    assert set(lay["tables"]) == {"matrix", "consequences"}
    for tid, t in lay["tables"].items():
        # no horizontal scrolling: the table is no wider than its box, and the box inside the window
        assert t["scroll"] <= t["client"] and t["right"] <= width, (width, tid, t)
    assert lay["doc"] <= width, lay
    assert lay["verdicts"]["n"] == len(LADDER_NAMES) + 1 and lay["verdicts"]["top"] < 200, lay["verdicts"]


def test_run_writes_each_candidates_own_page(ladder):
    """reports/<name>/report.html, as README's Files section says: that candidate's page,
    with the run's cross-engine floor, written beside its report.json."""
    from logitdiff.report import write_candidate_page

    d = ladder["dirs"][1]
    summary = {"cross_engine_floor": {"candidate": "test:q8", "kl_nats_mean": 0.01},
               "candidates": [{"candidate": "test:q4", "x_cross_engine_floor": 12.5}]}
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "report.html"}
    out = write_candidate_page(d, summary)
    assert out == d / "report.html"
    text = out.read_text(encoding="utf-8")
    data = _embedded(text, "logitdiff-data")
    assert data["candidates"] == ["q4"] and data["matrix"]["q4"]["x_cross_engine_floor"]["value"] == 12.5
    assert "drifts 12.5× cross-engine floor" in htmlmod.unescape(text)
    assert not (ladder["tmp"] / "out" / "reports" / "q4" / "report.html").samefile(ladder["page"])
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.name != "report.html"} == before  # nothing else touched
    assert not [p for p in d.iterdir() if p.name.startswith(".")]


def test_page_says_what_the_branches_leave_out(ladder):
    page, _ = _full_page(ladder)
    flips = htmlmod.unescape(re.sub(r"<[^>]+>", "", page.split('id="flips"', 1)[1].split('id="tokens"', 1)[0]))
    assert ("Answers or tool calls that changed: 2, 1 without a branched flip: math-1 right→wrong (branched at 4 → meaning_changed); "
            "tool-1 wrong→right (not branched: no top-1 flip before the answer)") in flips
    assert "Left out by the --max-branches cap: 3 selected flips in 2 items, not branched: code-1@7 (KL 0.25)" in flips
    assert "at 2 of 71 positions (2.82 %) the token the reference wrote is not its own scored top-1" in flips
    assert "at 1 of them the candidate picked the written token: not a flip, not branched" in flips
    assert "Cut at the token budget: 1 of 4 reference outputs and 2 of 6 branches." in flips
    conseq = re.search(r'<table id="consequences".*?</table>', page, re.S).group(0)
    keys = re.findall(r'<th data-sort="\w+" data-key="(\w+)"', conseq)
    assert keys[-3:] == ["mcnemar_p", "tool_call_valid_cand", "cut_cand"] and "flips_left_out" in keys and "flips_ref_not_top1" in keys
    row = re.search(r'<tr class="[^"]*" data-name="tiny-Q2_K">(.*?)</tr>', conseq, re.S).group(1)
    shown = dict(zip(keys, re.findall(r'<td data-v="([^"]*)"', row)))
    assert (shown["flips_left_out"], shown["flips_ref_not_top1"], shown["cut_cand"]) == ("3.0", "2.0", "2.0")


# ----------------------------------------------------------------------------- scripts/readme_figures.py
def test_readme_figures_script_writes_between_the_markers(ladder, tmp_path):
    """The script reads a run's OUT (summary.json, report.json, flips.parquet where present),
    writes the tables and figures between README's markers and nothing else."""
    import os
    import sys
    from pathlib import Path

    from logitdiff.contracts import RUN_SUMMARY_SCHEMA, SUMMARY_SCHEMA_VERSION, summary_json
    from logitdiff.pipeline import _summary_row

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    shutil.copytree(ladder["dirs"][0].parent, out / "reports")
    noise = ladder["reports"]["q8"]["summary"]["noise_floor"]
    rows = []
    for d in ladder["dirs"]:
        rep = json.loads((out / "reports" / d.name / "report.json").read_text())
        rows.append(_summary_row(rep["candidate"]["spec"], rep, out / "reports" / d.name, noise))
    for r in rows:
        r["x_cross_engine_floor"] = r["kl_mean"] / rows[0]["kl_mean"]
    summary = {"schema": RUN_SUMMARY_SCHEMA, "schema_version": SUMMARY_SCHEMA_VERSION, "reference": "test:ref", "workload": "w.jsonl",
               "workload_sha256": "0" * 64, "items": 4, "positions": 71, "noise_floor": noise,
               "cross_engine_floor": {"candidate": "test:q8", "kl_nats_mean": rows[0]["kl_mean"]}, "candidates": rows, "seconds": 12.5}
    (out / "summary.json").write_text(summary_json(summary, str(out / "summary.json")))
    readme = tmp_path / "README.md"
    readme.write_text("# head\n\ntext before\n<!-- readme_figures:begin -->\nold figures\n<!-- readme_figures:end -->\ntext after\n")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    script = [sys.executable, str(root / "scripts" / "readme_figures.py"), "--from", str(out), "--readme", str(readme)]
    r = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    text = readme.read_text()
    assert text.startswith("# head\n\ntext before\n<!-- readme_figures:begin -->\n") and text.endswith("<!-- readme_figures:end -->\ntext after\n")
    assert "old figures" not in text
    for row in rows:
        assert f"| `{row['candidate']}` | {row['kl_mean']:.2e} |" in text
    assert f"mean KL {noise['kl_nats_mean']:.2e} nats" in text and "4-item workload, 71 teacher-forced positions" in text
    # q4 has flips (2 benign / 1 meaning changed by the fixture's judge) and correctness: the second table and McNemar p come from its report
    assert "| `test:q4` | 6 | 3 | 0 | 0 / 0 | 0 / 0 | 2 / 1 |" in text and "McNemar p = 1" in text
    # a second run changes nothing; --check agrees; a README without the markers is refused
    assert subprocess.run(script, capture_output=True, text=True, env=env, timeout=300).returncode == 0 and readme.read_text() == text
    assert subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300).returncode == 0
    # one section per machine class: this machine's is rewritten, another class's kept as it is;
    # --check reads this class's section only, with the run's wall time and load left out
    sys.path.insert(0, str(root / "scripts"))
    import readme_figures as rf

    key = rf.machine_class()[0]
    assert text.count("<!-- readme_figures:class ") == 1 and f"<!-- readme_figures:class {key} -->\n" in text
    other = "<!-- readme_figures:class zz-other -->\nfigures of another machine class\n"
    readme.write_text(text.replace("<!-- readme_figures:end -->", "\n" + other + "<!-- readme_figures:end -->"))
    assert subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300).returncode == 0
    assert subprocess.run(script, capture_output=True, text=True, env=env, timeout=300).returncode == 0
    two = readme.read_text()
    assert "figures of another machine class" in two and two.count("<!-- readme_figures:class ") == 2
    assert two.index(f"class {key} -->") < two.index("class zz-other -->")  # sorted by key
    # another run's wall time and load, wrapped otherwise: not a difference; a figure beside them is
    timed = ("on X: `logitdiff run --out DIR` into a fresh directory (GGUF ladder cached) took {} s wall (`summary.json` "
             "seconds: {}); load average (1/5/15 min) {} before and {} after, so {}. Mean KL 1.2e-04.")
    a = timed.format(44, 40.2, "1.2/1.0/1.4", "1.1/1.0/1.4", "other work shared the machine")
    b = timed.format(284, 264.5, "0.1/0.2/0.3", "0.2/0.2/0.3", "the machine was otherwise quiet").replace(" took", "\ntook")
    assert rf.comparable(a) == rf.comparable(b) and rf.comparable(a) != rf.comparable(a.replace("1.2e-04", "1.3e-04"))
    readme.write_text(two.replace("| `test:q4` | 6 |", "| `test:q4` | 7 |"))  # a figure: a difference
    r = subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and f"({key}) differ" in r.stderr
    readme.write_text(two.replace(f"class {key} -->", "class zz-another -->"))  # no section for this class
    r = subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and f"no figures for this machine class ({key}" in r.stderr
    # a region it cannot parse is refused whole, README untouched (never a section silently dropped)
    for bad in (two.replace("class zz-other -->\n", "class zz-other --> \n"),  # marker not on a line of its own
                two.replace("<!-- readme_figures:begin -->\n", "<!-- readme_figures:begin -->\nstray text\n"),
                two.replace("class zz-other -->", f"class {key} -->")):  # a class twice
        readme.write_text(bad)
        r = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode != 0 and "readme_figures:" in r.stderr and readme.read_text() == bad, r.stderr
    # end to end with a run's timing (readme_figures.timing.json, as a fresh run keeps it): another
    # run's wall time and load, another CPU model name and memory of the same class are no
    # difference to --check; other cores are
    readme.write_text(two)
    timing = {"wall_s": 44.2, "load_before": "1.2/1.0/1.4", "load_after": "1.1/1.0/1.4",
              "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 24, "class": key, "isa": rf.machine_class()[1]}}
    saved = out / "readme_figures.timing.json"
    saved.write_text(json.dumps(timing))
    assert subprocess.run(script, capture_output=True, text=True, env=env, timeout=300).returncode == 0
    timed_text = readme.read_text()
    assert "took 44 s wall" in timed_text and "on AMD EPYC (" in timed_text
    other_run = {**timing, "wall_s": 1284.0, "load_before": "9.0/8.0/7.0", "load_after": "0.1/0.1/0.1",
                 "machine": {**timing["machine"], "cpu": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "memory_gib": 256}}
    saved.write_text(json.dumps(other_run))
    r = subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and readme.read_text() == timed_text, r.stderr
    saved.write_text(json.dumps({**other_run, "machine": {**other_run["machine"], "cores": 16}}))
    r = subprocess.run(script + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "differ" in r.stderr
    # README's table (summary markers, one class): rewritten and compared row by row on this class
    # only; --readme FILE alone never reaches README.md
    table = tmp_path / "TABLE.md"
    table.write_text(f"# t\n{rf.SUMMARY_BEGIN}\n<!-- readme_figures:class {key} -->\nold\n{rf.SUMMARY_END}\nafter\n")
    readme.write_text(two)
    with_table = script + ["--summary", str(table)]
    saved.unlink()
    r = subprocess.run(with_table, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and f"table for {key} rewritten" in r.stderr, r.stderr
    r = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)  # --readme alone: that file only
    assert r.returncode == 0 and str(root / "README.md") not in r.stderr and str(table) not in r.stderr, r.stderr
    t1 = table.read_text()
    assert "old" not in t1 and t1.endswith(f"{rf.SUMMARY_END}\nafter\n") and t1.count("| `test:") == len(rows)
    assert f"| `{rows[0]['candidate']}` | {rows[0]['kl_mean']:.2e} |" in t1 and "flip" not in t1.split(rf.SUMMARY_BEGIN)[1]
    r = subprocess.run(with_table + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and f"({len(rows)} rows compared)" in r.stderr, r.stderr
    row0 = f"| `{rows[0]['candidate']}` | {rows[0]['kl_mean']:.2e} |"
    table.write_text(t1.replace(row0, f"| `{rows[0]['candidate']}` | 9.99e-09 |"))  # a figure in README's table: a difference
    r = subprocess.run(with_table + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and f"its table ({key}) differs" in r.stderr and "-| `test:q8` | 9.99e-09 |" in r.stderr, r.stderr
    table.write_text(t1.replace(f"class {key} -->", "class zz-other -->"))  # another class's table: said, not compared
    r = subprocess.run(with_table + ["--check"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "of machine class zz-other, not this one" in r.stderr and "not compared" in r.stderr, r.stderr
    for bad in ("no markers\n", t1.replace(f"<!-- readme_figures:class {key} -->\n", "")):  # no markers; no class in them
        table.write_text(bad)
        r = subprocess.run(with_table, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode != 0 and "readme_figures:" in r.stderr and table.read_text() == bad, r.stderr
    readme.write_text("no markers\n")
    r = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "readme_figures:begin" in r.stderr and readme.read_text() == "no markers\n"
    # the repository: docs/figures.md has one region, a section per machine class measured;
    # README's table is the first table of its class's section there, figure for figure
    page = (root / "docs" / "figures.md").read_text(encoding="utf-8")
    assert page.count("<!-- readme_figures:begin -->") == 1 == page.count("<!-- readme_figures:end -->")
    secs = rf.sections(page.split("<!-- readme_figures:begin -->")[1].split("<!-- readme_figures:end -->")[0])
    assert {"amd-avx2", "amd-avx512bf16", "intel-avx512bf16-amx"} <= set(secs)
    real = (root / "README.md").read_text(encoding="utf-8")
    assert "<!-- readme_figures:begin -->" not in real and real.count(rf.SUMMARY_BEGIN) == 1 == real.count(rf.SUMMARY_END)
    (cls, readme_table), = rf.sections(real.split(rf.SUMMARY_BEGIN)[1].split(rf.SUMMARY_END)[0]).items()
    assert readme_table == rf.first_table(secs[cls]) and readme_table.count("| `builtin:tiny-") == 7


def test_readme_figures_machine_class_from_cpuinfo():
    """The class key is the vendor and the widest SIMD level the kernels take (what moves the
    figures), read from /proc/cpuinfo's first processor."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import readme_figures as rf

    def info(vendor, flags):
        return f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t: sse\n"

    zen3 = "fpu sse sse2 avx fma avx2 bmi2 sha_ni vaes"
    assert rf.machine_class(info("AuthenticAMD", zen3)) == ("amd-avx2", "AVX2, no AVX-512")
    assert rf.machine_class(info("AuthenticAMD", zen3 + " avx512f avx512bw avx512_bf16")) == ("amd-avx512bf16", "AVX-512 BF16")
    assert rf.machine_class(info("GenuineIntel", zen3 + " avx512f amx_tile amx_bf16")) == ("intel-avx512-amx", "AVX-512, no BF16, AMX")
    assert rf.machine_class(info("GenuineIntel", "fpu sse sse2 avx")) == ("intel-noavx2", "no AVX2")
    assert rf.machine_class(info("HygonGenuine", zen3))[0] == "other-avx2"
    assert rf.machine_class("") == ("other-unknown", "instruction set unknown")


def test_pair_without_interval_says_not_evaluated():
    # --bootstrap 0 (or one item): paired_bootstrap gives no CI and no p-value; the pair cell
    # must say the ordering was not evaluated, not "cannot order" (a tested, inconclusive result)
    from logitdiff.report.html import _verdict
    from logitdiff.numerics.stats import paired_bootstrap

    r = paired_bootstrap([0.1, 0.2, 0.3], [0.5, 0.6, 0.9], n_boot=0)
    assert r["ci"] == [None, None] and r["p_two_sided"] is None
    cell = _verdict("a", "b", r, "g")
    assert "not evaluated" in cell and "cannot order" not in cell and "p =" not in cell
    tested = _verdict("a", "b", paired_bootstrap([0.1, 0.2, 0.3], [0.5, 0.6, 0.9], n_boot=200), "g")
    assert "not evaluated" not in tested


def test_pairs_use_the_reports_bootstrap_setting(ladder):
    """The adjacent-pair table resamples as often as its reports did (method.bootstrap: the
    run's --bootstrap and --seed) and says how many; with --bootstrap 0 it orders nothing and
    says 'not evaluated', as the rest of the page. A separable pair's bootstrap p-value is
    1 / (resamples + 1): the count actually used shows in the number itself."""
    import copy

    from logitdiff.report.html import load_tokens
    from logitdiff.numerics.stats import paired_bootstrap

    data = _embedded(ladder["html"], "logitdiff-data")
    assert {r["method"]["bootstrap"]["n"] for r in ladder["reports"].values()} == {200}
    assert data["pairs_bootstrap"] == {"n": 200, "seed": 0}
    for p in data["pairs"]:
        assert p["kl"]["separable"] and p["kl"]["p_two_sided"] == pytest.approx(1 / 201, rel=1e-12)
    note = htmlmod.unescape(ladder["html"].split("<h3>Can the candidates be ordered?</h3>")[1].split("</p>")[0])
    assert "200 resamples, seed 0" in note and "2,000" not in note

    reports = [json.loads((d / "report.json").read_text()) for d in ladder["dirs"]]
    tokens = [load_tokens(d / "tokens.parquet") for d in ladder["dirs"]]
    names = [d.name for d in ladder["dirs"]]

    def page(n, seed, n_of=None):
        reps = copy.deepcopy(reports)
        for r in reps:
            r["method"]["bootstrap"].update(n=(n_of or {}).get(r["candidate"]["spec"], n), seed=seed)
        text = render_html(reps, tokens, paths=[str(d) for d in ladder["dirs"]])
        return text, _embedded(text, "logitdiff-data"), htmlmod.unescape(
            text.split("<h3>Can the candidates be ordered?</h3>")[1].split("</table>")[0])

    # another seed and count: the page's intervals are the paired bootstrap's with them
    _, d7, section = page(50, 7)
    assert d7["pairs_bootstrap"] == {"n": 50, "seed": 7} and "50 resamples, seed 7" in section
    ids = [it["id"] for it in reports[0]["items"]]  # the per-item means the page pairs: report.json's
    ikl = {n: [{it["id"]: it["kl_nats"]["mean"] for it in r["items"]}[i] for i in ids] for n, r in zip(names, reports)}
    for p in d7["pairs"]:
        want = paired_bootstrap(ikl[p["a"]], ikl[p["b"]], n_boot=50, seed=7)
        assert p["kl"]["ci"] == pytest.approx(want["ci"], rel=1e-12) and p["kl"]["p_two_sided"] == want["p_two_sided"]
    # reports made with different settings: the fewest resamples, said so
    _, dm, section = page(200, 0, n_of={"test:q4": 30})
    assert dm["pairs_bootstrap"]["n"] == 30 and "30 resamples" in section and "fewest" in section
    # --bootstrap 0: no interval, no ordering, "not evaluated" in the note and in every cell
    _, d0, section = page(0, 0)
    assert d0["pairs_bootstrap"]["n"] == 0 and all(p["kl"]["ci"] == [None, None] for p in d0["pairs"])
    assert "not evaluated" in section.split("</p>")[0] and "resamples" not in section.split("</p>")[0]
    assert section.count("not evaluated: no interval") == 2 * len(d0["pairs"])
    assert "drifts more than" not in section and "cannot order" not in section


GRADED_OUTPUTS = {  # (output, cut by the token budget) per grade, for the label {"answer": "42"}
    "right": ("The answer is 42.", False),
    "wrong": ("The answer is 41.", False),
    "truncated": ("Let me work it out step by step: first", True),
}


@pytest.mark.parametrize("pairs", [
    [("right", "truncated"), ("right", "right")],                      # issue 40: accuracy 50 % -> 25 %, "no answer changed"
    [("right", "truncated"), ("wrong", "right")],
    [("right", "wrong"), ("right", "truncated"), ("truncated", "right")],
    [("right", "right"), ("wrong", "wrong"), ("truncated", "truncated"), ("wrong", "truncated")],
], ids=["r2t", "r2t+w2r", "r2w+r2t+t2r", "unchanged"])
def test_verdict_line_agrees_with_the_answers_the_report_lists(ladder, pairs):
    """The verdict's answers part says "no answer changed" exactly when the report lists no
    right→wrong, wrong→right or right→truncated item, and names each kind it lists with its
    count. The correctness section is the real one (grading.grade on real outputs, then
    consequences.correctness_section) inside a real report, rendered to report.md."""
    from logitdiff.flips.consequences import Settings, correctness_section
    from logitdiff.flips.grading import grade
    from logitdiff.report.verdict import answers_part, verdict_text

    rows = []
    for i, (ref, cand) in enumerate(pairs + [("right", "right"), ("wrong", "wrong")]):
        g = {side: grade({"answer": "42"}, *GRADED_OUTPUTS[which][:1], truncated=GRADED_OUTPUTS[which][1])
             for side, which in (("ref", ref), ("cand", cand))}
        rows.append({"item_id": f"math-{i}", "tags": ["math"], "check": g["ref"].check, "ref_correct": g["ref"].correct,
                     "cand_correct": g["cand"].correct, "ref_verdict": g["ref"].verdict, "cand_verdict": g["cand"].verdict,
                     "ref_cut": GRADED_OUTPUTS[ref][1], "cand_cut": GRADED_OUTPUTS[cand][1], "budget_tokens": 8,
                     "divergence_at_top1_flip": None})
    sec = correctness_section(rows, Settings(n_boot=50))
    report = dict(ladder["reports"]["q8"], correctness=sec)
    listed = {"right→wrong": sec["items_right_to_wrong"], "wrong→right": sec["items_wrong_to_right"],
              "right→truncated": sec["items_right_to_truncated"]}
    sev, text = answers_part(report)
    line = verdict_text(report)
    assert text in line
    changed = any(listed.values())
    assert text.endswith("no answer changed") is (not changed), text
    assert (sec["accuracy_ref"] != sec["accuracy_cand"]) <= changed  # a changed accuracy is never "no answer changed"
    for kind, items in listed.items():
        if items:
            assert f"{len(items)} {kind}" in text, (kind, text)
    if sec["items_right_to_truncated"]:
        assert sev != "ok" and f"{len(sec['items_right_to_truncated'])} right→truncated" in render_markdown(report)


REAL_LONG = ["unsloth/Qwen3-30B-A3B-Instruct-2507-UD-Q4_K_XL", "unsloth/Qwen3-30B-A3B-Instruct-2507-UD-Q5_K_XL",
             "unsloth/Qwen3-30B-A3B-Instruct-2507-UD-Q6_K_XL"]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (scripts/install_chromium.sh installs it)")
def test_the_longest_real_names_never_overprint_and_stay_distinguishable(ladder, capsys, monkeypatch):
    """Three real names that differ only at the end: each row shows a different name, its text
    stays inside its cell (Chromium, 1,400 px), the full name is on hover; the terminal table
    tells them apart too."""
    base = [ladder["reports"][d.name] for d in ladder["dirs"]]
    reports = []
    for i, name in enumerate(REAL_LONG):
        r = json.loads(json.dumps(base[i % 3]))
        r["candidate"]["spec"] = f"gguf:/models/{name}.gguf"
        r["flips"] = _flips_section()  # the consequences table lists the candidates too
        reports.append(r)
    page = render_html(reports, [None] * 3, paths=[f"/out/reports/{n.split('/')[1]}" for n in REAL_LONG])
    path = ladder["tmp"] / "long-names.html"
    path.write_text(page, encoding="utf-8")
    res = _layout(path, 1400)
    assert res["errors"] == []
    assert set(res["layout"]["cands"]) == {"matrix", "consequences"}
    for rows in res["layout"]["cands"].values():
        assert len(rows) == 3 and len({r["shown"] for r in rows}) == 3, rows
        assert sorted(r["title"].split(" — ")[0] for r in rows) == sorted(n.split("/")[1] for n in REAL_LONG)  # full names on hover
        for r in rows:
            assert r["inside"] and (r["next_left"] is None or r["next_left"] >= r["right"] - 0.5), r
            assert r["shown"].endswith(r["title"].split(" — ")[0].rsplit("-", 1)[1])  # the part that differs is shown
    # the terminal: the summary table's candidate column, at a narrow terminal width
    from rich.console import Console

    import logitdiff.cli.run as cli_run

    row = {"candidate": "", "kl_mean": 0.01, "kl_mean_ci95": [0.009, 0.011], "kl_p99": 0.1, "jsd_mean": 0.005,
           "top1_disagreement": 0.1, "ppl_ratio": 1.01, "x_noise_floor": None, "x_cross_engine_floor": None}
    summary = {"reference": "hf:/models/Qwen3-30B-A3B-Instruct-2507", "items": 2, "positions": 9, "workload": "w", "seconds": 1.0,
               "candidates": [{**row, "candidate": f"gguf:/models/{n}.gguf", "name": n.split("/")[1]} for n in REAL_LONG],
               "noise_floor": None, "cross_engine_floor": None}
    monkeypatch.setattr(cli_run, "table_console", lambda width=120: Console(width=120))
    cli_run.print_run_summary(summary)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "│" in ln and any(k in ln for k in ("Q4_K_XL", "Q5_K_XL", "Q6_K_XL"))]
    assert len(lines) >= 3 and all(any(k in ln for ln in lines) for k in ("Q4_K_XL", "Q5_K_XL", "Q6_K_XL")), out


# ----------------------------------------------------------------------------- a RUN's shared plotly.js
def _selftest(url):
    r = _chromium(url + "#selftest", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<pre id="selftest-result">(.*?)</pre>', r.stdout, re.S)
    assert m, "the #selftest hook did not run"
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln and re.search(r"violates|Refused", ln)]
    return json.loads(htmlmod.unescape(m.group(1))), console


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (scripts/install_chromium.sh installs it)")
def test_shared_plotly_draws_from_file_and_from_a_server_and_says_when_missing(ladder, tmp_path):
    """A page that loads a RUN's shared plotly.js (two directories up, as a candidate's page
    does) draws every plot opened from disk and served over HTTP, its policy refusing nothing
    it needs; the same page without the shared file says so in a visible line."""
    import functools
    import http.server
    import threading

    from logitdiff.report.html import PLOTLY_FILE, plotly_js, plotly_src_for

    run = tmp_path / "run"
    page_dir = run / "reports" / "q4"
    page_dir.mkdir(parents=True)
    (run / PLOTLY_FILE).write_text(plotly_js(), encoding="utf-8")
    src = plotly_src_for(page_dir, run)
    assert src == "../../plotly.min.js"
    reports = [ladder["reports"][d.name] for d in ladder["dirs"]]
    text = render_html(reports, [None] * len(reports), paths=ladder["dirs"], plotly_src=src)
    assert plotly_js() not in text and text.count('<script id="plotly-js" src="../../plotly.min.js"></script>') == 1
    assert len(text.encode()) < 1_000_000  # the figures and data, not plotly's ~4.7 MB
    (page_dir / "report.html").write_text(text, encoding="utf-8")
    figs = [f["id"] for f in _embedded(text, "logitdiff-figures")]
    assert figs

    res, refused = _selftest((page_dir / "report.html").resolve().as_uri())
    assert res["errors"] == [] and not refused, (res["errors"], refused)
    assert set(res["plots"]) == set(figs) and all(n >= 1 for n in res["plots"].values()), res["plots"]
    assert res["plotly_missing"] is False

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(run))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        res, refused = _selftest(f"http://127.0.0.1:{server.server_address[1]}/reports/q4/report.html")
    finally:
        server.shutdown()
        server.server_close()
    assert res["errors"] == [] and not refused, (res["errors"], refused)
    assert all(n >= 1 for n in res["plots"].values()) and set(res["plots"]) == set(figs)

    (run / PLOTLY_FILE).unlink()
    res, _ = _selftest((page_dir / "report.html").resolve().as_uri())
    assert res["plotly_missing"] is True and res["errors"] == ["plotly.js not loaded"]
    assert all(n == 0 for n in res["plots"].values())
    # a page written alone carries plotly itself, and no missing-file line
    alone = render_html(reports, [None] * len(reports), paths=ladder["dirs"])
    assert alone.count(plotly_js()) == 1 and 'id="plotly-missing"' not in alone and "<script id=\"plotly-js\" src" not in alone


# ----------------------------------------------------------------------------- verdict words, outcome colours
VERDICT_CASES = [  # (outcomes, judge, the flips part of the verdict line)
    ({"diverged": 24}, None, "none of 24 {B} with a bad verdict (checked answers, tests, tool calls); "
                             "24 branches diverged (meaning not judged: no --judge)"),
    ({"answer_changed": 20, "tool_call_changed": 3, "recovered": 1}, None,
     "23 of 24 {B} with a bad verdict: answer changed 20, tool call changed or malformed 3"),
    ({"tests_failed": 2, "tests_passed": 1, "diverged": 1}, None,
     "2 of 4 {B} with a bad verdict: tests failed 2; 1 branch diverged (meaning not judged: no --judge)"),
    ({"meaning_changed": 24}, "gguf:judge.gguf", "24 of 24 {B} with a bad verdict: meaning changed (judged by gguf:judge.gguf) 24"),
    ({"benign": 24}, "gguf:judge.gguf", "none of 24 {B} with a bad verdict (checked answers, tests, tool calls)"),
]


@pytest.mark.parametrize("outcomes, judge, want", VERDICT_CASES)
def test_verdict_calls_branches_counterfactual_on_page_and_terminal(ladder, outcomes, judge, want):
    """Every branch changed (or none did) while no free-running answer changed: on the page and
    in the terminal the flips are counterfactual branches and the accuracy is free-running, so
    the line never reads as "24 of 24 changed ... no answer changed". Diverged branches are
    neither bad nor harmless: counted apart, with the meaning said to be not judged; a judge's
    meaning_changed is bad and names the judge."""
    import io

    from rich.console import Console

    from logitdiff.cli.run import print_verdicts
    from logitdiff.contracts import Outcome

    n = sum(outcomes.values())
    r = json.loads(json.dumps(ladder["reports"]["q4"]))
    r["flips"]["n_branches"] = n
    r["flips"]["outcomes"] = {o: outcomes.get(o, 0) for o in (Outcome.ALL if judge else Outcome.RULE)}
    r["flips"]["meaning_judged_by"] = judge
    r["correctness"] |= {"accuracy_ref": 0.75, "accuracy_cand": 0.75, "right_to_wrong": 0, "wrong_to_right": 0, "mcnemar_p": 1.0,
                         "items_right_to_wrong": [], "items_wrong_to_right": [], "attribution": [],
                         "attributed": {"n": 0, "with_flip": 0, "divergence_at_first_flip": 0, "branched": 0, "outcomes": {}}}
    page = render_html([r], [None], paths=[ladder["dirs"][1]])
    li = re.search(r'<li data-name="[^"]+"><code>[^<]+</code> (.*?)</li>', page, re.S).group(1)
    on_page = htmlmod.unescape(re.sub(r"<[^>]+>", "", li))
    row = {"candidate": "test:q4", "name": "q4", "kl_mean": 1e-3, "x_noise_floor": 3.0, "flip_branches": n,
           "flip_outcomes": r["flips"]["outcomes"], "flip_meaning_judged_by": judge, "accuracy_ref": 0.75, "accuracy_cand": 0.75,
           "right_to_wrong": 0, "wrong_to_right": 0, "mcnemar_p": 1.0}
    con = Console(file=io.StringIO(), width=1000, record=True)
    print_verdicts({"candidates": [row]}, con)
    in_terminal = con.export_text()
    for text in (on_page, in_terminal):
        assert want.format(B="counterfactual branches (the candidate's token forced at a flip)") in text, text
        # (the terminal reads summary.json, whose rows do not carry the labelled count)
        # (nor the accuracies' CIs)
        assert re.search(r"free-running accuracy 75\.0 %( \[25\.0–100\.0 %\])? → 75\.0 %( \[0\.0–100\.0 %\])?( \(4 labelled\))?: "
                         r"no answer changed", text), text
        assert not re.search(r"\d+ of \d+ branches", text) and not re.search(r"(?<!free-running )accuracy \d", text), text


def test_one_colour_per_flip_outcome_on_every_page(ladder):
    """The by-tag bars and the branches table colour an outcome by the outcome, the same on
    the combined page and on each candidate's own, whichever outcomes a page has."""
    from logitdiff.contracts import Outcome
    from logitdiff.report.html import OUTCOME_COLORS

    assert set(OUTCOME_COLORS) == set(Outcome.ALL) and len(set(OUTCOME_COLORS.values())) == len(Outcome.ALL)
    base = ladder["reports"]["q4"]
    one, two = json.loads(json.dumps(base)), json.loads(json.dumps(base))
    # the second candidate's tags hold other outcomes, in another order (plotly's colourway
    # would colour its first outcome like the first one's first)
    two["flips"]["by_tag"] = {"code": {"meaning_changed": 2, "tool_call_malformed": 1, "benign": 0, "recovered": 0, "tool_call_changed": 1,
                                       "n": 4, "rates": {}}}
    two["flips"]["top"] = [{"item_id": "code-1", "position": 3, "outcome": o, "kl_nats": 0.1} for o in Outcome.ALL]
    colours = []
    for reports in ([one], [two], [one, two]):
        page = render_html(reports, [None] * len(reports), paths=[f"/tmp/x/{i}" for i in range(len(reports))])
        fig = next(f for f in _embedded(page, "logitdiff-figures") if f["id"] == "plot-flips-by-tag")
        seen = {t["name"]: t["marker"]["color"] for t in fig["data"]}
        assert seen and all(OUTCOME_COLORS[o] == c for o, c in seen.items()), seen
        colours.append(seen)
        # every outcome the page shows has its colour; one it does not show is not named at all
        on_page = {t["outcome"] for r in reports for t in r["flips"]["top"]} | {o for r in reports for o, n in r["flips"]["outcomes"].items() if n}
        for o, c in OUTCOME_COLORS.items():
            assert (f".outcome.{o}{{border-left:4px solid {c};" in page) == (o in on_page), o
    assert set(colours[1]) - set(colours[0])  # the pages do hold other outcomes, each in its one colour
