"""``select --format llamafactory|axolotl``: the selection as another trainer's dataset, checked byte for byte for
a known selection of rows in three source formats (write_selected on a hand-made run directory; the CLI flag with
the pipeline stubbed out)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from ray_cluster_ft.api import write_selected
from ray_cluster_ft.config import parse_config
from ray_cluster_ft.data import canonicalize, example_id
from ray_cluster_ft.rundir import prepare_run_dir, read_ledger

ROWS = [
    {"prompt": "Add 2 and 3.", "response": "5", "tag": "math"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"}]},
    {"question": "Ünïcode?", "answer": "yes"},
    {"prompt": "not selected", "response": "x"},
]
# What each selected trainer file holds, in selection order (rows 2, 0, 1), written out by hand.
WANT_LINES = [
    '{"messages": [{"role": "user", "content": "Ünïcode?"}, {"role": "assistant", "content": "yes"}]}',
    '{"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]}',
    '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}, '
    '{"role": "assistant", "content": "Paris"}]}',
]
WANT_INFO = """{
  "ray_cluster_ft_selected": {
    "file_name": "selected.jsonl",
    "formatting": "sharegpt",
    "columns": {
      "messages": "messages"
    },
    "tags": {
      "role_tag": "role",
      "content_tag": "content",
      "user_tag": "user",
      "assistant_tag": "assistant",
      "system_tag": "system"
    }
  }
}
"""


def _run(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS), encoding="utf-8")
    spec = {"data": {"source": "files", "paths": [str(src)]}, "output": {"dir": str(tmp_path / "run")}}
    cfg = parse_config(spec)
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, False, [src])
    ids = [example_id(canonicalize(r)) for r in ROWS]
    order = [2, 0, 1]
    pd.DataFrame({"example_id": [ids[i] for i in order], "cluster": [1, 0, 1], "reason": "test",
                  "weight": [0.5, 1.25, 1.25]}).to_parquet(run_dir / "selection.parquet", index=False)
    pd.DataFrame({"epoch": 0, "step": [0, 0, 1, 1], "rank": [0, 1, 0, 1], "micro_index": 0,
                  "example_id": [ids[0], ids[2], ids[1], ids[0]]}).to_parquet(run_dir / "plan.parquet", index=False)
    return cfg, run_dir, spec


def test_llamafactory_writes_the_messages_and_a_dataset_info_entry(tmp_path):
    cfg, run_dir, _ = _run(tmp_path)
    paths = write_selected(cfg, run_dir, "llamafactory")
    folder = run_dir / "llamafactory"
    assert paths == (run_dir / "selected.jsonl", run_dir / "selected.parquet", folder / "selected.jsonl",
                     folder / "dataset_info.json")
    assert (folder / "selected.jsonl").read_text(encoding="utf-8") == "".join(line + "\n" for line in WANT_LINES)
    assert (folder / "dataset_info.json").read_text(encoding="utf-8") == WANT_INFO
    # line i of the trainer's file is row i of selected.jsonl (the ids, weights and clusters are there)
    rec = [json.loads(x) for x in (run_dir / "selected.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["weight"] for r in rec] == [0.5, 1.25, 1.25]
    assert {"llamafactory", "selected.jsonl"} <= set(read_ledger(run_dir)["paths"])


def test_axolotl_writes_a_chat_template_dataset(tmp_path):
    cfg, run_dir, _ = _run(tmp_path)
    paths = write_selected(cfg, run_dir, "axolotl")
    assert paths[2:] == (run_dir / "axolotl" / "selected.jsonl",)
    assert (run_dir / "axolotl" / "selected.jsonl").read_text(encoding="utf-8") == \
        "".join(line + "\n" for line in WANT_LINES)
    assert sorted(p.name for p in (run_dir / "axolotl").iterdir()) == ["selected.jsonl"]
    assert not (run_dir / "llamafactory").exists()


def test_unknown_format_is_refused_before_anything_is_written(tmp_path):
    cfg, run_dir, _ = _run(tmp_path)
    with pytest.raises(ValueError, match=r"unknown export format 'alpaca'; choose one of \['llamafactory', "
                                         r"'axolotl'\]"):
        write_selected(cfg, run_dir, "alpaca")
    assert not (run_dir / "selected.jsonl").exists()


def test_select_command_passes_format(tmp_path, monkeypatch, capsys):
    import ray_cluster_ft.pipeline as pipeline
    from ray_cluster_ft.cli import main

    cfg, run_dir, spec = _run(tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    calls = []

    def fake_pipeline(cfg, address=None, plan_only=False, resume=False):
        calls.append(plan_only)
        return {"counts": {"read": 4, "rejected": 0, "selected": 3, "trained": 0}, "timings_s": {"total": 1.0},
                "run_dir": str(run_dir)}

    monkeypatch.setattr(pipeline, "run_pipeline", fake_pipeline)
    assert main(["select", str(tmp_path / "job.yaml"), "--format", "llamafactory"]) == 0
    assert calls == [True]
    out = capsys.readouterr().out
    assert f"for llamafactory: {run_dir / 'llamafactory' / 'selected.jsonl'} and " \
           f"{run_dir / 'llamafactory' / 'dataset_info.json'}" in out
    assert (run_dir / "llamafactory" / "dataset_info.json").read_text(encoding="utf-8") == WANT_INFO
    with pytest.raises(SystemExit):
        main(["select", str(tmp_path / "job.yaml"), "--format", "alpaca"])


def test_a_lone_surrogate_in_a_field_the_format_does_not_read_is_written_as_its_escape(tmp_path):
    """Found by a review: ``{"meta": {"note": "\\ud800"}}`` is legal JSON, the row trains (its text is valid), and
    ``select`` then died writing ``selected.jsonl``. Both files keep the row; the surrogate stays an escape, and
    valid non-ASCII text stays itself."""
    import pyarrow.parquet as pq

    rows = [{"prompt": "Ünïcode?", "response": "yes", "meta": {"note": "\ud800"}}]
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps(rows[0]) + "\n", encoding="ascii")
    cfg = parse_config({"data": {"source": "files", "paths": [str(src)]}, "output": {"dir": str(tmp_path / "run")}})
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, False, [src])
    eid = example_id(canonicalize(rows[0]))
    pd.DataFrame({"example_id": [eid], "cluster": [0], "reason": "test", "weight": [1.0]}).to_parquet(
        run_dir / "selection.parquet", index=False)
    pd.DataFrame({"epoch": 0, "step": [0], "rank": [0], "micro_index": 0, "example_id": [eid]}).to_parquet(
        run_dir / "plan.parquet", index=False)
    jsonl, parquet = write_selected(cfg, run_dir, None)
    line = jsonl.read_text(encoding="utf-8").strip()
    assert '"meta": {"note": "\\ud800"}' in line and json.loads(line)["meta"] == {"note": "\ud800"}
    assert json.loads(line)["prompt"] == "Ünïcode?"
    assert json.loads(pq.read_table(parquet).column("meta")[0].as_py()) == {"note": "\ud800"}
