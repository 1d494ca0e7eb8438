"""Training stage: Ray Train launches DeepSpeed workers that train exactly the micro-batches of the plan.

DESIGN.md "Train". The driver joins the allocation plan with the tokenized examples and builds one Ray
dataset per rank (rows in plan order); ``DataConfig(datasets_to_split=[])`` with ``preserve_order=True``
hands rank ``r`` the dataset ``train_rank{r}`` unsplit and in order, so every rank trains the rows the
plan assigned to it at the planned step (CluSTER, Kim et al., EMNLP 2026, the allocation half of the
method). Each worker loads the model, wraps it with ``deepspeed.initialize`` (ZeRO 0-3; fp32 + gloo on
CPU, bf16 + NCCL on GPU) and runs ``engine(...)``, ``engine.backward``, ``engine.step`` per micro-batch;
DeepSpeed steps the optimizer every ``grad_accum`` micro-batches.

Artifacts written under ``run_dir``:

- ``trained/rank{r}.jsonl`` and, after the run, ``trained.parquet``: one row per trained example
  (rank, step, micro_index, epoch, example_id), in training order; the driver checks it equals the plan.
- ``train_log.jsonl``: one row per optimizer step (loss averaged over ranks, tokens, timings, lr).
- ``ray_train/train/``: Ray Train's run folder with the final DeepSpeed checkpoint (all ranks' shards).
- ``final_model/``: the trained model in Hugging Face format plus the tokenizer (``save_model=True``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from .allocate import check_plan
from .config import TrainConfig

__all__ = [
    "TrainResult",
    "deepspeed_config",
    "merge_deepspeed_config",
    "lr_multiplier",
    "build_rank_tables",
    "pad_micro_batch",
    "plan_hash",
    "train",
]

PLAN_COLUMNS = ("epoch", "step", "rank", "micro_index", "example_id")
TRAINED_COLUMNS = ("rank", "step", "micro_index", "epoch", "example_id")
IGNORE_INDEX = -100  # Hugging Face's label value for "no loss on this token"
_KEY = ["epoch", "step", "micro_index"]
FAIL_AT_STEP_ENV = "RAY_CLUSTER_FT_FAIL_AT_STEP"  # fault injection for tests: rank 0 raises once at this step


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
        checkpoint_path: the final Ray Train checkpoint folder (DeepSpeed state of every rank); None if
            Ray reported none.
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


# --------------------------------------------------------------------------------------------------------
# DeepSpeed configuration and learning-rate schedule


def lr_multiplier(step_index: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor for the optimizer step ``step_index`` (0-based): linear warm-up, then linear decay.

    ``(i + 1) / (warmup_steps + 1)`` during warm-up (never 0, so no step is wasted), then
    ``(total_steps - i) / (total_steps - warmup_steps)`` (1 at the first step after warm-up, ``1 / (T - W)``
    at the last step). The usual linear schedule of fine-tuning recipes (e.g. Hugging Face
    ``get_linear_schedule_with_warmup``), shifted so the first step trains.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps < 0`` or ``step_index < 0``.
    """
    if total_steps < 1 or warmup_steps < 0 or step_index < 0:
        raise ValueError(
            f"lr_multiplier: need total_steps >= 1, warmup_steps >= 0, step_index >= 0; "
            f"got {total_steps}, {warmup_steps}, {step_index}"
        )
    if step_index < warmup_steps:
        return (step_index + 1) / (warmup_steps + 1)
    return max(0.0, (total_steps - step_index) / max(1, total_steps - warmup_steps))


