"""Configuration of one simulated vLLM worker, and what is derived from it.

``num_gpu_blocks=None`` sizes the KV cache the way vLLM does on a GPU: the memory vLLM may use
(``gpu_memory_utilization`` of the GPU) minus the weights, divided by the bytes of one block
(``kv_bytes_per_token x block_size_tokens``). vLLM also subtracts the activation peak it
measures in a profiling run; the sim does not, so its cache is a few percent larger. A
``max_model_len`` longer than the cache can hold is shortened to fit (vLLM refuses to start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from gateway.config import Runner
from gateway.planner import parse_profile
from gateway.sim.costmodel import CostModel, PlannerCostModel

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = get_args(KVRole)
KVLoadFailurePolicy = Literal["fail", "recompute"]
KV_LOAD_FAILURE_POLICIES: tuple[str, ...] = get_args(KVLoadFailurePolicy)
DEFAULT_KV_TRANSFER_BYTES_PER_S = 25e9
"""200 Gb/s, one RDMA NIC: the link a NIXL read of one worker's KV typically gets."""
DEFAULT_CPU_OFFLOAD_BYTES_PER_S = 25e9
"""Host to GPU: PCIe Gen4 x16 in practice (or Gen5 at half its peak)."""
GIB = 1 << 30


@dataclass(frozen=True)
class SimWorkerConfig:
    model_name: str = "sim-llama-3-8b"
    """Served model name (``/v1/models``, the ``model_name`` metric label)."""
    profile: str = "llama-3-8b@h100"
    """Cost model: ``MODEL@GPU`` as ``gateway.planner.parse_profile`` reads it."""
    tokenizer: str = "simple"
    """``gateway.prompt.tokenizer.load_tokenizer`` source; the gateway must use the same."""
    block_size_tokens: int = 16
    num_gpu_blocks: int | None = None
    """KV cache blocks, block 0 included (vLLM's null block); None derives it from the GPU."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    """vLLM's ``--long-prefill-token-threshold``: a prefill computes at most this many tokens
    per step while another request runs or waits, so short prompts share the step; 0: off."""
    max_model_len: int = 131072
    time_scale: float = 1.0
    """Wall seconds per modelled second: 0.1 runs ten times faster than the modelled GPU."""
    kv_events: bool = False
    kv_events_endpoint: str | None = None
    """PUB endpoint; ``tcp://*:5557`` binds, ``tcp://127.0.0.1:5557`` connects (vLLM's rule).
    None with ``kv_events`` binds a free port on 127.0.0.1."""
    kv_replay_endpoint: str | None = None
    """ROUTER endpoint for replay (always bound); None: no replay socket."""
    seed: int = 0
    """Worker seed of generated tokens (combined with each request's seed or prompt)."""
    kv_events_topic: str = ""
    eos_probability: float = 0.0
    """Chance per generated token of EOS (``finish_reason`` "stop") unless ``ignore_eos``."""
    default_max_tokens: int | None = 256
    """Output cap of a chat request without ``max_completion_tokens``/``max_tokens``. vLLM uses
    the rest of the context, which a sim that never emits EOS would fill; None restores vLLM's
    rule. (Completions without ``max_tokens`` get vLLM's 16 either way.)"""
    gpu_memory_utilization: float = 0.9
    prefill_utilisation: float = 0.5
    """Fraction of peak FLOPs a prefill achieves (the planner's ``utilisation``)."""
    kv_dtype: str = "auto"
    step_overhead_s: float = 0.0
    """Fixed modelled cost of every step (scheduler + launch overheads)."""
    enable_prefix_caching: bool = True
    hash_seed: str | None = None
    """Seed of the block-hash chain; None is vLLM's (``PYTHONHASHSEED`` or "vllm-none-hash")."""
    runner: Runner = Runner.GENERATE
    """vLLM's ``--runner``: ``pooling`` serves the pooling routes (``gateway.sim.pooling``)
    instead of the generation routes."""
    tool_call_parser: str | None = None
    """vLLM's ``--tool-call-parser`` (with ``--enable-auto-tool-choice``): with one, a named or
    required tool choice answers ``tool_calls``; without (vLLM's default), every tool choice but
    ``none`` is refused (400), as vLLM refuses it."""
    enable_prompt_tokens_details: bool = False
    """Report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
    ``--enable-prompt-tokens-details``)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters (name, path) loaded at start (vLLM's ``--enable-lora --lora-modules
    name=path``): served under their names, listed in ``/v1/models`` with the model as parent."""
    allow_runtime_lora_updating: bool = False
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: serve ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter``."""
    kv_role: KVRole | None = None
    """vLLM's ``--kv-transfer-config`` ``kv_role`` with the NIXL connector: ``kv_producer``
    (prefill), ``kv_consumer`` (decode) or ``kv_both``. As with NIXL, the role does not gate the
    protocol (a request's ``kv_transfer_params`` do); it adds the consumer-side metrics. None:
    no connector, as vLLM without one: ``kv_transfer_params`` in a request is ignored and every
    answer has ``"kv_transfer_params": null``."""
    kv_transfer_bytes_per_s: float = DEFAULT_KV_TRANSFER_BYTES_PER_S
    """Link bandwidth that prices a pull: ``blocks x block_size x kv_bytes_per_token`` bytes take
    ``bytes / kv_transfer_bytes_per_s`` modelled seconds (times ``time_scale``)."""
    kv_lease_duration_s: float = 30.0
    """How long a producer holds a finished prefill's blocks for the decode side to pull, wall
    seconds: vLLM 0.32's ``kv_connector_extra_config.kv_lease_duration`` (default 30; it replaced
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480). The sim's consumer pulls at once, so it sends no
    heartbeats to extend the lease."""
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"
    """vLLM's ``kv_load_failure_policy`` (default ``fail``): a failed pull ends the request with
    finish reason ``error``, answered 500; ``recompute`` computes the prompt locally instead."""
    kv_transfer_host: str | None = None
    """Host put in ``remote_host`` (vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``); None: the address
    the fleet serves on (``127.0.0.1`` when that is a wildcard)."""
    kv_engine_id: str | None = None
    """``remote_engine_id`` (vLLM's ``kv_transfer_config.engine_id``); None: a random uuid4."""
    kv_offloading_size_gib: float | None = None
    """vLLM's ``--kv-offloading-size``: GiB of host memory for its native CPU offloading, a CPU
    tier of ``size / (kv_bytes_per_token x block_size)`` blocks (``kvcache.CpuOffloadCache``);
    None: no CPU tier."""
    cpu_offload_blocks: int | None = None
    """The CPU tier in blocks, instead of ``kv_offloading_size_gib`` (tests, benchmarks)."""
    cpu_offload_bytes_per_s: float = DEFAULT_CPU_OFFLOAD_BYTES_PER_S
    """Host link bandwidth that prices a load from the CPU tier: ``tokens x kv_bytes_per_token
    / cpu_offload_bytes_per_s`` modelled seconds."""
    self_describing_kv_events: bool = False
    """vLLM's ``kv_connector_extra_config.self_describing_kv_events``: the CPU tier's
    ``BlockStored`` events carry tokens and parents (default: placeholders)."""

    def __post_init__(self) -> None:
        if self.block_size_tokens < 1:
            raise ValueError("block_size_tokens must be >= 1")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is vLLM's null block)")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens must be >= 1, max_model_len >= 2"
            )
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must be in [0, 1]")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)} (or None)")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
            )
        if not self.kv_transfer_bytes_per_s > 0:
            raise ValueError("kv_transfer_bytes_per_s must be > 0")
        if not self.kv_lease_duration_s > 0:
            raise ValueError("kv_lease_duration_s must be > 0")
        if self.kv_offloading_size_gib is not None and not self.kv_offloading_size_gib > 0:
            raise ValueError("kv_offloading_size_gib must be > 0 (or None: no CPU tier)")
        if self.cpu_offload_blocks is not None and self.cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must be >= 0")
        if not self.cpu_offload_bytes_per_s > 0:
            raise ValueError("cpu_offload_bytes_per_s must be > 0")


