"""A file mixing good and bad rows through a real (plan-only) run: the manifest accounts for every row, a resume
over changed data is refused, and a failed fresh run leaves no older artifact behind."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import ConfigError, parse_config
from ray_cluster_ft.data import canonicalize, example_id
from tests.cli.test_bad_input import BAD_LINES, _mixed_file


@pytest.mark.slow
def test_mixed_file_run_manifest_accounts_for_every_row(tmp_path, tiny_model_dir):
    """The same file through a real run (up to the plan, random baselines so no sketching): the manifest adds up."""
    from ray_cluster_ft.pipeline import run_pipeline

    f, lines, good, _ = _mixed_file(tmp_path)
    out = tmp_path / "run"
    cfg = parse_config({
        "data": {"source": "files", "paths": [str(f)], "max_seq_len": 128, "eval_fraction": 0.2},
        "model": {"path": str(tiny_model_dir)},
        "selection": {"strategy": "random", "budget": 0.5},
        "allocation": {"strategy": "random"},
        "train": {"num_workers": 2, "micro_batch_size": 2},
        "output": {"dir": str(out)},
    })
    m = run_pipeline(cfg, plan_only=True)
    c = m["counts"]
    assert c["read"] == len(lines) and c["rejected"] == len(BAD_LINES)
    assert c["read"] == c["accepted"] + c["rejected"]
    assert c["accepted"] == c["selected"] + c["not_selected"]
    b = c["not_selected_breakdown"]
    assert c["not_selected"] == b["held_out"] + b["below_budget"] + b["dropped_for_even_plan"]
    assert json.loads((out / "manifest.json").read_text())["counts"] == c
    assert sum(1 for _ in open(out / "rejected.jsonl", encoding="utf-8")) == c["rejected"]
    ids = set(pq.read_table(out / "examples.parquet").column("example_id").to_pylist())
    ids |= set(pq.read_table(out / "eval_examples.parquet").column("example_id").to_pylist())
    assert {example_id(canonicalize(g)) for g in good} == ids
    # The tally has one key per category, not per offending value (the two bad roles share one).
    from collections import Counter

    from ray_cluster_ft.data.read import reason_category

    assert c["rejected_by_reason"] == dict(Counter(reason_category(b[2]) for b in BAD_LINES))
    assert c["rejected_by_reason"]["messages[i].role not system/user/assistant/tool"] == 2

    # A refused resume (the data changed) leaves the run directory as it was.
    before = {n: (out / n).read_bytes() for n in ("examples.parquet", "rejected.jsonl", "manifest.json")}
    f.write_bytes(f.read_bytes() + json.dumps({"prompt": "a new row", "response": "r"}).encode() + b"\n")
    with pytest.raises(ConfigError, match="--resume: examples.parquet computed now .* differs from the one in the "
                                          "run directory"):
        run_pipeline(cfg, plan_only=True, resume=True)
    assert {n: (out / n).read_bytes() for n in before} == before
    # A fresh run that fails after reading the data leaves no older manifest, plan or report behind.
    with pytest.raises(ConfigError, match="selection.budget=10000 is above"):
        run_pipeline(cfg.model_copy(update={"selection": cfg.selection.model_copy(update={"budget": 10000})}),
                     plan_only=True)
    assert not any((out / n).exists() for n in ("manifest.json", "plan.parquet", "report.md", "selection.parquet"))
