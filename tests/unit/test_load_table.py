"""The shared load table: each process writes its own row, readers sum the rows (real forked
processes writing concurrently, and the slot rules: claim order, freeing, restarts)."""

from __future__ import annotations

import multiprocessing
import struct
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from gateway.workers.load_table import MAGIC, PROMISE_SLOTS, LoadTable, worker_key

WORKERS = [f"http://w{i}:8000" for i in range(6)]


def _table(path: Path, row: int, rows: int = 3, slots: int = 64) -> LoadTable:
    table = LoadTable(path, rows=rows, own_row=row, slots=slots, refresh_s=0.0)
    table.open()
    return table


def _hammer(path: str, row: int, rounds: int, barrier: Barrier) -> None:
    """A process holding (row + 1) requests and 100 * (row + 1) prefill tokens on every worker
    at the end, after ``rounds`` of taking and releasing in between."""
    table = _table(Path(path), row)
    loads = [table.claim(w) for w in (WORKERS if row % 2 == 0 else reversed(WORKERS))]
    barrier.wait()
    for _ in range(rounds):
        for load in loads:
            load.requests += 3
            load.prefill_tokens += 500
        for load in loads:
            load.requests -= 3
            load.prefill_tokens -= 500
    for load in loads:
        load.requests += row + 1
        load.prefill_tokens += 100 * (row + 1)
    barrier.wait()  # the parent reads now
    barrier.wait()  # ... and is done reading: the mapping may go


