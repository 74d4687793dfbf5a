"""Served capture at a real vocabulary, on real servers started here.

At V = 248,320 (a random Llama on the bundled tokenizer widened with filler tokens) a served
reference capture through a counting proxy on 127.0.0.1 must fetch the V token texts in a
few /detokenize requests (never one per id), send an item's positions in groups, and - on
llama-server's default flags as on the tuned ones - evaluate one new token per position
after the item's prompt (read from the server's own timings). Tuned flags: positions in
groups per request, pinned to the item's slot; default flags (idle slots cleared whenever a
task starts): rounds, each one request of unpinned tasks - the next position of every item in
flight, at most one item per slot - restored from the slot or the host-RAM prompt cache.

A server that cannot start FAILS the test with its log tail (never a skip).
"""

import json
import math

import numpy as np
import pytest

from _models import make_wide_llama
from servers import CountingProxy, llama_server, start_or_fail
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.sources import open_source
from logitdiff.sources.served import DETOKENIZE_CHUNK, LLAMACPP_TASKS_PER_REQUEST
from logitdiff.store import RunReader
from logitdiff.workload import read_workload

V = 248_320
K = 64
T = 40  # output tokens per item: two requests of 32 + 8 positions


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from transformers import AutoTokenizer

    from logitdiff.sources.quantize import build_ladder

    root = tmp_path_factory.mktemp("wide")
    d = make_wide_llama(root / "m", vocab_size=V, hidden=128, layers=2)
    gguf = build_ladder(d, root / "cache", [])["F32"]
    wl = root / "wl.jsonl"
    # prompts of ~150+ tokens, so that re-evaluating a prefix per position would show
    text = open(__file__).read()
    rows = [{"id": f"p{i}", "prompt": text[400 * i : 400 * i + 600], "max_tokens": T} for i in range(3)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": text[2000:2600]}], "max_tokens": T})
    wl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"dir": d, "gguf": gguf, "wl": wl, "root": root, "logs": root / "logs", "tok": AutoTokenizer.from_pretrained(str(d))}


def _local_texts(tok) -> list[str]:
    return tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("flags", ["default", "tuned"])
