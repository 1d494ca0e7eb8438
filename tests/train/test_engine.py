"""What the worker builds, checked in a one-process DeepSpeed world (no Ray): the optimizer class DeepSpeed
constructs (torch's AdamW, or DeepSpeed's CPU Adam under offload), the dtype the model is loaded in, gradient
checkpointing and the attention kernel; and the precision settings of the DeepSpeed dict."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ray_cluster_ft.config import ConfigError, TrainConfig, parse_config
from ray_cluster_ft.train import deepspeed_config
from ray_cluster_ft.train.deepspeed import precision_for, resolve_precision

_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch
from ray_cluster_ft.config import TrainConfig
from ray_cluster_ft.train.deepspeed import deepspeed_config, precision_for
from ray_cluster_ft.train.loop import _build_engine, _namespace

train = TrainConfig(**json.loads(sys.argv[2]))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(model_dir, **train) -> dict:
    from ray_cluster_ft.model import cache_dir

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(cache_dir() / "torch_extensions")}  # the trainer's cache: built once
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(model_dir), json.dumps({"num_workers": 1, **train})],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_worker_builds_the_configured_optimizer_dtype_and_checkpointing(tiny_model_dir):
    plain = _build(tiny_model_dir, zero_stage=2)
    assert plain == {"optimizer": "AdamW", "dtype": "torch.float32", "precision": "fp32", "checkpointing": False,
                     "attn": "eager"}
    offload = _build(tiny_model_dir, zero_stage=2, offload="optimizer", precision="bf16", gradient_checkpointing=True)
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
