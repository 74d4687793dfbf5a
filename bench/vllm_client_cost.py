"""How much of a vLLM capture is logitdiff's client (diagnostic for served_bench).

Starts vLLM (``--skip-tokenizer-init``) on a random Llama (V = 2048, hidden 256, 2 layers),
then times, median of 5: ``ServedSource.score_many`` of 16 sequences (128 prompt + 32
teacher tokens, K = 64, 4 per request); the same four requests sent with bare httpx and not
parsed; and ``json.loads`` of those answers alone.

    python bench/vllm_client_cost.py [OUT]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    import httpx
    from served_bench import _pairs, make_model
    from servers import vllm_server

    from logitdiff.sources import open_source

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm_client_cost")
    d = make_model(out, vocab=2048, hidden=256, layers=2)
    pairs = _pairs(d, 16, 128, 32)
    with vllm_server(d, out / "logs", max_logprobs=64, extra=["--no-enable-prefix-caching", "--skip-tokenizer-init"]) as srv:
        with open_source(f"openai:{srv.url},top_k=64,concurrency=8,batch=4,tokenizer={d}") as src:
            src.score_many(pairs[:4])  # warm up
            bodies = [{"model": src.model, "prompt": [p + t for p, t in pairs[i : i + 4]], "max_tokens": 1,
                       "prompt_logprobs": 64, "temperature": 1.0} for i in range(0, len(pairs), 4)]

            async def raw():
                async with httpx.AsyncClient(base_url=srv.url, timeout=120) as h:
                    rs = await asyncio.gather(*(h.post("/v1/completions", json=b) for b in bodies))
                    return [r.content for r in rs]

            cap, bare, parse = [], [], []
            for _ in range(5):
                t0 = time.perf_counter()
                src.score_many(pairs)
                cap.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                contents = asyncio.run(raw())
                bare.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for c in contents:
                    json.loads(c)
                parse.append(time.perf_counter() - t0)
    print(f"answers: {sum(len(c) for c in contents):,} bytes; median of 5: score_many {statistics.median(cap):.3f} s, "
          f"bare httpx unparsed {statistics.median(bare):.3f} s, json.loads alone {statistics.median(parse):.3f} s")


if __name__ == "__main__":
    main()
