"""AdmissionGate's room kept for others (long prompts start only while their pool keeps
``reserve_workers`` workers free of long prefills for other tenants' short requests) and its
guaranteed share (a tenant below its share of the slots or of the KV held enters a full gate)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from gateway.config import Priority
from gateway.overload import (
    ROOM_POLL_S,
    SHORT_PREFILL_WAIT_S,
    AdmissionGate,
    Overloaded,
    Slot,
)
from tests.clock import ManualClock

LONG = 4096
GIB = 1 << 30


class Pool:
    """The prompt tokens queued for prefill on each healthy worker of pool ``p``, as the
    dispatcher reports them; tests set them as the workers' state changes."""

    def __init__(self, *queues: int) -> None:
        self.queues = list(queues)
        self.asked: list[str] = []

    def __call__(self, pool: str) -> dict[str, int]:
        self.asked.append(pool)
        return {f"w{k}": q for k, q in enumerate(self.queues)}


def gate_for(pool: Pool, *, max_inflight: int = 8, reserve_workers: int = 1,
             queue_timeout_s: float = 5.0, clock: Callable[[], float] | None = None,
             active_window_s: float = 5.0) -> AdmissionGate:
    return AdmissionGate(max_inflight, 100, queue_timeout_s, long_prompt_tokens=LONG,
                         reserve_workers=reserve_workers, active_window_s=active_window_s,
                         prefill_queues=pool, clock=clock or ManualClock())


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def enter(gate: AdmissionGate, tenant: str, prompt_tokens: int) -> Slot:
    """One request through the gate as the dispatcher takes it: a slot, then the room."""
    slot = await gate.acquire(tenant)
    wait = gate.room(slot, prompt_tokens, "p")
    if wait is not None:
        await wait
    return slot


def short_from(gate: AdmissionGate, tenant: str) -> None:
    """``tenant`` sends a short request (and it ends): ``tenant`` is active."""
    slot = gate.try_enter(tenant)
    assert slot is not None
    assert gate.room(slot, 200, "p") is None
    slot.release()


# -- who goes at once -------------------------------------------------------------------------


async def test_short_prompt_never_waits_for_room_even_when_every_worker_prefills() -> None:
    pool = Pool(16_000, 16_000)
    gate = gate_for(pool)
    short_from(gate, "a")
    slot = gate.try_enter("b")
    assert slot is not None
    assert gate.room(slot, LONG - 1, "p") is None
    assert pool.asked == []  # short requests do not even look at the workers


async def test_long_prompt_alone_goes_at_once_whatever_the_workers_prefill() -> None:
    """No other tenant active: no reserve and no wait (work-conserving); the workers' queues
    are not even looked at."""
    pool = Pool(16_000, 16_000)
    gate = gate_for(pool)
    slot = gate.try_enter("a")
    assert slot is not None
    assert gate.room(slot, 16_000, "p") is None
    assert pool.asked == []


async def test_long_prompt_parks_while_its_pool_keeps_the_reserve_for_another_tenant() -> None:
    pool = Pool(16_000, 16_000, 16_000, 0)
    gate = gate_for(pool)
    short_from(gate, "b")
    waiting = asyncio.create_task(enter(gate, "a", 16_000))
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert not waiting.done()
    assert (gate.parked, gate.queued, gate.inflight) == (1, 1, 0)  # parked: it holds no slot
    pool.queues = [0, 16_000, 16_000, 0]  # a long prefill ended (its first token)
    await asyncio.wait_for(waiting, 1.0)
    assert (gate.parked, gate.queued, gate.inflight) == (0, 0, 1)


async def test_another_tenant_counts_only_within_the_active_window() -> None:
    clock = ManualClock()
    pool = Pool(16_000, 0)
    gate = gate_for(pool, clock=clock, active_window_s=5.0)
    short_from(gate, "b")
    waiting = asyncio.create_task(enter(gate, "a", 16_000))
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert not waiting.done()
    clock.advance(5.1)  # b quiet for the window: the reserve is lifted
    await asyncio.wait_for(waiting, 1.0)


