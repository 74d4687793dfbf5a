"""Stage *store*: the RUN format — manifest, writer, reader and resume (this module), the store
kinds and their codecs (`kinds/`, `compact`, `hidden`, `npzinflate`), durable file I/O and
path safety (`files`), the file-identity cache (`filecache`), row buffers (`rowpool`), array
checks (`validate`), the tokenizer identity of a RUN (`tokenizer_identity`) and importers of
other tools' files (`importers`). Imports `numerics` and the base modules only.

RUN directories: a capture's manifest, items and per-position distributions.

Layout::

    RUN/
      manifest.json          schema, tool version, source, tokenizer hash, vocab size,
                             settings, status (partial|complete), list of finished chunks
      vocab.json             optional: printable text of every token id (for reports)
      tokens.json            optional: the token strings tokenizer_hash is of (tokenizer_identity.py)
      chunks/000000.items.jsonl   the items of chunk 0: id, tags, prompt, prompt_ids,
                                  teacher_ids, positions (scored output positions), row
      chunks/000000.logits.npy    full logits [rows, V] in native dtype (bf16 as uint16)
      chunks/000000.topk.npz      or top-K: ids, logprobs, logsumexp, tail_mass, entropy
                                  (or compact.npz, hidden.npz: one file per chunk in the
                                  form of the run's store kind, storekinds/)

Every file of a chunk is written to a temporary name and renamed; once the chunk's files
are fsynced, the manifest (which lists finished chunks) is rewritten atomically to list it.
A killed capture leaves only whole chunks listed, each fsynced before it was listed, and
``RunWriter(resume=True)`` continues after them (files of chunks never listed are removed,
and so are the rows of the item the kill interrupted: its start, in listed chunks).
Row r of a chunk is the distribution that predicts ``teacher_ids[positions[j]]`` of the
item whose rows it holds.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
import weakref
import zipfile
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar, cast

import numpy as np

from .._version import __version__
from . import validate
from ..errors import LogitdiffError
from ..contracts import RUN_SCHEMA
from .files import Kind, atomic_file_unsynced, atomic_write_bytes, atomic_write_json, check_output, fsync_path, held_key, locked
from .files import DOCUMENT_MAX_BYTES, input_stat, read_input_bytes, read_input_json
if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
from .kinds import BlockPlace, RowsForm, StoreKind, check_full_rows, cut_rows, store_kind
# the full-row helpers, defined with the store kinds; imported from here by the rest of the package
from .kinds.rows import DTYPES as _DTYPES, atomic_save_npy_rows, bf16_to_f32, f32_to_bf16  # noqa: F401

# A RUN keeps a copy of every tools module its items name, here (so a RUN is portable).
TOOLS_DIR = "tools"

# Keys of a source's identity that may change between a capture and its --resume without
# changing the numbers (parallelism, which replicas serve the same model); every other
# identity key (weight hashes, dtype, quant, versions, device) must match.
RESUME_FREE_IDENTITY = ("threads", "endpoints", "extra_bufts", "total_slots")

# The one chunk-size knob (``--chunk-size``): the bytes of distribution rows a writer
# buffers before it writes a chunk, a source hands out per block, and a reader or the
# metrics take per batch. Memory of every streaming path is a small multiple of it,
# whatever the output length or the vocabulary (at V = 248,320 float32: 67 rows).
DEFAULT_CHUNK_BYTES = 64 << 20
# The output rows one forward pass of an in-process source may produce, in chunks (they are
# handed out a chunk at a time): one llama.cpp decode then covers a scored span of up to this
# many chunks instead of being cut into decodes of one chunk (smaller batches, slower), at the
# cost of the engine's output buffer holding that many chunks.
FORWARD_CHUNKS = 4
MAX_CHUNK_BYTES = 1 << 40
TOKENS_FILE = "tokens.json"
# The most bytes per token a RUN's vocab.json / tokens.json hold (the manifest declares V):
# a token's text JSON-escaped is at most 12 bytes per character (a surrogate pair), and the
# longest tokens of real vocabularies are a few hundred characters (runs of spaces or dashes).
TOKEN_TEXT_MAX_BYTES = 4096


def token_texts_bound(vocab_size: int) -> int:
    """The size bound of a RUN's list of V token texts (TOKEN_TEXT_MAX_BYTES each, 1 MiB beside)."""
    return int(vocab_size) * TOKEN_TEXT_MAX_BYTES + (1 << 20)
# Chunks a RunWriter may have written but not yet made durable and listed in the manifest
# (the syncer's lag behind the writer): what the disk may owe when the producer waits, and
# what a SIGKILL or a crash can cost a --resume on top of the chunk being written.
SYNC_LAG = 4


def parse_chunk_size(text: str | int | None) -> int:
    """``"64MiB"``, ``"256MB"``, ``"1GiB"``, ``"1048576"`` -> bytes (>= 1 MiB)."""
    if text is None:
        return DEFAULT_CHUNK_BYTES
    if isinstance(text, int):
        n = text
    else:
        t = str(text).strip().lower().replace(" ", "")
        units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1, "": 1}
        num = t.rstrip("kmgib")
        unit = t[len(num):]
        try:
            n = int(float(num) * units[unit])
        except (ValueError, KeyError, OverflowError):  # OverflowError: 1e400 is inf
            raise LogitdiffError(f"--chunk-size {text!r}: expected bytes with an optional unit, e.g. 64MiB or 1GiB") from None
    if isinstance(n, bool) or not isinstance(n, int):
        raise LogitdiffError(f"--chunk-size {text!r}: expected bytes with an optional unit, e.g. 64MiB or 1GiB")
    if n < (1 << 20):
        raise LogitdiffError(f"--chunk-size {text!r}: must be at least 1MiB")
    if n > MAX_CHUNK_BYTES:
        raise LogitdiffError(f"--chunk-size {text!r}: at most 1TiB (memory is a small multiple of it)")
    return n


CHUNK_SIZE_HELP = (
    "bytes of distribution rows per chunk, e.g. 64MiB or 1GiB: what is written per chunk file and held per "
    "block while streaming; memory is a small multiple of it, not of an output's length (default: 64MiB)"
)


