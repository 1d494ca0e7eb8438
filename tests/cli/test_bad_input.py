"""Bad input and hostile conditions (issue 8): every bad row is rejected with its source position and a
clear reason, every impossible config fails before Ray with a message naming the values involved.

Each case here is one row of the "Bad input" table in the README.
"""

from __future__ import annotations

import gzip
import json
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import ConfigError, DataConfig, JobConfig, check_against_data, load_config, parse_config
from ray_cluster_ft.data import canonicalize, example_id, load_examples
from ray_cluster_ft.data.read import Rejection, iter_file_rows
from ray_cluster_ft.model import resolve_model_path

GOOD = {"prompt": "What is the capital of France?", "response": "Paris."}


def _write_jsonl(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return path


def _load(paths, tok, tokenize_chunk=2048, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return load_examples(DataConfig(source="files", paths=[str(p) for p in paths], **kw), tok,
                         tokenize_chunk=tokenize_chunk)


def _chat(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


# One bad JSONL line after one good line: (id, raw line or row, the start of the rejection reason).
BAD_LINES = [
    ("malformed-json", b"{not json", "malformed JSON: Expecting property name enclosed in double quotes"),
    ("truncated-json", b'{"prompt": "q", "response": "r"', "malformed JSON: Expecting ',' delimiter"),
    ("invalid-utf8", b'{"prompt": "caf\xe9", "response": "x"}',
     "bad encoding: not valid UTF-8 (invalid continuation byte at byte 15)"),
    ("lone-surrogate", b'{"prompt": "a\\ud800b", "response": "x"}', "invalid Unicode in 'prompt': lone surrogate"),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, "malformed JSON: nested too deeply"),
    ("huge-integer", b'{"prompt": ' + b"9" * 5000 + b"}", "malformed JSON: Exceeds the limit (4300 digits)"),
    ("json-string", b'"just a string"', "not a JSON object: string"),
    ("json-array", b'[{"prompt": "q", "response": "r"}]', "not a JSON object: array"),
    ("json-null", b"null", "not a JSON object: null"),
    ("json-number", b"42", "not a JSON object: number"),
    ("no-known-field", {"text": "hello"}, "missing field: need 'messages', 'conversations' (sharegpt), 'instruction'+'output' (alpaca), "
     "'prompt'+'completion', 'prompt'+'response' or 'question'+'answer'; map other fields with data.columns"),
    ("missing-response", {"prompt": "q"}, "missing field 'response'"),
    ("missing-prompt", {"response": "r"}, "missing field 'prompt'"),
    ("missing-answer", {"question": "q"}, "missing field 'answer'"),
    ("null-response", {"prompt": "q", "response": None}, "field 'response' is null"),
    ("int-prompt", {"prompt": 3, "response": "r"}, "field 'prompt' is int, expected a string"),
    ("list-response", {"prompt": "q", "response": ["r"]}, "field 'response' is list, expected a string"),
    ("empty-prompt", {"prompt": "   ", "response": "r"}, "empty prompt"),
    ("empty-response", {"prompt": "q", "response": ""}, "empty response"),
    ("empty-answer", {"question": "q", "answer": "\n"}, "empty answer"),
    ("messages-not-list", {"messages": "hi"}, "field 'messages' must be a non-empty list"),
    ("messages-empty", {"messages": []}, "field 'messages' must be a non-empty list"),
    ("message-not-object", {"messages": ["hi", "there"]}, "messages[0] is str, expected an object"),
    ("bad-role", _chat(("robot", "p"), ("assistant", "r")),
     "messages[0].role is 'robot', expected system/user/assistant/tool"),
    ("missing-role", {"messages": [{"content": "p"}, {"role": "assistant", "content": "r"}]},
     "messages[0].role is None, expected system/user/assistant/tool"),
    ("content-not-string", {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "r"}]},
     "messages[0].content is int, expected a string or a list of text parts"),
    ("content-image-part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                                      {"type": "image_url", "image_url": {"url": "x"}}]},
                                         {"role": "assistant", "content": "A cat."}]},
     "messages[0].content[1] is a 'image_url' part; only text parts are trained"),
    ("content-no-parts", {"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "r"}]},
     "empty prompt: no user message before the response"),
    ("content-part-not-text", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]},
                                            {"role": "assistant", "content": "r"}]},
     "messages[0].content[0].text is int, expected a string"),
    ("last-not-assistant", _chat(("user", "p")), "the last message is not the assistant's response"),
    ("empty-assistant", _chat(("user", "p"), ("assistant", " ")), "empty response"),
    ("no-user-turn", _chat(("system", "be brief"), ("assistant", "r")),
     "empty prompt: no user message before the response"),
    ("over-max-length-drop", {"prompt": "word " * 400, "response": "r"}, "over max length: "),
    ("zero-width-space-response", {"prompt": "q6", "response": "\u200b \u200b"}, "empty response"),
    ("bom-response", {"prompt": "q7", "response": "\ufeff"}, "empty response"),
    ("bom-answer", {"question": "q8", "answer": "\ufeff\u2060\n"}, "empty answer"),
    ("zero-width-prompt", {"prompt": "\u200d", "response": "r9"}, "empty prompt"),
    ("end-of-turn-only-response", {"prompt": "q10", "response": "<|im_end|>"},
     "empty response: only whitespace, format characters or special tokens"),
    ("special-tokens-only-chat", _chat(("user", "p11"), ("assistant", "<|im_start|> <|endoftext|>\u200b")),
     "empty response: only whitespace, format characters or special tokens"),
    ("added-special-token-response", {"prompt": "q12", "response": "<repo_name><file_sep> <empty_output>"},
     "empty response: only whitespace, format characters or special tokens"),
    ("nul-response", {"prompt": "q13", "response": "\x00\x00 "}, "empty response"),
    ("combining-marks-response", {"prompt": "q14", "response": "\ufe0f\u034f"}, "empty response"),
    ("hangul-filler-response", {"prompt": "q15", "response": "\u115f\u1160\u3164"}, "empty response"),
    ("special-token-prompt", {"prompt": "<|im_end|>", "response": "r16"},
     "empty prompt: only whitespace, format characters or special tokens"),
    ("zero-width-reserved-domain", {"prompt": "q17", "response": "r17", "domain": "\u200ball"}, "reserved domain: "),
    ("duplicate", GOOD, "duplicate example: same content as "),
    ("reserved-domain", {"prompt": "q3", "response": "r3", "domain": "all"}, "reserved domain: 'all' names the"),
    ("spaced-reserved-domain", {"prompt": "q4", "response": "r4", "domain": " all "}, "reserved domain: "),
    ("int-domain", {"prompt": "q5", "response": "r5", "domain": 7}, "field 'domain' is int, expected a string"),
]


