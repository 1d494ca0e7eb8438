"""The published CluSTER method's clustering: plain Euclidean k-means and its soft cap on cluster sizes.

From the paper's official code (kaist-dmlab/CluSTER, ``src/CluSTER/call_back.py``:
``_kmeans_prune_equalize_interleave`` and ``kmeans_soft_cap_fit_predict``), written anew and vectorised; used by
:mod:`ray_cluster_ft.cluster.kmeans` for ``clustering.algorithm: kmeans`` and ``clustering.max_cluster_ratio``.
Pure, deterministic functions of their inputs and seed.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from typing import Literal, Optional

import numpy as np

from ._vectors import _CHUNK_ROWS, _as_matrix, _centre_distances, _check_k, _sq_distance

__all__ = [
    "capped_labels",
    "euclidean_kmeans",
    "soft_cap_labels",
]


_CAP_TOPK = 8
"""Candidate centroids per point in the first pass of :func:`soft_cap_labels` (the published ``topk=8``)."""


def euclidean_kmeans(x, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain Euclidean k-means exactly as the published CluSTER code runs it (``clustering.algorithm: kmeans``).

    ``KMeans(n_clusters=k, n_init=10, random_state=seed)`` (k-means++, Lloyd, scikit-learn's other defaults)
    on the rows as given, not normalised; the distance is the float32 squared Euclidean distance to the
    assigned centre. Source: arXiv 2609.12584 and kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``,
    ``_kmeans_prune_equalize_interleave`` (its ``KMeans`` call) and ``_pairwise_sqdist_to_centers``.

    Args:
        x: (N, d) real, finite array (cast to float32); zero rows are allowed (nothing is normalised).
        k: clusters, 1 <= k <= N.
        seed: scikit-learn ``random_state``.

    Returns:
        labels int32 (N,) (scikit-learn's ``labels_``); dist float32 (N,) squared Euclidean distance to the own
        centre; centroids float32 (k, d) (``cluster_centers_``; for k = 1 no k-means runs: every row in cluster
        0, the centre their mean). A cluster is empty only when x has fewer than k distinct rows.

    Raises:
        ValueError: x not 2-D, empty, non-numeric or with NaN/inf; k < 1 or k > N.
    """
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    arr = _as_matrix(x)
    k = _check_k(k, arr.shape[0])
    if k == 1:  # the published code does not cluster at world size 1: one cluster, its centre the mean
        labels = np.zeros(arr.shape[0], dtype=np.int32)
        centroids = arr.mean(axis=0, dtype=np.float64, keepdims=True).astype(np.float32)
        return labels, _sq_distance(arr, labels, centroids), centroids
    with warnings.catch_warnings():
        # Fewer distinct rows than k: sklearn warns and leaves clusters empty; cluster_sketches drops them.
        warnings.simplefilter("ignore", ConvergenceWarning)
        km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(arr)
    labels = km.labels_.astype(np.int32)
    centroids = np.asarray(km.cluster_centers_, dtype=np.float32)
    return labels, _sq_distance(arr, labels, centroids), centroids


