"""The streamed cluster stage: spherical k-means over feature shards that never meet in one array on the driver.

Above ``sketch.stream_rows`` (:func:`ray_cluster_ft.features.stream_features`) the features stay in their Parquet
shards (:class:`~ray_cluster_ft.features.FeatureShards`). The driver fits the centres on the same seeded samples
as the in-memory :func:`~ray_cluster_ft.cluster.kmeans.spherical_kmeans` (gathered from the shards), and every
pass over the rows is a Ray Data ``map_batches`` over the shards, one CPU task per shard
(:mod:`ray_cluster_ft.cluster.passes`): validation and the samples, assignment and float64 cluster sums, the merge
of small clusters' rows, the distances. The driver holds per-row scalars only (labels, distances: 8 bytes a row)
and the (k, d) sums. Jobs of at most max(``MINIBATCH_THRESHOLD``, ``FIT_ROWS``) rows, whose in-memory fit sees
every row, gather every row (at most 200k rows) and run the in-memory clustering itself, and so do jobs of at most
``RESTART_ROWS`` (10^4) rows, where the in-memory fit restarts three times.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .kmeans import FIT_ROWS, MINIBATCH_THRESHOLD, RESTART_ROWS, ClusterResult, cluster_sketches, fit_sample_rows, resolve_k, sampled_centres
from .passes import assign_part, centroids_from_parts, check_part, distance_part, merge_plan, relabel_part, unit_part

__all__ = ["cluster_streamed", "run_streamed", "shard_pass"]

def shard_pass(batch: dict, kind: str, params) -> dict:
    """One streamed pass over the shards of ``batch`` (Ray Data's numpy batch of shard descriptors: ``shard``,
    ``file``, ``lo``, ``hi``), run in a Ray task; returns one row per shard: ``shard``, ``node`` (the Ray node id the
    task ran on) and ``payload`` (pickled numpy arrays).

    ``kind``: ``check`` (:func:`~ray_cluster_ft.cluster.passes.check_part` and the raw rows at ``params["rows"]``),
    ``assign`` (labels and sums, :func:`~ray_cluster_ft.cluster.passes.assign_part`), ``relabel``
    (:func:`~ray_cluster_ft.cluster.passes.relabel_part`), ``distance`` (own and nearest distances). ``params``: a
    dict, or a Ray object reference to one (the labels of every row travel once through the object store).
    """
    import ray
    from threadpoolctl import threadpool_limits

    from ..features import read_shard
    from ._vectors import nearest_distances

    p = ray.get(params) if isinstance(params, ray.ObjectRef) else params
    out = {"shard": [], "node": [], "payload": []}
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "driver"
    for s, f, lo, hi in zip(batch["shard"], batch["file"], batch["lo"], batch["hi"]):
        lo, hi = int(lo), int(hi)
        x = read_shard(str(f))["sketch"]
        with threadpool_limits(limits=1, user_api="blas"):  # one task per CPU: no BLAS threads on top
            if kind == "check":
                rows = np.asarray(p["rows"])
                take = rows[(rows >= lo) & (rows < hi)] - lo
                res = {"unit": check_part(x, lo), "rows": x[take]}
            else:
                xn = unit_part(x, p["all_unit"])
                if kind == "assign":
                    res = dict(zip(("labels", "sums", "sizes"), assign_part(xn, p["centres"])))
                elif kind == "relabel":
                    res = dict(zip(("labels", "sums", "sizes"), relabel_part(
                        xn, p["labels"][lo:hi], p["new_id"], p["centroids"], p["k"])))
                else:
                    own = distance_part(xn, p["labels"][lo:hi], p["centroids"])
                    res = {"dist": own, "near": nearest_distances(xn, p["centroids"], "cosine")[1]}
        out["shard"].append(int(s))
        out["node"].append(node)
        out["payload"].append(pickle.dumps(res, protocol=5))
    return {"shard": np.asarray(out["shard"], dtype=np.int64), "node": np.asarray(out["node"], dtype=object),
            "payload": np.asarray(out["payload"], dtype=object)}


def _run_pass(shards, kind: str, params, nodes: dict) -> list[dict]:
    """:func:`shard_pass` over every shard as a Ray Data ``map_batches`` (one shard a batch, one CPU a task);
    the payloads in shard order. ``nodes`` counts the shards each node ran (over all passes)."""
    import ray
    import ray.data

    if not ray.is_initialized():
        raise RuntimeError("the streamed clustering runs its passes on Ray: call ray.init() (the pipeline does)")
    items = [{"shard": i, "file": f, "lo": int(lo), "hi": int(hi)}
             for i, (f, lo, hi) in enumerate(zip(shards.files, shards.offsets[:-1], shards.offsets[1:]))]
    try:
        rows = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            shard_pass, fn_kwargs={"kind": kind, "params": params}, batch_size=1, batch_format="numpy",
            num_cpus=1).take_all()
    except Exception as err:  # noqa: BLE001 - a bad row's ValueError comes back wrapped by Ray: raise it as is
        bad = _user_error(err)
        if bad is None:
            raise
        raise bad from None
    rows.sort(key=lambda r: int(r["shard"]))
    if [int(r["shard"]) for r in rows] != list(range(len(items))):
        raise RuntimeError(f"streamed clustering: the {kind} pass returned shards {[int(r['shard']) for r in rows][:5]}"
                           f"..., expected 0..{len(items) - 1}")
    for r in rows:
        nodes[str(r["node"])] = nodes.get(str(r["node"]), 0) + 1
    return [pickle.loads(r["payload"]) for r in rows]


def _user_error(err: BaseException) -> ValueError | None:
    """The ValueError a shard task raised (bad features), found in the chain Ray wraps it in (or in the
    traceback text Ray keeps when it cannot rebuild the chain), else None."""
    seen, texts = set(), []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ValueError):
            return ValueError(str(err))
        texts.append(str(err))
        err = getattr(err, "cause", None) or err.__cause__
    lines = [ln.strip() for t in texts for ln in t.splitlines() if ln.strip().startswith("ValueError: ")]
    return ValueError(lines[-1].removeprefix("ValueError: ")) if lines else None


def _gather(shards, rows: np.ndarray, nodes: dict) -> tuple[np.ndarray, bool]:
    """The raw rows at ``rows`` (ascending positions), float32 (len(rows), d), and whether every row of every
    shard has unit norm; every shard is validated on the way (:func:`~ray_cluster_ft.cluster.passes.check_part`)."""
    parts = _run_pass(shards, "check", {"rows": rows}, nodes)
    x = np.concatenate([p["rows"] for p in parts]) if rows.size else np.empty((0, shards.dim), np.float32)
    return x, all(p["unit"] for p in parts)


def _stack(parts: list[dict], key: str) -> np.ndarray:
    return np.concatenate([p[key] for p in parts])


def _centroids(shards, parts, labels, fallback, nodes, all_unit) -> np.ndarray:
    """Centroids from the passes' summed sums; a degenerate cluster's from its first member's unit row."""
    sums = np.sum([p["sums"] for p in parts], axis=0)
    sizes = np.sum([p["sizes"] for p in parts], axis=0)
    centroids, degenerate = centroids_from_parts(sums, sizes, fallback)
    if degenerate.any():
        first = np.asarray([int(np.flatnonzero(labels == c)[0]) for c in np.flatnonzero(degenerate)])
        order = np.argsort(first)
        rows, _ = _gather(shards, first[order], nodes)
        centroids[np.flatnonzero(degenerate)[order]] = unit_part(rows, all_unit)
    return centroids


