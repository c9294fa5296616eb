"""The size of the room kept for others (``limits.reserve_workers``): "auto" sizes each pool's
reserve from the short requests the gate sees in flight there, averaged over
``active_window_s``, at least 1 and at most all workers but one while another tenant is active,
with hysteresis; an integer keeps its fixed meaning; the config takes both and nothing else."""

from __future__ import annotations

import copy
from typing import Literal

import pytest

from gateway.config import ConfigError, Priority, build_settings
from gateway.overload import NOWHERE, SHORT_PER_WORKER, SHRINK_BELOW, AdmissionGate, Slot
from tests.clock import ManualClock
from tests.unit.test_config import minimal

LONG = 4096
WINDOW_S = 5.0


def workers(pool: str) -> dict[str, int]:
    """Four healthy workers, nothing queued for prefill on any."""
    return {"w0": 0, "w1": 0, "w2": 0, "w3": 0}


def gate_for(clock: ManualClock, reserve_workers: int | Literal["auto"] = "auto"
             ) -> AdmissionGate:
    return AdmissionGate(64, 100, 5.0, long_prompt_tokens=LONG, reserve_workers=reserve_workers,
                         active_window_s=WINDOW_S, prefill_queues=workers, clock=clock)


def short(gate: AdmissionGate, tenant: str = "b") -> Slot:
    """A short request of ``tenant`` in flight in pool ``p`` until released."""
    slot = gate.try_enter(tenant)
    assert slot is not None
    assert gate.room(slot, 200, "p") is None
    return slot


def reserve(gate: AdmissionGate) -> int:
    """The workers a long prompt of tenant a would be kept off now."""
    slot = gate.try_enter("a")
    assert slot is not None
    slot._long = True  # what room() marks for a long prompt; asking room() would park it
    try:
        return len(gate.avoid(slot, "p"))
    finally:
        slot.release()


def hold(clock: ManualClock, gate: AdmissionGate, seconds: float, step_s: float = 0.25,
         active: tuple[str, ...] = ("b", "c", "e")) -> list[int]:
    """Let ``seconds`` pass, reading the reserve every ``step_s`` (as requests would), while
    the ``active`` tenants stay active: each sends a short request every step (one that ends at
    once, adding nothing to the demand; a tenant is active for the window after it *sent* a
    short prompt). Three others of a's weight: their share of four workers caps nothing below
    3."""
    sizes = []
    for _ in range(round(seconds / step_s)):
        clock.advance(step_s)
        for tenant in active:
            short(gate, tenant).release()
        sizes.append(reserve(gate))
    return sizes


def test_auto_reserve_is_the_default() -> None:
    assert AdmissionGate(1, 1, 1.0).reserve_workers == "auto"
    assert build_settings(copy.deepcopy(minimal())).limits.reserve_workers == "auto"


def test_auto_reserve_grows_with_the_short_requests_in_flight() -> None:
    clock = ManualClock()
    gate = gate_for(clock)
    chats = [short(gate)]
    assert hold(clock, gate, 2 * WINDOW_S)[-1] == 1
    chats.append(short(gate))
    assert hold(clock, gate, 2 * WINDOW_S)[-1] == 2
    for _ in range(10):
        chats.append(short(gate, "c"))
    assert hold(clock, gate, 2 * WINDOW_S)[-1] == 3  # never all four: the flood keeps one


def test_auto_reserve_shrinks_after_the_short_demand_falls() -> None:
    clock = ManualClock()
    gate = gate_for(clock)
    chats = [short(gate) for _ in range(3)]
    assert hold(clock, gate, 2 * WINDOW_S)[-1] == 3
    for chat in chats:
        chat.release()
    sizes = hold(clock, gate, 4 * WINDOW_S)  # b still active, nothing in flight
    assert sizes[-1] == 1
    assert sizes == sorted(sizes, reverse=True)


def test_auto_reserve_is_none_when_nobody_else_is_active() -> None:
    clock = ManualClock()
    gate = gate_for(clock)
    chats = [short(gate) for _ in range(3)]
    hold(clock, gate, WINDOW_S)
    for chat in chats:
        chat.release()
    clock.advance(WINDOW_S + 0.1)  # b silent for the window
    assert reserve(gate) == 0
    slot = gate.try_enter("a")
    assert slot is not None
    assert gate.room(slot, 16_000, "p") is None  # goes at once, to any worker
    assert gate.avoid(slot, "p") == NOWHERE