@pytest.mark.parametrize("line, reason", [(b[1], b[2]) for b in BAD_LINES], ids=[b[0] for b in BAD_LINES])
def test_bad_jsonl_line_is_rejected_with_position(tmp_path, demo_tokenizer, line, reason):
    f = _write_jsonl(tmp_path / "rows.jsonl", [GOOD, b"", line])
    res = _load([f], demo_tokenizer, max_seq_len=128)
    assert (res.n_read, res.train.num_rows, len(res.rejected)) == (2, 1, 1)
    rej = res.rejected[0]
    assert (rej.source, rej.position) == (str(f), 3)  # 1-based line number; the blank line 2 is not a row
    assert rej.reason.startswith(reason), rej.reason
    out = json.loads(rej.to_json().encode("utf-8"))  # rejected.jsonl is always writable as UTF-8
    assert out["position"] == 3 and out["reason"] == rej.reason


def test_duplicate_names_the_first_occurrence_across_files(tmp_path, demo_tokenizer):
    a = _write_jsonl(tmp_path / "a.jsonl", [GOOD])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"question": GOOD["prompt"], "answer": GOOD["response"]}])
    res = _load([a, b], demo_tokenizer)
    assert res.train.num_rows == 1 and res.n_read == 2
    assert res.rejected[0].reason == f"duplicate example: same content as {a}:1"
    assert res.rejected[0].source == str(b)


