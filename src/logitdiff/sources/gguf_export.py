"""Export a Hugging Face Llama directory to a GGUF file (F32 or BF16).

This is logitdiff's own, deliberately small exporter built on the ``gguf`` Python
library (``GGUFWriter``); it is not llama.cpp's ``convert_hf_to_gguf.py`` (though it
follows the same conventions, so llama.cpp loads the result as a normal ``llama`` model).
It exists so that the quant ladder (``F32``/``BF16`` -> ``Q8_0`` ... ``Q2_K``) of a
reference model can be built without a llama.cpp checkout.

Scope (anything else is refused with a one-line :class:`LogitdiffError`):

* ``LlamaForCausalLM`` (``model_type: llama``): RMSNorm, SwiGLU MLP, (G)QA attention,
  RoPE with ``rope_type`` ``default`` (or ``linear`` scaling), optional tied embeddings,
  optional attention / MLP biases;
* weights in ``model.safetensors`` or sharded ``model.safetensors.index.json``, stored as
  BF16, F16 or F32 (read with numpy directly, no torch needed);
* a byte-level BPE ``tokenizer.json`` (GPT-2 style: ``ByteLevel`` pre-tokenizer with the
  GPT-2 regex, no normalizer, merges not ignored), written as ``tokenizer.ggml.model =
  "gpt2"``, ``tokenizer.ggml.pre = "gpt-2"``.

Conventions that matter for exact agreement with transformers:

* Q and K projections are permuted from HF's "rotate-half" RoPE layout to GGML's
  interleaved (pairwise) layout, exactly like llama.cpp's converter
  (``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)``; K uses ``n_kv_head``);
* 1-D tensors (norms, biases) are always F32; 2-D weights are F32 or BF16 according to
  ``outtype``. BF16 sources exported to BF16 are copied bit-exactly; F32 sources are
  rounded to BF16 (round-to-nearest-even) by ``gguf.quants``;
* tokens are written in id order (padded with ``[PAD{i}]`` / UNUSED up to the config's
  ``vocab_size`` when the model's embedding is larger than the tokenizer); added special
  tokens (and ``<|...|>``-looking ones) are CONTROL, other added tokens USER_DEFINED.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import LogitdiffError
from ..store.files import atomic_path, open_input

#: Bump when the bytes this exporter writes change (part of the ladder cache key).
EXPORTER_VERSION = "1"

OUTTYPES = ("F32", "BF16")

# HF tensor suffix (inside model.layers.N.) -> GGUF name suffix (inside blk.N.)
_LAYER_MAP = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# gguf.TokenType values (avoid importing gguf at module import time)
_TT_NORMAL, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED = 1, 3, 4, 5

_ST_DTYPES: dict[str, str | type[np.floating]] = {"BF16": "bf16", "F16": np.float16, "F32": np.float32}

# hf_dir files that define the exported bytes (weights are added separately)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


# ------------------------------------------------------------------------------------
# safetensors reading (numpy only; BF16 kept as raw uint16 bits)
# ------------------------------------------------------------------------------------


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files holding the model's weights (sharded or not)."""
    hf_dir = Path(hf_dir)
    single = hf_dir / "model.safetensors"
    index = hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise LogitdiffError(f"{index}: not a valid safetensors index ({e})") from None
        return [hf_dir / f for f in sorted(set(wm.values()))]
    raise LogitdiffError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json found")


