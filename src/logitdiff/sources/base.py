"""The source contract: two declared kinds of source and the types they hand out.

A source is one of two kinds (:class:`RowKind`), and its kind fixes the type of its rows:

* :class:`FullLogitSource` (``RowKind.FULL``; transformers, llama.cpp in process): a row is
  the float logits over the whole vocabulary, ``[r, V]`` float32 (bf16 bits as uint16 when
  the source's ``logits_dtype`` is ``"bfloat16"``).
* :class:`TopKSource` (``RowKind.TOPK``; served models): a row is the K highest
  log-probabilities of the distribution, :class:`TopKRows` (``ids`` int64 ``[r, K]``,
  ``logprobs`` float64 ``[r, K]``, descending, normalised over the whole vocabulary).

Capture and compare dispatch on ``source.row_kind``, never on the type of a value.
Generation is the same for both kinds: token ids only (:class:`Generation`), never logits.

This module is a leaf: it imports nothing else of ``logitdiff.sources``, so a backend (or
:mod:`logitdiff.builtin`) can import it without importing the registry.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, TypeGuard

import numpy as np

from ..errors import LogitdiffError


class RowKind(str, enum.Enum):
    """What one scored row of a source is (see the module docstring)."""

    FULL = "full"  # float logits over the vocabulary
    TOPK = "topk"  # the K best token ids and their log-probabilities

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TopKRows:
    """Rows of a top-K source: ``ids`` int64 ``[r, K]`` and ``logprobs`` float64 ``[r, K]``,
    each row descending (lowest id first on ties)."""

    ids: np.ndarray
    logprobs: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    def take(self, rows) -> "TopKRows":
        """The rows at the given indices (or a slice)."""
        return TopKRows(self.ids[rows], self.logprobs[rows])

    def as_dict(self) -> dict[str, np.ndarray]:
        """``{"ids", "logprobs"}``: the form a RUN's top-K store reads back as."""
        return {"ids": self.ids, "logprobs": self.logprobs}

    @staticmethod
    def empty(k: int) -> "TopKRows":
        return TopKRows(np.zeros((0, k), np.int64), np.zeros((0, k), np.float64))

    @staticmethod
    def stack(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> "TopKRows":
        """One row per (ids [K], logprobs [K]) pair."""
        return TopKRows(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))


@dataclass
class Generation:
    """A greedy continuation (temperature 0) by the source's own engine: token ids only, for
    every kind of source. A full-logit source takes ``token_ids[t]`` as the argmax (lowest id
    on ties) of its logits after ``prompt + token_ids[:t]``; a served source reports the
    server's greedy decode. Distributions come from one teacher-forced prefill afterwards
    (``score_blocks``), so generation never holds a ``[length, V]`` array."""

    token_ids: list[int]
    stopped_by: str = "max_tokens"  # "eos" | "max_tokens"


@dataclass
class Block:
    """Rows ``t0 .. t0 + len(rows)`` of the selected positions of pair ``pair`` of a
    ``score_blocks`` call; ``rows`` has the type of the source's :class:`RowKind`:
    ``np.ndarray`` for ``FULL``, :class:`TopKRows` for ``TOPK``."""

    pair: int
    t0: int
    rows: np.ndarray | TopKRows
    # the output head's input of each row (bf16 bits [n, H]), only when the caller asked for
    # it (``score_blocks(..., with_hidden=True)``, sources with an ``output_head``)
    hidden: np.ndarray | None = None


@dataclass
class Spec:
    kind: str
    target: str
    options: dict[str, str] = field(default_factory=dict)
    text: str = ""


def parse_spec(text: str) -> Spec:
    """Split ``kind:target,key=value,...``. Targets may themselves contain ':' (URLs)."""
    if ":" not in text:
        raise LogitdiffError(
            f"source spec {text!r}: expected KIND:TARGET (hf:PATH, gguf:PATH, served:URL, builtin:NAME)"
        )
    kind, rest = text.split(":", 1)
    parts = rest.split(",")
    target = parts[0]
    options: dict[str, str] = {}
    for part in parts[1:]:
        if "=" not in part:
            raise LogitdiffError(f"source spec {text!r}: option {part!r} is not key=value")
        k, v = part.split("=", 1)
        options[k.strip()] = v.strip()
    return Spec(kind=kind.strip(), target=target, options=options, text=text)


