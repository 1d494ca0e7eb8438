"""The issue-7 side-by-side (kept as it ran; bench/end_to_end.py is the issue-31 quality benchmark): the published method (CluSTER) vs ours vs random and full data, on one model.

One model (the demo SmolLM2-135M-Instruct), one candidate pool, the same epochs and hyper-parameters for every
arm; each arm is one ``ray_cluster_ft.run_pipeline`` run that differs only in its selection, allocation, sketch
and loss-weighting settings:

=====================  ==========================================  =========  ================  ==========
arm                    what                                        selection  allocation        sketch
=====================  ==========================================  =========  ================  ==========
paper                  the published method (``preset: cluster-paper``: last-layer proxy, k = W, equalize,
                       cluster r on rank r, loss weighted)
ours                   the project's default method, weighted      balanced   cluster           gradient
ours_unweighted        the same, ``train.loss_weighting: none``    balanced   cluster           gradient
random_subset          random subset, as many rows as ``ours``     random     random            (none)
full                   all candidates (= ``full_random``)          full       random            (none)
full_random            1. the conventional baseline                full       random            (none)
balanced_cluster       3. the method (loss weighting by default)   balanced   cluster           gradient
balanced_random        ablation: selection only                    balanced   random            gradient
full_cluster           ablation: allocation only                   full       cluster           gradient
full_length            ablation: group by length                   full       length            (none)
embedding              ablation: embedding sketches                balanced   cluster           embedding
balanced_cluster_bf16  3 with a bf16 sketch                        balanced   cluster           gradient, bf16
full_packed            the strongest conventional baseline: all    full       random, packed    (none)
                       data packed in random order (TRL
                       ``packing=True``, axolotl sample packing)
ours_packed            ours with packed micro-batches, weighted    balanced   cluster, packed   gradient
=====================  ==========================================  =========  ================  ==========

The packed arms set ``allocation.packing: true`` and ``train.max_tokens_per_micro_batch = --micro-batch x
--max-seq-len`` (1,536 tokens in the paper setup): a pack may hold what a padded micro-batch could hold at most,
so the packed and padded arms train with the same activation memory per micro-batch, and a pack of short rows
carries more examples instead of padding.

Two data setups (``--setup``):

* ``paper`` (default): a pool of ``--examples`` rows from each of MedQuAD (whole documents, so a disease's
  templated questions come together, as in the source), GPTeacher codegen and MBPP (``train`` +
  ``validation`` + ``prompt`` splits only), read from ``../shared/data``; nothing of it is held out
  (``data.eval_fraction: 0``). Held out through ``evaluation.paths``, never sketched, selected or trained on:
  ``--eval-rows`` rows each of MBPP's ``test`` split (tasks 11-510; pass@1 and loss), HumanEval (pass@1) and
  MMLU-medical (MC accuracy) from the demo packages, and MedQuAD rows of documents not in the pool (loss).
  At most 384 tokens (longer rows truncated), 2 epochs, W = 2, seeds 0 and 1.
* ``demo-mix`` (the earlier setup): ``--examples`` rows from each of HumanEval, MMLU-medical, MBPP and MedQuAD,
  30% of them held out by the data stage.

The loss of the gaps (``loss_metric`` in the JSON): with ``evaluation.paths``, the token-weighted mean
response-token loss over all evaluation files (each file's ``all.loss`` weighted by its ``all.tokens``);
without, the held-out split's ``all`` loss. Gaps and ratios are taken per seed against the same seed's
``full`` (or ``full_random``) arm, then averaged.

Evaluation runs through :func:`ray_cluster_ft.evaluate.evaluate_model_path` with the tasks the pipeline finds
(``evaluation.max_mc`` / ``max_code`` per file); the benchmark passes its own evaluator to
``run_pipeline(evaluator=...)``, which memoises each (model, rows) result, so the base model's evaluation
(``evaluate_before``, the same for every arm of a seed) runs once. Ray is started once for all arms.

Figures per arm: time per stage (``manifest["timings_s"]``), end-to-end time = the pipeline's total minus
its two evaluation stages (data + sketch + cluster + select + allocate + train), the selection pass
(sketch + cluster + select + allocate), the sum of optimizer-step times (``train_log.jsonl``; the train
stage also holds the workers' start-up), tokens trained (the plan's ``n_tokens`` over all epochs) and padded
tokens (``train_log.jsonl``), held-out metrics per domain and per evaluation file after training. Mean and
spread (sample standard deviation) over ``--seeds``.

Writes ``OUT/report.md`` (tables, ``metric_vs_time.png``, ``loss_curves.png``), ``OUT/bench.json`` (every
figure) and the summary ``bench/results/end_to_end.json`` (``--results``; ``--quick`` writes it into OUT
instead). The last printed line is the summary as one JSON object.

Usage::

    python bench/paper_setup.py                       # paper setup: 5 arms x seeds 0 1 (hours on 2 CPU cores)
    python bench/paper_setup.py --setup demo-mix      # the earlier setup, all its arms, seed 0 (60-70 min)
    python bench/paper_setup.py --quick               # smoke run: tiny sizes, 1 epoch, seed 0
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench import _common  # noqa: E402  (after the path insert)
from bench._data import (  # noqa: E402
    demo_rows as _demo_rows,
    load_average,
    machine_info,
    medquad_split as _medquad_split,
    read_shared as _read_shared,
    sample as _sample,
    shared_data_dir,
    write_jsonl as _write_jsonl,
)

ARMS = {
    # name: (label, selection.strategy, allocation.strategy, sketch.method); None = what the arm's preset sets
    "paper": ("published CluSTER (preset cluster-paper)", None, None, "last_layer"),
    "ours": ("ours: balanced, cluster allocation, weighted", "balanced", "cluster", "gradient"),
    "ours_unweighted": ("ours, unweighted loss", "balanced", "cluster", "gradient"),
    "random_subset": ("random subset (ours' count), random allocation", "random", "random", None),
    "full": ("full data, random allocation", "full", "random", None),
    "full_random": ("1 full data, random allocation", "full", "random", None),
    "balanced_cluster": ("3 balanced selection, cluster allocation", "balanced", "cluster", "gradient"),
    "balanced_random": ("balanced selection, random allocation", "balanced", "random", "gradient"),
    "full_cluster": ("full data, cluster allocation", "full", "cluster", "gradient"),
    "full_length": ("full data, grouped by length", "full", "length", None),
    "embedding": ("balanced (embedding sketches), cluster allocation", "balanced", "cluster", "embedding"),
    "balanced_cluster_bf16": ("3 with the sketch under bf16 autocast", "balanced", "cluster", "gradient"),
    "full_packed": ("full data, random order, packed", "full", "random", None),
    "ours_packed": ("ours, packed micro-batches", "balanced", "cluster", "gradient"),
}
# Config keys an arm sets beyond its selection/allocation/sketch method (merged over the shared settings).
# bf16 autocast is what `sketch.dtype: auto` does on CUDA; on a CPU with native bf16 (AVX512-BF16, AMX) it
# sketches several times faster than fp32.
ARM_OVERRIDES = {
    "paper": {"preset": "cluster-paper"},
    "ours": {"train": {"loss_weighting": "cluster"}},
    "ours_unweighted": {"train": {"loss_weighting": "none"}},
    "balanced_cluster_bf16": {"sketch": {"dtype": "bfloat16"}},
    # train.max_tokens_per_micro_batch is set by arm_config from --micro-batch x --max-seq-len.
    "full_packed": {"allocation": {"packing": True}},
    "ours_packed": {"allocation": {"packing": True}, "train": {"loss_weighting": "cluster"}},
}
# Arms that are the same run under two names: the second one requested copies the first one's figures.
ALIASES = {"full": "full_random", "full_random": "full"}
# The order arms run in: the method before the arms that take its selected count or its sketch shards.
RUN_ORDER = ["full", "full_random", "full_packed", "ours", "ours_packed", "balanced_cluster", "ours_unweighted",
             "random_subset", "paper", "balanced_random", "full_cluster", "full_length", "embedding",
             "balanced_cluster_bf16"]
PACKED_BASE = "full_packed"  # the baseline of the *_packed ratios
SETUPS = {
    "paper": {"arms": ["paper", "ours", "ours_unweighted", "random_subset", "full"], "seeds": [0, 1],
              "examples": 224, "epochs": 2, "max_seq_len": 384, "eval_fraction": 0.0, "max_eval": 0,
              "eval_rows": 100, "max_mc": 100, "max_code": 16, "max_new_tokens": 128},
    "demo-mix": {"arms": ["full_random", "random_subset", "balanced_cluster", "balanced_random", "full_cluster",
                          "full_length", "embedding", "balanced_cluster_bf16"], "seeds": [0],
                 "examples": 32, "epochs": 3, "max_seq_len": 512, "eval_fraction": 0.3, "max_eval": 48,
                 "eval_rows": 0, "max_mc": 32, "max_code": 8, "max_new_tokens": 128},
}
QUICK = {"paper": {"seeds": [0], "examples": 24, "epochs": 1, "eval_rows": 12, "max_code": 2, "max_new_tokens": 32},
         "demo-mix": {"examples": 12, "epochs": 1, "max_eval": 12, "max_code": 2, "max_new_tokens": 32}}
STAGES = ["data", "sketch", "cluster", "select", "allocate", "evaluate_before", "train", "evaluate_after", "total"]
SELECTION_PASS = ["sketch", "cluster", "select", "allocate"]
TASK_METRICS = ("loss", "mc_accuracy", "pass_at_1")




# --------------------------------------------------------------------------- data










def write_data(out_dir: Path, examples: int, seed: int = 0) -> list[str]:
    """``--setup demo-mix``: one JSONL file per source (``examples`` rows each) in ``out_dir``; their paths.

    Demo rows get their task fields (:func:`ray_cluster_ft.evaluate.demo_eval_fields`); MBPP and MedQuAD rows
    are copied as they are (MBPP already has ``tests``). MBPP's ``test`` split (task ids 11-510) is left out,
    as its README asks of anyone reporting MBPP scores.

    Raises:
        FileNotFoundError: the shared data folder lacks mbpp.jsonl or medquad.jsonl.
    """
    by_source = _demo_rows(examples, seed)
    for name in ("mbpp", "medquad"):
        rows = _read_shared(name)
        if name == "mbpp":
            rows = [r for r in rows if r.get("split") != "test"]
        by_source[name] = _sample(rows, examples, seed)
    return [_write_jsonl(out_dir / f"{name}.jsonl", rows) for name, rows in by_source.items()]




def write_paper_data(out_dir: Path, examples: int, eval_rows: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``--setup paper``: the candidate pool files and the held-out evaluation files; ``(pool, eval)`` paths.

    Pool (``examples`` rows from each source): MedQuAD (whole documents, so the templated questions of one
    focus come together, as in the source and in practice), GPTeacher codegen, MBPP ``train`` +
    ``validation`` + ``prompt``. Evaluation files (``eval_rows`` rows each; ``evaluation.paths``): MBPP
    ``test`` (tasks 11-510, with ``tests``), HumanEval and MMLU-medical from the demo packages (with their task
    fields), MedQuAD rows of documents not in the pool.

    Raises:
        FileNotFoundError: the shared data folder lacks one of the files.
    """
    med_pool, med_eval = _medquad_split(_read_shared("medquad"), examples, eval_rows, seed)
    mbpp = _read_shared("mbpp")
    pool = {"medquad": med_pool,
            "gpteacher_codegen": _sample(_read_shared("gpteacher_codegen"), examples, seed),
            "mbpp": _sample([r for r in mbpp if r.get("split") != "test"], examples, seed)}
    demo = _demo_rows(None, seed)
    held = {"mbpp_test": _sample([r for r in mbpp if r.get("split") == "test"], eval_rows, seed),
            "humaneval": _sample(demo["humaneval"], eval_rows, seed),
            "mmlu_medical": _sample(demo["mmlu-medical"], eval_rows, seed),
            "medquad_heldout": med_eval}
    pool_paths = [_write_jsonl(out_dir / f"{name}.jsonl", rows) for name, rows in pool.items()]
    eval_paths = [_write_jsonl(out_dir / "eval" / f"{name}.jsonl", rows) for name, rows in held.items()]
    return pool_paths, eval_paths


