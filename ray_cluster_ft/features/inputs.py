"""What the feature stage runs on: the candidates' token ids as they are (``sketch``, ``last_layer``,
``hidden_mean``), re-tokenised for a proxy model with another tokenizer, or their text for the embedding
baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.examples import tokenize_rows
from ..data.read import load_messages
from ..model import load_tokenizer, resolve_model_path
from .sketchers import embedding_model_dir

__all__ = ["SketchInputs", "prepare_sketch_inputs", "same_tokenization"]


@dataclass
class SketchInputs:
    """What the sketch stage runs on.

    Attributes:
        table: ``pyarrow.Table``: ``example_id``, ``input_ids``, ``labels``, ``n_tokens`` (sketch,
            last_layer, hidden_mean) or ``example_id``, ``text``, ``n_tokens`` (embedding); ``n_tokens`` is always the
            trained model's count, and the example ids are the trained examples' ids, in their order.
        model_path: the resolved model to sketch with (for ``embedding`` by default the packaged MiniLM).
        pad_token_id: the sketch model's padding id.
        retokenized: the rows were tokenized again for a proxy model with another tokenizer.
    """

    table: Any
    model_path: str | None
    pad_token_id: int
    retokenized: bool = False


def same_tokenization(a, b) -> bool:
    """Two tokenizers turn the same chat into the same ids: equal vocabularies and chat templates."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def prepare_sketch_inputs(train, cfg, tokenizer) -> SketchInputs:
    """Build the sketch stage's input table for ``cfg.sketch.method`` and ``cfg.sketch.model``.

    ``sketch``, ``last_layer`` and ``hidden_mean`` (all read token ids, so they take the same path) with the trained
    model, or with a proxy whose tokenizer tokenizes like the trained one (:func:`same_tokenization`): the
    examples' token ids as they are. A proxy with another tokenizer: the
    messages are read again (:func:`load_messages`) and tokenized with the proxy's chat template
    (:func:`ray_cluster_ft.data.tokenize_rows`, overlong rows truncated to ``data.max_seq_len``); the
    example ids tie the proxy's rows to the trained ones. ``embedding``: the text of each example, its
    messages' contents joined by newlines.

    Args:
        train: the candidates, :data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`.
        cfg: the :class:`~ray_cluster_ft.config.JobConfig`.
        tokenizer: the trained model's tokenizer.

    Returns:
        :class:`SketchInputs`.

    Raises:
        FileNotFoundError: the proxy model or the embedding package is missing.
        ValueError: the proxy's tokenization leaves an example without a response token within
            ``data.max_seq_len`` (named by id).
    """
    import pyarrow as pa

    sk = cfg.sketch
    ids = train.column("example_id").to_pylist()
    if sk.method == "embedding":
        msgs = load_messages(cfg.data, ids)
        text = ["\n".join(m["content"] for m in msgs[i]) for i in ids]
        table = pa.table({"example_id": train.column("example_id"), "text": pa.array(text, type=pa.string()),
                          "n_tokens": train.column("n_tokens")})
        # Resolved now, so a missing package fails before any Ray work.
        path = resolve_model_path(sk.model, "sketch.model") if sk.model else embedding_model_dir()
        return SketchInputs(table, path, 0)
    cols = ["example_id", "input_ids", "labels", "n_tokens"]  # sketch, last_layer and hidden_mean alike
    trained = resolve_model_path(cfg.model.path)
    path = resolve_model_path(sk.model, "sketch.model") if sk.model else trained
    if path == trained:
        return SketchInputs(train.select(cols), path, int(tokenizer.pad_token_id))
    ptok = load_tokenizer(path, cfg.model.trust_remote_code)
    if same_tokenization(tokenizer, ptok):
        return SketchInputs(train.select(cols), path, int(ptok.pad_token_id))
    msgs = load_messages(cfg.data, ids)
    toks = tokenize_rows([msgs[i] for i in ids], ptok, cfg.data.max_seq_len, "truncate",
                         train_on=cfg.data.train_on, system_prompt=cfg.data.default_system_prompt)
    bad = [(i, t) for i, t in zip(ids, toks) if isinstance(t, str)]
    if bad:
        raise ValueError(f"sketch.model {sk.model!r}: {len(bad)} examples have no response token within "
                         f"data.max_seq_len={cfg.data.max_seq_len} under its tokenizer, e.g. {bad[0][0]}: "
                         f"{bad[0][1]}; raise data.max_seq_len or pick a proxy with the trained tokenizer")
    table = pa.table({
        "example_id": train.column("example_id"),
        "input_ids": pa.array([t[0] for t in toks], type=pa.list_(pa.int32())),
        "labels": pa.array([t[1] for t in toks], type=pa.list_(pa.int32())),
        "n_tokens": train.column("n_tokens"),
    })
    return SketchInputs(table, path, int(ptok.pad_token_id), retokenized=True)
