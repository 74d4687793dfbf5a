"""Stage *sources*: the engines (transformers, llama.cpp in process, served llama-server / vLLM
/ SGLang) behind one interface, the one llama-server client that capture and speculation
share (`served/llamacpp_client`; generation mode in `served/generate`), each engine's layer
hooks (`layer_hooks`: stage *layers* reads hidden states only through it), GGUF export and
quantization (`gguf_export`, `quantize`), and the served-batching floor (`served_floor`).
Imports `store`, `workload`, `numerics` and the base modules only. llama.cpp's process-wide
load lock and quiet log (`gguf.load_lock`, `gguf.llama_log_errors_only`) are shared by the
modules of this stage that call llama.cpp (gguf, hf, layer_hooks_gguf) and by nothing outside it.

Sources: where next-token distributions come from, behind one small interface.

A source is named by a spec string ``KIND:TARGET[,key=value...]``:

    hf:PATH[,dtype=bfloat16|float32][,device=cpu|cuda][,threads=N]...
    gguf:PATH[,n_ctx=N][,threads=N]...
    served:URL[,model=NAME][,top_k=K]...   a served model (llama-server, vLLM, SGLang);
                            openai:URL... is another name for it
    (every option of each kind, with type, default and meaning: :mod:`.options`)
    builtin:tiny            the bundled model through transformers (BF16)
    builtin:tiny-F32        ... through transformers in float32
    builtin:tiny-Q4_K_M     a GGUF of the bundled model's quant ladder (llama.cpp)

Kinds are looked up in :mod:`.registry` (``register(kind, factory)`` adds one). A source is
a :class:`FullLogitSource` (rows: float logits ``[r, V]``) or a :class:`TopKSource` (rows:
:class:`TopKRows`), its ``row_kind`` says which (:mod:`.base`). Every source can

* ``render(item)``       -> prompt token ids (chat template and tools applied),
* ``generate(ids, n)``   -> greedy continuation ids (ids only: no logits are kept),
* ``generate_many``      -> several prompts, batched where the backend can,
* ``score(ids, teacher)``-> the rows of ``teacher``; row t is the distribution of the
                            next token after ``ids + teacher[:t]`` (teacher forcing),
* ``score_blocks``       -> the same rows as a stream of bounded blocks (what capture and
                            live compare use: memory is a block, not an output),
* ``identity()``         -> a JSON-able description (files, hashes, dtype, versions...).

Output position t therefore always means "the distribution that predicts teacher[t]".
Opening a source changes nothing process-wide: the thread count a spec asks for is kept
in ``source.threads`` for the program's entry point (:func:`requested_threads`).
"""

from __future__ import annotations

from .base import Block, applied_threads, FullLogitSource, Generation, RowKind, Source, Spec, TopKRows, TopKSource, is_full, is_topk, parse_spec, requested_threads, tokenizer_hash_of
from ..store.filecache import file_sha256
from .registry import kinds, open_source, register

__all__ = [
    "Block", "FullLogitSource", "Generation", "RowKind", "Source", "Spec", "TopKRows", "TopKSource", "file_sha256",
    "is_full", "is_topk", "kinds", "open_source", "parse_spec", "register", "applied_threads", "requested_threads", "tokenizer_hash_of",
]