def file_name(path: str) -> str:
    """The short name of an evaluation file in the figures (its stem)."""
    return Path(path).stem


# --------------------------------------------------------------------------- configs


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def aligned_budget(args, seed: int, paths: list[str]) -> tuple[int, int]:
    """(examples to select, candidates): ``--budget`` of the candidates, rounded to the nearest multiple of one
    optimizer step (workers x micro-batch), at least one step.

    The plan keeps only whole steps; a budget of 23 with steps of 8 would train 16 (a 30% cut of the subset
    arms alone), so the subset arms ask for a whole number of steps. Reads the data once, as the arms will
    (only the ``data`` section is validated, so an arm whose other keys this version lacks is still skipped
    by :func:`run_arm` with its reason).
    """
    from ray_cluster_ft.config import DataConfig
    from ray_cluster_ft.data import load_examples
    from ray_cluster_ft.model import load_tokenizer

    raw = arm_config("full_random", args, seed, paths, [], Path(args.out) / "_probe")
    n = load_examples(DataConfig(**raw["data"]), load_tokenizer(args.model)).train.num_rows
    unit = args.workers * args.micro_batch
    want = args.budget * n if args.budget <= 1 else args.budget
    return int(min(max(unit, round(want / unit) * unit), n)), n


def arm_config(arm: str, args, seed: int, paths: list[str], eval_paths: list[str], run_dir: Path,
               budget: float | None = None) -> dict:
    """The job config of one arm: everything but selection/allocation/sketch method (and the arm's
    :data:`ARM_OVERRIDES`) is shared. An arm with a ``preset`` gets only the shared settings and the seeds, so
    the preset decides its method.

    ``budget``: the selection budget (a count from :func:`aligned_budget`; default ``--budget``)."""
    _, sel, alloc, method = ARMS[arm]
    over = ARM_OVERRIDES.get(arm, {})
    preset = "preset" in over
    sketch = {"seed": seed, "batch_size": 8}
    if not preset:
        sketch.update(last_blocks=4, k_in=16, k_out=16, dim=256)
        if method is not None:
            sketch["method"] = method
    evaluation = {"max_mc": args.max_mc, "max_code": args.max_code, "max_new_tokens": args.max_new_tokens,
                  "time_limit_s": args.time_limit}
    if eval_paths:
        evaluation["paths"] = list(eval_paths)
    cfg = {
        "data": {"source": "files", "paths": paths, "limit": args.examples if args.setup == "demo-mix" else None,
                 "max_seq_len": args.max_seq_len, "overlong": "truncate", "eval_fraction": args.eval_fraction,
                 "max_eval": args.max_eval, "seed": seed},
        "model": {"path": args.model},
        "sketch": sketch,
        "clustering": {"seed": seed} if preset else {"k": "auto", "seed": seed},
        "selection": {"seed": seed} if preset else
        {"strategy": sel, "budget": args.budget if budget is None else budget, "seed": seed},
        "allocation": {"seed": seed} if preset else {"strategy": alloc, "seed": seed, "packing": False},  # as the arms ran (packing: auto is the default since)
        "train": {"num_workers": args.workers, "use_gpu": False, "zero_stage": 2, "micro_batch_size": args.micro_batch,
                  "grad_accum": 1, "epochs": args.epochs, "lr": args.lr, "warmup_steps": 2, "seed": seed},
        "evaluation": evaluation,
        "output": {"dir": str(run_dir), "save_model": True},
    }
    cfg = _merge(cfg, over)
    if cfg["allocation"].get("packing"):
        # A pack holds at most what a padded micro-batch of the same arm could (see the module docstring).
        cfg["train"].setdefault("max_tokens_per_micro_batch", args.micro_batch * args.max_seq_len)
    return cfg


