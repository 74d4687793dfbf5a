"""RUN directories: a capture's manifest, items and per-position distributions.

Layout::

    RUN/
      manifest.json          schema, tool version, source, tokenizer hash, vocab size,
                             settings, status (partial|complete), list of finished chunks
      vocab.json             optional: printable text of every token id (for reports)
      chunks/000000.items.jsonl   the items of chunk 0: id, tags, prompt, prompt_ids,
                                  teacher_ids, positions (scored output positions), row
      chunks/000000.logits.npy    full logits [rows, V] in native dtype (bf16 as uint16)
      chunks/000000.topk.npz      or top-K: ids, logprobs, logsumexp, tail_mass, entropy

Every file of a chunk is written to a temporary name and renamed; the manifest (which
lists finished chunks) is rewritten atomically after each chunk. A killed capture leaves
only whole chunks behind, and ``RunWriter(resume=True)`` continues after them.
Row r of a chunk is the distribution that predicts ``teacher_ids[positions[j]]`` of the
item whose rows it holds.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import __version__
from . import compact as compact_store
from .errors import LogitdiffError
from .outputs import RUN_SCHEMA, Kind, check_output

# Keys of a source's identity that may change between a capture and its --resume without
# changing the numbers (parallelism, which replicas serve the same model); every other
# identity key (weight hashes, dtype, quant, versions, device) must match.
RESUME_FREE_IDENTITY = ("threads", "endpoints", "extra_bufts", "total_slots")
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    """np.save straight into a temp file, then rename (no in-memory copy of the chunk)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_npy_rows(path: Path, blocks: list[np.ndarray], dtype) -> None:
    """One ``.npy`` of the row blocks stacked, written block by block (no concatenated
    copy in memory), then renamed into place. ``dtype`` ``"bfloat16"`` stores bf16 bits."""
    n = sum(b.shape[0] for b in blocks)
    cols = blocks[0].shape[1] if blocks else 0
    out_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(_DTYPES[dtype])
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(out_dtype), "fortran_order": False, "shape": (n, cols)})
        for b in blocks:
            if dtype == "bfloat16":
                b = b if b.dtype == np.uint16 else _f32_to_bf16(b)
            f.write(memoryview(np.ascontiguousarray(b, dtype=out_dtype)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


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
    chunk: int = -1
    row: int = -1  # first row of this item in its chunk

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
            chunk=chunk,
            row=d["row"],
        )


class ResumeMismatch(LogitdiffError):
    """``--resume`` asked to continue a run captured with something else."""


def parse_store(text: str, vocab_size: int | None = None) -> int:
    """``full`` -> 0, ``topk:K`` -> K (1 <= K <= vocab_size when known); else a one-line error."""
    if text == "full":
        return 0
    if compact_store.is_compact(text):  # the compact reference store: not a top-K store
        compact_store.parse_spec(text)
        return 0
    kind, _, k = str(text).partition(":")
    if kind != "topk" or not k.isdigit() or int(k) < 1:
        raise LogitdiffError(f"--store {text!r}: expected full, topk:K with K a positive integer, "
                             "or compact[:exact=E,band=B,bits=8|16]")
    if vocab_size is not None and int(k) > vocab_size:
        raise LogitdiffError(f"--store {text!r}: K={int(k)} exceeds the vocabulary size {vocab_size}")
    return int(k)


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
            yield f"settings.{k}", os_.get(k), ns.get(k)

    for name, a, b in pairs():
        # JSON round trip: the stored manifest went through it (tuples became lists)
        if json.loads(json.dumps(a, default=str)) != json.loads(json.dumps(b, default=str)):
            return name, a, b
    return None


def first_difference(a, b) -> int:
    """Index of the first position where two id sequences differ (len of the shorter if one is a prefix)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits (what torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def _short(x, limit: int = 80) -> str:
    text = json.dumps(x, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RunWriter:
    """Writes a RUN chunk by chunk. ``store`` is ``"full"`` or ``"topk:K"``.

    Use ``add(item, logits)`` (full: logits ``[len(positions), V]``) or
    ``add(item, topk=dict)`` (top-K: ids, logprobs, logsumexp, tail_mass, entropy); rows
    are buffered and flushed every ``chunk_rows`` rows. ``finish()`` marks the run complete.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        source: dict,
        vocab_size: int,
        tokenizer_hash: str | None,
        store: str = "full",
        dtype: str = "float32",
        settings: dict | None = None,
        chunk_rows: int | None = None,
        resume: bool = False,
        overwrite: bool = False,
        vocab: list[str] | None = None,
    ):
        self.path = Path(path)
        self.store = store
        self.k = parse_store(store, vocab_size)
        # compact reference store (compact.py): its own chunk kind, bounded comparisons
        self.compact = compact_store.parse_spec(store) if compact_store.is_compact(store) else None
        if dtype not in _DTYPES:
            raise LogitdiffError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
        self.dtype = dtype
        if chunk_rows is None:
            # ~8 MiB of rows per chunk (64..2048 rows): small enough that the writer thread
            # overlaps the next forward passes and the last write at finish() is short.
            row_bytes = int(vocab_size) * (8 * 2 if store.startswith("topk:") else np.dtype(_DTYPES[dtype]).itemsize)
            if self.compact:
                row_bytes = 12 * self.compact.exact + 10 * self.compact.band
            chunk_rows = int(min(2048, max(64, (8 << 20) // max(1, row_bytes))))
        self.chunk_rows = chunk_rows
        self.vocab_size = int(vocab_size)
        self._buf_items: list[RunItem] = []
        self._buf_rows: list = []
        self._nrows = 0
        # Chunks are written by one background thread, in order, while the caller computes
        # the next rows (the file write and fsync cost a cheap model ~15 % of its forward
        # time). The manifest lists a chunk only after its files are durable, so a kill
        # still leaves whole chunks behind.
        self._pool = None
        self._pending: list = []
        mpath = self.path / "manifest.json"
        fresh = {
            "schema": RUN_SCHEMA,
            "tool": "logitdiff",
            "tool_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "status": "partial",
            "source": source,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": tokenizer_hash,
            "settings": {**(settings or {}), "store": store, "dtype": dtype if not (self.k or self.compact) else None},
            "chunks": [],
            "n_items": 0,
            "n_positions": 0,
        }
        if mpath.exists() and resume:
            try:
                self.manifest = json.loads(mpath.read_text())
            except (OSError, ValueError) as e:
                raise LogitdiffError(f"{mpath}: cannot resume, unreadable manifest ({e})") from None
            if self.manifest.get("schema") != RUN_SCHEMA:
                raise LogitdiffError(f"{mpath}: schema {self.manifest.get('schema')!r}, expected {RUN_SCHEMA}")
            diff = resume_difference(self.manifest, fresh)
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
        else:
            if mpath.exists() and not overwrite:
                raise LogitdiffError(f"{self.path}: already holds a run (use --resume to continue it or --overwrite)")
            # Library callers too: never clear or fill a directory that is not a RUN.
            check_output(self.path, Kind.RUN, overwrite=overwrite)
            (self.path / "chunks").mkdir(parents=True, exist_ok=True)
            if overwrite:
                for f in (self.path / "chunks").iterdir():
                    f.unlink()
            self.manifest = fresh
            if vocab is not None:
                atomic_write_json(self.path / "vocab.json", vocab)
            self._write_manifest()

    # -------------------------------------------------------------------------------
    def done_ids(self) -> set[str]:
        """Ids of the items already on disk (for resuming)."""
        ids: set[str] = set()
        for c in self.manifest["chunks"]:
            with open(self.path / "chunks" / c["items"]) as f:
                ids.update(json.loads(line)["id"] for line in f if line.strip())
        return ids

    def add(self, item: RunItem, logits=None, topk: dict | None = None, compact: dict | None = None) -> None:
        n = len(item.positions)
        if self.compact:
            if compact is None or np.asarray(compact["max_logit"]).shape != (n,):
                raise LogitdiffError(f"item {item.id!r}: compact run: pass compact= rows of {n} positions (compact.encode)")
            self._buf_rows.append(compact)
        elif self.k:
            if topk is None:
                raise ValueError("top-K run: pass topk=")
            for key in ("ids", "logprobs"):
                if np.asarray(topk[key]).shape != (n, self.k):
                    raise LogitdiffError(f"item {item.id!r}: top-K {key} shape {np.asarray(topk[key]).shape}, expected ({n}, {self.k})")
            self._buf_rows.append({k: np.asarray(v) for k, v in topk.items()})
        else:
            arr = np.asarray(logits)
            if arr.shape != (n, self.vocab_size):
                raise LogitdiffError(
                    f"item {item.id!r}: logits shape {arr.shape}, expected ({n}, {self.vocab_size})"
                )
            # max and min propagate NaN and expose ±inf without a full boolean temporary;
            # only a bad array pays for locating the row.
            if arr.size and not (np.isfinite(arr.max()) and np.isfinite(arr.min())):
                bad = int(np.nonzero(~np.isfinite(arr).all(1))[0][0])
                raise LogitdiffError(
                    f"item {item.id!r}: NaN/inf logits at output position {item.positions[bad]}"
                )
            self._buf_rows.append(arr)
        item.row = self._nrows
        self._buf_items.append(item)
        self._nrows += n
        if self._nrows >= self.chunk_rows:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Write the buffered rows as a chunk; by default return once every chunk is on disk.

        ``add`` calls ``flush(wait=False)``: the chunk is handed to the writer thread."""
        self._raise_failed()
        if self._buf_items:
            items, rows, nrows = self._buf_items, self._buf_rows, self._nrows
            self._buf_items, self._buf_rows, self._nrows = [], [], 0
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitdiff-writer")
            self._pending.append(self._pool.submit(self._write_chunk, items, rows, nrows))
        if wait:
            self._drain()

    def _raise_failed(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()  # re-raises the writer's exception in the caller

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Wait for pending chunks and stop the writer thread (``finish`` does this too)."""
        try:
            self._drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _write_chunk(self, items: list[RunItem], rows: list, nrows: int) -> None:
        idx = len(self.manifest["chunks"])
        stem = f"{idx:06d}"
        cdir = self.path / "chunks"
        entry = {"index": idx, "items": f"{stem}.items.jsonl", "rows": nrows, "n_items": len(items)}
        if self.compact:
            entry["data"] = f"{stem}.{compact_store.CHUNK_SUFFIX}"
            atomic_write_bytes(cdir / entry["data"], compact_store.save_chunk(cdir / entry["data"], rows))
        elif self.k:
            keys = rows[0].keys()
            cat = {k: np.concatenate([r[k] for r in rows]) for k in keys}
            import io

            bio = io.BytesIO()
            np.savez(bio, **cat)
            atomic_write_bytes(cdir / f"{stem}.topk.npz", bio.getvalue())
            entry["data"] = f"{stem}.topk.npz"
        else:
            blocks = rows or [np.zeros((0, self.vocab_size), dtype=np.float32)]
            atomic_save_npy_rows(cdir / f"{stem}.logits.npy", blocks, self.dtype)
            entry["data"] = f"{stem}.logits.npy"
        text = "".join(json.dumps(it.to_json()) + "\n" for it in items)
        atomic_write_bytes(cdir / entry["items"], text.encode())
        self.manifest["chunks"].append(entry)
        self.manifest["n_items"] += len(items)
        self.manifest["n_positions"] += nrows
        self._write_manifest()

    def finish(self, extra: dict | None = None) -> None:
        try:
            self.flush(wait=True)
        finally:
            self.close()
        if extra:
            self.manifest.update(extra)
        self.manifest["status"] = "complete"
        self.manifest["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._write_manifest()

    def _write_manifest(self) -> None:
        atomic_write_json(self.path / "manifest.json", self.manifest)


def _parse_item_line(path: Path, lineno: int, line: bytes, chunk: int) -> RunItem:
    """One line of a chunk's items.jsonl, or a one-line error naming file, line and field."""
    try:
        d = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LogitdiffError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); the run is damaged") from None
    except json.JSONDecodeError as e:
        raise LogitdiffError(f"{path}:{lineno}: not valid JSON ({e.msg}; truncated line?); the run is damaged") from None
    if not isinstance(d, dict):
        raise LogitdiffError(f"{path}:{lineno}: expected a JSON object; the run is damaged")
    for key, types in (("id", str), ("prompt_ids", list), ("teacher_ids", list), ("positions", list), ("row", int)):
        if not isinstance(d.get(key), types) or isinstance(d.get(key), bool):
            raise LogitdiffError(f"{path}:{lineno}: field {key!r} missing or not a {types.__name__}; the run is damaged")
    return RunItem.from_json(d, chunk)


class RunReader:
    """Streaming reader: chunks are memory-mapped on demand, never the whole run."""

    def __init__(self, path: str | Path, *, allow_partial: bool = False):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not self.path.is_dir():
            raise LogitdiffError(f"{self.path}: not a RUN directory")
        if not mpath.exists():
            raise LogitdiffError(f"{mpath}: missing (not a logitdiff RUN)")
        try:
            self.manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise LogitdiffError(f"{mpath}: not valid JSON ({e.msg})") from None
        if self.manifest.get("schema") != RUN_SCHEMA:
            raise LogitdiffError(f"{mpath}: field 'schema' is {self.manifest.get('schema')!r}, expected {RUN_SCHEMA!r}")
        if self.manifest.get("status") != "complete" and not allow_partial:
            raise LogitdiffError(
                f"{mpath}: run is marked {self.manifest.get('status')!r} (resume the capture, or pass --allow-partial)"
            )
        try:
            st = self.manifest["settings"]["store"]
            self.k = parse_store(st)
            self.vocab_size = int(self.manifest["vocab_size"])
            if not isinstance(self.manifest["chunks"], list):
                raise TypeError("chunks")
        except (KeyError, TypeError, ValueError, LogitdiffError) as e:
            raise LogitdiffError(f"{mpath}: field {str(e).strip(chr(39))!r} missing or malformed (not a RUN this logitdiff reads)") from None
        self.store = st
        self.compact = compact_store.parse_spec(st) if compact_store.is_compact(st) else None
        self.tokenizer_hash = self.manifest.get("tokenizer_hash")
        self.dtype = self.manifest["settings"].get("dtype")
        self._items: list[RunItem] | None = None
        self._cache: tuple[int, object] | None = None

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
            for c in self.manifest["chunks"]:
                p = self.path / "chunks" / c["items"]
                if not p.exists():
                    raise LogitdiffError(f"{p}: chunk file missing (truncated run)")
                for lineno, line in enumerate(p.read_bytes().split(b"\n"), 1):
                    if line.strip():
                        it = _parse_item_line(p, lineno, line, c["index"])
                        if it.id in seen:
                            raise LogitdiffError(f"{p}: duplicate item id {it.id!r}")
                        seen.add(it.id)
                        items.append(it)
            self._items = items
        return self._items

    def vocab(self) -> list[str] | None:
        p = self.path / "vocab.json"
        return json.loads(p.read_text()) if p.exists() else None

    def _chunk(self, index: int):
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1]
        c = self.manifest["chunks"][index]
        p = self.path / "chunks" / c["data"]
        if not p.exists():
            raise LogitdiffError(f"{p}: chunk file missing (truncated run)")
        try:
            if self.compact:
                data = compact_store.load_chunk(p)
                n = data["max_logit"].shape[0]
            elif self.k:
                with np.load(p) as z:
                    data = {k: z[k] for k in z.files}
                n = data["ids"].shape[0]
            else:
                data = np.load(p, mmap_mode="r")
                n = data.shape[0]
                if data.ndim != 2 or data.shape[1] != self.vocab_size:
                    raise LogitdiffError(f"{p}: logits shape {data.shape}, expected (*, {self.vocab_size})")
        except (ValueError, OSError, EOFError) as e:
            raise LogitdiffError(f"{p}: unreadable chunk ({e})") from None
        if n != c["rows"]:
            raise LogitdiffError(f"{p}: holds {n} rows, manifest says {c['rows']} (truncated run)")
        self._cache = (index, data)
        return data

    def logits(self, item: RunItem) -> np.ndarray:
        """Full logits ``[len(positions), V]`` of an item (float32 view for bf16 runs)."""
        if self.k:
            raise LogitdiffError(f"{self.path}: run stores top-{self.k}, not full logits")
        if self.compact:
            raise LogitdiffError(f"{self.path}: run stores a compact reference ({self.store}), not full logits")
        data = self._chunk(item.chunk)
        rows = data[item.row : item.row + len(item.positions)]
        if self.dtype == "bfloat16":
            return _bf16_to_f32(np.asarray(rows))
        return rows

    def topk(self, item: RunItem) -> dict[str, np.ndarray]:
        if not self.k:
            raise LogitdiffError(f"{self.path}: run stores full logits, not top-K")
        data = self._chunk(item.chunk)
        sl = slice(item.row, item.row + len(item.positions))
        return {k: v[sl] for k, v in data.items()}

    def compact_rows(self, item: RunItem) -> dict[str, np.ndarray]:
        """The compact store's arrays of an item's rows (see compact.py)."""
        if not self.compact:
            raise LogitdiffError(f"{self.path}: run stores {self.store}, not a compact reference")
        return compact_store.rows_of(self._chunk(item.chunk), slice(item.row, item.row + len(item.positions)))

    def iter_items(self) -> Iterator[RunItem]:
        """Items in chunk order, so each chunk is mapped once."""
        yield from self.items()
