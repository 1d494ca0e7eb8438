"""Groups of similar clusters, the upper level of hierarchical balanced sampling (``selection.groups``): the
groups from the rows (:func:`cluster_groups`) or from their sufficient statistics (:func:`groups_from_sums`, what a
streamed job gathers shard by shard). Pure numpy/scipy; :mod:`.quotas` shares the budget over them."""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["cluster_groups", "groups_from_sums", "silhouette_rows", "unit_rows64"]

_MAX_AUTO_GROUPS = 8
_SUM_CHUNK = 65536  # rows normalised at once: float64 (N, d) copies of 10^6 rows held 4 GiB
_SILHOUETTE_ROWS = 2048  # rows sampled for the silhouette of ``groups: auto``: O(rows^2) distances


def cluster_groups(x, labels, groups, seed: int = 0) -> np.ndarray:
    """Groups of similar clusters, the upper level of hierarchical balanced sampling.

    Flat equal shares per cluster are not equal shares per kind of row: a kind of row that k-means splits over
    many clusters (long medical answers of many lengths, say) gets a share per cluster, a kind held by one
    cluster gets one. Grouping the clusters first and sharing the budget equally between the groups, then
    between the clusters of each group (:func:`group_quotas`), is the hierarchical balanced sampling of Vo et
    al., "Automatic Data Curation for Self-Supervised Learning: A Clustering-Based Approach" (TMLR 2024,
    arXiv 2405.15613, Sec. 4: k-means applied again to the centroids, then balanced sampling level by level),
    with the upper level cut from an average-linkage tree of the cluster centroids under cosine distance
    (a deterministic cut instead of a second k-means, so a given ``groups`` always nests).

    Args:
        x: float (N, d) features (rows need not be normalised).
        labels: int (N,) clusters 0..k-1, every cluster non-empty.
        groups: ``"auto"``: the cut with 2..min(8, k - 1) groups whose rows have the highest mean silhouette
            (cosine; on a seeded sample of at most 2,048 rows); an int g: g groups (capped at k); 1 = one
            group (flat).
        seed: seed of the silhouette sample.

    Returns:
        int64 (k,) group of each cluster, 0..g-1 in the order of each group's lowest cluster index.

    Raises:
        ValueError: shapes disagree, a cluster is empty, ``groups`` is neither "auto" nor a positive int.
    """
    lab = np.asarray(labels)
    xa = np.asarray(x)  # no float64 copy of all rows: they are normalised a chunk at a time below
    if xa.ndim != 2 or lab.shape != (xa.shape[0],):
        raise ValueError(f"x must be (N, d) and labels (N,), got {xa.shape} and {lab.shape}")
    k = int(lab.max()) + 1 if lab.size else 0
    sizes = np.bincount(lab, minlength=k)
    if (sizes == 0).any():
        raise ValueError("every cluster needs at least one row")
    _check_groups(groups)
    if k <= 2 or groups == 1:
        return np.zeros(k, dtype=np.int64)
    sums = np.zeros((k, xa.shape[1]))
    for lo in range(0, lab.size, _SUM_CHUNK):  # in row order, as one np.add.at over all rows sums them
        np.add.at(sums, lab[lo:lo + _SUM_CHUNK], unit_rows64(xa[lo:lo + _SUM_CHUNK]))
    rows = silhouette_rows(lab.size, seed)
    return groups_from_sums(sums, unit_rows64(xa[rows]), lab[rows], groups)


def _check_groups(groups) -> None:
    if groups != "auto" and not (isinstance(groups, (int, np.integer)) and groups >= 1):
        raise ValueError(f"groups must be 'auto' or a positive integer, got {groups!r}")


def unit_rows64(x) -> np.ndarray:
    """float64 ``(N, d)`` rows of ``x`` scaled to unit norm (a zero row stays zero), as :func:`cluster_groups`
    normalises them; the streamed selection normalises its shards' rows with it too."""
    xa = np.asarray(x, dtype=np.float64)
    return xa / np.maximum(np.linalg.norm(xa, axis=1, keepdims=True), 1e-12)


def silhouette_rows(n: int, seed: int) -> np.ndarray:
    """int64 ascending positions of the rows whose silhouette scores ``groups: auto`` (every row up to 2,048,
    else a seeded sample of 2,048): a function of ``n`` and ``seed`` only, so a streamed job reads the same rows."""
    if n <= _SILHOUETTE_ROWS:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, _SILHOUETTE_ROWS, replace=False)).astype(np.int64)


def groups_from_sums(sums, sample, sample_labels, groups) -> np.ndarray:
    """:func:`cluster_groups` from its sufficient statistics: the clusters' sums of unit rows and the unit rows
    of the silhouette sample (:func:`silhouette_rows`), so the rows need not meet in one array.

    Args:
        sums: float64 (k, d) per-cluster sums of unit rows (:func:`unit_rows64`), every cluster non-empty.
        sample: float64 (m, d) unit rows at :func:`silhouette_rows`; sample_labels: int (m,) their clusters.
        groups: ``"auto"``, or a positive int (then ``sample`` is unused).

    Returns:
        int64 (k,) group of each cluster, as :func:`cluster_groups`.

    Raises:
        ValueError: ``groups`` is neither "auto" nor a positive int.
    """
    from scipy.cluster.hierarchy import fcluster, linkage

    _check_groups(groups)
    sums = np.asarray(sums, dtype=np.float64)
    k = sums.shape[0]
    if k <= 2 or groups == 1:
        return np.zeros(k, dtype=np.int64)
    cent = sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    tree = linkage(cent, method="average", metric="cosine")

    def cut(g: int) -> np.ndarray:
        raw = fcluster(tree, t=g, criterion="maxclust")
        _, first = np.unique(raw, return_index=True)  # renumber by each group's lowest cluster index
        rank = np.empty(raw.max() + 1, dtype=np.int64)
        rank[raw[np.sort(first)]] = np.arange(first.size)
        return rank[raw]

    if groups != "auto":
        if int(groups) > k:  # a user asked for more groups than there are clusters: say so, then cap
            warnings.warn(f"selection.groups={int(groups)} is more than the {k} clusters: {k} groups (one per "
                          f"cluster, as flat)", stacklevel=2)
        return cut(min(int(groups), k))
    from sklearn.metrics import silhouette_score

    lab = np.asarray(sample_labels)
    best, best_score = np.zeros(k, dtype=np.int64), -np.inf
    for g in range(2, min(_MAX_AUTO_GROUPS, k - 1) + 1):
        grp = cut(g)
        row_groups = grp[lab]
        if np.unique(row_groups).size < 2:
            continue
        score = float(silhouette_score(sample, row_groups, metric="cosine"))
        if score > best_score + 1e-12:  # ties keep the fewer groups
            best, best_score = grp, score
    return best
