"""Canonical rows -> tokenized examples, de-duplicated, with the held-out split.

Every input row ends in exactly one of two places: an accepted example (``examples.parquet`` or the held-out
``eval_examples.parquet``) or ``rejected.jsonl`` with its source, position and reason. Blank lines of a JSONL
file are not rows and are not counted. The loss is taken on response tokens only: ``labels`` is -100 on every
prompt (and template) token.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from ..config import ConfigError, DataConfig
from .formats import canonical_row, check_text, columns_hint, missing_sources
from .read import Rejection, example_id, hash_order, iter_rows
from .tasks import task_fields
from .tokenize import tokenize_guarded, tokenize_rows

__all__ = [
    "EXAMPLE_SCHEMA",
    "Canonical",
    "DataResult",
    "canonical_record",
    "split_held_out",
    "tokenize_rows",
    "load_examples",
    "refuse_missing_sources",
]


EXAMPLE_SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("n_tokens", pa.int32()),
        ("source_file", pa.string()),
        ("source_line", pa.int64()),
    ]
)
"""``source_file`` is the file the row was read from (the demo source's name for the built-in data) and
``source_line`` its position there: the 1-based line of a JSON Lines file, the 0-based index of a JSON array,
a Parquet file or a demo source."""


@dataclass
class DataResult:
    """Output of :func:`load_examples`.

    Attributes:
        train: accepted rows for selection, :data:`EXAMPLE_SCHEMA`.
        eval: accepted rows held out for evaluation, same schema.
        rejected: one :class:`Rejection` per rejected row.
        n_read: rows read (= len(train) + len(eval) + len(rejected)).
        truncated: accepted rows that were cut to ``max_seq_len`` (policy ``truncate``).
        sources: rows read per file.
        formats: per file, rows per detected format (rows rejected before a format was told apart not counted).
        unused: per file, per unused text field, the rows where it was left out (:func:`.formats.unused_text_fields`).
        hints: per file and field, the ``data.columns`` line that would use it.
    """

    train: pa.Table
    eval: pa.Table
    rejected: list[Rejection]
    n_read: int
    truncated: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    formats: dict[str, dict[str, int]] = field(default_factory=dict)
    unused: dict[str, dict[str, int]] = field(default_factory=dict)
    hints: dict[str, dict[str, str]] = field(default_factory=dict)


def _held_out(ids: list[str], domains: list[str], fraction: float, cap: int, seed: int) -> np.ndarray:
    """Boolean mask of held-out rows: per domain a seeded share ``fraction``, at most ``cap`` in all."""
    mask = np.zeros(len(ids), dtype=bool)
    if fraction <= 0 or cap <= 0 or not ids:
        return mask
    dom = np.asarray(domains)
    uniq = sorted(set(domains))
    total = min(cap, int(round(fraction * len(ids))))
    for d in uniq:
        idx = np.flatnonzero(dom == d)
        n = min(len(idx) - 1, int(round(total * len(idx) / len(ids))))
        if n <= 0:
            continue
        order = hash_order([ids[i] for i in idx], seed)
        mask[idx[order[:n]]] = True
    return mask


class _Accepted:
    """The accepted rows as columns, the ids seen (duplicates are rejected naming the first) and the tallies."""

    def __init__(self, cfg: DataConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.cols: dict[str, list] = {k: [] for k in EXAMPLE_SCHEMA.names}
        self.seen: dict[str, tuple[str, int]] = {}
        self.rejected: list[Rejection] = []
        self.truncated = 0
        self.pending: list[tuple[str, int, Any, list, str, str]] = []

    def flush(self) -> None:
        if not self.pending:
            return
        cfg = self.cfg
        toks = tokenize_guarded([p[3] for p in self.pending], self.tokenizer, cfg.max_seq_len, cfg.overlong,
                                train_on=cfg.train_on, system_prompt=cfg.default_system_prompt)
        for (src, pos, row, msgs, source, domain), tok in zip(self.pending, toks):
            if isinstance(tok, str):
                self.rejected.append(Rejection(src, pos, tok, row))
                continue
            ids, labels, cut = tok
            eid = example_id(msgs)
            if eid in self.seen:
                first = self.seen[eid]
                self.rejected.append(Rejection(src, pos, f"duplicate example: same content as {first[0]}:{first[1]}",
                                               row))
                continue
            self.seen[eid] = (src, pos)
            self.truncated += int(cut)
            for k, v in (("example_id", eid), ("source", source), ("domain", domain), ("input_ids", ids),
                         ("labels", labels), ("n_tokens", len(ids)), ("source_file", src), ("source_line", pos)):
                self.cols[k].append(v)
        self.pending.clear()


def _row_domain(row: dict) -> str:
    """The row's domain, folded (" all ", "all" and "\u200ball" are one name in the report: format characters go,
    whitespace folds).

    Raises:
        ValueError: the rejection reason (not a string, a lone surrogate, or the reserved name ``all``).
    """
    domain = row.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise ValueError(f"field 'domain' is {type(domain).__name__}, expected a string")
    check_text(domain or "", "field 'domain'")  # else Arrow fails on the whole table, not on this row
    domain = " ".join("".join(c for c in (domain or "") if unicodedata.category(c) != "Cf").split()) or "default"
    if domain == "all":  # the name of the every-domain aggregate in the evaluation
        raise ValueError("reserved domain: 'all' names the aggregate over every domain in the evaluation; rename "
                         "the row's domain")
    return domain


class Canonical(NamedTuple):
    """One readable row in canonical form (:func:`canonical_record`)."""

    fmt: str
    messages: list
    unused: list[str]
    hints: list[str]
    source: str
    domain: str


def canonical_record(src: str, pos: int, row: Any, cfg: DataConfig, eval_file: bool = False) -> Canonical | Rejection:
    """One row as read (``row`` may be a read-time :class:`Rejection`) -> its format, chat messages, unused text
    fields with the ``data.columns`` hint of each, ``source`` (the row's own, else the file's stem) and folded
    domain; or its :class:`Rejection`. The one per-row step of both :func:`load_examples` and the Ray Data path
    (:mod:`.ray_data`). In an evaluation file (``eval_file``) the fields the row's evaluation task reads
    (:func:`.tasks.task_fields`: MBPP's ``tests``, HumanEval's ``test``, ...) are scored, so not unused."""
    if isinstance(row, Rejection):
        return row
    try:
        fmt, msgs, left = canonical_row(row, cfg.format, cfg.columns)
        if eval_file and left:
            scored = task_fields(row)
            left = [name for name in left if name not in scored]
        domain = _row_domain(row)
        source = row.get("source") if isinstance(row.get("source"), str) and row.get("source") else Path(src).stem
        check_text(source, "field 'source'")  # else Arrow fails on the whole table, not on this row
    except ValueError as err:
        return Rejection(src, pos, str(err), row)
    hints = [columns_hint(fmt, name, row.get(name), cfg.columns) for name in left]
    return Canonical(fmt, msgs, list(left), hints, source, domain)


def refuse_missing_sources(src: str, columns: dict, fields, n_rows: int, canonical: bool) -> None:
    """Raise when a ``data.columns`` source field is in none of the ``n_rows`` rows read from ``src``
    (``fields``: their field names, in order of first appearance): a misspelt name would otherwise leave its
    target empty in every row, unnoticed or as "field 'prompt' is null". A file with none of the sources whose
    rows were read in a format of their own (``canonical``: some row was) is left alone: the mapping is for the
    other files (an evaluation file of chats beside mapped training files).

    Raises:
        ConfigError: naming the file, each target and missing source, and the fields the rows have.
    """
    missing = missing_sources(columns, fields) if fields else []
    if not missing or canonical and len(missing) == len(missing_sources(columns, ())):
        return
    maps = " and ".join(f"{t} from {s!r}" for t, s in missing)
    raise ConfigError(f"data file {src}: data.columns maps {maps}, but none of the {n_rows} rows read has "
                      f"{'that field' if len(missing) == 1 else 'those fields'} (their fields: {', '.join(fields)}); "
                      f"see docs/data.md for data.columns")


def split_held_out(table: pa.Table, cfg: DataConfig) -> tuple[pa.Table, pa.Table]:
    """The accepted rows (:data:`EXAMPLE_SCHEMA`, in input order) split into candidates and held-out rows: per
    domain a seeded share ``cfg.eval_fraction``, at most ``cfg.max_eval`` in all (a row's place depends on its
    example id, not its position)."""
    held = _held_out(table.column("example_id").to_pylist(), table.column("domain").to_pylist(), cfg.eval_fraction,
                     cfg.max_eval, cfg.seed)
    return table.filter(pa.array(~held)), table.filter(pa.array(held))


def load_examples(cfg: DataConfig, tokenizer, tokenize_chunk: int = 2048, eval_file: bool = False) -> DataResult:
    """Read every source of ``cfg``, canonicalise (:mod:`.formats`), tokenize (:mod:`.tokenize`),
    de-duplicate and split off the held-out rows.

    Args:
        cfg: the data section of the job config.
        tokenizer: the model's tokenizer (chat template applied).
        tokenize_chunk: rows tokenized per call (memory bound).
        eval_file: the sources are ``evaluation.paths`` files: a row's task fields are not unused
            (:func:`canonical_record`).

    Returns:
        A :class:`DataResult`; ``n_read == len(train) + len(eval) + len(rejected)`` always holds.

    Raises:
        FileNotFoundError: a data file is missing (checked before any row is read).
        ConfigError: a data file has an unsupported type or is not readable as a whole (see
            :func:`iter_file_rows`); ``data.default_system_prompt`` does not fit the template; a ``data.columns``
            source field is in no row of a file (:func:`refuse_missing_sources`). Bad rows never raise: they are
            rejected.
    """
    acc = _Accepted(cfg, tokenizer)
    n_read = 0
    sources: dict[str, int] = {}
    formats: dict[str, dict[str, int]] = {}
    unused: dict[str, dict[str, int]] = {}
    hints: dict[str, dict[str, str]] = {}
    fields: dict[str, dict[str, None]] = {}  # per file, the rows' field names (an ordered set), for data.columns
    for src, pos, row in iter_rows(cfg):
        n_read += 1
        sources[src] = sources.get(src, 0) + 1
        if cfg.columns and isinstance(row, dict):
            fields.setdefault(src, {}).update(dict.fromkeys(row))
        rec = canonical_record(src, pos, row, cfg, eval_file)
        if isinstance(rec, Rejection):
            acc.rejected.append(rec)
            continue
        per = formats.setdefault(src, {})
        per[rec.fmt] = per.get(rec.fmt, 0) + 1
        for name, hint in zip(rec.unused, rec.hints):
            unused.setdefault(src, {})[name] = unused.get(src, {}).get(name, 0) + 1
            hints.setdefault(src, {}).setdefault(name, hint)
        acc.pending.append((src, pos, row, rec.messages, rec.source, rec.domain))
        if len(acc.pending) >= tokenize_chunk:
            acc.flush()
    acc.flush()
    for src, n in sources.items() if cfg.columns else ():
        refuse_missing_sources(src, cfg.columns, fields.get(src, {}), n, src in formats)
    # Duplicates are found when their tokenizer chunk finishes: put every rejection back in input order.
    order = {src: i for i, src in enumerate(sources)}
    acc.rejected.sort(key=lambda r: (order.get(r.source, len(order)), r.position))

    train, held = split_held_out(pa.table(acc.cols, schema=EXAMPLE_SCHEMA), cfg)
    return DataResult(
        train=train,
        eval=held,
        rejected=acc.rejected,
        n_read=n_read,
        truncated=acc.truncated,
        sources=sources,
        formats=formats,
        unused=unused,
        hints=hints,
    )
