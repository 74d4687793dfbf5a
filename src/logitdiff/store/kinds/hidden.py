"""``--store hidden``: a bf16 (or float16) reference's logits, bit for bit, kept as its final
hidden states, the output head (once per run, ``head.npy``) and the few entries the head
does not reproduce (the arrays and their encoding are logitdiff.store.hidden's). A reader gets
the logits back: full rows, as from ``--store full`` of the same source."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import hidden as H
from ...errors import LogitdiffError
from ..files import atomic_write_bytes_unsynced
from .base import Block, BlockPlace, RowsForm, StoreKind
from .rows import DTYPES, atomic_save_npy_rows, full_values


# decoded-chunk buffers a reader keeps for reuse (`HiddenStore._free_buffer`): a streaming
# compare uses two (the chunk it compares, the next one decoded ahead: RunReader._chunk);
# three cover a caller that holds the previous block while asking for the next (a plain
# ``for`` loop over blocks)
OUT_BUFFERS = 3
# the reference count of an array held by a list slot and nothing else, as read above
# (measured once, so an interpreter that counts differently only changes this number)
_probe = [np.empty(0)]
_LISTED_ONLY = sys.getrefcount(_probe[0])
del _probe


class HiddenStore(StoreKind):
    name: ClassVar[str] = H.STORE
    usage: ClassVar[str] = "hidden"
    summary: ClassVar[str] = ("a bf16/fp16 transformers model's logits kept bit for bit as its final hidden states plus the "
                              "output head once: ~2 bytes per hidden unit per position; compares exactly")
    reads_as: ClassVar[RowsForm] = RowsForm.FULL
    chunk_suffix: ClassVar[str] = H.CHUNK_SUFFIX
    needs_hidden_states: ClassVar[bool] = True
    decodes: ClassVar[bool] = True  # a reader decodes the next chunk ahead (RunReader._chunk)
    lossless: ClassVar[bool] = True
    auto_rank: ClassVar[int] = 1  # ~2H bytes a position instead of 2V: taken where the reference allows it

    @classmethod
    def can_keep(cls, source: Any) -> bool:
        """A source whose logits are its 16-bit output head's output (a bf16/f16 transformers
        model with no bias, scaling or soft-capping): ``source.output_head()`` says so."""
        return source.output_head() is not None

    def __init__(self, text: str, vocab_size: int | None = None, dtype: str | None = None) -> None:
        super().__init__(text, vocab_size, dtype)
        self._head: np.ndarray | None = None  # [V, H] bf16/f16 bits: given (writer) or memory-mapped (reader)
        self._norms: np.ndarray | None = None  # ||W_v|| per head row (writer)
        self._run: Path | None = None
        self._head_meta: dict[str, Any] = {}
        self._out_buffers: list[np.ndarray] = []  # decoded chunks' arrays, reused once nothing refers to them

    def describe(self) -> str:
        return "hidden states"

    @property
    def row_bytes(self) -> int:
        # sized by the 16-bit rows a chunk stands for: a reader holds them decoded
        return int(self.vocab_size or 0) * np.dtype(DTYPES[self.dtype or "bfloat16"]).itemsize

    @property
    def hidden_size(self) -> int:
        return int(self._head_meta["shape"][1])

    # ------------------------------------------------------------------ writing
    def start_writing(self, head: np.ndarray | None = None) -> dict[str, Any]:
        if self.dtype not in H.FORMATS:
            raise LogitdiffError(f"--store hidden: the source's logits are {self.dtype}; the hidden-state store keeps bf16 or "
                                 "float16 logits (a transformers model in bfloat16/float16 whose logits are its head's output)")
        if head is None or np.asarray(head).ndim != 2 or np.asarray(head).shape[0] != int(self.vocab_size or 0):
            raise LogitdiffError(f"--store hidden: the source has no output head of {self.vocab_size} rows to store "
                                 "(transformers sources only)")
        self._head = np.asarray(head, np.uint16)
        self._norms = H.head_norms(self._head, self.dtype)
        self._head_meta = {"file": H.HEAD_FILE, "shape": list(self._head.shape), "sha256": H.head_sha256(self._head)}
        return {"head": self._head_meta}

    def write_files(self, run: Path, fresh: bool) -> None:
        if self._head is not None and (fresh or not (run / H.HEAD_FILE).exists()):
            atomic_save_npy_rows(run / H.HEAD_FILE, [self._head], "bfloat16")

    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Block:
        head, norms = self.head(), self._norms
        assert norms is not None, "start_writing first"
        if self.dtype == "float16" and rows.dtype == np.float16:
            rows = rows.view(np.uint16)
        if hidden is None or rows.dtype != np.uint16:
            raise LogitdiffError(f"{place.where}: hidden-state run: pass {self.dtype} logits (bits) and hidden= states")
        h = np.asarray(hidden)
        if h.dtype != np.uint16 or h.shape != (rows.shape[0], head.shape[1]):
            raise LogitdiffError(f"{place.where}: hidden states {h.dtype} {h.shape}, expected uint16 "
                                 f"({rows.shape[0]}, {head.shape[1]})")
        enc = H.encode(rows, h, head, norms, self.dtype or "bfloat16")
        V = int(self.vocab_size or 0)
        per_row = np.bincount(enc["exc_row"], minlength=rows.shape[0])
        worst = int(per_row.argmax()) if per_row.size else 0
        if per_row.size and per_row[worst] > max(64, V // 64):
            raise LogitdiffError(
                f"{place.where}: {place.label(worst)}: {per_row[worst]} of {V} logits are not the output head "
                "applied to the hidden state (bias, scaling or another head?): use --store full")
        return enc

    def check_block(self, block: Block, place: BlockPlace) -> tuple[Block, int]:
        head = self.head()
        block = block if isinstance(block, dict) else {}
        h = np.asarray(block.get("hidden"))
        e = [np.asarray(block.get(key)) for key in ("exc_row", "exc_id", "exc_bits")]
        V = int(self.vocab_size or 0)
        ok = (h.dtype == np.uint16 and h.ndim == 2 and h.shape[1] == head.shape[1] and h.shape[0] <= place.n_left
              and len({x.shape for x in e}) == 1 and e[0].ndim == 1
              and (e[0].size == 0 or (0 <= e[0].min() and e[0].max() < h.shape[0] and 0 <= e[1].min() and e[1].max() < V)))
        if not ok:
            raise LogitdiffError(f"{place.where}: hidden-state rows {h.dtype} {h.shape} (or their exceptions) do not fit "
                                 f"(<= {place.n_left}, {head.shape[1]}) at V = {V}")
        rows = {"hidden": h, "exc_row": e[0].astype(np.int32), "exc_id": e[1].astype(np.int32), "exc_bits": e[2].astype(np.uint16)}
        return rows, int(h.shape[0])

    def save_chunk(self, path: Path, blocks: list[Block]) -> None:
        atomic_write_bytes_unsynced(path, H.save_chunk(H.stack(blocks, self.head().shape[1])))  # fsynced by RunWriter before it lists the chunk

    # ------------------------------------------------------------------ reading
    def start_reading(self, run: Path, manifest: dict[str, Any]) -> None:
        hd = manifest.get("head")
        if not (isinstance(hd, dict) and isinstance(hd.get("shape"), list) and len(hd["shape"]) == 2
                and hd["shape"][0] == self.vocab_size and isinstance(hd.get("sha256"), str)):
            raise LogitdiffError(f"{run / 'manifest.json'}: field 'head' missing or malformed (a hidden-state run records its output head)")
        self._run, self._head_meta = run, hd

    def head(self) -> np.ndarray:
        """The output head [V, H] (bf16 bits): a writer's, or a reader's memory-mapped
        ``head.npy``, checked against the manifest once."""
        if self._head is None:
            if self._run is None:
                raise LogitdiffError("--store hidden: no output head (start_writing or start_reading first)")
            path = self._run / H.HEAD_FILE
            head = H.load_head(path, int(self.vocab_size or 0), self._head_meta["sha256"])
            if list(head.shape) != self._head_meta["shape"]:
                raise LogitdiffError(f"{path}: shape {head.shape}, manifest says {self._head_meta['shape']}")
            self._head = head
        return self._head

    def chunk_bound(self, rows: int) -> int:
        # per row its H bf16 hidden values and at most V exceptions (a row and an id, int32
        # each, and 16 bits: store/hidden.py encode)
        return max(0, int(rows)) * (2 * self.hidden_size + 10 * int(self.vocab_size or 0))

    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Block:
        return H.load_chunk(path, self.hidden_size, int(self.vocab_size or 0), max_bytes)

    def rows_in(self, block: Block) -> int:
        return int(block["hidden"].shape[0])

    def cut_stored(self, block: Block, a: int, b: int) -> Block:
        return H.rows_of(block, a, b)

    def decode(self, block: Block, device: Any = None, float32: bool = False) -> Block:
        """The chunk's rows as a full chunk of the same source holds them, or with
        ``float32`` as float32 values (exact; what a reader converts them to for a compare
        against float32 rows, done by the decode's threads instead)."""
        n = int(np.asarray(block["hidden"]).shape[0])
        out = self._free_buffer(n, np.float32 if float32 else np.uint16)
        data = H.decode(block, self.head(), self.dtype or "bfloat16", device=device, out=out)
        return data.view(np.float16) if self.dtype == "float16" and not float32 else data  # what a full float16 chunk holds

    def _free_buffer(self, n: int, dtype: Any = np.uint16) -> np.ndarray:
        """A uint16 [n, V] array to decode a chunk into: a view of a kept buffer that
        nothing else refers to, else a fresh one (kept when fewer than ``OUT_BUFFERS`` are).

        A fresh chunk-sized array (above glibc's 32 MB mmap ceiling, freed back to the
        kernel) is fresh pages on every chunk: ~0.01 s of system CPU per 79 MB chunk at
        V = 248,320 (bench/RESULTS.md, "hidden reader's buffers"). Reusing one is
        safe only when no earlier chunk's rows are still wanted: a caller may hold views of
        any number of chunks (``RunReader.logits`` lists an item's pieces; ``reblock``
        carries a block's first rows while the next chunk is decoded). Every such view, and
        every view of a view, holds a reference to the buffer itself (numpy's ``base``), and
        the buffer is only ever handed out as a view, so a buffer whose reference count is
        the pool's own is referred to by nothing: overwriting it cannot change rows anyone
        can still read. A streaming compare drops each chunk's rows before the next is
        decoded (``aligned_blocks`` and ``reblock`` let a spent piece go first), so it
        decodes every chunk into one buffer; a caller that keeps the previous block while
        asking for the next cycles between two."""
        V = int(self.vocab_size or 0)
        pool = self._out_buffers
        for i in range(len(pool)):
            if pool[i].shape[0] >= n and pool[i].dtype == dtype and sys.getrefcount(pool[i]) == _LISTED_ONLY:
                return pool[i][:n]
        buf = np.empty((n, V), dtype)
        if len(pool) < OUT_BUFFERS:
            pool.append(buf)
        else:
            # all kept buffers in use (or too short): replace a free one, if any, with this one
            free = [i for i in range(len(pool)) if sys.getrefcount(pool[i]) == _LISTED_ONLY]
            if free:
                pool[free[0]] = buf
        return buf[:n]

    def values(self, rows: Block, raw: bool = False) -> Block:
        return full_values(rows, self.dtype, raw)

    def writer_args(self) -> dict[str, Any]:
        return {"head": self.head()}
