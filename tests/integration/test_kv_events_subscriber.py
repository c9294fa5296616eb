"""The subscriber's ordering rules against a hand-driven PUB/ROUTER pair (real ZMQ sockets).

vLLM's own publisher numbers batches itself; these tests need to choose the sequence numbers
(duplicates, a replay buffer that has moved on, a replay socket that never answers, bytes that are
not msgpack), so they speak the same wire format from a pyzmq PUB and ROUTER written here.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest_asyncio
import zmq
import zmq.asyncio

from gateway.kvindex.events import KvEventsConfig, KvEventSubscriber
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.relay import EventRelay
from gateway.kvindex.service import PrefixIndex
from tests.harness import eventually

BLOCK = 4
TOPIC = b"kv"


def batch(*events: dict[str, object]) -> bytes:
    payload: bytes = msgpack.packb([0.0, list(events), 0])
    return payload


def stored(engine_hash: int, tokens: list[int], parent: int | None = None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [engine_hash],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


TOKENS = list(range(100, 100 + 8 * BLOCK))
OURS = block_hashes(TOKENS, BLOCK)


def chain_batch(i: int) -> bytes:
    """Batch ``i`` stores block ``i`` of TOKENS (engine hash 1000 + i), chained to block i - 1."""
    return batch(stored(1000 + i, TOKENS[i * BLOCK : (i + 1) * BLOCK], None if i == 0 else 999 + i))


class FakeVllm:
    """A PUB socket plus an optional ROUTER replay socket speaking vLLM's wire format."""

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool, answer_replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve(answer_replay))

    async def _serve(self, answer: bool) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if not answer:
                continue
            for seq in sorted(s for s in self.buffer if s >= start_seq):
                await self.router.send_multipart(
                    [client, b"", TOPIC, seq.to_bytes(8, "big"), self.buffer[seq]]
                )
            await self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    async def send(
        self, seq: int, payload: bytes, *, lost: bool = False, keep: bool = True
    ) -> None:
        if keep:
            self.buffer[seq] = payload
        if not lost:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@pytest_asyncio.fixture(loop_scope="function")
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """The test's ZMQ context. A test that fails before closing its subscribers and fakes leaves
    their tasks running on the loop: they are cancelled here, before the context's sockets go,
    so one failure cannot hang or spill into the next test."""
    before = asyncio.all_tasks()
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        left = asyncio.all_tasks() - before - {asyncio.current_task()}
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        c.destroy(linger=0)



async def connected(fake: FakeVllm, sub: KvEventSubscriber, first_seq: int = 0,
                    keep: bool = False) -> int:
    """Send empty batches 0, 1, 2 ... until one arrives (ZMQ's slow joiner drops what precedes
    the subscription); returns the next sequence number to send. ``keep``: the probes stay in
    the replay buffer too (by default not, so that no history replay brings a probe whose live
    copy then counts as a duplicate)."""
    for seq in range(first_seq, first_seq + 400):
        await fake.send(seq, batch(), keep=keep)
        await asyncio.sleep(0.005)
        if sub.stats().batches:
            await asyncio.sleep(0.02)  # let the probes in flight arrive
            return seq + 1
    raise AssertionError("subscriber never received a batch")


def held(index: BlockIndex) -> int:
    return index.match_prefix(OURS, ["w"])["w"]


async def start(
    fake: FakeVllm, index: BlockIndex, replay_timeout_s: float = 2.0
) -> tuple[KvEventSubscriber, int]:
    config = KvEventsConfig(fake.endpoint, fake.replay_endpoint, TOPIC.decode())
    sub = KvEventSubscriber("w", config, index, BLOCK, replay_timeout_s=replay_timeout_s)
    await sub.start()
    n = await connected(fake, sub)
    # Starting fresh, it asked for the worker's history ("Warm start"): from seq 0, every time.
    assert set(fake.replay_requests) <= {0}
    assert bool(fake.replay_requests) == (fake.replay_endpoint is not None)
    fake.replay_requests.clear()
    return sub, n


