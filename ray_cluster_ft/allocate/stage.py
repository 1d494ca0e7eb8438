"""The allocation stage's edge: the plan of the selection, its figures beside a random split of the same rows,
``plan.parquet`` and ``selection.parquet`` written."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .metrics import plan_hash, plan_metrics
from .plan import PlanResult, make_plan

__all__ = ["AllocationStage", "run"]


@dataclass(frozen=True)
class AllocationStage:
    """What the allocation stage hands on.

    Attributes:
        plan: the plan frame (:data:`ray_cluster_ft.allocate.PLAN_COLUMNS`).
        result: :class:`PlanResult` (the plan, the ids dropped to make every rank's micro-batch count equal).
        baseline: the ``random`` plan of the same selection (``None`` when the strategy is ``random``).
        metrics: ``{strategy: plan_metrics, "random (baseline)": plan_metrics}``.
        weights: float64 per planned example, indexed by ``example_id``: the selection weight
            (:func:`ray_cluster_ft.select.selection_weights`, mean 1), also ``selection.parquet``'s ``weight``.
    """

    plan: pd.DataFrame
    result: PlanResult
    baseline: pd.DataFrame | None
    metrics: dict
    weights: pd.Series


def run(cfg, run_dir: Path, *, example_ids: np.ndarray, labels: np.ndarray, n_tokens: np.ndarray,
        selected: np.ndarray, reasons: list, expected_plan_hash: str | None = None) -> AllocationStage:
    """Plan the selected candidates with ``allocation.strategy`` and write the stage's artifacts.

    ``selection.parquet`` (``example_id``, ``cluster`` int32, ``reason``) lists the selected rows the plan
    trains: the budget rounded down to whole optimizer steps on every rank; ``weight`` (float64) restores each
    cluster's share of the candidates, ``(n_c / N) / (s_c / S)`` over the rows listed (mean 1; 1 for the
    ``full`` and ``random`` selections).

    Args:
        cfg: the job config (``train`` world size, micro-batch, grad_accum, epochs; ``allocation`` section).
        run_dir: the run directory.
        example_ids: str ``(N,)`` candidate ids; labels: int ``(N,)`` clusters (zeros without clustering);
            n_tokens: int ``(N,)``.
        selected: int ``(S,)`` indices of the selected candidates; reasons: ``S`` strings, why each was picked.
        expected_plan_hash: on ``--resume``, the stopped run's :func:`plan_hash`; the plan must equal it.

    Raises:
        ConfigError: the plan differs from the stopped run's.
    """
    from ..config import ConfigError

    t = cfg.train
    W = t.num_workers
    sel_ids, sel_labels = example_ids[selected], labels[selected]
    plan_for = partial(make_plan, sel_ids, sel_labels, n_tokens[selected], W, t.micro_batch_size, t.grad_accum,
                       t.epochs, seed=cfg.allocation.seed, pad_tolerance=cfg.allocation.pad_tolerance)
    res = plan_for(strategy=cfg.allocation.strategy)
    plan = res.plan
    if expected_plan_hash is not None and plan_hash(plan) != expected_plan_hash:
        raise ConfigError(f"--resume: the plan computed now differs from the one in {run_dir / 'plan.parquet'}; the "
                          f"data, the config or a package changed. Start a fresh run directory.")
    from ..rundir import claim

    plan.to_parquet(claim(run_dir, "plan.parquet", "selection.parquet"), index=False)
    from ..select import selection_weights

    keep = np.isin(sel_ids, plan["example_id"].unique())
    weight = selection_weights(labels, np.asarray(selected)[keep], cfg.selection.strategy)
    pq.write_table(pa.table({"example_id": sel_ids[keep], "cluster": sel_labels[keep].astype(np.int32),
                             "reason": np.asarray(reasons)[keep], "weight": weight.astype(np.float64)}),
                   run_dir / "selection.parquet")
    metrics = {cfg.allocation.strategy: plan_metrics(plan, W)}
    baseline = None
    if cfg.allocation.strategy != "random":
        baseline = plan_for(strategy="random").plan
        metrics["random (baseline)"] = plan_metrics(baseline, W)
    print(f"[ray-cluster-ft] plan: {json.dumps(metrics, default=float)}", flush=True)
    return AllocationStage(plan, res, baseline, metrics, pd.Series(weight, index=sel_ids[keep], dtype=np.float64))
