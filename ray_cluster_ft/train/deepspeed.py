"""The DeepSpeed config of a job, built and validated once on the driver, and the learning-rate schedule.

Workers receive the finished dict and read no file (docs/design.md, "Train").
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig

__all__ = [
    "precision_for",
    "resolve_precision",
    "lr_multiplier",
    "deepspeed_config",
    "merge_deepspeed_config",
    "read_deepspeed_json",
    "build_deepspeed_config",
]


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


def make_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """DeepSpeed client scheduler factory (called with the basic optimizer inside ``deepspeed.initialize``)."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps)
    )


def precision_for(cfg: TrainConfig, bf16_supported: bool | None = None) -> str:
    """``bf16``, ``fp16``, ``fp32``, or ``auto`` (GPU, device not known here) for ``train.precision``.

    ``auto``: fp32 on the CPU; on a GPU bf16 when ``bf16_supported`` (Ampere and later), fp16 when not, and
    ``auto`` when the caller cannot tell (the driver may run on a CPU-only head node).
    """
    if cfg.precision != "auto":
        return cfg.precision
    if not cfg.use_gpu:
        return "fp32"
    return "auto" if bf16_supported is None else ("bf16" if bf16_supported else "fp16")


def _precision_keys(precision: str) -> dict:
    """DeepSpeed's precision sections for ``precision`` (``auto`` is written as bf16 and settled per worker)."""
    half = precision in ("bf16", "fp16", "auto")
    out: dict[str, Any] = {"bf16": {"enabled": precision in ("bf16", "auto")},
                           "fp16": {"enabled": precision == "fp16"}}
    if precision == "fp16":
        out["fp16"].update({"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1})
    if half:
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def resolve_precision(ds: dict, precision: str, bf16_supported: bool) -> tuple[dict, str]:
    """On a worker: settle ``auto`` on this GPU (bf16 where supported, else fp16) in a copy of the DeepSpeed
    dict. Returns ``(ds, precision)`` with precision one of bf16, fp16, fp32."""
    if precision != "auto":
        return ds, precision
    settled = "bf16" if bf16_supported else "fp16"
    return {**ds, **_precision_keys(settled)}, settled


def deepspeed_config(cfg: TrainConfig, total_steps: int, user: dict | None = None) -> dict:
    """The DeepSpeed config dict for ``cfg``.

    - batch: ``train_micro_batch_size_per_gpu = micro_batch_size``, ``gradient_accumulation_steps =
      grad_accum``, ``train_batch_size`` = their product times ``num_workers`` (DeepSpeed checks it
      against the real world size);
    - ``zero_optimization.stage = zero_stage``; ``gradient_clipping = max_grad_norm``; under ZeRO-3
      ``stage3_gather_16bit_weights_on_model_save`` (the final model is consolidated one module at a time onto
      rank 0, not gathered whole on every rank);
    - precision (:func:`precision_for`): ``train.precision``, where ``auto`` is fp32 on CPU and, on GPU, left
      for each worker to settle on its own device (:func:`resolve_precision`); bf16 and fp16 accumulate
      gradients in fp32 (``data_types.grad_accum_dtype``), fp16 uses dynamic loss scaling (fp16 is not
      supported by DeepSpeed on the CPU; docs/design.md, "Verified platform facts");
    - optimizer: AdamW with ``torch_adam: true`` (torch's AdamW, so no JIT-compiled FusedAdam); with
      ``train.offload`` DeepSpeed's own CPU Adam instead (``torch_adam`` absent), which DeepSpeed documents as
      5-7x faster than torch's on the CPU (it is JIT-compiled once, then cached);
    - no ``scheduler`` entry: DeepSpeed's ``WarmupDecayLR`` sets the learning rate to ``warmup_min_lr`` at
      construction and clamps warm-up to >= 2 steps, so with ``warmup_min_lr = 0`` the first two steps do
      not train at all (and with ``warmup_min_lr = lr`` there is no decay). The workers pass the linear
      warm-up + linear decay of :func:`lr_multiplier` as a client ``LambdaLR`` instead, which trains from the
      first step; ``total_steps`` is validated here for that schedule;
    - ``steps_per_print`` large: the training loop logs its own steps;
    - ``user`` (the parsed ``train.deepspeed_config`` JSON, see :func:`read_deepspeed_json`) merged over it with
      :func:`merge_deepspeed_config`. Pure: reads no file.

    Raises:
        ValueError: ``total_steps < 1``; a user batch key that contradicts the plan, or a non-mapping where
            DeepSpeed needs one (from :func:`merge_deepspeed_config`).
    """
    if total_steps < 1:
        raise ValueError(f"deepspeed_config: total_steps must be >= 1, got {total_steps}")
    zero: dict[str, Any] = {"stage": int(cfg.zero_stage)}
    if cfg.zero_stage == 3:  # the final model is gathered module by module onto rank 0 (loop._save_hf_model)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
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
        **_precision_keys(precision_for(cfg)),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                **({} if cfg.offload in ("optimizer", "params") else {"torch_adam": True}),
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if user:
        ds = merge_deepspeed_config(ds, user)
    return ds


def merge_deepspeed_config(base: dict, user: dict) -> dict:
    """``user`` merged over ``base``, recursively: nested mappings merge key by key, any other user value wins.

    The batch keys (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``)
    must agree with the plan, which fixed them: a user value that differs raises. Where ``base`` holds a
    mapping (``optimizer``, ``zero_optimization``, ...) the user's value must be a mapping too: DeepSpeed would
    otherwise fail inside every training worker.

    Raises:
        ValueError: a user batch key that contradicts the job config (the plan's micro-batches would not fit), a
            ZeRO stage other than ``train.zero_stage``, or a non-mapping where ``base`` has a mapping.
    """
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if key in user and user[key] != base.get(key):
            raise ValueError(
                f"the DeepSpeed config sets {key}={user[key]!r} but the plan needs {base.get(key)!r}; "
                f"set train.micro_batch_size / train.grad_accum / train.num_workers instead"
            )
    # The workers build the model (zero.Init under ZeRO-3) and save it (16-bit gather) by train.zero_stage, so
    # the stage DeepSpeed runs must be that one.
    stage = (user.get("zero_optimization") or {}).get("stage") if isinstance(user.get("zero_optimization"), dict) \
        else None
    # (a stage that is not a whole number is left to DeepSpeed's own config model, which names the field)
    if isinstance(stage, int) and not isinstance(stage, bool) and stage != base["zero_optimization"]["stage"]:
        raise ValueError(f"the DeepSpeed config sets zero_optimization.stage={stage!r} but train.zero_stage is "
                         f"{base['zero_optimization']['stage']}; set train.zero_stage instead")
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


def disable_shm_comm() -> None:
    """Stop DeepSpeed from JIT-compiling its shared-memory all-reduce op (``deepspeed_shm_comm``) on CPU.

    The op only serves inference all-reduce but costs about a minute of C++ compilation at the first
    ``deepspeed.initialize`` on CPU; DeepSpeed's ``build_shm_op`` skips it when this entry of the (private)
    compatible-ops table is False (docs/design.md, "Verified platform facts"; DeepSpeed 0.19.8). The one place that touches
    the private hook.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def read_deepspeed_json(path: str) -> dict:
    """The JSON object in the user's DeepSpeed file ``train.deepspeed_config``.

    Raises:
        ConfigError: the file is missing, is not valid JSON, or does not hold a JSON object.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"train.deepspeed_config: DeepSpeed config file not found: {p}")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"train.deepspeed_config: {p} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"train.deepspeed_config: {p} must hold a JSON object, got {type(obj).__name__}")
    return obj


def build_deepspeed_config(cfg: TrainConfig, total_steps: int = 1) -> dict:
    """The job's DeepSpeed dict, built and validated once on the driver: :func:`deepspeed_config` with the
    user's JSON (:func:`read_deepspeed_json`) merged in, its ZeRO section checked with DeepSpeed's own config
    model (``DeepSpeedZeroConfig``). Workers get the result and read nothing.

    Raises:
        ConfigError: an unreadable user file, a user batch key that contradicts the plan, a non-mapping where
            DeepSpeed needs one, or a ZeRO section DeepSpeed refuses (its message quoted).
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    user = read_deepspeed_json(cfg.deepspeed_config) if cfg.deepspeed_config else None
    try:
        ds = deepspeed_config(cfg, total_steps, user)
    except ValueError as err:
        raise ConfigError(f"train.deepspeed_config {cfg.deepspeed_config}: {err}") from None
    if user is not None:
        try:
            DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
        except Exception as err:  # pydantic's ValidationError, or a TypeError for an unknown shape
            lines = [x.strip() for x in str(err).splitlines() if x.strip()]
            raise ConfigError(
                f"train.deepspeed_config {cfg.deepspeed_config}: zero_optimization is not valid for DeepSpeed: "
                f"{' '.join(lines[1:3]) if len(lines) > 2 else ' '.join(lines)}") from None
    return ds
