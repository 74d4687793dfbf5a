"""vLLM (``/v1/completions`` with ``prompt_logprobs``) as a top-K source.

Scoring: ``prompt`` = list of token-id lists (``batch`` sequences per request),
``prompt_logprobs: K``, ``max_tokens: 1``. Each ``choices[i].prompt_logprobs`` is a list
whose entry j (entry 0 is null) maps token id (string) -> ``{logprob, rank,
decoded_token}`` for the distribution predicting prompt token j; the prompt token itself is
always included (so K or K+1 entries); we keep the K highest (ties: lowest id). The
sequence sent is ``prompt + teacher`` so entries ``P .. P+T-1`` predict ``teacher[0..T-1]``.

Raw or processed: in vLLM 0.32 prompt logprobs are ``log_softmax`` (float32) of the model's
logits (``gpu_model_runner._get_prompt_logprobs_dict``; the ``logprobs_mode`` doc in
``vllm/config/model.py``: "for prompt_logprobs, processed_* and raw_* yield identical
results because prompt tokens do not go through sampling processors"), so
``--logprobs-mode raw_logprobs`` (default) and ``processed_logprobs`` both give raw
logprobs. ``raw_logits``/``processed_logits`` put unnormalised *logits* there; those are
refused by :func:`~.base.topk_row` (a positive value, or a top-K summing above 1) and the
refusal names the server. Scoring requests also carry neutral sampling parameters
(temperature 1, top_p 1, top_k off, no penalties), so processed and raw coincide anyway.
The server's ``--max-logprobs`` (default 20) caps K: its 400 answer becomes one line
saying the cap and the flag to raise it.

**Start vLLM with ``--skip-tokenizer-init`` for capture** and pass ``tokenizer=PATH``:
vLLM otherwise decodes the text of every one of the K+1 entries of every prompt row in
Python (one ``tokenizer.decode`` per entry, ``v1/engine/logprobs.py``), which we never
read; measured in bench/RESULTS.md, it is most of the capture time on a small model. Such
a server has no ``/tokenize``; prompts are then rendered with the local tokenizer, and the
identity says that the server's own tokenization could not be checked.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from ...errors import LogitdiffError
from ..base import TopKRows
from .base import ServedSource, topk_row
from .client import ServerError, ServerKind, one_line


class VLLMSource(ServedSource):
    kind = ServerKind.VLLM
    #: False when vLLM runs with --skip-tokenizer-init (no /tokenize)
    server_tokenizer = True

    def _check_default_model(self, served: list) -> None:
        if len(served) != 1:
            raise LogitdiffError(
                f"{self.spec}: the server serves {len(served)} models ({', '.join(map(str, served))}); pick one with model=NAME"
            )

    def _probe_server(self, tokenizer: str | None) -> None:
        c = self._open_client
        try:
            self.server_info["version"] = c.run(c.request("GET", "/version", root=self.roots[0])).get("version")
        except LogitdiffError:
            pass
        self.server_tokenizer = self._has_tokenizer()
        self.server_info["server_tokenizer"] = self.server_tokenizer
        if not self.server_tokenizer and not tokenizer:
            raise LogitdiffError(
                f"{self.spec}: the vLLM server runs with --skip-tokenizer-init (no /tokenize); "
                "pass tokenizer=PATH, a local copy of the served model's tokenizer"
            )

    def _has_tokenizer(self) -> bool:
        """False when vLLM runs with ``--skip-tokenizer-init`` (its /tokenize answers 400)."""
        c = self._open_client
        try:
            c.run(c.request("POST", "/tokenize", {"model": self.model, "prompt": "a", "add_special_tokens": False}, retry=False))
            return True
        except ServerError as e:
            if e.status == 400 and "tokenizer" in str(e).lower():
                return False
            raise LogitdiffError(f"{self.spec}: vLLM /tokenize failed ({one_line(e, 200)})") from None

    def _local_vocab_size(self) -> int | None:
        root = self.server_info.get("root")
        if not (root and Path(str(root)).is_dir()):
            return None
        # the server runs on this machine: read its tokenizer to learn V
        try:
            from transformers import AutoTokenizer

            return len(AutoTokenizer.from_pretrained(str(root)))
        except Exception:  # noqa: BLE001
            return None

    # ---- tokenization -----------------------------------------------------------------
    def _tokenize_text(self, text: str) -> list[int] | None:
        if not self.server_tokenizer:
            return None  # --skip-tokenizer-init: nothing to check against
        return self._tokenize_literal(text)

    def _tokenize_literal(self, text: str) -> list:
        c = self._open_client
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return [int(i) for i in c.run(c.request("POST", "/tokenize", body))["tokens"]]

    def _render_ids(self, item) -> list[int]:
        if not self.server_tokenizer:
            return self._local_render(item)
        if item.messages is None:
            return self._tokenize_literal(item.prompt)  # what _tokenize_text does with the server's tokenizer
        c = self._open_client
        body = {"model": self.model, "messages": item.messages, "add_generation_prompt": True, "add_special_tokens": False}
        if item.tools:
            body["tools"] = item.tools
        return c.run(c.request("POST", "/tokenize", body))["tokens"]

    def _server_detokenize(self, ids: list[int]) -> str:
        c = self._open_client
        return c.run(c.request("POST", "/detokenize", {"model": self.model, "tokens": ids}))["prompt"]

    async def _detokenize_ids(self, ids: list[int]) -> str:
        return (await self._open_client.request("POST", "/detokenize", {"model": self.model, "tokens": ids})).get("prompt", "")

    # ---- model ---------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        c = self._open_client
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "return_token_ids": True, "skip_special_tokens": False}
        if not self.server_tokenizer and self.eos_token_ids:
            # without its tokenizer vLLM knows EOS only from generation_config.json
            body["stop_token_ids"] = list(self.eos_token_ids)
        r = c.run(c.request("POST", "/v1/completions", body))
        ch = r["choices"][0]
        ids = ch.get("token_ids")
        if ids is None:
            raise LogitdiffError(f"{self.spec}: vLLM did not return token_ids (needs vLLM >= 0.10.2 for return_token_ids)")
        return ids, "eos" if ch.get("finish_reason") == "stop" else "max_tokens"

    # prompt logprobs, several sequences per request
    async def _score(self, pairs):
        c, K = self._open_client, self.top_k
        results: list[TopKRows | None] = [None] * len(pairs)
        todo = [n for n, (p, t) in enumerate(pairs) if t]
        for n, (p, t) in enumerate(pairs):
            if not t:
                results[n] = TopKRows.empty(K)

        async def group(idx):
            body = {"model": self.model, "prompt": [pairs[n][0] + pairs[n][1] for n in idx], "max_tokens": 1,
                    "prompt_logprobs": K, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
            try:
                r = await c.request("POST", "/v1/completions", body)
            except ServerError as e:
                raise self._score_error(e) from None
            choices = sorted(r.get("choices") or [], key=lambda ch: ch.get("index", 0))
            if len(choices) != len(idx):
                raise LogitdiffError(f"{self.spec}: vLLM answered {len(choices)} choices for {len(idx)} prompts")
            for n, ch in zip(idx, choices):
                p, t = pairs[n]
                pl = ch.get("prompt_logprobs")
                if pl is None:
                    raise LogitdiffError(f"{self.spec}: vLLM returned no prompt_logprobs (is this vLLM?)")
                if len(pl) != len(p) + len(t):
                    raise LogitdiffError(f"{self.spec}: vLLM returned {len(pl)} prompt_logprobs entries for {len(p) + len(t)} tokens")
                rows = []
                for j in range(len(t)):
                    entry = pl[len(p) + j]
                    where = f"{self.spec}: output position {j}"
                    if not isinstance(entry, dict):
                        raise LogitdiffError(f"{where}: vLLM prompt_logprobs entry is {type(entry).__name__}, expected an object")
                    pairs_j = [(tid, (v or {}).get("logprob") if isinstance(v, dict) else v) for tid, v in entry.items()]
                    rows.append(topk_row(pairs_j, K, where, ordered=False, forced=t[j], vocab_size=self.vocab_size, keys=True))
                results[n] = TopKRows.stack(rows)

        groups = [todo[i : i + self.batch] for i in range(0, len(todo), self.batch)]
        await asyncio.gather(*(group(g) for g in groups))
        return results

    def _score_error(self, e: ServerError) -> LogitdiffError:
        msg = str(e)
        if "logprob" in msg.lower() and ("max" in msg.lower() or "allowed" in msg.lower()):
            m = re.search(r"(?:max(?:imum)?[^0-9]{0,40}?|allowed[^0-9]{0,20}?)(\d+)", msg, re.I)
            cap = m.group(1) if m else "?"
            return LogitdiffError(
                f"{self.spec}: the server caps logprobs at {cap} < top_k={self.top_k}; restart vLLM with "
                f"--max-logprobs {self.top_k} (or use top_k<={cap})"
            )
        if e.status == 404:
            return LogitdiffError(f"{self.spec}: model {self.model!r} not found on the server ({one_line(msg, 160)})")
        return LogitdiffError(f"{self.spec}: scoring request refused ({one_line(msg, 240)})")
