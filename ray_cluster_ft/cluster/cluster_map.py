"""Cluster maps reused across runs (``clustering.from_run``, docs/design.md "Cluster"): the pure part.

Every clustering run saves its map, ``centroids.parquet`` (:func:`ray_cluster_ft.cluster.stage.save_cluster_map`):
one row per cluster (``cluster`` int32, ``size`` int64, ``centroid`` fixed_size_list<float32>[d]) and, in the
Parquet key-value metadata under ``ray_cluster_ft``, what a later run needs to trust it (:func:`map_metadata`):
the algorithm (so the metric: cosine for ``spherical``, squared Euclidean for ``kmeans``), the 95th percentile of
the rows' distances to their nearest centroid, and the features it was made from (the store key of
:mod:`ray_cluster_ft.features.feature_store`: settings, model content fingerprint, device kind; the
``last_layer`` normalisation).

A later job with ``clustering.from_run: RUN_DIR`` loads that map
(:func:`ray_cluster_ft.cluster.stage.load_cluster_map`), refuses features of another kind (:func:`check_features`,
naming the mismatch), assigns every row to its nearest centroid in the map's metric (:func:`assign_to_map`; a row
that run clustered keeps its cluster there, :func:`ray_cluster_ft.cluster.stage.map_labels`), and measures drift
(:func:`drift`): the share of the rows that are new to the map (ids absent from that run's ``clusters.parquet``)
lying farther from every centroid than that run's 95th percentile. Above ``clustering.max_drift`` the manifest
and report suggest clustering again. With ``clustering.refit: true`` k-means is warm-started from the map's
centroids (:func:`ray_cluster_ft.cluster.kmeans.refit_kmeans`) instead. :func:`cluster_from_map` does all of it.

Pure functions: the files are read and written by :mod:`ray_cluster_ft.cluster.stage`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._vectors import (
    _as_matrix,
    _centroids_of,
    _normalise_rows,
    _own_distance,
    _sq_distance,
    nearest_distances,
)
from .capped import capped_labels
from .kmeans import ClusterResult, refit_kmeans

__all__ = [
    "ClusterMap",
    "assign_to_map",
    "check_features",
    "cluster_from_map",
    "drift",
    "map_metadata",
    "nearest_distances",
]

MAP_FORMAT = 1
"""The layout version a cluster map's metadata records (``format``)."""


@dataclass(frozen=True)
class ClusterMap:
    """A saved cluster map.

    Attributes:
        centroids: float32 ``(k, d)``: unit rows for ``spherical``.
        sizes: int64 ``(k,)`` rows per cluster in the run that made it.
        algorithm: ``spherical`` or ``kmeans``.
        p95_distance: 95th percentile of that run's rows' distance to their nearest centroid (``1 - cos`` for
            ``spherical``, squared Euclidean for ``kmeans``).
        features: what the features were: ``{"key", "settings", "model", "gpu", "normalisation"}`` (values
            ``None`` where the run did not record them).
        run_dir: the run directory it was read from (``None`` for a map not read from disk).
    """

    centroids: np.ndarray
    sizes: np.ndarray
    algorithm: str
    p95_distance: float
    features: dict
    run_dir: str | None = None

    @property
    def metric(self) -> str:
        """``cosine`` (spherical) or ``sqeuclidean`` (kmeans): the map's distance."""
        return "cosine" if self.algorithm == "spherical" else "sqeuclidean"


def _rows_for(x, algorithm: str) -> np.ndarray:
    """The rows as the algorithm sees them: unit rows for ``spherical`` (zero rows refused), as given for
    ``kmeans``."""
    arr = _as_matrix(x)
    return _normalise_rows(arr) if algorithm == "spherical" else arr


