"""The sandbox against the failure classes of a hostile campaign (issue #39), tried for real:
real victim processes, real System V objects, a real pseudo-terminal, real threads and files,
answers forged onto the real result pipe, whole programs run by run_program.

Each class is asserted on what the sandboxed code could reach (nothing changed), and where the
result says a part was not contained (an older kernel, a container profile) the assertion is
skipped for that part, never weakened. The unsandboxed controls show each attack works
outside the sandbox, so these tests can fail.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
import uuid
from pathlib import Path

import pytest

from logitdiff.errors import LogitdiffError
from logitdiff.flips.sandbox import (DISK_LIMIT, INODE_LIMIT, RESULT_DEPTH_LIMIT, TASK_LIMIT, ExecResult,
                                     _remove_tree, compare_results, execute_calls, load_check, run_program)
from logitdiff.flips.toolcalls import ToolCall

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
                                reason="the hostile module uses Linux syscalls of x86_64 and aarch64")

HOSTILE = Path(__file__).parent / "data" / "sandbox_hostile.py"
# part -> how its line starts when the kernel holds it
KERNEL = {"other_processes": "seccomp", "signals": ("Landlock", "seccomp"), "ipc": ("IPC namespace", "seccomp"),
          "terminal": "no terminal", "tasks": "RLIMIT_NPROC", "disk": "tmpfs", "filesystem": "Landlock",
          "network": "seccomp"}


@pytest.fixture(scope="module")
def H():
    """The hostile module itself, for the unsandboxed controls and the checks."""
    spec = importlib.util.spec_from_file_location("sandbox_hostile", HOSTILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def genuine():
    """The containment this platform gives (from an import that forges nothing)."""
    return load_check(HOSTILE)


def call(name, timeout=10.0, **arguments) -> ExecResult:
    (r,) = execute_calls(HOSTILE, [ToolCall(name, arguments)], timeout=timeout)
    return r


def held(r: ExecResult, part: str) -> bool:
    line = r.containment[part]
    assert line.startswith(KERNEL[part]) or line.startswith(("not contained (", "audit hook only (")), line
    return line.startswith(KERNEL[part])


@pytest.fixture()
def victim():
    """A process of the same user, in a session of its own (so its process group is its own)."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield p.pid
    p.kill()
    p.wait()


# --- other processes: limits, priorities, affinity, scheduling, I/O priority, signals ----------------
REACH = ("prlimit_fsize", "prlimit_cpu", "prlimit_nofile", "nice", "nice_group", "sched_setattr_nice", "affinity",
         "scheduler", "ioprio")
ALL_OF_USER = ("nice_user", "ioprio_user")  # every process of the user: never tried unsandboxed
KILLS = ("tgkill", "pidfd_kill")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an affinity change needs two CPUs to be seen")
@pytest.mark.parametrize("what", REACH + KILLS)
def test_control_each_route_reaches_another_process_outside_the_sandbox(what, victim, H):
    before = H.controls(victim)
    assert H.reach(victim, what) == "changed"
    time.sleep(0.05)  # a signal's delivery
    assert H.controls(victim) != before, what


@pytest.mark.parametrize("what", REACH + ALL_OF_USER + KILLS)
def test_no_route_reaches_another_process(what, victim, H):
    mine, before = H.controls(os.getpid()), H.controls(victim)
    r = call("reach", pid=victim, what=what, uid=os.getuid())
    time.sleep(0.05)
    part = "signals" if what in KILLS else "other_processes"
    if held(r, part):
        assert not r.ok and "Operation not permitted" in r.error, (what, r.value, r.error)
        assert H.controls(victim) == before, what
        assert H.controls(os.getpid()) == mine, what  # the user's other processes, this one among them


