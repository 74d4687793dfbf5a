"""Code a user of the public API writes, checked by mypy in tests/test_static.py (never run:
its name keeps pytest from collecting it). Each line states a type the API promises; a
change that loses one (a return typed ``dict`` or ``Any`` again, a renamed report field)
fails the type check here."""

from __future__ import annotations

from pathlib import Path

from typing_extensions import assert_type

import logitdiff
from logitdiff.contracts import LayersDoc, NoiseFloor, Report, RunSummary, SpeculationReport, Stats
from logitdiff.testing import DriftCheckFailed, DriftFailure, assert_drift_within, drift_failures


def uses_the_api(tmp: Path) -> None:
    report = logitdiff.diff_runs(tmp / "ref", tmp / "cand", out=tmp / "report")
    assert_type(report, Report)
    kl: float | None = report["summary"]["kl_nats_mean"]
    assert_type(report["summary"]["metrics"]["kl_nats"], Stats)
    nf = report["summary"].get("noise_floor")
    if nf is not None:
        assert_type(nf, NoiseFloor)
    assert_type(logitdiff.load_report(tmp / "report"), Report)
    assert_type(logitdiff.run(out=str(tmp / "run")), RunSummary)
    assert_type(logitdiff.load_summary(tmp / "run"), RunSummary)
    assert_type(logitdiff.capture_run("builtin:tiny", tmp / "ref"), Path)
    assert_type(logitdiff.speculate("http://127.0.0.1:1", "http://127.0.0.1:2"), SpeculationReport)
    from logitdiff.api import layers

    assert_type(layers("builtin:tiny", "builtin:tiny-Q4_K_M", tmp / "ref"), LayersDoc)
    assert_drift_within(report, require="kl_mean<0.05")
    failures = drift_failures(tmp / "report", fail_on="kl_mean>0.05")
    assert_type(failures, list[DriftFailure])
    value: float | None = failures[0]["value"]
    try:
        assert_drift_within(tmp / "report", fail_on="kl_p99>0.5")
    except DriftCheckFailed as e:
        assert_type(e.failures, list[DriftFailure])
    del value
    del kl
