"""The deployment files parse, carry the fields their consumers need, and agree with each other and with
pyproject.toml (image names and tags, Ray version, torch pin, referenced Services/Secrets/volumes)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _pin(package: str) -> str:
    for dep in PYPROJECT["project"]["dependencies"]:
        m = re.fullmatch(rf"{re.escape(package)}(\[[^\]]*\])?==([\w.]+)", dep)
        if m:
            return m.group(2)
    raise AssertionError(f"{package} is not pinned with == in pyproject.toml")


RAY_VERSION = _pin("ray")
TORCH_VERSION = _pin("torch")
IMAGE = {"cpu": f"taper:{VERSION}-cpu", "cuda": f"taper:{VERSION}-cuda"}
DOCKERFILE = {"cpu": DEPLOY / "Dockerfile.cpu", "cuda": DEPLOY / "Dockerfile.cuda"}


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [
        d for _, d in k8s_docs() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group name, pod spec) of every pod template in a workload or Ray resource."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind == "RayJob":
        spec = spec["rayClusterSpec"]
    if kind in ("RayCluster", "RayJob"):
        groups = [("head", spec["headGroupSpec"])] + [
            (g["groupName"], g) for g in spec.get("workerGroupSpecs", [])
        ]
        return [(n, g["template"]["spec"]) for n, g in groups]
    if kind in ("Deployment", "StatefulSet"):
        return [(doc["metadata"]["name"], spec["template"]["spec"])]
    return []


def ray_groups(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def custom_resources(group: dict[str, Any]) -> dict[str, float]:
    raw = group.get("rayStartParams", {}).get("resources")
    if raw is None:
        return {}
    # KubeRay's format: a JSON object inside a quoted string, e.g. '"{\"rollout\": 1}"'
    assert raw.startswith('"') and raw.endswith('"'), f"resources must be a quoted JSON string, got {raw!r}"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def quantity_bytes(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(q))
    assert m, f"bad quantity {q!r}"
    return float(m.group(1)) * units.get(m.group(2) or "", 1)


# ---------------------------------------------------------------- everything parses


def test_all_yaml_parses_and_k8s_objects_have_identity() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert {p.name for p in files} >= {
        "docker-compose.yml",
        "raycluster.yaml",
        "api.yaml",
        "redis.yaml",
        "secret.yaml",
        "rayjob.yaml",
        "kustomization.yaml",
    }
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
    for fname, doc in k8s_docs():
        assert doc.get("apiVersion") and doc.get("kind"), f"{fname}: object without apiVersion/kind"
        if doc["kind"] != "Kustomization":
            assert doc["metadata"].get("name"), f"{fname}: {doc['kind']} without metadata.name"
            assert doc["metadata"].get("namespace", "taper") == "taper" or doc["kind"] == "Namespace"


def test_kustomization_lists_existing_files_and_leaves_the_rayjob_out() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    assert "rayjob.yaml" not in kust["resources"]
    listed = set(kust["resources"]) | {"kustomization.yaml", "rayjob.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} == listed, (
        "a manifest is neither in kustomization nor the rayjob"
    )
    assert [i["name"] for i in kust["images"]] == ["taper"]


# ---------------------------------------------------------------- images


def all_images() -> list[tuple[str, str, dict[str, Any]]]:
    """(where, image, container) for every container in the k8s manifests."""
    out = []
    for fname, doc in k8s_docs():
        for group, spec in pod_specs(doc):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                out.append((f"{fname}:{group}", c["image"], c))
    return out


def test_images_are_the_built_ones_or_pinned_third_party() -> None:
    for where, image, container in all_images():
        if image.split(":")[0] == "taper":
            assert image in IMAGE.values(), f"{where}: {image} is not one of {sorted(IMAGE.values())}"
            gpu = "nvidia.com/gpu" in container.get("resources", {}).get("limits", {})
            assert image == IMAGE["cuda" if gpu else "cpu"], (
                f"{where}: GPU pods use the CUDA image, others the CPU one"
            )
        else:
            assert ":" in image and not image.endswith(":latest"), f"{where}: pin {image}"


def test_taper_pods_can_write_their_volumes() -> None:
    for fname, doc in k8s_docs():
        for group, pod in pod_specs(doc):
            if any(c["image"].startswith("taper:") for c in pod["containers"]):
                assert pod.get("securityContext", {}).get("fsGroup") == 1000, f"{fname}:{group}"
    for path in DOCKERFILE.values():
        assert "--uid 1000 --gid 1000 taper" in path.read_text() and "USER taper" in path.read_text()


def test_dockerfiles_install_like_the_setup_script() -> None:
    bases = set()
    for variant, path in DOCKERFILE.items():
        text = path.read_text()
        bases.add(re.search(r"^FROM (\S+)", text, re.M).group(1))
        assert f"ARG TORCH_VERSION={TORCH_VERSION}" in text, f"{path.name}: torch pin differs from pyproject"
        assert f'pip install -q -e ".[{variant}]"' in text
        removes = "pip uninstall -q -y torchvision torchaudio torchcodec" in text
        assert removes == (variant == "cpu"), f"{path.name}: torchvision & co. are removed for CPU only"
        assert f'org.opencontainers.image.version="{VERSION}"' in text
        assert (DEPLOY / f"{path.name}.dockerignore").is_file()
        assert "/etc/profile.d/" in text and "wget" in text  # KubeRay's `bash -l` start and its probes
    assert len(bases) == 1, "CPU and CUDA images must share a Python base: Ray needs one Python on all nodes"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "torchvision torchaudio torchcodec" in setup
    assert f"torch=={TORCH_VERSION}" in setup, "scripts/setup.sh pins another torch than pyproject.toml"
    assert '-e ".[$EXTRAS]"' in setup


def test_compose_images_build_from_the_dockerfiles() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "api", "ray-head", "ray-worker"} <= set(services)
    built = {}
    for name, svc in services.items():
        if "build" in svc:
            dockerfile = (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve()
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
            built[svc["image"]] = dockerfile
    assert built == {IMAGE["cpu"]: DOCKERFILE["cpu"].resolve(), IMAGE["cuda"]: DOCKERFILE["cuda"].resolve()}
    for name, svc in services.items():
        image = svc["image"]
        assert image in built or (image.startswith("redis:") and not image.endswith(":latest")), name


# ---------------------------------------------------------------- compose wiring


def test_compose_wiring() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    head_cmd = services["ray-head"]["command"]
    port = re.search(r"--port=(\d+)", head_cmd).group(1)
    client_port = re.search(r"--ray-client-server-port=(\d+)", head_cmd).group(1)
    assert f"--address=ray-head:{port}" in services["ray-worker"]["command"]
    env = services["api"]["environment"]
    assert env["RAY_ADDRESS"] == f"ray://ray-head:{client_port}"
    assert env["TAPER_REDIS_URL"].startswith("redis://redis:6379")
    for name in ("api", "ray-head", "ray-worker"):
        assert services[name]["environment"]["TAPER_DATA_DIR"] == "/data/taper"
        assert "taper-data:/data/taper" in services[name]["volumes"], f"{name} must share the data volume"
    assert json.loads(re.search(r"--resources='([^']*)'", services["ray-worker"]["command"]).group(1)) == {
        "rollout": 4
    }
    # only the API is published beyond this host: Ray and Redis run whatever they are sent
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert name == "api" or str(port).startswith("127.0.0.1:"), f"{name} publishes {port} to the network"
    for name in ("ray-head", "ray-worker"):
        store = int(re.search(r"--object-store-memory=(\d+)", services[name]["command"]).group(1))
        assert quantity_bytes(services[name]["shm_size"].upper().replace("GB", "G")) > store


# ---------------------------------------------------------------- Ray cluster


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_ray_groups_resources_bounds_and_object_store(kind: str) -> None:
    doc = find(kind)
    spec = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
    assert spec["rayVersion"] == RAY_VERSION
    advertised: dict[str, float] = {}
    gpu_groups = cpu_groups = 0
    for name, group in ray_groups(doc):
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), (
            f"{name}: rayStartParams values must be strings"
        )
        for k, v in custom_resources(group).items():
            advertised[k] = advertised.get(k, 0) + v
        if name != "head":
            assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        limits = container["resources"]["limits"]
        assert container["resources"]["requests"] == limits, f"{name}: Ray reads limits; keep requests equal"
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if gpus:
            gpu_groups += 1
            assert params.get("num-gpus", str(gpus)) == str(gpus)
            assert any(t["key"] == "nvidia.com/gpu" for t in pod.get("tolerations", []))
        elif name != "head":
            cpu_groups += 1
        # object store in /dev/shm: the memory-backed volume must be larger
        store = int(params["object-store-memory"])
        dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"]["medium"] == "Memory"
        assert quantity_bytes(dshm["emptyDir"]["sizeLimit"]) > store, f"{name}: /dev/shm below object store"
        assert quantity_bytes(limits["memory"]) > store
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts.get("/dev/shm") == "dshm" and mounts.get("/data/taper") == "taper-data", name
        assert any(
            v.get("persistentVolumeClaim", {}).get("claimName") == "taper-data" for v in pod["volumes"]
        )
    assert advertised.get("rollout", 0) > 0 and advertised.get("learner", 0) > 0
    assert gpu_groups >= 1
    if kind == "RayCluster":
        assert cpu_groups >= 1 and spec["enableInTreeAutoscaling"] is True
        assert custom_resources(spec["headGroupSpec"]) == {}, "no rollout/learner work on the head"


def test_api_reaches_ray_and_redis_and_is_exposed() -> None:
    cluster = find("RayCluster")
    api = find("Deployment", "taper-api")
    container = api["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    client_port = next(
        p["containerPort"]
        for p in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == "client"
    )
    assert env["RAY_ADDRESS"]["value"] == f"ray://{cluster['metadata']['name']}-head-svc:{client_port}"
    secret = find("Secret", "taper-secrets")
    for name in ("TAPER_REDIS_URL", "TAPER_API_KEY"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "taper-secrets" and ref["key"] in secret["stringData"]
    # every secret reference anywhere points at a key that exists
    for fname, doc in k8s_docs():
        for _, pod in pod_specs(doc):
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == "taper-secrets" and ref["key"] in secret["stringData"], fname
    # the Redis URL names the Redis Service and its port
    redis_svc = find("Service", "taper-redis")
    url = secret["stringData"]["TAPER_REDIS_URL"]
    assert re.fullmatch(rf"redis://(:[^@]+@)?taper-redis:{redis_svc['spec']['ports'][0]['port']}/\d+", url)
    # the Service selects the API pods and targets the container port
    svc = find("Service", "taper-api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert api["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in port_names
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # nothing but the API may be reachable from outside the cluster
    for fname, doc in k8s_docs():
        if doc["kind"] == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", f"{fname}: {doc['metadata']['name']}"
        assert doc["kind"] != "Ingress" or fname == "api.yaml", fname
    assert cluster["spec"]["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_redis_is_persistent_and_password_protected() -> None:
    sts = find("StatefulSet", "taper-redis")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    script = " ".join(container["command"] + container["args"])
    # the password reaches redis-server on its stdin, never on a command line (`ps` shows those)
    assert "redis-server - --appendonly yes" in script and 'requirepass "$REDISCLI_AUTH"' in script
    assert "--requirepass" not in script and "-a " not in json.dumps(container)
    password_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"]}
    assert password_env["REDISCLI_AUTH"] == "REDIS_PASSWORD"
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/data"] == "redis-data"
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["redis-data"]
    assert sts["spec"]["serviceName"] == "taper-redis"
    pvc = find("PersistentVolumeClaim", "taper-data")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


class _StopAfterParsing(Exception):
    pass


def test_rayjob_entrypoint_is_accepted_by_job_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The entrypoint goes through job_main's real argument parser and spec loader (the spec read from the
    ConfigMap it mounts); it stops where job_main would connect to Ray."""
    from rl_service import ray_cluster
    from rl_service.training import job_main

    job = find("RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "rl_service.training.job_main"], argv
    args = dict(zip(argv[3::2], argv[4::2], strict=True))
    # the spec file is the mounted ConfigMap
    spec_path = Path(args["--spec"])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(vm for vm in head["containers"][0]["volumeMounts"] if vm["mountPath"] == str(spec_path.parent))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    local_spec = tmp_path / spec_path.name
    local_spec.write_text(find("ConfigMap", volume["configMap"]["name"])["data"][spec_path.name])
    # checkpoints (and the resume after a retry) live on the shared volume
    assert Path(args["--work-dir"]).is_relative_to("/data/taper"), args
    # inside a Ray job the entrypoint joins the job's cluster instead of starting a local Ray
    assert args.get("--ray-address") == "auto", args

    seen: dict[str, object] = {}

    def stop(address: str | None, num_cpus: int | None = None) -> None:
        seen["address"] = address
        raise _StopAfterParsing

    monkeypatch.setattr(ray_cluster, "ensure_ray", stop)
    with pytest.raises(_StopAfterParsing):
        job_main.main([a if a != args["--spec"] else str(local_spec) for a in argv[3:]])
    assert seen["address"] == "auto"


def test_rayjob_entrypoint_is_the_learner_and_the_cluster_fits_the_job() -> None:
    from rl_service.spec import JobSpec

    job = find("RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    spec_name = Path(argv[argv.index("--spec") + 1]).name
    spec = JobSpec.model_validate(yaml.safe_load(find("ConfigMap", "taper-job-spec")["data"][spec_name]))
    res = spec.resources
    # one learner trains inside the entrypoint process: the entrypoint reserves the learner's resources
    assert res.num_learners == 1
    entry_cpus = float(job["spec"]["entrypointNumCpus"])
    entry_gpus = float(job["spec"].get("entrypointNumGpus", 0))
    entry_custom = json.loads(job["spec"].get("entrypointResources", "{}"))
    assert (entry_cpus, entry_gpus, entry_custom) == (res.learner_cpus, res.learner_gpus, res.learner_resources)
    groups = [(n, g) for n, g in ray_groups(job)]

    def offers(group: dict[str, Any]) -> dict[str, float]:
        params = group["rayStartParams"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        cpus = float(params.get("num-cpus", quantity_bytes(limits["cpu"])))
        return {"CPU": cpus, "GPU": float(params.get("num-gpus", "0")), **custom_resources(group)}

    def fits(need: dict[str, float], have: dict[str, float]) -> bool:
        return all(have.get(k, 0.0) >= v for k, v in need.items())

    # the entrypoint fits on one pod, and that pod is not the CPU-only head when it asks for a GPU
    entry_need = {"CPU": entry_cpus, "GPU": entry_gpus, **entry_custom}
    homes = [n for n, g in groups if fits(entry_need, offers(g))]
    assert homes and (entry_gpus == 0 or "head" not in homes), homes
    # every rollout worker's bundle fits on a pod, and the whole job fits in the cluster
    rollout_need = {"CPU": res.rollout_cpus, "GPU": res.rollout_gpus, **res.rollout_resources}
    assert any(fits(rollout_need, offers(g)) for _, g in groups)
    total: dict[str, float] = {}
    for _, g in groups:
        for k, v in offers(g).items():
            total[k] = total.get(k, 0.0) + v * g.get("replicas", 1)
    need = {k: entry_need.get(k, 0) + rollout_need.get(k, 0) * spec.rollout.num_workers
            for k in set(entry_need) | set(rollout_need)}
    assert fits(need, total), (need, total)
    assert job["spec"]["shutdownAfterJobFinishes"] is True


def test_readme_documents_the_entry_points_and_files() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in (
        "python -m rl_service.training.job_main --spec",
        "RAY_ADDRESS=ray://taper-head-svc:10001",
        "TAPER_REDIS_URL",
        "Dockerfile.cpu",
        "Dockerfile.cuda",
        "docker-compose.yml",
        "rayjob.yaml",
        "## Sizing per model preset",
        "## Scaling rollouts vs learners",
        "## Upgrading without losing jobs",
        "## Backing up Redis and checkpoints",
    ):
        assert needle in text, needle
    for preset in ("tiny", "small", "large"):
        assert f"| `{preset}` |" in text
