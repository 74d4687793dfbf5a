"""The report.json / summary.json contract: the declared types, the shipped JSON Schemas and the
writers and readers agree, and the domain words are declared once.

Reports here are real: synthetic RUNs written with RunWriter, compared with compare_runs and
turned into report.json by build_report / write_report_dir, as every command does.
"""

import json
import math
import re
import typing
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from test_compare import make_run  # the RUN writer of the report tests

from logitdiff import contracts as C
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.report import build_report, noise_floor_section, read_report, update_report_dir, write_report_dir
from logitdiff.report.markdown import render_markdown
from logitdiff.store import RunReader

V = 32
LENS = {"a": 9, "b": 5}


def _run(path, logits, teacher, spec):
    """A full-logit RUN in 4-row chunks (test_compare's writer), read back."""
    return RunReader(make_run(path, logits, teacher, vocab=V, source={"spec": spec, "identity": {"backend": "test"}}, chunk_rows=4,
                              tags={iid: ["x"] for iid in logits}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schema")
    rng = np.random.default_rng(1)
    ref = {k: rng.normal(0, 2, (n, V)).astype(np.float32) for k, n in LENS.items()}
    teacher = {k: lg.argmax(1) for k, lg in ref.items()}
    r = _run(tmp / "ref", ref, teacher, "test:ref")
    rerun = _run(tmp / "rerun", {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in ref.items()},
                 teacher, "test:ref")
    cand = _run(tmp / "cand", {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) for k, v in ref.items()},
                teacher, "test:cand")
    return tmp, r, rerun, cand


@pytest.fixture(scope="module")
def written(runs):
    tmp, ref, rerun, cand = runs
    nf = noise_floor_section(compare_runs(ref, rerun), spec="test:ref", rerun=f"rerun {rerun.path}")
    rep, cols = build_report(compare_runs(ref, cand), n_boot=50, noise_floor=nf)
    out = write_report_dir(tmp / "report", rep, cols, markdown=render_markdown(rep))
    return out, nf


# ----------------------------------------------------------------------------- types == schema

SECTIONS = [
    # (TypedDict, schema file, JSON pointer to the object's schema)
    (C.Report, "report", ""),
    (C.Summary, "report", "$defs/summary"),
    (C.Side, "report", "$defs/side"),
    (C.Method, "report", "$defs/method"),
    (C.Bootstrap, "report", "$defs/method/properties/bootstrap"),
    (C.Stats, "report", "$defs/stats"),
    (C.Top1Disagreement, "report", "$defs/top1_disagreement"),
    (C.GroupStats, "report", "$defs/group"),
    (C.NoiseFloor, "report", "$defs/noise_floor"),
    (C.Flips, "report", "$defs/flips"),
    (C.FlipTies, "report", "$defs/flips/properties/ties"),
    (C.Correctness, "report", "$defs/correctness"),
    (C.Attribution, "report", "$defs/attribution"),
    (C.FirstFlip, "report", "$defs/first_flip"),
    (C.AttributedBranch, "report", "$defs/attributed_branch"),
    (C.AttributedCounts, "report", "$defs/attributed_counts"),
    (C.AttributedCounts, "summary", "$defs/attributed_counts"),
    (C.Gates, "report", "$defs/gates"),
    (C.GateResult, "report", "$defs/gate_result"),
    (C.Tool, "report", "properties/tool"),
    (C.RunSummary, "summary", ""),
    (C.CandidateRow, "summary", "$defs/candidate_row"),
    (C.NoiseFloor, "summary", "$defs/noise_floor"),
]


def _at(schema, pointer):
    for part in filter(None, pointer.split("/")):
        schema = schema[part]
    return schema


@pytest.mark.parametrize("typed, name, pointer", SECTIONS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_typed_dict_and_json_schema_declare_the_same_fields(typed, name, pointer):
    node = _at(C.schema(name), pointer)
    assert set(typed.__annotations__) == set(node["properties"]), typed.__name__
    assert set(typed.__required_keys__) == set(node["required"]), typed.__name__
    assert node["additionalProperties"] is False  # a writer adding an undeclared field fails validation


def test_schema_files_ship_in_the_package():
    for name in ("report", "summary"):
        text = (resources.files("logitdiff") / "schemas" / f"{name}.schema.json").read_text()
        doc = json.loads(text)
        assert doc["$schema"].endswith("2020-12/schema")
        import jsonschema

        jsonschema.Draft202012Validator.check_schema(doc)
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert '"schemas/*.json"' in pyproject  # package data: the wheel carries the schemas


def test_outcome_and_kind_enums_match_the_schema():
    s = C.schema("report")["$defs"]
    assert tuple(s["outcome_counts"]["properties"]) == C.Outcome.ALL
    assert set(s["method"]["properties"]["kind"]["enum"]) == set(C.MethodKind.ALL)
    from logitdiff.numerics import bounds

    assert set(s["method"]["properties"]["bounds"]["enum"]) == {
        bounds.METHOD_EXACT, bounds.METHOD_COMPACT, bounds.METHOD_TOPK, bounds.METHOD_LLAMACPP}
    assert set(C.Outcome.BAD) < set(C.Outcome.ALL) and set(C.Outcome.TEXT) == set(C.Outcome.ALL)
    from logitdiff.flips import OUTCOMES, SEVERITY

    assert OUTCOMES == C.Outcome.ALL and set(SEVERITY) == set(C.Outcome.ALL)


# ----------------------------------------------------------------------------- writers


def test_written_report_validates_and_round_trips(written):
    out, nf = written
    text = (out / "report.json").read_text()
    doc = json.loads(text)
    C.validate(doc, "report")  # the shipped schema, independent of the env switch
    assert list(doc)[:2] == ["schema", "schema_version"] and doc["schema_version"] == C.SCHEMA_VERSION
    assert text == C.report_json(doc)  # one writer: re-serialising gives the same bytes
    loaded = read_report(out)
    assert loaded == doc and C.load_report(out / "report.json") == doc
    assert doc["summary"]["noise_floor"] == nf


def test_report_text_layout(written):
    """report.json: one compact row per line (encoded in C), everything else indented one
    space per level; the same JSON as json.dumps. Without rows: json.dumps(indent=1)."""
    out, _ = written
    text = (out / "report.json").read_text()
    doc = json.loads(text)
    assert doc["rows"]
    row_lines = [ln for ln in text.splitlines() if ln.startswith('  {"')]
    assert len(row_lines) == len(doc["rows"])
    assert [json.loads(ln.rstrip(",")) for ln in row_lines] == doc["rows"]
    rest = {k: v for k, v in doc.items() if k != "rows"}
    assert C._layout(rest) == json.dumps(rest, indent=1, allow_nan=False)
    # strings holding newlines, quotes and non-ASCII stay inside their JSON strings
    odd = {**rest, "method": {**rest["method"], "notes": ["two\nlines", 'a "quote"', "caf\u00e9"]}, "rows": doc["rows"][:2]}
    assert json.loads(C.report_json(odd)) == odd
    assert C._layout({**odd, "rows": []}) == json.dumps({**odd, "rows": []}, indent=1, allow_nan=False)


def test_noise_floor_has_one_shape_and_its_numbers(runs):
    _, ref, rerun, _ = runs
    comp = compare_runs(ref, rerun)
    nf = noise_floor_section(comp, spec="test:ref", rerun="r")
    assert set(nf) == set(C.NoiseFloor.__annotations__)
    kl = np.asarray(comp.columns["kl_nats"], dtype=np.float64)
    match = np.asarray(comp.columns["top1_match"], dtype=bool)
    assert nf["kl_nats_mean"] == float(kl.mean()) and nf["kl_nats_max"] == float(kl.max())
    assert nf["top1_flips"] == int((~match).sum()) and nf["positions"] == sum(LENS.values())
    assert nf["top1_disagreement"] == pytest.approx(nf["top1_flips"] / nf["positions"], abs=1e-15)
    assert nf["kl_nats_mean"] > 0  # a perturbed rerun: the floor is measured, not 0


def test_a_writer_that_breaks_the_schema_fails_with_one_line(runs, tmp_path, monkeypatch):
    _, ref, _, cand = runs
    rep, cols = build_report(compare_runs(ref, cand), n_boot=0)
    rep["summary"]["noise_floor"] = {"path": "somewhere", "kl_nats_mean": 0.1}  # the old 3-key shape of `compare`
    monkeypatch.setenv(C.VALIDATE_ENV, "1")
    with pytest.raises(LogitdiffError) as e:
        write_report_dir(tmp_path / "r", rep, cols, markdown="")
    msg = str(e.value)
    assert "summary.noise_floor" in msg and "report.json" in msg and "\n" not in msg
    assert not (tmp_path / "r").exists()  # nothing half-written
    rep["summary"].pop("noise_floor")
    rep["surprise"] = 1  # an undeclared field
    with pytest.raises(LogitdiffError, match="surprise"):
        write_report_dir(tmp_path / "r", rep, cols, markdown="")
    monkeypatch.setenv(C.VALIDATE_ENV, "0")  # off (production default): written as given
    write_report_dir(tmp_path / "r", rep, cols, markdown="")
    assert json.loads((tmp_path / "r" / "report.json").read_text())["surprise"] == 1


def test_update_report_dir_validates_too(written, tmp_path, monkeypatch):
    out, _ = written
    doc = C.load_report(out)
    monkeypatch.setenv(C.VALIDATE_ENV, "1")
    doc["gates"] = {"gates": [], "crossed": [], "passed": "yes"}
    with pytest.raises(LogitdiffError, match="gates.passed"):
        update_report_dir(out, doc, {})
    assert "gates" not in C.load_report(out)  # the old report is untouched


def test_update_report_dir_is_all_or_nothing(written, tmp_path):
    """A file that cannot be written (here: a directory stands where it goes) fails the whole
    update with one line naming it: no file replaced, no temporary left behind."""
    out, _ = written
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    (out / "blocked").mkdir()
    doc = C.load_report(out)
    doc["gates"] = {"gates": [], "crossed": [], "not_evaluated": [], "passed": True}
    with pytest.raises(LogitdiffError, match="blocked"):
        update_report_dir(out, doc, {"flips.parquet": b"new", "blocked": b"x"})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


# ----------------------------------------------------------------------------- readers


def test_load_report_accepts_older_minor_and_refuses_other_major_or_kind(written, tmp_path):
    out, _ = written
    doc = json.loads((out / "report.json").read_text())
    assert doc["schema"] == C.REPORT_SCHEMA == "logitdiff.report/2" and doc["schema_version"] == C.SCHEMA_VERSION == "2.2"
    p = tmp_path / "report.json"
    # schema_version's MAJOR must be the one in `schema` (2 here): 2.x is read, 1.x under /2 and 3.x are not
    for ver, ok in (("2.0", True), ("2.7", True), ("1.2", False), ("3.0", False), ("11.0", False)):
        p.write_text(json.dumps({**doc, "schema_version": ver}))
        if ok:
            assert C.load_report(p)["summary"] == doc["summary"]
        else:
            with pytest.raises(LogitdiffError, match="schema_version"):
                C.load_report(p)
    p.write_text(json.dumps({**doc, "schema": "logitdiff.run-summary/1"}))
    with pytest.raises(LogitdiffError, match="field 'schema'"):
        C.load_report(p)
    p.write_text("{not json")
    with pytest.raises(LogitdiffError, match="not valid JSON"):
        C.load_report(p)
    with pytest.raises(LogitdiffError, match="not found"):
        C.load_report(tmp_path / "nowhere")


def test_other_minors_are_readable(written, tmp_path, monkeypatch):
    """A newer minor's added field and an older file without schema_version are read as they are
    (outside tests nothing validates on reading; the kind and major are always checked)."""
    out, _ = written
    doc = json.loads((out / "report.json").read_text())
    monkeypatch.setenv(C.VALIDATE_ENV, "0")
    (tmp_path / "report.json").write_text(json.dumps({**doc, "schema_version": "2.7", "added_in_2_7": True}))
    assert C.load_report(tmp_path)["added_in_2_7"] is True
    (tmp_path / "report.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "schema_version"}))
    assert "schema_version" not in C.load_report(tmp_path)


def _schema_has(path: str) -> bool:
    """Does report.json's schema declare the dotted path (through $refs)?"""
    root = C.schema("report")
    node = root
    for part in path.split("."):
        while "$ref" in node:
            node = _at(root, node["$ref"].lstrip("#"))
        if "oneOf" in node:
            node = next(n for n in node["oneOf"] if n.get("type") != "null")
            while "$ref" in node:
                node = _at(root, node["$ref"].lstrip("#"))
        props = node.get("properties") or {}
        if part in props:
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        elif any(re.fullmatch(p, part) for p in node.get("patternProperties") or {}):
            return True
        else:
            return False
    return True


def test_every_path_a_reader_reads_is_declared():
    """report.html's matrix and the gates read report.json by dotted paths: each must exist in
    the schema (a reader of a key nothing writes — the old file_size / bits_per_weight — fails here)."""
    from logitdiff.report.gates import _SOURCES
    from logitdiff.report.html import CI_OF, MATRIX

    paths = [p for *_, ps, _ in MATRIX for p in ps] + list(CI_OF.values())
    paths += [p for _, ps in _SOURCES.values() for p in ps]
    declared_free = ("candidate.identity.",)  # identity: whatever the source records (GGUF: size)
    missing = [p for p in paths if not p.startswith(declared_free) and not _schema_has(p)]
    assert not missing
    assert not _schema_has("candidate.bits_per_weight") and not _schema_has("summary.noise_floor.path")
    assert [p for *_, ps, _ in MATRIX for p in ps if p.startswith(declared_free)] == ["candidate.identity.size"]


# ----------------------------------------------------------------------------- helpers


def test_json_clean():
    obj = {"a": np.float32(1.5), "b": np.int64(3), "c": np.bool_(True), "d": np.array([[1.0, np.nan], [np.inf, 2.0]]),
           "e": (1, float("-inf")), "f": [np.float64(np.nan)], "g": "s", "h": None, "i": Path("/x")}
    out = C.json_clean(obj)
    assert out == {"a": 1.5, "b": 3, "c": True, "d": [[1.0, None], [None, 2.0]], "e": [1, None], "f": [None], "g": "s",
                   "h": None, "i": Path("/x")}
    assert type(out["b"]) is int and type(out["c"]) is bool and type(out["a"]) is float
    assert C.json_clean(obj, default=str)["i"] == "/x"
    json.dumps(C.json_clean({k: v for k, v in obj.items() if k != "i"}), allow_nan=False)


def test_range_labels_and_edges():
    from logitdiff.numerics.summarize import DEFAULT_RANGES, format_ranges, parse_ranges, range_label, range_labels

    assert parse_ranges(format_ranges(DEFAULT_RANGES)) == DEFAULT_RANGES
    labels = range_labels(DEFAULT_RANGES)
    assert labels == ["[0,1)", "[1,8)", "[8,32)", "[32,128)", "[128,512)", "[512,inf)"]
    assert [range_label(p, DEFAULT_RANGES) for p in (0, 1, 7, 8, 511, 512, 10**9)] == [
        labels[0], labels[1], labels[1], labels[2], labels[4], labels[5], labels[5]]
    assert range_label(0, (1, 5)) == "n/a" and range_label(3, ()) == "n/a"
    from logitdiff.pipeline import RunConfig

    assert RunConfig().ranges == DEFAULT_RANGES


def test_store_text_has_one_parser_and_one_formatter():
    """A source's rows kept as given (full rows, top-K lists) are spelled by their kind, and
    that text parses back to the same kind."""
    from logitdiff.store.kinds import given_rows_kind, store_kind

    for k in (0, 1, 64, 4096):
        kind = given_rows_kind(k, 4096)
        again = store_kind(kind.text, vocab_size=4096)
        assert type(again) is type(kind) and again.k == k
    assert given_rows_kind(0).text == "full" and given_rows_kind(8).text == "topk:8"


def test_one_item_bootstrap():
    """resample_items against a direct float64 computation of the same draws; the three CI
    helpers (pooled mean, paired difference, accuracy difference) all go through it."""
    from logitdiff.flips.grading import paired_diff_ci
    from logitdiff.numerics.stats import paired_bootstrap
    from logitdiff.numerics.summarize import bootstrap_mean_ci, resample_items

    rng = np.random.default_rng(3)
    sums, counts = rng.random(11) * 5, rng.integers(1, 9, 11).astype(float)
    draws = np.random.default_rng(7).integers(0, 11, size=(200, 11))
    want = np.array([sums[d].sum() / counts[d].sum() for d in draws])
    got = resample_items(sums, counts, n_boot=200, seed=7)
    # each mean is a ratio of two sums of 11 positive terms: a few ulps of reassociation at most
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    a, b = rng.random(20), rng.random(20)
    d = b - a
    boot = resample_items(d, np.ones(20), n_boot=300, seed=0)
    assert paired_bootstrap(a, b, n_boot=300, seed=0)["ci"] == [float(x) for x in np.quantile(boot, [0.025, 0.975])]
    ok_r, ok_c = rng.random(30) < 0.7, rng.random(30) < 0.6
    boot = resample_items(ok_c.astype(float) - ok_r.astype(float), np.ones(30), n_boot=100, seed=2)
    assert paired_diff_ci(ok_r, ok_c, n_boot=100, seed=2) == [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
    vals = rng.random(40)
    idx = np.repeat(np.arange(8), 5)
    item_sums = np.bincount(idx, weights=vals)
    boot = resample_items(item_sums, np.full(8, 5.0), n_boot=100, seed=4)
    lo, hi = bootstrap_mean_ci(vals, idx, n_boot=100, seed=4)
    a = (1.0 - 0.95) / 2.0  # the level the CI helpers use
    assert (lo, hi) == tuple(float(x) for x in np.quantile(boot, [a, 1.0 - a]))
    assert math.isfinite(lo) and lo <= vals.mean() <= hi


def test_typed_dicts_are_plain_types():
    # TypedDicts are dicts at run time: writers stay byte-identical, readers need no conversion
    assert typing.get_type_hints(C.NoiseFloor)["top1_flips"] is int


def test_top_k_report_with_bounds_validates(tmp_path):
    """A top-K comparison (served models) writes the interval fields of bounded methods."""
    rng = np.random.default_rng(5)
    k = 8

    def topk_run(path, logits, teacher):
        return RunReader(make_run(path, logits, teacher, vocab=V, store=f"topk:{k}", chunk_rows=4))

    ref = {k_: rng.normal(0, 2, (n, V)) for k_, n in LENS.items()}
    teacher = {k_: lg.argmax(1) for k_, lg in ref.items()}
    r = topk_run(tmp_path / "r", ref, teacher)
    c = topk_run(tmp_path / "c", {k_: v + rng.normal(0, 0.3, v.shape) for k_, v in ref.items()}, teacher)
    rep, cols = build_report(compare_runs(r, c), n_boot=20, include_rows=False)
    out = write_report_dir(tmp_path / "rep", rep, cols, markdown=render_markdown(rep))
    doc = C.load_report(out)
    C.validate(doc, "report")
    assert doc["method"]["kind"] == C.MethodKind.TOP_K and doc["rows_omitted"] is True and doc["rows"] == []
    assert any(key.endswith("_lower_nats_mean") for key in doc["summary"])  # the patternProperties fields


def test_no_bootstrap_gives_no_interval_not_a_zero_width_one(runs, tmp_path, monkeypatch):
    """--bootstrap 0 asks for no intervals: every ci95 is null (a [mean, mean] interval would
    read as a measured, perfectly certain figure), and the report still validates and renders."""
    from logitdiff.report.html import render_html

    _, ref, _, cand = runs
    rep, cols = build_report(compare_runs(ref, cand), n_boot=0)
    cis = []

    def walk(x, path=""):
        if isinstance(x, dict):
            for k, v in x.items():
                if k.endswith("ci95") or k == "ci":
                    cis.append((path + "." + k, v))
                walk(v, path + "." + k)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(rep)
    assert cis, "the report has confidence intervals to check"
    assert all(v is None or list(v) == [None, None] for _, v in cis), [c for c in cis if c[1] and c[1][0] is not None][:3]
    monkeypatch.setenv(C.VALIDATE_ENV, "1")
    write_report_dir(tmp_path / "r", rep, cols, markdown=render_markdown(rep))
    page = render_html([rep], [None])
    assert page.startswith("<!") and "</html>" in page
    with_ci, _ = build_report(compare_runs(ref, cand), n_boot=50)
    lo, hi = with_ci["summary"]["metrics"]["kl_nats"]["ci95"]
    assert lo is not None and lo < with_ci["summary"]["metrics"]["kl_nats"]["mean"] < hi


# ----------------------------------------------------------------------------- schema 1.x -> 2.0

# A REPORT directory written by logitdiff before the rename (schema 1.2: the reference's side
# named "baseline"), kept as it was written: tests/data/report_schema_1_2/README.md.
OLD_REPORT = Path(__file__).parent / "data" / "report_schema_1_2"


def _renamed(obj):
    """Every key of the 1.x names under its 2.0 name, recursively (independent of migrate_report)."""
    names = {**C.RENAMED_IN_2, **C.RENAMED_COLUMNS_IN_2}
    if isinstance(obj, dict):
        return {names.get(k, k): _renamed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_renamed(v) for v in obj]
    return obj


def test_the_report_schema_says_reference_never_baseline():
    for name in ("report", "summary"):
        text = (resources.files("logitdiff") / "schemas" / f"{name}.schema.json").read_text()
        assert "baseline" not in text.lower(), name
    s = C.schema("report")
    assert "reference" in s["required"] and s["properties"]["reference"] == {"$ref": "#/$defs/side"}
    assert {"reference_top_mass_mean", "max_kl_reference_top_token", "shared_reference_mass_mean"} <= set(s["$defs"]["summary"]["required"])
    assert set(C.RENAMED_COLUMNS_IN_2.values()) <= set(s["$defs"]["row"]["required"])
    assert s["properties"]["schema"] == {"const": C.REPORT_SCHEMA}


def test_a_schema_1_report_is_read_as_2_0_with_every_value_kept(monkeypatch):
    raw = json.loads((OLD_REPORT / "report.json").read_text())
    assert raw["schema"] == C.REPORT_SCHEMA_1 and raw["schema_version"] == "1.2" and "baseline" in raw
    monkeypatch.setenv(C.VALIDATE_ENV, "1")  # the 2.0 schema checks the migrated report
    doc = C.load_report(OLD_REPORT)
    assert doc["schema"] == C.REPORT_SCHEMA and doc["schema_version"] == C.SCHEMA_VERSION
    assert "baseline" not in json.dumps(doc)  # no key (nor value) of the old name is left
    # its flips were classified before 2.1: said so, their counts as they were
    assert doc["flips"].pop("meaning_judged_by") == C.OLD_CLASSIFIER
    # every value as it was, under the new keys, in the same order; the correctness section
    # gains its 2.2 attribution (this report's answers did not change: no record, counts 0)
    added = {"attribution": [], "attributed": {"n": 0, "with_flip": 0, "divergence_at_first_flip": 0, "branched": 0, "outcomes": {}}}
    assert doc["correctness"] == {**raw["correctness"], **added}
    assert {k: v for k, v in doc.items() if k not in ("schema", "schema_version", "correctness")} == {
        k: v for k, v in _renamed(raw).items() if k not in ("schema", "schema_version", "correctness")}
    doc["flips"]["meaning_judged_by"] = C.OLD_CLASSIFIER
    assert list(doc) == list(_renamed(raw))
    assert list(doc["summary"]) == list(_renamed(raw["summary"])) and list(doc["rows"][0]) == list(_renamed(raw["rows"][0]))
    assert doc["reference"]["spec"] == "builtin:tiny" and doc["summary"]["reference_top_mass_mean"] == raw["summary"]["baseline_top_mass_mean"]
    C.validate(doc, "report")
    # the same through the public API, and a 2.0 report passes through untouched (the same object)
    import logitdiff

    assert logitdiff.load_report(OLD_REPORT / "report.json") == doc
    assert C.migrate_report(doc) is doc


def test_the_schema_check_runs_after_the_migration(tmp_path, monkeypatch):
    """A 1.x report is checked as the 2.0 report it is read as: its own fields by their new
    names, so a doctored one is named, and no 1.x file fails for being 1.x."""
    raw = json.loads((OLD_REPORT / "report.json").read_text())
    monkeypatch.setenv(C.VALIDATE_ENV, "1")
    bad = {**raw, "summary": {**raw["summary"], "shared_baseline_mass_mean": "much"}}
    (tmp_path / "report.json").write_text(json.dumps(bad))
    with pytest.raises(LogitdiffError, match=r"field 'summary.shared_reference_mass_mean' breaks the report schema"):
        C.load_report(tmp_path)
    for doc, field in (({**raw, "schema_version": "2.0"}, "schema_version"), ({**raw, "schema": "logitdiff.report/0"}, "schema")):
        (tmp_path / "report.json").write_text(json.dumps(doc))
        with pytest.raises(LogitdiffError, match=f"field '{field}'") as e:
            C.load_report(tmp_path)
        assert "\n" not in str(e.value)


def test_a_schema_1_tokens_table_is_read_under_the_2_0_names():
    import pyarrow.parquet as pq

    from logitdiff.report import read_columns
    from logitdiff.report.html import load_tokens

    stored = pq.read_table(OLD_REPORT / "tokens.parquet")
    assert "baseline_top_token" in stored.column_names
    cols = read_columns(OLD_REPORT)
    assert set(cols) == {C.RENAMED_COLUMNS_IN_2.get(k, k) for k in stored.column_names}
    assert list(cols["reference_top_token"]) == stored.column("baseline_top_token").to_pylist()
    assert list(read_columns(OLD_REPORT, ["reference_top_mass"])) == ["reference_top_mass"]
    page_cols = load_tokens(OLD_REPORT / "tokens.parquet")
    assert page_cols is not None and list(page_cols["reference_top_token"]) == stored.column("baseline_top_token").to_pylist()


def test_a_schema_1_report_renders_through_logitdiff_report(tmp_path, capsys):
    """`logitdiff report` on a REPORT directory of the previous release: the page, with the
    figures of its report.json, and the token view fed by its old tokens.parquet columns."""
    import shutil

    from logitdiff.cli import main
    from logitdiff.store.files import Kind, is_kind

    old = tmp_path / "old"
    shutil.copytree(OLD_REPORT, old)
    assert is_kind(old, Kind.REPORT)  # an output a new `compare --out` may replace
    assert main(["report", str(old), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    raw = json.loads((OLD_REPORT / "report.json").read_text())
    data = json.loads(re.search(r'id="logitdiff-data">(.*?)</script>', page, re.S).group(1))
    assert data["matrix"]["old"]["kl_mean"]["value"] == raw["summary"]["metrics"]["kl_nats"]["mean"]
    assert f"drift from {raw['baseline']['spec']}" in page
    assert (old / "report.json").read_text() == (OLD_REPORT / "report.json").read_text()  # reading rewrote nothing
    # Without top-5 columns, each token's hover line names both top-1 tokens from the renamed
    # columns (reference_top_token, read from the old file's baseline_top_token).
    import pyarrow.parquet as pq

    from logitdiff.report.html import _e, _show

    table = pq.read_table(old / "tokens.parquet")
    pq.write_table(table.drop([c for c in table.column_names if c.startswith("top5_")]), old / "tokens.parquet")
    assert main(["report", str(old), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    ref_top, cand_top = table.column("baseline_top_token").to_pylist(), table.column("candidate_top_token").to_pylist()
    shown = [_e(f"reference top-1 {_show(a)} · candidate top-1 {_show(b)}") in page for a, b in zip(ref_top, cand_top)]
    assert all(shown) and len(shown) == len(raw["rows"])


def test_a_1x_and_a_2x_report_of_one_workload_share_a_page(tmp_path):
    """The page takes a report of the previous release beside a current one: both are read
    as 2.0, so they measure the same thing and each keeps its figures."""
    import pyarrow.parquet as pq

    from logitdiff.report.html import write_html

    new = tmp_path / "new"
    new.mkdir()
    (new / "report.json").write_text(C.report_json(C.load_report(OLD_REPORT)))
    table = pq.read_table(OLD_REPORT / "tokens.parquet")
    pq.write_table(table.rename_columns([C.RENAMED_COLUMNS_IN_2.get(c, c) for c in table.column_names]), new / "tokens.parquet")
    assert json.loads((new / "report.json").read_text())["schema"] == C.REPORT_SCHEMA
    page = write_html([OLD_REPORT, new], tmp_path / "page.html").read_text()
    data = json.loads(re.search(r'id="logitdiff-data">(.*?)</script>', page, re.S).group(1))
    kl = json.loads((OLD_REPORT / "report.json").read_text())["summary"]["metrics"]["kl_nats"]["mean"]
    assert data["candidates"] == ["report_schema_1_2", "new"]
    assert [data["matrix"][n]["kl_mean"]["value"] for n in data["candidates"]] == [kl, kl]
    assert data["kl_cdf"]["report_schema_1_2"] == data["kl_cdf"]["new"] and data["kl_cdf"]["new"]["n"] == 8