_PARENT = r'''
import importlib.util, json, os, sys, tempfile
from logitdiff.flips.sandbox import execute_calls
from logitdiff.flips.toolcalls import ToolCall
spec = importlib.util.spec_from_file_location("h", sys.argv[1])
h = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h)
before = h.controls(os.getpid())
calls = [ToolCall("reach", {"pid": os.getpid(), "what": w, "uid": os.getuid()}) for w in json.loads(sys.argv[2])]
results = [r.to_json() for r in execute_calls(sys.argv[1], calls)]
after = h.controls(os.getpid())
with tempfile.TemporaryFile() as f:  # a run's next write: would fail under a lowered file-size limit
    f.write(b"x" * (1 << 20))
print(json.dumps({"before": before, "after": after, "results": results}))
'''


def test_the_sandbox_parent_keeps_its_limits_priority_and_life(H):
    """The campaign's critical case: the tool lowers its parent's file-size limit (flips on a
    shared RUN then failed) or CPU limit, renices it, pins it, or signals it."""
    whats = list(REACH + KILLS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.run([sys.executable, "-c", _PARENT, str(HOSTILE), json.dumps(whats)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["after"] == out["before"]
    for what, r in zip(whats, out["results"]):
        assert not r["ok"] and "Operation not permitted" in r["error"], (what, r)


# --- System V IPC -----------------------------------------------------------------------------------
@pytest.fixture()
def sysv(H):
    """A shared-memory segment holding b'keep', an empty message queue and a semaphore at 0,
    made here (outside any sandbox) under one fresh key."""
    libc = ctypes.CDLL(None, use_errno=True)
    key = int.from_bytes(os.urandom(3), "little") | 0x4C000000
    shmid = H._check(libc.shmget(key, 4096, H.IPC_CREAT | 0o600), "shmget")
    msqid = H._check(libc.msgget(key, H.IPC_CREAT | 0o600), "msgget")
    semid = H._check(libc.semget(key, 1, H.IPC_CREAT | 0o600), "semget")
    H.shm_write(shmid, b"keep")
    yield {"key": key, "shmid": shmid, "msqid": msqid, "semid": semid}
    libc.shmctl(shmid, 0, None)
    libc.msgctl(msqid, 0, None)
    libc.semctl(semid, 0, 0)


def _ipc_state(H, ids):
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sysvipc/msg") as f:
        qnum = [int(line.split()[4]) for line in f if line.split()[1] == str(ids["msqid"])]
    return {"shm": H.shm_read(ids["shmid"], 5), "messages": qnum, "sem": libc.semctl(ids["semid"], 0, 12),  # GETVAL
            "objects": H.ipc_objects(), "mq": _mq_exists()}


def _mq_exists(name=b"/logitdiff-left-behind"):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.mq_open(name, os.O_RDONLY)
    if fd >= 0:
        os.close(fd)
    return fd >= 0


IPC = ("shm_by_key", "shm_by_id", "msg_by_key", "msg_by_id", "sem_by_id", "sem_by_key", "leave_objects", "posix_mq")


@pytest.mark.parametrize("what", IPC)
def test_control_each_ipc_route_works_outside_the_sandbox(what, sysv, H):
    before = _ipc_state(H, sysv)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        assert H.ipc(what, **sysv) == "reached"
        assert _ipc_state(H, sysv) != before, what
    finally:  # what the control left behind
        for kind, _, ident in set(H.ipc_objects()) - set(before["objects"]):
            {"shm": lambda i: libc.shmctl(i, 0, None), "msg": lambda i: libc.msgctl(i, 0, None),
             "sem": lambda i: libc.semctl(i, 0, 0)}[kind](ident)
        libc.mq_unlink(b"/logitdiff-left-behind")


@pytest.mark.parametrize("what", IPC)
def test_no_ipc_object_outside_is_reached_and_none_is_left_behind(what, sysv, H):
    before = _ipc_state(H, sysv)
    r = call("ipc", what=what, **sysv)
    if held(r, "ipc"):
        assert not r.ok, (what, r.value)
        # EPERM (seccomp) or not found (an IPC namespace of its own)
        assert r.error.startswith(("PermissionError: [Errno 1]", "FileNotFoundError: [Errno 2]")), r.error
        assert _ipc_state(H, sysv) == before, what


# --- terminals --------------------------------------------------------------------------------------
@pytest.fixture()
def pty():
    """A real pseudo-terminal: canonical, echo on, 24x80."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    yield master, slave
    os.close(master)
    os.close(slave)


def _tty(slave):
    return termios.tcgetattr(slave), fcntl.ioctl(slave, termios.TIOCGWINSZ, bytes(8))


def _waiting_input(slave) -> bytes:
    os.set_blocking(slave, False)
    try:
        return os.read(slave, 1000)
    except BlockingIOError:
        return b""
    finally:
        os.set_blocking(slave, True)


TERMINAL = ("path:echo_off", "path:tiocsti", "path:winsize", "path:ctty", "path:read", "proc_fd:echo_off",
            "proc_fd:tiocsti", "dev_tty:echo_off", "dev_tty:tiocsti")


def test_control_a_terminal_opened_read_only_can_be_changed_and_injected(pty, H):
    master, slave = pty
    state = _tty(slave)
    H.terminal("path:echo_off", path=os.ttyname(slave))
    assert not termios.tcgetattr(slave)[3] & termios.ECHO
    H.terminal("path:winsize", path=os.ttyname(slave))
    assert _tty(slave) != state
    if os.path.exists("/proc/sys/dev/tty/legacy_tiocsti") and open("/proc/sys/dev/tty/legacy_tiocsti").read().strip() == "1":
        H.terminal("path:tiocsti", path=os.ttyname(slave))
        assert _waiting_input(slave) == b"injected\n"


@pytest.mark.parametrize("what", TERMINAL)
def test_no_terminal_can_be_changed_injected_or_read(what, pty, H):
    master, slave = pty
    os.write(master, b"secret\n")
    state = _tty(slave)
    r = call("terminal", what=what, path=os.ttyname(slave), pid=os.getpid(), fd=slave)
    if held(r, "terminal"):
        assert not r.ok, (what, r.value)
        assert _tty(slave) == state, what
        assert _waiting_input(slave) == b"secret\n", what  # nothing injected, nothing read away


def test_terminal_ioctls_are_refused_before_any_device_sees_them():
    """The filter itself: on /dev/null (granted to the sandbox) a terminal query reaches the
    device (ENOTTY) while TIOCSTI, tcsetattr and TIOCSWINSZ are refused (EPERM) first."""
    prog = ("import fcntl, os, struct, termios\n"
            "fd = os.open('/dev/null', os.O_RDONLY)\n"
            "out = []\n"
            "for req, arg in ((termios.TCGETS, bytes(60)), (termios.TIOCSTI, b'x'), (termios.TCSETS, bytes(60)),\n"
            "                 (termios.TIOCSWINSZ, struct.pack('HHHH', 1, 1, 0, 0))):\n"
            "    try:\n"
            "        fcntl.ioctl(fd, req, arg)\n"
            "        out.append('ok')\n"
            "    except OSError as e:\n"
            "        out.append(os.strerror(e.errno))\n"
            "raise SystemExit(repr(out))\n")
    r = run_program(prog)
    if r.containment["terminal"].startswith("no terminal"):
        assert r.error == ("SystemExit: ['Inappropriate ioctl for device', 'Operation not permitted', "
                           "'Operation not permitted', 'Operation not permitted']"), r.error


def test_an_inherited_terminal_is_never_passed_on(pty):
    """The caller's own stdin is a terminal: the sandboxed process still holds none."""
    master, slave = pty
    saved = os.dup(0)
    try:
        os.dup2(slave, 0)
        r = call("terminal", what="inherited")
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    assert r.ok and r.value == [], r


# --- tasks --------------------------------------------------------------------------------------
def test_control_this_process_can_start_more_threads_than_the_cap(H):
    import threading

    before = threading.stack_size()
    assert H.threads(TASK_LIMIT * 3) == TASK_LIMIT * 3
    # the control runs in this process: the small thread stacks it asks for are put back (a
    # model's forward pass on a later 64 KiB worker thread crashed the suite)
    assert threading.stack_size() == before


def test_threads_are_capped():
    t0 = time.monotonic()
    r = call("threads", n=2000)
    if held(r, "tasks"):
        assert r.ok and r.value == TASK_LIMIT - 1, r  # the main thread is the cap's first task
    assert time.monotonic() - t0 < 10


# --- disk ---------------------------------------------------------------------------------------
def _leftover_sandboxes() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("logitdiff-tool-")}


def test_total_bytes_written_are_capped_whatever_the_file_sizes():
    r = call("fill", total_mib=120, file_mib=8)  # each file under the per-file limit
    if held(r, "disk"):
        assert r.ok and r.value["error"] == "ENOSPC", r
        assert DISK_LIMIT - (8 << 20) <= r.value["written"] <= DISK_LIMIT, r.value


def test_files_are_capped_in_number():
    r = call("many_files", n=100_000)
    if held(r, "disk"):
        assert r.ok and r.value["error"] == "ENOSPC" and r.value["made"] < INODE_LIMIT, r.value


def test_deeply_nested_directories_cost_the_parent_nothing():
    before = _leftover_sandboxes()
    t0 = time.monotonic()
    r = call("nest", depth=3000)
    assert r.ok and r.value == 3000, r
    assert time.monotonic() - t0 < 15
    assert _leftover_sandboxes() <= before


@pytest.fixture()
def memory_dir():
    """A directory on tmpfs where there is one (removing thousands of directories on a busy
    disk takes milliseconds each), else in the temporary directory."""
    d = tempfile.mkdtemp(prefix="logitdiff-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield Path(d)
    _remove_tree(d)


def test_removal_of_any_depth_without_recursion(memory_dir):
    """Where no mount namespace held the writes, the parent removes what is left itself:
    3,000 nested directories (past PATH_MAX and the recursion limit), a directory of mode 0
    and a link to a file outside (which survives)."""
    outside = memory_dir / "outside.txt"
    outside.write_text("keep")
    top = memory_dir / "sandbox"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.symlink(outside, "link", dir_fd=fd)
    os.mkdir("locked", 0, dir_fd=fd)
    os.close(fd)
    _remove_tree(str(top))
    assert not top.exists()
    assert outside.read_text() == "keep"


# --- the parent survives any answer --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["deep_open", "deep_closed", "deep_value", "deep_object", "big_int", "not_utf8",
                                  "ok_not_bool", "error_not_str", "not_object", "null", "surrogates", "long_error",
                                  "two_answers", "forged_containment"])
def test_a_forged_answer_is_one_line_error_for_that_call(kind, genuine):
    r = call("forge", kind=kind)
    assert isinstance(r, ExecResult) and not r.ok and r.value is None, (kind, r.value)
    if kind not in ("surrogates", "long_error"):  # those two are well-formed answers with a bad error text
        assert r.error.startswith("tool process sent an answer that cannot be taken: "), r.error
    assert "\n" not in r.error and len(r.error) <= 600, r.error
    r.error.encode("utf-8")  # printable: no lone surrogate
    assert r.containment == genuine  # written before any tool code ran: not forgeable
    json.dumps(r.to_json()).encode("utf-8")
    assert compare_results([r], [r]) == (True, [])


def test_honest_results_too_deep_or_too_big_for_the_parent():
    for depth in (200_000, RESULT_DEPTH_LIMIT + 1):
        r = call("deep", depth=depth)
        assert not r.ok and r.error == f"ValueError: the result is nested deeper than {RESULT_DEPTH_LIMIT} levels", r.error
    r = call("deep", depth=RESULT_DEPTH_LIMIT)
    assert r.ok and json.dumps(r.value) == "[" * RESULT_DEPTH_LIMIT + "]" * RESULT_DEPTH_LIMIT
    r = call("big", digits=5000)  # more digits than Python turns into a string: its repr cannot be made either
    assert r.ok and r.value.startswith("<unrepresentable int: ValueError"), r.value
    r = call("big", digits=400)  # beyond the float range: compared exactly
    assert r.ok and r.value == 10 ** 399
    same, why = compare_results([r], [ExecResult(True, 1.0, None, False, 0.1)])
    assert not same and why[0].startswith("call 0: value 1000"), why


def test_flips_exec_check_survives_forged_and_deep_answers():
    from logitdiff.flips.consequences import exec_checker

    check = exec_checker({"tools_module": str(HOSTILE)}, 10.0)
    assert check is not None
    sig = check([ToolCall("forge", {"kind": "deep_closed"}), ToolCall("deep", {"depth": 200_000})],
                [ToolCall("forge", {"kind": "surrogates"}), ToolCall("big", {"digits": 400})])
    assert [r["ok"] for r in sig["ref"] + sig["branch"]] == [False, False, False, True]
    json.dumps(sig, sort_keys=True, default=str).encode("utf-8")


# --- whole programs --------------------------------------------------------------------------------
HUMANEVAL_LIKE = '''
def add(x: int, y: int):
    """Add two numbers x and y"""
{body}

METADATA = {{}}


def check(candidate):
    assert candidate(0, 1) == 1
    assert candidate(5, 7) == 12
    assert candidate(7, 5) == 12

check(add)
'''


def test_program_that_passes():
    r = run_program(HUMANEVAL_LIKE.format(body="    return x + y"))
    assert (r.status, r.error) == ("pass", None), r
    assert set(r.containment) >= set(KERNEL) and r.seconds > 0


def test_program_that_fails_an_assert():
    r = run_program("print('working')\n" + HUMANEVAL_LIKE.format(body="    return x - y"))
    assert r.status == "fail" and r.error == "AssertionError", r
    assert "working" in r.stderr_tail and 'File "<program>"' in r.stderr_tail and "AssertionError" in r.stderr_tail
    assert 'File "<string>"' not in r.stderr_tail  # the runner's own frames are left out


def test_program_that_loops_forever_times_out():
    t0 = time.monotonic()
    r = run_program("while True:\n    pass\n", timeout=1.5)
    assert r.status == "timeout" and r.error == "timed out after 1.5s", r
    assert time.monotonic() - t0 < 1.5 + 2.5
    assert r.containment is not None  # said before the program ran


@pytest.mark.parametrize("exit_code, status, error", [("0", "pass", None), ("None", "pass", None),
                                                       ("3", "fail", "SystemExit: 3"), ("'no'", "fail", "SystemExit: no")])
def test_program_exit_codes(exit_code, status, error):
    r = run_program(f"import sys\nsys.exit({exit_code})\n")
    assert (r.status, r.error) == (status, error), r


def test_program_that_ends_the_process_itself_or_reads_stdin_fails():
    r = run_program("import os\nos._exit(0)\n")
    assert r.status == "fail" and r.error == "ended without a result (exit status 0)", r
    r = run_program("input()\n")
    assert r.status == "fail" and r.error.startswith("EOFError"), r  # stdin is /dev/null


def test_program_that_writes_outside_or_opens_a_socket_fails_and_reaches_nothing():
    marker = Path("/tmp") / f"logitdiff-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    try:
        tries = {
            "open": f"open({str(marker)!r}, 'w').write('escaped')",
            "ctypes": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                       f"fd = libc.open({os.fsencode(marker)!r}, os.O_WRONLY | os.O_CREAT, 0o644)\n"
                       "assert fd >= 0, os.strerror(ctypes.get_errno())"),
            "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)",
            "subprocess": f"import subprocess\nsubprocess.run(['sh', '-c', 'echo escaped > {marker}'])",
        }
        for name, prog in tries.items():
            r = run_program(prog)
            assert r.status == "fail", (name, r)
            assert r.error.startswith(("PermissionError", "AssertionError: Permission denied")), (name, r.error)
            assert not marker.exists(), name
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        marker.unlink(missing_ok=True)


