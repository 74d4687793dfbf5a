"""Nothing lost, nothing mixed: every command that writes, against what it must not destroy.

Class tests run every writing command (capture reference and candidate, compare, import
llamacpp-kld and npz, merge, report, topk-error --json, run, layers, speculate) against a foreign directory,
a regular file, its own input, paths it cannot write, a concurrent writer (a real second
process holding the lock), a lock left by a killed process, and a failing replace; each
hashes the pre-existing bytes (the whole tree) before and after, and checks that no
temporary or lock file is left beside the output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from logitdiff.cli import main
from logitdiff.store.importers import write_llamacpp_kld
from logitdiff.store import RunReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import llama_server, start_or_fail  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------- helpers
def digest(path: Path) -> str:
    """Hash of a whole tree (names, kinds, bytes) or a file; 'missing' when absent."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_symlink():
        h.update(b"L" + os.readlink(path).encode())
    elif path.is_file():
        h.update(b"F" + path.read_bytes())
    elif path.is_dir():
        for p in sorted(path.rglob("*")):
            h.update(str(p.relative_to(path)).encode() + b"\0")
            h.update(b"F" + p.read_bytes() if p.is_file() and not p.is_symlink() else b"D")
    else:
        return "missing"
    return h.hexdigest()


def siblings(path: Path) -> list[str]:
    return sorted(os.listdir(Path(path).parent)) if Path(path).parent.exists() else []


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "logitdiff.cli", *argv], capture_output=True, text=True, env=env, timeout=600)


HOLD_LOCK = (
    "import sys, time\n"
    "from logitdiff.store.files import locked\n"
    "with locked(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)


def hold_lock(path: Path) -> subprocess.Popen:
    """A real second process holding the output's lock, as a writer does."""
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """Small real inputs: a workload, a reference RUN (bundled model, BF16), a candidate RUN
    (the same model in F32, teacher-forced), a REPORT, a page, llama.cpp and npz files."""
    root = tmp_path_factory.mktemp("safety")
    wl = root / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": p, "max_tokens": 4}) + "\n"
                          for k, p in enumerate(["def add(a, b):", "The capital of France is", "1, 2, 3,"])))
    ref, cand, rep = root / "ref", root / "cand", root / "rep"
    assert main(["capture", "builtin:tiny", "--workload", str(wl), "--out", str(ref)]) == 0
    assert main(["capture", "builtin:tiny,dtype=float32", "--reference", str(ref), "--out", str(cand)]) == 0
    assert main(["compare", str(ref), str(cand), "--out", str(rep), "--bootstrap", "10"]) == 0
    page = root / "page.html"
    assert main(["report", str(rep), "--out", str(page)]) == 0
    topk_json = root / "topk.json"
    assert main(["topk-error", str(ref), str(cand), "--k", "4", "--json", str(topk_json)]) == 0
    rng = np.random.default_rng(0)
    kld = root / "base.kld"
    write_llamacpp_kld(kld, rng.normal(size=(2, 8, 32)).astype(np.float32), rng.integers(0, 32, size=(2, 8)))
    bad_kld = root / "nan.kld"
    data = bytearray(kld.read_bytes())
    data[20 + 4 * 8 * 2 : 20 + 4 * 8 * 2 + 4] = np.array([np.nan], dtype="<f4").tobytes()  # first row's scale
    bad_kld.write_bytes(bytes(data))
    npz = root / "x.npz"
    np.savez(npz, logits=rng.normal(size=(6, 32)).astype(np.float32), token_ids=rng.integers(0, 32, 6),
             item_ids=np.array(["a", "a", "a", "b", "b", "b"]), positions=np.array([0, 1, 2, 0, 1, 2]))
    nan_npz = root / "nan.npz"
    lg = rng.normal(size=(6, 32)).astype(np.float32)
    lg[4, 7] = np.nan
    np.savez(nan_npz, logits=lg, token_ids=rng.integers(0, 32, 6), item_ids=np.array(["a", "a", "a", "b", "b", "b"]),
             positions=np.array([0, 1, 2, 0, 1, 2]))
    npz_run = root / "npzrun"
    assert main(["import", "npz", str(npz), "--out", str(npz_run)]) == 0
    run_out = root / "runout"
    assert main(RUN_ARGS(wl) + ["--out", str(run_out)]) == 0
    lay = root / "lay"
    assert main(LAYERS_ARGS(ref) + ["--out", str(lay)]) == 0
    started = []

    def spec_url() -> str:
        """One real llama-server (the bundled model, F32, no speculation), started on first
        use: speculate's reference and candidate at once (the cheapest real pair)."""
        if not started:
            from logitdiff.builtin import gguf_path

            started.append(start_or_fail(llama_server, gguf_path("F32"), root / "logs", parallel=1, threads=1))
        return started[0].url

    def spec_out() -> Path:
        out = root / "specout"
        if not out.exists():
            assert main(SPEC_ARGS(spec_url(), wl) + ["--out", str(out)]) == 0
        return out

    yield dict(root=root, wl=wl, ref=ref, cand=cand, rep=rep, page=page, topk_json=topk_json, kld=kld, bad_kld=bad_kld,
               npz=npz, nan_npz=nan_npz, npz_run=npz_run, run_out=run_out, lay=lay, spec_url=spec_url, spec_out=spec_out)
    for s in started:
        s.stop()


