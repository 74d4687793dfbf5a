"""The members of an ``.npz`` file (``np.savez_compressed``'s zip of ``.npy`` files), each
inflated by libdeflate where the system has it (issue 28: a compact reference's chunk is
deflated; zlib's inflate was ~10 % of a compare against it, libdeflate's takes ~2/3 of its
instructions and checks the CRC-32 in a fraction of zlib's time).

`load` returns None where it cannot read the file this way (no libdeflate, a member stored
with another method, encrypted, or a layout it does not know): the caller reads the file
with ``np.load`` as before, so a file is never refused here that ``np.load`` would read.
What it does refuse (ValueError) is what ``np.load`` also refuses: a member whose bytes do
not inflate, do not match the CRC-32 of the zip directory, or hold no plain ``.npy`` array.
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


def _member(lib, raw: memoryview, info: zipfile.ZipInfo) -> np.ndarray:
    """One member's ``.npy`` array, inflated into a fresh buffer that the array views."""
    off = info.header_offset
    if bytes(raw[off : off + 4]) != b"PK\x03\x04":
        raise ValueError(f"member {info.filename!r}: no local header at offset {off}")
    name_len, extra_len = struct.unpack("<HH", raw[off + 26 : off + 30])
    start = off + 30 + name_len + extra_len
    data = raw[start : start + info.compress_size]
    if len(data) != info.compress_size:
        raise ValueError(f"member {info.filename!r}: truncated")
    out = np.empty(info.file_size, np.uint8)
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
    f = io.BytesIO(out[:4096].tobytes())  # the .npy header (np.lib.format: magic, then a dict)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"member {info.filename!r}: .npy version {version} not read here")
    if dtype.hasobject:
        raise ValueError(f"member {info.filename!r}: object arrays are not read (pickles)")
    count = int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(out, dtype, count=count, offset=f.tell())
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


def load(path: str | Path, threads: int = 4) -> dict[str, np.ndarray] | None:
    """``{name: array}`` of an ``.npz`` file (names without ``.npy``), members inflated by
    libdeflate, ``threads`` at once; None where this reader does not apply (see module doc).
    Raises ValueError/OSError/zipfile.BadZipFile for a damaged file, as ``np.load`` does."""
    lib = _lib()
    if lib is None:
        return None
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    if any(i.compress_type not in (zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED) or i.flag_bits & 0x1
           or not i.filename.endswith(".npy") for i in infos):
        return None
    raw = memoryview(Path(path).read_bytes())
    if threads > 1 and len(infos) > 1:
        from concurrent.futures import ThreadPoolExecutor

        # the largest members first: the band's ids and codes are most of a compact chunk
        order = sorted(infos, key=lambda i: -i.file_size)
        with ThreadPoolExecutor(min(threads, len(infos))) as pool:
            arrays = dict(zip((i.filename for i in order), pool.map(lambda i: _member(lib, raw, i), order)))
    else:
        arrays = {i.filename: _member(lib, raw, i) for i in infos}
    return {i.filename[: -len(".npy")]: arrays[i.filename] for i in infos}
