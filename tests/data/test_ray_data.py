"""The data stage on Ray Data (``data.ray_data_rows``): the same rows accepted and rejected, with the same reasons,
positions and per-file tallies, as the single-process path, on a few thousand rows of mixed shapes."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import ConfigError, DataConfig, parse_config
from ray_cluster_ft.data.examples import load_examples
from ray_cluster_ft.data.ray_data import load_examples_ray, uses_ray_data


def _lines(n: int, seed: int) -> list[str]:
    """JSON Lines of every shape the reader meets: formats, unused fields, duplicates, bad JSON, blank lines,
    rows that are not objects, reserved domains, over-long rows."""
    out = []
    for i in range(n):
        k = (i * 7 + seed) % 13
        if k == 0:
            out.append(json.dumps({"instruction": f"Add {i % 50} and 1.", "input": "", "output": str(i % 50 + 1)}))
        elif k == 1:
            out.append(json.dumps({"conversations": [{"from": "human", "value": f"Hi {i}"},
                                                     {"from": "gpt", "value": "Hello."}]}))
        elif k == 2:
            out.append('{"prompt": "broken')  # malformed JSON
        elif k == 3:
            out.append("")  # blank: not a row
        elif k == 4:
            out.append(json.dumps({"prompt": f"Summarize {i}.", "response": "Short.",
                                   "input": f"The paragraph number {i} to sum up here."}))  # unused field
        elif k == 5:
            out.append(json.dumps([1, 2]))  # not an object
        elif k == 6:
            out.append(json.dumps({"prompt": "What is 2+2?", "response": "4"}))  # a duplicate after the first
        elif k == 7:
            out.append(json.dumps({"prompt": "x " * 300, "response": "too long"}))  # over max_seq_len
        elif k == 8:
            out.append(json.dumps({"prompt": f"Question {i}", "response": f"Answer {i}", "domain": "all"}))
        elif k == 9:
            out.append(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": f"Name {i}"},
                                                {"role": "assistant", "content": f"Name {i}."}], "domain": "chat"}))
        else:
            out.append(json.dumps({"question": f"Why {i}?", "context": f"Because of {i}.", "answer": f"{i}."}))
    return out


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    (d / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(_lines(1500, 0)).encode() + b"\n")
    (d / "b.jsonl").write_text("\n".join(_lines(1200, 3)))  # no final line end
    with gzip.open(d / "c.jsonl.gz", "wt") as fh:
        fh.write("\n".join(_lines(300, 5)) + "\n")
    rows = [json.loads(x) for x in _lines(400, 1) if x.startswith("{") and "broken" not in x and '"input"' not in x]
    pq.write_table(pa.Table.from_pylist([{"prompt": r.get("prompt", "p"), "response": r.get("response", "r")}
                                         for r in rows]), d / "d.parquet")
    (d / "e.csv").write_text("prompt,response\nWhat is 2+2?,4\nCSV row,fine\n")
    return d


def _same(a, b):
    assert a.train.equals(b.train) and a.eval.equals(b.eval)
    assert [(r.source, r.position, r.reason, r.row) for r in a.rejected] == \
           [(r.source, r.position, r.reason, r.row) for r in b.rejected]
    assert (a.n_read, a.truncated) == (b.n_read, b.truncated)
    for name in ("sources", "formats", "unused", "hints"):  # dict order too: the console and manifest print it
        x, y = getattr(a, name), getattr(b, name)
        assert x == y and list(x) == list(y), name
        assert all(list(x[k]) == list(y[k]) for k in x if isinstance(x[k], dict)), name


@pytest.mark.slow
def test_ray_data_path_accepts_and_rejects_exactly_the_same_rows(ray_cpu, pool, demo_tokenizer):
    cfg = DataConfig(paths=[str(pool / "*.jsonl"), str(pool / "c.jsonl.gz"), str(pool / "d.parquet"),
                            str(pool / "e.csv")], max_seq_len=256, eval_fraction=0.05, max_eval=50)
    one = load_examples(cfg, demo_tokenizer)
    many = load_examples_ray(cfg, demo_tokenizer, chunk_bytes=4096, actors=2)  # ~60 read tasks
    _same(one, many)
    reasons = {r.reason.split(":")[0] for r in one.rejected}
    assert {"malformed JSON", "not a JSON object", "duplicate example", "over max length", "reserved domain"} <= reasons
    assert one.n_read > 3000 and one.train.num_rows > 1000 and one.eval.num_rows == 50
    dup = next(r for r in many.rejected if r.reason.startswith("duplicate") and r.source.endswith("b.jsonl"))
    assert dup.reason == f"duplicate example: same content as {pool / 'a.jsonl'}:13"  # i = 12: the first 2+2 row
    assert many.unused[str(pool / "a.jsonl")] == {"input": 115}
    # data.limit reads whole files (a file's first rows), in the same way
    limited = cfg.model_copy(update={"limit": 40})
    _same(load_examples(limited, demo_tokenizer), load_examples_ray(limited, demo_tokenizer, chunk_bytes=4096))


@pytest.mark.slow
def test_ray_data_path_raises_the_single_process_errors(ray_cpu, tmp_path, demo_tokenizer):
    (tmp_path / "ok.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a", "response": "c"}\n' * 50)[:-20])
    cfg = DataConfig(paths=[str(tmp_path / "ok.jsonl"), str(tmp_path / "cut.jsonl.gz")])
    with pytest.raises(ConfigError) as single:
        load_examples(cfg, demo_tokenizer)
    with pytest.raises(ConfigError) as on_ray:  # raised inside a Ray task, unwrapped
        load_examples_ray(cfg, demo_tokenizer)
    assert str(on_ray.value) == str(single.value) and "cut.jsonl.gz" in str(single.value)
    cfg = DataConfig(paths=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_examples_ray(cfg, demo_tokenizer)


@pytest.mark.slow
def test_ray_data_path_checks_data_columns_per_file(ray_cpu, tmp_path, demo_tokenizer):
    """A ``data.columns`` source field is looked for in every piece of a file: one that only the last piece has is
    found, one that no piece has is refused with the single-process message."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"A{i}."}) + "\n" for i in range(40))
                  + json.dumps({"question": "Q?", "context": "Only here.", "answer": "A."}) + "\n")
    cfg = DataConfig(paths=[str(qa)], eval_fraction=0.0,
                     columns={"prompt": ["question", "context"], "response": "answer"})
    _same(load_examples(cfg, demo_tokenizer), load_examples_ray(cfg, demo_tokenizer, chunk_bytes=256))
    bad = cfg.model_copy(update={"columns": {"prompt": ["question", "contxt"], "response": "answer"}})
    with pytest.raises(ConfigError) as single:
        load_examples(bad, demo_tokenizer)
    with pytest.raises(ConfigError) as on_ray:
        load_examples_ray(bad, demo_tokenizer, chunk_bytes=256)
    assert str(on_ray.value) == str(single.value) == (
        f"data file {qa}: data.columns maps prompt from 'contxt', but none of the 41 rows read has that field (their "
        "fields: question, answer, context); see docs/data.md for data.columns")


