"""The package's layout by stage (README "Architecture", each stage's docstring): a module
imports only its own stage or a stage below it, the top of the package is the public face
(at most 8 modules), no private name is imported across stages, and no function in src/
is longer than a reader can follow (100 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_api import PKG, _module_graph

# Lowest first. A module may import its own stage or any stage listed before it; a lazy
# import inside a function counts (it is still a dependency).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("logitdiff.errors", "logitdiff._version", "logitdiff.defaults", "logitdiff.contracts")),
    ("numerics", ("logitdiff.numerics",)),
    ("store", ("logitdiff.store",)),
    ("workload", ("logitdiff.workload",)),
    ("sources", ("logitdiff.sources",)),
    ("builtin", ("logitdiff.builtin",)),
    ("capture", ("logitdiff.capture",)),
    ("compare", ("logitdiff.compare",)),
    ("report", ("logitdiff.report",)),
    ("flips", ("logitdiff.flips",)),
    ("speculation", ("logitdiff.speculation",)),
    ("layers", ("logitdiff.layers",)),
    ("pipeline", ("logitdiff.pipeline",)),
    ("public", ("logitdiff.api", "logitdiff.testing", "logitdiff")),
    ("cli", ("logitdiff.cli",)),
]


def stage_of(module: str) -> int:
    best, rank = -1, -1
    for k, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), k
    if rank < 0:
        raise AssertionError(f"{module} belongs to no stage: add it to STAGES (tests/test_structure.py)")
    return rank


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if stage_of(d) > stage_of(m))


def test_stage_checker_sees_an_upward_arrow():
    # the checker itself: the store importing a comparison method is refused, the reverse is not
    assert upward_arrows({"logitdiff.store.files": {"logitdiff.compare.methods.exact"}}) == [
        "logitdiff.store.files -> logitdiff.compare.methods.exact"]
    assert upward_arrows({"logitdiff.compare.methods.exact": {"logitdiff.store.files"}}) == []


def test_imports_go_down_the_stages_only():
    graph = _module_graph()
    assert "logitdiff.store.files" in graph and "logitdiff.cli" in graph
    assert upward_arrows(graph) == []


def test_top_of_the_package_is_the_public_face():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top
    # every subpackage says what it owns (its docstring's first line)
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc) > 40, f"{init.relative_to(PKG.parent)}: no docstring saying what the stage owns"


def _stage_name(module: str) -> str:
    return STAGES[stage_of(module)][0]


def private_imports_across_stages() -> list[str]:
    """``from X import _name`` where X is in another stage than the importer."""
    bad = []
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mod = ".".join(parts[:-1] if is_pkg else parts)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("logitdiff"):
                target = node.module or ""
            else:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and _stage_name(target) != _stage_name(mod):
                    bad.append(f"{mod}: from {target} import {a.name}")
    return sorted(bad)


def test_no_private_name_is_imported_across_stages():
    assert private_imports_across_stages() == []


MAX_FUNCTION_LINES = 100
# The compiled kernel's bridge is exempt by the word; nothing else is.
EXEMPT: set[str] = set()


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{f.relative_to(PKG.parent)}:{node.name}"
                if n > limit and name not in EXEMPT:
                    out.append(f"{name} ({n} lines)")
    return out


def test_no_function_is_over_100_lines():
    assert long_functions() == []
