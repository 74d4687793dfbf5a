"""What every served source shares: options, the model/vocabulary/tokenizer handshake,
the validation of one position's top-K (:func:`topk_row`), token texts, identity.

One subclass per server kind (:mod:`.llamacpp`, :mod:`.vllm`, :mod:`.sglang`) speaks its
protocol: tokenization, generation and teacher-forced scoring.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...store import validate
from ...errors import LogitdiffError
from ...contracts import json_clean
from ..base import Generation, TopKRows, TopKSource, tokenizer_hash_of
from ..chat_template import render_bounded
from .client import HttpClient, ServerError, ServerKind, endpoint_host, one_line

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from transformers import PreTrainedTokenizerBase

SUM_TOL = 1e-4
#: ``batching=`` of a ``served:`` spec: how scoring tasks share the server's batches
SERIAL, ROUNDS = "serial", "rounds"
BATCHING = {
    ROUNDS: "concurrent: several items in flight, so a server batch mixes tasks of several items (llama-server: "
            "rounds of unpinned tasks, or one pinned slot per item; vLLM/SGLang: concurrent requests); fast, but a "
            "row's arithmetic depends on its batch mates, so two captures differ by the served floor",
    SERIAL: "serial: one item at a time and one task per server batch (one request in flight); slower, and rows "
            "do not depend on other items' requests",
}
#: blocks a served source scores ahead (:meth:`ServedSource.prefetch`): their rows wait in
#: memory until asked for, so memory stays a few blocks of top-K rows whatever the workload
PREFETCH_BLOCKS = 4
#: token ids per /detokenize request when token texts come from the server (a few MB of JSON)
DETOKENIZE_CHUNK = 65_536
#: candidate separators between token texts in one /detokenize request (see ServedSource._separator)
SEPARATORS = ("[[~logitdiff|sep~]]", "{@ld#7f3a@}", "<~ld~sep~>")


def _border_free(s: str) -> bool:
    """No proper prefix of ``s`` is also a suffix: occurrences of ``s`` never overlap."""
    return all(s[:i] != s[-i:] for i in range(1, len(s)))


def topk_row(pairs: list[tuple[Any, Any]], k: int, where: str, *, ordered: bool, forced: int | None = None,
             vocab_size: int | None = None, keys: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise one position: ``pairs`` = (token id, logprob) as the server sent them.

    ``ordered``: the server promises a descending list (checked). ``forced``: the token the
    protocol promises to include (vLLM). Ids and logprobs are judged by :mod:`...validate`
    (ids in [0, ``vocab_size``), ``keys``: ids sent as JSON object keys). Returns the K best
    (descending, lowest id on ties).
    """
    clean = []
    if not isinstance(pairs, list):
        raise LogitdiffError(f"{where}: the server's top-K list is {type(pairs).__name__}, not a list")
    for tid, lp in pairs:
        tid = validate.token_id(tid, vocab_size, where, keys=keys)
        lp = validate.logprob(lp, f"{where}, token {tid}")
        if lp is None:
            continue
        clean.append((tid, lp))
    if ordered:
        lps = [lp for _, lp in clean]
        if any(b > a for a, b in zip(lps, lps[1:])):
            raise LogitdiffError(f"{where}: the server's top-K list is not sorted by logprob (refusing it)")
    if forced is not None and not any(t == forced for t, _ in clean):
        raise LogitdiffError(f"{where}: the server's logprobs lack the scored token {forced}, which its protocol always includes")
    clean.sort(key=lambda x: (-x[1], x[0]))
    finite = [(t, lp) for t, lp in clean if math.isfinite(lp)]
    if len({t for t, _ in finite}) != len(finite):
        raise LogitdiffError(f"{where}: the server returned a token twice in one top-K list")
    if len(finite) < k:
        raise LogitdiffError(
            f"{where}: the server returned {len(finite)} < K={k} finite logprobs (processed/truncated "
            "distribution or a server cap; lower top_k or raise the server's limit)"
        )
    top = finite[:k]
    total = math.fsum(math.exp(lp) for _, lp in top)
    if total > 1.0 + SUM_TOL:
        raise LogitdiffError(f"{where}: the top-{k} probabilities sum to {total:.6f} > 1: not raw normalised logprobs")
    return np.array([t for t, _ in top], np.int64), np.array([lp for _, lp in top], np.float64)


