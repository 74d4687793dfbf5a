"""A GGUF file's metadata as a source reads it: a handful of keys, read once per version of
the file (store.filecache.file_json_cached), and read by a parser of the key/value section
alone. ``gguf.GGUFReader`` builds a numpy view per array element and maps every tensor
before any key can be read: ~20 s per open of a 262,144-token file on the issue's machine,
50 s here under load (issue 40); this parser reads the same keys in well under a second.
A file it cannot read (version 1, big-endian, a type it does not know) is handed to
``gguf.GGUFReader`` as before, and so is its error.

``tokenizer_metadata_sha256`` says whether two files tokenize alike without loading either:
the sha256 of every key/value entry's raw bytes (key, type and value as stored), sorted by
key, except the entries a quantizer writes (`QUANTIZER_KEYS`). llama.cpp builds its
vocabulary from metadata alone (``tokenizer.*``, ``general.name``, ``general.architecture``,
``ARCH.vocab_size``: llama-vocab.cpp), transformers converts a GGUF's tokenizer and config from
metadata alone, and a source renders from ``tokenizer.chat_template`` and the special tokens:
so two files with the same digest give the same ids for every prompt, whichever renderer
reads them, and the preflight renders one of them (capture.preflight_tokenization). All
other keys are in the digest, not only those the renderers read today: a key a later
llama.cpp reads cannot make two different tokenizers look alike, at the cost of two files
differing in, say, ``general.license`` being rendered twice."""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path
from typing import Any

from ..errors import LogitdiffError

# The metadata keys a source reads (besides ARCH.context_length), each tokenizer.ggml.* id
METADATA_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "general.architecture", "general.name",
                 "general.file_type", "tokenizer.chat_template", "tokenizer.ggml.model",
                 *(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "eom", "pad", "unk")))

# What a quantizer (llama-quantize, logitdiff quantize) writes into a copy of the metadata:
# the file type, the quantization format version, imatrix provenance (quantize.imatrix.*).
# Nothing that builds a tokenizer reads them (llama-vocab.cpp; transformers' GGUF tokenizer
# conversion), so quants of one file share the tokenizer digest.
QUANTIZER_KEYS = ("general.file_type", "general.quantization_version")
QUANTIZER_PREFIX = "quantize."

# GGUF value types: struct format of the fixed-size ones; 8 = string, 9 = array
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Unreadable(Exception):
    """What this parser does not read (the caller falls back to gguf.GGUFReader)."""


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The metadata a source reads (`METADATA_KEYS`, and ``context_length`` of the file's
    architecture; None where absent), cached per version of the file."""
    import gguf

    from ..store.filecache import file_json_cached

    def read() -> dict[str, Any]:
        try:
            return read_keys(path)
        except _Unreadable:
            return _read_with_gguf(path)

    return file_json_cached(path, "gguf.metadata", {"gguf": getattr(gguf, "__version__", "unknown"), "parser": 3}, read,
                            valid=lambda v: isinstance(v, dict) and set(METADATA_KEYS) <= set(v) and isinstance(v.get("layout"), dict)
                            and "tokenizer_metadata_sha256" in v)


def _tokenizer_digest(entries: list[tuple[bytes, bytes]]) -> str:
    """``sha256:<hex>`` of the entries' digests (sha256 of each entry's raw bytes, key
    included), sorted by key, without the quantizer's keys (see the module doc)."""
    h = hashlib.sha256()
    for key, digest in sorted(entries):
        name = key.decode("utf-8", "replace")
        if name in QUANTIZER_KEYS or name.startswith(QUANTIZER_PREFIX):
            continue
        h.update(digest)
    return "sha256:" + h.hexdigest()


