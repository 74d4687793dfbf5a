"""The HTTP side of served sources: one client (connection pool, concurrency bound,
retries, replicas) and the probe that tells which server answers at a URL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import json
import re
import threading
from typing import Any
from urllib.parse import urlsplit

from ...errors import LogitdiffError


class ServerKind(str, enum.Enum):
    """Which OpenAI-compatible server speaks at a URL (``kind=`` of an ``openai:`` spec)."""

    LLAMACPP = "llamacpp"
    VLLM = "vllm"
    SGLANG = "sglang"

    def __str__(self) -> str:
        return self.value


def one_line(s: Any, n: int = 300) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def endpoint_root(url: str) -> str:
    u = url.strip().rstrip("/")
    if not re.match(r"^https?://", u):
        raise LogitdiffError(f"openai: endpoint {url!r} must start with http:// or https://")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def endpoint_host(root: str) -> str:
    """The host of an endpoint root, loopback spellings as one (127.0.0.1, localhost, ::1, 0.0.0.0:
    the same machine, the same cores)."""
    h = (urlsplit(root).hostname or "").lower()
    return "loopback" if h in ("localhost", "::1", "0.0.0.0") or h.startswith("127.") else h


class ServerError(LogitdiffError):
    """An HTTP error answer (4xx) of a server; ``status`` and ``body`` kept for callers."""

    def __init__(self, msg: str, status: int = 0, body: Any = None):
        super().__init__(msg)
        self.status, self.body = status, body


#: seconds close() waits for cancelled requests and the loop thread to wind down: closing a
#: source whose server hangs (Ctrl-C, a failed job) must not wait out the request timeout
CLOSE_WAIT_S = 2.0


class HttpClient:
    """An httpx client on its own event-loop thread (a sync facade for the source methods):
    bounded concurrency, retries with backoff, round-robin over replicas."""

    def __init__(self, roots: list[str], *, concurrency: int, timeout: float, retries: int, spec: str):
        import httpx

        self.roots = roots
        self.spec = spec
        self.retries = retries
        self.timeout = timeout
        self.concurrency = concurrency
        self._rr = itertools.count()
        # the calls waiting on the loop, cancelled by close(); a call after close() is refused
        self._inflight: set[concurrent.futures.Future] = set()
        self._closing = False
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logitdiff-openai", daemon=True)
        self._thread.start()
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)

        async def make():
            self._sem = asyncio.Semaphore(concurrency)
            return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)), limits=limits)

        self._http = self.run(make())

    def run(self, coro):
        """The coroutine's result, from any thread; a call cancelled by close() raises
        ``concurrent.futures.CancelledError``, one after close() a LogitdiffError."""
        with self._lock:  # close() sees every call submitted before its flag, so none waits on a stopped loop
            if self._closing:
                coro.close()
                raise LogitdiffError(f"{self.spec}: the client is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._inflight.add(fut)
        try:
            return fut.result()
        finally:
            with self._lock:
                self._inflight.discard(fut)

    def close(self) -> None:
        """Cancel every request in flight and stop the loop, waiting at most a few seconds
        (CLOSE_WAIT_S), never the request timeout: a hung server's prefetched block or an
        interrupted call must not hold Ctrl-C or a failed job's exit."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            inflight = list(self._inflight)
        for fut in inflight:
            fut.cancel()  # its waiter returns now; the task on the loop is cancelled with it

        async def shutdown():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_WAIT_S / 2)
            await self._http.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=CLOSE_WAIT_S)
        except Exception:  # noqa: BLE001  (closing: a connection that fails to close is let go)
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_WAIT_S)
        if not self._thread.is_alive():  # a loop still running cannot be closed; its thread is a daemon
            self._loop.close()

    def server_kind(self, root: str) -> "ServerKind":
        """Which server answers at ``root`` (:func:`detect_kind`)."""
        return self.run(detect_kind(self._http, root, self.spec))

    def next_root(self) -> str:
        return self.roots[next(self._rr) % len(self.roots)]

    async def _send(self, method: str, url: str, body: Any, started: asyncio.Event | None):
        if started is None:
            return await self._http.request(method, url, json=body)
        async with self._http.stream(method, url, json=body) as r:
            if r.status_code < 400:
                started.set()  # the server sends its headers with its first result
            await r.aread()
            return r

    async def request(self, method: str, path: str, body: Any = None, *, root: str | None = None, retry: bool = True,
                      bounded: bool = True, failover: bool = False, started: asyncio.Event | None = None) -> Any:
        """JSON request with bounded concurrency and retries (timeouts, connection errors, 5xx).

        Without ``root`` each attempt takes the next endpoint (round-robin); with ``root`` the
        first attempt goes there and, with ``failover``, retries move on to the other replicas.
        With ``started`` the answer is a server-sent event stream (``"stream": true``): the
        event is set when its first event arrives, and the answer is the list of its events."""
        import httpx

        attempts = self.retries if retry else 1
        last = ""
        delay = 0.25
        for attempt in range(max(1, attempts)):
            if root is not None and (attempt == 0 or not failover):
                base = root
            else:
                base = self.next_root()
            url = base + path
            try:
                if bounded:
                    async with self._sem:
                        r = await self._send(method, url, body, started)
                else:
                    r = await self._send(method, url, body, started)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                # connected, then silence: say so rather than "connection failed"
                last = f"{url}: no response within {self.timeout:g} s"
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                last = f"{url}: {type(e).__name__}{': ' + one_line(e, 120) if str(e) else ''}"
            else:
                if r.status_code < 400 and started is not None:
                    return _sse_events(r.text, url)
                if r.status_code < 400:
                    try:
                        return r.json()
                    except (ValueError, RecursionError):
                        raise LogitdiffError(f"{url}: answer is not JSON ({one_line(r.text, 120)!r})") from None
                try:
                    payload = r.json()
                except (ValueError, RecursionError):
                    payload = r.text
                if r.status_code >= 500 and r.status_code != 501:
                    last = f"{url}: HTTP {r.status_code} {one_line(err_text(payload), 160)}"
                else:
                    raise ServerError(f"{url}: HTTP {r.status_code} {one_line(err_text(payload), 240)}", r.status_code, payload)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 8.0)
        raise LogitdiffError(f"{self.spec}: server unreachable or failing after {max(1, attempts)} attempt(s) ({last})")


