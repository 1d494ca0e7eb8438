"""CluSTER's last-layer gradient proxy (``sketch.method: last_layer``): exactness against a plain per-example
loop, padding invariance, errors, the driver-side normalisation, the sketcher interface and the Ray stage."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_cluster_ft.config import SketchConfig
from ray_cluster_ft.data import IGNORE_INDEX
from ray_cluster_ft.features.last_layer import last_layer_features, normalise_last_layer
from ray_cluster_ft.features.sketchers import LastLayerSketcher, make_sketcher
from ray_cluster_ft.model import load_model

from ._helpers import examples as _examples
from ._helpers import pad as _pad


@pytest.fixture(scope="module")
def model64(tiny_model_dir):
    torch.set_num_threads(1)
    return load_model(str(tiny_model_dir), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def model32(tiny_model_dir):
    return load_model(str(tiny_model_dir)).eval()


def _reference(model, ids, labels):
    """g_i and the loss of ONE unpadded example, by an explicit loop: full forward, float64 softmax over the
    whole vocabulary, ``(p(y_t) - 1) h_t`` summed over the response positions and divided by their count."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True, use_cache=False)
    h = out.hidden_states[-1][0].double()
    probs = torch.softmax(out.logits[0].double(), dim=-1)
    g, loss, n = torch.zeros(h.shape[1], dtype=torch.float64), 0.0, 0
    for t in range(len(ids) - 1):
        y = int(labels[t + 1])
        if y == IGNORE_INDEX:
            continue
        p = probs[t, y]
        g += (p - 1.0) * h[t]
        loss += -float(torch.log(p))
        n += 1
    return g / n, loss / n


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


ROWS = ([11, 4, 17, 8], [5, 1, 9, 2])


@pytest.mark.parametrize("which, tol", [("model64", 1e-6), ("model32", 1e-5)])
def test_matches_a_plain_per_example_loop(request, which, tol):
    model = request.getfixturevalue(which)
    rows, labels = _examples(*ROWS, seed=3)
    feats, losses = last_layer_features(model, *_pad(rows, labels, "right"))
    assert feats.dtype == torch.float32 and feats.shape == (4, 32) and not feats.is_inference()
    assert losses.dtype == torch.float32 and losses.shape == (4,)
    ref = [_reference(model, r, l) for r, l in zip(rows, labels)]
    assert _rel(feats, torch.stack([g for g, _ in ref])) <= tol
    np.testing.assert_allclose(losses.numpy(), [loss for _, loss in ref], rtol=tol)


def test_the_fallback_without_a_linear_head_gives_the_same_rows(model64, monkeypatch):
    rows, labels = _examples(*ROWS, seed=4)
    batch = _pad(rows, labels, "left")
    fast, fast_loss = last_layer_features(model64, *batch)
    # Without a plain Linear head the full hidden_states[-1] and logits are sliced instead of the head trick.
    monkeypatch.setattr(model64, "get_output_embeddings", lambda: None)
    slow, slow_loss = last_layer_features(model64, *batch)
    assert _rel(fast, slow) <= 1e-6
    np.testing.assert_allclose(fast_loss.numpy(), slow_loss.numpy(), rtol=1e-6)


def test_left_and_right_padding_and_batch_mates_give_the_same_rows(model32):
    rows, labels = _examples([13, 3, 20, 7, 9], [4, 1, 6, 2, 8], seed=5)
    right, loss_r = last_layer_features(model32, *_pad(rows, labels, "right"))
    left, loss_l = last_layer_features(model32, *_pad(rows, labels, "left"))
    assert _rel(left, right) <= 1e-5
    np.testing.assert_allclose(loss_l.numpy(), loss_r.numpy(), rtol=1e-5)
    alone, _ = last_layer_features(model32, *_pad(rows[2:3], labels[2:3], "right"))
    assert _rel(alone, right[2:3]) <= 1e-5


