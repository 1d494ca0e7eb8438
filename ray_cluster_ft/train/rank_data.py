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
    "label_token_counts",
    "PLAN_COLUMNS",
    "TRAINED_COLUMNS",
    "build_rank_tables",
]


PLAN_COLUMNS = ("epoch", "step", "rank", "micro_index", "example_id")


TRAINED_COLUMNS = ("rank", "step", "micro_index", "epoch", "example_id")


MICRO_BATCH_KEY = ["epoch", "step", "micro_index"]
"""A rank's training order: the plan's sort order below the rank, one micro-batch per distinct key."""


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


def label_token_counts(labels: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """int64 ``(N,)``: the label tokens each example is trained on, ``labels[t] != -100`` for ``t >= 1`` (a
    causal LM predicts token t from the positions before it, so the first label never counts)."""
    labels = labels.combine_chunks() if isinstance(labels, pa.ChunkedArray) else labels
    n_lab = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(labels).to_numpy(zero_copy_only=False) != IGNORE_INDEX
    starts = np.cumsum(n_lab) - n_lab
    values[starts[n_lab > 0]] = False
    return np.bincount(np.repeat(np.arange(len(n_lab)), n_lab), weights=values, minlength=len(n_lab)).astype(np.int64)


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
    bad = np.flatnonzero(label_token_counts(labels) == 0)
    if bad.size:
        raise ValueError(
            f"{bad.size} planned examples have no label token to train on (all -100), e.g. {eid[bad[:5]].tolist()}"
        )


def _check_pack_sizes(plan: pd.DataFrame, n_tokens: np.ndarray, max_tokens: int) -> None:
    """Every micro-batch (pack) of ``plan`` holds at most ``max_tokens`` tokens; ``n_tokens`` is each plan row's
    ``len(input_ids)``. Raises ValueError naming the largest offending pack (an example longer than the maximum
    shows as a pack of that one example)."""
    sizes = pd.Series(n_tokens).groupby([plan[c].to_numpy() for c in ("rank", "epoch", "step", "micro_index")]).sum()
    over = sizes[sizes > max_tokens]
    if len(over):
        (r, e, s, m), size = over.idxmax(), int(over.max())
        raise ValueError(
            f"{len(over)} packs hold more than train.max_tokens_per_micro_batch={max_tokens} tokens, e.g. (rank {r}, "
            f"epoch {e}, step {s}, micro_index {m}) with {size}; a pack never cuts an example, so an example longer "
            f"than the maximum is a config or data error (raise the maximum, or lower data.max_seq_len)")


def build_rank_tables(plan: pd.DataFrame, examples: pa.Table | pd.DataFrame, world_size: int,
                      weights: pd.Series | None = None, max_tokens_per_pack: int | None = None) -> list[pa.Table]:
    """Join the plan with the tokenized examples: one table per rank, rows in plan order, with what the
    token-exact loss needs.

    A step's loss is ``sum_i w_i sum_t l_it / sum_i w_i |T_i|`` over every label token of that optimizer step,
    on all ranks and micro-batches (docs/design.md, "Train"). Its denominator is known from the plan, so it is
    precomputed here (``step_weighted_tokens``) and no collective is needed to normalise.

    Args:
        plan: the allocation plan (columns ``epoch, step, rank, micro_index, example_id``), rows of one
            micro-batch in their planned position order.
        examples: ``example_id`` (str), ``input_ids`` and ``labels`` (list<int>) per example.
        world_size: ranks.
        weights: per-example loss weight indexed by ``example_id`` (the selection weights); ``None`` = 1.
        max_tokens_per_pack: for a packed plan (``allocation.packing``), the most tokens (``len(input_ids)``
            summed over its rows) a micro-batch may hold (``train.max_tokens_per_micro_batch``); ``None`` checks
            nothing.

    Returns:
        ``world_size`` tables with columns ``example_id`` (string), ``epoch, step, micro_index`` (int64),
        ``input_ids, labels`` (list<int>), ``weight`` (float64), ``step_weighted_tokens`` (float64, the
        step's ``sum_i w_i |T_i|`` over all ranks) and ``step_micro_batches`` (int64, the micro-batches of the
        row's step on its rank: ``grad_accum``, fewer only in a short last step), sorted by ``(epoch, step, micro_index)`` with a stable sort,
        so the in-micro-batch position order of the plan is kept.

    Raises:
        ValueError: plan ids absent from ``examples`` or ``weights``, duplicate example ids, bad token columns
            (see :func:`_check_token_columns`), a weight that is not finite and positive, a pack over
            ``max_tokens_per_pack`` tokens.
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

    w = np.ones(len(plan_ids)) if weights is None else weights.reindex(plan_ids).to_numpy(np.float64)
    if not np.all(np.isfinite(w) & (w > 0)):
        raise ValueError("every planned example needs a finite, positive loss weight (missing ids or bad values)")
    if max_tokens_per_pack is not None:
        _check_pack_sizes(plan, pc.list_value_length(ex.column("input_ids")).to_numpy()[pos], max_tokens_per_pack)
    n_lab = label_token_counts(ex.column("labels"))[pos]
    step_tokens = pd.Series(w * n_lab).groupby(plan["step"].to_numpy()).transform("sum").to_numpy()
    # Micro-batches of the row's step on its rank: G, or fewer in an epoch's last step of the published plan.
    step_mbs = plan.groupby(["rank", "step"])["micro_index"].transform("nunique").to_numpy(np.int64)
    order = plan.assign(_pos=pos, _w=w, _d=step_tokens, _g=step_mbs).sort_values(["rank", *MICRO_BATCH_KEY],
                                                                                  kind="stable")
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
                    "weight": pa.array(part["_w"].to_numpy(np.float64)),
                    "step_weighted_tokens": pa.array(part["_d"].to_numpy(np.float64)),
                    "step_micro_batches": pa.array(part["_g"].to_numpy(np.int64)),
                }
            )
        )
    return tables
