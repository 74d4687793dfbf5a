"""Bridge to the compiled full-vocabulary kernel (``_kernel.cpp``, built by ``pip install``).

`pair_rows` hands two ``[R, V]`` CPU tensors (float32, bfloat16 or float16; or numpy float32/float16 arrays, no torch needed; rows of unit
stride; any row stride, so memory maps and stride-0 expansions are read in place, never
copied or upcast) to the kernel and returns, per row, the maxima, the exact top-kk of
each side and the eight float64 sums that `metrics.full_vocab` turns into its fields.
ctypes releases the GIL for the call; the kernel's threads live for that call only.
Importing this module loads nothing; `available()` says whether the library was built.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import numpy as np

# Input dtypes the kernel reads directly (torch dtype name -> kernel code).
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
# Instruction sets: auto (AVX2+FMA+F16C where the CPU has them, pass 2 in the EVEX build where
# it also has AVX-512VL), "avx2" (the AVX2 build only), or the portable path.
ISA_CODES = {"auto": 0, "scalar": 1, "avx2": 2}
# `hidden_decode`'s instruction sets: those of ISA_CODES, and "avx512bf16" (VDPBF16PS, bf16
# heads; what "auto" takes where the CPU has it, `has_avx512bf16`).
HIDDEN_ISA_CODES = {**ISA_CODES, "avx512bf16": 3}
# Order of the per-row sums returned in ``sums`` (see _kernel.cpp).
SUM_FIELDS = ("s_p", "a_p", "s_q", "a_q", "d_p", "d_q", "g", "s_d")
FLAG_BAD = 1  # a row holds NaN/inf (its sums are NaN)
FLAG_PASS3 = 2  # G was recomputed at the exact ratio (the first-order estimate was not enough)
FLAG_TAIL = 4  # tail tiles took the cheaper exp/log (their error bound met the budget)
FLAG_TAIL_REDONE = 8  # tail tiles were tried, the bound failed, the row was redone exactly


@functools.lru_cache(maxsize=1)
def _lib():
    spec = importlib.util.find_spec("logitdiff.numerics._kernel")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    f = lib.logitdiff_pair_rows
    p = ctypes.c_void_p
    i64, i32 = ctypes.c_int64, ctypes.c_int
    f.argtypes = [p, p, i64, i64, i64, i64, i32, i32, i32, i32, p, p, p, p, p]
    f.restype = i32
    lib.logitdiff_has_avx2.restype = i32
    h = getattr(lib, "logitdiff_has_evex", None)  # absent from a library built before it
    if h is not None:
        h.restype = i32
    g = getattr(lib, "logitdiff_first_nonfinite", None)  # absent from a library built before it
    if g is not None:
        g.argtypes = [p, i64, i64, i64, i32]
        g.restype = i64
    for name in ("logitdiff_hidden_decode", "logitdiff_hidden_decode_f32"):  # hidden.decode's product (absent from older builds)
        h = getattr(lib, name, None)
        if h is not None:
            h.argtypes = [p, i64, p, i64, i64, i32, i32, i32, p, i64, p]
            h.restype = i32
    b = getattr(lib, "logitdiff_has_avx512bf16", None)  # absent from older builds
    if b is not None:
        b.restype = i32
    c = getattr(lib, "logitdiff_compact_bounds", None)  # bounds.compact_vs_full's groups (absent from older builds)
    if c is not None:
        c.argtypes = [i64, i64, p, p, i64, i64, p, p, i64, p, p, p, p, p, p, p, i32, p, p]
        c.restype = i32
    c = getattr(lib, "logitdiff_compact_rows", None)  # the same from raw candidate logits (absent from older builds)
    if c is not None:
        c.argtypes = [i64, i64, p, i64, i32, i64, p, p, p, p, i64, p, p, i32, p, p, ctypes.c_double, p, p, p, p, i32, i32,
                      i32, p, p, p, p, p]
        c.restype = i32
    return lib


def available() -> bool:
    """True when the compiled kernel is installed (it is built by ``pip install``)."""
    return _lib() is not None


def has_simd() -> bool:
    """True when the kernel's AVX2/FMA path runs on this CPU."""
    lib = _lib()
    return bool(lib is not None and lib.logitdiff_has_avx2())


def has_evex() -> bool:
    """True when ``isa="auto"`` takes the EVEX (AVX-512VL, 32-register) build of pass 2."""
    lib = _lib()
    return bool(lib is not None and getattr(lib, "logitdiff_has_evex", None) is not None and lib.logitdiff_has_evex())


