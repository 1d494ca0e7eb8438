"""Training stage: plan checks, DeepSpeed config, collation, and real Ray Train + DeepSpeed runs on CPU."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.allocate import check_plan
from ray_cluster_ft.train.deepspeed import disable_shm_comm
from ray_cluster_ft.train import build_deepspeed_config, build_rank_tables, train
from ray_cluster_ft.train.checkpoints import checkpoint_problem
from ray_cluster_ft.train.deepspeed import deepspeed_config, lr_multiplier, merge_deepspeed_config
from ray_cluster_ft.train.loop import checkpoint_dir_name
from ray_cluster_ft.train.rank_data import plan_hash

VOCAB = 49152


def make_examples(n: int, seed: int = 0, min_len: int = 6, max_len: int = 20) -> pa.Table:
    """n tokenized examples with random ids; the first 3 tokens are prompt (label -100)."""
    rng = np.random.default_rng(seed)
    ids, labels, lens = [], [], []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        x = rng.integers(1, VOCAB, size=length).astype(np.int32)
        y = x.copy()
        y[:3] = -100
        ids.append(x)
        labels.append(y)
        lens.append(length)
    return pa.table(
        {
            "example_id": [f"ex{i:03d}" for i in range(n)],
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "labels": pa.array(labels, pa.list_(pa.int32())),
            "n_tokens": pa.array(lens, pa.int32()),
        }
    )


def make_plan(ids: list[str], world: int, mbs: int, ga: int, epochs: int, seed: int = 0) -> pd.DataFrame:
    """A valid plan: each epoch a fresh permutation, dealt to steps x ranks x micro-batches; global steps."""
    per_step = world * mbs * ga
    n_steps = len(ids) // per_step
    rng = np.random.default_rng(seed)
    rows = []
    for epoch in range(epochs):
        perm = rng.permutation(len(ids))[: n_steps * per_step].reshape(n_steps, world, ga, mbs)
        for s in range(n_steps):
            for r in range(world):
                for m in range(ga):
                    for i in perm[s, r, m]:
                        rows.append((epoch, epoch * n_steps + s, r, m, ids[i], 0, 10))
    plan = pd.DataFrame(rows, columns=["epoch", "step", "rank", "micro_index", "example_id", "cluster", "n_tokens"])
    return plan.sort_values(["rank", "epoch", "step", "micro_index"], kind="stable").reset_index(drop=True)


def reference_steps(model_dir: str, ex, steps: list[list[str]], lr: float, eps: float, total: int,
                     weights: dict | None = None, exact: bool = True) -> tuple[dict, list[float]]:
    """One process, one AdamW step per planned step over all its rows, with the run's linear lr schedule. Each
    step's loss is the token-exact weighted ``sum_i w_i sum_t l_it / sum_i w_i |T_i|`` (``exact``; ``w_i = 1``
    without ``weights``), or the mean over rows of each row's token mean (a loss that depends on how rows share
    micro-batches; a negative control). Returns the final state dict and the steps' losses."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = {e: (i, y) for e, i, y in zip(ex.column("example_id").to_pylist(), ex.column("input_ids").to_pylist(),
                                         ex.column("labels").to_pylist())}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0)
    losses = []
    for s, ids in enumerate(steps):
        opt.zero_grad()
        num, den, means = 0.0, 0.0, []
        for e in ids:
            x, y = rows[e]
            w = 1.0 if weights is None else weights[e]
            logits = model(input_ids=torch.tensor([x]), use_cache=False).logits[0, :-1].double()
            tgt = torch.tensor(y[1:])
            ce = torch.nn.functional.cross_entropy(logits, tgt, ignore_index=-100, reduction="sum")
            n = int((tgt != -100).sum())
            num, den = num + w * ce, den + w * n
            means.append(ce / n)
        loss = num / den if exact else torch.stack(means).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        for group in opt.param_groups:
            group["lr"] = lr * lr_multiplier(s, 0, total)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def assert_weights_match(model_dir: str, final_dir, want: dict, controls: list[dict]) -> None:
    """The trained weights in ``final_dir`` equal ``want`` (a :func:`reference_steps` state dict) to 1e-5 per
    parameter and 1e-4 in the norm of the update from ``model_dir``'s weights, while every control (a reference
    trained some other way) is more than 1e-2 away in that norm: the comparison can tell the two apart."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).state_dict()

    def delta(sd):
        return torch.cat([(sd[k] - base[k]).flatten() for k in base])

    assert float((delta(got) - delta(want)).norm() / delta(want).norm()) < 1e-4
    for k in base:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)
    for other in controls:
        assert float((delta(other) - delta(want)).norm() / delta(want).norm()) > 1e-2


# ---------------------------------------------------------------------------------------------- no Ray


def test_deepspeed_config_cpu_and_gpu():
    cfg = TrainConfig(num_workers=4, zero_stage=3, micro_batch_size=2, grad_accum=8, lr=1e-4, weight_decay=0.1,
                      max_grad_norm=0.5)
    ds = deepspeed_config(cfg, total_steps=100)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["train_batch_size"] == 2 * 8 * 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    opt = ds["optimizer"]
    assert opt["type"] == "AdamW" and opt["params"]["torch_adam"] is True
    assert opt["params"]["lr"] == 1e-4 and opt["params"]["weight_decay"] == 0.1
    assert "scheduler" not in ds  # the schedule is a client LambdaLR (see lr_multiplier)
    assert ds["steps_per_print"] >= 10**6
    gpu = deepspeed_config(cfg.model_copy(update={"use_gpu": True, "zero_stage": 1}), total_steps=100)
    assert gpu["bf16"]["enabled"] is True and gpu["zero_optimization"]["stage"] == 1
    with pytest.raises(ValueError, match="total_steps"):
        deepspeed_config(cfg, total_steps=0)


def test_deepspeed_config_offload_and_user_json(tmp_path):
    cfg = TrainConfig(num_workers=2, zero_stage=3, micro_batch_size=2, offload="params")
    zero = deepspeed_config(cfg, total_steps=10)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in deepspeed_config(cfg.model_copy(update={"offload": "optimizer"}), 10)[
        "zero_optimization"]

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"overlap_comm": True, "stage": 2},
                                "optimizer": {"params": {"eps": 1e-6}}, "gradient_clipping": 0.3}))
    ds = build_deepspeed_config(TrainConfig(zero_stage=2, deepspeed_config=str(user)), total_steps=10)
    # nested keys merge; the user's values win; untouched keys stay
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    # the workers build and save the model by train.zero_stage: another stage in the JSON is refused
    with pytest.raises(ValueError, match=r"zero_optimization.stage=2 but train.zero_stage is 3"):
        build_deepspeed_config(TrainConfig(zero_stage=3, deepspeed_config=str(user)), total_steps=10)
    assert ds["optimizer"]["params"]["eps"] == 1e-6 and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["gradient_clipping"] == 0.3 and ds["train_micro_batch_size_per_gpu"] == 4

    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16}))
    # refused on the driver, before any stage runs ...
    with pytest.raises(ValueError, match="sets train_micro_batch_size_per_gpu=16 but the plan needs 4"):
        build_deepspeed_config(TrainConfig(deepspeed_config=str(user)))
    # ... by the merge itself
    base = deepspeed_config(TrainConfig(), total_steps=10)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=16 but the plan needs 4"):
        merge_deepspeed_config(base, {"train_micro_batch_size_per_gpu": 16})


def test_train_config_errors(tmp_path):
    from ray_cluster_ft.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="offload='params' needs train.zero_stage = 3"):
        parse_config({"train": {"zero_stage": 2, "offload": "params"}})
    with pytest.raises(ConfigError, match="offload='optimizer' needs train.zero_stage >= 1"):
        parse_config({"train": {"zero_stage": 0, "offload": "optimizer"}})
    with pytest.raises(ConfigError, match="DeepSpeed config file not found"):
        build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(tmp_path / "missing.json")}}).train)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(bad)}}).train)
    with pytest.raises(ConfigError, match="unknown key 'train.lora.dropuot'; did you mean 'train.lora.dropout'"):
        parse_config({"train": {"lora": {"dropuot": 0.1}}})


def test_plan_hash_tracks_training_order():
    plan = make_plan([f"ex{i:03d}" for i in range(16)], world=2, mbs=2, ga=1, epochs=1)
    h = plan_hash(plan)
    # ranks listed in another order: same training order (rows within a rank keep their order)
    assert h == plan_hash(plan.sort_values("rank", ascending=False, kind="stable"))
    swapped = plan.copy()
    swapped.loc[[0, 1], "example_id"] = swapped.loc[[1, 0], "example_id"].to_numpy()
    assert plan_hash(swapped) != h


def test_lr_multiplier_warmup_then_linear_decay():
    # no warm-up: full lr at the first step, then (T - i) / T
    assert [lr_multiplier(i, 0, 4) for i in range(4)] == [1.0, 0.75, 0.5, 0.25]
    # warm-up of 2 steps over 6: 1/3, 2/3, then 4/4, 3/4, 2/4, 1/4
    assert [lr_multiplier(i, 2, 6) for i in range(6)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    with pytest.raises(ValueError):
        lr_multiplier(0, 0, 0)


def test_disable_shm_comm_sets_flag_and_skips_build():
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    disable_shm_comm()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    if get_accelerator().device_name() == "cpu":
        assert build_shm_op() is None  # would otherwise JIT-compile (about a minute)


def test_uneven_plan_raises_before_any_worker(tmp_path):
    ex = make_examples(16)
    plan = make_plan(ex.column("example_id").to_pylist(), world=2, mbs=2, ga=1, epochs=1)
    assert check_plan(plan, 2, 2, 1) == 4
    # drop rank 1's last micro-batch: rank 0 has 4, rank 1 has 3
    last = plan[plan["rank"] == 1]["step"].max()
    uneven = plan[~((plan["rank"] == 1) & (plan["step"] == last))]
    cfg = TrainConfig(num_workers=2, micro_batch_size=2)
    # train() must fail on the plan before touching Ray (Ray is not initialised in this test)
    import ray

    was_initialized = ray.is_initialized()
    with pytest.raises(ValueError, match=r"uneven plan: rank 1 has 3 micro-batches, rank 0 has 4; uneven counts hang"):
        train(uneven, ex, cfg, str(tmp_path / "no-model"), tmp_path / "run")
    assert ray.is_initialized() == was_initialized
    assert not (tmp_path / "run").exists()


def test_plan_structure_checks():
    ids = [f"ex{i:03d}" for i in range(16)]
    plan = make_plan(ids, world=2, mbs=2, ga=2, epochs=2)
    assert check_plan(plan, 2, micro_batch_size=2, grad_accum=2) == 4
    with pytest.raises(ValueError, match="rows, expected micro_batch_size=4"):
        check_plan(plan, 2, micro_batch_size=4, grad_accum=2)
    with pytest.raises(ValueError, match=r"micro_index values \[0, 1\], expected 0..2"):
        check_plan(plan, 2, micro_batch_size=2, grad_accum=3)
    ga1 = make_plan(ids, world=2, mbs=2, ga=1, epochs=1)  # micro_index always 0, 4 micro-batches per rank
    with pytest.raises(ValueError, match="expected 0..1"):
        check_plan(ga1, 2, micro_batch_size=2, grad_accum=2)
    shifted = plan.copy()
    shifted.loc[shifted["rank"] == 1, "step"] += 100
    with pytest.raises(ValueError, match="of 2 ranks"):
        check_plan(shifted, 2, micro_batch_size=2, grad_accum=2)
    mixed = plan.copy()
    mixed.loc[(mixed["step"] == 0) & (mixed["micro_index"] == 1), "epoch"] = 1
    with pytest.raises(ValueError, match="spans several epochs"):
        check_plan(mixed, 2, micro_batch_size=2, grad_accum=2)


def test_build_rank_tables_joins_in_plan_order():
    ex = make_examples(16)
    plan = make_plan(ex.column("example_id").to_pylist(), world=2, mbs=2, ga=2, epochs=2)
    tables = build_rank_tables(plan, ex.to_pandas(), 2)
    by_id = {e: (i, l) for e, i, l in zip(ex.column("example_id").to_pylist(), ex.column("input_ids").to_pylist(),
                                        ex.column("labels").to_pylist())}
    for r, t in enumerate(tables):
        want = plan[plan["rank"] == r]
        assert t.column("example_id").to_pylist() == want["example_id"].tolist()
        assert t.column("step").to_pylist() == want["step"].tolist()
        assert [by_id[e][0] for e in want["example_id"]] == t.column("input_ids").to_pylist()
        assert [by_id[e][1] for e in want["example_id"]] == t.column("labels").to_pylist()
    bad = plan.copy()
    bad.loc[0, "example_id"] = "nope"
    with pytest.raises(ValueError, match="not in examples.*nope"):
        build_rank_tables(bad, ex, 2)
    no_labels = ex.set_column(2, "labels", pa.array([[-100] * len(x) for x in ex.column("input_ids").to_pylist()],
                                                    pa.list_(pa.int32())))
    with pytest.raises(ValueError, match="no label token"):
        build_rank_tables(plan, no_labels, 2)


# ---------------------------------------------------------------------------------------------- Ray + DeepSpeed


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ray_cluster_ft.model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def _state_dict_keys_and_load(model_dir, final_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    sd0, sd1 = base.state_dict(), trained.state_dict()
    assert set(sd0) == set(sd1)
    assert all(sd0[k].shape == sd1[k].shape for k in sd0)
    assert all(bool(v.isfinite().all()) for v in sd1.values())
    # training moved the weights (first step trains at full lr, see lr_multiplier)
    assert any(not bool((sd0[k] == sd1[k]).all()) for k in sd0)


@pytest.mark.slow
def test_train_zero2_follows_a_packed_recut_plan_through_an_injected_failure(ray_cpu, tiny_model, tmp_path,
                                                                            monkeypatch):
    """3 epochs of a packed cluster plan (epochs 1 and 2 re-cut with seed + epoch: with these rows the same packs,
    in another order and on other ranks; a pack holds any number of rows),
    2 packs per rank and step (G = 2), weighted rows; rank 0 raises once at the second step of epoch 2 (step 8 of
    9); the group restarts from the step-6 checkpoint and still trains exactly the plan: step 7, trained before the
    failure, is cut from the logs by the rows the checkpoint recorded and trained again, nothing is skipped, no
    padding. The final weights equal one process taking the 9 AdamW steps on the token-exact weighted loss of each
    step's rows, uninterrupted (AdamW's eps is set large so an update is about lr * g / eps, linear in the
    gradient: a loss off by a scale or a weight would show; plain Adam's first step is nearly sign(g) * lr). Its
    checkpoints were written in place and only the final one is left."""
    from ray_cluster_ft.allocate import make_plan as make_cluster_plan

    ex = make_examples(24)
    ids = np.asarray(ex.column("example_id").to_pylist())
    n_tokens = np.asarray(ex.column("n_tokens").to_numpy(), dtype=np.int64)
    plan = make_cluster_plan(ids, np.arange(ids.size) % 4, n_tokens, 2, 2, 2, 3, strategy="cluster", seed=1,
                             packing=True, max_tokens_per_micro_batch=32).plan
    steps = int(plan["step"].nunique())
    fail_at = int(plan.loc[plan["epoch"] == 2, "step"].min()) + 2  # 1-based
    assert (steps, fail_at) == (9, 8)
    weights = dict(zip(ids.tolist(), np.linspace(0.4, 1.9, ids.size)))
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"optimizer": {"params": {"eps": 10.0}}}))
    cfg = TrainConfig(num_workers=2, zero_stage=2, micro_batch_size=2, grad_accum=2, epochs=3, lr=1e-2,
                      max_grad_norm=1e9, timeout_s=180, checkpoint_every=3, max_failures=1,
                      max_tokens_per_micro_batch=32, deepspeed_config=str(user))
    monkeypatch.setenv("RAY_CLUSTER_FT_FAIL_AT_STEP", str(fail_at))
    staged_before = set(Path(tempfile.gettempdir()).glob("ds_ckpt_*"))
    res = train(plan, ex, cfg, tiny_model, tmp_path / "run", pad_token_id=2, packing=True,
                weights=pd.Series(weights))

    assert (tmp_path / "run" / ".fault_injected").exists() and res.resumed_from_step == 6
    assert res.steps == steps
    # Checkpoints are written once, straight into Ray Train's run folder (nothing staged in a temporary folder),
    # and only the final one is left, complete for this plan, with every rank's optimizer state.
    storage = tmp_path / "run" / "ray_train" / "train"
    left = sorted(p.name for p in storage.glob("checkpoint_*") if p.is_dir())  # not Ray's own snapshot file
    assert set(Path(tempfile.gettempdir()).glob("ds_ckpt_*")) <= staged_before
    assert left == [checkpoint_dir_name(steps)] and res.checkpoint_path == str(storage / left[0])
    packs = plan.groupby(["rank", "step", "micro_index"]).ngroups
    assert checkpoint_problem(storage / left[0], 2, plan_hash(plan)) == (packs // 2, None)  # micro-batches done
    for rank in (0, 1):
        pos = json.loads((storage / left[0] / f"plan_position_rank{rank}.json").read_text())
        assert pos["steps_done"] == steps and any(name.endswith("optim_states.pt") for name in pos["files"])
        assert pos["rows_done"] == int((plan["rank"] == rank).sum())
    trained = pd.read_parquet(res.trained_path)
    assert list(trained.columns) == ["rank", "step", "micro_index", "epoch", "example_id"]
    for r in range(2):
        got = trained[trained["rank"] == r]
        want = plan[plan["rank"] == r]
        assert got["example_id"].tolist() == want["example_id"].tolist()
        assert got[["epoch", "step", "micro_index"]].to_numpy().tolist() == \
            want[["epoch", "step", "micro_index"]].to_numpy().tolist()
    # every example trained exactly once per epoch
    assert (trained.groupby(["epoch", "example_id"]).size() == 1).all()
    assert trained.groupby("epoch")["example_id"].nunique().tolist() == [24, 24, 24]

    log = [json.loads(line) for line in res.log_path.read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(steps))
    assert [row["epoch"] for row in log] == [0] * 3 + [1] * 3 + [2] * 3
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 for row in log)
    assert res.final_loss == log[-1]["loss"]
    # tokens per step = the real tokens of the rows the plan put in that step; packs have no padding
    want_tokens = plan.groupby("step")["n_tokens"].sum().tolist()
    assert [row["tokens"] for row in log] == want_tokens
    assert [row["padding_tokens"] for row in log] == [0] * steps
    # learning rate follows the client schedule (no warm-up: full lr first, linear decay)
    assert [row["lr"] for row in log] == pytest.approx([1e-2 * lr_multiplier(i, 0, steps) for i in range(steps)])

    # per-rank step-time figures, one entry per rank, from the all-gathered step log
    assert all(len(row["step_time_s_per_rank"]) == 2 and row["step_time_s"] == pytest.approx(max(row["step_time_s_per_rank"]), abs=1e-4)
               for row in log)
    assert [sum(row["tokens_per_rank"]) for row in log] == want_tokens
    assert len(res.step_time_p50_s) == 2 and all(0 < a <= b for a, b in zip(res.step_time_p50_s, res.step_time_p90_s))

    assert res.checkpoint_path is not None and os.listdir(res.checkpoint_path)
    assert (res.final_model_dir / "tokenizer.json").exists() or (res.final_model_dir / "tokenizer_config.json").exists()
    _state_dict_keys_and_load(tiny_model, res.final_model_dir)

    # The weights and the losses of the uninterrupted single process; the control: each step's loss the mean of its
    # rows' token means (a loss that depends on how rows share packs)
    by_step = [part["example_id"].tolist() for _, part in plan.groupby("step")]
    kw = {"lr": 1e-2, "eps": 10.0, "total": steps, "weights": weights}
    want, want_losses = reference_steps(tiny_model, ex, by_step, **kw)
    other, _ = reference_steps(tiny_model, ex, by_step, exact=False, **kw)
    assert_weights_match(tiny_model, res.final_model_dir, want, [other])
    assert [row["loss"] for row in log] == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "lora"),
    [(0, None), (3, None), (3, "merged"), (2, "adapter")],
    ids=["zero0", "zero3", "zero3-lora-merged", "zero2-lora-adapter"],
)
def test_train_saves_loadable_model(ray_cpu, tiny_model, tmp_path, stage, lora):
    from transformers import AutoModelForCausalLM

    ex = make_examples(8, seed=stage)
    lora_cfg = {"enabled": lora is not None, "r": 4, "alpha": 8, "merge": lora == "merged"}
    # ZeRO-0 also runs train.final_checkpoint: false, checkpointing every step: only final_model/ is left.
    no_final = {"checkpoint_every": 1, "final_checkpoint": False} if stage == 0 else {}
    cfg = TrainConfig(num_workers=2, zero_stage=stage, micro_batch_size=2, grad_accum=1, epochs=1, lr=1e-2,
                      timeout_s=120, lora=lora_cfg, **no_final)
    plan = make_plan(ex.column("example_id").to_pylist(), world=2, mbs=2, ga=1, epochs=1)
    res = train(plan, ex, cfg, tiny_model, tmp_path / "run", pad_token_id=2)
    assert res.steps == 2
    assert math.isfinite(res.final_loss)
    if no_final:
        storage = tmp_path / "run" / "ray_train" / "train"
        assert storage.is_dir() and not [p for p in storage.glob("checkpoint_*") if p.is_dir()]
        assert res.checkpoint_path is None
    if lora == "adapter":
        import torch

        assert (res.final_model_dir / "adapter_config.json").exists()
        assert not (res.final_model_dir / "model.safetensors").exists()
        # transformers loads an adapter folder onto its base model (peft integration)
        tuned = AutoModelForCausalLM.from_pretrained(res.final_model_dir)
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        x = torch.tensor([ex.column("input_ids")[0].as_py()])
        assert not torch.allclose(tuned(x).logits, base(x).logits)
    else:
        _state_dict_keys_and_load(tiny_model, res.final_model_dir)


def test_rank_tables_carry_weights_and_the_steps_token_denominator():
    from ray_cluster_ft.train import build_rank_tables

    ids = ["a", "b", "c", "d", "e", "f", "g", "h"]
    # prompt of 2 tokens (-100), then 1..8 label tokens: after the shift, example i trains on i+1 tokens
    toks = [[5] * (2 + i + 1) for i in range(8)]
    labels = [[-100, -100] + [7] * (i + 1) for i in range(8)]
    ex = pa.table({"example_id": ids, "input_ids": toks, "labels": labels})
    plan = make_plan(ids, world=2, mbs=2, ga=1, epochs=1, seed=0)  # 2 steps of 4 rows
    w = pd.Series(np.arange(1, 9, dtype=float), index=ids)
    tables = build_rank_tables(plan, ex, 2, w)
    n_lab = {e: i + 1 for i, e in enumerate(ids)}
    want = {s: sum(w[e] * n_lab[e] for e in g["example_id"]) for s, g in plan.groupby("step")}
    for t in tables:
        for e, s, wt, d in zip(*(t.column(c).to_pylist() for c in ("example_id", "step", "weight",
                                                                    "step_weighted_tokens"))):
            assert wt == w[e] and d == pytest.approx(want[s])
    ones = build_rank_tables(plan, ex, 2)
    assert set(ones[0].column("weight").to_pylist()) == {1.0}
    with pytest.raises(ValueError, match="finite, positive loss weight"):
        build_rank_tables(plan, ex, 2, w.drop("c"))
    with pytest.raises(ValueError, match="finite, positive loss weight"):
        build_rank_tables(plan, ex, 2, w.replace(3.0, 0.0))
