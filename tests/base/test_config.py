import json

import pytest

from ray_cluster_ft.cli import demo_config_path
from ray_cluster_ft.config import ConfigError, JobConfig, check_against_data, load_config, parse_config


def test_defaults_and_demo_spec_load():
    cfg = load_config(demo_config_path())
    assert cfg.train.num_workers == 2 and cfg.train.zero_stage == 2
    assert cfg.selection.budget == pytest.approx(0.31)
    assert cfg.model.path == "demo" and cfg.data.source == "demo"


def test_jobs_demo_is_the_packaged_demo():
    from pathlib import Path

    jobs = Path(__file__).resolve().parents[2] / "jobs" / "demo.yaml"
    assert jobs.read_text() == demo_config_path().read_text()


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"trian": {}}, "unknown key 'trian'; did you mean 'train'?"),
        ({"train": {"micro_batch_sise": 2}}, "did you mean 'train.micro_batch_size'?"),
        ({"sketch": {"dim": "big"}}, "sketch.dim"),
        ({"train": {"micro_batch_size": 0}}, "train.micro_batch_size"),
        ({"selection": {"budget": 0}}, "selection.budget"),
        ({"selection": {"budget": 2.5}}, "a count must be whole"),
        ({"selection": {"strategy": "best"}}, "selection.strategy"),
        ({"clustering": {"k": 0}}, "clustering.k"),
        ({"clustering": {"k": "automatic"}}, "clustering.k: must be a whole number, 'auto' or 'world_size' (got 'automatic')"),
        ({"selection": {"budget": 1.5}}, "selection.budget: a fraction must be in (0, 1], a count must be whole"),
        ({"sketch": {"modules": []}}, "sketch.modules: List should have at least 1 item"),
        ({"train": {"epochs": 10**12}}, "train.epochs: Input should be less than or equal to 1000"),
        ({"output": {"dir": ""}}, "output.dir: String should have at least 1 character"),
        ({"allocation": {"pad_tolerance": 1.5}}, "allocation.pad_tolerance: Input should be less than or equal to 1"),
        ({"data": {"source": "files"}}, "data.paths is empty"),
        ([1, 2], "mapping of sections"),
    ],
)
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert needle in str(err.value)


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("train:\n  epochs: 2\n")
    cfg = load_config(ok, {"output.dir": "x/y", "train.lr": 0.5})
    assert (cfg.train.epochs, cfg.output.dir, cfg.train.lr) == (2, "x/y", 0.5)


