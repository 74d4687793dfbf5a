"""Served-model benchmarks.

    python bench/served_bench.py topk-runs OUT      # runs for `logitdiff topk-error`
    python bench/served_bench.py throughput OUT [--servers llamacpp,vllm]
    python bench/served_bench.py peer OUT            # vs quantdiff, batching modes
    python bench/served_bench.py floors OUT          # the three floors of a served comparison

``topk-runs``: a random Llama (V=2048, hidden 256, 4 layers, F32) through transformers as
the reference on a generated workload, and its Q4_K_M GGUF (llama.cpp, in process) as a
full-logit candidate; then run
``logitdiff topk-error OUT/ref OUT/q4km --top-k 8,20,64,256 --json OUT/topk_error.json``.

``throughput``: teacher-forced top-K capture rate through each server (ServedSource.score_many,
the capture path) against the same server's own prompt-processing rate in the same run:

* vLLM: capture = ``prompt_logprobs: 64`` over ``prompt + teacher``; own rate = the same
  sequences with ``max_tokens: 1`` and no prompt logprobs. Both in tokens/s; ratio target >= 80 %.
  ``vllm-skip-tokenizer``: the same with the server started with ``--skip-tokenizer-init``
  (no per-entry detokenization; the source renders with ``tokenizer=PATH``).
* llama-server: capture = one request per output position (``n_probs: 64``, cached prefix);
  own rate = ``timings.prompt_per_second`` of single full-sequence prefills (no cache).
  Reported: positions/s, wall ms per position-request, server ms per request, HTTP+JSON overhead.

``scale``: the same at V = 248,320 (a random Llama, hidden 128, 2 layers, on the bundled
tokenizer widened with filler tokens: tests/_models.py ``make_wide_llama``): the time and
request count of fetching all token texts; teacher-forced top-64 capture positions/s on
llama-server with its default flags and with the tuned ones, each next to a peer that sends
one request per position (logitdiff's earlier scheduling; on the default flags also
its unpinned variant, the default-flags scheduling of the first change) and to the
server's own prefill rate; prompt tokens the server evaluated per position (its timings); the same for vLLM.

Servers are started by ``tests/servers.py`` (build them first: scripts/build_llama_server.sh,
scripts/setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def make_model(out: Path, *, vocab: int = 2048, hidden: int = 256, layers: int = 4) -> Path:
    from _models import make_random_llama

    d = out / f"model-v{vocab}-h{hidden}-l{layers}"
    if not (d / "config.json").exists():
        make_random_llama(d, vocab_size=vocab, hidden=hidden, intermediate=3 * hidden, layers=layers, heads=4, kv_heads=2, dtype="float32")
    return d


def make_workload(path: Path, n: int, max_tokens: int) -> Path:
    topics = ["def add(a, b):\n    return", "The quick brown fox", "What is 12 + 30?", "import json\n\ndef load(path):",
              "Repeat: hello world.", "class Stack:\n    def push(self, x):", "The lazy dog sleeps because", "textwrap.dedent("]
    rows = []
    for i in range(n):
        t = topics[i % len(topics)]
        if i % 2:
            rows.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"{t} ({i})"}], "max_tokens": max_tokens})
        else:
            rows.append({"id": f"p{i}", "prompt": f"{t} # {i}\n", "max_tokens": max_tokens})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cmd_topk_runs(args) -> None:
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.sources.quantize import build_ladder
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader
    from logitdiff.workload import read_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = make_model(out)
    ladder = build_ladder(d, out / "ladder", ["Q4_K_M"])
    wl = make_workload(out / "workload.jsonl", args.items, args.max_tokens)
    t = time.time()
    if not (out / "ref" / "manifest.json").exists():
        capture_reference(open_source(f"hf:{d},dtype=float32"), read_workload(wl), out / "ref")
    ref = RunReader(out / "ref")
    if not (out / "q4km" / "manifest.json").exists():
        with open_source(f"gguf:{ladder['Q4_K_M']}") as g:
            capture_candidate(g, ref, out / "q4km")
    print(f"runs ready in {time.time() - t:.0f} s: {out}/ref ({ref.manifest['n_positions']} positions, V={ref.vocab_size}), {out}/q4km")
    print(f"logitdiff topk-error {out}/ref {out}/q4km --top-k 8,20,64,256 --json {out}/topk_error.json")


def _pairs(d: Path, n: int, prompt_len: int, teacher_len: int, seed: int = 0):
    """(prompt, teacher) token-id pairs: real text prompts cut to prompt_len, random teachers."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    text = open(REPO / "tests" / "_models.py").read() * 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = int(rng.integers(0, len(ids) - prompt_len))
        out.append((ids[s : s + prompt_len], rng.integers(0, len(tok), teacher_len).tolist()))
    return out


