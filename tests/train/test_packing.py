"""Packed micro-batches (``allocation.packing``): a pack trains exactly what its rows train one by one.

Attention must stay inside each example: checked by comparing against per-example forwards and backwards (loss
and every parameter gradient, fp32, <= 1e-5 relative), for sdpa and eager, on the tiny model and on the demo
model; a control with positions that do not restart shows the comparison can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.data.collate import IGNORE_INDEX, pack
from ray_cluster_ft.train.driver import _check_plan
from ray_cluster_ft.train.loop import _check_micro_batch, _micro_batches
from ray_cluster_ft.train.rank_data import build_rank_tables
from ray_cluster_ft.train.step import micro_batch_to_device, token_exact_loss

from .test_train import make_examples, make_plan


def _rows(lengths, seed=0, prompt=2, vocab=49000):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, vocab, n) for n in lengths]
    labels = [x.copy() for x in ids]
    for y in labels:
        y[:prompt] = IGNORE_INDEX
    return ids, labels


def test_pack_concatenates_restarts_positions_and_masks_each_first_label():
    out = pack([[5, 6, 7], [8, 9], [4]], [[-100, 6, 7], [8, 9], [4]])
    np.testing.assert_array_equal(out["input_ids"], [[5, 6, 7, 8, 9, 4]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 0, 1, 0]])
    # -100 on every example's first token (no prediction across a boundary), the rows' own -100 kept
    np.testing.assert_array_equal(out["labels"], [[-100, 6, 7, -100, 9, -100]])
    np.testing.assert_array_equal(out["lengths"], [3, 2, 1])
    assert "attention_mask" not in out and out["input_ids"].dtype == np.int64
    flash = pack([[5, 6, 7], [8, 9]], flash_attn_kwargs=True)
    np.testing.assert_array_equal(flash["cu_seq_lens_q"], [0, 3, 5])
    assert flash["cu_seq_lens_q"].dtype == np.int32 and flash["max_length_k"] == 3
    np.testing.assert_array_equal(flash["labels"], [[-100, 6, 7, -100, 9]])  # no labels: train on the ids
    with pytest.raises(ValueError, match="empty sequence"):
        pack([[1, 2], []])
    with pytest.raises(ValueError, match="lengths differ"):
        pack([[1, 2]], [[1]])
    with pytest.raises(ValueError, match="equal-count"):
        pack([])


def test_packed_micro_batch_carries_per_token_weights():
    ids, labels = _rows([4, 6, 3])
    mb = micro_batch_to_device({"input_ids": ids, "labels": labels, "weight": np.array([0.5, 2.0, 1.5])}, 0, "cpu",
                               packed=True)
    assert set(mb) == {"input_ids", "position_ids", "labels", "weight", "logits_positions"}
    assert tuple(mb["input_ids"].shape) == (1, 13) and str(mb["weight"].dtype) == "torch.float32"
    np.testing.assert_array_equal(mb["weight"].numpy()[0], [0.5] * 4 + [2.0] * 6 + [1.5] * 3)
    # labels at 2, 3 | 6..9 | 12 (each row's first two are prompt): the positions before them
    np.testing.assert_array_equal(mb["logits_positions"].numpy(), [1, 2, 5, 6, 7, 8, 11])


@pytest.mark.parametrize("packed", [True, False])
def test_logits_at_label_positions_only_give_the_full_loss_and_gradient(tiny_model_dir, packed):
    """The training step's LM head runs only where a label follows (``logits_to_keep``): the same loss and
    gradients as the full logits, fp32, packed and padded; a model whose ``forward`` lacks the keyword gets all."""
    import torch

    from ray_cluster_ft.model import load_model
    from ray_cluster_ft.train.step import train_micro_batch

    model = load_model(str(tiny_model_dir), dtype=torch.float32)
    ids, labels = _rows([5, 17, 9, 2, 12], seed=4, prompt=3)
    w = np.array([0.5, 1.0, 2.0, 0.7, 1.3])
    mb = micro_batch_to_device({"input_ids": ids, "labels": labels, "weight": w}, 0, "cpu", packed=packed)
    pos = mb["logits_positions"]
    n_pos = mb["labels"].shape[1]
    assert 0 < len(pos) < n_pos - 1
    extra = {"position_ids": mb["position_ids"]} if packed else {"attention_mask": mb["attention_mask"]}

    def loss_and_grads(**kw):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=mb["input_ids"], **extra, **kw, use_cache=False).logits
        loss = token_exact_loss(logits, mb["labels"], mb["weight"], kw.get("logits_to_keep"))
        loss.backward()
        return float(loss.detach()), _grads(model), logits.shape[1]

    full, g_full, t_full = loss_and_grads()
    kept, g_kept, t_kept = loss_and_grads(logits_to_keep=pos)
    assert (t_full, t_kept) == (n_pos, len(pos))
    _assert_same(kept, full, g_kept, g_full, rel=1e-6)

    class Engine:  # what train_micro_batch uses of a DeepSpeed engine
        def __init__(self, module):
            self.module, self.seen = module, {}

        def __call__(self, **kw):
            self.seen = kw
            return self.module(**kw)

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

    engine = Engine(model)
    assert float(train_micro_batch(engine, mb, 1.0)) == pytest.approx(full, rel=1e-6)
    assert engine.seen["logits_to_keep"] is pos

    class NoKeep(torch.nn.Module):  # a forward without logits_to_keep: all logits, the same loss
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache)

    engine = Engine(NoKeep(model))
    assert float(train_micro_batch(engine, mb, 1.0)) == pytest.approx(full, rel=1e-6)
    assert "logits_to_keep" not in engine.seen


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_vs_one_by_one(model, ids, labels, w, positions=None):
    """(packed loss, per-example loss sum, packed grads, per-example grads): ``sum_i w_i sum_t l_it`` and its
    gradient from one packed forward/backward and from one forward/backward per example."""
    import torch

    mb = micro_batch_to_device({"input_ids": ids, "labels": labels, "weight": w}, 0, "cpu", packed=True)
    pos = mb["position_ids"] if positions is None else positions
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=mb["input_ids"], position_ids=pos, use_cache=False).logits
    packed = token_exact_loss(logits, mb["labels"], mb["weight"])
    packed.backward()
    g_packed = _grads(model)
    model.zero_grad(set_to_none=True)
    ref = 0.0
    for x, y, wi in zip(ids, labels, w):
        one = token_exact_loss(model(input_ids=torch.tensor(np.asarray([x])), use_cache=False).logits,
                               torch.tensor(np.asarray([y])), torch.tensor([wi], dtype=torch.float32))
        one.backward()
        ref += float(one.detach())
    return float(packed.detach()), ref, g_packed, _grads(model)


def _assert_same(packed, ref, g_packed, g_ref, rel=1e-5):
    assert packed == pytest.approx(ref, rel=rel)
    assert set(g_packed) == set(g_ref)
    for n in g_ref:
        err = float((g_packed[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30))
        assert err <= rel, f"{n}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_backward_equals_per_example_tiny_model(tiny_model_dir, attn):
    import torch

    from ray_cluster_ft.model import load_model

    model = load_model(str(tiny_model_dir), dtype=torch.float32, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    ids, labels = _rows([5, 17, 9, 2, 12], seed=1)
    w = np.array([0.5, 1.0, 2.0, 0.7, 1.3])
    _assert_same(*_packed_vs_one_by_one(model, ids, labels, w))
    # Control: positions that run on across examples are read as one sequence (full causal attention across
    # examples), and the figures differ.
    n = sum(len(x) for x in ids)
    packed, ref, _, _ = _packed_vs_one_by_one(model, ids, labels, w, positions=torch.arange(n)[None])
    assert abs(packed - ref) / ref > 1e-4


@pytest.mark.slow  # 15 s on an idle core, over 2 min on the shared 2 cores
@pytest.mark.parametrize("attn", ["sdpa"])  # eager on the tiny model above: one demo-model run is the slow part
def test_packed_forward_backward_equals_per_example_demo_model(attn):
    """The demo model (SmolLM2-135M, 30 layers) in fp32. Its fp32 rounding alone moves the gradient by about
    1.5e-5 (relative, all parameters) between any two exact ways of computing it: the padded batch of the same
    rows differs from the per-example passes by as much as the pack does (measured: 1.5e-5 both, sdpa and
    eager; the worst single tensor 8e-5 both). So the loss is held to 1e-5 and the gradient to that floor: the
    pack may differ from the per-example passes by no more than twice what the padded batch does (and 1e-4)."""
    import torch

    from ray_cluster_ft.model import load_model

    model = load_model("demo", dtype=torch.float32, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    ids, labels = _rows([7, 12, 5], seed=2, vocab=model.config.vocab_size)
    w = np.array([1.0, 0.6, 1.8])
    packed, ref, g_packed, g_ref = _packed_vs_one_by_one(model, ids, labels, w)
    assert packed == pytest.approx(ref, rel=1e-5)
    mb = micro_batch_to_device({"input_ids": ids, "labels": labels, "weight": w}, 0, "cpu")
    model.zero_grad(set_to_none=True)
    token_exact_loss(model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits,
                     mb["labels"], mb["weight"]).backward()
    g_padded = _grads(model)

    def rel(g):
        a, b = (torch.cat([x[n].flatten() for n in sorted(g_ref)]) for x in (g, g_ref))
        return float((a - b).norm() / b.norm())

    floor = rel(g_padded)
    assert rel(g_packed) <= min(1e-4, max(1e-5, 2 * floor)), (rel(g_packed), floor)


# ---------------------------------------------------------------------------------------------- packed plans


def make_packed_plan(ex: pa.Table, world: int, ga: int, rows_per_pack: list[int], seed: int = 0) -> pd.DataFrame:
    """A packed plan by hand (the schema of plan.parquet): the examples in a seeded order, dealt into packs of
    ``rows_per_pack`` rows (cycled), W x G packs per step, one epoch."""
    ids = np.asarray(ex.column("example_id").to_pylist())[np.random.default_rng(seed).permutation(ex.num_rows)]
    rows, i, j, mb = [], 0, 0, 0
    while i < len(ids):
        n = rows_per_pack[j % len(rows_per_pack)]
        step, rest = divmod(mb, world * ga)
        rank, micro = divmod(rest, ga)
        rows += [(0, step, rank, micro, e) for e in ids[i:i + n]]
        i, j, mb = i + n, j + 1, mb + 1
    assert mb % (world * ga) == 0, "the packs must fill whole steps"
    plan = pd.DataFrame(rows, columns=["epoch", "step", "rank", "micro_index", "example_id"])
    lengths = dict(zip(ex.column("example_id").to_pylist(), (len(t) for t in ex.column("input_ids").to_pylist())))
    plan["n_tokens"] = plan["example_id"].map(lengths).astype(np.int64)
    return plan.sort_values(["rank", "epoch", "step", "micro_index"], kind="stable").reset_index(drop=True)


class _Shard:
    """The slice of Ray's ``DataIterator`` the worker loop reads: ``iter_batches`` over one rank's table."""

    def __init__(self, table: pa.Table):
        self.table = table

    def iter_batches(self, batch_size, batch_format):
        for a in range(0, self.table.num_rows, batch_size):
            t = self.table.slice(a, batch_size)
            yield t if batch_format == "pyarrow" else {c: t.column(c).to_numpy(zero_copy_only=False)
                                                        for c in t.column_names}


def test_packed_plan_checks_and_micro_batches_in_plan_order():
    ex = make_examples(12, seed=3)
    plan = make_packed_plan(ex, world=2, ga=1, rows_per_pack=[1, 3, 2, 4, 1, 1])
    cfg = TrainConfig(num_workers=2, micro_batch_size=2, grad_accum=1, max_tokens_per_micro_batch=80)
    assert _check_plan(plan, 2, cfg, packing=True) == 3
    with pytest.raises(ValueError, match="has 1 rows, expected micro_batch_size=2"):
        _check_plan(plan, 2, cfg, packing=False)
    uneven = plan[~((plan["rank"] == 1) & (plan["step"] == 2))]
    with pytest.raises(ValueError, match="uneven plan|step 2 has micro-batches on 1 of 2 ranks"):
        _check_plan(uneven, 2, cfg, packing=True)

    tables = build_rank_tables(plan, ex, 2, max_tokens_per_pack=80)
    for r, t in enumerate(tables):
        want = plan[plan["rank"] == r]
        # chunks smaller than a pack: a pack that spans chunks still comes out whole
        got = list(_micro_batches(_Shard(t), 2, packed=True, chunk_rows=2))
        keys = [_check_micro_batch(b, None) for b in got]
        assert keys == [tuple(k) for k in want[["epoch", "step", "micro_index"]].drop_duplicates().to_numpy()]
        assert [e for b in got for e in b["example_id"]] == want["example_id"].tolist()
        assert [len(b["example_id"]) for b in got] == want.groupby(["step", "micro_index"]).size().tolist()
    with pytest.raises(RuntimeError, match="spans"):
        _check_micro_batch({"example_id": np.array(["a", "b"]), "epoch": np.array([0, 0]), "step": np.array([0, 1]),
                            "micro_index": np.array([0, 0])}, None)

    sizes = plan.assign(n=plan["example_id"].map(dict(zip(ex.column("example_id").to_pylist(),
                                                           ex.column("n_tokens").to_pylist()))))
    biggest = int(sizes.groupby(["rank", "step", "micro_index"])["n"].sum().max())
    build_rank_tables(plan, ex, 2, max_tokens_per_pack=biggest)
    with pytest.raises(ValueError, match=f"more than train.max_tokens_per_micro_batch={biggest - 1}"):
        build_rank_tables(plan, ex, 2, max_tokens_per_pack=biggest - 1)


# One process, one DeepSpeed engine (ZeRO-2, fp32), the worker's own functions: build_rank_tables -> the loop's
# micro-batch reader -> micro_batch_to_device -> train_micro_batch, for one step of G = 2 micro-batches.
_STEP_SCRIPT = r"""
import json, sys
import numpy as np, pandas as pd, pyarrow as pa, pyarrow.parquet as pq, torch
from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train.deepspeed import build_deepspeed_config, precision_for
from ray_cluster_ft.train.loop import _build_engine, _micro_batches, _namespace
from ray_cluster_ft.train.rank_data import build_rank_tables
from ray_cluster_ft.train.step import micro_batch_to_device, train_micro_batch

