"""bench/end_to_end.py, the quality benchmark: its pools, every arm's config, the run order, the figures read
from a manifest and the summary's keys (the issue's exact names); and one real quick run (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from bench._common import shared_data_dir
from ray_cluster_ft.config import parse_config

BENCH = Path(__file__).resolve().parents[2] / "bench" / "end_to_end.py"
needs_data = pytest.mark.skipif(shared_data_dir() is None, reason="the shared data folder is absent")


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("bench_quality", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


@needs_data
def test_pools_keep_the_natural_proportions_and_the_held_out_files_apart(e2e, tmp_path):
    pools, held = e2e.write_pools(tmp_path, 600, 8)
    sizes = {name: [len(_rows(p)) for p in paths] for name, paths in pools.items()}
    assert sizes == {"natural": [449, 124, 27], "balanced": [200, 200, 200]}  # medquad, gpteacher, mbpp
    assert [Path(p).stem for p in held] == ["mbpp_test", "humaneval", "mmlu_medical", "medquad_heldout"]
    assert all(len(_rows(p)) == 8 for p in held)
    assert not any(r.get("split") == "test" for p in pools["natural"] for r in _rows(p) if "split" in r)
    pool_qa = {(r["question"], r["answer"]) for name in pools for r in _rows(pools[name][0])}
    assert not pool_qa & {(r["question"], r["answer"]) for r in _rows(held[3])}
    # MedQuAD by whole documents: the natural pool's draw holds the balanced one's (the same document order).
    nat = {(r["question"], r["answer"]) for r in _rows(pools["natural"][0])}
    assert {(r["question"], r["answer"]) for r in _rows(pools["balanced"][0])} <= nat


def test_every_arm_parses_and_differs_only_in_its_keys(e2e, tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path)])
    cfgs = {arm: parse_config(e2e.arm_config(arm, args, "natural", 1, ["a.jsonl"], ["e.jsonl"], tmp_path / arm,
                                            e2e._budget_of(arm, {"rows": 180, "tokens_per_epoch": 31000})))
            for arm in e2e.ARMS}
    assert cfgs["ours"].selection.budget == 0.31 and cfgs["ours"].clustering.seed == 1
    assert cfgs["random_subset"].selection.strategy == "random" and cfgs["random_subset"].selection.budget == 180
    assert cfgs["random_tokens"].selection.budget_tokens == 31000  # it replaces budget
    assert cfgs["full"].selection.strategy == "full"
    assert cfgs["paper"].preset == "cluster-paper" and cfgs["paper"].clustering.seed != 1  # the preset's seed
    ours_cfg = cfgs["ours"]  # the package's defaults since issue 31
    assert (ours_cfg.sketch.method, ours_cfg.selection.groups, ours_cfg.selection.within,
            ours_cfg.train.loss_weighting) == ("embedding", "auto", "random", "none")
    old = cfgs["old_defaults"]
    assert (old.sketch.method, old.selection.groups, old.selection.within, old.train.loss_weighting) == \
        ("sketch", None, "kcenter", "cluster")
    ours = ours_cfg.model_dump()
    for arm in ("sketch", "hidden_mean", "within_kcenter", "max_tokens_128", "flat", "sqrt_quotas", "weighted"):
        diff = {(s, k) for s, sec in cfgs[arm].model_dump().items() if isinstance(sec, dict)
                for k, v in sec.items() if ours[s][k] != v and not (s == "output" and k == "dir")}
        # hidden_mean brings its pooling
        assert len(diff) == 1 or (arm == "hidden_mean" and diff == {("sketch", "method"), ("sketch", "pooling")}), \
            (arm, diff)
    for cfg in cfgs.values():  # every arm scores each epoch on the same files, features in one store
        assert cfg.evaluation.every_epoch and cfg.evaluation.paths == ["e.jsonl"]
        assert cfg.sketch.store == str(tmp_path / "natural" / "features") and cfg.sketch.seed == 0


def test_the_schedule_runs_ours_first_full_once_and_the_frontier_last(e2e):
    args = e2e.parse_args(["--seeds", "0", "1", "2"])
    order = e2e.schedule(args)
    for pool in ("natural", "balanced"):
        for seed in (0, 1, 2):
            arms = [a for p, s, a in order if (p, s) == (pool, seed) and a in e2e.HEADLINE]
            assert arms[0] == "ours" and ("full" in arms) == (seed == 0)
    runs = Counter(a for p, s, a in order if a in e2e.ABLATIONS)
    assert runs["within_kcenter"] == runs["hidden_mean"] == 2  # --ablation-seeds 2
    assert "embedding" not in runs  # the default's own keys: it would repeat ours
    assert [a for _, _, a in order[-4:]] == ["ours@0.2", "random_subset@0.2", "ours@0.5", "random_subset@0.5"]


def test_the_random_arms_take_the_counts_ours_trained_on_their_seed_and_budget(e2e, tmp_path, monkeypatch):
    """``_run_schedule`` hands each random arm the rows (``random_subset``) or tokens (``random_tokens``) that
    ``ours`` trained on the same pool, seed and budget, and skips it where ``ours`` has no figures."""
    ran = []

    def fake_arm(arm, raw, out, pool, seed, evaluator_for, only_cached, what=""):
        ran.append((pool, seed, arm, raw["selection"]))
        if arm.startswith("ours") and (pool, seed) != ("natural", 1):  # natural seed 1: ours failed
            budget, other = (0.2 if arm == "ours@0.2" else 0.31), pool == "balanced"
            return {"rows": int(1000 * budget) + seed + 500 * other,
                    "tokens_per_epoch": 10_000 * (seed + 1) + int(100 * budget) + 5_000 * other}
        return None if arm.startswith("ours") else {"macro_loss": 1.0}

    monkeypatch.setattr(e2e, "cached_arm", fake_arm)
    monkeypatch.setattr(e2e, "write_results", lambda args, results: None)
    args = e2e.parse_args(["--out", str(tmp_path), "--seeds", "0", "1", "--arms", "ours", "random_subset",
                           "random_tokens", "--pools", "natural", "balanced"])
    args.frontier, args.ablation_seeds = True, 0
    monkeypatch.setattr(e2e, "FRONTIER_BUDGETS", (0.2,))
    results: dict = {}
    e2e._run_schedule(args, tmp_path, {"natural": ["n.jsonl"], "balanced": ["b.jsonl"]}, ["e.jsonl"], results,
                      None)
    sel = {(p, s, a): x for p, s, a, x in ran}
    assert sel[("natural", 0, "random_subset")]["budget"] == 310
    assert sel[("natural", 0, "random_tokens")]["budget_tokens"] == 10_031 and "budget" not in \
        sel[("natural", 0, "random_tokens")]
    assert sel[("balanced", 0, "random_subset")]["budget"] == 810  # its own pool and seed
    assert sel[("balanced", 1, "random_subset")]["budget"] == 811
    assert sel[("balanced", 1, "random_tokens")]["budget_tokens"] == 25_031
    assert ("natural", 1, "random_subset") not in sel and ("natural", 1, "random_tokens") not in sel
    assert sel[("natural", 0, "ours@0.2")]["budget"] == 0.2
    assert sel[("natural", 0, "random_subset@0.2")]["budget"] == 200
    assert results["natural"][0]["random_subset"] == {"macro_loss": 1.0}


def test_ours_can_be_a_candidate_default_written_as_keys(e2e, tmp_path):
    """--ours NAME: ``ours`` runs NAME's keys (the random arms then take its counts), the ablation NAME is not run
    twice, ``defaults`` keeps the package's own defaults, and the summary names the keys."""
    args = e2e.parse_args(["--out", str(tmp_path), "--ours", "old_defaults", "--seeds", "0", "1"])
    cfg = parse_config(e2e.arm_config("ours", args, "natural", 0, ["a.jsonl"], ["e.jsonl"], tmp_path / "o"))
    assert cfg.sketch.method == "sketch" and cfg.selection.within == "kcenter" and cfg.selection.groups is None
    plain = parse_config(e2e.arm_config("defaults", args, "natural", 0, ["a.jsonl"], ["e.jsonl"], tmp_path / "d"))
    assert plain.sketch.method == parse_config({"data": {"source": "demo"}}).sketch.method == "embedding"
    arms = [a for _, _, a in e2e.schedule(args)]
    assert "old_defaults" not in arms and arms.count("defaults") == 2
    doc = e2e.summarise(args, {})
    assert doc["ours"] == "old_defaults" and doc["defaults"] == e2e.ARMS["old_defaults"][1]
    # Without --ours, ``defaults`` is ours itself and does not run.
    assert "defaults" not in [a for _, _, a in e2e.schedule(e2e.parse_args([]))]


