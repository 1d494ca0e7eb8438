"""Hierarchical balanced sampling (``selection.groups``): the budget is shared between groups of similar
clusters first, then between the clusters of each group."""

from __future__ import annotations

import numpy as np
import pytest

from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.select.quotas import cluster_groups, group_quotas, select, water_fill_quotas


def _two_kinds(seed: int = 0):
    """Rows of two kinds far apart: kind A split over three nearby clusters (60 rows each), kind B one
    cluster of 20 rows. Returns (x (200, 16), labels (200,), dist (200,))."""
    rng = np.random.default_rng(seed)
    a, b = np.zeros(16), np.zeros(16)
    a[0], b[1] = 1.0, 1.0
    centres = [a + 0.25 * np.eye(16)[2 + j] for j in range(3)] + [b]
    sizes = [60, 60, 60, 20]
    x = np.concatenate([c + 0.03 * rng.standard_normal((n, 16)) for c, n in zip(centres, sizes)])
    labels = np.repeat(np.arange(4), sizes)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    cent = np.stack([xn[labels == c].mean(0) for c in range(4)])
    cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    dist = 1.0 - np.einsum("ij,ij->i", xn, cent[labels])
    return x.astype(np.float32), labels, dist.astype(np.float32)


def test_group_quotas_share_between_groups_then_clusters():
    # groups' totals 30 and 2: budget 8 -> 6 and 2 (the small group whole), then 2 + 2 + 2 inside group 0
    assert group_quotas([10, 10, 10, 2], [0, 0, 0, 1], 8).tolist() == [2, 2, 2, 2]
    assert group_quotas([10, 10, 10, 2], [0, 0, 0, 1], 20).tolist() == [6, 6, 6, 2]
    # two groups of two: 9 between totals 12 and 12 -> 5 (the lower group index gets the extra one) and 4
    assert group_quotas([6, 6, 10, 2], [0, 0, 1, 1], 9).tolist() == [3, 2, 2, 2]
    # one group is plain water-filling
    s = np.array([5, 17, 3, 40])
    assert group_quotas(s, [0, 0, 0, 0], 30).tolist() == water_fill_quotas(s, 30).tolist()
    with pytest.raises(ValueError):
        group_quotas([1, 2], [0], 2)


def test_auto_groups_find_the_two_kinds_and_an_int_cuts_the_same_tree():
    x, labels, _ = _two_kinds()
    assert cluster_groups(x, labels, "auto").tolist() == [0, 0, 0, 1]
    assert cluster_groups(x, labels, 2).tolist() == [0, 0, 0, 1]
    assert cluster_groups(x, labels, 1).tolist() == [0, 0, 0, 0]
    assert sorted(set(cluster_groups(x, labels, 4).tolist())) == [0, 1, 2, 3]
    with pytest.warns(UserWarning, match=r"selection.groups=99 is more than the 4 clusters"):
        assert cluster_groups(x, labels, 99).tolist() == cluster_groups(x, labels, 4).tolist()  # capped at k
    with pytest.raises(ValueError):
        cluster_groups(x, labels, 0)
    with pytest.raises(ValueError):
        cluster_groups(x, np.where(labels == 1, 2, labels), "auto")  # cluster 1 empty


def test_balanced_with_groups_gives_each_kind_half_the_budget():
    x, labels, dist = _two_kinds()
    flat = select("balanced", x, labels, dist, budget=40, within="random", seed=3)
    grouped = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups="auto")
    # flat: 10 per cluster, so kind B (one cluster of four) gets a quarter; grouped: B gets 20 = all its rows
    assert np.bincount(labels[flat.indices], minlength=4).tolist() == [10, 10, 10, 10]
    assert np.bincount(labels[grouped.indices], minlength=4).tolist() == [7, 7, 6, 20]
    assert grouped.groups.tolist() == [0, 0, 0, 1] and flat.groups is None
    assert grouped.quotas.tolist() == [7, 7, 6, 20]
    again = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups="auto")
    assert again.indices.tolist() == grouped.indices.tolist()
    one = select("balanced", x, labels, dist, budget=40, within="random", seed=3, groups=1)
    assert one.indices.tolist() == flat.indices.tolist()


def test_groups_with_a_token_budget_share_tokens_between_groups():
    x, labels, dist = _two_kinds()
    nt = np.where(labels == 3, 50, 10).astype(np.int64)  # kind B: 20 rows x 50 tokens = 1,000 tokens
    res = select("balanced", x, labels, dist, within="random", seed=0, n_tokens=nt, budget_tokens=800,
                 groups="auto")
    by_group = [int(nt[res.indices][labels[res.indices] < 3].sum()), int(nt[res.indices][labels[res.indices] == 3].sum())]
    # 400 tokens a group; inside group A 134 + 133 + 133, of which whole 10-token rows fill 130 each
    assert res.token_quotas.tolist() == [134, 133, 133, 400]
    assert by_group == [390, 400]


