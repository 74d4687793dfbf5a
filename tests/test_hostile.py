"""Hostile inputs, round two: every class gives one line, a non-zero exit and
nothing half-written, or the right result.

Real parts: RUNs written by the real RunWriter (small synthetic models, so each test takes
seconds), a real HTTP server on 127.0.0.1 that speaks vLLM's protocol and doctors its
answers on demand (the hostile server itself), real tmpfs file systems that fill up (in a
user and mount namespace of their own), real CLI invocations.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from logitdiff import api
from logitdiff.cli import main
from logitdiff.contracts import VALIDATE_ENV
from logitdiff.errors import LogitdiffError
from logitdiff.store.files import Kind, writing
from logitdiff.store import RunItem, RunReader, RunWriter, f32_to_bf16
from logitdiff.workload import read_workload

SRC = str(Path(__file__).resolve().parents[1] / "src")
V = 64


# ----------------------------------------------------------------------------- helpers
def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[-1].startswith("logitdiff: error: "), err
    return lines[-1]


def fails(capsys, argv, *needles) -> str:
    assert main([str(a) for a in argv]) == 2
    line = one_line_error(capsys)
    for n in needles:
        assert n in line, (n, line)
    return line


def make_run(path, *, vocab=16, store="full", dtype="float32", identity=None, n_items=3, seed=0, shard=None,
             extra=None) -> Path:
    """A real RUN of a synthetic model: the same items (ids, teacher tokens) for every seed,
    logits drawn from ``seed``."""
    items_rng, rng = np.random.default_rng(1234), np.random.default_rng(seed)
    settings = {"role": "reference", **({"shard": shard, "shard_block": 1} if shard else {})}
    w = RunWriter(path, source={"spec": "synthetic:m", "kind": "synthetic", "identity": identity or {"weights": "a"}},
                  vocab_size=vocab, tokenizer_hash=None, store=store, dtype=dtype, settings=settings)
    k = int(store.split(":")[1]) if store.startswith("topk") else 0
    for n in range(n_items):
        if shard and n % int(shard.split("/")[1]) != int(shard.split("/")[0]):
            items_rng.integers(0, vocab, 5)
            rng.standard_normal((5, vocab))
            continue
        it = RunItem(id=f"i{n}", prompt_ids=[1, 2], teacher_ids=items_rng.integers(0, vocab, 5).tolist(),
                     positions=list(range(5)), extra=dict(extra or {}))
        logits = rng.standard_normal((5, vocab)).astype(np.float32)
        if k:
            lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
            idx = np.argsort(-lp, axis=1, kind="stable")[:, :k]
            w.add(it, stored={"ids": idx.astype(np.int64), "logprobs": np.take_along_axis(lp, idx, 1)})
        else:
            w.add(it, logits=logits)
    w.finish()
    return Path(path)


def tree(path: Path) -> dict:
    """Every file below ``path`` -> its bytes (what must stay as it was)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


# ------------------------------------------------------------- 2. the stale-temporary sweep
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


USER_NAMES = ("{n}.old-backup/", "{n}.tmp-notes", "{n}.tmp-", "{n}.old/", "{n}.tmp-{dead}", "{n}.tmp-{dead}-xyz",
              "{n}.tmp-{dead}-0123abcd.bak", "{n}.old-{dead}-0123ABCD", "{n}x.tmp-{dead}-0123abcd/",
              "{n}.tmp-{live}-0123abcd/", "{n}.tmp{dead}", "{n}.TMP-{dead}-0123abcd", "{n}.tmp-0-0123abcd")


@pytest.mark.parametrize("kind", [Kind.REPORT, Kind.TOPK_JSON])
def test_sweep_removes_only_dead_writers_temporaries(kind, tmp_path):
    out = tmp_path / "REP"
    dead, live = _dead_pid(), os.getppid()
    stale = [tmp_path / f".REP.tmp-{dead}-0123abcd", tmp_path / f".REP.old-{dead}-fedcba98"]
    stale[0].mkdir()
    (stale[0] / "half.json").write_text("{")
    stale[1].write_text("x")
    users = {}
    for pattern in USER_NAMES:
        name = "." + pattern.format(n="REP", dead=dead, live=live)
        p = tmp_path / name.rstrip("/")
        if name.endswith("/"):
            p.mkdir()
            (p / "notes.txt").write_text("mine")
        else:
            p.write_text("mine")
        users[p] = tree(p) if p.is_dir() else p.read_bytes()
    with writing(out, kind) as tmp:
        (tmp / "report.json").write_text("{}") if kind.is_dir else tmp.write_text("{}")
    assert not any(os.path.lexists(p) for p in stale)
    for p, before in users.items():
        assert (tree(p) if p.is_dir() else p.read_bytes()) == before, p
    assert sorted(os.listdir(tmp_path)) == sorted(["REP"] + [p.name for p in users])


# --------------------------------------------------- 3. ids and log-probabilities, stored
def _doctor_topk(run: Path, key: str, fn) -> Path:
    p = run / "chunks" / "000000.topk.npz"
    with np.load(p) as z:
        data = {k: z[k].copy() for k in z.files}
    data[key] = fn(data[key])
    with open(p, "wb") as f:
        np.savez(f, **data)
    return p


def _set(r, c, v):
    def fn(a):
        a = a.astype(np.result_type(a, np.asarray(v)))
        a[r, c] = v
        return a
    return fn


