"""KV events from vLLM's own publisher class reach the gateway's index.

A ``.venv-vllm`` subprocess drives ``vllm.distributed.kv_events.ZmqEventPublisher`` with real
``KVEventBatch``/``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` objects — the bytes a vLLM
server sends — without a model. It takes JSON commands on stdin and answers ``@@{json}`` lines.

Lost messages are simulated with the real publisher by sending a batch under another topic for a
moment: the SUB socket filters it out (as if dropped), but the publisher still numbers it and keeps
it in its replay buffer, exactly as when a subscriber misses a batch on the wire.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gateway.kvindex.events import KvEventsConfig, KvEventSubscriber
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.relay import EventRelay
from gateway.kvindex.service import PrefixIndex
from gateway.procs.vllm import vllm_python, vllm_script
from tests.harness import eventually

VLLM_PYTHON = vllm_python()
BLOCK = 16
TOPIC = "kv-events"

HARNESS = r"""
import json, os, sys, time
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)

pubs = {}

def reply(obj):
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()

def build(ev):
    if ev["type"] == "stored":
        return BlockStored(
            block_hashes=ev["hashes"], parent_block_hash=ev.get("parent"),
            token_ids=ev["tokens"], block_size=ev["block_size"], lora_id=None,
            medium="GPU", lora_name=None, group_idx=0,
        )
    if ev["type"] == "removed":
        return BlockRemoved(block_hashes=ev["hashes"], medium="GPU", group_idx=0)
    return AllBlocksCleared()

def new(cmd):
    deadline = time.time() + 30
    while True:
        try:
            return ZmqEventPublisher(
                data_parallel_rank=0, endpoint=cmd["endpoint"],
                replay_endpoint=cmd.get("replay"), topic=cmd["topic"],
            )
        except zmq.ZMQError:
            if time.time() > deadline:  # the old socket of a restarted publisher may linger
                raise
            time.sleep(0.05)

reply({"ready": True})
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "new":
            pub = pubs[cmd["name"]] = new(cmd)
            cfg = pub.get_publisher_config()
            reply({"endpoint": cfg.endpoint, "replay": cfg.replay_endpoint})
        elif cmd["op"] == "publish":
            pub = pubs[cmd["name"]]
            topic = pub._topic_bytes
            if cmd.get("hidden"):
                pub._topic_bytes = b"~not-subscribed"
            for batch in cmd["batches"]:
                pub.publish(KVEventBatch(ts=time.time(), events=[build(e) for e in batch]))
            pub._event_queue.join()  # sent (task_done follows send_multipart)
            pub._topic_bytes = topic
            reply({"ok": True})
        elif cmd["op"] == "shutdown":
            pubs.pop(cmd["name"]).shutdown()
            reply({"ok": True})
        elif cmd["op"] == "exit":
            break
    except Exception as exc:
        reply({"error": repr(exc)})
for pub in pubs.values():
    pub.shutdown()
