"""Spherical k-means, the auto-k rule and small-cluster merging (ray_cluster_ft.cluster)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from ray_cluster_ft import cluster as clustering
from ray_cluster_ft.cluster import _vectors, kmeans
from ray_cluster_ft.cluster import auto_k, cluster_sketches, spherical_kmeans
from ray_cluster_ft.cluster.kmeans import merge_small_clusters


def _stage_run(*args, **kwargs):
    """The cluster stage's result and summary."""
    out = clustering.run(*args, **kwargs)
    return out.result, out.summary


def planted_blobs(n_centres=8, per=100, d=32, noise=0.15, seed=0):
    """Points around random unit centres, scaled by random positive factors (direction is what counts)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_centres, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    truth = np.repeat(np.arange(n_centres), per)
    x = centres[truth] + noise * rng.normal(size=(truth.size, d)) / np.sqrt(d)
    x *= rng.uniform(0.5, 3.0, size=(truth.size, 1))
    return x.astype(np.float32), truth


def test_auto_k_rule():
    assert auto_k(1_000, 1) == 10  # sqrt(1000 / 10)
    assert auto_k(10_000, 2) == 32
    assert auto_k(100_000, 8) == 100
    assert auto_k(1_000_000, 8) == 100  # capped
    assert auto_k(1_000, 8) == 16  # at least 2 * world_size
    assert auto_k(5, 8) == 5  # never above n
    with pytest.raises(ValueError):
        auto_k(0, 1)
    with pytest.raises(ValueError):
        auto_k(10, 0)


def test_planted_clusters_recovered():
    x, truth = planted_blobs()
    labels, dist, centroids = spherical_kmeans(x, 8, seed=0)
    assert labels.dtype == np.int32 and dist.dtype == np.float32 and centroids.dtype == np.float32
    assert adjusted_rand_score(truth, labels) >= 0.9
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, atol=1e-5)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    expected = 1.0 - np.sum(xn * centroids[labels], axis=1)
    np.testing.assert_allclose(dist, expected, atol=1e-5)
    # Each point's own centroid is (essentially) its nearest one: the spherical assignment holds.
    nearest = np.argmax(xn @ centroids.T, axis=1)
    assert np.mean(nearest == labels) > 0.99


def test_minibatch_path_recovers_clusters(monkeypatch):
    monkeypatch.setattr(kmeans, "MINIBATCH_THRESHOLD", 100)
    x, truth = planted_blobs(per=150, seed=3)
    labels, dist, centroids = spherical_kmeans(x, 8, seed=1)
    assert adjusted_rand_score(truth, labels) >= 0.9
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, atol=1e-5)
    assert dist.min() >= 0.0 and dist.max() <= 2.0


def test_same_seed_same_labels():
    x, _ = planted_blobs(seed=5)
    a = spherical_kmeans(x, 6, seed=7)
    b = spherical_kmeans(x, 6, seed=7)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "x, k, match",
    [
        (np.ones((5, 3)), 6, "more than"),
        (np.ones((5, 3)), 0, ">= 1"),
        (np.ones(5), 1, "2-D"),
        (np.array([[1.0, np.nan], [1.0, 0.0]]), 1, "NaN"),
        (np.array([[1.0, np.inf], [1.0, 0.0]]), 1, "NaN or inf"),
        (np.array([[0.0, 0.0], [1.0, 0.0]]), 1, "all-zero"),
    ],
)
def test_spherical_kmeans_rejects_bad_input(x, k, match):
    with pytest.raises(ValueError, match=match):
        spherical_kmeans(x, k)


def test_merge_small_clusters_moves_members_to_nearest_surviving_centroid():
    # Clusters: 0 around +e0 (4 points), 1 around +e1 (4 points), 2 a single point near +e1, 3 empty.
    x = np.array(
        [[1, 0.05, 0], [1, -0.05, 0], [1, 0, 0.05], [1, 0, -0.05],
         [0.05, 1, 0], [-0.05, 1, 0], [0, 1, 0.05], [0, 1, -0.05],
         [0.2, 1, 0.3]],
        dtype=np.float32,
    )
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2])
    centroids = np.array([[1, 0, 0], [0, 1, 0], [0.2, 1, 0.3], [0, 0, 1]], dtype=np.float32)
    new, n_merged = merge_small_clusters(x, labels, centroids, min_size=2)
    assert n_merged == 2  # the singleton and the empty cluster
    np.testing.assert_array_equal(new, [0, 0, 0, 0, 1, 1, 1, 1, 1])
    assert new.dtype == np.int32
    # min_size 1 only removes empty clusters; labels stay contiguous.
    new1, n1 = merge_small_clusters(x, labels, centroids, min_size=1)
    assert n1 == 1
    np.testing.assert_array_equal(new1, labels)


def test_merge_keeps_largest_when_all_small():
    x = np.eye(3, dtype=np.float32)
    new, n_merged = merge_small_clusters(x, np.array([0, 1, 1]), np.eye(3, dtype=np.float32)[:2], min_size=5)
    assert n_merged == 1
    np.testing.assert_array_equal(new, [0, 0, 0])


def test_cluster_sketches_merges_and_recomputes():
    x, truth = planted_blobs(n_centres=4, per=50, d=16, seed=2)
    # Two isolated points become clusters of their own at k=6 and must be merged away at min size 3.
    rng = np.random.default_rng(9)
    outliers = rng.normal(size=(2, 16)).astype(np.float32)
    xs = np.concatenate([x, outliers])
    res = cluster_sketches(xs, k=6, world_size=2, seed=0, min_cluster_size=3)
    sizes = np.bincount(res.labels)
    assert res.k == sizes.size == res.centroids.shape[0]
    assert sizes.min() >= 3
    assert res.n_merged_clusters == 6 - res.k
    assert adjusted_rand_score(truth, res.labels[: truth.size]) >= 0.9
    xn = xs / np.linalg.norm(xs, axis=1, keepdims=True)
    np.testing.assert_allclose(res.dist, 1.0 - np.sum(xn * res.centroids[res.labels], axis=1), atol=1e-5)


def test_cluster_sketches_auto_k():
    x, _ = planted_blobs(n_centres=8, per=100, seed=4)
    res = cluster_sketches(x, k="auto", world_size=2, seed=0, min_cluster_size=1)
    assert res.k == auto_k(800, 2) == 9
    with pytest.raises(ValueError, match="auto"):
        cluster_sketches(x, k="many")


# --- the published clustering: Euclidean k-means, k = world size, the soft cap ----------------------------------


def _published_soft_cap(x, centroids, ratio, metric="sqeuclidean", topk=8, weights=None):
    """Brute-force reference: the sequential loops of the published kmeans_soft_cap_fit_predict
    (kaist-dmlab/CluSTER src/CluSTER/call_back.py), one pair at a time, on the same distance matrix.
    ``weights``: a point adds its weight to its cluster's load instead of 1 (``cap_by: tokens``)."""
    from fractions import Fraction

    n, k = x.shape[0], centroids.shape[0]
    w = np.ones(n, dtype=int) if weights is None else np.asarray(weights)
    cap = -(-Fraction(repr(ratio)) * int(w.sum()) // k)  # ceil(ratio * load / k) on the decimal ratio
    dmat = _vectors._centre_distances(np.asarray(x, np.float32), np.asarray(centroids, np.float32), metric)
    t = min(topk, k)
    nn_idx = np.argsort(dmat, axis=1, kind="stable")[:, :t]
    nn_dist = np.take_along_axis(dmat, nn_idx, axis=1)
    pairs_i, pairs_r = np.repeat(np.arange(n), t), np.tile(np.arange(t), n)
    order = np.argsort(nn_dist[pairs_i, pairs_r], kind="mergesort")
    labels, counts = -np.ones(n, dtype=int), np.zeros(k, dtype=int)
    for i, r in zip(pairs_i[order], pairs_r[order]):
        j = nn_idx[i, r]
        if labels[i] == -1 and counts[j] < cap:
            labels[i], counts[j] = j, counts[j] + w[i]
    for i in np.flatnonzero(labels == -1):
        for j in np.argsort(dmat[i], kind="stable"):
            if counts[j] < cap:
                labels[i], counts[j] = j, counts[j] + w[i]
                break
    return labels, cap


def test_kmeans_path_equals_sklearn_and_keeps_small_clusters():
    from sklearn.cluster import KMeans

    x, _ = planted_blobs(n_centres=4, per=40, d=8, seed=6)
    x = np.concatenate([x, np.full((1, 8), 50.0, dtype=np.float32)])  # an outlier: its own cluster at k=5
    res = cluster_sketches(x, k=5, seed=3, min_cluster_size=3, algorithm="kmeans")
    km = KMeans(n_clusters=5, n_init=10, random_state=3).fit(x)
    np.testing.assert_array_equal(res.labels, km.labels_)
    np.testing.assert_array_equal(res.centroids, km.cluster_centers_.astype(np.float32))
    expect = np.sum((x - km.cluster_centers_[km.labels_].astype(np.float32)) ** 2, axis=1)
    np.testing.assert_allclose(res.dist, expect, rtol=1e-5)
    assert res.labels.dtype == np.int32 and res.dist.dtype == np.float32
    # The published method keeps its k clusters: the singleton is not merged despite min_cluster_size=3.
    assert (res.k, res.n_merged_clusters, res.algorithm, res.cap) == (5, 0, "kmeans", None)
    assert np.bincount(res.labels).min() == 1


def test_soft_cap_on_a_lopsided_input_by_hand():
    # Centroids at (0,0), (10,0), (0,10); 20 points on the x axis near the first, 2 near each other one.
    # cap = ceil(1.5 * 24 / 3) = 12: the 12 points nearest (0,0) keep it, the other 8 take their second
    # choice (10,0) when their pair comes up; the small clusters keep their own points.
    line = np.stack([0.1 * np.arange(20), np.zeros(20)], axis=1)
    x = np.concatenate([line, [[10, 0.5], [10, -0.5], [0.5, 10], [-0.5, 10]]]).astype(np.float32)
    c = np.array([[0, 0], [10, 0], [0, 10]], dtype=np.float32)
    labels, cap = clustering.soft_cap_labels(x, c, 1.5)
    assert cap == 12
    np.testing.assert_array_equal(labels, [0] * 12 + [1] * 8 + [1, 1, 2, 2])
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels, _published_soft_cap(x, c, 1.5)[0])