TOPK_DOCTORED = {
    "id 999999": ("ids", _set(7, 1, 999_999), "token id 999999 outside [0, 16)", "item 'i1' output position 2"),
    "id -1": ("ids", _set(3, 0, -1), "token id -1 outside [0, 16)", "item 'i0' output position 3"),
    "id == V": ("ids", _set(12, 3, 16), "token id 16 outside [0, 16)", "item 'i2' output position 2"),
    "duplicate id": ("ids", lambda a: (a.__setitem__((5, 2), a[5, 0]), a)[1], "twice in one top-K row", "item 'i1' output position 0"),
    "positive logprob": ("logprobs", _set(2, 0, 0.25), "> 0: not a log-probability", "item 'i0' output position 2"),
    "NaN logprob": ("logprobs", _set(9, 2, np.nan), "is not finite", "item 'i1' output position 4"),
    "-inf logprob": ("logprobs", _set(0, 3, -np.inf), "is not finite", "item 'i0' output position 0"),
    "float ids": ("ids", lambda a: a.astype(np.float64), "dtype float64, expected integers", ""),
    "int logprobs": ("logprobs", lambda a: (a * 100).astype(np.int64), "dtype int64, expected floats", ""),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return {"root": root, "ref": make_run(root / "ref"), "topk": make_run(root / "topk", store="topk:4", seed=1),
            "bf16": make_run(root / "bf16", dtype="bfloat16", seed=2)}


@pytest.mark.parametrize("case", list(TOPK_DOCTORED))
def test_stored_topk_chunk_violations_are_one_line_errors(case, runs, tmp_path, capsys):
    key, fn, what, where = TOPK_DOCTORED[case]
    cand = shutil.copytree(runs["topk"], tmp_path / "cand")
    chunk = _doctor_topk(cand, key, fn)
    line = fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], str(chunk), what, where)
    assert not (tmp_path / "rep").exists(), line
    assert sorted(os.listdir(tmp_path)) == ["cand"]


def test_stored_topk_tolerates_float_rounding_above_zero(runs, tmp_path, capsys):
    """A log-probability of 1e-7 (a float32 log-softmax of p ~ 1) is rounding, not a violation."""
    cand = shutil.copytree(runs["topk"], tmp_path / "cand")
    _doctor_topk(cand, "logprobs", _set(2, 0, 1e-7))
    assert main(["compare", str(runs["ref"]), str(cand), "--out", str(tmp_path / "rep"), "--bootstrap", "0"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.int16, np.uint8])
def test_full_chunk_of_another_dtype_is_refused(dtype, runs, tmp_path, capsys):
    cand = shutil.copytree(runs["bf16"], tmp_path / "cand")
    p = cand / "chunks" / "000000.logits.npy"
    rows = np.load(p)
    np.save(p, rows.astype(dtype))
    fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], str(p),
          f"rows have dtype {np.dtype(dtype)}, the RUN declares bfloat16")
    assert not (tmp_path / "rep").exists()


ITEM_DOCTORED = {
    "teacher id >= V": (lambda d: d["teacher_ids"].__setitem__(2, 16), "teacher position 2: id 16 outside [0, 16)"),
    "teacher id -7": (lambda d: d["teacher_ids"].__setitem__(0, -7), "teacher position 0: id -7 outside [0, 16)"),
    "teacher id 10**30": (lambda d: d["teacher_ids"].__setitem__(1, 10**30), "teacher position 1: id"),
    "teacher id a string": (lambda d: d["teacher_ids"].__setitem__(1, "5"), "teacher position 1: id '5' is not an integer"),
    "prompt id float": (lambda d: d["prompt_ids"].__setitem__(0, 1.5), "prompt position 0: id 1.5 is not an integer"),
    "position past the teacher": (lambda d: d["positions"].__setitem__(4, 9), "field 'positions' [4] = 9"),
    "position a bool": (lambda d: d["positions"].__setitem__(0, True), "field 'positions' [0] = True"),
    "extra a list": (lambda d: d.__setitem__("extra", [1]), "field 'extra' not a dict"),
    "absolute tools_module": (lambda d: d.__setitem__("extra", {"item": {"id": d["id"], "prompt": "x",
                                                                         "tools_module": "/tmp/evil.py"}}),
                              "an absolute path"),
    "tools_module outside via ..": (lambda d: d.__setitem__("extra", {"item": {"id": d["id"], "prompt": "x",
                                                                               "tools_module": "tools/../../evil.py",
                                                                               "tools_module_sha256": "0" * 64}}),
                                    "not in the RUN"),
    "nested 100,000 deep": (lambda d: d.__setitem__("tags", json.loads("[" * 900 + "]" * 900)), "field 'tags'"),
}


@pytest.mark.parametrize("case", list(ITEM_DOCTORED))
def test_damaged_items_are_one_line_errors(case, runs, tmp_path, capsys):
    fn, what = ITEM_DOCTORED[case]
    cand = shutil.copytree(runs["topk"], tmp_path / "cand")
    p = cand / "chunks" / "000000.items.jsonl"
    lines = p.read_text().splitlines()
    d = json.loads(lines[0])
    fn(d)
    lines[0] = json.dumps(d)
    p.write_text("\n".join(lines) + "\n")
    fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], f"{p}:1", what)


def test_items_line_nested_beyond_the_recursion_limit(runs, tmp_path, capsys):
    cand = shutil.copytree(runs["topk"], tmp_path / "cand")
    p = cand / "chunks" / "000000.items.jsonl"
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n" + p.read_text())
    fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], f"{p}:1", "nested too deeply")


CHUNK_DAMAGE = {
    "truncated npz": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "text instead of npz": lambda p: p.write_text("not a chunk"),
    "npz without logprobs": lambda p: np.savez(open(p, "wb"), ids=np.zeros((15, 4), np.int64)),
    "rows of another shape": lambda p: np.savez(open(p, "wb"), ids=np.zeros((15, 3), np.int64), logprobs=np.zeros((15, 3)) - 1),
    "a pickled object array": lambda p: np.savez(open(p, "wb"), ids=np.array([None] * 15, dtype=object), logprobs=np.zeros((15, 4))),
    "missing": lambda p: p.unlink(),
}


@pytest.mark.parametrize("case", list(CHUNK_DAMAGE))
def test_damaged_topk_chunks_are_one_line_errors(case, runs, tmp_path, capsys):
    cand = shutil.copytree(runs["topk"], tmp_path / "cand")
    p = cand / "chunks" / "000000.topk.npz"
    CHUNK_DAMAGE[case](p)
    fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], str(p))
    assert sorted(os.listdir(tmp_path)) == ["cand"]


MANIFEST_DOCTORED = {
    "not an object": lambda m: [m],
    "chunks not a list": lambda m: {**m, "chunks": "000000"},
    "chunk entry a string": lambda m: {**m, "chunks": ["x"]},
    "chunk data outside the RUN": lambda m: {**m, "chunks": [{**m["chunks"][0], "data": "../../ref/chunks/000000.logits.npy"}]},
    "chunk rows negative": lambda m: {**m, "chunks": [{**m["chunks"][0], "rows": -1}]},
    "chunk index wrong": lambda m: {**m, "chunks": [{**m["chunks"][0], "index": 3}]},
    "vocab_size a string": lambda m: {**m, "vocab_size": "16"},
    "vocab_size zero": lambda m: {**m, "vocab_size": 0},
    "settings not an object": lambda m: {**m, "settings": 1},
    "dtype unknown": lambda m: {**m, "settings": {**m["settings"], "dtype": "int8"}},
}


