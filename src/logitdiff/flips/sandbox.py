"""The sandbox: run untrusted Python (a tools module's functions, or a whole program such as a
HumanEval check) in a fresh, confined subprocess.

The *tools module* is a Python file whose functions are named like the tools, e.g.
``def get_weather(city, unit): ...``.  A call ``{"name": "get_weather", "arguments": {...}}``
runs as ``get_weather(**arguments)``.  Callable names: those in the module's ``__all__``
when it has one, else the public (no leading ``_``) functions defined in the module itself
(so an imported ``from os import system`` is never callable).  :func:`run_program` runs a
whole program's source text instead and says pass, fail or timeout.

Each call (:func:`execute_calls`, :func:`load_check`, :func:`run_program`) runs in a fresh
subprocess: ``sys.executable -I -B -c <runner>``, cwd a fresh temporary directory (the
*sandbox*, removed afterwards), a new session (no controlling terminal), stdin a pipe the
runner empties and then replaces with ``/dev/null``, environment reduced to PATH, locale,
one-thread BLAS settings and HOME/TMPDIR pointing at the sandbox (no proxies, no PYTHON*
variables).  The runner writes to its result pipe first the containment that holds (one JSON
line, before any untrusted code runs, so it cannot be forged), then the answer; what the code
prints goes to stderr.

Containment, set by the runner before the untrusted code is imported, each part where the
platform allows it; every result says which parts were in force (:attr:`ExecResult.containment`,
one line per part, ``"audit hook only (why)"`` or ``"not contained (why)"`` where the platform
refused it):

* **kernel, Linux** (what holds even against ``ctypes`` and C extensions):

  - *filesystem*: Landlock (Linux >= 5.13, the ``landlock`` LSM enabled): the process may
    create, write, truncate, rename, link or remove files only beneath the sandbox directory
    (and write ``/dev/null``); the rest of the filesystem is a read-only view; from ABI 5 no
    ioctl on a device it opens (but /dev/null, and the generic ``FIO*`` requests). Reading is
    allowed everywhere.
  - *network*: a seccomp filter refuses ``socket()`` and ``socketpair()`` of every address
    family (Unix sockets included: a pathname Unix socket is reachable from any network
    namespace) and io_uring; and a network namespace of its own (no interface up). Without
    seccomp, Landlock ABI >= 4 still refuses TCP connect and bind.
  - *processes*: seccomp refuses fork, vfork, execve, execveat and clone without
    ``CLONE_THREAD`` (threads work), so no program can be started, whatever the route.
  - *metadata*: seccomp refuses chmod, chown, utime and xattr changes in every form and the
    inode-flag ioctls (``chattr``), everywhere (the sandbox included): Landlock does not
    govern them.
  - *signals*: Landlock ABI >= 6 scoping (no signal to a process outside the sandbox), and
    seccomp: ``kill`` only to itself or its own process group (itself alone), ``tgkill`` and
    the ``sigqueue`` calls only to itself, no ``tkill``, no pidfd, no ``F_SETOWN`` /
    ``FIOSETOWN`` (SIGIO to another owner).
  - *other_processes*: seccomp lets ``prlimit64``, ``setpriority``/``getpriority``
    (``PRIO_PROCESS`` only), ``sched_setaffinity``/``setscheduler``/``setparam``/``setattr``
    name only pid 0 or the process itself, and refuses ``ioprio_set``, ``ptrace``,
    ``process_vm_readv/writev``, ``kcmp``, ``process_madvise``/``mrelease``, page migration,
    ``perf_event_open``, ``bpf`` and the keyring calls (the user's keyrings are shared).
  - *ipc*: an IPC namespace of its own (System V objects die with it), seccomp refusing
    every System V IPC and POSIX message-queue call, and ``/dev/shm``, ``/dev/mqueue`` hidden
    under empty read-only mounts.
  - *terminal*: none: a new session, stdin ``/dev/null``, no terminal descriptor,
    ``/dev/pts`` hidden under an empty read-only mount, and seccomp refusing every ioctl of
    the terminal ('T'), console keyboard ('K') and virtual console ('V') types but the
    queries (``TCGETS``, ``TIOCGWINSZ``, ``FIONREAD``, ...): no ``tcsetattr``, ``TIOCSTI``,
    ``TIOCSWINSZ``, ``TIOCSCTTY``, whatever descriptor a terminal is reached through.
  - *tasks*: ``RLIMIT_NPROC`` :data:`TASK_LIMIT` in a user namespace of its own. Linux counts
    RLIMIT_NPROC per real uid *and user namespace* (threads included), so in a namespace of
    its own it counts the sandbox's tasks alone (outside one it would count every process of
    the user, hence not set there). Real uid 0 is exempt in the kernel, so under root the
    runner first moves its *real* uid to the overflow uid (effective and file-system uids stay
    0: file access is unchanged) and seccomp refuses every set*id call, so it cannot move back.
    Chosen over counting threads from outside (a poll sees 2,000 threads only after they
    exist) and over seccomp (which cannot count).
  - *disk*: a tmpfs of :data:`DISK_LIMIT` bytes and :data:`INODE_LIMIT` inodes mounted over
    the sandbox in a mount namespace of its own: the total the code can write there, in any
    number of files. It lives in that namespace only: the parent never walks what was written
    there (3,000 nested directories cost it nothing) and it is gone when the process ends.
  - *privileges*: every capability dropped (bounding, ambient, effective, permitted), and
    seccomp refusing the set*id calls, ``capset``, ``unshare``, ``setns``, ``chroot`` and the
    mount calls.

  Each degrades on its own: where the kernel, a container's seccomp profile or a policy
  (e.g. restricted user namespaces) refuses a part, its line says so.
* **resource limits** (soft = hard): address space :data:`MEMORY_LIMIT`, file size
  :data:`FILE_SIZE_LIMIT` (the stderr file included), no core files, CPU seconds
  ``ceil(timeout) + 1``, tasks as above.
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
* **the parent survives any answer**: at most :data:`RESULT_LIMIT` bytes are read from the
  result pipe, block by block (more: the process is killed); an answer that is not JSON, not
  UTF-8, nested deeper than :data:`RESULT_DEPTH_LIMIT` levels, holds an integer Python will
  not read, or has fields of the wrong type is that call's one-line error; the sandbox is
  removed without recursion, whatever depth of directories is left in it.
* **a timeout**: the process group is killed with SIGKILL at ``timeout`` seconds; the call
  then returns within about one more second.

Not contained, anywhere: reading files (the code can read what the user can, though not
other processes' memory: Landlock refuses ptrace outside the sandbox), file locks on files it
can read, CPU and memory use within the limits above (tmpfs pages included), and the
answer itself: the untrusted code shares the runner's process, so it can write a forged answer
(a tool's value, a program's pass) to the result pipe — never the containment line.
For hostile code a container or VM is still the stronger boundary.
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
from typing import TYPE_CHECKING, Any, Literal

from ..errors import LogitdiffError

if TYPE_CHECKING:  # toolcalls pulls in jsonschema
    from .toolcalls import ToolCall

MEMORY_LIMIT = 1 << 30  # bytes of address space for the sandboxed process
FILE_SIZE_LIMIT = 16 << 20  # largest file it may write (its stderr included)
DISK_LIMIT = 64 << 20  # bytes it may write into the sandbox in all (the tmpfs's size)
INODE_LIMIT = 4096  # files, directories and links it may make in the sandbox
TASK_LIMIT = 64  # tasks (the main thread and every other thread) it may have at once
RESULT_LIMIT = 16 << 20  # most bytes read from its result pipe; more: it is killed
RESULT_DEPTH_LIMIT = 100  # deepest nesting of lists and objects accepted in a tool's result
STDERR_TAIL = 4000  # bytes of stderr kept for an error line or a program's tail
_KILL_GRACE = 1.0  # seconds to reap the process group after SIGKILL

# The runner, run as ``python -I -B -c _RUNNER MODE TARGET SANDBOX TIMEOUT MEM FSIZE TASKS DISK INODES
# DEPTH`` (MODE: import, call or program; TARGET: the tools module, or - for a program).
# It is self-contained (isolated mode: no cwd on sys.path, logitdiff not needed).
_RUNNER = r'''
import json, math, os, resource, sys

mode, target, sandbox, timeout, mem, fsize, tasks, disk, inodes, depth = sys.argv[1:11]
PARTS = ("filesystem", "network", "processes", "signals", "metadata",
         "other_processes", "ipc", "terminal", "tasks", "disk", "privileges")
HOOKED = PARTS[:5]  # the audit hook has a say in these; nothing else holds the others
_write, _exit = os.write, os._exit  # as they are before any tool code runs
result_fd = os.dup(1)        # the result channel; everything the tool prints goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
for lim, val in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsize)),
                 (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, math.ceil(float(timeout)) + 1)):
    hard = resource.getrlimit(lim)[1]
    val = val if hard == resource.RLIM_INFINITY else min(val, hard)
    resource.setrlimit(lim, (val, val))
payload = json.loads(sys.stdin.read() or "null")
_fd = os.open(os.devnull, os.O_RDONLY)  # no terminal and nothing more to read: stdin is /dev/null
os.dup2(_fd, 0)
os.close(_fd)

import importlib.util, inspect

LINUX = sys.platform.startswith("linux")
if LINUX:
    import ctypes, platform, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    L = ctypes.c_long

def why():
    return os.strerror(ctypes.get_errno())

def not_held(reason):
    return {k: (f"audit hook only ({reason})" if k in HOOKED else f"not contained ({reason})") for k in PARTS}

# --- namespaces and mounts ------------------------------------------------------------------
NEWUSER, NEWNET, NEWIPC, NEWNS, NEWUTS = 0x10000000, 0x40000000, 0x08000000, 0x00020000, 0x04000000
RDONLY, NOSUID, NODEV, NOEXEC, REC, PRIVATE = 1, 2, 4, 8, 1 << 14, 1 << 18

def unshare(flag):
    return True if libc.unshare(ctypes.c_int(flag)) == 0 else why()

def write_proc(name, text):
    with open("/proc/self/" + name, "w") as f:
        f.write(text)

def enter_namespaces():
    """Namespaces of its own: a user namespace first (unprivileged users need it for the
    others, and the tasks it holds are counted apart from the user's other processes), then
    network, IPC, mount and UTS, each on its own. {name: True or why not}; "ids": the uid and
    gid maps written (files in a tmpfs of this namespace need them); "ruid": what became of
    root's real uid."""
    ruid, euid, egid = os.getuid(), os.geteuid(), os.getegid()
    ns = {"ruid": None}
    if ruid == 0:
        # The kernel exempts real uid 0 from RLIMIT_NPROC, so the real uid becomes the
        # overflow uid; the effective and file-system uids stay 0 (file access is unchanged)
        # and seccomp below refuses every set*id call, so it cannot be set back.
        try:
            with open("/proc/sys/kernel/overflowuid") as f:
                os.setresuid(int(f.read()), -1, -1)
            ns["ruid"] = True
        except (OSError, ValueError) as e:
            ns["ruid"] = f"real uid 0 kept ({e}): the kernel exempts it from RLIMIT_NPROC"
    ns["user"] = unshare(NEWUSER)
    if ns["user"] is True:
        try:
            write_proc("setgroups", "deny")
            write_proc("uid_map", f"{euid} {euid} 1")
            write_proc("gid_map", f"{egid} {egid} 1")
            ns["ids"] = True
        except OSError as e:
            ns["ids"] = f"uid map refused: {e.strerror}"
    elif ns["ruid"] is True:
        os.setresuid(0, -1, -1)  # no user namespace: nothing to gain from the overflow uid
        ns["ruid"] = None
    for name, flag in (("network", NEWNET), ("ipc", NEWIPC), ("mount", NEWNS), ("uts", NEWUTS)):
        ns[name] = unshare(flag)
    return ns

def mount_tmpfs(path, flags, options):
    ok = libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(flags), options.encode()) == 0
    return True if ok else why()

