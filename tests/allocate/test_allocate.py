"""The allocation plan: hard rules, balance goals and metrics (ray_cluster_ft.allocate)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ray_cluster_ft.allocate import PLAN_COLUMNS, check_plan, make_plan, plan_metrics


def _ids(n):
    return np.array([f"ex{i:06d}" for i in range(n)])


def _synthetic(n, k, seed=0, lo=8, hi=600):
    rng = np.random.default_rng(seed)
    return _ids(n), rng.integers(0, k, n), rng.integers(lo, hi, n)


def _rules_hold(res, ids, clusters, n_tokens, w, b, g, epochs):
    """Every hard rule of the plan, asserted from the frame alone."""
    plan = res.plan
    assert list(plan.columns) == PLAN_COLUMNS
    check_plan(plan, w, b, g)
    unit = w * b * g
    n = len(ids)
    kept = n - (n % unit)
    assert len(res.dropped) == n % unit < unit
    assert res.n_requested == n
    assert len(plan) == kept * epochs
    mb = plan.groupby(["rank", "step", "micro_index"]).size()
    assert (mb == b).all()
    assert set(mb.groupby(level="rank").size()) == {kept * epochs // (w * b)}
    kept_ids = set(ids) - set(res.dropped)
    assert len(kept_ids) == kept and set(res.dropped) <= set(ids)
    steps_per_epoch = kept // unit
    for e in range(epochs):
        part = plan[plan["epoch"] == e]
        assert part["example_id"].is_unique and set(part["example_id"]) == kept_ids
        assert part["step"].min() == e * steps_per_epoch and part["step"].max() == (e + 1) * steps_per_epoch - 1
    # The iterator order: rank, epoch, step, micro_index.
    keys = plan[["rank", "epoch", "step", "micro_index"]].to_numpy()
    assert (np.diff(keys @ np.array([10**12, 10**9, 10**3, 1])) >= 0).all()
    # Rows carry the input's cluster and length.
    ref = pd.DataFrame({"example_id": ids, "c": clusters, "t": n_tokens}).set_index("example_id")
    joined = ref.loc[plan["example_id"]]
    np.testing.assert_array_equal(joined["c"].to_numpy(), plan["cluster"].to_numpy())
    np.testing.assert_array_equal(joined["t"].to_numpy(), plan["n_tokens"].to_numpy())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cluster_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    w=st.integers(1, 8),
    b=st.integers(1, 8),
    g=st.integers(1, 4),
    epochs=st.integers(1, 2),
    strategy=st.sampled_from(["cluster", "random", "length"]),
    seed=st.integers(0, 2**16),
)
def test_plan_properties(cluster_sizes, w, b, g, epochs, strategy, seed):
    rng = np.random.default_rng(seed)
    clusters = rng.permutation(np.repeat(np.arange(len(cluster_sizes)), cluster_sizes))
    n = clusters.size
    ids = _ids(n)
    n_tokens = rng.integers(1, 2000, n)
    if n < w * b * g:
        with pytest.raises(ValueError, match="no micro-batch"):
            make_plan(ids, clusters, n_tokens, w, b, g, epochs, strategy, seed)
        return
    res = make_plan(ids, clusters, n_tokens, w, b, g, epochs, strategy, seed)
    _rules_hold(res, ids, clusters, n_tokens, w, b, g, epochs)
    m = plan_metrics(res.plan, w)
    assert m["critical_path_tokens"] >= m["critical_path_bound_tokens"] > 0  # a lower bound for every plan
    if strategy == "length" and g == 1:
        assert m["critical_path_vs_bound"] == 1.0  # the sorted cut is the optimum


@settings(max_examples=60, deadline=None)
@given(
    mbs_per_cluster=st.lists(st.integers(1, 10), min_size=1, max_size=12),
    w=st.integers(1, 8),
    b=st.integers(1, 4),
    g=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_collision_free_whenever_possible(mbs_per_cluster, w, b, g, seed):
    # Pure micro-batches only (sizes multiple of B, no pooling): a collision-free plan exists iff no cluster
    # has more micro-batches than there are slots (W micro-batches each); the plan must then find one.
    clusters = np.repeat(np.arange(len(mbs_per_cluster)), np.asarray(mbs_per_cluster) * b)
    n = clusters.size
    assume(n >= w * b * g)
    rng = np.random.default_rng(seed)
    n_tokens = rng.integers(1, 3000, n)
    res = make_plan(_ids(n), clusters, n_tokens, w, b, g, strategy="cluster", seed=seed, pad_tolerance=1.0)
    per_cluster = res.plan.groupby("cluster").size() // b
    n_slots = len(res.plan) // (w * b)
    m = plan_metrics(res.plan, w)
    assert m["single_cluster_fraction"] == 1.0
    # Unavoidable collisions only: a cluster fits once per slot, every extra micro-batch is one collision.
    floor = int(np.maximum(per_cluster.to_numpy() - n_slots, 0).sum())
    assert round(m["collisions_per_step"] * m["steps"]) == floor


@pytest.mark.parametrize("strategy", ["cluster", "random", "length"])
def test_awkward_sizes(strategy):
    ids, clusters, n_tokens = _synthetic(103, 5)
    res = make_plan(ids, clusters, n_tokens, world_size=2, micro_batch_size=4, strategy=strategy)
    assert len(res.plan) == 96 and len(res.dropped) == 7
    assert res.plan.groupby("rank").size().tolist() == [48, 48]  # 12 micro-batches of 4 each
    _rules_hold(res, ids, clusters, n_tokens, 2, 4, 1, 1)


def test_drops_leftovers_that_cannot_fill_a_cluster_micro_batch():
    # Four clusters of 5 with micro-batches of 4: each cluster leaves one example over; W=2 keeps 16.
    ids = _ids(20)
    clusters = np.repeat(np.arange(4), 5)
    n_tokens = np.tile([100, 101, 102, 103, 200], 4)  # inside each cluster: four alike and one long
    res = make_plan(ids, clusters, n_tokens, world_size=2, micro_batch_size=4)
    dropped = np.isin(ids, res.dropped)
    assert dropped.sum() == 4
    assert sorted(clusters[dropped].tolist()) == [0, 1, 2, 3]  # one leftover per cluster
    assert (n_tokens[dropped] == 200).all()
    m = plan_metrics(res.plan, 2)
    assert m["single_cluster_fraction"] == 1.0 and m["collisions_per_step"] == 0.0


def test_tight_cluster_stays_collision_free():
    # W=4, B=2: 8 slots; the long cluster 0 has 8 micro-batches, so it must sit in every slot. A pure
    # cost-sorted walk would leave it for the end and collide; the tight-cluster rule must not.
    long = 2000 + 10 * np.repeat(np.arange(8), 2)
    short = 50 + np.repeat(np.arange(24), 2)
    n_tokens = np.concatenate([long, short])
    clusters = np.concatenate([np.zeros(16, int), 1 + np.arange(48) // 8])
    ids = _ids(64)
    res = make_plan(ids, clusters, n_tokens, world_size=4, micro_batch_size=2)
    m = plan_metrics(res.plan, 4)
    assert m["collisions_per_step"] == 0.0
    assert m["padding_fraction"] == 0.0
    per_step = res.plan[res.plan["cluster"] == 0].groupby("step")["rank"].nunique()
    assert per_step.size == 8 and (per_step == 1).all()


def test_cluster_plan_beats_random_on_synthetic_lengths():
    rng = np.random.default_rng(3)
    n = 4000
    clusters = rng.integers(0, 24, n)
    n_tokens = np.maximum(8, np.exp(rng.normal(5.0, 0.8, n))).astype(int)
    ids = _ids(n)
    for w, g in [(4, 1), (8, 2)]:
        cl = make_plan(ids, clusters, n_tokens, w, 4, g, epochs=2, seed=1)
        rd = make_plan(ids, clusters, n_tokens, w, 4, g, epochs=2, strategy="random", seed=1)
        mc, mr = plan_metrics(cl.plan, w), plan_metrics(rd.plan, w)
        assert mc["collisions_per_step"] == 0.0
        assert mc["token_imbalance_mean"] <= 1.05 < mr["token_imbalance_mean"]
        assert mc["padding_fraction"] <= 0.05 < mr["padding_fraction"]
        assert mc["critical_path_tokens"] <= 0.5 * mr["critical_path_tokens"]
        assert mc["steps"] == mr["steps"] == 2 * (n // (w * 4 * g))


@pytest.mark.parametrize("seed", range(6))
def test_mixed_micro_batches_do_not_make_clusters_tight(seed):
    # 310 rows, 16 random clusters, W=8 (9 slots): most micro-batches mix clusters, and keying them by their
    # majority made some cluster hold a micro-batch in nearly every slot, so its costly ones were forced into
    # cheap slots (the previous walk: 1.04-1.11x the critical-path bound, mean imbalance 1.13-1.22). Mixed
    # micro-batches are re-cut per slot instead; the plan must stay within 3% of the bound, collision-free.
    rng = np.random.default_rng(seed)
    n = 310
    clusters = rng.integers(0, 16, n)
    n_tokens = np.clip(np.exp(rng.normal(4.9, 0.45, n)), 60, 320).astype(int)
    m = plan_metrics(make_plan(_ids(n), clusters, n_tokens, 8, 4).plan, 8)
    assert m["collisions_per_step"] == 0.0
    assert m["critical_path_vs_bound"] <= 1.03
    assert m["token_imbalance_mean"] <= 1.11
    assert m["padding_fraction"] <= 0.05


def test_clusters_that_follow_length_stay_distinct():
    # Clusters nested in length quartiles (4 per quartile) with W=8: a slot of similar lengths holds at most
    # 4 clusters, so staying collision-free must mix quartiles; the plan keeps the clusters distinct and pays
    # in balance (reported), never the other way round.
    rng = np.random.default_rng(0)
    n = 1024
    n_tokens = np.clip(np.exp(rng.normal(5.0, 0.6, n)), 16, 2000).astype(int)
    quartile = np.searchsorted(np.quantile(n_tokens, [0.25, 0.5, 0.75]), n_tokens)
    clusters = quartile * 4 + rng.integers(0, 4, n)
    m = plan_metrics(make_plan(_ids(n), clusters, n_tokens, 8, 4).plan, 8)
    assert m["collisions_per_step"] == 0.0
    assert m["critical_path_vs_bound"] > 1.1  # the price of distinct clusters here


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 8),
    b=st.integers(1, 6),
    n_clusters=st.integers(1, 12),
    n_forbidden=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_repartition_gives_distinct_majorities(m, b, n_clusters, n_forbidden, seed):
    from ray_cluster_ft.allocate._slots import _majority, _repartition

    rng = np.random.default_rng(seed)
    rows = rng.permutation(200)[: m * b]
    code = rng.integers(0, n_clusters, 200)
    nt = rng.integers(1, 60, 200)  # few distinct lengths: ties are common
    forbidden = set(rng.choice(n_clusters, size=min(n_forbidden, n_clusters), replace=False).tolist())
    out = _repartition(rows, code, nt, forbidden, b)
    present = set(code[rows].tolist())
    if len(present) == rows.size and not present & forbidden:
        assert out is not None  # all rows distinct and allowed: the consecutive cut itself is a solution
    if len(present - forbidden) < m:
        assert out is None  # fewer allowed clusters than micro-batches: no solution exists
    if out is None:
        return
    assert out.shape == (m, b)
    assert sorted(out.ravel().tolist()) == sorted(rows.tolist())
    inner = np.argsort(nt[out], axis=1, kind="stable")  # as the plan orders a micro-batch
    keys = _majority(code[np.take_along_axis(out, inner, axis=1)])
    assert len(set(keys.tolist())) == m and not (set(keys.tolist()) & forbidden)


def test_repartition_finds_a_cut_when_clusters_are_plenty():
    from ray_cluster_ft.allocate._slots import _repartition

    # 4 micro-batches of 4 rows, 16 distinct clusters, one forbidden that heads no micro-batch of the
    # consecutive cut: the in-order cut keeps that cut (no padding beyond it).
    rows = np.arange(16)
    code = np.arange(16)
    nt = 100 + np.arange(16)
    out = _repartition(rows, code, nt, {14}, 4)
    assert out is not None
    padded = int(nt[out].max(axis=1).sum() * 4)
    consecutive = int(np.sort(nt)[::-1].reshape(4, 4).max(axis=1).sum() * 4)
    assert padded == consecutive


def test_critical_path_bound():
    # Known answer: W=2, B=2, G=1, lengths 10, 9, 5, 4, 3, 3, 2, 1: bands of 4 are (10, 9, 5, 4) and
    # (3, 3, 2, 1); the bound is B x (10 + 3) = 26 (> real tokens / W = 18.5), and the length plan meets it.
    ids = _ids(8)
    n_tokens = np.array([3, 10, 2, 9, 5, 1, 4, 3])
    res = make_plan(ids, np.zeros(8, int), n_tokens, 2, 2, strategy="length")
    m = plan_metrics(res.plan, 2)
    assert m["critical_path_bound_tokens"] == 26
    assert m["critical_path_tokens"] == 26 and m["critical_path_vs_bound"] == 1.0
    rd = plan_metrics(make_plan(ids, np.zeros(8, int), n_tokens, 2, 2, strategy="random", seed=1).plan, 2)
    assert rd["critical_path_bound_tokens"] == 26 and rd["critical_path_tokens"] >= 26
    # One step of all 8 rows (G=2): max(real / W = 18.5, B x 10 = 20) = 20. With B=1, G=4 the real-token
    # term binds: max(18.5, 1 x 10) = 18.5.
    g2 = plan_metrics(make_plan(ids, np.zeros(8, int), n_tokens, 2, 2, 2, strategy="length").plan, 2)
    assert g2["critical_path_bound_tokens"] == 20
    g4 = plan_metrics(make_plan(ids, np.zeros(8, int), n_tokens, 2, 1, 4, strategy="length").plan, 2)
    assert g4["critical_path_bound_tokens"] == 18.5 and g4["critical_path_tokens"] >= 18.5


def test_slots_are_shuffled_across_the_epoch():
    ids, clusters, n_tokens = _synthetic(2000, 10, seed=4)
    res = make_plan(ids, clusters, n_tokens, 4, 4, epochs=2, seed=0)
    plan = res.plan
    steps = plan["step"].max() + 1
    per_epoch = steps // 2
    for c in range(10):
        s = plan[(plan["cluster"] == c) & (plan["epoch"] == 0)]["step"]
        assert s.min() < 0.2 * per_epoch and s.max() > 0.8 * per_epoch  # visited throughout the epoch
    # Lengths mixed over the epoch, not sorted: the step loads are uncorrelated with the step index.
    load = plan[plan["epoch"] == 0].groupby("step")["n_tokens"].max()
    assert abs(np.corrcoef(load.index, load.to_numpy())[0, 1]) < 0.3
    # Epochs see different orders of the same examples.
    e0 = plan[plan["epoch"] == 0]["example_id"].to_numpy()
    e1 = plan[plan["epoch"] == 1]["example_id"].to_numpy()
    assert set(e0) == set(e1) and not np.array_equal(e0, e1)


def test_length_plan_cuts_sorted_lengths():
    # Known answer: every epoch's micro-batches are the kept examples sorted by length, cut in runs of B, so the
    # padded tokens are those of that cut; slots pair neighbouring micro-batches, so ranks stay balanced.
    rng = np.random.default_rng(5)
    n, w, b, g = 1003, 4, 4, 2
    ids, clusters = _ids(n), rng.integers(0, 9, n)
    n_tokens = np.maximum(8, np.exp(rng.normal(5.0, 0.8, n))).astype(int)
    res = make_plan(ids, clusters, n_tokens, w, b, g, epochs=2, strategy="length", seed=3)
    _rules_hold(res, ids, clusters, n_tokens, w, b, g, 2)
    kept = np.sort(n_tokens[~np.isin(ids, res.dropped)])
    ref_padded = int((b * kept.reshape(-1, b).max(axis=1)).sum())
    mb = res.plan.groupby(["epoch", "step", "rank", "micro_index"])["n_tokens"].agg(["max", "size", "min"])
    for e in (0, 1):
        part = mb.loc[e]
        assert int((part["max"] * part["size"]).sum()) == ref_padded
    lp = plan_metrics(res.plan, w)
    rd = plan_metrics(make_plan(ids, clusters, n_tokens, w, b, g, epochs=2, strategy="random", seed=3).plan, w)
    assert lp["padding_fraction"] < 0.05 < rd["padding_fraction"]
    assert lp["token_imbalance_mean"] <= 1.05 < rd["token_imbalance_mean"]
    # Steps are not in length order, and the epochs differ.
    load = res.plan[res.plan["epoch"] == 0].groupby("step")["n_tokens"].max()
    assert abs(np.corrcoef(load.index, load.to_numpy())[0, 1]) < 0.3
    e0, e1 = (res.plan[res.plan["epoch"] == e]["example_id"].to_numpy() for e in (0, 1))
    assert not np.array_equal(e0, e1)
    from ray_cluster_ft.config import parse_config

    assert parse_config({"allocation": {"strategy": "length"}}).allocation.strategy == "length"


@pytest.mark.parametrize("strategy", ["cluster", "random", "length"])
def test_same_seed_same_plan(strategy):
    ids, clusters, n_tokens = _synthetic(500, 7, seed=2)
    a = make_plan(ids, clusters, n_tokens, 3, 4, 2, 2, strategy, seed=11)
    b = make_plan(ids, clusters, n_tokens, 3, 4, 2, 2, strategy, seed=11)
    pd.testing.assert_frame_equal(a.plan, b.plan)
    assert a.plan.equals(b.plan)
    np.testing.assert_array_equal(a.dropped, b.dropped)
    bufs = []
    for res in (a, b):
        buf = io.BytesIO()
        res.plan.to_parquet(buf, engine="pyarrow", index=False)
        bufs.append(buf.getvalue())
    assert bufs[0] == bufs[1]
    c = make_plan(ids, clusters, n_tokens, 3, 4, 2, 2, strategy, seed=12)
    assert not a.plan.equals(c.plan)


def test_plan_metrics_known_answer():
    # One step, W=2, B=2, G=1: rank 0 gets lengths 10 and 10 (cluster 5), rank 1 gets 5 and 3 (cluster 5).
    plan = pd.DataFrame(
        {
            "epoch": [0, 0, 0, 0],
            "step": [0, 0, 0, 0],
            "rank": [0, 0, 1, 1],
            "micro_index": [0, 0, 0, 0],
            "example_id": ["a", "b", "c", "d"],
            "cluster": [5, 5, 5, 7],
            "n_tokens": [10, 10, 3, 5],
        }
    )
    m = plan_metrics(plan, 2)
    assert m["token_imbalance_mean"] == pytest.approx(20 / 15)
    assert m["token_imbalance_max"] == pytest.approx(20 / 15)
    assert m["padding_fraction"] == pytest.approx(1 - 28 / 30)
    assert m["critical_path_tokens"] == 20
    # Rank 1's tie (5 vs 7) goes to the cluster of its longest example, 7: two distinct clusters, no collision.
    assert m["collisions_per_step"] == 0.0
    plan.loc[3, "n_tokens"] = 2
    assert plan_metrics(plan, 2)["collisions_per_step"] == 1.0
    assert m["steps"] == 1 and m["micro_batches_per_rank"] == 1
    assert m["single_cluster_fraction"] == 0.5


def test_majority_rule_matches_brute_force():
    from ray_cluster_ft.allocate._slots import _majority

    rng = np.random.default_rng(0)
    for b in (1, 2, 3, 4, 7):
        keys = rng.integers(0, 4, (500, b))
        expect = []
        for row in keys:
            vals, cnt = np.unique(row, return_counts=True)
            top = set(vals[cnt == cnt.max()].tolist())
            expect.append([v for v in row.tolist() if v in top][-1])  # tie: the one that occurs last
        np.testing.assert_array_equal(_majority(keys), expect)


def test_check_plan_errors():
    ids, clusters, n_tokens = _synthetic(103, 5)
    plan = make_plan(ids, clusters, n_tokens, 2, 4).plan
    last = plan[(plan["rank"] == 1) & (plan["step"] == plan["step"].max())].index
    uneven = r"uneven plan: rank 1 has 11 micro-batches, rank 0 has 12; uneven counts hang"
    with pytest.raises(ValueError, match=uneven):
        check_plan(plan.drop(last), 2, 4, 1)
    with pytest.raises(ValueError, match="rank 2 has no micro-batches"):
        check_plan(plan, 3, 4, 1)
    with pytest.raises(ValueError, match="has 3 rows, expected micro_batch_size=4"):
        check_plan(plan.drop(plan.index[0]), 2, 4, 1)
    with pytest.raises(ValueError, match="outside"):
        check_plan(plan.assign(rank=plan["rank"] + 1), 2, 4, 1)
    with pytest.raises(ValueError, match="micro_index"):
        check_plan(plan, 2, 4, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=7, w=2, b=4), "no micro-batch"),
        (dict(w=0), "world_size"),
        (dict(b=0), "micro_batch_size"),
        (dict(g=0), "grad_accum"),
        (dict(epochs=0), "epochs"),
        (dict(strategy="greedy"), "strategy"),
        (dict(mismatch=True), "length mismatch"),
        (dict(dup=True), "duplicate"),
        (dict(zero_tokens=True), "n_tokens"),
    ],
)
def test_make_plan_errors(kwargs, match):
    n = kwargs.get("n", 40)
    ids, clusters, n_tokens = _synthetic(n, 3)
    if kwargs.get("mismatch"):
        clusters = clusters[:-1]
    if kwargs.get("dup"):
        ids[3] = ids[4]
    if kwargs.get("zero_tokens"):
        n_tokens[5] = 0
    with pytest.raises(ValueError, match=match):
        make_plan(
            ids, clusters, n_tokens, kwargs.get("w", 2), kwargs.get("b", 4), kwargs.get("g", 1),
            kwargs.get("epochs", 1), kwargs.get("strategy", "cluster"),
        )


# --- real token lengths ----------------------------------------------------------------------------------------


def _shared_data() -> Path:
    return Path(os.environ.get("RAY_CLUSTER_FT_SHARED_DATA", Path(__file__).parents[3] / "shared" / "data"))


@pytest.fixture(scope="module")
def real_selection():
    """31% of a seeded 6,000-row mix of the three data files, random labels k=32, real token lengths."""
    root = _shared_data()
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else []
    if not files:
        pytest.skip(f"real data not found at {root} (set RAY_CLUSTER_FT_SHARED_DATA)")
    rows = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    rng = np.random.default_rng(0)
    sample = rng.choice(len(rows), size=6000, replace=False)
    labels = rng.integers(0, 32, 6000)
    chosen = np.sort(rng.choice(6000, size=round(0.31 * 6000), replace=False))
    from ray_cluster_ft.model import load_tokenizer

    tok = load_tokenizer("demo")
    texts = [rows[sample[i]]["question"] + "\n" + rows[sample[i]]["answer"] for i in chosen]
    n_tokens = np.array([len(t) for t in tok(texts, return_attention_mask=False)["input_ids"]])
    ids = np.array([rows[sample[i]]["id"] for i in chosen])
    return ids, labels[chosen], n_tokens


def _sorted_cut_reference(plan: pd.DataFrame, world_size: int, b: int = 4) -> float:
    """Mean per-step max/mean of the cluster-blind cut with the shortest possible critical path (G = 1): the
    plan's kept lengths sorted, consecutive micro-batches of B, consecutive W per step. Any plan that keeps
    that critical path holds exactly these steps; lowering their imbalance further only pads the lighter ranks
    (more padded tokens, no shorter step)."""
    lengths = np.sort(plan[plan["epoch"] == 0]["n_tokens"].to_numpy())[::-1]
    cost = b * lengths.reshape(-1, world_size, b).max(axis=2)
    return float((cost.max(axis=1) / cost.mean(axis=1)).mean())


def _goals(mc: dict, mr: dict, reference: float, world_size: int) -> None:
    """Issue 4's goals on real lengths (random cluster labels, so clusters and lengths are independent)."""
    assert mc["collisions_per_step"] == 0.0
    assert mc["padding_fraction"] <= 0.05
    assert mc["critical_path_vs_bound"] <= 1.02  # within 2% of the best any plan can do
    # Goal 1.05. Where even the cluster-blind optimum misses it (one 5,402-token example among 8 ranks; the
    # demo's 9 steps of 32 rows), the bar is that optimum: the clusters must cost nothing on top.
    assert mc["token_imbalance_mean"] <= max(1.05, reference)
    if world_size == 4:
        assert mc["token_imbalance_mean"] <= 1.05
    assert mc["critical_path_tokens"] < mr["critical_path_tokens"]


