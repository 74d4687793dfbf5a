"""Every field of a llama-server answer that `speculate` reads, of the wrong type or missing,
is one line naming the field and the request, never a traceback (issue #39: ten tracebacks).

llama-server itself never sends such answers, so the fault cannot be produced with it: a
real HTTP server on 127.0.0.1 (http.server in a thread, started by the test) speaks
llama-server's protocol with a deterministic toy model and, per case, puts one field of one
endpoint's answers out of shape. The same server unchanged gives a complete report (so a
case's error comes from its field, not from the server)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from logitdiff import speculation as S
from logitdiff.api import speculate
from logitdiff.errors import LogitdiffError

V = 64  # the toy model's vocabulary
K = 4  # --top-k
N = 4  # --max-tokens
DELETE = object()  # a case's value: the field is left out


def _next(ctx: list[int]) -> int:
    return (ctx[-1] * 7 + 3) % V


def _entry(ctx: list[int], k: int) -> dict:
    """The toy model's distribution after ``ctx``: its token and top-K, halving."""
    t = _next(ctx)
    top = [{"id": (t + i) % V, "logprob": math.log(0.5 ** (i + 1))} for i in range(k)]
    return {"id": t, "logprob": top[0]["logprob"], "top_logprobs": top}


def _completion(body: dict, drafts: bool):
    k, prompt = int(body.get("n_probs", 0)), body["prompt"]
    if prompt and isinstance(prompt[0], list):  # teacher forcing: one task per context
        return [{"index": i, "completion_probabilities": [_entry(c, k)], "timings": {"prompt_n": 1}} for i, c in enumerate(prompt)]
    ctx, probs = list(prompt), []
    for _ in range(int(body["n_predict"])):
        probs.append(_entry(ctx, k))
        ctx.append(probs[-1]["id"])
    n = len(probs)
    return {"index": 0, "tokens": ctx[len(prompt):], "completion_probabilities": probs, "stop_type": "limit",
            "generation_settings": {"n_predict": n},
            "timings": {"prompt_n": len(prompt), "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 2.5,
                        **({"draft_n": n, "draft_n_accepted": n - 1} if drafts else {})}}


def _answer(path: str, body: dict, drafts: bool):
    if path == "/props":
        return {"default_generation_settings": {"n_ctx": 4096, "params": {"post_sampling_probs": False, "samplers": ["top_k"]}},
                "build_info": "toy", "model_path": "/toy.gguf", "total_slots": 1, "chat_template": "{{ messages }}"}
    if path == "/slots":
        return [{"id": 0, "speculative": drafts, "params": {"speculative.types": ["draft"] if drafts else []}}]
    if path == "/v1/models":
        return {"object": "list", "data": [{"id": "toy", "meta": {"n_vocab": V}}]}
    if path == "/tokenize":
        return {"tokens": [ord(ch) % V for ch in body["content"]]}
    if path == "/apply-template":
        return {"prompt": "".join(m["content"] for m in body["messages"])}
    if path == "/completion":
        return _completion(body, drafts)
    return None


def _put(doc, path: str, value):
    """``doc`` with the field at ``path`` (dots; list indices as numbers) set to ``value``
    or, with DELETE, left out; ``""``: the whole answer replaced."""
    if not path:
        return value
    *up, last = path.split(".")
    node = doc
    for p in up:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