def rows_per_block(vocab_size: int, chunk_bytes: int | None = None, bytes_per_value: int = 4) -> int:
    """Rows of ``vocab_size`` values of ``bytes_per_value`` bytes that fit a chunk (>= 1)."""
    return max(1, int((chunk_bytes or DEFAULT_CHUNK_BYTES) // max(1, int(vocab_size) * bytes_per_value)))


@dataclass
class RunItem:
    """One captured item: its prompt, teacher sequence and which output positions were scored."""

    id: str
    prompt_ids: list[int]
    teacher_ids: list[int]
    positions: list[int]
    tags: list[str] = field(default_factory=list)
    prompt: object = None  # text or messages, for reports
    extra: dict = field(default_factory=dict)
    chunk: int = -1  # chunk holding the item's first row (its rows may run on into the next chunks)
    row: int = -1  # first row of this item in that chunk

    @property
    def next_tokens(self) -> np.ndarray:
        """Teacher-forced token at each scored position (what row j predicts)."""
        t = np.asarray(self.teacher_ids, dtype=np.int64)
        return t[np.asarray(self.positions, dtype=np.int64)] if len(self.positions) else t[:0]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "tags": self.tags,
            "prompt": self.prompt,
            "prompt_ids": [int(x) for x in self.prompt_ids],
            "teacher_ids": [int(x) for x in self.teacher_ids],
            "positions": [int(x) for x in self.positions],
            "row": self.row,
            **({"extra": self.extra} if self.extra else {}),
        }

    def to_json_in(self, file_chunk: int) -> dict:
        """``to_json`` for the items file of chunk ``file_chunk`` (the chunk where the item's
        rows end); ``chunk`` names where they start when that is an earlier chunk."""
        d = self.to_json()
        if self.chunk != file_chunk:
            d["chunk"] = self.chunk
        return d

    @classmethod
    def from_json(cls, d: dict, chunk: int) -> "RunItem":
        return cls(
            id=d["id"],
            prompt_ids=d["prompt_ids"],
            teacher_ids=d["teacher_ids"],
            positions=d["positions"],
            tags=d.get("tags") or [],
            prompt=d.get("prompt"),
            extra=d.get("extra") or {},
            chunk=int(d.get("chunk", chunk)),
            row=d["row"],
        )


class ResumeMismatch(LogitdiffError):
    """``--resume`` asked to continue a run captured with something else."""


# settings that name a file whose bytes another setting hashes: --resume compares the hash
# (a workload is its bytes; a teacher RUN stays named by its path, see capture_candidate)
BY_HASH = {"workload": "workload_sha256"}


def resume_difference(old: dict, new: dict) -> tuple[str, object, object] | None:
    """First field in which a RUN's manifest differs from what a resumed capture would
    write: vocabulary, tokenizer, source spec, model identity, then every setting
    (store, dtype, workload hash, max_tokens, positions, teacher...)."""
    def pairs():
        for k in ("vocab_size", "tokenizer_hash"):
            yield k, old.get(k), new.get(k)
        yield "source.spec", (old.get("source") or {}).get("spec"), (new.get("source") or {}).get("spec")
        oi, ni = (old.get("source") or {}).get("identity") or {}, (new.get("source") or {}).get("identity") or {}
        for k in sorted(set(oi) | set(ni)):
            if k not in RESUME_FREE_IDENTITY:
                yield f"source.identity.{k}", oi.get(k), ni.get(k)
        os_, ns = old.get("settings") or {}, new.get("settings") or {}
        # store first: a top-K run also differs in dtype, but the store is what was asked
        for k in sorted(set(os_) | set(ns), key=lambda k: (k != "store", k)):
            h = BY_HASH.get(k)
            if h and os_.get(h) is not None:
                if os_.get(h) == ns.get(h):
                    continue  # the same bytes under another path: the same capture
                yield f"settings.{h}", os_.get(h), ns.get(h)  # other bytes: say so, not the path
            yield f"settings.{k}", os_.get(k), ns.get(k)

    for name, a, b in pairs():
        # JSON round trip: the stored manifest went through it (tuples became lists)
        if json.loads(json.dumps(a, default=str)) != json.loads(json.dumps(b, default=str)):
            return name, a, b
    return None


def first_difference(a, b) -> int:
    """Index of the first position where two id sequences differ (len of the shorter if one is a prefix)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _short(x, limit: int = 80) -> str:
    text = json.dumps(x, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_Init = TypeVar("_Init", bound=Callable[..., None])


def _unlocked_on_error(init: _Init) -> _Init:
    """A RunWriter whose constructor fails lets go of the RUN's lock at once."""

    def wrapper(self: RunWriter, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if "_lock" in vars(self):
                self._lock.close()
            raise

    wrapper.__doc__, wrapper.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
    return cast(_Init, wrapper)


# The RunWriters of this process not yet finished or closed, by the RUN's real path. The
# RUN's lock cannot refuse a second writer in the thread that holds it (it is re-entrant per
# thread: `outputs.writing` holds it and the writer opened on its path takes it again), so
# the constructor refuses while one is listed here. Weak: a writer abandoned without close()
# (a crash the caller survived) and collected as garbage no longer counts, and resume goes on.
_LIVE_WRITERS: weakref.WeakValueDictionary[str, RunWriter] = weakref.WeakValueDictionary()


def _refuse_second_live_writer(key: str, path: Path) -> None:
    if key not in _LIVE_WRITERS:
        return
    gc.collect()  # one abandoned in a reference cycle is garbage the collector has not reached yet
    if key in _LIVE_WRITERS:
        raise LogitdiffError(
            f"{path}: a RunWriter of this run is open in this thread; finish() or close() it before opening another")


class RunWriter:
    """Writes a RUN chunk by chunk. ``store`` is the run's store kind (``kinds.StoreKind``, as
    ``kinds.store_kind`` parsed it once; bound here to the run's vocabulary and dtype) or a
    ``--store`` text: ``"full"``, ``"topk:K"``, a compact spec (compact.py), ``"hidden"``
    (hidden.py: pass the output head as ``head``) or any kind registered in
    kinds.STORE_KINDS, which encodes, writes and reads its rows.

    Rows stream in: ``begin_item(item)``, then ``add_rows(logits)`` (a source's full rows
    ``[r, V]``, float or, for ``dtype="bfloat16"``, bf16 bits as uint16; the kind encodes
    them), ``add_topk(ids, logprobs)`` (a top-K source's rows) or ``add_rows(stored=block)``
    (rows already in the kind's stored form, e.g. for a top-K run a dict of ids, logprobs,
    logsumexp, tail_mass, entropy) as often as the source hands out blocks, then ``end_item()``;
    ``add(item, ...)`` does all three for a whole item. Each block goes to the writer
    thread as it comes, into the current chunk's file (``StoreKind.open_chunk``: full rows
    are written at once, other kinds keep them until the chunk closes); a chunk closes once
    ``chunk_bytes`` of rows are in it (or ``chunk_rows`` rows, when given) — also in the
    middle of an item, whose rows then run on into the next chunk. An item is listed in the
    items file of the chunk where its rows end, so a killed capture leaves no half item
    behind. ``finish()`` marks the run complete. Memory: the blocks of the chunk being
    filled (kinds that keep them) plus at most ``chunk_bytes`` of blocks queued for the writer.

    One writer per RUN: the constructor takes the RUN's lock (``outputs.locked``, the one
    ``logitdiff capture`` takes; a writer opened inside ``outputs.writing`` re-enters it) and
    holds it until ``finish()`` or ``close()``; another process's writer is refused at once,
    naming this one's pid (two writers with ``resume=True`` would remove each other's unlisted
    chunks), and so is a second writer of the RUN in this one's own thread while this one is
    neither finished, closed nor garbage (``_LIVE_WRITERS``).
    """

    @_unlocked_on_error
    def __init__(
        self,
        path: str | Path,
        *,
        source: dict,
        vocab_size: int,
        tokenizer_hash: str | None,
        store: str | StoreKind = "full",
        dtype: str = "float32",
        settings: dict | None = None,
        chunk_rows: int | None = None,
        chunk_bytes: int | None = None,
        resume: bool = False,
        overwrite: bool = False,
        vocab: list[str] | None = None,
        head: np.ndarray | None = None,
        tokens: list[str | None] | None = None,
    ):
        self.path = Path(path)
        self._take_lock(overwrite, resume)
        self.kind: StoreKind = (store.bound(int(vocab_size), dtype) if isinstance(store, StoreKind)
                                else store_kind(store, int(vocab_size), dtype))
        self.store = self.kind.text
        kind_fields = self.kind.start_writing(head)  # checks that the source fits the kind
        self.dtype = dtype
        self.vocab_size = int(vocab_size)
        self.row_bytes = self.kind.row_bytes
        self.chunk_bytes = int(chunk_bytes or DEFAULT_CHUNK_BYTES)
        self.chunk_rows = int(chunk_rows) if chunk_rows else max(1, self.chunk_bytes // max(1, self.row_bytes))
        self._buf_items: list[RunItem] = []
        self._nrows = 0  # rows handed to the writer for the chunk being filled
        self._cur: RunItem | None = None
        self._cur_rows = 0
        self._init_write_queue()
        self._kept_tools: dict[str, dict] = {}  # tools module path -> its copy in the RUN
        fresh = self._fresh_manifest(source, tokenizer_hash, settings, kind_fields)
        mpath = self.path / "manifest.json"
        if mpath.exists() and resume:
            self._resume_from(mpath, fresh, kind_fields)
        else:
            self._start_new(mpath, fresh, overwrite, resume)
        # a new run writes these; a resumed one only when a kill came before them
        fresh_start = self.manifest is fresh
        self._send_side_files(fresh_start, vocab, tokens)
        self.kind.write_files(self.path, fresh_start)
        self._next_chunk = len(self.manifest["chunks"])
        _LIVE_WRITERS[self._key] = self  # the last step: a constructor that fails leaves no entry

    def _take_lock(self, overwrite: bool, resume: bool) -> None:
        """The RUN's lock (held until finish() or close()), refused while another writer of the
        RUN lives in this process."""
        if not self.path.parent.is_dir():  # the lock file lives beside the RUN
            check_output(self.path, Kind.RUN, overwrite=overwrite, resume=resume)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LogitdiffError(f"{self.path}: cannot create its directory ({e.strerror})") from None
        self._lock = ExitStack()  # closed by finish() / close()
        self._lock.enter_context(locked(self.path))
        self._key = held_key(self.path)
        _refuse_second_live_writer(self._key, self.path)

    def _init_write_queue(self) -> None:
        """The writer thread's and the syncer's state.

        Blocks are written by one background thread, in order, into the chunk's file as
        they come (the full store streams them to the disk while the caller computes the
        next rows: after the last forward only the last block is left to write, not a
        whole chunk); a producer faster than the disk waits once chunk_bytes of blocks are
        queued rather than piling them up in memory. The files are written whole
        (temporary + rename) but not fsynced by that thread: a second thread (the syncer)
        fsyncs each chunk's files and only then lists the chunk in the manifest, so the
        manifest still names only durable chunks and a kill or a crash leaves whole chunks
        behind, while the disk's flushes do not hold up the writer (at V = 248,320 the
        producer's wait on a writer that fsynced each 64 MiB chunk fell ~10x, bench/RESULTS.md
        issue 24). The syncer may trail the writer by at most SYNC_LAG chunks (written, not listed)."""
        self._pool: ThreadPoolExecutor | None = None
        self._syncer: ThreadPoolExecutor | None = None
        self._pending: deque = deque()  # the writer's futures with the bytes of their blocks, in order
        self._queued = 0  # bytes of the blocks in _pending
        self._syncing: list = []  # the syncer's futures, in chunk order
        self._sync_failed = False  # a chunk failed to become durable: no later chunk is listed
        self._chunk_file: Any = None  # the writer thread's: the chunk being filled (kind.open_chunk)
        self._write_failed = False  # the writer thread's: a block was not written, write nothing more

    def _fresh_manifest(self, source: dict, tokenizer_hash: str | None, settings: dict | None, kind_fields: dict) -> dict:
        """The manifest of a new run (a resumed run's must match it: ``resume_difference``)."""
        return {
            "schema": RUN_SCHEMA,
            "tool": "logitdiff",
            "tool_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "status": "partial",
            "source": source,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": tokenizer_hash,
            "settings": {**(settings or {}), "store": self.store, "dtype": self.kind.manifest_dtype()},
            "chunks": [],
            "n_items": 0,
            "n_positions": 0,
            **kind_fields,
        }

    def _resume_from(self, mpath: Path, fresh: dict, kind_fields: dict) -> None:
        """Resume: the run's manifest, checked against what this capture would write (a
        one-line ResumeMismatch naming the first field that differs); what a kill left
        unlisted or half-listed removed."""
        self.manifest = read_manifest(mpath)
        try:
            check_chunk_entries(self.manifest.get("chunks"), mpath)
        except (KeyError, TypeError, ValueError, LogitdiffError) as e:
            raise LogitdiffError(f"{mpath}: cannot resume, field {str(e).strip(chr(39))!r} malformed") from None
        if self.manifest.get("schema") != RUN_SCHEMA:
            raise LogitdiffError(f"{mpath}: schema {self.manifest.get('schema')!r}, expected {RUN_SCHEMA}")
        diff = resume_difference(self.manifest, fresh)
        for key in kind_fields:  # what the kind adds (the hidden store's head) must match too
            if diff is None and self.manifest.get(key) != fresh[key]:
                diff = (key, self.manifest.get(key), fresh[key])
        if diff is not None:
            name, have, want = diff
            raise ResumeMismatch(
                f"{mpath}: cannot resume, field {name!r} is {_short(have)} in the run but {_short(want)} now "
                "(resume with the run's own settings, or --overwrite to start again)"
            )
        self.manifest["status"] = "partial"
        # A kill during a background chunk write leaves its temporary file behind; the
        # manifest never listed it, so it is garbage: remove it before writing again.
        for stale in (self.path / "chunks").glob(".*.tmp*"):
            stale.unlink(missing_ok=True)
        self._drop_orphan_rows()
        self._remove_unlisted_files()

    def _start_new(self, mpath: Path, fresh: dict, overwrite: bool, resume: bool) -> None:
        """A new run (or one replaced, or a resume that finds no manifest): the directory
        checked and cleared of what an earlier capture or a kill left, then the manifest."""
        if mpath.exists() and not overwrite:
            raise LogitdiffError(f"{self.path}: already holds a run (use --resume to continue it or --overwrite)")
        # Library callers too: never clear or fill a directory that is not a RUN.
        check_output(self.path, Kind.RUN, overwrite=overwrite, resume=resume)
        (self.path / "chunks").mkdir(parents=True, exist_ok=True)
        if overwrite or resume:  # resume without a manifest: a capture killed before it
            for f in (self.path / "chunks").iterdir():
                _unlink_any(f)
            for f in self.path.iterdir():  # write temporaries (.NAME.tmpPID) a kill left
                if f.is_file() and f.name.startswith(".") and f.name.rpartition(".tmp")[2].isdigit():
                    f.unlink()
        self.manifest = fresh
        # the manifest first: from here on a killed capture is a RUN that --resume continues
        self._write_manifest()

    def _send_side_files(self, fresh_start: bool, vocab: list[str] | None, tokens: list[str | None] | None) -> None:
        """vocab.json and tokens.json, by the writer thread before any chunk (so durable before
        the manifest lists one): encoding V strings twice, ~0.06 CPU s at V = 248,320, runs
        beside the caller's first forward instead of before it."""
        side: list[tuple[str, list]] = []
        if vocab is not None and (fresh_start or not (self.path / "vocab.json").exists()):
            side.append(("vocab.json", vocab))
        if tokens is not None and (fresh_start or not (self.path / TOKENS_FILE).exists()):
            side.append((TOKENS_FILE, list(tokens)))  # the strings tokenizer_hash is of (tokenizer_identity.py)
        if side:
            self._send(0, self._write_side_files, side)

    def _drop_orphan_rows(self) -> None:
        """Resume: the rows of the item a kill interrupted, in listed chunks that no listed
        item covers (an item is listed in the chunk where its rows end; its earlier chunks
        were listed as they filled), are dropped: the resumed capture writes that item again
        from its start, so they would only take space, a chunk's worth per kill. Chunks past
        the last one that lists an item go from the manifest; that chunk, when rows follow
        its last item's, is rewritten cut after them under a new name. Crash-safe: the cut
        copy is durable before the manifest (written atomically) names it, and the files the
        manifest stopped naming are removed only after it (else by the next resume)."""
        chunks = self.manifest["chunks"]
        last, end = -1, 0  # the last chunk that lists an item; the rows its items cover
        for e in reversed(chunks):
            p = self.path / "chunks" / e["items"]
            try:
                raw = read_input_bytes(p, max_bytes=DOCUMENT_MAX_BYTES, inside=self.path)
            except LogitdiffError as err:
                raise LogitdiffError(f"cannot resume, unreadable chunk items: {err}") from None
            lines = [(n, ln) for n, ln in enumerate(raw.split(b"\n"), 1) if ln.strip()]
            if lines:
                last = e["index"]
                it = _parse_item_line(p, *lines[-1], last)
                # its rows run from (it.chunk, it.row) to here; every chunk between holds only its rows
                end = it.row + len(it.positions) - sum(c["rows"] for c in chunks[it.chunk:last])
                break
        if last >= 0 and not (0 <= end <= chunks[last]["rows"]):
            return  # entries that do not add up: a damaged run, left as it is (a reader names the fault)
        keep = [dict(c) for c in chunks[: last + 1]]
        if last >= 0 and end < keep[-1]["rows"]:
            entry = keep[-1]
            src = self.path / "chunks" / entry["data"]
            try:
                input_stat(src, max_bytes=1 << 62, inside=self.path)  # a regular file of the RUN; the kind bounds its size
                block = self.kind.load_chunk(src, lambda r: f"{src} row {r}", max_bytes=self.kind.chunk_bound(entry["rows"]))
            except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as err:
                raise LogitdiffError(f"{src}: cannot resume, unreadable chunk ({err})") from None
            entry["data"] = f"{last:06d}.cut{end}.{self.kind.chunk_suffix}"
            dest = self.path / "chunks" / entry["data"]
            # end 0: the chunk's rows are all the killed item's (its listed items have none)
            self.kind.save_chunk(dest, [self.kind.cut_stored(block, 0, end)] if end else [])
            del block  # a memory-mapped chunk is let go before its file is removed
            entry["rows"] = end
            fsync_path(dest)
            fsync_path(dest.parent)
        if keep == chunks:
            return
        self.manifest["chunks"] = keep
        self._write_manifest()

    def _remove_unlisted_files(self) -> None:
        """Resume: chunk files no manifest entry names (written, not yet durable when the
        kill came; cut or dropped by :meth:`_drop_orphan_rows`): the resumed capture writes
        the indices past the listed ones again; remove any it may not reach."""
        chunks = self.manifest["chunks"]
        for f in (self.path / "chunks").iterdir():
            stem = f.name.split(".", 1)[0]
            if not (stem.isdigit() and len(stem) == 6 and f.is_file()):
                continue
            i = int(stem)
            if i >= len(chunks) or f.name not in (chunks[i]["items"], chunks[i]["data"]):
                f.unlink(missing_ok=True)

    # -------------------------------------------------------------------------------
    def done_ids(self) -> set[str]:
        """Ids of the items already on disk (for resuming)."""
        ids: set[str] = set()
        for c in self.manifest["chunks"]:
            p = self.path / "chunks" / c["items"]
            try:
                lines = read_input_bytes(p, max_bytes=DOCUMENT_MAX_BYTES, inside=self.path).split(b"\n")
            except LogitdiffError as e:
                raise LogitdiffError(f"cannot resume, unreadable chunk items: {e}") from None
            ids.update(_parse_item_line(p, n, line, c["index"]).id for n, line in enumerate(lines, 1) if line.strip())
        return ids

    def add(self, item: RunItem, logits=None, hidden=None, *, stored=None) -> None:
        """A whole item: ``begin_item`` + ``add_rows`` + ``end_item``."""
        self.begin_item(item)
        self.add_rows(logits, hidden, stored=stored)
        self.end_item()

    def begin_item(self, item: RunItem) -> None:
        if self._cur is not None:
            raise ValueError(f"item {self._cur.id!r} is not finished (end_item)")
        self._raise_failed()
        item.chunk, item.row = self._next_chunk, self._nrows
        wl_item = item.extra.get("item") if isinstance(item.extra, dict) else None
        if isinstance(wl_item, dict) and wl_item.get("tools_module"):
            item.extra = {**item.extra, "item": {**wl_item, **self._keep_tools_module(wl_item["tools_module"], item.id)}}
        self._cur, self._cur_rows = item, 0

    def _keep_tools_module(self, path: str, item_id: str) -> dict:
        """A copy of an item's tools module inside the RUN (``tools/<sha256[:16]>-<name>``),
        so that a RUN moved to another machine still executes its tool calls; the item names
        it by that RUN-relative path and its hash (checked on read)."""
        if path in self._kept_tools:  # items of one workload mostly share one module
            return self._kept_tools[path]
        src = Path(path)
        try:
            data = read_input_bytes(src, max_bytes=DOCUMENT_MAX_BYTES)
        except LogitdiffError as e:
            raise LogitdiffError(f"item {item_id!r}: field 'tools_module': {e}") from None
        digest = hashlib.sha256(data).hexdigest()
        name = src.name.removeprefix(f"{digest[:16]}-")  # a teacher RUN's copy keeps its name
        rel = f"{TOOLS_DIR}/{digest[:16]}-{name}"
        dest = self.path / rel
        if not dest.is_file():
            dest.parent.mkdir(exist_ok=True)
            atomic_write_bytes(dest, data)
        self._kept_tools[path] = {"tools_module": rel, "tools_module_sha256": digest}
        return self._kept_tools[path]

    def add_rows(self, logits=None, hidden=None, *, stored=None) -> None:
        """The next rows of the current item (its positions in order): a source's full rows
        ``logits`` (checked, then encoded by the store kind; ``hidden``: their hidden states,
        for a kind that keeps them), or rows already in the kind's stored form (``stored``)."""
        item = self._cur
        if item is None:
            raise ValueError("add_rows outside begin_item/end_item")
        place = BlockPlace(item.id, item.positions, item.teacher_ids, self._cur_rows)
        if stored is not None:
            block, n = self.kind.check_block(stored, place)
        else:
            if logits is None:
                raise ValueError(f"{self.store} run: pass logits= (full rows) or stored= rows")
            rows = check_full_rows(logits, place, self.vocab_size, self.dtype)
            n = int(rows.shape[0])
            block = self.kind.encode(rows, place, hidden) if n else rows
        self._buffer(block, n)

    def add_topk(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """The next rows of the current item from a top-K source (served model): ids and
        log-probabilities ``[r, K']``, each row descending; the store kind keeps what it can."""
        item = self._cur
        if item is None:
            raise ValueError("add_topk outside begin_item/end_item")
        place = BlockPlace(item.id, item.positions, item.teacher_ids, self._cur_rows)
        self.add_rows(stored=self.kind.encode_topk(np.asarray(ids), np.asarray(logprobs), place))

    def _buffer(self, block, n: int) -> None:
        if n == 0:
            return
        self._send(_nbytes(block), self._append_block, self._next_chunk, block)
        self._nrows += n
        self._cur_rows += n
        # a full chunk closes here in the middle of an item; at the item's last rows, in
        # end_item, which lists the item in it (closed here, the item would go into a chunk
        # of its own with no rows)
        if self._nrows >= self.chunk_rows and (self._cur is None or self._cur_rows < len(self._cur.positions)):
            self.flush(wait=False)

    def end_item(self) -> None:
        item = self._cur
        if item is None:
            raise ValueError("end_item without begin_item")
        if self._cur_rows != len(item.positions):
            raise LogitdiffError(
                f"item {item.id!r}: {self._cur_rows} rows given for {len(item.positions)} scored positions"
            )
        self._cur = None
        self._buf_items.append(item)
        if self._nrows >= self.chunk_rows:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Close the chunk being filled; by default return once every chunk is on disk.

        ``add_rows`` calls ``flush(wait=False)``: the chunk's closing is handed to the writer
        thread (after its blocks)."""
        self._raise_failed()
        if self._buf_items or self._nrows:
            items, nrows = self._buf_items, self._nrows
            self._buf_items, self._nrows = [], 0
            idx = self._next_chunk
            self._next_chunk += 1
            self._drain_syncs(keep=SYNC_LAG)  # a bounded number written but not yet listed
            written = self._send(0, self._write_chunk, idx, items, nrows)
            self._syncing.append(self._threads()[1].submit(self._list_chunk, written))
        if wait:
            self._drain()

    def _send(self, nbytes: int, fn, *args):
        """``fn(*args)`` queued for the writer thread; first, while more than ``chunk_bytes``
        of blocks are queued there, wait for the oldest (memory bounded by a chunk). Tasks
        done are forgotten as they finish (their errors raised here), so the queue holds
        only what the writer has not done, however small the blocks."""
        pending = self._pending
        while pending and (pending[0][0].done() or self._queued + nbytes > self.chunk_bytes):
            done, b = pending.popleft()
            self._queued -= b
            done.result()
        future = self._threads()[0].submit(fn, *args)
        pending.append((future, nbytes))
        self._queued += nbytes
        return future

    def _threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The writer and the syncer (started on first use, stopped by ``close``)."""
        if self._pool is None or self._syncer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitdiff-writer")
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitdiff-syncer")
        return self._pool, self._syncer

    def _write_side_files(self, files: list[tuple[str, list]]) -> None:
        for name, strings in files:
            atomic_write_bytes(self.path / name, json_list_bytes(strings))

    def _raise_failed(self) -> None:
        done = [f for f, _ in self._pending if f.done()] + [f for f in self._syncing if f.done()]
        self._pending = deque((f, b) for f, b in self._pending if not f.done())
        self._queued = sum(b for _, b in self._pending)
        self._syncing = [f for f in self._syncing if not f.done()]
        for f in done:
            f.result()  # re-raises the writer's (or syncer's) exception in the caller

    def _drain_writes(self) -> None:
        pending, self._pending, self._queued = self._pending, deque(), 0
        for f, _ in pending:
            f.result()

    def _drain_syncs(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` chunks are written but not yet listed."""
        while len(self._syncing) > keep:
            self._syncing.pop(0).result()

    def _drain(self) -> None:
        """Every chunk handed out so far written, durable and listed in the manifest."""
        try:
            self._drain_writes()
        finally:
            self._drain_syncs()

    def close(self) -> None:
        """Wait for pending chunks, stop the writer threads and let go of the RUN's lock
        (``finish`` does this too); a chunk still being filled (rows given, never flushed) is
        abandoned: its file removed."""
        try:
            self._stop()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """The RUN's lock released and this writer no longer counted as open."""
        if _LIVE_WRITERS.get(self._key) is self:
            del _LIVE_WRITERS[self._key]
        self._lock.close()

    def _stop(self) -> None:
        try:
            self._drain()
        finally:
            for name in ("_pool", "_syncer"):
                pool = getattr(self, name)
                if pool is not None:
                    pool.shutdown(wait=True)
                    setattr(self, name, None)
            chunk, self._chunk_file = self._chunk_file, None
            if chunk is not None:
                chunk.abort()
            self.kind.stop_writing()  # the O_DIRECT staging buffer, freed now, not with this object

    def _chunk_path(self, idx: int) -> Path:
        return self.path / "chunks" / f"{idx:06d}.{self.kind.chunk_suffix}"

    def _append_block(self, idx: int, block) -> None:
        """The writer thread: one stored block into chunk ``idx``'s file (opened by its first)."""
        if self._write_failed:
            raise LogitdiffError(f"{self.path}: an earlier block was not written; later blocks are not")
        try:
            if self._chunk_file is None:
                self._chunk_file = self.kind.open_chunk(self._chunk_path(idx))
            self._chunk_file.append(block)
        except BaseException:
            self._abandon_chunk()
            raise

    def _abandon_chunk(self) -> None:
        """After a failed write: the chunk's temporary removed, nothing more written."""
        self._write_failed = True
        chunk, self._chunk_file = self._chunk_file, None
        if chunk is not None:
            try:
                chunk.abort()
            except Exception:  # noqa: S110 (the write's own error is the one to report)
                pass

    def _write_chunk(self, idx: int, items: list[RunItem], nrows: int) -> tuple[dict, list[RunItem]]:
        """The writer thread: chunk ``idx``'s files closed, whole under their names (not yet
        durable: :meth:`_list_chunk` does that)."""
        if self._write_failed:
            raise LogitdiffError(f"{self.path}: an earlier block was not written; chunk {idx} is not")
        stem = f"{idx:06d}"
        entry: dict[str, Any] = {"index": idx, "items": f"{stem}.items.jsonl", "rows": nrows, "n_items": len(items),
                 "data": f"{stem}.{self.kind.chunk_suffix}"}
        try:
            if self._chunk_file is None:  # a chunk that only closes items whose rows ended in earlier chunks
                self._chunk_file = self.kind.open_chunk(self._chunk_path(idx))
            chunk, self._chunk_file = self._chunk_file, None
            chunk.close()
            text = "".join(json.dumps(it.to_json_in(idx)) + "\n" for it in items)
            with atomic_file_unsynced(self.path / "chunks" / entry["items"]) as f:
                f.write(text.encode())
        except BaseException:
            self._abandon_chunk()
            raise
        return entry, items

    def _list_chunk(self, written) -> None:
        """The syncer thread, in chunk order: once the writer has written a chunk, fsync its
        files, then list it in the manifest (written atomically and fsynced). After a
        failure no later chunk is listed: the manifest's chunks stay 0, 1, ... with no gap."""
        if self._sync_failed:
            raise LogitdiffError(f"{self.path}: an earlier chunk was not written; later chunks are not listed")
        try:
            entry, items = written.result()
            cdir = self.path / "chunks"
            fsync_path(cdir / entry["data"])
            fsync_path(cdir / entry["items"])
            fsync_path(cdir)  # the renames that named them: else a crash could keep the manifest's entry, not the files
            self.manifest["chunks"].append(entry)
            self.manifest["n_items"] += len(items)
            self.manifest["n_positions"] += sum(len(it.positions) for it in items)
            self._write_manifest()
        except BaseException:
            self._sync_failed = True
            raise

    def finish(self, extra: dict | None = None) -> None:
        if self._cur is not None:
            raise ValueError(f"item {self._cur.id!r} is not finished (end_item)")
        try:
            try:
                self.flush(wait=True)
            finally:
                self._stop()
            if extra:
                self.manifest.update(extra)
            self.manifest["status"] = "complete"
            self.manifest["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._write_manifest()
        finally:
            self._let_go()

    def _write_manifest(self) -> None:
        atomic_write_json(self.path / "manifest.json", self.manifest)


# Strings per json.dumps call in json_list_bytes: ~1 ms of encoding, under the interpreter's
# 5 ms switch interval.
JSON_SLICE = 8192


def json_list_bytes(items: list) -> bytes:
    """``json.dumps(items) + "\\n"`` as bytes (one line: json's C encoder, ~10x the indented
    Python one at V = 248,320), encoded a slice of JSON_SLICE items per call. The C encoder
    holds the GIL for a whole call: 248,320 strings at once were ~35 ms in which the thread
    that called it (the writer, writing vocab.json and tokens.json) kept the caller's thread
    from running Python; that is setup and the first forward of a capture (setup measured
    0.068 s with the two files, 0.01 s without: bench/RESULTS.md, issue 24). Between slices
    the caller gets the GIL. The same bytes as one call."""
    parts = [json.dumps(items[a : a + JSON_SLICE], default=str)[1:-1] for a in range(0, len(items), JSON_SLICE)]
    return ("[" + ", ".join(parts) + "]\n").encode()


def _nbytes(block) -> int:
    """Bytes of a block's arrays (an array, or a dict of arrays)."""
    if isinstance(block, dict):
        return sum(int(getattr(a, "nbytes", 0)) for a in block.values())
    return int(getattr(block, "nbytes", 0))


def _parse_item_line(path: Path, lineno: int, line: bytes, chunk: int) -> RunItem:
    """One line of a chunk's items.jsonl, or a one-line error naming file, line and field."""
    d = _json_object(line, f"{path}:{lineno}", json_hint="; truncated line?", json_damaged=True)
    types: type
    for key, types in (("id", str), ("prompt_ids", list), ("teacher_ids", list), ("positions", list), ("row", int)):
        if not isinstance(d.get(key), types) or isinstance(d.get(key), bool):
            raise LogitdiffError(f"{path}:{lineno}: field {key!r} missing or not a {types.__name__}; the run is damaged")
    for key, types in (("extra", dict), ("tags", list), ("chunk", int)):
        if d.get(key) is not None and (not isinstance(d[key], types) or isinstance(d[key], bool)):
            raise LogitdiffError(f"{path}:{lineno}: field {key!r} not a {types.__name__}; the run is damaged")
    if not all(isinstance(t, str) for t in d.get("tags") or []):
        raise LogitdiffError(f"{path}:{lineno}: field 'tags' not a list of strings; the run is damaged")
    if d["row"] < 0 or d.get("chunk", chunk) < 0:
        raise LogitdiffError(f"{path}:{lineno}: field 'row' or 'chunk' negative; the run is damaged")
    return RunItem.from_json(d, chunk)
def read_manifest(mpath: Path) -> dict:
    """A RUN's manifest.json as a dict, or a one-line error (unreadable, not UTF-8, not
    JSON, nested beyond the recursion limit, not an object)."""
    raw = read_input_bytes(mpath, max_bytes=DOCUMENT_MAX_BYTES, inside=mpath.parent)
    return _json_object(raw, str(mpath))


def _json_object(raw: bytes, where: str, *, json_hint: str = "", json_damaged: bool = False) -> dict:
    """``raw`` (UTF-8 JSON) as a dict, or a one-line error naming ``where`` (not UTF-8, not
    JSON, nested beyond the recursion limit, not an object)."""
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LogitdiffError(f"{where}: not valid UTF-8 (byte {e.start}); the run is damaged") from None
    except json.JSONDecodeError as e:
        raise LogitdiffError(f"{where}: not valid JSON ({e.msg}{json_hint})" + ("; the run is damaged" if json_damaged else "")) from None
    except RecursionError:
        raise LogitdiffError(f"{where}: JSON nested too deeply; the run is damaged") from None
    if not isinstance(d, dict):
        raise LogitdiffError(f"{where}: expected a JSON object; the run is damaged")
    return d


def check_chunk_entries(chunks, mpath: Path) -> None:
    """The manifest's ``chunks``: objects numbered 0, 1, ... naming plain files in chunks/
    (no path outside the RUN) with a row count; raises ValueError('chunks[i].field')."""
    if not isinstance(chunks, list):
        raise ValueError("chunks")
    for i, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise ValueError(f"chunks[{i}]")
        if c.get("index") != i or isinstance(c.get("index"), bool):
            raise ValueError(f"chunks[{i}].index")
        for key in ("items", "data"):
            name = c.get(key)
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
                raise ValueError(f"chunks[{i}].{key}")
        if not isinstance(c.get("rows"), int) or isinstance(c.get("rows"), bool) or c["rows"] < 0:
            raise ValueError(f"chunks[{i}].rows")


def _unlink_any(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        import shutil

        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _check_item_ids(it: RunItem, vocab_size: int, where: str) -> None:
    """Ids of a stored item in [0, V) (teacher -1: unknown, in imported RUNs), positions
    integers indexing the teacher sequence."""
    validate.check_ids(it.prompt_ids, vocab_size, where, what="prompt")
    validate.check_ids(it.teacher_ids, vocab_size, where, what="teacher", allow=-1)
    n = len(it.teacher_ids)
    pos = it.positions
    if pos and set(map(type, pos)) <= {int} and min(pos) >= 0 and max(pos) < n:
        return
    for j, q in enumerate(pos):
        if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q < n:
            raise LogitdiffError(f"{where}: field 'positions' [{j}] = {str(q)[:40]} is not a teacher position in [0, {n})")


def reblock(pieces: Iterable, rows: int) -> Iterator:
    """Re-cut a stream of row blocks (arrays, or dicts of arrays with equal row counts) into
    blocks of exactly ``rows`` rows (the last may be shorter); pieces that already are one
    whole block pass through without a copy. Two streams of the same rows re-cut to the same
    ``rows`` line up block by block."""
    buf: list = []
    have = 0

    def n_of(p):
        return (next(iter(p.values())) if isinstance(p, dict) else p).shape[0]

    def cut(p, a, b):
        return {k: v[a:b] for k, v in p.items()} if isinstance(p, dict) else p[a:b]

    def cat(ps):
        if len(ps) == 1:
            return ps[0]
        if isinstance(ps[0], dict):
            return {k: np.concatenate([p[k] for p in ps]) for k in ps[0]}
        return np.concatenate(ps)

    for p in pieces:
        n = n_of(p)
        a = 0
        while a < n:
            take = min(rows - have, n - a)
            buf.append(cut(p, a, a + take) if (a, take) != (0, n) else p)
            have += take
            a += take
            if have == rows:
                yield cat(buf)
                buf, have = [], 0
        p = None  # a spent piece is not held while the next is made (see aligned_blocks)
    if have:
        yield cat(buf)


def aligned_blocks(pieces_a: Iterable, pieces_b: Iterable, rows: int) -> Iterator[tuple]:
    """Pairs of row blocks of two streams of the same rows (arrays cut anywhere): each pair
    covers the same rows, cut where a piece of either stream ends and after at most ``rows``
    rows. Views of the pieces, never a copy (`reblock` concatenates across pieces instead).
    Stops at the end of the shorter stream."""
    it_a, it_b = iter(pieces_a), iter(pieces_b)
    pa = pb = None
    oa = ob = 0
    while True:
        while pa is None or oa == len(pa):
            # the spent piece is dropped before the next is made: a decoding reader (hidden
            # store) can then decode into the buffer it was a view of, not into fresh pages
            pa = None
            pa, oa = next(it_a, None), 0
            if pa is None:
                return
        while pb is None or ob == len(pb):
            pb = None
            pb, ob = next(it_b, None), 0
            if pb is None:
                return
        take = min(rows, len(pa) - oa, len(pb) - ob)
        yield pa[oa : oa + take], pb[ob : ob + take]
        oa += take
        ob += take


class RunReader:
    """Streaming reader: chunks are memory-mapped on demand, never the whole run."""

    def __init__(self, path: str | Path, *, allow_partial: bool = False, device=None, read_ahead: bool = True):
        self.path = Path(path)
        self.device = device  # where a hidden-state run's chunks are decoded (torch device; None: cpu)
        self.read_ahead = read_ahead  # decode the next chunk while the caller works on this one (_chunk)
        mpath = self.path / "manifest.json"
        if not self.path.is_dir():
            raise LogitdiffError(f"{self.path}: not a RUN directory")
        if not mpath.exists():
            raise LogitdiffError(f"{mpath}: missing (not a logitdiff RUN)")
        self.manifest = read_manifest(mpath)
        if self.manifest.get("schema") != RUN_SCHEMA:
            raise LogitdiffError(f"{mpath}: field 'schema' is {self.manifest.get('schema')!r}, expected {RUN_SCHEMA!r}")
        if self.manifest.get("status") != "complete" and not allow_partial:
            raise LogitdiffError(
                f"{mpath}: run is marked {self.manifest.get('status')!r} (resume the capture, or pass --allow-partial)"
            )
        try:
            st = self.manifest["settings"]["store"]
            self.vocab_size = int(self.manifest["vocab_size"])
            if not isinstance(self.manifest["vocab_size"], int) or isinstance(self.manifest["vocab_size"], bool) or self.vocab_size < 1:
                raise ValueError("vocab_size")
            if self.manifest["settings"].get("dtype") not in (None, *_DTYPES):
                raise ValueError("settings.dtype")
            check_chunk_entries(self.manifest["chunks"], mpath)
            # the kind reads the chunks: a hidden-state run reads as a full run (they decode to the logits)
            self.kind: StoreKind = store_kind(st, self.vocab_size, self.manifest["settings"].get("dtype"))
        except (KeyError, TypeError, ValueError, AttributeError, LogitdiffError) as e:
            raise LogitdiffError(f"{mpath}: field {str(e).strip(chr(39))!r} missing or malformed (not a RUN this logitdiff reads)") from None
        self.store = st
        self.tokenizer_hash = self.manifest.get("tokenizer_hash")
        self.dtype = self.manifest["settings"].get("dtype")
        self.kind.start_reading(self.path, self.manifest)
        self._items: list[RunItem] | None = None
        self._cache: tuple[int, object] | None = None  # (chunk index, its readable rows)
        self._stored_cache: tuple[int, object] | None = None  # (chunk index, its stored rows)
        self._ahead: tuple[int, Any] | None = None  # (chunk index, the Future of its decode)
        self._last_index = -1  # the chunk handed out last (decode ahead only after k - 1 came before k)
        self._pool: Any = None  # the decode-ahead worker thread (an executor of one), made on first use
        self._float32 = False  # a decoding kind's rows handed out as float32 values (decode_to_float32)

    @property
    def is_partial(self) -> bool:
        return self.manifest.get("status") != "complete"

    @property
    def spec(self) -> str:
        return (self.manifest.get("source") or {}).get("spec", str(self.path))

    def items(self) -> list[RunItem]:
        if self._items is None:
            items: list[RunItem] = []
            seen: set[str] = set()
            checked: dict[str, str] = {}  # tools module copies already hashed
            for c in self.manifest["chunks"]:
                p = self.path / "chunks" / c["items"]
                if not p.exists():
                    raise LogitdiffError(f"{p}: chunk file missing (truncated run)")
                raw = read_input_bytes(p, max_bytes=DOCUMENT_MAX_BYTES, inside=self.path)
                for lineno, line in enumerate(raw.split(b"\n"), 1):
                    if line.strip():
                        it = _parse_item_line(p, lineno, line, c["index"])
                        _check_item_ids(it, self.vocab_size, f"{p}:{lineno} (item {it.id!r})")
                        self._resolve_tools_module(p, lineno, it, checked)
                        if it.id in seen:
                            raise LogitdiffError(f"{p}: duplicate item id {it.id!r}")
                        seen.add(it.id)
                        items.append(it)
            self._items = items
        return self._items

    def _resolve_tools_module(self, items_file: Path, lineno: int, it: RunItem, checked: dict[str, str]) -> None:
        """A RUN-relative ``tools_module`` (the copy ``RunWriter`` keeps) -> its path here,
        after checking that the copy is there and has the recorded hash."""
        wl_item = it.extra.get("item") if isinstance(it.extra, dict) else None
        if not isinstance(wl_item, dict) or wl_item.get("tools_module") is None:
            return
        rel = wl_item["tools_module"]
        where = f"{items_file}:{lineno} (item {it.id!r}): field 'tools_module' {str(rel)[:120]!r}"
        if not isinstance(rel, str) or not rel:
            raise LogitdiffError(f"{where}: not a path; the run is damaged")
        if Path(rel).is_absolute():
            # only a copy inside the RUN, checked against its hash, is ever executed
            raise LogitdiffError(f"{where}: an absolute path; a RUN's tools modules are its own copies under "
                                 f"{TOOLS_DIR}/ with their sha256 (recapture with this logitdiff)")
        local = self.path / rel
        if not local.is_file() or ".." in Path(rel).parts or self.path.resolve() not in local.resolve().parents:
            raise LogitdiffError(f"{where}: not in the RUN (copied without its {TOOLS_DIR}/ directory?)")
        want = wl_item.get("tools_module_sha256")
        if not isinstance(want, str):
            raise LogitdiffError(f"{where}: no 'tools_module_sha256' recorded beside it; the run is damaged")
        if rel not in checked:
            checked[rel] = hashlib.sha256(read_input_bytes(local, max_bytes=DOCUMENT_MAX_BYTES, inside=self.path)).hexdigest()
        if checked[rel] != want:
            raise LogitdiffError(f"{where}: its sha256 differs from the one recorded (the file was changed)")
        wl_item["tools_module"] = str(local)

    def vocab(self) -> list[str] | None:
        p = self.path / "vocab.json"
        return read_input_json(p, max_bytes=token_texts_bound(self.vocab_size), inside=self.path) if p.exists() else None

    def tokens(self) -> list[str | None] | None:
        """The token strings ``tokenizer_hash`` is of (None for a run without them)."""
        p = self.path / TOKENS_FILE
        if not p.exists():
            return None
        t = read_input_json(p, max_bytes=token_texts_bound(self.vocab_size), inside=self.path)
        if not isinstance(t, list) or not all(x is None or isinstance(x, str) for x in t):
            raise LogitdiffError(f"{p}: expected a list of token strings")
        return t

    def _stored(self, index: int):
        """Chunk ``index``'s rows as stored (checked against the manifest's row count)."""
        if self._stored_cache is not None and self._stored_cache[0] == index:
            return self._stored_cache[1]
        self._stored_cache = None  # let the previous chunk go before the next one is read
        data = self._load_stored(index)
        self._stored_cache = (index, data)
        return data

    def _load_stored(self, index: int):
        c = self.manifest["chunks"][index]
        p = self.path / "chunks" / c["data"]
        if not p.exists():
            raise LogitdiffError(f"{p}: chunk file missing (truncated run)")
        input_stat(p, max_bytes=1 << 62, inside=self.path)  # a regular file of the RUN; the kind bounds its size
        try:
            data = self.kind.load_chunk(p, lambda r: self._row_label(index, r), max_bytes=self.kind.chunk_bound(c["rows"]))
            n = self.kind.rows_in(data)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as e:
            raise LogitdiffError(f"{p}: unreadable chunk ({e})") from None
        if n != c["rows"]:
            raise LogitdiffError(f"{p}: holds {n} rows, manifest says {c['rows']} (truncated run)")
        return data

    def decode_to_float32(self) -> bool:
        """Hand out a decoding kind's rows (the hidden store's) as float32 values instead of
        the stored form (bf16 bits): exact, the values ``values`` would widen them to. For a
        caller that converts them to float32 anyway (a compare against float32 rows): the
        decode's threads write float32 directly, so the caller's single-threaded conversion of
        every block goes away. Whether the rows will be float32: False for a kind that does
        not decode (its rows are the file's) and once rows were read or prefetched (one form
        per reader: nothing already decoded is decoded again)."""
        if getattr(self.kind, "decodes", False) and not (self._ahead or self._cache or self._last_index >= 0):
            self._float32 = True
        return self._float32

    def _decode(self, index: int, stored):
        try:
            if self._float32:  # only a kind that ``decodes`` (decode_to_float32); others keep decode(block, device)
                return self.kind.decode(stored, device=self.device, float32=True)
            return self.kind.decode(stored, device=self.device)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as e:
            p = self.path / "chunks" / self.manifest["chunks"][index]["data"]
            raise LogitdiffError(f"{p}: unreadable chunk ({e})") from None

    def _chunk(self, index: int):
        """Chunk ``index``'s rows as a reader gets them (decoded by the kind).

        A kind that decodes (the hidden store: a head product per chunk) decodes ahead when
        chunks are asked for in order: once chunk k is handed out, chunk k + 1 is read and
        decoded in the reader's one worker thread while the caller works on chunk k (the
        kernel's threads run without the GIL), so a compare's single-threaded stretches
        (conversions, Python between blocks) leave no core idle while decoding is left. One
        decode at a time: a chunk asked for out of order waits for the one in flight first
        (the kind's buffer pool is not shared between two decodes)."""
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1]
        self._cache = None  # let the previous chunk go before the next one is built (decoded)
        ahead, self._ahead = self._ahead, None
        data = None
        if ahead is not None:
            if ahead[0] == index:
                data = ahead[1].result()  # the worker's LogitdiffError, if any, is this call's
            else:
                ahead[1].cancel() or ahead[1].exception()  # not wanted: wait for it, drop it (and its error)
            del ahead
        if data is None:
            data = self._decode(index, self._stored(index))
        self._cache = (index, data)
        sequential, self._last_index = index == self._last_index + 1, index
        if self.read_ahead and sequential and index + 1 < len(self.manifest["chunks"]) and getattr(self.kind, "decodes", False):
            self._ahead = (index + 1, self._worker().submit(lambda k=index + 1: self._decode(k, self._load_stored(k))))
        return data

    def prefetch(self, items: Iterable[RunItem] | None = None) -> None:
        """Start decoding, in the reader's worker thread, the first chunk a sequential read
        of ``items`` (default: the whole run) will ask for, and return at once. For a caller
        that is about to read rows but has other work first: a compare checks the runs'
        tokens and items (single-threaded Python) before its first block, and a hidden-state
        reference's first chunk can be decoded on the core that leaves idle. A no-op for a
        kind that does not decode, with ``read_ahead`` off, or once rows have been read."""
        if not (self.read_ahead and getattr(self.kind, "decodes", False)) or self._ahead or self._cache or self._last_index >= 0:
            return
        first = next(iter(items), None) if items is not None else None
        index = first.chunk if first is not None else 0
        if index < len(self.manifest["chunks"]):
            self._ahead = (index, self._worker().submit(lambda: self._decode(index, self._load_stored(index))))
            self._last_index = index - 1  # asking for it next is reading in order

    def _worker(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitdiff-decode")
        return self._pool

    def _row_label(self, index: int, r: int) -> str:
        """``item 'ID' output position P`` of row ``r`` of chunk ``index`` (for errors)."""
        for it in self.items():
            for i, a, b in self._spans(it):
                if i == index and a <= r < b:
                    done = sum(bb - aa for ii, aa, bb in self._spans(it) if ii < index)
                    return f"item {it.id!r} output position {it.positions[done + r - a]}"
        return f"row {r}"

    def stored_blocks(self, item: RunItem, rows: int | None = None) -> Iterator:
        """An item's rows as stored (not decoded), a chunk's span (or at most ``rows`` rows)
        at a time: what ``merge`` copies into a run of the same kind
        (``RunWriter.add_rows(stored=...)``)."""
        for index, a, b in self._spans(item):
            step = max(1, rows or (b - a))
            for lo in range(a, b, step):
                yield self.kind.cut_stored(self._stored(index), lo, min(b, lo + step))

    def _chunk_rows(self) -> list[int]:
        return [int(c["rows"]) for c in self.manifest["chunks"]]

    def _spans(self, item: RunItem) -> Iterator[tuple[int, int, int]]:
        """(chunk index, first row, end row) of the item's rows, in order (an item may run
        on into the following chunks)."""
        n_left = len(item.positions)
        index, row = item.chunk, item.row
        sizes = self._chunk_rows()
        while n_left > 0:
            if index >= len(sizes):
                raise LogitdiffError(f"{self.path}: item {item.id!r} runs past the last chunk (truncated run)")
            take = min(n_left, sizes[index] - row)
            if take <= 0:
                raise LogitdiffError(f"{self.path}: item {item.id!r}: row {row} outside chunk {index} (corrupt run)")
            yield index, row, row + take
            n_left -= take
            index, row = index + 1, 0

    def _pieces(self, item: RunItem, raw: bool = False) -> Iterator:
        """The item's rows as views of its chunk(s), in order (an item may run on into the
        following chunks). Full runs: native arrays (bf16 bits stay uint16 when ``raw``)."""
        for index, a, b in self._spans(item):
            yield cut_rows(self._chunk(index), a, b)

    def row_pieces(self, items: Iterable[RunItem]) -> Iterator[np.ndarray]:
        """The full-logit rows of ``items`` in order, in the stored dtype (bf16 bits as
        uint16), as views of the memory-mapped chunks: rows of consecutive items that lie
        next to each other in a chunk come as one view, so nothing is copied and a piece is
        at most a chunk. Pair two runs' pieces with `aligned_blocks`."""
        cur = None
        for it in items:
            for index, a, b in self._spans(it):
                if cur is not None and cur[0] == index and cur[2] == a:
                    cur = (index, cur[1], b)
                    continue
                if cur is not None:
                    yield self._chunk(cur[0])[cur[1] : cur[2]]
                cur = (index, a, b)
        if cur is not None:
            yield self._chunk(cur[0])[cur[1] : cur[2]]

    def logits(self, item: RunItem) -> np.ndarray:
        """Full logits ``[len(positions), V]`` of one item (float32 for bf16 runs).

        Holds the whole item: for small items and tests; streaming code uses
        :meth:`row_blocks`."""
        if self.kind.reads_as is not RowsForm.FULL:
            raise LogitdiffError(f"{self.path}: run stores {self.kind.describe()}, not full logits")
        pieces = list(self._pieces(item))
        rows = pieces[0] if len(pieces) == 1 else (np.concatenate(pieces) if pieces else np.zeros((0, self.vocab_size), _DTYPES[self.dtype or "float32"]))
        return self.kind.values(rows)

    def topk(self, item: RunItem) -> dict[str, np.ndarray]:
        if self.kind.reads_as is not RowsForm.TOPK:
            raise LogitdiffError(f"{self.path}: run stores {self.kind.describe()}, not top-K")
        pieces = list(self._pieces(item))
        if not pieces:
            data = self._chunk(item.chunk) if item.chunk < len(self.manifest["chunks"]) else {}
            return {k: v[:0] for k, v in data.items()} or {"ids": np.zeros((0, self.kind.k), np.int64), "logprobs": np.zeros((0, self.kind.k))}
        return _joined(pieces)

    def row_blocks(self, items: Iterable[RunItem], rows: int, *, raw: bool = False) -> Iterator:
        """The rows of ``items`` in order, cut into blocks of exactly ``rows`` rows across
        item and chunk boundaries (the last may be shorter), as the kind hands them out
        (``kind.reads_as``): full rows as float values (bf16 converted one block at a time;
        ``raw`` keeps the stored dtype, bf16 bits as uint16), top-K lists and bounded rows as
        dicts of arrays. Memory: one block, whatever the run's size."""
        for b in reblock((p for it in items for p in self._pieces(it)), rows):
            yield self.kind.values(b, raw)

    def compact_rows(self, item: RunItem) -> dict[str, np.ndarray]:
        """The compact store's arrays of an item's rows (see compact.py)."""
        if self.kind.reads_as is not RowsForm.BOUNDED:
            raise LogitdiffError(f"{self.path}: run stores {self.store}, not a compact reference")
        return _joined(list(self._pieces(item)))


def _joined(pieces: list[dict]) -> dict[str, np.ndarray]:
    """One item's rows of a top-K or compact store from its pieces (one per chunk it spans)."""
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
