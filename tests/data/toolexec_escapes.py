"""Tools that try to leave the sandbox (tests/test_toolexec.py): each tries to create
``marker`` (a path outside the sandbox), reach a port, or signal a process.

The audit hook alone stops the first three; the rest go around it (C calls, relative
paths under a directory descriptor, the process-creation primitive below subprocess) and
are stopped only by kernel containment where the platform has it.
"""

import ctypes
import os
import socket
import subprocess
import sys

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what):
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


# --- stopped by the audit hook -----------------------------------------------------------
def open_write(marker):
    with open(marker, "w") as f:
        f.write("escaped")
    return "written"


def os_system(marker):
    return os.system(f"echo escaped > '{marker}'")


def subprocess_run(marker):
    return subprocess.run(["/bin/sh", "-c", f"echo escaped > '{marker}'"]).returncode


# --- around the audit hook ---------------------------------------------------------------
def ctypes_open(marker):
    fd = _libc.open(os.fsencode(marker), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if fd < 0:
        _fail("open")
    _libc.write(fd, b"escaped", 7)
    _libc.close(fd)
    return "written"


def ctypes_mkdir(marker):
    if _libc.mkdir(os.fsencode(marker), 0o755) != 0:
        _fail("mkdir")
    return "made"


def ctypes_symlink(marker):
    if _libc.symlink(b"/etc/hostname", os.fsencode(marker)) != 0:
        _fail("symlink")
    return "linked"


def ctypes_system(marker):
    rc = _libc.system(f"echo escaped > '{marker}'".encode())
    if rc != 0:
        _fail(f"system returned {rc}")
    return rc


def ctypes_fork(marker):
    pid = _libc.fork()
    if pid < 0:
        _fail("fork")
    if pid == 0:  # the child writes with plain Python: the audit hook was only in the parent's view
        fd = _libc.open(os.fsencode(marker), os.O_WRONLY | os.O_CREAT, 0o644)
        os._exit(0 if fd >= 0 else 1)
    _, status = os.waitpid(pid, 0)
    return status


def dir_fd_open(marker):
    """A relative path under a descriptor of the marker's directory: the hook judges it
    against the working directory."""
    dfd = os.open(os.path.dirname(marker), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(os.path.basename(marker), os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd)
        os.write(fd, b"escaped")
        os.close(fd)
    finally:
        os.close(dfd)
    return "written"


def dir_fd_rename(marker):
    """A file made inside the sandbox, renamed into the marker's directory."""
    with open("inside.txt", "w") as f:
        f.write("escaped")
    dfd = os.open(os.path.dirname(marker), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename("inside.txt", os.path.basename(marker), dst_dir_fd=dfd)
    finally:
        os.close(dfd)
    return "renamed"


def fork_exec(marker):
    """The C primitive under subprocess.Popen, which raises no audit event itself."""
    import _posixsubprocess

    args = [b"/bin/sh", b"-c", f"echo escaped > '{marker}'".encode()]
    errpipe_read, errpipe_write = os.pipe()
    common = (args, [args[0]], True, (errpipe_write,), None, None, -1, -1, -1, -1, -1, -1,
              errpipe_read, errpipe_write, False, False)
    if sys.version_info < (3, 12):
        pid = _posixsubprocess.fork_exec(*common, -1, None, None, None, -1, None, False)
    else:
        pid = _posixsubprocess.fork_exec(*common, -1, None, None, -1, -1, None)
    os.close(errpipe_write)
    os.read(errpipe_read, 1000)
    os.close(errpipe_read)
    _, status = os.waitpid(pid, 0)
    return status


def popen_unaudited(marker):
    """subprocess.Popen with its sys.audit call replaced by a no-op."""

    class _Sys:
        def __getattr__(self, name):
            return getattr(sys, name)

        @staticmethod
        def audit(*_):
            pass

    subprocess.sys = _Sys()
    return subprocess.run(["/bin/sh", "-c", f"echo escaped > '{marker}'"]).returncode


# --- network and signals, around the audit hook ------------------------------------------
class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_uint32), ("zero", ctypes.c_char * 8)]


def _loopback(port):
    return _SockaddrIn(socket.AF_INET, socket.htons(port), int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), b"")