def test_bad_inputs_raise(model32):
    rows, labels = _examples([6, 5], [2, 5], seed=6)  # the second row: every label masked
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        last_layer_features(model32, *_pad(rows, labels, "right"))
    # Only the first token labelled: nothing predicts it after the shift.
    lab = labels[0].copy()
    lab[1:] = IGNORE_INDEX
    lab[0] = rows[0][0]
    with pytest.raises(ValueError, match="no response token"):
        last_layer_features(model32, *_pad(rows[:1], [lab], "right"))
    ids, mask, lab2 = _pad(rows, [labels[0], labels[0][:5]], "right")
    lab2[1, 5] = 3  # a label on a padding token
    with pytest.raises(ValueError, match="padding token"):
        last_layer_features(model32, ids, mask, lab2)
    with pytest.raises(ValueError, match=r"must be the same \(B, T\)"):
        last_layer_features(model32, ids, mask[:, :-1], lab2)


def test_normalise_last_layer_by_world_size():
    x = np.array([[3.0, 4.0], [1.0, 0.0], [-1.0, 2.0]], dtype=np.float32)
    unit = normalise_last_layer(x, world_size=2)
    np.testing.assert_allclose(unit, [[0.6, 0.8], [1.0, 0.0], [-1 / 5**0.5, 2 / 5**0.5]], rtol=1e-6)
    centred = normalise_last_layer(x, world_size=1)
    np.testing.assert_allclose(centred, [[2.0, 2.0], [0.0, -2.0], [-2.0, 0.0]], atol=1e-6)
    assert unit.dtype == centred.dtype == np.float32
    np.testing.assert_allclose(normalise_last_layer(np.zeros((2, 3)), 4), 0.0)  # a zero row stays zero
    with pytest.raises(ValueError):
        normalise_last_layer(x, world_size=0)


@pytest.mark.parametrize("workers", [1, 3])
def test_stage_run_normalises_the_raw_shards_on_the_driver(tmp_path, monkeypatch, workers):
    import pyarrow as pa

    from ray_cluster_ft.features import stage
    from ray_cluster_ft.features._shards import _to_arrow, _write_atomic

    raw = np.array([[3.0, 4.0], [1.0, 0.0], [-1.0, 2.0]], dtype=np.float32)
    ids = ["b", "c", "a"]  # the shard is read back sorted by id; run must restore the candidate order

    def fake_compute(table, model_path, cfg, out_dir, **kw):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        _write_atomic(_to_arrow({"example_id": np.asarray(ids), "sketch": raw, "loss": np.zeros(3),
                                 "n_tokens": np.ones(3)}), Path(out_dir) / "shard-00000-x.parquet")
        return {"shards": 1, "rows_computed": 3, "rows_reused": 0}

    monkeypatch.setattr(stage, "compute_sketches", fake_compute)
    monkeypatch.setattr(stage, "prepare_sketch_inputs", lambda train, cfg, tok: SimpleNamespace(
        table=train, model_path="m", pad_token_id=0, retokenized=False))
    monkeypatch.setattr("ray_cluster_ft.rundir.claim", lambda run_dir, *p: Path(run_dir) / p[0])
    cfg = SimpleNamespace(sketch=SketchConfig(method="last_layer"), model=SimpleNamespace(trust_remote_code=False),
                          train=SimpleNamespace(num_workers=workers, use_gpu=False))
    res = stage.run(cfg, tmp_path, candidates=pa.table({"example_id": ids}), tokenizer=None)
    np.testing.assert_allclose(res.sketches, normalise_last_layer(raw, workers), atol=1e-6)
    assert res.summary["normalisation"] == ("mean_centred" if workers == 1 else "l2_rows")


def _numpy_batch(rows, labels, ids):
    col, lab = np.empty(len(rows), dtype=object), np.empty(len(rows), dtype=object)
    col[:], lab[:] = rows, labels
    return {"example_id": np.asarray(ids), "input_ids": col, "labels": lab,
            "n_tokens": np.asarray([len(r) for r in rows], dtype=np.int64)}


