"""Does the selection beat a random subset? Held-out quality per benchmark, best epoch, several seeds (issue 31).

Every arm is one :func:`ray_cluster_ft.run_pipeline` run (the product as users run it: Ray Data features, the
driver's clustering, selection and plan, Ray Train + DeepSpeed on 2 CPU workers) that differs from the others
only in the keys of :data:`ARMS`; everything else is shared (:func:`arm_config`).

Pools (``--pools``), drawn once (data seed 0) from ``../shared/data`` and written to ``OUT/<pool>/data``:

* ``natural``: ``--candidates`` rows in the data's own proportions, by file size (MedQuAD 16,407, GPTeacher
  codegen 4,535, MBPP 974 rows: 75 / 21 / 4 %, largest remainders: 449 / 124 / 27 of 600; MBPP's rows from
  its non-test splits), MedQuAD by whole documents so its templated repeats come together as in the source;
* ``balanced``: the same number split equally between the three files (the paper setup).

Held out, never featurised, selected or trained on (``evaluation.paths``): ``--eval-rows`` rows each of MBPP
``test``, HumanEval, MMLU-medical and MedQuAD documents outside both pools. Each file is scored by its
response-token loss after every epoch (``evaluation.every_epoch``); the headline is the **macro mean** over
the four files (each file weighs the same), at the arm's **best epoch** (a user keeps the best checkpoint), with
the last epoch's and the token-weighted figure beside it.

Arms: ``full`` (all candidates; seed 0 only), ``ours`` (the product's defaults at ``--budget``),
``random_subset`` (random rows, as many as ours trained), ``random_tokens`` (random rows up to ours' tokens),
``paper`` (``preset: cluster-paper``), and the ablations, each one key changed from the default (natural pool).
``ours`` runs first in every seed: the random arms take its counts. Features are shared between the arms of
a pool through one ``sketch.store`` (``sketch.seed`` is fixed, so they do not depend on the run seed); an arm
that read every feature from the store is charged the sketch time of the run that computed them
(``OUT/<pool>/feature_times.json``), so every arm's selection pass counts the features it used.

Figures per arm and seed: ``macro_loss`` (best epoch), ``macro_loss_last``, ``token_loss`` (best epoch),
``best_epoch``, per-file losses per epoch, ``selection_s`` (sketch + cluster + select + allocate),
``train_s``, ``e2e_s`` (their sum: evaluation not counted), rows and tokens trained. Finished arms are kept
in ``OUT/<pool>/seed<s>/<arm>.bench.json`` keyed by their config and the package's tree hash, so a stopped
benchmark resumes where it stopped and a changed package reruns only what it changes. ``bench/results/
quality.json`` is rewritten after every arm; its ``machine`` names the commit and the load.

Usage (run from a separate ``git worktree`` at a fixed commit, under ``nice``; docs/benchmarks.md)::

    RAY_worker_niceness=0 nice -n 5 python bench/end_to_end.py               # everything, resumable (hours)
    python bench/end_to_end.py --pools natural --seeds 0 --arms ours random_subset full
    python bench/end_to_end.py --quick --model PATH                          # smoke run: tiny sizes
    python bench/end_to_end.py --only-cached --pools natural --arms sketch --merge-into bench/results/quality.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench._data import (  # noqa: E402
    demo_rows,
    load_average,
    machine_info,
    medquad_split,
    read_shared,
    sample,
    write_jsonl,
)

# Arm -> (what it is, config keys over the shared ones). ``ours`` and the ablations set the budget; the random
# arms get ours' counts (see run_seed); ``full`` and ``paper`` set their own selection.
ARMS = {
    "full": ("all candidates", {"selection": {"strategy": "full"}}),
    "ours": ("the product's defaults", {}),
    # The random arms plan at random too: no features, no clusters, so no selection pass (the first run, at
    # 8e5d9ee, kept the cluster plan and so read the features; see docs/benchmarks.md). The random plan is
    # padded and drops what does not fill whole steps of W x B rows: fewer than W x B = 8 of ours' rows.
    "random_subset": ("random rows, as many as ours trained",
                      {"selection": {"strategy": "random"}, "allocation": {"strategy": "random"}}),
    "random_tokens": ("random rows up to ours' tokens",
                      {"selection": {"strategy": "random"}, "allocation": {"strategy": "random"}}),
    "paper": ("preset: cluster-paper, its defaults", {"preset": "cluster-paper"}),
    # Ablations (natural pool): one key from the default (embedding, groups auto, within random, unweighted:
    # issue 31's; hidden_mean was the feature until the ablations below chose embedding).
    "hidden_mean": ("sketch.method: hidden_mean (RDS+; the default before embedding)",
                    {"sketch": {"method": "hidden_mean"}}),
    "sketch": ("sketch.method: sketch (the LoGra gradient sketch)", {"sketch": {"method": "sketch"}}),
    "last_layer": ("sketch.method: last_layer (published)", {"sketch": {"method": "last_layer"}}),
    # all-MiniLM-L6-v2, a 22M encoder: a selector much smaller than the trained model (Yin & Rush). The default
    # now, so as an ablation it repeats ``defaults``; kept so that --ours embedding names the keys measured.
    "embedding": ("sketch.method: embedding (all-MiniLM-L6-v2)", {"sketch": {"method": "embedding"}}),
    "within_kcenter": ("selection.within: kcenter", {"selection": {"within": "kcenter"}}),
    "within_peripheral": ("selection.within: peripheral", {"selection": {"within": "peripheral"}}),
    "max_tokens_128": ("sketch.max_tokens: 128", {"sketch": {"max_tokens": 128}}),
    # The gradient sketch from a row's first 64 tokens: about a third of its full-length cost on the natural pool
    # (mean row 185 tokens), which brings the sketch's selection pass under 0.10 of full's training.
    "sketch_64": ("sketch.method: sketch, sketch.max_tokens: 64", {"sketch": {"method": "sketch", "max_tokens": 64}}),
    "flat": ("selection.groups: null (every cluster one share)", {"selection": {"groups": None}}),
    # Square-root shares: between balance and the pool's mix (a source spread over many clusters, or one dense
    # templated cluster, keeps more of its size).
    "sqrt_quotas": ("selection.size_power: 0.5", {"selection": {"size_power": 0.5}}),
    "weighted": ("train.loss_weighting: cluster", {"train": {"loss_weighting": "cluster"}}),
    # The defaults before issue 31, all four keys at once.
    "old_defaults": ("sketch, k-center, flat quotas, cluster weights (the defaults before issue 31)",
                     {"sketch": {"method": "sketch"}, "selection": {"within": "kcenter", "groups": None},
                      "train": {"loss_weighting": "cluster"}}),
    # With --ours NAME, ``ours`` is a candidate default written as keys; this arm keeps the package's own.
    "defaults": ("the package's defaults at this commit", {}),
}
HEADLINE = ["ours", "random_subset", "random_tokens", "paper", "full"]
ABLATIONS = ["defaults", "hidden_mean", "sketch", "last_layer", "embedding", "within_kcenter", "within_peripheral",
             "max_tokens_128", "sketch_64", "flat", "sqrt_quotas", "weighted", "old_defaults"]
FRONTIER_BUDGETS = (0.2, 0.5)  # and --budget (0.31): ours and random_subset, natural, seed 0
SELECTION_PASS = ("sketch", "cluster", "select", "allocate")
QUICK = {"candidates": 30, "eval_rows": 6, "epochs": 2, "seeds": [0], "max_seq_len": 128}


# --------------------------------------------------------------------------- data


def write_pools(out: Path, candidates: int, eval_rows: int) -> tuple[dict[str, list[str]], list[str]]:
    """The pool files (``{"natural": paths, "balanced": paths}``) and the held-out files, drawn with data seed 0.

    MedQuAD's pool rows are whole documents (:func:`bench._data.medquad_split`); the natural pool takes as many
    as the balanced one needs or more, and the held-out MedQuAD rows come from documents outside the larger of
    the two MedQuAD draws (both start from the same document order, so the smaller is inside the larger).
    """
    med, gpt = read_shared("medquad"), read_shared("gpteacher_codegen")
    mbpp_all = read_shared("mbpp")
    mbpp = [r for r in mbpp_all if r.get("split") != "test"]
    # The files' own sizes (MBPP's test split included: it is MBPP's share of the data), largest remainders.
    sizes = np.array([len(med), len(gpt), len(mbpp_all)], dtype=float)
    exact = candidates * sizes / sizes.sum()
    natural = np.floor(exact).astype(int)
    natural[np.argsort(natural - exact)[: candidates - natural.sum()]] += 1
    balanced = [candidates // 3 + (1 if i < candidates % 3 else 0) for i in range(3)]
    n_med = max(natural[0], balanced[0])
    med_pool, med_eval = medquad_split(med, n_med, eval_rows, 0)
    pools = {}
    for name, (nm, ng, nb) in {"natural": natural.tolist(), "balanced": balanced}.items():
        d = out / name / "data"
        rows = {"medquad": medquad_split(med, nm, 0, 0)[0], "gpteacher_codegen": sample(gpt, ng, 0),
                "mbpp": sample(mbpp, nb, 0)}
        pools[name] = [write_jsonl(d / f"{k}.jsonl", v) for k, v in rows.items()]
    demo = demo_rows(None, 0)
    held = {"mbpp_test": sample([r for r in mbpp_all if r.get("split") == "test"], eval_rows, 0),
            "humaneval": sample(demo["humaneval"], eval_rows, 0),
            "mmlu_medical": sample(demo["mmlu-medical"], eval_rows, 0), "medquad_heldout": med_eval}
    assert not {(r["question"], r["answer"]) for r in med_eval} & {(r["question"], r["answer"]) for r in med_pool}
    return pools, [write_jsonl(out / "eval" / f"{k}.jsonl", v) for k, v in held.items()]


# --------------------------------------------------------------------------- configs


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def arm_keys(arm: str, args) -> dict:
    """The config keys an arm sets over the shared ones: :data:`ARMS`, except that ``--ours NAME`` makes ``ours``
    the candidate default ``NAME`` (measured as keys, so a later change of the package's defaults to exactly
    these keys does not invalidate what ran)."""
    if arm == "ours" and getattr(args, "ours", None):
        return copy.deepcopy(ARMS[args.ours][1])
    return copy.deepcopy(ARMS[arm][1])


def arm_config(arm: str, args, pool: str, seed: int, paths: list[str], eval_paths: list[str], run_dir: Path,
               budget: dict | None = None) -> dict:
    """One arm's job config: the shared settings, the arm's :data:`ARMS` keys, then ``budget`` (selection keys:
    ``budget`` or ``budget_tokens``). ``paper`` keeps only what the preset does not decide."""
    cfg = {
        "data": {"source": "files", "paths": paths, "max_seq_len": args.max_seq_len, "overlong": "truncate",
                 "eval_fraction": 0.0, "seed": 0},
        "model": {"path": args.model},
        # sketch.seed fixed: features do not depend on the run seed, so the arms of a pool share one store.
        "sketch": {"seed": 0, "batch_size": 8, "store": str(Path(args.out) / pool / "features"),
                   "dtype": "bfloat16" if args.precision == "bf16" else "float32"},
        "clustering": {"seed": seed},
        "selection": {"seed": seed, "budget": args.budget},
        "allocation": {"seed": seed},
        "train": {"num_workers": args.workers, "micro_batch_size": args.micro_batch, "epochs": args.epochs,
                  "lr": args.lr, "warmup_steps": 2, "seed": seed, "precision": args.precision},
        "evaluation": {"paths": list(eval_paths), "every_epoch": True, "max_mc": 0, "max_code": 0},
        "output": {"dir": str(run_dir), "save_model": True},
    }
    if arm == "paper":
        cfg["selection"].pop("budget")
        cfg["clustering"].pop("seed")  # the preset's (the official code's 42)
    if arm == "full":
        cfg["selection"].pop("budget")
    cfg = _merge(cfg, arm_keys(arm, args))
    if budget:
        cfg["selection"] = {k: v for k, v in cfg["selection"].items() if k not in ("budget", "budget_tokens")}
        cfg["selection"].update(budget)
    return cfg


# --------------------------------------------------------------------------- evaluation


def make_evaluator(cache: dict, threads: int, store: Path | None = None):
    """A memoising evaluator (:data:`ray_cluster_ft.evaluate.Evaluator`): the base model is scored on each file
    once, not once per arm. Loss only (``max_mc`` = ``max_code`` = 0 pass no tasks). With ``store`` (a pickle
    file) the base scores outlive the process, keyed also by the package's tree, so a resumed benchmark does not
    score the base model again (100-300 s of a 2-core machine per invocation)."""
    import pickle

    import ray

    from ray_cluster_ft.evaluate import evaluate_model_path
    from ray_cluster_ft.model import load_tokenizer

    def evaluator_for(cfg):
        pad = int(load_tokenizer(cfg.model.path, cfg.model.trust_remote_code).pad_token_id)

        def evaluate(model_path, table, tasks):
            # Only the base model is the same across arms; a trained model's path is reused by the next run.
            base = "/epochs/" not in str(model_path) and "final_model" not in str(model_path)
            key = (_package_tree(), str(model_path), tuple(table.column("example_id").to_pylist()))
            if base and key not in cache and store is not None and store.exists():
                cache.update(pickle.loads(store.read_bytes()))  # only base scores are ever written there
            if not base or key not in cache:
                task = ray.remote(evaluate_model_path).options(
                    num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
                cache[key] = ray.get(task.remote(model_path, table, 8, pad, cfg.model.trust_remote_code, threads,
                                                 tasks=tasks, with_samples=True))
                if base and store is not None:
                    kept = pickle.loads(store.read_bytes()) if store.exists() else {}
                    kept[key] = cache[key]
                    tmp = store.with_suffix(".tmp")
                    tmp.write_bytes(pickle.dumps(kept))
                    tmp.replace(store)
            return copy.deepcopy(cache[key])

        return evaluate

    return evaluator_for


def _file_losses(files: dict) -> dict[str, float]:
    return {Path(p).stem: float((m or {}).get("all", {}).get("loss", float("nan"))) for p, m in files.items()}


def epoch_figures(manifest: dict) -> dict:
    """The best and last epoch of a finished arm, from its manifest's ``eval_epochs``."""
    rows = manifest.get("eval_epochs") or []
    if not rows:
        raise RuntimeError("the manifest has no eval_epochs (evaluation.every_epoch did not run)")
    scored = [r for r in rows if r.get("macro_loss") is not None and math.isfinite(r["macro_loss"])]
    best = min(scored, key=lambda r: (r["macro_loss"], r["epoch"]))
    before = manifest.get("eval_files", {})
    return {
        "macro_loss": best["macro_loss"], "token_loss": best["token_loss"], "best_epoch": best["epoch"],
        "macro_loss_last": rows[-1]["macro_loss"], "token_loss_last": rows[-1]["token_loss"],
        "macro_by_epoch": [r["macro_loss"] for r in rows],
        "files_by_epoch": [_file_losses(r["files"]) for r in rows],
        "files_before": {Path(p).stem: v.get("before", {}).get("all", {}).get("loss") for p, v in before.items()},
    }


