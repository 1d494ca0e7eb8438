import math

import pyarrow as pa
import pytest
import torch

from ray_cluster_ft.evaluate import heldout_loss


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)


def _table(rows):
    return pa.table({
        "input_ids": [r[0] for r in rows],
        "labels": [r[1] for r in rows],
        "domain": [r[2] for r in rows],
    })


def test_heldout_loss_equals_token_weighted_reference(tiny):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, (n, n_prompt, dom) in enumerate([(9, 4, "code"), (5, 2, "code"), (12, 7, "medical")]):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        rows.append((ids, [-100] * n_prompt + ids[n_prompt:], dom))
    # reference: Hugging Face's own shifted loss, one example at a time, weighted by its label-token count
    nll, ntok = {}, {}
    for ids, lab, dom in rows:
        out = tiny(input_ids=torch.tensor([ids]), labels=torch.tensor([lab]))
        n = sum(1 for x in lab[1:] if x != -100)
        for d in (dom, "all"):
            nll[d] = nll.get(d, 0.0) + out.loss.item() * n
            ntok[d] = ntok.get(d, 0) + n
    for bs in (1, 3):
        res = heldout_loss(tiny, _table(rows), batch_size=bs, pad_token_id=0)
        assert set(res) == {"code", "medical", "all"}
        for d in res:
            assert res[d]["loss"] == pytest.approx(nll[d] / ntok[d], rel=1e-6)  # logits are cast to fp32
            assert res[d]["perplexity"] == pytest.approx(math.exp(nll[d] / ntok[d]), rel=1e-5)
            assert res[d]["tokens"] == ntok[d]
    assert res["code"]["examples"] == 2 and res["all"]["examples"] == 3


def test_heldout_loss_empty_table(tiny):
    empty = pa.table({"input_ids": pa.array([], pa.list_(pa.int32())), "labels": pa.array([], pa.list_(pa.int32())),
                      "domain": pa.array([], pa.string())})
    assert heldout_loss(tiny, empty) == {}
