"""Random token rows and their padded batches, shared by the feature tests."""

import numpy as np
import pyarrow as pa
import torch

from ray_cluster_ft.data import IGNORE_INDEX

VOCAB = 49_152


def examples(lengths, prompt_lens, seed=0):
    """Random int64 token rows; the first ``prompt_len`` tokens of each carry no label."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for n, p in zip(lengths, prompt_lens):
        ids = rng.integers(0, VOCAB, size=n, dtype=np.int64)
        lab = ids.copy()
        lab[:p] = IGNORE_INDEX
        rows.append(ids)
        labels.append(lab)
    return rows, labels


def pad(rows, labels, side):
    """(ids, mask, labels) int64 ``(B, T)`` tensors, padded on ``side`` with an arbitrary non-zero pad id."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), 7, dtype=torch.long)
    lab = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        sl = slice(0, len(r)) if side == "right" else slice(t - len(r), t)
        ids[i, sl], lab[i, sl], mask[i, sl] = torch.from_numpy(r), torch.from_numpy(l), 1
    return ids, mask, lab


def example_table(n):
    """``n`` rows of 5-17 random tokens (1-3 of them prompt) as a candidates table: ``example_id`` (``ex00``...),
    ``input_ids``, ``labels``, ``n_tokens``."""
    rows, labels = examples([5 + (7 * i) % 13 for i in range(n)], [1 + i % 3 for i in range(n)], seed=3)
    return pa.Table.from_pylist([{"example_id": f"ex{i:02d}", "input_ids": r.tolist(), "labels": lab.tolist(),
                                  "n_tokens": len(r)} for i, (r, lab) in enumerate(zip(rows, labels))])
