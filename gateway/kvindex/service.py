"""PrefixIndex: the facade the Router calls — prompt tokens in, cached tokens per worker out.

One ``BlockIndex`` for all workers, plus one ``KvEventSubscriber`` per worker that publishes KV
events. Per routing decision the Router calls ``cached_tokens`` (hash the prompt once per distinct
block size among the candidates, then one prefix match per candidate) and, for the chosen worker,
``record_routed`` (which reuses those hashes: the last prompt's hashes are memoized when the token
ids come as the same tuple object, as ``RoutingRequest.token_ids`` does).

Hashing costs ≈ 0.6 µs per block (one BLAKE2b call each, see ``hashing.py``): ≈ 5 ms for a
128K-token prompt at 16 tokens per block, too long for the event loop. ``hash_ahead`` therefore
runs in the thread that tokenized the prompt, right after tokenizing it, for every block size the
index knows; routing then takes those hashes (by the token tuple's identity) instead of computing
them on the loop. At most ``MAX_HASHED_AHEAD`` prompts wait there (a request refused before
routing leaves its entry behind; the oldest goes first), so the store stays bounded.

Prediction follows vLLM's rules: only full blocks are cached, and a fully cached prompt still
recomputes its last token, so at most ``(prompt_tokens - 1) // block_size`` blocks can hit.

Lower tiers (``kv_events.lower_tiers``, on by default): blocks a worker's KV connector offloaded (vLLM's
``--kv-offloading-size``: CPU) are kept per tier from the events' ``medium``; routing asks
``cached_pending_lower``, which adds the tokens past the GPU prefix a worker would reload from a
lower tier instead of recomputing (``gateway.routing.kv_aware`` prices them).

Workers with events get precise, ``confirmed`` entries, plus short-lived ``speculative`` ones at
routing time; workers without events get ``learned`` entries from routing alone (approximate mode).

With several gateway processes, a worker whose events the gateway binds for (bind mode) is bound by
the leader only, and followers subscribe to the leader's re-publication (``relay``).

What the subscribers accept comes from ``KvEventsSettings``: the message size cap, and in bind mode
the peers allowed to connect (the worker's own, from its ``KvEventsConfig``, plus ``bind_peers``),
checked by one ``PeerGate`` for the index's ZMQ context (``gateway.kvindex.peers``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

import zmq
import zmq.asyncio

from gateway.config import KvEventsSettings
from gateway.gil import SLICE_BLOCKS, yield_gil
from gateway.kvindex.events import (
    KvEventsConfig,
    KvEventSubscriber,
    SubscriberStats,
    chain_root,
)
from gateway.kvindex.hashing import BlockHash, block_hashes, block_hashes_sliced
from gateway.kvindex.index import BlockIndex, WorkerIndexStats
from gateway.kvindex.peers import PeerGate
from gateway.kvindex.relay import EventRelay

log = logging.getLogger(__name__)

MAX_HASHED_AHEAD: Final = 16
ROUTE_SLICE_BLOCKS: Final = 256
"""A started index records a longer route (4K tokens at 16 per block) a slice per loop turn
(``PrefixIndex.record_chain``): ~0.6 ms of the loop each into a full index."""


class _RouteSlices:
    """The rest of a long route, recorded a slice per loop turn (``PrefixIndex.record_chain``):
    the slices from the last to the second, then the first again. An object whose bound
    ``step`` is deferred, not a closure that deferred itself: that was a reference cycle, which
    kept the route's hashes until the garbage collector came for them."""

    __slots__ = ("_defer", "_epoch", "_hashes", "_head", "_index", "_starts", "_worker")

    def __init__(self, index: BlockIndex, worker_id: str, hashes: Sequence[BlockHash],
                 head: Sequence[BlockHash], defer: Callable[[Callable[[], None]], object]) -> None:
        self._index = index
        self._worker = worker_id
        self._hashes = hashes
        self._head = head
        self._defer = defer
        self._epoch = index.epoch(worker_id)
        self._starts = list(range(ROUTE_SLICE_BLOCKS, len(hashes), ROUTE_SLICE_BLOCKS))

    def step(self) -> None:
        index, worker_id = self._index, self._worker
        if index.epoch(worker_id) != self._epoch:
            return  # the worker was cleared or removed: the rest of the route is dropped
        if not self._starts:
            index.record_routed(worker_id, self._head)
            return
        start = self._starts.pop()
        hashes = self._hashes
        index.record_routed(worker_id, hashes[start:start + ROUTE_SLICE_BLOCKS], hashes[start - 1])
        self._defer(self.step)


_MemoKey = int | tuple[int, BlockHash]
"""A prompt's memoized hashes: by block size (plain chain), or (block size, chain root)."""


@dataclass(frozen=True)
class _WorkerSpec:
    block_size_tokens: int
    num_gpu_blocks: int | None
    events: KvEventsConfig | None


