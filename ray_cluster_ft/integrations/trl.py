"""The plan in TRL's ``SFTTrainer``: :class:`PlanSFTTrainer` lets TRL tokenize the rows its own way (its chat
template handling, EOS, completion mask, ``max_length``), re-makes the plan from the token counts that processing
produced, and then trains like :class:`~ray_cluster_ft.integrations.hf.PlanTrainer`: each process exactly its
rank's planned micro-batches, in plan order, with the token-exact weighted loss on TRL's labels.

Why re-plan: the plan balances the token loads of the ranks of each step and keeps micro-batches of similar
lengths. A run's plan counts tokens with this project's tokenization; TRL's formatting of the same rows gives other
counts (measured on the demo rows: 31 tokens more per row), so the balance would be of lengths nobody trains.
:func:`~ray_cluster_ft.integrations.torch.replan` keeps the rows, clusters, world size, ``grad_accum`` and epochs.

Install with ``pip install 'ray-cluster-ft[trl]'`` (TRL needs Python >= 3.11).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from trl import SFTConfig, SFTTrainer

from .hf import PlanTrainer, plan_args
from .torch import is_packed_plan, plan_shape
from .torch import replan as remake_plan

__all__ = ["PlanSFTTrainer", "selected_dataset"]

logger = logging.getLogger(__name__)


def selected_dataset(run_dir: str | Path):
    """A run's planned rows as a ``datasets.Dataset`` in TRL's conversational prompt-completion form.

    Reads ``plan.parquet`` and the run's ``config.yaml`` (written by ``ray-cluster-ft run``/``select``), and reads
    the rows again from the data sources it names (:func:`ray_cluster_ft.data.read.rows_by_id`: the same
    canonical chat messages the data stage tokenized, whatever the source format).

    Returns:
        ``datasets.Dataset`` with columns ``example_id`` (str), ``prompt`` (the messages before the last, list of
        ``{"role", "content"}``) and ``completion`` (the last message, a one-element list), one row per planned
        example in first-planned order. TRL then trains on the completion only (its default for this form).

    Raises:
        FileNotFoundError: no ``plan.parquet`` or ``config.yaml`` in ``run_dir``.
        RuntimeError: a planned row is no longer in the sources (they changed since the run).
    """
    import datasets

    from ..config import load_config
    from ..data.read import rows_by_id

    run_dir = Path(run_dir)
    for name in ("plan.parquet", "config.yaml"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} is missing: pass the folder of a ray-cluster-ft run or select")
    ids = pd.unique(pd.read_parquet(run_dir / "plan.parquet", columns=["example_id"])["example_id"].astype(str))
    found = rows_by_id(load_config(run_dir / "config.yaml").data, list(ids))
    msgs = [[{"role": m["role"], "content": m["content"]} for m in found[e][1]] for e in ids]
    return datasets.Dataset.from_dict({"example_id": list(ids), "prompt": [m[:-1] for m in msgs],
                                       "completion": [m[-1:] for m in msgs]})


def _prepared_tokens(dataset) -> tuple[list[str], pa.Table]:
    """The ids and TRL's tokens of its prepared train dataset."""
    cols = getattr(dataset, "column_names", None) or []
    if "example_id" not in cols:
        raise ValueError(f"PlanSFTTrainer needs an example_id column in train_dataset (TRL kept {cols}); "
                         f"selected_dataset(run_dir) gives one")
    ids = [str(x) for x in dataset["example_id"]]
    toks, labels = dataset["input_ids"], dataset["labels"]
    table = pa.table({"example_id": pa.array(ids, pa.string()), "input_ids": pa.array(toks, pa.list_(pa.int64())),
                      "labels": pa.array(labels, pa.list_(pa.int64()))})
    return ids, table


class PlanSFTTrainer(PlanTrainer, SFTTrainer):
    """A TRL ``SFTTrainer`` that trains the plan on TRL's own tokens: TRL prepares ``train_dataset`` as usual, the
    plan is re-made for the token counts that gives (``replan=True``), and process ``args.process_index`` then
    iterates exactly its rank's micro-batches of that plan, in plan order, with the token-exact weighted loss
    (``sum_i w_i sum_t l_it / D`` over TRL's labels; see :class:`~ray_cluster_ft.integrations.hf.PlanTrainer`).

    Args:
        model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs: as for
            ``SFTTrainer``. ``train_dataset``: a ``datasets.Dataset`` in any form TRL reads, with an
            ``example_id`` column (:func:`selected_dataset` gives one). ``args``: an ``SFTConfig`` (default
            ``SFTConfig("trl_out")``); B, G and the step count come from the plan; on a machine without CUDA pass
            ``bf16=False`` (``SFTConfig`` defaults to bf16).
        plan: the run's plan (``plan.parquet``) for ``args.world_size`` ranks, packed or not.
        weights: per-example loss weights indexed by ``example_id`` (``selection.parquet``'s ``weight``);
            ``None`` weighs every example 1.
        trained_log: as for ``PlanTrainer``.
        replan: re-make the plan from TRL's token counts (:func:`~ray_cluster_ft.integrations.torch.replan`);
            ``False`` trains ``plan`` as it is (an unpacked plan only).
        allocation: the allocation settings of the re-plan (the run's ``config.yaml`` ``allocation`` section, or
            an ``AllocationConfig``); default the package's.
        micro_batch_size: rows per micro-batch of the re-plan; default the plan's, for a packed plan the mean
            rows per pack (rounded down).

    Attributes:
        plan: the plan trained (the re-made one with ``replan``); ``plan_sampler``, ``plan_weights``,
        ``trained_rows`` as for ``PlanTrainer``.

    Raises:
        ValueError: ``packing`` or ``padding_free`` in ``args`` (the plan says what each micro-batch holds), a
            packed plan with ``replan=False``, rows TRL dropped, and what ``PlanTrainer`` raises.
    """

    def __init__(self, model=None, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, plan: pd.DataFrame, weights: pd.Series | None = None,
                 trained_log: str | Path | None = None, replan: bool = True, allocation: Any = None,
                 micro_batch_size: int | None = None, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("PlanSFTTrainer computes the token-exact loss itself; do not pass compute_loss_func")
        if train_dataset is None:
            raise ValueError("PlanSFTTrainer needs the train_dataset the plan was made from")
        args = args if args is not None else SFTConfig("trl_out")
        if getattr(args, "packing", False) or getattr(args, "padding_free", False):
            raise ValueError("PlanSFTTrainer trains the plan's micro-batches: set packing=False and padding_free=False "
                             "in SFTConfig (the plan itself says what each micro-batch holds)")
        packed = is_packed_plan(plan)
        if packed and not replan:
            raise ValueError("a packed plan (allocation.packing) cannot be trained as it is on TRL's tokens: keep "
                             "replan=True, or select with allocation.packing: false")
        if micro_batch_size is None and packed:  # a pack holds any number of rows: as many as a pack on average
            micro_batch_size = max(1, len(plan) // len(plan.drop_duplicates(["rank", "epoch", "step", "micro_index"])))
        args, _ = plan_args(args, plan, micro_batch_size=micro_batch_size if replan else None)
        SFTTrainer.__init__(self, model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                            eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        ids, table = _prepared_tokens(self.train_dataset)
        if replan:
            lengths = np.asarray([len(x) for x in table.column("input_ids").to_pylist()], dtype=np.int64)
            trained = remake_plan(plan, ids, lengths, self.args.per_device_train_batch_size, allocation)
        else:
            trained = plan
        self._attach_plan(trained, ids, table, weights, trained_log, self.args.process_index, False)
        self.args.max_steps = plan_shape(trained).steps
        self._after_init()