def read_keys(path: Path) -> dict[str, Any]:
    """`METADATA_KEYS` and ``context_length`` from the key/value section of a GGUF (v2/v3,
    little-endian). Strings that are not UTF-8 make their key None, as GGUFReader's
    ``contents()`` failing did."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if len(m) < 24 or m[:4] != b"GGUF":
            raise _Unreadable
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise _Unreadable
        found: dict[str, Any] = {}
        entries: list[tuple[bytes, bytes]] = []  # (key, sha256 of the entry's raw bytes): the tokenizer digest
        off = 24
        try:
            for _ in range(n_kv):
                start = off
                key, off = _string(m, off)
                (vtype,), off = struct.unpack_from("<I", m, off), off + 4
                name = key.decode("utf-8", "replace")
                want = name in METADATA_KEYS or name.endswith(_LAYOUT_SUFFIXES) or name == "general.alignment"
                value, off = _value(m, off, vtype, want)
                entries.append((key, hashlib.sha256(m[start:off]).digest()))
                if want:
                    found[name] = value
            tensors, off = _tensor_infos(m, off, n_tensors)
        except (struct.error, IndexError, ValueError):
            raise _Unreadable from None
    out = {key: found.get(key) for key in METADATA_KEYS}
    arch = out["general.architecture"]
    out["context_length"] = found.get(f"{arch}.context_length") if arch else None
    out["tokenizer_metadata_sha256"] = _tokenizer_digest(entries)
    align = found.get("general.alignment") or 32
    data_start = off + (-off) % int(align)
    tokens = out["tokenizer.ggml.tokens"]
    out["layout"] = {
        "architecture": arch,
        "block_count": found.get(f"{arch}.block_count") if arch else None,
        "embedding_length": found.get(f"{arch}.embedding_length") if arch else None,
        "vocab": len(tokens) if isinstance(tokens, list) else None,
        "tensors": [[name, shape, ttype, data_start + rel] for name, shape, ttype, rel in tensors],
    }
    return out


# the per-architecture keys the layout check reads (gguf_check.check_gguf_layout)
_LAYOUT_SUFFIXES = (".context_length", ".block_count", ".embedding_length")


def _tensor_infos(m: mmap.mmap, off: int, n_tensors: int) -> tuple[list, int]:
    """``[name, shape (ggml order), type id, offset in the data section]`` of each tensor."""
    out = []
    for _ in range(n_tensors):
        raw, off = _string(m, off)
        (n_dims,) = struct.unpack_from("<I", m, off)
        if n_dims > 8:
            raise ValueError("tensor with more than 8 dimensions")
        dims = list(struct.unpack_from(f"<{n_dims}Q", m, off + 4))
        ttype, rel = struct.unpack_from("<IQ", m, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        out.append([raw.decode("utf-8", "replace"), dims, ttype, rel])
    return out, off


def _string(m: mmap.mmap, off: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", m, off)
    end = off + 8 + n
    if end > len(m):
        raise ValueError("string past the end")
    return m[off + 8 : end], end


def _value(m: mmap.mmap, off: int, vtype: int, want: bool) -> tuple[Any, int]:
    """One value at ``off`` (decoded when ``want``) and the offset after it."""
    if vtype in _FIXED:
        fmt = "<" + _FIXED[vtype]
        return (struct.unpack_from(fmt, m, off)[0] if want else None), off + struct.calcsize(fmt)
    if vtype == _STRING:
        raw, off = _string(m, off)
        return (_text(raw) if want else None), off
    if vtype != _ARRAY:
        raise _Unreadable
    etype, count = struct.unpack_from("<IQ", m, off)
    off += 12
    if etype in _FIXED:
        size = struct.calcsize("<" + _FIXED[etype])
        end = off + size * count
        if end > len(m):
            raise ValueError("array past the end")
        return (list(struct.unpack_from(f"<{count}{_FIXED[etype]}", m, off)) if want else None), end
    if etype != _STRING:
        raise _Unreadable  # nested arrays: no key a source reads
    items: list[bytes] = []
    for _ in range(count):
        raw, off = _string(m, off)
        if want:
            items.append(raw)
    if not want:
        return None, off
    try:
        return [b.decode("utf-8") for b in items], off
    except UnicodeDecodeError:
        return None, off


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_with_gguf(path: Path) -> dict[str, Any]:
    """The same keys through ``gguf.GGUFReader`` (files `read_keys` does not read)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise LogitdiffError(f"{path}: not a readable GGUF file ({e})") from None

    def get(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # noqa: BLE001
            return None

    out = {key: get(key) for key in METADATA_KEYS}
    arch = out["general.architecture"]
    out["context_length"] = get(f"{arch}.context_length") if arch else None
    # the entries' bytes as stored (a big-endian file's differ from a little-endian copy's:
    # two digests, never a false match)
    out["tokenizer_metadata_sha256"] = _tokenizer_digest(
        [(f.parts[1].tobytes(), hashlib.sha256(b"".join(p.tobytes() for p in f.parts)).digest())
         for f in reader.fields.values() if not f.name.startswith("GGUF.")])
    from .gguf_check import layout_of_reader

    out["layout"] = layout_of_reader(reader)
    return out
