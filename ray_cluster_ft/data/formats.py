"""Row formats -> canonical chat messages: the shapes fine-tuning data comes in (docs/data.md).

Pure: no file I/O, no tokenizer. Each format turns one row (a dict) into chat messages ending with an
assistant message, and names the fields it used, so that the data stage can count the text fields it did not
use (:func:`unused_text_fields`).

Formats (``data.format``; ``auto`` picks one per row, in this order):

========================  =====================================================================================
``messages``              OpenAI chat: ``messages`` of ``{role, content}`` (system/user/assistant/tool; assistant
                          ``tool_calls`` with ``content`` null)
``sharegpt``              ``conversations`` of ``{from, value}``, ``from`` in human/gpt/system/tool/
                          function_call/observation (optional top-level ``system``)
``alpaca``                ``instruction``, optional ``input`` (joined to the instruction after a blank line, as
                          Stanford Alpaca's ``prompt_input`` separates them), ``output``, optional ``system``,
                          optional ``history`` (``[[instruction, output], ...]``, earlier turns, LLaMA-Factory)
``prompt_completion``     TRL: ``prompt`` + ``completion``, strings or lists of messages (conversational); only the
                          completion is trained
``prompt_response``       ``prompt`` + ``response``
``question_answer``       ``question`` + ``answer``, optional ``context`` (joined after the question)
========================  =====================================================================================

Every flat format also takes an optional ``system``. ``data.columns`` maps a file's own field names onto these
(:func:`apply_columns`): ``{prompt: [question, context], response: long_answer}``; a list of fields is joined
with a blank line (``"\\n\\n"``) in the order given, skipping absent and empty ones.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any, Mapping, Sequence

__all__ = [
    "FORMATS",
    "JOIN",
    "TEXT_FIELDS",
    "apply_columns",
    "canonical_row",
    "check_text",
    "columns_hint",
    "detect_format",
    "is_blank",
    "missing_sources",
    "row_messages",
    "unused_text_fields",
]

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_response", "question_answer")
JOIN = "\n\n"
"""The separator of joined fields: Alpaca's instruction and input, a question and its context, and a
``data.columns`` list."""

# Field names that hold text to train on in some format, or commonly do in the wild: always counted when unused.
TEXT_FIELDS = frozenset({
    "messages", "conversations", "instruction", "input", "output", "system", "history", "prompt", "completion",
    "response", "question", "answer", "context", "long_answer", "text", "passage", "document", "chosen",
    "rejected", "rationale", "explanation", "solution", "query", "reference", "article", "summary",
})
# Bookkeeping fields that the data stage reads itself or that never carry training text.
_META = frozenset({"source", "domain", "id", "uuid", "url", "task_id", "split", "label", "lang", "language"})

_ROLES = ("system", "user", "assistant", "tool")
# The fields the formats read (what data.columns maps onto): a row's other fields are what a hint names.
_FIELDS = frozenset({"messages", "conversations", "system", "history", "instruction", "input", "output", "prompt",
                     "completion", "response", "question", "context", "answer"})
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "system": "system", "tool": "tool", "observation": "tool",
                   "function_call": "assistant"}

# Letters that render as nothing: Hangul fillers, the braille blank.
_INVISIBLE = frozenset("\u115f\u1160\u3164\uffa0\u2800")
# Format (Cf: U+200B, U+FEFF, joiners), control (Cc: NUL, ...) and combining marks with no base (Mn, Me).
_BLANK_CATEGORIES = frozenset({"Cf", "Cc", "Mn", "Me"})


def is_blank(text: str) -> bool:
    """True when nothing visible is left of ``text`` after removing whitespace, Unicode format and control
    characters, combining marks and the invisible fillers: such text looks empty to a reader and gives the model
    nothing to learn. (A combining mark on a letter counts with its letter.)"""
    return not any(not ch.isspace() and ch not in _INVISIBLE and unicodedata.category(ch) not in _BLANK_CATEGORIES
                   for ch in text)


def check_text(v: str, what: str) -> None:
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
    if is_blank(v):
        raise ValueError(f"empty {key}")
    check_text(v, f"'{key}'")
    return v


def _optional_str(row: dict, key: str) -> str | None:
    """An optional text field: absent, null or blank -> None; otherwise it must be a string."""
    v = row.get(key)
    if v is None or (isinstance(v, str) and is_blank(v)):
        return None
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is {type(v).__name__}, expected a string")
    check_text(v, f"'{key}'")
    return v


def _present(row: dict, *keys: str) -> bool:
    """Whether any of ``keys`` holds a value; a null counts as absent so that a Parquet file mixing formats
    (null ``prompt`` beside a filled ``question``) reads each row in the format it uses."""
    return any(row.get(k) is not None for k in keys)


def _short(v: Any, n: int = 60) -> str:
    r = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return r if len(r) <= n else r[: n - 3] + "..."


_MISSING = ("missing field: need 'messages', 'conversations' (sharegpt), 'instruction'+'output' (alpaca), "
            "'prompt'+'completion', 'prompt'+'response' or 'question'+'answer'; map other fields with data.columns")


def detect_format(row: dict) -> str:
    """The format of one row (a dict), by the fields it fills, in the order of :data:`FORMATS`.

    Raises:
        ValueError: no format fits (the reason names the fields each format needs).
    """
    if row.get("messages") is not None:
        return "messages"
    if row.get("conversations") is not None:
        return "sharegpt"
    if _present(row, "instruction") and _present(row, "output"):
        return "alpaca"
    if _present(row, "completion") and not _present(row, "response"):
        return "prompt_completion"
    if _present(row, "prompt", "response") or not _present(row, "question", "answer") and (
        "prompt" in row or "response" in row
    ):
        return "prompt_response"
    if _present(row, "question", "answer") or "question" in row or "answer" in row:
        return "question_answer"
    raise ValueError(_MISSING)


def _tool_calls(v: Any, where: str) -> list:
    if not isinstance(v, list) or not v or not all(isinstance(c, dict) for c in v):
        raise ValueError(f"{where}.tool_calls must be a non-empty list of objects")
    return v


def _text_parts(content: list, where: str) -> str:
    """OpenAI's content parts (``[{"type": "text", "text": ...}, ...]``) as one text, the parts joined in order;
    a part of another type (an image, audio) is a rejection: a text model trains on text only."""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}.content[{j}] is a {_short(kind) if kind else type(part).__name__} part; "
                             f"only text parts are trained")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}].text is {type(part.get('text')).__name__}, expected a string")
        texts.append(part["text"])
    return "".join(texts)


def _chat(msgs: Any, field: str) -> list[dict]:
    """A list of OpenAI chat messages, checked; ``field`` names it in the reasons."""
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"field '{field}' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is {type(m).__name__}, expected an object")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            raise ValueError(f"{where}.role is {_short(role)}, expected system/user/assistant/tool")
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            if content is not None and not isinstance(content, str):
                raise ValueError(f"{where}.content is {type(content).__name__}, expected a string or null")
            content = content or ""
        elif isinstance(content, list):  # no parts: empty text, refused below as an empty prompt or response
            content = _text_parts(content, where)
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content is {type(content).__name__}, expected a string or a list of text "
                             f"parts")
        check_text(content, f"{where}.content")
        msg["content"] = content
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _finish(out: list[dict]) -> list[dict]:
    """The rules every conversation keeps: it ends with a non-empty assistant reply after some user text."""
    last = out[-1]
    if last["role"] != "assistant":
        raise ValueError("the last message is not the assistant's response")
    if "tool_calls" in last:
        raise ValueError("the last message is a tool call, not the assistant's response")
    if is_blank(last["content"]):
        raise ValueError("empty response")
    if not any(m["role"] == "user" and not is_blank(m["content"]) for m in out[:-1]):
        raise ValueError("empty prompt: no user message before the response")
    return out


def _system(row: dict) -> list[dict]:
    s = _optional_str(row, "system")
    return [] if s is None else [{"role": "system", "content": s}]


def _sharegpt(row: dict) -> tuple[list[dict], set[str]]:
    conv = row["conversations"]
    if not isinstance(conv, list) or not conv:
        raise ValueError("field 'conversations' must be a non-empty list")
    out = _system(row)
    for i, turn in enumerate(conv):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} is {type(turn).__name__}, expected an object")
        who, value = turn.get("from"), turn.get("value")
        if who not in _SHAREGPT_ROLES:
            raise ValueError(f"{where}.from is {_short(who)}, expected human/gpt/system/tool/function_call/"
                             f"observation")
        if not isinstance(value, str):
            raise ValueError(f"{where}.value is {type(value).__name__}, expected a string")
        check_text(value, f"{where}.value")
        if who == "function_call":
            try:
                call = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                raise ValueError(f"{where}: a function_call value must be JSON {{name, arguments}}") from None
            out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]})
        else:
            out.append({"role": _SHAREGPT_ROLES[who], "content": value})
    return out, {"conversations", "system"}


def _alpaca(row: dict) -> tuple[list[dict], set[str]]:
    out = _system(row)
    hist = row.get("history")
    if hist is not None:
        if not isinstance(hist, list) or not all(
                isinstance(h, (list, tuple)) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in hist):
            raise ValueError("field 'history' must be a list of [instruction, output] string pairs")
        for q, a in hist:
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    instruction = _nonempty_str(row, "instruction")
    extra = _optional_str(row, "input")
    prompt = instruction if extra is None else instruction + JOIN + extra
    out += [{"role": "user", "content": prompt}, {"role": "assistant", "content": _nonempty_str(row, "output")}]
    return out, {"instruction", "input", "output", "system", "history"}


def _prompt_completion(row: dict) -> tuple[list[dict], set[str]]:
    p, c = row.get("prompt"), row.get("completion")
    if isinstance(p, list) or isinstance(c, list):  # TRL's conversational prompt-completion
        prompt, completion = _chat(p, "prompt"), _chat(c, "completion")
        # TRL trains the completion only: assistant turns inside the prompt stay masked.
        prompt = [{**m, "train": False} if m["role"] == "assistant" else m for m in prompt]
        return prompt + completion, {"prompt", "completion"}
    out = _system(row) + [{"role": "user", "content": _nonempty_str(row, "prompt")},
                          {"role": "assistant", "content": _nonempty_str(row, "completion")}]
    return out, {"prompt", "completion", "system"}


def _flat(row: dict, prompt: str, response: str, extra: str | None = None) -> tuple[list[dict], set[str]]:
    text = _nonempty_str(row, prompt)
    more = _optional_str(row, extra) if extra else None
    if more is not None:
        text = text + JOIN + more
    out = _system(row) + [{"role": "user", "content": text}, {"role": "assistant", "content": _nonempty_str(row, response)}]
    return out, {prompt, response, "system"} | ({extra} if extra else set())


def row_messages(row: Any, fmt: str = "auto") -> tuple[str, list[dict], set[str]]:
    """One row -> ``(format, messages, fields used)``.

    Args:
        row: a dict in one of :data:`FORMATS` (after :func:`apply_columns`).
        fmt: ``auto`` (:func:`detect_format`) or one of :data:`FORMATS` to force it.

    Returns:
        The format, the chat messages (``[{"role", "content"}, ...]``, the last the assistant's reply; an
        assistant turn of a conversational prompt carries ``"train": False``), and the row's fields the format
        read.

    Raises:
        ValueError: the rejection reason (missing field, wrong type, empty prompt or response, ...).
    """
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object: {type(row).__name__}")
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "messages":
        if "messages" not in row:
            raise ValueError("missing field 'messages'")
        msgs, used = _chat(row["messages"], "messages"), {"messages"}
    elif fmt == "sharegpt":
        if "conversations" not in row:
            raise ValueError("missing field 'conversations'")
        msgs, used = _sharegpt(row)
    elif fmt == "alpaca":
        msgs, used = _alpaca(row)
    elif fmt == "prompt_completion":
        msgs, used = _prompt_completion(row)
    elif fmt == "prompt_response":
        msgs, used = _flat(row, "prompt", "response")
    elif fmt == "question_answer":
        msgs, used = _flat(row, "question", "answer", "context")
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return fmt, _finish(msgs), used


def apply_columns(row: Any, columns: Mapping[str, str | Sequence[str]]) -> tuple[Any, dict[str, list[str]]]:
    """Rename a row's fields by ``data.columns``: each target field gets its source field, or the non-empty
    string values of its source fields joined by :data:`JOIN`; a single non-string source (a list of messages)
    is passed as is.

    Returns:
        ``(row with the target fields, {target: its source fields})``; the row is unchanged when ``columns``
        is empty or the row is not a dict.
    """
    if not columns or not isinstance(row, dict):
        return row, {}
    out = dict(row)
    sources: dict[str, list[str]] = {}
    for target, src in columns.items():
        names = [src] if isinstance(src, str) else list(src)
        sources[target] = names
        for n in names:
            out.pop(n, None)
        vals = [row.get(n) for n in names]
        if len(names) == 1:
            out[target] = vals[0]
        else:
            texts = [v for v in vals if isinstance(v, str) and not is_blank(v)]
            bad = next((n for n, v in zip(names, vals) if v is not None and not isinstance(v, str)), None)
            if bad is not None:
                out[target] = row[bad]  # the format's own check names the wrong type
            else:
                out[target] = JOIN.join(texts) if texts else None
    return out, sources


def missing_sources(columns: Mapping[str, str | Sequence[str]], fields) -> list[tuple[str, str]]:
    """The ``(target, source)`` pairs of ``data.columns`` whose source field is not among ``fields``, in the
    mapping's order."""
    return [(t, n) for t, src in columns.items() for n in ([src] if isinstance(src, str) else src)
            if n not in fields]


