"""Segments of a model's output: label every output position as reasoning, tool call or answer.

Pure functions, no I/O.  The design asks for summaries per *segment* of the output
(reasoning inside ``<think>…</think>``, tool-call spans, the final answer), found on the
text with token offsets.  The steps:

1. :func:`token_pieces` turns token ids into the raw bytes of each token, from the
   vocabulary strings (an id -> string list);
2. :func:`segment_labels` joins the pieces, keeps each token's ``[start, end)`` byte offsets,
   finds the spans on the joined bytes and gives every token one label;
3. :func:`segment_masks` turns the labels of all rows of a comparison into ``(name, mask)``
   pairs for :func:`logitdiff.numerics.summarize.by_groups` (the same shape as ``range_masks``).

:func:`item_segments` does 1 and 2 for one item's teacher tokens.

Segments
--------
``SEGMENTS = ("think", "tool_call", "answer")``; every token gets exactly one of them.
There is no separate "markup" segment: a tag belongs to the span it opens or closes
(``<think>`` and ``</think>`` are ``think``, ``<tool_call>`` and ``</tool_call>`` are
``tool_call``), because emitting a tag is the model's decision to enter or leave that mode,
and a fourth group of a few tokens per item would only give noisy statistics.

Spans (byte offsets into the joined text; the tags are matched as exact byte strings, so a
tag split over several tokens, ``<`` ``think`` ``>``, is found all the same):

* ``think``: a reply with a ``</think>`` before any ``<think>`` started inside reasoning
  (DeepSeek-R1 and Qwen3 thinking templates end the prompt with ``<think>``): everything up to and
  including that ``</think>``.  Then, scanning on, each ``<think>`` up to and including its
  ``</think>``; an unclosed ``<think>`` runs to the end.
* ``tool_call``: ``<tool_call>`` up to and including ``</tool_call>`` (Hermes; unclosed: to
  the end); ``[TOOL_CALLS]`` to the end (Mistral); ``<|python_tag|>`` to the end (Llama 3).
  And the Llama-3 JSON form: when the *reply* (the text after the last ``think`` span, or
  all of it) is, after whitespace and an optional ``<|python_tag|>``, a JSON object or list
  with a ``"name":`` key somewhere - the same test as :mod:`logitdiff.flips.toolcalls` - the whole
  reply is ``tool_call``.
* ``answer``: the rest, including whitespace between spans (so whitespace after
  ``</think>`` is answer) and end-of-turn tokens after a closed ``</tool_call>``.

Spans are found left to right and whichever opens first owns the text up to its close, so a
``<tool_call>`` quoted inside reasoning is reasoning and a ``<think>`` inside an unclosed tool
call is tool call.  A ``</think>`` or ``</tool_call>`` with no open span (other than the
leading ``</think>`` above) is plain text.

Tokens on a boundary
--------------------
A token whose bytes fall into more than one span gets the label that holds most of its
bytes; on a tie, the one of those labels that its bytes reach first.  E.g. ``".<"`` before
``think>`` is 1 byte answer + 1 byte think: a tie, so answer; ``"a</"`` + ``"think>"`` puts
``"a</"`` (1 answer byte, 2 think bytes) in think.  A token with no bytes takes the label
of the byte at its offset (at the very end: of the last byte; in an empty text: answer).

Vocabulary schemes (:func:`vocab_scheme`)
-----------------------------------------
Token strings come in three kinds and the scheme is decided once per vocabulary: the
word-start marker that begins the most entries decides - ``'Ġ'`` (U+0120) -> ``"bytelevel"``,
``'▁'`` (U+2581) -> ``"sentencepiece"``, a plain space, a tie or none -> ``"text"``.

``bytelevel`` (HF token strings of GPT-2 style byte-level BPE: GPT-2, Llama 3, Qwen, ...)
    Every character stands for one byte through GPT-2's ``bytes_to_unicode`` table (``Ġ`` =
    space, ``Ċ`` = newline, ``Ã`` = 0xC3, ...), built here and inverted.  A string with a
    character outside the table is an added/special token stored verbatim (e.g.
    ``<｜end▁of▁sentence｜>``) and is its UTF-8 bytes.  (ASCII ``<think>``, ``<|im_end|>``
    read the same either way.)
``sentencepiece`` (HF token strings of Llama 2, Mistral, Gemma, ...)
    ``<0xHH>`` is the byte 0xHH (byte fallback); otherwise ``▁`` is a space and the rest is
    UTF-8.
``text`` (decoded text per token - what logitdiff's RUN ``vocab.json`` holds, see
``Source.token_text``: the token decoded on its own, with fall-backs where that is not
valid UTF-8)
    UTF-8 of the string, except for the fall-backs, which are read back to their bytes:
    ``<0xHH>`` (HF SentencePiece fragment) is 0xHH; ``\\xhh`` with hh in 80..ff (llama.cpp
    bytes decoded with ``backslashreplace``; only bytes >= 0x80 can be invalid UTF-8) is that
    byte; and a HF byte-level fragment is stored as its raw token string (``'Ã'`` for the
    lone byte 0xC3).  Such a string - only table characters, at least one of them not
    ASCII, and raw bytes that are not valid UTF-8 on their own (else decoding would not have
    failed) - can also be decoded text (``'é'`` is a whole character and the raw string of byte
    0xE9), so consecutive such tokens are read together: the readings (raw bytes or UTF-8
    text, per token) that make their bytes valid UTF-8, preferring raw bytes from the first
    token on; if none does, all as text.  Limits: decoding a token on its own can drop a
    SentencePiece word-start space, so byte offsets in such a vocabulary are those of the
    stored strings, not of the real text (the tags, and so the labels, are unaffected).
"""

