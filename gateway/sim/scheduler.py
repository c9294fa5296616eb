"""Continuous-batching scheduler of the simulated worker: vLLM v1's ``Scheduler.schedule`` without
the model.

Pure and synchronous (no clock, no asyncio), so tests drive it step by step. One engine step:

1. **Running requests first**, in arrival order. Each asks for all the tokens it has not yet
   computed (a decode asks for 1, a prefill the rest of its prompt), capped by the step's token
   budget (``max_num_batched_tokens``): that cap is chunked prefill. If the KV cache cannot give
   the slots, the *newest* running request is preempted (recompute mode: its blocks are freed,
   its computed-token count reset, and it goes to the front of the waiting queue) until the
   allocation succeeds or the request has preempted itself.
2. **Then waiting requests**, strictly first-come first-served, but only when no request was
   preempted in this step, while the budget lasts and fewer than ``max_num_seqs`` run. A
   request's cached prefix is looked up (``KVCacheManager.get_computed_blocks``); it is admitted
   only if its whole current sequence fits in the free blocks (vLLM's
   ``scheduler_reserve_full_isl``); the first that does not fit blocks the queue.
3. After the step has run (the engine sleeps for its modelled duration), every scheduled
   request whose computed tokens caught up with its known tokens samples one token; a request
   stops at ``max_tokens``, at ``max_model_len``, or on EOS (never, unless an EOS probability is
   configured and ``ignore_eos`` is off). Finished requests free their blocks.

Cost of a step (``StepPlan``): the prompt tokens computed in it (``prefill_tokens``, cached ones
excluded: they cost nothing) and, for the requests decoding, the KV tokens the decode reads
(``decode_kv_tokens`` = sum of each decoding request's context). The engine turns both into time
with the cost model (see ``gateway.sim.costmodel``).

KV transfer (prefill/decode disaggregation, ``gateway.sim.kvtransfer``), as vLLM's scheduler
runs it with the NIXL connector: a request with ``kv_hold`` (a prefill for a remote decode) does
not free its blocks when it finishes; they stay referenced (not free, not evictable) in
``held`` until ``release_held`` (pulled, or the lease expired). A request with ``remote_kv`` (its
prompt's KV was pulled from a producer) is admitted with every prompt token its local prefix
cache lacks counted as computed (``external`` tokens, vLLM's ``get_num_new_matched_tokens``),
minus the last token, recomputed for its logits; its blocks are cached as computed ones are.

CPU tier (``SchedulerConfig.cpu_offload_blocks``, vLLM's native offloading): a waiting request's
lookup continues past its GPU hit into the CPU tier (``kvcache.CpuOffloadCache.lookup``); those
blocks are admitted as computed (external tokens, as above), counted in ``StepPlan.reload_tokens``
for the engine to charge their load, and cached on the GPU as computed blocks are. vLLM loads
them asynchronously (the request waits while others step); the sim charges the load to the step
that admits the request, a little conservative for the others in it.

Generated tokens are deterministic: each request carries a ``random.Random`` seeded from the
worker seed and the request (its ``seed`` field, else its prompt), so the same request on the
same worker always produces the same tokens, and therefore the same decode-block hashes.
"""

from __future__ import annotations

