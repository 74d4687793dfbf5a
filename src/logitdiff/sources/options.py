"""The options of each source kind, declared once: name, type, default, help.

A spec's ``,key=value`` options are checked and converted by one function,
:func:`parse_options`, against its kind's declaration in :data:`OPTIONS`; ``capture --help``
(:func:`spec_help`) and the source-options table of docs/sources.md (``scripts/docs_tables.py``,
:func:`markdown_table`) are generated from the same declarations. Every error is one line
naming the spec and the option.

A leaf module: it imports no backend, so the CLI can describe the sources without loading
torch or llama.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import LogitdiffError
from .base import Spec


class OptionType:
    """What an option's value must be (and how the error says so)."""

    POSITIVE_INT = "positive integer"
    INT = "integer"
    POSITIVE_NUMBER = "positive number"
    BOOL = "true or false"
    CHOICE = "one of"
    TEXT = "text"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_ABSURD = 1e12  # a positive count or duration at or above this is a typo, not a setting


@dataclass(frozen=True)
class Option:
    name: str
    type: str  # an OptionType
    default: Any  # None: not set (the backend decides, see help)
    help: str
    choices: tuple[str, ...] = ()

    def usage(self) -> str:
        """``name=VALUE`` as the synopsis shows it."""
        if self.type == OptionType.CHOICE:
            return f"{self.name}={'|'.join(self.choices)}"
        if self.type == OptionType.BOOL:
            return f"{self.name}=true|false"
        metavar = {OptionType.POSITIVE_INT: "N", OptionType.INT: "N", OptionType.POSITIVE_NUMBER: "S"}.get(self.type, "TEXT")
        return f"{self.name}={metavar}"

    def convert(self, raw: str, text: str) -> Any:
        """``raw`` as this option's type; a one-line LogitdiffError naming the spec and option."""
        t = self.type
        if t == OptionType.TEXT:
            return raw or None
        if t == OptionType.CHOICE:
            if raw not in self.choices:
                raise LogitdiffError(f"source spec {text!r}: {self.name}={raw!r} (expected {_either(self.choices)})")
            return raw
        if t == OptionType.BOOL:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise LogitdiffError(f"source spec {text!r}: option {self.name}={raw!r} must be true or false")
        try:
            v = float(raw) if t == OptionType.POSITIVE_NUMBER else int(raw)
        except (ValueError, OverflowError):
            v = None
        positive = t != OptionType.INT
        if v is None or not math.isfinite(v) or (positive and not 0 < v < _ABSURD):
            raise LogitdiffError(f"source spec {text!r}: option {self.name}={raw!r} must be a {t}")
        return v


def _either(choices) -> str:
    choices = list(choices)
    return choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]