def _manifest(macro: list[float]) -> dict:
    return {"eval_epochs": [{"epoch": e + 1, "macro_loss": m, "token_loss": m + 0.1,
                             "files": {"/x/mbpp_test.jsonl": {"all": {"loss": m - 0.2}}}} for e, m in enumerate(macro)],
            "eval_files": {"/x/mbpp_test.jsonl": {"before": {"all": {"loss": 2.0}}}}}


def test_a_frontier_point_with_a_note_is_marked_on_the_plot(e2e, tmp_path):
    doc = {"frontier": {"ours": [{"budget": 0.2, "macro_loss": 1.2, "e2e_s": 300.0},
                                 {"budget": 0.4, "macro_loss": 1.15, "e2e_s": 700.0}],
                        "full": {"macro_loss": 1.1, "e2e_s": 1500.0}}}
    e2e.plot_frontier(doc, tmp_path / "plain.png")
    doc["frontier"]["ours"][1]["note"] = "timed beside other work"
    e2e.plot_frontier(doc, tmp_path / "noted.png")
    plain, noted = (tmp_path / "plain.png").read_bytes(), (tmp_path / "noted.png").read_bytes()
    assert len(plain) > 1000 and noted != plain


def test_the_best_epoch_is_the_headline_and_the_last_is_beside_it(e2e):
    f = e2e.epoch_figures(_manifest([1.3, 1.1, 1.2]))
    assert (f["macro_loss"], f["best_epoch"], f["macro_loss_last"], f["token_loss"]) == (1.1, 2, 1.2, 1.1 + 0.1)
    assert f["files_by_epoch"][0] == {"mbpp_test": pytest.approx(1.1)} and f["files_before"] == {"mbpp_test": 2.0}
    with pytest.raises(RuntimeError, match="eval_epochs"):
        e2e.epoch_figures({"eval_epochs": []})


