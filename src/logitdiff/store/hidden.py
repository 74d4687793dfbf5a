"""The hidden-state reference store (``--store hidden``): a bf16 (or float16) reference's
logits, bit for bit, from a few hundred bytes per position (docs/bounds.md, section 6).

A bf16 transformers model computes its logits as ``z = bf16(W h)``: the output head ``W``
[V, H] (bf16) applied to the final hidden state ``h`` [H] (bf16), accumulated in float32 and
rounded to bf16. Given ``W`` once per run and ``h`` per position, ``z`` is recomputed as

    R(s),  s = sum_j W_vj h_j in float64,  R = round to nearest bf16, ties to even,

except at the few entries where the model's float32 accumulation rounded to the other side
of a bf16 rounding boundary; those are stored as they are (``exceptions``: row, id, bits).
A float16 model is the same with float16 in place of bf16 (products of two float16 values,
11-bit significands, are exact in float64 too).

*Why the reconstruction is exact on every machine.* Products of two bf16 values are exact
in float64, and any float64 summation order is within gamma_H * sum_j |W_vj h_j| of the
exact sum (gamma_H = H u / (1 - H u), u = 2^-53; Higham, Accuracy and Stability, 3.1), which
Cauchy-Schwarz bounds by gamma_H ||W_v|| ||h||. ``encode`` (at capture, with the model's
logits at hand) stores as an exception every entry v where R(s_v - m_v) or R(s_v + m_v)
differs from the model's value, with m_v twice that bound. Since R is monotone, every other
entry has R(s'_v) = z_v for any s'_v a reader computes (any BLAS, any order, CPU or GPU).
So ``decode`` reproduces the captured bf16 logits exactly, and a comparison against them is
the full-vocabulary computation itself: nothing to bound.

Exceptions per position (bench/RESULTS.md): 0.28 on builtin:tiny (V = 4,096, H = 256),
19 on it widened to V = 248,320, 28 on a random bf16 Llama at V = 248,320, H = 4,096.

``encode``/``decode`` are pure (arrays in, arrays out; ``head`` may be a memory map);
``save_chunk``/``load_chunk``/``save_head``/``load_head`` are the only I/O, used by store.py.
"""

from __future__ import annotations

import hashlib
import io
import tokenize
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LogitdiffError

STORE = "hidden"
CHUNK_SUFFIX = "hidden.npz"
HEAD_FILE = "head.npy"
# Rows recomputed per pass over the head, and head rows converted to float64 per slice:
# bound the float64 temporaries (ROW_GROUP x slice and slice x H, 8 bytes each) whatever V
# and H are. Converting the head costs about as much as the product at H = 4096, so a pass
# serves as many rows as it can (a reader's block is a chunk: 135 rows at V = 248,320).
ROW_GROUP = 1024
SLICE_BYTES = 16 << 20
_EXC_FIELDS = ("exc_row", "exc_id", "exc_bits")


def is_hidden(store: str | None) -> bool:
    return store == STORE


# The 16-bit formats a store can hold: explicit significand bits, smallest normal, largest
# finite value. Only normal, finite values are reconstructed; ``encode`` stores the rest.
FORMATS = {"bfloat16": (7, 2.0**-126, 3.3895313892515355e38), "float16": (10, 2.0**-14, 65504.0)}


