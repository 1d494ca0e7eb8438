"""The streamed clustering (Ray Data tasks over feature shards) against the in-memory clustering of the same rows:
the same samples give the same labels, centroids and distances."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.cluster import cluster_sketches
from ray_cluster_ft.cluster.passes import check_part, merge_plan
from ray_cluster_ft.cluster.stream import cluster_streamed
from ray_cluster_ft.features import feature_shards, read_shard
from ray_cluster_ft.features._shards import _to_arrow


def write_shards(tmp_path, x: np.ndarray, rows: int, dtype: str = "float16", n_tokens=None):
    """``x`` cut into Parquet shards of ``rows`` rows (:func:`_to_arrow`, as the sketch actors write them)."""
    n = x.shape[0]
    nt = np.full(n, 10) if n_tokens is None else n_tokens
    files = []
    for i, lo in enumerate(range(0, n, rows)):
        hi = min(n, lo + rows)
        batch = {"example_id": np.asarray([f"ex{j:06d}" for j in range(lo, hi)]), "sketch": x[lo:hi],
                 "loss": np.zeros(hi - lo, np.float32), "n_tokens": nt[lo:hi]}
        f = tmp_path / f"shard-{i:05d}.parquet"
        pq.write_table(_to_arrow(batch, dtype), f)
        files.append(str(f))
    return feature_shards(files)


def blobs(n: int, d: int = 16, centres: int = 12, seed: int = 0, spread=None) -> np.ndarray:
    """Rows around ``centres`` random directions, of unequal sizes (``spread``: the blob probabilities)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, d))
    p = np.ones(centres) / centres if spread is None else np.asarray(spread) / np.sum(spread)
    lab = rng.choice(centres, size=n, p=p)
    return (c[lab] + 0.5 * rng.standard_normal((n, d))).astype(np.float32)


def _in_memory(shards):
    return np.concatenate([read_shard(f)["sketch"] for f in shards.files])


@pytest.mark.parametrize("min_size", [2, 400])
def test_streamed_labels_equal_the_in_memory_ones_for_the_same_sample(ray_cpu, tmp_path, min_size):
    spread = [30, 30, 20, 20, 10, 10, 5, 5, 2, 1, 1, 1]
    shards = write_shards(tmp_path, blobs(12_000, spread=spread), rows=1_500)
    x = _in_memory(shards)  # the float16 shards read back: both paths see the same float32 rows
    fit = {"fit_rows": 3_000, "minibatch_rows": 5_000}
    ref = cluster_sketches(x, 24, 2, seed=5, min_cluster_size=min_size, **fit)
    got, near, nodes = cluster_streamed(shards, 24, 2, seed=5, min_cluster_size=min_size, **fit)
    if min_size == 400:
        assert ref.n_merged_clusters > 0  # the merge pass ran
    assert (got.k, got.n_merged_clusters) == (ref.k, ref.n_merged_clusters)
    np.testing.assert_array_equal(got.labels, ref.labels)
    np.testing.assert_array_equal(got.centroids, ref.centroids)
    np.testing.assert_allclose(got.dist, ref.dist, atol=1e-6)
    assert near.shape == (12_000,) and (near <= got.dist + 1e-6).all()
    assert sum(nodes.values()) == 8 * (3 if min_size == 2 else 4)  # 8 shards x (check, assign, [relabel], distance)


def test_a_small_job_gathers_every_row_and_clusters_them_in_memory(ray_cpu, tmp_path):
    shards = write_shards(tmp_path, blobs(900, seed=1), rows=200, dtype="float32")
    ref = cluster_sketches(_in_memory(shards), "auto", 4, seed=0)
    got, _, nodes = cluster_streamed(shards, "auto", 4, seed=0)
    np.testing.assert_array_equal(got.labels, ref.labels)
    np.testing.assert_array_equal(got.dist, ref.dist)
    assert sum(nodes.values()) == 5  # one pass (validation and the rows)


def test_bad_rows_in_a_shard_are_refused_with_their_position(ray_cpu, tmp_path):
    x = blobs(3_000, seed=2)
    x[2_345] = 0.0
    shards = write_shards(tmp_path, x, rows=1_000, dtype="float32")
    with pytest.raises(ValueError, match="all-zero rows .first: row 2345"):
        cluster_streamed(shards, 8, 1, fit_rows=500, minibatch_rows=1_000)


def test_the_pure_pieces():
    assert check_part(np.eye(3, dtype=np.float32)) is True
    assert check_part(2 * np.eye(3, dtype=np.float32)) is False
    with pytest.raises(ValueError, match="NaN or inf"):
        check_part(np.asarray([[np.nan, 1.0]], dtype=np.float32))
    new_id, merged = merge_plan(np.asarray([5, 1, 0, 7]), 2)
    assert new_id.tolist() == [0, -1, -1, 1] and merged == 2
    assert merge_plan(np.asarray([1, 1, 0]), 5)[0].tolist() == [0, -1, -1]  # none reaches 5: the largest stays
