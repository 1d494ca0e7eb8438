"""ray-cluster-ft: clustering-based balanced sampling and allocation (CluSTER, Kim et al., EMNLP 2026) for
data-parallel fine-tuning, as a distributed workflow on Ray: Ray Data actors compute per-example features, the
driver clusters them, selects a balanced subset and plans which rank trains which example at which step, and
Ray Train + DeepSpeed workers train exactly that plan.

The stages, one module or package each, every one a ``run(cfg, run_dir, ...)`` that owns its artifacts
(docs/design.md):

* :mod:`ray_cluster_ft.data`: sources -> tokenized examples + rejected rows; the one :func:`collate`;
* :mod:`ray_cluster_ft.features`: pooled hidden states, gradient sketches, the last-layer proxy or embeddings by Ray
  Data actors, resumable shards;
* :mod:`ray_cluster_ft.cluster`: spherical k-means (or the published KMeans with a soft cap);
  :mod:`ray_cluster_ft.select`: water-filled quotas per group of clusters and per cluster, a sample or k-center
  picks inside (or the published equal cuts); :mod:`ray_cluster_ft.allocate`: the rank x step plan (pure algorithms, no Ray);
* :mod:`ray_cluster_ft.train`: Ray Train + DeepSpeed workers that train exactly their planned rows;
* :mod:`ray_cluster_ft.evaluate`: held-out loss, multiple-choice accuracy, pass@1;
* :func:`run_pipeline` (:mod:`ray_cluster_ft.pipeline`) runs them in order; ``ray-cluster-ft`` is the CLI;
* :func:`compute_features` and :func:`select_and_plan` (:mod:`ray_cluster_ft.api`): the same features, clusters,
  selection and plan as a library, with no run directory;
* :mod:`ray_cluster_ft.integrations`: the plan in your own trainer (a torch ``PlanBatchSampler``, a Hugging Face
  ``PlanTrainer``, Ray Train datasets and ``DataConfig``).

The stage packages keep their names (``ray_cluster_ft.train`` is the package, its driver is
``ray_cluster_ft.train.train``). Configs are pydantic models (:class:`JobConfig` and its sections), read from YAML by :func:`load_config`.
"""

from ._lazy import lazy_exports
from ._quiet import quiet_library_noise

quiet_library_noise()  # before any stage imports DeepSpeed or Ray Data

__version__ = "0.1.0"

# Imported on first use (PEP 562): `import ray_cluster_ft` and `ray-cluster-ft check` load neither torch nor Ray.
_WHERE = {
    "PlanResult": "allocate", "check_plan": "allocate", "make_plan": "allocate", "plan_metrics": "allocate",
    "Features": "api", "Plan": "api", "compute_features": "api", "select_and_plan": "api",
    "ClusterResult": "cluster", "cluster_sketches": "cluster",
    **{name: "config" for name in (
        "AllocationConfig", "ClusteringConfig", "ConfigError", "DataConfig", "EvaluationConfig", "JobConfig",
        "LoraConfig", "ModelConfig", "OutputConfig", "SelectionConfig", "SketchConfig", "TrainConfig",
        "load_config", "parse_config")},
    "collate": "data", "load_examples": "data",
    "compute_sketches": "features", "read_sketches": "features",
    "run_pipeline": "pipeline",
    "SelectionResult": "select",
    "TrainResult": "train",
}
_SUBMODULES = ("allocate", "api", "cli", "cluster", "config", "data", "evaluate", "features", "integrations",
               "model", "pipeline", "rundir", "select", "train")

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, _SUBMODULES)
