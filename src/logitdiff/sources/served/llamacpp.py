"""llama-server (``/completion``) as a top-K source.

No prompt logprobs, so one task per position: ``prompt`` = a list of token-id prefixes (up
to 32 positions per request, one task each), ``n_predict: 1``, ``n_probs: K``,
``post_sampling_probs: false`` (raw softmax of the logits over the whole vocabulary),
``cache_prompt: true``, ``response_fields`` (only what we read); we read
``completion_probabilities[0].top_logprobs`` (``id``, ``logprob``) of each answer (ordered by
``index``). Positions of one item run in order on one server slot (``id_slot``; each task
extends the cached prefix by one token), with the item's next request already queued on
that slot while one runs; items run concurrently, one per slot of each replica. Where the
server clears idle slots (llama-server's default flags: -np auto, --cache-idle-slots;
probed when the source opens), each position is one unpinned request instead, in order per
item, restored from the server's host-RAM prompt cache. ``timings`` (``prompt_n``,
``cache_n``) of every answer are summed in ``server_stats``.

``cache_prompt`` (spec option, default true): reuse the cached prefix, so each position
request evaluates one new token. ``false`` re-evaluates the whole prefix per position
(quadratic cost) in one batch, as the in-process ``gguf:`` source does: incremental decoding
differs from a batched prefill by float rounding (up to ~1e-4 in logprobs on a random F32
model).
"""

from __future__ import annotations

import asyncio

from ...errors import LogitdiffError
from ..base import TopKRows
from .base import ServedSource, topk_row
from .client import ServerError, ServerKind, err_text, one_line

#: positions (tasks) per /completion request, a cap on the prompt tokens one request
#: carries, and the fields of its final events we read (the rest, e.g. the prompt's text,
#: is not sent)
LLAMACPP_TASKS_PER_REQUEST = 32
LLAMACPP_TOKENS_PER_REQUEST = 262_144
LLAMACPP_FIELDS = ("index", "stop", "timings")


