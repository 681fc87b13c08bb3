"""Deployment files (tools/deploy): the Kubernetes manifests and systemd units parse, pass
the offline checks of kubectl and systemd-analyze, and agree with the services' code (the
OMNI_* names their config modules read, ports, drain grace, CLI subcommands and flags).
Both forms are checked: one scheduler (k8s/, omnifabric-scheduler.service) and the
active/standby pair on a Redis election (the k8s-ha/ overlay, omnifabric-scheduler@.service)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnifabric.common import config as settings
from omnifabric.common import schedulers
from omnifabric.edge.config import EdgeConfig, read_key_file
from omnifabric.edge.main import build_parser as edge_parser
from omnifabric.scheduler import election
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.main import build_parser as scheduler_parser
from omnifabric.tools.cli import USAGE
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.errors import ConfigError
from omnifabric.worker.main import build_parser as worker_parser
from tests.conftest import scaled

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "tools" / "deploy"
K8S = DEPLOY / "k8s"
#: The active/standby overlay of K8S: the scheduler pair and its Redis.
K8S_HA = DEPLOY / "k8s-ha"
SYSTEMD = DEPLOY / "systemd"
SERVICES = ("scheduler", "edge", "worker")
BINARY = "/opt/omnifabric/venv/bin/omnifabric"
UNITS = {
    "scheduler": "omnifabric-scheduler.service",
    "edge": "omnifabric-edge.service",
    "worker": "omnifabric-worker@.service",
}
#: One scheduler of an active/standby pair; instance N on port 5005N.
HA_UNIT = "omnifabric-scheduler@.service"
#: Every unit file, with the service it runs.
UNIT_FILES = [*UNITS.items(), ("scheduler", HA_UNIT)]
#: The Redis settings of the pair's election (Debian's redis-server), included by redis.conf.
REDIS_CONF = SYSTEMD / "redis-omnifabric.conf"
#: Images that run the omnifabric CLI (tools/deploy/Dockerfile); others (redis) do not.
OMNI_IMAGES = {"omnifabric", "omnifabric-fabric"}
#: Each service's real command-line parser.
PARSERS = {"scheduler": scheduler_parser, "edge": edge_parser, "worker": worker_parser}
CONFIGS = {"scheduler": SchedulerConfig, "edge": EdgeConfig, "worker": WorkerConfig}
#: Values the downward API would give (fieldRef), for resolving $(VAR) references.
POD_FIELDS = {"status.podIP": "10.1.2.3", "metadata.name": "omnifabric-worker-7d9f-x2x"}
#: Specifier values for expanding units, as systemd would on a GPU host.
SPECIFIERS = {"i": "3", "H": "gpu-host-1", "S": "/var/lib", "C": "/var/cache", "%": "%"}

# Field names of the Kubernetes API objects used here (core/v1, apps/v1): a misspelt
# field is dropped silently by some clients, and no API server is here to refuse it.
POD_SPEC_FIELDS = {
    "containers", "initContainers", "volumes", "terminationGracePeriodSeconds",
    "automountServiceAccountToken", "securityContext", "tolerations", "nodeSelector",
    "affinity", "serviceAccountName", "priorityClassName", "runtimeClassName",
    "topologySpreadConstraints", "imagePullSecrets", "hostNetwork", "dnsPolicy",
    "restartPolicy", "enableServiceLinks", "shareProcessNamespace",
}  # fmt: skip
CONTAINER_FIELDS = {
    "name", "image", "command", "args", "workingDir", "ports", "envFrom", "env",
    "resources", "volumeMounts", "livenessProbe", "readinessProbe", "startupProbe",
    "lifecycle", "terminationMessagePath", "terminationMessagePolicy", "imagePullPolicy",
    "securityContext", "stdin", "stdinOnce", "tty", "resizePolicy", "restartPolicy",
    "volumeDevices",
}  # fmt: skip
PROBE_FIELDS = {
    "exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "timeoutSeconds",
    "periodSeconds", "successThreshold", "failureThreshold", "terminationGracePeriodSeconds",
}  # fmt: skip
API_VERSIONS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "PersistentVolumeClaim": "v1",
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
WORKLOAD_SPEC_FIELDS = {
    "Deployment": {
        "replicas", "selector", "template", "strategy", "minReadySeconds",
        "revisionHistoryLimit", "progressDeadlineSeconds", "paused",
    },
    "StatefulSet": {
        "replicas", "selector", "template", "serviceName", "podManagementPolicy",
        "updateStrategy", "minReadySeconds", "revisionHistoryLimit", "volumeClaimTemplates",
        "persistentVolumeClaimRetentionPolicy", "ordinals",
    },
}  # fmt: skip


# --- what the code reads ------------------------------------------------------------


def omni_names(service: str) -> set[str]:
    """OMNI_* names a service reads: the string constants that are exactly such a name in
    its config.py and the shared common/logs.py and common/tls.py (the fabric TLS settings
    every service's config includes); a renamed variable drops out of this set."""
    names: set[str] = set()
    shared = (ROOT / "common" / "logs.py", ROOT / "common" / "tls.py")
    for path in (ROOT / service / "config.py", *shared):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"OMNI_[A-Z0-9_]+", node.value)
            ):
                names.add(node.value)
    return names


READ = {service: omni_names(service) for service in SERVICES}


def cli_commands() -> set[str]:
    """The subcommands `omnifabric` dispatches, from its usage text."""
    block = USAGE.split("commands:", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0] for line in block.splitlines() if line.strip()}


DRAIN_VARS = {
    "scheduler": "OMNI_SCHEDULER_DRAIN_GRACE_S",
    "edge": "OMNI_EDGE_DRAIN_GRACE_S",
    "worker": "OMNI_WORKER_DRAIN_GRACE_S",
}


def drain_grace(service: str, env: dict[str, str]) -> float:
    """The drain grace a service uses with this environment (its config default if unset)."""
    raw = env.get(DRAIN_VARS[service])
    if raw:
        return float(raw)
    config = {"scheduler": SchedulerConfig, "edge": EdgeConfig, "worker": WorkerConfig}[service]
    return float(config.__dataclass_fields__["drain_grace_s"].default)


