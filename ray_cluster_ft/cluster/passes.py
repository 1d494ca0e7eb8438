"""The streamed spherical clustering's per-shard work and the driver's steps between the passes (pure).

Above ``sketch.stream_rows`` the features stay in their shards (:mod:`ray_cluster_ft.cluster.stream` runs these
functions over them as Ray Data tasks). Each function is the piece of :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`
(``algorithm: spherical``, no cap) that touches rows, written for one shard at a time, so the streamed
clustering gives the same labels as the in-memory one for the same samples: unit rows
(:func:`unit_part`), the nearest fitted centre and float64 cluster sums (:func:`assign_part`), the centroids
from the summed shards (:func:`centroids_from_parts`), which clusters a merge dissolves (:func:`merge_plan`), the
dissolved clusters' rows moved (:func:`relabel_part`) and each row's distance to its final centroid
(:func:`distance_part`). No Ray, no files.
"""

from __future__ import annotations

import numpy as np

from ._vectors import _as_matrix, _centroids_from_sums, _cluster_sums, _nearest_centroid, _own_distance, _row_norms

__all__ = [
    "assign_part",
    "centroids_from_parts",
    "check_part",
    "distance_part",
    "merge_plan",
    "relabel_part",
    "unit_part",
]


def check_part(x, first_row: int = 0) -> bool:
    """Validate one shard's rows as the in-memory clustering does (finite, no all-zero row) and say whether
    every row is already of unit norm (within 1e-6): :func:`unit_part` then leaves the rows as they are when every
    shard says so, as the in-memory ``_normalise_rows`` does for the whole matrix.

    Args:
        x: float (n, d) one shard's features.
        first_row: the shard's first row in candidate order (named in the errors).

    Raises:
        ValueError: NaN/inf or all-zero rows (the first one's candidate position named).
    """
    arr = _as_matrix(x, f"the features of rows {first_row}..")
    norms = _row_norms(arr)
    zero = norms <= np.finfo(np.float32).tiny
    if zero.any():
        raise ValueError(f"the features have all-zero rows (first: row {first_row + int(np.flatnonzero(zero)[0])}); a "
                         f"zero sketch has no direction to cluster by")
    return bool(np.all(np.abs(norms - 1.0) <= 1e-6))


def unit_part(x, all_unit: bool) -> np.ndarray:
    """One shard's rows as unit rows, float32 (n, d): as given when ``all_unit`` (every shard's :func:`check_part`),
    else divided by their norms, row by row as the in-memory ``_normalise_rows``."""
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if all_unit:
        return arr
    return (arr / _row_norms(arr)[:, None]).astype(np.float32, copy=False)


def assign_part(xn: np.ndarray, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pass 1 of a shard: each unit row's most cosine-similar centre (ties to the lower index) and the float64
    sums of the rows per centre.

    Returns:
        ``(labels int32 (n,), sums float64 (k, d), sizes int64 (k,))``.
    """
    labels = _nearest_centroid(xn, centres).astype(np.int32)
    sums, sizes = _cluster_sums(xn, labels, centres.shape[0])
    return labels, sums, sizes


def centroids_from_parts(sums: np.ndarray, sizes: np.ndarray, fallback: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The clusters' unit mean directions from the shards' summed float64 sums (the in-memory ``_centroids_of``).

    Args:
        sums: float64 (k, d) the sums over every shard; sizes: int64 (k,) the cluster sizes.
        fallback: float32 (k, d) unit rows for empty clusters (the fitted centres).

    Returns:
        ``(centroids float32 (k, d), degenerate bool (k,))``: a degenerate cluster (non-empty, zero sum) needs its
        first member's unit row as its centroid, which the caller reads from the shards.
    """
    centroids, degenerate = _centroids_from_sums(sums, sizes)
    centroids[sizes == 0] = fallback[sizes == 0]
    return centroids, degenerate


def merge_plan(sizes: np.ndarray, min_size: int) -> tuple[np.ndarray, int]:
    """Which clusters :func:`~ray_cluster_ft.cluster.kmeans.merge_small_clusters` dissolves: ``(new_id int64 (k,),
    n_merged)``, ``new_id`` the cluster's label after the merge (surviving clusters keep their order), -1 for a
    dissolved one. If no cluster reaches ``min_size`` the largest (lowest index on ties) survives alone."""
    sizes = np.asarray(sizes, dtype=np.int64)
    keep = sizes >= min_size
    if not keep.any():
        keep[int(np.argmax(sizes))] = True
    new_id = np.full(sizes.size, -1, dtype=np.int64)
    new_id[np.flatnonzero(keep)] = np.arange(int(keep.sum()))
    return new_id, int(sizes.size - keep.sum())


def relabel_part(xn: np.ndarray, labels: np.ndarray, new_id: np.ndarray, centroids: np.ndarray,
                 k_final: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pass 2 of a shard (only after a merge): surviving clusters renumbered by ``new_id``, the rows of dissolved
    ones moved to their most cosine-similar surviving centroid (``centroids[new_id >= 0]``, renormalised as
    ``merge_small_clusters`` does), and the new float64 sums.

    Returns:
        ``(labels int32 (n,), sums float64 (k_final, d), sizes int64 (k_final,))``.
    """
    out = new_id[np.asarray(labels)]
    moving = out < 0
    if moving.any():
        cn = np.asarray(centroids, dtype=np.float32)[new_id >= 0]
        cn = cn / np.maximum(np.linalg.norm(cn, axis=1, keepdims=True), 1e-12)
        out[moving] = _nearest_centroid(xn[moving], cn)
    out = out.astype(np.int32)
    sums, sizes = _cluster_sums(xn, out, k_final)
    return out, sums, sizes


def distance_part(xn: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The last pass of a shard: ``1 - cos`` of each unit row to its own centroid, float32 (n,) in [0, 2]."""
    return _own_distance(xn, np.asarray(labels), centroids)
