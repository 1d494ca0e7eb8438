"""Packed plans (allocation.packing), per-row collisions, and the per-epoch re-cut of the cluster plan."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ray_cluster_ft.allocate import check_plan, make_plan, plan_metrics
from ray_cluster_ft.allocate._light import _cut_rank, _light_collisions, _light_packs, _lpt, _rank_groups
from ray_cluster_ft.allocate._packs import _even_count, _pack_stats, bfd


def _bfd_reference(lengths, cap):
    """Best-fit by brute force: the open pack with the least room that holds the item (among equals, the one
    that came to that room first), else a new one."""
    rooms, since, out = [], [], []
    for t, x in enumerate(lengths):
        fits = [(room, since[i], i) for i, room in enumerate(rooms) if room >= x]
        if fits:
            _, _, i = min(fits)
        else:
            rooms.append(cap)
            since.append(0)
            i = len(rooms) - 1
        rooms[i] -= x
        since[i] = t
        out.append(i)
    return out


def test_bfd_known_answer_and_reference():
    # 6 -> new 0 (room 1); 5 -> new 1 (room 2); 4 -> new 2 (room 3); 3 -> pack 2 (exact); 2 -> pack 1; 1 -> pack 0
    assert bfd([6, 5, 4, 3, 2, 1], 7).tolist() == [0, 1, 2, 2, 1, 0]
    rng = np.random.default_rng(0)
    for _ in range(30):
        cap = int(rng.integers(8, 64))
        x = np.sort(rng.integers(1, cap + 1, int(rng.integers(1, 80))))[::-1]
        assert bfd(x, cap).tolist() == _bfd_reference(x.tolist(), cap)
        y = rng.integers(1, cap + 1, 50)  # any order, not only decreasing
        assert bfd(y, cap).tolist() == _bfd_reference(y.tolist(), cap)
    with pytest.raises(ValueError, match="exceeds the pack capacity"):
        bfd([5, 9], 8)


def _synthetic(n=3000, k=16, seed=0, cap_len=1024):
    rng = np.random.default_rng(seed)
    nt = np.clip(np.round(rng.lognormal(math.log(200.0), 0.6, n)), 8, cap_len).astype(np.int64)
    return np.array([f"e{i:05d}" for i in range(n)]), rng.integers(0, k, n), nt


@pytest.mark.parametrize("strategy", ["cluster", "random", "cluster_per_rank"])
@pytest.mark.parametrize("g", [1, 3])
def test_packed_plan_hard_rules(strategy, g):
    ids, cl, nt = _synthetic(n=1500)
    w, cap, epochs = 4, 2048, 2
    if strategy == "cluster_per_rank":
        cl = cl % w
    res = make_plan(ids, cl, nt, w, 4, g, epochs, strategy=strategy, seed=3, packing=True,
                    max_tokens_per_micro_batch=cap)
    plan = res.plan
    steps = check_plan(plan, w, 4, g, max_tokens_per_micro_batch=cap)  # packs in tokens, equal counts, all ranks
    assert steps == plan["step"].nunique()
    packs = plan.groupby(["step", "rank", "micro_index"])["n_tokens"].sum()
    assert packs.max() <= cap
    # every rank has the same number of packs, G per step
    per = plan.groupby(["step", "rank"])["micro_index"].nunique()
    assert (per == g).all()
    # nothing lost: every kept row exactly once per epoch; only cluster_per_rank drops (to equal pack counts)
    kept = set(ids) - set(res.dropped)
    for e in range(epochs):
        got = plan.loc[plan["epoch"] == e, "example_id"]
        assert got.is_unique and set(got) == kept
    if strategy != "cluster_per_rank":
        assert len(res.dropped) == 0
    else:
        assert len(res.dropped) < 0.2 * ids.size
        assert (plan.groupby("rank")["cluster"].nunique() == 1).all()
    # inside a pack, shortest first (the iterator order)
    assert plan.equals(plan.sort_values(["rank", "epoch", "step", "micro_index"], kind="stable")
                       .reset_index(drop=True))
    m = plan_metrics(plan, w, cap)
    assert m["padding_fraction"] == 0.0 and 0 < m["pack_fill"] <= 1.0


def test_packed_cluster_plan_goals_on_synthetic_lengths():
    """The issue's plan goals where clusters are independent of length and k = 2W (lognormal lengths)."""
    ids, cl, nt = _synthetic(n=6000, k=16)
    w, cap = 8, 4096
    mc = plan_metrics(make_plan(ids, cl, nt, w, 4, 1, 1, seed=0, packing=True, max_tokens_per_micro_batch=cap).plan,
                      w, cap)
    mr = plan_metrics(make_plan(ids, cl, nt, w, 4, 1, 1, strategy="random", seed=0, packing=True,
                                max_tokens_per_micro_batch=cap).plan, w, cap)
    assert mc["token_imbalance_mean"] <= 1.02
    assert mc["pack_fill"] >= 0.95
    assert mc["single_cluster_fraction"] >= 0.90
    assert mc["collisions_per_step_rows"] <= 0.05
    # the packed random baseline fills its packs as well, but mixes clusters on every rank
    assert mr["pack_fill"] >= 0.95 and mr["collisions_per_step_rows"] > 5


