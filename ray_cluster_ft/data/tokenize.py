"""Chat messages -> token ids and labels, through the model's own chat template
(``tokenizer.apply_chat_template``): the loss is on the trained assistant turns only, every other token
(system, user, tool messages, the template's own markup before each reply) has label -100.

A trained assistant turn ``i`` covers the tokens from the end of ``template(messages[:i],
add_generation_prompt=True)`` (the prompt up to the reply) to the end of ``template(messages[:i + 1])`` (the reply
and its end-of-turn tokens): the same cut that TRL's ``assistant_only_loss`` and axolotl's chat-template
masking make, computed from the template's renderings rather than from template markers, so any template works.
"""

from __future__ import annotations

from ..config import ConfigError
from .formats import is_blank

__all__ = ["TRAIN_ON", "marked_text", "render_chat", "tokenize_rows", "tokenize_guarded", "trained_turns"]

TRAIN_ON = ("all_assistant_turns", "last_assistant_turn")
_SENTINEL = "\u2063ray-cluster-ft system sentinel\u2063"


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


def _template_msgs(msgs: list[dict]) -> list[dict]:
    # "train" is this project's mark on a masked assistant turn; the template should not see it.
    return [{k: v for k, v in m.items() if k != "train"} for m in msgs]


def render_chat(tokenizer, msgs: list[dict], generation_prompt: bool, system_prompt: str | None = None) -> str:
    """The chat template's text of ``msgs``.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        msgs: chat messages.
        generation_prompt: append the template's assistant header (``add_generation_prompt``).
        system_prompt: ``data.default_system_prompt`` for a chat without a system message: None keeps the
            template's own default; a text is inserted as the system message; ``""`` removes the template's
            default (the rendering of a placeholder system message is cut off the front).

    Raises:
        ConfigError: ``system_prompt=""`` with a template whose system block is not a prefix of the rendering.
    """
    msgs = _template_msgs(msgs)
    has_system = bool(msgs) and msgs[0]["role"] == "system"
    if system_prompt is None or has_system:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    if system_prompt:
        return tokenizer.apply_chat_template([{"role": "system", "content": system_prompt}] + msgs, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    block = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}], tokenize=False)
    text = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}] + msgs, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    if _SENTINEL not in block or not text.startswith(block):
        raise ConfigError("data.default_system_prompt: '' cannot remove this chat template's default system "
                          "prompt (its system block is not the start of the chat); give a system text instead")
    return text[len(block):]


def trained_turns(msgs: list[dict], train_on: str) -> list[int]:
    """Indices of the assistant messages that carry the loss: every assistant turn after the first user message
    and not marked ``train: False`` (``all_assistant_turns``), or only the last message (``last_assistant_turn``).
    An assistant turn before any user message (a chat that opens with the assistant's greeting) answers no
    prompt: it stays in the input as context, untrained (a template also cannot render the empty chat before
    it as a prompt)."""
    if train_on == "last_assistant_turn":
        return [len(msgs) - 1]
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    return [i for i, m in enumerate(msgs)
            if i > first_user and m["role"] == "assistant" and m.get("train", True) is not False]


def _prefix_len(prefix: list[int], full: list[int]) -> int:
    """How many tokens of ``full`` the ``prefix`` rendering covers: its length when it is a token prefix,
    else (templates that rewrite earlier turns, merges across the cut) the longest common prefix."""
    if full[:len(prefix)] == prefix:
        return len(prefix)
    return next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))


def _row_check(msgs: list[dict], special: list[str], supports_tools: bool) -> str | None:
    if is_blank(_without(msgs[-1]["content"], special)):  # only end-of-turn tokens: nothing to learn
        return "empty response: only whitespace, format characters or special tokens"
    if all(is_blank(_without(m["content"], special)) for m in msgs[:-1] if m["role"] == "user"):
        return "empty prompt: only whitespace, format characters or special tokens"
    if not supports_tools and any(m["role"] == "tool" or "tool_calls" in m for m in msgs):
        return "tool messages: the model's chat template does not render tool calls or tool results"
    return None


