"""Train the bundled ``builtin:tiny`` model (a small Llama) from data available offline.

    python training/train_tiny.py --out src/logitdiff/builtin/tiny --minutes 40 --seed 0

Build-time code, not part of the installed package (the runtime only loads the weights it
wrote into src/logitdiff/builtin/tiny).

Data: CPython stdlib sources (code), pydoc help topics + stdlib docstrings (prose), and the
seeded synthetic chat / tool-calling tasks of ``training/tasks.py``.  Everything is
seeded; with ``--minutes`` the number of steps is fixed from the measured speed before the
cosine phase starts (warmup is step-based), and TRAINING.md records the equivalent
``--steps N`` command, which repeats the run step for step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import tasks as T  # training/tasks.py: this script's directory is on sys.path when it runs

HERE = Path(__file__).resolve().parents[1] / "src" / "logitdiff" / "builtin"  # what it writes
EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip", "tkinter"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# text data


def stdlib_files(seed: int) -> list[Path]:
    root = T.stdlib_dir()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in EXCLUDE_DIRS for part in rel[:-1]) or rel[-1].startswith("test_"):
            continue
        files.append(p)
    random.Random(seed).shuffle(files)
    return files


def code_texts(seed: int, max_chars: int) -> list[str]:
    out, n = [], 0
    for p in stdlib_files(seed):
        try:
            s = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(s) > 200_000:
            continue
        out.append(s)
        n += len(s)
        if n >= max_chars:
            break
    return out


def prose_texts(code: list[str]) -> list[str]:
    import ast

    out = [v for _, v in sorted(T.prose_topics().items())]
    for src in code:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) > 200:
                    out.append(d)
    return out


# --------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer(out_dir: Path, code: list[str], prose: list[str], seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed + 1)
    chats = []
    for _ in range(3000):
        ex = T.gen_chat(rng, rng.choice(["tool", "tool", "math", "copy", "lookup"]))
        chats.append(T.render_chat(ex["messages"], ex.get("tools"), True) + T.answer_text(ex["expected"]))
    # Digits are removed from the tokenizer corpus so that no merge involves a digit: numbers are
    # tokenized digit by digit, which a tiny model can learn to add and copy.
    strip = str.maketrans("", "", "0123456789")

    def corpus():
        for s in code + prose + chats:
            for sp in T.SPECIAL_TOKENS:
                s = s.replace(sp, "\n")
            yield s.translate(strip)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=T.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # <tool_call> / </tool_call> stay added tokens (matched atomically, ids 3 and 4) but are not
    # flagged "special", so decoding keeps them (as in Qwen2.5; llama.cpp maps them USER_DEFINED).
    d = json.loads(tok.to_str())
    for at in d["added_tokens"]:
        if at["content"] in ("<tool_call>", "</tool_call>"):
            at["special"] = False
    tok = Tokenizer.from_str(json.dumps(d))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = T.CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(out_dir))
    assert len(fast) == vocab_size, len(fast)
    for i, s in enumerate(T.SPECIAL_TOKENS):
        assert fast.convert_tokens_to_ids(s) == i, (s, fast.convert_tokens_to_ids(s))
    assert fast.bos_token is None and fast.eos_token == "<|im_end|>"
    return fast


# --------------------------------------------------------------------------------------------
# batches


class Data:
    def __init__(self, tok, code: list[str], prose: list[str], seed: int, seq_len: int, exclude: set[str], mix: dict,
                 tool_kinds: list[str] | None = None, small_kinds: list[str] | None = None):
        self.tok, self.T, self.exclude, self.mix = tok, seq_len, exclude, mix
        self.tool_kinds = tool_kinds or ["tool", "tool", "tool", "math"]
        self.small_kinds = small_kinds or ["math", "math", "copy", "lookup"]
        eot = tok.convert_tokens_to_ids("<|endoftext|>")
        self.im_end_nl = tok.encode("<|im_end|>\n", add_special_tokens=False)

        def stream(texts):
            ids = []
            enc = tok(texts, add_special_tokens=False)["input_ids"]
            for e in enc:
                ids.extend(e)
                ids.append(eot)
            return ids

        c, p = stream(code), stream(prose)
        hc, hp = len(c) // 20, len(p) // 20
        self.code, self.code_val = c[:-hc], c[-hc:]
        self.prose, self.prose_val = p[:-hp], p[-hp:]
        log(f"tokens: code {len(self.code):,} (+{hc:,} val), prose {len(self.prose):,} (+{hp:,} val)")
        self.rng = random.Random(seed + 2)
        self.skipped = 0
        self._check_fits()

    def _check_fits(self, n: int = 300) -> None:
        # An example longer than a row is never packed (row() skips it), so a seq_len that is
        # too short silently drops e.g. every prompt offering two or three tools. Refuse it.
        saved = self.rng.getstate()
        for kind in sorted(set(self.tool_kinds) | set(self.small_kinds)):
            longest = max(len(self.chat_example(kind)[0]) for _ in range(n))
            if longest > self.T + 1:
                raise SystemExit(
                    f"train_tiny: --seq-len {self.T} is too short for '{kind}' examples "
                    f"(longest of {n} sampled: {longest} tokens); they would never be trained"
                )
        self.rng.setstate(saved)

    def chat_example(self, kind: str) -> tuple[list[int], list[int]]:
        while True:
            ex = T.gen_chat(self.rng, kind)
            if ex["messages"][-1]["content"] not in self.exclude:
                break
            self.skipped += 1
        prefix = self.tok.encode(T.render_chat(ex["messages"], ex.get("tools"), True), add_special_tokens=False)
        ans = self.tok.encode(T.answer_text(ex["expected"]), add_special_tokens=False) + self.im_end_nl
        ids = prefix + ans
        labels = [-100] * len(prefix) + ans[:-1] + [-100]  # loss on the answer and <|im_end|>
        return ids, labels

    def row(self) -> tuple[list[int], list[int]]:
        r = self.rng.random()
        acc = 0.0
        for kind, w in self.mix.items():
            acc += w
            if r < acc:
                break
        if kind in ("code", "prose"):
            src = self.code if kind == "code" else self.prose
            a = self.rng.randrange(len(src) - self.T - 1)
            window = src[a : a + self.T + 1]
            return window[:-1], window[1:]
        # chat row: packed examples; "tool" rows hold tool calls (long prompts), "small" rows the
        # short labelled tasks
        kinds = self.tool_kinds if kind == "tool" else self.small_kinds
        ids: list[int] = []
        labels: list[int] = []
        tries = 0
        while tries < 4:
            e, lab = self.chat_example(self.rng.choice(kinds))
            if len(ids) + len(e) > self.T + 1:
                tries += 1
                continue
            ids += e
            labels += lab
        n = self.T + 1 - len(ids)
        ids += [0] * n
        labels += [-100] * n
        return ids[:-1], labels[1:]

    def batch(self, bs: int):
        import torch

        rows = [self.row() for _ in range(bs)]
        x = torch.tensor([r[0] for r in rows], dtype=torch.long)
        y = torch.tensor([r[1] for r in rows], dtype=torch.long)
        return x, y


# --------------------------------------------------------------------------------------------
# evaluation


def generate_reply(model, tok, item: dict, max_new_tokens: int) -> str:
    import torch

    text = T.render_chat(item["messages"], item.get("tools"), True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=im_end,
            pad_token_id=0,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def check_item(item: dict, reply: str) -> tuple[bool | None, bool | None]:
    """(schema_valid_tool_call or None, correct or None)."""
    import jsonschema

    exp = item.get("expected") or {}
    valid = None
    if "tools" in item:
        call = T.parse_tool_call(reply)
        valid = False
        if call is not None:
            byname = {t["function"]["name"]: t for t in item["tools"]}
            if call["name"] in byname:
                try:
                    jsonschema.validate(call["arguments"], byname[call["name"]]["function"]["parameters"])
                    valid = True
                except jsonschema.ValidationError:
                    pass
    correct = None
    if "answer" in exp:
        correct = reply.strip() == exp["answer"]
    elif "tool_call" in exp:
        call = T.parse_tool_call(reply)
        correct = call is not None and call["name"] == exp["tool_call"]["name"] and call["arguments"] == exp["tool_call"]["arguments"]
    return valid, correct


def evaluate(model, tok, items: list[dict], default_max: int = 48) -> dict:
    res: dict[str, Any] = {"tool_valid": [], "correct": [], "by_kind": {}}
    for it in items:
        if "messages" not in it:
            continue
        reply = generate_reply(model, tok, it, it.get("max_tokens", default_max))
        v, c = check_item(it, reply)
        kind = (it.get("tags") or ["?"])[0]
        if v is not None:
            res["tool_valid"].append(v)
        if c is not None:
            res["correct"].append(c)
            res["by_kind"].setdefault(kind, []).append(c)
    out = {
        "tool_valid": sum(res["tool_valid"]) / max(1, len(res["tool_valid"])),
        "n_tool": len(res["tool_valid"]),
        "labelled_correct": sum(res["correct"]) / max(1, len(res["correct"])),
        "n_labelled": len(res["correct"]),
    }
    for k, v in sorted(res["by_kind"].items()):
        out[f"correct_{k}"] = sum(v) / len(v)
    return out


def val_loss(model, ids: list[int], seq_len: int, n: int = 16) -> float:
    import torch

    losses = []
    with torch.no_grad():
        step = max(1, (len(ids) - seq_len - 1) // n)
        for a in range(0, len(ids) - seq_len - 1, step)[:n]:
            x = torch.tensor([ids[a : a + seq_len]])
            y = torch.tensor([ids[a + 1 : a + seq_len + 1]])
            losses.append(float(_loss(model, x, y)))
    return sum(losses) / len(losses)


def _loss(model, x, y):
    import torch.nn.functional as F

    logits = model(input_ids=x).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "tiny"))
    ap.add_argument("--workload", default=str(HERE / "workload.jsonl"))
    ap.add_argument("--training-md", default=str(HERE / "TRAINING.md"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-time budget (sets --steps from measured speed)")
    ap.add_argument("--steps", type=int, default=None, help="exact number of steps (overrides --minutes)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--code-chars", type=int, default=4_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", default=None, help="continue training from this model dir (same tokenizer)")
    ap.add_argument("--mix", default="0.30,0.15,0.25,0.30", help="row fractions: code,prose,tool,small")
    ap.add_argument("--n-eval", type=int, default=40, help="extra fresh chat items for the final eval")
    ap.add_argument("--tool-kinds", default="tool,tool,tool,math", help="task kinds drawn (uniformly) for packed tool rows")
    ap.add_argument("--small-kinds", default="math,math,copy,lookup", help="task kinds drawn (uniformly) for packed short-task rows")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate (bf16) on the workload every N steps and keep the best weights")
    ap.add_argument("--stop-at", default=None, help="wall-clock HH:MM (local time) after which training stops (best weights kept)")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # workload first: its chat prompts are held out from training
    workload = T.write_workload(args.workload)
    exclude = {it["messages"][-1]["content"] for it in workload if "messages" in it}
    eval_rng = random.Random(T.WORKLOAD_SEED + 1)
    extra: list[dict] = []
    while len(extra) < args.n_eval:
        kind = ["math", "tool", "copy", "lookup"][len(extra) % 4]
        ex = T.gen_chat(eval_rng, kind)
        ex["messages"] = [m for m in ex["messages"] if m["role"] != "system"]
        if ex["messages"][-1]["content"] in exclude:
            continue
        exclude.add(ex["messages"][-1]["content"])
        extra.append({**ex, "tags": [kind], "max_tokens": {"math": 8, "tool": 48, "copy": 24, "lookup": 8}[kind]})
    log(f"workload: {len(workload)} items -> {args.workload}; {len(exclude)} chat prompts held out")

    code = code_texts(args.seed, args.code_chars)
    prose = prose_texts(code)
    log(f"text: {len(code)} stdlib files ({sum(map(len, code)):,} chars), {len(prose)} prose docs ({sum(map(len, prose)):,} chars)")
    previous_md = ""
    if args.init_from:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.init_from)
        if Path(args.training_md).exists():
            previous_md = Path(args.training_md).read_text(encoding="utf-8")
    else:
        tok = build_tokenizer(out, code, prose, args.seed, args.vocab)
    log(f"tokenizer: {len(tok)} tokens")
    # the jinja template and the Python renderer must agree
    for it in workload[-30:]:
        if "messages" in it:
            a = tok.apply_chat_template(it["messages"], tools=it.get("tools"), tokenize=False, add_generation_prompt=True)
            assert a == T.render_chat(it["messages"], it.get("tools"), True), (a,)
    for it in workload:
        if "expected" in it:
            n = len(tok.encode(T.answer_text(it["expected"]), add_special_tokens=False)) + 1
            assert n <= it["max_tokens"], (it["id"], n)

    mix = dict(zip(["code", "prose", "tool", "small"], map(float, args.mix.split(","))))
    data = Data(tok, code, prose, args.seed + (1000 if args.init_from else 0), args.seq_len, exclude, mix,
                args.tool_kinds.split(","), args.small_kinds.split(","))

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=0,
        initializer_range=0.02,
    )
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        cfg = model.config
    else:
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {n_params:,} params")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    total = args.steps
    budget = args.minutes * 60.0
    t_train = time.time()
    ema = None
    step = 0
    probe = max(5, args.warmup - 5)  # steps timed before --minutes sets --steps
    stop_at = None
    if args.stop_at:
        hh, mm = map(int, args.stop_at.split(":"))
        lt = time.localtime()
        stop_at = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, hh, mm, 0, 0, 0, -1))
    best = None  # (score, step, state_dict, eval)

    def score_of(ev):
        meets = ev["tool_valid"] >= 0.9 and ev["labelled_correct"] >= 0.5
        return (meets, ev["labelled_correct"] + 0.5 * ev["tool_valid"])

    def eval_now(step):
        nonlocal best
        import copy

        m16 = copy.deepcopy(model).to(torch.bfloat16)
        m16.eval()
        t0 = time.time()
        ev = evaluate(m16, tok, workload)
        sc = score_of(ev)
        better = best is None or sc > best[0]
        log(f"eval @ step {step} ({time.time() - t0:.0f}s): {ev}{' (best so far)' if better else ''}")
        if better:
            best = (sc, step, {k: v.detach().clone() for k, v in model.state_dict().items()}, ev)
        del m16

    while True:
        if total is None and step == probe:
            el = time.time() - t_train
            rate = el / probe
            total = max(args.warmup + 10, int((budget - (time.time() - t_start) + el) / rate))
            log(f"measured {rate:.2f} s/step -> --steps {total}")
        if total is not None and step >= total:
            break
        if stop_at is not None and time.time() >= stop_at:
            log(f"stopping at step {step}: --stop-at {args.stop_at} reached")
            break
        if total is not None and args.steps is None and time.time() - t_train > budget * 1.25:
            log(f"stopping early at step {step}: over the time budget")
            break
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            prog = (step - args.warmup) / max(1, (total or 1) - args.warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(args.batch)
        model.train()
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        step += 1
        if step % 10 == 0 or step == 1:
            log(f"step {step}/{total or '?'} loss {lv:.3f} ema {ema:.3f} lr {lr:.2e} ({time.time() - t_train:.0f}s)")
        if args.eval_every and step % args.eval_every == 0:
            eval_now(step)
    train_s = time.time() - t_train
    steps_done = step
    best_note = ""
    if args.eval_every:
        if step % args.eval_every != 0:
            eval_now(step)
        if best is not None and best[1] != step:
            model.load_state_dict(best[2])
            log(f"restored best weights from step {best[1]}")
        if best is not None:
            best_note = f"best workload eval at step {best[1]} of {step} (evaluated every {args.eval_every} steps; those weights are saved)"

    model.eval()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=cfg.eos_token_id, pad_token_id=0, bos_token_id=None, do_sample=False, max_new_tokens=48
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    log(f"saved -> {out}")

    vl = {"code": val_loss(model, data.code_val, args.seq_len), "prose": val_loss(model, data.prose_val, args.seq_len)}
    # the bf16 eval of the saved weights was already done during training when --eval-every is set
    ev_w = best[3] if args.eval_every and best is not None else evaluate(model, tok, workload)
    ev_x = evaluate(model, tok, extra)
    log(f"val loss (bf16): {vl}")
    log(f"workload eval (bf16): {ev_w}")
    log(f"fresh eval (bf16, {len(extra)} items): {ev_x}")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    total_mb = sum(sizes.values()) / 1e6

    cmd_used = "python training/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv)
    repro = (
        f"python training/train_tiny.py --out {args.out} --seed {args.seed} --steps {steps_done}"
        + "".join(
            f" --{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("init_from", "mix", "tool_kinds", "small_kinds", "eval_every", "minutes", "layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq_len", "batch", "lr", "warmup", "code_chars")
            and v != ap.get_default(k)
        )
    )
    md = f"""# builtin:tiny - training record

