"""The rank x step plan and its balance metrics (DESIGN.md "Allocate").

CluSTER (Kim et al., EMNLP 2026, arXiv 2609.12584; cluster-aware allocation) gives each
data-parallel rank, at every optimizer step, a micro-batch from a *different* cluster (a stratified global
batch), with the ranks' token loads balanced (the slowest rank sets the step time) and little padding.

Plan rows: ``epoch, step, rank, micro_index, example_id, cluster, n_tokens``. ``step`` is the global optimizer
step across epochs (from 0); ``micro_index`` is the micro-batch inside that step on that rank
(0..grad_accum-1); the rows sharing ``(rank, step, micro_index)`` form that rank's micro-batch. The frame is
sorted by ``(rank, epoch, step, micro_index, position in the micro-batch)``: the order a rank's iterator
yields rows.

Hard rules (violating them hangs the collective ops of data-parallel training): every rank has the same number
of micro-batches, every micro-batch is full, every step has ``grad_accum`` micro-batches on every rank, and
each kept example appears exactly once per epoch. Hence only the largest multiple of
``world_size * micro_batch_size * grad_accum`` examples is kept; the rest are reported as ``dropped``.

All functions are pure and deterministic for a given seed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import pandas as pd

__all__ = ["PLAN_COLUMNS", "PlanResult", "make_plan", "plan_metrics", "check_plan"]

PLAN_COLUMNS = ["epoch", "step", "rank", "micro_index", "example_id", "cluster", "n_tokens"]
# Stream tags mixed into the seed so drop choice, slot order and rank tie-breaks never share random draws.
_TAG_DROP, _TAG_ORDER, _TAG_RANKS, _TAG_SLOTS = 1, 2, 3, 4


@dataclass(frozen=True)
class PlanResult:
    """The allocation plan.

    Attributes:
        plan: DataFrame with :data:`PLAN_COLUMNS` (int64 except ``example_id`` str), sorted by
            ``(rank, epoch, step, micro_index, position)``, RangeIndex.
        dropped: example ids (input order) left out so that every rank gets the same number of full
            micro-batches; fewer than ``world_size * micro_batch_size * grad_accum``.
        n_requested: number of examples given (kept + dropped).
    """

    plan: pd.DataFrame
    dropped: np.ndarray
    n_requested: int


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def _rng(seed: int, *tags: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *[int(t) for t in tags]])


def _majority(keys_2d: np.ndarray) -> np.ndarray:
    """Majority cluster of each micro-batch, int (T, B) in position order -> (T,).

    Ties go to the tied cluster that occurs last in the micro-batch (positions are sorted by length, so: the
    cluster of the longest example). Breaking ties by the smallest label instead would pile mixed
    micro-batches onto the low labels and make those clusters look far bigger than they are.
    :func:`plan_metrics` applies the same rule.
    """
    t, b = keys_2d.shape
    order = np.argsort(keys_2d, axis=1, kind="stable")  # equal keys keep position order
    srt = np.take_along_axis(keys_2d, order, axis=1)
    col = np.broadcast_to(np.arange(b), (t, b))
    starts_run = np.ones((t, b), dtype=bool)
    starts_run[:, 1:] = srt[:, 1:] != srt[:, :-1]
    ends_run = np.ones((t, b), dtype=bool)
    ends_run[:, :-1] = starts_run[:, 1:]
    run_start = np.maximum.accumulate(np.where(starts_run, col, 0), axis=1)
    # At each run's last element: (run length, its position, the latest of the run) ranks the candidates.
    score = np.where(ends_run, (col - run_start + 1) * b + order, -1)
    best = np.argmax(score, axis=1)
    return srt[np.arange(t), best]


def _form_slots(keys: np.ndarray, costs: np.ndarray, world_size: int) -> np.ndarray:
    """Group T micro-batches into T / W slots of W micro-batches from distinct clusters, similar cost.

    Walk the micro-batches sorted by cost; a micro-batch whose cluster is already in the current slot is
    deferred, and deferred ones go first into the next slots (a heap of each cluster's earliest unused
    micro-batch implements the walk with deferral in O(T log k)). A cluster whose unused count equals the
    number of slots left is "tight" and goes into the current slot first: with sum(remaining) = W * slots
    left, at most W clusters can be tight, so this keeps a collision-free completion possible whenever one
    exists (every cluster has at most T / W micro-batches). When none exists, the fullest clusters fill the
    gaps, which reaches the fewest possible collisions, sum over clusters of max(0, micro-batches - slots)
    (checked by a property test).

    A negative key marks a *mixed* micro-batch (rows of several clusters, see :func:`_repartition`): it
    never collides and is never tight, so it simply fills the next place in cost order. Giving mixed
    micro-batches the cluster of their majority here instead would make some clusters look tight only
    because ties fell their way, and force their costly micro-batches into cheap slots.

    Args:
        keys: int (T,) cluster of each micro-batch (0..k-1), or -1 for a mixed one.
        costs: int (T,) padded tokens of each micro-batch.
        world_size: W; T must be a multiple of W.

    Returns:
        int64 (T / W, W) micro-batch ids per slot.
    """
    t = keys.size
    n_slots = t // world_size
    order = np.lexsort((np.arange(t), costs))  # global walk order: cost, then id
    pos_key = keys[order]
    wild = np.flatnonzero(pos_key < 0)  # walk positions of the mixed micro-batches, ascending
    wptr = 0
    pure_pos = np.flatnonzero(pos_key >= 0)
    k = int(keys.max()) + 1 if pure_pos.size else 0
    by_key = pure_pos[np.argsort(pos_key[pure_pos], kind="stable")]  # grouped by cluster, ascending inside
    counts = np.bincount(pos_key[pure_pos], minlength=k)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ptr = starts[:-1].copy()
    ends = starts[1:]
    remaining = counts.astype(np.int64)
    heap = [(int(by_key[starts[c]]), c) for c in range(k) if counts[c]]
    heapq.heapify(heap)

    def take(c: int) -> int:
        p = int(by_key[ptr[c]])
        ptr[c] += 1
        remaining[c] -= 1
        if ptr[c] < ends[c]:
            heapq.heappush(heap, (int(by_key[ptr[c]]), c))
        return p

    def valid(p: int, c: int) -> bool:
        return ptr[c] < ends[c] and int(by_key[ptr[c]]) == p

    slots = np.empty((n_slots, world_size), dtype=np.int64)
    for s in range(n_slots):
        left = n_slots - s
        in_slot: set[int] = set()
        picked: list[int] = []
        tight = np.flatnonzero(remaining >= left) if k else np.empty(0, dtype=np.int64)
        if tight.size > world_size:  # infeasible input: serve the most loaded clusters first
            tight = tight[np.lexsort((tight, -remaining[tight]))][:world_size]
        for c in tight.tolist():
            picked.append(take(c))
            in_slot.add(c)
        skipped = []
        while len(picked) < world_size:
            while heap and (not valid(*heap[0]) or heap[0][1] in in_slot):
                p, c = heapq.heappop(heap)
                if valid(p, c):
                    skipped.append((p, c))
            next_pure = heap[0][0] if heap else t
            next_wild = int(wild[wptr]) if wptr < wild.size else t
            if next_pure == t:
                # Every cluster left is in the slot already: a mixed micro-batch cannot dodge the collision
                # either, so it competes on cost with the cheapest repeat.
                cheapest_repeat = min((p for p, _ in skipped), default=t)
                if next_wild == t or cheapest_repeat < next_wild:
                    break
            if next_wild < next_pure:
                picked.append(next_wild)
                wptr += 1
            else:
                c = heap[0][1]
                picked.append(take(c))
                in_slot.add(c)
        for item in skipped:
            heapq.heappush(heap, item)
        while len(picked) < world_size:
            # Fewer than W clusters left: a collision cannot be avoided. Repeat the cluster with the most
            # micro-batches left, so no cluster that could still fill a later slot on its own is used up.
            if remaining.any() or wptr == wild.size:
                picked.append(take(int(np.argmax(remaining))))
            else:
                picked.append(int(wild[wptr]))
                wptr += 1
        slots[s] = order[np.asarray(picked, dtype=np.int64)]
    return slots


def _recut_in_order(srt: np.ndarray, code: np.ndarray, nt: np.ndarray, forbidden: set[int], m: int, b: int,
                    slack: int = 0):
    """Cut rows (longest first) into ``m`` micro-batches of ``b`` with distinct majority clusters outside
    ``forbidden``, as close to the plain consecutive cut as the rule allows.

    A row of a still-free cluster opens a new micro-batch, with itself as head, whenever fewer are open than
    the consecutive cut would have by then plus ``slack``; otherwise a row joins the longest-headed open
    micro-batch that keeps its majority (the head's cluster: a row of another cluster may bring its count up
    to the head cluster's count, not past it, and ties go to the longest row, the head), and opens one only
    when none does. Returns int64 (m, b) (each head last among its micro-batch's equal lengths) or None when
    some row fits nowhere.
    """
    members: list[list[int]] = []
    heads: list[int] = []
    counts: list[dict[int, int]] = []
    used = set(forbidden)
    for i, r in enumerate(srt.tolist()):
        c = int(code[r])
        can_open = c not in used and len(heads) < m
        if can_open and len(heads) < i // b + 1 + slack:
            placed = False
        else:
            placed = False
            for j in range(len(members)):
                if len(members[j]) == b - 1:
                    continue
                hc = int(code[heads[j]])
                if c == hc or counts[j].get(c, 0) + 1 <= counts[j][hc]:
                    members[j].append(r)
                    counts[j][c] = counts[j].get(c, 0) + 1
                    placed = True
                    break
        if placed:
            continue
        if not can_open:
            return None
        heads.append(r)
        members.append([])
        counts.append({c: 1})
        used.add(c)
    if len(heads) != m:
        return None
    return np.asarray([mem[::-1] + [h] for mem, h in zip(members, heads)], dtype=np.int64).reshape(m, b)


def _recut_by_heads(srt: np.ndarray, code: np.ndarray, nt: np.ndarray, forbidden: set[int], m: int, b: int):
    """Fallback of :func:`_recut_in_order`: the m longest rows of m distinct allowed clusters are the heads;
    every other row (longest first) joins the shortest head that is at least as long and keeps its majority
    (best fit). Returns int64 (m, b) or None."""
    heads: list[int] = []
    seen = set(forbidden)
    for r in srt.tolist():
        c = int(code[r])
        if c not in seen:
            heads.append(r)
            seen.add(c)
            if len(heads) == m:
                break
    if len(heads) < m:
        return None
    head_set = set(heads)
    head_len = [int(nt[h]) for h in heads]  # descending
    head_cl = [int(code[h]) for h in heads]
    members: list[list[int]] = [[] for _ in range(m)]
    counts: list[dict[int, int]] = [{head_cl[j]: 1} for j in range(m)]
    for r in srt.tolist():
        if r in head_set:
            continue
        c, ln = int(code[r]), int(nt[r])
        best = -1
        for j in range(m - 1, -1, -1):  # shortest head first: the best fit that still holds the row
            if len(members[j]) == b - 1:
                continue
            # A tie with the head's cluster is fine: the head is the longest row, and ties go to it.
            if c == head_cl[j] or (head_len[j] >= ln and counts[j].get(c, 0) + 1 <= counts[j][head_cl[j]]):
                best = j
                break
        if best < 0:
            return None
        members[best].append(r)
        counts[best][c] = counts[best].get(c, 0) + 1
    return np.asarray([mem[::-1] + [h] for mem, h in zip(members, heads)], dtype=np.int64).reshape(m, b)


def _repartition(rows: np.ndarray, code: np.ndarray, nt: np.ndarray, forbidden: set[int], b: int):
    """Re-cut the mixed micro-batches of one slot so that their majority clusters differ from each other and
    from ``forbidden`` (the clusters of the slot's single-cluster micro-batches).

    Tries :func:`_recut_in_order` (close to the consecutive cut of the rows by length, so little padding) with
    slack 0, 1 and 2, and :func:`_recut_by_heads`, and keeps the cut with the fewest padded tokens. Majority
    and ties follow :func:`_majority` on rows sorted by length.

    Args:
        rows: int (m * b,) row indices of the slot's mixed micro-batches.
        code: int (N,) cluster code per row; nt: int (N,) tokens per row.
        forbidden: cluster codes already present in the slot.
        b: micro-batch size.

    Returns:
        int64 (m, b) micro-batches, or None when neither cut finds distinct clusters (the caller keeps the old
        cut).
    """
    m = rows.size // b
    srt = rows[np.lexsort((rows, -nt[rows]))]  # longest first, then row index
    best, best_padded = None, None
    for cut in (partial(_recut_in_order, slack=0), partial(_recut_in_order, slack=1),
                partial(_recut_in_order, slack=2), _recut_by_heads):
        out = cut(srt, code, nt, forbidden, m, b)
        if out is not None:
            padded = int(nt[out].max(axis=1).sum())
            if best is None or padded < best_padded:
                best, best_padded = out, padded
    return best


def _assign_ranks(step_slots: np.ndarray, costs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """LPT inside each step: every rank gets one micro-batch of each of the step's G slots.

    Slots are handled widest cost range first; a slot's micro-batches, largest first, go to the ranks with
    the least load so far in the step (ties broken by a random rank order per step, so no rank is always
    the one that gets the largest micro-batch).

    Args:
        step_slots: int (n_steps, G, W) micro-batch ids, slot g of step s is ``step_slots[s, g]``.
        costs: int (T,) padded tokens per micro-batch.

    Returns:
        int (n_steps, G, W): ``out[s, g, r]`` is the micro-batch of rank r at micro_index g of step s.
    """
    n_steps, g_acc, w = step_slots.shape
    c = costs[step_slots]  # (n_steps, G, W)
    spread = c.max(axis=2) - c.min(axis=2)
    slot_order = np.argsort(-spread, axis=1, kind="stable")  # (n_steps, G)
    tiebreak = rng.random((n_steps, w)) * 0.5  # < 1 token: only decides exact ties
    loads = np.zeros((n_steps, w), dtype=np.float64)
    out = np.empty_like(step_slots)
    rows = np.arange(n_steps)[:, None]
    for j in range(g_acc):
        g = slot_order[:, j]
        mbs = step_slots[np.arange(n_steps), g]  # (n_steps, W)
        mc = costs[mbs]
        big_first = np.argsort(-mc, axis=1, kind="stable")
        light_first = np.argsort(loads + tiebreak, axis=1, kind="stable")
        ranks = light_first  # i-th largest micro-batch -> i-th lightest rank
        chosen = np.take_along_axis(mbs, big_first, axis=1)
        out[rows, g[:, None], ranks] = chosen
        loads[rows, ranks] += costs[chosen]
    return out


def _distinct_mixed(slots: np.ndarray, mb_rows: np.ndarray, keys: np.ndarray, n_pure: int, code: np.ndarray,
                    nt: np.ndarray, costs: np.ndarray, b: int, reach: int = 3) -> None:
    """Make the majority clusters of every slot distinct, in place (``slots``, ``mb_rows``, ``keys``).

    First, in every slot whose majority clusters repeat, the mixed micro-batches (ids >= ``n_pure``) are re-cut
    by :func:`_repartition`. A slot that still repeats a cluster then swaps one of its repeating micro-batches
    with the micro-batch of closest cost in a slot at most ``reach`` away in walk order (so of similar cost)
    whose cluster it lacks, when that slot lacks the repeated cluster too. A slot neither step can fix keeps its
    repeats (e.g. when more micro-batches of one cluster exist than slots); the metrics count them.

    Args:
        slots: int (S, W) micro-batch ids per slot, in walk (cost) order.
        mb_rows: int (T, B) row indices per micro-batch; keys: int (T,) majority cluster code per micro-batch.
        n_pure: micro-batches ``0..n_pure-1`` are single-cluster, the rest mixed.
        code, nt: int (N,) cluster code and tokens per row; costs: int (T,) padded tokens per micro-batch,
            updated for re-cut micro-batches.
        b: micro-batch size; reach: how many slots on each side a swap may look.
    """
    n_slots, w = slots.shape
    for s in range(n_slots):
        ids = slots[s]
        k = keys[ids]
        if np.unique(k).size == k.size:
            continue
        mixed = ids[ids >= n_pure]
        if mixed.size == 0:
            continue
        forbidden = set(keys[ids[ids < n_pure]].tolist())
        new = _repartition(mb_rows[mixed].ravel(), code, nt, forbidden, b)
        if new is None:
            continue
        inner = np.argsort(nt[new], axis=1, kind="stable")
        new = np.take_along_axis(new, inner, axis=1)
        mb_rows[mixed] = new
        keys[mixed] = _majority(code[new])
        costs[mixed] = b * nt[new].max(axis=1)
    sk = np.sort(keys[slots], axis=1)
    clean = ~(sk[:, 1:] == sk[:, :-1]).any(axis=1)  # slots without a repeated cluster
    for s in np.flatnonzero(~clean).tolist():
        lo, hi = max(0, s - reach), min(n_slots, s + reach + 1)
        partners = [s2 for s2 in range(lo, hi) if s2 != s and clean[s2]]
        while partners:
            k = keys[slots[s]]
            vals, cnt = np.unique(k, return_counts=True)
            dup = set(vals[cnt > 1].tolist())
            if not dup:
                clean[s] = True
                break
            present = set(vals.tolist())
            best = None  # (cost gap, slot, position in s, position in the other)
            for i in range(w):
                u = slots[s, i]
                if keys[u] not in dup:
                    continue
                for s2 in partners:
                    k2 = keys[slots[s2]]
                    if keys[u] in k2:
                        continue
                    for j in range(w):
                        v = slots[s2, j]
                        if int(keys[v]) in present:
                            continue
                        gap = abs(int(costs[u]) - int(costs[v]))
                        if best is None or gap < best[0]:
                            best = (gap, s2, i, j)
            if best is None:
                break
            _, s2, i, j = best
            slots[s, i], slots[s2, j] = slots[s2, j], slots[s, i]


def _validate(example_ids, clusters, n_tokens):
    ids = np.asarray(example_ids)
    if ids.ndim != 1:
        raise ValueError(f"example_ids must be 1-D, got shape {ids.shape}")
    ids = ids.astype(str)
    cl = np.asarray(clusters)
    nt = np.asarray(n_tokens)
    if cl.shape != ids.shape or nt.shape != ids.shape:
        raise ValueError(
            f"length mismatch: {ids.size} example_ids, {cl.size} clusters, {nt.size} n_tokens (must be equal)"
        )
    for name, arr in (("clusters", cl), ("n_tokens", nt)):
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    cl = cl.astype(np.int64)
    nt = nt.astype(np.int64)
    if nt.size and nt.min() < 1:
        raise ValueError(f"n_tokens must be >= 1, got {nt.min()} (example {ids[int(np.argmin(nt))]!r})")
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1]
        raise ValueError(f"duplicate example ids: {dup.size} ids repeat (first: {dup[0]!r})")
    return ids, cl, nt


def _cluster_microbatches(cl, nt, mbs, n_drop, seed, pad_tolerance):
    """Cut micro-batches for the ``cluster`` strategy and choose what to drop.

    Returns (micro-batches int64 (T, B) of row indices, the number of single-cluster micro-batches, which
    come first, dropped row indices sorted).
    """
    n = cl.size
    idx = np.arange(n)
    _, code = np.unique(cl, return_inverse=True)
    order = np.lexsort((idx, nt, code))  # by cluster, then length: consecutive lengths share a micro-batch
    sc = code[order]
    sizes = np.bincount(sc)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rank_in = np.arange(n) - starts[sc]
    full_len = (sizes // mbs) * mbs
    in_full = rank_in < full_len[sc]
    full_rows = order[in_full].reshape(-1, mbs)  # whole single-cluster micro-batches
    pool = order[~in_full]
    rng = _rng(seed, _TAG_DROP)
    if n_drop <= pool.size:
        # Leftovers could not fill a single-cluster micro-batch anyway: drop among them.
        drop = rng.choice(pool, size=n_drop, replace=False) if n_drop else np.empty(0, dtype=np.int64)
        pool = np.setdiff1d(pool, drop)
    else:
        # Drop every leftover plus whole micro-batches (a multiple of B remains to drop), taken one at a
        # time from the cluster with most micro-batches left so the balanced selection stays balanced.
        extra = (n_drop - pool.size) // mbs
        mb_cluster = code[full_rows[:, 0]]
        left = np.bincount(mb_cluster, minlength=sizes.size).astype(np.int64)
        gone = np.zeros(full_rows.shape[0], dtype=bool)
        for _ in range(extra):
            c = int(np.argmax(left))  # lowest cluster on ties
            cand = np.flatnonzero((mb_cluster == c) & ~gone)
            gone[rng.choice(cand)] = True
            left[c] -= 1
        drop = np.concatenate([pool, full_rows[gone].ravel()])
        full_rows = full_rows[~gone]
        pool = np.empty(0, dtype=np.int64)
    # A single-cluster micro-batch that pads more than the tolerance holds its cluster's length outliers;
    # pooled with similar lengths from other clusters they waste far less (the metric reports the purity).
    longest = nt[full_rows].max(axis=1)
    padding = 1.0 - nt[full_rows].sum(axis=1) / (mbs * longest)
    loose = padding > pad_tolerance
    pool = np.concatenate([pool, full_rows[loose].ravel()])
    full_rows = full_rows[~loose]
    pool = pool[np.lexsort((pool, nt[pool]))]  # mixed micro-batches, also by length
    mixed_rows = pool.reshape(-1, mbs)
    mbs = np.concatenate([full_rows, mixed_rows]).astype(np.int64)
    return mbs, full_rows.shape[0], np.sort(drop).astype(np.int64)


def _rows_frame(mb_sched: np.ndarray, mb_rows: np.ndarray, ids, cl, nt, steps_per_epoch: int) -> pd.DataFrame:
    """Plan frame from ``mb_sched[e, s, g, r]`` (micro-batch id) and ``mb_rows[mb]`` (row indices)."""
    n_epochs, n_steps, g_acc, w = mb_sched.shape
    b = mb_rows.shape[1]
    seq = mb_sched.transpose(3, 0, 1, 2)  # rank, epoch, step, micro_index: the iterator order
    grid = np.indices(seq.shape)
    rows = mb_rows[seq.ravel()].ravel()
    rep = lambda a: np.repeat(a.ravel().astype(np.int64), b)  # noqa: E731
    frame = pd.DataFrame(
        {
            "epoch": rep(grid[1]),
            "step": rep(grid[1] * steps_per_epoch + grid[2]),
            "rank": rep(grid[0]),
            "micro_index": rep(grid[3]),
            "example_id": ids[rows].astype(object),
            "cluster": cl[rows],
            "n_tokens": nt[rows],
        }
    )
    return frame


def make_plan(
    example_ids,
    clusters,
    n_tokens,
    world_size: int,
    micro_batch_size: int,
    grad_accum: int = 1,
    epochs: int = 1,
    strategy: Literal["cluster", "random", "length"] = "cluster",
    seed: int = 0,
    pad_tolerance: float = 0.05,
) -> PlanResult:
    """Build the allocation plan.

    ``cluster`` (the method): inside each cluster, sort by length and cut micro-batches of consecutive
    lengths; leftovers (fewer than a micro-batch per cluster) are pooled into mixed micro-batches, also by
    length, and the examples to drop are taken from them first (then whole micro-batches of the clusters
    with most micro-batches). A single-cluster micro-batch whose padding fraction is above
    ``pad_tolerance`` (a cluster's length outliers) joins the mixed pool too. Micro-batches are grouped into
    slots of ``world_size`` from distinct clusters with similar padded cost (see :func:`_form_slots`), twice:
    once with every mixed micro-batch keyed by its majority cluster, once with mixed micro-batches as
    wildcards whose rows are re-cut per slot into distinct majorities (:func:`_repartition`); repeats left in
    either are traded with nearby slots (:func:`_distinct_mixed`). The walk with fewer collisions, then the
    shorter critical path, is kept. On the issue's real lengths with random cluster labels this lands within
    1% of :func:`plan_metrics`' ``critical_path_bound_tokens``. Every epoch,
    the slot order is shuffled (seed, epoch) so clusters and lengths are spread over the epoch, consecutive
    ``grad_accum`` slots form a step, and each slot's micro-batches go to ranks by LPT on the step's load.

    ``random`` (the baseline, a shuffled ``DistributedSampler``): a seeded permutation per epoch, rank r takes
    every W-th example from position r, and cuts consecutive micro-batches.

    ``length`` (grouping by length, as ``group_by_length`` in other trainers; no clusters): every epoch, the
    kept examples in a seeded random order are stably sorted by length (so equal lengths mix differently per
    epoch) and cut into consecutive micro-batches; ``world_size`` consecutive micro-batches (similar lengths)
    form a slot, the slot order is shuffled (seed, epoch), and ranks get micro-batches by LPT as in
    ``cluster``. The examples dropped are a seeded random choice, as in ``random``.

    Args:
        example_ids: str (N,) unique ids.
        clusters: int (N,) cluster of each example (any integers; ``-1`` is an ordinary cluster here).
        n_tokens: int (N,) tokens of each example (>= 1).
        world_size: data-parallel ranks W.
        micro_batch_size: rows per micro-batch B.
        grad_accum: micro-batches per rank per optimizer step G.
        epochs: passes over the kept examples.
        strategy: ``cluster``, ``random`` or ``length``.
        seed: seed of every random choice (non-negative); epoch e uses streams derived from (seed, e).
        pad_tolerance: ``cluster`` only, in [0, 1]: largest padding fraction a single-cluster micro-batch
            may keep; 1 keeps every one (pure clusters, more padding), 0 pools all that are not uniform.

    Returns:
        :class:`PlanResult`.

    Raises:
        ValueError: length mismatch, duplicate ids, non-integer or non-positive token counts, W/B/G/epochs
            < 1, unknown strategy, negative seed, or ``N < W * B * G`` (some rank would get no micro-batch).
    """
    w = _positive("world_size", world_size)
    b = _positive("micro_batch_size", micro_batch_size)
    g = _positive("grad_accum", grad_accum)
    n_epochs = _positive("epochs", epochs)
    if strategy not in ("cluster", "random", "length"):
        raise ValueError(f"strategy must be 'cluster', 'random' or 'length', got {strategy!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not 0.0 <= float(pad_tolerance) <= 1.0:
        raise ValueError(f"pad_tolerance must be in [0, 1], got {pad_tolerance!r}")
    ids, cl, nt = _validate(example_ids, clusters, n_tokens)
    n = ids.size
    unit = w * b * g
    if n < unit:
        raise ValueError(
            f"{n} examples cannot fill one optimizer step of world_size={w} x micro_batch_size={b} x "
            f"grad_accum={g} = {unit}: some ranks would get no micro-batch"
        )
    n_keep = (n // unit) * unit
    n_drop = n - n_keep
    n_slots = n_keep // (w * b)
    steps_per_epoch = n_slots // g

    if strategy in ("random", "length"):
        drop = np.sort(_rng(seed, _TAG_DROP).choice(n, size=n_drop, replace=False)).astype(np.int64)
        kept = np.setdiff1d(np.arange(n), drop)
        mb_rows_all, scheds = [], []
        for e in range(n_epochs):
            perm = _rng(seed, _TAG_ORDER, e).permutation(kept)
            base = e * n_slots * w
            if strategy == "length":
                srt = perm[np.argsort(nt[perm], kind="stable")]
                mbs_e = srt.reshape(-1, b)  # (n_slots * W, B), by length
                costs_e = b * nt[mbs_e].max(axis=1)
                slots = np.arange(n_slots * w).reshape(n_slots, w)  # W neighbours in length per slot
                step_slots = slots[_rng(seed, _TAG_SLOTS, e).permutation(n_slots)].reshape(steps_per_epoch, g, w)
                mb_rows_all.append(mbs_e)
                scheds.append(base + _assign_ranks(step_slots, costs_e, _rng(seed, _TAG_RANKS, e)))
                continue
            per_rank = perm.reshape(-1, w).T  # rank r: perm[r::W], like DistributedSampler
            mbs = per_rank.reshape(w, steps_per_epoch, g, b)
            mb_rows_all.append(mbs.reshape(-1, b))
            ids_grid = base + np.arange(w * n_slots).reshape(w, steps_per_epoch, g)
            scheds.append(ids_grid.transpose(1, 2, 0))  # step, micro_index, rank
        mb_rows = np.concatenate(mb_rows_all)
        sched = np.stack(scheds)
    else:
        mb_rows, n_pure, drop = _cluster_microbatches(cl, nt, b, n_drop, seed, float(pad_tolerance))
        # Positions inside a micro-batch: shortest first (already so for full ones; keep it explicit).
        inner = np.argsort(nt[mb_rows], axis=1, kind="stable")
        mb_rows = np.take_along_axis(mb_rows, inner, axis=1)
        _, code = np.unique(cl, return_inverse=True)
        keys = _majority(code[mb_rows])
        costs = b * nt[mb_rows].max(axis=1)
        # Two walks, and the better plan is kept (fewer collisions, then a shorter critical path): mixed
        # micro-batches keyed by their majority (safe when clusters follow length, so that the mixed rows of a
        # slot hold few clusters), or as wildcards re-cut per slot (better balance when they do not).
        best = None
        for wildcards in (False, True):
            rows_v, keys_v, costs_v = mb_rows.copy(), keys.copy(), costs.copy()
            walk_keys = keys_v.copy()
            if wildcards:
                walk_keys[n_pure:] = -1
            slots_v = _form_slots(walk_keys, costs_v, w)  # (n_slots, W)
            _distinct_mixed(slots_v, rows_v, keys_v, n_pure, code, nt, costs_v, b)
            sk = np.sort(keys_v[slots_v], axis=1)
            collisions = int((sk[:, 1:] == sk[:, :-1]).sum())
            score = (collisions, int(costs_v[slots_v].max(axis=1).sum()), int(wildcards))
            if best is None or score < best[0]:
                best = (score, slots_v, rows_v, costs_v)
        _, slots, mb_rows, costs = best
        scheds = []
        for e in range(n_epochs):
            order = _rng(seed, _TAG_ORDER, e).permutation(n_slots)
            step_slots = slots[order].reshape(steps_per_epoch, g, w)
            scheds.append(_assign_ranks(step_slots, costs, _rng(seed, _TAG_RANKS, e)))
        sched = np.stack(scheds)

    plan = _rows_frame(sched, mb_rows, ids, cl, nt, steps_per_epoch)
    return PlanResult(plan=plan, dropped=ids[drop].astype(object), n_requested=n)


def _microbatch_table(plan: pd.DataFrame) -> pd.DataFrame:
    """One row per micro-batch: step, rank, micro_index, rows, longest, real tokens, distinct clusters,
    majority cluster (ties: see :func:`_majority`)."""
    key = ["step", "rank", "micro_index"]
    mb = plan.groupby(key, sort=True).agg(
        rows=("n_tokens", "size"),
        longest=("n_tokens", "max"),
        real=("n_tokens", "sum"),
        n_clusters=("cluster", "nunique"),
    )
    # Same tie rule as the allocator: the tied cluster of the longest example, then the later position.
    frame = plan[key + ["cluster", "n_tokens"]].copy()
    frame["_last"] = frame["n_tokens"].to_numpy(np.int64) * (len(frame) + 1) + np.arange(len(frame))
    cnt = frame.groupby(key + ["cluster"], sort=True).agg(c=("_last", "size"), last=("_last", "max")).reset_index()
    cnt = cnt.sort_values(key + ["c", "last"], ascending=[True, True, True, False, False], kind="stable")
    major = cnt.drop_duplicates(key).set_index(key)["cluster"]
    mb["major"] = major
    mb["padded"] = mb["rows"] * mb["longest"]
    return mb.reset_index()


def _critical_path_bound(n_tokens: np.ndarray, w: int, b: int, g: int) -> float:
    """Lower bound on the critical path of one epoch of these examples (see :func:`plan_metrics`)."""
    srt = np.sort(n_tokens)[::-1]
    return float(max(srt.sum() / w, b * srt[:: w * b * g].sum()))


def plan_metrics(plan: pd.DataFrame, world_size: int) -> dict:
    """Balance, padding and collision figures of a plan.

    - ``token_imbalance_mean`` / ``_max``: per step, the max over ranks / the mean over the ``world_size``
      ranks of the rank's padded tokens in that step (sum over its micro-batches of rows x longest
      ``n_tokens``); averaged / maximised over steps. 1.0 is perfect; the slowest rank sets the step time.
    - ``padding_fraction``: pad tokens / padded tokens, over the whole plan.
    - ``critical_path_tokens``: sum over steps of the slowest rank's padded tokens (a proxy of wall time).
    - ``collisions_per_step``: mean over steps of the sum over micro-slots (micro_index) of ``world_size`` -
      the number of distinct majority clusters among the ranks' micro-batches (0 = stratified batches).
    - ``single_cluster_fraction``: share of micro-batches whose rows all come from one cluster.
    - ``critical_path_bound_tokens``: a lower bound on ``critical_path_tokens`` for *any* plan of the same
      examples, W, B and G: per epoch, the larger of (real tokens / W) and B x the sum of every
      (W * B * G)-th length in descending order (the step holding the j-th such length has a micro-batch at
      least that long). With G = 1 the second term is exact: it is what the cluster-blind sorted cut reaches.
    - ``critical_path_vs_bound``: ``critical_path_tokens / critical_path_bound_tokens`` (>= 1).
    - ``steps``: optimizer steps; ``micro_batches_per_rank``: mean micro-batches per rank.

    Args:
        plan: a plan frame (:data:`PLAN_COLUMNS`).
        world_size: W.

    Returns:
        dict of floats.

    Raises:
        ValueError: missing columns, empty plan, world_size < 1.
    """
    w = _positive("world_size", world_size)
    missing = [c for c in ("step", "rank", "micro_index", "cluster", "n_tokens") if c not in plan.columns]
    if missing:
        raise ValueError(f"plan lacks columns {missing}")
    if plan.empty:
        raise ValueError("plan is empty")
    mb = _microbatch_table(plan)
    load = mb.groupby(["step", "rank"], sort=True)["padded"].sum()
    per_step = load.groupby(level="step")
    step_max = per_step.max()
    step_mean = per_step.sum() / w
    imb = step_max / step_mean
    distinct = mb.groupby(["step", "micro_index"], sort=True)["major"].nunique()
    coll = (w - distinct).groupby(level="step").sum()
    b = int(mb["rows"].max())
    g = int(mb["micro_index"].max()) + 1
    if "epoch" in plan.columns:
        epochs = plan.groupby("epoch")
        bound = float(sum(_critical_path_bound(part["n_tokens"].to_numpy(np.int64), w, b, g) for _, part in epochs))
    else:
        bound = _critical_path_bound(plan["n_tokens"].to_numpy(np.int64), w, b, g)
    return {
        "token_imbalance_mean": float(imb.mean()),
        "token_imbalance_max": float(imb.max()),
        "padding_fraction": float(1.0 - mb["real"].sum() / mb["padded"].sum()),
        "critical_path_tokens": float(step_max.sum()),
        "collisions_per_step": float(coll.mean()),
        "single_cluster_fraction": float((mb["n_clusters"] == 1).mean()),
        "critical_path_bound_tokens": bound,
        "critical_path_vs_bound": float(step_max.sum()) / bound,
        "steps": float(step_max.size),
        "micro_batches_per_rank": float(mb.groupby("rank").size().mean()),
    }


def check_plan(plan: pd.DataFrame, world_size: int, micro_batch_size: int, grad_accum: int = 1) -> int:
    """Enforce the hard rules that keep data-parallel training from hanging.

    Checks: every rank 0..W-1 present and none outside; the same number of micro-batches on every rank; every
    micro-batch has exactly ``micro_batch_size`` rows; every (rank, step) has micro_index 0..G-1; every step
    has all ranks; every step lies in one epoch and steps increase with epochs. The trainer runs this on the
    driver before any worker starts.

    Returns:
        The number of optimizer steps.

    Raises:
        ValueError: naming the offending rank / step / micro-batch, e.g. ``uneven plan: rank 1 has 3
            micro-batches, rank 0 has 4; uneven counts hang the collective ops of data-parallel training``.
    """
    w = _positive("world_size", world_size)
    b = _positive("micro_batch_size", micro_batch_size)
    g = _positive("grad_accum", grad_accum)
    missing = [c for c in ("step", "rank", "micro_index") if c not in plan.columns]
    if missing:
        raise ValueError(f"plan lacks columns {missing}")
    ranks = plan["rank"].to_numpy()
    outside = np.setdiff1d(np.unique(ranks), np.arange(w))
    if outside.size:
        raise ValueError(f"plan has rank {int(outside[0])} outside 0..{w - 1} (world size {w})")
    mb = plan.groupby(["rank", "step", "micro_index"], sort=True).size()
    per_rank = mb.groupby(level="rank").size().reindex(range(w), fill_value=0)
    absent = per_rank.index[per_rank.to_numpy() == 0]
    if len(absent):
        raise ValueError(
            f"uneven plan: rank {int(absent[0])} has no micro-batches (world size {w}); uneven counts hang the "
            f"collective ops of data-parallel training"
        )
    if per_rank.nunique() > 1:
        lo, hi = int(per_rank.idxmin()), int(per_rank.idxmax())
        raise ValueError(
            f"uneven plan: rank {lo} has {int(per_rank[lo])} micro-batches, rank {hi} has {int(per_rank[hi])}; "
            f"uneven counts hang the collective ops of data-parallel training"
        )
    bad = mb[mb != b]
    if len(bad):
        (r, s, m), size = bad.index[0], int(bad.iloc[0])
        raise ValueError(
            f"micro-batch (rank {r}, step {s}, micro_index {m}) has {size} rows, expected micro_batch_size={b}"
        )
    per_rank_step = mb.reset_index().groupby(["rank", "step"])["micro_index"].agg(["size", "min", "max"])
    wrong = per_rank_step[(per_rank_step["size"] != g) | (per_rank_step["min"] != 0) | (per_rank_step["max"] != g - 1)]
    if len(wrong):
        r, s = wrong.index[0]
        raise ValueError(
            f"rank {r} step {s} has micro_index values {sorted(mb.loc[(r, s)].index.tolist())}, "
            f"expected 0..{g - 1} (grad_accum={g})"
        )
    ranks_per_step = mb.reset_index().groupby("step")["rank"].nunique()
    short = ranks_per_step[ranks_per_step != w]
    if len(short):
        raise ValueError(
            f"step {int(short.index[0])} has micro-batches on {int(short.iloc[0])} of {w} ranks; the others would "
            f"wait forever in the step's collective ops"
        )
    if "epoch" in plan.columns:
        epochs_per_step = plan.groupby("step")["epoch"].agg(["nunique", "min"])
        split = epochs_per_step[epochs_per_step["nunique"] > 1]
        if len(split):
            raise ValueError(f"step {int(split.index[0])} spans several epochs; every step must lie in one epoch")
        if np.any(np.diff(epochs_per_step["min"].to_numpy()) < 0):
            raise ValueError("plan steps must increase with epochs")
    return int(ranks_per_step.size)
