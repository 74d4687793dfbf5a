"""The one llama-server client: every request logitdiff sends to a llama-server, and every
field of its answers it reads, checked here.

Used by the capture source (:class:`~logitdiff.sources.served.llamacpp.LlamaServerSource`)
and by generation mode (:mod:`.generate`, which speculation uses); both speak HTTP through
:class:`~logitdiff.sources.served.client.HttpClient` (pool, retries, replicas).

A field of the wrong type, or missing where it is required, is one
:class:`~logitdiff.errors.LogitdiffError` line naming the field and the request
(``candidate server http://…: item q1 generation (POST /completion): field
'timings.draft_n' is a string ('3'), expected an integer``), never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...errors import LogitdiffError
from .client import HttpClient, ServerError, one_line

# what a field must be: a name for the message and the check
_KINDS: dict[str, tuple[str, Any]] = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "object": ("an object", lambda v: isinstance(v, dict)),
}
MISSING = object()


def _described(v: Any) -> str:
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return f"{names.get(type(v), type(v).__name__)} ({one_line(repr(v), 40)})"


def malformed_field(where: str, name: str, value: Any, kind: str) -> LogitdiffError:
    """The one-line error of an answer's field ``name`` (``""``: the whole answer) that is
    not ``kind``."""
    if not name:
        return LogitdiffError(f"{where}: llama-server's answer is {_described(value)}, expected {_KINDS[kind][0]}")
    if value is MISSING:
        return LogitdiffError(f"{where}: llama-server's answer has no field {name!r} ({_KINDS[kind][0]} expected)")
    return LogitdiffError(f"{where}: llama-server's answer field {name!r} is {_described(value)}, expected {_KINDS[kind][0]}")


def checked(value: Any, kind: str, where: str, name: str, *, optional: bool = False) -> Any:
    """``value`` when it is ``kind`` (``optional``: None and MISSING pass as None), else the
    one-line error naming the field."""
    if optional and (value is None or value is MISSING):
        return None
    if value is MISSING or not _KINDS[kind][1](value):
        raise malformed_field(where, name, value, kind)
    return value


def field(obj: Any, key: str, kind: str, where: str, name: str = "", *, optional: bool = False) -> Any:
    """``obj[key]`` checked to be ``kind`` (``optional``: absent or null gives None); ``name``
    is the field's path in the answer for the message (default ``key``)."""
    name = name or key
    if not isinstance(obj, dict):
        parent = f"answer field {name.rsplit('.', 1)[0]!r}" if "." in name else "answer"
        raise LogitdiffError(f"{where}: llama-server's {parent} is {_described(obj)}, expected an object")
    return checked(obj.get(key, MISSING), kind, where, name, optional=optional)


def token_id(t: Any, where: str, name: str) -> int:
    """A token of a /tokenize answer: an id, or ``{"id": id, "piece": ...}`` (with_pieces)."""
    if isinstance(t, dict):
        return int(field(t, "id", "int", where, f"{name}.id"))
    return int(checked(t, "int", where, name))


def top_logprobs(entry: Any, where: str, name: str) -> list[tuple[int, float]]:
    """The ``(id, logprob)`` pairs of one ``completion_probabilities`` entry's
    ``top_logprobs``, each field checked; post-sampling probabilities are refused."""
    if isinstance(entry, dict) and ("top_probs" in entry or ("prob" in entry and "logprob" not in entry)):
        raise LogitdiffError(f"{where}: llama-server returned post-sampling probabilities (top_probs); raw logprobs are required")
    if isinstance(entry, dict) and "top_logprobs" not in entry:
        raise LogitdiffError(f"{where}: llama-server's answer has no {name + '.top_logprobs'!r} "
                             "(server too old: needs token ids and logprobs)")
    top = field(entry, "top_logprobs", "list", where, f"{name}.top_logprobs")
    return [(int(field(d, "id", "int", where, f"{name}.top_logprobs[{n}].id")),
             float(field(d, "logprob", "number", where, f"{name}.top_logprobs[{n}].logprob"))) for n, d in enumerate(top)]


@dataclass(frozen=True)
class Props:
    """What ``GET /props`` says that logitdiff reads."""

    build_info: str | None
    model_path: str | None
    n_ctx: int | None
    total_slots: int | None
    post_sampling_probs: bool
    chat_template: bool
    samplers: list | None


