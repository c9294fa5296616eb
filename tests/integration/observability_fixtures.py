"""Real Prometheus and Alertmanager processes for tests: loopback, free ports, tmp storage, fast.

``run_prometheus`` and ``run_alertmanager`` are context managers that start Debian's binaries
(``scripts/setup.sh --test`` installs them; a missing binary is an error, never a skip) and stop
them on exit. Intervals are short so a test sees scrapes, rule evaluations and notifications
within seconds:

- Prometheus scrapes and evaluates every ``interval_s`` (1 s) and resends firing alerts to
  Alertmanager every second (``--rules.alert.resend-delay``).
- ``fast_rules`` copies ``deploy/prometheus/alerts.yml`` with every ``for:`` (and the
  KvgateRunawaySession hysteresis window) shortened, and
  ``fast_alertmanager_config`` the routes of ``deploy/alertmanager/alertmanager.yml`` with second
  intervals and the webhook pointed at a test gateway, so the production files are what is tested.

A sketch of the end-to-end runaway-session test these pieces are for::

    rules = fast_rules(tmp_path, for_s=2, thresholds={"KvgateRunawaySession": 0.5})
    am_cfg = fast_alertmanager_config(tmp_path, gateway_url, admin_token)
    with run_alertmanager(tmp_path, am_cfg) as am, run_prometheus(
        tmp_path, [scrape_job("kvgate", [gateway_hostport])], rule_files=[rules],
        alertmanager=am.hostport,
    ) as prom:
        ...hammer one session...
        prom.wait_for_alert("KvgateRunawaySession", state="firing", timeout_s=30)
        ...that session gets 429 session_throttled, another is served...
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.bench import noop
from gateway.procs.net import free_port, http_ok, wait_until
from gateway.procs.process import ManagedProcess, StartError, child_env

ROOT = Path(__file__).resolve().parents[2]
ALERTS_YML = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"

PROMETHEUS = "prometheus"
ALERTMANAGER = "prometheus-alertmanager"  # Debian's name for the alertmanager binary
PROMTOOL = "promtool"
AMTOOL = "amtool"

T = TypeVar("T")


def require_binary(name: str) -> str:
    """The binary's path; a missing one fails the test (setup.sh installs it), it never skips."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(
            f"{name} is not installed: run scripts/setup.sh --test (Debian packages prometheus,"
            " prometheus-alertmanager)"
        )
    return path


@contextlib.contextmanager
def _server(binary: str, args_of: Callable[[int], list[str]], log: Path,
            timeout_s: float) -> Iterator[tuple[ManagedProcess, int]]:
    """A Prometheus-family server on a free loopback port (``args_of(port)``: its arguments),
    ready when ``/-/ready`` answers 200, and the port; stopped on exit. A port found free can be
    taken by another process before the server binds it: then it is started on another."""
    for attempt in range(1, 4):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = ManagedProcess([binary, *args_of(port)],
                              ready=lambda url=url: http_ok(url + "/-/ready"),  # type: ignore[misc]
                              log_path=log, env=child_env())
        try:
            proc.start(timeout_s=timeout_s)
            break
        except StartError:
            if attempt == 3 or "address already in use" not in proc.log_tail().lower():
                raise
    try:
        yield proc, port
    finally:
        proc.stop()


# --- Prometheus ---------------------------------------------------------------------------------

def scrape_job(name: str, targets: list[str], labels: dict[str, str] | None = None,
               worker_label: bool = False) -> dict[str, Any]:
    """A scrape job of static targets (``host:port``). ``worker_label`` sets ``worker`` to
    ``http://<address>`` as deploy/prometheus/prometheus.yml does for vLLM workers."""
    job: dict[str, Any] = {
        "job_name": name,
        "static_configs": [{"targets": targets, "labels": labels or {}}],
    }
    if worker_label:
        job["relabel_configs"] = [{
            "source_labels": ["__address__"], "target_label": "worker", "replacement": "http://$1",
        }]
    return job