def test_the_summary_has_the_issue_keys(e2e, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 2.0, 3.0))
    args = e2e.parse_args(["--seeds", "0", "1", "--out", str(tmp_path), "--results", str(tmp_path / "q.json")])
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 8.0, 7.0))  # the arms ran: the file is written now

    def fig(m, e2e_s):
        return {"macro_loss": m, "macro_loss_last": m + 0.01, "token_loss": m, "best_epoch": 1, "selection_s": 5.0,
                "train_s": e2e_s - 5.0, "e2e_s": e2e_s, "rows": 10, "tokens_per_epoch": 100, "candidates": 600}

    results = {"natural": {0: {"ours": fig(1.0, 50), "random_subset": fig(1.1, 45), "full": fig(0.9, 150),
                               "ours@0.2": fig(1.05, 30), "random_subset@0.2": fig(1.2, 28)},
                           1: {"ours": fig(1.02, 52), "random_subset": fig(1.08, 44)}}}
    doc = e2e.write_results(args, results)
    nat = doc["pools"]["natural"]
    assert {"candidates", "seeds", "epochs", "full_train_s", "arms"} <= set(nat) and nat["full_train_s"] == 145.0
    assert nat["arms"]["ours"]["macro_loss"] == [1.0, 1.02] and nat["arms"]["full"]["macro_loss"] == [0.9]
    assert {"macro_loss", "macro_loss_last", "token_loss", "selection_s", "train_s", "e2e_s"} <= \
        set(nat["arms"]["random_subset"])
    assert [p["budget"] for p in doc["frontier"]["ours"]] == [0.2, 0.31]
    assert doc["frontier"]["full"] == {"macro_loss": 0.9, "e2e_s": 150}
    assert "defaults" in doc and doc["machine"]["commit"]
    assert doc["machine"]["load_before"] == "1.00 2.00 3.00"  # the start's, not the last arm's load after
    cached = e2e.parse_args(["--only-cached", "--out", str(tmp_path), "--results", str(tmp_path / "c.json")])
    assert e2e.summarise(cached, results)["machine"]["load_before"] is None  # it ran nothing: no start load
    assert json.loads((tmp_path / "q.json").read_text())["pools"]["natural"]["arms"]["ours"]["e2e_s"] == [50, 52]
    assert (tmp_path / "frontier.png").stat().st_size > 1000


