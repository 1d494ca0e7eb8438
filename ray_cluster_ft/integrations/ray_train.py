"""The plan in your own ``ray.train.torch.TorchTrainer``: the data setup this project's trainer uses
(:mod:`ray_cluster_ft.train.driver`), as three public functions.

- :func:`plan_datasets` (driver side): one Ray dataset per rank, ``train_rank{r}``, rows in plan order, with
  the token-exact loss's ``weight`` and ``step_weighted_tokens`` (:func:`ray_cluster_ft.train.build_rank_tables`).
- :func:`plan_data_config` (driver side): ``DataConfig(datasets_to_split=[])`` with ``preserve_order=True``,
  so Ray hands rank r the dataset ``train_rank{r}`` whole and in order (a split, ``streaming_split``, is not a
  fixed assignment of rows to ranks; docs/design.md, "Verified platform facts").
- :func:`rank_shard` (worker side): this worker's own dataset.

In the worker, ``rank_shard().iter_batches(batch_size=B, batch_format="numpy")`` yields exactly one planned
micro-batch per batch (B = the plan's micro-batch size). Each batch's ``step_weighted_tokens[0]`` is the step's
``D``; backpropagate ``token_exact_loss(logits, labels, weight) * W / D`` under DDP when your loop sums the G
micro-batches' gradients (the table in :mod:`ray_cluster_ft.integrations.torch` gives the other cases).
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from ..pipeline.session import ensure_ray
from ..train import build_rank_tables
from .torch import is_packed_plan, plan_shape

__all__ = ["plan_data_config", "plan_datasets", "rank_shard"]


def plan_datasets(plan: pd.DataFrame, examples: pa.Table | pd.DataFrame, world_size: int,
                  weights: pd.Series | None = None, *, name: str = "train", address: str | None = None,
                  packed: bool | None = None) -> dict:
    """One Ray dataset per rank, for ``TorchTrainer(datasets=...)``.

    Args:
        plan: the allocation plan (``plan.parquet``), checked with :func:`ray_cluster_ft.allocate.check_plan`.
        examples: ``example_id`` (str), ``input_ids``, ``labels`` (list<int>) of at least the planned examples.
        world_size: the ``ScalingConfig(num_workers=...)`` you run; must be the plan's.
        weights: per-example loss weights indexed by ``example_id`` (``selection.parquet``'s ``weight``);
            ``None`` weighs every example 1.
        name: dataset name prefix; the keys are ``f"{name}_rank{r}"``.
        address: the Ray cluster to join when this process has no Ray yet (``auto``, ``host:port``,
            ``ray://...``), as the command line's ``--address``; default ``$RAY_ADDRESS``, else a new local Ray.
        packed: a packed plan (``allocation.packing``); ``None`` reads it off the plan
            (:func:`~ray_cluster_ft.integrations.torch.is_packed_plan`). A pack's rows are consecutive rows of one
            ``(epoch, step, micro_index)``; group them by those columns instead of cutting batches of B rows.

    Returns:
        ``{f"{name}_rank{r}": ray.data.Dataset}`` for r in ``0..world_size-1``; rows in rank r's plan order with
        columns ``example_id`` (string), ``epoch, step, micro_index`` (int64), ``input_ids, labels`` (list<int>),
        ``weight`` and ``step_weighted_tokens`` (float64).

    Without a Ray in this process, one is started the way every entry point starts it
    (:func:`ray_cluster_ft.pipeline.session.ensure_ray`: a new local Ray unless ``address`` or ``$RAY_ADDRESS``
    names one, never the cluster a stale ``/tmp/ray`` file or another user's ``ray start`` recorded) and left
    running for the trainer.

    Raises:
        ValueError: a plan for another world size or one ``check_plan`` rejects; plan ids missing from
            ``examples`` or ``weights``; anything else ``build_rank_tables`` rejects.
        ConfigError: Ray could not start or be joined (:func:`ray_cluster_ft.pipeline.session.init_ray`).
    """
    import ray.data

    shape = plan_shape(plan, world_size, is_packed_plan(plan) if packed is None else packed)
    tables = build_rank_tables(plan, examples, shape.world_size, weights)
    ensure_ray(address)
    out = {}
    for r, t in enumerate(tables):
        ds = ray.data.from_arrow(t)
        ds.context.enable_progress_bars = False  # this dataset's context copy: no per-batch bars in the workers
        out[f"{name}_rank{r}"] = ds
    return out


def plan_data_config(datasets_to_split=()):
    """``ray.train.DataConfig`` that gives every worker its ``*_rank{r}`` dataset unsplit and in order.

    Args:
        datasets_to_split: names of *other* datasets (e.g. an evaluation set) Ray should split across workers as
            usual; never the plan's.

    Returns:
        ``DataConfig(datasets_to_split=list(datasets_to_split),
        execution_options=ExecutionOptions(preserve_order=True))``.
    """
    import ray.data
    import ray.train

    return ray.train.DataConfig(datasets_to_split=list(datasets_to_split),
                                execution_options=ray.data.ExecutionOptions(preserve_order=True))


def rank_shard(name: str = "train"):
    """In a Ray Train worker: this worker's planned rows, ``ray.train.get_dataset_shard(f"{name}_rank{r}")``
    with r its world rank.

    Returns:
        A ``DataIterator``; ``iter_batches(batch_size=B, batch_format="numpy")`` yields one planned micro-batch
        per batch (dicts of numpy arrays, columns as in :func:`plan_datasets`).

    Raises:
        KeyError: no dataset of that name for this rank (``plan_datasets(..., name=...)`` used another name, or
            the trainer runs more workers than the plan has ranks).
    """
    import ray.train

    key = f"{name}_rank{ray.train.get_context().get_world_rank()}"
    try:
        return ray.train.get_dataset_shard(key)
    except KeyError as err:
        raise KeyError(f"no dataset {key!r} in this TorchTrainer: pass datasets=plan_datasets(..., name={name!r}) "
                       f"for as many ranks as ScalingConfig(num_workers=...)") from err
