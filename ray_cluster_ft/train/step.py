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

import numpy as np

from ..data.collate import IGNORE_INDEX, collate

__all__ = ["ForwardTimer", "micro_batch_to_device", "token_exact_loss", "train_micro_batch"]


class ForwardTimer:
    """Seconds spent in the forward passes of one step, without a host sync per micro-batch: on CUDA a pair of
    events per forward, read once at the end of the step (:meth:`take`); on the CPU the wall clock."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._pairs: list = []
        self._cpu_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            import torch

            self._pairs.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
            self._pairs[-1][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._pairs[-1][1].record()
        else:
            self._cpu_s += time.perf_counter() - self._t0

    def take(self) -> float:
        """The forward seconds since the last call (waits for the last recorded event on CUDA)."""
        if self.cuda:
            if self._pairs:
                self._pairs[-1][1].synchronize()
            out = sum(a.elapsed_time(b) for a, b in self._pairs) / 1000.0
            self._pairs = []
            return out
        out, self._cpu_s = self._cpu_s, 0.0
        return out


def micro_batch_to_device(batch: dict[str, np.ndarray], pad_token_id: int, device) -> dict:
    """Collate one planned micro-batch (ragged ``input_ids`` and ``labels``) and move it to ``device``.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels``: int64 torch tensors ``(B, T)``; ``weight``: float32
        ``(B,)`` (ones when the batch has no ``weight`` column); all on ``device``.
    """
    import torch

    host = collate(batch["input_ids"], batch["labels"], pad_token_id)
    w = batch.get("weight")
    host["weight"] = (np.ones(len(batch["input_ids"])) if w is None else np.asarray(w)).astype(np.float32)
    if getattr(device, "type", str(device)) != "cuda":
        return {k: torch.from_numpy(v) for k, v in host.items()}
    # Pinned host memory lets the copies run asynchronously; the forward waits for them on the stream.
    return {k: torch.from_numpy(v).pin_memory().to(device, non_blocking=True) for k, v in host.items()}


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


def train_micro_batch(engine, mb: dict, scale: float, timer: ForwardTimer | None = None):
    """Forward, token-exact loss, backward and ``engine.step()`` of one micro-batch. Nothing here waits for the
    device: the loss stays a device tensor, and the forward is timed by ``timer``'s events.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` wrapping a Hugging Face causal LM.
        mb: from :func:`micro_batch_to_device`.
        scale: ``W * G / D`` for this micro-batch's step (see the module docstring).
        timer: times the forward (:class:`ForwardTimer`), or ``None``.

    Returns:
        The detached ``sum_{i in mb} w_i sum_t l_it`` (divided by ``D`` and summed over micro-batches and ranks
        it is the step's loss), a scalar tensor on the device.
    """
    if timer is not None:
        timer.start()
    logits = engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    total = token_exact_loss(logits, mb["labels"], mb["weight"])
    if timer is not None:
        timer.stop()
    engine.backward(total * scale)
    engine.step()
    return total.detach()