def bench_vllm(d: Path, pairs, logs: Path, K: int, *, skip_tokenizer: bool = False, repeats: int = 3) -> dict:
    import statistics

    from servers import vllm_server

    from logitdiff.sources import open_source

    res = {"server": "vllm" + (" --skip-tokenizer-init" if skip_tokenizer else ""), "K": K, "repeats": repeats}
    # no prefix caching: the plain prefill must not be answered from the cache of its warm-up
    extra = ["--no-enable-prefix-caching"] + (["--skip-tokenizer-init"] if skip_tokenizer else [])
    spec_tail = f",tokenizer={d}" if skip_tokenizer else ""
    with vllm_server(d, logs, max_logprobs=K, extra=extra) as srv:
        res["startup_s"] = round(srv.started_in, 1)
        tokens = sum(len(p) + len(t) for p, t in pairs)
        positions = sum(len(t) for _, t in pairs)
        with open_source(f"openai:{srv.url},top_k={K},concurrency=8,batch=4{spec_tail}") as src:
            src.score_many(pairs[:4])  # warm up
            # the server's own prompt processing of the same sequences: no prompt logprobs
            c = src._client

            async def plain():
                import asyncio

                async def grp(g):
                    body = {"model": src.model, "prompt": [p + t for p, t in g], "max_tokens": 1, "temperature": 0.0}
                    await c.request("POST", "/v1/completions", body)

                await asyncio.gather(*(grp(pairs[i : i + 4]) for i in range(0, len(pairs), 4)))

            c.run(plain())  # warm
            caps, pps = [], []
            for _ in range(repeats):  # alternating, median of each
                t0 = time.perf_counter()
                src.score_many(pairs)
                caps.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.run(plain())
                pps.append(time.perf_counter() - t0)
            cap, pp = statistics.median(caps), statistics.median(pps)
        res.update({
            "capture_s_all": [round(x, 3) for x in caps], "prefill_s_all": [round(x, 3) for x in pps],
            "sequences": len(pairs), "tokens": tokens, "output_positions": positions,
            "capture_s": round(cap, 3), "capture_tokens_per_s": round(tokens / cap, 1), "capture_positions_per_s": round(positions / cap, 1),
            "prefill_s": round(pp, 3), "prefill_tokens_per_s": round(tokens / pp, 1),
            "capture_vs_prefill": round(pp / cap, 3),
        })
    return res


def bench_llamacpp(d: Path, pairs, logs: Path, K: int, threads: int) -> dict:
    import httpx
    from servers import llama_server

    from logitdiff.sources.quantize import build_ladder
    from logitdiff.sources import open_source

    gguf = build_ladder(d, d.parent / "ladder", [])["F32"]
    res = {"server": "llama-server", "K": K, "gguf": "F32"}
    with llama_server(gguf, logs, parallel=4, threads=threads) as srv:
        res["startup_s"] = round(srv.started_in, 1)
        positions = sum(len(t) for _, t in pairs)
        tokens = sum(len(p) + len(t) for p, t in pairs)
        with open_source(f"openai:{srv.url},top_k={K},concurrency=4") as src:
            src.score_many(pairs[:2])
            t0 = time.perf_counter()
            src.score_many(pairs)
            cap = time.perf_counter() - t0
        # per-request server cost of one position request (cached prefix + 1 token + top-K)
        p, t = pairs[0]
        server_ms, wall_ms, cached, evaluated = [], [], 0, 0
        with httpx.Client(timeout=60) as h:
            for j in range(len(t)):
                body = {"prompt": p + t[:j], "n_predict": 1, "n_probs": K, "temperature": 0.0, "cache_prompt": True}
                t1 = time.perf_counter()
                r = h.post(srv.url + "/completion", json=body).json()
                wall_ms.append(1000 * (time.perf_counter() - t1))
                tm = r.get("timings") or {}
                server_ms.append(float(tm.get("prompt_ms", 0)) + float(tm.get("predicted_ms", 0)))
                cached += int(tm.get("cache_n", 0))
                evaluated += int(tm.get("prompt_n", 0))
            # the server's own prompt-processing rate: full-sequence prefills, no cache
            pn, pms = 0, 0.0
            t1 = time.perf_counter()
            for p, t in pairs:
                r = h.post(srv.url + "/completion", json={"prompt": p + t, "n_predict": 1, "temperature": 0.0, "cache_prompt": False}).json()
                tm = r.get("timings") or {}
                pn += int(tm.get("prompt_n", 0))
                pms += float(tm.get("prompt_ms", 0))
            pp_wall = time.perf_counter() - t1
        import statistics as st

        res.update({
            "sequences": len(pairs), "output_positions": positions, "tokens": tokens,
            "capture_s": round(cap, 3), "capture_positions_per_s": round(positions / cap, 1),
            "request_wall_ms_median": round(st.median(wall_ms), 2), "request_server_ms_median": round(st.median(server_ms), 2),
            "request_overhead_ms_median": round(st.median(w - s for w, s in zip(wall_ms, server_ms)), 2),
            "sequential_requests_prompt_tokens_cached": cached, "sequential_requests_prompt_tokens_evaluated": evaluated,
            "prefill_tokens_per_s_server": round(1000 * pn / pms, 1) if pms else None,
            "prefill_tokens_per_s_wall": round(tokens / pp_wall, 1),
            "capture_positions_vs_prefill_tokens": round((positions / cap) / (1000 * pn / pms), 3) if pms else None,
        })
    return res


