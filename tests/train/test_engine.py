"""What the worker builds, checked in a one-process DeepSpeed world (no Ray): the optimizer class DeepSpeed
constructs (torch's AdamW, or DeepSpeed's CPU Adam under offload), the dtype the model is loaded in, gradient
checkpointing and the attention kernel; and the precision settings of the DeepSpeed dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ray_cluster_ft.config import ConfigError, TrainConfig, parse_config
from ray_cluster_ft.train.deepspeed import deepspeed_config
from ray_cluster_ft.train.deepspeed import precision_for, resolve_precision
from tests.conftest import free_port

_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch
from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train.deepspeed import deepspeed_config, precision_for
from ray_cluster_ft.train.loop import _build_engine, _namespace

train = TrainConfig(**json.loads(sys.argv[2]))
if sys.argv[3] == "stub-cpu-adam":
    # DeepSpeed's CPU Adam compiles its C++ kernel on first use (100 s on 2 cores, again for every virtualenv
    # path). What is checked is which optimizer class the configuration makes DeepSpeed construct, so the built
    # module is replaced by one that accepts the calls DeepSpeedCPUAdam makes while it is built and freed.
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder.load = lambda self, verbose=True: SimpleNamespace(create_adam=lambda *a: None,
                                                                     destroy_adam=lambda *a: None)
config = {"model_dir": sys.argv[1], "trust_remote_code": False, "total_steps": 1,
          "ds_config": deepspeed_config(train, 1), "precision": precision_for(train),
          "gradient_checkpointing": train.gradient_checkpointing, "attn_implementation": "eager"}
engine, _, _, precision = _build_engine(config, _namespace(train.model_dump()))
inner = engine.optimizer
while hasattr(inner, "optimizer"):  # ZeRO wraps the basic optimizer
    inner = inner.optimizer
module = engine.module
print(json.dumps({"optimizer": type(inner).__name__, "dtype": str(next(module.parameters()).dtype),
                  "precision": precision, "checkpointing": bool(module.is_gradient_checkpointing),
                  "attn": module.config._attn_implementation}))
"""


def _build(model_dir, stub_cpu_adam: bool = False, **train) -> dict:
    from ray_cluster_ft.model import cache_dir

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(cache_dir() / "torch_extensions")}  # the trainer's cache: built once
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(model_dir), json.dumps({"num_workers": 1, **train}),
                           "stub-cpu-adam" if stub_cpu_adam else "-"],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_worker_builds_the_configured_optimizer_dtype_and_checkpointing(tiny_model_dir):
    plain = _build(tiny_model_dir, zero_stage=2)
    assert plain == {"optimizer": "AdamW", "dtype": "torch.float32", "precision": "fp32", "checkpointing": False,
                     "attn": "eager"}
    offload = _build(tiny_model_dir, stub_cpu_adam=True, zero_stage=2, offload="optimizer", precision="bf16",
                     gradient_checkpointing=True)
    assert offload["optimizer"] == "DeepSpeedCPUAdam"  # not torch's AdamW on the CPU
    assert (offload["dtype"], offload["precision"], offload["checkpointing"]) == ("torch.bfloat16", "bf16", True)


def test_precision_settings_of_the_deepspeed_dict():
    cpu = deepspeed_config(TrainConfig(), 1)
    assert (cpu["bf16"]["enabled"], cpu["fp16"]["enabled"], "data_types" in cpu) == (False, False, False)
    gpu = TrainConfig(use_gpu=True)
    assert precision_for(gpu) == "auto" and precision_for(gpu, bf16_supported=False) == "fp16"
    ds = deepspeed_config(gpu, 1)
    assert ds["bf16"]["enabled"] and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    settled, p = resolve_precision(ds, "auto", bf16_supported=False)  # a pre-Ampere GPU
    assert p == "fp16" and settled["fp16"]["enabled"] and settled["fp16"]["loss_scale"] == 0  # dynamic
    assert not settled["bf16"]["enabled"] and ds["bf16"]["enabled"]  # the driver's dict is untouched
    assert resolve_precision(ds, "auto", bf16_supported=True)[1] == "bf16"
    fp16 = deepspeed_config(TrainConfig(use_gpu=True, precision="fp16"), 1)
    assert fp16["fp16"]["enabled"] and fp16["data_types"]["grad_accum_dtype"] == "fp32"
    assert "torch_adam" not in deepspeed_config(TrainConfig(zero_stage=2, offload="optimizer"), 1)["optimizer"]["params"]
    with pytest.raises(ConfigError, match="train.precision 'fp16' needs train.use_gpu"):
        parse_config({"train": {"precision": "fp16"}})