def test_check_against_data():
    cfg = JobConfig()
    check_against_data(cfg, 100)  # 31 selected >= 2 workers x 4
    with pytest.raises(ConfigError, match="no accepted training examples"):
        check_against_data(cfg, 0)
    check_against_data(cfg, 20)  # packed by default (allocation.packing: auto): 6 rows fill 2 ranks' packs
    with pytest.raises(ConfigError, match=r"num_workers=2 x train.grad_accum=1 = 2 packs .* only 1"):
        check_against_data(cfg, 3)  # round(0.31 * 3) = 1 < 2
    unpacked = parse_config({"allocation": {"packing": False}})
    with pytest.raises(ConfigError, match=r"num_workers=2 x train.micro_batch_size=4 .* only 6"):
        check_against_data(unpacked, 20)  # round(0.31 * 20) = 6 < 8
    with pytest.raises(ConfigError, match="selection.budget=500 is above the 100"):
        check_against_data(parse_config({"selection": {"budget": 500}}), 100)
    with pytest.raises(ConfigError, match="clustering.k=101 is above the 100"):
        check_against_data(parse_config({"clustering": {"k": 101}}), 100)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"selection": {"budget": float("inf")}}, "selection.budget"),
        ({"train": {"lr": float("nan")}}, "train.lr"),
        ({"selection": {"budget": True}}, "selection.budget: .*does not take a boolean"),
        ({"clustering": {"k": True}}, "clustering.k: .*does not take a boolean"),
        ({"train": {"epochs": True}}, "train.epochs: .*does not take a boolean"),  # was read as 1 epoch
        ({"train": {"lr": True}}, "train.lr: .*does not take a boolean"),  # was read as 1.0
        ({"clustering": {"max_cluster_ratio": True}}, "clustering.max_cluster_ratio: .*does not take a boolean"),
        ({"train": {"max_tokens_per_micro_batch": False}}, "train.max_tokens_per_micro_batch: .*does not take a boolean"),
        ({"data": {"paths": True}}, "data.paths: .*does not take a boolean"),
    ],
)
def test_non_finite_and_boolean_numbers_are_refused(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_cap_by_needs_a_cap():
    with pytest.raises(ConfigError, match="clustering.cap_by: tokens .* set clustering.max_cluster_ratio"):
        parse_config({"clustering": {"cap_by": "tokens"}})
    with pytest.raises(ConfigError, match="clustering.cap_by"):
        parse_config({"clustering": {"cap_by": "docs", "max_cluster_ratio": 1.5}})
    assert parse_config({"clustering": {"cap_by": "rows", "max_cluster_ratio": 1.5}}).clustering.cap_by == "rows"
    assert parse_config({}).clustering.cap_by == "auto"


def test_boolean_keys_still_take_booleans():
    cfg = parse_config({"train": {"use_gpu": False, "final_checkpoint": False}, "clustering": {"refit": False},
                        "allocation": {"packing": False}})
    assert cfg.train.final_checkpoint is False and cfg.allocation.packing is False


def test_data_paths_mean_files_and_demo_with_paths_is_refused(tmp_path, monkeypatch):
    # Listing files without data.source once trained on the built-in demo data instead, silently.
    cfg = parse_config({"data": {"paths": ["a.jsonl"]}})
    assert cfg.data.source == "files" and cfg.data.paths == ["a.jsonl"]
    with pytest.raises(ConfigError, match="data.source is 'demo' .* but data.paths lists files"):
        parse_config({"data": {"source": "demo", "paths": ["a.jsonl"]}})
    assert parse_config({}).data.source == "demo"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_config({"data": {"paths": ["~/x.jsonl"]}}).data.paths == [str(tmp_path / "x.jsonl")]


@pytest.mark.parametrize("section", ["data", "sketch", "clustering", "selection", "allocation", "train"])
@pytest.mark.parametrize("seed, ok", [(0, True), (2**32 - 1, True), (-1, False), (2**32, False)])
def test_seeds_are_checked_with_the_config(section, seed, ok):
    # numpy / scikit-learn take seeds in [0, 2**32): a bad one used to fail after the sketch stage.
    raw = {section: {"seed": seed}}
    if ok:
        assert getattr(parse_config(raw), section).seed == seed
    else:
        with pytest.raises(ConfigError, match=f"{section}.seed: Input should be"):
            parse_config(raw)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    spec = tmp_path / "dup.yaml"
    spec.write_text("train:\n  epochs: 3\nselection:\n  budget: 0.5\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="duplicate key 'train' \\(first on line 1\\)"):
        load_config(spec)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  epochs: 3\n  epochs: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'epochs' \\(first on line 2\\)"):
        load_config(nested)
    apart = tmp_path / "apart.yaml"  # the same key in different mappings, and a merge key, are fine
    apart.write_text("train:\n  seed: 1\nselection: &s\n  seed: 1\nallocation:\n  <<: *s\n  strategy: length\n")
    cfg = load_config(apart)
    assert (cfg.train.seed, cfg.selection.seed, cfg.allocation.seed, cfg.allocation.strategy) == (1, 1, 1, "length")


def test_deepspeed_batch_keys_are_checked_on_the_driver(tmp_path):
    import json

    from ray_cluster_ft.train import build_deepspeed_config

    def build(**train):
        return build_deepspeed_config(parse_config({"train": {"deepspeed_config": str(ds), **train}}).train)

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="sets train_micro_batch_size_per_gpu=8 but the plan needs 4"):
        build()
    with pytest.raises(ConfigError, match="zero_optimization.stage=3 but train.zero_stage is 2"):
        build(micro_batch_size=8)
    assert build(micro_batch_size=8, zero_stage=3)["train_micro_batch_size_per_gpu"] == 8
    ds.write_text(json.dumps({"train_batch_size": 16}))
    with pytest.raises(ConfigError, match="train_batch_size=16 but the plan needs 8"):
        build()
    assert build(num_workers=4)["train_batch_size"] == 16
    ds.write_text(json.dumps({"optimizer": 5}))  # DeepSpeed would fail in every worker
    with pytest.raises(ConfigError, match="sets optimizer=5, but DeepSpeed expects a mapping"):
        build()
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert parse_config({"train": {"deepspeed_config": str(ds)}}).train.deepspeed_config == str(ds)
    assert build()["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_config_validation_reads_no_file(tmp_path):
    """The schema is pure: a DeepSpeed path is checked where the driver reads it, not when a config (or a
    worker's copy of it) is validated."""
    from ray_cluster_ft.train import build_deepspeed_config

    missing = tmp_path / "missing.json"
    cfg = parse_config({"train": {"deepspeed_config": str(missing)}})
    assert cfg.train.deepspeed_config == str(missing)
    with pytest.raises(ConfigError, match="DeepSpeed config file not found"):
        build_deepspeed_config(cfg.train)


def test_clustering_k_only_checked_where_clustering_runs():
    cfg = parse_config({"clustering": {"k": 100}, "selection": {"strategy": "random"},
                        "allocation": {"strategy": "length"}})
    check_against_data(cfg, 50)  # no clustering runs: k is unused
    with pytest.raises(ConfigError, match="clustering.k=100 is above the 50"):
        check_against_data(parse_config({"clustering": {"k": 100}}), 50)


def test_fewer_clusters_than_ranks_is_refused_for_the_cluster_allocation():
    with pytest.raises(ConfigError, match=r"clustering.k=1 is below train.num_workers=2: .* set "
                                          r"allocation.allow_shared_clusters: true"):
        parse_config({"clustering": {"k": 1}})
    with pytest.raises(ConfigError, match="clustering.k=3 is below train.num_workers=4"):
        parse_config({"clustering": {"k": 3}, "train": {"num_workers": 4}})
    assert parse_config({"clustering": {"k": 1}, "allocation": {"allow_shared_clusters": True}}).clustering.k == 1
    assert parse_config({"clustering": {"k": 1}, "allocation": {"strategy": "random"}}).clustering.k == 1
    assert parse_config({"clustering": {"k": 2}}).clustering.k == 2
    assert parse_config({"clustering": {"k": "auto"}, "train": {"num_workers": 8}}).clustering.k == "auto"


def test_loss_weighting_defaults_to_cluster_for_the_published_selection_only():
    # Measured (issue 31): the balanced subset trained unweighted has the lower held-out macro loss.
    assert parse_config({}).train.loss_weighting == "none"
    assert parse_config({"preset": "cluster-paper"}).train.loss_weighting == "cluster"
    assert parse_config({"selection": {"strategy": "equalize"}}).train.loss_weighting == "cluster"
    assert parse_config({"selection": {"strategy": "random"}}).train.loss_weighting == "none"
    assert parse_config({"selection": {"strategy": "full"}}).train.loss_weighting == "none"
    assert parse_config({"train": {"loss_weighting": "none"}}).train.loss_weighting == "none"
    assert parse_config({"selection": {"strategy": "random"}, "train": {"loss_weighting": "cluster"}}
                        ).train.loss_weighting == "cluster"
    assert parse_config({"train": {"loss_weighting": "cluster"}}).train.loss_weighting == "cluster"
    with pytest.raises(ConfigError, match="train.loss_weighting: Input should be 'cluster' or 'none'"):
        parse_config({"train": {"loss_weighting": "tokens"}})


def test_cluster_per_rank_needs_as_many_clusters_as_ranks():
    with pytest.raises(ConfigError, match=r"'cluster_per_rank' .* needs clustering.k equal to "
                                          r"train.num_workers=2 .* got clustering.k=auto"):
        parse_config({"allocation": {"strategy": "cluster_per_rank"}})
    with pytest.raises(ConfigError, match="train.num_workers=4 .* got clustering.k=3"):
        parse_config({"allocation": {"strategy": "cluster_per_rank"}, "clustering": {"k": 3},
                      "train": {"num_workers": 4}})
    assert parse_config({"allocation": {"strategy": "cluster_per_rank"}, "clustering": {"k": 2}}).clustering.k == 2


# --- the published CluSTER options: clustering.k world_size, algorithm, max_cluster_ratio, selection.ratio ------


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"selection": {"ratio": 0}}, "selection.ratio: Input should be greater than 0 (got 0)"),
        ({"selection": {"ratio": 1.5}}, "selection.ratio: Input should be less than or equal to 1 (got 1.5)"),
        ({"selection": {"ratio": True}}, "selection.ratio: does not take a boolean (YAML true/false)"),
        ({"selection": {"within": "farthest"}}, "selection.within: Input should be"),
        ({"clustering": {"max_cluster_ratio": 1}}, "clustering.max_cluster_ratio: Input should be greater than 1"),
        ({"clustering": {"max_cluster_ratio": 0.5}}, "clustering.max_cluster_ratio: Input should be greater than 1"),
        ({"clustering": {"max_cluster_ratio": True}}, "clustering.max_cluster_ratio: does not take a boolean"),
        ({"clustering": {"algorithm": "dbscan"}},
         "clustering.algorithm: Input should be 'spherical' or 'kmeans' (got 'dbscan')"),
        ({"clustering": {"k": "worldsize"}}, "clustering.k: must be a whole number, 'auto' or 'world_size'"),
    ],
)
def test_published_options_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert needle in str(err.value)


