"""HFSource on real (random-init) Llama checkpoints written by tests/_models.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import make_random_llama  # noqa: E402

from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources import file_sha256, open_source  # noqa: E402
from logitdiff.workload import Item  # noqa: E402

CHAT = Item(id="chat", messages=[{"role": "user", "content": "What is 12 + 30?"}])
RAW = Item(id="raw", prompt="The quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    f32 = make_random_llama(root / "f32", dtype="float32")
    bf16 = make_random_llama(root / "bf16", dtype="bfloat16")
    return {"f32": f32, "bf16": bf16, "root": root}


@pytest.fixture(scope="module")
def src32(dirs):
    return open_source(f"hf:{dirs['f32']},batch=3")


@pytest.fixture(scope="module")
def src16(dirs):
    return open_source(f"hf:{dirs['bf16']},batch=3")


@pytest.fixture(scope="module")
def padded(dirs):
    """Same tokenizer, output layer padded by 64 rows, short context (for the length error)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = dirs["root"] / "padded"
    out.mkdir()
    for f in dirs["f32"].iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=len(tok) + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # make the padded rows win if they were kept: their logits dominate
        model.lm_head.weight[len(tok):] *= 50
    model.save_pretrained(str(out))
    return out


def _full_logits(src, ids):
    with torch.no_grad():
        return src.model(torch.tensor([ids])).logits[0].float().numpy()


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(a, b):
    la, lb = log_softmax(a.astype(np.float64)), log_softmax(b.astype(np.float64))
    return (np.exp(la) * (la - lb)).sum(-1)


def test_render_raw_and_chat(src32):
    tok = src32.tok
    raw = src32.render(RAW)
    assert raw == tok(RAW.prompt, add_special_tokens=False)["input_ids"]
    assert src32.detokenize(raw) == RAW.prompt

    chat = src32.render(CHAT)
    text = tok.apply_chat_template(CHAT.messages, add_generation_prompt=True, tokenize=False)
    assert chat == tok(text, add_special_tokens=False)["input_ids"]
    assert src32.detokenize(chat).endswith("<|im_start|>assistant")
    assert chat[0] == tok.convert_tokens_to_ids("<|im_start|>")

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert src32.render(Item(id="t", messages=CHAT.messages, tools=tools)) == chat  # template ignores tools
    assert isinstance(src32.token_text(chat[0]), str)


def test_basic_attributes(src32, src16, dirs):
    assert src32.vocab_size == len(src32.tok) == 512
    assert src32.eos_token_ids == (src32.tok.convert_tokens_to_ids("<|im_end|>"),)
    assert src32.tokenizer_hash == src16.tokenizer_hash  # same trained tokenizer
    assert src32.dtype_name == "float32" and src16.dtype_name == "bfloat16"  # from config.json
    assert src32.model.dtype == torch.float32 and src16.model.dtype == torch.bfloat16

    ident = src32.identity()
    assert ident["backend"] == "transformers"
    assert ident["dtype"] == "float32" and ident["device"] == "cpu"
    assert ident["architecture"] == "LlamaForCausalLM"
    assert ident["weight_files"]["model.safetensors"] == file_sha256(dirs["f32"] / "model.safetensors")
    assert "tokenizer.json" in ident["tokenizer_files"]
    assert "padded_logits" not in ident
    assert {"torch", "transformers", "threads", "model_path"} <= set(ident)


def test_score_matches_full_forward(src32):
    prompt = src32.render(CHAT)
    teacher = src32.render(RAW)[:12]
    rows = src32.score(prompt, teacher)
    assert rows.dtype == np.float32 and rows.shape == (len(teacher), src32.vocab_size)
    full = _full_logits(src32, prompt + teacher)[len(prompt) - 1 : len(prompt) + len(teacher) - 1]
    assert np.abs(rows - full).max() <= 1e-4
    assert src32.score(prompt, []).shape == (0, src32.vocab_size)


def _ragged_pairs(src):
    base = src.render(RAW) + src.render(CHAT)
    specs = [(3, 5), (17, 1), (1, 9), (25, 14), (8, 0), (11, 20), (5, 2)]
    return [(base[:p], base[p : p + t]) for p, t in specs]


def test_score_many_ragged_equals_single_f32(src32):
    pairs = _ragged_pairs(src32)
    many = src32.score_many(pairs)
    assert len(many) == len(pairs)
    for (p, t), got in zip(pairs, many):
        want = src32.score(p, t)
        assert got.shape == (len(t), src32.vocab_size)
        if len(t):
            assert np.abs(got - want).max() <= 1e-4