async def test_the_tenants_own_short_requests_keep_no_room_from_it() -> None:
    gate = gate_for(Pool(16_000, 0))
    short_from(gate, "a")
    slot = gate.try_enter("a")
    assert slot is not None
    assert gate.room(slot, 16_000, "p") is None


@pytest.mark.parametrize(("queues", "goes"), [((0,), True), ((16_000,), False)])
async def test_one_worker_pool_keeps_no_reserve_but_runs_one_long_prefill_at_a_time(
        queues: tuple[int, ...], goes: bool) -> None:
    """The reserve is at most the healthy workers less one: long prompts never starve."""
    gate = gate_for(Pool(*queues), reserve_workers=3, queue_timeout_s=0.01)
    short_from(gate, "b")
    slot = gate.try_enter("a")
    assert slot is not None
    wait = gate.room(slot, 16_000, "p")
    assert (wait is None) is goes
    if wait is not None:
        with pytest.raises(Overloaded):
            await wait


async def test_pool_without_healthy_workers_lets_routing_answer() -> None:
    gate = gate_for(Pool())
    short_from(gate, "b")
    slot = gate.try_enter("a")
    assert slot is not None and gate.room(slot, 16_000, "p") is None


# -- landing, short prefills, the order --------------------------------------------------------


async def test_long_requests_let_through_count_until_placed() -> None:
    """Two long prompts arriving together: the first is not yet in any worker's queue when the
    second asks, so without the landing count both would take the last clean workers."""
    pool = Pool(0, 0, 16_000, 16_000)
    gate = gate_for(pool)
    short_from(gate, "b")
    first = await enter(gate, "a", 16_000)
    second = asyncio.create_task(enter(gate, "a", 16_000))
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert not second.done()  # clean 2 - landing 1 = 1: the reserve
    first.hold(GIB)  # placed: routing counts it on its worker from now on
    pool.queues = [16_000, 0, 16_000, 16_000]
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert not second.done()
    pool.queues = [16_000, 0, 0, 16_000]
    await asyncio.wait_for(second, 1.0)


async def test_long_request_waits_for_short_prefills_to_end_but_at_most_the_bound() -> None:
    pool = Pool(200, 0, 0, 0)  # a short prefill queued on a clean worker
    gate = gate_for(pool, clock=time.monotonic)
    short_from(gate, "b")
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(enter(gate, "a", 16_000), 1.0)
    assert asyncio.get_running_loop().time() - started >= SHORT_PREFILL_WAIT_S * 0.9
    pool.queues = [0, 0, 0, 0]
    slot = gate.try_enter("a")
    assert slot is not None and gate.room(slot, 16_000, "p") is None  # no short prefill: at once


async def test_parked_long_request_gives_its_slot_to_a_short_one() -> None:
    pool = Pool(16_000, 0)
    gate = gate_for(pool, max_inflight=1)
    short_from(gate, "b")
    long = asyncio.create_task(enter(gate, "a", 16_000))
    await settle()
    chat = await asyncio.wait_for(gate.acquire("b"), 0.5)
    assert chat is not None and gate.inflight == 1 and not long.done()
    long.cancel()


async def test_try_enter_is_not_blocked_by_parked_requests() -> None:
    gate = gate_for(Pool(16_000, 0))
    short_from(gate, "b")
    long = asyncio.create_task(enter(gate, "a", 16_000))
    await settle()
    assert gate.parked == 1
    assert gate.try_enter("c") is not None
    long.cancel()


async def test_parked_long_requests_go_in_fair_order_across_tenants() -> None:
    """a holds KV in flight while both wait: when room comes, e's parked request goes first,
    though a's was parked before it."""
    clock = ManualClock()
    pool = Pool(16_000, 16_000, 0)
    gate = gate_for(pool, clock=clock)
    short_from(gate, "b")
    running = gate.try_enter("a")
    assert running is not None
    running.hold(8 * GIB)
    order: list[str] = []

    async def one(tenant: str) -> None:
        await enter(gate, tenant, 16_000)
        order.append(tenant)

    tasks = [asyncio.create_task(one("a"))]
    await settle()
    tasks.append(asyncio.create_task(one("e")))
    await settle()
    assert gate.parked == 2
    clock.advance(1)  # a's request in flight holds 8 GiB for a second more
    short_from(gate, "b")
    pool.queues = [16_000, 0, 0]
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert order == ["e"]
    for task in tasks:
        task.cancel()


