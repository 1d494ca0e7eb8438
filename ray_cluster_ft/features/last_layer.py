"""CluSTER's last-layer gradient proxy: one inference-mode forward, no backward (the maths; no Ray, no I/O).

For the output head ``logits_t = W h_t`` the gradient of the cross-entropy of the true next token ``y_t``
w.r.t. ``W`` is ``(softmax(logits_t) - e_{y_t}) h_t^T``; its row ``y_t`` is ``(p_theta(y_t | x_<t) - 1) h_t``.
CluSTER (Kim et al., EMNLP 2026, arXiv 2609.12584; official code kaist-dmlab/CluSTER,
``src/CluSTER/call_back.py``, ``jvp_proxy_raw``) clusters the token mean of that row::

    g_i = (1 / |T_i|) * sum_{t in T_i} (p_theta(y_t | x_<t) - 1) * h_t          (hidden_size,)

with ``T_i`` the response positions of example ``i`` (``labels[t + 1] != -100``) and ``h_t`` the final hidden
state at the position that predicts ``y_t``. The published code then either L2-normalises the rows (more than
one GPU) or subtracts their mean over all examples (one GPU); :func:`normalise_last_layer` does that on the
driver, after every shard is read back, so shards hold the raw ``g_i`` and do not depend on the world size
(docs/design.md, "Features").
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.collate import IGNORE_INDEX

__all__ = ["last_layer_features", "normalise_last_layer"]


def _valid_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                     check_inputs: bool = True) -> torch.Tensor:
    """``(B, T - 1)`` bool: position ``t`` is real and predicts a response token ``labels[t + 1]``.

    ``check_inputs=False`` skips the two value checks, each a device-to-host sync on a GPU; the sketchers
    make them on the host arrays before upload.

    Raises:
        ValueError: shapes disagree, a padding token carries a label, or a row has no such position.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape or input_ids.shape != labels.shape:
        raise ValueError(
            f"last_layer_features: input_ids {tuple(input_ids.shape)}, attention_mask "
            f"{tuple(attention_mask.shape)} and labels {tuple(labels.shape)} must be the same (B, T)"
        )
    mask = attention_mask.to(torch.bool)
    if check_inputs and (labels[~mask] != IGNORE_INDEX).any():
        raise ValueError("last_layer_features: a padding token (attention_mask 0) has a label other than -100")
    # Under left padding the first real token's label would be "predicted" from a pad position, which an
    # unpadded run never does: only real predicting positions count (as in projection.sketch_batch).
    valid = (labels[:, 1:] != IGNORE_INDEX) & mask[:, :-1]
    empty = valid.sum(dim=1) == 0
    if check_inputs and empty.any():
        bad = torch.nonzero(empty).flatten().tolist()
        raise ValueError(f"last_layer_features: rows {bad} have no response token after the label shift")
    return valid