def private_mounts(ns, sandbox):
    """In the mount namespace of its own, its mounts made private first (so nothing
    propagates back): a tmpfs of DISK bytes and INODES inodes over the sandbox (every byte and
    file the tool writes; gone with the namespace, never seen by the parent), and empty
    read-only tmpfs over /dev/pts (no terminal to open by path), /dev/shm and /dev/mqueue (no
    other process's POSIX shared memory or queues). {"disk", "pts", "shm"}: True or why not."""
    if ns["mount"] is not True:
        return dict.fromkeys(("disk", "pts", "shm"), f"no mount namespace: {ns['mount']}")
    if libc.mount(None, b"/", None, ctypes.c_ulong(REC | PRIVATE), None) != 0:
        return dict.fromkeys(("disk", "pts", "shm"), f"mounts not made private: {why()}")
    got = {}
    if ns["user"] is True and ns["ids"] is not True:
        got["disk"] = ns["ids"]
    else:
        got["disk"] = mount_tmpfs(sandbox, NOSUID | NODEV, f"size={disk},nr_inodes={inodes},mode=0700")
        if got["disk"] is True:
            os.chdir(sandbox)  # the working directory was the directory beneath the new mount
    empty, opts = RDONLY | NOSUID | NODEV | NOEXEC, "size=4k,nr_inodes=1,mode=0"
    got["pts"] = mount_tmpfs("/dev/pts", empty, opts) if os.path.isdir("/dev/pts") else True
    hidden = [mount_tmpfs(p, empty, opts) for p in ("/dev/shm", "/dev/mqueue") if os.path.isdir(p)]
    got["shm"] = next((r for r in hidden if r is not True), True)
    return got