# -- leaving while parked ----------------------------------------------------------------------


async def test_parked_request_times_out_with_overloaded_and_holds_nothing() -> None:
    gate = gate_for(Pool(16_000, 0), queue_timeout_s=0.05)
    short_from(gate, "b")
    slot = gate.try_enter("a")
    assert slot is not None
    wait = gate.room(slot, 16_000, "p")
    assert wait is not None
    with pytest.raises(Overloaded) as info:
        await wait
    assert "room" in str(info.value) and info.value.retry_after_s == pytest.approx(0.05)
    slot.release()  # the dispatcher releases what it refuses: nothing left to pass on
    assert (gate.inflight, gate.queued, gate.parked) == (0, 0, 0)


async def test_parked_request_cancelled_leaves_no_trace() -> None:
    gate = gate_for(Pool(16_000, 0))
    short_from(gate, "b")
    long = asyncio.create_task(enter(gate, "a", 16_000))
    await settle()
    long.cancel()
    await settle()
    assert (gate.inflight, gate.queued, gate.parked) == (0, 0, 0)


async def test_parked_request_granted_and_cancelled_at_once_passes_the_slot_on() -> None:
    pool = Pool(16_000, 0)
    gate = gate_for(pool, max_inflight=1)
    short_from(gate, "b")
    long = asyncio.create_task(enter(gate, "a", 16_000))
    await settle()
    held = gate.try_enter("c")
    assert held is not None
    queued = asyncio.create_task(gate.acquire("d"))
    await settle()
    pool.queues = [0, 0, 0]
    held.release()  # the parked long request may go now and is granted the slot ...
    long.cancel()  # ... and leaves before it runs: the slot goes on to d
    granted = await asyncio.wait_for(queued, 1.0)
    assert granted is not None and (gate.inflight, gate.queued, gate.parked) == (1, 0, 0)


# -- the guaranteed share ----------------------------------------------------------------------


def share_gate(max_inflight: int = 4) -> AdmissionGate:
    return AdmissionGate(max_inflight, 100, 5.0, guaranteed_share=True)


async def test_tenant_below_its_share_enters_a_full_gate_at_once() -> None:
    """The bug it fixes: 8 slots held by a's 16K-token prompts made b's chat wait ~0.5 s for a
    slot, however fair the order of the queue (fair gate: b/c TTFT p99 54x quiet)."""
    gate = share_gate()
    for _ in range(4):
        slot = gate.try_enter("a")
        assert slot is not None
        slot.hold(2 * GIB)
    chat = gate.try_enter("b")
    assert chat is not None and gate.inflight == 5


async def test_tenant_at_its_share_of_slots_and_bytes_waits() -> None:
    gate = share_gate()
    for tenant in ("a", "a", "b", "b"):
        slot = gate.try_enter(tenant)
        assert slot is not None
        slot.hold(GIB)
    assert gate.try_enter("b") is None


