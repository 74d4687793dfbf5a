"""Served models: an OpenAI-compatible inference server as a source of top-K logprobs.

Spec::

    openai:http://HOST:PORT[/v1][,model=NAME][,kind=auto|llamacpp|vllm|sglang][,top_k=K]
          [,concurrency=N][,timeout=S][,retries=N][,batch=N][,endpoints=URL2|URL3]
          [,vocab_size=N][,tokenizer=PATH]

* ``kind``        which server speaks at URL (default ``auto``: probed, see :func:`detect_kind`).
* ``top_k``       K log-probabilities per position (default 64).
* ``concurrency`` requests in flight at once, over all endpoints (default 8).
* ``timeout``     seconds per request (default 300); ``retries`` attempts per request on
                  timeouts, connection errors and 5xx, with exponential backoff (default 4).
* ``batch``       sequences per vLLM request (default 4); llama-server scores up to 32
                  positions of one item per request, SGLang one sequence per request.
* ``endpoints``   more replicas of the same model (``|``-separated URLs), used round-robin.
* ``vocab_size``  V of the distribution (default: from the server or ``tokenizer``).
* ``tokenizer``   a local HF tokenizer directory: gives the tokenizer hash, the vocabulary
                  size and token texts; the server's tokenization is checked against it.
                  Without it the V token texts (for reports) come from the server's
                  ``/detokenize`` in ``ceil(V / 65,536)`` requests, never one per id.
* ``cache_prompt`` llama-server only (default true): reuse the cached prefix, so each
                  position request evaluates one new token. ``false`` re-evaluates the whole
                  prefix per position (quadratic cost) in one batch, as the in-process
                  ``gguf:`` source does: incremental decoding differs from a batched prefill by
                  float rounding (up to ~1e-4 in logprobs on a random F32 model).

Every request sends **token ids**, never text, so the server scores exactly the teacher
sequence. Per server:

* **vLLM** (``/v1/completions``): ``prompt`` = list of token-id lists (``batch`` sequences),
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
  refused by the checks below (a positive value, or a top-K summing above 1) and the
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
* **llama-server** (``/completion``): no prompt logprobs, so one task per position:
  ``prompt`` = a list of token-id prefixes (up to 32 positions per request, one task each),
  ``n_predict: 1``, ``n_probs: K``, ``post_sampling_probs: false`` (raw softmax of the logits
  over the whole vocabulary), ``cache_prompt: true``, ``response_fields`` (only what we read);
  we read ``completion_probabilities[0].top_logprobs`` (``id``, ``logprob``) of each answer
  (ordered by ``index``). Positions of one item run in order on one server slot
  (``id_slot``; each task extends the cached prefix by one token), with the item's next
  request already queued on that slot while one runs; items run concurrently, one per slot
  of each replica. Where the server clears idle slots (llama-server's default flags: -np
  auto, --cache-idle-slots; probed when the source opens), items go in rounds instead: one
  request of unpinned tasks (``id_slot: -1``) holding the next position of every item in
  flight (at most one item per slot), so the server decodes them as one batch and restores
  each item's prefix from its slot or the host-RAM prompt cache.
  ``timings`` (``prompt_n``, ``cache_n``) of every answer are summed in ``server_stats``.
* **SGLang** (``/generate``): ``input_ids`` = ``prompt + teacher``, ``return_logprob: true``,
  ``logprob_start_len: P - 1``, ``top_logprobs_num: K``, ``max_new_tokens: 1``; entry j of
  ``meta_info.input_top_logprobs`` (a list of ``[logprob, token_id, text]``; entry 0 is null)
  predicts input token ``P - 1 + j``.

Refused (a one-line :class:`LogitdiffError`, never a report): fewer than K finite entries,
an unsorted list, probabilities summing above 1 + 1e-4, a positive log-probability, a
missing forced token (vLLM), post-sampling probabilities (llama-server ``top_probs``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import LogitdiffError
from . import Generation, Source, Spec, json_safe, tokenizer_hash_of

KINDS = ("llamacpp", "vllm", "sglang")
_KNOWN_OPTIONS = {"model", "kind", "top_k", "concurrency", "timeout", "retries", "batch", "endpoints", "vocab_size", "tokenizer",
                  "cache_prompt"}
SUM_TOL = 1e-4
#: token ids per /detokenize request when token texts come from the server (a few MB of JSON)
DETOKENIZE_CHUNK = 65_536
#: llama-server scoring: positions (tasks) per /completion request, a cap on the prompt tokens
#: one request carries, and the fields of its final events we read (the rest, e.g. the
#: prompt's text, is not sent)
LLAMACPP_TASKS_PER_REQUEST = 32
LLAMACPP_TOKENS_PER_REQUEST = 262_144
LLAMACPP_FIELDS = ("index", "stop", "timings")
#: candidate separators between token texts in one /detokenize request (see OpenAISource._separator)
SEPARATORS = ("[[~logitdiff|sep~]]", "{@ld#7f3a@}", "<~ld~sep~>")


def _one_line(s: Any, n: int = 300) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _root(url: str) -> str:
    u = url.strip().rstrip("/")
    if not re.match(r"^https?://", u):
        raise LogitdiffError(f"openai: endpoint {url!r} must start with http:// or https://")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def _border_free(s: str) -> bool:
    """No proper prefix of ``s`` is also a suffix: occurrences of ``s`` never overlap."""
    return all(s[:i] != s[-i:] for i in range(1, len(s)))


def _bool_option(spec: Spec, key: str, default: bool) -> bool:
    v = spec.options.get(key)
    if v is None:
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise LogitdiffError(f"source spec {spec.text!r}: option {key}={v!r} must be true or false")


class ServerError(LogitdiffError):
    """An HTTP error answer (4xx) of a server; ``status`` and ``body`` kept for callers."""

    def __init__(self, msg: str, status: int = 0, body: Any = None):
        super().__init__(msg)
        self.status, self.body = status, body


# --------------------------------------------------------------------------------------
# validation of one position's top-K (shared by every server kind)
# --------------------------------------------------------------------------------------


def topk_row(pairs: list[tuple[int, float]], k: int, where: str, *, ordered: bool, forced: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise one position: ``pairs`` = (token id, logprob) as the server sent them.

    ``ordered``: the server promises a descending list (checked). ``forced``: the token the
    protocol promises to include (vLLM). Returns the K best (descending, lowest id on ties).
    """
    clean = []
    for tid, lp in pairs:
        if lp is None:
            continue
        lp = float(lp)
        if math.isnan(lp):
            raise LogitdiffError(f"{where}: the server returned a NaN logprob for token {tid}")
        if lp > 1e-6:
            raise LogitdiffError(f"{where}: the server returned logprob {lp:.6g} > 0 for token {tid}: not log-probabilities")
        clean.append((int(tid), lp))
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


