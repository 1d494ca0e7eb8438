"""``bench/gpu_check.py`` stays runnable: its ``--device cpu`` dry run on the tiny model, in a subprocess (it
starts a process group), lands near the fp32 CPU references it checks a GPU against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_matches_its_references(tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    argv = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--rows", "2", "--max-len", "64",
            "--model", str(tiny_model_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    fig = json.loads(done.stdout.strip().splitlines()[-1])
    assert fig["device"] == "cpu" and fig["rows"] == 2
    # On the CPU in fp32 the features and the ZeRO steps run the reference computation: rounding only.
    for key in ("gradient_rel_err", "last_layer_rel_err", "zero2_loss_rel_err", "zero3_loss_rel_err"):
        assert 0.0 <= fig[key] < 1e-5, (key, fig[key])
    # A pack against separate per-example passes: other shapes, other float sums (1.5e-5 on the demo model, README).
    assert 0.0 <= fig["packed_sdpa_loss_rel_err"] < 1e-4 and 0.0 <= fig["packed_sdpa_grad_rel_err"] < 1e-4
    assert fig["packed_sdpa_grad_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert fig["reference_loss"] > 0 and fig["zero2_tokens_per_s"] > 0