def test_overlong_truncate_keeps_drop_rejects(tmp_path, demo_tokenizer):
    long_resp = {"prompt": "Count.", "response": "one two three " * 100}
    long_prompt = {"prompt": "word " * 400, "response": "r"}
    f = _write_jsonl(tmp_path / "long.jsonl", [long_resp, long_prompt])
    dropped = _load([f], demo_tokenizer, max_seq_len=64, overlong="drop")
    assert dropped.train.num_rows == 0 and [r.position for r in dropped.rejected] == [1, 2]
    assert all(r.reason.startswith("over max length: ") and r.reason.endswith("> data.max_seq_len=64")
               for r in dropped.rejected)
    cut = _load([f], demo_tokenizer, max_seq_len=64, overlong="truncate")
    assert cut.train.num_rows == 1 and cut.truncated == 1 and cut.train.column("n_tokens").to_pylist() == [64]
    # truncation cannot help a prompt that alone fills the budget: there would be no response token to learn
    [rej] = cut.rejected
    assert rej.position == 2 and "the prompt alone is" in rej.reason and ">= data.max_seq_len=64" in rej.reason


def test_bom_and_crlf_are_accepted(tmp_path, demo_tokenizer):
    f = tmp_path / "excel.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n" + json.dumps(
        {"prompt": "q2", "response": "r2"}).encode() + b"\r\n")
    res = _load([f], demo_tokenizer)
    assert (res.n_read, res.train.num_rows, res.rejected) == (2, 2, [])


def test_empty_file_gives_no_rows_and_a_clear_config_error(tmp_path, demo_tokenizer):
    f = tmp_path / "empty.jsonl"
    f.write_bytes(b"")
    blank = _write_jsonl(tmp_path / "blank.jsonl", [b"", b"  ", b"\t"])
    res = _load([f, blank], demo_tokenizer)
    assert (res.n_read, res.train.num_rows, res.eval.num_rows, res.rejected) == (0, 0, 0, [])
    with pytest.raises(ConfigError, match="no accepted training examples"):
        check_against_data(JobConfig(), res.train.num_rows)


def test_parquet_wrong_types_and_nulls(tmp_path, demo_tokenizer):
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "prompt": pa.array(["a?", None, "c?", "d?", None], pa.string()),
        "response": pa.array([1, 2, None, 4, None], pa.int64()),  # wrong type for every row
        "question": pa.array([None, None, None, None, "e?"], pa.string()),
        "answer": pa.array([None, None, None, None, "E"], pa.string()),
    }), p)
    res = _load([p], demo_tokenizer)
    got = [(r.position, r.reason) for r in res.rejected]
    assert got == [(0, "field 'response' is int, expected a string"), (1, "field 'prompt' is null"),
                   (2, "field 'response' is null"), (3, "field 'response' is int, expected a string")]
    assert res.n_read == 5 and res.train.num_rows == 1  # row 4 uses question/answer; its null prompt is absent


def test_parquet_chat_messages_column(tmp_path, demo_tokenizer):
    p = tmp_path / "chat.parquet"
    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}],
            None]
    pq.write_table(pa.table({"messages": msgs}), p)
    res = _load([p], demo_tokenizer)
    assert res.train.num_rows == 1
    assert [(r.position, r.reason) for r in res.rejected] == [
        (1, "messages[1].role is 'bot', expected system/user/assistant/tool"),
        (2, "missing field: need 'messages', 'conversations' (sharegpt), 'instruction'+'output' (alpaca), "
     "'prompt'+'completion', 'prompt'+'response' or 'question'+'answer'; map other fields with data.columns "
     "(the row's fields: messages (null); see docs/data.md)")]


def test_unreadable_files_raise_naming_the_file(tmp_path, demo_tokenizer):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    with pytest.raises(ValueError, match=f"cannot read Parquet file {garbage}"):
        _load([garbage], demo_tokenizer)
    gz = tmp_path / "broken.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps(GOOD).encode() * 50)[:40])  # truncated stream
    with pytest.raises(ValueError, match=f"cannot read data file {gz}"):
        list(iter_file_rows(gz))
    other = tmp_path / "rows.xlsx"
    other.write_text("prompt,response\nq,r\n")
    with pytest.raises(ValueError, match="unsupported data file type: .*rows.xlsx"):
        _load([other], demo_tokenizer)
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.jsonl"):
        _load([tmp_path / "nope.jsonl"], demo_tokenizer)