model_dir, ex_path, plan_path, packed, attn, ds_json = sys.argv[1:7]
packed = packed == "1"
ex, plan = pq.read_table(ex_path), pd.read_parquet(plan_path)
weights = pd.Series(np.linspace(0.4, 1.9, ex.num_rows), index=ex.column("example_id").to_pylist())
train = TrainConfig(num_workers=1, zero_stage=2, micro_batch_size=4, grad_accum=2, lr=1e-2, max_grad_norm=1e9,
                    deepspeed_config=ds_json)
config = {"model_dir": model_dir, "trust_remote_code": False, "total_steps": 1,
          "ds_config": build_deepspeed_config(train, 1), "precision": precision_for(train),
          "gradient_checkpointing": False, "attn_implementation": attn}
torch.manual_seed(0)
engine, _, _, _ = _build_engine(config, _namespace(train.model_dump()))
engine.train()
table = build_rank_tables(plan, ex, 1, weights)[0]

class Shard:
    def iter_batches(self, batch_size, batch_format):
        for a in range(0, table.num_rows, batch_size):
            t = table.slice(a, batch_size)
            yield t if batch_format == "pyarrow" else {c: t.column(c).to_numpy(zero_copy_only=False)
                                                        for c in t.column_names}

loss, shapes = 0.0, []
for batch in _micro_batches(Shard(), 4, packed, chunk_rows=3):
    d = float(batch["step_weighted_tokens"][0])
    mb = micro_batch_to_device(batch, 2, engine.device, packed=packed)
    shapes.append(list(mb["input_ids"].shape))
    loss += float(train_micro_batch(engine, mb, 1 * 2 / d)) / d
