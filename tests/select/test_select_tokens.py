"""selection.budget_tokens: the budget in tokens, water-filled per cluster (balanced) or a random prefix."""

from __future__ import annotations

import numpy as np
import pytest

from ray_cluster_ft.select import select, select_with_config, water_fill_quotas
from ray_cluster_ft.select.quotas import token_budget_count


def test_water_filling_in_tokens_known_values():
    # Token totals 100, 300, 600 and a budget of 600: level L with 100 + 2L = 600, L = 250.
    assert water_fill_quotas(np.array([100, 300, 600]), 600).tolist() == [100, 250, 250]
    # A budget of 601: the token left over goes to the largest cluster still above the level.
    assert water_fill_quotas(np.array([100, 300, 600]), 601).tolist() == [100, 250, 251]


def _clusters():
    """Three clusters; ``central`` picks members by ascending distance to the centroid (a fixed order)."""
    labels = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    nt = np.array([50, 30, 20, 100, 100, 50, 50, 200, 100, 100, 100, 100])
    dist = np.array([0.3, 0.1, 0.2, 0.4, 0.1, 0.3, 0.2, 0.5, 0.1, 0.2, 0.3, 0.4])
    return labels, nt, dist


def test_balanced_token_budget_exact_picks():
    labels, nt, dist = _clusters()
    # cluster tokens: 100, 300, 600 (total 1000); budget 600 -> quotas 100, 250, 250 (see above).
    res = select("balanced", None, labels, dist, within="central", n_tokens=nt, budget_tokens=600)
    assert res.token_quotas.tolist() == [100, 250, 250]
    # cluster 0: whole (100 tokens). cluster 1 by distance: rows 4 (100), 6 (50), 5 (50) = 200, then row 3
    # (100) would reach 300 > 250. cluster 2 by distance: rows 8, 9 (100 each) = 200, row 10 would reach 300.
    assert res.indices.tolist() == [0, 1, 2, 4, 5, 6, 8, 9]
    assert res.quotas.tolist() == [3, 3, 2]  # rows picked per cluster
    assert int(nt[res.indices].sum()) == 500
    assert res.reasons[:3].tolist() == ["whole-cluster"] * 3


def test_balanced_token_budget_with_kcenter_stays_within_each_quota():
    rng = np.random.default_rng(0)
    n, k = 600, 5
    x = rng.standard_normal((n, 16)).astype(np.float32)
    labels = rng.integers(0, k, n)
    dist = rng.random(n)
    nt = rng.integers(10, 400, n)
    budget = int(0.3 * nt.sum())
    res = select("balanced", x, labels, dist, within="kcenter", n_tokens=nt, budget_tokens=budget, seed=3)
    per = np.bincount(labels[res.indices], weights=nt[res.indices], minlength=k)
    assert (per <= res.token_quotas).all()
    assert res.token_quotas.sum() == budget
    # each cluster is filled to within one of its rows of its quota (its longest row)
    longest = np.array([nt[labels == c].max() for c in range(k)])
    assert (res.token_quotas - per < longest).all()


def test_random_token_budget_takes_the_seeded_order_while_it_fits():
    """A seeded permutation, each row taken while it fits what is left (a long row does not end the pick)."""
    labels, nt, _ = _clusters()
    perm = np.random.default_rng(4).permutation(nt.size)
    left, want = 450, []
    for i in perm:  # the reference: first fit in the seeded order
        if nt[i] <= left:
            want.append(i)
            left -= int(nt[i])
    res = select("random", None, labels, None, n_tokens=nt, budget_tokens=450, seed=4)
    assert res.indices.tolist() == sorted(want)
    assert int(nt[res.indices].sum()) <= 450
    rest = np.setdiff1d(np.arange(nt.size), res.indices)
    assert int(nt[rest].min()) > 450 - int(nt[res.indices].sum())  # nothing left out would still fit


def test_a_long_row_does_not_end_the_token_pick():
    from ray_cluster_ft.select.quotas import _fit_in_order

    assert _fit_in_order(np.array([3, 4, 10, 2, 1, 5]), 10).tolist() == [0, 1, 3, 4]
    assert _fit_in_order(np.array([11, 12]), 10).tolist() == []
    assert _fit_in_order(np.array([5, 5]), 10).tolist() == [0, 1]


def test_token_budget_errors():
    labels, nt, _ = _clusters()
    with pytest.raises(ValueError, match="above the 1000 tokens"):
        select("random", None, labels, None, n_tokens=nt, budget_tokens=1001)
    with pytest.raises(ValueError, match="needs n_tokens"):
        select("random", None, labels, None, budget_tokens=10)
    with pytest.raises(ValueError, match="applies to the 'balanced' and 'random'"):
        select("full", None, labels, None, n_tokens=nt, budget_tokens=10)
    from ray_cluster_ft.config import SelectionConfig

    with pytest.raises(ValueError, match="budget_tokens applies to 'balanced' and 'random', not 'equalize'"):
        SelectionConfig(strategy="equalize", budget_tokens=0.5)


def test_select_with_config_token_fraction():
    from ray_cluster_ft.config import JobConfig

    nt = _clusters()[1]
    cfg = JobConfig.model_validate({"data": {"source": "demo"}, "train": {"micro_batch_size": 1},
                                    "selection": {"strategy": "random", "budget_tokens": 0.45}})
    st = select_with_config(cfg, n_candidates=nt.size, n_tokens=nt)
    assert st.tokens_requested == token_budget_count(0.45, 1000) == 450
    assert st.requested == st.result.indices.size
    assert int(nt[st.result.indices].sum()) <= 450
    assert token_budget_count(5000, 1000) == 5000


def test_a_token_budget_below_one_step_is_a_config_error():
    from ray_cluster_ft.config import ConfigError, JobConfig

    nt = _clusters()[1]
    cfg = JobConfig.model_validate({"data": {"source": "demo"}, "selection": {"strategy": "random",
                                                                              "budget_tokens": 2}})
    with pytest.raises(ConfigError, match=r"budget_tokens=2.0 \(2 tokens\) selects 0 examples, fewer than one "
                                          r"optimizer step needs \(2: train.num_workers x train.grad_accum\)"):
        select_with_config(cfg, n_candidates=nt.size, n_tokens=nt)  # packed by default: a pack per rank
    unpacked = JobConfig.model_validate({"data": {"source": "demo"}, "allocation": {"packing": False},
                                         "selection": {"strategy": "random", "budget_tokens": 2}})
    with pytest.raises(ConfigError, match=r"optimizer step needs \(8: train.num_workers x train.grad_accum x "
                                          r"train.micro_batch_size\)"):
        select_with_config(unpacked, n_candidates=nt.size, n_tokens=nt)
