"""Library messages that mean nothing for this package's CPU runs, silenced once where the package starts
(``ray_cluster_ft/__init__.py`` calls :func:`quiet_library_noise`)."""

from __future__ import annotations

import logging
import os

_CPU_ACCELERATOR = "Setting accelerator to CPU"


class _DropCpuAccelerator(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it.": printed by every process that imports DeepSpeed without ``DS_ACCELERATOR`` on a machine without
    CUDA, where the CPU is the only accelerator there is (a GPU that is really missing fails later, naming
    CUDA). Every other DeepSpeed record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_CPU_ACCELERATOR)


# Seconds between Ray Data's progress blocks when stdout is no terminal (Ray's default: 10 s, so a 4-minute
# sketch printed 24 identical blocks into a log). A stage then logs one block at its start and its "finished"
# line; a job sketching for hours still gets a block every 10 minutes.
RAY_DATA_LOG_INTERVAL_S = 600


def quiet_library_noise() -> None:
    """Attach the DeepSpeed filter (once: the logger is the one DeepSpeed creates on import, by name) and set
    Ray Data's log interval for non-terminal output (``RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL``, read when Ray
    Data is imported; a value the user set is kept). Touches nothing else."""
    ds_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropCpuAccelerator) for f in ds_logger.filters):
        ds_logger.addFilter(_DropCpuAccelerator())
    os.environ.setdefault("RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL", str(RAY_DATA_LOG_INTERVAL_S))
