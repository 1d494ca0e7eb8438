"""The examples/ scripts, each run as a user would (``python`` or ``torchrun``, from a fresh directory) against a real
``ray-cluster-ft select`` output folder made with a tiny model. For the HF, TRL and torch ones every forward is
recorded (tests/examples/_capture.py): each rank must have fed the model exactly its planned rows' tokens in plan
order, and every step's loss must equal an independent token-exact weighted loss computed here from the captured
logits (plain cross-entropy per row, the plan's weights from selection.parquet; none of the package's loss code)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CAPTURE = Path(__file__).with_name("_capture.py")
FIXTURE = ROOT / "tests" / "fixtures" / "mixed_120.jsonl"


@pytest.fixture(scope="module")
def sel(tmp_path_factory, tiny_model_dir):
    """``select`` on 24 real rows: W = 2, B = 2, G = 1, one epoch, the default (packed) cluster plan."""
    from ray_cluster_ft.cli import main

    tmp = tmp_path_factory.mktemp("sel")
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(FIXTURE.read_text(encoding="utf-8").splitlines(keepends=True)[:24]), encoding="utf-8")
    spec = {"data": {"source": "files", "paths": [str(rows)], "max_seq_len": 512, "overlong": "truncate",
                     "eval_fraction": 0.0},
            "model": {"path": str(tiny_model_dir)},
            "sketch": {"batch_size": 8, "k_in": 8, "k_out": 8, "dim": 32, "num_actors": 1},
            "clustering": {"k": 2}, "selection": {"budget": 16},
            "train": {"num_workers": 2, "micro_batch_size": 2, "epochs": 1}}
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["select", str(tmp / "job.yaml"), "--output", str(tmp / "run")]) == 0
    # These few rows select evenly (every weight 1): spread the weights so that a loss ignoring them fails.
    sel = pd.read_parquet(tmp / "run" / "selection.parquet")
    sel.assign(weight=np.linspace(0.5, 2.0, len(sel))).to_parquet(tmp / "run" / "selection.parquet", index=False)
    return tmp / "run"


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}


def _torchrun(script: str, run_dir: Path, model: Path | None, cwd: Path) -> tuple[list[dict], str]:
    """Each rank's capture and the run's stdout. ``model`` None: the script's default, the model the run's
    manifest.json names."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(CAPTURE), str(cwd), str(EXAMPLES / script), str(run_dir)]
    cmd += ["--model", str(model)] if model is not None else []
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(cwd / f"capture_rank{r}.pt", weights_only=False) for r in (0, 1)], proc.stdout


def _micro_batches(plan: pd.DataFrame, rank: int) -> list[list[str]]:
    rows = plan[plan["rank"] == rank].sort_values(["epoch", "step", "micro_index"], kind="stable")
    return [g["example_id"].tolist() for _, g in rows.groupby(["epoch", "step", "micro_index"], sort=False)]


def _row_terms(call: dict, ids: list[str], tokens: dict) -> list[tuple[str, float, int]]:
    """Per planned row of one captured forward: (id, summed next-token CE over its labels, label count), after
    checking that the forward held exactly that row's tokens (padded rows, or one pack in plan order). Logits
    kept at some positions only (``logits_to_keep``) go back to their positions, NaN elsewhere: a label whose
    logits were not computed makes its row's CE NaN."""
    x, logits = call["input_ids"], call["logits"]
    if "logits_to_keep" in call:
        full = torch.full((*x.shape, logits.shape[-1]), float("nan"))
        full[:, call["logits_to_keep"]] = logits
        logits = full
    out = []
    packed = x.shape[0] == 1 and len(ids) > 1
    offset = 0
    for k, eid in enumerate(ids):
        want_x = torch.tensor(tokens[eid][0], dtype=torch.int64)
        y = torch.tensor(tokens[eid][1], dtype=torch.int64)
        n = len(want_x)
        got_x, lg = (x[0, offset:offset + n], logits[0, offset:offset + n]) if packed else (x[k, :n], logits[k, :n])
        assert torch.equal(got_x, want_x), f"row {eid}: the model was fed other tokens"
        offset += n
        lab = y[1:] != -100
        ce = F.cross_entropy(lg[:-1][lab], y[1:][lab], reduction="sum")
        out.append((eid, float(ce), int(lab.sum())))
    if packed:
        assert offset == x.shape[1]  # nothing else in the pack
    return out