def limit_tasks(ns):
    """RLIMIT_NPROC counts the tasks (threads included) of one real uid in one user
    namespace: in a namespace of its own that is the sandbox's tasks alone. The cap, or why
    not."""
    if ns["user"] is not True:
        return f"no user namespace of its own ({ns['user']}): RLIMIT_NPROC would count all the user's processes"
    if ns["ruid"] not in (None, True):
        return ns["ruid"]
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    n = int(tasks) if hard == resource.RLIM_INFINITY else min(int(tasks), hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    return n

def drop_capabilities():
    for cap in range(64):
        libc.prctl(L(24), L(cap), L(0), L(0), L(0))  # PR_CAPBSET_DROP (EINVAL past the last one)
    libc.prctl(L(47), L(4), L(0), L(0), L(0))  # PR_CAP_AMBIENT_CLEAR_ALL
    head = ctypes.create_string_buffer(struct.pack("<Ii", 0x20080522, 0))  # version 3, this process
    if libc.capset(head, ctypes.create_string_buffer(24)) != 0:  # effective, permitted, inheritable: none
        return f"capset refused: {why()}"
    with open("/proc/self/status") as f:
        held = [line.split()[1] for line in f if line.startswith(("CapEff:", "CapPrm:"))]
    return True if held and all(int(v, 16) == 0 for v in held) else f"capabilities left: {held}"

# --- Landlock ---------------------------------------------------------------------------------
def landlock(sandbox):
    """Write-like rights (and, ABI >= 5, ioctls on devices) only beneath the sandbox and on
    /dev/null; reading stays allowed everywhere. (abi, True or why not)."""
    abi = libc.syscall(L(444), None, L(0), L(1))  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi < 1:
        return 0, f"no Landlock: {why()}"
    write_file, truncate = 1 << 1, (1 << 14 if abi >= 3 else 0)
    fs = write_file | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13)) | truncate  # REMOVE_*, MAKE_*
    fs |= (1 << 13) if abi >= 2 else 0  # REFER: links and renames across directories
    ioctl_dev = (1 << 15) if abi >= 5 else 0  # IOCTL_DEV: no terminal or other device ioctl
    fs |= ioctl_dev
    net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, no port allowed
    scoped = 3 if abi >= 6 else 0  # abstract Unix sockets and signals of other domains
    attr = struct.pack("<QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    rs = libc.syscall(L(444), ctypes.c_char_p(attr), L(len(attr)), L(0))
    ok = rs >= 0
    for path, allowed in ((sandbox, fs), ("/dev/null", write_file | truncate | ioctl_dev)):
        if not ok:
            break
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = ctypes.create_string_buffer(struct.pack("<Qi", allowed, fd), 12)
        ok = libc.syscall(L(445), L(rs), L(1), rule, L(0)) == 0  # LANDLOCK_RULE_PATH_BENEATH
        os.close(fd)
    ok = ok and libc.syscall(L(446), L(rs), L(0)) == 0  # landlock_restrict_self
    reason = True if ok else f"Landlock refused: {why()}"
    if rs >= 0:
        os.close(rs)
    return abi, reason

# --- seccomp ----------------------------------------------------------------------------------
# Refused outright (EPERM), by group; then the calls judged by their arguments.
SYSCALLS = {
    "x86_64": {
        "audit": 0xC000003E,
        # fork vfork execve execveat
        "processes": (57, 58, 59, 322),
        # socket socketpair io_uring_setup io_uring_enter io_uring_register
        "network": (41, 53, 425, 426, 427),
        # chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes futimesat
        # utimensat [lf]setxattr [lf]removexattr setxattrat removexattrat
        "metadata": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198, 199, 463, 466),
        # ioprio_set tkill pidfd_open pidfd_send_signal pidfd_getfd ptrace process_vm_readv
        # process_vm_writev kcmp process_madvise process_mrelease migrate_pages move_pages
        # perf_event_open bpf keyctl add_key request_key
        "other_processes": (251, 200, 434, 424, 438, 101, 310, 311, 312, 440, 448, 256, 279, 298, 321, 250, 248, 249),
        # msgget msgsnd msgrcv msgctl semget semop semctl semtimedop shmget shmat shmctl shmdt
        # mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
        "ipc": (68, 69, 70, 71, 64, 65, 66, 220, 29, 30, 31, 67, 240, 241, 242, 243, 244, 245),
        # setuid setgid setreuid setregid setresuid setresgid setfsuid setfsgid setgroups capset
        # unshare setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig
        # fsmount fspick mount_setattr open_tree_attr
        "privileges": (105, 106, 113, 114, 117, 119, 122, 123, 116, 126, 272, 308, 165, 166, 155, 161,
                       428, 429, 430, 431, 432, 433, 442, 467),
        "by_args": {"clone": 56, "clone3": 435, "ioctl": 16, "fcntl": 72, "kill": 62, "tgkill": 234,
                    "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "setpriority": 141, "getpriority": 140,
                    "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
                    "sched_setattr": 314, "prlimit64": 302},
    },
    "aarch64": {
        "audit": 0xC00000B7,
        "processes": (221, 281),
        "network": (198, 199, 425, 426, 427),
        "metadata": (52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466),
        "other_processes": (30, 130, 434, 424, 438, 117, 270, 271, 272, 440, 448, 238, 239, 241, 280, 219, 217, 218),
        "ipc": (186, 189, 188, 187, 190, 193, 191, 192, 194, 196, 195, 197, 180, 181, 182, 183, 184, 185),
        "privileges": (146, 144, 145, 143, 147, 149, 151, 152, 159, 91, 97, 268, 40, 39, 41, 51,
                       428, 429, 430, 431, 432, 433, 442, 467),
        "by_args": {"clone": 220, "clone3": 435, "ioctl": 29, "fcntl": 25, "kill": 129, "tgkill": 131,
                    "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "setpriority": 140, "getpriority": 141,
                    "sched_setparam": 118, "sched_setscheduler": 119, "sched_setaffinity": 122,
                    "sched_setattr": 274, "prlimit64": 261},
    },
}
LD, JEQ, JGE, JSET, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
# ioctl requests: refused (chattr's inode flags; SIGIO to another owner), then the terminal
# queries allowed (TCGETS TIOCGWINSZ FIONREAD FIONBIO FIONCLEX FIOCLEX TIOCGPGRP TIOCGSID
# TIOCOUTQ TIOCGETD TIOCGPTN TCGETS2), then every other request of the terminal ('T'),
# console keyboard ('K') and virtual console ('V') types refused: termios, TIOCSTI, window
# size, controlling terminal, line discipline.
IOCTL_REFUSED = (0x40086602, 0x40046602, 0x401C5820, 0x8901, 0x8902)
IOCTL_QUERIES = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451, 0x540F, 0x5429, 0x5411, 0x5424,
                 0x80045430, 0x802C542A)
