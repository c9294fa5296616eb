"""The simulator's CPU tier speaks vLLM's offloading connector on the wire, and the gateway
routes to it (issue 15, item 4).

1. Frames captured from a simulated worker with a CPU tier decode with vLLM 0.32's own msgspec
   classes, re-encode to the same bytes, and their CPU events equal what vLLM's own
   ``OffloadingEventsTracker`` emits for the same offloaded and evicted blocks (placeholders
   by default, as ``--kv-offloading-size`` publishes them), in a ``.venv-vllm`` subprocess.
2. Through the gateway on two simulated workers whose working set is larger than their GPU KV
   but within GPU + CPU: a prompt that its first worker evicted from the GPU but kept in the
   CPU goes back there (reloaded, reported cached), not to the idle cold worker.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.vllm import vllm_script
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from tests.harness import kv_event_batches, next_batch, serve_app, zmq_handshakes
from tests.integration.sim_workers import ask, up, wait_for, words

pytestmark = pytest.mark.timeout(240)

BS = 16

ORACLE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker)
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as u
from vllm.v1.kv_offload.base import (
    Medium, OffloadingEvent, OffloadingKVEventsConfig, make_offload_key)

dec = msgspec.msgpack.Decoder(KVEventBatch)
enc = msgspec.msgpack.Encoder()
u.init_none_hash(sha256)
job = json.loads(sys.stdin.readline())
bs = job["block_size"]
hashes = []
for tokens in job["token_lists"]:
    parent, out = None, []
    for i in range(0, len(tokens) - bs + 1, bs):
        parent = u.hash_block_tokens(sha256, parent, tokens[i:i + bs], None)
        out.append(parent)
    hashes.append(out)
tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(
    enable_kv_cache_events=True, self_describing_kv_events=False))
expected = []
for kind, which in job["ops"]:  # (store|remove, [[token list index, block index], ...])
    keys = [make_offload_key(hashes[t][b], 0) for t, b in which]
    ev = OffloadingEvent(keys=keys, medium=Medium.CPU, removed=kind == "remove")
    expected += [msgspec.to_builtins(e) for e in tracker.take_events([ev])]
batches = []
for hexpayload in job["payloads"]:
    raw = bytes.fromhex(hexpayload)
    batch = dec.decode(raw)
    batches.append({"events": msgspec.to_builtins(batch.events),
                    "same_bytes": enc.encode(batch) == raw})
print(json.dumps({"batches": batches, "expected": expected}), flush=True)
"""


def ask_vllm(job: dict[str, Any]) -> dict[str, Any]:
    proc = vllm_script(ORACLE, {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    out, err = proc.communicate(json.dumps(job) + "\n", timeout=180)
    assert proc.returncode == 0, err[-3000:]
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return answer


class Fleet:
    """Simulated workers on one background loop (the gateway's server runs on another)."""

    def __init__(self, configs: list[SimWorkerConfig]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.fleet = SimFleet(configs)  # each binds a port the kernel picks
        self.urls: list[str] = self._run(self.fleet.start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def endpoints(self, i: int) -> tuple[str, str | None]:
        pub = self.fleet.workers[i].publisher
        assert pub is not None
        return pub.endpoint, pub.replay_endpoint

    def close(self) -> None:
        self._run(self.fleet.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def tiered(**kw: Any) -> SimWorkerConfig:
    return SimWorkerConfig(model_name="sim", kv_events=True,
                           kv_events_endpoint="tcp://127.0.0.1:*",
                           kv_replay_endpoint="tcp://127.0.0.1:*",
                           hash_seed="vllm-none-hash", time_scale=0.0, **kw)


def complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


def test_cpu_tier_events_on_the_wire_are_vllms_offloading_events() -> None:
    fleet = Fleet([tiered(num_gpu_blocks=9, max_model_len=128, cpu_offload_blocks=6)])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pub, replay = fleet.endpoints(0)
        assert replay is not None
        with zmq_handshakes(sub) as handshake:
            sub.connect(pub)
            handshake(60)  # the subscription is on its way before anything is published
        a = list(range(1000, 1040))  # 2 full blocks
        b = list(range(2000, 2080))  # 5 full blocks: 2 + 5 > 6, the CPU evicts a's first
        complete(fleet.urls[0], a)
        frames = [next_batch(sub, replay, 0)]
        complete(fleet.urls[0], b)
        frames.append(next_batch(sub, replay, 1))
    finally:
        sub.close(linger=0)
        ctx.term()
        fleet.close()
    out = ask_vllm({"block_size": BS, "token_lists": [a, b],
                    "payloads": [f[2].hex() for f in frames],
                    "ops": [["store", [[0, 0], [0, 1]]], ["remove", [[0, 0]]],
                            ["store", [[1, i] for i in range(5)]]]})
    assert all(bt["same_bytes"] for bt in out["batches"])
    first, second = (bt["events"] for bt in out["batches"])
    assert [e["medium"] for e in first] == ["GPU", "CPU", "CPU"]  # GPU first, as vLLM appends
    assert [e["medium"] for e in second] == ["GPU", "CPU", *["CPU"] * 5]
    assert [e for e in first + second if e["medium"] == "CPU"] == out["expected"]


@pytest.fixture(scope="module")
def workers() -> Iterator[Fleet]:
    # 32 usable GPU blocks (512 tokens) hold one ~400-token prompt; the CPU holds 12 of them.
    config = tiered(num_gpu_blocks=33, cpu_offload_blocks=300, enable_prompt_tokens_details=True)
    f = Fleet([config, config])
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def gateway(workers: Fleet) -> Iterator[str]:
    ws = []
    for i, url in enumerate(workers.urls):
        pub, replay = workers.endpoints(i)
        ws.append({"url": url, "kv_events_endpoint": pub, "kv_replay_endpoint": replay})
    settings = build_settings({
        "models": [{"name": "sim", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 512, "policy": "kv_aware",
                   "workers": ws}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        # ZMQ's slow joiner: events published before the gateway's subscriptions reach the
        # workers are lost. Two-block prompts of their own, straight to each worker, until the
        # gateway has applied a batch from it.
        for i, w in enumerate(workers.urls):
            deadline = time.monotonic() + 60
            attempt = 0
            while kv_event_batches(url).get(w, 0) == 0:
                assert time.monotonic() < deadline, f"no KV event from {w} reached the gateway"
                start = 900_000 + 10_000 * i + 2 * BS * attempt
                complete(w, list(range(start, start + 2 * BS)))
                attempt += 1
                time.sleep(0.1)
        yield url


def test_prompt_evicted_from_the_gpu_goes_back_to_its_cpu_tier_not_to_a_cold_worker(
    gateway: str, workers: Fleet,
) -> None:
    for seed in range(4):  # with a GPU-only index each is a tie: 1/16 to pass by chance
        prompt = words(seed)
        before = kv_event_batches(gateway)
        holder, cached = ask(gateway, prompt)
        assert cached == 0
        for flood in range(2):  # straight to the holder: its GPU evicts the prompt
            start = 20_000 + 1000 * (2 * seed + flood)
            complete(holder, list(range(start, start + 400)))
        # the events reach the gateway: a batch at least for the prompt and for each flood
        wait_for(lambda holder=holder, before=before:  # type: ignore[misc]
                 kv_event_batches(gateway).get(holder, 0) >= before.get(holder, 0) + 3,
                 "the floods' events")
        again, cached = ask(gateway, prompt)
        assert again == holder, f"prompt {seed} went to the cold worker"
        assert cached >= 384, cached  # reloaded from the CPU: vLLM reports it cached