@pytest.mark.slow
def test_the_stage_switches_to_ray_data_at_data_ray_data_rows(ray_cpu, pool, tmp_path, tiny_model_dir, capsys):
    from ray_cluster_ft.data.stage import run
    from ray_cluster_ft.rundir import prepare_run_dir

    n = sum(1 for line in _lines(1500, 0) if line)  # rows: the non-blank lines
    spec = {"data": {"paths": [str(pool / "a.jsonl")], "max_seq_len": 256, "ray_data_rows": n},
            "model": {"path": str(tiny_model_dir)}, "output": {"dir": str(tmp_path / "run")}}
    cfg = parse_config(spec)
    assert uses_ray_data(cfg.data)
    assert not uses_ray_data(cfg.data.model_copy(update={"ray_data_rows": n + 1}))
    assert not uses_ray_data(cfg.data.model_copy(update={"ray_data_rows": None}))
    prepare_run_dir(tmp_path / "run", resume=False)
    out = run(cfg, tmp_path / "run")
    assert f"[ray-cluster-ft] data: reading and tokenizing on Ray Data (data.ray_data_rows={n})" in \
           capsys.readouterr().out
    _same(load_examples(cfg.data, out.tokenizer), out.result)
    assert pq.read_table(tmp_path / "run" / "examples.parquet").equals(out.result.train)
