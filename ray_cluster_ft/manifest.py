"""The run's ``manifest.json``: config, seeds, versions, the counts that account for every input row, the
checks of what was trained against the plan, and stage timings."""

from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["StageTimer", "feature_counts", "versions", "write_manifest"]


class StageTimer:
    """Wall seconds per stage (``timings_s`` in the manifest), with a progress line at each start and end."""

    def __init__(self):
        self.t_start = time.perf_counter()
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        print(f"[ray-cluster-ft] {name} ...", flush=True)
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.timings[name] = round(dt, 3)
        print(f"[ray-cluster-ft] {name} done in {dt:.1f} s", flush=True)


def versions() -> dict:
    """Versions of the packages a run's figures depend on."""
    from importlib.metadata import version

    import deepspeed
    import ray
    import sklearn
    import torch
    import transformers

    return {
        "ray_cluster_ft": version("ray-cluster-ft"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
        "numpy": np.__version__,
    }


def feature_counts(sketch: dict | None) -> dict:
    """``features_computed`` (rows featurised by this run) and ``features_reused`` (rows read from the feature
    store, ``sketch.store``, or from finished shards of an interrupted run): they add up to the rows featurised,
    0 and 0 when the job computed no features. From the feature stage's summary (the manifest's ``sketch``)."""
    sketch = sketch or {}
    return {"features_computed": int(sketch.get("features_computed", 0)),
            "features_reused": int(sketch.get("features_reused", 0))}


def write_manifest(run_dir: Path, cfg, manifest: dict, timer: StageTimer, *, data, selection, allocation,
                   tres=None, scores: dict | None = None) -> dict:
    """Fill ``manifest`` with counts, budget, checks, evaluation, training figures, seeds, versions and timings;
    write ``manifest.json``.

    Counts add up: ``read = accepted + rejected``, ``accepted = selected + not_selected``, and
    ``not_selected`` splits into held out, below the budget and dropped for an even plan;
    ``features_computed + features_reused`` is the rows featurised (:func:`feature_counts`). ``tokens_candidates``
    / ``tokens_selected`` (the planned rows' tokens, each row once) and their share; ``budget.tokens_requested``
    is the token budget (``selection.budget_tokens``; None when the budget counts rows).

    Args:
        data: the data stage's :class:`~ray_cluster_ft.data.DataStage`.
        selection: the select stage's :class:`~ray_cluster_ft.select.SelectOutput`.
        allocation: the allocation stage's :class:`~ray_cluster_ft.allocate.AllocationStage`.
        tres: the :class:`~ray_cluster_ft.train.TrainResult`, or ``None`` (plan only).
        scores: held-out metrics ``before``/``after`` training, and per ``evaluation.paths`` file
            ``files_before``/``files_after`` (``{path: metrics}``); ``{}`` for a plan-only run.

    Returns:
        The manifest; ``checks`` holds :func:`ray_cluster_ft.train.verify_trained` of the trained log.
    """
    from .train import verify_trained

    scores = scores or {}
    if tres is not None:
        check = verify_trained(allocation.plan, pd.read_parquet(run_dir / "trained.parquet"))
    else:
        check = {"matches_plan": None, "once_per_epoch": None, "distinct_trained": 0, "mismatched_ranks": []}
    d = data.result
    n_train, n_eval = d.train.num_rows, d.eval.num_rows
    n_sel = int(allocation.plan["example_id"].nunique())
    dropped = len(allocation.result.dropped)
    requested = int(selection.requested)
    tokens_candidates = int(np.asarray(d.train.column("n_tokens").to_numpy(), dtype=np.int64).sum())
    tokens_selected = int(allocation.plan.drop_duplicates("example_id")["n_tokens"].sum())
    manifest.update(
        counts={
            "read": d.n_read,
            "accepted": n_train + n_eval,
            "rejected": len(d.rejected),
            "held_out": n_eval,
            "candidates": n_train,
            "selected": n_sel,
            "not_selected": n_train + n_eval - n_sel,
            "not_selected_breakdown": {"held_out": n_eval, "below_budget": n_train - requested,
                                       "dropped_for_even_plan": dropped},
            "trained": check["distinct_trained"],
            "tokens_candidates": tokens_candidates,
            "tokens_selected": tokens_selected,
            "tokens_selected_share": tokens_selected / tokens_candidates if tokens_candidates else 0.0,
            "truncated": d.truncated,
            "rejected_by_reason": data.reasons,
            **feature_counts(manifest.get("sketch")),
        },
        budget={"requested": requested, "planned": n_sel, "rounded_down_by": dropped,
                "tokens_requested": getattr(selection, "tokens_requested", None)},
        checks=check,
        eval={"before": scores.get("before") or {}, "after": scores.get("after") or {}},
        eval_files=_eval_files(data, scores),
        train=None if tres is None else {
            "steps": tres.steps, "seconds": tres.seconds, "final_loss": tres.final_loss,
            "final_model": str(tres.final_model_dir) if tres.final_model_dir else None,
            "step_time_p50_s": list(tres.step_time_p50_s), "step_time_p90_s": list(tres.step_time_p90_s),
            "wait_mean_s": list(tres.wait_mean_s), "resumed_from_step": tres.resumed_from_step},
        seeds={"data": cfg.data.seed, "sketch": cfg.sketch.seed, "clustering": cfg.clustering.seed,
               "selection": cfg.selection.seed, "allocation": cfg.allocation.seed, "train": cfg.train.seed},
        versions=versions(),
    )
    timer.timings["total"] = round(time.perf_counter() - timer.t_start, 3)
    manifest["timings_s"] = timer.timings
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float))
    return manifest


def _eval_files(data, scores: dict) -> dict:
    """Per ``evaluation.paths`` file: rows read, scored and rejected, rows that are also training candidates
    (same content hash: the file overlaps the training data), and the scores before and after training."""
    out = {}
    for path, res in data.eval_files.items():
        out[path] = {"read": res.n_read, "scored": res.train.num_rows, "rejected": len(res.rejected),
                     "overlap_with_candidates": data.eval_overlap[path],
                     "before": scores.get("files_before", {}).get(path, {}),
                     "after": scores.get("files_after", {}).get(path, {})}
    return out
