"""``ray-cluster-ft check`` reads the data with the tokenizer only: formats, counts, unused fields, two decoded
examples; a file that ``run`` would refuse fails it with exit status 2, in seconds."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from ray_cluster_ft.cli import main
from tests.data.test_formats import CASES


def _spec(tmp_path, model_dir, paths, **data):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"data": {"paths": [str(p) for p in paths], **data},
                                    "model": {"path": str(model_dir)}, "output": {"dir": str(tmp_path / "run")}}))
    return spec


def test_check_reads_every_format_and_shows_what_is_trained(tmp_path, tiny_model_dir, capsys):
    files = []
    for i, (fmt, row, _full, _trained) in enumerate(CASES):
        files.append(tmp_path / f"{i}-{fmt}.jsonl")
        files[-1].write_text(json.dumps(row) + "\n")
    assert main(["check", str(_spec(tmp_path, tiny_model_dir, [tmp_path / "*.jsonl"]))]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["data"]["format"] == "auto"  # stdout: the spec, as before
    for i, (fmt, *_rest) in enumerate(CASES):
        assert f"{tmp_path / f'{i}-{fmt}.jsonl'}: format {fmt} (1)" in err
        assert f"check: {tmp_path / f'{i}-{fmt}.jsonl'}: 1 rows; of the first 1: 1 accepted, 0 rejected" in err
    # the first two files' rows, trained text marked: the chat's two replies, then ShareGPT's
    assert "<|im_start|>assistant\n[[Hello.<|im_end|>\n]]<|im_start|>user\n2+2?" in err
    assert "[[Blue.<|im_end|>\n]]<|im_start|>user\nGrass?<|im_end|>\n<|im_start|>assistant\n[[Green.<|im_end|>\n]]" in err
    assert "no model weights" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("what, data, message", [
    ("missing file", {"paths": ["{tmp}/nope.jsonl"]}, "data file not found: {tmp}/nope.jsonl"),
    ("empty glob", {"paths": ["{tmp}/shards/*.jsonl"]}, "data.paths: the glob {tmp}/shards/*.jsonl matches no file"),
    ("refused format", {"paths": ["{tmp}/text.jsonl"]},
     "data file {tmp}/text.jsonl: none of its first 2 rows is accepted (rejected: {{'missing field': 2}}; the "
     "first: missing field: need 'messages', 'conversations' (sharegpt), 'instruction'+'output' (alpaca), "
     "'prompt'+'completion', 'prompt'+'response' or 'question'+'answer'; map other fields with data.columns (the "
     "row's fields: text; see docs/data.md))\n"),
    ("forced format", {"paths": ["{tmp}/pr.jsonl"], "format": "alpaca"},
     "data file {tmp}/pr.jsonl: none of its first 1 rows is accepted (rejected: "
     "{{\"missing field 'instruction'\": 1}}; the first: missing field 'instruction'); see docs/data.md for the "
     "formats and data.columns\n"),
    ("columns source in no row", {"paths": ["{tmp}/pr.jsonl"], "columns": {"prompt": ["prompt", "inptu"]}},
     "data file {tmp}/pr.jsonl: data.columns maps prompt from 'inptu', but none of the 1 rows read has that field "
     "(their fields: prompt, response, input); see docs/data.md for data.columns\n"),
    ("unused field refused", {"paths": ["{tmp}/pr.jsonl"], "unused_fields": "error"},
     "{tmp}/pr.jsonl: field 'input' is not used by the row format in 1 row; to train on it: data.columns: "
     "{{prompt: [prompt, input]}}"),
])
def test_check_fails_fast_on_data_run_would_refuse(tmp_path, tiny_model_dir, capsys, what, data, message):
    (tmp_path / "text.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"}\n')
    (tmp_path / "pr.jsonl").write_text('{"prompt": "Summarize.", "response": "Short.", "input": "The paragraph."}\n')
    data = {k: ([p.format(tmp=tmp_path) for p in v] if k == "paths" else v) for k, v in data.items()}
    spec = _spec(tmp_path, tiny_model_dir, data.pop("paths"), **data)
    start = time.perf_counter()
    assert main(["check", str(spec)]) == 2
    assert time.perf_counter() - start < 10
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_run_refuses_a_columns_source_no_row_has_before_ray(tmp_path, tiny_model_dir, capsys):
    import ray

    (tmp_path / "qa.jsonl").write_text('{"question": "Why?", "context": "Because.", "answer": "So."}\n')
    spec = _spec(tmp_path, tiny_model_dir, [tmp_path / "qa.jsonl"],
                 columns={"prompt": "question", "response": "answr"})
    assert main(["run", str(spec)]) == 2
    assert (f"data file {tmp_path / 'qa.jsonl'}: data.columns maps response from 'answr', but none of the 1 rows "
            "read has that field (their fields: question, context, answer)") in capsys.readouterr().err
    assert not ray.is_initialized() and not (tmp_path / "run" / "examples.parquet").exists()


def test_run_with_unused_fields_error_stops_before_ray(tmp_path, tiny_model_dir, capsys):
    import ray

    (tmp_path / "pr.jsonl").write_text('{"prompt": "Summarize.", "response": "Short.", "input": "The paragraph."}\n')
    spec = _spec(tmp_path, tiny_model_dir, [tmp_path / "pr.jsonl"], unused_fields="error")
    assert main(["run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pr.jsonl'}: field 'input' is not used by the row format in 1 row" in err
    assert not ray.is_initialized() and not (tmp_path / "run" / "examples.parquet").exists()
    spec = _spec(tmp_path, tiny_model_dir, [tmp_path / "pr.jsonl"])  # warn: one line naming file and field
    assert main(["check", str(spec)]) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning:" in ln]
    assert warned == [f"[ray-cluster-ft] warning: {tmp_path / 'pr.jsonl'}: field 'input' is not used by the row "
                      "format in 1 row; to train on it: data.columns: {prompt: [prompt, input]}"]


_CHECK_IMPORTS = """
import json, sys
import ray_cluster_ft
loaded = {"after_import": sorted(m for m in ("ray", "torch", "transformers") if m in sys.modules)}
from ray_cluster_ft.cli import main
rc = main(["check", sys.argv[1]])
loaded["after_check"] = sorted(m for m in ("ray", "torch") if m in sys.modules)
ray_cluster_ft.compute_sketches  # the lazy name resolves, and its module brings torch
loaded["after_compute_sketches"] = sorted(m for m in ("ray", "torch") if m in sys.modules)
print(json.dumps({"rc": rc, **loaded}), file=sys.stderr)
"""


def test_check_imports_neither_ray_nor_torch(tmp_path, tiny_model_dir):
    """The package imports its stages on first use (PEP 562), and ``check`` loads the tokenizer through the class
    that needs no torch: a fresh interpreter running the check path has not imported Ray or torch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "pr.jsonl").write_text('{"prompt": "2+2?", "response": "4"}\n{"prompt": "3+3?", "response": "6"}\n')
    spec = _spec(tmp_path, tiny_model_dir, [tmp_path / "pr.jsonl"])
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHECK_IMPORTS, str(spec)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert loaded == {"rc": 0, "after_import": [], "after_check": [], "after_compute_sketches": ["torch"]}
    assert "[[4<|im_end|>\n]]" in proc.stderr  # the check did tokenize and show the trained text


