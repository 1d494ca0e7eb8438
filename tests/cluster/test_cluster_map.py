"""Cluster maps reused across runs (``clustering.from_run``): the map saved by every clustering run, nearest-
centroid assignment in the map's metric, drift against its 95th-percentile distance, warm-started refits, and
the errors for a map that does not fit."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft import cluster as clustering
from ray_cluster_ft.cluster import ClusterMap, load_cluster_map
from ray_cluster_ft.cluster.cluster_map import drift, nearest_distances
from ray_cluster_ft.cluster.kmeans import refit_kmeans
from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.features.feature_store import feature_settings
from ray_cluster_ft.rundir import prepare_run_dir

from .test_clustering import planted_blobs


def _features(cfg, model="m1", normalisation=None):
    """A feature stage summary as :func:`ray_cluster_ft.features.stage.sketch_with_store` gives it."""
    of = {"settings": feature_settings(cfg.sketch), "model": model, "gpu": False}
    return {"feature_key": f"key-{model}", "feature_key_of": of, "normalisation": normalisation}


def _run(tmp_path, name, x, ids, clustering_cfg, features=None, sketch=None):
    cfg = parse_config({"clustering": clustering_cfg, "sketch": {"method": "sketch", **(sketch or {})}, "train": {"num_workers": 2}})
    run_dir = tmp_path / name
    prepare_run_dir(run_dir, resume=False)
    out = clustering.run(cfg, run_dir, example_ids=ids, sketches=x,
                         features=features if features is not None else _features(cfg))
    res, summary = out.result, out.summary
    return cfg, run_dir, res, summary


@pytest.fixture
def old_run(tmp_path):
    x, _truth = planted_blobs(n_centres=4, per=50, d=16, seed=2)
    ids = np.asarray([f"id{i:03d}" for i in range(len(x))])
    _cfg, run_dir, res, summary = _run(tmp_path, "old", x, ids, {"k": 4})
    return x, ids, run_dir, res, summary


def test_every_run_saves_its_map_with_the_p95_distance(old_run):
    x, _ids, run_dir, res, summary = old_run
    cmap = load_cluster_map(run_dir)
    np.testing.assert_array_equal(cmap.centroids, res.centroids)
    assert cmap.algorithm == "spherical" and cmap.metric == "cosine"
    assert list(cmap.sizes) == np.bincount(res.labels).tolist()
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    near = 1.0 - (xn @ res.centroids.T).max(axis=1)  # nearest-centroid cosine distance, by hand
    assert cmap.p95_distance == pytest.approx(np.percentile(near, 95), rel=1e-5, abs=1e-7)
    assert summary["p95_distance"] == cmap.p95_distance
    assert cmap.features["model"] == "m1" and cmap.features["settings"]["seed"] == 0
    meta = pq.read_schema(run_dir / "centroids.parquet").metadata
    assert b"ray_cluster_ft" in meta


def test_from_run_assigns_the_same_rows_as_before_and_new_rows_to_the_nearest(tmp_path, old_run):
    x, ids, run_dir, res, _ = old_run
    rng = np.random.default_rng(5)
    extra = x[:20] + 0.01 * rng.normal(size=(20, x.shape[1])).astype(np.float32)  # near the first blob
    x2 = np.concatenate([x, extra])
    ids2 = np.concatenate([ids, [f"new{i}" for i in range(20)]])
    _, _, res2, summary = _run(tmp_path, "new", x2, ids2, {"from_run": str(run_dir)})
    np.testing.assert_array_equal(res2.labels[:len(x)], res.labels)  # the map's own rows: the same clusters
    assert (res2.labels[len(x):] == res.labels[0]).all()
    np.testing.assert_array_equal(res2.centroids, res.centroids)  # the map, not a new clustering
    fr = summary["from_run"]
    assert fr["map_k"] == 4 and fr["refit"] is False and fr["map_clusters"] == [0, 1, 2, 3]
    d = fr["drift"]
    assert (d["rows"], d["new_rows"]) == (220, 20) and d["suggest_recluster"] is False
    assert "drift_warning" not in summary


def test_rows_from_elsewhere_drift_and_the_report_suggests_reclustering(tmp_path, old_run):
    from ray_cluster_ft.pipeline.report import _cluster_map_lines

    x, ids, run_dir, _, _ = old_run
    far, _ = planted_blobs(n_centres=1, per=30, d=16, seed=99)  # another direction altogether
    x2 = np.concatenate([x, far])
    ids2 = np.concatenate([ids, [f"far{i}" for i in range(30)]])
    _, _, _, summary = _run(tmp_path, "new", x2, ids2, {"from_run": str(run_dir), "max_drift": 0.2})
    d = summary["from_run"]["drift"]
    assert d["new_rows"] == 30 and d["share_new_beyond_p95"] > 0.9 and d["suggest_recluster"] is True
    assert "clustering.max_drift=0.2" in summary["drift_warning"]
    text = "\n".join(_cluster_map_lines(summary))
    assert "## Reused cluster map" in text and "Re-clustering suggested" in text


def test_known_rows_keep_their_cluster_new_rows_take_the_nearest():
    from ray_cluster_ft.cluster.cluster_map import cluster_from_map

    cent = np.asarray([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    cmap = ClusterMap(cent, np.asarray([2, 2]), "spherical", 0.05, {})
    x = np.asarray([[1, 0.1], [0.9, 0.2], [0.2, 1], [0.1, 1], [0.8, 0.3], [0.3, 0.8]], dtype=np.float32)
    # Row 1 was in cluster 1 in the map's run (k-means stopped before moving it): it stays there.
    res = cluster_from_map(x, cmap, np.asarray([0, 1, 1, 1, -1, -1]), min_cluster_size=1)
    assert res.labels.tolist() == [0, 1, 1, 1, 0, 1]
    d = res.from_run["drift"]
    assert d["new_rows"] == 2 and d["new_beyond_p95"] == 2  # 1 - cos > 0.05 for both new rows
    with pytest.raises(ValueError, match="values below 2"):
        cluster_from_map(x, cmap, np.asarray([0, 1, 2, 1, -1, -1]))


def test_drift_by_hand():
    d = drift(np.asarray([0.1, 0.5, 0.9, 0.2]), 0.4, np.asarray([True, True, False, True]), 0.2)
    assert (d["new_rows"], d["new_beyond_p95"]) == (3, 1)
    assert d["share_new_beyond_p95"] == pytest.approx(1 / 3) and d["share_all_beyond_p95"] == 0.5
    assert d["suggest_recluster"] is True
    none_new = drift(np.asarray([0.9]), 0.4, np.asarray([False]), 0.2)
    assert none_new["share_new_beyond_p95"] is None and none_new["suggest_recluster"] is False


def test_kmeans_map_uses_squared_euclidean_distance(tmp_path):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(40, 3)), rng.normal(size=(40, 3)) + 6]).astype(np.float32)
    ids = np.asarray([f"id{i}" for i in range(80)])
    _, run_dir, _res, _ = _run(tmp_path, "old", x, ids, {"k": 2, "algorithm": "kmeans"})
    cmap = load_cluster_map(run_dir)
    assert cmap.metric == "sqeuclidean"
    # A point far out along a centroid's direction: cosine would put it anywhere on that ray, Euclidean near.
    new = np.asarray([[3.0, 3.0, 3.0], [0.1, -0.2, 0.3]], dtype=np.float32)
    lab, dist = nearest_distances(new, cmap.centroids, "sqeuclidean")
    ref = ((new[:, None, :] - cmap.centroids[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(lab, ref.argmin(1))
    np.testing.assert_allclose(dist, ref.min(1), rtol=1e-5)
    _, _, res2, _summary = _run(tmp_path, "new", np.concatenate([x, new]), np.append(ids, ["n0", "n1"]),
                               {"from_run": str(run_dir), "algorithm": "kmeans"})
    assert res2.algorithm == "kmeans"
    np.testing.assert_array_equal(res2.labels[80:], ref.argmin(1))
    np.testing.assert_allclose(res2.dist[80:], ref.min(1), rtol=1e-5)


def test_refit_warm_starts_kmeans_from_the_map(tmp_path, old_run):
    from sklearn.cluster import KMeans

    x, ids, run_dir, res, _ = old_run
    shifted = x + 0.3 * np.roll(x, 1, axis=1)  # the same rows, moved: the map's centroids are a start, not the end
    _, _, res2, summary = _run(tmp_path, "refit", shifted, ids, {"from_run": str(run_dir), "refit": True})
    assert summary["from_run"]["refit"] is True
    xn = shifted / np.linalg.norm(shifted, axis=1, keepdims=True)
    ref = KMeans(n_clusters=4, init=res.centroids, n_init=1, random_state=0, algorithm="lloyd").fit(xn)
    np.testing.assert_array_equal(res2.labels, ref.labels_)
    means = np.stack([xn[ref.labels_ == j].mean(0) for j in range(4)])
    np.testing.assert_allclose(res2.centroids, means / np.linalg.norm(means, axis=1, keepdims=True), atol=1e-5)
    labels, _cent = refit_kmeans(shifted, res.centroids, "kmeans")
    ref_e = KMeans(n_clusters=4, init=res.centroids, n_init=1, random_state=0).fit(shifted)
    np.testing.assert_array_equal(labels, ref_e.labels_)
    with pytest.raises(ValueError, match="more than the 3 rows"):
        refit_kmeans(xn[:3], res.centroids, "spherical")


def test_a_map_that_does_not_fit_is_refused_by_name(tmp_path, old_run):
    x, ids, run_dir, _, _ = old_run
    with pytest.raises(ConfigError, match="no such directory"):
        _run(tmp_path, "a", x, ids, {"from_run": str(tmp_path / "nowhere")})
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not a ray-cluster-ft run directory"):
        _run(tmp_path, "b", x, ids, {"from_run": str(tmp_path / "plain")})
    bare = tmp_path / "bare"
    prepare_run_dir(bare, resume=False)
    with pytest.raises(ConfigError, match=r"holds no cluster map \(centroids.parquet\)"):
        _run(tmp_path, "c", x, ids, {"from_run": str(bare)})
    with pytest.raises(ConfigError, match="features of dimension 8, the map's centroids of dimension 16"):
        _run(tmp_path, "d", x[:, :8], ids, {"from_run": str(run_dir)})
    with pytest.raises(ConfigError, match=r"sketch.dim 128, the map.s 256; sketch.seed 3, the map.s 0"):
        _run(tmp_path, "e", x, ids, {"from_run": str(run_dir)}, sketch={"seed": 3, "dim": 128})
    cfg = parse_config({})
    with pytest.raises(ConfigError, match="features from another model"):
        _run(tmp_path, "f", x, ids, {"from_run": str(run_dir)}, features=_features(cfg, model="m2"))
    with pytest.raises(ConfigError, match="clustering.algorithm 'kmeans', the map's 'spherical'"):
        _run(tmp_path, "g", x, ids, {"from_run": str(run_dir), "algorithm": "kmeans"})
    with pytest.raises(ConfigError, match="feature normalisation 'l2_rows', the map's None"):
        _run(tmp_path, "h", x, ids, {"from_run": str(run_dir)}, features=_features(cfg, normalisation="l2_rows"))


def test_refit_without_a_map_is_refused():
    with pytest.raises(ValueError, match="set clustering.from_run"):
        parse_config({"clustering": {"refit": True}})


def test_select_and_plan_api_reads_the_map_too(old_run):
    from ray_cluster_ft.cluster import cluster_with_config

    x, ids, run_dir, res, _ = old_run
    cfg = parse_config({"clustering": {"from_run": str(run_dir)}, "sketch": {"method": "sketch"}, "train": {"num_workers": 2}})
    res2, table = cluster_with_config(cfg, ids, x)  # no feature summary: size and settings are still checked
    np.testing.assert_array_equal(res2.labels, res.labels)
    assert table.column("cluster").to_pylist() == res.labels.tolist()
    assert isinstance(load_cluster_map(run_dir), ClusterMap)
