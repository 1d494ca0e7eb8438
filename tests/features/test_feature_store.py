"""The cross-run feature store (``sketch.store``): keyed by settings, model content and example inputs; a job
computes only the rows it lacks; atomic, concurrent writers lose nothing; another seed or one changed weight
byte reads nothing."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from ray_cluster_ft.config import SketchConfig
from ray_cluster_ft.features import read_sketches
from ray_cluster_ft.features.feature_store import (
    FeatureStore,
    model_fingerprint,
    row_input_hashes,
    store_key,
)
from ray_cluster_ft.features.stage import sketch_with_store
from ray_cluster_ft.model import make_tiny_model

from ._helpers import examples as _examples
from .test_features import _numpy_batch

CFG = SketchConfig(method="sketch", k_in=4, k_out=4, dim=32, batch_size=3, last_blocks=1, seed=7, num_actors=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _table(n, seed=3, bump=()):
    """n token rows with ids ex00.. (rows in ``bump`` get their first token changed, same id)."""
    rows, labels = _examples([5 + (7 * i) % 13 for i in range(n)], [1 + i % 3 for i in range(n)], seed=seed)
    for i in bump:
        rows[i][0] += 1
    return pa.Table.from_pylist([{"example_id": f"ex{i:02d}", "input_ids": r.tolist(), "labels": lab.tolist(),
                                  "n_tokens": len(r)} for i, (r, lab) in enumerate(zip(rows, labels))])


def _fake_rows(ids, dim=8):
    """Features that are a pure function of the id (so any writer's copy of a row is the same)."""
    sk = np.stack([np.random.default_rng(int(i[2:])).standard_normal(dim) for i in ids]).astype(np.float32)
    return {"example_id": np.asarray(ids), "sketch": sk, "loss": np.asarray([int(i[2:]) for i in ids], np.float32),
            "n_tokens": np.asarray([int(i[2:]) % 50 for i in ids], np.int32)}


# ------------------------------------------------------------------------------------- keys and hashes


def test_key_covers_settings_and_model_content_not_its_path(tiny_dir, tmp_path):
    key, desc = store_key(CFG, str(tiny_dir), use_gpu=False)
    assert desc["settings"] == {"method": "gradient", "modules": CFG.modules, "last_blocks": 1, "k_in": 4,
                                "k_out": 4, "dim": 32, "seed": 7, "dtype": "auto"}
    names = [n for n, _ in desc["model"]["files"]]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names) and names == sorted(names)
    (tiny_dir / ".hidden.json").write_text("{}")  # hidden files are not the model
    assert store_key(CFG, str(tiny_dir), use_gpu=False)[0] == key
    (tiny_dir / ".hidden.json").unlink()
    # Batch size and actor count do not change a feature; every value-changing setting does.
    assert store_key(CFG.model_copy(update={"batch_size": 5, "num_actors": 2, "store": "x"}), str(tiny_dir),
                     False)[0] == key
    for change in ({"seed": 8}, {"dim": 16}, {"k_in": 8}, {"last_blocks": 2}, {"dtype": "float32"},
                   {"modules": ["q_proj"]}, {"method": "last_layer"}):
        assert store_key(CFG.model_copy(update=change), str(tiny_dir), False)[0] != key, change
    assert store_key(CFG, str(tiny_dir), True)[0] != key
    # A copy elsewhere (new path, new mtimes) is the same model; one changed weight byte is another.
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert store_key(CFG, str(copy), False)[0] == key
    blob = bytearray((copy / "model.safetensors").read_bytes())
    blob[-1] ^= 0x01
    (copy / "model.safetensors").write_bytes(bytes(blob))
    assert store_key(CFG, str(copy), False)[0] != key
    assert model_fingerprint("someone/some-model") == {"hub_id": "someone/some-model", "revision": "unresolved"}
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_fingerprint(str(tmp_path))


