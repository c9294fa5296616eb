"""deploy/k8s: plain manifests, validated against Kubernetes' and the Prometheus Operator's schemas.

- Core kinds: ``kubernetes-validate`` (PyPI), the OpenAPI schemas of Kubernetes releases, strict
  (unknown fields are errors), for the oldest and newest release we support.
- ServiceMonitor and PrometheusRule (CRDs, not in Kubernetes' schemas): the pydantic models that
  ``cloudcoil.models.prometheus_operator`` (PyPI) generates from the Prometheus Operator's CRDs;
  a manifest must validate and survive the round trip unchanged (the models drop unknown fields).
- The PrometheusRule carries exactly the groups of deploy/prometheus/alerts.yml.
- The gateway's config in the ConfigMap loads with the gateway's own Settings.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gateway.config import load_settings
from tests.integration.observability_fixtures import ALERTS_YML, ROOT

K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


DOCS = documents()


def by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _diff(ours: Any, theirs: Any, path: str = "") -> list[str]:
    if isinstance(ours, dict):
        if not isinstance(theirs, dict):
            return [f"{path}: became {theirs!r}"]
        out = []
        for k, v in ours.items():
            out += [f"{path}.{k}: unknown field"] if k not in theirs else _diff(v, theirs[k], f"{path}.{k}")
        return out
    if isinstance(ours, list):
        if not isinstance(theirs, list) or len(ours) != len(theirs):
            return [f"{path}: list changed"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                for d in _diff(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: {ours!r} became {theirs!r}"]


def operator_problems(doc: dict[str, Any]) -> list[str]:
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"]).model_validate(doc)  # raises on a type error
    return _diff(doc, model.model_dump(by_alias=True, exclude_none=True, mode="json"))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifest_is_valid_for_kubernetes(name: str, doc: dict[str, Any], version: str) -> None:
    if doc["kind"] in OPERATOR_KINDS:
        assert operator_problems(doc) == [], name
        return
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_kubernetes_validator_rejects_an_unknown_field() -> None:
    doc = by_kind("Deployment", "kvgate")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_operator_check_rejects_unknown_fields_and_bad_types() -> None:
    from pydantic import ValidationError

    sm = yaml.safe_load(yaml.safe_dump(by_kind("ServiceMonitor", "kvgate")))
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in p for p in operator_problems(sm))
    rule = yaml.safe_load(yaml.safe_dump(by_kind("PrometheusRule")))
    rule["spec"]["groups"][0]["rules"] = "not a list"
    with pytest.raises(ValidationError):
        operator_problems(rule)


def test_prometheusrule_carries_exactly_the_alert_rules() -> None:
    alerts = yaml.safe_load(ALERTS_YML.read_text())
    assert by_kind("PrometheusRule")["spec"] == {"groups": alerts["groups"]}
    r = subprocess.run([sys.executable, str(K8S / "sync_rules.py"), "--check"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_gateway_deployment_is_highly_available_and_locked_down() -> None:
    dep = by_kind("Deployment", "kvgate")
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    [c] = pod["containers"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop_s = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    # preStop, then the gateway's 30 s drain, must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + 30
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])  # writable scratch
    [token] = [e for e in c["env"] if e["name"] == "KVGATE_ADMIN__TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "kvgate-admin", "key": "token"}
    # /metrics names sessions: the gateway requires the token its ServiceMonitor sends
    [scrape] = [e for e in c["env"] if e["name"] == "KVGATE_ADMIN__METRICS_TOKEN"]
    sent = by_kind("ServiceMonitor", "kvgate")["spec"]["endpoints"][0]["authorization"]
    assert sent["type"] == "Bearer"
    assert scrape["valueFrom"]["secretKeyRef"] == sent["credentials"]
    # Budgets are per tenant: the shipped config has API keys (digests, from a Secret).
    [keys] = [e for e in c["env"] if e["name"] == "KVGATE_AUTH__API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "kvgate-api-keys", "key": "api_keys"}
    assert not any(d["kind"] == "Secret" for _, d in DOCS)  # referenced, never committed
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]


def test_pdb_service_and_servicemonitor_select_the_gateway_pods() -> None:
    pod_labels = by_kind("Deployment", "kvgate")["spec"]["template"]["metadata"]["labels"]
    pdb = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = by_kind("Service", "kvgate")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    sm = by_kind("ServiceMonitor", "kvgate")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The alert rules' job="kvgate" comes from the ServiceMonitor's jobLabel.
    assert service["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvgate"


def test_configmap_config_loads_with_the_gateway_settings(tmp_path: Path) -> None:
    cm = by_kind("ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    settings = load_settings(path)
    assert {p.name for p in settings.pools} == {"short-chat", "long-context"}
    assert settings.listen.host == "0.0.0.0"
    redis = by_kind("Service", "kvgate-redis")
    assert settings.budgets.redis_url is not None
    assert f"{redis['metadata']['name']}.{redis['metadata']['namespace']}" in str(settings.budgets.redis_url)
    tenant = settings.budgets.defaults.tenant
    assert tenant.inflight_kv_bytes is not None and tenant.requests_per_minute is not None


def test_configmap_config_takes_api_keys_from_the_secrets_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Deployment's KVGATE_AUTH__API_KEYS (from the Secret) gives the gateway."""
    path = tmp_path / "config.yaml"
    path.write_text(by_kind("ConfigMap")["data"]["config.yaml"])
    digest = hashlib.sha256(b"sk-app").hexdigest()
    monkeypatch.setenv("KVGATE_AUTH__API_KEYS", json.dumps([{"name": "app", "sha256": digest}]))
    settings = load_settings(path)
    assert [(k.name, k.sha256) for k in settings.auth.api_keys] == [("app", digest)]