_ZERO3_SCRIPT = r"""
import json, sys
import torch
import deepspeed
import ray_cluster_ft.model as M
from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train.deepspeed import deepspeed_config, precision_for
from ray_cluster_ft.train.loop import _build_engine, _namespace, _save_hf_model

seen = {}
load = M.load_local_model
def spy(*args, **kwargs):  # what from_pretrained built, before deepspeed.initialize touches it
    model = load(*args, **kwargs)
    seen["partitioned_at_load"] = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    seen["kwargs"] = sorted(kwargs)
    return model
M.load_local_model = spy

train = TrainConfig(**json.loads(sys.argv[2]))
if sys.argv[3] == "stub-cpu-adam":
    # DeepSpeed's CPU Adam compiles its C++ kernel on first use (100 s on 2 cores, again for every virtualenv
    # path). What is checked is which optimizer class the configuration makes DeepSpeed construct, so the built
    # module is replaced by one that accepts the calls DeepSpeedCPUAdam makes while it is built and freed.
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder.load = lambda self, verbose=True: SimpleNamespace(create_adam=lambda *a: None,
                                                                     destroy_adam=lambda *a: None)
ds = deepspeed_config(train, 1)
config = {"model_dir": sys.argv[1], "trust_remote_code": False, "total_steps": 1, "ds_config": ds,
          "precision": precision_for(train), "gradient_checkpointing": False, "attn_implementation": "eager"}
engine, _, _, _ = _build_engine(config, _namespace(train.model_dump()))
x = torch.randint(1, 1000, (2, 12))
loss = engine(input_ids=x, labels=x).loss
engine.backward(loss)
engine.step()
_save_hf_model(engine, __import__("pathlib").Path(sys.argv[3]), 0, 3, merge_lora=True)
params = list(engine.module.parameters())
with deepspeed.zero.GatheredParameters(params, modifier_rank=0):  # the reference: peft's own merge, gathered
    ref = {k: v.detach().clone() for k, v in engine.module.merge_and_unload().state_dict().items()}
from transformers import AutoModelForCausalLM
import ray_cluster_ft.train.loop as loop
loop._HF_DS_CONFIG.clear()  # load the saved folder as a plain model, not under zero.Init
saved = AutoModelForCausalLM.from_pretrained(sys.argv[3]).state_dict()
lora_moved = max(float((ref[k] - v).abs().max()) for k, v in saved.items() if k in ref)
print(json.dumps({**seen, "gather_flag": ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"],
                  "same_keys": sorted(saved) == sorted(ref), "max_abs_diff": lora_moved}))
"""


