"""Candidate names folded to the part that differs (report.names.distinct_names)."""

from __future__ import annotations

import itertools

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
