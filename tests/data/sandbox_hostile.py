"""Tools that try to reach past the sandbox (tests/test_sandbox_hostile.py): other processes'
limits and scheduling, System V IPC outside, terminals, task and disk exhaustion, and answers
forged straight onto the result pipe. Each is also called unsandboxed by the tests (the
controls), so a test that finds nothing changed can fail.

Linux only (ctypes libc calls and raw syscall numbers for x86_64 and aarch64).
"""

import ctypes
import errno
import fcntl
import os
import platform
import resource
import stat
import struct
import termios
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
# ioprio_set, ioprio_get, sched_setattr
_NR = {"x86_64": (251, 252, 314), "aarch64": (30, 31, 274)}[platform.machine()]
IOPRIO_WHO_PROCESS, IOPRIO_WHO_USER, IOPRIO_IDLE = 1, 3, 3 << 13


def _check(rc, what):
    if rc is None or rc == -1 or (isinstance(rc, int) and rc < 0):
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


# --- other processes ------------------------------------------------------------------------
def ioprio_get(pid):
    return _check(_libc.syscall(ctypes.c_long(_NR[1]), ctypes.c_long(IOPRIO_WHO_PROCESS), ctypes.c_long(pid)), "ioprio_get")


def controls(pid):
    """What another process could change of ``pid``: its limits, nice value, CPU affinity,
    scheduling policy and I/O priority, and whether it is alive."""
    if not _alive(pid):
        return {"alive": False}
    limits = {name: list(resource.prlimit(pid, getattr(resource, name)))
              for name in ("RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_NPROC")}
    return {"limits": limits, "nice": os.getpriority(os.PRIO_PROCESS, pid),
            "affinity": sorted(os.sched_getaffinity(pid)), "policy": os.sched_getscheduler(pid),
            "ioprio": ioprio_get(pid), "alive": True}


def _alive(pid):
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except OSError:
        return False


def reach(pid, what, uid=None):
    """Change something of process ``pid`` (or of every process of ``uid``)."""
    pid = int(pid)
    if what == "prlimit_fsize":
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    elif what == "prlimit_cpu":
        resource.prlimit(pid, resource.RLIMIT_CPU, (1, 1))
    elif what == "prlimit_nofile":
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (8, 8))
    elif what == "nice":
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    elif what == "nice_group":
        os.setpriority(os.PRIO_PGRP, os.getpgid(pid), 19)
    elif what == "nice_user":
        os.setpriority(os.PRIO_USER, int(uid), 19)
    elif what == "sched_setattr_nice":
        attr = struct.pack("<IIQiIQQQ", 48, 0, 0, 19, 0, 0, 0, 0)  # size, SCHED_OTHER, flags, nice 19
        buf = ctypes.create_string_buffer(attr, 48)
        _check(_libc.syscall(ctypes.c_long(_NR[2]), ctypes.c_long(pid), buf, ctypes.c_long(0)), "sched_setattr")
    elif what == "affinity":
        os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
    elif what == "scheduler":
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    elif what == "ioprio":
        _check(_libc.syscall(ctypes.c_long(_NR[0]), ctypes.c_long(IOPRIO_WHO_PROCESS), ctypes.c_long(pid),
                             ctypes.c_long(IOPRIO_IDLE)), "ioprio_set")
    elif what == "ioprio_user":
        _check(_libc.syscall(ctypes.c_long(_NR[0]), ctypes.c_long(IOPRIO_WHO_USER), ctypes.c_long(int(uid)),
                             ctypes.c_long(IOPRIO_IDLE)), "ioprio_set")
    elif what == "tgkill":
        _check(_libc.syscall(ctypes.c_long(234 if _NR[0] == 251 else 131), ctypes.c_long(pid), ctypes.c_long(pid),
                             ctypes.c_long(9)), "tgkill")
    elif what == "pidfd_kill":
        fd = _check(_libc.syscall(ctypes.c_long(434), ctypes.c_long(pid), ctypes.c_long(0)), "pidfd_open")
        _check(_libc.syscall(ctypes.c_long(424), ctypes.c_long(fd), ctypes.c_long(9), None, ctypes.c_long(0)),
               "pidfd_send_signal")
    else:
        raise ValueError(what)
    return "changed"


