"""What ships for a real GPU cluster, checked as far as a machine without a cloud account can check it.

- Cluster launcher YAMLs validate against the autoscaler schema inside the installed ``ray`` package and keep
  the dashboard private and token authentication on.
- KubeRay manifests parse and carry the fields the KubeRay operator (``ray.io/v1``) needs: see
  :func:`_check_ray_cluster_spec` and :func:`test_rayjob_manifest` for the list.
- Every job spec under ``jobs/`` validates; the Dockerfile's base image matches the pinned Ray.
"""

import fnmatch
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from ray_cluster_ft.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "cluster_configs"
LAUNCHER = sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("kuberay-"))
KUBERAY = sorted(CONFIG_DIR.glob("kuberay-*.yaml"))
JOB_SPECS = sorted((ROOT / "jobs").glob("*.yaml"))
SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
PYPROJECT = (ROOT / "pyproject.toml").read_text()
PROJECT_VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)
# The image the configs run: REGISTRY is the user's registry; the name and tag are the project's.
IMAGE = re.compile(r"^[^\s]+/ray-cluster-ft:" + re.escape(PROJECT_VERSION) + r"$")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_the_expected_configs_exist():
    assert {p.name for p in LAUNCHER} >= {"aws-gpu.yaml", "gcp-gpu.yaml"}
    assert {p.name for p in KUBERAY} == {"kuberay-raycluster.yaml", "kuberay-rayjob.yaml"}


# ---------------------------------------------------------------- cluster launcher


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_matches_schema(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, SCHEMA)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    head = types[cfg["head_node_type"]]
    assert not head["resources"].get("GPU"), "the head is a CPU node"
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu, "an autoscaling GPU worker type"
    for t in gpu.values():
        assert t["min_workers"] == 0 and t["max_workers"] >= 1
        assert t["max_workers"] <= cfg["max_workers"]
    assert cfg["idle_timeout_minutes"] > 0
    assert IMAGE.match(cfg["docker"]["image"]), cfg["docker"]["image"]


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_keeps_dashboard_private_and_token_auth_on(path):
    cfg = yaml.safe_load(path.read_text())
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in path.read_text()
    # Ray 2.60's `ray start` enables token auth from RAY_AUTH_MODE or an existing token file; both are set on
    # every node: the variable in the container's environment, the client's token file mounted into it.
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"] == {"/home/ray/.ray/auth_token": "~/.ray/auth_token"}


def test_token_auth_names_match_the_installed_ray():
    """The variable and the default token path the configs rely on are the installed Ray's."""
    from ray._private.authentication import authentication_token_setup as auth

    assert auth.AUTH_MODE_ENV_VAR == "RAY_AUTH_MODE"
    assert auth._get_default_token_path().relative_to(Path.home()) == Path(".ray/auth_token")


def test_schema_rejects_a_broken_config():
    cfg = yaml.safe_load((CONFIG_DIR / "gcp-gpu.yaml").read_text())
    cfg["available_node_types"]["gpu_worker"]["min_workers"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, SCHEMA)
    cfg = yaml.safe_load((CONFIG_DIR / "aws-gpu.yaml").read_text())
    cfg["available_node_types"]["gpu_worker"]["resources"] = {"GPU": 0.5}  # resources are whole numbers
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, SCHEMA)


# ---------------------------------------------------------------- KubeRay


def _container(template: dict) -> dict:
    containers = template["spec"]["containers"]
    assert containers and all(c["name"] and c["image"] for c in containers)
    return containers[0]


def _check_resources(container: dict) -> dict:
    res = container["resources"]
    for kind in ("limits", "requests"):
        for key, value in res[kind].items():
            assert QUANTITY.match(str(value)), (key, value)
    # Extended resources (GPUs) cannot be overcommitted: Kubernetes wants requests == limits.
    if "nvidia.com/gpu" in res["limits"]:
        assert res["requests"].get("nvidia.com/gpu") == res["limits"]["nvidia.com/gpu"]
    return res["limits"]


def _check_ray_cluster_spec(spec: dict) -> None:
    """The RayCluster fields the operator needs, and this project's choices.

    Required by KubeRay: ``headGroupSpec.rayStartParams`` (a string map) and ``headGroupSpec.template`` with a
    container image; per worker group ``groupName``, ``minReplicas`` <= ``replicas`` <= ``maxReplicas``,
    ``rayStartParams`` and a template with an image. Autoscaling: ``enableInTreeAutoscaling: true``. Ours:
    ``rayVersion`` = the pinned Ray, token auth (``authOptions.mode: token``), a ClusterIP head Service,
    the project image everywhere, a GPU worker group scaling from 0 with ``nvidia.com/gpu`` limits.
    """
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert spec["authOptions"] == {"mode": "token"}
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    head_c = _container(head["template"])
    assert IMAGE.match(head_c["image"])
    assert "nvidia.com/gpu" not in _check_resources(head_c)
    groups = spec["workerGroupSpecs"]
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names) and all(DNS_1123.match(n) for n in names)
    gpu_groups = []
    for g in groups:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert isinstance(g["rayStartParams"], dict)
        c = _container(g["template"])
        assert IMAGE.match(c["image"])
        if int(_check_resources(c).get("nvidia.com/gpu", 0)) >= 1:
            gpu_groups.append(g)
    assert gpu_groups and all(g["minReplicas"] == 0 and g["maxReplicas"] >= 1 for g in gpu_groups)


def _claims(spec: dict) -> set[str]:
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    out = set()
    for t in templates:
        vols = {v["name"]: v for v in t["spec"].get("volumes", [])}
        for c in t["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"volumeMount {m['name']} has no volume"
                if "persistentVolumeClaim" in vols[m["name"]]:
                    out.add(vols[m["name"]]["persistentVolumeClaim"]["claimName"])
    return out


def test_raycluster_manifest():
    docs = _docs(CONFIG_DIR / "kuberay-raycluster.yaml")
    assert all(d["apiVersion"] and d["kind"] and DNS_1123.match(d["metadata"]["name"]) for d in docs)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("RayCluster") == 1
    assert not {"Ingress", "Service"} & set(kinds), "no extra way in to the dashboard"
    rc = docs[kinds.index("RayCluster")]
    assert rc["apiVersion"] == "ray.io/v1"
    _check_ray_cluster_spec(rc["spec"])
    pvcs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert _claims(rc["spec"]) and _claims(rc["spec"]) <= set(pvcs)
    assert all("ReadWriteMany" in p["spec"]["accessModes"] for p in pvcs.values())


def test_rayjob_manifest():
    """RayJob: ``apiVersion: ray.io/v1``, ``kind: RayJob``, ``metadata.name``, ``spec.entrypoint`` and
    ``spec.rayClusterSpec`` (checked as a RayCluster spec); the entrypoint runs a job spec of this
    repository, which the image holds under /home/ray/ray-cluster-ft/jobs."""
    (job,) = _docs(CONFIG_DIR / "kuberay-rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert DNS_1123.match(job["metadata"]["name"])
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["ray-cluster-ft", "run"]
    spec_path = Path(argv[2])
    assert spec_path.parent == Path("/home/ray/ray-cluster-ft/jobs")
    assert (ROOT / "jobs" / spec_path.name).is_file()
    assert spec["shutdownAfterJobFinishes"] is True
    _check_ray_cluster_spec(spec["rayClusterSpec"])
    # The claim is created by kuberay-raycluster.yaml.
    pvcs = {d["metadata"]["name"] for d in _docs(CONFIG_DIR / "kuberay-raycluster.yaml")
            if d["kind"] == "PersistentVolumeClaim"}
    assert _claims(spec["rayClusterSpec"]) <= pvcs
    # Enough GPUs in the group for the job spec it runs.
    cfg = load_config(ROOT / "jobs" / spec_path.name)
    gpus = sum(int(_container(g["template"])["resources"]["limits"].get("nvidia.com/gpu", 0)) * g["maxReplicas"]
               for g in spec["rayClusterSpec"]["workerGroupSpecs"])
    assert cfg.train.use_gpu and gpus >= cfg.train.num_workers


def test_kuberay_image_comes_with_the_job_specs():
    """The RayJob reads jobs/ from the image: the Dockerfile must copy it there."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "WORKDIR /home/ray/ray-cluster-ft" in text
    assert re.search(r"^COPY .*\bjobs \./jobs$", text, re.M)


# ---------------------------------------------------------------- job specs


def test_there_are_job_specs():
    names = {p.name for p in JOB_SPECS}
    assert {"demo.yaml", "code-7b-4gpu.yaml", "medical-13b-8gpu.yaml"} <= names


@pytest.mark.parametrize("path", JOB_SPECS, ids=lambda p: p.name)
def test_job_spec_validates(path):
    cfg = load_config(path)
    if cfg.train.use_gpu:  # the cluster specs
        assert cfg.train.zero_stage == 3
        # One sketch actor per training GPU, each with one GPU (the default would count the GPUs present
        # before the autoscaler adds any).
        assert cfg.sketch.num_actors == cfg.train.num_workers
        assert "/" in cfg.model.path and not Path(cfg.model.path).exists(), "a hub id"
        # Every node writes into the run directory: absolute paths on shared storage.
        assert Path(cfg.output.dir).is_absolute() and all(Path(p).is_absolute() for p in cfg.data.paths)


def test_specs_cover_lora_and_full_fine_tuning():
    gpu = [load_config(p) for p in JOB_SPECS if load_config(p).train.use_gpu]
    assert {c.train.lora.enabled for c in gpu} == {True, False}
    assert {c.train.num_workers for c in gpu} >= {4, 8}


def test_every_spec_the_docs_name_exists():
    texts = [(ROOT / "jobs" / "README.md").read_text()] + [p.read_text() for p in LAUNCHER + KUBERAY]
    named = {m for t in texts for m in re.findall(r"jobs/([\w.-]+\.yaml)", t)}
    assert named and all((ROOT / "jobs" / n).is_file() for n in named), named


def test_bad_job_spec_is_a_config_error(tmp_path):
    from ray_cluster_ft.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "jobs" / "code-7b-4gpu.yaml").read_text().replace("  lora:\n", "  lorra:\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lorra'; did you mean 'train\.lora'"):
        load_config(bad)


# ---------------------------------------------------------------- Docker image


def _dockerignored(name: str, rules: list[str]) -> bool:
    """Docker's rule for a top-level path: the last matching pattern wins, ``!`` re-includes."""
    ignored = False
    for rule in rules:
        neg = rule.startswith("!")
        pat = rule[1:] if neg else rule
        if fnmatch.fnmatch(name, pat.rstrip("/")):
            ignored = not neg
    return ignored


def test_dockerfile_base_matches_pinned_ray():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray.__version__}" in text
    assert f'"ray[default,train,data]=={ray.__version__}"' in PYPROJECT
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON\}-\$\{CUDA\}$", text, re.M)
    # The Python of the image satisfies the project's requires-python.
    py = re.search(r"^ARG PYTHON=py3(\d+)$", text, re.M)
    need = re.search(r'requires-python = ">=3\.(\d+)"', PYPROJECT)
    assert py and need and int(py.group(1)) >= int(need.group(1))


def test_dockerfile_cuda_arg_and_installs():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA=cu\d{3}$", text, re.M)
    # torch from the PyTorch index of the same CUDA variant, at the version the install scripts pin.
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "test.sh").read_text()).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in text
    assert 'https://download.pytorch.org/whl/${CUDA}' in text
    assert re.search(r"pip install --no-cache-dir \.(\s|$)", text)  # the project, with its pinned deps
    assert re.search(r'"deepspeed==[\d.]+"', PYPROJECT)
    # Everything the Dockerfile copies exists and is in the build context.
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    sources = [s for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", text, re.M) for s in line.split()[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _dockerignored(src, rules), f"{src} is excluded by .dockerignore"
    assert _dockerignored(".venv", rules) and _dockerignored("runs", rules)
