"""A plan-only run with a token budget and packing: the manifest's token counts and the packed plan's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mixed_120.jsonl"


def test_plan_only_run_with_a_token_budget_and_packing(tmp_path, tiny_model_dir):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.pipeline import run_pipeline

    out = tmp_path / "run"
    cfg = parse_config({
        "data": {"source": "files", "paths": [str(FIXTURE)], "max_seq_len": 256, "eval_fraction": 0.1},
        "model": {"path": str(tiny_model_dir)},
        "selection": {"strategy": "random", "budget_tokens": 0.3},
        "allocation": {"strategy": "random", "packing": True},
        "train": {"num_workers": 2, "micro_batch_size": 2, "grad_accum": 2, "epochs": 2,
                  "max_tokens_per_micro_batch": 512},
        "output": {"dir": str(out)},
    })
    m = run_pipeline(cfg, plan_only=True)
    c, b = m["counts"], m["budget"]
    assert b["tokens_requested"] == round(0.3 * c["tokens_candidates"])
    assert 0 < c["tokens_selected"] <= b["tokens_requested"]
    assert c["tokens_selected_share"] == c["tokens_selected"] / c["tokens_candidates"]
    # packing drops no row: every selected row is planned, and the counts still add up
    assert b["rounded_down_by"] == 0 and c["not_selected_breakdown"]["dropped_for_even_plan"] == 0
    assert c["accepted"] == c["selected"] + c["not_selected"]
    plan = pd.read_parquet(out / "plan.parquet")
    assert plan.groupby(["step", "rank", "micro_index"])["n_tokens"].sum().max() <= 512
    assert plan[plan["epoch"] == 0]["n_tokens"].sum() == c["tokens_selected"]
    pm = json.loads((out / "manifest.json").read_text())["plan_metrics"]["random"]
    assert 0 < pm["pack_fill"] <= 1 and pm["padding_fraction"] == 0.0 and "collisions_per_step_rows" in pm
