"""The pipeline: each stage's ``run`` in order, one run directory, then the manifest and the report.

data -> features -> cluster -> select -> allocate -> evaluate (before) -> train -> evaluate (after).
Stages talk only through the artifacts of docs/design.md ("Artifacts") and the frozen outputs they return; the
recipe times them (``timings_s`` in the manifest) and hands the outputs to :mod:`.manifest` and :mod:`.report`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from .. import allocate, cluster, data, evaluate, features, select, train
from ..cluster import stream as cluster_stream
from ..select import stream as select_stream
from ..config import ConfigError, JobConfig, check_against_data, needs_clusters
from ..features.feature_store import check_store
from ..features.inputs import prepare_sketch_inputs
from ..model import check_module_patterns, resolve_models
from ..rundir import claim, input_paths, prepare_run_dir, write_spec
from .manifest import StageTimer, features_manifest, pipeline_manifest, write_manifest
from .session import check_local_resources, ray_session
from .warmup import warm_up

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
    old_plan = run_dir / "plan.parquet"

    def read_old_hash():
        return allocate.plan_hash(pd.read_parquet(old_plan)) if resume and old_plan.exists() else None

    timer = StageTimer()
    spec = cfg.model_dump(mode="json")  # the manifest keeps the user's spec, not the resolved model folders
    cfg, models, old_hash = _prepare(cfg, run_dir, resume, before_spec=read_old_hash)
    if cfg.sketch.store and needs_clusters(cfg):
        check_store(cfg.sketch.store)

    # Before Ray: a bad config or bad data fails fast (a pool of data.ray_data_rows rows is read on its own Ray).
    with timer.stage("data"):
        ds = _data_stage(cfg, run_dir, address, resume)
    cand = ds.result.train
    check_against_data(cfg, cand.num_rows, ds.result.n_read, int(np.sum(cand.column("n_tokens").to_numpy())))
    clustered = needs_clusters(cfg)
    check_module_patterns(cfg, ds.model_path, clustered)

    feats = clusters = trained = before = after = epochs = None
    streamed = clustered and features.stream_features(cfg.sketch, cand.num_rows) \
        and features.streaming_unsupported(cfg) is None  # the streamed stages run their passes on Ray
    needs_ray = not plan_only or streamed or (clustered and not _features_in_driver(cfg, cand.num_rows))
    with _session(needs_ray, address, cfg.train.use_gpu) as started_ray:
        # A plan for any world size may be made on a laptop: only training needs the workers' resources.
        if started_ray and not plan_only and not (address or os.environ.get("RAY_ADDRESS")):
            check_local_resources(cfg)
        ids = np.asarray(cand.column("example_id").to_pylist())
        n_tokens = np.asarray(cand.column("n_tokens").to_numpy(), dtype=np.int64)
        sketches = labels = dist = None
        if clustered:
            feats = _features(cfg, run_dir, ds, timer)
            sketches = feats.sketches
            with timer.stage("cluster"):
                if feats.shards is not None:  # above sketch.stream_rows: the features stay in their shards
                    clusters = cluster_stream.run_streamed(cfg, run_dir, shards=feats.shards, resume=resume,
                                                           example_ids=cand.column("example_id").combine_chunks(),
                                                           features=feats.summary)
                else:
                    clusters = cluster.run(cfg, run_dir, example_ids=ids, sketches=sketches, resume=resume,
                                           features=feats.summary, n_tokens=n_tokens)
            labels, dist = clusters.labels, clusters.dist
        with timer.stage("select"):
            if feats is not None and feats.shards is not None:
                sel, _ = select_stream.select_streamed(cfg, feats.shards, labels, dist, n_tokens=n_tokens)
            else:
                sel = select.run(cfg, run_dir, n_candidates=len(ids), sketches=sketches, labels=labels, dist=dist,
                                 n_tokens=n_tokens)
        with timer.stage("allocate"):
            alloc = allocate.run(cfg, run_dir, example_ids=ids,
                                 labels=labels if clustered else np.zeros(len(ids), dtype=np.int64),
                                 n_tokens=n_tokens, selected=np.asarray(sel.result.indices),
                                 reasons=sel.result.reasons, expected_plan_hash=old_hash,
                                 origins=cand.select(["example_id", "source_file", "source_line"]))
        if not plan_only:
            before, trained, after, epochs = _evaluate_and_train(cfg, run_dir, ds, alloc, timer, evaluator, resume)
    manifest = pipeline_manifest(cfg, run_dir, timer, spec=spec, resumed=resume, models=models, data=ds,
                                 features=feats, cluster=clusters, select=sel, allocate=alloc, train=trained,
                                 before=before, after=after, epochs=epochs,
                                 profile=_profile(cfg, ds, labels, n_tokens, alloc) if clustered else None)
    return _finish(run_dir, manifest, alloc, labels, sel, trained, _examples_shown(ds))


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
    if not cfg.sketch.store:
        raise ConfigError("ray-cluster-ft features writes features into the feature store: set sketch.store (a "
                          "local path, s3:// or gs://) in the job spec")
    run_dir = Path(cfg.output.dir).expanduser().resolve()
    timer = StageTimer()
    cfg, _, _ = _prepare(cfg, run_dir, False)
    check_store(cfg.sketch.store)
    with timer.stage("data"):
        ds = _data_stage(cfg, run_dir, address, False)
    cand = ds.result.train
    if cand.num_rows == 0:
        raise ConfigError(f"no candidate rows to featurise: {ds.result.n_read} read, {len(ds.result.rejected)} "
                          f"rejected, {ds.result.eval.num_rows} held out")
    check_module_patterns(cfg, ds.model_path, True)
    with _session(not _features_in_driver(cfg, cand.num_rows), address, cfg.train.use_gpu):
        feats = _features(cfg, run_dir, ds, timer)
    manifest = features_manifest(cfg, run_dir, timer, data=ds, features=feats)
    claim(run_dir, "manifest.json")
    write_manifest(run_dir, manifest)
    return manifest


def _data_stage(cfg: JobConfig, run_dir: Path, address: str | None, resume: bool):
    """The data stage; on Ray Data (a Ray session of its own, shut down after it if it started one) when the
    files hold ``data.ray_data_rows`` rows or more (:func:`ray_cluster_ft.data.ray_data.uses_ray_data`)."""
    from ..data.ray_data import uses_ray_data

    big = uses_ray_data(cfg.data)
    with _session(big, address, cfg.train.use_gpu):
        return data.run(cfg, run_dir, resume=resume, on_ray=big)


def _features_in_driver(cfg: JobConfig, n_candidates: int) -> bool:
    """Whether every feature is computed in the driver (``sketch.in_process_rows``: a small CPU job), so that a run
    which trains nothing needs no Ray: no warm-up (a Ray Train run) and at most that many rows to sketch."""
    return not cfg.train.use_gpu and not cfg.sketch.warmup_steps and n_candidates <= cfg.sketch.in_process_rows


def _session(needed: bool, address: str | None, use_gpu: bool):
    """:func:`ray_session`, or no Ray at all when the run needs none (a small plan-only run): starting a local Ray
    costs 10-40 s on 2 cores, more than sketching 40 rows."""
    import contextlib

    return ray_session(address, use_gpu) if needed else contextlib.nullcontext(False)


def _prepare(cfg: JobConfig, run_dir: Path, resume: bool, before_spec=None) -> tuple:
    """The preamble of every entry point: the run directory made ours (:func:`ray_cluster_ft.rundir.prepare_run_dir`),
    ``before_spec()`` (what must be read before the spec is rewritten), the spec saved, and the models resolved
    once, here on the driver: ``demo`` and hub ids become absolute folders under ``model.cache_dir``, which the
    workers, sketch actors and the evaluation task load as they are (they never resolve a name themselves).

    Returns:
        ``(cfg with resolved model paths, {"model.path", "sketch.model", "model.cache_dir"}, before_spec() or
        None)``.
    """
    prepare_run_dir(run_dir, resume, input_paths(cfg))
    early = before_spec() if before_spec is not None else None
    write_spec(cfg, run_dir)
    cfg, models = resolve_models(cfg)
    return cfg, models, early


def _features(cfg: JobConfig, run_dir: Path, ds, timer: StageTimer):
    """The sketch inputs, the optional warm-up of the sketch model (``sketch_warmup``), then the feature stage
    (``sketch``)."""
    inputs = prepare_sketch_inputs(ds.result.train, cfg, ds.tokenizer)  # proxy model / re-tokenised / text
    sketch_model = inputs.model_path
    if cfg.sketch.warmup_steps:
        with timer.stage("sketch_warmup"):
            sketch_model = warm_up(inputs, cfg, claim(run_dir, "warmup"))
    with timer.stage("sketch"):
        return features.run(cfg, run_dir, candidates=ds.result.train, inputs=inputs, sketch_model=sketch_model)


def _profile(cfg: JobConfig, ds, labels: np.ndarray, n_tokens: np.ndarray, alloc) -> dict:
    """What each cluster holds (:func:`ray_cluster_ft.pipeline._clusters.cluster_profile`): the rows' ``source``
    (the file, or the row's own field), else their ``domain``, whichever tells rows apart; the planned rows'
    selection weights; prompts decoded with the run's tokenizer."""
    from ._clusters import cluster_profile, pick_source, prompt_texts

    cand = ds.result.train
    field, source = pick_source({c: cand.column(c).to_numpy(zero_copy_only=False) for c in ("source", "domain")})
    ids = cand.column("example_id").to_numpy(zero_copy_only=False).astype(str)
    weight = alloc.weights.reindex(ids).to_numpy(np.float64)
    return cluster_profile(labels, n_tokens, selected_weight=weight, source=source, source_field=field,
                           texts=prompt_texts(cand, ds.tokenizer), seed=cfg.clustering.seed)


def _evaluate_and_train(cfg, run_dir, ds, alloc, timer, evaluator, resume) -> tuple:
    """Held-out scores of the base model, training, and held-out scores of the trained model (and of every epoch's
    with ``evaluation.every_epoch``): ``(EvaluateOutput, TrainOutput, EvaluateOutput, eval_epochs or None)``."""
    evaluator = evaluator or evaluate.ray_evaluator(cfg, ds.pad_token_id)
    held = ds.result.eval
    ev = cfg.evaluation
    tasks = evaluate.eval_tasks(cfg.data, held, max_mc=ev.max_mc, max_code=ev.max_code) if held.num_rows else []
    scoring = {"examples": held, "tasks": tasks, "evaluator": evaluator, "eval_files": ds.eval_files}
    with timer.stage("evaluate_before"):
        before = evaluate.run(cfg, run_dir, model_path=ds.model_path, when="before", resume=resume, **scoring)
    with timer.stage("train"):
        trained = train.run(cfg, run_dir, plan=alloc.plan, candidates=ds.result.train, model_path=ds.model_path,
                            pad_token_id=ds.pad_token_id, weights=alloc.weights, resume=resume,
                            pack_tokens=alloc.result.pack_tokens)
    with timer.stage("evaluate_after"):
        final = trained.result.final_model_dir
        after = evaluate.run(cfg, run_dir, model_path=str(final) if final else None, when="after", **scoring)
        epochs = _evaluate_epochs(cfg, run_dir, final, after, scoring) if cfg.evaluation.every_epoch else None
    return before, trained, after, epochs


def _evaluate_epochs(cfg, run_dir: Path, final, after, scoring: dict) -> list[dict]:
    """``evaluation.every_epoch``: every epoch's saved model scored like the final one (the last epoch's scores
    are ``after``'s), the held-out losses of each (:func:`ray_cluster_ft.evaluate.held_out_losses`), and every
    epoch folder but the best one removed. Returns the manifest's ``eval_epochs``, in epoch order, each
    ``{"epoch", "model", "heldout", "files", "macro_loss", "token_loss", "basis", "best"}``."""
    import shutil

    folders = sorted((run_dir / "epochs").glob("epoch*"), key=lambda p: int(p.name.removeprefix("epoch")))
    outs = [(int(p.name.removeprefix("epoch")), p,
             evaluate.run(cfg, run_dir, model_path=str(p), when=p.name, **scoring)) for p in folders]
    outs.append((len(folders) + 1, final, after))
    rows = [{"epoch": e, "model": str(path) if path else None, "heldout": out.metrics, "files": out.files,
             **evaluate.held_out_losses(out.metrics, out.files)} for e, path, out in outs]
    best = evaluate.best_epoch(rows)
    for row, (e, path, _) in zip(rows, outs):
        row["best"] = e == best
        if path is not None and e != best and path != final:
            shutil.rmtree(path, ignore_errors=True)
            row["model"] = None
    return rows


def _examples_shown(ds, n: int = 3) -> list[str]:
    """``n`` candidates decoded with their trained part marked, for the report: the first of each file, then the
    next ones in order."""
    import pyarrow as pa

    from ..data import marked_text

    files = ds.result.train.column("source_file").to_pylist()
    first: dict[str, int] = {}
    for i, f in enumerate(files):
        first.setdefault(f, i)
    picks = list(first.values())[:n]
    picks += [i for i in range(len(files)) if i not in picks][:n - len(picks)]
    t = ds.result.train.take(pa.array(sorted(picks), pa.int64()))
    return [marked_text(ds.tokenizer, i, lab) for i, lab in zip(t.column("input_ids").to_pylist(),
                                                                   t.column("labels").to_pylist())]


def _finish(run_dir: Path, manifest: dict, alloc, labels, sel, trained, shown: list[str]) -> dict:
    """Manifest and report written; raises when the trained log does not match the plan."""
    from .report import FIGURES, write_report

    claim(run_dir, "manifest.json", "report.md", *FIGURES)
    write_manifest(run_dir, manifest)
    write_report(run_dir, manifest, alloc.plan, labels, np.asarray(sel.result.indices), baseline_plan=alloc.baseline,
                 trained_examples=shown)
    check = manifest["checks"]
    if trained is not None and not (check["matches_plan"] and check["once_per_epoch"]):
        raise RuntimeError(f"trained log does not match the plan: {check}")
    return manifest
