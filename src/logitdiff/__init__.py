"""logitdiff: how far a candidate LLM drifts from its reference, token by token."""

__version__ = "0.1.0"