def test_file_level_problems_name_the_file(tmp_path, demo_tokenizer):
    a_dir = tmp_path / "adir"
    a_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="data.paths: the folder .*adir holds no data file"):
        _load([a_dir], demo_tokenizer)
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes((json.dumps(GOOD) + "\n").encode("utf-16"))  # with its byte-order mark
    with pytest.raises(ValueError, match="utf16.jsonl is UTF-16 or UTF-32 encoded .*save it as UTF-8"):
        _load([utf16], demo_tokenizer)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "q", "response": "r"},')
    with pytest.raises(ValueError, match="broken.json starts a JSON array but is not valid JSON"):
        _load([broken], demo_tokenizer)
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)  # reading it would block forever
    with pytest.raises(FileNotFoundError, match="data path .*rows.jsonl is not a regular file"):
        _load([fifo], demo_tokenizer)


def test_json_array_file_rows_and_positions(tmp_path, demo_tokenizer):
    # The Alpaca-style layout: one JSON array (pretty-printed), positions are 0-based element indices.
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps([GOOD, 7, {"question": "2 + 2?", "answer": "4"}, {"prompt": "q"}], indent=2))
    res = _load([f], demo_tokenizer)
    assert res.n_read == 4 and res.train.num_rows == 2
    assert [(r.position, r.reason) for r in res.rejected] == [(1, "not a JSON object: number"),
                                                             (3, "missing field 'response'")]
    lines = tmp_path / "lines.json"  # a .json file of JSON Lines still reads line by line
    _write_jsonl(lines, [GOOD, {"prompt": "x", "response": "y"}])
    assert _load([lines], demo_tokenizer).train.num_rows == 2


def test_rejected_rows_are_in_input_order(tmp_path, demo_tokenizer):
    # Duplicates are found when their tokenizer chunk finishes, after the parse errors of later lines.
    rows = [GOOD, {"prompt": "a", "response": "b"}, GOOD, b"{bad", {"prompt": "a", "response": "b"}, b"[1]", GOOD]
    f = _write_jsonl(tmp_path / "d.jsonl", rows)
    g = _write_jsonl(tmp_path / "e.jsonl", [b"{bad", GOOD])
    res = _load([f, g], demo_tokenizer, tokenize_chunk=2)
    assert [(Path(r.source).name, r.position) for r in res.rejected] == [
        ("d.jsonl", 3), ("d.jsonl", 4), ("d.jsonl", 5), ("d.jsonl", 6), ("d.jsonl", 7), ("e.jsonl", 1),
        ("e.jsonl", 2)]


def test_rejection_to_json_survives_hostile_rows():
    nasty = {"prompt": "a\ud800", "nested": [[[[]]]], "bytes": b"\xff", "nan": float("nan")}
    line = Rejection("f.jsonl", 3, "invalid Unicode", nasty).to_json()
    line.encode("utf-8")
    assert json.loads(line)["row"]["prompt"] == "a\ud800"
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    out = json.loads(Rejection("f.jsonl", 1, "x", deep).to_json())
    assert out["position"] == 1 and out["row"].startswith("[[[")


def _mixed_file(tmp_path):
    """One file with 31 good rows (three formats) interleaved with every kind of bad line above."""
    good = []
    for i in range(30):
        kind = i % 3
        if kind == 0:
            good.append({"prompt": f"What is {i} + {i}?", "response": str(2 * i), "domain": "math"})
        elif kind == 1:
            good.append({"question": f"Name the {i}th letter.", "answer": f"letter {i}", "domain": "lang"})
        else:
            chat = _chat(("system", "be brief"), ("user", f"Echo {i}"), ("assistant", f"{i}"))
            good.append({**chat, "domain": "chat"})
    good.insert(0, GOOD)  # the first copy of the row that the "duplicate" line repeats
    lines: list = []
    bad_positions = []
    for i in range(max(len(good), len(BAD_LINES))):
        if i < len(good):
            lines.append(good[i])
        if i < len(BAD_LINES):
            lines.append(BAD_LINES[i][1])
            bad_positions.append(len(lines))
    return _write_jsonl(tmp_path / "mixed.jsonl", lines), lines, good, bad_positions


