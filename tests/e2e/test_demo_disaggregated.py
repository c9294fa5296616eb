"""``kvgate demo --disaggregated`` as a user runs it: one process, simulated prefill and decode
workers, the gateway in front; one chat through the real ``openai`` client takes the two-step
path (a prefill on a kv_producer, a decode that pulls the KV on a kv_consumer)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway import promtext
from gateway.procs.net import free_port, http_ok
from gateway.procs.process import ManagedProcess, python_argv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log: Path = tmp_path_factory.mktemp("demo") / "demo.log"
    proc = ManagedProcess(
        python_argv("gateway.cli", "demo", "--disaggregated", "--port", str(port),
                    "--prefill-workers", "1", "--decode-workers", "2", "--time-scale", "0.1"),
        ready=lambda: http_ok(url + "/ready"), log_path=log)
    proc.start(timeout_s=90)
    try:
        yield url
    finally:
        proc.stop()


def test_demo_disaggregated_answers_a_chat_through_a_prefill_and_a_decode_worker(
        demo_url: str) -> None:
    client = openai.OpenAI(base_url=f"{demo_url}/v1", api_key="none")
    answer = client.chat.completions.create(
        model="sim-llama-3-8b", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    text = httpx.get(f"{demo_url}/metrics", timeout=10).text
    prefills = promtext.values(text, "kvgate_prefill_requests_total", pool="disaggregated",
                               code="200")
    assert sum(prefills) == 1, "the chat did not go through a prefill worker"


def test_demo_disaggregated_lists_the_model(demo_url: str) -> None:
    models = httpx.get(f"{demo_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["sim-llama-3-8b"]
