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
    "Shard",
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
    :func:`model_files_fingerprint`) and the device kind."""
    import json

    blob = json.dumps({"v": 1, "cfg": feature_settings(cfg), "model": model_files_fingerprint(model_path),
                       "gpu": bool(use_gpu)}, sort_keys=True, default=str)
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