def has_avx512bf16() -> bool:
    """True when `hidden_decode` can take (and ``isa="auto"`` takes) the AVX-512 BF16 path."""
    lib = _lib()
    f = getattr(lib, "logitdiff_has_avx512bf16", None) if lib is not None else None
    return bool(f is not None and f())


# numpy dtypes the kernel reads in place (bf16 has no numpy dtype: its bits come as a torch view)
_NUMPY_CODES = {np.dtype(np.float32): DTYPE_CODES["float32"], np.dtype(np.float16): DTYPE_CODES["float16"]}


def supports(z) -> bool:
    """Whether ``z`` (a torch tensor, or a float32/float16 numpy array: no torch needed) can be
    read by the kernel in place."""
    if isinstance(z, np.ndarray):
        return (z.ndim == 2 and z.dtype in _NUMPY_CODES and (z.shape[1] == 1 or z.strides[1] == z.itemsize)
                and z.strides[0] % z.itemsize == 0)
    import torch

    return (
        isinstance(z, torch.Tensor)
        and z.device.type == "cpu"
        and z.dim() == 2
        and str(z.dtype).removeprefix("torch.") in DTYPE_CODES
        and (z.stride(1) == 1 or z.shape[1] == 1)
    )


def pair_rows(zp, zq, kk: int, threads: int, isa: str = "auto") -> dict[str, np.ndarray]:
    """Per-row maxima, top-kk and sums of two ``[R, V]`` tensors (or numpy arrays) of one dtype (see module doc).

    Returns ``maxes`` [R, 2] (reference, candidate), ``top_ids`` [R, 2, kk] int64 (value
    descending, lowest id first on ties), ``top_vals`` [R, 2, kk] float64, ``sums`` [R, 8]
    in `SUM_FIELDS` order and ``flags`` [R] (`FLAG_BAD`, `FLAG_PASS3`, `FLAG_TAIL`,
    `FLAG_TAIL_REDONE`).
    """
    lib = _lib()
    if lib is None:
        raise RuntimeError("the compiled kernel logitdiff.numerics._kernel is not built (reinstall with pip install -e .)")
    if not (supports(zp) and supports(zq)) or zp.shape != zq.shape or zp.dtype != zq.dtype:
        raise ValueError(f"kernel input must be two CPU [R, V] tensors of one dtype in {sorted(DTYPE_CODES)} with unit column stride")
    n, vocab = zp.shape
    if isinstance(zp, np.ndarray) != isinstance(zq, np.ndarray):
        raise ValueError("kernel input must be two numpy arrays or two torch tensors, not one of each")
    if isinstance(zp, np.ndarray):  # pointer, row stride in elements, dtype code
        code = _NUMPY_CODES[zp.dtype]
        ptrs = (zp.ctypes.data, zq.ctypes.data, zp.strides[0] // zp.itemsize, zq.strides[0] // zq.itemsize)
    else:
        code = DTYPE_CODES[str(zp.dtype).removeprefix("torch.")]
        ptrs = (zp.data_ptr(), zq.data_ptr(), zp.stride(0), zq.stride(0))
    out = {
        "sums": np.empty((n, 8), np.float64),
        "maxes": np.empty((n, 2), np.float64),
        "top_ids": np.empty((n, 2, kk), np.int64),
        "top_vals": np.empty((n, 2, kk), np.float64),
        "flags": np.empty(n, np.int32),
    }
    if n == 0:
        return out
    rc = lib.logitdiff_pair_rows(
        ptrs[0], ptrs[1], n, vocab, ptrs[2], ptrs[3], code, kk, max(1, int(threads)), ISA_CODES[isa],
        *(out[f].ctypes.data for f in ("sums", "maxes", "top_ids", "top_vals", "flags")),
    )  # fmt: skip
    if rc:
        raise ValueError(f"kernel rejected its arguments (n={n}, V={vocab}, kk={kk}, threads={threads})")
    return out


# numpy dtypes the non-finite scan reads (bf16 as its uint16 bits).
_SCAN_CODES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.float16): 2}


