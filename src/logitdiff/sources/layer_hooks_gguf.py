"""llama.cpp's layer hooks: a second context on an open
:class:`~logitdiff.sources.gguf.GGUFSource`'s loaded model whose graph evaluation callback
copies the per-layer outputs (:mod:`.layer_hooks`)."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Sequence

import numpy as np

from ..errors import LogitdiffError
from .gguf import llama_log_errors_only, load_lock
from .layer_families import Family


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h: type, buffer, ne[4], nb[4])."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


_GGML_TYPE_F32 = 0


def _ggml_functions():
    """``ggml_get_name`` and ``ggml_backend_tensor_get`` from the binding's bundled ggml."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    get_name = lib.ggml_get_name
    get_name.argtypes, get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    tensor_get = lib.ggml_backend_tensor_get
    tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    tensor_get.restype = None
    return get_name, tensor_get


class GGUFLayers:
    """A llama.cpp source's per-layer hidden states: a second context on the source's loaded
    model whose graph evaluation callback (``cb_eval``) copies the named per-layer outputs
    (``l_out-i``, ``embd``) as they are computed; the source's own context is untouched.

    The callback sees tensors per ubatch: a decode of more tokens than ``n_ubatch`` would be
    split, so rows are collected per ubatch, in order (a point seen again starts the next
    ubatch). All but the last layer hold every token of the ubatch; the last layer holds
    only the output rows (llama.cpp gathers them before the last layer's attention), which
    are exactly the selected rows here (only those are flagged for logits)."""

    engine = "gguf"
    # the decode in progress, for the callback (set by _decode)
    _sel: np.ndarray  # the selected (output) rows of the decode
    _ub0: int  # first token of the current ubatch
    _ub_n: int  # tokens in the current ubatch
    _seen: set[int]  # points seen in the current ubatch
    _out: np.ndarray  # [points, selected rows, hidden] being filled
    _out_done: int  # output rows of the last point filled so far

    def __init__(self, source, family: Family, *, window: int, split: bool = False):
        import llama_cpp

        self.src = source
        self.split = split
        llm = source.llm
        if not getattr(source, "_fast", False):
            raise LogitdiffError(f"{source.spec}: this llama-cpp-python lacks the internals per-layer capture needs")
        model = llm._model.model
        self.family = family
        self.n_layer = int(llama_cpp.llama_model_n_layer(model))
        self.hidden = int(llama_cpp.llama_model_n_embd(model))
        self.n_vocab = int(llm.n_vocab())
        names = (["embd"] if self.family.embedding else []) + [f"l_out-{i}" for i in range(self.n_layer)]
        self._point = {n.encode(): j for j, n in enumerate(names)}
        self._last = len(names) - 1
        self._get_name, self._tensor_get = _ggml_functions()
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval)
        # the source's own context settings (KV cache types, flash attention, threads...), so
        # the numbers are those of its plain capture; only the batch sizes and the callback differ
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        self.window_tokens = max(1, min(int(window), int(llm.n_ctx())))
        params.n_batch = params.n_ubatch = self.window_tokens
        params.cb_eval = self._cb
        params.cb_eval_user_data = None
        with load_lock, llama_log_errors_only():  # llama.cpp logs a context's creation at info level
            self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise LogitdiffError(f"{source.spec}: llama.cpp could not create a context for per-layer capture")
        self.batch = llama_cpp.llama_batch_init(self.window_tokens, 0, 1)
        self._error: BaseException | None = None

    def begin(self) -> None:
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        import llama_cpp

        if getattr(self, "ctx", None):
            with load_lock, llama_log_errors_only():
                llama_cpp.llama_batch_free(self.batch)
                llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # called by llama.cpp from the decode (same thread): never raise through C
    def _eval(self, t, ask, user_data):
        try:
            j = self._point.get(self._get_name(t))
            if ask:
                return j is not None
            if j is None:
                return True
            head = _TensorHead.from_address(t)
            h, rows = int(head.ne[0]), int(head.ne[1])
            if head.type != _GGML_TYPE_F32 or h != self.hidden or head.ne[2] != 1 or head.nb[1] != 4 * h:
                raise LogitdiffError(f"{self.src.spec}: llama.cpp tensor {self._get_name(t).decode()} is not a contiguous "
                                     f"F32 [{self.hidden}, rows] block")
            if j in self._seen:  # the same point again: the next ubatch of this decode
                self._ub0 += self._ub_n
                self._seen.clear()
            self._seen.add(j)
            buf = np.empty((rows, h), np.float32)
            self._tensor_get(t, buf.ctypes.data, 0, buf.nbytes)
            if j == self._last:  # output rows only, in order
                lo = self._out_done
                self._out[j, lo : lo + rows] = buf
                self._out_done += rows
            else:
                self._ub_n = rows
                lo, hi = int(np.searchsorted(self._sel, self._ub0)), int(np.searchsorted(self._sel, self._ub0 + rows))
                self._out[j, lo:hi] = buf[self._sel[lo:hi] - self._ub0]
            return True
        except BaseException as e:  # noqa: BLE001 - reported after the decode
            self._error = e
            return False

    def _decode(self, tokens, n_past: int, sel: np.ndarray, out: np.ndarray, logits: np.ndarray, row0: int) -> None:
        import llama_cpp

        b = self.batch
        n = len(tokens)
        flags = np.zeros(n, bool)
        flags[sel] = True
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = bool(flags[i])
        self._sel, self._ub0, self._ub_n, self._seen, self._out_done = sel, 0, n, set(), 0
        self._out = out[:, row0 : row0 + len(sel)]
        self._error = None
        rc = llama_cpp.llama_decode(self.ctx, b)
        if self._error is not None:
            raise self._error if isinstance(self._error, LogitdiffError) else LogitdiffError(
                f"{self.src.spec}: reading llama.cpp's per-layer tensors failed ({type(self._error).__name__}: {self._error})")
        if rc != 0:
            raise LogitdiffError(f"{self.src.spec}: llama.cpp decode failed (status {rc})")
        if self._out_done != len(sel):
            raise LogitdiffError(f"{self.src.spec}: llama.cpp's last layer held {self._out_done} output rows, expected {len(sel)}")
        if len(sel):
            rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(len(sel), self.n_vocab))
            logits[row0 : row0 + len(sel)] = rows[:, : self.src.vocab_size]

    def window(self, tokens: Sequence[int], n_past: int, sel: np.ndarray):
        n = len(tokens)
        if n_past + n > self.src.n_ctx:
            raise LogitdiffError(f"{self.src.spec}: a sequence of more than {n_past + n - 1} tokens exceeds n_ctx={self.src.n_ctx} "
                                 "(raise it with gguf:PATH,n_ctx=N)")
        out = np.empty((len(self._point), len(sel), self.hidden), np.float32)
        logits = np.empty((len(sel), self.src.vocab_size), np.float32)
        cuts = [0, n // 2, n] if self.split and n >= 2 else [0, n]
        for a, b in zip(cuts, cuts[1:]):
            lo, hi = int(np.searchsorted(sel, a)), int(np.searchsorted(sel, b))
            self._decode(tokens[a:b], n_past + a, sel[lo:hi] - a, out, logits, lo)
        return out, logits


