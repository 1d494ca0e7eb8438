"""Packs sized to the data (``allocation.packing: auto`` without ``train.max_tokens_per_micro_batch``): the
default plan (internal to :mod:`ray_cluster_ft.allocate`).

The number of optimizer steps is the unpacked plan's (``N // (W B G)``, fewer when a pack would be shorter than
the longest row), so a step trains about as many rows as a padded micro-batch step; every epoch's ``P = S W G``
packs then hold ``T / P`` tokens each as nearly as whole rows allow, and the pack size reported
(``max_tokens_per_micro_batch``) is the fullest pack's tokens.

Layout (McNaughton's wrap-around rule for preemptive scheduling, McNaughton 1959, "Scheduling with deadlines
and loss functions", Management Science 6(1)): the clusters are laid one after another on one line of ``T``
tokens, the line is cut into ``P`` consecutive packs of ``T / P`` tokens, and rank r takes packs ``r Q ..
(r + 1) Q - 1`` (``Q = S G``), ``G`` consecutive ones per step. A cluster occupies one interval of the line; it
can meet itself in a step only where its interval straddles a rank boundary and its two ends reach the same
step, which needs more than ``T / W - T / P`` tokens (one step short of a rank's share). So every step's ranks
hold distinct clusters, counted per row, whenever no cluster holds more than about 1/W of the tokens; a
cluster above 1/W must sit on two ranks at some step under any plan. A pack holds one cluster except where
one cluster ends and the next begins.

Inside a cluster the rows are free to move, and each pack is filled to its cumulative target (pack j ends as
near ``(j + 1) T / P`` as rows allow: the largest row that still fits first, then the smaller ones, then the
choice between stopping short and the smallest row's overshoot, whichever misses less), so errors do not add
up along the line. Every epoch (seed + epoch) tries a few seeded cluster orders (clusters within two packs of
1/W of the tokens first, largest first: the first starts on a rank boundary) and keeps the one with the
fewest per-row collisions, then the most even packs; rows of one cluster are then traded between its packs to
even them further (:func:`_even_out`: collision counts unchanged); repeats left (a cluster above 1/W, or near it) are traded
between steps by :func:`ray_cluster_ft.allocate._packs._row_distinct`. Steps come in a seeded order and each
step's packs go to ranks in a seeded order, as in the other packed plan.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from ._packs import _clusters_of, _row_distinct
from ._slots import _TAG_ORDER, _TAG_RANKS, _rng

# Stream tag of the sized plan's cluster orders and row tie-breaks.
_TAG_SIZED = 6
# Cluster orders tried per epoch (each is one pass over the rows); one above this many rows.
_ORDERS = 6
_ORDERS_UP_TO = 200_000


def sized_steps(nt: np.ndarray, w: int, b: int, g: int) -> int:
    """Optimizer steps per epoch of the sized plan: the unpacked plan's ``N // (W B G)``, lowered so that a pack
    (``T / (S W G)`` tokens) is at least the longest row, and at least 1.

    Args:
        nt: int (N,) tokens of the rows; w, b, g: world size, micro-batch (rows), grad_accum.

    Raises:
        ValueError: fewer than ``W G`` rows (some rank would get no pack).
    """
    n = int(nt.size)
    if n < w * g:
        raise ValueError(f"{n} examples cannot fill one optimizer step of world_size={w} x grad_accum={g} packs: "
                         f"some ranks would get no micro-batch")
    by_rows = n // (w * b * g)
    by_length = int(nt.sum()) // (w * g * int(nt.max()))
    return max(1, min(by_rows, by_length))


def _fill(order_c, members, nt: np.ndarray, n_packs: int) -> np.ndarray:
    """Pack index (int64, per row of ``members``' concatenation in ``order_c`` order) of the wrap-around cut.

    ``members[c]`` holds cluster c's rows sorted by tokens ascending. Packs are filled along the line to the
    cumulative targets ``(j + 1) T / P``; every pack gets at least one row, and a pack closes early when the rows
    left are only as many as the packs left."""
    total = float(sum(int(nt[m].sum()) for m in members))
    per = total / n_packs
    rows_left = sum(m.size for m in members)
    out_rows, out_pack = [], []
    j, filled, in_pack = 0, 0, 0
    for c in order_c:
        rows = members[c].tolist()
        lens = nt[members[c]].tolist()
        while lens:
            last = j == n_packs - 1
            room = float("inf") if last else (j + 1) * per - filled
            if in_pack and not last and rows_left <= n_packs - 1 - j:
                j, in_pack = j + 1, 0  # the rows left are needed one per pack
                continue
            i = bisect_right(lens, room) - 1
            if i < 0:  # nothing fits: stop short, or take the smallest row, whichever misses the target less
                if in_pack and lens[0] - room >= room:
                    j, in_pack = j + 1, 0
                    continue
                i = 0
            out_rows.append(rows.pop(i))
            filled += lens.pop(i)
            out_pack.append(j)
            in_pack += 1
            rows_left -= 1
            if not last and filled >= (j + 1) * per:
                j, in_pack = j + 1, 0
    return np.asarray(out_rows, dtype=np.int64), np.asarray(out_pack, dtype=np.int64)


def _even_out(rows: np.ndarray, pack: np.ndarray, code: np.ndarray, nt: np.ndarray, n_packs: int) -> None:
    """Even the packs' tokens by swapping rows of one cluster between two of its packs, in place on ``pack``.

    A swap of two rows of cluster c keeps c in both packs, so which clusters each pack holds (and so every
    collision count) is unchanged. For each cluster, the heaviest and the lightest of the packs holding its rows
    trade the pair of its rows whose length difference comes nearest half their gap (only a difference strictly
    between 0 and the gap narrows it), until no pair narrows it (at most twice as many trades as the cluster has
    packs). This evens the packs of clusters whose rows are all long, which the cumulative fill cannot.
    """
    tokens = np.bincount(pack, weights=nt[rows], minlength=n_packs)
    by_cluster = np.argsort(code[rows], kind="stable")
    bounds = np.flatnonzero(np.diff(code[rows][by_cluster])) + 1
    for pos in np.split(by_cluster, bounds):
        held: dict[int, list[int]] = {}
        for i in pos.tolist():
            held.setdefault(int(pack[i]), []).append(i)
        if len(held) < 2:
            continue
        packs_c = np.fromiter(held, dtype=np.int64)
        for _ in range(2 * packs_c.size):
            t = tokens[packs_c]
            hi, lo = int(packs_c[np.argmax(t)]), int(packs_c[np.argmin(t)])
            gap = float(tokens[hi] - tokens[lo])
            a_pos, b_pos = np.asarray(held[hi]), np.asarray(held[lo])
            diff = nt[rows[a_pos]][:, None] - nt[rows[b_pos]][None, :]
            ok = (diff > 0) & (diff < gap)
            if not ok.any():
                break
            score = np.where(ok, np.abs(diff - gap / 2.0), np.inf)
            ia, ib = np.unravel_index(int(np.argmin(score)), score.shape)
            i, j = int(a_pos[ia]), int(b_pos[ib])
            pack[i], pack[j] = lo, hi
            held[hi].remove(i)
            held[lo].remove(j)
            held[hi].append(j)
            held[lo].append(i)
            d = float(diff[ia, ib])
            tokens[hi] -= d
            tokens[lo] += d


def _layout_collisions(code_rows: np.ndarray, pack: np.ndarray, w: int, q: int, g: int) -> int:
    """Per-row collisions of the wrap-around layout: sum over (step, cluster) of the ranks holding it - 1."""
    rank = pack // q
    step = (pack % q) // g
    key = np.unique(np.stack([step, code_rows, rank]), axis=1)
    _, per = np.unique(key[:2], axis=1, return_counts=True)
    return int((per - 1).sum())


def sized_epoch(code: np.ndarray, nt: np.ndarray, w: int, g: int, steps: int, seed_e: int):
    """One epoch of the sized plan (see the module docstring), cut with seed ``seed_e`` (= seed + epoch).

    Args:
        code: int64 (N,) cluster codes 0..k-1; nt: int64 (N,) tokens; w, g: world size, grad_accum;
        steps: optimizer steps of the epoch (:func:`sized_steps`).

    Returns:
        (rows, ptr, sched): CSR packs (shortest row first inside a pack) and ``sched`` int64 (steps, G, W),
        ``sched[s, m, r]`` rank r's pack at micro_index m of step s.
    """
    rng = _rng(seed_e, _TAG_SIZED)
    n_packs = steps * w * g
    q = steps * g
    k = int(code.max()) + 1
    tie = rng.random(code.size)
    members = []
    for c in range(k):
        m = np.flatnonzero(code == c)
        members.append(m[np.lexsort((tie[m], nt[m]))])
    share = np.bincount(code, weights=nt, minlength=k)
    # A cluster within two packs of a rank's share can meet itself only where it straddles a rank boundary;
    # laid first, it starts on one (rank 0's first pack).
    near = share > share.sum() / w - 2.0 * share.sum() / n_packs
    best = None
    for _ in range(_ORDERS if code.size <= _ORDERS_UP_TO else 1):
        order_c = rng.permutation(k)
        order_c = order_c[np.lexsort((-share[order_c] * near[order_c], ~near[order_c]))]
        rows, pack = _fill(order_c, members, nt, n_packs)
        tokens = np.bincount(pack, weights=nt[rows], minlength=n_packs)
        score = (_layout_collisions(code[rows], pack, w, q, g), float(tokens.max() - tokens.min()))
        if best is None or score < best[0]:
            best = (score, rows, pack)
    _, rows, pack = best
    _even_out(rows, pack, code, nt, n_packs)
    srt = np.lexsort((rows, nt[rows], pack))
    rows, pack = rows[srt], pack[srt]
    ptr = np.concatenate([[0], np.cumsum(np.bincount(pack, minlength=n_packs))]).astype(np.int64)
    # Rank-steps (bundles of G packs) in line order: bundle r * S + s is rank r's step s.
    bundles = np.arange(n_packs, dtype=np.int64).reshape(w * steps, g)
    slots = np.arange(w * steps, dtype=np.int64).reshape(w, steps).T.copy()  # (steps, W) bundle ids
    if best[0][0]:
        tokens = np.bincount(pack, weights=nt[rows], minlength=n_packs)
        _row_distinct(slots, _clusters_of(bundles, rows, ptr, code), tokens[bundles].sum(axis=1))
    slots = slots[_rng(seed_e, _TAG_ORDER).permutation(steps)]
    rank_perm = np.argsort(_rng(seed_e, _TAG_RANKS).random((steps, w)), axis=1)
    slots = np.take_along_axis(slots, rank_perm, axis=1)
    return rows, ptr, bundles[slots].transpose(0, 2, 1)


def over_share(code: np.ndarray, nt: np.ndarray, w: int) -> list[tuple[int, float]]:
    """The clusters holding more than 1/W of the tokens (they must sit on two ranks at some step under any
    plan): ``[(cluster code, token share)]``, largest share first."""
    share = np.bincount(code, weights=nt) / float(nt.sum())
    big = np.flatnonzero(share > 1.0 / w)
    return [(int(c), float(share[c])) for c in big[np.argsort(-share[big], kind="stable")]]