async def test_in_order_batches_apply(ctx: zmq.asyncio.Context) -> None:
    fake, index = FakeVllm(ctx, replay=False), BlockIndex()
    sub, n = await start(fake, index)
    for i in range(4):
        await fake.send(n + i, chain_batch(i))
    await eventually(lambda: held(index) == 4)
    stats = sub.stats()
    assert stats.last_seq == n + 3
    assert (stats.gaps, stats.restarts, stats.resets) == (0, 0, 0)
    await sub.close()
    await fake.close()


async def test_replayed_batches_arriving_again_live_are_skipped_as_duplicates(
    ctx: zmq.asyncio.Context,
) -> None:
    """Regression: after a replay, the live copies of the replayed batches must not be taken for
    a publisher restart (which would drop every block)."""
    fake, index = FakeVllm(ctx, replay=True), BlockIndex()
    sub, n = await start(fake, index)
    await fake.send(n, chain_batch(0))
    await fake.send(n + 1, chain_batch(1), lost=True)
    await fake.send(n + 2, chain_batch(2), lost=True)
    # published after batch 3, so the replay asked for at batch 3 returns them too ...
    fake.buffer[n + 4] = chain_batch(4)
    fake.buffer[n + 5] = chain_batch(5)
    await fake.send(n + 3, chain_batch(3))  # the gap shows here
    await eventually(lambda: held(index) == 6)
    # ... and then their live copies arrive
    await fake.send(n + 4, chain_batch(4))
    await fake.send(n + 5, chain_batch(5))
    await fake.send(n + 6, chain_batch(6))
    await eventually(lambda: held(index) == 7)
    stats = sub.stats()
    assert fake.replay_requests == [n + 1]
    assert (stats.replays, stats.restarts, stats.resets, stats.duplicates) == (1, 0, 0, 2)
    await sub.close()
    await fake.close()


async def test_replay_that_no_longer_has_the_missed_batches_drops_the_workers_entries(
    ctx: zmq.asyncio.Context,
) -> None:
    fake, index = FakeVllm(ctx, replay=True), BlockIndex()
    sub, n = await start(fake, index)
    await fake.send(n, chain_batch(0))
    await fake.send(n + 1, chain_batch(1))
    await eventually(lambda: held(index) == 2)
    await fake.send(n + 2, chain_batch(2), lost=True, keep=False)  # fell out of the replay buffer
    await fake.send(n + 3, batch(stored(77, [9, 9, 9, 9])))
    await eventually(lambda: sub.stats().last_seq == n + 3)
    assert held(index) == 0
    assert index.match_prefix(block_hashes([9, 9, 9, 9], BLOCK), ["w"])["w"] == 1
    assert (sub.stats().resets, sub.stats().replays) == (1, 0)
    await sub.close()
    await fake.close()


async def test_replay_socket_that_never_answers_drops_the_workers_entries(
    ctx: zmq.asyncio.Context,
) -> None:
    fake, index = FakeVllm(ctx, replay=True, answer_replay=False), BlockIndex()
    sub, n = await start(fake, index, replay_timeout_s=0.2)
    await fake.send(n, chain_batch(0))
    await eventually(lambda: held(index) == 1)  # no history at start: cold, not stuck
    assert (sub.stats().warm_starts, sub.stats().resets) == (0, 0)
    await fake.send(n + 2, batch())
    await eventually(lambda: sub.stats().resets == 1)
    assert held(index) == 0 and sub.stats().last_seq == n + 2
    assert fake.replay_requests == [n + 1]
    await sub.close()
    await fake.close()


async def test_seq_going_back_to_zero_is_a_restart_that_clears_the_worker(
    ctx: zmq.asyncio.Context,
) -> None:
    fake, index = FakeVllm(ctx, replay=True), BlockIndex()
    sub, n = await start(fake, index)
    for i in range(3):
        await fake.send(n + i, chain_batch(i))
    await eventually(lambda: held(index) == 3)
    await fake.send(0, batch(stored(5, [7, 7, 7, 7])))
    await eventually(lambda: sub.stats().restarts == 1)
    assert held(index) == 0
    assert index.match_prefix(block_hashes([7, 7, 7, 7], BLOCK), ["w"])["w"] == 1
    assert fake.replay_requests == []
    await sub.close()
    await fake.close()


def removed_batch(engine_hash: int) -> bytes:
    return batch({"type": "BlockRemoved", "block_hashes": [engine_hash], "medium": "GPU"})


