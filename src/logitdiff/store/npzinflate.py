"""The members of an ``.npz`` file (``np.savez_compressed``'s zip of ``.npy`` files), each
inflated by libdeflate where the system has it (issue 28: a compact reference's chunk is
deflated; zlib's inflate was ~10 % of a compare against it, libdeflate's takes ~2/3 of its
instructions and checks the CRC-32 in a fraction of zlib's time).

`load` returns None where it cannot read the file this way (no libdeflate, a member stored
with another method, encrypted, or a layout it does not know): the caller reads the file
with ``np.load`` as before, so a well-formed file is never refused here that ``np.load`` would read.
What it refuses (ValueError naming the member): a member whose bytes do not inflate, do not
match the CRC-32 of the zip directory, or hold no plain ``.npy`` array, as ``np.load`` does;
and, before anything is allocated, sizes its method cannot produce from its bytes (a stored
member's two sizes differ; a deflated one claims more than 1032 times its bytes), a local
header missing or naming another member, or two members' bytes overlapping (``np.load``
reads some such files, inflating whatever a directory claims).
The same deflate streams are read, so stores written by any version read alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io
import struct
import zipfile
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=1)
def _lib():
    name = ctypes.util.find_library("deflate")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)  # ctypes releases the GIL for each call: members inflate side by side
        p, n = ctypes.c_void_p, ctypes.c_size_t
        lib.libdeflate_alloc_decompressor.restype = p
        lib.libdeflate_alloc_decompressor.argtypes = []
        lib.libdeflate_free_decompressor.argtypes = [p]
        lib.libdeflate_free_decompressor.restype = None
        lib.libdeflate_deflate_decompress.argtypes = [p, p, n, p, n, ctypes.POINTER(n)]
        lib.libdeflate_deflate_decompress.restype = ctypes.c_int
        lib.libdeflate_crc32.argtypes = [ctypes.c_uint32, p, n]
        lib.libdeflate_crc32.restype = ctypes.c_uint32
    except (OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    """True where libdeflate is found (`load` reads with it)."""
    return _lib() is not None


# deflate expands at most ~1032:1 (a length-258 match per 2 bits at best, RFC 1951), so a
# member claiming more than this is damaged or hostile: refused before anything is allocated
DEFLATE_MAX_RATIO = 1032
LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


class _NotHere(Exception):
    """A member this reader does not handle though ``np.load`` may (a .npy version or layout
    it does not know): `load` returns None and the caller reads the file with ``np.load``."""


def _checked_spans(raw: memoryview, infos: list[zipfile.ZipInfo]) -> dict[str, tuple[int, int]]:
    """Each member's compressed bytes as (start, end) in the file, after the checks that bound
    what inflating it may allocate: a local header where the directory says, with the
    directory's name; sizes a member's method can produce from its bytes; no two members'
    bytes overlapping (a directory pointing many names at one stream would inflate it many
    times). ValueError for any that fails, naming the member."""
    spans: dict[str, tuple[int, int]] = {}
    for info in infos:
        off, name = info.header_offset, info.filename
        if off < 0 or off + LOCAL_HEADER > len(raw) or bytes(raw[off : off + 4]) != b"PK\x03\x04":
            raise ValueError(f"member {name!r}: no local header at offset {off}")
        name_len, extra_len = struct.unpack("<HH", raw[off + 26 : off + 30])
        local_name = bytes(raw[off + LOCAL_HEADER : off + LOCAL_HEADER + name_len])
        if local_name not in (name.encode("utf-8"), name.encode("cp437", "replace")):
            raise ValueError(f"member {name!r}: its local header names {local_name!r}")
        start = off + LOCAL_HEADER + name_len + extra_len
        end = start + info.compress_size
        if end > len(raw):
            raise ValueError(f"member {name!r}: truncated")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise ValueError(f"member {name!r}: stored with {info.compress_size} bytes for {info.file_size}")
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > DEFLATE_MAX_RATIO * info.compress_size + 1024:
            raise ValueError(f"member {name!r}: {info.file_size} bytes cannot inflate from {info.compress_size}")
        spans[name] = (off, end)
    ordered = sorted(spans.items(), key=lambda kv: kv[1])
    for (a, (_, a_end)), (b, (b_off, _)) in zip(ordered, ordered[1:]):
        if b_off < a_end:
            raise ValueError(f"members {a!r} and {b!r} overlap")
    return spans


def _header(out: np.ndarray, name: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """The .npy header at the start of ``out``: shape, Fortran order, dtype and the data's
    offset. A header ``np.load`` would refuse is a ValueError here too (numpy's parser raises
    SyntaxError, TypeError or tokenize errors on some); one it may read that this does not
    is `_NotHere`."""
    f = io.BytesIO(out[:12].tobytes())
    try:
        version = np.lib.format.read_magic(f)
    except Exception as e:  # noqa: BLE001 - numpy's parser: any failure is a damaged member
        raise ValueError(f"member {name!r}: not a .npy array ({e})") from None
    if version not in ((1, 0), (2, 0)):
        raise _NotHere(version)
    length = int.from_bytes(out[8:10].tobytes() if version == (1, 0) else out[8:12].tobytes(), "little")
    total = (10 if version == (1, 0) else 12) + length
    if total > out.size:
        raise ValueError(f"member {name!r}: .npy header longer than the member")
    f = io.BytesIO(out[:total].tobytes())
    try:
        np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except Exception as e:  # noqa: BLE001 - SyntaxError, TypeError, tokenize.TokenError, ValueError
        raise ValueError(f"member {name!r}: bad .npy header ({type(e).__name__}: {e})") from None
    if not all(type(d) is int and d >= 0 for d in shape):  # not a bool, not negative
        raise ValueError(f"member {name!r}: bad shape {shape!r} in its .npy header")
    if dtype.hasobject:
        raise ValueError(f"member {name!r}: object arrays are not read (pickles)")
    return shape, fortran, dtype, total


def _member(lib, raw: memoryview, info: zipfile.ZipInfo, span: tuple[int, int]) -> np.ndarray:
    """One member's ``.npy`` array, inflated into a fresh buffer that the array views
    (its sizes already checked by `_checked_spans`)."""
    end = span[1]
    data = raw[end - info.compress_size : end]
    try:
        out = np.empty(info.file_size, np.uint8)
    except MemoryError:
        raise ValueError(f"member {info.filename!r}: {info.file_size} bytes do not fit in memory") from None
    if info.compress_type == zipfile.ZIP_DEFLATED:
        src = np.frombuffer(data, np.uint8)  # a view of the file's bytes, not a copy
        d = lib.libdeflate_alloc_decompressor()  # one per call: a decompressor is not shared between threads
        if not d:
            raise MemoryError("libdeflate_alloc_decompressor")
        got = ctypes.c_size_t(0)
        try:
            rc = lib.libdeflate_deflate_decompress(d, src.ctypes.data, src.size, out.ctypes.data, out.size,
                                                   ctypes.byref(got))
        finally:
            lib.libdeflate_free_decompressor(d)
        if rc != 0 or got.value != info.file_size:
            raise ValueError(f"member {info.filename!r}: bad deflate data")
    else:  # ZIP_STORED (load() sends nothing else here)
        out[:] = np.frombuffer(data, np.uint8)
    if lib.libdeflate_crc32(0, out.ctypes.data, out.size) != info.CRC:
        raise ValueError(f"member {info.filename!r}: CRC-32 mismatch (damaged file)")
    shape, fortran, dtype, offset = _header(out, info.filename)
    count = int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(out, dtype, count=count, offset=offset)
    if not arr.flags.aligned:
        # a header not padded to the dtype's alignment (np.save pads to 64 bytes; other writers
        # need not): a copy, so compiled readers never get a misaligned pointer
        arr = arr.copy()
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


# A .npy header is at most 10 + 65,535 bytes (format 1.0; np.save writes ~128): what a
# member may hold beyond its array's bytes, so beyond what a chunk's rows account for.
NPY_HEADER_MAX = 10 + 0xFFFF


def _file_bound(max_bytes: int | None) -> int:
    """The most bytes an .npz whose members hold at most ``max_bytes`` may take on disk: deflate
    adds at most 5 bytes per 16 KiB stored block, and the zip's headers and directory ~100
    bytes per member (members are bounded by the same count through ``max_bytes``'s headers)."""
    return 1 << 62 if max_bytes is None else max_bytes + max_bytes // 1024 + (1 << 20)


def _read_checked(path: str | Path, max_bytes: int | None) -> tuple[bytes, list[zipfile.ZipInfo]]:
    """The file's bytes (a regular file, read with a bound: files.read_input_bytes) and its zip
    directory, after the check that bounds what its members may claim: their sizes together
    within ``max_bytes`` (the chunk's rows at most, see StoreKind.chunk_bound) plus one .npy
    header each. ValueError otherwise, before any member is inflated."""
    from .files import read_input_bytes

    raw = read_input_bytes(path, max_bytes=_file_bound(max_bytes))
    return raw, check_claims(raw, max_bytes)


def check_claims(raw, max_bytes: int | None) -> list[zipfile.ZipInfo]:
    """The zip directory of the .npz ``raw`` (its bytes, or a binary file), its members' sizes
    together within ``max_bytes`` (plus one .npy header each); ValueError before anything is
    inflated."""
    with zipfile.ZipFile(io.BytesIO(raw) if isinstance(raw, bytes) else raw) as zf:
        infos = zf.infolist()
    if max_bytes is not None:
        claimed = sum(i.file_size for i in infos)
        if claimed > max_bytes + NPY_HEADER_MAX * len(infos):
            big = max(infos, key=lambda i: i.file_size)
            raise ValueError(f"members claim {claimed} bytes (member {big.filename!r}: {big.file_size}), more than "
                             f"the {max_bytes} bytes they may hold")
    return infos


def load(path: str | Path, threads: int = 4, *, max_bytes: int | None = None) -> dict[str, np.ndarray] | None:
    """``{name: array}`` of an ``.npz`` file (names without ``.npy``), members inflated by
    libdeflate, ``threads`` at once; None where this reader does not apply (see module doc).
    ``max_bytes``: what the members may hold together (`_read_checked`). Raises
    ValueError/OSError/zipfile.BadZipFile for a damaged file, as ``np.load`` does."""
    lib = _lib()
    if lib is None:
        return None
    raw_bytes, infos = _read_checked(path, max_bytes)
    if any(i.compress_type not in (zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED) or i.flag_bits & 0x1
           or not i.filename.endswith(".npy") for i in infos):
        return None
    raw = memoryview(raw_bytes)
    spans = _checked_spans(raw, infos)
    try:
        if threads > 1 and len(infos) > 1:
            from concurrent.futures import ThreadPoolExecutor

            # the largest members first: the band's ids and codes are most of a compact chunk
            order = sorted(infos, key=lambda i: -i.file_size)
            with ThreadPoolExecutor(min(threads, len(infos))) as pool:
                arrays = dict(zip((i.filename for i in order),
                                  pool.map(lambda i: _member(lib, raw, i, spans[i.filename]), order)))
        else:
            arrays = {i.filename: _member(lib, raw, i, spans[i.filename]) for i in infos}
    except _NotHere:
        return None
    return {i.filename[: -len(".npy")]: arrays[i.filename] for i in infos}


def check_headers(raw) -> None:
    """Each .npy member's header claims no more bytes than the member holds (np.load makes
    the array a header claims before it reads the bytes that should fill it); ValueError.
    ``raw``: the .npz's bytes, or a binary file."""
    with zipfile.ZipFile(io.BytesIO(raw) if isinstance(raw, bytes) else raw) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            if int(np.prod(shape, dtype=object)) * dtype.itemsize > info.file_size:
                raise ValueError(f"member {info.filename!r}: its .npy header claims {shape} {dtype}, more than its "
                                 f"{info.file_size} bytes")


def _np_load_checked(raw: bytes, threads: int) -> dict[str, np.ndarray]:
    """np.load's reading of the members (where `load` does not apply), headers checked first."""
    check_headers(raw)
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        if threads > 1 and len(z.files) > 1:
            from concurrent.futures import ThreadPoolExecutor

            # members inflated side by side (zlib releases the GIL; ZipFile reads under its own lock)
            with ThreadPoolExecutor(min(threads, len(z.files))) as pool:
                return dict(zip(z.files, pool.map(z.__getitem__, z.files)))
        return {k: z[k] for k in z.files}


def read_npz(path: str | Path, *, max_bytes: int | None, threads: int = 1) -> dict[str, np.ndarray]:
    """``{name: array}`` of a chunk's ``.npz`` (the one reader of them: the top-K, compact and
    hidden-state stores'): a regular file, every member's claimed size within ``max_bytes``
    (the chunk's rows as the manifest declares them, StoreKind.chunk_bound) before anything is
    inflated; by libdeflate (`load`) where it applies, else by np.load with each .npy header
    checked against its member first. Raises ValueError/OSError/zipfile.BadZipFile/
    LogitdiffError (not a regular file, too large) for a damaged or hostile file."""
    got = load(path, threads, max_bytes=max_bytes)
    if got is not None:
        return got
    raw, _ = _read_checked(path, max_bytes)
    return _np_load_checked(raw, threads)