def test_mixed_file_counts_add_up_and_every_good_row_is_kept(tmp_path, demo_tokenizer):
    f, lines, good, bad_positions = _mixed_file(tmp_path)
    res = _load([f], demo_tokenizer, max_seq_len=128, eval_fraction=0.2)
    n_rej = len(res.rejected)
    assert res.n_read == len(lines) == len(good) + len(BAD_LINES)
    assert res.n_read == res.train.num_rows + res.eval.num_rows + n_rej
    assert n_rej == len(BAD_LINES) and res.eval.num_rows > 0
    assert sorted(r.position for r in res.rejected) == bad_positions
    kept = set(res.train.column("example_id").to_pylist()) | set(res.eval.column("example_id").to_pylist())
    assert {example_id(canonicalize(g)) for g in good} == kept
    domains = res.train.column("domain").to_pylist() + res.eval.column("domain").to_pylist()
    assert set(domains) == {"math", "lang", "chat", "default"}  # GOOD names no domain


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"selection": {"budget": 0}}, "selection.budget: Input should be greater than 0 (got 0)"),
        ({"selection": {"budget": -5}}, "selection.budget: Input should be greater than 0 (got -5)"),
        ({"train": {"micro_batch_size": 0}},
         "train.micro_batch_size: Input should be greater than or equal to 1 (got 0)"),
        ({"train": {"num_workers": 0}}, "train.num_workers: Input should be greater than or equal to 1 (got 0)"),
        ({"clustering": {"k": -1}}, "clustering.k: clustering.k must be >= 1 or 'auto' (got -1)"),
        ({"data": {"max_seq_length": 10}}, "unknown key 'data.max_seq_length'; did you mean 'data.max_seq_len'?"),
        ({"model": {"trust_remote": True}},
         "unknown key 'model.trust_remote'; did you mean 'model.trust_remote_code'?"),
        ({"selection": {"strategey": "random"}},
         "unknown key 'selection.strategey'; did you mean 'selection.strategy'?"),
        ({"allocaton": {}}, "unknown key 'allocaton'; did you mean 'allocation'?"),
        ({"zzz": 1}, "unknown key 'zzz' (valid here: preset, data, model, sketch"),
        ({"train": 5}, "train: Input should be a valid dictionary or instance of TrainConfig (got 5)"),
        ({1: 2}, "1: Keys should be strings (got 1)"),
    ],
)
def test_config_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "raw, n_train, message",
    [
        ({"selection": {"budget": 150}}, 100, "selection.budget=150 is above the 100 accepted training examples"),
        ({"clustering": {"k": 40}}, 30, "clustering.k=40 is above the 30 accepted training examples"),
        ({"train": {"num_workers": 8, "micro_batch_size": 2}, "allocation": {"packing": False}}, 40,
         "train.num_workers=8 x train.micro_batch_size=2 x train.grad_accum=1 = 16 examples per optimizer step, "
         "but the selection holds only 12: some ranks would get no micro-batch"),
        ({"selection": {"strategy": "full"}, "train": {"num_workers": 4, "grad_accum": 2},
          "allocation": {"packing": False}}, 20, "= 32 examples per optimizer step, but the selection holds only 20"),
        ({"train": {"num_workers": 8}}, 20,  # packed by default: one pack per rank per step
         "train.num_workers=8 x train.grad_accum=1 = 8 packs per optimizer step, but the selection holds only 6"),
        ({}, 0, "no accepted training examples: every row was rejected or held out (see rejected.jsonl)"),
    ],
)
def test_impossible_combinations_name_both_values(raw, n_train, message):
    cfg = parse_config(raw)
    with pytest.raises(ConfigError) as err:
        check_against_data(cfg, n_train)
    assert message in str(err.value)
    check_against_data(cfg, 1000)  # the same config is fine with enough data


