"""Held-out metrics of a loaded model: response-token loss and perplexity per domain, multiple-choice accuracy
by answer likelihood, greedy completions and pass@1.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from typing import Iterable

import numpy as np
import pyarrow as pa

from ..data.collate import collate, logits_positions
from ..data.tasks import LETTERS
from ..model import forward_keeps_logits

__all__ = [
    "LETTERS",
    "heldout_loss",
    "choice_logprobs",
    "mc_accuracy",
    "generate_completions",
    "pass_at_1",
]


@contextlib.contextmanager
def _scoring(model):
    """``model.eval()`` and no gradients for the block; the model's training mode back afterwards, also when
    scoring raises."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _check_width(logits, positions: int) -> None:
    """Refuse logits that are not one per position asked: a position would read another position's logits.

    Raises:
        ValueError: ``logits.shape[1] != positions`` (PEFT prompt tuning and p-tuning put virtual tokens first).
    """
    if logits.shape[1] != positions:
        raise ValueError(
            f"the model returned logits for {logits.shape[1]} positions where {positions} were asked; held-out "
            f"scores need the logits of the input's own positions (PEFT prompt tuning and p-tuning put virtual "
            f"tokens before the input, and are not supported here)")


def heldout_loss(model, examples: pa.Table, batch_size: int = 8, pad_token_id: int = 0,
                 prompt_end_scores: dict | None = None) -> dict:
    """Response-token loss per domain and overall.

    Args:
        model: a causal LM (``model(input_ids, attention_mask).logits`` of shape (B, T, V)); one whose
            ``forward`` takes ``logits_to_keep`` computes logits only where a label follows.
        examples: rows with ``input_ids``, ``labels``, ``domain`` (``data.EXAMPLE_SCHEMA``; ``example_id`` too
            when ``prompt_end_scores`` is given).
        batch_size: examples per forward pass (sorted by length to cut padding).
        prompt_end_scores: optional ``{example_id: list of token ids}``, filled in place with
            ``{example_id: float64 (n,) log-probabilities of those tokens as the first response token}`` (the
            next-token distribution at the prompt's last position), read off the same forward pass: the
            multiple-choice letters then cost no extra pass (see :func:`evaluate_model_path`).

    Returns:
        ``{domain: {"loss": float nats/token, "perplexity": float, "tokens": int, "examples": int}, ...,
        "all": {...}}``; empty dict for an empty table.

    Raises:
        ValueError: the model's logits are not one per input position (or per kept position), as with PEFT prompt
            tuning and p-tuning; an example of ``prompt_end_scores`` with no response token.
    """
    import torch

    if examples.num_rows == 0:
        return {}
    ids = examples.column("input_ids").to_pylist()
    labels = examples.column("labels").to_pylist()
    domains = examples.column("domain").to_pylist()
    want = dict(prompt_end_scores) if prompt_end_scores else {}
    eids = examples.column("example_id").to_pylist() if want else [None] * len(ids)
    order = np.argsort([len(x) for x in ids], kind="stable")
    nll: dict[str, float] = defaultdict(float)
    ntok: dict[str, int] = defaultdict(int)
    nex: dict[str, int] = defaultdict(int)
    device = next(model.parameters()).device
    keep = forward_keeps_logits(model)
    with _scoring(model):
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            b = collate([ids[i] for i in idx], [labels[i] for i in idx], pad_token_id)
            # Logits only where a label follows: a multiple-choice row's long prompt never reaches the LM head.
            pos = logits_positions(b["labels"])
            b = {k: torch.from_numpy(v).to(device) for k, v in b.items()}
            at = torch.from_numpy(pos).to(device)
            extra = {"logits_to_keep": at} if keep else {}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], **extra).logits
            _check_width(logits, len(pos) if keep else b["input_ids"].shape[1])
            logits = (logits if keep else logits.index_select(1, at)).float()
            tgt = b["labels"].index_select(1, at + 1)
            lp = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="none"
            ).view(tgt.shape)
            valid = tgt != -100
            per_ex = (lp * valid).sum(1).cpu().numpy()
            per_n = valid.sum(1).cpu().numpy()
            for j, i in enumerate(idx):
                for d in (domains[i], "all"):
                    nll[d] += float(per_ex[j])
                    ntok[d] += int(per_n[j])
                    nex[d] += 1
                if eids[i] in want:
                    n_p = next((t for t, x in enumerate(labels[i]) if x != -100), len(labels[i]))
                    col = int(np.searchsorted(pos, n_p - 1))  # a label follows n_p - 1: it is kept
                    if col == len(pos) or pos[col] != n_p - 1:  # the row has no label
                        raise ValueError(f"example {eids[i]!r}: no response token to score after its prompt")
                    row = torch.log_softmax(logits[j, col].double(), dim=-1)
                    prompt_end_scores[eids[i]] = row[list(want[eids[i]])].cpu().numpy()
    out = {}
    for d in sorted(nll, key=lambda k: (k == "all", k)):
        loss = nll[d] / max(ntok[d], 1)
        out[d] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": ntok[d], "examples": nex[d]}
    return out