def test_llama_server_wide_vocab_capture(wide, tmp_path, flags):
    srv = start_or_fail(llama_server, wide["gguf"], wide["logs"], default_flags=flags == "default")
    try:
        # the reference takes its rows from its generation: the scheduling of teacher-forced
        # scoring is a candidate's, captured through the proxy on the reference's tokens
        with open_source(f"openai:{srv.url},top_k={K}") as src:
            ref = RunReader(capture_reference(src, read_workload(wide["wl"]), tmp_path / "ref", store=f"topk:{K}"))
        with CountingProxy(srv.url, keep=("/completion", "/detokenize")) as px:
            with open_source(f"openai:{px.url},top_k={K}") as src:
                assert src.vocab_size == V
                run = RunReader(capture_candidate(src, ref, tmp_path / "cand", store=f"topk:{K}"))
                stats = dict(src.server_stats)
                slots, pinned = src._n_slots, src._pin_slots
            counts = dict(px.counts)
            bodies, detok = list(px.bodies["/completion"]), list(px.bodies["/detokenize"])
        log = srv.tail(2000)
    finally:
        srv.stop()
    if flags == "default":
        assert "kv_unified = 'true'" in log, "llama-server's defaults changed: no unified KV cache, so this test no longer covers them"

    # token texts: all V ids in ceil(V / 65,536) /detokenize requests, never one per id (the
    # only one-token request is the separator's probe)
    n_chunks = math.ceil(V / DETOKENIZE_CHUNK)
    sizes = [len(b["tokens"]) for b in detok]
    assert sum(n > DETOKENIZE_CHUNK for n in sizes) == n_chunks and sizes.count(1) <= 1, sizes
    assert len(sizes) <= n_chunks + 2, sizes
    vocab = run.vocab()
    assert len(vocab) == V
    local = _local_texts(wide["tok"])
    # llama.cpp's token texts are the tokenizer's: every whole-character token agrees with
    # the HF tokenizer decoded on its own (fragments of a multi-byte character are U+FFFD on both)
    assert [i for i in range(V) if vocab[i] != local[i] and "\ufffd" not in local[i]] == []
    assert vocab[V - 1] == f"<fill{V - 1}>" and vocab[2] == "<|im_end|>"

    # tuned flags: an item's positions in groups of 32 per request, pinned to its slot;
    # default flags (idle slots cleared, found by the open's probe): rounds of unpinned tasks,
    # one position of each item in flight per request; with no more items than slots all are
    # in flight from the start, so there are as many rounds as the longest output has
    # positions (+ the preflight; besides: the probe's 3 requests)
    items = run.items()
    assert pinned == (flags == "tuned")
    scoring = [b for b in bodies if isinstance(b.get("prompt"), list) and b["prompt"] and isinstance(b["prompt"][0], list)]
    if pinned:
        want = sum(math.ceil(len(it.teacher_ids) / LLAMACPP_TASKS_PER_REQUEST) for it in items if it.teacher_ids)
        assert all(len(b["prompt"]) <= LLAMACPP_TASKS_PER_REQUEST and b["id_slot"] in range(slots) for b in scoring)
    else:
        assert slots >= len(items)
        want = max(len(it.teacher_ids) for it in items)
        rounds = scoring[1:]  # after the preflight
        assert all(len(b["prompt"]) <= slots and b["id_slot"] == -1 for b in rounds)
        # round r: prefix + r teacher tokens of every item still running, in item order
        for r, b in enumerate(rounds):
            running = [it for it in items if len(it.teacher_ids) > r]
            assert b["prompt"] == [list(it.prompt_ids) + list(it.teacher_ids[:r]) for it in running], r
    assert len(scoring) == want + 1, (len(scoring), want)  # + the preflight
    assert counts["/completion"] == len(scoring) + 3

    # prefix reuse, from the server's timings: after its prompt, each position of an item
    # evaluates one new token (not its whole prefix)
    tasks = sum(len(it.teacher_ids) for it in items) + 1
    assert stats["tasks"] == tasks
    # at most: each item's prompt once, one token per position, one more per request (a
    # request's first task may find a token less of its prefix kept), + the preflight's 2
    bound = sum(len(it.prompt_ids) + len(it.teacher_ids) for it in items) + len(scoring) + 2
    quadratic = sum(len(it.prompt_ids) * len(it.teacher_ids) for it in items)
    print(f"{flags} flags: {stats['prompt_tokens_evaluated']} prompt tokens evaluated for {tasks} positions "
          f"(bound {bound}, whole prefix each time: >= {quadratic}); {counts}")
    assert stats["prompt_tokens_evaluated"] <= bound
    assert run.manifest["n_positions"] == sum(len(it.teacher_ids) for it in items) > 2 * LLAMACPP_TASKS_PER_REQUEST
    # every stored row is a valid top-K: K distinct ids, descending
    for it in items:
        tk = run.topk(it)
        assert tk["ids"].shape == (len(it.teacher_ids), K)
        assert (np.diff(tk["logprobs"], axis=1) <= 0).all()
        assert all(len(set(r)) == K for r in tk["ids"].tolist())


def test_token_text_containing_the_separator(tmp_path):
    """A token whose own text contains the separator splits its chunk into more parts than
    ids: the chunk is halved until each part splits right, so every id still gets its own
    text (checked against one /detokenize request per id, the independent reference)."""
    import httpx

    from logitdiff.sources.quantize import build_ladder
    from logitdiff.sources.served import SEPARATORS

    evil = (f"x{SEPARATORS[0]}y", SEPARATORS[0])
    d = make_wide_llama(tmp_path / "m", vocab_size=4_608, hidden=64, layers=1, extra=evil)
    gguf = build_ladder(d, tmp_path / "cache", [])["F32"]
    srv = start_or_fail(llama_server, gguf, tmp_path / "logs")
    try:
        with CountingProxy(srv.url) as px, open_source(f"openai:{px.url},top_k=8") as src:
            texts = [src.token_text(i) for i in range(src.vocab_size)]
            n_detok = px.counts["/detokenize"]
        with httpx.Client(timeout=60) as h:
            one = [h.post(srv.url + "/detokenize", json={"tokens": [i]}).json()["content"] for i in range(len(texts))]
    finally:
        srv.stop()
    assert len(texts) == 4_608 and texts[4096:4098] == list(evil)
    assert texts == one
    # 3 probes + 1 chunk + two halvings per level down to each of the two tokens (13 levels)
    assert n_detok <= 4 + 2 * 2 * 13, n_detok
