"""The allocation stage's edge: the plan of the selection, its figures beside a random split of the same rows,
``plan.parquet`` and ``selection.parquet`` written."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .metrics import plan_hash, plan_metrics
from .plan import PlanResult, make_plan

__all__ = ["AllocateOutput", "plan_selection", "run"]


@dataclass(frozen=True)
class AllocateOutput:
    """What the allocation stage hands on.

    Attributes:
        plan: the plan frame (:data:`ray_cluster_ft.allocate.PLAN_COLUMNS`).
        result: :class:`PlanResult` (the plan, the ids dropped to make every rank's micro-batch count equal).
        baseline: the ``random`` plan of the same selection (``None`` when the strategy is ``random``, or when the
            selection fills no whole step of a random split); with ``allocation.packing`` the random *packed* plan
            (the conventional packing baseline).
        metrics: ``{strategy: plan_metrics, "random (baseline)": plan_metrics}``.
        weights: float64 per planned example, indexed by ``example_id``: the selection weight
            (:func:`ray_cluster_ft.select.selection_weights`, mean 1), also ``selection.parquet``'s ``weight``.
        packing: the manifest's ``allocation`` (:func:`packing_summary`): packing as resolved, the pack size
            used, the clusters above 1/W of the tokens.
    """

    plan: pd.DataFrame
    result: PlanResult
    baseline: pd.DataFrame | None
    metrics: dict
    weights: pd.Series
    packing: dict

    @property
    def summary(self) -> dict:
        """The manifest's ``plan_metrics``: :attr:`metrics`."""
        return self.metrics


def plan_selection(cfg, example_ids: np.ndarray, labels: np.ndarray, n_tokens: np.ndarray, selected: np.ndarray,
                   reasons, strategy: str | None = None, pack_tokens: int | None = None
                   ) -> tuple[PlanResult, pa.Table]:
    """The plan of the selected candidates and the selection table it trains, pure (no I/O).

    Args: as :func:`run`; ``strategy`` overrides ``allocation.strategy`` (the random baseline); ``pack_tokens``
    overrides ``train.max_tokens_per_micro_batch`` (the random baseline of a plan whose packs were sized to the
    data gets the same pack size). ``allocation.packing`` is resolved by :attr:`JobConfig.packed`; packed
    without ``train.max_tokens_per_micro_batch``, the cluster plan sizes its packs to the data
    (``PlanResult.pack_tokens`` says to how many tokens).

    Returns:
        ``(PlanResult, selection)``: ``selection`` has ``example_id`` (string), ``cluster`` (int32), ``reason``
        and ``weight`` (float64, :func:`ray_cluster_ft.select.selection_weights` over the rows the plan keeps:
        the budget is rounded down to whole optimizer steps there), in selection order.
    """
    from ..select import selection_weights

    t, a = cfg.train, cfg.allocation
    selected = np.asarray(selected)
    sel_ids, sel_labels = example_ids[selected], labels[selected]
    res = make_plan(sel_ids, sel_labels, n_tokens[selected], t.num_workers, t.micro_batch_size, t.grad_accum,
                    t.epochs, strategy=strategy or a.strategy, seed=a.seed, pad_tolerance=a.pad_tolerance,
                    packing=cfg.packed, max_tokens_per_micro_batch=pack_tokens or t.max_tokens_per_micro_batch)
    keep = np.isin(sel_ids, res.plan["example_id"].unique())
    weight = selection_weights(labels, selected[keep], cfg.selection.strategy)
    table = pa.table({"example_id": pa.array(sel_ids[keep].tolist(), type=pa.string()),
                      "cluster": sel_labels[keep].astype(np.int32), "reason": np.asarray(reasons)[keep],
                      "weight": weight.astype(np.float64)})
    return res, table


def _with_origins(selection, origins):
    """``selection`` with ``source_file`` and ``source_line`` of each row taken from ``origins`` by id."""
    import pyarrow as pa

    where = {e: i for i, e in enumerate(origins.column("example_id").to_pylist())}
    taken = origins.take(pa.array([where[e] for e in selection.column("example_id").to_pylist()], pa.int64()))
    for name in ("source_file", "source_line"):
        selection = selection.append_column(name, taken.column(name))
    return selection


def run(cfg, run_dir: Path, *, example_ids: np.ndarray, labels: np.ndarray, n_tokens: np.ndarray,
        selected: np.ndarray, reasons: list, expected_plan_hash: str | None = None,
        origins=None) -> AllocateOutput:
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
        origins: a ``pyarrow.Table`` with ``example_id``, ``source_file`` and ``source_line`` for (at least) every
            candidate (the data stage's ``examples.parquet`` columns); those two columns are then appended to
            ``selection.parquet``, so a selected row can be found in its file.

    Returns:
        :class:`AllocateOutput`.

    Raises:
        ConfigError: the plan differs from the stopped run's.
    """
    from ..config import ConfigError
    from ..rundir import claim

    W = cfg.train.num_workers
    res, selection = plan_selection(cfg, example_ids, labels, n_tokens, selected, reasons)
    plan = res.plan
    if expected_plan_hash is not None and plan_hash(plan) != expected_plan_hash:
        raise ConfigError(f"--resume: the plan computed now differs from the one in {run_dir / 'plan.parquet'}; the "
                          f"data, the config or a package changed. Start a fresh run directory.")
    plan.to_parquet(claim(run_dir, "plan.parquet", "selection.parquet"), index=False)
    pq.write_table(selection if origins is None else _with_origins(selection, origins), run_dir / "selection.parquet")
    cap = res.pack_tokens
    metrics = {cfg.allocation.strategy: plan_metrics(plan, W, cap)}
    baseline = None
    t = cfg.train
    # The published plan may hold less than one whole step of W x B x G rows, which a random split cannot fill.
    fits = len(selected) >= W * t.grad_accum * (1 if cap is not None else t.micro_batch_size)
    if cfg.allocation.strategy != "random" and fits:
        baseline = plan_selection(cfg, example_ids, labels, n_tokens, selected, reasons, strategy="random",
                                  pack_tokens=cap)[0].plan
        metrics["random (baseline)"] = plan_metrics(baseline, W, cap)
    print(f"[ray-cluster-ft] plan: {json.dumps(metrics, default=float)}", flush=True)
    weights = pd.Series(selection.column("weight").to_numpy(), index=selection.column("example_id").to_pylist(),
                        dtype=np.float64)
    return AllocateOutput(plan, res, baseline, metrics, weights, packing_summary(cfg, plan, res.pack_tokens))


def packing_summary(cfg, plan: pd.DataFrame, pack_tokens: int | None) -> dict:
    """The manifest's ``allocation``: ``packing`` (resolved, bool), ``packing_setting`` (as written: true,
    false or auto), ``max_tokens_per_micro_batch`` (the pack size used: as set, or chosen from the data, ``pack_size:
    "data"``; None unpacked), and ``over_share``: the clusters holding more than 1/W of the planned tokens
    (``[{"cluster", "token_share"}]``, largest first), which must sit on two ranks at some step under any plan,
    so ``collisions_per_step_rows`` cannot be 0 while one exists."""
    from ._sized import over_share

    labels, code = np.unique(plan["cluster"].to_numpy(np.int64), return_inverse=True)
    w = cfg.train.num_workers
    big = over_share(code, plan["n_tokens"].to_numpy(np.int64), w) if w > 1 else []
    return {"packing": bool(cfg.packed), "packing_setting": cfg.allocation.packing,
            "max_tokens_per_micro_batch": pack_tokens,
            "pack_size": None if pack_tokens is None else ("set" if cfg.train.max_tokens_per_micro_batch else "data"),
            "over_share": [{"cluster": int(labels[c]), "token_share": round(share, 4)} for c, share in big]}
