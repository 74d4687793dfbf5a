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

Containment, set by the runner before the module is imported, each part where the platform
allows it (every result says which parts were in force: :attr:`ExecResult.containment`):

* **kernel, Linux** (what holds even against ``ctypes`` and C extensions):

  - *filesystem*: Landlock (Linux >= 5.13, the ``landlock`` LSM enabled): the process and
    anything it starts may create, write, truncate, rename, link or remove files only beneath
    the sandbox directory (and write ``/dev/null``); the rest of the filesystem is a read-only
    view. Reading is allowed everywhere.
  - *network*: a seccomp filter refuses ``socket()`` and ``socketpair()`` of every address
    family (Unix sockets included: a pathname Unix socket is reachable from any network
    namespace) and io_uring, so the process can make no socket at all; and a network
    namespace of its own (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``, or ``CLONE_NEWNET``
    alone as root) where the kernel allows: no interface is up. Without seccomp, Landlock
    ABI >= 4 still refuses TCP connect and bind.
  - *processes*: the seccomp filter refuses fork, vfork, execve, execveat and clone without
    ``CLONE_THREAD`` (threads work), so no program can be started, whatever the route.
  - *metadata*: the seccomp filter refuses chmod, chown, utime and xattr changes in every
    form (``fchmod``, ``fchmodat(2)``, ``fchownat``, ``lchown``, ``utimes``, ``utimensat``,
    ``futimesat``, ``[lf]setxattr``, ``[lf]removexattr``, ``setxattrat``, ``removexattrat``)
    and the inode-flag ioctls (``chattr``), everywhere (the sandbox included): Landlock does
    not govern them.
  - *signals*: Landlock ABI >= 6 scoping: no signal to a process outside the sandbox.

  Each degrades on its own: where the kernel, a container's seccomp profile or a policy
  (e.g. restricted user namespaces) refuses a part, that part is "audit hook only (reason)".
