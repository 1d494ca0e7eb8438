"""The whole job end to end on a local Ray: tiny model, two DeepSpeed workers (ZeRO-2), real demo data; stopped by
a failure in training and resumed from its checkpoint, as a user continues a stopped run."""

import json
from pathlib import Path

import pandas as pd
import pytest

from ray_cluster_ft.config import parse_config
from ray_cluster_ft.pipeline import run_pipeline
from ray_cluster_ft.train import verify_trained

pytestmark = pytest.mark.slow


def _config(tiny_model_dir, out):
    return parse_config({
        "data": {"source": "demo", "limit": 24, "max_seq_len": 256, "eval_fraction": 0.15, "max_eval": 8},
        "model": {"path": str(tiny_model_dir)},
        "sketch": {"last_blocks": 1, "k_in": 4, "k_out": 4, "dim": 32, "batch_size": 8},
        "clustering": {"k": 3},
        "selection": {"strategy": "balanced", "budget": 0.5},
        "allocation": {"strategy": "cluster"},
        "train": {"num_workers": 2, "zero_stage": 2, "micro_batch_size": 2, "grad_accum": 1, "epochs": 2,
                  "lr": 1e-3, "checkpoint_every": 2, "max_failures": 0},
        "evaluation": {"paths": [str(EVAL_FILE)], "max_new_tokens": 16},
        "output": {"dir": str(out)},
    })


EVAL_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "mbpp_test_6.jsonl"  # MBPP test-split tasks, with their tests


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """The job of this module, stopped and resumed as a user does: its training dies at step 3 (no restarts allowed,
    so the driver exits, and stops the Ray it started), then ``ray-cluster-ft run --resume RUN_DIR`` continues it
    from the step-2 checkpoint to the end. Returns ``(run dir, manifest, the train log's lines when it stopped)``.
    The tests below check the finished run as any run: a resumed run must leave what an uninterrupted one does."""
    import ray

    from ray_cluster_ft.cli import main

    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_CLUSTER_FT_FAIL_AT_STEP", "3")
        with pytest.raises(Exception, match="injected failure at step 3"):
            run_pipeline(_config(tiny_model_dir, out))
    assert not ray.is_initialized()
    assert not (out / "manifest.json").exists() and (out / "config.yaml").exists()
    stopped_log = (out / "train_log.jsonl").read_text().splitlines()
    assert main(["run", "--resume", str(out)]) == 0
    return out, json.loads((out / "manifest.json").read_text()), stopped_log


def test_artifacts_written(run):
    out, manifest, _ = run
    for name in ("examples.parquet", "eval_examples.parquet", "rejected.jsonl", "clusters.parquet",
                 "selection.parquet", "plan.parquet", "trained.parquet", "manifest.json", "report.md"):
        assert (out / name).is_file(), name
    assert list((out / "sketches").glob("*.parquet"))
    assert json.loads((out / "manifest.json").read_text())["counts"] == manifest["counts"]
    assert set(manifest["timings_s"]) >= {"data", "sketch", "cluster", "select", "allocate", "train", "total"}


def test_counts_add_up(run):
    _, m, _ = run
    c = m["counts"]
    assert c["read"] == 48
    assert c["read"] == c["accepted"] + c["rejected"]
    assert c["accepted"] == c["selected"] + c["not_selected"]
    assert c["trained"] == c["selected"] > 0
    assert m["checks"]["matches_plan"] and m["checks"]["once_per_epoch"]
    assert sum(1 for _ in open(m["run_dir"] + "/rejected.jsonl")) == c["rejected"]


def test_each_rank_trained_its_plan_in_order(run):
    out, _, _ = run
    plan = pd.read_parquet(out / "plan.parquet")
    trained = pd.read_parquet(out / "trained.parquet")
    assert sorted(plan["rank"].unique()) == [0, 1]
    for r in (0, 1):
        p = plan[plan["rank"] == r]
        t = trained[trained["rank"] == r]
        assert list(t["example_id"]) == list(p["example_id"])
        assert list(t["epoch"]) == list(p["epoch"]) and list(t["step"]) == list(p["step"])
    # each planned example exactly once per epoch, and the two ranks never share one
    assert trained.groupby("epoch")["example_id"].apply(lambda s: s.is_unique).all()
    assert set(plan["example_id"]) == set(pd.read_parquet(out / "selection.parquet")["example_id"])