def _iter_safetensors(path: Path) -> Iterator[tuple[str, str, np.ndarray]]:
    """Yield ``(name, dtype, array)``; arrays are read-only memory maps of the file.

    BF16 tensors come back as ``uint16`` arrays of raw bits.
    """
    try:
        # a regular file (memory-mapped below: its size allocates nothing); the header's
        # claimed length is read only when the file holds it
        with open_input(path, max_bytes=1 << 62) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > os.fstat(f.fileno()).st_size - 8:
                raise ValueError(f"its header claims {n} bytes, more than the file holds")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error, RecursionError) as e:
        raise LogitdiffError(f"{path}: not a readable safetensors file ({e})") from None
    base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise LogitdiffError(f"{path}: tensor {name} has dtype {dt}; only BF16, F16, F32 are supported")
        start, end = info["data_offsets"]
        raw = mm[base + start: base + end]
        npdt = np.uint16 if dt == "BF16" else _ST_DTYPES[dt]
        arr = raw.view(npdt).reshape(info["shape"])
        yield name, dt, arr


def _to_f32(dt: str, arr: np.ndarray) -> np.ndarray:
    if dt == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """HF rotate-half Q/K rows -> GGML interleaved RoPE rows (llama.cpp's ``permute``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return np.ascontiguousarray(
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# ------------------------------------------------------------------------------------
# config / tokenizer
# ------------------------------------------------------------------------------------


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise LogitdiffError(f"{path}: file not found")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise LogitdiffError(f"{path}: not valid JSON ({e})") from None


def _hparams(hf_dir: Path) -> dict:
    cfg = _read_json(hf_dir / "config.json")
    where = hf_dir / "config.json"
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise LogitdiffError(
            f"{where}: model_type {cfg.get('model_type')!r} is not supported by the GGUF exporter (llama only)"
        )
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(k), int):
            raise LogitdiffError(f"{where}: missing integer field {k!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise LogitdiffError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    rope = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ("default", "linear"):
        raise LogitdiffError(f"{where}: rope_type {rope_type!r} is not supported by the GGUF exporter")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    n_head = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    return {
        "cfg": cfg,
        "n_embd": cfg["hidden_size"],
        "n_ff": cfg["intermediate_size"],
        "n_layer": cfg["num_hidden_layers"],
        "n_head": n_head,
        "n_head_kv": cfg.get("num_key_value_heads") or n_head,
        "head_dim": head_dim,
        "n_ctx": cfg.get("max_position_embeddings", 2048),
        "eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "theta": float(theta),
        "rope_type": rope_type,
        "rope_factor": rope.get("factor"),
        "vocab_size": cfg["vocab_size"],
        "tied": bool(cfg.get("tie_word_embeddings", False)),
    }


def _looks_special(tok: str) -> bool:
    return (tok.startswith("<|") and tok.endswith("|>")) or tok in ("<pad>", "<mask>")


def _token_id(value, vocab: dict[str, int]) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return vocab.get(value)
    return None


def read_tokenizer(hf_dir: str | Path, vocab_size: int | None = None) -> dict:
    """Tokens (id order), token types, merges, special ids and chat template of a
    byte-level BPE HF tokenizer, as they go into GGUF metadata."""
    hf_dir = Path(hf_dir)
    tj_path = hf_dir / "tokenizer.json"
    tj = _read_json(tj_path)
    tc = _read_json(hf_dir / "tokenizer_config.json", required=False)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise LogitdiffError(f"{tj_path}: tokenizer model {model.get('type')!r} is not supported (byte-level BPE only)")
    pre = tj.get("pre_tokenizer") or {}
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)):
        raise LogitdiffError(
            f"{tj_path}: pre-tokenizer {pre.get('type')!r} is not the GPT-2 byte-level one; "
            "use llama.cpp's convert_hf_to_gguf.py for this model"
        )
    if tj.get("normalizer") is not None:
        raise LogitdiffError(f"{tj_path}: tokenizers with a normalizer are not supported by the GGUF exporter")
    if model.get("ignore_merges"):
        raise LogitdiffError(f"{tj_path}: BPE with ignore_merges=true is not supported by the GGUF exporter")

    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["id"]: a for a in tj.get("added_tokens") or []}
    for i, a in added.items():
        vocab[a["content"]] = i
    n = max(vocab.values()) + 1 if vocab else 0
    if vocab_size is not None and vocab_size < n:
        raise LogitdiffError(f"{tj_path}: tokenizer has {n} tokens but config vocab_size is {vocab_size}")
    total = max(n, vocab_size or 0)
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(total):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(_TT_UNUSED)
        elif i in added:
            tokens.append(t)
            types.append(_TT_CONTROL if (added[i].get("special") or _looks_special(t)) else _TT_USER_DEFINED)
        else:
            tokens.append(t)
            types.append(_TT_NORMAL)

    merges = []
    for m in model.get("merges") or []:
        merges.append(m if isinstance(m, str) else " ".join(m))

    special: dict[str, int] = {}
    for key in ("eos", "bos", "pad", "unk"):
        tid = _token_id(tc.get(f"{key}_token"), vocab)
        if tid is not None:
            special[key] = tid
    if "eos" not in special:
        cfg = _read_json(hf_dir / "config.json", required=False)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            special["eos"] = eos

    add_bos = bool(tc.get("add_bos_token", False))
    post = tj.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing" and "bos" in special:
        first = (post.get("single") or [{}])[0]
        if "SpecialToken" in first and first["SpecialToken"].get("id") == tokens[special["bos"]]:
            add_bos = True

    template = None
    cj = hf_dir / "chat_template.jinja"
    if cj.is_file():
        template = cj.read_text(encoding="utf-8")
    elif isinstance(tc.get("chat_template"), str):
        template = tc["chat_template"]
    elif isinstance(tc.get("chat_template"), list):
        named = {d.get("name"): d.get("template") for d in tc["chat_template"] if isinstance(d, dict)}
        template = named.get("default") or next(iter(named.values()), None)

    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special": special,
        "add_bos": add_bos,
        "chat_template": template,
    }


# ------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------


def _gguf_name(hf_name: str, n_layer: int) -> tuple[str, int | None] | None:
    """GGUF tensor name and layer index of an HF tensor (None for tensors to skip)."""
    if hf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[hf_name], None
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name.startswith("model.layers."):
        rest = hf_name[len("model.layers."):]
        bid_s, _, tail = rest.partition(".")
        if bid_s.isdecimal():
            stem, _, kind = tail.rpartition(".")
            if stem in _LAYER_MAP and kind in ("weight", "bias") and int(bid_s) < n_layer:
                return f"blk.{int(bid_s)}.{_LAYER_MAP[stem]}.{kind}", int(bid_s)
    raise LogitdiffError(f"tensor {hf_name!r} is not a Llama tensor the GGUF exporter knows")


def export_gguf(
    hf_dir: str | Path,
    out_path: str | Path,
    outtype: str = "F32",
    *,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write ``hf_dir`` as a GGUF file of type ``outtype`` (``F32`` or ``BF16``).

    The file is written to a temporary name next to ``out_path`` and renamed into place.
    """
    import gguf

    outtype = outtype.upper()
    if outtype not in OUTTYPES:
        raise LogitdiffError(f"GGUF export type {outtype!r} is not supported (expected one of {', '.join(OUTTYPES)})")
    hf_dir = Path(hf_dir)
    out_path = Path(out_path)
    if not hf_dir.is_dir():
        raise LogitdiffError(f"{hf_dir}: model directory not found")
    hp = _hparams(hf_dir)
    tk = read_tokenizer(hf_dir, hp["vocab_size"])

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path) as tmp:  # out_path appears whole, or not at all
        w = gguf.GGUFWriter(str(tmp), "llama")
        try:
            _add_hparams(w, hp, outtype, name or hf_dir.resolve().name, len(tk["tokens"]))
            _add_tokenizer(w, tk)
            seen = _add_tensors(w, hf_dir, hp, outtype, progress)
            _check_complete(hf_dir, hp, seen)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        except BaseException:
            try:
                w.close()  # before the temporary is removed
            except Exception:
                pass
            raise
    return out_path


