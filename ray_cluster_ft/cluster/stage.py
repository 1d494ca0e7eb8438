"""The cluster stage's edge: every file it reads or writes.

:func:`run` clusters the features (:func:`cluster_with_config`: from scratch, or with ``clustering.from_run`` on
that run's map), writes ``clusters.parquet`` and the run's own map, ``centroids.parquet``
(:func:`save_cluster_map`), for a later ``from_run``; :func:`load_cluster_map` and :func:`map_labels` read an
earlier run's map and assignment. The algorithms are pure: :mod:`.kmeans`, :mod:`.capped`, :mod:`.cluster_map`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .cluster_map import MAP_FORMAT, ClusterMap, check_features, cluster_from_map, map_metadata
from .kmeans import ClusterResult, cluster_sketches

__all__ = [
    "CENTROIDS_FILE",
    "ClusterOutput",
    "cap_weights",
    "cluster_with_config",
    "clustering_warning",
    "drift_warning",
    "finish_clusters",
    "load_cluster_map",
    "map_labels",
    "run",
    "save_cluster_map",
]

CENTROIDS_FILE = "centroids.parquet"
"""The cluster map's file in a run directory."""

_META_KEY = b"ray_cluster_ft"


@dataclass(frozen=True)
class ClusterOutput:
    """What the cluster stage hands on.

    Attributes:
        result: the :class:`~ray_cluster_ft.cluster.kmeans.ClusterResult` (labels, distances, centroids, k).
        summary: the manifest's ``clustering`` entry (k, merged clusters, sizes, ``algorithm``, ``p95_distance``
            of the map written; ``capped``, ``cap`` and ``cap_by`` when the soft cap fired; ``from_run``; the
            :func:`clustering_warning` and drift warning when there are any).
    """

    result: ClusterResult
    summary: dict

    @property
    def labels(self) -> np.ndarray:
        """int32 ``(N,)``: each candidate's cluster, 0..k-1."""
        return self.result.labels

    @property
    def dist(self) -> np.ndarray:
        """float32 ``(N,)``: each candidate's distance to its own centroid."""
        return self.result.dist


def save_cluster_map(path: Path, x, labels: np.ndarray, centroids: np.ndarray, algorithm: str,
                     features: dict | None = None, near=None) -> dict:
    """Write a run's cluster map to ``path`` (``centroids.parquet``), atomically (temporary name, then rename).

    Args:
        path: the file to write.
        x: ``(N, d)`` the features clustered (as given to the clustering; normalised here for ``spherical``).
        labels: int ``(N,)`` the final clusters, 0..k-1.
        centroids: ``(k, d)`` the final centroids.
        algorithm: ``spherical`` or ``kmeans``.
        features: the feature stage's ``feature_key``, ``feature_key_of`` and ``normalisation`` (its summary),
            or ``None``.
        near: each row's distance to its nearest centroid, instead of ``x`` (see
            :func:`~ray_cluster_ft.cluster.cluster_map.map_metadata`).

    Returns:
        The metadata written (:func:`~ray_cluster_ft.cluster.cluster_map.map_metadata`).
    """
    import os
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    cent = np.ascontiguousarray(centroids, dtype=np.float32)
    meta = map_metadata(x, cent, algorithm, features, near=near)
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

    from ..rundir import read_ledger

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
    if meta.get("format") != MAP_FORMAT or meta.get("algorithm") not in ("spherical", "kmeans") \
            or cent.shape != (meta.get("k"), meta.get("dim")):
        raise ConfigError(f"{where}: {path} is not a cluster map of format {MAP_FORMAT} (metadata {meta})")
    return ClusterMap(cent, sizes, meta["algorithm"], float(meta["p95_distance"]), meta.get("features") or {},
                      str(d.resolve()))