def map_metadata(x, centroids: np.ndarray, algorithm: str, features: dict | None = None, near=None) -> dict:
    """What a saved map records about itself (the metadata of ``centroids.parquet``).

    Args:
        x: ``(N, d)`` the features clustered (as given to the clustering; normalised here for ``spherical``).
        centroids: float32 ``(k, d)`` the final centroids.
        algorithm: ``spherical`` or ``kmeans``.
        features: the feature stage's ``feature_key``, ``feature_key_of`` and ``normalisation`` (its summary),
            or ``None``.
        near: float32 ``(N,)`` each row's distance to its nearest centroid when the caller has it (the streamed
            clustering, whose features are not in memory); ``x`` is then unused (may be None).

    Returns:
        ``{"format", "algorithm", "metric", "k", "dim", "rows", "p95_distance", "features"}``: ``p95_distance`` the
        95th percentile of the rows' distance to their nearest centroid in the map's metric.
    """
    cent = np.ascontiguousarray(centroids, dtype=np.float32)
    metric = "cosine" if algorithm == "spherical" else "sqeuclidean"
    if near is None:
        _, near = nearest_distances(_rows_for(x, algorithm), cent, metric)
    f = features or {}
    of = f.get("feature_key_of") or {}
    return {"format": MAP_FORMAT, "algorithm": algorithm, "metric": metric, "k": int(cent.shape[0]),
            "dim": int(cent.shape[1]), "rows": int(len(near)), "p95_distance": float(np.percentile(near, 95)),
            "features": {"key": f.get("feature_key"), "settings": of.get("settings"), "model": of.get("model"),
                         "gpu": of.get("gpu"), "normalisation": f.get("normalisation")}}


def check_features(cmap: ClusterMap, dim: int, algorithm: str, settings: dict, features: dict | None) -> None:
    """Refuse features the map was not made from.

    Args:
        cmap: the loaded map.
        dim: this job's feature size.
        algorithm: this job's ``clustering.algorithm``.
        settings: this job's feature settings (:func:`~ray_cluster_ft.features.feature_store.feature_settings`).
        features: this job's feature stage summary (``feature_key_of``, ``normalisation``), or ``None`` (then the
            model is not compared: the library API passes features it did not compute).

    Raises:
        ConfigError: naming every mismatch: the feature size, the algorithm, each ``sketch.*`` setting that
            differs, the model fingerprint, the device kind, the ``last_layer`` normalisation.
    """
    from ..config import ConfigError

    bad = []
    if dim != cmap.centroids.shape[1]:
        bad.append(f"features of dimension {dim}, the map's centroids of dimension {cmap.centroids.shape[1]}")
    if algorithm != cmap.algorithm:
        bad.append(f"clustering.algorithm {algorithm!r}, the map's {cmap.algorithm!r}")
    old = cmap.features or {}
    if old.get("settings"):
        for k in sorted(set(old["settings"]) | set(settings)):
            if old["settings"].get(k) != settings.get(k):
                bad.append(f"sketch.{k} {settings.get(k)!r}, the map's {old['settings'].get(k)!r}")
    if features is not None:
        of = features.get("feature_key_of") or {}
        if old.get("model") and of.get("model") and old["model"] != of["model"]:
            bad.append(f"features from another model (fingerprint {of['model']}, the map's {old['model']})")
        if old.get("gpu") is not None and of.get("gpu") is not None and old["gpu"] != of["gpu"]:
            kind = {True: "GPU", False: "CPU"}
            bad.append(f"features computed on the {kind[of['gpu']]}, the map's on the {kind[old['gpu']]}")
        if old.get("normalisation") != features.get("normalisation"):
            bad.append(f"feature normalisation {features.get('normalisation')!r}, the map's "
                       f"{old.get('normalisation')!r} (last_layer: train.num_workers 1 vs more)")
    if bad:
        raise ConfigError(f"clustering.from_run {cmap.run_dir}: its cluster map does not fit this job's features: "
                          + "; ".join(bad))


