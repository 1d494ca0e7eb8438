"""The run directory is owned by proof (a marker with the run id and a ledger of what the run wrote), never by
file names: nothing a run did not write is removed or overwritten."""

from __future__ import annotations

import json
import os

import pytest

from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.rundir import RUN_MARKER, claim, input_paths, prepare_run_dir, read_ledger


def test_a_file_or_an_uncreatable_path_is_refused(tmp_path):
    a_file = tmp_path / "out.txt"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match="output.dir .*out.txt is a file, not a directory"):
        prepare_run_dir(a_file, resume=False)
    with pytest.raises(ConfigError, match="output.dir .*out.txt/sub cannot be created: Not a directory"):
        prepare_run_dir(a_file / "sub", resume=False)
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("names", [["config.yaml"], ["manifest.json", "config.yaml", "report.md"],
                                   ["examples.parquet", "notes.txt"], [RUN_MARKER, "plan.parquet"]])
def test_files_named_like_artifacts_are_no_proof(tmp_path, names):
    folder = tmp_path / "project"
    folder.mkdir()
    for n in names:
        (folder / n).write_text(f"the user's {n}")  # an empty or foreign marker is no proof either
    before = {p.name: p.read_text() for p in folder.iterdir()}
    with pytest.raises(ConfigError, match="holds '.*' and has no ray-cluster-ft run marker, so no run wrote "
                                          "it; nothing was touched"):
        prepare_run_dir(folder, resume=False)
    with pytest.raises(ConfigError, match="nothing was touched"):
        prepare_run_dir(folder, resume=True)
    assert {p.name: p.read_text() for p in folder.iterdir()} == before


def test_a_fresh_run_removes_only_what_its_ledger_lists(tmp_path):
    run = tmp_path / "runs" / "x"
    first = prepare_run_dir(run, resume=False)
    assert read_ledger(run) == {"run_id": first, "paths": []}
    for d in ("final_model", "trained", "sketches"):
        claim(run, d).mkdir()
    for f in ("train_log.jsonl", "plan.parquet"):
        claim(run, f).write_text("old")
    assert read_ledger(run)["paths"] == ["final_model", "trained", "sketches", "train_log.jsonl", "plan.parquet"]
    assert prepare_run_dir(run, resume=True) == first  # a resume keeps everything and the run id
    assert (run / "final_model").exists() and (run / "train_log.jsonl").exists()
    second = prepare_run_dir(run, resume=False)
    assert second != first
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER, "sketches"]  # shards are reused by key
    assert read_ledger(run)["paths"] == ["sketches"]


def test_a_run_directory_inside_another_run_is_refused(tmp_path):
    outer = tmp_path / "runs" / "x"
    prepare_run_dir(outer, resume=False)
    for inner in (outer / "sub", outer / "a" / "b"):
        with pytest.raises(ConfigError, match=f"output.dir {inner} lies inside the run directory {outer}; give it"):
            prepare_run_dir(inner, resume=False)
    assert sorted(p.name for p in outer.iterdir()) == [RUN_MARKER]  # nothing made there: the outer run still runs
    prepare_run_dir(outer, resume=False)
    prepare_run_dir(tmp_path / "runs" / "y", resume=False)  # a sibling is fine


def test_an_unlisted_entry_in_an_owned_folder_is_refused_and_kept(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False)
    claim(run, "plan.parquet").write_text("ours")
    (run / "report.md").write_text("the user's notes")  # named like an artifact, but never claimed
    with pytest.raises(ConfigError, match="holds 'report.md' which its ledger does not list; nothing"):
        prepare_run_dir(run, resume=False)
    assert (run / "report.md").read_text() == "the user's notes" and (run / "plan.parquet").exists()
    # A stage never writes over it either.
    with pytest.raises(ConfigError, match="'report.md' appeared there during the run and no run wrote it"):
        claim(run, "manifest.json", "report.md")
    assert (run / "report.md").read_text() == "the user's notes"
    with pytest.raises(ConfigError, match="not a prepared run directory"):
        claim(tmp_path, "x.json")


