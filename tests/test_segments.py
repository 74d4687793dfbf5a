"""segments.py: token bytes from vocabulary strings, and reasoning / tool-call / answer labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from logitdiff.numerics.segments import SEGMENTS, item_segments, segment_labels, segment_masks, token_pieces, vocab_scheme
from logitdiff.numerics.summarize import by_groups

TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "src/logitdiff/builtin/tiny/tokenizer.json"

# A hand-written byte-level (GPT-2 style) vocabulary: 'Ġ' = space, 'Ċ' = newline; 'Ã' and '©'
# are the two bytes of 'é' (C3 A9); 'ä' '¸' 'Ń' the three bytes of '中' (E4 B8 AD).
BL = [
    "<|im_end|>", "<tool_call>", "</tool_call>",   # 0-2 added tokens, verbatim
    "Ġcaf", "Ã", "©", "Ċ", "ĊĊ", "Sure", ".",      # 3-9
    "<", "think", ">", "</", "Ġthe", "Ġplan",       # 10-15
    "ä", "¸", "Ń", "<｜end▁of▁sentence｜>",         # 16-19: 中 in three tokens; DeepSeek-style special
    "Ġ", "ĠĠ",                                      # 20-21
]


def lab(*parts: str | bytes) -> list[str]:
    return segment_labels([p.encode() if isinstance(p, str) else p for p in parts])


# --------------------------------------------------------------------------------------------
# vocabulary schemes and token bytes


def test_vocab_scheme_by_most_common_word_start_marker():
    assert vocab_scheme(BL) == "bytelevel"
    assert vocab_scheme(["<s>", "▁the", "▁a", "Ġx", "<0x0A>"]) == "sentencepiece"
    # Decoded text (a RUN's vocab.json) with a few raw byte-level fall-backs: still text.
    assert vocab_scheme([" the", " a", " cat", "Ġä", "Ã", "é"]) == "text"
    assert vocab_scheme(["a", "b"]) == "text"
    assert vocab_scheme([]) == "text"


def test_bytelevel_pieces_multibyte_split_and_added_tokens():
    ids = [3, 4, 5, 6, 16, 17, 18, 7, 0, 19, 21]
    pieces = token_pieces(BL, ids)
    assert pieces == [
        b" caf", b"\xc3", b"\xa9", b"\n", b"\xe4", b"\xb8", b"\xad", b"\n\n",
        b"<|im_end|>", "<｜end▁of▁sentence｜>".encode("utf-8"), b"  ",
    ]
    assert b"".join(pieces).decode("utf-8") == " café\n中\n\n<|im_end|><｜end▁of▁sentence｜>  "


def test_sentencepiece_pieces():
    sp = ["<s>", "</s>", "▁Sure", "▁caf", "<0xC3>", "<0xA9>", "<0x0A>", "▁", "<think>", "é", "▁the"]
    assert vocab_scheme(sp) == "sentencepiece"
    pieces = token_pieces(sp, [8, 2, 3, 4, 5, 6, 7, 9, 1])
    assert pieces == [b"<think>", b" Sure", b" caf", b"\xc3", b"\xa9", b"\n", b" ", "é".encode(), b"</s>"]
    assert b"".join(pieces).decode() == "<think> Sure café\n é</s>"


def test_text_scheme_reads_fallbacks_back_to_bytes():
    # What a RUN's vocab.json holds: each token decoded on its own; fragments as raw byte-level
    # strings (HF), <0xHH> (HF SentencePiece) or \xhh escapes (llama.cpp backslashreplace).
    v = [" the", " caf", "é", "Ã", "©", "ä¸", "Ń",
         "<0xE4>", "\\xe4\\xb8", "\\xad", "中", "Ġä", "<think>", "Ã©"]
    assert vocab_scheme(v) == "text"
    # 'é' decoded (a whole character) vs 'Ã' '©' (the two raw fragments of the same character).
    assert token_pieces(v, [1, 2]) == [b" caf", b"\xc3\xa9"]
    assert token_pieces(v, [1, 3, 4]) == [b" caf", b"\xc3", b"\xa9"]
    # A whole 'é' next to raw fragments of '中': each read the way that gives valid UTF-8.
    assert token_pieces(v, [2, 5, 6]) == [b"\xc3\xa9", b"\xe4\xb8", b"\xad"]
    assert token_pieces(v, [2, 2]) == [b"\xc3\xa9", b"\xc3\xa9"]
    # An unambiguous <0xE4> does not join the run after it.
    assert token_pieces(v, [7, 5, 6]) == [b"\xe4", b"\xe4\xb8", b"\xad"]
    assert token_pieces(v, [8, 9, 10]) == [b"\xe4\xb8", b"\xad", "中".encode()]
    # 'Ġä' (raw " \xe4") followed by ' the' cannot be completed: read as the text it is.
    assert token_pieces(v, [11, 0]) == ["Ġä".encode(), b" the"]
    # 'Ã©' read raw would be a complete 'é'; a fall-back is stored only where the bytes do not
    # decode, so a string whose raw reading is valid UTF-8 on its own is text.
    assert token_pieces(v, [13]) == ["Ã©".encode()]
    # Two raw fragments that together make valid UTF-8 are read raw (the first reading tried).
    assert token_pieces(v, [3, 4]) == [b"\xc3", b"\xa9"]
    assert token_pieces(v, [12, 0]) == [b"<think>", b" the"]


def test_text_scheme_fragment_runs():
    v = ["Ġä", "¸Ń", " x", "é", "\\x41"]
    assert token_pieces(v, [0, 1]) == [b" \xe4", b"\xb8\xad"]
    # Alone, 'Ġä' cannot be completed: read as the text it is.
    assert token_pieces(v, [0, 2]) == ["Ġä".encode(), b" x"]
    # Only \x80-\xff escapes are llama.cpp's; '\x41' is literal text.
    assert token_pieces(v, [4]) == [b"\\x41"]


def test_token_pieces_errors():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_pieces(BL, [len(BL)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_pieces(BL, [-1])
    with pytest.raises(ValueError, match="unknown vocabulary scheme"):
        token_pieces(BL, [0], scheme="wordpiece")
    # An explicit scheme overrides detection.
    assert token_pieces(BL, [3], scheme="text") == ["Ġcaf".encode()]


# --------------------------------------------------------------------------------------------
# labels


def test_plain_answer_only():
    assert lab("Sure", ".", " The", " answer", " is", " 4", "<|im_end|>") == ["answer"] * 7
    assert segment_labels([]) == []


def test_think_split_over_tokens_then_answer_whitespace_is_answer():
    got = lab("<", "think", ">", "plan", "</", "think", ">", "\n\n", "Sure", ".")
    assert got == ["think"] * 7 + ["answer"] * 3


def test_tool_call_after_reasoning():
    got = lab("<think>", "x", "</think>", "\n", "<tool_call>", '{"name": "f", ', '"arguments": {}}',
              "</tool_call>", "<|im_end|>")
    assert got == ["think"] * 3 + ["answer"] + ["tool_call"] * 4 + ["answer"]


def test_answer_and_several_hermes_calls():
    got = lab("Ok", "<tool_call>", "{}", "</tool_call>", "\n", "<tool_call>", "{}", "</tool_call>", " done")
    assert got == ["answer", "tool_call", "tool_call", "tool_call", "answer", "tool_call", "tool_call",
                   "tool_call", "answer"]


def test_unclosed_think_and_unclosed_tool_call_run_to_the_end():
    assert lab("Hi", " ", "<think>", "a", "b", "<|im_end|>") == ["answer", "answer"] + ["think"] * 4
    assert lab("<tool_call>", '{"name": "f"', "<|im_end|>") == ["tool_call"] * 3


def test_leading_close_think_only():
    # Qwen3 / DeepSeek-R1: the <think> is in the prompt, the reply starts inside reasoning.
    got = lab("Let", " me", " think", ".", "</think>", "\n\n", "42", "<|im_end|>")
    assert got == ["think"] * 5 + ["answer"] * 3
    # A later <think> block after it is reasoning again.
    assert lab("a", "</think>", "b", "<think>", "c", "</think>", "d") == \
        ["think", "think", "answer", "think", "think", "think", "answer"]


def test_tool_call_tag_inside_reasoning_is_reasoning():
    got = lab("<think>", "use ", "<tool_call>", " here", "</think>", "ok", "</tool_call>")
    assert got == ["think"] * 5 + ["answer", "answer"]  # a stray </tool_call> is plain text


def test_mistral_marker_runs_to_the_end():
    got = lab("Let", " me", " check", ".", "[TOOL_CALLS]", '[{"name": "f", "arguments": {}}]', "</s>")
    assert got == ["answer"] * 4 + ["tool_call"] * 3
    assert lab("[TOOL_CALLS]", "get_weather", "[ARGS]", "{}") == ["tool_call"] * 4


def test_python_tag_runs_to_the_end():
    got = lab("Calling", ".", "<|python_tag|>", '{"name": "f", "parameters": {}}', "<|eom_id|>")
    assert got == ["answer", "answer", "tool_call", "tool_call", "tool_call"]
    assert lab("<|python_tag|>", "print(1)") == ["tool_call", "tool_call"]


def test_llama3_json_reply_is_a_call():
    assert lab("\n", '{"name": "f", ', '"parameters": {"x": 1}}', "<|eot_id|>") == ["tool_call"] * 4
    assert lab("[", '{"name"', ": ", '"f"}]') == ["tool_call"] * 4
    # After reasoning, the reply (not the reasoning) is what is tested.
    assert lab("<think>", "hm", "</think>", " ", '{"name": "f", "arguments": {}}') == \
        ["think"] * 3 + ["tool_call"] * 2
    # JSON without a name key, and prose before the brace, are answers.
    assert lab('{"answer": ', "42}") == ["answer", "answer"]
    assert lab("Here", ': {"name": "f"}') == ["answer", "answer"]


def test_straddling_token_goes_with_most_of_its_bytes():
    # '</think>' plus one newline: 8 think bytes, 1 answer byte -> think.
    assert lab("<think>", "a", "</think>\n", "b") == ["think", "think", "think", "answer"]
    # '>' plus nine newlines: 1 think byte, 9 answer bytes -> answer.
    assert lab("<think>", "a", "</think", ">\n\n\n\n\n\n\n\n\n", "b") == ["think"] * 3 + ["answer", "answer"]
    # 'a<th' is 1 answer byte, 3 think bytes -> think.
    assert lab("a<th", "ink>", "x") == ["think", "think", "think"]
    # '.<' is a tie (1 and 1) -> the label its bytes reach first: answer.
    assert lab("ok", ".<", "think>", "x") == ["answer", "answer", "think", "think"]
    # Three labels in one token: 9 think, 1 answer, 11 tool_call bytes -> tool_call.
    assert lab("<think>", "y</think>z<tool_call>", "{}", "</tool_call>") == \
        ["think", "tool_call", "tool_call", "tool_call"]


def test_empty_tokens_take_the_label_of_their_offset():
    assert lab("<think>", "", "a", "</think>", "b", "") == ["think", "think", "think", "think", "answer", "answer"]
    assert lab("", "") == ["answer", "answer"]


def test_custom_think_tags():
    got = lab("<reasoning>", "x", "</reasoning>", "y", "<think>")
    assert segment_labels([p.encode() for p in ("<reasoning>", "x", "</reasoning>", "y", "<think>")],
                          think_tags=("<reasoning>", "</reasoning>")) == ["think"] * 3 + ["answer"] * 2
    assert got == ["answer"] * 4 + ["think"]
    with pytest.raises(ValueError, match="non-empty"):
        segment_labels([b"x"], think_tags=("", "</think>"))


def test_item_segments_on_bytelevel_vocab():
    # "<think> the plan</think>\nSure. café<tool_call>...": ids into BL.
    ids = [10, 11, 12, 14, 15, 13, 11, 12, 6, 8, 9, 3, 4, 5, 1, 2, 0]
    assert item_segments(BL, ids) == ["think"] * 8 + ["answer"] * 6 + ["tool_call"] * 2 + ["answer"]


# --------------------------------------------------------------------------------------------
# masks for by_groups


def test_segment_masks_and_by_groups():
    labels = ["answer", "think", "think", "answer", "think"]
    masks = segment_masks(labels)
    assert [name for name, _ in masks] == ["think", "answer"]  # SEGMENTS order, tool_call absent
    assert masks[0][1].dtype == bool
    assert masks[0][1].tolist() == [False, True, True, False, True]
    assert masks[1][1].tolist() == [True, False, False, True, False]
    metrics = {"kl_nats": np.array([0.5, 0.1, 0.2, 0.7, 0.3]),
               "top1_match": np.array([False, True, True, True, True])}
    rows = by_groups(metrics, np.array([0, 0, 0, 1, 1]), masks, n_boot=0)
    assert [r["group"] for r in rows] == ["think", "answer"]
    assert rows[0]["n"] == 3 and rows[0]["kl_nats"]["mean"] == pytest.approx(0.2)
    assert rows[1]["n"] == 2 and rows[1]["kl_nats"]["mean"] == pytest.approx(0.6)
    assert rows[1]["top1_disagreement"]["mismatches"] == 1
    assert segment_masks([]) == []
    assert tuple(SEGMENTS) == ("think", "tool_call", "answer")
    with pytest.raises(ValueError, match="not segment labels"):
        segment_masks(["answer", "markup"])


# --------------------------------------------------------------------------------------------
# the real bundled tokenizer


@pytest.fixture(scope="module")
def tiny():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(TINY_TOKENIZER))
    by_id = {i: s for s, i in tok.get_vocab(with_added_tokens=True).items()}
    vocab = [by_id[i] for i in range(len(by_id))]
    return tok, vocab


def test_tiny_tokenizer_labels(tiny):
    tok, vocab = tiny
    text = '<think>plan it</think>Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    enc = tok.encode(text, add_special_tokens=False)
    assert vocab_scheme(vocab) == "bytelevel"
    pieces = token_pieces(vocab, enc.ids)
    assert b"".join(pieces) == text.encode()
    # Each token's bytes are exactly the text at the tokenizer's own offsets (ASCII text here).
    assert [p.decode() for p in pieces] == [text[a:b] for a, b in enc.offsets]
    labels = item_segments(vocab, enc.ids)
    by_text = [(p.decode(), lab_) for p, lab_ in zip(pieces, labels)]
    n_think = len(tok.encode("<think>plan it</think>", add_special_tokens=False).ids)
    assert [t for t, _ in by_text[:n_think]] and "".join(t for t, _ in by_text[:n_think]) == "<think>plan it</think>"
    assert labels[:n_think] == ["think"] * n_think
    start_call = enc.tokens.index("<tool_call>")
    assert "".join(t for t, _ in by_text[n_think:start_call]) == "Sure. "
    assert labels[n_think:start_call] == ["answer"] * (start_call - n_think)
    assert labels[start_call:] == ["tool_call"] * (len(labels) - start_call)
    assert enc.tokens[-1] == "</tool_call>"


def test_tiny_tokenizer_round_trips_non_ascii(tiny):
    tok, vocab = tiny
    text = "Café 中文 — naïve\n\n\tx  y 🙂<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = token_pieces(vocab, ids)
    assert b"".join(pieces) == text.encode("utf-8")
    # Some characters are split over tokens, so pieces alone are not all valid UTF-8.
    assert any(_invalid(p) for p in pieces)


def test_tiny_tokenizer_decoded_vocab_like_a_run(tiny):
    # vocab.json of a RUN holds each token decoded on its own, with the raw token string where
    # that decoding is not valid UTF-8 (HFSource.token_text); reading it back gives the bytes.
    tok, vocab = tiny
    decoded = []
    for i, raw in enumerate(vocab):
        s = tok.decode([i], skip_special_tokens=False)
        decoded.append(raw if "\ufffd" in s else s)
    assert vocab_scheme(decoded) == "text"
    text = "<think>Café 中文?</think>\n\nnaïve 🙂 é<tool_call>{\"name\": \"f\"}</tool_call><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = token_pieces(decoded, ids)
    assert b"".join(pieces) == text.encode("utf-8")
    assert pieces == token_pieces(vocab, ids)
    labels = item_segments(decoded, ids, scheme="text")
    assert labels == item_segments(vocab, ids)
    joined = {k: b"".join(p for p, lab_ in zip(pieces, labels) if lab_ == k).decode() for k in SEGMENTS}
    assert joined == {"think": "<think>Café 中文?</think>", "tool_call": '<tool_call>{"name": "f"}</tool_call>',
                      "answer": "\n\nnaïve 🙂 é<|im_end|>"}


def _invalid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