def tokenize_rows(messages: list[list[dict]], tokenizer, max_seq_len: int, overlong: str = "drop", *,
                  train_on: str = "all_assistant_turns", system_prompt: str | None = None,
                  ) -> list[tuple[list[int], list[int], bool] | str]:
    """Tokenize chat examples with the model's chat template; loss only on the trained assistant turns.

    Args:
        messages: per example, the chat messages (last = assistant).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_seq_len: maximum tokens per example (the whole chat, template included).
        overlong: ``drop`` rejects longer examples; ``truncate`` cuts them (rejected only when the first trained
            token is past the cut).
        train_on: ``all_assistant_turns`` or ``last_assistant_turn`` (:func:`trained_turns`).
        system_prompt: ``data.default_system_prompt`` (:func:`render_chat`).

    Returns:
        Per example, ``(input_ids, labels, truncated)`` (``labels[t]`` is ``input_ids[t]`` on trained tokens,
        -100 elsewhere), or a rejection reason (str).

    Raises:
        ConfigError: ``system_prompt`` cannot be applied to this template (:func:`render_chat`).
    """
    special = _special_token_texts(tokenizer)
    supports_tools = "tool" in (getattr(tokenizer, "chat_template", None) or "")
    checks = [_row_check(m, special, supports_tools) for m in messages]
    texts: list[str] = []
    layout: list[tuple[int, list[int]]] = []  # per row: index of its full text, then (start, end) text indices
    for msgs, bad in zip(messages, checks):
        if bad is not None:
            layout.append((-1, []))
            continue
        base = len(texts)
        texts.append(render_chat(tokenizer, msgs, False, system_prompt))
        spans = []
        for i in trained_turns(msgs, train_on):
            spans.append(len(texts))
            texts.append(render_chat(tokenizer, msgs[:i], True, system_prompt))
            if i == len(msgs) - 1:
                spans.append(base)  # the last reply ends where the chat does
            else:
                spans.append(len(texts))
                texts.append(render_chat(tokenizer, msgs[:i + 1], False, system_prompt))
        layout.append((base, spans))
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out: list[tuple[list[int], list[int], bool] | str] = []
    for bad, (base, spans) in zip(checks, layout):
        if bad is not None:
            out.append(bad)
            continue
        out.append(_labelled(enc[base], [(enc[spans[j]], enc[spans[j + 1]]) for j in range(0, len(spans), 2)],
                             max_seq_len, overlong))
    return out


def _labelled(f_ids: list[int], turns: list[tuple[list[int], list[int]]], max_seq_len: int, overlong: str
              ) -> tuple[list[int], list[int], bool] | str:
    """One chat's ids and labels from its full token ids and, per trained turn, the ids of the text before
    and through the reply; or the rejection reason."""
    labels = [-100] * len(f_ids)
    first = None
    for before, through in turns:
        lo, hi = _prefix_len(before, f_ids), _prefix_len(through, f_ids)
        if hi > lo:
            labels[lo:hi] = f_ids[lo:hi]
            first = lo if first is None else min(first, lo)
    if first is None:
        return "empty response after tokenization"
    if len(f_ids) > max_seq_len:
        if overlong == "drop":
            return f"over max length: {len(f_ids)} tokens > data.max_seq_len={max_seq_len}"
        if first >= max_seq_len:
            return f"over max length: the prompt alone is {first} tokens >= data.max_seq_len={max_seq_len}"
    cut = len(f_ids) > max_seq_len
    return list(f_ids[:max_seq_len]), labels[:max_seq_len], cut


def tokenize_guarded(messages, tokenizer, max_seq_len: int, overlong: str, **kw) -> list:
    """:func:`tokenize_rows` on a chunk; if the tokenizer fails on the chunk, retry row by row so only the
    offending rows are rejected (with the tokenizer's message) and the rest of the chunk is kept."""
    try:
        return tokenize_rows(messages, tokenizer, max_seq_len, overlong, **kw)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - third-party tokenizers raise arbitrary types on hostile text
        out = []
        for m in messages:
            try:
                out.extend(tokenize_rows([m], tokenizer, max_seq_len, overlong, **kw))
            except ConfigError:
                raise
            except Exception as err:  # noqa: BLE001
                out.append(f"tokenizer error: {type(err).__name__}: {str(err)[:200]}")
        return out


def marked_text(tokenizer, input_ids, labels, open_mark: str = "[[", close_mark: str = "]]") -> str:
    """One example decoded with its trained tokens marked: masked text (labels -100) as it is, every run of trained
    tokens between ``open_mark`` and ``close_mark``; what ``check`` and ``report.md`` show.

    Args:
        tokenizer: the tokenizer that made ``input_ids``.
        input_ids, labels: int sequences of one length (an ``examples.parquet`` row).
    """
    ids, labs = list(input_ids), list(labels)
    out, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or (labs[t] == -100) != (labs[start] == -100):
            text = tokenizer.decode(ids[start:t])
            out.append(text if labs[start] == -100 else open_mark + text + close_mark)
            start = t
    return "".join(out)