def _sse_events(text: str, url: str) -> list:
    """The JSON payloads of a server-sent event stream (``data: {...}`` lines)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            if data and data != "[DONE]":
                try:
                    events.append(json.loads(data))
                except (ValueError, RecursionError):
                    raise LogitdiffError(f"{url}: an event of the answer is not JSON ({one_line(data, 120)!r})") from None
    return events


def err_text(payload: Any) -> str:
    if isinstance(payload, dict):
        e = payload.get("error", payload.get("message", payload.get("detail", payload)))
        if isinstance(e, dict):
            return str(e.get("message", e))
        return str(e)
    return str(payload)


PROBE_TIMEOUT_S = 10.0
PROBE_UNREACHABLE = -1  # no connection
PROBE_SILENT = -2  # connected, but no answer in time (the body is the seconds waited)


async def _probe(http, url: str) -> tuple[int, Any]:
    import httpx

    wait = min(PROBE_TIMEOUT_S, http.timeout.read or PROBE_TIMEOUT_S)
    try:
        r = await http.get(url, timeout=wait)
    except httpx.ReadTimeout:
        return PROBE_SILENT, wait
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError):
        return PROBE_UNREACHABLE, None
    try:
        return r.status_code, r.json()
    except (ValueError, RecursionError):
        return r.status_code, r.text


async def detect_kind(http, root: str, spec: str) -> ServerKind:
    """llama-server answers ``/props``; SGLang ``/get_model_info``; vLLM ``/version`` + ``/v1/models``."""
    st, body = await _probe(http, root + "/props")
    if st == PROBE_UNREACHABLE:
        raise LogitdiffError(f"{spec}: server unreachable at {root} (connection failed)")
    if st == PROBE_SILENT:
        raise LogitdiffError(f"{spec}: {root} accepted the connection but sent no response within {body:g} s")
    if st == 200 and isinstance(body, dict) and ("default_generation_settings" in body or "build_info" in body):
        return ServerKind.LLAMACPP
    st, body = await _probe(http, root + "/get_model_info")
    if st == 200 and isinstance(body, dict) and "model_path" in body:
        return ServerKind.SGLANG
    st, body = await _probe(http, root + "/server_info")
    if st == 200 and isinstance(body, dict) and ("model_path" in body or "tokenizer_path" in body):
        return ServerKind.SGLANG
    st_v, body_v = await _probe(http, root + "/version")
    st_m, body_m = await _probe(http, root + "/v1/models")
    if st_v == 200 and isinstance(body_v, dict) and "version" in body_v and st_m == 200:
        return ServerKind.VLLM
    raise LogitdiffError(
        f"{spec}: cannot tell which server runs at {root} (no llama-server /props, SGLang /get_model_info or vLLM /version); "
        "pass kind=llamacpp|vllm|sglang"
    )
