"""Slot machinery of the ``cluster`` plan: micro-batches grouped into per-step slots of distinct clusters,
mixed micro-batches re-cut per slot, ranks assigned by load (internal to :mod:`ray_cluster_ft.allocate`).
"""

from __future__ import annotations

import heapq
from functools import partial

import numpy as np

# Stream tags mixed into the seed so drop choice, slot order and rank tie-breaks never share random draws.
_TAG_DROP, _TAG_ORDER, _TAG_RANKS, _TAG_SLOTS = 1, 2, 3, 4


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
