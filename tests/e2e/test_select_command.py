"""``ray-cluster-ft select``: the plan-only artifacts of the pinned files spec, plus the selected rows as they
were read (selected.jsonl, selected.parquet) with their cluster, weight and first planned rank and step."""

from __future__ import annotations

import contextlib
import io
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from ray_cluster_ft.data import canonicalize, example_id
from ray_cluster_ft.rundir import read_ledger

from tests._pins import (
    FILES_FULL_PINNED,
    FILES_SELECTED_PINNED,
    FIXTURE,
    SELECTED,
    files_spec,
    full_pins,
    assert_full_pins,
)

ADDED = ["example_id", "cluster", "weight", "rank", "step", "source_file", "source_line"]


@pytest.fixture(scope="module")
def selected(tmp_path_factory, tiny_model_dir):
    from ray_cluster_ft.cli import main

    tmp = tmp_path_factory.mktemp("select")
    spec = tmp / "files.yaml"
    spec.write_text(yaml.safe_dump(files_spec(tiny_model_dir)))
    out = tmp / "run"
    printed = io.StringIO()  # module scope: capsys is per test, so the CLI's lines are kept here
    with contextlib.redirect_stdout(printed):
        assert main(["select", str(spec), "--output", str(out)]) == 0
    records = [json.loads(line) for line in (out / "selected.jsonl").read_text(encoding="utf-8").splitlines()]
    return out, records, printed.getvalue().splitlines()


def test_select_writes_what_plan_only_writes(selected):
    out, _, _ = selected
    assert_full_pins(full_pins(out), FILES_FULL_PINNED)
    assert_full_pins(full_pins(out, SELECTED), FILES_SELECTED_PINNED)
    assert json.loads((out / "manifest.json").read_text())["counts"]["trained"] == 0
    assert not (out / "trained.parquet").exists()


def test_selected_rows_are_the_rows_as_read(selected):
    out, records, lines = selected
    sel = pd.read_parquet(out / "selection.parquet")
    assert [r["example_id"] for r in records] == sel["example_id"].tolist()
    assert [r["cluster"] for r in records] == sel["cluster"].tolist()
    assert [r["weight"] for r in records] == sel["weight"].tolist()
    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_id = {}
    for row in rows:
        by_id.setdefault(example_id(canonicalize(row)), row)
    lines_of = FIXTURE.read_text(encoding="utf-8").splitlines()
    for rec, (src, line) in zip(records, zip(sel["source_file"], sel["source_line"])):
        assert {k: v for k, v in rec.items() if k not in ADDED} == by_id[rec["example_id"]]
        # the file and 1-based line the row was read from, in the export and in selection.parquet
        assert (rec["source_file"], rec["source_line"]) == (src, line) == (str(FIXTURE), line)
        assert json.loads(lines_of[line - 1]) == by_id[rec["example_id"]]
    assert any(f"{out / 'selected.jsonl'} and {out / 'selected.parquet'}" in line for line in lines)


def test_rank_and_step_are_the_first_planned_appearance(selected):
    out, records, _ = selected
    plan = pd.read_parquet(out / "plan.parquet")
    for rec in records:
        mine = plan[plan["example_id"] == rec["example_id"]]
        first = mine.loc[mine["step"].idxmin()]
        assert (rec["rank"], rec["step"]) == (first["rank"], first["step"])
        assert first["epoch"] == 0


def test_selected_parquet_holds_the_same_rows_and_is_in_the_ledger(selected):
    out, records, _ = selected
    table = pq.read_table(out / "selected.parquet")
    assert table.column_names[-len(ADDED):] == ADDED
    for rec, row in zip(records, table.to_pylist()):
        assert {k: v for k, v in row.items() if v is not None} == rec
    assert {"selected.jsonl", "selected.parquet"} <= set(read_ledger(out)["paths"])


def test_selected_parquet_loads_with_datasets(selected, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a local file: nothing to fetch (read when datasets imports)
    datasets = pytest.importorskip("datasets")
    out, records, _ = selected
    ds = datasets.load_dataset("parquet", data_files=str(out / "selected.parquet"), split="train")
    assert ds.num_rows == len(records) and ds["example_id"] == [r["example_id"] for r in records]