def test_random_packed_is_best_fit_decreasing_of_a_seeded_order():
    """With W = G = 1 no re-cut is needed: the packs are exactly BFD over the seeded permutation sorted by
    length, descending (stable), as TRL packs."""
    ids, cl, nt = _synthetic(n=400)
    res = make_plan(ids, cl, nt, 1, 4, 1, 1, strategy="random", seed=5, packing=True, max_tokens_per_micro_batch=1500)
    from ray_cluster_ft.allocate._slots import _TAG_ORDER, _rng

    perm = _rng(5, _TAG_ORDER, 0).permutation(ids.size)
    order = perm[np.argsort(-nt[perm], kind="stable")]
    ref = _bfd_reference(nt[order].tolist(), 1500)
    want = sorted(sorted(ids[order[np.asarray(ref) == p]].tolist()) for p in range(max(ref) + 1))
    got = sorted(sorted(g) for g in res.plan.groupby("step")["example_id"].apply(list))
    assert got == want


def test_even_count_recuts_without_losing_rows():
    rng = np.random.default_rng(1)
    nt = rng.integers(50, 400, 300)
    code = rng.integers(0, 8, 300)
    order = np.argsort(-nt, kind="stable")
    pack_of = bfd(nt[order], 1000)
    from ray_cluster_ft.allocate._packs import _csr

    rows, ptr = _csr(pack_of, order, nt, int(pack_of.max()) + 1)
    p = ptr.size - 1
    for w, g in ((4, 1), (3, 2), (7, 1)):
        r2, p2, n_light = _even_count(rows, ptr, code, nt, 1000, w, g)
        assert (p2.size - 1) % (w * g) == 0 and p2.size - 1 >= p
        assert sorted(r2.tolist()) == list(range(300))
        tokens, _ = _pack_stats(r2, p2, code, nt)
        assert tokens.max() <= 1000 and (np.diff(p2) > 0).all()
        assert n_light % (w * g) == 0
        if n_light:  # the light packs of one step carry nearly equal tokens
            light = tokens[-n_light:]
            assert light.max() / light.mean() < 1.3


def test_rank_groups_trades_groups_before_splitting_a_cluster():
    # Five clusters of 8, 7, 6, 5, 4 tokens (one-token rows) on 2 ranks. LPT gives 8+5+4 = 17 and 7+6 = 13;
    # no single group moves without overshooting (gap 4), but trading 8 for 6 gives 15 and 15, with every
    # cluster on one rank (splitting the 4-token cluster, the old way, put it on both ranks).
    code = np.repeat(np.arange(5), [8, 7, 6, 5, 4])
    nt = np.ones(code.size, dtype=np.int64)
    parts = _rank_groups(np.arange(code.size), code, nt, 2, 0.05)
    assert sorted(int(nt[p].sum()) for p in parts) == [15, 15]
    assert sorted(np.concatenate(parts).tolist()) == list(range(code.size))
    owners = [set(code[p].tolist()) for p in parts]
    assert not owners[0] & owners[1] and owners[0] | owners[1] == set(range(5))


