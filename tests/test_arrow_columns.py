"""arrow_columns builds and reads the same arrays as pyarrow's pandas-backed paths, without pandas."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from logitdiff.report import arrow_columns as ac

RNG = np.random.default_rng(0)
TEXTS = ["", "a", "héllo", "日本語", " \n\t", "🙂x", "tok" * 50]


def _same_numpy(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tolist() == y.tolist()
        elif isinstance(x, float):
            assert x == y or (np.isnan(x) and np.isnan(y))
        else:
            assert x == y and type(x) is type(y)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float64, np.float32, np.bool_, np.uint8])
def test_from_numpy_1d_equals_pa_array(n, dtype):
    v = (RNG.standard_normal(n) * 100).astype(dtype)
    if dtype == np.float64 and n:
        v[0] = np.nan
    v_strided = np.repeat(v, 2)[::2]  # not contiguous
    for x in (v, v_strided):
        a, ref = ac.from_numpy(x), pa.array(x)
        assert a.type == ref.type and a.null_count == ref.null_count == 0  # NaN stays a value
        assert a.to_pylist() == ref.to_pylist() or np.array_equal(a.to_pylist(), ref.to_pylist(), equal_nan=True)


@pytest.mark.parametrize("shape", [(0, 5), (1, 5), (9, 5), (300, 3)])
@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_from_numpy_2d_equals_pa_array_of_rows(shape, dtype):
    v = (RNG.standard_normal(shape) * 100).astype(dtype)
    a = ac.from_numpy(v)
    ref = pa.array(list(v)) if shape[0] else pa.array([], type=pa.list_(pa.from_numpy_dtype(np.dtype(dtype))))
    assert a.type == ref.type and a.equals(ref)


def test_strings_and_string_lists_equal_pa_array():
    vals = [TEXTS[i % len(TEXTS)] for i in range(50)]
    assert ac.strings(vals).equals(pa.array(vals, type=pa.string()))
    assert ac.strings([]).equals(pa.array([], type=pa.string()))
    rows = [vals[i : i + (i % 4)] for i in range(30)]
    assert ac.string_lists(rows).equals(pa.array(rows, type=pa.list_(pa.string())))
    # a lone surrogate is not UTF-8: the same error as pyarrow's own path
    with pytest.raises(Exception) as e1:
        pa.array(["\ud800"], type=pa.string())
    with pytest.raises(type(e1.value)):
        ac.strings(["\ud800"])


def _arrays():
    yield pa.array(RNG.integers(-5, 5, 37))
    yield pa.array(RNG.standard_normal(37))
    yield pa.array(RNG.standard_normal(37).astype(np.float32))
    yield pa.array(RNG.random(37) < 0.5)
    yield pa.array([TEXTS[i % len(TEXTS)] for i in range(37)])
    yield pa.array([[TEXTS[j % 7] for j in range(i % 3)] for i in range(37)], type=pa.list_(pa.string()))
    yield pa.array([list(RNG.standard_normal(5)) for _ in range(37)])
    yield pa.array([list(RNG.integers(0, 9, 5)) for _ in range(37)])
    yield pa.array([1.0, None, 2.0])  # nulls: pyarrow's own path
    yield pa.array([], type=pa.string())


@pytest.mark.parametrize("i", range(10))
def test_to_numpy_equals_pyarrow(i):
    a = list(_arrays())[i]
    variants = [a, pa.chunked_array([a]), a.slice(3, 20) if len(a) > 20 else a,
                pa.chunked_array([a.slice(0, len(a) // 2), a.slice(len(a) // 2)], type=a.type)]
    for v in variants:
        _same_numpy(ac.to_numpy(v), v.to_numpy(zero_copy_only=False))


def test_write_and_read_report_columns_without_pandas(tmp_path):
    code = f"""
import sys, numpy as np
from logitdiff.report import write_parquet, read_columns
from logitdiff.report.html import load_tokens
n = 11
cols = {{"item_id": np.array(["a", "b"] * 5 + ["c"], dtype=object), "tags": [["x", "y"]] * n,
        "position": np.arange(n), "token_id": np.arange(n) * 3, "token": np.array(["t"] * n, dtype=object),
        "kl_nats": np.linspace(0, 1, n), "top1_match": np.arange(n) % 2 == 0,
        "top5_ref_ids": np.arange(5 * n).reshape(n, 5), "top5_ref_tokens": [["q"] * 5] * n}}
write_parquet(r"{tmp_path}/tokens.parquet", cols)
back = read_columns(r"{tmp_path}")
load_tokens(r"{tmp_path}/tokens.parquet")
assert back["top5_ref_ids"][4].tolist() == list(range(20, 25)) and back["top1_match"].dtype == bool
print("pandas" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "tokens.parquet")
    assert t.column_names[:5] == ["item_id", "tags", "position", "token_id", "token"]
    assert t.schema.field("top5_ref_ids").type == pa.list_(pa.int64())
    assert t.column("tags").to_pylist() == [["x", "y"]] * 11


def test_cli_start_imports_no_engine_or_pandas():
    """Building the CLI's parser (every command's start) imports no engine module, pandas or plotly:
    their defaults come from logitdiff.defaults."""
    code = """
import sys
from logitdiff.cli import build_parser
build_parser()
heavy = ("logitdiff.capture", "logitdiff.flips", "logitdiff.flips.grading", "logitdiff.flips.consequences", "logitdiff.speculation",
         "logitdiff.layers", "logitdiff.sources.served", "pandas", "plotly", "torch", "transformers", "jsonschema")
print([m for m in heavy if m in sys.modules])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    from logitdiff import capture, defaults, flips, layers, speculation
    from logitdiff.flips import consequences, grading

    assert (capture.SCORE_BATCH, flips.MIN_RUN, consequences.DEFAULT_MAX_BRANCHES, grading.DEFAULT_THRESHOLDS,
            layers.FLOOR_RERUN, speculation.DEFAULT_TOP_K) == (defaults.SCORE_BATCH, defaults.MIN_RUN,
                                                              defaults.DEFAULT_MAX_BRANCHES, defaults.DEFAULT_THRESHOLDS,
                                                              defaults.FLOOR_RERUN, defaults.DEFAULT_TOP_K)
