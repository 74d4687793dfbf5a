"""SGLang (``/generate`` with input logprobs) as a top-K source.

Scoring: ``input_ids`` = ``prompt + teacher``, ``return_logprob: true``,
``logprob_start_len: P - 1``, ``top_logprobs_num: K``, ``max_new_tokens: 1``; entry j of
``meta_info.input_top_logprobs`` (a list of ``[logprob, token_id, text]``; entry 0 is null)
predicts input token ``P - 1 + j``. One sequence per request. SGLang has no stable
tokenize endpoint: prompts are rendered with ``tokenizer=PATH`` (a local copy of the served
tokenizer), and without one token texts are ``<id>``.
"""

from __future__ import annotations

import asyncio

from ...errors import LogitdiffError
from ..base import TopKRows
from .base import ServedSource, topk_row
from .client import ServerError, ServerKind


class SGLangSource(ServedSource):
    kind = ServerKind.SGLANG
    models_optional = True

    def _probe_server(self, tokenizer: str | None) -> None:
        c = self._open_client
        for path in ("/get_model_info", "/model_info"):
            try:
                info = c.run(c.request("GET", path, root=self.roots[0], retry=False))
                self.server_info["model_info"] = info
                self.model = self.model or info.get("model_path")
                break
            except LogitdiffError:
                continue

    # ---- tokenization -----------------------------------------------------------------
    def _render_ids(self, item) -> list[int]:
        if self.tok is None:
            where = f"item {getattr(item, 'id', '?')!r}"
            raise LogitdiffError(f"{where}: an SGLang source needs tokenizer=PATH (a local copy of the served tokenizer) to render prompts")
        return self._local_render(item)

    def _server_detokenize(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def _server_texts(self) -> list[str]:
        return [f"<{i}>" for i in range(self.vocab_size)]

    # ---- model ---------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        c = self._open_client
        stopped = "max_tokens"
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
        r = c.run(c.request("POST", "/generate", body))
        ids = list(r.get("output_ids") or [])
        fr = (r.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(fr, dict) and fr.get("type") == "stop":
            stopped = "eos"
            m = fr.get("matched")
            if isinstance(m, int) and (not ids or ids[-1] != m):
                ids.append(m)
        return ids, stopped

    # input top logprobs, one sequence per request
    async def _score(self, pairs):
        c, K = self._open_client, self.top_k

        async def one(n):
            p, t = pairs[n]
            if not t:
                return TopKRows.empty(K)
            start = len(p) - 1
            body = {"input_ids": p + t, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": K,
                    "return_text_in_logprobs": False,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}}
            try:
                r = await c.request("POST", "/generate", body)
            except ServerError as e:
                raise LogitdiffError(f"{self.spec}: scoring request refused ({e})") from None
            if isinstance(r, list):
                r = r[0]
            itl = (r.get("meta_info") or {}).get("input_top_logprobs")
            if itl is None:
                raise LogitdiffError(f"{self.spec}: SGLang returned no meta_info.input_top_logprobs")
            n_in = len(p) + len(t)
            if len(itl) != n_in - start:
                raise LogitdiffError(f"{self.spec}: SGLang returned {len(itl)} input_top_logprobs entries, expected {n_in - start}")
            rows = []
            for j in range(len(t)):
                entry = itl[j + 1]
                where = f"{self.spec}: output position {j}"
                if not entry:
                    raise LogitdiffError(f"{where}: SGLang returned an empty input_top_logprobs entry")
                rows.append(topk_row([(e[1], e[0]) for e in entry], K, where, ordered=True, vocab_size=self.vocab_size))
            return TopKRows.stack(rows)

        return list(await asyncio.gather(*(one(n) for n in range(len(pairs)))))
