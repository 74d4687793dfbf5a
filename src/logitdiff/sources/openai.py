"""Old home of the served source, kept so ``logitdiff.sources.openai`` imports keep working:
the code lives in :mod:`logitdiff.sources.served` (one module per server kind)."""

from .served import (  # noqa: F401
    DETOKENIZE_CHUNK,
    LLAMACPP_TASKS_PER_REQUEST,
    SEPARATORS,
    ServedSource,
    ServerError,
    ServerKind,
    open_served,
    topk_row,
)

#: the served source's base class under its old name
OpenAISource = ServedSource