@pytest.mark.slow
@needs_data
def test_a_quick_run_scores_every_epoch_and_resumes(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    argv = [sys.executable, str(BENCH), "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path),
            "--pools", "natural", "--arms", "ours", "--no-frontier"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=BENCH.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "quality.json").read_text())
    arms = doc["pools"]["natural"]["arms"]
    assert len(arms["ours"]["macro_by_epoch"][0]) == 2  # both epochs scored
    assert arms["ours"]["selection_s"][0] > 0 and arms["ours"]["rows"][0] > 0
    # One arm: the random arms' counts are checked without training (the test above); the second arm cost this
    # test 45 CPU-s (115.8 against 70.3, measured 2026-12-07).
    # A second call finds the arm kept and runs nothing: not even a Ray start.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1])
    assert again.returncode == 0 and "=====" not in again.stdout + again.stderr
    assert "Started a local Ray instance" in done.stderr and "Started a local Ray instance" not in again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["natural.ours.macro_loss"] == \
        pytest.approx(arms["ours"]["macro_loss"][0], abs=1e-4)


def test_the_base_models_scores_outlive_the_process_and_trained_ones_do_not(e2e, tmp_path, monkeypatch):
    """A resumed benchmark reads the base model's held-out scores from ``base_eval.pkl`` instead of scoring it
    again; a trained model (an epoch or the final model) is scored every time."""
    import types

    import pyarrow as pa
    import ray

    import ray_cluster_ft.model

    calls = []

    def remote(fn):
        def run(*a, **k):
            calls.append(a[0])
            return {"loss": float(len(calls))}
        return types.SimpleNamespace(options=lambda **_: types.SimpleNamespace(remote=run))

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda x: x)
    monkeypatch.setattr(ray_cluster_ft.model, "load_tokenizer", lambda *a: types.SimpleNamespace(pad_token_id=0))
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(path="m", trust_remote_code=False))
    table = pa.table({"example_id": ["a", "b"]})
    store = tmp_path / "base_eval.pkl"
    first = e2e.make_evaluator({}, 1, store)(cfg)
    assert first("/c/base", table, None) == {"loss": 1.0}
    again = e2e.make_evaluator({}, 1, store)(cfg)  # a new process: an empty memo, the same store
    assert again("/c/base", table, None) == {"loss": 1.0} and calls == ["/c/base"]
    assert again("/c/base", pa.table({"example_id": ["a"]}), None) == {"loss": 2.0}  # other rows: scored
    assert again("/r/epochs/1", table, None) == {"loss": 3.0}
    assert again("/r/epochs/1", table, None) == {"loss": 4.0}  # trained models are never memoised


def test_bf16_reaches_training_and_features_and_fp32_neither(e2e, tmp_path):
    for precision, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        args = e2e.parse_args(["--out", str(tmp_path), "--precision", precision])
        cfg = parse_config(e2e.arm_config("ours", args, "natural", 0, ["a.jsonl"], ["e.jsonl"], tmp_path / "o"))
        assert (cfg.train.precision, cfg.sketch.dtype) == (precision, dtype)
        assert e2e.summarise(args, {})["settings"]["precision"] == precision


def test_the_schedule_waits_while_the_pause_file_exists(e2e, tmp_path):
    import threading
    (tmp_path / "PAUSE").touch()
    threading.Timer(0.3, (tmp_path / "PAUSE").unlink).start()
    t = time.monotonic()
    e2e.wait_while_paused(tmp_path, poll_s=0.05)
    assert 0.25 < time.monotonic() - t < 5 and not (tmp_path / "PAUSE").exists()
    t = time.monotonic()
    e2e.wait_while_paused(tmp_path, poll_s=10)  # no file: returns at once
    assert time.monotonic() - t < 1


