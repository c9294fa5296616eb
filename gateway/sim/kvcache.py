"""Paged KV cache with block-level prefix caching, following vLLM v1 (0.32) rule for rule.

The simulator's prefix-hit counts must equal a real vLLM server's for the same request sequence
(the lead's calibration test sends one sequence to both), so this module copies vLLM's
``BlockPool`` / ``KVCacheManager`` / ``FullAttentionManager`` behaviour instead of inventing a
cleaner cache. The rules, with vLLM's names:

* **Blocks.** ``num_gpu_blocks`` blocks of ``block_size_tokens`` slots. Block 0 is vLLM's *null
  block*: taken out of the free queue at start, never allocated, so ``num_gpu_blocks - 1`` blocks
  hold KV and usage is ``1 - free / (num_gpu_blocks - 1)``.
* **Hashes.** Only full blocks are hashed: ``h_i = sha256(pickle((h_{i-1} or NONE_HASH,
  tuple(block_tokens), None)))`` with ``NONE_HASH = sha256(pickle(seed))`` and seed
  ``"vllm-none-hash"`` (vLLM's default, or ``PYTHONHASHSEED`` when vLLM has it set). The hashes
  are therefore the engine's own; events carry the last 8 bytes as an unsigned 64-bit int, as
  vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default).
* **Lookup.** A new request's hit is the longest run of cached full blocks from the start, over
  at most ``num_tokens - 1`` tokens: the last prompt token is always recomputed for its logits,
  and because allocation is block-aligned a fully cached prompt recomputes its whole last block.
  Hits are counted in tokens, once, at admission, and only for requests never preempted
  (a resumed request's lookup goes to vLLM's separate ``preempted_*`` stats).
* **Caching.** When a step is scheduled, every block that becomes full through the tokens
  scheduled in it is cached (``cache_full_blocks``) and announced in one ``BlockStored``. The
  cache does not de-duplicate: a recomputed block whose hash is already cached gets a second
  entry (and a second ``BlockStored``), exactly like vLLM's ``BlockHashToBlockMap``.
* **Ref counts and eviction.** Blocks in use have ``ref_cnt > 0``; a hit ``touch``-es its blocks
  (taking them off the free queue if they were idle). A finished or preempted request frees its
  blocks in reverse order: uncached ones go to the *front* of the free queue (reused first),
  cached ones to the *back* (evicted last, so the queue is an LRU of idle cached blocks, tail
  blocks of a sequence before its head). Allocation pops from the front; a popped block that
  still has a hash is evicted from the cache (one ``BlockRemoved`` per block).
* **Admission.** ``allocate_slots`` refuses (returns False) unless the free queue, evictable
  blocks included, holds every block the step needs; with ``full_sequence_must_fit`` (vLLM's
  ``scheduler_reserve_full_isl``, default on) a new request must fit its whole current sequence,
  not only its first chunk.

* **CPU tier** (``CpuOffloadCache``, vLLM's ``--kv-offloading-size``): cached blocks are
  written through to a CPU LRU; a new request's GPU miss continues there, and its hits are
  loaded instead of computed. Its events carry medium ``"CPU"`` (see the class).

Cost: lookup and caching are O(blocks) dictionary operations plus one SHA-256 per full block
(about 3 us each), so a 32K-token prompt at 16-token blocks costs a few ms of hashing, done once
per request as tokens arrive. Trade-off: exactness over speed; a simulator that hashed with
``hash()`` would be faster but could not be checked against vLLM's own events byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
FULL_ATTENTION = "full_attention"

BlockHash = bytes


def none_hash(seed: str | None = None) -> BlockHash:
    """vLLM's ``NONE_HASH``: the parent hash of every first block."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@dataclass(frozen=True)
class SimLora:
    """A loaded LoRA adapter: vLLM's ``LoRARequest`` (name, int id, path)."""

    name: str
    lora_id: int
    path: str

    @property
    def extra_keys(self) -> tuple[tuple[str, str, str], ...]:
        """What vLLM adds to every block hash of its requests (``_gen_lora_extra_hash_keys``)."""
        return (("lora", self.name, self.path),)


