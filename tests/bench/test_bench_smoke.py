"""Every bench script runs: each on tiny inputs (the tiny model, a few rows), in a subprocess as a user runs it,
its last line the JSON summary it prints. Figures are not checked here (the scripts' own runs are the
measurements); what is checked is that the script gets to its summary and writes it where asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._common import shared_data_dir

REPO = Path(__file__).resolve().parents[2]
needs_data = pytest.mark.skipif(shared_data_dir() is None, reason="the shared data folder is absent")


def _run(script: str, *args: str, timeout: int = 600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)  # gpu_check starts a process group of its own
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_data
def test_sketch_throughput_runs(tiny_model_dir, tmp_path):
    out = tmp_path / "st.json"
    fig = _run("sketch_throughput.py", "--model", str(tiny_model_dir), "--batches", "1", "--repeats", "1",
               "--batch", "2", "--seq", "32", "--k", "4", "--dim", "16", "--out", str(out))
    assert fig["batches"] == 1 and fig["seq"] == 32 and fig["sketch_over_step_all"] > 0
    assert fig["hidden_mean_ratio"] > 0 and fig["last_layer_ratio"] > 0 and fig["hidden_mean_examples_per_s"] > 0
    assert fig["lm_head_share_of_forward"] < 1
    assert json.loads(out.read_text())["sketch_vs_exact_rel_err_all"] < 1e-3


@needs_data
def test_sketch_fidelity_runs(tiny_model_dir, tmp_path):
    out = tmp_path / "sf.json"
    fig = _run("sketch_fidelity.py", "--model", str(tiny_model_dir), "--examples", "4", "--last-blocks", "1",
               "--k", "4", "--dims", "8", "16", "--max-seq-len", "64", "--out", str(out))
    assert fig["examples"] >= 2 and "pearson_16" in fig and out.is_file()  # 4 read, the overlong dropped


@pytest.mark.slow
def test_plan_scale_runs(tmp_path):
    out = tmp_path / "ps.json"
    # One size: each costs two processes, the streamed one with a Ray of its own (a second size: 14.7 CPU-s more).
    fig = _run("plan_scale.py", "--sizes", "1000", "--out", str(out))
    assert fig["seconds_1e3"] > 0 and fig["streamed_seconds_1e3"] > 0 and fig["streamed_stages_1e3"]["cluster"] > 0
    assert "growth_per_10x_1e3" not in fig and json.loads(out.read_text()) == fig  # a growth needs two sizes


@pytest.mark.slow
@needs_data
def test_plan_goals_runs(tmp_path):
    out = tmp_path / "pg.json"
    fig = _run("plan_goals.py", "--rows", "300", "--workers", "2", "--no-scale", "--synthetic-rows", "2000",
               "--out", str(out))
    assert fig["rows"] == 300 and set(fig["runs"]) >= {"tfidf_W2_k4", "random_W2_k8"} and out.is_file()
    assert "cluster_default" in fig["runs"]["random_W2_k4"]
    demo, synth = fig["defaults"]["demo"], fig["defaults"]["synthetic"]
    assert demo["shape"] == {"rows": 86, "tokens": 14051, "k": 5, "W": 2, "B": 4, "G": 1, "epochs": 2}
    assert synth["shape"]["rows"] == 2000 and synth["shape"]["W"] == 8
    for r in (demo, synth):  # the new default: no collision counted per row, no padding (the figures: the docs)
        new, old = r["new_default_sized_packs"], r["old_default_unpacked"]
        assert new["collisions_per_step_rows"] == 0 and new["padding_fraction"] == 0 and old["padding_fraction"] > 0


@pytest.mark.slow
def test_gpu_check_dry_run_matches_its_references(tiny_model_dir):
    """``--device cpu`` on the tiny model lands near the fp32 CPU references it checks a GPU against."""
    fig = _run("gpu_check.py", "--device", "cpu", "--rows", "2", "--max-len", "64", "--model", str(tiny_model_dir))
    assert fig["device"] == "cpu" and fig["rows"] == 2
    # On the CPU in fp32 the features and the ZeRO steps run the reference computation: rounding only.
    for key in ("gradient_rel_err", "last_layer_rel_err", "zero2_loss_rel_err", "zero3_loss_rel_err"):
        assert 0.0 <= fig[key] < 1e-5, (key, fig[key])
    # A pack against separate per-example passes: other shapes, other float sums (1.5e-5 on the demo model, README).
    assert 0.0 <= fig["packed_sdpa_loss_rel_err"] < 1e-4 and 0.0 <= fig["packed_sdpa_grad_rel_err"] < 1e-4
    assert fig["packed_sdpa_grad_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert fig["reference_loss"] > 0 and fig["zero2_tokens_per_s"] > 0


@pytest.mark.slow
@needs_data
def test_feature_store_runs(tmp_path):
    out = tmp_path / "fs.json"
    _run("feature_store.py", "--model", "tiny", "--n", "24", "--grow", "0.25", "--max-seq-len", "128",
         "--no-from-run", "--smoke", "--work", str(tmp_path / "work"), "--out", str(out))
    fig = json.loads(out.read_text())
    assert fig["computes_exactly_the_new_rows"] and fig["second_features_reused"] == fig["candidates_first"]


@pytest.mark.slow
@needs_data
def test_paper_setup_runs(tiny_model_dir, tmp_path):
    fig = _run("paper_setup.py", "--setup", "demo-mix", "--quick", "--model", str(tiny_model_dir),
               "--arms", "ours", "--out", str(tmp_path / "e2e"), timeout=900)
    assert (tmp_path / "e2e" / "report.md").is_file() and (tmp_path / "e2e" / "end_to_end.json").is_file()
    assert "budget_effective" in fig


@pytest.mark.slow
def test_data_throughput_runs(tiny_model_dir, tmp_path):
    out = tmp_path / "dt.json"
    fig = _run("data_throughput.py", "--rows", "300", "--cpus", "2", "--model", str(tiny_model_dir),
               "--chunk-bytes", "4096", "--out", str(out))
    (size,) = fig["sizes"]
    assert size["rows"] == 300 and size["same"] is True and size["single_rows_per_s"] > 0 and size["ray_rows_per_s"] > 0
    assert size["accepted"] + size["rejected"] == 300 and size["rejected"] > 0  # the malformed lines and repeats
    assert json.loads(out.read_text()) == fig