IOCTL_TYPES = (0x5400, 0x4B00, 0x5600)
FCNTL_REFUSED = (8, 15, 1024)  # F_SETOWN, F_SETOWN_EX (SIGIO to another process), F_SETLEASE

def arg(k):
    return (LD, 0, 0, 16 + 8 * k)  # the low 32 bits: the kernel reads these arguments as int

def only(*conds):
    """Allowed when every (argument, values) condition holds, else EPERM."""
    body = []
    for k, values in conds:
        body.append(arg(k))
        body += [(JEQ, len(values) - i, 0, v & 0xFFFFFFFF) for i, v in enumerate(values)]
        body.append((RET, 0, 0, EPERM))
    return body + [(RET, 0, 0, ALLOW)]

def refuse(k, values):
    """EPERM when argument k is one of values, else allowed."""
    body = [arg(k)]
    for v in values:
        body += [(JEQ, 0, 1, v), (RET, 0, 0, EPERM)]
    return body + [(RET, 0, 0, ALLOW)]

def ioctl_rule():
    body = [arg(1)]
    for v in IOCTL_REFUSED:
        body += [(JEQ, 0, 1, v), (RET, 0, 0, EPERM)]
    for v in IOCTL_QUERIES:
        body += [(JEQ, 0, 1, v), (RET, 0, 0, ALLOW)]
    body.append((AND, 0, 0, 0xFF00))
    for v in IOCTL_TYPES:
        body += [(JEQ, 0, 1, v), (RET, 0, 0, EPERM)]
    return body + [(RET, 0, 0, ALLOW)]

