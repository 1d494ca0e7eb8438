"""``preset: cluster-paper`` with no other key against an independent transcription of the official code.

The reference below is written here, in plain numpy and scikit-learn, from kaist-dmlab/CluSTER
(``src/CluSTER/call_back.py``: ``_kmeans_prune_equalize_interleave``, ``kmeans_soft_cap_fit_predict``,
``PruneAndClusteringinwithMeanCallback.on_train_begin``; ``train_grad.py``'s defaults: ``seed=42``,
``ratio=100``, ``prune="close"``, ``dataloader_drop_last`` off): it shares no code with the product. The product
must give the same labels, the same kept rows, the same rows per rank (rank r trains cluster r) and the same
weights (the code's per-rank ``rank_weights = K * n_r / N``), with no key but the preset and the world size set.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ray_cluster_ft.api import select_and_plan
from ray_cluster_ft.config import parse_config

SEED, RATIO = 42, 100  # train_grad.py's defaults


def _sqdist(x, centers, labels):
    d = x - centers[labels]
    return np.einsum("nd,nd->n", d, d).astype(np.float32)


def _soft_cap(x, k, seed, eps=0.5, topk=8):
    """kmeans_soft_cap_fit_predict: KMeans again, then a greedy pass over (row, candidate) pairs by distance
    under the cap ceil((1 + eps) N / K), each row's topk nearest centres; a full search for what is left."""
    from sklearn.cluster import KMeans

    n = x.shape[0]
    km = KMeans(n_clusters=k, n_init=10, random_state=seed, max_iter=300, init="k-means++")
    km.fit_predict(x)
    centers = km.cluster_centers_.astype(np.float32)
    cap = int(np.ceil((1.0 + eps) * (n / k)))
    topk = min(topk, k)
    dist = np.sum(x * x, axis=1, keepdims=True) + np.sum(centers * centers, axis=1, keepdims=True).T \
        - 2.0 * (x @ centers.T)
    idx = np.argpartition(dist, kth=topk - 1, axis=1)[:, :topk]
    dsmall = np.take_along_axis(dist, idx, axis=1)
    order = np.argsort(dsmall, axis=1)
    idx, dsmall = np.take_along_axis(idx, order, axis=1), np.take_along_axis(dsmall, order, axis=1)
    labels = -np.ones(n, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    pairs_i = np.repeat(np.arange(n), topk)
    pairs_r = np.tile(np.arange(topk), n)
    for p in np.argsort(dsmall[pairs_i, pairs_r], kind="mergesort"):
        i, j = pairs_i[p], idx[pairs_i[p], pairs_r[p]]
        if labels[i] == -1 and counts[j] < cap:
            labels[i], counts[j] = j, counts[j] + 1
    for i in np.flatnonzero(labels == -1):
        j = next(j for j in np.argsort(dist[i]) if counts[j] < cap)
        labels[i], counts[j] = j, counts[j] + 1
    return labels, centers


def reference_selection(x: np.ndarray, world_size: int):
    """The official selection: ``(labels (N,), kept row indices per rank, weight per rank, soft cap fired)``."""
    from sklearn.cluster import KMeans

    n = x.shape[0]
    if world_size <= 1:
        return np.zeros(n, dtype=np.int64), [list(range(n))], [1.0], False
    km = KMeans(n_clusters=world_size, n_init=10, random_state=SEED)
    labels = km.fit_predict(x)
    centers = km.cluster_centers_
    sizes = np.bincount(labels, minlength=world_size)
    capped = bool(sizes.max() > sizes.sum() * 1.5 / world_size)
    if capped:
        labels, centers = _soft_cap(x, world_size, SEED)
    dists = _sqdist(x, centers, labels)
    by_cluster = [sorted(np.flatnonzero(labels == c).tolist(), key=lambda i: dists[i]) for c in range(world_size)]
    sizes = [len(c) for c in by_cluster]
    m = min(sizes) * RATIO // 100
    kept = [c[-m:] for c in by_cluster]  # prune "close": the rows farthest from the centre stay
    rank_weights = [world_size * s / sum(sizes) for s in sizes]
    return labels, kept, rank_weights, capped


def _features(sizes, dim=12, seed=0):
    """Unit rows (the published last-layer proxy is L2-normalised for W > 1) around len(sizes) directions."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sizes), dim))
    x = np.concatenate([c + 0.6 * rng.normal(size=(s, dim)) for c, s in zip(centres, sizes)])
    x = x[rng.permutation(x.shape[0])]
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("world, sizes, capped", [
    (2, (70, 50), False),
    (3, (40, 35, 30), False),
    (3, (110, 25, 20), True),  # one cluster above 1.5 N / K: the soft cap fires
])
def test_cluster_paper_preset_equals_the_official_selection(world, sizes, capped):
    x = _features(sizes, seed=world)
    n = x.shape[0]
    want_labels, want_kept, want_w, was_capped = reference_selection(x, world)
    assert was_capped == capped

    cfg = parse_config({"preset": "cluster-paper", "train": {"num_workers": world, "micro_batch_size": 4,
                                                             "grad_accum": 2}})
    assert (cfg.clustering.seed, cfg.selection.ratio) == (42, 1.0)
    ids = np.array([f"r{i:03d}" for i in range(n)])
    out = select_and_plan(x, np.full(n, 10), cfg, example_ids=ids)

    np.testing.assert_array_equal(out.clusters["cluster"].to_numpy(), want_labels)
    assert sorted(out.selection["example_id"]) == sorted(ids[np.concatenate(want_kept)])
    for r in range(world):
        epoch0 = out.plan[(out.plan["rank"] == r) & (out.plan["epoch"] == 0)]
        assert sorted(epoch0["example_id"]) == sorted(ids[want_kept[r]])  # rank r holds exactly cluster r's cut
    w = out.selection.set_index("example_id")["weight"]
    for r in range(world):
        np.testing.assert_allclose(w[ids[want_kept[r]]].to_numpy(), want_w[r], rtol=1e-12)
    m = len(want_kept[0])
    # no rounding: every rank has ceil(m / B) micro-batches, its last one short when B does not divide m
    mb = out.plan[out.plan["epoch"] == 0].groupby(["rank", "step", "micro_index"]).size()
    assert mb.groupby(level="rank").size().tolist() == [math.ceil(m / 4)] * world
    assert sorted(set(mb.tolist())) == sorted({4, m % 4 or 4})
    assert out.plan.groupby(["epoch", "example_id"]).size().eq(1).all()


def test_cluster_paper_preset_at_world_size_one_keeps_every_row_with_weight_one():
    x = _features((30, 17), seed=5)
    n = x.shape[0]
    labels, kept, weights, _ = reference_selection(x, 1)
    cfg = parse_config({"preset": "cluster-paper", "train": {"num_workers": 1, "micro_batch_size": 4}})
    ids = np.array([f"r{i:03d}" for i in range(n)])
    out = select_and_plan(x, np.full(n, 10), cfg, example_ids=ids)
    np.testing.assert_array_equal(out.clusters["cluster"].to_numpy(), labels)
    assert sorted(out.selection["example_id"]) == sorted(ids[kept[0]])
    assert (out.selection["weight"] == weights[0]).all()
    assert sorted(out.plan.loc[out.plan["epoch"] == 0, "example_id"]) == sorted(ids)
    # 47 rows, B = 4: 11 full micro-batches and one of 3
    assert out.plan[out.plan["epoch"] == 0].groupby(["step", "micro_index"]).size().tolist()[-1] == 3


def test_cluster_paper_ratio_075_and_05_cut_the_smallest_cluster_share():
    x = _features((60, 44), seed=2)
    n = x.shape[0]
    _, kept, _, _ = reference_selection(x, 2)
    smallest = min(len(k) for k in kept)
    ids = np.array([f"r{i:03d}" for i in range(n)])
    for ratio in (0.75, 0.5):
        cfg = parse_config({"preset": "cluster-paper", "selection": {"ratio": ratio},
                            "train": {"num_workers": 2, "micro_batch_size": 4}})
        out = select_and_plan(x, np.full(n, 10), cfg, example_ids=ids)
        assert out.selection["cluster"].value_counts().tolist() == [smallest * int(ratio * 100) // 100] * 2
