"""``--store topk:K``: per row the K most probable token ids with their log-probabilities
(normalised over the full vocabulary), plus logsumexp, tail mass and entropy when the
source gave full logits; one ``.npz`` per chunk."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import validate
from ...errors import LogitdiffError
from ..files import atomic_write_bytes_unsynced
from .base import Block, BlockPlace, RowsForm, StoreKind
from .rows import bf16_to_f32


class TopKStore(StoreKind):
    name: ClassVar[str] = "topk"
    usage: ClassVar[str] = "topk:K with K a positive integer"
    summary: ClassVar[str] = "the K most probable tokens per position, 1 <= K <= V"
    reads_as: ClassVar[RowsForm] = RowsForm.TOPK
    chunk_suffix: ClassVar[str] = "topk.npz"
    keeps_dtype: ClassVar[bool] = False  # log-probabilities, whatever the source's logits were

    def __init__(self, text: str, vocab_size: int | None = None, dtype: str | None = None, *, k: int = 1) -> None:
        super().__init__(text, vocab_size, dtype)
        self._k = int(k)

    @classmethod
    def parse(cls, text: str, vocab_size: int | None = None, dtype: str | None = None) -> TopKStore:
        name, _, k = str(text).partition(":")
        if name != cls.name or not k.isdigit() or int(k) < 1:
            raise LogitdiffError(f"--store {text!r}: expected {cls.usage}")
        kind = cls(text, vocab_size, dtype, k=int(k))
        kind.check_vocab()
        return kind

    @classmethod
    def as_given(cls, top_k: int, vocab_size: int | None, dtype: str | None) -> StoreKind | None:
        if not top_k:
            return None
        kind = cls(f"{cls.name}:{int(top_k)}", vocab_size, dtype, k=int(top_k))
        kind.check_vocab()
        return kind

    def check_vocab(self) -> None:
        if self.vocab_size is not None and self._k > self.vocab_size:
            raise LogitdiffError(f"--store {self.text!r}: K={self._k} exceeds the vocabulary size {self.vocab_size}")

    @property
    def k(self) -> int:
        return self._k

    @property
    def top_entries(self) -> int | None:
        return self._k

    def describe(self) -> str:
        return f"top-{self._k}"

    @property
    def row_bytes(self) -> int:
        # top-K ids (int64) + logprobs (float64) + 3 float64 stats
        return self._k * 16 + 24

    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Block:
        from ...numerics import metrics as M

        z = bf16_to_f32(rows) if rows.dtype == np.uint16 else rows
        st = M.row_stats(z, k=self._k)
        return {"ids": st["topk_ids"], "logprobs": st["topk_logprobs"], "logsumexp": st["logsumexp"],
                "tail_mass": st["tail_mass"], "entropy": st["entropy"]}

    def encode_topk(self, ids: np.ndarray, logprobs: np.ndarray, place: BlockPlace) -> Block:
        if ids.shape[1] < self._k:
            raise LogitdiffError(f"the source returned {ids.shape[1]} logprobs per position, fewer than K={self._k}")
        return {"ids": ids[:, : self._k], "logprobs": logprobs[:, : self._k]}

    def check_block(self, block: Block, place: BlockPlace) -> tuple[Block, int]:
        if not isinstance(block, dict) or "ids" not in block or "logprobs" not in block:
            raise LogitdiffError(f"{place.where}: a top-K run takes dicts of 'ids' and 'logprobs' rows")
        rows = {key: np.asarray(v) for key, v in block.items()}
        n = rows["ids"].shape[0] if rows["ids"].ndim == 2 else -1
        for key in ("ids", "logprobs"):
            if rows[key].ndim != 2 or rows[key].shape != (n, self._k) or n > place.n_left:
                raise LogitdiffError(f"{place.where}: top-K {key} shape {rows[key].shape}, expected (<= {place.n_left}, {self._k})")
        validate.topk_rows(rows["ids"], rows["logprobs"], int(self.vocab_size or 0), self._k, place.where, label=place.label)
        return rows, n

    def save_chunk(self, path: Path, blocks: list[Block]) -> None:
        if blocks:
            cat = {key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}
        else:
            cat = {"ids": np.zeros((0, self._k), np.int64), "logprobs": np.zeros((0, self._k), np.float64)}
        bio = io.BytesIO()
        np.savez(bio, allow_pickle=False, **cat)
        atomic_write_bytes_unsynced(path, bio.getvalue())  # fsynced by RunWriter before it lists the chunk

    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Block:
        from ..npzinflate import read_npz

        data = read_npz(path, max_bytes=max_bytes)
        if "ids" not in data or "logprobs" not in data:
            raise LogitdiffError(f"{path}: top-K chunk without 'ids' and 'logprobs' arrays; the run is damaged")
        validate.topk_rows(data["ids"], data["logprobs"], int(self.vocab_size or 0), self._k, str(path), label=label)
        return data
