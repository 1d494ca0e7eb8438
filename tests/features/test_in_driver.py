"""A small CPU job is featurised in the driver (``sketch.in_process_rows``): no Ray started, no actor pool, the
same shard files a pool would write, one progress bar; and a plan-only run of that size starts no Ray at all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ray_cluster_ft.config import ConfigError, SketchConfig, parse_config
from ray_cluster_ft.features import read_sketches
from ray_cluster_ft.features.sketchers import make_sketcher
from ray_cluster_ft.features.stage import sketch_with_store
from ray_cluster_ft.model import make_tiny_model

from ._helpers import example_table as _table

CFG = SketchConfig(method="sketch", k_in=4, k_out=4, dim=32, batch_size=3, last_blocks=1, seed=7, num_actors=1)


class _NoRay(Exception):
    """Raised by the patched ``ray.init``: the code under test tried to start Ray."""


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    assert not ray.is_initialized()

    def refuse(*_a, **_k):
        raise _NoRay("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_rows_up_to_the_threshold_are_sketched_here_without_ray(tiny_dir, tmp_path, no_ray, capsys):
    t = _table(10)
    sk, summary = sketch_with_store(t, str(tiny_dir), CFG.model_copy(update={"in_process_rows": 10}),
                                    str(tmp_path / "s"))
    # num_actors 1, 8 x 3 = 24 rows a full shard: the 10 rows are one shard, as a one-actor pool would cut them.
    assert (summary["computed"], summary["rows_computed"], summary["features_computed"]) == (1, 10, 10)
    assert [f.name[:11] for f in (tmp_path / "s").glob("shard-*.parquet")] == ["shard-00000"]
    assert sk["example_id"].tolist() == [f"ex{i:02d}" for i in range(10)]
    # Each row's sketch is the one it gets alone (a sketch does not depend on its batch mates).
    alone = make_sketcher("sketch", str(tiny_dir), CFG.model_dump(), False, 0, "cpu")
    for i in (0, 4, 9):
        row = t.slice(i, 1)
        got = alone({c: row.column(c).to_numpy(zero_copy_only=False) for c in row.column_names})["sketch"][0]
        np.testing.assert_allclose(sk["sketch"][i], got, atol=2e-5)
    err = capsys.readouterr().err
    assert "sketch (in this process)" in err and "10/10" in err
    assert read_sketches(str(tmp_path / "s"))["example_id"].tolist() == sk["example_id"].tolist()


def test_one_row_over_the_threshold_goes_to_the_actor_pool(tiny_dir, tmp_path, no_ray):
    with pytest.raises(_NoRay):
        sketch_with_store(_table(10), str(tiny_dir), CFG.model_copy(update={"in_process_rows": 9}),
                          str(tmp_path / "s"))
    with pytest.raises(_NoRay):  # 0: always the pool
        sketch_with_store(_table(3), str(tiny_dir), CFG.model_copy(update={"in_process_rows": 0}),
                          str(tmp_path / "s0"))


def _spec(tiny_model_dir, tmp_path, **sketch):
    rows = [{"prompt": f"Write the number {i} in words, please.", "response": f"It is {i} ({'x' * (i % 7)})."}
            for i in range(40)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_config({
        "data": {"paths": [str(path)], "eval_fraction": 0.0},
        "model": {"path": str(tiny_model_dir)},
        "sketch": {"method": "sketch", "batch_size": 4, "k_in": 4, "k_out": 4, "dim": 16, **sketch},
        "selection": {"budget": 0.5},
        "train": {"num_workers": 2, "micro_batch_size": 2, "epochs": 1},
        "output": {"dir": str(tmp_path / "run")}})


def test_a_small_plan_only_run_starts_no_ray(tiny_model_dir, tmp_path, no_ray):
    from ray_cluster_ft.pipeline import run_pipeline

    manifest = run_pipeline(_spec(tiny_model_dir, tmp_path), plan_only=True)
    assert (manifest["counts"]["candidates"], manifest["counts"]["selected"]) == (40, 20)
    assert manifest["counts"]["features_computed"] == 40
    # Above the threshold the same run starts (here: tries to start) a local Ray for the actor pool.
    with pytest.raises(ConfigError, match="could not start a local Ray: ray.init was called"):
        run_pipeline(_spec(tiny_model_dir, tmp_path / "b", in_process_rows=39), plan_only=True)