@pytest.mark.parametrize("max_seq_len", [None, 2048])
@pytest.mark.parametrize("world_size", [4, 8])
def test_real_lengths_cluster_plan_vs_random(real_selection, world_size, max_seq_len):
    ids, labels, n_tokens = real_selection
    if max_seq_len is not None:  # what data.overlong='truncate' hands the allocator
        n_tokens = np.minimum(n_tokens, max_seq_len)
    cl = make_plan(ids, labels, n_tokens, world_size, 4, seed=0)
    rd = make_plan(ids, labels, n_tokens, world_size, 4, strategy="random", seed=0)
    mc, mr = plan_metrics(cl.plan, world_size), plan_metrics(rd.plan, world_size)
    cp_ratio = mc["critical_path_tokens"] / mr["critical_path_tokens"]
    reference = _sorted_cut_reference(cl.plan, world_size)
    print(
        f"\nW={world_size} max_seq_len={max_seq_len} cluster {json.dumps(mc)}\n"
        f"W={world_size} max_seq_len={max_seq_len} random  {json.dumps(mr)}\n"
        f"critical-path ratio {cp_ratio:.3f}; sorted-cut reference imbalance {reference:.4f}"
    )
    _goals(mc, mr, reference, world_size)
    assert cp_ratio <= 0.35
    if max_seq_len is not None:
        assert mc["token_imbalance_mean"] <= 1.05
    assert mr["padding_fraction"] > 0.3  # real lengths: a random split wastes a large share on padding
    assert mr["token_imbalance_mean"] > 1.3


