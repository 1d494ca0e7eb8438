"""Data stage: sources -> canonical rows -> tokenized examples (+ rejected rows with reasons), and the one
collate function every other stage pads with.

Public: :func:`load_examples` (the whole read), :func:`collate`, the readers and :func:`run` (the stage:
writes ``examples.parquet``, ``eval_examples.parquet`` and ``rejected.jsonl``).
"""

from .collate import IGNORE_INDEX, as_token_rows, collate
from .examples import EXAMPLE_SCHEMA, DataResult, load_examples, tokenize_rows
from .read import (
    MEDICAL_SUBJECTS,
    Rejection,
    canonicalize,
    example_id,
    iter_demo_rows,
    iter_file_rows,
    iter_rows,
    load_messages,
    reason_category,
)
from .stage import DataOutput, run

__all__ = [
    "IGNORE_INDEX",
    "EXAMPLE_SCHEMA",
    "MEDICAL_SUBJECTS",
    "DataOutput",
    "DataResult",
    "Rejection",
    "as_token_rows",
    "canonicalize",
    "collate",
    "example_id",
    "iter_demo_rows",
    "iter_file_rows",
    "iter_rows",
    "load_examples",
    "load_messages",
    "reason_category",
    "run",
    "tokenize_rows",
]
