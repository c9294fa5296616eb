"""BlockIndex: which worker holds which KV block, bounded, with a source for every entry.

Data structures (all in memory, all synchronous, no I/O; time comes from an injected clock):

- per worker, ``entries``: an ``OrderedDict[BlockHash, _Stamp]`` in least-recently-used order
  (the front is evicted first). A ``_Stamp`` is (source, expires_at), shared by every block one
  call recorded: ``record_routed`` makes one stamp per call, confirmed blocks share one
  ``_CONFIRMED``. Refreshing a block replaces its stamp, it never mutates one.
- per worker and tentative source, ``queues[source]``: an ``OrderedDict[BlockHash, None]`` of that
  source's entries in the order their TTL was (re)started. TTLs are fixed per source and the clock
  is monotonic, so that order is expiry order: expired entries are reclaimed from the front in
  O(expired), without a scan, a sort or a stale record (a refreshed, confirmed, removed or
  evicted entry leaves its queue at once). Entries per source are structural:
  ``len(queues[s])``, and confirmed = ``len(entries)`` minus both queues.
- per worker, ``capacity_blocks`` (``set_capacity``: vLLM's ``num_gpu_blocks`` when known,
  ``default_capacity_blocks`` otherwise) and ``events`` (whether KV events confirm its entries).

The inverse question "which workers hold block h" is answered by asking each worker's dict (one
O(1) lookup per worker): that is exactly what routing asks (for a handful of candidates), and it
avoids a second hash -> workers map that would double the memory for no faster match.

Sources:

- ``confirmed``: reported by the worker's KV events (``apply_stored``). No TTL; it leaves on
  ``apply_removed``, ``clear_worker`` or LRU eviction.
- ``speculative``: ``record_routed`` on a worker that has events. A burst of same-prefix requests
  then sticks to one worker before its first ``BlockStored`` arrives. Expires after
  ``speculative_ttl_s`` unless an event confirms it (a request that queues longer than that, or
  fails, stops attracting its siblings).
- ``learned``: ``record_routed`` on a worker without events (approximate mode, as vLLM's
  production-stack, SGLang's and llm-d's approximate routers do). Bounded by the same LRU, and
  expires after ``learned_ttl_s`` (refreshed on every route) because the gateway cannot see
  evictions caused by other gateway replicas or by decode growth.

Cost per operation (B = blocks in the call, W = workers asked). Updates run as whole-call C-level
operations (``map(entries.pop, ...)``, ``OrderedDict.update(zip(...))``, an ``islice`` of the LRU
front to evict), not a Python loop per block:

- ``match_prefix``: O(W × (matched + 1)) dict lookups; it stops at each worker's first miss.
  Read-only: looking is not using, so it refreshes no LRU position.
- ``record_routed`` / ``apply_stored``: O(B) pops and inserts, plus O(evicted) eviction and
  O(expired) reclaim, each entry evicted or reclaimed once: no sort, no compaction, no stall.
  Never-seen prompts into a full 65,536-block index (every call evicts what it adds), min /
  median / mean on this shared 2-core box: 8K blocks (128K tokens at 16 per block) 4.0 / 6-8 /
  7.5-16 ms, where the previous design (a Python loop per block, and a TTL deque of records
  sorted whenever it outgrew 2 × capacity) took 5-6 / 14-15 / 25-30 ms with 150-340 ms stalls;
  1K blocks 0.4 / 0.7 / 1.6 ms against 0.6 / 0.9 / 4.0 ms. ``python -m gateway.bench.routing_cost``
  prints this case as its ``full index`` table.
- ``apply_removed``: O(B). ``clear_worker``: O(entries of that worker). ``stats``: O(W).

A hash repeated within one call keeps the position of its last occurrence and a confirmed block
stays confirmed, exactly as one ``move_to_end`` per block would do (chained hashes never repeat;
the rare case costs one more pass).

Memory bound: a worker holds at most ``capacity_blocks`` entries (inserting evicts the LRU
front), and each tentative entry is in exactly one queue, so the index never holds more than
Σ capacity entries. Measured with ``tracemalloc``: ≈ 140 bytes per confirmed entry (OrderedDict
node + int key; the stamp is shared), ≈ 245 per tentative one (its queue node too), i.e.
≈ 14-25 MB per 100K blocks (the previous design: ≈ 185 and ≈ 250, plus up to one stale TTL
record per entry). The event subscriber's engine-hash map adds ≈ 60-90 bytes per
confirmed block.
"""

from __future__ import annotations

import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, islice, repeat
from typing import Final, Literal

from gateway.kvindex.hashing import BlockHash

Source = Literal["confirmed", "speculative", "learned"]
CONFIRMED: Final = "confirmed"
SPECULATIVE: Final = "speculative"
LEARNED: Final = "learned"
SOURCES: Final[tuple[Source, ...]] = (CONFIRMED, SPECULATIVE, LEARNED)
TENTATIVE: Final[tuple[Source, ...]] = (SPECULATIVE, LEARNED)

