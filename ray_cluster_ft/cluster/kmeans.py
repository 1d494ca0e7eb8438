"""Spherical k-means on gradient sketches (docs/design.md, "Cluster").

The driver groups examples by the direction of their gradient sketch: two examples whose sketches point the
same way teach the model the same thing. Clustering follows CluSTER (Kim et al., EMNLP 2026, arXiv 2609.12584:
clustering of gradient features) with spherical k-means (Dhillon & Modha, "Concept decompositions for
large sparse text data using clustering", Machine Learning 2001): rows are L2-normalised, so the Euclidean
k-means of scikit-learn on the unit sphere ranks points by cosine, and the centroids are renormalised afterwards.

``clustering.algorithm: kmeans`` is the published method's own clustering instead (the CluSTER code,
kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``, ``_kmeans_prune_equalize_interleave``): plain Euclidean
``KMeans(n_clusters=k, n_init=10, random_state=seed)`` on the vectors as given, distance = squared Euclidean
distance to the centroid, and no small-cluster merging (the published method keeps its k clusters).
``clustering.max_cluster_ratio`` is its soft cap (same file, ``kmeans_soft_cap_fit_predict``), see
:func:`ray_cluster_ft.cluster.capped.soft_cap_labels`. A reused map (``clustering.from_run``) is
:mod:`ray_cluster_ft.cluster.cluster_map`; the stage's files are :mod:`ray_cluster_ft.cluster.stage`.

Everything here is a pure, deterministic function of its inputs and seed (no global state).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np

from ._vectors import (
    _CHUNK_ROWS,
    _as_matrix,
    _centroids_of,
    _check_k,
    _nearest_centroid,
    _normalise_rows,
    _own_distance,
    _sq_distance,
    nearest_distances,
)
from .capped import capped_labels, euclidean_kmeans

__all__ = [
    "FIT_ROWS",
    "MINIBATCH_THRESHOLD",
    "ClusterResult",
    "auto_k",
    "cluster_sketches",
    "fit_sample_rows",
    "merge_small_clusters",
    "resolve_k",
    "sampled_centres",
    "refit_kmeans",
    "spherical_kmeans",
]


MINIBATCH_THRESHOLD = 50_000
"""Above this many rows :func:`spherical_kmeans` uses ``MiniBatchKMeans`` (full Lloyd passes over 10^6 rows
cost minutes on a few cores; mini-batches keep the fit near-linear with a small constant)."""


_AUTO_K_MAX = 100


# At or below this many rows the spherical k-means restarts three times (cheap there, and steadier).
RESTART_ROWS = 10_000


_INIT_ROWS = 16_384  # rows sampled for the k-means++ initialisation


FIT_ROWS = 200_000
"""Above :data:`MINIBATCH_THRESHOLD`, ``MiniBatchKMeans`` is fitted on a seeded sample of at most this many rows
and every row is then assigned to its most cosine-similar centroid (one chunked matrix product). With about 100
clusters a 200k sample holds about 2,000 rows per cluster, far more than the centroid estimate needs, and the
fit no longer grows with N (fitting all 10^6 rows cost about 4 minutes on 2 shared cores)."""


@dataclass(frozen=True)
class ClusterResult:
    """The clustering of N sketches.

    Attributes:
        labels: int32 (N,), cluster of each row, contiguous 0..k-1, every cluster non-empty.
        dist: float32 (N,), distance to the own centroid: ``spherical``: cosine distance
            ``1 - cos(x_i, centroid[labels[i]])`` in [0, 2]; ``kmeans``: squared Euclidean distance.
        centroids: float32 (k, d): ``spherical``: unit-norm centroids (the renormalised mean of each cluster's
            unit rows); ``kmeans``: scikit-learn's centres.
        k: number of clusters after merging (``centroids.shape[0]``).
        n_merged_clusters: clusters smaller than ``min_cluster_size`` (or empty) that were dissolved into
            their nearest surviving centroids (``kmeans``: empty clusters dropped).
        algorithm: ``spherical`` or ``kmeans``.
        cap: the soft cap on cluster sizes when ``max_cluster_ratio`` fired
            (:func:`~ray_cluster_ft.cluster.capped.soft_cap_labels`), else None:
            rows, or tokens when the cap weighed rows by their tokens (``clustering.cap_by``).
        from_run: with ``clustering.from_run``
            (:func:`~ray_cluster_ft.cluster.cluster_map.cluster_from_map`): ``{"run_dir", "refit", "map_k",
            "map_clusters" (the map cluster each cluster is), "drift"}``
            (:func:`ray_cluster_ft.cluster.cluster_map.drift`), else None.
    """

    labels: np.ndarray
    dist: np.ndarray
    centroids: np.ndarray
    k: int
    n_merged_clusters: int
    algorithm: str = "spherical"
    cap: Optional[int] = None
    from_run: dict | None = None


def auto_k(n: int, world_size: int) -> int:
    """The ``clustering.k: auto`` rule.

    ``k = min(n, max(2 * world_size, min(100, round(sqrt(n / 10)))))``

    - ``sqrt(n / 10)`` grows slowly with the data: 10 clusters at 10^3 examples, 32 at 10^4, 100 at 10^5;
    - capped at 100, the order the anchors use (about 100 clusters for 10^5-10^6 examples, docs/design.md "Cluster");
    - at least ``2 * world_size``, so every optimizer step can draw its ``world_size`` micro-batches from
      distinct clusters with room to spare (with k == world_size every cluster would have to appear in every
      step, which forces equal cluster sizes);
    - never above ``n`` (k-means cannot have more clusters than points).

    Args:
        n: number of examples (>= 1).
        world_size: data-parallel ranks (>= 1).

    Raises:
        ValueError: ``n < 1`` or ``world_size < 1``.
    """
    if int(n) != n or n < 1:
        raise ValueError(f"auto_k: n must be a positive integer, got {n!r}")
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"auto_k: world_size must be a positive integer, got {world_size!r}")
    k = min(_AUTO_K_MAX, int(round(math.sqrt(n / 10.0))))
    return int(min(int(n), max(2 * int(world_size), k)))


def fit_sample_rows(n: int, k: int, seed: int, fit_rows: int = FIT_ROWS,
                    minibatch_rows: int = MINIBATCH_THRESHOLD) -> tuple[np.ndarray, np.ndarray | None]:
    """The seeded rows :func:`spherical_kmeans` fits on: ``(init, fit)``, int64 ascending positions in 0..n-1:
    ``init`` the k-means++ sample (at most max(16,384, 4k) rows), ``fit`` the mini-batch sample of ``fit_rows``
    rows when ``n`` is above both ``minibatch_rows`` and ``fit_rows``, else None (every row is fitted). The
    streamed clustering gathers exactly these rows from the shards."""
    rng = np.random.default_rng(seed)
    init = np.sort(rng.choice(n, size=min(n, max(_INIT_ROWS, 4 * k)), replace=False))
    fit = None
    if n > minibatch_rows and n > fit_rows:
        fit = np.sort(np.random.default_rng([seed, 1]).choice(n, size=fit_rows, replace=False))
    return init, fit


def sampled_centres(x_init: np.ndarray, x_fit: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The centres of :func:`spherical_kmeans` above its mini-batch threshold, from its samples alone: k-means++
    on the unit rows ``x_init`` (seed ``seed``, one BLAS thread), then ``MiniBatchKMeans`` (batch 4096, stop
    after 10 batches without improvement) on the unit rows ``x_fit``; returned renormalised, float32 (k, d)."""
    from sklearn.cluster import MiniBatchKMeans, kmeans_plusplus
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        init, _ = kmeans_plusplus(np.asarray(x_init, dtype=np.float64), k, random_state=seed)
    fit = MiniBatchKMeans(n_clusters=k, init=init.astype(np.float32), n_init=1, batch_size=4096,
                          max_no_improvement=10, random_state=seed, compute_labels=False).fit(x_fit)
    centres = np.asarray(fit.cluster_centers_, dtype=np.float32)
    return centres / np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)


