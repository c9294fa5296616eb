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
- per worker, the chain structure the prefix search relies on (below): ``parent`` (block -> the
  block before it in its chain), ``kids`` (per block, its children held or ghosts, and its
  confirmed children held), ``ghosts`` (blocks not held that are an ancestor of a held block),
  ``unanchored`` (ghosts whose own ancestors are unknown) and ``violations`` (tentative blocks
  held that have a confirmed child held).

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

- ``match_prefix``: O(W × log B) dict lookups (the search below), two per worker when the
  worker holds all of the prompt or none of it; O(matched) per worker where it must walk.
  Looking is not using, so it refreshes no LRU position (it reclaims expired entries first).
- ``record_routed`` / ``apply_stored``: O(B) pops and inserts, plus O(evicted) eviction and
  O(expired) reclaim, each entry evicted or reclaimed once: no sort, no compaction, no stall.
  Never-seen prompts of one length into a full 65,536-block index (every call evicts what it
  adds, a whole route: see "Order within one call" for lengths that vary), min /
  median / mean on this shared 2-core box: 8K blocks (128K tokens at 16 per block) 4.0 / 6-8 /
  7.5-16 ms, where the previous design (a Python loop per block, and a TTL deque of records
  sorted whenever it outgrew 2 × capacity) took 5-6 / 14-15 / 25-30 ms with 150-340 ms stalls;
  1K blocks 0.4 / 0.7 / 1.6 ms against 0.6 / 0.9 / 4.0 ms. ``python -m gateway.bench.routing_cost``
  printed this case as its ``full index`` table (its prompt lengths vary since issue 11).
  Keeping the search's chain structure (parent links and child counts of the blocks added
  and evicted) costs about as much again: at 2K
  blocks, median 2.4-2.8 ms before it and 5.4-8.9 ms with it, side by side on a loaded box. A
  route whose blocks are all confirmed already only moves them to the most-recently-used end
  (``move_to_end`` per block: 0.4 ms for 2K blocks, where a pop and an insert took 0.85). A
  route whose blocks are all held tentatively from the worker's current source (a prompt routed
  again without events: approximate mode) is refreshed in place the same way, with the new
  stamp and its queue moved too (``_refreshed``; compiled, session 30, on a machine ~2x slower
  than the one above: 2 blocks 5.8 -> 4.5 µs, 32 blocks 18.4 -> 9.2 µs, 512 blocks 227 -> 100
  µs).
- ``apply_removed``: O(B). ``clear_worker``: O(entries of that worker). ``stats``: O(W).

Order within one call: a call touches its blocks last to first, so a prompt's first block is
its most recently used and its last block is evicted first. vLLM does the same (a finished
request's blocks join the free queue tail first, "so that the tail blocks are evicted first"),
so a prompt's prefix outlives its tail and a partly evicted route still gives a prefix hit.
It is also what keeps eviction cheap: capacity eviction takes a chain's tail, whose children
leave with it, so no ghost is made (below). Issue 11 measured it with ``python -m
gateway.bench.routing_cost --quick --lengths 32768,131072 --tokenizer simple`` (its ``full
index`` table: never-seen prompts up to 10% shorter than the length, so evictions end part-way
through a route, into a full 65,536-block index): median / max at 128K tokens 30.6 / 43.6 ms
when a call's first block went first (each eviction cut the oldest chain at its start and made
thousands of ghosts, one Python step each), 14.8 / 23.8 ms tail first; at 32K 6.2 -> 3.7 ms.
What is left is C-level dict work, ≈ 2-3 µs a block with real 64-bit hashes, so the gateway
records a long route a slice per loop turn (``PrefixIndex.record_chain``).

A hash repeated within one call keeps the position of its first occurrence and a confirmed
block stays confirmed, exactly as one ``move_to_end`` per block, last to first, would do
(chained hashes never repeat; the rare case costs one more pass, and that worker is walked,
not searched, until it is empty).

Search (``match_prefix_pending``; issue 15: a 32K-token prompt held by all 16 candidates cost
4.5-8.7 ms of walking, 2,048 lookups per worker). The answer is the walk's: per worker, the
blocks held before the first one missing or expired, and how many of those are pending. Keys
are chained hashes, so a block fixes every block before it, and a worker's blocks form a tree
of prefixes. The search finds the answer in O(log B) lookups:

1. expired entries are reclaimed (they are misses; now "held" is "present");
2. first missing block: binary search for the boundary of "held" along the prompt's chain. That
   is the first miss only where the held blocks of the chain form a prefix; where they do not,
   a block before the boundary is missing although a block after it is held, which makes it a
   ghost: every block that leaves (removed, evicted, expired) while a descendant is held or a
   ghost stays as one, and leaves when its last descendant does. So the first miss is the
   boundary or the first ghost before it, whichever comes first (ghosts on the prompt found by
   set lookups over the smaller of the ghosts and the prompt);
3. pending: on a chain, confirmed blocks come first (an event confirms a segment after its
   parent, and vLLM stores blocks in order) and tentative blocks after them carry the stamp of
   the latest route that covered them, newest first (a route covers the whole prefix), so
   "pending" (routed within ``speculative_ttl_s``) holds for a run of them: two more binary
   searches. ``violations`` counts where a confirmed block follows a tentative one (a segment
   stored after a tentative parent, a ghost routed again): then pending is counted over the
   matched blocks' stamps.

