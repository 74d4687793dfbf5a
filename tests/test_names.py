"""Candidate names folded to the part that differs (report.names.distinct_names)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logitdiff.report.names import ELLIPSIS, distinct_names

REAL = ["Qwen3-30B-A3B-Instruct-2507-UD-Q4_K_XL", "Qwen3-30B-A3B-Instruct-2507-UD-Q2_K_XL",
        "Qwen3-30B-A3B-Instruct-2507-UD-IQ3_XXS"]


def test_the_longest_real_names_keep_what_tells_them_apart():
    assert distinct_names(REAL) == ["…Q4_K_XL", "…Q2_K_XL", "…IQ3_XXS"]
    # a column cut at 12 characters still tells them apart
    assert len({s[:12] for s in distinct_names(REAL)}) == 3


def test_folds_at_a_separator_never_inside_a_word():
    assert distinct_names(["SmolLM2-135M-Q4_0", "SmolLM2-135M-Q4_1"]) == ["…Q4_0", "…Q4_1"]
    assert distinct_names(["tiny-Q8_0", "tiny-Q2_K"]) == ["tiny-Q8_0", "tiny-Q2_K"]  # 5 characters: nothing to gain


def test_a_name_that_is_the_shared_prefix_stays_whole():
    names = ["model-Q4/", "model-Q4/x-y", "model-Q4/x-z"]
    out = distinct_names(names)
    assert out[0] == "model-Q4/" and len(set(out)) == 3


@given(st.lists(st.text(alphabet="ab-_.Q4K", min_size=0, max_size=30), min_size=1, max_size=6, unique=True))
def test_different_names_never_render_alike(names):
    out = distinct_names(names)
    assert len(out) == len(names) and len(set(out)) == len(names)
    for short, full in zip(out, names):
        assert short == full or (short.startswith(ELLIPSIS) and full.endswith(short[1:]))


def test_one_name_or_equal_names_unchanged():
    assert distinct_names(["a-very-long-model-name-Q4"]) == ["a-very-long-model-name-Q4"]
    assert distinct_names([]) == []
    assert list(itertools.chain(distinct_names(["x", "x"]))) == ["x", "x"]


# ------------------------------------------------------------------------------------------
# the terminal tables of `logitdiff run` with long real names that differ only at the end
# ------------------------------------------------------------------------------------------

GGUF = [f"Qwen3-30B-A3B-Instruct-2507-UD-{q}" for q in ("Q4_K_XL", "Q5_K_XL", "Q6_K_XL")]
RULES = "│┃┓┩┘┐┤┫┛"


def _run_summary() -> dict:
    from logitdiff.contracts import Outcome

    rows = []
    for k, name in enumerate(GGUF):
        rows.append({"candidate": f"gguf:/models/{name}.gguf", "name": name, "kl_mean": 0.0123 * (k + 1),
                     "kl_mean_ci95": [0.0111 * (k + 1), 0.0135 * (k + 1)], "kl_p99": 0.123, "jsd_mean": 0.00456,
                     "top1_disagreement": 0.0789, "ppl_ratio": 1.0123, "x_noise_floor": 12345.0, "x_cross_engine_floor": 456.0,
                     "flip_branches": 24, "flip_ties": 5, "flip_outcomes": {o: k + i for i, o in enumerate(Outcome.ALL)},
                     "accuracy_ref": 0.95, "accuracy_cand": 0.875 - 0.025 * k, "right_to_wrong": 3 + k, "wrong_to_right": k,
                     "mcnemar_p": 0.25 / (k + 1), "tool_call_valid_cand": 0.917})
    return {"reference": "hf:/models/Qwen3-30B-A3B-Instruct-2507", "items": 68, "positions": 1806, "workload": "w.jsonl",
            "seconds": 1.0, "candidates": rows, "noise_floor": None, "cross_engine_floor": None}


@pytest.mark.parametrize("width", [80, 120, 160])
def test_run_tables_tell_long_names_apart_and_crop_nothing(width, capsys, monkeypatch):
    """`run`'s drift and consequence tables, at a terminal's 80 and 120 columns and a pipe's
    160: every candidate row shows its own name (the part that differs), no cell or header is
    cut to "…" and no column is cropped off the right edge (each table line ends in its rule);
    a table too wide for the width is split into tables that repeat the candidate column."""
    from rich.console import Console

    import logitdiff.cli.run as cli_run
    from logitdiff.report.metric_registry import CONSEQUENCE_TABLE, DRIFT_TABLE, header

    monkeypatch.setattr(cli_run, "table_console", lambda width_=160: Console(width=width, color_system=None))
    summary = _run_summary()
    cli_run.print_run_summary(summary)
    out = capsys.readouterr().out
    shown = distinct_names(GGUF)
    assert shown == ["…Q4_K_XL", "…Q5_K_XL", "…Q6_K_XL"]
    lines = out.splitlines()
    body = [ln for ln in lines if ln[:1] in "│┃┏┡└"]
    assert body and all(len(ln) <= width and ln.rstrip()[-1] in RULES for ln in body), "\n".join(body)
    # the candidate column of every table, row by row, and nothing cut outside it
    firsts = [ln.split(ln[0])[1].strip() for ln in body if ln[0] == "│"]
    names = [c for c in firsts if c]
    tables = out.count("┏")
    assert tables >= 2 and names == shown * tables, (names, out)
    for ln in body:
        if ln[0] in "│┃":
            assert "…" not in ln[ln.index(ln[0], 1):], ln  # no header or value cut short
    # every header is there, in words (wrapped between words, never cut)
    words = " ".join(" ".join(ln.split()) for ln in body)
    for h in [header(n) for n in (*DRIFT_TABLE, *CONSEQUENCE_TABLE)]:
        assert all(w in words for w in h.split()), h
    # and every row's values: the McNemar p and accuracy of each candidate
    for r in summary["candidates"]:
        assert f"{r['mcnemar_p']:.3g}" in words and f"{100 * r['accuracy_cand']:.1f}%" in words, r