def cmd_throughput(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = make_model(out, vocab=2048, hidden=args.hidden, layers=args.layers)
    pairs = _pairs(d, args.sequences, args.prompt_len, args.teacher_len)
    results = []
    for s in args.servers.split(","):
        if s in ("vllm", "vllm-skip-tokenizer"):
            results.append(bench_vllm(d, pairs, out / "logs", args.k, skip_tokenizer=s != "vllm", repeats=args.repeats))
        elif s == "llamacpp":
            results.append(bench_llamacpp(d, pairs, out / "logs", args.k, args.threads))
        print(json.dumps(results[-1]), flush=True)
    (out / "served_bench.json").write_text(json.dumps({"model": str(d), "args": vars(args), "results": results}, indent=1, default=str))


# ------------------------------------------------------------------ scale: V = 248,320
def _per_position_requests(url: str, pairs, K: int, n_slots: int, *, pin: bool = True) -> dict:
    """The peer: logitdiff's earlier scheduling - one /completion request per output
    position, each item pinned to one slot for all its positions, items one per slot.
    ``pin=False``: the default-flags scheduling of the first change - the same, but
    every request unpinned (``id_slot: -1``), restored from the host-RAM prompt cache."""
    import asyncio

    import httpx

    stats = {"requests": 0, "prompt_tokens_evaluated": 0}

    async def run():
        async with httpx.AsyncClient(timeout=600) as h:
            q: asyncio.Queue = asyncio.Queue()
            for k in range(n_slots):
                q.put_nowait(k)

            async def item(p, t):
                slot = await q.get()
                try:
                    for j in range(len(t)):
                        body = {"prompt": p + t[:j], "n_predict": 1, "n_probs": K, "temperature": 0.0, "post_sampling_probs": False,
                                "cache_prompt": True, "stream": False, "id_slot": slot if pin else -1}
                        r = (await h.post(url + "/completion", json=body)).json()
                        stats["requests"] += 1
                        stats["prompt_tokens_evaluated"] += int(r["timings"]["prompt_n"])
                finally:
                    q.put_nowait(slot)

            await asyncio.gather(*(item(p, t) for p, t in pairs))

    t0 = time.perf_counter()
    asyncio.run(run())
    stats["s"] = time.perf_counter() - t0
    return stats


def _vmhwm_mb(pid: int) -> float | None:
    try:
        for ln in open(f"/proc/{pid}/status"):
            if ln.startswith("VmHWM:"):
                return round(int(ln.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _llama_prefill_rate(url: str, pairs) -> float:
    """The server's own prompt processing: full-sequence prefills without the cache, tokens/s
    from its timings (prompt_n / prompt_ms)."""
    import httpx

    pn, pms = 0, 0.0
    with httpx.Client(timeout=600) as h:
        for p, t in pairs:
            r = h.post(url + "/completion", json={"prompt": p + t, "n_predict": 1, "temperature": 0.0, "cache_prompt": False}).json()
            pn += int(r["timings"]["prompt_n"])
            pms += float(r["timings"]["prompt_ms"])
    return 1000 * pn / pms



def _time_token_texts(src, px, res: dict) -> None:
    """The text of every token id (what a capture asks for its report), timed, with the
    requests it took counted at the proxy."""
    n_before = sum(px.counts.values())
    t0 = time.perf_counter()
    texts = [src.token_text(i) for i in range(src.vocab_size)]
    res["token_texts_s"] = round(time.perf_counter() - t0, 2)
    res["token_texts_requests"] = sum(px.counts.values()) - n_before
    res["vocab_size"] = len(texts)

def bench_scale_llamacpp(gguf: Path, pair_sets, peer_sets, unpinned_sets, logs: Path, K: int, threads: int, flags: str) -> dict:
    import statistics as st

    from servers import CountingProxy, llama_server

    from logitdiff.sources import open_source

    res = {"server": f"llama-server ({flags} flags)", "K": K}
    srv = llama_server(gguf, logs, threads=threads, default_flags=flags == "default")
    with srv, CountingProxy(srv.url) as px:
        res["startup_s"] = round(srv.started_in, 1)
        t0 = time.perf_counter()
        with open_source(f"openai:{px.url},top_k={K}") as src:
            res["open_s"] = round(time.perf_counter() - t0, 2)
            res["slots"] = src._n_slots
            _time_token_texts(src, px, res)
            src.score_many(pair_sets[0][:1])  # warm-up
            caps, evals, reqs, peers, unpinned = [], [], [], [], []
            # alternating rounds, each on fresh sequences (no answer from an earlier round's cache)
            for pairs, peer_pairs in zip(pair_sets[1:], peer_sets):
                s0, r0 = src.server_stats["prompt_tokens_evaluated"], px.counts["/completion"]
                t0 = time.perf_counter()
                src.score_many(pairs)
                caps.append(time.perf_counter() - t0)
                evals.append(src.server_stats["prompt_tokens_evaluated"] - s0)
                reqs.append(px.counts["/completion"] - r0)
                peers.append(_per_position_requests(srv.url, peer_pairs, K, res["slots"]))
                if flags == "default":  # on fresh sequences of its own
                    unpinned.append(_per_position_requests(srv.url, unpinned_sets[len(unpinned)], K, res["slots"], pin=False))
        positions = sum(len(t) for _, t in pair_sets[1])
        pp = _llama_prefill_rate(srv.url, pair_sets[1])
        res["server_vmhwm_mb"] = _vmhwm_mb(srv.proc.pid)
    cap = st.median(caps)
    peer = st.median(p["s"] for p in peers)
    res.update({
        "sequences": len(pair_sets[1]), "prompt_len": len(pair_sets[1][0][0]), "output_positions": positions,
        "capture_s_all": [round(x, 3) for x in caps], "capture_positions_per_s": round(positions / cap, 1),
        "capture_requests": reqs[0], "capture_tokens_evaluated_per_position": round(st.median(evals) / positions, 3),
        "peer_s_all": [round(p["s"], 3) for p in peers],
        "peer_positions_per_s": round(positions / peer, 1), "peer_requests": peers[0]["requests"],
        "peer_tokens_evaluated_per_position": round(st.median(p["prompt_tokens_evaluated"] for p in peers) / positions, 3),
        "capture_vs_peer_speed": round(peer / cap, 2),
        **({"unpinned_s_all": [round(p["s"], 3) for p in unpinned],
            "unpinned_positions_per_s": round(positions / st.median(p["s"] for p in unpinned), 1),
            "unpinned_tokens_evaluated_per_position": round(st.median(p["prompt_tokens_evaluated"] for p in unpinned) / positions, 3)}
           if unpinned else {}),
        "server_prefill_tokens_per_s": round(pp, 1),
        "capture_positions_vs_prefill_tokens": round((positions / cap) / pp, 4),
    })
    return res


def bench_scale_vllm(d: Path, pair_sets, logs: Path, K: int) -> dict:
    import statistics as st

    from servers import CountingProxy, vllm_server

    from logitdiff.sources import open_source

    res = {"server": "vllm", "K": K}
    with vllm_server(d, logs, max_logprobs=K, extra=["--no-enable-prefix-caching", "--max-num-batched-tokens", "512"]) as srv, \
            CountingProxy(srv.url) as px:
        res["startup_s"] = round(srv.started_in, 1)
        with open_source(f"openai:{px.url},top_k={K},concurrency=8,batch=4") as src:
            _time_token_texts(src, px, res)
            src.score_many(pair_sets[0][:4])  # warm-up
            c = src._client

            async def plain(pairs):
                import asyncio

                async def grp(g):
                    body = {"model": src.model, "prompt": [p + t for p, t in g], "max_tokens": 1, "temperature": 0.0}
                    await c.request("POST", "/v1/completions", body)

                await asyncio.gather(*(grp(pairs[i : i + 4]) for i in range(0, len(pairs), 4)))

            caps, pps = [], []
            for pairs in pair_sets[1:]:
                t0 = time.perf_counter()
                src.score_many(pairs)
                caps.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.run(plain(pairs))
                pps.append(time.perf_counter() - t0)
        res["server_vmhwm_mb"] = _vmhwm_mb(srv.proc.pid)
    positions = sum(len(t) for _, t in pair_sets[1])
    tokens = sum(len(p) + len(t) for p, t in pair_sets[1])
    cap, pp = st.median(caps), st.median(pps)
    res.update({
        "sequences": len(pair_sets[1]), "output_positions": positions, "tokens": tokens,
        "capture_s_all": [round(x, 3) for x in caps], "prefill_s_all": [round(x, 3) for x in pps],
        "capture_positions_per_s": round(positions / cap, 1), "capture_tokens_per_s": round(tokens / cap, 1),
        "server_prefill_tokens_per_s": round(tokens / pp, 1), "capture_vs_prefill": round(pp / cap, 3),
    })
    return res


def bench_scale_flags(gguf: Path, d: Path, args, logs: Path) -> dict:
    """Default against tuned flags in one invocation: both llama-servers up at once, rounds
    alternating default / tuned (the first server of a round alternates too), each round on
    fresh sequences, so a change of machine load hits both alike. Reported per server: the
    capture seconds of every round, the median positions/s, tokens evaluated per position."""
    import statistics as st
    from contextlib import ExitStack

    from servers import llama_server

    from logitdiff.sources import open_source

    K, R = args.k, args.repeats
    res: dict = {"K": K, "rounds": R}
    with ExitStack() as stack:
        srcs = {}
        for flags in ("default", "tuned"):
            srv = stack.enter_context(llama_server(gguf, logs, threads=args.threads, default_flags=flags == "default"))
            srcs[flags] = stack.enter_context(open_source(f"openai:{srv.url},top_k={K}"))
            srcs[flags].score_many(_pairs(d, 1, args.prompt_len, args.teacher_len, seed=900 + len(srcs)))  # warm-up
        times: dict = {f: [] for f in srcs}
        evals: dict = {f: [] for f in srcs}
        for r in range(R):
            order = ("default", "tuned") if r % 2 == 0 else ("tuned", "default")
            for flags in order:
                pairs = _pairs(d, args.sequences, args.prompt_len, args.teacher_len, seed=1000 + 10 * r + (flags == "tuned"))
                src = srcs[flags]
                e0 = src.server_stats["prompt_tokens_evaluated"]
                t0 = time.perf_counter()
                src.score_many(pairs)
                times[flags].append(round(time.perf_counter() - t0, 3))
                evals[flags].append(src.server_stats["prompt_tokens_evaluated"] - e0)
        positions = args.sequences * args.teacher_len
        for flags in srcs:
            res[flags] = {"scheduling": srcs[flags].server_info.get("scheduling"), "slots": srcs[flags]._n_slots,
                          "capture_s_all": times[flags], "positions": positions,
                          "capture_positions_per_s": round(positions / st.median(times[flags]), 1),
                          "tokens_evaluated_per_position": round(st.median(evals[flags]) / positions, 3)}
        res["default_vs_tuned_time"] = round(st.median(times["default"]) / st.median(times["tuned"]), 3)
        res["default_vs_tuned_time_per_round"] = [round(a / b, 3) for a, b in zip(times["default"], times["tuned"])]
    return res


def cmd_scale(args) -> None:
    from _models import make_wide_llama

    from logitdiff.sources.quantize import build_ladder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    d = make_wide_llama(out / f"wide-v{args.vocab}-h{args.hidden}-l{args.layers}", vocab_size=args.vocab, hidden=args.hidden,
                        layers=args.layers)
    gguf = build_ladder(d, out / "ladder", [])["F32"]
    print(f"model ready in {time.perf_counter() - t0:.0f} s: {d}, {gguf}", flush=True)
    pair_sets = [_pairs(d, args.sequences, args.prompt_len, args.teacher_len, seed=s) for s in range(args.repeats + 1)]
    peer_sets = [_pairs(d, args.sequences, args.prompt_len, args.teacher_len, seed=100 + s) for s in range(args.repeats)]
    unpinned_sets = [_pairs(d, args.sequences, args.prompt_len, args.teacher_len, seed=200 + s) for s in range(args.repeats)]
    results = []
    for s in args.servers.split(","):
        if s in ("llamacpp-default", "llamacpp-tuned"):
            results.append(bench_scale_llamacpp(gguf, pair_sets, peer_sets, unpinned_sets, out / "logs", args.k, args.threads, s.split("-")[1]))
        elif s == "llamacpp-flags":
            results.append(bench_scale_flags(gguf, d, args, out / "logs"))
        elif s == "vllm":
            results.append(bench_scale_vllm(d, pair_sets, out / "logs", args.k))
        print(json.dumps(results[-1]), flush=True)
    (out / "served_scale.json").write_text(json.dumps({"model": str(d), "args": vars(args), "results": results}, indent=1, default=str))


def _timed(cmd: list[str], env: dict | None = None) -> float:
    import os
    import subprocess

    t0 = time.perf_counter()
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}  # None: unset
    r = subprocess.run(cmd, capture_output=True, text=True, env=full)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}...: exit {r.returncode}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def _served_floor(ref_run: Path, a: Path, b: Path) -> dict:
    """Two captures of the same server (other batch layouts): mean KL and median |d logprob|."""
    import numpy as np

    from logitdiff.compare import compare_runs
    from logitdiff.store import RunReader

    ra, rb = RunReader(a), RunReader(b)
    kl = compare_runs(ra, rb).columns["kl_nats"]
    d = []
    for ia, ib in zip(ra.items(), rb.items()):
        ta, tb = ra.topk(ia), rb.topk(ib)
        for r in range(len(ta["ids"])):
            common, ja, jb = np.intersect1d(ta["ids"][r], tb["ids"][r], return_indices=True)
            d.append(np.abs(np.asarray(ta["logprobs"][r])[ja] - np.asarray(tb["logprobs"][r])[jb]))
    d = np.concatenate(d)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "logprob_absdiff_median": float(np.median(d)),
            "logprob_absdiff_max": float(d.max()), "identical": bool((d == 0).all())}


