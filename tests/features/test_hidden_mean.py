"""The RDS+ feature (``sketch.method: hidden_mean``): exactness against a plain Hugging Face forward pooled by hand,
for one row and for padded length-sorted batches, both poolings; the LM head is never called; the config; the
feature through ``compute_features`` in this process and through the Ray actor stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ray_cluster_ft as rcf
from ray_cluster_ft.config import ConfigError, SketchConfig, parse_config
from ray_cluster_ft.features.hidden_mean import base_transformer, hidden_mean_features, pooling_weights
from ray_cluster_ft.features.sketchers import HiddenMeanSketcher, make_sketcher
from ray_cluster_ft.model import load_model
from tests.conftest import local_ray_kwargs
from tests._pins import FIXTURE

from ._helpers import examples as _examples
from ._helpers import pad as _pad


@pytest.fixture(scope="module")
def model32(tiny_model_dir):
    torch.set_num_threads(1)
    return load_model(str(tiny_model_dir)).eval()


def _reference(model, ids, pooling):
    """One unpadded row: ``hidden_states[-1]`` of a plain forward with ``output_hidden_states=True`` (logits and
    all), pooled by an explicit loop over the tokens, then divided by its norm."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids)[None], output_hidden_states=True, use_cache=False)
    h = out.hidden_states[-1][0].double()
    n = len(ids)
    total = n * (n + 1) / 2
    pooled = torch.zeros(h.shape[1], dtype=torch.float64)
    for t in range(n):
        pooled += ((t + 1) / total if pooling == "weighted" else 1.0 / n) * h[t]
    return (pooled / pooled.norm()).numpy()


def _numpy_batch(rows, labels, ids):
    col, lab = np.empty(len(rows), dtype=object), np.empty(len(rows), dtype=object)
    col[:], lab[:] = rows, labels
    return {"example_id": np.asarray(ids), "input_ids": col, "labels": lab,
            "n_tokens": np.asarray([len(r) for r in rows], dtype=np.int64)}


LENGTHS, PROMPTS = [13, 4, 21, 8, 17, 9], [5, 1, 9, 2, 3, 4]


@pytest.mark.parametrize("pooling", ["weighted", "mean"])
def test_one_row_equals_a_plain_forward_pooled_by_hand(model32, pooling):
    rows, _ = _examples([11, 3, 19], [2, 1, 5], seed=5)
    for r in rows:
        got = hidden_mean_features(model32, torch.from_numpy(r)[None], torch.ones(1, len(r), dtype=torch.long),
                                   pooling)
        assert got.dtype == torch.float32 and got.shape == (1, 32) and not got.is_inference()
        np.testing.assert_allclose(got[0].numpy(), _reference(model32, r, pooling), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["weighted", "mean"])
def test_padded_length_sorted_batches_equal_the_reference(tiny_model_dir, model32, pooling):
    rows, labels = _examples(LENGTHS, PROMPTS, seed=9)
    ids = [f"e{i}" for i in range(len(rows))]
    sk = make_sketcher("hidden_mean", str(tiny_model_dir), SketchConfig(method="hidden_mean", pooling=pooling,
                                                                        batch_size=2).model_dump(),
                       pad_token_id=3, device="cpu")
    assert isinstance(sk, HiddenMeanSketcher) and sk.dim == 32
    out = sk(_numpy_batch(rows, labels, ids))
    assert list(out["example_id"]) == ids and list(out["n_tokens"]) == LENGTHS
    assert out["sketch"].dtype == np.float32 and out["sketch"].shape == (6, 32) and np.isnan(out["loss"]).all()
    ref = np.stack([_reference(model32, r, pooling) for r in rows])
    np.testing.assert_allclose(out["sketch"], ref, rtol=0, atol=1e-5)
    # Left padding, all rows in one batch: the same rows (position ids follow the mask).
    ids_t, mask, _ = _pad(rows, labels, "left")
    np.testing.assert_allclose(hidden_mean_features(model32, ids_t, mask, pooling).numpy(), ref, rtol=0, atol=1e-5)


def test_the_two_poolings_differ_and_weights_follow_the_real_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_allclose(pooling_weights(mask, "weighted").numpy(),
                               [[1 / 6, 2 / 6, 3 / 6, 0], [0, 1 / 6, 2 / 6, 3 / 6]], rtol=1e-6)
    np.testing.assert_allclose(pooling_weights(mask, "mean").numpy(), [[1 / 3] * 3 + [0], [0] + [1 / 3] * 3])
    with pytest.raises(ValueError, match="pooling must be"):
        pooling_weights(mask, "max")
    with pytest.raises(ValueError, match="no real token"):
        pooling_weights(torch.tensor([[1, 1], [0, 0]]), "mean")


