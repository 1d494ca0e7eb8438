"""The RDS+ feature: the sketch model's final hidden state pooled over a row's tokens, one forward, no LM head
(the maths; no Ray, no I/O).

Ivison et al. 2025, "Large-Scale Data Selection for Instruction Tuning" (arXiv 2503.01807), select with RDS+:
each example is represented by the position-weighted mean of a language model's final hidden states over its
tokens, the pooling of SGPT (Muennighoff 2022, "SGPT: GPT Sentence Embeddings for Semantic Search", arXiv
2202.08904): token ``t = 0..n-1`` of a row of ``n`` real tokens weighs

    w_t = (t + 1) / sum_{s=0}^{n-1} (s + 1) = 2 (t + 1) / (n (n + 1)),

so later tokens, which in a causal LM have attended to more of the row, count more; ``pooling: mean`` weighs
every token ``1 / n``. The pooled rows are L2-normalised (no centring): clustering compares them by cosine.

The base transformer is called (``model.get_decoder()``, else ``model.base_model``), whose
``last_hidden_state`` is, for Llama-style models, the output of the final norm: what the LM head reads and
what ``output_hidden_states=True`` returns as ``hidden_states[-1]``. No logits are computed: the LM head of a
small model (vocabulary 49,152 x hidden 576 for SmolLM2-135M) is a large share of its forward
(docs/benchmarks.md has the figure from ``bench/sketch_throughput.py``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["base_transformer", "hidden_mean_features", "pooling_weights"]


def base_transformer(model: nn.Module) -> nn.Module:
    """The transformer under a causal LM's head: ``model.get_decoder()`` (Hugging Face causal LMs), else
    ``model.base_model``.

    Raises:
        ValueError: the model has neither (or only itself), so the head could not be left out.
    """
    get = getattr(model, "get_decoder", None)
    base = get() if callable(get) else None
    if base is None or base is model:
        base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ValueError(f"hidden_mean_features: {type(model).__name__} has no base transformer (get_decoder() or "
                         f"base_model) to run without its LM head")
    return base


def pooling_weights(attention_mask: torch.Tensor, pooling: str, check_inputs: bool = True) -> torch.Tensor:
    """Per-token pooling weights of a padded batch, float32 ``(B, T)``, each row summing to 1 over its real tokens.

    ``weighted``: the ``t``-th real token of a row (``t = 0..n-1``, counted along the mask, so either padding
    side works) weighs ``(t + 1) / (n (n + 1) / 2)``; ``mean``: ``1 / n``. Padding weighs 0. ``check_inputs=False``
    skips the check for empty rows (a device-to-host sync on a GPU; the sketchers check the host arrays).

    Raises:
        ValueError: an unknown ``pooling`` or a row without real tokens.
    """
    m = attention_mask.to(torch.float32)
    if pooling == "weighted":
        w = m * m.cumsum(dim=1)
    elif pooling == "mean":
        w = m
    else:
        raise ValueError(f"hidden_mean_features: pooling must be 'weighted' or 'mean', got {pooling!r}")
    total = w.sum(dim=1, keepdim=True)
    if check_inputs and bool((total == 0).any()):
        raise ValueError("hidden_mean_features: a row has no real token (attention_mask all 0)")
    return w / total


def hidden_mean_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         pooling: str = "weighted", check_inputs: bool = True) -> torch.Tensor:
    """The RDS+ feature of every row of a padded batch: final hidden states pooled over the row's real tokens
    (prompt and response alike; see the module docstring, Ivison et al. 2025, arXiv 2503.01807), L2-normalised.

    One forward of :func:`base_transformer` under ``torch.inference_mode()`` (no LM head, no logits), with
    position ids from the attention mask, so left and right padding give the same rows and a row does not
    depend on its batch mates (up to float rounding). Runs in the model's dtype or an active autocast; the
    pooling sums run in float32. Dropout is not switched off here: call ``model.eval()`` first.

    Args:
        model: Hugging Face causal LM (its base transformer is called with ``input_ids``, ``attention_mask``,
            ``position_ids``).
        input_ids: ``(B, T)`` int64 token ids.
        attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding (either side).
        pooling: ``weighted`` (RDS+) or ``mean``.
        check_inputs: check on the device that every row has a real token (False when the caller checked).

    Returns:
        float32 ``(B, H)`` unit rows (``H`` the hidden size), an ordinary tensor (not an inference tensor), on the
        inputs' device.

    Raises:
        ValueError: shapes disagree, an unknown pooling, a row without real tokens, or no base transformer.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"hidden_mean_features: input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must be the same (B, T)")
    weights = pooling_weights(attention_mask, pooling, check_inputs)
    base = base_transformer(model)
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    with torch.inference_mode():
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        pooled = torch.einsum("bt,bth->bh", weights.to(hidden.device), hidden.float())
        pooled = pooled / pooled.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    # Inference tensors cannot enter autograd later; a clone outside the mode is cheap at (B, H).
    return pooled.clone()
