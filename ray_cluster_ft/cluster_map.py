"""Cluster maps reused across runs (``clustering.from_run``, docs/design.md "Cluster").

Every clustering run saves its map, ``centroids.parquet`` (:func:`save_cluster_map`): one row per cluster
(``cluster`` int32, ``size`` int64, ``centroid`` fixed_size_list<float32>[d]) and, in the Parquet key-value
metadata under ``ray_cluster_ft``, what a later run needs to trust it: the algorithm (so the metric: cosine for
``spherical``, squared Euclidean for ``kmeans``), the 95th percentile of the rows' distances to their nearest
centroid, and the features it was made from (the store key of :mod:`ray_cluster_ft.features.feature_store`:
settings, model content fingerprint, device kind; the ``last_layer`` normalisation).

A later job with ``clustering.from_run: RUN_DIR`` loads that map (:func:`load_cluster_map`), refuses features
of another kind (:func:`check_features`, naming the mismatch), assigns every row to its nearest centroid in the
map's metric (:func:`assign_to_map`; a row that run clustered keeps its cluster there, :func:`map_labels`), and
measures drift (:func:`drift`): the share of the rows that are new to the map (ids absent from that run's
``clusters.parquet``) lying farther from every centroid than that run's 95th percentile. Above ``clustering.max_drift`` the manifest and report suggest clustering again. With
``clustering.refit: true`` k-means is warm-started from the map's centroids (:func:`ray_cluster_ft.clustering.refit_kmeans`) instead.

Pure functions except :func:`save_cluster_map`, :func:`load_cluster_map` and :func:`map_labels` (file I/O).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .capped_kmeans import _CHUNK_ROWS, _as_matrix, _centre_distances, _normalise_rows

__all__ = [
    "CENTROIDS_FILE",
    "ClusterMap",
    "assign_to_map",
    "check_features",
    "drift",
    "load_cluster_map",
    "map_labels",
    "nearest_distances",
    "save_cluster_map",
]

CENTROIDS_FILE = "centroids.parquet"
"""The cluster map's file in a run directory."""

_META_KEY = b"ray_cluster_ft"
_FORMAT = 1


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