def test_load_config_hostile_yaml(tmp_path):
    laughs = tmp_path / "laughs.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    lines += ["data:", "  paths: *a8"]
    laughs.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(laughs)
    assert "unknown key 'a0'" in str(err.value) and len(str(err.value)) < 20_000
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, got str"):
        load_config(scalar)
    flat = tmp_path / "flat.yaml"
    flat.write_text("output: 5\n")
    with pytest.raises(ConfigError, match="cannot set 'output.dir': 'output' in .* is a int, not a mapping"):
        load_config(flat, {"output.dir": "x"})
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"train:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(binary)


# --------------------------------------------------------------------------- model path


def test_missing_model_path_fails_clearly(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"model.path '.*/no-such-model' is not a folder"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"model.path 'not/a/real/model' is not a folder"):
        resolve_model_path("not/a/real/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is a folder without config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file, not a model folder"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="model.path is empty"):
        resolve_model_path("  ")
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a valid Hugging Face hub id"):
        resolve_model_path("my model!")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache while the hub is offline"):
        resolve_model_path("nobody-xyz/no-such-model-0000")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model_path("nobody-xyz/no-such-model-0000") == "nobody-xyz/no-such-model-0000"  # no network


def test_cli_reports_config_errors_before_ray(tmp_path, capsys):
    """`ray-cluster-ft run` prints one error line and exits 2; no Ray session is started."""
    import ray

    from ray_cluster_ft.cli import main

    bad_rows = _write_jsonl(tmp_path / "bad.jsonl", [b"{oops", {"prompt": "q"}])
    spec = tmp_path / "job.yaml"
    spec.write_text(f"data:\n  source: files\n  paths: [{bad_rows}]\noutput:\n  dir: {tmp_path / 'run'}\n")
    assert main(["run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("ray-cluster-ft: error: no accepted training examples: every row was rejected or "
                           "held out (see rejected.jsonl)")
    rejected = [json.loads(x) for x in (tmp_path / "run" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["position"], r["reason"].split(":")[0]) for r in rejected] == [(1, "malformed JSON"),
                                                                              (2, "missing field 'response'")]
    spec.write_text(f"model:\n  path: {tmp_path / 'nope'}\noutput:\n  dir: {tmp_path / 'run2'}\n")
    assert main(["run", str(spec)]) == 2
    assert f"ray-cluster-ft: error: model.path '{tmp_path / 'nope'}' is not a folder" in capsys.readouterr().err
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    spec.write_text(f"data:\n  source: files\n  paths: [{garbage}]\noutput:\n  dir: {tmp_path / 'run3'}\n")
    assert main(["run", str(spec)]) == 2
    assert f"ray-cluster-ft: error: cannot read Parquet file {garbage}: " in capsys.readouterr().err
    spec.write_text("trian: {}\n")
    assert main(["run", str(spec)]) == 2
    assert "unknown key 'trian'; did you mean 'train'?" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    spec.write_text(f"data:\n  paths: [{empty}]\noutput:\n  dir: {tmp_path / 'run4'}\n")
    assert main(["run", str(spec)]) == 2
    assert "no accepted training examples: the data files hold no rows" in capsys.readouterr().err
    assert main(["check", str(tmp_path)]) == 2
    assert f"job config {tmp_path} is a directory, not a YAML file" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_cli_ctrl_c_prints_one_line(tmp_path, capsys, monkeypatch):
    from ray_cluster_ft import pipeline
    from ray_cluster_ft.cli import main

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_pipeline", interrupted)
    assert main(["run", str(tmp_path / "x.yaml")]) == 2  # a missing spec is still a config error
    capsys.readouterr()
    spec = tmp_path / "job.yaml"
    spec.write_text(f"output:\n  dir: {tmp_path / 'run'}\n")
    assert main(["run", str(spec)]) == 130
    assert capsys.readouterr().err == ("ray-cluster-ft: interrupted (SIGINT); continue the run with "
                                       f"`ray-cluster-ft run --resume {tmp_path / 'run'}`\n")

    def terminated(*_, **__):
        from ray_cluster_ft.cli import Interrupted

        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(pipeline, "run_pipeline", terminated)
    assert main(["run", str(spec)]) == 143
    assert capsys.readouterr().err.startswith("ray-cluster-ft: interrupted (SIGTERM); continue the run with")


# --------------------------------------------------------------------------- run directory and model modules


def test_module_patterns_are_checked_before_ray(tiny_model_dir):
    from ray_cluster_ft.model import check_module_patterns as _check_module_patterns

    ok = parse_config({"model": {"path": str(tiny_model_dir)}, "train": {"lora": {"enabled": True}}})
    _check_module_patterns(ok, str(tiny_model_dir), need_sketch=True)
    typo = parse_config({"train": {"lora": {"enabled": True, "target_modules": ["q_proj", "q_projj"]}}})
    with pytest.raises(ConfigError, match=r"train.lora.target_modules: 'q_projj' match no nn.Linear of .*"
                                          r"\(module name suffixes there: .*q_proj"):
        _check_module_patterns(typo, str(tiny_model_dir), need_sketch=False)
    sketch = parse_config({"sketch": {"method": "sketch", "modules": ["gate_proj", "mlp.up_proj", "attn_out"]}})
    with pytest.raises(ConfigError, match="sketch.modules: 'attn_out' match no nn.Linear"):
        _check_module_patterns(sketch, str(tiny_model_dir), need_sketch=True)
    _check_module_patterns(sketch, str(tiny_model_dir), need_sketch=False)  # no sketch: not checked
    embed = parse_config({"sketch": {"method": "embedding", "modules": ["nothing"]}})
    _check_module_patterns(embed, str(tiny_model_dir), need_sketch=True)


def test_model_folders_without_usable_weights_or_tokenizer_are_refused(tmp_path, tiny_model_dir):
    import shutil

    from ray_cluster_ft.model import check_model_files
    from ray_cluster_ft.model import check_module_patterns as _check_module_patterns
    from ray_cluster_ft.pipeline import run_pipeline

    check_model_files(str(tiny_model_dir))
    check_model_files("HuggingFaceTB/SmolLM2-135M")  # a hub id: checked when loaded
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.path '.*bare' has no weights: none of model.safetensors"):
        check_model_files(str(bare))
    cut = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, cut)
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[:100])
    with pytest.raises(FileNotFoundError, match="cannot read the weights file model.safetensors"):
        check_model_files(str(cut), "sketch.model")
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lists 2 missing shard"):
        check_model_files(str(sharded))
    # Through the pipeline, before Ray: the trained model, a separate sketch model, a folder without a tokenizer.
    cfg = parse_config({"model": {"path": str(bare)}, "output": {"dir": str(tmp_path / "r1")}})
    with pytest.raises(FileNotFoundError, match="model.path .* has no weights"):
        run_pipeline(cfg)
    sk = parse_config({"model": {"path": str(tiny_model_dir)}, "sketch": {"model": str(cut)}})
    with pytest.raises(FileNotFoundError, match="sketch.model .*cannot read the weights file"):
        _check_module_patterns(sk, str(tiny_model_dir), need_sketch=True)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shutil.copy(tiny_model_dir / "model.safetensors", no_tok / "model.safetensors")
    cfg = parse_config({"model": {"path": str(no_tok)}, "output": {"dir": str(tmp_path / "r2")}})
    with pytest.raises(ConfigError, match="model.path .*no_tok': cannot load its tokenizer"):
        run_pipeline(cfg)


