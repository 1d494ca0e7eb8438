"""The training step of one rank: a planned micro-batch onto the device, forward, the token-exact loss,
backward, DeepSpeed step.

The loss of an optimizer step is ``L = sum_i w_i sum_t l_it / D`` over every label token of the step on all
ranks and micro-batches, with ``D = sum_i w_i |T_i|`` precomputed from the plan (``step_weighted_tokens``,
:func:`ray_cluster_ft.train.build_rank_tables`) and ``w_i`` the example's selection weight (1 without
``train.loss_weighting: cluster``). Every token then weighs the same whatever micro-batch it shares, so a
length-homogeneous plan and a random split optimise the same objective. DeepSpeed divides a micro-batch's loss
by ``gradient_accumulation_steps`` in ``backward`` and averages gradients over the ``W`` ranks, so each
micro-batch backpropagates ``W * G * sum_{i in mb} w_i sum_t l_it / D``: the summed gradient is ``dL``.
DeepSpeed steps the optimizer every ``G`` micro-batches; each call here is one micro-batch.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..data.collate import IGNORE_INDEX, collate

__all__ = ["micro_batch_to_device", "token_exact_loss", "train_micro_batch"]


def micro_batch_to_device(batch: dict[str, np.ndarray], pad_token_id: int, device) -> dict:
    """Collate one planned micro-batch (ragged ``input_ids`` and ``labels``) and move it to ``device``.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels``: int64 torch tensors ``(B, T)``; ``weight``: float32
        ``(B,)`` (ones when the batch has no ``weight`` column); all on ``device``.
    """
    import torch

    out = {k: torch.from_numpy(v).to(device) for k, v in
           collate(batch["input_ids"], batch["labels"], pad_token_id).items()}
    w = batch.get("weight")
    w = np.ones(len(batch["input_ids"])) if w is None else np.asarray(w)
    out["weight"] = torch.from_numpy(w.astype(np.float32)).to(device)
    return out


def token_exact_loss(logits, labels, weight):
    """``sum_i w_i sum_t l_it`` of one micro-batch: the weighted sum of next-token cross-entropies over its
    label tokens.

    Args:
        logits: ``(B, T, V)`` (any float dtype; the cross-entropy runs in float32).
        labels: int64 ``(B, T)``, ``-100`` where no loss is taken; position t predicts ``labels[t + 1]``.
        weight: float ``(B,)`` per-example weights.

    Returns:
        A float32 scalar tensor (nats, summed, not averaged).
    """
    import torch.nn.functional as F

    tgt = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(tgt.shape)
    return (ce.sum(dim=1) * weight.float()).sum()


def train_micro_batch(engine, mb: dict, scale: float, sync: Callable[[], None] = lambda: None) -> tuple:
    """Forward, token-exact loss, backward and ``engine.step()`` of one micro-batch.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` wrapping a Hugging Face causal LM.
        mb: from :func:`micro_batch_to_device`.
        scale: ``W * G / D`` for this micro-batch's step (see the module docstring).
        sync: waits for the device, so the forward's wall time can be read (a no-op on the CPU).

    Returns:
        ``(weighted_sum, forward_seconds)``: the detached ``sum_{i in mb} w_i sum_t l_it`` (divided by ``D`` and
        summed over micro-batches and ranks it is the step's loss) and the forward's wall time.
    """
    t_f = time.perf_counter()
    logits = engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    total = token_exact_loss(logits, mb["labels"], mb["weight"])
    sync()
    fwd_s = time.perf_counter() - t_f
    engine.backward(total * scale)
    engine.step()
    return total.detach(), fwd_s