# --- the demo data's real token lengths ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_selection():
    """31% of the demo data's training rows (max_seq_len 320, the demo tokenizer), random labels k=16."""
    from ray_cluster_ft.config import DataConfig
    from ray_cluster_ft.data import load_examples
    from ray_cluster_ft.model import load_tokenizer

    train = load_examples(DataConfig(source="demo", max_seq_len=320), load_tokenizer("demo")).train
    n_tokens = np.asarray(train.column("n_tokens").to_numpy(), dtype=np.int64)
    ids = np.asarray(train.column("example_id").to_pylist())
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 16, ids.size)
    chosen = np.sort(rng.choice(ids.size, size=round(0.31 * ids.size), replace=False))
    return ids[chosen], labels[chosen], n_tokens[chosen]


@pytest.mark.parametrize("world_size", [4, 8])
def test_demo_lengths_cluster_plan_vs_random(demo_selection, world_size):
    """Issue 4's goals on the demo data (about 310 selected rows, lengths 72..320 after truncation).

    The 0.35x critical-path goal is out of reach here for any plan: random's padding is only about 32% on
    these length-capped rows, so even a perfect plan (no padding, equal loads: real tokens / W per step)
    has 0.53x (W=4) and 0.48x (W=8) of random's critical path; the plan must come within 2% of the bound.
    With W=8 there are only 9 steps of 32 rows, and the widest length band (the top one) alone keeps even
    the cluster-blind optimum at 1.07 mean imbalance: the plan must not be worse than that.
    """
    ids, labels, n_tokens = demo_selection
    cl = make_plan(ids, labels, n_tokens, world_size, 4, seed=0)
    rd = make_plan(ids, labels, n_tokens, world_size, 4, strategy="random", seed=0)
    mc, mr = plan_metrics(cl.plan, world_size), plan_metrics(rd.plan, world_size)
    ideal = cl.plan["n_tokens"].sum() / world_size  # lower bound of any plan's critical path
    cp_ratio = mc["critical_path_tokens"] / mr["critical_path_tokens"]
    reference = _sorted_cut_reference(cl.plan, world_size)
    print(
        f"\ndemo W={world_size} cluster {json.dumps(mc)}\ndemo W={world_size} random  {json.dumps(mr)}\n"
        f"critical-path ratio {cp_ratio:.3f}; ideal ratio {ideal / mr['critical_path_tokens']:.3f}; "
        f"sorted-cut reference imbalance {reference:.4f}"
    )
    _goals(mc, mr, reference, world_size)
    assert mr["padding_fraction"] > 0.25
    assert mc["critical_path_tokens"] <= 1.12 * ideal
    assert mc["token_imbalance_mean"] < mr["token_imbalance_mean"]