from __future__ import annotations

import codecs
import re
from typing import Sequence

import numpy as np

SEGMENTS = ("think", "tool_call", "answer")
SCHEMES = ("bytelevel", "sentencepiece", "text")

_HERMES_OPEN, _HERMES_CLOSE = b"<tool_call>", b"</tool_call>"
_TO_END = (b"[TOOL_CALLS]", b"<|python_tag|>")  # Mistral, Llama 3: the call runs to the end
_PYTHON_TAG = b"<|python_tag|>"
_NAME_KEY = re.compile(rb'"name"\s*:')  # the same test as toolcalls._parse_llama3
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ESCAPED_BYTE = re.compile(r"\\x([89a-f][0-9a-f])")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 maps to itself, the other 68 bytes
    (controls, space, 0x7F-0xA0, 0xAD) to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _table_bytes(s: str) -> bytes | None:
    """``s`` read through the byte table, or None when a character is not in it."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in s)
    except KeyError:
        return None


def vocab_scheme(vocab: Sequence[str]) -> str:
    """``"bytelevel"``, ``"sentencepiece"`` or ``"text"``: the scheme of the token strings.

    The word-start marker that begins the most entries wins: ``'Ġ'`` -> bytelevel, ``'▁'`` ->
    sentencepiece, a plain space (or a tie, or no marker at all) -> text.  Decoded
    vocabularies start words with spaces, raw ones with their marker, so the plurality tells
    them apart even where a few raw fall-back strings (``'Ġä'``) sit in a decoded vocabulary.
    """
    n_g = n_sp = n_space = 0
    for s in vocab:
        if s:
            c = s[0]
            n_g += c == "Ġ"
            n_sp += c == "▁"
            n_space += c == " "
    if n_g > max(n_sp, n_space):
        return "bytelevel"
    if n_sp > max(n_g, n_space):
        return "sentencepiece"
    return "text"


def _utf8_tail(data: bytes) -> bytes | None:
    """The incomplete UTF-8 sequence at the end of ``data``, or None if ``data`` cannot start
    valid UTF-8 (b"" when it is complete)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        dec.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return dec.getstate()[0]


