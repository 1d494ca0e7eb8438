"""The data stage on Ray Data, for pools of ``data.ray_data_rows`` rows or more: the files read in pieces by Ray
tasks, each row canonicalised (format detected, unused fields counted) where it was read, tokenized by a pool of
actors holding the tokenizer, de-duplicated by a Ray Data ``groupby`` on the example id; only the accepted
examples' columns and the rejected rows come back to the driver.

Every per-row step is the one :func:`.examples.load_examples` runs (:func:`.read.iter_chunk_rows` /
:func:`.read.iter_file_rows`, :func:`.examples.canonical_record`, :func:`.tokenize.tokenize_guarded`,
:func:`.read.example_id`), and a row's place is its file's index and its position there, so the result is the
single-process one: the same accepted rows in the same order, the same rejections with the same reasons (a
duplicate names the first row of its content in input order), the same per-file formats and unused fields.

Why not ``ray.data.read_json``: it parses a block of lines at once with pyarrow, so one malformed line fails the
block instead of being one rejection, and it keeps no line numbers.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from ..config import ConfigError, DataConfig
from .examples import EXAMPLE_SCHEMA, DataResult, canonical_record, refuse_missing_sources, split_held_out
from .read import Rejection, count_rows, example_id, expand_paths, iter_chunk_rows, iter_file_rows, jsonl_chunks
from .tokenize import tokenize_guarded

__all__ = ["CHUNK_BYTES", "load_examples_ray", "pool_rows", "uses_ray_data"]

CHUNK_BYTES = 8 << 20  # one read task per 8 MiB of JSON Lines: ~10^4 chat rows, seconds of work each
_POS_BITS = 40  # a row's key: file index << 40 | position (positions below 2^40, ~10^12 lines)
_ERROR = "\x00"  # a status starting so is a file-level error, not a row's rejection

_READ_SCHEMA = pa.schema([
    ("key", pa.int64()), ("status", pa.string()), ("fmt", pa.string()), ("messages", pa.string()),
    ("unused", pa.list_(pa.string())), ("hints", pa.list_(pa.string())), ("source", pa.string()),
    ("domain", pa.string()), ("row", pa.binary()), ("fields", pa.list_(pa.string())),
])
_TOKEN_SCHEMA = pa.schema([
    ("key", pa.int64()), ("status", pa.string()), ("fmt", pa.string()), ("unused", pa.list_(pa.string())),
    ("hints", pa.list_(pa.string())), ("source", pa.string()), ("domain", pa.string()), ("row", pa.binary()),
    ("example_id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    ("truncated", pa.bool_()), ("fields", pa.list_(pa.string())),
])


def pool_rows(cfg: DataConfig) -> int:
    """Rows of the files of ``cfg`` without parsing them (:func:`.read.count_rows`); 0 for the demo source.

    Raises:
        FileNotFoundError / ConfigError: as :func:`.read.count_rows` and :func:`.read.expand_paths`.
    """
    if cfg.source != "files":
        return 0
    return sum(count_rows(p) for p in expand_paths(cfg.paths))


def uses_ray_data(cfg: DataConfig) -> bool:
    """Whether the data stage runs on Ray Data: ``data.ray_data_rows`` is set and the files hold at least that
    many rows (:func:`pool_rows`).

    Raises:
        FileNotFoundError / ConfigError: as :func:`pool_rows` (the message the data stage would give).
    """
    return cfg.source == "files" and cfg.ray_data_rows is not None and pool_rows(cfg) >= cfg.ray_data_rows


def _pieces(cfg: DataConfig, files: list[str], chunk_bytes: int) -> list[dict]:
    """The read tasks: plain JSON Lines files cut by :func:`.read.jsonl_chunks` (whole files under ``data.limit``,
    which counts a file's first rows), every other file one task. File-level problems (a missing file, an
    unsupported type, UTF-16) are raised here, on the driver, with the single-process message."""
    out = []
    for i, f in enumerate(files):
        next(iter_file_rows(f, 0), None)  # the file's own checks, no row read
        name = Path(f).name.lower()
        if cfg.limit is None and name.endswith((".jsonl", ".ndjson")):
            out += [{"file": i, "start": s, "end": e, "line": ln} for s, e, ln in jsonl_chunks(f, chunk_bytes)]
        else:
            out.append({"file": i, "start": -1, "end": -1, "line": -1})
    return out


def _error_status(err: Exception) -> str:
    """A file-level error as a row's status: Ray keeps a task's exception as text only, so it travels as data and
    the driver raises the first one in input order (:func:`_raise_first_error`), as one process would."""
    return f"{_ERROR}{type(err).__name__}{_ERROR}{err}"


def _rows_or_error(rows):
    try:
        yield from rows
    except (ConfigError, FileNotFoundError) as err:
        yield None, None, err


def _read_piece(batch: pa.Table, files: list[str], cfg: DataConfig) -> pa.Table:
    """Ray Data ``map_batches`` (one piece per batch): the piece's rows, each canonicalised."""
    cols: dict[str, list] = {k: [] for k in _READ_SCHEMA.names}
    for piece in batch.to_pylist():
        f = files[piece["file"]]
        rows = (iter_chunk_rows(f, piece["start"], piece["end"], piece["line"]) if piece["start"] >= 0
                else iter_file_rows(f, cfg.limit))
        last, first = 0, len(cols["key"])
        fields: dict[str, None] = {}  # the piece's field names, on its first row: data.columns is checked per file
        for src, pos, row in _rows_or_error(rows):
            if isinstance(row, Exception):
                for k in _READ_SCHEMA.names:
                    cols[k].append({"key": piece["file"] << _POS_BITS | last, "status": _error_status(row),
                                    "unused": [], "hints": [], "fields": []}.get(k))
                break
            if cfg.columns and isinstance(row, dict):
                fields.update(dict.fromkeys(row))
            last = pos + 1
            rec = canonical_record(src, pos, row, cfg)
            ok = not isinstance(rec, Rejection)
            for k, v in (("key", piece["file"] << _POS_BITS | pos), ("status", "" if ok else rec.reason),
                         ("fmt", rec.fmt if ok else None),
                         ("messages", json.dumps(rec.messages, ensure_ascii=False) if ok else None),
                         ("unused", rec.unused if ok else []), ("hints", rec.hints if ok else []),
                         ("source", rec.source if ok else None), ("domain", rec.domain if ok else None),
                         ("row", pickle.dumps(row.row if isinstance(row, Rejection) else row)), ("fields", [])):
                cols[k].append(v)
        if fields:
            cols["fields"][first] = list(fields)
    return pa.table(cols, schema=_READ_SCHEMA)


