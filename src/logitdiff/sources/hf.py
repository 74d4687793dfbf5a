"""The transformers backend: a local HF model directory as a source of logits.

Spec: ``hf:PATH[,dtype=bfloat16|float16|float32][,device=cpu|cuda][,threads=N]...`` (every option, its type
and default: :data:`logitdiff.sources.options.OPTIONS`)

``PATH`` is a model directory, or a GGUF file (``hf:model.gguf``, or ``hf:DIR,gguf_file=NAME.gguf``):
transformers loads its weights dequantized, so a model distributed only as GGUF gets a
transformers reference in one spec. Its prompts are tokenized by llama.cpp's tokenizer of the
same file (opened vocab only): transformers' conversion of a GGUF tokenizer can split text
differently (``identity()["tokenizer"]`` says which tokenizer encoded). A GGUF's dtype
defaults to bfloat16; ``identity()`` records the file's sha256 and the quantization it was
dequantized from (``gguf_file_type`` and the tensor types it holds).

* ``dtype``   defaults to the dtype in ``config.json`` (``dtype``/``torch_dtype``), else bfloat16:
              the reference is the model as its authors shipped it.
* ``device``  ``cpu`` (default) or ``cuda``; asking for cuda without one is an error, never a
              silent fallback (the numbers would differ).
* ``threads`` the torch intra-op threads wanted (``source.threads``). torch has no per-model
              knob and opening a source changes nothing process-wide, so the program's entry
              point applies it (:func:`logitdiff.sources.requested_threads`).
* ``batch``   sequences per forward pass, in generation (left padding) and in teacher-forced
              scoring (right padding) alike (default 8).
* ``prefill`` tokens per forward pass when scoring a sequence longer than that (default 2048):
              long outputs are prefilled in windows over a KV cache, so memory does not grow
              with the output's length.

Why the code looks the way it does:

* **One logits path.** ``generate`` and ``score`` both run the base model (``model.model``) to
  hidden states and apply ``lm_head`` themselves (:meth:`HFSource._head`). The argmax that
  greedy decoding takes is taken on exactly the float32 rows we return, and teacher-forced
  scoring of a generation reproduces its logits. We do not call ``model.generate``: its logits
  processors and cache/padding choices are not ours to audit.
* **Only output positions hit the lm_head, a block at a time.** Scoring gathers the hidden states
  at the selected output positions (``len(prompt)-1+t``) and projects them onto the vocabulary in
  blocks of a chunk's bytes (:meth:`HFSource.score_blocks`), so no ``[T, V]`` tensor exists;
  generation keeps token ids only.
* **Native dtype out.** A bf16 (or f16) model without logit post-processing hands out its
  logits as they are (bf16 as uint16 bits, ``logits_dtype``), so a RUN stores 2 bytes per entry.
* **Padded vocabularies.** Many checkpoints pad the output layer beyond the tokenizer
  (``config.vocab_size > len(tokenizer)``, e.g. to a multiple of 64). Those rows are no token
  at all; we drop output rows with ids ``>= len(tokenizer)`` *before* anything takes a softmax,
  so ``vocab_size == len(tokenizer)`` and distributions are comparable with backends (GGUF)
  that only know real tokens. ``identity()["padded_logits"]`` says so when it happens.
* **Batching with right padding.** Padding sits after the real tokens, so with the attention
  mask every real position sees exactly the keys it sees unbatched and keeps its default
  position id; results match unbatched scoring to float rounding.
* **Rendering.** A raw ``prompt`` is encoded with ``add_special_tokens=False`` (no BOS is
  added behind the workload's back); ``messages`` go through the tokenizer's chat template
  as text and are then encoded the same way, so a BOS appears only if the template writes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, cast

import numpy as np

from ..errors import LogitdiffError
from ..store import bf16_to_f32 as _bits_to_f32
from .base import Block, FullLogitSource, Generation, Spec, tokenizer_hash_of
from .chat_template import render_bounded
from ..store.filecache import file_sha256_cached
from .options import parse_options

if TYPE_CHECKING:
    from ..store.rowpool import RowPool

_DTYPES = ("bfloat16", "float16", "float32")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _config_dtype(cfg: Any) -> str | None:
    """The dtype a config declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    for attr in ("dtype", "torch_dtype"):
        d = cfg.__dict__.get(attr)
        if d is not None:
            name = str(d).replace("torch.", "")
            return name if name in _DTYPES else None
    return None