def seccomp_program(t, me):
    """The filter: other ABIs refused; the groups above refused; clone only with CLONE_THREAD
    (threads; clone3 answers ENOSYS so the C library falls back to clone); ioctl and fcntl by
    request; calls that name a process only on this one (pid 0 or its own)."""
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, t["audit"]), (RET, 0, 0, EPERM), (LD, 0, 0, 0),
            (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # other ABIs (i386 on x86_64, x32): refused
    for group in ("processes", "network", "metadata", "other_processes", "ipc", "privileges"):
        for nr in t[group]:
            prog += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    nr = t["by_args"]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]
    itself = (0, me)
    rules = {
        "clone": [arg(0), (JSET, 1, 0, 0x10000), (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)],  # CLONE_THREAD
        "ioctl": ioctl_rule(), "fcntl": refuse(1, FCNTL_REFUSED),
        "prlimit64": only((0, itself)), "sched_setaffinity": only((0, itself)),
        "sched_setscheduler": only((0, itself)), "sched_setparam": only((0, itself)),
        "sched_setattr": only((0, itself)),
        "setpriority": only((0, (0,)), (1, itself)), "getpriority": only((0, (0,)), (1, itself)),  # PRIO_PROCESS
        "kill": only((0, (0, me, -me))),  # itself, or its own process group (itself alone: no fork)
        "tgkill": only((0, (me,))), "rt_sigqueueinfo": only((0, (me,))), "rt_tgsigqueueinfo": only((0, (me,))),
    }
    for name, body in rules.items():
        prog += [(JEQ, 0, len(body), nr[name])] + body
    return prog + [(RET, 0, 0, ALLOW)]

def seccomp():
    t = SYSCALLS.get(platform.machine())
    if t is None:
        return f"no seccomp filter for {platform.machine()}"
    prog = seccomp_program(t, os.getpid())
    filt = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in prog))
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt))
    if libc.prctl(L(22), L(2), ctypes.c_char_p(fprog), L(0), L(0)) != 0:  # PR_SET_SECCOMP, FILTER
        return f"seccomp refused: {why()}"
    return True

# --- what held ----------------------------------------------------------------------------------
def describe(ns, mounts, task_cap, caps, abi, fs, sc):
    """One line per part: what holds it, or 'audit hook only (why)' / 'not contained (why)'."""
    got = not_held("?")
    scoped = fs is True and abi >= 6
    if fs is True:
        got["filesystem"] = (f"Landlock ABI {abi}: writes only inside the sandbox directory"
                             + ("; no device ioctls" if abi >= 5 else ""))
    else:
        got["filesystem"] = f"audit hook only ({fs})"
    netns = "network namespace (no interface up)" if ns["network"] is True else None
    if sc is True:
        got["network"] = "seccomp: no socket of any address family (Unix included), no io_uring" + (f"; {netns}" if netns else "")
    elif netns:
        got["network"] = netns
    elif fs is True and abi >= 4:
        got["network"] = f"Landlock ABI {abi}: TCP refused; UDP and Unix sockets by the audit hook only"
    else:
        got["network"] = f"audit hook only ({sc}; no network namespace: {ns['network']})"
    signals = ([f"Landlock ABI {abi}: no signal to a process outside the sandbox"] if scoped else []) + (
        ["seccomp: kill, tgkill and sigqueue only to itself, no pidfd, no SIGIO owner"] if sc is True else [])
    got["signals"] = "; ".join(signals) or f"audit hook only ({sc}; {fs if fs is not True else f'Landlock ABI {abi} < 6'})"
    if sc is True:
        got["processes"] = "seccomp: fork and exec refused"
        got["metadata"] = "seccomp: chmod, chown, utime, xattr and inode-flag changes refused everywhere"
        got["other_processes"] = ("seccomp: prlimit, priority, scheduling and CPU affinity only on itself; no I/O "
                                  "priority, ptrace, process_vm, kcmp, pidfd, page migration, perf, bpf or keyrings")
    else:
        for k in ("processes", "metadata"):
            got[k] = f"audit hook only ({sc})"
        got["other_processes"] = f"not contained ({sc})"
    ipc = (["IPC namespace of its own"] if ns["ipc"] is True else []) + (
        ["seccomp: System V IPC and POSIX message queues refused"] if sc is True else [])
    got["ipc"] = ("; ".join(ipc) + ("; /dev/shm hidden" if mounts["shm"] is True else "")) if ipc else (
        f"not contained ({sc}; no IPC namespace: {ns['ipc']})")
    tty = "new session, stdin /dev/null, no terminal descriptor"
    pts = "/dev/pts hidden" if mounts["pts"] is True else f"/dev/pts visible ({mounts['pts']})"
    got["terminal"] = (f"no terminal: {tty}; seccomp: terminal ioctls refused (termios, TIOCSTI, window size); {pts}"
                       if sc is True else f"not contained ({sc}: a terminal opened by path can be changed; {tty}; {pts})")
    if isinstance(task_cap, str):
        got["tasks"] = f"not contained ({task_cap})"
    elif ns["ruid"] is True and sc is not True:
        got["tasks"] = f"not contained ({sc}: root could set its real uid back, which RLIMIT_NPROC exempts)"
    else:
        got["tasks"] = f"RLIMIT_NPROC {task_cap} in a user namespace of its own: at most {task_cap} tasks, threads included"
    mib = int(fsize) >> 20
    got["disk"] = (f"tmpfs of {int(disk) >> 20} MiB and {inodes} inodes over the sandbox, in a mount namespace of its "
                   f"own (gone with it); files up to {mib} MiB each" if mounts["disk"] is True
                   else f"not contained ({mounts['disk']}); files up to {mib} MiB each")
    if caps is True:
        got["privileges"] = "no capabilities" + ("; seccomp: no set*id, capset, unshare, setns, mount or chroot"
                                                 if sc is True else f"; not refused: set*id, unshare, mount ({sc})")
    else:
        got["privileges"] = f"not contained ({caps}; {sc})"
    return got