@pytest.mark.slow
def test_zero3_builds_the_model_partitioned_and_saves_it_through_the_16bit_gather(tiny_model_dir, tmp_path):
    """ZeRO-3 on CPU (gloo, world 1): from_pretrained already returns partitioned parameters (transformers'
    HfDeepSpeedConfig + deepspeed.zero.Init), and the merged LoRA model saved from DeepSpeed's module-by-module
    16-bit consolidation equals peft's merge_and_unload of the gathered model after a training step."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    train = {"num_workers": 1, "zero_stage": 3, "lr": 1e-2, "lora": {"enabled": True, "r": 4, "alpha": 8, "merge": True}}
    done = subprocess.run([sys.executable, "-c", _ZERO3_SCRIPT, str(tiny_model_dir), json.dumps(train),
                           str(tmp_path / "final")], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["partitioned_at_load"] is True and "device_map" not in got["kwargs"]
    assert got["gather_flag"] is True and got["same_keys"] is True
    assert got["max_abs_diff"] < 1e-6


def test_load_kwargs_bf16_straight_onto_the_gpu():
    import torch

    from ray_cluster_ft.train.loop import load_kwargs

    assert load_kwargs("bf16", 2, "cuda", 3) == {"dtype": torch.bfloat16, "device_map": {"": "cuda:3"}}
    assert load_kwargs("fp16", 0, "cuda", 0) == {"dtype": torch.float16, "device_map": {"": "cuda:0"}}
    assert load_kwargs("bf16", 3, "cuda", 1) == {"dtype": torch.bfloat16}  # ZeRO-3: zero.Init places the shards
    assert load_kwargs("fp32", 2, "cpu") == {"dtype": torch.float32}
    assert load_kwargs("bf16", 2, "cpu") == {"dtype": torch.bfloat16}


def test_sketch_actors_load_bf16_weights_where_they_run_in_bf16():
    import torch

    from ray_cluster_ft.features.sketchers import sketch_load_dtype

    assert sketch_load_dtype("cuda", "auto") == torch.bfloat16
    assert sketch_load_dtype("cuda", "bfloat16") == torch.bfloat16
    assert sketch_load_dtype("cuda", "float32") == torch.float32
    assert sketch_load_dtype("cpu", "auto") == torch.float32
    assert sketch_load_dtype("cpu", "bfloat16") == torch.bfloat16


def test_sketcher_holds_the_weights_in_the_load_dtype(tiny_model_dir):
    import torch

    from ray_cluster_ft.config import SketchConfig
    from ray_cluster_ft.features.sketchers import GradientSketcher

    sk = GradientSketcher(str(tiny_model_dir), SketchConfig(dtype="bfloat16", k_in=4, k_out=4, dim=16).model_dump(),
                          device="cpu")
    assert {p.dtype for p in sk.model.parameters()} == {torch.bfloat16}


def test_merge_lora_state_dict_equals_peft_merge_and_unload(tiny_model_dir):
    import torch
    from peft import LoraConfig, get_peft_model

    from ray_cluster_ft.model import load_local_model
    from ray_cluster_ft.train.loop import merge_lora_state_dict

    torch.manual_seed(0)
    model = get_peft_model(load_local_model(str(tiny_model_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at zero: make the merge change something
    merged = merge_lora_state_dict(model.state_dict(), 8 / 4)
    ref = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(ref)
    assert max(float((merged[k] - ref[k]).abs().max()) for k in ref) < 1e-6
    with pytest.raises(KeyError):
        merge_lora_state_dict({"base_model.model.a.base_layer.weight": torch.zeros(2, 2)}, 1.0)


def test_zero3_dict_gathers_16bit_weights_on_save():
    ds = deepspeed_config(TrainConfig(zero_stage=3), 1)
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_16bit_weights_on_model_save" not in deepspeed_config(TrainConfig(zero_stage=2), 1)[
        "zero_optimization"]


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    """torch waits forever on an op's lock file: a stale one (old, no process building in its folder) goes, a
    fresh one or one whose build runs (a process working in the folder) stays."""
    from ray_cluster_ft.train._op_locks import clear_stale_build_locks

    old = time.time() - 3600
    for op in ("cpu_adam", "building", "fresh"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").touch()
    for op in ("cpu_adam", "building"):
        os.utime(tmp_path / op / "lock", (old, old))
    build = subprocess.Popen(["sleep", "60"], cwd=tmp_path / "building")  # stands in for ninja
    try:
        removed = clear_stale_build_locks(tmp_path)
    finally:
        build.kill()
        build.wait()
    assert removed == [tmp_path / "cpu_adam" / "lock"]
    assert not (tmp_path / "cpu_adam" / "lock").exists()
    assert (tmp_path / "building" / "lock").exists() and (tmp_path / "fresh" / "lock").exists()
    assert f"removed the build lock {tmp_path / 'cpu_adam' / 'lock'}, left 60 min ago" in capsys.readouterr().out
    assert clear_stale_build_locks(tmp_path / "missing") == []