def LAYERS_ARGS(teacher):
    return ["layers", "builtin:tiny", "builtin:tiny,dtype=float32", "--reference", str(teacher), "--floor", "none"]


def SPEC_ARGS(url, wl):
    return ["speculate", url, url, "--workload", str(wl), "--max-tokens", "4", "--floor-items", "0", "--top-k", "2"]


# a port nothing listens on: speculate fails at its first request, after its --out checks
DEAD_URL = "http://127.0.0.1:9"


def RUN_ARGS(wl):
    return ["run", "--reference", "builtin:tiny", "--candidate", "builtin:tiny,dtype=float32", "--workload", str(wl),
            "--no-noise-floor", "--no-flips", "--bootstrap", "10", "--floor", "none"]


@dataclass
class Command:
    """A writing command: argv for an output path, which input --out must not be, a
    same-kind output to start from, and an invocation that fails while replacing it."""

    name: str
    is_file: bool
    argv: Callable[[dict, str], list[str]]
    own_input: str  # key of w
    existing: str  # key of w: a valid output of the same kind
    failing: Callable[[dict, str], list[str]]


COMMANDS = [
    Command("capture-reference", False,
            lambda w, o: ["capture", "builtin:tiny", "--workload", str(w["wl"]), "--out", o], "wl", "ref",
            lambda w, o: ["capture", "builtin:tiny", "--workload", str(w["wl"]), "--out", o, "--overwrite", "--positions", "bogus"]),
    Command("capture-candidate", False,
            lambda w, o: ["capture", "builtin:tiny", "--reference", str(w["ref"]), "--out", o], "ref", "cand",
            lambda w, o: ["capture", "builtin:tiny", "--reference", str(w["ref"]), "--out", o, "--overwrite", "--store", "topk:abc"]),
    Command("capture-hidden", False,
            lambda w, o: ["capture", "builtin:tiny", "--reference", str(w["ref"]), "--out", o, "--store", "hidden"], "ref", "cand",
            # refused: float32 logits cannot fill a hidden-state store
            lambda w, o: ["capture", "builtin:tiny,dtype=float32", "--reference", str(w["ref"]), "--out", o, "--overwrite",
                          "--store", "hidden"]),
    Command("compare", False,
            lambda w, o: ["compare", str(w["ref"]), str(w["cand"]), "--out", o, "--bootstrap", "10"], "cand", "rep",
            # fails after reading both runs: another vocabulary
            lambda w, o: ["compare", str(w["ref"]), str(w["npz_run"]), "--out", o, "--bootstrap", "10"]),
    Command("import-llamacpp-kld", False,
            lambda w, o: ["import", "llamacpp-kld", str(w["kld"]), "--out", o], "kld", "npz_run",
            lambda w, o: ["import", "llamacpp-kld", str(w["bad_kld"]), "--out", o, "--overwrite"]),
    Command("import-npz", False,
            lambda w, o: ["import", "npz", str(w["npz"]), "--out", o], "npz", "npz_run",
            lambda w, o: ["import", "npz", str(w["nan_npz"]), "--out", o, "--overwrite"]),
    Command("merge", False,
            lambda w, o: ["merge", str(w["cand"]), "--out", o], "cand", "ref",
            lambda w, o: ["merge", str(w["cand"]), str(w["ref"]), "--out", o, "--overwrite"]),
    Command("report", True,
            lambda w, o: ["report", str(w["rep"]), "--out", o], "rep", "page",
            lambda w, o: ["report", str(w["rep"]), str(w["ref"]), "--out", o]),
    Command("topk-error", True,
            lambda w, o: ["topk-error", str(w["ref"]), str(w["cand"]), "--k", "4", "--json", o], "ref", "topk_json",
            lambda w, o: ["topk-error", str(w["ref"]), str(w["npz_run"]), "--k", "4", "--json", o]),
    Command("run", False,
            lambda w, o: RUN_ARGS(w["wl"]) + ["--out", o], "wl", "run_out",
            # fails after reusing the reference: a candidate that cannot be opened
            lambda w, o: [a if a != "builtin:tiny,dtype=float32" else "gguf:/nonexistent/x.gguf" for a in RUN_ARGS(w["wl"])]
            + ["--out", o]),
    Command("layers", False,
            lambda w, o: LAYERS_ARGS(w["ref"]) + ["--out", o], "ref", "lay",
            # fails after reading the teacher: a candidate that cannot be opened
            lambda w, o: [a if a != "builtin:tiny,dtype=float32" else "gguf:/nonexistent/x.gguf" for a in LAYERS_ARGS(w["ref"])]
            + ["--out", o]),
    # --out is checked before any server is contacted: the refusals need no server (DEAD_URL);
    # the successful writes (a concurrent writer's second half) use one real llama-server
    Command("speculate", False,
            lambda w, o: SPEC_ARGS(DEAD_URL, w["wl"]) + ["--out", o], "wl", "spec_out",
            lambda w, o: SPEC_ARGS(DEAD_URL, w["wl"]) + ["--out", o]),
]
IDS = [c.name for c in COMMANDS]


def copy_of(w: dict, key: str, dest: Path) -> Path:
    src = w[key]() if callable(w[key]) else w[key]
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest)
    return dest


