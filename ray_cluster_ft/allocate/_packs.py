"""Packed plans (``allocation.packing``): whole examples concatenated into packs of at most
``max_tokens_per_micro_batch`` tokens, one pack per micro-batch (internal to :mod:`ray_cluster_ft.allocate`).

A set of packs is held in CSR form: ``rows`` (int64, row indices grouped by pack, shortest first inside a pack),
``ptr`` (int64 (P + 1,), pack p holds ``rows[ptr[p]:ptr[p + 1]]``). Every function here is pure and
deterministic for the generators it is given.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

import numpy as np

from ._light import _light_collisions, _light_packs
from ._slots import _TAG_ORDER, _TAG_RANKS, _TAG_SLOTS, _form_slots, _rng

# Stream tag of the per-epoch cut (seed + epoch): the length jitter and tie-breaks of the packing order.
_TAG_CUT = 5
# The cluster strategy sorts each cluster's rows by length x exp(U(-J, J)) before best-fit-decreasing, so
# every epoch's packs differ while the order stays nearly decreasing (which is what keeps BFD's packs full).
_JITTER = 0.05


def bfd(lengths, cap: int) -> np.ndarray:
    """Best-fit decreasing bin packing, in the order given.

    Each item goes into the open pack with the least room that still holds it; when none holds it, a new pack
    opens. Among packs of equal room, the one that came to that room first is used first. This is TRL's ``pack_dataset(strategy="bfd")``
    (a segment tree over rooms there, a sorted list of the distinct rooms here: at most ``cap`` of them, so an
    item costs one bisection). The caller sorts the items (descending length makes it best-fit *decreasing*).

    Args:
        lengths: int (n,) item sizes, each in 1..cap.
        cap: pack capacity (tokens).

    Returns:
        int64 (n,) pack index of each item; packs are numbered 0.. in opening order.

    Raises:
        ValueError: an item larger than ``cap``.
    """
    ln = np.asarray(lengths, dtype=np.int64)
    if ln.size and int(ln.max()) > cap:
        raise ValueError(f"an item of {int(ln.max())} exceeds the pack capacity {cap}")
    rooms: list[int] = []  # sorted distinct rooms (> 0) of the open packs
    at: dict[int, deque] = {}  # room -> packs with that room, first opened first
    out = []
    n_packs = 0
    for x in ln.tolist():
        j = bisect_left(rooms, x)
        if j < len(rooms):
            room = rooms[j]
            q = at[room]
            p = q.popleft()
            if not q:
                del rooms[j]
                del at[room]
        else:
            p, room = n_packs, cap
            n_packs += 1
        out.append(p)
        room -= x
        if room > 0:
            q = at.get(room)
            if q is None:
                insort(rooms, room)
                at[room] = deque((p,))
            else:
                q.append(p)
    return np.asarray(out, dtype=np.int64)


def _csr(pack_of: np.ndarray, rows: np.ndarray, nt: np.ndarray, n_packs: int):
    """CSR (rows, ptr) from ``pack_of[i]`` = pack of ``rows[i]``; shortest row first inside a pack."""
    order = np.lexsort((rows, nt[rows], pack_of))
    counts = np.bincount(pack_of, minlength=n_packs)
    return rows[order].astype(np.int64), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _pack_stats(rows: np.ndarray, ptr: np.ndarray, code: np.ndarray, nt: np.ndarray):
    """(tokens int64 (P,), key int64 (P,): the pack's cluster code when all its rows share one, else -1)."""
    sizes = np.diff(ptr)
    pid = np.repeat(np.arange(sizes.size), sizes)
    tokens = np.bincount(pid, weights=nt[rows], minlength=sizes.size).astype(np.int64)
    c = code[rows]
    lo = np.minimum.reduceat(c, ptr[:-1]) if rows.size else np.empty(0, dtype=np.int64)
    hi = np.maximum.reduceat(c, ptr[:-1]) if rows.size else np.empty(0, dtype=np.int64)
    return tokens, np.where(lo == hi, lo, -1).astype(np.int64)


def _check_fits(ids: np.ndarray, nt: np.ndarray, cap: int) -> None:
    if nt.size and int(nt.max()) > cap:
        i = int(np.argmax(nt))
        raise ValueError(f"example {ids[i]!r} has {int(nt[i])} tokens, more than max_tokens_per_micro_batch={cap}: "
                         f"a pack never cuts an example (raise the maximum, or truncate/reject the example)")


def _split_packs(rows: np.ndarray, ptr: np.ndarray, nt: np.ndarray, x: int, unit: int, cap: int):
    """``x`` more packs by splitting packs in two: each time the pack with the most rows (then the most tokens)
    gives its lighter half of rows (every other row in length order) to a new pack. A part of a pack that fits
    ``cap`` fits too, so this succeeds whenever there are at least ``P + x`` rows: the fallback of
    :func:`_even_count` when no light re-cut fits. The new packs are ordinary packs (no light steps of their own).

    Returns:
        (rows, ptr) CSR of ``P + x`` packs.

    Raises:
        ValueError: fewer rows than ``P + x``: every pack would have to hold one example and there would still
            be too few packs for whole steps of ``unit`` (= world_size x grad_accum) packs.
    """
    p = ptr.size - 1
    if rows.size < p + x:
        raise ValueError(
            f"{rows.size} examples make {p} packs of at most {cap} tokens, and whole optimizer steps of {unit} packs "
            f"(world_size x grad_accum) need {p + x}, more packs than examples: raise "
            f"train.max_tokens_per_micro_batch, lower train.grad_accum or train.num_workers, or select more rows")
    packs = [rows[ptr[q]:ptr[q + 1]] for q in range(p)]
    for _ in range(x):
        big = max(range(len(packs)), key=lambda q: (packs[q].size, int(nt[packs[q]].sum()), -q))
        part = packs[big][np.argsort(-nt[packs[big]], kind="stable")]
        packs[big], extra = part[0::2], part[1::2]
        packs.append(extra)
    pid = np.repeat(np.arange(len(packs)), [a.size for a in packs])
    return _csr(pid, np.concatenate(packs), nt, len(packs))


_RECUT_TRIES = 8  # pools tried for the light re-cut of _even_count (each W x G packs more than the last)
_MIN_SINGLE = 0.9  # a larger pool is tried only while single-cluster packs stay at least this share


def _single_packs(code: np.ndarray, pack: np.ndarray, m: int) -> int:
    """How many of packs 0..m-1 hold rows of one cluster only (``pack[i]``: the pack of a row of ``code[i]``)."""
    lo = np.full(m, np.iinfo(np.int64).max)
    hi = np.full(m, np.iinfo(np.int64).min)
    np.minimum.at(lo, pack, code)
    np.maximum.at(hi, pack, code)
    return int((lo == hi).sum())


def _even_count(rows, ptr, code, nt, cap: int, w: int, g: int, prefer_mixed: bool = True):
    """Make the number of packs a multiple of W x G without dropping a row.

    With P packs, ``x = -P mod (W G)`` more are needed. The mixed packs and, as needed, single-cluster packs
    round-robin over clusters (``prefer_mixed``; otherwise the least full packs only; ``y`` packs in all,
    ``y + x`` a multiple of W x G) are re-cut by :func:`_light_packs` into ``y + x`` lighter packs of nearly
    equal tokens that fill whole steps of their own, so they do not unbalance a step of full packs, and that
    share few clusters across ranks. ``y`` grows by W x G until the re-cut fits ``cap`` (then smaller ``y`` are
    tried); with ``prefer_mixed``, up to ``_RECUT_TRIES`` pools that fit are compared in that order and the
    one whose light steps have the fewest collisions (:func:`_light_collisions`) is kept: the first pool that
    fits always qualifies, a later one only with fewer collisions and at least ``_MIN_SINGLE`` of all packs
    single-cluster.

    Returns (rows, ptr, n_light): a multiple of W x G packs (unchanged when P already is one), the re-cut ones
    last (``n_light`` of them, a multiple of W x G; 0 when nothing was re-cut), ordered rank-major: rank r's
    light packs are ``r * n_light / W`` .. onwards.

    When no light re-cut fits ``cap``, ``x`` packs are split in two instead (:func:`_split_packs`), which works
    whenever there are at least ``P + x`` rows.

    Raises:
        ValueError: fewer rows than W x G (some rank would get no pack), or fewer rows than ``P + x``.
    """
    unit = w * g
    p = ptr.size - 1
    x = (-p) % unit
    if x == 0:
        return rows, ptr, 0
    if rows.size < unit:
        raise ValueError(f"{rows.size} examples cannot fill one optimizer step of {unit} packs (world_size x "
                         f"grad_accum): some ranks would get no micro-batch")
    tokens, key = _pack_stats(rows, ptr, code, nt)
    sizes = np.diff(ptr)
    if prefer_mixed:
        # Mixed first, then single-cluster packs round-robin over clusters (each cluster's least full first),
        # so no cluster's rows outweigh one rank's share of the re-cut (that would put it on two ranks).
        by_fill = np.lexsort((np.arange(p), tokens, key))
        kf = key[by_fill]
        new_run = np.ones(p, dtype=bool)
        new_run[1:] = kf[1:] != kf[:-1]
        nth = np.empty(p, dtype=np.int64)
        nth[by_fill] = np.arange(p) - np.maximum.accumulate(np.where(new_run, np.arange(p), 0))
        pick_order = np.lexsort((np.arange(p), tokens, nth, key >= 0))
        j0 = max(1, (int((key < 0).sum()) + x) // unit)  # as many as the mixed packs allow (small groups)
    else:
        pick_order = np.lexsort((np.arange(p), tokens))  # the least full
        j0 = 1
    j_max = -(-(p + x) // unit)
    best = None
    tries = 0
    for j in [*range(j0, j_max + 1), *range(1, j0)]:
        y = min(unit * j - x, p)
        m = y + x
        chosen = pick_order[:y]
        sel_rows = np.concatenate([rows[ptr[q]:ptr[q + 1]] for q in chosen.tolist()])
        cut = _light_packs(sel_rows, code, nt, w, m // w, cap, g)
        if cut is None:
            continue
        # A pool dominated by one cluster (the loose rows of a cluster of long rows fill the mixed packs) must
        # spread it over several ranks; a few more re-cut packs, drawn round-robin over clusters, dilute it, as
        # long as single-cluster packs stay at least _MIN_SINGLE of all.
        split = _light_collisions(code[sel_rows], cut, m // w, g)
        single = int((key[pick_order[y:]] >= 0).sum()) + _single_packs(code[sel_rows], cut, m)
        if best is None or (split < best[0] and single >= _MIN_SINGLE * (p + x)):
            best = (split, m, chosen, sel_rows, cut)
        tries += 1
        if best[0] == 0 or tries == _RECUT_TRIES or not prefer_mixed:
            break
    if best is None:
        return (*_split_packs(rows, ptr, nt, x, unit, cap), 0)
    _, m, chosen, sel_rows, cut = best
    keep = np.setdiff1d(np.arange(p), chosen)
    kept_rows = np.concatenate([rows[ptr[q]:ptr[q + 1]] for q in keep.tolist()]) if keep.size else rows[:0]
    kept_pid = np.repeat(np.arange(keep.size), sizes[keep])
    all_rows = np.concatenate([kept_rows, sel_rows])
    all_pid = np.concatenate([kept_pid, keep.size + cut])
    out_rows, out_ptr = _csr(all_pid, all_rows, nt, keep.size + m)
    return out_rows, out_ptr, m


def _pack_clusters(code: np.ndarray, nt: np.ndarray, rows: np.ndarray, cap: int, tol: float,
                   rng: np.random.Generator):
    """Single-cluster packs by best-fit decreasing inside each cluster; packs emptier than ``tol`` (fill below
    ``1 - tol``) give their rows to a pool that is packed the same way across clusters (mixed packs).

    Args:
        code: int (N,) cluster code per row; nt: int (N,) tokens; rows: int (n,) the rows to pack.
        cap: tokens per pack; tol: the largest empty share a single-cluster pack keeps (``pad_tolerance``).
        rng: the epoch's cut stream: length jitter (x exp(U(-0.05, 0.05))) and tie-breaks.

    Returns:
        (rows, ptr) CSR of the packs.
    """
    n = rows.size
    jit = nt[rows] * np.exp(rng.uniform(-_JITTER, _JITTER, n))
    order = rows[np.lexsort((rng.random(n), -jit, code[rows]))]
    c_sorted = code[order]
    bounds = np.flatnonzero(np.diff(c_sorted)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    pack_of = np.empty(n, dtype=np.int64)
    offset = 0
    for a, b in zip(starts.tolist(), ends.tolist()):
        p = bfd(nt[order[a:b]], cap)
        pack_of[a:b] = p + offset
        offset += int(p.max()) + 1
    prow, pptr = _csr(pack_of, order, nt, offset)
    tokens = np.add.reduceat(nt[prow], pptr[:-1])
    loose = tokens < (1.0 - tol) * cap
    if not loose.any():
        return prow, pptr
    sizes = np.diff(pptr)
    row_loose = np.repeat(loose, sizes)
    pool = prow[row_loose]
    # Cluster by cluster, longest first inside each: a mixed pack then holds few clusters (two or three
    # neighbours in this order), so it collides with few other ranks.
    pool = pool[np.lexsort((rng.random(pool.size), -nt[pool], code[pool]))]
    mixed = bfd(nt[pool], cap)
    tight_pid = np.repeat(np.cumsum(~loose) - 1, sizes)[~row_loose]
    n_tight = int((~loose).sum())
    return _csr(np.concatenate([tight_pid, n_tight + mixed]), np.concatenate([prow[~row_loose], pool]), nt,
                n_tight + int(mixed.max()) + 1)


def _bundles(tokens: np.ndarray, key: np.ndarray, g: int):
    """Group packs into bundles of ``g`` (one rank's micro-batches of one step): each cluster's single-cluster
    packs, heaviest first, ``g`` at a time; the remainders and the mixed packs, heaviest first, ``g`` at a time
    (mixed bundles). Returns (bundle int64 (U, g) pack ids, key int64 (U,): cluster code or -1, cost (U,))."""
    p = tokens.size
    pure = key >= 0
    order = np.lexsort((np.arange(p), -tokens, np.where(pure, key, np.iinfo(np.int64).max)))
    k_sorted = key[order]
    # position inside its cluster's run
    new_run = np.ones(p, dtype=bool)
    new_run[1:] = k_sorted[1:] != k_sorted[:-1]
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(p), 0))
    pos = np.arange(p) - run_start
    run_len = np.diff(np.concatenate([np.flatnonzero(new_run), [p]]))
    full_len = np.repeat((run_len // g) * g, run_len)
    in_full = (k_sorted >= 0) & (pos < full_len)
    full = order[in_full].reshape(-1, g)
    rest = order[~in_full]
    rest = rest[np.lexsort((rest, -tokens[rest]))].reshape(-1, g)
    bundles = np.concatenate([full, rest]).astype(np.int64)
    bkey = np.concatenate([key[full[:, 0]], np.full(rest.shape[0], -1, dtype=np.int64)])
    if rest.size:  # a mixed bundle whose packs happen to share one cluster is a pure one
        rk = key[rest]
        same = (rk == rk[:, :1]).all(axis=1) & (rk[:, 0] >= 0)
        bkey[full.shape[0]:][same] = rk[same, 0]
    return bundles, bkey, tokens[bundles].sum(axis=1)


def _clusters_of(bundles: np.ndarray, rows: np.ndarray, ptr: np.ndarray, code: np.ndarray) -> list[frozenset]:
    """The set of cluster codes present in each bundle's rows."""
    out = []
    for b in bundles.tolist():
        out.append(frozenset(np.unique(np.concatenate([code[rows[ptr[p]:ptr[p + 1]]] for p in b])).tolist()))
    return out


def _collisions(members) -> int:
    """Sum over clusters of (bundles holding it - 1), for a list of cluster sets."""
    seen: dict = {}
    for st in members:
        for c in st:
            seen[c] = seen.get(c, 0) + 1
    return sum(v - 1 for v in seen.values())


# How far (x the largest bundle) two bundles' tokens may differ for _row_distinct to trade them: the repeats sit
# in the light re-cut steps, ~5% lighter than full ones (bench/plan_goals.py, tfidf, W = 4, k = 8: 0.01 left 5
# collisions in 87 steps, 0.05 left 3, 0.08 none).
_SWAP_GAP = 0.08


def _row_distinct(slots: np.ndarray, csets: list[frozenset], cost: np.ndarray, reach: int = 16,
                  max_gap: float = _SWAP_GAP) -> None:
    """Trade bundles between nearby slots (in walk order, so of similar cost) to remove repeats counted per row,
    in place: a cluster present in two bundles of one slot (whatever their majorities) is one collision.

    For each slot with a collision, every bundle that takes part in one may swap with a bundle of a slot at
    most ``reach`` away whose cost differs by at most ``max_gap`` x the largest cost (each trade moves a step's
    tokens by at most that much; trades add up over retries and passes); the swap that removes the most
    collisions from the two slots together (then the closest cost) is made, and the slot is tried again until
    no swap helps. Up to three passes over the plan.
    """
    n_slots, w = slots.shape
    limit = max_gap * float(cost.max()) if cost.size else 0.0
    for _ in range(3):
        changed = False
        for s in range(n_slots):
            while True:
                here = [csets[u] for u in slots[s]]
                base = _collisions(here)
                if base == 0:
                    break
                counts: dict = {}
                for st in here:
                    for c in st:
                        counts[c] = counts.get(c, 0) + 1
                best = None
                for i in range(w):
                    u = slots[s, i]
                    if not any(counts[c] > 1 for c in csets[u]):
                        continue
                    rest = here[:i] + here[i + 1:]
                    for s2 in range(max(0, s - reach), min(n_slots, s + reach + 1)):
                        if s2 == s:
                            continue
                        there = [csets[v] for v in slots[s2]]
                        base2 = _collisions(there)
                        for j in range(w):
                            v = slots[s2, j]
                            gap = abs(float(cost[u]) - float(cost[v]))
                            if gap > limit:
                                continue
                            gain = base + base2 - _collisions(rest + [csets[v]]) - _collisions(
                                there[:j] + there[j + 1:] + [csets[u]])
                            if gain > 0 and (best is None or (gain, -gap) > (best[0], -best[1])):
                                best = (gain, gap, s2, i, j)
                if best is None:
                    break
                _, _, s2, i, j = best
                slots[s, i], slots[s2, j] = slots[s2, j], slots[s, i]
                changed = True
        if not changed:
            break


def cluster_epoch(code: np.ndarray, nt: np.ndarray, rows: np.ndarray, w: int, g: int, cap: int, tol: float,
                  seed_e: int):
    """One epoch of the packed ``cluster`` plan, cut with seed ``seed_e`` (= seed + epoch).

    Packs (:func:`_pack_clusters`), made a multiple of W x G (:func:`_even_count`), grouped into bundles of G
    (:func:`_bundles`), bundles into steps of W from distinct clusters with similar tokens (the ``cluster``
    plan's walk, :func:`ray_cluster_ft.allocate._slots._form_slots`, mixed bundles as wildcards), then
    repeats counted per row are traded away (:func:`_row_distinct`). Steps come in a seeded order, and the W
    bundles of a step go to ranks in a seeded order (they carry similar tokens, so any order balances).

    Returns:
        (rows, ptr, sched int64 (steps, G, W) pack ids: ``sched[s, m, r]`` is rank r's pack at micro_index m).
    """
    rng = _rng(seed_e, _TAG_CUT)
    prow, pptr = _pack_clusters(code, nt, rows, cap, tol, rng)
    prow, pptr, n_light = _even_count(prow, pptr, code, nt, cap, w, g)
    tokens, key = _pack_stats(prow, pptr, code, nt)
    n_main = tokens.size - n_light
    bundles, bkey, bcost = _bundles(tokens[:n_main], key[:n_main], g)
    slots = _form_slots(bkey, bcost, w)
    if n_light:
        # The re-cut packs (rank-major, :func:`_light_packs`) fill steps of their own (they are lighter):
        # light step t gives rank r its packs r * L + t * G .. + G, so each rank keeps its own clusters.
        n_light_steps = n_light // (w * g)
        light = (n_main + np.arange(n_light)).reshape(w, n_light_steps, g).transpose(1, 0, 2).reshape(-1, g)
        slots = np.concatenate([slots, bundles.shape[0] + np.arange(light.shape[0]).reshape(-1, w)])
        bundles = np.concatenate([bundles, light])
        bcost = np.concatenate([bcost, tokens[light].sum(axis=1)])
    _row_distinct(slots, _clusters_of(bundles, prow, pptr, code), bcost)
    n_steps = slots.shape[0]
    slots = slots[_rng(seed_e, _TAG_ORDER).permutation(n_steps)]
    rank_perm = np.argsort(_rng(seed_e, _TAG_RANKS).random((n_steps, w)), axis=1)
    slots = np.take_along_axis(slots, rank_perm, axis=1)
    sched = bundles[slots].transpose(0, 2, 1)  # (steps, G, W)
    return prow, pptr, sched


def random_packs(code: np.ndarray, nt: np.ndarray, n: int, w: int, g: int, cap: int, seed: int):
    """Packs of the ``random`` packed baseline, cut once: a seeded permutation of the rows, stably sorted by
    length descending, packed by best-fit decreasing (TRL ``SFTTrainer(packing=True)``, ``bfd``), then made a
    multiple of W x G (:func:`_even_count`). Returns (rows, ptr)."""
    perm = _rng(seed, _TAG_ORDER, 0).permutation(n)
    order = perm[np.argsort(-nt[perm], kind="stable")]
    pack_of = bfd(nt[order], cap)
    prow, pptr = _csr(pack_of, order, nt, int(pack_of.max()) + 1)
    return _even_count(prow, pptr, code, nt, cap, w, g, prefer_mixed=False)[:2]


def random_epoch_sched(n_packs: int, w: int, g: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch`` of the random packed baseline: the packs in a seeded order, rank r takes every W-th pack
    from position r (``DistributedSampler``), G consecutive per step. Returns int64 (steps, G, W) pack ids."""
    perm = _rng(seed, _TAG_SLOTS, epoch).permutation(n_packs)
    per_rank = perm.reshape(-1, w).T  # (W, steps * G)
    return per_rank.reshape(w, -1, g).transpose(1, 2, 0)


def packed_frame(epoch_parts, ids, cl, nt):
    """The plan frame of packed epochs.

    Args:
        epoch_parts: per epoch ``(rows, ptr, sched)``: CSR packs and ``sched[s, m, r]`` pack ids.
        ids, cl, nt: per-row id (str), cluster, tokens.

    Returns:
        DataFrame with :data:`ray_cluster_ft.allocate.PLAN_COLUMNS`, sorted by (rank, epoch, step, micro_index,
        position in the pack).
    """
    import pandas as pd

    cols = {c: [] for c in ("epoch", "step", "rank", "micro_index", "row")}
    step0 = 0
    for e, (rows, ptr, sched) in enumerate(epoch_parts):
        n_steps = sched.shape[0]
        seq = sched.transpose(2, 0, 1)  # rank, step, micro_index: the iterator order
        grid = np.indices(seq.shape)
        packs = seq.ravel()
        sizes = (ptr[1:] - ptr[:-1])[packs]
        starts = np.repeat(ptr[packs] - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        cols["row"].append(rows[starts + np.arange(int(sizes.sum()))])
        cols["epoch"].append(np.full(int(sizes.sum()), e, dtype=np.int64))
        cols["step"].append(np.repeat(grid[1].ravel() + step0, sizes))
        cols["rank"].append(np.repeat(grid[0].ravel(), sizes))
        cols["micro_index"].append(np.repeat(grid[2].ravel(), sizes))
        step0 += n_steps
    cat = {c: np.concatenate(v).astype(np.int64) for c, v in cols.items()}
    frame = pd.DataFrame({"epoch": cat["epoch"], "step": cat["step"], "rank": cat["rank"],
                          "micro_index": cat["micro_index"], "example_id": ids[cat["row"]].astype(object),
                          "cluster": cl[cat["row"]], "n_tokens": nt[cat["row"]]})
    order = np.lexsort((np.arange(len(frame)), frame["micro_index"].to_numpy(), frame["step"].to_numpy(),
                        frame["epoch"].to_numpy(), frame["rank"].to_numpy()))
    return frame.iloc[order].reset_index(drop=True)
