"""Inside one cluster: which members to keep (docs/design.md, "Select").

``kcenter`` (farthest-point traversal under cosine distance), ``strata`` (by distance to the centroid, with
near-duplicates dropped), and the published method's orders by distance alone: ``peripheral`` (farthest first,
its default ``close`` prune type), ``central`` (nearest first) and ``random`` (kaist-dmlab/CluSTER,
``src/CluSTER/call_back.py``, ``_kmeans_prune_equalize_interleave``). Used by :mod:`.quotas`. Pure.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ._checks import _check_int

__all__ = [
    "DISTANCE_ORDERS",
    "select_within",
]


_DEDUP_CHUNK = 1024  # rows compared at once in the greedy de-duplication


_KCENTER_BLOCK = 512  # rows per k-center block in big clusters (512 KiB at d = 256: stays in cache)


_BLOCK_LLOYD_ITERS = 10  # spherical Lloyd passes that make the k-center blocks compact


_DEDUP_KEPT_BLOCK = 8192  # kept rows per block: bounds the (chunk x block) similarity temporary to 32 MiB


DISTANCE_ORDERS = ("peripheral", "central", "random")
"""The within-cluster choices by distance order alone (no sketches needed)."""


_WITHIN = ("kcenter", "strata") + DISTANCE_ORDERS


def _unit_rows(x) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"x_c must be a 2-D array (n, d), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("x_c has NaN or inf")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    if (norms <= np.finfo(np.float32).tiny).any():
        raise ValueError("x_c has all-zero rows: a zero sketch has no direction")
    return np.ascontiguousarray(arr / norms, dtype=np.float32)


def _near_duplicate_keep(xn: np.ndarray, order: np.ndarray, threshold: float) -> np.ndarray:
    """Greedy de-duplication in ``order``: keep a row unless its cosine to an already kept row is above
    ``threshold``. Returns a bool (n,) mask of kept rows.

    Rows are compared chunk by chunk against all kept rows (BLAS matrix products, memory bounded); inside a
    chunk only the rows that have an earlier near-duplicate need the sequential pass, and they are rare.
    Cost O(n * kept * d) flops; about a second for a 20k-row cluster at d = 256.
    """
    n, d = xn.shape
    keep = np.zeros(n, dtype=bool)
    if threshold >= 1.0:
        keep[:] = True
        return keep
    kept = np.empty((n, d), dtype=np.float32)
    n_kept = 0
    for lo in range(0, n, _DEDUP_CHUNK):
        idx = order[lo : lo + _DEDUP_CHUNK]
        xc = xn[idx]
        alive = np.ones(idx.size, dtype=bool)
        for klo in range(0, n_kept, _DEDUP_KEPT_BLOCK):
            sims = xc @ kept[klo : min(klo + _DEDUP_KEPT_BLOCK, n_kept)].T
            alive &= ~(sims > threshold).any(axis=1)
        dup_earlier = np.tril(xc @ xc.T > threshold, k=-1)
        dup_earlier &= alive[None, :]
        final = alive.copy()
        for i in np.flatnonzero(alive & dup_earlier.any(axis=1)):
            final[i] = not (dup_earlier[i, :i] & final[:i]).any()
        keep[idx] = final
        new = xc[final]
        kept[n_kept : n_kept + new.shape[0]] = new
        n_kept += new.shape[0]
    return keep


def _farthest_points(xn: np.ndarray, start: int, quota: int) -> tuple[np.ndarray, np.ndarray]:
    """Farthest-point traversal (greedy k-center, Gonzalez 1985) of unit rows from ``start``.

    Keeps each row's squared Euclidean distance to its nearest pick (``|x - y|^2 = 2 - 2 cos`` on the unit
    sphere, monotone in the cosine distance): one matrix-vector product per pick, O(n * quota * d).

    Returns:
        (picks int64 (quota,), squared distance of each pick to its nearest earlier pick when it was made,
        float64 (quota,), inf for the first).
    """
    picked = np.empty(quota, dtype=np.int64)
    gap_sq = np.empty(quota, dtype=np.float64)
    picked[0], gap_sq[0] = start, np.inf
    near_sq = (2.0 - 2.0 * (xn @ xn[start])).astype(np.float32)
    near_sq[start] = -np.inf  # picked rows never win the argmax again
    for t in range(1, quota):
        j = int(np.argmax(near_sq))
        picked[t], gap_sq[t] = j, near_sq[j]
        near_sq[j] = -np.inf
        np.minimum(near_sq, 2.0 - 2.0 * (xn @ xn[j]), out=near_sq)
    return picked, gap_sq


def _kcenter(xn: np.ndarray, dist: np.ndarray, quota: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """k-center greedy over a cluster, in blocks of about ``_KCENTER_BLOCK`` rows for big clusters.

    The traversal costs O(n * quota * d) and the quota grows with n (a budget share): a 10^4-row cluster at
    a 31% budget takes 3,100 passes over 10 MB, 17 s measured on one core, about half an hour for 10^6
    examples in 100 clusters. Above ``_KCENTER_BLOCK`` rows the cluster is therefore split into
    ceil(n / block) blocks by spherical k-means (k-means++ start and at most 10 Lloyd passes on a 4-block
    sample, then every row to its nearest block centre); each block gets a quota proportional to its size
    (largest remainders) and its own traversal, from its member nearest the cluster centroid. Blocks stay in
    cache and the cost becomes O(n * quota * d * block / n), linear in n at a fixed budget fraction (0.45 s
    for the same cluster with 512-row blocks, 0.9 s with 1,024). Far points of different blocks are far apart already, so the cover stays close to a
    single traversal's; exact duplicates share a block, so de-duplication still holds.

    Returns:
        (picks int64 (quota,), gap_sq float64 (quota,) as :func:`_farthest_points`, inf at each block start);
        the first pick is the cluster's member nearest the centroid.
    """
    n = xn.shape[0]
    if n <= _KCENTER_BLOCK:
        return _farthest_points(xn, int(np.argmin(dist)), quota)
    from sklearn.cluster import kmeans_plusplus

    m = -(-n // _KCENTER_BLOCK)
    # Blocks only need to be compact, not converged: a seeded k-means++ start on a sample and a few spherical
    # Lloyd passes in numpy (sklearn's KMeans costs ~0.2 s of fixed overhead per call, 100 calls at 10^6 rows).
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, 4 * _KCENTER_BLOCK), replace=False))
    init, _ = kmeans_plusplus(xn[sample].astype(np.float64), m, random_state=seed % 2**32)
    centres = _spherical_lloyd(xn[sample], init.astype(np.float32), _BLOCK_LLOYD_ITERS)
    blocks = np.argmax(xn @ centres.T, axis=1)
    sizes = np.bincount(blocks, minlength=m)
    share = quota * sizes / n
    q = np.floor(share).astype(np.int64)
    frac_order = np.lexsort((np.arange(m), -(share - q)))
    q[frac_order[: quota - int(q.sum())]] += 1  # q < size holds: quota < n; empty blocks get 0
    first = int(blocks[int(np.argmin(dist))])
    picks, gaps = [], []
    for b in [first] + [b for b in range(m) if b != first]:
        if q[b] == 0:
            continue
        members = np.flatnonzero(blocks == b)
        loc, gap = _farthest_points(xn[members], int(np.argmin(dist[members])), int(q[b]))
        picks.append(members[loc])
        gaps.append(gap)
    return np.concatenate(picks), np.concatenate(gaps)


def _spherical_lloyd(xn: np.ndarray, centres: np.ndarray, iters: int) -> np.ndarray:
    """Unit centres float32 (m, d) after at most ``iters`` spherical Lloyd passes over the unit rows ``xn``
    (assign by max cosine, centre = renormalised mean). A centre that loses all its rows keeps its direction."""
    c = centres / np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    labels = np.argmax(xn @ c.T, axis=1)
    for _ in range(iters):
        onehot = (labels[:, None] == np.arange(c.shape[0])).astype(np.float32)  # (n, m); m is small
        sums = onehot.T @ xn
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        c = np.where(norms > 1e-12, sums / np.maximum(norms, 1e-12), c).astype(np.float32)
        new = np.argmax(xn @ c.T, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
    return c


def _evenly(m: int, q: int) -> np.ndarray:
    """q positions spread evenly over 0..m-1 (the middle of q equal strata), int64, strictly increasing."""
    return ((np.arange(q, dtype=np.float64) + 0.5) * m / q).astype(np.int64)


def _ordered_pick(dist: np.ndarray, quota: int, method: str, seed: int) -> np.ndarray:
    """The first ``quota`` members of a cluster in a distance order, int64 (quota,), in pick order.

    The published code sorts a cluster's members by ascending distance to the centroid (a stable sort of the
    members in index order, so ties by index) and keeps a slice of that list; ``peripheral`` keeps its last
    ``quota`` (``lst[-m:]``: the farthest, and on a tie at the cut the higher index), ``central`` its first
    ``quota`` (``lst[:m]``); both are returned farthest / nearest first. ``random``: a seeded permutation.
    """
    if method == "random":
        return np.random.default_rng(seed).permutation(dist.size)[:quota].astype(np.int64)
    near_first = np.lexsort((np.arange(dist.size), dist))
    return (near_first[:quota] if method == "central" else near_first[::-1][:quota]).astype(np.int64)


def _check_quota(quota, n: int) -> int:
    quota = _check_int("quota", quota)
    if quota > n:
        raise ValueError(f"quota={quota} is above the {n} members of the cluster")
    return quota


def _select_ordered(x_c, dist_c, quota: int, method: str, seed: int) -> tuple[np.ndarray, list[str]]:
    """:func:`select_within` for ``peripheral``, ``central`` and ``random``: ``x_c`` is only checked for
    its row count (may be None); no de-duplication (the published selection has none)."""
    dist = np.asarray(dist_c, dtype=np.float64)
    n_rows = dist.shape[0] if x_c is None else np.shape(x_c)[0]
    if dist.ndim != 1 or dist.shape[0] != n_rows:
        raise ValueError(f"dist_c must have shape ({n_rows},), got {dist.shape}")
    if not np.isfinite(dist).all():
        raise ValueError("dist_c has NaN or inf")
    quota = _check_quota(quota, n_rows)
    if quota == n_rows and quota:
        return np.arange(n_rows, dtype=np.int64), ["whole-cluster"] * n_rows
    return _ordered_pick(dist, quota, method, seed), [method] * quota


def select_within(
    x_c,
    dist_c,
    quota: int,
    method: Literal["kcenter", "strata", "peripheral", "central", "random"] = "kcenter",
    dedup_threshold: float = 0.995,
    seed: int = 0,
) -> tuple[np.ndarray, list[str]]:
    """Pick ``quota`` diverse, non-duplicate members of one cluster.

    ``kcenter``: farthest-point traversal under cosine distance, starting at the member nearest the centroid
    (smallest ``dist_c``, lowest index on ties): each pick is the member farthest from everything picked so
    far (running min-distance vector, O(n * quota * d)). Clusters above 512 members are first split into
    blocks of about that size, with the quota shared in proportion (see :func:`_kcenter`), which keeps the
    cost linear in n. De-duplication is implied: a member whose cosine to a picked one is above
    ``dedup_threshold`` is nearer to the picks than any non-duplicate, so it is only reached once every
    remaining member (of its block) is such a duplicate; those picks are labelled ``dedup-fill``.

    ``strata``: greedy de-duplication in order of distance to the centroid (the nearer copy survives), then
    the de-duplicated members sorted by distance are cut into ``quota`` equal strata and one seeded random
    member is drawn from each, so near and far members are represented alike. If de-duplication leaves fewer
    than ``quota``, all survivors are taken and the rest is filled with duplicates spread evenly over the
    distance order (reason ``dedup-fill``: they are still valid examples).

    ``peripheral`` / ``central`` / ``random``: the published within-cluster choices (arXiv 2609.12584;
    kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``, ``_kmeans_prune_equalize_interleave``, argument
    ``prune_type``), by distance to the centroid alone, without de-duplication. Its names say what is *pruned*;
    its list is sorted by ascending distance, so ``lst[:m]`` keeps the nearest:

    - ``peripheral`` = its ``close`` (prune the close ones, keep ``lst[-m:]``, the farthest; the default of
      its ``train_grad.py`` and the README's main configuration);
    - ``central`` = its ``far`` (prune the far ones, keep ``lst[:m]``, the nearest);
    - ``random`` = its ``rand`` (a seeded shuffle; ours draws with numpy, not Python's ``random``);
    - its ``mix`` (half nearest, half farthest), ``big`` (largest norm) and ``none`` have no counterpart;
      ``kcenter`` is close to the ``badge`` variant of ``_kmeans_badge_equalize_interleave`` (which starts
      at the largest-norm member instead of the one nearest the centroid).

    Ties are broken by index (see :func:`_ordered_pick`), so the picks are deterministic.

    ``quota == n`` returns every member with reason ``whole-cluster`` (water-filling took the cluster whole).

    Args:
        x_c: (n, d) sketches of the cluster's members (normalised internally); may be None for the three
            distance orders.
        dist_c: (n,) distance of each member to the cluster centroid.
        quota: members to pick, 0 <= quota <= n.
        method: ``kcenter``, ``strata``, ``peripheral``, ``central`` or ``random``.
        dedup_threshold: cosine above which two members are duplicates, in (0, 1]; 1 disables it (``kcenter``
            and ``strata`` only).
        seed: seed of the strata draws, of the k-center blocks and of ``random``.

    Returns:
        (local indices int64 (quota,) in pick order, reasons list[str] aligned).

    Raises:
        ValueError: bad shapes, NaN/inf or zero rows, quota out of range, unknown method, bad threshold.
    """
    if method not in _WITHIN:
        raise ValueError(f"method must be one of {', '.join(map(repr, _WITHIN))}, got {method!r}")
    if not (0.0 < float(dedup_threshold) <= 1.0):
        raise ValueError(f"dedup_threshold must be in (0, 1], got {dedup_threshold!r}")
    if method in DISTANCE_ORDERS:
        return _select_ordered(x_c, dist_c, quota, method, seed)
    xn = _unit_rows(x_c)
    n = xn.shape[0]
    dist = np.asarray(dist_c, dtype=np.float64)
    if dist.shape != (n,):
        raise ValueError(f"dist_c must have shape ({n},), got {dist.shape}")
    quota = _check_quota(quota, n)
    if quota == 0:
        return np.empty(0, dtype=np.int64), []
    if quota == n:
        return np.arange(n, dtype=np.int64), ["whole-cluster"] * n

    if method == "kcenter":
        picked, gap_sq = _kcenter(xn, dist, quota, seed)
        # A pick within cosine > threshold of an earlier one means only duplicates were left.
        dup_sq = 2.0 * (1.0 - float(dedup_threshold))
        dup = (gap_sq < dup_sq) if dedup_threshold < 1.0 else np.zeros(quota, dtype=bool)
        reasons = ["centroid"] + ["dedup-fill" if d else "kcenter" for d in dup[1:].tolist()]
        return picked, reasons

    order = np.argsort(dist, kind="stable")
    keep = _near_duplicate_keep(xn, order, float(dedup_threshold))
    uniq = order[keep[order]]
    m = uniq.size
    if m >= quota:
        rng = np.random.default_rng(seed)
        edges = (np.arange(quota + 1, dtype=np.int64) * m) // quota
        pos = edges[:-1] + (rng.random(quota) * (edges[1:] - edges[:-1])).astype(np.int64)
        return uniq[pos].astype(np.int64), ["strata"] * quota
    dups = order[~keep[order]]
    fill = dups[_evenly(dups.size, quota - m)]
    return np.concatenate([uniq, fill]).astype(np.int64), ["strata"] * m + ["dedup-fill"] * (quota - m)