def first_nonfinite(rows: np.ndarray) -> int | None:
    """First row of a ``[R, V]`` array (float32, float16, or bf16 bits as uint16) holding a
    NaN or an infinity, or None: one vectorised read of the rows, no temporaries. -1 means
    "not checked here" (the library or its scan is not built, or the layout is not one it
    reads): the caller checks another way."""
    lib = _lib()
    code = _SCAN_CODES.get(rows.dtype)
    if (lib is None or code is None or rows.ndim != 2 or getattr(lib, "logitdiff_first_nonfinite", None) is None
            or (rows.shape[1] > 1 and rows.strides[1] != rows.itemsize) or rows.strides[0] % rows.itemsize):
        return -1
    got = lib.logitdiff_first_nonfinite(rows.ctypes.data, rows.shape[0], rows.shape[1], rows.strides[0] // rows.itemsize, code)
    return None if got < 0 else int(got)


def hidden_decode(hidden: np.ndarray, head: np.ndarray, dtype: str, threads: int,
                  isa: str = "auto", out: np.ndarray | None = None) -> tuple[np.ndarray, int] | None:
    """`hidden.decode`'s reconstruction before exceptions, compiled (issue 28): the bits
    R(W h) [n, V] of hidden states [n, H] and a head [V, H] (16-bit bits, ``dtype``
    "bfloat16" or "float16"), float32 dots with a proven error bound and the float64 dot
    where that bound straddles a rounding boundary (_kernel.cpp), and how many entries took
    the float64 path. ``isa`` (`HIDDEN_ISA_CODES`): "auto" the fastest this CPU runs,
    "avx512bf16" VDPBF16PS (bf16 heads; ValueError on a CPU without it, `has_avx512bf16`),
    "avx2" the 8-lane float32 path, "scalar" the portable one (every dot in float64, as on
    a CPU without AVX2). The bits do not depend on it. ``out``: a C-contiguous uint16 [n, V]
    array to write into (and return) instead of a fresh one, or a float32 one: the same
    values widened to float32 (exact), written by the decode's threads (a caller comparing
    against float32 rows then converts nothing). None when the library lacks the function."""
    lib = _lib()
    f32 = out is not None and out.dtype == np.float32
    fn = getattr(lib, "logitdiff_hidden_decode_f32" if f32 else "logitdiff_hidden_decode", None) if lib is not None else None
    if fn is None:
        return None
    h = np.ascontiguousarray(hidden, np.uint16)
    w = np.ascontiguousarray(head, np.uint16)  # a C-contiguous memory map is read in place
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[1]:
        # the kernel reads hidden as [n, head.shape[1]]: a mismatch would read past its end
        raise ValueError(f"hidden_decode: hidden {h.shape} and head {w.shape} differ in hidden size")
    n, V = h.shape[0], w.shape[0]
    if out is None:
        out = np.empty((n, V), np.uint16)
    elif out.shape != (n, V) or out.dtype not in (np.uint16, np.float32) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"hidden_decode: out {out.dtype} {out.shape} is not a writable C-contiguous uint16 or float32 ({n}, {V})")
    fb = ctypes.c_int64(0)
    rc = fn(h.ctypes.data, n, w.ctypes.data, V, w.shape[1], DTYPE_CODES[dtype], max(1, int(threads)),
            HIDDEN_ISA_CODES[isa], out.ctypes.data, V, ctypes.byref(fb))
    if rc == 2:
        raise ValueError("hidden_decode: isa='avx512bf16' on a CPU without AVX-512 BF16")
    if rc != 0:
        raise ValueError(f"hidden_decode: bad arguments (hidden {h.shape}, head {w.shape}, {dtype})")
    return out, int(fb.value)


def _compact_ref_arrays(ref) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(getattr(ref, k), dt) for k, dt in (
        ("exact_ids", np.int64), ("exact_logp", np.float64), ("band_ids", np.int64), ("band_lo", np.float64),
        ("band_hi", np.float64), ("band_mass", np.float64), ("rest_mass", np.float64), ("rest_max", np.float64),
        ("rest_min", np.float64))}