def test_the_lm_head_is_never_called(tiny_model_dir, model32):
    calls = []
    handle = model32.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        rows, labels = _examples([9, 14], [2, 3], seed=1)
        hidden_mean_features(model32, *_pad(rows, labels, "right")[:2])
        assert calls == []
        model32(input_ids=torch.from_numpy(rows[0])[None])  # the hook itself works
        assert calls == [1]
    finally:
        handle.remove()
    assert base_transformer(model32) is model32.model
    sk = HiddenMeanSketcher(str(tiny_model_dir), SketchConfig(method="hidden_mean").model_dump(), device="cpu")
    seen = []
    sk.model.get_output_embeddings().register_forward_hook(lambda *a: seen.append(1))
    sk(_numpy_batch(rows, labels, ["a", "b"]))
    assert seen == []


def test_config():
    assert SketchConfig(method="hidden_mean").pooling == "weighted"
    assert SketchConfig(method="hidden_mean", pooling="mean").pooling == "mean"
    # embedding is the default (issue 31's ablations), which pools nothing: a spec that names no method has none
    assert SketchConfig().method == "embedding" and parse_config({}).sketch.pooling is None
    assert parse_config({"sketch": {"method": "hidden_mean"}}).sketch.pooling == "weighted"
    assert SketchConfig(method="sketch").pooling is None
    assert SketchConfig(method="hidden_mean", warmup_steps=2).warmup_steps == 2
    for method in ("sketch", "last_layer", "embedding"):
        with pytest.raises(ValueError, match="sketch.pooling: mean pools the final hidden states"):
            SketchConfig(method=method, pooling="mean")
    with pytest.raises(ConfigError, match="sketch.pooling"):
        parse_config({"sketch": {"method": "sketch", "pooling": "weighted"}})
    # A saved config of hidden_mean says which pooling ran, and loads again.
    dumped = parse_config({"sketch": {"method": "hidden_mean"}}).model_dump(mode="json")
    assert dumped["sketch"]["pooling"] == "weighted" and parse_config(dumped).sketch.pooling == "weighted"
    assert parse_config(parse_config({}).model_dump(mode="json")).sketch.pooling is None
    sketch_cfg = parse_config({"sketch": {"method": "sketch"}}).model_dump(mode="json")
    assert parse_config(sketch_cfg).sketch.pooling is None  # a saved config of another method still loads


@pytest.mark.slow
def test_compute_features_in_process_and_on_ray_agree(tiny_model_dir):
    """The same rows through ``compute_features`` without Ray (the sketcher in this process) and with a local Ray
    (:func:`compute_sketches`' actor pool, shards on disk): the same unit features."""
    import ray

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[:10]]
    cfg = parse_config({"sketch": {"method": "hidden_mean", "batch_size": 4, "num_actors": 1},
                        "data": {"max_seq_len": 512, "overlong": "truncate"}})
    assert not ray.is_initialized()
    here = rcf.compute_features(rows, str(tiny_model_dir), cfg)
    assert here.features.shape == (10, 32) and here.features.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(here.features, axis=1), 1.0, rtol=1e-5)
    ray.init(**local_ray_kwargs(log_to_driver=False))
    try:
        on_ray = rcf.compute_features(rows, str(tiny_model_dir), cfg)
    finally:
        ray.shutdown()
    assert on_ray.example_id.tolist() == here.example_id.tolist()
    np.testing.assert_allclose(on_ray.features, here.features, rtol=0, atol=1e-6)
    # Not the last-layer feature nor an unpooled one: a check that the method reached the actors.
    ll_cfg = cfg.model_copy(update={"sketch": cfg.sketch.model_copy(update={"method": "last_layer", "pooling": None})})
    ll = rcf.compute_features(rows, str(tiny_model_dir), ll_cfg, world_size=2)
    assert np.abs(ll.features - here.features).max() > 0.1


def test_bf16_autocast_gives_float32_rows_near_the_fp32_ones(tiny_model_dir, model32):
    """``sketch.dtype: bfloat16`` (the GPU default, and bench/end_to_end.py's): the pooled rows come back from the
    autocast region in bf16; the sketcher hands float32 rows within bf16's precision of the fp32 reference."""
    rows, labels = _examples(LENGTHS, PROMPTS, seed=9)
    sk = make_sketcher("hidden_mean", str(tiny_model_dir),
                       SketchConfig(method="hidden_mean", batch_size=2, dtype="bfloat16").model_dump(),
                       pad_token_id=3, device="cpu")
    out = sk(_numpy_batch(rows, labels, [f"e{i}" for i in range(len(rows))]))
    ref = np.stack([_reference(model32, r, "weighted") for r in rows])
    assert out["sketch"].dtype == np.float32
    cos = (out["sketch"] * ref).sum(1) / np.linalg.norm(out["sketch"], axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.99 and not np.allclose(out["sketch"], ref, rtol=0, atol=1e-6)  # bf16 did run
