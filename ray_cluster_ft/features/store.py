"""Sketch shards on disk: fixed slices of the input, each written atomically to a Parquet file named by a hash
of the sketch settings, the model and the shard's inputs, so a re-run keeps finished shards and sketches only
the rest; and the reader that brings them back to the driver.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import SketchConfig

__all__ = [
    "FeatureShards",
    "Shard",
    "feature_shards",
    "read_shard",
    "resolve_shard_dtype",
    "run_shards",
    "streaming_unsupported",
    "stream_features",
    "feature_settings",
    "model_files_fingerprint",
    "sketch_fingerprint",
    "plan_shards",
    "read_sketches",
]


@dataclass(frozen=True)
class Shard:
    """A fixed slice of the input rows and the file its sketches go to.

    Attributes:
        index: position of the shard (rows ``start:stop`` of the input, in input order).
        start, stop: row range.
        file: ``shard-<index:05d>-<key>.parquet``; ``key`` hashes the sketch fingerprint and the shard's
            example ids and inputs, so a file of another config, model or input never passes for this shard.
    """

    index: int
    start: int
    stop: int
    file: str


def model_files_fingerprint(model_path: str) -> dict:
    """What identifies the weights: for a local folder the names, sizes and mtimes of its files (a warm-up
    model retrained in place gets new mtimes), else the hub id itself."""
    p = Path(model_path).expanduser()
    if not p.is_dir():
        return {"id": model_path}
    files = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in p.iterdir()
        if f.is_file() and (f.suffix in (".safetensors", ".bin", ".json", ".pt") or f.name == "config.json")
    )
    return {"path": str(p.resolve()), "files": files}


_PROJECTION = ("modules", "last_blocks", "k_in", "k_out", "dim", "seed")
"""The settings of the LoGra sketch's projections, which no other method reads."""


def feature_settings(cfg: SketchConfig) -> dict:
    """The ``sketch`` settings a feature's value depends on, in the section's field order: ``method`` and
    ``dtype`` for every method; ``modules``, ``last_blocks``, ``k_in``, ``k_out``, ``dim``, ``seed`` for
    ``sketch``; ``pooling`` for ``hidden_mean``; ``max_tokens`` for every method when it is set. Batch sizes and
    actor counts are left out (a feature does not depend on its batch mates, up to float rounding), and so is a
    ``dim`` the method does not use (a changed ``dim`` recomputes no last-layer feature).

    The LoGra sketch is recorded as ``"method": "gradient"``, its name before ``sketch``, and a ``max_tokens`` of
    null not at all: the settings of a job that reads whole rows are what they were before issue 31, so feature
    stores, shards and cluster maps (``clustering.from_run``) written before it stay valid. Both the per-run shard
    key (:func:`sketch_fingerprint`) and the store key
    (:func:`~ray_cluster_ft.features.feature_store.store_key`) hash this dict."""
    used = {"method", "dtype", "max_tokens"} | (set(_PROJECTION) if cfg.method == "sketch" else set()) \
        | ({"pooling"} if cfg.method == "hidden_mean" else set())
    out = {k: v for k, v in cfg.model_dump().items() if k in used and not (k == "max_tokens" and v is None)}
    if out["method"] == "sketch":
        out["method"] = "gradient"
    return out


