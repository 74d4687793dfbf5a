"""``gguf:PATH[,n_ctx=N][,threads=N]...`` - a GGUF model run in process by llama.cpp (options:
:data:`logitdiff.sources.options.OPTIONS`).

Uses llama-cpp-python's ``Llama`` and reads the file's metadata
(tokens, special ids, chat template, file type) with ``gguf.GGUFReader``.

Weight repacking is disabled (unless the spec says ``repack=true``: llama.cpp's own default,
what llama-perplexity and llama-server run; on SmolLM2 Q4_0 the two layouts' logits differ by up
to 2.4, the repacked matmul quantising activations its own way).  llama.cpp's CPU backend, by default, moves quantized
weights into "extra buffer types" at load time (``llama_model_params.use_extra_bufts``,
default ``true``): the AMX / interleaved ("repack") layouts of ``ggml-cpu``.  With a
natively built llama.cpp (``GGML_NATIVE=ON``, the pip default) on AMX-capable Xeons,
every quantized GGUF crashed (SIGSEGV) in that AMX repacking path, while F32/F16 files,
which are not repacked, ran fine.  ``Llama(...)`` has no argument for it, so
:func:`load_llama` builds the model with ``use_extra_bufts = False``: it wraps
``llama_cpp.llama_model_default_params`` (which ``Llama.__init__`` calls) for the
duration of the constructor, under a lock, and then verifies on
``llm.model_params.use_extra_bufts`` that the flag really reached llama.cpp.  Weights
stay in the plain CPU buffer, which computes the same quantized dot products (results
may differ from a repacked run by float summation order only).  On llama-cpp-python
builds whose ``llama_model_params`` has no ``use_extra_bufts`` field there is nothing to
switch off and a warning is recorded in ``identity()["extra_bufts"]``.

Process state: opening, using and closing a source leave the process as they found it.
``threads`` goes to the context (``n_threads``), never to a global; the binding function
swapped during a load is put back before :func:`load_llama` returns; the level that
``Llama(verbose=False)`` sets on the ``llama-cpp-python`` logger is restored after the load
and after ``close`` (each runs with errors-only logging). A program that wants llama.cpp
quiet everywhere says so once at its entry point (:func:`quiet_llama_log`).

Token conventions (chosen to match the HF source on the same tokenizer):

* raw ``prompt`` items: ``tokenize(add_bos=False, special=True)`` - HF's
  ``tokenizer(prompt, add_special_tokens=False)`` adds no BOS but does match special
  tokens written in the text;
* ``messages`` items: the GGUF's ``tokenizer.chat_template`` rendered with jinja2 the way
  transformers renders it (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``tojson``,
  ``raise_exception``, ``strftime_now``, ``bos_token``/``eos_token``...), with
  ``messages``, ``tools`` and ``add_generation_prompt=True``; then tokenized with
  ``special=True`` and no BOS (whatever BOS the template writes is kept);
* ``tokenizer_hash`` hashes ``tokenizer.ggml.tokens`` in id order, without the trailing
  ``[PAD{i}]`` placeholders converters add to pad the vocabulary to the embedding size
  (HF's ``len(tokenizer)`` does not count them); ``vocab_size`` is the full row width;
* ``eos_token_ids`` are the file's ``eos``/``eot``/``eom`` token ids; ``generate`` stops
  after emitting one of them (it is included in ``token_ids``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Sequence, cast

import numpy as np

from ..errors import LogitdiffError
from ..contracts import json_clean
from .base import Block, FullLogitSource, Generation, Spec, parse_spec, tokenizer_hash_of
from .chat_template import render_bounded
from .gguf_check import check_gguf_layout
from .options import parse_options

load_lock = threading.Lock()
_stderr_lock = threading.Lock()  # load_vocab's sys.stderr swap, one at a time
_PAD_RE = re.compile(r"^\[PAD(\d+)\]$")


def extra_bufts_supported() -> bool:
    """Whether the installed llama-cpp-python exposes ``llama_model_params.use_extra_bufts``."""
    import llama_cpp

    return any(f[0] == "use_extra_bufts" for f in llama_cpp.llama_model_params._fields_)


def load_llama(path: str | Path, *, repack: bool = False, **kwargs):
    """``llama_cpp.Llama(path, **kwargs)`` with extra buffer types (weight repacking) off
    (``repack=True``: llama.cpp's default, left as it is).

    Process state is the same after the call as before it: ``Llama`` has no parameter for
    ``use_extra_bufts``, so the binding's ``llama_model_default_params`` is swapped for the
    duration of the constructor only (under a lock, restored in ``finally``), and the level
    ``Llama(verbose=...)`` sets on the process-wide ``llama-cpp-python`` logger is put back.
    llama.cpp's log is quiet (errors only) during the load and the source's ``close``
    (:func:`llama_log_errors_only`); quieting it for everything is the entry point's choice
    (:func:`quiet_llama_log`)."""
    import llama_cpp
    import llama_cpp.llama_cpp as C

    if repack:
        with load_lock, llama_log_errors_only():
            return llama_cpp.Llama(model_path=str(path), **kwargs)
    has_field = extra_bufts_supported()
    with load_lock, llama_log_errors_only():
        orig = C.llama_model_default_params

        def no_repack_params():
            p = orig()
            if has_field:
                p.use_extra_bufts = False
            return p

        C.llama_model_default_params = no_repack_params
        try:
            llm = llama_cpp.Llama(model_path=str(path), **kwargs)
        finally:
            C.llama_model_default_params = orig
    if has_field and bool(llm.model_params.use_extra_bufts):  # pragma: no cover - defensive
        llm.close()
        raise LogitdiffError(f"{path}: could not disable llama.cpp weight repacking (use_extra_bufts)")
    return llm


@contextlib.contextmanager
def llama_log_errors_only():
    """llama.cpp's log through llama-cpp-python at error level for the duration of one call,
    then the logger's level as it was (``Llama(verbose=False)`` would leave it changed)."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_vocab(path: str | Path):
    """llama.cpp's tokenizer of a GGUF: ``Llama(vocab_only=True)``, no weights (well under a
    second). Quiet: llama.cpp warns that n_ctx exceeds the training context (which a vocab-only
    load reads as 0) and llama-cpp-python's log callback prints ggml's WARN as an error, to
    ``sys.stderr`` whatever ``verbose`` says; so ``sys.stderr`` is swapped for the load alone
    (a failed load raises, with its message). The swap is process state: two loads at once
    would each restore the other's buffer (leaving ``sys.stderr`` a StringIO), so they take
    turns (``_stderr_lock``); another thread's writes to ``sys.stderr`` during one are lost."""
    import io

    with _stderr_lock, contextlib.redirect_stderr(io.StringIO()):
        return load_llama(path, vocab_only=True, verbose=False)


def quiet_llama_log() -> None:
    """Let llama.cpp's log through llama-cpp-python only at error level (what
    ``Llama(verbose=False)`` does): a process-wide setting, for a program's entry point to
    make once, explicitly. Opening a ``gguf:`` source does not make it."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def _has_output_batch_api(llm) -> bool:
    """Whether this llama-cpp-python exposes the internals `_decode_outputs` drives."""
    ctx, batch = getattr(llm, "_ctx", None), getattr(llm, "_batch", None)
    return (
        all(hasattr(ctx, a) for a in ("kv_cache_seq_rm", "decode", "ctx"))
        and hasattr(batch, "set_batch")
        and hasattr(getattr(batch, "batch", None), "logits")
        and hasattr(llm, "input_ids")
    )


# --------------------------------------------------------------------------------------
# chat template rendering, as transformers does it
# --------------------------------------------------------------------------------------


def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (HF assistant masks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# --------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------


class GGUFSource(FullLogitSource):
    engine = "llama.cpp in process"
    scores_alone = True  # score_blocks: one prefill per (prompt, teacher) pair
    llm: Any  # llama_cpp.Llama: the model, or (tokenizer-only) its vocabulary once loaded, else None
    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        seed: int = 0,
        n_batch: int = 512,
        repack: bool = False,
        spec: str | None = None,
        tokenizer_only: bool = False,
    ):
        """``tokenizer_only``: llama.cpp opens the vocabulary alone (no weights, well under a
        second), on the first tokenization: the source renders and tokenizes, and nothing else
        (a preflight's open; one whose ``render_identity`` is already proven loads nothing)."""
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise LogitdiffError("gguf: sources need llama-cpp-python (pip install 'logitdiff[gguf]')") from None
        self.path = Path(path)
        self.spec = spec or f"gguf:{path}"
        p = self.path
        if not p.exists():
            raise LogitdiffError(f"{p}: GGUF file not found")
        if not p.is_file():
            raise LogitdiffError(f"{p}: not a file")
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LogitdiffError(f"{p}: not a GGUF file (bad magic {magic!r})")
        if n_ctx is not None and n_ctx < 1:
            raise LogitdiffError(f"{self.spec}: n_ctx must be positive")
        # llama.cpp threads are per context (n_threads), nothing process-wide; ``threads`` (the
        # torch count an entry point applies) stays None for this source
        self.n_threads = int(threads) if threads else max(1, os.cpu_count() or 1)
        self.repack = bool(repack)
        self._read_metadata()
        if n_ctx is None:
            # Default: the model's training context, capped at 4096 (KV memory).
            n_ctx = min(4096, int(self.n_ctx_train)) if self.n_ctx_train else 4096

        n_batch = max(1, min(int(n_batch), int(n_ctx)))
        self._template: Any = None  # the compiled chat template (jinja2), on first use
        self._tokenizer_only = tokenizer_only
        if tokenizer_only:
            self.llm = None  # loaded by the first tokenization (_vocab)
            self.vocab_size = len(self._tokens)  # llama.cpp's n_vocab (a full open checks they agree)
            return
        try:
            # Without ``logits_all``: with it, ``Llama`` keeps an [n_ctx, V] float32 array
            # (32 GB at n_ctx 32k, V 248,320). Rows are read from llama.cpp's own output
            # buffer instead, a block at a time (``_output_blocks``). Only a binding without
            # the internals that needs gets ``logits_all`` (and its memory) back.
            for logits_all in (False, True):
                self.llm = load_llama(
                    p,
                    n_ctx=int(n_ctx),
                    n_batch=n_batch,
                    n_ubatch=n_batch,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    logits_all=logits_all,
                    seed=int(seed),
                    n_gpu_layers=0,
                    verbose=False,
                    repack=repack,
                )
                self._fast = _has_output_batch_api(self.llm)
                if self._fast or logits_all:
                    break
                self.llm.close()
        except (ValueError, RuntimeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise LogitdiffError(f"{p}: llama.cpp could not load the model ({msg})") from None
        # llama.cpp may round the context up (to a multiple of 256); the limit enforced
        # here is the one the user asked for.
        self.n_ctx = min(int(n_ctx), int(self.llm.n_ctx()))
        self.vocab_size = int(self.llm.n_vocab())
        if self.vocab_size != len(self._tokens):
            raise LogitdiffError(
                f"{p}: llama.cpp reports {self.vocab_size} tokens but tokenizer.ggml.tokens has {len(self._tokens)}"
            )
        self.seed = int(seed)
        self._sha256: str | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: Spec | str) -> "GGUFSource":
        if isinstance(spec, str):
            spec = parse_spec(spec)
        text = spec.text or f"{spec.kind}:{spec.target}"
        kw = parse_options(spec, "gguf")  # the declared options (sources/options.py), checked
        if not spec.target:
            raise LogitdiffError(f"source spec {text!r}: missing GGUF path")
        return cls(spec.target, spec=text, **kw)

    @classmethod
    def tokenizer_from_spec(cls, spec: Spec | str) -> "GGUFSource":
        """The spec's source opened ``tokenizer_only`` (options checked as for a full open)."""
        if isinstance(spec, str):
            spec = parse_spec(spec)
        text = spec.text or f"{spec.kind}:{spec.target}"
        kw = parse_options(spec, "gguf")
        if not spec.target:
            raise LogitdiffError(f"source spec {text!r}: missing GGUF path")
        return cls(spec.target, spec=text, tokenizer_only=True, **kw)

    def _read_metadata(self) -> None:
        from .gguf_meta import gguf_metadata

        meta = gguf_metadata(self.path)
        check_gguf_layout(meta["layout"], self.path)  # before llama.cpp, which aborts on some of it
        get = meta.get
        tokens = get("tokenizer.ggml.tokens")
        if not tokens:
            raise LogitdiffError(f"{self.path}: GGUF has no tokenizer.ggml.tokens (no embedded tokenizer)")
        self._tokens: list[str] = list(tokens)
        self._token_types: list[int] = list(get("tokenizer.ggml.token_type") or [])
        self.arch = get("general.architecture")
        self.n_ctx_train = get("context_length")
        self.model_name = get("general.name")
        self.file_type = get("general.file_type")
        self.chat_template: str | None = get("tokenizer.chat_template")
        self.tokenizer_model = get("tokenizer.ggml.model")
        self._bos = get("tokenizer.ggml.bos_token_id")
        self._eos = get("tokenizer.ggml.eos_token_id")
        eos = []
        for key in ("eos", "eot", "eom"):
            v = get(f"tokenizer.ggml.{key}_token_id")
            if v is not None and int(v) not in eos and 0 <= int(v) < len(self._tokens):
                eos.append(int(v))
        self.eos_token_ids = tuple(eos)
        self._special_strs = {}
        for key in ("bos", "eos", "pad", "unk"):
            v = get(f"tokenizer.ggml.{key}_token_id")
            if v is not None and 0 <= int(v) < len(self._tokens):
                self._special_strs[f"{key}_token"] = self._tokens[int(v)]
        # drop the trailing [PADi] placeholders a converter adds to reach the embedding size
        n = len(self._tokens)
        while n > 0:
            m = _PAD_RE.match(self._tokens[n - 1])
            if not (m and int(m.group(1)) == n - 1):
                break
            n -= 1
        self.tokenizer_tokens = list(self._tokens[:n])
        self.tokenizer_hash = tokenizer_hash_of(self.tokenizer_tokens)
        # what this class renders from: the GGUF's metadata (all of it but the quantizer's
        # keys); None from a reader that could not digest it
        digest = self._tokenizer_digest = get("tokenizer_metadata_sha256")
        self.render_identity = f"gguf: llama.cpp vocabulary + chat template of metadata {digest}" if digest else None

    # ---- tokenization -----------------------------------------------------------------
    def _vocab(self):
        """llama.cpp's model: the one loaded at open, or (tokenizer-only) its vocabulary,
        loaded on first use."""
        if self.llm is None:
            try:
                self.llm = load_vocab(self.path)
            except (ValueError, RuntimeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise LogitdiffError(f"{self.path}: llama.cpp could not load the vocabulary ({msg})") from None
        return self.llm

    def _tokenize(self, text: str) -> list[int]:
        ids = self._vocab().tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return [int(i) for i in ids]

    def render_text(self, item: Any) -> str:
        """The chat-template text of a ``messages`` item (the raw prompt for ``prompt`` items)."""
        if getattr(item, "prompt", None) is not None:
            return item.prompt
        if not self.chat_template:
            raise LogitdiffError(
                f"item {getattr(item, 'id', '?')!r}: {self.path} has no tokenizer.chat_template for chat messages"
            )
        import jinja2

        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise LogitdiffError(f"{self.path}: chat template does not compile ({e})") from None
        kwargs = dict(self._special_strs)
        try:
            return render_bounded(lambda: self._template.render(
                messages=item.messages,
                tools=item.tools,
                add_generation_prompt=True,
                **kwargs,
            ), f"item {item.id!r}: {self.spec}")
        except LogitdiffError:
            raise
        except Exception as e:  # a template's own error (TemplateError, TypeError, RecursionError...): one line
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            raise LogitdiffError(f"item {item.id!r}: chat template of {self.path} failed ({msg})") from None

    def render(self, item: Any) -> list[int]:
        return self._tokenize(self.render_text(item))

    def render_many(self, items: Sequence[Any]) -> list[list[int]]:
        """`render` of several items. A tokenizer-only open (a preflight's) keeps the ids per
        (tokenizer digest, llama-cpp-python version, texts): the ids are a function of those
        alone (llama.cpp builds the vocabulary from the metadata the digest covers), so a
        later preflight on the same tokenizer and prompts loads no vocabulary. A full open
        (a capture) always tokenizes."""
        texts = [self.render_text(it) for it in items]
        if not self._tokenizer_only or self._tokenizer_digest is None:
            return [self._tokenize(t) for t in texts]
        import hashlib

        import llama_cpp

        from ..store.filecache import json_cached

        key = {"tokenizer_metadata_sha256": self._tokenizer_digest, "llama_cpp_python": llama_cpp.__version__,
               "call": "tokenize(add_bos=False, special=True)",
               "texts_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest()}
        return json_cached("gguf.prompt_ids", key, lambda: [self._tokenize(t) for t in texts],
                           valid=lambda v: isinstance(v, list) and len(v) == len(texts)
                           and all(isinstance(ids, list) and all(type(i) is int for i in ids) for ids in v))

    def document_ids(self, text: str) -> tuple[list[int], int | None]:
        # common_tokenize(ctx, text, add_special=true, parse_special=false), as llama-perplexity
        if self.llm._model.add_eos_token():  # llama-perplexity asserts this too
            raise LogitdiffError(f"{self.path}: the model appends EOS to every text; a text: workload cannot be chunked")
        ids = [int(i) for i in self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)]
        return ids, (int(self.llm.token_bos()) if self.llm._model.add_bos_token() else None)

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check_ids(ids, "detokenize")
        b = self._vocab().detokenize([int(i) for i in ids], special=True)
        return b.decode("utf-8", errors="replace")

    def token_texts(self) -> list[str]:
        """``token_text`` of every id, kept per version of the GGUF file (filecache.py): V
        detokenize calls cost ~1 s at V = 248,320."""
        if self._token_texts is None or len(self._token_texts) != self.vocab_size:
            import llama_cpp

            from ..store.filecache import cached_json

            self._token_texts = cached_json("gguf.token_texts", [self.path], {
                "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"), "vocab_size": self.vocab_size},
                lambda: [self.token_text(i) for i in range(self.vocab_size)])
        return self._token_texts

    def token_text(self, token_id: int) -> str:
        self._check_ids([token_id], "token_text")
        b = self._vocab().detokenize([int(token_id)], special=True)
        return b.decode("utf-8", errors="backslashreplace")

    # ---- model ---------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        for i in ids:
            if not (0 <= int(i) < self.vocab_size):
                raise LogitdiffError(f"{self.path}: {what}: token id {int(i)} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _rows(self, start: int, stop: int) -> np.ndarray:
        return np.array(self.llm.scores[start:stop, : self.vocab_size], dtype=np.float32, copy=True)

    def _output_blocks(self, seq: list[int], out_idx: np.ndarray, block: int, window: int | None = None,
                       pool: Any = None) -> Iterator[np.ndarray]:
        """Logits of the positions ``out_idx`` (sorted indices into ``seq``) of one prefill of
        ``seq``, as float32 blocks of at most ``block`` rows, in order.

        ``Llama.eval`` with ``logits_all`` asks llama.cpp for the logits of every position and
        copies them all into ``Llama.scores`` (an ``[n_ctx, V]`` array). Here the batch's
        output flags select the wanted rows, so llama.cpp runs the output layer on those rows
        only. A decode call flags at most ``window`` of them (default ``block``), so
        llama.cpp's own output buffer stays within ``window`` rows; they are copied out
        ``block`` rows at a time, each block a fresh array (from a pool of buffers used again
        once every view of one is gone, ``pool``: no page faults per block). A window of several
        blocks keeps a long scored span in one decode: cut into decodes of ``block`` rows, a
        chunk of 512 tokens at V = 262,144 went through llama.cpp in four smaller batches,
        8 % slower (bench/RESULTS.md, issue 40). The KV cache is cleared and ``Llama``'s own
        position counter is set, so ``Llama.eval`` can continue after it. This uses
        llama-cpp-python's internal context and batch objects (those ``Llama.eval`` itself
        uses); a version without them was loaded with ``logits_all`` (see ``__init__``) and
        gets the plain ``Llama.eval`` path, same rows."""
        import llama_cpp

        llm = self.llm
        if not self._fast:
            llm.reset()
            llm.eval(seq)
            for a in range(0, len(out_idx), block):
                yield np.array(llm.scores[out_idx[a : a + block], : self.vocab_size], dtype=np.float32)
            return
        window = max(block, window or block)
        llama_get_logits = llama_cpp.llama_get_logits
        ctx, batch, n_vocab_model = llm._ctx, llm._batch, llm.n_vocab()
        ctx.kv_cache_seq_rm(-1, 0, -1)
        flags = np.zeros(len(seq), bool)
        flags[out_idx] = True
        a, j = 0, 0  # next sequence index, next output index
        while a < len(seq):
            b = min(len(seq), a + llm.n_batch)
            n_out = int(np.searchsorted(out_idx, b) - j)
            if n_out > window:  # end the window right after its window-th output row
                b = int(out_idx[j + window - 1]) + 1
                n_out = window
            chunk = seq[a:b]
            batch.set_batch(batch=chunk, n_past=a, logits_all=False)
            for i in range(len(chunk)):
                batch.batch.logits[i] = bool(flags[a + i])
            ctx.decode(batch)
            llm.input_ids[a:b] = chunk
            llm.n_tokens = b
            if n_out:
                rows = np.ctypeslib.as_array(llama_get_logits(ctx.ctx), shape=(n_out, n_vocab_model))
                for r in range(0, n_out, block):
                    part = rows[r : r + block, : self.vocab_size]
                    out = pool.take(len(part)) if pool is not None and len(part) <= pool.rows else np.empty(part.shape, np.float32)
                    np.copyto(out, part)
                    yield out
            j += n_out
            a = b

    forward_on_worker = True

    def forward_threads(self) -> int:
        return self.n_threads  # a CPU build: every layer on the CPU (n_gpu_layers=0)

    def _check_pair(self, prompt: list[int], teacher: list[int]) -> None:
        if not prompt:
            raise LogitdiffError(f"{self.path}: score needs at least one prompt token")
        self._check_ids(prompt, "prompt")
        self._check_ids(teacher, "teacher")
        if len(prompt) + len(teacher) - 1 > self.n_ctx:
            raise LogitdiffError(
                f"{self.path}: prompt ({len(prompt)}) + continuation ({len(teacher)}) tokens exceed n_ctx={self.n_ctx}"
                " (raise it with gguf:PATH,n_ctx=N)"
            )

    def score(self, prompt_ids: Sequence[int], teacher_ids: Sequence[int]) -> np.ndarray:
        blocks = [cast(np.ndarray, b.rows) for b in self.score_blocks([(prompt_ids, teacher_ids)], chunk_bytes=1 << 62)]
        return np.concatenate(blocks) if blocks else np.zeros((0, self.vocab_size), dtype=np.float32)

    def score_blocks(self, batch, positions=None, *, chunk_bytes=None) -> Iterator[Block]:
        """Teacher-forced rows of each pair, one prefill of ``prompt + teacher[:-1]`` per pair,
        in blocks of at most ``chunk_bytes`` of float32 rows (see ``_output_blocks``)."""
        from ..store import DEFAULT_CHUNK_BYTES, FORWARD_CHUNKS, rows_per_block
        from ..store.rowpool import RowPool

        block = rows_per_block(self.vocab_size, chunk_bytes)
        window = rows_per_block(self.vocab_size, FORWARD_CHUNKS * (chunk_bytes or DEFAULT_CHUNK_BYTES))
        most = max((len(t) if positions is None or positions[k] is None else len(positions[k])
                    for k, (_, t) in enumerate(batch)), default=0)
        # buffers of this call's blocks, used again across its pairs (no larger than its rows)
        pool = RowPool(min(block, most), self.vocab_size, np.float32) if most else None
        for k, (p, t) in enumerate(batch):
            prompt, teacher = [int(i) for i in p], [int(i) for i in t]
            if not teacher:
                continue
            self._check_pair(prompt, teacher)
            want = np.arange(len(teacher)) if positions is None or positions[k] is None else np.asarray(positions[k], np.int64)
            if not want.size:
                continue
            if want.min() < 0 or want.max() >= len(teacher):
                raise LogitdiffError(f"{self.path}: scoring pair {k}: positions outside the {len(teacher)} teacher tokens")
            t0 = 0
            for rows in self._output_blocks(prompt + teacher[:-1], len(prompt) - 1 + want, block, window, pool):
                yield Block(k, t0, rows)
                t0 += len(rows)

    def _next_row(self, tok: int, pos: int) -> np.ndarray:
        """Feed one token at position ``pos``; the logits after it (a view of llama.cpp's
        buffer, valid until the next decode)."""
        import llama_cpp

        llm = self.llm
        if not self._fast:
            llm.eval([tok])
            return llm.scores[pos + 1, : self.vocab_size]
        llm._batch.set_batch(batch=[tok], n_past=pos + 1, logits_all=False)
        llm._ctx.decode(llm._batch)
        llm.input_ids[pos + 1] = tok
        llm.n_tokens = pos + 2
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm._ctx.ctx), shape=(1, llm.n_vocab()))[0, : self.vocab_size]

    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Generation:
        """Greedy decoding (ties: lowest id); only token ids are kept, each step's logits
        are read in llama.cpp's buffer and dropped."""
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise LogitdiffError(f"{self.path}: generate needs at least one prompt token")
        self._check_ids(prompt, "prompt")
        if len(prompt) + max_tokens - 1 > self.n_ctx:
            raise LogitdiffError(
                f"{self.path}: prompt ({len(prompt)}) + max_tokens ({max_tokens}) tokens exceed n_ctx={self.n_ctx}"
                " (raise it with gguf:PATH,n_ctx=N)"
            )
        out: list[int] = []
        stopped = "max_tokens"
        if max_tokens <= 0:
            return Generation([], stopped)
        eos = set(self.eos_token_ids)
        row = next(self._output_blocks(prompt, np.array([len(prompt) - 1]), 1))[0]
        pos = len(prompt) - 1
        while True:
            tok = int(np.argmax(row))
            out.append(tok)
            if tok in eos:
                stopped = "eos"
                break
            if len(out) >= max_tokens:
                break
            row = self._next_row(tok, pos)
            pos += 1
        return Generation(out, stopped)

    # ---- identity -------------------------------------------------------------------------
    def identity(self) -> dict:
        import llama_cpp

        from .quantize import ftype_name

        if self._sha256 is None:
            from ..store.filecache import file_sha256_cached

            self._sha256 = file_sha256_cached(self.path)
        return json_clean(default=str, obj={
            "kind": "gguf",
            "spec": self.spec,
            "backend": "llama.cpp",
            "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"),
            "path": str(self.path.resolve()),
            "sha256": self._sha256,
            "size": self.path.stat().st_size,
            "file_type": ftype_name(self.file_type),
            "quant": ftype_name(self.file_type),
            "arch": self.arch,
            "name": self.model_name,
            "n_ctx": self.n_ctx,
            "threads": self.n_threads,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": self.tokenizer_hash,
            "extra_bufts": True if self.repack else False if extra_bufts_supported() else "not supported by this llama-cpp-python",
            "logits": "output rows only, in blocks" if self._fast else "Llama.eval with logits_all (binding lacks the internals)",
        })

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            with contextlib.suppress(Exception), load_lock, llama_log_errors_only():
                llm.close()
            self.llm = None

    def __del__(self):
        # a source dropped unclosed frees its context quietly too (llama.cpp logs on free)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def open_gguf(spec: Spec) -> GGUFSource:
    """The registry's factory for ``gguf:`` specs."""
    return GGUFSource.from_spec(spec)


def open_gguf_tokenizer(spec: Spec) -> GGUFSource:
    """The registry's tokenizer-only factory for ``gguf:`` specs (vocabulary only)."""
    return GGUFSource.tokenizer_from_spec(spec)
