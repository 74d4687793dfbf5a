"""Tokenizer identity by what matters.

llama.cpp's converter writes a tokenizer's user-defined tokens with literal spaces where the
transformers tokenizer spells them with U+2581 ("pre-normalize user-defined spaces"), so the
vocabulary hashes differ while tokenization can be identical. The classes checked:

* converter spellings only (U+2581/space, byte tokens' case, placeholders): accepted with a
  note, and the per-item token-id check decides — it passes where the ids agree and refuses
  (naming the item and position) where they do not;
* any other difference in the token strings: refused, naming the first differing id and
  both spellings;
* a run without a token list (older versions): different hashes refused as before.

The end-to-end cases use real engines: a transformers model whose tokenizer has a
user-defined "▁▁▁▁" token, and its GGUF written the way llama.cpp's converter writes it
(literal spaces), run by llama.cpp.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from logitdiff.sources import gguf_export
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.sources.base import tokenizer_hash_of
from logitdiff.store import RunReader
from logitdiff.store.tokenizer_identity import canonical, check
from logitdiff.workload import read_workload

USER_TOKEN = "\u2581\u2581\u2581\u2581"  # a run of four SentencePiece spaces, as Gemma's vocabularies hold


# ---------------------------------------------------------------------------------------
# the rule on token lists
# ---------------------------------------------------------------------------------------

BASE = ["<unk>", "<0x0A>", "\u2581the", "hello", "<start_of_turn>", USER_TOKEN, "[PAD6]"]


def _h(tokens):
    return tokenizer_hash_of([t if t is not None else "" for t in tokens])


@pytest.mark.parametrize("spelled", [
    [t.replace("\u2581", " ") if t == USER_TOKEN else t for t in BASE],  # converter: user-defined spaces
    [t.replace("\u2581", " ") for t in BASE],                              # every U+2581
    ["<unk>", "<0x0a>", "\u2581the", "hello", "<start_of_turn>", USER_TOKEN, "[PAD6]"],  # byte token's case
    BASE[:-1],                                                                # no trailing placeholder
    BASE[:-1] + [None],                                                       # an empty id at the end
])
def test_converter_spellings_are_accepted_with_a_note(spelled):
    note = check("a", _h(BASE), BASE, "b", _h(spelled), spelled)
    assert note is not None and "identity rests on equal token ids per item" in note


def test_equal_hashes_need_no_token_lists():
    assert check("a", _h(BASE), None, "b", _h(BASE), None) is None
    assert check("a", None, None, "b", _h(BASE), BASE) is None  # unknown on one side: the caller notes it


@pytest.mark.parametrize("j, other", [
    (3, "hullo"),            # a different token
    (4, "<end_of_turn>"),    # a different control token
    (1, "<0x0B>"),           # a different byte
    (5, "\u2581\u2581\u2581"),  # a shorter run of spaces
    (2, "the"),              # the space mark dropped is a different token, not a spelling
])
def test_a_real_difference_is_refused_naming_the_first_token(j, other):
    b = list(BASE)
    b[j] = other
    with pytest.raises(LogitdiffError, match=rf"tokenizers differ at token id {j}: .* in a vs {other!r} in b"):
        check("a", _h(BASE), BASE, "b", _h(b), b)


def test_a_longer_vocabulary_is_refused():
    b = BASE[:-1] + ["extra"]
    with pytest.raises(LogitdiffError, match=r"token id 6: '\[PAD6\]' in a vs 'extra' in b"):
        check("a", _h(BASE), BASE, "b", _h(b), b)


def test_without_a_token_list_different_hashes_are_refused():
    spelled = [t.replace("\u2581", " ") for t in BASE]
    with pytest.raises(LogitdiffError, match="no token list on one side"):
        check("a", _h(BASE), BASE, "b", _h(spelled), None)


def test_canonical_forms():
    assert canonical("\u2581a\u2581") == " a "
    assert canonical("<0xfe>") == canonical("<0xFE>") == "<0xFE>"
    assert canonical(None) == canonical("") == canonical("[PAD12]") == ""
    assert canonical("<0xFEF>") == "<0xFEF>"  # not a byte token


# ---------------------------------------------------------------------------------------
# real engines: transformers vs llama.cpp on a converter-spelled GGUF
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF dir, converter-spelled GGUF, GGUF whose user token really differs)."""
    import torch
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    from _models import _save_random, make_tokenizer

    root = tmp_path_factory.mktemp("tokid")
    d = root / "hf"
    tok = make_tokenizer(d, vocab_size=384)
    tok.add_tokens([AddedToken(USER_TOKEN, normalized=False, special=False)])
    tok.save_pretrained(str(d))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    _save_random(LlamaForCausalLM(cfg), d, seed=0, dtype="float32")
    real = gguf_export.read_tokenizer

    def converted(rename):
        def read(hf_dir, vocab_size=None):
            tk = real(hf_dir, vocab_size)
            for i, (t, ty) in enumerate(zip(tk["tokens"], tk["types"])):
                if ty == gguf_export._TT_USER_DEFINED:  # llama.cpp: "pre-normalize user-defined spaces"
                    tk["tokens"][i] = rename(t)
            return tk
        return read

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(gguf_export, "read_tokenizer", converted(lambda t: t.replace("\u2581", " ")))
        spelled = gguf_export.export_gguf(d, root / "spelled-F32.gguf", "F32")
        mp.setattr(gguf_export, "read_tokenizer", converted(lambda t: "abcd"))
        other = gguf_export.export_gguf(d, root / "other-F32.gguf", "F32")
    finally:
        mp.undo()
    return d, spelled, other, len(tok) - 1


