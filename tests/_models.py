"""Small real models for tests: a byte-level BPE tokenizer and a random Llama.

Built offline in seconds; saved with ``save_pretrained`` so every backend reads real files.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def _corpus() -> list[str]:
    import inspect
    import json as _json
    import textwrap

    texts = [inspect.getsource(_json), inspect.getsource(textwrap)]
    texts.append("The quick brown fox jumps over the lazy dog. " * 20)
    texts.append("What is 12 + 30? 42. Repeat: hello world. " * 20)
    return texts


def make_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE (GPT-2 style) tokenizer and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_random_llama(
    out_dir: str | Path,
    *,
    hidden: int = 256,
    intermediate: int = 768,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """A random-init LlamaForCausalLM plus tokenizer in ``out_dir`` (real files)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir, vocab_size=vocab_size)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so the random model has peaked, varied distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    (out_dir / "logitdiff_test_model.json").write_text(json.dumps({"seed": seed}))
    return out_dir


WIDE_VOCAB = 248_320  # Qwen3.5's vocabulary size: the design point of issue 16


def widen_tokenizer(out_dir: str | Path, vocab_size: int = WIDE_VOCAB) -> int:
    """Copy the bundled tokenizer into ``out_dir`` with filler tokens appended to its BPE
    vocabulary up to exactly ``vocab_size`` entries (``<fillerN>``: no merge produces them,
    so tokenization is unchanged; they are real ids a model can put mass on)."""
    import shutil

    from logitdiff.builtin import TINY_DIR

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (TINY_DIR / name).exists():
            shutil.copy(TINY_DIR / name, out_dir / name)
    tj = json.loads((TINY_DIR / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    base = len(vocab)
    assert base <= vocab_size and max(vocab.values()) == base - 1
    for i in range(base, vocab_size):
        vocab[f"<filler{i}>"] = i
    (out_dir / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return vocab_size


def make_wide_llama(
    out_dir: str | Path,
    *,
    vocab_size: int = WIDE_VOCAB,
    hidden: int = 128,
    layers: int = 2,
    max_positions: int = 40_960,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """A random Llama (hidden 128, 2 layers) on the bundled tokenizer widened to
    ``vocab_size`` tokens, saved with real files. The end-of-sequence tokens' output rows
    are zero, so their logit is 0 while the largest of ~248k random logits is well above
    it: greedy generation runs to ``max_tokens`` (benchmarks need outputs of a set length)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    n = widen_tokenizer(out_dir, vocab_size)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=n,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        model.lm_head.weight[2].zero_()  # <|im_end|>, the eos id
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0, "do_sample": False}))
    return out_dir
