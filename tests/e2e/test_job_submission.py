"""A real Ray job submission, the same path as ``ray job submit``: a local head on loopback with token
authentication, the job submission client, a plan-only run of a tiny job spec, and a bad spec.

The head is started by this module only (``ray start --head --block`` in its own session, its own
``--temp-dir`` and free ports) and stopped by signalling that process and its descendants: ``ray stop`` would
kill every Ray of the user, including other local runs on the same machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests._processes import stop_started
from tests.conftest import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the venv's bin: `ray` and the `ray-cluster-ft` entry point
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _get(url: str, token: str | None = None) -> int:
    """HTTP status of a GET (with a bearer token when given); 0 when nothing answers."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:  # not listening yet
        return 0


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on this machine: dashboard and job server on 127.0.0.1, token authentication on, 2 CPUs.

    Yields ``(dashboard_url, token)``.
    """
    if shutil.which("ray-cluster-ft", path=str(BIN)) is None:
        pytest.skip(f"the ray-cluster-ft entry point is not installed in {BIN}")
    # A short path: Ray's Unix socket names under the temp dir must stay below 108 characters.
    tmp = Path(tempfile.mkdtemp(prefix="rcft-head-", dir="/tmp"))
    token = secrets.token_hex(32)
    token_path = tmp / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path), RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    dash = free_port()
    ports = {flag: free_port() for flag in (
        "--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port")}
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--num-gpus=0",
           f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", *(f"{k}={v}" for k, v in ports.items())]
    log = open(tmp / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while _get(f"{url}/api/version", token) != 200:
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Ray head did not come up: {(tmp / 'head.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url, token
    finally:
        stop_started([head])
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _client(url: str, token: str):
    from ray.job_submission import JobSubmissionClient

    # An explicit header: the test process itself need not be in token mode.
    return JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})


def _submit(client, **kwargs) -> str:
    """``client.submit_job``, retried while the head's job agent has not registered yet: the dashboard answers
    before its agent does, and Ray's own answer then is "No available agent to submit job, please try again
    later" (seen on a loaded 2-core machine)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def _wait(client, job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after {timeout_s} s:\n{client.get_job_logs(job_id)[-3000:]}")
        time.sleep(2)


def _rows() -> list[dict]:
    """32 distinct question/answer rows in two domains."""
    code = [{"question": f"Write a Python function that returns {i} times x.",
             "answer": f"def times_{i}(x):\n    return {i} * x", "domain": "code"} for i in range(16)]
    med = [{"question": f"What is the usual adult dose range of drug number {i}?",
            "answer": f"Drug {i} is usually given at {5 * (i + 1)} mg twice a day; ask a doctor.",
            "domain": "medical"} for i in range(16)]
    return code + med


def _spec(tiny_model_dir: Path, data: Path, **extra) -> dict:
    spec = {
        "data": {"source": "files", "paths": [str(data)], "max_seq_len": 128, "eval_fraction": 0.1, "max_eval": 4},
        "model": {"path": str(tiny_model_dir)},
        "sketch": {"last_blocks": 1, "k_in": 4, "k_out": 4, "dim": 16, "batch_size": 8, "num_actors": 1},
        "clustering": {"k": 2},
        "selection": {"strategy": "balanced", "budget": 0.5},
        "allocation": {"strategy": "cluster"},
        "train": {"num_workers": 2, "micro_batch_size": 2},
        "output": {"dir": "runs/unused"},
    }
    for section, values in extra.items():
        spec.setdefault(section, {}).update(values)
    return spec


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The job's working directory: a good spec, a spec with a bad key, and the data file."""
    d = tmp_path_factory.mktemp("job")
    data = d / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (d / "tiny.yaml").write_text(yaml.safe_dump(_spec(tiny_model_dir, data)))
    (d / "bad.yaml").write_text(yaml.safe_dump(_spec(tiny_model_dir, data, train={"bogus_key": 1})))
    return d


def test_token_auth_is_on(ray_head):
    url, token = ray_head
    assert _get(f"{url}/api/jobs/") == 401
    assert _get(f"{url}/api/jobs/", "0" * 64) == 403
    assert _get(f"{url}/api/jobs/", token) == 200


def test_plan_only_job_succeeds_and_writes_artifacts(ray_head, job_dir, tmp_path, tiny_model_dir):
    url, token = ray_head
    client = _client(url, token)
    out = tmp_path / "run"
    t0 = time.monotonic()
    job_id = _submit(
        client,
        entrypoint=f"ray-cluster-ft run tiny.yaml --output {out} --plan-only",
        runtime_env={"working_dir": str(job_dir), "env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    status = _wait(client, job_id, timeout_s=420)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-3000:]
    print(f"plan-only job: {time.monotonic() - t0:.1f} s")

    assert "[ray-cluster-ft] done: read 32" in logs
    for name in ("examples.parquet", "eval_examples.parquet", "rejected.jsonl", "clusters.parquet",
                 "selection.parquet", "plan.parquet", "manifest.json", "report.md"):
        assert (out / name).is_file(), name
    assert list((out / "sketches").glob("*.parquet"))
    assert not (out / "trained.parquet").exists()
    m = json.loads((out / "manifest.json").read_text())
    print(f"stage timings inside the job: {m['timings_s']}")
    c = m["counts"]
    assert c["read"] == 32 and c["rejected"] == 0
    assert c["accepted"] == c["selected"] + c["not_selected"]
    assert c["trained"] == 0 and m["train"] is None
    assert m["config"]["model"]["path"] == str(tiny_model_dir)
    assert m["clustering"]["k"] == 2
    plan = pd.read_parquet(out / "plan.parquet")
    assert sorted(plan["rank"].unique()) == [0, 1]
    assert plan["example_id"].nunique() == c["selected"] > 0
    # Each rank gets the same number of micro-batches of 2 rows (the plan's evenness guarantee).
    assert plan.groupby("rank").size().nunique() == 1


def test_bad_spec_fails_with_the_config_error_in_the_logs(ray_head, job_dir):
    url, token = ray_head
    client = _client(url, token)
    job_id = _submit(client, entrypoint="ray-cluster-ft run bad.yaml --plan-only",
                     runtime_env={"working_dir": str(job_dir)})
    t0 = time.monotonic()
    assert _wait(client, job_id, timeout_s=180) == "FAILED"
    print(f"bad-spec job: {time.monotonic() - t0:.1f} s")
    logs = client.get_job_logs(job_id)
    assert "unknown key 'train.bogus_key'" in logs, logs[-3000:]
    assert client.get_job_info(job_id).driver_exit_code == 2