def test_checks_tokenizer_is_the_one_run_loads(tiny_model_dir, tmp_path):
    """:func:`generic_tokenizer` (no torch) gives the class, chat text, ids and pad id that ``AutoTokenizer``
    gives for the same folder; a folder ``AutoTokenizer`` could load otherwise (remote code) is left to it."""
    import shutil

    from ray_cluster_ft.data.tokenize import tokenize_rows
    from ray_cluster_ft.model import generic_tokenizer, load_tokenizer

    fast, auto = generic_tokenizer(tiny_model_dir), load_tokenizer(str(tiny_model_dir))
    assert type(fast) is type(auto) and fast.pad_token_id == auto.pad_token_id
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Größe 2+2? 日本"},
              {"role": "assistant", "content": "4"}],
             [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "    return 1\n"}]]
    assert tokenize_rows(chats, fast, 256) == tokenize_rows(chats, auto, 256)
    assert fast.apply_chat_template(chats[0], tokenize=False) == auto.apply_chat_template(chats[0], tokenize=False)
    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    conf = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**conf, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert generic_tokenizer(remote) is None and generic_tokenizer(tiny_model_dir, trust_remote_code=True) is None


def test_check_samples_evaluation_files_with_the_same_unused_fields_policy(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "train.jsonl").write_text('{"prompt": "2+2?", "response": "4"}\n')
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "Summarize.", "response": "Short.", "input": "The paragraph."}\n{"text": "a b"}\n')
    spec = yaml.safe_load(_spec(tmp_path, tiny_model_dir, [tmp_path / "train.jsonl"]).read_text())
    spec["evaluation"] = {"paths": [str(held)]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["check", str(tmp_path / "job.yaml")]) == 0
    err = capsys.readouterr().err
    assert (f"[ray-cluster-ft] check: evaluation file {held}: 2 rows; of the first 2: 1 accepted, 1 rejected "
            "{'missing field': 1}") in err
    assert (f"[ray-cluster-ft] warning: evaluation file {held}: field 'input' is not used by the row format in 1 "
            "row; to train on it: data.columns: {prompt: [prompt, input]}") in err
    spec["data"]["unused_fields"] = "error"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["check", str(tmp_path / "job.yaml")]) == 2
    assert f"evaluation file {held}: field 'input' is not used" in capsys.readouterr().err
    spec["evaluation"] = {"paths": [str(tmp_path / "nope.jsonl")]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["check", str(tmp_path / "job.yaml")]) == 2
    assert f"evaluation.paths: data file not found: {tmp_path / 'nope.jsonl'}" in capsys.readouterr().err


def test_check_names_an_empty_file_beside_good_ones_and_alone(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "good.jsonl").write_text(json.dumps({"prompt": "Hi there", "response": "Hello to you."}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["check", str(_spec(tmp_path, tiny_model_dir, [tmp_path / "good.jsonl", tmp_path / "empty.jsonl"]))]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'empty.jsonl'}: 0 rows (an empty file" in err and "good.jsonl: 1 rows" in err
    assert main(["check", str(_spec(tmp_path, tiny_model_dir, [tmp_path / "empty.jsonl"]))]) == 2
    assert "empty.jsonl empty)" in capsys.readouterr().err
