"""The evaluation stage: every held-out score of one model in one pass, and the evaluator the recipe calls
before and after training (a Ray task, so the driver stays light).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from ..config import JobConfig
from .metrics import choice_logprobs, heldout_loss, mc_result, pass_at_1
from .tasks import eval_tasks

__all__ = [
    "EvaluateOutput",
    "Evaluator",
    "evaluate_model_path",
    "evaluate_tasks",
    "ray_evaluator",
    "run",
    "write_samples",
]


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
        res = mc_result([np.asarray(have[t["example_id"]]) for t in mc], [t["gold"] for t in mc])
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
        model_path: the absolute Hugging Face folder the driver resolved, with its tokenizer (needed only with
            ``tasks``); a name such as ``demo`` raises ``ValueError`` (:func:`ray_cluster_ft.model.require_local_model`).
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

    from ..model import load_local_model, load_local_tokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    cuda = torch.cuda.is_available()
    # The absolute folder the driver resolved, read offline; bf16 weights straight onto the GPU.
    model = load_local_model(model_path, trust_remote_code=trust_remote_code,
                             dtype=torch.bfloat16 if cuda else torch.float32,
                             device_map={"": "cuda:0"} if cuda else None)
    tok = load_local_tokenizer(model_path, trust_remote_code) if tasks else None
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


Evaluator = Callable[[str, pa.Table, list], tuple]
"""``evaluator(model_path, examples, tasks) -> (metrics, samples)``: what :func:`run` calls to score a model;
``metrics`` as :func:`evaluate_model_path` returns them, ``samples`` its per-task records. The recipe takes
one (``run_pipeline(evaluator=...)``), so a benchmark can pass a memoising one."""


def ray_evaluator(cfg: JobConfig, pad_token_id: int) -> Evaluator:
    """The default :data:`Evaluator`: :func:`evaluate_model_path` in a Ray task (a GPU where the job trains on
    GPUs), so the driver stays light; generated code runs in separate, limited processes (:mod:`.codeexec`).

    Args:
        cfg: the job config (``evaluation`` limits, ``train.use_gpu``, ``model.trust_remote_code``).
        pad_token_id: the trained model's padding id.
    """

    def evaluate(model_path: str, examples: pa.Table, tasks: list) -> tuple:
        import ray

        threads = max(1, min(4, os.cpu_count() or 1))
        task = ray.remote(evaluate_model_path).options(
            num_cpus=1, num_gpus=1 if cfg.train.use_gpu else 0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}})
        ev = cfg.evaluation
        return ray.get(task.remote(model_path, examples, 8, pad_token_id, cfg.model.trust_remote_code, threads,
                                   tasks=tasks, max_new_tokens=ev.max_new_tokens, time_limit_s=ev.time_limit_s,
                                   exec_workers=1, with_samples=True))

    return evaluate


def write_samples(path: Path, samples: list[dict]) -> None:
    """Write :func:`evaluate_tasks`' per-task records to ``path``, one JSON object per line."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in samples)


@dataclass(frozen=True)
class _Scoring:
    """One scoring pass of the evaluation stage.

    Attributes:
        model_path: the model folder to score (the base model before training, ``final_model`` after).
        examples: the held-out rows (:data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`).
        tasks: :func:`eval_tasks`' multiple-choice items and code problems of those rows.
        when: ``"before"`` or ``"after"`` (training): names the artifacts.
        evaluator: the :data:`Evaluator` to call.
        resume: ``before`` only: read back the scores of a stopped run instead of scoring again
            (``eval_before.json``; for a file, ``eval_before_file<i>.json`` when its key is unchanged).
        name: ``""`` for the held-out split of the training sources; ``file<i>`` for the i-th
            ``evaluation.paths`` file (its own samples file and scores file).
        settings: what else decides a file's scores (the ``evaluation`` settings but ``paths``), in its key.
    """

    model_path: str | None
    examples: pa.Table
    tasks: list
    when: str
    evaluator: Evaluator
    resume: bool = False
    name: str = ""
    settings: dict = field(default_factory=dict)


def _score(run_dir: Path, inputs: _Scoring) -> dict:
    """Score ``inputs.model_path`` on ``inputs.examples``.

    Writes ``eval_{when}[_file<i>]_samples.jsonl`` (one record per scored task) and, before training, the scores:
    ``eval_before.json`` for the held-out split, ``eval_before_file<i>.json`` for a file (with its key, a SHA-256
    of the rows, the tasks, the ``evaluation`` settings and the model path). ``resume`` reads them back, so a
    resumed run compares against the same base scores; a file's only while its key is unchanged (a file edited or
    settings changed in between are scored again), and a file that cannot be read is scored again.

    Returns:
        The metrics (``{}`` when nothing is held out or there is no model to score).
    """
    from ..rundir import claim

    suffix = f"_{inputs.name}" if inputs.name else ""
    cached = run_dir / f"eval_before{suffix}.json" if inputs.when == "before" else None
    # A file's scores are kept with a key: a resumed run reads the file and the config again, either may have changed.
    key = _scoring_key(inputs) if cached is not None and inputs.name else None
    if inputs.resume and cached is not None and cached.exists():
        try:
            kept = json.loads(cached.read_text())
        except ValueError:
            kept = None
        if kept is not None and not inputs.name:
            return kept
        if isinstance(kept, dict) and kept.get("key_sha256") == key:
            return kept["metrics"]
    samples_file = f"eval_{inputs.when}{suffix}_samples.jsonl"
    # The scores are written whole to a .tmp, then renamed: a run killed meanwhile leaves no half file to read back.
    claim(run_dir, samples_file, *([cached.name, cached.name + ".tmp"] if cached is not None else []))
    metrics: dict = {}
    if inputs.examples.num_rows and inputs.model_path:
        metrics, samples = inputs.evaluator(inputs.model_path, inputs.examples, inputs.tasks)
        write_samples(run_dir / samples_file, samples)
    if cached is not None:
        kept = metrics if not inputs.name else {"key_sha256": key, "metrics": metrics}
        tmp = cached.with_name(cached.name + ".tmp")
        tmp.write_text(json.dumps(kept, default=float))
        os.replace(tmp, cached)
    return metrics


