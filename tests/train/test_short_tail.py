"""The published plan's short tail, trained: each rank's last micro-batch of an epoch holds fewer rows and the
epoch's last step fewer than ``grad_accum`` micro-batches (``allocation.strategy: cluster_per_rank`` rounds
nothing). DeepSpeed must step at the plan's boundaries (``set_gradient_accumulation_boundary``) and the loss
stay token-exact and weighted: the trained weights equal a single process taking the same optimizer steps. The
plans without a short tail (G micro-batches every step) get the same check on ``tests/train/test_train.py``'s
injected-failure run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ray_cluster_ft.allocate import make_plan
from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train import build_rank_tables, train
from ray_cluster_ft.train.loop import _PlanOrder
from tests.train.test_train import assert_weights_match, make_examples, reference_steps


def _short_tail_plan(ex, epochs: int):
    """10 rows in 2 clusters of 5, W = 2, B = 2, G = 2: per rank and epoch micro-batches of 2, 2, 1 rows, i.e. a
    step of 2 micro-batches and a step of 1."""
    ids = np.asarray(ex.column("example_id").to_pylist())
    return make_plan(ids, np.repeat([0, 1], 5), np.asarray(ex.column("n_tokens").to_numpy()), 2, 2, grad_accum=2,
                     epochs=epochs, strategy="cluster_per_rank", seed=4).plan


def test_rank_tables_and_order_check_follow_a_short_last_step():
    ex = make_examples(10, seed=1)
    plan = _short_tail_plan(ex, epochs=2)
    tables = build_rank_tables(plan, ex, 2)
    for t in tables:
        got = list(zip(t.column("step").to_pylist(), t.column("micro_index").to_pylist(),
                       t.column("step_micro_batches").to_pylist()))
        assert got == [(0, 0, 2)] * 2 + [(0, 1, 2)] * 2 + [(1, 0, 1)] + [(2, 0, 2)] * 2 + [(2, 1, 2)] * 2 + [(3, 0, 1)]
    order = _PlanOrder(0)
    for i, key in enumerate([(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 2, 0), (1, 2, 1), (1, 3, 0)]):
        order.check(key, 1 if key[1] in (1, 3) else 2, i)
    with pytest.raises(RuntimeError, match="out of plan order"):
        bad = _PlanOrder(0)
        bad.check((0, 0, 0), 2, 0)
        bad.check((0, 1, 0), 1, 1)  # step 0 had only one of its two micro-batches


@pytest.mark.slow
def test_a_weighted_plan_with_a_short_last_micro_batch_and_step_trains_exactly(ray_cpu, tiny_model_dir, tmp_path):
    """2 ranks, ZeRO-2, fp32, G = 2 with a short last micro-batch and step per epoch, rows weighted and of lengths
    far apart: the trained weights equal one process taking the same 4 AdamW steps on the token-exact weighted
    loss of each step's rows. AdamW's eps is set large so an update is about lr * g / eps, linear in the gradient:
    a loss off by a scale or a weight would show (plain Adam's first step is nearly sign(g) * lr, blind to both).
    Two controls differ: the short steps folded into the next ones (a counter of G micro-batches), and the mean
    of the rows' token means (a loss that depends on how rows share micro-batches)."""
    tiny_model = str(tiny_model_dir)
    ex = make_examples(10, seed=7, min_len=4, max_len=40)
    plan = _short_tail_plan(ex, epochs=2)
    weights = dict(zip(ex.column("example_id").to_pylist(), np.linspace(0.4, 1.9, 10)))
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"optimizer": {"params": {"eps": 10.0}}}))  # update ~ lr g / eps: linear in g
    cfg = TrainConfig(num_workers=2, zero_stage=2, micro_batch_size=2, grad_accum=2, epochs=2, lr=1e-2,
                      max_grad_norm=1e9, timeout_s=120, deepspeed_config=str(user))
    res = train(plan, ex, cfg, tiny_model, tmp_path / "run", pad_token_id=2, weights=pd.Series(weights))
    assert res.steps == 4  # per epoch a step of 2 micro-batches and one of 1
    trained = pd.read_parquet(res.trained_path)
    assert (trained.groupby(["epoch", "example_id"]).size() == 1).all()
    assert sorted(trained["example_id"]) == sorted(plan["example_id"])  # every planned row once per epoch
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3]

    steps = [part["example_id"].tolist() for _, part in plan.groupby("step")]
    kw = {"lr": 1e-2, "eps": 10.0, "total": 4}
    want, want_losses = reference_steps(tiny_model, ex, steps, weights=weights, **kw)
    merged = [steps[0], steps[1] + steps[2], steps[3]]
    controls = [reference_steps(tiny_model, ex, merged, weights=weights, **kw)[0],
                reference_steps(tiny_model, ex, steps, weights=weights, exact=False, **kw)[0]]
    assert_weights_match(tiny_model, res.final_model_dir, want, controls)
    assert [r["loss"] for r in log] == pytest.approx(want_losses, rel=1e-5)
    assert res.final_loss == pytest.approx(want_losses[-1], rel=1e-5)