def _batches(order: np.ndarray, batch_size: int) -> Iterable[np.ndarray]:
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def _padded(seqs: list[list[int]], pad_token_id: int):
    """:func:`ray_cluster_ft.data.collate` (right padding) as int64 torch tensors ``(ids, mask)``."""
    import torch

    b = collate(seqs, pad_token_id=pad_token_id)
    return torch.from_numpy(b["input_ids"]), torch.from_numpy(b["attention_mask"])


def choice_logprobs(model, items: list[dict], batch_size: int = 8, pad_token_id: int = 0) -> list[np.ndarray]:
    """Log-likelihood of each choice's continuation after its item's prompt.

    Items whose choices are all one token are scored from one forward pass over the prompt (the next-token
    log-softmax at the prompt's last position); the others from one pass per (prompt + choice) sequence,
    summing the choice tokens' log-probabilities. Sequences are right-padded and sorted by length; causal
    attention makes the real positions independent of the padding.

    Args:
        model: a causal LM, ``model(input_ids=, attention_mask=).logits`` of shape (B, T, V).
        items: dicts with ``prompt_ids`` (list[int], non-empty) and ``choice_ids`` (list of non-empty
            list[int], at least 2 choices).
        batch_size: sequences per forward pass.
        pad_token_id: id written into padded positions (never scored).

    Returns:
        Per item, float64 (n_choices,) summed log-probabilities in nats (<= 0).

    Raises:
        ValueError: an item with an empty prompt, fewer than 2 choices, or an empty choice; logits that are not
            one per input position (PEFT prompt tuning and p-tuning).
    """
    import torch

    for i, it in enumerate(items):
        if not it.get("prompt_ids"):
            raise ValueError(f"item {i}: empty prompt_ids")
        if len(it.get("choice_ids") or []) < 2:
            raise ValueError(f"item {i}: needs at least 2 choices")
        if any(len(c) == 0 for c in it["choice_ids"]):
            raise ValueError(f"item {i}: empty choice continuation")
    out: list[np.ndarray] = [np.zeros(len(it["choice_ids"])) for it in items]
    device = next(model.parameters()).device
    with _scoring(model):
        single = [i for i, it in enumerate(items) if all(len(c) == 1 for c in it["choice_ids"])]
        one = set(single)
        multi = [(i, j) for i, it in enumerate(items) if i not in one for j in range(len(it["choice_ids"]))]
        order = np.asarray(single)[np.argsort([len(items[i]["prompt_ids"]) for i in single], kind="stable")] \
            if single else np.zeros(0, dtype=np.int64)
        for idx in _batches(order, batch_size):
            seqs = [items[i]["prompt_ids"] for i in idx]
            ids, mask = _padded(seqs, pad_token_id)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            _check_width(logits, ids.shape[1])
            last = torch.as_tensor([len(s) - 1 for s in seqs], device=logits.device)
            lp = torch.log_softmax(logits[torch.arange(len(seqs), device=logits.device), last].double(), dim=-1)
            lp = lp.cpu().numpy()
            for row, i in enumerate(idx):
                out[i] = lp[row, [c[0] for c in items[i]["choice_ids"]]]
        lens = [len(items[i]["prompt_ids"]) + len(items[i]["choice_ids"][j]) for i, j in multi]
        morder = np.argsort(lens, kind="stable")
        for idx in _batches(morder, batch_size):
            pairs = [multi[k] for k in idx]
            seqs = [list(items[i]["prompt_ids"]) + list(items[i]["choice_ids"][j]) for i, j in pairs]
            ids, mask = _padded(seqs, pad_token_id)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            _check_width(logits, ids.shape[1])
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            tgt = ids[:, 1:].to(lp.device)
            tok_lp = lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).double().cpu().numpy()
            for row, (i, j) in enumerate(pairs):
                n_p, n_c = len(items[i]["prompt_ids"]), len(items[i]["choice_ids"][j])
                # logits at position t predict token t+1: the choice tokens n_p..n_p+n_c-1 read n_p-1..
                out[i][j] = tok_lp[row, n_p - 1 : n_p - 1 + n_c].sum()
    return out


