"""AdmissionGate: a cap on requests in flight, a bounded queue served in weighted fair order
across tenants by KV byte-seconds, priority classes, timeouts, clients leaving."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.config import Priority
from gateway.overload import AdmissionGate, Overloaded, Slot, priority_for
from tests.clock import ManualClock

GIB = 1 << 30



async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


class Queue:
    """Requests queued on a gate as tasks; ``granted`` lists (tenant, slot) in the order served."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.granted: list[tuple[str, Slot]] = []
        self.tasks: list[asyncio.Task[None]] = []

    def add(self, tenant: str, n: int = 1, priority: Priority = Priority.INTERACTIVE) -> None:
        async def one() -> None:
            self.granted.append((tenant, await self.gate.acquire(tenant, priority)))

        self.tasks += [asyncio.create_task(one()) for _ in range(n)]

    def cancel(self) -> None:
        """The requests still waiting leave."""
        for task in self.tasks:
            task.cancel()


async def serve(gate: AdmissionGate, clock: ManualClock, queue: Queue, first: Slot, first_tenant: str,
                kv_bytes: dict[str, int], hold_s: float, steps: int) -> dict[str, float]:
    """One slot: each request served in turn holds its tenant's KV bytes for ``hold_s``; the
    byte-seconds each tenant was served over ``steps`` requests."""
    served = dict.fromkeys(kv_bytes, 0.0)
    slot, tenant = first, first_tenant
    await settle()
    for _ in range(steps):
        slot.hold(kv_bytes[tenant])
        clock.advance(hold_s)
        served[tenant] += kv_bytes[tenant] * hold_s
        slot.release()
        await settle()
        tenant, slot = queue.granted[-1]
    return served


# -- the cap, the bound, the timeout (FIFO behaviour kept for one tenant) -----------------------


async def test_admits_up_to_the_cap_then_queues_in_order() -> None:
    gate = AdmissionGate(max_inflight=2, max_queued=5, queue_timeout_s=5)
    a, b = gate.try_enter("t"), await gate.acquire("t")
    assert a is not None
    q = Queue(gate)
    for i in range(3):
        q.add(f"w{i}")
    await settle()
    assert (gate.inflight, gate.queued, q.granted) == (2, 3, [])
    a.release()
    b.release()
    await settle()
    q.granted[0][1].release()
    await settle()
    await asyncio.gather(*q.tasks)
    assert [t for t, _ in q.granted] == ["w0", "w1", "w2"]
    assert gate.inflight == 2 and gate.queued == 0


async def test_full_queue_refuses_at_once_with_retry_after() -> None:
    gate = AdmissionGate(max_inflight=1, max_queued=1, queue_timeout_s=5)
    held = await gate.acquire("t")
    q = Queue(gate)
    q.add("t")
    await settle()
    with pytest.raises(Overloaded) as info:
        await gate.acquire("t")
    assert info.value.retry_after_s == 1.0
    held.release()
    await asyncio.gather(*q.tasks)
    assert gate.inflight == 1


async def test_queue_timeout_refuses_and_leaves_no_trace() -> None:
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=0.05)
    held = await gate.acquire("t")
    with pytest.raises(Overloaded) as info:
        await gate.acquire("t")
    assert info.value.retry_after_s == pytest.approx(0.05)
    assert gate.queued == 0
    held.release()
    assert gate.inflight == 0


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    """A client that goes away while queued must neither hold a slot nor lose one."""
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=5)
    held = await gate.acquire("t")
    queued = asyncio.create_task(gate.acquire("t"))
    await settle()
    queued.cancel()
    await settle()
    held.release()
    assert (gate.inflight, gate.queued) == (0, 0)
    assert (await gate.acquire("t")) is not None and gate.inflight == 1


async def test_waiter_cancelled_as_it_is_granted_passes_the_slot_on() -> None:
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=5)
    held = await gate.acquire("a")
    leaving = asyncio.create_task(gate.acquire("b"))
    q = Queue(gate)
    q.add("c")
    await settle()
    held.release()  # b is granted the slot ...
    leaving.cancel()  # ... and cancelled before it runs
    await settle()
    assert [t for t, _ in q.granted] == ["c"]
    assert (gate.inflight, gate.queued) == (1, 0)


async def test_release_twice_frees_one_slot() -> None:
    gate = AdmissionGate(max_inflight=2, max_queued=3, queue_timeout_s=5)
    slot = await gate.acquire("t")
    await gate.acquire("t")
    slot.release()
    slot.release()
    assert gate.inflight == 1


