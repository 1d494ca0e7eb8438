"""Row and centroid arithmetic shared by the k-means variants and the cluster map: validated float32 matrices,
unit rows, distances to centroids, all in chunks of rows so the temporaries stay bounded at 10^6 x 256."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

_CHUNK_ROWS = 65_536  # rows per block when scoring against centroids: bounds the (rows x k) temporary



def _as_matrix(x, name: str = "x") -> np.ndarray:
    """float32 C-contiguous (N, d) copy-if-needed of ``x``, validated."""
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (N, d), got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    finite = np.empty(arr.shape[0], dtype=bool)
    for lo in range(0, arr.shape[0], _CHUNK_ROWS):  # chunked: a whole-matrix mask is 256 MiB at 10^6 x 256
        finite[lo : lo + _CHUNK_ROWS] = np.isfinite(arr[lo : lo + _CHUNK_ROWS]).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"{name} has NaN or inf in {bad.size} rows (first: row {int(bad[0])})")
    return arr


def _check_k(k, n: int) -> int:
    """``k`` as an int in 1..n, else ValueError."""
    if isinstance(k, bool) or int(k) != k:
        raise ValueError(f"k must be an integer, got {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"k={k} clusters is more than the {n} rows to cluster")
    return k


def _row_norms(x: np.ndarray) -> np.ndarray:
    """L2 norm of each row, (N,), in chunks of ``_CHUNK_ROWS`` rows (the unchunked ``np.linalg.norm`` builds a
    1 GiB square temporary at 10^6 x 256 and cost about 2 s per call on a shared core)."""
    out = np.empty(x.shape[0], dtype=np.float64 if x.dtype == np.float64 else np.float32)
    for lo in range(0, x.shape[0], _CHUNK_ROWS):
        out[lo : lo + _CHUNK_ROWS] = np.linalg.norm(x[lo : lo + _CHUNK_ROWS], axis=1)
    return out


def _normalise_rows(x: np.ndarray, name: str = "x") -> np.ndarray:
    """Rows divided by their L2 norm (float32). A zero row has no direction, so it is an error.

    Rows already of unit norm come back as the same array (no copy: at 10^6 x 256 a copy is 1 GiB)."""
    norms = _row_norms(x)
    if x.dtype == np.float32 and np.all(np.abs(norms - 1.0) <= 1e-6):
        return x
    zero = norms <= np.finfo(np.float32).tiny
    if zero.any():
        bad = np.flatnonzero(zero)
        raise ValueError(
            f"{name} has {bad.size} all-zero rows (first: row {int(bad[0])}); a zero sketch has no direction "
            f"to cluster by (was the example's loss masked out entirely?)"
        )
    return (x / norms[:, None]).astype(np.float32, copy=False)
def _sq_distance(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """``|x_i - centroid[labels[i]]|^2``, float32 (N,), as the published ``_pairwise_sqdist_to_centers`` (float32
    difference, then its squared norm); in chunks, so the (rows x d) difference stays bounded."""
    out = np.empty(x.shape[0], dtype=np.float32)
    for lo in range(0, x.shape[0], _CHUNK_ROWS):
        diff = x[lo : lo + _CHUNK_ROWS] - centroids[labels[lo : lo + _CHUNK_ROWS]]
        out[lo : lo + _CHUNK_ROWS] = np.einsum("nd,nd->n", diff, diff)
    return out


def _centre_distances(x: np.ndarray, centroids: np.ndarray, metric: str) -> np.ndarray:
    """Distances of rows to every centroid, float32 (M, K).

    ``sqeuclidean``: ``|x|^2 + |c|^2 - 2 x.c``, the published ``_sqdist_matrix_chunk`` (same float32 rounding);
    ``cosine``: ``1 - x.c`` for unit rows and unit centroids."""
    dots = x @ centroids.T
    if metric == "cosine":
        return 1.0 - dots
    x2 = np.sum(x * x, axis=1, keepdims=True)
    c2 = np.sum(centroids * centroids, axis=1, keepdims=True).T
    return x2 + c2 - 2.0 * dots


def _cluster_sums(xn: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of the rows, float64 (k, d), and sizes, int64 (k,), in chunks of ``_CHUNK_ROWS`` rows.

    Summed in float64 so that sums of the same rows in other groupings (one array here, shard by shard in the
    streamed clustering, :mod:`ray_cluster_ft.cluster.passes`) round to the same float32 centroids."""
    sums = np.zeros((k, xn.shape[1]), dtype=np.float64)
    lab = np.asarray(labels)
    for lo in range(0, xn.shape[0], _CHUNK_ROWS):
        part = lab[lo:lo + _CHUNK_ROWS]
        m = part.size
        onehot = sp.csr_matrix((np.ones(m, dtype=np.float64), (part, np.arange(m))), shape=(k, m))
        sums += onehot @ xn[lo:lo + _CHUNK_ROWS].astype(np.float64)
    return sums, np.bincount(lab, minlength=k).astype(np.int64)