async def test_subscriber_opening_in_front_of_a_busy_worker_is_warm_before_any_live_batch(
    ctx: zmq.asyncio.Context,
) -> None:
    """A gateway (re)started in front of a worker that already holds prompts reads the worker's
    history from its replay socket at once: no live batch is needed to know what it holds."""
    fake, index = FakeVllm(ctx, replay=True), BlockIndex()
    for i in range(6):
        await fake.send(i, chain_batch(i), lost=True)  # published before this gateway existed
    await fake.send(6, removed_batch(1005), lost=True)  # history includes what left, too
    config = KvEventsConfig(fake.endpoint, fake.replay_endpoint, TOPIC.decode())
    sub = KvEventSubscriber("w", config, index, BLOCK)
    await sub.start()
    # the history is counted once its end is read, a moment after its last batch is applied
    await eventually(lambda: held(index) == 5 and sub.stats().warm_starts == 1)
    stats = sub.stats()
    assert (stats.warm_starts, stats.warm_batches, stats.last_seq) == (1, 7, 6)
    assert fake.replay_requests == [0]
    # live batches go on from there; those the history brought again are duplicates
    await fake.send(6, removed_batch(1005))
    await fake.send(7, chain_batch(5))
    await eventually(lambda: held(index) == 6)
    assert sub.stats().resets == 0  # history and live batches, one contiguous sequence
    await sub.close()
    await fake.close()


async def test_first_live_batch_after_missed_ones_brings_the_history_before_it(
    ctx: zmq.asyncio.Context,
) -> None:
    """A worker that starts after the gateway: its first batches go out before the subscription
    reaches it (ZMQ's slow joiner); the first batch seen, seq k >= 3, asks for 0..k-1 first."""
    fake, index2 = FakeVllm(ctx, replay=True), BlockIndex()
    sub2 = KvEventSubscriber(
        "w", KvEventsConfig(fake.endpoint, fake.replay_endpoint, TOPIC.decode()), index2, BLOCK)
    await sub2.start()
    await eventually(lambda: fake.replay_requests == [0])  # the opening read: empty
    for i in range(3):
        await fake.send(i, chain_batch(i), lost=True)
    first_seen = await connected(fake, sub2, first_seq=3, keep=True) - 1  # empty 3, 4 ...
    assert held(index2) == 3
    assert fake.replay_requests == [0, 0]
    stats = sub2.stats()
    assert (stats.warm_starts, stats.warm_batches, stats.resets) == (1, first_seen, 0)
    await sub2.close()
    await fake.close()