import enum
import random
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.sim.kvcache import (
    BlockHash,
    KVCacheManager,
    KVEvent,
    SimLora,
    block_hashes_for,
    first_block_extra_keys,
    hash_block_tokens,
    none_hash,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class SamplingSpec:
    """What decides a request's generated tokens and when it stops."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_probability: float = 0.0
    eos_token_id: int = 2
    seed: int = 0
    vocab_low: int = 16
    vocab_high: int = 32000
    token_pool: tuple[int, ...] = ()
    """When set, generated ids are drawn from these (a real tokenizer's valid ids) instead."""
    forced_token_ids: tuple[int, ...] = ()
    """When set, the output is these tokens then EOS (what structured outputs constrain a model
    to: a tool call's JSON arguments, a JSON answer)."""


class SimRequest:
    """One sequence in the scheduler: prompt, outputs, computed-token count, block hashes."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingSpec,
        *,
        block_size_tokens: int,
        root_hash: BlockHash,
        arrival_time: float = 0.0,
        lora: SimLora | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.lora = lora
        self.cache_salt = cache_salt
        self._extra = None if lora is None else lora.extra_keys
        self._first_extra = first_block_extra_keys(self._extra, cache_salt)
        self.request_id = request_id
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self._bs = block_size_tokens
        self._root = root_hash
        self.block_hashes: list[BlockHash] = block_hashes_for(
            self.token_ids, block_size_tokens, root_hash, self._extra, self._first_extra
        )
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        """Prefix-cache hit of the first admission, local plus external tokens (what
        ``prompt_tokens_details`` reports)."""
        self.kv_hold = False
        """Keep the blocks when finished, for a remote decode to pull (``do_remote_decode``)."""
        self.remote_kv = False
        """The prompt's KV was pulled from a producer: admit it as computed (once)."""
        self.remote_cached_tokens: int | None = None
        """The producer's prefix-cache hit, reported in ``usage`` instead of the local one."""
        self.skip_reading_prefix_cache = False
        """vLLM's: the prompt is computed whole, from no cache tier (it asked for its logprobs)."""
        self.finish_reason: str | None = None
        self.arrival_time = arrival_time
        self._rng = random.Random(sampling.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        n = len(self.token_ids)
        if n % self._bs == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = self._extra if parent is not None else self._first_extra
            self.block_hashes.append(
                hash_block_tokens(parent, self.token_ids[n - self._bs :], self._root, extra)
            )

    def sample(self) -> tuple[int, bool]:
        """The next token and whether it is EOS."""
        s = self.sampling
        if s.forced_token_ids:
            done = self.num_output_tokens
            if done < len(s.forced_token_ids):
                return s.forced_token_ids[done], False
            return s.eos_token_id, True
        if (
            not s.ignore_eos
            and s.eos_probability > 0.0
            and self.num_output_tokens + 1 >= max(s.min_tokens, 1)
            and self._rng.random() < s.eos_probability
        ):
            return s.eos_token_id, True
        if s.token_pool:
            return s.token_pool[self._rng.randrange(len(s.token_pool))], False
        return self._rng.randrange(s.vocab_low, s.vocab_high), False


def request_seed(
    worker_seed: int, request_seed: int | None, prompt_token_ids: Sequence[int]
) -> int:
    """Seed of a request's token generator: its own ``seed``, else its prompt."""
    if request_seed is not None:
        return (worker_seed * 1_000_003 + request_seed) & 0xFFFFFFFF
    digest = zlib.crc32(b"".join(t.to_bytes(4, "little", signed=False) for t in prompt_token_ids))
    return (worker_seed * 1_000_003 + digest) & 0xFFFFFFFF


@dataclass(frozen=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size_tokens: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    """A prefill's tokens per step at most, while another request runs or waits (vLLM's cap,
    ``Scheduler.schedule``: not applied to a request alone); 0: no cap."""
    max_model_len: int = 131072
    enable_prefix_caching: bool = True
    record_events: bool = False
    hash_seed: str | None = None
    has_connector: bool = False
    """A KV connector is configured: external prefix-cache stats are kept (vLLM keeps them for
    every request on such a worker)."""
    cpu_offload_blocks: int = 0
    """The CPU tier's blocks (vLLM's ``--kv-offloading-size``, ``kvcache.CpuOffloadCache``);
    0: none. A CPU tier is a connector too: its hits are external tokens."""
    cpu_offload_self_describing_events: bool = False
    """vLLM's ``kv_connector_extra_config.self_describing_kv_events``: full CPU-tier
    ``BlockStored`` payloads instead of placeholders."""
    cpu_reload_s_per_token: float = 0.0
    """Modelled seconds to load one token's KV from the CPU tier (KV bytes / host link)."""


@dataclass
class ScheduledChunk:
    request: SimRequest
    num_new_tokens: int
    is_decode: bool


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_kv_tokens: int = 0
    num_decode_requests: int = 0
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    reload_tokens: int = 0
    """Tokens loaded from the CPU tier in this step instead of computed."""

    @property
    def empty(self) -> bool:
        return not self.chunks

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepOutput:
    request: SimRequest
    token_id: int
    finish_reason: str | None
    first_token: bool


@dataclass
class PrefixCacheStats:
    """vLLM's split: first admissions feed ``vllm:prefix_cache_*``; re-admissions after a
    preemption are counted apart and never exported under those names."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    preempted_requests: int = 0
    external_queries: int = 0
    """vLLM's connector stats: tokens the local cache lacked, at each first admission."""
    external_hits: int = 0
    """...of which loaded from a remote producer."""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size_tokens,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            record_events=config.record_events,
            cpu_offload_blocks=config.cpu_offload_blocks,
            cpu_self_describing_events=config.cpu_offload_self_describing_events,
        )
        self.root_hash = none_hash(config.hash_seed)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.held: dict[str, SimRequest] = {}
        """Finished ``kv_hold`` requests whose blocks wait to be pulled."""
        self.prefix_stats = PrefixCacheStats()
        self.num_preemptions = 0

    # -- requests ---------------------------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingSpec,
        arrival_time: float = 0.0,
        lora: SimLora | None = None,
        cache_salt: str | None = None,
    ) -> SimRequest:
        return SimRequest(
            request_id,
            prompt_token_ids,
            sampling,
            block_size_tokens=self.config.block_size_tokens,
            root_hash=self.root_hash,
            arrival_time=arrival_time,
            lora=lora,
            cache_salt=cache_salt,
        )

    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> SimRequest | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FINISH_ABORT
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Block ids a held request keeps, in order (vLLM's ``remote_block_ids``)."""
        if request_id not in self.held:
            return []
        return [b.block_id for b in self.kv.req_to_blocks.get(request_id, [])]

    def release_held(self, request_id: str) -> bool:
        """Free a held request's blocks (pulled, or its lease expired); False if not held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        kv = self.kv
        # vLLM's long_prefill_token_threshold: nobody to starve when one request is alone
        cap = (cfg.long_prefill_token_threshold
               if len(self.running) + len(self.waiting) > 1 else 0)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if 0 < cap < num_new:
                num_new = cap
            num_new = min(num_new, budget)
            num_new = min(num_new, cfg.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            scheduled = True
            while not kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            is_decode = (
                num_new == 1
                and request.num_output_tokens > 0
                and request.num_computed_tokens == request.num_tokens - 1
            )
            self._add_chunk(plan, request, num_new, is_decode)
            budget -= num_new
            i += 1

        cpu = kv.cpu
        if not plan.preempted:
            while budget > 0 and self.waiting and len(self.running) < cfg.max_num_seqs:
                request = self.waiting[0]
                computed_blocks, hit_tokens = kv.get_computed_blocks(request)
                external = reloaded = 0
                if request.remote_kv and request.num_preemptions == 0:
                    external = max(request.num_prompt_tokens - hit_tokens, 0)
                elif cpu is not None and not request.skip_reading_prefix_cache:
                    bs = cfg.block_size_tokens
                    reloaded = external = bs * cpu.lookup(
                        request.block_hashes, hit_tokens // bs, (request.num_tokens - 1) // bs)
                computed = min(hit_tokens + external, request.num_tokens - 1)
                num_new = request.num_tokens - computed
                if 0 < cap < num_new:
                    num_new = cap
                num_new = min(num_new, budget)
                if not kv.allocate_slots(
                    request, computed - hit_tokens + num_new, computed_blocks,
                    full_sequence_must_fit=True,
                ):
                    break
                self._record_lookup(request, hit_tokens, external)
                request.remote_kv = False  # one transfer per request, as vLLM's connector
                if reloaded and cpu is not None:
                    plan.reload_tokens += reloaded
                    cpu.loaded_blocks += reloaded // cfg.block_size_tokens
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = computed
                plan.admitted.append(request)
                self._add_chunk(plan, request, num_new, False)
                budget -= num_new

        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
        return plan

    def update_from_output(self, plan: StepPlan) -> list[StepOutput]:
        """Sample one token for every request whose known tokens are all computed."""
        outputs: list[StepOutput] = []
        finished: list[SimRequest] = []
        max_len = self.config.max_model_len
        for chunk in plan.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that is not the last one
            first = request.num_output_tokens == 0
            token_id, is_eos = request.sample()
            request.append_token(token_id)
            # vLLM's check_stop tests the length caps before EOS.
            reason: str | None = None
            if (
                request.num_output_tokens >= request.sampling.max_tokens
                or request.num_tokens >= max_len
            ):
                reason = FINISH_LENGTH
            elif is_eos:
                reason = FINISH_STOP
            if reason is not None:
                request.finish_reason = reason
                finished.append(request)
            outputs.append(StepOutput(request, token_id, reason, first))
        for request in finished:
            self.running.remove(request)
            self.requests.pop(request.request_id, None)
            request.status = RequestStatus.FINISHED
            if request.kv_hold:
                self.held[request.request_id] = request
            else:
                self.kv.free(request.request_id)
        return outputs

    def take_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()

    # -- helpers ----------------------------------------------------------------------------

    def _add_chunk(
        self, plan: StepPlan, request: SimRequest, num_new: int, is_decode: bool
    ) -> None:
        plan.chunks.append(ScheduledChunk(request, num_new, is_decode))
        if is_decode:
            plan.num_decode_requests += 1
            plan.decode_kv_tokens += request.num_computed_tokens + 1
        else:
            plan.prefill_tokens += num_new

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _record_lookup(self, request: SimRequest, hit_tokens: int, external: int = 0) -> None:
        stats = self.prefix_stats
        if (self.config.has_connector or self.kv.cpu is not None) \
                and request.num_preemptions == 0:
            stats.external_queries += request.num_tokens - hit_tokens
            stats.external_hits += external
            request.num_cached_tokens = hit_tokens + external
        if not self.config.enable_prefix_caching:
            return
        if request.num_preemptions > 0:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += hit_tokens
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += hit_tokens
            request.num_cached_tokens = hit_tokens + external
