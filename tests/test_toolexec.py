"""Executable tool checks in a sandboxed subprocess (logitdiff.flips.sandbox), on real modules."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from logitdiff.errors import LogitdiffError
from logitdiff.flips.toolcalls import ToolCall
from logitdiff.flips.sandbox import ExecResult, compare_results, execute_calls, load_check

DATA = Path(__file__).parent / "data"
TOOLS = DATA / "tools_impl.py"


def run1(name, timeout=5.0, **arguments) -> ExecResult:
    (r,) = execute_calls(TOOLS, [ToolCall(name, arguments)], timeout=timeout)
    return r


def test_calls_return_json_values_in_order():
    rs = execute_calls(TOOLS, [ToolCall("get_weather", {"city": "Paris", "unit": "fahrenheit"}),
                               ToolCall("add", {"a": 2, "b": 3.5}), ToolCall("noisy", {})])
    assert [r.ok for r in rs] == [True, True, True] and not any(r.timed_out for r in rs)
    t = sum(map(ord, "Paris")) % 35 * 9 / 5 + 32
    assert rs[0].value == {"city": "Paris", "unit": "fahrenheit", "temperature": t}
    assert rs[1].value == 5.5
    assert rs[2].value == 7  # the tool's print went to stderr, not into the result
    assert all(r.error is None and r.seconds > 0 for r in rs)


def test_exceptions_unknown_names_and_odd_values():
    r = run1("fail", n=3)
    assert (r.ok, r.value, r.timed_out) == (False, None, False)
    assert r.error == "TypeError: bad n: 3 second line"
    assert run1("add", a=1).error.startswith("TypeError: ")  # missing argument
    for name in ("no_such_tool", "_private", "system"):  # system is imported from os, not defined
        assert run1(name).error == f"NameError: the tools module has no function {name!r}"
    r = run1("odd_value")
    assert r.ok and r.value == "{1, 2, 3}"  # not JSON: repr


def test_process_that_dies_without_a_result():
    assert run1("exit_early").error == "tool process ended without a result (exit status 3)"
    r = run1("abort")
    assert not r.ok and not r.timed_out and r.error.startswith("tool process ended without a result (killed by SIGABRT)")


def test_all_lists_the_callable_names():
    path = DATA / "toolexec_all.py"
    rs = execute_calls(path, [ToolCall("dumps", {"obj": [1, 2]}), ToolCall("double", {"x": 2}),
                              ToolCall("hidden", {"x": 1})])
    assert [r.value for r in rs] == ["[1, 2]", 4, None]
    assert "no function 'hidden'" in rs[2].error


def test_timeout_kills_within_bound():
    t0 = time.monotonic()
    r = run1("sleep_long", timeout=1.5)
    wall = time.monotonic() - t0
    assert r.timed_out and not r.ok and r.error == "timed out after 1.5s"
    assert wall < 1.5 + 2.0, wall
    assert 1.5 <= r.seconds < 3.5


@pytest.mark.parametrize("name", ["connect", "connect_raw"])
def test_network_is_refused_and_nothing_connects(name):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        r = run1(name, port=server.getsockname()[1])
        assert not r.ok and r.error.startswith("PermissionError: sandbox: socket."), r.error
        # a completed TCP handshake would sit in the backlog even without accept()
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_server_reachable_without_sandbox_so_the_network_test_can_fail():
    # the same kind of connection from this process is accepted: the test above is meaningful
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=2):
            conn, _ = server.accept()
            conn.close()
    finally:
        server.close()


def test_processes_are_refused():
    assert run1("spawn").error == "PermissionError: sandbox: subprocess.Popen is not allowed"
    assert run1("shell").error == "PermissionError: sandbox: os.system is not allowed"


def test_writes_inside_the_sandbox_are_allowed():
    r = run1("write_file", path="out.txt", text="hello")
    assert r.ok and r.value == {"path": "out.txt", "cwd_is_home": True, "read": "hello"}, r.error
    assert run1("low_level_write", path="inside.bin").ok


def test_writes_and_removals_outside_are_refused(tmp_path):
    outside = Path("/tmp") / f"logitdiff-test-{uuid.uuid4().hex}" / "outside.txt"
    outside.parent.mkdir()
    try:
        for name in ("write_file", "low_level_write"):
            r = run1(name, path=str(outside))
            assert not r.ok and r.error.startswith("PermissionError: sandbox: writing"), r.error
            assert not outside.exists()
        # escaping through a relative path or a symlink is judged on the resolved path
        r = run1("write_file", path="../" * 20 + str(outside).lstrip("/"))
        assert r.error.startswith("PermissionError: sandbox: writing"), r.error
        r = run1("symlink_write", target=str(outside))
        assert r.error.startswith("PermissionError: sandbox: writing 'link'"), r.error
        assert not outside.exists()
        keep = tmp_path / "keep.txt"
        keep.write_text("keep")
        r = run1("remove", path=str(keep))
        assert r.error.startswith("PermissionError: sandbox: os.remove"), r.error
        assert keep.read_text() == "keep"
    finally:
        outside.unlink(missing_ok=True)
        outside.parent.rmdir()


def test_limits_and_reduced_environment(monkeypatch):
    r = run1("hog_memory")
    assert not r.ok and r.error.startswith("MemoryError")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    r = run1("env_view")
    assert r.ok and r.value == {"HTTP_PROXY": None, "http_proxy": None, "HTTPS_PROXY": None, "PYTHONPATH": None}


def test_sandbox_directory_is_removed():
    tmp = tempfile.gettempdir()
    before = {p for p in os.listdir(tmp) if p.startswith("logitdiff-tool-")}
    r = run1("where")
    assert r.ok and os.path.basename(os.path.dirname(r.value)).startswith("logitdiff-tool-")
    assert not os.path.exists(r.value)
    after = {p for p in os.listdir(tmp) if p.startswith("logitdiff-tool-")}
    assert after <= before


def test_load_check():
    load_check(TOOLS)
    with pytest.raises(LogitdiffError, match=r"toolexec_broken.py: tools module failed to import: "
                                             r"ModuleNotFoundError: No module named 'logitdiff_no_such"):
        load_check(DATA / "toolexec_broken.py")
    with pytest.raises(LogitdiffError, match=r"toolexec_net_on_import.py: tools module failed to import: "
                                             r"PermissionError: sandbox: socket"):
        load_check(DATA / "toolexec_net_on_import.py")
    with pytest.raises(LogitdiffError, match="tools module not found"):
        load_check(DATA / "no_such_tools.py")
    with pytest.raises(LogitdiffError, match="tools module not found"):
        execute_calls(DATA / "no_such_tools.py", [])


def test_load_check_hanging_import_times_out():
    t0 = time.monotonic()
    with pytest.raises(LogitdiffError, match=r"toolexec_hang.py: tools module did not import within 1.5s"):
        load_check(DATA / "toolexec_hang.py", timeout=1.5)
    assert time.monotonic() - t0 < 1.5 + 2.0


def test_failed_import_fails_each_call():
    (r,) = execute_calls(DATA / "toolexec_broken.py", [ToolCall("f", {})])
    assert not r.ok and r.error.startswith("tools module failed to import: ModuleNotFoundError")


def _r(ok, value=None, error=None, timed_out=False):
    return ExecResult(ok, value, error, timed_out, 0.1)


def test_compare_results():
    assert compare_results([_r(True, {"t": 1.0, "xs": [1, "a"]})], [_r(True, {"t": 1.0 + 1e-12, "xs": [1.0, "a"]})]) == (True, [])
    assert compare_results([_r(False, error="TypeError: x")], [_r(False, error="timed out", timed_out=True)]) == (True, [])
    eq, why = compare_results([_r(True, 3)], [_r(True, 4)])
    assert not eq and why == ["call 0: value 3 != 4"]
    eq, why = compare_results([_r(True, "Paris")], [_r(True, "paris")])  # results are not normalised
    assert not eq
    eq, why = compare_results([_r(True, True)], [_r(True, 1)])
    assert not eq
    eq, why = compare_results([_r(True, 1)], [_r(False, error="TypeError: bad")])
    assert why == ["call 0: ok True != False (TypeError: bad)"]
    eq, why = compare_results([_r(True, 1)], [_r(True, 1), _r(True, 2)])
    assert not eq and why == ["1 results != 2"]


def test_compare_results_on_real_executions():
    a = execute_calls(TOOLS, [ToolCall("get_weather", {"city": "Oslo"}), ToolCall("add", {"a": 1, "b": 2})])
    b = execute_calls(TOOLS, [ToolCall("get_weather", {"city": "Oslo", "unit": "celsius"}), ToolCall("add", {"a": 2, "b": 2})])
    eq, why = compare_results(a, b)
    assert not eq and why == ["call 1: value 3 != 4"]


# ------------------------------------------------------------------------------------------
# Escapes, tried for real against a marker path outside the sandbox.

ESCAPES = DATA / "toolexec_escapes.py"
HOOKED = ("open_write", "os_system", "subprocess_run")  # the audit hook alone stops these
# escape -> the containment part that must stop it when the hook cannot
AROUND_HOOK = {
    "ctypes_open": "filesystem", "ctypes_mkdir": "filesystem", "ctypes_symlink": "filesystem",
    "dir_fd_open": "filesystem", "dir_fd_rename": "filesystem",
    "ctypes_system": "processes", "ctypes_fork": "processes", "fork_exec": "processes", "popen_unaudited": "processes",
}
# part -> how its line starts when the kernel holds it
KERNEL = {"filesystem": ("Landlock",), "processes": ("seccomp",), "network": ("seccomp",),
          "signals": ("Landlock", "seccomp"), "metadata": ("seccomp",), "other_processes": ("seccomp",),
          "ipc": ("IPC namespace", "seccomp"), "terminal": ("no terminal",), "tasks": ("RLIMIT_NPROC",),
          "disk": ("tmpfs",), "privileges": ("no capabilities",)}
HOOK_PARTS = ("filesystem", "network", "processes", "signals", "metadata")  # the audit hook has a say


def _held(r: ExecResult, part: str) -> bool:
    """Does the result say the kernel contained this part?  Anything else must say 'audit hook
    only' (where the hook has a say) or 'not contained'."""
    line = r.containment[part]
    fallback = "audit hook only (" if part in HOOK_PARTS else "not contained ("
    assert line.startswith(KERNEL[part]) or line.startswith(fallback), line
    return line.startswith(KERNEL[part])


