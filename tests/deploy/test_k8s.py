"""deploy/k8s: every manifest against the Kubernetes schemas, and the wiring between them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.tools import BASE, K8S_DIR, base_manifests, by_kind, container, load_yaml_docs, run

# The oldest release with the native `sleep` preStop hook the gateway uses, and the newest
# the schemas know.
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
WORKERS = ("prefill", "decode")
LLMD_DEPLOYMENTS = ("gateway", *WORKERS)


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return base_manifests()


@pytest.fixture(scope="module")
def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return by_kind(docs, "Deployment")


def kustomize(kubectl_bin: str, overlay: str) -> list[dict[str, Any]]:
    result = run([kubectl_bin, "kustomize", str(K8S_DIR / overlay)])
    assert result.returncode == 0, result.stderr
    return load_yaml_docs(result.stdout)


def test_schema_rejects_an_unknown_field(kubernetes_validate: Any, deployments: dict[str, dict[str, Any]]) -> None:
    # Guards the guard: strict validation must catch a misspelt field.
    broken = yaml.safe_load(yaml.safe_dump(deployments["gateway"]))
    container(broken)["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_base_manifests_match_the_kubernetes_schema(
    kubernetes_validate: Any, docs: list[dict[str, Any]], version: str
) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_kustomize_output_matches_the_kubernetes_schema(
    kubectl_bin: str, kubernetes_validate: Any, overlay: str
) -> None:
    rendered = kustomize(kubectl_bin, overlay)
    assert sorted((doc["kind"], doc["metadata"]["name"]) for doc in rendered if doc["kind"] != "ConfigMap") == [
        ("Deployment", "decode"), ("Deployment", "gateway"), ("Deployment", "prefill"), ("Deployment", "redis"),
        ("HorizontalPodAutoscaler", "decode"), ("HorizontalPodAutoscaler", "prefill"),
        ("NetworkPolicy", "decode-kv-transfer"), ("Service", "gateway"), ("Service", "redis"),
    ]
    for doc in rendered:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    on_disk = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == on_disk


def test_no_manifest_names_a_namespace() -> None:
    for path in K8S_DIR.rglob("*.yaml"):
        for doc in load_yaml_docs(path.read_text()):
            assert "namespace" not in doc.get("metadata", {}), path
            assert "namespace" not in doc, path


def test_selectors_match_their_pods(docs: list[dict[str, Any]], deployments: dict[str, dict[str, Any]]) -> None:
    for name, deployment in deployments.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    for name, service in by_kind(docs, "Service").items():
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), name
        port_names = {port["name"] for port in container(deployments[name])["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names, name


def test_gateway_is_ready_on_ready_and_alive_on_health(deployments: dict[str, dict[str, Any]]) -> None:
    gateway = container(deployments["gateway"])
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "LLMD_GATEWAY__PORT", "value": "8000"} in gateway["env"]


@pytest.mark.parametrize("name", WORKERS)
def test_workers_are_probed_on_their_health_port(deployments: dict[str, dict[str, Any]], name: str) -> None:
    worker = container(deployments[name])
    assert worker["command"] == ["python", "-m", f"services.{name}"]
    assert worker["ports"][0] == {"name": "metrics", "containerPort": 9100}
    assert {"name": "LLMD_WORKER__HEALTH_PORT", "value": "9100"} in worker["env"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, probe


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment)["env"]}


@pytest.mark.parametrize("name", WORKERS)
def test_kv_goes_pod_to_pod_over_the_decode_data_port(deployments: dict[str, dict[str, Any]], name: str) -> None:
    env = env_of(deployments[name])
    assert env["LLMD_WORKER__KV_SHM_DIR"] == ""  # pods share no tmpfs
    assert env["LLMD_WORKER__KV_TCP_ADVERTISE"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    decode = env_of(deployments["decode"])
    assert (decode["LLMD_WORKER__KV_TCP_HOST"], decode["LLMD_WORKER__KV_TCP_PORT"]) == ("0.0.0.0", "9200")
    assert container(deployments["decode"])["ports"][1] == {"name": "kv", "containerPort": 9200}


def test_only_prefill_pods_reach_the_kv_data_port(docs: list[dict[str, Any]]) -> None:
    policy = by_kind(docs, "NetworkPolicy")["decode-kv-transfer"]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    kv, metrics = policy["ingress"]
    assert kv["ports"] == [{"port": 9200, "protocol": "TCP"}]
    assert kv["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "llmd", "app.kubernetes.io/component": "prefill"}}}]
    assert metrics == {"ports": [{"port": 9100, "protocol": "TCP"}]}


@pytest.mark.parametrize("name", WORKERS)
def test_worker_count_is_left_to_the_autoscaler(
    docs: list[dict[str, Any]], deployments: dict[str, dict[str, Any]], name: str
) -> None:
    assert "replicas" not in deployments[name]["spec"]
    target = by_kind(docs, "HorizontalPodAutoscaler")[name]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def test_autoscalers_use_each_pools_own_signals(docs: list[dict[str, Any]]) -> None:
    hpas = by_kind(docs, "HorizontalPodAutoscaler")

    def signals(name: str) -> list[tuple[str, str]]:
        metrics = hpas[name]["spec"]["metrics"]
        return [(m["type"], m[m["type"].lower()]["metric"]["name"]) for m in metrics]

    assert signals("prefill") == [
        ("External", "llmd_queue_depth"), ("External", "llmd_time_to_first_token_seconds_p90"),
    ]
    assert signals("decode") == [("Pods", "llmd_kv_cache_usage_perc"), ("Pods", "llmd_num_requests_running")]


@pytest.mark.parametrize("name", (*LLMD_DEPLOYMENTS, "redis"))
def test_containers_request_resources_and_run_unprivileged(
    deployments: dict[str, dict[str, Any]], name: str
) -> None:
    pod = deployments[name]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    spec = container(deployments[name])
    assert {"cpu", "memory"} <= spec["resources"]["requests"].keys()
    assert "memory" in spec["resources"]["limits"]
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("name", LLMD_DEPLOYMENTS)
def test_llmd_pods_share_the_generated_config(deployments: dict[str, dict[str, Any]], name: str) -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    generated = {item["name"]: item["literals"] for item in kustomization["configMapGenerator"]}
    assert "LLMD_REDIS__URL=redis://redis:6379/0" in generated["llmd-config"]
    assert container(deployments[name])["envFrom"] == [{"configMapRef": {"name": "llmd-config"}}]
    assert container(deployments[name])["image"] == "llmd:cpu"


def test_gpu_overlay_gives_each_worker_one_gpu(kubectl_bin: str) -> None:
    rendered = by_kind(kustomize(kubectl_bin, "gpu"), "Deployment")
    for name in WORKERS:
        worker = container(rendered[name])
        assert worker["image"] == "llmd:gpu"
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
        env = {item["name"]: item.get("value") for item in worker["env"]}
        assert env["LLMD_MODEL__DEVICE"] == "cuda"
        assert env["LLMD_KV_CACHE__MEMORY_FRACTION"] == "0.7"
        assert "LLMD_KV_CACHE__MEMORY_BYTES" not in env
    gateway = container(rendered["gateway"])
    assert gateway["image"] == "llmd:cpu"
    assert "nvidia.com/gpu" not in gateway["resources"]["limits"]