@pytest.mark.parametrize("case", list(MANIFEST_DOCTORED) + ["not UTF-8", "nested", "truncated"])
def test_damaged_manifest_is_one_line_error(case, runs, tmp_path, capsys):
    cand = shutil.copytree(runs["ref"], tmp_path / "cand")
    mp = cand / "manifest.json"
    m = json.loads(mp.read_text())
    if case == "not UTF-8":
        mp.write_bytes(b'{"schema": "\xff\xfe"}')
    elif case == "nested":
        mp.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "truncated":
        mp.write_text(mp.read_text()[:40])
    else:
        mp.write_text(json.dumps(MANIFEST_DOCTORED[case](m)))
    fails(capsys, ["compare", runs["ref"], cand, "--out", tmp_path / "rep", "--bootstrap", "0"], str(mp))
    fails(capsys, ["merge", cand, "--out", tmp_path / "merged"], str(mp))
    assert sorted(os.listdir(tmp_path)) == ["cand"]


# --------------------------------------------------------------------------- 4. merge
def test_merge_refuses_shards_of_different_models(tmp_path, capsys):
    a = make_run(tmp_path / "a", shard="0/2", n_items=4, identity={"weights": {"model.safetensors": "aa" * 32}, "dtype": "float32"})
    b = make_run(tmp_path / "b", shard="1/2", n_items=4, identity={"weights": {"model.safetensors": "bb" * 32}, "dtype": "float32"})
    fails(capsys, ["merge", a, b, "--out", tmp_path / "m"], str(b), "source identity field 'weights'", "not shards of one model")
    assert not (tmp_path / "m").exists()
    c = make_run(tmp_path / "c", shard="1/2", n_items=4, identity={"weights": {"model.safetensors": "aa" * 32}, "dtype": "bfloat16"})
    fails(capsys, ["merge", a, c, "--out", tmp_path / "m"], "source identity field 'dtype'")
    # the same model at another path, on another replica, with other threads: one capture
    d = make_run(tmp_path / "d", shard="1/2", n_items=4,
                 identity={"weights": {"model.safetensors": "aa" * 32}, "dtype": "float32", "model_path": "/elsewhere", "threads": 7})
    assert main(["merge", str(a), str(d), "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert [it.id for it in RunReader(tmp_path / "m").items()] == ["i0", "i1", "i2", "i3"]


# --------------------------------------------------------------------- 5. workloads, options
def _workload(tmp_path, line: str) -> Path:
    p = tmp_path / "wl.jsonl"
    p.write_text('{"id": "ok", "prompt": "fine"}\n' + line + "\n")
    return p


WORKLOAD_LINES = {
    "nested 100,000 deep": ('{"id": "a", "prompt": "x", "tags": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "nested inside a message": ('{"id": "a", "messages": [{"role": "user", "content": ' + "[" * 50_000 + "]" * 50_000 + "}]}",
                                "nested too deeply"),
    "lone high surrogate": ('{"id": "a", "prompt": "x\\ud800y"}', "lone surrogate"),
    "lone low surrogate in an id": ('{"id": "\\udc00", "prompt": "x"}', "lone surrogate"),
    "surrogate in a message": ('{"id": "a", "messages": [{"role": "user", "content": "\\udfff"}]}', "lone surrogate"),
    "content a number": ('{"id": "a", "messages": [{"role": "user", "content": 42}]}', "messages[0].content is int"),
    "content an object": ('{"id": "a", "messages": [{"role": "user", "content": {"x": 1}}]}', "messages[0].content is dict"),
    "content a list of numbers": ('{"id": "a", "messages": [{"role": "user", "content": [1, 2]}]}', "messages[0].content is list"),
}


@pytest.mark.parametrize("case", list(WORKLOAD_LINES))
def test_hostile_workload_lines(case, tmp_path, capsys):
    line, what = WORKLOAD_LINES[case]
    wl = _workload(tmp_path, line)
    with pytest.raises(LogitdiffError, match="wl.jsonl:2") as e:
        read_workload(wl)
    assert what in str(e.value) and "\n" not in str(e.value)
    fails(capsys, ["capture", "openai:http://127.0.0.1:9", "--workload", wl, "--out", tmp_path / "run"], f"{wl}:2", what)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,what", [
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--chunk-size", "1e400"], "--chunk-size '1e400'"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--chunk-size", "nan"], "--chunk-size 'nan'"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--chunk-size=-inf"], "--chunk-size '-inf'"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--chunk-size", "1e30"], "at most 1TiB"),
    (["merge", "{ref}", "--out", "{tmp}/r", "--chunk-size", "1e400"], "--chunk-size '1e400'"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--seed", "-1"], "--seed -1"),
    (["flips", "{ref}", "--seed", "-1"], "--seed -1"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/r", "--logprob-floor", "nan"], "--logprob-floor"),
    (["capture", "openai:http://127.0.0.1:9,timeout=nan", "--reference", "{ref}", "--out", "{tmp}/r"], "timeout='nan'"),
    (["capture", "openai:http://127.0.0.1:9,timeout=inf", "--reference", "{ref}", "--out", "{tmp}/r"], "timeout='inf'"),
    (["capture", "openai:http://127.0.0.1:9,top_k=1e400", "--reference", "{ref}", "--out", "{tmp}/r"], "top_k='1e400'"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/" + "x" * 300], "its name is 300 bytes"),
    (["compare", "{ref}", "{ref}", "--out", "{tmp}/" + "é" * 120], "its name is 240 bytes"),
    (["merge", "{ref}", "--out", "{tmp}/" + "y" * 255], "its name is 255 bytes"),
    (["capture", "openai:http://127.0.0.1:9", "--workload", "{ref}/manifest.json", "--out", "{tmp}/" + "z" * 256], "256 bytes"),
])
def test_hostile_options_are_one_line_errors(argv, what, runs, tmp_path, capsys):
    argv = [a.format(ref=runs["ref"], tmp=tmp_path) for a in argv]
    fails(capsys, argv, what)
    assert os.listdir(tmp_path) == []


def test_long_but_fitting_out_name_works(runs, tmp_path, capsys):
    out = tmp_path / ("n" * 200)
    assert main(["merge", str(runs["ref"]), "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["n" * 200]


# ------------------------------------------------------------------ report inputs doctored
def _doctor_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    d = fn(d)
    path.write_text(json.dumps(d) if not isinstance(d, str) else d)


REPORT_DOCTORED = {
    "summary not an object": lambda d: {**d, "summary": [1]},
    "summary dropped": lambda d: {k: v for k, v in d.items() if k != "summary"},
    "kl mean a string": lambda d: {**d, "summary": {**d["summary"], "kl_nats_mean": "big"}},
    "rows a number": lambda d: {**d, "rows": 5},
    "rows of strings": lambda d: {**d, "rows": ["x"] * 3},
    "method null": lambda d: {**d, "method": None},
    "reference a list": lambda d: {**d, "reference": [1, 2]},
    "nested": lambda d: '{"schema": "logitdiff.report/2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "truncated": lambda d: json.dumps(d)[:100],
}


@pytest.fixture(scope="module")
def report_dir(runs):
    rep = runs["root"] / "report"
    assert main(["compare", str(runs["ref"]), str(runs["topk"]), "--out", str(rep), "--bootstrap", "10"]) == 0
    return rep


@pytest.mark.parametrize("case", list(REPORT_DOCTORED))
def test_doctored_report_json_handed_to_report(case, report_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(VALIDATE_ENV)  # as users run it: no schema check on the happy path
    rep = shutil.copytree(report_dir, tmp_path / "rep")
    _doctor_json(rep / "report.json", REPORT_DOCTORED[case])
    fails(capsys, ["report", rep, "--out", tmp_path / "page.html"], "report")
    assert not (tmp_path / "page.html").exists()


@pytest.mark.parametrize("case", ["candidates a string", "candidates of numbers", "not an object", "nested"])
def test_doctored_summary_json_handed_to_report(case, report_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(VALIDATE_ENV)
    out = tmp_path / "out"
    shutil.copytree(report_dir, out / "reports" / "cand")
    s = out / "summary.json"
    docs = {"candidates a string": {"schema": "logitdiff.run-summary/1", "candidates": "cand"},
            "candidates of numbers": {"schema": "logitdiff.run-summary/1", "candidates": [1, 2]},
            "not an object": [1, 2, 3]}
    s.write_text(json.dumps(docs[case]) if case in docs else "[" * 100_000 + "]" * 100_000)
    fails(capsys, ["report", out, "--out", tmp_path / "page.html"], "summary.json")
    assert not (tmp_path / "page.html").exists()


# ------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("call,what", [
    (lambda t: api.capture_run(123, t / "o"), "argument 'spec' is int"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", max_tokens="5"), "argument 'max_tokens' is str"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", max_tokens=True), "argument 'max_tokens' is bool"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", endpoints="http://x"), "argument 'endpoints' is str"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", resume="yes"), "argument 'resume' is str"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", bar=5), "argument 'bar' is int"),
    (lambda t: api.capture_run("builtin:tiny", t / "o", bogus=1), "capture_run: got an unexpected keyword argument 'bogus'"),
    (lambda t: api.capture_run(), "missing a required argument: 'spec'"),
    (lambda t: api.diff_runs(None, t / "c"), "argument 'reference' is NoneType"),
    (lambda t: api.diff_runs(t / "r", t / "c", bootstrap="10"), "argument 'bootstrap' is str"),
    (lambda t: api.diff_runs(t / "r", t / "c", ranges=[1, "8"]), "argument 'ranges' is list"),
    (lambda t: api.diff_runs(t / "r", t / "c", seed=1.5), "argument 'seed' is float"),
    (lambda t: api.diff_runs(t / "r", t / "c", seed=-1), "--seed -1"),
    (lambda t: api.diff_runs(t / "r", t / "c", logprob_floor="x"), "argument 'logprob_floor' is str"),
    (lambda t: api.load_report(5), "argument 'report_dir' is int"),
    (lambda t: api.run(max_tokens="5"), "argument 'max_tokens' is str"),
    (lambda t: api.run(candidates="gguf:x"), "argument 'candidates' is str"),
    (lambda t: api.run(nonsense=1), "run: unknown argument 'nonsense'"),
    (lambda t: api.run(bar=3), "argument 'bar' is int"),
])
def test_api_wrong_argument_types_raise_logitdiff_error(call, what, tmp_path):
    with pytest.raises(LogitdiffError) as e:
        call(tmp_path)
    assert what in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------- 6. resume before the manifest; by hash
def test_resume_of_a_run_killed_before_its_manifest(tmp_path):
    """What a capture leaves when killed before its manifest: chunks/, vocab.json and write
    temporaries. A resume (and a plain rerun) continues it; a user's file there is no RUN."""
    for resume in (True, False):
        out = tmp_path / f"run-{resume}"
        (out / "chunks").mkdir(parents=True)
        (out / "vocab.json").write_text('["a"]')
        (out / ".manifest.json.tmp4242").write_text('{"sch')
        (out / "chunks" / ".000000.logits.npy.tmp4242").write_bytes(b"\x93NUMPY")
        with writing(out, Kind.RUN, resume=resume, in_place_when_new=True) as path:
            w = RunWriter(path, source={"spec": "s", "kind": "synthetic"}, vocab_size=4, tokenizer_hash=None, resume=resume,
                          vocab=["a", "b", "c", "d"])
            w.add(RunItem(id="x", prompt_ids=[1], teacher_ids=[2, 3], positions=[0, 1]), logits=np.zeros((2, 4), np.float32))
            w.finish()
        r = RunReader(out)
        assert [it.id for it in r.items()] == ["x"] and r.vocab() == ["a", "b", "c", "d"]
        assert not any(n.startswith(".") for n in os.listdir(out)), os.listdir(out)
        assert sorted(os.listdir(out / "chunks")) == ["000000.items.jsonl", "000000.logits.npy"]
    # not ours: a user file beside chunks/ -> refused, untouched
    out = tmp_path / "theirs"
    (out / "chunks").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(LogitdiffError, match="is not a RUN directory"):
        with writing(out, Kind.RUN, resume=True, in_place_when_new=True):
            pass
    assert (out / "notes.txt").read_text() == "mine"


def test_manifest_is_written_before_anything_else(tmp_path):
    """The order that makes every kill after the first file resumable."""
    seen = []
    import logitdiff.store.files as outputs
    import logitdiff.store as store

    real = outputs.atomic_write_bytes

    def spy(path, data):
        seen.append(Path(path).name)
        return real(path, data)

    outputs.atomic_write_bytes = store.atomic_write_bytes = spy
    try:
        RunWriter(tmp_path / "r", source={"spec": "s"}, vocab_size=4, tokenizer_hash=None, vocab=["a", "b", "c", "d"])
    finally:
        outputs.atomic_write_bytes = store.atomic_write_bytes = real
    assert seen[0] == "manifest.json", seen


# ------------------------------------------------------------- the hostile vLLM server
def _logprobs(prev: int) -> np.ndarray:
    x = -((np.arange(V) - 3 * prev) % V) / 6.0
    return x - np.log(np.exp(x).sum())


class FakeVLLM:
    """A real HTTP server speaking vLLM's completions protocol over a tiny deterministic
    model (token = ord(char) % V; next-token distribution a function of the previous
    token). ``mode`` doctors answers to requests for sequences longer than the preflight's."""

    def __init__(self, K=4):
        self.K, self.mode = K, None

    def answer(self, path: str, body: dict):
        mode = self.mode
        if path == "/v1/models":
            return {"data": [{"id": "fake", "meta": {"n_vocab": V}}]}
        if path == "/version":
            return {"version": "0.fake"}
        if path == "/tokenize":
            return {"tokens": [ord(c) % V for c in (body.get("prompt") or "")] or [1]}
        if path == "/detokenize":
            return {"prompt": "".join(chr(65 + t % 26) for t in body["tokens"])}
        if path != "/v1/completions":
            return None
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):  # one sequence (generation)
            prompts = [prompts]
        long = any(len(p) > 3 for p in prompts)
        m = mode if long else None
        if "prompt_logprobs" not in body:  # generation
            p = prompts[0]
            ids, prev = [], p[-1]
            for _ in range(body["max_tokens"]):
                prev = int(np.argmax(_logprobs(prev)))
                ids.append(prev)
            bad = {"gen_big": [V + 100], "gen_neg": [3, -3], "gen_str": ["7"], "gen_float": [1.0], "gen_huge": [10**30],
                   "gen_not_list": 5}
            if m in bad:
                ids = bad[m]
            if m == "gen_no_choices":
                return {"id": "x"}
            return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]}
        if m == "no_choices":
            return {"id": "x", "object": "text_completion"}
        if m == "choices_not_list":
            return {"choices": 5}
        if m == "not_object":
            return [1, 2, 3]
        if m == "nested":
            return "NESTED"
        choices = []
        for n, p in enumerate(prompts):
            pl = [None]
            for j in range(1, len(p)):
                lp = _logprobs(p[j - 1])
                top = np.argsort(-lp, kind="stable")[: self.K]
                entry = {str(int(t)): {"logprob": float(lp[t]), "rank": r + 1} for r, t in enumerate(top)}
                entry[str(int(p[j]))] = {"logprob": float(lp[p[j]]), "rank": 99}
                if m and j == len(p) - 1:
                    first = str(int(top[0]))
                    doctor = {"id_neg": ("-1", None), "id_big": (str(10**30), None), "id_ge_v": (str(V + 5), None),
                              "id_nonnum": ("abc", None), "id_float": ("1.5", None), "lp_str": (None, "x"),
                              "lp_pos": (None, 0.5), "lp_nan": (None, float("nan")), "lp_bool": (None, True),
                              "lp_list": (None, [1]), "lp_inf": (None, float("inf")), "lp_huge": (None, 10**400)}
                    if m in doctor:
                        key, val = doctor[m]
                        v = entry.pop(first)
                        if val is not None:
                            v = {**v, "logprob": val}
                        entry[key or first] = v
                    if m == "entry_list":
                        entry = [1, 2]
                    if m == "entry_value_str":
                        entry[first] = "oops"
                pl.append(entry)
            choices.append({"index": n, "prompt_logprobs": pl, "text": "", "finish_reason": "length"})
        return {"choices": choices}

    def __enter__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _go(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n)) if n else {}
                ans = fake.answer(self.path.split("?")[0], body)
                if ans is None:
                    data, code = b'{"error": "not found"}', 404
                elif ans == "NESTED":
                    data, code = ("[" * 100_000 + "]" * 100_000).encode(), 200
                else:
                    data, code = json.dumps(ans).encode(), 200  # NaN/Infinity as Python writes them
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _go

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self._srv.daemon_threads = True
        self.spec = f"openai:http://127.0.0.1:{self._srv.server_address[1]},kind=vllm,top_k={self.K},retries=1"
        self._t = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._srv.shutdown()
        self._srv.server_close()


@pytest.fixture(scope="module")
def fake():
    with FakeVLLM() as f:
        yield f


@pytest.fixture()
def wl(tmp_path):
    p = tmp_path / "wl.jsonl"
    p.write_text("".join(json.dumps({"id": f"w{k}", "prompt": f"hello {k} world", "max_tokens": 6}) + "\n" for k in range(3)))
    return p


def test_fake_server_captures_cleanly(fake, wl, tmp_path, capsys):
    """The control: undoctored, the hostile server's answers make a RUN with the values sent."""
    fake.mode = None
    out = tmp_path / "run"
    assert main(["capture", fake.spec, "--workload", str(wl), "--out", str(out)]) == 0
    capsys.readouterr()
    r = RunReader(out)
    it = r.items()[0]
    top = r.topk(it)
    prev = [it.prompt_ids[-1]] + it.teacher_ids[:-1]
    np.testing.assert_allclose(top["logprobs"][:, 0], [_logprobs(p).max() for p in prev], rtol=0, atol=1e-12)


SERVED_DOCTORED = {
    "id_neg": "token id -1 outside [0, 64)",
    "id_big": f"token id {10**30} outside [0, 64)",
    "id_ge_v": "token id 69 outside [0, 64)",
    "id_nonnum": "token id 'abc' is not an integer",
    "id_float": "token id '1.5' is not an integer",
    "lp_str": "log-probability 'x' is not a number",
    "lp_pos": "log-probability 0.5 > 0",
    "lp_nan": "log-probability nan is not a log-probability",
    "lp_inf": "log-probability inf is not a log-probability",
    "lp_bool": "log-probability True is not a number",
    "lp_list": "log-probability [1] is not a number",
    "lp_huge": "is not a log-probability",
    "entry_list": "prompt_logprobs entry is list",
    "entry_value_str": "log-probability 'oops' is not a number",
    "no_choices": "answered 0 choices",
    "choices_not_list": "malformed",
    "not_object": "malformed",
    "nested": "not JSON",
    "gen_big": "generated position 0: id 164 outside [0, 64)",
    "gen_neg": "generated position 1: id -3 outside [0, 64)",
    "gen_str": "generated position 0: id '7' is not an integer",
    "gen_float": "generated position 0: id 1.0 is not an integer",
    "gen_huge": "generated position 0: id",
    "gen_not_list": "not a list",
    "gen_no_choices": "malformed (missing field 'choices')",
}


@pytest.mark.parametrize("mode", list(SERVED_DOCTORED))
def test_hostile_server_answers_are_one_line_errors(mode, fake, wl, tmp_path, capsys):
    fake.mode = mode
    try:
        line = fails(capsys, ["capture", fake.spec, "--workload", wl, "--out", tmp_path / "run"], SERVED_DOCTORED[mode])
    finally:
        fake.mode = None
    assert f"http://127.0.0.1:{fake._srv.server_address[1]}" in line  # names the source
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", [-1, V, 10**6])
def test_teacher_ids_outside_the_vocabulary_are_refused(bad, fake, wl, tmp_path, capsys):
    fake.mode = None
    ref = tmp_path / "ref"
    assert main(["capture", fake.spec, "--workload", str(wl), "--out", str(ref)]) == 0
    capsys.readouterr()
    p = ref / "chunks" / "000000.items.jsonl"
    lines = p.read_text().splitlines()
    d = json.loads(lines[1])
    d["teacher_ids"][2] = bad
    lines[1] = json.dumps(d)
    p.write_text("\n".join(lines) + "\n")
    what = "teacher position 2: id" if bad != -1 else "teacher position 2: id -1 outside [0, 64)"
    fails(capsys, ["capture", fake.spec, "--reference", ref, "--out", tmp_path / "cand"], "item 'w1'", what)
    assert not (tmp_path / "cand").exists()


def test_resume_accepts_the_same_workload_bytes_under_another_path(fake, wl, tmp_path, capsys):
    fake.mode = None
    out = tmp_path / "run"
    assert main(["capture", fake.spec, "--workload", str(wl), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    m["status"] = "partial"  # as a killed capture leaves it
    (out / "manifest.json").write_text(json.dumps(m))
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(wl, moved)
    assert main(["capture", fake.spec, "--workload", str(moved), "--out", str(out), "--resume"]) == 0
    assert RunReader(out).manifest["status"] == "complete"
    moved.write_text(wl.read_text().replace("hello", "hullo"))  # other bytes: refused, naming the hash
    capsys.readouterr()
    fails(capsys, ["capture", fake.spec, "--workload", moved, "--out", out, "--resume"], "workload_sha256")


# ------------------------------------------------------------------------ 5. a full disk
_ENOSPC = r"""
import contextlib, io, json, os, subprocess, sys, traceback
mnt, levels, argvs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
from logitdiff.cli import main
results = []
for free in levels:
    for argv in argvs:
        filler = os.path.join(mnt, "filler")
        st = os.statvfs(mnt)
        with open(filler, "wb") as f:  # leave `free` bytes
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - free))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except BaseException:
                traceback.print_exc(file=err)
                rc = -1
        os.unlink(filler)
        left = sorted(os.listdir(mnt))
        results.append({"free": free, "argv": argv, "rc": rc, "err": err.getvalue(), "left": left})
        for name in left:
            subprocess.run(["rm", "-rf", os.path.join(mnt, name)])
print(json.dumps(results))
"""

FREE_LEVELS = [0, 6 << 10, 40 << 10, 400 << 10]  # bytes left: fails at the lock, a first file, a later one; fits


@pytest.mark.skipif(shutil.which("unshare") is None or not sys.platform.startswith("linux"), reason="needs Linux unshare")
def test_full_file_system_gives_one_line_and_leaves_nothing(runs, report_dir, fake, wl, tmp_path):
    """Each writing command on a real tmpfs (in a user and mount namespace of its own) with a
    few bytes left: either it fits (exit 0), or one line naming a path in that file system
    that says the device is full, exit 2, and nothing left there."""
    fake.mode = None
    npz = tmp_path / "in.npz"
    rng = np.random.default_rng(0)
    np.savez(npz, logits=rng.standard_normal((6, 16)).astype(np.float32), token_ids=np.arange(6) % 16,
             item_ids=np.array(["a"] * 3 + ["b"] * 3), positions=np.array([0, 1, 2, 0, 1, 2]))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    argvs = [["compare", str(runs["ref"]), str(runs["topk"]), "--out", f"{mnt}/rep", "--bootstrap", "0"],
             ["merge", str(runs["ref"]), "--out", f"{mnt}/merged"],
             ["report", str(report_dir), "--out", f"{mnt}/page.html"],
             ["import", "npz", str(npz), "--out", f"{mnt}/imp"],
             ["capture", fake.spec, "--workload", str(wl), "--out", f"{mnt}/cap"],
             ["topk-error", str(runs["ref"]), str(runs["bf16"]), "--k", "2", "--json", f"{mnt}/t.json"]]
    cmd = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", _ENOSPC, str(mnt),
           json.dumps(FREE_LEVELS), json.dumps(argvs)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("HOSTILE_SRC", SRC), *[p for p in sys.path if p]])}
    env.pop(VALIDATE_ENV, None)  # as users run it
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0 and not p.stdout.strip() and ("unshare" in p.stderr or "mount" in p.stderr):
        pytest.skip(f"no tmpfs in a user namespace here: {p.stderr.strip()[-200:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    failed = {}
    for r in json.loads(p.stdout.strip().splitlines()[-1]):
        assert "Traceback" not in r["err"], (r["free"], r["argv"], r["err"])
        if r["rc"] == 0:
            continue
        failed[r["free"]] = failed.get(r["free"], 0) + 1
        lines = [ln for ln in r["err"].splitlines() if ln.strip()]
        assert r["rc"] == 2 and len(lines) == 1, (r["free"], r["argv"], r["err"])
        assert "no space left on device" in lines[0].lower() and str(mnt) in lines[0], (r["argv"], lines[0])
        assert r["left"] == [], (r["free"], r["argv"], lines[0], r["left"])
    assert failed.get(0) == failed.get(6 << 10) == len(argvs), failed  # the test can fail: the disk was full


# ------------------------------------------------------------------------------ imports
@pytest.mark.parametrize("bad,dtype", [(-1, np.int64), (16, np.int32), (2**40, np.int64), (2**63 + 5, np.uint64)])
def test_imported_token_ids_outside_the_vocabulary(bad, dtype, tmp_path, capsys):
    rng = np.random.default_rng(0)
    tok = (np.arange(6) % 16).astype(dtype)
    tok[4] = bad
    npz = tmp_path / "in.npz"
    np.savez(npz, logits=rng.standard_normal((6, 16)).astype(np.float32), token_ids=tok,
             item_ids=np.array(["a"] * 3 + ["b"] * 3), positions=np.array([0, 1, 2, 0, 1, 2]))
    fails(capsys, ["import", "npz", npz, "--out", tmp_path / "imp"], f"{npz}: field 'token_ids'", "row position 4",
          f"id {bad} outside [0, 16)", "item 'b'")
    assert not (tmp_path / "imp").exists()


@pytest.mark.parametrize("bad", [-1, 16, 2**31 - 1])
def test_imported_kld_token_block_outside_the_vocabulary(bad, tmp_path, capsys):
    from logitdiff.store.importers import write_llamacpp_kld

    rng = np.random.default_rng(0)
    kld = tmp_path / "base.kld"
    write_llamacpp_kld(kld, rng.standard_normal((2, 8, 16)).astype(np.float32), rng.integers(0, 16, (2, 8)))
    raw = bytearray(kld.read_bytes())
    off = 20 + 4 * (8 + 3)  # chunk 1, position 3 of the int32 token block after the 20-byte header
    raw[off:off + 4] = int(bad).to_bytes(4, "little", signed=True)
    kld.write_bytes(bytes(raw))
    fails(capsys, ["import", "llamacpp-kld", kld, "--out", tmp_path / "imp"], f"{kld}: token block chunk 1",
          f"position 3: id {bad} outside [0, 16)")
    assert not (tmp_path / "imp").exists()


# =============================================================================================
# Round three: the commands and options merged after round two (layers, speculate, the served
# noise floor, gates --require). Every class: one line, exit 2, nothing written.
# =============================================================================================
def _damaged(runs, tmp_path) -> Path:
    """A copy of the reference RUN with its first items line cut short."""
    bad = shutil.copytree(runs["ref"], tmp_path / "damaged")
    m = json.loads((bad / "manifest.json").read_text())
    items = bad / "chunks" / m["chunks"][0]["items"]
    items.write_bytes(items.read_bytes()[:-20])
    return bad


LAYERS = ["layers", "builtin:tiny", "builtin:tiny,dtype=float32", "--floor", "none"]


@pytest.mark.parametrize("extra, teacher, what", [
    (["--floor", "garbage"], "ref", "--floor 'garbage'"),
    (["--floor", ""], "ref", "--floor ''"),
    (["--floor", "openai:http://127.0.0.1:9"], "ref", "not hidden states"),
    (["--chunk-size", "0"], "ref", "--chunk-size '0'"),
    (["--chunk-size", "nan"], "ref", "--chunk-size 'nan'"),
    (["--chunk-size", "1e400"], "ref", "--chunk-size '1e400'"),
    (["--chunk-size", "-5"], "ref", "--chunk-size '-5'"),
    ([], "wl", "not a RUN directory"),  # a workload file given as the teacher
    ([], "missing", "not a RUN directory"),
    ([], "damaged", "the run is damaged"),  # checked before any model loads
    ([], "notrun", "missing (not a logitdiff RUN)"),  # a directory that is not a RUN (e.g. a REPORT)
], ids=["floor-garbage", "floor-empty", "floor-served", "chunk-0", "chunk-nan", "chunk-1e400", "chunk-negative", "teacher-file",
        "teacher-missing", "teacher-damaged", "teacher-not-a-run"])
def test_layers_bad_arguments(extra, teacher, what, runs, tmp_path, capsys):
    given = {"ref": runs["ref"], "missing": tmp_path / "nope", "damaged": None, "notrun": tmp_path / "rep", "wl": tmp_path / "wl.jsonl"}
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "report.json").write_text("{}")
    (tmp_path / "wl.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    t = _damaged(runs, tmp_path) if teacher == "damaged" else given[teacher]
    before = tree(tmp_path)
    fails(capsys, LAYERS + ["--reference", t, "--out", tmp_path / "out", *extra], what)
    assert tree(tmp_path) == before and not (tmp_path / "out").exists()


DEAD = "http://127.0.0.1:9"


@pytest.mark.parametrize("ref, cand, extra, what", [
    (DEAD, DEAD + ",speculative=maybe", [], "unknown option 'speculative=maybe'"),
    (DEAD, "openai:" + DEAD + ",batching=bogus", [], "unknown option 'batching=bogus'"),
    (DEAD + ",speculative=1", DEAD, [], "declared speculative"),
    ("notaurl", DEAD, [], "expected a llama-server URL"),
    (DEAD, DEAD, ["--timeout", "nan"], "--timeout nan"),  # was a ValueError traceback from httpx
    (DEAD, DEAD, ["--timeout", "-1"], "--timeout -1"),  # was a traceback
    (DEAD, DEAD, ["--timeout", "inf"], "--timeout inf"),  # was an OverflowError traceback
    (DEAD, DEAD, ["--timeout", "0"], "--timeout 0"),  # was "connection lost ... did the server die?"
    (DEAD, DEAD, ["--top-k", "0"], "--top-k 0"),
    (DEAD, DEAD, ["--max-tokens", "0"], "--max-tokens 0"),
], ids=["speculative-maybe", "batching-bogus", "reference-speculative", "not-a-url", "timeout-nan", "timeout-negative",
        "timeout-inf", "timeout-0"] + ["top-k-0", "max-tokens-0"])
def test_speculate_bad_arguments_before_any_server(ref, cand, extra, what, tmp_path, capsys):
    fails(capsys, ["speculate", ref, cand, "--out", tmp_path / "out", *extra], what)
    assert os.listdir(tmp_path) == []


def test_speculate_top_k_beyond_the_vocabulary(tmp_path, capsys):
    """A real llama-server (the bundled model, V = 4096): --top-k 100000 was accepted and the
    report claimed 100,000 log-probabilities a position; now refused at the handshake."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from servers import llama_server, start_or_fail

    from logitdiff.builtin import gguf_path

    srv = start_or_fail(llama_server, gguf_path("F32"), tmp_path / "logs", parallel=1, threads=1)
    try:
        out = tmp_path / "out"
        fails(capsys, ["speculate", srv.url, srv.url, "--out", out, "--top-k", "100000", "--max-tokens", "2", "--floor-items", "0"],
              "--top-k 100000", "vocabulary size 4096")
        assert not out.exists()
    finally:
        srv.stop()


def _ident(**over) -> dict:
    return {"backend": "synthetic", "weight_files": {"m.safetensors": "sha256:aa"}, "dtype": "float32", "batch": 8, "threads": 2,
            **over}


@pytest.mark.parametrize("floor, what", [
    ("self", "is the reference RUN itself"),
    ("weights", "'weight_files'"),
    ("dtype", "'dtype'"),
    ("backend", "'backend'"),
    ("served-model", "'model'"),
    ("not-served", "'kind'"),
], ids=["the-reference-itself", "other-weights", "other-dtype", "other-engine", "other-served-model", "served-vs-in-process"])
def test_noise_floor_of_another_model_is_refused(floor, what, tmp_path, capsys):
    """--noise-floor must be the reference's model captured again: the reference RUN itself
    (a floor of 0 by construction) or a RUN of other weights, dtype, engine or served model
    (a drift read as the floor: every "x noise floor" wrong) was accepted with exit 0."""
    served = floor in ("served-model", "not-served")
    base = _ident(**({"kind": "openai", "model": "a", "server": "llamacpp"} if served else {}))
    ref = make_run(tmp_path / "ref", identity=base)
    cand = make_run(tmp_path / "cand", identity=_ident(dtype="bfloat16"), seed=1)
    nf = ref if floor == "self" else make_run(tmp_path / "nf", seed=2, identity={
        "weights": {**base, "weight_files": {"m.safetensors": "sha256:bb"}}, "dtype": {**base, "dtype": "bfloat16"},
        "backend": {**base, "backend": "other"}, "served-model": {**base, "model": "b"},
        "not-served": _ident(backend="transformers")}[floor])
    before = tree(tmp_path)
    fails(capsys, ["compare", ref, cand, "--noise-floor", nf, "--out", tmp_path / "rep", "--bootstrap", "0"], "--noise-floor", what)
    assert tree(tmp_path) == before and not (tmp_path / "rep").exists()


def test_noise_floor_rerun_with_other_layout_is_accepted(tmp_path, capsys):
    """The positive control: a rerun of the same model with another batch and thread count
    (what a rerun varies), and a served rerun with other batching, are floors."""
    for served in (False, True):
        extra = {"model": "a", "server": "llamacpp", "batching": "rounds"} if served else {}
        ref = make_run(tmp_path / f"ref{served}", identity=_ident(**extra))
        nf = make_run(tmp_path / f"nf{served}", seed=2, identity=_ident(batch=1, threads=1, **{**extra, **({"batching": "serial"} if served else {})}))
        out = tmp_path / f"rep{served}"
        assert main(["compare", str(ref), str(make_run(tmp_path / f"c{served}", seed=1)), "--noise-floor", str(nf), "--out", str(out),
                     "--bootstrap", "0"]) == 0
        capsys.readouterr()
        floor = json.loads((out / "report.json").read_text())["summary"]["noise_floor"]
        assert floor["kl_nats_mean"] > 0 and floor["positions"] == 15


@pytest.mark.parametrize("flag, value, what", [
    ("--require", "", "--require '': no clause"),
    ("--require", " , ", "no clause"),
    ("--fail-on", "kl_mean>", "threshold '' is not a finite number"),
    ("--fail-on", "nosuch>1", "unknown metric 'nosuch'"),
    ("--require", "kl_mean==0", "bad operator '=='"),
    ("--require", "kl_mean<inf", "threshold 'inf'"),
    ("--fail-on", "kl_mean>nan", "threshold 'nan'"),
], ids=["require-empty", "require-commas", "fail-on-no-number", "fail-on-unknown-metric", "require-eq", "require-inf", "fail-on-nan"])
@pytest.mark.parametrize("command", ["compare", "run"])
def test_gate_option_errors(command, flag, value, what, runs, tmp_path, capsys):
    argv = (["compare", runs["ref"], runs["ref"]] if command == "compare"
            else ["run", "--workload", runs["root"] / "missing.jsonl"]) + ["--out", tmp_path / "out", f"{flag}={value}"]
    fails(capsys, argv, what)
    assert os.listdir(tmp_path) == []


def test_bootstrap_0_reports_say_no_interval(runs, tmp_path, capsys):
    """--bootstrap 0: every CI is null, and report.md and the page say there is none (not
    '95 % CIs from 0 bootstrap resamples', not a zero-width interval)."""
    out = tmp_path / "rep"
    assert main(["compare", str(runs["ref"]), str(runs["topk"]), "--out", str(out), "--bootstrap", "0"]) == 0
    capsys.readouterr()
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["metrics"]["kl_nats"]["ci95"] == [None, None]
    md = (out / "report.md").read_text()
    assert "no 95 % CIs (--bootstrap 0)" in md and "from 0 bootstrap" not in md
    page = (out / "report.html").read_text()
    assert "no 95 % CIs (--bootstrap 0)" in page and "from 0 bootstrap" not in page
