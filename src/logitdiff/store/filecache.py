"""Facts derived from a model's files, computed once per file version and kept in
``$LOGITDIFF_CACHE`` (default ``~/.cache/logitdiff``), so that opening a source a second
time costs what loading the model costs and nothing more.

At V = 248,320 a transformers source spent ~7 s before its first position on facts that
only change when a file changes: the sha256 of every weight file (its identity), the
texts of all V tokens (a RUN's ``vocab.json``) and the vocabulary's content hash.

* :func:`file_sha256_cached`: a file's sha256, keyed by (resolved path, size, mtime_ns, device,
  inode, ctime_ns) -- what ``git`` and ``make`` trust to say a file is unchanged. A file
  rewritten in place with the same size inside one mtime tick would be missed; ctime_ns
  (which user space cannot set back) narrows that to a rewrite within one ctime tick: on
  Linux >= 6.13 (multigrain timestamps: ext4, xfs, btrfs, tmpfs) a change after a stat
  always gets a new ctime, on older kernels the tick is one jiffy (1-10 ms).
* :func:`cached_json`: a JSON value computed from files, keyed by those files' sha256
  (via the cache above), the library versions that computed it and a name.
* :func:`file_fact_cached`: any short text computed from one file's bytes (e.g. the
  sha256 of a hidden-state run's output head as its manifest records it), keyed by the
  file's identity as above and a name: read once per version of the file.
* :func:`file_json_cached`: the same for a JSON value (a GGUF's tokenizer metadata: V
  token strings that ``gguf.GGUFReader`` took ~20 s to parse at V = 262,144, issue 40).
* :func:`json_cached`: a JSON value keyed by a JSON key that already names every input of
  the computation by content (a tokenizer's digest, a library version, the texts): llama.cpp's
  ids of a preflight's prompts, so that a later preflight loads no vocabulary.
* :func:`file_dir_cached`: the same for a value kept as files in a directory (transformers'
  tokenizer and config converted from a GGUF: ~17 s of an ``hf:FILE.gguf`` open for
  SmolLM2, issue 38), written whole under a temporary name and renamed into place.

Every entry is one small file written through a temporary name and a rename; an entry
that cannot be read is recomputed, and a cache directory that cannot be written is not an
error (the value is computed every time, as without a cache). ``LOGITDIFF_CACHE=off``
turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def cache_root() -> Path | None:
    env = os.environ.get("LOGITDIFF_CACHE")
    if env == "off":
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "logitdiff"


def _entry(kind: str, key: str) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    return root / kind / hashlib.sha256(key.encode()).hexdigest()[:40]


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write(path: Path | None, data: bytes) -> None:
    if path is None:
        return
    from ..errors import LogitdiffError
    from .files import atomic_write_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)  # removes its temporary on failure (a full disk leaves nothing)
    except (OSError, LogitdiffError):
        pass  # a read-only cache: compute again next time


def file_identity(path: str | os.PathLike) -> list:
    """What says a file is the version a fact was computed from: its resolved path, size,
    mtime_ns, inode, ctime_ns and device (see the module doc)."""
    p = Path(path).resolve()
    st = p.stat()
    return [str(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, st.st_dev]


def file_sha256(path, chunk: int = 1 << 22) -> str:
    """``"sha256:<hex>"`` of a file's bytes, read in ``chunk``-byte pieces."""
    from .files import open_input

    h = hashlib.sha256()
    # a regular file (a FIFO would hang, /dev/zero never end), read in pieces: no size bound
    with open_input(path, max_bytes=1 << 62) as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return "sha256:" + h.hexdigest()


