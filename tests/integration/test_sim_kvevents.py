"""The simulator's KV events are vLLM's: frames captured here decode with vLLM 0.32's own msgspec
classes (in a ``.venv-vllm`` subprocess), re-encode to the same bytes, and carry the block hashes
vLLM's own ``hash_block_tokens`` computes for the same tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from gateway.procs.vllm import vllm_script
from gateway.sim import SimFleet, SimWorkerConfig
from gateway.sim.kvcache import block_hashes_for, external_hash, none_hash
from gateway.sim.kvevents import END_SEQ
from tests.harness import replayed_batch, zmq_handshakes

pytestmark = pytest.mark.asyncio(loop_scope="module")

BS = 16

# A long-lived .venv-vllm process (importing vLLM costs seconds): one JSON job per stdin line,
# one JSON answer per stdout line.
ORACLE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as u

dec = msgspec.msgpack.Decoder(KVEventBatch)
enc = msgspec.msgpack.Encoder()
u.init_none_hash(sha256)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    batches = []
    for hexpayload in job["payloads"]:
        raw = bytes.fromhex(hexpayload)
        batch = dec.decode(raw)
        batches.append({
            "ts": batch.ts,
            "rank": batch.data_parallel_rank,
            "events": msgspec.to_builtins(batch.events),
            "classes": [type(e).__name__ for e in batch.events],
            "same_bytes": enc.encode(batch) == raw,
        })
    hashes = []
    bs = job["block_size"]
    salts = job.get("salts") or [None] * len(job["token_lists"])
    for tokens, salt in zip(job["token_lists"], salts):
        parent, out = None, []
        for i in range(0, len(tokens) - bs + 1, bs):
            # vLLM's generate_block_hash_extra_keys: the salt is the first block's only
            extra = (("cache_salt", salt),) if salt and i == 0 else None
            parent = u.hash_block_tokens(sha256, parent, tokens[i:i + bs], extra)
            out.append(u.maybe_convert_block_hash(parent))
        hashes.append(out)
    print(json.dumps({"batches": batches, "hashes": hashes}), flush=True)
"""


class VllmOracle:
    def __init__(self) -> None:
        self.proc = vllm_script(ORACLE, {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})

    async def ask(self, payloads: list[bytes], token_lists: list[list[int]],
                  salts: list[str | None] | None = None) -> dict[str, Any]:
        job = {
            "payloads": [p.hex() for p in payloads],
            "token_lists": token_lists,
            "block_size": BS,
            "salts": salts,
        }
        return await asyncio.to_thread(self._ask, job)

    def _ask(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                assert self.proc.stderr is not None
                raise AssertionError("vLLM oracle died: " + self.proc.stderr.read()[-3000:])
            answer: dict[str, Any] = json.loads(line)
            if "ready" not in answer:
                return answer

    def close(self) -> None:
        self.proc.kill()  # vLLM's interpreter shutdown takes seconds; nothing to flush
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module", autouse=True)
def oracle() -> Iterator[VllmOracle]:
    """Started by the module's first test, so it imports vLLM while the others run."""
    o = VllmOracle()
    yield o
    o.close()


EVENTS_CONFIG = SimWorkerConfig(
    model_name="sim-ev",
    num_gpu_blocks=9,  # 8 usable blocks: easy to force evictions
    max_model_len=128,
    time_scale=0.0,
    kv_events=True,
    kv_events_endpoint="tcp://127.0.0.1:*",
    kv_replay_endpoint="tcp://127.0.0.1:*",
    kv_events_topic="kv-events",
    hash_seed="vllm-none-hash",  # the oracle runs without PYTHONHASHSEED, whatever ours is
)


@pytest_asyncio.fixture(loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    """A fresh worker with an empty cache and sequence numbers from 0, per test."""
    fleet = SimFleet([EVENTS_CONFIG])
    await fleet.start()
    yield fleet
    await fleet.stop()


async def recv_batch(sub: zmq.asyncio.Socket, replay: str, seq: int) -> list[bytes]:
    """Batch ``seq`` from ``sub``, or from replay where the subscription missed it (the
    publisher takes a subscription in on its own time: ``tests.harness.next_batch``)."""
    with contextlib.suppress(TimeoutError):
        while True:
            frames = await asyncio.wait_for(sub.recv_multipart(), 10)
            if int.from_bytes(frames[1], "big") >= seq:
                break
        if int.from_bytes(frames[1], "big") == seq:
            return frames
    return await asyncio.to_thread(replayed_batch, replay, seq)


async def complete(url: str, prompt: list[int], max_tokens: int = 1,
                   **fields: Any) -> None:
    async with httpx.AsyncClient() as c:
        resp = await c.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **fields}
        )
        assert resp.status_code == 200, resp.text


async def test_replay_returns_buffered_batches_from_a_sequence_number_then_end(
    fleet: SimFleet,
) -> None:
    worker = fleet.workers[0]
    assert worker.publisher is not None and worker.publisher.replay_endpoint is not None
    await complete(fleet.urls[0], list(range(5000, 5020)))
    last = worker.publisher.next_seq - 1
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(worker.publisher.replay_endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            empty, topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 60)
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            assert msgpack.unpackb(payload)[2] == 0
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert seqs == list(range(last + 1))


