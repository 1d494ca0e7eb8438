"""Gradient sketch stage: exactness against per-example autograd + explicit Kronecker projection, batch and
padding invariance, seeding, module selection, the Ray Data callable and the Parquet round trip."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_cluster_ft.config import SketchConfig
from ray_cluster_ft.model import load_model, make_tiny_model
from ray_cluster_ft.sketch import (
    IGNORE_INDEX,
    GradientSketcher,
    compute_sketches,
    exact_sketch,
    make_projector,
    read_sketches,
    select_modules,
    sketch_batch,
)

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 49_152


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


def _examples(lengths, prompt_lens, seed=0):
    """Random token rows; the first ``prompt_len`` tokens of each carry no label."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for n, p in zip(lengths, prompt_lens):
        ids = rng.integers(0, VOCAB, size=n, dtype=np.int64)
        lab = ids.copy()
        lab[:p] = IGNORE_INDEX
        rows.append(ids)
        labels.append(lab)
    return rows, labels


def _pad(rows, labels, side):
    """(ids, mask, labels) int64 tensors, padded on ``side`` with an arbitrary non-zero pad id."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), 7, dtype=torch.long)
    lab = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        sl = slice(0, len(r)) if side == "right" else slice(t - len(r), t)
        ids[i, sl], lab[i, sl], mask[i, sl] = torch.from_numpy(r), torch.from_numpy(l), 1
    return ids, mask, lab


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
    cfg = SketchConfig(k_in=4, k_out=4, dim=48, batch_size=2, last_blocks=1, seed=4)
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


def test_compute_and_read_sketches_on_local_ray(tiny_dir, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    import ray_cluster_ft.sketch as sketch_mod

    # Two Ray batches of 6, each two padded sub-batches of 3. One actor keeps the test fast; it runs in
    # another process than the direct computation below, so equal sketches also show the seeding is portable.
    monkeypatch.setattr(sketch_mod, "_SUBBATCHES_PER_RAY_BATCH", 2)
    cfg = SketchConfig(k_in=4, k_out=4, dim=32, batch_size=3, last_blocks=1, seed=7, num_actors=1)
    lengths = [5 + (7 * i) % 17 for i in range(12)]
    rows, labels = _examples(lengths, [1 + i % 4 for i in range(12)], seed=12)
    ids = [f"ex{(5 * i) % 12:02d}" for i in range(12)]
    table_in = pa.Table.from_pylist(
        [
            {"example_id": e, "input_ids": r.tolist(), "labels": l.tolist(), "n_tokens": len(r), "source": "t"}
            for e, r, l in zip(ids, rows, labels)
        ]
    )
    (tmp_path / "examples").mkdir()
    pq.write_table(table_in, tmp_path / "examples" / "part-0.parquet")
    out_dir = tmp_path / "sketches"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Default pool: one actor per CPU, one CPU left free in all for the read and write tasks.
        assert sketch_mod._actor_resources(SketchConfig(), use_gpu=False) == (2, 0.5)
        assert sketch_mod._actor_resources(cfg, use_gpu=False) == (1, 1.0)
        # read_parquet runs Ray tasks upstream of the actor pool: a pool holding every CPU would hang here.
        ds = ray.data.read_parquet(str(tmp_path / "examples"))
        compute_sketches(ds, str(tiny_dir), cfg, str(out_dir), use_gpu=False, pad_token_id=0)
    finally:
        ray.shutdown()
    table = pq.read_table(out_dir)
    sk_type = table.schema.field("sketch").type
    assert pa.types.is_fixed_size_list(sk_type) and sk_type.list_size == 32
    assert sk_type.value_type == pa.float32()
    got = read_sketches(str(out_dir))
    assert list(got["example_id"]) == sorted(ids)  # every id exactly once
    assert got["sketch"].shape == (12, 32) and got["sketch"].dtype == np.float32
    direct = GradientSketcher(str(tiny_dir), cfg.model_dump(), device="cpu")(_numpy_batch(rows, labels, ids))
    order = np.argsort(direct["example_id"])
    np.testing.assert_allclose(got["sketch"], direct["sketch"][order], atol=1e-5)
    np.testing.assert_allclose(got["loss"], direct["loss"][order], rtol=1e-5)
    assert got["n_tokens"].dtype == np.int32 and list(got["n_tokens"]) == list(np.asarray(lengths)[order])


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
