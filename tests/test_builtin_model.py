"""The bundled ``builtin:tiny`` model: real, small, trained, and good enough at its own tasks.

Loads ``src/logitdiff/builtin/tiny`` with transformers in bfloat16 on CPU and generates greedily
for the bundled workload's chat items.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _tasks import parse_tool_call as _parse_tool_call

BUILTIN = Path(__file__).resolve().parents[1] / "src" / "logitdiff" / "builtin"
MODEL_DIR = BUILTIN / "tiny"
WORKLOAD = BUILTIN / "workload.jsonl"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="builtin tiny model not built")


def _items() -> list[dict]:
    from logitdiff.workload import read_workload

    return [it.to_json() for it in read_workload(WORKLOAD)]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    # One thread: the model is tiny, and spinning intra-op threads are 10-50x slower on a busy box.
    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.bfloat16)
    m.eval()
    return m


# ---------------------------------------------------------------------------------------------
# fast checks


def test_workload_is_valid():
    items = _items()
    assert len(items) >= 48
    tags = [t for it in items for t in it.get("tags", [])]
    for t in ("code", "prose", "math", "tool"):
        assert tags.count(t) >= 8, t
    for it in items:
        assert it.get("max_tokens", 1) <= 48
        if "tool" in it.get("tags", []):
            assert it["tools"] and "tool_call" in it["expected"]
            names = {t["function"]["name"] for t in it["tools"]}
            assert it["expected"]["tool_call"]["name"] in names


def test_size_and_config(tok):
    from transformers import AutoConfig

    files = [p for p in MODEL_DIR.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= 25 * 1024 * 1024, total
    cfg = AutoConfig.from_pretrained(str(MODEL_DIR))
    assert cfg.model_type == "llama"
    assert cfg.hidden_size % 256 == 0 and cfg.intermediate_size % 256 == 0
    assert cfg.vocab_size % 256 == 0 and cfg.vocab_size == len(tok)
    assert str(cfg.dtype).endswith("bfloat16")
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            assert t.get_dtype() == "BF16", k
            shape = t.get_shape()
            if len(shape) == 2:
                assert shape[-1] % 256 == 0, (k, shape)


def test_tokenizer_specials(tok):
    for i, s in enumerate(SPECIAL):
        assert tok.convert_tokens_to_ids(s) == i, s
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    ids = tok.encode("x = 1", add_special_tokens=True)
    assert tok.decode(ids) == "x = 1"
    s = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=True) == s
    from transformers import GenerationConfig

    gc = GenerationConfig.from_pretrained(str(MODEL_DIR))
    assert gc.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("env_opts", [{}, {"trim_blocks": True, "lstrip_blocks": True}])
def test_chat_template_plain_jinja_matches_tokenizer(tok, env_opts):
    import jinja2

    template = tok.chat_template
    assert isinstance(template, str) and template
    env = jinja2.Environment(**env_opts)
    t = env.from_string(template)
    chats = [it for it in _items() if "messages" in it]
    chats.append(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "Weather in Oslo?"},
            ],
            "tools": chats[-1].get("tools") or next(c["tools"] for c in chats if c.get("tools")),
        }
    )
    n_tools = 0
    for it in chats:
        for agp in (True, False):
            a = t.render(messages=it["messages"], tools=it.get("tools"), add_generation_prompt=agp)
            b = tok.apply_chat_template(it["messages"], tools=it.get("tools"), tokenize=False, add_generation_prompt=agp)
            assert a == b
        if it.get("tools"):
            n_tools += 1
            assert '<tool_call>{"name": ' in a
            for tool in it["tools"]:
                assert json.dumps(tool) + "\n" in a
        assert a.endswith("<|im_end|>\n")
    assert n_tools >= 8
    out = t.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# the model itself


def _generate(model, tok, item: dict) -> str:
    import torch

    ids = tok.apply_chat_template(item["messages"], tools=item.get("tools"), add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=item.get("max_tokens", 48),
            do_sample=False,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.pad_token_id,
        )
    return tok.decode(out[0, x.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def graded(model, tok):
    """(schema-valid tool calls, tool items, correct answers, labelled items, replies) at BF16."""
    import jsonschema

    items = [it for it in _items() if "messages" in it and ("tools" in it or "expected" in it)]
    tool_items = [it for it in items if it.get("tools")]
    labelled = [it for it in items if it.get("expected")]
    assert len(tool_items) >= 8 and len(labelled) >= 16
    replies = {it["id"]: _generate(model, tok, it) for it in items}

    valid = 0
    for it in tool_items:
        call = _parse_tool_call(replies[it["id"]])
        if call is None:
            continue
        byname = {t["function"]["name"]: t["function"] for t in it["tools"]}
        if call["name"] not in byname:
            continue
        try:
            jsonschema.validate(call["arguments"], byname[call["name"]]["parameters"])
        except jsonschema.ValidationError:
            continue
        valid += 1

    correct = 0
    for it in labelled:
        exp, reply = it["expected"], replies[it["id"]]
        if "answer" in exp:
            correct += reply.strip() == exp["answer"]
        elif "tool_call" in exp:
            call = _parse_tool_call(reply)
            correct += bool(
                call and call["name"] == exp["tool_call"]["name"] and call["arguments"] == exp["tool_call"]["arguments"]
            )
    return valid, len(tool_items), correct, len(labelled), replies


def test_bf16_meets_issue_targets(graded):
    """A schema-valid tool call on >= 90 % of the bundled tool prompts and a correct
    answer on >= 50 % of the labelled prompts, greedy at BF16."""
    valid, n_tool, correct, n_lab, replies = graded
    detail = "\n".join(f"{k}: {v!r}" for k, v in replies.items())
    assert valid >= 0.9 * n_tool, f"schema-valid tool calls {valid}/{n_tool}\n{detail}"
    assert correct >= 0.5 * n_lab, f"correct {correct}/{n_lab}\n{detail}"


def test_bf16_answers_and_tool_format(graded):
    """What the committed model (phase 8) reaches, as a regression guard above the issue's
    targets: at BF16 it answered 38/40 labelled prompts and made 12/12 schema-valid calls."""
    valid, n_tool, correct, n_lab, _ = graded
    assert correct >= 0.85 * n_lab, f"correct answers {correct}/{n_lab}"
    assert valid == n_tool, f"schema-valid tool calls {valid}/{n_tool}"


def test_bf16_text_continuation_is_not_garbage(model, tok):
    """Raw code/prose prompts: the model's mean loss on them is well below uniform (ln V)."""
    import math

    import torch

    items = [it for it in _items() if "prompt" in it]
    losses = []
    for it in items:
        ids = torch.tensor([tok.encode(it["prompt"], add_special_tokens=False)])
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    mean = sum(losses) / len(losses)
    assert mean < 0.7 * math.log(len(tok)), (mean, losses)


def test_training_refuses_rows_too_short_for_its_examples(tok):
    """A --seq-len shorter than an example means row packing skips that example forever
    (phases 4-7 never saw a prompt offering two or three tools); train_tiny refuses it."""
    from _tasks import training_module

    TT = training_module("train_tiny")

    mix = {"code": 0.0, "prose": 0.0, "tool": 1.0, "small": 0.0}
    text = ["def f(x):\n    return x + 1\n" * 200]
    with pytest.raises(SystemExit, match="--seq-len 256 is too short for 'tool' examples"):
        TT.Data(tok, text, text, 0, 256, set(), mix, ["tool"], ["math"])
    data = TT.Data(tok, text, text, 0, 512, set(), mix, ["tool"], ["math"])
    ids, labels = data.row()
    assert len(ids) == len(labels) == 512
    assert any(l != -100 for l in labels)  # an answer is trained in every chat row