def _items(tmp_path, prompts):
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": p, "max_tokens": 6}) + "\n" for k, p in enumerate(prompts)))
    return read_workload(wl)


def _reference(pair, tmp_path, prompts):
    from logitdiff.sources.hf import HFSource

    d = pair[0]
    src = HFSource(d, dtype="float32", threads=1)
    out = capture_reference(src, _items(tmp_path, prompts), tmp_path / "ref")
    return RunReader(out)


def test_the_pair_really_is_spelled_differently(pair):
    from logitdiff.sources.gguf import GGUFSource
    from logitdiff.sources.hf import HFSource

    d, spelled, _, uid = pair
    hf, gg = HFSource(d, dtype="float32"), GGUFSource(spelled, n_ctx=256, threads=1)
    try:
        assert hf.tokenizer_tokens[uid] == USER_TOKEN and gg.tokenizer_tokens[uid] == "    "
        assert hf.tokenizer_hash != gg.tokenizer_hash and hf.vocab_size == gg.vocab_size
    finally:
        gg.close()


def test_accepted_when_the_ids_agree(pair, tmp_path):
    from logitdiff.sources.gguf import GGUFSource

    ref = _reference(pair, tmp_path, ["Hello world. The quick brown fox", "What is 12 + 30?"])
    assert ref.tokens()[pair[3]] == USER_TOKEN  # the run keeps its token strings
    gg = GGUFSource(pair[1], n_ctx=256, threads=1)
    try:
        capture_candidate(gg, ref, tmp_path / "cand")
    finally:
        gg.close()
    cand = RunReader(tmp_path / "cand")
    assert cand.tokenizer_hash != ref.tokenizer_hash
    comp = compare_runs(ref, cand)
    assert any("spelled differently in 1 token(s)" in n for n in comp.notes)
    # the same float32 weights in both engines: the distributions agree
    assert np.asarray(comp.columns["kl_nats"]).max() < 1e-4


def test_refused_when_the_ids_do_not_agree(pair, tmp_path):
    """Four spaces: llama.cpp matches the converter-spelled user token, transformers does
    not (its token is spelled with U+2581): the ids differ and the item is named."""
    from logitdiff.sources.gguf import GGUFSource

    ref = _reference(pair, tmp_path, ["Hello world", "def f(x):\n    return x"])
    gg = GGUFSource(pair[1], n_ctx=256, threads=1)
    try:
        with pytest.raises(LogitdiffError, match=r"item 'i1': tokenization differs at prompt position \d+"):
            capture_candidate(gg, ref, tmp_path / "cand")
    finally:
        gg.close()
    assert not (tmp_path / "cand").exists()


def test_a_real_vocabulary_difference_is_refused(pair, tmp_path):
    from logitdiff.sources.gguf import GGUFSource

    ref = _reference(pair, tmp_path, ["Hello world"])
    gg = GGUFSource(pair[2], n_ctx=256, threads=1)
    try:
        with pytest.raises(LogitdiffError, match=rf"tokenizers differ at token id {pair[3]}: 'abcd' in .* vs {USER_TOKEN!r}"):
            capture_candidate(gg, ref, tmp_path / "cand")
    finally:
        gg.close()