def assign_to_map(x, cmap: ClusterMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row's nearest centroid of the map, in the map's metric.

    Args:
        x: ``(N, d)`` features (normalised here for a ``spherical`` map).
        cmap: the map.

    Returns:
        ``(rows, labels int64 (N,), distance float32 (N,))``: ``rows`` float32 ``(N, d)`` as the metric sees
        them (unit rows for ``spherical``).

    Raises:
        ValueError: as the clustering's input checks (2-D, finite; non-zero rows for ``spherical``).
    """
    xs = _rows_for(x, cmap.algorithm)
    labels, dist = nearest_distances(xs, cmap.centroids, cmap.metric)
    return xs, labels, dist


def drift(distance: np.ndarray, p95_distance: float, new: np.ndarray, max_drift: float) -> dict:
    """How far the rows new to a map lie from it.

    Args:
        distance: float ``(N,)`` each row's distance to its nearest map centroid.
        p95_distance: the map's 95th-percentile distance (of the rows it was made from).
        new: bool ``(N,)`` rows the map's run did not have.
        max_drift: ``clustering.max_drift``.

    Returns:
        ``{"p95_distance", "rows", "new_rows", "new_beyond_p95", "share_new_beyond_p95" (None without new
        rows), "share_all_beyond_p95", "max_drift", "suggest_recluster"}``: ``suggest_recluster`` is
        ``share_new_beyond_p95 > max_drift``. By construction about 5% of the map's own rows lie beyond p95.
    """
    far = np.asarray(distance) > p95_distance
    new = np.asarray(new, dtype=bool)
    n_new = int(new.sum())
    share = float(far[new].mean()) if n_new else None
    return {"p95_distance": float(p95_distance), "rows": int(far.size), "new_rows": n_new,
            "new_beyond_p95": int(far[new].sum()), "share_new_beyond_p95": share,
            "share_all_beyond_p95": float(far.mean()) if far.size else 0.0, "max_drift": float(max_drift),
            "suggest_recluster": bool(share is not None and share > max_drift)}


def cluster_from_map(x, cmap, known: np.ndarray, *, refit: bool = False, min_cluster_size: int = 2,
                     max_cluster_ratio: float | None = None, max_drift: float = 0.2, seed: int = 0,
                     weights: np.ndarray | None = None) -> ClusterResult:
    """Cluster with an earlier run's map (``clustering.from_run``) instead of from scratch.

    A row the map's run clustered keeps its cluster there (``known``: k-means stops near, not at, the fixed point
    where every row's cluster is its nearest centroid, so re-assigning would move a few old rows); every new row
    goes to its nearest map centroid in the map's metric (:func:`assign_to_map`: cosine
    for a ``spherical`` map, squared Euclidean for ``kmeans``), and the drift of the new rows is measured against
    the map's 95th-percentile distance (:func:`drift`). With ``refit``, k-means
    is then warm-started from the map's centroids (:func:`refit_kmeans`). Then as
    :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`: clusters left empty are dropped, for ``spherical``
    those below ``min_cluster_size`` are dissolved into their nearest surviving centroid (point-wise); the map's centroids are
    kept as they are (with ``refit``, recomputed after a merge); the soft cap applies; distances are to the final
    centroids.

    Args:
        x: ``(N, d)`` features.
        cmap: :class:`ClusterMap`.
        known: int ``(N,)`` each row's cluster in the map's run, -1 for a new row
            (:func:`ray_cluster_ft.cluster.stage.map_labels`).
        refit: warm-start k-means from the map.
        min_cluster_size, max_cluster_ratio, seed, weights: as :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`.
        max_drift: ``clustering.max_drift``.

    Returns:
        :class:`ClusterResult` with ``algorithm`` the map's and ``from_run`` filled.

    Raises:
        ValueError: as :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`' input checks; a feature size
            other than the map's; with ``refit``, more map centroids than rows.
    """
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
    labels, cap = capped_labels(xs, labels, centroids, max_cluster_ratio, metric, weights)
    dist = _own_distance(xs, labels, centroids) if spherical else _sq_distance(xs, labels, centroids)
    info["map_clusters"] = kept.tolist()
    return ClusterResult(labels=labels, dist=dist, centroids=centroids, k=int(kept.size),
                         n_merged_clusters=int(cmap.centroids.shape[0] - kept.size),
                         algorithm=cmap.algorithm, cap=cap, from_run=info)