def _add_hparams(w, hp: dict, outtype: str, name: str, n_vocab: int) -> None:
    """The general and hyperparameter keys."""
    import gguf

    file_type = gguf.LlamaFileType.ALL_F32 if outtype == "F32" else gguf.LlamaFileType.MOSTLY_BF16
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(n_vocab)
    w.add_context_length(int(hp["n_ctx"]))
    w.add_embedding_length(hp["n_embd"])
    w.add_block_count(hp["n_layer"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_rope_freq_base(hp["theta"])
    w.add_rope_dimension_count(hp["head_dim"])
    if hp["head_dim"] != hp["n_embd"] // hp["n_head"]:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if hp["rope_type"] == "linear" and hp["rope_factor"]:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(hp["rope_factor"]))


def _add_tokenizer(w, tk: dict) -> None:
    """The tokenizer keys (a GPT-2 style BPE) from :func:`read_tokenizer`'s description."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tk["tokens"])
    w.add_token_types(tk["types"])
    if tk["merges"]:
        w.add_token_merges(tk["merges"])
    sp = tk["special"]
    if "bos" in sp:
        w.add_bos_token_id(sp["bos"])
    if "eos" in sp:
        w.add_eos_token_id(sp["eos"])
    if "pad" in sp:
        w.add_pad_token_id(sp["pad"])
    if "unk" in sp:
        w.add_unk_token_id(sp["unk"])
    w.add_add_bos_token(tk["add_bos"])
    w.add_add_eos_token(False)
    if tk["chat_template"]:
        w.add_chat_template(tk["chat_template"])


def _add_tensors(w, hf_dir: Path, hp: dict, outtype: str, progress: Callable[[str], None] | None) -> set[str]:
    """Every weight of the safetensors files under its GGUF name (Q and K permuted to
    llama.cpp's rotary layout; norms and vectors F32; ``BF16``: BF16 weights copied bit for
    bit, others rounded); returns the names written."""
    import gguf

    qt = gguf.GGMLQuantizationType
    seen: set[str] = set()
    for wf in weight_files(hf_dir):
        for hf_name, dt, arr in _iter_safetensors(wf):
            mapped = _gguf_name(hf_name, hp["n_layer"])
            if mapped is None:
                continue
            gname, _bid = mapped
            if gname == "output.weight" and hp["tied"]:
                continue
            if gname.endswith(".attn_q.weight") or gname.endswith(".attn_q.bias"):
                arr = _permute(arr, hp["n_head"], hp["n_head"])
            elif gname.endswith(".attn_k.weight") or gname.endswith(".attn_k.bias"):
                arr = _permute(arr, hp["n_head"], hp["n_head_kv"])
            if arr.ndim <= 1 or gname.endswith("_norm.weight") or outtype == "F32":
                w.add_tensor(gname, np.ascontiguousarray(_to_f32(dt, arr)), raw_dtype=qt.F32)
            elif dt == "BF16":  # bit-exact copy
                w.add_tensor(gname, np.ascontiguousarray(arr), raw_dtype=qt.BF16)
            else:
                w.add_tensor(gname, gguf.quants.quantize(_to_f32(dt, arr), qt.BF16), raw_dtype=qt.BF16)
            seen.add(gname)
            if progress:
                progress(gname)
    return seen


def _check_complete(hf_dir: Path, hp: dict, seen: set[str]) -> None:
    """Every tensor a Llama GGUF needs was written: one line naming the first missing."""
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in seen]
    if not hp["tied"] and "output.weight" not in seen:
        missing.append("output.weight")
    for b in range(hp["n_layer"]):
        for s in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                  "attn_norm", "ffn_norm"):
            if f"blk.{b}.{s}.weight" not in seen:
                missing.append(f"blk.{b}.{s}.weight")
    if missing:
        raise LogitdiffError(f"{hf_dir}: weights are missing tensors for {missing[0]} ({len(missing)} missing)")
