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
    _save_random(LlamaForCausalLM(cfg), out_dir, seed=seed, dtype=dtype)
    return out_dir


def _save_random(model, out_dir: Path, *, seed: int, dtype: str, zero_rows: tuple[int, ...] = ()) -> None:
    import torch

    # Larger-than-default init so the random model has peaked, varied distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        for r in zero_rows:  # output rows whose logit is always 0
            model.lm_head.weight[r].zero_()
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    (out_dir / "logitdiff_test_model.json").write_text(json.dumps({"seed": seed}))


BUILTIN_TOKENIZER = Path(__file__).resolve().parents[1] / "src" / "logitdiff" / "builtin" / "tiny"


def widen_tokenizer(src_dir: str | Path, out_dir: str | Path, vocab_size: int, *, extra: tuple[str, ...] = ()):
    """Copy a byte-level BPE tokenizer and pad its vocabulary with filler tokens ``<fillN>``
    to exactly ``vocab_size`` entries (a real-scale V such as Qwen's 248,320); ``extra``
    (printable ASCII strings) are the first fillers.

    The fillers are plain vocabulary entries without merges, so BPE never produces them:
    tokenization is unchanged, only the size of the distribution grows."""
    import shutil

    from transformers import AutoTokenizer

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out_dir / f.name)
    tj = json.loads((src_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    n = max(max(vocab.values()), max((a["id"] for a in tj.get("added_tokens") or []), default=-1)) + 1
    if vocab_size < n:
        raise ValueError(f"{src_dir}: tokenizer has {n} tokens > vocab_size={vocab_size}")
    names = list(extra) + [f"<fill{i}>" for i in range(n + len(extra), vocab_size)]
    for i, name in enumerate(names):
        vocab[name] = n + i
    (out_dir / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


WIDE_VOCAB = 248_320  # Qwen3.5's vocabulary size: the design point


def make_wide_llama(out_dir: str | Path, *, vocab_size: int = WIDE_VOCAB, hidden: int = 128, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, max_positions: int = 4096, seed: int = 0, dtype: str = "float32",
                    extra: tuple[str, ...] = (), never_eos: bool = False) -> Path:
    """A random Llama whose vocabulary has exactly ``vocab_size`` tokens: the bundled
    tokenizer (builtin:tiny) widened with filler tokens (:func:`widen_tokenizer`).

    ``never_eos``: the end-of-sequence token's output row is zero, so its logit is 0 while
    the largest of ~248k random logits is well above it: greedy generation runs to
    ``max_tokens`` (benchmarks and scale tests need outputs of a set length)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "logitdiff_test_model.json").exists():
        return out_dir
    tok = widen_tokenizer(BUILTIN_TOKENIZER, out_dir, vocab_size, extra=extra)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    model = LlamaForCausalLM(cfg)
    if never_eos:
        _save_random(model, out_dir, seed=seed, dtype=dtype, zero_rows=(eos,))
    else:
        _save_random(model, out_dir, seed=seed, dtype=dtype)
    return out_dir


def rewrite_gguf(src: str | Path, dst: str | Path, *, fields: dict | None = None, keep_tensor=None) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with metadata ``fields`` replaced (key -> value,
    written with the field's type in ``src``; a new key as a uint32, a string or an array of
    strings as its value is) and only the tensors ``keep_tensor(name)`` accepts (default all):
    a file that claims what its tensors do not hold, built the way a converter writes one."""
    import gguf

    fields = dict(fields or {})
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=fields.pop("general.architecture", arch))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = fields.pop(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for key, value in fields.items():
        vtype = (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.ARRAY
                 if isinstance(value, list) else gguf.GGUFValueType.UINT32)
        writer.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType.STRING if isinstance(value, list) else None)
    kept = [t for t in reader.tensors if keep_tensor is None or keep_tensor(t.name)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst)