def test_final_model_loads_and_eval_ran(run):
    from transformers import AutoModelForCausalLM

    out, m, _ = run
    model = AutoModelForCausalLM.from_pretrained(m["train"]["final_model"])
    assert model.config.num_hidden_layers == 2
    assert set(m["eval"]["before"]) == set(m["eval"]["after"]) >= {"all"}
    # The report shows every score the manifest has: loss per domain, and MC accuracy / pass@1 where scored.
    report = (out / "report.md").read_text()
    assert "## Held-out loss" in report
    scored = [k for k in ("mc_accuracy", "pass_at_1") if k in m["eval"]["before"]["all"]]
    assert scored, "the demo rows held out include MMLU items or HumanEval problems"
    assert "## Held-out task scores" in report
    labels = {"mc_accuracy": "multiple-choice accuracy", "pass_at_1": "pass@1"}
    for key in scored:
        assert f"| all | {labels[key]} |" in report
    assert f"{m['plan_metrics']['cluster']['critical_path_tokens']:,.0f}" in report
    # One record per scored task, before and after, beside the scores.
    for when in ("before", "after"):
        recs = [json.loads(x) for x in (out / f"eval_{when}_samples.jsonl").read_text().splitlines()]
        allv = m["eval"][when]["all"]
        assert len(recs) == allv.get("mc_items", 0) + allv.get("code_problems", 0)
        assert sum(r["status"] == "passed" for r in recs if r["kind"] == "code") == \
            round(allv.get("pass_at_1", 0) * allv.get("code_problems", 0))


def test_extra_eval_files_are_scored_and_never_trained(run):
    out, m, _ = run
    f = m["eval_files"][str(EVAL_FILE)]
    assert (f["read"], f["scored"], f["rejected"], f["overlap_with_candidates"]) == (6, 6, 0, 0)
    for when in ("before", "after"):
        allv = f[when]["all"]
        assert allv["examples"] == 6 and allv["loss"] > 0 and allv["code_problems"] == 6
        recs = [json.loads(x) for x in (out / f"eval_{when}_file0_samples.jsonl").read_text().splitlines()]
        assert len(recs) == 6 and {r["kind"] for r in recs} == {"code"}
    assert f["before"]["all"]["loss"] != f["after"]["all"]["loss"]
    # none of its rows reached the candidates (so no sketch, selection or plan)
    from ray_cluster_ft.data import canonicalize, example_id

    eval_ids = {example_id(canonicalize(json.loads(x))) for x in EVAL_FILE.read_text().splitlines()}
    assert len(eval_ids) == 6
    assert not eval_ids & set(pd.read_parquet(out / "examples.parquet")["example_id"])
    assert not eval_ids & set(pd.read_parquet(out / "plan.parquet")["example_id"])
    assert "## Extra held-out files (`evaluation.paths`)" in (out / "report.md").read_text()
    assert "| mbpp_test_6.jsonl | 6 | 0 | 0 |" in (out / "report.md").read_text()


def test_verify_trained_catches_a_swap():
    plan = pd.DataFrame({"rank": [0, 0, 1, 1], "epoch": 0, "step": [0, 1, 0, 1], "micro_index": 0,
                         "example_id": ["a", "b", "c", "d"]})
    assert verify_trained(plan, plan.copy())["matches_plan"]
    swapped = plan.copy()
    swapped.loc[[0, 1], "example_id"] = ["b", "a"]
    res = verify_trained(plan, swapped)
    assert not res["matches_plan"] and res["mismatched_ranks"] == [0] and res["once_per_epoch"]
    repeated = plan.copy()
    repeated.loc[1, "example_id"] = "a"
    assert not verify_trained(plan, repeated)["once_per_epoch"]