def ctypes_tcp_connect(port):
    fd = _libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    if fd < 0:
        _fail("socket")
    addr = _loopback(port)
    try:
        if _libc.connect(fd, ctypes.byref(addr), ctypes.sizeof(addr)) != 0:
            _fail("connect")
    finally:
        _libc.close(fd)
    return "connected"


def ctypes_udp_send(port):
    fd = _libc.socket(socket.AF_INET, socket.SOCK_DGRAM, 0)
    if fd < 0:
        _fail("socket")
    addr = _loopback(port)
    try:
        if _libc.sendto(fd, b"escaped", 7, 0, ctypes.byref(addr), ctypes.sizeof(addr)) != 7:
            _fail("sendto")
    finally:
        _libc.close(fd)
    return "sent"


def ctypes_kill(pid):
    if _libc.kill(int(pid), 9) != 0:
        _fail("kill")
    return "killed"


# --- Unix sockets, metadata, floods (round two) ------------------------------------------
class _SockaddrUn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("path", ctypes.c_char * 108)]


def unix_connect(path):
    """A pathname Unix socket is reachable from any network namespace."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"escaped")
    s.close()
    return "sent"


def ctypes_unix_connect(path):
    fd = _libc.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
    if fd < 0:
        _fail("socket")
    addr = _SockaddrUn(socket.AF_UNIX, os.fsencode(path))
    try:
        if _libc.connect(fd, ctypes.byref(addr), ctypes.sizeof(addr)) != 0:
            _fail("connect")
        _libc.write(fd, b"escaped", 7)
    finally:
        _libc.close(fd)
    return "sent"


def ctypes_socket(family, kind):
    fd = _libc.socket(int(family), int(kind), 0)
    if fd < 0:
        _fail("socket")
    _libc.close(fd)
    return "made"


def ctypes_socketpair():
    fds = (ctypes.c_int * 2)()
    if _libc.socketpair(socket.AF_UNIX, socket.SOCK_STREAM, 0, fds) != 0:
        _fail("socketpair")
    return "made"


def os_meta(target, what):
    if what == "chmod":
        os.chmod(target, 0)
    elif what == "utime":
        os.utime(target, (1, 1))
    elif what == "setxattr":
        os.setxattr(target, "user.escaped", b"1")
    elif what == "chown":
        os.chown(target, 1, 1)
    return "changed"


def fd_meta(target, what):
    """The same changes through a read-only descriptor: no path for the audit hook to judge."""
    fd = os.open(target, os.O_RDONLY)
    try:
        if what == "chmod":
            os.fchmod(fd, 0)
        elif what == "utime":
            os.utime(fd, (1, 1))
        elif what == "setxattr":
            os.setxattr(fd, "user.escaped", b"1")
        elif what == "chown":
            os.fchown(fd, 1, 1)
    finally:
        os.close(fd)
    return "changed"


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def ctypes_meta(target, what):
    t = os.fsencode(target)
    if what == "chmod":
        rc = _libc.chmod(t, 0)
    elif what == "utime":
        ts = (_Timespec * 2)((1, 0), (1, 0))
        rc = _libc.utimensat(-100, t, ts, 0)
    elif what == "setxattr":
        rc = _libc.setxattr(t, b"user.escaped", b"1", 1, 0)
    elif what == "chown":
        rc = _libc.chown(t, 1, 1)
    if rc != 0:
        _fail(what)
    return "changed"


def flood(mib):
    """Write ``mib`` MiB of junk straight into the result descriptor (fd 3 or above)."""
    block = b"x" * (1 << 20)
    for fd in range(3, 16):
        try:
            os.fstat(fd)
        except OSError:
            continue
        try:
            for _ in range(int(mib)):
                os.write(fd, block)
        except OSError:
            continue
        return "flooded"
    return "no descriptor"
