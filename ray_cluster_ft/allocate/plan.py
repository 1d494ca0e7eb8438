"""The rank x step plan and its balance metrics (docs/design.md, "Allocate").

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
``world_size * micro_batch_size * grad_accum`` examples is kept; the rest are reported as ``dropped``. A packed
plan (``packing=True``) has the same schema: a micro-batch is a pack of whole examples within
``max_tokens_per_micro_batch`` tokens, any number of rows; it drops nothing (``cluster_per_rank`` excepted).
The published ``cluster_per_rank`` plan (unpacked) rounds nothing: each rank's last micro-batch of an epoch may
be short, and so may the epoch's last step (fewer than ``grad_accum`` micro-batches, as many on every rank);
:func:`ray_cluster_ft.allocate.check_plan` accepts that with ``short_tail=True``.

All functions are pure and deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from ._packs import (
    _TAG_CUT,
    _check_fits,
    _csr,
    bfd,
    cluster_epoch,
    packed_frame,
    random_epoch_sched,
    random_packs,
)
from ._sized import sized_epoch, sized_steps
from ._slots import (
    _TAG_DROP,
    _TAG_ORDER,
    _TAG_RANKS,
    _TAG_SLOTS,
    _assign_ranks,
    _distinct_mixed,
    _form_slots,
    _majority,
    _positive,
    _rng,
)

__all__ = ["PLAN_COLUMNS", "PlanResult", "cluster_per_rank_plan", "make_plan"]


PLAN_COLUMNS = ["epoch", "step", "rank", "micro_index", "example_id", "cluster", "n_tokens"]


@dataclass(frozen=True)
class PlanResult:
    """The allocation plan.

    Attributes:
        plan: DataFrame with :data:`PLAN_COLUMNS` (int64 except ``example_id`` str), sorted by
            ``(rank, epoch, step, micro_index, position)``, RangeIndex.
        dropped: example ids (input order) left out so that every rank gets the same number of full
            micro-batches; fewer than ``world_size * micro_batch_size * grad_accum``.
        n_requested: number of examples given (kept + dropped).
        pack_tokens: packed plans only: the tokens a pack may hold, ``max_tokens_per_micro_batch`` as given or,
            for packs sized to the data, the fullest pack's tokens; ``None`` unpacked.
    """

    plan: pd.DataFrame
    dropped: np.ndarray
    n_requested: int
    pack_tokens: int | None = None


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


def _cluster_microbatches(cl, nt, mbs, n_drop, seed, pad_tolerance, jitter=None):
    """Cut micro-batches for the ``cluster`` strategy and choose what to drop.

    Inside each cluster the rows are sorted by length; with ``jitter`` (a generator: the re-cut of epochs
    after the first) a row's place in that order moves by U(0, 2B) places before the cut, and likewise in the
    pooled rows of the mixed micro-batches, so consecutive micro-batches trade rows of similar length and every
    epoch trains other micro-batches.

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
    if jitter is not None:
        order = order[np.lexsort((rank_in + jitter.random(n) * 2 * mbs, sc))]
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
    if jitter is not None:  # the same perturbation of the length order as inside the clusters
        pool = pool[np.argsort(np.arange(pool.size) + jitter.random(pool.size) * 2 * mbs, kind="stable")]
    mixed_rows = pool.reshape(-1, mbs)
    mbs = np.concatenate([full_rows, mixed_rows]).astype(np.int64)
    return mbs, full_rows.shape[0], np.sort(drop).astype(np.int64)


def _cluster_cut(cl, nt, b, w, n_drop, seed, pad_tolerance, jitter=None):
    """The ``cluster`` plan's micro-batches and slots for one epoch (see :func:`make_plan`).

    Returns (slots int64 (n_slots, W) micro-batch ids, micro-batch rows int64 (T, B) shortest first, padded
    cost int64 (T,), dropped row indices sorted). ``jitter`` (a generator) perturbs the length order inside
    each cluster (see :func:`_cluster_microbatches`); ``None`` is the cut of epoch 0.
    """
    mb_rows, n_pure, drop = _cluster_microbatches(cl, nt, b, n_drop, seed, pad_tolerance, jitter)
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
    return slots, mb_rows, costs, drop


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


