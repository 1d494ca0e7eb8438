import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import DataConfig
from ray_cluster_ft.data import canonicalize, example_id, load_examples
from ray_cluster_ft.data.examples import tokenize_rows
from ray_cluster_ft.data.read import iter_demo_rows

from ..conftest import shared_data_dir


def test_canonicalize_formats():
    pr = canonicalize({"prompt": "p", "response": "r"})
    qa = canonicalize({"question": "p", "answer": "r"})
    ch = canonicalize({"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]})
    assert pr == qa == ch == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert example_id(pr) == example_id(ch) and len(example_id(pr)) == 16
    assert example_id(pr) != example_id(canonicalize({"prompt": "p", "response": "r2"}))


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "p"}, "missing field 'response'"),
        ({"prompt": "  ", "response": "r"}, "empty prompt"),
        ({"prompt": "p", "response": ""}, "empty response"),
        ({"prompt": 3, "response": "r"}, "field 'prompt' is int"),
        ({"text": "x"}, "missing field"),
        ({"messages": [{"role": "user", "content": "p"}]}, "not the assistant's"),
        ({"messages": [{"role": "robot", "content": "p"}, {"role": "assistant", "content": "r"}]}, "role"),
        ({"messages": "hi"}, "non-empty list"),
        ([1], "not a JSON object"),
    ],
)
def test_canonicalize_rejects(row, reason):
    with pytest.raises(ValueError, match=reason):
        canonicalize(row)


def test_tokenize_masks_prompt_and_handles_overlong(demo_tokenizer):
    msgs = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]]
    [(ids, labels, cut)] = tokenize_rows(msgs, demo_tokenizer, 512)
    full = demo_tokenizer(demo_tokenizer.apply_chat_template(msgs[0], tokenize=False), add_special_tokens=False)
    assert ids == full["input_ids"] and not cut
    n_resp = sum(1 for x in labels if x != -100)
    # the response "4", the end-of-turn token and the template's trailing newline carry the loss
    assert demo_tokenizer.decode([t for t in labels if t != -100]).startswith("4<|im_end|>")
    assert labels[: len(ids) - n_resp] == [-100] * (len(ids) - n_resp)
    n = len(ids)
    [reason] = tokenize_rows(msgs, demo_tokenizer, n - 1, "drop")
    assert reason.startswith("over max length")
    [(ids2, labels2, cut2)] = tokenize_rows(msgs, demo_tokenizer, n - 1, "truncate")
    assert ids2 == ids[: n - 1] and labels2 == labels[: n - 1] and cut2


def test_demo_rows_are_real_and_deterministic():
    rows = list(iter_demo_rows())
    srcs = [s for s, _, _ in rows]
    assert srcs.count("humaneval") == 164 and srcs.count("mmlu-medical") == 1089
    a = [(s, p) for s, p, _ in iter_demo_rows(limit=10, seed=3)]
    assert a == [(s, p) for s, p, _ in iter_demo_rows(limit=10, seed=3)]
    assert len(a) == 20 and a != [(s, p) for s, p, _ in iter_demo_rows(limit=10, seed=4)]
    med = next(r for s, _, r in rows if s == "mmlu-medical")
    assert med["response"][0] in "ABCD" and med["response"][1:3] == ". "


def _write_jsonl(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else line.encode()) + b"\n")


def test_load_examples_accounts_for_every_row(tmp_path, demo_tokenizer):
    good = [json.dumps({"prompt": f"question {i}?", "response": f"answer {i}", "domain": "d"}) for i in range(20)]
    bad = [
        b"{not json",
        b'"a string"',
        json.dumps({"prompt": "q"}).encode(),
        json.dumps({"prompt": "q", "response": " "}).encode(),
        b'{"prompt": "caf\xe9", "response": "x"}',  # latin-1 byte: invalid UTF-8
        json.dumps({"prompt": "long " * 400, "response": "x"}).encode(),
        good[0].encode(),  # duplicate content
    ]
    f = tmp_path / "mix.jsonl"
    _write_jsonl(f, [x.encode() for x in good] + [b""] + bad)
    res = load_examples(DataConfig(source="files", paths=[str(f)], max_seq_len=128, eval_fraction=0.2), demo_tokenizer)
    assert res.n_read == 27  # the blank line is not a row
    assert res.train.num_rows + res.eval.num_rows == 20 and len(res.rejected) == 7
    assert res.eval.num_rows == 4
    reasons = sorted(r.reason.split(":")[0] for r in res.rejected)
    assert reasons == sorted(["malformed JSON", "not a JSON object", "missing field 'response'", "empty response",
                              "bad encoding", "over max length", "duplicate example"])
    assert {r.position for r in res.rejected} == set(range(22, 29))
    labels = res.train.column("labels").to_pylist()
    assert all(any(x != -100 for x in lab) for lab in labels)


