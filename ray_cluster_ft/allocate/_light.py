"""The light re-cut of packed plans (internal to :mod:`ray_cluster_ft.allocate`): the rows left over when the
pack count must become a multiple of W x G are shared among the ranks and cut into lighter packs that fill steps
of their own, with few clusters on two ranks of one step. Pure functions, deterministic for their inputs.
"""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import numpy as np


def _cut_points(cs: np.ndarray, bnd: np.ndarray, parts: int, snap: float) -> np.ndarray | None:
    """Edges (int64 (parts + 1,), 0 .. n) cutting a sequence with token prefix sums ``cs`` into ``parts`` runs
    of nearly equal tokens; a cut moves to the nearest allowed boundary in ``bnd`` (positions) when that is
    within ``snap`` x the mean run. None when a run would be empty."""
    n = cs.size
    total = int(cs[-1])
    mean = total / parts
    bnd_cs = cs[bnd - 1] if bnd.size else np.empty(0)
    cuts = []
    for i in range(1, parts):
        t = i * mean
        pos = int(np.searchsorted(cs, t, side="left"))  # first row whose prefix reaches t
        before = cs[pos - 1] if pos else 0
        cut = pos + 1 if cs[pos] - t < t - before else pos  # the nearest row edge
        if bnd.size:
            j = int(np.argmin(np.abs(bnd_cs - t)))
            if abs(bnd_cs[j] - t) <= snap * mean:
                cut = int(bnd[j])
        cuts.append(cut)
    edges = np.array([0, *cuts, n], dtype=np.int64)
    return None if (np.diff(edges) <= 0).any() else edges


