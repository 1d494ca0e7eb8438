"""The pinned files spec run as a streamed job (``sketch.stream_rows`` below its candidates, float32 shards so the
features are the in-memory run's): the streamed cluster and select stages write the same artifacts as the
in-memory run, and the pinned selection and plan."""

from __future__ import annotations

import json

import pytest
import yaml

from tests._pins import FILES_FULL_PINNED, assert_full_pins, files_spec, full_pins

pytestmark = pytest.mark.slow  # a local Ray and two pipeline runs


def _plan_only(spec: dict, tmp_path, name: str):
    from ray_cluster_ft.cli import main

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / name
    assert main(["run", str(path), "--output", str(out), "--plan-only"]) == 0
    return out


def test_a_streamed_run_of_the_files_spec_writes_the_in_memory_artifacts(tmp_path):
    from ray_cluster_ft.model import make_tiny_model

    spec = files_spec(make_tiny_model(tmp_path / "tiny"))
    memory = _plan_only(spec, tmp_path, "memory")
    spec["sketch"].update(stream_rows=10, shard_dtype="float32")
    streamed = _plan_only(spec, tmp_path, "streamed")
    manifest = json.loads((streamed / "manifest.json").read_text())
    assert manifest["clustering"]["streamed"] is True and manifest["sketch"]["streamed"] is True
    assert "streamed" not in json.loads((memory / "manifest.json").read_text())["clustering"]
    got = full_pins(streamed)
    assert got == full_pins(memory)  # every artifact, float columns included, bit for bit
    assert_full_pins({k: got[k] for k in ("selection", "plan")},
                     {k: FILES_FULL_PINNED[k] for k in ("selection", "plan")})
