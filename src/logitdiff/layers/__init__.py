"""Stage *layers*: where in the network a candidate's drift starts — per-layer attribution
through each engine's layer hooks (this module). Imports `capture`, `sources`, `store` and
below.

Where the drift starts: per-layer attribution between a candidate and its reference.

For every teacher-forced position of a reference RUN's tokens, the residual stream after
each decoder layer (and after the token embedding, where both engines name it) of the
reference and of each candidate, compared per layer:

* ``rel_l2``  = ‖c − r‖ / ‖r‖ (relative L2 error of the candidate's hidden state),
* ``cosine``  = r·c / (‖r‖ ‖c‖),
* ``sqnr_db`` = 10 log10(‖r‖² / ‖c − r‖²) (inf where the states are identical),

all in float64 from the engines' float32 (or bf16) states; per layer the median and p95
over positions, the growth (median ``rel_l2`` of a layer / that of the layer before), the
first layer where a candidate leaves the floor band, and per item the rank correlation
between a layer's error and the final KL of the position (the KL from the same forward
passes' logits, :func:`logitdiff.numerics.metrics.full_vocab`).

The point compared is the same in both engines: transformers' decoder layer ``i`` output
(a forward hook on ``model.layers[i]``; note ``hidden_states[-1]`` of a transformers
forward is *after* the final norm, so it is not used) and llama.cpp's ``l_out-i`` (read
through the graph evaluation callback ``cb_eval`` of a second llama.cpp context on the
same loaded model). The final norm and the output head are not a layer: their effect is the
KL itself.

Memory: sequences are prefilled a window of tokens at a time over a KV cache (the window
sized from ``--chunk-size``); a window's hidden states of every compared point,
``[points, rows, H]`` float32, exist for the reference and for one candidate at a time,
plus their logits ``[rows, V]``. Per position only scalars are kept (``points`` floats per
figure), never ``[layers x positions x H]``.

The floor (what arithmetic noise alone does per layer): by default the reference rerun with
every window prefilled in two forward passes instead of one (other matrix shapes, other
float rounding: the analogue of the noise floor's moved batch boundaries); or any source
spec compared like a candidate (e.g. ``builtin:tiny-BF16``: the cross-engine floor).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import LogitdiffError, renamed_parameters
from ..contracts import LAYERS_SCHEMA

if TYPE_CHECKING:
    from ..contracts import LayersComparison, LayersDoc, LayersGeometry, LayersItem, LayersPerPoint

LAYERS_SCHEMA_VERSION = "1.0"
from ..defaults import FLOOR_RERUN  # noqa: E402
FLOOR_NONE = "none"
FLOOR_SPEC = "spec"  # another source, compared like a candidate
TOP_LAYERS = 3  # "the layers that add the most error": how many are named
SERVED_KINDS = ("served", "openai")  # openai: the old name of served:


# ------------------------------------------------------------------------------- numerics
def layer_errors(ref, cand) -> dict[str, np.ndarray]:
    """Per row of two ``[n, H]`` hidden-state blocks (any float dtype): ``rel_l2``,
    ``cosine`` and ``sqnr_db``, float64 ``[n]``, accumulated in float64.

    A reference row of norm 0 gives ``rel_l2`` inf (nan when the candidate's is 0 too);
    identical rows give ``rel_l2`` 0, ``cosine`` 1 and ``sqnr_db`` inf."""
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if r.shape != c.shape or r.ndim != 2:
        raise ValueError(f"layer_errors: shapes {r.shape} and {c.shape} differ or are not [n, H]")
    rr = np.einsum("ij,ij->i", r, r)
    cc = np.einsum("ij,ij->i", c, c)
    rc = np.einsum("ij,ij->i", r, c)
    d = c - r
    dd = np.einsum("ij,ij->i", d, d)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.sqrt(dd / rr)
        cos = rc / np.sqrt(rr * cc)
        sqnr = 10.0 * np.log10(rr / dd)
    cos = np.where(dd == 0, 1.0, cos)
    return {"rel_l2": rel, "cosine": cos, "sqnr_db": sqnr}


def added_error(ref, cand, prev_ref=None, prev_cand=None) -> np.ndarray:
    """Per row: the error a point adds to the stream, ‖e − e_prev‖ / ‖r‖ with e = c − r at
    this point and e_prev at the point before (0 for the first point): what the layer's own
    update changed in the error, whether from its weights or from its input's error passing
    through it. Relative errors alone can fall across a layer that adds error (the stream's
    norm grows), so this, not ``growth``, names the layers that add the most."""
    r = np.asarray(ref, dtype=np.float64)
    e = np.asarray(cand, dtype=np.float64) - r
    if prev_ref is not None:
        e -= np.asarray(prev_cand, dtype=np.float64) - np.asarray(prev_ref, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("ij,ij->i", e, e) / np.einsum("ij,ij->i", r, r))


def growth(medians: Sequence[float]) -> list[float | None]:
    """Each point's median error over the previous point's (None for the first; inf where
    the previous is 0 and this one is not: error that appears from nothing; nan for 0/0)."""
    m = [float(x) for x in medians]
    out: list[float | None] = [None]
    for a, b in zip(m, m[1:]):
        if a == 0:
            out.append(math.inf if b > 0 else math.nan)
        else:
            out.append(b / a)
    return out


def first_beyond(medians: Sequence[float], band: Sequence[float | None] | None) -> int | None:
    """Index of the first point whose median error exceeds the floor band's top (its p95),
    or None when none does (or no floor was measured; a point whose band is undefined,
    None as read back from layers.json, is not judged)."""
    if band is None:
        return None
    for j, (m, b) in enumerate(zip(medians, band)):
        if b is not None and np.isfinite(m) and m > b:
            return j
    return None


def top_added(added: Sequence[float], n: int = TOP_LAYERS) -> list[int]:
    """Indices of the ``n`` points whose median added error is largest (zeros and undefined
    values left out): the layers that add the most error."""
    keyed = [(j, x) for j, x in enumerate(added) if x is not None and math.isfinite(x) and x > 0]
    keyed.sort(key=lambda jx: (-jx[1], jx[0]))
    return [j for j, _ in keyed[:n]]


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), float64."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x), np.float64)
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e - 1) / 2.0
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equal-length vectors (nan when fewer than 3 finite
    pairs or either side is constant)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else math.nan


def _q(x: np.ndarray, q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default) of the non-nan values;
    inf where both neighbours are inf (numpy's own gives nan there: inf - inf)."""
    xs = np.sort(x[~np.isnan(x)])
    if not len(xs):
        return math.nan
    pos = q / 100.0 * (len(xs) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    a, b = float(xs[lo]), float(xs[hi])
    return a if a == b or pos == lo else a + (b - a) * (pos - lo)


def summarize_points(rel: np.ndarray, cos: np.ndarray, sqnr: np.ndarray, added: np.ndarray) -> dict[str, list[float]]:
    """Per point (column) of ``[positions, points]`` figures: median and p95 of rel_l2, mean
    rel_l2, median and p5 of cosine, median SQNR (dB), median added error."""
    cols = range(rel.shape[1])
    return {
        "added_rel_l2_median": [_q(added[:, j], 50) for j in cols],
        "rel_l2_median": [_q(rel[:, j], 50) for j in cols],
        "rel_l2_p95": [_q(rel[:, j], 95) for j in cols],
        "rel_l2_mean": [float(np.nanmean(rel[:, j])) if np.isfinite(rel[:, j]).any() else math.nan for j in cols],
        "cosine_median": [_q(cos[:, j], 50) for j in cols],
        "cosine_p5": [_q(cos[:, j], 5) for j in cols],
        "sqnr_db_median": [_q(sqnr[:, j], 50) for j in cols],
    }


# ------------------------------------------------------------------ architecture families
@dataclass(frozen=True)
class Family:
    """Where one architecture family's per-layer residual stream is, in each engine: the
    decoder layers' outputs (transformers: ``model.layers[i]``; llama.cpp: ``l_out-i``) and,
    when ``embedding``, the token embedding before any scaling (transformers:
    ``model.embed_tokens``; llama.cpp: ``embd``)."""

    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    embedding: bool  # both engines expose the same embedding point


# Gemma scales the embedding by sqrt(H) in a place that differs between transformers
# versions (inside embed_tokens or in the model's forward), so only its layers are compared.
FAMILIES = (
    Family("llama", ("llama", "mistral"), ("llama",), True),
    Family("qwen", ("qwen2", "qwen3"), ("qwen2", "qwen3"), True),
    Family("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"), ("gemma", "gemma2", "gemma3"), False),
)


def family_of(engine: str, arch: str | None, spec: str) -> Family:
    """The family of a transformers ``model_type`` or a GGUF ``general.architecture``."""
    for f in FAMILIES:
        if arch in (f.hf_model_types if engine == "hf" else f.gguf_archs):
            return f
    known = sorted({a for f in FAMILIES for a in (f.hf_model_types if engine == "hf" else f.gguf_archs)})
    raise LogitdiffError(f"{spec}: architecture {arch!r} has no per-layer mapping (layers knows {', '.join(known)})")


def point_names(family: Family, n_layer: int) -> list[str]:
    return (["embedding"] if family.embedding else []) + [f"layer {i}" for i in range(n_layer)]


# -------------------------------------------------------------------------------- engines
class HFLayers:
    """A transformers source's per-layer hidden states, a window of tokens at a time over a
    KV cache; ``split``: each window in two forward passes (the floor's other layout)."""

    engine = "hf"

    def __init__(self, source, *, split: bool = False):
        self.src = source
        self.split = split
        cfg = source.config
        self.family = family_of("hf", getattr(cfg, "model_type", None), source.spec)
        self.layers = list(source.base.layers)
        self.n_layer = len(self.layers)
        self.hidden = int(cfg.hidden_size)
        self.modules = ([source.base.embed_tokens] if self.family.embedding else []) + self.layers
        self._kw: dict = {}

    def begin(self) -> None:
        self._kw = {}

    def close(self) -> None:
        self._kw = {}

    def window(self, tokens: Sequence[int], n_past: int, sel: np.ndarray):
        """Hidden states ``[points, len(sel), H]`` float32 and logits ``[len(sel), V]``
        float32 at the window's rows ``sel`` (indices into ``tokens``, sorted)."""
        import torch

        n = len(tokens)
        self.src._check_len(n_past + n, "per-layer scoring")
        out = np.empty((len(self.modules), len(sel), self.hidden), np.float32)
        logits = np.empty((len(sel), self.src.vocab_size), np.float32)
        cuts = [0, n // 2, n] if self.split and n >= 2 else [0, n]
        dev = self.src.device
        for a, b in zip(cuts, cuts[1:]):
            lo, hi = np.searchsorted(sel, a), np.searchsorted(sel, b)
            here = torch.as_tensor(sel[lo:hi] - a, device=dev)

            def hook(j):
                def keep(module, args, output):
                    h = output[0] if isinstance(output, tuple) else output
                    out[j, lo:hi] = h[0, here].float().cpu().numpy()
                return keep

            handles = [m.register_forward_hook(hook(j)) for j, m in enumerate(self.modules)]
            try:
                with torch.inference_mode():
                    o = self.src.base(input_ids=torch.tensor([list(tokens[a:b])], device=dev), use_cache=True, **self._kw)
                    self._kw = self.src._cache_kw(o)
                    if hi > lo:
                        logits[lo:hi] = self.src._head(o.last_hidden_state[0, here]).float().cpu().numpy()
            finally:
                for h in handles:
                    h.remove()
        return out, logits


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

    def __init__(self, source, *, window: int, split: bool = False):
        import llama_cpp

        self.src = source
        self.split = split
        llm = source.llm
        if not getattr(source, "_fast", False):
            raise LogitdiffError(f"{source.spec}: this llama-cpp-python lacks the internals per-layer capture needs")
        model = llm._model.model
        self.family = family_of("gguf", source.arch, source.spec)
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
        from ..sources.gguf import llama_log_errors_only, load_lock

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

        from ..sources.gguf import llama_log_errors_only, load_lock

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


def geometry_of(source) -> tuple[Family, int, int]:
    """(family, decoder layers, hidden size) of an open source, without running it."""
    from ..sources.gguf import GGUFSource
    from ..sources.hf import HFSource

    if isinstance(source, HFSource):
        cfg = source.config
        return family_of("hf", getattr(cfg, "model_type", None), source.spec), len(source.base.layers), int(cfg.hidden_size)
    if isinstance(source, GGUFSource):
        import llama_cpp

        model = source.llm._model.model
        return (family_of("gguf", source.arch, source.spec), int(llama_cpp.llama_model_n_layer(model)),
                int(llama_cpp.llama_model_n_embd(model)))
    raise LogitdiffError(f"{source.spec}: per-layer hidden states need an in-process hf:, gguf: or builtin: source")


def layer_engine(source, *, window: int, split: bool = False):
    """The per-layer reader of an open source (transformers or llama.cpp)."""
    from ..sources.gguf import GGUFSource
    from ..sources.hf import HFSource

    if isinstance(source, HFSource):
        return HFLayers(source, split=split)
    if isinstance(source, GGUFSource):
        return GGUFLayers(source, window=window, split=split)
    raise LogitdiffError(f"{source.spec}: per-layer hidden states need an in-process hf:, gguf: or builtin: source")


def check_layer_specs(specs: Sequence[str]) -> None:
    """A served source cannot do this: one line, before anything opens."""
    from ..sources import parse_spec

    for s in specs:
        if parse_spec(s).kind in SERVED_KINDS:
            raise LogitdiffError(
                f"{s}: a served source hands out top-K log-probabilities, not hidden states; per-layer attribution "
                "needs an in-process hf:, gguf: or builtin: source"
            )


def check_same_geometry(ref, other) -> None:
    """Family, layer count and hidden size must match: one line naming both sources."""
    a, b = ref.src.spec, other.src.spec
    if ref.family.name != other.family.name:
        raise LogitdiffError(f"{b}: architecture family {other.family.name} differs from the reference {a} ({ref.family.name})")
    if ref.n_layer != other.n_layer:
        raise LogitdiffError(f"{b}: {other.n_layer} layers, the reference {a} has {ref.n_layer}")
    if ref.hidden != other.hidden:
        raise LogitdiffError(f"{b}: hidden size {other.hidden}, the reference {a} has {ref.hidden}")


def window_tokens(chunk_bytes: int, points: int, hidden: int, vocab: int) -> int:
    """Tokens per forward pass so that two sides' hidden states of every point and their
    logits, float32, fit ``chunk_bytes``: 2 x (points x H + V) x 4 bytes per row.

    Not counted: the engines' own copies of a window's logits (torch's head output and its
    float32 cast; each llama.cpp context -- reference, floor, every candidate -- keeps its
    own [window, V] output and compute buffers). Measured (hf, V = 248,320, 3 points): peak
    RSS above the loaded models 206 MiB at 64 MiB, 846 MiB at 512 MiB: about 1.7-3x."""
    return max(1, min(2048, int(chunk_bytes // (2 * 4 * (points * hidden + vocab)))))


# ---------------------------------------------------------------------------------- the job
@dataclass
class _Side:
    """Per-position figures of one comparison with the reference (a candidate or the floor)."""

    spec: str
    engine: Any
    rel: np.ndarray
    cos: np.ndarray
    sqnr: np.ndarray
    added: np.ndarray
    kl: np.ndarray
    top1: np.ndarray


@renamed_parameters(teacher="reference_run")
def layer_attribution(
    ref_src,
    cand_srcs: Sequence,
    reference_run,
    *,
    floor_src=None,
    floor: str = FLOOR_RERUN,
    chunk_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> LayersDoc:
    """The layers.json object for open sources over the open reference RUN (``RunReader``).

    ``floor``: ``FLOOR_RERUN`` (the reference, each window in two forward passes),
    ``FLOOR_NONE``, or ``FLOOR_SPEC``: ``floor_src``, an open source compared like a candidate."""
    from ..numerics import metrics as M
    from ..capture import verified_prompts
    from ..store import DEFAULT_CHUNK_BYTES

    chunk_bytes = int(chunk_bytes or DEFAULT_CHUNK_BYTES)
    pairs = verified_prompts(ref_src, reference_run)
    for s in list(cand_srcs) + ([floor_src] if floor_src is not None else []):
        verified_prompts(s, reference_run)
    family, n_layer, hidden = geometry_of(ref_src)
    win = window_tokens(chunk_bytes, len(point_names(family, n_layer)), hidden, ref_src.vocab_size)
    with contextlib.ExitStack() as stack:
        ref = layer_engine(ref_src, window=win)
        stack.callback(ref.close)
        names = point_names(ref.family, ref.n_layer)
        n_pos = sum(len(it.positions) for it, _ in pairs)

        def side(spec, eng):
            stack.callback(eng.close)
            check_same_geometry(ref, eng)
            shape = (n_pos, len(names))
            return _Side(spec, eng, np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan),
                         np.full(shape, np.nan), np.full(n_pos, np.nan), np.zeros(n_pos, bool))

        floor_side = None
        if floor == FLOOR_RERUN:
            floor_side = side(f"{ref_src.spec} (rerun, each window in two forward passes)", layer_engine(ref_src, window=win, split=True))
        elif floor == FLOOR_SPEC:
            floor_side = side(floor_src.spec, layer_engine(floor_src, window=win))
        sides = [side(c.spec, layer_engine(c, window=win)) for c in cand_srcs]
        everyone = ([floor_side] if floor_side else []) + sides
        item_rows: list[tuple[str, int, int]] = []
        row0 = 0
        for it, prompt in pairs:
            teacher_ids = list(it.teacher_ids)
            pos = np.asarray(it.positions, np.int64)
            if not len(pos):
                item_rows.append((it.id, row0, row0))
                continue
            seq = (list(prompt) + teacher_ids[:-1])[: len(prompt) + int(pos.max())]
            sel_all = len(prompt) - 1 + pos
            nxt = np.asarray(teacher_ids, np.int64)[pos]
            ref.begin()
            for s in everyone:
                s.engine.begin()
            done = 0
            for a in range(0, len(seq), win):
                b = min(len(seq), a + win)
                hi = int(np.searchsorted(sel_all, b))
                sel = sel_all[done:hi] - a
                h_ref, z_ref = ref.window(seq[a:b], a, sel)
                rows = slice(row0 + done, row0 + hi)
                for s in everyone:
                    h, z = s.engine.window(seq[a:b], a, sel)
                    for j in range(len(names)):
                        e = layer_errors(h_ref[j], h[j])
                        s.rel[rows, j], s.cos[rows, j], s.sqnr[rows, j] = e["rel_l2"], e["cosine"], e["sqnr_db"]
                        s.added[rows, j] = added_error(h_ref[j], h[j], *((h_ref[j - 1], h[j - 1]) if j else ()))
                    if len(sel):
                        m = M.full_vocab(z_ref, z, nxt[done:hi], k=1)
                        s.kl[rows] = m["kl_nats"]
                        s.top1[rows] = m["top1_match"]
                    del h, z
                done = hi
            item_rows.append((it.id, row0, row0 + len(pos)))
            row0 += len(pos)
            if progress:
                progress(1)
        geometry: LayersGeometry = {"family": ref.family.name, "n_layer": ref.n_layer, "hidden_size": ref.hidden, "points": names,
                    "window_tokens": win, "chunk_bytes": chunk_bytes}
    floor_doc = _comparison(floor_side, item_rows, None) if floor_side else None
    band = floor_doc["per_point"]["rel_l2_p95"] if floor_doc else None
    return {
        "schema": LAYERS_SCHEMA,
        "schema_version": LAYERS_SCHEMA_VERSION,
        "reference": {"spec": ref_src.spec, "engine": ref.engine},
        "teacher": str(reference_run.path),  # layers.json 1.x's name for the reference RUN
        "n_items": len(pairs),
        "n_positions": n_pos,
        "geometry": geometry,
        "method": {
            "point": "residual stream after each decoder layer (before the final norm); 'embedding': the token "
                     "embedding before any scaling. transformers: model.layers[i] outputs (forward hooks); llama.cpp: "
                     "l_out-i (graph evaluation callback)",
            "metrics": "rel_l2 = |c - r| / |r|; cosine = r.c / (|r| |c|); sqnr_db = 10 log10(|r|^2 / |c - r|^2); float64 "
                       "from the engines' float32 (bf16) states; growth = median rel_l2 of a point / that of the point before; "
                       "added_rel_l2 = |e - e_prev| / |r| with e = c - r (the error a layer's own update adds; the layers that "
                       "add the most error are ranked by its median)",
            "floor": _floor_text(floor, floor_side),
            "beyond_floor": "a point leaves the floor band where a candidate's median rel_l2 exceeds the floor's p95",
            "kl": "forward KL(P_ref || P_cand) of each position's final logits, from the same forward passes "
                  "(metrics.full_vocab); correlation per item: Spearman's rank correlation across the item's positions",
            "layout": f"each sequence prefilled {win} tokens per forward pass over a KV cache, one sequence at a time",
        },
        "floor": floor_doc,
        "candidates": [_comparison(s, item_rows, band) for s in sides],
    }


def _floor_text(floor: str, floor_side) -> str:
    if floor == FLOOR_NONE or floor_side is None:
        return "none: no floor was measured; no layer can be read against arithmetic noise"
    if floor == FLOOR_RERUN:
        return ("the reference rerun with every window prefilled in two forward passes instead of one (other matrix "
                "shapes, other float rounding): the arithmetic noise of the reference's own engine")
    return f"{floor_side.spec} compared with the reference like a candidate (e.g. the same weights in another engine)"


def _comparison(s: _Side, item_rows: Sequence[tuple[str, int, int]], band: Sequence[float | None] | None) -> LayersComparison:
    pts = summarize_points(s.rel, s.cos, s.sqnr, s.added)
    names_n = s.rel.shape[1]
    items: list[LayersItem] = []
    for item_id, a, b in item_rows:
        kl = s.kl[a:b]
        items.append({
            "id": item_id, "n": int(b - a),
            "kl_mean_nats": float(np.mean(kl)) if b > a else math.nan,
            "spearman_rel_l2_kl": [spearman(s.rel[a:b, j], kl) for j in range(names_n)],
        })
    rho = np.array([it["spearman_rel_l2_kl"] for it in items], np.float64).reshape(len(items), names_n)
    # the figures are floats (nan/inf where undefined); layers_json writes those as null
    per: LayersPerPoint = {
        "rel_l2_median": list(pts["rel_l2_median"]), "rel_l2_p95": list(pts["rel_l2_p95"]),
        "rel_l2_mean": list(pts["rel_l2_mean"]), "cosine_median": list(pts["cosine_median"]),
        "cosine_p5": list(pts["cosine_p5"]), "sqnr_db_median": list(pts["sqnr_db_median"]),
        "growth": growth(pts["rel_l2_median"]), "added_rel_l2_median": list(pts["added_rel_l2_median"]),
        "spearman_kl_median": [_q(rho[:, j], 50) for j in range(names_n)],
    }
    identical = bool(np.all(np.nan_to_num(s.rel, nan=0.0) == 0) and np.all(np.nan_to_num(s.kl) == 0))
    first = first_beyond(pts["rel_l2_median"], band)
    return {
        "spec": s.spec,
        "engine": s.engine.engine,
        "identical": identical,
        "per_point": per,
        "first_beyond_floor": first,
        "top_added": top_added(pts["added_rel_l2_median"]),
        "kl_mean_nats": float(np.nanmean(s.kl)) if len(s.kl) else math.nan,
        "top1_disagreement": float(1.0 - np.mean(s.top1)) if len(s.top1) else math.nan,
        "items": items,
    }