def cluster_streamed(shards, k="auto", world_size: int = 1, seed: int = 0, min_cluster_size: int = 2,
                     fit_rows: int = FIT_ROWS, minibatch_rows: int = MINIBATCH_THRESHOLD
                     ) -> tuple[ClusterResult, np.ndarray, dict]:
    """:func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches` (``spherical``, no cap) over feature shards, the
    rows read shard by shard in Ray tasks; the same labels, centroids and distances as the in-memory clustering of
    the shards' rows for the same seed (the same samples, float64 cluster sums).

    Args:
        shards: :class:`~ray_cluster_ft.features.FeatureShards` (candidate order).
        k, world_size, seed, min_cluster_size: as :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches`.
        fit_rows, minibatch_rows: as :func:`~ray_cluster_ft.cluster.kmeans.spherical_kmeans` (tests lower them).

    Returns:
        ``(ClusterResult, near, nodes)``: ``near`` float32 (N,) each row's distance to its nearest final
        centroid (the map's p95), ``nodes`` the shards each Ray node ran, over all passes (node id -> count).

    Raises:
        ValueError: as :func:`~ray_cluster_ft.cluster.kmeans.cluster_sketches` (NaN/inf or zero rows; bad k).
        RuntimeError: Ray is not started; a pass lost a shard.
    """
    from ._vectors import _check_k

    n = shards.n_rows
    kk = _check_k(resolve_k(k, n, world_size), n)
    nodes: dict = {}
    init_rows, fit = fit_sample_rows(n, kk, seed, fit_rows, minibatch_rows)
    if fit is None or n <= RESTART_ROWS:  # the in-memory fit sees every row, or restarts: only all rows match it
        x, _ = _gather(shards, np.arange(n), nodes)
        res = cluster_sketches(x, kk, world_size, seed, min_cluster_size, fit_rows=fit_rows,
                               minibatch_rows=minibatch_rows)
        near = _near_of(x, res.centroids)
        return res, near, nodes
    wanted = np.union1d(init_rows, fit)
    x, all_unit = _gather(shards, wanted, nodes)
    xs = unit_part(x, all_unit)
    centres = sampled_centres(xs[np.searchsorted(wanted, init_rows)], xs[np.searchsorted(wanted, fit)], kk, seed)
    del x, xs
    parts = _run_pass(shards, "assign", {"all_unit": all_unit, "centres": centres}, nodes)
    labels = _stack(parts, "labels")
    centroids = _centroids(shards, parts, labels, centres, nodes, all_unit)
    new_id, n_merged = merge_plan(np.bincount(labels, minlength=kk), min_cluster_size)
    k_final = int(new_id.max()) + 1
    if n_merged:
        import ray

        ref = ray.put({"all_unit": all_unit, "labels": labels, "new_id": new_id, "centroids": centroids,
                       "k": k_final})
        parts = _run_pass(shards, "relabel", ref, nodes)
        labels = _stack(parts, "labels")
        centroids = _centroids(shards, parts, labels, np.zeros((k_final, shards.dim), np.float32), nodes, all_unit)
    import ray

    ref = ray.put({"all_unit": all_unit, "labels": labels, "centroids": centroids})
    parts = _run_pass(shards, "distance", ref, nodes)
    res = ClusterResult(labels=labels, dist=_stack(parts, "dist"), centroids=centroids, k=k_final,
                        n_merged_clusters=n_merged)
    return res, _stack(parts, "near"), nodes


