"""Use the plan from your own trainer: each rank trains exactly its planned micro-batches, in plan order, with the
selection weights and the token-exact loss (docs/design.md, "Train"; README, "Use it from your own trainer").

- :mod:`.torch`: :class:`~.torch.PlanBatchSampler` for ``DataLoader(batch_sampler=...)``,
  :func:`~.torch.plan_loss_weights` (per micro-batch: weights and the step's token denominator) and
  :func:`~.torch.micro_batch_loss` (with :func:`~.torch.loss_positions`, logits only where a label follows);
  :class:`~.torch.ExamplesDataset` and :class:`~.torch.TokenCollator` for
  ``examples.parquet`` rows.
- :mod:`.hf`: :class:`~.hf.PlanTrainer`, a ``transformers.Trainer`` whose train loader Accelerate does not
  re-shard.
- :mod:`.trl`: :class:`~.trl.PlanSFTTrainer`, a TRL ``SFTTrainer`` on the plan, re-planned for TRL's own token
  counts; :func:`~.trl.selected_dataset`, a run's planned rows in TRL's prompt-completion form.
- :mod:`.ray_train`: :func:`~.ray_train.plan_datasets`, :func:`~.ray_train.plan_data_config` and
  :func:`~.ray_train.rank_shard` for a ``ray.train.torch.TorchTrainer``.

The names below are imported lazily (``from ray_cluster_ft.integrations import PlanBatchSampler`` loads
``.torch`` only), so importing this package pulls in neither transformers nor Ray.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ExamplesDataset": "torch",
    "MicroBatchWeights": "torch",
    "PlanBatchSampler": "torch",
    "PlanShape": "torch",
    "TokenCollator": "torch",
    "is_packed_plan": "torch",
    "loss_positions": "torch",
    "replan": "torch",
    "micro_batch_loss": "torch",
    "plan_loss_weights": "torch",
    "plan_shape": "torch",
    "PlanTrainer": "hf",
    "PlanSFTTrainer": "trl",
    "selected_dataset": "trl",
    "plan_data_config": "ray_train",
    "plan_datasets": "ray_train",
    "rank_shard": "ray_train",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
