"""On a two-node local Ray whose head has no CPUs, the streamed clustering's shard tasks and the streamed
selection's tasks (the groups pass and the k-center waves) all run on the second node (the tasks report the node
they ran on)."""

from __future__ import annotations

import numpy as np
import pytest

from ray_cluster_ft.cluster.stream import cluster_streamed
from ray_cluster_ft.config import parse_config
from ray_cluster_ft.select.stream import select_streamed
from tests.cluster.test_stream import blobs, write_shards


@pytest.fixture
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    worker = c.add_node(num_cpus=2)
    ray.init(address=c.address)
    try:
        yield worker.node_id
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.slow
def test_the_streamed_passes_run_on_the_second_node(two_nodes, tmp_path):
    shards = write_shards(tmp_path, blobs(12_000, seed=7), rows=1_500)
    res, _, nodes = cluster_streamed(shards, 12, 2, seed=1, fit_rows=3_000, minibatch_rows=5_000)
    assert nodes == {two_nodes: 8 * 3}  # 8 shards x (check, assign, distance), none on the head
    # k-center reads features, so its clusters go to Ray tasks in waves (100 kB: several); groups auto adds a pass
    cfg = parse_config({"train": {"num_workers": 2}, "selection": {"within": "kcenter", "groups": "auto"}})
    _, sel_nodes = select_streamed(cfg, shards, res.labels, res.dist, wave_bytes=100_000)
    assert set(sel_nodes) == {two_nodes} and sum(sel_nodes.values()) >= 2 * 2 + 3  # groups: 2 a CPU; waves: >= 3
    assert np.bincount(res.labels).min() >= 2