def _make_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """DeepSpeed client scheduler factory (called with the basic optimizer inside ``deepspeed.initialize``)."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps)
    )


def deepspeed_config(cfg: TrainConfig, total_steps: int) -> dict:
    """The DeepSpeed config dict for ``cfg``.

    - batch: ``train_micro_batch_size_per_gpu = micro_batch_size``, ``gradient_accumulation_steps =
      grad_accum``, ``train_batch_size`` = their product times ``num_workers`` (DeepSpeed checks it
      against the real world size);
    - ``zero_optimization.stage = zero_stage``; ``gradient_clipping = max_grad_norm``;
    - precision: bf16 on GPU, fp32 on CPU (fp16 is not supported on CPU, NOTES-ray-deepspeed.md);
    - optimizer: AdamW with ``torch_adam: true`` (torch's AdamW, so no JIT-compiled FusedAdam);
    - no ``scheduler`` entry: DeepSpeed's ``WarmupDecayLR`` sets the learning rate to ``warmup_min_lr`` at
      construction and clamps warm-up to >= 2 steps, so with ``warmup_min_lr = 0`` the first two steps do
      not train at all (and with ``warmup_min_lr = lr`` there is no decay). The workers pass the linear
      warm-up + linear decay of :func:`lr_multiplier` as a client ``LambdaLR`` instead, which trains from the
      first step; ``total_steps`` is validated here for that schedule;
    - ``steps_per_print`` large: the training loop logs its own steps.

    Raises:
        ValueError: ``total_steps < 1``.
    """
    if total_steps < 1:
        raise ValueError(f"deepspeed_config: total_steps must be >= 1, got {total_steps}")
    zero: dict[str, Any] = {"stage": int(cfg.zero_stage)}
    if cfg.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(cfg.use_gpu)}
    if cfg.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": bool(cfg.use_gpu)}
    ds = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * cfg.num_workers,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(cfg.use_gpu)},
        "fp16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.deepspeed_config:
        ds = merge_deepspeed_config(ds, json.loads(Path(cfg.deepspeed_config).read_text(encoding="utf-8")))
    return ds


def merge_deepspeed_config(base: dict, user: dict) -> dict:
    """``user`` merged over ``base``, recursively: nested mappings merge key by key, any other user value wins.

    The batch keys (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``)
    must agree with the plan, which fixed them: a user value that differs raises. Where ``base`` holds a
    mapping (``optimizer``, ``zero_optimization``, ...) the user's value must be a mapping too: DeepSpeed would
    otherwise fail inside every training worker.

    Raises:
        ValueError: a user batch key that contradicts the job config (the plan's micro-batches would not fit),
            or a non-mapping where ``base`` has a mapping.
    """
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if key in user and user[key] != base.get(key):
            raise ValueError(
                f"the DeepSpeed config sets {key}={user[key]!r} but the plan was built for {base.get(key)!r}; "
                f"set train.micro_batch_size / train.grad_accum / train.num_workers instead"
            )
    return _deep_merge(base, user)


def _deep_merge(base: dict, over: dict, prefix: str = "") -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(out.get(key), dict):
            if not isinstance(value, dict):
                raise ValueError(f"the DeepSpeed config sets {prefix}{key}={value!r}, but DeepSpeed expects a mapping "
                                 f"(a JSON object) there")
            out[key] = _deep_merge(out[key], value, f"{prefix}{key}.")
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------------------
# Plan checks (driver side, before any worker starts)


def _require_columns(plan: pd.DataFrame, columns: Sequence[str]) -> None:
    if not isinstance(plan, pd.DataFrame):
        raise ValueError(f"plan must be a pandas DataFrame, got {type(plan).__name__}")
    missing = [c for c in columns if c not in plan.columns]
    if missing:
        raise ValueError(f"plan is missing columns {missing} (has {list(plan.columns)})")


# --------------------------------------------------------------------------------------------------------
# Data: plan x examples -> one table per rank


def _examples_table(examples: pa.Table | pd.DataFrame) -> pa.Table:
    cols = ["example_id", "input_ids", "labels"]
    if isinstance(examples, pd.DataFrame):
        missing = [c for c in cols if c not in examples.columns]
        if missing:
            raise ValueError(f"examples are missing columns {missing}")
        examples = pa.Table.from_pandas(examples[cols], preserve_index=False)
    if not isinstance(examples, pa.Table):
        raise ValueError(f"examples must be a pyarrow Table or pandas DataFrame, got {type(examples).__name__}")
    missing = [c for c in cols if c not in examples.column_names]
    if missing:
        raise ValueError(f"examples are missing columns {missing}")
    t = examples.select(cols).combine_chunks()
    return t.set_column(0, "example_id", pc.cast(t.column("example_id"), pa.string()))


def _check_token_columns(t: pa.Table) -> None:
    """input_ids/labels: no nulls, equal non-zero lengths, at least one trainable (shifted) label each."""
    ids, labels = t.column("input_ids"), t.column("labels")
    if ids.null_count or labels.null_count:
        raise ValueError("examples have null input_ids or labels")
    n_ids = pc.list_value_length(ids).to_numpy()
    n_lab = pc.list_value_length(labels).to_numpy()
    eid = t.column("example_id").to_numpy(zero_copy_only=False)
    bad = np.flatnonzero((n_ids != n_lab) | (n_ids < 2))
    if bad.size:
        raise ValueError(
            f"{bad.size} planned examples have len(input_ids) != len(labels) or fewer than 2 tokens, "
            f"e.g. {eid[bad[:5]].tolist()}"
        )
    # Causal LMs shift labels by one, so the first token's label never counts: an example needs a
    # non-ignored label at position >= 1, else a micro-batch of such examples has a 0/0 (NaN) loss.
    values = pc.list_flatten(labels).to_numpy() != IGNORE_INDEX
    starts = np.cumsum(n_lab) - n_lab
    values[starts] = False
    owner = np.repeat(np.arange(len(n_lab)), n_lab)
    trainable = np.bincount(owner, weights=values, minlength=len(n_lab))
    bad = np.flatnonzero(trainable == 0)
    if bad.size:
        raise ValueError(
            f"{bad.size} planned examples have no label token to train on (all -100), e.g. {eid[bad[:5]].tolist()}"
        )


def build_rank_tables(plan: pd.DataFrame, examples: pa.Table | pd.DataFrame, world_size: int) -> list[pa.Table]:
    """Join the plan with the tokenized examples: one table per rank, rows in plan order.

    Args:
        plan: the allocation plan (columns ``epoch, step, rank, micro_index, example_id``), rows of one
            micro-batch in their planned position order.
        examples: ``example_id`` (str), ``input_ids`` and ``labels`` (list<int>) per example.
        world_size: ranks.

    Returns:
        ``world_size`` tables with columns ``example_id`` (string), ``epoch, step, micro_index`` (int64),
        ``input_ids, labels`` (list<int>), sorted by ``(epoch, step, micro_index)`` with a stable sort, so the
        in-micro-batch position order of the plan is kept.

    Raises:
        ValueError: plan ids absent from ``examples``, duplicate example ids, bad token columns (see
            :func:`_check_token_columns`).
    """
    _require_columns(plan, PLAN_COLUMNS)
    ex = _examples_table(examples)
    index = pd.Index(ex.column("example_id").to_numpy(zero_copy_only=False))
    if index.has_duplicates:
        dup = index[index.duplicated()].unique()[:5].tolist()
        raise ValueError(f"examples hold duplicate example_id values, e.g. {dup}")
    plan_ids = plan["example_id"].astype(str).to_numpy()
    pos = index.get_indexer(plan_ids)
    if (pos < 0).any():
        missing = pd.unique(plan_ids[pos < 0])
        raise ValueError(f"{missing.size} planned example ids are not in examples, e.g. {missing[:5].tolist()}")
    used = np.unique(pos)
    _check_token_columns(ex.take(pa.array(used)))

    order = plan.assign(_pos=pos).sort_values(["rank", *_KEY], kind="stable")
    tables = []
    for r in range(world_size):
        part = order[order["rank"] == r]
        rows = ex.take(pa.array(part["_pos"].to_numpy()))
        tables.append(
            pa.table(
                {
                    "example_id": pa.array(part["example_id"].astype(str).to_numpy(), pa.string()),
                    "epoch": pa.array(part["epoch"].to_numpy(np.int64)),
                    "step": pa.array(part["step"].to_numpy(np.int64)),
                    "micro_index": pa.array(part["micro_index"].to_numpy(np.int64)),
                    "input_ids": rows.column("input_ids"),
                    "labels": rows.column("labels"),
                }
            )
        )
    return tables


def pad_micro_batch(
    input_ids: Sequence[np.ndarray], labels: Sequence[np.ndarray], pad_token_id: int
) -> dict[str, np.ndarray]:
    """Right-pad one micro-batch to its longest sequence.

    Args:
        input_ids: B integer sequences (lengths L_i >= 1).
        labels: B sequences of the same lengths (``-100`` where no loss is taken).
        pad_token_id: id written into padded ``input_ids`` positions.

    Returns:
        ``input_ids``, ``labels`` and ``attention_mask``, each int64 of shape (B, max L_i); padded positions
        hold ``pad_token_id``, ``-100`` and 0.

    Raises:
        ValueError: empty batch, mismatched counts or lengths.
    """
    if len(input_ids) == 0 or len(input_ids) != len(labels):
        raise ValueError(f"pad_micro_batch: need B >= 1 equal-count sequences, got {len(input_ids)} and {len(labels)}")
    ids = [np.asarray(x, dtype=np.int64).ravel() for x in input_ids]
    lab = [np.asarray(x, dtype=np.int64).ravel() for x in labels]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    if not np.array_equal(lengths, [len(x) for x in lab]):
        raise ValueError("pad_micro_batch: input_ids and labels lengths differ")
    mask = np.arange(lengths.max()) < lengths[:, None]
    out_ids = np.full(mask.shape, pad_token_id, dtype=np.int64)
    out_lab = np.full(mask.shape, IGNORE_INDEX, dtype=np.int64)
    out_ids[mask] = np.concatenate(ids)
    out_lab[mask] = np.concatenate(lab)
    return {"input_ids": out_ids, "labels": out_lab, "attention_mask": mask.astype(np.int64)}


# --------------------------------------------------------------------------------------------------------
# Worker


def _disable_shm_comm() -> None:
    """Stop DeepSpeed from JIT-compiling its shared-memory all-reduce op (``deepspeed_shm_comm``) on CPU.

    The op only serves inference all-reduce but costs about a minute of C++ compilation at the first
    ``deepspeed.initialize`` on CPU; DeepSpeed's ``build_shm_op`` skips it when this entry of the (private)
    compatible-ops table is False (NOTES-ray-deepspeed.md, DeepSpeed 0.19.8). The one place that touches
    the private hook.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _check_micro_batch(batch: dict[str, np.ndarray], micro_batch_size: int) -> tuple[int, int, int]:
    """(epoch, step, micro_index) of a batch that must be exactly one planned micro-batch."""
    n = len(batch["example_id"])
    key = tuple(np.unique(batch[c]) for c in _KEY)
    if n != micro_batch_size or any(k.size != 1 for k in key):
        raise RuntimeError(
            f"a batch of {n} rows spans (epoch, step, micro_index) values {[k.tolist() for k in key]}; expected "
            f"exactly one planned micro-batch of {micro_batch_size} rows (is the dataset order preserved?)"
        )
    return int(key[0][0]), int(key[1][0]), int(key[2][0])


def _append_jsonl(fh, rows: list[dict]) -> None:
    fh.write("".join(json.dumps(r) + "\n" for r in rows))
    fh.flush()


def _truncate_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of a JSONL log (rows written after the checkpoint are trained again)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    complete = [x for x in lines if x.endswith("\n")]
    if len(complete) < keep:
        raise RuntimeError(f"{path} holds {len(complete)} complete rows but the checkpoint says {keep} were trained")
    path.write_text("".join(complete[:keep]), encoding="utf-8")


def _restore(engine, rank: int, plan_hash: str) -> int:
    """Load Ray Train's latest checkpoint (if any) into ``engine``; returns the micro-batches it already trained."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        pos = json.loads((Path(d) / f"plan_position_rank{rank}.json").read_text())
        if pos.get("plan_hash") != plan_hash:
            raise RuntimeError(
                f"the checkpoint in {ckpt.path} was written for another plan (plan hash {pos.get('plan_hash')}, "
                f"this run's is {plan_hash}); resume only with the run's own plan, or start a fresh run directory"
            )
        load_path, _ = engine.load_checkpoint(d, tag=pos["tag"])
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint '{pos['tag']}' in {ckpt.path}")
    return int(pos["micro_batches_done"])


def _checkpoint(engine, rank: int, done: int, steps_done: int, plan_hash: str, metrics: dict) -> None:
    """Every rank saves its DeepSpeed shard and its plan position; Ray merges them into one checkpoint."""
    import ray.train

    tag = f"step{steps_done}"
    with tempfile.TemporaryDirectory(prefix="ds_ckpt_") as tmp:
        engine.save_checkpoint(tmp, tag=tag)
        # One position file per rank, so Ray's merge of the ranks' checkpoint folders cannot collide.
        (Path(tmp) / f"plan_position_rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "micro_batches_done": done, "steps_done": steps_done, "tag": tag, "plan_hash": plan_hash}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _metric_handles(rank: int) -> dict:
    """The training metrics exported to Ray's metrics agent (Prometheus / the dashboard's Metrics view)."""
    from ray.util.metrics import Counter, Gauge, Histogram

    tags = {"rank": str(rank)}
    m = {
        "step_s": Histogram("ray_cluster_ft_train_step_seconds", "optimizer-step wall time of this rank",
                            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160], tag_keys=("rank",)),
        "wait_s": Gauge("ray_cluster_ft_train_wait_seconds",
                        "approximate wait at the gradient all-reduce in the last step (step time - compute time)",
                        tag_keys=("rank",)),
        "tokens": Counter("ray_cluster_ft_train_tokens_total", "real (non-padding) tokens trained by this rank",
                          tag_keys=("rank",)),
        "tps": Gauge("ray_cluster_ft_train_tokens_per_second", "this rank's real tokens / its step time",
                     tag_keys=("rank",)),
        "loss": Gauge("ray_cluster_ft_train_loss", "last step's loss averaged over ranks", tag_keys=("rank",)),
    }
    for h in m.values():
        h.set_default_tags(tags)
    return m


def _train_loop_per_worker(config: dict) -> None:
    """Ray Train worker: DeepSpeed-train this rank's planned micro-batches, log, checkpoint, save the model.

    After a worker-group restart (or a driver-level resume) the worker loads the latest checkpoint, cuts its
    logs back to the checkpoint's plan position and skips that many micro-batches of its (re-created, same
    order) dataset iterator, so every planned micro-batch is trained exactly once in the final model's history.
    """
    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist

    from .model import load_model

    cfg = TrainConfig(**config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = Path(config["run_dir"])
    total_steps, n_micro = config["total_steps"], config["micro_batches_per_rank"]
    mbs, ga = cfg.micro_batch_size, cfg.grad_accum
    fail_at = int(config["fail_at_step"] or 0)
    torch.manual_seed(cfg.seed)

    _disable_shm_comm()
    t0 = time.perf_counter()
    # bf16 weights on GPU: a 7B model in fp32 would need 28 GB per rank before ZeRO shards it (DeepSpeed keeps
    # its own fp32 master copy in the optimizer state).
    model = load_model(config["model_dir"], trust_remote_code=config["trust_remote_code"],
                       dtype=torch.bfloat16 if cfg.use_gpu else torch.float32)
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        model = get_peft_model(model, PeftLoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    t_load = time.perf_counter() - t0
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config["ds_config"],
        lr_scheduler=partial(_make_scheduler, warmup_steps=cfg.warmup_steps, total_steps=total_steps),
    )
    t_init = time.perf_counter() - t0
    engine.train()
    device = engine.device
    start = _restore(engine, rank, config["plan_hash"])
    if rank == 0:
        print(f"[train] model loaded in {t_load:.1f}s, deepspeed.initialize done at {t_init:.1f}s "
              f"(ZeRO-{cfg.zero_stage}{', LoRA' if cfg.lora.enabled else ''}, world {world}, {total_steps} steps)"
              + (f"; resumed after step {start // ga}" if start else ""), flush=True)

    trained_path = run_dir / "trained" / f"rank{rank}.jsonl"
    _truncate_lines(trained_path, start * mbs)
    trained_fh = open(trained_path, "a", encoding="utf-8")
    log_fh = None
    if rank == 0:
        _truncate_lines(run_dir / "train_log.jsonl", start // ga)
        log_fh = open(run_dir / "train_log.jsonl", "a", encoding="utf-8")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    meters = _metric_handles(rank)
    shard = ray.train.get_dataset_shard(f"train_rank{rank}")
    done = 0
    cur_step = None
    step_t0 = step_lr = fwd_s = 0.0
    # This rank's step sums (loss over micro-batches, real tokens, padded tokens), kept on the device so the
    # micro-batch loop never waits for the accelerator; read once per step by the all-gather.
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    metrics: dict[str, Any] = {}
    t_train = time.perf_counter()
    try:
        for batch in shard.iter_batches(batch_size=mbs, batch_format="numpy"):
            epoch, step, micro = _check_micro_batch(batch, mbs)
            if micro != done % ga or (micro == 0 and cur_step is not None and step <= cur_step) or (
                micro > 0 and step != cur_step
            ):
                raise RuntimeError(
                    f"rank {rank}: micro-batch (epoch {epoch}, step {step}, micro_index {micro}) arrived out of plan "
                    f"order after {done} micro-batches"
                )
            cur_step = step
            if done < start:  # trained before the checkpoint this run resumed from
                done += 1
                continue
            if micro == 0:
                n_step = done // ga + 1
                if fail_at == n_step and rank == 0 and not (run_dir / ".fault_injected").exists():
                    (run_dir / ".fault_injected").touch()
                    raise RuntimeError(f"injected failure at step {n_step} ({FAIL_AT_STEP_ENV}={fail_at})")
                step_t0 = time.perf_counter()
                fwd_s = 0.0
                step_lr = float(engine.get_lr()[0])  # the lr this step trains with (the scheduler steps after it)
                acc.zero_()
            mb = {k: torch.from_numpy(v).to(device) for k, v in
                  pad_micro_batch(batch["input_ids"], batch["labels"], config["pad_token_id"]).items()}
            t_f = time.perf_counter()
            loss = engine(**mb, use_cache=False).loss
            sync()
            fwd_s += time.perf_counter() - t_f
            engine.backward(loss)
            engine.step()
            _append_jsonl(trained_fh, [
                {"rank": rank, "step": step, "micro_index": micro, "epoch": epoch, "example_id": str(e)}
                for e in batch["example_id"]
            ])
            acc += torch.stack([loss.detach().double(), mb["attention_mask"].sum().double(),
                                torch.tensor(float(mb["attention_mask"].numel()), dtype=torch.float64, device=device)])
            done += 1
            if micro == ga - 1:
                sync()
                step_time = time.perf_counter() - step_t0
                mine = torch.cat([acc, torch.tensor([step_time, fwd_s], dtype=torch.float64, device=device)])
                mine[0] /= ga
                per_rank = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(per_rank, mine)
                g = torch.stack(per_rank).cpu().numpy()  # (world, 5): loss, tokens, padded, step_s, forward_s
                loss_avg = float(g[:, 0].mean())
                # Backward costs about twice the forward (Kaplan et al. 2020, section 2.1), and the forward
                # holds no collective under ZeRO 0-2, so 3x forward approximates the rank's own compute.
                compute = 3.0 * g[:, 4]
                wait = np.maximum(0.0, g[:, 3] - compute)
                meters["step_s"].observe(step_time)
                meters["wait_s"].set(float(wait[rank]))
                meters["tokens"].inc(float(g[rank, 1]))
                meters["tps"].set(float(g[rank, 1] / max(step_time, 1e-9)))
                meters["loss"].set(loss_avg)
                steps_done = done // ga
                metrics = {"epoch": epoch, "step": step, "loss": loss_avg}
                if log_fh is not None:
                    slowest = float(g[:, 3].max())
                    row = {"step": step, "epoch": epoch, "loss": loss_avg, "tokens": int(g[:, 1].sum()),
                           "padded_tokens": int(g[:, 2].sum()), "step_time_s": slowest,
                           "tokens_per_s": float(g[:, 1].sum()) / max(slowest, 1e-9), "lr": step_lr,
                           "step_time_s_per_rank": g[:, 3].round(4).tolist(),
                           "compute_s_per_rank": compute.round(4).tolist(), "wait_s_per_rank": wait.round(4).tolist(),
                           "tokens_per_rank": g[:, 1].astype(int).tolist()}
                    _append_jsonl(log_fh, [row])
                    if steps_done % cfg.log_every == 0 or steps_done == total_steps:
                        print(f"[train] step {steps_done}/{total_steps} epoch {epoch} loss {loss_avg:.4f} "
                              f"tokens/s {row['tokens_per_s']:.0f} step {slowest:.2f}s "
                              f"wait {wait.max():.2f}s", flush=True)
                if cfg.checkpoint_every and steps_done % cfg.checkpoint_every == 0 and steps_done < total_steps:
                    trained_fh.flush()
                    _checkpoint(engine, rank, done, steps_done, config["plan_hash"], metrics)
        if done != n_micro:
            raise RuntimeError(f"rank {rank}: trained {done} micro-batches, the plan has {n_micro}")
    finally:
        trained_fh.close()
        if log_fh is not None:
            log_fh.close()
    t_train = time.perf_counter() - t_train

    final = {**metrics, "load_s": t_load, "init_s": t_init, "train_s": t_train, "resumed_from_micro_batch": start}
    # The final checkpoint comes before the model is written: merging LoRA adapters rewrites the module tree.
    _checkpoint(engine, rank, done, done // ga, config["plan_hash"], final)
    if config["save_model"]:
        _save_hf_model(engine, run_dir / "final_model", rank, cfg.zero_stage,
                       merge_lora=cfg.lora.enabled and cfg.lora.merge)
    dist.barrier()


def _save_hf_model(engine, dest: Path, rank: int, zero_stage: int, merge_lora: bool = False) -> None:
    """Rank 0 writes ``engine.module`` with ``save_pretrained`` (for a peft model: the adapter, or with
    ``merge_lora`` the base model with the adapters merged in); under ZeRO-3 every rank first all-gathers the
    partitioned parameters (a collective, so all ranks must call this)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero_stage == 3):
        if rank == 0:
            module = engine.module.merge_and_unload() if merge_lora else engine.module
            module.save_pretrained(dest)