def test_row_input_hashes_follow_the_inputs():
    t = _table(4)
    h = row_input_hashes(t, ["input_ids", "labels"])
    assert h.shape == (4,) and len(set(h)) == 4 and all(len(x) == 32 for x in h)
    assert list(row_input_hashes(_table(4, bump=[2]), ["input_ids", "labels"]) == h) == [True, True, False, True]
    # Labels count too (a changed loss mask changes the gradient); so does where a row's tokens split.
    lab = t.column("labels").to_pylist()
    lab[1][-1] = -100
    t2 = t.set_column(2, "labels", pa.array(lab, type=t.schema.field("labels").type))
    assert list(row_input_hashes(t2, ["input_ids", "labels"]) == h) == [True, False, True, True]
    a = row_input_hashes(pa.table({"text": ["ab", "c"]}), ["text"])
    assert a[0] != row_input_hashes(pa.table({"text": ["a", "bc"]}), ["text"])[0]


# ------------------------------------------------------------------------------------- store I/O


def _writer(uri, key, rounds, seed):
    """One job: ``rounds`` writes of random overlapping subsets of ex000..ex199."""
    rng = np.random.default_rng(seed)
    store = FeatureStore.open(uri, key, {"who": "test"})
    for _ in range(rounds):
        ids = sorted({f"ex{i:03d}" for i in rng.choice(200, size=int(rng.integers(5, 60)), replace=False)})
        store.write(_fake_rows(ids), np.asarray([f"h{i}" for i in ids]))


