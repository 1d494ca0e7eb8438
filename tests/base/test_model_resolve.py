"""Model paths are resolved once, on the driver, to absolute folders under ``model.cache_dir``; the worker-side
loaders take only such folders (ray_cluster_ft.model: resolve_models, require_local_model, load_local_model)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ray_cluster_ft.config import parse_config
from ray_cluster_ft.model import (
    convert_demo_model,
    download_hub_model,
    load_local_model,
    load_local_tokenizer,
    model_cache_dir,
    require_local_model,
    resolve_models,
)


def test_model_cache_dir_has_one_default_for_the_library_and_the_command_line(tmp_path, monkeypatch):
    from ray_cluster_ft.api import _model_cache

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_CLUSTER_FT_CACHE", str(tmp_path / "machine"))
    default = tmp_path / "machine" / "models"
    assert model_cache_dir(None, "runs/a") == model_cache_dir(None) == default
    # the library's compute_features resolves model.cache_dir with the same function
    assert _model_cache(None) == _model_cache(parse_config({})) == default
    assert _model_cache(parse_config({"model": {"cache_dir": "c"}, "output": {"dir": "runs/a"}})) == \
        tmp_path / "runs" / "c"
    assert model_cache_dir("shared-cache", "runs/a") == tmp_path / "runs" / "shared-cache"  # beside output.dir
    assert model_cache_dir("shared-cache") == tmp_path / "shared-cache"  # no run directory: the working directory
    assert model_cache_dir(str(tmp_path / "elsewhere"), "runs/a") == tmp_path / "elsewhere"
    monkeypatch.delenv("RAY_CLUSTER_FT_CACHE")
    assert model_cache_dir(None) == Path.home() / ".cache" / "ray-cluster-ft" / "models"


def test_demo_is_resolved_into_the_default_cache_the_library_uses(tmp_path, monkeypatch):
    home = convert_demo_model()  # this machine's default cache, as the test session already has it
    assert home == model_cache_dir(None) / home.name
    monkeypatch.chdir(tmp_path)
    new, resolved = resolve_models(parse_config({"output": {"dir": "runs/r1"}}))
    assert resolved == {"model.path": str(home), "sketch.model": None, "model.cache_dir": str(home.parent)}
    assert not (tmp_path / "runs" / ".model-cache").exists()


def test_demo_is_resolved_once_into_a_cache_beside_output_dir(tmp_path, monkeypatch):
    home = convert_demo_model()  # this machine's cache, as the test session already has it
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"output": {"dir": "runs/r1"}, "model": {"cache_dir": ".model-cache"}})
    new, resolved = resolve_models(cfg)
    want = tmp_path / "runs" / ".model-cache" / home.name
    assert resolved == {"model.path": str(want), "sketch.model": None, "model.cache_dir": str(want.parent)}
    assert new.model.path == str(want) and new.model.cache_dir == str(want.parent) and cfg.model.path == "demo"
    assert (want / "config.json").is_file() and (want / ".complete").is_file()
    # the same bytes as this machine's converted copy (linked or copied, never converted again)
    for f in ("model.safetensors", "tokenizer.json"):
        assert (want / f).read_bytes() == (home / f).read_bytes()
    # a second run beside it reuses the folder: same path, same files
    again, _ = resolve_models(parse_config({"output": {"dir": "runs/r2"}, "model": {"cache_dir": ".model-cache"}}))
    assert again.model.path == str(want)


def test_local_folder_and_proxy_become_absolute(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tiny_model_dir.parent)
    rel = os.path.relpath(tiny_model_dir)
    cfg = parse_config({"model": {"path": rel}, "sketch": {"model": rel}, "output": {"dir": str(tmp_path / "run")}})
    new, resolved = resolve_models(cfg)
    assert resolved["model.path"] == resolved["sketch.model"] == str(tiny_model_dir) == new.sketch.model
    assert os.path.isabs(new.model.path)


def test_hub_id_is_downloaded_once_by_the_driver(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, local_dir, allow_patterns):  # what the hub client would leave there
        calls.append((repo_id, local_dir))
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    cfg = parse_config({"model": {"path": "owner/some-model", "cache_dir": str(tmp_path / "cache")},
                        "output": {"dir": str(tmp_path / "run")}})
    first = resolve_models(cfg)[1]["model.path"]
    second = download_hub_model("owner/some-model", tmp_path / "cache")
    want = str(tmp_path / "cache" / "hub" / "owner--some-model")
    assert first == second == want
    assert calls == [("owner/some-model", want)]  # once, into the cache


@pytest.mark.parametrize("name", ["demo", "HuggingFaceTB/SmolLM2-135M", "relative/folder", "", None])
def test_worker_side_loaders_refuse_names(name):
    with pytest.raises(ValueError, match="not a resolved model folder"):
        require_local_model(name)
    with pytest.raises(ValueError, match="not a resolved model folder"):
        load_local_model(name)
    with pytest.raises(ValueError, match="not a resolved model folder"):
        load_local_tokenizer(name)


def test_worker_side_loaders_refuse_a_folder_this_node_cannot_see(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json on this node"):
        require_local_model(str(tmp_path / "not-mounted-here"))


def test_sketch_actor_and_evaluation_task_refuse_demo(demo_tokenizer):
    from ray_cluster_ft.config import SketchConfig
    from ray_cluster_ft.evaluate import evaluate_model_path
    from ray_cluster_ft.features.sketchers import GradientSketcher

    with pytest.raises(ValueError, match="not a resolved model folder"):
        GradientSketcher("demo", SketchConfig().model_dump(), device="cpu")
    with pytest.raises(ValueError, match="not a resolved model folder"):
        evaluate_model_path("demo", None)


def test_the_dict_sent_to_the_training_workers_holds_the_absolute_folder(tmp_path, tiny_model_dir, monkeypatch):
    """What train() hands Ray Train (captured before any worker starts): plain JSON data, the absolute folder."""
    from ray_cluster_ft.config import TrainConfig
    from ray_cluster_ft.train import driver
    from tests.train.test_train import make_examples, make_plan

    captured = {}

    class Stop(Exception):
        pass

    def fake_trainer(cfg, tables, run_dir, loop_config):
        captured.update(loop_config)
        raise Stop

    monkeypatch.setattr(driver, "_trainer", fake_trainer)
    monkeypatch.chdir(tiny_model_dir.parent)
    ex = make_examples(4)
    plan = make_plan(ex.column("example_id").to_pylist(), world=1, mbs=2, ga=1, epochs=1)
    with pytest.raises(Stop):
        driver.train(plan, ex, TrainConfig(num_workers=1, micro_batch_size=2, grad_accum=1),
                     os.path.relpath(tiny_model_dir),
                     tmp_path / "run", save_model=False)
    assert captured["model_dir"] == str(tiny_model_dir) and os.path.isabs(captured["model_dir"])
    assert json.loads(json.dumps(captured))["model_dir"] == captured["model_dir"]  # plain data, no config object
    assert isinstance(captured["train"], dict)


def test_the_sketch_inputs_name_the_resolved_folder(tmp_path, monkeypatch):
    """The feature stage, given the resolved config, hands the actors the folder in the cache."""
    from ray_cluster_ft.data import load_examples
    from ray_cluster_ft.features.inputs import prepare_sketch_inputs
    from ray_cluster_ft.model import load_tokenizer

    monkeypatch.chdir(tmp_path)
    cfg, resolved = resolve_models(parse_config({"output": {"dir": "run"}, "data": {"max_seq_len": 128},
                                                 "model": {"cache_dir": ".model-cache"},
                                                 "sketch": {"method": "hidden_mean"}}))
    tok = load_tokenizer(cfg.model.path)
    train = load_examples(cfg.data, tok).train
    sk = prepare_sketch_inputs(train, cfg, tok)
    assert sk.model_path == resolved["model.path"] == str(tmp_path / ".model-cache" / convert_demo_model().name)


def test_a_cache_dir_that_cannot_be_a_folder_is_a_config_error(tmp_path):
    from ray_cluster_ft.config import ConfigError
    from ray_cluster_ft.model import resolve_models

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for cache in (a_file, a_file / "below"):
        cfg = parse_config({"model": {"cache_dir": str(cache)}, "output": {"dir": str(tmp_path / "run")}})
        with pytest.raises(ConfigError, match="model.cache_dir: .* cannot be a folder"):
            resolve_models(cfg)