# --------------------------------------------------------------------------- one arm


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _feature_key(cfg) -> str:
    from ray_cluster_ft.features.store import feature_settings

    return json.dumps({"settings": feature_settings(cfg.sketch), "model": cfg.sketch.model or cfg.model.path},
                      sort_keys=True, default=str)


def arm_key(cfg: dict) -> str:
    """What an arm's figures depend on: its job config and the package's tree (HEAD:ray_cluster_ft), so a
    commit that changes only the benchmark keeps finished arms."""
    return json.dumps({"config": cfg, "package_tree": _package_tree()}, sort_keys=True, default=str)


def _package_tree() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD:ray_cluster_ft"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def run_arm(arm: str, raw: dict, out: Path, pool: str, evaluator_for, what: str = "") -> dict:
    """Run one arm; its figures. The sketch time of an arm that read every feature from the store is the run's
    that computed them (``feature_times.json``)."""
    import pandas as pd
    import ray

    from ray_cluster_ft import run_pipeline
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.pipeline.session import init_ray

    cfg = parse_config(raw)
    if not ray.is_initialized():  # once, at the first arm that runs (each run_pipeline then joins it)
        init_ray(None, False)
    print(f"[bench] ===== {pool} {Path(cfg.output.dir).parent.name} {arm}: {what}", flush=True)
    t0 = time.perf_counter()
    manifest = run_pipeline(cfg, evaluator=evaluator_for(cfg))
    wall = time.perf_counter() - t0
    t = {k: float(v) for k, v in manifest["timings_s"].items()}
    c = manifest["counts"]
    times_path = out / pool / "feature_times.json"
    times = _read_json(times_path, {})
    own_sketch = t.get("sketch", 0.0)
    charged = own_sketch
    if c.get("features_computed", 0) + c.get("features_reused", 0):
        key = _feature_key(cfg)
        if c.get("features_reused", 0) == 0:
            times[key] = own_sketch
            _write_json(times_path, times)
        elif c.get("features_computed", 0) == 0:
            # No record of the computation (it ran in a run that failed later): the pass is not known.
            charged = times.get(key)
    selection_s = None if charged is None else charged + sum(t.get(k, 0.0) for k in SELECTION_PASS if k != "sketch")
    plan = pd.read_parquet(Path(cfg.output.dir) / "plan.parquet")
    epochs = max(1, int(plan["epoch"].nunique()))
    for sub in ("final_model", "ray_train", "epochs"):  # ~0.5-2.5 GB each; the figures are read
        shutil.rmtree(Path(cfg.output.dir) / sub, ignore_errors=True)
    return {
        **epoch_figures(manifest),
        "selection_s": selection_s, "sketch_s_own": own_sketch, "train_s": t.get("train", 0.0),
        "e2e_s": None if selection_s is None else selection_s + t.get("train", 0.0), "wall_s": wall, "timings_s": t,
        "rows": int(plan.loc[plan["epoch"] == plan["epoch"].min(), "example_id"].nunique()),
        "tokens_per_epoch": int(plan["n_tokens"].sum()) // epochs, "candidates": int(c["candidates"]),
        "eval_scored": {Path(p).stem: v.get("scored") for p, v in manifest.get("eval_files", {}).items()},
        "k": manifest.get("clustering", {}).get("k"), "groups": manifest.get("budget", {}).get("groups"),
        "load_after": load_average(),
    }


