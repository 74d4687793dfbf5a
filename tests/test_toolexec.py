"""Executable tool checks in a sandboxed subprocess (logitdiff.toolexec), on real modules."""

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from logitdiff.errors import LogitdiffError
from logitdiff.toolcalls import ToolCall
from logitdiff.toolexec import ExecResult, compare_results, execute_calls, load_check

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