def hash_block_tokens(
    parent: BlockHash | None, block_token_ids: Sequence[int], root: BlockHash,
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """vLLM's ``hash_block_tokens`` with the default ``sha256`` (pickle) algorithm; a LoRA
    request's blocks carry the adapter in ``extra_keys``, so they are its own."""
    payload = (parent or root, tuple(block_token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external_hash(block_hash: BlockHash) -> int:
    """The 64-bit form vLLM publishes in KV events (last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


def block_hashes_for(
    token_ids: Sequence[int], block_size_tokens: int, root: BlockHash,
    extra_keys: tuple[object, ...] | None = None,
    first_extra_keys: tuple[object, ...] | None = None,
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids``; ``first_extra_keys``: the first
    block's own (``first_block_extra_keys``), ``extra_keys`` where None."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size_tokens + 1, block_size_tokens):
        extra = first_extra_keys if start == 0 and first_extra_keys is not None else extra_keys
        parent = hash_block_tokens(parent, token_ids[start : start + block_size_tokens], root,
                                   extra)
        hashes.append(parent)
    return hashes


def first_block_extra_keys(
    extra_keys: tuple[object, ...] | None, cache_salt: str | None,
) -> tuple[object, ...] | None:
    """The extra keys of a prompt's first block: vLLM appends ``("cache_salt", salt)`` to the
    adapter's there and only there (``generate_block_hash_extra_keys``), so a salted prompt
    shares no block with another salt's or an unsalted one."""
    if cache_salt is None:
        return extra_keys
    return (*(extra_keys or ()), ("cache_salt", cache_salt))


# --- events (plain values; gateway.sim.kvevents encodes them in vLLM's wire format) ---------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int  # 0 with no tokens: the offloading connector's placeholder (CPU medium)
    lora: SimLora | None = None  # the adapter of the request that stored them
    medium: str = MEDIUM_GPU
    # The request's cache_salt when the first block stored is the prompt's first (no parent):
    # vLLM publishes it in that block's extra keys.
    cache_salt: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class _FreeQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` (eviction order, front first) without a node per block.

    The queue is ``front + never-used ids + back``: blocks freed without a hash are prepended to
    ``front``, cached ones appended to ``back``, and the ids no request has touched yet stay an
    integer range in the middle, so an idle worker with a large cache costs no memory per block.
    """

    __slots__ = ("_back", "_end", "_front", "_next_unused")

    def __init__(self, first_id: int, end_id: int) -> None:
        self._front: OrderedDict[int, None] = OrderedDict()
        self._back: OrderedDict[int, None] = OrderedDict()
        self._next_unused = first_id
        self._end = end_id

    def __len__(self) -> int:
        return len(self._front) + (self._end - self._next_unused) + len(self._back)

    def popleft(self) -> int:
        if self._front:
            return self._front.popitem(last=False)[0]
        if self._next_unused < self._end:
            self._next_unused += 1
            return self._next_unused - 1
        return self._back.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        if block_id in self._front:
            del self._front[block_id]
        else:
            del self._back[block_id]

    def prepend(self, block_id: int) -> None:
        self._front[block_id] = None
        self._front.move_to_end(block_id, last=False)

    def append(self, block_id: int) -> None:
        self._back[block_id] = None

    def ids(self) -> list[int]:
        return [*self._front, *range(self._next_unused, self._end), *self._back]


class BlockPool:
    """Blocks, the free queue (eviction order) and the hash -> blocks map."""

    def __init__(
        self, num_gpu_blocks: int, block_size_tokens: int, *, record_events: bool = False
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size_tokens = block_size_tokens
        self.record_events = record_events
        # Block objects are made on first use; block 0 (the null block) never is.
        self._blocks: dict[int, Block] = {}
        self._free = _FreeQueue(1, num_gpu_blocks)
        # Insertion-ordered so that, like vLLM, the first cached copy of a hash is the one hit.
        self._cached: dict[BlockHash, dict[int, Block]] = {}
        self._events: list[KVEvent] = []

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: blocks referenced by requests / usable blocks."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        entry = self._cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (front first); for tests and debugging."""
        return self._free.ids()

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    # -- mutation ---------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out: list[Block] = []
        for _ in range(n):
            block_id = self._free.popleft()
            block = self._blocks.get(block_id)
            if block is None:
                block = self._blocks[block_id] = Block(block_id)
            self._maybe_evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Release one reference each; ``ordered`` is in eviction priority (first = first out)."""
        evict_first: list[Block] = []
        evict_last: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (evict_first if block.block_hash is None else evict_last).append(block)
        for block in reversed(evict_first):
            self._free.prepend(block.block_id)
        for block in evict_last:
            self._free.append(block.block_id)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        lora: SimLora | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        bs = self.block_size_tokens
        new_hashes: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block_hash = block_hashes[i]
            if block.block_hash is None:
                block.block_hash = block_hash
                self._cached.setdefault(block_hash, {})[block.block_id] = block
            new_hashes.append(external_hash(block_hash))
        if self.record_events:
            parent = (
                external_hash(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None
            )
            self._events.append(
                BlockStored(
                    block_hashes=tuple(new_hashes),
                    parent_block_hash=parent,
                    token_ids=tuple(token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                    block_size=bs,
                    lora=lora,
                    cache_salt=None if num_cached_blocks else cache_salt,
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as in vLLM."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        for block in self._blocks.values():
            block.block_hash = None
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _maybe_evict(self, block: Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        entry = self._cached.get(block_hash)
        if entry is not None and entry.pop(block.block_id, None) is not None:
            if not entry:
                del self._cached[block_hash]
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=(external_hash(block_hash),)))
        block.block_hash = None


class CpuOffloadCache:
    """vLLM's native CPU offloading (``--kv-offloading-size``: the ``OffloadingConnector`` with
    its CPU manager and LRU policy, one GPU block per offloaded chunk), as the sim keeps it.

    * **Store (write-through).** Every block the GPU cache caches is stored to the CPU too, as
      vLLM's ``_build_store_jobs`` offloads the blocks each step computed
      (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``); a block already
      there moves to the most-recently-used end and is not announced again. Room is made by
      evicting least-recently-used blocks other than the ones being stored (the manager's
      ``protected`` keys); when even that cannot make room, nothing of the call is stored (its
      ``prepare_store`` returns None). vLLM announces a store when the transfer completes, a
      step or so later; the sim, at once.
    * **Lookup.** From the first block the GPU cache lacks, the run of consecutive blocks held
      here (``_maximal_prefix_lookup``), capped as the GPU lookup is (the last prompt token is
      recomputed); hits move to the most-recently-used end. The scheduler loads them instead of
      computing them (``external`` tokens) and the engine charges their KV bytes over the host
      link (``cpu_reload_s_per_token``).
    * **Events** (``offloading/events.py``, with medium ``"CPU"``, after the step's GPU events
      as vLLM's scheduler appends the connector's): one ``BlockRemoved`` listing every block a
      store evicted, then one ``BlockStored`` per stored block: by default a placeholder (the
      block's hash, no parent, no tokens, ``block_size`` 0), with ``self_describing`` the full
      payload (parent, tokens, ``block_size``, the adapter's name).

    Cost: O(blocks) dictionary operations per store and lookup; memory, one entry per block.
    """

    def __init__(self, capacity_blocks: int, block_size_tokens: int, *,
                 record_events: bool = False, self_describing: bool = False) -> None:
        if capacity_blocks < 1:
            raise ValueError("a CPU tier needs at least one block")
        self.capacity_blocks = capacity_blocks
        self.block_size_tokens = block_size_tokens
        self.record_events = record_events
        self.self_describing = self_describing
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._events: list[KVEvent] = []
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hashes: Sequence[BlockHash], start: int, limit: int) -> int:
        """Blocks ``block_hashes[start:limit]`` held here, consecutively from ``start``."""
        hits = 0
        for block_hash in block_hashes[start:limit]:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            hits += 1
        return hits

    def store(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        start: int,
        end: int,
        lora: SimLora | None = None,
    ) -> None:
        """Offload blocks ``start..end`` of a sequence (just cached on the GPU)."""
        blocks = self._blocks
        new: list[int] = []
        for i in range(start, end):
            if block_hashes[i] in blocks:
                blocks.move_to_end(block_hashes[i])
            else:
                new.append(i)
        if not new:
            return
        excess = len(blocks) + len(new) - self.capacity_blocks
        evicted: list[BlockHash] = []
        if excess > 0:
            protected = set(block_hashes[start:end])
            evicted = [h for h in islice(blocks, excess + len(protected)) if h not in protected]
            if len(evicted) < excess:
                return  # cannot make room: nothing of this call is stored (vLLM's None)
            evicted = evicted[:excess]
            for block_hash in evicted:
                del blocks[block_hash]
            self.evicted_blocks += len(evicted)
        for i in new:
            blocks[block_hashes[i]] = None
        self.stored_blocks += len(new)
        if not self.record_events:
            return
        if evicted:
            self._events.append(BlockRemoved(tuple(external_hash(h) for h in evicted),
                                             medium=MEDIUM_CPU))
        bs = self.block_size_tokens
        for i in new:
            if self.self_describing:
                parent = external_hash(block_hashes[i - 1]) if i else None
                self._events.append(BlockStored(
                    (external_hash(block_hashes[i]),), parent,
                    tuple(token_ids[i * bs : (i + 1) * bs]), bs, lora, medium=MEDIUM_CPU))
            else:
                self._events.append(BlockStored(
                    (external_hash(block_hashes[i]),), None, (), 0, medium=MEDIUM_CPU))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class CachedSequence(Protocol):
    """What the cache manager reads from a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """Prompt then output tokens."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Hashes of every full block of ``token_ids``."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a ``BlockPool`` (vLLM's KVCacheManager, one full-attention group)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size_tokens: int,
        *,
        max_model_len: int,
        enable_caching: bool = True,
        record_events: bool = False,
        cpu_offload_blocks: int = 0,
        cpu_self_describing_events: bool = False,
    ) -> None:
        self.block_size_tokens = block_size_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_gpu_blocks, block_size_tokens, record_events=record_events)
        self.cpu: CpuOffloadCache | None = None
        """The CPU tier (vLLM's ``--kv-offloading-size``); None: GPU only."""
        if cpu_offload_blocks > 0 and enable_caching:
            self.cpu = CpuOffloadCache(cpu_offload_blocks, block_size_tokens,
                                       record_events=record_events,
                                       self_describing=cpu_self_describing_events)
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_computed_blocks(self, seq: CachedSequence) -> tuple[list[Block], int]:
        """The cached prefix of a new (or preempted) request: blocks and hit tokens."""
        if not self.enable_caching or getattr(seq, "skip_reading_prefix_cache", False):
            return [], 0  # (vLLM's ``can_read_prefix_cache``)
        # The last token is always recomputed to get logits; allocation is block-aligned, so a
        # fully cached sequence recomputes its last block.
        max_hit_tokens = len(seq.token_ids) - 1
        hit: list[Block] = []
        for block_hash in seq.block_hashes[: max_hit_tokens // self.block_size_tokens]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size_tokens

    def allocate_slots(
        self,
        seq: CachedSequence,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Block] = (),
        *,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens; False if blocks run out."""
        bs = self.block_size_tokens
        req_blocks = self.req_to_blocks.get(seq.request_id, [])
        num_computed = seq.num_computed_tokens + len(new_computed_blocks) * bs
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        have = len(req_blocks) + len(new_computed_blocks)
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            full_tokens = min(len(seq.token_ids), self.max_model_len)
            if max(_cdiv(full_tokens, bs) - have, 0) + evictable > free:
                return False
        need_slots = min(num_computed + num_new_tokens, self.max_model_len)
        if max(_cdiv(need_slots, bs) - have, 0) + evictable > free:
            return False

        req_blocks = self.req_to_blocks.setdefault(seq.request_id, req_blocks)
        if seq.request_id not in self.num_cached_block:
            self.pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[seq.request_id] = len(req_blocks)
        missing = _cdiv(need_slots, bs) - len(req_blocks)
        if missing > 0:
            req_blocks.extend(self.pool.get_new_blocks(missing))
        if self.enable_caching:
            num_full = min(num_computed + num_new_tokens, len(seq.token_ids)) // bs
            already = self.num_cached_block[seq.request_id]
            lora = getattr(seq, "lora", None)  # SimRequest's adapter; plain sequences have none
            self.pool.cache_full_blocks(
                req_blocks,
                seq.block_hashes,
                seq.token_ids,
                already,
                num_full,
                lora,
                getattr(seq, "cache_salt", None),
            )
            if self.cpu is not None and num_full > already:
                self.cpu.store(seq.block_hashes, seq.token_ids, already, num_full, lora)
            self.num_cached_block[seq.request_id] = max(
                num_full, self.num_cached_block[seq.request_id]
            )
        return True

    def free(self, request_id: str) -> None:
        """Release a finished/preempted request's blocks, tail first (tail evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def take_events(self) -> list[KVEvent]:
        """The step's events: the GPU cache's, then the CPU tier's (vLLM's order)."""
        events = self.pool.take_events()
        if self.cpu is not None:
            events += self.cpu.take_events()
        return events
