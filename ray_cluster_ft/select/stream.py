"""The streamed select stage: the within-cluster choice in Ray tasks that read their clusters' rows from the
feature shards, a few clusters at a time, so the driver never holds the features.

Quotas come from the cluster sizes (or token totals) alone, exactly as :func:`~ray_cluster_ft.select.quotas.select`
computes them. The clusters with a quota are cut, in ascending order, into waves whose rows' features fit
``wave_bytes`` (and at least two waves per CPU of the Ray cluster); one Ray task a wave reads every shard, keeps its clusters' rows (in candidate order) and calls
:func:`~ray_cluster_ft.select.quotas.select_cluster` on each cluster, as the in-memory selection does. Strategies
and within-cluster orders that read no feature (``random``, ``full``, ``peripheral``, ``central``, ``random``
inside clusters) need no task: the in-memory selection runs on the labels and distances alone.
"""

from __future__ import annotations

import numpy as np

from ..config import ConfigError
from .quotas import (SelectionResult, equalize_count, group_quotas, select_cluster, token_budget_count,
                     water_fill_quotas)
from .within import DISTANCE_ORDERS

__all__ = ["group_task", "select_streamed", "wave_task"]

_WAVE_BYTES = 1 << 30  # float32 feature bytes a selection task holds at most (plus one shard)


def wave_task(files, offsets, clusters, quotas, labels, dist, n_tokens, params: dict) -> dict:
    """One wave of clusters (run as a Ray task): their rows gathered from every shard, then each cluster's picks.

    Returns ``{"chosen": [int64 candidate positions per cluster], "reasons": [list[str] per cluster], "node"}``.
    """
    from threadpoolctl import threadpool_limits

    from ..features import read_shard

    want = np.zeros(int(labels.max()) + 1, dtype=bool)
    want[np.asarray(clusters)] = True
    pos = np.flatnonzero(want[labels])  # the wave's rows, ascending: filled shard by shard into one array
    x = np.empty((pos.size, int(params["dim"])), dtype=np.float32)
    for f, lo, hi in zip(files, offsets[:-1], offsets[1:]):
        a, b = np.searchsorted(pos, [lo, hi])
        if b > a:
            x[a:b] = read_shard(f)["sketch"][pos[a:b] - lo]
    lab = labels[pos]
    out = {"chosen": [], "reasons": []}
    limit = 1 if params["within"] == "kcenter" else None  # as the in-memory selection: k-center on one thread
    with threadpool_limits(limits=limit, user_api="blas"):
        for c, q in zip(clusters, quotas):
            m = np.flatnonzero(lab == c)  # ascending candidate order, as in memory
            nt_c = None if n_tokens is None else n_tokens[pos[m]]
            loc, why = select_cluster(x[m], dist[pos[m]], int(q), params["within"], params["dedup_threshold"],
                                      params["seed"], int(c), nt_c)
            out["chosen"].append(pos[m][loc])
            out["reasons"].append(list(why))
    out["node"] = _node()
    return out


def group_task(files, offsets, labels, k: int, rows) -> dict:
    """The sufficient statistics of ``selection.groups`` over some shards (run as a Ray task): float64 (k, d)
    per-cluster sums of unit rows and the unit rows at the silhouette positions ``rows`` that fall in these
    shards (:func:`~ray_cluster_ft.select.quotas.groups_from_sums`). Returns ``{"sums", "sample", "node"}``."""
    from threadpoolctl import threadpool_limits

    from ..features import read_shard
    from .quotas import unit_rows64

    rows = np.asarray(rows, dtype=np.int64)
    sums, sample = None, []
    with threadpool_limits(limits=1, user_api="blas"):
        for f, lo, hi in zip(files, offsets[:-1], offsets[1:]):
            xn = unit_rows64(read_shard(f)["sketch"])
            if sums is None:
                sums = np.zeros((k, xn.shape[1]))
            np.add.at(sums, labels[lo:hi], xn)
            sample.append(xn[rows[(rows >= lo) & (rows < hi)] - lo])
    return {"sums": sums, "sample": np.concatenate(sample), "node": _node()}