def test_groups_config_is_checked():
    base = {"selection": {"strategy": "balanced", "groups": "auto"}}
    assert parse_config(base).selection.groups == "auto"
    assert parse_config({"selection": {"groups": 3}}).selection.groups == 3
    # auto is the default (issue 31): other strategies ignore it, and refuse a count (a saved config.yaml holds
    # every key, so the default itself must load with any strategy)
    assert parse_config({}).selection.groups == "auto"
    for strategy in ("random", "full", "equalize"):
        assert parse_config({"selection": {"strategy": strategy}}).selection.groups == "auto"
        assert parse_config({"selection": {"strategy": strategy, "groups": None}}).selection.groups is None
    with pytest.raises(ConfigError, match="groups"):
        parse_config({"selection": {"strategy": "random", "groups": 3}})
    with pytest.raises(ConfigError, match="groups"):
        parse_config({"selection": {"groups": 0}})
    with pytest.raises(ConfigError, match="groups"):
        parse_config({"selection": {"groups": "many"}})


def test_groups_from_the_sums_and_the_sample_are_the_groups_of_the_rows():
    """The streamed selection finds the groups from per-shard sums of unit rows and the silhouette sample's rows
    (:func:`groups_from_sums`); over a pool above the 2,048-row sample that is the in-memory grouping."""
    from ray_cluster_ft.select.quotas import groups_from_sums, silhouette_rows, unit_rows64

    x, labels, _ = _two_kinds(1)
    x = np.concatenate([x] * 12) * np.random.default_rng(2).uniform(0.5, 2.0, (2400, 1)).astype(np.float32)
    labels = np.concatenate([labels] * 12)
    rows = silhouette_rows(labels.size, seed=5)
    assert rows.size == 2048 and np.all(np.diff(rows) > 0) and np.array_equal(rows, silhouette_rows(2400, 5))
    xn = unit_rows64(x)
    sums = sum(np.stack([xn[lo:lo + 600][labels[lo:lo + 600] == c].sum(0) for c in range(4)])
               for lo in range(0, 2400, 600))  # four "shards" summed apart, as the streamed tasks do
    want = cluster_groups(x, labels, "auto", seed=5)
    assert want.tolist() == [0, 0, 0, 1]
    assert groups_from_sums(sums, xn[rows], labels[rows], "auto").tolist() == want.tolist()
    assert groups_from_sums(sums, None, None, 1).tolist() == [0, 0, 0, 0]
    # the selection takes groups computed already, one per cluster
    res = select("balanced", None, labels, np.zeros(2400), 100, within="random", groups=want)
    assert res.groups.tolist() == want.tolist() and np.bincount(want[labels[res.indices]]).tolist() == [50, 50]
    with pytest.raises(ValueError, match="one group per cluster"):
        select("balanced", None, labels, np.zeros(2400), 100, within="random", groups=np.zeros(3, np.int64))


def test_cluster_groups_sums_rows_a_chunk_at_a_time_exactly_as_all_at_once(monkeypatch):
    """Above ``_SUM_CHUNK`` rows :func:`cluster_groups` normalises and sums a chunk at a time (no float64 copy of
    every row): the per-cluster sums and the silhouette sample it hands on are bit-identical to one ``np.add.at``
    over all unit rows."""
    import ray_cluster_ft.select.groups as groups_mod
    from ray_cluster_ft.select.quotas import silhouette_rows, unit_rows64

    rng = np.random.default_rng(3)
    n = 2 * groups_mod._SUM_CHUNK + 123
    labels = rng.integers(0, 5, n)
    x = (rng.standard_normal((5, 16))[labels] + 0.3 * rng.standard_normal((n, 16))).astype(np.float16)
    seen = {}
    real = groups_mod.groups_from_sums
    monkeypatch.setattr(groups_mod, "groups_from_sums",
                        lambda s, sample, lab, g: seen.update(sums=s, sample=sample) or real(s, sample, lab, g))
    got = groups_mod.cluster_groups(x, labels, "auto", seed=1)
    xn = unit_rows64(x)
    want_sums = np.zeros((5, 16))
    np.add.at(want_sums, labels, xn)
    assert np.array_equal(seen["sums"], want_sums)
    assert np.array_equal(seen["sample"], xn[silhouette_rows(n, 1)])
    assert got.tolist() == real(want_sums, xn[silhouette_rows(n, 1)], labels[silhouette_rows(n, 1)], "auto").tolist()
