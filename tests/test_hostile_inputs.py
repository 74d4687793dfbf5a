"""Hostile input files (issue 39): every file a command reads is opened as a regular file
with a size bound checked before anything is allocated (store.files.open_input), and every
compressed member's claim is checked against what its chunk's rows may hold.

Real parts: RUNs written by the real RunWriter (synthetic rows, every store kind), REPORTs
written by the real `compare`, real FIFOs, real symlinks to /dev/zero and out of the RUN,
real deflate streams that inflate to hundreds of MiB; commands run as real processes
(``python -m logitdiff.cli``) with a time limit and an address-space limit, so a hang or a read
until memory runs out fails the test instead of stopping the suite.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from logitdiff.contracts import REPORT_SCHEMA
from logitdiff.cli import main
from logitdiff.errors import LogitdiffError
from logitdiff.report import read_report_and_columns
from logitdiff.store import RunItem, RunReader, RunWriter, npzinflate
from logitdiff.store import hidden as Hs
from logitdiff.store.files import holds_no_files, open_input, read_input_bytes, remove_tree, same_directory

SRC = str(Path(__file__).resolve().parents[1] / "src")
V, H, ITEMS, ROWS = 16, 8, 3, 5


def _items():
    rng = np.random.default_rng(1234)
    return [RunItem(id=f"i{n}", prompt_ids=[1, 2], teacher_ids=rng.integers(0, V, ROWS).tolist(), positions=list(range(ROWS)))
            for n in range(ITEMS)]


def make_run(path: Path, store: str = "full", seed: int = 0) -> Path:
    """A RUN of every store kind from synthetic rows (the hidden store's rows are its head's
    output, as a transformers source gives them), with vocab.json and tokens.json."""
    rng = np.random.default_rng(seed)
    head = Hs.round_bits(rng.normal(0, 1, (V, H))) if store == "hidden" else None
    w = RunWriter(path, source={"spec": "synthetic:m", "kind": "synthetic", "identity": {"weights": "a"}}, vocab_size=V,
                  tokenizer_hash=None, store=store, dtype="bfloat16" if store == "hidden" else "float32",
                  vocab=[f"t{i}" for i in range(V)], tokens=[f"t{i}" for i in range(V)], head=head, chunk_rows=7)
    for it in _items():
        if store == "hidden":
            h = Hs.round_bits(rng.normal(0, 1, (ROWS, H)))
            w.add(it, logits=Hs.round_bits(Hs._bits_to_f64(h) @ Hs._bits_to_f64(head).T), hidden=h)
        elif store.startswith("topk"):
            k = int(store.split(":")[1])
            lp = rng.standard_normal((ROWS, V))
            lp -= np.log(np.exp(lp).sum(1, keepdims=True))
            idx = np.argsort(-lp, axis=1, kind="stable")[:, :k]
            w.add(it, stored={"ids": idx.astype(np.int64), "logprobs": np.take_along_axis(lp, idx, 1)})
        else:
            w.add(it, logits=rng.standard_normal((ROWS, V)).astype(np.float32))
    w.finish()
    return path


STORES = {"full": "full", "topk": "topk:4", "compact": "compact:exact=4,band=8", "hidden": "hidden"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    runs = {name: make_run(root / name, store) for name, store in STORES.items()}
    runs["cand"] = make_run(root / "cand", seed=1)
    rep = root / "report"
    assert main(["compare", str(runs["full"]), str(runs["cand"]), "--out", str(rep), "--bootstrap", "0"]) == 0
    wl = root / "wl.jsonl"
    wl.write_text('{"id": "a", "prompt": "hi", "max_tokens": 2}\n')
    npz = root / "in.npz"
    np.savez(npz, logits=np.zeros((2, V), np.float32), token_ids=np.array([1, 2]), item_ids=np.array(["a", "a"]),
             positions=np.array([0, 1]))
    kld = root / "in.kld"
    kld.write_bytes(b"_logits_" + np.array([4, V, 1], "<i4").tobytes())
    return {"root": root, "runs": runs, "report": rep, "wl": wl, "npz": npz, "kld": kld}


def _chunk(run: Path, key: str, index: int = 0) -> str:
    return "chunks/" + json.loads((run / "manifest.json").read_text())["chunks"][index][key]


def cli(argv, timeout: float = 120) -> subprocess.CompletedProcess:
    """``logitdiff ARGV`` as a process: at most ``timeout`` seconds (a FIFO that hangs it
    fails the test) and 6 GiB of address space (a read of /dev/zero until memory runs out
    ends with MemoryError, not with the machine's memory)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    env = {**os.environ, "PYTHONPATH": SRC}
    try:
        return subprocess.run([sys.executable, "-m", "logitdiff.cli", *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env=env, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"logitdiff {' '.join(map(str, argv))}: still running after {timeout} s (hung on an input)")


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("logitdiff: error: "), proc.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# Every file a command reads: (what is copied, the file in it, the command reading it).
# RUN files: the doctored RUN is the reference of a compare (its manifest, its chunks'
# items and rows, vocab.json, the hidden store's head); REPORT files through `report`; the
# workload through `capture`; both import formats.
def _compare(d, base, tmp):
    return ["compare", d, base["runs"]["cand"], "--out", tmp / "rep", "--bootstrap", "0"]


INPUTS = {
    "manifest.json": ("full", lambda run: "manifest.json", _compare),
    "vocab.json": ("full", lambda run: "vocab.json", _compare),
    "chunk items.jsonl": ("full", lambda run: _chunk(run, "items"), _compare),
    "full chunk": ("full", lambda run: _chunk(run, "data"), _compare),
    "top-K chunk": ("topk", lambda run: _chunk(run, "data"), _compare),
    "compact chunk": ("compact", lambda run: _chunk(run, "data"), _compare),
    "hidden chunk": ("hidden", lambda run: _chunk(run, "data"), _compare),
    "hidden head.npy": ("hidden", lambda run: "head.npy", _compare),
    "report.json": ("report", lambda d: "report.json", lambda d, base, tmp: ["report", d, "--out", tmp / "p.html"]),
    "tokens.parquet": ("report", lambda d: "tokens.parquet", lambda d, base, tmp: ["report", d, "--out", tmp / "p.html"]),
    "workload": ("wl", None, lambda p, base, tmp: ["capture", "builtin:tiny", "--workload", p, "--out", tmp / "o"]),
    "import npz": ("npz", None, lambda p, base, tmp: ["import", "npz", p, "--out", tmp / "o"]),
    "import llamacpp-kld": ("kld", None, lambda p, base, tmp: ["import", "llamacpp-kld", p, "--out", tmp / "o"]),
}


def _placed(base, name: str, tmp: Path) -> tuple[Path, Path]:
    """A copy of the input ``name`` lives in (a RUN, a REPORT or the file itself) and the path
    of the file to replace in it."""
    what, rel, _ = INPUTS[name]
    if rel is None:
        return tmp / base[what].name, tmp / base[what].name
    src = base["report"] if what == "report" else base["runs"][what]
    d = Path(shutil.copytree(src, tmp / "in"))
    return d, d / rel(d)


@pytest.mark.parametrize("replacement", ["fifo", "symlink to /dev/zero"])
@pytest.mark.parametrize("name", list(INPUTS))
def test_a_fifo_or_a_device_in_place_of_any_input_is_one_line(name, replacement, base, tmp_path):
    """Each input a command reads, replaced by a FIFO nobody writes to (it hung the command)
    or by a symlink to /dev/zero (read until memory ran out): one line naming the file,
    exit 2, at once."""
    arg, target = _placed(base, name, tmp_path)
    target.unlink(missing_ok=True)
    if replacement == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    line = one_line(cli(INPUTS[name][2](arg, base, tmp_path)), target.name)
    # what it is (a FIFO, a device, a symlink out of the RUN), or that it is no regular file
    # where a command looks for one before opening it (a workload, a REPORT's report.json)
    assert any(w in line for w in ("FIFO", "character device", "symlink out of", "not a regular file", "no report.json")), line


@pytest.mark.parametrize("replacement", ["fifo", "symlink to /dev/zero"])
@pytest.mark.parametrize("output", ["REPORT report.json", "RUN manifest.json"])
def test_an_existing_outputs_marker_replaced_by_a_fifo_or_device_is_refused_at_once(output, replacement, base, tmp_path):
    """The output guard reads the marker of an existing --out (a REPORT's report.json, a
    RUN's manifest.json) to tell whether it may replace it: a FIFO there hung the command, a
    symlink to /dev/zero was read until memory ran out; now the --out is no logitdiff output
    of that kind, refused in one line and left as it was."""
    kind, marker = output.split()
    out = Path(shutil.copytree(base["report"] if kind == "REPORT" else base["runs"]["full"], tmp_path / "out"))
    (out / marker).unlink()
    if replacement == "fifo":
        os.mkfifo(out / marker)
    else:
        (out / marker).symlink_to("/dev/zero")
    before = sorted(os.listdir(out))
    argv = (["compare", base["runs"]["full"], base["runs"]["cand"], "--out", out, "--bootstrap", "0"] if kind == "REPORT"
            else ["import", "npz", base["npz"], "--out", out, "--overwrite"])
    one_line(cli(argv), str(out))
    assert sorted(os.listdir(out)) == before


RUN_FILES = {k: v for k, v in INPUTS.items() if v[2] is _compare}


@pytest.mark.parametrize("name", list(RUN_FILES))
def test_a_run_file_symlinked_out_of_the_run_is_refused_and_inside_it_read(name, base, tmp_path):
    """A RUN's files are its own: the same bytes behind a symlink out of the RUN are refused
    (a RUN moved or shared must not read another directory's files without a word); behind a
    symlink that stays inside the RUN they are read as before."""
    run, target = _placed(base, name, tmp_path)
    outside = tmp_path / "elsewhere" / target.name
    outside.parent.mkdir()
    shutil.move(target, outside)
    target.symlink_to(outside)
    one_line(cli(_compare(run, base, tmp_path)), target.name, "symlink out of")
    inside = run / "kept" / target.name
    inside.parent.mkdir()
    shutil.move(outside, inside)
    target.unlink()
    target.symlink_to(os.path.relpath(inside, target.parent))
    assert main([str(a) for a in _compare(run, base, tmp_path)]) == 0


# ----------------------------------------------------------------------------- compressed members
def _deflated_zeros_npy(zf: zipfile.ZipFile, name: str, nbytes: int, dtype=np.uint16, shape=None) -> None:
    """A member ``name`` holding a .npy of ``nbytes`` of zeros, deflated as it is written (the
    test never holds the inflated bytes)."""
    bio = io.BytesIO()
    count = nbytes // np.dtype(dtype).itemsize
    np.lib.format.write_array_header_1_0(bio, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": shape or (count,)})
    with zf.open(name, "w", force_zip64=True) as f:
        f.write(bio.getvalue())
        block = bytes(1 << 20)
        for _ in range(nbytes >> 20):
            f.write(block)


@pytest.mark.parametrize("reader", ["libdeflate", "np.load"])
@pytest.mark.parametrize("store", ["topk", "compact", "hidden"])
def test_a_chunk_member_beyond_what_its_rows_hold_is_refused_before_it_is_inflated(store, reader, base, tmp_path, monkeypatch):
    """A chunk whose members inflate to 512 MiB (a few hundred KiB of deflate) while the
    manifest's rows of it hold a few KiB: refused before it is inflated, on both readers,
    with no allocation near the claim; one line naming the chunk."""
    if reader == "np.load":
        monkeypatch.setattr(npzinflate, "_lib", lambda: None)
    elif not npzinflate.available():
        pytest.skip("libdeflate not on this system")
    run = Path(shutil.copytree(base["runs"][store], tmp_path / "run"))
    chunk = run / _chunk(run, "data")
    with zipfile.ZipFile(chunk) as zf:
        names = zf.namelist()
        members = {n: zf.read(n) for n in names}
    big = max(names, key=lambda n: len(members[n]))
    with zipfile.ZipFile(chunk, "w", zipfile.ZIP_DEFLATED) as zf:
        for n in names:
            if n == big:
                _deflated_zeros_npy(zf, n, 512 << 20)
            else:
                zf.writestr(n, members[n])
    assert chunk.stat().st_size < 4 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reader_ = RunReader(run)
    with pytest.raises(LogitdiffError) as ei:
        list(reader_.row_blocks(reader_.items(), 64))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 128 << 10  # KiB
    msg = str(ei.value)
    assert "\n" not in msg and str(chunk) in msg and "claim" in msg, msg


@pytest.mark.parametrize("field,dtype", [("exc_row", np.float64), ("exc_id", np.float32), ("exc_row", np.bool_),
                                         ("exc_bits", np.int64), ("exc_id", np.complex64)])
def test_hidden_exception_fields_of_another_dtype_are_one_line(field, dtype, base, tmp_path):
    """A hidden chunk's exception rows, ids or bits of a dtype that cannot index or be bf16
    bits (float64 exc_row was an IndexError traceback): one line naming chunk and field."""
    run = Path(shutil.copytree(base["runs"]["hidden"], tmp_path / "run"))
    chunk = run / _chunk(run, "data")
    with np.load(chunk) as z:
        data = {k: z[k] for k in z.files}
    data["exc_row"], data["exc_id"], data["exc_bits"] = np.array([0]), np.array([1]), np.array([7], np.uint16)
    data[field] = data[field].astype(dtype)
    np.savez_compressed(chunk, **data)
    line = one_line(cli(_compare(run, base, tmp_path)), str(chunk), f"field {field!r}")
    assert np.dtype(dtype).name in line


# ----------------------------------------------------------------------------- imports
def test_import_npz_with_sparse_positions_is_refused_before_anything_is_written(tmp_path):
    """A few KiB of .npz whose positions reach MAX_POSITION for many items: each item's
    teacher sequence would be millions of -1 entries (10 KiB became 3.9 GiB); refused with one
    line naming the field, nothing written."""
    n = 200
    p = tmp_path / "sparse.npz"
    np.savez(p, logits=np.zeros((n, 4), np.float32), token_ids=np.zeros(n, np.int64),
             item_ids=np.array([f"i{k}" for k in range(n)]), positions=np.full(n, (1 << 22) - 1))
    assert p.stat().st_size < 16 << 10
    proc = cli(["import", "npz", p, "--out", tmp_path / "o"])
    one_line(proc, str(p), "'positions'")
    assert not (tmp_path / "o").exists()


def test_import_npz_dense_positions_still_import(tmp_path):
    """The bound keeps real exports: positions 0..N-1 of a few items import as before."""
    rng = np.random.default_rng(0)
    p = tmp_path / "dense.npz"
    np.savez(p, logits=rng.standard_normal((12, 8)).astype(np.float32), token_ids=rng.integers(0, 8, 12),
             item_ids=np.repeat(["a", "b", "c"], 4), positions=np.tile(np.arange(4), 3))
    assert main(["import", "npz", str(p), "--out", str(tmp_path / "o")]) == 0
    assert [len(it.teacher_ids) for it in RunReader(tmp_path / "o").items()] == [4, 4, 4]


@pytest.mark.parametrize("claim", ["inflating", "header"])
def test_import_npz_bomb_is_refused_before_it_is_inflated(claim, tmp_path):
    """A .npz whose logits inflate to 256 MiB from ~256 KiB (a deflate bomb, ~1000x), or whose
    .npy header claims 64 GiB in a few bytes: one line, no allocation near the claim."""
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        if claim == "inflating":
            _deflated_zeros_npy(zf, "logits.npy", 256 << 20, np.float32, shape=(1 << 20, 64))
        else:
            bio = io.BytesIO()
            np.lib.format.write_array_header_1_0(bio, {"descr": "<f4", "fortran_order": False, "shape": (1 << 24, 1024)})
            zf.writestr("logits.npy", bio.getvalue() + bytes(64))
        for k, a in {"token_ids": np.zeros(1, np.int64), "item_ids": np.array(["a"]), "positions": np.zeros(1, np.int64)}.items():
            b = io.BytesIO()
            np.save(b, a)
            zf.writestr(f"{k}.npy", b.getvalue())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(LogitdiffError) as ei:
        from logitdiff.store.importers import import_npz

        import_npz(p, tmp_path / "o")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    assert "\n" not in str(ei.value) and str(p) in str(ei.value) and "claim" in str(ei.value), ei.value
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- tokens.parquet, report swaps
@pytest.mark.parametrize("content", [b"", b"not parquet at all\n", b"PAR1" + bytes(100) + b"PAR1"])
def test_tokens_parquet_that_is_not_parquet_is_one_line(content, base, tmp_path):
    """flips and report read tokens.parquet: a file that is not Parquet (empty, text, a bad
    footer) was an ArrowInvalid traceback; now one line naming the file, from the reader both
    commands use and from `report`."""
    rep = Path(shutil.copytree(base["report"], tmp_path / "rep"))
    (rep / "tokens.parquet").write_bytes(content)
    with pytest.raises(LogitdiffError) as ei:
        read_report_and_columns(rep)
    assert "\n" not in str(ei.value) and str(rep / "tokens.parquet") in str(ei.value)
    one_line(cli(["report", rep, "--out", tmp_path / "p.html"]), "tokens.parquet")
    one_line(cli(["flips", rep]), "tokens.parquet")


def test_a_report_replaced_between_its_reads_is_refused_not_mixed(base, tmp_path):
    """report.json and tokens.parquet are read as one version of the REPORT: a REPORT that
    `compare` replaced (a temporary renamed over it, as store.files.writing does) between the
    two reads is a one-line error, never one report's figures beside the other's tokens."""
    rep = Path(shutil.copytree(base["report"], tmp_path / "rep"))
    other = Path(shutil.copytree(base["report"], tmp_path / "other"))
    with pytest.raises(LogitdiffError, match="replaced by another command while it was read"):
        with same_directory(rep):
            json.loads((rep / "report.json").read_text())
            os.replace(rep, tmp_path / "old")
            os.replace(other, rep)
    report, cols = read_report_and_columns(rep)  # undisturbed: read whole
    assert len(cols["kl_nats"]) == ITEMS * ROWS and report["schema"] == REPORT_SCHEMA


def test_report_reads_racing_compare_never_mix(base, tmp_path):
    """A real race: `compare` replaces the REPORT again and again with reports of
    two candidates while it is read; every read gives report.json and tokens.parquet of the
    same compare (the report's mean and max KL are its columns'; the two candidates' differ),
or the one-line error."""
    rep = tmp_path / "rep"
    cands = [base["runs"]["cand"], make_run(tmp_path / "cand2", seed=7)]
    assert main(["compare", str(base["runs"]["full"]), str(cands[0]), "--out", str(rep), "--bootstrap", "0"]) == 0
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            k += 1
            main(["compare", str(base["runs"]["full"]), str(cands[k % 2]), "--out", str(rep), "--bootstrap", "0"])

    t = threading.Thread(target=writer)
    t.start()
    reads = refused = 0
    try:
        for _ in range(60):
            try:
                report, cols = read_report_and_columns(rep)
            except LogitdiffError as e:
                assert "replaced by another command" in str(e) or "not found" in str(e), e
                refused += 1
                continue
            reads += 1
            assert report["summary"]["kl_nats_max"] == float(np.max(cols["kl_nats"]))
            assert abs(report["summary"]["kl_nats_mean"] - float(np.mean(cols["kl_nats"]))) < 1e-9
    finally:
        stop.set()
        t.join()
    assert reads > 0


# ----------------------------------------------------------------------------- depth
def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("where", ["manifest.json", "vocab.json", "report.json", "items line", "workload line"])
def test_json_nested_200000_deep_is_one_line(where, base, tmp_path):
    """A JSON value nested 200,000 deep in any JSON a command reads: one line, no
    RecursionError traceback."""
    deep = _deep(200_000)
    if where == "report.json":
        rep = Path(shutil.copytree(base["report"], tmp_path / "rep"))
        (rep / "report.json").write_text('{"schema": "logitdiff.report/2", "x": ' + deep + "}")
        one_line(cli(["report", rep, "--out", tmp_path / "p.html"]), "report.json")
        return
    if where == "workload line":
        wl = tmp_path / "wl.jsonl"
        wl.write_text('{"id": "a", "prompt": ' + deep + "}\n")
        one_line(cli(["capture", "builtin:tiny", "--workload", wl, "--out", tmp_path / "o"]), str(wl))
        return
    run = Path(shutil.copytree(base["runs"]["full"], tmp_path / "run"))
    if where == "manifest.json":
        target = run / "manifest.json"
        target.write_text('{"schema": "logitdiff.run/1", "x": ' + deep + "}")
    elif where == "vocab.json":
        target = run / "vocab.json"
        target.write_text(deep)
    else:
        target = run / _chunk(run, "items")
        target.write_text(target.read_text() + '{"id": ' + deep + "}\n")
    one_line(cli(_compare(run, base, tmp_path)), target.name)


def _nest(top: Path, depth: int, leaf: str | None = None, link: Path | None = None) -> None:
    """``top/d/d/.../d`` ``depth`` deep, made as a tool in the sandbox makes it (one directory
    at a time, relative to the last: its path is far beyond PATH_MAX), with a file ``leaf``
    and a symlink to ``link`` at the bottom."""
    top.mkdir(exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    if leaf:
        os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    if link:
        os.symlink(link, "link", dir_fd=fd)
    os.close(fd)


def test_3000_nested_directories_do_not_stop_the_output_guard_or_its_removal(base, tmp_path):
    """Directories nested 3,000 deep (os.walk and shutil.rmtree recurse once per level in
    Python 3.11, and the path is beyond PATH_MAX): the output guard finds a file at the
    bottom (and refuses the --out) or none (and takes it); a REPORT holding such a tree is
    replaced and removed; remove_tree removes it whole and never follows a symlink."""
    out = tmp_path / "out"
    _nest(out, 3000, leaf="f")
    assert not holds_no_files(out)
    line = one_line(cli(["compare", base["runs"]["full"], base["runs"]["cand"], "--out", out, "--bootstrap", "0"]), str(out))
    assert "RecursionError" not in line
    remove_tree(out)
    assert not out.exists()
    _nest(out, 3000)
    assert holds_no_files(out)
    assert main(["compare", str(base["runs"]["full"]), str(base["runs"]["cand"]), "--out", str(out), "--bootstrap", "0"]) == 0
    assert (out / "report.json").is_file() and not (out / "d").exists()
    _nest(out, 3000, leaf="f")
    assert main(["compare", str(base["runs"]["full"]), str(base["runs"]["cand"]), "--out", str(out), "--bootstrap", "0"]) == 0
    assert not (out / "d").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
    _nest(tmp_path / "tree", 3000, leaf="f", link=base["root"])
    remove_tree(tmp_path / "tree")
    assert not (tmp_path / "tree").exists() and (base["root"] / "report" / "report.json").is_file()


# ----------------------------------------------------------------------------- the helper itself
def test_open_input_refuses_every_kind_of_non_file_and_checks_the_size_first(tmp_path):
    """The one opener: a FIFO, a character device, a socket and a directory are refused
    before any read (O_NONBLOCK: the FIFO does not block the open); a file beyond max_bytes
    is refused from fstat; a file at max_bytes is read whole."""
    import socket

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    try:
        for path, kind in ((fifo, "FIFO"), (Path("/dev/zero"), "character device"), (sock, "socket"), (tmp_path, "directory")):
            with pytest.raises(LogitdiffError, match=kind):
                open_input(path, max_bytes=1 << 20)
    finally:
        s.close()
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert read_input_bytes(f, max_bytes=100) == b"x" * 100
    with pytest.raises(LogitdiffError, match="100 bytes, more than the 99"):
        read_input_bytes(f, max_bytes=99)
    with pytest.raises(LogitdiffError, match="not found"):
        read_input_bytes(tmp_path / "missing", max_bytes=10)
