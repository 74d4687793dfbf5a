"""Served models: an inference server (llama-server, vLLM, SGLang) as a source of top-K logprobs.

Spec (``openai:`` is another name for ``served:``; the options are declared in
:mod:`logitdiff.sources.options`)::

    served:http://HOST:PORT[/v1][,model=NAME][,kind=auto|llamacpp|vllm|sglang][,top_k=K]...

What each option sets, its type and default: :data:`logitdiff.sources.options.OPTIONS`
(``capture --help`` and the source-options table of docs/sources.md are generated from it). Without
``tokenizer=`` the V token texts (for reports) come from the server's ``/detokenize`` in
``ceil(V / 65,536)`` requests, never one per id. ``batching=rounds`` (default) puts several
items in flight, so a server batch mixes their tasks (fast; a row depends on its batch mates,
so two captures differ by the served floor); ``serial`` scores one item at a time, one task
per server batch (deterministic, slower). Both are recorded in the RUN's source identity, and
``compare`` notes two sides captured in different modes.

Layout: :mod:`.client` (HTTP: pool, retries, replicas, server detection), :mod:`.base`
(what every server kind shares, and the validation of one position's top-K), then one
module per server kind with its protocol: :mod:`.llamacpp`, :mod:`.vllm`, :mod:`.sglang`.
llama-server is spoken to through one client, :mod:`.llamacpp_client` (its requests, every
answer field checked: one line naming the field and the request), by the capture source
(:mod:`.llamacpp`) and by generation mode (:mod:`.generate`, which ``speculate`` uses).

Every request sends **token ids**, never text, so the server scores exactly the teacher
sequence. Refused (a one-line :class:`LogitdiffError`, never a report): fewer than K finite
entries, an unsorted list, probabilities summing above 1 + 1e-4, a positive
log-probability, a missing forced token (vLLM), post-sampling probabilities (llama-server
``top_probs``).
"""

from __future__ import annotations

from ...errors import LogitdiffError
from ..base import Spec
from ..options import OPTIONS, parse_options
from .base import BATCHING, DETOKENIZE_CHUNK, MALFORMED, ROUNDS, SEPARATORS, SERIAL, ServedSource, malformed, topk_row
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
KNOWN_OPTIONS = {o.name for o in OPTIONS["served"]}  # declared in sources/options.py

__all__ = [
    "BATCHING", "DETOKENIZE_CHUNK", "ROUNDS", "SERIAL", "LLAMACPP_TASKS_PER_REQUEST", "SEPARATORS", "SERVER_CLASSES", "LlamaServerSource", "SGLangSource",
    "ServedSource", "ServerError", "ServerKind", "VLLMSource", "open_served", "topk_row",
]


def open_served(spec: Spec) -> ServedSource:
    """The registry's factory for ``served:`` specs (alias ``openai:``): parse the options,
    connect, detect the server kind (unless ``kind=`` says it) and open that kind's source."""
    text = spec.text or f"{spec.kind}:{spec.target}"
    o = parse_options(spec, "served")  # the declared options (sources/options.py), checked
    if not spec.target:
        raise LogitdiffError(f"source spec {text!r}: missing server URL ({spec.kind}:http://HOST:PORT)")
    urls = [spec.target] + [u for u in (o["endpoints"] or "").split("|") if u.strip()]
    kw = dict(model=o["model"], top_k=o["top_k"], batch=o["batch"], vocab_size=o["vocab_size"], tokenizer=o["tokenizer"],
              cache_prompt=o["cache_prompt"], spec=text, batching=o["batching"])
    concurrency, timeout, retries, kind, speculative = o["concurrency"], o["timeout"], o["retries"], o["kind"], o["speculative"]
    roots = [endpoint_root(u) for u in urls]
    client = HttpClient(roots, concurrency=concurrency, timeout=float(timeout), retries=retries, spec=text)
    try:
        server = ServerKind(kind) if kind != "auto" else client.server_kind(roots[0])
        src = SERVER_CLASSES[server](client, **kw)
        if speculative:
            # recorded in the identity: a teacher-forced comparison of it is labelled
            # "speculation not exercised" (compare.speculation_notes); `logitdiff speculate` measures it
            src.server_info["speculative"] = True
        src.overlap = o["overlap"]  # read by `run` only (pipeline._reference_run), not an identity
        return src
    except MALFORMED as e:
        client.close()
        raise malformed(text, "connecting", e) from None
    except BaseException:
        client.close()
        raise
