"""The library API: features of your own rows, then clusters, selection and plan, with no run directory.

:func:`compute_features` and :func:`select_and_plan` call the very functions the stages call (the feature
stage's sketchers and post-processing, :func:`~ray_cluster_ft.cluster.cluster_with_config`,
:func:`~ray_cluster_ft.select.select_with_config`, :func:`~ray_cluster_ft.allocate.make_plan`), so for the same
features they give what ``ray-cluster-ft run --plan-only`` writes. :func:`write_selected` is the ``select``
command's export of the selected rows as they were read.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .config import (
    DataConfig,
    JobConfig,
    SketchConfig,
    check_against_data,
    needs_clusters,
)

__all__ = ["EXPORT_FORMATS", "Features", "Plan", "compute_features", "select_and_plan", "write_selected"]


@dataclass(frozen=True)
class Features:
    """Per-example features, in the order of the rows given to :func:`compute_features`.

    Attributes:
        example_id: str ``(N,)``: :func:`ray_cluster_ft.data.example_id` of each row (a hash of its messages).
        features: float32 ``(N, d)``: ``d`` = ``sketch.dim`` (sketch), the hidden size (last_layer,
            hidden_mean) or 384 (embedding).
        n_tokens: int64 ``(N,)``: tokens of each row under the model's chat template.
        examples: the rows as tokenized for training (``pyarrow.Table``: ``example_id`` string, ``input_ids`` and
            ``labels`` list<int32> (prompt tokens -100), ``n_tokens`` int32; row i for input row i; whole rows
            up to ``data.max_seq_len``, whatever ``sketch.max_tokens`` read): what
            :class:`~ray_cluster_ft.integrations.torch.ExamplesDataset`,
            :func:`~ray_cluster_ft.integrations.torch.plan_loss_weights` and the trainer integrations take, so the
            library path needs no tokenisation of its own. ``None`` for a Features built by hand.
    """

    example_id: np.ndarray
    features: np.ndarray
    n_tokens: np.ndarray
    examples: Any = None


@dataclass(frozen=True)
class Plan:
    """The selection and the rank x step plan of :func:`select_and_plan`.

    Attributes:
        clusters: ``clusters.parquet``'s content (``example_id``, ``cluster`` int32, ``distance`` float32), one
            row per candidate; ``None`` when the config clusters nothing (``random``/``full`` selection with
            ``random``/``length`` allocation).
        selection: ``selection.parquet``'s content but its ``source_file``/``source_line`` (a run's file adds
            where each row was read): ``example_id``, ``cluster`` int32, ``reason`` str, ``weight`` float64
            (mean 1), the selected rows the plan trains.
        plan: ``plan.parquet``'s content (:data:`ray_cluster_ft.allocate.PLAN_COLUMNS`), in each rank's order.
        metrics: :func:`ray_cluster_ft.allocate.plan_metrics` of the plan (floats).
        pack_tokens: a packed plan's pack size in tokens (``train.max_tokens_per_micro_batch`` as set, or chosen
            from the data under ``allocation.packing: auto``); ``None`` unpacked.
    """

    clusters: pd.DataFrame | None
    selection: pd.DataFrame
    plan: pd.DataFrame
    metrics: dict
    pack_tokens: int | None = None


def compute_features(rows_or_table, model: str, cfg: JobConfig | SketchConfig, *, world_size: int | None = None,
                     work_dir: str | None = None) -> Features:
    """The feature of every row, as the feature stage computes it (``sketch.method``: gradient sketch,
    last-layer proxy, pooled final hidden state (``hidden_mean``, RDS+) or embedding; at most
    ``sketch.max_tokens`` tokens of a row), without a run directory.

    Without Ray (``ray.is_initialized()`` false) it runs in this process: the sketcher of
    :func:`~ray_cluster_ft.features.make_sketcher` over consecutive chunks of ``8 x sketch.batch_size`` rows
    (the feature stage's shards, so the sub-batches and their padding are the same), each sorted by length
    inside. On Ray it calls :func:`~ray_cluster_ft.features.compute_sketches` (an actor pool) into a temporary
    folder under ``work_dir``. Either way the rows then get the stage's post-processing
    (:func:`~ray_cluster_ft.features.stage.finish_features`: for ``last_layer`` the world-size normalisation).

    Args:
        rows_or_table: a list of row dicts in any accepted format (``messages``, ``prompt`` + ``response``,
            ``question`` + ``answer``), tokenized here with the model's chat template (``cfg.data``'s
            ``max_seq_len`` and ``overlong`` for a :class:`JobConfig`, the defaults otherwise); or a
            ``pyarrow.Table`` already tokenized (``example_id``, ``input_ids``, ``labels``, ``n_tokens`` as in
            :data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`, plus ``text`` for ``sketch.method: embedding``).
        model: the model to tokenize and sketch with: ``demo``, a local folder or a hub id (downloaded once by
            this process into ``model.cache_dir``, by default ``~/.cache/ray-cluster-ft/models``, the command line's too). For ``embedding``
            it only counts tokens; the encoder is ``sketch.model`` or the packaged all-MiniLM-L6-v2.
        cfg: a :class:`JobConfig` (its ``sketch``, ``data``, ``model.trust_remote_code``, ``train.num_workers``
            and ``train.use_gpu`` apply) or a :class:`SketchConfig`.
        world_size: the world size of the ``last_layer`` normalisation; default ``cfg.train.num_workers``
            (required for ``last_layer`` with a :class:`SketchConfig`).
        work_dir: parent of the temporary shard folder on Ray (default the system's temp folder); on a
            multi-node cluster it must be storage every node writes to.

    Returns:
        :class:`Features`: ``example_id`` str ``(N,)``, ``features`` float32 ``(N, d)``, ``n_tokens`` int64
        ``(N,)``, ``examples`` (the tokenized rows: ``example_id``, ``input_ids``, ``labels``, ``n_tokens``), row i
        for input row i.

    Raises:
        TypeError: ``cfg`` is neither a JobConfig nor a SketchConfig, or ``rows_or_table`` neither rows nor a
            table.
        ValueError: no rows; a row that the data stage would reject (named by position and reason); two rows
            with the same content; missing table columns; ``sketch.warmup_steps`` (not done here) or a proxy
            ``sketch.model`` for ``sketch``/``last_layer``/``hidden_mean`` (pass it as ``model``); ``last_layer``
            without a world size.
        FileNotFoundError: the model (or the embedding package) is missing.
    """
    from .model import load_tokenizer, resolve_model_path

    sk, job = _sketch_settings(cfg)
    w = world_size if world_size is not None else (job.train.num_workers if job else None)
    if sk.method == "last_layer" and w is None:
        raise ValueError("compute_features: last_layer features depend on the world size; pass a JobConfig or "
                         "world_size=")
    # Resolved here, once: the sketch actors load only absolute folders (a hub id is downloaded into the cache
    # by this process, so on a cluster set model.cache_dir to storage every node reads).
    cache = _model_cache(job)
    model_path = resolve_model_path(model, "model", cache=cache)
    trust = bool(job and job.model.trust_remote_code)
    tokenizer = load_tokenizer(model_path, trust)
    table = _input_table(rows_or_table, tokenizer, job.data if job else DataConfig(), sk.method)
    sketch_model = _sketch_model(sk, model_path, cache)
    args = (table, sketch_model, sk, trust, int(tokenizer.pad_token_id))
    from .features.stage import finish_features, sketch_in_process

    raw = _on_ray(*args, bool(job and job.train.use_gpu), work_dir) if _ray_running() else sketch_in_process(*args)

    ids = np.asarray(table.column("example_id").to_pylist(), dtype=object)
    feats, _ = finish_features(raw, ids, sk.method, w or 1)
    return Features(ids, feats, table.column("n_tokens").to_numpy().astype(np.int64),
                    table.select(["example_id", "input_ids", "labels", "n_tokens"]))


def _sketch_settings(cfg) -> tuple[SketchConfig, JobConfig | None]:
    """``(sketch section, job config or None)``; refuses what compute_features does not do."""
    if isinstance(cfg, JobConfig):
        sk, job = cfg.sketch, cfg
    elif isinstance(cfg, SketchConfig):
        sk, job = cfg, None
    else:
        raise TypeError(f"compute_features: cfg must be a JobConfig or a SketchConfig, got {type(cfg).__name__}")
    if sk.warmup_steps:
        raise ValueError("compute_features does not warm up the sketch model (sketch.warmup_steps); warm it up "
                         "with ray_cluster_ft.pipeline.warm_up and pass the result as model")
    if sk.model and sk.method != "embedding":
        raise ValueError(f"compute_features sketches with its model argument; pass sketch.model {sk.model!r} as "
                         f"model (the rows are then tokenized with its tokenizer)")
    return sk, job


def _model_cache(job: JobConfig | None) -> Path:
    """Where a ``demo`` conversion or a hub download goes for the library API: ``model.cache_dir`` resolved as the
    command line resolves it (:func:`ray_cluster_ft.model.model_cache_dir`; one default for both)."""
    from .model import model_cache_dir

    return model_cache_dir(job.model.cache_dir, job.output.dir) if job is not None else model_cache_dir(None)


def _sketch_model(sk: SketchConfig, model_path: str, cache: Path) -> str:
    """The model the sketcher loads: the given one, or for ``embedding`` the encoder (as the feature stage)."""
    if sk.method != "embedding":
        return model_path
    from .features.sketchers import embedding_model_dir
    from .model import resolve_model_path

    return resolve_model_path(sk.model, "sketch.model", cache=cache) if sk.model else embedding_model_dir()


def _input_table(rows_or_table, tokenizer, data: DataConfig, method: str):
    """The sketch input table: tokenized rows (and their text for ``embedding``), checked."""
    import pyarrow as pa

    if isinstance(rows_or_table, pa.Table):
        table = rows_or_table
    elif isinstance(rows_or_table, Sequence) and not isinstance(rows_or_table, (str, bytes)):
        table = _tokenize(rows_or_table, tokenizer, data)
    else:
        raise TypeError(f"compute_features: expected a list of row dicts or a pyarrow.Table, got "
                        f"{type(rows_or_table).__name__}")
    need = ["example_id", "input_ids", "labels", "n_tokens"] + (["text"] if method == "embedding" else [])
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"compute_features: the table lacks columns {missing} (sketch.method {method!r})")
    if table.num_rows == 0:
        raise ValueError("compute_features: no rows")
    _check_unique(table.column("example_id").to_pylist())
    return table.select(need)


def _tokenize(rows: Sequence[Any], tokenizer, data: DataConfig, chunk: int = 2048):
    """Rows -> ``example_id``, ``input_ids``, ``labels``, ``n_tokens``, ``text``, as the data stage reads them.

    Raises:
        ValueError: a row the data stage would reject, named by position and reason.
    """
    import pyarrow as pa

    from .data import canonicalize, example_id
    from .data.examples import tokenize_rows

    msgs = []
    for i, row in enumerate(rows):
        try:
            msgs.append(canonicalize(row, data.format, data.columns))
        except ValueError as err:
            raise ValueError(f"compute_features: row {i}: {err}") from None
    toks: list = []
    for lo in range(0, len(msgs), chunk):  # tokenizer memory stays bounded, as in the data stage
        toks += tokenize_rows(msgs[lo:lo + chunk], tokenizer, data.max_seq_len, data.overlong,
                              train_on=data.train_on, system_prompt=data.default_system_prompt)
    bad = next((i for i, t in enumerate(toks) if isinstance(t, str)), None)
    if bad is not None:
        hint = "" if "max length" not in toks[bad] else (
            " (raise data.max_seq_len" + (" or set data.overlong: truncate)" if data.overlong == "drop" else ")"))
        raise ValueError(f"compute_features: row {bad}: {toks[bad]}{hint}")
    ints = pa.list_(pa.int32())
    return pa.table({
        "example_id": pa.array([example_id(m) for m in msgs], type=pa.string()),
        "input_ids": pa.array([t[0] for t in toks], type=ints),
        "labels": pa.array([t[1] for t in toks], type=ints),
        "n_tokens": pa.array([len(t[0]) for t in toks], type=pa.int32()),
        # The embedding baseline's text, as the feature stage builds it from the same messages.
        "text": pa.array(["\n".join(m["content"] for m in ms) for ms in msgs], type=pa.string()),
    })


def _check_unique(ids: list[str]) -> None:
    """Example ids are content hashes: a repeat is the same example twice, which the plan cannot hold."""
    first: dict[str, int] = {}
    for i, eid in enumerate(ids):
        if eid in first:
            raise ValueError(f"compute_features: rows {first[eid]} and {i} are the same example ({eid}); "
                             f"de-duplicate the rows first")
        first[eid] = i


def _ray_running() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized()


def _on_ray(table, model_path: str, sk: SketchConfig, trust: bool, pad_token_id: int, use_gpu: bool,
            work_dir: str | None) -> dict:
    """:func:`compute_sketches` into a temporary folder, read back (``{"example_id", "sketch", ...}``)."""
    from .features import compute_sketches, read_sketches

    with tempfile.TemporaryDirectory(prefix="rcft-features-", dir=work_dir) as tmp:
        compute_sketches(table, model_path, sk, tmp, use_gpu=use_gpu, trust_remote_code=trust,
                         pad_token_id=pad_token_id)
        return read_sketches(tmp)


def select_and_plan(features, n_tokens, cfg: JobConfig, *, example_ids=None) -> Plan:
    """Clusters, selection, selection weights and the rank x step plan of the given features: pure (no Ray, no
    I/O, no global state), and for the same features equal to what ``ray-cluster-ft run --plan-only`` writes
    (``clusters.parquet``, ``selection.parquet``, ``plan.parquet``).

    Args:
        features: a :class:`Features` (its ids are used), or float ``(N, d)`` features; ``None`` only when the
            config clusters nothing (``random``/``full`` selection with ``random``/``length`` allocation).
        n_tokens: int ``(N,)`` tokens per example; ``None`` takes ``features.n_tokens``.
        cfg: the job config: ``clustering``, ``selection``, ``allocation`` and ``train`` (world size,
            ``micro_batch_size``, ``grad_accum``, ``epochs``).
        example_ids: str ``(N,)`` unique; default ``features.example_id``, else ``"0"``..``"N-1"``.

    Returns:
        :class:`Plan`: ``clusters`` (N rows or ``None``), ``selection`` and ``plan`` frames, ``metrics`` dict.

    Raises:
        TypeError: ``cfg`` is not a JobConfig.
        ValueError: shapes disagree, ids repeat, features missing or not finite, as :func:`cluster_sketches`.
        ConfigError: the config is impossible for N examples (as at the start of a run), or ``equalize``
            leaves no row per cluster.
    """
    if not isinstance(cfg, JobConfig):
        raise TypeError(f"select_and_plan: cfg must be a JobConfig, got {type(cfg).__name__}")
    x, tok, ids = _plan_inputs(features, n_tokens, example_ids)
    check_against_data(cfg, len(ids))
    from .cluster import cluster_with_config
    from .select import select_with_config

    clusters = labels = dist = None
    if needs_clusters(cfg):
        if x is None:
            raise ValueError("select_and_plan: this config clusters the examples: it needs their features")
        res, table = cluster_with_config(cfg, ids, x, n_tokens=tok)
        clusters, labels, dist = table.to_pandas(), res.labels, res.dist
    sel = select_with_config(cfg, n_candidates=len(ids), sketches=x if labels is not None else None,
                             labels=labels, dist=dist, n_tokens=tok).result
    plan, selection, pack_tokens = _allocate(cfg, ids, labels if labels is not None else np.zeros(len(ids),
                                                                                                  dtype=np.int64),
                                             tok, sel)
    from .allocate import plan_metrics

    return Plan(clusters, selection, plan, plan_metrics(plan, cfg.train.num_workers, pack_tokens), pack_tokens)


def _plan_inputs(features, n_tokens, example_ids) -> tuple:
    """``(features float (N, d) or None, n_tokens int64 (N,), example ids str (N,))``, checked."""
    if isinstance(features, Features):
        x = features.features
        n_tokens = features.n_tokens if n_tokens is None else n_tokens
        example_ids = features.example_id if example_ids is None else example_ids
    else:
        x = None if features is None else np.asarray(features)
    if n_tokens is None:
        raise ValueError("select_and_plan: n_tokens is needed unless features is a Features")
    tok = np.asarray(n_tokens)
    if tok.ndim != 1 or (tok.size and not np.issubdtype(tok.dtype, np.integer)):
        raise ValueError(f"select_and_plan: n_tokens must be a 1-D integer array, got shape {tok.shape} "
                         f"dtype {tok.dtype}")
    n = tok.size
    ids = np.asarray([str(i) for i in range(n)] if example_ids is None else example_ids, dtype=object)
    if x is not None and (x.ndim != 2 or x.shape[0] != n):
        raise ValueError(f"select_and_plan: features {x.shape} must be (N, d) with N = {n}, the n_tokens given")
    if ids.shape != (n,) or len(set(ids.tolist())) != n:
        raise ValueError(f"select_and_plan: example_ids must be {n} unique ids")
    return x, tok.astype(np.int64), ids


def _allocate(cfg: JobConfig, ids, labels, n_tokens, sel) -> tuple[pd.DataFrame, pd.DataFrame, int | None]:
    """``(plan, selection, pack tokens)`` exactly as the allocation stage writes ``plan.parquet`` and
    ``selection.parquet`` (both come from :func:`ray_cluster_ft.allocate.plan_selection`); the pack size is
    ``PlanResult.pack_tokens`` (None unpacked)."""
    from .allocate import plan_selection

    res, table = plan_selection(cfg, ids, labels, n_tokens, np.asarray(sel.indices), sel.reasons)
    return res.plan, table.to_pandas(), res.pack_tokens


SELECTED_COLUMNS = ("example_id", "cluster", "weight", "rank", "step", "source_file", "source_line")
"""The columns :func:`write_selected` adds to each row's own fields (they replace fields of the same name)."""


def write_selected(cfg: JobConfig, run_dir: str | Path, fmt: str | None = None) -> tuple[Path, ...]:
    """The ``select`` command's export: every row of ``selection.parquet`` as it was read from the sources
    (its original fields), plus ``example_id``, ``cluster``, ``weight``, the ``rank`` and ``step`` of its
    first appearance in ``plan.parquet``, and ``source_file`` / ``source_line`` (where it was read), written to ``selected.jsonl`` and ``selected.parquet`` (in the order
    of ``selection.parquet``), both claimed in the run directory's ledger first.

    Parquet columns are the union of the rows' fields (missing ones null); a field whose values mix types
    (a number in one row, text in another) is stored as JSON text there. The JSONL keeps every value as read.

    ``fmt`` (``select --format``) also writes the rows for another trainer, as the chat messages the data stage
    read from each row (whatever its format), in the same order (line i is row i of ``selected.jsonl``):
    ``llamafactory``: ``llamafactory/selected.jsonl`` (``{"messages": [{"role", "content"}, ...]}`` per line)
    and ``llamafactory/dataset_info.json`` with the entry :data:`LLAMAFACTORY_DATASET` (sharegpt formatting,
    OpenAI role tags), for ``dataset_dir: <run_dir>/llamafactory`` and ``dataset: ray_cluster_ft_selected``;
    ``axolotl``: ``axolotl/selected.jsonl`` (the same lines), a ``type: chat_template`` dataset
    (``field_messages: messages``). Neither trainer reads the plan's order or the weights.

    Args:
        cfg: the job config of the run (its ``data`` section names the sources).
        run_dir: a run directory with ``selection.parquet`` and ``plan.parquet`` (after ``--plan-only``).
        fmt: ``None`` (the two files only) or one of :data:`EXPORT_FORMATS`.

    Returns:
        ``(selected.jsonl, selected.parquet)`` paths, then the files ``fmt`` wrote.

    Raises:
        ValueError: an unknown ``fmt``.
        RuntimeError: a selected example is no longer in the sources (they changed since the run).
        ConfigError: the names exist in ``run_dir`` but no run wrote them.
    """
    from .data.read import json_text
    from .rundir import claim

    if fmt is not None and fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(EXPORT_FORMATS)}")
    run_dir = Path(run_dir)
    records, messages = _selected_records(cfg, run_dir)
    jsonl = claim(run_dir, "selected.jsonl", "selected.parquet", *([fmt] if fmt else []))
    with open(jsonl, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json_text(rec) + "\n")
    parquet = run_dir / "selected.parquet"
    _write_parquet(records, parquet)
    return (jsonl, parquet) + (_write_for_trainer(run_dir / fmt, fmt, messages) if fmt else ())


EXPORT_FORMATS = ("llamafactory", "axolotl")
"""The ``select --format`` values: trainers whose own data loaders read the selection (:func:`write_selected`)."""

LLAMAFACTORY_DATASET = "ray_cluster_ft_selected"
"""The name of the selection in the ``dataset_info.json`` that ``select --format llamafactory`` writes."""


def _write_for_trainer(folder: Path, fmt: str, messages: list[list[dict]]) -> tuple[Path, ...]:
    """``folder/selected.jsonl`` (one ``{"messages": [...]}`` per row) and, for LLaMA-Factory, its
    ``dataset_info.json`` entry (LLaMA-Factory's sharegpt format with OpenAI-style ``role``/``content`` tags,
    as its own docs describe for such files)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "selected.jsonl"
    with open(data, "w", encoding="utf-8") as fh:
        for msgs in messages:
            fh.write(json.dumps({"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]},
                                ensure_ascii=False) + "\n")
    if fmt == "axolotl":
        return (data,)
    info = {LLAMAFACTORY_DATASET: {
        "file_name": data.name, "formatting": "sharegpt", "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                 "system_tag": "system"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return data, folder / "dataset_info.json"


def _selected_records(cfg: JobConfig, run_dir: Path) -> tuple[list[dict], list[list[dict]]]:
    """One dict per selected row (the row as read, then the :data:`SELECTED_COLUMNS`), and its chat messages."""
    sel = pd.read_parquet(run_dir / "selection.parquet")
    plan = pd.read_parquet(run_dir / "plan.parquet", columns=["example_id", "step", "rank", "micro_index"])
    first = plan.sort_values(["step", "rank", "micro_index"], kind="stable").drop_duplicates("example_id")
    first = first.set_index("example_id")
    rows = _original_rows(cfg.data, set(sel["example_id"]))
    where = sel.set_index("example_id") if "source_file" in sel.columns else None
    out, msgs = [], []
    for eid, cluster, weight in zip(sel["example_id"], sel["cluster"], sel["weight"]):
        extra = {"example_id": eid, "cluster": int(cluster), "weight": float(weight),
                 "rank": int(first.at[eid, "rank"]), "step": int(first.at[eid, "step"])}
        if where is not None:  # selection.parquet of a run before issue 28 has no origins
            extra.update(source_file=str(where.at[eid, "source_file"]), source_line=int(where.at[eid, "source_line"]))
        row, row_msgs = rows[eid]
        out.append({**{k: v for k, v in row.items() if k not in extra}, **extra})
        msgs.append(row_msgs)
    return out, msgs


def _original_rows(data: DataConfig, wanted: set[str]) -> dict[str, tuple[dict, list[dict]]]:
    """The first source row of each wanted example id, as read (the data stage keeps the first of duplicates),
    with its chat messages."""
    from .data.read import rows_by_id

    return dict(rows_by_id(data, wanted))


def _write_parquet(records: list[dict], path: Path) -> None:
    """The records as one Parquet table whose columns are the union of their fields."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .data.read import json_text

    names = list(dict.fromkeys(k for r in records for k in r))
    cols = {}
    for name in names:
        values = [r.get(name) for r in records]
        try:
            cols[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, UnicodeEncodeError):
            # Mixed types in one field cannot share a Parquet column, nor can a lone surrogate be UTF-8: keep
            # them, as JSON text.
            cols[name] = pa.array([None if v is None else json_text(v) for v in values], type=pa.string())
    pq.write_table(pa.table(cols), path)