def cmd_peer(args) -> None:
    """logitdiff served capture + compare against quantdiff's run, the same two llama-servers
    (default flags) on the bundled ladder (F32 reference, Q4_K_M candidate) and the same
    items, interleaved; plus each batching mode's rate and served floor."""
    import statistics

    from servers import llama_server
    from logitdiff.builtin import TINY_DIR, cache_dir
    from logitdiff.sources.quantize import build_ladder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ladder = build_ladder(TINY_DIR, cache_dir(), ["Q4_K_M"])
    wl = out / "workload.jsonl"
    topics = ["Write a haiku about the sea.", "What is 12 + 30?", "Name three colours.", "Explain recursion briefly.",
              "Translate 'good morning' into French.", "List two prime numbers.", "Describe a cat.", "Why is the sky blue?"]
    wl.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{topics[i % len(topics)]} ({i})", "max_tokens": args.tokens}) + "\n"
                          for i in range(args.items)))
    py = sys.executable
    # logitdiff runs from the source tree: its bytecode compiled once into OUT/pycache, as
    # pip compiles an installed package (quantdiff's, in its venv); without it, a shell with
    # PYTHONDONTWRITEBYTECODE set recompiles ~60 modules in every one of the three processes
    env = {"PYTHONPATH": str(REPO / "src"), "PYTHONPYCACHEPREFIX": str(out / "pycache"), "PYTHONDONTWRITEBYTECODE": None}
    _timed([py, "-m", "compileall", "-q", str(REPO / "src" / "logitdiff")], env)
    ld = [py, "-m", "logitdiff.cli"]
    qd = [args.quantdiff, "run"]
    res: dict = {"items": args.items, "tokens": args.tokens, "k": args.k, "repeats": args.repeats, "walls": {}}
    ref_s = llama_server(ladder["F32"], out / "logs", default_flags=True, threads=args.threads).start()
    cand_s = llama_server(ladder["Q4_K_M"], out / "logs", default_flags=True, threads=args.threads).start()
    try:
        walls: dict[str, list] = {"logitdiff": [], "logitdiff-serial": [], "quantdiff": []}
        for rep in range(args.repeats):
            for name in (["quantdiff", "logitdiff", "logitdiff-serial"] if rep % 2 else ["logitdiff", "logitdiff-serial", "quantdiff"]):
                d = out / f"{name}-{rep}"
                if name == "quantdiff":
                    w = _timed(qd + ["--ref", f"llamacpp:{ref_s.url}", "--cand", f"llamacpp:{cand_s.url}", "--prompts", str(wl),
                                     "--score-tokens", str(args.tokens), "--top-k", str(min(args.k, 20)), "--offline",
                                     "--no-preflight", "--no-png", "--no-cache", "-q", "--out", str(d)])
                else:
                    b = ",batching=serial" if name.endswith("serial") else ""
                    w = _timed(ld + ["capture", f"openai:{ref_s.url},top_k={args.k}{b}", "--workload", str(wl), "--max-tokens",
                                     str(args.tokens), "--out", str(d / "ref")], env)
                    w += _timed(ld + ["capture", f"openai:{cand_s.url},top_k={args.k}{b}", "--reference", str(d / "ref"),
                                      "--out", str(d / "cand")], env)
                    w += _timed(ld + ["compare", str(d / "ref"), str(d / "cand"), "--out", str(d / "rep")], env)
                walls[name].append(w)
                print(f"{name} run {rep}: {w:.1f} s", flush=True)
        res["walls"] = walls
        med = {k: statistics.median(v) for k, v in walls.items()}
        res["median_s"] = med
        res["ratio_vs_quantdiff"] = {k: med[k] / med["quantdiff"] for k in med}
        # each mode's candidate rate and floor: two captures with other batch layouts
        from logitdiff.store import RunReader

        ref_run = out / "logitdiff-0" / "ref"
        n_pos = RunReader(ref_run).manifest["n_positions"]
        modes = {}
        for mode in ("rounds", "serial"):
            caps = []
            for batch in (8, 3):
                d = out / f"floor-{mode}-b{batch}"
                w = _timed(ld + ["capture", f"openai:{cand_s.url},top_k={args.k},batching={mode}", "--reference", str(ref_run),
                                 "--batch", str(batch), "--out", str(d), "--overwrite"], env)
                caps.append((d, w))
            modes[mode] = {"positions_per_s": n_pos / statistics.median(w for _, w in caps),
                           "floor": _served_floor(ref_run, caps[0][0], caps[1][0])}
        res["modes"] = modes
    finally:
        ref_s.stop()
        cand_s.stop()
    (out / "peer.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def cmd_floors(args) -> None:
    """The three floors of a served comparison on the bundled ladder (llama-servers on their
    default flags, F32 reference, Q4_K_M candidate, the bundled workload): (1) each server
    against itself with other batch mates, per batching mode; (2) in-process llama.cpp
    against llama-server on the same GGUF; (3) the candidate against the reference."""
    from servers import llama_server
    from logitdiff.builtin import TINY_DIR, WORKLOAD, cache_dir
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.compare import compare_runs
    from logitdiff.sources.quantize import build_ladder
    from logitdiff.sources import open_source
    from logitdiff.store import RunReader
    from logitdiff.workload import read_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ladder = build_ladder(TINY_DIR, cache_dir(), ["Q4_K_M"])
    items = read_workload(WORKLOAD)[: args.items]
    K = args.k
    srv = {q: llama_server(ladder[q], out / "logs", default_flags=True, threads=args.threads).start() for q in ("F32", "Q4_K_M")}
    res: dict = {"items": len(items), "max_tokens": args.tokens, "k": K}

    def kl(a, b) -> dict:
        c = compare_runs(RunReader(a), RunReader(b)).columns
        return {"kl_mean": float(c["kl_nats"].mean()), "kl_max": float(c["kl_nats"].max()),
                "top1_disagreement": float(1 - c["top1_match"].mean()), **_served_floor(None, a, b)}

    try:
        with open_source(f"openai:{srv['F32'].url},top_k={K},batching=serial") as src:
            ref = RunReader(capture_reference(src, items, out / "ref", max_tokens=args.tokens, overwrite=True))
        caps = {}
        for q in ("F32", "Q4_K_M"):
            for mode in ("rounds", "serial"):
                for batch in (8, 3):
                    d = out / f"{q}-{mode}-b{batch}"
                    with open_source(f"openai:{srv[q].url},top_k={K},batching={mode}") as src:
                        t0 = time.perf_counter()
                        capture_candidate(src, ref, d, batch=batch, overwrite=True)
                        caps[q, mode, batch] = (d, time.perf_counter() - t0)
            with open_source(f"gguf:{ladder[q]}") as src:
                capture_candidate(src, ref, out / f"{q}-inprocess", store=f"topk:{K}", overwrite=True)
        n = ref.manifest["n_positions"]
        res["server_vs_itself"] = {f"{q} {mode}": {**kl(caps[q, mode, 8][0], caps[q, mode, 3][0]),
                                                  "positions_per_s": n / min(caps[q, mode, 8][1], caps[q, mode, 3][1])}
                                   for q in ("F32", "Q4_K_M") for mode in ("rounds", "serial")}
        res["inprocess_vs_server"] = {f"{q} serial": kl(out / f"{q}-inprocess", caps[q, "serial", 8][0]) for q in ("F32", "Q4_K_M")}
        res["candidate"] = {mode: kl(caps["F32", mode, 8][0], caps["Q4_K_M", mode, 8][0]) for mode in ("rounds", "serial")}
    finally:
        for s_ in srv.values():
            s_.stop()
    (out / "floors.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def cmd_table(args) -> None:
    """Markdown table of a `logitdiff topk-error --json` file."""
    r = json.loads(Path(args.json).read_text())
    e = r["exact"]
    print(f"{r['n']} positions, {r['items']} items, V={r['vocab_size']}; exact top-1 agreement {100 * e['top1_agreement']:.1f} %\n")
    print("| K | exact mean | approx mean | exact p95 | approx p95 | exact max | approx max | mean abs err | rel err of mean |"
          " median rel err | ref top-K mass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in r["rows"]:
        print(f"| {x['k']} | {e['mean']:.4g} | {x['approx_mean']:.4g} | {e['p95']:.4g} | {x['approx_p95']:.4g} | {e['max']:.4g} |"
              f" {x['approx_max']:.4g} | {x['mean_abs_err']:.3g} | {100 * x['rel_err_of_mean']:.1f} % | {100 * x['median_rel_err']:.1f} % |"
              f" {x['ref_top_mass_mean']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("topk-runs")
    a.add_argument("out")
    a.add_argument("--items", type=int, default=24)
    a.add_argument("--max-tokens", type=int, default=32)
    a.set_defaults(func=cmd_topk_runs)
    b = sub.add_parser("throughput")
    b.add_argument("out")
    b.add_argument("--servers", default="llamacpp,vllm,vllm-skip-tokenizer",
                   help="comma list of llamacpp, vllm, vllm-skip-tokenizer (vLLM with --skip-tokenizer-init)")
    b.add_argument("--repeats", type=int, default=3, help="vLLM: alternating capture/prefill rounds, median of each")
    b.add_argument("--sequences", type=int, default=32)
    b.add_argument("--prompt-len", type=int, default=96)
    b.add_argument("--teacher-len", type=int, default=32)
    b.add_argument("--k", type=int, default=64)
    b.add_argument("--hidden", type=int, default=512)
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--threads", type=int, default=2)
    b.set_defaults(func=cmd_throughput)
    e = sub.add_parser("scale", help="teacher-forced top-K capture at V=248,320 through llama-server (default and tuned flags) and vLLM")
    e.add_argument("out")
    e.add_argument("--servers", default="llamacpp-default,llamacpp-tuned,vllm",
                   help="comma list of llamacpp-default (llama-server's own defaults), llamacpp-tuned "
                        "(-np 4 -fa off --cache-ram 0 ...), llamacpp-flags (both at once, rounds alternating "
                        "default / tuned), vllm")
    e.add_argument("--vocab", type=int, default=248_320)
    e.add_argument("--hidden", type=int, default=128)
    e.add_argument("--layers", type=int, default=2)
    e.add_argument("--repeats", type=int, default=3, help="rounds, each on fresh sequences; medians reported")
    e.add_argument("--sequences", type=int, default=8)
    e.add_argument("--prompt-len", type=int, default=64)
    e.add_argument("--teacher-len", type=int, default=32)
    e.add_argument("--k", type=int, default=64)
    e.add_argument("--threads", type=int, default=2)
    e.set_defaults(func=cmd_scale)
    f = sub.add_parser("peer", help="served capture + compare vs quantdiff on the same llama-servers; batching modes")
    f.add_argument("out")
    f.add_argument("--quantdiff", default="/tmp/qdvenv/bin/quantdiff", help="quantdiff executable (its own venv)")
    f.add_argument("--items", type=int, default=20)
    f.add_argument("--tokens", type=int, default=32)
    f.add_argument("--k", type=int, default=20, help="top-K of both tools (quantdiff allows at most 20)")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--threads", type=int, default=2)
    f.set_defaults(func=cmd_peer)
    g = sub.add_parser("floors", help="the three floors of a served comparison on the bundled ladder")
    g.add_argument("out")
    g.add_argument("--items", type=int, default=20)
    g.add_argument("--tokens", type=int, default=32)
    g.add_argument("--k", type=int, default=20)
    g.add_argument("--threads", type=int, default=2)
    g.set_defaults(func=cmd_floors)
    c = sub.add_parser("table")
    c.add_argument("json")
    c.set_defaults(func=cmd_table)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