def test_run_program_refuses_bad_arguments():
    with pytest.raises(LogitdiffError, match="source must be a str"):
        run_program(b"print(1)")  # type: ignore[arg-type]
    with pytest.raises(LogitdiffError, match="timeout"):
        run_program("print(1)", timeout=0)


# --- as an unprivileged user ------------------------------------------------------------------------
# Under root the kernel's own permission checks stop some routes already (the runner's real uid
# is not root's); an ordinary user's tool and its victims share one uid, so there only the
# sandbox stands between them. The tests run as root here: this one becomes uid 65534, with a
# copy of the sandbox (it needs only errors.py) and a Python that user can run.
_UNPRIVILEGED = r'''
import importlib.util, json, os, subprocess, sys, time
from logitdiff.flips.sandbox import TASK_LIMIT, execute_calls
spec = importlib.util.spec_from_file_location("h", sys.argv[1])
h = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h)

class Call:  # what execute_calls needs of a ToolCall (toolcalls pulls in jsonschema)
    def __init__(self, name, arguments):
        self.name, self.arguments = name, arguments
    def to_json(self):
        return {"name": self.name, "arguments": self.arguments}

whats = json.loads(sys.argv[2])
out = {"uid": os.getuid(), "control": {}, "sandboxed": {}}
for what in whats:
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        before = h.controls(victim.pid)
        try:
            h.reach(victim.pid, what)
        except OSError as e:
            out["control"][what] = str(e)
        time.sleep(0.05)
        out["control"][what] = out["control"].get(what) or (h.controls(victim.pid) != before)
    finally:
        victim.kill()
        victim.wait()
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        mine, before = h.controls(os.getpid()), h.controls(victim.pid)
        targets = [Call("reach", {"pid": victim.pid, "what": what, "uid": os.getuid()}),
                   Call("reach", {"pid": os.getpid(), "what": what, "uid": os.getuid()})]
        rs = execute_calls(sys.argv[1], targets)
        time.sleep(0.05)
        out["sandboxed"][what] = {"errors": [r.error for r in rs], "victim_same": h.controls(victim.pid) == before,
                                  "parent_same": h.controls(os.getpid()) == mine, "containment": rs[0].containment}
    finally:
        victim.kill()
        victim.wait()
(r,) = execute_calls(sys.argv[1], [Call("threads", {"n": 2000})])
out["threads"] = [r.value, r.containment["tasks"], TASK_LIMIT]
print(json.dumps(out))
'''