def contain(sandbox):
    """Kernel-level containment, as much as this platform allows, before any tool code runs:
    one line per part (see describe). Each step degrades on its own."""
    if not LINUX:
        return not_held("not Linux")
    ns = enter_namespaces()
    mounts = private_mounts(ns, sandbox)
    task_cap = limit_tasks(ns)
    caps = drop_capabilities()
    # Landlock and seccomp without privileges need no_new_privs (inherited, never undone)
    if libc.prctl(L(38), L(1), L(0), L(0), L(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        nnp = f"no_new_privs refused: {why()}"
        return describe(ns, mounts, task_cap, caps, 0, nnp, nnp)
    abi, fs = landlock(sandbox)
    return describe(ns, mounts, task_cap, caps, abi, fs, seccomp())

# --- the audit hook -------------------------------------------------------------------------------
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

# --- running the tool or program ------------------------------------------------------------------
def one_line(e):
    msg = " ".join(str(e).split())
    s = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return s if len(s) <= 500 else s[:497] + "..."

def too_deep(value, limit):
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False

def returned(value):
    """The answer for a value the tool returned: JSON it can hold, else its repr; an error
    when it is nested deeper than DEPTH levels (the parent would refuse it)."""
    deep = {"ok": False, "error": f"ValueError: the result is nested deeper than {depth} levels"}
    try:
        json.dumps(value)
    except RecursionError:
        return deep
    except (TypeError, ValueError):
        try:
            value = repr(value)
        except BaseException as e:
            value = f"<unrepresentable {type(value).__name__}: {one_line(e)}>"
    return deep if too_deep(value, int(depth)) else {"ok": True, "value": value}

def call_tool():
    try:
        sys.path.append(os.path.dirname(os.path.abspath(target)))
        spec = importlib.util.spec_from_file_location("_logitdiff_tools", target)
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
    return returned(value)

def run_program():
    """The program's source as __main__; passes when it ends without an exception (or with
    SystemExit 0/None). The traceback goes to stderr."""
    import traceback
    sys.argv = ["<program>"]
    try:
        exec(compile(payload["source"], "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return {"ok": True, "value": None}
        return {"ok": False, "error": one_line(e)}
    except BaseException as e:
        try:  # from the program's own frames on
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
        return {"ok": False, "error": one_line(e)}
    return {"ok": True, "value": None}

def send(obj):
    view = memoryview(json.dumps(obj).encode() + b"\n")
    while view:
        view = view[_write(result_fd, view):]

try:
    CONTAINMENT = contain(SANDBOX)
except Exception as e:  # e.g. a Python built without ctypes: say so, run with the hook alone
    CONTAINMENT = not_held(f"{type(e).__name__}: {e}")
send(CONTAINMENT)  # first line, before any tool code runs: the tool cannot forge it
sys.addaudithook(guard)
answer = run_program() if mode == "program" else call_tool()
try:
    send(answer)
finally:  # no atexit handler, lingering thread or finaliser of the tool's runs after its answer
    try:
        sys.stderr.flush()
    finally:
        _exit(0)
'''


@dataclass
class ExecResult:
    """One executed call.

    ``ok``: the function returned; ``value``: its result as JSON (after a JSON round trip;
    a value that JSON cannot hold is replaced by its ``repr`` string), None unless ok;
    ``error``: one line (``"TypeError: ..."``, a sandbox ``PermissionError``, ``timed out
    after 5s``, how the process died, or what was wrong with its answer); ``timed_out``:
    killed at the timeout; ``seconds``: wall time of the subprocess; ``containment``: what
    held the process (part -> one line, see the module docstring), None when it died before
    saying.
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


@dataclass
class ProgramResult:
    """One program run by :func:`run_program`.

    ``status``: ``"pass"`` (it ran to its end, or ended with ``SystemExit`` 0/None),
    ``"fail"`` (an exception, another exit status, a signal, or a refused operation) or
    ``"timeout"``; ``error``: one line saying why it did not pass (None on pass);
    ``stderr_tail``: the last :data:`STDERR_TAIL` bytes it wrote to stdout and stderr (the
    traceback included); ``seconds``: wall time; ``containment``: as :attr:`ExecResult.containment`.
    """

    status: Literal["pass", "fail", "timeout"]
    error: str | None
    stderr_tail: str
    seconds: float
    containment: dict | None = None

    def to_json(self) -> dict:
        return {"status": self.status, "error": self.error, "stderr_tail": self.stderr_tail,
                "seconds": self.seconds, "containment": self.containment}


@dataclass
class _Exit:
    """What one sandboxed process left behind."""

    out: bytes  # its result pipe, up to RESULT_LIMIT bytes
    timed_out: bool
    flooded: bool  # killed for sending more than RESULT_LIMIT bytes
    returncode: int | None
    stderr_tail: str
    seconds: float


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
    """Send ``data`` to the process's stdin and read its result pipe until EOF, at most
    :data:`RESULT_LIMIT` bytes and ``timeout`` seconds: (bytes read, timed out, flooded).
    Reads incrementally, so a flooding process costs this one at most the cap; what was read
    before a timeout or flood is returned too (its first line says what contained it)."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None, "the process is started with stdin and stdout pipes"
    out_fd, in_fd = stdout.fileno(), stdin.fileno()
    os.set_blocking(out_fd, False)
    os.set_blocking(in_fd, False)
    sel.register(out_fd, selectors.EVENT_READ)
    sel.register(in_fd, selectors.EVENT_WRITE)
    view, n = memoryview(data), 0
    chunks: list[bytes] = []
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), True, False
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
                    return b"".join(chunks), False, True
                chunks.append(block)
    finally:
        sel.close()
    return b"".join(chunks), False, False


def _remove_tree(top: str) -> None:
    """Remove ``top`` and everything in it, whatever its depth, without recursion and without
    raising: each directory met is first moved up into one holding directory, so no path grows
    past two names (a tool that made 3,000 nested directories where no mount namespace held its
    writes must not stop the caller with RecursionError or ENAMETOOLONG)."""
    try:
        hold = tempfile.mkdtemp(prefix=".rm-", dir=top)
    except OSError:
        hold = None
    seen, todo, moved = [], [top], 0
    while todo:
        d = todo.pop()
        seen.append(d)
        try:
            os.chmod(d, 0o700)  # a directory made with mode 0 cannot be listed or emptied
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            if e.path == hold:
                continue
            try:
                if e.is_dir(follow_symlinks=False) and hold is not None:
                    moved += 1
                    dest = os.path.join(hold, str(moved))
                    os.chmod(e.path, 0o700)  # moving a directory rewrites its '..'
                    os.rename(e.path, dest)
                    todo.append(dest)
                else:
                    os.unlink(e.path)
            except OSError:
                pass
    for d in [*reversed(seen[1:]), *([hold] if hold else []), top]:
        try:
            os.rmdir(d)
        except OSError:
            pass


def _spawn(mode: str, target: str, payload: Any, timeout: float) -> _Exit:
    """Run the runner once in a fresh sandbox (removed afterwards, whatever is in it)."""
    t0 = time.monotonic()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="logitdiff-tool-"))
    try:
        sandbox = os.path.join(tmp, "work")
        os.mkdir(sandbox, 0o700)
        # stderr goes to a file beside (not inside) the sandbox: no pipe to fill up, and the
        # code cannot overwrite it through the sandbox
        with open(os.path.join(tmp, "stderr"), "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _RUNNER, mode, target, sandbox, repr(float(timeout)),
                 str(MEMORY_LIMIT), str(FILE_SIZE_LIMIT), str(TASK_LIMIT), str(DISK_LIMIT), str(INODE_LIMIT),
                 str(RESULT_DEPTH_LIMIT)],
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
            err.seek(max(0, err.seek(0, os.SEEK_END) - STDERR_TAIL))
            tail = err.read().decode("utf-8", "replace")
    finally:
        _remove_tree(tmp)
    return _Exit(out, timed_out, flooded, proc.returncode, tail, seconds)


def _one_line(text: str, limit: int = 500) -> str:
    """One printable line of at most ``limit`` characters (lone surrogates replaced)."""
    s = " ".join(text.encode("utf-8", "replace").decode("utf-8").split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _containment(out: bytes) -> dict | None:
    """The first line of the result pipe: part -> one line, written by the runner before any
    untrusted code ran. None when the process died before writing it."""
    head, sep, _ = out.partition(b"\n")
    try:
        held = json.loads(head.decode("utf-8")) if sep else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(held, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in held.items()):
        return None
    return held


def _depth_within(value: Any, limit: int) -> bool:
    """Is ``value`` (decoded JSON) nested at most ``limit`` levels deep? Iterative."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return True


def _answer(out: bytes) -> tuple[dict | None, str | None]:
    """The runner's answer (the second line of the result pipe), checked field by field, as
    (answer, None); (None, why) for an answer that cannot be taken (a tool can write to the
    pipe itself); (None, None) when there is none."""
    _, _, body = out.partition(b"\n")
    if not body.strip():
        return None, None
    try:
        res = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "its answer is not UTF-8"
    except RecursionError:
        return None, f"its answer is nested deeper than {RESULT_DEPTH_LIMIT} levels"
    except ValueError as e:  # not JSON, or an integer of more digits than Python reads
        return None, _one_line(f"its answer is not JSON ({e})", 300)
    if not isinstance(res, dict) or not isinstance(res.get("ok"), bool):
        return None, "its answer is not an object with a boolean 'ok'"
    if res["ok"]:
        if not _depth_within(res.get("value"), RESULT_DEPTH_LIMIT):
            return None, f"its answer is nested deeper than {RESULT_DEPTH_LIMIT} levels"
        return {"ok": True, "value": res.get("value")}, None
    if not isinstance(res.get("error"), str):
        return None, "its answer's 'error' is not a string"
    return {"ok": False, "error": _one_line(res["error"]) or "failed"}, None


def _death(x: _Exit) -> str:
    """How a process that left no answer ended, with the last line of its stderr."""
    rc = x.returncode if x.returncode is not None else -signal.SIGKILL
    how = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
    if rc < 0 and -rc in signal.valid_signals():
        how = f"killed by {signal.Signals(-rc).name}"
    lines = x.stderr_tail.strip().splitlines()
    last = f": {_one_line(lines[-1], 300)}" if lines else ""
    return f"ended without a result ({how}){last}"


def _run(module_path: Path, mode: str, payload: Any, timeout: float) -> ExecResult:
    """Run a tools module's import or one call in a fresh sandbox, as an ExecResult."""
    x = _spawn(mode, str(module_path), payload, timeout)
    held = _containment(x.out)
    if x.timed_out:
        return ExecResult(False, None, f"timed out after {timeout:g}s", True, x.seconds, held)
    if x.flooded:
        return ExecResult(False, None, f"tool process killed: its result exceeded {RESULT_LIMIT >> 20} MiB",
                          False, x.seconds, held)
    res, bad = _answer(x.out)
    if bad:
        return ExecResult(False, None, f"tool process sent an answer that cannot be taken: {bad}", False, x.seconds, held)
    if res is None:
        return ExecResult(False, None, f"tool process {_death(x)}", False, x.seconds, held)
    if res["ok"]:
        return ExecResult(True, res["value"], None, False, x.seconds, held)
    return ExecResult(False, None, res["error"], False, x.seconds, held)


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


def run_program(source: str, *, timeout: float = 10.0) -> ProgramResult:
    """Run a whole Python program (its source text, as ``__main__``) in a fresh sandbox with
    the containment of the module docstring and a time limit: pass, fail or timeout, with the
    tail of what it wrote. E.g. a HumanEval check: prompt + completion + test +
    ``check(entry_point)``. A program that ends without an exception (or with ``SystemExit``
    0/None) passes. The program shares its process with the runner, so hostile code could
    forge a pass (see the module docstring); containment is not forgeable."""
    if not isinstance(source, str):
        raise LogitdiffError(f"run_program: source must be a str of Python source text, not {type(source).__name__}")
    timeout = _check_timeout(timeout)
    x = _spawn("program", "-", {"source": source}, timeout)
    held = _containment(x.out)
    if x.timed_out:
        return ProgramResult("timeout", f"timed out after {timeout:g}s", x.stderr_tail, x.seconds, held)
    if x.flooded:
        return ProgramResult("fail", f"killed: it wrote more than {RESULT_LIMIT >> 20} MiB to the result pipe",
                             x.stderr_tail, x.seconds, held)
    res, bad = _answer(x.out)
    if bad or res is None:
        why = f"sent an answer that cannot be taken: {bad}" if bad else _death(x)
        return ProgramResult("fail", why, x.stderr_tail, x.seconds, held)
    if not res["ok"]:
        return ProgramResult("fail", res["error"], x.stderr_tail, x.seconds, held)
    if x.returncode != 0:
        return ProgramResult("fail", _death(x), x.stderr_tail, x.seconds, held)
    return ProgramResult("pass", None, x.stderr_tail, x.seconds, held)


def compare_results(a: list[ExecResult], b: list[ExecResult]) -> tuple[bool, list[str]]:
    """Do two executions agree?  Per call: the same ``ok``; when both ok, equal values
    (:func:`~logitdiff.flips.toolcalls.values_equal` without string normalisation: numbers within
    1e-9 relative, bool is not a number; exact equality where that comparison cannot be made,
    e.g. an integer beyond the float range).  Two failures agree whatever their error text (a
    timeout and an exception are both failures).  Returns (equal, reasons)."""
    from .toolcalls import values_equal

    reasons = []
    if len(a) != len(b):
        reasons.append(f"{len(a)} results != {len(b)}")
    for k, (x, y) in enumerate(zip(a, b)):
        if x.ok != y.ok:
            reasons.append(f"call {k}: ok {x.ok} != {y.ok} ({x.error or y.error})")
            continue
        if not x.ok:
            continue
        try:
            same = values_equal(x.value, y.value, normalize=False)
        except (OverflowError, RecursionError, ValueError):
            same = x.value == y.value
        if not same:
            reasons.append(f"call {k}: value {_short(x.value)} != {_short(y.value)}")
    return not reasons, reasons


def _short(v: Any) -> str:
    try:
        s = json.dumps(v, sort_keys=True)
    except (ValueError, RecursionError):
        s = "<value>"
    return s if len(s) <= 80 else s[:77] + "..."