def test_pad_tolerance_trades_padding_for_single_cluster_micro_batches(real_selection):
    """With clusters independent of length, a micro-batch of one cluster pads more: the tolerance sets how much
    padding a single-cluster micro-batch may keep before its rows are re-cut with other clusters' rows."""
    ids, labels, n_tokens = real_selection
    for w in (4, 8):
        m = {tol: plan_metrics(make_plan(ids, labels, n_tokens, w, 4, seed=0, pad_tolerance=tol).plan, w)
             for tol in (0.0, 0.05, 0.1, 1.0)}
        print(f"\nW={w} " + "; ".join(f"tol {t}: single-cluster {v['single_cluster_fraction']:.3f} padding "
                                      f"{v['padding_fraction']:.4f}" for t, v in m.items()))
        single = [m[t]["single_cluster_fraction"] for t in sorted(m)]
        padding = [m[t]["padding_fraction"] for t in sorted(m)]
        assert single == sorted(single) and padding == sorted(padding)
        assert all(v["collisions_per_step"] == 0.0 for v in m.values())
        assert m[0.1]["single_cluster_fraction"] >= 0.7 and m[0.1]["padding_fraction"] <= 0.05
        assert m[1.0]["single_cluster_fraction"] >= 0.95 and m[1.0]["padding_fraction"] > 0.1