def cluster_per_rank_plan(ids: np.ndarray, cl: np.ndarray, nt: np.ndarray, w: int, b: int, g: int, epochs: int,
                          seed: int) -> PlanResult:
    """The published method's allocation: rank r trains only cluster r, in a fresh seeded order every epoch.

    In the paper's code (kaist-dmlab/CluSTER, ``call_back.py``: ``_interleave_equal_clusters`` with
    Accelerate's strided sharding, re-shuffled per epoch preserving position mod W) the K = W clusters are
    interleaved so that rank r sees only cluster r. Here the same assignment is a plan: clusters in ascending
    label order map to ranks 0..W-1; every rank keeps the smallest cluster's count n (all of every cluster
    after the published equal cut; otherwise the others' extra rows are a seeded random choice, reported as
    dropped), nothing rounded: each epoch every rank's rows are permuted with a stream of (seed, epoch, rank)
    and cut into consecutive micro-batches of ``b`` rows, the last one holding ``n mod b`` when that is not 0
    (the published ``dataloader_drop_last`` is off), and consecutive groups of ``g`` micro-batches form the
    steps, the last step of an epoch holding the ceil(n / b) mod g left when that is not 0 (as Hugging Face's
    Trainer steps at the end of an epoch). Every rank has the same micro-batches per step, so no collective
    waits; the trainer marks each step's last micro-batch as DeepSpeed's accumulation boundary.

    Args:
        ids: str (N,); cl: int (N,) cluster labels with exactly ``w`` distinct values; nt: int (N,) tokens.
        w, b, g, epochs, seed: world size, micro-batch, grad_accum, epochs, seed (validated by the caller).

    Returns:
        :class:`PlanResult` (the plan sorted by rank, epoch, step, micro_index, position).

    Raises:
        ValueError: not exactly ``w`` clusters.
    """
    labels, code = np.unique(cl, return_inverse=True)
    if labels.size != w:
        raise ValueError(f"cluster_per_rank needs exactly world_size={w} clusters (rank r trains cluster r), got "
                         f"{labels.size}")
    members = [np.flatnonzero(code == r) for r in range(w)]
    per_rank = min(m.size for m in members)
    kept = [m if m.size == per_rank else np.sort(_rng(seed, _TAG_DROP, r).choice(m, size=per_rank, replace=False))
            for r, m in enumerate(members)]
    drop = np.sort(np.setdiff1d(np.arange(ids.size), np.concatenate(kept)))
    n_mb = -(-per_rank // b)
    steps = -(-n_mb // g)
    pos = np.arange(per_rank)
    mb = pos // b  # micro-batch of each position in a rank's epoch order
    step_in_epoch, micro = mb // g, mb % g
    frames = []
    for r in range(w):
        for e in range(epochs):
            rows = _rng(seed, _TAG_ORDER, e, r).permutation(kept[r])
            frames.append(pd.DataFrame({"epoch": np.full(per_rank, e, dtype=np.int64),
                                        "step": (e * steps + step_in_epoch).astype(np.int64),
                                        "rank": np.full(per_rank, r, dtype=np.int64),
                                        "micro_index": micro.astype(np.int64),
                                        "example_id": ids[rows].astype(object),
                                        "cluster": cl[rows].astype(np.int64), "n_tokens": nt[rows].astype(np.int64)}))
    plan = pd.concat(frames, ignore_index=True)[PLAN_COLUMNS]
    return PlanResult(plan=plan, dropped=ids[drop].astype(object), n_requested=int(ids.size))


def _packed_plan(ids, cl, nt, w: int, b: int, g: int, epochs: int, strategy: str, seed: int, tol: float,
                 max_tokens) -> PlanResult:
    """:func:`make_plan` with ``packing=True`` (see there). Every row is kept except under
    ``cluster_per_rank``, whose ranks must hold the same number of packs of their own cluster."""
    if max_tokens is None and strategy == "cluster":
        return _sized_plan(ids, cl, nt, w, b, g, epochs, seed)
    if max_tokens is None:
        raise ValueError(f"strategy {strategy!r} with packing needs max_tokens_per_micro_batch (packs sized to the "
                         f"data are the cluster strategy's)")
    cap = _positive("max_tokens_per_micro_batch", max_tokens)
    if strategy == "length":
        raise ValueError("strategy 'length' with packing: packing already removes the padding that grouping by "
                         "length avoids; use 'random' (the packed baseline) or 'cluster'")
    _check_fits(ids, nt, cap)
    n = ids.size
    if n < w * g:
        raise ValueError(f"{n} examples cannot fill one optimizer step of world_size={w} x grad_accum={g} packs: "
                         f"some ranks would get no micro-batch")
    _, code = np.unique(cl, return_inverse=True)
    code = code.astype(np.int64)
    drop = np.empty(0, dtype=np.int64)
    if strategy == "cluster":
        rows = np.arange(n)
        parts = [cluster_epoch(code, nt, rows, w, g, cap, tol, seed + e) for e in range(epochs)]
    elif strategy == "random":
        prow, pptr = random_packs(code, nt, n, w, g, cap, seed)
        parts = [(prow, pptr, random_epoch_sched(pptr.size - 1, w, g, seed, e)) for e in range(epochs)]
    else:  # cluster_per_rank
        labels = np.unique(cl)
        if labels.size != w:
            raise ValueError(f"cluster_per_rank needs exactly world_size={w} clusters (rank r trains cluster r), "
                             f"got {labels.size}")
        per_rank = []
        for r in range(w):
            members = np.flatnonzero(code == r)
            rng = _rng(seed, _TAG_CUT, r)
            order = members[np.lexsort((rng.random(members.size), -nt[members]))]
            pack_of = bfd(nt[order], cap)
            per_rank.append(_csr(pack_of, order, nt, int(pack_of.max()) + 1))
        n_packs = (min(p.size - 1 for _, p in per_rank) // g) * g
        if n_packs == 0:
            raise ValueError(f"cluster_per_rank: the smallest cluster fills {min(p.size - 1 for _, p in per_rank)} "
                             f"packs, fewer than one optimizer step of grad_accum={g} on its rank")
        flat, ptrs = [], [0]
        for r, (prow, pptr) in enumerate(per_rank):
            keep = np.sort(_rng(seed, _TAG_DROP, r).choice(pptr.size - 1, size=n_packs, replace=False))
            for q in keep.tolist():
                flat.append(prow[pptr[q]:pptr[q + 1]])
                ptrs.append(ptrs[-1] + pptr[q + 1] - pptr[q])
        prow_all = np.concatenate(flat)
        pptr_all = np.asarray(ptrs, dtype=np.int64)
        drop = np.sort(np.setdiff1d(np.arange(n), prow_all))
        parts = []
        for e in range(epochs):
            own = np.stack([r * n_packs + _rng(seed, _TAG_ORDER, e, r).permutation(n_packs) for r in range(w)])
            parts.append((prow_all, pptr_all, own.reshape(w, -1, g).transpose(1, 2, 0)))
    plan = packed_frame(parts, ids, cl, nt)
    return PlanResult(plan=plan, dropped=ids[drop].astype(object), n_requested=int(n), pack_tokens=cap)


def _sized_plan(ids, cl, nt, w: int, b: int, g: int, epochs: int, seed: int) -> PlanResult:
    """The packed ``cluster`` plan with packs sized to the data (:mod:`ray_cluster_ft.allocate._sized`): the
    unpacked plan's step count, every pack near ``T / (S W G)`` tokens, nothing dropped."""
    steps = sized_steps(nt, w, b, g)
    _, code = np.unique(cl, return_inverse=True)
    code = code.astype(np.int64)
    parts = [sized_epoch(code, nt, w, g, steps, seed + e) for e in range(epochs)]
    cap = max(int(np.add.reduceat(nt[rows], ptr[:-1]).max()) for rows, ptr, _ in parts)
    return PlanResult(plan=packed_frame(parts, ids, cl, nt), dropped=ids[:0].astype(object),
                      n_requested=int(ids.size), pack_tokens=cap)


def make_plan(
    example_ids,
    clusters,
    n_tokens,
    world_size: int,
    micro_batch_size: int,
    grad_accum: int = 1,
    epochs: int = 1,
    strategy: Literal["cluster", "random", "length", "cluster_per_rank"] = "cluster",
    seed: int = 0,
    pad_tolerance: float = 0.05,
    packing: bool = False,
    max_tokens_per_micro_batch: int | None = None,
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
    1% of :func:`plan_metrics`' ``critical_path_bound_tokens``. Epoch 0 is cut with ``seed``; every later
    epoch e re-cuts the same kept rows with seed + e and a jitter of the length order (U(0, 2B) places), so the
    micro-batches themselves change between epochs, as under a shuffled sampler. Every epoch,
    the slot order is shuffled (seed, epoch) so clusters and lengths are spread over the epoch, consecutive
    ``grad_accum`` slots form a step, and each slot's micro-batches go to ranks by LPT on the step's load.

    ``packing=True`` (``allocation.packing``): a micro-batch is a pack of whole examples holding at most
    ``max_tokens_per_micro_batch`` tokens (``micro_batch_size`` is then unused; ``grad_accum`` packs per rank
    per step; every rank the same number of packs; no row dropped, except by ``cluster_per_rank``). ``cluster``:
    per epoch (seed + epoch) best-fit-decreasing packs inside each cluster, the packs emptier than
    ``pad_tolerance`` re-packed together as mixed packs, the count made a multiple of W x G by re-cutting a few
    mixed or least full packs into lighter ones that fill steps of their own, G packs of a cluster per rank-step,
    W rank-steps of distinct clusters and similar tokens per step, then swaps that remove clusters present on two
    ranks of a step counting every row (see :mod:`ray_cluster_ft.allocate._packs`). ``random`` (the packed
    baseline, TRL ``SFTTrainer(packing=True)`` best-fit decreasing): the rows in a seeded order, sorted by length
    (stable), packed once; each epoch the packs in a seeded order, rank r takes every W-th. ``cluster_per_rank``:
    rank r packs cluster r once; every rank keeps the same number of its packs (a seeded choice; the rows of
    the others are dropped), reshuffled per epoch. ``length`` is refused (packing already removes padding).

    ``random`` (the baseline, a shuffled ``DistributedSampler``): a seeded permutation per epoch, rank r takes
    every W-th example from position r, and cuts consecutive micro-batches.

    ``length`` (grouping by length, as ``group_by_length`` in other trainers; no clusters): every epoch, the
    kept examples in a seeded random order are stably sorted by length (so equal lengths mix differently per
    epoch) and cut into consecutive micro-batches; ``world_size`` consecutive micro-batches (similar lengths)
    form a slot, the slot order is shuffled (seed, epoch), and ranks get micro-batches by LPT as in
    ``cluster``. The examples dropped are a seeded random choice, as in ``random``.

    ``cluster_per_rank`` (the published method's allocation, :func:`cluster_per_rank_plan`): rank r trains
    only the r-th cluster (clusters in ascending label order; there must be exactly ``world_size``), all of it
    when the clusters are equal, with a short last micro-batch and step where the count asks for them.

    Args:
        example_ids: str (N,) unique ids.
        clusters: int (N,) cluster of each example (any integers; ``-1`` is an ordinary cluster here).
        n_tokens: int (N,) tokens of each example (>= 1).
        world_size: data-parallel ranks W.
        micro_batch_size: rows per micro-batch B.
        grad_accum: micro-batches per rank per optimizer step G.
        epochs: passes over the kept examples.
        strategy: ``cluster``, ``random``, ``length`` or ``cluster_per_rank``.
        seed: seed of every random choice (non-negative); epoch e uses streams derived from (seed, e).
        pad_tolerance: ``cluster`` only, in [0, 1]: largest padding fraction a single-cluster micro-batch
            may keep; 1 keeps every one (pure clusters, more padding), 0 pools all that are not uniform. With
            packing: the largest empty share a single-cluster pack may keep.
        packing: micro-batches are packs (see above).
        max_tokens_per_micro_batch: tokens per pack at most (packing only; required with it).

    Returns:
        :class:`PlanResult`.

    Raises:
        ValueError: length mismatch, duplicate ids, non-integer or non-positive token counts, W/B/G/epochs
            < 1, unknown strategy, negative seed, or ``N < W * B * G`` (some rank would get no micro-batch);
            with packing: an example longer than ``max_tokens_per_micro_batch`` (named), ``length``, ``N < W * G``;
            ``max_tokens_per_micro_batch`` without packing.
    """
    w, b, g, n_epochs = _check_plan_args(world_size, micro_batch_size, grad_accum, epochs, strategy, seed,
                                         pad_tolerance)
    ids, cl, nt = _validate(example_ids, clusters, n_tokens)
    if packing:
        return _packed_plan(ids, cl, nt, w, b, g, n_epochs, strategy, seed, float(pad_tolerance),
                            max_tokens_per_micro_batch)
    if max_tokens_per_micro_batch is not None:
        raise ValueError("max_tokens_per_micro_batch sizes packs: it needs packing=True")
    return _padded_plan(ids, cl, nt, w, b, g, n_epochs, strategy, seed, float(pad_tolerance))


def _check_plan_args(world_size, micro_batch_size, grad_accum, epochs, strategy, seed, pad_tolerance) -> tuple:
    """``(W, B, G, epochs)`` as positive ints; ValueError for those, an unknown strategy, a negative seed or a
    ``pad_tolerance`` outside [0, 1]."""
    w = _positive("world_size", world_size)
    b = _positive("micro_batch_size", micro_batch_size)
    g = _positive("grad_accum", grad_accum)
    n_epochs = _positive("epochs", epochs)
    if strategy not in ("cluster", "random", "length", "cluster_per_rank"):
        raise ValueError(f"strategy must be 'cluster', 'random', 'length' or 'cluster_per_rank', got {strategy!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not 0.0 <= float(pad_tolerance) <= 1.0:
        raise ValueError(f"pad_tolerance must be in [0, 1], got {pad_tolerance!r}")
    return w, b, g, n_epochs


def _padded_plan(ids, cl, nt, w: int, b: int, g: int, n_epochs: int, strategy: str, seed: int,
                 pad_tolerance: float) -> PlanResult:
    """:func:`make_plan` without packing: micro-batches of ``B`` rows, the rows beyond whole steps dropped."""
    n = ids.size
    unit = w * b * g
    if strategy == "cluster_per_rank":
        return cluster_per_rank_plan(ids, cl, nt, w, b, g, n_epochs, seed)
    if n < unit:
        raise ValueError(
            f"{n} examples cannot fill one optimizer step of world_size={w} x micro_batch_size={b} x "
            f"grad_accum={g} = {unit}: some ranks would get no micro-batch"
        )
    n_drop = n - (n // unit) * unit
    if strategy in ("random", "length"):
        drop = np.sort(_rng(seed, _TAG_DROP).choice(n, size=n_drop, replace=False)).astype(np.int64)
        mb_rows, sched = _sampler_epochs(nt, np.setdiff1d(np.arange(n), drop), w, b, g, n_epochs, strategy, seed)
    else:
        mb_rows, sched, drop = _cluster_epochs(cl, nt, w, b, g, n_epochs, n_drop, seed, pad_tolerance)
    plan = _rows_frame(sched, mb_rows, ids, cl, nt, sched.shape[1])  # sched: (epochs, steps, G, W)
    return PlanResult(plan=plan, dropped=ids[drop].astype(object), n_requested=n)


def _sampler_epochs(nt, kept, w: int, b: int, g: int, n_epochs: int, strategy: str, seed: int):
    """The ``random`` and ``length`` plans' epochs over the ``kept`` rows (see :func:`make_plan`).

    Returns (mb_rows int64 (M, B) rows of every micro-batch of every epoch, sched int64 (epochs, steps, G, W)
    micro-batch ids)."""
    n_slots = kept.size // (w * b)
    steps_per_epoch = n_slots // g
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
    return np.concatenate(mb_rows_all), np.stack(scheds)


def _cluster_epochs(cl, nt, w: int, b: int, g: int, n_epochs: int, n_drop: int, seed: int, tol: float):
    """The unpacked ``cluster`` plan's epochs (see :func:`make_plan`): ``n_drop`` rows dropped by the epoch-0 cut.

    Returns (mb_rows int64 (M, B), sched int64 (epochs, steps, G, W) micro-batch ids, drop int64 rows)."""
    n_slots = (cl.size - n_drop) // (w * b)
    steps_per_epoch = n_slots // g
    # Epoch 0 is cut with the seed itself (so a one-epoch plan is what it always was); epoch e >= 1 re-cuts
    # the same kept rows with seed + e and a length jitter, so micro-batch composition changes per epoch.
    slots, mb_rows, costs, drop = _cluster_cut(cl, nt, b, w, n_drop, seed, tol)
    kept = np.setdiff1d(np.arange(cl.size), drop)
    rows_all, scheds = [], []
    for e in range(n_epochs):
        if e > 0:
            slots, rows_e, costs, _ = _cluster_cut(cl[kept], nt[kept], b, w, 0, seed + e, tol,
                                                   _rng(seed + e, _TAG_CUT))
            mb_rows = kept[rows_e]
        rows_all.append(mb_rows)
        order = _rng(seed, _TAG_ORDER, e).permutation(n_slots)
        step_slots = slots[order].reshape(steps_per_epoch, g, w)
        scheds.append(e * n_slots * w + _assign_ranks(step_slots, costs, _rng(seed, _TAG_RANKS, e)))
    return np.concatenate(rows_all), np.stack(scheds), drop
