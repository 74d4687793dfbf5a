"""numpy columns <-> pyarrow arrays without pandas.

pyarrow's ``pa.array`` and ``Array.to_numpy`` import pandas on first use (0.3-2 s of a
``compare`` process, more on a loaded machine) even for plain numpy input. These build the
same arrays from buffers and read them back the same way: ``from_numpy`` gives what
``pa.array`` gives for the column kinds a report holds (numbers, bools, strings, lists of
strings, 2-D numeric arrays as lists), ``to_numpy`` gives what ``to_numpy(zero_copy_only=False)``
gives (object arrays of str / of numpy rows for strings and lists). Anything else (nulls,
other types, strings over 2 GiB) falls back to pyarrow's own functions: same result, slower start.
"""

from __future__ import annotations

import numpy as np

_INT32_MAX = 2**31 - 1


def _numeric(pa, v: np.ndarray):
    v = np.ascontiguousarray(v)
    if v.dtype == np.bool_:
        bits = np.packbits(v, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(v), [None, pa.py_buffer(bits)])
    return pa.Array.from_buffers(pa.from_numpy_dtype(v.dtype), len(v), [None, pa.py_buffer(v)])


def _offsets(pa, lengths: np.ndarray):
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    if off[-1] > _INT32_MAX:
        return None
    return pa.py_buffer(off.astype(np.int32))


def strings(values) -> "object":
    """pa.array(values, type=pa.string()) for a sequence of str."""
    import pyarrow as pa

    try:
        enc = [s.encode("utf-8") for s in values]
    except (UnicodeEncodeError, AttributeError):
        return pa.array(list(values), type=pa.string())
    off = _offsets(pa, np.fromiter((len(b) for b in enc), dtype=np.int64, count=len(enc)))
    if off is None:
        return pa.array(list(values), type=pa.string())
    return pa.Array.from_buffers(pa.string(), len(enc), [None, off, pa.py_buffer(b"".join(enc))])


def string_lists(rows) -> "object":
    """pa.array(rows, type=pa.list_(pa.string())) for a sequence of sequences of str."""
    import pyarrow as pa

    rows = [list(r) for r in rows]
    flat = strings([s for r in rows for s in r])
    off = _offsets(pa, np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)))
    if off is None:
        return pa.array(rows, type=pa.list_(pa.string()))
    return pa.ListArray.from_buffers(pa.list_(pa.string()), len(rows), [None, off], children=[flat])


def from_numpy(v: np.ndarray) -> "object":
    """What ``pa.array(v)`` (1-D numeric/bool) or ``pa.array(list(v))`` (2-D numeric) gives."""
    import pyarrow as pa

    v = np.asarray(v)
    if v.dtype.kind not in "biuf" or v.ndim not in (1, 2):
        return pa.array(list(v) if v.ndim == 2 else v)
    if v.ndim == 1:
        return _numeric(pa, v)
    n, m = v.shape
    off = _offsets(pa, np.full(n, m, dtype=np.int64))
    if off is None:
        return pa.array(list(v))
    child = _numeric(pa, v.reshape(-1))
    return pa.ListArray.from_buffers(pa.list_(child.type), n, [None, off], children=[child])


def _array_to_numpy(pa, a) -> np.ndarray:
    t = a.type
    if a.null_count:
        return a.to_numpy(zero_copy_only=False)
    if pa.types.is_boolean(t):
        bits = np.frombuffer(a.buffers()[1], dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little", count=a.offset + len(a))[a.offset :].astype(bool)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        dt = np.dtype(t.to_pandas_dtype())
        return np.frombuffer(a.buffers()[1], dtype=dt, count=a.offset + len(a))[a.offset :].copy()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        out = np.empty(len(a), dtype=object)
        out[:] = a.to_pylist()
        return out
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        off = _array_to_numpy(pa, a.offsets).astype(np.int64)
        child = _array_to_numpy(pa, a.values)
        out = np.empty(len(a), dtype=object)
        for i in range(len(a)):
            out[i] = child[off[i] : off[i + 1]]
        return out
    return a.to_numpy(zero_copy_only=False)


def to_numpy(col) -> np.ndarray:
    """``col.to_numpy(zero_copy_only=False)`` of a ChunkedArray or Array, without pandas."""
    import pyarrow as pa

    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) == 1:
        return _array_to_numpy(pa, chunks[0])
    if not chunks:
        return col.to_numpy(zero_copy_only=False)
    return np.concatenate([_array_to_numpy(pa, c) for c in chunks])


def read_parquet(path, columns=None):
    """A REPORT's tokens.parquet as a pyarrow Table, or a one-line error naming the file: a
    regular file (store.files.open_input: no FIFO or device; read whole, so bounded like a
    document), and one that is not Parquet or is damaged is refused, not a pyarrow traceback.
    ``columns``: the columns to read, a function of the file's column names giving them, or
    None for all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..errors import LogitdiffError
    from ..store.files import DOCUMENT_MAX_BYTES, open_input

    with open_input(path, max_bytes=DOCUMENT_MAX_BYTES) as f:
        # the bytes, not the Python file object: pyarrow reading through a Python file from its
        # own threads aborted the interpreter at exit now and then ("terminate called without
        # an active exception", tests/test_arrow_columns.py); the size was bounded above
        data = f.read()
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        return pf.read(columns=columns(pf.schema_arrow.names) if callable(columns) else columns)
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())[:160]
        raise LogitdiffError(f"{path}: not a tokens.parquet this logitdiff reads ({type(e).__name__}: {msg})") from None