async def test_tenant_holding_little_kv_enters_beyond_its_share_of_slots() -> None:
    gate = share_gate()
    for tenant, kv_bytes in (("a", 2 * GIB), ("b", GIB // 100), ("b", GIB // 100),
                             ("b", GIB // 100)):
        slot = gate.try_enter(tenant)
        assert slot is not None
        slot.hold(kv_bytes)
    assert gate.try_enter("b") is not None


async def test_batch_requests_never_enter_beyond_the_cap() -> None:
    gate = share_gate()
    for _ in range(4):
        assert gate.try_enter("a") is not None
    assert gate.try_enter("d", Priority.BATCH) is None


async def test_slot_beyond_the_cap_is_retired_not_passed_on() -> None:
    """Else every burst would add a slot for good and the cap would creep up."""
    gate = share_gate(max_inflight=2)
    held = [gate.try_enter("a"), gate.try_enter("a")]
    queued = asyncio.create_task(gate.acquire("a"))
    await settle()
    burst = gate.try_enter("b")
    assert burst is not None and gate.inflight == 3
    burst.release()
    await settle()
    assert gate.inflight == 2 and not queued.done()
    held[0].release()  # type: ignore[union-attr]
    await asyncio.wait_for(queued, 1.0)
    assert gate.inflight == 2


async def test_in_flight_never_exceeds_twice_the_cap() -> None:
    gate = share_gate(max_inflight=2)
    assert gate.try_enter("a") and gate.try_enter("a")
    entered = [gate.try_enter(t) for t in ("b", "c", "e", "f", "g")]
    assert gate.inflight == 4 and entered.count(None) == 3


async def test_without_fair_queuing_there_is_no_guaranteed_share() -> None:
    gate = AdmissionGate(1, 10, 5.0, fair=False, guaranteed_share=True)
    assert gate.try_enter("a") is not None
    assert gate.try_enter("b") is None


# -- where they go: the reserved workers carry no long request -------------------------------


def long_slot(gate: AdmissionGate, tenant: str = "a") -> Slot:
    """A long request admitted, let through (room, or its tenant alone) and placed (``hold``
    runs right before routing, as in the dispatcher)."""
    slot = gate.try_enter(tenant)
    assert slot is not None
    assert gate.room(slot, 16_000, "p") is None
    slot.hold(GIB)
    return slot


def short_slot(gate: AdmissionGate, tenant: str = "b") -> Slot:
    slot = gate.try_enter(tenant)
    assert slot is not None
    assert gate.room(slot, 200, "p") is None
    return slot


async def test_long_prompt_avoids_the_reserved_worker_while_another_tenant_is_active() -> None:
    """The reserve is kept from long decodes too, not only from long prefills: the worker with
    no long request and the least prefill queued is the one routing leaves out."""
    gate = gate_for(Pool(0, 0, 0, 0))
    short_from(gate, "b")
    assert gate.avoid(long_slot(gate), "p") == {"w0"}


async def test_reserved_worker_is_the_one_carrying_the_fewest_long_requests() -> None:
    """Longs routed while their tenant was alone went anywhere; once another tenant is active
    the reserve is the worker they left free, so it stays free of long decodes."""
    gate = gate_for(Pool(0, 0, 0, 0))
    for worker in ("w0", "w1", "w3"):
        long_slot(gate).routed(worker)
    short_from(gate, "b")
    assert gate.avoid(long_slot(gate), "p") == {"w2"}


async def test_reserve_formed_under_a_flood_stays_put_until_another_worker_drains() -> None:
    """Regression (a flood that came first, ``gateway.bench.fairness --flood-first``): a's
    prompts, sent alone, took every worker; once b was active the reserve, re-sorted by the
    long requests each worker carried, moved at every tie to a worker that had just been sent
    long prompts, and b's chats waited behind their prefills for seconds (TTFT p99 4.3x). The
    reserve chosen stays while it drains; only a worker with no long request left takes it."""
    gate = gate_for(Pool(0, 0, 0, 0), max_inflight=64)
    longs = {w: [long_slot(gate), long_slot(gate)] for w in ("w0", "w1", "w2", "w3")}
    for worker, slots in longs.items():
        for slot in slots:
            slot.routed(worker)
    short_from(gate, "b")
    assert gate.avoid(long_slot(gate), "p") == {"w0"}
    longs["w1"].pop().release()  # w1 now carries fewer than w0: the reserve stays on w0
    assert gate.avoid(long_slot(gate), "p") == {"w0"}
    long_slot(gate).routed("w1")
    for slot in longs["w3"]:
        slot.release()  # w3 carries none: it is the reserve now
    assert gate.avoid(long_slot(gate), "p") == {"w3"}
    for slot in longs["w0"]:
        slot.release()
    assert gate.avoid(long_slot(gate), "p") == {"w3"}  # formed: it stays


async def test_short_prompt_goes_to_the_reserve_being_formed_when_every_worker_carries_long(
) -> None:
    """While the reserve still drains the flood's long requests, new long prompts go to the
    other workers: short ones go to the reserve."""
    gate = gate_for(Pool(0, 0, 0, 0))
    for worker in ("w0", "w1", "w2", "w3"):
        long_slot(gate).routed(worker)
    short_from(gate, "b")
    assert gate.avoid(long_slot(gate), "p") == {"w0"}
    assert gate.avoid(short_slot(gate), "p") == {"w1", "w2", "w3"}


async def test_long_prompt_avoids_no_worker_while_its_tenant_is_alone() -> None:
    gate = gate_for(Pool(0, 0, 0, 0))
    short_from(gate, "a")  # its own short requests keep no room from it
    assert gate.avoid(long_slot(gate), "p") == set()


async def test_short_prompt_avoids_the_workers_carrying_long_requests() -> None:
    gate = gate_for(Pool(0, 0, 0, 0))
    long_slot(gate).routed("w1")
    long_slot(gate).routed("w2")
    assert gate.avoid(short_slot(gate), "p") == {"w1", "w2"}


async def test_short_prompt_picks_the_reserve_when_every_worker_carries_long_and_none_was_chosen(
) -> None:
    """a's prompts, sent alone, took every worker; b's first chat comes before any of a's next
    prompts asks for room: the chat chooses the reserve (where a's next prompts will not go),
    rather than any worker, behind a long prefill, until a long prompt asks (seconds later)."""
    gate = gate_for(Pool(0, 0))
    long_slot(gate).routed("w0")
    long_slot(gate).routed("w1")
    assert gate.avoid(short_slot(gate), "p") == {"w1"}
    assert gate.avoid(long_slot(gate), "p") == {"w0"}  # the long prompts agree


async def test_short_prompt_avoids_no_worker_in_a_one_worker_pool_carrying_long() -> None:
    gate = gate_for(Pool(0))
    long_slot(gate).routed("w0")
    assert gate.avoid(short_slot(gate), "p") == set()


async def test_short_prompt_avoids_no_worker_when_no_long_request_is_in_flight() -> None:
    pool = Pool(0, 0)
    gate = gate_for(pool)
    assert gate.avoid(short_slot(gate), "p") == set()
    assert pool.asked == []  # no long request anywhere: the workers are not even looked at


async def test_long_request_stops_counting_on_its_worker_when_it_ends() -> None:
    gate = gate_for(Pool(0, 0))
    slot = long_slot(gate)
    slot.routed("w0")
    slot.release()
    slot.release()  # twice: counted off once
    assert gate.avoid(short_slot(gate), "p") == set()


async def test_short_request_routed_is_not_counted_as_long() -> None:
    gate = gate_for(Pool(0, 0))
    short_slot(gate).routed("w0")
    assert gate.avoid(short_slot(gate), "p") == set()


async def test_avoid_is_empty_with_the_room_off() -> None:
    gate = AdmissionGate(8, 100, 5.0)
    slot = gate.try_enter("a")
    assert slot is not None
    assert gate.room(slot, 16_000, "p") is None
    slot.routed("w0")
    assert gate.avoid(slot, "p") == set()


async def test_long_prompt_parks_while_only_the_reserved_worker_is_clean_of_long_prefill() -> None:
    """The room is counted outside the reserve: a clean reserved worker is not room."""
    gate = gate_for(Pool(0, 0, 0))
    for worker in ("w0", "w1"):
        long_slot(gate).routed(worker)
    short_from(gate, "b")
    slot = gate.try_enter("a")
    assert slot is not None
    gate._prefill_queues = Pool(16_000, 16_000, 0)  # w0, w1 prefill; w2 reserved and clean
    wait = gate.room(slot, 16_000, "p")
    assert wait is not None
    waiting = asyncio.ensure_future(wait)
    await asyncio.sleep(3 * ROOM_POLL_S)
    assert not waiting.done() and gate.parked == 1
    gate._prefill_queues = Pool(0, 16_000, 0)  # w0's long prompt produced its first token
    await asyncio.wait_for(waiting, 1.0)
    assert gate.avoid(slot, "p") == {"w2"}
