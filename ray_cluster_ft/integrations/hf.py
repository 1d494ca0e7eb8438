"""The plan in a Hugging Face ``transformers.Trainer``: :class:`PlanTrainer` trains each process on exactly its
rank's planned micro-batches with the selection weights and the token-exact loss.

Keeping Accelerate from sharding twice. ``Trainer._get_dataloader`` passes the train loader through
``accelerator.prepare``, whose ``prepare_data_loader`` wraps any map-style batch sampler in
``BatchSamplerShard`` (rank r keeps every W-th batch). A :class:`~ray_cluster_ft.integrations.torch.PlanBatchSampler`
already yields only this rank's batches, so that wrapper would drop ``(W-1)/W`` of them and train the wrong
rows (huggingface/accelerate#4075; accelerate 1.x has no "already sharded" option).
:meth:`PlanTrainer.get_train_dataloader` therefore calls Accelerate's public
``accelerate.data_loader.prepare_data_loader`` itself with ``num_processes=1, process_index=0`` (no
``BatchSamplerShard``, no dispatching, no batch splitting), and does not hand the loader to
``accelerator.prepare``. The loader is still a ``DataLoaderShard``: batches are moved to the device and the
end of the data is reported to Accelerate's ``GradientState``. ``split_batches`` and ``dispatch_batches`` are not
used: both assume one global batch stream cut across processes, the opposite of a per-rank plan.

The loss. ``compute_loss`` returns ``W * S_mb / D`` (``S_mb = token_exact_loss``, ``D`` the step's
``sum_i w_i |T_i|`` over all ranks, see :mod:`ray_cluster_ft.integrations.torch`) and the class sets
``loss_is_scaled_for_ga = True``, so the Trainer does not divide it by G again (and turns DeepSpeed's own
division off, as it always does). DDP or DeepSpeed average the gradients over the W ranks and the G micro-batches'
gradients add up: the optimizer applies exactly ``dL/dtheta``. The logged ``loss`` (the Trainer's mean over ranks
of the summed micro-batch losses) is the step's token-exact loss ``L``.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import Trainer, TrainingArguments

from ..model import forward_keeps_logits
from ._launch import world_size_message
from .torch import (
    ExamplesDataset,
    PlanBatchSampler,
    TokenCollator,
    is_packed_plan,
    loss_positions,
    micro_batch_loss,
    plan_loss_weights,
    plan_shape,
)

__all__ = ["PlanTrainer", "plan_args"]

logger = logging.getLogger(__name__)

POSITION_KEY = "plan_position"  # the batch key carrying the dataset positions of a planned micro-batch


class _Positioned(Dataset):
    """``dataset[p]`` paired with ``p``, so the collated batch says which rows it holds."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, p: int):
        return p, self.dataset[p]


