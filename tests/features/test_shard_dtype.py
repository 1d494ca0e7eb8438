"""Feature shards above ``sketch.stream_rows``: float16 on disk with the dtype in the Arrow type, read back shard by
shard as float32; at or below it, float32 shards named as before (small runs unchanged)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_cluster_ft.config import SketchConfig
from ray_cluster_ft.features import feature_shards, read_shard, read_sketches, stream_features
from ray_cluster_ft.features._shards import _to_arrow
from ray_cluster_ft.features.stage import compute_sketches
from ray_cluster_ft.features.store import resolve_shard_dtype, sketch_fingerprint
from ray_cluster_ft.model import make_tiny_model

from ._helpers import example_table as _table

CFG = SketchConfig(method="sketch", k_in=4, k_out=4, dim=32, batch_size=3, last_blocks=1, seed=7, num_actors=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_the_shard_dtype_follows_the_stream_threshold():
    cfg = SketchConfig(stream_rows=100)
    assert not stream_features(cfg, 100) and stream_features(cfg, 101)
    assert (resolve_shard_dtype(cfg, 100), resolve_shard_dtype(cfg, 101)) == ("float32", "float16")
    assert resolve_shard_dtype(cfg.model_copy(update={"store": "/tmp/s"}), 101) == "float32"  # a store stays exact
    assert resolve_shard_dtype(cfg.model_copy(update={"shard_dtype": "float16"}), 5) == "float16"
    assert not stream_features(SketchConfig(stream_rows=None), 10**9)


def test_float32_shards_keep_their_names_and_float16_ones_get_others(tiny_dir):
    auto = sketch_fingerprint(CFG, str(tiny_dir), False)
    assert sketch_fingerprint(CFG.model_copy(update={"shard_dtype": "float32"}), str(tiny_dir), False) == auto
    assert sketch_fingerprint(CFG.model_copy(update={"shard_dtype": "float16"}), str(tiny_dir), False) != auto


def test_a_float16_shard_records_its_dtype_and_reads_back_as_float32(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    batch = {"example_id": np.asarray([f"e{i}" for i in range(5)]), "sketch": x,
             "loss": np.zeros(5, np.float32), "n_tokens": np.arange(1, 6)}
    pq.write_table(_to_arrow(batch, "float16"), tmp_path / "a.parquet")
    pq.write_table(_to_arrow(batch), tmp_path / "b.parquet")
    assert pq.read_schema(tmp_path / "a.parquet").field("sketch").type == pa.list_(pa.float16(), 6)
    fs = feature_shards([str(tmp_path / "a.parquet")])
    assert (fs.dim, fs.dtype, fs.n_rows, fs.offsets.tolist()) == (6, "float16", 5, [0, 5])
    got = read_shard(fs.files[0], with_ids=True)
    assert got["sketch"].dtype == np.float32
    np.testing.assert_array_equal(got["sketch"], x.astype(np.float16).astype(np.float32))
    assert got["example_id"].to_pylist() == batch["example_id"].tolist()
    assert got["n_tokens"].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(read_sketches(str(tmp_path / "a.parquet"))["sketch"], got["sketch"])
    with pytest.raises(ValueError, match="differ in feature size or float type"):
        feature_shards([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])


def test_a_job_above_the_threshold_writes_float16_shards_of_the_same_features(tiny_dir, tmp_path):
    t = _table(10)
    small = compute_sketches(t, str(tiny_dir), CFG, str(tmp_path / "f32"), shard_rows=4, in_process_rows=100)
    big = compute_sketches(t, str(tiny_dir), CFG.model_copy(update={"stream_rows": 5}), str(tmp_path / "f16"),
                           shard_rows=4, in_process_rows=100)
    assert small["shards"] == big["shards"] == 3
    files = sorted(str(p) for p in (tmp_path / "f16").glob("shard-*.parquet"))
    fs = feature_shards(files)
    assert (fs.dtype, fs.n_rows, fs.offsets.tolist()) == ("float16", 10, [0, 4, 8, 10])
    assert feature_shards(sorted(str(p) for p in (tmp_path / "f32").glob("shard-*.parquet"))).dtype == "float32"
    exact = read_sketches(str(tmp_path / "f32"))["sketch"]
    half = np.concatenate([read_shard(f)["sketch"] for f in fs.files])  # shard order = input order
    np.testing.assert_allclose(half, exact, rtol=2e-3, atol=1e-4)
    np.testing.assert_array_equal(half, exact.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("scale", [1e5, 1e-8], ids=["overflow", "underflow"])
def test_rows_float16_cannot_hold_are_refused_with_the_setting_that_keeps_them(scale):
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    x[2] *= scale  # one row out of float16's range (max 65,504; smallest subnormal 6e-8)
    batch = {"example_id": np.asarray(["a", "b", "c", "d"]), "sketch": x, "loss": np.zeros(4, np.float32),
             "n_tokens": np.ones(4, np.int64)}
    with pytest.raises(ValueError, match=r"1 feature rows do not fit float16 \(row 'c'.*sketch.shard_dtype: float32"):
        _to_arrow(batch, "float16")
    assert _to_arrow(batch, "float32").num_rows == 4  # float32 keeps them
    x[2] = 0.0  # an all-zero row fits (the clustering refuses it later, by name), and so does a NaN row (the same)
    assert _to_arrow(batch, "float16").num_rows == 4
    x[2] = np.nan
    assert _to_arrow(batch, "float16").num_rows == 4