def map_labels(run_dir: str, example_ids, k: int) -> np.ndarray:
    """int64 ``(N,)``: each id's cluster in the map's run (``run_dir/clusters.parquet``, whose cluster ids are the
    map's centroid rows), -1 for ids that run never clustered (new rows); all -1 when that file is missing.

    Raises:
        ConfigError: the file's clusters are not in 0..k-1 (it does not belong to the map).
    """
    import pandas as pd
    import pyarrow.parquet as pq

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
    return by if by != "auto" else ("tokens" if cfg.packed else "rows")


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
    """:func:`run` without the files it writes (also :func:`ray_cluster_ft.select_and_plan`'s):
    :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`
    with the job's ``clustering`` settings and world size, and the ``clusters.parquet`` table. With
    ``clustering.from_run`` it reads that run's map and assignment (``centroids.parquet``, ``clusters.parquet``:
    the only files it reads) and assigns to it (:func:`~ray_cluster_ft.cluster.cluster_map.cluster_from_map`; ``k`` is then the map's).

    Args:
        cfg: the job config (``clustering`` section; ``train.num_workers``; ``sketch`` for ``from_run``).
        example_ids: str ``(N,)`` candidate ids, in the order of ``sketches``.
        sketches: float ``(N, d)``.
        features: the feature stage's summary (``feature_key``, ``feature_key_of``, ``normalisation``): with
            ``from_run`` the map's features must match it (:func:`~ray_cluster_ft.cluster.cluster_map.check_features`);
            ``None`` compares only the feature size and ``sketch`` settings.
        n_tokens: int ``(N,)`` tokens per row, for a cap that counts tokens (:func:`cap_weights`).

    Returns:
        ``(ClusterResult, pyarrow.Table)``: the table has ``example_id`` (string), ``cluster`` (int32),
        ``distance`` (float32).

    Raises:
        ValueError: as :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`.
        ConfigError: ``from_run`` is missing, not a run, has no map, or its features do not match (named).
    """
    import pyarrow as pa

    c = cfg.clustering
    weights = cap_weights(cfg, n_tokens) if c.max_cluster_ratio is not None else None
    if c.from_run:
        from ..features.feature_store import feature_settings

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
        features: dict | None = None, n_tokens: np.ndarray | None = None) -> ClusterOutput:
    """The cluster stage's edge: :func:`cluster_with_config` on the features (from scratch, or with
    ``clustering.from_run`` on that run's map), ``clusters.parquet`` written (``example_id``, ``cluster`` int32,
    ``distance`` float32 to the final centroid: ``1 - cos`` for ``clustering.algorithm: spherical``, the squared
    Euclidean distance for ``kmeans``) and the run's own map, ``centroids.parquet`` (:func:`save_cluster_map`),
    for a later ``from_run``.

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
        :class:`ClusterOutput`: the result and the manifest's ``clustering`` entry (k, merged clusters, sizes,
        ``algorithm``, ``capped: true``, ``cap`` and ``cap_by`` (rows or tokens) when the soft cap fired,
        ``p95_distance`` of the map written, ``from_run`` (``ClusterResult.from_run``) and the
        :func:`clustering_warning` and drift warning when there are any).

    Raises:
        ConfigError: (``resume``) the assignment changed; ``from_run`` unusable (see :func:`cluster_with_config`);
            fewer clusters than ranks after merging with
            ``allocation.strategy: cluster`` (unless ``allocation.allow_shared_clusters``), or a cluster count
            other than the world size with ``cluster_per_rank``.
    """
    import pyarrow.parquet as pq

    from ..rundir import claim, same_as_before

    res, table = cluster_with_config(cfg, example_ids, sketches, features, n_tokens)
    if resume:
        same_as_before(run_dir / "clusters.parquet", table, ["example_id", "cluster"])
    pq.write_table(table, claim(run_dir, "clusters.parquet"))
    meta = save_cluster_map(claim(run_dir, CENTROIDS_FILE), sketches, res.labels, res.centroids, res.algorithm,
                            features)
    return finish_clusters(cfg, res, meta)


def finish_clusters(cfg, res: ClusterResult, meta: dict) -> ClusterOutput:
    """:func:`run`'s last part, shared with the streamed clustering (:mod:`ray_cluster_ft.cluster.stream`): the
    manifest's ``clustering`` entry from the result and the map's metadata, the warnings printed, and the
    refusals of too few clusters (see :func:`run`'s Raises)."""
    c = cfg.clustering
    W = cfg.train.num_workers
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
    return ClusterOutput(res, summary)
