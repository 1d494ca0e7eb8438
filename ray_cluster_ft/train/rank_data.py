"""The plan joined with the tokenized examples: one table per rank, rows in plan order, checked on the driver
before any worker starts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..allocate import plan_hash  # noqa: F401 - re-exported: the hash a checkpoint records
from ..data.collate import IGNORE_INDEX

__all__ = [
    "PLAN_COLUMNS",
    "TRAINED_COLUMNS",
    "build_rank_tables",
]


PLAN_COLUMNS = ("epoch", "step", "rank", "micro_index", "example_id")


TRAINED_COLUMNS = ("rank", "step", "micro_index", "epoch", "example_id")


_KEY = ["epoch", "step", "micro_index"]


def _require_columns(plan: pd.DataFrame, columns: Sequence[str]) -> None:
    if not isinstance(plan, pd.DataFrame):
        raise ValueError(f"plan must be a pandas DataFrame, got {type(plan).__name__}")
    missing = [c for c in columns if c not in plan.columns]
    if missing:
        raise ValueError(f"plan is missing columns {missing} (has {list(plan.columns)})")


def _examples_table(examples: pa.Table | pd.DataFrame) -> pa.Table:
    cols = ["example_id", "input_ids", "labels"]
    if isinstance(examples, pd.DataFrame):
        missing = [c for c in cols if c not in examples.columns]
        if missing:
            raise ValueError(f"examples are missing columns {missing}")
        examples = pa.Table.from_pandas(examples[cols], preserve_index=False)
    if not isinstance(examples, pa.Table):
        raise ValueError(f"examples must be a pyarrow Table or pandas DataFrame, got {type(examples).__name__}")
    missing = [c for c in cols if c not in examples.column_names]
    if missing:
        raise ValueError(f"examples are missing columns {missing}")
    t = examples.select(cols).combine_chunks()
    return t.set_column(0, "example_id", pc.cast(t.column("example_id"), pa.string()))


def _check_token_columns(t: pa.Table) -> None:
    """input_ids/labels: no nulls, equal non-zero lengths, at least one trainable (shifted) label each."""
    ids, labels = t.column("input_ids"), t.column("labels")
    if ids.null_count or labels.null_count:
        raise ValueError("examples have null input_ids or labels")
    n_ids = pc.list_value_length(ids).to_numpy()
    n_lab = pc.list_value_length(labels).to_numpy()
    eid = t.column("example_id").to_numpy(zero_copy_only=False)
    bad = np.flatnonzero((n_ids != n_lab) | (n_ids < 2))
    if bad.size:
        raise ValueError(
            f"{bad.size} planned examples have len(input_ids) != len(labels) or fewer than 2 tokens, "
            f"e.g. {eid[bad[:5]].tolist()}"
        )
    # Causal LMs shift labels by one, so the first token's label never counts: an example needs a
    # non-ignored label at position >= 1, else a micro-batch of such examples has a 0/0 (NaN) loss.
    values = pc.list_flatten(labels).to_numpy() != IGNORE_INDEX
    starts = np.cumsum(n_lab) - n_lab
    values[starts] = False
    owner = np.repeat(np.arange(len(n_lab)), n_lab)
    trainable = np.bincount(owner, weights=values, minlength=len(n_lab))
    bad = np.flatnonzero(trainable == 0)
    if bad.size:
        raise ValueError(
            f"{bad.size} planned examples have no label token to train on (all -100), e.g. {eid[bad[:5]].tolist()}"
        )


def build_rank_tables(plan: pd.DataFrame, examples: pa.Table | pd.DataFrame, world_size: int) -> list[pa.Table]:
    """Join the plan with the tokenized examples: one table per rank, rows in plan order.

    Args:
        plan: the allocation plan (columns ``epoch, step, rank, micro_index, example_id``), rows of one
            micro-batch in their planned position order.
        examples: ``example_id`` (str), ``input_ids`` and ``labels`` (list<int>) per example.
        world_size: ranks.

    Returns:
        ``world_size`` tables with columns ``example_id`` (string), ``epoch, step, micro_index`` (int64),
        ``input_ids, labels`` (list<int>), sorted by ``(epoch, step, micro_index)`` with a stable sort, so the
        in-micro-batch position order of the plan is kept.

    Raises:
        ValueError: plan ids absent from ``examples``, duplicate example ids, bad token columns (see
            :func:`_check_token_columns`).
    """
    _require_columns(plan, PLAN_COLUMNS)
    ex = _examples_table(examples)
    index = pd.Index(ex.column("example_id").to_numpy(zero_copy_only=False))
    if index.has_duplicates:
        dup = index[index.duplicated()].unique()[:5].tolist()
        raise ValueError(f"examples hold duplicate example_id values, e.g. {dup}")
    plan_ids = plan["example_id"].astype(str).to_numpy()
    pos = index.get_indexer(plan_ids)
    if (pos < 0).any():
        missing = pd.unique(plan_ids[pos < 0])
        raise ValueError(f"{missing.size} planned example ids are not in examples, e.g. {missing[:5].tolist()}")
    used = np.unique(pos)
    _check_token_columns(ex.take(pa.array(used)))

    order = plan.assign(_pos=pos).sort_values(["rank", *_KEY], kind="stable")
    tables = []
    for r in range(world_size):
        part = order[order["rank"] == r]
        rows = ex.take(pa.array(part["_pos"].to_numpy()))
        tables.append(
            pa.table(
                {
                    "example_id": pa.array(part["example_id"].astype(str).to_numpy(), pa.string()),
                    "epoch": pa.array(part["epoch"].to_numpy(np.int64)),
                    "step": pa.array(part["step"].to_numpy(np.int64)),
                    "micro_index": pa.array(part["micro_index"].to_numpy(np.int64)),
                    "input_ids": rows.column("input_ids"),
                    "labels": rows.column("labels"),
                }
            )
        )
    return tables
