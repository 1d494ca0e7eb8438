"""The config sections of training, evaluation and output (:class:`LoraConfig`, :class:`TrainConfig`,
:class:`EvaluationConfig`, :class:`OutputConfig`), re-exported by :mod:`ray_cluster_ft.config`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ._config_base import Section, seed_field

__all__ = ["LoraConfig", "TrainConfig", "EvaluationConfig", "OutputConfig"]


class LoraConfig(Section):
    """Low-rank adapters through peft (Hu et al., "LoRA", ICLR 2022): only the adapters train."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="suffixes of the nn.Linear module names that get adapters",
    )
    merge: bool = Field(True, description="true: final_model/ is a plain model with the adapters merged into the "
                                          "base weights; false: the adapter only (adapter_config.json names the base)")


class TrainConfig(Section):
    """Ray Train + DeepSpeed settings. The optimizer is AdamW (betas 0.9, 0.999; DeepSpeed's CPU Adam with
    ``offload``); the learning rate warms up linearly over ``warmup_steps``, then decays linearly."""

    num_workers: int = Field(2, ge=1, description="data-parallel world size (Ray Train workers)")
    use_gpu: bool = Field(False, description="one GPU per worker (NCCL); false: CPU workers (gloo)")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs each worker reserves")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    micro_batch_size: int = Field(4, ge=1, description="rows per micro-batch per rank; packed, a micro-batch is "
                                                       "one pack, and packs sized to the data (allocation.packing: "
                                                       "auto, no max_tokens_per_micro_batch) keep the unpacked step "
                                                       "count, selected rows // (num_workers x micro_batch_size x "
                                                       "grad_accum)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per rank per optimizer step")
    epochs: int = Field(1, ge=1, le=1000, description="passes over the selection (the plan grows with it)")
    lr: float = Field(2e-5, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warm-up")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (global norm)")
    log_every: int = Field(1, ge=1, description="rank 0 prints a progress line every N optimizer steps (and at the "
                                                "last); train_log.jsonl has every step")
    seed: int = seed_field("torch seed of the workers")
    timeout_s: int = Field(1800, ge=10, description="collective-op timeout of the process group")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    offload: Literal["none", "optimizer", "params"] = Field(
        "none", description="ZeRO CPU offload: optimizer state, or optimizer state and parameters (ZeRO-3)"
    )
    deepspeed_config: str | None = Field(
        None, description="path to a DeepSpeed JSON merged over the generated config (its keys win; batch keys "
                          "must match the plan; ``~`` is expanded); read and checked on the driver when the run starts"
    )
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N optimizer steps; 0 = only at the end")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: fp32 on CPU; on GPU bf16 where the GPU supports it (Ampere and later), else fp16 "
                            "with dynamic loss scaling (decided on each worker's GPU); gradients accumulate in fp32")
    gradient_checkpointing: bool | None = Field(
        None, description="recompute activations in the backward (long sequences at 7B+); null = on with use_gpu")
    loss_weighting: Literal["cluster", "none"] | None = Field(
        None, description="cluster: weigh each example's token losses by its selection weight (n_c/N)/(s_c/S), "
                          "restoring every cluster's share of the data; none: weight 1; null = cluster for the "
                          "published equalize selection, none otherwise (measured: docs/benchmarks.md). Either way a step's loss is "
                          "token-exact: sum_i w_i sum_t l_it / sum_i w_i |T_i| over all its ranks")
    max_failures: int = Field(2, ge=-1, description="worker-group restarts from the latest checkpoint; -1 = no limit")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=8, description="packed plans only: tokens per pack at most (whole examples, never cut, so at "
                                "least data.max_seq_len); required by allocation.packing: true; under auto, "
                                "unset = packs sized to the data (the unpacked step count, each pack near the "
                                "epoch's tokens / (steps x num_workers x grad_accum); the manifest's "
                                "allocation.max_tokens_per_micro_batch gives the size)")

    final_checkpoint: bool = Field(
        True, description="write a last checkpoint after the final step (off when only final_model/ is wanted)")

    @model_validator(mode="after")
    def _precision_on_its_device(self) -> "TrainConfig":
        if self.precision == "fp16" and not self.use_gpu:
            raise ValueError("train.precision 'fp16' needs train.use_gpu (DeepSpeed has no fp16 on the CPU); use "
                             "fp32 or bf16")
        return self

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "TrainConfig":
        if self.offload == "optimizer" and self.zero_stage == 0:
            raise ValueError("train.offload='optimizer' needs train.zero_stage >= 1")
        if self.offload == "params" and self.zero_stage != 3:
            raise ValueError("train.offload='params' needs train.zero_stage = 3")
        return self

    @field_validator("deepspeed_config")
    @classmethod
    def _expand_user(cls, v: str | None) -> str | None:
        # The file itself is read and checked once, on the driver (train.build_deepspeed_config): validation
        # here reads nothing, so a worker that receives this config never looks for the file on its node.
        return None if v is None else str(Path(v).expanduser())


class EvaluationConfig(Section):
    """Held-out evaluation before and after training: response-token loss and perplexity per domain, plus
    multiple-choice accuracy (items with choices and a gold letter) and pass@1 (code problems with tests)."""

    max_mc: int = Field(64, ge=0, description="multiple-choice items scored at most")
    max_code: int = Field(8, ge=0, description="code problems generated and run at most (pass@1)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per code problem (greedy)")
    time_limit_s: float = Field(5.0, gt=0, description="seconds each generated program may run with its tests")
    paths: list[str] = Field(
        default_factory=list,
        description="extra held-out files (any data.paths format), scored before and after training, per file: "
                    "loss, and MC accuracy or pass@1 where rows carry choices or tests; never sketched, selected "
                    "or trained on (manifest: eval_files)")
    every_epoch: bool = Field(
        False, description="also score the model after every epoch (saved as epochs/epoch{e}/ while training; "
                           "needs output.save_model): manifest eval_epochs, each epoch's held-out scores and the "
                           "macro mean of the evaluation files' losses, and eval.best_epoch, the lowest; the "
                           "other epochs' folders are removed, the best one is kept")

    @field_validator("paths")
    @classmethod
    def _expand_user(cls, v: list[str]) -> list[str]:
        return [str(Path(x).expanduser()) for x in v]


class OutputConfig(Section):
    """Where the run directory goes."""

    dir: str = Field("runs/demo", min_length=1, description="the run directory (``--output`` sets it); a folder "
                                                           "holding files no run wrote is refused")
    save_model: bool = Field(True, description="write final_model/ (Hugging Face format) at the end")
