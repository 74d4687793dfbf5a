"""Greedy generation and batch-shaped teacher forcing on a llama-server, token by token,
through the one llama-server client (:mod:`.llamacpp_client`: every answer field checked).

The protocol of generation mode (:mod:`logitdiff.speculation`), checked against the
llama.cpp vendored by llama-cpp-python (tools/server: server-schema.cpp, server-context.cpp,
server-task.cpp, server-common.cpp):

* ``POST /completion`` with ``prompt`` = token ids (never text), ``n_predict`` = N and
  ``ignore_eos: true`` (a -inf logit bias on every end-of-generation token: fixed length),
  ``samplers: ["top_k"]`` + ``top_k: 1`` (argmax, then ``dist`` picks the only survivor) and
  ``temperature: 0``, ``n_probs: K`` with ``post_sampling_probs: false`` (raw softmax of the
  model's logits over the whole vocabulary), ``cache_prompt: false`` (the prompt is
  prefilled from scratch), ``return_tokens: true``, no penalties.
* Per generated token the answer's ``completion_probabilities`` has ``id``, ``logprob`` and
  ``top_logprobs``. For every token produced by a speculative step (the accepted draft
  tokens and the target's own token after them) the server sets ``prob = 1.0`` and no top
  list ("TODO: set result.probs"): ``logprob`` 0.0 with an empty list. Such a token is
  marked *probability not reported*, never read as p = 1. A token whose text ends in an
  incomplete UTF-8 sequence gets no entry at all (``slot.add_token`` is skipped); entries
  are aligned to ``tokens`` from the end (the entry belongs to the token that completes
  the character), unmatched tokens are *not reported* too.
* ``timings.draft_n`` / ``draft_n_accepted`` exist only when the request drafted
  (``n_draft_tokens > 0``): absent means 0, the per-request proof that drafting never ran.
* ``GET /slots`` says per slot whether the server can speculate (``speculative``) and its
  ``speculative.types``; ``GET /props`` the build, model and default sampling settings.

Teacher forcing in a chosen batch shape (:meth:`LlamaServer.score`): the next-token
distribution after ``prompt + tokens[:j]`` is the ``n_probs`` of a one-token completion of
that context. With the prompt cache on and every task pinned to one slot, the server
evaluates only what its cache lacks, so ordering the contexts ``j, j + w, j + 2w, ...``
after a priming context ``w`` tokens shorter makes every row come from a prefill batch of
width ``w`` (``w = 1``: one-token decode steps, the shape of greedy decoding). The width
each row really had is read back from ``timings.prompt_n``, never assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...errors import LogitdiffError
from .client import HttpClient
from .llamacpp_client import LlamaServerClient, checked, top_logprobs
from .llamacpp_client import field as answer_field

#: the fields of an answer we read (the prompt's text and the rest are not sent back)
GEN_FIELDS = ("index", "tokens", "completion_probabilities", "timings", "stop_type", "truncated", "generation_settings")
SCORE_FIELDS = ("index", "completion_probabilities", "timings")
#: contexts per scoring request (one task each, run in order on one slot)
TASKS_PER_REQUEST = 64


#: the timings of a generation kept in its trace (numbers, each checked)
TIMINGS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")


@dataclass
class Trace:
    """One greedy generation: per token its id, returned log-probability and top-K (NaN /
    -1 where the server reported none), and the request's speculation counters."""

    ids: np.ndarray  # [n] int64
    logprob: np.ndarray  # [n] float64, NaN where not reported
    reported: np.ndarray  # [n] bool
    no_entry: np.ndarray  # [n] bool: no completion_probabilities entry at all (incomplete UTF-8 text)
    top_ids: np.ndarray  # [n, K] int64, -1 padded
    top_lps: np.ndarray  # [n, K] float64, -inf padded
    draft_n: int = 0
    draft_n_accepted: int = 0
    timings: dict = field(default_factory=dict)
    stop_type: str | None = None
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Per token: id, logprob (null: probability not reported), top-K ids and logprobs
        (empty where not reported)."""
        tops = []
        for r in range(len(self.ids)):
            ok = self.top_ids[r] >= 0
            tops.append([[int(i), float(v)] for i, v in zip(self.top_ids[r][ok], self.top_lps[r][ok])])
        return {
            "ids": self.ids.tolist(),
            "logprob": [float(v) if ok else None for v, ok in zip(self.logprob, self.reported)],
            "top": tops,
            "no_entry": np.flatnonzero(self.no_entry).tolist(),
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "timings": self.timings,
            "stop_type": self.stop_type,
        }


def not_reported(logprob: float | None, n_top: int, k: int) -> bool:
    """A token's probability was not reported: logprob exactly 0.0 with a short or empty top
    list (llama-server's speculative tokens), or no logprob at all."""
    return logprob is None or (logprob == 0.0 and n_top < k)


def parse_generation(answer: Any, n_predict: int, k: int, where: str) -> Trace:
    """A /completion answer as a :class:`Trace`; refuses what is not a fixed-length greedy
    generation with raw log-probabilities, and every field of the wrong type (one line
    naming the field)."""
    checked(answer, "object", where, "")
    if "tokens" not in answer:
        raise LogitdiffError(f"{where}: the answer has no 'tokens' (server too old for return_tokens)")
    ids = [int(checked(t, "int", where, f"tokens[{n}]")) for n, t in enumerate(answer_field(answer, "tokens", "list", where))]
    stop_type = answer_field(answer, "stop_type", "str", where, optional=True)
    if len(ids) != n_predict:
        raise LogitdiffError(
            f"{where}: the server generated {len(ids)} tokens, not n_predict={n_predict} "
            f"(stop_type {stop_type!r}; ignore_eos not honoured, or the context is too short)"
        )
    probs = answer_field(answer, "completion_probabilities", "list", where, optional=True) or []
    n = len(ids)
    tr = Trace(ids=np.asarray(ids, np.int64), logprob=np.full(n, np.nan), reported=np.zeros(n, bool), no_entry=np.ones(n, bool),
               top_ids=np.full((n, k), -1, np.int64), top_lps=np.full((n, k), -np.inf), stop_type=stop_type,
               settings=answer_field(answer, "generation_settings", "object", where, optional=True) or {})
    _read_probabilities(tr, probs, k, where)
    tm = answer_field(answer, "timings", "object", where, optional=True) or {}
    tr.timings = {t: answer_field(tm, t, "number", where, f"timings.{t}") for t in TIMINGS if t in tm}
    # absent: the request never drafted (0)
    tr.draft_n = int(answer_field(tm, "draft_n", "int", where, "timings.draft_n", optional=True) or 0)
    tr.draft_n_accepted = int(answer_field(tm, "draft_n_accepted", "int", where, "timings.draft_n_accepted", optional=True) or 0)
    return tr


def _read_probabilities(tr: Trace, probs: list, k: int, where: str) -> None:
    """The ``completion_probabilities`` entries into ``tr``, aligned to its tokens from the
    end (see the module doc)."""
    ids = tr.ids
    j = len(probs) - 1
    for i in range(len(ids) - 1, -1, -1):
        if j < 0:
            break
        e, name = probs[j], f"completion_probabilities[{j}]"
        checked(e, "object", where, name)
        if "top_probs" in e or ("prob" in e and "logprob" not in e):
            raise LogitdiffError(f"{where}: the server returned post-sampling probabilities; raw logprobs are required")
        if int(answer_field(e, "id", "int", where, f"{name}.id")) != ids[i]:
            continue  # token i has no entry (incomplete UTF-8 text): not reported
        j -= 1
        tr.no_entry[i] = False
        top = top_logprobs(e, where, name) if e.get("top_logprobs") is not None else []
        lp = answer_field(e, "logprob", "number", where, f"{name}.logprob", optional=True)
        if lp is None or not_reported(lp, len(top), k):
            continue
        pairs = []
        for tid, v in top[:k]:
            if math.isnan(v) or v > 1e-6:
                raise LogitdiffError(f"{where}: token {i}: the server returned logprob {v!r} for token {tid}: not a log-probability")
            pairs.append((tid, v))
        pairs.sort(key=lambda x: (-x[1], x[0]))
        tr.logprob[i] = float(lp)
        tr.reported[i] = True
        for c, (tid, v) in enumerate(pairs):
            tr.top_ids[i, c], tr.top_lps[i, c] = tid, v
    if j >= 0:
        raise LogitdiffError(f"{where}: {j + 1} completion_probabilities entries match no generated token")


@dataclass
class Scored:
    """Teacher-forced rows of positions ``start..n-1``: top-K ids/logprobs and the width of
    the batch that evaluated each row (``timings.prompt_n``)."""

    top_ids: np.ndarray  # [m, K]
    top_lps: np.ndarray  # [m, K]
    widths: np.ndarray  # [m] int


class LlamaServer:
    """One llama-server in generation mode, spoken to with one request at a time
    (concurrency 1, no retries) through the one llama-server client
    (:class:`~logitdiff.sources.served.llamacpp_client.LlamaServerClient`)."""

    def __init__(self, url: str, *, role: str, top_k: int = 20, timeout: float = 600.0):
        u = url.strip().rstrip("/")
        for prefix in ("served:", "openai:"):  # openai: the old name of served:
            if u.startswith(prefix):
                u = u[len(prefix):]
        if u.endswith("/v1"):
            u = u[:-3]
        if not (u.startswith("http://") or u.startswith("https://")):
            raise LogitdiffError(f"{role} {url!r}: expected a llama-server URL http://HOST:PORT")
        self.url, self.role, self.k = u, role, int(top_k)
        self.where = f"{role} server {u}"
        http = HttpClient([u], concurrency=1, timeout=float(timeout), retries=1, spec=self.where)
        self.client = LlamaServerClient(http, self.where, u)
        try:
            self._handshake()
        except BaseException:
            http.close()
            raise

    def _handshake(self) -> None:
        c = self.client
        self.props = c.props()
        if self.props.post_sampling_probs:
            raise LogitdiffError(f"{self.where}: configured for post-sampling probabilities; raw logprobs are required")
        self.n_ctx = int(self.props.n_ctx or 0)
        n_vocab = c.n_vocab()
        if n_vocab and self.k > n_vocab:
            # the server would hand out the whole vocabulary and the report claim K log-probabilities
            raise LogitdiffError(f"--top-k {self.k}: exceeds the vocabulary size {n_vocab} of the {self.where}")
        slots = c.slots()
        self.slots_visible = bool(slots)
        w = c.at("slots", "/slots", "GET")
        #: whether the server holds a speculative decoding context (/slots), None when it does not say
        self.can_speculate = any([bool(answer_field(s, "speculative", "bool", w, f"[{n}].speculative", optional=True))
                                  for n, s in enumerate(slots)]) if slots else None
        self.spec_types = None
        if slots:
            # copied into the report's identity as the server sent it (any JSON value)
            params = answer_field(slots[0], "params", "object", w, "[0].params", optional=True)
            self.spec_types = (params or {}).get("speculative.types")
        self._ascii: int | None = None

    def close(self) -> None:
        self.client.http.close()

    def identity(self) -> dict:
        p = self.props
        return {
            "url": self.url,
            "build_info": p.build_info,
            "model_path": p.model_path,
            "total_slots": p.total_slots,
            "n_ctx": self.n_ctx,
            "can_speculate": self.can_speculate,
            "speculative_types": self.spec_types,
            "default_samplers": p.samplers,
        }

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.client.tokenize(text)

    def apply_template(self, messages: list, tools: list | None) -> str:
        return self.client.apply_template(messages, tools)

    def ascii_token(self) -> int | None:
        """A token whose text is one ASCII character (:meth:`LlamaServerClient.ascii_token`)."""
        if self._ascii is None:
            t = self.client.ascii_token()
            self._ascii = -1 if t is None else t
        return None if self._ascii < 0 else self._ascii

    # ---- generation ----------------------------------------------------------------------
    def generation_body(self, prompt: Sequence[int], n_predict: int) -> dict:
        return {
            "prompt": [int(i) for i in prompt], "n_predict": int(n_predict), "ignore_eos": True,
            "samplers": ["top_k"], "top_k": 1, "temperature": 0.0, "seed": 0,
            "n_probs": self.k, "post_sampling_probs": False, "cache_prompt": False, "return_tokens": True,
            "repeat_penalty": 1.0, "dry_multiplier": 0.0, "stream": False, "response_fields": list(GEN_FIELDS),
        }

    def generate(self, prompt: Sequence[int], n_predict: int, item: str) -> Trace:
        where = f"{self.where}: item {item}"
        if self.n_ctx and len(prompt) + n_predict > self.n_ctx:
            raise LogitdiffError(f"{where}: prompt {len(prompt)} + n_predict {n_predict} tokens exceed the slot context {self.n_ctx}")
        what = f"item {item} generation"
        answer = self.client.call("POST", "/completion", self.generation_body(prompt, n_predict), what)
        return parse_generation(answer, n_predict, self.k, self.client.at(what))

    # ---- teacher forcing in a batch shape --------------------------------------------------
    def score(self, prompt: Sequence[int], tokens: Sequence[int] | np.ndarray, *, start: int = 0, width: int = 1, item: str = "") -> Scored:
        """The next-token top-K after ``prompt + tokens[:j]`` for ``j = start .. len(tokens) - 1``,
        every row from a prefill batch of ``width`` tokens (see the module doc)."""
        full = [int(i) for i in prompt] + [int(i) for i in tokens]
        P, n, K = len(prompt), len(tokens), self.k
        m = max(n - start, 0)
        out = Scored(np.full((m, K), -1, np.int64), np.full((m, K), -np.inf), np.zeros(m, np.int64))
        w = max(1, int(width))
        for o in range(min(w, m)):
            js = list(range(start + o, n, w))
            for c in range(0, len(js), TASKS_PER_REQUEST):
                part = js[c : c + TASKS_PER_REQUEST]
                prime = full[: max(1, P + part[0] - w)]
                answers = self._score_request([prime] + [full[: P + j] for j in part], item)
                for j, (pairs, width_seen) in zip(part, answers[1:]):
                    if len(pairs) < K:
                        raise LogitdiffError(f"{self.where}: item {item} teacher forcing: position {j}: {len(pairs)} < K={K} "
                                             "logprobs returned")
                    r = j - start
                    out.top_ids[r] = [p[0] for p in pairs]
                    out.top_lps[r] = [p[1] for p in pairs]
                    out.widths[r] = width_seen
        return out

    def _score_request(self, contexts: list[list[int]], item: str) -> list[tuple[list[tuple[int, float]], int]]:
        """One request of one-token completions of ``contexts``, in order on slot 0: per
        context its top-K ``(id, logprob)`` pairs (sorted) and the prompt tokens the server
        evaluated for it (``timings.prompt_n``: the batch width), every field checked."""
        K = self.k
        body = {"prompt": contexts, "n_predict": 1, "n_probs": K, "post_sampling_probs": False,
                "samplers": ["top_k"], "top_k": 1, "temperature": 0.0, "cache_prompt": True, "id_slot": 0,
                "stream": False, "response_fields": list(SCORE_FIELDS)}
        if self.ascii_token() is not None:
            body["logit_bias"] = [[self.ascii_token(), 1e6]]
        what = f"item {item} teacher forcing"
        ans = self.client.call("POST", "/completion", body, what)
        where = self.client.at(what)
        if isinstance(ans, dict):
            ans = [ans]
        if not isinstance(ans, list) or len(ans) != len(contexts):
            raise LogitdiffError(f"{where}: {len(contexts)} contexts sent, {len(ans) if isinstance(ans, list) else 0} answers")
        for n, a in enumerate(ans):
            answer_field(a, "index", "int", where, f"[{n}].index", optional=True)
        out = []
        for n, a in enumerate(sorted(ans, key=lambda a: int(a.get("index") or 0))):
            cp = answer_field(a, "completion_probabilities", "list", where, f"[{n}].completion_probabilities", optional=True) or []
            top = top_logprobs(cp[0], where, f"[{n}].completion_probabilities[0]") if cp else []
            tm = answer_field(a, "timings", "object", where, f"[{n}].timings", optional=True) or {}
            prompt_n = answer_field(tm, "prompt_n", "int", where, f"[{n}].timings.prompt_n", optional=True) or 0
            out.append((sorted(top[:K], key=lambda x: (-x[1], x[0])), int(prompt_n)))
        return out