def sketch_fingerprint(cfg: SketchConfig, model_path: str, use_gpu: bool) -> str:
    """Hex digest of everything a sketch's values depend on besides its example: the settings of
    :func:`feature_settings` (method, projection settings, pooling, dtype, ``max_tokens``), the model weights (see
    :func:`model_files_fingerprint`), the device kind and a ``sketch.shard_dtype`` of ``float16`` (resolved: give
    ``cfg`` with :func:`resolve_shard_dtype`'s value; ``auto`` counts as float32)."""
    import json

    key = {"v": 1, "cfg": feature_settings(cfg), "model": model_files_fingerprint(model_path), "gpu": bool(use_gpu)}
    if cfg.shard_dtype == "float16":  # only then: float32 shards keep the names they had before issue 30
        key["shard_dtype"] = "float16"
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def plan_shards(table, shard_rows: int, fingerprint: str, content_columns: Sequence[str]) -> list[Shard]:
    """Cut ``table`` into consecutive shards of ``shard_rows`` rows (the last may be shorter), each keyed by
    ``fingerprint`` and a SHA-256 of its ``example_id`` values and ``content_columns`` (token ids or text).

    Args:
        table: ``pyarrow.Table`` with ``example_id`` and the content columns, in input order.
        shard_rows: rows per shard (>= 1).
        fingerprint: from :func:`sketch_fingerprint`.
        content_columns: the columns the sketch is computed from.

    Returns:
        ``[Shard, ...]`` covering every row once, in order.

    Raises:
        ValueError: ``shard_rows < 1``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if shard_rows < 1:
        raise ValueError(f"plan_shards: shard_rows must be >= 1, got {shard_rows}")
    n = table.num_rows
    # Flatten every column once; a shard's bytes are then a slice between two row offsets.
    parts = []
    for name in ("example_id", *content_columns):
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            bounds = np.concatenate([[0], np.cumsum(lens)])
            parts.append((flat, bounds, lambda v: v.tobytes()))
        else:
            vals = col.to_pylist()
            enc = np.asarray([(v if v is not None else "").encode() for v in vals], dtype=object)
            parts.append((enc, np.arange(n + 1), lambda v: b"\x00".join(v.tolist()) + b"\x01"))
    shards = []
    for i, start in enumerate(range(0, n, shard_rows)):
        stop = min(n, start + shard_rows)
        h = hashlib.sha256(f"{fingerprint}|{i}|{start}|{stop}".encode())
        for flat, bounds, to_bytes in parts:
            h.update(to_bytes(flat[bounds[start]:bounds[stop]]))
            h.update(np.asarray(np.diff(bounds[start:stop + 1]), dtype=np.int64).tobytes())
        shards.append(Shard(i, start, stop, f"shard-{i:05d}-{h.hexdigest()[:20]}.parquet"))
    return shards


def read_sketches(out_dir: str) -> dict[str, np.ndarray]:
    """Read the sketches written by :func:`compute_sketches` with pyarrow (no Ray needed).

    Args:
        out_dir: folder of Parquet files (subfolders included), or one file.

    Returns:
        ``example_id`` str ``(N,)``, ``sketch`` float32 ``(N, dim)``, ``loss`` float32 ``(N,)``, ``n_tokens``
        int32 ``(N,)``, all sorted by ``example_id``.

    Raises:
        FileNotFoundError: ``out_dir`` does not exist.
        ValueError: no rows, missing columns, sketches of different lengths, or a duplicated example id.
    """
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(out_dir):
        raise FileNotFoundError(f"read_sketches: {out_dir} does not exist")
    table = pq.read_table(out_dir)
    need = ["example_id", "sketch", "loss", "n_tokens"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"read_sketches: {out_dir} lacks columns {missing}")
    if table.num_rows == 0:
        raise ValueError(f"read_sketches: {out_dir} holds no rows")
    col = table.column("sketch").combine_chunks()
    if isinstance(col.type, pa.ExtensionType):
        col = col.storage
    if pa.types.is_fixed_size_list(col.type):
        sketch = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    else:
        rows = col.to_pylist()
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"read_sketches: sketches in {out_dir} have different lengths")
        sketch = np.asarray(rows)
    ids = np.asarray(table.column("example_id").to_pylist(), dtype=str)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
        dup = ids[1:][ids[1:] == ids[:-1]][:3].tolist()
        raise ValueError(f"read_sketches: example ids appear more than once in {out_dir}, e.g. {dup}")
    return {
        "example_id": ids,
        "sketch": np.ascontiguousarray(sketch[order], dtype=np.float32),
        "loss": table.column("loss").to_numpy().astype(np.float32)[order],
        "n_tokens": table.column("n_tokens").to_numpy().astype(np.int32)[order],
    }


def stream_features(cfg: SketchConfig, n_candidates: int) -> bool:
    """Whether a job of ``n_candidates`` keeps its features in their shards (``sketch.stream_rows``): more
    candidates than ``stream_rows`` (never when it is null)."""
    return cfg.stream_rows is not None and int(n_candidates) > int(cfg.stream_rows)


def resolve_shard_dtype(cfg: SketchConfig, n_candidates: int) -> str:
    """``sketch.shard_dtype`` as written to the shards: ``float16`` or ``float32`` as set; ``auto`` is float16 when
    the job streams (:func:`stream_features`) and has no feature store (whose rows another, smaller job may read
    back: they stay float32), else float32, so a small job's features are exactly what they were."""
    if cfg.shard_dtype != "auto":
        return cfg.shard_dtype
    return "float16" if stream_features(cfg, n_candidates) and not cfg.store else "float32"