def test_an_input_inside_the_output_folder_is_never_touched(tmp_path):
    data = tmp_path / "work" / "examples.parquet"
    data.parent.mkdir()
    data.write_text("the user's data")
    cfg = parse_config({"data": {"paths": [str(data)]}})
    with pytest.raises(ConfigError, match=r"holds an input of this job \(.*examples.parquet\)"):
        prepare_run_dir(data.parent, resume=False, inputs=input_paths(cfg))
    # Even a folder this tool owns: the input is refused before its ledger is read.
    owned = tmp_path / "owned"
    prepare_run_dir(owned, resume=False)
    inner = claim(owned, "examples.parquet")
    inner.write_text("written by the run, then named as data")
    cfg = parse_config({"data": {"paths": [str(inner)]}})
    with pytest.raises(ConfigError, match="holds an input of this job"):
        prepare_run_dir(owned, resume=False, inputs=input_paths(cfg))
    assert inner.read_text() == "written by the run, then named as data"
    assert data.read_text() == "the user's data"


def test_the_reported_deletion_is_refused_through_the_cli(tmp_path, capsys):
    """Issue 19's reproduction: a folder with notes.txt and the user's examples.parquet, which is also the
    data file of the spec, run with --output that folder and --plan-only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_cluster_ft.cli import main

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("notes")
    rows = pa.table({"prompt": [f"q{i}" for i in range(60)], "response": [f"a{i}" for i in range(60)]})
    pq.write_table(rows, folder / "examples.parquet")
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({"data": {"paths": [str(folder / "examples.parquet")]}}))
    assert main(["run", str(spec), "--output", str(folder), "--plan-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds an input of this job" in err
    assert pq.read_table(folder / "examples.parquet").equals(rows)
    assert sorted(p.name for p in folder.iterdir()) == ["examples.parquet", "notes.txt"]


@pytest.mark.parametrize("entry", ["../../victim", "/tmp/victim2", "", ".", "..", "a/b", RUN_MARKER])
def test_a_hand_edited_ledger_cannot_reach_outside_the_folder(tmp_path, entry):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "a").write_text("x")
    run = tmp_path / "runs" / "evil"
    run.mkdir(parents=True)
    (run / RUN_MARKER).write_text(json.dumps({"run_id": "abc", "paths": [entry, "plan.parquet"]}))
    with pytest.raises(ConfigError, match="its ledger lists .*, which is not a name inside the folder; nothing"):
        prepare_run_dir(run, resume=False)
    assert (victim / "a").read_text() == "x" and (run / RUN_MARKER).is_file()


def test_symlinks_in_place_of_the_runs_folders_are_never_followed(tmp_path):
    mine = tmp_path / "bigdisk"
    mine.mkdir()
    (mine / "my_table.parquet").write_text("the user's")
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False)
    claim(run, "sketches").mkdir()
    claim(run, "final_model").mkdir()
    (run / "sketches").rmdir()
    (run / "sketches").symlink_to(mine)
    with pytest.raises(ConfigError, match="'sketches' is a symlink, not what the run wrote"):
        prepare_run_dir(run, resume=True)
    with pytest.raises(ConfigError, match="'sketches' is a symlink"):
        claim(run, "sketches")
    prepare_run_dir(run, resume=False)  # a fresh run removes the link, never what it points at
    assert not os.path.lexists(run / "sketches") and (mine / "my_table.parquet").read_text() == "the user's"


def test_a_marker_that_is_not_a_file_is_refused_and_nothing_is_left_behind(tmp_path):
    folder = tmp_path / "user"
    (folder / RUN_MARKER).mkdir(parents=True)
    with pytest.raises(ConfigError, match="is not a ray-cluster-ft marker file; nothing was touched"):
        prepare_run_dir(folder, resume=False)
    assert [p.name for p in folder.iterdir()] == [RUN_MARKER]