def test_two_concurrent_writers_lose_nothing_and_corrupt_nothing(tmp_path):
    uri = str(tmp_path / "store")
    ctx = mp.get_context("fork")  # two OS processes (numpy + pyarrow only in the children); fork skips re-imports
    procs = [ctx.Process(target=_writer, args=(uri, "k1", 40, s)) for s in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    wanted = set()
    for s in (0, 1):  # replay each writer's choices: the rows it wrote
        rng = np.random.default_rng(s)
        for _ in range(40):
            wanted |= {f"ex{i:03d}" for i in rng.choice(200, size=int(rng.integers(5, 60)), replace=False)}
    ids = np.asarray(sorted(wanted))
    store = FeatureStore.open(uri, "k1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every part must be readable
        got = store.read(ids, np.asarray([f"h{i}" for i in ids]))
    assert sorted(got["example_id"]) == list(ids)  # every row written by either job, each once
    ref = _fake_rows(got["example_id"])
    np.testing.assert_array_equal(got["sketch"], ref["sketch"])
    np.testing.assert_array_equal(got["loss"], ref["loss"])
    np.testing.assert_array_equal(got["n_tokens"], ref["n_tokens"])
    assert not list((tmp_path / "store").rglob("*.tmp"))


def test_store_reads_only_matching_hashes_and_skips_damaged_parts(tmp_path):
    store = FeatureStore.open(f"file://{tmp_path / 's'}", "k", {"a": 1})
    assert (tmp_path / "s" / "v1" / "k" / "_key.json").is_file()
    ids = [f"ex{i:03d}" for i in range(10)]
    written = store.write(_fake_rows(ids), np.asarray([f"h{i}" for i in ids]))
    assert len(written) == 1 and store.write(_fake_rows(ids), np.asarray([f"h{i}" for i in ids])) == []
    hashes = np.asarray([f"h{i}" if i != "ex003" else "other" for i in ids])
    got = store.read(np.asarray(ids + ["ex999"]), np.append(hashes, "h999"))
    assert sorted(got["example_id"]) == [i for i in ids if i != "ex003"]
    (tmp_path / "s" / "v1" / "k" / "part-0000.parquet").write_bytes(b"not parquet")
    with pytest.warns(UserWarning, match="skipped unreadable part"):
        again = store.read(np.asarray(ids), np.asarray([f"h{i}" for i in ids]))
    assert sorted(again["example_id"]) == ids
    with pytest.raises(ValueError, match="repeats"):
        store.write(_fake_rows(["ex001", "ex001"]), np.asarray(["a", "a"]))


def test_an_object_store_gets_one_put_per_part():
    from pyarrow import fs as pafs

    mock = pafs._MockFileSystem()  # an in-memory pyarrow filesystem that is not local: the upload path
    mock.create_dir("bucket/v1/k", recursive=True)
    store = FeatureStore("mock://bucket", "k", mock, "bucket/v1/k")
    ids = [f"ex{i:03d}" for i in range(5)]
    (path,) = store.write(_fake_rows(ids), np.asarray([f"h{i}" for i in ids]))
    assert store.parts() == [path] and path.startswith("bucket/v1/k/part-")
    assert [i.base_name for i in mock.get_file_info(pafs.FileSelector("bucket/v1/k"))] == [path.split("/")[-1]]
    got = store.read(np.asarray(ids), np.asarray([f"h{i}" for i in ids]))
    np.testing.assert_array_equal(got["sketch"], _fake_rows(got["example_id"])["sketch"])


# ------------------------------------------------------------------------------------- the job's view


def test_a_job_computes_only_the_rows_the_store_lacks(tiny_dir, tmp_path, ray_cpu):
    from ray_cluster_ft.features.sketchers import GradientSketcher

    store = str(tmp_path / "store")
    cfg = CFG.model_copy(update={"store": store})
    first_sk, first = sketch_with_store(_table(12).slice(0, 8), str(tiny_dir), cfg, str(tmp_path / "run1"))
    assert (first["features_computed"], first["features_reused"], first["store_parts_written"]) == (8, 0, 1)
    assert first_sk["sketch"].shape == (8, 32)
    # A later job over 12 rows (4 new; one old row's tokens changed under the same id): sketches 5.
    grown = _table(12, bump=[2])
    sk, second = sketch_with_store(grown, str(tiny_dir), cfg, str(tmp_path / "run2"))
    assert (second["features_computed"], second["features_reused"]) == (5, 7)
    assert read_sketches(str(tmp_path / "run2"))["example_id"].tolist() == ["ex02", "ex08", "ex09", "ex10", "ex11"]
    assert second["feature_key"] == first["feature_key"]
    # The same features as computed from scratch (the sketcher on all rows at once, in this process).
    rows = [np.asarray(r) for r in grown.column("input_ids").to_pylist()]
    fresh = GradientSketcher(str(tiny_dir), CFG.model_dump(), device="cpu")(_numpy_batch(
        rows, [np.asarray(r) for r in grown.column("labels").to_pylist()], grown.column("example_id").to_pylist()))
    assert sk["example_id"].tolist() == list(fresh["example_id"]) == [f"ex{i:02d}" for i in range(12)]
    np.testing.assert_allclose(sk["sketch"], fresh["sketch"], atol=1e-5)
    np.testing.assert_allclose(sk["loss"], fresh["loss"], rtol=1e-5)
    assert (sk["n_tokens"] == np.asarray(fresh["n_tokens"])).all()
    # Everything stored now: nothing computed, no actor started, and the run's stale shards are cleared.
    _, third = sketch_with_store(grown, str(tiny_dir), cfg, str(tmp_path / "run2"))
    assert (third["features_computed"], third["features_reused"], third["computed"]) == (0, 12, 0)
    assert not list((tmp_path / "run2").glob("*.parquet"))


def test_a_small_input_is_cut_so_every_actor_gets_a_shard(ray_cpu):
    from ray_cluster_ft.features.stage import _default_shard_rows

    two = SketchConfig(method="sketch", batch_size=3)  # 2 CPUs: two actors; a full shard is 8 sub-batches of 3 = 24 rows
    assert [_default_shard_rows(n, two, False, None) for n in (0, 5, 12, 47, 48, 1000)] == [24, 3, 6, 24, 24, 24]
    one = SketchConfig(method="sketch", batch_size=3, num_actors=1)
    assert [_default_shard_rows(n, one, False, None) for n in (12, 30)] == [12, 24]


def test_a_large_input_writes_hundreds_of_shards_not_tens_of_thousands():
    """10^6 rows at the default batch size (8 rows, 64-row shards) would write 15,625 files; the shards grow so
    that at most 500 are written, and an input up to 500 default shards keeps the default size."""
    from ray_cluster_ft.features.stage import _default_shard_rows

    cfg = SketchConfig(method="sketch", num_actors=8)
    for n, files in ((10**6, 500), (32_000, 500), (32_001, 493), (100_000, 500), (10_000, 157)):
        rows = _default_shard_rows(n, cfg, False, None)
        assert -(-n // rows) == files, (n, rows)
    assert _default_shard_rows(10**6, cfg, False, None) == 2000
    assert _default_shard_rows(10_000, cfg, False, None) == 64


@pytest.mark.slow  # three Ray Data jobs: about 45 s on 2 busy cores
def test_another_seed_or_one_changed_weight_byte_reads_nothing(tiny_dir, tmp_path, ray_cpu):
    cfg = CFG.model_copy(update={"store": str(tmp_path / "store")})
    rows = _table(6)
    _, base = sketch_with_store(rows, str(tiny_dir), cfg, str(tmp_path / "r1"))
    assert (base["features_computed"], base["features_reused"]) == (6, 0)
    _, seeded = sketch_with_store(rows, str(tiny_dir), cfg.model_copy(update={"seed": 8}), str(tmp_path / "r2"))
    assert (seeded["features_computed"], seeded["features_reused"]) == (6, 0)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_dir, other)
    blob = bytearray((other / "model.safetensors").read_bytes())
    blob[-1] ^= 0x01
    (other / "model.safetensors").write_bytes(bytes(blob))
    _, changed = sketch_with_store(rows, str(other), cfg, str(tmp_path / "r3"))
    assert (changed["features_computed"], changed["features_reused"]) == (6, 0)
    assert len({base["feature_key"], seeded["feature_key"], changed["feature_key"]}) == 3
    assert len(list((tmp_path / "store" / "v1").iterdir())) == 3  # three keys side by side, none overwritten


@pytest.mark.slow
def test_few_missing_rows_are_sketched_here_with_the_same_shards_and_values(tiny_dir, tmp_path, ray_cpu):
    from ray_cluster_ft.features import compute_sketches

    t = _table(10)
    pool = compute_sketches(t, str(tiny_dir), CFG, str(tmp_path / "pool"), shard_rows=4)
    here = compute_sketches(t, str(tiny_dir), CFG, str(tmp_path / "here"), shard_rows=4, in_process_rows=10)
    assert (here["computed"], here["rows_computed"]) == (pool["computed"], pool["rows_computed"]) == (3, 10)
    assert sorted(f.name for f in (tmp_path / "here").iterdir()) == sorted(f.name for f in (tmp_path / "pool").iterdir())
    a, b = read_sketches(str(tmp_path / "pool")), read_sketches(str(tmp_path / "here"))
    assert a["example_id"].tolist() == b["example_id"].tolist()
    np.testing.assert_allclose(b["sketch"], a["sketch"], atol=1e-5)
    with pytest.raises(RuntimeError, match="injected failure on shard 1"):
        compute_sketches(t, str(tiny_dir), CFG, str(tmp_path / "fail"), shard_rows=4, in_process_rows=10,
                         fail_on_shard=1)
    assert [f.name[:11] for f in (tmp_path / "fail").glob("shard-*.parquet")] == ["shard-00000"]


def test_a_store_that_cannot_be_one_is_refused_before_any_work(tmp_path):
    from ray_cluster_ft.config import ConfigError
    from ray_cluster_ft.features.feature_store import check_store

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for bad, why in ((str(a_file), "afile"), ("foo://x", "foo"), (str(a_file / "under"), "under")):
        with pytest.raises(ConfigError, match=r"sketch.store .* cannot be used as a feature store"):
            check_store(bad)
    check_store(str(tmp_path / "new" / "store"))  # a folder that does not exist yet is made
    assert (tmp_path / "new" / "store").is_dir()
