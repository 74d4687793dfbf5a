"""The floors of a `logitdiff run`, chosen by what the reference IS (never by a name).

- **cross-engine floor**: the reference's own weights in another engine, scored like a
  candidate (its own report). ``--floor SPEC`` names it; ``--floor auto`` (the default) picks
  it by the rule below; ``--floor none`` turns it off.

  ==========================  ==============================================================
  reference                   automatic floor
  ==========================  ==============================================================
  ``builtin:tiny``            ``builtin:tiny-BF16`` (the same weights as GGUF, llama.cpp)
  ``hf:DIR``                  its GGUF export through llama.cpp: BF16, or F32 for a model
                              loaded in float32 (built once into the ladder cache)
  ``hf:FILE.gguf``            ``gguf:FILE.gguf`` (llama.cpp reading the same file; also
                              ``hf:DIR,gguf_file=NAME``: ``gguf:DIR/NAME``)
  ``gguf:FILE``               ``hf:FILE`` (transformers reading the same GGUF)
  served, anything else       none (the summary says so; name one with ``--floor``)
  ==========================  ==============================================================

- **noise floor**: the reference against reruns of itself. The second rerun (batch
  boundaries moved by half a batch) is skipped where it is provably the same computation as
  the first (:func:`shift_skip_reason`), and a reused reference RUN brings the floor measured
  with it (:func:`read_stored_floor`).

- **``--candidates-from MODEL --types ...``**: the one-line ladder (:func:`ladder_candidates`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from ..capture import SCORE_BATCH
from ..errors import LogitdiffError
from ..sources.base import parse_spec
from ..sources.served_floor import is_served
from ..store.files import DOCUMENT_MAX_BYTES, atomic_write_json, read_input_bytes

AUTO, NONE = "auto", "none"
FLOOR_STORE_SCHEMA = "logitdiff.run-floors/1"


def _float32_hf(spec_options: dict[str, str], model_dir: Path) -> bool:
    """Whether an hf: reference computes in float32: its dtype= option, else its config's."""
    if "dtype" in spec_options:
        return spec_options["dtype"] in ("float32", "fp32")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("dtype") or cfg.get("torch_dtype")) == "float32"


def automatic_floor(reference: str, *, build: bool = True) -> tuple[str | None, str]:
    """``(floor spec or None, how it was chosen)`` for ``--floor auto`` (the module's table).
    ``build``: make an hf: reference's GGUF export now (into the ladder cache)."""
    if is_served(reference):
        return None, ("no automatic cross-engine floor for a served reference (its weights are not at hand here): "
                      "name one with --floor SPEC, e.g. the same model through gguf: or hf:")
    spec = parse_spec(reference)
    if spec.kind == "builtin" and spec.target == "tiny":
        return "builtin:tiny-BF16", "auto: the bundled model's weights as a BF16 GGUF, through llama.cpp"
    if spec.kind == "gguf":
        return f"hf:{spec.target}", "auto: the reference's GGUF file read by transformers"
    if spec.kind == "hf":
        path = Path(spec.target).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf" and "gguf_file" not in spec.options:
            return f"gguf:{path}", "auto: the reference's GGUF file through llama.cpp"
        if path.is_dir() and "gguf_file" in spec.options:  # hf:DIR,gguf_file=NAME: the same file, read by llama.cpp
            return f"gguf:{path / spec.options['gguf_file']}", "auto: the reference's GGUF file through llama.cpp"
        if path.is_dir() and "gguf_file" not in spec.options:
            outtype = "F32" if _float32_hf(spec.options, path) else "BF16"
            how = f"auto: the reference's weights exported to a GGUF {outtype}, through llama.cpp"
            if not build:
                return f"gguf:<{outtype} export of {path}>", how
            from ..sources.quantize import build_ladder

            try:
                return f"gguf:{build_ladder(path, quants=())[outtype]}", how
            except LogitdiffError as e:  # e.g. an architecture the exporter does not write: no floor, said why
                return None, f"auto: no cross-engine floor, the GGUF export of {path} failed ({e}); name one with --floor SPEC"
    return None, (f"no automatic cross-engine floor for {reference}: name one with --floor SPEC (the same weights "
                  "in another engine)")


def choose_floor(floor: str, reference: str) -> tuple[str | None, str]:
    """``(floor spec or None, how it was chosen)`` from ``--floor auto|none|SPEC``."""
    if floor == NONE:
        return None, "none: --floor none"
    if floor == AUTO:
        return automatic_floor(reference)
    parse_spec(floor)  # one clear line for a malformed spec, before the reference capture
    if floor == reference:
        raise LogitdiffError(f"--floor {floor}: that is the reference itself (its reruns are the noise floor); "
                             "name the same weights in another engine")
    return floor, f"--floor {floor}"