def cached_arm(arm: str, raw: dict, out: Path, pool: str, seed: int, evaluator_for, only_cached: bool,
               what: str = "") -> dict | None:
    """The arm's kept figures when its key matches, else it runs (unless ``only_cached``) and they are kept."""
    path = out / pool / f"seed{seed}" / f"{arm}.bench.json"
    key = arm_key(raw)
    kept = _read_json(path, {})
    if kept.get("key") == key and "macro_loss" in kept.get("figures", {}):
        return kept["figures"]
    if only_cached:
        return None
    try:
        figures = run_arm(arm, raw, out, pool, evaluator_for, what)
    except Exception as err:  # noqa: BLE001 - one failed arm must not lose the others' figures
        print(f"[bench] {pool} seed {seed} {arm} failed: {type(err).__name__}: {err}", flush=True)
        return None
    _write_json(path, {"key": key, "figures": figures})
    return figures


# --------------------------------------------------------------------------- the schedule


def schedule(args) -> list[tuple[str, int, str]]:
    """(pool, seed, arm) in run order: the headline arms of natural seed by seed (``ours`` first: the random
    arms take its counts; ``full`` once per pool), then balanced, then the ablations (natural, the first
    ``--ablation-seeds`` seeds), then the frontier (natural, seed 0)."""
    order = []
    for pool in args.pools:
        for i, seed in enumerate(args.seeds):
            order += [(pool, seed, a) for a in HEADLINE if a in args.arms and (a != "full" or i == 0)]
    if "natural" in args.pools:
        # With --ours NAME the ablation NAME is ours itself, and ``defaults`` is ours without it.
        same = {args.ours or "defaults"} | {a for a in ABLATIONS if a != "defaults" and _is_default(a)}
        for seed in args.seeds[: args.ablation_seeds]:
            order += [("natural", seed, a) for a in ABLATIONS if a in args.arms and a not in same]
        if args.frontier:
            for b in FRONTIER_BUDGETS:
                order += [("natural", args.seeds[0], f"{a}@{b}") for a in ("ours", "random_subset")]
    return order


