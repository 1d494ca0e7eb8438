"""Per-cluster quotas and the within-cluster choice (docs/design.md, "Select").

CluSTER (Kim et al., EMNLP 2026, arXiv 2609.12584; balanced sampling) gives every cluster the same share of
the budget; clusters smaller than their share are taken whole and what they leave is shared out again among
the others (water-filling). Inside a cluster, near-duplicate sketches are dropped, then diverse
examples are picked: k-center greedy (farthest-point traversal; Gonzalez 1985, and Sener & Savarese,
"Active Learning for Convolutional Neural Networks: A Core-Set Approach", ICLR 2018) or strata of the
distance to the centroid (near and far examples alike). Baselines in the same code: ``random`` (same budget)
and ``full`` (everything).

All functions are pure and deterministic for a given seed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from threadpoolctl import threadpool_limits

__all__ = [
    "SelectionStage",
    "run",
    "SelectionResult",
    "water_fill_quotas",
    "select_within",
    "select",
]

_DEDUP_CHUNK = 1024  # rows compared at once in the greedy de-duplication
_KCENTER_BLOCK = 512  # rows per k-center block in big clusters (512 KiB at d = 256: stays in cache)
_BLOCK_LLOYD_ITERS = 10  # spherical Lloyd passes that make the k-center blocks compact
_DEDUP_KEPT_BLOCK = 8192  # kept rows per block: bounds the (chunk x block) similarity temporary to 32 MiB


@dataclass(frozen=True)
class SelectionResult:
    """The selected subset.

    Attributes:
        indices: int64 (n_sel,), row positions into the stage's input, sorted ascending, unique.
        reasons: str array (n_sel,) aligned with ``indices``: why each row was picked (``centroid``,
            ``kcenter``, ``strata``, ``whole-cluster``, ``dedup-fill``, ``random``, ``full``).
        quotas: int64 (k,) per cluster: the water-filled quotas for ``balanced``; for ``random`` and ``full``
            the per-cluster counts that resulted (so reports can show them side by side); None when no
            labels were given.
    """

    indices: np.ndarray
    reasons: np.ndarray
    quotas: Optional[np.ndarray]


def _check_int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def water_fill_quotas(sizes, budget: int) -> np.ndarray:
    """Water-filling quotas: an equal share per cluster, small clusters taken whole, the rest shared again.

    Equivalent closed form: find the largest integer level L with ``sum(min(size, L)) <= budget``; every
    cluster gets ``min(size, L)``; the ``budget - sum`` left over (fewer than the clusters above L) goes one
    each to the largest clusters still above L, ties broken by the lower cluster index.

    Guarantees: ``sum == budget``; ``quota <= size``; the quotas of clusters not taken whole
    (``quota < size``) differ by at most one.

    Args:
        sizes: int (k,), cluster sizes (>= 0).
        budget: examples to select, 0 <= budget <= sum(sizes).

    Returns:
        int64 (k,) quotas.

    Raises:
        ValueError: sizes not 1-D non-negative integers; budget negative, non-integer or above sum(sizes).
    """
    s = np.asarray(sizes)
    if s.ndim != 1:
        raise ValueError(f"sizes must be 1-D, got shape {s.shape}")
    if s.size and not np.issubdtype(s.dtype, np.integer):
        if not np.all(np.mod(s, 1) == 0):
            raise ValueError("sizes must be integers")
    s = s.astype(np.int64)
    if (s < 0).any():
        raise ValueError(f"sizes must be >= 0, got {s.min()}")
    budget = _check_int("budget", budget)
    total = int(s.sum())
    if budget > total:
        raise ValueError(f"budget={budget} is above the {total} examples in all clusters")
    if budget == total:
        return s.copy()

    srt = np.sort(s)
    csum = np.concatenate([[0], np.cumsum(srt)])

    def filled(level: int) -> int:
        below = int(np.searchsorted(srt, level, side="left"))  # clusters taken whole at this level
        return int(csum[below]) + level * (s.size - below)

    lo, hi = 0, int(srt[-1])  # filled(lo) <= budget < filled(hi) since budget < total
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if filled(mid) <= budget:
            lo = mid
        else:
            hi = mid
    quotas = np.minimum(s, lo)
    rest = budget - int(quotas.sum())
    if rest:
        above = np.flatnonzero(s > lo)
        order = above[np.lexsort((above, -s[above]))]  # largest first, then lowest index
        quotas[order[:rest]] += 1
    return quotas


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


def select_within(
    x_c,
    dist_c,
    quota: int,
    method: Literal["kcenter", "strata"] = "kcenter",
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

    ``quota == n`` returns every member with reason ``whole-cluster`` (water-filling took the cluster whole).

    Args:
        x_c: (n, d) sketches of the cluster's members (normalised internally).
        dist_c: (n,) distance of each member to the cluster centroid.
        quota: members to pick, 0 <= quota <= n.
        method: ``kcenter`` or ``strata``.
        dedup_threshold: cosine above which two members are duplicates, in (0, 1]; 1 disables it.
        seed: seed of the strata draws and of the k-center blocks.

    Returns:
        (local indices int64 (quota,) in pick order, reasons list[str] aligned).

    Raises:
        ValueError: bad shapes, NaN/inf or zero rows, quota out of range, unknown method, bad threshold.
    """
    if method not in ("kcenter", "strata"):
        raise ValueError(f"method must be 'kcenter' or 'strata', got {method!r}")
    if not (0.0 < float(dedup_threshold) <= 1.0):
        raise ValueError(f"dedup_threshold must be in (0, 1], got {dedup_threshold!r}")
    xn = _unit_rows(x_c)
    n = xn.shape[0]
    dist = np.asarray(dist_c, dtype=np.float64)
    if dist.shape != (n,):
        raise ValueError(f"dist_c must have shape ({n},), got {dist.shape}")
    quota = _check_int("quota", quota)
    if quota > n:
        raise ValueError(f"quota={quota} is above the {n} members of the cluster")
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