_T = OptionType
OPTIONS: dict[str, tuple[Option, ...]] = {
    "hf": (
        Option("dtype", _T.CHOICE, None, "weights and compute dtype (default: the model's own; a GGUF loads in bfloat16)",
               ("bfloat16", "float16", "float32")),
        Option("device", _T.CHOICE, "cpu", "where the model runs", ("cpu", "cuda")),
        Option("threads", _T.POSITIVE_INT, None, "torch CPU threads, applied by the command that runs the source "
               "(default: torch's)"),
        Option("batch", _T.POSITIVE_INT, 8, "sequences per forward pass in generation (left padding) and scoring (right padding)"),
        Option("prefill", _T.POSITIVE_INT, 2048, "outputs longer than this many tokens are prefilled in windows over a KV cache"),
        Option("gguf_file", _T.TEXT, None, "the GGUF file in PATH to load dequantized (hf:DIR,gguf_file=NAME.gguf)"),
    ),
    "gguf": (
        Option("n_ctx", _T.POSITIVE_INT, None, "llama.cpp context length (default: 4096, at most the model's training "
               "context)"),
        Option("threads", _T.POSITIVE_INT, None, "llama.cpp threads of this context (default: the CPU count)"),
        Option("seed", _T.INT, 0, "llama.cpp seed"),
        Option("n_batch", _T.POSITIVE_INT, 512, "llama.cpp batch size (tokens per decode call)"),
        Option("repack", _T.BOOL, False, "llama.cpp's weight repacking (extra buffer types: interleaved Q4_0/Q8_0 layouts, "
               "faster on AVX2; llama-perplexity's and llama-server's default). Off by default: its AMX path crashed native "
               "builds; rows differ from the plain layout by float summation order"),
    ),
    "served": (
        Option("model", _T.TEXT, None, "the model name the server knows (default: the one it serves)"),
        Option("kind", _T.CHOICE, "auto", "which server speaks at URL (auto: probed)", ("auto", "llamacpp", "vllm", "sglang")),
        Option("top_k", _T.POSITIVE_INT, 64, "K log-probabilities per position"),
        Option("concurrency", _T.POSITIVE_INT, 8, "requests in flight at once, over all endpoints"),
        Option("timeout", _T.POSITIVE_NUMBER, 300.0, "seconds per request"),
        Option("retries", _T.POSITIVE_INT, 4, "attempts per request on timeouts, connection errors and 5xx, with backoff"),
        Option("batch", _T.POSITIVE_INT, 4, "sequences per vLLM request (llama-server: up to 32 positions of one item, "
               "SGLang: one sequence)"),
        Option("endpoints", _T.TEXT, None, "more replicas of the same model, |-separated URLs, used round-robin"),
        Option("vocab_size", _T.POSITIVE_INT, None, "V of the distribution (default: from the server or tokenizer)"),
        Option("tokenizer", _T.TEXT, None, "a local HF tokenizer directory: tokenizer hash, V and token texts; the server's "
               "tokenization is checked against it"),
        Option("cache_prompt", _T.BOOL, True, "llama-server's prompt cache"),
        Option("speculative", _T.BOOL, False, "the server decodes speculatively (recorded: a teacher-forced comparison says "
               "speculation was not exercised)"),
        Option("batching", _T.CHOICE, "rounds", "rounds: several items in flight, a server batch mixes them (fast); serial: "
               "one item at a time (deterministic scoring)", ("rounds", "serial")),
        Option("overlap", _T.CHOICE, "auto", "run with a served reference, this candidate (the first served one): score it on "
               "each reference block while the reference generates the next (on), or after (off); auto: on only when the two "
               "servers are on different hosts (on one host the two compete for the same cores)", ("auto", "on", "off")),
    ),
}
# Other spellings of a kind: ``openai:`` is the old name of ``served:`` (the servers mostly
# speak their own protocols, not the OpenAI API) and works identically.
ALIASES = {"openai": "served"}
TARGETS = {"hf": "PATH", "gguf": "PATH", "served": "http://HOST:PORT[/v1]"}


def canonical_kind(kind: str) -> str:
    """``kind`` with an alias resolved (``openai`` -> ``served``)."""
    return ALIASES.get(kind, kind)


def is_served(spec_text: str | None) -> bool:
    """Whether a spec names a served source (``served:`` or its alias ``openai:``)."""
    kind = str(spec_text or "").split(":", 1)[0].strip()
    return bool(spec_text) and ":" in str(spec_text) and canonical_kind(kind) == "served"


def parse_options(spec: Spec, kind: str | None = None) -> dict[str, Any]:
    """Every declared option of the spec's kind, converted (given ones) or its default; a
    one-line LogitdiffError for an unknown option or a value of the wrong type."""
    kind = canonical_kind(kind or spec.kind)
    declared = {o.name: o for o in OPTIONS[kind]}
    text = spec.text or f"{spec.kind}:{spec.target}"
    unknown = sorted(set(spec.options) - set(declared))
    if unknown:
        raise LogitdiffError(f"source spec {text!r}: unknown option {unknown[0]!r} ({spec.kind}: takes {', '.join(declared)})")
    return {name: (o.convert(spec.options[name], text) if name in spec.options else o.default) for name, o in declared.items()}


def synopsis(kind: str) -> str:
    """``served:http://HOST:PORT[/v1][,model=TEXT][,kind=auto|llamacpp|vllm|sglang]...``"""
    return f"{kind}:{TARGETS[kind]}" + "".join(f"[,{o.usage()}]" for o in OPTIONS[kind])


def spec_help() -> str:
    """The SPEC paragraph of ``capture --help``: each kind's synopsis."""
    kinds = " | ".join(synopsis(k) for k in OPTIONS)
    return (f"SPEC: {kinds} | builtin:tiny | builtin:tiny-Q4_K_M ...  (openai: is another name for served:.) "
            "hf: PATH is a model directory, or a GGUF file loaded dequantized (hf:FILE.gguf, hf:DIR,gguf_file=NAME.gguf). ")


def markdown_table() -> str:
    """The source-options table of docs/sources.md."""
    lines = ["| kind | option | value | default | what it sets |", "|---|---|---|---|---|"]
    for kind, opts in OPTIONS.items():
        for o in opts:
            value = _either(o.choices) if o.type == OptionType.CHOICE else o.type
            default = "—" if o.default is None else (str(o.default).lower() if isinstance(o.default, bool) else str(o.default))
            lines.append(f"| `{kind}:` | `{o.name}` | {value} | {default} | {o.help.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