async def test_connect_mode_publisher_reaches_a_binding_subscriber() -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = SimWorkerConfig(
        time_scale=0.0,
        num_gpu_blocks=64,
        kv_events=True,
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
    )
    fleet = SimFleet([config])
    try:
        with zmq_handshakes(sub) as handshake:
            await fleet.start()
            # A bound SUB sends its subscription only once its own thread touches the socket
            # after the publisher connected; before that, PUB drops everything.
            handshake(60)  # the publisher has connected
            receiving = asyncio.ensure_future(sub.recv_multipart())
            sub.getsockopt(zmq.EVENTS)  # the SUB attaches it and sends its subscription
            await complete(fleet.urls[0], list(range(16 * 3)))
            topic, seq, payload = await asyncio.wait_for(receiving, 60)
        assert topic == b"" and int.from_bytes(seq, "big") == 0
        _ts, events, rank = msgpack.unpackb(payload)
        assert rank == 0
        assert events[0]["type"] == "BlockStored" and len(events[0]["block_hashes"]) == 3
        async with httpx.AsyncClient() as c:
            sources = (await c.get(f"{fleet.urls[0]}/kv_event_sources")).json()
        assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        await fleet.stop()
        sub.close(linger=0)
        ctx.term()


async def test_events_decode_with_vllm_classes_and_reencode_to_the_same_bytes(
    fleet: SimFleet, oracle: VllmOracle
) -> None:
    worker = fleet.workers[0]
    assert worker.publisher is not None
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    replay = worker.publisher.replay_endpoint
    assert replay is not None
    with zmq_handshakes(sub) as handshake:
        sub.connect(worker.publisher.endpoint)
        handshake(60)  # the subscription is on its way before anything is published
    try:
        a = list(range(1000, 1040))  # 40 tokens: 2 full blocks
        b = list(range(2000, 2120))  # 120 tokens: all 8 blocks -> evicts a's two idle ones
        await complete(fleet.urls[0], a)
        frames = [await recv_batch(sub, replay, 0)]
        await complete(fleet.urls[0], b)
        frames.append(await recv_batch(sub, replay, 1))
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{fleet.urls[0]}/reset_prefix_cache")).status_code == 200
        # As in vLLM, the clear goes out with the next step's events.
        await complete(fleet.urls[0], a)
        frames.append(await recv_batch(sub, replay, 2))
    finally:
        sub.close(linger=0)
        ctx.term()

    topics = {f[0] for f in frames}
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert topics == {b"kv-events"}
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    out = await oracle.ask([f[2] for f in frames], [a, b])
    batches = out["batches"]
    assert all(bt["same_bytes"] for bt in batches)
    assert all(bt["rank"] == 0 for bt in batches)

    (stored_a,) = batches[0]["events"]
    assert batches[0]["classes"] == ["BlockStored"]
    assert stored_a["token_ids"] == a[:32]
    assert stored_a["block_hashes"] == out["hashes"][0]  # vLLM's own hashes of these tokens
    assert stored_a["parent_block_hash"] is None
    assert (stored_a["block_size"], stored_a["medium"], stored_a["group_idx"]) == (16, "GPU", 0)

    # a freed its blocks tail first, so its tail block is evicted first.
    assert batches[1]["classes"] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    removed = [e["block_hashes"][0] for e in batches[1]["events"][:2]]
    assert removed == out["hashes"][0][::-1]
    assert batches[1]["events"][-1]["block_hashes"] == out["hashes"][1]
    assert batches[2]["classes"] == ["AllBlocksCleared", "BlockStored"]
    assert batches[2]["events"][1]["block_hashes"] == out["hashes"][0]  # a is a miss again


async def test_block_hashes_match_vllm_for_long_prompts(oracle: VllmOracle) -> None:
    tokens = [[(i * 7919) % 32000 for i in range(n)] for n in (16, 17, 160, 333)]
    out = await oracle.ask([], tokens)
    root = none_hash("vllm-none-hash")
    assert out["hashes"] == [
        [external_hash(h) for h in block_hashes_for(t, BS, root)] for t in tokens
    ]


async def test_salted_prompts_hash_and_publish_as_vllm_does(
    fleet: SimFleet, oracle: VllmOracle
) -> None:
    """A ``cache_salt`` goes into the first block's hash, as vLLM's own ``hash_block_tokens``
    with its extra keys computes it, and into that block's published extra keys: the same
    tokens unsalted share nothing with it and are stored again."""
    worker = fleet.workers[0]
    assert worker.publisher is not None and worker.publisher.replay_endpoint is not None
    replay = worker.publisher.replay_endpoint
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with zmq_handshakes(sub) as handshake:
            sub.connect(worker.publisher.endpoint)
            handshake(60)
        a = list(range(3000, 3040))  # 2 full blocks
        await complete(fleet.urls[0], a, cache_salt="tenant-1")
        frames = [await recv_batch(sub, replay, 0)]
        await complete(fleet.urls[0], a)
        frames.append(await recv_batch(sub, replay, 1))
    finally:
        sub.close(linger=0)
        ctx.term()
    out = await oracle.ask([f[2] for f in frames], [a, a], ["tenant-1", None])
    assert all(bt["same_bytes"] for bt in out["batches"])
    (salted,), (plain,) = (bt["events"] for bt in out["batches"])
    assert salted["block_hashes"] == out["hashes"][0] != out["hashes"][1]
    assert salted["extra_keys"] == [["tenant-1"], None] and salted["parent_block_hash"] is None
    assert plain["block_hashes"] == out["hashes"][1]
    assert plain["extra_keys"] == [None, None]  # as vLLM publishes a plain chain
