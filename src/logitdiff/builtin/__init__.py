"""Stage *builtin*: the bundled model and workload, resolved to sources. Imports `sources` and
below.

The bundled default: a tiny Llama trained by ``training/train_tiny.py``, its workload, and its
GGUF quant ladder built on demand.

Specs:

    builtin:tiny                 transformers, BF16 (the reference of ``logitdiff run``)
    builtin:tiny,dtype=float32   transformers, F32
    builtin:tiny-F32             llama.cpp, F32 GGUF exported from the same weights
    builtin:tiny-BF16            llama.cpp, BF16 GGUF (the cross-engine floor)
    builtin:tiny-Q8_0 ... -Q2_K  llama.cpp quantizations (see ``LADDER``)

GGUF files are built the first time they are asked for into ``$LOGITDIFF_CACHE`` (default
``~/.cache/logitdiff``), under a directory keyed by a hash of the weights, tokenizer and
exporter version, so they are rebuilt exactly when any of those change.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LogitdiffError

HERE = Path(__file__).parent
TINY_DIR = HERE / "tiny"
WORKLOAD = HERE / "workload.jsonl"
# The quant ladder of `logitdiff run`, best to worst.
LADDER = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")
GGUF_TYPES = ("F32", "BF16") + LADDER


def cache_dir() -> Path:
    """Where the ladder is built: :func:`logitdiff.sources.quantize.default_cache_dir` (one definition)."""
    from ..sources.quantize import default_cache_dir

    return default_cache_dir()


def gguf_path(name: str, progress=None) -> Path:
    """Path of ``builtin:tiny-<name>``, building the ladder entry on demand."""
    from ..sources.quantize import build_ladder

    if name not in GGUF_TYPES:
        raise LogitdiffError(f"builtin:tiny-{name}: unknown type (expected one of {', '.join(GGUF_TYPES)})")
    quants = [name] if name in LADDER else []
    paths = build_ladder(TINY_DIR, cache_dir(), quants, progress=progress)
    return Path(paths[name])


def open_builtin(spec, tokenizer_only: bool = False):
    """Open a ``builtin:`` spec (already parsed): the registry's factory for ``builtin:``
    (named there as a string, so neither package imports the other at import time).
    ``tokenizer_only``: the tokenizer alone (no weights; a ``tiny-TYPE`` GGUF is still built)."""
    from ..sources.base import parse_spec

    target = spec.target
    if target != "tiny" and not target.startswith("tiny-"):
        raise LogitdiffError(
            f"source spec {spec.text!r}: unknown builtin {target!r} (expected tiny or tiny-TYPE, TYPE in {', '.join(GGUF_TYPES)})"
        )
    if not TINY_DIR.joinpath("config.json").exists():
        raise LogitdiffError(f"{TINY_DIR}: the bundled model is missing from this installation")
    # The bundled model is far too small to gain from intra-op threads, and on a busy
    # machine spinning worker threads make it 10-50x slower (measured: 48 greedy tokens
    # 0.4 s with 1 thread, 8-25 s with 2 on a loaded 2-core box). One thread unless asked:
    # llama.cpp takes it per context; for transformers it is recorded in ``source.threads``
    # and applied by the program's entry point (opening a source sets nothing process-wide).
    options = {"threads": "1", **spec.options}
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    if target == "tiny":
        from ..sources.hf import HFSource

        hf_spec = parse_spec(f"hf:{TINY_DIR}" + ("," + opts if opts else ""))
        if "dtype" not in hf_spec.options:
            hf_spec.options["dtype"] = "bfloat16"
        src = HFSource.tokenizer_from_spec(hf_spec) if tokenizer_only else HFSource.from_spec(hf_spec)
        src.spec = spec.text
        return src
    from ..sources.gguf import GGUFSource  # target is tiny-TYPE (checked above)

    path = gguf_path(target[len("tiny-"):])
    g_spec = parse_spec(f"gguf:{path}" + ("," + opts if opts else ""))
    gguf_src = GGUFSource.tokenizer_from_spec(g_spec) if tokenizer_only else GGUFSource.from_spec(g_spec)
    gguf_src.spec = spec.text
    return gguf_src


def open_builtin_tokenizer(spec):
    """The registry's tokenizer-only factory for ``builtin:`` specs."""
    return open_builtin(spec, tokenizer_only=True)
