"""The published method end to end (``preset: cluster-paper``) on 120 real rows with the tiny model, plan only:
last-layer features, KMeans with k = world size, every cluster cut to the same count, rank r trains cluster r,
and selection weights that restore each cluster's share; on the run's real last-layer features the labels, rows
per rank and weights equal the independent transcription of the official code (tests/select/
test_published_reference.py), and the manifest and report say what each cluster holds."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from tests._pins import FIXTURE

pytestmark = pytest.mark.slow


def test_cluster_paper_preset_plans_cluster_per_rank_with_share_weights(tmp_path, tiny_model_dir):
    from ray_cluster_ft.cli import main

    spec = tmp_path / "paper.yaml"
    spec.write_text(yaml.safe_dump({
        "preset": "cluster-paper",
        "data": {"paths": [str(FIXTURE)], "max_seq_len": 256, "eval_fraction": 0.1},
        "model": {"path": str(tiny_model_dir)},
        "sketch": {"batch_size": 8, "num_actors": 1},
        "train": {"num_workers": 2, "micro_batch_size": 4, "epochs": 2},
    }))
    out = tmp_path / "run"
    assert main(["run", str(spec), "--output", str(out), "--plan-only"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["preset"] == "cluster-paper"
    assert manifest["sketch"]["normalisation"] == "l2_rows"  # more than one rank
    assert manifest["clustering"]["algorithm"] == "kmeans" and manifest["clustering"]["k"] == 2

    clusters = pd.read_parquet(out / "clusters.parquet")
    sel = pd.read_parquet(out / "selection.parquet")
    plan = pd.read_parquet(out / "plan.parquet")
    n_c = clusters["cluster"].value_counts().sort_index()
    s_c = sel["cluster"].value_counts().sort_index()
    # every cluster cut to the smallest one's count (the preset's ratio 1.0), not rounded to the micro-batch
    m = min(n_c)
    assert s_c.tolist() == [m, m] and manifest["config"]["selection"]["ratio"] == 1.0
    # w_c = (n_c / N) / (s_c / S): with equal s_c it is K * n_c / N, the published per-rank weight
    want = (n_c / n_c.sum()) / (s_c / s_c.sum())
    np.testing.assert_allclose(sel["weight"].to_numpy(), sel["cluster"].map(want).to_numpy(), rtol=1e-12)
    assert sel["weight"].mean() == pytest.approx(1.0)
    # peripheral: within a cluster, every kept row lies at least as far from its centroid as every dropped row
    # (the smallest cluster is kept whole at ratio 1.0; the larger one drops its nearest rows)
    for c, part in clusters.groupby("cluster"):
        kept = part["example_id"].isin(sel["example_id"])
        assert (~kept).any() == (len(part) > m)
        if (~kept).any():
            assert part.loc[kept, "distance"].min() >= part.loc[~kept, "distance"].max()
    # rank r trains only cluster r, each kept row once per epoch
    assert plan.groupby("rank")["cluster"].unique().map(list).to_dict() == {0: [0], 1: [1]}
    assert (plan.groupby(["epoch", "example_id"]).size() == 1).all()
    assert manifest["plan_metrics"]["cluster_per_rank"]["collisions_per_step"] == 0.0

    # the same selection as the transcription of the official code on this run's real last-layer features
    # (raw g_i from the shards, L2-normalised as its jvp_proxy_normalized does, in candidate order)
    import torch

    from ray_cluster_ft.features import read_sketches
    from tests.select.test_published_reference import reference_selection

    raw = read_sketches(str(out / "sketches"))
    pos = pd.Index(raw["example_id"]).get_indexer(clusters["example_id"])
    x = torch.nn.functional.normalize(torch.from_numpy(raw["sketch"][pos]).float(), dim=1).numpy()
    ref_labels, ref_kept, ref_w, _ = reference_selection(x, 2)
    np.testing.assert_array_equal(clusters["cluster"].to_numpy(), ref_labels)
    ids = clusters["example_id"].to_numpy()
    for r in (0, 1):
        assert set(plan.loc[(plan["rank"] == r) & (plan["epoch"] == 0), "example_id"]) == set(ids[ref_kept[r]])
        np.testing.assert_allclose(sel.set_index("example_id").loc[ids[ref_kept[r]], "weight"], ref_w[r], rtol=1e-12)

    # what each cluster holds: the rows' domain (the fixture's files have one source), sizes, selection, prompts
    prof = manifest["clustering"]
    assert prof["source_field"] == "domain" and 0.0 <= prof["nmi"] <= 1.0
    assert [c["size"] for c in prof["clusters"]] == n_c.tolist()
    assert [c["selected"] for c in prof["clusters"]] == s_c.tolist()
    assert sum(c["weight"] for c in prof["clusters"]) == pytest.approx(len(sel))
    dom = pd.read_parquet(out / "examples.parquet").set_index("example_id").loc[clusters["example_id"], "domain"]
    for c in prof["clusters"]:
        want = dom[clusters["cluster"].to_numpy() == c["cluster"]].value_counts(normalize=True)
        assert c["sources"] == pytest.approx(want.to_dict())
    prompts = [" ".join(json.loads(x)["prompt"].split()) for x in FIXTURE.read_text().splitlines()]
    for c in prof["clusters"]:
        assert len(c["examples"]) == 3
        assert all(any(p.startswith(e.rstrip("…")) for p in prompts) for e in c["examples"])
    report = (out / "report.md").read_text()
    assert "## What each cluster holds" in report and f"{prof['nmi']:.3f}" in report
