"""The library API (ray_cluster_ft.compute_features, ray_cluster_ft.select_and_plan) against a real plan-only run
of the pinned 120-row files spec at a world size of 4 on this machine's 2 CPUs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

import ray_cluster_ft as rcf
from ray_cluster_ft.config import ConfigError, load_config
from ray_cluster_ft.data import canonicalize, example_id
from ray_cluster_ft.features import read_sketches
from ray_cluster_ft.features.stage import finish_features

from tests._pins import FIXTURE, files_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_only_run(tmp_path_factory, tiny_model_dir):
    """``run --plan-only`` at train.num_workers 4 x cpus_per_worker 64: no machine here holds 256 CPUs, so the run
    succeeds only because a plan-only run never checks the training resources."""
    from ray_cluster_ft.cli import main

    tmp = tmp_path_factory.mktemp("api")
    spec = files_spec(tiny_model_dir)
    spec["train"].update(num_workers=4, cpus_per_worker=64)
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp / "run"
    assert main(["run", str(path), "--output", str(out), "--plan-only"]) == 0
    cfg = load_config(out / "config.yaml")
    examples = pq.read_table(out / "examples.parquet")
    ids = np.asarray(examples.column("example_id").to_pylist(), dtype=object)
    feats, _ = finish_features(read_sketches(str(out / "sketches")), ids, cfg.sketch.method, 4)
    return out, cfg, examples, feats


def test_a_plan_only_run_plans_more_ranks_than_the_machine_has(plan_only_run):
    out, cfg, _, _ = plan_only_run
    assert cfg.train.num_workers * cfg.train.cpus_per_worker == 256
    assert sorted(pd.read_parquet(out / "plan.parquet")["rank"].unique()) == [0, 1, 2, 3]
    assert json.loads((out / "manifest.json").read_text())["train"] is None


def test_select_and_plan_equals_the_plan_only_run(plan_only_run):
    out, cfg, examples, feats = plan_only_run
    x = feats.copy()
    n_tokens = examples.column("n_tokens").to_numpy()
    ids = examples.column("example_id").to_pylist()
    got = rcf.select_and_plan(x, n_tokens, cfg, example_ids=ids)
    for name, frame in (("clusters", got.clusters), ("selection", got.selection), ("plan", got.plan)):
        written = pd.read_parquet(out / f"{name}.parquet")
        if name == "selection":  # the run's file adds where each row was read; the library sees no files
            assert list(written.columns[-2:]) == ["source_file", "source_line"]
            written = written.drop(columns=["source_file", "source_line"])
        pd.testing.assert_frame_equal(frame, written, obj=name)
    manifest = json.loads((out / "manifest.json").read_text())
    assert got.metrics == pytest.approx(manifest["plan_metrics"][cfg.allocation.strategy])
    np.testing.assert_array_equal(x, feats)  # the inputs are left as they were
    again = rcf.select_and_plan(rcf.Features(np.asarray(ids, dtype=object), x, n_tokens.astype(np.int64)), None, cfg)
    pd.testing.assert_frame_equal(again.plan, got.plan)


def test_compute_features_in_process_matches_the_runs_sketches(plan_only_run, tiny_model_dir):
    import ray

    out, cfg, examples, feats = plan_only_run
    assert not ray.is_initialized()
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    by_id = {example_id(canonicalize(r)): r for r in rows}
    ids = examples.column("example_id").to_pylist()
    got = rcf.compute_features([by_id[i] for i in ids], str(tiny_model_dir), cfg)
    assert got.example_id.tolist() == ids
    assert got.features.dtype == np.float32 and got.features.shape == feats.shape
    np.testing.assert_array_equal(got.n_tokens, examples.column("n_tokens").to_numpy())
    # The tokens handed back are the data stage's (examples.parquet), ready for the trainer integrations.
    cols = ["example_id", "input_ids", "labels", "n_tokens"]
    assert got.examples.column_names == cols and got.examples.equals(examples.select(cols))
    from ray_cluster_ft.integrations.torch import plan_loss_weights

    plan = pd.read_parquet(out / "plan.parquet")
    weights = pd.read_parquet(out / "selection.parquet").set_index("example_id")["weight"]
    labels = dict(zip(ids, examples.column("labels").to_pylist()))
    for mw in plan_loss_weights(plan, got.examples, 1, weights, packed=True):  # |T_i|: label tokens after the first position
        assert mw.label_tokens.tolist() == [sum(t != -100 for t in labels[i][1:]) for i in mw.example_ids]
    # Same sub-batches as the run's actors; only the thread count differs.
    np.testing.assert_allclose(got.features, feats, rtol=0, atol=2e-5)
    # An already tokenized table gives the same features.
    part = rcf.compute_features(examples.slice(0, 8), str(tiny_model_dir), cfg.sketch)
    np.testing.assert_allclose(part.features, feats[:8], rtol=0, atol=2e-5)


@pytest.mark.slow
def test_compute_features_on_ray_is_the_feature_stage(ray_cpu, plan_only_run, tiny_model_dir):
    out, cfg, examples, feats = plan_only_run
    got = rcf.compute_features(examples, str(tiny_model_dir), cfg)
    assert got.example_id.tolist() == examples.column("example_id").to_pylist()
    np.testing.assert_allclose(got.features, feats, rtol=0, atol=1e-6)


def test_last_layer_features_get_the_stages_normalisation(tiny_model_dir):
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[:6]]
    sk = rcf.SketchConfig(method="last_layer")
    with pytest.raises(ValueError, match="world size"):
        rcf.compute_features(rows, str(tiny_model_dir), sk)
    data = {"max_seq_len": 512, "overlong": "truncate"}
    one = rcf.compute_features(rows, str(tiny_model_dir), rcf.parse_config({"sketch": {"method": "last_layer"},
                                                                           "data": data, "train": {"num_workers": 1}}))
    np.testing.assert_allclose(one.features.mean(axis=0), 0, atol=1e-6)
    two = rcf.compute_features(rows, str(tiny_model_dir), rcf.parse_config({"sketch": {"method": "last_layer"},
                                                                           "data": data}))
    np.testing.assert_allclose(np.linalg.norm(two.features, axis=1), 1, rtol=1e-5)


def test_bad_inputs_are_named(tiny_model_dir):
    model = str(tiny_model_dir)
    ok = {"prompt": "What is 2 + 2?", "response": "4"}
    with pytest.raises(TypeError, match="JobConfig or a SketchConfig"):
        rcf.compute_features([ok], model, {"method": "sketch"})
    with pytest.raises(ValueError, match="row 1: missing field 'response'"):
        rcf.compute_features([ok, {"prompt": "hi"}], model, rcf.SketchConfig())
    with pytest.raises(ValueError, match="rows 0 and 2 are the same example"):
        rcf.compute_features([ok, {"prompt": "a", "response": "b"}, dict(ok)], model, rcf.SketchConfig())
    with pytest.raises(ValueError, match="row 0: over max length.*data.overlong: truncate"):
        rcf.compute_features([{"prompt": "word " * 50, "response": "x"}], model,
                             rcf.parse_config({"data": {"max_seq_len": 16}}))
    with pytest.raises(ValueError, match="warm up"):
        rcf.compute_features([ok], model, rcf.SketchConfig(method="hidden_mean", warmup_steps=2))
    cfg = rcf.parse_config({"train": {"num_workers": 2, "micro_batch_size": 4}, "allocation": {"packing": False}})
    with pytest.raises(ConfigError, match="examples per optimizer step"):
        rcf.select_and_plan(np.ones((10, 4), dtype=np.float32), np.full(10, 5), cfg)
    with pytest.raises(ValueError, match=r"features \(10, 4\) must be \(N, d\) with N = 12"):
        rcf.select_and_plan(np.ones((10, 4)), np.full(12, 5), cfg)
    with pytest.raises(TypeError, match="JobConfig"):
        rcf.select_and_plan(np.ones((10, 4)), np.full(10, 5), cfg.selection)


def test_select_and_plan_without_clusters_needs_no_features():
    cfg = rcf.parse_config({"selection": {"strategy": "random", "budget": 0.5},
                            "allocation": {"strategy": "length"}, "train": {"num_workers": 2, "micro_batch_size": 2}})
    plan = rcf.select_and_plan(None, np.arange(20) + 3, cfg)
    assert plan.clusters is None and len(plan.selection) == 8 and (plan.selection["weight"] == 1).all()
    assert set(plan.plan["example_id"]) == set(plan.selection["example_id"]) <= {str(i) for i in range(20)}


# The "Use it as a library" example of docs/library.md, verbatim (test_readme_example checks that it is).
README_EXAMPLE = '''\
import json

import ray_cluster_ft as rcf

rows = [json.loads(line) for line in open("tests/fixtures/mixed_120.jsonl")][:40]  # 40 MBPP rows
cfg = rcf.parse_config({"data": {"max_seq_len": 512, "overlong": "truncate"},
                        "selection": {"budget": 0.5},
                        "train": {"num_workers": 2, "micro_batch_size": 2, "epochs": 2}})

feats = rcf.compute_features(rows, "demo", cfg)  # MiniLM sentence embeddings; row i is rows[i]
print(feats.features.shape, feats.features.dtype)  # (40, 384) float32

plan = rcf.select_and_plan(feats, feats.n_tokens, cfg)
print(plan.selection.head())  # example_id, cluster, reason, weight: the rows to train
print(plan.plan.head())  # epoch, step, rank, micro_index, example_id, cluster, n_tokens
print(plan.metrics["collisions_per_step"], plan.metrics["padding_fraction"])
'''


def _library_section() -> str:
    """The library section of docs/library.md."""
    text = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    assert "## Use it as a library" in text, "no 'Use it as a library' section in docs/library.md"
    return text.split("## Use it as a library", 1)[1]


@pytest.mark.slow
def test_readme_example(monkeypatch, capsys):
    assert "```python\n" + README_EXAMPLE + "```" in _library_section()
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(README_EXAMPLE, "README example", "exec"), scope)
    feats, plan, cfg = scope["feats"], scope["plan"], scope["cfg"]
    assert feats.features.shape == (40, 384) and feats.features.dtype == np.float32  # MiniLM's hidden size
    assert "(40, 384) float32" in capsys.readouterr().out
    assert sorted(plan.plan["rank"].unique()) == [0, 1]
    assert set(plan.plan["example_id"]) == set(plan.selection["example_id"])
    assert plan.selection["weight"].mean() == pytest.approx(1.0)
    assert len(plan.selection) % (cfg.train.num_workers * cfg.train.micro_batch_size) == 0
