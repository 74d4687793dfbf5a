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
probed when the source opens), items go in rounds instead: one request of unpinned tasks
(``id_slot: -1``) holding the next position of every item in flight (at most one item per
slot), so the server decodes them as one batch and restores each item's prefix from its
slot or the host-RAM prompt cache. ``timings`` (``prompt_n``,
``cache_n``) of every answer are summed in ``server_stats``.

``cache_prompt`` (spec option, default true): reuse the cached prefix, so each position
request evaluates one new token. ``false`` re-evaluates the whole prefix per position
(quadratic cost) in one batch, as the in-process ``gguf:`` source does: incremental decoding
differs from a batched prefill by float rounding (up to ~1e-4 in logprobs on a random F32
model).
"""

from __future__ import annotations

import asyncio

import numpy as np

from ...errors import LogitdiffError
from ..base import TopKRows
from .base import SERIAL, ServedSource, topk_row
from .client import ServerError, ServerKind, err_text, one_line
from .llamacpp_client import LlamaServerClient, field, top_logprobs

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
        # rows of the greedy generations of the last generate_many (serial mode): see _rows_in_generation
        self._gen_rows: dict[tuple, TopKRows] = {}
        self._collect_rows = False
        self._pin_slots = True
        # tasks answered and prompt tokens evaluated / taken from the cache (the server's
        # ``timings``), summed over this source's scoring requests
        self.server_stats = {"tasks": 0, "prompt_tokens_evaluated": 0, "prompt_tokens_cached": 0}
        super().__init__(client, **kw)

    def _api(self, root: str | None = None) -> LlamaServerClient:
        """The one llama-server client over this source's HTTP client (``root``: that
        replica; None: the next one)."""
        return LlamaServerClient(self._open_client, self.spec, root)

    def _probe_server(self, tokenizer: str | None) -> None:
        props = self._api(self.roots[0]).props()
        self.server_info["build_info"] = props.build_info
        self.server_info["model_path"] = props.model_path
        self.server_info["n_ctx"] = props.n_ctx
        if props.post_sampling_probs:
            raise LogitdiffError(f"{self.spec}: llama-server is configured for post-sampling probabilities (post_sampling_probs=true); raw logprobs are required")
        self.server_info["chat_template"] = props.chat_template
        self._force_tok = self._api().ascii_token()
        self._n_slots = max(1, int(props.total_slots or 1))
        self.server_info["total_slots"] = self._n_slots
        self._pin_slots = self._idle_slots_kept()
        self.server_info["scheduling"] = "pinned slots" if self._pin_slots else "rounds of unpinned tasks, one position per item (host-RAM prompt cache)"
        self._probe_rows_note()

    def _idle_slots_kept(self) -> bool:
        """Does an idle slot keep its prompt while another slot starts a task? Three requests:
        P on slot 0, Q on slot 1, then P + one token on slot 0, which evaluates 1 token if
        slot 0 kept P. llama-server's default flags (-np auto: a unified KV cache with
        --cache-idle-slots) save every idle slot to the host-RAM cache and clear it whenever
        a task starts; a request pinned to a cleared slot is not restored from that cache."""
        if self._n_slots < 2 or not self.cache_prompt:
            return True
        c = self._open_client
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

    # ---- tokenization -----------------------------------------------------------------
    def _tokenize_text(self, text: str) -> list[int]:  # llama-server always has /tokenize
        return self._api().tokenize(text)

    def _tokenize_literal(self, text: str) -> list:
        return self._api().tokenize(text, parse_special=False)

    def _render_ids(self, item) -> list[int]:
        text = self._api().apply_template(item.messages, item.tools) if item.messages is not None else item.prompt
        return self._tokenize_text(text)

    def _server_detokenize(self, ids: list[int]) -> str:
        return self._api().detokenize(ids)

    async def _detokenize_ids(self, ids: list[int]) -> str:
        return await self._api().adetokenize(ids)

    # ---- model ---------------------------------------------------------------------------
    def _rows_in_generation(self) -> bool:
        """Prefix cache on (the default): a reference capture takes each item's rows from its
        greedy generation (``n_probs`` on every generated token) instead of a teacher-forced
        task per position afterwards: one request per item, as a peer such as quantdiff does.
        Both are the same incremental decoding (the prompt, then one new token per position);
        what can differ is the server batch a row was computed in:

        * serial: the prompt is evaluated afresh and the item is alone in its batches, so the
          rows are the teacher-forced ones bit for bit (tests/test_served_floor.py);
        * rounds: the other items' generation steps are the batch mates, as other items'
          scoring tasks would be; rows move by the served floor either way (a ``run`` measures
          it: the reference scored again, teacher-forced, with other batch mates, against these).

        Not with ``cache_prompt=false`` (scoring re-evaluates each prefix in one batch, not
        incremental decoding)."""
        return self.cache_prompt and (self.batching != SERIAL or len(self.roots) == 1)

    def _probe_rows_note(self) -> None:
        if self._rows_in_generation():
            self.server_info["reference_rows"] = (
                "a reference capture takes each item's rows from its greedy generation (n_probs on every generated token: "
                + ("alone in its server batches, bit-identical to teacher-forced scoring" if self.batching == SERIAL
                   else "other items' generation steps as batch mates, within the served floor of teacher-forced scoring")
                + "); an item whose generation lacks a row (a byte token) is scored teacher-forced")

    def generate_many(self, prompts, max_tokens):
        self._gen_rows = {}  # only this block's: memory is a block of items
        self._collect_rows = self._rows_in_generation()
        try:
            return super().generate_many(prompts, max_tokens)
        finally:
            self._collect_rows = False

    def score_many(self, batch):
        if not self._gen_rows:
            return super().score_many(batch)
        keys = self._block_key(batch)
        out = [self._gen_rows.pop(k, None) for k in keys]
        # the pairs the generation did not answer are scored together, as they would be
        missing = [n for n, r in enumerate(out) if r is None]
        if missing:
            for n, r in zip(missing, super().score_many([batch[n] for n in missing])):
                out[n] = r
        return out

    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        c = self._open_client
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "return_tokens": True,
                "cache_prompt": True, "repeat_penalty": 1.0, "dry_multiplier": 0.0, "stream": False}
        if self._collect_rows:
            # raw log-probabilities of every generated token; serial: the whole prompt evaluated
            # afresh, as the item's first scoring task would be
            body.update({"n_probs": self.top_k, "post_sampling_probs": False, "cache_prompt": self.batching != SERIAL})
        r = c.run(c.request("POST", "/completion", body))
        where = f"{self.spec}: generation (POST /completion)"
        ids = field(r, "tokens", "list", where, optional=True) or []
        stop_type = field(r, "stop_type", "str", where, optional=True)
        if self._collect_rows:
            self._keep_rows(prompt, ids, r.get("completion_probabilities"))
        return ids, "eos" if stop_type == "eos" else "max_tokens"

    def _keep_rows(self, prompt: list[int], ids, probs) -> None:
        """Keep the generation's rows for score_many when there is one complete, valid row
        per generated token; anything else (a byte token's probabilities dropped, a short
        list) leaves the item to teacher-forced scoring, which reports it properly."""
        if not isinstance(ids, list) or not ids or not isinstance(probs, list) or len(probs) != len(ids):
            return
        try:
            rows = []
            for j, e in enumerate(probs):
                where = f"{self.spec}: generated position {j}"
                rows.append(topk_row(top_logprobs(e, where, f"completion_probabilities[{j}]"), self.top_k, where, ordered=True,
                                     vocab_size=self.vocab_size))
            self._gen_rows[(tuple(int(i) for i in prompt), tuple(int(i) for i in ids))] = TopKRows.stack(rows)
        except (LogitdiffError, KeyError, TypeError, ValueError):
            return

    # one task per position; an item's positions in order on one slot
    def _row(self, e: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The top-K row of one task's event with probabilities (every field checked)."""
        cp = field(e, "completion_probabilities", "list", where)
        if not cp:
            raise LogitdiffError(f"{where}: llama-server returned no completion_probabilities (n_probs ignored?)")
        pairs = top_logprobs(cp[0], where, "completion_probabilities[0]")
        return topk_row(pairs, self.top_k, where, ordered=True, vocab_size=self.vocab_size)

    def _task_events(self, events: list, n_prompts: int, where: str) -> dict[int, dict]:
        """Per task (its ``index``) of one streamed request: the event with the token's
        probabilities; the final events' (``stop: true``) timings are summed in server_stats."""
        probs: dict[int, dict] = {}
        for k, ev in enumerate(events):
            if ev is None:
                continue  # "data: null": a task started (headers for the first one)
            if not isinstance(ev, dict):
                raise LogitdiffError(f"{where}: llama-server sent an event that is not an object")
            if "error" in ev:
                raise LogitdiffError(f"{where}: scoring request failed on the server ({one_line(err_text(ev), 240)})")
            i = int(field(ev, "index", "int", where, f"event {k}: index", optional=True) or 0)
            if ev.get("completion_probabilities"):
                probs[i] = ev
            if field(ev, "stop", "bool", where, f"event {k}: stop", optional=True):
                tm = field(ev, "timings", "object", where, f"event {k}: timings", optional=True) or {}
                self.server_stats["tasks"] += 1
                self.server_stats["prompt_tokens_evaluated"] += int(field(tm, "prompt_n", "int", where, "timings.prompt_n", optional=True) or 0)
                self.server_stats["prompt_tokens_cached"] += int(field(tm, "cache_n", "int", where, "timings.cache_n", optional=True) or 0)
        if sorted(probs) != list(range(n_prompts)):
            raise LogitdiffError(f"{where}: llama-server answered {len(probs)} of {n_prompts} positions with completion_probabilities")
        return probs

    async def _tasks(self, root: str, slot: int, prompts: list, labels: list[str], where: str, started: asyncio.Event,
                     fresh: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """One request, one task per prompt (its row labelled ``labels[n]``), all on ``slot``
        (-1: any); streamed, so ``started`` is set as soon as the server has queued all its tasks.
        ``fresh``: evaluate the prompt from scratch (no prefix from the cache)."""
        body = {"prompt": prompts, "n_predict": 1, "n_probs": self.top_k, "temperature": 0.0,
                "post_sampling_probs": False, "cache_prompt": self.cache_prompt and not fresh, "return_tokens": False,
                "stream": True, "id_slot": slot, "response_fields": list(LLAMACPP_FIELDS)}
        if self._force_tok is not None:
            # llama-server drops the probabilities of a sampled token whose text is an
            # incomplete UTF-8 sequence (a byte token); the sampled token is not what we
            # read, so a logit bias (a sampler: the raw n_probs are computed from the
            # model's logits before any sampler) makes it a plain ASCII one.
            body["logit_bias"] = [[self._force_tok, 1e6]]
        try:
            events = await self._open_client.request("POST", "/completion", body, root=root, failover=True, started=started)
        except ServerError as e:
            raise LogitdiffError(f"{where}: scoring request refused ({e})") from None
        finally:
            started.set()  # never leave the item's next request waiting on a failed one
        probs = self._task_events(events, len(prompts), where)
        return [self._row(probs[n], label) for n, label in enumerate(labels)]

    async def _rounds(self, pairs, root: str, todo: list[int]) -> dict[int, TopKRows]:
        """Items ``todo`` on one replica whose idle slots are cleared (default flags): up to
        one item per slot in flight, and round r sends the next position of every item in
        flight as ONE request of unpinned tasks. The server launches a request's tasks in
        the same loop iteration, so they decode as one batch (one pass over the output
        head for all of them), and each task takes its item's prefix back - from the slot
        that still holds it (the first task of the round), else from the host-RAM prompt
        cache, where launching that first task saved the other idle slots: one new token
        per position. One request per item and position (the earlier scheduling) let the
        items' requests reach the server at different times, so a round took several
        decode passes, each reading the whole output head.
        A round that fills every slot has the next round sent as soon as its tasks are
        queued: the server defers those tasks (no free slot) and starts them as the slots
        are released, without waiting for our round trip; a round with a free slot is
        awaited first (the next one's tasks would start beside it, a token short)."""
        rows: dict[int, list] = {}
        flight: list[list[int]] = []  # [item, next position]
        queue = list(todo)
        sent: list[tuple[asyncio.Future, list]] = []  # at most two rounds: one runs, one waits

        async def collect():
            fut, batch = sent.pop(0)
            for (n, _), r in zip(batch, await fut):
                rows[n].append(r)

        try:
            while queue or flight:
                while queue and len(flight) < self._n_slots:
                    n = queue.pop(0)
                    if pairs[n][1]:
                        rows[n] = []
                        flight.append([n, 0])
                if not flight:
                    break
                if len(sent) >= 2:
                    await collect()
                batch = [(n, j) for n, j in flight]
                prompts = [pairs[n][0] + pairs[n][1][:j] for n, j in batch]
                labels = [f"{self.spec}: item {n} output position {j}" for n, j in batch]
                started = asyncio.Event()
                # serial (one item in flight): its first position evaluates the whole prompt,
                # not a prefix cached from the item before it, so its rows depend on it alone
                fresh = self.batching == SERIAL and batch[0][1] == 0
                sent.append((asyncio.ensure_future(
                    self._tasks(root, -1, prompts, labels, f"{self.spec}: output positions of {len(batch)} items", started,
                                fresh)), batch))
                for f in flight:
                    f[1] += 1
                flight = [f for f in flight if f[1] < len(pairs[f[0]][1])]
                if len(batch) == self._n_slots:
                    await started.wait()
                else:
                    while sent:
                        await collect()
            while sent:
                await collect()
        except BaseException:
            for fut, _ in sent:
                fut.cancel()
            raise
        return {n: TopKRows.stack(r) for n, r in rows.items()}

    async def _pinned_item(self, p: list[int], t: list[int], slots: dict[str, asyncio.Queue]) -> TopKRows:
        """One item's positions in groups of tasks per request on one slot of one replica,
        the next request sent as soon as the server has queued the one before (see _score)."""
        if not t:
            return TopKRows.empty(self.top_k)
        serial = self.batching == SERIAL
        per = max(1, min(LLAMACPP_TASKS_PER_REQUEST, LLAMACPP_TOKENS_PER_REQUEST // (len(p) + len(t))))
        root = self._open_client.next_root()
        slot = await slots[root].get()
        groups = [list(range(j, min(j + per, len(t)))) for j in range(0, len(t), per)]
        if serial and len(groups[0]) > 1:
            # the first position alone, evaluating the whole prompt (no prefix cached from
            # the item before on this slot): the item's rows depend on it alone
            groups = [[0], groups[0][1:]] + groups[1:]
        requests: list[asyncio.Future] = []
        try:
            for g, js in enumerate(groups):
                if g >= 2:
                    await requests[g - 2]  # two requests of an item at a time: one runs, one waits
                started = asyncio.Event()
                requests.append(asyncio.ensure_future(self._tasks(
                    root, slot, [p + t[:j] for j in js], [f"{self.spec}: output position {j}" for j in js],
                    f"{self.spec}: output positions {js[0]}..{js[-1]}", started, serial and g == 0)))
                await started.wait()
            rows = [x for g in await asyncio.gather(*requests) for x in g]
        except BaseException:
            for f in requests:
                f.cancel()
            raise
        finally:
            slots[root].put_nowait(slot)
        return TopKRows.stack(rows)

    async def _score(self, pairs):
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
        # _idle_slots_kept) the items go in rounds of unpinned tasks (``_rounds``), which
        # llama-server restores from the slot or the host-RAM cache: one new token each.
        if not self._pin_slots:
            # items go round-robin to the replicas, each replica's items in rounds
            done: dict[int, TopKRows] = {}
            parts = [list(range(i, len(pairs), len(self.roots))) for i in range(len(self.roots))]
            for d in await asyncio.gather(*(self._rounds(pairs, self.roots[i], part) for i, part in enumerate(parts) if part)):
                done.update(d)
            return [done[n] if n in done else TopKRows.empty(self.top_k) for n in range(len(pairs))]
        slots: dict[str, asyncio.Queue] = {}
        for r in self.roots:
            q: asyncio.Queue = asyncio.Queue()
            for k in range(self._n_slots):
                q.put_nowait(k)
            slots[r] = q
        return list(await asyncio.gather(*(self._pinned_item(p, t, slots) for p, t in pairs)))
