"""Per-worker load summed over the gateway's processes: one mmapped table, one row per process.

With ``kvgate serve --processes N`` each process holds only its own requests, but ``least_loaded``
and ``kv_aware`` must see the whole gateway's load on a worker, not a 1/N slice. The table is a
file in the processes' shared ``runtime_dir``, mmapped by every process:

- a 64-byte header (magic, rows, slots per row, words per slot), then ``rows`` rows of ``slots``
  slots; a slot is 8-byte words: the worker's key (a 64-bit hash of its URL; 0 = empty, 1 =
  freed), this process's requests in flight on it, their queued prefill tokens, and its pending
  TTFT objectives there (below);
- a process writes only its own row (its index), so there are no locks and no lost updates: every
  store is one aligned 8-byte word, which x86-64 and ARM64 write and read whole;
- a worker's slot in a row is found by open addressing from ``key % slots`` (linear probing,
  skipping freed slots, stopping at an empty one); each process claims its slots in its own order,
  so a reader probes each row, remembers where the key was and re-checks it on every read;
- a reader sums the other rows; a slot whose key changed while it was being read (freed, reused)
  is skipped for that read.

Cost (measured on the 2-core dev machine): the own counts are exact, and a change to them is one
more 8-byte store (a request's take + prefill done + release: 0.9 µs against 0.46 µs with one
process); the others' sum is re-read at most every ``refresh_s`` per worker (2 ms by default;
about 0.2 µs per other process, 2.9 µs with 16 processes), and a read in between costs 0.2 µs
(0.085 µs with one process, where nothing is shared). The trade-off: another process's new
requests reach this one's routing up to ``refresh_s`` late, far less than a request lasts.
Ordering: a slot's counts are zeroed before its key is published; x86-64 keeps stores in that
order, elsewhere a reader may for one refresh see a just-claimed slot's old counts.

Pending TTFT objectives (``gateway.routing.slo.Promises``): a request routed with a TTFT objective
is pending on its worker until its first token is due, and a request routed there later delays
it by about its own prefill, whichever process routed either. Per worker a process publishes the
total delay it has added there (a float, only ever growing) and up to ``PROMISE_SLOTS`` of its
pending requests as (due - the gateway's total delay when it was added, deadline): a request's
due time is that plus the gateway's total delay now (the sum over the rows), so a delay one
process adds reaches the requests every process holds without writing into another's row. An
empty pair (0, 0) is never due. A pair is two stores: a reader that catches one half-written
misjudges one placement. With one process the same arithmetic runs in memory.

A process that restarts zeroes its row when it opens the table (its requests died with it). A
worker that departs frees its slot, and the ``SharedLoad`` of that worker stops writing to the
table, so requests still releasing it cannot touch a slot another worker may now own.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAGIC = 0x6B76_6761_7465_4C54  # "kvgateLT"
HEADER_WORDS = 8
PROMISE_SLOTS = 6  # pending requests with a TTFT objective published per worker and process
REQUESTS, PREFILL, DELAY, PROMISES = 1, 2, 3, 4  # word offsets in a slot (after the key)
SLOT_WORDS = PROMISES + 2 * PROMISE_SLOTS  # key, requests, prefill tokens, delay, (due, deadline)s
_ZEROS = memoryview(bytes(8 * (SLOT_WORDS - 1))).cast("q")
EMPTY = 0
FREED = 1
DEFAULT_SLOTS = 2048
DEFAULT_REFRESH_S = 0.002


def worker_key(worker_id: str) -> int:
    """A 64-bit key for a worker URL, never EMPTY or FREED."""
    key = int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "little")
    return key if key > FREED else key + 2


class LoadTable:
    """The mmapped table. The constructor does no I/O; ``open`` maps (creating it if needed)."""

    def __init__(self, path: Path, rows: int, own_row: int, slots: int = DEFAULT_SLOTS,
                 refresh_s: float = DEFAULT_REFRESH_S) -> None:
        if not 0 <= own_row < rows:
            raise ValueError(f"row {own_row} outside 0..{rows - 1}")
        self.path = path
        self.rows = rows
        self.own_row = own_row
        self.slots = slots
        self.refresh_s = refresh_s
        self._map: mmap.mmap | None = None
        self._keys: memoryview | None = None  # the whole file as unsigned words (keys)
        self._counts: memoryview | None = None  # the same words, signed (counts)
        self._floats: memoryview[float] | None = None  # the same words, as floats (delays, times)
        self._own: dict[int, SharedLoad] = {}  # key -> its load (and slot) in the own row
        self._own_urls: dict[str, SharedLoad] = {}  # the same, by worker URL

    @property
    def counts(self) -> memoryview:
        """The table's words as signed counts (for ``SharedLoad``'s stores into the own row)."""
        assert self._counts is not None, "open() first"
        return self._counts

    @property
    def floats(self) -> memoryview[float]:
        """The table's words as floats (``SharedLoad``'s pending objectives)."""
        assert self._floats is not None, "open() first"
        return self._floats

    @property
    def size_bytes(self) -> int:
        return 8 * (HEADER_WORDS + self.rows * self.slots * SLOT_WORDS)

    def open(self) -> None:
        """Map the file (every process creates it if missing, at the same size) and zero the own
        row: what this process held before a restart died with it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            magic, rows, slots, words = struct.unpack("<4Q",
                                                      os.pread(fd, 32, 0).ljust(32, b"\0"))
            if magic not in (0, MAGIC):
                raise ValueError(f"{self.path} is not a kvgate load table")
            if magic == MAGIC and (rows, slots, words) != (self.rows, self.slots, SLOT_WORDS):
                raise ValueError(f"{self.path} has another layout {(rows, slots, words)} than"
                                 f" this process's {(self.rows, self.slots, SLOT_WORDS)}")
            if os.fstat(fd).st_size != self.size_bytes:
                os.ftruncate(fd, self.size_bytes)
            self._map = mmap.mmap(fd, self.size_bytes)
        finally:
            os.close(fd)
        self._keys = memoryview(self._map).cast("Q")
        self._counts = memoryview(self._map).cast("q")
        self._floats = memoryview(self._map).cast("d")
        if self._keys[0] != MAGIC:  # the first process here writes the header (all write the same)
            self._keys[1], self._keys[2], self._keys[3] = self.rows, self.slots, SLOT_WORDS
            self._keys[0] = MAGIC
        start, end = self._row_bounds(self.own_row)
        self._counts[start:end] = memoryview(bytes(8 * (end - start))).cast("q")
        self._own.clear()
        self._own_urls.clear()

    def close(self) -> None:
        for load in self._own.values():
            load.detach()
        self._own.clear()
        self._own_urls.clear()
        for view in (self._keys, self._counts, self._floats):
            if view is not None:
                view.release()
        self._keys = self._counts = self._floats = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def _row_bounds(self, row: int) -> tuple[int, int]:
        start = HEADER_WORDS + row * self.slots * SLOT_WORDS
        return start, start + self.slots * SLOT_WORDS

    # -- the own row ---------------------------------------------------------------------------

    def claim(self, worker_id: str) -> SharedLoad:
        """This process's slot for a worker (zeroed); without one (a full row, a URL claimed
        already) the load is counted here but not shared."""
        assert self._keys is not None and self._counts is not None, "open() first"
        key = worker_key(worker_id)
        word = None if key in self._own else self._probe_free(key)
        if word is None:  # a full row, or the same URL listed in a second pool
            log.warning("load table row %d: no slot for %s, its load here is not shared",
                        self.own_row, worker_id)
            return SharedLoad(self, key, None)
        self._counts[word + 1:word + SLOT_WORDS] = _ZEROS
        self._keys[word] = key  # published last: readers never see it with stale counts
        load = self._own[key] = self._own_urls[worker_id] = SharedLoad(self, key, word)
        return load

    def shared(self, worker_id: str) -> SharedLoad | None:
        """The worker's slot in the own row (None: it has none); what ``Promises`` shares."""
        return self._own_urls.get(worker_id)

    def free(self, worker_id: str) -> None:
        """The worker departed: its slot in the own row is free again, and its load detaches
        (requests still releasing it count locally only)."""
        assert self._keys is not None and self._counts is not None
        load = self._own.pop(worker_key(worker_id), None)
        if load is None:
            return  # never had a slot (full row), or freed already
        self._own_urls.pop(worker_id, None)
        word = load.word
        load.detach()
        self._keys[word] = FREED
        self._counts[word + 1:word + SLOT_WORDS] = _ZEROS

    def _probe_free(self, key: int) -> int | None:
        assert self._keys is not None
        start, _ = self._row_bounds(self.own_row)
        for i in range(self.slots):
            word = start + ((key + i) % self.slots) * SLOT_WORDS
            if self._keys[word] in (EMPTY, FREED):
                return word
        return None

    # -- reading the other rows ----------------------------------------------------------------

    def others(self, key: int, hints: list[int]) -> tuple[int, int]:
        """(requests, prefill tokens) of ``key`` summed over every row but the own one. ``hints``
        (one word index per row, -1 unknown) remembers where the key was found; updated here."""
        keys, counts = self._keys, self._counts
        if keys is None or counts is None:
            return 0, 0  # closed: the gateway is stopping
        requests = tokens = 0
        for word in self._other_words(key, hints):
            r, t = counts[word + REQUESTS], counts[word + PREFILL]
            if keys[word] == key:  # not freed or reused while we read it
                requests += r
                tokens += t
        return requests, tokens

    def other_promises(self, key: int, hints: list[int]) -> tuple[float, list[tuple[float, float]]]:
        """The delay the other rows added on ``key``'s worker (summed), and their published
        pending objectives (due less the gateway's delay when added, deadline)."""
        keys, floats = self._keys, self._floats
        if keys is None or floats is None:
            return 0.0, []
        delay = 0.0
        pairs: list[tuple[float, float]] = []
        for word in self._other_words(key, hints):
            d = floats[word + DELAY]
            # floats, whatever ``tolist``'s annotation says (compiled, list[int] would be checked)
            found: list[Any] = floats[word + PROMISES:word + SLOT_WORDS].tolist()
            if keys[word] == key:
                delay += d
                pairs.extend((found[i], found[i + 1]) for i in range(0, len(found), 2)
                             if found[i + 1] != 0.0)
        return delay, pairs

    def _other_words(self, key: int, hints: list[int]) -> list[int]:
        keys = self._keys
        assert keys is not None
        words = []
        for row in range(self.rows):
            if row == self.own_row:
                continue
            word = hints[row]
            if word < 0 or keys[word] != key:
                word = hints[row] = self._find(row, key)
                if word < 0:
                    continue
            words.append(word)
        return words

    def _find(self, row: int, key: int) -> int:
        keys = self._keys
        assert keys is not None
        start, _ = self._row_bounds(row)
        for i in range(self.slots):
            word = start + ((key + i) % self.slots) * SLOT_WORDS
            k = keys[word]
            if k == key:
                return word
            if k == EMPTY:
                return -1
        return -1


