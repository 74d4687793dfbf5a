"""Are two tokenizers the same? Decided by what matters: the token ids.

Every run records ``tokenizer_hash`` (the sha256 of its token strings in id order) and the
strings themselves (``tokens.json``; runs of older versions lack it). Equal hashes settle it. Different hashes are not
yet a difference: converters spell some tokens differently from the tokenizer they convert
(llama.cpp's converter writes user-defined tokens with literal spaces where a SentencePiece
``tokenizer.json`` writes U+2581; byte tokens ``<0xNN>`` in either case; ``[PADn]`` placeholders
for ids a tokenizer leaves empty). So the two token lists are compared under those spellings
(:func:`canonical`): equal lists are accepted with a note, and the per-item token-id checks
that follow (the prompts' and the teacher's ids, item by item) decide; a list that still differs
is refused, naming the first differing id and both spellings. Without a token list on one side
(a run from an older version) different hashes are refused as before.
"""

from __future__ import annotations

import re
from typing import Sequence

from ..errors import LogitdiffError

_BYTE_RE = re.compile(r"^<0[xX]([0-9a-fA-F]{2})>$")
_PLACEHOLDER_RE = re.compile(r"^\[PAD\d+\]$")
SPACE_MARK = "\u2581"  # SentencePiece's visible space


def canonical(token: str | None) -> str:
    """One token string with the converters' spelling choices undone: U+2581 as a space,
    a byte token as ``<0xNN>`` upper-case, an empty id (None, '' or a ``[PADn]`` placeholder)
    as ''."""
    if token is None or _PLACEHOLDER_RE.match(token):
        return ""
    m = _BYTE_RE.match(token)
    if m:
        return f"<0x{m.group(1).upper()}>"
    return token.replace(SPACE_MARK, " ")


def _trimmed(tokens: Sequence[str | None]) -> list[str]:
    """Canonical strings without trailing empty ids (a converter pads the vocabulary to the
    embedding size; ``len(tokenizer)`` does not count the padding)."""
    out = [canonical(t) for t in tokens]
    while out and out[-1] == "":
        out.pop()
    return out


def _show(t: str | None) -> str:
    return "None" if t is None else repr(t)


def check(a_where: str, a_hash: str | None, a_tokens: Sequence[str | None] | None,
          b_where: str, b_hash: str | None, b_tokens: Sequence[str | None] | None) -> str | None:
    """None when the hashes agree (or one is unknown: the caller notes it); a note when the
    token lists agree under the converters' spellings; otherwise a one-line error naming the
    first differing token id and both spellings."""
    if not (a_hash and b_hash) or a_hash == b_hash:
        return None
    if a_tokens is None or b_tokens is None:
        raise LogitdiffError(
            f"tokenizers differ: {a_where} field 'tokenizer_hash' {a_hash[:19]}... vs {b_where} {b_hash[:19]}... "
            "(no token list on one side to compare under converter spellings)"
        )
    ca, cb = _trimmed(a_tokens), _trimmed(b_tokens)
    for i in range(max(len(ca), len(cb))):
        x = ca[i] if i < len(ca) else None
        y = cb[i] if i < len(cb) else None
        if x != y:
            raw_a = a_tokens[i] if i < len(a_tokens) else None
            raw_b = b_tokens[i] if i < len(b_tokens) else None
            raise LogitdiffError(
                f"tokenizers differ at token id {i}: {_show(raw_a)} in {a_where} vs {_show(raw_b)} in {b_where} "
                "(not a converter's spelling)"
            )
    n = sum(1 for x, y in zip(a_tokens, b_tokens) if x != y) + abs(len(a_tokens) - len(b_tokens))
    i = next((i for i, (x, y) in enumerate(zip(a_tokens, b_tokens)) if x != y), min(len(a_tokens), len(b_tokens)))
    ex = (f"; first at id {i}: {_show(a_tokens[i] if i < len(a_tokens) else None)} vs "
          f"{_show(b_tokens[i] if i < len(b_tokens) else None)}")
    return (f"tokenizers spelled differently in {n} token(s) (converter spellings: U+2581/space, byte tokens, "
            f"placeholders{ex}); identity rests on equal token ids per item")
