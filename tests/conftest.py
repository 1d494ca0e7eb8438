"""Shared fixtures: a tiny Llama with the real demo tokenizer, the real shared data folder."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from bench._common import shared_data_dir  # noqa: F401  (the tests' import of it: ..conftest)

# One OpenMP thread for the whole session, set before torch or scikit-learn start their thread pools. The
# pinned plan hashes (tests/test_plan_pin.py) hold for a fixed thread count: a float sum split over two threads
# rounds differently, and k-means can then break a near-tie the other way. Before, the count depended on which
# module ran first (the ray_cpu fixture set it), so a pinned test passed in the full suite and failed alone.
os.environ["OMP_NUM_THREADS"] = "1"

# Ray starts its workers at niceness 15. In the suite the other xdist worker runs at 0, so whenever it computes,
# this worker's Ray tasks and Ray Train workers got a sliver of a core: a tiny model's training step took 1.8 s
# instead of 0.7 s (measured beside a niced benchmark). Every local Ray of the suite, in-process or started by a CLI
# subprocess (which inherits the variable), gives its workers the same priority as the test that waits on them.
os.environ.setdefault("RAY_worker_niceness", "0")

# A tiny model trains its steps in well under a second, so Ray Train's fixed costs are most of a training test: the
# controller polls the workers every 2 s (a run's start and its end each wait up to one interval), and every run
# starts a preemption watcher actor (one more process) that follows node draining on autoscaled clusters, which the
# suite has none of. Propagated by Ray Train to its controller and workers, and inherited by CLI subprocesses. The
# driver's values win over the 0.5 s the package gives a local Ray it starts (pipeline.session.LOCAL_TRAIN_ENV).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

# Every local Ray the package starts in the suite (a pipeline run, a CLI or bench subprocess) starts without its
# dashboard, which nothing here looks at: 3.7 of a start's 7.9 CPU-seconds (pipeline.session.LOCAL_DASHBOARD_ENV).
os.environ.setdefault("RAY_CLUSTER_FT_LOCAL_DASHBOARD", "0")

# Under pytest-xdist (scripts/test.sh runs 2 workers) each worker gets its own Ray temp dir: a local Ray writes its
# address to <temp dir>/ray/ray_current_cluster, and a test must never find and join the other worker's cluster.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_TMPDIR"] = f"/tmp/rcft-{os.environ['PYTEST_XDIST_WORKER']}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


def pytest_collection_modifyitems(items):
    """Files with end-to-end (``slow``) tests first, each file's tests kept together: xdist hands out whole files
    (``--dist loadfile``), so the long ones start at once instead of ending the run alone. Within a file the tests
    that ask for ``ray_cpu`` come first, in file order, so that they share one Ray session."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (item.path not in slow_files, first[item.path], "ray_cpu" not in item.fixturenames))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, hidden-32 Llama saved with the SmolLM2 tokenizer (chat template included)."""
    from ray_cluster_ft.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def demo_tokenizer():
    from ray_cluster_ft.model import load_tokenizer

    return load_tokenizer("demo")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ray_kwargs(**extra) -> dict:
    """``ray.init`` arguments of a test's own local Ray: 2 CPUs, no dashboard, and a dashboard port nothing listens
    on. Without a dashboard Ray still records ``127.0.0.1:8265`` as its State API address; Ray Train's placement
    group cleaner then asks whatever answers there (the other xdist worker's pipeline, which has a dashboard) about
    this run's controller, is told it does not exist, and removes the live run's placement group: the workers die
    ("Destroying worker since its placement group was removed")."""
    return {"address": "local", "num_cpus": 2, "include_dashboard": False, "dashboard_port": free_port(), **extra}


@pytest.fixture
def ray_cpu():
    """A local Ray for the test (2 CPUs, no dashboard, ``DS_ACCELERATOR=cpu`` on its workers; Ray Train's polling
    and preemption watcher as set at the top of this file), shared with the tests before and after it that ask for
    it too: a session costs about 10 CPU-seconds to start and stop (the GCS, raylet, agents and Ray Data's
    actors), and the suite starts dozens. A pipeline run in the test joins it and leaves it running. A test that
    does not ask for it starts with none (:func:`_no_ray_unless_asked`)."""
    import ray

    if not ray.is_initialized():
        ray.init(**local_ray_kwargs(runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}}))
    return ray


def _shutdown_ray() -> None:
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_across_files():
    """Every test file starts with no Ray in this process: a file whose tests all ask for ``ray_cpu`` leaves it
    running, and the next file's module fixtures (set up before any of its tests' fixtures) must not join it."""
    _shutdown_ray()


@pytest.fixture(autouse=True)
def _no_ray_unless_asked(request):
    """Shut down the shared Ray before a test that does not ask for ``ray_cpu``: such a test may start Ray itself,
    check what the code under test starts and stops, or run a job in a fresh local Ray as a user does."""
    if "ray_cpu" not in request.fixturenames:
        _shutdown_ray()
