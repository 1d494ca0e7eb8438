"""The sketch actor pool's size, the shard layout it implies without starting Ray, and the progress bar of the
rows sketched in this process: helpers of the feature stage (:mod:`.stage`)."""

from __future__ import annotations

import os

from ..config import SketchConfig


def _actor_resources(cfg: SketchConfig, use_gpu: bool, gpu_actors: int | None = None) -> tuple[int, float]:
    """(number of actors, CPUs each) for the sketch pool.

    Actors: ``cfg.num_actors``; else with ``use_gpu`` ``gpu_actors`` (the job's ``train.num_workers``: on an
    autoscaling cluster the GPUs present at start are 0 or 1, and Ray's autoscaler brings up the ones asked
    for), or one per GPU present; else one per CPU; at least 1.
    CPUs: 1 each, but never more than ``CPU - 1`` in all: a pool holding every CPU starves Ray Data's read
    and write tasks, and the job hangs (seen with ``read_parquet`` on 2 CPUs). A fractional share still
    runs one torch thread (Ray sets ``OMP_NUM_THREADS`` to ``max(1, floor(cpus))``).
    """
    import ray

    if not ray.is_initialized():
        ray.init(address="local")  # never whatever cluster a stale /tmp/ray file names
    res = ray.cluster_resources()
    return _pool_size(cfg, use_gpu, gpu_actors, float(res.get("CPU", 1.0)), float(res.get("GPU", 0)))


def _pool_size(cfg: SketchConfig, use_gpu: bool, gpu_actors: int | None, n_cpu: float, n_gpu: float
               ) -> tuple[int, float]:
    """:func:`_actor_resources` for a cluster of ``n_cpu`` CPUs and ``n_gpu`` GPUs."""
    if cfg.num_actors is not None:
        n = cfg.num_actors
    elif use_gpu:
        n = max(1, int(gpu_actors if gpu_actors is not None else n_gpu))
    else:
        n = max(1, int(n_cpu))
    return n, min(1.0, max(n_cpu - 1.0, 0.0) / n)


def _layout_actors(cfg: SketchConfig, use_gpu: bool, gpu_actors: int | None) -> tuple[int, float]:
    """The pool the shards are cut for: :func:`_actor_resources` on a running Ray; without one, the pool a new
    local Ray on this machine would get (one CPU slot a core), computed without starting it, so that a job
    sketched in the driver (``sketch.in_process_rows``) writes the shards a pool would, and a re-run through
    a pool reuses them."""
    import ray

    if ray.is_initialized():
        return _actor_resources(cfg, use_gpu, gpu_actors)
    try:
        n_cpu = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n_cpu = os.cpu_count() or 1
    return _pool_size(cfg, use_gpu, gpu_actors, float(n_cpu), 0.0)


def _row_bar(total: int):
    """The feature stage's one progress bar where no Ray Data runs (rows sketched in this process); on a
    terminal it redraws in place, in a log it adds a line at most every 30 s."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, desc="sketch (in this process)", unit="row", dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)
