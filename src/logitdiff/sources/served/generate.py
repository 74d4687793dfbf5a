"""Greedy generation and batch-shaped teacher forcing on a llama-server, token by token.

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

#: the fields of an answer we read (the prompt's text and the rest are not sent back)
GEN_FIELDS = ("index", "tokens", "completion_probabilities", "timings", "stop_type", "truncated", "generation_settings")
SCORE_FIELDS = ("index", "completion_probabilities", "timings")
#: contexts per scoring request (one task each, run in order on one slot)
TASKS_PER_REQUEST = 64


def one_line(s: Any, n: int = 200) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


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


def parse_generation(answer: dict, n_predict: int, k: int, where: str) -> Trace:
    """A /completion answer as a :class:`Trace`; refuses what is not a fixed-length greedy
    generation with raw log-probabilities."""
    if not isinstance(answer, dict):
        raise LogitdiffError(f"{where}: the server's answer is not a JSON object")
    ids = answer.get("tokens")
    if not isinstance(ids, list):
        raise LogitdiffError(f"{where}: the answer has no 'tokens' (server too old for return_tokens)")
    ids = [int(t) for t in ids]
    if len(ids) != n_predict:
        raise LogitdiffError(
            f"{where}: the server generated {len(ids)} tokens, not n_predict={n_predict} "
            f"(stop_type {answer.get('stop_type')!r}; ignore_eos not honoured, or the context is too short)"
        )
    probs = answer.get("completion_probabilities") or []
    n = len(ids)
    logprob = np.full(n, np.nan)
    reported = np.zeros(n, bool)
    no_entry = np.ones(n, bool)
    top_ids = np.full((n, k), -1, np.int64)
    top_lps = np.full((n, k), -np.inf)
    # entries align to tokens from the end (see the module doc)
    j = len(probs) - 1
    for i in range(n - 1, -1, -1):
        if j < 0:
            break
        e = probs[j]
        if not isinstance(e, dict) or "id" not in e:
            raise LogitdiffError(f"{where}: a completion_probabilities entry is not an object with an id")
        if "top_probs" in e or ("prob" in e and "logprob" not in e):
            raise LogitdiffError(f"{where}: the server returned post-sampling probabilities; raw logprobs are required")
        if int(e["id"]) != ids[i]:
            continue  # token i has no entry (incomplete UTF-8 text): not reported
        j -= 1
        no_entry[i] = False
        top = e.get("top_logprobs") or []
        lp = e.get("logprob")
        if lp is None or not_reported(lp, len(top), k):
            continue
        pairs = []
        for d in top[:k]:
            v = d.get("logprob")
            if v is None or math.isnan(float(v)) or float(v) > 1e-6:
                raise LogitdiffError(f"{where}: token {i}: the server returned logprob {v!r} for token {d.get('id')}: not a log-probability")
            pairs.append((int(d["id"]), float(v)))
        pairs.sort(key=lambda x: (-x[1], x[0]))
        logprob[i] = float(lp)
        reported[i] = True
        for c, (tid, v) in enumerate(pairs):
            top_ids[i, c], top_lps[i, c] = tid, v
    if j >= 0:
        raise LogitdiffError(f"{where}: {j + 1} completion_probabilities entries match no generated token")
    tm = answer.get("timings") or {}
    return Trace(ids=np.asarray(ids, np.int64), logprob=logprob, reported=reported, no_entry=no_entry, top_ids=top_ids, top_lps=top_lps,
                 draft_n=int(tm.get("draft_n") or 0), draft_n_accepted=int(tm.get("draft_n_accepted") or 0),
                 timings={k2: tm[k2] for k2 in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")
                          if k2 in tm},
                 stop_type=answer.get("stop_type"), settings=answer.get("generation_settings") or {})


@dataclass
class Scored:
    """Teacher-forced rows of positions ``start..n-1``: top-K ids/logprobs and the width of
    the batch that evaluated each row (``timings.prompt_n``)."""

    top_ids: np.ndarray  # [m, K]
    top_lps: np.ndarray  # [m, K]
    widths: np.ndarray  # [m] int


class LlamaServer:
    """One llama-server, spoken to with one request at a time (concurrency 1)."""

    def __init__(self, url: str, *, role: str, top_k: int = 20, timeout: float = 600.0):
        import httpx

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
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))
        try:
            self._handshake()
        except BaseException:
            self._http.close()
            raise

    def _handshake(self) -> None:
        self.props = self._get("/props")
        if not isinstance(self.props, dict) or not ("default_generation_settings" in self.props or "build_info" in self.props):
            raise LogitdiffError(f"{self.where}: not a llama-server (no /props with default_generation_settings)")
        params = (self.props.get("default_generation_settings") or {}).get("params") or {}
        if params.get("post_sampling_probs"):
            raise LogitdiffError(f"{self.where}: configured for post-sampling probabilities; raw logprobs are required")
        self.n_ctx = int((self.props.get("default_generation_settings") or {}).get("n_ctx") or 0)
        n_vocab = self._n_vocab()
        if n_vocab and self.k > n_vocab:
            # the server would hand out the whole vocabulary and the report claim K log-probabilities
            raise LogitdiffError(f"--top-k {self.k}: exceeds the vocabulary size {n_vocab} of the {self.where}")
        try:
            slots = self._get("/slots")
        except LogitdiffError:
            slots = None
        self.slots_visible = isinstance(slots, list) and bool(slots)
        #: whether the server holds a speculative decoding context (/slots), None when it does not say
        self.can_speculate = any(bool(s.get("speculative")) for s in slots) if self.slots_visible else None
        self.spec_types = None
        if self.slots_visible:
            self.spec_types = ((slots[0].get("params") or {}).get("speculative.types"))
        self._ascii: int | None = None

    def _n_vocab(self) -> int | None:
        """The model's vocabulary size from /v1/models (llama-server's meta.n_vocab); None
        when the server does not say."""
        try:
            models = self._get("/v1/models")
            n = ((models.get("data") or [{}])[0].get("meta") or {}).get("n_vocab")
        except (LogitdiffError, AttributeError, IndexError, TypeError):
            return None
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def close(self) -> None:
        self._http.close()

    # ---- HTTP ----------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, what: str = "") -> Any:
        import httpx

        where = f"{self.where}{': ' + what if what else ''}"
        try:
            r = self._http.request(method, self.url + path, json=body)
        except httpx.TimeoutException:
            raise LogitdiffError(f"{where}: no answer within the timeout ({path})") from None
        except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProtocolError) as e:
            raise LogitdiffError(f"{where}: connection lost or refused on {path} ({type(e).__name__}); did the server die?") from None
        try:
            data = r.json()
        except ValueError:
            data = r.text
        if r.status_code >= 400:
            msg = data.get("error", data) if isinstance(data, dict) else data
            if isinstance(msg, dict):
                msg = msg.get("message", msg)
            raise LogitdiffError(f"{where}: HTTP {r.status_code} on {path}: {one_line(msg)}")
        return data

    def _get(self, path: str) -> Any:
        return self._call("GET", path)

    def identity(self) -> dict:
        p = self.props
        return {
            "url": self.url,
            "build_info": p.get("build_info"),
            "model_path": p.get("model_path"),
            "total_slots": p.get("total_slots"),
            "n_ctx": self.n_ctx,
            "can_speculate": self.can_speculate,
            "speculative_types": self.spec_types,
            "default_samplers": ((p.get("default_generation_settings") or {}).get("params") or {}).get("samplers"),
        }

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        r = self._call("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": True}, "tokenize")
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in r.get("tokens", [])]

    def apply_template(self, messages: list, tools: list | None) -> str:
        body: dict = {"messages": messages}
        if tools:
            body["tools"] = tools
        return self._call("POST", "/apply-template", body, "apply-template")["prompt"]

    def ascii_token(self) -> int | None:
        """A token whose text is one ASCII character: a scoring request's sampled token is
        biased to it, because llama-server drops the probabilities of a sampled token whose
        text is an incomplete UTF-8 sequence (the raw n_probs are computed before any sampler,
        so the bias changes nothing we read)."""
        if self._ascii is None:
            for text in ("a", "e", "0", " ", "x", "."):
                r = self._call("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False}, "tokenize")
                toks = r.get("tokens") or []
                if len(toks) == 1:
                    t = toks[0]
                    self._ascii = int(t["id"]) if isinstance(t, dict) else int(t)
                    break
            else:
                self._ascii = -1
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
        answer = self._call("POST", "/completion", self.generation_body(prompt, n_predict), f"item {item} generation")
        return parse_generation(answer, n_predict, self.k, where)

    # ---- teacher forcing in a batch shape --------------------------------------------------
    def score(self, prompt: Sequence[int], tokens: Sequence[int] | np.ndarray, *, start: int = 0, width: int = 1, item: str = "") -> Scored:
        """The next-token top-K after ``prompt + tokens[:j]`` for ``j = start .. len(tokens) - 1``,
        every row from a prefill batch of ``width`` tokens (see the module doc)."""
        full = [int(i) for i in prompt] + [int(i) for i in tokens]
        P, n, K = len(prompt), len(tokens), self.k
        m = n - start
        top_ids = np.full((max(m, 0), K), -1, np.int64)
        top_lps = np.full((max(m, 0), K), -np.inf)
        widths = np.zeros(max(m, 0), np.int64)
        if m <= 0:
            return Scored(top_ids, top_lps, widths)
        w = max(1, int(width))
        where = f"{self.where}: item {item} teacher forcing"
        for o in range(min(w, m)):
            js = list(range(start + o, n, w))
            for c in range(0, len(js), TASKS_PER_REQUEST):
                part = js[c : c + TASKS_PER_REQUEST]
                prime = full[: max(1, P + part[0] - w)]
                contexts = [prime] + [full[: P + j] for j in part]
                body = {"prompt": contexts, "n_predict": 1, "n_probs": K, "post_sampling_probs": False,
                        "samplers": ["top_k"], "top_k": 1, "temperature": 0.0, "cache_prompt": True, "id_slot": 0,
                        "stream": False, "response_fields": list(SCORE_FIELDS)}
                if self.ascii_token() is not None:
                    body["logit_bias"] = [[self.ascii_token(), 1e6]]
                ans = self._call("POST", "/completion", body, f"item {item} teacher forcing")
                if isinstance(ans, dict):
                    ans = [ans]
                if not isinstance(ans, list) or len(ans) != len(contexts):
                    raise LogitdiffError(f"{where}: {len(contexts)} contexts sent, {len(ans) if isinstance(ans, list) else 0} answers")
                ans = sorted(ans, key=lambda a: int(a.get("index", 0)))
                for j, a in zip(part, ans[1:]):
                    cp = a.get("completion_probabilities") or []
                    top = (cp[0].get("top_logprobs") if cp else None) or []
                    if len(top) < K:
                        raise LogitdiffError(f"{where}: position {j}: {len(top)} < K={K} logprobs returned")
                    pairs = sorted(((int(d["id"]), float(d["logprob"])) for d in top[:K]), key=lambda x: (-x[1], x[0]))
                    r = j - start
                    top_ids[r] = [p[0] for p in pairs]
                    top_lps[r] = [p[1] for p in pairs]
                    widths[r] = int((a.get("timings") or {}).get("prompt_n") or 0)
        return Scored(top_ids, top_lps, widths)