# --------------------------------------------------------------------------- evaluation


def make_evaluator(args, cache: dict):
    """A memoising :data:`ray_cluster_ft.evaluate.Evaluator` with the benchmark's task limits; ``cache`` is shared
    by every arm, so the base model of a seed is evaluated once per set of rows. Returns ``evaluator_for(cfg)``.

    It scores the tasks the pipeline passes (the held-out split's, or one ``evaluation.paths`` file's, found
    with ``evaluation.max_mc`` / ``max_code``)."""
    import ray

    from ray_cluster_ft.evaluate import evaluate_model_path

    def evaluator_for(cfg):
        from ray_cluster_ft.model import load_tokenizer

        pad = int(load_tokenizer(cfg.model.path, cfg.model.trust_remote_code).pad_token_id)

        def evaluate(model_path, table, tasks):
            key = (str(model_path), tuple(table.column("example_id").to_pylist()),
                   tuple((t["example_id"], t["kind"]) for t in tasks))
            if key in cache:
                print(f"[bench] evaluation of {model_path} on {table.num_rows} rows reused", flush=True)
            else:
                task = ray.remote(evaluate_model_path).options(
                    num_cpus=1, num_gpus=1 if cfg.train.use_gpu else 0,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.eval_threads)}})
                cache[key] = ray.get(task.remote(model_path, table, 8, pad, cfg.model.trust_remote_code,
                                                 args.eval_threads, tasks=tasks, max_new_tokens=args.max_new_tokens,
                                                 time_limit_s=args.time_limit, exec_workers=1, with_samples=True))
            return copy.deepcopy(cache[key])

        return evaluate

    return evaluator_for


def files_loss(files: dict) -> float:
    """Token-weighted mean response-token loss over evaluation files (``{name: metrics}``, each with
    ``all.loss`` and ``all.tokens``); NaN without any."""
    num = den = 0.0
    for m in files.values():
        a = (m or {}).get("all", {})
        if a.get("tokens") and a.get("loss") is not None and math.isfinite(a["loss"]):
            num += float(a["loss"]) * float(a["tokens"])
            den += float(a["tokens"])
    return num / den if den else float("nan")


# --------------------------------------------------------------------------- one arm


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _seed_sketches(run_dir: Path, cfg, donor_dir: Path) -> None:
    """Put a copy of ``donor_dir``'s sketch shards into ``run_dir`` as shards a run there wrote: prepare the
    folder as a run directory, claim ``sketches`` in its ledger, copy. A fresh run keeps them
    (``rundir._KEPT_ON_FRESH_RUN``); a folder holding anything else no run wrote stops here with its reason."""
    from ray_cluster_ft.rundir import claim, input_paths, prepare_run_dir

    prepare_run_dir(run_dir, False, input_paths(cfg))
    shutil.rmtree(run_dir / "sketches", ignore_errors=True)
    claim(run_dir, "sketches")
    shutil.copytree(donor_dir / "sketches", run_dir / "sketches")