class LlamaServerSource(ServedSource):
    kind = ServerKind.LLAMACPP

    def __init__(self, client, **kw):
        self._n_slots = 1
        self._pin_slots = True
        # tasks answered and prompt tokens evaluated / taken from the cache (the server's
        # ``timings``), summed over this source's scoring requests
        self.server_stats = {"tasks": 0, "prompt_tokens_evaluated": 0, "prompt_tokens_cached": 0}
        super().__init__(client, **kw)

    def _probe_server(self, tokenizer: str | None) -> None:
        c = self._client
        props = c.run(c.request("GET", "/props", root=self.roots[0]))
        self.server_info["build_info"] = props.get("build_info")
        self.server_info["model_path"] = props.get("model_path")
        self.server_info["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx")
        gen = (props.get("default_generation_settings") or {}).get("params") or {}
        if gen.get("post_sampling_probs"):
            raise LogitdiffError(f"{self.spec}: llama-server is configured for post-sampling probabilities (post_sampling_probs=true); raw logprobs are required")
        self.server_info["chat_template"] = bool(props.get("chat_template"))
        self._force_tok = self._ascii_token()
        self._n_slots = max(1, int(props.get("total_slots") or 1))
        self.server_info["total_slots"] = self._n_slots
        self._pin_slots = self._idle_slots_kept()
        self.server_info["scheduling"] = "pinned slots" if self._pin_slots else "one position per request (host-RAM prompt cache)"

    def _idle_slots_kept(self) -> bool:
        """Does an idle slot keep its prompt while another slot starts a task? Three requests:
        P on slot 0, Q on slot 1, then P + one token on slot 0, which evaluates 1 token if
        slot 0 kept P. llama-server's default flags (-np auto: a unified KV cache with
        --cache-idle-slots) save every idle slot to the host-RAM cache and clear it whenever
        a task starts; a request pinned to a cleared slot is not restored from that cache."""
        if self._n_slots < 2 or not self.cache_prompt:
            return True
        c = self._client
        base = [self._force_tok if self._force_tok is not None else 0] * 8

        def run(prompt, slot):
            body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True, "id_slot": slot,
                    "stream": False, "response_fields": ["timings"]}
            try:
                return int((c.run(c.request("POST", "/completion", body, root=self.roots[0])).get("timings") or {}).get("prompt_n", 0))
            except ServerError as e:
                raise LogitdiffError(f"{self.spec}: llama-server refused a completion request ({e})") from None

        run(base, 0)
        run([1] + base, 1)
        return run(base + [1], 0) <= 1

    def _ascii_token(self) -> int | None:
        """A token whose text is one complete ASCII character (see _score)."""
        c = self._client
        for text in ("a", "e", "0", " ", "x", "."):
            r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False}))
            toks = r.get("tokens") or []
            if len(toks) == 1:
                t = toks[0]
                return int(t["id"]) if isinstance(t, dict) else int(t)
        return None

    # ---- tokenization -----------------------------------------------------------------
    def _tokenize_text(self, text: str) -> list[int] | None:
        c = self._client
        r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": True}))
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in r["tokens"]]

    def _tokenize_literal(self, text: str) -> list:
        c = self._client
        r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False}))
        return r.get("tokens") or []

    def _render_ids(self, item) -> list[int]:
        c = self._client
        if item.messages is not None:
            body = {"messages": item.messages}
            if item.tools:
                body["tools"] = item.tools
            text = c.run(c.request("POST", "/apply-template", body))["prompt"]
        else:
            text = item.prompt
        return self._tokenize_text(text)

    def _server_detokenize(self, ids: list[int]) -> str:
        c = self._client
        return c.run(c.request("POST", "/detokenize", {"tokens": ids}))["content"]

    async def _detokenize_ids(self, ids: list[int]) -> str:
        return (await self._client.request("POST", "/detokenize", {"tokens": ids})).get("content", "")

    # ---- model ---------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        c = self._client
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "return_tokens": True,
                "cache_prompt": True, "repeat_penalty": 1.0, "dry_multiplier": 0.0, "stream": False}
        r = c.run(c.request("POST", "/completion", body))
        return r.get("tokens") or [], "eos" if r.get("stop_type") == "eos" else "max_tokens"

    # one task per position; an item's positions in order on one slot
    async def _score(self, pairs):
        c, K = self._client, self.top_k

        def row(e, where):
            cp = e.get("completion_probabilities")
            if not cp:
                raise LogitdiffError(f"{where}: llama-server returned no completion_probabilities (n_probs ignored?)")
            e0 = cp[0]
            if "top_probs" in e0 or ("prob" in e0 and "logprob" not in e0):
                raise LogitdiffError(f"{where}: llama-server returned post-sampling probabilities (top_probs); raw logprobs are required")
            if "top_logprobs" not in e0:
                raise LogitdiffError(f"{where}: llama-server answer has no top_logprobs (server too old: needs token ids and logprobs)")
            return topk_row([(d["id"], d.get("logprob")) for d in e0["top_logprobs"]], K, where, ordered=True)

        async def positions(root, slot, p, t, js, started):
            """One request, one task per position j in js (prompt = p + t[:j]), all on ``slot``;
            streamed, so ``started`` is set as soon as the server has queued all its tasks."""
            body = {"prompt": [p + t[:j] for j in js], "n_predict": 1, "n_probs": K, "temperature": 0.0,
                    "post_sampling_probs": False, "cache_prompt": self.cache_prompt, "return_tokens": False,
                    "stream": True, "id_slot": slot, "response_fields": list(LLAMACPP_FIELDS)}
            if self._force_tok is not None:
                # llama-server drops the probabilities of a sampled token whose text is an
                # incomplete UTF-8 sequence (a byte token); the sampled token is not what we
                # read, so a logit bias (a sampler: the raw n_probs are computed from the
                # model's logits before any sampler) makes it a plain ASCII one.
                body["logit_bias"] = [[self._force_tok, 1e6]]
            where = f"{self.spec}: output positions {js[0]}..{js[-1]}"
            try:
                events = await c.request("POST", "/completion", body, root=root, failover=True, started=started)
            except ServerError as e:
                raise LogitdiffError(f"{where}: scoring request refused ({e})") from None
            finally:
                started.set()  # never leave the item's next request waiting on a failed one
            # per task (its "index"): the event with the token's probabilities, and the final
            # one (stop: true) with the timings
            probs: dict[int, dict] = {}
            for e in events:
                if e is None:
                    continue  # "data: null": a task started (headers for the first one)
                if not isinstance(e, dict):
                    raise LogitdiffError(f"{where}: llama-server sent an event that is not an object")
                if "error" in e:
                    raise LogitdiffError(f"{where}: scoring request failed on the server ({one_line(err_text(e), 240)})")
                i = int(e.get("index", 0))
                if e.get("completion_probabilities"):
                    probs[i] = e
                if e.get("stop"):
                    tm = e.get("timings") or {}
                    self.server_stats["tasks"] += 1
                    self.server_stats["prompt_tokens_evaluated"] += int(tm.get("prompt_n") or 0)
                    self.server_stats["prompt_tokens_cached"] += int(tm.get("cache_n") or 0)
            if sorted(probs) != list(range(len(js))):
                raise LogitdiffError(f"{where}: llama-server answered {len(probs)} of {len(js)} positions with completion_probabilities")
            return [row(probs[n], f"{self.spec}: output position {j}") for n, j in enumerate(js)]

        # Each item holds one server slot (id_slot) of one replica for all its positions, so
        # its growing prefix stays in that slot's KV cache: one new token per position.
        # Without pinning, concurrent items evict each other's slots (llama-server picks a
        # slot by prefix similarity, else the least recently used) and every request
        # re-prefills. Positions go in groups of tasks per request, and the item's next
        # request is sent as soon as the server has queued the tasks of the one before (its
        # answer has started), so it waits on the slot behind them, in order.
        # On llama-server's default flags (-np auto: a unified KV cache, --cache-idle-slots,
        # --cache-ram 8192) starting any task saves every idle slot to the host-RAM cache and
        # clears it - slots that finish in the same batch clear each other - and a request
        # pinned to a cleared slot is not restored from that cache: there (found at open by
        # _idle_slots_kept) each position is one unpinned request, in order, which llama-server
        # restores from the host-RAM cache, so it also evaluates one new token.
        slots: dict[str, asyncio.Queue] = {}
        for r in self.roots:
            q: asyncio.Queue = asyncio.Queue()
            for k in range(self._n_slots):
                q.put_nowait(k)
            slots[r] = q

        async def item(n):
            p, t = pairs[n]
            if not t:
                return TopKRows.empty(K)
            per = max(1, min(LLAMACPP_TASKS_PER_REQUEST, LLAMACPP_TOKENS_PER_REQUEST // (len(p) + len(t))))
            root = c.next_root()
            slot = await slots[root].get()
            if not self._pin_slots:
                # idle slots are cleared (default flags): one position per request, in order,
                # on any slot, which restores the item's prefix from the host-RAM prompt cache
                # (the slot taken above only keeps as many items in flight as there are slots)
                try:
                    rows = []
                    for j in range(len(t)):
                        rows += await positions(root, -1, p, t, [j], asyncio.Event())
                finally:
                    slots[root].put_nowait(slot)
                return TopKRows.stack(rows)
            groups = [list(range(j, min(j + per, len(t)))) for j in range(0, len(t), per)]
            requests: list[asyncio.Future] = []
            try:
                for g, js in enumerate(groups):
                    if g >= 2:
                        await requests[g - 2]  # two requests of an item at a time: one runs, one waits
                    started = asyncio.Event()
                    requests.append(asyncio.ensure_future(positions(root, slot, p, t, js, started)))
                    await started.wait()
                rows = [x for g in await asyncio.gather(*requests) for x in g]
            except BaseException:
                for f in requests:
                    f.cancel()
                raise
            finally:
                slots[root].put_nowait(slot)
            return TopKRows.stack(rows)

        return list(await asyncio.gather(*(item(n) for n in range(len(pairs)))))
