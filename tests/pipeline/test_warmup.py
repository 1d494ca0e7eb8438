"""The warm-up of the sketch model before features (ray_cluster_ft.pipeline.warmup): its sample and its plan."""

from __future__ import annotations

import numpy as np
import pytest

from ray_cluster_ft.config import SketchConfig


def test_warmup_sample_and_plan():
    from ray_cluster_ft.allocate import check_plan
    from ray_cluster_ft.config import TrainConfig
    from ray_cluster_ft.pipeline.warmup import warmup_plan, warmup_sample

    assert warmup_sample(364, 8, 4, 0.05) == (16, 2)  # 18 rows -> 2 whole steps; 4 steps need 2 epochs
    assert warmup_sample(1000, 8, 3, 0.5) == (496, 1)
    assert warmup_sample(100, 8, 5, 0.001) == (8, 5)  # at least one step's worth
    assert warmup_sample(20, 8, 1, 1.0) == (16, 1)
    for bad in ((7, 8, 1, 0.5), (100, 8, 0, 0.5), (100, 8, 1, 0.0), (100, 0, 1, 0.5)):
        with pytest.raises(ValueError):
            warmup_sample(*bad)
    ids = np.asarray([f"x{i:03d}" for i in range(200)])
    nt = np.arange(200) % 50 + 10
    tcfg = TrainConfig(num_workers=2, micro_batch_size=2, grad_accum=2)
    scfg = SketchConfig(method="hidden_mean", warmup_steps=5, warmup_fraction=0.1, seed=3)
    plan = warmup_plan(ids, nt, tcfg, scfg)
    assert check_plan(plan, 2, 2, 2) == 5
    assert plan["example_id"].nunique() == 16 and set(plan["example_id"]) <= set(ids)  # 20 rows -> 16, 2 epochs
    assert plan.equals(warmup_plan(ids, nt, tcfg, scfg))
    assert set(warmup_plan(ids, nt, tcfg, scfg.model_copy(update={"seed": 4}))["example_id"]) != set(plan["example_id"])
