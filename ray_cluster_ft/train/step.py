"""The training step of one rank: a planned micro-batch onto the device, forward, the token-exact loss,
backward, DeepSpeed step.

The loss of an optimizer step is ``L = sum_i w_i sum_t l_it / D`` over every label token of the step on all
ranks and micro-batches, with ``D = sum_i w_i |T_i|`` precomputed from the plan (``step_weighted_tokens``,
:func:`ray_cluster_ft.train.build_rank_tables`) and ``w_i`` the example's selection weight (1 without
``train.loss_weighting: cluster``). Every token then weighs the same whatever micro-batch it shares, so a
length-homogeneous plan and a random split optimise the same objective. DeepSpeed divides a micro-batch's loss
by ``gradient_accumulation_steps`` in ``backward`` and averages gradients over the ``W`` ranks, so each
micro-batch backpropagates ``W * G * sum_{i in mb} w_i sum_t l_it / D``: the summed gradient is ``dL``.
DeepSpeed steps the optimizer every ``G`` micro-batches (or, for the published plan's short last step of an
epoch, where the plan's boundary is set explicitly); each call here is one micro-batch.

Packed micro-batches (``allocation.packing``): the rows of a micro-batch are concatenated into one sequence
(:func:`ray_cluster_ft.data.collate.pack`) and the per-example weights become per-token weights (``w_i`` on
every label position of example ``i``), so ``sum_i w_i sum_t l_it`` and ``D`` are unchanged: a packed step
optimises exactly the loss of the padded step on the same rows.

Logits only where a loss is taken: the LM head runs on the positions whose next token is a label
(``logits_positions``, found on the host by :func:`collate_micro_batch`, passed as transformers'
``logits_to_keep``), not on prompt tokens or padding. The loss is the same sum over the same tokens; the
``(B, T, V)`` logits, the largest activation of a fine-tuning step at a 50k-150k vocabulary, shrink to
``(B, K, V)``.
"""

from __future__ import annotations

import time

import numpy as np

from ..data.collate import IGNORE_INDEX, collate, logits_positions, pack
from ..model import forward_keeps_logits

__all__ = ["FLASH_VARLEN_KEYS", "ForwardTimer", "collate_micro_batch", "micro_batch_to_device", "to_device",
           "token_exact_loss", "train_micro_batch"]

