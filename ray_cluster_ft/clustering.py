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
:func:`ray_cluster_ft.capped_kmeans.soft_cap_labels`.

Everything here is a pure, deterministic function of its inputs and seed (no global state).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
import scipy.sparse as sp

from .capped_kmeans import (
    _CHUNK_ROWS,
    _normalise_rows,
    _as_matrix,
    _capped,
    _check_k,
    _sq_distance,
    euclidean_kmeans,
    soft_cap_labels,
)

__all__ = [
    "clustering_warning",
    "drift_warning",
    "run",
    "MINIBATCH_THRESHOLD",
    "ClusterResult",
    "auto_k",
    "spherical_kmeans",
    "euclidean_kmeans",
    "soft_cap_labels",
    "merge_small_clusters",
    "cluster_sketches",
    "cluster_from_map",
    "cluster_with_config",
]


MINIBATCH_THRESHOLD = 50_000
"""Above this many rows :func:`spherical_kmeans` uses ``MiniBatchKMeans`` (full Lloyd passes over 10^6 rows
cost minutes on a few cores; mini-batches keep the fit near-linear with a small constant)."""


_AUTO_K_MAX = 100


_RESTART_ROWS = 10_000


_INIT_ROWS = 16_384  # rows sampled for the k-means++ initialisation


_FIT_ROWS = 200_000
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
        cap: the soft cap on cluster sizes when ``max_cluster_ratio`` fired (:func:`soft_cap_labels`), else None:
            rows, or tokens when the cap weighed rows by their tokens (``clustering.cap_by``).
        from_run: with ``clustering.from_run`` (:func:`cluster_from_map`): ``{"run_dir", "refit", "map_k",
            "map_clusters" (the map cluster each cluster is), "drift"}`` (:func:`ray_cluster_ft.cluster_map.drift`),
            else None.
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