def _node() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (a test calling a task's body directly)
        return "driver"


def _groups_streamed(cfg, shards, lab: np.ndarray, nodes: dict) -> np.ndarray:
    """``selection.groups`` of a streamed job: one pass of Ray tasks (two per CPU) over the shards for the
    clusters' sums of unit rows and the silhouette sample, then
    :func:`~ray_cluster_ft.select.quotas.groups_from_sums` on the driver: the in-memory
    :func:`~ray_cluster_ft.select.quotas.cluster_groups` of the shards' rows, with (k, d) and 2,048 rows held."""
    import ray

    from .quotas import groups_from_sums, silhouette_rows

    k = int(lab.max()) + 1
    rows = silhouette_rows(lab.size, cfg.selection.seed)
    n_tasks = max(1, min(len(shards.files), 2 * int(ray.cluster_resources().get("CPU", 1))))
    cuts = np.linspace(0, len(shards.files), n_tasks + 1).round().astype(int)
    task = ray.remote(num_cpus=1)(group_task)
    lab_ref = ray.put(lab)
    outs = ray.get([task.remote(list(shards.files[a:b]), np.asarray(shards.offsets[a:b + 1]), lab_ref, k, rows)
                    for a, b in zip(cuts[:-1], cuts[1:]) if b > a])
    for o in outs:
        nodes[o["node"]] = nodes.get(o["node"], 0) + 1
    sums = np.sum([o["sums"] for o in outs], axis=0)
    return groups_from_sums(sums, np.concatenate([o["sample"] for o in outs]), lab[rows], cfg.selection.groups)


def _quotas(cfg, labels: np.ndarray, n_tokens, groups=None) -> tuple[np.ndarray, int, int | None, np.ndarray | None]:
    """``(quotas (k,), requested, tokens requested or None, token array or None)`` of ``balanced`` (flat, or over
    ``groups`` first) and ``equalize``, as :func:`~ray_cluster_ft.select.stage.select_with_config` asks
    :func:`select` for them."""
    from ..config import budget_count

    s = cfg.selection
    sizes = np.bincount(labels).astype(np.int64)

    def fill(totals, want):
        p = s.size_power
        return water_fill_quotas(totals, want, p) if groups is None else group_quotas(totals, groups, want, p)

    if s.strategy == "equalize":
        m = int(sizes[0]) if sizes.size == 1 else equalize_count(sizes, s.ratio)
        return np.full(sizes.size, m, dtype=np.int64), m * sizes.size, None, None
    if s.budget_tokens is not None:
        nt = np.asarray(n_tokens, dtype=np.int64)
        want = token_budget_count(s.budget_tokens, int(nt.sum()))
        return fill(np.bincount(labels, weights=nt).astype(np.int64), want), 0, want, nt
    want = budget_count(s.budget, labels.size)
    return fill(sizes, want), want, None, None


def _waves(quotas: np.ndarray, sizes: np.ndarray, dim: int, wave_bytes: int, min_waves: int = 1) -> list[np.ndarray]:
    """The clusters with a quota, in ascending order, cut into consecutive waves of at most ``wave_bytes`` float32
    feature bytes (a cluster larger than that is a wave alone), and into at least ``min_waves`` waves where there
    are that many clusters (so every CPU gets a task)."""
    total = int(sizes[quotas > 0].sum()) * dim * 4
    wave_bytes = max(1, min(wave_bytes, -(-total // max(1, min_waves))))
    waves, cur, held = [], [], 0
    for c in np.flatnonzero(quotas):
        b = int(sizes[c]) * dim * 4
        if cur and held + b > wave_bytes:
            waves.append(np.asarray(cur))
            cur, held = [], 0
        cur.append(int(c))
        held += b
    if cur:
        waves.append(np.asarray(cur))
    return waves


def select_streamed(cfg, shards, labels: np.ndarray, dist: np.ndarray, n_tokens=None,
                    wave_bytes: int = _WAVE_BYTES) -> tuple:
    """:func:`~ray_cluster_ft.select.stage.select_with_config` over feature shards: the same
    :class:`~ray_cluster_ft.select.quotas.SelectionResult` as the in-memory selection of the shards' rows.

    Args:
        cfg: the job config (``selection``; ``groups`` takes one more pass of Ray tasks over the shards).
        shards: :class:`~ray_cluster_ft.features.FeatureShards`, candidate order.
        labels: int ``(N,)`` clusters 0..k-1; dist: float32 ``(N,)`` distances to the own centroid.
        n_tokens: int ``(N,)`` tokens per candidate (a token budget).
        wave_bytes: feature bytes one task gathers at most.

    Returns:
        ``(SelectOutput, nodes)``: the select stage's output and the tasks each Ray node ran.

    Raises:
        ConfigError: as :func:`~ray_cluster_ft.select.stage.select_with_config`.
    """
    import ray

    from .stage import SelectOutput, select_with_config

    s = cfg.selection
    lab = np.asarray(labels).astype(np.int64)
    nodes: dict = {}
    groups = None
    if s.groups is not None and s.strategy == "balanced":
        groups = _groups_streamed(cfg, shards, lab, nodes)
    if s.strategy in ("random", "full") or s.within in DISTANCE_ORDERS:
        # Zero-width features: these choices read the labels and distances only (and the groups, found above).
        return select_with_config(cfg, n_candidates=lab.size, sketches=np.empty((lab.size, 0), np.float32),
                                  labels=lab, dist=dist, n_tokens=n_tokens, groups=groups), nodes
    quotas, requested, tokens, nt = _quotas(cfg, lab, n_tokens, groups)
    sizes = np.bincount(lab, minlength=quotas.size)
    refs = [ray.put(a) for a in (lab, np.asarray(dist, np.float32), nt)]
    task = ray.remote(num_cpus=1)(wave_task)
    params = {"within": s.within, "dedup_threshold": s.dedup_threshold, "seed": s.seed, "dim": shards.dim}
    # Two waves per CPU: the CPUs share the work, and a slow wave is not left alone at the end.
    waves = _waves(quotas, sizes, shards.dim, wave_bytes, 2 * int(ray.cluster_resources().get("CPU", 1)))
    outs = ray.get([task.remote(list(shards.files), shards.offsets, w, quotas[w], *refs, params) for w in waves])
    chosen, why = [], []
    for o in outs:
        nodes[o["node"]] = nodes.get(o["node"], 0) + 1
        chosen += o["chosen"]
        why += [r for rs in o["reasons"] for r in rs]
    idx = np.concatenate(chosen).astype(np.int64) if chosen else np.empty(0, np.int64)
    reasons = np.asarray(why, dtype=str)
    srt = np.argsort(idx, kind="stable")
    if nt is not None:
        picked = np.bincount(lab[idx], minlength=quotas.size).astype(np.int64)
        res = SelectionResult(idx[srt], reasons[srt], picked, quotas, groups=groups)
        t = cfg.train
        need = t.num_workers * t.grad_accum * (1 if cfg.packed else t.micro_batch_size)
        if idx.size < need:
            raise ConfigError(f"selection.budget_tokens={s.budget_tokens} ({tokens} tokens) selects {idx.size} "
                              f"examples, fewer than one optimizer step needs ({need}); raise the budget")
        return SelectOutput(int(idx.size), res, tokens), nodes
    return SelectOutput(int(requested), SelectionResult(idx[srt], reasons[srt], quotas, groups=groups)), nodes