def _bits_to_f64(u16: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    u16 = np.asarray(u16, np.uint16)
    if dtype == "float16":
        return u16.view(np.float16).astype(np.float64)
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bits(s: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """float64 -> ``dtype`` bits (uint16), round to nearest, ties to even, in one rounding
    (a float32 step in between could round twice): the float64 significand is rounded to
    the format's width, after which the value is exact in it. For normal, finite results;
    ``encode`` stores anything else as an exception."""
    drop = 52 - FORMATS[dtype][0]
    b = np.ascontiguousarray(s, np.float64).view(np.uint64)
    lsb = (b >> np.uint64(drop)) & np.uint64(1)  # last kept bit of the significand
    r = ((b + np.uint64((1 << (drop - 1)) - 1) + lsb) & ~np.uint64((1 << drop) - 1)).view(np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return r.astype(np.float16).view(np.uint16)
    return (r.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _sums(hidden_f64: np.ndarray, head: np.ndarray, v0: int, v1: int, dtype: str = "bfloat16") -> np.ndarray:
    """s[n, v1 - v0] = hidden @ head[v0:v1].T in float64 (torch: its bf16 -> float64
    conversion is ~3x numpy's, and the order of the sums does not matter, see above)."""
    import torch

    w = torch.from_numpy(np.array(head[v0:v1], np.uint16).view(np.int16)).view(getattr(torch, dtype))  # a copy: memmaps are read-only
    return (torch.from_numpy(hidden_f64) @ w.to(torch.float64).T).numpy()


def _slices(V: int, H: int):
    step = max(256, SLICE_BYTES // (8 * max(H, ROW_GROUP)))
    for v0 in range(0, V, step):
        yield v0, min(V, v0 + step)


def head_norms(head: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """||W_v||_2 per head row (float64), a slice at a time."""
    V, H = head.shape
    out = np.empty(V, np.float64)
    for v0, v1 in _slices(V, H):
        out[v0:v1] = np.sqrt(np.square(_bits_to_f64(head[v0:v1], dtype)).sum(1))
    return out


def encode(logits_bits: np.ndarray, hidden_bits: np.ndarray, head: np.ndarray, norms: np.ndarray,
           dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """One block: the model's logits [n, V], its hidden states [n, H] and the head [V, H],
    all as ``dtype`` bits (uint16), and `head_norms` -> the arrays a chunk stores."""
    z = np.asarray(logits_bits, np.uint16)
    h = np.asarray(hidden_bits, np.uint16)
    n, V = z.shape
    H = h.shape[1] if h.ndim == 2 else -1
    if h.shape != (n, head.shape[1]) or head.shape[0] != V:
        raise LogitdiffError(f"hidden store: hidden states {h.shape} and head {head.shape} do not fit logits {z.shape}")
    gamma = 2.0 * 1.01 * H * 2.0**-53  # twice gamma_H, with room for the norms' own rounding
    _, tiny, big = FORMATS[dtype]
    rows, ids, bits = [], [], []
    for a in range(0, n, ROW_GROUP):
        hf = _bits_to_f64(h[a : a + ROW_GROUP], dtype)
        hn = np.sqrt(np.square(hf).sum(1))[:, None]
        for v0, v1 in _slices(V, H):
            s = _sums(hf, head, v0, v1, dtype)
            m = gamma * hn * norms[None, v0:v1]
            zz = z[a : a + ROW_GROUP, v0:v1]
            with np.errstate(over="ignore", invalid="ignore"):
                bad = ((round_bits(s - m, dtype) != zz) | (round_bits(s + m, dtype) != zz)
                       | ~(np.abs(s) - m >= tiny) | ~(np.abs(s) + m < big))
            r, c = np.nonzero(bad)
            rows.append((r + a).astype(np.int32))
            ids.append((c + v0).astype(np.int32))
            bits.append(zz[r, c])
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))  # noqa: E731
    return {"hidden": h.copy(), "exc_row": cat(rows, np.int32), "exc_id": cat(ids, np.int32), "exc_bits": cat(bits, np.uint16)}


def _round_bits_torch(s, dtype: str):
    """`round_bits` on a float64 torch tensor (any device, torch's threads): the same
    integer arithmetic on the bits (int64 wraps as uint64 does), then a conversion to the
    16-bit format that is exact because the value already fits it."""
    import torch

    drop = 52 - FORMATS[dtype][0]
    b = s.view(torch.int64)
    lsb = (b >> drop) & 1  # bit ``drop`` whatever the shift fills in above it
    r = ((b + ((1 << (drop - 1)) - 1) + lsb) & -(1 << drop)).view(torch.float64)
    return r.to(getattr(torch, dtype)).view(torch.int16)


def decode(block: dict[str, np.ndarray], head: np.ndarray, dtype: str = "bfloat16", device=None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Arrays of `encode` (a whole block, or one with its exceptions' rows renumbered) ->
    the model's logits [n, V] as ``dtype`` bits, exactly.

    One float64 head product per row group and head slice (torch: its threads on a CPU;
    ``device`` "cuda" runs the product and the rounding on a GPU): the result does not
    depend on where or in which order the sums are taken (module docstring). On a CPU
    the rounding is numpy's (torch's 64-bit integer ops measured ~40x slower there).
    ``out``: a C-contiguous uint16 [n, V] array to write the logits into (and return)
    instead of a fresh one (a reader reuses its buffers: no page faults per chunk), or a
    float32 [n, V] one: the same logits as float32 values (exact), for a caller that compares
    them against float32 rows (the compiled decode widens each tile in its threads)."""
    h = np.ascontiguousarray(block["hidden"], np.uint16)
    if out is not None and out.dtype == np.float32:
        got = None
        if device is None or str(device) == "cpu":
            from ..numerics import kernel
            from ..numerics.metrics import default_threads

            got = kernel.hidden_decode(h, head, dtype, default_threads(), out=out)
        if got is None:  # no compiled decode (or another device): the bits, then widened in place
            bits = decode(block, head, dtype, device)
            if dtype == "float16":
                out[...] = bits.view(np.float16)
            else:
                wide = out.view(np.uint32)
                wide[...] = bits
                wide <<= 16
            return out
        out[block["exc_row"], block["exc_id"]] = _bits_to_f64(block["exc_bits"], dtype)
        return out
    if device is None or str(device) == "cpu":
        from ..numerics import kernel
        from ..numerics.metrics import default_threads

        got = kernel.hidden_decode(h, head, dtype, default_threads(), out=out)
        if got is not None:
            out = got[0]
            out[block["exc_row"], block["exc_id"]] = block["exc_bits"]
            return out
    import torch

    dev = torch.device(device or "cpu")
    tdt = getattr(torch, dtype)
    n, V = h.shape[0], head.shape[0]
    if out is None:
        out = np.empty((n, V), np.uint16)
    out_t = torch.from_numpy(out.view(np.int16))
    for a in range(0, n, ROW_GROUP):
        hf = torch.from_numpy(h[a : a + ROW_GROUP].view(np.int16)).to(dev).view(tdt).to(torch.float64)
        for v0, v1 in _slices(V, head.shape[1]):
            w = torch.from_numpy(np.array(head[v0:v1], np.uint16).view(np.int16)).to(dev).view(tdt)
            sums = hf @ w.to(torch.float64).T
            if dev.type == "cpu":
                with np.errstate(over="ignore", invalid="ignore"):
                    out[a : a + ROW_GROUP, v0:v1] = round_bits(sums.numpy(), dtype)
            else:
                out_t[a : a + ROW_GROUP, v0:v1] = _round_bits_torch(sums, dtype).cpu()
    out[block["exc_row"], block["exc_id"]] = block["exc_bits"]
    return out


def rows_of(block: dict[str, np.ndarray], a: int, b: int) -> dict[str, np.ndarray]:
    """Rows a..b of a block, exceptions renumbered."""
    keep = (block["exc_row"] >= a) & (block["exc_row"] < b)
    return {"hidden": block["hidden"][a:b], "exc_row": block["exc_row"][keep] - a, "exc_id": block["exc_id"][keep],
            "exc_bits": block["exc_bits"][keep]}


def stack(blocks: list[dict[str, np.ndarray]], hidden_size: int) -> dict[str, np.ndarray]:
    """Blocks -> one block (exception rows offset)."""
    if not blocks:
        return {"hidden": np.zeros((0, hidden_size), np.uint16), "exc_row": np.zeros(0, np.int32),
                "exc_id": np.zeros(0, np.int32), "exc_bits": np.zeros(0, np.uint16)}
    offs = np.cumsum([0] + [b["hidden"].shape[0] for b in blocks[:-1]])
    return {"hidden": np.concatenate([b["hidden"] for b in blocks]),
            "exc_row": np.concatenate([b["exc_row"] + o for b, o in zip(blocks, offs)]).astype(np.int32),
            "exc_id": np.concatenate([b["exc_id"] for b in blocks]).astype(np.int32),
            "exc_bits": np.concatenate([b["exc_bits"] for b in blocks]).astype(np.uint16)}


# --------------------------------------------------------------------------------------
# files (the only I/O)
# --------------------------------------------------------------------------------------


def head_sha256(head: np.ndarray) -> str:
    hsh = hashlib.sha256()
    for v0, v1 in _slices(*head.shape):
        hsh.update(np.ascontiguousarray(head[v0:v1], np.uint16).data)  # a memory map's slice: its buffer, no copy
    return hsh.hexdigest()


def _head_sha256_cached(path, head: np.ndarray, ident: list) -> str:
    """sha256 of the memory-mapped ``head``, cached under ``ident``: the identity of the file
    taken before it was mapped, and still its identity after (else hashed, not cached): a
    head.npy replaced between the map and the lookup cannot pass its key to the old bytes."""
    from .filecache import file_fact_cached, file_identity

    if file_identity(path) != ident:
        return head_sha256(head)
    return file_fact_cached(path, "hidden-head-sha256", lambda: head_sha256(head),
                            valid=lambda t: len(t) == 64 and all(c in "0123456789abcdef" for c in t), ident=ident)


def save_chunk(block: dict[str, np.ndarray]) -> bytes:
    bio = io.BytesIO()
    arrays: dict[str, Any] = block  # (numpy's stub would read a ** of arrays as its allow_pickle flag)
    np.savez_compressed(bio, **arrays)
    return bio.getvalue()


# what each exception field must be: a row and a token id index the decoded rows (a float
# or a 64-bit value there was an IndexError traceback), the bits are bf16 values
_EXC_KINDS = {"exc_row": "iu", "exc_id": "iu", "exc_bits": "u"}


def load_chunk(path, hidden_size: int, vocab_size: int, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """A chunk file's arrays, checked (``max_bytes``: what its members may hold together, the
    chunk's rows as its manifest entry declares them; see npzinflate.read_npz)."""
    from .npzinflate import read_npz

    try:
        data = read_npz(path, max_bytes=max_bytes)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, SyntaxError, TypeError,
            tokenize.TokenError, MemoryError) as e:
        raise LogitdiffError(f"{path}: unreadable hidden-state chunk ({e})") from None
    for k in ("hidden", *_EXC_FIELDS):
        if k not in data:
            raise LogitdiffError(f"{path}: hidden-state chunk lacks field {k!r}")
    h = data["hidden"]
    if h.dtype != np.uint16 or h.ndim != 2 or h.shape[1] != hidden_size:
        raise LogitdiffError(f"{path}: field 'hidden' is {h.dtype} {h.shape}, expected uint16 (*, {hidden_size})")
    exc = [data[k] for k in _EXC_FIELDS]
    for k, x in zip(_EXC_FIELDS, exc):
        if x.dtype.kind not in _EXC_KINDS[k] or x.dtype.itemsize > (2 if k == "exc_bits" else 8):
            raise LogitdiffError(f"{path}: field {k!r} is {x.dtype}, expected {'uint16' if k == 'exc_bits' else 'integers'}")
    if len({x.shape for x in exc}) != 1 or exc[0].ndim != 1:
        raise LogitdiffError(f"{path}: exception fields of different lengths")
    if exc[0].size and (exc[0].min() < 0 or exc[0].max() >= h.shape[0] or exc[1].min() < 0 or exc[1].max() >= vocab_size):
        raise LogitdiffError(f"{path}: field 'exc_row'/'exc_id' outside the chunk's {h.shape[0]} rows x {vocab_size} ids")
    return data


def load_head(path, vocab_size: int, sha256: str | None) -> np.ndarray:
    """The run's output head [V, H] (bf16 bits), memory-mapped, checked against the
    manifest's shape and sha256.

    The sha256 is computed once per version of the file (store/filecache.py: keyed by
    path, device, inode, size, mtime_ns and ctime_ns, which a write to the file moves and
    user space cannot set back), not once per reader: hashing a 57 MB head took 0.04 s,
    40 % of a whole compare against a full reference at V = 49,152 (bench/RESULTS.md). A
    head whose bytes changed has another identity, so it is hashed again and refused."""
    from .filecache import file_identity
    from .files import input_stat

    # a regular file inside the RUN (a FIFO would hang the map's open); memory-mapped, so its
    # size allocates nothing: the shape below is what is checked
    if not Path(path).exists():
        raise LogitdiffError(f"{path}: missing (a hidden-state run needs its output head)")
    input_stat(path, max_bytes=1 << 62, inside=Path(path).parent)
    try:
        ident = file_identity(path)  # before the map: the version the mapped bytes are
        head = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise LogitdiffError(f"{path}: missing (a hidden-state run needs its output head)") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise LogitdiffError(f"{path}: unreadable output head ({e})") from None
    if head.dtype != np.uint16 or head.ndim != 2 or head.shape[0] != vocab_size:
        raise LogitdiffError(f"{path}: output head is {head.dtype} {head.shape}, expected uint16 ({vocab_size}, H)")
    if sha256 is not None and _head_sha256_cached(path, head, ident) != sha256:
        raise LogitdiffError(f"{path}: sha256 differs from the manifest's 'head.sha256' (the file was changed)")
    return head
