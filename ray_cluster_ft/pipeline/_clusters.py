"""What each cluster holds: its size, where its rows come from, how long they are, what was selected from it,
and a few of its prompts; with the normalised mutual information between clusters and sources. The manifest's
``clustering.clusters`` / ``clustering.nmi`` and the report's "What each cluster holds" come from here.

Pure (no Ray, no file I/O) and vectorised: bincounts, one groupby and one hash of the sources over the
candidates (10^6 rows, 100 clusters, 3 sources: 1.3-2.8 s on the 2-core development machine under load); only the
few example rows are decoded.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd

__all__ = ["EXAMPLES_PER_CLUSTER", "cluster_profile", "pick_source", "prompt_texts"]

EXAMPLES_PER_CLUSTER = 3
"""Example rows shown per cluster (a seeded choice)."""

_TEXT_CHARS = 120
"""Characters of an example's prompt kept (whitespace collapsed; an ellipsis marks a cut)."""


def pick_source(columns: dict[str, Sequence[str]]) -> tuple[str | None, np.ndarray | None]:
    """Which per-row field tells where a row comes from: the first of ``columns`` (in the order given, e.g.
    ``source`` then ``domain``) holding more than one distinct value (a field with one value cannot tell
    clusters apart). Returns ``(field name, values as str (N,))`` or ``(None, None)``."""
    for name, values in columns.items():
        arr = np.asarray(values, dtype=object).astype(str)
        if np.unique(arr).size > 1:
            return name, arr
    return None, None


def _shorten(text: str) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= _TEXT_CHARS else flat[: _TEXT_CHARS - 1].rstrip() + "…"


def cluster_profile(labels, n_tokens, *, selected_weight=None, source=None, source_field: str | None = None,
                    texts: Callable[[np.ndarray], list[str]] | None = None, seed: int = 0) -> dict:
    """Per-cluster contents of a clustering.

    Args:
        labels: int (N,) cluster of every candidate, 0..k-1.
        n_tokens: int (N,) tokens of every candidate.
        selected_weight: float (N,) the selection weight of every planned (selected) candidate and NaN for the
            others; ``None`` = nothing selected.
        source: str (N,) where each row comes from (:func:`pick_source`), or ``None`` (unknown).
        source_field: the name of the field ``source`` holds (``source`` or ``domain``), reported as is.
        texts: maps int row indices (M,) to their prompt texts (M strings); ``None`` = no examples.
        seed: seed of the example choice (a seeded permutation inside each cluster).

    Returns:
        ``{"source_field", "nmi", "clusters"}``: ``nmi`` is scikit-learn's ``normalized_mutual_info_score``
        (arithmetic mean normalisation, in [0, 1]) between the clusters and ``source``, None without a source;
        ``clusters`` has per cluster (ascending) ``{"cluster", "size", "share" (of all candidates), "sources"
        ({value: share of the cluster's rows}, largest first; {} without a source), "tokens_min",
        "tokens_max", "tokens_mean", "selected" (rows planned), "weight" (their summed selection weight),
        "examples" (up to 3 prompts, at most 120 characters each)}``.

    Raises:
        ValueError: shapes disagree, or labels are not non-negative integers.
    """
    lab = np.asarray(labels)
    nt = np.asarray(n_tokens, dtype=np.float64)
    if lab.ndim != 1 or nt.shape != lab.shape or (lab.size and (not np.issubdtype(lab.dtype, np.integer)
                                                               or lab.min() < 0)):
        raise ValueError(f"labels (non-negative ints) and n_tokens must be (N,), got {lab.shape} and {nt.shape}")
    k = int(lab.max()) + 1 if lab.size else 0
    size = np.bincount(lab, minlength=k)
    w = np.full(lab.size, np.nan) if selected_weight is None else np.asarray(selected_weight, dtype=np.float64)
    if w.shape != lab.shape:
        raise ValueError(f"selected_weight must be (N,) = {lab.shape}, got {w.shape}")
    picked = ~np.isnan(w)
    n_sel = np.bincount(lab[picked], minlength=k)
    w_sum = np.bincount(lab[picked], weights=w[picked], minlength=k)
    tok = pd.DataFrame({"c": lab, "t": nt}).groupby("c")["t"].agg(["min", "max", "mean"]).reindex(range(k))
    shares, nmi = [{} for _ in range(k)], None
    if source is not None:
        from sklearn.metrics import normalized_mutual_info_score

        src = np.asarray(source)
        if src.shape != lab.shape:
            raise ValueError(f"source must be (N,) = {lab.shape}, got {src.shape}")
        code, names = pd.factorize(src)  # hashing, not sorting, the N strings
        m = len(names)
        cross = np.bincount(lab * m + code, minlength=k * m).reshape(k, m)
        for c in np.flatnonzero(size):
            order = np.argsort(-cross[c], kind="stable")
            shares[c] = {str(names[j]): float(cross[c, j] / size[c]) for j in order if cross[c, j]}
        nmi = float(normalized_mutual_info_score(code, lab))
    examples = _examples(lab, k, texts, seed)
    clusters = [{"cluster": c, "size": int(size[c]), "share": float(size[c] / max(lab.size, 1)),
                 "sources": shares[c], "tokens_min": int(tok.at[c, "min"]), "tokens_max": int(tok.at[c, "max"]),
                 "tokens_mean": float(tok.at[c, "mean"]), "selected": int(n_sel[c]), "weight": float(w_sum[c]),
                 "examples": examples[c]} for c in range(k) if size[c]]
    return {"source_field": source_field if source is not None else None, "nmi": nmi, "clusters": clusters}


