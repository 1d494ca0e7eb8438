"""The plan in a user's own Ray Train TorchTrainer: each worker's shard is exactly its planned rows, in order;
and the README example trains."""

from __future__ import annotations

import json
from pathlib import Path

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


def _report_ids(config):
    import ray.train

    from ray_cluster_ft.integrations.ray_train import rank_shard

    rank = ray.train.get_context().get_world_rank()
    batches = []
    for batch in rank_shard().iter_batches(batch_size=config["B"], batch_format="numpy"):
        batches.append({"ids": [str(x) for x in batch["example_id"]],
                        "key": [sorted(set(batch[c].tolist())) for c in ("epoch", "step", "micro_index")],
                        "d": sorted(set(batch["step_weighted_tokens"].tolist()))})
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(batches))


@pytest.mark.slow
def test_two_worker_torch_trainer_sees_exactly_its_planned_rows(ray_cpu, tmp_path):
    import ray.train
    from ray.train.torch import TorchTrainer

    made = make_run(tmp_path / "run")
    plan = made["plan"]
    out = tmp_path / "ids"
    out.mkdir()
    trainer = TorchTrainer(
        _report_ids,
        train_loop_config={"B": 2, "out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="ids", storage_path=str(tmp_path / "ray")),
        datasets=plan_datasets(plan, made["examples"], 2, made["weights"]),
        dataset_config=plan_data_config(),
    )
    trainer.fit()
    for r in (0, 1):
        got = json.loads((out / f"rank{r}.json").read_text())
        want = planned_rows(plan, r)
        assert [i for b in got for i in b["ids"]] == want["example_id"].tolist()
        # every batch of B rows is one planned micro-batch, with one step denominator
        keys = want[["epoch", "step", "micro_index"]].to_numpy()[::2].tolist()
        assert [[k[0] for k in b["key"]] for b in got] == keys
        assert all(len(b["key"][0]) == len(b["key"][1]) == len(b["key"][2]) == len(b["d"]) == 1 for b in got)
        assert len(got) == 16


@pytest.mark.slow
def test_readme_ray_train_example_trains(ray_cpu, tmp_path, tiny_model_dir, monkeypatch):
    make_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    code = readme_example("ray-train", tmp_path / "run", tiny_model_dir)
    code = code.replace("scaling_config=ray.train.ScalingConfig(num_workers=shape.world_size),",
                        "scaling_config=ray.train.ScalingConfig(num_workers=shape.world_size),\n"
                        f"    run_config=ray.train.RunConfig(name='readme', storage_path={str(tmp_path / 'ray')!r}),")
    assert "run_config=" in code
    ns: dict = {"__name__": "readme_ray_train"}
    exec(compile(code, "README:ray-train", "exec"), ns)
    assert isinstance(ns["plan"], pd.DataFrame) and ns["shape"].steps == 8