DEFAULT_CAPACITY_BLOCKS: Final = 65_536
DEFAULT_SPECULATIVE_TTL_S: Final = 10.0
DEFAULT_LEARNED_TTL_S: Final = 300.0


@dataclass(frozen=True, slots=True, eq=False)
class _Stamp:
    """What an entry is and until when; one object for all blocks of one call. Compared by
    identity (``eq=False``): counting ``_CONFIRMED`` in a list of thousands stays at C speed."""

    source: Source
    expires_at: float


_CONFIRMED: Final = _Stamp(CONFIRMED, math.inf)


class _WorkerBlocks:
    __slots__ = ("capacity_blocks", "entries", "events", "queues")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.events = False
        self.entries: OrderedDict[BlockHash, _Stamp] = OrderedDict()
        self.queues: dict[Source, OrderedDict[BlockHash, None]] = {
            s: OrderedDict() for s in TENTATIVE
        }

    def unqueue(self, hashes: Iterable[BlockHash]) -> None:
        """Take ``hashes`` out of every tentative queue that has entries (absent ones are fine)."""
        for q in self.queues.values():
            if q:
                _consume(map(q.pop, hashes, repeat(None)))


def _consume(it: Iterable[object]) -> None:
    """Run a ``map`` of dict operations to its end at C speed (the standard idiom)."""
    deque(it, maxlen=0)


@dataclass(frozen=True)
class WorkerIndexStats:
    capacity_blocks: int
    events: bool
    confirmed: int
    speculative: int
    learned: int

    @property
    def total(self) -> int:
        return self.confirmed + self.speculative + self.learned


