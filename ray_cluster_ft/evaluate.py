"""Held-out evaluation: response-token loss and perplexity per domain.

The loss is the token-weighted mean negative log-likelihood of the response tokens (labels != -100), so a
domain's figure does not depend on how its examples are batched.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pyarrow as pa

from .train import pad_micro_batch

__all__ = ["heldout_loss", "evaluate_model_path"]


def heldout_loss(model, examples: pa.Table, batch_size: int = 8, pad_token_id: int = 0) -> dict:
    """Response-token loss per domain and overall.

    Args:
        model: a causal LM (``model(input_ids, attention_mask).logits`` of shape (B, T, V)).
        examples: rows with ``input_ids``, ``labels``, ``domain`` (``data.EXAMPLE_SCHEMA``).
        batch_size: examples per forward pass (sorted by length to cut padding).

    Returns:
        ``{domain: {"loss": float nats/token, "perplexity": float, "tokens": int, "examples": int}, ...,
        "all": {...}}``; empty dict for an empty table.
    """
    import torch

    if examples.num_rows == 0:
        return {}
    ids = examples.column("input_ids").to_pylist()
    labels = examples.column("labels").to_pylist()
    domains = examples.column("domain").to_pylist()
    order = np.argsort([len(x) for x in ids], kind="stable")
    nll: dict[str, float] = defaultdict(float)
    ntok: dict[str, int] = defaultdict(int)
    nex: dict[str, int] = defaultdict(int)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            b = pad_micro_batch([ids[i] for i in idx], [labels[i] for i in idx], pad_token_id)
            b = {k: torch.from_numpy(v).to(device) for k, v in b.items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            tgt = b["labels"][:, 1:]
            lp = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="none"
            ).view(tgt.shape)
            valid = tgt != -100
            per_ex = (lp * valid).sum(1).cpu().numpy()
            per_n = valid.sum(1).cpu().numpy()
            for j, i in enumerate(idx):
                for d in (domains[i], "all"):
                    nll[d] += float(per_ex[j])
                    ntok[d] += int(per_n[j])
                    nex[d] += 1
    model.train(was_training)
    out = {}
    for d in sorted(nll, key=lambda k: (k == "all", k)):
        loss = nll[d] / max(ntok[d], 1)
        out[d] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": ntok[d], "examples": nex[d]}
    return out


def evaluate_model_path(model_path: str, examples: pa.Table, batch_size: int = 8, pad_token_id: int = 0,
                        trust_remote_code: bool = False, num_threads: int | None = None) -> dict:
    """Load ``model_path`` (fp32 on CPU, bf16 on CUDA) and return :func:`heldout_loss` on ``examples``."""
    import torch

    from .model import load_model

    if num_threads:
        torch.set_num_threads(num_threads)
    cuda = torch.cuda.is_available()
    model = load_model(model_path, trust_remote_code=trust_remote_code,
                       dtype=torch.bfloat16 if cuda else torch.float32)
    if cuda:
        model = model.cuda()
    return heldout_loss(model, examples, batch_size=batch_size, pad_token_id=pad_token_id)
