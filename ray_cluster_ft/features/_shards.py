"""The shard files' own bookkeeping, shared by the store's reader and the stage's writers: the Arrow layout of a
sketch shard, the hidden columns that route rows to their shard, atomic writes and the check of finished
shards."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .store import Shard


def _to_arrow(batch: dict[str, np.ndarray], dtype: str = "float32"):
    """Numpy sketch batch -> Arrow table whose ``sketch`` is a plain ``fixed_size_list<float32>[dim]``, or
    ``fixed_size_list<halffloat>[dim]`` for ``dtype="float16"`` (readable by any Parquet reader, no Ray extension
    type; the list's value type records the dtype).

    Raises:
        ValueError: ``dtype="float16"`` and a row does not fit float16 (an entry above 65,504, or so small that the
            row's norm moves by more than 1%: unnormalised gradient sketches can be either); the message names
            ``sketch.shard_dtype: float32``.
    """
    import pyarrow as pa

    with np.errstate(over="ignore", invalid="ignore"):  # a row float16 cannot hold is refused below, by name
        sk = np.ascontiguousarray(batch["sketch"], dtype=np.float16 if dtype == "float16" else np.float32)
        if dtype == "float16":
            before = np.linalg.norm(np.asarray(batch["sketch"], dtype=np.float32), axis=1)
            after = np.linalg.norm(sk.astype(np.float32), axis=1)
            # NaN or inf rows pass: the cluster stage refuses them with their position
            bad = np.isfinite(before) & ~(np.abs(after - before) <= 0.01 * before)
    if dtype == "float16" and bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{int(bad.sum())} feature rows do not fit float16 (row {str(batch['example_id'][j])!r}: "
                         f"norm {before[j]:.3g}, largest entry {np.abs(batch['sketch'][j]).max():.3g}); set "
                         "sketch.shard_dtype: float32")
    return pa.table(
        {
            "example_id": pa.array(np.asarray(batch["example_id"]).astype(str), type=pa.string()),
            "sketch": pa.FixedSizeListArray.from_arrays(pa.array(sk.reshape(-1)), sk.shape[1]),
            "loss": pa.array(np.asarray(batch["loss"], dtype=np.float32)),
            "n_tokens": pa.array(np.asarray(batch["n_tokens"], dtype=np.int32)),
        }
    )


_SHARD_COLS = ("_shard", "_shard_file", "_shard_rows")
"""The hidden columns that route each row to its shard through the actor pool."""


def _finished_shards(out_dir: Path, shards: Sequence["Shard"]) -> set[str]:
    """Files of ``shards`` already complete in ``out_dir``; every other Parquet or temporary file there (a
    shard of another config or input, a half-written file, output of an older layout) is deleted."""
    import pyarrow.parquet as pq

    want = {s.file: s.stop - s.start for s in shards}
    done = set()
    for f in out_dir.iterdir():
        if f.is_file() and f.name in want:
            try:
                ok = pq.read_metadata(f).num_rows == want[f.name]
            except Exception:  # noqa: BLE001 - an unreadable file is redone, whatever pyarrow raises
                ok = False
            if ok:
                done.add(f.name)
                continue
        if f.is_file() and (f.suffix == ".parquet" or f.name.endswith(".tmp")):
            f.unlink()
    return done


def _write_atomic(table, path: Path) -> None:
    """Write Parquet to a hidden temporary name and rename it into place: a reader (or a resumed run) sees
    the whole file or none of it. Hidden names (a leading dot) are skipped by pyarrow's dataset reader."""
    import os
    import uuid

    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
