"""Executable tool checks: run parsed tool calls against a Python module of tool functions.

The *tools module* is a Python file whose functions are named like the tools, e.g.
``def get_weather(city, unit): ...``.  A call ``{"name": "get_weather", "arguments": {...}}``
runs as ``get_weather(**arguments)``.  Callable names: those in the module's ``__all__``
when it has one, else the public (no leading ``_``) functions defined in the module itself
(so an imported ``from os import system`` is never callable).

Each call (and :func:`load_check`) runs in a fresh subprocess: ``sys.executable -I -B -c
<runner>``, cwd a fresh temporary directory (the *sandbox*, removed afterwards), environment
reduced to PATH, locale, one-thread BLAS settings and HOME/TMPDIR pointing at the sandbox (no
proxies, no PYTHON* variables).  The runner reads the call from stdin and writes one JSON
object to the original stdout; what the tool prints goes to stderr.

Guards, set by the runner before the module is imported:

* resource limits (soft = hard): address space :data:`MEMORY_LIMIT`, file size
  :data:`FILE_SIZE_LIMIT`, no core files, CPU seconds ``ceil(timeout) + 1``.  RLIMIT_NPROC is
  not set: Linux counts it per user (all of the user's processes) and threads count, so any
  useful value would break thread use or depend on what else the user runs; process
  creation is refused by the audit hook instead.
* an audit hook (:pep:`578`) raising ``PermissionError`` on: network use (``socket.connect``
  / ``bind`` / ``getaddrinfo`` / ``gethostbyname`` / ``gethostbyaddr`` / ``getnameinfo`` /
  ``sendto`` / ``sendmsg``); process creation or signalling (``subprocess.Popen``,
  ``os.system``, ``os.exec*``, ``os.posix_spawn``, ``os.spawn*``, ``os.fork``,
  ``os.forkpty``, ``os.kill``, ``os.killpg``); ``open``/``os.open`` for writing (mode with
  ``w a x +`` or flags with O_WRONLY, O_RDWR, O_CREAT, O_APPEND, O_TRUNC) of a path that does
  not resolve (symlinks followed) inside the sandbox, except ``/dev/null``; and removing,
  renaming, creating, linking, truncating or changing the metadata of such a path
  (``os.remove``/``unlink``/``rmdir``/``rename``/``replace``/``mkdir``/``link``/``symlink``/
  ``truncate``/``chmod``/``chown``/``utime``/``mkfifo``/``mknod``/xattrs, ``shutil.rmtree``/
  ``move``/``copy*``/``chown``/``make_archive``/``unpack_archive``, ``sqlite3.connect``).
  Reading files anywhere is allowed.
* a timeout: the process group (the runner starts a new session) is killed with SIGKILL at
  ``timeout`` seconds; the call then returns within about one more second.

This guards against tools that by accident reach the network, spawn programs or write
outside their directory.  It is not a security boundary against hostile code: audit hooks
can be sidestepped (``ctypes``, C extensions), and paths given relative to a ``dir_fd`` are
judged against the cwd.  Run untrusted tool code in a container.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import LogitdiffError
from .toolcalls import ToolCall, values_equal

MEMORY_LIMIT = 1 << 30  # bytes of address space for the tool process
FILE_SIZE_LIMIT = 16 << 20  # largest file the tool process may write (its stderr included)
_KILL_GRACE = 1.0  # seconds to reap the process group after SIGKILL

# The runner, run with ``python -I -B -c _RUNNER MODE MODULE SANDBOX TIMEOUT MEM FSIZE``.
# It is self-contained (isolated mode: no cwd on sys.path, logitdiff not needed).
_RUNNER = r'''
import json, math, os, resource, sys

mode, module_path, sandbox, timeout, mem, fsize = sys.argv[1:7]
result_fd = os.dup(1)        # the result channel; everything the tool prints goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
for lim, val in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsize)),
                 (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, math.ceil(float(timeout)) + 1)):
    hard = resource.getrlimit(lim)[1]
    val = val if hard == resource.RLIM_INFINITY else min(val, hard)
    resource.setrlimit(lim, (val, val))
payload = json.loads(sys.stdin.read() or "null")

import importlib.util, inspect

SANDBOX = os.path.realpath(sandbox)
BLOCKED = {
    "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg",
    "socket.sethostname", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
    "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.startfile",
}
# event -> positions of the path arguments that must lie inside the sandbox
PATH_ARGS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
    "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,), "os.chflags": (0,),
    "shutil.rmtree": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,),
    "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.copytree": (1,),
    "shutil.chown": (0,), "shutil.make_archive": (0,), "shutil.unpack_archive": (1,),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(p):
    if p is None or isinstance(p, int):   # an open file descriptor, or no path
        return True
    full = os.path.realpath(os.path.join(os.getcwd(), os.fsdecode(p)))
    return full == SANDBOX or full.startswith(SANDBOX + os.sep) or full == "/dev/null"

def guard(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
        return
    if event == "sqlite3.connect" and args and args[0] not in (":memory:", "", b":memory:", b""):
        if not inside(args[0]):
            raise PermissionError(f"sandbox: sqlite3.connect {args[0]!r} outside the working directory")
        return
    for i in PATH_ARGS.get(event, ()):
        if i < len(args) and not inside(args[i]):
            raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory is not allowed")

def one_line(e):
    msg = " ".join(str(e).split())
    s = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return s if len(s) <= 500 else s[:497] + "..."

def run():
    try:
        sys.path.append(os.path.dirname(os.path.abspath(module_path)))
        spec = importlib.util.spec_from_file_location("_logitdiff_tools", module_path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    except BaseException as e:
        return {"ok": False, "error": "tools module failed to import: " + one_line(e)}
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, f in vars(mod).items() if not n.startswith("_")
                 and inspect.isfunction(f) and f.__module__ == mod.__name__]
    if mode == "import":
        return {"ok": True, "value": sorted(names)}
    name, args = payload["name"], payload["arguments"]
    fn = getattr(mod, name, None) if name in names else None
    if not callable(fn):
        return {"ok": False, "error": f"NameError: the tools module has no function {name!r}"}
    try:
        value = fn(**args)
    except BaseException as e:
        return {"ok": False, "error": one_line(e)}
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            value = repr(value)
        except BaseException as e:
            value = f"<unrepresentable {type(value).__name__}: {one_line(e)}>"
    return {"ok": True, "value": value}

sys.addaudithook(guard)
data = json.dumps(run()).encode()
view = memoryview(data)
while view:
    view = view[os.write(result_fd, view):]
'''


@dataclass
class ExecResult:
    """One executed call.

    ``ok``: the function returned; ``value``: its result as JSON (after a JSON round trip;
    a value that JSON cannot hold is replaced by its ``repr`` string), None unless ok;
    ``error``: one line (``"TypeError: ..."``, a sandbox ``PermissionError``, ``timed out
    after 5s``, or how the process died); ``timed_out``: killed at the timeout;
    ``seconds``: wall time of the subprocess.
    """

    ok: bool
    value: Any
    error: str | None
    timed_out: bool
    seconds: float

    def to_json(self) -> dict:
        return {"ok": self.ok, "value": self.value, "error": self.error,
                "timed_out": self.timed_out, "seconds": self.seconds}


def _env(sandbox: str) -> dict[str, str]:
    env = {
        "PATH": os.defpath, "HOME": sandbox, "TMPDIR": sandbox, "TMP": sandbox, "TEMP": sandbox,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        # one thread each: BLAS thread pools would reserve most of MEMORY_LIMIT on a big machine
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    if "LD_LIBRARY_PATH" in os.environ:  # some Python builds need it to start at all
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def _run(module_path: Path, mode: str, payload: Any, timeout: float) -> ExecResult:
    """Run the runner once in a fresh sandbox; the runner's answer as an ExecResult."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="logitdiff-tool-", ignore_cleanup_errors=True) as tmp:
        sandbox = os.path.join(os.path.realpath(tmp), "work")
        os.mkdir(sandbox)
        # stderr goes to a file beside (not inside) the sandbox: no pipe to fill up, and the
        # tool cannot overwrite it through the sandbox
        with open(os.path.join(tmp, "stderr"), "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _RUNNER, mode, str(module_path), sandbox,
                 repr(float(timeout)), str(MEMORY_LIMIT), str(FILE_SIZE_LIMIT)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=sandbox,
                env=_env(sandbox), start_new_session=True,
            )
            timed_out = False
            try:
                out, _ = proc.communicate(json.dumps(payload).encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: anything it started dies too
                except ProcessLookupError:
                    pass
                try:
                    out, _ = proc.communicate(timeout=_KILL_GRACE)
                except subprocess.TimeoutExpired:  # unkillable (D state): give up on it
                    out = b""
            seconds = time.monotonic() - t0
            err.seek(max(0, err.seek(0, os.SEEK_END) - 4000))
            tail = err.read().decode("utf-8", "replace").strip().splitlines()
    if timed_out:
        return ExecResult(False, None, f"timed out after {timeout:g}s", True, seconds)
    try:
        res = json.loads(out.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        res = None
    if not isinstance(res, dict) or "ok" not in res:
        rc = proc.returncode
        how = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
        if rc < 0 and -rc in signal.valid_signals():
            how = f"killed by {signal.Signals(-rc).name}"
        last = f": {' '.join(tail[-1].split())[:300]}" if tail else ""
        return ExecResult(False, None, f"tool process ended without a result ({how}){last}", False, seconds)
    if res["ok"]:
        return ExecResult(True, res.get("value"), None, False, seconds)
    return ExecResult(False, None, res.get("error") or "failed", False, seconds)


def _module(module_path: str | Path) -> Path:
    p = Path(module_path).resolve()
    if not p.is_file():
        raise LogitdiffError(f"{module_path}: tools module not found")
    return p


def load_check(module_path: str | Path, timeout: float = 10.0) -> None:
    """Import the tools module once, sandboxed as a call would be; raise LogitdiffError
    ``"<path>: tools module failed to import: <one line>"`` or ``"<path>: tools module did
    not import within Ns"``."""
    r = _run(_module(module_path), "import", None, timeout)
    if r.timed_out:
        raise LogitdiffError(f"{module_path}: tools module did not import within {timeout:g}s")
    if not r.ok:
        reason = r.error.removeprefix("tools module failed to import: ")
        raise LogitdiffError(f"{module_path}: tools module failed to import: {reason}")


def execute_calls(module_path: str | Path, calls: list[ToolCall], *, timeout: float = 5.0) -> list[ExecResult]:
    """Run each call in its own fresh sandboxed subprocess (see the module docstring); one
    ExecResult per call, in order.  Never blocks longer than about ``timeout + 1`` s a call."""
    path = _module(module_path)
    return [_run(path, "call", c.to_json(), timeout) for c in calls]


def compare_results(a: list[ExecResult], b: list[ExecResult]) -> tuple[bool, list[str]]:
    """Do two executions agree?  Per call: the same ``ok``; when both ok, equal values
    (:func:`~logitdiff.toolcalls.values_equal` without string normalisation: numbers within
    1e-9 relative, bool is not a number).  Two failures agree whatever their error text (a
    timeout and an exception are both failures).  Returns (equal, reasons)."""
    reasons = []
    if len(a) != len(b):
        reasons.append(f"{len(a)} results != {len(b)}")
    for k, (x, y) in enumerate(zip(a, b)):
        if x.ok != y.ok:
            reasons.append(f"call {k}: ok {x.ok} != {y.ok} ({x.error or y.error})")
        elif x.ok and not values_equal(x.value, y.value, normalize=False):
            reasons.append(f"call {k}: value {_short(x.value)} != {_short(y.value)}")
    return not reasons, reasons


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 80 else s[:77] + "..."
