"""The evaluation stage on resume: the base model's scores of a stopped run are read back, per ``evaluation.paths``
file only while that file's rows are unchanged; scores after training are never read back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa

from ray_cluster_ft.config import parse_config
from ray_cluster_ft.evaluate import run
from ray_cluster_ft.rundir import prepare_run_dir


def _rows(ids: list[str]) -> pa.Table:
    return pa.table({"example_id": ids, "input_ids": [[1, 2, 3]] * len(ids), "labels": [[-100, 2, 3]] * len(ids)})


def _evaluator(calls: list):
    """Scores a model by counting calls: each score is the call's number, so a re-score is seen in the value."""
    def evaluate(model_path, examples, tasks):
        calls.append((model_path, examples.column("example_id").to_pylist()))
        return {"all": {"loss": float(len(calls))}}, [{"task": len(calls)}]
    return evaluate


def _stage(run_dir, calls, file_ids, *, when="before", resume=False):
    cfg = parse_config({"evaluation": {"max_mc": 0, "max_code": 0}})
    files = {"/data/held.jsonl": SimpleNamespace(train=_rows(file_ids))}
    return run(cfg, run_dir, model_path="/models/base", examples=_rows(["h1", "h2"]), tasks=[], when=when,
               evaluator=_evaluator(calls), eval_files=files, resume=resume)


def test_a_resumed_run_reads_back_the_base_scores_and_rescores_a_changed_file(tmp_path):
    prepare_run_dir(tmp_path, resume=False)
    calls = []
    first = _stage(tmp_path, calls, ["f1", "f2"])
    assert first.metrics == {"all": {"loss": 1.0}} and first.files == {"/data/held.jsonl": {"all": {"loss": 2.0}}}
    kept = json.loads((tmp_path / "eval_before_file0.json").read_text())
    assert kept["metrics"] == {"all": {"loss": 2.0}} and len(kept["rows_sha256"]) == 64

    again = _stage(tmp_path, calls, ["f1", "f2"], resume=True)  # the same rows: nothing scored again
    assert len(calls) == 2 and again.metrics == first.metrics and again.files == first.files

    edited = _stage(tmp_path, calls, ["f1", "f3"], resume=True)  # the file changed: it alone is scored again
    assert calls[2:] == [("/models/base", ["f1", "f3"])]
    assert edited.metrics == first.metrics and edited.files == {"/data/held.jsonl": {"all": {"loss": 3.0}}}
    assert json.loads((tmp_path / "eval_before_file0.json").read_text())["metrics"] == {"all": {"loss": 3.0}}

    fresh = _stage(tmp_path, calls, ["f1", "f3"])  # not a resume: everything is scored
    assert len(calls) == 5 and fresh.metrics == {"all": {"loss": 4.0}}


def test_scores_after_training_are_never_read_back(tmp_path):
    prepare_run_dir(tmp_path, resume=False)
    calls = []
    _stage(tmp_path, calls, ["f1"], when="after")
    again = _stage(tmp_path, calls, ["f1"], when="after", resume=True)
    assert len(calls) == 4 and again.metrics == {"all": {"loss": 3.0}}
    assert not list(tmp_path.glob("eval_before*.json")) and (tmp_path / "eval_after_file0_samples.jsonl").is_file()
