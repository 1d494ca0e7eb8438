"""A streamed job (features left in their shards: clustering in Ray Data tasks, the within-cluster choice in Ray
tasks a few clusters at a time, the plan made over positions and written in parts) writes the same
``clusters.parquet``, ``selection.parquet`` and ``plan.parquet`` as the in-memory stages, at 1.2 x 10^4 rows."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ray_cluster_ft import allocate, cluster, select
from ray_cluster_ft.allocate.stream import run_streamed as allocate_streamed
from ray_cluster_ft.cluster import stage as cluster_stage
from ray_cluster_ft.cluster import stream as cluster_stream
from ray_cluster_ft.cluster.stream import run_streamed as cluster_streamed
from ray_cluster_ft.config import parse_config
from ray_cluster_ft.features import read_shard
from ray_cluster_ft.rundir import prepare_run_dir
from ray_cluster_ft.select.stream import select_streamed
from tests.cluster.test_stream import blobs, write_shards


def _in_memory(cfg, run_dir, shards, ids, nt):
    x = np.concatenate([read_shard(f)["sketch"] for f in shards.files])
    cl = cluster.run(cfg, run_dir, example_ids=ids, sketches=x, n_tokens=nt)
    sel = select.run(cfg, run_dir, n_candidates=len(ids), sketches=x, labels=cl.labels, dist=cl.dist, n_tokens=nt)
    allocate.run(cfg, run_dir, example_ids=ids, labels=cl.labels, n_tokens=nt,
                 selected=np.asarray(sel.result.indices), reasons=sel.result.reasons)
    return sel


def _streamed(cfg, run_dir, shards, ids, nt):
    cl = cluster_streamed(cfg, run_dir, shards=shards, example_ids=pa.array(ids))
    assert cl.summary["nodes"], "the clustering gathered the rows instead of streaming them"
    sel, nodes = select_streamed(cfg, shards, cl.labels, cl.dist, n_tokens=nt, wave_bytes=200_000)
    # several waves of clusters, each a task; the distance orders and random read no feature, so no task; the
    # groups take one pass of tasks (2 per CPU) of their own
    waves = 3 if cfg.selection.within in ("kcenter", "strata") else 0
    grouped = cfg.selection.groups is not None and cfg.selection.strategy == "balanced"
    groups = 2 * 2 if grouped else 0  # the ray_cpu fixture's 2 CPUs
    assert sum(nodes.values()) >= waves + groups and (nodes == {}) == (waves + groups == 0)
    allocate_streamed(cfg, run_dir, example_ids=pa.array(ids), labels=cl.labels, n_tokens=nt,
                      selected=np.asarray(sel.result.indices), reasons=sel.result.reasons)
    return sel


@pytest.mark.parametrize("spec", [
    {"selection": {"within": "kcenter", "groups": None}},
    {"selection": {"within": "strata", "budget_tokens": 0.2}, "allocation": {"packing": False}},
    {},  # the defaults: hidden_mean's rows (any features here), groups auto, within random
    {"selection": {"strategy": "equalize", "within": "peripheral", "ratio": 0.5},
     "allocation": {"strategy": "cluster"}},
    {"selection": {"within": "random", "groups": "auto"}},
    {"selection": {"within": "kcenter", "groups": 3, "budget_tokens": 0.25}},
])
@pytest.mark.slow
def test_selection_and_plan_of_12k_rows_equal_between_streamed_and_in_memory(ray_cpu, tmp_path, spec, monkeypatch):
    # Both paths fit k-means on a 3,000-row sample (FIT_ROWS, 2 x 10^5, in a real job), so the streamed assignment,
    # sums and distances run in Ray tasks over the shards as at 10^7; at 10^4 rows or fewer the in-memory fit
    # restarts and the streamed stage gathers every row instead.
    small_fit = {"fit_rows": 3_000, "minibatch_rows": 5_000}
    for module, name in ((cluster_stream, "cluster_streamed"), (cluster_stage, "cluster_sketches")):
        monkeypatch.setattr(module, name, functools.partial(getattr(module, name), **small_fit))
    n = 12_000
    rng = np.random.default_rng(4)
    nt = np.clip(np.round(rng.lognormal(np.log(120), 0.6, n)), 8, 1024).astype(np.int64)
    (tmp_path / "shards").mkdir()
    shards = write_shards(tmp_path / "shards", blobs(n, d=32, centres=20, seed=3), rows=1_500, n_tokens=nt)
    ids = np.asarray([f"ex{j:06d}" for j in range(n)])
    base = {"train": {"num_workers": 4, "micro_batch_size": 2, "epochs": 2}, "sketch": {"stream_rows": 100}, **spec}
    cfg = parse_config(base)
    prepare_run_dir(tmp_path / "mem", False)
    prepare_run_dir(tmp_path / "str", False)
    a = _in_memory(cfg, tmp_path / "mem", shards, ids, nt)
    b = _streamed(cfg, tmp_path / "str", shards, ids, nt)
    np.testing.assert_array_equal(a.result.indices, b.result.indices)
    np.testing.assert_array_equal(a.result.reasons, b.result.reasons)
    np.testing.assert_array_equal(a.result.quotas, b.result.quotas)
    if cfg.selection.groups is not None and cfg.selection.strategy == "balanced":  # from the shards, as in memory
        np.testing.assert_array_equal(a.result.groups, b.result.groups)
        assert np.unique(b.result.groups).size >= 2
    assert (a.requested, a.tokens_requested) == (b.requested, b.tokens_requested)
    for name in ("clusters.parquet", "selection.parquet", "plan.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "mem" / name), pd.read_parquet(tmp_path / "str" / name),
                                      check_dtype=False)
    assert len(pd.read_parquet(tmp_path / "str" / "plan.parquet")) > 0
