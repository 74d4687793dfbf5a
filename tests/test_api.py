"""The public Python API: ``logitdiff.__all__``, the README example, ``assert_drift_within``,
and the package's structure (no import cycle, no process-wide state changed on import)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import logitdiff
from logitdiff.errors import LogitdiffError
from logitdiff.testing import DriftCheckFailed, assert_drift_within, drift_failures

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "logitdiff"


# ----------------------------------------------------------------------------- structure
def _module_graph() -> dict[str, set[str]]:
    """Edges module -> package module for every import statement, at module level or in a
    function (a lazy import is still a dependency)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)

    def targets(mod: str, is_pkg: bool, node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name.split(".")[0] == "logitdiff"]
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        elif (node.module or "").split(".")[0] == "logitdiff":
            target = node.module
        else:
            return []
        # `from . import x` imports the submodule x when there is one
        return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]

    graph: dict[str, set[str]] = {}
    for mod, (f, is_pkg) in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in targets(mod, is_pkg, node):
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != mod:
                        deps.add(t)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    # the checker itself: a cycle of three, a self-contained tail, an isolated module
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph = _module_graph()
    assert "logitdiff.cli" in graph and "logitdiff.sources" in graph  # the walk saw the package
    assert _cycles(graph) == []


def test_library_does_not_import_the_cli():
    graph = _module_graph()
    offenders = {m: sorted(d for d in deps if d.startswith("logitdiff.cli")) for m, deps in graph.items()
                 if not m.startswith("logitdiff.cli")}
    assert {m: d for m, d in offenders.items() if d} == {}


_STATE_PROBE = r"""
import importlib, json, logging, os, pkgutil, signal, sys, threading
import torch
import logitdiff

def state():
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop": torch.get_num_interop_threads(),
        "environ": dict(os.environ),
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)},
        "root_handlers": [repr(h) for h in logging.getLogger().handlers],
        "root_level": logging.getLogger().level,
        "excepthook": repr(sys.excepthook),
        "threads": threading.active_count(),
        "cwd": os.getcwd(),
    }

before = state()
names = [m.name for m in pkgutil.walk_packages(logitdiff.__path__, "logitdiff.")
         if not m.name.endswith("__main__") and ".builtin.tiny" not in m.name]
for name in names:
    importlib.import_module(name)
after = state()
print(json.dumps({"modules": len(names), "before": before, "after": after}))
"""


def test_importing_every_module_changes_no_process_state():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _STATE_PROBE], capture_output=True, text=True, env=env, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["modules"] >= 30
    assert res["after"] == res["before"]


# ----------------------------------------------------------------------------- public names
def test_public_names_resolve_and_import_is_light():
    code = ("import sys, logitdiff; heavy = [m for m in ('torch', 'llama_cpp', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; [getattr(logitdiff, n) for n in logitdiff.__all__]; print(len(logitdiff.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(logitdiff.__all__) >= 10
    assert callable(logitdiff.capture_run) and callable(logitdiff.diff_runs) and callable(logitdiff.assert_drift_within)
    with pytest.raises(AttributeError):
        logitdiff.no_such_name  # noqa: B018


def _readme_python_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S).group(1))


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path, monkeypatch):
    code = _readme_python_example()
    assert "logitdiff.capture_run" in code and "assert_drift_within" in code
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md (Python API)", "exec"), namespace)
    report = json.loads((tmp_path / "reports" / "q4" / "report.json").read_text())
    assert report["candidate"]["spec"] == "builtin:tiny-Q4_K_M"
    assert report["summary"]["kl_nats_mean"] > 0


# ----------------------------------------------------------------------------- assert_drift_within
@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    """A real comparison: the bundled model in BF16 (reference) against float32 (candidate)
    through transformers, on three items of the bundled workload."""
    from logitdiff.builtin import WORKLOAD

    tmp = tmp_path_factory.mktemp("api")
    lines = WORKLOAD.read_text(encoding="utf-8").splitlines()[:3]
    wl = tmp / "w.jsonl"
    wl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    logitdiff.capture_run("builtin:tiny", tmp / "ref", workload=wl, max_tokens=12)
    logitdiff.capture_run("builtin:tiny,dtype=float32", tmp / "cand", reference=tmp / "ref")
    report = logitdiff.diff_runs(tmp / "ref", tmp / "cand", out=tmp / "rep", bootstrap=0)
    return tmp / "rep", report