def spherical_kmeans(x, k: int, seed: int = 0, fit_rows: int = FIT_ROWS,
                     minibatch_rows: int = MINIBATCH_THRESHOLD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spherical k-means: k-means on L2-normalised rows, centroids renormalised to unit length.

    Uses scikit-learn ``KMeans`` (k-means++ init, Lloyd) up to :data:`MINIBATCH_THRESHOLD` rows and
    ``MiniBatchKMeans`` (batch 4096, stop after 10 batches without improvement) above it, fitted on a seeded
    sample of at most :data:`FIT_ROWS` rows, after which every row is assigned to its nearest centroid by
    cosine (chunked ``argmax(x @ centroids.T)``: O(N k d), seconds at 10^6 rows). k-means++
    (Arthur & Vassilvitskii 2007) seeds on a sample of at most 16k rows; 3 restarts (lowest inertia kept) up
    to 10^4 rows, 1 above. The returned centroids are the renormalised means of each cluster's unit rows
    (for Lloyd at convergence this equals the renormalised sklearn centre; for mini-batch it corrects the
    centres' running-average drift). Deterministic for a given ``seed`` and thread count.

    Args:
        x: (N, d) real array (cast to float32); rows need not be normalised but must be non-zero and finite.
        k: clusters, 1 <= k <= N.
        seed: random state for the initialisation.
        fit_rows, minibatch_rows: the sample size and the mini-batch threshold (:func:`fit_sample_rows`;
            tests lower them to compare with the streamed clustering on small data).

    Returns:
        labels int32 (N,) in 0..k-1; dist float32 (N,) = 1 - cosine to the own centroid; centroids float32
        (k, d) with unit rows. A cluster can come back empty only when x has fewer than k distinct
        directions; its centroid row is then sklearn's (renormalised) centre.

    Raises:
        ValueError: x not 2-D, empty, non-numeric, with NaN/inf or all-zero rows; k < 1 or k > N.
    """
    from sklearn.cluster import KMeans, MiniBatchKMeans, kmeans_plusplus
    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    arr = _as_matrix(x)
    n = arr.shape[0]
    k = _check_k(k, n)
    xn = _normalise_rows(arr)

    # k-means++ seeds come from a float64 sample: sklearn's own initialisation on float32 rows goes through a
    # slow chunked upcast (about a minute at 5 x 10^4 rows, far more than the Lloyd iterations after it).
    # Restarts are cheap up to 10^4 rows and buy stability there; above, one start is as good in practice.
    sample, sampled = fit_sample_rows(n, k, seed, fit_rows, minibatch_rows)
    x_init = xn[sample].astype(np.float64)
    n_init = 3 if n <= RESTART_ROWS else 1
    if sampled is not None and n_init == 1:
        # The streamed clustering's fit (ray_cluster_ft.cluster.stream): the same samples, the same centres.
        centres = sampled_centres(x_init, xn[sampled], k, seed)
        labels = _nearest_centroid(xn, centres).astype(np.int32)
        centroids, sizes = _centroids_of(xn, labels, k)
        centroids[sizes == 0] = centres[sizes == 0]
        return labels, _own_distance(xn, labels, centroids), centroids
    model, labels, best = None, None, np.inf
    with warnings.catch_warnings():
        # Fewer distinct points than k: sklearn warns and leaves clusters empty; merge_small_clusters handles it.
        warnings.simplefilter("ignore", ConvergenceWarning)
        for restart in range(n_init):
            # k-means++ is a chain of small (trials x sample) products: extra BLAS threads only add
            # synchronisation, which cost 20x (6.5 s at 10^4 rows, k = 32) on 2 shared cores.
            with threadpool_limits(limits=1, user_api="blas"):
                init, _ = kmeans_plusplus(x_init, k, random_state=seed + restart)
            init = init.astype(np.float32)
            if n > minibatch_rows:
                fit = MiniBatchKMeans(
                    n_clusters=k, init=init, n_init=1, batch_size=4096, max_no_improvement=10,
                    random_state=seed, compute_labels=False,
                ).fit(xn[sampled] if sampled is not None else xn)
                # Every row goes to its most cosine-similar centre; a start is scored by the spherical
                # objective sum(1 - max cos) over all rows (sklearn computes no inertia without labels).
                centres = np.asarray(fit.cluster_centers_, dtype=np.float32)
                centres = centres / np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
                lab, cos = _nearest_centroid(xn, centres, with_cos=True)
                score = float(np.sum(1.0 - cos, dtype=np.float64))
                lab = lab.astype(np.int32)
            else:
                fit = KMeans(n_clusters=k, init=init, n_init=1, random_state=seed, algorithm="lloyd").fit(xn)
                score, lab = float(fit.inertia_), fit.labels_.astype(np.int32)
            if model is None or score < best:
                model, labels, best = fit, lab, score

    centroids, sizes = _centroids_of(xn, labels, k)
    empty = sizes == 0
    if empty.any():
        centres = np.asarray(model.cluster_centers_, dtype=np.float32)[empty]
        norms = np.linalg.norm(centres, axis=1, keepdims=True)
        centroids[empty] = centres / np.where(norms > 0, norms, 1.0)
    dist = _own_distance(xn, labels, centroids)
    return labels, dist, centroids


def merge_small_clusters(x, labels, centroids, min_size: int) -> tuple[np.ndarray, int]:
    """Dissolve clusters with fewer than ``min_size`` members and relabel to contiguous 0..k'-1.

    Each member of a dissolved cluster moves to its most cosine-similar surviving centroid (point-wise, so a
    small cluster straddling two big ones is split sensibly). Surviving clusters keep their relative order.
    If no cluster reaches ``min_size``, the largest (lowest index on ties) survives alone.

    Args:
        x: (N, d) sketches (normalised internally).
        labels: int (N,) in 0..k-1.
        centroids: (k, d) centroids (normalised internally).
        min_size: smallest allowed cluster size (>= 1); ``1`` only removes empty clusters.

    Returns:
        (labels int32 (N,) contiguous 0..k'-1, number of dissolved clusters including empty ones).

    Raises:
        ValueError: shape mismatches, labels outside 0..k-1, ``min_size < 1``.
    """
    xn = _normalise_rows(_as_matrix(x))
    cent = _as_matrix(centroids, "centroids")
    lab = np.asarray(labels)
    if lab.ndim != 1 or lab.shape[0] != xn.shape[0]:
        raise ValueError(f"labels must have shape ({xn.shape[0]},), got {lab.shape}")
    if not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {lab.dtype}")
    if cent.shape[1] != xn.shape[1]:
        raise ValueError(f"centroids have dimension {cent.shape[1]}, sketches {xn.shape[1]}")
    k = cent.shape[0]
    if lab.min() < 0 or lab.max() >= k:
        raise ValueError(f"labels must be in 0..{k - 1}, got range {lab.min()}..{lab.max()}")
    if int(min_size) != min_size or min_size < 1:
        raise ValueError(f"min_size must be a positive integer, got {min_size!r}")

    sizes = np.bincount(lab, minlength=k)
    keep = sizes >= min_size
    if not keep.any():
        keep[int(np.argmax(sizes))] = True
    n_merged = int(k - keep.sum())
    kept_ids = np.flatnonzero(keep)
    new_id = np.full(k, -1, dtype=np.int64)
    new_id[kept_ids] = np.arange(kept_ids.size)
    out = new_id[lab]
    moving = out < 0
    if moving.any():
        cn = cent[kept_ids]
        cn = cn / np.maximum(np.linalg.norm(cn, axis=1, keepdims=True), 1e-12)
        out[moving] = _nearest_centroid(xn[moving], cn)
    return out.astype(np.int32), n_merged


def cluster_sketches(
    x,
    k: Union[int, Literal["auto", "world_size"]] = "auto",
    world_size: int = 1,
    seed: int = 0,
    min_cluster_size: int = 2,
    algorithm: Literal["spherical", "kmeans"] = "spherical",
    max_cluster_ratio: Optional[float] = None,
    weights: Optional[np.ndarray] = None,
    fit_rows: int = FIT_ROWS,
    minibatch_rows: int = MINIBATCH_THRESHOLD,
) -> ClusterResult:
    """The Cluster stage: k-means, then small clusters merged (spherical only), the soft cap, distances.

    ``spherical`` (default): :func:`spherical_kmeans`, clusters below ``min_cluster_size`` merged
    (:func:`merge_small_clusters`), centroids recomputed after a merge. ``kmeans``: :func:`euclidean_kmeans`,
    the published clustering; no merging (the published method keeps its k clusters; only empty clusters,
    possible when x has fewer than k distinct rows, are dropped). With ``max_cluster_ratio`` and a largest
    cluster above ``ratio * N / K``, points are reassigned by :func:`~ray_cluster_ft.cluster.capped.soft_cap_labels` (squared Euclidean for
    ``kmeans``, cosine distance for ``spherical``), without refitting the centroids.

    Args:
        x: (N, d) sketches (float; normalised internally for ``spherical``, used as given for ``kmeans``).
        k: clusters; ``"auto"`` for :func:`auto_k` ``(N, world_size)``; ``"world_size"`` for ``world_size``.
        world_size: data-parallel ranks.
        seed: k-means initialisation seed.
        min_cluster_size: ``spherical``: clusters below this size are dissolved; unused by ``kmeans``.
        algorithm: ``spherical`` or ``kmeans``.
        max_cluster_ratio: the soft cap's factor (> 1), or None for no cap.
        weights: int (N,) tokens per row: the cap then counts tokens (``weights`` of
            :func:`~ray_cluster_ft.cluster.capped.soft_cap_labels`);
            None counts rows (the published cap).
        fit_rows, minibatch_rows: ``spherical``'s sample size and mini-batch threshold (:func:`spherical_kmeans`).

    Returns:
        :class:`ClusterResult` with contiguous labels and distances to the final centroids.

    Raises:
        ValueError: as :func:`spherical_kmeans`, :func:`euclidean_kmeans` and :func:`merge_small_clusters`;
            ``k`` neither int, "auto" nor "world_size"; unknown algorithm; ``max_cluster_ratio <= 1``.
    """
    if algorithm not in ("spherical", "kmeans"):
        raise ValueError(f"algorithm must be 'spherical' or 'kmeans', got {algorithm!r}")
    if max_cluster_ratio is not None and not max_cluster_ratio > 1:
        raise ValueError(f"max_cluster_ratio must be > 1 or None, got {max_cluster_ratio!r}")
    if algorithm == "kmeans":
        arr = _as_matrix(x)
        labels, dist, centroids = euclidean_kmeans(arr, resolve_k(k, arr.shape[0], world_size), seed)
        labels, cap = capped_labels(arr, labels, centroids, max_cluster_ratio, "sqeuclidean", weights)
        if cap is not None:
            dist = _sq_distance(arr, labels, centroids)
        labels, centroids, n_empty = _drop_empty(labels, centroids)
        return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=int(centroids.shape[0]),
                             n_merged_clusters=n_empty, algorithm="kmeans", cap=cap)
    xn = _normalise_rows(_as_matrix(x))  # once: the calls below reuse these unit rows without copying
    labels, _, centroids = spherical_kmeans(xn, resolve_k(k, xn.shape[0], world_size), seed, fit_rows, minibatch_rows)
    labels, n_merged = merge_small_clusters(xn, labels, centroids, min_cluster_size)
    k_final = int(labels.max()) + 1
    if n_merged:
        centroids, _ = _centroids_of(xn, labels, k_final)
    labels, cap = capped_labels(xn, labels, centroids, max_cluster_ratio, "cosine", weights)
    dist = _own_distance(xn, labels, centroids)
    return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=k_final, n_merged_clusters=n_merged,
                         cap=cap)


def resolve_k(k, n: int, world_size: int):
    """``clustering.k`` as a number: ``auto`` by :func:`auto_k`, ``world_size`` the number of ranks."""
    if k == "auto":
        return auto_k(n, world_size)
    if k == "world_size":
        return int(world_size)
    if isinstance(k, str):
        raise ValueError(f"k must be a positive integer, 'auto' or 'world_size', got {k!r}")
    return k


def _drop_empty(labels: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Empty clusters removed, labels made contiguous again (the order of the others kept).

    Returns (labels int32 (N,), centroids (k', d), number removed)."""
    keep = np.bincount(labels, minlength=centroids.shape[0]) > 0
    if keep.all():
        return labels, centroids, 0
    new_id = np.cumsum(keep) - 1
    return new_id[labels].astype(np.int32), centroids[keep], int((~keep).sum())


def refit_kmeans(xs: np.ndarray, init: np.ndarray, algorithm: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """k-means warm-started from a map's centroids (``clustering.refit: true``): Lloyd iterations from ``init``,
    one start, no k-means++.

    ``spherical``: scikit-learn ``KMeans(init=init, n_init=1, algorithm="lloyd")`` on the unit rows (above
    :data:`MINIBATCH_THRESHOLD` rows ``MiniBatchKMeans`` with the same init on a
    seeded sample of at most ``FIT_ROWS`` rows, then every row to its most cosine-similar centre), centroids
    the renormalised means of each cluster (as :func:`spherical_kmeans`).
    ``kmeans``: ``KMeans(init=init, n_init=1)`` on the rows as given (the published clustering, warm-started).

    Args:
        xs: float32 ``(N, d)``: unit rows for ``spherical``.
        init: float32 ``(k, d)`` the map's centroids, k <= N.
        algorithm: ``spherical`` or ``kmeans``.
        seed: random state (mini-batch sampling).

    Returns:
        ``(labels int32 (N,), centroids float32 (k, d))``; a cluster may come back empty (the caller drops it).

    Raises:
        ValueError: more centroids than rows.
    """
    from sklearn.cluster import KMeans, MiniBatchKMeans
    from sklearn.exceptions import ConvergenceWarning

    n, k = xs.shape[0], init.shape[0]
    if k > n:
        raise ValueError(f"refit_kmeans: the map has {k} centroids, more than the {n} rows to cluster")
    init = np.ascontiguousarray(init, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        if algorithm == "kmeans":
            km = KMeans(n_clusters=k, init=init, n_init=1, random_state=seed).fit(xs)
            return km.labels_.astype(np.int32), np.asarray(km.cluster_centers_, dtype=np.float32)
        if n > MINIBATCH_THRESHOLD:
            rows = np.sort(np.random.default_rng([seed, 2]).choice(n, size=min(n, FIT_ROWS), replace=False))
            fit = MiniBatchKMeans(n_clusters=k, init=init, n_init=1, batch_size=4096, max_no_improvement=10,
                                  random_state=seed, compute_labels=False).fit(xs[rows])
            centres = np.asarray(fit.cluster_centers_, dtype=np.float32)
            centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
            labels, _ = nearest_distances(xs, centres, "cosine")
        else:
            labels = KMeans(n_clusters=k, init=init, n_init=1, random_state=seed, algorithm="lloyd").fit(xs).labels_
    labels = labels.astype(np.int32)
    centroids, sizes = _centroids_of(xs, labels, k)
    centroids[sizes == 0] = init[sizes == 0]
    return labels, centroids
