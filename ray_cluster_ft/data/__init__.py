"""Data stage: sources -> canonical rows -> tokenized examples (+ rejected rows with reasons), and the one
collate function every other stage pads with.

Public: :func:`load_examples` (the whole read), :func:`collate`, the readers and :func:`run` (the stage:
writes ``examples.parquet``, ``eval_examples.parquet`` and ``rejected.jsonl``).
"""

from .collate import IGNORE_INDEX, collate
from .examples import DataResult, EXAMPLE_SCHEMA, load_examples
from .read import canonicalize, example_id
from .stage import DataOutput, check, run
from .tokenize import marked_text

__all__ = [
    "DataOutput",
    "DataResult",
    "EXAMPLE_SCHEMA",
    "IGNORE_INDEX",
    "canonicalize",
    "check",
    "collate",
    "example_id",
    "load_examples",
    "marked_text",
    "run",
]