#: what parsing an answer of the wrong shape raises (a missing key, a string where a list
#: belongs, a number beyond float range): turned into one line by :func:`malformed`
MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError)


def malformed(spec: str, what: str, e: BaseException) -> LogitdiffError:
    """One line for a server answer that does not have the protocol's shape."""
    detail = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {one_line(e, 160)}"
    return LogitdiffError(f"{spec}: {what}: the server's answer is malformed ({detail})")


class ServedSource(TopKSource):
    """A model behind an OpenAI-compatible server, as a source of top-K logprobs.

    Subclasses set ``kind`` and implement the protocol hooks (``_probe_server``,
    ``_render_ids``, ``_tokenize_text``, ``_tokenize_literal``, ``_detokenize_ids``,
    ``_server_detokenize``, ``_generate``, ``_score``). Built by
    :func:`logitdiff.sources.served.open_served`, which owns the client until this is open.
    """

    engine = "the server"

    kind: ServerKind
    batch: int  # sequences per request (never None here, unlike Source.batch)
    #: a model list that a server may refuse (SGLang): then no model check
    models_optional = False
    #: a token whose text is one complete ASCII character, where the protocol needs one
    #: (llama-server sets it; see LlamaServerSource._ascii_token)
    _force_tok: int | None = None
    #: called with the (prompt, generated ids) pairs of every generate_many: what a job that
    #: scores another source on this one's generations hands to that source's prefetch (pipeline.py)
    on_generated = None
    #: whether `run` scores this candidate ahead, on each reference block while the reference
    #: generates the next: on, off, auto (on when the two servers are on different hosts)
    overlap = "auto"

    def __init__(
        self,
        client: HttpClient,
        *,
        model: str | None = None,
        top_k: int = 64,
        batch: int = 4,
        vocab_size: int | None = None,
        tokenizer: str | None = None,
        cache_prompt: bool = True,
        batching: str = ROUNDS,
        spec: str,
    ):
        self._client: HttpClient | None = client  # None once closed
        self.roots = client.roots
        self.spec = spec
        self.top_k = int(top_k)
        self.batch = max(1, int(batch))
        self.cache_prompt = cache_prompt
        self.batching = batching
        self.server_info: dict = {"kind": self.kind}
        self.model = model
        self.tok: PreTrainedTokenizerBase | None = None  # the local tokenizer (tokenizer=PATH)
        self._tok_vocab: int | None = None
        self._prefetched: dict[tuple, Any] = {}  # block key -> Future of its rows (prefetch)
        self._prefetcher: ThreadPoolExecutor | None = None  # started by the first prefetch
        server_vocab = self._check_models()
        self._probe_server(tokenizer)
        self._load_tokenizer(tokenizer)
        v = vocab_size or self._tok_vocab or server_vocab
        if v is None:
            v = self._local_vocab_size()
        if v is None:
            raise LogitdiffError(f"{self.spec}: the {self.kind} server does not say its vocabulary size; pass vocab_size=N or tokenizer=PATH")
        if server_vocab and vocab_size and server_vocab != vocab_size:
            raise LogitdiffError(f"{self.spec}: vocab_size={vocab_size} but the server reports n_vocab={server_vocab}")
        self.vocab_size = int(v)
        if self.top_k > self.vocab_size:
            raise LogitdiffError(f"{self.spec}: top_k={self.top_k} exceeds the vocabulary size {self.vocab_size}")
        eos: list[int] = []
        if self.tok is not None and self.tok.eos_token_id is not None:
            eos.append(int(self.tok.eos_token_id))
        self.eos_token_ids = tuple(eos)
        if self.tok is not None:
            self._check_tokenizer_agrees(self.tok)
        self._preflight()

    @property
    def _open_client(self) -> HttpClient:
        """The HTTP client; a closed source refuses."""
        if self._client is None:
            raise LogitdiffError(f"{self.spec}: the source is closed")
        return self._client

    # ---- construction -------------------------------------------------------------------
    def _check_models(self) -> int | None:
        """Every replica must answer and serve the same model; returns the server's n_vocab
        when its model list says it."""
        c = self._open_client
        server_vocab = None
        for r in self.roots:
            try:
                models = c.run(c.request("GET", "/v1/models", root=r, retry=True))
            except ServerError as e:
                if self.models_optional:
                    models = {"data": []}
                else:
                    raise LogitdiffError(f"{self.spec}: {e}") from None
            served = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
            if self.model is None:
                self._check_default_model(served)
                self.model = served[0] if served else None
            elif served and self.model not in served:
                raise LogitdiffError(f"{self.spec}: model {self.model!r} is not served at {r} (it serves: {', '.join(map(str, served))})")
            for m in models.get("data") or []:
                if isinstance(m, dict) and m.get("id") == self.model:
                    meta = m.get("meta") or {}
                    if meta.get("n_vocab"):
                        server_vocab = int(meta["n_vocab"])
                    if m.get("max_model_len"):
                        self.server_info["max_model_len"] = m["max_model_len"]
                    if m.get("root"):
                        self.server_info["root"] = m["root"]
        return server_vocab

    def _check_default_model(self, served: list) -> None:
        """No model= given: may the first served model be taken?"""

    def _probe_server(self, tokenizer: str | None) -> None:
        """Kind-specific handshake (server facts into ``server_info``)."""

    def _local_vocab_size(self) -> int | None:
        """V when neither the spec, the tokenizer nor the model list says it."""
        return None

    def _load_tokenizer(self, tokenizer: str | None) -> None:
        if tokenizer:
            from transformers import AutoTokenizer

            p = Path(tokenizer).expanduser()
            try:
                self.tok = AutoTokenizer.from_pretrained(str(p))
            except Exception as e:  # noqa: BLE001
                raise LogitdiffError(f"{self.spec}: tokenizer={tokenizer}: cannot load ({type(e).__name__}: {one_line(e, 120)})") from None
            n_tok = len(self.tok)
            self.tokenizer_tokens = self.tok.convert_ids_to_tokens(list(range(n_tok)))
            self.tokenizer_hash = tokenizer_hash_of(self.tokenizer_tokens)
            self._tok_vocab = n_tok
        else:
            self.tokenizer_hash = None
            self._tok_vocab = None

    def _preflight(self) -> None:
        """Score one tiny pair before anything is written: a server that caps logprobs below K,
        returns fewer than K, unsorted or processed (post-sampling) logprobs is refused here."""
        try:
            self.score_many([([0, 1], [2])])
        except LogitdiffError as e:
            msg = str(e)
            raise LogitdiffError(msg if msg.startswith(self.spec) else f"{self.spec}: {msg}") from None

    def _check_tokenizer_agrees(self, tok: PreTrainedTokenizerBase) -> None:
        probe = "The quick brown fox: 12 + 30 = 42.\n"
        local = [int(i) for i in tok(probe, add_special_tokens=False)["input_ids"]]
        remote = self._tokenize_text(probe)
        if remote is not None and remote != local:
            raise LogitdiffError(f"{self.spec}: the server tokenizes differently from tokenizer={tok.name_or_path} (probe text)")

    # ---- tokenization -----------------------------------------------------------------
    def _tokenize_text(self, text: str) -> list[int] | None:
        """The server's tokenization of ``text`` (special tokens parsed), or None where the
        server has no usable tokenizer endpoint."""
        return None

    def _tokenize_literal(self, text: str) -> list:
        """The server's tokens of ``text`` taken literally (no special tokens)."""
        raise NotImplementedError

    def _render_ids(self, item) -> list[int]:
        """Prompt ids of a workload item (may raise :class:`ServerError`)."""
        raise NotImplementedError

    def render(self, item: Any) -> list[int]:
        where = f"item {getattr(item, 'id', '?')!r}"
        try:
            ids = self._render_ids(item)
        except ServerError as e:
            raise LogitdiffError(f"{where}: the server could not tokenize it ({e})") from None
        except MALFORMED as e:
            raise malformed(self.spec, f"tokenizing {where}", e) from None
        ids = validate.token_ids(ids, self.vocab_size, f"{self.spec}: {where}", what="prompt").tolist()
        if not ids:
            raise LogitdiffError(f"{where}: prompt renders to zero tokens on {self.spec}")
        return ids

    def _local_render(self, item) -> list[int]:
        """Prompt ids from the local tokenizer (callers check there is one)."""
        tok = self.tok
        if tok is None:
            raise LogitdiffError(f"item {getattr(item, 'id', '?')!r}: {self.spec} has no local tokenizer (tokenizer=PATH) to render it")
        if item.messages is not None:
            text = render_bounded(lambda: tok.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                                  tokenize=False), f"item {getattr(item, 'id', '?')!r}: {self.spec}")
            if not isinstance(text, str):
                text = text["text"] if isinstance(text, dict) else "".join(text)
        else:
            text = item.prompt
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]

    def _server_detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            text = self._server_detokenize(ids)
        except MALFORMED as e:
            raise malformed(self.spec, "detokenizing", e) from None
        if not isinstance(text, str):
            raise LogitdiffError(f"{self.spec}: detokenizing: the server's text is {type(text).__name__}, not a string")
        return text

    def token_texts(self) -> list[str]:
        if self._token_texts is None:
            try:
                self._token_texts = self._vocab_texts()
            except MALFORMED as e:
                raise malformed(self.spec, "reading token texts", e) from None
        return self._token_texts

    def token_text(self, token_id: int) -> str:
        token_id = int(token_id)
        texts = self.token_texts()
        if 0 <= token_id < len(texts):
            return texts[token_id]
        return f"<{token_id}>"

    def _vocab_texts(self) -> list[str]:
        """Texts of all V token ids, fetched once: from the local tokenizer when one is given
        (each id decoded on its own, as HFSource.token_text does), else from the server in a
        few large /detokenize requests (:meth:`_server_texts`), never one request per id."""
        if self.tok is not None:
            n = min(self.vocab_size, len(self.tok))
            fast = getattr(self.tok, "backend_tokenizer", None)
            if fast is not None:  # a Rust tokenizer: all ids in one parallel call (~1 s at V = 248,320)
                texts = fast.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
            else:
                texts = [self.tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in range(n)]
            # a byte-level fragment of a multi-byte character decodes to U+FFFD: its raw
            # token string tells such tokens apart (as HFSource.token_text does)
            bad = [i for i, t in enumerate(texts) if "\ufffd" in t]
            for i, raw in zip(bad, self.tok.convert_ids_to_tokens(bad)):
                if raw is not None:
                    texts[i] = raw
            return texts + [f"<{i}>" for i in range(n, self.vocab_size)]
        try:
            return self._server_texts()
        except ServerError:
            return [f"<{i}>" for i in range(self.vocab_size)]

    async def _detokenize_ids(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _separator(self) -> tuple[list[int], str] | None:
        """Token ids of a separator and the text they read as between two tokens, checked on
        the server: ``a SEP a`` must come back as exactly two ``a`` around one SEP.

        Both servers detokenize a list by concatenating the tokens' texts (llama-server:
        ``tokens_to_str``; vLLM: the tokenizer's ``decode``), so ``t0 SEP t1 SEP ...`` splits
        back into the tokens' own texts. The separator text is border-free (no proper prefix
        is also a suffix), so a false split can only come from a token whose own text
        contains it, which adds parts; the count check catches that (:meth:`_server_texts`)."""
        c = self._open_client
        for text in SEPARATORS:
            ids = [int(t["id"]) if isinstance(t, dict) else int(t) for t in self._tokenize_literal(text)]
            if not ids:
                continue
            a = self._force_tok if self._force_tok is not None else ids[0]
            one = c.run(self._detokenize_ids([a]))
            both = c.run(self._detokenize_ids([a, *ids, a]))
            # the separator as it reads between two tokens (a SentencePiece decode drops a
            # word-start space only at the start of the text)
            sep = both[len(one) : len(both) - len(one)] if one and both.startswith(one) and both.endswith(one) else ""
            if len(both) > 2 * len(one) and sep and _border_free(sep) and sep not in one and both.split(sep) == [one, one]:
                return ids, sep
        return None

    def _server_texts(self) -> list[str]:
        """All token texts from the server in ``ceil(V / DETOKENIZE_CHUNK)`` requests: each
        detokenizes ``t0 SEP t1 SEP ... tn`` and splits on SEP. A chunk that does not split
        into exactly its n texts (a token whose text contains SEP) is halved until it does;
        only such a token is then detokenized on its own."""
        c = self._open_client
        found = self._separator()
        V = self.vocab_size
        if found is None:
            # no separator survives this server's detokenization: placeholders, never V requests
            return [f"<{i}>" for i in range(V)]
        sep_ids, sep = found

        async def texts(ids: list[int]) -> list[str]:
            if len(ids) == 1:
                return [await self._detokenize_ids(ids)]
            body = [ids[0]]
            for i in ids[1:]:
                body += sep_ids
                body.append(i)
            parts = (await self._detokenize_ids(body)).split(sep)
            if len(parts) == len(ids):
                return parts
            half = len(ids) // 2
            a, b = await asyncio.gather(texts(ids[:half]), texts(ids[half:]))
            return a + b

        chunks = [list(range(s, min(s + DETOKENIZE_CHUNK, V))) for s in range(0, V, DETOKENIZE_CHUNK)]

        async def every():
            return await asyncio.gather(*(texts(ch) for ch in chunks))

        return [t for part in c.run(every()) for t in part]

    # ---- model ---------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        """Greedy ids and why they stopped (``"eos"``/``"max_tokens"``); may raise ServerError."""
        raise NotImplementedError

    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise LogitdiffError(f"{self.spec}: generate needs a non-empty prompt")
        if max_tokens <= 0:
            return Generation([], "max_tokens")
        try:
            ids, stopped = self._generate(prompt, int(max_tokens))
        except ServerError as e:
            raise LogitdiffError(f"{self.spec}: generation failed ({e})") from None
        except MALFORMED as e:
            raise malformed(self.spec, "generation", e) from None
        if not isinstance(ids, list):
            raise LogitdiffError(f"{self.spec}: generation: the server's token ids are {type(ids).__name__}, not a list")
        ids = validate.token_ids(ids, self.vocab_size, f"{self.spec}: generation", what="generated").tolist()[:max_tokens]
        return Generation(ids, stopped)

    def _threaded(self, fn, jobs: list) -> list:
        """``fn`` over ``jobs`` from up to ``concurrency`` threads, in order (each blocks on
        the client's event loop, whose semaphore bounds the requests in flight)."""
        if len(jobs) < 2:
            return [fn(j) for j in jobs]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(jobs), self._open_client.concurrency)) as pool:
            return list(pool.map(fn, jobs))

    def render_many(self, items: Sequence[Any]) -> list[list[int]]:
        return self._threaded(self.render, list(items))

    def generate_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[Generation]:
        """Greedy continuations, concurrently in rounds mode (the server batches them; at most
        ``concurrency`` requests in flight, the client's bound), one at a time in serial mode."""
        jobs = list(zip(prompts, max_tokens))
        if self.batching == SERIAL:
            gens = [self.generate(p, n) for p, n in jobs]
        else:
            gens = self._threaded(lambda job: self.generate(*job), jobs)
        if self.on_generated is not None:
            self.on_generated([(list(p), list(g.token_ids)) for p, g in zip(prompts, gens)])
        return gens

    @staticmethod
    def _block_key(batch) -> tuple:
        return tuple((tuple(int(i) for i in p), tuple(int(i) for i in t)) for p, t in batch)

    def scores_ahead_of(self, reference) -> bool:
        """Whether `run` scores this (candidate) source ahead, on each block of ``reference``
        (a served source, another server) while it generates the next: ``overlap=on``; ``off``
        never; ``auto`` only when no endpoint of the two shares a host (bench/RESULTS.md: on one
        2-core host the two servers computing at once lengthened the wall)."""
        if set(self.roots) & set(reference.roots) or self.overlap == "off":
            return False  # the same server: the candidate's tasks would be the reference's batch mates
        if self.overlap == "on":
            return True
        return not ({endpoint_host(r) for r in self.roots} & {endpoint_host(r) for r in reference.roots})

    def prefetch(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
        """Start scoring one block of (prompt, teacher) pairs in the background (one block at a
        time, in order); a later :meth:`score_many` of exactly that block, same pairs in the same
        order (the same batch mates), takes its rows from there. What ``run`` uses to score a
        served candidate on each reference block while the reference generates the next one
        (another server). At most :data:`PREFETCH_BLOCKS` blocks wait; False when refused."""
        if len(self._prefetched) >= PREFETCH_BLOCKS or self._client is None:
            return False
        key = self._block_key(batch)
        if key in self._prefetched:
            return True
        if self._prefetcher is None:
            from concurrent.futures import ThreadPoolExecutor

            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitdiff-prefetch")
        self._prefetched[key] = self._prefetcher.submit(self._score_now, [(list(p), list(t)) for p, t in batch])
        return True

    async def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[TopKRows]:
        raise NotImplementedError

    def score_many(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TopKRows]:
        """Teacher-forced top-K per position of each (prompt, teacher) pair (from a
        :meth:`prefetch` of exactly this block when there is one)."""
        if self._prefetched:
            fut = self._prefetched.pop(self._block_key(batch), None)
            if fut is not None:
                return fut.result()
        return self._score_now(batch)

    def _score_now(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TopKRows]:
        pairs = []
        for n, (p, t) in enumerate(batch):
            p, t = [int(i) for i in p], [int(i) for i in t]
            if not p:
                raise LogitdiffError(f"{self.spec}: scoring pair {n} has an empty prompt")
            pairs.append((p, t))
        try:
            if self.batching == SERIAL:
                # one pair at a time, each scored alone (the protocol keeps its tasks in order on
                # one slot / one sequence per request): no other item's task shares a server batch
                return [self._open_client.run(self._score([pair]))[0] for pair in pairs]
            return self._open_client.run(self._score(pairs))
        except MALFORMED as e:
            raise malformed(self.spec, "scoring", e) from None

    # ---- identity -------------------------------------------------------------------------
    def identity(self) -> dict:
        return json_clean(default=str, obj={
            "kind": "openai",
            "spec": self.spec,
            "server": self.kind.value,
            "endpoints": self.roots,
            "model": self.model,
            "top_k": self.top_k,
            "batching": self.batching,
            "batching_text": BATCHING[self.batching],
            "vocab_size": self.vocab_size,
            "tokenizer_hash": self.tokenizer_hash,
            "tokenizer": getattr(self.tok, "name_or_path", None),
            "logprobs": "raw (log_softmax of the model's logits over the full vocabulary)",
            **{k: v for k, v in self.server_info.items() if k != "kind"},
        })

    def close(self) -> None:
        """Prompt whatever the server does: blocks never asked for (a job that failed, Ctrl-C)
        are cancelled, the one in flight with its requests (the client's close), and its thread
        waited for at most CLOSE_WAIT_S, never the request timeout of a hung server."""
        from concurrent.futures import wait

        from .client import CLOSE_WAIT_S

        pool = getattr(self, "_prefetcher", None)
        blocks = list((getattr(self, "_prefetched", None) or {}).values())
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)  # the blocks not started
            self._prefetcher = None
            self._prefetched = {}
        c = getattr(self, "_client", None)
        if c is not None:
            c.close()  # cancels the block in flight: its thread's call returns now
            self._client = None
        if blocks:
            wait(blocks, timeout=CLOSE_WAIT_S)