def _near_of(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    from ._vectors import _normalise_rows, nearest_distances

    return nearest_distances(_normalise_rows(x), centroids, "cosine")[1]


def run_streamed(cfg, run_dir: Path, *, shards, example_ids, resume: bool = False, features: dict | None = None):
    """The cluster stage of a streamed job (:func:`ray_cluster_ft.cluster.stage.run` without the features in
    memory): :func:`cluster_streamed` with the job's ``clustering`` settings and world size, ``clusters.parquet``
    and ``centroids.parquet`` written as :func:`~ray_cluster_ft.cluster.stage.run` writes them.

    Args:
        cfg: the job config (``clustering`` with ``algorithm: spherical``, no ``from_run``, no
            ``max_cluster_ratio``: :func:`ray_cluster_ft.features.streaming_unsupported` sends other jobs to the
            in-memory stage).
        run_dir: the run directory.
        shards: the feature stage's :class:`~ray_cluster_ft.features.FeatureShards`.
        example_ids: the candidates' ids in shard order (a ``pyarrow`` string array or anything it takes).
        resume: the stopped run's ``clusters.parquet`` must hold the same assignment.
        features: the feature stage's summary (recorded in the map).

    Returns:
        :class:`~ray_cluster_ft.cluster.stage.ClusterOutput`; its summary adds ``streamed: true`` and ``nodes``
        (the shards each Ray node ran, over every pass).

    Raises:
        ConfigError: as :func:`~ray_cluster_ft.cluster.stage.run`; a clustering setting the streamed stage does
            not offer.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..config import ConfigError
    from ..rundir import claim, same_as_before
    from .stage import CENTROIDS_FILE, finish_clusters, save_cluster_map

    c = cfg.clustering
    if c.algorithm != "spherical" or c.from_run or c.max_cluster_ratio is not None:
        raise ConfigError("the streamed cluster stage offers clustering.algorithm: spherical without from_run and "
                          "max_cluster_ratio; raise sketch.stream_rows to cluster in memory")
    res, near, nodes = cluster_streamed(shards, c.k, cfg.train.num_workers, c.seed, c.min_cluster_size)
    table = pa.table({"example_id": pa.array(example_ids, type=pa.string()), "cluster": res.labels.astype(np.int32),
                      "distance": res.dist.astype(np.float32)})
    if resume:
        same_as_before(run_dir / "clusters.parquet", table, ["example_id", "cluster"])
    pq.write_table(table, claim(run_dir, "clusters.parquet"))
    meta = save_cluster_map(claim(run_dir, CENTROIDS_FILE), None, res.labels, res.centroids, res.algorithm,
                            features, near=near)
    out = finish_clusters(cfg, res, meta)
    out.summary.update(streamed=True, nodes=nodes)
    return out