def test_lpt_and_light_collisions_known_answers():
    # LPT: 9, 7, 6, 5, 4, 3 into 3 bins -> 9 | 7 | 6, then 5 -> bin 2 (6), 4 -> bin 1 (7), 3 -> bin 0 (9):
    # loads 12, 11, 11.
    lengths = np.array([3, 9, 4, 7, 5, 6])
    got = _lpt(lengths, 3)
    np.testing.assert_array_equal(got, [0, 0, 1, 1, 2, 2])
    assert np.bincount(got, weights=lengths).tolist() == [12, 11, 11]
    # Light packs of 2 ranks x 2 packs, one pack per step (g = 1): pack r * 2 + i is rank r's, in step i.
    # Cluster 5 in packs 0 (rank 0, step 0) and 2 (rank 1, step 0): one collision; cluster 6 in packs 1 and 3
    # (both step 1): one; cluster 7 in packs 0 and 3 (different steps): none.
    code = np.array([5, 5, 6, 6, 7, 7])
    pack = np.array([0, 2, 1, 3, 0, 3])
    assert _light_collisions(code, pack, per_rank=2, g=1) == 2
    # With g = 2 both packs of a rank are one step: every shared cluster collides once.
    assert _light_collisions(code, pack, per_rank=2, g=2) == 3