@pytest.mark.parametrize("metric", ["sqeuclidean", "cosine"])
def test_soft_cap_matches_the_published_loop(metric):
    rng = np.random.default_rng(11)
    for trial in range(25):
        n, k, d = int(rng.integers(10, 150)), int(rng.integers(2, 14)), int(rng.integers(2, 5))
        x = rng.normal(size=(n, d))
        x[: n // 2] = 0.1 * x[: n // 2] + 2.0  # one crowded region
        if trial % 3 == 0:
            x = np.round(x)  # exact ties between pairs
        c = rng.normal(size=(k, d))
        if metric == "cosine":
            x = x + 1e-3  # no zero rows
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            c /= np.linalg.norm(c, axis=1, keepdims=True)
        ratio = float(rng.choice([1.01, 1.2, 1.5, 3.0]))
        topk = int(rng.integers(1, 9))  # small topk forces the full-search fallback
        got, cap = clustering.soft_cap_labels(x.astype(np.float32), c.astype(np.float32), ratio, metric, topk)
        want, want_cap = _published_soft_cap(x, c, ratio, metric, topk)
        assert cap == want_cap
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        assert np.bincount(got, minlength=k).max() <= cap


@pytest.mark.parametrize("metric", ["sqeuclidean", "cosine"])
def test_token_weighted_cap_matches_the_sequential_loop(metric):
    # cap_by: tokens: the same greedy loop with each point's tokens as its load.
    rng = np.random.default_rng(12)
    for trial in range(25):
        n, k, d = int(rng.integers(10, 150)), int(rng.integers(2, 14)), int(rng.integers(2, 5))
        x = rng.normal(size=(n, d))
        x[: n // 2] = 0.1 * x[: n // 2] + 2.0
        if metric == "cosine":
            x = x + 1e-3
            x /= np.linalg.norm(x, axis=1, keepdims=True)
        c = x[rng.choice(n, size=k, replace=False)] + 0.01 * rng.normal(size=(k, d))
        if metric == "cosine":
            c /= np.linalg.norm(c, axis=1, keepdims=True)
        tokens = rng.integers(1, 600, size=n) * (1 + 9 * (np.arange(n) < n // 3))  # long rows crowd one region
        ratio, topk = float(rng.choice([1.05, 1.2, 1.5])), int(rng.integers(1, 9))
        got, cap = clustering.soft_cap_labels(x.astype(np.float32), c.astype(np.float32), ratio, metric, topk,
                                              weights=tokens)
        want, want_cap = _published_soft_cap(x, c, ratio, metric, topk, weights=tokens)
        assert cap == want_cap
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        load = np.bincount(got, weights=tokens, minlength=k)
        last = np.array([tokens[got == j].max() if (got == j).any() else 0 for j in range(k)])
        assert (load - last < cap).all()  # over the cap by less than one row


def test_token_cap_by_hand():
    # Two centroids on a line; four points near the first, one at the second; tokens 10, 10, 10, 170, 100, so
    # cap = ceil(1.2 * 300 / 2) = 180 tokens. A point is taken while its cluster's load is below the cap.
    x = np.array([[0.0], [0.1], [0.2], [0.3], [10.0]], dtype=np.float32)
    c = np.array([[0.0], [10.0]], dtype=np.float32)
    tokens = np.array([10, 10, 10, 170, 100])
    # Nearest first: loads 10, 20, 30, then the 170-token point is taken (30 < 180): nothing moves.
    labels, cap = clustering.soft_cap_labels(x, c, 1.2, weights=tokens)
    assert cap == 180
    np.testing.assert_array_equal(labels, [0, 0, 0, 0, 1])
    # The 170-token point nearest: 170, then a 10 (170 < 180) fills it to 180; the two farther points go to
    # their second choice. Counting points instead, cap = ceil(1.2 * 5 / 2) = 3 and only the farthest moves.
    x2 = np.array([[0.3], [0.1], [0.2], [0.0], [10.0]], dtype=np.float32)
    labels, _ = clustering.soft_cap_labels(x2, c, 1.2, weights=tokens)
    np.testing.assert_array_equal(labels, [1, 0, 1, 0, 1])
    labels, cap = clustering.soft_cap_labels(x2, c, 1.2)
    assert cap == 3
    np.testing.assert_array_equal(labels, [1, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="positive integers"):
        clustering.soft_cap_labels(x, c, 1.2, weights=np.array([1, 2, 0, 1, 1]))
    with pytest.raises(ValueError, match="positive integers"):
        clustering.soft_cap_labels(x, c, 1.2, weights=np.ones(4, dtype=int))


def test_kmeans_with_cap_is_kmeans_then_the_cap():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=(300, 4)), rng.normal(size=(40, 4)) + 8]).astype(np.float32)
    res = cluster_sketches(x, k=4, seed=1, algorithm="kmeans", max_cluster_ratio=1.2)
    labels0, _, centres = clustering.euclidean_kmeans(x, 4, seed=1)
    assert np.bincount(labels0).max() > 1.2 * 340 / 4  # the cap fired
    want, cap = clustering.soft_cap_labels(x, centres, 1.2)
    assert res.cap == cap == 102
    np.testing.assert_array_equal(res.labels, want)
    np.testing.assert_array_equal(res.centroids, centres)  # not refitted
    np.testing.assert_allclose(res.dist, np.sum((x - centres[want]) ** 2, axis=1), rtol=1e-5)
    assert np.bincount(res.labels).max() <= cap


def test_spherical_cap_uses_cosine_and_fires_only_when_needed():
    x, _ = planted_blobs(n_centres=4, per=30, d=16, seed=8)
    big, _ = planted_blobs(n_centres=1, per=200, d=16, seed=9)
    xs = np.concatenate([x, big])
    plain = cluster_sketches(xs, k=4, seed=0, min_cluster_size=1)
    capped = cluster_sketches(xs, k=4, seed=0, min_cluster_size=1, max_cluster_ratio=1.2)
    assert plain.cap is None and np.bincount(plain.labels).max() > 1.2 * xs.shape[0] / 4
    assert capped.cap == -(-12 * xs.shape[0] // 40)  # ceil(1.2 * N / 4)
    assert np.bincount(capped.labels).max() <= capped.cap
    np.testing.assert_array_equal(capped.centroids, plain.centroids)
    xn = xs / np.linalg.norm(xs, axis=1, keepdims=True)
    want, _ = clustering.soft_cap_labels(xn, plain.centroids, 1.2, "cosine")
    np.testing.assert_array_equal(capped.labels, want)
    np.testing.assert_allclose(capped.dist, 1.0 - np.sum(xn * plain.centroids[want], axis=1), atol=1e-5)
    # A loose cap that nothing exceeds changes nothing.
    loose = cluster_sketches(xs, k=4, seed=0, min_cluster_size=1, max_cluster_ratio=10.0)
    assert loose.cap is None
    np.testing.assert_array_equal(loose.labels, plain.labels)
    np.testing.assert_array_equal(loose.dist, plain.dist)


def test_new_clustering_arguments_are_checked():
    x, _ = planted_blobs(n_centres=2, per=10, d=4)
    with pytest.raises(ValueError, match="algorithm"):
        cluster_sketches(x, k=2, algorithm="dbscan")
    with pytest.raises(ValueError, match="max_cluster_ratio"):
        cluster_sketches(x, k=2, max_cluster_ratio=1.0)
    with pytest.raises(ValueError, match="ratio"):
        clustering.soft_cap_labels(x, x[:2], 0.5)
    assert cluster_sketches(x, k="world_size", world_size=3, min_cluster_size=1).k == 3


def _stage(tmp_path, raw):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.rundir import prepare_run_dir

    prepare_run_dir(tmp_path / "run", resume=False)
    return parse_config(raw), tmp_path / "run"


def test_run_resolves_world_size_and_reports_the_algorithm(tmp_path):
    import pyarrow.parquet as pq

    x, _ = planted_blobs(n_centres=3, per=20, d=8, seed=1)
    ids = np.asarray([f"id{i}" for i in range(x.shape[0])])
    cfg, run_dir = _stage(tmp_path, {"clustering": {"k": "world_size"}, "train": {"num_workers": 3}})
    res, summary = _stage_run(cfg, run_dir, example_ids=ids, sketches=x)
    assert res.k == summary["k"] == 3 and summary["algorithm"] == "spherical"
    assert "capped" not in summary and "cap" not in summary
    table = pq.read_table(run_dir / "clusters.parquet")
    np.testing.assert_array_equal(table.column("cluster").to_numpy(), res.labels)


def test_run_reports_the_cap(tmp_path):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=(90, 4)), rng.normal(size=(10, 4)) + 9]).astype(np.float32)
    ids = np.asarray([f"id{i}" for i in range(100)])
    cfg, run_dir = _stage(tmp_path, {"clustering": {"k": "world_size", "algorithm": "kmeans",
                                                    "max_cluster_ratio": 1.1},
                                     "train": {"num_workers": 2}, "allocation": {"packing": False}})
    res, summary = _stage_run(cfg, run_dir, example_ids=ids, sketches=x)  # unpacked: cap_by auto counts rows
    assert summary["algorithm"] == "kmeans" and summary["capped"] is True and summary["cap"] == 55
    assert max(summary["sizes"]) <= 55 and sum(summary["sizes"]) == 100