# --------------------------------------------------------------------------------------
# an HTTP client on its own event loop thread (sync facade for the Source interface)
# --------------------------------------------------------------------------------------


class _Client:
    def __init__(self, roots: list[str], *, concurrency: int, timeout: float, retries: int, spec: str):
        import httpx

        self.roots = roots
        self.spec = spec
        self.retries = retries
        self.timeout = timeout
        self.concurrency = concurrency
        self._rr = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logitdiff-openai", daemon=True)
        self._thread.start()
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)

        async def make():
            self._sem = asyncio.Semaphore(concurrency)
            return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)), limits=limits)

        self._http = self.run(make())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.run(self._http.aclose())
        except Exception:  # noqa: BLE001
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def next_root(self) -> str:
        return self.roots[next(self._rr) % len(self.roots)]

    async def _send(self, method: str, url: str, body: Any, started: asyncio.Event | None):
        if started is None:
            return await self._http.request(method, url, json=body)
        async with self._http.stream(method, url, json=body) as r:
            if r.status_code < 400:
                started.set()  # the server sends its headers with its first result
            await r.aread()
            return r

    async def request(self, method: str, path: str, body: Any = None, *, root: str | None = None, retry: bool = True,
                      bounded: bool = True, failover: bool = False, started: asyncio.Event | None = None) -> Any:
        """JSON request with bounded concurrency and retries (timeouts, connection errors, 5xx).

        Without ``root`` each attempt takes the next endpoint (round-robin); with ``root`` the
        first attempt goes there and, with ``failover``, retries move on to the other replicas.
        With ``started`` the answer is a server-sent event stream (``"stream": true``): the
        event is set when its first event arrives, and the answer is the list of its events."""
        import httpx

        attempts = self.retries if retry else 1
        last = ""
        delay = 0.25
        for attempt in range(max(1, attempts)):
            if root is not None and (attempt == 0 or not failover):
                base = root
            else:
                base = self.next_root()
            url = base + path
            try:
                if bounded:
                    async with self._sem:
                        r = await self._send(method, url, body, started)
                else:
                    r = await self._send(method, url, body, started)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                # connected, then silence: say so rather than "connection failed"
                last = f"{url}: no response within {self.timeout:g} s"
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                last = f"{url}: {type(e).__name__}{': ' + _one_line(e, 120) if str(e) else ''}"
            else:
                if r.status_code < 400 and started is not None:
                    return _sse_events(r.text, url)
                if r.status_code < 400:
                    try:
                        return r.json()
                    except ValueError:
                        raise LogitdiffError(f"{url}: answer is not JSON ({_one_line(r.text, 120)!r})") from None
                try:
                    payload = r.json()
                except ValueError:
                    payload = r.text
                if r.status_code >= 500 and r.status_code != 501:
                    last = f"{url}: HTTP {r.status_code} {_one_line(_err_text(payload), 160)}"
                else:
                    raise ServerError(f"{url}: HTTP {r.status_code} {_one_line(_err_text(payload), 240)}", r.status_code, payload)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 8.0)
        raise LogitdiffError(f"{self.spec}: server unreachable or failing after {max(1, attempts)} attempt(s) ({last})")