class PrefixIndex:
    """Cached-prefix lookups over a ``BlockIndex``, and the event subscribers that feed it.

    Synchronous methods do no network I/O. ``set_worker``/``remove_worker`` may be called before
    ``start()`` (subscribers open on ``start()``) or, once started, from the event loop's thread
    (subscribers open or close at once; a closing one is awaited by ``close()``). A subscriber
    that cannot open (say, the address to bind is taken) is logged and its worker is routed
    approximately (``has_events`` is False). ``close()`` is idempotent.
    """

    def __init__(
        self,
        index: BlockIndex,
        *,
        replay_timeout_s: float = 2.0,
        mapped_blocks_factor: int = 2,
        relay: EventRelay | None = None,
        settings: KvEventsSettings | None = None,
        lower_tiers: bool | None = None,
    ) -> None:
        self.index = index
        self.relay = relay
        self.settings = settings or KvEventsSettings()
        # None: the settings' ``kv_events.lower_tiers``
        self.lower_tiers = self.settings.lower_tiers if lower_tiers is None else lower_tiers
        self.replay_timeout_s = replay_timeout_s
        self.mapped_blocks_factor = mapped_blocks_factor
        self._specs: dict[str, _WorkerSpec] = {}
        self._subscribers: dict[str, KvEventSubscriber] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._context: zmq.asyncio.Context | None = None
        self._gate: PeerGate | None = None
        self._state = "new"  # new -> started -> closed
        self._memo_tokens: tuple[int, ...] | None = None
        # Hashes by block size, or by (block size, chain root) for an adapter's or a salt's chain.
        self._memo: dict[_MemoKey, list[BlockHash]] = {}
        self._block_sizes: frozenset[int] = frozenset()
        # id(token tuple) -> (that tuple, its hashes per memo key); the stored tuple keeps its
        # id from being reused. Written by tokenizing threads, taken by the loop: hence the lock.
        self._ahead: dict[int, tuple[tuple[int, ...], dict[_MemoKey, list[BlockHash]]]] = {}
        self._ahead_lock = threading.Lock()
        # Told each route's hashes after the index records it (worker, block size, hashes):
        # the replica exchange's queue (``gateway.kvindex.exchange``); None: nobody listens.
        self.on_routed: Callable[[str, int, list[BlockHash]], None] | None = None
        # Runs a callback at a later loop turn (the loop's ``call_soon``) once started: long
        # routes are then recorded in slices (``record_chain``); None: all at once.
        self._defer: Callable[[Callable[[], None]], object] | None = None

    # -- workers ----------------------------------------------------------------------------

    def set_worker(
        self,
        worker_id: str,
        block_size_tokens: int,
        num_gpu_blocks: int | None,
        events: KvEventsConfig | None,
    ) -> None:
        """Declare or update a worker. A new block size forgets what it held (the hashes change);
        a new events config replaces its subscriber."""
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        spec = _WorkerSpec(block_size_tokens, num_gpu_blocks, events)
        old = self._specs.get(worker_id)
        if old == spec:
            return
        self._specs[worker_id] = spec
        self._block_sizes = frozenset(s.block_size_tokens for s in self._specs.values())
        self.index.set_capacity(worker_id, num_gpu_blocks)
        if old is None or old.events != events or old.block_size_tokens != block_size_tokens:
            self._drop_subscriber(worker_id)
            if old is not None:  # other hashes, or confirmed entries nobody would remove any more
                self.index.clear_worker(worker_id)
            self.index.set_events(worker_id, events is not None)
            if events is not None and self._state == "started":
                self._open_subscriber(worker_id, spec)
        elif worker_id in self._subscribers:  # capacity changed: keep the map bounded to match
            self._subscribers[worker_id].applier.max_mapped_blocks = self._max_mapped(spec)

    def remove_worker(self, worker_id: str) -> None:
        self._specs.pop(worker_id, None)
        self._block_sizes = frozenset(s.block_size_tokens for s in self._specs.values())
        self._drop_subscriber(worker_id)
        self.index.remove_worker(worker_id)

    def block_sizes(self) -> dict[str, int]:
        """Each declared worker's block size in tokens (its hashes are chained per block)."""
        return {w: s.block_size_tokens for w, s in self._specs.items()}

    def has_events(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s entries are confirmed by a running KV-event subscriber."""
        sub = self._subscribers.get(worker_id)
        return sub is not None and sub.running

    # -- routing ----------------------------------------------------------------------------

    def cached_tokens(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]]
    ) -> dict[str, int]:
        """Prompt tokens each ``(worker_id, block_size_tokens)`` is believed to hold in KV cache."""
        return {w: held for w, (held, _) in self.cached_and_pending(token_ids, workers).items()}

    def cached_and_pending(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]],
        adapter: str | None = None, salt: str | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Per worker, (prompt tokens held, of which probably still being prefilled there);
        ``adapter``, ``salt``: the blocks of that LoRA adapter and ``cache_salt``
        (``events.chain_root``), not the base model's unsalted ones."""
        return {w: (held, pending) for w, (held, pending, _) in
                self.cached_pending_lower(token_ids, workers, adapter, salt).items()}

    def cached_pending_lower(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]],
        adapter: str | None = None, salt: str | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """Per worker, (prompt tokens held on the GPU, of which probably still being
        prefilled, prompt tokens past those reachable only through its lower tiers: CPU
        offload ...): what a worker would reload rather than recompute
        (``BlockIndex.match_prefix_tiers``), within the same usable blocks; 0 for the last
        while no worker has a lower tier (and the lookup costs what a GPU-only one does)."""
        result: dict[str, tuple[int, int, int]] = {}
        if not workers:
            return result
        by_size: dict[int, list[str]] = {}
        for worker_id, block_size in workers:
            by_size.setdefault(block_size, []).append(worker_id)
        tiers = self.index.has_lower_tiers
        for block_size, ids in by_size.items():
            usable = max(0, (len(token_ids) - 1) // block_size)  # vLLM recomputes the last token
            if usable == 0:
                result.update(dict.fromkeys(ids, (0, 0, 0)))
                continue
            hashes = self._hashes(token_ids, block_size, adapter, salt)
            if not tiers:
                for worker_id, (held, pending) in self.index.match_prefix_pending(
                        hashes, ids).items():
                    blocks = min(held, usable)
                    result[worker_id] = (blocks * block_size, min(pending, blocks) * block_size,
                                         0)
                continue
            for worker_id, (held, pending, reach) in self.index.match_prefix_tiers(
                    hashes, ids).items():
                blocks = min(held, usable)
                lower = min(reach, usable) - blocks
                result[worker_id] = (blocks * block_size, min(pending, blocks) * block_size,
                                     lower * block_size)
        return result

    def record_routed(
        self, worker_id: str, token_ids: Sequence[int], block_size_tokens: int,
        adapter: str | None = None, salt: str | None = None,
    ) -> None:
        """The prompt was sent to ``worker_id``: its full blocks will be cached there."""
        hashes = self._hashes(token_ids, block_size_tokens, adapter, salt)
        if hashes:
            self.record_chain(worker_id, hashes)
            if self.on_routed is not None:
                self.on_routed(worker_id, block_size_tokens, hashes)

    def record_chain(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """Record one route's chain of block hashes (``BlockIndex.record_routed``).

        Recording costs ≈ 2-3 µs per block into a full index, all of it on the event loop: 15-22
        ms for a 128K-token prompt (8,192 blocks), which every short request waiting on the loop
        would wait for too (issue 11, isolation). So, once started, a chain longer than
        ``ROUTE_SLICE_BLOCKS`` is recorded a slice per loop turn: its first slice at once (what
        a sibling request routed next matches first), then the others from the last to the
        second, each continuing the chain after the block before it, and last the first slice
        again. The index ends as one call would leave it, the tail least recently used
        (``BlockIndex``: a prompt's tail is evicted before its prefix). In between, a sibling
        request matches the first slice only (the gap before the slices recorded so far is an
        unanchored ghost: the search walks, ``BlockIndex``, "Search"). A clear or removal of
        the worker in between drops the rest of the route."""
        index = self.index
        defer = self._defer
        if defer is None or len(hashes) <= ROUTE_SLICE_BLOCKS:
            index.record_routed(worker_id, hashes)
            return
        head = hashes[:ROUTE_SLICE_BLOCKS]
        index.record_routed(worker_id, head)
        defer(_RouteSlices(index, worker_id, hashes, head, defer).step)

    def eviction_probe(
        self, worker_id: str, token_ids: Sequence[int], block_size_tokens: int,
        adapter: str | None = None, salt: str | None = None,
    ) -> Callable[[int, int], int] | None:
        """For hit accounting (``HitRecord.eviction_probe``): called at routing, returns a
        function of (predicted, delivered) cached tokens that says how many of the tokens
        predicted and not delivered were lost because the worker's events removed, after this
        call, the first block vLLM did not serve (the chain breaks there: the whole shortfall);
        0 otherwise. None for a worker without events (nothing is removed by events there). It
        holds the prompt's hashes (computed for routing already) until the answer is settled."""
        if not self.has_events(worker_id):
            return None
        hashes = self._hashes(token_ids, block_size_tokens, adapter, salt)
        index, mark = self.index, self.index.removal_mark(worker_id)

        def evicted(predicted: int, delivered: int) -> int:
            missed = delivered // block_size_tokens
            if predicted <= delivered or missed >= len(hashes):
                return 0
            return (predicted - delivered
                    if index.removed_since(worker_id, hashes[missed], mark) else 0)
        return evicted

    def hash_ahead(self, token_ids: tuple[int, ...], salt: str | None = None) -> None:
        """Hash a prompt now, for every declared block size, so that routing this very tuple
        later does not (``salt``: its ``cache_salt``'s chain). Thread-safe: meant for the thread
        that tokenized the prompt, which lets the event loop have the GIL every
        ``gateway.gil.SLICE_BLOCKS`` blocks."""
        root = None if salt is None else chain_root(None, salt)
        hashes: dict[_MemoKey, list[BlockHash]] = {
            size if root is None else (size, root):
                block_hashes_sliced(token_ids, size, root, SLICE_BLOCKS, yield_gil)
            for size in self._block_sizes}
        with self._ahead_lock:
            self._ahead[id(token_ids)] = (token_ids, hashes)
            while len(self._ahead) > MAX_HASHED_AHEAD:
                del self._ahead[next(iter(self._ahead))]

    def _hashes(self, token_ids: Sequence[int], block_size: int,
                adapter: str | None = None, salt: str | None = None) -> list[BlockHash]:
        # An adapter's or a salt's chain has a root of its own (``chain_root``).
        root = None if adapter is None and salt is None else chain_root(adapter, salt)
        # Identity, not equality: comparing two 32K tuples would cost as much as hashing them.
        if isinstance(token_ids, tuple):
            if token_ids is not self._memo_tokens:
                self._memo_tokens = token_ids
                with self._ahead_lock:
                    ahead = self._ahead.pop(id(token_ids), None)
                self._memo = {} if ahead is None else ahead[1]
            key: _MemoKey = block_size if root is None else (block_size, root)
            hashes = self._memo.get(key)
            if hashes is None:
                hashes = self._memo[key] = block_hashes(token_ids, block_size, root)
            return hashes
        return block_hashes(token_ids, block_size, root)

    # -- observing --------------------------------------------------------------------------

    def stats(self) -> dict[str, WorkerIndexStats]:
        return self.index.stats()

    def subscriber_stats(self) -> dict[str, SubscriberStats]:
        return {w: s.stats() for w, s in self._subscribers.items()}

    def subscriber(self, worker_id: str) -> KvEventSubscriber | None:
        return self._subscribers.get(worker_id)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"PrefixIndex is {self._state}")
        self._context = zmq.asyncio.Context()
        self._gate = PeerGate(self._context)
        self._gate.open()
        self._state = "started"
        self._defer = asyncio.get_running_loop().call_soon
        for worker_id, spec in self._specs.items():
            if spec.events is not None:
                self._open_subscriber(worker_id, spec)

    async def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self._defer = None
        for worker_id in list(self._subscribers):
            self._drop_subscriber(worker_id)
        if self._gate is not None:
            self._closing.update(self._gate.close_nowait())
            self._gate = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
            self._closing.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _max_mapped(self, spec: _WorkerSpec) -> int:
        capacity = spec.num_gpu_blocks or self.index.default_capacity_blocks
        # a lower tier's blocks keep their engine hashes mapped too (``events``, "Lower tiers")
        lower = self.index.default_lower_tier_capacity_blocks if self.lower_tiers else 0
        return self.mapped_blocks_factor * capacity + lower

    def _open_subscriber(self, worker_id: str, spec: _WorkerSpec) -> None:
        assert spec.events is not None and self._context is not None
        config, republish = spec.events, None
        if config.bind and self.settings.bind_peers:
            config = replace(config, peers=(*config.peers, *self.settings.bind_peers))
        if config.bind and self.relay is not None:
            if self.relay.leader:
                republish = self.relay.endpoint(worker_id)
            else:
                config = self.relay.follower_config(worker_id, config)
        sub = KvEventSubscriber(
            worker_id,
            config,
            self.index,
            spec.block_size_tokens,
            context=self._context,
            max_mapped_blocks=self._max_mapped(spec),
            replay_timeout_s=self.replay_timeout_s,
            republish=republish,
            gate=self._gate,
            max_message_bytes=self.settings.max_message_bytes,
            keep_lower_tiers=self.lower_tiers,
        )
        try:
            sub.open()
        except (zmq.ZMQError, OSError) as exc:
            # Degrade to approximate mode rather than fail the registry update.
            log.error(
                "kv events for %s: cannot open %s (%s); routing it approximately",
                worker_id,
                spec.events.endpoint,
                exc,
            )
            self.index.set_events(worker_id, False)
            return
        self._subscribers[worker_id] = sub

    def _drop_subscriber(self, worker_id: str) -> None:
        sub = self._subscribers.pop(worker_id, None)
        if sub is None:
            return
        for task in sub.close_nowait():
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
