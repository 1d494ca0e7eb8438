"""The per-epoch re-cut of the cluster plan. That it keeps the plan-exact resume (a failure injected in a re-cut
epoch of a packed cluster plan, resumed by the rows the checkpoint recorded) is checked on the injected-failure
run of ``tests/train/test_train.py``: each Ray Train run costs about 20 s of the suite."""

from __future__ import annotations

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