def _read_run(options: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Pick raw or text bytes for each token of a run of ambiguous ``text``-scheme strings.

    A small dynamic programme over the pending incomplete UTF-8 tail: each state keeps the
    first choice sequence (raw before text, earliest token first) that reaches it.
    """
    states: dict[bytes, list[bytes]] = {b"": []}
    for raw, text in options:
        nxt: dict[bytes, list[bytes]] = {}
        for pending, chosen in states.items():
            for piece in (raw, text):
                tail = _utf8_tail(pending + piece)
                if tail is not None and tail not in nxt:
                    nxt[tail] = chosen + [piece]
        states = nxt
    done = states.get(b"")
    return done if done is not None else [text for _, text in options]


def _text_piece(s: str) -> tuple[bytes, bytes | None]:
    """Bytes of a ``text``-scheme string, plus its raw byte-level reading when ambiguous."""
    m = _BYTE_TOKEN.fullmatch(s)
    if m:
        return bytes([int(m.group(1), 16)]), None
    if "\\x" in s and _ESCAPED_BYTE.search(s):
        parts = _ESCAPED_BYTE.split(s)  # text, hex, text, hex, ..., text
        return b"".join(bytes([int(p, 16)]) if k % 2 else p.encode("utf-8") for k, p in enumerate(parts)), None
    text = s.encode("utf-8")
    if s.isascii():
        return text, None
    raw = _table_bytes(s)
    # Only a string whose raw reading is not valid UTF-8 on its own can be a fall-back.
    if raw is None or _utf8_tail(raw) == b"":
        return text, None
    return text, raw


def token_pieces(vocab: Sequence[str], ids: Sequence[int], *, scheme: str | None = None) -> list[bytes]:
    """The raw bytes of each token ``ids[i]``, read from the vocabulary strings ``vocab[id]``.

    ``scheme`` is one of :data:`SCHEMES`; None detects it with :func:`vocab_scheme` (a pass
    over the vocabulary - pass it explicitly when calling for many items).  See the module
    docstring for how each scheme is read.  Raises ValueError for an id outside the
    vocabulary or an unknown scheme.
    """
    if scheme is None:
        scheme = vocab_scheme(vocab)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown vocabulary scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    strings = []
    for i in ids:
        i = int(i)
        if not 0 <= i < len(vocab):
            raise ValueError(f"token id {i} is outside the vocabulary (0..{len(vocab) - 1})")
        strings.append(vocab[i])
    if scheme == "bytelevel":
        return [b if (b := _table_bytes(s)) is not None else s.encode("utf-8") for s in strings]
    if scheme == "sentencepiece":
        pieces: list[bytes] = []
        for s in strings:
            m = _BYTE_TOKEN.fullmatch(s)
            pieces.append(bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode("utf-8"))
        return pieces
    # text: ambiguous strings are decided together with their ambiguous neighbours.
    out: list[bytes] = []
    run: list[tuple[bytes, bytes]] = []
    for s in strings:
        text, raw = _text_piece(s)
        if raw is not None:
            run.append((raw, text))
            continue
        if run:
            out += _read_run(run)
            run = []
        out.append(text)
    if run:
        out += _read_run(run)
    return out


def _spans(text: bytes, think_open: bytes, think_close: bytes) -> bytearray:
    """Label code (index into SEGMENTS) of every byte of ``text``."""
    THINK, TOOL, ANSWER = 0, 1, 2
    codes = bytearray([ANSWER]) * len(text)

    def paint(a: int, b: int, code: int) -> None:
        codes[a:b] = bytes([code]) * (b - a)

    pos = reply = 0
    first_close, first_open = text.find(think_close), text.find(think_open)
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        # The reply began inside reasoning: the <think> was part of the prompt.
        pos = reply = first_close + len(think_close)
        paint(0, pos, THINK)
    while pos < len(text):
        found = [(text.find(m, pos), m) for m in (think_open, _HERMES_OPEN, *_TO_END)]
        found = [(at, m) for at, m in found if at >= 0]
        if not found:
            break
        at, marker = min(found, key=lambda f: f[0])
        if marker == think_open:
            close = text.find(think_close, at + len(think_open))
            end = len(text) if close < 0 else close + len(think_close)
            paint(at, end, THINK)
            reply = end
        elif marker == _HERMES_OPEN:
            close = text.find(_HERMES_CLOSE, at + len(_HERMES_OPEN))
            end = len(text) if close < 0 else close + len(_HERMES_CLOSE)
            paint(at, end, TOOL)
        else:
            end = len(text)
            paint(at, end, TOOL)
        pos = end
    # Llama-3 JSON: the whole reply is the call.
    body = text[reply:].lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if body[:1] in (b"{", b"[") and _NAME_KEY.search(body):
        paint(reply, len(text), TOOL)
    return codes


def segment_labels(pieces: Sequence[bytes], *, think_tags: tuple[str, str] = ("<think>", "</think>")) -> list[str]:
    """One of :data:`SEGMENTS` for each token, from the tokens' bytes (:func:`token_pieces`).

    The pieces are joined, the spans found on the joined bytes and each token labelled by
    the span holding most of its bytes (ties: the label its bytes reach first; a token with
    no bytes: the label of the byte at its offset).  ``think_tags`` are the opening and
    closing reasoning tags (non-empty).  The rules are in the module docstring.
    """
    think_open, think_close = (t.encode("utf-8") for t in think_tags)
    if not think_open or not think_close:
        raise ValueError(f"think_tags must be two non-empty strings, got {think_tags!r}")
    text = b"".join(pieces)
    codes = _spans(text, think_open, think_close)
    labels = []
    start = 0
    for piece in pieces:
        end = start + len(piece)
        part = codes[start:end]
        if not part:
            at = min(start, len(codes) - 1)
            labels.append(SEGMENTS[codes[at]] if at >= 0 else "answer")
        elif part.count(part[0]) == len(part):
            labels.append(SEGMENTS[part[0]])
        else:
            # max() keeps the first maximum, so order the candidates by first appearance.
            present = sorted(set(part), key=part.index)
            labels.append(SEGMENTS[max(present, key=part.count)])
        start = end
    return labels


def item_segments(
    vocab: Sequence[str],
    teacher_ids: Sequence[int],
    *,
    scheme: str | None = None,
    think_tags: tuple[str, str] = ("<think>", "</think>"),
) -> list[str]:
    """The segment label of every teacher position of one item:
    ``segment_labels(token_pieces(vocab, teacher_ids, scheme=scheme), think_tags=think_tags)``."""
    return segment_labels(token_pieces(vocab, teacher_ids, scheme=scheme), think_tags=think_tags)


def segment_masks(labels_per_row: Sequence[str] | np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``(name, boolean mask over the rows)`` for each segment that occurs, in
    :data:`SEGMENTS` order - the shape :func:`logitdiff.numerics.summarize.by_groups` takes (like
    ``range_masks``).  Raises ValueError for a label that is not a segment."""
    labels = np.asarray(list(labels_per_row), dtype=object)
    unknown = set(labels.tolist()) - set(SEGMENTS)
    if unknown:
        raise ValueError(f"not segment labels: {sorted(map(str, unknown))} (known: {', '.join(SEGMENTS)})")
    masks = [(name, labels == name) for name in SEGMENTS]
    return [(name, np.asarray(mask, dtype=bool)) for name, mask in masks if mask.any()]