def test_cluster_per_rank_gives_rank_r_only_cluster_r_reshuffled_every_epoch():
    from ray_cluster_ft.allocate import check_plan, make_plan, plan_metrics

    rng = np.random.default_rng(3)
    sizes = {7: 30, 2: 21, 5: 26}  # labels need not be 0..W-1: ascending label order maps to ranks
    cl = np.concatenate([np.full(n, c) for c, n in sizes.items()])
    ids = np.array([f"x{i}" for i in range(cl.size)])
    nt = rng.integers(3, 60, size=cl.size)
    res = make_plan(ids, cl, nt, 3, 4, grad_accum=2, epochs=3, strategy="cluster_per_rank", seed=9)
    plan = res.plan
    # 21 rows per rank (the smallest cluster, nothing rounded): micro-batches 4, 4, 4, 4, 4, 1 -> steps of
    # 2, 2, 2 micro-batches, for 3 epochs; the strict rules refuse the short micro-batch
    assert check_plan(plan, 3, 4, 2, short_tail=True) == 3 * 3
    with pytest.raises(ValueError, match="has 1 rows, expected micro_batch_size=4"):
        check_plan(plan, 3, 4, 2)
    mb = plan.groupby(["rank", "epoch", "step", "micro_index"]).size()
    assert mb.loc[0, 0].tolist() == [4, 4, 4, 4, 4, 1]
    assert plan.groupby("rank")["cluster"].unique().map(list).to_dict() == {0: [2], 1: [5], 2: [7]}
    assert len(res.dropped) == cl.size - 3 * 21 and set(res.dropped).isdisjoint(plan["example_id"])
    assert set(plan.loc[plan["rank"] == 0, "example_id"]) == set(ids[cl == 2])  # the smallest cluster whole
    for _, part in plan.groupby("epoch"):  # the same rows every epoch, each once
        assert part["example_id"].is_unique and set(part["example_id"]) == set(plan["example_id"])
    orders = [part[part["rank"] == 0]["example_id"].tolist() for _, part in plan.groupby("epoch")]
    assert orders[0] != orders[1] != orders[2]  # a fresh order per epoch
    assert plan_metrics(plan, 3)["collisions_per_step"] == 0.0
    again = make_plan(ids, cl, nt, 3, 4, grad_accum=2, epochs=3, strategy="cluster_per_rank", seed=9).plan
    pd.testing.assert_frame_equal(plan, again)


