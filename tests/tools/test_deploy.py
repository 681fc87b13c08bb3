"""Deployment files (tools/deploy): the Kubernetes manifests and systemd units parse, pass
the offline checks of kubectl and systemd-analyze, and agree with the services' code (the
OMNI_* names their config modules read, ports, drain grace, CLI subcommands)."""

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

from omnifabric.edge.config import EdgeConfig, read_key_file
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.tools.cli import USAGE
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.errors import ConfigError
from tests.conftest import scaled

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "tools" / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
SERVICES = ("scheduler", "edge", "worker")
BINARY = "/opt/omnifabric/venv/bin/omnifabric"
UNITS = {
    "scheduler": "omnifabric-scheduler.service",
    "edge": "omnifabric-edge.service",
    "worker": "omnifabric-worker@.service",
}
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
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


# --- what the code reads ------------------------------------------------------------


def omni_names(service: str) -> set[str]:
    """OMNI_* names a service reads: the string constants that are exactly such a name in
    its config.py and the shared common/logs.py (a renamed variable drops out of this set)."""
    names: set[str] = set()
    for path in (ROOT / service / "config.py", ROOT / "common" / "logs.py"):
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


def kustomization() -> dict[str, Any]:
    """kustomization.yaml, parsed."""
    (doc,) = load_yaml(K8S / "kustomization.yaml")
    return doc


def manifests() -> list[dict[str, Any]]:
    """The objects kustomization.yaml applies (resources), in file order."""
    return [doc for name in kustomization()["resources"] for doc in load_yaml(K8S / name)]


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


def config_map() -> dict[str, str]:
    """The generated ConfigMap omnifabric-config, as kustomize builds it from env files."""
    (generator,) = kustomization()["configMapGenerator"]
    assert generator["name"] == "omnifabric-config"
    data: dict[str, str] = {}
    for name in generator["envs"]:
        data.update(read_env_file(K8S / name)[0])
    return data


def workloads() -> list[dict[str, Any]]:
    """The Deployments and StatefulSets kustomize applies."""
    return [doc for doc in manifests() if doc["kind"] in WORKLOAD_KINDS]


def container_pod(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a workload's template."""
    return workload["spec"]["template"]["spec"]


def service_of(container: dict[str, Any]) -> str:
    """Which omnifabric service a container runs (its first argument)."""
    service = container["args"][0]
    assert service in SERVICES, f"container {container['name']} runs {container['args']}"
    return service


def containers_by_service() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """service -> (workload, container); one container per service."""
    found = {}
    for workload in workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            service = service_of(container)
            assert service not in found, f"two workloads run {service}"
            found[service] = (workload, container)
    assert set(found) == set(SERVICES)
    return found


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the container starts with: envFrom ConfigMap first, then env, with
    $(VAR) expanded as the kubelet does (only names defined before) and fieldRefs filled."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "omnifabric-config"
        env.update(config_map())
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


def test_every_manifest_parses_and_is_named() -> None:
    """Each YAML document has apiVersion (the right one for its kind), kind, metadata.name."""
    seen = set()
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = load_yaml(path)
        assert docs, f"{path.name} holds no document"
        for doc in docs:
            assert doc.get("kind") in API_VERSIONS, f"{path.name}: kind {doc.get('kind')}"
            assert doc.get("apiVersion") == API_VERSIONS[doc["kind"]], f"{path.name}: {doc}"
            name = doc.get("metadata", {}).get("name")
            assert name and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), path.name
            assert (doc["kind"], name) not in seen, f"{doc['kind']} {name} twice"
            seen.add((doc["kind"], name))
    kinds = {kind for kind, _ in seen}
    assert {"Deployment", "Service", "Secret", "Namespace"} <= kinds


def test_kustomization_lists_exactly_the_files_present() -> None:
    """Resources and generator inputs are the files of k8s/, less itself and the examples
    (the Secret example must never be applied over real keys)."""
    doc = kustomization()
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert doc["kind"] == "Kustomization"
    listed = list(doc["resources"])
    for generator in doc.get("configMapGenerator", []):
        listed += generator.get("envs", []) + generator.get("files", [])
    assert len(listed) == len(set(listed)), listed
    present = {
        p.name
        for p in K8S.iterdir()
        if p.name != "kustomization.yaml" and ".example." not in p.name
    }
    assert set(listed) == present