class HFSource(FullLogitSource):
    """A local transformers checkpoint. Rows have ``len(tokenizer)`` columns (padded output
    rows of the lm_head, ids ``>= len(tokenizer)``, are dropped before any softmax)."""

    batch: int  # always set (Source.batch: None for sources that do not batch)
    engine = "transformers"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        threads: int | None = None,
        batch: int = 8,
        prefill: int = 2048,
        spec: str | None = None,
        gguf_file: str | None = None,
        tokenizer_only: bool = False,
    ):
        """``tokenizer_only``: the config and tokenizer alone, no weights: the source renders
        and tokenizes, and nothing else (a preflight's open)."""
        import torch

        self.spec = spec or f"hf:{path}"
        where = self._locate(Path(path).expanduser(), gguf_file)
        if dtype is not None and dtype not in _DTYPES:
            raise LogitdiffError(f"{self.spec}: unknown dtype {dtype!r} (expected one of {', '.join(_DTYPES)})")
        if device not in ("cpu", "cuda"):
            raise LogitdiffError(f"{self.spec}: unknown device {device!r} (expected cpu or cuda)")
        if device == "cuda" and not torch.cuda.is_available():
            raise LogitdiffError(f"{self.spec}: device=cuda asked for but torch sees no CUDA device")
        self.threads = int(threads) if threads else None  # applied by the entry point, not here
        self.batch = batch
        self.prefill = prefill
        self.device = torch.device(device)
        # a GGUF's layout is checked before transformers builds a model from its header (a
        # block_count of 1000 would build 1000 layers); the one read also gives identity()
        # what the weights were dequantized from
        self._origin = _checked_gguf_origin(where) if self.gguf_file and not tokenizer_only else {}
        cfg = self._load(where, dtype, tokenizer_only)
        if tokenizer_only:
            self.max_positions = getattr(cfg, "max_position_embeddings", None)
            self.vocab_size = len(self.tok)
            return
        self._adopt_model()

    def _locate(self, path: Path, gguf_file: str | None) -> Path:
        """Set ``path`` (the directory) and ``gguf_file``; the file or directory the weights
        come from, checked to exist and be of its kind."""
        self.path = path
        if gguf_file is None and path.suffix.lower() == ".gguf":
            self.path, gguf_file = path.parent, path.name
        self.gguf_file = gguf_file
        where = self.path / gguf_file if gguf_file else self.path
        if not where.exists():
            raise LogitdiffError(f"{where}: model path not found")
        if gguf_file:
            if not where.is_file():
                raise LogitdiffError(f"{where}: not a GGUF file")
        elif not self.path.is_dir() or not (self.path / "config.json").is_file():
            raise LogitdiffError(f"{self.path}: not a transformers model directory (no config.json)")
        return where

    def _load(self, where: Path, dtype: str | None, tokenizer_only: bool) -> Any:
        """Config, weights (unless ``tokenizer_only``) and tokenizer; the config. A model whose
        weight files do not cover its config is refused (:func:`_check_weights_cover`)."""
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        load = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        try:
            if self.gguf_file:  # converted from the file's metadata, once per version (_converted_gguf)
                cfg, self.tok = _converted_gguf(where)
                self.render_identity = _gguf_render_identity(where)
            else:
                cfg = AutoConfig.from_pretrained(str(self.path))
            # a GGUF's weights are dequantized: bf16 unless asked (its config's dtype says nothing)
            self.dtype_name = dtype or (None if self.gguf_file else _config_dtype(cfg)) or "bfloat16"
            self.torch_dtype = getattr(torch, self.dtype_name)
            # transformers >= 4.56 renamed ``torch_dtype`` to ``dtype`` (5.x warns on the old name).
            major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
            dkw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
            if not tokenizer_only:
                # mismatched sizes are listed in ``info`` (and refused there, by name) rather
                # than raised as a message that points at a log line
                self.model, info = AutoModelForCausalLM.from_pretrained(
                    str(self.path), **{dkw: self.torch_dtype}, output_loading_info=True, ignore_mismatched_sizes=True, **load)
                _check_weights_cover(where, info)
            if not self.gguf_file:
                self.tok = AutoTokenizer.from_pretrained(str(self.path))
            # A GGUF is the authority on its own tokenizer: transformers' GGUF conversion
            # rebuilds it and can split text differently (SmolLM2's ``tokenizer.ggml.pre =
            # smollm`` isolates each digit; transformers 5.x has no split for it and falls back
            # to GPT-2's regex, so "\n    0.75" became ['ĊĠĠĠ','Ġ','0'] instead of llama.cpp's
            # ['ĊĠĠĠĠ','0']). Prompts are therefore tokenized by llama.cpp on the same file,
            # vocab only (no weights: ~0.3 s), exactly as ``gguf:FILE`` tokenizes them; a
            # tokenizer-only open loads it on the first render (_llama_vocab).
            self._vocab = _gguf_vocab(where) if self.gguf_file and not tokenizer_only else None
        except LogitdiffError:
            raise
        except Exception as e:  # transformers raises many types; the user needs one line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LogitdiffError(f"{where}: cannot load model/tokenizer ({type(e).__name__}: {msg})") from None
        return cfg

    def _adopt_model(self) -> None:
        """The loaded model's parts and facts: the decoder stack and the head, the vocabulary
        (padded head rows dropped), the end-of-sequence ids, the stored logits' dtype."""
        self.model.to(self.device).eval()
        self.config = self.model.config
        # the decoder stack without the lm_head: ``model.model`` for Llama-likes
        self.base = self.model.model if hasattr(self.model, "model") else self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()

        n_tok = len(self.tok)
        self.out_rows = int(self.lm_head.weight.shape[0])
        self.vocab_size = min(n_tok, self.out_rows)
        self.padded = self.out_rows - self.vocab_size
        self.tokenizer_tokens = self._tokens(n_tok)
        # not cached: ~25 ms at V = 248,320, and it keys the cached token texts (below)
        self.tokenizer_hash = tokenizer_hash_of(self.tokenizer_tokens)
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

        eos: list[int] = []
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for tid in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])) + [self.tok.eos_token_id]:
            if isinstance(tid, int) and tid not in eos:
                eos.append(tid)
        self.eos_token_ids = tuple(eos)
        cfg = self.config
        self._postprocessed = bool(
            (getattr(cfg, "logit_scale", None) is not None and str(getattr(cfg, "model_type", "")).startswith("cohere"))
            or getattr(cfg, "logits_scaling", None)
            or getattr(cfg, "final_logit_softcapping", None)
        )
        # What the head hands out and a RUN stores: the model's own 16-bit dtype when the
        # logits are the head's output unchanged, float32 after any post-processing.
        self.logits_dtype = self.dtype_name if self.dtype_name in ("bfloat16", "float16") and not self._postprocessed else "float32"
        self._identity: dict | None = None

    @classmethod
    def from_spec(cls, spec: Spec) -> "HFSource":
        o = parse_options(spec, "hf")  # the declared options (sources/options.py), checked
        if not spec.target:
            raise LogitdiffError(f"source spec {spec.text!r}: hf: needs a model directory path")
        return cls(spec.target, dtype=o["dtype"], device=o["device"], threads=o["threads"], batch=o["batch"],
                   prefill=o["prefill"], spec=spec.text, gguf_file=o["gguf_file"])

    @classmethod
    def tokenizer_from_spec(cls, spec: Spec) -> "HFSource":
        """The spec's source opened ``tokenizer_only`` (options checked as for a full open)."""
        o = parse_options(spec, "hf")
        if not spec.target:
            raise LogitdiffError(f"source spec {spec.text!r}: hf: needs a model directory path")
        return cls(spec.target, dtype=o["dtype"], device="cpu", batch=o["batch"], prefill=o["prefill"],
                   spec=spec.text, gguf_file=o["gguf_file"], tokenizer_only=True)

    # --- tokenization -------------------------------------------------------------
    def render(self, item: Any) -> list[int]:
        if item.messages is not None:
            try:
                text = render_bounded(lambda: self.tok.apply_chat_template(
                    item.messages, tools=item.tools, add_generation_prompt=True, tokenize=False
                ), f"item {item.id!r}: {self.spec}")
            except LogitdiffError:
                raise
            except Exception as e:
                raise LogitdiffError(
                    f"item {item.id!r}: chat template of {self.path} failed ({type(e).__name__}: {e})".splitlines()[0]
                ) from None
            if not isinstance(text, str):  # some versions/templates hand back a list or a dict
                text = text["text"] if isinstance(text, dict) else "".join(text)
        else:
            text = item.prompt
        if self.gguf_file:  # as GGUFSource._tokenize: no BOS, special tokens matched
            ids = self._llama_vocab().tokenize(text.encode("utf-8"), add_bos=False, special=True)
        else:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        ids = [int(i) for i in ids]
        if not ids:
            raise LogitdiffError(f"item {item.id!r}: prompt renders to zero tokens with {self.path}")
        if self.max_positions and len(ids) > self.max_positions:
            raise LogitdiffError(
                f"item {item.id!r}: prompt is {len(ids)} tokens, longer than max_position_embeddings="
                f"{self.max_positions} of {self.path}"
            )
        return ids

    def _llama_vocab(self):
        """llama.cpp's vocabulary of the GGUF, loaded at a full open or on first use."""
        if self._vocab is None:
            where = self.path / cast(str, self.gguf_file)
            try:
                self._vocab = _gguf_vocab(where)
            except (ValueError, RuntimeError) as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise LogitdiffError(f"{where}: llama.cpp could not load the vocabulary ({msg})") from None
        return self._vocab

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _tokens(self, n_tok: int) -> list[str | None]:
        """``convert_ids_to_tokens`` of every id (a Python call per id: ~0.2 s at V = 248,320,
        a fifth of a capture's fixed cost), kept per version of every file the tokenizer can
        come from (filecache.py): the GGUF; or in a model directory the tokenizer files by
        content and every other file by its identity (a tokenizer in a file
        _TOKENIZER_FILES does not name is covered; a weight file is not read for this), and
        the library versions. A cached value that is not ``n_tok`` strings or None is
        computed again."""
        import tokenizers
        import transformers

        from ..store.filecache import cached_json, file_identity

        if self.gguf_file:
            files, others = [self.path / self.gguf_file], []
        else:
            every = sorted(p for p in self.path.iterdir() if p.is_file())
            files = [p for p in every if p.name in _TOKENIZER_FILES]
            others = [file_identity(p) for p in every if p.name not in _TOKENIZER_FILES]
        versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "n_tok": n_tok,
                    "class": type(self.tok).__name__, "others": others}

        def compute() -> list[str | None]:
            return list(self.tok.convert_ids_to_tokens(list(range(n_tok))))

        got = cached_json("hf.tokenizer_tokens", files, versions, compute)
        if not (isinstance(got, list) and len(got) == n_tok and all(t is None or type(t) is str for t in got)):
            return compute()
        return got

    def _cached(self, name: str, compute):
        """A fact of the tokenizer, computed once per version of its files (filecache.py)."""
        import tokenizers
        import transformers

        from ..store.filecache import cached_json

        # a GGUF holds its tokenizer: the file is the key (the directory may hold several).
        # The token strings' hash is in the key too: a tokenizer held in files not named in
        # _TOKENIZER_FILES (vocab.txt, *.tiktoken...) must not share another model's entry.
        files = [self.path / self.gguf_file] if self.gguf_file else [self.path / n for n in _TOKENIZER_FILES]
        return cached_json(f"hf.{name}", files,
                           {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                            "n_tok": len(self.tok), "vocab_size": self.vocab_size,
                            "tokenizer_hash": self.tokenizer_hash}, compute)

    def token_texts(self) -> list[str]:
        """``token_text`` of every id: one parallel decode in the Rust tokenizer (not V
        Python calls), kept per version of the tokenizer's files (filecache.py)."""
        if self._token_texts is None or len(self._token_texts) != self.vocab_size:
            got = self._cached("token_texts", self._all_token_texts)
            ok = isinstance(got, list) and len(got) == self.vocab_size and all(type(t) is str for t in got)
            self._token_texts = got if ok else self._all_token_texts()  # a damaged cache entry: computed again
        return self._token_texts

    def _all_token_texts(self) -> list[str]:
        n = self.vocab_size
        fast = getattr(self.tok, "backend_tokenizer", None)
        if fast is None:
            return [self.token_text(i) for i in range(n)]
        texts = fast.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        bad = [i for i, t in enumerate(texts) if "\ufffd" in t]  # as token_text: the raw token string
        for i, raw in zip(bad, self.tok.convert_ids_to_tokens(bad)):
            if raw is not None:
                texts[i] = raw
        return texts

    def token_text(self, token_id: int) -> str:
        """Decoded text; a byte-level fragment of a multi-byte character (which decodes to
        U+FFFD) falls back to the raw token string so reports can tell tokens apart."""
        s = self.detokenize([token_id])
        if "\ufffd" in s:
            raw = self.tok.convert_ids_to_tokens(int(token_id))
            if raw is not None:
                return raw
        return s

    # --- model --------------------------------------------------------------------
    def _head(self, hidden):
        """Hidden states ``[N, H]`` -> logits ``[N, vocab_size]``: float32, or the model's
        own dtype when that is what ``logits_dtype`` says is stored (no post-processing).

        Mirrors what ``*ForCausalLM.forward`` does after the decoder for the architectures
        that post-process logits (Cohere ``logit_scale``, Granite ``logits_scaling``, Gemma 2/3
        ``final_logit_softcapping``); padded rows are dropped first."""
        import torch

        logits = self.lm_head(hidden)[..., : self.vocab_size]
        if not self._postprocessed:
            return logits
        logits = logits.float()
        cfg = self.config
        if getattr(cfg, "logit_scale", None) is not None and cfg.model_type.startswith("cohere"):
            logits = logits * cfg.logit_scale
        if getattr(cfg, "logits_scaling", None):
            logits = logits / cfg.logits_scaling
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _rows_are_head_output(self) -> bool:
        """Whether the stored rows are the head's 16-bit output unchanged: no post-processing,
        no bias, the head's own dtype (what a hidden-state store and the pooled rows need)."""
        import torch

        w = self.lm_head.weight
        return (self.logits_dtype in ("bfloat16", "float16") and w.dtype == getattr(torch, self.logits_dtype)
                and getattr(self.lm_head, "bias", None) is None)

    def output_head(self) -> np.ndarray | None:
        """The head's weight rows of the vocabulary (bf16 or float16 bits) when the logits
        are the head's 16-bit output unchanged: no post-processing, no bias."""
        import torch

        if not self._rows_are_head_output():
            return None
        return self.lm_head.weight[: self.vocab_size].detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16)

    def _stored(self, logits):
        """The head's rows in the stored dtype (``logits_dtype``), converted where they are
        (on the device: a block leaves it once, at 2 bytes per entry for a 16-bit model)."""
        import torch

        return logits.to({"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.logits_dtype, torch.float32)).contiguous()

    def _launch(self, k: int, t0: int, hb, with_hidden: bool, pool: RowPool | None = None):
        """Block ``t0..`` of pair ``k`` from its hidden states ``hb``: on the CPU a finished
        :class:`Block`; on CUDA the head's rows (and hidden states) on their way to pinned host
        memory without waiting, with the event that says they arrived (:meth:`_landed`)."""
        import torch

        # hidden states as the head's 16-bit bits (what a hidden-state store keeps)
        hid = hb.detach().to(self.lm_head.weight.dtype).contiguous().view(torch.int16) if with_hidden else None
        if self.device.type != "cuda":
            pooled = self._head_pooled(hb, pool) if pool is not None else None
            rows = pooled if pooled is not None else _host_array(self._stored(self._head(hb)))
            return Block(k, t0, rows, _host_array(hid) if hid is not None else None), None
        rows = self._stored(self._head(hb))
        out: list[Any] = []  # pinned host tensors (None: no hidden states asked for)
        for t in (rows, hid):
            if t is None:
                out.append(None)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        ev = torch.cuda.Event()
        ev.record()
        return (k, t0, *out), ev

    @staticmethod
    def _landed(launches) -> Iterator[Block]:
        """Blocks of :meth:`_launch` in order, one in flight: on CUDA block i is handed out
        once its copy has arrived, after block i+1's head and copy were queued, so the device
        computes and copies while the caller (checks, writer) works on the host."""
        held = None
        for blk, ev in launches:
            if ev is None:
                yield blk
                continue
            if held is not None:
                yield _arrived(*held)
            held = (*blk, ev)
        if held is not None:
            yield _arrived(*held)

    def forward_threads(self) -> int:
        if self.device.type != "cpu":
            return 0
        import torch

        return self.threads or torch.get_num_threads()

    def _check_len(self, n: int, what: str) -> None:
        if self.max_positions and n > self.max_positions:
            raise LogitdiffError(
                f"{self.path}: {what} needs {n} positions, more than max_position_embeddings={self.max_positions}"
            )

    @staticmethod
    def _cache_kw(out) -> dict:
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (argument and output).
        kw = "cache" if "cache" in out else "past_key_values"
        return {kw: out[kw]}

    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        """Greedy decoding with a KV cache; ties go to the lowest id.

        Stops after emitting an eos id (kept in the output) or after ``max_tokens`` tokens, or
        at the context limit (``max_position_embeddings``, reported as ``max_tokens``)."""
        return self.generate_many([prompt_ids], [max_tokens])[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[Generation]:
        """Greedy decoding of ``batch`` prompts per forward pass (left padding: every
        sequence's next token sits in the last column). Only token ids are kept: each step
        takes the argmax of ``[batch, V]`` head rows and drops them. A lone prompt runs
        without padding or mask, exactly as an unbatched decode."""
        out: list[Generation] = []
        for a in range(0, len(prompts), self.batch):
            out += self._generate_group(list(prompts[a : a + self.batch]), list(max_tokens[a : a + self.batch]))
        return out

    def _generate_group(self, prompts: list, budgets: list) -> list[Generation]:
        import torch

        prompts = [[int(i) for i in p] for p in prompts]
        budgets = list(budgets)
        for k, p in enumerate(prompts):
            if not p:
                raise LogitdiffError(f"{self.path}: generate needs a non-empty prompt")
            self._check_len(len(p), "prompt")
            if self.max_positions:
                budgets[k] = min(budgets[k], self.max_positions - len(p) + 1)
        n = len(prompts)
        ids_out: list[list[int]] = [[] for _ in prompts]
        stopped = ["max_tokens"] * n
        live = [b > 0 for b in budgets]
        if not any(live):
            return [Generation([], "max_tokens") for _ in prompts]
        width = max(len(p) for p in prompts)
        padded = n > 1 and any(len(p) != width for p in prompts)
        eos = set(self.eos_token_ids)
        dev = self.device
        with torch.inference_mode():
            x = torch.full((n, width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((n, width), dtype=torch.long)
            for k, p in enumerate(prompts):
                x[k, width - len(p) :] = torch.tensor(p)
                mask[k, width - len(p) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            kw: dict = {}
            x = x.to(dev)
            if padded:
                mask, pos = mask.to(dev), pos.to(dev)
            while any(live):
                if padded:
                    o = self.base(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
                else:
                    o = self.base(input_ids=x, use_cache=True, **kw)
                kw = self._cache_kw(o)
                nxt = self._head(o.last_hidden_state[:, -1]).argmax(-1).tolist()  # first max: lowest id
                for k in range(n):
                    if not live[k]:
                        continue
                    ids_out[k].append(int(nxt[k]))
                    if nxt[k] in eos:
                        stopped[k], live[k] = "eos", False
                    elif len(ids_out[k]) >= budgets[k]:
                        live[k] = False
                x = torch.tensor(nxt, dtype=torch.long, device=dev)[:, None]
                if padded:
                    mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], 1)
                    pos = pos[:, -1:] + 1
        return [Generation(token_ids=ids, stopped_by=s) for ids, s in zip(ids_out, stopped)]

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> np.ndarray:
        return self.score_many([(prompt_ids, teacher_ids)])[0]

    def score_many(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Float32 logits ``[len(teacher), V]`` per pair: ``score_blocks`` gathered (holds
        whole outputs; for tests and small runs)."""
        parts: list[list[np.ndarray]] = [[] for _ in batch]
        for b in self.score_blocks(batch):
            parts[b.pair].append(cast(np.ndarray, b.rows))  # a full-logit source's rows are arrays
        out = []
        for k, ps in enumerate(parts):
            rows = np.concatenate(ps) if ps else np.zeros((0, self.vocab_size), np.float32)
            out.append(_bits_to_f32(rows) if rows.dtype == np.uint16 else rows)
        return out

    def _row_pool(self, block: int) -> RowPool | None:
        """Page-aligned buffers for one scoring call's blocks of at most ``block`` rows
        (rowpool.py), where the rows are the head's plain 16-bit output of exactly the
        vocabulary on the CPU; None otherwise (post-processing, a bias, padded head rows,
        float32 storage, CUDA). Each block then costs no fresh tensor mapped and faulted by
        the kernel, and the O_DIRECT writer takes the rows from there without its staging
        copy. One pool per call: nothing is held once the call's blocks are gone."""
        if block < 1 or self.device.type == "cuda" or self.out_rows != self.vocab_size or not self._rows_are_head_output():
            return None
        from ..store.rowpool import RowPool

        return RowPool(block, self.vocab_size, np.uint16)

    def _head_pooled(self, hb, pool: RowPool) -> np.ndarray | None:
        """The head's rows of ``hb`` ([n, H] on the CPU, pool.rows / 2 < n <= ``pool.rows``) as
        16-bit values in one of ``pool``'s buffers (bf16 as uint16 bits, float16 as float16, as
        ``_host_array`` hands them out); None for a smaller block or hidden states the head
        would not take as they are (the caller then takes the head's own output). The same
        values as ``_stored(_head(hb))``: the same matrix product (``F.linear`` without a bias
        is ``mm`` with the transposed weight), written in place."""
        import torch

        w = self.lm_head.weight
        # a block under half a buffer (an item's last rows, a short item) is not pooled: a
        # buffer held for a few rows would pin memory the writer's queue does not count
        if hb.dtype != w.dtype or hb.dim() != 2 or not pool.rows < 2 * hb.shape[0] <= 2 * pool.rows:
            return None
        rows = pool.take(int(hb.shape[0]))
        torch.mm(hb, w.t(), out=torch.from_numpy(rows.view(np.int16)).view(w.dtype))
        return rows if w.dtype == torch.bfloat16 else rows.view(np.float16)

    def score_blocks(self, batch, positions=None, *, chunk_bytes=None, with_hidden: bool = False) -> Iterator[Block]:
        """Teacher-forced rows, a bounded block at a time (see ``Source.score_blocks``);
        ``with_hidden``: each block also carries the hidden states its rows came from.

        Each sequence is ``prompt + teacher[:-1]`` (the last teacher token predicts nothing
        we need). Pairs whose sequences fit one window of ``prefill`` tokens go ``batch`` at a
        time (by length) through one right-padded forward pass; a longer sequence goes
        alone, ``prefill`` tokens per forward pass over a KV cache, so neither activations nor
        attention masks grow with its length. Only the hidden states of selected output
        positions reach the (large) output head, in blocks of ``chunk_bytes`` of float32
        logits; blocks are yielded in pair order as they are computed."""
        import torch

        from ..store import rows_per_block

        block = rows_per_block(self.vocab_size, chunk_bytes)
        seqs: list[list[int]] = []
        sel: list[np.ndarray] = []
        for k, (p, t) in enumerate(batch):
            p, t = [int(i) for i in p], [int(i) for i in t]
            if not p:
                raise LogitdiffError(f"{self.path}: scoring pair {k} has an empty prompt")
            self._check_len(len(p) + max(len(t) - 1, 0), f"scoring pair {k}")
            seqs.append(p + t[:-1])
            want = np.arange(len(t)) if positions is None or positions[k] is None else np.asarray(positions[k], dtype=np.int64)
            if want.size and (want.min() < 0 or want.max() >= len(t)):
                raise LogitdiffError(f"{self.path}: scoring pair {k}: positions outside the {len(t)} teacher tokens")
            sel.append(len(p) - 1 + want)  # sequence index of each selected output row
        # Sequences that fit one window go through right-padded forward passes, ``batch`` at a
        # time, grouped by length (little padding; the grouping of earlier versions, so the
        # numbers are the same); their hidden states (``[rows, H]`` each, no vocabulary axis)
        # wait while blocks are yielded in pair order.
        short = sorted((k for k in range(len(batch)) if sel[k].size and len(seqs[k]) <= self.prefill), key=lambda k: -len(seqs[k]))
        hidden: dict[int, Any] = {}
        # buffers of the largest block this call makes: no larger than the rows it scores
        # (a chunk size far above them must not map memory for rows that never come)
        pool = self._row_pool(min(block, max((x.size for x in sel), default=0)))
        with torch.inference_mode():
            for a in range(0, len(short), self.batch):
                hidden.update(self._forward_group(short[a : a + self.batch], seqs, sel))
            for k in range(len(batch)):
                if not sel[k].size:
                    continue
                if k not in hidden:
                    yield from self._score_long(k, seqs[k], sel[k], block, with_hidden, pool)
                    continue
                h = hidden.pop(k)
                yield from self._landed(self._launch(k, a, h[a : a + block], with_hidden, pool) for a in range(0, len(h), block))

    def _forward_group(self, group, seqs, sel) -> dict:
        """One right-padded forward pass: padding sits after the real tokens, so with the
        attention mask every real position sees exactly the keys it sees unbatched and keeps
        its default position id. Returns the hidden states of each pair's selected rows."""
        import torch

        width = max(len(seqs[k]) for k in group)
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for b, k in enumerate(group):
            ids[b, : len(seqs[k])] = torch.tensor(seqs[k])
            mask[b, : len(seqs[k])] = 1
        out = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False).last_hidden_state
        return {k: out[b, torch.as_tensor(sel[k], device=self.device)] for b, k in enumerate(group)}

    def _score_long(self, k, seq, sel, block, with_hidden=False, pool=None):
        """One sequence, ``prefill`` tokens per forward pass over a KV cache."""
        import torch

        kw: dict = {}
        done = 0  # selected rows yielded so far
        for a in range(0, len(seq), self.prefill):
            b = min(len(seq), a + self.prefill)
            o = self.base(input_ids=torch.tensor([seq[a:b]], device=self.device), use_cache=True, **kw)
            kw = self._cache_kw(o)
            stop = int(np.searchsorted(sel, b))
            here = torch.as_tensor(sel[done:stop] - a, device=self.device)
            yield from self._landed(self._launch(k, done + c, o.last_hidden_state[0, here[c : c + block]], with_hidden, pool)
                                    for c in range(0, len(here), block))
            done = stop

    # --- identity -----------------------------------------------------------------
    def identity(self) -> dict:
        """What produced the numbers: versions, files (sha256), dtype, device, threads.
        Hashing weights reads them once; the result is cached."""
        if self._identity is None:
            import torch
            import transformers

            if self.gguf_file:
                weights = [self.path / self.gguf_file]
            else:
                weights = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin"))
            d: dict[str, Any] = {
                "backend": "transformers",
                "spec": self.spec,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "model_path": str(self.path.resolve()),
                "architecture": (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0],
                "dtype": self.dtype_name,
                "logits_dtype": self.logits_dtype,
                "batch": self.batch,
                "prefill": self.prefill,
                "device": str(self.device),
                "threads": torch.get_num_threads(),
                "attn_implementation": getattr(self.config, "_attn_implementation", None),
                "vocab_size": self.vocab_size,
                "tokenizer_hash": self.tokenizer_hash,
                "eos_token_ids": list(self.eos_token_ids),
                "weight_files": {f.name: file_sha256_cached(f) for f in weights},
                "tokenizer_files": {
                    n: file_sha256_cached(self.path / n) for n in _TOKENIZER_FILES if (self.path / n).is_file()
                },
                "config_files": {
                    n: file_sha256_cached(self.path / n)
                    for n in ("config.json", "generation_config.json")
                    if (self.path / n).is_file()
                },
            }
            if self.gguf_file:
                d.update(self._origin)
                d["tokenizer_files"] = {}  # the tokenizer is the GGUF's metadata (weight_files)
                import llama_cpp

                d["tokenizer"] = (f"llama.cpp vocab of {self.gguf_file} (llama-cpp-python "
                                  f"{getattr(llama_cpp, '__version__', 'unknown')}); transformers' for decoding only")
            if self.padded > 0:
                d["padded_logits"] = (
                    f"dropped {self.padded} padded output rows (ids >= len(tokenizer)) before log_softmax"
                )
            if self.out_rows < len(self.tok):
                d["short_output_layer"] = (
                    f"lm_head has {self.out_rows} rows but the tokenizer {len(self.tok)} tokens; "
                    f"rows cover ids < {self.out_rows} only"
                )
            self._identity = d
        return dict(self._identity)


    def close(self) -> None:
        vocab, self._vocab = getattr(self, "_vocab", None), None
        if vocab is not None:
            from .gguf import llama_log_errors_only, load_lock

            with load_lock, llama_log_errors_only():
                vocab.close()


def _gguf_vocab(path: Path):
    """llama.cpp's tokenizer of a GGUF file: the model opened ``vocab_only`` (no weights)."""
    from .gguf import load_vocab

    return load_vocab(path)


def _gguf_neighbours(path: Path) -> list:
    """What else transformers may read when it converts the GGUF ``path`` (a
    ``tokenizer_config.json`` beside it names the tokenizer class and can carry a chat
    template; ``chat_templates/*.jinja``): the name and `file_identity` of every file beside
    it but GGUFs, and of those under ``chat_templates/``."""
    from ..store.filecache import file_identity

    d = path.parent
    files = [p for p in d.iterdir() if p.is_file() and p.suffix.lower() != ".gguf"]
    if (d / "chat_templates").is_dir():
        files += [p for p in (d / "chat_templates").iterdir() if p.is_file()]
    return [[p.relative_to(d).as_posix(), file_identity(p)] for p in sorted(files)]


def _converted_gguf(path: Path) -> tuple[Any, Any]:
    """transformers' config and tokenizer of the GGUF ``path`` (``AutoConfig`` and
    ``AutoTokenizer`` with ``gguf_file``: each parses the file through gguf.GGUFReader, and
    the tokenizer is rebuilt from its V token strings: 17 s of a 55.8-s preflight for
    SmolLM2, V = 49,152, issue 38), kept per version of the file, of the files beside it that
    transformers may read (`_gguf_neighbours`) and of the libraries (filecache.file_dir_cached),
    as ``save_pretrained`` writes them, and kept only when the copy loads back alike
    (`_same_conversion`); a cached open loads them in ~0.3 s."""
    import gguf
    import tokenizers
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from ..store.filecache import file_dir_cached

    def convert() -> tuple[Any, Any]:
        return (AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name),
                AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))

    def load(d: Path) -> tuple[Any, Any]:
        return AutoConfig.from_pretrained(str(d)), AutoTokenizer.from_pretrained(str(d))

    def save(value: tuple[Any, Any], d: Path) -> bool:
        value[0].save_pretrained(str(d))
        value[1].save_pretrained(str(d))
        return _same_conversion(value, load(d))

    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "gguf": getattr(gguf, "__version__", "unknown"), "beside": _gguf_neighbours(path), "format": 1}
    return file_dir_cached(path, "hf.gguf_conversion", versions, convert, save, load)


def _same_conversion(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two (config, tokenizer) pairs are alike in all a source reads of them: the
    config (but the path it was read from), and the tokenizer's class, length, serialized
    fast tokenizer (model, normalizer, pre-tokenizer, post-processor, added tokens), special
    tokens and chat template."""
    (ca, ta), (cb, tb) = a, b
    da, db = ca.to_dict(), cb.to_dict()
    da.pop("_name_or_path", None)
    db.pop("_name_or_path", None)
    ba, bb = getattr(ta, "backend_tokenizer", None), getattr(tb, "backend_tokenizer", None)
    return (da == db and type(ta) is type(tb) and len(ta) == len(tb) and ba is not None and bb is not None
            and ba.to_str() == bb.to_str() and ta.special_tokens_map == tb.special_tokens_map
            and ta.chat_template == tb.chat_template)


def _gguf_render_identity(path: Path) -> str | None:
    """The ``render_identity`` of ``hf:`` on the GGUF ``path``: transformers' chat template and
    llama.cpp's vocabulary, both from the file's metadata (its digest: sources/gguf_meta.py)
    and what transformers may read beside it."""
    import hashlib
    import json

    from .gguf_meta import gguf_metadata

    digest = gguf_metadata(path).get("tokenizer_metadata_sha256")
    if not digest:
        return None
    beside = hashlib.sha256(json.dumps(_gguf_neighbours(path)).encode()).hexdigest()
    return f"hf: transformers' chat template + llama.cpp vocabulary of metadata {digest}, beside sha256:{beside}"


def _host_array(t) -> np.ndarray:
    """A host tensor as numpy, sharing its memory: bf16 (and int16-viewed 16-bit bits) as
    uint16 bits."""
    import torch

    if t.dtype == torch.int16:  # 16-bit bits
        return t.numpy().view(np.uint16)
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _arrived(k: int, t0: int, rows, hid, ev) -> Block:
    ev.synchronize()
    return Block(k, t0, _host_array(rows), _host_array(hid) if hid is not None else None)


def _check_weights_cover(where: Path, info: dict) -> None:
    """Refuse a model whose weight files do not cover its config: transformers fills a missing
    tensor (an absent ``lm_head.weight``, the layers a config claims beyond the checkpoint's)
    with random values and says so only in a log line, and drops tensors the config has no
    place for; either way the logits are not the checkpoint's. A head tied to the embedding
    (``tie_word_embeddings``) is no missing tensor: transformers does not list it."""
    from .gguf_check import named

    for key, what in (("missing_keys", "lack tensors the config asks for"),
                      ("unexpected_keys", "hold tensors the config has no place for"),
                      ("mismatched_keys", "hold tensors of another shape than the config's")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            raise LogitdiffError(f"{where}: the weights do not cover the config: they {what}: {named(names)}")


def _checked_gguf_origin(path: Path) -> dict:
    """A GGUF to be loaded through transformers, read once: its layout checked
    (:func:`~logitdiff.sources.gguf_check.check_gguf_layout`), and what its weights are
    dequantized from: its declared file type and the count of tensors per quantization type."""
    import gguf

    from .gguf_check import check_gguf_layout, layout_of_reader

    try:
        r = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise LogitdiffError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})".splitlines()[0]) from None
    check_gguf_layout(layout_of_reader(r), path)
    kinds: dict[str, int] = {}
    for t in r.tensors:
        name = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        kinds[name] = kinds.get(name, 0) + 1
    ft = r.fields.get("general.file_type")
    ftype = None
    if ft is not None:
        code = int(ft.parts[ft.data[0]][0])
        try:
            ftype = gguf.LlamaFileType(code).name
        except ValueError:
            ftype = str(code)
    return {"dequantized_from": "gguf", "gguf_file_type": ftype, "gguf_tensor_types": dict(sorted(kinds.items()))}


def open_hf(spec: Spec) -> HFSource:
    """The registry's factory for ``hf:`` specs."""
    return HFSource.from_spec(spec)


def open_hf_tokenizer(spec: Spec) -> HFSource:
    """The registry's tokenizer-only factory for ``hf:`` specs (config and tokenizer only)."""
    return HFSource.tokenizer_from_spec(spec)
