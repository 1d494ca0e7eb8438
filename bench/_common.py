"""Helpers the benchmark scripts share (and the tests borrow): where the shared real data lives, and real rows
of it tokenized as the pipeline does. Nothing here imports ``tests/``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """``../shared/data`` beside the checkout (or ``$RAY_CLUSTER_FT_SHARED_DATA``), if present."""
    env = os.environ.get("RAY_CLUSTER_FT_SHARED_DATA")
    p = Path(env) if env else REPO.parent / "shared" / "data"
    return p if p.is_dir() else None


def real_examples(n: int, max_seq_len: int, tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first ``n`` accepted examples of mbpp and medquad together (``n // 2`` from each file where
    possible), tokenized with the tokenizer's chat template, overlong rows truncated: ``(input_ids, labels)``
    int64 arrays."""
    from ray_cluster_ft.config import DataConfig
    from ray_cluster_ft.data import load_examples

    d = shared_data_dir()
    out = []
    for name in ("mbpp.jsonl", "medquad.jsonl"):
        cfg = DataConfig(source="files", paths=[str(d / name)], limit=n, max_seq_len=max_seq_len,
                         overlong="truncate", eval_fraction=0.0)
        t = load_examples(cfg, tokenizer).train
        rows = list(zip(t.column("input_ids").to_pylist(), t.column("labels").to_pylist()))[: n // 2]
        out += [(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)) for a, b in rows]
    return out