# --------------------------------------------------------------------------------------------------------
# Driver


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
) -> TrainResult:
    """Train ``model_path`` on exactly the planned micro-batches with Ray Train + DeepSpeed.

    Expects Ray to be initialised by the caller (otherwise Ray starts a local instance with defaults).
    Each of ``cfg.num_workers`` workers takes ``cfg.cpus_per_worker`` CPUs (and one GPU with
    ``cfg.use_gpu``). On CPU the workers get ``DS_ACCELERATOR=cpu`` and the gloo backend; on GPU NCCL and
    bf16. ``TORCH_EXTENSIONS_DIR`` points at ``cache_dir()/torch_extensions`` so any DeepSpeed op that is
    compiled is compiled once.

    Args:
        plan: allocation plan, columns ``epoch, step, rank, micro_index, example_id`` (+ any others), sorted
            by ``(rank, epoch, step, micro_index, position)``; see :func:`ray_cluster_ft.allocate.check_plan`.
        examples: ``example_id`` (str), ``input_ids``, ``labels`` (list<int32>, -100 on prompt tokens).
        cfg: the ``train`` section of the job config.
        model_path: ``demo``, a local Hugging Face folder or a hub id (resolved with ``resolve_model_path``).
        run_dir: the run directory (local path visible to the driver and every worker).
        trust_remote_code: passed to ``from_pretrained``.
        save_model: write ``run_dir/final_model`` (HF format + tokenizer).
        pad_token_id: id used to right-pad micro-batches (masked out of attention and loss).
        resume: continue from the latest checkpoint under ``run_dir/ray_train`` (a stopped run of the same
            plan); False starts clean, deleting that run's checkpoints and logs.

    Fault tolerance: ``cfg.max_failures`` worker-group restarts, each resuming from the latest checkpoint
    (written every ``cfg.checkpoint_every`` steps and at the end). For tests, ``$RAY_CLUSTER_FT_FAIL_AT_STEP=N``
    makes rank 0 raise once per run directory at the start of optimizer step N (1-based).

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: an uneven or malformed plan, or plan/examples that do not join (before any worker starts).
        FileNotFoundError: ``model_path`` is a missing local folder.
        RuntimeError: the workers trained something other than the plan.
        ray.train.TrainingFailedError: a worker failed.
    """
    from .model import cache_dir, resolve_model_path

    world = cfg.num_workers
    total_steps = check_plan(plan, world, cfg.micro_batch_size, cfg.grad_accum)
    n_micro = total_steps * cfg.grad_accum
    tables = build_rank_tables(plan, examples, world)
    model_dir = resolve_model_path(model_path)
    tokenizer = None
    if save_model:
        from transformers import AutoTokenizer

        # Loaded before the run so a model folder without a tokenizer fails now, not after training.
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = Path(run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Ray Train resumes from any checkpoint under the same RunConfig(name, storage_path): a fresh run must
    # not find the last run's.
    stale_dirs = ["final_model"] if resume else ["trained", "final_model", "ray_train"]
    for stale in stale_dirs:
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    (run_dir / "trained").mkdir(exist_ok=True)
    for stale in ("trained.parquet",) if resume else ("train_log.jsonl", "trained.parquet"):
        (run_dir / stale).unlink(missing_ok=True)

    # Ray Train's print patch both tees and logs every print of a worker: the progress lines came out twice.
    env = {"TORCH_EXTENSIONS_DIR": str(cache_dir() / "torch_extensions"), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if not cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    datasets = {}
    for r, t in enumerate(tables):
        ds = ray.data.from_arrow(t)
        # Per-dataset context copy: the workers log their own progress; per-batch data bars only add noise.
        ds.context.enable_progress_bars = False
        datasets[f"train_rank{r}"] = ds
    trainer = TorchTrainer(
        _train_loop_per_worker,
        train_loop_config={
            "train": cfg.model_dump(),
            "ds_config": deepspeed_config(cfg, total_steps),
            "model_dir": model_dir,
            "trust_remote_code": trust_remote_code,
            "run_dir": str(run_dir),
            "total_steps": total_steps,
            "micro_batches_per_rank": n_micro,
            "save_model": save_model,
            "pad_token_id": int(pad_token_id),
            "plan_hash": plan_hash(plan),
            "fail_at_step": os.environ.get(FAIL_AT_STEP_ENV),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=world, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        run_config=ray.train.RunConfig(
            name="train",
            storage_path=str(run_dir / "ray_train"),
            worker_runtime_env={"env_vars": env},
            # Only the latest checkpoint is kept (the demo model's ZeRO-2 checkpoint is about 2 GB).
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo", timeout_s=cfg.timeout_s),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(
            datasets_to_split=[], execution_options=ray.data.ExecutionOptions(preserve_order=True)
        ),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    seconds = time.perf_counter() - t0

    trained = _consolidate_trained(run_dir, world)
    trained_path = run_dir / "trained.parquet"
    trained.to_parquet(trained_path, index=False)
    expected = plan.sort_values(["rank", *_KEY], kind="stable")
    same = all(
        np.array_equal(trained[c].to_numpy(), expected[c].to_numpy(np.int64)) for c in ("rank", *_KEY)
    ) and np.array_equal(trained["example_id"].to_numpy(), expected["example_id"].astype(str).to_numpy())
    if not same:
        raise RuntimeError(f"the workers did not train the plan: see {trained_path}")

    log_path = run_dir / "train_log.jsonl"
    log = pd.read_json(log_path, lines=True)
    if len(log) != total_steps:
        raise RuntimeError(f"train log has {len(log)} steps, the plan {total_steps}")
    final_dir = None
    if save_model:
        final_dir = run_dir / "final_model"
        tokenizer.save_pretrained(final_dir)
    metrics = result.metrics or {}
    per_rank = np.asarray(log["step_time_s_per_rank"].tolist(), dtype=np.float64)  # (steps, world)
    waits = np.asarray(log["wait_s_per_rank"].tolist(), dtype=np.float64)
    return TrainResult(
        final_model_dir=final_dir,
        steps=total_steps,
        seconds=seconds,
        final_loss=float(log["loss"].iloc[-1]),
        log_path=log_path,
        trained_path=trained_path,
        checkpoint_path=result.checkpoint.path if result.checkpoint is not None else None,
        init_seconds=float(metrics.get("init_s", float("nan"))),
        step_time_p50_s=np.percentile(per_rank, 50, axis=0).round(4).tolist(),
        step_time_p90_s=np.percentile(per_rank, 90, axis=0).round(4).tolist(),
        wait_mean_s=waits.mean(axis=0).round(4).tolist(),
        resumed_from_step=int(metrics.get("resumed_from_micro_batch", 0)) // cfg.grad_accum,
    )


def plan_hash(plan: pd.DataFrame) -> str:
    """sha256 (hex) of the plan's training order: ``rank, epoch, step, micro_index, example_id`` per row in
    ``(rank, epoch, step, micro_index)`` order. A checkpoint records it, so a run resumes only its own plan."""
    import hashlib

    order = plan.sort_values(["rank", *_KEY], kind="stable")
    h = hashlib.sha256()
    for c in ("rank", *_KEY):
        h.update(order[c].to_numpy(np.int64).tobytes())
    h.update("\x00".join(order["example_id"].astype(str)).encode())
    return h.hexdigest()