def _centroids_of(xn: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm mean direction of each cluster and the cluster sizes.

    Returns (centroids float32 (k, d), sizes int64 (k,)); an empty cluster gets a zero row.
    """
    n = xn.shape[0]
    onehot = sp.csr_matrix((np.ones(n, dtype=np.float32), (labels, np.arange(n))), shape=(k, n))
    sums = np.asarray(onehot @ xn, dtype=np.float32)
    sizes = np.bincount(labels, minlength=k).astype(np.int64)
    norms = np.linalg.norm(sums, axis=1)
    # A cluster of antipodal points has a zero mean: fall back to its first member's direction.
    degenerate = (sizes > 0) & (norms <= 1e-12)
    if degenerate.any():
        first = np.full(k, -1, dtype=np.int64)
        order = np.argsort(labels, kind="stable")
        starts = np.searchsorted(labels[order], np.arange(k))
        first[degenerate] = order[starts[degenerate]]
        sums[degenerate] = xn[first[degenerate]]
        norms[degenerate] = 1.0
    safe = np.where(norms > 0, norms, 1.0)
    return (sums / safe[:, None]).astype(np.float32), sizes


def _own_distance(xn: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """``1 - cos(x_i, centroid[labels[i]])`` for unit rows, float32 (N,), clipped to [0, 2]."""
    out = np.empty(xn.shape[0], dtype=np.float32)
    for lo in range(0, xn.shape[0], _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, xn.shape[0])
        cos = np.einsum("ij,ij->i", xn[lo:hi], centroids[labels[lo:hi]])
        out[lo:hi] = 1.0 - cos
    return np.clip(out, 0.0, 2.0)


def spherical_kmeans(x, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spherical k-means: k-means on L2-normalised rows, centroids renormalised to unit length.

    Uses scikit-learn ``KMeans`` (k-means++ init, Lloyd) up to :data:`MINIBATCH_THRESHOLD` rows and
    ``MiniBatchKMeans`` (batch 4096, stop after 10 batches without improvement) above it, fitted on a seeded
    sample of at most :data:`_FIT_ROWS` rows, after which every row is assigned to its nearest centroid by
    cosine (chunked ``argmax(x @ centroids.T)``: O(N k d), seconds at 10^6 rows). k-means++
    (Arthur & Vassilvitskii 2007) seeds on a sample of at most 16k rows; 3 restarts (lowest inertia kept) up
    to 10^4 rows, 1 above. The returned centroids are the renormalised means of each cluster's unit rows
    (for Lloyd at convergence this equals the renormalised sklearn centre; for mini-batch it corrects the
    centres' running-average drift). Deterministic for a given ``seed`` and thread count.

    Args:
        x: (N, d) real array (cast to float32); rows need not be normalised but must be non-zero and finite.
        k: clusters, 1 <= k <= N.
        seed: random state for the initialisation.

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
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, max(_INIT_ROWS, 4 * k)), replace=False))
    x_init = xn[sample].astype(np.float64)
    n_init = 3 if n <= _RESTART_ROWS else 1
    fit_rows = None
    if n > MINIBATCH_THRESHOLD and n > _FIT_ROWS:
        fit_rows = np.sort(np.random.default_rng([seed, 1]).choice(n, size=_FIT_ROWS, replace=False))
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
            if n > MINIBATCH_THRESHOLD:
                fit = MiniBatchKMeans(
                    n_clusters=k, init=init, n_init=1, batch_size=4096, max_no_improvement=10,
                    random_state=seed, compute_labels=False,
                ).fit(xn[fit_rows] if fit_rows is not None else xn)
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


def _nearest_centroid(xn: np.ndarray, centroids: np.ndarray, with_cos: bool = False):
    """Index of the most cosine-similar centroid for each unit row (chunked), int64 (N,).

    With ``with_cos``, returns ``(index, cosine to that centroid float32 (N,))``. Chunks of
    ``_CHUNK_ROWS`` rows bound the (rows x k) score temporary (64 MiB at k = 256)."""
    out = np.empty(xn.shape[0], dtype=np.int64)
    cos = np.empty(xn.shape[0], dtype=np.float32) if with_cos else None
    cent_t = np.ascontiguousarray(centroids.T, dtype=np.float32)
    for lo in range(0, xn.shape[0], _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, xn.shape[0])
        scores = xn[lo:hi] @ cent_t
        out[lo:hi] = np.argmax(scores, axis=1)
        if with_cos:
            cos[lo:hi] = scores[np.arange(hi - lo), out[lo:hi]]
    return (out, cos) if with_cos else out


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
) -> ClusterResult:
    """The Cluster stage: k-means, then small clusters merged (spherical only), the soft cap, distances.

    ``spherical`` (default): :func:`spherical_kmeans`, clusters below ``min_cluster_size`` merged
    (:func:`merge_small_clusters`), centroids recomputed after a merge. ``kmeans``: :func:`euclidean_kmeans`,
    the published clustering; no merging (the published method keeps its k clusters; only empty clusters,
    possible when x has fewer than k distinct rows, are dropped). With ``max_cluster_ratio`` and a largest
    cluster above ``ratio * N / K``, points are reassigned by :func:`soft_cap_labels` (squared Euclidean for
    ``kmeans``, cosine distance for ``spherical``), without refitting the centroids.

    Args:
        x: (N, d) sketches (float; normalised internally for ``spherical``, used as given for ``kmeans``).
        k: clusters; ``"auto"`` for :func:`auto_k` ``(N, world_size)``; ``"world_size"`` for ``world_size``.
        world_size: data-parallel ranks.
        seed: k-means initialisation seed.
        min_cluster_size: ``spherical``: clusters below this size are dissolved; unused by ``kmeans``.
        algorithm: ``spherical`` or ``kmeans``.
        max_cluster_ratio: the soft cap's factor (> 1), or None for no cap.
        weights: int (N,) tokens per row: the cap then counts tokens (:func:`soft_cap_labels` ``weights``);
            None counts rows (the published cap).

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
        labels, dist, centroids = euclidean_kmeans(arr, _resolve_k(k, arr.shape[0], world_size), seed)
        labels, cap = _capped(arr, labels, centroids, max_cluster_ratio, "sqeuclidean", weights)
        if cap is not None:
            dist = _sq_distance(arr, labels, centroids)
        labels, centroids, n_empty = _drop_empty(labels, centroids)
        return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=int(centroids.shape[0]),
                             n_merged_clusters=n_empty, algorithm="kmeans", cap=cap)
    xn = _normalise_rows(_as_matrix(x))  # once: the calls below reuse these unit rows without copying
    labels, _, centroids = spherical_kmeans(xn, _resolve_k(k, xn.shape[0], world_size), seed)
    labels, n_merged = merge_small_clusters(xn, labels, centroids, min_cluster_size)
    k_final = int(labels.max()) + 1
    if n_merged:
        centroids, _ = _centroids_of(xn, labels, k_final)
    labels, cap = _capped(xn, labels, centroids, max_cluster_ratio, "cosine", weights)
    dist = _own_distance(xn, labels, centroids)
    return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=k_final, n_merged_clusters=n_merged,
                         cap=cap)