# --- System V IPC -------------------------------------------------------------------------------
IPC_CREAT, IPC_PRIVATE, IPC_NOWAIT, IPC_RMID = 0o1000, 0, 0o4000, 0


class _Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 16)]


class _Sembuf(ctypes.Structure):
    _fields_ = [("num", ctypes.c_ushort), ("op", ctypes.c_short), ("flg", ctypes.c_short)]


def ipc_objects():
    """(kind, key, id) of every System V object this IPC namespace shows."""
    out = []
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            out += [(kind, int(line.split()[0]), int(line.split()[1])) for line in list(f)[1:]]
    return sorted(out)


def shm_write(shmid, data):
    addr = _libc.shmat(int(shmid), None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        _check(-1, "shmat")
    ctypes.memmove(addr, data, len(data))
    _libc.shmdt(ctypes.c_void_p(addr))


def shm_read(shmid, n):
    addr = _libc.shmat(int(shmid), None, 0o10000)  # SHM_RDONLY
    if addr in (None, ctypes.c_void_p(-1).value):
        _check(-1, "shmat")
    data = ctypes.string_at(addr, n)
    _libc.shmdt(ctypes.c_void_p(addr))
    return data


def msg_send(msqid, text):
    m = _Msg(1, text)
    _check(_libc.msgsnd(int(msqid), ctypes.byref(m), 16, IPC_NOWAIT), "msgsnd")


def sem_add(semid, n):
    op = _Sembuf(0, int(n), 0)
    _check(_libc.semop(int(semid), ctypes.byref(op), 1), "semop")


def ipc(what, key=0, shmid=0, msqid=0, semid=0):
    """Reach System V objects made outside (by key or by id), or leave new ones behind."""
    if what == "shm_by_key":
        shm_write(_check(_libc.shmget(int(key), 0, 0), "shmget"), b"owned")
    elif what == "shm_by_id":
        shm_write(shmid, b"owned")
    elif what == "msg_by_key":
        msg_send(_check(_libc.msgget(int(key), 0), "msgget"), b"owned")
    elif what == "msg_by_id":
        msg_send(msqid, b"owned")
    elif what == "sem_by_id":
        sem_add(semid, 5)
    elif what == "sem_by_key":
        sem_add(_check(_libc.semget(int(key), 0, 0), "semget"), 5)
    elif what == "leave_objects":
        _check(_libc.shmget(IPC_PRIVATE, 1 << 16, IPC_CREAT | 0o600), "shmget")
        _check(_libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600), "msgget")
        _check(_libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600), "semget")
    elif what == "posix_mq":
        _check(_libc.mq_open(b"/logitdiff-left-behind", os.O_CREAT | os.O_RDWR, 0o600, None), "mq_open")
    else:
        raise ValueError(what)
    return "reached"


# --- terminals ----------------------------------------------------------------------------------
def terminal(what, path="", pid=0, fd=0):
    """Change or use a terminal: by its path, through another process's descriptor, or one inherited."""
    if what == "inherited":
        return [n for n in range(256) if _isatty(n)]
    if what == "dev_tty":
        t = os.open("/dev/tty", os.O_RDONLY)
    elif what == "proc_fd":
        t = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDONLY | os.O_NOCTTY)
    else:
        t = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    action = what.split(":")[-1]
    if action == "echo_off":
        attrs = termios.tcgetattr(t)
        attrs[3] &= ~(termios.ECHO | termios.ISIG | termios.ICANON)
        termios.tcsetattr(t, termios.TCSANOW, attrs)
    elif action == "tiocsti":
        for c in b"injected\n":
            fcntl.ioctl(t, termios.TIOCSTI, bytes([c]))
    elif action == "winsize":
        fcntl.ioctl(t, termios.TIOCSWINSZ, struct.pack("HHHH", 3, 7, 0, 0))
    elif action == "read":
        return os.read(t, 100).decode()
    elif action == "ctty":
        fcntl.ioctl(t, termios.TIOCSCTTY, 0)
    return "done"