state = {k: v.detach().numpy().tolist() for k, v in engine.module.state_dict().items()}
print(json.dumps({"loss": loss, "shapes": shapes, "state": state}))
"""


def _one_process_step(tmp_path, model_dir, ex, plan, packed: bool, attn: str) -> dict:
    import pyarrow.parquet as pq

    from ray_cluster_ft.model import cache_dir
    from tests.conftest import free_port

    pq.write_table(ex, tmp_path / "ex.parquet")
    plan.to_parquet(tmp_path / "plan.parquet")
    (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"params": {"eps": 10.0}}}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(cache_dir() / "torch_extensions")}
    done = subprocess.run([sys.executable, "-c", _STEP_SCRIPT, str(model_dir), str(tmp_path / "ex.parquet"),
                           str(tmp_path / "plan.parquet"), "1" if packed else "0", attn, str(tmp_path / "ds.json")],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes that import DeepSpeed: about 1 min each on the shared 2 cores
@pytest.mark.parametrize("attn", ["sdpa"])
def test_packed_deepspeed_step_updates_the_weights_as_the_padded_step(tiny_model_dir, tmp_path, attn):
    """The same 8 rows in one optimizer step (G = 2): as 2 padded micro-batches of 4 rows, and as 2 packs of 5 and
    3 rows (other rows share a micro-batch, and the per-token weights differ). With AdamW's eps large, the
    first update is about lr * g / eps, linear in the gradient, so equal weights mean equal gradients."""
    import torch

    ex = make_examples(8, seed=7, min_len=4, max_len=40)
    ids = ex.column("example_id").to_pylist()
    padded_plan = make_plan(ids, world=1, mbs=4, ga=2, epochs=1, seed=3)[["epoch", "step", "rank", "micro_index",
                                                                          "example_id"]]
    packed_plan = padded_plan.assign(micro_index=[0] * 5 + [1] * 3)
    (tmp_path / "padded").mkdir()
    (tmp_path / "packed").mkdir()
    a = _one_process_step(tmp_path / "padded", tiny_model_dir, ex, padded_plan, False, attn)
    b = _one_process_step(tmp_path / "packed", tiny_model_dir, ex, packed_plan, True, attn)
    n_tok = ex.column("n_tokens").to_pylist()
    pos = {e: i for i, e in enumerate(ids)}
    by_micro = packed_plan.groupby("micro_index")["example_id"]
    assert b["shapes"] == [[1, sum(n_tok[pos[e]] for e in g)] for _, g in by_micro]
    by_micro = padded_plan.groupby("micro_index")["example_id"]
    assert a["shapes"] == [[4, max(n_tok[pos[e]] for e in g)] for _, g in by_micro]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    moved = 0.0
    for k in base:
        if k not in a["state"]:
            continue
        got, want = torch.tensor(b["state"][k]), torch.tensor(a["state"][k])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        moved = max(moved, float((want - base[k]).abs().max()))
    assert moved > 1e-5  # the step moved the weights


def test_prefetch_collates_ahead_on_another_thread_in_order():
    """The loop's collation runs on a background thread, in plan order; batches before the resume point are not
    collated; a collation error surfaces at its batch."""
    import threading

    from ray_cluster_ft.train.loop import _prefetch

    main = threading.get_ident()
    seen = []

    def collate(b):
        seen.append(threading.get_ident())
        if b == 5:
            raise ValueError("bad batch 5")
        return b * 10

    got = list(_prefetch(iter(range(5)), collate, skip=2))
    assert got == [(0, None), (1, None), (2, 20), (3, 30), (4, 40)]
    assert len(seen) == 3 and main not in seen
    out = []
    with pytest.raises(ValueError, match="bad batch 5"):
        for b, host in _prefetch(iter(range(8)), collate):
            out.append(host)
    assert out == [0, 10, 20, 30, 40]