def test_score_many_ragged_bf16(src16):
    pairs = _ragged_pairs(src16)
    for (p, t), got in zip(pairs, src16.score_many(pairs)):
        want = src16.score(p, t)
        assert got.shape == want.shape == (len(t), src16.vocab_size)
        if len(t):
            same_top = (got.argmax(-1) == want.argmax(-1)).all()
            assert same_top or _kl(want, got).max() <= 1e-3


@pytest.mark.parametrize("which", ["src32", "src16"])
def test_generate_is_greedy_and_reproduced_by_score(which, request):
    """Generation keeps token ids only; teacher-forced scoring of them reproduces the greedy
    choice (the same model, the same head: argmax of the scored rows is the generated id)."""
    src = request.getfixturevalue(which)
    prompt = src.render(CHAT)
    g = src.generate(prompt, 12)
    assert len(g.token_ids) == 12 and g.stopped_by == "max_tokens"
    assert not hasattr(g, "logits")
    rows = src.score(prompt, g.token_ids)
    assert rows.dtype == np.float32 and rows.shape == (12, src.vocab_size)
    assert list(rows.argmax(-1)) == g.token_ids


def test_generate_stops_after_eos(src32):
    prompt = src32.render(RAW)
    free = src32.generate(prompt, 8).token_ids
    saved = src32.eos_token_ids
    try:
        src32.eos_token_ids = (free[3],)
        g = src32.generate(prompt, 8)
    finally:
        src32.eos_token_ids = saved
    k = free.index(free[3])
    assert g.token_ids == free[: k + 1] and g.stopped_by == "eos"


def test_padded_vocab_rows_dropped(padded):
    src = open_source(f"hf:{padded},dtype=float32")
    n = len(src.tok)
    assert src.model.config.vocab_size == n + 64
    assert src.vocab_size == n
    assert "dropped 64 padded output rows" in src.identity()["padded_logits"]
    prompt = src.render(RAW)
    rows = src.score(prompt[:1], prompt[1:6])
    assert rows.shape == (5, n)
    full = _full_logits(src, prompt[:1] + prompt[1:5])
    assert np.abs(rows - full[:, :n]).max() <= 1e-4
    g = src.generate(prompt[:5], 4)
    assert len(g.token_ids) == 4 and all(t < n for t in g.token_ids)

    # max_position_embeddings=64: a longer prompt is a one-line error naming the item
    long_item = Item(id="long", prompt=" ".join(str(i) for i in range(200)))
    with pytest.raises(LogitdiffError, match="'long'.*max_position_embeddings"):
        src.render(long_item)
    too_long = list(range(3, 70))
    with pytest.raises(LogitdiffError, match="max_position_embeddings"):
        src.score(too_long, [5])
    with pytest.raises(LogitdiffError, match="max_position_embeddings"):
        src.generate(too_long, 2)


def test_bad_inputs(dirs, tmp_path):
    with pytest.raises(LogitdiffError, match="not found"):
        open_source(f"hf:{tmp_path / 'nope'}")
    with pytest.raises(LogitdiffError, match="no config.json"):
        open_source(f"hf:{tmp_path}")
    with pytest.raises(LogitdiffError, match=r"dtype='fp8' \(expected bfloat16, float16 or float32\)"):
        open_source(f"hf:{dirs['f32']},dtype=fp8")
    with pytest.raises(LogitdiffError, match=r"device='tpu' \(expected cpu or cuda\)"):
        open_source(f"hf:{dirs['f32']},device=tpu")
    with pytest.raises(LogitdiffError, match="batch"):
        open_source(f"hf:{dirs['f32']},batch=0")
    with pytest.raises(LogitdiffError, match="threads"):
        open_source(f"hf:{dirs['f32']},threads=many")
    with pytest.raises(LogitdiffError, match="unknown option"):
        open_source(f"hf:{dirs['f32']},n_ctx=5")
    if not torch.cuda.is_available():
        with pytest.raises(LogitdiffError, match="cuda"):
            open_source(f"hf:{dirs['f32']},device=cuda")
    with pytest.raises(LogitdiffError) as e:
        open_source(f"hf:{tmp_path / 'nope'}")
    assert "\n" not in str(e.value) and "nope" in str(e.value)