def tokenizer_hash_of(tokens: Sequence[str | None]) -> str:
    """Content hash of a vocabulary: token strings in id order.

    Backends that hold the same vocabulary (a HF ``tokenizer.json`` and the GGUF
    ``tokenizer.ggml.tokens`` converted from it) give the same hash. An id without a token
    (None: a hole in a HF vocabulary) hashes as the byte 0xff, which no UTF-8 text holds.
    """
    h = hashlib.sha256()
    for t in tokens:
        h.update(b"\xff" if t is None else t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return "sha256:" + h.hexdigest()


class Source:
    """What every source has; use :class:`FullLogitSource` or :class:`TopKSource`.

    Subclasses set ``spec``, ``vocab_size``, ``tokenizer_hash``. ``threads`` is the CPU
    thread count the spec asked for (None: not asked); opening a source never applies it
    process-wide: the program's entry point reads it (:func:`requested_threads`).
    """

    row_kind: RowKind
    spec: str
    vocab_size: int  # size of the distribution rows the source describes
    tokenizer_hash: str | None
    # the token strings the hash is of (tokenizer_identity.py compares them under converter spellings)
    tokenizer_tokens: list[str | None] | None = None
    eos_token_ids: tuple[int, ...] = ()
    threads: int | None = None
    batch: int | None = None  # sequences per forward pass (or request), where the backend batches
    # what computes the numbers, as notes name it (e.g. "transformers", "llama.cpp in process")
    engine: str = "this backend"
    # True: score_blocks runs each sequence in its own forward pass, so a sequence never has
    # batch mates and moving the batch boundaries cannot change a number (the noise floor's
    # rerun with other batch mates is then skipped: pipeline/floors.py)
    scores_alone: bool = False
    # Equal, not None, for two sources only where both render every item to the same ids
    # without either rendering it: the renderer and a digest of everything it reads (a GGUF's
    # metadata: sources/gguf_meta.py); capture.preflight_tokenization renders one of them.
    render_identity: str | None = None
    _token_texts: list[str] | None = None

    # --- tokenization -------------------------------------------------------------
    def render(self, item: Any) -> list[int]:
        """Prompt token ids for a workload item (chat template + tools applied)."""
        raise NotImplementedError

    def render_many(self, items: Sequence[Any]) -> list[list[int]]:
        """`render` of several items, in order (served sources overlap the requests)."""
        return [self.render(it) for it in items]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def document_ids(self, text: str) -> tuple[list[int], int | None]:
        """``text`` tokenized as one document, as llama.cpp's tools tokenize a file (BOS first
        when the model adds one, special-token text read as plain text), and the BOS id every
        chunk of it starts with (None: the model adds no BOS). What ``text:`` workloads read."""
        raise LogitdiffError(f"{self.spec}: this source cannot tokenize a plain text document "
                             "(a text: workload needs a gguf: source)")

    def token_text(self, token_id: int) -> str:
        """Printable text of one token (for reports)."""
        return self.detokenize([token_id])

    def token_texts(self) -> list[str]:
        """Printable texts of all ``vocab_size`` token ids, computed once per open source."""
        if self._token_texts is None or len(self._token_texts) != self.vocab_size:
            self._token_texts = [self.token_text(i) for i in range(self.vocab_size)]
        return self._token_texts

    # --- model --------------------------------------------------------------------
    def forward_threads(self) -> int:
        """The CPU threads of this machine a forward pass keeps busy (0: it runs elsewhere,
        a server or a GPU). A live comparison gives the metrics the other CPUs, so the
        metrics computed beside the next forward pass (capture/ahead.py) do not take cores
        from it."""
        return 0

    # Whether ``score_blocks`` may run on a worker thread beside the caller (capture/ahead.py):
    # llama.cpp in process (one context, used from that thread alone). Not torch: its thread
    # count is process-wide, set by the entry point from the main thread (`applied_threads`),
    # so its forward passes stay on the caller's thread.
    forward_on_worker: bool = False

    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        raise NotImplementedError

    def generate_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[Generation]:
        """Greedy continuations of several prompts; backends override to batch them."""
        return [self.generate(p, n) for p, n in zip(prompts, max_tokens)]

    def score_blocks(
        self,
        batch: Sequence[tuple[Sequence[int], Sequence[int]]],
        positions: Sequence[Sequence[int] | None] | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> Iterator[Block]:
        """Teacher-forced rows of several (prompt, teacher) pairs as a stream of
        :class:`Block`, pair by pair in the given order and in position order within a
        pair. ``positions[k]`` (sorted output positions, None = all) selects the rows of
        pair k: only those are produced."""
        raise NotImplementedError

    def output_head(self) -> np.ndarray | None:
        """The output head ``[vocab_size, H]`` as bf16 bits when the source's logits are
        exactly ``bf16(head @ hidden)`` and its ``score_blocks`` takes ``with_hidden=True``
        (what ``--store hidden`` needs); None otherwise."""
        return None

    def identity(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - trivial
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FullLogitSource(Source):
    """A source of float logits over the whole vocabulary (``RowKind.FULL``).

    ``logits_dtype``: what its rows hold, ``"float32"`` or the model's own 16-bit dtype
    (``"bfloat16"``: rows are bf16 bits as uint16)."""

    row_kind = RowKind.FULL
    logits_dtype: str = "float32"

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> np.ndarray:
        """Logits ``[len(teacher_ids), V]``: row t predicts ``teacher_ids[t]``."""
        raise NotImplementedError

    def score_many(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Several (prompt, teacher) pairs; backends override to batch."""
        return [self.score(p, t) for p, t in batch]

    def score_blocks(self, batch, positions=None, *, chunk_bytes=None) -> Iterator[Block]:
        """As :meth:`Source.score_blocks`; a block holds at most ``chunk_bytes`` of float32
        rows (the last of a pair may be shorter). This version scores one pair at a time
        (``score``) and cuts it up: backends that can (transformers, llama.cpp) override it
        to compute a block at a time."""
        from ..store import rows_per_block

        step = max(1, rows_per_block(self.vocab_size, chunk_bytes))
        for k, (p, t) in enumerate(batch):
            pos = None if positions is None else positions[k]
            if pos is not None and not len(pos):
                continue
            scored = np.asarray(self.score(p, t))
            if pos is not None:
                scored = scored[list(pos)]
            for a in range(0, scored.shape[0], step):
                yield Block(k, a, scored[a : a + step])


class TopKSource(Source):
    """A source of the K best log-probabilities per position (``RowKind.TOPK``; served
    models): rows are :class:`TopKRows` with ``top_k`` = K columns."""

    row_kind = RowKind.TOPK
    top_k: int

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> TopKRows:
        """Top-K ``[len(teacher_ids), K]``: row t predicts ``teacher_ids[t]``."""
        return self.score_many([(prompt_ids, teacher_ids)])[0]

    def score_many(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TopKRows]:
        raise NotImplementedError

    def score_blocks(self, batch, positions=None, *, chunk_bytes=None) -> Iterator[Block]:
        """As :meth:`Source.score_blocks`, one block per pair: top-K rows are small, so the
        whole batch is scored in one call (a server runs its requests concurrently)."""
        many = self.score_many(batch)
        for k, scored in enumerate(many):
            pos = None if positions is None else positions[k]
            if pos is not None and not len(pos):
                continue
            if pos is not None:
                scored = scored.take(list(pos))
            if len(scored):
                yield Block(k, 0, scored)


def is_topk(source: Source) -> TypeGuard[TopKSource]:
    """Whether ``source`` gives top-K rows: its ``row_kind``, never its class, decides; the
    TypeGuard tells a type checker what the kind promises (``top_k``, TopKRows rows)."""
    return source.row_kind is RowKind.TOPK


def is_full(source: Source) -> TypeGuard[FullLogitSource]:
    """Whether ``source`` gives full logit rows (``row_kind``; ``logits_dtype``, array rows)."""
    return source.row_kind is RowKind.FULL


def requested_threads(sources: Sequence[Source]) -> int | None:
    """The CPU thread count the sources' specs asked for (the smallest if several did), or
    None: what a program's entry point passes to ``torch.set_num_threads`` once, explicitly
    (opening a source never sets it)."""
    asked = [t for s in sources if (t := getattr(s, "threads", None))]
    return min(asked) if asked else None


@contextlib.contextmanager
def applied_threads(sources: Sequence[Source]):
    """For the duration of a job, torch's intra-op thread count as the sources asked
    (:func:`requested_threads`; nothing when none asked), then the count as it was.

    torch has one process-wide count and no per-model knob, so this is the one place it is
    set, explicitly, by the job that owns the process for that while (``capture``,
    ``compare`` with a live candidate, ``run``, ``flips``); opening a source never sets it,
    and the metrics take their own thread count as a parameter."""
    n = requested_threads(sources)
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
