"""The Ray Train worker: DeepSpeed-train this rank's planned micro-batches, log, checkpoint, save the model."""

from __future__ import annotations

import json
import time
from functools import partial
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ._op_locks import clear_stale_build_locks
from .deepspeed import disable_shm_comm, make_scheduler, resolve_precision
from .rank_data import MICRO_BATCH_KEY
from .step import ForwardTimer, collate_micro_batch, to_device, train_micro_batch

__all__ = ["FAIL_AT_STEP_ENV", "train_loop_per_worker"]


FAIL_AT_STEP_ENV = "RAY_CLUSTER_FT_FAIL_AT_STEP"  # fault injection for tests: rank 0 raises once at this step


def _check_micro_batch(batch: dict[str, np.ndarray], micro_batch_size: int | None,
                       at_most: bool = False) -> tuple[int, int, int]:
    """(epoch, step, micro_index) of a batch that must be exactly one planned micro-batch: ``micro_batch_size``
    rows (``at_most``: 1 to that many, a plan with a short tail), or (``None``, a pack) any number of rows of one
    key."""
    n = len(batch["example_id"])
    key = tuple(np.unique(batch[c]) for c in MICRO_BATCH_KEY)
    wrong_size = micro_batch_size is not None and (n > micro_batch_size if at_most else n != micro_batch_size)
    if wrong_size or any(k.size != 1 for k in key):
        size = "any number of" if micro_batch_size is None else ("at most " if at_most else "") + str(micro_batch_size)
        raise RuntimeError(
            f"a batch of {n} rows spans (epoch, step, micro_index) values {[k.tolist() for k in key]}; expected "
            f"exactly one planned micro-batch of {size} rows (is the dataset order preserved?)"
        )
    return int(key[0][0]), int(key[1][0]), int(key[2][0])


def _micro_batches(shard, micro_batch_size: int, packed: bool, chunk_rows: int = 256):
    """One rank's planned micro-batches, in order, as numpy dicts (ragged token columns as object arrays).

    Unpacked plans have ``micro_batch_size`` rows per micro-batch, read as batches of that size. A pack has as
    many rows as fit its token budget, so packed plans are read in chunks of ``chunk_rows`` rows (pyarrow, so
    ragged columns concatenate safely) and cut wherever ``(epoch, step, micro_index)`` changes; the last
    micro-batch of a chunk waits for the next chunk."""
    if not packed:
        yield from shard.iter_batches(batch_size=micro_batch_size, batch_format="numpy")
        return
    import pyarrow as pa

    def as_numpy(t):
        return {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}

    buf = None
    for chunk in shard.iter_batches(batch_size=chunk_rows, batch_format="pyarrow"):
        buf = chunk if buf is None else pa.concat_tables([buf, chunk])
        key = np.stack([buf.column(c).to_numpy() for c in MICRO_BATCH_KEY], axis=1)
        starts = [0, *(np.flatnonzero((key[1:] != key[:-1]).any(axis=1)) + 1).tolist()]
        for a, z in pairwise(starts):
            yield as_numpy(buf.slice(a, z - a))
        buf = buf.slice(starts[-1])
    if buf is not None and buf.num_rows:
        yield as_numpy(buf)


