"""Inputs in the shapes users keep them (docs/data.md): globs, folders, CSV/TSV, gzip JSON Lines, JSON arrays,
Parquet and ``datasets`` save_to_disk folders, each row with its file and line."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import ConfigError, DataConfig
from ray_cluster_ft.data import load_examples
from ray_cluster_ft.data.read import CSV_EXTRA_CELLS, count_rows, expand_paths, iter_file_rows


def _rows(path, **kw):
    return [(pos, row) for _src, pos, row in iter_file_rows(path, **kw)]


def test_globs_and_folders_expand_to_sorted_files(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("b.jsonl", "a.jsonl", "c.parquet", "notes.txt"):
        (shards / name).write_text("")
    (shards / "sub").mkdir()
    assert expand_paths([str(shards / "*.jsonl")]) == [str(shards / "a.jsonl"), str(shards / "b.jsonl")]
    assert expand_paths([str(shards)]) == [str(shards / n) for n in ("a.jsonl", "b.jsonl", "c.parquet")]
    # a file named twice (by a glob and by name) is read once
    assert expand_paths([str(shards / "b.jsonl"), str(shards / "*.jsonl")]) == [str(shards / "b.jsonl"),
                                                                                 str(shards / "a.jsonl")]
    with pytest.raises(FileNotFoundError, match=r"the glob .*\*.csv matches no file"):
        expand_paths([str(shards / "*.csv")])
    with pytest.raises(FileNotFoundError, match="the folder .*sub holds no data file"):
        expand_paths([str(shards / "sub")])


def test_csv_and_tsv_rows_are_strings_with_their_lines(tmp_path):
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text('prompt,response\nq1,"two\nlines"\nq2,42\nq3,r,extra\nq4,r,x,y\n', encoding="utf-8")
    got = _rows(csv_file)
    assert got[:2] == [(2, {"prompt": "q1", "response": "two\nlines"}), (4, {"prompt": "q2", "response": "42"})]
    # Rejected with every cell kept, under one reason however many cells are extra.
    assert [(pos, r.reason, r.row) for pos, r in got[2:]] == [
        (5, "CSV row has more cells than the header", {"prompt": "q3", "response": "r", CSV_EXTRA_CELLS: ["extra"]}),
        (6, "CSV row has more cells than the header", {"prompt": "q4", "response": "r", CSV_EXTRA_CELLS: ["x", "y"]})]
    assert json.loads(got[3][1].to_json())["row"][CSV_EXTRA_CELLS] == ["x", "y"]
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("instruction\tinput\toutput\nAdd.\t1 2\t3\n")
    assert _rows(tsv) == [(2, {"instruction": "Add.", "input": "1 2", "output": "3"})]
    assert (count_rows(csv_file), count_rows(tsv)) == (4, 1)


def test_gzip_json_array_and_parquet_counts(tmp_path):
    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "response": "d"}\n'))
    arr = tmp_path / "rows.json"
    arr.write_text(json.dumps([{"prompt": "a", "response": "b"}] * 3))
    par = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", "d"]}), par)
    assert [pos for pos, _ in _rows(gz)] == [1, 3]
    assert (count_rows(gz), count_rows(arr), count_rows(par)) == (2, 3, 2)


def test_datasets_folder_reads_its_train_split(tmp_path, demo_tokenizer):
    datasets = pytest.importorskip("datasets")
    one = tmp_path / "ds"
    datasets.Dataset.from_list([{"question": "Q1?", "answer": "A1."}, {"question": "Q2?", "answer": "A2."}]
                               ).save_to_disk(str(one))
    both = tmp_path / "dsdict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p", "response": "r"}]),
                          "test": datasets.Dataset.from_list([{"prompt": "x", "response": "y"}])}).save_to_disk(str(both))
    assert expand_paths([str(one)]) == [str(one)]
    res = load_examples(DataConfig(paths=[str(one), str(both)], eval_fraction=0.0), demo_tokenizer)
    assert res.formats == {str(one): {"question_answer": 2}, str(both): {"prompt_response": 1}}
    assert list(zip(res.train.column("source_file").to_pylist(), res.train.column("source_line").to_pylist())) == [
        (str(one), 0), (str(one), 1), (str(both), 0)]
    assert count_rows(one) == 2
    nosplit = tmp_path / "nosplit"
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "x", "response": "y"}])}).save_to_disk(
        str(nosplit))
    with pytest.raises(ConfigError, match=r"has splits \['test'\] but no 'train' split"):
        list(iter_file_rows(nosplit))


def test_datasets_folder_without_the_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"needs the 'datasets' package: pip install 'ray-cluster-ft\[datasets\]'"):
        list(iter_file_rows(folder))
