"""The ``--plan-only`` and ``select`` artifacts of two fixed specs are pinned (the pins and why they hold:
tests/_pins.py): a reorganisation of the code must leave them byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests._pins import (
    DEMO_FULL_PINNED,
    FILES_FULL_PINNED,
    FULL_ARTIFACTS,
    SELECTED,
    assert_full_pins,
    files_spec,
    full_pins,
)


def _plan_only(spec: Path, out: Path, command: str = "run") -> Path:
    from ray_cluster_ft.cli import main

    argv = ["run", str(spec), "--output", str(out), "--plan-only"] if command == "run" else \
        ["select", str(spec), "--output", str(out)]
    assert main(argv) == 0
    return out


def test_plan_only_artifacts_of_a_files_spec_are_pinned(tmp_path):
    from ray_cluster_ft.model import make_tiny_model

    # The same tiny model as at the pin (make_tiny_model's defaults are seeded).
    model = make_tiny_model(tmp_path / "tiny")
    spec = tmp_path / "files.yaml"
    spec.write_text(yaml.safe_dump(files_spec(model)))
    assert_full_pins(full_pins(_plan_only(spec, tmp_path / "run")), FILES_FULL_PINNED)


@pytest.mark.slow
def test_plan_only_artifacts_of_the_demo_spec_are_pinned(tmp_path):
    demo = Path(__file__).resolve().parents[2] / "jobs" / "demo.yaml"
    out = tmp_path / "run"
    assert_full_pins(full_pins(_plan_only(demo, out, command="select"), FULL_ARTIFACTS + SELECTED), DEMO_FULL_PINNED)
