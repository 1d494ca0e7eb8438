"""A real run stopped by SIGINT (Ctrl-C: the whole process group) and by SIGTERM (``ray job stop``, Kubernetes:
the driver only) between checkpoints, then resumed to the end: exit 130 / 143 with one line, the resumed run
starts after the newest complete checkpoint, the trained log equals the plan once per epoch, one checkpoint
is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests._pins import FIXTURE

pytestmark = pytest.mark.slow


def _spec(tmp_path: Path, model: Path) -> Path:
    spec = {"data": {"paths": [str(FIXTURE)], "max_seq_len": 128, "overlong": "truncate", "eval_fraction": 0.0},
            "model": {"path": str(model)},
            # hidden_mean: the tiny model's own forward pass, the cheapest feature (what is stopped here is training).
            "sketch": {"method": "hidden_mean", "batch_size": 8, "num_actors": 1},
            "selection": {"budget": 0.4},
            "train": {"num_workers": 2, "micro_batch_size": 4, "epochs": 3, "checkpoint_every": 3, "lr": 1e-3},
            "evaluation": {"max_mc": 0, "max_code": 0},
            "output": {"dir": str(tmp_path / "run"), "save_model": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _steps_logged(run: Path) -> int:
    log = run / "train_log.jsonl"
    return sum(1 for line in log.read_text().splitlines() if line.strip()) if log.exists() else 0


def _run_until(args: list[str], run: Path, after_step: int, sig: int, group: bool, log: Path) -> tuple[int, str]:
    """Start the CLI, send ``sig`` once the train log holds more than ``after_step`` steps; returns (exit code,
    stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ray_cluster_ft.cli", *args], stdout=out, stderr=err,
                                env=env, start_new_session=True)
        deadline = time.monotonic() + 420
        while _steps_logged(run) <= after_step:
            assert proc.poll() is None, f"the run ended before step {after_step + 1}: {log.with_suffix('.err').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the run did not reach its step in time"
            time.sleep(0.2)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        code = proc.wait(timeout=180)
    return code, log.with_suffix(".err").read_text()


def _newest_complete_step(run: Path) -> int:
    from ray_cluster_ft.allocate import plan_hash
    from ray_cluster_ft.train.checkpoints import newest_complete_checkpoint

    path, _ = newest_complete_checkpoint(run / "ray_train" / "train", 2, plan_hash(pd.read_parquet(run / "plan.parquet")))
    assert path is not None, "no complete checkpoint was kept"
    return json.loads((Path(path) / "plan_position_rank0.json").read_text())["steps_done"]


def _last_line(err: str) -> str:
    return [x for x in err.splitlines() if x.strip()][-1]


def test_sigint_and_sigterm_stop_a_run_that_resumes_after_its_newest_checkpoint(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path, tiny_model_dir)
    run = tmp_path / "run"

    code, err = _run_until(["run", str(spec)], run, after_step=4, sig=signal.SIGINT, group=True,
                           log=tmp_path / "first.log")
    assert code == 130, err[-3000:]
    assert _last_line(err) == f"ray-cluster-ft: interrupted (SIGINT); continue the run with `ray-cluster-ft run " \
                              f"--resume {run}`"
    kept = _newest_complete_step(run)
    assert kept >= 3 and kept % 3 == 0

    code, err = _run_until(["run", "--resume", str(run)], run, after_step=kept + 4, sig=signal.SIGTERM,
                           group=False, log=tmp_path / "second.log")
    assert code == 143, err[-3000:]
    assert _last_line(err).startswith("ray-cluster-ft: interrupted (SIGTERM); continue the run with")
    kept2 = _newest_complete_step(run)
    assert kept2 > kept

    done = subprocess.run([sys.executable, "-m", "ray_cluster_ft.cli", "run", "--resume", str(run)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["train"]["resumed_from_step"] == kept2  # the newest complete checkpoint, not Ray's record
    assert manifest["checks"]["matches_plan"] and manifest["checks"]["once_per_epoch"]
    plan = pd.read_parquet(run / "plan.parquet")
    log = pd.read_json(run / "train_log.jsonl", lines=True)
    assert log["step"].tolist() == sorted(plan["step"].unique().tolist())  # every step once in the history
    assert len([p for p in (run / "ray_train" / "train").glob("checkpoint_*") if p.is_dir()]) == 1


def test_sigterm_while_ray_starts_is_the_clis_to_handle(tmp_path, tiny_model_dir):
    """SIGTERM right after the data stage, while ray.init is starting a local Ray: Ray's own handler
    (sys.exit(15) from wherever the main thread is) must not take it over."""
    spec = _spec(tmp_path, tiny_model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    err_path = tmp_path / "early.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ray_cluster_ft.cli", "run", str(spec)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        for line in proc.stdout:
            if line.startswith("[ray-cluster-ft] data done"):
                break
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)  # drained, not closed: a print before the stop must not break the pipe
        code = proc.returncode
    err = err_path.read_text()
    assert code == 143, err[-3000:]
    assert _last_line(err).startswith("ray-cluster-ft: interrupted (SIGTERM); continue the run with")