def _isatty(n):
    try:
        return os.isatty(n)
    except OSError:
        return False


# --- tasks and disk -----------------------------------------------------------------------------
def threads(n):
    """Start up to ``n`` threads at once (small stacks); how many started. The stack size
    is process-wide: it is put back, for the threads a caller starts afterwards (the
    unsandboxed control runs this in the test process, where a model's forward pass on a
    64 KiB thread stack crashed later tests)."""
    before = threading.stack_size(64 << 10)
    release, started = threading.Event(), []
    try:
        for _ in range(int(n)):
            t = threading.Thread(target=release.wait, daemon=True)
            t.start()
            started.append(t)
    except RuntimeError:
        pass
    finally:
        release.set()
        threading.stack_size(before)
    for t in started:
        t.join()
    return len(started)


def fill(total_mib, file_mib):
    """Write files of ``file_mib`` MiB until ``total_mib`` MiB or an error: bytes written, error."""
    block, written = b"x" * (1 << 20), 0
    try:
        for k in range(int(total_mib) // int(file_mib)):
            with open(f"f{k}", "wb") as f:
                for _ in range(int(file_mib)):
                    f.write(block)
                    f.flush()
                    written += len(block)
    except OSError as e:
        return {"written": written, "error": errno.errorcode.get(e.errno, str(e.errno))}
    return {"written": written, "error": None}


def many_files(n):
    made = 0
    try:
        for k in range(int(n)):
            open(f"e{k}", "w").close()
            made += 1
    except OSError as e:
        return {"made": made, "error": errno.errorcode.get(e.errno, str(e.errno))}
    return {"made": made, "error": None}


def nest(depth):
    """Directories nested ``depth`` deep, each made under a descriptor of the one above (no
    path grows, so neither PATH_MAX nor the audit hook's path checks slow it down)."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(int(depth)):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(fd)
    return int(depth)


def where():
    return os.getcwd()


# --- answers forged onto the result pipe ----------------------------------------------------------
FORGED = {
    "deep_open": b"[" * 200_000,
    "deep_closed": b"[" * 200_000 + b"]" * 200_000,
    "deep_value": b'{"ok": true, "value": ' + b"[" * 150 + b"]" * 150 + b"}",
    "deep_object": b'{"ok": true, "value": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}",
    "big_int": b'{"ok": true, "value": 1' + b"0" * 5000 + b"}",
    "not_utf8": b'{"ok": true, "value": "\xff\xfe"}',
    "ok_not_bool": b'{"ok": "yes", "value": 1}',
    "error_not_str": b'{"ok": false, "error": ["x", {"y": 1}]}',
    "not_object": b"[1, 2, 3]",
    "null": b"null",
    "surrogates": b'{"ok": false, "error": "bad \\ud800 line\\nsecond"}',
    "long_error": b'{"ok": false, "error": "' + b"x\\n" * 300_000 + b'"}',
    "two_answers": b'{"ok": true, "value": 1}\n{"ok": true, "value": 2}',
    "forged_containment": b'{"filesystem": "forged"}\n{"ok": true, "value": "forged"}',
}


def forge(kind):
    """Write a forged answer to every pipe this process may write (the result pipe among them)
    and end at once, before the runner can answer."""
    data = FORGED[kind]
    for fd in range(3, 64):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            continue
    os._exit(0)


def deep(depth):
    """A value of lists nested ``depth`` levels deep (``[]`` is one level), returned honestly."""
    v = []
    for _ in range(int(depth) - 1):
        v = [v]
    return v


def big(digits):
    return 10 ** (int(digits) - 1)