def check_floor_arg(floor: str) -> None:
    if floor not in (AUTO, NONE):
        parse_spec(floor)


# ------------------------------------------------------------------------------------------
# noise floor: the rerun with other batch mates, skipped where it cannot differ
# ------------------------------------------------------------------------------------------


def shift_skip_reason(scores_alone: bool, engine: str, n_items: int, shift: int) -> str | None:
    """Why the rerun with batch boundaries moved by ``shift`` items would compute exactly what
    the plain rerun did (None: it might not)."""
    if scores_alone:
        return (f"the rerun with other batch mates was skipped: {engine} scores each sequence in its own forward pass, "
                "so no sequence has batch mates to change")
    if n_items <= shift:
        return (f"the rerun with other batch mates was skipped: the workload's {n_items} items fit in half a batch "
                f"({shift} of {SCORE_BATCH}), so the moved batches hold the same items")
    return None


# ------------------------------------------------------------------------------------------
# the floor measured with a reference RUN, kept beside it and reused with it
# ------------------------------------------------------------------------------------------


def _store_path(ref_dir: Path) -> Path:
    return ref_dir.parent / "reference-floors.json"


def _floor_key(ref_dir: Path, top_logprobs: int) -> str:
    digest = hashlib.sha256(read_input_bytes(ref_dir / "manifest.json", max_bytes=DOCUMENT_MAX_BYTES)).hexdigest()
    return f"{digest};top_logprobs={top_logprobs};batch={SCORE_BATCH}"


def read_stored_floor(ref_dir: Path, top_logprobs: int) -> dict[str, Any] | None:
    """The noise floor measured by an earlier run of this very reference RUN (its manifest's
    sha256) and settings, or None."""
    path = _store_path(ref_dir)
    if not path.is_file():
        return None
    try:
        doc = json.loads(read_input_bytes(path, max_bytes=DOCUMENT_MAX_BYTES))
    except (LogitdiffError, ValueError):
        return None  # unreadable: measured again and rewritten
    if not isinstance(doc, dict) or doc.get("schema") != FLOOR_STORE_SCHEMA or doc.get("key") != _floor_key(ref_dir, top_logprobs):
        return None
    return doc


def write_stored_floor(ref_dir: Path, top_logprobs: int, noise: dict | None, served_side: dict | None) -> None:
    atomic_write_json(_store_path(ref_dir), {"schema": FLOOR_STORE_SCHEMA, "key": _floor_key(ref_dir, top_logprobs),
                                             "noise_floor": noise, "served_side": served_side})


def reused_text(ref_dir: Path) -> str:
    return f"; measured by an earlier run with this reference capture, reused ({_store_path(ref_dir)})"


# ------------------------------------------------------------------------------------------
# --candidates-from MODEL --types ...: the one-line ladder
# ------------------------------------------------------------------------------------------


def _model_digest(model: str) -> tuple[Path, str]:
    kind, _, rest = model.partition(":")
    path = Path((rest if kind in ("gguf", "hf") and rest else model).split(",")[0]).expanduser()
    if path.is_file():
        from ..store.filecache import file_sha256_cached

        return path, file_sha256_cached(path)
    if path.is_dir() and (path / "config.json").is_file():
        from ..sources.quantize import source_key

        return path, source_key(path)
    raise LogitdiffError(f"--candidates-from {model}: model not found (a GGUF file or a transformers model directory)")


def ladder_candidates(model: str, types: Sequence[str], progress=None) -> tuple[list[str], Path]:
    """``gguf:`` specs of ``model`` quantized to each of ``types`` with llama.cpp's quantizer
    (sources.quantize_model), made once into the cache (keyed by the model's bytes, the types
    and the llama.cpp version) and reused; and the QUANT directory that holds them."""
    from importlib.metadata import PackageNotFoundError, version

    from ..sources.quantize import default_cache_dir
    from ..sources.quantize_model import quantize_model

    try:
        llama_cpp = version("llama_cpp_python")
    except PackageNotFoundError:
        llama_cpp = "none"
    path, digest = _model_digest(model)
    key = hashlib.sha256(f"{digest};{','.join(types)};llama_cpp={llama_cpp}".encode()).hexdigest()[:16]
    out = default_cache_dir() / "quants" / f"{path.stem if path.is_file() else path.resolve().name}-{key}"
    index = out / "quantize.json"
    if index.is_file():
        files = json.loads(read_input_bytes(index, max_bytes=DOCUMENT_MAX_BYTES))["files"]
    else:
        files = [{"file": f.file} for f in quantize_model(model, list(types), out, overwrite=out.exists(), progress=progress)]
    return [f"gguf:{out / f['file']}" for f in files], out
