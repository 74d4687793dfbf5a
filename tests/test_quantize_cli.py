"""``logitdiff quantize``: llama.cpp's own quantizer on a user's model, fallbacks listed not
refused, and the output guard of every writing command (a foreign --out, its own input, a
second writer, a failing --overwrite)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("transformers")

from _models import make_random_llama  # noqa: E402

from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources.quantize import check_tensor_types  # noqa: E402
from logitdiff.sources.quantize_model import quantize_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    # hidden 256: every K-quant block fits; hidden 96: no row is a multiple of 256, so
    # llama.cpp writes the K-quant tensors in a 32-block fallback type
    even = make_random_llama(root / "even", hidden=256, intermediate=512, layers=2)
    odd = make_random_llama(root / "odd", hidden=96, intermediate=192, layers=2, heads=4, kv_heads=2)
    return root, even, odd


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "logitdiff.cli", *args], capture_output=True, text=True, timeout=600)


def test_from_an_hf_directory_then_requantized_from_its_gguf(models, tmp_path):
    root, even, _ = models
    files = quantize_model(str(even), ["BF16", "Q8_0", "Q4_K_M"], tmp_path / "q")
    assert [f.type for f in files] == ["BF16", "Q8_0", "Q4_K_M"]
    assert all(not f.fallbacks for f in files) and [f.dominant for f in files] == ["BF16", "Q8_0", "Q4_K"]
    manifest = json.loads((tmp_path / "q" / "quantize.json").read_text())
    assert manifest["schema"] == "logitdiff.quantize/1" and manifest["source"]["kind"] == "hf"
    # a quantized GGUF is requantized (llama-quantize --allow-requantize) and says from what
    q8 = tmp_path / "q" / files[1].file
    again = quantize_model(f"gguf:{q8}", ["Q2_K"], tmp_path / "q2")
    assert again[0].requantized_from == "Q8_0" and again[0].dominant == "Q2_K"
    assert check_tensor_types(tmp_path / "q2" / again[0].file, "Q2_K")["dominant"] == "Q2_K"


def test_rows_off_the_block_size_are_written_in_a_fallback_type_and_listed(models, tmp_path):
    _, _, odd = models
    (f,) = quantize_model(str(odd), ["Q2_K"], tmp_path / "q")
    # every attention/FFN weight has 96- or 192-long rows: none fits a 256 block
    assert f.fallbacks and set(f.fallbacks.values()) <= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "F16", "BF16", "F32"}
    assert f.dominant != "Q2_K" and sum(f.counts.values()) == len(f.fallbacks) + f.counts.get("Q2_K", 0)
    listed = json.loads((tmp_path / "q" / "quantize.json").read_text())["files"][0]["fallbacks"]
    assert listed == f.fallbacks
    # the strict check (the bundled ladder's) still refuses such a file, naming a tensor
    with pytest.raises(LogitdiffError, match=r"fell back to|left as"):
        check_tensor_types(tmp_path / "q" / f.file, "Q2_K")


@pytest.mark.parametrize("types,match", [
    ("Q9_K", "unknown quant type 'Q9_K'"),
    ("", "name at least one type"),
])
def test_bad_types_are_one_line(models, tmp_path, types, match):
    _, even, _ = models
    p = _cli("quantize", str(even), "--types", types, "--out", str(tmp_path / "q"))
    assert p.returncode == 2 and match in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "q").exists()


def test_float_types_only_from_a_transformers_model(models, tmp_path):
    root, even, _ = models
    (f,) = quantize_model(str(even), ["Q8_0"], tmp_path / "q")
    with pytest.raises(LogitdiffError, match="from a GGUF only quantizations are made"):
        quantize_model(str(tmp_path / "q" / f.file), ["BF16"], tmp_path / "q2")
    assert not (tmp_path / "q2").exists()


def test_missing_model_and_imatrix_are_one_line(tmp_path, models):
    _, even, _ = models
    p = _cli("quantize", str(tmp_path / "nope.gguf"), "--types", "Q8_0", "--out", str(tmp_path / "q"))
    assert p.returncode == 2 and "nope.gguf: model not found" in p.stderr
    import os

    os.mkfifo(tmp_path / "fifo.gguf")  # a FIFO in place of the model: refused at once, never opened
    p = _cli("quantize", str(tmp_path / "fifo.gguf"), "--types", "Q8_0", "--out", str(tmp_path / "q"))
    assert p.returncode == 2 and "fifo.gguf: not a regular file" in p.stderr, p.stderr
    p = _cli("quantize", str(even), "--types", "Q8_0", "--imatrix", str(tmp_path / "m.dat"), "--out", str(tmp_path / "q"))
    assert p.returncode == 2 and "--imatrix" in p.stderr and "file not found" in p.stderr
    assert not (tmp_path / "q").exists()


# --- the output guard: the failure classes of every writing command

def test_a_foreign_out_is_never_replaced(models, tmp_path):
    _, even, _ = models
    for foreign in (tmp_path / "dir", tmp_path / "file.txt"):
        if foreign.suffix:
            foreign.write_text("mine")
        else:
            foreign.mkdir()
            (foreign / "keep.txt").write_text("mine")
        p = _cli("quantize", str(even), "--types", "Q8_0", "--out", str(foreign), "--overwrite")
        assert p.returncode == 2 and str(foreign) in p.stderr, p.stderr
        assert (foreign.read_text() if foreign.is_file() else (foreign / "keep.txt").read_text()) == "mine"


def test_its_own_input_is_never_the_output(models, tmp_path):
    _, even, _ = models
    p = _cli("quantize", str(even), "--types", "Q8_0", "--out", str(even), "--overwrite")
    assert p.returncode == 2 and (even / "config.json").is_file(), p.stderr


def test_overwrite_replaces_an_earlier_quant_only_with_the_flag_and_a_failure_keeps_it(models, tmp_path):
    _, even, _ = models
    out = tmp_path / "q"
    quantize_model(str(even), ["Q8_0"], out)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(LogitdiffError, match="--overwrite"):
        quantize_model(str(even), ["Q6_K"], out)
    # a failing overwrite (a type refused after the guard would let it through) leaves it whole
    with pytest.raises(LogitdiffError):
        quantize_model(str(even), ["Q8_0", "Q9_K"], out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    quantize_model(str(even), ["Q6_K"], out, overwrite=True)
    assert [f["type"] for f in json.loads((out / "quantize.json").read_text())["files"]] == ["Q6_K"]


def test_a_second_writer_is_refused_while_the_first_writes(models, tmp_path):
    _, even, _ = models
    out = tmp_path / "q"
    first = subprocess.Popen([sys.executable, "-m", "logitdiff.cli", "quantize", str(even), "--types",
                              "Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import time

        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first writer holds its lock
        p = _cli("quantize", str(even), "--types", "Q8_0", "--out", str(out))
        assert p.returncode == 2 and "pid" in p.stderr, p.stderr
    finally:
        first.communicate(timeout=600)
    assert first.returncode == 0 and len(json.loads((out / "quantize.json").read_text())["files"]) == 5