def test_load_examples_parquet_and_missing_file(tmp_path, demo_tokenizer):
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?", ""], "answer": ["x", "y", "z"]}), p)
    res = load_examples(DataConfig(source="files", paths=[str(p)], eval_fraction=0.0), demo_tokenizer)
    assert (res.n_read, res.train.num_rows, len(res.rejected)) == (3, 2, 1)
    assert res.rejected[0].position == 2 and res.rejected[0].reason == "empty question"
    with pytest.raises(FileNotFoundError, match="not found"):
        load_examples(DataConfig(source="files", paths=[str(tmp_path / "nope.jsonl")]), demo_tokenizer)


@pytest.mark.skipif(shared_data_dir() is None, reason="../shared/data not present")
def test_shared_data_reads_cleanly(demo_tokenizer):
    f = shared_data_dir() / "mbpp.jsonl"
    res = load_examples(DataConfig(source="files", paths=[str(f)], max_seq_len=1024, eval_fraction=0.1), demo_tokenizer)
    assert res.n_read == 974
    # MBPP's one duplicated question has different code, so it is kept; one task (line 493) is 2,185 tokens
    assert res.train.num_rows + res.eval.num_rows == 973
    assert [(r.position, r.reason.split(":")[0]) for r in res.rejected] == [(493, "over max length")]
    assert set(res.train.column("domain").to_pylist()) == {"code"}
    n = np.asarray(res.train.column("n_tokens").to_pylist())
    assert n.min() > 20 and n.max() <= 1024


def test_evaluation_files_that_overlap_the_candidates_or_score_nothing_are_warned_about(tmp_path, tiny_model_dir,
                                                                                        capsys):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.data.stage import run
    from ray_cluster_ft.rundir import prepare_run_dir

    rows = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(10)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overlap = tmp_path / "overlap.jsonl"  # 3 training rows and 2 new ones
    overlap.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [{"prompt": "new", "response": "x"},
                                                                         {"prompt": "new 2", "response": "y"}]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"prompt": "other", "response": "z"}) + "\n")
    cfg = parse_config({"data": {"paths": [str(train)], "eval_fraction": 0.0},
                        "model": {"path": str(tiny_model_dir)},
                        "evaluation": {"paths": [str(overlap), str(empty), str(clean)]},
                        "output": {"dir": str(tmp_path / "run")}})
    prepare_run_dir(tmp_path / "run", resume=False)
    stage = run(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert f"warning: 3 of the 5 rows of evaluation file {overlap} are also training candidates" in out
    assert f"warning: evaluation file {empty} has no row to score (0 read, 0 rejected" in out
    assert not [ln for ln in out.splitlines() if str(clean) in ln and "warning" in ln]  # only its format line
    assert stage.eval_files[str(clean)].train.num_rows == 1
    missing = tmp_path / "missing.jsonl"
    cfg = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"paths": [str(missing)]})})
    with pytest.raises(FileNotFoundError, match=f"^evaluation.paths: data file not found: {missing}$"):
        run(cfg, tmp_path / "run")  # named by its key: a data.paths file reads the same