def test_cluster_per_rank_refuses_a_cluster_count_other_than_the_world_size():
    from ray_cluster_ft.allocate import make_plan

    ids = np.array([f"x{i}" for i in range(40)])
    with pytest.raises(ValueError, match="needs exactly world_size=2 clusters .* got 3"):
        make_plan(ids, np.arange(40) % 3, np.full(40, 5), 2, 4, strategy="cluster_per_rank")
    # a cluster of 3 rows: each rank trains 3, one short micro-batch per epoch
    small = make_plan(ids, (np.arange(40) < 3).astype(int), np.full(40, 5), 2, 4, strategy="cluster_per_rank").plan
    assert small.groupby("rank").size().tolist() == [3, 3]


def test_the_published_plan_of_less_than_one_step_runs_without_a_random_baseline(tmp_path):
    """The published plan rounds nothing: 2 ranks x 5 rows with B = 4, G = 2 is less than one whole step of a
    random split (16 rows), so the stage plans it and leaves the baseline out instead of failing."""
    from ray_cluster_ft.allocate import run
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.rundir import prepare_run_dir

    cfg = parse_config({"preset": "cluster-paper", "train": {"num_workers": 2, "micro_batch_size": 4,
                                                             "grad_accum": 2}})
    prepare_run_dir(tmp_path, False)
    ids = np.array([f"x{i}" for i in range(10)])
    out = run(cfg, tmp_path, example_ids=ids, labels=np.repeat([0, 1], 5), n_tokens=np.full(10, 7),
              selected=np.arange(10), reasons=["peripheral"] * 10)
    assert out.baseline is None and list(out.metrics) == ["cluster_per_rank"]
    assert out.plan.groupby("rank").size().tolist() == [5 * 1, 5 * 1]  # one epoch of 5 rows per rank
    assert pd.read_parquet(tmp_path / "selection.parquet")["weight"].tolist() == [1.0] * 10
