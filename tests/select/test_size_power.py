"""``selection.size_power``: shares of the budget in proportion to size ** p, between equal shares (p = 0, the
water-filling of ``balanced``) and the pool's own mix (p = 1, a stratified sample)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.select.quotas import group_quotas, select, water_fill_quotas
from ray_cluster_ft.select.stage import select_with_config

from .test_select_groups import _two_kinds


def test_known_answers():
    # sqrt shares of 30: 100, 25, 4 -> weights 10, 5, 2 -> 17.6, 8.8, 3.5 -> floors 17, 8, 3 and the two rows
    # left to the largest remainders (.82, .65)
    assert water_fill_quotas([100, 25, 4], 30, 0.5).tolist() == [18, 9, 3]
    # proportional: 23.3, 5.8, 0.9 -> 23, 5, 0, then .93 and .81 -> the small cluster keeps a row (Hamilton)
    assert water_fill_quotas([100, 25, 4], 30, 1.0).tolist() == [23, 6, 1]
    # a cluster smaller than its share is taken whole and the rest shared again: 2 + 24 + 24
    assert water_fill_quotas([2, 100, 100], 50, 0.5).tolist() == [2, 24, 24]
    assert water_fill_quotas([0, 7, 0], 3, 0.5).tolist() == [0, 3, 0]
    assert water_fill_quotas([10, 2, 5], 17, 0.3).tolist() == [10, 2, 5]
    assert water_fill_quotas([10, 2, 5], 0, 0.7).tolist() == [0, 0, 0]
    # equal sizes: every power is plain water-filling
    assert water_fill_quotas([3, 3, 3], 7, 0.5).tolist() == water_fill_quotas([3, 3, 3], 7).tolist() == [3, 2, 2]
    # two levels: groups' totals 30 and 2 -> sqrt shares of 8: 6.36 and 1.64 -> 6 and 1, the row left to the
    # larger remainder (.64): 6 and 2; then 6 over three equal clusters
    assert group_quotas([10, 10, 10, 2], [0, 0, 0, 1], 8, 0.5).tolist() == [2, 2, 2, 2]
    # proportional: 7.5 and 0.5 -> 7 and 0, the tie of remainders to the larger group; then 8 over three
    assert group_quotas([10, 10, 10, 2], [0, 0, 0, 1], 8, 1.0).tolist() == [3, 3, 2, 0]


def test_power_out_of_range_is_refused():
    for p in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="power"):
            water_fill_quotas([3, 4], 5, p)
    # float64 shares lose whole rows beyond 2**53 (found by review: the sum came out 5 above the budget)
    with pytest.raises(ValueError, match="2\\*\\*53"):
        water_fill_quotas([10**18, 10**18 - 1, 5], 10**18, 0.5)
    assert water_fill_quotas([10**18, 10**18 - 1, 5], 10**18).sum() == 10**18  # power 0 stays exact


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 80), min_size=1, max_size=25), frac=st.floats(0.0, 1.0),
       power=st.floats(0.05, 1.0))
def test_properties(sizes, frac, power):
    s = np.asarray(sizes)
    budget = int(round(frac * s.sum()))
    q = water_fill_quotas(s, budget, power)
    assert q.sum() == budget and (q >= 0).all() and (q <= s).all()
    open_ = np.flatnonzero(q < s)
    # a larger open cluster never gets fewer rows than a smaller one, less one for the rounding
    for i in open_:
        for j in open_:
            if s[i] > s[j]:
                assert q[i] >= q[j] - 1
    # a cluster taken whole was no bigger than the share an open cluster's level gives it, plus the rounding row
    if open_.size:
        level = max((q[i] + 1) / s[i] ** power for i in open_)
        assert all(s[c] <= level * s[c] ** power + 1 for c in np.flatnonzero((q == s) & (s > 0)))


def test_proportional_is_within_one_row_of_the_pool_mix():
    rng = np.random.default_rng(0)
    s = rng.integers(5, 200, 30)
    q = water_fill_quotas(s, 400, 1.0)
    assert np.abs(q - 400 * s / s.sum()).max() < 1


def test_select_and_the_config_pass_it_through():
    x, labels, dist = _two_kinds()  # kind A: three clusters of 60, kind B: one of 20
    equal = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups="auto")
    root = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups="auto", size_power=0.5)
    prop = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups="auto", size_power=1.0)
    # groups' totals 180 and 20: equal 20/20, sqrt 13.4 : 4.5 -> 30/10, proportional 36/4
    assert equal.quotas.tolist() == [7, 7, 6, 20]
    assert root.quotas.tolist() == [10, 10, 10, 10]
    assert prop.quotas.tolist() == [12, 12, 12, 4]
    cfg = parse_config({"selection": {"budget": 40, "within": "random", "seed": 3, "size_power": 0.5}})
    out = select_with_config(cfg, n_candidates=200, sketches=x, labels=labels, dist=dist)
    assert out.result.quotas.tolist() == [10, 10, 10, 10]
    assert out.result.indices.tolist() == root.indices.tolist()


def test_config_is_checked():
    assert parse_config({}).selection.size_power == 0.0
    for bad in (-0.5, 2):
        with pytest.raises(ConfigError, match="size_power"):
            parse_config({"selection": {"size_power": bad}})
    with pytest.raises(ConfigError, match="size_power"):
        parse_config({"selection": {"strategy": "random", "size_power": 0.5}})
    assert parse_config({"selection": {"strategy": "random"}}).selection.size_power == 0.0
