"""The run's ``manifest.json``: config, seeds, versions, the counts that account for every input row, the
checks of what was trained against the plan, and stage timings."""

from __future__ import annotations

import json
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..train.driver import NOT_TRAINED

__all__ = ["StageTimer", "feature_counts", "features_manifest", "pipeline_manifest", "versions", "write_manifest"]


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

    def finish(self) -> dict[str, float]:
        """The timings with ``total`` (wall seconds since the timer started) added."""
        self.timings["total"] = round(time.perf_counter() - self.t_start, 3)
        return self.timings


def versions() -> dict:
    """Versions of the packages a run's figures depend on."""
    from importlib.metadata import version

    import ray
    import sklearn
    import torch
    import transformers

    return {
        "ray_cluster_ft": version("ray-cluster-ft"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        # Read from the metadata: importing DeepSpeed costs 5-20 s on 2 cores, more than a small select run.
        "deepspeed": version("deepspeed"),
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


def pipeline_manifest(cfg, run_dir: Path, timer: StageTimer, *, spec: dict, resumed: bool, models: dict, data,
                      features, cluster, select, allocate, train, before, after, epochs=None,
                      profile: dict | None = None) -> dict:
    """The manifest of a run from its stages' outputs: config, seeds, versions, counts, budget, checks,
    evaluation, training figures and timings (``timings["total"]`` is set here).

    Counts add up: ``read = accepted + rejected``, ``accepted = selected + not_selected``, and
    ``not_selected`` splits into held out, below the budget and dropped for an even plan;
    ``features_computed + features_reused`` is the rows featurised (:func:`feature_counts`). ``tokens_candidates``
    / ``tokens_selected`` (the planned rows' tokens, each row once) and their share; ``budget.tokens_requested``
    is the token budget (``selection.budget_tokens``; None when the budget counts rows).

    Args:
        cfg: the job config.
        run_dir: the run directory.
        timer: the recipe's :class:`StageTimer`.
        spec: the job config as the user gave it, before model names were resolved (the manifest's ``config``).
        resumed: the run continued a stopped one.
        models: the resolved model folders (:func:`ray_cluster_ft.model.resolve_models`).
        data: the :class:`~ray_cluster_ft.data.DataOutput`.
        features: the :class:`~ray_cluster_ft.features.FeaturesOutput`, or None (nothing clustered).
        cluster: the :class:`~ray_cluster_ft.cluster.ClusterOutput`, or None.
        select: the :class:`~ray_cluster_ft.select.SelectOutput`.
        allocate: the :class:`~ray_cluster_ft.allocate.AllocateOutput`.
        train: the :class:`~ray_cluster_ft.train.TrainOutput`, or None (plan only).
        before, after: the :class:`~ray_cluster_ft.evaluate.EvaluateOutput` before and after training, or None
            (plan only).
        epochs: with ``evaluation.every_epoch``, the per-epoch rows (the manifest's ``eval_epochs``; the best
            one's epoch and model folder go to ``eval.best_epoch`` and ``eval.best_model``), else None.
        profile: what each cluster holds (``ray_cluster_ft.pipeline._clusters.cluster_profile``: ``source_field``,
            ``nmi``, ``clusters``), added to the manifest's ``clustering``; None when nothing was clustered.

    Returns:
        The manifest dict, keys in the order ``manifest.json`` has them.
    """
    manifest: dict = {"config": spec, "run_dir": str(run_dir), "argv": sys.argv,
                      "resumed": resumed, "models": models}
    if features is not None:
        manifest["sketch"] = features.summary
    if cluster is not None:
        manifest["clustering"] = {**cluster.summary, **(profile or {})}
    manifest["plan_metrics"] = allocate.summary
    manifest["allocation"] = allocate.packing
    check = train.checks if train is not None else dict(NOT_TRAINED)
    d = data.summary
    n_train, n_eval = d["candidates"], d["held_out"]
    plan = allocate.plan
    n_sel = int(plan["example_id"].nunique())
    dropped = len(allocate.result.dropped)
    budget = select.summary
    requested = budget["requested"]
    tokens_candidates = int(np.asarray(data.result.train.column("n_tokens").to_numpy(), dtype=np.int64).sum())
    tokens_selected = int(plan.drop_duplicates("example_id")["n_tokens"].sum())
    manifest.update(
        counts={
            "read": d["read"],
            "accepted": d["accepted"],
            "rejected": d["rejected"],
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
            "truncated": d["truncated"],
            "rejected_by_reason": d["rejected_by_reason"],
            **feature_counts(manifest.get("sketch")),
        },
        budget={"requested": requested, "planned": n_sel, "rounded_down_by": dropped,
                "tokens_requested": budget["tokens_requested"],
                **{k: budget[k] for k in ("groups", "group_quotas") if k in budget}},
        checks=check,
        eval={"before": (before.summary if before else None) or {}, "after": (after.summary if after else None) or {}},
        data_files=data.files,
        eval_files=_eval_files(data, before, after),
        train=None if train is None else train.summary,
        seeds={"data": cfg.data.seed, "sketch": cfg.sketch.seed, "clustering": cfg.clustering.seed,
               "selection": cfg.selection.seed, "allocation": cfg.allocation.seed, "train": cfg.train.seed},
        versions=versions(),
    )
    if epochs is not None:
        best = next((e for e in epochs if e["best"]), None)
        manifest["eval"].update(best_epoch=best["epoch"] if best else None, best_model=best["model"] if best else None)
        manifest["eval_epochs"] = epochs
    manifest["timings_s"] = timer.finish()
    return manifest


def features_manifest(cfg, run_dir: Path, timer: StageTimer, *, data, features) -> dict:
    """The manifest of ``ray-cluster-ft features`` (:func:`ray_cluster_ft.pipeline.run_features`): ``{"command":
    "features", "config", "run_dir", "argv", "counts": {"read", "accepted", "rejected", "held_out",
    "candidates", "features_computed", "features_reused"}, "sketch" (the feature stage's summary), "seeds",
    "timings_s"}``."""
    d = data.summary
    counts = {k: d[k] for k in ("read", "accepted", "rejected", "held_out", "candidates")}
    return {"command": "features", "config": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "argv": sys.argv,
            "counts": {**counts, **feature_counts(features.summary)}, "data_files": data.files,
            "sketch": features.summary,
            "seeds": {"data": cfg.data.seed, "sketch": cfg.sketch.seed}, "timings_s": timer.finish()}


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """``run_dir/manifest.json``: the one place it is written (floats of numpy types as floats)."""
    (Path(run_dir) / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float))


def _eval_files(data, before, after) -> dict:
    """Per ``evaluation.paths`` file: rows read, scored and rejected, rows that are also training candidates
    (same content hash: the file overlaps the training data), per file it names the formats and unused text
    fields (``data_files``, as the top-level ``data_files``), and the scores before and after training."""
    out = {}
    stats = data.eval_file_stats
    for path, res in data.eval_files.items():
        out[path] = {"read": res.n_read, "scored": res.train.num_rows, "rejected": len(res.rejected),
                     "overlap_with_candidates": data.eval_overlap[path], "data_files": stats[path],
                     "before": before.files.get(path, {}) if before else {},
                     "after": after.files.get(path, {}) if after else {}}
    return out