def select(
    strategy: Literal["balanced", "random", "full"],
    x=None,
    labels=None,
    dist=None,
    budget: int = 0,
    within: Literal["kcenter", "strata"] = "kcenter",
    dedup_threshold: float = 0.995,
    seed: int = 0,
    n: Optional[int] = None,
) -> SelectionResult:
    """The Select stage.

    - ``balanced`` (the method): water-filled quotas per cluster (:func:`water_fill_quotas`), then
      :func:`select_within` in each cluster (cluster c draws with a seed derived from ``(seed, c)``).
    - ``random``: a seeded uniform sample of ``budget`` rows without replacement (the baseline).
    - ``full``: every row (``budget`` ignored).

    Args:
        strategy: ``balanced``, ``random`` or ``full``.
        x: (N, d) sketches; required for ``balanced``.
        labels: int (N,) clusters 0..k-1; required for ``balanced``, optional otherwise (used for ``quotas``).
        dist: (N,) distance to the own centroid; required for ``balanced``.
        budget: rows to select, 0 <= budget <= N (``random``, ``balanced``).
        within: ``kcenter`` or ``strata`` (``balanced``).
        dedup_threshold: cosine above which two sketches are duplicates (``balanced``).
        seed: seed of every random choice.
        n: number of rows when neither x nor labels is given (``random`` / ``full`` without sketches).

    Returns:
        :class:`SelectionResult` (indices sorted ascending, reasons aligned, per-cluster quotas).

    Raises:
        ValueError: unknown strategy; missing or misshapen inputs; labels not 0..k-1; budget out of range.
    """
    if strategy not in ("balanced", "random", "full"):
        raise ValueError(f"strategy must be 'balanced', 'random' or 'full', got {strategy!r}")
    lab = None
    if labels is not None:
        lab = np.asarray(labels)
        if lab.ndim != 1 or not np.issubdtype(lab.dtype, np.integer):
            raise ValueError(f"labels must be a 1-D integer array, got shape {lab.shape} dtype {lab.dtype}")
        if lab.size and lab.min() < 0:
            raise ValueError(f"labels must be >= 0, got {lab.min()}")
    counts = (None if x is None else np.shape(x)[0], None if lab is None else lab.size, n)
    sizes_n = [v for v in counts if v is not None]
    if not sizes_n:
        raise ValueError("select needs x, labels or n to know how many rows there are")
    if len(set(sizes_n)) != 1:
        raise ValueError(f"x, labels and n disagree on the number of rows: {sizes_n}")
    total = sizes_n[0]
    k = int(lab.max()) + 1 if lab is not None and lab.size else 0

    if strategy == "full":
        idx = np.arange(total, dtype=np.int64)
        quotas = np.bincount(lab, minlength=k).astype(np.int64) if lab is not None else None
        return SelectionResult(idx, np.full(total, "full"), quotas)

    budget = _check_int("budget", budget)
    if budget > total:
        raise ValueError(f"budget={budget} is above the {total} rows available")

    if strategy == "random":
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(total, size=budget, replace=False)).astype(np.int64)
        quotas = np.bincount(lab[idx], minlength=k).astype(np.int64) if lab is not None else None
        return SelectionResult(idx, np.full(budget, "random"), quotas)

    if x is None or lab is None or dist is None:
        raise ValueError("the balanced strategy needs x, labels and dist")
    d = np.asarray(dist)
    if d.shape != (total,):
        raise ValueError(f"dist must have shape ({total},), got {d.shape}")
    x = np.asarray(x)
    sizes = np.bincount(lab, minlength=k)
    quotas = water_fill_quotas(sizes, budget)
    order = np.argsort(lab, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    chosen, why = [], []
    # The k-center traversal is a chain of memory-bound matrix-vector products: extra BLAS threads add only
    # synchronisation, which collapses throughput (10x measured) when the cores are shared. Strata's
    # de-duplication is matrix-matrix work and keeps every thread.
    limit = threadpool_limits(limits=1, user_api="blas") if within == "kcenter" else contextlib.nullcontext()
    with limit:
        for c in np.flatnonzero(quotas):
            members = order[starts[c] : starts[c + 1]]
            c_seed = int(np.random.SeedSequence([int(seed), int(c)]).generate_state(1)[0])
            loc, reasons = select_within(x[members], d[members], int(quotas[c]), within, dedup_threshold, c_seed)
            chosen.append(members[loc])
            why.extend(reasons)
    if not chosen:
        return SelectionResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=str), quotas)
    idx = np.concatenate(chosen).astype(np.int64)
    reasons_arr = np.asarray(why, dtype=str)
    srt = np.argsort(idx, kind="stable")
    return SelectionResult(idx[srt], reasons_arr[srt], quotas)


