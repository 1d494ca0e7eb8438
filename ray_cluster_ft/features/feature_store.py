"""The cross-run feature store (``sketch.store``): per-example features kept on any pyarrow filesystem (a local
path, ``s3://``, ``gs://``), content-addressed, so a later job reads the rows it already paid for and computes
only the new ones (docs/design.md, "Features").

Layout::

    <store>/v1/<key>/_key.json                  what the key stands for (settings, model fingerprint), for people
    <store>/v1/<key>/part-<content hash>.parquet  example_id, input_hash, sketch, loss, n_tokens

``key`` (:func:`store_key`) hashes everything a feature's value depends on besides its example: the feature
settings (:func:`~ray_cluster_ft.features.store.feature_settings`: method, modules, last_blocks, k_in, k_out,
dim, seed, dtype for the LoGra sketch; method and dtype for ``last_layer`` and ``embedding``, plus pooling for
``hidden_mean``; ``max_tokens`` where set), the model's *content* fingerprint (:func:`model_fingerprint`: SHA-256 of
its config and weight files, or the hub revision; never its path or mtimes) and the device kind. A store
written with other settings or another model lives under another key and is never read for this job. Within a
key a row is found by its ``example_id`` (the content hash of the example's messages) and reused only when its
``input_hash`` (:func:`row_input_hashes`: the token ids and labels, or the text, the feature was computed
from) matches too, so a changed tokenizer, chat template or ``data.max_seq_len`` recomputes the rows it changed.

Writes are atomic: a part file is written whole under a hidden temporary name and renamed into place on a
local filesystem; on an object store one upload is atomic by itself (the object appears complete or not at
all). Part files are named by the content hash of the rows they hold, and never rewritten with other rows, so
two jobs writing the same store at once lose nothing and corrupt nothing: both parts land, and a row present in
both is read once (the first part that holds it, in name order; both hold the same feature up to float
rounding). Reading filters by id part by part (ids and hashes first, the feature columns only from parts that
hold a wanted row), so a job reads what it needs, not the whole store.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import SketchConfig
from .store import feature_settings

__all__ = [
    "FeatureStore",
    "check_store",
    "feature_settings",
    "model_fingerprint",
    "open_store",
    "row_input_hashes",
    "store_key",
]

_LAYOUT = "v1"
_PART_ROWS = 100_000  # rows per part file at most: one part of a 10^6-row job is ~100 MiB at dim 256
# What a model folder's features depend on: weights, configs (model, adapter, pooling), tokenizer files.
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".json", ".txt", ".model", ".jinja")
_HASH_MEMO: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes, memoised per process by (real path, inode, size, mtime_ns): one
    read of the weights per process (about 1 s per GB on one core)."""
    st = path.stat()
    memo = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if memo not in _HASH_MEMO:
        with open(path, "rb") as f:
            _HASH_MEMO[memo] = hashlib.file_digest(f, "sha256").hexdigest()
    return _HASH_MEMO[memo]


