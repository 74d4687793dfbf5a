"""Where vLLM spends a prompt-logprobs request (diagnostic for served_bench).

Runs vLLM in process (engine core in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on a model directory, times ``prompt_logprobs: K`` requests against plain prefills of the
same token-id prompts (median of ``--repeats``), then profiles one prompt-logprobs request
with cProfile and prints the functions with the largest cumulative time. Run it with the
vLLM venv's interpreter (scripts/setup_vllm.sh):

    ~/.cache/logitdiff/tools/vllm-venv/bin/python bench/vllm_profile.py src/logitdiff/builtin/tiny
    ~/.cache/logitdiff/tools/vllm-venv/bin/python bench/vllm_profile.py src/logitdiff/builtin/tiny --skip-tokenizer-init
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--length", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    skip = args.skip_tokenizer_init
    llm = LLM(model=args.model, dtype="float32", max_model_len=max(512, args.length + 8), max_logprobs=args.k,
              enforce_eager=True, skip_tokenizer_init=skip, enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(5, vocab, args.length).tolist()) for _ in range(args.sequences)]
    capture = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=args.k, detokenize=not skip)
    prefill = SamplingParams(max_tokens=1, temperature=1.0, detokenize=not skip)
    llm.generate(prompts[:4], capture, use_tqdm=False)
    llm.generate(prompts[:4], prefill, use_tqdm=False)
    times: dict[str, list[float]] = {"capture": [], "prefill": []}
    for _ in range(args.repeats):
        for name, sp in (("capture", capture), ("prefill", prefill)):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
    c, p = statistics.median(times["capture"]), statistics.median(times["prefill"])
    print(f"skip_tokenizer_init={skip}: {args.sequences} x {args.length} tokens, K={args.k}; "
          f"capture {c:.3f} s, prefill {p:.3f} s (median of {args.repeats}); prefill/capture {p / c:.1%}")
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, capture, use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