def canonical_row(row: Any, fmt: str = "auto", columns: Mapping[str, Any] | None = None
                  ) -> tuple[str, list[dict], list[str]]:
    """:func:`apply_columns`, then :func:`row_messages`; then the row's unused text fields
    (:func:`unused_text_fields`, by the file's own field names).

    Returns:
        ``(format, messages, unused fields)``.

    Raises:
        ValueError: the rejection reason.
    """
    mapped, sources = apply_columns(row, columns or {})
    try:
        fmt, msgs, used = row_messages(mapped, fmt)
    except ValueError as err:
        msg = str(err)
        if msg == _MISSING and isinstance(row, dict):
            # No format fits: the row's own field names (a null one says so) beside the ones a format needs.
            names = ", ".join(k + (" (null)" if v is None else "") for k, v in row.items()) or "none"
            raise ValueError(f"{msg} (the row's fields: {names}; see docs/data.md)") from None
        target = re.match(r"field '(\w+)' is null$", msg)
        if target and target.group(1) in sources and isinstance(row, dict) and \
                not any(n in row for n in sources[target.group(1)]):
            # The target is null because the row lacks every field data.columns maps to it: name those.
            names = " or ".join(repr(n) for n in sources[target.group(1)])
            raise ValueError(f"missing field {names} (data.columns maps it to '{target.group(1)}')") from None
        if msg.startswith("missing field '") and isinstance(mapped, dict):
            # Name what the row does have, so the fix (a data.columns line) is one look away.
            others = [k for k in mapped if k not in _META and k not in _FIELDS and _texts(mapped[k])]
            if others:
                raise ValueError(f"{msg} (the row has {', '.join(others)}; map them with data.columns)") from None
        raise
    used_here = {n for u in used for n in sources.get(u, [u])} | {n for names in sources.values() for n in names}
    text = "\n".join(m["content"] for m in msgs)
    return fmt, msgs, unused_text_fields(row, used_here, text)


