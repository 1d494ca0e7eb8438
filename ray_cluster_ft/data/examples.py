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
from typing import Any

import numpy as np
import pyarrow as pa

from ..config import DataConfig
from .read import (
    Rejection,
    hash_order,
    canonicalize,
    example_id,
    is_blank,
    iter_rows,
)

__all__ = [
    "EXAMPLE_SCHEMA",
    "DataResult",
    "tokenize_rows",
    "load_examples",
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


def _special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens, longest first: the named ones (``all_special_tokens``) and
    every added token marked special (SmolLM2's ``<empty_output>``, ``<file_sep>``, ...)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok.content))
    return sorted((t for t in texts if t), key=len, reverse=True)


def _without(text: str, tokens: list[str]) -> str:
    for tok in tokens:
        text = text.replace(tok, "")
    return text


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
    special = _special_token_texts(tokenizer)
    prompts = [tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True) for m in messages]
    fulls = [tokenizer.apply_chat_template(m, tokenize=False) for m in messages]
    enc_p = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    enc_f = tokenizer(fulls, add_special_tokens=False)["input_ids"]
    out: list[tuple[list[int], list[int], bool] | str] = []
    for msgs, p_ids, f_ids in zip(messages, enc_p, enc_f):
        if is_blank(_without(msgs[-1]["content"], special)):  # only end-of-turn tokens: nothing to learn
            out.append("empty response: only whitespace, format characters or special tokens")
            continue
        if all(is_blank(_without(m["content"], special)) for m in msgs[:-1] if m["role"] == "user"):
            out.append("empty prompt: only whitespace, format characters or special tokens")
            continue
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
        order = hash_order([ids[i] for i in idx], seed)
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
    rows = iter_rows(cfg)

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
        # " all ", "all" and "\u200ball" are one name in the report: format characters go, whitespace folds.
        domain = " ".join("".join(c for c in (domain or "") if unicodedata.category(c) != "Cf").split()) or "default"
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