def _examples(lab: np.ndarray, k: int, texts, seed: int) -> list[list[str]]:
    """Up to :data:`EXAMPLES_PER_CLUSTER` prompts per cluster: a seeded random key per row, the smallest keys of
    each cluster (one sort of N keys, then the texts of 3k rows only)."""
    if texts is None or not lab.size:
        return [[] for _ in range(k)]
    key = np.random.default_rng(seed).random(lab.size)
    order = np.lexsort((key, lab))
    starts = np.concatenate([[0], np.cumsum(np.bincount(lab, minlength=k))])
    rank_in = np.arange(lab.size) - starts[lab[order]]
    rows = order[rank_in < EXAMPLES_PER_CLUSTER]
    out = [[] for _ in range(k)]
    for r, text in zip(rows.tolist(), texts(rows)):
        out[int(lab[r])].append(_shorten(text))
    return out


def prompt_texts(table, tokenizer, ignore_index: int = -100) -> Callable[[np.ndarray], list[str]]:
    """A ``texts`` callable for :func:`cluster_profile`: the prompt of each row of ``table`` (``input_ids`` and
    ``labels``, the examples table), decoded from its tokens (the examples keep no text): the leading tokens
    whose label is ``ignore_index``, with the chat template's wrapping around a single user turn removed where
    it is there (rendered once with a placeholder); otherwise decoded without special tokens."""
    marker = "\x00PROMPT\x00"
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=True)
        pre, post = rendered.split(marker) if rendered.count(marker) == 1 else (None, None)
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template: no wrapping to remove
        pre = post = None

    def texts(rows: np.ndarray) -> list[str]:
        import pyarrow as pa

        part = table.select(["input_ids", "labels"]).take(pa.array(np.asarray(rows, dtype=np.int64)))
        out = []
        for ids, labels in zip(part.column("input_ids").to_pylist(), part.column("labels").to_pylist()):
            lab = np.asarray(labels)
            n = int(np.argmax(lab != ignore_index)) if (lab != ignore_index).any() else len(ids)
            text = tokenizer.decode(ids[:n])
            # The trained part may begin inside the template: a response opening with a newline and indentation
            # (code) is tokenised with the newline that ends the template, so the prompt lacks it.
            cut = None
            if pre is not None and text.startswith(pre):
                cut = next((c for c in (post, post.rstrip()) if text.endswith(c)), None)
            if cut is not None and len(text) >= len(pre) + len(cut):
                text = text[len(pre): len(text) - len(cut)]
            else:
                text = tokenizer.decode(ids[:n], skip_special_tokens=True)
            out.append(text)
        return out

    return texts
