"""Served models: an OpenAI-compatible inference server as a source of top-K logprobs.

Spec::

    openai:http://HOST:PORT[/v1][,model=NAME][,kind=auto|llamacpp|vllm|sglang][,top_k=K]
          [,concurrency=N][,timeout=S][,retries=N][,batch=N][,endpoints=URL2|URL3]
          [,vocab_size=N][,tokenizer=PATH][,cache_prompt=true|false][,speculative=1]
          [,batching=rounds|serial]

* ``kind``        which server speaks at URL (default ``auto``: probed, see
                  :func:`.client.detect_kind`).
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
* ``cache_prompt`` llama-server only (default true), see :mod:`.llamacpp`.
* ``speculative`` the server decodes speculatively (default false): recorded in the identity,
                  so a teacher-forced comparison of it says "speculation not exercised"
                  (generation mode, ``logitdiff speculate``, measures speculation).
* ``batching``    ``rounds`` (default): several items in flight, a server batch mixes their
                  tasks (fast; a row depends on its batch mates, so two captures differ by
                  the served floor); ``serial``: one item at a time, one task per server
                  batch (deterministic scoring, slower). Recorded in the RUN's source
                  identity; ``compare`` notes two sides captured in different modes.

Layout: :mod:`.client` (HTTP: pool, retries, replicas, server detection), :mod:`.base`
(what every server kind shares, and the validation of one position's top-K), then one
module per server kind with its protocol: :mod:`.llamacpp`, :mod:`.vllm`, :mod:`.sglang`.

Every request sends **token ids**, never text, so the server scores exactly the teacher
sequence. Refused (a one-line :class:`LogitdiffError`, never a report): fewer than K finite
entries, an unsorted list, probabilities summing above 1 + 1e-4, a positive
log-probability, a missing forced token (vLLM), post-sampling probabilities (llama-server
``top_probs``).
"""

from __future__ import annotations

from ...errors import LogitdiffError
from ..base import Spec
from .base import BATCHING, DETOKENIZE_CHUNK, MALFORMED, ROUNDS, SEPARATORS, SERIAL, ServedSource, bool_option, malformed, topk_row
from .client import HttpClient, ServerError, ServerKind, endpoint_root
from .llamacpp import LLAMACPP_TASKS_PER_REQUEST, LlamaServerSource
from .sglang import SGLangSource
from .vllm import VLLMSource

#: the class that speaks each server kind's protocol
SERVER_CLASSES: dict[ServerKind, type[ServedSource]] = {
    ServerKind.LLAMACPP: LlamaServerSource,
    ServerKind.VLLM: VLLMSource,
    ServerKind.SGLANG: SGLangSource,
}
KNOWN_OPTIONS = {"model", "kind", "top_k", "concurrency", "timeout", "retries", "batch", "endpoints", "vocab_size", "tokenizer",
                 "cache_prompt", "speculative", "batching"}

__all__ = [
    "BATCHING", "DETOKENIZE_CHUNK", "ROUNDS", "SERIAL", "LLAMACPP_TASKS_PER_REQUEST", "SEPARATORS", "SERVER_CLASSES", "LlamaServerSource", "SGLangSource",
    "ServedSource", "ServerError", "ServerKind", "VLLMSource", "open_served", "topk_row",
]


def open_served(spec: Spec) -> ServedSource:
    """The registry's factory for ``openai:`` specs: parse the options, connect, detect the
    server kind (unless ``kind=`` says it) and open that kind's source."""
    text = spec.text or f"{spec.kind}:{spec.target}"
    unknown = set(spec.options) - KNOWN_OPTIONS
    if unknown:
        raise LogitdiffError(
            f"source spec {text!r}: unknown option {sorted(unknown)[0]!r} (openai: takes {', '.join(sorted(KNOWN_OPTIONS))})"
        )
    if not spec.target:
        raise LogitdiffError(f"source spec {text!r}: missing server URL (openai:http://HOST:PORT)")

    def num(key, default, conv=int):
        if key not in spec.options:
            return default
        try:
            v = conv(spec.options[key])
        except (ValueError, OverflowError):
            v = -1
        if not 0 < v < 1e12:  # NaN, inf and absurd values too
            raise LogitdiffError(f"source spec {text!r}: option {key}={spec.options[key]!r} must be a positive number")
        return v

    urls = [spec.target] + [u for u in spec.options.get("endpoints", "").split("|") if u.strip()]
    kw = dict(model=spec.options.get("model") or None, top_k=num("top_k", 64))
    concurrency, timeout, retries = num("concurrency", 8), num("timeout", 300.0, float), num("retries", 4)
    kw.update(batch=num("batch", 4), vocab_size=num("vocab_size", None), tokenizer=spec.options.get("tokenizer") or None,
              cache_prompt=bool_option(spec, "cache_prompt", True), spec=text)
    batching = spec.options.get("batching", ROUNDS)
    if batching not in BATCHING:
        raise LogitdiffError(f"source spec {text!r}: batching={batching!r} (expected {' or '.join(BATCHING)})")
    kw["batching"] = batching
    roots = [endpoint_root(u) for u in urls]
    kind = spec.options.get("kind", "auto")
    if kind != "auto" and kind not in {k.value for k in ServerKind}:
        raise LogitdiffError(f"source spec {text!r}: kind={kind!r} (expected auto, llamacpp, vllm or sglang)")
    speculative = bool_option(spec, "speculative", False)
    client = HttpClient(roots, concurrency=concurrency, timeout=float(timeout), retries=retries, spec=text)
    try:
        server = ServerKind(kind) if kind != "auto" else client.server_kind(roots[0])
        src = SERVER_CLASSES[server](client, **kw)
        if speculative:
            # recorded in the identity: a teacher-forced comparison of it is labelled
            # "speculation not exercised" (compare.speculation_notes); `logitdiff speculate` measures it
            src.server_info["speculative"] = True
        return src
    except MALFORMED as e:
        client.close()
        raise malformed(text, "connecting", e) from None
    except BaseException:
        client.close()
        raise