def test_concurrent_writers_in_forked_processes_sum_exactly(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    path = tmp_path / "load.table"
    procs = [ctx.Process(target=_hammer, args=(str(path), row, 2000, barrier)) for row in (1, 2)]
    for p in procs:
        p.start()
    reader = _table(path, 0)
    mine = {w: reader.claim(w) for w in WORKERS}
    barrier.wait()
    seen_during = [mine[w].gateway_requests() for w in WORKERS for _ in range(50)]
    barrier.wait()
    final = {w: (mine[w].gateway_requests(), mine[w].gateway_prefill_tokens()) for w in WORKERS}
    barrier.wait()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    assert final == dict.fromkeys(WORKERS, (2 + 3, 200 + 300))
    assert all(0 <= n <= 2 * 3 + 2 + 3 for n in seen_during)  # never torn, never negative
    assert all(mine[w].requests == 0 for w in WORKERS)  # the own reading stays the own
    reader.close()


def test_rows_claimed_in_different_orders_with_colliding_keys_are_found(tmp_path: Path) -> None:
    """Six workers in full 6-slot rows collide, and each process claims them in another order."""
    path = tmp_path / "load.table"
    a, b = _table(path, 0, rows=2, slots=6), _table(path, 1, rows=2, slots=6)
    a_loads = {w: a.claim(w) for w in WORKERS}
    b_loads = {w: b.claim(w) for w in reversed(WORKERS)}
    for i, w in enumerate(WORKERS):
        b_loads[w].requests = i + 1

    assert [a_loads[w].gateway_requests() for w in WORKERS] == [1, 2, 3, 4, 5, 6]
    assert len({worker_key(w) % 6 for w in WORKERS}) < len(WORKERS)  # collisions did happen
    a.close()
    b.close()


def test_a_process_that_reopens_its_row_starts_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "load.table"
    leader, follower = _table(path, 0), _table(path, 1)
    seen = leader.claim(WORKERS[0])
    follower.claim(WORKERS[0]).requests = 7
    assert seen.gateway_requests() == 7

    follower.close()
    restarted = _table(path, 1)  # its requests died with the old process

    assert seen.gateway_requests() == 0
    restarted.claim(WORKERS[0]).requests = 1
    assert seen.gateway_requests() == 1
    leader.close()
    restarted.close()


def test_a_departed_worker_frees_its_slot_and_late_releases_touch_nothing(tmp_path: Path) -> None:
    path = tmp_path / "load.table"
    reader, writer = _table(path, 0, rows=2, slots=1), _table(path, 1, rows=2, slots=1)
    old = writer.claim(WORKERS[0])
    old.requests = 4
    writer.free(WORKERS[0])
    new = writer.claim(WORKERS[1])  # the only slot of the row, reused
    new.requests = 2

    old.requests -= 1  # a request that was still on the departed worker releases it

    assert old.requests == 3 and old.gateway_requests() == 3  # counted locally only
    assert reader.claim(WORKERS[1]).gateway_requests() == 2
    assert reader.claim(WORKERS[0]).gateway_requests() == 0
    reader.close()
    writer.close()


def test_a_full_row_degrades_to_an_unshared_load(tmp_path: Path) -> None:
    path = tmp_path / "load.table"
    reader, writer = _table(path, 0, rows=2, slots=1), _table(path, 1, rows=2, slots=1)
    writer.claim(WORKERS[0])
    extra = writer.claim(WORKERS[1])
    extra.requests = 5

    assert extra.gateway_requests() == 5
    assert reader.claim(WORKERS[1]).gateway_requests() == 0
    reader.close()
    writer.close()


def test_other_rows_are_read_at_most_every_refresh_interval_and_the_own_row_exactly(
    tmp_path: Path,
) -> None:
    path = tmp_path / "load.table"
    slow = LoadTable(path, rows=2, own_row=0, slots=16, refresh_s=3600.0)
    slow.open()
    writer = _table(path, 1, rows=2, slots=16)
    mine, theirs = slow.claim(WORKERS[0]), writer.claim(WORKERS[0])
    theirs.requests = 2
    assert mine.gateway_requests() == 2

    theirs.requests = 9
    mine.requests += 1

    assert mine.gateway_requests() == 3  # the others' sum is cached, the own count is not
    slow.close()
    writer.close()


def test_a_table_with_another_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "load.table"
    first = _table(path, 0, rows=2, slots=16)
    with pytest.raises(ValueError, match="another layout"):
        _table(path, 0, rows=3, slots=16)
    first.close()
    (tmp_path / "other").write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match="not a kvgate load table"):
        _table(tmp_path / "other", 0, rows=2, slots=16)
    older = tmp_path / "older"  # an earlier kvgate's table: 3 words per slot
    older.write_bytes(struct.pack("<4Q", MAGIC, 2, 16, 3).ljust(64, b"\0"))
    with pytest.raises(ValueError, match="another layout"):
        _table(older, 0, rows=2, slots=16)


def test_pending_objectives_are_published_per_worker_and_read_by_the_other_rows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "load.table"
    a, b = _table(path, 0, rows=2, slots=4), _table(path, 1, rows=2, slots=4)
    mine, theirs = a.claim(WORKERS[0]), b.claim(WORKERS[0])
    mine.add_delay(0.05)
    mine.publish([(float(i), 10.0 + i) for i in range(PROMISE_SLOTS + 2)])
    theirs.add_delay(0.02)

    delay, pairs = theirs.promises()
    assert delay == pytest.approx(0.07)  # every row's
    assert pairs == [(float(i), 10.0 + i) for i in range(PROMISE_SLOTS)]  # the first ones
    assert mine.promises()[0] == pytest.approx(0.07)
    assert mine.promises()[1] == []  # its own are not "others"
    mine.publish([(1.0, 2.0)])  # fewer now: the rest of the slots emptied
    assert theirs.promises()[1] == [(1.0, 2.0)]
    assert b.claim(WORKERS[1]).promises() == (0.0, [])  # another worker: nothing

    a.free(WORKERS[0])  # departed: its slot zeroed, requests and pending alike
    assert theirs.promises()[0] == pytest.approx(0.02) and theirs.promises()[1] == []
    a.claim(WORKERS[2])  # may take the freed slot: it starts empty
    assert b.claim(WORKERS[2]).promises() == (0.0, [])
    a.close()
    b.close()