def mc_accuracy(model, tokenizer, items: list[dict], batch_size: int = 8) -> dict:
    """Multiple-choice accuracy by answer likelihood.

    Args:
        model: a causal LM (see :func:`choice_logprobs`).
        tokenizer: its tokenizer; each choice string is tokenized on its own, without special tokens (the
            prompt is expected to end where the answer starts, e.g. after the chat template's generation
            prompt).
        items: dicts with ``prompt_ids`` (list[int]) or ``prompt`` (str, tokenized without special tokens),
            ``choices`` (list of continuation strings, e.g. ``["A", "B", "C", "D"]``) and ``gold`` (int index).
        batch_size: sequences per forward pass.

    Returns:
        ``{"accuracy": float in [0, 1], "items": int, "correct": int, "gold_prob": float (mean over items of
        the gold choice's probability renormalised over the choices), "predictions": list[int],
        "gold_probs": list[float]}``;
        accuracy and gold_prob are NaN when there are no items. Ties go to the first choice (``argmax``).

    Raises:
        ValueError: a gold index outside the choices, or what :func:`choice_logprobs` raises.
    """
    prepared = []
    for i, it in enumerate(items):
        gold = it["gold"]
        if isinstance(gold, bool) or not isinstance(gold, (int, np.integer)) or not 0 <= gold < len(it["choices"]):
            raise ValueError(f"item {i}: gold {gold!r} is not an index into its {len(it['choices'])} choices")
        p = it.get("prompt_ids")
        if p is None:
            p = tokenizer(it["prompt"], add_special_tokens=False)["input_ids"]
        prepared.append({"prompt_ids": list(p),
                         "choice_ids": [tokenizer(c, add_special_tokens=False)["input_ids"] for c in it["choices"]]})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores = choice_logprobs(model, prepared, batch_size=batch_size, pad_token_id=pad)
    return mc_result(scores, [it["gold"] for it in items])


def mc_result(scores: list[np.ndarray], golds: list[int]) -> dict:
    """:func:`mc_accuracy`'s summary from per-item choice scores (ties: the first choice)."""
    preds = [int(np.argmax(s)) for s in scores]
    correct = sum(int(p == g) for p, g in zip(preds, golds))
    gold_prob = [float(np.exp(s[g] - np.logaddexp.reduce(s))) for s, g in zip(scores, golds)]
    n = len(golds)
    return {"accuracy": correct / n if n else float("nan"), "items": n, "correct": correct,
            "gold_prob": float(np.mean(gold_prob)) if n else float("nan"), "predictions": preds,
            "gold_probs": gold_prob}


def generate_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 128,
                         batch_size: int = 8) -> list[str]:
    """Greedy completions of tokenized prompts (Hugging Face ``generate``, ``do_sample=False``).

    Prompts are left-padded in batches of similar length; generation stops at the tokenizer's EOS token
    (the chat template's end of turn for the demo model) or after ``max_new_tokens``.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer (pad and EOS ids; decoding skips special tokens).
        prompts: token ids per prompt (non-empty).
        max_new_tokens: cap on generated tokens per prompt (>= 1).
        batch_size: prompts per ``generate`` call.

    Returns:
        One decoded completion per prompt, in input order.

    Raises:
        ValueError: ``max_new_tokens < 1`` or an empty prompt.
    """
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    out: list[str] = [""] * len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    with _scoring(model):
        for idx in _batches(order, batch_size):
            b = collate([prompts[i] for i in idx], pad_token_id=int(pad), side="left")
            ids, mask = torch.from_numpy(b["input_ids"]), torch.from_numpy(b["attention_mask"])
            width = ids.shape[1]
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=int(max_new_tokens), pad_token_id=int(pad),
                                 eos_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
            texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
            for r, i in enumerate(idx):
                out[i] = texts[r]
    return out


def pass_at_1(model, tokenizer, problems: list[dict], max_new_tokens: int = 128, batch_size: int = 8,
              time_limit_s: float = 5.0, memory_mb: int = 1024, workers: int = 2) -> dict:
    """pass@1 with greedy decoding: generate one completion per problem, run it with the problem's tests in
    a separate resource-limited process (:func:`.codeexec.check_completions`), count the programs that exit 0.

    Args:
        model, tokenizer: see :func:`generate_completions`.
        problems: dicts with ``prompt_ids`` (list[int]), ``tests`` (str) and optional ``prefix`` (str).
        max_new_tokens, batch_size: generation settings.
        time_limit_s, memory_mb, workers: execution limits (see :func:`.codeexec.run_program`).

    Returns:
        ``{"pass_at_1": float (NaN without problems), "problems": int, "passed": int,
        "status": {status: count}, "statuses": list[str] (per problem), "completions": list[str],
        "stderrs": list[str] (per problem, the last 500 characters), "seconds_generate": float,
        "seconds_execute": float}``.
    """
    from .codeexec import check_completions

    t0 = time.perf_counter()
    comps = generate_completions(model, tokenizer, [p["prompt_ids"] for p in problems], max_new_tokens, batch_size) \
        if problems else []
    t1 = time.perf_counter()
    res = check_completions(comps, problems, time_limit_s=time_limit_s, memory_mb=memory_mb, workers=workers)
    t2 = time.perf_counter()
    status: dict[str, int] = defaultdict(int)
    for r in res:
        status[r["status"]] += 1
    n, passed = len(problems), status.get("passed", 0)
    return {"pass_at_1": passed / n if n else float("nan"), "problems": n, "passed": passed, "status": dict(status),
            "statuses": [r["status"] for r in res], "completions": comps,
            "stderrs": [r.get("stderr", "")[-500:] for r in res],
            "seconds_generate": round(t1 - t0, 3), "seconds_execute": round(t2 - t1, 3)}
