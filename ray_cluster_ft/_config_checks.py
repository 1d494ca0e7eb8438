"""Checks of a job config that need more than the config: whether the job clusters at all, and the combinations
the accepted-example count makes impossible (run at the start of a run, before Ray starts a worker).
Re-exported by :mod:`ray_cluster_ft.config`; the config is read by attribute only, so this module does not import
the schema (no import cycle).
"""

from __future__ import annotations

from ._config_load import ConfigError

# ``JobConfig`` in the annotations below is ray_cluster_ft.config.JobConfig; it is not imported (even under
# TYPE_CHECKING), since config imports this module and the package keeps its import graph free of cycles.

__all__ = ["budget_count", "check_against_data", "needs_clusters"]


def needs_clusters(cfg: JobConfig) -> bool:
    """Whether the job clusters its candidates (and so computes features): the balanced and equalize
    selections and the cluster allocations need clusters; ``random``/``full`` with ``random``/``length``
    allocation do not."""
    return cfg.selection.strategy in ("balanced", "equalize") or cfg.allocation.strategy in ("cluster",
                                                                                             "cluster_per_rank")


def budget_count(budget: float, n_accepted: int) -> int:
    """The number of examples a budget asks for: ``round(budget * n)`` for a fraction in (0, 1], else the count."""
    if budget <= 1:
        return max(1, int(round(budget * n_accepted)))
    return int(budget)


def check_against_data(cfg: JobConfig, n_train: int, n_read: int | None = None,
                       n_tokens: int | None = None) -> None:
    """Fail fast on combinations that the accepted-example count makes impossible.

    Args:
        cfg: the job config.
        n_train: accepted examples available for selection (after the held-out split).
        n_read: rows read from the sources (None: unknown), to tell empty files from all-rejected rows.
        n_tokens: tokens of the accepted examples (None: unknown), for ``selection.budget_tokens``.

    Raises:
        ConfigError: no examples; a count budget above ``n_train`` (or a token count above ``n_tokens``);
            ``clustering.k`` above ``n_train``; a world size whose ranks would get no micro-batch (packed: no
            pack).
    """
    t = cfg.train
    if n_train == 0 and n_read == 0:
        raise ConfigError("no accepted training examples: the data files hold no rows (empty, or blank lines only)")
    if n_train == 0:
        raise ConfigError("no accepted training examples: every row was rejected or held out (see rejected.jsonl)")
    b = cfg.selection.budget
    if cfg.selection.strategy != "full" and b > 1 and b > n_train:
        raise ConfigError(f"selection.budget={int(b)} is above the {n_train} accepted training examples")
    clusters = needs_clusters(cfg)
    if clusters and isinstance(cfg.clustering.k, int) and cfg.clustering.k > n_train:
        raise ConfigError(f"clustering.k={cfg.clustering.k} is above the {n_train} accepted training examples")
    bt = cfg.selection.budget_tokens
    if bt is not None and bt > 1 and n_tokens is not None and bt > n_tokens:
        raise ConfigError(f"selection.budget_tokens={int(bt)} is above the {n_tokens} tokens of the accepted "
                          f"training examples")
    n_sel = n_train if cfg.selection.strategy == "full" else budget_count(b, n_train)
    if bt is not None:
        n_sel = n_train  # how many rows a token budget takes is known after selection (select.run checks it)
    if cfg.packed:  # a pack may hold one example: a step needs W x G of them
        per_step = t.num_workers * t.grad_accum
        if n_sel < per_step:
            raise ConfigError(
                f"train.num_workers={t.num_workers} x train.grad_accum={t.grad_accum} = {per_step} packs per "
                f"optimizer step, but the selection holds only {n_sel} examples: some ranks would get no pack")
        return
    if cfg.allocation.strategy == "cluster_per_rank":  # the published plan: short micro-batches and steps allowed
        if n_train < t.num_workers:
            raise ConfigError(f"train.num_workers={t.num_workers} ranks each train a cluster of their own, but there "
                              f"are only {n_train} accepted training examples")
        return
    per_step = t.num_workers * t.micro_batch_size * t.grad_accum
    if n_sel < per_step:
        raise ConfigError(
            f"train.num_workers={t.num_workers} x train.micro_batch_size={t.micro_batch_size} x "
            f"train.grad_accum={t.grad_accum} = {per_step} examples per optimizer step, but the selection holds "
            f"only {n_sel}: some ranks would get no micro-batch"
        )