def cluster_from_map(x, cmap, known: np.ndarray, *, refit: bool = False, min_cluster_size: int = 2,
                     max_cluster_ratio: float | None = None, max_drift: float = 0.2, seed: int = 0,
                     weights: np.ndarray | None = None) -> ClusterResult:
    """Cluster with an earlier run's map (``clustering.from_run``) instead of from scratch.

    A row the map's run clustered keeps its cluster there (``known``: k-means stops near, not at, the fixed point
    where every row's cluster is its nearest centroid, so re-assigning would move a few old rows); every new row
    goes to its nearest map centroid in the map's metric (:func:`ray_cluster_ft.cluster_map.assign_to_map`: cosine
    for a ``spherical`` map, squared Euclidean for ``kmeans``), and the drift of the new rows is measured against
    the map's 95th-percentile distance (:func:`ray_cluster_ft.cluster_map.drift`). With ``refit``, k-means
    is then warm-started from the map's centroids (:func:`refit_kmeans`). Then as
    :func:`cluster_sketches`: clusters left empty are dropped, for ``spherical`` those below
    ``min_cluster_size`` are dissolved into their nearest surviving centroid (point-wise); the map's centroids are
    kept as they are (with ``refit``, recomputed after a merge); the soft cap applies; distances are to the final
    centroids.

    Args:
        x: ``(N, d)`` features.
        cmap: :class:`ray_cluster_ft.cluster_map.ClusterMap`.
        known: int ``(N,)`` each row's cluster in the map's run, -1 for a new row
            (:func:`ray_cluster_ft.cluster_map.map_labels`).
        refit: warm-start k-means from the map.
        min_cluster_size, max_cluster_ratio, seed, weights: as :func:`cluster_sketches`.
        max_drift: ``clustering.max_drift``.

    Returns:
        :class:`ClusterResult` with ``algorithm`` the map's and ``from_run`` filled.

    Raises:
        ValueError: as :func:`cluster_sketches`' input checks; a feature size other than the map's; with
            ``refit``, more map centroids than rows.
    """
    from .cluster_map import assign_to_map, drift, nearest_distances

    arr = _as_matrix(x)
    if arr.shape[1] != cmap.centroids.shape[1]:
        raise ValueError(f"features of dimension {arr.shape[1]}, the map's centroids {cmap.centroids.shape[1]}")
    known = np.asarray(known, dtype=np.int64)
    if known.shape != (arr.shape[0],) or known.max(initial=-1) >= cmap.centroids.shape[0]:
        raise ValueError(f"known must have shape ({arr.shape[0]},) and values below {cmap.centroids.shape[0]}")
    xs, labels, near = assign_to_map(arr, cmap)
    old = known >= 0
    labels[old] = known[old]
    info = {"run_dir": cmap.run_dir, "refit": bool(refit), "map_k": int(cmap.centroids.shape[0]),
            "drift": drift(near, cmap.p95_distance, ~old, max_drift)}
    centroids = cmap.centroids
    if refit:
        labels, centroids = refit_kmeans(xs, centroids, cmap.algorithm, seed)
    spherical = cmap.algorithm == "spherical"
    metric = cmap.metric
    sizes = np.bincount(labels, minlength=centroids.shape[0])
    keep = sizes >= (int(min_cluster_size) if spherical else 1)
    if not keep.any():
        keep[int(np.argmax(sizes))] = True
    kept = np.flatnonzero(keep)
    new_id = np.full(centroids.shape[0], -1, dtype=np.int64)
    new_id[kept] = np.arange(kept.size)
    labels = new_id[labels]
    moving = labels < 0
    if moving.any():
        labels[moving], _ = nearest_distances(xs[moving], centroids[kept], metric)
    labels = labels.astype(np.int32)
    centroids = np.ascontiguousarray(centroids[kept])
    if refit and spherical and moving.any():
        centroids, _ = _centroids_of(xs, labels, kept.size)
    labels, cap = _capped(xs, labels, centroids, max_cluster_ratio, metric, weights)
    dist = _own_distance(xs, labels, centroids) if spherical else _sq_distance(xs, labels, centroids)
    info["map_clusters"] = kept.tolist()
    return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=int(kept.size),
                         n_merged_clusters=int(cmap.centroids.shape[0] - kept.size),
                         algorithm=cmap.algorithm, cap=cap, from_run=info)