def test_run_caps_tokens_when_packing(tmp_path):
    # The same lopsided data; the small cluster's rows are 10x longer, so it holds half the tokens. Counting
    # rows (cap 55) the 90-row cluster is cut; counting tokens (cap_by auto with packing: ceil(1.1 * 1800 / 2)
    # = 990 tokens) the long rows' cluster is over its share instead and the cap moves tokens, not rows.
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=(90, 4)), rng.normal(size=(10, 4)) + 9]).astype(np.float32)
    ids = np.asarray([f"id{i}" for i in range(100)])
    tokens = np.array([10] * 90 + [90] * 10)
    base = {"clustering": {"k": "world_size", "algorithm": "kmeans", "max_cluster_ratio": 1.1},
            "train": {"num_workers": 2, "max_tokens_per_micro_batch": 512}, "allocation": {"packing": True}}
    cfg, run_dir = _stage(tmp_path, base)
    res, summary = _stage_run(cfg, run_dir, example_ids=ids, sketches=x, n_tokens=tokens)
    plain = clustering.euclidean_kmeans(x, 2, seed=0)[0]
    load = np.bincount(plain, weights=tokens)
    assert load.max() <= 1.1 * tokens.sum() / 2  # 900 and 900 tokens: no cap fires, though the rows are 90/10
    assert "capped" not in summary
    np.testing.assert_array_equal(res.labels, plain)
    # Five more long rows in the small cluster: 1350 of 2250 tokens, above 1.1 x 2250 / 2 = 1237.5.
    x2 = np.concatenate([x, rng.normal(size=(5, 4)).astype(np.float32) + 9])
    tokens2 = np.concatenate([tokens, [90] * 5])
    ids2 = np.asarray([f"id{i}" for i in range(105)])
    cfg2, run2 = _stage(tmp_path / "b", base)
    res2, summary2 = _stage_run(cfg2, run2, example_ids=ids2, sketches=x2, n_tokens=tokens2)
    assert summary2["capped"] is True and summary2["cap_by"] == "tokens" and summary2["cap"] == 1238
    load2 = np.bincount(res2.labels, weights=tokens2)
    assert (load2 - 90 < 1238).all() and load2.max() < 1350
    c2 = clustering.euclidean_kmeans(x2, 2, seed=0)[2]
    want, _ = clustering.soft_cap_labels(x2, c2, 1.1, weights=tokens2)
    np.testing.assert_array_equal(res2.labels, want)
    # cap_by: rows keeps the published cap: 58 rows at most (ceil(1.1 * 105 / 2)).
    cfg3, run3 = _stage(tmp_path / "c", {**base, "clustering": {**base["clustering"], "cap_by": "rows"}})
    _, summary3 = _stage_run(cfg3, run3, example_ids=ids2, sketches=x2, n_tokens=tokens2)
    assert summary3["cap_by"] == "rows" and summary3["cap"] == 58 and max(summary3["sizes"]) <= 58
    # Tokens are needed to count them.
    cfg4, run4 = _stage(tmp_path / "d", base)
    with pytest.raises(ValueError, match="pass n_tokens"):
        clustering.run(cfg4, run4, example_ids=ids2, sketches=x2)