def test_auto_reserve_is_one_before_any_short_request_is_measured() -> None:
    clock = ManualClock()
    gate = gate_for(clock)
    short(gate).release()  # b active, nothing in flight yet measured over time
    assert reserve(gate) == 1


def test_auto_reserve_measures_afresh_after_a_quiet_window() -> None:
    """After a window without short requests the average restarts from what it sees, not from
    0: two chats in flight a second after b comes back ask for two workers at once (an average
    that decays toward 2 from 0 would read 0.36 then, and keep one)."""
    clock = ManualClock()
    gate = gate_for(clock)
    short(gate).release()
    clock.advance(10 * WINDOW_S)
    chats = [short(gate), short(gate)]
    assert hold(clock, gate, 1.0)[-1] == 2
    for chat in chats:
        chat.release()


def test_auto_reserve_does_not_flap_when_the_demand_hovers_at_a_boundary() -> None:
    """Two short requests in flight for a second, none the next, over and over: the averaged
    demand swings around ``SHORT_PER_WORKER`` (1 in flight), crossing it both ways every
    second. The reserve settles at 2 and stays (a reserve that followed every crossing would
    change each second, moving long requests each time)."""
    assert SHORT_PER_WORKER == 1.0 and SHRINK_BELOW < 0.9
    clock = ManualClock()
    gate = gate_for(clock)
    levels: list[float] = []
    sizes: list[int] = []
    for _ in range(30):
        chats = [short(gate), short(gate)]
        sizes += hold(clock, gate, 1.0)
        levels.append(gate._demand["p"].level(gate.now(), WINDOW_S))
        for chat in chats:
            chat.release()
        sizes += hold(clock, gate, 1.0)
        levels.append(gate._demand["p"].level(gate.now(), WINDOW_S))
    assert min(levels[4:]) < SHORT_PER_WORKER < max(levels[4:])  # it does cross, both ways
    assert set(sizes[8:]) == {2}


def test_auto_reserve_is_at_most_the_other_tenants_weighted_share_of_the_workers() -> None:
    """Measured: b's, c's and d's backlogged 4K-token chats (~20 in flight) took 3 of 4 workers
    and a's 16K-token prompts the last one: a's share of the served KV byte-seconds fell to
    0.15 (Jain 0.88). Against one other tenant of a's weight the reserve is at most half the
    pool; a batch tenant counts ``batch_share`` of its weight."""
    clock = ManualClock()
    gate = gate_for(clock)
    chats = [short(gate) for _ in range(10)]
    assert hold(clock, gate, 2 * WINDOW_S, active=("b",))[-1] == 2  # floor(4 x 1/2)
    assert hold(clock, gate, 2 * WINDOW_S, active=("b", "c"))[-1] == 2  # floor(4 x 2/3)
    for _ in range(8):
        slot = gate.try_enter("d", Priority.BATCH)
        assert slot is not None and gate.room(slot, 200, "p") is None
        slot.release()
        assert hold(clock, gate, 0.5, active=("b", "c"))[-1] == 2  # floor(4 x 2.1/3.1)
    assert hold(clock, gate, 2 * WINDOW_S, active=("b", "c", "d"))[-1] == 3  # d interactive
    for chat in chats:
        chat.release()


def test_integer_reserve_keeps_its_fixed_size_whatever_the_demand() -> None:
    clock = ManualClock()
    gate = gate_for(clock, reserve_workers=2)
    short(gate).release()
    assert reserve(gate) == 2
    chats = [short(gate) for _ in range(10)]
    assert hold(clock, gate, 2 * WINDOW_S)[-1] == 2
    for chat in chats:
        chat.release()
    assert reserve(gate_for(clock, reserve_workers=0)) == 0


@pytest.mark.parametrize(("value", "read"), [("auto", "auto"), (0, 0), (2, 2), ("3", 3)])
def test_config_takes_auto_or_an_integer(value: object, read: object) -> None:
    data = copy.deepcopy(minimal())
    data["limits"] = {"reserve_workers": value}
    assert build_settings(data).limits.reserve_workers == read


@pytest.mark.parametrize("value", ["many", "AUTO", -1, 1.5, True, None])
def test_config_refuses_anything_else_naming_both_forms(value: object) -> None:
    data = copy.deepcopy(minimal())
    data["limits"] = {"reserve_workers": value}
    with pytest.raises(ConfigError, match=r"limits\.reserve_workers: .*integer >= 0 or 'auto'"):
        build_settings(data)