def _check_trained_the_plan(caps: list[dict], plan: pd.DataFrame, tokens: dict, weights: pd.Series,
                            losses: dict[int, float]) -> None:
    """Each rank's forwards are its planned micro-batches in order, each computing logits only where a label
    follows (``logits_to_keep``); each step's loss is the weighted token mean."""
    num, den = {}, {}
    for r, cap in enumerate(caps):
        assert all("logits_to_keep" in call for call in cap["calls"]), f"rank {r}: a forward computed every logit"
        mbs = _micro_batches(plan, r)
        assert len(cap["calls"]) == len(mbs), f"rank {r}: {len(cap['calls'])} forwards for {len(mbs)} micro-batches"
        steps = plan[plan["rank"] == r].sort_values(["epoch", "step", "micro_index"], kind="stable") \
            .drop_duplicates(["epoch", "step", "micro_index"])["step"].tolist()
        for call, ids, step in zip(cap["calls"], mbs, steps):
            for eid, ce, n in _row_terms(call, ids, tokens):
                num[step] = num.get(step, 0.0) + float(weights[eid]) * ce
                den[step] = den.get(step, 0.0) + float(weights[eid]) * n
    assert sorted(losses) == sorted(num)
    for step, got in losses.items():
        assert got == pytest.approx(num[step] / den[step], rel=1e-4, abs=1e-4), f"step {step}"


def _run_tokens(run_dir: Path) -> dict:
    ex = pd.read_parquet(run_dir / "examples.parquet")
    return {e: (list(x), list(y)) for e, x, y in zip(ex["example_id"], ex["input_ids"], ex["labels"])}


def _weights(run_dir: Path) -> pd.Series:
    return pd.read_parquet(run_dir / "selection.parquet").set_index("example_id")["weight"]


def test_select_folder_is_packed_and_weighted(sel):
    from ray_cluster_ft.integrations.torch import is_packed_plan

    plan = pd.read_parquet(sel / "plan.parquet")
    assert is_packed_plan(plan)  # the default plan: what the examples must train
    assert not np.allclose(_weights(sel).to_numpy(), 1.0)


@pytest.mark.slow
def test_hf_trainer_example_trains_each_ranks_plan(sel, tiny_model_dir, tmp_path):
    caps, _ = _torchrun("hf_trainer.py", sel, tiny_model_dir, tmp_path)
    plan = pd.read_parquet(sel / "plan.parquet")
    assert all(c["log"][0]["loss"] == caps[0]["log"][0]["loss"] for c in caps)
    losses = {int(h["step"]) - 1: h["loss"] for h in caps[0]["log"]}  # Trainer logs step k+1 after step k
    _check_trained_the_plan(caps, plan, _run_tokens(sel), _weights(sel), losses)
    for r in (0, 1):
        trained = pd.read_json(tmp_path / "hf_out" / f"trained_rank{r}.jsonl", lines=True, dtype={"example_id": str})
        assert trained["example_id"].tolist() == sum(_micro_batches(plan, r), [])


@pytest.mark.slow
def test_trl_example_replans_on_trls_tokens_and_trains_each_ranks_plan(sel, tiny_model_dir, tmp_path):
    pytest.importorskip("trl")
    caps, _ = _torchrun("trl_sft.py", sel, tiny_model_dir, tmp_path)
    plan, tok = caps[0]["plan"], caps[0]["tokens"]
    tokens = {e: (list(x), list(y)) for e, x, y in zip(tok["example_id"], tok["input_ids"], tok["labels"])}
    # the plan trained is the selection's rows, balanced on TRL's own token counts
    old = pd.read_parquet(sel / "plan.parquet")
    assert set(plan["example_id"]) == set(old["example_id"])
    assert all(n == len(tokens[e][0]) for e, n in zip(plan["example_id"], plan["n_tokens"]))
    losses = {int(h["step"]) - 1: h["loss"] for h in caps[0]["log"]}
    _check_trained_the_plan(caps, plan, tokens, _weights(sel), losses)