class BlockIndex:
    """Block hash -> the workers holding it; one bounded LRU per worker. See the module docstring."""

    def __init__(
        self,
        *,
        default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        learned_ttl_s: float = DEFAULT_LEARNED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_capacity_blocks <= 0:
            raise ValueError("default_capacity_blocks must be positive")
        self._default_capacity = default_capacity_blocks
        self._ttl: dict[Source, float] = {
            CONFIRMED: math.inf,
            SPECULATIVE: speculative_ttl_s,
            LEARNED: learned_ttl_s,
        }
        self._clock = clock
        self._workers: dict[str, _WorkerBlocks] = {}

    # -- configuration ----------------------------------------------------------------------

    @property
    def default_capacity_blocks(self) -> int:
        return self._default_capacity

    def set_capacity(self, worker_id: str, blocks: int | None) -> None:
        """Bound ``worker_id``'s entries (``None``: the default); evicts LRU entries at once."""
        if blocks is not None and blocks <= 0:
            raise ValueError(f"capacity must be positive, got {blocks}")
        w = self._worker(worker_id)
        w.capacity_blocks = blocks if blocks is not None else self._default_capacity
        self._evict(w)

    def set_events(self, worker_id: str, enabled: bool) -> None:
        """Whether ``worker_id``'s KV events confirm its blocks (routing then records
        ``speculative`` entries for it; otherwise ``learned`` ones)."""
        self._worker(worker_id).events = enabled

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # -- queries ----------------------------------------------------------------------------

    def match_prefix(
        self, hashes: Sequence[BlockHash], worker_ids: Iterable[str]
    ) -> dict[str, int]:
        """Per worker, how many leading blocks of ``hashes`` it holds (stops at the first miss).

        Expired tentative entries count as misses. Unknown workers hold nothing.
        """
        return {w: held for w, (held, _) in self.match_prefix_pending(hashes, worker_ids).items()}

    def match_prefix_pending(
        self, hashes: Sequence[BlockHash], worker_ids: Iterable[str]
    ) -> dict[str, tuple[int, int]]:
        """Per worker, (leading blocks held, how many of those are probably still being computed).

        "Being computed": speculative entries (routed, not yet confirmed by an event) and learned
        entries routed within the last ``speculative_ttl_s``. A request that follows them onto
        the worker waits for that prefill rather than adding to it: the kv_aware policy must not
        charge it as a queue ahead of the request (Dynamo's "active prefill - overlap").
        """
        now = self._clock()
        recent_learned = now + self._ttl[LEARNED] - self._ttl[SPECULATIVE]
        result: dict[str, tuple[int, int]] = {}
        for worker_id in worker_ids:
            w = self._workers.get(worker_id)
            if w is None or not w.entries:
                result[worker_id] = (0, 0)
                continue
            entries = w.entries
            matched = pending = 0
            for h in hashes:
                e = entries.get(h)
                if e is None or e.expires_at <= now:
                    break
                matched += 1
                if e.source == SPECULATIVE or (
                    e.source == LEARNED and e.expires_at > recent_learned
                ):
                    pending += 1
            result[worker_id] = (matched, pending)
        return result

    def holders(self, block_hash: BlockHash) -> set[str]:
        """The workers that hold ``block_hash`` now (any source)."""
        now = self._clock()
        out: set[str] = set()
        for worker_id, w in self._workers.items():
            e = w.entries.get(block_hash)
            if e is not None and e.expires_at > now:
                out.add(worker_id)
        return out

    def stats(self) -> dict[str, WorkerIndexStats]:
        """Entries per worker and source (expired entries not yet reclaimed are reclaimed first)."""
        now = self._clock()
        out: dict[str, WorkerIndexStats] = {}
        for worker_id, w in self._workers.items():
            self._reclaim_expired(w, now)
            speculative, learned = len(w.queues[SPECULATIVE]), len(w.queues[LEARNED])
            out[worker_id] = WorkerIndexStats(
                capacity_blocks=w.capacity_blocks,
                events=w.events,
                confirmed=len(w.entries) - speculative - learned,
                speculative=speculative,
                learned=learned,
            )
        return out

    # -- updates ----------------------------------------------------------------------------

    def record_routed(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """The router sent a prompt with these block hashes to ``worker_id``.

        New blocks become ``speculative`` (worker with events) or ``learned`` (without); existing
        tentative entries get a fresh TTL (and the worker's current source); every block moves to
        the most-recently-used end (the engine will touch them all), confirmed ones included.
        """
        w = self._worker(worker_id)
        source: Source = SPECULATIVE if w.events else LEARNED
        now = self._clock()
        stamp = _Stamp(source, now + self._ttl[source])
        entries = w.entries
        old = list(map(entries.pop, hashes, repeat(None)))
        existing = len(old) - old.count(None)
        confirmed = old.count(_CONFIRMED) if existing else 0
        if existing > confirmed:  # tentative entries among them: out of their queues
            w.unqueue(hashes)
        size = len(entries)
        queue = w.queues[source]
        if confirmed == len(hashes):  # all confirmed already: only their LRU positions change
            entries.update(zip(hashes, repeat(_CONFIRMED)))
        elif confirmed:
            was_confirmed = list(map(operator.is_, old, repeat(_CONFIRMED)))
            entries.update(zip(hashes, repeat(stamp)))
            entries.update(zip(compress(hashes, was_confirmed), repeat(_CONFIRMED)))
            queue.update(zip(compress(hashes, map(operator.not_, was_confirmed)), repeat(None)))
        else:
            entries.update(zip(hashes, repeat(stamp)))
            queue.update(zip(hashes, repeat(None)))
        if len(entries) - size != len(hashes):
            self._repeated(w, hashes, old, stamp)
        self._reclaim_expired(w, now)
        self._evict(w)

    def apply_stored(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """KV events say ``worker_id`` now holds these blocks: they become ``confirmed``."""
        w = self._worker(worker_id)
        entries = w.entries
        old = list(map(entries.pop, hashes, repeat(None)))
        existing = len(old) - old.count(None)
        if existing and existing > old.count(_CONFIRMED):
            w.unqueue(hashes)
        size = len(entries)
        entries.update(zip(hashes, repeat(_CONFIRMED)))
        if len(entries) - size != len(hashes):
            self._repeated(w, hashes, old, _CONFIRMED)
        self._evict(w)

    def apply_removed(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """KV events say ``worker_id`` evicted these blocks (whatever their source here)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        _consume(map(w.entries.pop, hashes, repeat(None)))
        w.unqueue(hashes)

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything ``worker_id`` holds (restart, ``AllBlocksCleared``, lost events).
        Its capacity and event mode are kept."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.entries.clear()
        for q in w.queues.values():
            q.clear()

    # -- internals --------------------------------------------------------------------------

    def _worker(self, worker_id: str) -> _WorkerBlocks:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _WorkerBlocks(self._default_capacity)
        return w

    @staticmethod
    def _repeated(
        w: _WorkerBlocks, hashes: Sequence[BlockHash], old: list[_Stamp | None], stamp: _Stamp
    ) -> None:
        """A hash occurred more than once in one call, which the batch updates do not order as
        one ``move_to_end`` per block would: redo the call's blocks one at a time. A block
        confirmed before the call stays confirmed; every other one ends with ``stamp``."""
        was_confirmed = {h for h, o in zip(hashes, old, strict=True) if o is _CONFIRMED}
        entries = w.entries
        for h in hashes:
            final = _CONFIRMED if h in was_confirmed else stamp
            entries[h] = final
            entries.move_to_end(h)
            for source, q in w.queues.items():
                if source == final.source:
                    q[h] = None
                    q.move_to_end(h)
                else:
                    q.pop(h, None)

    @staticmethod
    def _evict(w: _WorkerBlocks) -> None:
        entries = w.entries
        excess = len(entries) - w.capacity_blocks
        if excess > 0:
            victims = list(islice(entries, excess))
            _consume(map(entries.pop, victims))
            w.unqueue(victims)

    @staticmethod
    def _reclaim_expired(w: _WorkerBlocks, now: float) -> None:
        entries = w.entries
        for q in w.queues.values():
            expired: list[BlockHash] = []
            for h in q:
                if entries[h].expires_at > now:
                    break
                expired.append(h)
            if expired:
                _consume(map(q.pop, expired))
                _consume(map(entries.pop, expired))
