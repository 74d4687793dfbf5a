"""``logitdiff quantize``: quantizations of a user's own model, with llama.cpp's own quantizer.

From a GGUF file (requantized, as ``llama-quantize --allow-requantize`` does, when it is
already quantized) or a transformers model directory (exported to an F32 GGUF first), one
GGUF per requested type, written into a QUANT directory with ``quantize.json``: where each
file came from, the llama.cpp that wrote it, and every tensor llama.cpp wrote in a fallback
type because its rows are not a multiple of the type's block size (llama-quantize's own
semantics: such a file is written, not refused, and the list says what it really holds).

The quantizer runs in process through llama-cpp-python (``llama_model_quantize``, the code
``llama-quantize`` calls). An importance matrix cannot be handed to that C call from Python
(it takes a C++ map), so ``imatrix=`` runs the ``llama-quantize`` binary that
``scripts/build_llama_server.sh`` builds beside llama-server, and says so when it is absent.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..contracts import QUANTIZE_SCHEMA
from ..errors import LogitdiffError
from ..store.files import Kind, atomic_write_json, writing
from .quantize import FTYPES, QUANT_TYPES, _llama_cpp_version, _resolve_ftype, check_tensor_types, ftype_name, quantize

FLOAT_EXPORTS = ("F32", "BF16")  # written from a transformers model by the exporter, not quantized
_FLOAT_FILE_TYPES = {FTYPES["F32"], FTYPES["F16"], FTYPES["BF16"]}


@dataclass
class QuantizedFile:
    type: str  # the type asked for
    file: str  # name inside the QUANT directory
    dominant: str  # the GGML type most attention/FFN weights hold
    counts: dict[str, int]
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor -> type llama.cpp wrote instead
    requantized_from: str | None = None
    imatrix: str | None = None


def llama_quantize_binary() -> Path | None:
    """The ``llama-quantize`` built by scripts/build_llama_server.sh (``LOGITDIFF_LLAMA_QUANTIZE``
    overrides), or None."""
    if os.environ.get("LOGITDIFF_LLAMA_QUANTIZE"):
        return Path(os.environ["LOGITDIFF_LLAMA_QUANTIZE"])
    tools = Path(os.environ.get("LOGITDIFF_TOOLS") or Path.home() / ".cache" / "logitdiff" / "tools")
    path = tools / "llama-server" / "current" / "bin" / "llama-quantize"
    return path if path.is_file() else None


def _model_path(model: str) -> tuple[str, Path]:
    """``("gguf" | "hf", path)`` of a model named by a path or a ``gguf:``/``hf:`` spec."""
    kind, _, rest = model.partition(":")
    if kind in ("gguf", "hf") and rest:
        path = Path(rest.split(",")[0])
    else:
        path, kind = Path(model), ""
    if not path.exists():
        raise LogitdiffError(f"{path}: model not found (a GGUF file or a transformers model directory)")
    if not path.is_file() and not path.is_dir():  # a FIFO, a device, a socket: never read
        raise LogitdiffError(f"{path}: not a regular file (a model is a GGUF file or a transformers model directory)")
    if path.is_file():
        if kind == "hf" and path.suffix != ".gguf":
            raise LogitdiffError(f"{model}: an hf: model is a directory (or a .gguf file)")
        return "gguf", path
    if not (path / "config.json").is_file():
        raise LogitdiffError(f"{path}: not a transformers model directory (no config.json)")
    return "hf", path


def _gguf_file_type(path: Path) -> int | None:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse error is a bad file
        raise LogitdiffError(f"{path}: not a readable GGUF file ({e})") from None
    f = reader.fields.get("general.file_type")
    return int(f.contents()) if f is not None else None


def check_types(types: Sequence[str], source_kind: str) -> list[str]:
    names: list[str] = []
    offered = QUANT_TYPES + (FLOAT_EXPORTS if source_kind == "hf" else ())
    for text in types:
        name, _ = _resolve_ftype(text)
        if name not in offered:
            why = "from a GGUF only quantizations are made" if name in FLOAT_EXPORTS else "not offered"
            raise LogitdiffError(f"--types {text}: {why} (one of {', '.join(offered)})")
        if name not in names:
            names.append(name)
    if not names:
        raise LogitdiffError("--types: name at least one type (e.g. Q8_0,Q4_K_M,Q2_K)")
    return names


def _quantize_binary(src: Path, dst: Path, name: str, imatrix: Path, requantize: bool, nthread: int) -> None:
    binary = llama_quantize_binary()
    if binary is None:
        raise LogitdiffError("--imatrix needs llama.cpp's llama-quantize (bash scripts/build_llama_server.sh builds it "
                             "beside llama-server; or set LOGITDIFF_LLAMA_QUANTIZE)")
    cmd = [str(binary), "--imatrix", str(imatrix)] + (["--allow-requantize"] if requantize else [])
    cmd += [str(src), str(dst), name] + ([str(nthread)] if nthread else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not dst.is_file():
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise LogitdiffError(f"{src}: llama-quantize to {name} failed (status {p.returncode}): {last}")


def quantize_model(model: str, types: Sequence[str], out: str | Path, *, overwrite: bool = False,
                   imatrix: str | Path | None = None, nthread: int = 0,
                   progress: Callable[[str, str], None] | None = None) -> list[QuantizedFile]:
    """Write one GGUF per type of ``model`` into the QUANT directory ``out`` (new, or with
    ``overwrite`` an earlier QUANT directory, replaced whole when every file is written)."""
    source_kind, path = _model_path(model)
    names = check_types(types, source_kind)
    if imatrix is not None and not Path(imatrix).is_file():
        raise LogitdiffError(f"--imatrix {imatrix}: file not found")
    source_type = ftype_name(_gguf_file_type(path)) if source_kind == "gguf" else None
    requantize = source_kind == "gguf" and FTYPES.get(source_type or "", -1) not in _FLOAT_FILE_TYPES
    stem = (path.stem if source_kind == "gguf" else path.resolve().name).replace(f"-{source_type}", "").replace(f".{source_type}", "")
    written: list[QuantizedFile] = []
    with writing(out, Kind.QUANT, inputs=[path], overwrite=overwrite) as tmp:
        with tempfile.TemporaryDirectory(dir=tmp, prefix=".f32-") as scratch:
            base = path
            if source_kind == "hf":
                from .gguf_export import export_gguf

                if progress:
                    progress("F32", "exporting")
                base = Path(scratch) / f"{stem}-F32.gguf"
                export_gguf(path, base, "F32", name=stem)
            for name in names:
                if progress:
                    progress(name, "building")
                dst = Path(tmp) / f"{stem}-{name}.gguf"
                if name in FLOAT_EXPORTS:
                    from .gguf_export import export_gguf

                    export_gguf(path, dst, name, name=stem)
                    facts = check_tensor_types(dst, name)
                elif imatrix is not None:
                    _quantize_binary(base, dst, name, Path(imatrix), requantize, nthread)
                    facts = check_tensor_types(dst, name, allow_fallbacks=True)
                else:
                    quantize(base, dst, name, nthread=nthread, allow_requantize=requantize, allow_fallbacks=True)
                    facts = check_tensor_types(dst, name, allow_fallbacks=True)
                written.append(QuantizedFile(name, dst.name, facts["dominant"], facts["counts"], facts["fallbacks"],
                                             source_type if requantize else None,
                                             str(Path(imatrix).resolve()) if imatrix is not None else None))
                if progress:
                    progress(name, "built")
        atomic_write_json(Path(tmp) / "quantize.json", {
            "schema": QUANTIZE_SCHEMA,
            "source": {"model": str(path.resolve()), "kind": source_kind, "file_type": source_type},
            "llama_cpp": _llama_cpp_version(),
            "files": [asdict(f) for f in written],
        })
    return written
