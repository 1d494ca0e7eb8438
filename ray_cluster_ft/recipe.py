"""The pipeline: each stage's ``run`` in order, one run directory, then the manifest and the report.

data -> features -> cluster -> select -> allocate -> evaluate (before) -> train -> evaluate (after).
Stages talk only through the artifacts of docs/design.md ("Artifacts") and the results they return.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from . import allocate, cluster, data, evaluate, features, select, train
from ._ray import check_local_resources, init_ray
from .config import JobConfig, check_against_data, needs_clusters
from .features.feature_store import check_store
from .manifest import StageTimer, write_manifest
from .model import check_module_patterns, resolve_models
from .rundir import claim, input_paths, prepare_run_dir, write_spec

__all__ = ["run_features", "run_pipeline"]


def run_pipeline(cfg: JobConfig, address: str | None = None, plan_only: bool = False, resume: bool = False,
                 evaluator: evaluate.Evaluator | None = None) -> dict:
    """Run the whole job and return the manifest (also written to ``<output.dir>/manifest.json``).

    Args:
        cfg: the validated job config.
        address: a Ray cluster to join (``ray://`` or ``auto``); default ``$RAY_ADDRESS`` or a new local Ray.
        plan_only: stop after the allocation plan (no evaluation, no training); the manifest then has
            ``train: null`` and ``counts.trained == 0``. The local Ray need not hold ``train.num_workers``
            workers then: a plan for any world size is made on any machine.
        resume: continue a stopped run in ``output.dir``: the deterministic stages run again (finished sketch
            shards are reused), the plan must come out identical to the stored one, the held-out scores of the
            base model are read back, and training continues from its latest checkpoint.
        evaluator: scores a model on the held-out rows (:data:`ray_cluster_ft.evaluate.Evaluator`); default
            :func:`ray_cluster_ft.evaluate.ray_evaluator`, a Ray task.

    Raises:
        ConfigError: the config is impossible for the accepted data (before any Ray work); on ``resume``, a
            plan that differs from the stopped run's.
        FileNotFoundError: ``model.path`` or ``sketch.model`` cannot be resolved (before any Ray work).
        RuntimeError: the trained-ids log does not match the plan.
    """
    if cfg.train.deepspeed_config:  # read and checked once, here on the driver; workers get the dict
        train.build_deepspeed_config(cfg.train)
    run_dir = Path(cfg.output.dir).expanduser().resolve()
    prepare_run_dir(run_dir, resume, input_paths(cfg))
    timer = StageTimer()
    manifest: dict = {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "argv": sys.argv,
                      "resumed": resume}
    old_plan = run_dir / "plan.parquet"
    old_hash = allocate.plan_hash(pd.read_parquet(old_plan)) if resume and old_plan.exists() else None
    write_spec(cfg, run_dir)
    # Once, here on the driver: `demo` and hub ids become absolute folders under model.cache_dir, which the
    # workers, sketch actors and the evaluation task load as they are (they never resolve a name themselves).
    cfg, manifest["models"] = resolve_models(cfg)
    if cfg.sketch.store and needs_clusters(cfg):
        check_store(cfg.sketch.store)

    # Before Ray: a bad config or bad data fails fast.
    with timer.stage("data"):
        ds = data.run(cfg, run_dir, resume)
    cand = ds.result.train
    check_against_data(cfg, cand.num_rows, ds.result.n_read, int(np.sum(cand.column("n_tokens").to_numpy())))
    clustered = needs_clusters(cfg)
    check_module_patterns(cfg, ds.model_path, clustered)

    started_ray = init_ray(address, cfg.train.use_gpu)
    try:
        # A plan for any world size may be made on a laptop: only training needs the workers' resources.
        if started_ray and not plan_only and not (address or os.environ.get("RAY_ADDRESS")):
            check_local_resources(cfg)
        ids = np.asarray(cand.column("example_id").to_pylist())
        n_tokens = np.asarray(cand.column("n_tokens").to_numpy(), dtype=np.int64)
        sketches = labels = dist = None
        if clustered:
            feats = features.run(cfg, run_dir, cand, ds.tokenizer, timer)
            manifest["sketch"] = feats.summary
            sketches = feats.sketches
            with timer.stage("cluster"):
                clustered_out = cluster.run(cfg, run_dir, example_ids=ids, sketches=sketches, resume=resume,
                                            features=feats.summary, n_tokens=n_tokens)
            manifest["clustering"] = clustered_out.summary
            labels, dist = clustered_out.labels, clustered_out.dist
        with timer.stage("select"):
            sel = select.run(cfg, run_dir, n_candidates=len(ids), sketches=sketches, labels=labels, dist=dist,
                             n_tokens=n_tokens)
        with timer.stage("allocate"):
            alloc = allocate.run(cfg, run_dir, example_ids=ids,
                                 labels=labels if clustered else np.zeros(len(ids), dtype=np.int64),
                                 n_tokens=n_tokens, selected=np.asarray(sel.result.indices),
                                 reasons=sel.result.reasons, expected_plan_hash=old_hash)
        manifest["plan_metrics"] = alloc.metrics
        tres, scores = None, {}
        if not plan_only:
            tres, scores = _evaluate_and_train(cfg, run_dir, ds, alloc, timer, evaluator, resume)
    except KeyboardInterrupt:
        started_ray = True  # on a joined cluster too: the driver's actors and workers must stop now
        raise
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return _finish(run_dir, cfg, manifest, timer, ds, sel, alloc, labels, tres, scores)


def run_features(cfg: JobConfig, address: str | None = None) -> dict:
    """Data, then features into the feature store, and nothing else (``ray-cluster-ft features``): a nightly
    job prefetches the features of tomorrow's runs, which then read them from ``sketch.store``.

    Writes into ``output.dir`` the data stage's artifacts, the sketch shards of the rows the store lacked, and
    ``manifest.json``: ``{"command": "features", "config", "run_dir", "counts": {"read", "accepted",
    "rejected", "held_out", "candidates", "features_computed", "features_reused"}, "sketch" (the feature
    stage's summary: store, feature_key, ...), "seeds", "timings_s"}``. Every candidate is featurised, whatever
    the selection strategy.

    Args:
        cfg: the validated job config; ``sketch.store`` must be set.
        address: a Ray cluster to join; default ``$RAY_ADDRESS`` or a new local Ray.

    Returns:
        The manifest.

    Raises:
        ConfigError: ``sketch.store`` is not set (the features would be kept nowhere), or as :func:`run_pipeline`
            for the data stage.
    """
    import json

    from .config import ConfigError
    from .manifest import feature_counts

    if not cfg.sketch.store:
        raise ConfigError("ray-cluster-ft features writes features into the feature store: set sketch.store (a "
                          "local path, s3:// or gs://) in the job spec")
    run_dir = Path(cfg.output.dir).expanduser().resolve()
    prepare_run_dir(run_dir, False, input_paths(cfg))
    timer = StageTimer()
    write_spec(cfg, run_dir)
    cfg, _ = resolve_models(cfg)  # as run_pipeline: the sketch actors load an absolute folder
    check_store(cfg.sketch.store)
    with timer.stage("data"):
        ds = data.run(cfg, run_dir)
    cand = ds.result.train
    if cand.num_rows == 0:
        raise ConfigError(f"no candidate rows to featurise: {ds.result.n_read} read, {len(ds.result.rejected)} "
                          f"rejected, {ds.result.eval.num_rows} held out")
    check_module_patterns(cfg, ds.model_path, True)
    started_ray = init_ray(address, cfg.train.use_gpu)
    try:
        feats = features.run(cfg, run_dir, cand, ds.tokenizer, timer)
    except KeyboardInterrupt:
        started_ray = True
        raise
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    d = ds.result
    timer.timings["total"] = round(time.perf_counter() - timer.t_start, 3)
    manifest = {"command": "features", "config": cfg.model_dump(mode="json"), "run_dir": str(run_dir),
                "argv": sys.argv,
                "counts": {"read": d.n_read, "accepted": d.train.num_rows + d.eval.num_rows,
                           "rejected": len(d.rejected), "held_out": d.eval.num_rows, "candidates": cand.num_rows,
                           **feature_counts(feats.summary)},
                "sketch": feats.summary, "seeds": {"data": cfg.data.seed, "sketch": cfg.sketch.seed},
                "timings_s": timer.timings}
    claim(run_dir, "manifest.json")
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float))
    return manifest


def _evaluate_and_train(cfg, run_dir, ds, alloc, timer, evaluator, resume) -> tuple:
    """Held-out scores of the base model, training, and held-out scores of the trained model."""
    evaluator = evaluator or evaluate.ray_evaluator(cfg, ds.pad_token_id)
    held = ds.result.eval
    ev = cfg.evaluation
    tasks = evaluate.eval_tasks(cfg.data, held, max_mc=ev.max_mc, max_code=ev.max_code) if held.num_rows else []
    with timer.stage("evaluate_before"):
        before = evaluate.run(cfg, run_dir, evaluate.EvaluationInputs(ds.model_path, held, tasks, "before",
                                                                       evaluator, resume))
        files_before = evaluate.run_files(cfg, run_dir, ds.eval_files, ds.model_path, "before", evaluator)
    with timer.stage("train"):
        tres = train.run(cfg, run_dir, plan=alloc.plan, candidates=ds.result.train, model_path=ds.model_path,
                         pad_token_id=ds.pad_token_id, weights=alloc.weights, resume=resume)
    with timer.stage("evaluate_after"):
        final = str(tres.final_model_dir) if tres.final_model_dir else None
        after = evaluate.run(cfg, run_dir, evaluate.EvaluationInputs(final, held, tasks, "after", evaluator))
        files_after = evaluate.run_files(cfg, run_dir, ds.eval_files, final, "after", evaluator)
    return tres, {"before": before, "after": after, "files_before": files_before, "files_after": files_after}


def _finish(run_dir, cfg, manifest, timer, ds, sel, alloc, labels, tres, scores) -> dict:
    """Manifest and report; raises when the trained log does not match the plan."""
    from .report import FIGURES, write_report

    claim(run_dir, "manifest.json", "report.md", *FIGURES)
    manifest = write_manifest(run_dir, cfg, manifest, timer, data=ds, selection=sel, allocation=alloc, tres=tres,
                              scores=scores)
    write_report(run_dir, manifest, alloc.plan, labels, np.asarray(sel.result.indices), baseline_plan=alloc.baseline)
    check = manifest["checks"]
    if tres is not None and not (check["matches_plan"] and check["once_per_epoch"]):
        raise RuntimeError(f"trained log does not match the plan: {check}")
    return manifest