def test_drift_within_passes_when_every_clause_holds(real_report):
    rep_dir, report = real_report
    kl = report["summary"]["kl_nats_mean"]
    assert kl > 0
    assert_drift_within(rep_dir, require=f"kl_mean<{kl * 1.01}, kl_max<=10, top1_disagreement<=1")
    assert_drift_within(rep_dir / "report.json", require=f"kl_mean<{kl * 1.01}")
    assert_drift_within(report, require=f"kl_mean>={kl}")
    assert_drift_within(report, fail_on=f"kl_mean<{kl}")  # the same check as a failure condition
    assert drift_failures(rep_dir, require=f"kl_mean<{kl * 1.01}") == []


def test_drift_within_fails_with_metric_value_and_worst_items(real_report):
    rep_dir, report = real_report
    kl = report["summary"]["kl_nats_mean"]
    worst = max(report["items"], key=lambda it: it["kl_nats"]["mean"])
    with pytest.raises(DriftCheckFailed) as e:
        assert_drift_within(rep_dir, require=f"kl_mean<{kl / 2}, top1_disagreement<=1")
    msg = str(e.value)
    assert f"kl_mean<{kl / 2}" in msg and "top1_disagreement" not in msg.split("\n", 1)[1]
    assert f"kl_mean = {kl:.6g}" in msg
    assert f"worst items: {worst['id']} ({worst['kl_nats']['mean']:.4g})" in msg
    [f] = e.value.failures
    assert f["metric"] == "kl_mean" and f["value"] == pytest.approx(kl, rel=0, abs=0)
    assert isinstance(e.value, AssertionError)


def test_drift_within_fails_closed_on_a_missing_metric(real_report):
    rep_dir, _ = real_report
    # no `logitdiff flips` ran on this report: a flips clause cannot be shown to hold
    with pytest.raises(DriftCheckFailed, match="meaning_changed<=0: not evaluated, meaning_changed is missing from the report: "
                       "the report has no flips section"):
        assert_drift_within(rep_dir, require="meaning_changed<=0")
    with pytest.raises(DriftCheckFailed, match="not evaluated"):
        assert_drift_within(rep_dir, fail_on="meaning_changed>0")


def test_drift_within_rejects_bad_clauses(real_report):
    rep_dir, _ = real_report
    with pytest.raises(LogitdiffError, match="unknown metric 'kl_avg'"):
        assert_drift_within(rep_dir, require="kl_avg<0.1")
    with pytest.raises(LogitdiffError, match="not found"):
        assert_drift_within(rep_dir.parent / "nowhere", require="kl_mean<0.1")


@pytest.mark.parametrize("bad, match", [
    ({"bootstrap": 10**9}, "--bootstrap 1000000000: must be between 0"),
    ({"threads": 0}, "--threads 0: must be at least 1"),
    ({"top_logprobs": 0}, "--top-k 0: must be at least 1"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"gates": "kl_avg<1"}, "unknown metric 'kl_avg'"),
])
def test_diff_runs_checks_arguments_before_writing(real_report, bad, match):
    tmp = real_report[0].parent
    out = tmp / "never"
    with pytest.raises(LogitdiffError, match=re.escape(match)):
        logitdiff.diff_runs(tmp / "ref", tmp / "cand", out=out, **bad)
    assert not out.exists()


def test_run_is_the_run_command(real_report, tmp_path):
    tmp = real_report[0].parent
    summary = logitdiff.run(reference="builtin:tiny", candidates=["builtin:tiny,dtype=float32"], workload=str(tmp / "w.jsonl"),
                            out=str(tmp_path / "out"), max_tokens=12, noise_floor=False, flips=False, correctness=False,
                            bootstrap=0, floor="none")
    [row] = summary["candidates"]
    # the same reference output and the same candidate as the fixture's capture + compare
    assert row["kl_mean"] == real_report[1]["summary"]["kl_nats_mean"]
    assert logitdiff.load_summary(tmp_path / "out")["candidates"][0]["kl_mean"] == row["kl_mean"]
    with pytest.raises(LogitdiffError, match="--bootstrap -1"):
        logitdiff.run(out=str(tmp_path / "never"), bootstrap=-1)
    assert not (tmp_path / "never").exists()