"""


class Harness:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_HOST_IP="127.0.0.1", VLLM_LOGGING_LEVEL="WARNING")
        self.proc = vllm_script(HARNESS, env)
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                assert self.proc.stderr is not None
                raise RuntimeError(f"publisher harness died:\n{self.proc.stderr.read()[-3000:]}")
            if line.startswith("@@"):
                answer: dict[str, Any] = json.loads(line[2:])
                if "error" in answer:
                    raise RuntimeError(f"publisher harness: {answer['error']}")
                return answer

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def new(self, name: str, endpoint: str, replay: str | None = None) -> dict[str, Any]:
        return self.call(op="new", name=name, endpoint=endpoint, replay=replay, topic=TOPIC)

    def publish(self, name: str, *batches: list[dict[str, Any]], hidden: bool = False) -> None:
        self.call(op="publish", name=name, batches=list(batches), hidden=hidden)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: these tests drive vLLM's own publisher")
    h = Harness()
    try:
        yield h
    finally:
        h.close()


_names = iter(range(1_000_000))


@pytest.fixture
def name() -> str:
    return f"pub{next(_names)}"


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {
        "type": "stored",
        "hashes": hashes,
        "parent": parent,
        "tokens": tokens,
        "block_size": BLOCK,
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "removed", "hashes": hashes}



async def join(harness: Harness, name: str, sub: KvEventSubscriber) -> None:
    """Publish empty batches until one arrives: a SUB socket misses what is published before its
    subscription reaches the publisher (ZMQ's slow joiner)."""
    seen = sub.stats().batches
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        harness.publish(name, [])
        await asyncio.sleep(0.02)
        if sub.stats().batches > seen:
            # drain probes still in flight so later assertions see a quiet socket
            await asyncio.sleep(0.05)
            return
    raise AssertionError("subscriber never received a batch")


PROMPT = list(range(1000, 1000 + 6 * BLOCK))  # 6 full blocks
OURS = block_hashes(PROMPT, BLOCK)


@pytest_asyncio.fixture(loop_scope="function")
async def prefix() -> AsyncIterator[PrefixIndex]:
    p = PrefixIndex(BlockIndex(), replay_timeout_s=2.0)
    try:
        yield p
    finally:
        await p.close()


def held(prefix: PrefixIndex, worker: str) -> int:
    return prefix.index.match_prefix(OURS, [worker])[worker]


async def test_vllm_publisher_events_update_index_when_gateway_connects(
    harness: Harness, name: str, prefix: PrefixIndex
) -> None:
    ep = harness.new(name, "tcp://*:0")
    prefix.set_worker("w", BLOCK, 1000, KvEventsConfig(ep["endpoint"], topic=TOPIC))
    await prefix.start()
    assert prefix.has_events("w")
    sub = prefix.subscriber("w")
    assert sub is not None
    await join(harness, name, sub)

    harness.publish(name, [stored([11, 12, 13, 14], PROMPT[: 4 * BLOCK])])
    await eventually(lambda: held(prefix, "w") == 4)
    assert prefix.cached_tokens(tuple(PROMPT), [("w", BLOCK)]) == {"w": 4 * BLOCK}

    harness.publish(name, [stored([15, 16], PROMPT[4 * BLOCK :], parent=14)])
    await eventually(lambda: held(prefix, "w") == 6)
    assert prefix.index.stats()["w"].confirmed == 6

    harness.publish(name, [removed([13])])
    await eventually(lambda: held(prefix, "w") == 2)

    harness.publish(name, [{"type": "cleared"}])
    await eventually(lambda: prefix.index.stats()["w"].total == 0)
    assert sub.stats().gaps == 0 and sub.stats().resets == 0
    harness.call(op="shutdown", name=name)


async def test_vllm_publisher_events_update_index_when_worker_connects_to_gateway(
    harness: Harness, name: str
) -> None:
    index = BlockIndex()
    sub = KvEventSubscriber(
        "w", KvEventsConfig("tcp://127.0.0.1:0", topic=TOPIC, bind=True), index, BLOCK
    )
    await sub.start()
    try:
        assert sub.bound_endpoint is not None and not sub.bound_endpoint.endswith(":0")
        harness.new(name, sub.bound_endpoint)  # no "*": vLLM's PUB connects
        await join(harness, name, sub)
        harness.publish(name, [stored([21, 22, 23], PROMPT[: 3 * BLOCK])])
        await eventually(lambda: index.match_prefix(OURS, ["w"])["w"] == 3)
        harness.call(op="shutdown", name=name)
    finally:
        await sub.close()
        await sub.close()  # idempotent


async def test_missed_batches_are_recovered_from_vllm_replay_socket(
    harness: Harness, name: str, prefix: PrefixIndex
) -> None:
    ep = harness.new(name, "tcp://*:0", replay="tcp://*:0")
    assert ep["replay"] is not None
    prefix.set_worker("w", BLOCK, None, KvEventsConfig(ep["endpoint"], ep["replay"], TOPIC))
    await prefix.start()
    sub = prefix.subscriber("w")
    assert sub is not None
    await join(harness, name, sub)

    harness.publish(name, [stored([31, 32], PROMPT[: 2 * BLOCK])])
    await eventually(lambda: held(prefix, "w") == 2)
    # these two never reach the subscriber ...
    harness.publish(
        name,
        [stored([33], PROMPT[2 * BLOCK : 3 * BLOCK], parent=32)],
        [stored([34, 35], PROMPT[3 * BLOCK : 5 * BLOCK], parent=33)],
        hidden=True,
    )
    # ... so this child of block 35 shows a gap; replay must bring 33..35 back first
    harness.publish(name, [stored([36], PROMPT[5 * BLOCK :], parent=35)])
    await eventually(lambda: held(prefix, "w") == 6)
    # The replay may bring batch 36 itself before its end frame, and a replay is counted at its
    # end: all six blocks can be held a moment before the count.
    await eventually(lambda: sub.stats().replays + sub.stats().resets > 0)
    stats = sub.stats()
    assert (stats.gaps, stats.replays, stats.resets) == (1, 1, 0)
    assert stats.events.get("skipped_orphan", 0) == 0
    harness.call(op="shutdown", name=name)


async def test_gateway_started_after_vllm_published_reads_what_it_holds_from_the_replay_socket(
    harness: Harness, name: str, prefix: PrefixIndex
) -> None:
    """Warm start on vLLM's own publisher: a gateway (re)started in front of a worker that
    already holds prompts knows them before the worker publishes anything new."""
    ep = harness.new(name, "tcp://*:0", replay="tcp://*:0")
    harness.publish(name, [stored([41, 42, 43], PROMPT[: 3 * BLOCK])])
    harness.publish(name, [stored([44, 45], PROMPT[3 * BLOCK : 5 * BLOCK], parent=43)])
    harness.publish(name, [removed([45])])
    prefix.set_worker("w", BLOCK, None, KvEventsConfig(ep["endpoint"], ep["replay"], TOPIC))
    await prefix.start()
    sub = prefix.subscriber("w")
    assert sub is not None
    await eventually(lambda: sub.stats().warm_starts == 1)
    assert held(prefix, "w") == 4
    stats = sub.stats()
    assert (stats.warm_batches, stats.last_seq, stats.resets) == (3, 2, 0)
    harness.call(op="shutdown", name=name)


async def test_gap_without_replay_endpoint_drops_the_workers_entries(
    harness: Harness, name: str, prefix: PrefixIndex
) -> None:
    ep = harness.new(name, "tcp://*:0")
    prefix.set_worker("w", BLOCK, None, KvEventsConfig(ep["endpoint"], topic=TOPIC))
    await prefix.start()
    sub = prefix.subscriber("w")
    assert sub is not None
    await join(harness, name, sub)

    harness.publish(name, [stored([41, 42, 43], PROMPT[: 3 * BLOCK])])
    await eventually(lambda: held(prefix, "w") == 3)
    harness.publish(name, [removed([41])], hidden=True)  # lost: we would keep a stale block
    other = list(range(5000, 5000 + 2 * BLOCK))
    harness.publish(name, [stored([51, 52], other)])
    await eventually(lambda: prefix.index.match_prefix(block_hashes(other, BLOCK), ["w"])["w"] == 2)
    assert held(prefix, "w") == 0
    assert sub.stats().resets == 1
    harness.call(op="shutdown", name=name)


async def test_publisher_restart_clears_the_workers_entries(
    harness: Harness, name: str, prefix: PrefixIndex
) -> None:
    ep = harness.new(name, "tcp://*:0")
    prefix.set_worker("w", BLOCK, None, KvEventsConfig(ep["endpoint"], topic=TOPIC))
    await prefix.start()
    sub = prefix.subscriber("w")
    assert sub is not None
    await join(harness, name, sub)
    for i in range(5):  # move seq well past where the restarted publisher will begin
        harness.publish(
            name,
            [
                stored(
                    [60 + i], PROMPT[i * BLOCK : (i + 1) * BLOCK], parent=None if i == 0 else 59 + i
                )
            ],
        )
    await eventually(lambda: held(prefix, "w") == 5)

    harness.call(op="shutdown", name=name)
    harness.new(name, ep["endpoint"].replace("127.0.0.1", "*"))  # same port, seq from 0 again
    await join(harness, name, sub)
    assert held(prefix, "w") == 0
    assert sub.stats().resets >= 1
    harness.publish(name, [stored([71], PROMPT[:BLOCK])])  # the new engine's own blocks count
    await eventually(lambda: held(prefix, "w") == 1)
    harness.call(op="shutdown", name=name)


@pytest_asyncio.fixture(loop_scope="function")
async def processes() -> AsyncIterator[tuple[PrefixIndex, PrefixIndex]]:
    """The prefix indexes of two gateway processes (leader, follower) sharing a runtime_dir."""
    with tempfile.TemporaryDirectory(prefix="kvg") as d:
        pair = (PrefixIndex(BlockIndex(), relay=EventRelay(Path(d), leader=True)),
                PrefixIndex(BlockIndex(), relay=EventRelay(Path(d), leader=False)))
        try:
            yield pair
        finally:
            for p in pair:
                await p.close()


async def test_vllm_publisher_events_reach_every_gateway_process_when_they_connect(
    harness: Harness, name: str, processes: tuple[PrefixIndex, PrefixIndex]
) -> None:
    ep = harness.new(name, "tcp://*:0")
    for p in processes:
        p.set_worker("w", BLOCK, 1000, KvEventsConfig(ep["endpoint"], topic=TOPIC))
        await p.start()
        sub = p.subscriber("w")
        assert sub is not None
        await join(harness, name, sub)

    harness.publish(name, [stored([81, 82, 83], PROMPT[: 3 * BLOCK])])
    await eventually(lambda: all(held(p, "w") == 3 for p in processes))
    harness.call(op="shutdown", name=name)


async def test_vllm_publisher_events_reach_a_follower_through_the_leader_when_the_worker_connects(
    harness: Harness, name: str, processes: tuple[PrefixIndex, PrefixIndex]
) -> None:
    leader, follower = processes
    for p in processes:
        p.set_worker("w", BLOCK, 1000, KvEventsConfig("tcp://127.0.0.1:0", topic=TOPIC, bind=True))
        await p.start()
    bound, relayed = leader.subscriber("w"), follower.subscriber("w")
    assert bound is not None and relayed is not None and bound.bound_endpoint is not None
    harness.new(name, bound.bound_endpoint)  # vLLM's PUB connects to the leader's port only
    await join(harness, name, relayed)

    harness.publish(name, [stored([91, 92, 93], PROMPT[: 3 * BLOCK])])
    await eventually(lambda: held(leader, "w") == 3 and held(follower, "w") == 3)
    harness.publish(name, [removed([92])])
    await eventually(lambda: held(leader, "w") == 1 and held(follower, "w") == 1)
    assert relayed.stats().gaps == 0 and relayed.stats().resets == 0
    harness.call(op="shutdown", name=name)