# -- fair order ----------------------------------------------------------------------------------


async def test_light_tenant_overtakes_a_flooding_tenants_backlog() -> None:
    """FIFO served the flood's 10 queued requests first; fair order serves b's next."""
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=20, queue_timeout_s=60, clock=clock)
    held = await gate.acquire("a")
    held.hold(2 * GIB)
    q = Queue(gate)
    q.add("a", 10)
    await settle()
    q.add("b")
    await settle()
    clock.advance(1)
    held.release()
    await settle()
    assert [t for t, _ in q.granted] == ["b"]


async def test_fifo_mode_serves_in_arrival_order_whoever_floods() -> None:
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=20, queue_timeout_s=60, fair=False,
                         clock=clock)
    held = await gate.acquire("a")
    held.hold(2 * GIB)
    q = Queue(gate)
    q.add("a", 3)
    await settle()
    q.add("b", 1, Priority.INTERACTIVE)
    q.add("c", 1, Priority.BATCH)
    await settle()
    served = await serve(gate, clock, q, held, "a", {"a": 2 * GIB, "b": 1, "c": 1}, 1.0, 5)
    assert [t for t, _ in q.granted] == ["a", "a", "a", "b", "c"]
    assert served["a"] == 4 * 2 * GIB


async def test_in_flight_bytes_count_before_the_request_ends() -> None:
    """A tenant holding a lot right now waits behind one holding little, though neither has
    finished a request yet."""
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=3, max_queued=20, queue_timeout_s=60, clock=clock)
    big, small, other = [await gate.acquire(t) for t in ("a", "b", "x")]
    big.hold(2 * GIB)
    small.hold(GIB // 100)
    q = Queue(gate)
    q.add("a")
    q.add("b")
    await settle()
    clock.advance(5)
    other.release()
    await settle()
    assert gate.tenant_vtime("a") > gate.tenant_vtime("b")
    assert [t for t, _ in q.granted] == ["b"]


@pytest.mark.parametrize("weights", [{}, {"a": 2.0}])
async def test_backlogged_tenants_are_served_byte_seconds_in_proportion_to_weight(
        weights: dict[str, float]) -> None:
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=1000, queue_timeout_s=1e6, weights=weights,
                         clock=clock)
    first = await gate.acquire("a")
    q = Queue(gate)
    q.add("a", 300)
    q.add("b", 300)
    q.add("c", 300)
    # a's requests hold 16x the KV of b's and c's: fairness is in bytes x time, not requests.
    served = await serve(gate, clock, q, first, "a",
                         {"a": 16 * GIB, "b": GIB, "c": GIB}, 0.5, 400)
    share = {t: served[t] / weights.get(t, 1.0) for t in "abc"}
    assert max(share.values()) / min(share.values()) < 1.1, served
    q.cancel()


async def test_tenant_idle_while_another_is_served_does_not_bank_credit() -> None:
    """b, away while a was served alone, comes back level with a, not with a's hour of usage
    to spend: from then on they alternate."""
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=100, queue_timeout_s=1e6, clock=clock)
    for _ in range(100):  # a alone, one request after another
        slot = await gate.acquire("a")
        slot.hold(GIB)
        clock.advance(1)
        slot.release()
    first = await gate.acquire("a")
    q = Queue(gate)
    q.add("b", 20)
    q.add("a", 20)
    await serve(gate, clock, q, first, "a", {"a": GIB, "b": GIB}, 1.0, 10)
    counts = Counter(t for t, _ in q.granted)
    assert counts["a"] >= 4 and counts["b"] >= 4, counts  # banked credit: b 10, a 0
    q.cancel()


async def test_full_queue_pushes_out_the_flooders_newest_request_not_the_newcomer() -> None:
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=60, clock=clock)
    held = await gate.acquire("a")
    held.hold(GIB)
    flood = [asyncio.create_task(gate.acquire("a")) for _ in range(3)]
    await settle()
    newcomer = asyncio.create_task(gate.acquire("b"))
    await settle()
    clock.advance(1)
    assert flood[2].done() and isinstance(flood[2].exception(), Overloaded)
    assert not flood[0].done() and not flood[1].done() and gate.queued == 3
    held.release()
    await settle()
    assert newcomer.done() and not flood[0].done()  # b goes first: a holds the gate's history
    # The flooder itself, on a full queue, is refused rather than pushing out another's.
    flood.append(asyncio.create_task(gate.acquire("a")))
    await settle()
    assert gate.queued == 3
    with pytest.raises(Overloaded):
        await gate.acquire("a")
    for task in flood:
        task.cancel()
    await settle()


