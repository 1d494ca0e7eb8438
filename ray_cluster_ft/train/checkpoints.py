"""Checkpoints on disk: which is the newest complete one, and pruning the rest.

A Ray Train checkpoint of this trainer is a folder ``checkpoint_*`` under ``run_dir/ray_train/train`` holding
every rank's DeepSpeed files and one ``plan_position_rank{r}.json`` per rank (written by the worker loop) that
lists the files the rank wrote, with their sizes. Ray records a checkpoint only once every rank reported it, and
an interrupt can stop the run between the files reaching the disk and that record: the newest complete
checkpoint on disk can be ahead of Ray's latest. "Complete" means: a position file for every rank, all for this
plan and the same step, and every file they list present at its size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["checkpoint_problem", "newest_complete_checkpoint", "prune_checkpoints"]


def checkpoint_problem(folder: Path, world_size: int, plan_hash: str) -> tuple[int, str | None]:
    """``(micro-batches done, None)`` for a complete checkpoint folder, else ``(-1, why it is not)``."""
    steps = set()
    done = -1
    for r in range(world_size):
        pos_file = folder / f"plan_position_rank{r}.json"
        try:
            pos = json.loads(pos_file.read_text())
        except (OSError, ValueError):
            return -1, f"no readable plan position of rank {r}"
        if pos.get("plan_hash") != plan_hash:
            return -1, "written for another plan"
        if not isinstance(pos.get("files"), dict):
            return -1, f"rank {r}'s plan position lists no files (an older checkpoint layout)"
        for name, size in pos["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != size:
                return -1, f"rank {r}'s file {name} is missing or cut short"
        steps.add((pos.get("steps_done"), pos.get("tag")))
        done = int(pos["micro_batches_done"])
    if len(steps) != 1:
        return -1, f"the ranks' positions disagree: {sorted(map(str, steps))}"
    return done, None


def newest_complete_checkpoint(storage: Path, world_size: int, plan_hash: str) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint folder under ``storage`` (``run_dir/ray_train/train``), and one line per
    folder skipped as incomplete.

    Returns:
        ``(path or None, skipped)``; the newest is the one furthest along the plan, the later name on ties.
    """
    best: tuple[int, str] | None = None
    skipped = []
    for folder in sorted(Path(storage).glob("checkpoint_*")) if Path(storage).is_dir() else []:
        if not folder.is_dir():
            continue
        done, why = checkpoint_problem(folder, world_size, plan_hash)
        if why is not None:
            skipped.append(f"{folder.name}: {why}")
        elif best is None or done >= best[0]:
            best = (done, str(folder))
    return (best[1] if best else None), skipped


def prune_checkpoints(storage: Path, keep: str | None) -> list[str]:
    """Delete every ``checkpoint_*`` folder under ``storage`` except ``keep``; returns the names removed. Ray
    keeps ``num_to_keep`` of the checkpoints it recorded; this removes the ones an interrupted run left behind
    that Ray never recorded."""
    removed = []
    keep_name = Path(keep).name if keep else None
    for folder in sorted(Path(storage).glob("checkpoint_*")) if Path(storage).is_dir() else []:
        if folder.is_dir() and folder.name != keep_name:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed
