"""Two Ray nodes on one machine, the second unable to see the driver's home cache, as a separate machine would be.

The head runs no tasks (``--num-cpus=0``). The second node is started inside its own mount namespace
(``unshare -m``) with an empty, read-only tmpfs over ``~/.cache``: the driver's converted demo model
(``~/.cache/ray-cluster-ft``), its Hugging Face cache and its compiled ops are not there. The whole pipeline then
runs with ``model.path: demo`` (sketch actors, training workers and both evaluations, all on the second node,
the only one with CPUs); it can only pass if the driver resolved the model once into ``model.cache_dir`` beside
``output.dir`` and every worker loaded that folder.

Both nodes are started by this module (``ray start --block``, own ``--temp-dir``, free ports) and stopped by
signalling those processes and their descendants: never ``ray stop``, which would stop every Ray on the
machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests._processes import stop_started
from tests.conftest import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _can_unshare_mounts() -> str | None:
    """None when ``unshare -m`` with a tmpfs mount works here, else why not."""
    if shutil.which("unshare") is None:
        return "the unshare tool is not installed"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True, check=False, timeout=30)
    if probe.returncode != 0:
        return f"unshare -m with a tmpfs mount is not permitted here: {probe.stderr.strip()[:200]}"
    return None


def _node_ports(taken: tuple[int, ...] = ()) -> list[str]:
    """A node's component ports and a 41-port worker range that holds none of them nor ``taken`` (Ray refuses a
    worker range that overlaps another component's port)."""
    flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    ports = [free_port() for _ in flags]
    used = set(ports) | set(taken)
    lo = free_port()
    while any(lo <= p <= lo + 40 for p in used):
        lo = free_port()
    return [f"{f}={p}" for f, p in zip(flags, ports)] + [f"--min-worker-port={lo}", f"--max-worker-port={lo + 40}"]


def _rows() -> list[dict]:
    code = [{"question": f"Write a Python function that returns {i} times x.",
             "answer": f"def times_{i}(x):\n    return {i} * x", "domain": "code"} for i in range(8)]
    med = [{"question": f"What is the usual adult dose of drug number {i}?",
            "answer": f"Drug {i} is usually given at {5 * (i + 1)} mg twice a day.", "domain": "medical"}
           for i in range(8)]
    return code + med


@pytest.fixture(scope="module")
def two_nodes():
    """``(address, head_temp_dir, node_temp_dir, env)`` of a head without CPUs and a 4-CPU node in its own mount
    namespace with an empty read-only ``~/.cache``."""
    why = _can_unshare_mounts()
    if why:
        pytest.skip(why)
    tmp = Path(tempfile.mkdtemp(prefix="rcft-2n-", dir="/tmp"))  # short: Ray's socket paths must stay < 108
    # This cluster's own token (as a real cluster would have): every process here, driver included, uses it.
    token_path = tmp / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    # A joined cluster, as users have: Ray Train starts its preemption watcher (the suite turns it off elsewhere,
    # tests/conftest.py); the suite's faster polling stays.
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    port, client_port = free_port(), free_port()
    head_cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=0", "--num-gpus=0",
                "--include-dashboard=false", f"--ray-client-server-port={client_port}",
                f"--temp-dir={tmp / 'head'}", "--disable-usage-stats", *_node_ports((port, client_port))]
    head_log = open(tmp / "head.log", "w")  # noqa: SIM115 - closed after stop_started
    head = subprocess.Popen(head_cmd, env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    node = node_log = None
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"Ray head did not come up: {(tmp / 'head.log').read_text()[-3000:]}")
                time.sleep(1)
        home_cache = Path.home() / ".cache"
        node_cmd = " ".join([str(BIN / "ray"), "start", "--block", f"--address=127.0.0.1:{port}", "--num-cpus=4",
                             "--num-gpus=0", f"--temp-dir={tmp / 'node'}", "--disable-usage-stats", *_node_ports()])
        # Mounts in the new namespace are private (unshare's default): the tmpfs hides ~/.cache from this node only.
        script = f"mkdir -p {home_cache} && mount -t tmpfs -o ro,size=1m tmpfs {home_cache} && exec {node_cmd}"
        node_log = open(tmp / "node.log", "w")  # noqa: SIM115 - closed after stop_started
        node = subprocess.Popen(["unshare", "-m", "sh", "-c", script], env=env, stdout=node_log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_node = ("import ray, time\n"
                         f"ray.init(address='127.0.0.1:{port}', log_to_driver=False)\n"
                         "for _ in range(120):\n"
                         "    if ray.cluster_resources().get('CPU', 0) >= 4: print('ok'); break\n"
                         "    time.sleep(1)\n")
        probe = [sys.executable, "-c", wait_for_node]
        up = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=240, check=False)
        if "ok" not in up.stdout:
            pytest.fail(f"the second node did not join: {up.stderr[-2000:]}\n{(tmp / 'node.log').read_text()[-2000:]}")
        yield f"127.0.0.1:{port}", tmp / "head", tmp / "node", env
    finally:
        stop_started([p for p in (node, head) if p is not None])
        for log in (node_log, head_log):
            if log is not None:
                log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_second_node_cannot_see_the_drivers_cache(two_nodes):
    """The premise: a task on the second node finds no ``~/.cache/ray-cluster-ft`` (the driver's demo copy)."""
    address, _, _, env = two_nodes
    code = ("import ray, os\n"
            f"ray.init(address='{address}', log_to_driver=False)\n"
            "f = ray.remote(num_cpus=1)(lambda p: os.path.exists(p))\n"
            "print(ray.get(f.remote(os.path.expanduser('~/.cache/ray-cluster-ft'))))\n")
    assert (Path.home() / ".cache" / "ray-cluster-ft").is_dir()  # the driver's side has it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env=env)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_pipeline_with_the_demo_model_runs_on_a_node_without_the_drivers_cache(two_nodes, tmp_path):
    address, head_dir, node_dir, env = two_nodes
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    spec = {
        "data": {"source": "files", "paths": [str(data)], "max_seq_len": 96, "eval_fraction": 0.15, "max_eval": 2},
        # the default cache is this machine's ~/.cache: on several nodes it must lie beside output.dir (shared)
        "model": {"path": "demo", "cache_dir": ".model-cache"},
        # in_process_rows 0: these few rows would otherwise be sketched in the driver, on the head.
        "sketch": {"method": "last_layer", "batch_size": 8, "num_actors": 1, "in_process_rows": 0},
        "clustering": {"k": 2},
        "selection": {"strategy": "balanced", "budget": 2},
        "allocation": {"strategy": "cluster"},
        "train": {"num_workers": 2, "micro_batch_size": 1, "grad_accum": 1, "timeout_s": 300},
        "evaluation": {"max_mc": 0, "max_code": 0},
        "output": {"dir": str(tmp_path / "runs" / "r")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ray_cluster_ft.cli", "run", str(tmp_path / "job.yaml"),
                           "--address", address], capture_output=True, text=True, timeout=1500, check=False,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    print(f"two-node pipeline: {time.monotonic() - t0:.0f} s")
    m = json.loads((tmp_path / "runs" / "r" / "manifest.json").read_text())
    cache = tmp_path / "runs" / ".model-cache"
    assert m["models"]["model.cache_dir"] == str(cache) and m["models"]["model.path"].startswith(str(cache))
    assert m["config"]["model"]["path"] == "demo"  # the manifest keeps the user's spec
    assert m["counts"]["trained"] == 2 and m["train"]["steps"] == 1
    assert (tmp_path / "runs" / "r" / "final_model" / "config.json").is_file()
    # The work ran on the second node (the head has no CPUs): its worker logs name the training workers, the
    # sketch actor and the evaluation task; the head's name none of them.
    def names(d: Path) -> str:
        return "".join(p.read_text(errors="replace") for p in d.rglob("worker-*.out")) + \
               "".join(p.read_text(errors="replace") for p in d.rglob("worker-*.err"))
    on_node, on_head = names(node_dir), names(head_dir)
    for what in ("RayTrainWorker", "evaluate_model_path", "ShardSketcher"):
        assert what in on_node, what
        assert what not in on_head, what
