"""The Ray session of every entry point: :func:`ray_session` starts a new local Ray (or joins the one an address or
``$RAY_ADDRESS`` names) and shuts down what it started, also when the run is interrupted; and the checks that
make a bad address or an impossible world size fail fast instead of waiting for minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from ..config import ConfigError, JobConfig

__all__ = ["check_local_resources", "check_reachable", "ensure_ray", "init_ray", "ray_session"]


# Ray Train's settings for a Ray this process starts on its own machine. The controller polls its workers every
# 2 s by default, and a run's start, each checkpoint report and its end each wait for a poll: a short local run's
# train stage took 32-34 s with it, 24.5 s with 0.5 s (docs/benchmarks.md, "The test suite's time"). A local Ray
# has no nodes to drain, so the preemption watcher (one more actor process per run) has nothing to watch. A value
# in the driver's own environment wins: Ray Train passes it to the controller over these.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

# ``0`` starts a new local Ray without its dashboard: 3.7 CPU-s less per start on the test machine (7.9 against
# 4.2 for a start and stop, docs/operations.md), for CI and scripts that start many short runs and never look.
LOCAL_DASHBOARD_ENV = "RAY_CLUSTER_FT_LOCAL_DASHBOARD"


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` (or ``ray://host:port``) nobody listens on: ``ray.init`` retries for minutes."""
    import socket

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local" and the like: Ray resolves them itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"cannot reach a Ray cluster at {address!r}: {err}") from None


@contextlib.contextmanager
def _callers_sigterm_handler():
    """Keep the caller's SIGTERM handler through ``ray.init``. Ray 2.60 installs its own first (``sys.exit(15)``
    from whatever the main thread is doing; seen swallowed inside ``logging``'s lock, and the run then went on or
    hung), through the private ``ray._private.utils.set_sigterm_handler``: the one place that touches it.
    The handlers are put back after ``ray.init`` in any case (:func:`init_ray`), for Ray versions that set it
    elsewhere."""
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def init_ray(address: str | None, use_gpu: bool | None) -> bool:
    """Start or join Ray; returns True when this call started it (so the pipeline shuts it down).

    No ``address`` and no ``$RAY_ADDRESS`` means a new local Ray (``address="local"``): a plain ``ray.init()``
    would instead join whatever ``/tmp/ray/ray_current_cluster`` names, and a file left by a crashed
    ``ray start`` made runs hang for minutes on a dead address. Joining a running cluster takes
    ``--address auto`` (or ``$RAY_ADDRESS``).

    ``use_gpu`` False gives every Ray worker ``DS_ACCELERATOR=cpu`` (DeepSpeed on CPU workers), True nothing;
    None (a caller that does not run this project's training) no ``DS_ACCELERATOR``. Whatever ``use_gpu``, a new
    local Ray also gets :data:`LOCAL_TRAIN_ENV` (Ray Train's polling for one machine, also for a user's own
    ``TorchTrainer`` on it), less any key set in this process's environment; a joined cluster gets none. With
    ``$RAY_CLUSTER_FT_LOCAL_DASHBOARD=0`` a new local Ray starts without its dashboard.

    Raises:
        ConfigError: the address is unreachable (checked within seconds), or Ray could not start or connect, or
            (starting a local Ray) ``$RAY_CLUSTER_FT_LOCAL_DASHBOARD`` is neither ``0`` nor ``1``.
    """
    import ray

    if ray.is_initialized():
        return False
    env = {} if use_gpu or use_gpu is None else {"DS_ACCELERATOR": "cpu"}
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    options = {}
    if address == "local":
        env |= {k: v for k, v in LOCAL_TRAIN_ENV.items() if k not in os.environ}
        options = _local_dashboard_options()
    check_reachable(address)
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        with _callers_sigterm_handler():
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True, **options)
    except KeyboardInterrupt:  # the caller's handler stopped the start-up: leave no Ray behind
        if ray.is_initialized():
            ray.shutdown()
        raise
    except Exception as err:  # Ray raises a bare Exception when its node times out at start-up
        what = "start a local Ray" if address == "local" else f"join Ray at {address!r}"
        raise ConfigError(f"could not {what}: {err}") from None
    finally:
        for sig, handler in before.items():
            if handler is not None:
                signal.signal(sig, handler)
    return True


def _local_dashboard_options() -> dict:
    """``ray.init`` keywords for a new local Ray: none by default (Ray starts its dashboard); with
    ``$RAY_CLUSTER_FT_LOCAL_DASHBOARD=0`` no dashboard, on a port nothing listens on. Without a dashboard Ray
    still records ``127.0.0.1:8265`` as its State API address, and Ray Train's placement group cleaner would ask
    whatever answers there (another Ray's dashboard on this machine) about this run and be told it is gone. On
    the free port nobody answers: the cleaner logs a warning about once a second while a run trains and cannot
    clean up after a controller that dies (docs/operations.md, "Small jobs").

    Raises:
        ConfigError: the variable is set to something other than ``0`` or ``1``.
    """
    import socket

    value = os.environ.get(LOCAL_DASHBOARD_ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"${LOCAL_DASHBOARD_ENV} must be 0 (no dashboard) or 1, got {value!r}")
    if value == "1":
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"include_dashboard": False, "dashboard_port": s.getsockname()[1]}


@contextlib.contextmanager
def ray_session(address: str | None = None, use_gpu: bool | None = False):
    """The Ray session of a run: started (or joined) on entry by :func:`init_ray`, shut down on exit if this call
    started it. On ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM through the CLI) it is shut down even when joined:
    the driver's actors and workers must stop now, and a driver that leaves Ray drops them.

    Yields:
        True when this call started Ray (a Ray already initialised in this process is used as it is).

    Raises:
        ConfigError: as :func:`init_ray`.
    """
    started = init_ray(address, use_gpu)
    try:
        yield started
    except KeyboardInterrupt:
        started = True
        raise
    finally:
        if started:
            import ray

            ray.shutdown()


def ensure_ray(address: str | None = None) -> bool:
    """Ray for a caller whose results outlive the call (Ray datasets handed back to a user's own trainer): started
    or joined as :func:`ray_session` does (a new local Ray unless ``address`` or ``$RAY_ADDRESS`` names one, never
    whatever a stale ``/tmp/ray`` file names), and left running. Returns True when this call started it."""
    return init_ray(address, None)


def check_local_resources(cfg: JobConfig) -> None:
    """On a Ray this job started itself (no autoscaler), refuse a world size the machine cannot place:
    Ray Train would otherwise wait for resources forever."""
    import ray

    res = ray.cluster_resources()
    t = cfg.train
    need_cpu = t.num_workers * t.cpus_per_worker
    if need_cpu > res.get("CPU", 0):
        raise ConfigError(f"train.num_workers={t.num_workers} x train.cpus_per_worker={t.cpus_per_worker} = "
                          f"{need_cpu} CPUs, but the local Ray has {res.get('CPU', 0):g}; lower num_workers or "
                          f"join a larger cluster with --address")
    if t.use_gpu and t.num_workers > res.get("GPU", 0):
        raise ConfigError(f"train.use_gpu with train.num_workers={t.num_workers}, but the local Ray has "
                          f"{res.get('GPU', 0):g} GPUs")
