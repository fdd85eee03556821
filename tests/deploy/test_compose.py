"""docker-compose.yml, its GPU override and its monitoring profile, as Docker Compose v2 itself resolves them."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.dashboard import DASHBOARD, expressions, panels, selectors
from tests.deploy.tools import REPO_ROOT, compose_config, run

CPU_FILES = ["docker-compose.yml"]
GPU_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]
WORKERS = ("prefill", "decode")
LLMD_SERVICES = ("gateway", *WORKERS)


@pytest.fixture(scope="module")
def cpu(compose_bin: str) -> dict[str, Any]:
    return compose_config(compose_bin, CPU_FILES)


@pytest.fixture(scope="module")
def gpu(compose_bin: str) -> dict[str, Any]:
    return compose_config(compose_bin, GPU_FILES)


def test_config_rejects_an_invalid_file(compose_bin: str, tmp_path: Path) -> None:
    # Guards the guard: `config` must fail on a broken file, or the tests above prove nothing.
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on:\n      b:\n        condition: service_healthy\n")
    result = run([compose_bin, "-f", str(bad), "config", "-q"])
    assert result.returncode != 0
    assert 'depends on undefined service "b"' in result.stderr


def test_stack_has_exactly_redis_gateway_prefill_and_decode(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    assert sorted(cpu["services"]) == ["decode", "gateway", "prefill", "redis"]
    assert sorted(gpu["services"]) == ["decode", "gateway", "prefill", "redis"]


@pytest.mark.parametrize("service", WORKERS)
def test_workers_can_be_scaled(cpu: dict[str, Any], service: str) -> None:
    spec = cpu["services"][service]
    assert "container_name" not in spec
    assert "ports" not in spec
    assert spec["expose"] == ["9100", "9200"]


@pytest.mark.parametrize("service", WORKERS)
def test_workers_hand_kv_off_through_one_shared_tmpfs(cpu: dict[str, Any], service: str) -> None:
    spec = cpu["services"][service]
    assert spec["environment"]["LLMD_WORKER__KV_SHM_DIR"] == "/kv-shm"
    assert {"type": "volume", "source": "kv-shm", "target": "/kv-shm", "volume": {}} in spec["volumes"]
    assert cpu["volumes"]["kv-shm"]["driver_opts"]["type"] == "tmpfs"


@pytest.mark.parametrize("service", WORKERS)
def test_workers_open_the_kv_data_port_to_the_other_containers_only(cpu: dict[str, Any], service: str) -> None:
    spec = cpu["services"][service]
    env = spec["environment"]
    assert (env["LLMD_WORKER__KV_TCP_HOST"], env["LLMD_WORKER__KV_TCP_PORT"]) == ("0.0.0.0", "9200")
    assert "9200" in spec["expose"] and "ports" not in spec


def test_only_the_gateway_publishes_a_port(cpu: dict[str, Any]) -> None:
    published = {name: spec["ports"] for name, spec in cpu["services"].items() if "ports" in spec}
    assert published == {"gateway": [{"mode": "ingress", "target": 8000, "published": "8000", "protocol": "tcp"}]}


@pytest.mark.parametrize("service", LLMD_SERVICES)
def test_llmd_services_start_after_redis_is_healthy(cpu: dict[str, Any], service: str) -> None:
    assert cpu["services"][service]["depends_on"] == {"redis": {"condition": "service_healthy", "required": True}}


def test_redis_is_probed_with_ping_and_keeps_nothing_on_disk(cpu: dict[str, Any]) -> None:
    redis = cpu["services"]["redis"]
    assert redis["image"] == "redis:7.4-alpine"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert redis["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert "volumes" not in redis


def test_images_can_be_replaced_without_an_edit(compose_bin: str) -> None:
    # An offline host runs its own Redis and llmd images (deploy/offline_images.sh, make compose-test).
    env = {"REDIS_IMAGE": "llmd-redis:bookworm", "CPU_IMAGE": "llmd:offline"}
    services = compose_config(compose_bin, CPU_FILES, env=env)["services"]
    assert services["redis"]["image"] == "llmd-redis:bookworm"
    assert {services[name]["image"] for name in LLMD_SERVICES} == {"llmd:offline"}


@pytest.mark.parametrize(
    ("service", "port_var", "port"),
    [("gateway", "LLMD_GATEWAY__PORT", "8000"), ("prefill", "LLMD_WORKER__HEALTH_PORT", "9100"),
     ("decode", "LLMD_WORKER__HEALTH_PORT", "9100")],
)
def test_healthcheck_probes_health_on_the_configured_port(
    cpu: dict[str, Any], service: str, port_var: str, port: str
) -> None:
    spec = cpu["services"][service]
    test = spec["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    assert "urllib.request.urlopen('http://127.0.0.1:%s/health'" in test[3]
    assert f"os.environ['{port_var}']" in test[3]
    assert spec["environment"][port_var] == port
    compile(test[3], "healthcheck", "exec")


@pytest.mark.parametrize("service", LLMD_SERVICES)
def test_services_run_their_module_from_one_image(cpu: dict[str, Any], service: str) -> None:
    spec = cpu["services"][service]
    assert spec["command"] == ["python", "-m", f"services.{service}"]
    assert spec["image"] == "llmd:cpu"
    assert spec["build"]["dockerfile"] == "Dockerfile"


@pytest.mark.parametrize("service", LLMD_SERVICES)
def test_services_reach_redis_by_its_service_name(cpu: dict[str, Any], service: str) -> None:
    assert cpu["services"][service]["environment"]["LLMD_REDIS__URL"] == "redis://redis:6379/0"


def test_optional_settings_pass_through_unset(cpu: dict[str, Any]) -> None:
    # A key with no value is unset in the container unless the shell sets it, so the
    # code's default applies (for the model: the GGUF baked into the image).
    assert cpu["services"]["decode"]["environment"]["LLMD_MODEL__PATH"] is None
    assert cpu["services"]["gateway"]["environment"]["LLMD_GATEWAY__API_KEYS"] is None


@pytest.mark.parametrize("service", WORKERS)
def test_gpu_override_reserves_one_gpu_per_worker(gpu: dict[str, Any], service: str) -> None:
    spec = gpu["services"][service]
    assert spec["deploy"]["resources"]["reservations"]["devices"] == [
        {"capabilities": ["gpu"], "driver": "nvidia", "count": 1}
    ]
    assert spec["image"] == "llmd:gpu"
    assert spec["build"]["dockerfile"] == "Dockerfile.gpu"
    assert spec["environment"]["LLMD_MODEL__DEVICE"] == "cuda"
    assert spec["command"] == ["python", "-m", f"services.{service}"]
    assert "ports" not in spec


def test_gpu_override_leaves_gateway_and_redis_as_they_are(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    assert gpu["services"]["gateway"] == cpu["services"]["gateway"]
    assert gpu["services"]["redis"] == cpu["services"]["redis"]


def doc_compose_snippets() -> list[str]:
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO_ROOT / "docs" / "deploy.md").read_text(), re.S)
    return [block for block in blocks if block.startswith("services:")]


def test_docs_show_compose_snippets() -> None:
    assert len(doc_compose_snippets()) == 2


@pytest.mark.parametrize("snippet", doc_compose_snippets())
def test_compose_snippets_in_the_docs_resolve(compose_bin: str, tmp_path: Path, snippet: str) -> None:
    for name in [*GPU_FILES, "Dockerfile", "Dockerfile.gpu"]:
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    (tmp_path / "snippet.yml").write_text(snippet)
    args = [arg for name in [*GPU_FILES, "snippet.yml"] for arg in ("-f", name)]
    result = run([compose_bin, *args, "config", "-q"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr


# ---- the monitoring profile: Prometheus and Grafana ----------------------------------------------

MONITORING = REPO_ROOT / "deploy" / "monitoring"
SCRAPED_PORTS = {"gateway": ("LLMD_GATEWAY__PORT", 8000), "prefill": ("LLMD_WORKER__HEALTH_PORT", 9100),
                 "decode": ("LLMD_WORKER__HEALTH_PORT", 9100)}


@pytest.fixture(scope="module")
def monitoring(compose_bin: str) -> dict[str, Any]:
    return compose_config(compose_bin, CPU_FILES, profiles=("monitoring",))


@pytest.fixture(scope="module")
def scrape_jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_the_monitoring_profile_adds_prometheus_and_grafana_only(monitoring: dict[str, Any]) -> None:
    assert sorted(monitoring["services"]) == ["decode", "gateway", "grafana", "prefill", "prometheus", "redis"]
    assert monitoring["services"]["prometheus"]["profiles"] == ["monitoring"]
    assert monitoring["services"]["grafana"]["profiles"] == ["monitoring"]


def test_every_service_has_a_healthcheck(monitoring: dict[str, Any]) -> None:
    # make compose-test waits for every container to report healthy; one without a check never does.
    for name, spec in monitoring["services"].items():
        check = spec.get("healthcheck", {})
        assert check.get("test", [""])[0] == "CMD" and not check.get("disable"), name


@pytest.mark.parametrize(("service", "port"), [("prometheus", 9090), ("grafana", 3000)])
def test_monitoring_healthchecks_probe_the_port_the_service_serves(
    monitoring: dict[str, Any], service: str, port: int
) -> None:
    spec = monitoring["services"][service]
    (url,) = [arg for arg in spec["healthcheck"]["test"] if arg.startswith("http://")]
    assert url.startswith(f"http://127.0.0.1:{port}/")
    assert [p["target"] for p in spec["ports"]] == [port]


def test_grafana_starts_after_prometheus_is_healthy(monitoring: dict[str, Any]) -> None:
    assert monitoring["services"]["grafana"]["depends_on"] == {
        "prometheus": {"condition": "service_healthy", "required": True}
    }


@pytest.mark.parametrize(("service", "pattern"), [("prometheus", r"prom/prometheus:v\d+\.\d+\.\d+"),
                                                  ("grafana", r"grafana/grafana:\d+\.\d+\.\d+")])
def test_monitoring_images_are_pinned_to_a_release(monitoring: dict[str, Any], service: str, pattern: str) -> None:
    assert re.fullmatch(pattern, monitoring["services"][service]["image"])


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_monitoring_mounts_files_of_the_repository_read_only(monitoring: dict[str, Any], service: str) -> None:
    mounts = monitoring["services"][service]["volumes"]
    assert mounts
    for mount in mounts:
        source = Path(mount["source"])
        assert mount["type"] == "bind" and mount["read_only"] is True
        assert source.is_relative_to(MONITORING) and source.exists(), source


def test_prometheus_scrapes_every_replica_of_each_service_on_its_metrics_port(
    cpu: dict[str, Any], scrape_jobs: dict[str, dict[str, Any]]
) -> None:
    # DNS discovery on the service name: Compose answers it with one address per replica.
    assert sorted(scrape_jobs) == sorted(SCRAPED_PORTS)
    for name, (port_var, port) in SCRAPED_PORTS.items():
        (discovery,) = scrape_jobs[name]["dns_sd_configs"]
        assert discovery["names"] == [name] and discovery["type"] == "A"
        assert discovery["port"] == port == int(cpu["services"][name]["environment"][port_var])
        assert scrape_jobs[name].get("metrics_path", "/metrics") == "/metrics"


def test_the_image_listens_on_all_interfaces_for_the_scrapes() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "LLMD_GATEWAY__HOST=0.0.0.0" in dockerfile
    assert "LLMD_WORKER__HEALTH_HOST=0.0.0.0" in dockerfile


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(monitoring: dict[str, Any]) -> None:
    provisioning = MONITORING / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "llmd.yml").read_text())["providers"]
    targets = {Path(m["source"]): m["target"] for m in monitoring["services"]["grafana"]["volumes"]}
    assert targets[provisioning] == "/etc/grafana/provisioning"
    assert targets[DASHBOARD.parent] == provider["options"]["path"]
    uids = {target["datasource"]["uid"] for panel in panels() for target in panel.get("targets", [])}
    assert uids == {datasource["uid"]}


def test_every_dashboard_query_names_the_scrape_jobs_it_reads(scrape_jobs: dict[str, dict[str, Any]]) -> None:
    # The job label is the pool: a query without one would mix the gateway's and the workers' series
    # of one name (both export vllm:time_to_first_token_seconds, from different starting points).
    found = [selector for expr in expressions() for selector in selectors(expr)]
    assert found
    for selector in found:
        assert selector.jobs and selector.jobs <= set(scrape_jobs), selector