def test_light_packs_lay_a_split_cluster_in_different_steps_on_its_two_ranks():
    # Clusters of 7, 7, 4 one-token rows on 2 ranks: LPT gives 7+4 | 7, and two rows of cluster 2 move over
    # (9 | 9), so cluster 2 sits on both ranks. Three light packs (steps, g = 1) of 3 tokens per rank: in
    # cluster order both ranks hold cluster 2 in their last step (a collision); with it first on one rank
    # (step 0) and last on the other (step 2), none.
    code = np.repeat(np.arange(3), [7, 7, 4])
    nt = np.ones(code.size, dtype=np.int64)
    rows = np.arange(code.size)
    pack = _light_packs(rows, code, nt, 2, 3, cap=100, g=1)
    assert np.bincount(pack, weights=nt).tolist() == [3] * 6
    assert set(pack[code == 2] // 3) == {0, 1}  # still split over the two ranks
    assert _light_collisions(code, pack, per_rank=3, g=1) == 0
    parts = _rank_groups(rows, code, nt, 2, 0.1)
    in_code_order = np.concatenate([r * 3 + _cut_rank(part, nt, 3, 100) for r, part in enumerate(parts)])
    assert _light_collisions(code[np.concatenate(parts)], in_code_order, 3, 1) == 1


@pytest.mark.parametrize("seed", range(30))
def test_light_packs_never_collide_more_than_cluster_order(seed):
    rng = np.random.default_rng(seed)
    w, g = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    per_rank = g * int(rng.integers(1, 4))
    code = rng.integers(0, int(rng.integers(w, 4 * w)), size=int(rng.integers(w * per_rank, 120)))
    nt = rng.integers(20, 400, size=code.size)
    rows = rng.permutation(code.size)
    pack = _light_packs(rows, code, nt, w, per_rank, cap=10_000, g=g)
    parts = _rank_groups(rows, code, nt, w, 0.1)
    if pack is None:
        assert any(p.size < per_rank for p in parts)
        return
    assert sorted(np.bincount(pack, minlength=w * per_rank) > 0) == [True] * (w * per_rank)
    by_rank = [sorted(rows[pack // per_rank == r].tolist()) for r in range(w)]
    assert by_rank == [sorted(p.tolist()) for p in parts]  # the layout only reorders each rank's own rows
    ref = np.concatenate([r * per_rank + _cut_rank(p, nt, per_rank, 10_000) for r, p in enumerate(parts)])
    assert _light_collisions(code[rows], pack, per_rank, g) <= _light_collisions(code[np.concatenate(parts)], ref,
                                                                                  per_rank, g)


def test_packing_errors():
    ids, cl, nt = _synthetic(n=200)
    nt[17] = 5000
    with pytest.raises(ValueError, match="e00017.*5000 tokens.*max_tokens_per_micro_batch=4096"):
        make_plan(ids, cl, nt, 2, 4, packing=True, max_tokens_per_micro_batch=4096)
    nt[17] = 100
    with pytest.raises(ValueError, match="strategy 'length' with packing"):
        make_plan(ids, cl, nt, 2, 4, strategy="length", packing=True, max_tokens_per_micro_batch=4096)
    with pytest.raises(ValueError, match="strategy 'random' with packing needs max_tokens_per_micro_batch"):
        make_plan(ids, cl, nt, 2, 4, strategy="random", packing=True)  # only the cluster plan sizes its packs
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be an integer"):
        make_plan(ids, cl, nt, 2, 4, packing=True, max_tokens_per_micro_batch="big")
    with pytest.raises(ValueError, match="needs packing=True"):
        make_plan(ids, cl, nt, 2, 4, max_tokens_per_micro_batch=4096)
    with pytest.raises(ValueError, match="cannot fill one optimizer step"):
        make_plan(ids[:3], cl[:3], nt[:3], 2, 4, 2, packing=True, max_tokens_per_micro_batch=4096)
    from ray_cluster_ft.config import AllocationConfig

    with pytest.raises(ValueError, match="'length' with allocation.packing"):
        AllocationConfig(strategy="length", packing=True)


def test_check_plan_refuses_an_overfull_pack():
    plan = pd.DataFrame({"epoch": 0, "step": 0, "rank": [0, 0, 1], "micro_index": 0,
                         "example_id": ["a", "b", "c"], "cluster": 0, "n_tokens": [60, 50, 90]})
    assert check_plan(plan, 2, 1, 1, max_tokens_per_micro_batch=110) == 1
    with pytest.raises(ValueError, match=r"pack \(rank 0, step 0, micro_index 0\) holds 110 tokens"):
        check_plan(plan, 2, 1, 1, max_tokens_per_micro_batch=100)


def test_plan_metrics_per_row_collisions_and_pack_fill_known_answer():
    """W = 2, two steps. Step 0: rank 0 packs clusters {1, 2} (majority 1: two rows of 1), rank 1 {2, 2, 3}
    (majority 2): majorities differ (0 by majority) but cluster 2 is on both ranks (1 per row). Step 1:
    rank 0 {4}, rank 1 {5}: none."""
    rows = [  # step, rank, cluster, n_tokens
        (0, 0, 1, 30), (0, 0, 1, 30), (0, 0, 2, 10),
        (0, 1, 2, 20), (0, 1, 2, 20), (0, 1, 3, 40),
        (1, 0, 4, 80), (1, 1, 5, 60),
    ]
    plan = pd.DataFrame(rows, columns=["step", "rank", "cluster", "n_tokens"])
    plan["epoch"], plan["micro_index"] = 0, 0
    plan["example_id"] = [f"x{i}" for i in range(len(plan))]
    m = plan_metrics(plan, 2, 100)
    assert m["collisions_per_step"] == 0.0
    assert m["collisions_per_step_rows"] == 0.5  # one collision in step 0, none in step 1
    assert m["pack_fill"] == pytest.approx((70 + 80 + 80 + 60) / 4 / 100)
    assert m["padding_fraction"] == 0.0
    # per step max / mean of real tokens: step 0 80/75, step 1 80/70
    assert m["token_imbalance_mean"] == pytest.approx((80 / 75 + 80 / 70) / 2)
    assert m["single_cluster_fraction"] == 0.5
    assert "pack_fill" not in plan_metrics(plan, 2)


def _mb_sets(plan, epoch):
    part = plan[plan["epoch"] == epoch]
    return {frozenset(v) for v in part.groupby(["step", "rank", "micro_index"])["example_id"].apply(tuple)}


def test_cluster_plan_recut_every_epoch_keeps_epoch_0():
    ids, cl, nt = _synthetic(n=1203, k=12)
    one = make_plan(ids, cl, nt, 4, 4, 2, 1, seed=7).plan
    res = make_plan(ids, cl, nt, 4, 4, 2, 3, seed=7)
    three = res.plan
    # epoch 0 is the one-epoch plan, row for row (so single-epoch plans are unchanged)
    e0 = three[three["epoch"] == 0].reset_index(drop=True)
    pd.testing.assert_frame_equal(e0, one)
    kept = set(e0["example_id"])
    for e in (1, 2):
        part = three[three["epoch"] == e]
        assert set(part["example_id"]) == kept and part["example_id"].is_unique
    # micro-batch composition differs between epochs (not only their order)
    s0, s1, s2 = (_mb_sets(three, e) for e in range(3))
    assert len(s0 & s1) < 0.5 * len(s0) and len(s1 & s2) < 0.5 * len(s1)
    check_plan(three, 4, 4, 2)
    m = plan_metrics(three, 4)
    assert m["collisions_per_step"] == 0.0 and m["padding_fraction"] < 0.08


def test_packed_cluster_plan_recuts_every_epoch():
    ids, cl, nt = _synthetic(n=1500, k=8)
    plan = make_plan(ids, cl, nt, 4, 4, 1, 2, seed=0, packing=True, max_tokens_per_micro_batch=2048).plan
    s0, s1 = _mb_sets(plan, 0), _mb_sets(plan, 1)
    assert len(s0 & s1) < 0.5 * len(s0)
    first = make_plan(ids, cl, nt, 4, 4, 1, 1, seed=0, packing=True, max_tokens_per_micro_batch=2048).plan
    pd.testing.assert_frame_equal(plan[plan["epoch"] == 0].reset_index(drop=True), first)


def test_packed_plan_is_deterministic():
    ids, cl, nt = _synthetic(n=800)
    a = make_plan(ids, cl, nt, 4, 4, 2, 2, seed=11, packing=True, max_tokens_per_micro_batch=2048).plan
    b = make_plan(ids, cl, nt, 4, 4, 2, 2, seed=11, packing=True, max_tokens_per_micro_batch=2048).plan
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("strategy", ["cluster", "random"])
def test_packing_splits_packs_when_no_light_recut_fits(strategy):
    """4 rows whose best-fit packs (3) are no multiple of W = 2, and no light re-cut fits the cap: one pack is
    split in two (a part of a pack fits too), nothing is dropped. Fewer rows than packs needed: a clear error."""
    res = make_plan(["a", "b", "c", "d"], [1, 0, 1, 0], [35, 46, 97, 23], world_size=2, micro_batch_size=1,
                    strategy=strategy, packing=True, max_tokens_per_micro_batch=100)
    assert check_plan(res.plan, 2, 1, 1, max_tokens_per_micro_batch=100) == 2
    assert sorted(res.plan["example_id"]) == ["a", "b", "c", "d"] and len(res.dropped) == 0
    with pytest.raises(ValueError, match="more packs than examples: raise train.max_tokens_per_micro_batch"):
        make_plan(["a", "b", "c"], [0, 1, 0], [90, 95, 99], world_size=2, micro_batch_size=1, strategy=strategy,
                  packing=True, max_tokens_per_micro_batch=100)


def test_packing_never_refuses_a_possible_plan():
    """Random small inputs (W in 2, 4, 8; G in 1, 2; lengths up to the cap): whenever there are at least as
    many rows as whole steps need packs, the plan is made, keeps the hard rules and every row once per epoch."""
    rng = np.random.default_rng(0)
    made = 0
    for t in range(150):
        n, w, g = int(rng.integers(4, 60)), int(rng.choice([2, 4, 8])), int(rng.choice([1, 2]))
        cap = int(rng.choice([100, 512]))
        nt = np.minimum(rng.lognormal(np.log(cap / 3), 0.7, n).astype(np.int64) + 1, cap)
        if n < w * g:
            continue
        packs = int(bfd(np.sort(nt)[::-1], cap).max()) + 1
        possible = -(-packs // (w * g)) * w * g <= n
        ids = [f"r{i}" for i in range(n)]
        for strategy in ("cluster", "random"):
            try:
                res = make_plan(ids, rng.integers(0, 4, n), nt, w, 1, g, 2, strategy=strategy, seed=t,
                                packing=True, max_tokens_per_micro_batch=cap)
            except ValueError as err:
                assert not possible and "more packs than examples" in str(err), (t, strategy, err)
                continue
            made += 1
            check_plan(res.plan, w, 1, g, max_tokens_per_micro_batch=cap)
            assert (res.plan.groupby(["epoch", "example_id"]).size() == 1).all()
            assert res.plan.groupby("epoch")["example_id"].nunique().tolist() == [n, n]
    assert made > 150