def _texts(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _texts(x)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _texts(x)]
    return []


def unused_text_fields(row: dict, used: set[str], trained_text: str) -> list[str]:
    """The row's text fields that its format did not use and whose text is not in ``trained_text`` anyway.

    A field counts as text when its name is in :data:`TEXT_FIELDS`, or when it holds a string (or strings in a
    list or object) of five or more words (a category such as MedQuAD's ``qtype: exams and tests`` is not); bookkeeping names (``source``, ``domain``, ``id``, ``url``,
    ``label``, ...) and names ending in ``_id`` never count. A field whose every string already appears in
    ``trained_text`` (``gpteacher``'s ``instruction`` inside its ``question``) is not lost and does not count.

    Returns:
        The field names, in the row's order.
    """
    out = []
    for key, value in row.items():
        if key in used or key in _META or key.endswith("_id"):
            continue
        texts = [t for t in _texts(value) if not is_blank(t)]
        if not texts:
            continue
        if key not in TEXT_FIELDS and not any(len(t.split()) >= 5 for t in texts):
            continue
        if all(t.strip() in trained_text for t in texts):
            continue
        out.append(key)
    return out


def columns_hint(fmt: str, field: str, value: Any = "", columns: Mapping[str, Any] | None = None) -> str:
    """The ``data.columns`` line that would train an unused ``field`` of a ``fmt`` row, for the warning; for a
    field that is not a string (``data.columns`` joins strings only), what to do instead.

    ``columns`` (the ``data.columns`` in force) is kept in the line, the field appended to its target's sources
    (the documented join of a list of fields): a line that named only the target and the field would drop
    what the user had mapped onto it (``{prompt: [prompt, context]}`` for rows whose ``prompt`` comes from
    ``question``)."""
    if not isinstance(value, str) and fmt not in ("sharegpt", "messages"):
        return f"{field!r} is a {type(value).__name__}, not text: write it into a text field of the rows first"
    target = {"alpaca": "instruction", "prompt_completion": "prompt", "question_answer": "question",
              "sharegpt": None, "messages": None}.get(fmt, "prompt")
    if target is None:
        return f"(a {fmt} row: put {field!r} into its messages)"
    cols = {t: [s] if isinstance(s, str) else list(s) for t, s in (columns or {}).items()}
    cols[target] = cols.get(target, [target]) + [field]
    return "data.columns: {" + ", ".join(
        f"{t}: {s[0] if len(s) == 1 else '[' + ', '.join(s) + ']'}" for t, s in cols.items()) + "}"
