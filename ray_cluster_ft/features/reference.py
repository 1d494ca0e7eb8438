"""Slow exact references for the gradient sketch: per-example autograd and the explicit Kronecker projection.

Independent of the factorised code in :mod:`.projection`, which must agree with them (tests), and the
fidelity measure of :mod:`bench/sketch_fidelity.py`: how well sketch cosines follow full-gradient cosines.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.collate import IGNORE_INDEX, collate
from ._sketch_ops import _check_projector, _finish, _frozen
from .projection import Projector, make_projector, sketch_batch
from .sketchers import length_batches

__all__ = [
    "weight_gradients",
    "exact_sketch",
    "sketch_fidelity",
]


def weight_gradients(
    model: nn.Module, modules: Sequence[tuple[str, nn.Linear]], input_ids: torch.Tensor, labels: torch.Tensor
) -> list[torch.Tensor]:
    """Plain per-example autograd: the gradient of one unpadded example's token-mean next-token loss (response
    tokens) w.r.t. each module's weight, the reference that sketches approximate.

    Args:
        input_ids: ``(T,)`` int64.
        labels: ``(T,)`` int64, ``-100`` at prompt tokens.

    Returns:
        Per module, ``(out_features, in_features)`` in the model's dtype.

    Raises:
        ValueError: no response token after the shift.
    """
    if not (labels[1:] != IGNORE_INDEX).any():
        raise ValueError("weight_gradients: no response token after the label shift")
    weights = [m.weight for _, m in modules]
    with _frozen(model, keep=weights), torch.enable_grad():
        logits = model(input_ids=input_ids[None], use_cache=False).logits[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX)
        return list(torch.autograd.grad(loss, weights))


def sketch_fidelity(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Linear]],
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    k_in: int,
    k_out: int,
    dims: Sequence[int],
    seed: int = 0,
    batch_size: int = 8,
) -> dict[int, dict[str, float]]:
    """How well sketch cosines approximate full-gradient cosines (the quantity clustering uses).

    For every pair of ``examples``: the cosine of their full gradients over ``modules``
    (:func:`weight_gradients`, concatenated) against the cosine of their sketches (:func:`sketch_batch` in
    length-sorted batches of ``batch_size``; one set of ``P_in``/``P_out``, then each ``dim``'s own final
    ``R``, as :func:`make_projector` draws them). Holds all full gradients in memory:
    ``len(examples) x sum(out * in)`` float32.

    Args:
        examples: ``(input_ids, labels)`` int arrays, unpadded, ``-100`` at prompt tokens.
        dims: final sketch sizes to evaluate.

    Returns:
        ``{dim: {"mae", "max_abs_error", "pearson", "reference_mad", "sketch_dim", "pairs"}}``: mean and
        largest absolute cosine error over pairs ``i < j``, the correlation of the two cosine lists, the mean
        absolute deviation of the full-gradient cosines from their mean (the error of a sketch that knew only
        the average cosine), the sketch length really used (``min(dim, n_modules * k_out * k_in)``), and the
        number of pairs.
    """
    n = len(examples)
    full = None
    dev = next(model.parameters()).device
    for i, (ids, lab) in enumerate(examples):
        g = torch.cat([t.reshape(-1).float() for t in weight_gradients(
            model, modules, torch.as_tensor(ids, device=dev), torch.as_tensor(lab, device=dev))])
        if full is None:
            full = torch.empty(n, g.numel(), dtype=torch.float32, device=dev)
        full[i] = g / g.norm().clamp_min(1e-30)
    ref = (full @ full.T).cpu().numpy()
    del full
    base = make_projector(modules, k_in, k_out, len(modules) * k_in * k_out, seed).to(dev)
    raw = torch.zeros(n, base.raw_dim, dtype=torch.float32, device=dev)
    lengths = np.asarray([len(e[0]) for e in examples])
    for idx in length_batches(lengths, batch_size):
        b = {k: torch.from_numpy(v).to(dev) for k, v in
             collate([examples[i][0] for i in idx], [examples[i][1] for i in idx]).items()}
        raw[torch.as_tensor(idx, device=dev)] = sketch_batch(model, modules, base, b["input_ids"],
                                                             b["attention_mask"], b["labels"], normalize=False)[0]
    iu = np.triu_indices(n, k=1)
    out = {}
    for d in dims:
        proj = make_projector(modules, k_in, k_out, d, seed).to(dev)
        s = _finish(raw, proj, normalize=True).cpu().numpy()
        est = (s @ s.T)[iu]
        err = np.abs(est - ref[iu])
        out[int(d)] = {"mae": float(err.mean()), "max_abs_error": float(err.max()),
                       "pearson": float(np.corrcoef(est, ref[iu])[0, 1]),
                       "reference_mad": float(np.abs(ref[iu] - ref[iu].mean()).mean()),
                       "sketch_dim": int(s.shape[1]), "pairs": int(len(err))}
    return out


def exact_sketch(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Linear]],
    projector: Projector,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    normalize: bool = True,
) -> torch.Tensor:
    """Slow reference sketch of one unpadded example, for tests.

    Per-example autograd of the token-mean next-token loss w.r.t. each module's WEIGHT ``G`` (out x in),
    then the explicit Kronecker projection ``(P_out (x) P_in) vec(G)`` (row-major ``vec``, the Kronecker
    matrix built in full), concatenation, ``R`` and optional L2 normalisation. Independent of the
    factorised code of :func:`sketch_batch`, which must agree with it.

    Args:
        input_ids: ``(T,)`` int64.
        labels: ``(T,)`` int64, ``-100`` at prompt tokens.

    Returns:
        float32 ``(projector.dim,)``.

    Raises:
        ValueError: shapes disagree or no response token after the shift.
    """
    if input_ids.ndim != 1 or input_ids.shape != labels.shape:
        raise ValueError(
            f"exact_sketch: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be (T,)"
        )
    if not (labels[1:] != IGNORE_INDEX).any():
        raise ValueError("exact_sketch: no response token after the label shift")
    _check_projector(modules, projector)
    grads = weight_gradients(model, modules, input_ids, labels)
    blocks = []
    with torch.no_grad():
        for g, p_in, p_out in zip(grads, projector.p_in, projector.p_out):
            kron = torch.kron(p_out, p_in)  # (k_out * k_in, out * in)
            blocks.append(kron @ g.to(kron.dtype).reshape(-1))
        return _finish(torch.cat(blocks)[None], projector, normalize)[0]
