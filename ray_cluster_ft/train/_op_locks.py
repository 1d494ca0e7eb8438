"""Stale build locks of DeepSpeed's compiled ops.

Under ``train.offload`` DeepSpeed compiles its CPU Adam with torch's JIT builder, which holds the file
``<TORCH_EXTENSIONS_DIR>/<op>/lock`` while ninja runs and, in every other process, waits for that file to go away,
with no time limit and no message (``torch.utils.file_baton.FileBaton.wait``). A build that was killed (Ctrl-C, a
lost worker, a timeout) leaves the file behind, and every later run on that node hangs in ``deepspeed.initialize``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _working_dirs() -> set[str]:
    """Real paths of the working folders of this node's processes we may read (``/proc``; empty elsewhere)."""
    dirs = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return dirs
    for pid in pids:
        try:
            dirs.add(os.path.realpath(os.readlink(f"/proc/{pid}/cwd")))
        except OSError:  # gone, or another user's
            continue
    return dirs


def clear_stale_build_locks(root: str | os.PathLike | None = None, min_age_s: float = 120.0) -> list[Path]:
    """Remove the op build locks under ``root`` that no build holds any more, printing one warning line each.

    A lock ``root/<op>/lock`` is stale when its file is older than ``min_age_s`` seconds and no process on this node
    has ``root/<op>`` as its working folder: torch runs ninja and the compiler there for the whole build, and takes
    the lock only milliseconds before. A fresh lock, or one whose build is running, is left alone, so concurrent
    workers of one node still build once. The check reads ``/proc``, so only Linux removes anything; a cache shared
    by several nodes (a network home) should be moved to a node-local folder with ``RAY_CLUSTER_FT_CACHE``, since a
    build on another node is not visible here.

    Args:
        root: the extensions folder; default ``$TORCH_EXTENSIONS_DIR`` (the trainer sets it to
            ``cache_dir()/torch_extensions``), nothing done when neither is set or the folder is missing.
        min_age_s: seconds a lock must have existed before it can be stale.

    Returns:
        The removed lock files.
    """
    root = root if root is not None else os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root or not Path(root).is_dir() or not os.path.isdir("/proc"):
        return []
    ages = {p: time.time() - p.stat().st_mtime for p in Path(root).glob("*/lock")}
    locks = {p: age for p, age in ages.items() if age > min_age_s}
    if not locks:
        return []
    busy = _working_dirs()
    removed = []
    for lock, age in locks.items():
        if os.path.realpath(lock.parent) in busy:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:  # another worker of this node removed it first
            continue
        print(f"[ray-cluster-ft] warning: removed the build lock {lock}, left {age / 60:.0f} min ago by a build that "
              "was stopped; the op is built again", flush=True)
        removed.append(lock)
    return removed