def test_plan_only_rerun_gives_identical_selection_and_plan(run, tmp_path, tiny_model_dir):
    out, manifest, _ = run
    m = run_pipeline(_config(tiny_model_dir, tmp_path), plan_only=True)
    assert m["train"] is None and m["counts"]["trained"] == 0 and not (tmp_path / "trained.parquet").exists()
    for name in ("selection.parquet", "plan.parquet", "clusters.parquet"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    # allocation.pad_tolerance reaches the plan: the plan equals make_plan's on the run's own inputs.
    from ray_cluster_ft.allocate import make_plan

    cfg = _config(tiny_model_dir, tmp_path)
    cfg.allocation.packing = False  # pad_tolerance shapes the padded plan (packs sized to the data ignore it)
    cfg.allocation.pad_tolerance = 1.0
    pure = run_pipeline(cfg, plan_only=True)
    assert pure["config"]["allocation"]["pad_tolerance"] == 1.0
    sel = pd.read_parquet(tmp_path / "selection.parquet")
    examples = pd.read_parquet(tmp_path / "examples.parquet", columns=["example_id", "n_tokens"])
    n_tok = examples.set_index("example_id").loc[sel["example_id"], "n_tokens"].to_numpy()
    t = cfg.train
    ref = make_plan(sel["example_id"].to_numpy(), sel["cluster"].to_numpy(), n_tok, t.num_workers,
                    t.micro_batch_size, t.grad_accum, t.epochs, seed=cfg.allocation.seed, pad_tolerance=1.0).plan
    got = pd.read_parquet(tmp_path / "plan.parquet")
    pd.testing.assert_frame_equal(got.reset_index(drop=True), ref.reset_index(drop=True), check_dtype=False)
    # The fixture's run has the default (packs sized to the data): make_plan's packed plan of the same rows.
    first = pd.read_parquet(out / "selection.parquet")
    n_first = examples.set_index("example_id").loc[first["example_id"], "n_tokens"].to_numpy()
    ref = make_plan(first["example_id"].to_numpy(), first["cluster"].to_numpy(), n_first, t.num_workers,
                    t.micro_batch_size, t.grad_accum, t.epochs, seed=cfg.allocation.seed, packing=True).plan
    got = pd.read_parquet(out / "plan.parquet")
    pd.testing.assert_frame_equal(got.reset_index(drop=True), ref.reset_index(drop=True), check_dtype=False)
    print("single-cluster fraction, tolerance 0.05 -> 1.0:",
          manifest["plan_metrics"]["cluster"]["single_cluster_fraction"],
          pure["plan_metrics"]["cluster"]["single_cluster_fraction"])


def test_the_stopped_run_resumed_after_its_newest_checkpoint(run):
    """The module's run died at step 3 and was continued with ``run --resume``: it restarted from the step-2
    checkpoint and the trained log still holds every planned example exactly once per epoch, in plan order."""
    out, m, stopped_log = run
    assert len(stopped_log) == 2
    assert m["resumed"] and m["train"]["resumed_from_step"] == 2
    assert m["checks"]["matches_plan"] and m["checks"]["once_per_epoch"]
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert log[:2] == stopped_log and [json.loads(x)["step"] for x in log] == list(range(m["train"]["steps"]))
    plan = pd.read_parquet(out / "plan.parquet")
    trained = pd.read_parquet(out / "trained.parquet")
    assert verify_trained(plan, trained)["matches_plan"]


def test_resume_refuses_a_changed_plan_and_a_missing_run(run, tmp_path, capsys):
    import shutil

    from ray_cluster_ft.cli import main

    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert f"--resume {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert main(["run", "--resume", str(tmp_path / "a_file")]) == 2
    assert "a_file: a file, not a run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["run", "--resume", str(tmp_path / "empty")]) == 2
    assert "empty: no config.yaml there (not a ray-cluster-ft run directory)" in capsys.readouterr().err
    out = tmp_path / "run"
    shutil.copytree(run[0], out, ignore=shutil.ignore_patterns("ray_train", "final_model", "trained*"))
    spec = (out / "config.yaml").read_text()
    assert "budget: 0.5" in spec
    (out / "config.yaml").write_text(spec.replace("budget: 0.5", "budget: 0.4"))
    assert main(["run", "--resume", str(out)]) == 2
    assert "the plan computed now differs" in capsys.readouterr().err
    assert not (out / "trained.parquet").exists()