def test_published_options_parse():
    cfg = parse_config({})
    assert (cfg.clustering.algorithm, cfg.clustering.max_cluster_ratio, cfg.selection.ratio) == ("spherical", None, 1.0)
    cfg = parse_config({"clustering": {"k": "world_size", "algorithm": "kmeans", "max_cluster_ratio": 1.5},
                        "selection": {"strategy": "equalize", "ratio": 1, "within": "peripheral"},
                        "train": {"num_workers": 4}})
    assert cfg.clustering.k == "world_size" and cfg.clustering.max_cluster_ratio == 1.5
    assert (cfg.selection.strategy, cfg.selection.ratio, cfg.selection.within) == ("equalize", 1.0, "peripheral")
    for within in ("kcenter", "strata", "central", "random"):
        assert parse_config({"selection": {"within": within}}).selection.within == within
    # ints, 'auto' and booleans behave as before
    assert parse_config({"clustering": {"k": "12"}}).clustering.k == 12
    with pytest.raises(ConfigError, match="does not take a boolean"):
        parse_config({"clustering": {"k": True}})


def test_a_selection_key_the_strategy_ignores_is_refused_unless_it_keeps_its_default():
    with pytest.raises(ConfigError, match=r"selection.ratio \(0.3\) applies to 'equalize' only, not 'balanced'"):
        parse_config({"selection": {"ratio": 0.3}})
    with pytest.raises(ConfigError, match="selection.ratio .* not 'random'"):
        parse_config({"selection": {"strategy": "random", "ratio": 0.8}})
    with pytest.raises(ConfigError, match=r"selection.budget \(0.5\) and selection.budget_tokens \(0.2\) both set"):
        parse_config({"selection": {"budget": 0.5, "budget_tokens": 0.2}})
    with pytest.raises(ConfigError, match="budget_tokens replaces budget"):
        parse_config({"preset": "cluster-paper", "selection": {"strategy": "balanced", "budget": 100,
                                                               "budget_tokens": 5000}})
    # A saved spec holds every key with its default (config.yaml, for --resume): it loads again.
    for raw in ({"selection": {"budget_tokens": 0.2}}, {"selection": {"strategy": "random", "budget": 0.4}},
                {"preset": "cluster-paper", "selection": {"strategy": "balanced"}}):
        cfg = parse_config(raw)
        assert parse_config(cfg.model_dump(mode="json")) == cfg


