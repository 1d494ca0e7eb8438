"""The training step of one rank: a planned micro-batch onto the device, forward, backward, DeepSpeed step.

DeepSpeed steps the optimizer every ``gradient_accumulation_steps`` micro-batches; each call here is one
micro-batch. The loss is the model's own: the mean over the micro-batch's label tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..data.collate import collate

__all__ = ["micro_batch_to_device", "train_micro_batch"]


def micro_batch_to_device(batch: dict[str, np.ndarray], pad_token_id: int, device) -> dict:
    """Collate one planned micro-batch (ragged ``input_ids`` and ``labels``) and move it to ``device``.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels``: int64 torch tensors ``(B, T)`` on ``device``.
    """
    import torch

    return {k: torch.from_numpy(v).to(device) for k, v in
            collate(batch["input_ids"], batch["labels"], pad_token_id).items()}


def train_micro_batch(engine, mb: dict, sync: Callable[[], None] = lambda: None) -> tuple:
    """Forward, backward and ``engine.step()`` of one micro-batch.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` wrapping a Hugging Face causal LM.
        mb: from :func:`micro_batch_to_device`.
        sync: waits for the device, so the forward's wall time can be read (a no-op on the CPU).

    Returns:
        ``(loss, forward_seconds)``: the detached scalar loss tensor (nats per label token) and the forward's
        wall time.
    """
    t_f = time.perf_counter()
    loss = engine(**mb, use_cache=False).loss
    sync()
    fwd_s = time.perf_counter() - t_f
    engine.backward(loss)
    engine.step()
    return loss.detach(), fwd_s