# ----------------------------------------------------------------------------- class tests
def foreign_tree(root: Path) -> Path:
    d = root / "project"
    (d / "src").mkdir(parents=True)
    (d / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (d / "README").write_text("mine\n")
    return d


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_foreign_directory_is_untouched(cmd, w, tmp_path, capsys):
    d = foreign_tree(tmp_path)
    before, around = digest(d), siblings(d)
    assert main(cmd.argv(w, str(d))) == 2
    err = one_line_error(capsys)
    assert str(d) in err and ("is not a" in err or "is a directory" in err), err
    assert digest(d) == before and siblings(d) == around


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_regular_file_is_untouched(cmd, w, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("<!DOCTYPE html> my own notes, not a page logitdiff wrote\n")
    before, around = digest(f), siblings(f)
    assert main(cmd.argv(w, str(f))) == 2
    err = one_line_error(capsys)
    assert str(f) in err, err
    assert digest(f) == before and siblings(f) == around


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_own_input_is_untouched(cmd, w, capsys):
    inp = w[cmd.own_input]
    before, around = digest(inp), siblings(inp)
    assert main(cmd.argv(w, str(inp))) == 2
    err = one_line_error(capsys)
    assert "input" in err or "is a directory" in err or "is not a" in err, err
    assert digest(inp) == before and siblings(inp) == around


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_inside_its_input_is_refused(cmd, w, capsys):
    inp = w[cmd.own_input]
    target = inp / "sub"
    before, around = digest(inp), siblings(inp)
    assert main(cmd.argv(w, str(target))) == 2
    err = one_line_error(capsys)
    assert ("inside the input" if inp.is_dir() else "regular file") in err, err
    assert digest(inp) == before and siblings(inp) == around


@pytest.mark.parametrize("where", ["below-a-file", "proc", "dot", "contains-input"])
@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_unwritable_or_odd_out_paths(cmd, where, w, tmp_path, capsys, monkeypatch):
    if where == "below-a-file":
        f = tmp_path / "file"
        f.write_text("x")
        out, watch = f / "sub" / "out", f
        needle = "regular file"
    elif where == "proc":
        out, watch = Path("/proc/logitdiff-test-x"), None
        needle = "/proc/logitdiff-test-x"
    elif where == "dot":
        d = foreign_tree(tmp_path)
        monkeypatch.chdir(d)
        out, watch = Path("."), d
        needle = "'.'"
    else:
        out, watch = w["root"], w["root"]
        needle = "contains the input"
    before = digest(watch) if watch else None
    assert main(cmd.argv(w, str(out))) == 2
    err = one_line_error(capsys)
    assert needle in err, err
    if watch:
        assert digest(watch) == before
    else:
        assert not out.exists()


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_failing_replace_leaves_the_old_output(cmd, w, tmp_path, capsys):
    out = copy_of(w, cmd.existing, tmp_path / ("out.file" if cmd.is_file else "out"))
    before, around = digest(out), siblings(out)
    assert main(cmd.failing(w, str(out))) == 2
    one_line_error(capsys)
    assert digest(out) == before and siblings(out) == around


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_concurrent_writer_is_refused_and_a_dead_one_does_not_block(cmd, w, tmp_path, capsys):
    out = copy_of(w, cmd.existing, tmp_path / ("out.file" if cmd.is_file else "out"))
    argv = cmd.argv(w, str(out)) + (["--overwrite"] if cmd.name in ("capture-reference", "capture-candidate", "capture-hidden", "merge",
                                                                    "import-llamacpp-kld", "import-npz") else [])
    if cmd.name == "speculate":  # the second half writes: a real server this time
        argv = [w["spec_url"]() if a == DEAD_URL else a for a in argv]
    before = digest(out)
    holder = hold_lock(out)
    try:
        assert main(argv) == 2
        err = one_line_error(capsys)
        assert f"pid {holder.pid}" in err, err
        assert digest(out) == before
    finally:
        holder.kill()
        holder.wait()
    # The killed holder left its lock file (and we plant temporaries as a SIGKILLed writer
    # would, named with its pid): neither blocks the next writer, and both are gone after it.
    # A user's files of similar names beside it are never touched.
    stale = [out.parent / f".{out.name}.tmp-{holder.pid}-0123abcd", out.parent / f".{out.name}.old-{holder.pid}-fedc9876"]
    stale[0].mkdir()
    (stale[0] / "part").write_text("x")
    stale[1].write_text("x")
    users = plant_user_files(out)
    assert main(argv) == 0
    capsys.readouterr()
    assert not any(os.path.lexists(p) for p in stale)
    assert {p.name: digest(p) for p in users} == {p.name: h for p, h in users.items()}
    assert sorted(os.listdir(out.parent)) == sorted([out.name] + [p.name for p in users])


# Where each command is held mid-work by the test below: a function of its work phase
# (after its --out checks, before its write), as module and attribute.
WORK = {
    "capture-reference": ("logitdiff.capture", "_reference_rows"),
    "capture-candidate": ("logitdiff.capture", "_candidate_rows"),
    "capture-hidden": ("logitdiff.capture", "_candidate_rows"),
    "compare": ("logitdiff.compare", "compare_runs"),
    "import-llamacpp-kld": ("logitdiff.store.importers", "read_kld_header"),
    "import-npz": ("logitdiff.store.importers", "import_npz"),
    "merge": ("logitdiff.capture.shards", "merge_runs"),
    "report": ("logitdiff.report.html", "write_html"),
    "topk-error": ("logitdiff.compare.topk_error", "topk_error"),
    "run": ("logitdiff.pipeline", "_run_locked"),
    "layers": ("logitdiff.layers", "layer_attribution"),
    "speculate": ("logitdiff.speculation", "compare_generation"),
}
OVERWRITES = ("capture-reference", "capture-candidate", "capture-hidden", "merge", "import-llamacpp-kld", "import-npz")

STOP_IN_WORK = (
    "import importlib, os, signal, sys\n"
    "m = importlib.import_module(sys.argv[1])\n"
    "orig = getattr(m, sys.argv[2])\n"
    "def held(*a, **k):\n"
    "    setattr(m, sys.argv[2], orig)\n"
    "    os.kill(os.getpid(), signal.SIGSTOP)  # a real process stopped mid-work until the test sends SIGCONT\n"
    "    return orig(*a, **k)\n"
    "setattr(m, sys.argv[2], held)\n"
    "from logitdiff.cli import main\n"
    "sys.exit(main(sys.argv[3:]))\n"
)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def test_writer_class_is_complete():
    assert sorted(WORK) == sorted(IDS)


def first_stopped_second_refused(work: tuple[str, str], first_argv: list[str], second_argv: list[str], out: Path, log: Path,
                                 capsys) -> None:
    """A real first writer stopped in ``work``; the second (this process) is refused naming
    its pid and leaves ``out`` as it was; the first, continued, exits 0."""
    env = {**os.environ, "PYTHONPATH": SRC}
    with open(log, "w") as f:
        first = subprocess.Popen([sys.executable, "-c", STOP_IN_WORK, *work, *first_argv], env=env, stdout=f, stderr=f)
    try:
        deadline = time.time() + 300
        while not _stopped(first.pid) and first.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert _stopped(first.pid), f"the first writer never reached its work: {log.read_text()[-2000:]}"
        before = digest(out)
        assert main(second_argv) == 2
        err = one_line_error(capsys)
        assert f"pid {first.pid}" in err, err
        assert digest(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, log.read_text()[-2000:]


def test_flips_mid_work_refuses_the_next_and_finishes_complete(w, tmp_path, capsys):
    """flips writes into the REPORT it reads: a second flips of that REPORT while the first
    runs its branches is refused; the first finishes (flips.parquet, report.json's flips)."""
    rep = copy_of(w, "rep", tmp_path / "rep")
    argv = ["flips", str(rep), "--similarity", "edit"]
    first_stopped_second_refused(("logitdiff.flips.consequences", "analyse_report_dir"), argv, argv, rep, tmp_path / "first.log", capsys)
    assert (rep / "flips.parquet").is_file() and "flips" in json.loads((rep / "report.json").read_text())
    assert sorted(os.listdir(tmp_path)) == ["first.log", "rep"]


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_a_writer_mid_work_refuses_the_next_and_finishes_complete(cmd, w, tmp_path, capsys):
    """A real first writer stopped in its work phase (before its write): a second writer of
    the same --out is refused at once naming the first's pid, writes nothing, and the first,
    resumed, finishes a complete output of its kind with nothing left beside it. Before, the
    commands whose work comes before their write (compare, report, topk-error, layers,
    speculate; import and merge while checking their input) took the lock only to write:
    both did the work and the last to finish replaced the other's output whole."""
    from logitdiff.store.files import Kind, is_kind

    (tmp_path / "o").mkdir()
    out = tmp_path / "o" / ("out.file" if cmd.is_file else "out")
    first_argv = cmd.argv(w, str(out))
    if cmd.name == "speculate":
        first_argv = [w["spec_url"]() if a == DEAD_URL else a for a in first_argv]
    second_argv = first_argv + (["--overwrite"] if cmd.name in OVERWRITES else [])
    first_stopped_second_refused(WORK[cmd.name], first_argv, second_argv, out, tmp_path / "first.log", capsys)
    kind = {"report": Kind.HTML, "topk-error": Kind.TOPK_JSON, "compare": Kind.REPORT, "run": Kind.RUN_OUT,
            "layers": Kind.LAYERS, "speculate": Kind.SPECULATION}.get(cmd.name, Kind.RUN)
    assert is_kind(out, kind), sorted(os.listdir(out)) if out.is_dir() else out
    if kind is Kind.RUN:
        assert RunReader(out).manifest["status"] == "complete"
    if kind is Kind.SPECULATION:
        assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", "generations.jsonl"}
    assert os.listdir(out.parent) == [out.name]  # no lock file, no temporary


def plant_user_files(out: Path) -> dict[Path, str]:
    """A user's files beside --out whose names resemble the writer's temporaries: the
    hostile examples and the class around them (no pid, a live pid, a malformed token,
    another name's temporaries); path -> digest."""
    n = out.name
    live = os.getppid()  # alive for the whole test
    dirs = [f".{n}.old-backup", f".{n}.tmp-{live}-0123abcd", f".{n}.tmp-", f".{n}.old"]
    files = [f".{n}.tmp-notes", f".{n}.tmp-999999", f".{n}.tmp-999999-xyz", f".{n}.tmp-999999-0123abcd.bak",
             f".{n}.old-999999-0123ABCD", f".{n}x.tmp-999999-0123abcd", f"{n}.tmp-999999-0123abcd", f".{n}.tmp-0-0123abcd",
             f".{n}.tmp999999"]
    made = {}
    for d in dirs:
        (out.parent / d).mkdir()
        (out.parent / d / "keep.txt").write_text("user data")
    for f in files:
        (out.parent / f).write_text("user data")
    for name in dirs + files:
        made[out.parent / name] = digest(out.parent / name)
    return made


def test_flips_takes_the_report_lock(w, tmp_path, capsys):
    """flips rewrites files of its REPORT: a second writer of that REPORT is refused."""
    rep = copy_of(w, "rep", tmp_path / "rep")
    before = digest(rep)
    holder = hold_lock(rep)
    try:
        check_error(capsys, ["flips", rep, "--similarity", "edit"], f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert digest(rep) == before



@pytest.mark.parametrize("argv", [
    ["--candidate", "gguf:/nonexistent/x.gguf"],  # fails opening the candidate, after reading the REPORT
    ["--reference", "gguf:/nonexistent/x.gguf", "--both"],  # fails opening the reference
])
def test_flips_that_fails_leaves_its_report_as_it_was(w, tmp_path, capsys, argv):
    """flips writes into its REPORT (no --out): a failing flips leaves every file of it unchanged."""
    rep = copy_of(w, "rep", tmp_path / "rep")
    before = digest(rep)
    check_error(capsys, ["flips", rep, "--similarity", "edit", *argv], "x.gguf")
    assert digest(rep) == before

def test_real_concurrent_capture_is_refused(w, tmp_path):
    """Two real logitdiff processes capturing into one RUN: the second fails at once,
    naming the first's pid; the first completes a run holding only its own model."""
    out = tmp_path / "run"
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": f"def f{k}(x):", "max_tokens": 24}) + "\n" for k in range(24)))
    env = {**os.environ, "PYTHONPATH": SRC}
    first = subprocess.Popen([sys.executable, "-m", "logitdiff.cli", "capture", "builtin:tiny", "--workload", str(wl),
                              "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
    lock = out.parent / f".{out.name}.lock"
    deadline = time.time() + 300
    # holding the lock with its pid written, and its manifest on disk: mid-capture
    while not (lock.exists() and lock.read_text().strip() and (out / "manifest.json").exists()) \
            and time.time() < deadline and first.poll() is None:
        time.sleep(0.005)
    first.send_signal(signal.SIGSTOP)  # keep it mid-write, deterministically
    try:
        assert first.poll() is None, "the first capture finished before the test could hold it"
        second = run_cli(["capture", "builtin:tiny,dtype=float32", "--workload", str(wl), "--out", str(out), "--overwrite"])
        assert second.returncode == 2
        errs = [line for line in second.stderr.splitlines() if "error:" in line]
        assert len(errs) == 1 and f"pid {first.pid}" in errs[0], second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, first.stderr.read()
    run = RunReader(out)
    assert run.manifest["source"]["spec"] == "builtin:tiny" and run.manifest["source"]["identity"]["dtype"] == "bfloat16"
    assert [it.id for it in run.items()] == [f"i{k}" for k in range(24)]
    assert sorted(os.listdir(tmp_path)) == ["run", "wl.jsonl"]


# ----------------------------------------------------------------------------- signals
SIGNAL_IN_WRITE = (
    "import os, signal, sys\n"
    "import logitdiff.report as R\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when started in a background job\n"
    "orig = R.write_parquet\n"
    "def write_parquet(path, columns):\n"
    "    orig(path, columns)\n"
    "    os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # a real signal, half-way through the new REPORT\n"
    "R.write_parquet = write_parquet\n"
    "from logitdiff.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_during_compare_leaves_old_report_and_no_temp(w, tmp_path, sig, code):
    out = copy_of(w, "rep", tmp_path / "rep")
    before, around = digest(out), siblings(out)
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_WRITE, sig, "compare", str(w["ref"]), str(w["cand"]), "--out", str(out),
                           "--bootstrap", "10"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert digest(out) == before and siblings(out) == around


def test_sigterm_during_capture_overwrite_keeps_old_run(w, tmp_path):
    out = copy_of(w, "ref", tmp_path / "ref")
    before = digest(out)
    code = (
        "import os, signal, sys\n"
        "from logitdiff.store import RunWriter\n"
        "orig = RunWriter.add_rows\n"
        "def add(self, *a, **k):\n"
        "    orig(self, *a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "RunWriter.add_rows = add\n"
        "from logitdiff.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", code, "capture", "builtin:tiny,dtype=float32", "--workload", str(w["wl"]),
                           "--out", str(out), "--overwrite"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert digest(out) == before and sorted(os.listdir(tmp_path)) == ["ref"]


# ----------------------------------------------------------------------------- resume
def partial_copy(w: dict, dest: Path, key: str = "ref") -> Path:
    """A run as a kill after its first item leaves it: one chunk listed, partial."""
    shutil.copytree(w[key], dest)
    m = json.loads((dest / "manifest.json").read_text())
    assert m["n_items"] == 3
    first = m["chunks"][0]
    lines = (dest / "chunks" / first["items"]).read_text().splitlines(keepends=True)
    keep = json.loads(lines[0])
    rows = len(keep["positions"])
    (dest / "chunks" / first["items"]).write_text(lines[0])
    data = np.load(dest / "chunks" / first["data"])
    np.save(dest / "chunks" / first["data"], data[:rows])
    m.update(status="partial", chunks=[{**first, "rows": rows, "n_items": 1}], n_items=1, n_positions=rows)
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


@pytest.mark.parametrize("change, field", [
    (["--spec", "builtin:tiny,dtype=float32"], "source.spec"),
    (["--max-tokens", "3"], "settings.max_tokens"),
    (["--positions", "first"], "settings.positions"),
    (["--store", "topk:4"], "settings.store"),
    (["--workload-edit"], "settings.workload_sha256"),
])
def test_resume_refuses_to_mix(w, tmp_path, capsys, change, field):
    run = partial_copy(w, tmp_path / "run")
    wl = tmp_path / "wl.jsonl"
    shutil.copy(w["wl"], wl)
    spec = "builtin:tiny"
    extra = []
    if change[0] == "--spec":
        spec = change[1]
    elif change[0] == "--workload-edit":
        wl.write_text(wl.read_text().replace("France", "Spain"))
    else:
        extra = change
    # the run recorded the original workload path: resume must name the same file
    m = json.loads((run / "manifest.json").read_text())
    m["settings"]["workload"] = str(wl)
    (run / "manifest.json").write_text(json.dumps(m))
    before = digest(run)
    assert main(["capture", spec, "--workload", str(wl), "--out", str(run), "--resume", *extra]) == 2
    err = one_line_error(capsys)
    assert f"field {field!r}" in err and "cannot resume" in err, err
    assert digest(run) == before


@pytest.mark.parametrize("teacher_change, field", [("moved", "settings.teacher"), ("recaptured", "settings.teacher_manifest_sha256")])
def test_candidate_resume_refuses_another_teacher(w, tmp_path, capsys, teacher_change, field):
    teacher = shutil.copytree(w["ref"], tmp_path / "ref")
    run = partial_copy(w, tmp_path / "cand", key="cand")
    m = json.loads((run / "manifest.json").read_text())
    m["settings"]["teacher"] = str(teacher)
    m["settings"]["teacher_manifest_sha256"] = hashlib.sha256((teacher / "manifest.json").read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m))
    if teacher_change == "moved":
        teacher = teacher.rename(tmp_path / "ref2")
    else:  # the same path, captured again (its manifest, e.g. its creation time, differs)
        tm = json.loads((teacher / "manifest.json").read_text())
        tm["created"] = "2000-01-01T00:00:00Z"
        (teacher / "manifest.json").write_text(json.dumps(tm))
    before = digest(run)
    check_error(capsys, ["capture", "builtin:tiny,dtype=float32", "--reference", teacher, "--out", run, "--resume"],
                f"field {field!r}", "cannot resume")
    assert digest(run) == before
    # with the teacher it was made on, the resume completes it
    if teacher_change == "moved":
        teacher.rename(tmp_path / "ref")
        assert main(["capture", "builtin:tiny,dtype=float32", "--reference", str(tmp_path / "ref"), "--out", str(run), "--resume"]) == 0
        assert [it.id for it in RunReader(run).items()] == [it.id for it in RunReader(w["cand"]).items()]


def test_resume_with_the_same_settings_completes_like_a_fresh_capture(w, tmp_path, capsys):
    run = partial_copy(w, tmp_path / "run")
    assert main(["capture", "builtin:tiny", "--workload", str(w["wl"]), "--out", str(run), "--resume"]) == 0
    done, fresh = RunReader(run), RunReader(w["ref"])
    assert [it.id for it in done.items()] == [it.id for it in fresh.items()]
    for a, b in zip(done.items(), fresh.items()):
        assert a.teacher_ids == b.teacher_ids
        np.testing.assert_array_equal(done.logits(a), fresh.logits(b))


def test_resume_refuses_other_weights_at_the_same_path(w, tmp_path, capsys):
    """Same spec, same path, other weights: the weight hash in the model identity differs."""
    import torch
    from safetensors.torch import load_file, save_file

    from logitdiff.builtin import TINY_DIR

    model = tmp_path / "model"
    shutil.copytree(TINY_DIR, model)
    spec = f"hf:{model},dtype=float32"
    wl = w["wl"]
    out = tmp_path / "run"
    assert main(["capture", spec, "--workload", str(wl), "--out", str(out)]) == 0
    tensors = load_file(model / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = (tensors[name].to(torch.float32) * 1.01).to(tensors[name].dtype)
    save_file(tensors, model / "model.safetensors")
    before = digest(out)
    assert main(["capture", spec, "--workload", str(wl), "--out", str(out), "--resume"]) == 2
    err = one_line_error(capsys)
    assert "field 'source.identity.weight_files'" in err, err
    assert digest(out) == before


# ----------------------------------------------------------------------------- run: one report per candidate
def test_report_names_are_unique_and_stable():
    from logitdiff.store.files import report_names

    assert report_names(["gguf:a/model.gguf", "gguf:b/model.gguf", "builtin:tiny-Q8_0"]) == ["a-model", "b-model", "tiny-Q8_0"]
    # the same parent name too: a hash of the spec, stable across calls and orders
    specs = ["gguf:x/a/m.gguf", "gguf:y/a/m.gguf"]
    names = report_names(specs)
    assert len(set(names)) == 2 and all(n.startswith("a-m-") for n in names)
    assert report_names(specs[::-1]) == names[::-1]
    # names differing only in case would collide on a case-insensitive file system
    names = report_names(["hf:A", "hf:a"])
    assert len({n.lower() for n in names}) == 2
    with pytest.raises(Exception, match="given twice"):
        report_names(["builtin:tiny-Q8_0", "builtin:tiny-Q8_0"])


def test_run_keeps_one_report_per_candidate_with_the_same_file_name(w, tmp_path, capsys):
    from logitdiff.builtin import TINY_DIR

    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
        (tmp_path / parent / "model").symlink_to(TINY_DIR, target_is_directory=True)
    specs = [f"hf:{tmp_path / 'a' / 'model'},dtype=float32", f"hf:{tmp_path / 'b' / 'model'},dtype=bfloat16"]
    out = tmp_path / "out"
    assert main(["run", "--reference", "builtin:tiny", "--candidate", specs[0], "--candidate", specs[1], "--workload", str(w["wl"]),
                 "--no-noise-floor", "--no-flips", "--bootstrap", "10", "--floor", "none", "--out", str(out)]) == 0
    reports = sorted(p.name for p in (out / "reports").iterdir())
    assert reports == ["a-model", "b-model"]
    got = {json.loads((out / "reports" / n / "report.json").read_text())["candidate"]["spec"] for n in reports}
    assert got == set(specs)
    summary = json.loads((out / "summary.json").read_text())
    assert [c["name"] for c in summary["candidates"]] == ["a-model", "b-model"]
    # F32 and BF16 of the same weights: two different reports, not one written twice
    kl = [c["kl_mean"] for c in summary["candidates"]]
    assert kl[0] != kl[1]


# ----------------------------------------------------------------------------- errors, not tracebacks
def check_error(capsys, argv, *needles):
    assert main([str(a) for a in argv]) == 2
    err = one_line_error(capsys)
    for n in needles:
        assert n in err, err
    return err


def test_workload_with_invalid_utf8(tmp_path, capsys):
    wl = tmp_path / "wl.jsonl"
    wl.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    out = tmp_path / "run"
    check_error(capsys, ["capture", "builtin:tiny", "--workload", wl, "--out", out], f"{wl}:2", "UTF-8")
    assert not out.exists()


def test_truncated_items_line(w, tmp_path, capsys):
    run = shutil.copytree(w["cand"], tmp_path / "cand")
    m = json.loads((run / "manifest.json").read_text())
    items = run / "chunks" / m["chunks"][0]["items"]
    items.write_bytes(items.read_bytes()[:-40])
    out = tmp_path / "rep"
    check_error(capsys, ["compare", w["ref"], run, "--out", out], str(items), "not valid JSON")
    assert not out.exists()


def npz_case(tmp_path, **over):
    rng = np.random.default_rng(1)
    arrays = dict(logits=rng.normal(size=(4, 16)).astype(np.float32), token_ids=np.array([1, 2, 3, 4]),
                  item_ids=np.array(["a", "a", "b", "b"]), positions=np.array([0, 1, 0, 1]))
    arrays.update(over)
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    return path


def _with(row, col, value):
    x = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32)
    x[row, col] = value
    return x


@pytest.mark.parametrize("over, needles", [
    (dict(item_ids=np.array(["a", 1, "b", None], dtype=object)), ["'item_ids'", "object array"]),
    (dict(positions=np.array([0, 1, 0, 10_000_000_000])), ["'positions'", "10000000000", "item 'b'"]),
    (dict(logits=np.ones((4, 16), dtype=np.complex64)), ["'logits'", "complex64"]),
    (dict(logits=np.ones((4, 16), dtype=bool)), ["'logits'", "bool"]),
    (dict(positions=np.array([0.0, 1.5, 0.0, 1.0])), ["'positions'", "float64", "integers"]),
    (dict(token_ids=np.array([1, 2, 3, 99])), ["'token_ids'", "99"]),
    (dict(logits=_with(1, 3, np.nan)), ["item 'a' position 1", "NaN"]),
    (dict(logits=_with(2, 3, np.inf)), ["item 'b' position 0", "+inf"]),
    (dict(logits=_with(3, 3, -np.inf)), ["item 'b' position 1", "-inf", "masked tokens are not supported", "max - 1e4"]),
], ids=["object-ids", "position-1e10", "complex", "bool", "float-positions", "token-id", "nan", "+inf", "-inf"])
def test_npz_errors(tmp_path, capsys, over, needles):
    path = npz_case(tmp_path, **over)
    out = tmp_path / "run"
    check_error(capsys, ["import", "npz", path, "--out", out], str(path), *needles)
    assert sorted(os.listdir(tmp_path)) == ["in.npz"]


def test_npz_truncated_zip(tmp_path, capsys):
    path = npz_case(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 30):
        path.write_bytes(data[:cut])
        check_error(capsys, ["import", "npz", path, "--out", tmp_path / "run"], str(path))
        assert sorted(os.listdir(tmp_path)) == ["in.npz"]


@pytest.mark.parametrize("value, needle", [(np.nan, "NaN"), (-np.inf, "masked tokens are not supported"), (np.inf, "+inf")])
def test_kld_nonfinite_rows(tmp_path, capsys, value, needle):
    rng = np.random.default_rng(2)
    path = tmp_path / "in.kld"
    write_llamacpp_kld(path, rng.normal(size=(2, 8, 32)).astype(np.float32), rng.integers(0, 32, size=(2, 8)))
    data = bytearray(path.read_bytes())
    nv = 2 * ((32 + 1) // 2) + 4
    row = 20 + 4 * 8 * 2 + 2 * nv * 3  # chunk 1, scored row 0 (3 scored rows a chunk: n_ctx - 1 - n_ctx//2)
    field = 4 if value == -np.inf else 0  # min_log_prob, or the scale
    data[row + field : row + field + 4] = np.array([value], dtype="<f4").tobytes()
    path.write_bytes(bytes(data))
    check_error(capsys, ["import", "llamacpp-kld", path, "--out", tmp_path / "run"], str(path), "chunk 1 scored row 0", needle)
    assert sorted(os.listdir(tmp_path)) == ["in.kld"]


@pytest.mark.parametrize("argv, needles", [
    (["--store", "topk:abc"], ["--store 'topk:abc'"]),
    (["--store", "topk:100000"], ["K=100000", "vocabulary size"]),
    (["--max-tokens", "0"], ["--max-tokens 0"]),
    (["--positions", "sample:2"], ["--positions 'sample:2'", "(0, 1]"]),
    (["--positions", "sample:-0.5"], ["--positions 'sample:-0.5'"]),
    (["--positions", "sample:nan"], ["--positions 'sample:nan'"]),
    (["--positions", "bogus"], ["--positions 'bogus'"]),
    (["--resume", "--overwrite"], ["exclude each other"]),
])
def test_capture_argument_errors(w, tmp_path, capsys, argv, needles):
    out = tmp_path / "run"
    check_error(capsys, ["capture", "builtin:tiny", "--workload", w["wl"], "--out", out, *argv], *needles)
    assert not out.exists()


@pytest.mark.parametrize("argv, needles", [
    (["--top-logprobs", "0"], ["--top-k 0"]),  # the old name of --top-k
    (["--top-k", "0"], ["--top-k 0"]),
    (["--top-logprobs", "100000000"], ["--top-k 100000000", "vocabulary size"]),
    (["--bootstrap", "-1"], ["--bootstrap -1"]),
    (["--device", "nonsense"], ["--device 'nonsense'"]),
    (["--device", "cuda"], ["--device 'cuda'"]),
])
def test_compare_argument_errors(w, tmp_path, capsys, argv, needles):
    import torch

    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is valid")
    out = tmp_path / "rep"
    err = check_error(capsys, ["compare", w["ref"], w["cand"], "--out", out, *argv], *needles)
    if argv[1] == "cuda":
        assert "CUDA is not available" in err
    assert not out.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--bootstrap", "-1"], "--bootstrap -1"), (["--max-tokens", "0"], "--max-tokens 0"),
    (["--positions", "sample:2"], "--positions 'sample:2'"),
])
def test_run_argument_errors(w, tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    check_error(capsys, ["run", "--workload", w["wl"], "--out", out, *argv], needle)
    assert not out.exists()


def test_run_out_a_regular_file_and_report_out_an_existing_directory(w, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    check_error(capsys, RUN_ARGS(w["wl"]) + ["--out", f], str(f), "not a directory")
    assert f.read_text() == "x"
    d = tmp_path / "d"
    d.mkdir()
    check_error(capsys, ["report", w["rep"], "--out", d], str(d), "is a directory")
    assert list(d.iterdir()) == []


def test_silent_server_says_no_response(tmp_path, capsys):
    """A real server socket that accepts connections and never answers."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        check_error(capsys, ["capture", f"openai:http://127.0.0.1:{port},timeout=1,retries=1", "--out", tmp_path / "run"],
                    "no response within 1 s")
    finally:
        srv.close()
    assert not (tmp_path / "run").exists()


def test_run_does_not_resume_a_reference_made_with_another_model(w, tmp_path, capsys):
    """A partial reference in OUT whose model identity differs is captured afresh, not continued."""
    out = copy_of(w, "run_out", tmp_path / "out")
    mpath = out / "runs" / "reference" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["status"] = "partial"
    m["source"]["identity"]["weight_files"] = {"model.safetensors": "0" * 64}
    mpath.write_text(json.dumps(m))
    capsys.readouterr()
    assert main(RUN_ARGS(w["wl"]) + ["--out", str(out)]) == 0
    assert "capturing afresh" in capsys.readouterr().err
    fresh = RunReader(out / "runs" / "reference")
    assert fresh.manifest["source"]["identity"]["weight_files"] == RunReader(w["ref"]).manifest["source"]["identity"]["weight_files"]
    assert [it.teacher_ids for it in fresh.items()] == [it.teacher_ids for it in RunReader(w["ref"]).items()]


def test_a_failed_replacement_names_the_output_not_its_temporary(tmp_path):
    """An error raised while writing the temporary that replaces an existing output names
    the output the user asked for (the temporary is gone by then), and leaves it as it was."""
    from logitdiff.errors import LogitdiffError
    from logitdiff.contracts import TOPK_ERROR_SCHEMA
    from logitdiff.store.files import Kind, writing

    out = tmp_path / "topk.json"
    old = json.dumps({"schema": TOPK_ERROR_SCHEMA})
    out.write_text(old)
    seen = []
    with pytest.raises(LogitdiffError) as err:
        with writing(out, Kind.TOPK_JSON, overwrite=True) as tmp:
            seen.append(tmp)
            raise LogitdiffError(f"{tmp}: cannot write (File too large)")
    assert seen[0] != out and str(seen[0]) not in str(err.value)
    assert str(err.value) == f"{out}: cannot write (File too large)"
    assert out.read_text() == old and not seen[0].exists()