def _sse_events(text: str, url: str) -> list:
    """The JSON payloads of a server-sent event stream (``data: {...}`` lines)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            if data and data != "[DONE]":
                try:
                    events.append(json.loads(data))
                except ValueError:
                    raise LogitdiffError(f"{url}: an event of the answer is not JSON ({_one_line(data, 120)!r})") from None
    return events


def _err_text(payload: Any) -> str:
    if isinstance(payload, dict):
        e = payload.get("error", payload.get("message", payload.get("detail", payload)))
        if isinstance(e, dict):
            return str(e.get("message", e))
        return str(e)
    return str(payload)


PROBE_TIMEOUT_S = 10.0
PROBE_UNREACHABLE = -1  # no connection
PROBE_SILENT = -2  # connected, but no answer in time (the body is the seconds waited)


async def _probe(http, url: str) -> tuple[int, Any]:
    import httpx

    wait = min(PROBE_TIMEOUT_S, http.timeout.read or PROBE_TIMEOUT_S)
    try:
        r = await http.get(url, timeout=wait)
    except httpx.ReadTimeout:
        return PROBE_SILENT, wait
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError):
        return PROBE_UNREACHABLE, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


# --------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------


class OpenAISource(Source):
    distribution = "topk"
    logits_dtype = "float32"

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        kind: str = "auto",
        top_k: int = 64,
        concurrency: int = 8,
        timeout: float = 300.0,
        retries: int = 4,
        batch: int = 4,
        vocab_size: int | None = None,
        tokenizer: str | None = None,
        cache_prompt: bool = True,
        spec: str | None = None,
    ):
        if not urls:
            raise LogitdiffError("openai: needs a server URL (openai:http://HOST:PORT)")
        self.roots = [_root(u) for u in urls]
        self.spec = spec or f"openai:{urls[0]}"
        if kind not in ("auto",) + KINDS:
            raise LogitdiffError(f"source spec {self.spec!r}: kind={kind!r} (expected auto, llamacpp, vllm or sglang)")
        if top_k < 1:
            raise LogitdiffError(f"source spec {self.spec!r}: top_k must be >= 1")
        self.top_k = int(top_k)
        self.batch = max(1, int(batch))
        self._extra_score_body: dict = {}  # tests: force server options (e.g. post_sampling_probs)
        self._force_tok: int | None = None
        self._n_slots = 1
        self._pin_slots = True
        self.cache_prompt = cache_prompt
        # llama-server: tasks answered and prompt tokens evaluated / taken from the cache
        # (its ``timings``), summed over this source's scoring requests
        self.server_stats = {"tasks": 0, "prompt_tokens_evaluated": 0, "prompt_tokens_cached": 0}
        self._client = _Client(self.roots, concurrency=max(1, int(concurrency)), timeout=float(timeout),
                               retries=max(1, int(retries)), spec=self.spec)
        try:
            self._init(model, kind, vocab_size, tokenizer)
        except BaseException:
            self._client.close()
            raise

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: Spec) -> "OpenAISource":
        text = spec.text or f"{spec.kind}:{spec.target}"
        unknown = set(spec.options) - _KNOWN_OPTIONS
        if unknown:
            raise LogitdiffError(
                f"source spec {text!r}: unknown option {sorted(unknown)[0]!r} (openai: takes {', '.join(sorted(_KNOWN_OPTIONS))})"
            )
        if not spec.target:
            raise LogitdiffError(f"source spec {text!r}: missing server URL (openai:http://HOST:PORT)")

        def num(key, default, conv=int):
            if key not in spec.options:
                return default
            try:
                v = conv(spec.options[key])
            except ValueError:
                v = -1
            if v <= 0:
                raise LogitdiffError(f"source spec {text!r}: option {key}={spec.options[key]!r} must be a positive number")
            return v

        urls = [spec.target] + [u for u in spec.options.get("endpoints", "").split("|") if u.strip()]
        return cls(
            urls,
            model=spec.options.get("model") or None,
            kind=spec.options.get("kind", "auto"),
            top_k=num("top_k", 64),
            concurrency=num("concurrency", 8),
            timeout=num("timeout", 300.0, float),
            retries=num("retries", 4),
            batch=num("batch", 4),
            vocab_size=num("vocab_size", None),
            tokenizer=spec.options.get("tokenizer") or None,
            cache_prompt=_bool_option(spec, "cache_prompt", True),
            spec=text,
        )

    def _init(self, model, kind, vocab_size, tokenizer) -> None:
        c = self._client
        root = self.roots[0]
        if kind == "auto":
            kind = c.run(detect_kind(c._http, root, self.spec))
        self.kind = kind
        self._vllm_tokenizer = True  # False: vLLM started with --skip-tokenizer-init
        self.server_info: dict = {"kind": kind}
        self.model = model
        self.tok = None
        self._token_texts: list[str] | None = None
        server_vocab = None
        # every replica must answer and serve the same model
        for r in self.roots:
            try:
                models = c.run(c.request("GET", "/v1/models", root=r, retry=True))
            except ServerError as e:
                if kind == "sglang":
                    models = {"data": []}
                else:
                    raise LogitdiffError(f"{self.spec}: {e}") from None
            served = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
            if self.model is None:
                if kind == "vllm" and len(served) != 1:
                    raise LogitdiffError(
                        f"{self.spec}: the server serves {len(served)} models ({', '.join(map(str, served))}); pick one with model=NAME"
                    )
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
        if kind == "llamacpp":
            props = c.run(c.request("GET", "/props", root=root))
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
            self.server_info["scheduling"] = "pinned slots" if self._pin_slots else "rounds of unpinned tasks, one position per item (host-RAM prompt cache)"
        elif kind == "vllm":
            try:
                self.server_info["version"] = c.run(c.request("GET", "/version", root=root)).get("version")
            except LogitdiffError:
                pass
            self._vllm_tokenizer = self._vllm_has_tokenizer()
            self.server_info["server_tokenizer"] = self._vllm_tokenizer
            if not self._vllm_tokenizer and not tokenizer:
                raise LogitdiffError(
                    f"{self.spec}: the vLLM server runs with --skip-tokenizer-init (no /tokenize); "
                    "pass tokenizer=PATH, a local copy of the served model's tokenizer"
                )
        elif kind == "sglang":
            for path in ("/get_model_info", "/model_info"):
                try:
                    info = c.run(c.request("GET", path, root=root, retry=False))
                    self.server_info["model_info"] = info
                    self.model = self.model or info.get("model_path")
                    break
                except LogitdiffError:
                    continue
        if tokenizer:
            from transformers import AutoTokenizer

            p = Path(tokenizer).expanduser()
            try:
                self.tok = AutoTokenizer.from_pretrained(str(p))
            except Exception as e:  # noqa: BLE001
                raise LogitdiffError(f"{self.spec}: tokenizer={tokenizer}: cannot load ({type(e).__name__}: {_one_line(e, 120)})") from None
            n_tok = len(self.tok)
            self.tokenizer_hash = tokenizer_hash_of(self.tok.convert_ids_to_tokens(list(range(n_tok))))
            self._tok_vocab = n_tok
        else:
            self.tokenizer_hash = None
            self._tok_vocab = None
        v = vocab_size or self._tok_vocab or server_vocab
        if v is None and kind == "vllm" and self.server_info.get("root") and Path(str(self.server_info["root"])).is_dir():
            # the server runs on this machine: read its tokenizer to learn V
            try:
                from transformers import AutoTokenizer

                v = len(AutoTokenizer.from_pretrained(str(self.server_info["root"])))
            except Exception:  # noqa: BLE001
                v = None
        if v is None:
            raise LogitdiffError(f"{self.spec}: the {kind} server does not say its vocabulary size; pass vocab_size=N or tokenizer=PATH")
        if server_vocab and vocab_size and server_vocab != vocab_size:
            raise LogitdiffError(f"{self.spec}: vocab_size={vocab_size} but the server reports n_vocab={server_vocab}")
        self.vocab_size = int(v)
        if self.top_k > self.vocab_size:
            raise LogitdiffError(f"{self.spec}: top_k={self.top_k} exceeds the vocabulary size {self.vocab_size}")
        eos = []
        if self.tok is not None and self.tok.eos_token_id is not None:
            eos.append(int(self.tok.eos_token_id))
        self.eos_token_ids = tuple(eos)
        if self.tok is not None:
            self._check_tokenizer_agrees()
        self._preflight()

    def _preflight(self) -> None:
        """Score one tiny pair before anything is written: a server that caps logprobs below K,
        returns fewer than K, unsorted or processed (post-sampling) logprobs is refused here."""
        try:
            self.score_many([([0, 1], [2])])
        except LogitdiffError as e:
            msg = str(e)
            raise LogitdiffError(msg if msg.startswith(self.spec) else f"{self.spec}: {msg}") from None

    def _vllm_has_tokenizer(self) -> bool:
        """False when vLLM runs with ``--skip-tokenizer-init`` (its /tokenize answers 400)."""
        c = self._client
        try:
            c.run(c.request("POST", "/tokenize", {"model": self.model, "prompt": "a", "add_special_tokens": False}, retry=False))
            return True
        except ServerError as e:
            if e.status == 400 and "tokenizer" in str(e).lower():
                return False
            raise LogitdiffError(f"{self.spec}: vLLM /tokenize failed ({_one_line(e, 200)})") from None

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
        """A token whose text is one complete ASCII character (llama-server, see _score_llamacpp)."""
        c = self._client
        for text in ("a", "e", "0", " ", "x", "."):
            r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False}))
            toks = r.get("tokens") or []
            if len(toks) == 1:
                t = toks[0]
                return int(t["id"]) if isinstance(t, dict) else int(t)
        return None

    def _check_tokenizer_agrees(self) -> None:
        probe = "The quick brown fox: 12 + 30 = 42.\n"
        local = [int(i) for i in self.tok(probe, add_special_tokens=False)["input_ids"]]
        remote = self._tokenize_text(probe)
        if remote is not None and remote != local:
            raise LogitdiffError(f"{self.spec}: the server tokenizes differently from tokenizer={self.tok.name_or_path} (probe text)")

    # ---- tokenization -----------------------------------------------------------------
    def _tokenize_text(self, text: str) -> list[int] | None:
        c = self._client
        if self.kind == "vllm" and not self._vllm_tokenizer:
            return None  # --skip-tokenizer-init: nothing to check against
        if self.kind == "vllm":
            body = {"model": self.model, "prompt": text, "add_special_tokens": False}
            return [int(i) for i in c.run(c.request("POST", "/tokenize", body))["tokens"]]
        if self.kind == "llamacpp":
            r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": True}))
            return [int(t["id"]) if isinstance(t, dict) else int(t) for t in r["tokens"]]
        return None  # SGLang: no stable tokenize endpoint

    def render(self, item: Any) -> list[int]:
        where = f"item {getattr(item, 'id', '?')!r}"
        c = self._client
        try:
            if self.kind == "vllm" and not self._vllm_tokenizer:
                ids = self._local_render(item)
            elif self.kind == "vllm":
                if item.messages is not None:
                    body = {"model": self.model, "messages": item.messages, "add_generation_prompt": True,
                            "add_special_tokens": False}
                    if item.tools:
                        body["tools"] = item.tools
                    ids = c.run(c.request("POST", "/tokenize", body))["tokens"]
                else:
                    ids = self._tokenize_text(item.prompt)
            elif self.kind == "llamacpp":
                if item.messages is not None:
                    body = {"messages": item.messages}
                    if item.tools:
                        body["tools"] = item.tools
                    text = c.run(c.request("POST", "/apply-template", body))["prompt"]
                else:
                    text = item.prompt
                ids = self._tokenize_text(text)
            else:
                if self.tok is None:
                    raise LogitdiffError(f"{where}: an SGLang source needs tokenizer=PATH (a local copy of the served tokenizer) to render prompts")
                ids = self._local_render(item)
        except ServerError as e:
            raise LogitdiffError(f"{where}: the server could not tokenize it ({e})") from None
        ids = [int(i) for i in ids]
        if not ids:
            raise LogitdiffError(f"{where}: prompt renders to zero tokens on {self.spec}")
        return ids

    def _local_render(self, item) -> list[int]:
        if item.messages is not None:
            text = self.tok.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True, tokenize=False)
            if not isinstance(text, str):
                text = text["text"] if isinstance(text, dict) else "".join(text)
        else:
            text = item.prompt
        return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        c = self._client
        if self.kind == "vllm":
            return c.run(c.request("POST", "/detokenize", {"model": self.model, "tokens": ids}))["prompt"]
        if self.kind == "llamacpp":
            return c.run(c.request("POST", "/detokenize", {"tokens": ids}))["content"]
        return "".join(f"<{i}>" for i in ids)

    def token_text(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._token_texts is None:
            self._token_texts = self._vocab_texts()
        if 0 <= token_id < len(self._token_texts):
            return self._token_texts[token_id]
        return f"<{token_id}>"

    def _vocab_texts(self) -> list[str]:
        """Texts of all V token ids, fetched once: from the local tokenizer when one is given
        (each id decoded on its own, as HFSource.token_text does), else from the server in a
        few large /detokenize requests (:meth:`_server_texts`), never one request per id;
        SGLang without a tokenizer: ``<id>``."""
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
        if self.kind == "sglang":
            return [f"<{i}>" for i in range(self.vocab_size)]
        try:
            return self._server_texts()
        except ServerError:
            return [f"<{i}>" for i in range(self.vocab_size)]

    async def _detokenize_ids(self, ids: list[int]) -> str:
        c = self._client
        if self.kind == "vllm":
            return (await c.request("POST", "/detokenize", {"model": self.model, "tokens": ids})).get("prompt", "")
        return (await c.request("POST", "/detokenize", {"tokens": ids})).get("content", "")

    def _separator(self) -> tuple[list[int], str] | None:
        """Token ids of a separator and the text they read as between two tokens, checked on
        the server: ``a SEP a`` must come back as exactly two ``a`` around one SEP.

        Both servers detokenize a list by concatenating the tokens' texts (llama-server:
        ``tokens_to_str``; vLLM: the tokenizer's ``decode``), so ``t0 SEP t1 SEP ...`` splits
        back into the tokens' own texts. The separator text is border-free (no proper prefix
        is also a suffix), so a false split can only come from a token whose own text
        contains it, which adds parts; the count check catches that (:meth:`_server_texts`)."""
        c = self._client
        for text in SEPARATORS:
            if self.kind == "vllm":
                body = {"model": self.model, "prompt": text, "add_special_tokens": False}
                ids = c.run(c.request("POST", "/tokenize", body))["tokens"]
            else:
                r = c.run(c.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False}))
                ids = r.get("tokens") or []
            ids = [int(t["id"]) if isinstance(t, dict) else int(t) for t in ids]
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
        c = self._client
        found = self._separator()
        V = self.vocab_size

        async def texts(ids: list[int]) -> list[str]:
            if len(ids) == 1:
                return [await self._detokenize_ids(ids)]
            sep_ids, sep = found
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

        if found is None:
            # no separator survives this server's detokenization: placeholders, never V requests
            return [f"<{i}>" for i in range(V)]
        chunks = [list(range(s, min(s + DETOKENIZE_CHUNK, V))) for s in range(0, V, DETOKENIZE_CHUNK)]

        async def every():
            return await asyncio.gather(*(texts(ch) for ch in chunks))

        return [t for part in c.run(every()) for t in part]

    # ---- model ---------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise LogitdiffError(f"{self.spec}: generate needs a non-empty prompt")
        if max_tokens <= 0:
            return Generation([], "max_tokens")
        c = self._client
        stopped = "max_tokens"
        try:
            if self.kind == "vllm":
                body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
                        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                        "frequency_penalty": 0.0, "return_token_ids": True, "skip_special_tokens": False}
                if not self._vllm_tokenizer and self.eos_token_ids:
                    # without its tokenizer vLLM knows EOS only from generation_config.json
                    body["stop_token_ids"] = list(self.eos_token_ids)
                r = c.run(c.request("POST", "/v1/completions", body))
                ch = r["choices"][0]
                ids = ch.get("token_ids")
                if ids is None:
                    raise LogitdiffError(f"{self.spec}: vLLM did not return token_ids (needs vLLM >= 0.10.2 for return_token_ids)")
                if ch.get("finish_reason") == "stop":
                    stopped = "eos"
            elif self.kind == "llamacpp":
                body = {"prompt": prompt, "n_predict": int(max_tokens), "temperature": 0.0, "return_tokens": True,
                        "cache_prompt": True, "repeat_penalty": 1.0, "dry_multiplier": 0.0, "stream": False}
                r = c.run(c.request("POST", "/completion", body))
                ids = r.get("tokens") or []
                if r.get("stop_type") == "eos":
                    stopped = "eos"
            else:
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": int(max_tokens), "temperature": 0.0}}
                r = c.run(c.request("POST", "/generate", body))
                ids = list(r.get("output_ids") or [])
                fr = (r.get("meta_info") or {}).get("finish_reason") or {}
                if isinstance(fr, dict) and fr.get("type") == "stop":
                    stopped = "eos"
                    m = fr.get("matched")
                    if isinstance(m, int) and (not ids or ids[-1] != m):
                        ids.append(m)
        except ServerError as e:
            raise LogitdiffError(f"{self.spec}: generation failed ({e})") from None
        ids = [int(i) for i in ids][:max_tokens]
        return Generation(ids, stopped)

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> dict:
        return self.score_many([(prompt_ids, teacher_ids)])[0]

    def score_many(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[dict]:
        """Teacher-forced top-K per position: ``[{"ids": [T, K] int64, "logprobs": [T, K] float64}]``."""
        pairs = []
        for n, (p, t) in enumerate(batch):
            p, t = [int(i) for i in p], [int(i) for i in t]
            if not p:
                raise LogitdiffError(f"{self.spec}: scoring pair {n} has an empty prompt")
            pairs.append((p, t))
        if self.kind == "vllm":
            coro = self._score_vllm(pairs)
        elif self.kind == "llamacpp":
            coro = self._score_llamacpp(pairs)
        else:
            coro = self._score_sglang(pairs)
        return self._client.run(coro)

    def _empty(self) -> dict:
        return {"ids": np.zeros((0, self.top_k), np.int64), "logprobs": np.zeros((0, self.top_k), np.float64)}

    @staticmethod
    def _stack(rows) -> dict:
        return {"ids": np.stack([r[0] for r in rows]), "logprobs": np.stack([r[1] for r in rows])}

    # vLLM: prompt logprobs, several sequences per request
    async def _score_vllm(self, pairs):
        c, K = self._client, self.top_k
        results: list[dict | None] = [None] * len(pairs)
        todo = [n for n, (p, t) in enumerate(pairs) if t]
        for n, (p, t) in enumerate(pairs):
            if not t:
                results[n] = self._empty()

        async def group(idx):
            body = {"model": self.model, "prompt": [pairs[n][0] + pairs[n][1] for n in idx], "max_tokens": 1,
                    "prompt_logprobs": K, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    **self._extra_score_body}
            try:
                r = await c.request("POST", "/v1/completions", body)
            except ServerError as e:
                raise self._vllm_error(e) from None
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
                    pairs_j = [(int(tid), (v or {}).get("logprob") if isinstance(v, dict) else v) for tid, v in entry.items()]
                    rows.append(topk_row(pairs_j, K, where, ordered=False, forced=t[j]))
                results[n] = self._stack(rows)

        groups = [todo[i : i + self.batch] for i in range(0, len(todo), self.batch)]
        await asyncio.gather(*(group(g) for g in groups))
        return results

    def _vllm_error(self, e: ServerError) -> LogitdiffError:
        msg = str(e)
        if "logprob" in msg.lower() and ("max" in msg.lower() or "allowed" in msg.lower()):
            m = re.search(r"(?:max(?:imum)?[^0-9]{0,40}?|allowed[^0-9]{0,20}?)(\d+)", msg, re.I)
            cap = m.group(1) if m else "?"
            return LogitdiffError(
                f"{self.spec}: the server caps logprobs at {cap} < top_k={self.top_k}; restart vLLM with "
                f"--max-logprobs {self.top_k} (or use top_k<={cap})"
            )
        if e.status == 404:
            return LogitdiffError(f"{self.spec}: model {self.model!r} not found on the server ({_one_line(msg, 160)})")
        return LogitdiffError(f"{self.spec}: scoring request refused ({_one_line(msg, 240)})")

    # llama-server: one task per position; an item's positions in order on one slot
    async def _score_llamacpp(self, pairs):
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

        async def tasks(root, slot, prompts, labels, where, started):
            """One request, one task per prompt (its row labelled ``labels[n]``), all on ``slot``
            (-1: any); streamed, so ``started`` is set as soon as the server has queued all its tasks."""
            body = {"prompt": prompts, "n_predict": 1, "n_probs": K, "temperature": 0.0,
                    "post_sampling_probs": False, "cache_prompt": self.cache_prompt, "return_tokens": False,
                    "stream": True, "id_slot": slot, "response_fields": list(LLAMACPP_FIELDS), **self._extra_score_body}
            if self._force_tok is not None:
                # llama-server drops the probabilities of a sampled token whose text is an
                # incomplete UTF-8 sequence (a byte token); the sampled token is not what we
                # read, so a logit bias (a sampler: the raw n_probs are computed from the
                # model's logits before any sampler) makes it a plain ASCII one.
                body["logit_bias"] = [[self._force_tok, 1e6]]
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
                    raise LogitdiffError(f"{where}: scoring request failed on the server ({_one_line(_err_text(e), 240)})")
                i = int(e.get("index", 0))
                if e.get("completion_probabilities"):
                    probs[i] = e
                if e.get("stop"):
                    tm = e.get("timings") or {}
                    self.server_stats["tasks"] += 1
                    self.server_stats["prompt_tokens_evaluated"] += int(tm.get("prompt_n") or 0)
                    self.server_stats["prompt_tokens_cached"] += int(tm.get("cache_n") or 0)
            if sorted(probs) != list(range(len(prompts))):
                raise LogitdiffError(f"{where}: llama-server answered {len(probs)} of {len(prompts)} positions with completion_probabilities")
            return [row(probs[n], label) for n, label in enumerate(labels)]

        async def positions(root, slot, p, t, js, started):
            """Positions js of one item (prompt = p + t[:j]) in one request on ``slot``."""
            return await tasks(root, slot, [p + t[:j] for j in js], [f"{self.spec}: output position {j}" for j in js],
                               f"{self.spec}: output positions {js[0]}..{js[-1]}", started)

        async def rounds(root, todo):
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
                    sent.append((asyncio.ensure_future(
                        tasks(root, -1, prompts, labels, f"{self.spec}: output positions of {len(batch)} items", started)), batch))
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
            return {n: self._stack(r) for n, r in rows.items()}

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
        # _idle_slots_kept) the items go in rounds of unpinned tasks (``rounds``), which
        # llama-server restores from the slot or the host-RAM cache: one new token each.
        if not self._pin_slots:
            # items go round-robin to the replicas, each replica's items in rounds
            done: dict[int, dict] = {}
            parts = [list(range(i, len(pairs), len(self.roots))) for i in range(len(self.roots))]
            for d in await asyncio.gather(*(rounds(self.roots[i], part) for i, part in enumerate(parts) if part)):
                done.update(d)
            return [done[n] if n in done else self._empty() for n in range(len(pairs))]
        slots: dict[str, asyncio.Queue] = {}
        for r in self.roots:
            q: asyncio.Queue = asyncio.Queue()
            for k in range(self._n_slots):
                q.put_nowait(k)
            slots[r] = q

        async def item(n):
            p, t = pairs[n]
            if not t:
                return self._empty()
            per = max(1, min(LLAMACPP_TASKS_PER_REQUEST, LLAMACPP_TOKENS_PER_REQUEST // (len(p) + len(t))))
            root = c.next_root()
            slot = await slots[root].get()
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
            return self._stack(rows)

        return list(await asyncio.gather(*(item(n) for n in range(len(pairs)))))

    # SGLang: input top logprobs, one sequence per request
    async def _score_sglang(self, pairs):
        c, K = self._client, self.top_k

        async def one(n):
            p, t = pairs[n]
            if not t:
                return self._empty()
            start = len(p) - 1
            body = {"input_ids": p + t, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": K,
                    "return_text_in_logprobs": False,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
                    **self._extra_score_body}
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
                rows.append(topk_row([(e[1], e[0]) for e in entry], K, where, ordered=True))
            return self._stack(rows)

        return list(await asyncio.gather(*(one(n) for n in range(len(pairs)))))

    # ---- identity -------------------------------------------------------------------------
    def identity(self) -> dict:
        return json_safe({
            "kind": "openai",
            "spec": self.spec,
            "server": self.kind,
            "endpoints": self.roots,
            "model": self.model,
            "top_k": self.top_k,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": self.tokenizer_hash,
            "tokenizer": getattr(self.tok, "name_or_path", None),
            "logprobs": "raw (log_softmax of the model's logits over the full vocabulary)",
            **{k: v for k, v in self.server_info.items() if k != "kind"},
        })

    def close(self) -> None:
        c = getattr(self, "_client", None)
        if c is not None:
            c.close()
            self._client = None


async def detect_kind(http, root: str, spec: str) -> str:
    """llama-server answers ``/props``; SGLang ``/get_model_info``; vLLM ``/version`` + ``/v1/models``."""
    st, body = await _probe(http, root + "/props")
    if st == PROBE_UNREACHABLE:
        raise LogitdiffError(f"{spec}: server unreachable at {root} (connection failed)")
    if st == PROBE_SILENT:
        raise LogitdiffError(f"{spec}: {root} accepted the connection but sent no response within {body:g} s")
    if st == 200 and isinstance(body, dict) and ("default_generation_settings" in body or "build_info" in body):
        return "llamacpp"
    st, body = await _probe(http, root + "/get_model_info")
    if st == 200 and isinstance(body, dict) and "model_path" in body:
        return "sglang"
    st, body = await _probe(http, root + "/server_info")
    if st == 200 and isinstance(body, dict) and ("model_path" in body or "tokenizer_path" in body):
        return "sglang"
    st_v, body_v = await _probe(http, root + "/version")
    st_m, body_m = await _probe(http, root + "/v1/models")
    if st_v == 200 and isinstance(body_v, dict) and "version" in body_v and st_m == 200:
        return "vllm"
    raise LogitdiffError(
        f"{spec}: cannot tell which server runs at {root} (no llama-server /props, SGLang /get_model_info or vLLM /version); "
        "pass kind=llamacpp|vllm|sglang"
    )