def _resolve_k(k, n: int, world_size: int):
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


def clustering_warning(k: int, n_merged: int, world_size: int, min_cluster_size: int) -> str | None:
    """The sentence the run prints (and the manifest and report keep) when clustering left fewer clusters
    than ranks: then the W micro-batches of a step cannot all come from distinct clusters."""
    if k >= world_size:
        return None
    merged = (f" after merging {n_merged} clusters smaller than clustering.min_cluster_size={min_cluster_size}"
              if n_merged else "")
    return (f"{k} cluster{'s' if k != 1 else ''}{merged}, fewer than the {world_size} ranks: the ranks of a step "
            f"cannot all train different clusters (see plan_metrics.collisions_per_step); use more data, a "
            f"smaller clustering.min_cluster_size or a larger clustering.k")


def drift_warning(d: dict, refit: bool = False) -> str:
    """The sentence the run prints (and the manifest and report keep) when the rows new to a reused cluster
    map lie beyond its 95th-percentile distance more often than ``clustering.max_drift`` (``refit``: the run
    already warm-started k-means from the map, so only clustering from scratch is left to suggest)."""
    advice = "cluster again (drop clustering.from_run)" + ("" if refit else " or set clustering.refit: true")
    return (f"{d['share_new_beyond_p95']:.1%} of the {d['new_rows']} rows new to the reused cluster map lie farther "
            f"from every centroid than its 95th-percentile distance ({d['p95_distance']:.4g}), above "
            f"clustering.max_drift={d['max_drift']:g}: {advice}")


def _cap_unit(cfg) -> str:
    by = cfg.clustering.cap_by
    return by if by != "auto" else ("tokens" if cfg.allocation.packing else "rows")


def cap_weights(cfg, n_tokens) -> np.ndarray | None:
    """What ``clustering.max_cluster_ratio`` counts: ``n_tokens`` (int64 (N,)) when ``clustering.cap_by`` is
    ``tokens``, or ``auto`` with ``allocation.packing`` (a packed step gives every rank the same tokens, so a
    cluster above 1/W of the tokens must sit on two ranks at some step whatever its row count); None (rows,
    the published cap) otherwise.

    Raises:
        ValueError: tokens are to be counted and ``n_tokens`` is None.
    """
    if _cap_unit(cfg) == "rows":
        return None
    if n_tokens is None:
        raise ValueError("clustering.cap_by counts tokens: pass n_tokens")
    return np.asarray(n_tokens)  # soft_cap_labels checks for positive integers (no silent float truncation)