def _is_default(arm: str) -> bool:
    """True when an arm's keys are the package's defaults already (``embedding`` since it became the default):
    running it would repeat ``defaults``."""
    from ray_cluster_ft.config import parse_config

    return parse_config(ARMS[arm][1]).model_dump() == parse_config({}).model_dump()


def _budget_of(arm: str, ours: dict | None) -> dict | None:
    base = arm.split("@")[0]
    if base in ("random_subset", "random_tokens"):
        if ours is None:
            return None
        return {"budget": ours["rows"]} if base == "random_subset" else {"budget_tokens": ours["tokens_per_epoch"]}
    if "@" in arm:
        return {"budget": float(arm.split("@")[1])}
    return None


def run_all(args) -> dict:
    import ray

    out = Path(args.out)
    pools, eval_paths = write_pools(out, args.candidates, args.eval_rows)
    results: dict = {}
    cache: dict = {}
    evaluator_for = make_evaluator(cache, args.eval_threads, out / "base_eval.pkl")
    try:
        _run_schedule(args, out, pools, eval_paths, results, evaluator_for)
    finally:
        ray.shutdown()
    return write_results(args, results)


def wait_while_paused(out: Path, poll_s: float = 30.0) -> None:
    """Hold the schedule between arms while ``OUT/PAUSE`` exists, so a timed measurement elsewhere can have the
    machine without slowing (or being slowed by) an arm; the arm in progress finishes first."""
    said = False
    while (out / "PAUSE").exists():
        if not said:
            print(f"[bench] paused: {out / 'PAUSE'} exists", flush=True)
            said = True
        time.sleep(poll_s)


