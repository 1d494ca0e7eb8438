"""``ray-cluster-ft features``: data -> features into the feature store only; a later run of the same spec reads
every feature from the store (``counts.features_reused``) and plans what a run without the store plans; a run
with ``clustering.from_run`` reuses that run's cluster map."""

from __future__ import annotations

import contextlib
import io
import json

import pandas as pd
import pytest
import yaml

from tests._pins import FILES_FULL_PINNED, assert_full_pins, files_spec, full_pins


def _cli(*argv):
    from ray_cluster_ft.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def prefetched(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("features")
    spec = files_spec(tiny_model_dir)
    spec["sketch"]["store"] = str(tmp / "store")
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, out, err = _cli("features", str(path), "--output", str(tmp / "nightly"))
    assert code == 0, err
    return tmp, path, out


def test_features_fills_the_store_and_writes_no_plan(prefetched):
    tmp, _, out = prefetched
    m = json.loads((tmp / "nightly" / "manifest.json").read_text())
    c = m["counts"]
    assert m["command"] == "features"
    assert c["features_computed"] == c["candidates"] > 0 and c["features_reused"] == 0
    assert c["read"] == c["accepted"] + c["rejected"] and c["accepted"] == c["candidates"] + c["held_out"]
    key = m["sketch"]["feature_key"]
    parts = list((tmp / "store" / "v1" / key).glob("part-*.parquet"))
    assert len(parts) == m["sketch"]["store_parts_written"] == 1
    assert not (tmp / "nightly" / "plan.parquet").exists() and not (tmp / "nightly" / "clusters.parquet").exists()
    assert f"{c['features_computed']} computed, 0 reused" in out and key in out


@pytest.mark.slow  # two plan-only pipelines: about 45 s on 2 busy cores
def test_a_run_after_the_prefetch_reads_every_feature_and_plans_the_same(prefetched):
    tmp, path, _ = prefetched
    code, _, err = _cli("run", str(path), "--output", str(tmp / "run"), "--plan-only")
    assert code == 0, err
    m = json.loads((tmp / "run" / "manifest.json").read_text())
    assert (m["counts"]["features_computed"], m["counts"]["features_reused"]) == (0, m["counts"]["candidates"])
    assert m["sketch"]["store_parts_read"] == 1
    # The same features as the pinned run without a store: the same clusters, selection and plan.
    assert_full_pins(full_pins(tmp / "run"), FILES_FULL_PINNED)
    assert "Features: 0 computed" in (tmp / "run" / "report.md").read_text()

    # Reusing that run's cluster map: every row keeps its cluster; no rows are new, so no drift.
    spec = yaml.safe_load(path.read_text())
    spec["clustering"]["from_run"] = str(tmp / "run")
    reuse = tmp / "reuse.yaml"
    reuse.write_text(yaml.safe_dump(spec))
    code, _, err = _cli("run", str(reuse), "--output", str(tmp / "run2"), "--plan-only")
    assert code == 0, err
    m2 = json.loads((tmp / "run2" / "manifest.json").read_text())
    fr = m2["clustering"]["from_run"]
    assert fr["drift"]["new_rows"] == 0 and fr["drift"]["suggest_recluster"] is False
    a = pd.read_parquet(tmp / "run" / "clusters.parquet")
    b = pd.read_parquet(tmp / "run2" / "clusters.parquet")
    assert a["example_id"].tolist() == b["example_id"].tolist() and a["cluster"].tolist() == b["cluster"].tolist()
    assert "## Reused cluster map" in (tmp / "run2" / "report.md").read_text()


def test_features_without_a_store_is_a_clear_error(tmp_path, tiny_model_dir):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(files_spec(tiny_model_dir)))
    code, _, err = _cli("features", str(path), "--output", str(tmp_path / "out"))
    assert code == 2 and "set sketch.store" in err
    assert not (tmp_path / "out").exists()
