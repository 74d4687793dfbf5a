"""stats: paired bootstrap over items, items needed, ordering of neighbouring candidates."""

import math

import numpy as np
import pytest

from logitdiff.numerics.stats import adjacent_pairs, items_needed, paired_bootstrap, per_item_values


def test_identical_inputs_cannot_be_separated():
    a = np.random.default_rng(1).gamma(2.0, 0.01, 50)
    r = paired_bootstrap(a, a.copy(), n_boot=500, seed=3)
    assert r["diff"] == 0.0
    assert r["ci"] == [0.0, 0.0]
    assert r["ci"][0] <= 0.0 <= r["ci"][1]
    assert r["separable"] is False
    assert r["p_two_sided"] == 1.0
    assert items_needed(a, a) == math.inf


@pytest.mark.parametrize("shift", [0.5, -0.25])
def test_constant_shift_is_separable_and_exact(shift):
    # Multiples of 1/4 are exact in binary floating point, so b - a is exactly the shift.
    a = np.random.default_rng(2).integers(0, 40, 30) / 4.0
    r = paired_bootstrap(a, a + shift, n_boot=400, seed=0)
    assert r["diff"] == shift
    assert r["ci"] == pytest.approx([shift, shift], abs=1e-15)
    assert r["separable"] is True
    assert r["p_two_sided"] == pytest.approx(1 / 401)
    assert r["n_items"] == 30 and r["sd"] == 0.0


def test_bootstrap_matches_a_hand_computation():
    rng = np.random.default_rng(7)
    a = rng.normal(1.0, 0.3, 25)
    b = a + rng.normal(0.05, 0.2, 25)
    r = paired_bootstrap(a, b, n_boot=1000, seed=11)
    # By hand: draw item indices with the same generator, mean of the paired differences per draw.
    d = b - a
    idx = np.random.default_rng(11).integers(0, 25, size=(1000, 25))
    boot = np.array([d[row].mean() for row in idx])
    assert r["diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert r["ci"] == pytest.approx(list(np.quantile(boot, [0.025, 0.975])), rel=1e-12)
    k = min((boot <= 0).sum(), (boot >= 0).sum())
    assert r["p_two_sided"] == pytest.approx(min(1.0, (2 * k + 1) / 1001))
    assert r["separable"] == (r["ci"][0] > 0 or r["ci"][1] < 0)


def test_seeded_determinism():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, 40), rng.normal(0.1, 1, 40)
    assert paired_bootstrap(a, b, seed=5) == paired_bootstrap(a, b, seed=5)
    assert paired_bootstrap(a, b, seed=5)["ci"] != paired_bootstrap(a, b, seed=6)["ci"]


def test_nan_items_are_dropped_and_lengths_must_match():
    a = np.array([1.0, 2.0, np.nan, 4.0])
    b = np.array([1.5, 2.5, 3.0, np.nan])
    r = paired_bootstrap(a, b, n_boot=100)
    assert r["n_items"] == 2 and r["diff"] == 0.5
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 2.0], [1.0])
    assert paired_bootstrap([], [])["diff"] is None
    one = paired_bootstrap([1.0], [2.0])
    assert one["diff"] == 1.0 and one["separable"] is False


def test_items_needed_formula_and_that_it_is_about_right():
    d = np.array([0.1, 0.3, -0.1, 0.2, 0.0, 0.4, -0.2, 0.3])
    a = np.zeros_like(d)
    expect = math.ceil((1.959963984540054 * d.std(ddof=1) / d.mean()) ** 2)
    assert items_needed(a, d) == expect
    assert items_needed([1.0], [2.0]) is None
    # Doubling the effect at the same spread needs about a quarter of the items.
    big = items_needed(np.zeros(8), d + d.mean())
    assert big < expect / 2
    # Sanity by simulation: with 4x the estimated number of items, the CI excludes 0 nearly always.
    rng = np.random.default_rng(0)
    pop_a = rng.gamma(2.0, 0.01, 200)
    pop_b = pop_a * rng.lognormal(0.05, 0.3, 200)
    n = int(items_needed(pop_a, pop_b))
    assert 2 <= n < 200
    hits = 0
    for s in range(20):
        pick = np.random.default_rng(100 + s).integers(0, 200, 4 * n)
        hits += paired_bootstrap(pop_a[pick], pop_b[pick], n_boot=500, seed=s)["separable"]
    assert hits >= 17


def test_adjacent_pairs_sorted_and_separated():
    rng = np.random.default_rng(3)
    base = rng.gamma(2.0, 0.01, 60)
    wobble = rng.normal(0, 1e-4, 60)
    wobble -= wobble.mean()  # zero-mean: Q4b differs from Q4 item by item but not on average
    kl = {
        "Q2": base * 8 + rng.normal(0, 1e-4, 60),
        "BF16": base * 0.01,
        "Q4": base * 2,
        "Q4b": base * 2 + wobble,
    }
    t1 = {k: np.clip(v * 5, 0, 1) for k, v in kl.items()}
    ids = [f"i{k}" for k in range(60)]
    pairs = adjacent_pairs(ids, kl, t1, n_boot=500)
    order = [pairs[0]["a"]] + [p["b"] for p in pairs]
    assert order[0] == "BF16" and order[-1] == "Q2" and set(order[1:3]) == {"Q4", "Q4b"}
    by = {(p["a"], p["b"]): p for p in pairs}
    assert by[("BF16", order[1])]["kl"]["separable"]
    assert by[(order[2], "Q2")]["kl"]["separable"]
    mid = by[(order[1], order[2])]["kl"]
    assert not mid["separable"] and mid["items_needed"] > 60
    assert all("top1" in p for p in pairs)
    with pytest.raises(ValueError):
        adjacent_pairs(ids[:-1], kl)


def test_per_item_values_aligns_with_item_order():
    v = per_item_values(np.array(["b", "a", "b", "a", "a"]), np.array([1.0, 2.0, 3.0, 4.0, 6.0]), ["a", "b", "c"])
    assert v[0] == 4.0 and v[1] == 2.0 and math.isnan(v[2])
