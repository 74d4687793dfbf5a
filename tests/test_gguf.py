"""GGUF export, llama.cpp quant ladder and the gguf: source, on a real random Llama.

No mocks: a random-init Llama (tests/_models.py) is exported with our own exporter,
quantized by llama.cpp, and compared against transformers in float32.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _models import make_random_llama  # noqa: E402

from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources.quantize import DEFAULT_QUANTS, build_ladder, check_tensor_types, quantize  # noqa: E402
from logitdiff.sources import open_source, tokenizer_hash_of  # noqa: E402
from logitdiff.sources.gguf import GGUFSource, extra_bufts_supported  # noqa: E402
from logitdiff.workload import Item  # noqa: E402

THREADS = 2

TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The quick brown fox jumps over the lazy dog. What is 12 + 30? 42.  Two  spaces,\ttabs,\n\nnewlines; "
    "json.dumps({'key': [1, 2.5, None]}) -> textwrap.dedent(text) ... hello world! "
    "Unicode: café, naïve, Ωmega, 日本語, 😀 and 'quotes' don't won't it's."
)

CHAT = Item(
    id="chat1",
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 + 30?\nAnswer with a number."},
    ],
)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _kl_top1(ref_logits: np.ndarray, cand_logits: np.ndarray) -> tuple[float, float]:
    lp, lq = _log_softmax64(ref_logits), _log_softmax64(cand_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    agree = (ref_logits.argmax(-1) == cand_logits.argmax(-1)).mean()
    return float(kl.mean()), float(agree)


# ----------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


@pytest.fixture(scope="module")
def ladder(model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    t0 = time.perf_counter()
    events = []
    paths = build_ladder(model_dir, cache, DEFAULT_QUANTS, progress=lambda *a: events.append(a))
    elapsed = time.perf_counter() - t0
    print(f"\nladder build: {elapsed:.2f}s for {len(paths)} files")
    return {"paths": paths, "cache": cache, "events": events, "seconds": elapsed}


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def f32(ladder):
    src = GGUFSource(ladder["paths"]["F32"], n_ctx=512, threads=THREADS)
    yield src
    src.close()


@pytest.fixture(scope="module")
def sequence(hf):
    """(prompt ids, teacher ids, HF float32 logits rows predicting each teacher token)."""
    tok, model = hf
    ids = tok(TEXT + " " + TEXT, add_special_tokens=False)["input_ids"]
    prompt, teacher = ids[:8], ids[8:]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    ref = logits[len(prompt) - 1: len(ids) - 1]
    assert ref.shape[0] == len(teacher)
    return prompt, teacher, ref


def _hf_render(tok, item: Item) -> list[int]:
    if item.prompt is not None:
        return tok(item.prompt, add_special_tokens=False)["input_ids"]
    text = tok.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------
# (a) tokenizer
# ----------------------------------------------------------------------------------------


def test_tokenizer_hash_matches_hf(hf, f32):
    tok, _ = hf
    hf_hash = tokenizer_hash_of([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    assert f32.tokenizer_hash == hf_hash
    assert f32.vocab_size == len(tok)
    assert f32.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.parametrize(
    "item",
    [
        CHAT,
        Item(id="raw", prompt=TEXT),
        Item(id="raw-special", prompt="hello<|im_end|>\n<|im_start|>user\nworld <tool_call>x</tool_call>"),
        Item(id="spaces", prompt="   leading and trailing   \n\n\n"),
    ],
    ids=lambda it: it.id,
)
def test_render_matches_hf(hf, f32, item):
    tok, _ = hf
    assert f32.render(item) == _hf_render(tok, item)


def test_chat_text_and_detokenize(hf, f32):
    tok, _ = hf
    text = tok.apply_chat_template(CHAT.messages, add_generation_prompt=True, tokenize=False)
    assert f32.render_text(CHAT) == text
    ids = f32.render(CHAT)
    assert f32.detokenize(ids) == text
    assert f32.token_text(ids[0]) == "<|im_start|>"


# ----------------------------------------------------------------------------------------
# (b) cross-engine: transformers F32 vs llama.cpp F32
# ----------------------------------------------------------------------------------------


def test_cross_engine_f32(f32, sequence):
    prompt, teacher, ref = sequence
    got = f32.score(prompt, teacher)
    assert got.dtype == np.float32 and got.shape == (len(teacher), f32.vocab_size)
    kl, agree = _kl_top1(ref, got)
    print(f"\nHF F32 vs GGUF F32: mean KL {kl:.3e} nats, top-1 agreement {agree:.4f} over {len(teacher)} positions")
    assert kl <= 1e-4
    assert agree >= 0.995


def test_score_is_stateless(f32, sequence):
    prompt, teacher, _ = sequence
    a = f32.score(prompt, teacher[:20])
    f32.score(prompt[:3], teacher[5:40])  # different history in between
    b = f32.score(prompt, teacher[:20])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def _eval_source(monkeypatch, ladder, **kw):
    """The F32 GGUF loaded as for a binding without the internals the output-row path
    uses: ``logits_all`` and plain ``Llama.eval``."""
    import logitdiff.sources.gguf as G

    with monkeypatch.context() as mp:
        mp.setattr(G, "_has_output_batch_api", lambda llm: False)
        src = GGUFSource(ladder["paths"]["F32"], n_ctx=512, threads=THREADS, **kw)
    assert src._fast is False and "logits_all" in src.identity()["logits"]
    return src


def test_score_asks_only_output_rows_and_equals_full_eval(monkeypatch, ladder, f32, sequence):
    """score() flags only the output positions (no logits_all); the rows equal
    llama-cpp-python's own Llama.eval with logits_all bit for bit, and a prompt spanning
    several n_batch chunks (the first ones without any output row) gives the same
    distributions."""
    prompt, teacher, _ = sequence
    prompt = (prompt * 6)[:40]
    assert f32._fast and f32.identity()["logits"] == "output rows only, in blocks"
    got = f32.score(prompt, teacher)
    with _eval_source(monkeypatch, ladder) as slow:
        np.testing.assert_array_equal(slow.score(prompt, teacher), got)
        assert slow.generate(prompt, 5).token_ids == f32.generate(prompt, 5).token_ids
    with GGUFSource(ladder["paths"]["F32"], n_ctx=512, threads=THREADS, n_batch=16) as small:
        chunked = small.score(prompt, teacher)
        assert small.generate(prompt, 6).token_ids == f32.generate(prompt, 6).token_ids
    np.testing.assert_allclose(chunked, got, rtol=0, atol=1e-3)  # other batch shapes, other float rounding
    assert (chunked.argmax(1) == got.argmax(1)).mean() >= 0.97


def test_score_blocks_bounded_and_selected(f32, sequence):
    """Blocks of at most the chunk's rows, only the selected positions, in order; a decode
    call never flags more rows than a block, so windows end early: other batch shapes, float
    rounding only (same 1e-3 as above)."""
    prompt, teacher, _ = sequence
    full = f32.score(prompt, teacher)
    chunk = 3 * 4 * f32.vocab_size  # three float32 rows
    blocks = list(f32.score_blocks([(prompt, teacher)], chunk_bytes=chunk))
    assert max(len(b.rows) for b in blocks) <= 3 and [b.t0 for b in blocks] == list(range(0, len(teacher), 3))
    np.testing.assert_allclose(np.concatenate([b.rows for b in blocks]), full, rtol=0, atol=1e-3)
    pos = [1, 4, 5, len(teacher) - 1]
    sel = list(f32.score_blocks([(prompt, teacher)], [pos], chunk_bytes=chunk))
    got = np.concatenate([b.rows for b in sel])
    assert got.shape == (len(pos), f32.vocab_size)
    np.testing.assert_allclose(got, full[pos], rtol=0, atol=1e-3)


# ----------------------------------------------------------------------------------------
# (c) greedy generation
# ----------------------------------------------------------------------------------------


def test_generate_greedy_and_consistent_with_score(f32):
    prompt = f32.render(CHAT)
    gen = f32.generate(prompt, 24)
    assert 1 <= len(gen.token_ids) <= 24
    assert not hasattr(gen, "logits")  # ids only
    if gen.stopped_by == "eos":
        assert gen.token_ids[-1] in f32.eos_token_ids
    else:
        assert gen.stopped_by == "max_tokens" and len(gen.token_ids) == 24
    scored = f32.score(prompt, gen.token_ids)
    assert list(scored.argmax(-1)) == gen.token_ids


# ----------------------------------------------------------------------------------------
# (d) ladder + quantized files
# ----------------------------------------------------------------------------------------


def test_ladder_files_and_cache(ladder, model_dir):
    paths = ladder["paths"]
    assert set(paths) == {"F32", "BF16", *DEFAULT_QUANTS}
    for name, p in paths.items():
        assert p.is_file() and p.stat().st_size > 0
        info = check_tensor_types(p, name)
        assert info["file_type"] == name
    # second call: everything cached, same paths
    events = []
    again = build_ladder(model_dir, ladder["cache"], DEFAULT_QUANTS, progress=lambda *a: events.append(a))
    assert again == paths
    assert {e[3] for e in events} == {"cached"}
    assert {e[0] for e in ladder["events"] if e[3] == "built"} == set(paths)


def test_check_tensor_types_rejects_wrong_type(ladder):
    with pytest.raises(LogitdiffError, match="Q8_0"):
        check_tensor_types(ladder["paths"]["Q8_0"], "Q4_K_M")
    mix = check_tensor_types(ladder["paths"]["Q4_K_M"], "Q4_K_M")
    assert mix["dominant"] == "Q4_K"


def test_check_tensor_types_catches_fallback(tmp_path):
    """Rows of 320 are not multiples of 256: llama.cpp silently falls back to Q5_0."""
    d = make_random_llama(tmp_path / "odd", hidden=320, intermediate=512, layers=1, heads=4, kv_heads=4)
    from logitdiff.sources.gguf_export import export_gguf

    src = export_gguf(d, tmp_path / "odd-F32.gguf", "F32")
    with pytest.raises(LogitdiffError, match=r"blk\.0\.\w+\.weight"):
        quantize(src, tmp_path / "odd-Q4_K_M.gguf", "Q4_K_M")
    assert not (tmp_path / "odd-Q4_K_M.gguf").exists()


def test_quantized_files_run_and_order(ladder, f32, sequence):
    prompt, teacher, _ = sequence
    base = f32.score(prompt, teacher)
    kls = {}
    for name in ("BF16",) + tuple(DEFAULT_QUANTS):
        with GGUFSource(ladder["paths"][name], n_ctx=512, threads=THREADS) as src:
            assert src.tokenizer_hash == f32.tokenizer_hash
            got = src.score(prompt, teacher)
            assert np.isfinite(got).all(), name
            kls[name], _ = _kl_top1(base, got)
            ident = src.identity()
            assert ident["quant"] == name and ident["backend"] == "llama.cpp"
    print("\nKL vs GGUF F32:", {k: f"{v:.2e}" for k, v in kls.items()})
    assert kls["BF16"] < kls["Q8_0"] < kls["Q4_K_M"] < kls["Q2_K"]


def test_identity(f32, ladder):
    ident = f32.identity()
    p = ladder["paths"]["F32"]
    assert ident["backend"] == "llama.cpp"
    assert ident["path"] == str(p.resolve())
    assert ident["size"] == p.stat().st_size
    assert ident["sha256"].startswith("sha256:")
    assert ident["file_type"] == "F32"
    assert ident["n_ctx"] >= 512 and ident["threads"] == THREADS
    assert ident["extra_bufts"] is False
    # the flag really reached llama.cpp (weight repacking / extra buffer types off)
    assert extra_bufts_supported()
    assert f32.llm.model_params.use_extra_bufts is False


# ----------------------------------------------------------------------------------------
# (e) bad input
# ----------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(LogitdiffError, match="nope.gguf: GGUF file not found"):
        open_source(f"gguf:{missing}")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n")
    with pytest.raises(LogitdiffError, match="model.gguf: not a GGUF file"):
        GGUFSource(bad)


def test_truncated_gguf(tmp_path, ladder):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ladder["paths"]["Q8_0"].read_bytes()[:4096])
    with pytest.raises(LogitdiffError, match="cut.gguf"):
        GGUFSource(cut)


def test_bad_spec_options(ladder):
    p = ladder["paths"]["F32"]
    with pytest.raises(LogitdiffError, match="unknown option 'bogus'"):
        open_source(f"gguf:{p},bogus=1")
    with pytest.raises(LogitdiffError, match="option n_ctx='big' must be a positive integer"):
        open_source(f"gguf:{p},n_ctx=big")


def test_too_long(ladder, sequence):
    prompt, teacher, _ = sequence
    with open_source(f"gguf:{ladder['paths']['Q8_0']},n_ctx=64,threads={THREADS}") as src:
        assert src.n_ctx == 64
        with pytest.raises(LogitdiffError, match="exceed n_ctx=64"):
            src.score(prompt, teacher[:100])
        with pytest.raises(LogitdiffError, match="exceed n_ctx=64"):
            src.generate(prompt, 100)
        with pytest.raises(LogitdiffError, match="outside the vocabulary"):
            src.score(prompt, [src.vocab_size + 5])
        # still usable after the errors
        assert src.score(prompt, teacher[:10]).shape == (10, src.vocab_size)


def test_load_vocab_restores_stderr_under_concurrent_and_failed_loads(ladder, tmp_path):
    """load_vocab swaps the process-wide sys.stderr for the load: loads at once in several
    threads, and a load that fails, must each leave sys.stderr as it was."""
    import sys
    import threading

    from logitdiff.sources.gguf import load_vocab

    real = sys.stderr
    vocabs = []
    threads = [threading.Thread(target=lambda: vocabs.append(load_vocab(ladder["paths"]["F32"]))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(vocabs) == 4 and sys.stderr is real
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises((ValueError, RuntimeError)):
        load_vocab(bad)
    assert sys.stderr is real


def test_metadata_is_read_once_per_version_of_the_file(ladder, tmp_path, monkeypatch):
    """The tokenizer metadata (V token strings, the special ids, the template) is parsed once
    per version of the file: a second open reads the cache entry (a tampered entry is what it
    sees), a new version of the file (another mtime) or a damaged entry is parsed again."""
    import json
    import os
    import shutil

    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    shutil.copy2(ladder["paths"]["Q8_0"], g)
    first = GGUFSource(g, tokenizer_only=True)
    want = first.tokenizer_tokens
    assert len(want) == first.vocab_size > 100 and first.eos_token_ids
    (entry,) = (tmp_path / "cache" / "gguf.metadata").iterdir()
    meta = json.loads(entry.read_text())
    meta["tokenizer.ggml.tokens"][5] = "<tampered>"
    entry.write_text(json.dumps(meta))
    again = GGUFSource(g, tokenizer_only=True)
    assert again.tokenizer_tokens[5] == "<tampered>" and again.tokenizer_hash != first.tokenizer_hash
    st = g.stat()
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version: read again, a second entry
    renewed = GGUFSource(g, tokenizer_only=True)
    assert renewed.tokenizer_tokens == want and renewed.tokenizer_hash == first.tokenizer_hash
    assert len(list((tmp_path / "cache" / "gguf.metadata").iterdir())) == 2
    for e in (tmp_path / "cache" / "gguf.metadata").iterdir():  # damaged: valid JSON of the wrong shape
        e.write_text('["x"]')
    damaged = GGUFSource(g, tokenizer_only=True)
    assert damaged.tokenizer_tokens == want and damaged.eos_token_ids == first.eos_token_ids
    assert (damaged.arch, damaged.n_ctx_train, damaged.file_type, damaged.chat_template) == \
        (first.arch, first.n_ctx_train, first.file_type, first.chat_template)


def test_metadata_parser_reads_what_ggufreader_reads(ladder, tmp_path):
    """The key/value parser (sources.gguf_meta) gives GGUFReader's values on every file of
    the ladder; a file cut inside its key/value section is refused with GGUFReader's one-line
    error, naming the file."""
    from logitdiff.sources.gguf_meta import _read_with_gguf, gguf_metadata, read_keys

    for q, path in ladder["paths"].items():
        got = read_keys(path)
        assert got == _read_with_gguf(path), q
        assert len(got["tokenizer.ggml.tokens"]) > 100 and got["context_length"] and got["general.architecture"], q
    raw = ladder["paths"]["Q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:4096])
    with pytest.raises(LogitdiffError, match=r"cut\.gguf: not a readable GGUF file"):
        gguf_metadata(cut)


# ----------------------------------------------------------------------------------------
# the tokenizer digest (sources.gguf_meta) and transformers' conversion, cached
# ----------------------------------------------------------------------------------------


def test_quants_of_one_file_share_its_tokenizer_digest(ladder):
    """llama-quantize copies the metadata and sets the file type and quantization version: every
    quant of the F32 export has the F32's digest; the BF16 export (our exporter, same tokenizer)
    too."""
    from logitdiff.sources.gguf_meta import read_keys

    digests = {q: read_keys(p)["tokenizer_metadata_sha256"] for q, p in ladder["paths"].items()}
    assert len(set(digests.values())) == 1 and digests["F32"].startswith("sha256:"), digests
    assert len({read_keys(p)["general.file_type"] for p in ladder["paths"].values()}) == len(digests)


@pytest.mark.parametrize("field, value, same", [
    ("general.file_type", 7, True),                      # the quantizer's keys
    ("general.quantization_version", 3, True),
    ("quantize.imatrix.file", "imatrix.dat", True),
    ("general.name", "phi-3 mini", False),                # llama.cpp's vocabulary reads it (token attributes)
    ("tokenizer.ggml.pre", "smollm", False),               # the pre-tokenizer
    ("tokenizer.chat_template", "{{ messages[0]['content'] }}", False),
    ("tokenizer.ggml.eos_token_id", 3, False),
    ("llama.context_length", 333, False),                  # an architecture key: hf: checks prompt lengths with it
    ("general.license", "mit", False),                     # read by no tokenizer today: in the digest all the same
])
def test_tokenizer_digest_changes_with_every_key_but_the_quantizers(ladder, tmp_path, field, value, same):
    from _models import rewrite_gguf
    from logitdiff.sources.gguf_meta import _read_with_gguf, read_keys

    src = ladder["paths"]["Q8_0"]
    changed = rewrite_gguf(src, tmp_path / "changed.gguf", fields={field: value})
    a, b = read_keys(src)["tokenizer_metadata_sha256"], read_keys(changed)["tokenizer_metadata_sha256"]
    assert (a == b) is same
    assert _read_with_gguf(changed)["tokenizer_metadata_sha256"] == b  # both readers digest the same bytes


def test_hf_gguf_conversion_is_cached_per_version_of_the_file(ladder, tmp_path, monkeypatch):
    """transformers' config and tokenizer of an hf:FILE.gguf are converted once per version of
    the file: a second open loads the cached copy (and renders and hashes as the conversion
    does, tokenizer-only and full); the file rewritten in place with the same size (its chat
    template changed) or a tokenizer_config.json put beside it is converted again."""
    import json
    import os
    import shutil

    from _models import rewrite_gguf
    from logitdiff.sources.gguf_meta import read_keys
    from logitdiff.sources.hf import HFSource

    cache = tmp_path / "cache"
    monkeypatch.setenv("LOGITDIFF_CACHE", str(cache))
    d = tmp_path / "model"
    d.mkdir()
    g = shutil.copy2(ladder["paths"]["Q8_0"], d / "m.gguf")
    first = HFSource(g, tokenizer_only=True)
    (entry,) = (cache / "hf.gguf_conversion").iterdir()
    again = HFSource(g, tokenizer_only=True)
    assert Path(again.tok.name_or_path) == entry and Path(first.tok.name_or_path) != entry  # the copy, loaded
    monkeypatch.setenv("LOGITDIFF_CACHE", "off")
    fresh, fresh_full = HFSource(g, tokenizer_only=True), HFSource(g, dtype="float32")
    monkeypatch.setenv("LOGITDIFF_CACHE", str(cache))
    cached_full = HFSource(g, dtype="float32")
    assert Path(cached_full.tok.name_or_path) == entry
    assert again.render(CHAT) == fresh.render(CHAT) == first.render(CHAT)
    assert again.tok.chat_template == fresh.tok.chat_template and again.max_positions == fresh.max_positions
    assert (cached_full.tokenizer_hash, cached_full.eos_token_ids, cached_full.vocab_size) == \
        (fresh_full.tokenizer_hash, fresh_full.eos_token_ids, fresh_full.vocab_size)
    assert cached_full.token_texts() == fresh_full.token_texts()
    for s in (first, again, fresh, fresh_full, cached_full):
        s.close()

    template = read_keys(g)["tokenizer.chat_template"]
    assert "assistant" in template
    new = rewrite_gguf(g, tmp_path / "new.gguf", fields={"tokenizer.chat_template": template.replace("assistant", "assistent")})
    st = os.stat(g)
    assert new.stat().st_size == st.st_size
    with open(g, "r+b") as f:  # in place, the old mtime put back: the ctime tells the versions apart
        f.write(new.read_bytes())
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    renewed = HFSource(g, tokenizer_only=True)
    assert "assistent" in renewed.tok.chat_template and renewed.render(CHAT) != first.render(CHAT)
    assert len(list((cache / "hf.gguf_conversion").iterdir())) == 2
    assert renewed.render_identity != first.render_identity

    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    beside = HFSource(g, tokenizer_only=True)
    assert len(list((cache / "hf.gguf_conversion").iterdir())) == 3
    assert beside.render_identity != renewed.render_identity
    for s in (renewed, beside):
        s.close()