def run_arm(arm: str, args, seed: int, paths: list[str], eval_paths: list[str], out: Path,
            budget: float | None = None, sketch_donor: dict | None = None, evaluator_for=None) -> dict:
    """Run one arm; returns its figures (or ``{"error": ...}``, ``{"skipped": reason}``).

    ``sketch_donor``: the figures of the same seed's ``ours`` (or ``balanced_cluster``) arm. A gradient-sketch
    arm with the same sketch settings then starts from a copy of its sketch shards (the same data, model, seed
    and sketch settings give the same shards, which the pipeline reuses), so the benchmark sketches once per
    seed; the donor's sketch time is charged to the arm's selection pass and end-to-end time, as if it had
    sketched itself.
    """
    import pandas as pd

    from ray_cluster_ft.config import ConfigError, parse_config
    from ray_cluster_ft import run_pipeline

    run_dir = out / f"seed{seed}" / arm
    try:
        cfg = parse_config(arm_config(arm, args, seed, paths, eval_paths, run_dir, budget))
    except ConfigError as err:
        reason = str(err).replace("\n", " ")
        print(f"[bench] skipping arm {arm}: its config is not accepted by this version ({reason})", flush=True)
        return {"skipped": reason}
    # Shards an interrupted earlier attempt of this arm left would be reused and shorten its timed sketch stage:
    # an arm that runs (none of its figures were kept) sketches from nothing, or from the donor's shards.
    shutil.rmtree(run_dir / "sketches", ignore_errors=True)
    reuse = (sketch_donor is not None and ARMS[arm][3] == "gradient" and "sketch" not in ARM_OVERRIDES.get(arm, {})
             and "timings_s" in sketch_donor)
    if reuse:
        try:
            _seed_sketches(run_dir, cfg, Path(sketch_donor["run_dir"]))
        except (ConfigError, OSError) as err:
            print(f"[bench] arm {arm}: sketch shards not copied ({err}); it sketches itself", flush=True)
            reuse = False
    print(f"[bench] ===== seed {seed} arm {arm}: {ARMS[arm][0]}", flush=True)
    t0 = time.perf_counter()
    try:
        manifest = run_pipeline(cfg, evaluator=evaluator_for(cfg) if evaluator_for else None)
    except Exception as err:  # noqa: BLE001 - one failed arm must not lose the others' figures
        print(f"[bench] arm {arm} failed: {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {err}"}
    wall = time.perf_counter() - t0
    t = {k: float(manifest["timings_s"].get(k, 0.0)) for k in STAGES}
    own_sketch_s = t["sketch"]
    if reuse:
        if manifest.get("sketch", {}).get("computed", 1) != 0:
            print(f"[bench] arm {arm}: the copied sketch shards were not reused; its own sketch time stands",
                  flush=True)
            reuse = False
        else:
            extra = sketch_donor["timings_s"]["sketch"] - own_sketch_s
            t["sketch"] += extra
            t["total"] += extra
    plan = pd.read_parquet(run_dir / "plan.parquet")
    log = _read_jsonl(run_dir / "train_log.jsonl")
    padded = int(sum(r["padded_tokens"] for r in log))
    real_logged = int(sum(r["tokens"] for r in log))
    ef = manifest.get("eval_files", {})
    files_before = {file_name(p): v.get("before", {}) for p, v in ef.items()}
    files_after = {file_name(p): v.get("after", {}) for p, v in ef.items()}
    after = manifest["eval"]["after"]
    if not args.keep_models:
        # The trained model and the Ray Train checkpoints (weights + optimizer state) take ~2.5 GB per arm; the
        # figures are read, the evaluation is done.
        for sub in ("final_model", "ray_train"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    return {
        "timings_s": t,
        "wall_s": wall,
        "e2e_s": t["total"] - t["evaluate_before"] - t["evaluate_after"],
        "selection_pass_s": sum(t[k] for k in SELECTION_PASS),
        "sketch_reused": bool(reuse),
        "own_sketch_s": own_sketch_s,
        "step_time_s": float(sum(r["step_time_s"] for r in log)),
        "steps": len(log),
        "selected": int(manifest["counts"]["selected"]),
        "candidates": int(manifest["counts"]["candidates"]),
        "held_out": int(manifest["counts"]["held_out"]),
        "tokens_trained": int(plan["n_tokens"].sum()),
        "tokens_logged": real_logged,
        "padded_tokens": padded,
        "padding_fraction": 1.0 - real_logged / padded if padded else float("nan"),
        "k": manifest.get("clustering", {}).get("k"),
        "loss_weighting": manifest.get("config", {}).get("train", {}).get("loss_weighting"),
        "eval_before": manifest["eval"]["before"],
        "eval_after": after,
        "eval_files_before": files_before,
        "eval_files_after": files_after,
        "eval_files_overlap": {file_name(p): v.get("overlap_with_candidates") for p, v in ef.items()},
        # The loss of the gaps: over the evaluation files when there are any, else the held-out split's.
        "heldout_loss": files_loss(files_after) if files_after else _metric({"eval_after": after}, "all", "loss"),
        "heldout_loss_before": files_loss(files_before) if files_before else
        _metric({"eval_after": manifest["eval"]["before"]}, "all", "loss"),
        "loss_curve": [[r["step"], r["loss"], r["step_time_s"]] for r in log],
        "run_dir": str(run_dir),
    }


# --------------------------------------------------------------------------- summary


def _metric(res: dict, domain: str, key: str) -> float:
    v = res.get("eval_after", {}).get(domain, {}).get(key, float("nan"))
    return float("nan") if v is None else float(v)


def _file_metric(res: dict, name: str, key: str) -> float:
    v = res.get("eval_files_after", {}).get(name, {}).get("all", {}).get(key, float("nan"))
    return float("nan") if v is None else float(v)


def _ms(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _ran(res: dict | None) -> bool:
    return bool(res) and "timings_s" in res


def arm_key(arm: str, args, seed: int, paths: list[str], eval_paths: list[str], out: Path, budget) -> str:
    """What an arm's figures depend on: its job config, the evaluation settings and the package's code. A kept
    result (``--resume``) is used only when this key matches, so a changed flag or package runs the arm again."""
    cfg = arm_config(arm, args, seed, paths, eval_paths, out / f"seed{seed}" / arm, budget)
    # The package's tree hash, not HEAD: a commit that changes only the benchmark's summary keeps the arms' runs.
    code = subprocess.run(["git", "rev-parse", "HEAD:ray_cluster_ft"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    return json.dumps({"config": cfg, "package_tree": code, "reuse_sketches": args.reuse_sketches}, sort_keys=True,
                      default=str)


def _arm_file(out: Path, seed: int, arm: str) -> Path:
    # Beside, not inside, the arm's run directory: a fresh run there may remove what no run of it wrote.
    return out / f"seed{seed}" / f"{arm}.bench.json"


def read_arm(out: Path, seed: int, arm: str, key: str) -> dict | None:
    """The figures an earlier benchmark run kept for this arm and seed, or None (none, other key, unreadable)."""
    try:
        kept = json.loads(_arm_file(out, seed, arm).read_text())
    except (OSError, ValueError):
        return None
    return kept["figures"] if kept.get("key") == key and _ran(kept.get("figures")) else None


def write_arm(out: Path, seed: int, arm: str, key: str, figures: dict) -> None:
    path = _arm_file(out, seed, arm)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "figures": _clean(figures)}, default=str))
    tmp.replace(path)


def base_run(seed_results: dict, fallback: dict | None = None) -> dict:
    """The full-data baseline of one seed: ``full``, else ``full_random``; where the seed ran neither (the issue
    asks for 2 seeds of every *subset* arm, and the full arm is the costliest), ``fallback``: the first seed's."""
    own = next((seed_results[a] for a in ("full", "full_random") if _ran(seed_results.get(a))), {})
    return own or (fallback or {})


def summarise(results: dict, arms: list[str], seeds: list[int], domains: list[str], files: list[str]) -> dict:
    """Per arm: mean and spread over seeds of each figure, and its ratios to the full-data arm (per seed, then
    averaged); ``loss_gap`` = held-out loss ratio - 1."""
    summary = {}
    for arm in arms:
        runs = [results[s][arm] for s in seeds if _ran(results[s].get(arm))]
        if not runs:
            summary[arm] = {"runs": 0, "status": next((results[s][arm] for s in seeds if arm in results[s]), {})}
            continue
        row = {"runs": len(runs), "seeds": [s for s in seeds if _ran(results[s].get(arm))]}
        for key in ("e2e_s", "selection_pass_s", "step_time_s", "steps", "selected", "candidates", "tokens_trained",
                    "padded_tokens", "padding_fraction", "wall_s", "heldout_loss"):
            row[key] = _ms([r.get(key) for r in runs])
        for st in STAGES:
            row["t_" + st] = _ms([r["timings_s"][st] for r in runs])
        for d in domains:
            for key in TASK_METRICS:
                row[f"{key}_{d}"] = _ms([_metric(r, d, key) for r in runs])
        for f in files:
            for key in TASK_METRICS:
                row[f"file_{f}_{key}"] = _ms([_file_metric(r, f, key) for r in runs])
        first = next((base_run(results[s]) for s in seeds if base_run(results[s])), {})
        base = [base_run(results[s], first) for s in row["seeds"]]
        for name, num in (("train_ratio", lambda r: r["timings_s"]["train"]), ("e2e_ratio", lambda r: r["e2e_s"]),
                          ("step_time_ratio", lambda r: r["step_time_s"]),
                          ("loss_ratio", lambda r: r["heldout_loss"])):
            row[name] = _ms([num(r) / num(b) if _ran(b) and num(b) else float("nan") for r, b in zip(runs, base)])
        m, s = row["loss_ratio"]
        row["loss_gap"] = (m - 1, s)
        # The same ratios against the packed baseline (full_packed of the same seed, else the first seed's).
        pfirst = next((results[s][PACKED_BASE] for s in seeds if _ran(results[s].get(PACKED_BASE))), {})
        pbase = [results[s][PACKED_BASE] if _ran(results[s].get(PACKED_BASE)) else pfirst for s in row["seeds"]]
        for name, num in (("train_ratio_packed", lambda r: r["timings_s"]["train"]),
                          ("e2e_ratio_packed", lambda r: r["e2e_s"]), ("loss_ratio_packed", lambda r: r["heldout_loss"])):
            row[name] = _ms([num(r) / num(b) if _ran(b) and num(b) else float("nan") for r, b in zip(runs, pbase)])
        m, s = row["loss_ratio_packed"]
        row["loss_gap_packed"] = (m - 1, s)
        summary[arm] = row
    return summary


def _fmt(ms: tuple[float, float], digits: int = 3, pct: bool = False) -> str:
    m, s = ms
    if not np.isfinite(m):
        return "n/a"
    if pct:
        return f"{100 * m:.1f}%" + (f" ± {100 * s:.1f}" if s else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s else "")


def _has(summary: dict, arms: list[str], key: str) -> bool:
    return any(summary[a]["runs"] and np.isfinite(summary[a].get(key, (np.nan,))[0]) for a in arms)


def write_report(out: Path, args, summary: dict, results: dict, arms: list[str], seeds: list[int], domains: list[str],
                 files: list[str], figures: dict, machine: dict) -> Path:
    """report.md with the tables and two PNGs (held-out metrics vs end-to-end time; training loss curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [a for a in arms if summary[a]["runs"]]
    if args.setup == "paper":
        data_line = (f"Setup `paper`: a pool of {args.examples} rows from each of MedQuAD (whole documents), GPTeacher "
                     f"codegen and MBPP (train/validation/prompt), {figures.get('candidates')} candidates, none held "
                     f"out; evaluation files ({args.eval_rows} rows each): {', '.join(files)}.")
    else:
        data_line = (f"Setup `demo-mix`: {args.examples} rows per source (HumanEval, MMLU-medical, MBPP, MedQuAD), "
                     f"{figures.get('candidates')} candidates, {args.eval_fraction:.0%} held out (at most "
                     f"{args.max_eval}).")
    lines = ["# End-to-end benchmark: published method vs ours vs random and full data", "",
             f"Command: `{machine['command']}`", "",
             f"Machine: {machine['cpus']} CPU cores, {machine['mem_gib']} GiB, {machine['platform']}; load average "
             f"{machine['load_before']} before, {machine['load_after']} after; {machine['date']}; commit "
             f"`{machine['commit']}`.", "",
             f"Model `{args.model}`. {data_line} Max {args.max_seq_len} tokens (longer rows truncated), "
             f"{args.epochs} epoch(s), {args.workers} workers x micro-batch {args.micro_batch}, lr {args.lr}, budget "
             f"{args.budget} (rounded to whole optimizer steps: {figures.get('budget_effective', float('nan')):.1%} "
             f"of the candidates); seeds {seeds}. End-to-end = data + selection pass + train (the two evaluations "
             f"excluded). Held-out loss: {figures['loss_metric']}. Ratios and the loss gap are against the "
             f"full-data arm of the same seed.", ""]
    head = ["arm", "selected", "steps", "tokens trained", "padding", "selection pass s", "train s", "train ÷ full",
            "step time s", "e2e s", "e2e ÷ full", "held-out loss", "loss gap"]
    dom_cols = [d for d in domains if d != "all"] if not files else []
    head += [f"loss {d}" for d in dom_cols]
    file_cols = [(f, k) for f in files for k in TASK_METRICS if _has(summary, arms, f"file_{f}_{k}")]
    head += [f"{f} {k.replace('_', ' ')}" for f, k in file_cols]
    extra = [k for k in ("mc_accuracy", "pass_at_1") if _has(summary, arms, f"{k}_all")]
    head += [k.replace("_", " ") for k in extra]
    rows = []
    for a in arms:
        s = summary[a]
        if not s["runs"]:
            st = s.get("status", {})
            rows.append([ARMS[a][0], "skipped: " + st["skipped"][:80] if "skipped" in st else
                         "failed: " + str(st.get("error", "not run"))[:80]] + [""] * (len(head) - 2))
            continue
        row = [ARMS[a][0], _fmt(s["selected"], 0), _fmt(s["steps"], 0), _fmt(s["tokens_trained"], 0),
               _fmt(s["padding_fraction"], pct=True), _fmt(s["selection_pass_s"], 1), _fmt(s["t_train"], 1),
               _fmt(s["train_ratio"]), _fmt(s["step_time_s"], 1), _fmt(s["e2e_s"], 1), _fmt(s["e2e_ratio"]),
               _fmt(s["heldout_loss"], 4), _fmt(s["loss_gap"], pct=True)]
        row += [_fmt(s[f"loss_{d}"], 4) for d in dom_cols]
        row += [_fmt(s[f"file_{f}_{k}"], 4 if k == "loss" else 3) for f, k in file_cols]
        row += [_fmt(s[f"{k}_all"]) for k in extra]
        rows.append(row)
    lines += ["## Arms", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    reused = sorted({a for s in seeds for a, r in results[s].items() if r.get("sketch_reused")})
    if reused:
        lines += ["", f"Sketch shards of the method arm reused by: {', '.join(ARMS[a][0] for a in reused)} (the same "
                  "data, model, seed and sketch settings give the same shards); its sketch time is charged to their "
                  "selection pass and end-to-end time."]
    first = next((results[s][a] for s in seeds for a in done if _ran(results[s].get(a))), {})
    before, fbefore = first.get("eval_before", {}), first.get("eval_files_before", {})
    if before:
        b = before.get("all", {})
        lines += ["", f"Before training (seed {seeds[0]}): loss " + ", ".join(
            f"{d} {before[d]['loss']:.4f}" for d in domains if d in before and "loss" in before[d])
            + (f"; MC accuracy {b['mc_accuracy']:.3f} ({b['mc_items']} items)" if "mc_accuracy" in b else "")
            + (f"; pass@1 {b['pass_at_1']:.3f} ({b['code_problems']} problems)" if "pass_at_1" in b else "") + "."]
    if fbefore:
        parts = []
        for f, m in fbefore.items():
            a = m.get("all", {})
            bits = [f"loss {a['loss']:.4f} ({a.get('tokens', 0)} tokens)"] if "loss" in a else []
            if "pass_at_1" in a:
                bits.append(f"pass@1 {a['pass_at_1']:.3f} ({a['code_problems']} problems)")
            if "mc_accuracy" in a:
                bits.append(f"MC accuracy {a['mc_accuracy']:.3f} ({a['mc_items']} items)")
            parts.append(f"{f}: " + ", ".join(bits))
        lines += ["", f"Before training (seed {seeds[0]}), per evaluation file: " + "; ".join(parts)
                  + f"; held-out loss {files_loss(fbefore):.4f}."]
    lines += ["", "## Stage timings (s, mean over seeds)", "", "| arm | " + " | ".join(STAGES) + " |",
              "|" + "---|" * (len(STAGES) + 1)]
    for a in done:
        lines.append(f"| {ARMS[a][0]} | " + " | ".join(f"{summary[a]['t_' + st][0]:.1f}" for st in STAGES) + " |")
    lines += ["", f"## Goals (issue 7; method arm `{figures['method_arm']}`)", "", "| figure | measured | goal | met |",
              "|---|---:|---:|---|"]
    for name, goal, ok in figures.get("goals", []):
        v = figures.get(name)
        lines.append(f"| {name} | {'n/a' if v is None else f'{v:.3f}'} | {goal} | {ok} |")

    # metric vs time
    metrics = [("heldout_loss", "held-out loss",
                files_loss(fbefore) if fbefore else before.get("all", {}).get("loss"))]
    for f, k in file_cols:
        if k != "loss":
            metrics.append((f"file_{f}_{k}", f"{f} {k.replace('_', ' ')}", fbefore.get(f, {}).get("all", {}).get(k)))
    for k in extra:
        metrics.append((f"{k}_all", k.replace("_", " "), before.get("all", {}).get(k)))
    if done:
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
        for ax, (key, label, base_value) in zip(axes[0], metrics):
            for a in done:
                x, xs = summary[a]["e2e_s"]
                y, ys = summary[a][key]
                ax.errorbar([x], [y], xerr=[xs], yerr=[ys], marker="o", capsize=3, label=ARMS[a][0])
            if base_value is not None and np.isfinite(base_value):
                ax.axhline(base_value, color="grey", ls="--", lw=1, label="before training")
            ax.set_xlabel("end-to-end time (s)")
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "metric_vs_time.png", dpi=100)
        plt.close(fig)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for a in done:
            curve = np.asarray(results[summary[a]["seeds"][0]][a].get("loss_curve") or [[0, np.nan, 0]], dtype=float)
            # A trailing mean over 4 steps: single micro-batches of 4 make the raw per-step loss jumpy.
            smooth = np.convolve(curve[:, 1], np.ones(4), "full")[: len(curve)] / np.minimum(np.arange(1, len(curve) + 1), 4)
            axes[0].plot(np.cumsum(curve[:, 2]), smooth, marker=".", lw=1, label=ARMS[a][0])
            axes[1].plot(curve[:, 0], smooth, marker=".", lw=1, label=ARMS[a][0])
        axes[0].set_xlabel("cumulative optimizer-step time (s)")
        axes[1].set_xlabel("optimizer step")
        for ax in axes:
            ax.set_ylabel("training loss (mean of the last 4 steps)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=100)
        plt.close(fig)
        lines += ["", "## Held-out metrics vs end-to-end time", "", "![metric vs time](metric_vs_time.png)", "",
                  "## Training loss (first seed of each arm)", "", "![loss curves](loss_curves.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def loss_metric(files: list[str]) -> str:
    """What the held-out loss of the gaps is, in words (``loss_metric`` in the JSON)."""
    if files:
        return ("token-weighted mean response-token loss (nats/token) over the evaluation files "
                f"({', '.join(files)}): each file's all.loss weighted by its all.tokens")
    return "response-token loss (nats/token) of the held-out split, all domains (eval.after.all.loss)"


def headline(summary: dict, args, seeds: list[int], files: list[str], candidates: int | None) -> dict:
    """The figures the issue asks for (ratios and gaps per seed against the full-data arm, averaged), with the
    goals they are held to. The method arm is ``ours`` (``balanced_cluster`` where ``ours`` did not run)."""
    def mean(arm, key):
        s = summary.get(arm, {})
        return s[key][0] if s.get("runs") and np.isfinite(s[key][0]) else None

    method = "ours" if summary.get("ours", {}).get("runs") else "balanced_cluster"
    full = "full" if summary.get("full", {}).get("runs") else "full_random"
    fig = {
        "loss_metric": loss_metric(files),
        "method_arm": method,
        "full_arm": full,
        "loss_gap": mean(method, "loss_gap"),
        "paper_loss_gap": mean("paper", "loss_gap"),
        "random_loss_gap": mean("random_subset", "loss_gap"),
        "unweighted_loss_gap": mean("ours_unweighted", "loss_gap"),
        "e2e_ratio": mean(method, "e2e_ratio"),
        "train_ratio": mean(method, "train_ratio"),
        "step_time_ratio": mean(method, "step_time_ratio"),
        "paper_e2e_ratio": mean("paper", "e2e_ratio"),
        "paper_train_ratio": mean("paper", "train_ratio"),
        "random_e2e_ratio": mean("random_subset", "e2e_ratio"),
        "loss_full": mean(full, "heldout_loss"),
        "loss_ours": mean(method, "heldout_loss"),
        "loss_paper": mean("paper", "heldout_loss"),
        "loss_random": mean("random_subset", "heldout_loss"),
        # The method with its sketch under bf16 autocast (what `sketch.dtype: auto` does on CUDA).
        "train_ratio_bf16_sketch": mean("balanced_cluster_bf16", "train_ratio"),
        "e2e_ratio_bf16_sketch": mean("balanced_cluster_bf16", "e2e_ratio"),
        "loss_gap_bf16_sketch": mean("balanced_cluster_bf16", "loss_gap"),
        # Packed: ours_packed against full_packed (the strongest conventional baseline), per seed, averaged.
        "e2e_ratio_packed": mean("ours_packed", "e2e_ratio_packed"),
        "train_ratio_packed": mean("ours_packed", "train_ratio_packed"),
        "loss_gap_packed": mean("ours_packed", "loss_gap_packed"),
        "full_packed_e2e_ratio": mean("full_packed", "e2e_ratio"),
        "full_packed_train_ratio": mean("full_packed", "train_ratio"),
        "loss_full_packed": mean("full_packed", "heldout_loss"),
        "loss_ours_packed": mean("ours_packed", "heldout_loss"),
    }
    fig.update(setup=args.setup, candidates=candidates, seeds=seeds, epochs=args.epochs, examples=args.examples,
               eval_rows=args.eval_rows if files else None, max_seq_len=args.max_seq_len, workers=args.workers,
               budget=args.budget, quick=bool(args.quick),
               date=dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    fig["goals"] = [
        ("train_ratio", "<= 0.20", fig["train_ratio"] is not None and fig["train_ratio"] <= 0.20),
        ("e2e_ratio", "<= 0.30", fig["e2e_ratio"] is not None and fig["e2e_ratio"] <= 0.30),
        ("e2e_ratio_packed", "<= 0.40", fig["e2e_ratio_packed"] is not None and fig["e2e_ratio_packed"] <= 0.40),
        ("loss_gap_packed", "<= 0.02", fig["loss_gap_packed"] is not None and fig["loss_gap_packed"] <= 0.02),
        ("loss_gap", "<= 0.02", fig["loss_gap"] is not None and fig["loss_gap"] <= 0.02),
        ("random_loss_gap", ">= loss_gap", fig["loss_gap"] is not None and fig["random_loss_gap"] is not None
         and fig["loss_gap"] <= fig["random_loss_gap"]),
        ("paper_loss_gap", ">= loss_gap", fig["loss_gap"] is not None and fig["paper_loss_gap"] is not None
         and fig["loss_gap"] <= fig["paper_loss_gap"]),
    ]
    return fig


def _clean(x):
    """NaN -> None, tuples -> lists, recursively (the summary JSON stays strict JSON)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def arm_figures(s: dict, domains: list[str], files: list[str]) -> dict:
    """One arm's figures for the summary JSON: ``[mean, spread]`` over its seeds (spread 0 for one seed)."""
    if not s["runs"]:
        return {"status": s.get("status")}
    out = {"runs": s["runs"], "seeds": s["seeds"]}
    for key, name in (("selected", "selected"), ("candidates", "candidates"), ("steps", "steps"),
                      ("tokens_trained", "tokens_trained"), ("padding_fraction", "padding_fraction"),
                      ("selection_pass_s", "selection_pass_s"), ("t_train", "train_s"), ("step_time_s", "step_time_s"),
                      ("e2e_s", "e2e_s"), ("heldout_loss", "heldout_loss"), ("loss_gap", "loss_gap"),
                      ("train_ratio", "train_ratio"), ("e2e_ratio", "e2e_ratio"),
                      ("train_ratio_packed", "train_ratio_packed"), ("e2e_ratio_packed", "e2e_ratio_packed"),
                      ("loss_gap_packed", "loss_gap_packed")):
        out[name] = list(s[key])
    if files:
        out["files"] = {f: {k: list(s[f"file_{f}_{k}"]) for k in TASK_METRICS if np.isfinite(s[f"file_{f}_{k}"][0])}
                        for f in files}
    dom = {f"{k}_{d}": list(s[f"{k}_{d}"]) for d in domains for k in TASK_METRICS if np.isfinite(s[f"{k}_{d}"][0])}
    if dom:
        out["domains"] = dom
    return out




def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup", choices=list(SETUPS), default="paper",
                   help="paper (default): MedQuAD + GPTeacher codegen + MBPP pool, held-out evaluation files; "
                        "demo-mix: the earlier four-source sample with a held-out split")
    p.add_argument("--arms", nargs="+", default=None, choices=list(ARMS),
                   help="default: paper ours ours_unweighted random_subset full (--setup paper); every earlier arm "
                        "(--setup demo-mix)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0 1 (paper), 0 (demo-mix)")
    p.add_argument("--examples", type=int, default=None,
                   help="rows per source (paper: per pool source, default 224; demo-mix: default 32; --quick 24/12)")
    p.add_argument("--epochs", type=int, default=None, help="default 2 (paper), 3 (demo-mix); --quick 1")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per example; longer rows are truncated (default 384 paper, 512 demo-mix)")
    p.add_argument("--budget", type=float, default=0.31, help="ours' selection budget (rounded to whole steps)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="share of accepted rows held out by the data stage (default 0 paper, 0.3 demo-mix)")
    p.add_argument("--max-eval", type=int, default=None, help="held-out rows at most (default 0 paper, 48 demo-mix)")
    p.add_argument("--eval-rows", type=int, default=None, help="paper: rows per evaluation file (default 100)")
    p.add_argument("--max-mc", type=int, default=None, help="MC items scored at most, per file (100 paper, 32 demo-mix)")
    p.add_argument("--max-code", type=int, default=None,
                   help="code problems evaluated at most, per file (default 16 paper, 8 demo-mix; --quick 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per code completion (default 128; --quick 32)")
    p.add_argument("--time-limit", type=float, default=5.0, help="seconds per code test program")
    p.add_argument("--eval-threads", type=int, default=1,
                   help="torch threads of the evaluation task (1: two OpenMP threads on 2 busy cores ran up to 10x "
                        "slower)")
    p.add_argument("--model", default="demo")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--out", default=str(REPO / "runs" / "bench_e2e"))
    p.add_argument("--results", default=None,
                   help="summary JSON (default bench/results/end_to_end.json; with --quick OUT/end_to_end.json)")
    p.add_argument("--keep-models", action="store_true",
                   help="keep each arm's final_model/ and ray_train/ checkpoints (about 2.5 GB per arm)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny pool, 1 epoch, 2 code problems, seed 0")
    p.add_argument("--extra-seed-arms", nargs="+", default=None, choices=list(ARMS),
                   help="arms run for the seeds after the first (default: every arm for every seed)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="run every arm again instead of using the figures an earlier run kept (OUT/seedS/ARM.bench.json)"
                   " for the same config and package code")
    p.add_argument("--no-reuse-sketches", dest="reuse_sketches", action="store_false",
                   help="let the gradient arms sketch again instead of starting from the method arm's shards")
    args = p.parse_args(argv)
    defaults = {**SETUPS[args.setup], **(QUICK[args.setup] if args.quick else {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if args.results is None:
        args.results = str(Path(args.out) / "end_to_end.json") if args.quick else \
            str(REPO / "bench" / "results" / "end_to_end.json")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t_start = time.perf_counter()
    if args.setup == "paper":
        paths, eval_paths = write_paper_data(out / "data", args.examples, args.eval_rows, seed=0)
    else:
        paths, eval_paths = write_data(out / "data", args.examples, seed=0), []
    print(f"[bench] setup {args.setup}: pool {', '.join(paths)}"
          + (f"; evaluation files {', '.join(eval_paths)}" if eval_paths else ""), flush=True)
    from ray_cluster_ft.pipeline.session import init_ray

    init_ray(None, False)  # once for every arm (each run_pipeline then joins it)
    evaluator_for = make_evaluator(args, {})
    results: dict = {}
    budgets: dict = {}
    try:
        for seed in args.seeds:
            results[seed] = {}
            budget, n = aligned_budget(args, seed, paths)
            budgets[seed] = {"selected": budget, "candidates": n, "fraction": budget / n}
            print(f"[bench] seed {seed}: {n} candidates, ours selects {budget} ({budget / n:.1%})", flush=True)
            wanted = args.arms if seed == args.seeds[0] or not args.extra_seed_arms else \
                [a for a in args.arms if a in args.extra_seed_arms]
            for arm in [a for a in RUN_ORDER if a in wanted]:
                done = results[seed]
                alias = ALIASES.get(arm)
                if alias and _ran(done.get(alias)):
                    done[arm] = {**done[alias], "alias_of": alias}
                    print(f"[bench] seed {seed} arm {arm}: the same run as {alias}", flush=True)
                    continue
                donor = next((done[a] for a in ("ours", "balanced_cluster") if _ran(done.get(a))), None)
                b = budget
                if arm == "random_subset" and donor is not None:
                    b = donor["selected"]  # as many rows as the method trained
                key = arm_key(arm, args, seed, paths, eval_paths, out, b)
                kept = read_arm(out, seed, arm, key) if args.resume else None
                if kept is not None:
                    done[arm] = kept
                    print(f"[bench] seed {seed} arm {arm}: figures of an earlier run with the same config", flush=True)
                    continue
                load0 = os.getloadavg()
                done[arm] = run_arm(arm, args, seed, paths, eval_paths, out, b,
                                    sketch_donor=donor if args.reuse_sketches else None, evaluator_for=evaluator_for)
                # Wall times are only comparable between arms run at a similar load: each arm keeps its own.
                done[arm]["load_1m_before"], done[arm]["load_15m_after"] = load0[0], os.getloadavg()[2]
                if _ran(done[arm]):
                    write_arm(out, seed, arm, key, done[arm])
    finally:
        import ray

        ray.shutdown()
    machine["load_after"] = load_average()
    machine["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    domains = sorted({d for s in results.values() for r in s.values() for d in r.get("eval_after", {}) if d != "all"})
    domains.append("all")
    files = [file_name(p) for p in eval_paths]
    summary = summarise(results, args.arms, args.seeds, domains, files)
    candidates = round(float(np.mean([b["candidates"] for b in budgets.values()]))) if budgets else None
    figures = headline(summary, args, args.seeds, files, candidates)
    figures["budget_effective"] = float(np.mean([b["fraction"] for b in budgets.values()]))
    report = write_report(out, args, summary, results, args.arms, args.seeds, domains, files, figures, machine)
    (out / "bench.json").write_text(json.dumps(_clean({"args": vars(args), "machine": machine, "budgets": budgets,
                                                       "summary": summary, "figures": figures, "results": results}),
                                               indent=1, default=str))
    res_path = Path(args.results)
    res_path.parent.mkdir(parents=True, exist_ok=True)
    short = {k: v for k, v in figures.items() if k != "goals"}
    short["goals_met"] = {name: bool(ok) for name, _, ok in figures["goals"]}
    short["machine"] = {k: machine[k] for k in ("cpus", "mem_gib", "load_before", "load_after", "commit", "command",
                                                 "bench_wall_s")}
    first = next((r for s in args.seeds for r in results[s].values() if _ran(r)), {})
    short["before"] = {"seed": args.seeds[0], "heldout_loss": first.get("heldout_loss_before"),
                       "files": {f: {k: m.get("all", {}).get(k) for k in ("loss", "tokens", "pass_at_1", "mc_accuracy")
                                     if k in m.get("all", {})} for f, m in first.get("eval_files_before", {}).items()}}
    short["arms"] = {a: arm_figures(summary[a], domains, files) for a in args.arms}
    short = _clean(short)
    res_path.write_text(json.dumps(short, indent=1, default=str) + "\n")
    print(f"[bench] report: {report}; summary: {res_path}; {machine['bench_wall_s']} s", flush=True)
    print(json.dumps({k: v for k, v in short.items() if k not in ("arms", "machine", "before")}, default=str))
    return short


if __name__ == "__main__":
    main()