@pytest.fixture()
def outside():
    d = Path("/tmp") / f"logitdiff-test-{uuid.uuid4().hex}"  # outside the sandbox's temporary directory
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
    d.rmdir()


def _escape(name, **arguments) -> ExecResult:
    (r,) = execute_calls(ESCAPES, [ToolCall(name, arguments)])
    return r


@pytest.mark.parametrize("name", HOOKED + tuple(AROUND_HOOK))
def test_escape_leaves_no_file_outside_or_says_it_was_not_contained(name, outside):
    marker = outside / name
    r = _escape(name, marker=str(marker))
    assert not r.ok, f"{name} returned {r.value!r}"
    assert set(r.containment) == set(KERNEL)
    if name in HOOKED or _held(r, AROUND_HOOK[name]):
        assert not os.path.lexists(marker), f"{name} wrote {marker} ({r.containment})"
        if name in HOOKED:
            assert r.error.startswith("PermissionError: sandbox: "), r.error
        else:  # the kernel said no: EACCES from Landlock, EPERM from seccomp, EXDEV (a rename
            # out of the sandbox's own tmpfs) before Landlock is asked
            assert r.error.startswith(("PermissionError: [Errno ", "OSError: [Errno 18] Invalid cross-device")), r.error
    # else: the result says 'audit hook only' for that part; test_degraded_... shows such an
    # escape then succeeds, so the line is the truth


