"""Training stage driver: Ray Train launches DeepSpeed workers that train exactly the micro-batches of the plan."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ..allocate import check_plan
from ..config import TrainConfig
from .checkpoints import newest_complete_checkpoint, prune_checkpoints
from .deepspeed import build_deepspeed_config, precision_for
from .loop import FAIL_AT_STEP_ENV, train_loop_per_worker
from .rank_data import MICRO_BATCH_KEY, TRAINED_COLUMNS, build_rank_tables, plan_hash

__all__ = [
    "TrainOutput",
    "TrainResult",
    "run",
    "train",
    "verify_trained",
]


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` produced.

    Attributes:
        final_model_dir: Hugging Face folder of the trained model (with tokenizer); None when not saved.
        steps: optimizer steps taken (all epochs).
        seconds: wall-clock seconds of the whole Ray Train run (worker start, DeepSpeed init, training,
            checkpoint, model save).
        final_loss: loss of the last step, averaged over ranks (mean over the label tokens of each
            micro-batch, then over the step's micro-batches and the ranks).
        log_path: ``train_log.jsonl``, one row per step.
        trained_path: ``trained.parquet``, one row per trained example, in training order per rank.
        checkpoint_path: the final checkpoint folder (DeepSpeed state of every rank, under
            ``run_dir/ray_train/train``); None with ``train.final_checkpoint`` off.
        init_seconds: seconds rank 0 spent loading the model and in ``deepspeed.initialize``.
        step_time_p50_s, step_time_p90_s: per rank (list index = rank), the median and 90th percentile of
            the optimizer-step wall time in seconds.
        wait_mean_s: per rank, mean seconds per step spent waiting at the gradient all-reduce, approximated
            as step time minus 3x the forward time (see ``train_log.jsonl``'s ``wait_s_per_rank``).
        resumed_from_step: optimizer steps the last (re)start found already done in its checkpoint.
    """

    final_model_dir: Path | None
    steps: int
    seconds: float
    final_loss: float
    log_path: Path
    trained_path: Path
    checkpoint_path: str | None = None
    init_seconds: float = float("nan")
    step_time_p50_s: list = ()
    step_time_p90_s: list = ()
    wait_mean_s: list = ()
    resumed_from_step: int = 0


def _consolidate_trained(run_dir: Path, world_size: int) -> pd.DataFrame:
    frames = []
    for r in range(world_size):
        path = run_dir / "trained" / f"rank{r}.jsonl"
        if not path.exists() or path.stat().st_size == 0:
            raise RuntimeError(f"worker {r} left no record of what it trained ({path})")
        frames.append(pd.read_json(path, lines=True, dtype={"example_id": str}))
    out = pd.concat(frames, ignore_index=True)[list(TRAINED_COLUMNS)]
    return out.astype({"rank": np.int64, "step": np.int64, "micro_index": np.int64, "epoch": np.int64,
                       "example_id": str})


def _fit(trainer):
    """``trainer.fit()`` on a helper thread. Ray Train installs its own SIGINT handler when ``fit`` runs on the
    main thread (it aborts the run and exits 1 with no message); from another thread it does not, so the main
    thread keeps the caller's handlers, and an interrupt raised there stops the run where the caller decides
    (the recipe shuts Ray down, which stops the workers; checkpoints already on disk stay)."""
    import threading

    box: dict = {}

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread below
            box["error"] = err

    thread = threading.Thread(target=target, name="ray-cluster-ft-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in box:
        raise box["error"]
    return box["result"]


def _trainer(cfg: TrainConfig, tables: list[pa.Table], run_dir: Path, loop_config: dict):
    """The ``TorchTrainer``: one dataset per rank handed over unsplit and in order, the worker loop, checkpoints
    under ``run_dir/ray_train`` (only the latest kept), retries from the latest checkpoint."""
    import ray.data
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from ..model import cache_dir

    # Ray Train's print patch both tees and logs every print of a worker: the progress lines came out twice.
    # HF_HUB_OFFLINE: the workers read the folder the driver resolved and never reach a hub.
    env = {"TORCH_EXTENSIONS_DIR": str(cache_dir() / "torch_extensions"), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
           "HF_HUB_OFFLINE": "1"}
    if not cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    datasets = {}
    for r, t in enumerate(tables):
        ds = ray.data.from_arrow(t)
        # Per-dataset context copy: the workers log their own progress; per-batch data bars only add noise.
        ds.context.enable_progress_bars = False
        datasets[f"train_rank{r}"] = ds
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        run_config=ray.train.RunConfig(
            name="train",
            storage_path=str(run_dir / "ray_train"),
            worker_runtime_env={"env_vars": env},
            # Only the latest checkpoint is kept (the demo model's ZeRO-2 checkpoint is about 2 GB). The workers
            # write each checkpoint once, straight into its folder here (loop._checkpoint).
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo", timeout_s=cfg.timeout_s),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(
            datasets_to_split=[], execution_options=ray.data.ExecutionOptions(preserve_order=True)
        ),
    )