def test_config_map_and_container_env_names_are_read_by_the_services() -> None:
    """Every OMNI_* name set for a container is one its service reads; every ConfigMap key
    is read by some service. A variable renamed in a config module fails here."""
    every = set().union(*READ.values())
    unknown = {k for k in config_map() if k.startswith("OMNI_")} - every
    assert not unknown, f"ConfigMap keys no service reads: {sorted(unknown)}"
    for service, (_, container) in containers_by_service().items():
        names = {e["name"] for e in container.get("env", [])}
        assert len(names) == len(container.get("env", [])), f"{service}: a name set twice"
        unknown = {n for n in names if n.startswith("OMNI_")} - READ[service]
        assert not unknown, f"{service} container sets names it never reads: {sorted(unknown)}"


def test_workloads_are_well_formed() -> None:
    """Field names exist in the API; selectors match the pod labels; probes, mounts and env
    entries refer to ports, volumes and values that exist; pods drop privileges."""
    for workload in workloads():
        name = workload["metadata"]["name"]
        template = workload["spec"]["template"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        pod = template["spec"]
        assert set(pod) <= POD_SPEC_FIELDS, f"{name}: {set(pod) - POD_SPEC_FIELDS}"
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"] for v in pod.get("volumes", [])}
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
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                if kind in container:
                    assert set(container[kind]) <= PROBE_FIELDS, f"{name} {kind}"
                    probe_port(container, container[kind])
            assert "readinessProbe" in container and "livenessProbe" in container, name


def test_services_select_one_workload_and_target_its_ports() -> None:
    """Each Service selects exactly one workload's pods; each port targets a container port
    of it, under the same number."""
    for service in (d for d in manifests() if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        chosen = [
            w
            for w in workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)}"
        (container,) = chosen[0]["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            assert port_number(container, port["targetPort"]) == port["port"], port


def test_container_settings_are_valid_for_the_services_and_match_the_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each container's environment passes its service's own config parsing, and the ports
    it yields are the container ports the Services and probes use."""
    found = containers_by_service()

    _, container = found["scheduler"]
    scheduler = SchedulerConfig.from_env(container_env(container))
    assert scheduler.host == "0.0.0.0"
    assert port_number(container, "grpc") == scheduler.port
    assert port_number(container, "metrics") == scheduler.metrics_port
    assert probe_port(container, container["readinessProbe"]) == scheduler.port

    _, container = found["worker"]
    env = container_env(container)
    worker = WorkerConfig.from_env(env)
    assert worker.engine == "minicpmo"
    assert worker.host == "0.0.0.0"
    assert port_number(container, "grpc") == worker.port
    assert port_number(container, "metrics") == worker.metrics_port
    assert worker.advertise_address == f"{POD_FIELDS['status.podIP']}:{worker.port}"
    assert worker.worker_id == POD_FIELDS["metadata.name"]
    assert worker.scheduler_address == "omnifabric-scheduler:50051"
    assert probe_port(container, container["readinessProbe"]) == worker.port
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(worker.model_path.startswith(m + "/") for m in mounts), worker.model_path

    _, container = found["edge"]
    env = container_env(container)
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
    assert edge.scheduler == "omnifabric-scheduler:50051"
    assert len(edge.api_key_digests) == 1
    assert port_number(container, "http") == edge.port
    assert port_number(container, "grpc") == edge.grpc_port
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/healthz"
    assert probe_port(container, readiness) == edge.port


def test_example_secret_holds_no_usable_key(tmp_path: Path) -> None:
    """Applied as it is, the example stops the edge (no key) instead of opening it."""
    secret = example_secret()
    assert secret["kind"] == "Secret"
    assert secret["metadata"]["name"] not in {d["metadata"]["name"] for d in manifests()}
    (text,) = secret["stringData"].values()
    path = tmp_path / "api-keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(str(path))


def test_workers_take_one_gpu_each_and_advertise_the_pod_ip() -> None:
    """Every worker pod limits nvidia.com/gpu to 1 and advertises status.podIP."""
    for workload in workloads():
        for container in container_pod(workload)["containers"]:
            if service_of(container) != "worker":
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
    assert workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"]["type"] == "Recreate"


def test_termination_grace_outlasts_prestop_and_drain() -> None:
    """terminationGracePeriodSeconds > preStop sleep + the service's drain grace."""
    for service, (workload, container) in containers_by_service().items():
        grace = drain_grace(service, container_env(container))
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep = float(pre_stop["command"][1]) if pre_stop.get("command", [""])[0] == "sleep" else 0
        assert container_pod(workload)["terminationGracePeriodSeconds"] > sleep + grace, service


def kubectl_kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize DIR`: builds offline, without a cluster or a kubeconfig."""
    return subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=scaled(30),
        env={**os.environ, "KUBECONFIG": os.devnull},
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_builds_offline() -> None:
    """`kubectl kustomize` (no API server needed) builds the stack: every object in the
    namespace, the ConfigMap hashed and referenced by that name, the image set."""
    result = kubectl_kustomize(K8S)
    assert result.returncode == 0, result.stderr
    built = list(yaml.safe_load_all(result.stdout))
    names = {(d["kind"], d["metadata"]["name"]) for d in built}
    (config,) = [d for d in built if d["kind"] == "ConfigMap"]
    assert re.fullmatch(r"omnifabric-config-[a-z0-9]{10}", config["metadata"]["name"])
    assert config["data"] == config_map()
    expected = {(d["kind"], d["metadata"]["name"]) for d in manifests()}
    assert names == expected | {("ConfigMap", config["metadata"]["name"])}
    images = {
        i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in kustomization()["images"]
    }
    # Edge and scheduler run the slim image (base install, no torch), workers the full one.
    role_image = {"edge": "omnifabric-fabric", "scheduler": "omnifabric-fabric"}
    for doc in built:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "omnifabric", doc["metadata"]
        if doc["kind"] in WORKLOAD_KINDS:
            for container in container_pod(doc)["containers"]:
                assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
                role = doc["metadata"]["name"].removeprefix("omnifabric-")
                assert container["image"] == images[role_image.get(role, "omnifabric")], role


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


def unit_env(service: str, credentials: str = "/run/credentials/unit") -> dict[str, str]:
    """The environment a unit starts with: Environment= lines, then the EnvironmentFile=s
    in order (their example files stand in), later ones winning."""
    unit = parse_unit(SYSTEMD / UNITS[service])
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
    for service, name in UNITS.items():
        unit = parse_unit(SYSTEMD / name)
        (exec_start,) = values(unit, "ExecStart")
        binary, command = exec_start.split()
        assert binary == BINARY and command == service and command in commands
        assert values(unit, "User") == [sysusers]
        assert values(unit, "Restart") == ["on-failure"]
        assert values(unit, "KillSignal") == ["SIGTERM"]
        assert values(unit, "NoNewPrivileges") == ["yes"]
        assert f"-/etc/omnifabric/{service}.env" in values(unit, "EnvironmentFile")
        assert values(unit, "WantedBy", "Install") == ["multi-user.target"]
        grace = drain_grace(service, unit_env(service))
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
    for service, name in UNITS.items():
        unit = parse_unit(SYSTEMD / name)
        names = {
            a.partition("=")[0]
            for line in values(unit, "Environment")
            for a in line.split()
            if a.startswith("OMNI_")
        }
        assert not names - READ[service], f"{name}: not read: {sorted(names - READ[service])}"
    examples = {p.name for p in SYSTEMD.glob("*.env.example")}
    for name in UNITS.values():
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


def verify_units(directory: Path, stub: Path) -> list[str]:
    """Problems `systemd-analyze verify` reports for copies of the units in `directory`,
    with ExecStart pointed at an existing executable (the venv is not installed here).
    Unknown keys and sections are only warnings (exit 0), so any output is a problem."""
    problems = []
    for name in UNITS.values():
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
    for name in UNITS.values():
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
    for scheduler and edge, 4 for the worker (it must keep the GPU devices and JIT code)."""
    directory, stub = unit_copies(tmp_path)
    assert verify_units(directory, stub) == []
    for service, limit in (("scheduler", 2.0), ("edge", 2.0), ("worker", 4.0)):
        instance = UNITS[service].replace("@.", "@0.")
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
    for name in UNITS.values():
        assert set(values(parse_unit(SYSTEMD / name), "User")) <= users


# --- image --------------------------------------------------------------------------------


def test_dockerfile_copies_what_exists_and_installs_the_project_pins() -> None:
    """Not built here (no container runtime): its COPY sources exist, pinned.py gives the
    project's torch and grpcio-tools pins, and the entrypoint is the omnifabric CLI."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+$", text, re.M)
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
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