def test_network_around_the_hook_reaches_nothing():
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        tcp.setblocking(False)
        udp.bind(("127.0.0.1", 0))
        udp.setblocking(False)
        r = _escape("ctypes_tcp_connect", port=tcp.getsockname()[1])
        held = _held(r, "network") or r.containment["network"].startswith("Landlock")  # Landlock: TCP only
        if held:
            assert not r.ok and r.error.startswith(("OSError: [Errno", "PermissionError: [Errno")), r.error
            with pytest.raises(BlockingIOError):
                tcp.accept()
        r = _escape("ctypes_udp_send", port=udp.getsockname()[1])
        if _held(r, "network"):
            assert not r.ok, r.value
            with pytest.raises(BlockingIOError):
                udp.recv(100)
    finally:
        tcp.close()
        udp.close()


def test_signals_around_the_hook_reach_no_outside_process():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        r = _escape("ctypes_kill", pid=victim.pid)
        if _held(r, "signals"):
            assert not r.ok and "Operation not permitted" in r.error, r.error
            assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


def test_containment_is_reported_by_load_check_and_every_result():
    c = load_check(ESCAPES)
    assert set(c) == set(KERNEL)
    r = run1("add", a=1, b=2)
    assert r.ok and r.containment == c and r.to_json()["containment"] == c


