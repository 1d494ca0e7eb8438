"""Balance, padding and collision figures of a plan, and the hard rules the trainer checks before it starts."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ._slots import _positive

__all__ = [
    "microbatch_table",
    "plan_metrics",
    "check_plan",
    "plan_hash",
]


def microbatch_table(plan: pd.DataFrame) -> pd.DataFrame:
    """One row per micro-batch: step, rank, micro_index, rows, longest, real tokens, distinct clusters,
    majority cluster (ties: see :func:`_majority`)."""
    key = ["step", "rank", "micro_index"]
    mb = plan.groupby(key, sort=True).agg(
        rows=("n_tokens", "size"),
        longest=("n_tokens", "max"),
        real=("n_tokens", "sum"),
        n_clusters=("cluster", "nunique"),
    )
    # Same tie rule as the allocator: the tied cluster of the longest example, then the later position.
    frame = plan[key + ["cluster", "n_tokens"]].copy()
    frame["_last"] = frame["n_tokens"].to_numpy(np.int64) * (len(frame) + 1) + np.arange(len(frame))
    cnt = frame.groupby(key + ["cluster"], sort=True).agg(c=("_last", "size"), last=("_last", "max")).reset_index()
    cnt = cnt.sort_values(key + ["c", "last"], ascending=[True, True, True, False, False], kind="stable")
    major = cnt.drop_duplicates(key).set_index(key)["cluster"]
    mb["major"] = major
    mb["padded"] = mb["rows"] * mb["longest"]
    return mb.reset_index()


def _critical_path_bound(n_tokens: np.ndarray, w: int, b: int, g: int) -> float:
    """Lower bound on the critical path of one epoch of these examples (see :func:`plan_metrics`)."""
    srt = np.sort(n_tokens)[::-1]
    return float(max(srt.sum() / w, b * srt[:: w * b * g].sum()))


def row_collisions(plan: pd.DataFrame) -> pd.Series:
    """Per step: sum over clusters of (ranks holding a row of that cluster in the step - 1)."""
    tri = plan[["step", "rank", "cluster"]].drop_duplicates()
    ranks_per = tri.groupby(["step", "cluster"], sort=True).size()
    return (ranks_per - 1).groupby(level="step").sum()


def plan_metrics(plan: pd.DataFrame, world_size: int, max_tokens_per_micro_batch: int | None = None) -> dict:
    """Balance, padding and collision figures of a plan.

    - ``token_imbalance_mean`` / ``_max``: per step, the max over ranks / the mean over the ``world_size``
      ranks of the rank's padded tokens in that step (sum over its micro-batches of rows x longest
      ``n_tokens``); averaged / maximised over steps. 1.0 is perfect; the slowest rank sets the step time.
    - ``padding_fraction``: pad tokens / padded tokens, over the whole plan.
    - ``critical_path_tokens``: sum over steps of the slowest rank's padded tokens (a proxy of wall time).
    - ``collisions_per_step``: mean over steps of the sum over micro-slots (micro_index) of ``world_size`` -
      the number of distinct majority clusters among the ranks' micro-batches (0 = stratified batches).
    - ``collisions_per_step_rows``: the strict count, every row counted rather than each micro-batch's
      majority: mean over steps of the sum over clusters of (the number of ranks holding a row of that
      cluster in the step - 1). A cluster on two ranks of one step is one collision, whatever the
      micro-batches' majorities are.
    - ``single_cluster_fraction``: share of micro-batches (packs) whose rows all come from one cluster.
    - ``pack_fill`` (packed plans only, ``max_tokens_per_micro_batch`` given): mean over packs of real tokens
      / ``max_tokens_per_micro_batch``. For a packed plan the loads are real tokens (a pack has no padding),
      ``padding_fraction`` is 0, and the bound is real tokens / W per epoch.
    - ``critical_path_bound_tokens``: a lower bound on ``critical_path_tokens`` for *any* plan of the same
      examples, W, B and G: per epoch, the larger of (real tokens / W) and B x the sum of every
      (W * B * G)-th length in descending order (the step holding the j-th such length has a micro-batch at
      least that long). With G = 1 the second term is exact: it is what the cluster-blind sorted cut reaches.
    - ``critical_path_vs_bound``: ``critical_path_tokens / critical_path_bound_tokens`` (>= 1).
    - ``steps``: optimizer steps; ``micro_batches_per_rank``: mean micro-batches per rank.

    Args:
        plan: a plan frame (:data:`PLAN_COLUMNS`).
        world_size: W.

    Returns:
        dict of floats.

    Raises:
        ValueError: missing columns, empty plan, world_size < 1.
    """
    w = _positive("world_size", world_size)
    missing = [c for c in ("step", "rank", "micro_index", "cluster", "n_tokens") if c not in plan.columns]
    if missing:
        raise ValueError(f"plan lacks columns {missing}")
    if plan.empty:
        raise ValueError("plan is empty")
    mb = microbatch_table(plan)
    packed = max_tokens_per_micro_batch is not None
    if packed:
        cap = _positive("max_tokens_per_micro_batch", max_tokens_per_micro_batch)
        mb["padded"] = mb["real"]
    load = mb.groupby(["step", "rank"], sort=True)["padded"].sum()
    per_step = load.groupby(level="step")
    step_max = per_step.max()
    step_mean = per_step.sum() / w
    imb = step_max / step_mean
    distinct = mb.groupby(["step", "micro_index"], sort=True)["major"].nunique()
    coll = (w - distinct).groupby(level="step").sum()
    b = int(mb["rows"].max())
    g = int(mb["micro_index"].max()) + 1
    if packed:
        parts = plan.groupby("epoch") if "epoch" in plan.columns else [(0, plan)]
        bound = float(sum(part["n_tokens"].sum() / w for _, part in parts))
    elif "epoch" in plan.columns:
        epochs = plan.groupby("epoch")
        bound = float(sum(_critical_path_bound(part["n_tokens"].to_numpy(np.int64), w, b, g) for _, part in epochs))
    else:
        bound = _critical_path_bound(plan["n_tokens"].to_numpy(np.int64), w, b, g)
    row_coll = row_collisions(plan).reindex(step_max.index, fill_value=0)
    out = {
        "token_imbalance_mean": float(imb.mean()),
        "token_imbalance_max": float(imb.max()),
        "padding_fraction": float(1.0 - mb["real"].sum() / mb["padded"].sum()),
        "critical_path_tokens": float(step_max.sum()),
        "collisions_per_step": float(coll.mean()),
        "collisions_per_step_rows": float(row_coll.mean()),
        "single_cluster_fraction": float((mb["n_clusters"] == 1).mean()),
        "critical_path_bound_tokens": bound,
        "critical_path_vs_bound": float(step_max.sum()) / bound,
        "steps": float(step_max.size),
        "micro_batches_per_rank": float(mb.groupby("rank").size().mean()),
    }
    if packed:
        out["pack_fill"] = float(mb["real"].mean() / cap)
    return out


def check_plan(plan: pd.DataFrame, world_size: int, micro_batch_size: int, grad_accum: int = 1,
               max_tokens_per_micro_batch: int | None = None, short_tail: bool = False) -> int:
    """Enforce the hard rules that keep data-parallel training from hanging.

    Checks: every rank 0..W-1 present and none outside; the same number of micro-batches on every rank; every
    micro-batch has exactly ``micro_batch_size`` rows (packed plans, ``max_tokens_per_micro_batch`` given:
    instead, every pack holds at most that many tokens); every (rank, step) has micro_index 0..G-1; every step
    has all ranks; every step lies in one epoch and steps increase with epochs. The trainer runs this on the
    driver before any worker starts.

    ``short_tail=True`` (the published ``cluster_per_rank`` plan, which rounds nothing): the last micro-batch of
    each rank and epoch may hold fewer rows (at least one), and the last step of each epoch may hold fewer than
    G micro-batches (micro_index 0..g-1, the same g on every rank). The trainer then marks each step's last
    micro-batch as the accumulation boundary itself.

    Returns:
        The number of optimizer steps.

    Raises:
        ValueError: naming the offending rank / step / micro-batch, e.g. ``uneven plan: rank 1 has 3
            micro-batches, rank 0 has 4; uneven counts hang the collective ops of data-parallel training``.
    """
    w = _positive("world_size", world_size)
    b = _positive("micro_batch_size", micro_batch_size)
    g = _positive("grad_accum", grad_accum)
    missing = [c for c in ("step", "rank", "micro_index") if c not in plan.columns]
    if missing:
        raise ValueError(f"plan lacks columns {missing}")
    ranks = plan["rank"].to_numpy()
    outside = np.setdiff1d(np.unique(ranks), np.arange(w))
    if outside.size:
        raise ValueError(f"plan has rank {int(outside[0])} outside 0..{w - 1} (world size {w})")
    mb = plan.groupby(["rank", "step", "micro_index"], sort=True).size()
    per_rank = mb.groupby(level="rank").size().reindex(range(w), fill_value=0)
    absent = per_rank.index[per_rank.to_numpy() == 0]
    if len(absent):
        raise ValueError(
            f"uneven plan: rank {int(absent[0])} has no micro-batches (world size {w}); uneven counts hang the "
            f"collective ops of data-parallel training"
        )
    if per_rank.nunique() > 1:
        lo, hi = int(per_rank.idxmin()), int(per_rank.idxmax())
        raise ValueError(
            f"uneven plan: rank {lo} has {int(per_rank[lo])} micro-batches, rank {hi} has {int(per_rank[hi])}; "
            f"uneven counts hang the collective ops of data-parallel training"
        )
    if max_tokens_per_micro_batch is not None:
        cap = _positive("max_tokens_per_micro_batch", max_tokens_per_micro_batch)
        if "n_tokens" not in plan.columns:
            raise ValueError("plan lacks columns ['n_tokens'] (a packed plan is checked in tokens)")
        tok = plan.groupby(["rank", "step", "micro_index"], sort=True)["n_tokens"].sum()
        over = tok[tok > cap]
        if len(over):
            (r, s, m), size = over.index[0], int(over.iloc[0])
            raise ValueError(f"pack (rank {r}, step {s}, micro_index {m}) holds {size} tokens, above "
                             f"max_tokens_per_micro_batch={cap}")
        bad = mb.iloc[:0]
    elif short_tail:
        flat = mb.reset_index()
        flat["epoch"] = flat["step"].map(plan.groupby("step")["epoch"].first()) if "epoch" in plan.columns else 0
        last = pd.MultiIndex.from_frame(flat.groupby(["rank", "epoch"]).tail(1)[["rank", "step", "micro_index"]])
        bad = mb[(mb > b) | ((mb < b) & ~mb.index.isin(last))]
    else:
        bad = mb[mb != b]
    if len(bad):
        (r, s, m), size = bad.index[0], int(bad.iloc[0])
        raise ValueError(
            f"micro-batch (rank {r}, step {s}, micro_index {m}) has {size} rows, expected micro_batch_size={b}"
        )
    per_rank_step = mb.reset_index().groupby(["rank", "step"])["micro_index"].agg(["size", "min", "max"])
    _check_step_sizes(mb, per_rank_step, g, short_tail, plan)
    ranks_per_step = mb.reset_index().groupby("step")["rank"].nunique()
    short = ranks_per_step[ranks_per_step != w]
    if len(short):
        raise ValueError(
            f"step {int(short.index[0])} has micro-batches on {int(short.iloc[0])} of {w} ranks; the others would "
            f"wait forever in the step's collective ops"
        )
    if "epoch" in plan.columns:
        epochs_per_step = plan.groupby("step")["epoch"].agg(["nunique", "min"])
        split = epochs_per_step[epochs_per_step["nunique"] > 1]
        if len(split):
            raise ValueError(f"step {int(split.index[0])} spans several epochs; every step must lie in one epoch")
        if np.any(np.diff(epochs_per_step["min"].to_numpy()) < 0):
            raise ValueError("plan steps must increase with epochs")
    return int(ranks_per_step.size)


def _check_step_sizes(mb: pd.Series, per_rank_step: pd.DataFrame, g: int, short_tail: bool,
                      plan: pd.DataFrame) -> None:
    """Every (rank, step) has micro_index 0..G-1; with ``short_tail`` the last step of an epoch may have
    0..g-1 for a g < G, the same g on every rank of that step. ValueError naming the first offender."""
    size, lo, hi = (per_rank_step[c] for c in ("size", "min", "max"))
    full = (size == g) & (lo == 0) & (hi == g - 1)
    if short_tail:
        steps = per_rank_step.index.get_level_values("step")
        last = plan.groupby("epoch")["step"].max() if "epoch" in plan.columns else pd.Series([steps.max()])
        contiguous = (lo == 0) & (hi == size - 1) & (size <= g) & np.isin(steps, last.to_numpy())
        full = full | contiguous
        uneven = per_rank_step["size"].groupby(level="step").nunique()
        if (uneven > 1).any():
            s = int(uneven.index[np.argmax(uneven.to_numpy() > 1)])
            raise ValueError(f"step {s} has different micro-batch counts on its ranks; uneven counts hang the "
                             f"collective ops of data-parallel training")
    wrong = per_rank_step[~full]
    if len(wrong):
        r, s = wrong.index[0]
        raise ValueError(
            f"rank {r} step {s} has micro_index values {sorted(mb.loc[(r, s)].index.tolist())}, "
            f"expected 0..{g - 1} (grad_accum={g})" + (" (fewer only in an epoch's last step)" if short_tail else "")
        )


def plan_hash(plan: pd.DataFrame) -> str:
    """sha256 (hex) of the plan's training order: ``rank, epoch, step, micro_index, example_id`` per row in
    ``(rank, epoch, step, micro_index)`` order. A checkpoint records it, so a run resumes only its own plan."""
    import hashlib

    order = plan.sort_values(["rank", "epoch", "step", "micro_index"], kind="stable")
    h = hashlib.sha256()
    for c in ("rank", "epoch", "step", "micro_index"):
        h.update(order[c].to_numpy(np.int64).tobytes())
    h.update("\x00".join(order["example_id"].astype(str)).encode())
    return h.hexdigest()
