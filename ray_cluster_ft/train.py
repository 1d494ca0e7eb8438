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
    "lr_multiplier",
    "build_rank_tables",
    "pad_micro_batch",
    "train",
]

PLAN_COLUMNS = ("epoch", "step", "rank", "micro_index", "example_id")
TRAINED_COLUMNS = ("rank", "step", "micro_index", "epoch", "example_id")
IGNORE_INDEX = -100  # Hugging Face's label value for "no loss on this token"
_KEY = ["epoch", "step", "micro_index"]


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
    """

    final_model_dir: Path | None
    steps: int
    seconds: float
    final_loss: float
    log_path: Path
    trained_path: Path
    checkpoint_path: str | None = None
    init_seconds: float = float("nan")


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
    return {
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


def _train_loop_per_worker(config: dict) -> None:
    """Ray Train worker: DeepSpeed-train this rank's planned micro-batches, log, checkpoint, save the model."""
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
    torch.manual_seed(cfg.seed)

    _disable_shm_comm()
    t0 = time.perf_counter()
    model = load_model(config["model_dir"], trust_remote_code=config["trust_remote_code"])
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
    if rank == 0:
        print(f"[train] model loaded in {t_load:.1f}s, deepspeed.initialize done at {t_init:.1f}s "
              f"(ZeRO-{cfg.zero_stage}, world {world}, {total_steps} steps)", flush=True)

    trained_fh = open(run_dir / "trained" / f"rank{rank}.jsonl", "w", encoding="utf-8")
    log_fh = open(run_dir / "train_log.jsonl", "w", encoding="utf-8") if rank == 0 else None
    shard = ray.train.get_dataset_shard(f"train_rank{rank}")
    done = 0
    cur_epoch = cur_step = None
    step_t0 = step_lr = 0.0
    # This rank's step sums (loss over micro-batches, real tokens, padded tokens), kept on the device so the
    # micro-batch loop never waits for the accelerator; read once per step by the all-reduce.
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    epoch_losses: list[float] = []
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
            if micro == 0:
                if cur_epoch is not None and epoch != cur_epoch:
                    # Every rank crosses the epoch boundary at the same micro-batch (checked by the driver),
                    # so the report calls, which are a barrier, line up.
                    ray.train.report({**metrics, "epoch_loss": float(np.mean(epoch_losses))})
                    epoch_losses = []
                cur_epoch, cur_step = epoch, step
                step_t0 = time.perf_counter()
                step_lr = float(engine.get_lr()[0])  # the lr this step trains with (the scheduler steps after it)
                acc.zero_()
            mb = {k: torch.from_numpy(v).to(device) for k, v in
                  pad_micro_batch(batch["input_ids"], batch["labels"], config["pad_token_id"]).items()}
            loss = engine(**mb, use_cache=False).loss
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
                t = acc.clone()
                t[0] /= ga
                dist.all_reduce(t)
                step_time = time.perf_counter() - step_t0
                loss_avg, tokens, padded = t[0].item() / world, int(t[1].item()), int(t[2].item())
                epoch_losses.append(loss_avg)
                metrics = {"epoch": epoch, "step": step, "loss": loss_avg}
                if log_fh is not None:
                    row = {"step": step, "epoch": epoch, "loss": loss_avg, "tokens": tokens, "padded_tokens": padded,
                           "step_time_s": step_time, "tokens_per_s": tokens / max(step_time, 1e-9),
                           "lr": step_lr}
                    _append_jsonl(log_fh, [row])
                    n = done // ga
                    if n % cfg.log_every == 0 or n == total_steps:
                        print(f"[train] step {n}/{total_steps} epoch {epoch} loss {loss_avg:.4f} "
                              f"tokens/s {row['tokens_per_s']:.0f} step {step_time:.2f}s", flush=True)
        if done != n_micro:
            raise RuntimeError(f"rank {rank}: trained {done} micro-batches, the plan has {n_micro}")
    finally:
        trained_fh.close()
        if log_fh is not None:
            log_fh.close()
    t_train = time.perf_counter() - t_train

    if config["save_model"]:
        _save_hf_model(engine, run_dir / "final_model", rank, cfg.zero_stage)
    dist.barrier()
    final = {**metrics, "epoch_loss": float(np.mean(epoch_losses)), "load_s": t_load, "init_s": t_init,
             "train_s": t_train}
    with tempfile.TemporaryDirectory(prefix="ds_ckpt_") as tmp:
        engine.save_checkpoint(tmp)
        # The plan position lets a resumed run know where it stopped; one file per rank so Ray's merge of
        # the ranks' checkpoint folders cannot collide.
        (Path(tmp) / f"plan_position_rank{rank}.json").write_text(
            json.dumps({"rank": rank, "micro_batches_done": done, "epoch": cur_epoch, "step": cur_step})
        )
        ray.train.report(final, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _save_hf_model(engine, dest: Path, rank: int, zero_stage: int) -> None:
    """Rank 0 writes ``engine.module`` with ``save_pretrained``; under ZeRO-3 every rank first all-gathers
    the partitioned parameters (a collective, so all ranks must call this)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero_stage == 3):
        if rank == 0:
            engine.module.save_pretrained(dest)


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
    for stale in ("trained", "final_model"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    (run_dir / "trained").mkdir()
    for stale in ("train_log.jsonl", "trained.parquet"):
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
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=world, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        run_config=ray.train.RunConfig(
            name="train",
            storage_path=str(run_dir / "ray_train"),
            worker_runtime_env={"env_vars": env},
            # One checkpoint per run; a re-run in the same run_dir replaces the previous one (the demo
            # model's ZeRO-2 checkpoint is about 2 GB).
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
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
    return TrainResult(
        final_model_dir=final_dir,
        steps=total_steps,
        seconds=seconds,
        final_loss=float(log["loss"].iloc[-1]),
        log_path=log_path,
        trained_path=trained_path,
        checkpoint_path=result.checkpoint.path if result.checkpoint is not None else None,
        init_seconds=float(metrics.get("init_s", float("nan"))),
    )