def cluster_with_config(cfg, example_ids, sketches, features: dict | None = None, n_tokens=None) -> tuple:
    """The pure part of :func:`run` (also :func:`ray_cluster_ft.select_and_plan`'s): :func:`cluster_sketches`
    with the job's ``clustering`` settings and world size, and the ``clusters.parquet`` table. With
    ``clustering.from_run`` it reads that run's map and assignment (``centroids.parquet``, ``clusters.parquet``:
    the only files it reads) and assigns to it (:func:`cluster_from_map`; ``k`` is then the map's).

    Args:
        cfg: the job config (``clustering`` section; ``train.num_workers``; ``sketch`` for ``from_run``).
        example_ids: str ``(N,)`` candidate ids, in the order of ``sketches``.
        sketches: float ``(N, d)``.
        features: the feature stage's summary (``feature_key``, ``feature_key_of``, ``normalisation``): with
            ``from_run`` the map's features must match it (:func:`ray_cluster_ft.cluster_map.check_features`);
            ``None`` compares only the feature size and ``sketch`` settings.
        n_tokens: int ``(N,)`` tokens per row, for a cap that counts tokens (:func:`cap_weights`).

    Returns:
        ``(ClusterResult, pyarrow.Table)``: the table has ``example_id`` (string), ``cluster`` (int32),
        ``distance`` (float32).

    Raises:
        ValueError: as :func:`cluster_sketches`.
        ConfigError: ``from_run`` is missing, not a run, has no map, or its features do not match (named).
    """
    import pyarrow as pa

    c = cfg.clustering
    weights = cap_weights(cfg, n_tokens) if c.max_cluster_ratio is not None else None
    if c.from_run:
        from .cluster_map import check_features, load_cluster_map, map_labels
        from .features.feature_store import feature_settings

        cmap = load_cluster_map(c.from_run)
        check_features(cmap, int(np.shape(sketches)[1]), c.algorithm, feature_settings(cfg.sketch), features)
        known = map_labels(cmap.run_dir, example_ids, cmap.centroids.shape[0])
        res = cluster_from_map(sketches, cmap, known, refit=c.refit,
                               min_cluster_size=c.min_cluster_size, max_cluster_ratio=c.max_cluster_ratio,
                               max_drift=c.max_drift, seed=c.seed, weights=weights)
    else:
        res = cluster_sketches(sketches, c.k, cfg.train.num_workers, c.seed, c.min_cluster_size,
                               algorithm=c.algorithm, max_cluster_ratio=c.max_cluster_ratio, weights=weights)
    table = pa.table({"example_id": example_ids, "cluster": res.labels.astype(np.int32),
                      "distance": res.dist.astype(np.float32)})
    return res, table


