"""Runs the stages in order, writes their artifacts, the manifest and the report.

data -> sketch -> cluster -> select -> allocate -> evaluate (before) -> train -> evaluate (after) -> verify.
Each stage reads and writes only the artifacts of DESIGN.md, in one run directory.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError, JobConfig, budget_count, check_against_data

__all__ = ["run_pipeline", "verify_trained", "write_samples"]


class _Timer:
    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        print(f"[ray-cluster-ft] {name} ...", flush=True)
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.timings[name] = round(dt, 3)
        print(f"[ray-cluster-ft] {name} done in {dt:.1f} s", flush=True)


def _versions() -> dict:
    import deepspeed
    import ray
    import sklearn
    import torch
    import transformers

    from importlib.metadata import version

    return {
        "ray_cluster_ft": version("ray-cluster-ft"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
        "numpy": np.__version__,
    }


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` (or ``ray://host:port``) nobody listens on: ``ray.init`` retries for minutes."""
    import socket

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local" and the like: Ray resolves them itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"cannot reach a Ray cluster at {address!r}: {err}") from None


def _init_ray(address: str | None, use_gpu: bool) -> bool:
    """Start or join Ray; returns True when this call started it (so the pipeline shuts it down).

    Raises:
        ConfigError: the address is unreachable, or Ray could not start or connect.
    """
    import ray

    if ray.is_initialized():
        return False
    env = {} if use_gpu else {"DS_ACCELERATOR": "cpu"}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    except Exception as err:  # Ray raises a bare Exception when its node times out at start-up
        raise ConfigError(f"could not {'join Ray at ' + repr(address) if address else 'start a local Ray'}: "
                          f"{err}") from None
    return True


def _check_local_resources(cfg: JobConfig) -> None:
    """On a Ray this job started itself (no autoscaler), refuse a world size the machine cannot place:
    Ray Train would otherwise wait for resources forever."""
    import ray

    res = ray.cluster_resources()
    t = cfg.train
    need_cpu = t.num_workers * t.cpus_per_worker
    if need_cpu > res.get("CPU", 0):
        raise ConfigError(f"train.num_workers={t.num_workers} x train.cpus_per_worker={t.cpus_per_worker} = "
                          f"{need_cpu} CPUs, but the local Ray has {res.get('CPU', 0):g}; lower num_workers or "
                          f"join a larger cluster with --address")
    if t.use_gpu and t.num_workers > res.get("GPU", 0):
        raise ConfigError(f"train.use_gpu with train.num_workers={t.num_workers}, but the local Ray has "
                          f"{res.get('GPU', 0):g} GPUs")


def _eval_remote(model_path: str, table: pa.Table, cfg: JobConfig, pad_token_id: int, tasks: list | None,
                 samples_path: Path) -> dict:
    """Held-out loss, and MC accuracy / pass@1 for ``tasks``, in a Ray task (a GPU where the job trains on GPUs),
    so the driver stays light; generated code runs in separate, limited processes (``codeexec``). The per-task
    records (prediction, or completion and status) go to ``samples_path`` (JSON Lines) on the driver."""
    import ray

    from .evaluate import evaluate_model_path

    threads = max(1, min(4, os.cpu_count() or 1))
    task = ray.remote(evaluate_model_path).options(
        num_cpus=1, num_gpus=1 if cfg.train.use_gpu else 0, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    )
    metrics, samples = ray.get(
        task.remote(model_path, table, 8, pad_token_id, cfg.model.trust_remote_code, threads, tasks=tasks,
                    max_new_tokens=cfg.evaluation.max_new_tokens, time_limit_s=cfg.evaluation.time_limit_s,
                    exec_workers=1, with_samples=True)
    )
    write_samples(samples_path, samples)
    return metrics


