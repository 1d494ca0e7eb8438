"""Checkpoint folder names. That checkpoints are written once, straight into Ray Train's run folder, and that
``train.final_checkpoint: false`` leaves none behind, is checked on the runs of ``test_train.py`` (the injected
failure run and the ZeRO-0 run): each Ray Train run costs about 20 s of the suite."""

from __future__ import annotations

from ray_cluster_ft.train.loop import checkpoint_dir_name


def test_checkpoint_dir_names_sort_by_step():
    names = [checkpoint_dir_name(s) for s in (2, 10, 100)]
    assert names == sorted(names) == ["checkpoint_step000002", "checkpoint_step000010", "checkpoint_step000100"]