def _run_schedule(args, out: Path, pools: dict, eval_paths: list[str], results: dict, evaluator_for) -> None:
    for pool, seed, arm in schedule(args):
        wait_while_paused(out)
        base = arm.split("@")[0]
        ref = f"ours@{arm.split('@')[1]}" if "@" in arm else "ours"
        ours = results.get(pool, {}).get(seed, {}).get(ref)
        if base.startswith("random") and ours is None:
            print(f"[bench] {pool} seed {seed} {arm}: skipped, {ref} has no figures", flush=True)
            continue
        run_dir = out / pool / f"seed{seed}" / arm.replace("@", "_b")
        raw = arm_config(base, args, pool, seed, pools[pool], eval_paths, run_dir, _budget_of(arm, ours))
        what = ARMS[base][0] if not (base == "ours" and args.ours) else f"--ours {args.ours}: {ARMS[args.ours][0]}"
        fig = cached_arm(arm, raw, out, pool, seed, evaluator_for, args.only_cached, what)
        if fig is not None:
            results.setdefault(pool, {}).setdefault(seed, {})[arm] = fig
            write_results(args, results)


# --------------------------------------------------------------------------- results


def _over_seeds(results: dict, pool: str, seeds: list[int], arm: str, key: str) -> list:
    return [results.get(pool, {}).get(s, {}).get(arm, {}).get(key) for s in seeds]


def summarise(args, results: dict) -> dict:
    """``bench/results/quality.json`` (the issue's keys): per pool ``candidates``, ``seeds``, ``epochs``,
    ``full_train_s`` and per arm lists over ``seeds``; the ``frontier``; ``ablations`` (natural); ``machine``."""
    keys = ("macro_loss", "macro_loss_last", "token_loss", "best_epoch", "selection_s", "train_s", "e2e_s", "rows",
            "tokens_per_epoch", "load_after")
    doc = {"pools": {}, "frontier": {}, "defaults": arm_keys("ours", args), "ours": args.ours or "defaults",
           # The load when this invocation started (the file is rewritten after every arm); None for --only-cached,
           # which runs nothing. Arms kept from earlier invocations carry their own load_after.
           "machine": {**machine_info(), "load_before": getattr(args, "load_before", None)},
           "settings": {k: getattr(args, k) for k in ("candidates", "eval_rows", "budget", "epochs", "lr",
                                                      "max_seq_len", "micro_batch", "workers", "model",
                                                      "precision")}}
    for pool in args.pools:
        arms = {}
        for arm in HEADLINE + (ABLATIONS if pool == "natural" else []):
            seeds = [0] if arm == "full" else args.seeds
            if any(v is not None for v in _over_seeds(results, pool, seeds, arm, "macro_loss")):
                arms[arm] = {"seeds": seeds, **{k: _over_seeds(results, pool, seeds, arm, k) for k in keys},
                             "macro_by_epoch": _over_seeds(results, pool, seeds, arm, "macro_by_epoch"),
                             "files_by_epoch": _over_seeds(results, pool, seeds, arm, "files_by_epoch")}
        full = results.get(pool, {}).get(0, {}).get("full", {})
        doc["pools"][pool] = {"candidates": full.get("candidates") or args.candidates, "seeds": args.seeds,
                              "epochs": args.epochs, "full_train_s": full.get("train_s"), "arms": arms}
    nat = results.get("natural", {}).get(args.seeds[0], {})
    for arm in ("ours", "random_subset"):
        pts = [(args.budget, nat.get(arm))] + [(b, nat.get(f"{arm}@{b}")) for b in FRONTIER_BUDGETS]
        doc["frontier"][arm] = [{"budget": b, "macro_loss": f["macro_loss"], "e2e_s": f["e2e_s"]}
                                for b, f in sorted(pts, key=lambda p: p[0]) if f and f["e2e_s"] is not None]
    if nat.get("full"):
        doc["frontier"]["full"] = {"macro_loss": nat["full"]["macro_loss"], "e2e_s": nat["full"]["e2e_s"]}
    return doc


