"""What every store kind (``--store TEXT``) implements, and nothing else: ``RunWriter`` and
``RunReader`` (store.py) hold one kind object per run and call it; they never ask which kind
it is. A kind says how its ``--store`` text is spelled, what a reader gets from it
(:class:`RowsForm`: the comparison methods are chosen from the forms of the two runs), how
a block of a source's full rows is encoded, how a chunk file is written and read back and
how stored rows decode to what a reader hands out.

Blocks travel in two forms: *stored* (what a chunk file holds: encoded, the form ``merge``
copies without decoding) and *readable* (what ``RunReader.row_blocks`` yields: full rows
``[r, V]``, or dicts of arrays with ``r`` rows). For most kinds the two are the same object.
"""

from __future__ import annotations

import copy
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from ...errors import LogitdiffError
from .rows import DTYPES, nonfinite_row

# One block of rows in a kind's stored or readable form: an array [r, V] (full rows) or a
# dict of arrays with r rows each (top-K lists, a compact reference, hidden states).
Block = Any


class ChunkFile(Protocol):
    """A chunk file being written (``StoreKind.open_chunk``): ``append`` each stored block,
    then ``close`` (whole under its name, not yet durable), or ``abort`` (nothing left)."""

    def append(self, block: Block) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class KeptBlocks:
    """The default :class:`ChunkFile`: keeps the blocks and hands them to ``save`` at ``close``."""

    def __init__(self, save) -> None:
        self._save = save
        self._blocks: list[Block] = []

    def append(self, block: Block) -> None:
        self._blocks.append(block)

    def close(self) -> None:
        blocks, self._blocks = self._blocks, []
        self._save(blocks)

    def abort(self) -> None:
        self._blocks = []


class RowsForm(str, enum.Enum):
    """What a reader of a run gets, whatever the kind stores."""

    FULL = "full rows"  # logits [r, V]: exact comparisons
    TOPK = "top-K lists"  # {"ids", "logprobs", ...} [r, K]: approximate, with proven intervals
    BOUNDED = "bounded rows"  # a reference's arrays that bound each row (compact): bounded comparisons

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BlockPlace:
    """Where a block of rows goes: its item and the item's rows before it (for the block's
    teacher tokens and for one-line errors that name the output position)."""

    item_id: str
    positions: Sequence[int]
    teacher_ids: Sequence[int]
    row0: int = 0

    @property
    def where(self) -> str:
        return f"item {self.item_id!r}"

    @property
    def n_left(self) -> int:
        return len(self.positions) - self.row0

    def label(self, r: int) -> str:
        """Row ``r`` of the block in words."""
        return f"output position {self.positions[self.row0 + r]}"

    def next_tokens(self, n: int) -> np.ndarray:
        """The teacher tokens the block's ``n`` rows predict."""
        pos = np.asarray(self.positions[self.row0 : self.row0 + n], dtype=np.int64)
        return np.asarray(self.teacher_ids, dtype=np.int64)[pos] if len(pos) else np.zeros(0, np.int64)


def cut_rows(block: Block, a: int, b: int) -> Block:
    """Rows a..b of a readable block: an array, or a dict of arrays with one row count
    (views, no copy)."""
    if isinstance(block, dict):
        return {key: v[a:b] for key, v in block.items()}
    return block[a:b]


def check_full_rows(rows: Any, place: BlockPlace, vocab_size: int, dtype: str | None) -> np.ndarray:
    """A block of full logits for ``place``: ``[<= rows left, V]``, no NaN/inf; else a
    one-line error naming the item and output position."""
    rows = np.asarray(rows)
    n = rows.shape[0] if rows.ndim == 2 else -1
    if rows.ndim != 2 or rows.shape[1] != vocab_size or n > place.n_left:
        raise LogitdiffError(
            f"{place.where}: logits shape {rows.shape}, expected ({len(place.positions)}, {vocab_size})"
            + (f" in blocks ({place.n_left} rows left)" if place.row0 else "")
        )
    bad = nonfinite_row(rows, dtype)
    if bad is not None:
        raise LogitdiffError(f"{place.where}: NaN/inf logits at {place.label(bad)}")
    return rows


