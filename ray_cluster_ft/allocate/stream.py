"""The allocation stage of a streamed job: the plan made over candidate positions (integers, not id strings) and
``plan.parquet`` and ``selection.parquet`` written in parts, each part's ids taken from the candidates' Arrow id
column, so no frame of Python id strings is built for millions of plan rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from .metrics import plan_metrics
from .plan import make_plan

__all__ = ["PART_ROWS", "plan_positions", "run_streamed", "write_in_parts"]

PART_ROWS = 1_000_000
"""Rows per part (Parquet row group) of a plan or selection written in parts."""


def plan_positions(cfg, labels: np.ndarray, n_tokens: np.ndarray, selected: np.ndarray, strategy: str | None = None,
                   pack_tokens: int | None = None):
    """:func:`~ray_cluster_ft.allocate.stage.plan_selection` with candidate positions for ids: the plan's
    ``example_id`` holds each row's candidate position (as a decimal string: :func:`make_plan` keeps ids as
    strings), and the same rows, order and weights as the plan of the ids themselves (the plan does not depend on
    what the ids say: ties are broken by position, seeds by rank and epoch).

    Returns:
        ``(PlanResult, (kept, mask, weights))``: ``kept`` int64 the selected positions the plan trains, in
        selection order, ``mask`` bool over ``selected`` marking them, and their weights (float64).
    """
    from ..select import selection_weights

    t, a = cfg.train, cfg.allocation
    selected = np.asarray(selected, dtype=np.int64)
    res = make_plan(selected, np.asarray(labels)[selected], np.asarray(n_tokens)[selected], t.num_workers,
                    t.micro_batch_size, t.grad_accum, t.epochs, strategy=strategy or a.strategy, seed=a.seed,
                    pad_tolerance=a.pad_tolerance, packing=cfg.packed,
                    max_tokens_per_micro_batch=pack_tokens or t.max_tokens_per_micro_batch)
    planned = np.zeros(np.asarray(labels).size, dtype=bool)
    planned[res.plan["example_id"].astype(np.int64).unique()] = True
    mask = planned[selected]
    kept = selected[mask]
    return res, (kept, mask, selection_weights(labels, kept, cfg.selection.strategy))


def write_in_parts(path: Path, frame_parts, example_ids) -> None:
    """Write a Parquet file part by part (one row group each): every part a ``pandas.DataFrame`` whose
    ``example_id`` holds candidate positions, replaced by the ids at those positions (``example_ids``, a
    ``pyarrow`` string array); written to a temporary name and renamed into place."""
    import os
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    writer = None
    try:
        for part in frame_parts:
            pos = pa.array(part["example_id"].astype(np.int64).to_numpy())
            t = pa.Table.from_pandas(part.drop(columns=["example_id"]), preserve_index=False)
            cols = list(part.columns)
            t = t.add_column(cols.index("example_id"), "example_id", example_ids.take(pos))
            if writer is None:
                writer = pq.ParquetWriter(tmp, t.schema)
            writer.write_table(t)
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, path)


def _parts(frame: pd.DataFrame):
    for lo in range(0, len(frame), PART_ROWS):
        yield frame.iloc[lo:lo + PART_ROWS]


def run_streamed(cfg, run_dir: Path, *, example_ids, labels: np.ndarray, n_tokens: np.ndarray, selected: np.ndarray,
                 reasons, origins=None) -> dict:
    """:func:`~ray_cluster_ft.allocate.stage.run` for a streamed job: the same ``plan.parquet`` and
    ``selection.parquet`` (same rows, order, columns), made over positions and written in parts.

    Args:
        cfg: the job config; run_dir: the run directory.
        example_ids: the candidates' ids (a ``pyarrow`` string array, candidate order).
        labels, n_tokens: int ``(N,)``; selected: int ``(S,)`` positions; reasons: ``S`` strings.
        origins: a ``pyarrow.Table`` with ``source_file`` and ``source_line`` in candidate order, appended to
            ``selection.parquet`` as the in-memory stage does.

    Returns:
        ``{"plan": the plan frame over positions, "result": PlanResult, "metrics": {strategy: plan_metrics,
        "random (baseline)": ...}, "kept": positions the plan trains, "weights": their weights}``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..rundir import claim

    W = cfg.train.num_workers
    ids = pa.array(example_ids, type=pa.string()) if not isinstance(example_ids, pa.Array) else example_ids
    res, (kept, mask, weight) = plan_positions(cfg, labels, n_tokens, selected, None)
    write_in_parts(claim(run_dir, "plan.parquet", "selection.parquet"), _parts(res.plan), ids)
    sel = pa.table({"example_id": ids.take(pa.array(kept)), "cluster": np.asarray(labels)[kept].astype(np.int32),
                    "reason": pa.array(np.asarray(reasons)[mask].tolist(), type=pa.string()),
                    "weight": weight.astype(np.float64)})
    if origins is not None:
        for name in ("source_file", "source_line"):
            sel = sel.append_column(name, origins.column(name).take(pa.array(kept)))
    pq.write_table(sel, run_dir / "selection.parquet", row_group_size=PART_ROWS)
    cap = res.pack_tokens
    metrics = {cfg.allocation.strategy: plan_metrics(res.plan, W, cap)}
    t = cfg.train
    if cfg.allocation.strategy != "random" and len(selected) >= W * t.grad_accum * (1 if cap else t.micro_batch_size):
        base = plan_positions(cfg, labels, n_tokens, selected, "random", cap)[0].plan
        metrics["random (baseline)"] = plan_metrics(base, W, cap)
    print(f"[ray-cluster-ft] plan: {json.dumps(metrics, default=float)}", flush=True)
    return {"plan": res.plan, "result": res, "metrics": metrics, "kept": kept, "weights": weight}