Written by `training/train_tiny.py` at the end of the run.

* Command run: `{cmd_used}` (from the repository root)
* Step-exact reproduction: `{repro}`
* Torch {torch.__version__}, {args.threads} CPU threads, seed {args.seed}, fp32 training, saved in bfloat16.
* Wall time: {train_s / 60:.1f} min training ({steps_done} steps x {args.batch} x {args.seq_len} tokens), {(time.time() - t_start) / 60:.1f} min in all.
* Model: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, FFN {args.ffn}, {args.heads} heads (head_dim {args.hidden // args.heads}), {args.kv_heads} KV heads, vocab {len(tok)}, untied embeddings; **{n_params:,} parameters**.
* Tokenizer: byte-level BPE (ByteLevel pre-tokenizer, add_prefix_space=False, no normalizer), {len(tok)} tokens incl. `<|endoftext|>`=0 (pad), `<|im_start|>`=1, `<|im_end|>`=2 (eos), `<tool_call>`=3, `</tool_call>`=4; no BOS. Digits were removed from the tokenizer's training text, so numbers are tokenized one digit per token.
* Data mix (rows of {args.seq_len} tokens): {int(mix['code'] * 100)} % stdlib code, {int(mix['prose'] * 100)} % prose (pydoc topics + stdlib docstrings), {int(mix['tool'] * 100)} % packed tool-call chats, {int(mix['small'] * 100)} % packed short chats (arithmetic, copy, lookup); loss on the assistant replies only. 5 % of each text stream held out.
* Optimizer: AdamW (betas 0.9/0.95, wd 0.1), peak LR {args.lr}, {args.warmup} warmup steps, cosine to 10 %, grad clip 1.0.
* Final training loss (EMA): {ema:.3f}
* Held-out loss (bf16, nats/token): code {vl['code']:.3f}, prose {vl['prose']:.3f}
* Bundled workload (`workload.jsonl`, {len(workload)} items), greedy, bf16: tool-call schema-valid {ev_w['tool_valid']:.0%} of {ev_w['n_tool']}, labelled correct {ev_w['labelled_correct']:.0%} of {ev_w['n_labelled']} ({', '.join(f'{k[8:]} {v:.0%}' for k, v in ev_w.items() if k.startswith('correct_'))})
* Fresh held-out chat items ({len(extra)}), greedy, bf16: tool-call schema-valid {ev_x['tool_valid']:.0%}, labelled correct {ev_x['labelled_correct']:.0%} ({', '.join(f'{k[8:]} {v:.0%}' for k, v in ev_x.items() if k.startswith('correct_'))})
* Data mix used: {args.mix} (code, prose, tool rows, short-task rows); tool rows draw {args.tool_kinds}, short-task rows draw {args.small_kinds}{"; " + best_note if best_note else ""}{f"; continued from `{args.init_from}` (the earlier phase below)" if args.init_from else ""}
* Files: {', '.join(f'{k} {v / 1e6:.2f} MB' for k, v in sizes.items())}; total {total_mb:.2f} MB
"""
    if previous_md:
        md += "\n## Earlier phase (the starting point of this run)\n\n" + previous_md.split("\n", 1)[1]
    Path(args.training_md).write_text(md, encoding="utf-8")
    log(f"wrote {args.training_md}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