def _python_for(uid: int) -> str | None:
    """A Python interpreter user ``uid`` can run (this one may live in root's home)."""
    for exe in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            p = subprocess.run([exe, "-c", "import ctypes, json, termios"], user=uid, group=uid, extra_groups=[],
                               capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if p.returncode == 0:
            return exe
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root (as a user, the tests above are this case)")
def test_as_an_unprivileged_user_no_route_reaches_its_own_processes():
    nobody = 65534
    python = _python_for(nobody)
    if python is None:
        pytest.skip("no Python that uid 65534 can run")
    src = Path(__file__).parent.parent / "src" / "logitdiff"
    top = Path(tempfile.mkdtemp(prefix="logitdiff-test-"))
    try:
        pkg = top / "logitdiff"
        (pkg / "flips").mkdir(parents=True)
        for rel in ("errors.py", "flips/sandbox.py"):
            (pkg / rel).write_bytes((src / rel).read_bytes())
        for rel in ("__init__.py", "flips/__init__.py"):
            (pkg / rel).write_text("")
        hostile = top / "sandbox_hostile.py"
        hostile.write_bytes(HOSTILE.read_bytes())
        for p in [top, *top.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        whats = [w for w in REACH + KILLS if w != "affinity" or len(os.sched_getaffinity(0)) > 1]
        p = subprocess.run([python, "-c", _UNPRIVILEGED, str(hostile), json.dumps(whats)], user=nobody, group=nobody,
                           extra_groups=[], capture_output=True, text=True, cwd=top, timeout=300,
                           env={"PATH": os.defpath, "PYTHONPATH": str(top)})
    finally:
        _remove_tree(str(top))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["uid"] == nobody
    for what in whats:
        assert out["control"][what] is True, (what, out["control"][what])  # unsandboxed, each route works
        got = out["sandboxed"][what]
        part = "signals" if what in KILLS else "other_processes"
        if got["containment"][part].startswith(KERNEL[part]):
            assert got["victim_same"] and got["parent_same"], (what, got)
            assert all("Operation not permitted" in e for e in got["errors"]), (what, got["errors"])
    value, line, cap = out["threads"]
    if line.startswith("RLIMIT_NPROC"):
        assert value == cap - 1, out["threads"]
