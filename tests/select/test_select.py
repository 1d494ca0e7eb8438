"""Water-filling quotas, within-cluster choice and the Select stage (ray_cluster_ft.select)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_cluster_ft import select as sel
from ray_cluster_ft.select import within  # holds the block sizes the tests shrink
from ray_cluster_ft.select import select, select_within, water_fill_quotas


# --- water-filling ---------------------------------------------------------------------------------------------


def test_water_fill_known_answers():
    np.testing.assert_array_equal(water_fill_quotas([10, 2, 5], 12), [5, 2, 5])
    # 7 over three clusters of 3: level 2, the one extra goes to the lowest index among equal sizes.
    np.testing.assert_array_equal(water_fill_quotas([3, 3, 3], 7), [3, 2, 2])
    # The extra goes to the largest unsaturated cluster first.
    np.testing.assert_array_equal(water_fill_quotas([4, 9, 1, 6], 12), [3, 4, 1, 4])
    np.testing.assert_array_equal(water_fill_quotas([10, 2, 5], 17), [10, 2, 5])
    np.testing.assert_array_equal(water_fill_quotas([10, 2, 5], 0), [0, 0, 0])
    np.testing.assert_array_equal(water_fill_quotas([0, 7, 0], 3), [0, 3, 0])
    assert water_fill_quotas([3, 3, 3], 7).dtype == np.int64


def test_water_fill_remainder_to_largest():
    # Level 3 fills 3 + 3 + 1 = 7 of 8: the leftover one goes to the larger of the two clusters above level.
    np.testing.assert_array_equal(water_fill_quotas([5, 9, 1], 8), [3, 4, 1])


def test_water_fill_errors():
    with pytest.raises(ValueError, match="above"):
        water_fill_quotas([10, 2, 5], 18)
    with pytest.raises(ValueError):
        water_fill_quotas([10, 2, 5], -1)
    with pytest.raises(ValueError):
        water_fill_quotas([3, -1], 1)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=25),
    frac=st.floats(0.0, 1.0),
)
def test_water_fill_properties(sizes, frac):
    sizes = np.asarray(sizes)
    budget = int(round(frac * sizes.sum()))
    q = water_fill_quotas(sizes, budget)
    assert q.sum() == budget
    assert (q >= 0).all() and (q <= sizes).all()
    unsat = q < sizes
    if unsat.any():
        assert q[unsat].max() - q[unsat].min() <= 1
        # A cluster was taken whole only if it was no bigger than the others' share.
        assert (sizes[~unsat] <= q[unsat].min() + 1).all()


# --- within a cluster ------------------------------------------------------------------------------------------


def _dist_to(x, centre):
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = np.asarray(centre, dtype=np.float64)
    return 1.0 - xn @ (c / np.linalg.norm(c))


def test_kcenter_picks_far_points():
    x = np.array([[1, 0], [0.99, 0.14], [0.98, 0.2], [0, 1], [-1, 0.05], [0.97, -0.24]], dtype=np.float32)
    dist = _dist_to(x, [1, 0])
    idx, reasons = select_within(x, dist, 3, "kcenter")
    # Start nearest the centroid, then the antipode, then the orthogonal point.
    assert idx.tolist() == [0, 4, 3]
    assert reasons == ["centroid", "kcenter", "kcenter"]


def test_kcenter_matches_plain_traversal(monkeypatch):
    monkeypatch.setattr(within, "_KCENTER_BLOCK", 1024)  # one block: the plain traversal, pick for pick
    rng = np.random.default_rng(4)
    centres = rng.normal(size=(5, 16))
    x = (centres[rng.integers(0, 5, 600)] + 0.3 * rng.normal(size=(600, 16))).astype(np.float32)
    dist = _dist_to(x, x.mean(axis=0))
    idx, _ = select_within(x, dist, 200, "kcenter", dedup_threshold=1.0)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    expect = [int(np.argmin(dist))]
    mind = 1.0 - xn @ xn[expect[0]]
    for _ in range(199):
        mind[expect] = -np.inf
        j = int(np.argmax(mind))
        expect.append(j)
        mind = np.minimum(mind, 1.0 - xn @ xn[j])
    assert idx.tolist() == expect


def test_kcenter_blocks_cover_every_region(monkeypatch):
    # Force the block path (clusters above 100 rows) on 6 tight, well separated groups of 100 rows: with a
    # quota of 12, every group must get picks, in proportion, and each block starts near the centroid.
    monkeypatch.setattr(within, "_KCENTER_BLOCK", 100)
    rng = np.random.default_rng(5)
    centres = np.linalg.qr(rng.normal(size=(16, 6)))[0].T  # orthonormal
    group = np.repeat(np.arange(6), 100)
    x = (centres[group] + 0.05 * rng.normal(size=(600, 16))).astype(np.float32)
    x = np.concatenate([x, x[:1]])  # an exact duplicate stays in its original's block
    group = np.append(group, 0)
    dist = _dist_to(x, x.mean(axis=0))
    idx, reasons = select_within(x, dist, 12, "kcenter", seed=0)
    assert idx.size == 12 and np.unique(idx).size == 12
    assert idx[0] == int(np.argmin(dist)) and reasons[0] == "centroid"
    assert np.bincount(group[idx], minlength=6).tolist() == [2] * 6
    assert "dedup-fill" not in reasons
    # Group 0 has 101 rows, one an exact duplicate, split in two blocks: 100 picks are the distinct ones.
    one = np.flatnonzero(group == 0)
    idx1, reasons1 = select_within(x[one], dist[one], 100, "kcenter", seed=0)
    assert "dedup-fill" not in reasons1
    assert not {0, 100} <= set(idx1.tolist())  # rows 0 and 600 of x are the duplicate pair


def test_dedup_drops_exact_duplicate():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    x = np.concatenate([x, x[2:3] * 3.0])  # row 6 is row 2 (same direction)
    dist = _dist_to(x, x.mean(axis=0))
    for method in ("kcenter", "strata"):
        idx, reasons = select_within(x, dist, 6, method, dedup_threshold=0.995, seed=0)
        assert len(set(idx.tolist()) & {2, 6}) == 1, method
        assert "dedup-fill" not in reasons
    # The whole cluster asked for: every row, duplicates included.
    idx, reasons = select_within(x, dist, 7, "kcenter")
    assert reasons == ["whole-cluster"] * 7
    # Two duplicate pairs among 8 rows leave 6 distinct directions: a 7th pick is a flagged duplicate.
    x2 = np.concatenate([x, x[0:1]])
    d2 = _dist_to(x2, x2.mean(axis=0))
    for method in ("kcenter", "strata"):
        idx, reasons = select_within(x2, d2, 7, method)
        assert sorted(set(idx.tolist())) == sorted(idx.tolist())  # no row twice
        assert reasons.count("dedup-fill") == 1, method
    # Threshold 1 disables de-duplication.
    idx, reasons = select_within(x, dist, 6, "kcenter", dedup_threshold=1.0)
    assert "dedup-fill" not in reasons


def test_greedy_dedup_matches_brute_force_across_chunks(monkeypatch):
    monkeypatch.setattr(within, "_DEDUP_CHUNK", 16)
    monkeypatch.setattr(within, "_DEDUP_KEPT_BLOCK", 8)
    rng = np.random.default_rng(1)
    base = rng.normal(size=(60, 12))
    x = np.concatenate([base, base[rng.integers(0, 60, 90)] + 0.01 * rng.normal(size=(90, 12))])
    xn = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    order = rng.permutation(xn.shape[0])
    got = within._near_duplicate_keep(xn, order, 0.99)
    expect = np.zeros(xn.shape[0], dtype=bool)
    kept = []
    for i in order:
        if not kept or (xn[kept] @ xn[i]).max() <= 0.99:
            kept.append(i)
            expect[i] = True
    np.testing.assert_array_equal(got, expect)
    assert 50 <= got.sum() < 150


def test_strata_spread_over_distance():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 16)).astype(np.float32)
    dist = rng.permutation(np.linspace(0.0, 1.0, 100))
    idx, reasons = select_within(x, dist, 10, "strata", seed=3)
    assert reasons == ["strata"] * 10
    # One pick in each tenth of the distance order.
    np.testing.assert_array_equal(np.sort(np.floor(dist[idx] * 9.999).astype(int)), np.arange(10))
    idx2, _ = select_within(x, dist, 10, "strata", seed=3)
    np.testing.assert_array_equal(idx, idx2)


def test_select_within_errors():
    x = np.eye(3, dtype=np.float32)
    d = np.zeros(3)
    with pytest.raises(ValueError, match="quota"):
        select_within(x, d, 4)
    with pytest.raises(ValueError, match="method"):
        select_within(x, d, 1, "nearest")
    with pytest.raises(ValueError, match="dist_c"):
        select_within(x, d[:2], 1)
    with pytest.raises(ValueError, match="zero"):
        select_within(np.zeros((3, 3)), d, 1)
    assert select_within(x, d, 0)[0].size == 0


# --- the stage -------------------------------------------------------------------------------------------------


def _clustered(seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.array([40, 5, 25, 2, 60])
    labels = np.repeat(np.arange(sizes.size), sizes)
    x = rng.normal(size=(labels.size, 16)).astype(np.float32)
    dist = rng.uniform(0, 1, labels.size)
    perm = rng.permutation(labels.size)
    return x[perm], labels[perm], dist[perm], sizes


@pytest.mark.parametrize("within", ["kcenter", "strata"])
def test_select_balanced_meets_quotas(within):
    x, labels, dist, sizes = _clustered()
    res = select("balanced", x, labels, dist, budget=50, within=within, seed=1)
    np.testing.assert_array_equal(res.quotas, water_fill_quotas(sizes, 50))
    np.testing.assert_array_equal(np.bincount(labels[res.indices], minlength=sizes.size), res.quotas)
    assert res.indices.dtype == np.int64
    assert np.all(np.diff(res.indices) > 0)
    assert res.reasons.shape == res.indices.shape
    assert set(res.reasons) <= {"centroid", "kcenter", "strata", "whole-cluster", "dedup-fill"}
    # The two clusters smaller than their share are taken whole.
    whole = res.indices[res.reasons == "whole-cluster"]
    assert sorted(np.unique(labels[whole]).tolist()) == [1, 3]
    again = select("balanced", x, labels, dist, budget=50, within=within, seed=1)
    np.testing.assert_array_equal(res.indices, again.indices)
    np.testing.assert_array_equal(res.reasons, again.reasons)


def test_select_random_and_full():
    x, labels, dist, sizes = _clustered()
    r = select("random", x, labels, dist, budget=30, seed=4)
    assert r.indices.size == 30 and np.unique(r.indices).size == 30 and np.all(np.diff(r.indices) > 0)
    assert (r.reasons == "random").all()
    np.testing.assert_array_equal(r.quotas, np.bincount(labels[r.indices], minlength=sizes.size))
    np.testing.assert_array_equal(select("random", labels=labels, budget=30, seed=4).indices, r.indices)
    assert not np.array_equal(select("random", labels=labels, budget=30, seed=5).indices, r.indices)
    f = select("full", x, labels, dist, budget=0)
    np.testing.assert_array_equal(f.indices, np.arange(labels.size))
    np.testing.assert_array_equal(f.quotas, sizes)
    assert select("full", n=7).indices.tolist() == list(range(7))


def test_random_is_uniform():
    counts = np.zeros(50)
    for s in range(400):
        counts[select("random", n=50, budget=10, seed=s).indices] += 1
    # Each row is drawn with probability 1/5: 80 expected draws, binomial sd ~8.
    assert counts.min() > 45 and counts.max() < 115


def test_select_errors():
    x, labels, dist, _ = _clustered()
    with pytest.raises(ValueError, match="above"):
        select("random", x, labels, dist, budget=labels.size + 1)
    with pytest.raises(ValueError, match="strategy"):
        select("greedy", x, labels, dist, budget=3)
    with pytest.raises(ValueError, match="needs"):
        select("balanced", labels=labels, budget=3)
    with pytest.raises(ValueError, match="disagree"):
        select("random", x[:-1], labels, budget=3)


def test_large_cluster_is_fast():
    import time

    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 64)).astype(np.float32)
    x[10_000:10_050] = x[:50]  # exact duplicates far apart in any order
    dist = rng.uniform(0, 1, 20_000)
    t0 = time.perf_counter()
    idx, reasons = select_within(x, dist, 500, "strata", seed=0)
    idx_k, _ = select_within(x, dist, 500, "kcenter")
    elapsed = time.perf_counter() - t0
    assert idx.size == idx_k.size == 500
    assert elapsed < 30.0, elapsed  # O(n^2 d) de-duplication in BLAS blocks, O(n q d) k-center


# --- the published selection: equalize, distance orders, weights -----------------------------------------------


def _published_slice(dist_c, m, prune_type):
    """The published per-cluster cut (_kmeans_prune_equalize_interleave): members sorted by ascending distance
    (a stable sort, so ties by index), then 'close' keeps lst[-m:] and 'far' keeps lst[:m]."""
    lst = sorted(range(len(dist_c)), key=lambda i: dist_c[i])
    return set(lst[-m:] if prune_type == "close" else lst[:m])


def _two_clusters_2d():
    # Cluster 0: five points on a line around (0, 0); cluster 1: seven points around (10, 10), two tied.
    a = np.array([[-2, 0], [-1, 0], [0, 0], [1, 0], [2.5, 0]], dtype=np.float32)
    b = np.array([[10, 10], [10, 11], [10, 13], [12, 10], [10, 7], [10, 9.5], [10.5, 10]], dtype=np.float32)
    x = np.concatenate([a, b])
    labels = np.array([0] * 5 + [1] * 7)
    centres = np.array([[0, 0], [10, 10]], dtype=np.float32)
    dist = np.sum((x - centres[labels]) ** 2, axis=1)  # squared Euclidean, as the kmeans path
    return x, labels, dist


def test_within_orders_pick_the_right_points_by_hand():
    x, labels, dist = _two_clusters_2d()
    # dist: cluster 0 = [4, 1, 0, 1, 6.25]; cluster 1 = [0, 1, 9, 4, 9, 0.25, 0.25].
    res = select("equalize", x, labels, dist, within="peripheral", ratio=0.8)
    assert res.quotas.tolist() == [4, 4]  # floor(0.8 * 5) = 4, nothing rounded to a micro-batch
    assert res.indices.tolist() == [0, 1, 3, 4, 6, 7, 8, 9]  # the farthest four of each cluster
    assert set(res.reasons) == {"peripheral"}
    res = select("equalize", x, labels, dist, within="central", ratio=0.8)
    assert res.indices.tolist() == [0, 1, 2, 3, 5, 6, 10, 11]  # the nearest four of each cluster
    res = select("equalize", x, labels, dist, within="peripheral", ratio=1.0)
    assert res.quotas.tolist() == [5, 5]  # the published default: the smallest cluster whole
    # Ties at the cut, as the published slices: peripheral (lst[-m:]) keeps the higher index, central
    # (lst[:m]) the lower; picks come farthest / nearest first.
    d0 = dist[:5]
    assert select_within(None, d0, 3, "peripheral")[0].tolist() == [4, 0, 3]
    assert select_within(None, d0, 2, "central")[0].tolist() == [2, 1]
    d1 = dist[5:]
    assert select_within(x[5:], d1, 2, "central")[0].tolist() == [0, 5]
    assert select_within(x[5:], d1, 2, "peripheral")[0].tolist() == [4, 2]
    # random: seeded, a subset of the right size, the same twice.
    r1, why = select_within(None, d1, 3, "random", seed=4)
    r2, _ = select_within(None, d1, 3, "random", seed=4)
    assert r1.tolist() == r2.tolist() and len(set(r1.tolist())) == 3 and why == ["random"] * 3
    assert select_within(None, d1, 7, "peripheral")[1] == ["whole-cluster"] * 7


def test_within_orders_match_the_published_slices():
    x, labels, dist = _two_clusters_2d()
    for within, prune_type in (("peripheral", "close"), ("central", "far")):
        for m in (1, 2, 3, 4):
            res = select("equalize", x, labels, dist, within=within, ratio=m / 5)
            for c in (0, 1):
                members = np.flatnonzero(labels == c)
                got = set(np.flatnonzero(np.isin(members, res.indices)).tolist())
                assert got == _published_slice(dist[members], m, prune_type), (within, m, c)


def test_equalize_counts_are_equal_and_not_rounded():
    rng = np.random.default_rng(0)
    sizes = np.array([40, 13, 25, 60])
    labels = rng.permutation(np.repeat(np.arange(4), sizes))
    x = rng.normal(size=(labels.size, 8)).astype(np.float32)
    dist = rng.uniform(0, 1, labels.size)
    for within in ("kcenter", "strata", "peripheral", "central", "random"):
        res = select("equalize", x, labels, dist, within=within, ratio=0.5, seed=2)
        # floor(0.5 * 13) = 6, not rounded to a micro-batch (the published drop_last is off)
        assert res.quotas.tolist() == [6, 6, 6, 6], within
        assert np.bincount(labels[res.indices], minlength=4).tolist() == [6, 6, 6, 6], within
        assert np.all(np.diff(res.indices) > 0)
    # the peripheral picks are each cluster's six largest distances
    res = select("equalize", x, labels, dist, within="peripheral", ratio=0.5)
    for c in range(4):
        members = np.flatnonzero(labels == c)
        top = members[np.argsort(-dist[members])[:6]]
        assert sorted(top.tolist()) == res.indices[labels[res.indices] == c].tolist()


def test_equalize_count_rules():
    assert sel.equalize_count([100, 300], 0.29) == 29  # the decimal 0.29, not 28.999...
    assert sel.equalize_count([13, 40], 0.5) == 6
    assert sel.equalize_count([13, 40], 0.75) == 9
    assert sel.equalize_count([13, 40], 1.0) == 13
    from ray_cluster_ft.config import ConfigError

    x, labels, dist, _ = _clustered()  # sizes 40, 5, 25, 2, 60
    with pytest.raises(ConfigError, match=r"sizes \[40, 5, 25, 2, 60\]") as err:
        select("equalize", x, labels, dist, ratio=0.4)
    assert "selection.ratio=0.4" in str(err.value) and "= 0 rows" in str(err.value)
    with pytest.raises(ValueError, match="ratio"):
        sel.equalize_count([10], 1.5)
    # one cluster (the published world size 1): every row, whatever the ratio
    one = np.zeros(labels.size, dtype=np.int64)
    res = select("equalize", x, one, dist, within="peripheral", ratio=0.5)
    assert res.indices.tolist() == list(range(labels.size))


def test_balanced_with_a_distance_order_meets_the_quotas():
    x, labels, dist, sizes = _clustered()
    res = select("balanced", x, labels, dist, budget=50, within="central", seed=1)
    np.testing.assert_array_equal(np.bincount(labels[res.indices], minlength=sizes.size), water_fill_quotas(sizes, 50))
    for c in np.flatnonzero(res.quotas < sizes):
        members = np.flatnonzero(labels == c)
        nearest = members[np.argsort(dist[members], kind="stable")[: res.quotas[c]]]
        assert sorted(nearest.tolist()) == res.indices[labels[res.indices] == c].tolist()


def test_selection_weights_by_hand():
    # Clusters of 6, 3 and 1 candidates (N = 10), 2, 2 and 1 selected (S = 5):
    # w0 = (6/10)/(2/5) = 1.5, w1 = (3/10)/(2/5) = 0.75, w2 = (1/10)/(1/5) = 0.5.
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 2])
    selected = np.array([9, 0, 6, 1, 7])
    w = sel.selection_weights(labels, selected, "equalize")
    assert w.dtype == np.float64
    assert w.tolist() == [0.5, 1.5, 0.75, 1.5, 0.75]
    assert w.mean() == 1.0
    assert sel.selection_weights(labels, selected, "random").tolist() == [1.0] * 5
    assert sel.selection_weights(labels, selected, "full").tolist() == [1.0] * 5
    assert sel.selection_weights(labels, selected[:0], "balanced").shape == (0,)
    # Cluster 2 has nothing selected: N counts the 9 candidates of clusters 0 and 1, S = 3:
    # w0 = (6/9)/(1/3) = 2, w1 = (3/9)/(2/3) = 0.5; the mean stays 1.
    w2 = sel.selection_weights(labels, np.array([0, 6, 7]), "balanced")
    assert w2.tolist() == [2.0, 0.5, 0.5] and w2.mean() == 1.0
    with pytest.raises(ValueError, match="strategy"):
        sel.selection_weights(labels, selected, "greedy")
    with pytest.raises(ValueError, match="index"):
        sel.selection_weights(labels, np.array([10]), "balanced")


def test_selection_weights_mean_is_one_on_real_selections():
    x, labels, dist, _ = _clustered(seed=3)
    for strategy, kw in (("balanced", {"budget": 37}), ("equalize", {"ratio": 1.0})):
        res = select(strategy, x, labels, dist, within="random", **kw)
        w = sel.selection_weights(labels, res.indices, strategy)
        assert w.shape == res.indices.shape and abs(w.mean() - 1.0) < 1e-12


def test_run_equalize_reports_k_times_m():
    from ray_cluster_ft.config import ConfigError, parse_config

    x, labels, dist, _ = _clustered()  # sizes 40, 5, 25, 2, 60
    cfg = parse_config({"selection": {"strategy": "equalize", "ratio": 1.0, "within": "peripheral"},
                        "train": {"micro_batch_size": 2}})
    stage = sel.run(cfg, None, n_candidates=labels.size, sketches=x, labels=labels, dist=dist)
    assert stage.requested == 5 * 2 == stage.result.indices.size
    with pytest.raises(ConfigError, match="clustering"):
        sel.run(cfg, None, n_candidates=labels.size)
