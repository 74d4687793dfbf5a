"""The metric registry (logitdiff.report.metric_registry) is the one description of every metric:
its declarations are complete and point at real functions, and every surface that describes
a metric (gates, page tooltips, report.md, assert_drift_within, the docs' tables) is generated from it.
(That every metric in a real report.json is registered and vice versa: tests/test_builtin_run.py.)"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from logitdiff.report import gates
from logitdiff import testing
from logitdiff.report.metric_registry import GATE_METRICS, METRICS, SERIES, Direction
from logitdiff.report import html

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("m", [*METRICS.values(), *SERIES.values()], ids=lambda m: m.name)
def test_declaration_is_complete_and_names_real_functions(m):
    assert m.meaning and m.unit and m.computed_by
    if hasattr(m, "direction"):
        assert m.direction in Direction.ALL and m.aggregate and m.paths and m.header
    for dotted in m.computed_by:
        module, _, name = dotted.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), dotted


def test_gates_tooltips_and_messages_come_from_the_registry():
    assert set(gates.METRICS) == set(GATE_METRICS)
    for name, m in GATE_METRICS.items():
        assert gates.METRICS[name].startswith(m.describe()) and gates._SOURCES[name][1] == m.paths
        if m.item:
            assert testing._ITEM_FIELD[name] == m.item
    columns = [*html.MATRIX[1:], *html.FLIP_COLUMNS, *html.OPTIONAL_COLUMNS]
    by_key = {m.key: m for m in METRICS.values()}
    for key, header, tip, paths, fmt in columns:
        m = by_key[key]
        assert (header, tip, fmt) == (m.header, m.describe(), m.fmt) and paths in (m.paths, m.paths[0])
    for key, header, tip, fmt in html.CORRECTNESS:
        assert (header, tip, fmt) == (METRICS[key].header, METRICS[key].describe(), METRICS[key].fmt)


def test_assert_drift_within_message_says_unit_and_direction():
    report = {"summary": {"metrics": {"kl_nats": {"mean": 0.2}}}, "items": [{"id": "a", "kl_nats": {"mean": 0.3}}]}
    with pytest.raises(testing.DriftCheckFailed) as e:
        testing.assert_drift_within(report, fail_on="kl_mean>0.1")
    m = METRICS["kl_mean"]
    assert f"({m.unit}, {m.direction}: {m.meaning})" in str(e.value) and "a (0.3)" in str(e.value)


def test_docs_metric_and_source_option_tables_are_the_generated_ones():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