def _prefetch(batches, collate, skip: int = 0, depth: int = 2):
    """``(batch, collate(batch))`` for every batch of ``batches``, with ``collate`` (host-side padding or packing,
    tensor creation, pinning) run on one background thread up to ``depth`` micro-batches ahead, so the training
    thread only launches copies and kernels. The first ``skip`` batches (trained before the checkpoint a run
    resumes from) come with ``None``, uncollated. Reading the batches stays on the calling thread (Ray's iterator
    is not shared); an exception in ``collate`` is raised here, at its batch."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="collate") as pool:
        pending: deque = deque()
        for i, batch in enumerate(batches):
            if i < skip:
                yield batch, None
                continue
            pending.append((batch, pool.submit(collate, batch)))
            if len(pending) > depth:
                b, fut = pending.popleft()
                yield b, fut.result()
        while pending:
            b, fut = pending.popleft()
            yield b, fut.result()


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


def _restore(engine, rank: int, plan_hash: str, disk_checkpoint: str | None) -> tuple[int, int | None]:
    """Load the newest checkpoint into ``engine``: Ray's latest, or ``disk_checkpoint`` (the newest complete one
    the driver found on disk, see :func:`ray_cluster_ft.train.newest_complete_checkpoint`) when that is further
    along (an interrupt can stop the run before Ray records the checkpoints it wrote). Returns the micro-batches
    already trained, the rows they held (``None`` from a checkpoint that did not record them) and the optimizer
    steps they made."""
    import contextlib

    import ray.train

    ckpt = ray.train.get_checkpoint()
    with (ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(None)) as ray_dir:
        found = []
        for d in (ray_dir, disk_checkpoint):
            pos_file = Path(d) / f"plan_position_rank{rank}.json" if d else None
            if pos_file is not None and pos_file.is_file():
                pos = json.loads(pos_file.read_text())
                found.append((int(pos["micro_batches_done"]), d, pos))
        if not found:
            return 0, 0, 0
        done, d, pos = max(found, key=lambda f: f[0])
        if pos.get("plan_hash") != plan_hash:
            raise RuntimeError(
                f"the checkpoint in {d} was written for another plan (plan hash {pos.get('plan_hash')}, this run's "
                f"is {plan_hash}); resume only with the run's own plan, or start a fresh run directory")
        load_path, _ = engine.load_checkpoint(d, tag=pos["tag"])
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint '{pos['tag']}' in {d}")
    return done, pos.get("rows_done"), int(pos["steps_done"])


def checkpoint_dir_name(steps_done: int) -> str:
    """The folder of the checkpoint after ``steps_done`` optimizer steps, under Ray Train's run folder
    (``run_dir/ray_train/train``); the zero-padded step keeps the names in step order."""
    return f"checkpoint_step{steps_done:06d}"


def _checkpoint(engine, rank: int, done: int, steps_done: int, plan_hash: str, metrics: dict,
                rows_done: int) -> str:
    """Every rank saves its DeepSpeed shard straight into the checkpoint's final folder in Ray Train's run folder
    on the shared storage (written once: no local temporary folder that Ray then copies), then its plan
    position (micro-batches and rows trained: a pack's row count varies), and reports the folder with ``checkpoint_upload_mode=NO_UPLOAD`` (Ray records it where it is).
    The position file lists the folder's files with their sizes, taken after every rank finished writing, so a
    checkpoint cut short by an interrupt can be told from a complete one (:mod:`.checkpoints`). Returns the
    folder. A collective: every rank must call it."""
    import ray.train
    import torch.distributed as dist
    from ray.train import CheckpointUploadMode

    tag = f"step{steps_done}"
    name = checkpoint_dir_name(steps_done)
    dest = Path(ray.train.get_context().get_storage().experiment_fs_path) / name
    dest.mkdir(parents=True, exist_ok=True)
    position = dest / f"plan_position_rank{rank}.json"
    position.unlink(missing_ok=True)  # a folder left by an interrupted attempt at this step is rewritten
    engine.save_checkpoint(str(dest), tag=tag)
    dist.barrier()  # every rank's files are on disk before any rank lists them
    files = {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*"))
             if p.is_file() and not p.name.startswith("plan_position_rank")}
    # One position file per rank: the checkpoint is complete when every rank's is there and its files match.
    tmp = position.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "micro_batches_done": done, "rows_done": rows_done,
                               "steps_done": steps_done, "tag": tag,
                               "plan_hash": plan_hash, "files": files}))
    tmp.replace(position)
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(dest)), checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    return str(dest)


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


def _namespace(d: dict) -> SimpleNamespace:
    """A plain (nested) dict as attributes: workers get the driver's validated config as data, not a model
    to validate again."""
    return SimpleNamespace(**{k: _namespace(v) if isinstance(v, dict) else v for k, v in d.items()})


# transformers finds the ZeRO-3 config through a weak reference: the object must outlive from_pretrained (and is
# kept for the worker's life, as transformers' Trainer keeps it with its arguments).
_HF_DS_CONFIG: list = []


def load_kwargs(precision: str, zero_stage: int, device_type: str, device_index: int | None = None) -> dict:
    """How a worker loads the trained model: ``dtype`` of the run's precision (bf16, fp16; fp32 on the CPU), and
    under ZeRO 0-2 on a GPU ``device_map`` onto this worker's GPU, so the weights go there in that dtype without a
    host copy of the whole model. Under ZeRO-3 no ``device_map``: the model is constructed partitioned
    (:func:`_build_engine` activates transformers' ``HfDeepSpeedConfig``, whose ``deepspeed.zero.Init`` places
    each rank's shard). Pure.

    Returns:
        ``{"dtype": torch.dtype}`` plus ``{"device_map": {"": "cuda:<i>"}}`` on a GPU under ZeRO 0-2.
    """
    import torch

    out: dict[str, Any] = {"dtype": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)}
    if device_type == "cuda" and zero_stage != 3:
        out["device_map"] = {"": f"cuda:{device_index or 0}"}
    return out


def _build_engine(config: dict, cfg: SimpleNamespace):
    """Load the model in the run's precision (bf16/fp16 straight onto this worker's GPU in that dtype under
    ZeRO 0-2, constructed partitioned with ``deepspeed.zero.Init`` under ZeRO-3; fp32 on CPU), turn on gradient
    checkpointing if asked, wrap LoRA adapters if configured, and ``deepspeed.initialize`` it with the driver's
    DeepSpeed dict (``auto`` precision settled on this worker's GPU) and the client LR schedule. The model folder
    is the absolute one the driver resolved (``config["model_dir"]``), read offline.
    Returns ``(engine, load_seconds, init_seconds, precision)``.

    Raises:
        ValueError: ``config["model_dir"]`` is not a resolved absolute folder (:func:`ray_cluster_ft.model.require_local_model`).
    """
    import deepspeed
    import torch

    from ..model import load_local_model

    disable_shm_comm()
    t0 = time.perf_counter()
    ds, precision = config["ds_config"], config["precision"]
    cuda = cfg.use_gpu and torch.cuda.is_available()
    if cfg.use_gpu:
        ds, precision = resolve_precision(ds, precision, torch.cuda.is_bf16_supported())
    if cfg.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # DeepSpeed's communication layer must know the world (Ray Train's process group) before zero.Init reads
        # the batch settings, or it checks them against a world of 1.
        deepspeed.init_distributed()
        _HF_DS_CONFIG[:] = [HfDeepSpeedConfig(ds)]  # from_pretrained now builds under deepspeed.zero.Init
    kwargs = load_kwargs(precision, cfg.zero_stage, "cuda" if cuda else "cpu",
                         torch.cuda.current_device() if cuda else None)
    model = load_local_model(config["model_dir"], trust_remote_code=config["trust_remote_code"],
                             attn_implementation=config.get("attn_implementation"), **kwargs)
    if config.get("gradient_checkpointing"):
        # Non-reentrant checkpointing also works with frozen inputs (LoRA) and with ZeRO-3's hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    t_load = time.perf_counter() - t0
    clear_stale_build_locks()  # else a killed CPU Adam build makes initialize wait forever
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds,
        lr_scheduler=partial(make_scheduler, warmup_steps=cfg.warmup_steps, total_steps=config["total_steps"]),
    )
    return engine, t_load, time.perf_counter() - t0, precision


def _end_of_step(loss_acc, tokens: tuple[int, int], step_time: float, fwd_s: float, rank: int, world: int,
                 meters: dict):
    """All-gather every rank's step figures once per step, export this rank's metrics.

    Returns:
        float64 ``(world, 5)``: this rank's share of the token-exact step loss (their sum is the step's loss),
        real tokens, padded tokens (token positions of the micro-batch tensors: real + padding), step seconds,
        forward seconds; and the per-rank approximate compute and wait
        seconds.
    """
    import torch
    import torch.distributed as dist

    # One host-to-device copy per step: the token counts come from the host arrays, the loss stays on the device.
    mine = torch.tensor([0.0, *tokens, step_time, fwd_s], dtype=torch.float64).to(loss_acc.device)
    mine[0] = loss_acc
    per_rank = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(per_rank, mine)
    g = torch.stack(per_rank).cpu().numpy()
    # Backward costs about twice the forward (Kaplan et al. 2020, section 2.1), and the forward holds no
    # collective under ZeRO 0-2, so 3x forward approximates the rank's own compute.
    compute = 3.0 * g[:, 4]
    wait = np.maximum(0.0, g[:, 3] - compute)
    meters["step_s"].observe(step_time)
    meters["wait_s"].set(float(wait[rank]))
    meters["tokens"].inc(float(g[rank, 1]))
    meters["tps"].set(float(g[rank, 1] / max(step_time, 1e-9)))
    meters["loss"].set(float(g[:, 0].sum()))
    return g, compute, wait


def _log_row(step: int, epoch: int, g: np.ndarray, compute: np.ndarray, wait: np.ndarray, lr: float) -> dict:
    """One row of ``train_log.jsonl`` from :func:`_end_of_step`'s figures."""
    slowest = float(g[:, 3].max())
    return {"step": step, "epoch": epoch, "loss": float(g[:, 0].sum()), "tokens": int(g[:, 1].sum()),
            "padded_tokens": int(g[:, 2].sum()), "padding_tokens": int(g[:, 2].sum() - g[:, 1].sum()),
            "step_time_s": slowest,
            "tokens_per_s": float(g[:, 1].sum()) / max(slowest, 1e-9), "lr": lr,
            "step_time_s_per_rank": g[:, 3].round(4).tolist(),
            "compute_s_per_rank": compute.round(4).tolist(), "wait_s_per_rank": wait.round(4).tolist(),
            "tokens_per_rank": g[:, 1].astype(int).tolist()}


def train_loop_per_worker(config: dict) -> None:
    """Ray Train worker: DeepSpeed-train this rank's planned micro-batches, log, checkpoint, save the model.

    ``config`` is plain data from the driver (the validated train section, the finished DeepSpeed dict, the
    resolved model folder); nothing is validated or read from the job spec here. After a worker-group restart
    (or a driver-level resume) the worker loads the latest checkpoint, cuts its logs back to the checkpoint's
    plan position and skips that many micro-batches of its (re-created, same order) dataset iterator, so every
    planned micro-batch is trained exactly once in the final model's history.

    With ``config["packing"]`` every micro-batch is a pack (any number of rows of one ``(epoch, step,
    micro_index)``), trained as one padding-free sequence (:func:`ray_cluster_ft.train.step.micro_batch_to_device`);
    with ``flash`` in ``config["attn_implementation"]`` the pack carries flash-attention's varlen arguments.
    """
    import ray.train
    import torch
    import torch.distributed as dist

    cfg = _namespace(config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = Path(config["run_dir"])
    total_steps, n_micro = config["total_steps"], config["micro_batches_per_rank"]
    mbs, ga = cfg.micro_batch_size, cfg.grad_accum
    fail_at = int(config["fail_at_step"] or 0)
    packed = bool(config.get("packing", False))
    flash_varlen = packed and "flash" in str(config.get("attn_implementation") or "")
    torch.manual_seed(cfg.seed)

    engine, t_load, t_init, precision = _build_engine(config, cfg)
    engine.train()
    device = engine.device
    short_tail = bool(config.get("short_tail", False))  # an epoch's last step may hold fewer than G micro-batches
    start, start_rows, steps_done = _resume_point(engine, rank, config, packed, mbs)
    if rank == 0:
        _announce(cfg, t_load, t_init, precision, world, total_steps, start, steps_done)
    trained_fh, log_fh = _open_logs(run_dir, rank, start_rows, steps_done)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timer, meters = ForwardTimer(device), _metric_handles(rank)
    shard = ray.train.get_dataset_shard(f"train_rank{rank}")
    done = rows_done = 0
    order = _PlanOrder(rank)
    step_t0 = step_lr = 0.0
    real = padded = 0
    # This rank's step sums (its share of the token-exact loss, real tokens, padded tokens), kept on the device so the
    # micro-batch loop never waits for the accelerator; read once per step by the all-gather.
    loss_acc = torch.zeros((), dtype=torch.float64, device=device)
    metrics: dict[str, Any] = {}
    t_train = time.perf_counter()
    try:
        def collate(b):
            return collate_micro_batch(b, config["pad_token_id"], device, packed=packed, flash_attn_kwargs=flash_varlen)

        for batch, host in _prefetch(_micro_batches(shard, mbs, packed or short_tail), collate, skip=start):
            epoch, step, micro = _check_micro_batch(batch, None if packed else mbs, at_most=short_tail)
            n_in_step = int(batch["step_micro_batches"][0]) if short_tail else ga
            order.check((epoch, step, micro), n_in_step, done)
            if done < start:  # trained before the checkpoint this run resumed from
                done += 1
                rows_done += len(batch["example_id"])
                continue
            if micro == 0:
                if rank == 0:
                    _inject_fault(run_dir, fail_at, steps_done + 1)
                step_t0 = time.perf_counter()
                real = padded = 0
                step_lr = float(engine.get_lr()[0])  # the lr this step trains with (the scheduler steps after it)
                loss_acc.zero_()
            mb = to_device(host, device)
            denom = float(batch["step_weighted_tokens"][0])  # the step's sum_i w_i |T_i|, from the plan
            loss_sum = train_micro_batch(engine, mb, world * ga / denom, timer,
                                         boundary=micro == n_in_step - 1 if short_tail else None)
            _append_jsonl(trained_fh, [{"rank": rank, "step": step, "micro_index": micro, "epoch": epoch,
                                        "example_id": str(e)} for e in batch["example_id"]])
            loss_acc += loss_sum.double() / denom
            mb_real, mb_padded = _micro_batch_tokens(batch, packed)
            real, padded = real + mb_real, padded + mb_padded
            done += 1
            rows_done += len(batch["input_ids"])
            if micro != n_in_step - 1:
                continue
            sync()
            g, compute, wait = _end_of_step(loss_acc, (real, padded), time.perf_counter() - step_t0, timer.take(),
                                            rank, world, meters)
            steps_done += 1
            metrics = {"epoch": epoch, "step": step, "loss": float(g[:, 0].sum())}
            if log_fh is not None:
                _log_step(log_fh, _log_row(step, epoch, g, compute, wait, step_lr), steps_done, total_steps,
                          cfg.log_every, float(wait.max()))
            _after_step(engine, config, cfg, rank, (done, steps_done, rows_done), metrics, trained_fh)
        if done != n_micro:
            raise RuntimeError(f"rank {rank}: trained {done} micro-batches, the plan has {n_micro}")
    finally:
        trained_fh.close()
        if log_fh is not None:
            log_fh.close()
    t_train = time.perf_counter() - t_train

    final = {**metrics, "load_s": t_load, "init_s": t_init, "train_s": t_train, "resumed_from_micro_batch": start}
    _finish_rank(engine, config, cfg, rank, final, (done, steps_done, rows_done), start)
    dist.barrier()


def _announce(cfg, t_load: float, t_init: float, precision: str, world: int, total_steps: int, start: int,
              steps_done: int) -> None:
    """Rank 0's line once the engine is up: load and initialise times, ZeRO stage, precision, where it resumes."""
    print(f"[train] model loaded in {t_load:.1f}s, deepspeed.initialize done at {t_init:.1f}s "
          f"(ZeRO-{cfg.zero_stage}, {precision}{', LoRA' if cfg.lora.enabled else ''}, world {world}, "
          f"{total_steps} steps)"
          + (f"; resumed after step {steps_done}" if start else ""), flush=True)


def _micro_batch_tokens(batch: dict, packed: bool) -> tuple[int, int]:
    """``(real, padded)`` tokens of a micro-batch: a pack's tensor holds its real tokens only; a padded
    micro-batch holds B x its longest row."""
    lengths = [len(x) for x in batch["input_ids"]]
    return sum(lengths), (sum(lengths) if packed else len(lengths) * max(lengths))


def _resume_point(engine, rank: int, config: dict, packed: bool, mbs: int) -> tuple[int, int, int]:
    """``(micro-batches, rows, optimizer steps)`` this rank trained before the checkpoint it resumes from (0, 0, 0
    for a fresh run).

    Raises:
        RuntimeError: a packed plan resumes from a checkpoint that does not record its rows.
    """
    start, start_rows, steps = _restore(engine, rank, config["plan_hash"], config.get("resume_checkpoint"))
    if start_rows is None:
        if packed or config.get("short_tail"):
            raise RuntimeError("the checkpoint does not record the rows trained, which a packed plan or one with a "
                               "short micro-batch needs to resume")
        start_rows = start * mbs
    return start, start_rows, steps


def _inject_fault(run_dir: Path, fail_at: int, n_step: int) -> None:
    """The test hook of ``$RAY_CLUSTER_FT_FAIL_AT_STEP``: raise once per run directory at the start of step
    ``fail_at`` (1-based; 0 = never)."""
    if fail_at == n_step and not (run_dir / ".fault_injected").exists():
        (run_dir / ".fault_injected").touch()
        raise RuntimeError(f"injected failure at step {n_step} ({FAIL_AT_STEP_ENV}={fail_at})")


def _open_logs(run_dir: Path, rank: int, rows_kept: int, steps_kept: int) -> tuple:
    """``(trained rows file, step log or None)`` opened for appending, each cut back first to what the checkpoint
    this attempt resumes from had done (``rows_kept`` rows, ``steps_kept`` steps); the step log is rank 0's."""
    trained_path = run_dir / "trained" / f"rank{rank}.jsonl"
    _truncate_lines(trained_path, rows_kept)
    trained_fh = open(trained_path, "a", encoding="utf-8")
    log_fh = None
    if rank == 0:
        _truncate_lines(run_dir / "train_log.jsonl", steps_kept)
        log_fh = open(run_dir / "train_log.jsonl", "a", encoding="utf-8")
    return trained_fh, log_fh


class _PlanOrder:
    """The plan-order check of one rank's micro-batches: each :meth:`check` raises RuntimeError unless micro-batch
    ``(epoch, step, micro_index)`` follows the one before in plan order: the next micro_index of the same step,
    or micro_index 0 of a later step once the step before has had all its ``n_in_step`` micro-batches."""

    def __init__(self, rank: int):
        self.rank = rank
        self.prev: tuple | None = None  # (step, micro_index, micro-batches of that step)

    def check(self, key: tuple, n_in_step: int, done: int) -> None:
        epoch, step, micro = key
        prev = self.prev
        if micro == 0:
            ok = prev is None or (step > prev[0] and prev[1] == prev[2] - 1)
        else:
            ok = prev is not None and step == prev[0] and micro == prev[1] + 1
        if not ok or micro >= n_in_step:
            raise RuntimeError(
                f"rank {self.rank}: micro-batch (epoch {epoch}, step {step}, micro_index {micro}) arrived out of "
                f"plan order after {done} micro-batches"
            )
        self.prev = (step, micro, n_in_step)


def _log_step(log_fh, row: dict, steps_done: int, total_steps: int, log_every: int, wait_max: float) -> None:
    """Rank 0: the step's row appended to ``train_log.jsonl``, and a progress line every ``log_every`` steps."""
    _append_jsonl(log_fh, [row])
    if steps_done % log_every == 0 or steps_done == total_steps:
        print(f"[train] step {steps_done}/{total_steps} epoch {row['epoch']} loss {row['loss']:.4f} "
              f"tokens/s {row['tokens_per_s']:.0f} step {row['step_time_s']:.2f}s "
              f"wait {wait_max:.2f}s", flush=True)


def _after_step(engine, config: dict, cfg, rank: int, position: tuple, metrics: dict, trained_fh) -> None:
    """What follows an optimizer step: a checkpoint every ``train.checkpoint_every`` steps (not after the last:
    the final one follows), and at the end of every epoch but the last, with ``config["epoch_ends"]`` (global
    step -> epoch), the model saved as ``run_dir/epochs/epoch{epoch + 1}`` for the per-epoch evaluation.
    ``position``: ``(micro-batches done, steps done, rows done)``."""
    done, steps_done, rows_done = position
    if cfg.checkpoint_every and steps_done % cfg.checkpoint_every == 0 and steps_done < config["total_steps"]:
        trained_fh.flush()
        _checkpoint(engine, rank, done, steps_done, config["plan_hash"], metrics, rows_done)
    epoch = config.get("epoch_ends", {}).get(metrics["step"])
    if epoch is not None:
        _save_hf_model(engine, Path(config["run_dir"]) / "epochs" / f"epoch{epoch + 1}", rank, cfg.zero_stage,
                       merge_lora=cfg.lora.enabled, keep_training=True)


def _finish_rank(engine, config: dict, cfg, rank: int, final: dict, position: tuple, start: int) -> None:
    """The final checkpoint (or a last report), then the model saved. ``position``: ``(micro-batches done, steps
    done, rows done)``."""
    import ray.train

    # The final checkpoint comes before the model is written (merging LoRA adapters rewrites the module tree). None
    # with train.final_checkpoint off, nor when this attempt trained nothing (its checkpoint is already there).
    done, steps_done, rows_done = position
    if getattr(cfg, "final_checkpoint", True) and done > start:
        _checkpoint(engine, rank, done, steps_done, config["plan_hash"], final, rows_done)
    else:
        ray.train.report(final)
    if config["save_model"]:
        _save_hf_model(engine, Path(config["run_dir"]) / "final_model", rank, cfg.zero_stage,
                       merge_lora=cfg.lora.enabled and cfg.lora.merge)


def merge_lora_state_dict(state: dict, scaling: float, adapter: str = "default") -> dict:
    """A peft LoRA model's full state dict -> the base model's, the adapters merged in:
    ``W + scaling * B @ A`` for every ``<m>.base_layer.weight`` with ``<m>.lora_A.<adapter>.weight`` (r, in) and
    ``<m>.lora_B.<adapter>.weight`` (out, r), the ``base_model.model.`` prefix and ``.base_layer`` removed, the
    adapter tensors dropped. Computed in fp32, stored back in each weight's dtype; tied (shared) tensors stay
    shared. peft's ``merge_and_unload`` does the same on a live module (``scaling = lora_alpha / r``). Pure.

    Raises:
        KeyError: an adapter half without its partner.
    """
    out: dict = {}
    lora = {k for k in state if f".lora_A.{adapter}." in k or f".lora_B.{adapter}." in k}
    for key, value in state.items():
        if key in lora or ".lora_" in key:
            continue
        new = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state[f"{stem}.lora_A.{adapter}.weight"], state[f"{stem}.lora_B.{adapter}.weight"]
            value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[new] = value
    return out


def _save_hf_model(engine, dest: Path, rank: int, zero_stage: int, merge_lora: bool = False,
                   keep_training: bool = False) -> None:
    """Rank 0 writes ``engine.module`` with ``save_pretrained`` (for a peft model: the adapter, or with
    ``merge_lora`` the base model with the adapters merged in). Under ZeRO-3 the weights come from DeepSpeed's
    16-bit consolidation (``_zero3_consolidated_16bit_state_dict``, enabled by
    ``stage3_gather_16bit_weights_on_model_save``): gathered one module at a time onto rank 0 and moved to its
    host memory, so no rank ever holds every parameter on its GPU at once. A collective: all ranks must call it.
    ``keep_training``: training goes on after the save, so LoRA adapters are merged into a copy of the state dict
    (:func:`merge_lora_state_dict`) instead of into the live module."""
    if zero_stage == 3 or (merge_lora and keep_training):
        state = engine._zero3_consolidated_16bit_state_dict() if zero_stage == 3 else None
        if rank != 0:
            return
        state = engine.module.state_dict() if state is None else state
        module = engine.module
        if merge_lora:
            peft_cfg = module.peft_config["default"]
            state = merge_lora_state_dict(state, peft_cfg.lora_alpha / peft_cfg.r)
            module = module.get_base_model()
        module.save_pretrained(dest, state_dict=state)
        return
    if rank == 0:
        module = engine.module.merge_and_unload() if merge_lora else engine.module
        module.save_pretrained(dest)