class _Tokenize:
    """Ray Data actor: the tokenizer, loaded once, applied to batches of canonical rows."""

    def __init__(self, tokenizer, cfg: DataConfig):
        self.tokenizer, self.cfg = tokenizer, cfg

    def __call__(self, batch: pa.Table) -> pa.Table:
        status = batch.column("status").to_pylist()
        todo = [i for i, s in enumerate(status) if not s]
        msgs = [json.loads(m) for m in pc.take(batch.column("messages"), pa.array(todo, pa.int64())).to_pylist()]
        c = self.cfg
        try:
            toks = tokenize_guarded(msgs, self.tokenizer, c.max_seq_len, c.overlong, train_on=c.train_on,
                                    system_prompt=c.default_system_prompt)
        except ConfigError as err:  # the template refuses data.default_system_prompt: every row says so
            toks = [_error_status(err)] * len(msgs)
        n = batch.num_rows
        eid, ids, labels, cut = [None] * n, [None] * n, [None] * n, [False] * n
        for i, m, tok in zip(todo, msgs, toks):
            if isinstance(tok, str):
                status[i] = tok
            else:
                ids[i], labels[i], cut[i] = tok
                eid[i] = example_id(m)
        out = batch.drop_columns(["messages", "status"]).append_column("status", pa.array(status, pa.string()))
        for name, values in (("example_id", eid), ("input_ids", ids), ("labels", labels), ("truncated", cut)):
            out = out.append_column(name, pa.array(values, _TOKEN_SCHEMA.field(name).type))
        return out.select(_TOKEN_SCHEMA.names)