def test_merging_adds_what_ran_to_published_figures_and_refuses_to_replace_or_mix(e2e, tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--results", str(tmp_path / "q.json"), "--no-frontier"])

    def fig(m, train_s=10.0):
        return {"macro_loss": m, "macro_loss_last": m, "token_loss": m, "best_epoch": 1, "selection_s": 5.0,
                "train_s": train_s, "e2e_s": train_s + 5.0, "rows": 10, "tokens_per_epoch": 100, "candidates": 600,
                "load_after": f"{m:.2f} 2.00 3.00"}

    published = e2e.write_results(args, {"natural": {0: {"ours": fig(1.0)}, 1: {"ours": fig(1.1)}},
                                         "balanced": {0: {"ours": fig(1.5)}}})
    published["pools"]["natural"]["arms"]["ours"]["note"] = "kept as it was"
    (tmp_path / "q.json").write_text(json.dumps(published))
    assert published["pools"]["natural"]["arms"]["ours"]["seeds"] == [0, 1, 2]  # the summary lists every seed

    # Seeds 0 and 1 of a new arm, seed 2 of a published one, and a pool's full data.
    new = e2e.summarise(args, {"natural": {0: {"sketch": fig(1.2)}, 1: {"sketch": fig(1.3)}, 2: {"ours": fig(1.05)}},
                               "balanced": {0: {"full": fig(0.9, train_s=145.0)}}})
    merged = e2e.merge_into(tmp_path / "q.json", new, "python bench/end_to_end.py --only-cached")
    assert merged == json.loads((tmp_path / "q.json").read_text())
    nat, bal = merged["pools"]["natural"], merged["pools"]["balanced"]
    sketch = nat["arms"]["sketch"]
    assert (sketch["seeds"], sketch["macro_loss"], sketch["load_after"]) == ([0, 1], [1.2, 1.3], ["1.20 2.00 3.00",
                                                                                                 "1.30 2.00 3.00"])
    assert sketch["commits"] == [new["machine"]["commit"]] * 2
    ours = nat["arms"]["ours"]
    assert (ours["seeds"], ours["macro_loss"], ours["note"]) == ([0, 1, 2], [1.0, 1.1, 1.05], "kept as it was")
    assert ours["commits"] == [None, None, new["machine"]["commit"]]  # the published seeds had none
    assert bal["arms"]["full"]["macro_loss"] == [0.9] and bal["full_train_s"] == 145.0
    assert bal["arms"]["ours"] == published["pools"]["balanced"]["arms"]["ours"]
    assert merged["merges"][-1]["arms"] == ["natural ours (seeds 2)", "natural sketch (seeds 0, 1)",
                                            "balanced full (seeds 0)"]
    assert merged["merges"][-1]["machine"]["cpus"] == new["machine"]["cpus"]

    before = (tmp_path / "q.json").read_text()
    refused = {
        "are in .* already": new,  # any seed again
        "settings differ": e2e.summarise(e2e.parse_args(["--out", str(tmp_path), "--lr", "3e-4"]),
                                         {"natural": {0: {"flat": fig(1.0)}}}),
        "ours is": e2e.summarise(e2e.parse_args(["--out", str(tmp_path), "--ours", "sqrt_quotas", "--no-frontier"]),
                                 {"balanced": {1: {"random_tokens": fig(1.6)}}}),
        "frontier": e2e.summarise(args, {"natural": {0: {"ours@0.2": fig(1.3), "flat": fig(1.4)}}}),
        "nothing to merge": e2e.summarise(args, {"natural": {1: {"ours": fig(1.2)}}}),  # skipped below
    }
    for match, doc in refused.items():
        with pytest.raises(ValueError, match=match):
            e2e.merge_into(tmp_path / "q.json", doc, "refused", skip=("ours",) if match.startswith("nothing") else ())
    assert (tmp_path / "q.json").read_text() == before  # a refused merge writes nothing

    # ours run again only for the random arms' counts: recorded, not merged; a skipped full brings no full_train_s.
    rerun = e2e.summarise(args, {"balanced": {1: {"ours": fig(1.51), "random_tokens": fig(1.6)}},
                                 "natural": {0: {"full": fig(0.7, train_s=999.0), "flat": fig(1.4)}}})
    merged = e2e.merge_into(tmp_path / "q.json", rerun, "again", skip=("ours", "full"))
    assert merged["pools"]["balanced"]["arms"]["ours"] == published["pools"]["balanced"]["arms"]["ours"]
    assert merged["pools"]["balanced"]["arms"]["random_tokens"]["macro_loss"] == [1.6]
    assert "full" not in merged["pools"]["natural"]["arms"] and merged["pools"]["natural"]["full_train_s"] is None
    assert merged["pools"]["natural"]["arms"]["flat"]["macro_loss"] == [1.4]
    assert merged["merges"][-1]["not_merged"] == {"balanced ours": [None, 1.51, None], "natural full": [0.7]}
    for argv in (["--merge-into", "q.json"], ["--only-cached", "--merge-skip", "ours"]):
        with pytest.raises(SystemExit):  # only a finished run's kept arms; skipping is for merging
            e2e.parse_args(argv)
