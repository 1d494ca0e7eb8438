"""Cluster launcher configs validate against the autoscaler schema shipped inside the ray package."""

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "cluster_configs").glob("*.yaml"))
SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_launcher_config_matches_schema(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, SCHEMA)
    gpu = [t for t in cfg["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu and all(t["min_workers"] == 0 and t["max_workers"] >= 1 for t in gpu)
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])


def test_schema_rejects_a_broken_config():
    cfg = yaml.safe_load(CONFIGS[0].read_text())
    cfg["available_node_types"]["gpu_worker"]["min_workers"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, SCHEMA)


def test_dockerfile_base_matches_pinned_ray():
    root = Path(__file__).resolve().parents[1]
    text = (root / "docker" / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray.__version__}" in text
    assert f'"ray[default,train,data]=={ray.__version__}"' in (root / "pyproject.toml").read_text()