def test_evaluation_files_are_held_to_the_unused_fields_policy(tmp_path, tiny_model_dir, capsys):
    from ray_cluster_ft.config import ConfigError, parse_config
    from ray_cluster_ft.data.stage import run
    from ray_cluster_ft.pipeline.manifest import _eval_files as manifest_eval_files
    from ray_cluster_ft.rundir import prepare_run_dir

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"question {i}", "response": f"answer {i}"}) + "\n"
                             for i in range(4)))
    held = tmp_path / "held.jsonl"  # a renamed Alpaca row: its input would not be scored
    held.write_text(json.dumps({"prompt": "Summarize.", "response": "Short.", "input": "The paragraph to sum."})
                    + "\n" + json.dumps({"prompt": "Name a colour.", "response": "Red."}) + "\n")
    spec = {"data": {"paths": [str(train)], "eval_fraction": 0.0}, "model": {"path": str(tiny_model_dir)},
            "evaluation": {"paths": [str(held)]}, "output": {"dir": str(tmp_path / "run")}}
    prepare_run_dir(tmp_path / "run", resume=False)
    stage = run(parse_config(spec), tmp_path / "run")
    out = capsys.readouterr().out
    assert f"[ray-cluster-ft] evaluation file {held}: format prompt_response (2)" in out
    assert [ln for ln in out.splitlines() if "warning:" in ln] == [
        f"[ray-cluster-ft] warning: evaluation file {held}: field 'input' is not used by the row format in 1 row; "
        "to train on it: data.columns: {prompt: [prompt, input]}"]
    entry = manifest_eval_files(stage, None, None)[str(held)]
    assert entry["data_files"] == {str(held): {"rows": 2, "formats": {"prompt_response": 2},
                                               "unused_fields": {"input": 1}}}
    assert (entry["read"], entry["scored"]) == (2, 2)

    spec["data"]["unused_fields"] = "error"
    prepare_run_dir(tmp_path / "run2", resume=False)
    with pytest.raises(ConfigError, match=rf"\n  evaluation file {held}: field 'input' is not used by the row "
                                          r"format in 1 row"):
        run(parse_config(spec), tmp_path / "run2")
    assert not (tmp_path / "run2" / "examples.parquet").exists()  # refused before anything is written
    spec["data"]["unused_fields"] = "ignore"
    run(parse_config(spec), tmp_path / "run2")
    assert "warning" not in capsys.readouterr().out


def test_an_evaluation_files_task_fields_are_scored_not_unused(tmp_path, tiny_model_dir, capsys):
    """MBPP's ``tests``, HumanEval's ``test`` and ``entry_point`` and an MC item's ``choices`` are what the
    evaluation scores: in an evaluation file they are used, under ``data.unused_fields: error`` too; a malformed
    one (no task) and the same fields in a training file (not trained on) still count as unused."""
    from ray_cluster_ft.config import ConfigError, parse_config
    from ray_cluster_ft.data.stage import run
    from ray_cluster_ft.rundir import prepare_run_dir

    mbpp = {"question": "Write a function to add two numbers.", "answer": "def add(a, b):\n    return a + b",
            "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0 and add(0, 0) == 0"], "test_setup_code": ""}
    human = {"prompt": "def inc(x):\n", "response": "    return x + 1",
             "test": "def check(candidate):\n    assert candidate(1) == 2, 'one more than one is two'",
             "entry_point": "inc"}
    mc = {"question": "Which organ pumps blood through the body?", "answer": "B",
          "choices": ["The liver of the body", "The heart of the body"], "gold": "B"}
    broken = {**mbpp, "question": "Write a function to add three numbers.", "tests": "assert add(1, 2) == 3 or so"}
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in (mbpp, human, mc)))
    spec = {"data": {"paths": [str(held)], "eval_fraction": 0.0, "unused_fields": "error"},
            "model": {"path": str(tiny_model_dir)}, "evaluation": {"paths": [str(held)]},
            "output": {"dir": str(tmp_path / "run")}}
    prepare_run_dir(tmp_path / "run", resume=False)
    with pytest.raises(ConfigError) as err:  # the training file's rows: tests, test and choices are not trained
        run(parse_config(spec), tmp_path / "run")
    lines = re.findall(r"^  (.*): field '(\w+)' is not used", str(err.value), re.M)
    assert sorted(lines) == [(str(held), "choices"), (str(held), "test"), (str(held), "tests")]  # no evaluation file

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"question {i}", "response": f"answer {i}"}) + "\n"
                             for i in range(4)))
    spec["data"]["paths"] = [str(train)]
    stage = run(parse_config(spec), tmp_path / "run")  # the evaluation file alone: nothing unused
    assert stage.eval_files[str(held)].unused == {} and stage.eval_files[str(held)].train.num_rows == 3

    held.write_text("".join(json.dumps(r) + "\n" for r in (mbpp, broken)))
    with pytest.raises(ConfigError, match=rf"\n  evaluation file {held}: field 'tests' is not used by the row "
                                          r"format in 1 row;"):
        run(parse_config(spec), tmp_path / "run")  # a tests string is no MBPP task: left unused, so reported