async def test_history_that_no_longer_starts_at_zero_misses_old_blocks_and_invents_none(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM's buffer keeps the last buffer_steps batches: a block stored before them is unknown
    (its children cannot be placed either), never a phantom."""
    fake, index = FakeVllm(ctx, replay=True), BlockIndex()
    for i in range(2, 6):  # 0 and 1 fell out of the buffer
        fake.buffer[i] = chain_batch(i)
    fake.buffer[6] = batch(stored(77, [9, 9, 9, 9]))
    config = KvEventsConfig(fake.endpoint, fake.replay_endpoint, TOPIC.decode())
    sub = KvEventSubscriber("w", config, index, BLOCK)
    await sub.start()
    await eventually(lambda: sub.stats().last_seq == 6)
    assert held(index) == 0
    assert index.match_prefix(block_hashes([9, 9, 9, 9], BLOCK), ["w"])["w"] == 1
    await sub.close()
    await fake.close()


async def test_undecodable_batch_drops_the_workers_entries(ctx: zmq.asyncio.Context) -> None:
    fake, index = FakeVllm(ctx, replay=False), BlockIndex()
    sub, n = await start(fake, index)
    await fake.send(n, chain_batch(0))
    await eventually(lambda: held(index) == 1)
    await fake.send(n + 1, b"\xc1 not msgpack")
    await fake.send(n + 2, batch(stored(5, [7, 7, 7, 7])))
    await eventually(lambda: sub.stats().last_seq == n + 2)
    stats = sub.stats()
    assert (stats.decode_errors, stats.resets, stats.gaps) == (1, 1, 0)
    assert held(index) == 0
    await sub.close()
    await fake.close()


async def test_close_is_idempotent_and_leaves_no_tasks(ctx: zmq.asyncio.Context) -> None:
    fake, index = FakeVllm(ctx, replay=False), BlockIndex()
    before = asyncio.all_tasks()
    sub = KvEventSubscriber("w", KvEventsConfig(fake.endpoint, topic="kv"), index, BLOCK)
    await sub.start()
    assert len(asyncio.all_tasks() - before) == 2
    await sub.close()
    await sub.close()
    assert asyncio.all_tasks() - before == set()
    assert not sub.running
    await fake.close()


async def test_constructor_does_no_io() -> None:
    sub = KvEventSubscriber(
        "w", KvEventsConfig("tcp://127.0.0.1:1", bind=True), BlockIndex(), BLOCK
    )
    assert sub.bound_endpoint is None and not sub.running
    await sub.close()  # closing what never started is fine


async def test_prefix_index_opens_and_closes_subscribers_as_workers_come_and_go(
    ctx: zmq.asyncio.Context,
) -> None:
    fake = FakeVllm(ctx, replay=False)
    prefix = PrefixIndex(BlockIndex())
    before = asyncio.all_tasks()
    config = KvEventsConfig(fake.endpoint, topic="kv")
    prefix.set_worker("early", BLOCK, 100, config)
    assert not prefix.has_events("early")  # nothing opens before start()
    await prefix.start()
    assert prefix.has_events("early")
    prefix.set_worker("late", BLOCK, 100, config)  # opens at once while running
    assert prefix.has_events("late")
    prefix.set_worker("late", BLOCK, 200, config)  # capacity only: same subscriber
    assert prefix.has_events("late")
    prefix.remove_worker("early")
    assert not prefix.has_events("early")
    prefix.set_worker("late", BLOCK, 200, None)  # events switched off
    assert not prefix.has_events("late")
    await prefix.close()
    await prefix.close()
    assert asyncio.all_tasks() - before == set()
    await fake.close()


async def test_prefix_index_routes_approximately_when_the_event_endpoint_cannot_be_bound(
    ctx: zmq.asyncio.Context,
) -> None:
    taken = ctx.socket(zmq.PULL)
    taken.bind("tcp://127.0.0.1:0")
    prefix = PrefixIndex(BlockIndex())
    await prefix.start()
    try:
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        prefix.set_worker("w", BLOCK, None, KvEventsConfig(endpoint, bind=True))
        assert not prefix.has_events("w")
        prefix.record_routed("w", tuple(TOKENS), BLOCK)
        assert prefix.index.stats()["w"].learned == len(OURS)
    finally:
        await prefix.close()
        taken.close(linger=0)


async def test_first_batch_after_a_disconnect_starts_fresh_even_when_seq_continues(
    ctx: zmq.asyncio.Context,
) -> None:
    """Regression: a restarted publisher whose first batches were lost before we reconnected can
    show exactly ``last + 1``; taken for a continuation, the dead engine's blocks stayed forever."""
    fake, index = FakeVllm(ctx, replay=False), BlockIndex()
    sub, n = await start(fake, index)
    for i in range(3):
        await fake.send(n + i, chain_batch(i))
    await eventually(lambda: held(index) == 3)
    endpoint = fake.endpoint
    fake.pub.close(linger=0)
    await eventually(lambda: sub.stats().disconnects == 1)
    for _ in range(100):  # the old socket may hold the port for a moment
        try:
            fake.pub = ctx.socket(zmq.PUB)
            fake.pub.bind(endpoint)
            break
        except zmq.ZMQError:
            fake.pub.close(linger=0)
            await asyncio.sleep(0.02)
    fresh = batch(stored(5, [7, 7, 7, 7]))
    for _ in range(400):  # the same seq, last + 1, until it gets through
        await fake.send(n + 3, fresh)
        await asyncio.sleep(0.005)
        if sub.stats().reconnects:
            break
    await eventually(lambda: sub.stats().reconnects == 1)
    assert held(index) == 0
    assert index.match_prefix(block_hashes([7, 7, 7, 7], BLOCK), ["w"])["w"] == 1
    await sub.close()
    await fake.close()


async def test_bind_mode_follower_gets_the_leaders_batches_and_its_lost_peer(
    ctx: zmq.asyncio.Context,
) -> None:
    """Several gateway processes, the worker connecting to the gateway: the leader binds and
    re-publishes; the follower's subscriber sees the same batches and the leader's disconnect."""
    with tempfile.TemporaryDirectory(prefix="kvg") as d:
        leader = PrefixIndex(BlockIndex(), relay=EventRelay(Path(d), leader=True))
        follower = PrefixIndex(BlockIndex(), relay=EventRelay(Path(d), leader=False))
        config = KvEventsConfig("tcp://127.0.0.1:0", topic=TOPIC.decode(), bind=True)
        for p in (leader, follower):
            p.set_worker("w", BLOCK, 100, config)
            await p.start()
        lsub, fsub = leader.subscriber("w"), follower.subscriber("w")
        assert lsub is not None and fsub is not None and lsub.bound_endpoint is not None
        assert fsub.bound_endpoint is None  # the follower binds nothing
        pub = ctx.socket(zmq.PUB)
        pub.connect(lsub.bound_endpoint)

        async def send(seq: int, payload: bytes) -> None:
            await pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

        n = 0
        while not fsub.stats().batches:  # two slow joiners: worker -> leader -> follower
            assert n < 400, "the follower never received a batch"
            await send(n, batch())
            n += 1
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        for i in range(3):
            await send(n + i, chain_batch(i))
        await eventually(lambda: held_by(leader) == 3 and held_by(follower) == 3)

        pub.close(linger=0)
        await eventually(lambda: fsub.stats().disconnects == 1)
        pub = ctx.socket(zmq.PUB)  # the engine restarted: same seq continues by chance
        pub.connect(lsub.bound_endpoint)
        fresh = batch(stored(5, [7, 7, 7, 7]))
        while not fsub.stats().reconnects:
            await send(n + 3, fresh)
            await asyncio.sleep(0.005)
        await eventually(lambda: held_by(leader) == 0 and held_by(follower) == 0)
        pub.close(linger=0)
        await follower.close()
        await leader.close()


def held_by(prefix: PrefixIndex) -> int:
    return prefix.index.match_prefix(OURS, ["w"])["w"]


async def test_hit_accounting_learns_which_predicted_blocks_the_workers_events_removed(
    ctx: zmq.asyncio.Context,
) -> None:
    """The ``evicted`` bucket: a probe taken at routing says the shortfall was evicted when the
    worker's events removed the first block vLLM did not serve after it, and not when the
    removal came before routing (the prediction was stale) or hit another block."""
    fake = FakeVllm(ctx, replay=False)
    prefix = PrefixIndex(BlockIndex())
    prefix.set_worker("w", BLOCK, 100, KvEventsConfig(fake.endpoint, topic=TOPIC.decode()))
    await prefix.start()
    try:
        sub = prefix.subscriber("w")
        assert sub is not None
        n = await connected(fake, sub)
        for i in range(8):
            await fake.send(n + i, chain_batch(i))
        await eventually(lambda: held(prefix.index) == 8)
        prompt = (*TOKENS, 7)  # 8 usable blocks: vLLM never serves the last token from cache
        routed = prefix.eviction_probe("w", prompt, BLOCK)
        assert routed is not None
        # vLLM evicts leaf first: blocks 5, 6, 7 (engine hashes 1005-1007) leave the worker.
        await fake.send(n + 8, batch({"type": "BlockRemoved", "block_hashes": [1007, 1006, 1005],
                                      "medium": "GPU"}))
        await eventually(lambda: held(prefix.index) == 5)
        later = prefix.eviction_probe("w", prompt, BLOCK)
        assert later is not None
        predicted = 8 * BLOCK
        assert routed(predicted, 5 * BLOCK) == 3 * BLOCK  # served 5 blocks, missed block 5: evicted
        assert routed(predicted, 2 * BLOCK) == 0  # missed block 2, still held: a stale prediction
        assert routed(predicted, predicted) == 0  # nothing short
        assert later(predicted, 5 * BLOCK) == 0  # removed before this routing: not evicted since
    finally:
        await prefix.close()
        await fake.close()


async def test_no_eviction_probe_for_a_worker_without_events() -> None:
    prefix = PrefixIndex(BlockIndex())
    prefix.set_worker("w", BLOCK, 100, None)
    assert prefix.eviction_probe("w", tuple(TOKENS), BLOCK) is None