class ToyLlamaServer:
    """llama-server's protocol on 127.0.0.1 (a free port); ``fault`` = (endpoint, kind of
    request or None, field path, value) puts that field of those answers out of shape."""

    def __init__(self, *, drafts: bool, fault=None):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                doc = _answer(self.path, body, owner.drafts)
                if doc is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                f = owner.fault
                if f and f[0] == self.path and (f[1] is None or f[1] == ("score" if isinstance(doc, list) else "generate")):
                    doc = _put(doc, f[2], f[3])
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply("GET")

            def do_POST(self):
                self._reply("POST")

        self.drafts, self.fault = drafts, fault
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def workload(tmp_path):
    p = tmp_path / "wl.jsonl"
    p.write_text(json.dumps({"id": "plain", "prompt": "abc"}) + "\n"
                 + json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hello"}]}) + "\n")
    return p


def _run(ref: ToyLlamaServer, cand: ToyLlamaServer, workload, out):
    return speculate(ref.url, cand.url + ",speculative=1", out, workload=workload, n_predict=N, top_k=K, floor_items=1,
                     shape_width=1, timeout=10)


def test_the_toy_server_unchanged_gives_a_report(workload, tmp_path):
    with ToyLlamaServer(drafts=False) as ref, ToyLlamaServer(drafts=True) as cand:
        rep = _run(ref, cand, workload, tmp_path / "out")
    assert rep["summary"]["items"] == 2 and rep["summary"]["identical_output_rate"] == 1.0
    assert rep["candidate"]["counters"]["draft_n"] == 2 * N and rep["floors"]["F1"]["positions"] == N
    assert rep["verdict"]["label"] in S.VERDICTS and (tmp_path / "out" / "report.json").is_file()


GEN, SCORE = "generate", "score"
# (side, endpoint, request kind, field path in the answer, value, the field as the message names it)
CASES = [
    ("cand", "/props", None, "default_generation_settings", "x", "default_generation_settings"),
    ("cand", "/props", None, "default_generation_settings.n_ctx", "4096", "default_generation_settings.n_ctx"),
    ("ref", "/props", None, "default_generation_settings.params", [], "default_generation_settings.params"),
    ("ref", "/props", None, "default_generation_settings.params.post_sampling_probs", "no",
     "default_generation_settings.params.post_sampling_probs"),
    ("ref", "/props", None, "default_generation_settings.params.samplers", "top_k", "default_generation_settings.params.samplers"),
    ("ref", "/props", None, "build_info", 5, "build_info"),
    ("cand", "/props", None, "model_path", ["a"], "model_path"),
    ("cand", "/props", None, "total_slots", "1", "total_slots"),
    ("cand", "/slots", None, "0.params", "x", "[0].params"),
    ("cand", "/slots", None, "0", 7, "[0]"),
    ("cand", "/slots", None, "0.speculative", "false", "[0].speculative"),
    ("ref", "/slots", None, "", {"slots": []}, ""),
    ("ref", "/v1/models", None, "data", {}, "data"),
    ("ref", "/v1/models", None, "data.0.meta.n_vocab", "64", "data[0].meta.n_vocab"),
    ("ref", "/tokenize", None, "tokens", DELETE, "tokens"),
    ("cand", "/tokenize", None, "tokens", "abc", "tokens"),
    ("cand", "/tokenize", None, "tokens.0", "a", "tokens[0]"),
    ("ref", "/tokenize", None, "tokens.0", {"piece": "a"}, "tokens[0].id"),
    ("ref", "/apply-template", None, "prompt", DELETE, "prompt"),
    ("ref", "/apply-template", None, "prompt", 5, "prompt"),
    ("cand", "/completion", GEN, "", [1, 2], ""),
    ("cand", "/completion", GEN, "tokens", "abcd", "tokens"),
    ("ref", "/completion", GEN, "tokens.1", 1.5, "tokens[1]"),
    ("cand", "/completion", GEN, "stop_type", 3, "stop_type"),
    ("cand", "/completion", GEN, "generation_settings", "x", "generation_settings"),
    ("ref", "/completion", GEN, "completion_probabilities", {}, "completion_probabilities"),
    ("cand", "/completion", GEN, "completion_probabilities.2", "x", "completion_probabilities[2]"),
    ("cand", "/completion", GEN, "completion_probabilities.0.id", "3", "completion_probabilities[0].id"),
    ("ref", "/completion", GEN, "completion_probabilities.1.logprob", "x", "completion_probabilities[1].logprob"),
    ("cand", "/completion", GEN, "completion_probabilities.3.top_logprobs", "x", "completion_probabilities[3].top_logprobs"),
    ("ref", "/completion", GEN, "completion_probabilities.0.top_logprobs.1", 9, "completion_probabilities[0].top_logprobs[1]"),
    ("cand", "/completion", GEN, "completion_probabilities.0.top_logprobs.0.id", None, "completion_probabilities[0].top_logprobs[0].id"),
    ("ref", "/completion", GEN, "completion_probabilities.2.top_logprobs.1.logprob", DELETE,
     "completion_probabilities[2].top_logprobs[1].logprob"),
    ("cand", "/completion", GEN, "completion_probabilities.1.top_logprobs.2.logprob", "-1",
     "completion_probabilities[1].top_logprobs[2].logprob"),
    ("cand", "/completion", GEN, "timings", [], "timings"),
    ("cand", "/completion", GEN, "timings.draft_n", "3", "timings.draft_n"),
    ("cand", "/completion", GEN, "timings.draft_n_accepted", 1.5, "timings.draft_n_accepted"),
    ("ref", "/completion", GEN, "timings.prompt_ms", "1", "timings.prompt_ms"),
    ("cand", "/completion", GEN, "timings.predicted_ms", None, "timings.predicted_ms"),
    ("ref", "/completion", SCORE, "1", "x", "[1]"),
    ("ref", "/completion", SCORE, "1.index", "1", "[1].index"),
    ("ref", "/completion", SCORE, "2.completion_probabilities", "x", "[2].completion_probabilities"),
    ("ref", "/completion", SCORE, "1.completion_probabilities.0", [], "[1].completion_probabilities[0]"),
    ("ref", "/completion", SCORE, "1.completion_probabilities.0.top_logprobs.0.id", "7",
     "[1].completion_probabilities[0].top_logprobs[0].id"),
    ("ref", "/completion", SCORE, "3.completion_probabilities.0.top_logprobs.3.logprob", [],
     "[3].completion_probabilities[0].top_logprobs[3].logprob"),
    ("ref", "/completion", SCORE, "1.timings", 0, "[1].timings"),
    ("ref", "/completion", SCORE, "2.timings.prompt_n", "1", "[2].timings.prompt_n"),
]
REQUESTS = {"/props": "GET /props", "/slots": "GET /slots", "/v1/models": "GET /v1/models", "/tokenize": "POST /tokenize",
            "/apply-template": "POST /apply-template", "/completion": "POST /completion"}


@pytest.mark.parametrize("side, endpoint, kind, path, value, name", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2] or ''}-{c[3] or 'answer'}-{'missing' if c[4] is DELETE else type(c[4]).__name__}"
                              for c in CASES])
def test_a_field_out_of_shape_is_one_line_naming_it_and_the_request(side, endpoint, kind, path, value, name, workload, tmp_path):
    fault = (endpoint, kind, path, value)
    with ToyLlamaServer(drafts=False, fault=fault if side == "ref" else None) as ref, \
            ToyLlamaServer(drafts=True, fault=fault if side == "cand" else None) as cand:
        with pytest.raises(LogitdiffError) as e:
            _run(ref, cand, workload, tmp_path / "out")
        url = ref.url if side == "ref" else cand.url
    msg = str(e.value)
    role = "reference" if side == "ref" else "candidate"
    assert "\n" not in msg and msg.startswith(f"{role} server {url}"), msg
    assert (f"'{name}'" if name else "llama-server's answer is") in msg and REQUESTS[endpoint] in msg, msg
    assert ("has no field" in msg) if value is DELETE else ("expected" in msg), msg
    assert not (tmp_path / "out").exists()