def test_sketcher_returns_raw_rows_in_input_order(tiny_model_dir, model32):
    cfg = SketchConfig(method="last_layer", batch_size=2)
    sk = make_sketcher("last_layer", str(tiny_model_dir), cfg.model_dump(), pad_token_id=3, device="cpu")
    assert isinstance(sk, LastLayerSketcher) and sk.dim == 32
    rows, labels = _examples([13, 4, 21, 8, 17], [5, 1, 9, 2, 3], seed=9)
    ids = ["e3", "e0", "e4", "e1", "e2"]
    out = sk(_numpy_batch(rows, labels, ids))
    assert list(out["example_id"]) == ids and list(out["n_tokens"]) == [13, 4, 21, 8, 17]
    assert out["sketch"].dtype == np.float32 and out["sketch"].shape == (5, 32)
    assert out["loss"].dtype == np.float32 and out["n_tokens"].dtype == np.int32
    ref, ref_loss = last_layer_features(model32, *_pad(rows, labels, "left"))
    np.testing.assert_allclose(out["sketch"], ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["loss"], ref_loss.numpy(), rtol=1e-5)
    assert not np.allclose(np.linalg.norm(out["sketch"], axis=1), 1.0)  # raw: the stage normalises
    with pytest.raises(ValueError, match="needs a model_path"):
        make_sketcher("last_layer", None, cfg.model_dump())
    with pytest.raises(ValueError, match="last_layer"):
        make_sketcher("nope", str(tiny_model_dir), cfg.model_dump())


def test_config_and_input_columns():
    from ray_cluster_ft.features.stage import _input_columns

    assert SketchConfig(method="last_layer", warmup_steps=3).warmup_steps == 3
    with pytest.raises(ValueError, match="'sketch', 'last_layer' or 'hidden_mean'"):
        SketchConfig(method="embedding", warmup_steps=1)
    assert _input_columns("last_layer") == _input_columns("sketch") == _input_columns("hidden_mean") == \
        ["example_id", "input_ids", "labels", "n_tokens"]


def test_prepare_sketch_inputs_gives_token_ids(tiny_model_dir, tmp_path):
    from ray_cluster_ft.config import parse_config
    from ray_cluster_ft.data import load_examples
    from ray_cluster_ft.features.inputs import prepare_sketch_inputs
    from ray_cluster_ft.model import load_tokenizer

    rows = [{"question": f"What is {i} plus {i}?", "answer": f"It is {2 * i}."} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = parse_config({"data": {"source": "files", "paths": [str(tmp_path / "rows.jsonl")], "eval_fraction": 0.0,
                                 "max_seq_len": 64}, "model": {"path": str(tiny_model_dir)},
                        "sketch": {"method": "last_layer"}})
    tok = load_tokenizer(str(tiny_model_dir))
    train = load_examples(cfg.data, tok).train
    got = prepare_sketch_inputs(train, cfg, tok)
    assert got.model_path == str(tiny_model_dir) and not got.retokenized
    assert got.table.column_names == ["example_id", "input_ids", "labels", "n_tokens"]
    assert got.table.column("input_ids").to_pylist() == train.column("input_ids").to_pylist()


@pytest.mark.slow
def test_compute_sketches_with_ray(ray_cpu, tiny_model_dir, tmp_path):
    pytest.importorskip("ray.data")
    import pyarrow as pa

    from ray_cluster_ft.features.stage import compute_sketches
    from ray_cluster_ft.features.store import read_sketches

    cfg = SketchConfig(method="last_layer", batch_size=3, num_actors=1)
    rows, labels = _examples([5 + (7 * i) % 13 for i in range(6)], [1 + i % 3 for i in range(6)], seed=12)
    ids = [f"ex{(5 * i) % 6}" for i in range(6)]
    table = pa.Table.from_pylist([{"example_id": e, "input_ids": r.tolist(), "labels": l.tolist(),
                                   "n_tokens": len(r)} for e, r, l in zip(ids, rows, labels)])
    stats = compute_sketches(table, str(tiny_model_dir), cfg, str(tmp_path / "sk"), shard_rows=3)
    assert (stats["shards"], stats["computed"], stats["examples"]) == (2, 2, 6)
    got = read_sketches(str(tmp_path / "sk"))
    direct = LastLayerSketcher(str(tiny_model_dir), cfg.model_dump(), device="cpu")(_numpy_batch(rows, labels, ids))
    order = np.argsort(direct["example_id"])
    assert list(got["example_id"]) == sorted(ids) and got["sketch"].shape == (6, 32)
    np.testing.assert_allclose(got["sketch"], direct["sketch"][order], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["loss"], direct["loss"][order], rtol=1e-5)