def test_hash_of_a_vocabulary_with_holes():
    """An id without a token (transformers' convert_ids_to_tokens gives None for a hole in the
    id space) hashes as its own value, not as an error, and not as any token string."""
    import hashlib

    plain = ["a", "\u2581b", "<0x0A>"]
    want = hashlib.sha256(b"".join(t.encode() + b"\x00" for t in plain)).hexdigest()
    assert tokenizer_hash_of(plain) == "sha256:" + want  # unchanged for a vocabulary without holes
    holed = tokenizer_hash_of(["a", None, "<0x0A>"])
    assert holed not in {tokenizer_hash_of(["a", s, "<0x0A>"]) for s in ("", "\xff", "None", "\x00")}
    assert holed != tokenizer_hash_of(["a", "<0x0A>"])


def test_run_refuses_a_tokenization_mismatch_before_the_reference_capture(pair, tmp_path, capsys):
    """`run` renders every prompt with the reference and each candidate (tokenizer-only opens)
    before capturing anything: the item whose ids differ is named in one line, exit 1, and no
    reference run was started. The same pair on prompts that tokenize alike passes the preflight."""
    from logitdiff.capture import preflight_tokenization
    from logitdiff.cli import main

    ref_spec, cand_spec = f"hf:{pair[0]},dtype=float32,threads=1", f"gguf:{pair[1]},n_ctx=256,threads=1"
    preflight_tokenization(ref_spec, [cand_spec], _items(tmp_path, ["Hello world. The quick brown fox", "What is 12 + 30?"]))
    wl = tmp_path / "wl.jsonl"
    _items(tmp_path, ["Hello world", "def f(x):\n    return x"])  # i1: four spaces, ids differ
    out = tmp_path / "out"
    rc = main(["run", "--reference", ref_spec, "--candidate", cand_spec, "--workload", str(wl), "--out", str(out),
               "--no-noise-floor", "--floor", "none"])
    err = capsys.readouterr().err
    assert rc != 0
    line = [x for x in err.splitlines() if "tokenization differs" in x]
    assert len(line) == 1 and "item 'i1': tokenization differs at prompt position" in line[0] and cand_spec in line[0]
    assert "Traceback" not in err
    assert not (out / "runs" / "reference").exists()

    # and the refusal comes before any capture: no reference stage began, no bar was started
    from logitdiff.pipeline import Hooks, RunConfig, run_pipeline

    seen: list[str] = []

    class Record(Hooks):
        def stage(self, text):
            seen.append(text)

        def bar(self, total, text):
            seen.append(f"bar {text}")
            return lambda n=1: None

    cfg = RunConfig(reference=ref_spec, candidates=[cand_spec], workload=str(wl), out=str(tmp_path / "out2"),
                    noise_floor=False, floor="none")
    with pytest.raises(LogitdiffError, match=r"item 'i1': tokenization differs at prompt position \d+"):
        run_pipeline(cfg, Record())
    assert seen and seen[-1].startswith("preflight:"), seen


# ---------------------------------------------------------------------------------------
# the preflight: what it compares, what it renders once, and its cache
# ---------------------------------------------------------------------------------------


def _tokens_of(path):
    from logitdiff.sources.gguf_meta import read_keys

    return list(read_keys(path)["tokenizer.ggml.tokens"])


def _with_token(src, dst, j, text):
    from _models import rewrite_gguf

    tokens = _tokens_of(src)
    tokens[j] = text
    return rewrite_gguf(src, dst, fields={"tokenizer.ggml.tokens": tokens})


@pytest.mark.parametrize("which, new", [
    ("the chat template's end token", lambda t: "<|im_stop|>"),   # every chat prompt holds it
    ("the last token, widened", lambda t: t + "x"),              # no prompt produces it
    ("the newline byte", lambda t: "<0x0B>" if t.startswith("<0x") else t + "\u2581"),
])
def test_preflight_refuses_a_changed_token_text_in_one_line_naming_both_files(pair, tmp_path, monkeypatch, which, new):
    """A candidate GGUF whose token strings differ from the reference's in anything but a
    converter's spelling is refused by the preflight, naming the token id, both spellings
    and both files, whether or not a prompt of the workload produces that token."""
    from logitdiff.capture import preflight_tokenization

    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    ref = pair[1]
    tokens = _tokens_of(ref)
    j = {"the chat template's end token": tokens.index("<|im_end|>"), "the last token, widened": len(tokens) - 1,
         "the newline byte": next(i for i, t in enumerate(tokens) if t in ("<0x0A>", "Ċ"))}[which]
    cand = _with_token(ref, tmp_path / "cand.gguf", j, new(tokens[j]))
    ref_spec, cand_spec = f"gguf:{ref}", f"gguf:{cand}"
    items = _items(tmp_path, ["Hello world"])
    with pytest.raises(LogitdiffError) as e:
        preflight_tokenization(ref_spec, [cand_spec], items)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"tokenizers differ at token id {j}: {tokens[j]!r} in {ref_spec} vs {new(tokens[j])!r} in {cand_spec}")
    preflight_tokenization(ref_spec, [f"gguf:{_with_token(ref, tmp_path / 'same.gguf', j, tokens[j])}"], items)  # the control