class SharedLoad:
    """One worker's load as this process sees it: its own requests (exact, each change mirrored
    into its row of the table) plus the other processes' (read at most every ``refresh_s``)."""

    __slots__ = ("_counts", "_delay", "_floats", "_hints", "_others", "_prefill_tokens",
                 "_read_at", "_requests", "_table", "key", "word")

    def __init__(self, table: LoadTable, key: int, word: int | None) -> None:
        self._table: LoadTable | None = table
        self._counts = table.counts if word is not None else None
        self._floats = table.floats if word is not None else None
        self._delay = 0.0
        self.word = -1 if word is None else word  # -1: no slot (full row, or detached)
        self.key = key
        self._requests = 0
        self._prefill_tokens = 0
        self._hints = [-1] * table.rows
        self._others = (0, 0)
        self._read_at = float("-inf")

    def detach(self) -> None:
        """Stop touching the table (the worker departed, or the table closed)."""
        self._table = None
        self._counts = self._floats = None
        self._others = (0, 0)

    @property
    def requests(self) -> int:
        return self._requests

    @requests.setter
    def requests(self, n: int) -> None:
        self._requests = n
        if self._counts is not None:
            self._counts[self.word + REQUESTS] = n

    @property
    def prefill_tokens(self) -> int:
        return self._prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, n: int) -> None:
        self._prefill_tokens = n
        if self._counts is not None:
            self._counts[self.word + PREFILL] = n

    def _others_now(self) -> tuple[int, int]:
        table = self._table
        if table is None:
            return 0, 0
        now = time.monotonic()
        if now - self._read_at >= table.refresh_s:
            self._others = table.others(self.key, self._hints)
            self._read_at = now
        return self._others

    def gateway_requests(self) -> int:
        return self._requests + self._others_now()[0]

    def gateway_prefill_tokens(self) -> int:
        return self._prefill_tokens + self._others_now()[1]

    # -- pending TTFT objectives (``gateway.routing.slo.Promises``; read as placed, no refresh)

    def add_delay(self, delay_s: float) -> None:
        """This process delayed the worker's pending requests by ``delay_s`` more."""
        self._delay += delay_s
        if self._floats is not None:
            self._floats[self.word + DELAY] = self._delay

    def publish(self, pairs: list[tuple[float, float]]) -> None:
        """This process's pending requests on the worker, (due less the gateway's delay when
        added, deadline), at most ``PROMISE_SLOTS`` (the rest are not shared)."""
        floats = self._floats
        if floats is None:
            return
        word = self.word + PROMISES
        for i in range(PROMISE_SLOTS):
            base, deadline = pairs[i] if i < len(pairs) else (0.0, 0.0)
            floats[word + 2 * i] = base
            floats[word + 2 * i + 1] = deadline

    def promises(self) -> tuple[float, list[tuple[float, float]]]:
        """The gateway's delay on the worker (every process's) and the other processes'
        pending requests there, as ``publish`` writes them."""
        table = self._table
        if table is None:
            return self._delay, []
        delay, pairs = table.other_promises(self.key, self._hints)
        return self._delay + delay, pairs