def _rank_groups(rows: np.ndarray, code: np.ndarray, nt: np.ndarray, w: int, tol: float) -> list[np.ndarray]:
    """Share rows among ``w`` ranks with nearly equal tokens, keeping each cluster's rows on one rank where the
    balance allows.

    Each cluster's rows form a group; groups go whole, largest first, to the least loaded rank (LPT). Then,
    while the heaviest rank is more than ``tol`` above the mean or the lightest more than ``tol`` below, the
    heaviest hands the lightest its largest group that narrows the gap, or trades one of its groups for a
    smaller one of the lightest's (:func:`_best_swap`), whichever brings the two closer; only when neither
    narrows the gap does it hand over the shortest rows of its smallest group, as many as close the gap (that
    cluster then sits on two ranks).

    Returns:
        ``w`` int64 arrays of rows, cluster by cluster and longest first inside each.
    """
    order = np.lexsort((-nt[rows], code[rows]))
    srt = rows[order]
    bounds = np.flatnonzero(np.diff(code[srt])) + 1
    groups = [g for g in np.split(srt, bounds) if g.size]
    tok = [int(nt[g].sum()) for g in groups]
    mean = sum(tok) / w
    bins: list[list[np.ndarray]] = [[] for _ in range(w)]
    loads = np.zeros(w, dtype=np.int64)
    for i in np.argsort([-t for t in tok], kind="stable").tolist():
        b = int(np.argmin(loads))
        bins[b].append(groups[i])
        loads[b] += tok[i]
    for _ in range(4 * w + len(groups)):
        h, lo = int(np.argmax(loads)), int(np.argmin(loads))
        if loads[h] <= mean * (1 + tol) and loads[lo] >= mean * (1 - tol):
            break
        gap = int(loads[h] - loads[lo])
        sizes = [int(nt[g].sum()) for g in bins[h]]
        movable = [j for j, t in enumerate(sizes) if t < gap]  # moving it narrows the gap
        swap = _best_swap(sizes, [int(nt[g].sum()) for g in bins[lo]], gap)
        if movable and (swap is None or abs(gap - 2 * max(sizes[j] for j in movable)) <= abs(gap - 2 * swap[2])):
            j = max(movable, key=lambda jj: sizes[jj])
            grp = bins[h].pop(j)
        elif swap is not None:  # trading a group for a smaller one narrows the gap without splitting a cluster
            a_, b_, d = swap
            ga, gb = bins[h].pop(a_), bins[lo].pop(b_)
            bins[lo].append(ga)
            bins[h].append(gb)
            loads[h] -= d
            loads[lo] += d
            continue
        else:
            j = int(np.argmin(sizes))
            g = bins[h][j]
            cum = np.cumsum(nt[g][::-1])  # shortest rows first
            take = max(1, int(np.searchsorted(cum, gap // 2, side="right")))
            if take >= g.size:
                break
            grp = g[g.size - take:]
            bins[h][j] = g[: g.size - take]
        bins[lo].append(grp)
        moved = int(nt[grp].sum())
        loads[h] -= moved
        loads[lo] += moved
    out = []
    for b in bins:
        cat = np.concatenate(b) if b else np.empty(0, dtype=np.int64)
        out.append(cat[np.lexsort((-nt[cat], code[cat]))] if cat.size else cat)
    return out


def _best_swap(heavy: list[int], light: list[int], gap: int):
    """The trade of a heavy-side group for a light-side one whose token difference ``d`` (0 < d < gap) brings
    the two loads closest together (|gap - 2d| least); None when no trade narrows the gap."""
    best = None
    for i, a in enumerate(heavy):
        for j, b in enumerate(light):
            d = a - b
            if 0 < d < gap and (best is None or abs(gap - 2 * d) < abs(gap - 2 * best[2])):
                best = (i, j, d)
    return best


def _light_packs(rows: np.ndarray, code: np.ndarray, nt: np.ndarray, w: int, per_rank: int, cap: int, g: int,
                 tol: float = 0.1):
    """Cut rows into ``w * per_rank`` packs that fill steps of their own with few shared clusters.

    The rows are shared among the ranks by :func:`_rank_groups` (tokens within ``tol`` of the mean, each
    cluster on one rank where possible); each rank's rows are then cut into ``per_rank`` packs of nearly equal
    tokens (they go to that rank, one per light micro-batch, ``g`` per light step), its clusters in the order
    :func:`_order_shared` picks so that a cluster on two ranks sits in different light steps on each. None when
    a pack would be empty or above ``cap``.

    Returns:
        int64 (len(rows),) pack index ``rank * per_rank + i`` aligned with ``rows``, or None.
    """
    m = w * per_rank
    if rows.size < m:
        return None
    parts = _rank_groups(rows, code, nt, w, tol)
    if any(part.size < per_rank for part in parts):
        return None
    groups = [np.split(part, np.flatnonzero(np.diff(code[part])) + 1) for part in parts]
    laid = _order_shared(groups, code, nt, per_rank, g, cap)
    if laid is None:
        return None
    pos = {int(r): i for i, r in enumerate(rows.tolist())}
    out = np.empty(rows.size, dtype=np.int64)
    for r, (seq, pid) in enumerate(laid):
        out[[pos[int(x)] for x in seq.tolist()]] = r * per_rank + pid
    return out


def _cut_rank(seq: np.ndarray, nt: np.ndarray, per_rank: int, cap: int) -> np.ndarray | None:
    """One rank's light packs: ``seq`` (rows in order) cut into ``per_rank`` runs of nearly equal tokens, or, where
    a run would overshoot ``cap``, dealt longest first to the lightest pack (:func:`_lpt`). Returns int64
    (len(seq),) pack index in 0..per_rank-1, or None when no pack fits ``cap``."""
    inner = _cut_points(np.cumsum(nt[seq]), np.empty(0, dtype=np.int64), per_rank, 0.0)
    pid = None if inner is None else np.repeat(np.arange(per_rank), np.diff(inner))
    if pid is None or np.bincount(pid, weights=nt[seq], minlength=per_rank).max() > cap:
        # Runs of long rows overshoot the cap where a run boundary falls badly: LPT packs the same rows more
        # evenly.
        pid = _lpt(nt[seq], per_rank)
        if np.bincount(pid, weights=nt[seq], minlength=per_rank).max() > cap:
            return None
    return pid


_ORDER_PERMS = 4  # ranks with at most this many cluster groups try every order of them; others move one group


def _order_shared(groups: list[list[np.ndarray]], code: np.ndarray, nt: np.ndarray, per_rank: int, g: int,
                  cap: int):
    """Order each rank's cluster groups so that a cluster split over two ranks lands in different light steps.

    A cluster that :func:`_rank_groups` had to split is a collision in every light step where both ranks hold
    some of it. Laid at the end of one rank's rows and at the start of the other's (McNaughton's wrap-around,
    where no job runs on two machines at once), the two parts meet in no light step as long as together they
    fill at most as many light steps as one rank has (a rank dealt by LPT, :func:`_cut_rank`'s fallback, mixes
    its clusters into every pack whatever the order). Coordinate descent: each rank holding a shared cluster in
    turn takes the order of its groups (every order up to ``_ORDER_PERMS`` groups; otherwise each shared group
    moved to the front or the back) whose (light step, cluster) cells meet the other ranks' least; ties keep the
    current order. Two passes.

    Args:
        groups: per rank, its rows as cluster groups (int64 arrays, one cluster each).
        code, nt: per-row cluster code and tokens.

    Returns:
        Per rank ``(seq, pid)``: its rows in the chosen order and their pack (0..per_rank-1), from
        :func:`_cut_rank`; None when some rank's rows fit no cut.
    """
    w = len(groups)
    orders = [list(range(len(gs))) for gs in groups]

    def lay(r, order):
        seq = np.concatenate([groups[r][i] for i in order])
        pid = _cut_rank(seq, nt, per_rank, cap)
        return None if pid is None else (seq, pid)

    def cells(laid_r):
        seq, pid = laid_r
        return set(zip((pid // g).tolist(), code[seq].tolist()))

    laid = [lay(r, orders[r]) for r in range(w)]
    if any(x is None for x in laid):
        return None
    on_ranks = Counter(int(code[gr[0]]) for gs in groups for gr in gs)
    shared = {c for c, n in on_ranks.items() if n > 1}
    if not shared:
        return laid
    cell_sets = [cells(x) for x in laid]
    for _ in range(2):
        changed = False
        for r in range(w):
            n = len(groups[r])
            mine = [i for i in range(n) if int(code[groups[r][i][0]]) in shared]
            if n < 2 or not mine:
                continue
            others = Counter(c for q in range(w) if q != r for c in cell_sets[q])
            best = (sum(1 for c in cell_sets[r] if others[c]), orders[r], laid[r], cell_sets[r])
            if n <= _ORDER_PERMS:
                tries = [list(t) for t in permutations(range(n))]
            else:
                cur = orders[r]
                tries = [[i] + [j for j in cur if j != i] for i in mine]
                tries += [[j for j in cur if j != i] + [i] for i in mine]
            for order in tries:
                x = lay(r, order)
                if x is None:
                    continue
                cs = cells(x)
                cost = sum(1 for c in cs if others[c])
                if cost < best[0]:
                    best = (cost, order, x, cs)
            if best[1] is not orders[r]:
                orders[r], laid[r], cell_sets[r] = best[1], best[2], best[3]
                changed = True
        if not changed:
            break
    return laid


def _lpt(lengths: np.ndarray, bins: int) -> np.ndarray:
    """Longest processing time first: each item, longest first, to the least loaded of ``bins`` bins (ties: the
    lower bin). Returns int64 (n,) the bin of each item, in the input order; every bin gets an item when
    n >= bins."""
    import heapq

    heap = [(0, b) for b in range(bins)]
    out = np.empty(lengths.size, dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable").tolist():
        load, b = heapq.heappop(heap)
        out[i] = b
        heapq.heappush(heap, (load + int(lengths[i]), b))
    return out


def _light_collisions(code: np.ndarray, pack: np.ndarray, per_rank: int, g: int) -> int:
    """Collisions (a cluster on two ranks of one step, counted per cluster and extra rank) of light re-cut packs
    laid out as :func:`cluster_epoch` lays them: pack ``r * per_rank + i`` is rank r's, in light step i // g."""
    rank, step = pack // per_rank, (pack % per_rank) // g
    trip = np.unique(np.stack([step, code, rank]), axis=1)
    return int(trip.shape[1] - np.unique(trip[:2], axis=1).shape[1])
