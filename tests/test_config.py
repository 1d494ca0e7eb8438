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

    jobs = Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml"
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
    with pytest.raises(ConfigError, match=r"num_workers=2 x train.micro_batch_size=4 .* only 6"):
        check_against_data(cfg, 20)  # round(0.31 * 20) = 6 < 8
    with pytest.raises(ConfigError, match="selection.budget=500 is above the 100"):
        check_against_data(parse_config({"selection": {"budget": 500}}), 100)
    with pytest.raises(ConfigError, match="clustering.k=101 is above the 100"):
        check_against_data(parse_config({"clustering": {"k": 101}}), 100)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"selection": {"budget": float("inf")}}, "selection.budget"),
        ({"train": {"lr": float("nan")}}, "train.lr"),
        ({"selection": {"budget": True}}, "not a boolean"),
        ({"clustering": {"k": True}}, "not a boolean"),
    ],
)
def test_non_finite_and_boolean_numbers_are_refused(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)
