"""A RUN carries what it needs: the tools module its items execute is copied into the RUN
(hash-checked), so a RUN moved to another directory or machine still works."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

import logitdiff
from logitdiff.builtin import WORKLOAD
from logitdiff.errors import LogitdiffError
from logitdiff.store import TOOLS_DIR, RunReader

IMPL = "def get_weather(city):\n    return {'city': city, 'temp_c': 21}\n"


@pytest.fixture(scope="module")
def moved_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("portable")
    src_dir = tmp / "here"
    src_dir.mkdir()
    (src_dir / "impl.py").write_text(IMPL)
    item = json.loads(WORKLOAD.read_text(encoding="utf-8").splitlines()[0])
    item["tools_module"] = "impl.py"
    wl = src_dir / "w.jsonl"
    wl.write_text(json.dumps(item) + "\n")
    logitdiff.capture_run("builtin:tiny", src_dir / "ref", workload=wl, max_tokens=4)
    logitdiff.capture_run("builtin:tiny,dtype=float32", src_dir / "cand", reference=src_dir / "ref")
    there = tmp / "there"
    shutil.move(str(src_dir), there)  # the workload and the module are gone from where they were
    (there / "impl.py").unlink()
    return there, item["id"]


@pytest.mark.parametrize("run", ["ref", "cand"])
def test_a_moved_run_finds_its_tools_module_inside_itself(moved_runs, run):
    there, item_id = moved_runs
    [it] = RunReader(there / run).items()
    assert it.id == item_id
    wl_item = it.extra["item"]
    path = wl_item["tools_module"]
    digest = hashlib.sha256(IMPL.encode()).hexdigest()
    assert path == str(there / run / TOOLS_DIR / f"{digest[:16]}-impl.py")
    assert open(path).read() == IMPL and wl_item["tools_module_sha256"] == digest
    # on disk the item names it relative to the RUN: nothing absolute is embedded
    stored = (there / run / "chunks").glob("*.items.jsonl")
    assert all(str(there) not in f.read_text() and "/here/" not in f.read_text() for f in stored)


def test_a_changed_tools_module_copy_is_refused(moved_runs, tmp_path):
    there, _ = moved_runs
    copy = tmp_path / "ref"
    shutil.copytree(there / "ref", copy)
    [mod] = (copy / TOOLS_DIR).iterdir()
    mod.write_text(IMPL + "# changed\n")
    with pytest.raises(LogitdiffError, match=r"field 'tools_module' .*sha256 differs"):
        RunReader(copy).items()
    shutil.rmtree(copy / TOOLS_DIR)
    with pytest.raises(LogitdiffError, match=r"field 'tools_module' .*not in the RUN"):
        RunReader(copy).items()


def test_a_tools_module_without_its_recorded_hash_is_refused(moved_runs, tmp_path):
    there, _ = moved_runs
    copy = tmp_path / "ref"
    shutil.copytree(there / "ref", copy)
    [items] = (copy / "chunks").glob("*.items.jsonl")
    items.write_text(items.read_text().replace('"tools_module_sha256"', '"sha256_elsewhere"'))
    with pytest.raises(LogitdiffError, match=r"field 'tools_module' .*no 'tools_module_sha256' recorded"):
        RunReader(copy).items()