def test_preflight_renders_each_tokenizer_once(pair, tmp_path, monkeypatch):
    """Candidates whose metadata is the reference's but for the quantizer's keys (a copy; a
    file typed Q8_0 with imatrix provenance) are not rendered: llama.cpp loads the reference's
    vocabulary only. One with any other key changed (general.name, which llama.cpp's vocabulary
    reads) is rendered, and passes: its prompts give the reference's ids. A later preflight of
    the same prompts takes the ids from the cache (keyed by the tokenizer digest and the texts)
    and loads no vocabulary; other prompts load them again, and the ids are the full source's."""
    import shutil

    from _models import rewrite_gguf
    from logitdiff.capture import preflight_tokenization
    from logitdiff.sources import gguf as gguf_source

    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    loads = []
    real = gguf_source.load_vocab

    def counting(path):
        loads.append(str(path))
        return real(path)

    monkeypatch.setattr(gguf_source, "load_vocab", counting)
    ref = pair[1]
    copy = shutil.copy2(ref, tmp_path / "copy.gguf")
    typed = rewrite_gguf(ref, tmp_path / "typed.gguf", fields={"general.file_type": 7, "quantize.imatrix.file": "i.dat"})
    named = rewrite_gguf(ref, tmp_path / "named.gguf", fields={"general.name": "another model"})
    items = _items(tmp_path, ["Hello world", "def f(x):\n    return x"])
    preflight_tokenization(f"gguf:{ref}", [f"gguf:{copy}", f"gguf:{typed}", f"gguf:{named}"], items)
    assert loads == [str(ref), str(named)]
    loads.clear()
    preflight_tokenization(f"gguf:{ref}", [f"gguf:{named}", f"gguf:{copy}"], items)
    assert loads == []  # every prompt's ids cached, for both tokenizers
    other = _items(tmp_path, ["What is 12 + 30?", "Hello world"])
    preflight_tokenization(f"gguf:{ref}", [f"gguf:{named}", f"gguf:{copy}"], other)  # order: the first of a kind renders
    assert loads == [str(ref), str(named)]
    from logitdiff.sources.gguf import GGUFSource

    with GGUFSource(named, tokenizer_only=True) as cached, GGUFSource(named, n_ctx=64, threads=1) as full:
        assert cached.render_many(other) == full.render_many(other) == [full.render(it) for it in other]
    assert loads == [str(ref), str(named)]  # the tokenizer-only open's ids came from the cache


@pytest.mark.parametrize("mtime", ["new", "restored"])
def test_preflight_reads_a_candidate_rewritten_in_place_again(pair, tmp_path, monkeypatch, mtime):
    """The metadata (tokens, digest) is cached per version of the file: a candidate rewritten in
    place with the same size and one token's text changed (a new mtime; or the old mtime put
    back, which leaves the new ctime) is read again and refused; the cached copy is not used."""
    import os
    import shutil

    from logitdiff.capture import preflight_tokenization

    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    ref = pair[1]
    cand = shutil.copy2(ref, tmp_path / "cand.gguf")
    items = _items(tmp_path, ["Hello world"])
    preflight_tokenization(f"gguf:{ref}", [f"gguf:{cand}"], items)  # both files' metadata now cached
    tokens = _tokens_of(ref)
    j = len(tokens) - 1
    changed = _with_token(ref, tmp_path / "changed.gguf", j, tokens[j][:-1] + ("y" if tokens[j][-1] != "y" else "z"))
    st = os.stat(cand)
    assert changed.stat().st_size == st.st_size
    with open(cand, "r+b") as f:  # in place: same path, inode and size
        f.write(changed.read_bytes())
    if mtime == "restored":
        os.utime(cand, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(cand).st_size == st.st_size and os.stat(cand).st_ino == st.st_ino
    with pytest.raises(LogitdiffError, match=rf"tokenizers differ at token id {j}: .* in gguf:{ref} vs .* in gguf:{cand}"):
        preflight_tokenization(f"gguf:{ref}", [f"gguf:{cand}"], items)