def test_clustering_warning_when_fewer_clusters_than_ranks():
    from ray_cluster_ft.cluster.stage import clustering_warning as _clustering_warning

    assert _clustering_warning(4, 0, 4, 2) is None
    msg = _clustering_warning(1, 35, 2, 2)
    assert msg.startswith("1 cluster after merging 35 clusters smaller than clustering.min_cluster_size=2, "
                          "fewer than the 2 ranks")
    assert _clustering_warning(3, 0, 8, 2).startswith("3 clusters, fewer than the 8 ranks")


def test_reason_categories_fold_values_and_indices():
    from ray_cluster_ft.data.read import reason_category

    cases = {
        "messages[3].role is 'ro|bot', expected system/user/assistant/tool": "messages[i].role not system/user/assistant/tool",
        "messages[12].content is int, expected a string or a list of text parts": "messages[i].content not a string",
        "messages[1].content[2] is a 'image_url' part; only text parts are trained": "messages[i].content[j] not a text part",
        "messages[0] is str, expected an object": "messages[i] not an object",
        "field 'prompt' is int, expected a string": "field 'prompt' not a string",
        "field 'prompt' is dict, expected a string": "field 'prompt' not a string",
        "field 'response' is null": "field 'response' is null",
        "invalid Unicode in messages[2].content: lone surrogate '\\ud800' at character 4": "invalid Unicode",
        "over max length: 434 tokens > data.max_seq_len=128": "over max length",
        "empty prompt": "empty prompt",
    }
    assert {r: reason_category(r) for r in cases} == cases