@dataclass(frozen=True)
class SimResources:
    """What a config resolves to: cache size, context limit, cost model."""

    num_gpu_blocks: int
    max_model_len: int
    cost: CostModel
    kv_bytes_per_token: int = 0
    """KV bytes of one token (the profile's model and ``kv_dtype``): what a KV transfer moves.
    Resolved only for a worker with a ``kv_role``; 0 otherwise."""
    cpu_offload_blocks: int = 0
    """Blocks of the CPU tier; 0: none."""
    cpu_reload_s_per_token: float = 0.0
    """Modelled seconds to load one token's KV from the CPU tier."""


def derive_num_gpu_blocks(
    gpu_memory_bytes: float,
    weight_bytes: float,
    kv_bytes_per_token: int,
    block_size_tokens: int,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """Blocks that fit in the GPU memory left after the weights."""
    free = gpu_memory_bytes * gpu_memory_utilization - weight_bytes
    per_block = kv_bytes_per_token * block_size_tokens
    if free <= 0 or per_block <= 0:
        raise ValueError("the model's weights do not leave room for a KV cache on this GPU")
    return int(free // per_block)


def resolve(config: SimWorkerConfig, cost: CostModel | None = None) -> SimResources:
    """Cache size, context limit and cost model of ``config`` (reads the planner's presets)."""
    num_blocks = config.num_gpu_blocks
    if cost is None or num_blocks is None:
        model, gpu = parse_profile(config.profile)
        if cost is None:
            cost = PlannerCostModel(
                model, gpu, utilisation=config.prefill_utilisation, kv_dtype=config.kv_dtype
            )
        if num_blocks is None:
            num_blocks = derive_num_gpu_blocks(
                gpu.memory_bytes,
                model.weight_bytes,
                model.kv_bytes_per_token(config.kv_dtype),
                config.block_size_tokens,
                config.gpu_memory_utilization,
            )
    max_model_len = min(config.max_model_len, (num_blocks - 1) * config.block_size_tokens)
    kv_bytes = 0
    if config.kv_role is not None:
        kv_bytes = parse_profile(config.profile)[0].kv_bytes_per_token(config.kv_dtype)
    cpu_blocks, reload_s = 0, 0.0
    if config.cpu_offload_blocks is not None or config.kv_offloading_size_gib is not None:
        token_bytes = parse_profile(config.profile)[0].kv_bytes_per_token(config.kv_dtype)
        if config.cpu_offload_blocks is not None:
            cpu_blocks = config.cpu_offload_blocks
        else:
            assert config.kv_offloading_size_gib is not None
            cpu_blocks = int(config.kv_offloading_size_gib * GIB
                             // (token_bytes * config.block_size_tokens))
        reload_s = token_bytes / config.cpu_offload_bytes_per_s
    return SimResources(num_gpu_blocks=num_blocks, max_model_len=max_model_len, cost=cost,
                        kv_bytes_per_token=kv_bytes, cpu_offload_blocks=cpu_blocks,
                        cpu_reload_s_per_token=reload_s)
