"""The quant ladder: F32/BF16 GGUF exports and llama.cpp quantizations of one HF model.

* :func:`quantize` runs llama.cpp's own quantizer (``llama_model_quantize`` through
  llama-cpp-python, default params + the ``LLAMA_FTYPE_MOSTLY_*`` file type, no imatrix);
* :func:`check_tensor_types` reads the result with ``gguf.GGUFReader`` and verifies that
  the attention/FFN weights really hold the intended type: the *dominant* type (by
  parameter count) must be the ftype's base type (K-quant mixes legitimately put some
  tensors higher, e.g. Q4_K_M keeps some ``attn_v``/``ffn_down`` at Q6_K), and no weight
  may have silently fallen back to a non-K / 32-block type (``Q4_0``, ``Q5_0``,
  ``Q5_1``, ``Q8_0``, ``IQ4_NL``) or to a float type because its rows are not a
  multiple of 256;
* :func:`build_ladder` builds F32 + BF16 + the requested quants on demand into a cache
  directory keyed by a hash of the source weights, tokenizer files, exporter version and
  llama.cpp version; writes are atomic (temp file, rename) and existing files are reused.

``IQ4_XS`` (like all K-quants and ``Q8_0``) needs no importance matrix in llama.cpp;
``Q2_K_S`` and the ``IQ1``/``IQ2``/``IQ3_XXS`` types do and are not offered here.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

from ..errors import LogitdiffError
from ..store.files import atomic_path, atomic_write_json
from .gguf_export import EXPORTER_VERSION, TOKENIZER_FILES, export_gguf, weight_files

#: ladder name -> llama.cpp LLAMA_FTYPE value (llama.h ``enum llama_ftype``)
FTYPES: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "BF16": 32,
}
FTYPE_NAMES: dict[int, str] = {v: k for k, v in FTYPES.items()}

#: the ftypes :func:`quantize` accepts (llama.cpp quantizations that need no imatrix)
QUANT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "IQ4_XS", "IQ4_NL",
               "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0")

#: default ladder (from high to low precision)
DEFAULT_QUANTS = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")

#: ftype -> the GGML tensor type that must dominate the attention/FFN weights
DOMINANT = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K", "Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K",
    "Q3_K_L": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_S": "Q3_K", "Q2_K": "Q2_K",
    "IQ4_XS": "IQ4_XS", "IQ4_NL": "IQ4_NL",
}
_FLOATS = {"F32", "F16", "BF16", "F64"}
# types llama.cpp falls back to when a row length is not a multiple of the block size
_FALLBACKS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}
_BLOCK_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

ProgressFn = Callable[[str, int, int, str], None]
"""``progress(name, index, total, status)``; status is ``"cached"``, ``"building"`` or ``"built"``."""

_quant_lock = threading.Lock()


def current_llama_log(llama_cpp) -> tuple | None:
    """The (callback, user_data) llama.cpp logs to now, or None where the binding has no
    ``llama_log_get``."""
    get = getattr(llama_cpp, "llama_log_get", None)
    if get is None:  # pragma: no cover - older bindings
        return None
    cb, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    get(ctypes.byref(cb), ctypes.byref(user_data))
    return cb, user_data


@contextlib.contextmanager
def _captured_llama_log(llama_cpp, sink: list[str]):
    """Route llama.cpp's log to ``sink`` for the duration of one call, then put back exactly
    the callback that was installed before (llama.cpp's log callback is process-wide: nothing
    of ours stays installed after return)."""

    @llama_cpp.llama_log_callback
    def _cb(level, text, user_data):  # pragma: no cover - called from C
        try:
            sink.append(text.decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001
            pass

    before = current_llama_log(llama_cpp)
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
    try:
        yield
    finally:
        if before is not None:
            llama_cpp.llama_log_set(*before)
        else:  # pragma: no cover - no llama_log_get: llama-cpp-python's own callback
            from llama_cpp._logger import llama_log_callback as _default

            llama_cpp.llama_log_set(_default, ctypes.c_void_p(0))


def ftype_name(ftype: int | None) -> str | None:
    """``general.file_type`` value -> ladder name (``15`` -> ``"Q4_K_M"``)."""
    if ftype is None:
        return None
    return FTYPE_NAMES.get(int(ftype), f"ftype{int(ftype)}")


def _resolve_ftype(ftype: str | int) -> tuple[str, int]:
    if isinstance(ftype, int):
        if ftype not in FTYPE_NAMES:
            raise LogitdiffError(f"unknown llama.cpp file type {ftype}")
        return FTYPE_NAMES[ftype], ftype
    name = str(ftype).upper()
    if name not in FTYPES:
        raise LogitdiffError(
            f"unknown quant type {ftype!r} (expected one of {', '.join(('F32', 'BF16') + QUANT_TYPES)})"
        )
    return name, FTYPES[name]


# ------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------


def quantize(src: str | Path, dst: str | Path, qtype: str, *, nthread: int = 0, check: bool = True,
             allow_requantize: bool = False, allow_fallbacks: bool = False) -> Path:
    """Quantize GGUF ``src`` to ``dst`` with llama.cpp's quantizer (atomic write).
    ``allow_requantize``: ``src`` may itself be quantized (a GGUF-only model's ladder is
    made from the quant it ships; llama-quantize --allow-requantize)."""
    name, ftype = _resolve_ftype(qtype)
    if name not in QUANT_TYPES:
        raise LogitdiffError(f"quant type {name!r} is not a llama.cpp quantization offered here ({', '.join(QUANT_TYPES)})")
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise LogitdiffError(f"{src}: GGUF file not found")
    try:
        import llama_cpp
    except ImportError:
        raise LogitdiffError("quantizing needs llama-cpp-python (pip install 'logitdiff[gguf]')") from None

    dst.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", ftype)
    params.nthread = int(nthread)
    params.allow_requantize = bool(allow_requantize)
    with atomic_path(dst) as tmp:  # dst appears whole and checked, or not at all
        # llama.cpp logs a line per tensor (and fallback warnings) while quantizing: capture
        # them instead of printing, and quote the last lines if quantization fails.
        lines: list[str] = []
        with _quant_lock, _captured_llama_log(llama_cpp, lines):
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            text = "".join(lines)
            errs = [ln.strip() for ln in text.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
            why = f": {errs[-1]}" if errs else ""
            raise LogitdiffError(f"{src}: llama.cpp quantization to {name} failed (status {rc}){why}")
        if check:
            check_tensor_types(tmp, name, display=dst, allow_fallbacks=allow_fallbacks)
    return dst


def check_tensor_types(path: str | Path, expected_ftype: str | int, *, display: str | Path | None = None,
                       allow_fallbacks: bool = False) -> dict:
    """Verify the weight types in a GGUF; return ``{"dominant", "counts", "file_type", "fallbacks"}``.

    Raises :class:`LogitdiffError` naming the file and tensor on a mismatch. With
    ``allow_fallbacks`` (llama-quantize's own semantics, ``logitdiff quantize``), a weight whose
    rows are not a multiple of the type's block size and that llama.cpp therefore wrote in a
    fallback type is listed in ``fallbacks`` (tensor name -> type written) instead, and the
    dominant type may then differ from the requested one (``dominant`` says which it is).
    """
    import gguf

    path = Path(path)
    shown = Path(display) if display is not None else path
    name, ftype = _resolve_ftype(expected_ftype)
    want = DOMINANT[name]
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse error is a bad file
        raise LogitdiffError(f"{shown}: not a readable GGUF file ({e})") from None
    ft_field = reader.fields.get("general.file_type")
    file_type = int(ft_field.contents()) if ft_field is not None else None
    if file_type is not None and file_type != ftype:
        raise LogitdiffError(
            f"{shown}: general.file_type is {ftype_name(file_type)}, expected {name}"
        )

    params: dict[str, int] = {}
    counts: dict[str, int] = {}
    fallbacks: dict[str, str] = {}
    quantized = name not in _FLOATS
    for t in reader.tensors:
        tname = t.name
        ttype = t.tensor_type.name
        dims = [int(d) for d in t.shape if int(d) > 1]
        is_block_weight = (
            tname.startswith("blk.") and tname.endswith(".weight")
            and tname.split(".")[2] in _BLOCK_WEIGHTS
        )
        if tname in ("token_embd.weight", "output.weight"):
            if quantized and ttype in _FLOATS:
                raise LogitdiffError(f"{shown}: tensor {tname} is {ttype}, expected a quantized type for {name}")
            if not quantized and ttype != want:
                raise LogitdiffError(f"{shown}: tensor {tname} is {ttype}, expected {want}")
            continue
        if not is_block_weight or len(dims) < 2:
            continue
        counts[ttype] = counts.get(ttype, 0) + 1
        params[ttype] = params.get(ttype, 0) + int(t.n_elements)
        if not quantized:
            if ttype != want:
                raise LogitdiffError(f"{shown}: tensor {tname} is {ttype}, expected {want}")
            continue
        if allow_fallbacks and (ttype in _FLOATS or (ttype in _FALLBACKS and ttype != want)):
            fallbacks[tname] = ttype
            continue
        if ttype in _FLOATS:
            raise LogitdiffError(
                f"{shown}: tensor {tname} was left as {ttype} in a {name} file (row length {t.shape[0]})"
            )
        if ttype in _FALLBACKS and ttype != want:
            raise LogitdiffError(
                f"{shown}: tensor {tname} fell back to {ttype} in a {name} file "
                f"(row length {int(t.shape[0])} is not a multiple of the {want} block size)"
            )
    if not params:
        raise LogitdiffError(f"{shown}: no attention/FFN weight tensors found")
    dominant = max(params, key=lambda t: params[t])
    if dominant != want and not allow_fallbacks:
        raise LogitdiffError(
            f"{shown}: dominant weight type is {dominant} ({params[dominant]} of {sum(params.values())} "
            f"weights), expected {want} for {name}"
        )
    return {"dominant": dominant, "counts": counts, "file_type": ftype_name(file_type), "fallbacks": fallbacks}


# ------------------------------------------------------------------------------------
# ladder cache
# ------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where built files (quants, ladders) go: the cache root (store.filecache.cache_root, one
    reading of $LOGITDIFF_CACHE). With ``LOGITDIFF_CACHE=off`` nothing is kept in a cache,
    but a built file still needs a home while the run reads it: the system's temporary
    directory, per user -- never a folder named ``off`` in the working directory."""
    from ..store.filecache import cache_root

    root = cache_root()
    if root is None:
        import tempfile

        return Path(tempfile.gettempdir()) / f"logitdiff-uncached-{os.getuid()}"
    return root


def _llama_cpp_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001
        try:
            import llama_cpp

            return str(getattr(llama_cpp, "__version__", "unknown"))
        except ImportError:
            return "none"


def _file_digest(path: Path, memo: dict) -> str:
    """sha256 of a file, memoized by (path, size, mtime) in ``memo``."""
    st = path.stat()
    key = str(path.resolve())
    hit = memo.get(key)
    if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
        return hit[2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    memo[key] = [st.st_size, st.st_mtime_ns, digest]
    return digest


def source_key(hf_dir: str | Path, cache_dir: str | Path | None = None) -> str:
    """Hash of the model's weights + config + tokenizer files + exporter/llama.cpp versions."""
    hf_dir = Path(hf_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    memo_path = cache_dir / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    h.update(f"exporter={EXPORTER_VERSION};llama_cpp={_llama_cpp_version()}\n".encode())
    files = [hf_dir / "config.json"] + weight_files(hf_dir) + [hf_dir / f for f in TOKENIZER_FILES]
    for f in files:
        if f.is_file():
            h.update(f"{f.name}={_file_digest(f, memo)}\n".encode())
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(memo_path, memo, indent=None)
    except OSError:
        pass
    return h.hexdigest()[:20]


def ladder_dir(hf_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    hf_dir = Path(hf_dir)
    return cache_dir / "ladders" / f"{hf_dir.resolve().name}-{source_key(hf_dir, cache_dir)}"


def build_ladder(
    hf_dir: str | Path,
    cache_dir: str | Path | None = None,
    quants: Iterable[str] = DEFAULT_QUANTS,
    progress: ProgressFn | None = None,
    *,
    nthread: int = 0,
) -> dict[str, Path]:
    """Build (or reuse) ``F32``, ``BF16`` and ``quants`` GGUFs of ``hf_dir``; return {name: path}.

    Quants are made from the F32 export. ``progress(name, index, total, status)`` is called
    before (``"building"``) and after (``"built"``) each file, or once with ``"cached"``.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise LogitdiffError(f"{hf_dir}: model directory not found")
    qnames = []
    for q in quants:
        n, _ = _resolve_ftype(q)
        if n not in QUANT_TYPES:
            raise LogitdiffError(f"quant type {q!r} is not offered ({', '.join(QUANT_TYPES)})")
        if n not in qnames:
            qnames.append(n)
    out = ladder_dir(hf_dir, cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = ["F32", "BF16"] + qnames
    total = len(steps)
    stem = hf_dir.resolve().name
    paths: dict[str, Path] = {}
    for i, step in enumerate(steps):
        path = out / f"{stem}-{step}.gguf"
        paths[step] = path
        if path.is_file():
            if progress:
                progress(step, i, total, "cached")
            continue
        if progress:
            progress(step, i, total, "building")
        if step in ("F32", "BF16"):
            export_gguf(hf_dir, path, step, name=stem)
        else:
            quantize(paths["F32"], path, step, nthread=nthread)
        if progress:
            progress(step, i, total, "built")
    manifest = out / "ladder.json"
    if not manifest.is_file():
        atomic_write_json(manifest, {
            "source": str(hf_dir.resolve()),
            "exporter_version": EXPORTER_VERSION,
            "llama_cpp": _llama_cpp_version(),
        })
    return paths