It walks instead where it cannot vouch for the answer: a worker with both tentative sources at
once (after ``set_events`` flips: their TTLs differ), an unanchored ghost on the prompt's way (a
segment stored after a parent the index does not hold: what lies before is unknown), or a list
that is not a chain the index knows (a probed block held after another block than the one before
it in the list, or a block held after one used as a chain's first). Updates keep the structure
with whole-call C-level operations too (``dict.update`` of the parent links, ``Counter.update``
of new children); a batch of removed blocks that takes every child with it (an evicted route,
vLLM's leaf-first evictions) is handled without a Python loop per block, others one block at a
time. ``tests/unit/test_kvindex_search.py`` checks the search against the walk, and the
structure against one recomputed from scratch, over random sequences of routes, stored
segments, removals, expiries, mode flips, capacity changes and clears.

Lower tiers (issue 15, item 4): vLLM's KV connectors keep blocks outside the GPU cache too
(``--kv-offloading-size``: the native CPU offload; LMCache; other tiers), and publish them with
the tier's ``medium`` (``"CPU"``, ``"STORAGE"`` ...). Per worker and medium, ``tiers[medium]`` is a
``_Tier``: an ``OrderedDict[BlockHash, int]`` in LRU order, the int a reference count (vLLM's
self-describing offload events announce a hash shared by two chunks once per chunk, and remove it
as often), bounded by its own ``capacity_blocks`` (``set_tier_capacity``; default
``default_lower_tier_capacity_blocks``). Only events fill it (there is no tentative source: the
gateway cannot guess what a worker offloaded), and it is independent of the GPU entries: a block
removed from the GPU but stored to the CPU stays a lower-tier hit; a block removed from the CPU
leaves that tier only. ``match_prefix_tiers`` answers, per worker, the GPU prefix and pending
blocks (``match_prefix_pending``) and the longer prefix reachable through lower tiers: from the
first GPU miss on, the run of blocks some lower tier holds, as vLLM's offloading connector looks
them up (``get_num_new_matched_tokens`` continues at ``num_computed_tokens``, chunk by chunk,
until the first miss). Cost: one C-level ``takewhile`` over that run per worker with a lower tier,
nothing for a worker without one or holding the whole prompt on the GPU: a 32K-token prompt
(2,048 blocks) held only in the CPU tier costs ≈ 50-90 µs per worker on this 2-core box, 0.8 ms
for 16 such candidates (the GPU search: 5 µs). No binary search here: a tier's LRU evicts a
chain's blocks in any order, so its held blocks need not form a prefix. ≈ 100 bytes per
lower-tier entry.

Removals (hit accounting's ``evicted`` bucket, ``gateway.routing.accounting``): per worker, the
events that removed blocks are numbered, and the last ``REMOVAL_LOG_BLOCKS`` blocks removed are
kept with their event's number (an ``OrderedDict``, oldest first; one more whole-call
``update`` per ``apply_removed``, ≈ 100 bytes per logged block, 0.4 MB per worker at most);
a clear (``AllBlocksCleared``, a restart, lost events) is numbered too. ``removal_mark`` at
routing time and ``removed_since`` when the answer came tell whether a block the prediction
counted on was removed in between. Only events count: an entry that expired (a TTL) or left
the index's own LRU was not removed by the worker.

Memory bound: a worker holds at most ``capacity_blocks`` entries (inserting evicts the LRU
front), and each tentative entry is in exactly one queue, so the index never holds more than
Σ capacity entries. Measured with ``tracemalloc``: ≈ 140 bytes per confirmed entry (OrderedDict
node + int key; the stamp is shared), ≈ 245 per tentative one (its queue node too), i.e.
≈ 14-25 MB per 100K blocks (the previous design: ≈ 185 and ≈ 250, plus up to one stale TTL
record per entry). The event subscriber's engine-hash map adds ≈ 60-90 bytes per
confirmed block. The search's chain structure adds a parent link and a child count per block
that has a child (and ghosts, bounded by the blocks held times their depth, usually none):
measured on a 100K-block chain, 105 -> 246 bytes per confirmed entry and 211 -> 316 per learned
one, i.e. ≈ +9 MB per worker holding 65,536 confirmed blocks.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress, filterfalse, islice, repeat, takewhile
from typing import Final, Literal

from mypy_extensions import mypyc_attr

from gateway.kvindex.hashing import BlockHash

Source = Literal["confirmed", "speculative", "learned"]
CONFIRMED: Final = "confirmed"
SPECULATIVE: Final = "speculative"
LEARNED: Final = "learned"
SOURCES: Final[tuple[Source, ...]] = (CONFIRMED, SPECULATIVE, LEARNED)
TENTATIVE: Final[tuple[Source, ...]] = (SPECULATIVE, LEARNED)

_CONFIRMED_SHIFT: Final = 32
CONFIRMED_CHILD: Final = 1 << _CONFIRMED_SHIFT
"""One confirmed child held, in ``_WorkerBlocks.kids`` (the low 32 bits count every child)."""
_KIDS: Final = CONFIRMED_CHILD - 1

DEFAULT_CAPACITY_BLOCKS: Final = 65_536
MAX_LOWER_TIERS: Final = 4
"""Media per worker (CPU, STORAGE, a connector's own ...): what a publisher names beyond them is
not kept, so no stream of made-up media grows the index."""
DEFAULT_LOWER_TIER_CAPACITY_BLOCKS: Final = 4 * DEFAULT_CAPACITY_BLOCKS
"""Per worker and lower tier, until ``set_tier_capacity`` says otherwise: a CPU tier is usually
several times the GPU cache (host memory), and only events fill it."""
DEFAULT_SPECULATIVE_TTL_S: Final = 10.0
REMOVAL_LOG_BLOCKS: Final = 4096  # per worker: the blocks most recently removed by events
DEFAULT_LEARNED_TTL_S: Final = 300.0


@dataclass(frozen=True, slots=True, eq=False, init=False)
class _Stamp:
    """What an entry is and until when; one object for all blocks of one call. Compared by
    identity (``eq=False``): counting ``_CONFIRMED`` in a list of thousands stays at C speed."""

    source: Source
    expires_at: float

    def __init__(self, source: Source, expires_at: float) -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "expires_at", expires_at)


_CONFIRMED: Final = _Stamp(CONFIRMED, math.inf)


class _WorkerBlocks:
    __slots__ = (
        "capacity_blocks", "cleared_at", "entries", "epoch", "events", "ghosts", "kids",
        "parent", "queues", "removals", "removed", "tiers", "unanchored", "violations", "walk",
    )

    def __init__(self, capacity_blocks: int, epoch: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.epoch = epoch  # new at creation and at every clear (``BlockIndex.epoch``)
        self.events = False
        self.entries: OrderedDict[BlockHash, _Stamp] = OrderedDict()
        self.queues: dict[Source, OrderedDict[BlockHash, None]] = {
            s: OrderedDict() for s in TENTATIVE
        }
        # The chain structure the search relies on (module docstring, "Search"):
        self.parent: dict[BlockHash, BlockHash] = {}  # block -> the block before it in its chain
        # per block: children held or ghosts + CONFIRMED_CHILD × confirmed children held (one
        # dict for both counts: a dict slot per block is most of the structure's memory)
        self.kids: Counter[BlockHash] = Counter()
        self.ghosts: set[BlockHash] = set()  # not held, but an ancestor of a held block
        self.unanchored: set[BlockHash] = set()  # ghosts whose own ancestors are unknown
        self.violations = 0  # tentative blocks held with a confirmed child held
        self.walk = False  # a call repeated a hash (no chain): answer by walking until emptied
        self.tiers: dict[str, _Tier] = {}  # lower tiers by medium (module docstring)
        # Removal log (module docstring, "Removals"): events that removed blocks, numbered; the
        # last REMOVAL_LOG_BLOCKS blocks removed, each with its event's number; the number of
        # the last clear.
        self.removals = 0
        self.removed: OrderedDict[BlockHash, int] = OrderedDict()
        self.cleared_at = 0

    def unqueue(self, hashes: Iterable[BlockHash]) -> None:
        """Take ``hashes`` out of every tentative queue that has entries (absent ones are fine)."""
        for q in self.queues.values():
            if q:
                _consume(map(q.pop, hashes, repeat(None)))

    def reset_chains(self) -> None:
        """No block held: no structure either (and a worker that was walked is searched again)."""
        self.parent.clear()
        self.kids.clear()
        self.ghosts.clear()
        self.unanchored.clear()
        self.violations = 0
        self.walk = False

    def link(
        self,
        hashes: Sequence[BlockHash],
        old: list[_Stamp | None],
        first_parent: BlockHash | None,
        confirm: bool,
    ) -> None:
        """``hashes`` (one chain segment, ``first_parent`` before it, ``None``: the chain's start)
        are now held, ``old`` their stamps before the call; confirmed if ``confirm``."""
        if self.walk:
            return
        parent, kids, ghosts = self.parent, self.kids, self.ghosts
        # parents[i] is the parent of hashes[i + skip]: a chain's first block has none
        parents: list[BlockHash] = list(islice(hashes, len(hashes) - 1))
        skip = 1
        if first_parent is not None:
            parents.insert(0, first_parent)
            skip = 0
        parent.update(zip(islice(hashes, 1, None), hashes, strict=False))
        if first_parent is not None:
            parent[hashes[0]] = first_parent
        counted = list(map(operator.is_, old, repeat(None)))  # newly held: a new child
        revived: list[BlockHash] = []
        if ghosts:
            is_ghost = list(map(ghosts.__contains__, hashes))
            if any(is_ghost):
                for i in compress(range(len(hashes)), is_ghost):
                    h = hashes[i]
                    revived.append(h)
                    ghosts.discard(h)
                    if h in self.unanchored:  # not yet counted by a parent: it is now
                        self.unanchored.discard(h)
                    else:
                        counted[i] = False
        _count(kids, list(compress(parents, islice(counted, skip, None))))
        if first_parent is not None and counted[0] and first_parent not in self.entries \
                and first_parent not in ghosts:
            # A segment whose parent is not held: what lies before it is unknown.
            ghosts.add(first_parent)
            self.unanchored.add(first_parent)
        if confirm:
            newly = list(map(operator.is_not, old, repeat(_CONFIRMED)))
            if self.violations:  # tentative blocks with confirmed children stop being tentative
                was_tentative = map(operator.and_, newly, map(operator.is_not, old, repeat(None)))
                self.violations -= _with_confirmed_kids(kids, compress(hashes, was_tentative))
            # a chain segment names each parent once: one increment per parent
            confirmed_parents = compress(parents, islice(newly, skip, None))
            kids.update(dict.fromkeys(confirmed_parents, CONFIRMED_CHILD))
            confirmed_kids = 0 if first_parent is None else kids[first_parent] >> _CONFIRMED_SHIFT
            if first_parent is not None and newly[0] and confirmed_kids == 1:
                s = self.entries.get(first_parent)
                if s is not None and s is not _CONFIRMED:
                    self.violations += 1
        elif revived:
            self.violations += _with_confirmed_kids(kids, revived)

    def unlink(self, victims: list[BlockHash], olds: list[_Stamp]) -> None:
        """``victims`` are no longer held (``olds``: their stamps). A victim with children held
        (or ghosts) becomes a ghost; a ghost left without children goes, up its chain."""
        if not self.entries:
            self.reset_chains()
            return
        if self.walk or not victims:
            return
        parent, kids = self.parent, self.kids
        ps = list(map(parent.get, victims))
        if self.violations:
            tentative = map(operator.is_not, olds, repeat(_CONFIRMED))
            self.violations -= _with_confirmed_kids(kids, compress(victims, tentative))
        confirmed: list[BlockHash | None] = []
        if olds.count(_CONFIRMED):
            confirmed = list(compress(ps, map(operator.is_, olds, repeat(_CONFIRMED))))
        gone = set(victims)
        outside = list(filterfalse(gone.__contains__, ps))  # parents that stay
        # Every child of every victim is a victim too (no ghost is made) iff the victims' child
        # counts add up to the victims whose parent is a victim.
        children = sum(map(operator.and_, map(kids.get, victims, repeat(0)), repeat(_KIDS)))
        if children == len(ps) - len(outside):
            _consume(map(parent.pop, victims, repeat(None)))
            _consume(map(kids.pop, victims, repeat(None)))
            if confirmed:
                self._lost_confirmed(_tally(list(filterfalse(gone.__contains__, confirmed))))
            for p, n in _tally(outside).items():
                if p is not None:
                    self._lost_kids(p, n)
            return
        if confirmed:
            self._lost_confirmed(_tally(confirmed))
        for v in victims:
            if kids.get(v, 0) & _KIDS:
                self.ghosts.add(v)
            else:
                self._drop(v)

    def _lost_confirmed(self, by_parent: dict[BlockHash | None, int]) -> None:
        kids, entries = self.kids, self.entries
        for p, n in by_parent.items():
            if p is None:
                continue
            left = kids.get(p, 0) - n * CONFIRMED_CHILD
            if left > 0:
                kids[p] = left
            else:
                kids.pop(p, None)
            if left >> _CONFIRMED_SHIFT == 0:
                s = entries.get(p)
                if s is not None and s is not _CONFIRMED:
                    self.violations -= 1

    def _lost_kids(self, p: BlockHash, n: int) -> None:
        left = self.kids.get(p, 0) - n
        if left & _KIDS:
            self.kids[p] = left
            return
        self.kids.pop(p, None)  # no child left, so no confirmed one either
        if p in self.ghosts:
            self._drop(p)

    def _drop(self, h: BlockHash) -> None:
        """``h`` (not held, no children) leaves the structure, and so does every ghost above it
        that it was the last child of."""
        kids, ghosts = self.kids, self.ghosts
        while True:
            kids.pop(h, None)
            ghosts.discard(h)
            self.unanchored.discard(h)
            p = self.parent.pop(h, None)
            if p is None:
                return
            left = kids.get(p, 0) - 1
            if left & _KIDS:
                kids[p] = left
                return
            kids.pop(p, None)
            if p not in ghosts:
                return
            h = p


def _in_any(tiers: list[OrderedDict[BlockHash, int]], h: BlockHash) -> bool:
    return any(h in t for t in tiers)


class _Tier:
    """One lower tier of one worker: block -> reference count, in LRU order, bounded."""

    __slots__ = ("blocks", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[BlockHash, int] = OrderedDict()

    def store(self, hashes: Sequence[BlockHash]) -> None:
        blocks = self.blocks
        for h in hashes:
            blocks[h] = blocks.get(h, 0) + 1
            blocks.move_to_end(h)
        self.evict()

    def remove(self, hashes: Iterable[BlockHash]) -> None:
        blocks = self.blocks
        for h in hashes:
            n = blocks.get(h)
            if n is None:
                continue
            if n > 1:
                blocks[h] = n - 1
            else:
                del blocks[h]

    def evict(self) -> None:
        excess = len(self.blocks) - self.capacity_blocks
        if excess > 0:
            _consume(map(self.blocks.pop, list(islice(self.blocks, excess))))


def _with_confirmed_kids(kids: Counter[BlockHash], hashes: Iterable[BlockHash]) -> int:
    """How many of ``hashes`` have a confirmed child held."""
    counts = map(kids.get, hashes, repeat(0))
    return sum(map(bool, map(operator.rshift, counts, repeat(_CONFIRMED_SHIFT))))


_SHORT: Final = 32
"""Up to this many hashes, ``_tally`` and ``_count`` count in a compiled loop: building or
updating a ``Counter`` runs its interpreted ``__init__``/``update`` (~1-2 us a call), more than a
routed short prompt's few blocks cost to count (issue 11: a new two-block prompt's recording at
capacity made three such calls); past it, ``Counter``'s C loop is faster."""


def _tally(items: list[BlockHash | None]) -> dict[BlockHash | None, int]:
    """How many times each of ``items`` occurs."""
    if len(items) > _SHORT:
        return Counter(items)
    counts: dict[BlockHash | None, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _count(kids: Counter[BlockHash], parents: list[BlockHash]) -> None:
    """One more child for each of ``parents`` (a parent named twice gets two)."""
    if len(parents) > _SHORT:
        kids.update(parents)
        return
    for p in parents:
        kids[p] = kids.get(p, 0) + 1


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
    lower_tiers: tuple[tuple[str, int], ...] = ()  # (medium, blocks held there), by medium

    @property
    def total(self) -> int:
        return self.confirmed + self.speculative + self.learned


@mypyc_attr(allow_interpreted_subclasses=True)  # tests count its calls in a subclass
class BlockIndex:
    """Block hash -> the workers holding it; one bounded LRU per worker. See the module docstring."""

    def __init__(
        self,
        *,
        default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        default_lower_tier_capacity_blocks: int = DEFAULT_LOWER_TIER_CAPACITY_BLOCKS,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        learned_ttl_s: float = DEFAULT_LEARNED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_capacity_blocks <= 0:
            raise ValueError("default_capacity_blocks must be positive")
        if default_lower_tier_capacity_blocks <= 0:
            raise ValueError("default_lower_tier_capacity_blocks must be positive")
        self._default_capacity = default_capacity_blocks
        self._default_tier_capacity = default_lower_tier_capacity_blocks
        # Set once any worker has a lower tier: until then a lookup skips the tiers entirely.
        self.has_lower_tiers = False
        self._ttl: dict[Source, float] = {
            CONFIRMED: math.inf,
            SPECULATIVE: speculative_ttl_s,
            LEARNED: learned_ttl_s,
        }
        self._clock = clock
        self._workers: dict[str, _WorkerBlocks] = {}
        self._epochs = itertools.count(1)

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

    @property
    def default_lower_tier_capacity_blocks(self) -> int:
        return self._default_tier_capacity

    def set_tier_capacity(self, worker_id: str, medium: str, blocks: int | None) -> None:
        """Bound ``worker_id``'s ``medium`` tier (``None``: the default); evicts its LRU front."""
        if blocks is not None and blocks <= 0:
            raise ValueError(f"capacity must be positive, got {blocks}")
        w = self._worker(worker_id)
        if medium not in w.tiers and len(w.tiers) >= MAX_LOWER_TIERS:
            raise ValueError(f"{worker_id} has {MAX_LOWER_TIERS} lower tiers already")
        tier = self._tier(w, medium)
        tier.capacity_blocks = blocks if blocks is not None else self._default_tier_capacity
        tier.evict()

    def set_events(self, worker_id: str, enabled: bool) -> None:
        """Whether ``worker_id``'s KV events confirm its blocks (routing then records
        ``speculative`` entries for it; otherwise ``learned`` ones)."""
        self._worker(worker_id).events = enabled

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def epoch(self, worker_id: str) -> int | None:
        """Changes whenever ``worker_id``'s entries are all forgotten (``clear_worker``,
        ``remove_worker``); None for a worker the index does not know. A caller that records a
        route over several calls checks it did not change in between."""
        w = self._workers.get(worker_id)
        return None if w is None else w.epoch

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

        The answer is the walk's (``_walk``), found by the search of the module docstring in
        O(log n) lookups per worker; it reclaims the workers' expired entries first.
        """
        now = self._clock()
        recent_learned = now + self._ttl[LEARNED] - self._ttl[SPECULATIVE]
        result: dict[str, tuple[int, int]] = {}
        positions = _Positions(hashes)
        for worker_id in worker_ids:
            w = self._workers.get(worker_id)
            if w is not None and (w.queues[SPECULATIVE] or w.queues[LEARNED]):
                self._reclaim_expired(w, now)  # expired = not held, for the search's invariants
            if w is None or not w.entries or not hashes:
                result[worker_id] = (0, 0)
                continue
            found = None
            if not w.walk and not (w.queues[SPECULATIVE] and w.queues[LEARNED]):
                found = _search(w, hashes, recent_learned, positions)
            result[worker_id] = (
                found if found is not None else _walk(w.entries, hashes, now, recent_learned)
            )
        return result

    def match_prefix_tiers(
        self, hashes: Sequence[BlockHash], worker_ids: Iterable[str]
    ) -> dict[str, tuple[int, int, int]]:
        """Per worker, (leading blocks held on the GPU, pending among them, leading blocks
        reachable with its lower tiers too): ``match_prefix_pending`` plus, from the first GPU
        miss on, the run of blocks some lower tier holds (the module docstring, "Lower tiers").
        The third number is never below the first."""
        ids = list(worker_ids)
        result: dict[str, tuple[int, int, int]] = {}
        for worker_id, (held, pending) in self.match_prefix_pending(hashes, ids).items():
            reach = held
            w = self._workers.get(worker_id)
            if w is not None and w.tiers and held < len(hashes):
                tiers = [t.blocks for t in w.tiers.values() if t.blocks]
                rest = islice(hashes, held, None)
                if len(tiers) == 1:
                    reach += len(list(takewhile(tiers[0].__contains__, rest)))
                elif tiers:
                    reach += len(list(takewhile(partial(_in_any, tiers), rest)))
            result[worker_id] = (held, pending, reach)
        return result

    def in_lower_tier(self, worker_id: str, block_hash: BlockHash) -> bool:
        """Whether some lower tier of ``worker_id`` holds ``block_hash``."""
        w = self._workers.get(worker_id)
        return w is not None and any(block_hash in t.blocks for t in w.tiers.values())

    def in_gpu(self, worker_id: str, block_hash: BlockHash) -> bool:
        """Whether ``worker_id``'s GPU entries hold ``block_hash`` (any source, unexpired or not)."""
        w = self._workers.get(worker_id)
        return w is not None and block_hash in w.entries

    def is_confirmed(self, worker_id: str, block_hash: BlockHash) -> bool:
        """Whether ``worker_id``'s KV events reported ``block_hash`` (a ``confirmed`` entry)."""
        w = self._workers.get(worker_id)
        return w is not None and w.entries.get(block_hash) is _CONFIRMED

    def export_chains(
        self, worker_id: str, max_blocks: int
    ) -> list[tuple[BlockHash | None, list[BlockHash]]]:
        """Up to ``max_blocks`` of ``worker_id``'s held blocks (unexpired, any source) as chain
        segments, most recently used first: (the block before the segment, given by an earlier
        segment, or ``None`` at a chain's start; the segment's blocks in chain order). Every
        segment ends a prefix that was routed or stored whole, so ``record_routed`` of that
        prefix rebuilds the entries with the index's invariants (a replica's snapshot,
        ``gateway.kvindex.exchange``). Blocks below a ghost are not given (no prefix search
        reaches them), nor anything of a worker that is walked (a call repeated a hash: no
        chain structure). O(blocks given + blocks visited), no sort."""
        w = self._workers.get(worker_id)
        if w is None or w.walk or max_blocks <= 0:
            return []
        self._reclaim_expired(w, self._clock())
        entries, parent = w.entries, w.parent
        given: set[BlockHash] = set()
        skipped: set[BlockHash] = set()  # below a ghost
        out: list[tuple[BlockHash | None, list[BlockHash]]] = []
        left = max_blocks
        for h in reversed(entries):  # most recently used first
            if h in given or h in skipped:
                continue
            up: list[BlockHash] = []
            p: BlockHash | None = h
            while p is not None and p not in given:
                if p in skipped or p not in entries:  # a ghost: unreachable below it
                    skipped.update(up)
                    up = []
                    break
                up.append(p)
                p = parent.get(p)
            if not up:
                continue
            up.reverse()
            given.update(up)
            if out and p is not None and out[-1][1] and out[-1][1][-1] == p:
                # A call's blocks come most recently used first from its first block on (its
                # tail goes first): each continues the segment before it, so extend that one.
                out[-1][1].extend(up[:left])
            else:
                out.append((p, up[:left]))
            left -= len(up)
            if left <= 0:
                break
        return out

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
                lower_tiers=tuple(sorted((m, len(t.blocks)) for m, t in w.tiers.items())),
            )
        return out

    # -- updates ----------------------------------------------------------------------------

    def record_routed(
        self, worker_id: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> None:
        """The router sent a prompt with these block hashes to ``worker_id`` (``parent``: the
        block before them in the prompt's chain, when they are a later slice of it; ``None``:
        they start it).

        New blocks become ``speculative`` (worker with events) or ``learned`` (without); existing
        tentative entries get a fresh TTL (and the worker's current source); every block moves to
        the most-recently-used end (the engine will touch them all), confirmed ones included,
        last block first (module docstring: a prompt's tail is evicted before its prefix).
        """
        w = self._worker(worker_id)
        source: Source = SPECULATIVE if w.events else LEARNED
        now = self._clock()
        stamp = _Stamp(source, now + self._ttl[source])
        entries = w.entries
        if hashes and entries.get(hashes[0]) is _CONFIRMED and entries.get(hashes[-1]) is \
                _CONFIRMED and list(map(entries.get, hashes)).count(_CONFIRMED) == len(hashes):
            # All confirmed (a prompt whose prefix the worker reported): only their LRU
            # positions change, and one C call per block moves each, where a pop and an insert
            # cost 3-4x as much (32K tokens on 16 candidates: most of the decision's time).
            _consume(map(entries.move_to_end, reversed(hashes)))
            self._reclaim_expired(w, now)
            return
        if hashes and self._refreshed(w, hashes, source, stamp):
            self._reclaim_expired(w, now)
            self._evict(w)
            return
        old = list(map(entries.pop, hashes, repeat(None)))
        existing = len(old) - old.count(None)
        confirmed = old.count(_CONFIRMED) if existing else 0
        if existing > confirmed:  # tentative entries among them: out of their queues
            w.unqueue(hashes)
        size = len(entries)
        queue = w.queues[source]
        if confirmed == len(hashes):  # all confirmed already: only their LRU positions change
            entries.update(zip(reversed(hashes), repeat(_CONFIRMED)))
        elif confirmed:
            was_confirmed = list(map(operator.is_, old, repeat(_CONFIRMED)))
            entries.update(zip(reversed(hashes), repeat(stamp)))
            entries.update(zip(compress(hashes, was_confirmed), repeat(_CONFIRMED)))
            queue.update(zip(compress(reversed(hashes), map(operator.not_,
                                                            reversed(was_confirmed))),
                             repeat(None)))
        else:
            entries.update(zip(reversed(hashes), repeat(stamp)))
            queue.update(zip(reversed(hashes), repeat(None)))
        if len(entries) - size != len(hashes):
            self._repeated(w, hashes, old, stamp)
        elif existing < len(hashes):  # new blocks (all were held: the chains are unchanged)
            w.link(hashes, old, parent, confirm=False)
        self._reclaim_expired(w, now)
        self._evict(w)

    def _refreshed(self, w: _WorkerBlocks, hashes: Sequence[BlockHash], source: Source,
                   stamp: _Stamp) -> bool:
        """Whether ``record_routed``'s work was done here: when ``w`` holds every block of
        ``hashes`` (no two alike) tentatively from ``source`` (a prompt routed again to the
        worker it went to before, without events to confirm it), each takes ``stamp`` and
        moves to the recently-used end of the LRU and of its queue, last block first: the
        state the general path leaves (pop all, unqueue, insert all), in three C-level passes
        over existing keys instead of five that allocate. False (nothing changed) otherwise."""
        entries = w.entries
        stamps = set(map(entries.get, hashes))  # one stamp per earlier call: a few objects
        for old in stamps:
            if old is None or old is _CONFIRMED or old.source != source:
                return False
        if len(hashes) > 1 and len(set(hashes)) != len(hashes):
            return False  # a repeated hash: the general path's ``_repeated`` decides
        queue = w.queues[source]
        _consume(map(entries.move_to_end, reversed(hashes)))
        entries.update(zip(hashes, repeat(stamp)))  # existing keys: their places stay
        _consume(map(queue.move_to_end, reversed(hashes)))
        return True

    def apply_stored(
        self, worker_id: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> None:
        """KV events say ``worker_id`` now holds these blocks: they become ``confirmed``.

        ``hashes`` continue the chain after ``parent`` (``None``: they start a chain), as
        vLLM's ``BlockStored`` does with its ``parent_block_hash``.
        """
        w = self._worker(worker_id)
        entries = w.entries
        old = list(map(entries.pop, hashes, repeat(None)))
        existing = len(old) - old.count(None)
        if existing and existing > old.count(_CONFIRMED):
            w.unqueue(hashes)
        size = len(entries)
        entries.update(zip(reversed(hashes), repeat(_CONFIRMED)))
        if len(entries) - size != len(hashes):
            self._repeated(w, hashes, old, _CONFIRMED)
        elif hashes and old.count(_CONFIRMED) < len(hashes):  # not all confirmed already
            w.link(hashes, old, parent, confirm=True)
        self._evict(w)

    def apply_removed(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """KV events say ``worker_id`` evicted these blocks (whatever their source here)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        old = list(map(w.entries.pop, hashes, repeat(None)))
        w.unqueue(hashes)
        held = list(map(operator.is_not, old, repeat(None)))
        gone = list(compress(hashes, held))
        w.unlink(gone, list(filter(None, old)))
        if gone:
            w.removals += 1
            log = w.removed
            _consume(map(log.pop, gone, repeat(None)))  # a block removed again moves to the end
            log.update(zip(gone, repeat(w.removals)))
            if len(log) > REMOVAL_LOG_BLOCKS:
                _consume(map(log.pop, list(islice(log, len(log) - REMOVAL_LOG_BLOCKS))))

    def removal_mark(self, worker_id: str) -> int:
        """The number of the last removal ``worker_id``'s events made (0: none): pass it to
        ``removed_since`` later to ask whether a block left after now."""
        w = self._workers.get(worker_id)
        return 0 if w is None else w.removals

    def removed_since(self, worker_id: str, block: BlockHash, mark: int) -> bool:
        """Whether an event removed ``block`` from ``worker_id`` (or cleared the worker) after
        ``removal_mark`` returned ``mark``. False when the log no longer reaches that far back
        (``REMOVAL_LOG_BLOCKS``): not known is not removed."""
        w = self._workers.get(worker_id)
        if w is None or w.removals == mark:
            return False
        return w.cleared_at > mark or w.removed.get(block, 0) > mark

    def apply_stored_lower(
        self, worker_id: str, medium: str, hashes: Sequence[BlockHash]
    ) -> bool:
        """KV events say ``worker_id`` stored these blocks in its ``medium`` tier (not the GPU):
        one reference each, at the most-recently-used end; the tier's LRU front goes beyond its
        capacity. Its GPU entries do not change. False (nothing kept): the worker has
        ``MAX_LOWER_TIERS`` other media already."""
        w = self._worker(worker_id)
        if medium not in w.tiers and len(w.tiers) >= MAX_LOWER_TIERS:
            return False
        if hashes:
            self._tier(w, medium).store(hashes)
        return True

    def apply_removed_lower(
        self, worker_id: str, medium: str, hashes: Sequence[BlockHash]
    ) -> None:
        """KV events say ``worker_id``'s ``medium`` tier dropped these blocks (one reference
        each); its GPU entries and other tiers do not change."""
        w = self._workers.get(worker_id)
        tier = None if w is None else w.tiers.get(medium)
        if tier is not None:
            tier.remove(hashes)

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything ``worker_id`` holds (restart, ``AllBlocksCleared``, lost events),
        lower tiers included. Its capacities and event mode are kept."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        for tier in w.tiers.values():
            tier.blocks.clear()
        w.entries.clear()
        w.epoch = next(self._epochs)
        w.removals += 1
        w.cleared_at = w.removals
        w.removed.clear()
        for q in w.queues.values():
            q.clear()
        w.reset_chains()

    # -- internals --------------------------------------------------------------------------

    def _tier(self, w: _WorkerBlocks, medium: str) -> _Tier:
        tier = w.tiers.get(medium)
        if tier is None:
            tier = w.tiers[medium] = _Tier(self._default_tier_capacity)
            self.has_lower_tiers = True
        return tier

    def _worker(self, worker_id: str) -> _WorkerBlocks:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _WorkerBlocks(self._default_capacity,
                                                         next(self._epochs))
        return w

    @staticmethod
    def _repeated(
        w: _WorkerBlocks, hashes: Sequence[BlockHash], old: list[_Stamp | None], stamp: _Stamp
    ) -> None:
        """A hash occurred more than once in one call, which the batch updates do not order as
        one ``move_to_end`` per block would: redo the call's blocks one at a time. A block
        confirmed before the call stays confirmed; every other one ends with ``stamp``."""
        was_confirmed = {h for h, o in zip(hashes, old, strict=True) if o is _CONFIRMED}
        w.walk = True  # chained hashes never repeat: no chain structure to rely on
        entries = w.entries
        for h in reversed(hashes):  # last to first, as the batch updates touch them
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
            olds = list(map(entries.pop, victims))
            w.unqueue(victims)
            w.unlink(victims, olds)

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
                w.unlink(expired, list(map(entries.pop, expired)))


class _Positions:
    """Where each hash of one query sits, built on first use (only a ghost check needs it)."""

    __slots__ = ("_hashes", "_map")

    def __init__(self, hashes: Sequence[BlockHash]) -> None:
        self._hashes = hashes
        self._map: dict[BlockHash, int] | None = None

    def get(self) -> dict[BlockHash, int]:
        if self._map is None:
            n = len(self._hashes)  # reversed: a hash's first position wins
            self._map = dict(zip(reversed(self._hashes), range(n - 1, -1, -1), strict=True))
        return self._map


def _walk(
    entries: OrderedDict[BlockHash, _Stamp],
    hashes: Sequence[BlockHash],
    now: float,
    recent_learned: float,
) -> tuple[int, int]:
    """The linear walk: (blocks held before the first miss, pending among them). The reference
    the search must equal, and its fallback where the search's invariants do not hold."""
    matched = pending = 0
    for h in hashes:
        e = entries.get(h)
        if e is None or e.expires_at <= now:
            break
        matched += 1
        if e.source == SPECULATIVE or (e.source == LEARNED and e.expires_at > recent_learned):
            pending += 1
    return matched, pending


def _search(
    w: _WorkerBlocks, hashes: Sequence[BlockHash], recent_learned: float, positions: _Positions
) -> tuple[int, int] | None:
    """``_walk``'s answer in O(log n) lookups, or ``None`` where it must walk (a block is held
    at a place in ``hashes`` that is not its place in a chain, or an unanchored ghost is on the
    way). Needs: expired entries reclaimed, one tentative source, ``w.walk`` false."""
    entries, parent = w.entries, w.parent
    get = entries.get
    n = len(hashes)
    first = get(hashes[0])
    if first is None:
        return 0, 0
    if hashes[0] in parent:
        return None
    # 1. the first block not held, were the held blocks of the chain a prefix of it
    last = get(hashes[n - 1])
    if last is not None:
        if n > 1 and parent.get(hashes[n - 1]) != hashes[n - 2]:
            return None
        held = n
    else:
        lo, hi = 1, n - 1  # hashes[lo - 1] held, hashes[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if get(hashes[mid]) is None:
                hi = mid
            elif parent.get(hashes[mid]) != hashes[mid - 1]:
                return None
            else:
                lo = mid + 1
        held = lo
    # 2. a ghost before it: every block not held that has a held descendant is one
    ghosts = w.ghosts
    if ghosts and held > 1:
        if len(ghosts) < held:
            where = positions.get()
            hits = [i for i in map(where.get, ghosts) if i is not None and i < held]
        else:
            hits = list(compress(range(held), map(ghosts.__contains__, islice(hashes, held))))
        if hits:
            unanchored = w.unanchored
            if unanchored and any(hashes[i] in unanchored for i in hits):
                return None
            held = min(hits)
    # 3. pending: confirmed blocks first, then tentative ones, newest routed first
    if w.violations:
        stamps = list(map(entries.__getitem__, islice(hashes, held)))
        return held, sum(stamps.count(s) for s in set(stamps) if _pending(s, recent_learned))
    last = entries[hashes[held - 1]]
    if last is _CONFIRMED:
        return held, 0
    confirmed = 0
    if first is _CONFIRMED:
        lo, hi = 1, held - 1  # hashes[lo - 1] confirmed, hashes[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if entries[hashes[mid]] is _CONFIRMED:
                lo = mid + 1
            else:
                hi = mid
        confirmed = lo
    if entries[hashes[confirmed]].source == SPECULATIVE:
        return held, held - confirmed
    if not _pending(entries[hashes[confirmed]], recent_learned):
        return held, 0
    if _pending(last, recent_learned):
        return held, held - confirmed
    lo, hi = confirmed + 1, held - 1  # hashes[lo - 1] pending, hashes[hi] not
    while lo < hi:
        mid = (lo + hi) // 2
        if _pending(entries[hashes[mid]], recent_learned):
            lo = mid + 1
        else:
            hi = mid
    return held, lo - confirmed


def _pending(s: _Stamp, recent_learned: float) -> bool:
    return s.source == SPECULATIVE or (s.source == LEARNED and s.expires_at > recent_learned)