* **resource limits** (soft = hard): address space :data:`MEMORY_LIMIT`, file size
  :data:`FILE_SIZE_LIMIT`, no core files, CPU seconds ``ceil(timeout) + 1``.  RLIMIT_NPROC is
  not set: Linux counts it per user (all of the user's processes) and threads count, so any
  useful value would break thread use or depend on what else the user runs.
* **an audit hook** (:pep:`578`, every platform) raising ``PermissionError`` on: network use
  (``socket.connect`` / ``bind`` / ``getaddrinfo`` / ``gethostbyname`` / ``gethostbyaddr`` /
  ``getnameinfo`` / ``sendto`` / ``sendmsg``); process creation or signalling
  (``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.posix_spawn``, ``os.spawn*``,
  ``os.fork``, ``os.forkpty``, ``os.kill``, ``os.killpg``); ``open``/``os.open`` for writing
  (mode with ``w a x +`` or flags with O_WRONLY, O_RDWR, O_CREAT, O_APPEND, O_TRUNC) of a path
  that does not resolve (symlinks followed) inside the sandbox, except ``/dev/null``; and
  removing, renaming, creating, linking, truncating or changing the metadata of such a path
  (``os.remove``/``unlink``/``rmdir``/``rename``/``replace``/``mkdir``/``link``/``symlink``/
  ``truncate``/``chmod``/``chown``/``utime``/``mkfifo``/``mknod``/xattrs, ``shutil.rmtree``/
  ``move``/``copy*``/``chown``/``make_archive``/``unpack_archive``, ``sqlite3.connect``).
  It gives the readable errors; it is not a boundary: ``ctypes``, C extensions,
  ``_posixsubprocess.fork_exec`` and paths relative to a ``dir_fd`` (judged against the cwd)
  go around it. Where only the hook holds a part, that part is not contained.
* **a result cap**: at most :data:`RESULT_LIMIT` bytes are read from the result pipe, block by
  block; a tool that sends more is killed and the call fails with one line.
* **a timeout**: the process group (the runner starts a new session) is killed with SIGKILL at
  ``timeout`` seconds; the call then returns within about one more second.

Not contained, anywhere: reading files (a tool can read what the user can), writing to the
descriptors the process is given (its stderr file beside the sandbox, capped by the file
size limit, and the result pipe, capped by the result cap: a tool can forge its own result), and CPU and memory use
within the limits above.  For hostile code use a container or VM as well.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LogitdiffError

if TYPE_CHECKING:  # toolcalls pulls in jsonschema; the CLI imports SANDBOX_HELP at startup
    from .toolcalls import ToolCall

MEMORY_LIMIT = 1 << 30  # bytes of address space for the tool process
FILE_SIZE_LIMIT = 16 << 20  # largest file the tool process may write (its stderr included)
RESULT_LIMIT = 16 << 20  # most bytes read from a tool's result pipe; more: the tool is killed
_KILL_GRACE = 1.0  # seconds to reap the process group after SIGKILL

# What `--help` says (flips; run). Keep in step with the module docstring and docs/flips-and-correctness.md.
SANDBOX_HELP = """\
Executed tool calls (items with a tools_module) run one per fresh subprocess, in an empty
temporary directory, with a timeout, memory/CPU/file-size limits and a Python audit hook.
On Linux the kernel also confines the process where it allows: Landlock (writes only inside
that directory), seccomp (no socket of any address family, Unix included; no new
processes; no chmod/chown/utime/xattr changes anywhere), a network namespace (no interface
up) and Landlock scoping (no signals to other processes). A tool's result is read up to
16 MiB; more kills it. Any part
the kernel refuses (old kernel, container profile, no user namespaces) falls back to the
audit hook alone, which ctypes, C extensions and dir_fd paths go around: that part is NOT
contained. Every execution records which parts held ("containment" in flips.parquet's
signals). Reading files is never restricted. For hostile code, use a container as well."""

# The runner, run with ``python -I -B -c _RUNNER MODE MODULE SANDBOX TIMEOUT MEM FSIZE``.
# It is self-contained (isolated mode: no cwd on sys.path, logitdiff not needed).
_RUNNER = r'''
import json, math, os, resource, sys

mode, module_path, sandbox, timeout, mem, fsize = sys.argv[1:7]
PARTS = ("filesystem", "network", "processes", "signals", "metadata")
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

def contain(sandbox):
    """Kernel-level containment, as much as this platform allows, before any tool code runs.

    Returns what is in force: {"filesystem", "network", "processes", "signals", "metadata"} -> one short
    line each. Each step degrades on its own (a kernel without Landlock still gets the
    namespace); "audit hook only" means that only the Python-level guard below holds."""
    got = {k: "audit hook only" for k in PARTS}
    if not sys.platform.startswith("linux"):
        return got
    import ctypes, platform, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    L = ctypes.c_long
    def why():
        return os.strerror(ctypes.get_errno())
    # network: a network namespace of its own holds only a loopback that is down, so no
    # address (TCP, UDP, abstract Unix sockets) outside the process is reachable. As root
    # CLONE_NEWNET alone works; unprivileged users need a user namespace with it.
    for flags in (0x10000000 | 0x40000000, 0x40000000):  # CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET
        if libc.unshare(ctypes.c_int(flags)) == 0:
            got["network"] = "network namespace (no interface up)"
            break
    else:
        got["network"] = f"audit hook only (no network namespace: {why()})"
    # Landlock and seccomp without privileges need no_new_privs (inherited, never undone)
    if libc.prctl(L(38), L(1), L(0), L(0), L(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        for k in ("filesystem", "processes", "signals", "metadata"):
            got[k] = f"audit hook only (no_new_privs refused: {why()})"
        return got
    # filesystem: Landlock (Linux >= 5.13). Only write-like rights are handled, so reading
    # stays allowed everywhere; they are granted beneath the sandbox and on /dev/null only.
    abi = libc.syscall(L(444), None, L(0), L(1))  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi < 1:
        got["filesystem"] = got["signals"] = f"audit hook only (no Landlock: {why()})"
    else:
        write_file, truncate = 1 << 1, (1 << 14 if abi >= 3 else 0)
        fs = write_file | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13)) | truncate  # REMOVE_*, MAKE_*
        fs |= (1 << 13) if abi >= 2 else 0  # REFER: links and renames across directories
        net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, no port allowed
        scoped = 3 if abi >= 6 else 0  # abstract Unix sockets and signals of other domains
        attr = struct.pack("<QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
        rs = libc.syscall(L(444), ctypes.c_char_p(attr), L(len(attr)), L(0))
        ok = rs >= 0
        for path, allowed in ((sandbox, fs), ("/dev/null", write_file | truncate)):
            if not ok:
                break
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rule = ctypes.create_string_buffer(struct.pack("<Qi", allowed, fd), 12)
            ok = libc.syscall(L(445), L(rs), L(1), rule, L(0)) == 0  # LANDLOCK_RULE_PATH_BENEATH
            os.close(fd)
        ok = ok and libc.syscall(L(446), L(rs), L(0)) == 0  # landlock_restrict_self
        if ok:
            got["filesystem"] = f"Landlock ABI {abi}: writes only inside the sandbox directory"
            got["signals"] = (f"Landlock ABI {abi}: no signal to a process outside the sandbox" if scoped
                              else f"audit hook only (Landlock ABI {abi} < 6 has no signal scoping)")
            if abi >= 4 and not got["network"].startswith("network namespace"):
                got["network"] = f"Landlock ABI {abi}: TCP refused; UDP and Unix sockets by the audit hook only"
        else:
            got["filesystem"] = got["signals"] = f"audit hook only (Landlock refused: {why()})"
        if rs >= 0:
            os.close(rs)
    # one seccomp filter (refused calls answer EPERM):
    # processes: fork, vfork, execve and clone without CLONE_THREAD (threads still work;
    #   clone3 says ENOSYS so the C library falls back to clone);
    # network: socket() and socketpair() of every address family (Unix sockets included:
    #   a pathname Unix socket is reachable from any network namespace) and io_uring (which
    #   can make sockets and open files without those calls);
    # metadata: chmod, chown, utime and xattr changes (Landlock does not govern them), every
    #   form, and the inode-flag ioctls (chattr): refused everywhere, inside the sandbox too.
    arch = platform.machine()
    tables = {  # audit arch, clone, ioctl, fork/exec, sockets, metadata
        "x86_64": (0xC000003E, 56, 16, (57, 58, 59, 322), (41, 53, 425, 426, 427),
                   (90, 91, 92, 93, 94, 132, 188, 189, 190, 197, 198, 199, 235, 260, 261, 268, 280, 452, 463, 466)),
        "aarch64": (0xC00000B7, 220, 29, (221, 281), (198, 199, 425, 426, 427),
                    (5, 6, 7, 14, 15, 16, 52, 53, 54, 55, 88, 452, 463, 466)),
    }
    if arch not in tables:
        got["processes"] = got["metadata"] = f"audit hook only (no seccomp filter for {arch})"
        return got
    audit_arch, nr_clone, nr_ioctl, nr_proc, nr_sock, nr_meta = tables[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # ERRNO(EPERM), ERRNO(ENOSYS)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, deny), (ld, 0, 0, 0),
            (jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # other ABIs (i386 on x86_64, x32): refused
    for nr in nr_proc + nr_sock + nr_meta:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
    prog += [(jeq, 0, 1, 435), (ret, 0, 0, nosys)]  # clone3: its flags are out of reach
    # FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS, FS_IOC_FSSETXATTR (low 32 bits of the request)
    cmds = (0x40086602, 0x40046602, 0x401C5820)
    prog += [(jeq, 0, 2 + 2 * len(cmds), nr_ioctl), (ld, 0, 0, 24)]
    for c in cmds:
        prog += [(jeq, 0, 1, c), (ret, 0, 0, deny)]
    prog += [(ret, 0, 0, allow)]
    prog += [(jeq, 0, 3, nr_clone), (ld, 0, 0, 16), (jset, 1, 0, 0x10000), (ret, 0, 0, deny),  # CLONE_THREAD
             (ret, 0, 0, allow)]
    filt = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in prog))
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt))
    if libc.prctl(L(22), L(2), ctypes.c_char_p(fprog), L(0), L(0)) == 0:  # PR_SET_SECCOMP, FILTER
        got["processes"] = "seccomp: fork and exec refused"
        got["metadata"] = "seccomp: chmod, chown, utime, xattr and inode-flag changes refused everywhere"
        ns = got["network"].startswith("network namespace")
        got["network"] = ("seccomp: no socket of any address family (Unix included), no io_uring"
                          + ("; network namespace (no interface up)" if ns else ""))
    else:
        got["processes"] = got["metadata"] = f"audit hook only (seccomp refused: {why()})"
    return got

SANDBOX = os.path.realpath(sandbox)
BLOCKED = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
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

try:
    CONTAINMENT = contain(SANDBOX)
except Exception as e:  # e.g. a Python built without ctypes: say so, run with the hook alone
    CONTAINMENT = {k: f"audit hook only ({type(e).__name__}: {e})" for k in PARTS}
sys.addaudithook(guard)
data = json.dumps({**run(), "containment": CONTAINMENT}).encode()
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
    ``seconds``: wall time of the subprocess; ``containment``: what held the tool process
    (``{"filesystem", "network", "processes"}`` -> one line each, see :func:`contained`),
    None when the process died before saying.
    """

    ok: bool
    value: Any
    error: str | None
    timed_out: bool
    seconds: float
    containment: dict | None = None

    def to_json(self) -> dict:
        return {"ok": self.ok, "value": self.value, "error": self.error,
                "timed_out": self.timed_out, "seconds": self.seconds, "containment": self.containment}


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


def _exchange(proc: subprocess.Popen, data: bytes, timeout: float) -> tuple[bytes, bool, bool]:
    """Send ``data`` to the tool's stdin and read its result pipe until EOF, at most
    :data:`RESULT_LIMIT` bytes and ``timeout`` seconds: (result bytes, timed out, flooded).
    Reads incrementally, so a flooding tool costs this process at most the cap."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None, "the tool is started with stdin and stdout pipes"
    out_fd, in_fd = stdout.fileno(), stdin.fileno()
    os.set_blocking(out_fd, False)
    os.set_blocking(in_fd, False)
    sel.register(out_fd, selectors.EVENT_READ)
    sel.register(in_fd, selectors.EVENT_WRITE)
    view, chunks, n = memoryview(data), [], 0
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", True, False
            for key, _ in sel.select(left):
                if key.fd == in_fd:
                    try:
                        view = view[os.write(in_fd, view[:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # died before reading: its exit status says why
                        view = view[:0]
                    if not view:
                        sel.unregister(in_fd)
                        stdin.close()
                    continue
                try:
                    block = os.read(out_fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not block:
                    sel.unregister(out_fd)
                    continue
                n += len(block)
                if n > RESULT_LIMIT:
                    return b"", False, True
                chunks.append(block)
    finally:
        sel.close()
    return b"".join(chunks), False, False


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
            t_end = time.monotonic() + timeout
            out, timed_out, flooded = _exchange(proc, json.dumps(payload).encode(), timeout)
            if not (timed_out or flooded):  # the result pipe is closed; the process must end too
                try:
                    proc.wait(timeout=max(0.0, t_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
            if timed_out or flooded:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: anything it started dies too
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=_KILL_GRACE)
            except subprocess.TimeoutExpired:  # unkillable (D state): give up on it
                pass
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()
            seconds = time.monotonic() - t0
            err.seek(max(0, err.seek(0, os.SEEK_END) - 4000))
            tail = err.read().decode("utf-8", "replace").strip().splitlines()
    if timed_out:
        return ExecResult(False, None, f"timed out after {timeout:g}s", True, seconds)
    if flooded:
        return ExecResult(False, None, f"tool process killed: its result exceeded {RESULT_LIMIT >> 20} MiB", False, seconds)
    try:
        res = json.loads(out.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        res = None
    if not isinstance(res, dict) or "ok" not in res:
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        how = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
        if rc < 0 and -rc in signal.valid_signals():
            how = f"killed by {signal.Signals(-rc).name}"
        last = f": {' '.join(tail[-1].split())[:300]}" if tail else ""
        return ExecResult(False, None, f"tool process ended without a result ({how}){last}", False, seconds)
    held = res.get("containment")
    if res["ok"]:
        return ExecResult(True, res.get("value"), None, False, seconds, held)
    return ExecResult(False, None, res.get("error") or "failed", False, seconds, held)


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < 1e6):
        raise LogitdiffError(f"tool call timeout {timeout!r}: must be a number of seconds above 0 (and finite)")
    return float(timeout)


def _module(module_path: str | Path) -> Path:
    p = Path(module_path).resolve()
    if not p.is_file():
        raise LogitdiffError(f"{module_path}: tools module not found")
    return p


def load_check(module_path: str | Path, timeout: float = 10.0) -> dict | None:
    """Import the tools module once, sandboxed as a call would be; return the containment
    that held (see :class:`ExecResult`); raise LogitdiffError ``"<path>: tools module failed
    to import: <one line>"`` or ``"<path>: tools module did not import within Ns"``."""
    r = _run(_module(module_path), "import", None, _check_timeout(timeout))
    if r.timed_out:
        raise LogitdiffError(f"{module_path}: tools module did not import within {timeout:g}s")
    if not r.ok:
        reason = (r.error or "").removeprefix("tools module failed to import: ")
        raise LogitdiffError(f"{module_path}: tools module failed to import: {reason}")
    return r.containment


def execute_calls(module_path: str | Path, calls: list[ToolCall], *, timeout: float = 5.0) -> list[ExecResult]:
    """Run each call in its own fresh sandboxed subprocess (see the module docstring); one
    ExecResult per call, in order.  Never blocks longer than about ``timeout + 1`` s a call."""
    path = _module(module_path)
    timeout = _check_timeout(timeout)
    return [_run(path, "call", c.to_json(), timeout) for c in calls]


def compare_results(a: list[ExecResult], b: list[ExecResult]) -> tuple[bool, list[str]]:
    """Do two executions agree?  Per call: the same ``ok``; when both ok, equal values
    (:func:`~logitdiff.flips.toolcalls.values_equal` without string normalisation: numbers within
    1e-9 relative, bool is not a number).  Two failures agree whatever their error text (a
    timeout and an exception are both failures).  Returns (equal, reasons)."""
    from .toolcalls import values_equal

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
