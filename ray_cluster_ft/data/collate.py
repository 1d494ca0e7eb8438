"""The collate functions: token rows -> a padded batch (ids, attention mask, labels), for training, sketching
and evaluation alike (:func:`collate`); or -> one packed sequence (ids, position ids, labels, no padding) for a
packed micro-batch (:func:`pack`, ``allocation.packing``)."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np

__all__ = ["IGNORE_INDEX", "collate", "as_token_rows", "logits_positions", "pack"]

IGNORE_INDEX = -100
"""Label of tokens without loss (prompt and padding), the Hugging Face convention."""


def logits_positions(labels) -> np.ndarray:
    """The sequence positions whose logits a loss reads: ``t`` such that ``labels[b, t + 1]`` is a label for some
    row ``b``. A packed micro-batch (one row) gets exactly its label positions; a padded batch the union over its
    rows (the other rows' entries there are ``-100`` and cost nothing but their share of the LM head). Passed to
    a transformers causal LM as ``logits_to_keep``, it keeps prompt tokens and padding out of the LM head.

    Args:
        labels: int ``(B, T)`` array or host tensor, ``-100`` where no loss is taken.

    Returns:
        int64 ``(K,)``, ascending, each in ``[0, T - 1)``.
    """
    lab = np.asarray(labels)
    return np.flatnonzero((lab[:, 1:] != IGNORE_INDEX).any(axis=0)).astype(np.int64)


def as_token_rows(column: Any, name: str = "input_ids") -> list[np.ndarray]:
    """A ragged column (object array of arrays, or a list) or a 2-D array as a list of 1-D int64 arrays.

    Raises:
        ValueError: a row is not a 1-D sequence, or the column is neither ragged nor 2-D.
    """
    arr = column if isinstance(column, np.ndarray) else np.asarray(column, dtype=object)
    if arr.dtype != object and arr.ndim == 2:
        return [np.asarray(r, dtype=np.int64) for r in arr]
    if arr.ndim != 1:
        raise ValueError(f"column {name!r}: expected a ragged column or a 2-D array, got shape {arr.shape}")
    rows = [np.asarray(r, dtype=np.int64) for r in arr]
    if any(r.ndim != 1 for r in rows):
        raise ValueError(f"column {name!r}: every row must be a 1-D sequence of token ids")
    return rows


def _sequences(who: str, input_ids, labels) -> tuple[list[np.ndarray], np.ndarray]:
    """``input_ids`` as int64 arrays and their lengths, after the checks both layouts share: B >= 1, as many
    label sequences as id sequences, none empty (a packing collator would drop an empty one silently)."""
    if len(input_ids) == 0 or (labels is not None and len(input_ids) != len(labels)):
        n_lab = None if labels is None else len(labels)
        raise ValueError(f"{who}: need B >= 1 equal-count sequences, got {len(input_ids)} and {n_lab}")
    ids = [np.asarray(x, dtype=np.int64).ravel() for x in input_ids]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    if lengths.min() < 1:
        raise ValueError(f"{who}: an empty sequence")
    return ids, lengths


def collate(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    side: Literal["right", "left"] = "right",
) -> dict[str, np.ndarray]:
    """Pad B token sequences to the longest one.

    Args:
        input_ids: B integer sequences (lengths L_i >= 1).
        labels: B sequences of the same lengths (``-100`` where no loss is taken), or ``None``.
        pad_token_id: id written into padded ``input_ids`` positions (masked out, so any valid id works).
        side: ``right`` (training, sketching, scoring) or ``left`` (batched generation).

    Returns:
        ``input_ids`` and ``attention_mask`` (and ``labels`` when given), each int64 of shape (B, max L_i);
        padded positions hold ``pad_token_id``, 0 (and ``-100``).

    Raises:
        ValueError: an empty batch or sequence, mismatched counts or lengths, or an unknown ``side``.
    """
    if side not in ("right", "left"):
        raise ValueError(f"collate: side must be 'right' or 'left', got {side!r}")
    ids, lengths = _sequences("collate", input_ids, labels)
    width = int(lengths.max())
    cols = np.arange(width)[None, :]
    mask = cols < lengths[:, None] if side == "right" else cols >= (width - lengths)[:, None]
    out_ids = np.full(mask.shape, pad_token_id, dtype=np.int64)
    out_ids[mask] = np.concatenate(ids)
    out = {"input_ids": out_ids, "attention_mask": mask.astype(np.int64)}
    if labels is not None:
        lab = [np.asarray(x, dtype=np.int64).ravel() for x in labels]
        if not np.array_equal(lengths, [len(x) for x in lab]):
            raise ValueError("collate: input_ids and labels lengths differ")
        out_lab = np.full(mask.shape, IGNORE_INDEX, dtype=np.int64)
        out_lab[mask] = np.concatenate(lab)
        out["labels"] = out_lab
    return out


def pack(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]] | None = None,
    flash_attn_kwargs: bool = False,
) -> dict[str, Any]:
    """Concatenate B whole examples into one sequence of ``N = sum_i L_i`` tokens, with transformers'
    ``DataCollatorWithFlattening`` (padding-free training).

    The result goes to the model as ``input_ids``, ``position_ids`` and no ``attention_mask``: transformers 5
    then keeps attention inside each example. Read in the installed transformers 5.24 source:
    ``masking_utils._preprocess_mask_arguments`` calls ``find_packed_sequence_indices(position_ids)`` when
    ``attention_mask`` is None and there is no cache (``use_cache=False``); that function starts a new sequence
    wherever ``position_ids`` does not grow by exactly 1, and ``create_causal_mask`` then ANDs the causal mask
    with ``packed_sequence_mask_function`` (same sequence index) and re-maps positions per sequence, so sdpa and
    eager get a block-diagonal causal mask. ``flash_attention_2`` takes the varlen path from
    ``cu_seq_lens_q/k`` + ``max_length_q/k`` (``modeling_flash_attention_utils._flash_attention_forward``,
    "padding free ... cu_seqlen and max_length are provided"), or infers them from ``position_ids`` (a device
    sync per layer) when they are absent. The tests compare packed against per-example forwards and backwards
    rather than trusting this reading.

    Labels: the collator writes ``-100`` over the first label of every example, so the last token of one
    example never predicts the first of the next (a causal LM never trains on the first label anyway, see
    :func:`ray_cluster_ft.train.rank_data.label_token_counts`); the other labels are the rows' own, ``-100``
    included.

    Args:
        input_ids: B integer sequences (lengths L_i >= 1).
        labels: B sequences of the same lengths, or ``None`` (train on every token but each example's first).
        flash_attn_kwargs: also return ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 ``(B + 1,)``, the cumulative
            lengths from 0) and ``max_length_q``/``max_length_k`` (int, ``max L_i``) for flash-attention varlen.

    Returns:
        ``input_ids``, ``position_ids`` (0..L_i-1 per example), ``labels``: int64 ``(1, N)``; ``lengths``:
        int64 ``(B,)``; plus the flash-attention keys when asked. No ``attention_mask``.

    Raises:
        ValueError: an empty batch or sequence, mismatched counts or lengths.
    """
    from transformers import DataCollatorWithFlattening

    ids, lengths = _sequences("pack", input_ids, labels)
    features = [{"input_ids": x} for x in ids]
    if labels is not None:
        lab = [np.asarray(x, dtype=np.int64).ravel() for x in labels]
        if not np.array_equal(lengths, [len(x) for x in lab]):
            raise ValueError("pack: input_ids and labels lengths differ")
        for f, y in zip(features, lab):
            f["labels"] = y
    out = DataCollatorWithFlattening(return_tensors="np", return_flash_attn_kwargs=flash_attn_kwargs,
                                     separator_id=IGNORE_INDEX)(features)
    out["lengths"] = lengths
    return out