def file_sha256_cached(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of a file, read once per version of the file (see the module doc)."""
    return file_fact_cached(path, "sha256", lambda: file_sha256(Path(path).resolve()),
                            valid=lambda t: t.startswith("sha256:") and len(t) == 71)


def file_fact_cached(path: str | os.PathLike, name: str, compute: Callable[[], str],
                     valid: Callable[[str], bool] = bool, ident: list | None = None) -> str:
    """``compute()`` (a short ASCII text computed from the bytes of the file ``path``), or
    its cached copy for this version of the file (`file_identity`) and ``name``; an entry
    that ``valid`` refuses is recomputed. The value is kept only when the file's identity
    is the same after ``compute`` as before it (a file changed while it was read is read
    again next time). ``ident``: the identity the caller took when it opened the bytes
    ``compute`` reads (a memory map), so that a file replaced since cannot lend that
    version its key; default: taken now."""
    ident = file_identity(path) if ident is None else ident
    entry = _entry(name, json.dumps(ident))
    got = _read(entry)
    if got is not None:
        try:
            text = got.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if valid(text):
            return text
    value = compute()
    if file_identity(path) == ident:
        _write(entry, value.encode("ascii"))
    return value


def file_json_cached(path: str | os.PathLike, name: str, versions: dict, compute: Callable[[], object],
                     valid: Callable[[object], bool] = lambda v: True):
    """``compute()`` (a JSON value computed from the file ``path``), or its cached copy for
    this version of the file (`file_identity`, no read of its bytes: a GGUF's metadata is
    the point, and hashing the file would cost what reading it costs), ``name`` and
    ``versions`` (the libraries that computed it); an entry that ``valid`` refuses is
    recomputed, and a value is kept only when the file's identity is the same after
    ``compute`` as before it."""
    ident = file_identity(path)
    entry = _entry(name, json.dumps([ident, sorted(versions.items())]))
    cached = _read_json(entry, valid)
    if cached is not None:
        return cached
    value = compute()
    if file_identity(path) == ident:
        _write(entry, json.dumps(value).encode())  # ASCII: lone surrogates survive as escapes
    return value


def _read_json(entry: Path | None, valid: Callable[[object], bool]) -> object | None:
    """The JSON value an entry holds when it parses and ``valid`` accepts it, else None."""
    got = _read(entry)
    if got is None:
        return None
    try:
        value = json.loads(got)
    except ValueError:
        return None
    return value if value is not None and valid(value) else None


def json_cached(name: str, key: object, compute: Callable[[], object], valid: Callable[[object], bool] = lambda v: True):
    """``compute()`` (a JSON value), or its cached copy for ``name`` and ``key`` (a JSON value
    that must name every input of ``compute`` by content: nothing else keys the entry); an
    entry that ``valid`` refuses is recomputed."""
    entry = _entry(name, json.dumps(key, sort_keys=True))
    cached = _read_json(entry, valid)
    if cached is not None:
        return cached
    value = compute()
    _write(entry, json.dumps(value).encode())
    return value


def cached_json(name: str, files: Sequence[str | os.PathLike], versions: dict, compute: Callable[[], object]):
    """``compute()`` (a JSON value), or its cached copy when ``files`` (their contents),
    ``versions`` and ``name`` are those it was computed from."""
    key = json.dumps([name, sorted(versions.items()),
                      [(Path(f).name, file_sha256_cached(f)) for f in files if Path(f).is_file()]])
    entry = _entry("derived", key)
    got = _read(entry)
    if got is not None:
        try:
            return json.loads(got)
        except ValueError:
            pass
    value = compute()
    _write(entry, json.dumps(value).encode())  # ASCII: lone surrogates survive as escapes
    return value


def file_dir_cached(path: str | os.PathLike, name: str, versions: dict, compute: Callable[[], T],
                    save: Callable[[T, Path], bool], load: Callable[[Path], T]) -> T:
    """``compute()``, or ``load(DIR)`` of its cached copy for this version of the file
    ``path`` (`file_identity`: no read of its bytes), ``name`` and ``versions`` (the libraries
    that computed it). On a miss the value is computed and ``save(value, DIR)`` writes it into
    a new directory, which is kept only when ``save`` returns True (it may refuse: a value
    whose copy does not load back the same) and the file's identity is the same after
    ``compute`` as before it; the directory is renamed into place whole, so a reader sees a
    complete entry or none. An entry that ``load`` fails on is computed again and replaced."""
    from .files import remove_tree

    ident = file_identity(path)
    entry = _entry(name, json.dumps([ident, sorted(versions.items())]))
    if entry is not None and entry.is_dir():
        try:
            return load(entry)
        except Exception:  # noqa: BLE001 - a damaged entry (any loader's error): computed again
            pass
    value = compute()
    if entry is None or file_identity(path) != ident:
        return value
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        if not save(value, tmp):
            return value
        if entry.is_dir():  # the damaged entry, moved aside before the new one takes its name
            old = entry.with_name(f".{entry.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(entry, old)
            remove_tree(old)
        os.rename(tmp, entry)  # fails if another process put its entry there first: keep that one
    except Exception:  # noqa: BLE001 - a read-only cache, a writer's error: the value stands, computed again next time
        pass
    finally:
        if tmp.exists():
            remove_tree(tmp)
    return value
