"""Held-out figures per epoch and the best epoch (``evaluation.every_epoch``): pure functions of the scores
the evaluation stage returns.

Papers on data selection report each held-out benchmark and their mean, every benchmark weighing the same (a
macro mean), scored at the best epoch: users keep the best checkpoint. The token-weighted mean beside it lets a
long file decide; both are given.
"""

from __future__ import annotations

import math

__all__ = ["best_epoch", "held_out_losses"]


def _loss(metrics: dict) -> tuple[float, int] | None:
    a = (metrics or {}).get("all", {})
    loss, tokens = a.get("loss"), a.get("tokens")
    if loss is None or not tokens or not math.isfinite(float(loss)):
        return None
    return float(loss), int(tokens)


def held_out_losses(split: dict, files: dict) -> dict:
    """The run's held-out loss two ways.

    Args:
        split: the held-out split's metrics (``{"all": {"loss", "tokens", ...}, ...}``), or ``{}``.
        files: ``{path: metrics}`` of the ``evaluation.paths`` files.

    Returns:
        ``{"macro_loss": mean over the files of each file's response-token loss (nats/token), "token_loss":
        the files' losses weighted by their tokens, "basis": "files"}``; without any scored file, both are the
        held-out split's loss and ``basis`` is ``"split"``; ``None`` values when nothing was scored.
    """
    per_file = [v for v in (_loss(m) for m in files.values()) if v is not None]
    if per_file:
        macro = sum(lo for lo, _ in per_file) / len(per_file)
        token = sum(lo * n for lo, n in per_file) / sum(n for _, n in per_file)
        return {"macro_loss": macro, "token_loss": token, "basis": "files"}
    own = _loss(split)
    return {"macro_loss": own[0] if own else None, "token_loss": own[0] if own else None, "basis": "split"}


def best_epoch(epochs: list[dict]) -> int | None:
    """The epoch (its ``"epoch"`` value) with the lowest ``"macro_loss"``; the earlier one on a tie; None when no
    epoch has a loss."""
    scored = [(e["macro_loss"], e["epoch"]) for e in epochs if e.get("macro_loss") is not None]
    return min(scored)[1] if scored else None