class LlamaServerClient:
    """The requests logitdiff sends to one llama-server (``root``; None: the HTTP client's
    next replica), each answer's fields checked. ``where`` starts every message."""

    def __init__(self, http: HttpClient, where: str, root: str | None = None):
        self.http, self.where, self.root = http, where, root

    # ---- requests --------------------------------------------------------------------------
    def _named(self, e: LogitdiffError, what: str, path: str) -> LogitdiffError:
        """``e`` with the request named (a ServerError stays one: callers tell a refusal
        from a lost server by it)."""
        msg = str(e)
        if msg.startswith(self.where):
            return e
        msg = f"{self.where}: {what} ({path}): {msg}"
        return ServerError(msg, e.status, e.body) if isinstance(e, ServerError) else LogitdiffError(msg)

    def call(self, method: str, path: str, body: Any = None, what: str = "") -> Any:
        """One JSON request (the HTTP client's retries); an error answer (ServerError) or a
        lost server is one line naming the request."""
        try:
            return self.http.run(self.http.request(method, path, body, root=self.root))
        except LogitdiffError as e:
            raise self._named(e, what or path, f"{method} {path}") from None

    async def acall(self, method: str, path: str, body: Any = None, what: str = "", **kw) -> Any:
        """:meth:`call` on the client's event loop (``kw``: :meth:`HttpClient.request`'s)."""
        try:
            return await self.http.request(method, path, body, **({"root": self.root} | kw))
        except LogitdiffError as e:
            raise self._named(e, what or path, f"{method} {path}") from None

    def at(self, what: str, path: str = "/completion", method: str = "POST") -> str:
        """The message prefix of a request: ``where: what (METHOD path)``."""
        return f"{self.where}: {what} ({method} {path})"

    # ---- the server ------------------------------------------------------------------------
    def props(self) -> Props:
        """``GET /props``: refuses an answer that is not llama-server's."""
        p = self.call("GET", "/props", what="server properties")
        w = self.at("server properties", "/props", "GET")
        if not isinstance(p, dict) or not ("default_generation_settings" in p or "build_info" in p):
            raise LogitdiffError(f"{self.where}: not a llama-server (no /props with default_generation_settings)")
        gen = field(p, "default_generation_settings", "object", w, optional=True) or {}
        params = field(gen, "params", "object", w, "default_generation_settings.params", optional=True) or {}
        return Props(
            build_info=field(p, "build_info", "str", w, optional=True),
            model_path=field(p, "model_path", "str", w, optional=True),
            n_ctx=field(gen, "n_ctx", "int", w, "default_generation_settings.n_ctx", optional=True),
            total_slots=field(p, "total_slots", "int", w, optional=True),
            post_sampling_probs=bool(field(params, "post_sampling_probs", "bool", w,
                                           "default_generation_settings.params.post_sampling_probs", optional=True)),
            chat_template=bool(field(p, "chat_template", "str", w, optional=True)),
            samplers=field(params, "samplers", "list", w, "default_generation_settings.params.samplers", optional=True),
        )

    def slots(self) -> list[dict] | None:
        """``GET /slots`` (None where the server hides it: ``--no-slots``)."""
        try:
            s = self.call("GET", "/slots", what="slots")
        except LogitdiffError:
            return None
        w = self.at("slots", "/slots", "GET")
        s = checked(s, "list", w, "")
        for n, one in enumerate(s):
            checked(one, "object", w, f"[{n}]")
        return s

    def n_vocab(self) -> int | None:
        """The model's vocabulary size from ``GET /v1/models`` (llama-server's meta.n_vocab);
        None when the server does not say."""
        try:
            models = self.call("GET", "/v1/models", what="models")
        except LogitdiffError:
            return None
        w = self.at("models", "/v1/models", "GET")
        data = field(models, "data", "list", w, optional=True) or [{}]
        meta = field(data[0], "meta", "object", w, "data[0].meta", optional=True) or {}
        n = field(meta, "n_vocab", "int", w, "data[0].meta.n_vocab", optional=True)
        return n if n is not None and n > 0 else None

    # ---- text --------------------------------------------------------------------------------
    def tokenize(self, text: str, *, parse_special: bool = True) -> list[int]:
        """``POST /tokenize`` without special tokens added; ``parse_special``: special-token
        text becomes those tokens (a rendered template), else literal text."""
        r = self.call("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": parse_special}, "tokenize")
        w = self.at("tokenize", "/tokenize")
        return [token_id(t, w, f"tokens[{n}]") for n, t in enumerate(field(r, "tokens", "list", w))]

    def apply_template(self, messages: list, tools: list | None) -> str:
        """``POST /apply-template``: the model's chat template applied to ``messages``."""
        body: dict = {"messages": messages}
        if tools:
            body["tools"] = tools
        r = self.call("POST", "/apply-template", body, "apply-template")
        return field(r, "prompt", "str", self.at("apply-template", "/apply-template"))

    def detokenize(self, ids: Sequence[int]) -> str:
        r = self.call("POST", "/detokenize", {"tokens": [int(i) for i in ids]}, "detokenize")
        return field(r, "content", "str", self.at("detokenize", "/detokenize"))

    async def adetokenize(self, ids: Sequence[int]) -> str:
        r = await self.acall("POST", "/detokenize", {"tokens": [int(i) for i in ids]}, "detokenize")
        return field(r, "content", "str", self.at("detokenize", "/detokenize"))

    def ascii_token(self) -> int | None:
        """A token whose text is one ASCII character (None when the model has none): a
        scoring request's sampled token is biased to it, because llama-server drops the
        probabilities of a sampled token whose text is an incomplete UTF-8 sequence (the raw
        n_probs are computed before any sampler, so the bias changes nothing we read)."""
        for text in ("a", "e", "0", " ", "x", "."):
            toks = self.tokenize(text, parse_special=False)
            if len(toks) == 1:
                return toks[0]
        return None