def test_preset_cluster_paper_fills_the_published_configuration_and_spec_keys_win(tmp_path, capsys):
    from ray_cluster_ft.cli import main

    cfg = parse_config({"preset": "cluster-paper"})
    assert (cfg.sketch.method, cfg.clustering.k, cfg.clustering.algorithm, cfg.clustering.max_cluster_ratio,
            cfg.clustering.cap_by) == ("last_layer", "world_size", "kmeans", 1.5, "rows")
    # the official defaults (train_grad.py: seed 42, ratio 100)
    assert (cfg.selection.strategy, cfg.selection.ratio, cfg.selection.within) == ("equalize", 1.0, "peripheral")
    assert cfg.clustering.seed == 42
    assert (cfg.allocation.strategy, cfg.train.loss_weighting) == ("cluster_per_rank", "cluster")
    mine = parse_config({"preset": "cluster-paper", "selection": {"ratio": 0.75},
                         "clustering": {"seed": 3}, "train": {"loss_weighting": "none"}})
    assert (mine.selection.ratio, mine.selection.within, mine.clustering.seed, mine.clustering.algorithm,
            mine.train.loss_weighting) == (0.75, "peripheral", 3, "kmeans", "none")
    with pytest.raises(ConfigError, match="preset: Input should be 'cluster-paper'"):
        parse_config({"preset": "paper"})
    with pytest.raises(ConfigError, match=r"not 'equalize' .* \(preset 'cluster-paper' sets selection.strategy=equalize, "
                                          r"selection.ratio=1.0, selection.within=peripheral; a key in the spec overrides"):
        parse_config({"preset": "cluster-paper", "selection": {"budget_tokens": 0.3}})
    spec = tmp_path / "paper.yaml"
    spec.write_text("preset: cluster-paper\nselection:\n  ratio: 1.0\n")
    assert main(["check", str(spec)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["preset"] == "cluster-paper" and printed["selection"]["strategy"] == "equalize"
    assert printed["selection"]["ratio"] == 1.0 and printed["allocation"]["strategy"] == "cluster_per_rank"
