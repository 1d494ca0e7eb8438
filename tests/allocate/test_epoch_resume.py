"""The per-epoch re-cut of the cluster plan keeps the plan-exact resume: a failure injected in a re-cut epoch."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ray_cluster_ft.allocate import make_plan
from tests.train.test_train import make_examples


@pytest.mark.slow
def test_failure_in_a_recut_epoch_resumes_to_exactly_the_planned_rows(ray_cpu, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """3 epochs of a cluster plan (epochs 1 and 2 re-cut with seed + epoch); rank 0 fails once at step 13, in
    epoch 2; the group restarts from the checkpoint of step 10 (epoch 1) and trains exactly the plan."""
    from ray_cluster_ft.config import TrainConfig
    from ray_cluster_ft.train import train

    ex = make_examples(24)
    ids = np.asarray(ex.column("example_id").to_pylist())
    n_tokens = np.asarray(ex.column("n_tokens").to_numpy(), dtype=np.int64)
    clusters = np.arange(ids.size) % 4
    plan = make_plan(ids, clusters, n_tokens, 2, 2, 1, 3, strategy="cluster", seed=1).plan
    assert plan["step"].nunique() == 18 and plan.loc[plan["step"] == 13, "epoch"].unique().tolist() == [2]
    mbs = [{frozenset(v) for v in plan[plan["epoch"] == e].groupby(["step", "rank"])["example_id"].apply(tuple)}
           for e in range(3)]
    assert mbs[0] != mbs[1] and mbs[1] != mbs[2]  # re-cut: other micro-batches, not only another order

    cfg = TrainConfig(num_workers=2, zero_stage=2, micro_batch_size=2, grad_accum=1, epochs=3, lr=1e-3,
                      timeout_s=180, checkpoint_every=5, max_failures=1)
    monkeypatch.setenv("RAY_CLUSTER_FT_FAIL_AT_STEP", "13")
    res = train(plan, ex, cfg, str(tiny_model_dir), tmp_path / "run", pad_token_id=2, save_model=False)

    assert (tmp_path / "run" / ".fault_injected").exists()
    assert res.resumed_from_step is not None and res.resumed_from_step <= 13
    assert res.steps == 18
    trained = pd.read_parquet(res.trained_path)
    for r in range(2):
        got = trained[trained["rank"] == r]
        want = plan[plan["rank"] == r]
        assert got["example_id"].tolist() == want["example_id"].tolist()
        assert got[["epoch", "step", "micro_index"]].to_numpy().tolist() == \
            want[["epoch", "step", "micro_index"]].to_numpy().tolist()
    assert (trained.groupby(["epoch", "example_id"]).size() == 1).all()
