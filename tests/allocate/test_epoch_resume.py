"""The per-epoch re-cut of the cluster plan keeps the plan-exact resume: a failure injected in a re-cut epoch
of a packed cluster plan (packs hold any number of rows, so the resume cuts the trained log by the rows the
checkpoint recorded)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ray_cluster_ft.allocate import make_plan
from tests.train.test_train import make_examples


def _micro_batches(plan: pd.DataFrame, epoch: int) -> set:
    sub = plan[plan["epoch"] == epoch]
    return {frozenset(v) for v in sub.groupby(["step", "rank", "micro_index"])["example_id"].apply(tuple)}


def _inputs(n: int):
    ex = make_examples(n)
    ids = np.asarray(ex.column("example_id").to_pylist())
    n_tokens = np.asarray(ex.column("n_tokens").to_numpy(), dtype=np.int64)
    return ex, ids, n_tokens, np.arange(ids.size) % 4


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_every_epoch_recuts_the_cluster_plan(packing):
    """Epochs 1 and 2 are cut with seed + epoch: other micro-batches (packs), not only another order; every row
    once per epoch."""
    # (24 rows of 6-20 tokens would leave BFD one way to pack each cluster, jittered or not)
    _, ids, n_tokens, clusters = _inputs(48)
    kw = {"packing": True, "max_tokens_per_micro_batch": 48} if packing else {}
    plan = make_plan(ids, clusters, n_tokens, 2, 2, 1, 3, strategy="cluster", seed=1, **kw).plan
    mbs = [_micro_batches(plan, e) for e in range(3)]
    assert mbs[0] != mbs[1] and mbs[1] != mbs[2]
    assert (plan.groupby(["epoch", "example_id"]).size() == 1).all()
    assert all(set(plan.loc[plan["epoch"] == e, "example_id"]) == set(ids) for e in range(3))


@pytest.mark.slow
def test_failure_in_a_recut_epoch_resumes_to_exactly_the_planned_rows(ray_cpu, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """3 epochs of a packed cluster plan (epochs 1 and 2 re-cut with seed + epoch); rank 0 fails once at the
    second step of epoch 2; the group restarts from the last checkpoint before it and trains exactly the plan,
    with no padding and the plan's tokens per step."""
    from ray_cluster_ft.config import TrainConfig
    from ray_cluster_ft.train import train

    ex, ids, n_tokens, clusters = _inputs(24)
    plan = make_plan(ids, clusters, n_tokens, 2, 2, 1, 3, strategy="cluster", seed=1, packing=True,
                     max_tokens_per_micro_batch=48).plan
    steps = int(plan["step"].nunique())
    fail_at = int(plan.loc[plan["epoch"] == 2, "step"].min()) + 1
    cfg = TrainConfig(num_workers=2, zero_stage=2, micro_batch_size=2, grad_accum=1, epochs=3, lr=1e-3,
                      timeout_s=180, checkpoint_every=3, max_failures=1, max_tokens_per_micro_batch=48)
    monkeypatch.setenv("RAY_CLUSTER_FT_FAIL_AT_STEP", str(fail_at))
    res = train(plan, ex, cfg, str(tiny_model_dir), tmp_path / "run", pad_token_id=2, packing=True,
                save_model=False)

    assert (tmp_path / "run" / ".fault_injected").exists()
    assert res.resumed_from_step == (fail_at - 1) // 3 * 3 and res.steps == steps
    trained = pd.read_parquet(res.trained_path)
    for r in range(2):
        got, want = trained[trained["rank"] == r], plan[plan["rank"] == r]
        assert got["example_id"].tolist() == want["example_id"].tolist()
        assert got[["epoch", "step", "micro_index"]].to_numpy().tolist() == \
            want[["epoch", "step", "micro_index"]].to_numpy().tolist()
    log = [json.loads(line) for line in res.log_path.read_text().splitlines()]
    want_tokens = plan.groupby("step")["n_tokens"].sum().tolist()
    assert [row["tokens"] for row in log] == want_tokens
    assert [row["padding_tokens"] for row in log] == [0] * steps