def plot_frontier(doc: dict, path: Path) -> None:
    """Held-out macro loss against end-to-end time: ours and random_subset at each budget, full as a point. A
    point with a ``note`` (its time taken beside other work, say) is labelled with a ``*`` and the note below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    notes = []
    for arm, style in (("ours", "o-"), ("random_subset", "s--")):
        pts = doc["frontier"].get(arm) or []
        if pts:
            ax.plot([p["e2e_s"] for p in pts], [p["macro_loss"] for p in pts], style, label=arm)
            for p in pts:
                ax.annotate(f"{p['budget']:g}" + ("*" if p.get("note") else ""), (p["e2e_s"], p["macro_loss"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=8)
                if p.get("note"):
                    notes.append(f"* {arm} {p['budget']:g}: {p['note']}")
    if doc["frontier"].get("full"):
        f = doc["frontier"]["full"]
        ax.plot([f["e2e_s"]], [f["macro_loss"]], "k*", markersize=12, label="full")
    ax.set_xlabel("end-to-end time, s (selection pass + training)")
    ax.set_ylabel("held-out macro loss (best epoch)")
    ax.set_title("natural pool, seed 0")
    ax.legend()
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.03 * len(notes), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(args, results: dict) -> dict:
    doc = summarise(args, results)
    _write_json(Path(args.results), doc)
    if any(doc["frontier"].values()):
        plot_frontier(doc, Path(args.results).with_name("frontier.png"))
    return doc


def _seeds_that_ran(arm: dict) -> dict:
    """An arm's figures without the seeds that have no ``macro_loss`` (the summary lists every seed of the run)."""
    keep = [i for i, v in enumerate(arm.get("macro_loss", [])) if v is not None]
    return {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in arm.items()}


def _join_seeds(have: dict, new: dict) -> dict:
    """One arm's figures over the seeds of both (disjoint), in seed order; a list one side lacks is None there."""
    n_have, n_new = len(have["seeds"]), len(new["seeds"])
    order = sorted(range(n_have + n_new), key=lambda i: (have["seeds"] + new["seeds"])[i])
    out = {k: v for k, v in have.items() if not isinstance(v, list)}
    for k in dict.fromkeys([*have, *new]):
        if isinstance(have.get(k, new.get(k)), list):
            both = (have.get(k) or [None] * n_have) + (new.get(k) or [None] * n_new)
            out[k] = [both[i] for i in order]
    return out


def merge_into(path: Path, doc: dict, command: str, skip: tuple[str, ...] = ()) -> dict:
    """Add the figures of ``doc`` (a :func:`summarise` result) to the results file at ``path`` and rewrite it: a
    benchmark resumed on another machine, whose earlier arms' records are gone, extends the figures already
    published. Only seeds that ran are added: a new arm with them, or an arm of the file gains seeds that have no
    figures there (its lists keep only the seeds with figures, in seed order; a key one side lacks is None there).
    Each added seed gets ``commits`` (``doc``'s commit: the checkout that summarised, whose package tree keyed the
    records) and keeps its ``load_after``; the file's ``merges`` records the arms, the command, the commit, the
    package's tree, the machine (``load_before`` None: a merge runs nothing) and the merge's date, and the losses
    of the arms named in ``skip`` (``ours`` run again only for the random arms' counts, say), which are not added
    (``not_merged``). A pool's ``full_train_s`` comes with its ``full`` arm.

    Raises:
        ValueError: ``doc`` was run with other ``settings`` (other sizes: the figures would not compare), or with
            another ``ours`` while its ``ours`` or random arms would be added (their counts follow ``ours``); it
            holds frontier points (not merged: run with ``--no-frontier``); a seed of an arm is in the file
            already (merging never replaces a published figure); or it adds nothing. Nothing is written then.
    """
    old = json.loads(path.read_text())
    if old.get("settings") != doc["settings"]:
        raise ValueError(f"settings differ: {old.get('settings')} in {path}, {doc['settings']} here")
    budgets = {pt["budget"] for pts in doc["frontier"].values() if isinstance(pts, list) for pt in pts}
    if budgets - {doc["settings"]["budget"]}:
        raise ValueError(f"frontier points (budgets {sorted(budgets)}) are not merged: run with --no-frontier")
    commit, added, not_merged = doc["machine"]["commit"], [], {}
    for pool, p in doc["pools"].items():
        ran = {}
        for arm, a in p["arms"].items():
            if arm in skip:
                not_merged[f"{pool} {arm}"] = a["macro_loss"]
            elif (kept := _seeds_that_ran(a))["seeds"]:
                ran[arm] = kept
        if not ran:
            continue
        if doc.get("ours") != old.get("ours") and {"ours", "random_subset", "random_tokens"} & set(ran):
            raise ValueError(f"ours is {doc.get('ours')!r} here and {old.get('ours')!r} in {path}")
        into = old["pools"].setdefault(pool, {**{k: p[k] for k in ("candidates", "seeds", "epochs")},
                                              "full_train_s": None, "arms": {}})
        for arm, a in ran.items():
            have = _seeds_that_ran(into["arms"].get(arm, {"seeds": [], "macro_loss": []}))
            both = set(have["seeds"]) & set(a["seeds"])
            if both:
                raise ValueError(f"{pool} {arm} seed(s) {sorted(both)} are in {path} already")
            into["arms"][arm] = _join_seeds(have, {**a, "commits": [commit] * len(a["seeds"])})
            added.append(f"{pool} {arm} (seeds {', '.join(map(str, a['seeds']))})")
        if "full" in ran and into.get("full_train_s") is None:
            into["full_train_s"] = p.get("full_train_s")
    if not added:
        raise ValueError(f"nothing to merge into {path}: no arm of this run has figures (skipped: {list(skip)})")
    machine = {k: v for k, v in doc["machine"].items() if k not in ("commit", "command", "date")}
    old.setdefault("merges", []).append({"arms": added, "commit": commit, "package_tree": _package_tree(),
                                         "machine": machine, "merged_at": doc["machine"].get("date"),
                                         "command": command, **({"not_merged": not_merged} if not_merged else {})})
    _write_json(path, old)
    return old


