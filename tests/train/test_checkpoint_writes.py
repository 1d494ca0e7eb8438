"""Checkpoints are written once, straight into Ray Train's run folder on the run's storage (no temporary folder
copied by Ray), and ``train.final_checkpoint: false`` leaves no checkpoint behind, only ``final_model/``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train import train
from ray_cluster_ft.train.checkpoints import checkpoint_problem
from ray_cluster_ft.train.loop import checkpoint_dir_name
from tests.train.test_train import make_examples, make_plan


def _temp_checkpoint_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("ds_ckpt_*")}


def test_checkpoint_dir_names_sort_by_step():
    names = [checkpoint_dir_name(s) for s in (2, 10, 100)]
    assert names == sorted(names) == ["checkpoint_step000002", "checkpoint_step000010", "checkpoint_step000100"]


@pytest.mark.slow
@pytest.mark.parametrize("final_checkpoint", [True, False], ids=["final", "no-final"])
def test_checkpoints_are_written_in_place_once(ray_cpu, tiny_model_dir, tmp_path, final_checkpoint):
    ex = make_examples(8)
    cfg = TrainConfig(num_workers=2, zero_stage=2, micro_batch_size=2, grad_accum=1, epochs=1, lr=1e-3, timeout_s=120,
                      checkpoint_every=1, final_checkpoint=final_checkpoint)
    plan = make_plan(ex.column("example_id").to_pylist(), world=2, mbs=2, ga=1, epochs=1)
    before = _temp_checkpoint_dirs()
    res = train(plan, ex, cfg, str(tiny_model_dir), tmp_path / "run", pad_token_id=2)
    storage = tmp_path / "run" / "ray_train" / "train"
    left = sorted(p.name for p in storage.glob("checkpoint_*") if p.is_dir())  # not Ray's own snapshot file
    assert res.steps == 2 and (res.final_model_dir / "config.json").is_file()
    assert _temp_checkpoint_dirs() == before  # nothing staged in a temporary folder
    if not final_checkpoint:
        assert left == [] and res.checkpoint_path is None
        return
    # the step-1 checkpoint was replaced by the final one; the final one is where the workers wrote it
    assert left == [checkpoint_dir_name(2)] and res.checkpoint_path == str(storage / checkpoint_dir_name(2))
    from ray_cluster_ft.train.rank_data import plan_hash

    done, why = checkpoint_problem(storage / left[0], 2, plan_hash(plan))
    assert why is None and done == 2
    pos = json.loads((storage / left[0] / "plan_position_rank1.json").read_text())
    assert pos["steps_done"] == 2 and any(name.endswith("optim_states.pt") for name in pos["files"])