# -- priority classes ------------------------------------------------------------------------------


async def test_interactive_first_but_batch_gets_its_bounded_share() -> None:
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=1000, queue_timeout_s=1e6, batch_share=0.1,
                         clock=clock)
    first = await gate.acquire("i")
    q = Queue(gate)
    q.add("b", 100, Priority.BATCH)
    await settle()
    q.add("i", 300)
    served = await serve(gate, clock, q, first, "i", {"i": GIB, "b": GIB}, 1.0, 200)
    order = [t for t, _ in q.granted]
    assert order[:9] == ["i"] * 9  # interactive first ...
    assert Counter(order[:200])["b"] == 20  # ... batch never starves: one in ten
    assert served["b"] > 0
    q.cancel()


async def test_batch_alone_takes_every_slot() -> None:
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=100, queue_timeout_s=1e6, clock=clock)
    first = await gate.acquire("b")
    q = Queue(gate)
    q.add("b", 5, Priority.BATCH)
    await serve(gate, clock, q, first, "b", {"b": GIB}, 1.0, 5)
    assert [t for t, _ in q.granted] == ["b"] * 5


@pytest.mark.parametrize(("header", "ceiling", "expected"), [
    (None, Priority.INTERACTIVE, Priority.INTERACTIVE),
    (None, Priority.BATCH, Priority.BATCH),
    ("batch", Priority.INTERACTIVE, Priority.BATCH),
    (" Batch ", Priority.INTERACTIVE, Priority.BATCH),
    ("interactive", Priority.BATCH, Priority.BATCH),  # a batch key cannot raise itself
    ("interactive", Priority.INTERACTIVE, Priority.INTERACTIVE),
])
def test_priority_header_may_lower_the_keys_class_never_raise_it(
        header: str | None, ceiling: Priority, expected: Priority) -> None:
    assert priority_for(header, ceiling) is expected


def test_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="interactive, batch"):
        priority_for("urgent", Priority.INTERACTIVE)


async def test_a_floods_debt_ends_with_its_busy_period() -> None:
    """a used the slot alone while b was light; once the queue has emptied, a next contention
    starts level instead of starving a until b has used as much (a ran 0 of 10 otherwise)."""
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=1, max_queued=100, queue_timeout_s=1e6, clock=clock)
    first = await gate.acquire("a")
    q = Queue(gate)
    q.add("a", 20)
    await settle()
    q.add("b", 1)
    await serve(gate, clock, q, first, "a", {"a": 16 * GIB, "b": GIB}, 1.0, 21)
    q.granted[-1][1].release()
    assert (gate.queued, gate.inflight) == (0, 0)
    first = await gate.acquire("b")
    q = Queue(gate)
    q.add("b", 10)
    await settle()
    q.add("a", 10)
    await serve(gate, clock, q, first, "b", {"a": GIB, "b": GIB}, 1.0, 10)
    counts = Counter(t for t, _ in q.granted)
    assert counts["a"] >= 4 and counts["b"] >= 4, counts
    q.cancel()


async def test_a_shrunk_hold_is_charged_its_shed_bytes_only_for_the_time_they_were_held(
        ) -> None:
    """A prefill/decode request holds its prompt twice until the decode worker pulls it; its
    tenant's meter then counts the decode side alone, as its budget does."""
    clock = ManualClock()
    gate = AdmissionGate(max_inflight=2, max_queued=4, queue_timeout_s=60, clock=clock)
    shrunk, whole = await gate.acquire("a"), await gate.acquire("b")
    shrunk.hold(3 * GIB)
    whole.hold(2 * GIB)
    clock.advance(1)
    shrunk.shrink(2 * GIB)
    shrunk.shrink(4 * GIB)  # never grows
    clock.advance(9)
    # a: 3 GiB x 1 s + 2 GiB x 9 s = 21 GiB-s; b: 2 GiB x 10 s = 20 GiB-s
    assert gate.tenant_vtime("a") == pytest.approx(21 * GIB)
    assert gate.tenant_vtime("b") == pytest.approx(20 * GIB)
    shrunk.release()
    whole.release()
    clock.advance(5)
    assert gate.tenant_vtime("a") == pytest.approx(21 * GIB)  # nothing held after release
    shrunk.shrink(0)  # after release: no change
    assert gate.tenant_vtime("a") == pytest.approx(21 * GIB)