def test_too_few_clusters_after_merging_is_refused_unless_shared_clusters_are_allowed(tmp_path):
    from ray_cluster_ft.config import ConfigError, parse_config
    from ray_cluster_ft.rundir import prepare_run_dir

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(40, 8)) + 5, rng.normal(size=(3, 8)) - 5]).astype(np.float32)
    ids = np.array([f"e{i}" for i in range(len(x))])
    spec = {"clustering": {"k": 2, "min_cluster_size": 10}, "train": {"num_workers": 2}}
    prepare_run_dir(tmp_path / "a", resume=False)
    with pytest.raises(ConfigError, match=r"1 cluster after merging 1 clusters smaller than "
                                          r"clustering.min_cluster_size=10, fewer than the 2 ranks.*"
                                          r"allocation.allow_shared_clusters: true"):
        clustering.run(parse_config(spec), tmp_path / "a", example_ids=ids, sketches=x)
    prepare_run_dir(tmp_path / "b", resume=False)
    res, summary = _stage_run(parse_config({**spec, "allocation": {"allow_shared_clusters": True}}),
                                  tmp_path / "b", example_ids=ids, sketches=x)
    assert res.k == 1 and summary["warning"].startswith("1 cluster after merging")
    prepare_run_dir(tmp_path / "c", resume=False)
    per_rank = {**spec, "allocation": {"strategy": "cluster_per_rank"}}
    with pytest.raises(ConfigError, match="'cluster_per_rank' needs 2 clusters .* but clustering left 1 after"):
        clustering.run(parse_config(per_rank), tmp_path / "c", example_ids=ids, sketches=x)
