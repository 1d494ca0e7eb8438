"""Packed plans in your own trainer: PlanBatchSampler(packed=True) yields each pack's rows, TokenCollator(packed=True)
packs them with transformers' DataCollatorWithFlattening, and micro_batch_loss spreads the weights over the
pack's tokens: loss and gradients equal the padded batch of the same rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from ray_cluster_ft.integrations.torch import (
    ExamplesDataset,
    PlanBatchSampler,
    TokenCollator,
    micro_batch_loss,
    plan_loss_weights,
    plan_shape,
)

from ..train.test_packing import make_packed_plan
from ..train.test_train import make_examples


def test_packed_sampler_collator_and_loss_equal_the_padded_batch(tiny_model_dir):
    from ray_cluster_ft.model import load_model

    ex = make_examples(12, seed=4)
    plan = make_packed_plan(ex, world=2, ga=1, rows_per_pack=[1, 3, 2, 4, 1, 1])
    ids = ex.column("example_id").to_pylist()
    weights = dict(zip(ids, np.linspace(0.5, 2.0, len(ids))))
    w = pd.Series(weights)
    with pytest.raises(ValueError, match="expected micro_batch_size"):
        plan_shape(plan)  # a packed plan read as a padded one
    assert plan_shape(plan, packed=True).steps == 3
    data = ExamplesDataset(ex)
    model = load_model(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    for rank in (0, 1):
        sampler = PlanBatchSampler(plan, data.example_ids, rank, packed=True)
        want = plan[plan["rank"] == rank]
        assert [len(p) for p in sampler] == want.groupby(["step", "micro_index"]).size().tolist()
        mws = plan_loss_weights(plan, ex, rank, w, packed=True)
        assert len(mws) == len(sampler) == 3
        packs = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(packed=True))
        padded = DataLoader(data, batch_sampler=sampler, collate_fn=TokenCollator(2))
        for pk, pd_, mw in zip(packs, padded, mws):
            assert pk["example_id"] == list(mw.example_ids) and "attention_mask" not in pk
            assert tuple(pk["input_ids"].shape) == (1, int(mw.lengths.sum()))
            model.zero_grad(set_to_none=True)
            out = model(input_ids=pk["input_ids"], position_ids=pk["position_ids"], use_cache=False).logits
            loss_pk = micro_batch_loss(out, pk["labels"], mw, world_size=2)
            loss_pk.backward()
            g_pk = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            out = model(input_ids=pd_["input_ids"], attention_mask=pd_["attention_mask"], use_cache=False).logits
            loss_pd = micro_batch_loss(out, pd_["labels"], mw, world_size=2)
            loss_pd.backward()
            assert float(loss_pk.detach()) == pytest.approx(float(loss_pd.detach()), rel=1e-5)
            for a, p in zip(g_pk, model.parameters()):
                assert float((a - p.grad).norm() / p.grad.norm()) <= 1e-5
    # the labels of another pack are refused
    first = next(iter(DataLoader(data, batch_sampler=PlanBatchSampler(plan, data.example_ids, 0, packed=True),
                                 collate_fn=TokenCollator(packed=True))))
    other = plan_loss_weights(plan, ex, 0, w, packed=True)[1]
    with pytest.raises(ValueError, match="pack of|label tokens"):
        micro_batch_loss(torch.zeros(1, first["input_ids"].shape[1], 49152), first["labels"], other, world_size=2)
