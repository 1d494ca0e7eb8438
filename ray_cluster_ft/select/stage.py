"""The select stage's edge: the job config's ``selection`` section applied to the candidates (no artifact of its
own: ``selection.parquet`` is written by the allocation stage, after the plan rounds the budget to whole steps)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import ConfigError
from .quotas import SelectionResult, select, token_budget_count

__all__ = ["SelectOutput", "run", "select_with_config"]


@dataclass(frozen=True)
class SelectOutput:
    """What the select stage hands on.

    Attributes:
        requested: the rows asked for (the budget's count; K x m for ``equalize``; with ``selection.budget_tokens``
            the rows picked).
        result: the :class:`~ray_cluster_ft.select.quotas.SelectionResult` (indices into the candidates, reasons).
        tokens_requested: with ``selection.budget_tokens``, the tokens asked for; else None.
    """

    requested: int
    result: SelectionResult
    tokens_requested: Optional[int] = None

    @property
    def summary(self) -> dict:
        """``{"requested", "tokens_requested"}``, and with ``selection.groups`` ``"groups"``: the group of every
        cluster and ``"group_quotas"``, what each group was given (rows, or tokens with a token budget). The
        manifest's ``budget`` takes them."""
        out = {"requested": int(self.requested), "tokens_requested": self.tokens_requested}
        r = self.result
        if r.groups is not None:
            quotas = r.token_quotas if r.token_quotas is not None else r.quotas
            out["groups"] = r.groups.tolist()
            out["group_quotas"] = np.bincount(r.groups, weights=quotas).astype(np.int64).tolist()
        return out


def run(cfg, run_dir: Path, *, n_candidates: int, sketches=None, labels=None, dist=None,
        n_tokens=None) -> SelectOutput:
    """The select stage: ``selection.strategy`` over the candidates, at ``selection.budget`` (``balanced``,
    ``random``) or, for ``equalize``, K x m rows (m = floor(``selection.ratio`` x the smallest cluster); one cluster is kept whole).

    Writes nothing: which selected rows are trained is fixed by the plan (the budget is rounded down to whole
    optimizer steps there), so ``selection.parquet`` is written by the allocation stage.

    Args:
        cfg: the job config (``selection`` section).
        run_dir: the run directory (unused: no artifact of its own).
        n_candidates: N.
        sketches, labels, dist: the features ``(N, d)``, clusters ``(N,)`` and distances ``(N,)``; ``None``
            when no clustering ran (``random`` and ``full`` need none).
        n_tokens: int ``(N,)`` tokens per candidate; needed with ``selection.budget_tokens``.

    Returns:
        :class:`SelectOutput`; its ``requested`` is the budget's count, or K x m for ``equalize``.

    Raises:
        ConfigError: ``equalize`` without clusters, or with m rounding down to 0; a token budget that selects
            fewer examples than one optimizer step needs.
    """
    return select_with_config(cfg, n_candidates=n_candidates, sketches=sketches, labels=labels, dist=dist,
                              n_tokens=n_tokens)


def select_with_config(cfg, *, n_candidates: int, sketches=None, labels=None, dist=None,
                       n_tokens=None, groups=None) -> SelectOutput:
    """The whole of :func:`run` (which writes nothing) as a pure function of the job config, also called by
    :func:`ray_cluster_ft.select_and_plan`. Arguments, result and errors as :func:`run`; ``groups``: int64 (k,)
    the cluster groups of ``selection.groups`` computed already (the streamed selection), else None."""
    from ..config import budget_count

    s = cfg.selection
    if s.strategy == "equalize":
        if labels is None or dist is None:
            raise ConfigError("selection.strategy 'equalize' cuts every cluster to the same size: it needs the "
                              "clustering stage to run (no clusters were computed)")
        res = select("equalize", sketches, labels, dist, within=s.within, dedup_threshold=s.dedup_threshold,
                     seed=s.seed, ratio=s.ratio)
        return SelectOutput(int(res.indices.size), res)
    if sketches is None:
        sketches = np.zeros((n_candidates, 1), dtype=np.float32)
        labels = np.zeros(n_candidates, dtype=np.int64)
        dist = np.zeros(n_candidates, dtype=np.float32)
    if s.budget_tokens is not None and s.strategy in ("balanced", "random"):
        if n_tokens is None:
            raise ConfigError("selection.budget_tokens counts tokens: the select stage needs the candidates' "
                              "n_tokens")
        want = token_budget_count(s.budget_tokens, int(np.asarray(n_tokens, dtype=np.int64).sum()))
        res = select(s.strategy, sketches, labels, dist, within=s.within, dedup_threshold=s.dedup_threshold,
                     seed=s.seed, n_tokens=n_tokens, budget_tokens=want, groups=s.groups if groups is None else groups,
                     size_power=s.size_power)
        t = cfg.train
        need = t.num_workers * t.grad_accum * (1 if cfg.packed else t.micro_batch_size)
        if res.indices.size < need:
            raise ConfigError(
                f"selection.budget_tokens={s.budget_tokens} ({want} tokens) selects {res.indices.size} examples, "
                f"fewer than one optimizer step needs ({need}: train.num_workers x train.grad_accum"
                f"{'' if cfg.packed else ' x train.micro_batch_size'}); raise the budget")
        return SelectOutput(int(res.indices.size), res, want)
    requested = n_candidates if s.strategy == "full" else budget_count(s.budget, n_candidates)
    res = select(s.strategy, sketches, labels, dist, requested, within=s.within, dedup_threshold=s.dedup_threshold,
                 seed=s.seed, groups=(s.groups if groups is None else groups) if s.strategy == "balanced" else None,
                 size_power=s.size_power)
    return SelectOutput(requested, res)
