"""The static checks of CI: mypy (configuration: pyproject.toml [tool.mypy]) and ruff
([tool.ruff]) over src/, plus the public API as a user's code sees it
(tests/typing_api_usage.py). Each fails with the tool's own output."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "tests" / "typing_api_usage.py"


def _tool(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` at the repository root (where pyproject.toml configures it)."""
    try:
        __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed in {sys.executable}: run scripts/setup.sh (it installs the dev tools)")
    # PYTHONPATH (a worktree run: PYTHONPATH=src) would make mypy take src/ for an installed
    # package and stay silent about its errors
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _output(p: subprocess.CompletedProcess) -> str:
    return (p.stdout + p.stderr).strip()


def test_mypy_passes_on_src_and_the_api_as_users_see_it():
    p = _tool("mypy", "src/logitdiff", str(USAGE))
    assert p.returncode == 0, "mypy found type errors:\n" + _output(p)


def test_mypy_sees_a_misspelled_report_field(tmp_path):
    """The check above can fail: a report field that does not exist is an error to mypy, so
    the report really is typed (not ``dict``/``Any``) where a user reads it."""
    user = tmp_path / "user_code.py"
    user.write_text("import logitdiff\n\n\ndef f() -> None:\n    logitdiff.diff_runs('r', 'c')['summary']['kl_nats_meen']\n")
    p = _tool("mypy", "src/logitdiff", str(user))
    out = _output(p)
    assert p.returncode == 1 and "user_code.py:5:" in out and '"kl_nats_meen"' in out, out


def test_ruff_passes_on_src():
    p = _tool("ruff", "check", "--no-cache", "src")
    assert p.returncode == 0, "ruff found problems:\n" + _output(p)


def test_type_checking_imports_match_the_lazy_exports():
    """``logitdiff/__init__.py`` imports its public names lazily (``_EXPORTS``) and again under
    ``TYPE_CHECKING`` for type checkers; the two lists must name the same things."""
    tree = ast.parse((ROOT / "src" / "logitdiff" / "__init__.py").read_text())
    exports = submodules = None
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                exports = ast.literal_eval(node.value)
            elif node.targets[0].id == "_SUBMODULES":
                submodules = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.dump(imp)
                for alias in imp.names:
                    typed[alias.asname or alias.name] = imp.module or alias.name
    assert exports and submodules is not None
    assert typed == {**exports, **{m: m for m in submodules}}