def _scoring_key(inputs: _Scoring) -> str:
    """SHA-256 of what decides a scoring pass's result: the rows (as an Arrow IPC stream, so equal for the same
    rows read again), the tasks (the file's own task fields: ``tests``, ``gold``, ...), ``inputs.settings`` and
    the model path."""
    import hashlib

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, inputs.examples.schema) as writer:
        writer.write_table(inputs.examples.combine_chunks())
    h = hashlib.sha256(sink.getvalue().to_pybytes())
    h.update(json.dumps([inputs.tasks, inputs.settings, inputs.model_path], sort_keys=True, default=str).encode())
    return h.hexdigest()


def _score_files(cfg: JobConfig, run_dir: Path, files: dict, model_path: str | None, when: str,
                 evaluator: Evaluator, resume: bool = False) -> dict:
    """Score ``model_path`` on every ``evaluation.paths`` file (``files``: path -> its
    :class:`~ray_cluster_ft.data.DataResult`, all rows in ``train``), each with its own tasks and
    ``eval_{when}_file<i>_samples.jsonl``; with ``resume``, a file whose key is unchanged keeps its
    ``eval_before_file<i>.json`` scores (:func:`_score`).

    Returns:
        ``{path: metrics}`` (as :func:`_score` returns them).
    """
    from ..config import DataConfig

    ev = cfg.evaluation
    out = {}
    for i, (path, res) in enumerate(files.items()):
        table = res.train
        tasks = eval_tasks(DataConfig(source="files", paths=[path]), table, max_mc=ev.max_mc,
                           max_code=ev.max_code) if table.num_rows else []
        out[path] = _score(run_dir, _Scoring(model_path, table, tasks, when, evaluator, resume, name=f"file{i}",
                                             settings=ev.model_dump(mode="json", exclude={"paths"})))
    return out


@dataclass(frozen=True)
class EvaluateOutput:
    """What the evaluation stage hands on.

    Attributes:
        when: ``"before"`` or ``"after"`` (training).
        metrics: the held-out split's scores (``{}`` when nothing is held out or there is no model): the
            manifest's ``eval.before`` / ``eval.after``.
        files: ``{path: metrics}`` per ``evaluation.paths`` file (the manifest's ``eval_files``).
    """

    when: str
    metrics: dict
    files: dict

    @property
    def summary(self) -> dict:
        """The manifest's ``eval.<when>`` entry: :attr:`metrics`."""
        return self.metrics


def run(cfg: JobConfig, run_dir: Path, *, model_path: str | None, examples: pa.Table, tasks: list, when: str,
        evaluator: Evaluator, eval_files: dict | None = None, resume: bool = False) -> EvaluateOutput:
    """The evaluation stage: score ``model_path`` on the held-out rows, then on every ``evaluation.paths`` file.

    Args:
        cfg: the job config (``evaluation`` limits).
        run_dir: the run directory (``eval_{when}*_samples.jsonl``, ``eval_before.json``,
            ``eval_before_file<i>.json``).
        model_path: the model folder to score (the base model before training, ``final_model`` after); None
            scores nothing.
        examples: the held-out rows (:data:`ray_cluster_ft.data.EXAMPLE_SCHEMA`).
        tasks: :func:`eval_tasks`' multiple-choice items and code problems of those rows.
        when: ``"before"`` or ``"after"`` (training): names the artifacts.
        evaluator: the :data:`Evaluator` to call.
        eval_files: per ``evaluation.paths`` file its rows (:class:`~ray_cluster_ft.data.DataResult`, all in
            ``train``); None for none.
        resume: ``before`` only: read back the base model's scores of a stopped run instead of scoring again:
            the held-out split's ``eval_before.json``, and each file's ``eval_before_file<i>.json`` where its
            rows, tasks, ``evaluation`` settings and model are the same (else it is scored again; see ``_score``).

    Returns:
        :class:`EvaluateOutput`.
    """
    metrics = _score(run_dir, _Scoring(model_path, examples, tasks, when, evaluator, resume))
    files = _score_files(cfg, run_dir, eval_files or {}, model_path, when, evaluator, resume)
    return EvaluateOutput(when, metrics, files)
