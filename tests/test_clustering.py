"""Spherical k-means, the auto-k rule and small-cluster merging (ray_cluster_ft.clustering)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from ray_cluster_ft import clustering
from ray_cluster_ft.clustering import auto_k, cluster_sketches, merge_small_clusters, spherical_kmeans


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
    monkeypatch.setattr(clustering, "MINIBATCH_THRESHOLD", 100)
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