def write_samples(path: Path, samples: list[dict]) -> None:
    """Write :func:`.evaluate.evaluate_tasks`' per-task records to ``path``, one JSON object per line."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in samples)


RUN_MARKER = ".ray-cluster-ft-run"
# What a fresh run replaces: everything an earlier run wrote except the sketch shards (reused by key), so a
# run that fails part-way never leaves an older manifest or plan beside its new data files.
_STALE = ["trained", "final_model", "ray_train", "warmup", "trained.parquet", "train_log.jsonl", "eval_before.json",
          "eval_before_samples.jsonl", "eval_after_samples.jsonl", "examples.parquet", "eval_examples.parquet",
          "rejected.jsonl", "clusters.parquet", "selection.parquet", "plan.parquet", "manifest.json", "report.md",
          "config.yaml", "loss.png", "allocation.png", "clusters.png", "load.png"]


def _prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Create (or check) the run directory before anything is written into it.

    A fresh run into an existing run directory first removes that run's artifacts (``_STALE``; the sketch
    shards stay), so a plan-only run never leaves an older model beside its new plan, and a run that fails
    part-way leaves no older manifest describing other data. A directory that holds other files (the current
    directory, a data folder) is refused: the training stage deletes folders inside the run directory.

    Raises:
        ConfigError: ``run_dir`` is a file, a non-empty directory that no run of this tool wrote, or cannot be
            created (a parent is a file, no permission).
    """
    import shutil

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output.dir {run_dir} is a file, not a directory")
    if run_dir.is_dir():
        entries = sorted(x.name for x in run_dir.iterdir())
        ours = any((run_dir / m).exists() for m in (RUN_MARKER, "manifest.json", "examples.parquet"))
        if entries and not ours:
            raise ConfigError(f"output.dir {run_dir} already holds files that no ray-cluster-ft run wrote (e.g. "
                              f"{entries[0]!r}); use a new or empty directory (the run replaces folders in it)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_MARKER).touch()
    except OSError as err:
        raise ConfigError(f"output.dir {run_dir} cannot be created: {err.strerror or err}") from None
    if not resume:
        for name in _STALE:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _check_deepspeed_values(cfg: JobConfig) -> None:
    """Validate the merged ZeRO section with DeepSpeed's own config model on the driver: a bad value in a
    user's DeepSpeed JSON (``"stage": "three"``) would otherwise fail in every training worker, after the
    sketch and the first evaluation.

    Raises:
        ConfigError: naming the DeepSpeed file and DeepSpeed's own message.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from .train import deepspeed_config

    zero = deepspeed_config(cfg.train, total_steps=1).get("zero_optimization", {})
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as err:  # pydantic's ValidationError, or a TypeError for an unknown shape
        lines = [x.strip() for x in str(err).splitlines() if x.strip()]
        raise ConfigError(f"train.deepspeed_config {cfg.train.deepspeed_config}: zero_optimization is not valid "
                          f"for DeepSpeed: {' '.join(lines[1:3]) if len(lines) > 2 else ' '.join(lines)}") from None


def _same_as_before(path: Path, table: pa.Table, columns: list[str]) -> None:
    """On ``--resume``: the artifact recomputed now must equal the one the run wrote (in ``columns``), checked
    before it is overwritten, so a refused resume leaves the run directory as it was.

    Raises:
        ConfigError: the recomputed ``columns`` differ from ``path``'s (the data or a package changed).
    """
    if not path.exists():
        return
    old = pq.read_table(path, columns=columns)
    if not old.equals(table.select(columns)):
        raise ConfigError(f"--resume: {path.name} computed now ({table.num_rows} rows) differs from the one in the "
                          f"run directory ({old.num_rows} rows); the data or a package changed since the run "
                          f"started. Start a fresh run directory.")


def _check_module_patterns(cfg: JobConfig, model_path: str, need_sketch: bool) -> None:
    """Every LoRA target and sketched module pattern must name an ``nn.Linear`` of its model, and a separate
    ``sketch.model`` must hold readable weights: either mistake would otherwise fail inside the Ray workers
    (retried ``max_failures`` times), and a pattern typo could silently sketch fewer modules.

    Raises:
        ConfigError: naming the patterns that match nothing and the valid suffixes.
        FileNotFoundError: ``sketch.model`` cannot be resolved or has no readable weights (named as such).
    """
    from .model import check_model_files, linear_module_names, resolve_model_path

    checks = []
    if cfg.train.lora.enabled:
        checks.append(("train.lora.target_modules", cfg.train.lora.target_modules, model_path))
    sketch_model = model_path
    if need_sketch and cfg.sketch.model:
        sketch_model = resolve_model_path(cfg.sketch.model, "sketch.model")
        check_model_files(sketch_model, "sketch.model")
    if need_sketch and cfg.sketch.method == "gradient":
        checks.append(("sketch.modules", cfg.sketch.modules, sketch_model))
    names_of: dict[str, list[str]] = {}
    for key, patterns, path in checks:
        if path not in names_of:
            try:
                names_of[path] = linear_module_names(path, cfg.model.trust_remote_code)
            except (OSError, ValueError) as err:
                raise ConfigError(f"cannot read the model config of {path!r} to check {key}: {err}") from None
        names = names_of[path]
        missing = [p for p in patterns if not any(n == p or n.endswith("." + p) for n in names)]
        if missing:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ConfigError(f"{key}: {', '.join(map(repr, missing))} match no nn.Linear of {path} (module name "
                              f"suffixes there: {', '.join(suffixes)})")


def _clustering_warning(k: int, n_merged: int, world_size: int, min_cluster_size: int) -> str | None:
    """The sentence the run prints (and the manifest and report keep) when clustering left fewer clusters
    than ranks: then the W micro-batches of a step cannot all come from distinct clusters."""
    if k >= world_size:
        return None
    merged = (f" after merging {n_merged} clusters smaller than clustering.min_cluster_size={min_cluster_size}"
              if n_merged else "")
    return (f"{k} cluster{'s' if k != 1 else ''}{merged}, fewer than the {world_size} ranks: the ranks of a step "
            f"cannot all train different clusters (see plan_metrics.collisions_per_step); use more data, a "
            f"smaller clustering.min_cluster_size or a larger clustering.k")


def verify_trained(plan: pd.DataFrame, trained: pd.DataFrame) -> dict:
    """Check the trained-ids log against the plan.

    Args:
        plan: rows ``rank, epoch, step, micro_index, example_id`` in plan order.
        trained: rows ``rank, epoch, step, micro_index, example_id`` as the workers logged them.

    Returns:
        ``{"matches_plan": bool, "once_per_epoch": bool, "distinct_trained": int, "mismatched_ranks": [...]}``:
        ``matches_plan`` is True when every rank trained exactly its planned ids in plan order.
    """
    bad = []
    for r, p in plan.groupby("rank", sort=True):
        t = trained[trained["rank"] == r]
        if list(p["example_id"]) != list(t["example_id"]) or list(p["epoch"]) != list(t["epoch"]):
            bad.append(int(r))
    extra = sorted(set(trained["rank"]) - set(plan["rank"]))
    per_epoch = trained.groupby("epoch")["example_id"]
    planned_ids = set(plan["example_id"])
    once = all(g.is_unique and set(g) == planned_ids for _, g in per_epoch) and per_epoch.ngroups == plan["epoch"].nunique()
    return {
        "matches_plan": not bad and not extra,
        "once_per_epoch": bool(once),
        "distinct_trained": int(trained["example_id"].nunique()),
        "mismatched_ranks": bad + [int(e) for e in extra],
    }


def run_pipeline(cfg: JobConfig, address: str | None = None, plan_only: bool = False, resume: bool = False) -> dict:
    """Run the whole job and return the manifest (also written to ``<output.dir>/manifest.json``).

    Args:
        cfg: the validated job config.
        address: a Ray cluster to join (``ray://`` or ``auto``); default ``$RAY_ADDRESS`` or a new local Ray.
        plan_only: stop after the allocation plan (no evaluation, no training); the manifest then has
            ``train: null`` and ``counts.trained == 0``.
        resume: continue a stopped run in ``output.dir``: the deterministic stages run again (finished sketch
            shards are reused), the plan must come out identical to the stored one, the held-out scores of the
            base model are read back, and training continues from its latest checkpoint.

    Raises:
        ConfigError: the config is impossible for the accepted data (before any Ray work); on ``resume``, a
            plan that differs from the stopped run's.
        RuntimeError: the trained-ids log does not match the plan.
    """
    from . import allocate, clustering, select
    from .data import load_examples, reason_category
    from .model import check_model_files, load_tokenizer, resolve_model_path

    run_dir = Path(cfg.output.dir).expanduser().resolve()
    _prepare_run_dir(run_dir, resume)
    timer = _Timer()
    t_start = time.perf_counter()
    manifest: dict = {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "argv": sys.argv,
                      "resumed": resume}
    old_plan = run_dir / "plan.parquet"
    old_plan_hash = None
    if resume and old_plan.exists():
        from .train import plan_hash

        old_plan_hash = plan_hash(pd.read_parquet(old_plan))
    # The job spec as run, for `ray-cluster-ft run --resume RUN_DIR`.
    import yaml

    spec = cfg.model_dump(mode="json")
    spec["output"]["dir"] = str(run_dir)
    # Paths relative to where this run started would break a resume started elsewhere.
    spec["data"]["paths"] = [str(Path(x).expanduser().resolve()) for x in cfg.data.paths]
    for section, key in (("model", "path"), ("sketch", "model"), ("train", "deepspeed_config")):
        value = spec[section][key]
        if value and Path(value).expanduser().exists():
            spec[section][key] = str(Path(value).expanduser().resolve())
    (run_dir / "config.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    # ---- data (before Ray: a bad config or data fails fast)
    with timer.stage("data"):
        model_path = resolve_model_path(cfg.model.path)
        check_model_files(model_path, "model.path")
        try:
            tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
        except (OSError, ValueError) as err:  # an unknown hub id, an unreadable folder, no usable tokenizer files
            if isinstance(err, FileNotFoundError):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"model.path {cfg.model.path!r}: cannot load its tokenizer (are its tokenizer files "
                              f"there?): {first}") from None
        pad_id = int(tok.pad_token_id)
        data = load_examples(cfg.data, tok)
        if resume:
            _same_as_before(run_dir / "examples.parquet", data.train, ["example_id", "n_tokens"])
            _same_as_before(run_dir / "eval_examples.parquet", data.eval, ["example_id"])
        pq.write_table(data.train, run_dir / "examples.parquet")
        pq.write_table(data.eval, run_dir / "eval_examples.parquet")
        with open(run_dir / "rejected.jsonl", "w", encoding="utf-8") as fh:
            for rej in data.rejected:
                fh.write(rej.to_json() + "\n")
        reasons: dict[str, int] = {}
        for rej in data.rejected:
            key = reason_category(rej.reason)
            reasons[key] = reasons.get(key, 0) + 1
        print(
            f"[ray-cluster-ft] read {data.n_read} row{'' if data.n_read == 1 else 's'}: {data.train.num_rows} for "
            f"selection, {data.eval.num_rows} held out, {len(data.rejected)} rejected" + (f" {reasons}" if reasons else ""),
            flush=True,
        )
    n_train = data.train.num_rows
    check_against_data(cfg, n_train, data.n_read)
    if cfg.train.deepspeed_config:
        _check_deepspeed_values(cfg)
    need_sketch = cfg.selection.strategy == "balanced" or cfg.allocation.strategy == "cluster"
    _check_module_patterns(cfg, model_path, need_sketch)

    started_ray = _init_ray(address, cfg.train.use_gpu)
    try:
        if started_ray and not (address or os.environ.get("RAY_ADDRESS")):
            _check_local_resources(cfg)
        import ray

        ids = np.asarray(data.train.column("example_id").to_pylist())
        n_tokens = np.asarray(data.train.column("n_tokens").to_numpy(), dtype=np.int64)
        W = cfg.train.num_workers

        # ---- sketch
        if need_sketch:
            from .sketch import compute_sketches, prepare_sketch_inputs, read_sketches, warm_up

            sk_inputs = prepare_sketch_inputs(data.train, cfg, tok)  # proxy model / re-tokenised / text
            sketch_model = sk_inputs.model_path
            if cfg.sketch.warmup_steps:
                with timer.stage("sketch_warmup"):
                    sketch_model = warm_up(sk_inputs, cfg, run_dir / "warmup")
            with timer.stage("sketch"):
                sketch_dir = run_dir / "sketches"
                # Resumable: finished shards of the same inputs, model and sketch settings are kept, any
                # other file in sketch_dir is removed (a different config starts clean).
                manifest["sketch"] = compute_sketches(
                    sk_inputs.table, sketch_model, cfg.sketch, str(sketch_dir), use_gpu=cfg.train.use_gpu,
                    trust_remote_code=cfg.model.trust_remote_code, pad_token_id=sk_inputs.pad_token_id)
                manifest["sketch"].update(model=sketch_model, retokenized=sk_inputs.retokenized)
                sk = read_sketches(str(sketch_dir))
                pos = pd.Series(np.arange(len(ids)), index=ids)
                order = pos.loc[sk["example_id"]].to_numpy()
                sketches = np.empty((len(ids), sk["sketch"].shape[1]), dtype=np.float32)
                sketches[order] = sk["sketch"]
                if len(sk["example_id"]) != len(ids) or len(set(sk["example_id"])) != len(ids):
                    raise RuntimeError(f"sketch stage produced {len(sk['example_id'])} sketches for {len(ids)} examples")

            # ---- cluster
            with timer.stage("cluster"):
                cres = clustering.cluster_sketches(sketches, cfg.clustering.k, W, cfg.clustering.seed,
                                                   cfg.clustering.min_cluster_size)
                labels, dist = cres.labels, cres.dist
                clusters = pa.table({"example_id": ids, "cluster": labels.astype(np.int32),
                                     "distance": dist.astype(np.float32)})
                if resume:
                    _same_as_before(run_dir / "clusters.parquet", clusters, ["example_id", "cluster"])
                pq.write_table(clusters, run_dir / "clusters.parquet")
            manifest["clustering"] = {"k": int(cres.k), "merged_small_clusters": int(cres.n_merged_clusters),
                                      "sizes": np.bincount(labels).tolist()}
            warning = _clustering_warning(cres.k, cres.n_merged_clusters, W, cfg.clustering.min_cluster_size)
            if warning:
                manifest["clustering"]["warning"] = warning
                print(f"[ray-cluster-ft] warning: {warning}", flush=True)
        else:
            sketches = np.zeros((len(ids), 1), dtype=np.float32)
            labels = np.zeros(len(ids), dtype=np.int64)
            dist = np.zeros(len(ids), dtype=np.float32)

        # ---- select
        with timer.stage("select"):
            requested = n_train if cfg.selection.strategy == "full" else budget_count(cfg.selection.budget, n_train)
            sres = select.select(cfg.selection.strategy, sketches, labels, dist, requested,
                                 within=cfg.selection.within, dedup_threshold=cfg.selection.dedup_threshold,
                                 seed=cfg.selection.seed)
            sel_idx = np.asarray(sres.indices)

        # ---- allocate
        with timer.stage("allocate"):
            plan_for = partial(allocate.make_plan, ids[sel_idx], labels[sel_idx], n_tokens[sel_idx], W,
                               cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.train.epochs,
                               seed=cfg.allocation.seed, pad_tolerance=cfg.allocation.pad_tolerance)
            pres = plan_for(strategy=cfg.allocation.strategy)
            plan = pres.plan
            if old_plan_hash is not None:
                from .train import plan_hash

                if plan_hash(plan) != old_plan_hash:
                    raise ConfigError(f"--resume: the plan computed now differs from the one in {old_plan}; the "
                                      f"data, the config or a package changed. Start a fresh run directory.")
            plan.to_parquet(run_dir / "plan.parquet", index=False)
            keep_mask = np.isin(ids[sel_idx], plan["example_id"].unique())
            pq.write_table(pa.table({"example_id": ids[sel_idx][keep_mask],
                                     "cluster": labels[sel_idx][keep_mask].astype(np.int32),
                                     "reason": np.asarray(sres.reasons)[keep_mask]}), run_dir / "selection.parquet")
            metrics = {cfg.allocation.strategy: allocate.plan_metrics(plan, W)}
            baseline = None
            if cfg.allocation.strategy != "random":
                baseline = plan_for(strategy="random").plan
                metrics["random (baseline)"] = allocate.plan_metrics(baseline, W)
            manifest["plan_metrics"] = metrics
            print(f"[ray-cluster-ft] plan: {json.dumps(metrics, default=float)}", flush=True)
        if plan_only:
            return _finish(manifest, timer, t_start, run_dir, cfg, data, reasons, requested, pres, plan, baseline,
                           labels if need_sketch else None, sel_idx, None, {}, {})

        # ---- evaluate before
        from .evaluate import eval_tasks

        ev = cfg.evaluation
        tasks = eval_tasks(cfg.data, data.eval, max_mc=ev.max_mc, max_code=ev.max_code) if data.eval.num_rows else []
        with timer.stage("evaluate_before"):
            cached = run_dir / "eval_before.json"
            if resume and cached.exists():
                eval_before = json.loads(cached.read_text())
            else:
                eval_before = (_eval_remote(model_path, data.eval, cfg, pad_id, tasks,
                                            run_dir / "eval_before_samples.jsonl") if data.eval.num_rows else {})
                cached.write_text(json.dumps(eval_before, default=float))

        # ---- train
        from .train import train

        with timer.stage("train"):
            examples_by_id = data.train.filter(pa.array(np.isin(ids, plan["example_id"].unique())))
            tres = train(plan, examples_by_id, cfg.train, model_path, run_dir,
                         trust_remote_code=cfg.model.trust_remote_code, save_model=cfg.output.save_model,
                         pad_token_id=pad_id, resume=resume)

        # ---- evaluate after
        with timer.stage("evaluate_after"):
            eval_after = (
                _eval_remote(str(tres.final_model_dir), data.eval, cfg, pad_id, tasks,
                             run_dir / "eval_after_samples.jsonl")
                if data.eval.num_rows and tres.final_model_dir else {}
            )
    finally:
        if started_ray:
            import ray

            ray.shutdown()

    return _finish(manifest, timer, t_start, run_dir, cfg, data, reasons, requested, pres, plan, baseline,
                   labels if need_sketch else None, sel_idx, tres, eval_before, eval_after)


def _finish(manifest, timer, t_start, run_dir, cfg, data, reasons, requested, pres, plan, baseline, labels,
            sel_idx, tres, eval_before, eval_after) -> dict:
    """Counts, checks, manifest and report; raises when the trained log does not match the plan."""
    if tres is not None:
        check = verify_trained(plan, pd.read_parquet(run_dir / "trained.parquet"))
    else:
        check = {"matches_plan": None, "once_per_epoch": None, "distinct_trained": 0, "mismatched_ranks": []}
    n_train, n_eval = data.train.num_rows, data.eval.num_rows
    n_sel = int(plan["example_id"].nunique())
    dropped = len(pres.dropped)
    manifest.update(
        counts={
            "read": data.n_read,
            "accepted": n_train + n_eval,
            "rejected": len(data.rejected),
            "held_out": n_eval,
            "candidates": n_train,
            "selected": n_sel,
            "not_selected": n_train + n_eval - n_sel,
            "not_selected_breakdown": {"held_out": n_eval, "below_budget": n_train - int(requested),
                                       "dropped_for_even_plan": dropped},
            "trained": check["distinct_trained"],
            "truncated": data.truncated,
            "rejected_by_reason": reasons,
        },
        budget={"requested": int(requested), "planned": n_sel, "rounded_down_by": dropped},
        checks=check,
        eval={"before": eval_before, "after": eval_after},
        train=None if tres is None else {
            "steps": tres.steps, "seconds": tres.seconds, "final_loss": tres.final_loss,
            "final_model": str(tres.final_model_dir) if tres.final_model_dir else None,
            "step_time_p50_s": list(tres.step_time_p50_s), "step_time_p90_s": list(tres.step_time_p90_s),
            "wait_mean_s": list(tres.wait_mean_s), "resumed_from_step": tres.resumed_from_step},
        seeds={"data": cfg.data.seed, "sketch": cfg.sketch.seed, "clustering": cfg.clustering.seed,
               "selection": cfg.selection.seed, "allocation": cfg.allocation.seed, "train": cfg.train.seed},
        versions=_versions(),
    )
    timer.timings["total"] = round(time.perf_counter() - t_start, 3)
    manifest["timings_s"] = timer.timings
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float))

    from .report import write_report

    write_report(run_dir, manifest, plan, labels, sel_idx, baseline_plan=baseline)
    if tres is not None and not (check["matches_plan"] and check["once_per_epoch"]):
        raise RuntimeError(f"trained log does not match the plan: {check}")
    return manifest
