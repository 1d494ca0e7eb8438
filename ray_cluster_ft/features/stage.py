"""The feature stage: Ray Data actors sketch every candidate, resumably, one Parquet shard per actor call.

``sketch.model`` may name a smaller proxy model (re-tokenised when its tokenizer differs),
``sketch.method: embedding`` (the default) replaces gradients by all-MiniLM-L6-v2 sentence embeddings (no trained
model), ``sketch.method: last_layer`` by CluSTER's last-layer gradient proxy (:mod:`.last_layer`, normalised
here on the driver by the world size), ``sketch.method: hidden_mean`` by the RDS+ feature (:mod:`.hidden_mean`:
pooled final hidden states, no LM head). A warmed-up sketch model (``sketch.warmup_steps``) comes from the
pipeline (:mod:`ray_cluster_ft.pipeline.warmup`) as ``run``'s ``sketch_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..config import SketchConfig
from .inputs import prepare_sketch_inputs
from .last_layer import normalise_last_layer
from .sketchers import embedding_model_dir, make_sketcher
from ._pool import _actor_resources, _layout_actors, _row_bar
from ._shards import _SHARD_COLS, _finished_shards, _to_arrow, _write_atomic
from .store import (FeatureShards, plan_shards, resolve_shard_dtype, run_shards, sketch_fingerprint,
                    stream_features, streaming_unsupported)

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa
    import ray.data


__all__ = [
    "ShardSketcher",
    "compute_sketches",
    "sketch_in_process",
    "sketch_with_store",
    "FeaturesOutput",
    "finish_features",
    "run",
]


# A shard (one actor call, one file) holds this many sketch sub-batches by default: sorting a larger pool
# by length leaves less padding, and a smaller one loses less work to an interruption.
_SUBBATCHES_PER_RAY_BATCH = 8
# ... and a large input is cut into at most this many shards: 10^6 rows write 500 files of 2,000 rows, not 15,625
# of 64 (a shared file system or an object store pays per file; an interruption loses one shard per actor).
_MAX_SHARDS = 500

# ``sketch.in_process_rows`` (default 512): at most that many rows left to sketch on the CPU are sketched in the
# driver rather than by a fresh actor pool (compute_sketches' in_process_rows): a small job, or the nightly job's
# few new rows. Measured on 2 busy cores with a 16M-parameter model: 60 rows took 50 s through the pool (30 s of it
# the actors' start-up); 40 rows of the demo model took 241 s through the pool under load 10-50.
# 512 since 2026-12-07: the demo's 278 rows and 842 rows were faster in the driver than through a pool on 2
# cores, with the same clusters, selection and plan (docs/benchmarks.md, "Small jobs").


class ShardSketcher:
    """Ray Data callable class around :class:`GradientSketcher` / :class:`LastLayerSketcher` /
    :class:`HiddenMeanSketcher` / :class:`EmbeddingSketcher` (:func:`make_sketcher`) that writes each shard's sketches to
    ``out_dir/<shard file>`` (atomically) and returns one summary row per shard.

    A batch must hold whole shards (``compute_sketches`` feeds one shard per block with ``batch_size=None``);
    rows are grouped by the ``_shard`` column. Exports Ray metrics (``ray.util.metrics``, tag ``method``):
    ``ray_cluster_ft_sketch_examples_total`` (counter, examples), ``ray_cluster_ft_sketch_tokens_total``
    (counter, real tokens of the trained model's tokenization) and ``ray_cluster_ft_sketch_tokens_per_second``
    (gauge, tokens/s of the actor's last shard, wall clock).

    Args:
        method: ``sketch``, ``last_layer``, ``hidden_mean`` or ``embedding``.
        model_path: the model to sketch with (``None`` = the packaged MiniLM for ``embedding``).
        sketch: ``SketchConfig.model_dump()``.
        out_dir: the sketch folder (shared by every actor; on a multi-node cluster a shared file system).
        trust_remote_code, pad_token_id, device: as in :class:`GradientSketcher`.
        fail_on_shard: test hook: raise ``RuntimeError`` on reaching this shard index (an interrupted stage).
    """

    def __init__(self, method: str, model_path: str | None, sketch: dict, out_dir: str,
                 trust_remote_code: bool = False, pad_token_id: int = 0, device: str | None = None,
                 fail_on_shard: int | None = None):
        self.inner = make_sketcher(method, model_path, sketch, trust_remote_code, pad_token_id, device)
        self.method = method
        self.shard_dtype = "float16" if sketch.get("shard_dtype") == "float16" else "float32"
        self.out_dir = Path(out_dir)
        self.fail_on_shard = fail_on_shard
        self.metrics = None
        try:
            import ray

            if ray.is_initialized():
                from ray.util.metrics import Counter, Gauge

                tags = ("method",)
                self.metrics = (
                    Counter("ray_cluster_ft_sketch_examples_total", "examples sketched", tag_keys=tags),
                    Counter("ray_cluster_ft_sketch_tokens_total", "real tokens of the examples sketched",
                            tag_keys=tags),
                    Gauge("ray_cluster_ft_sketch_tokens_per_second",
                          "real tokens / wall seconds of this actor's last shard", tag_keys=tags),
                )
        except ImportError:  # pragma: no cover
            pass

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import time

        shard = np.asarray(batch["_shard"]).astype(np.int64)
        files = np.asarray(batch["_shard_file"]).astype(str)
        expect = np.asarray(batch["_shard_rows"]).astype(np.int64)
        out = {"shard": [], "rows": [], "seconds": []}
        for s in np.unique(shard):
            rows = np.flatnonzero(shard == s)
            if len(rows) != expect[rows[0]]:
                raise RuntimeError(f"ShardSketcher: got {len(rows)} rows of shard {s}, expected {expect[rows[0]]}: "
                                   f"a batch must hold whole shards")
            if self.fail_on_shard is not None and int(s) == self.fail_on_shard:
                raise RuntimeError(f"ShardSketcher: injected failure on shard {s}")
            t0 = time.perf_counter()
            sub = {k: v[rows] for k, v in batch.items() if k not in _SHARD_COLS}
            _write_atomic(_to_arrow(self.inner(sub), self.shard_dtype), self.out_dir / files[rows[0]])
            dt = time.perf_counter() - t0
            if self.metrics is not None:
                tokens = float(np.asarray(sub["n_tokens"]).sum())
                tags = {"method": self.method}
                self.metrics[0].inc(len(rows), tags=tags)
                self.metrics[1].inc(tokens, tags=tags)
                self.metrics[2].set(tokens / max(dt, 1e-9), tags=tags)
            out["shard"].append(int(s))
            out["rows"].append(len(rows))
            out["seconds"].append(dt)
        return {k: np.asarray(v) for k, v in out.items()}


def _sketch_here(table, pending, cfg: SketchConfig, model_path: str, out: Path, trust_remote_code: bool,
                 pad_token_id: int, fail_on_shard: int | None) -> None:
    """The pending shards sketched in this process by one :class:`ShardSketcher` on the CPU, shard by shard, in
    the numpy batch format Ray Data hands an actor (object arrays of token arrays); one tqdm bar of rows."""
    sketcher = ShardSketcher(cfg.method, model_path, cfg.model_dump(), str(out.resolve()), trust_remote_code,
                             pad_token_id, device="cpu", fail_on_shard=fail_on_shard)
    with _row_bar(sum(s.stop - s.start for s in pending)) as bar:
        for s in pending:
            t = table.slice(s.start, s.stop - s.start)
            batch = {c: t.column(c).to_numpy() for c in t.column_names}
            n = t.num_rows
            batch.update(_shard=np.full(n, s.index, dtype=np.int32), _shard_file=np.asarray([s.file] * n),
                         _shard_rows=np.full(n, n, dtype=np.int32))
            sketcher(batch)
            bar.update(n)


def _default_shard_rows(n_rows: int, cfg: SketchConfig, use_gpu: bool, gpu_actors: int | None) -> int:
    """Rows per shard: ``8 * sketch.batch_size`` (:data:`_SUBBATCHES_PER_RAY_BATCH` sub-batches), or
    ``ceil(n_rows / 500)`` when that is larger (:data:`_MAX_SHARDS`: a large job writes hundreds of files, not
    tens of thousands); but when the input is smaller than one ``8 * sketch.batch_size`` shard per actor of the
    pool (:func:`_actor_resources`), ``ceil(n_rows / actors)`` (at least ``sketch.batch_size``), so that every
    actor gets a shard: a job that adds a few rows to a feature store (60 rows, 2 actors) sketches them as two
    shards at once, not one after the other."""
    rows = _SUBBATCHES_PER_RAY_BATCH * cfg.batch_size
    if n_rows == 0:
        return rows
    if n_rows > rows * _MAX_SHARDS:
        return -(-n_rows // _MAX_SHARDS)
    n_actors, _ = _layout_actors(cfg, use_gpu, gpu_actors)
    if n_rows >= rows * n_actors:
        return rows
    return max(cfg.batch_size, min(rows, -(-n_rows // n_actors)))


def _input_columns(method: str) -> list[str]:
    """The columns a method reads: text for ``embedding``, token ids for ``sketch``, ``last_layer`` and
    ``hidden_mean``."""
    if method == "embedding":
        return ["example_id", "text", "n_tokens"]
    return ["example_id", "input_ids", "labels", "n_tokens"]


def compute_sketches(
    examples: "pa.Table | ray.data.Dataset",
    model_path: str | None,
    cfg: SketchConfig,
    out_dir: str,
    use_gpu: bool = False,
    trust_remote_code: bool = False,
    pad_token_id: int = 0,
    shard_rows: int | None = None,
    fail_on_shard: int | None = None,
    gpu_actors: int | None = None,
    in_process_rows: int = 0,
    n_candidates: int | None = None,
) -> dict:
    """Sketch every example with a pool of :class:`ShardSketcher` actors; resumable, one Parquet file a shard.

    The rows (in input order) are cut into shards of ``shard_rows`` (default :func:`_default_shard_rows`:
    ``8 * cfg.batch_size``, fewer when that would leave actors idle), each
    named by a hash of the sketch fingerprint (:func:`sketch_fingerprint`: method, model weights, projection
    settings, pooling, dtype, ``max_tokens``) and the shard's ids and inputs (:func:`plan_shards`). Finished shard files already in
    ``out_dir`` are kept and not recomputed; every other Parquet or temporary file there is deleted first
    (another config's or input's shards, a half-written file). Each actor writes its shards atomically, so an
    interrupted run leaves only whole shards, and a re-run sketches the rest: in the end ``out_dir`` holds
    exactly one sketch per input row.

    The shards hold ``sketch`` as float32, or float16 when :func:`resolve_shard_dtype` says so (above
    ``sketch.stream_rows`` candidates by default); a float16 shard has another file name (the fingerprint
    records the dtype), so a float32 shard is never taken for one.

    Input columns: ``example_id``, ``input_ids``, ``labels``, ``n_tokens`` for ``method: sketch``,
    ``last_layer`` and ``hidden_mean``; ``example_id``, ``text``, ``n_tokens`` for ``method: embedding`` (others are ignored). The
    pool has ``cfg.num_actors`` actors, else one per GPU (``use_gpu``) or one per CPU of the Ray cluster, each
    with 1 GPU with ``use_gpu`` and up to 1 CPU (one CPU stays free for Ray Data's own tasks, see
    :func:`_actor_resources`). Output columns: ``example_id`` (string), ``sketch``
    (``fixed_size_list<float32>[dim]``; for ``last_layer`` the raw, unnormalised features, dim = hidden size),
    ``loss`` (float32, NaN for embeddings), ``n_tokens`` (int32); read them back with :func:`read_sketches`.
    On a multi-node cluster ``out_dir`` must be on storage every node writes to (the run directory already
    is, for Ray Train).

    Args:
        examples: a ``pyarrow.Table`` or a Ray Dataset (materialised on the driver, in block order).
        model_path: the model to sketch with; for ``embedding`` ``None`` = the packaged all-MiniLM-L6-v2.
        cfg: the ``sketch`` section.
        out_dir: the sketch folder (created; owned by this stage).
        use_gpu: one GPU per actor.
        trust_remote_code: passed to the model loader.
        pad_token_id: right-padding id of the sketch model's tokenizer.
        shard_rows: rows per shard (and per actor call).
        fail_on_shard: test hook, see :class:`ShardSketcher`.
        gpu_actors: with ``use_gpu`` and no ``sketch.num_actors``, the actors to ask for (the job's world size;
            see :func:`_actor_resources`).
        in_process_rows: without ``use_gpu``, when at most this many rows are left to sketch, the pending shards
            are sketched by one :class:`ShardSketcher` in this process (same shards, same files) instead of an
            actor pool, whose start-up (a fresh worker importing torch and loading the model: 5 s on an idle
            core, 30 s on a loaded one) costs more than a few rows. 0 = always the pool.
        n_candidates: the job's candidates, for ``sketch.shard_dtype: auto`` (:func:`resolve_shard_dtype`;
            default the rows of ``examples``; with a feature store only the missing rows are sketched here).

    Returns:
        ``{"shards", "reused", "computed", "rows_reused", "rows_computed", "examples", "seconds"}``: shard counts
        (finished ones found vs sketched now), the rows in each, all rows, and wall seconds of this call. An
        empty ``examples`` table only clears ``out_dir`` of other shards.

    Raises:
        ValueError: a required column is missing, an example id repeats, or ``shard_rows < 1``.
        RuntimeError: (from Ray) an actor failed; the shards finished before it stay on disk for a re-run.
    """
    import time

    t0 = time.perf_counter()
    table = _sketch_table(examples, cfg.method)
    if model_path is None and cfg.method == "embedding":
        model_path = embedding_model_dir()
    if model_path is None:
        raise ValueError(f"compute_sketches: method {cfg.method!r} needs a model_path")
    rows = shard_rows if shard_rows is not None else _default_shard_rows(table.num_rows, cfg, use_gpu, gpu_actors)
    cfg = cfg.model_copy(update={"shard_dtype": resolve_shard_dtype(cfg, n_candidates or table.num_rows)})
    shards = plan_shards(table, rows, sketch_fingerprint(cfg, model_path, use_gpu), _input_columns(cfg.method)[1:-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = _finished_shards(out, shards)
    pending = [s for s in shards if s.file not in done]
    n_pending = sum(s.stop - s.start for s in pending)
    if pending and not use_gpu and n_pending <= in_process_rows:
        _sketch_here(table, pending, cfg, model_path, out, trust_remote_code, pad_token_id, fail_on_shard)
    elif pending:
        _sketch_on_pool(table, pending, cfg, model_path, out, use_gpu, gpu_actors, {
            "trust_remote_code": trust_remote_code, "pad_token_id": pad_token_id, "fail_on_shard": fail_on_shard})
    lost = [s.file for s in shards if not (out / s.file).is_file()]
    if lost:
        raise RuntimeError(f"compute_sketches: {len(lost)} shard files missing after the run, e.g. {lost[:2]}")
    return {
        "shards": len(shards),
        "reused": len(done),
        "computed": len(pending),
        "rows_reused": sum(s.stop - s.start for s in shards if s.file in done),
        "rows_computed": sum(s.stop - s.start for s in pending),
        "examples": table.num_rows,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _sketch_table(examples, method: str):
    """The columns ``method`` reads (:func:`_input_columns`) of ``examples`` (a ``pyarrow.Table``, or a Ray
    Dataset materialised here in block order); ValueError for a missing column or a repeated example id."""
    import pyarrow as pa

    need = _input_columns(method)
    if not isinstance(examples, pa.Table):
        import ray

        examples = pa.concat_tables(ray.get(examples.select_columns(
            [c for c in need if c in examples.columns()]).to_arrow_refs()))
    missing = [c for c in need if c not in examples.column_names]
    if missing:
        raise ValueError(f"compute_sketches: examples lack columns {missing} (method {method!r})")
    table = examples.select(need)
    ids = table.column("example_id").to_pylist()
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:3] if len(ids) < 10_000 else "(several)"
        raise ValueError(f"compute_sketches: example ids must be unique; repeated: {dup}")
    return table


def _sketch_on_pool(table, pending, cfg: SketchConfig, model_path: str, out: Path, use_gpu: bool,
                    gpu_actors: int | None, actor_kwargs: dict) -> None:
    """The pending shards sketched by a pool of :class:`ShardSketcher` actors (Ray Data), each shard one block,
    one actor call and one file; RuntimeError when the actors report other shards than were pending.
    ``actor_kwargs``: ``trust_remote_code``, ``pad_token_id``, ``fail_on_shard``."""
    import pyarrow as pa
    import ray
    import ray.data

    n_actors, cpus_per_actor = _actor_resources(cfg, use_gpu, gpu_actors)
    blocks = []
    for s in pending:
        t = table.slice(s.start, s.stop - s.start)
        n = t.num_rows
        blocks.append(t.append_column("_shard", pa.array(np.full(n, s.index, dtype=np.int32)))
                      .append_column("_shard_file", pa.array([s.file] * n, type=pa.string()))
                      .append_column("_shard_rows", pa.array(np.full(n, n, dtype=np.int32))))
    # One block a shard, and batch_size=None hands an actor one whole block: a shard is sketched and
    # written by one actor call, and the pool's actors share the shards.
    summary = ray.data.from_arrow(blocks).map_batches(
        ShardSketcher,
        fn_constructor_kwargs={
            "method": cfg.method,
            "model_path": model_path,
            "sketch": cfg.model_dump(),
            "out_dir": str(out.resolve()),
            "trust_remote_code": actor_kwargs["trust_remote_code"],
            "pad_token_id": actor_kwargs["pad_token_id"],
            "fail_on_shard": actor_kwargs["fail_on_shard"],
        },
        batch_size=None,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=min(n_actors, len(pending))),
        num_gpus=1 if use_gpu else 0,
        num_cpus=cpus_per_actor,
    ).take_all()
    written = sorted(int(r["shard"]) for r in summary)
    if written != sorted(s.index for s in pending):
        raise RuntimeError(f"compute_sketches: actors reported shards {written[:5]}..., expected "
                           f"{[s.index for s in pending][:5]}...")


def sketch_with_store(table: pa.Table, model_path: str | None, cfg: SketchConfig, out_dir: str, *,
                      use_gpu: bool = False, trust_remote_code: bool = False, pad_token_id: int = 0,
                      gpu_actors: int | None = None, shard_rows: int | None = None) -> tuple[dict, dict]:
    """Every row's feature: from the feature store (``cfg.store``) where it holds the row for these settings and
    this model, else computed by :func:`compute_sketches` into ``out_dir`` (resumable shards; at most
    ``cfg.in_process_rows`` missing rows on the CPU are sketched in this process, not by an actor pool) and then
    added to the store. Without ``cfg.store``, :func:`compute_sketches` on all rows (in this process, too, when
    they are at most ``cfg.in_process_rows``).

    The store key (:func:`~ray_cluster_ft.features.feature_store.store_key`: settings, model content
    fingerprint, device kind) is computed in both cases: it is the summary's ``feature_key``, which the cluster
    map of the run records (``clustering.from_run`` checks it). A stored row is reused only when its
    ``example_id`` and its input hash (:func:`~ray_cluster_ft.features.feature_store.row_input_hashes`) match.

    Args:
        table: the sketch inputs (:func:`compute_sketches`' columns for ``cfg.method``), unique ids.
        model_path: the model to sketch with (``None``: the packaged MiniLM for ``embedding``).
        cfg: the ``sketch`` section; ``cfg.store`` a local path or a ``pyarrow.fs`` URI, or ``None``.
        out_dir: the run's sketch folder (only the rows not in the store are sketched there).
        use_gpu, trust_remote_code, pad_token_id, gpu_actors, shard_rows: as :func:`compute_sketches`.

    Returns:
        ``(sketches, summary)``: :func:`read_sketches`' dict for all rows (sorted by ``example_id``) and
        :func:`compute_sketches`' summary plus ``features_computed`` (rows sketched now), ``features_reused``
        (rows read from the store or from finished shards in ``out_dir``), ``feature_key``, ``feature_key_of``
        (settings, model fingerprint, gpu) and, with a store, ``store``, ``store_parts_read``,
        ``store_parts_written``.

    Raises:
        ValueError: as :func:`compute_sketches`; a required column is missing; an example id repeats.
        OSError: (from pyarrow) the store cannot be reached.
    """
    import pyarrow as pa

    from .feature_store import FeatureStore, row_input_hashes, store_key
    from .store import read_sketches

    if model_path is None and cfg.method == "embedding":
        model_path = embedding_model_dir()
    if model_path is None:
        raise ValueError(f"sketch_with_store: method {cfg.method!r} needs a model_path")
    key, desc = store_key(cfg, model_path, use_gpu)
    desc_summary = _store_key(cfg, model_path, use_gpu)[1]
    args = {"use_gpu": use_gpu, "trust_remote_code": trust_remote_code, "pad_token_id": pad_token_id,
            "shard_rows": shard_rows, "gpu_actors": gpu_actors, "in_process_rows": cfg.in_process_rows,
            "n_candidates": table.num_rows}
    if not cfg.store:
        summary = compute_sketches(table, model_path, cfg, out_dir, **args)
        summary.update(features_computed=summary["rows_computed"], features_reused=summary["rows_reused"],
                       feature_key=key, feature_key_of=desc_summary)
        return read_sketches(out_dir), summary
    need = _input_columns(cfg.method)
    missing_cols = [c for c in need if c not in table.column_names]
    if missing_cols:
        raise ValueError(f"sketch_with_store: the table lacks columns {missing_cols} (method {cfg.method!r})")
    table = table.select(need)
    ids = np.asarray(table.column("example_id").to_pylist(), dtype=str)
    if len(np.unique(ids)) != len(ids):
        raise ValueError("sketch_with_store: example ids must be unique")
    hashes = row_input_hashes(table, need[1:-1])
    store = FeatureStore.open(cfg.store, key, desc)
    found = store.read(ids, hashes)
    parts_read = found["parts_read"]
    todo = ~np.isin(ids, found["example_id"])
    summary = compute_sketches(table.filter(pa.array(todo)), model_path, cfg, out_dir, **args)
    parts = []
    if todo.any():
        new = read_sketches(out_dir)
        by_id = pd.Series(hashes, index=ids)
        parts = store.write(new, by_id.loc[new["example_id"]].to_numpy())
        if found["sketch"] is not None:
            new = {k: np.concatenate([found[k], new[k]]) for k in ("example_id", "sketch", "loss", "n_tokens")}
        found = new
    order = np.argsort(found["example_id"], kind="stable")
    sk = {k: found[k][order] for k in ("example_id", "sketch", "loss", "n_tokens")}
    summary.update(examples=len(ids), features_computed=summary["rows_computed"],
                   features_reused=int(len(ids) - summary["rows_computed"]), feature_key=key,
                   feature_key_of=desc_summary, store=cfg.store, store_parts_read=parts_read,
                   store_parts_written=len(parts))
    return sk, summary


def _store_key(cfg: SketchConfig, model_path: str, use_gpu: bool) -> tuple[str, dict]:
    """The feature key (:func:`~ray_cluster_ft.features.feature_store.store_key`) and the summary's
    ``feature_key_of`` (settings, model fingerprint digest, gpu)."""
    from .feature_store import store_key

    key, desc = store_key(cfg, model_path, use_gpu)
    return key, {"settings": desc["settings"], "model": _digest(desc["model"]), "gpu": desc["gpu"]}


def sketch_in_process(table, model_path: str, sk: SketchConfig, trust: bool, pad_token_id: int) -> dict:
    """The sketcher called in this process, no Ray and no files: over consecutive chunks of
    ``8 x sketch.batch_size`` rows, the shards of :func:`compute_sketches` (so the sub-batches and their padding
    are the same), each sorted by length inside (:func:`ray_cluster_ft.compute_features` without Ray).

    Args:
        table: the sketch inputs (:func:`compute_sketches`' columns for ``sk.method``).
        model_path: the model folder to sketch with.
        sk: the ``sketch`` section.
        trust: ``trust_remote_code`` for the model loader.
        pad_token_id: right-padding id of the sketch model's tokenizer.

    Returns:
        ``{"example_id": object (N,), "sketch": float32 (N, d)}`` in the table's row order.
    """

    fn = make_sketcher(sk.method, model_path, sk.model_dump(), trust, pad_token_id)
    step = _SUBBATCHES_PER_RAY_BATCH * sk.batch_size  # a shard of compute_sketches: the same sub-batches
    ids, out = [], []
    with _row_bar(table.num_rows) as bar:
        for lo in range(0, table.num_rows, step):
            part = table.slice(lo, step)
            # Ray Data's numpy batch format: ragged list columns as 1-D object arrays of arrays.
            res = fn({c: part.column(c).to_numpy(zero_copy_only=False) for c in part.column_names})
            ids.extend(res["example_id"].tolist())
            out.append(res["sketch"])
            bar.update(part.num_rows)
    return {"example_id": np.asarray(ids, dtype=object), "sketch": np.concatenate(out)}


def _digest(obj) -> str:
    """24 hex digits of the SHA-256 of ``obj`` as sorted JSON (a model fingerprint in one short string)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class FeaturesOutput:
    """What the feature stage hands on.

    Attributes:
        sketches: float32 ``(N, dim)``, row i the feature of candidate i (the order of the candidates table).
        summary: shard counts, seconds, the model sketched with and whether the rows were re-tokenised (the
            manifest's ``sketch`` entry).
    """

    sketches: np.ndarray | None
    summary: dict
    shards: FeatureShards | None = None


def run(cfg, run_dir: Path, *, candidates, tokenizer=None, inputs=None, sketch_model: str | None = None
        ) -> FeaturesOutput:
    """The feature stage: every candidate sketched by Ray Data actors into ``run_dir/sketches`` (resumable:
    finished shards of the same inputs, model and settings are kept, any other file there is removed), read back
    in candidate order. With ``sketch.store`` the rows the store holds for these settings and this model are read
    from it and only the others are sketched (and then added to the store): :func:`sketch_with_store`. The
    summary's ``features_computed`` and ``features_reused`` (the manifest's ``counts``) add up to the candidates.

    ``sketch.method: last_layer``: the shards hold the raw CluSTER features, and the normalisation of the
    published code, which depends on the world size, is applied here to all candidates at once
    (:func:`normalise_last_layer`): ``train.num_workers > 1`` L2-normalises each row, ``== 1`` subtracts the
    mean over all candidates. So the shards do not depend on the world size (the shard key leaves
    ``num_workers`` out). The summary's ``normalisation`` names what was applied.

    Args:
        cfg: the job config (``sketch``, ``model``, ``data``, ``train`` sections).
        run_dir: the run directory.
        candidates: the candidates, :data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`.
        tokenizer: the trained model's tokenizer (unused when ``inputs`` is given).
        inputs: :func:`prepare_sketch_inputs` of the candidates, when the caller made them already (the
            pipeline does, for the warm-up); default made here.
        sketch_model: the model folder to sketch with: the warmed-up model after ``sketch.warmup_steps``
            (:func:`ray_cluster_ft.pipeline.warmup.warm_up`); default ``inputs.model_path``.

    Returns:
        :class:`FeaturesOutput`.

    Raises:
        RuntimeError: the actors did not produce exactly one sketch per candidate.
    """
    from ..rundir import claim

    if inputs is None:
        inputs = prepare_sketch_inputs(candidates, cfg, tokenizer)  # proxy model / re-tokenised / text
    model = sketch_model if sketch_model is not None else inputs.model_path
    sketch_dir = claim(run_dir, "sketches")
    if stream_features(cfg.sketch, candidates.num_rows) and streaming_unsupported(cfg) is None:
        summary = compute_sketches(
            inputs.table, model, cfg.sketch, str(sketch_dir), use_gpu=cfg.train.use_gpu,
            trust_remote_code=cfg.model.trust_remote_code, pad_token_id=inputs.pad_token_id,
            gpu_actors=cfg.train.num_workers, in_process_rows=cfg.sketch.in_process_rows)
        key, desc = _store_key(cfg.sketch, model, cfg.train.use_gpu)
        shards = run_shards(sketch_dir, candidates)
        summary.update(features_computed=summary["rows_computed"], features_reused=summary["rows_reused"],
                       feature_key=key, feature_key_of=desc, model=model, retokenized=inputs.retokenized,
                       streamed=True, shard_dtype=shards.dtype)
        return FeaturesOutput(None, summary, shards)
    sk, summary = sketch_with_store(
        inputs.table, model, cfg.sketch, str(sketch_dir), use_gpu=cfg.train.use_gpu,
        trust_remote_code=cfg.model.trust_remote_code, pad_token_id=inputs.pad_token_id,
        gpu_actors=cfg.train.num_workers)
    summary.update(model=model, retokenized=inputs.retokenized)
    ids = np.asarray(candidates.column("example_id").to_pylist())
    sketches, normalisation = finish_features(sk, ids, cfg.sketch.method, cfg.train.num_workers)
    if normalisation is not None:
        summary["normalisation"] = normalisation
    return FeaturesOutput(sketches, summary)


def finish_features(sk: dict, example_ids, method: str, world_size: int) -> tuple[np.ndarray, str | None]:
    """The feature stage's post-processing of the sketches read back, shared with
    :func:`ray_cluster_ft.compute_features` so both give the same features: rows put in the order of
    ``example_ids``, then for ``last_layer`` the published world-size normalisation (:func:`normalise_last_layer`).

    Args:
        sk: :func:`~ray_cluster_ft.features.read_sketches`' dict (``example_id`` (N,), ``sketch`` (N, d)), any
            row order.
        example_ids: str ``(N,)`` the order wanted.
        method: ``sketch.method``.
        world_size: ``train.num_workers`` (used by ``last_layer`` only).

    Returns:
        ``(features, normalisation)``: float32 ``(N, d)``, row i the feature of ``example_ids[i]``; ``"l2_rows"``,
        ``"mean_centred"`` or ``None`` (nothing applied).

    Raises:
        RuntimeError: not exactly one sketch per example id.
    """
    ids = np.asarray(example_ids)
    if len(sk["example_id"]) != len(ids) or len(set(sk["example_id"])) != len(ids):
        raise RuntimeError(f"sketch stage produced {len(sk['example_id'])} sketches for {len(ids)} examples")
    order = pd.Series(np.arange(len(ids)), index=ids).loc[sk["example_id"]].to_numpy()
    sketches = np.empty((len(ids), sk["sketch"].shape[1]), dtype=np.float32)
    sketches[order] = sk["sketch"]
    if method != "last_layer":
        return sketches, None
    return normalise_last_layer(sketches, world_size), "l2_rows" if world_size > 1 else "mean_centred"