def _candidates(x: np.ndarray, centroids: np.ndarray, metric: str, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``t`` nearest centroids, nearest first (ties: lower centroid index), chunked.

    Returns (indices int64 (M, t), distances float32 (M, t))."""
    idx = np.empty((x.shape[0], t), dtype=np.int64)
    dist = np.empty((x.shape[0], t), dtype=np.float32)
    for lo in range(0, x.shape[0], _CHUNK_ROWS):
        d = _centre_distances(x[lo : lo + _CHUNK_ROWS], centroids, metric)
        order = np.argsort(d, axis=1, kind="stable")[:, :t]
        idx[lo : lo + _CHUNK_ROWS] = order
        dist[lo : lo + _CHUNK_ROWS] = np.take_along_axis(d, order, axis=1)
    return idx, dist


def _greedy_capped(cand: np.ndarray, time: np.ndarray, room: np.ndarray,
                   weight: np.ndarray | None = None) -> np.ndarray:
    """First-come greedy assignment under capacities, computed in rounds instead of one event at a time.

    The rule (the published loop): events (row, candidate) happen in ``time`` order; a row not yet placed takes
    the candidate if that cluster is not full yet. A cluster is full from the event that brings its load
    (rows, or the rows' ``weight``) to ``room``: with weights the last row taken may overshoot ``room`` by less
    than its own weight. Equivalently each row takes its first candidate whose cluster was not full at that
    event's time. Knowing the fill times of some clusters, every row tentatively takes its first candidate not
    full at that time; the earliest tentative fill among the other clusters is then exact (before it, the
    tentative and the sequential runs place every row alike), so it is fixed and the round repeats: at most K
    rounds of O(M t) array work, where the loop costs O(M t) Python steps.

    Args:
        cand: int (M, t) candidate clusters of each row, in the row's order of preference.
        time: int64 (M, t) time of each event, non-decreasing along a row; two rows never share a time.
        room: int (K,) load left in each cluster (rows, or weight units).
        weight: int64 (M,) positive load of each row; None = 1 per row (the published count cap).

    Returns:
        int64 (M,) the cluster each row takes, -1 where every candidate was full at its time.
    """
    m, k = cand.shape[0], room.shape[0]
    rows = np.arange(m)
    wt = np.ones(m, dtype=np.int64) if weight is None else np.asarray(weight, dtype=np.int64)
    fixed = room <= 0
    fill = np.where(fixed, -1, np.iinfo(np.int64).max)  # time of a cluster's filling event; later ones refused
    while True:
        ok = time <= fill[cand]
        first = np.argmax(ok, axis=1)
        took = ok[rows, first]
        lab = np.where(took, cand[rows, first], -1)
        free = took & ~fixed[np.maximum(lab, 0)]
        cl, at, w = lab[free], time[rows, first][free], wt[free]
        load = np.bincount(cl, weights=w, minlength=k)  # float64: exact for integer loads below 2^53
        over = np.flatnonzero(~fixed & (load >= room))
        if over.size == 0:
            return lab
        mine = np.isin(cl, over)  # only the overflowing clusters' events need sorting
        cl, at, w = cl[mine], at[mine], w[mine]
        srt = np.lexsort((at, cl))
        cum = np.cumsum(w[srt])
        starts = np.searchsorted(cl[srt], over)
        before = np.where(starts > 0, cum[np.maximum(starts - 1, 0)], 0)
        last = np.searchsorted(cum, before + room[over], side="left")  # the event that filled each cluster
        when = at[srt][last]
        j = int(np.argmin(when))
        fill[over[j]], fixed[over[j]] = when[j], True


def soft_cap_labels(x, centroids, ratio: float, metric: Literal["sqeuclidean", "cosine"] = "sqeuclidean",
                    topk: int = _CAP_TOPK, weights=None) -> tuple[np.ndarray, int]:
    """Reassign points to fixed centroids under a soft cap on cluster sizes (``clustering.max_cluster_ratio``).

    The published rule (arXiv 2609.12584; kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``,
    ``kmeans_soft_cap_fit_predict``, whose ``eps`` is ``ratio - 1``): cap = ceil(ratio * N / K) (exact decimal
    arithmetic, see :func:`_exact`); each point's
    ``topk`` nearest centroids; all (point, candidate) pairs sorted by distance (stable: ties by point, then
    candidate rank); in that order a point not yet placed takes the candidate if it has fewer than ``cap``
    points. Leftovers, in index order, take their nearest centroid with room (full search); a last resort
    (unreachable for ratio > 1, since cap * K >= N) takes the nearest centroid. Centroids are not refitted.
    Ties among a point's candidates go to the lower centroid index (the published code leaves them to
    ``argpartition``/``argsort``). The sequential pair loop is replaced by the equivalent rounds of
    :func:`_greedy_capped`.

    With ``weights`` (ours, ``clustering.cap_by: tokens``; not in the paper) the cap counts weight instead of
    points: cap = ceil(ratio * sum(weights) / K), and a point is taken while its candidate's load is below the
    cap (so a cluster may end above it by less than one point's weight). Packed plans need this: a cluster
    holding more than 1/W of the tokens must sit on two ranks at some step, whatever its point count.

    Args:
        x: (N, d) rows; unit rows for ``cosine``.
        centroids: (K, d) centres; unit rows for ``cosine``.
        ratio: cap factor, > 1.
        metric: ``sqeuclidean`` (the published one) or ``cosine`` (``1 - x.c``, the spherical path).
        topk: candidate centroids per point in the first pass (>= 1).
        weights: int (N,) positive load per point (tokens), or None to count points.

    Returns:
        (labels int32 (N,) in 0..K-1, cap): every cluster holds at most ``cap`` points (no weights), or its load
        minus its last point's weight is below ``cap`` (weights).

    Raises:
        ValueError: ratio <= 1, unknown metric, topk < 1, shape mismatch, weights not positive integers of
            shape (N,).
    """
    xm, cent = _as_matrix(x), _as_matrix(centroids, "centroids")
    if not ratio > 1:
        raise ValueError(f"ratio must be > 1, got {ratio!r}")
    if metric not in ("sqeuclidean", "cosine") or int(topk) < 1 or cent.shape[1] != xm.shape[1]:
        raise ValueError(f"bad soft-cap arguments: metric={metric!r}, topk={topk!r}, "
                         f"centroids {cent.shape} for rows {xm.shape}")
    n, k = xm.shape[0], cent.shape[0]
    wt = _check_weights(weights, n)
    cap = math.ceil(_exact(ratio) * (n if wt is None else int(wt.sum())) / k)
    t = min(int(topk), k)
    idx, dist = _candidates(xm, cent, metric, t)
    when = np.empty(n * t, dtype=np.int64)
    when[np.argsort(dist.ravel(), kind="stable")] = np.arange(n * t)
    labels = _greedy_capped(idx, when.reshape(n, t), np.full(k, cap, dtype=np.int64), wt)
    left = np.flatnonzero(labels < 0)
    if left.size:  # every one of their topk candidates was full: search all centroids, in index order
        placed = labels >= 0
        room = cap - np.bincount(labels[placed], weights=None if wt is None else wt[placed], minlength=k)
        full, _ = _candidates(xm[left], cent, metric, k)
        step = np.broadcast_to(np.arange(left.size, dtype=np.int64)[:, None], full.shape)
        labels[left] = _greedy_capped(full, step, room.astype(np.int64), None if wt is None else wt[left])
    left = np.flatnonzero(labels < 0)
    if left.size:  # the published last resort; cap * K >= total load makes it unreachable for ratio > 1
        labels[left] = np.argmin(_centre_distances(xm[left], cent, metric), axis=1)
    return labels.astype(np.int32), cap


def capped_labels(x, labels, centroids, ratio, metric, weights=None) -> tuple[np.ndarray, Optional[int]]:
    """:func:`soft_cap_labels` when the largest cluster is above ``ratio * N / K`` (the published trigger in
    ``_kmeans_prune_equalize_interleave``; with ``weights``, its load above ``ratio * sum(weights) / K``), else
    the labels unchanged and no cap.

    Args:
        x, centroids, metric, weights: as :func:`soft_cap_labels`.
        labels: int (N,) the clusters before the cap, 0..K-1.
        ratio: the cap factor (> 1), or None for no cap.

    Returns:
        ``(labels int32 (N,), cap)``: ``cap`` None when the cap did not fire (labels returned as given).
    """
    k = centroids.shape[0]
    if ratio is None:
        return labels, None
    wt = _check_weights(weights, labels.shape[0])
    load = np.bincount(labels, weights=wt, minlength=k)
    total = labels.shape[0] if wt is None else int(wt.sum())
    if load.max() <= _exact(ratio) * total / k:
        return labels, None
    return soft_cap_labels(x, centroids, ratio, metric, weights=wt)


def _check_weights(weights, n: int) -> np.ndarray | None:
    """``weights`` as int64 (n,) of positive integers (None stays None), else ValueError."""
    if weights is None:
        return None
    w = np.asarray(weights)
    if w.shape != (n,) or not np.issubdtype(w.dtype, np.integer) or (w.size and int(w.min()) < 1):
        raise ValueError(f"weights must be positive integers of shape ({n},) (tokens per row), got "
                         f"{w.dtype} {w.shape}" + (f" with minimum {w.min()}" if w.size and w.ndim == 1 else ""))
    return w.astype(np.int64, copy=False)


def _exact(ratio: float) -> Fraction:
    """The ratio as the decimal the user wrote: ceil(1.1 * 100 / 2) is 55, not 56 as in floating point (the
    published code's ``np.ceil((1.0 + eps) * (N / K))``; the two agree for its eps = 0.5)."""
    return Fraction(repr(float(ratio)))
