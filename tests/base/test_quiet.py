"""The library noise silenced where the package starts (ray_cluster_ft/_quiet.py): DeepSpeed's CPU-accelerator
warning only, and Ray Data's non-terminal progress interval unless the user set one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import ray_cluster_ft  # noqa: F401  (the package start attaches the filter)


def test_deepspeed_cpu_warning_is_dropped_and_nothing_else(caplog):
    log = logging.getLogger("DeepSpeed")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    log.addHandler(handler)
    try:
        log.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        log.warning("Setting accelerator to cuda (override)")
        log.error("ZeRO stage 3 needs more memory")
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Setting accelerator to cuda (override)", "ZeRO stage 3 needs more memory"]
    ray_cluster_ft._quiet.quiet_library_noise()  # a second call adds no second filter
    assert sum(type(f).__name__ == "_DropCpuAccelerator" for f in log.filters) == 1


def test_ray_data_interval_is_set_unless_the_user_chose_one(tmp_path):
    code = "import os, ray_cluster_ft; print(os.environ['RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL'])"
    env = {k: v for k, v in os.environ.items() if k != "RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "600"
    env["RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL"] = "5"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "5"