def headline(doc: dict) -> dict:
    """One line of figures: per pool and arm the mean macro loss over the seeds that ran."""
    out = {"commit": doc["machine"]["commit"]}
    for pool, p in doc["pools"].items():
        for arm, a in p["arms"].items():
            v = [x for x in a["macro_loss"] if x is not None]
            out[f"{pool}.{arm}.macro_loss"] = round(float(np.mean(v)), 4) if v else None
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", nargs="+", default=["natural", "balanced"], choices=["natural", "balanced"])
    p.add_argument("--arms", nargs="+", default=HEADLINE + ABLATIONS, choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--ours", choices=ABLATIONS, default=None,
                   help="run `ours` as this ablation's keys (a candidate default) instead of the package's defaults")
    p.add_argument("--ablation-seeds", type=int, default=2, help="seeds of each ablation (the first N of --seeds)")
    p.add_argument("--no-frontier", dest="frontier", action="store_false")
    p.add_argument("--candidates", type=int, default=600)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.31)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="train.precision of every arm, and bf16 autocast of the features (sketch.dtype) with bf16: "
                        "the GPU default, and 2x the fp32 speed on a CPU with AVX512-BF16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--eval-threads", type=int, default=2)
    p.add_argument("--model", default="demo")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_quality"))
    p.add_argument("--results", default=str(REPO / "bench" / "results" / "quality.json"))
    p.add_argument("--only-cached", action="store_true", help="summarise the kept arms; run nothing")
    p.add_argument("--merge-into", default=None, metavar="PATH",
                   help="with --only-cached: add the kept arms to the results file PATH (see merge_into); this "
                        "run's own summary goes to OUT/quality_to_merge.json instead of --results")
    p.add_argument("--merge-skip", nargs="+", default=[], choices=list(ARMS), metavar="ARM",
                   help="arms not to merge (ours run again only for the random arms' counts)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny pools, seed 0, results into --out")
    args = p.parse_args(argv)
    if args.merge_into:
        if not args.only_cached:
            p.error("--merge-into needs --only-cached: merge the arms of a finished run")
        args.results = str(Path(args.out) / "quality_to_merge.json")
    elif args.merge_skip:
        p.error("--merge-skip is for --merge-into")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.results = str(Path(args.out) / "quality.json")
    args.load_before = None if args.only_cached else load_average()
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    doc = run_all(args)
    if args.merge_into:
        command = shlex.join(["python", "bench/end_to_end.py", *(sys.argv[1:] if argv is None else argv)])
        merge_into(Path(args.merge_into), doc, command, tuple(args.merge_skip))
    print(json.dumps(headline(doc)))  # this run's arms (merged or not)
    return doc


if __name__ == "__main__":
    main()