class StoreKind(ABC):
    """One store kind, bound to one run (its vocabulary size and the source's logits dtype,
    either may be unknown while only the ``--store`` text is checked).

    Subclasses set the class attributes, implement the abstract methods and are listed in
    ``storekinds.STORE_KINDS`` under ``name``; the other methods have defaults that fit a
    kind whose stored form is its readable form and that needs nothing beside its chunks."""

    name: ClassVar[str]  # the first word of the --store text (its key in STORE_KINDS)
    usage: ClassVar[str]  # how --store spells it, for errors and --help
    summary: ClassVar[str] = ""  # what it keeps, in a few words (--help)
    reads_as: ClassVar[RowsForm]  # what RunReader hands out for this kind
    chunk_suffix: ClassVar[str]  # file name of a chunk's rows: NNNNNN.<suffix>
    keeps_dtype: ClassVar[bool] = True  # settings.dtype records the source's logits dtype
    needs_hidden_states: ClassVar[bool] = False  # encode takes the block's final hidden states too
    # a reader gets the source's rows back bit for bit: a choice of ``run --reference-store``
    lossless: ClassVar[bool] = False
    # ``run --reference-store auto`` takes, of the lossless kinds that can keep the reference
    # (``can_keep``), the one of the highest rank (the first registered among equals)
    auto_rank: ClassVar[int] = 0

    def __init__(self, text: str, vocab_size: int | None = None, dtype: str | None = None) -> None:
        self.text = text  # the --store text, as the manifest's settings.store records it
        self.vocab_size = vocab_size
        self.dtype = dtype

    @classmethod
    def parse(cls, text: str, vocab_size: int | None = None, dtype: str | None = None) -> StoreKind:
        """The kind of a ``--store`` text whose first word is ``name``; a one-line error when
        the rest does not fit (default: the text is the name alone)."""
        if text != cls.name:
            raise LogitdiffError(f"--store {text!r}: expected {cls.usage}")
        return cls(text, vocab_size, dtype)

    @classmethod
    def can_keep(cls, source: Any) -> bool:
        """Whether this kind can store what ``source`` (a ``sources.Source``) gives; default:
        any source (a kind that needs more, such as the output head, says so)."""
        return True

    @classmethod
    def as_given(cls, top_k: int, vocab_size: int | None, dtype: str | None) -> StoreKind | None:
        """This kind keeping a source's rows as the source gives them: full rows (``top_k`` 0)
        or top-K lists of ``top_k`` entries; None (the default) when it does not keep them so."""
        return None

    def bound(self, vocab_size: int, dtype: str | None) -> StoreKind:
        """This kind (parsed once from its text) bound to a run's vocabulary size and logits
        dtype: itself when it already is, else a copy, checked against the vocabulary."""
        if self.vocab_size == vocab_size and self.dtype == dtype:
            return self
        kind = copy.copy(self)
        kind.vocab_size, kind.dtype = vocab_size, dtype
        kind.check_vocab()
        return kind

    def check_vocab(self) -> None:
        """A one-line error when the kind does not fit its run's vocabulary (default: any fits)."""

    # ------------------------------------------------------------------ what it holds
    @property
    def k(self) -> int:
        """Entries of the top-K lists a reader gets (0: not a top-K store)."""
        return 0

    @property
    def top_entries(self) -> int | None:
        """The most top entries a comparison can read exactly from a row (None: all of V)."""
        return None

    def describe(self) -> str:
        """What the run stores, in words (errors: "run stores ..., not full logits")."""
        return f"{self.text} rows"

    # ------------------------------------------------------------------ writing
    @property
    @abstractmethod
    def row_bytes(self) -> int:
        """Bytes of one row as buffered before a chunk is written (sizes a chunk)."""

    def manifest_dtype(self) -> str | None:
        """settings.dtype of a run of this kind (None: its rows carry no logits dtype)."""
        return self.dtype if self.keeps_dtype else None

    def start_writing(self, head: np.ndarray | None = None) -> dict[str, Any]:
        """Check that the source fits the kind (its dtype; ``head``: the source's output
        head, for kinds that need one) and return the manifest fields the kind adds."""
        if self.dtype not in DTYPES:
            raise LogitdiffError(f"dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        return {}

    def write_files(self, run: Path, fresh: bool) -> None:
        """Files besides the chunks (written once; ``fresh``: a new run, not a resumed one)."""

    @abstractmethod
    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Block:
        """A block of a source's full rows (checked, in the run's dtype; bf16 as uint16 bits)
        -> the stored form. ``hidden``: the block's hidden states when ``needs_hidden_states``."""

    def encode_topk(self, ids: np.ndarray, logprobs: np.ndarray, place: BlockPlace) -> Block:
        """A block of a top-K source's rows (served model) -> the stored form."""
        raise LogitdiffError(f"--store {self.text}: a top-K source cannot fill it (it needs full logits); "
                             "a top-K source can only be stored with --store topk:K")

    @abstractmethod
    def check_block(self, block: Block, place: BlockPlace) -> tuple[Block, int]:
        """A block already in the stored form (from ``merge`` or a library caller): checked
        against the run, with its number of rows."""

    @abstractmethod
    def save_chunk(self, path: Path, blocks: list[Block]) -> None:
        """Write the stored blocks (maybe none) as one chunk file, whole under ``path`` or not
        at all (outputs.py); not necessarily durable: ``RunWriter`` fsyncs it before listing it."""

    def open_chunk(self, path: Path) -> ChunkFile:
        """The chunk file ``path`` to be written block by block (``RunWriter``'s writer thread:
        ``append`` each stored block, then ``close``; ``abort`` on failure). Default: the
        blocks are kept and written by ``save_chunk`` at ``close``; a kind whose file can
        take its rows as they come (full rows) overrides it."""
        return KeptBlocks(lambda blocks: self.save_chunk(path, blocks))

    def stop_writing(self) -> None:
        """The writer is done (finished or closed): let go of what writing kept between
        chunks (buffers); a later chunk would make them again. Default: nothing kept."""

    # ------------------------------------------------------------------ reading
    def start_reading(self, run: Path, manifest: dict[str, Any]) -> None:
        """Check the manifest fields the kind adds (a one-line error naming the field)."""

    def chunk_bound(self, rows: int) -> int:
        """The most bytes the arrays of a chunk of ``rows`` rows hold together, before any
        compression (``rows``: its manifest entry's count). A compressed member claiming more
        is refused before it is inflated (npzinflate.read_npz): a chunk cannot make a reader
        allocate beyond what its rows stand for. Default: ``row_bytes`` per row, for a kind
        whose ``row_bytes`` counts every array of a row at its widest stored dtype."""
        return max(0, int(rows)) * self.row_bytes

    @abstractmethod
    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Block:
        """A chunk file's rows in the stored form, checked (``label(r)`` names row r in
        errors; ``max_bytes``: what its arrays may hold, :meth:`chunk_bound` of its declared
        rows). Raises LogitdiffError, or ValueError/OSError/KeyError... for a damaged file."""

    def rows_in(self, block: Block) -> int:
        """Rows of a block."""
        if isinstance(block, dict):
            return int(next(iter(block.values())).shape[0])
        return int(block.shape[0]) if block.ndim else 0

    def cut_stored(self, block: Block, a: int, b: int) -> Block:
        """Rows a..b of a block in the stored form (default: as `cut_rows`)."""
        return cut_rows(block, a, b)

    def decode(self, block: Block, device: Any = None, float32: bool = False) -> Block:
        """A chunk's stored rows -> its readable rows (default: the same). ``float32``: full
        rows as float32 values, for a kind that ``decodes`` (RunReader.decode_to_float32 asks
        only those)."""
        return block

    def values(self, rows: Block, raw: bool = False) -> Block:
        """Readable rows as a reader hands them out: full rows as float values unless
        ``raw`` (the stored dtype, bf16 bits as uint16); other forms as they are."""
        return rows

    def writer_args(self) -> dict[str, Any]:
        """What a writer of the same kind needs besides the rows (``merge``)."""
        return {}