@dataclass
class Prometheus:
    url: str
    process: ManagedProcess
    log: Path

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; raises AssertionError with Prometheus' message on a query error."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=60)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"query failed: {expr}\n{body.get('errorType')}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets_up(self) -> dict[str, bool]:
        """scrapeUrl -> whether the last scrape succeeded."""
        r = httpx.get(self.url + "/api/v1/targets", timeout=60).json()
        return {t["scrapeUrl"]: t["health"] == "up" for t in r["data"]["activeTargets"]}

    def wait_for_targets_up(self, count: int, timeout_s: float = 60) -> None:
        wait_until(lambda: len([u for u in self.targets_up().values() if u]) >= count,
                   timeout_s, f"{count} scrape targets up")

    def alerts(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/alerts", timeout=60).json()
        alerts: list[dict[str, Any]] = r["data"]["alerts"]
        return alerts

    def wait_for_alert(self, name: str, state: str = "firing", timeout_s: float = 30,
                       **labels: str) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            for a in self.alerts():
                if (a["labels"].get("alertname") == name and a["state"] == state
                        and all(a["labels"].get(k) == v for k, v in labels.items())):
                    return a
            return None

        return wait_until(find, timeout_s, f"alert {name} {labels} to be {state}")

    def rule_health(self) -> dict[str, str]:
        """rule name -> health (ok / err / unknown), with lastError appended on errors."""
        r = httpx.get(self.url + "/api/v1/rules", timeout=60).json()
        out = {}
        for group in r["data"]["groups"]:
            for rule in group["rules"]:
                health = rule.get("health", "unknown")
                if health == "err":
                    health += ": " + rule.get("lastError", "")
                out[rule["name"]] = health
        return out


@contextlib.contextmanager
def run_prometheus(
    tmp_path: Path,
    scrape_configs: list[dict[str, Any]],
    rule_files: list[Path] | None = None,
    alertmanager: str | None = None,
    interval_s: float = 1.0,
    startup_timeout_s: float = 60,
) -> Iterator[Prometheus]:
    """A Prometheus on 127.0.0.1:<free port> with its TSDB under ``tmp_path``."""
    binary = require_binary(PROMETHEUS)
    workdir = tmp_path / f"prometheus-{os.getpid()}-{time.monotonic_ns()}"
    (workdir / "data").mkdir(parents=True)
    interval = f"{int(interval_s * 1000)}ms"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": interval},
        "scrape_configs": scrape_configs,
        "rule_files": [str(p) for p in rule_files or []],
    }
    if alertmanager is not None:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "prometheus.log"
    with _server(binary, lambda port: [
        f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s",
        "--rules.alert.for-grace-period=1s", "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ], log, startup_timeout_s) as (proc, port):
        yield Prometheus(f"http://127.0.0.1:{port}", proc, log)


# --- Alertmanager -------------------------------------------------------------------------------

@dataclass
class Alertmanager:
    url: str
    hostport: str
    process: ManagedProcess
    log: Path

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = httpx.get(self.url + "/api/v2/alerts", timeout=60).json()
        return alerts


@contextlib.contextmanager
def run_alertmanager(tmp_path: Path, config: dict[str, Any],
                     startup_timeout_s: float = 60) -> Iterator[Alertmanager]:
    """An Alertmanager on 127.0.0.1:<free port>, clustering off, state under ``tmp_path``."""
    binary = require_binary(ALERTMANAGER)
    workdir = tmp_path / f"alertmanager-{os.getpid()}-{time.monotonic_ns()}"
    (workdir / "data").mkdir(parents=True)
    config_path = workdir / "alertmanager.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "alertmanager.log"
    with _server(binary, lambda port: [
        f"--config.file={config_path}", f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
        "--log.level=warn",
    ], log, startup_timeout_s) as (proc, port):
        yield Alertmanager(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", proc, log)


# --- the production files, made fast ------------------------------------------------------------

_FOR = re.compile(r"^\d+[smhd]$")
# The range of an ``*_over_time(...[range])`` call: the hysteresis window of an alert that keeps
# firing on its own ALERTS series (KvgateRunawaySession).
_HOLD_RANGE = re.compile(r"(_over_time\([^()\[\]]*)\[\d+[smhd]\]")


def fast_rules(tmp_path: Path, for_s: float = 2, thresholds: dict[str, float] | None = None,
               hold_s: float = 3, source: Path = ALERTS_YML) -> Path:
    """A copy of the alert rules with every ``for:`` set to ``for_s`` seconds.

    ``thresholds`` replaces the number after the first ``>`` of an alert's expression, e.g.
    ``{"KvgateRunawaySession": 0.5}`` (the expression must compare with ``> <number>``).

    ``hold_s``: an alert whose expression refers to its own firing ``ALERTS`` series (hysteresis:
    it keeps firing while ``max_over_time(...[1m]) > 0``) gets every ``*_over_time`` range set to
    ``hold_s`` seconds, so it resolves that long after its metric goes rather than a minute. Keep
    it a few scrape intervals long, or a missed scrape resolves it.
    """
    doc = yaml.safe_load(source.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                assert _FOR.match(str(rule["for"])), rule["for"]
                rule["for"] = f"{int(for_s * 1000)}ms"
            name = rule.get("alert")
            if thresholds and name in thresholds:
                expr, n = re.subn(r">\s*[0-9.]+", f"> {thresholds[name]}", rule["expr"], count=1)
                assert n == 1, f"no '> number' in the expression of {name}"
                rule["expr"] = expr
            if name and re.search(rf'ALERTS{{[^}}]*alertname="{name}"', rule["expr"]):
                expr, n = _HOLD_RANGE.subn(rf"\1[{int(hold_s * 1000)}ms]", rule["expr"])
                assert n >= 1, f"no *_over_time(...[range]) hysteresis window in {name}"
                rule["expr"] = expr
    path = tmp_path / "alerts.fast.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def fast_alertmanager_config(tmp_path: Path, gateway_url: str, admin_token: str,
                             source: Path = ALERTMANAGER_YML) -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml with second intervals, the webhook at
    ``gateway_url``/admin/alerts and the admin token in a file under ``tmp_path``."""
    doc: dict[str, Any] = yaml.safe_load(source.read_text())
    token_file = tmp_path / "admin-token"
    token_file.write_text(admin_token)

    def speed_up(route: dict[str, Any]) -> None:
        for key, value in (("group_wait", "1s"), ("group_interval", "1s"),
                           ("repeat_interval", "5s")):
            if key in route:
                route[key] = value
        for child in route.get("routes", []):
            speed_up(child)

    speed_up(doc["route"])
    doc["global"]["resolve_timeout"] = "5s"
    for receiver in doc["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            if hook["url"].endswith("/admin/alerts"):
                hook["url"] = gateway_url.rstrip("/") + "/admin/alerts"
                hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    return doc


# --- a worker with vLLM's /metrics --------------------------------------------------------------

def vllm_metrics_page(running: int = 2, waiting: int = 0, kv_usage: float = 0.5,
                      prefix_queries_tokens: float = 1000.0, prefix_hits_tokens: float = 600.0,
                      model: str = "noop") -> str:
    """The vLLM families the gateway and the dashboards read, in vLLM 0.x's exposition shape."""
    labels = f'engine="0",model_name="{model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv_usage}\n"
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        f"vllm:prefix_cache_queries_total{{{labels}}} {prefix_queries_tokens}\n"
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f"vllm:prefix_cache_hits_total{{{labels}}} {prefix_hits_tokens}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="4096",{labels}}} 1.0\n'
    )


def fake_vllm_worker(page: str) -> ASGIApp:
    """The no-op backend (gateway.bench.noop) with a vLLM-shaped /metrics page."""
    body = page.encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": body})
            return
        await noop.app(scope, receive, send)

    return app