def run(cfg, run_dir: Path, *, example_ids: np.ndarray, sketches: np.ndarray, resume: bool = False,
        features: dict | None = None, n_tokens: np.ndarray | None = None) -> tuple:
    """The cluster stage's edge: :func:`cluster_with_config` on the features (from scratch, or with
    ``clustering.from_run`` on that run's map), ``clusters.parquet`` written (``example_id``, ``cluster`` int32,
    ``distance`` float32 to the final centroid: ``1 - cos`` for ``clustering.algorithm: spherical``, the squared
    Euclidean distance for ``kmeans``) and the run's own map, ``centroids.parquet``
    (:func:`ray_cluster_ft.cluster_map.save_cluster_map`), for a later ``from_run``.

    Args:
        cfg: the job config (``clustering`` section: ``k``, ``algorithm``, ``seed``, ``min_cluster_size``,
            ``max_cluster_ratio``; ``train.num_workers`` for ``k: auto`` and ``k: world_size``).
        run_dir: the run directory.
        example_ids: str ``(N,)`` candidate ids, in the order of ``sketches``.
        sketches: float32 ``(N, d)``.
        resume: the stopped run's ``clusters.parquet`` must hold the same assignment.
        features: the feature stage's summary (recorded in the map; checked against ``from_run``'s).
        n_tokens: int64 ``(N,)`` tokens per row (a cap that counts tokens, :func:`cap_weights`).

    Returns:
        ``(ClusterResult, summary)``: the summary is the manifest's ``clustering`` entry (k, merged clusters,
        sizes, ``algorithm``, ``capped: true``, ``cap`` and ``cap_by`` (rows or tokens) when the soft cap fired,
        ``p95_distance`` of the map written, ``from_run`` (:attr:`ClusterResult.from_run`) and the
        :func:`clustering_warning` and drift warning when there are any).

    Raises:
        ConfigError: (``resume``) the assignment changed; ``from_run`` unusable (see :func:`cluster_with_config`);
            fewer clusters than ranks after merging with
            ``allocation.strategy: cluster`` (unless ``allocation.allow_shared_clusters``), or a cluster count
            other than the world size with ``cluster_per_rank``.
    """
    import pyarrow.parquet as pq

    from .config import ConfigError
    from .rundir import claim, same_as_before

    c = cfg.clustering
    W = cfg.train.num_workers
    from .cluster_map import CENTROIDS_FILE, save_cluster_map

    res, table = cluster_with_config(cfg, example_ids, sketches, features, n_tokens)
    if resume:
        same_as_before(run_dir / "clusters.parquet", table, ["example_id", "cluster"])
    pq.write_table(table, claim(run_dir, "clusters.parquet"))
    meta = save_cluster_map(claim(run_dir, CENTROIDS_FILE), sketches, res.labels, res.centroids, res.algorithm,
                            features)
    summary = {"k": int(res.k), "merged_small_clusters": int(res.n_merged_clusters),
               "sizes": np.bincount(res.labels).tolist(), "algorithm": res.algorithm,
               "p95_distance": meta["p95_distance"]}
    if res.cap is not None:
        summary.update(capped=True, cap=int(res.cap), cap_by=_cap_unit(cfg))
    if res.from_run is not None:
        summary["from_run"] = res.from_run
        d = res.from_run["drift"]
        if d["suggest_recluster"]:
            summary["drift_warning"] = drift_warning(d, refit=cfg.clustering.refit)
            print(f"[ray-cluster-ft] warning: {summary['drift_warning']}", flush=True)
    warning = clustering_warning(res.k, res.n_merged_clusters, W, c.min_cluster_size)
    alloc = cfg.allocation
    if alloc.strategy == "cluster_per_rank" and res.k != W:
        raise ConfigError(f"allocation.strategy 'cluster_per_rank' needs {W} clusters (train.num_workers), but "
                          f"clustering left {res.k}" + (f" after merging {res.n_merged_clusters} smaller than "
                          f"clustering.min_cluster_size={c.min_cluster_size}" if res.n_merged_clusters else ""))
    if warning and alloc.strategy == "cluster" and not alloc.allow_shared_clusters:
        raise ConfigError(f"{warning}; or set allocation.allow_shared_clusters: true to run anyway")
    if warning:
        summary["warning"] = warning
        print(f"[ray-cluster-ft] warning: {warning}", flush=True)
    return res, summary


def refit_kmeans(xs: np.ndarray, init: np.ndarray, algorithm: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """k-means warm-started from a map's centroids (``clustering.refit: true``): Lloyd iterations from ``init``,
    one start, no k-means++.

    ``spherical``: scikit-learn ``KMeans(init=init, n_init=1, algorithm="lloyd")`` on the unit rows (above
    :data:`~ray_cluster_ft.clustering.MINIBATCH_THRESHOLD` rows ``MiniBatchKMeans`` with the same init on a
    seeded sample of at most ``_FIT_ROWS`` rows, then every row to its most cosine-similar centre), centroids
    the renormalised means of each cluster (as :func:`~ray_cluster_ft.clustering.spherical_kmeans`).
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

    from .cluster_map import nearest_distances

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
            rows = np.sort(np.random.default_rng([seed, 2]).choice(n, size=min(n, _FIT_ROWS), replace=False))
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
