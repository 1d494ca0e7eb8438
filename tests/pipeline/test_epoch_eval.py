"""Per-epoch evaluation (``evaluation.every_epoch``): every epoch's model scored, the best one kept."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.evaluate import EvaluateOutput, best_epoch, held_out_losses
from ray_cluster_ft.pipeline.recipe import _evaluate_epochs
from ray_cluster_ft.rundir import prepare_run_dir


def test_held_out_losses_macro_and_token_weighted():
    files = {"a": {"all": {"loss": 1.0, "tokens": 300}}, "b": {"all": {"loss": 2.0, "tokens": 100}},
             "empty": {}}
    got = held_out_losses({"all": {"loss": 9.0, "tokens": 5}}, files)
    assert got == {"macro_loss": 1.5, "token_loss": 1.25, "basis": "files"}
    assert held_out_losses({"all": {"loss": 0.7, "tokens": 5}}, {}) == {"macro_loss": 0.7, "token_loss": 0.7,
                                                                          "basis": "split"}
    assert held_out_losses({}, {"x": {"all": {"loss": float("nan"), "tokens": 3}}})["macro_loss"] is None


def test_best_epoch_is_the_lowest_macro_loss_and_the_earlier_on_a_tie():
    rows = [{"epoch": 1, "macro_loss": 1.2}, {"epoch": 2, "macro_loss": 1.1}, {"epoch": 3, "macro_loss": 1.1}]
    assert best_epoch(rows) == 2
    assert best_epoch([{"epoch": 1, "macro_loss": None}]) is None


def test_every_epoch_is_scored_and_only_the_best_folder_is_kept(tmp_path):
    cfg = parse_config({"evaluation": {"every_epoch": True}, "output": {"dir": str(tmp_path)}})
    prepare_run_dir(tmp_path, resume=False)
    for e in (1, 2):
        (tmp_path / "epochs" / f"epoch{e}").mkdir(parents=True)
    final = tmp_path / "final_model"
    final.mkdir()
    losses = {"epoch1": 1.0, "epoch2": 0.5, "final_model": 0.7}
    seen = []

    def evaluator(model_path, table, tasks):
        seen.append(model_path.rsplit("/", 1)[-1])
        return {"all": {"loss": losses[seen[-1]], "tokens": 10}}, []

    held = pa.table({"example_id": ["x"], "input_ids": [[1, 2]], "labels": [[-100, 2]], "domain": ["d"]})
    after = EvaluateOutput("after", {"all": {"loss": 0.7, "tokens": 10}}, {})
    rows = _evaluate_epochs(cfg, tmp_path, final, after, {"examples": held, "tasks": [], "evaluator": evaluator,
                                                          "eval_files": {}})
    assert seen == ["epoch1", "epoch2"]  # the last epoch's scores are `after`'s: not scored again
    assert [(r["epoch"], r["macro_loss"], r["best"]) for r in rows] == [(1, 1.0, False), (2, 0.5, True),
                                                                          (3, 0.7, False)]
    assert not (tmp_path / "epochs" / "epoch1").exists() and (tmp_path / "epochs" / "epoch2").is_dir()
    assert final.is_dir()  # the final model is never removed
    assert [r["model"] for r in rows] == [None, str(tmp_path / "epochs" / "epoch2"), str(final)]
    assert (tmp_path / "eval_epoch1_samples.jsonl").exists()


def test_every_epoch_needs_a_saved_model():
    with pytest.raises(ConfigError, match="every_epoch"):
        parse_config({"evaluation": {"every_epoch": True}, "output": {"save_model": False}})