def test_deepspeed_values_are_checked_with_deepspeeds_own_model(tmp_path):
    from ray_cluster_ft.train import build_deepspeed_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}}))
    for train in ({"zero_stage": 3, "offload": "params"}, {"zero_stage": 2, "offload": "optimizer"}, {"zero_stage": 0}):
        build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(ds), **train}}).train)
    ds.write_text(json.dumps({"zero_optimization": {"stage": "three"}}))
    with pytest.raises(ConfigError, match="ds.json: zero_optimization is not valid for DeepSpeed: stage Input should"):
        build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(ds)}}).train)
    ds.write_text(json.dumps({"zero_optimization": {"offload_optimizer": "cpu"}}))
    with pytest.raises(ConfigError, match="offload_optimizer Input should be a valid dictionary"):
        build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(ds)}}).train)


def test_report_says_why_there_is_no_evaluation_after_training(tmp_path):
    import numpy as np

    from ray_cluster_ft.allocate import make_plan
    from ray_cluster_ft.pipeline.report import write_report

    plan = make_plan(np.array([f"e{i}" for i in range(8)]), np.arange(8) % 2, np.full(8, 10), 2, 2).plan
    manifest = {"counts": {k: 8 for k in ("read", "accepted", "selected", "trained")} | {
                    "rejected": 0, "held_out": 2, "not_selected": 0},
                "timings_s": {"total": 1.0}, "train": {"steps": 2},
                "config": {"output": {"save_model": False}},
                "eval": {"before": {"all": {"examples": 2, "loss": 1.0, "perplexity": 2.7}}, "after": {}}}
    report = write_report(tmp_path, manifest, plan, None, np.arange(8)).read_text()
    assert "| all | 2 | 1 |  | 2.7 |  |" in report  # not measured: blank, not nan
    assert "No evaluation after training: `output.save_model` is false, so no final model was written." in report
    manifest["eval_files"] = {"/x/held.jsonl": {"read": 3, "scored": 2, "rejected": 1, "overlap_with_candidates": 0,
                                                "before": {}, "after": {}}}  # a --plan-only run scores nothing
    report = write_report(tmp_path, manifest, plan, None, np.arange(8)).read_text()
    assert "| held.jsonl | 2 | 1 | 0 |  |  |  |  |  |  |" in report and "nan" not in report
    assert "Not scored: this run evaluated nothing (`--plan-only`)." in report


def test_report_tables_escape_values_from_the_data():
    from ray_cluster_ft.pipeline.report import _table

    out = _table(["domain", "examples"], [["co|de", 3], ["med\nical", 4]])
    assert out.splitlines()[2:] == ["| co\\|de | 3 |", "| med ical | 4 |"]


def test_report_tables_format_token_counts():
    from ray_cluster_ft.pipeline.report import _table

    out = _table(["metric", "plan"], [["critical_path_tokens", 13848.0], ["padding_fraction", 0.0321], ["k", 5]])
    assert "| critical_path_tokens | 13,848 |" in out and "| padding_fraction | 0.0321 |" in out