@dataclass(frozen=True)
class SelectionStage:
    """The select stage's result: the budget asked for and the :class:`SelectionResult` (indices into the
    candidates, reasons)."""

    requested: int
    result: SelectionResult


def run(cfg, run_dir: Path, *, n_candidates: int, sketches=None, labels=None, dist=None) -> SelectionStage:
    """The select stage: ``selection.strategy`` at ``selection.budget`` over the candidates.

    Writes nothing: which selected rows are trained is fixed by the plan (the budget is rounded down to whole
    optimizer steps there), so ``selection.parquet`` is written by the allocation stage.

    Args:
        cfg: the job config (``selection`` section).
        run_dir: the run directory (unused: no artifact of its own).
        n_candidates: N.
        sketches, labels, dist: the features ``(N, d)``, clusters ``(N,)`` and distances ``(N,)``; ``None``
            when no clustering ran (``random`` and ``full`` need none).
    """
    from .config import budget_count

    s = cfg.selection
    if sketches is None:
        sketches = np.zeros((n_candidates, 1), dtype=np.float32)
        labels = np.zeros(n_candidates, dtype=np.int64)
        dist = np.zeros(n_candidates, dtype=np.float32)
    requested = n_candidates if s.strategy == "full" else budget_count(s.budget, n_candidates)
    res = select(s.strategy, sketches, labels, dist, requested, within=s.within, dedup_threshold=s.dedup_threshold,
                 seed=s.seed)
    return SelectionStage(requested, res)