# ----------------------------------------------------------------------------- one name for the reference RUN
def _renamed_callables():
    """Every callable of the API, capture and layers that once took the reference RUN as
    ``teacher=`` (docs/migration.md), with its new name."""
    import logitdiff.api as api
    from logitdiff import capture, layers

    return [(api.capture_run, "reference"), (api.layers, "reference_run"), (capture.capture_candidate, "reference"),
            (capture.verified_prompts, "reference"), (capture.LiveRun, "reference"), (layers.layer_attribution, "reference_run")]


def test_no_parameter_names_the_reference_run_teacher():
    """No function of the public API, capture or layers has a parameter named ``teacher``
    (the deprecated name lives in errors.renamed_parameters only)."""
    import inspect

    import logitdiff.api as api
    from logitdiff import capture, layers

    found = []
    for mod in (api, capture, layers):
        for name, obj in vars(mod).items():
            fns = [obj] if inspect.isfunction(obj) else [getattr(obj, "__init__", None)] if inspect.isclass(obj) else []
            for fn in fns:
                if fn is not None and getattr(fn, "__module__", "").startswith("logitdiff") and \
                        "teacher" in inspect.signature(fn).parameters:
                    found.append(f"{mod.__name__}.{name}")
    assert found == []
    for fn, new in _renamed_callables():
        assert new in inspect.signature(fn).parameters, fn
    assert logitdiff.api.__all__ == ["capture_run", "diff_runs", "layers", "load_report", "noise_floor_of", "run", "speculate"]


@pytest.mark.parametrize("fn, new", _renamed_callables(), ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_old_and_new_name_together_is_an_error_before_anything_runs(fn, new, tmp_path):
    """By keyword or by position (the first positional arguments stand for the new name's
    place), giving the deprecated teacher= as well is one line, raised before the function
    starts (the arguments here would fail it otherwise)."""
    import inspect
    import warnings

    sig = inspect.signature(fn).parameters
    params = [p for p in sig if p != "self"]
    before = [p for p in params[: params.index(new)] if sig[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    calls = [([object()] * len(before), {new: tmp_path / "a"})]
    if sig[new].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        calls.append(([object()] * (len(before) + 1), {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args, kwargs in calls:
            with pytest.raises(LogitdiffError) as e:
                fn(*args, teacher=tmp_path / "b", **kwargs)
            name = fn.__qualname__.removesuffix(".__init__") if inspect.isfunction(fn) else fn.__name__
            assert str(e.value) == (f"{name}: both teacher= and {new}= given; teacher= is the deprecated name of {new}= "
                                    f"(accepted until 0.3): give {new}= only")
    assert not caught and not (tmp_path / "a").exists()


def test_capture_run_takes_the_old_keyword_with_one_warning(real_report, tmp_path):
    """teacher= still captures the same candidate RUN, with exactly one DeprecationWarning,
    pointing at the caller's line."""
    import warnings

    import numpy as np

    from logitdiff.store import RunReader

    tmp = real_report[0].parent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = logitdiff.capture_run("builtin:tiny,dtype=float32", tmp_path / "old", teacher=tmp / "ref")
    mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and "teacher" in str(w.message)]
    assert [str(w.message) for w in mine] == ["capture_run: teacher= is deprecated, use reference= (accepted until 0.3)"]
    assert mine[0].filename == __file__
    old, new = RunReader(out), RunReader(tmp / "cand")  # the fixture's capture with reference=
    assert [(it.id, it.teacher_ids, it.positions) for it in old.items()] == [(it.id, it.teacher_ids, it.positions) for it in new.items()]
    for a, b in zip(old.items(), new.items()):
        np.testing.assert_array_equal(old.logits(a), new.logits(b))
    assert logitdiff.diff_runs(tmp / "ref", out, bootstrap=0)["summary"]["kl_nats_mean"] == real_report[1]["summary"]["kl_nats_mean"]
