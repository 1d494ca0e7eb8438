"""Orchestration: the stages in order, and what belongs to no single stage.

* :mod:`.recipe`: :func:`run_pipeline` (the whole job) and :func:`run_features` (data and features only), each
  stage's ``run(cfg, run_dir, *, inputs) -> <Stage>Output`` in turn, timed;
* :mod:`.session`: :func:`ray_session`, the one Ray session of every entry point;
* :mod:`.warmup`: the warm-up training of the sketch model before features (it trains, so it sits here, above
  the training stage);
* :mod:`.manifest`: ``manifest.json`` from the stage outputs; :mod:`.report`: ``report.md`` and its figures.
"""

from .recipe import run_features, run_pipeline
from .session import ray_session
from .warmup import warm_up

__all__ = ["ray_session", "run_features", "run_pipeline", "warm_up"]