def _check_plan(plan: pd.DataFrame, world: int, cfg: TrainConfig, packing: bool) -> int:
    """:func:`ray_cluster_ft.allocate.check_plan` (the hard rules: every rank, even micro-batch counts,
    ``micro_index`` 0..G-1 per rank and step, steps within an epoch); returns the optimizer steps. A packed plan
    has any number of rows per micro-batch: its packs are checked in tokens (``train.max_tokens_per_micro_batch``)
    instead of rows. A short tail (an epoch's last micro-batch or step, the published plan) is accepted: the
    workers step at the plan's boundaries."""
    if not packing:
        return check_plan(plan, world, cfg.micro_batch_size, cfg.grad_accum, short_tail=True)
    if cfg.max_tokens_per_micro_batch is None:
        raise ValueError("a packed plan needs train.max_tokens_per_micro_batch (the tokens a pack may hold)")
    return check_plan(plan, world, 1, cfg.grad_accum, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                      short_tail=True)


def _short_tail(plan: pd.DataFrame, world: int, cfg: TrainConfig, packing: bool) -> tuple[bool, int]:
    """``(short, micro-batches per rank)``: whether some step holds fewer than ``grad_accum`` micro-batches or
    (unpacked) some micro-batch fewer than ``micro_batch_size`` rows (the published plan's last ones), which the
    workers then read by key and step at the plan's boundaries; and the micro-batches every rank trains."""
    mb = plan.groupby(["rank", "step", "micro_index"], sort=False).size()
    per_step = mb.groupby(level=["rank", "step"]).size()
    short = bool((per_step < cfg.grad_accum).any() or (not packing and (mb < cfg.micro_batch_size).any()))
    return short, int(mb.size // world)


def _clear_run_dir(run_dir: str | Path, resume: bool) -> Path:
    """The absolute run directory, made, with the training outputs of an earlier run removed (a resume keeps
    its checkpoints, trained rows and step log)."""
    run_dir = Path(run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Ray Train resumes from any checkpoint under the same RunConfig(name, storage_path): a fresh run must
    # not find the last run's.
    for stale in ["final_model"] if resume else ["trained", "final_model", "ray_train", "epochs"]:
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    (run_dir / "trained").mkdir(exist_ok=True)
    for stale in ("trained.parquet",) if resume else ("train_log.jsonl", "trained.parquet"):
        (run_dir / stale).unlink(missing_ok=True)
    return run_dir


def _check_trained(run_dir: Path, world: int, plan: pd.DataFrame) -> Path:
    """Write the rows the workers trained to ``run_dir/trained.parquet`` and return its path.

    Raises:
        RuntimeError: they are not exactly the plan's rows, in the plan's order on every rank.
    """
    trained = _consolidate_trained(run_dir, world)
    trained_path = run_dir / "trained.parquet"
    trained.to_parquet(trained_path, index=False)
    expected = plan.sort_values(["rank", *MICRO_BATCH_KEY], kind="stable")
    same = all(
        np.array_equal(trained[c].to_numpy(), expected[c].to_numpy(np.int64)) for c in ("rank", *MICRO_BATCH_KEY)
    ) and np.array_equal(trained["example_id"].to_numpy(), expected["example_id"].astype(str).to_numpy())
    if not same:
        raise RuntimeError(f"the workers did not train the plan: see {trained_path}")
    return trained_path


def train(
    plan: pd.DataFrame,
    examples: pa.Table | pd.DataFrame,
    cfg: TrainConfig,
    model_path: str,
    run_dir: str | Path,
    *,
    trust_remote_code: bool = False,
    save_model: bool = True,
    pad_token_id: int = 0,
    resume: bool = False,
    weights: pd.Series | None = None,
    attn_implementation: str | None = None,
    packing: bool = False,
    save_epoch_models: bool = False,
) -> TrainResult:
    """Train ``model_path`` on exactly the planned micro-batches with Ray Train + DeepSpeed.

    Expects Ray to be initialised by the caller (otherwise Ray starts a local instance with defaults). Each of
    ``cfg.num_workers`` workers takes ``cfg.cpus_per_worker`` CPUs (and one GPU with ``cfg.use_gpu``). On CPU the
    workers get ``DS_ACCELERATOR=cpu`` and the gloo backend; on GPU NCCL and bf16. ``TORCH_EXTENSIONS_DIR`` points at ``cache_dir()/torch_extensions`` so any DeepSpeed op that is
    compiled is compiled once.

    Args:
        plan: allocation plan, columns ``epoch, step, rank, micro_index, example_id`` (+ any others), sorted
            by ``(rank, epoch, step, micro_index, position)``; see :func:`ray_cluster_ft.allocate.check_plan`.
        examples: ``example_id`` (str), ``input_ids``, ``labels`` (list<int32>, -100 on prompt tokens).
        cfg: the ``train`` section of the job config.
        model_path: ``demo`` or a local Hugging Face folder, resolved here on the driver with
            ``resolve_model_path`` to the absolute folder the workers load (a hub id must be resolved to a folder
            first, :func:`ray_cluster_ft.model.resolve_models`: workers refuse names).
        run_dir: the run directory (local path visible to the driver and every worker).
        trust_remote_code: passed to ``from_pretrained``.
        save_model: write ``run_dir/final_model`` (HF format + tokenizer).
        pad_token_id: id used to right-pad micro-batches (masked out of attention and loss).
        attn_implementation: the model's attention kernel (``model.attn_implementation``; ``None``: the library's).
        weights: per-example loss weights by ``example_id`` (the selection weights, ``train.loss_weighting:
            cluster``); ``None`` weighs every example 1; the loss is token-exact (:mod:`ray_cluster_ft.train.step`).
        packing: the plan's micro-batches are packs (``allocation.packing``): any number of whole rows per
            ``(rank, step, micro_index)``, at most ``cfg.max_tokens_per_micro_batch`` tokens each (when set), each
            trained as one padding-free sequence with ``position_ids`` restarting per example
            (:func:`ray_cluster_ft.data.collate.pack`). ``cfg.micro_batch_size`` is then not a row count.
        save_epoch_models: at the end of every epoch but the last, rank 0 also writes the model (HF format, LoRA
            adapters merged, with the tokenizer) to ``run_dir/epochs/epoch{e}`` (e = 1, 2, ...), for the per-epoch
            evaluation (``evaluation.every_epoch``); the last epoch's model is ``final_model``.
        resume: continue from the newest complete checkpoint under ``run_dir/ray_train`` (a stopped run of the
            same plan: Ray's latest, or a newer complete one on disk; incomplete ones are skipped and reported);
            False starts clean, deleting that run's checkpoints and logs. Only the final checkpoint is kept after
            the run (none with ``cfg.final_checkpoint`` off: only ``final_model/``).

    Fault tolerance: ``cfg.max_failures`` worker-group restarts, each resuming from the latest checkpoint
    (written every ``cfg.checkpoint_every`` steps and at the end). For tests, ``$RAY_CLUSTER_FT_FAIL_AT_STEP=N``
    makes rank 0 raise once per run directory at the start of optimizer step N (1-based).

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: an uneven or malformed plan, a pack over ``cfg.max_tokens_per_micro_batch`` tokens, or
            plan/examples that do not join (before any worker starts).
        FileNotFoundError: ``model_path`` is a missing local folder.
        RuntimeError: the workers trained something other than the plan.
        ray.train.TrainingFailedError: a worker failed.
    """
    from ..model import resolve_model_path

    world = cfg.num_workers
    total_steps = _check_plan(plan, world, cfg, packing)
    tables = build_rank_tables(plan, examples, world, weights,
                               max_tokens_per_pack=cfg.max_tokens_per_micro_batch if packing else None)
    model_dir = resolve_model_path(model_path)
    tokenizer = _saved_tokenizer(model_dir, trust_remote_code) if save_model else None
    run_dir = _clear_run_dir(run_dir, resume)

    storage = run_dir / "ray_train" / "train"
    this_plan = plan_hash(plan)
    resume_from, skipped = newest_complete_checkpoint(storage, world, this_plan) if resume else (None, [])
    for line in skipped:
        print(f"[train] skipped incomplete checkpoint {line}", flush=True)
    trainer = _trainer(cfg, tables, run_dir, _loop_config(
        cfg, total_steps, model_dir=model_dir, run_dir=run_dir, plan_hash=this_plan, resume_checkpoint=resume_from,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, save_model=save_model,
        pad_token_id=pad_token_id, packing=packing, plan=plan, save_epoch_models=save_epoch_models))
    t0 = time.perf_counter()
    result = _fit(trainer)
    seconds = time.perf_counter() - t0
    keep = result.checkpoint.path if result.checkpoint is not None else None
    if keep is None and cfg.final_checkpoint:  # a resumed run that had nothing left to train wrote none
        keep, _ = newest_complete_checkpoint(storage, world, this_plan)
    prune_checkpoints(storage, keep if cfg.final_checkpoint else None)
    keep = keep if cfg.final_checkpoint else None

    trained_path = _check_trained(run_dir, world, plan)
    return _train_result(run_dir, cfg, result.metrics or {}, total_steps, seconds, keep, trained_path, tokenizer)


def _saved_tokenizer(model_dir: str, trust_remote_code: bool):
    """The tokenizer saved beside the final model, loaded before the run so that a model folder without one
    fails now, not after training."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def _loop_config(cfg: TrainConfig, total_steps: int, *, model_dir: str, run_dir: Path, plan_hash: str,
                 resume_checkpoint, attn_implementation, trust_remote_code: bool, save_model: bool,
                 pad_token_id: int, packing: bool, plan: pd.DataFrame, save_epoch_models: bool) -> dict:
    """The ``train_loop_config`` every worker gets (:func:`ray_cluster_ft.train.loop.train_loop_per_worker`): the
    train section, the DeepSpeed dict built once here on the driver, and the run's facts (from ``plan``: the
    micro-batches per rank, whether it has a short tail (:func:`_short_tail`), the epochs' last steps)."""
    short_tail, n_micro = _short_tail(plan, cfg.num_workers, cfg, packing)
    return {
        "train": cfg.model_dump(),
        "ds_config": build_deepspeed_config(cfg, total_steps),
        "precision": precision_for(cfg),
        "gradient_checkpointing": cfg.use_gpu if cfg.gradient_checkpointing is None else cfg.gradient_checkpointing,
        "attn_implementation": attn_implementation,
        "model_dir": model_dir,
        "trust_remote_code": trust_remote_code,
        "run_dir": str(run_dir),
        "total_steps": total_steps,
        "micro_batches_per_rank": n_micro,
        "short_tail": short_tail,
        "save_model": save_model,
        "pad_token_id": int(pad_token_id),
        "plan_hash": plan_hash,
        "fail_at_step": os.environ.get(FAIL_AT_STEP_ENV),
        "resume_checkpoint": resume_checkpoint,
        "packing": bool(packing),
        "epoch_ends": _epoch_ends(plan) if save_epoch_models else {},
    }


def _epoch_ends(plan: pd.DataFrame) -> dict[int, int]:
    """``{last global step of epoch e: e}`` for every epoch but the last (the plan's steps are global)."""
    last = plan.groupby("epoch")["step"].max().sort_index()
    return {int(step): int(epoch) for epoch, step in last.iloc[:-1].items()}


def _train_result(run_dir: Path, cfg: TrainConfig, metrics: dict, total_steps: int, seconds: float,
                  checkpoint: str | None, trained_path: Path, tokenizer) -> TrainResult:
    """The :class:`TrainResult` of a finished run, from its step log; the tokenizer saved beside the final model
    (``tokenizer`` None: no model saved).

    Raises:
        RuntimeError: the step log has another number of steps than the plan.
    """
    log_path = run_dir / "train_log.jsonl"
    log = pd.read_json(log_path, lines=True)
    if len(log) != total_steps:
        raise RuntimeError(f"train log has {len(log)} steps, the plan {total_steps}")
    final_dir = None
    if tokenizer is not None:
        final_dir = run_dir / "final_model"
        for folder in [final_dir, *sorted((run_dir / "epochs").glob("epoch*"))]:
            tokenizer.save_pretrained(folder)
    per_rank = np.asarray(log["step_time_s_per_rank"].tolist(), dtype=np.float64)  # (steps, world)
    waits = np.asarray(log["wait_s_per_rank"].tolist(), dtype=np.float64)
    return TrainResult(
        final_model_dir=final_dir,
        steps=total_steps,
        seconds=seconds,
        final_loss=float(log["loss"].iloc[-1]),
        log_path=log_path,
        trained_path=trained_path,
        checkpoint_path=checkpoint,
        init_seconds=float(metrics.get("init_s", float("nan"))),
        step_time_p50_s=np.percentile(per_rank, 50, axis=0).round(4).tolist(),
        step_time_p90_s=np.percentile(per_rank, 90, axis=0).round(4).tolist(),
        wait_mean_s=waits.mean(axis=0).round(4).tolist(),
        resumed_from_step=int(metrics.get("resumed_from_micro_batch", 0)) // cfg.grad_accum,
    )


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


NOT_TRAINED = {"matches_plan": None, "once_per_epoch": None, "distinct_trained": 0, "mismatched_ranks": []}
"""The manifest's ``checks`` of a run that trained nothing (``--plan-only``)."""


@dataclass(frozen=True)
class TrainOutput:
    """What the training stage hands on.

    Attributes:
        result: the :class:`TrainResult` of :func:`train`.
        checks: :func:`verify_trained` of ``trained.parquet`` against the plan (the manifest's ``checks``).
    """

    result: TrainResult
    checks: dict

    @property
    def summary(self) -> dict:
        """The manifest's ``train`` entry: steps, seconds, final loss, the final model folder (or None), per-rank
        step-time percentiles and all-reduce waits, and the steps a resumed run found done."""
        r = self.result
        return {"steps": r.steps, "seconds": r.seconds, "final_loss": r.final_loss,
                "final_model": str(r.final_model_dir) if r.final_model_dir else None,
                "step_time_p50_s": list(r.step_time_p50_s), "step_time_p90_s": list(r.step_time_p90_s),
                "wait_mean_s": list(r.wait_mean_s), "resumed_from_step": r.resumed_from_step}


def run(cfg, run_dir: Path, *, plan: pd.DataFrame, candidates: pa.Table, model_path: str, pad_token_id: int,
        weights: pd.Series | None = None, resume: bool = False, pack_tokens: int | None = None) -> TrainOutput:
    """The training stage: :func:`train` on the planned rows of ``candidates`` (the whole candidates table;
    only the rows the plan names are sent to the workers), then the trained log checked against the plan.
    ``pack_tokens``: a packed plan's pack size (``PlanResult.pack_tokens``: ``train.max_tokens_per_micro_batch``
    or the size chosen from the data under ``allocation.packing: auto``), the most tokens a pack may hold.

    Returns:
        :class:`TrainOutput`.

    Raises:
        RuntimeError: the workers trained something other than the plan.
    """
    from ..rundir import claim

    claim(run_dir, "trained", "trained.parquet", "train_log.jsonl", "ray_train", "final_model", "epochs",
          ".fault_injected")
    ids = np.asarray(candidates.column("example_id").to_pylist())
    planned = candidates.filter(pa.array(np.isin(ids, plan["example_id"].unique())))
    train_cfg = cfg.train
    if cfg.packed and pack_tokens is not None:
        train_cfg = cfg.train.model_copy(update={"max_tokens_per_micro_batch": int(pack_tokens)})
    res = train(plan, planned, train_cfg, model_path, run_dir, trust_remote_code=cfg.model.trust_remote_code,
                save_model=cfg.output.save_model, pad_token_id=pad_token_id, resume=resume,
                weights=weights if cfg.train.loss_weighting == "cluster" else None,
                attn_implementation=cfg.model.attn_implementation, packing=cfg.packed,
                save_epoch_models=cfg.evaluation.every_epoch and cfg.output.save_model)
    return TrainOutput(res, verify_trained(plan, pd.read_parquet(Path(run_dir) / "trained.parquet")))
