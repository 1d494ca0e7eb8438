"""The evaluation stage on resume: the base model's scores of a stopped run are read back, per ``evaluation.paths``
file only while what decides them (its rows, its tasks, the ``evaluation`` settings, the model) is unchanged;
scores after training or after an epoch are never read back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pytest

from ray_cluster_ft.config import parse_config
from ray_cluster_ft.evaluate import run
from ray_cluster_ft.rundir import prepare_run_dir

A, B = "/data/a.jsonl", "/data/b.jsonl"


def _rows(ids: list[str]) -> pa.Table:
    return pa.table({"example_id": ids, "input_ids": [[1, 2, 3]] * len(ids), "labels": [[-100, 2, 3]] * len(ids)})


@pytest.fixture
def tasks_of(monkeypatch) -> dict:
    """Each file's tasks, as the test sets them (the stage reads them from the file's source rows)."""
    from ray_cluster_ft.evaluate import stage

    tasks: dict = {}
    monkeypatch.setattr(stage, "eval_tasks", lambda data_cfg, table, **_: tasks[data_cfg.paths[0]])
    return tasks


def _stage(run_dir, calls, files: dict, tasks_of: dict, *, when="before", resume=False, max_new_tokens=16,
           model="/models/base"):
    """The stage with an evaluator that scores a model by counting calls (each score is the call's number, so a
    re-score shows in the value) and records what it was asked; ``files``: path -> (row ids, tasks)."""
    def evaluate(model_path, examples, tasks):
        calls.append((model_path, examples.column("example_id").to_pylist(), tasks))
        return {"all": {"loss": float(len(calls))}}, [{"task": len(calls)}]

    tasks_of.update({path: tasks for path, (_, tasks) in files.items()})
    cfg = parse_config({"evaluation": {"max_mc": 0, "max_code": 0, "max_new_tokens": max_new_tokens}})
    eval_files = {path: SimpleNamespace(train=_rows(ids)) for path, (ids, _) in files.items()}
    return run(cfg, run_dir, model_path=model, examples=_rows(["h1", "h2"]), tasks=[], when=when,
               evaluator=evaluate, eval_files=eval_files, resume=resume)


def _loss(out, path):
    return out.files[path]["all"]["loss"]


def test_a_resumed_run_reads_back_the_base_scores_while_rows_tasks_settings_and_model_are_the_same(
        tmp_path, tasks_of):
    prepare_run_dir(tmp_path, resume=False)
    calls = []
    mc = [{"kind": "mc", "choices": ["A", "B"], "gold": 0}]
    files = {A: (["a1", "a2"], mc), B: (["b1"], [])}
    first = _stage(tmp_path, calls, files, tasks_of)
    assert first.metrics == {"all": {"loss": 1.0}} and (_loss(first, A), _loss(first, B)) == (2.0, 3.0)
    kept = json.loads((tmp_path / "eval_before_file0.json").read_text())
    assert kept["metrics"] == {"all": {"loss": 2.0}} and len(kept["key_sha256"]) == 64
    assert not list(tmp_path.glob("*.tmp"))

    again = _stage(tmp_path, calls, files, tasks_of, resume=True)  # nothing changed: nothing scored again
    assert len(calls) == 3 and again.metrics == first.metrics and again.files == first.files

    # Each change re-scores the file it touches, and only that file; the held-out split is read back throughout.
    changes = [({A: (["a1", "a3"], mc), B: files[B]}, {}, A),  # a row of A edited
               ({A: (["a1", "a3"], [{**mc[0], "gold": 1}]), B: files[B]}, {}, A),  # A's gold edited, same rows
               ({A: (["a1", "a3"], [{**mc[0], "gold": 1}]), B: files[B]}, {"max_new_tokens": 32}, None),  # both
               ({A: (["a1", "a3"], [{**mc[0], "gold": 1}]), B: files[B]}, {"max_new_tokens": 32, "model": "/m2"},
                None)]
    for new_files, kw, only in changes:
        n = len(calls)
        out = _stage(tmp_path, calls, new_files, tasks_of, resume=True, **kw)
        rescored = [c[1] for c in calls[n:]]
        want = [new_files[p][0] for p in (A, B) if only in (None, p)]
        assert rescored == want, (kw, only, rescored)
        assert out.metrics == first.metrics
        if only == A:
            assert _loss(out, A) == float(len(calls)) and _loss(out, B) == 3.0

    (tmp_path / "eval_before_file1.json").write_text('{"key_sha256": "')  # a file cut short: scored again
    n = len(calls)
    out = _stage(tmp_path, calls, {A: changes[-1][0][A], B: files[B]}, tasks_of, resume=True, max_new_tokens=32,
                 model="/m2")
    assert [c[1] for c in calls[n:]] == [["b1"]] and _loss(out, B) == float(len(calls))

    fresh = _stage(tmp_path, calls, files, tasks_of)  # not a resume: everything is scored
    assert len(calls) == n + 4 and fresh.metrics == {"all": {"loss": float(n + 2)}}


@pytest.mark.parametrize("when", ["after", "epoch1"])
def test_scores_after_training_or_an_epoch_are_never_read_back(tmp_path, when, tasks_of):
    prepare_run_dir(tmp_path, resume=False)
    calls = []
    _stage(tmp_path, calls, {A: (["a1"], [])}, tasks_of, when=when)
    again = _stage(tmp_path, calls, {A: (["a1"], [])}, tasks_of, when=when, resume=True)
    assert len(calls) == 4 and again.metrics == {"all": {"loss": 3.0}}
    assert not list(tmp_path.glob("eval_before*")) and (tmp_path / f"eval_{when}_file0_samples.jsonl").is_file()