def _centroids_from_sums(sums: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit mean directions float32 (k, d) from float64 cluster sums; an empty cluster gets a zero row.

    Returns ``(centroids, degenerate)``: ``degenerate`` bool (k,) marks non-empty clusters whose sum is zero (a
    cluster of antipodal points), whose row the caller fills with its first member's direction."""
    norms = np.linalg.norm(sums, axis=1)
    degenerate = (sizes > 0) & (norms <= 1e-12)
    safe = np.where(norms > 1e-12, norms, 1.0)
    return (sums / safe[:, None]).astype(np.float32), degenerate


def _centroids_of(xn: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm mean direction of each cluster and the cluster sizes (:func:`_cluster_sums`,
    :func:`_centroids_from_sums`).

    Returns (centroids float32 (k, d), sizes int64 (k,)); an empty cluster gets a zero row.
    """
    sums, sizes = _cluster_sums(xn, labels, k)
    centroids, degenerate = _centroids_from_sums(sums, sizes)
    # A cluster of antipodal points has a zero mean: fall back to its first member's direction.
    if degenerate.any():
        first = np.full(k, -1, dtype=np.int64)
        order = np.argsort(labels, kind="stable")
        starts = np.searchsorted(labels[order], np.arange(k))
        first[degenerate] = order[starts[degenerate]]
        centroids[degenerate] = xn[first[degenerate]]
    return centroids, sizes


def _own_distance(xn: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """``1 - cos(x_i, centroid[labels[i]])`` for unit rows, float32 (N,), clipped to [0, 2]."""
    out = np.empty(xn.shape[0], dtype=np.float32)
    for lo in range(0, xn.shape[0], _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, xn.shape[0])
        cos = np.einsum("ij,ij->i", xn[lo:hi], centroids[labels[lo:hi]])
        out[lo:hi] = 1.0 - cos
    return np.clip(out, 0.0, 2.0)


def nearest_distances(x: np.ndarray, centroids: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest centroid and its distance, in chunks of rows.

    Args:
        x: float32 ``(N, d)``: unit rows for ``cosine``.
        centroids: float32 ``(k, d)``: unit rows for ``cosine``.
        metric: ``cosine`` (``1 - x.c``, clipped to [0, 2]) or ``sqeuclidean`` (``|x|^2 + |c|^2 - 2 x.c``, the
            published ``_sqdist_matrix_chunk``, clipped at 0).

    Returns:
        ``(labels int64 (N,), distance float32 (N,))``; ties go to the lower centroid index.
    """
    labels = np.empty(x.shape[0], dtype=np.int64)
    dist = np.empty(x.shape[0], dtype=np.float32)
    for lo in range(0, x.shape[0], _CHUNK_ROWS):
        d = _centre_distances(x[lo:lo + _CHUNK_ROWS], centroids, metric)
        lab = np.argmin(d, axis=1)
        labels[lo:lo + _CHUNK_ROWS] = lab
        dist[lo:lo + _CHUNK_ROWS] = d[np.arange(len(lab)), lab]
    hi = 2.0 if metric == "cosine" else np.inf
    return labels, np.clip(dist, 0.0, hi)


def _nearest_centroid(xn: np.ndarray, centroids: np.ndarray, with_cos: bool = False):
    """Index of the most cosine-similar centroid for each unit row (chunked), int64 (N,).

    With ``with_cos``, returns ``(index, cosine to that centroid float32 (N,))``. Chunks of
    ``_CHUNK_ROWS`` rows bound the (rows x k) score temporary (64 MiB at k = 256)."""
    out = np.empty(xn.shape[0], dtype=np.int64)
    cos = np.empty(xn.shape[0], dtype=np.float32) if with_cos else None
    cent_t = np.ascontiguousarray(centroids.T, dtype=np.float32)
    for lo in range(0, xn.shape[0], _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, xn.shape[0])
        scores = xn[lo:hi] @ cent_t
        out[lo:hi] = np.argmax(scores, axis=1)
        if with_cos:
            cos[lo:hi] = scores[np.arange(hi - lo), out[lo:hi]]
    return (out, cos) if with_cos else out