FLASH_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The keyword arguments of a packed micro-batch that flash-attention varlen reads (transformers'
``FlashAttentionKwargs``)."""


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


def collate_micro_batch(batch: dict[str, np.ndarray], pad_token_id: int, device, packed: bool = False,
                        flash_attn_kwargs: bool = False) -> dict:
    """Collate one planned micro-batch (ragged ``input_ids`` and ``labels``) into host tensors, pinned when
    ``device`` is CUDA so that :func:`to_device` copies them asynchronously. Host-only work: the training loop runs
    it on a background thread, one micro-batch ahead of the step (:func:`ray_cluster_ft.train.loop._prefetch`).

    Args:
        batch: ``input_ids``, ``labels`` (B ragged rows) and optionally ``weight`` (B,).
        pad_token_id: the id right-padding writes (unpacked only).
        device: the torch device.
        packed: concatenate the rows into one sequence (:func:`ray_cluster_ft.data.collate.pack`) instead of
            padding them.
        flash_attn_kwargs: with ``packed``, add the flash-attention varlen arguments (:data:`FLASH_VARLEN_KEYS`)
            so ``flash_attention_2`` does not infer them from ``position_ids`` in every layer.

    Returns:
        Unpacked: ``input_ids``, ``attention_mask``, ``labels``: int64 torch tensors ``(B, T)``; ``weight``:
        float32 ``(B,)`` (ones when the batch has no ``weight`` column). Packed: ``input_ids``,
        ``position_ids``, ``labels``: int64 ``(1, N)`` with ``N = sum_i L_i``, no ``attention_mask``;
        ``weight``: float32 ``(1, N)``, the row's weight on each of its tokens; plus the int32
        ``cu_seq_lens_q/k`` and int ``max_length_q/k`` when asked. Both: ``logits_positions``, int64 ``(K,)``
        (:func:`ray_cluster_ft.data.collate.logits_positions`). All tensors on the host (pinned for CUDA).
    """
    import torch

    w = batch.get("weight")
    w = (np.ones(len(batch["input_ids"])) if w is None else np.asarray(w)).astype(np.float32)
    if packed:
        host = pack(batch["input_ids"], batch["labels"], flash_attn_kwargs=flash_attn_kwargs)
        host["weight"] = np.repeat(w, host.pop("lengths"))[None, :]
    else:
        host = collate(batch["input_ids"], batch["labels"], pad_token_id)
        host["weight"] = w
    host["logits_positions"] = logits_positions(host["labels"])
    ints = {k: host.pop(k) for k in ("max_length_q", "max_length_k") if k in host}
    cuda = getattr(device, "type", str(device)) == "cuda"
    # Pinned host memory lets the copies run asynchronously; the forward waits for them on the stream.
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in host.items()}
    return {**({k: t.pin_memory() for k, t in tensors.items()} if cuda else tensors), **ints}


def to_device(host: dict, device) -> dict:
    """The tensors of :func:`collate_micro_batch` on ``device`` (non-blocking copies from pinned memory on CUDA;
    the same dict on the CPU); plain ints stay as they are."""
    if getattr(device, "type", str(device)) != "cuda":
        return host
    return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in host.items()}


def micro_batch_to_device(batch: dict[str, np.ndarray], pad_token_id: int, device, packed: bool = False,
                          flash_attn_kwargs: bool = False) -> dict:
    """:func:`collate_micro_batch` then :func:`to_device`: one planned micro-batch as tensors on ``device``
    (the shapes and dtypes of :func:`collate_micro_batch`)."""
    return to_device(collate_micro_batch(batch, pad_token_id, device, packed, flash_attn_kwargs), device)


def token_exact_loss(logits, labels, weight, positions=None):
    """``sum_i w_i sum_t l_it`` of one micro-batch: the weighted sum of next-token cross-entropies over its
    label tokens.

    Args:
        logits: ``(B, T, V)``, or ``(B, K, V)`` at ``positions`` only (any float dtype; the cross-entropy runs in
            float32).
        labels: int64 ``(B, T)``, ``-100`` where no loss is taken; position t predicts ``labels[t + 1]``.
        weight: float ``(B,)`` per-example weights, or ``(B, T)`` per-token weights aligned with ``labels`` (a
            packed micro-batch: the weight of label ``t`` is that of the example holding token ``t``).
        positions: int64 ``(K,)`` on the logits' device, the positions ``logits`` holds
            (:func:`ray_cluster_ft.data.collate.logits_positions`: every label of ``labels`` is at one of
            them), or ``None`` for all ``T``.

    Returns:
        A float32 scalar tensor (nats, summed, not averaged).
    """
    import torch.nn.functional as F

    if positions is None:
        tgt, logits = labels[:, 1:], logits[:, :-1]
        w = weight[:, 1:] if weight.dim() == 2 else weight
    else:
        tgt = labels.index_select(1, positions + 1)
        w = weight.index_select(1, positions + 1) if weight.dim() == 2 else weight
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(tgt.shape)
    if w.dim() == 2:
        return (ce * w.float()).sum()
    return (ce.sum(dim=1) * w.float()).sum()


def train_micro_batch(engine, mb: dict, scale: float, timer: ForwardTimer | None = None,
                      boundary: bool | None = None):
    """Forward, token-exact loss, backward and ``engine.step()`` of one micro-batch. Nothing here waits for the
    device: the loss stays a device tensor, and the forward is timed by ``timer``'s events.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` wrapping a Hugging Face causal LM.
        mb: from :func:`micro_batch_to_device` (padded: with ``attention_mask``; packed: with ``position_ids``
            and no mask, so the model builds the block-causal mask, see :func:`ray_cluster_ft.data.collate.pack`).
            Its ``logits_positions`` become ``logits_to_keep`` where the model's ``forward`` takes it (all
            logits are computed otherwise, and for a batch without the key).
        scale: ``W * G / D`` for this micro-batch's step (see the module docstring).
        timer: times the forward (:class:`ForwardTimer`), or ``None``.
        boundary: whether this micro-batch ends its optimizer step, set on the engine before the forward
            (``engine.set_gradient_accumulation_boundary``, DeepSpeed's documented override of its micro-step
            counter) for a plan whose last step of an epoch holds fewer than G micro-batches; ``None`` leaves the
            counter to decide (every G micro-batches). ``scale`` stays ``W * G / D`` either way: DeepSpeed divides
            every micro-batch's loss by the configured G, whatever the step's micro-batch count.

    Returns:
        The detached ``sum_{i in mb} w_i sum_t l_it`` (divided by ``D`` and summed over micro-batches and ranks
        it is the step's loss), a scalar tensor on the device.
    """
    if boundary is not None:
        engine.set_gradient_accumulation_boundary(bool(boundary))
    if timer is not None:
        timer.start()
    extra = {k: mb[k] for k in ("attention_mask", "position_ids", *FLASH_VARLEN_KEYS) if k in mb}
    positions = mb.get("logits_positions")
    if positions is not None and forward_keeps_logits(engine.module):
        extra["logits_to_keep"] = positions
    else:
        positions = None
    logits = engine(input_ids=mb["input_ids"], **extra, use_cache=False).logits
    total = token_exact_loss(logits, mb["labels"], mb["weight"], positions)
    if timer is not None:
        timer.stop()
    engine.backward(total * scale)
    engine.step()
    return total.detach()