def nearest_distances(x: np.ndarray, centroids: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest centroid and its distance, in chunks of rows.

    Args:
        x: float32 ``(N, d)``: unit rows for ``cosine``.
        centroids: float32 ``(k, d)``: unit rows for ``cosine``.
        metric: ``cosine`` (``1 - x.c``, clipped to [0, 2]) or ``sqeuclidean`` (``|x|^2 + |c|^2 - 2 x.c``, the
            published ``_sqdist_matrix_chunk``, clipped at 0).

    Returns:
        ``(labels int64 (N,), distance float32 (N,))``; ties go to the lower centroid index.
    """
    labels = np.empty(x.shape[0], dtype=np.int64)
    dist = np.empty(x.shape[0], dtype=np.float32)
    for lo in range(0, x.shape[0], _CHUNK_ROWS):
        d = _centre_distances(x[lo:lo + _CHUNK_ROWS], centroids, metric)
        lab = np.argmin(d, axis=1)
        labels[lo:lo + _CHUNK_ROWS] = lab
        dist[lo:lo + _CHUNK_ROWS] = d[np.arange(len(lab)), lab]
    hi = 2.0 if metric == "cosine" else np.inf
    return labels, np.clip(dist, 0.0, hi)


def _rows_for(x, algorithm: str) -> np.ndarray:
    """The rows as the algorithm sees them: unit rows for ``spherical`` (zero rows refused), as given for
    ``kmeans``."""
    arr = _as_matrix(x)
    return _normalise_rows(arr) if algorithm == "spherical" else arr


def save_cluster_map(path: Path, x, labels: np.ndarray, centroids: np.ndarray, algorithm: str,
                     features: dict | None = None) -> dict:
    """Write a run's cluster map to ``path`` (``centroids.parquet``), atomically (temporary name, then rename).

    Args:
        path: the file to write.
        x: ``(N, d)`` the features clustered (as given to the clustering; normalised here for ``spherical``).
        labels: int ``(N,)`` the final clusters, 0..k-1.
        centroids: ``(k, d)`` the final centroids.
        algorithm: ``spherical`` or ``kmeans``.
        features: the feature stage's ``feature_key``, ``feature_key_of`` and ``normalisation`` (its summary),
            or ``None``.

    Returns:
        The metadata written (``format``, ``algorithm``, ``metric``, ``k``, ``dim``, ``rows``,
        ``p95_distance``, ``features``).
    """
    import os
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    cent = np.ascontiguousarray(centroids, dtype=np.float32)
    xs = _rows_for(x, algorithm)
    metric = "cosine" if algorithm == "spherical" else "sqeuclidean"
    _, near = nearest_distances(xs, cent, metric)
    f = features or {}
    of = f.get("feature_key_of") or {}
    meta = {"format": _FORMAT, "algorithm": algorithm, "metric": metric, "k": int(cent.shape[0]),
            "dim": int(cent.shape[1]), "rows": int(xs.shape[0]), "p95_distance": float(np.percentile(near, 95)),
            "features": {"key": f.get("feature_key"), "settings": of.get("settings"), "model": of.get("model"),
                         "gpu": of.get("gpu"), "normalisation": f.get("normalisation")}}
    table = pa.table({
        "cluster": pa.array(np.arange(cent.shape[0], dtype=np.int32)),
        "size": pa.array(np.bincount(np.asarray(labels), minlength=cent.shape[0]).astype(np.int64)),
        "centroid": pa.FixedSizeListArray.from_arrays(pa.array(cent.reshape(-1)), cent.shape[1]),
    }).replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return meta


def load_cluster_map(run_dir: str | Path) -> ClusterMap:
    """Read the cluster map of an earlier run (``RUN_DIR/centroids.parquet``).

    Raises:
        ConfigError: ``run_dir`` does not exist, is not a ray-cluster-ft run directory (no run marker), holds no
            ``centroids.parquet`` (it did not cluster, or ran before maps were saved), or the file is not a
            cluster map of this format. Each message names the path and the fault.
    """
    import pyarrow.parquet as pq

    from .config import ConfigError
    from .rundir import read_ledger

    where = f"clustering.from_run {run_dir}"
    d = Path(run_dir).expanduser()
    if not d.exists():
        raise ConfigError(f"{where}: no such directory")
    if not d.is_dir() or read_ledger(d) is None:
        raise ConfigError(f"{where}: not a ray-cluster-ft run directory (no run marker); give the output.dir of an "
                          f"earlier run")
    path = d / CENTROIDS_FILE
    if not path.is_file():
        raise ConfigError(f"{where}: the run holds no cluster map ({CENTROIDS_FILE}): it did not cluster, or it ran "
                          f"before cluster maps were saved; run it again, or cluster afresh (drop from_run)")
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {})[_META_KEY])
        col = table.column("centroid").combine_chunks()
        cent = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), col.type.list_size)
        sizes = table.column("size").to_numpy().astype(np.int64)
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, the message says which file
        raise ConfigError(f"{where}: {path} is not a readable cluster map ({type(err).__name__}: {err})") from None
    if meta.get("format") != _FORMAT or meta.get("algorithm") not in ("spherical", "kmeans") \
            or cent.shape != (meta.get("k"), meta.get("dim")):
        raise ConfigError(f"{where}: {path} is not a cluster map of format {_FORMAT} (metadata {meta})")
    return ClusterMap(cent, sizes, meta["algorithm"], float(meta["p95_distance"]), meta.get("features") or {},
                      str(d.resolve()))


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
    from .config import ConfigError

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


def map_labels(run_dir: str, example_ids, k: int) -> np.ndarray:
    """int64 ``(N,)``: each id's cluster in the map's run (``run_dir/clusters.parquet``, whose cluster ids are the
    map's centroid rows), -1 for ids that run never clustered (new rows); all -1 when that file is missing.

    Raises:
        ConfigError: the file's clusters are not in 0..k-1 (it does not belong to the map).
    """
    import pandas as pd
    import pyarrow.parquet as pq

    from .config import ConfigError

    path = Path(run_dir) / "clusters.parquet"
    ids = np.asarray(example_ids).astype(str)
    if not path.is_file():
        return np.full(len(ids), -1, dtype=np.int64)
    old = pq.read_table(path, columns=["example_id", "cluster"])
    lab = old.column("cluster").to_numpy().astype(np.int64)
    if len(lab) and (lab.min() < 0 or lab.max() >= k):
        raise ConfigError(f"clustering.from_run {run_dir}: clusters.parquet names clusters outside the map's 0..{k - 1}")
    where = pd.Index(old.column("example_id").to_numpy(zero_copy_only=False).astype(str)).get_indexer(ids)
    return np.where(where >= 0, lab[np.maximum(where, 0)], -1)