@dataclass(frozen=True)
class FeatureShards:
    """Feature shards on disk, in candidate order: file i holds the candidates ``offsets[i]:offsets[i + 1]``.

    Attributes:
        files: absolute paths of the Parquet shards (``example_id``, ``sketch``, ``loss``, ``n_tokens``).
        offsets: int64 ``(len(files) + 1,)`` row offsets, from 0 to the number of rows.
        dim: the feature size.
        dtype: the shards' stored float type, ``float16`` or ``float32`` (read back as float32).
    """

    files: tuple
    offsets: np.ndarray
    dim: int
    dtype: str

    @property
    def n_rows(self) -> int:
        """All rows of all shards."""
        return int(self.offsets[-1])


def feature_shards(paths: Sequence[str]) -> FeatureShards:
    """The :class:`FeatureShards` of the Parquet files ``paths``, in the order given (the candidates' order), from
    their footers alone (no feature is read).

    Raises:
        ValueError: no files; a file without a ``sketch`` column of fixed-size float lists; sizes or float types
            that differ between files.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not paths:
        raise ValueError("feature_shards: no shard files")
    counts, kinds = [], set()
    for p in paths:
        f = pq.ParquetFile(p)
        field = f.schema_arrow.field("sketch") if "sketch" in f.schema_arrow.names else None
        if field is None or not pa.types.is_fixed_size_list(field.type) \
                or not pa.types.is_floating(field.type.value_type):
            raise ValueError(f"feature_shards: {p} has no sketch column of fixed-size float lists")
        kinds.add((field.type.list_size, "float16" if pa.types.is_float16(field.type.value_type) else "float32"))
        counts.append(f.metadata.num_rows)
    if len(kinds) != 1:
        raise ValueError(f"feature_shards: the shards differ in feature size or float type: {sorted(kinds)}")
    (dim, dtype), = kinds
    return FeatureShards(tuple(str(Path(p).resolve()) for p in paths),
                         np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), int(dim), dtype)


def read_shard(path: str, with_ids: bool = False) -> dict[str, np.ndarray]:
    """One shard's rows, in file order: ``sketch`` float32 ``(n, dim)`` (float16 shards upcast), ``n_tokens``
    int64 ``(n,)`` and with ``with_ids`` ``example_id`` (a ``pyarrow.StringArray``)."""
    import pyarrow.parquet as pq

    cols = ["sketch", "n_tokens"] + (["example_id"] if with_ids else [])
    t = pq.read_table(path, columns=cols)
    col = t.column("sketch").combine_chunks()
    x = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    out = {"sketch": np.ascontiguousarray(x, dtype=np.float32),
           "n_tokens": t.column("n_tokens").to_numpy().astype(np.int64)}
    if with_ids:
        out["example_id"] = t.column("example_id").combine_chunks()
    return out


def streaming_unsupported(cfg) -> str | None:
    """Why a job above ``sketch.stream_rows`` still gathers its features on the driver, or None when it streams:
    a feature store (its rows are read back whole), ``sketch.method: last_layer`` (its normalisation spans all
    rows), or a clustering or selection setting the streaming stages do not offer (``clustering.from_run``,
    ``clustering.algorithm: kmeans``, ``clustering.max_cluster_ratio``)."""
    c = cfg.clustering
    for why, bad in (("sketch.store", cfg.sketch.store), ("sketch.method: last_layer", cfg.sketch.method == "last_layer"),
                     ("clustering.from_run", c.from_run), ("clustering.algorithm: kmeans", c.algorithm == "kmeans"),
                     ("clustering.max_cluster_ratio", c.max_cluster_ratio is not None)):
        if bad:
            return why
    return None


def run_shards(sketch_dir: Path, candidates) -> FeatureShards:
    """The run's shards (``shard-<index>-<key>.parquet``, every other file removed by :func:`compute_sketches`) in
    shard order, checked shard by shard to hold the candidates in their order (ids only are read)."""
    import pyarrow.parquet as pq

    fs = feature_shards(sorted(str(p) for p in sketch_dir.glob("shard-*.parquet")))
    ids = candidates.column("example_id")
    if fs.n_rows != len(ids):
        raise RuntimeError(f"sketch stage produced {fs.n_rows} sketches for {len(ids)} examples")
    for f, lo, hi in zip(fs.files, fs.offsets[:-1], fs.offsets[1:]):
        got = pq.read_table(f, columns=["example_id"]).column("example_id")
        if not got.equals(ids.slice(int(lo), int(hi - lo))):
            raise RuntimeError(f"sketch stage: {f} does not hold candidates {lo}..{hi - 1} in candidate order")
    return fs
