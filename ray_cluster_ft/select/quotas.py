"""Per-cluster quotas and the within-cluster choice (docs/design.md, "Select").

CluSTER (Kim et al., EMNLP 2026, arXiv 2609.12584; balanced sampling) gives every cluster the same share of
the budget; clusters smaller than their share are taken whole and what they leave is shared out again among
the others (water-filling). Inside a cluster, near-duplicate sketches are dropped, then diverse
examples are picked: k-center greedy (farthest-point traversal; Gonzalez 1985, and Sener & Savarese,
"Active Learning for Convolutional Neural Networks: A Core-Set Approach", ICLR 2018) or strata of the
distance to the centroid (near and far examples alike). Baselines in the same code: ``random`` (same budget)
and ``full`` (everything).

``equalize`` is the published CluSTER selection as its official code does it (kaist-dmlab/CluSTER
``src/CluSTER/call_back.py``, ``_kmeans_prune_equalize_interleave``): every cluster is cut to the same count,
floor(ratio x the smallest cluster) (:func:`equalize_count`; one cluster, as at world size 1, is kept whole), by the
distance orders ``peripheral`` / ``central`` / ``random`` (the published ``prune_type``s; see
:func:`select_within`) or by k-center / strata. :func:`selection_weights` gives each selected row the weight
that restores its cluster's share of the candidates (the published per-rank weights).

All functions are pure and deterministic for a given seed; the stage's edge is :mod:`.stage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, Optional

import numpy as np
from threadpoolctl import threadpool_limits

from ..config import ConfigError
from ._checks import _check_int
from .groups import cluster_groups, groups_from_sums, silhouette_rows, unit_rows64  # noqa: F401 (re-exported)
from .within import DISTANCE_ORDERS, select_within

__all__ = [
    "SelectionResult",
    "cluster_groups",
    "equalize_count",
    "group_quotas",
    "groups_from_sums",
    "select",
    "select_cluster",
    "selection_weights",
    "silhouette_rows",
    "token_budget_count",
    "unit_rows64",
    "water_fill_quotas",
]


@dataclass(frozen=True)
class SelectionResult:
    """The selected subset.

    Attributes:
        indices: int64 (n_sel,), row positions into the stage's input, sorted ascending, unique.
        reasons: str array (n_sel,) aligned with ``indices``: why each row was picked (``centroid``,
            ``kcenter``, ``strata``, ``peripheral``, ``central``, ``whole-cluster``, ``dedup-fill``,
            ``random``, ``full``).
        quotas: int64 (k,) per cluster: the water-filled quotas for ``balanced``; the common count m for
            ``equalize``; for ``random`` and ``full``
            the per-cluster counts that resulted (so reports can show them side by side); None when no
            labels were given. With a token budget, the rows picked per cluster.
        token_quotas: int64 (k,) per cluster, with a token budget and ``balanced``: the water-filled token
            quotas (:func:`water_fill_quotas` over the clusters' token totals); otherwise None.
        groups: int64 (k,) the group of every cluster when ``balanced`` shared the budget between groups first
            (:func:`cluster_groups`), else None.
    """

    indices: np.ndarray
    reasons: np.ndarray
    quotas: Optional[np.ndarray]
    token_quotas: Optional[np.ndarray] = None
    groups: Optional[np.ndarray] = None


def water_fill_quotas(sizes, budget: int, power: float = 0.0) -> np.ndarray:
    """Water-filling quotas: an equal share per cluster, small clusters taken whole, the rest shared again.

    With ``power`` p > 0 the shares are ``size ** p`` instead of equal (:func:`_power_fill`): p = 1 is a
    proportional (stratified) sample, p = 0.5 square-root sampling, between balance and the pool's own mix (the
    temperature sampling of multilingual training, p = 1/T: Arivazhagan et al. 2019, "Massively Multilingual
    Neural Machine Translation in the Wild", Sec. 4.2). p = 0 is the closed form below, exactly.

    Equivalent closed form: find the largest integer level L with ``sum(min(size, L)) <= budget``; every
    cluster gets ``min(size, L)``; the ``budget - sum`` left over (fewer than the clusters above L) goes one
    each to the largest clusters still above L, ties broken by the lower cluster index.

    Guarantees: ``sum == budget``; ``quota <= size``; the quotas of clusters not taken whole
    (``quota < size``) differ by at most one.

    Args:
        sizes: int (k,), cluster sizes (>= 0).
        budget: examples to select, 0 <= budget <= sum(sizes).
        power: 0 <= p <= 1, each cluster's share in proportion to ``size ** p``.

    Returns:
        int64 (k,) quotas.

    Raises:
        ValueError: sizes not 1-D non-negative integers; budget negative, non-integer or above sum(sizes);
            power not a number in [0, 1]; power > 0 with sum(sizes) above 2**53.
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
    if isinstance(power, bool) or not isinstance(power, (int, float, np.integer, np.floating)) \
            or not 0.0 <= power <= 1.0:
        raise ValueError(f"power must be a number in [0, 1], got {power!r}")
    if power > 0.0 and total > 2**53:  # the real shares are float64: beyond 2**53 rows they lose whole rows
        raise ValueError(f"power > 0 needs sum(sizes) <= 2**53, got {total}")
    if budget == total:
        return s.copy()
    if power > 0.0:
        return _power_fill(s, budget, power)

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


def _power_fill(s: np.ndarray, budget: int, power: float) -> np.ndarray:
    """Weighted water-filling: the real level L with ``sum(min(s, L s**p)) == budget`` (bisection), each cluster
    ``min(s, floor(L s**p))``, then the rows left over one each to the clusters still below their size, largest
    remainder first (ties: larger cluster, then lower index): Hamilton's rounding of the real shares. Same
    guarantees as :func:`water_fill_quotas`: sum == budget, quota <= size."""
    w = np.where(s > 0, s.astype(np.float64) ** power, 0.0)
    lo, hi = 0.0, float((s / np.where(w > 0, w, 1.0)).max())  # at hi every cluster is whole
    for _ in range(100):
        mid = (lo + hi) / 2
        if float(np.minimum(s, mid * w).sum()) <= budget:
            lo = mid
        else:
            hi = mid
    quotas = np.minimum(s, np.floor(lo * w).astype(np.int64))
    rest = budget - int(quotas.sum())
    while rest > 0:  # one pass in exact arithmetic; a float level a hair low can leave a row for a second
        open_ = np.flatnonzero(quotas < s)
        frac = lo * w[open_] - quotas[open_]
        order = open_[np.lexsort((open_, -s[open_], -frac))][:rest]
        quotas[order] += 1
        rest -= order.size
    return quotas


def group_quotas(sizes, groups, budget: int, power: float = 0.0) -> np.ndarray:
    """Two-level water-filling: :func:`water_fill_quotas` between the groups' totals, then inside each group
    between its clusters with the group's quota.

    Args:
        sizes: int (k,) per-cluster totals (rows, or tokens for a token budget).
        groups: int (k,) group of every cluster (:func:`cluster_groups`).
        budget: 0 <= budget <= sum(sizes).
        power: shares in proportion to ``size ** power`` at both levels (:func:`water_fill_quotas`).

    Returns:
        int64 (k,) quotas: sum == budget, quota <= size; with power 0, groups not taken whole get equal shares
        (within one) and so do the clusters not taken whole inside one group.

    Raises:
        ValueError: as :func:`water_fill_quotas`; shapes disagree.
    """
    s = np.asarray(sizes, dtype=np.int64)
    grp = np.asarray(groups, dtype=np.int64)
    if grp.shape != s.shape:
        raise ValueError(f"groups must have shape {s.shape}, got {grp.shape}")
    g = int(grp.max()) + 1 if grp.size else 0
    per_group = water_fill_quotas(np.bincount(grp, weights=s, minlength=g).astype(np.int64), budget, power)
    out = np.zeros_like(s)
    for j in range(g):
        members = np.flatnonzero(grp == j)
        out[members] = water_fill_quotas(s[members], int(per_group[j]), power)
    return out


def equalize_count(sizes, ratio: float) -> int:
    """The per-cluster count m of ``equalize``: floor(ratio x smallest cluster).

    As the published ``_kmeans_prune_equalize_interleave`` with its defaults (``m * ratio // 100``; the
    ``(m // micro) * micro`` rounding there applies only with ``dataloader_drop_last``, off in its
    ``train_grad.py``), with the ratio a fraction instead of a percentage: the product is taken on the decimal
    as written (0.29 x 100 = 29, where binary floating point gives 28.999... and floor 28). Nothing is rounded
    to the micro-batch: a rank's last micro-batch may be short (``allocation.strategy: cluster_per_rank``).

    Args:
        sizes: int (k,) cluster sizes, k >= 1.
        ratio: share of the smallest cluster, in (0, 1].

    Returns:
        m >= 1.

    Raises:
        ValueError: no clusters, ratio out of range.
        ConfigError: m rounds down to 0 (the message names the sizes and the ratio).
    """
    sz = np.asarray(sizes, dtype=np.int64)
    if sz.ndim != 1 or sz.size == 0:
        raise ValueError(f"sizes must be a non-empty 1-D array, got shape {sz.shape}")
    if not (0.0 < float(ratio) <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    smallest = int(sz.min())
    m = math.floor(Fraction(repr(float(ratio))) * smallest)
    if m == 0:
        shown = ", ".join(map(str, sz[:20].tolist())) + (", ..." if sz.size > 20 else "")
        raise ConfigError(
            f"selection.strategy 'equalize' keeps floor(selection.ratio={ratio} x {smallest}, the smallest cluster) "
            f"= 0 rows of every cluster (cluster sizes [{shown}]): raise selection.ratio or use fewer clusters")
    return int(m)


def selection_weights(labels, selected, strategy: str) -> np.ndarray:
    """Per selected row, the weight that restores its cluster's share of the candidates.

    ``w_c = (n_c / N) / (s_c / S)``: n_c candidates of cluster c among N, s_c selected rows of c among S.
    Summed over the selected rows this is S, so the weights have mean 1 (up to float rounding). N counts the
    candidates of the clusters that have a selected row (all of them unless a ``balanced`` budget is below k):
    a cluster with nothing selected cannot carry weight. This is the published per-rank gradient weight
    (kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``, ``PruneAndClusteringinwithMeanCallback.on_train_begin``:
    ``rank_weights = n_gpus * size / total_size``, one cluster per rank and equal counts, so s_c / S = 1/K).
    ``full`` and ``random`` keep the candidates' distribution already: all ones.

    Args:
        labels: int (N,) cluster of every candidate, >= 0.
        selected: int (S,) candidate positions of the selected rows (any order; the output follows it).
        strategy: ``balanced``, ``equalize``, ``random`` or ``full``.

    Returns:
        float64 (S,) weights aligned with ``selected``.

    Raises:
        ValueError: unknown strategy; labels not 1-D non-negative integers; selected out of range.
    """
    sel = np.asarray(selected)
    if sel.ndim != 1 or (sel.size and not np.issubdtype(sel.dtype, np.integer)):
        raise ValueError(f"selected must be a 1-D integer array, got shape {sel.shape} dtype {sel.dtype}")
    if strategy in ("full", "random"):
        return np.ones(sel.size, dtype=np.float64)
    if strategy not in ("balanced", "equalize"):
        raise ValueError(f"strategy must be 'balanced', 'equalize', 'random' or 'full', got {strategy!r}")
    lab = np.asarray(labels)
    if lab.ndim != 1 or (lab.size and not np.issubdtype(lab.dtype, np.integer)) or (lab.size and lab.min() < 0):
        raise ValueError(f"labels must be a 1-D array of non-negative integers, got shape {lab.shape}")
    if sel.size and (sel.min() < 0 or sel.max() >= lab.size):
        raise ValueError(f"selected must index the {lab.size} candidates, got range {sel.min()}..{sel.max()}")
    if sel.size == 0:
        return np.empty(0, dtype=np.float64)
    k = int(lab.max()) + 1
    n_c = np.bincount(lab, minlength=k)
    s_c = np.bincount(lab[sel], minlength=k)
    seen = s_c > 0
    # n_c * S / (N * s_c) in integers, then one division: 6 * 5 / (10 * 2) is exactly 1.5, (0.6 / 0.4) is not.
    w = np.zeros(k, dtype=np.float64)
    w[seen] = (n_c[seen] * sel.size) / (int(n_c[seen].sum()) * s_c[seen])
    return w[lab[sel]]


def select(
    strategy: Literal["balanced", "equalize", "random", "full"],
    x=None,
    labels=None,
    dist=None,
    budget: int = 0,
    within: Literal["kcenter", "strata", "peripheral", "central", "random"] = "kcenter",
    dedup_threshold: float = 0.995,
    seed: int = 0,
    n: Optional[int] = None,
    ratio: float = 1.0,
    n_tokens=None,
    budget_tokens: Optional[int] = None,
    groups=None,
    size_power: float = 0.0,
) -> SelectionResult:
    """The Select stage.

    - ``balanced`` (the method): water-filled quotas per cluster (:func:`water_fill_quotas`), then
      :func:`select_within` in each cluster (cluster c draws with a seed derived from ``(seed, c)``).
    - ``equalize`` (the published CluSTER selection, kaist-dmlab/CluSTER ``src/CluSTER/call_back.py``,
      ``_kmeans_prune_equalize_interleave``): every cluster gives the same m = :func:`equalize_count`
      ``(sizes, ratio)`` rows, K x m in all (``budget`` unused), chosen by :func:`select_within` as for
      ``balanced``; a single cluster (the published world size 1: no clustering, no pruning) is kept whole.
    - ``random``: a seeded uniform sample of ``budget`` rows without replacement (the baseline).
    - ``full``: every row (``budget`` ignored).

    Args:
        strategy: ``balanced``, ``equalize``, ``random`` or ``full``.
        x: (N, d) sketches; required for ``balanced`` and ``equalize`` with ``kcenter`` / ``strata``.
        labels: int (N,) clusters 0..k-1; required for ``balanced`` and ``equalize`` (else only for ``quotas``).
        dist: (N,) distance to the own centroid; required for ``balanced`` and ``equalize``.
        budget: rows to select, 0 <= budget <= N (``random``, ``balanced``).
        within: ``kcenter``, ``strata``, ``peripheral``, ``central`` or ``random`` (``balanced``, ``equalize``).
        dedup_threshold: cosine above which two sketches are duplicates (``kcenter``, ``strata``).
        seed: seed of every random choice.
        n: number of rows when neither x nor labels is given (``random`` / ``full`` without sketches).
        ratio: ``equalize``: share of the smallest cluster, in (0, 1].
        n_tokens: int (N,) tokens per row; needed with ``budget_tokens``.
        budget_tokens: a budget in tokens instead of rows (``balanced``, ``random``; ``budget`` is then unused),
            0 <= budget_tokens <= sum(n_tokens). ``balanced``: :func:`water_fill_quotas` over the clusters'
            token totals gives each cluster a token quota; inside a cluster the members are taken in the
            ``within`` pick order while their tokens fit the quota (see :func:`_select_tokens_within`).
            ``random``: a seeded permutation of the rows, its longest prefix within the budget.
        groups: ``balanced`` only: ``None`` = flat (every cluster one share); ``"auto"`` or a count: the budget
            (rows or tokens) is shared between groups of similar clusters first (:func:`cluster_groups`,
            :func:`group_quotas`); needs ``x``. Or an int64 ``(k,)`` array: each cluster's group, computed
            already (:func:`groups_from_sums`).
        size_power: ``balanced`` only: shares in proportion to ``size ** size_power`` (0 = equal; see
            :func:`water_fill_quotas`).

    Returns:
        :class:`SelectionResult` (indices sorted ascending, reasons aligned, per-cluster quotas).

    Raises:
        ValueError: unknown strategy; missing or misshapen inputs; labels not 0..k-1; budget out of range.
        ConfigError: ``equalize`` whose m rounds down to 0 (:func:`equalize_count`).
    """
    if strategy not in ("balanced", "equalize", "random", "full"):
        raise ValueError(f"strategy must be 'balanced', 'equalize', 'random' or 'full', got {strategy!r}")
    lab = _checked_labels(labels)
    total = _row_count(x, lab, n)
    k = int(lab.max()) + 1 if lab is not None and lab.size else 0

    nt = None
    if budget_tokens is not None:
        nt, budget_tokens = _checked_token_budget(strategy, n_tokens, budget_tokens, total)
        if strategy == "random":
            perm = np.random.default_rng(seed).permutation(total)
            idx = np.sort(perm[_fit_in_order(nt[perm], budget_tokens)]).astype(np.int64)
            return SelectionResult(idx, np.full(idx.size, "random"), _counts(lab, idx, k))
    elif strategy == "full":
        idx = np.arange(total, dtype=np.int64)
        return SelectionResult(idx, np.full(total, "full"), _counts(lab, idx, k))
    elif strategy != "equalize":
        budget = _check_int("budget", budget)
        if budget > total:
            raise ValueError(f"budget={budget} is above the {total} rows available")

    if strategy == "random":
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(total, size=budget, replace=False)).astype(np.int64)
        return SelectionResult(idx, np.full(budget, "random"), _counts(lab, idx, k))

    if lab is None or dist is None or (x is None and within not in DISTANCE_ORDERS):
        raise ValueError(f"the {strategy} strategy needs x, labels and dist")
    d = np.asarray(dist)
    if d.shape != (total,):
        raise ValueError(f"dist must have shape ({total},), got {d.shape}")
    sizes = np.bincount(lab, minlength=k)
    xa = None if x is None else np.asarray(x)
    if strategy == "equalize":
        quotas = np.full(k, int(sizes[0]) if k == 1 else equalize_count(sizes, ratio), dtype=np.int64)
        return _per_cluster(xa, lab, d, quotas, within, dedup_threshold, seed)
    quotas, grp = _balanced_quotas(xa, lab, sizes, nt, budget if nt is None else budget_tokens, groups, seed,
                                   size_power)
    res = _per_cluster(xa, lab, d, quotas, within, dedup_threshold, seed, nt=nt)
    return res if grp is None else dataclasses.replace(res, groups=grp)


def _balanced_quotas(xa, lab: np.ndarray, sizes: np.ndarray, nt, want: int, groups, seed: int, power: float = 0.0):
    """``balanced``'s per-cluster quotas (rows, or tokens with ``nt``) and the cluster groups (None when flat):
    water-filling over the clusters, or over the groups first with ``groups``."""
    if groups is None:
        grp = None
    elif isinstance(groups, np.ndarray):  # computed already (the streamed selection, from the shards)
        grp = groups.astype(np.int64)
        if grp.shape != sizes.shape:
            raise ValueError(f"groups must give one group per cluster, shape {sizes.shape}, got {grp.shape}")
    elif xa is None:
        raise ValueError("groups needs x: the groups are cut from the clusters' mean features")
    else:
        grp = cluster_groups(xa, lab, groups, seed)
    totals = sizes if nt is None else np.bincount(lab, weights=nt, minlength=sizes.size).astype(np.int64)
    return (water_fill_quotas(totals, want, power) if grp is None else group_quotas(totals, grp, want, power)), grp


def _checked_labels(labels) -> np.ndarray | None:
    """``labels`` as a 1-D non-negative integer array (None stays None), else ValueError."""
    if labels is None:
        return None
    lab = np.asarray(labels)
    if lab.ndim != 1 or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {lab.shape} dtype {lab.dtype}")
    if lab.size and lab.min() < 0:
        raise ValueError(f"labels must be >= 0, got {lab.min()}")
    return lab


def _row_count(x, lab, n) -> int:
    """The number of rows, from whichever of ``x``, ``labels`` and ``n`` is given (they must agree)."""
    counts = (None if x is None else np.shape(x)[0], None if lab is None else lab.size, n)
    sizes_n = [v for v in counts if v is not None]
    if not sizes_n:
        raise ValueError("select needs x, labels or n to know how many rows there are")
    if len(set(sizes_n)) != 1:
        raise ValueError(f"x, labels and n disagree on the number of rows: {sizes_n}")
    return sizes_n[0]


def _checked_token_budget(strategy: str, n_tokens, budget_tokens, total: int) -> tuple[np.ndarray, int]:
    """``(n_tokens int64 (total,), budget_tokens)`` checked for a token budget, else ValueError."""
    if strategy not in ("balanced", "random"):
        raise ValueError(f"budget_tokens applies to the 'balanced' and 'random' strategies, not {strategy!r}")
    if n_tokens is None:
        raise ValueError("budget_tokens needs n_tokens (tokens per row)")
    nt = np.asarray(n_tokens)
    if nt.shape != (total,) or (nt.size and not np.issubdtype(nt.dtype, np.integer)):
        raise ValueError(f"n_tokens must be an integer array of shape ({total},), got {nt.shape} {nt.dtype}")
    nt = nt.astype(np.int64)
    if nt.size and nt.min() < 1:
        raise ValueError(f"n_tokens must be >= 1, got {int(nt.min())}")
    budget_tokens = _check_int("budget_tokens", budget_tokens)
    if budget_tokens > int(nt.sum()):
        raise ValueError(f"budget_tokens={budget_tokens} is above the {int(nt.sum())} tokens available")
    return nt, budget_tokens


def _counts(lab, idx: np.ndarray, k: int) -> np.ndarray | None:
    """Selected rows per cluster, int64 (k,); None without labels (the baselines' ``quotas``)."""
    return np.bincount(lab[idx], minlength=k).astype(np.int64) if lab is not None else None


def token_budget_count(budget_tokens: float, total_tokens: int) -> int:
    """The tokens a ``selection.budget_tokens`` asks for: ``round(fraction * total)`` for a fraction in (0, 1],
    else the count (at least 1)."""
    if budget_tokens <= 1:
        return max(1, round(float(budget_tokens) * int(total_tokens)))
    return int(budget_tokens)


def _fit_in_order(tokens: np.ndarray, quota: int) -> np.ndarray:
    """The positions taken when ``tokens`` (int64 (n,), in pick order) are taken in order while they fit
    ``quota``: the longest prefix that fits, then every later one that still fits what is left (a long row does
    not end the pick; the rows after it may be shorter). Returns int64 positions, ascending."""
    cs = np.cumsum(tokens)
    k = int(np.searchsorted(cs, quota, side="right"))
    taken = list(range(k))
    left = quota - (int(cs[k - 1]) if k else 0)
    if k < tokens.size:
        rest = tokens[k + 1:]
        smallest = int(rest.min()) if rest.size else left + 1
        for i in range(k + 1, tokens.size):  # one Python step per row after the prefix, until nothing fits
            if left < smallest:
                break
            t = int(tokens[i])
            if t <= left:
                taken.append(i)
                left -= t
    return np.asarray(taken, dtype=np.int64)


def _select_tokens_within(x_c, d_c, nt_c: np.ndarray, quota_tokens: int, within, dedup_threshold, seed):
    """:func:`select_within` under a token quota: the members in the method's pick order, each taken while it
    fits what is left of ``quota_tokens`` (:func:`_fit_in_order`).

    The methods pick a given count, so the count is found by a few calls: start at ``quota / mean tokens``,
    and while the picks' tokens fall short of the quota (and members remain) ask for as many more as the
    shortfall / mean tokens (at least one), up to 8 calls and at most n - 1 members; then keep those that
    fit, in pick order.

    Returns (local indices int64 in pick order, reasons list[str]).
    """
    n = nt_c.size
    total = int(nt_c.sum())
    if quota_tokens >= total:
        return np.arange(n, dtype=np.int64), ["whole-cluster"] * n
    mean = total / n
    # At most n - 1 picks: asked for all n, the methods return the members in index order, not pick order; and
    # n - 1 picks always suffice (all n exceed the quota).
    m = min(n - 1, max(1, int(quota_tokens // mean)))
    for _ in range(8):
        loc, reasons = select_within(x_c, d_c, m, within, dedup_threshold, seed)
        got = int(nt_c[loc].sum())
        if got >= quota_tokens or m == n - 1:
            break
        m = min(n - 1, m + max(1, int((quota_tokens - got) // mean)))
    keep = _fit_in_order(nt_c[loc], quota_tokens)
    return loc[keep], [reasons[i] for i in keep.tolist()]


def select_cluster(x_c, d_c, quota: int, within: str, dedup_threshold: float, seed: int, c: int,
                   nt_c=None) -> tuple[np.ndarray, list[str]]:
    """Cluster ``c``'s picks as :func:`select` makes them: :func:`select_within` with a seed derived from
    ``(seed, c)``, or under a token quota (``nt_c``: its members' tokens, ``quota`` then in tokens). ``x_c``,
    ``d_c``: its members' features and distances in ascending candidate order. Returns (local indices int64,
    reasons); the streamed selection calls it one cluster at a time."""
    c_seed = int(np.random.SeedSequence([int(seed), int(c)]).generate_state(1)[0])
    if nt_c is None:
        return select_within(x_c, d_c, int(quota), within, dedup_threshold, c_seed)
    return _select_tokens_within(x_c, d_c, nt_c, int(quota), within, dedup_threshold, c_seed)


def _per_cluster(x, lab, d, quotas, within, dedup_threshold, seed, nt=None) -> SelectionResult:
    """:func:`select_within` with each cluster's quota; indices sorted ascending."""
    sizes = np.bincount(lab, minlength=quotas.size)
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
            loc, reasons = select_cluster(None if x is None else x[members], d[members], int(quotas[c]), within,
                                          dedup_threshold, seed, int(c), None if nt is None else nt[members])
            chosen.append(members[loc])
            why.extend(reasons)
    if not chosen:
        return SelectionResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=str), quotas)
    idx = np.concatenate(chosen).astype(np.int64)
    reasons_arr = np.asarray(why, dtype=str)
    srt = np.argsort(idx, kind="stable")
    if nt is not None:
        picked = np.bincount(lab[idx], minlength=quotas.size).astype(np.int64)
        return SelectionResult(idx[srt], reasons_arr[srt], picked, quotas)
    return SelectionResult(idx[srt], reasons_arr[srt], quotas)
