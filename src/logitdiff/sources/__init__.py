"""Sources: where next-token distributions come from, behind one small interface.

A source is named by a spec string ``KIND:TARGET[,key=value...]``:

    hf:PATH[,dtype=bfloat16|float32][,device=cpu|cuda]
    gguf:PATH[,n_ctx=N][,threads=N]
    builtin:tiny            the bundled model through transformers (BF16)
    builtin:tiny-F32        ... through transformers in float32
    builtin:tiny-Q4_K_M     a GGUF of the bundled model's quant ladder (llama.cpp)

Every source can

* ``render(item)``       -> prompt token ids (chat template and tools applied),
* ``generate(ids, n)``   -> greedy continuation ids (ids only: no logits are kept),
* ``generate_many``      -> several prompts, batched where the backend can,
* ``score(ids, teacher)``-> logits ``[len(teacher), V]``; row t is the distribution of
                            the next token after ``ids + teacher[:t]`` (teacher forcing),
* ``score_blocks``       -> the same rows as a stream of bounded blocks (what capture and
                            live compare use: memory is a block, not an output),
* ``identity()``         -> a JSON-able description (files, hashes, dtype, versions...).

Output position t therefore always means "the distribution that predicts teacher[t]".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import LogitdiffError


@dataclass
class Generation:
    """A greedy continuation: ``token_ids[t]`` is the argmax of the distribution after
    ``prompt + token_ids[:t]``. Only the ids are kept: distributions come from one
    teacher-forced prefill afterwards (``score_blocks``), so generation never holds a
    ``[length, V]`` array."""

    token_ids: list[int]
    stopped_by: str = "max_tokens"  # "eos" | "max_tokens"


@dataclass
class Block:
    """Rows ``t0 .. t0 + len(rows)`` of the selected positions of pair ``pair`` of a
    ``score_blocks`` call: ``rows`` is float logits ``[r, V]`` (bf16 bits as uint16 when the
    source's ``logits_dtype`` is ``"bfloat16"``) or, for top-K sources, ``{"ids", "logprobs"}``."""

    pair: int
    t0: int
    rows: Any


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
            f"source spec {text!r}: expected KIND:TARGET (hf:PATH, gguf:PATH, openai:URL, builtin:NAME)"
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


def tokenizer_hash_of(tokens: Sequence[str]) -> str:
    """Content hash of a vocabulary: token strings in id order.

    Backends that hold the same vocabulary (a HF ``tokenizer.json`` and the GGUF
    ``tokenizer.ggml.tokens`` converted from it) give the same hash.
    """
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return "sha256:" + h.hexdigest()


def file_sha256(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return "sha256:" + h.hexdigest()


class Source:
    """Base class. Subclasses set ``spec``, ``vocab_size``, ``tokenizer_hash``.

    ``distribution`` is ``"full"`` (``score``/``score_many`` return float logits
    ``[T, V]``) or ``"topk"`` (served models: they return ``{"ids": int [T, K],
    "logprobs": float64 [T, K]}``, descending, log-probabilities normalised over the whole
    vocabulary, with ``top_k`` = K).
    """

    spec: str
    distribution: str = "full"
    top_k: int = 0
    vocab_size: int  # size of the distribution rows the source returns
    tokenizer_hash: str
    eos_token_ids: tuple[int, ...] = ()

    # --- tokenization -------------------------------------------------------------
    def render(self, item: Any) -> list[int]:
        """Prompt token ids for a workload item (chat template + tools applied)."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """Printable text of one token (for reports)."""
        return self.detokenize([token_id])

    # --- model --------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        raise NotImplementedError

    def generate_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[Generation]:
        """Greedy continuations of several prompts; backends override to batch them."""
        return [self.generate(p, n) for p, n in zip(prompts, max_tokens)]

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> np.ndarray:
        """Logits ``[len(teacher_ids), V]``: row t predicts ``teacher_ids[t]``."""
        raise NotImplementedError

    def score_many(
        self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[np.ndarray]:
        """Several (prompt, teacher) pairs; backends override to batch."""
        return [self.score(p, t) for p, t in batch]

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
        pair k: only those are produced. A block holds at most ``chunk_bytes`` of float32
        rows (the last of a pair may be shorter).

        This base version scores one pair at a time (``score``) and cuts it up: backends
        that can (transformers, llama.cpp) override it to compute a block at a time."""
        from ..store import rows_per_block

        # Top-K rows are small: a served source scores the whole batch in one call (its
        # requests run concurrently); a full-logits source one pair at a time.
        many = self.score_many(batch) if self.distribution == "topk" else None
        for k, (p, t) in enumerate(batch):
            pos = None if positions is None else positions[k]
            if pos is not None and not len(pos):
                continue
            scored = many[k] if many is not None else self.score(p, t)
            if pos is not None:
                scored = {kk: np.asarray(v)[list(pos)] for kk, v in scored.items()} if isinstance(scored, dict) else np.asarray(scored)[list(pos)]
            n = (scored["ids"] if isinstance(scored, dict) else scored).shape[0]
            step = n if isinstance(scored, dict) else rows_per_block(self.vocab_size, chunk_bytes)
            for a in range(0, n, max(1, step)):
                rows = {kk: v[a : a + step] for kk, v in scored.items()} if isinstance(scored, dict) else scored[a : a + step]
                yield Block(k, a, rows)

    def identity(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - trivial
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_source(text: str) -> Source:
    """Build a source from its spec string."""
    spec = parse_spec(text)
    if spec.kind == "hf":
        from .hf import HFSource

        return HFSource.from_spec(spec)
    if spec.kind == "gguf":
        from .gguf import GGUFSource

        return GGUFSource.from_spec(spec)
    if spec.kind == "builtin":
        from ..builtin import open_builtin

        return open_builtin(spec)
    if spec.kind == "openai":
        from .openai import OpenAISource

        return OpenAISource.from_spec(spec)
    raise LogitdiffError(
        f"source spec {text!r}: unknown kind {spec.kind!r} (expected hf, gguf, openai or builtin)"
    )


def json_safe(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