@pytest.mark.slow
def test_torch_ddp_example_trains_each_ranks_plan(sel, tiny_model_dir, tmp_path):
    assert json.loads((sel / "manifest.json").read_text())["models"]["model.path"] == str(tiny_model_dir)
    caps, out = _torchrun("torch_ddp.py", sel, None, tmp_path)  # the run's own model, from its manifest
    plan = pd.read_parquet(sel / "plan.parquet")
    losses: dict[int, float] = {}
    for r in (0, 1):
        log = json.loads((tmp_path / "torch_out" / f"trained_rank{r}.json").read_text())
        assert [e for m in log for e in m["example_id"]] == sum(_micro_batches(plan, r), [])
        for m in log:
            losses[m["step"]] = losses.get(m["step"], 0.0) + m["loss"]
    _check_trained_the_plan(caps, plan, _run_tokens(sel), _weights(sel), losses)
    # rank 0 alone says what ran: every planned row, and the last step's loss (checked above against the reference)
    lines = [line for line in out.splitlines() if line.startswith("trained ")]
    assert len(lines) == 1, out[-3000:]
    want = rf"trained {plan['step'].nunique()} steps, {len(plan)} rows on 2 ranks; final loss (\d+\.\d{{4}})"
    m = re.fullmatch(want, lines[0])
    assert m, lines[0]
    assert float(m[1]) == pytest.approx(losses[max(losses)], abs=1e-4)


@pytest.mark.slow
def test_library_example_runs_from_a_fresh_directory(tiny_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "library.py"), "--model", str(tiny_model_dir)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "8 of 16 rows selected, 4 steps" in proc.stdout
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("step ")] == \
        ["step 0", "step 1", "step 2", "step 3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no files: the library writes nothing


@pytest.mark.slow
def test_ray_train_example_trains(sel, tiny_model_dir, tmp_path):
    cmd = [sys.executable, str(EXAMPLES / "ray_train.py"), str(sel), "--model", str(tiny_model_dir),
           "--storage", str(tmp_path / "ray")]
    import shutil
    import tempfile

    # Ray's socket paths must stay under 107 bytes: a short temp dir of its own, not pytest's long one
    env = {**_env(), "RAY_TMPDIR": tempfile.mkdtemp(prefix="rcft-ex-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    plan = pd.read_parquet(sel / "plan.parquet")
    # Result.metrics is None without a checkpoint in Ray Train 2: the line must carry the loop's own last metrics
    m = re.search(rf"^trained {plan['step'].nunique()} steps on 2 workers; last step (\d+), loss (\d+\.\d{{4}})$",
                  proc.stdout, re.M)
    assert m, proc.stdout[-3000:]
    assert int(m[1]) == plan["step"].max()
    assert 0 < float(m[2]) < 20  # a next-token cross-entropy in nats (the tiny model: about ln 49152)


@pytest.mark.slow  # ~35 CPU s: one TRL run beside the plan-driven ones above
def test_docs_plain_trl_example_runs_as_written_offline(sel, tiny_model_dir, tmp_path):
    """docs/library.md's plain-TRL block (only its paths line pointed at the select folder and the tiny model), with
    the hub offline: TRL's own sampler trains every planned row, two epochs of SFTConfig's default 8 rows a step."""
    pytest.importorskip("trl")
    from tests.integrations._helpers import readme_example

    script = tmp_path / "train_sft.py"
    script.write_text(readme_example("trl-plain", sel, tiny_model_dir))
    proc = subprocess.run([sys.executable, str(CAPTURE), str(tmp_path), str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cap = torch.load(tmp_path / "capture_rank0.pt", weights_only=False)
    planned = sorted(pd.read_parquet(sel / "plan.parquet")["example_id"].unique())
    assert sorted(cap["tokens"]["example_id"]) == planned
    assert cap["global_step"] == 2 * -(-len(planned) // 8)
    assert 0 < cap["train_loss"] < 20


@pytest.mark.slow
def test_docs_trl_example_runs_as_written_on_cpu(sel, tiny_model_dir, tmp_path):
    """docs/library.md's TRL block, only its paths line pointed at the select folder and the tiny model, under
    torchrun x2 on CPUs: every planned row trained once, by one rank."""
    pytest.importorskip("trl")
    from tests.integrations._helpers import readme_example

    script = tmp_path / "train_trl.py"
    script.write_text(readme_example("trl", sel, tiny_model_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    trained = pd.concat([pd.read_json(tmp_path / "trl_out" / f"trained_rank{r}.jsonl", lines=True,
                                      dtype={"example_id": str}).assign(r=r) for r in (0, 1)])
    planned = pd.read_parquet(sel / "plan.parquet")["example_id"]
    assert sorted(trained["example_id"]) == sorted(planned)  # one epoch: each planned row once
    assert (trained["rank"] == trained["r"]).all()