def compact_rows(z: np.ndarray, block: dict[str, np.ndarray], kk: int, threads: int,
                 isa: str = "auto", *, rest_box: tuple[np.ndarray, np.ndarray], box_slack: float) -> dict[str, np.ndarray] | None:
    """`compact_bounds` from the candidate's raw logits ``z`` [n, V] (float32, float16, or
    bf16 bits as uint16; rows contiguous, read in place) against a compact reference in its
    stored form ``block`` (`compact.encode`'s arrays; `compact.decode`'s arithmetic is done
    in the kernel, per entry), with the candidate's side in the same pass (issue 28):
    ``lower``/``upper`` [3, n] (forward KL, reverse KL, JSD), ``max``, ``log_sum`` (ln sum
    exp(z - max)) and ``entropy`` [n] (float64), ``top_ids`` [n, kk] (value descending,
    lowest id first on ties) and ``bad`` [n] (True: the row holds NaN/inf; its other outputs
    are NaN). ``isa`` (`ISA_CODES`): "auto" the AVX2 passes where the CPU has them, "scalar"
    the portable ones (tests hold both to the same values). None when the library lacks the
    function or cannot read ``z`` in place. ``rest_box`` (rest_max, rest_min) and ``box_slack``
    are `compact.decode_rest`'s box and `compact.BOX_SLACK`, passed in so that this module
    imports nothing of the package."""
    lib = _lib()
    fn = getattr(lib, "logitdiff_compact_rows", None) if lib is not None else None
    z = np.asarray(z)
    dtype = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.float16): 2}.get(z.dtype)
    if fn is None or dtype is None or z.ndim != 2 or z.strides[1] != z.itemsize or z.strides[0] % z.itemsize:
        return None
    n, V = z.shape
    kk = int(min(max(kk, 0), V))
    f64, i64 = np.float64, np.int64
    arr = {k: np.ascontiguousarray(block[k], dt) for k, dt in (
        ("exact_ids", i64), ("exact_logits", np.float32), ("max_logit", f64), ("log_sum", f64), ("band_ids", i64),
        ("band_top", f64), ("band_step", f64), ("band_mass", f64), ("rest_mass", f64))}
    codes = np.asarray(block["band_codes"])
    codes = np.ascontiguousarray(codes if codes.dtype in (np.uint8, np.uint16) else codes.astype(np.uint16))
    rest_max, rest_min = (np.ascontiguousarray(a, f64) for a in rest_box)
    lower, upper = np.zeros((3, n)), np.zeros((3, n))
    stats = np.zeros((n, 3))
    top = np.zeros((n, kk), np.int64)
    bad = np.zeros(n, np.int32)
    ld = z.strides[0] // z.itemsize if n > 1 else V
    rc = fn(n, V, z.ctypes.data, ld, dtype, arr["exact_ids"].shape[1], arr["exact_ids"].ctypes.data,
            arr["exact_logits"].ctypes.data, arr["max_logit"].ctypes.data, arr["log_sum"].ctypes.data,
            arr["band_ids"].shape[1], arr["band_ids"].ctypes.data, codes.ctypes.data, 8 * codes.itemsize,
            arr["band_top"].ctypes.data, arr["band_step"].ctypes.data, float(box_slack), arr["band_mass"].ctypes.data,
            arr["rest_mass"].ctypes.data, rest_max.ctypes.data, rest_min.ctypes.data, kk,
            max(1, int(threads)), ISA_CODES[isa], lower.ctypes.data, upper.ctypes.data, stats.ctypes.data, top.ctypes.data,
            bad.ctypes.data)
    if rc != 0:
        raise ValueError(f"compact_rows: bad arguments (an id outside the vocabulary, or isa={isa!r} not on this CPU)")
    return {"lower": lower, "upper": upper, "max": stats[:, 0], "log_sum": stats[:, 1], "entropy": stats[:, 2],
            "top_ids": top, "bad": bad.astype(bool)}


def compact_bounds(lq: np.ndarray, q: np.ndarray, ref, threads: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`bounds.compact_vs_full`'s sums, compiled (issue 28): (lower, upper) [3, n] of forward
    KL, reverse KL and JSD (that order) before `bounds._interval`'s clamps, for a compact
    reference ``ref`` (`bounds.CompactRows`) against candidate log-probabilities ``lq`` and
    probabilities ``q`` [n, V] (float64). None when the library lacks the function."""
    lib = _lib()
    fn = getattr(lib, "logitdiff_compact_bounds", None) if lib is not None else None
    if fn is None:
        return None
    lq = np.ascontiguousarray(lq, np.float64)
    q = np.ascontiguousarray(q, np.float64)
    n, V = lq.shape
    arr = _compact_ref_arrays(ref)
    lower = np.zeros((3, n))
    upper = np.zeros((3, n))
    rc = fn(n, V, lq.ctypes.data, q.ctypes.data, V, arr["exact_ids"].shape[1], arr["exact_ids"].ctypes.data,
            arr["exact_logp"].ctypes.data, arr["band_ids"].shape[1], arr["band_ids"].ctypes.data,
            arr["band_lo"].ctypes.data, arr["band_hi"].ctypes.data, arr["band_mass"].ctypes.data,
            arr["rest_mass"].ctypes.data, arr["rest_max"].ctypes.data, arr["rest_min"].ctypes.data,
            max(1, int(threads)), lower.ctypes.data, upper.ctypes.data)
    if rc != 0:
        raise ValueError("compact_bounds: bad arguments (an id outside the vocabulary)")
    return lower, upper