class _PositionCollator:
    """The user's collator on the items, plus ``plan_position`` (int64 ``(B,)``)."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, pairs: list) -> dict:
        out = dict(self.collate_fn([item for _, item in pairs]))
        out[POSITION_KEY] = torch.tensor([p for p, _ in pairs], dtype=torch.int64)
        return out


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _dataset_ids(dataset) -> list[str]:
    ids = getattr(dataset, "example_ids", None)
    if ids is None:
        try:
            ids = dataset["example_id"]  # a datasets.Dataset column
        except (KeyError, TypeError, IndexError, ValueError):
            try:
                ids = [dataset[i]["example_id"] for i in range(len(dataset))]
            except (KeyError, TypeError, IndexError) as err:
                raise ValueError(
                    "PlanTrainer needs the example id of every train_dataset row: pass example_ids=, or use a "
                    "dataset with an `example_ids` attribute, an `example_id` column or `example_id` items"
                ) from err
    return [str(x) for x in ids]


def _token_table(dataset, ids: Sequence[str], positions: np.ndarray) -> pa.Table:
    """example_id, input_ids, labels of the planned rows (what ``build_rank_tables`` needs for ``D``)."""
    if isinstance(dataset, ExamplesDataset):
        return dataset.table
    rows_ids, rows_labels = [], []
    for p in positions.tolist():
        item = dataset[p]
        if "input_ids" not in item:
            raise ValueError(
                f"train_dataset row {p} has no input_ids (its fields: {sorted(item)[:8]}): PlanTrainer trains "
                f"tokenized rows. Pass ExamplesDataset(pd.read_parquet(f'{{run_dir}}/examples.parquet')) (the "
                f"run's tokens), ExamplesDataset(compute_features(...).examples), tokenize the rows first "
                f"(input_ids, labels with -100 on the prompt), or let TRL tokenize them: "
                f"ray_cluster_ft.integrations.trl.PlanSFTTrainer (re-plans on TRL's token counts)")
        x = item["input_ids"]
        y = item.get("labels") if item.get("labels") is not None else x
        rows_ids.append(np.asarray(x, dtype=np.int64).ravel().tolist())
        rows_labels.append(np.asarray(y, dtype=np.int64).ravel().tolist())
    return pa.table({"example_id": pa.array([ids[p] for p in positions.tolist()], pa.string()),
                     "input_ids": pa.array(rows_ids, pa.list_(pa.int64())),
                     "labels": pa.array(rows_labels, pa.list_(pa.int64()))})


def plan_args(args: TrainingArguments, plan: pd.DataFrame, micro_batch_size: int | None = None
              ) -> tuple[TrainingArguments, bool]:
    """A copy of ``args`` with what the plan fixes, after the checks every plan trainer makes.

    Sets ``per_device_train_batch_size`` = B (``micro_batch_size`` when given: a plan about to be re-made),
    ``gradient_accumulation_steps`` = G, ``max_steps`` = the plan's optimizer steps, ``num_train_epochs`` = 1.

    Returns:
        ``(args, packed)``: ``packed`` says the plan is packed (``allocation.packing``: micro-batches of unequal
        row counts, B then the most rows of a pack).

    Raises:
        transformers without ``Trainer.loss_is_scaled_for_ga`` (RuntimeError); ValueError as :class:`PlanTrainer`.
    """
    if not hasattr(Trainer, "loss_is_scaled_for_ga"):
        raise RuntimeError(
            f"transformers {_transformers_version()} has no Trainer.loss_is_scaled_for_ga: its Trainer would "
            f"divide the token-exact loss by gradient_accumulation_steps again; upgrade transformers"
        )
    args = copy.copy(args)
    packed = is_packed_plan(plan)
    shape = plan_shape(plan, packed=packed)
    if shape.world_size != args.world_size:
        raise ValueError(world_size_message(shape.world_size, args.world_size, "this Trainer",
                                            use_cpu=bool(args.use_cpu)))
    if args.auto_find_batch_size:
        raise ValueError("auto_find_batch_size would change the planned micro-batch size; turn it off")
    if args.n_gpu > 1:
        raise ValueError("PlanTrainer needs one process per device (n_gpu > 1 means torch DataParallel)")
    b = shape.micro_batch_size if micro_batch_size is None else int(micro_batch_size)
    if args.deepspeed and (args.per_device_train_batch_size, args.gradient_accumulation_steps) != (b, shape.grad_accum):
        raise ValueError(
            f"with DeepSpeed set per_device_train_batch_size={b} and gradient_accumulation_steps={shape.grad_accum} "
            f"(the plan's) in TrainingArguments: it fills DeepSpeed's config when it is created"
        )
    for name, value in (("per_device_train_batch_size", b), ("gradient_accumulation_steps", shape.grad_accum),
                        ("max_steps", shape.steps), ("num_train_epochs", 1)):
        if getattr(args, name) != value:
            logger.info("PlanTrainer: %s=%s from the plan (was %s)", name, value, getattr(args, name))
            setattr(args, name, value)
    return args, packed


class PlanTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on the plan: process ``args.process_index`` iterates exactly its
    rank's planned micro-batches, in plan order, over all the plan's epochs, with the token-exact weighted loss.

    What it sets from the plan, on a copy of ``args``: ``per_device_train_batch_size`` = B,
    ``gradient_accumulation_steps`` = G (the plan's ``micro_index`` count), ``max_steps`` = the plan's optimizer
    steps and ``num_train_epochs`` = 1 (one Trainer epoch is the whole plan: every epoch of the plan in order).
    With a DeepSpeed config, ``TrainingArguments`` fills DeepSpeed's batch sizes when it is created, so there
    B and G must already equal the plan's (a ``ValueError`` says so). A packed plan (``allocation.packing``, the
    default for ``strategy: cluster``; micro-batches of unequal row counts) is recognised: each micro-batch is then
    one padding-free pack (:class:`~ray_cluster_ft.integrations.torch.TokenCollator` with ``packed=True``:
    ``input_ids``, ``position_ids``, ``labels`` of shape ``(1, N)``) and the weights go onto each example's tokens.

    Args:
        model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs: as for ``Trainer``.
            ``train_dataset`` is map-style; item ``p`` is the example with id ``example_ids[p]`` and holds
            ``input_ids`` and ``labels`` (``-100`` where no loss is taken; without ``labels`` every token
            counts), e.g. :class:`~ray_cluster_ft.integrations.torch.ExamplesDataset`. ``data_collator``
            defaults to :class:`~ray_cluster_ft.integrations.torch.TokenCollator` (pad id from
            ``processing_class`` or the model config, else 0); a custom one must keep the items' labels.
        plan: the allocation plan (``plan.parquet``) for ``args.world_size`` ranks.
        example_ids: the id of each ``train_dataset`` row; default: the dataset's ``example_ids`` attribute,
            ``example_id`` column, or items' ``example_id``.
        weights: per-example loss weights indexed by ``example_id`` (``selection.parquet``'s ``weight``);
            ``None`` weighs every example 1.
        trained_log: optional path with ``{rank}``, e.g. ``"out/trained_rank{rank}.jsonl"``: one JSON line per
            trained row (``rank, step, micro_index, epoch, example_id``, the ids read from the batch), the
            schema of the project's ``trained.parquet`` (check it with
            :func:`ray_cluster_ft.train.verify_trained`). Started afresh at step 0, appended to on a resume.

    Attributes:
        plan_sampler: this rank's :class:`~ray_cluster_ft.integrations.torch.PlanBatchSampler`.
        plan_weights: its :class:`~ray_cluster_ft.integrations.torch.MicroBatchWeights`, one per micro-batch.
        trained_rows: the rows this process trained, as dicts (the same rows as ``trained_log``).

    Raises:
        ValueError: a plan for another world size, a plan or dataset the sampler rejects, ``auto_find_batch_size``,
            ``n_gpu > 1`` (``torch.nn.DataParallel``: use one process per device), a ``compute_loss_func``,
            a DeepSpeed config whose B or G differ from the plan's.
        RuntimeError (in training): a batch that is not this rank's next planned micro-batch, or labels that do
            not hold the planned label tokens (a collator that changed them).
    """

    # compute_loss returns W * S_mb / D, already normalised over the step: the Trainer must not divide by G.
    loss_is_scaled_for_ga = True

    def __init__(self, model=None, args: TrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, plan: pd.DataFrame,
                 example_ids: Sequence[Any] | None = None, weights: pd.Series | None = None,
                 trained_log: str | Path | None = None, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("PlanTrainer computes the token-exact loss itself; do not pass compute_loss_func")
        if train_dataset is None:
            raise ValueError("PlanTrainer needs the train_dataset the plan was made from")
        args, packed = plan_args(args if args is not None else TrainingArguments(output_dir="tmp_trainer"), plan)
        ids = [str(x) for x in example_ids] if example_ids is not None else _dataset_ids(train_dataset)
        if len(ids) != len(train_dataset):
            raise ValueError(f"{len(ids)} example_ids for a train_dataset of {len(train_dataset)} rows")
        # D counts every rank's rows of a step: the token table covers the whole plan, not only this rank's.
        planned = np.sort(pd.Index(ids).get_indexer(pd.unique(plan["example_id"].astype(str).to_numpy())))
        table = _token_table(train_dataset, ids, planned)
        self._attach_plan(plan, ids, table, weights, trained_log, args.process_index, packed)

        if data_collator is None:
            pad = getattr(processing_class, "pad_token_id", None)
            if pad is None:
                pad = getattr(getattr(model, "config", None), "pad_token_id", None)
            data_collator = TokenCollator(pad if pad is not None else 0, packed=packed)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        self._after_init()

    def _attach_plan(self, plan: pd.DataFrame, ids: list[str], table: pa.Table, weights, trained_log, rank: int,
                     packed: bool) -> None:
        """This rank's sampler and per-micro-batch loss weights (``D`` from ``table``, every planned row)."""
        world = plan_shape(plan, packed=packed).world_size
        self.plan = plan
        self.plan_sampler = PlanBatchSampler(plan, ids, rank, world, packed=packed)
        self.plan_weights = plan_loss_weights(plan, table, rank, weights, world, packed=packed)
        self.trained_rows: list[dict] = []
        self._plan_ids = ids
        self._trained_log = None if trained_log is None else Path(str(trained_log).format(rank=rank))
        self._next_micro = None

    def _after_init(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        self._pass_use_cache = "use_cache" in inspect.signature(model.forward).parameters
        self._keep_logits = forward_keeps_logits(model)

    # ------------------------------------------------------------------------------------------ the data

    def get_train_dataloader(self) -> DataLoader:
        """A ``DataLoader`` with this rank's :class:`PlanBatchSampler`, prepared by Accelerate for one process
        (device placement, gradient-state tracking) and never re-sharded; see the module docstring."""
        from accelerate.data_loader import prepare_data_loader

        dataset = self.train_dataset
        collator = self.data_collator
        try:  # transformers drops the columns the model's forward does not take (e.g. example_id)
            collator = self._get_collator_with_removed_columns(collator, description="training")
        except AttributeError:
            pass
        kept = getattr(collator, "signature_columns", None)
        if kept is not None and "labels" not in kept:
            # compute_loss reads the labels itself, whatever the forward takes: a forward without ``labels`` would
            # otherwise lose them here, and the collator would make labels of every input token
            collator.signature_columns = [*kept, "labels"]
        args = self.args
        workers = args.dataloader_num_workers
        loader = DataLoader(
            _Positioned(dataset),
            batch_sampler=self.plan_sampler,
            collate_fn=_PositionCollator(collator),
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers if workers > 0 else False,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )
        # num_processes=1: the batch sampler is already this rank's; Accelerate must not wrap it in
        # BatchSamplerShard (huggingface/accelerate#4075). Deliberately not passed to accelerator.prepare.
        return prepare_data_loader(loader, self.accelerator.device, num_processes=1, process_index=0,
                                   split_batches=False, put_on_device=True, rng_types=None, dispatch_batches=False,
                                   even_batches=False)

    def _planned(self, positions: list[int]) -> int:
        """Index of the planned micro-batch these positions are: one of the G of the current optimizer step
        (``state.global_step``), and the next one after the last micro-batch trained."""
        g = self.plan_sampler.grad_accum
        k = self.state.global_step
        pos = np.asarray(positions, dtype=np.int64)
        planned = self.plan_sampler.positions
        for j in range(k * g, min((k + 1) * g, len(planned))):
            if np.array_equal(planned[j], pos) and (self._next_micro is None or j == self._next_micro):
                self._next_micro = j + 1
                return j
        rank = self.plan_sampler.rank
        raise RuntimeError(
            f"rank {rank}: the batch at optimizer step {k} holds dataset rows {pos.tolist()}, not the next planned "
            f"micro-batch of that step (ids {[self._plan_ids[p] for p in pos.tolist()]}); was the train loader "
            f"re-sharded or re-ordered?"
        )

    # ------------------------------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """``W * token_exact_loss / D`` for a planned micro-batch (any other batch, e.g. evaluation, goes to
        ``Trainer.compute_loss``). Records the trained rows. Where the model's ``forward`` takes
        ``logits_to_keep`` (transformers' causal LMs), the LM head runs only at the positions whose next token is a
        label (:func:`~ray_cluster_ft.integrations.torch.loss_positions`), as in the project's own trainer: the
        same loss without the prompt's and the padding's logits. With ``return_outputs`` all logits are kept."""
        if POSITION_KEY not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        positions = inputs.pop(POSITION_KEY).tolist()
        labels = inputs.pop("labels")
        inputs.pop("example_id", None)  # kept by the collator when remove_unused_columns=False
        j = self._planned(positions)
        mw = self.plan_weights[j]
        if self._pass_use_cache:
            inputs["use_cache"] = False
        keep = None
        if self._keep_logits and not return_outputs:
            keep = inputs["logits_to_keep"] = loss_positions(labels)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        try:  # checks the labels hold the planned label tokens (D counts them); spreads weights over a pack
            loss = micro_batch_loss(logits, labels, mw, self.args.world_size, positions=keep)
        except ValueError as err:
            raise RuntimeError(f"rank {self.plan_sampler.rank}: {err}") from None
        self._record(mw, positions)
        return (loss, outputs) if return_outputs else loss

    def end(self) -> None:
        """``Trainer.end`` (trackers finished, the default process group destroyed) after all ranks meet
        (``accelerator.wait_for_everyone``). Call it on every rank, as ``Trainer.end``: a rank that calls it alone
        waits for the others until the process group's timeout, then raises (``Trainer.end`` still runs).

        Why the wait: with gloo (CPU runs) a rank's gloo worker thread can still be releasing the tensors of the
        last collective (``Trainer``'s final ``store_flos`` all-gather) when the script ends; the release needs
        the GIL, and taking it while the interpreter finalizes aborts the rank (``terminate called without an
        active exception``, SIGABRT; seen under load in the TRL example's test). gloo's barrier first waits for
        the rank's collectives in flight, with the GIL released: this narrows the race, it cannot rule it out.
        """
        try:
            self.accelerator.wait_for_everyone()
        finally:
            super().end()

    def _record(self, mw, positions: list[int]) -> None:
        rows = [{"rank": self.plan_sampler.rank, "step": mw.step, "micro_index": mw.micro_index, "epoch": mw.epoch,
                 "example_id": self._plan_ids[p]} for p in positions]
        self.trained_rows.extend(rows)
        if self._trained_log is not None:
            fresh = not hasattr(self, "_log_opened")
            self._log_opened = True
            mode = "w" if fresh and self.state.global_step == 0 and mw.micro_index == 0 else "a"
            self._trained_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self._trained_log, mode, encoding="utf-8") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in rows))