# A platform without the kernel parts (an old kernel, a container profile that refuses the
# syscalls): a real seccomp filter installed in a parent process, inherited by the tool's
# process, makes Landlock, unshare and further seccomp filters fail the way such a platform does.
_DEGRADE = r'''
import ctypes, json, os, struct, sys
from logitdiff.flips.toolcalls import ToolCall
from logitdiff.flips.sandbox import execute_calls
L = ctypes.c_long
libc = ctypes.CDLL(None, use_errno=True)
ld, jeq, ret, allow = 0x20, 0x15, 0x06, 0x7FFF0000
nosys, perm, inval = 0x50000 | 38, 0x50000 | 1, 0x50000 | 22
prog = [(ld, 0, 0, 0)]
for nr, answer in ((444, nosys), (445, nosys), (446, nosys), (272, perm), (317, nosys)):  # landlock, unshare, seccomp
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, answer)]
prog += [(jeq, 0, 3, 157), (ld, 0, 0, 16), (jeq, 0, 1, 22), (ret, 0, 0, inval), (ret, 0, 0, allow)]  # prctl(PR_SET_SECCOMP)
filt = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in prog))
assert libc.prctl(L(38), L(1), L(0), L(0), L(0)) == 0
assert libc.prctl(L(22), L(2), ctypes.c_char_p(struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt))), L(0), L(0)) == 0
calls = json.loads(sys.argv[1])
out = [r.to_json() for r in execute_calls(sys.argv[2], [ToolCall(n, a) for n, a in calls])]
print(json.dumps(out))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="the degrading seccomp filter uses x86_64 syscall numbers")
def test_degraded_platform_says_audit_hook_only_and_then_escapes_do_escape(outside):
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    try:
        names = HOOKED + tuple(AROUND_HOOK)
        calls = [[n, {"marker": str(outside / n)}] for n in names] + [["ctypes_tcp_connect", {"port": tcp.getsockname()[1]}]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        p = subprocess.run([sys.executable, "-c", _DEGRADE, json.dumps(calls), str(ESCAPES)], capture_output=True,
                           text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        results = json.loads(p.stdout)
        for (name, _), r in zip(calls, results):
            held = r["containment"]
            assert held is not None and set(held) == set(KERNEL), (name, r["error"])
            for part, line in held.items():
                if part == "privileges":  # dropping capabilities needs neither namespaces nor seccomp
                    assert line.startswith("no capabilities; not refused: set*id"), line
                else:
                    assert line.startswith("audit hook only (" if part in HOOK_PARTS else "not contained ("), (part, line)
        got = {name: r for (name, _), r in zip(calls, results)}
        for name in HOOKED:  # the hook still stops these
            assert not os.path.lexists(outside / name) and got[name]["error"].startswith("PermissionError: sandbox: ")
        for name in AROUND_HOOK:  # ... and not these: exactly what 'audit hook only' warns of
            assert os.path.lexists(outside / name), (name, got[name]["error"])
        assert got["ctypes_tcp_connect"]["ok"], got["ctypes_tcp_connect"]["error"]
    finally:
        tcp.close()


# --- round two: Unix sockets, metadata changes, result floods -------------------------------
def _unix_listener(outside):
    path = str(outside / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    srv.setblocking(False)
    return srv, path


def test_unix_listener_reachable_without_sandbox_so_the_socket_test_can_fail(outside):
    import importlib.util
    spec = importlib.util.spec_from_file_location("esc", ESCAPES)
    esc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(esc)
    srv, path = _unix_listener(outside)
    try:
        assert esc.ctypes_unix_connect(path) == "sent"
        conn, _ = srv.accept()
        conn.settimeout(5)
        assert conn.recv(100) == b"escaped"
        conn.close()
    finally:
        srv.close()


@pytest.mark.parametrize("name", ["unix_connect", "ctypes_unix_connect"])
def test_pathname_unix_socket_outside_receives_nothing(name, outside):
    srv, path = _unix_listener(outside)
    try:
        r = _escape(name, path=path)
        assert _held(r, "network"), r.containment
        assert not r.ok and r.error.startswith("PermissionError: "), r.error
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


@pytest.mark.parametrize("family", [socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, 16, 17])  # NETLINK, PACKET
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW])
def test_no_socket_of_any_family_or_kind(family, kind):
    r = _escape("ctypes_socket", family=int(family), kind=int(kind))
    assert _held(r, "network"), r.containment
    assert not r.ok and "Operation not permitted" in r.error, (family, kind, r.value)


def test_no_socketpair():
    r = _escape("ctypes_socketpair")
    assert not r.ok and "Operation not permitted" in r.error, r.value


def _meta(path):
    st = os.lstat(path)
    try:
        xattrs = sorted(os.listxattr(path))
    except OSError:
        xattrs = None
    return (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_atime_ns, xattrs)


METADATA = ("chmod", "utime", "setxattr", "chown")


def test_metadata_changes_work_without_sandbox_so_the_test_can_fail(outside):
    import importlib.util
    spec = importlib.util.spec_from_file_location("esc", ESCAPES)
    esc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(esc)
    changed = set()
    for what in METADATA:
        target = outside / f"control-{what}"
        target.write_text("x")
        before = _meta(target)
        try:
            esc.ctypes_meta(str(target), what)
        except OSError:  # setxattr on a file system without user xattrs; chown when not root
            continue
        if _meta(target) != before:
            changed.add(what)
    assert {"chmod", "utime"} <= changed, changed


@pytest.mark.parametrize("route", ["os_meta", "fd_meta", "ctypes_meta"])
@pytest.mark.parametrize("what", METADATA)
def test_metadata_of_a_file_outside_stays_unchanged(route, what, outside):
    target = outside / "victim"
    target.write_text("keep me")
    os.chmod(target, 0o644)
    before = _meta(target)
    r = _escape(route, target=str(target), what=what)
    assert _held(r, "metadata"), r.containment
    assert not r.ok, (route, what, r.value)
    assert _meta(target) == before, (route, what, r.error)
    assert target.read_text() == "keep me"


def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak memory")
def test_a_flooded_result_pipe_kills_the_tool_and_bounds_memory():
    rss = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    t0 = time.monotonic()
    r = _escape("flood", mib=200)
    growth = _vm("VmHWM") - rss
    assert not r.ok and not r.timed_out
    assert r.error == "tool process killed: its result exceeded 16 MiB", r.error
    assert growth < 64 << 20, growth >> 20
    assert time.monotonic() - t0 < 5