def model_fingerprint(model_path: str) -> dict:
    """What identifies a model's weights by content, independent of where they lie.

    A local folder: ``{"files": [[relative path, sha256], ...]}`` of its weights (``.safetensors``, ``.bin``,
    ``.pt``, ``.pth``, ``.ckpt``, ``.gguf``), configs and tokenizer files (``.json``, ``.txt``, ``.model``,
    ``.jinja``; subfolders included, hidden files and READMEs not), sorted. A copy of the folder elsewhere has
    the same fingerprint; one changed byte in one weight file changes it. (The tokenizer is hashed too although
    :func:`row_input_hashes` covers the token ids: the embedding baseline tokenizes inside its encoder.) A hub id: ``{"hub_id": id, "revision": commit}``, the commit of
    its snapshot in the local Hugging Face cache (``"unresolved"`` when not cached yet: the key then changes
    once it is, a conservative miss). No network access.

    Raises:
        FileNotFoundError: a local folder without ``config.json``.
    """
    p = Path(model_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model_fingerprint: {p} has no config.json (not a model folder)")
        names = sorted(f.relative_to(p).as_posix() for f in p.rglob("*")
                       if f.is_file() and f.suffix in _MODEL_SUFFIXES and not f.name.startswith(".")
                       and not f.name.upper().startswith("README")
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        return {"files": [[n, _file_sha256(p / n)] for n in names]}
    revision = "unresolved"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
        if isinstance(cached, str):
            revision = Path(cached).parent.name  # .../snapshots/<commit>/config.json
    except Exception:  # noqa: BLE001, S110 - a malformed id or an unreadable cache: the id alone keys it
        pass
    return {"hub_id": model_path, "revision": revision}


def store_key(cfg: SketchConfig, model_path: str, use_gpu: bool) -> tuple[str, dict]:
    """The store key of a job's features and what it stands for.

    Args:
        cfg: the ``sketch`` section.
        model_path: the resolved model the features are computed with (after any warm-up).
        use_gpu: features computed on GPUs (bf16 autocast with ``dtype: auto``) or on the CPU.

    Returns:
        ``(key, description)``: ``key`` a 32-hex-digit SHA-256 prefix of ``description``, which is
        ``{"layout", "settings": feature_settings(cfg), "model": model_fingerprint(model_path), "gpu"}``.

    Raises:
        FileNotFoundError: as :func:`model_fingerprint`.
    """
    desc = {"layout": _LAYOUT, "settings": feature_settings(cfg), "model": model_fingerprint(model_path),
            "gpu": bool(use_gpu)}
    blob = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32], desc


def row_input_hashes(table, content_columns: Sequence[str]) -> np.ndarray:
    """Per-row hash of what a feature is computed from.

    Args:
        table: ``pyarrow.Table`` with the ``content_columns``: integer lists (``input_ids``, ``labels``) or
            strings (``text``).
        content_columns: the columns hashed, in this order.

    Returns:
        str ``(N,)``: 32 hex digits each (BLAKE2b-128 of every column's row bytes and lengths). A Python loop over
        rows: about 18 us a row of 2 x 150 tokens on a shared core (3.5 s for 200,000 rows, so ~18 s at 10^6),
        small beside featurising a row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    cols = []  # per column: (bytes, byte offsets of each row (N + 1,), tag)
    for name in content_columns:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = np.ascontiguousarray(pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64))
            cols.append((memoryview(flat.tobytes()), (8 * np.concatenate([[0], np.cumsum(lens)])).tolist(), b"\xff"))
        else:
            enc = [(v if v is not None else "").encode() for v in col.to_pylist()]
            cols.append((memoryview(b"".join(enc)), np.concatenate([[0], np.cumsum([len(e) for e in enc])]).tolist(),
                         b"\xfe"))
    out = np.empty(n, dtype=object)
    for i in range(n):
        h = hashlib.blake2b(digest_size=16)
        for data, off, tag in cols:
            lo, hi = off[i], off[i + 1]
            h.update(data[lo:hi])
            h.update(tag + (hi - lo).to_bytes(8, "little"))
        out[i] = h.hexdigest()
    return out.astype(str)


def open_store(uri: str):
    """``(pyarrow FileSystem, root path)`` of a store: a URI with a scheme (``s3://``, ``gs://``, ``file://``,
    ``hdfs://``) through ``pyarrow.fs.FileSystem.from_uri``, anything else a local path (made absolute)."""
    from pyarrow import fs as pafs

    if "://" in uri:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        return filesystem, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def check_store(uri: str) -> None:
    """Fail before any work when ``sketch.store`` cannot be a store: an unknown URI scheme, or a local path that
    is a file or cannot be created. A remote store is only parsed here (reaching it needs credentials the
    workers may hold and this process may not).

    Raises:
        ConfigError: naming ``sketch.store`` and the reason.
    """
    from pyarrow import fs as pafs

    from ..config import ConfigError

    try:
        filesystem, root = open_store(uri)
        if isinstance(filesystem, pafs.LocalFileSystem):
            filesystem.create_dir(root, recursive=True)
            if filesystem.get_file_info(root).type != pafs.FileType.Directory:
                raise OSError(f"{root} is not a folder")
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"sketch.store {uri!r} cannot be used as a feature store: {err}") from None


@dataclass
class FeatureStore:
    """One key of a store: read the rows it holds, add rows (atomically).

    Build with :meth:`open`. Attributes: ``uri`` (as given), ``key``, ``fs`` (pyarrow FileSystem), ``dir``
    (``<root>/v1/<key>`` on ``fs``).
    """

    uri: str
    key: str
    fs: object
    dir: str

    @classmethod
    def open(cls, uri: str, key: str, description: dict | None = None) -> FeatureStore:
        """The store at ``uri`` for ``key`` (folders created; ``_key.json`` written once from ``description``).

        Raises:
            OSError: (from pyarrow) the store cannot be reached or written.
        """
        from pyarrow import fs as pafs

        filesystem, root = open_store(uri)
        d = f"{root}/{_LAYOUT}/{key}"
        filesystem.create_dir(d, recursive=True)
        store = cls(uri, key, filesystem, d)
        if description is not None and filesystem.get_file_info(f"{d}/_key.json").type == pafs.FileType.NotFound:
            store._put(f"{d}/_key.json", json.dumps(description, indent=1, sort_keys=True).encode())
        return store

    def parts(self) -> list[str]:
        """Paths of the finished part files under this key, sorted (hidden temporary files are not parts)."""
        from pyarrow import fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File
                      and i.base_name.startswith("part-") and i.base_name.endswith(".parquet"))

    def _put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically: temporary name + rename locally, one upload elsewhere."""
        import uuid

        from pyarrow import fs as pafs

        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp"
            try:
                with self.fs.open_output_stream(tmp) as f:
                    f.write(data)
                os.replace(tmp, path)  # POSIX rename: atomic, replaces an equal file another job wrote first
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            with self.fs.open_output_stream(path) as f:
                f.write(data)

    def read(self, example_ids: np.ndarray, input_hashes: np.ndarray) -> dict:
        """The stored rows of ``example_ids`` whose ``input_hash`` matches.

        Args:
            example_ids: str ``(N,)`` the rows wanted (unique).
            input_hashes: str ``(N,)`` :func:`row_input_hashes` of those rows.

        Returns:
            ``{"example_id" str (M,), "sketch" float32 (M, d), "loss" float32 (M,), "n_tokens" int32 (M,),
            "parts_read": int}`` for the M <= N rows found, each once, in no particular order. A part that
            cannot be read (not a Parquet file of this layout) is skipped with a warning: its rows are computed
            again.
        """
        import warnings

        import pandas as pd
        import pyarrow.parquet as pq

        ids = np.asarray(example_ids).astype(str)
        want = pd.Index(ids)
        hashes = np.asarray(input_hashes).astype(str)
        have = np.zeros(len(ids), dtype=bool)
        got_idx, sketches, losses, ntoks = [], [], [], []
        parts_read = 0
        for path in self.parts():
            if have.all():
                break
            try:
                with self.fs.open_input_file(path) as f:
                    pf = pq.ParquetFile(f)
                    head = pf.read(columns=["example_id", "input_hash"])
                    pos = want.get_indexer(head.column("example_id").to_numpy(zero_copy_only=False).astype(str))
                    ok = pos >= 0
                    ok[ok] = (hashes[pos[ok]] == head.column("input_hash").to_numpy(zero_copy_only=False)
                              .astype(str)[ok]) & ~have[pos[ok]]
                    if not ok.any():
                        continue
                    # A part may hold one id twice (never written so, but cheap to guard): keep its first row.
                    rows = np.flatnonzero(ok)
                    _, first = np.unique(pos[rows], return_index=True)
                    rows = rows[first]
                    body = pf.read(columns=["sketch", "loss", "n_tokens"]).take(rows)
                sk = _fixed_list_to_numpy(body.column("sketch"))
            except Exception as err:  # noqa: BLE001 - a foreign or damaged file is skipped, its rows recomputed
                warnings.warn(f"feature store: skipped unreadable part {path}: {err}", stacklevel=2)
                continue
            parts_read += 1
            have[pos[rows]] = True
            got_idx.append(pos[rows])
            sketches.append(sk)
            losses.append(body.column("loss").to_numpy().astype(np.float32))
            ntoks.append(body.column("n_tokens").to_numpy().astype(np.int32))
        if not got_idx:
            return {"example_id": np.asarray([], dtype=str), "sketch": None, "loss": np.zeros(0, np.float32),
                    "n_tokens": np.zeros(0, np.int32), "parts_read": 0}
        dims = {s.shape[1] for s in sketches}
        if len(dims) != 1:
            raise ValueError(f"feature store {self.uri} key {self.key}: parts hold features of sizes {sorted(dims)}")
        idx = np.concatenate(got_idx)
        return {"example_id": ids[idx], "sketch": np.concatenate(sketches), "loss": np.concatenate(losses),
                "n_tokens": np.concatenate(ntoks), "parts_read": parts_read}

    def write(self, rows: dict, input_hashes: np.ndarray) -> list[str]:
        """Add rows to the store, in part files of at most 100,000 rows, each named by the SHA-256 of the key and
        its rows' ids and input hashes (sorted by id), each written atomically. A part that already exists (the
        same rows written by another job) is left as it is.

        Args:
            rows: ``{"example_id" str (M,), "sketch" float (M, d), "loss" float (M,), "n_tokens" int (M,)}``.
            input_hashes: str ``(M,)`` the rows' :func:`row_input_hashes`.

        Returns:
            The part paths written now.

        Raises:
            ValueError: lengths differ, or an id repeats.
        """
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyarrow import fs as pafs

        ids = np.asarray(rows["example_id"]).astype(str)
        hashes = np.asarray(input_hashes).astype(str)
        sk = np.ascontiguousarray(rows["sketch"], dtype=np.float32) if len(ids) else None
        if len(hashes) != len(ids) or (sk is not None and sk.shape[0] != len(ids)):
            raise ValueError(f"FeatureStore.write: {len(ids)} ids, {len(hashes)} hashes, "
                             f"{None if sk is None else sk.shape[0]} features")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("FeatureStore.write: an example id repeats")
        order = np.argsort(ids, kind="stable")
        written = []
        for lo in range(0, len(ids), _PART_ROWS):
            sel = order[lo:lo + _PART_ROWS]
            h = hashlib.sha256(self.key.encode())
            for a in (ids[sel], hashes[sel]):
                h.update("\n".join(a.tolist()).encode() + b"\x00")
            path = f"{self.dir}/part-{h.hexdigest()[:40]}.parquet"
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                continue
            s = sk[sel]
            table = pa.table({
                "example_id": pa.array(ids[sel], type=pa.string()),
                "input_hash": pa.array(hashes[sel], type=pa.string()),
                "sketch": pa.FixedSizeListArray.from_arrays(pa.array(s.reshape(-1)), s.shape[1]),
                "loss": pa.array(np.asarray(rows["loss"], dtype=np.float32)[sel]),
                "n_tokens": pa.array(np.asarray(rows["n_tokens"], dtype=np.int32)[sel]),
            })
            buf = io.BytesIO()
            pq.write_table(table, buf)
            self._put(path, buf.getvalue())
            written.append(path)
        return written


def _fixed_list_to_numpy(col) -> np.ndarray:
    """A ``fixed_size_list<float>[d]`` column as float32 ``(N, d)``."""
    col = col.combine_chunks()
    d = col.type.list_size
    return col.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), d)