def _head_inputs_and_logits(model: nn.Module, input_ids, attention_mask, sel) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states ``(n, H)`` and logits ``(n, V)`` at the selected ``(row, position)`` pairs ``sel``.

    With a plain ``nn.Linear`` head a forward pre-hook keeps only the selected rows of the head's input, so
    the head (for a 50k vocabulary often the largest single matmul) runs on ``n`` rows instead of ``B * T``;
    that input is ``hidden_states[-1]`` (checked in the tests). Otherwise the full outputs are sliced.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)  # padding side does not matter
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    if not isinstance(head, nn.Linear):
        out = model(**kwargs, output_hidden_states=True)
        return out.hidden_states[-1][:, :-1][sel], out.logits[:, :-1][sel]
    kept: list[torch.Tensor] = []

    def pre_hook(mod: nn.Module, args: tuple) -> tuple:
        kept.append(args[0][:, :-1][sel])
        return (kept[-1],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        out = model(**kwargs)
    finally:
        handle.remove()
    logits = out.logits if hasattr(out, "logits") else out[0]
    if len(kept) != 1 or logits.ndim != 2 or logits.shape[0] != kept[0].shape[0]:
        raise ValueError(f"last_layer_features: unexpected head calls ({len(kept)}) or logits {tuple(logits.shape)}")
    return kept[0], logits


def last_layer_features(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CluSTER's per-example last-layer gradient proxy ``g_i`` of a padded batch, one forward, no backward.

    ``g_i = mean_{t in T_i} (p_theta(y_t | x_<t) - 1) h_t`` (see the module docstring; arXiv 2609.12584 and
    its code's ``jvp_proxy_raw``), raw: not normalised, not centred. ``T_i``: real positions ``t`` whose next
    label ``labels[t + 1]`` is not ``-100``. Position ids come from the attention mask, so left and right
    padding give the same result, and an example's row does not depend on its batch mates. Runs under
    ``torch.inference_mode()`` in the model's dtype (or an active autocast); logits are upcast to at least
    float32 before the softmax, and the sums run in at least float32. Dropout is not switched off here: call
    ``model.eval()`` first.

    Args:
        model: Hugging Face causal LM (called with ``input_ids``, ``attention_mask``, ``position_ids``).
        input_ids: ``(B, T)`` int64 token ids.
        attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding (either side).
        labels: ``(B, T)`` int64, ``-100`` at prompt and padding tokens.
        check_inputs: check on the device that padding carries no label and every row has a response token
            (False when the caller checked the host arrays: the checks cost a sync each on a GPU).

    Returns:
        ``(features, losses)``: float32 ``(B, H)`` (``H`` = the head's input size, the hidden size) and
        float32 ``(B,)``, each example's mean next-token cross-entropy over ``T_i`` (nats per token). Ordinary
        tensors (not inference tensors), on the inputs' device.

    Raises:
        ValueError: shapes disagree, a padding token carries a label, or an example has no response token
            after the shift.
    """
    valid = _valid_positions(input_ids, attention_mask, labels, check_inputs)
    with torch.inference_mode():
        sel = valid.nonzero(as_tuple=True)  # (rows, positions) with a loss, row-major
        h, logits = _head_inputs_and_logits(model, input_ids, attention_mask, sel)
        dtype = torch.promote_types(h.dtype, torch.float32)  # bf16 sums would lose the small terms
        ce = F.cross_entropy(logits.to(dtype), labels[:, 1:][sel], reduction="none")  # -log p_theta(y_t)
        coeff = torch.exp(-ce) - 1.0  # p_theta(y_t) - 1, in [-1, 0)
        n = valid.sum(dim=1).to(dtype)
        feats = torch.zeros(len(input_ids), h.shape[-1], dtype=dtype, device=h.device)
        feats.index_add_(0, sel[0], coeff.unsqueeze(-1) * h.to(dtype))
        losses = torch.zeros(len(input_ids), dtype=dtype, device=h.device).index_add_(0, sel[0], ce)
        feats, losses = (feats / n.unsqueeze(-1)).float(), (losses / n).float()
    # Inference tensors cannot enter autograd later; a clone outside the mode is cheap at (B, H).
    return feats.clone(), losses.clone()


def normalise_last_layer(features: np.ndarray, world_size: int) -> np.ndarray:
    """The published normalisation of the raw last-layer features, which depends on the world size.

    ``world_size > 1``: each row divided by its L2 norm (the code's ``jvp_proxy_normalized``); ``== 1``: the
    mean over all rows subtracted from every row (``remove_mean``). Applied by the feature stage on the
    driver to all candidates at once, so the shards stay independent of the world size.

    Args:
        features: float ``(N, H)`` raw ``g_i`` of every candidate.
        world_size: ``train.num_workers`` (>= 1).

    Returns:
        float32 ``(N, H)``, a new array.

    Raises:
        ValueError: ``features`` is not 2-D or ``world_size < 1``.
    """
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or world_size < 1:
        raise ValueError(f"normalise_last_layer: features {x.shape} must be (N, H), world_size {world_size} >= 1")
    if world_size == 1:
        return (x - x.mean(axis=0, keepdims=True)).astype(np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, np.finfo(np.float64).tiny)).astype(np.float32)