def test_scanner_finds_the_names_the_services_read() -> None:
    """The name scan is not empty by accident: it finds names each service is known to use."""
    assert {"OMNI_SCHEDULER_PORT", "OMNI_SCHEDULER_DRAIN_GRACE_S"} <= READ["scheduler"]
    assert {"OMNI_EDGE_PORT", "OMNI_EDGE_GRPC_PORT", "OMNI_API_KEYS_FILE"} <= READ["edge"]
    assert {"OMNI_WORKER_ADVERTISE", "OMNI_WORKER_ENGINE", "OMNI_FABRIC_TLS_CA"} <= READ["worker"]
    assert all("OMNI_LOG_FORMAT" in names for names in READ.values())
    assert {"scheduler", "edge", "worker"} <= cli_commands()


# --- Kubernetes -----------------------------------------------------------------------


def load_yaml(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(directory: Path = K8S) -> dict[str, Any]:
    """A directory's kustomization.yaml, parsed."""
    (doc,) = load_yaml(directory / "kustomization.yaml")
    return doc


def base_directories(directory: Path) -> list[Path]:
    """The kustomizations a kustomization builds on (resources naming a directory)."""
    return [
        (directory / name).resolve()
        for name in kustomization(directory)["resources"]
        if (directory / name).is_dir()
    ]


def patch_files(directory: Path) -> list[str]:
    """The patch files of a kustomization."""
    return [patch["path"] for patch in kustomization(directory).get("patches", [])]


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge patch of maps only (the form the patches here take): keys merged
    recursively, scalars replaced. A list in a patch is not modelled (kustomize merges
    some lists by key) and fails the test."""
    merged = dict(target)
    for key, value in patch.items():
        assert not isinstance(value, list), f"patch lists are not modelled here: {key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def manifests(directory: Path = K8S) -> list[dict[str, Any]]:
    """The objects a kustomization applies, as kustomize builds them (less namespace, labels,
    images and the generated ConfigMap): its resources in order (a directory: that
    kustomization's objects), then its patches (`$patch: delete` removes the object named,
    any other patch is merged into it)."""
    objects: list[dict[str, Any]] = []
    for name in kustomization(directory)["resources"]:
        path = directory / name
        objects += manifests(path.resolve()) if path.is_dir() else load_yaml(path)
    for name in patch_files(directory):
        (patch,) = load_yaml(directory / name)
        key = (patch["kind"], patch["metadata"]["name"])
        found = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == key]
        assert len(found) == 1, f"{directory.name}/{name}: patches {key}, found {len(found)}"
        if patch.get("$patch") == "delete":
            del objects[found[0]]
        else:
            objects[found[0]] = merge(objects[found[0]], patch)
    return objects


def example_secret() -> dict[str, Any]:
    """The API key Secret example (not applied by kustomize)."""
    (doc,) = load_yaml(K8S / "secret-api-keys.example.yaml")
    return doc


def read_env_file(path: Path) -> tuple[dict[str, str], set[str]]:
    """(active NAME=value settings, every OMNI_* name, commented-out ones included)."""
    active: dict[str, str] = {}
    named: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        commented = re.fullmatch(r"[#;]\s*(OMNI_[A-Z0-9_]+)=.*", line)
        if commented:
            named.add(commented.group(1))
        if not line or line[0] in "#;":
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f"{path.name}: {line!r}"
        active[name] = value
        if name.startswith("OMNI_"):
            named.add(name)
    return active, named


def config_map(directory: Path = K8S) -> dict[str, str]:
    """The generated ConfigMap omnifabric-config, as kustomize builds it from env files
    (behavior merge: the base's data, then this generator's values)."""
    (generator,) = kustomization(directory)["configMapGenerator"]
    assert generator["name"] == "omnifabric-config"
    data: dict[str, str] = {}
    if generator.get("behavior") == "merge":
        (base,) = base_directories(directory)
        data.update(config_map(base))
    for name in generator["envs"]:
        data.update(read_env_file(directory / name)[0])
    return data


def workloads(directory: Path = K8S) -> list[dict[str, Any]]:
    """The Deployments and StatefulSets kustomize applies."""
    return [doc for doc in manifests(directory) if doc["kind"] in WORKLOAD_KINDS]


def runs_omnifabric(container: dict[str, Any]) -> bool:
    """Whether a container runs the omnifabric image (not, e.g., the election's Redis)."""
    return container["image"].split(":")[0] in OMNI_IMAGES


def container_pod(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a workload's template."""
    return workload["spec"]["template"]["spec"]


def service_of(container: dict[str, Any]) -> str:
    """Which omnifabric service a container runs (its first argument)."""
    service = container["args"][0]
    assert service in SERVICES, f"container {container['name']} runs {container['args']}"
    return service


def containers_by_service(
    directory: Path = K8S,
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """service -> (workload, container); one container per service."""
    found = {}
    for workload in workloads(directory):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if not runs_omnifabric(container):
                continue
            service = service_of(container)
            assert service not in found, f"two workloads run {service}"
            found[service] = (workload, container)
    assert set(found) == set(SERVICES)
    return found


def container_env(container: dict[str, Any], directory: Path = K8S) -> dict[str, str]:
    """The environment the container starts with: envFrom ConfigMap first, then env, with
    $(VAR) expanded as the kubelet does (only names defined before) and fieldRefs filled."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "omnifabric-config"
        env.update(config_map(directory))
    for entry in container.get("env", []):
        name = entry["name"]
        if "valueFrom" in entry:
            env[name] = POD_FIELDS[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            continue

        def expand(match: re.Match[str], name: str = name) -> str:
            ref = match.group(1)
            assert ref in env, f"{name} uses $({ref}) before it is defined: left unexpanded"
            return env[ref]

        env[name] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, str(entry["value"]))
    return env


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A container port given by number or by name; fails when the container lacks it."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    number = ports.get(port) if isinstance(port, str) else port
    assert number in ports.values(), f"{container['name']}: no container port {port!r}"
    return int(number)


def probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    """The container port a probe checks; fails when the container lacks it."""
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            if kind == "grpc":
                # The grpc probe takes a number only; a port name is rejected by the API.
                assert isinstance(probe["grpc"]["port"], int), probe
            return port_number(container, probe[kind]["port"])
    raise AssertionError(f"probe without a port: {probe}")


FORMS = pytest.mark.parametrize("directory", [K8S, K8S_HA], ids=["single", "ha"])


@FORMS
def test_every_manifest_parses_and_is_named(directory: Path) -> None:
    """Each YAML document has apiVersion (the right one for its kind), kind, metadata.name;
    no object is defined twice. Patches (partial objects) only name what they patch."""
    seen = set()
    patches = set(patch_files(directory))
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = load_yaml(path)
        assert docs, f"{path.name} holds no document"
        for doc in docs:
            assert doc.get("kind") in API_VERSIONS, f"{path.name}: kind {doc.get('kind')}"
            assert doc.get("apiVersion") == API_VERSIONS[doc["kind"]], f"{path.name}: {doc}"
            name = doc.get("metadata", {}).get("name")
            assert name and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), path.name
            if path.name in patches:
                continue
            assert (doc["kind"], name) not in seen, f"{doc['kind']} {name} twice"
            seen.add((doc["kind"], name))
    kinds = {kind for kind, _ in seen}
    if directory == K8S:
        assert {"Deployment", "Service", "Secret", "Namespace"} <= kinds
    else:
        assert {"StatefulSet", "Deployment", "Service", "PersistentVolumeClaim"} <= kinds


@FORMS
def test_kustomization_lists_exactly_the_files_present(directory: Path) -> None:
    """Resources, patches and generator inputs are the files of the folder, less itself and
    the examples (the Secret example must never be applied over real keys). The overlay
    builds on k8s/ alone."""
    doc = kustomization(directory)
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert doc["kind"] == "Kustomization"
    assert doc["namespace"] == "omnifabric"
    assert base_directories(directory) == ([] if directory == K8S else [K8S])
    listed = [n for n in doc["resources"] if not (directory / n).is_dir()]
    listed += patch_files(directory)
    for generator in doc.get("configMapGenerator", []):
        listed += generator.get("envs", []) + generator.get("files", [])
    assert len(listed) == len(set(listed)), listed
    present = {
        p.name
        for p in directory.iterdir()
        if p.is_file() and p.name != "kustomization.yaml" and ".example." not in p.name
    }
    assert set(listed) == present


@FORMS
def test_config_map_and_container_env_names_are_read_by_the_services(directory: Path) -> None:
    """Every OMNI_* name set for a container is one its service reads; every ConfigMap key
    is read by some service. A variable renamed in a config module fails here."""
    every = set().union(*READ.values())
    unknown = {k for k in config_map(directory) if k.startswith("OMNI_")} - every
    assert not unknown, f"ConfigMap keys no service reads: {sorted(unknown)}"
    for service, (_, container) in containers_by_service(directory).items():
        names = {e["name"] for e in container.get("env", [])}
        assert len(names) == len(container.get("env", [])), f"{service}: a name set twice"
        unknown = {n for n in names if n.startswith("OMNI_")} - READ[service]
        assert not unknown, f"{service} container sets names it never reads: {sorted(unknown)}"


@FORMS
def test_workloads_are_well_formed(directory: Path) -> None:
    """Field names exist in the API; selectors match the pod labels; probes, mounts and env
    entries refer to ports, volumes and values that exist; pods drop privileges."""
    claims = {
        d["metadata"]["name"] for d in manifests(directory) if d["kind"] == "PersistentVolumeClaim"
    }
    for workload in workloads(directory):
        name = workload["metadata"]["name"]
        spec_fields = WORKLOAD_SPEC_FIELDS[workload["kind"]]
        assert set(workload["spec"]) <= spec_fields, (
            f"{name}: {set(workload['spec']) - spec_fields}"
        )
        template = workload["spec"]["template"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        pod = template["spec"]
        assert set(pod) <= POD_SPEC_FIELDS, f"{name}: {set(pod) - POD_SPEC_FIELDS}"
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {volume}"
        for container in pod["containers"]:
            assert set(container) <= CONTAINER_FIELDS, (
                f"{name}: {set(container) - CONTAINER_FIELDS}"
            )
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"
            for entry in container.get("env", []):
                assert ("value" in entry) != ("valueFrom" in entry), f"{name}: {entry}"
                if "value" in entry:
                    assert isinstance(entry["value"], str), f"{name}: {entry} (quote it)"
            assert all(isinstance(a, str) for a in container.get("args", [])), f"{name} (quote)"
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                if kind in container:
                    assert set(container[kind]) <= PROBE_FIELDS, f"{name} {kind}"
                    probe_port(container, container[kind])
            assert "readinessProbe" in container and "livenessProbe" in container, name


@FORMS
def test_services_select_one_workload_and_target_its_ports(directory: Path) -> None:
    """Each Service selects exactly one workload's pods; each port targets a container port
    of it, under the same number."""
    for service in (d for d in manifests(directory) if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        chosen = [
            w
            for w in workloads(directory)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)}"
        (container,) = chosen[0]["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            assert port_number(container, port["targetPort"]) == port["port"], port


@FORMS
def test_container_args_parse_with_the_services_own_flags(directory: Path) -> None:
    """Flags given in a container's args exist in its service's real parser and take the
    values written there (the files use variables today; a flag added later is checked)."""
    for service, (_, container) in containers_by_service(directory).items():
        PARSERS[service]().parse_args(container["args"][1:])


def check_container_settings(
    directory: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[SchedulerConfig, WorkerConfig, EdgeConfig]:
    """Each container's environment passes its service's own config parsing, and the ports
    it yields are the container ports the Services and probes use: the three configs."""
    found = containers_by_service(directory)

    _, container = found["scheduler"]
    scheduler = SchedulerConfig.from_env(container_env(container, directory))
    assert scheduler.host == "0.0.0.0"
    assert port_number(container, "grpc") == scheduler.port
    assert port_number(container, "metrics") == scheduler.metrics_port
    assert probe_port(container, container["readinessProbe"]) == scheduler.port

    _, container = found["worker"]
    env = container_env(container, directory)
    worker = WorkerConfig.from_env(env)
    assert worker.engine == "minicpmo"
    assert worker.host == "0.0.0.0"
    assert port_number(container, "grpc") == worker.port
    assert port_number(container, "metrics") == worker.metrics_port
    assert worker.advertise_address == f"{POD_FIELDS['status.podIP']}:{worker.port}"
    assert worker.worker_id == POD_FIELDS["metadata.name"]
    assert probe_port(container, container["readinessProbe"]) == worker.port
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(worker.model_path.startswith(m + "/") for m in mounts), worker.model_path

    _, container = found["edge"]
    env = container_env(container, directory)
    keys_file = Path(env["OMNI_API_KEYS_FILE"])
    secret = example_secret()
    (volume,) = [
        v
        for v in container_pod(found["edge"][0])["volumes"]
        if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]
    ]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    (item,) = volume["secret"]["items"]
    assert keys_file == Path(mount["mountPath"]) / item["path"]
    assert item["key"] in secret["stringData"]
    # The Secret's key file as the edge would read it, at a path that exists here.
    real_keys = tmp_path / "api-keys"
    real_keys.write_text("k-0123456789abcdef max_sessions=2\n")
    env["OMNI_API_KEYS_FILE"] = str(real_keys)
    for name in [n for n in os.environ if n.startswith("OMNI_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    edge = EdgeConfig.from_env()
    assert edge.host == "0.0.0.0"
    assert len(edge.api_key_digests) == 1
    assert port_number(container, "http") == edge.port
    assert port_number(container, "grpc") == edge.grpc_port
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/healthz"
    assert probe_port(container, readiness) == edge.port
    return scheduler, worker, edge


def test_container_settings_are_valid_for_the_services_and_match_the_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The single form: settings valid, ports matching; edges and workers dial the
    scheduler's Service; the scheduler runs without an election."""
    scheduler, worker, edge = check_container_settings(K8S, monkeypatch, tmp_path)
    assert scheduler.ha is None
    assert worker.scheduler_address == "omnifabric-scheduler:50051"
    assert edge.scheduler == "omnifabric-scheduler:50051"


def test_example_secret_holds_no_usable_key(tmp_path: Path) -> None:
    """Applied as it is, the example stops the edge (no key) instead of opening it."""
    secret = example_secret()
    assert secret["kind"] == "Secret"
    for directory in (K8S, K8S_HA):
        assert secret["metadata"]["name"] not in {
            d["metadata"]["name"] for d in manifests(directory)
        }
    (text,) = secret["stringData"].values()
    path = tmp_path / "api-keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(str(path))


@FORMS
def test_workers_take_one_gpu_each_and_advertise_the_pod_ip(directory: Path) -> None:
    """Every worker pod limits nvidia.com/gpu to 1 and advertises status.podIP."""
    for workload in workloads(directory):
        for container in container_pod(workload)["containers"]:
            if not runs_omnifabric(container) or service_of(container) != "worker":
                continue
            assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
            env = {e["name"]: e for e in container["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["OMNI_WORKER_ADVERTISE"]["value"].startswith("$(POD_IP):")
            # No surge: a new pod would wait for the GPU its predecessor still holds.
            assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_one_scheduler_replaced_not_rolled() -> None:
    """A single scheduler, and never two at once (they would split workers and queue)."""
    workload, _ = containers_by_service()["scheduler"]
    assert workload["kind"] == "Deployment"
    assert workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"]["type"] == "Recreate"


@FORMS
def test_termination_grace_outlasts_prestop_and_drain(directory: Path) -> None:
    """terminationGracePeriodSeconds > preStop sleep + the service's drain grace."""
    for service, (workload, container) in containers_by_service(directory).items():
        grace = drain_grace(service, container_env(container, directory))
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep = float(pre_stop["command"][1]) if pre_stop.get("command", [""])[0] == "sleep" else 0
        assert container_pod(workload)["terminationGracePeriodSeconds"] > sleep + grace, service


# --- Kubernetes: the active/standby pair (k8s-ha) ------------------------------------


def named(directory: Path, kind: str, name: str) -> dict[str, Any]:
    """The one object of that kind and name a kustomization applies."""
    (doc,) = [
        d for d in manifests(directory) if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    return doc


def ha_scheduler_addresses() -> tuple[str, ...]:
    """The address of every scheduler pod of the overlay, as cluster DNS forms it for a
    StatefulSet under its headless Service: POD.SERVICE:PORT, POD = NAME-ORDINAL."""
    workload, container = containers_by_service(K8S_HA)["scheduler"]
    service = named(K8S_HA, "Service", workload["spec"]["serviceName"])
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["targetPort"] in ("grpc", 50051)]
    assert port_number(container, "grpc") == port
    name, replicas = workload["metadata"]["name"], workload["spec"]["replicas"]
    return tuple(
        f"{name}-{ordinal}.{service['metadata']['name']}:{port}" for ordinal in range(replicas)
    )


def test_ha_overlay_keeps_the_single_form_and_replaces_only_its_scheduler() -> None:
    """The overlay takes every object of k8s/ but the scheduler Deployment, adds the pair
    and Redis, and changes only the scheduler addresses of the shared settings."""
    single = {(d["kind"], d["metadata"]["name"]) for d in manifests(K8S)}
    pair = {(d["kind"], d["metadata"]["name"]) for d in manifests(K8S_HA)}
    assert single - pair == {("Deployment", "omnifabric-scheduler")}
    assert pair - single == {
        ("StatefulSet", "omnifabric-scheduler"),
        ("Deployment", "omnifabric-redis"),
        ("Service", "omnifabric-redis"),
        ("PersistentVolumeClaim", "omnifabric-redis"),
    }
    base, overlay = config_map(K8S), config_map(K8S_HA)
    changed = {k for k in base.keys() | overlay.keys() if base.get(k) != overlay.get(k)}
    assert changed == {"OMNI_EDGE_SCHEDULER", "OMNI_WORKER_SCHEDULER"}
    for service in ("edge", "worker"):
        _, container = containers_by_service(K8S_HA)[service]
        assert container == containers_by_service(K8S)[service][1], service
    # The overlay tags the fabric image the scheduler pods use as k8s/ tags the edge's.
    tags = {
        directory: {i["name"]: i for i in kustomization(directory)["images"]}
        for directory in (K8S, K8S_HA)
    }
    assert tags[K8S_HA]["omnifabric-fabric"] == tags[K8S]["omnifabric-fabric"]


def test_ha_scheduler_pair_is_dialable_pod_by_pod_and_elects_through_redis(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two scheduler pods of a StatefulSet, each with a DNS name of its own under a
    headless Service; edges and workers list exactly those names; each pod runs the
    election against the Redis Service with a short TTL; no probe needs the leader."""
    scheduler, worker, edge = check_container_settings(K8S_HA, monkeypatch, tmp_path)
    workload, container = containers_by_service(K8S_HA)["scheduler"]
    assert workload["kind"] == "StatefulSet"
    assert workload["spec"]["replicas"] == 2
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    service = named(K8S_HA, "Service", workload["spec"]["serviceName"])
    # Headless: the service name resolves to each pod, and POD.SERVICE to one pod, from the
    # pod's start (before readiness).
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()

    expected = ha_scheduler_addresses()
    assert expected == (
        "omnifabric-scheduler-0.omnifabric-scheduler:50051",
        "omnifabric-scheduler-1.omnifabric-scheduler:50051",
    )
    assert schedulers.addresses(worker.scheduler_address) == expected
    assert schedulers.addresses(edge.scheduler) == expected

    assert scheduler.ha is not None
    store = election.parse_store_url(scheduler.ha)
    assert not store.sentinel
    ((host, port),) = store.hosts
    redis_service = named(K8S_HA, "Service", host)
    assert port in {p["port"] for p in redis_service["spec"]["ports"]}
    (redis,) = [
        w
        for w in workloads(K8S_HA)
        if redis_service["spec"]["selector"].items()
        <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert not runs_omnifabric(container_pod(redis)["containers"][0])
    # A short TTL: a crashed leader's successor leads within about it.
    assert scheduler.ha_ttl_s <= 5

    # A standby reports NOT_SERVING on grpc.health.v1: probing that would keep it unready
    # and restart it. The probes check the port is open.
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if kind in container:
            assert "grpc" not in container[kind], f"{kind} needs the leader"
            assert probe_port(container, container[kind]) == scheduler.port


def test_ha_redis_keeps_the_epoch_on_a_volume() -> None:
    """Redis writes every change to its append-only file, on a PersistentVolumeClaim,
    before answering: the epoch counter survives a restart or a rescheduled pod (workers
    refuse a leader with a lower epoch than one they saw). One pod, replaced with Recreate
    (the volume is ReadWriteOnce); the Debian-based official image."""
    (redis,) = [
        w for w in workloads(K8S_HA) if not runs_omnifabric(container_pod(w)["containers"][0])
    ]
    assert redis["kind"] == "Deployment" and redis["spec"]["replicas"] == 1
    assert redis["spec"]["strategy"]["type"] == "Recreate"
    (container,) = container_pod(redis)["containers"]
    assert container["image"] == "redis"
    images = {i["name"]: i for i in kustomization(K8S_HA)["images"]}
    assert images["redis"]["newTag"].endswith("-bookworm")
    command, *options = container["args"]
    assert command == "redis-server" and len(options) % 2 == 0
    option = dict(zip(options[::2], options[1::2], strict=True))
    assert option["--appendonly"] == "yes"
    assert option["--appendfsync"] == "always"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == option["--dir"]]
    (volume,) = [v for v in container_pod(redis)["volumes"] if v["name"] == mount["name"]]
    claim = named(K8S_HA, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    security = container_pod(redis)["securityContext"]
    assert security["fsGroup"] == security["runAsGroup"]
    assert port_number(container, "redis") == 6379


def kubectl_kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize DIR`: builds offline, without a cluster or a kubeconfig."""
    return subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=scaled(30),
        env={**os.environ, "KUBECONFIG": os.devnull},
    )


def strip_built(doc: dict[str, Any]) -> dict[str, Any]:
    """A built object less what kustomize adds (namespace, part-of label) and what these
    tests model separately (images, the ConfigMap's hashed name)."""
    doc = json.loads(json.dumps(doc))
    doc["metadata"].pop("namespace", None)
    labels = doc["metadata"].get("labels", {})
    labels.pop("app.kubernetes.io/part-of", None)
    if not labels:
        doc["metadata"].pop("labels", None)
    if doc["kind"] in WORKLOAD_KINDS:
        for container in container_pod(doc)["containers"]:
            container["image"] = container["image"].split(":")[0]
            for source in container.get("envFrom", []):
                source["configMapRef"]["name"] = "omnifabric-config"
    return doc


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
@FORMS
def test_kubectl_kustomize_builds_offline(directory: Path) -> None:
    """`kubectl kustomize` (no API server needed) builds the stack: every object in the
    namespace, the ConfigMap hashed and referenced by that name, the image set; the objects
    are the ones the offline model above checks, field for field."""
    result = kubectl_kustomize(directory)
    assert result.returncode == 0, result.stderr
    built = list(yaml.safe_load_all(result.stdout))
    names = {(d["kind"], d["metadata"]["name"]) for d in built}
    (config,) = [d for d in built if d["kind"] == "ConfigMap"]
    assert re.fullmatch(r"omnifabric-config-[a-z0-9]{10}", config["metadata"]["name"])
    assert config["data"] == config_map(directory)
    expected = {(d["kind"], d["metadata"]["name"]): d for d in manifests(directory)}
    assert names == set(expected) | {("ConfigMap", config["metadata"]["name"])}
    for doc in built:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in expected:
            assert strip_built(doc) == expected[key], key
    images = {
        i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}"
        for i in kustomization(directory)["images"]
    }
    for base in base_directories(directory):
        for i in kustomization(base)["images"]:
            images.setdefault(i["name"], f"{i.get('newName', i['name'])}:{i['newTag']}")
    # Edge and scheduler run the slim image (base install, no torch), workers the full one.
    role_image = {"edge": "omnifabric-fabric", "scheduler": "omnifabric-fabric", "redis": "redis"}
    for doc in built:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "omnifabric", doc["metadata"]
        if doc["kind"] in WORKLOAD_KINDS:
            for container in container_pod(doc)["containers"]:
                role = doc["metadata"]["name"].removeprefix("omnifabric-")
                assert container["image"] == images[role_image.get(role, "omnifabric")], role
                if runs_omnifabric(container):
                    reference = container["envFrom"][0]["configMapRef"]["name"]
                    assert reference == config["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_fails_on_a_missing_resource(tmp_path: Path) -> None:
    """The kustomize check can fail: a kustomization naming a missing file is refused."""
    broken = tmp_path / "k8s"
    shutil.copytree(K8S, broken)
    text = (broken / "kustomization.yaml").read_text()
    (broken / "kustomization.yaml").write_text(
        text.replace("  - worker.yaml\n", "  - worker.yaml\n  - gone.yaml\n")
    )
    result = kubectl_kustomize(broken)
    assert result.returncode != 0
    assert "gone.yaml" in result.stderr


# --- systemd ------------------------------------------------------------------------------


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file, each a list of (key, value) in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path.name}: continuation lines are not parsed here"
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current, f"{path.name}: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], key: str, section: str = "Service") -> list[str]:
    """Every value of `key` in `section`, in order."""
    return [v for k, v in unit.get(section, []) if k == key]


def expand(value: str, credentials: str = "/run/credentials/unit") -> str:
    """Expand the specifiers the units use; any other one fails the test."""

    def one(match: re.Match[str]) -> str:
        letter = match.group(1)
        if letter == "d":
            return credentials
        assert letter in SPECIFIERS, f"specifier %{letter} not modelled in this test"
        return SPECIFIERS[letter]

    return re.sub(r"%(.)", one, value)


def unit_env(
    service: str, credentials: str = "/run/credentials/unit", unit_file: str | None = None
) -> dict[str, str]:
    """The environment a unit (the service's, or `unit_file`) starts with: Environment=
    lines, then the EnvironmentFile=s in order (their example files stand in), later ones
    winning."""
    unit = parse_unit(SYSTEMD / (unit_file or UNITS[service]))
    env: dict[str, str] = {}
    for line in values(unit, "Environment"):
        for assignment in line.split():
            name, _, value = assignment.partition("=")
            env[name] = expand(value, credentials)
    for path in values(unit, "EnvironmentFile"):
        example = SYSTEMD / (Path(path.lstrip("-")).name + ".example")
        if example.exists():
            env.update(read_env_file(example)[0])
    return env


def test_units_run_the_cli_as_a_dedicated_user_and_outlast_the_drain() -> None:
    """ExecStart is the venv's omnifabric with a real subcommand; a dedicated user; restart
    on failure; SIGTERM; a stop timeout longer than the drain grace; per-service env file."""
    commands = cli_commands()
    (sysusers,) = [
        line.split()[1]
        for line in (SYSTEMD / "omnifabric.sysusers.conf").read_text().splitlines()
        if line.startswith("u ")
    ]
    for service, name in UNIT_FILES:
        unit = parse_unit(SYSTEMD / name)
        (exec_start,) = values(unit, "ExecStart")
        binary, command, *flags = exec_start.split()
        assert binary == BINARY and command == service and command in commands
        # Flags, if any, exist in the service's own parser (the units use variables today).
        PARSERS[service]().parse_args([expand(f) for f in flags])
        assert values(unit, "User") == [sysusers]
        assert values(unit, "Restart") == ["on-failure"]
        assert values(unit, "KillSignal") == ["SIGTERM"]
        assert values(unit, "NoNewPrivileges") == ["yes"]
        assert f"-/etc/omnifabric/{service}.env" in values(unit, "EnvironmentFile")
        assert values(unit, "WantedBy", "Install") == ["multi-user.target"]
        grace = drain_grace(service, unit_env(service, unit_file=name))
        (stop,) = values(unit, "TimeoutStopSec")
        # Room after the drain for the process to stop (the worker frees the GPU).
        assert float(stop) > grace + 5, f"{name}: TimeoutStopSec={stop}, drain {grace} s"


def test_worker_unit_binds_one_gpu_and_keeps_cuda_reachable() -> None:
    """CUDA_VISIBLE_DEVICES is the instance; nothing hides /dev/nvidia*."""
    unit = parse_unit(SYSTEMD / UNITS["worker"])
    env = values(unit, "Environment")
    assert "CUDA_VISIBLE_DEVICES=%i" in env
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
    assert values(unit, "PrivateDevices") in ([], ["no"])
    assert values(unit, "DevicePolicy") in ([], ["auto"])
    assert not values(unit, "PrivateUsers") and not values(unit, "MemoryDenyWriteExecute")


def test_unit_and_env_example_names_are_read_by_the_services() -> None:
    """OMNI_* names in Environment= lines and in the env examples (commented-out ones too)
    are read by that service; common.env's by every service."""
    for path in sorted(SYSTEMD.glob("*.env.example")):
        _, named = read_env_file(path)
        service = path.name.split(".")[0]
        if service == "common":
            expected = set.intersection(*READ.values())
        else:
            expected = READ[service]
        assert named, f"{path.name} names no variable"
        assert not named - expected, f"{path.name}: not read: {sorted(named - expected)}"
    for service, name in UNIT_FILES:
        unit = parse_unit(SYSTEMD / name)
        names = {
            a.partition("=")[0]
            for line in values(unit, "Environment")
            for a in line.split()
            if a.startswith("OMNI_")
        }
        assert not names - READ[service], f"{name}: not read: {sorted(names - READ[service])}"
    examples = {p.name for p in SYSTEMD.glob("*.env.example")}
    for _, name in UNIT_FILES:
        for path in values(parse_unit(SYSTEMD / name), "EnvironmentFile"):
            base = Path(path.lstrip("-")).name
            if "%" not in base:
                assert base + ".example" in examples, f"{name}: {base} has no example"


def test_unit_settings_are_valid_for_the_services(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Unit + example env pass each service's own config parsing; worker instances 0-9 get
    distinct valid ports, instance 10 a clear error (the limit the unit documents)."""
    scheduler = SchedulerConfig.from_env(unit_env("scheduler"))
    assert (scheduler.host, scheduler.port) == ("0.0.0.0", 50051)

    ports = set()
    for instance in range(10):
        monkeypatch.setitem(SPECIFIERS, "i", str(instance))
        worker = WorkerConfig.from_env(unit_env("worker"))
        assert worker.advertise_address == f"gpu-host-1:{worker.port}"
        assert worker.worker_id == f"gpu-host-1-gpu{instance}"
        assert worker.engine == "minicpmo" and worker.model_path
        ports |= {worker.port, worker.metrics_port}
    assert len(ports) == 20
    assert ports.isdisjoint({50051, 9150, 8006, 8007})
    monkeypatch.setitem(SPECIFIERS, "i", "10")
    with pytest.raises(ConfigError, match="OMNI_WORKER_PORT"):
        WorkerConfig.from_env(unit_env("worker"))

    credentials = tmp_path / "credentials"
    credentials.mkdir()
    ((source,),) = [values(parse_unit(SYSTEMD / UNITS["edge"]), "LoadCredential")]
    (credentials / source.split(":")[0]).write_text("k-0123456789abcdef\n")
    for name in [n for n in os.environ if n.startswith("OMNI_")]:
        monkeypatch.delenv(name)
    for name, value in unit_env("edge", str(credentials)).items():
        monkeypatch.setenv(name, value)
    edge = EdgeConfig.from_env()
    assert (edge.host, edge.port, edge.grpc_port) == ("0.0.0.0", 8006, 8007)
    assert len(edge.api_key_digests) == 1


def commented_settings(path: Path) -> dict[str, list[str]]:
    """NAME -> the values of the commented-out `# NAME=value` lines of an env file (the
    examples show alternatives that way)."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"#\s*(OMNI_[A-Z0-9_]+)=(.*)", line.strip())
        if match:
            found.setdefault(match.group(1), []).append(match.group(2))
    return found


def redis_directives(path: Path) -> dict[str, list[str]]:
    """Directive -> its arguments, of a redis.conf-style file (comments skipped)."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, *arguments = line.split()
        assert name not in found, f"{path.name}: {name} twice"
        found[name] = arguments
    return found


def test_ha_unit_pairs_through_one_redis_and_edges_and_workers_list_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """omnifabric-scheduler@N: port 5005N, metrics 915N (instances 0-9), always in an
    election (never leading alone), never beside the single scheduler. The pair @1/@2 is
    what the edge and worker examples list; the Redis settings keep the epoch counter on
    disk and listen where the units' store address points."""
    unit = parse_unit(SYSTEMD / HA_UNIT)
    assert UNITS["scheduler"] in " ".join(values(unit, "Conflicts", "Unit")).split()
    assert "redis-server.service" in " ".join(values(unit, "After", "Unit")).split()
    assert "-/etc/omnifabric/scheduler-%i.env" in values(unit, "EnvironmentFile")
    pair: dict[int, SchedulerConfig] = {}
    ports: set[int] = set()
    for instance in range(10):
        monkeypatch.setitem(SPECIFIERS, "i", str(instance))
        config = SchedulerConfig.from_env(unit_env("scheduler", unit_file=HA_UNIT))
        assert (config.port, config.metrics_port) == (50050 + instance, 9150 + instance)
        assert config.ha is not None and config.ha_ttl_s <= 5
        ports |= {config.port, config.metrics_port}
        pair[instance] = config
    assert len(ports) == 20
    worker_ports = {p for n in range(10) for p in (22400 + n, 9160 + n)}
    assert ports.isdisjoint(worker_ports | {8006, 8007})
    monkeypatch.setitem(SPECIFIERS, "i", "10")
    with pytest.raises(ValueError, match="OMNI_SCHEDULER_PORT"):
        SchedulerConfig.from_env(unit_env("scheduler", unit_file=HA_UNIT))

    # The default store: Redis on the same host, where redis-omnifabric.conf's Redis is.
    redis = redis_directives(REDIS_CONF)
    assert redis["appendonly"] == ["yes"] and redis["appendfsync"] == ["always"]
    redis_port = int(redis.get("port", ["6379"])[0])
    store = election.parse_store_url(pair[1].ha or "")
    assert store.hosts == (("127.0.0.1", redis_port),)
    # The shared store of two hosts (scheduler.env): a password, as redis-omnifabric.conf
    # requires for remote clients (commented there: `# requirepass ...`).
    (shared,) = commented_settings(SYSTEMD / "scheduler.env.example")["OMNI_SCHEDULER_HA"]
    store = election.parse_store_url(shared)
    assert store.password and store.hosts[0][1] == redis_port
    assert re.search(r"^#\s*requirepass \S+$", REDIS_CONF.read_text(), re.M)
    (ttl,) = commented_settings(SYSTEMD / "scheduler.env.example")["OMNI_SCHEDULER_HA_TTL_S"]
    assert float(ttl) == pair[1].ha_ttl_s

    # Edges and workers: the example pair is @1 and @2, by their ports.
    expected_ports = [pair[1].port, pair[2].port]
    (worker_pair,) = commented_settings(SYSTEMD / "worker.env.example")["OMNI_WORKER_SCHEDULER"]
    (edge_pair,) = commented_settings(SYSTEMD / "edge.env.example")["OMNI_EDGE_SCHEDULER"]
    assert worker_pair == edge_pair
    addresses = schedulers.addresses(worker_pair)
    assert [int(a.rpartition(":")[2]) for a in addresses] == expected_ports
    assert len({a.rpartition(":")[0] for a in addresses}) == 2, "two hosts"
    monkeypatch.setitem(SPECIFIERS, "i", "0")
    worker = WorkerConfig.from_env({**unit_env("worker"), "OMNI_WORKER_SCHEDULER": worker_pair})
    assert worker.scheduler_address == worker_pair
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "api-keys").write_text("k-0123456789abcdef\n")
    for name in [n for n in os.environ if n.startswith("OMNI_")]:
        monkeypatch.delenv(name)
    for name, value in unit_env("edge", str(credentials)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMNI_EDGE_SCHEDULER", edge_pair)
    assert EdgeConfig.from_env().scheduler == edge_pair


#: A comment naming the flag of the setting below it: `... (--ha): ...`.
FLAG_NOTE = re.compile(r"\((--[a-z][a-z0-9-]*)\)")
VARIABLE_SERVICE = {"OMNI_SCHEDULER_": "scheduler", "OMNI_EDGE_": "edge", "OMNI_WORKER_": "worker"}


def noted_flags(path: Path) -> dict[str, tuple[str, str]]:
    """OMNI_* name -> (the flag named `(--flag)` in the comment lines just above the line
    that sets it, the value set), for a manifest (`- name:` then `value:`), a unit
    (`Environment=`) or an env file."""
    notes: dict[str, tuple[str, str]] = {}
    comment: list[str] = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        match = re.match(r"(?:- name: |Environment=)?(OMNI_[A-Z0-9_]+)(?:=(\S*))?$", stripped)
        flags = FLAG_NOTE.findall(" ".join(comment)) if match else []
        comment = []
        if not flags:
            continue
        assert match is not None
        (flag,) = flags
        raw = match.group(2)
        if raw is None:  # a manifest: the value is on the next line
            key, _, raw = lines[number + 1].strip().partition(": ")
            assert key == "value", f"{path.name}: {match.group(1)} has no value line"
            raw = str(yaml.safe_load(raw))
        notes[match.group(1)] = (flag, expand(raw))
    return notes


def test_flags_named_beside_settings_are_the_services_own() -> None:
    """Where a file names the flag of a variable it sets, `(--flag)`, that flag is the
    same setting's in the service's real parser, and the parser takes the value set there
    to the same effect. The pair's files name --ha and --ha-ttl that way."""
    files = [
        *sorted(K8S.glob("*.yaml")),
        *sorted(K8S_HA.glob("*.yaml")),
        *sorted(SYSTEMD.glob("*.service")),
        *sorted(SYSTEMD.glob("*.env.example")),
    ]
    seen: dict[str, set[str]] = {}
    for path in files:
        for variable, (flag, value) in noted_flags(path).items():
            (service,) = [s for p, s in VARIABLE_SERVICE.items() if variable.startswith(p)]
            cls = CONFIGS[service]
            (field,) = [n for n, s in settings.settings(cls).items() if s.env == variable]
            assert flag in settings.settings(cls)[field].flags, f"{path.name}: {variable} {flag}"
            args = PARSERS[service]().parse_args([flag, value])
            expected = getattr(settings.load(cls, {variable: value}), field)
            assert getattr(args, field) == expected, f"{path.name}: {flag} {value}"
            seen.setdefault(path.name, set()).add(flag)
    assert seen["scheduler.yaml"] == {"--ha", "--ha-ttl"}  # k8s-ha/scheduler.yaml
    assert seen[HA_UNIT] == {"--ha", "--ha-ttl"}


def verify_units(directory: Path, stub: Path) -> list[str]:
    """Problems `systemd-analyze verify` reports for copies of the units in `directory`,
    with ExecStart pointed at an existing executable (the venv is not installed here).
    Unknown keys and sections are only warnings (exit 0), so any output is a problem."""
    problems = []
    for _, name in UNIT_FILES:
        text = (directory / name).read_text()
        assert BINARY in text
        (directory / name).write_text(text.replace(BINARY, str(stub)))
        instance = name.replace("@.", "@0.")
        result = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", f"./{instance}"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=scaled(30),
        )
        output = (result.stdout + result.stderr).strip()
        if result.returncode != 0 or output:
            problems.append(f"{instance} (exit {result.returncode}): {output}")
    return problems


def unit_copies(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of the unit files under tmp_path, and a stub executable for ExecStart."""
    directory = tmp_path / "units"
    directory.mkdir()
    for _, name in UNIT_FILES:
        shutil.copy(SYSTEMD / name, directory / name)
    stub = tmp_path / "omnifabric"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return directory, stub


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not on PATH"
)


@needs_systemd_analyze
def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    """`systemd-analyze verify` on every unit (the worker as instance @0): no output."""
    assert verify_units(*unit_copies(tmp_path)) == []


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_an_unknown_key(tmp_path: Path) -> None:
    """The verify check can fail: a misspelt key in a copy of a unit is reported."""
    directory, stub = unit_copies(tmp_path)
    path = directory / UNITS["scheduler"]
    path.write_text(path.read_text().replace("[Service]\n", "[Service]\nRestartt=always\n"))
    problems = verify_units(directory, stub)
    assert any(
        p.startswith(UNITS["scheduler"]) and "Unknown key" in p and "Restartt" in p
        for p in problems
    ), problems


@needs_systemd_analyze
def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=true`: exposure (0 safe .. 10 unsafe) at most 2
    for schedulers and edge, 4 for the worker (it must keep the GPU devices and JIT code)."""
    directory, stub = unit_copies(tmp_path)
    assert verify_units(directory, stub) == []
    limits = {"scheduler": 2.0, "edge": 2.0, "worker": 4.0}
    for service, name in UNIT_FILES:
        limit = limits[service]
        instance = name.replace("@.", "@0.")
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", "--no-pager", f"./{instance}"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=scaled(30),
        )
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
        assert match, result.stdout + result.stderr
        assert float(match.group(1)) <= limit, f"{instance}: exposure {match.group(1)}"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="no systemd-sysusers")
def test_sysusers_creates_the_unit_user(tmp_path: Path) -> None:
    """The sysusers file creates the user the units run as (in a scratch root)."""
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "omnifabric.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert result.returncode == 0, result.stderr
    users = {line.split(":")[0] for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    for _, name in UNIT_FILES:
        assert set(values(parse_unit(SYSTEMD / name), "User")) <= users


# --- image --------------------------------------------------------------------------------


def test_dockerfile_copies_what_exists_and_installs_the_project_pins() -> None:
    """Not built here (no container runtime): its COPY sources exist, pinned.py gives the
    project's torch and grpcio-tools pins, and the entrypoint is the omnifabric CLI."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+$", text, re.M)
    copied = set()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            copied.add(source)
    # Every folder the package is built from reaches the image: copied, and let through
    # the build context's ignore file (`*`, then `!FOLDER/` for what is kept).
    with (ROOT / "pyproject.toml").open("rb") as file:
        folders = set(tomllib.load(file)["tool"]["setuptools"]["package-dir"].values())
    kept = set(re.findall(r"^!(\S+)/$", (DEPLOY / "Dockerfile.dockerignore").read_text(), re.M))
    for folder in folders:
        top = folder.split("/")[0]
        assert top in copied, f"{folder}: the package folder is not copied into the image"
        assert top in kept, f"{folder}: Dockerfile.dockerignore keeps it out of the context"
    # torch only for the extras that need it: the fabric image (EXTRAS=ha) has none.
    assert re.search(r"EXTRAS=ha\b", text)
    (torch_step,) = [s for s in text.split("\nRUN ") if "pinned.py torch" in s and "case" in s]
    assert "*,minicpmo,*|*,reference,*)" in torch_step
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", text, re.M)
    assert json.loads(entrypoint)[-1] == "omnifabric"
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "pinned.py"), "torch", "grpcio-tools"],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert result.returncode == 0, result.stderr
    with (ROOT / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    extras = project["optional-dependencies"]
    assert result.stdout.split() == [
        next(d for d in extras["minicpmo"] if d.startswith("torch==")),
        next(d for d in project["dependencies"] if d.startswith("grpcio-tools==")),
    ]
    missing = subprocess.run(
        [sys.executable, str(DEPLOY / "pinned.py"), "numpy"],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert missing.returncode == 1 and "numpy is not pinned" in missing.stderr