def _first_of_each_id(tokenized, partitions: int) -> pa.Table:
    """De-duplication as a Ray Data ``groupby``: per example id of a tokenized row, the key of its first row
    (in input order) and how many rows share it; only the ids held by two rows or more come back."""
    from ray.data.aggregate import Count, Min

    ok = tokenized.map_batches(lambda t: t.filter(pc.equal(t["status"], "")).select(["example_id", "key"]),
                               batch_format="pyarrow")
    firsts = ok.groupby("example_id", num_partitions=partitions).aggregate(Count(), Min("key")).materialize()
    parts = [t for t in (_arrow(r) for r in firsts.to_arrow_refs()) if t.num_rows]
    if not parts:
        return pa.table({"example_id": pa.array([], pa.string()), "first": pa.array([], pa.int64())})
    t = pa.concat_tables(parts)
    t = t.filter(pc.greater(t["count()"], 1))
    return pa.table({"example_id": t["example_id"], "first": t["min(key)"]})


def _arrow(ref) -> pa.Table:
    import ray

    return ray.get(ref)


def load_examples_ray(cfg: DataConfig, tokenizer, chunk_bytes: int | None = None, actors: int | None = None
                      ) -> DataResult:
    """:func:`.examples.load_examples` on Ray Data (the module docstring); Ray must be initialised.

    Args:
        cfg: the data section (``source: files``).
        tokenizer: the model's tokenizer; shipped to each tokenizing actor.
        chunk_bytes: bytes of JSON Lines per read task; default a quarter of the files' bytes per CPU, between
            64 KiB and :data:`CHUNK_BYTES` (a pool of a few pieces would leave CPUs idle).
        actors: tokenizing actors; default one per CPU of the cluster.

    Returns:
        The :class:`.examples.DataResult` that :func:`.examples.load_examples` returns for ``cfg``.

    Raises:
        FileNotFoundError / ConfigError: as :func:`.examples.load_examples` (a file that fails inside a Ray task
            raises here with its own message).
    """
    import ray

    files = expand_paths(cfg.paths)
    n_actors = actors or max(1, int(ray.cluster_resources().get("CPU", 1)))
    if chunk_bytes is None:
        total = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
        chunk_bytes = min(CHUNK_BYTES, max(64 << 10, total // (4 * n_actors)))
    pieces = _pieces(cfg, files, chunk_bytes)
    try:
        read = ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
            _read_piece, batch_size=1, batch_format="pyarrow", fn_kwargs={"files": files, "cfg": cfg})
        tokenized = read.map_batches(_Tokenize, fn_constructor_args=(tokenizer, cfg), batch_size=1024,
                                     batch_format="pyarrow",
                                     compute=ray.data.ActorPoolStrategy(size=n_actors)).materialize()
        # Ray's default of 200 shuffle partitions costs ~30 s of task start-ups on 2 cores for any size.
        dups = _first_of_each_id(tokenized, max(1, min(64, len(pieces) // 16, n_actors * 2)))
        table = pa.concat_tables([_arrow(r) for r in tokenized.to_arrow_refs()])
    except Exception as err:  # noqa: BLE001 - Ray wraps a task's error; the user's message is in its chain
        raise _cause(err) from None
    table = table.sort_by("key")
    _raise_first_error(table)
    return _assemble(cfg, [str(Path(f)) for f in files], table, dups)


def _raise_first_error(t: pa.Table) -> None:
    """Raise the first file-level error (:func:`_error_status`) in input order, with its own type and message."""
    errors = t.filter(pc.starts_with(pc.fill_null(t["status"], ""), _ERROR))
    if errors.num_rows:
        _, kind, msg = errors["status"][0].as_py().split(_ERROR, 2)
        raise (FileNotFoundError if kind == "FileNotFoundError" else ConfigError)(msg)


def _cause(err: BaseException) -> BaseException:
    """The ``ConfigError`` or ``FileNotFoundError`` a Ray task raised, unwrapped from Ray's exceptions (else
    ``err``)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for kind in (ConfigError, FileNotFoundError):
            if isinstance(e, kind) and not type(e).__module__.startswith("ray"):
                return kind(*e.args)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return err


def _assemble(cfg: DataConfig, files: list[str], t: pa.Table, dups: pa.Table) -> DataResult:
    """The driver's part: duplicates marked, accepted rows as :data:`EXAMPLE_SCHEMA` and split, rejections and the
    per-file tallies in input order (``t`` sorted by key)."""
    first = t.select(["key", "example_id"]).join(dups, "example_id", join_type="left outer").sort_by("key")["first"]
    dup = pc.and_kleene(pc.is_valid(first), pc.not_equal(first, t["key"]))
    dup = pc.fill_null(dup, False)
    ok = pc.and_(pc.equal(t["status"], ""), pc.invert(dup))
    files_arr = pa.array(files, pa.string())
    fidx = pc.shift_right(t["key"], _POS_BITS)
    pos = pc.bit_wise_and(t["key"], (1 << _POS_BITS) - 1)
    acc = t.filter(ok)
    table = pa.table({
        "example_id": acc["example_id"], "source": acc["source"], "domain": acc["domain"],
        "input_ids": acc["input_ids"], "labels": acc["labels"], "n_tokens": pc.list_value_length(acc["input_ids"]),
        "source_file": pc.take(files_arr, pc.filter(fidx, ok)), "source_line": pc.filter(pos, ok),
    }).cast(EXAMPLE_SCHEMA)
    rejected = []
    bad = pc.invert(ok)
    for k, status, row, f in zip(*(pc.filter(c, bad).to_pylist() for c in (t["key"], t["status"], t["row"], first))):
        reason = status or "duplicate example: same content as {}:{}".format(files[f >> _POS_BITS],
                                                                             f & ((1 << _POS_BITS) - 1))
        rejected.append(Rejection(files[k >> _POS_BITS], k & ((1 << _POS_BITS) - 1), reason, pickle.loads(row)))
    train, held = split_held_out(table, cfg)
    sources = {files[i]: n for i, n in _counts(fidx)}
    formats: dict[str, dict[str, int]] = {}
    unused: dict[str, dict[str, int]] = {}
    hints: dict[str, dict[str, str]] = {}
    fmt_valid = pc.is_valid(t["fmt"])
    for i, name, n, _hint in _first_counts(pc.filter(fidx, fmt_valid), pc.filter(t["fmt"], fmt_valid)):
        formats.setdefault(files[i], {})[name] = n
    parent = pc.list_parent_indices(t["unused"])
    for i, name, n, hint in _first_counts(pc.take(fidx, parent), pc.list_flatten(t["unused"]),
                                          pc.list_flatten(t["hints"])):
        unused.setdefault(files[i], {})[name] = n
        hints.setdefault(files[i], {})[name] = hint
    if cfg.columns:
        fields: dict[str, dict[str, None]] = {}
        for i, name in zip(pc.take(fidx, pc.list_parent_indices(t["fields"])).to_pylist(),
                           pc.list_flatten(t["fields"]).to_pylist()):
            fields.setdefault(files[i], {})[name] = None
        for src, n in sources.items():
            refuse_missing_sources(src, cfg.columns, fields.get(src, {}), n, src in formats)
    return DataResult(train=train, eval=held, rejected=rejected, n_read=t.num_rows,
                      truncated=int(pc.sum(pc.cast(pc.filter(t["truncated"], ok), pa.int64())).as_py() or 0),
                      sources=sources,
                      formats=formats, unused=unused, hints=hints)


def _counts(fidx) -> list[tuple[int, int]]:
    """Rows per file index, in file order."""
    vc = pc.value_counts(fidx).to_pylist()
    return sorted((d["values"], d["counts"]) for d in vc)


def _first_counts(fidx, names, hints=None) -> list[tuple[int, str, int, str | None]]:
    """Per (file, name) in the order of its first row (the arrays are in input order): the count and the first
    row's hint; a dict's insertion order as the single-process tally builds it."""
    order = pa.table({"f": fidx, "n": names, "i": pa.array(range(len(names)), pa.int64()),
                      "h": hints if hints is not None else pa.nulls(len(names), pa.string())})
    g = order.group_by(["f", "n"], use_threads=False).aggregate([("i", "min"), ("i", "count"), ("h", "first")])
    g = g.sort_by("i_min")
    return list(zip(g["f"].to_pylist(), g["n"].to_pylist(), g["i_count"].to_pylist(), g["h_first"].to_pylist()))
