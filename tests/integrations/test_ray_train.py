"""The plan in a user's own Ray Train TorchTrainer: the README example trains, each worker's shard exactly its
planned rows, in order."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ray_cluster_ft.integrations.ray_train import plan_data_config, plan_datasets

from ._helpers import make_run, planned_rows, readme_example


def test_plan_datasets_and_config_without_workers(tmp_path):
    made = make_run(tmp_path / "run")
    with pytest.raises(ValueError, match="the plan is for 2 ranks but this job runs 3 processes"):
        plan_datasets(made["plan"], made["examples"], 3)
    with pytest.raises(ValueError, match="not in examples"):
        plan_datasets(made["plan"], made["examples"].slice(1), 2)
    cfg = plan_data_config(datasets_to_split=["eval"])
    opts = vars(cfg)  # Ray keeps them private: read them without relying on one attribute name
    assert cfg._datasets_to_split == ["eval"]
    assert any(getattr(v, "preserve_order", False) for v in opts.values())
    assert plan_data_config()._datasets_to_split == []


def test_plan_datasets_start_a_new_local_ray_or_join_the_address_given(tmp_path, monkeypatch):
    """As the command line: never a plain ray.init() (which joins whatever cluster ray start last recorded)."""
    import ray

    from ray_cluster_ft.config import ConfigError

    made = make_run(tmp_path / "run")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls = []

    def fake_init(**kw):
        calls.append(kw["address"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(ConfigError, match="could not start a local Ray: stop here"):
        plan_datasets(made["plan"], made["examples"], 2)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ConfigError, match="could not join Ray at 'auto': stop here"):
        plan_datasets(made["plan"], made["examples"], 2)
    assert calls == ["local", "auto"]
    with pytest.raises(ConfigError, match="cannot reach a Ray cluster at '127.0.0.1:1'"):
        plan_datasets(made["plan"], made["examples"], 2, address="127.0.0.1:1")
    assert calls == ["local", "auto"]  # refused before ray.init


# Inserted into the README example's loop: what each worker's batch held, written for the test to read.
_RECORD = """
def _record(batch, out={out!r}):
    import json as _json
    import ray.train as _rt

    row = {{"ids": [str(x) for x in batch["example_id"]],
           "key": [sorted(set(batch[c].tolist())) for c in ("epoch", "step", "micro_index")],
           "d": sorted(set(batch["step_weighted_tokens"].tolist()))}}
    with open(f"{{out}}/rank{{_rt.get_context().get_world_rank()}}.jsonl", "a") as fh:
        fh.write(_json.dumps(row) + "\\n")

"""


@pytest.mark.slow
def test_readme_ray_train_example_trains_each_workers_planned_rows(ray_cpu, tmp_path, tiny_model_dir, monkeypatch):
    """The README's Ray Train block, run as written (its paths line pointed at the run and the tiny model, a run
    folder under tmp_path, and one line in its loop that records each batch): each worker's shard is exactly its
    planned rows in order, and every batch of B rows is one planned micro-batch with one step denominator."""
    made = make_run(tmp_path / "run")
    plan = made["plan"]
    out = tmp_path / "ids"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    code = readme_example("ray-train", tmp_path / "run", tiny_model_dir)
    for old, new in [
        ("scaling_config=ray.train.ScalingConfig(num_workers=shape.world_size),",
         "scaling_config=ray.train.ScalingConfig(num_workers=shape.world_size),\n    run_config=ray.train.RunConfig("
         + f"name='readme', storage_path={str(tmp_path / 'ray')!r}),"),
        ("        mb = micro_batch_to_device(", "        _record(batch)\n        mb = micro_batch_to_device("),
        ("\n\ndef train_loop(cfg):", "\n" + _RECORD.format(out=str(out)) + "\ndef train_loop(cfg):"),
    ]:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    ns: dict = {"__name__": "readme_ray_train"}
    exec(compile(code, "README:ray-train", "exec"), ns)
    assert isinstance(ns["plan"], pd.DataFrame) and ns["shape"].steps == 8
    for r in (0, 1):
        got = [json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines()]
        want = planned_rows(plan, r)
        assert [i for b in got for i in b["ids"]] == want["example_id"].tolist()
        keys = want[["epoch", "step", "micro_index"]].to_numpy()[::2].tolist()
        assert [[k[0] for k in b["key"]] for b in got] == keys
        assert all(len(b["key"][0]) == len(b["key"][1]) == len(b["key"][2]) == len(b["d"]) == 1 for b in got)
        assert len(got) == 16
