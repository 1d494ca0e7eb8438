"""bench/paper_setup.py's packed arms: their job configs parse, and the packed ratios are taken against
full_packed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from ray_cluster_ft.config import parse_config

BENCH = Path(__file__).resolve().parents[2] / "bench" / "paper_setup.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_end_to_end", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_packed_arm_configs_parse(bench, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    args = bench.parse_args(["--quick"])
    for arm in ("full_packed", "ours_packed"):
        assert arm in bench.RUN_ORDER and arm in bench.ARMS
        cfg = parse_config(bench.arm_config(arm, args, 0, [str(data)], [], tmp_path / arm))
        assert cfg.allocation.packing is True
        assert cfg.train.max_tokens_per_micro_batch == args.micro_batch * args.max_seq_len == 4 * 384
    full, ours = (parse_config(bench.arm_config(a, args, 0, [str(data)], [], tmp_path / a))
                  for a in ("full_packed", "ours_packed"))
    assert (full.selection.strategy, full.allocation.strategy) == ("full", "random")
    assert (ours.selection.strategy, ours.allocation.strategy, ours.train.loss_weighting) == \
        ("balanced", "cluster", "cluster")
    plain = parse_config(bench.arm_config("ours", args, 0, [str(data)], [], tmp_path / "ours"))
    assert plain.allocation.packing is False and plain.train.max_tokens_per_micro_batch is None
    # the arm key (what a kept result is matched on) tells the packed arm from the padded one
    key = bench.arm_key("ours_packed", args, 0, [str(data)], [], tmp_path, 10)
    assert key != bench.arm_key("ours", args, 0, [str(data)], [], tmp_path, 10)


def _run(e2e: float, train: float, loss: float) -> dict:
    return {"timings_s": {**dict.fromkeys(["data", "sketch", "cluster", "select", "allocate", "evaluate_before",
                                           "evaluate_after", "total"], 0.0), "train": train},
            "e2e_s": e2e, "step_time_s": train, "heldout_loss": loss}


def test_packed_ratios_and_goals(bench):
    results = {0: {"full": _run(100, 80, 1.0), "full_packed": _run(50, 40, 1.0), "ours": _run(25, 15, 1.01),
                   "ours_packed": _run(15, 8, 1.015)},
               1: {"full": _run(100, 80, 1.0), "ours": _run(30, 16, 1.0), "ours_packed": _run(25, 12, 1.03)}}
    arms = ["full", "full_packed", "ours", "ours_packed"]
    summary = bench.summarise(results, arms, [0, 1], ["all"], [])
    # seed 1 has no full_packed: it is compared with seed 0's
    assert summary["ours_packed"]["e2e_ratio_packed"][0] == pytest.approx((15 / 50 + 25 / 50) / 2)
    assert summary["ours_packed"]["train_ratio_packed"][0] == pytest.approx((8 / 40 + 12 / 40) / 2)
    assert summary["ours_packed"]["loss_gap_packed"][0] == pytest.approx((0.015 + 0.03) / 2)
    assert summary["full_packed"]["e2e_ratio"][0] == pytest.approx(0.5)
    args = bench.parse_args(["--quick"])
    fig = bench.headline(summary, args, [0, 1], [], 10)
    assert fig["e2e_ratio_packed"] == pytest.approx(0.4) and fig["train_ratio_packed"] == pytest.approx(0.25)
    goals = {name: ok for name, _, ok in fig["goals"]}
    assert goals["e2e_ratio_packed"] is True and goals["loss_gap_packed"] is False  # 0.0225 > 0.02
    assert goals["e2e_ratio"] is True  # ours: (0.25 + 0.30) / 2 <= 0.30
    assert math.isclose(fig["full_packed_e2e_ratio"], 0.5)
