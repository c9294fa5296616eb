"""Capacity planner: how many requests of a given length fit on a GPU, and how fast they run.

Formulas (the seed articles' back-of-envelope model; ``kvmath`` supplies the byte counts)
----------------------------------------------------------------------------------------
* Concurrency (capacity):  floor((GPU memory - weights - reserved) / KV bytes of one request).
  ``reserved`` stands for activations, CUDA graphs and the allocator's slack (the seeds reserve
  10 GB on an 80 GB card; vLLM reserves ``1 - gpu_memory_utilization`` plus its profiled
  activation peak).
* Decode step, TPOT (memory-bound):  (weight bytes + KV bytes of every token in the batch) /
  memory bandwidth. Every step reads all weights once and the whole batch's KV once; that is a
  lower bound: attention and MLP kernels, scheduling and sampling only add to it. For MoE models
  every expert's weights are counted, which a batch reads once it touches every expert; a batch of
  one reads only its active experts, so there the figure overstates the bound.
* Prefill, TTFT (compute-bound):  2 x params x prompt tokens / (dense FLOP/s x utilisation), with the
  active params for MoE. The seeds take utilisation 0.3-0.5. ``include_attention=True`` adds the
  attention score/value FLOPs, 2 x (causal pairs) x heads x head_dim x 2 per layer, which the 2 x
  params rule leaves out and which dominates at long context (two thirds of Llama-3-8B's prefill
  FLOPs at 128K).
* Tensor parallelism over ``tensor_parallel`` identical GPUs divides weights, FLOPs and bandwidth;
  each rank caches ceil(kv_heads / tp) KV heads (MLA latents are replicated, see ``kvmath``);
  ``reserved_bytes`` is per GPU. Communication is ignored.

Units
-----
Memory in binary units (GiB = 2**30 bytes): a GPU sold as "80 GB" has 80 GiB of HBM (nvidia-smi shows
81920 MiB on an A100 80GB), and the seeds' "GB" means 1024**3 bytes (seed 000 says so). Their
concurrency example comes out exactly this way: (80 - 14 - 10) GiB / 4 GiB = 14 requests at 8K, 56
with 8 KV heads. Bandwidth (TB/s) and FLOP/s are decimal, as datasheets give them. The seeds' TPOT
figures (18 GB / 2-3 TB/s = 6-9 ms) divide GiB by "1000 GB/s", which makes them 7.4% (1024**3 / 10**9)
optimistic against a datasheet's bytes per second; tests reproduce both readings.

Compared to: vLLM's startup log ("Maximum concurrency for N tokens per request: X") does the capacity
sum with measured activation memory and 16-token blocks; real TPOT sits above the bound here, by
how much is what ``gateway.bench`` measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gateway.kvmath import GiB, ModelArch, format_bytes, kv_dtype_bytes, load_model_arch

TB_PER_S: Final = 1e12  # bytes/s in one datasheet TB/s
TFLOPS: Final = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: memory, memory bandwidth and dense 16-bit tensor throughput."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: float  # dense bf16 FLOP/s

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or self.flops <= 0:
            raise ValueError(f"{self.name}: memory, bandwidth and FLOP/s must all be positive")


# Public NVIDIA datasheet figures (SXM boards unless named). Dense BF16 is half the datasheet's
# "with sparsity" number. Memory "80GB" etc. taken as GiB (see Units).
#   A100 datasheet ("NVIDIA A100 Tensor Core GPU"): 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s;
#     BF16 312 TFLOPS dense.
#   H100 datasheet ("NVIDIA H100 Tensor Core GPU"): SXM 80GB HBM3 3.35 TB/s, BF16 1,979 TFLOPS
#     sparse = 989.5 dense; PCIe 80GB HBM2e 2 TB/s, BF16 1,513 sparse = 756.5 dense.
#   H200 datasheet ("NVIDIA H200 Tensor Core GPU"): SXM 141GB HBM3e 4.8 TB/s, BF16 1,979 sparse.
#   L40S datasheet: 48GB GDDR6 864 GB/s, BF16 362.05 TFLOPS dense.
#   L4 datasheet: 24GB GDDR6 300 GB/s, BF16 242 TFLOPS sparse = 121 dense.
GPU_PRESETS: Final[dict[str, GpuSpec]] = {
    spec.name: spec
    for spec in (
        GpuSpec("a100-40g", 40 * GiB, 1_555e9, 312e12),
        GpuSpec("a100-80g", 80 * GiB, 2_039e9, 312e12),
        GpuSpec("h100-80g", 80 * GiB, 3_350e9, 989.5e12),
        GpuSpec("h100-pcie-80g", 80 * GiB, 2_000e9, 756.5e12),
        GpuSpec("h200-141g", 141 * GiB, 4_800e9, 989.5e12),
        GpuSpec("l40s-48g", 48 * GiB, 864e9, 362.05e12),
        GpuSpec("l4-24g", 24 * GiB, 300e9, 121e12),
    )
}

_GPU_ALIASES: Final[dict[str, str]] = {
    "a100": "a100-80g",
    "a100-80gb": "a100-80g",
    "a100-40gb": "a100-40g",
    "h100": "h100-80g",
    "h100-sxm": "h100-80g",
    "h100-80gb": "h100-80g",
    "h100-pcie": "h100-pcie-80g",
    "h200": "h200-141g",
    "h200-141gb": "h200-141g",
    "l40s": "l40s-48g",
    "l4": "l4-24g",
}


def resolve_gpu(name: str) -> GpuSpec:
    """A GPU preset by name or alias (``h100`` is ``h100-80g``), case-insensitive."""
    key = name.strip().lower()
    spec = GPU_PRESETS.get(key) or GPU_PRESETS.get(_GPU_ALIASES.get(key, ""))
    if spec is None:
        known = ", ".join([*GPU_PRESETS, *_GPU_ALIASES])
        raise ValueError(f"unknown GPU {name!r}; known: {known}")
    return spec


def parse_profile(profile: str) -> tuple[ModelArch, GpuSpec]:
    """``MODEL@GPU``, e.g. ``llama-3-8b@h100``; MODEL is anything ``load_model_arch`` accepts."""
    model, sep, gpu = profile.rpartition("@")
    if not sep or not model.strip() or not gpu.strip():
        raise ValueError(f"profile {profile!r} must look like MODEL@GPU, e.g. 'llama-3-8b@h100'")
    return load_model_arch(model.strip()), resolve_gpu(gpu)


# -- the arithmetic --------------------------------------------------------------------------------


def _check_tp(tensor_parallel: int) -> None:
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")


def attention_flops(model: ModelArch, tokens: int) -> float:
    """Attention score and value FLOPs of a causal prefill of ``tokens`` (not in 2 x params):
    per layer 2 FLOPs x (q.k + p.v) x head_dim x heads x attended pairs, pairs = T(T+1)/2 on full
    layers and the window-capped count on sliding ones."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    full_pairs = tokens * (tokens + 1) // 2
    window = model.sliding_window
    if window is not None and tokens > window:
        sliding_pairs = window * (window + 1) // 2 + (tokens - window) * window
    else:
        sliding_pairs = full_pairs
    sliding = model.num_sliding_layers
    pairs = (model.num_layers - sliding) * full_pairs + sliding * sliding_pairs
    return 4.0 * model.num_attention_heads * model.head_dim * pairs


def prefill_flops(model: ModelArch, tokens: int, *, include_attention: bool = False) -> float:
    """2 x (active) params x tokens, plus ``attention_flops`` when asked."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    flops = 2.0 * model.active_params * tokens
    return flops + attention_flops(model, tokens) if include_attention else flops


def prefill_time_s(
    model: ModelArch,
    gpu: GpuSpec,
    tokens: int,
    utilisation: float = 0.5,
    *,
    tensor_parallel: int = 1,
    include_attention: bool = False,
) -> float:
    """TTFT estimate: prefill FLOPs / (dense FLOP/s x utilisation x tensor_parallel)."""
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation}")
    _check_tp(tensor_parallel)
    flops = prefill_flops(model, tokens, include_attention=include_attention)
    return flops / (gpu.flops * utilisation * tensor_parallel)


def decode_step_time_s(
    model: ModelArch,
    gpu: GpuSpec,
    batch_kv_tokens: int,
    kv_dtype: str = "auto",
    *,
    batch_size: int = 1,
    tensor_parallel: int = 1,
) -> float:
    """TPOT lower bound: (weights + KV bytes of all ``batch_kv_tokens``) / bandwidth.

    ``batch_kv_tokens`` is the sum over the batch; for sliding-window layers it is split evenly
    over ``batch_size`` sequences so each is capped at the window. With tensor parallelism each
    rank reads its shard at its own bandwidth, in parallel."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_tp(tensor_parallel)
    if batch_kv_tokens < 0:
        raise ValueError(f"batch_kv_tokens must be >= 0, got {batch_kv_tokens}")
    per_seq, extra = divmod(batch_kv_tokens, batch_size)
    kv = (batch_size - extra) * model.kv_bytes_for_tokens(
        per_seq, kv_dtype, tensor_parallel=tensor_parallel
    ) + extra * model.kv_bytes_for_tokens(per_seq + 1, kv_dtype, tensor_parallel=tensor_parallel)
    return (model.weight_bytes / tensor_parallel + kv) / gpu.bandwidth_bytes_per_s


def kv_budget_bytes(
    model: ModelArch, gpu: GpuSpec, reserved_bytes: int = 0, *, tensor_parallel: int = 1
) -> int:
    """Per-GPU memory left for KV cache: memory - weights / tp - reserved (may be negative)."""
    _check_tp(tensor_parallel)
    if reserved_bytes < 0:
        raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes}")
    return gpu.memory_bytes - math.ceil(model.weight_bytes / tensor_parallel) - reserved_bytes


def max_concurrency(
    model: ModelArch,
    gpu: GpuSpec,
    context_tokens: int,
    kv_dtype: str = "auto",
    reserved_bytes: int = 0,
    *,
    tensor_parallel: int = 1,
) -> int:
    """Requests of ``context_tokens`` whose KV fits next to the weights: floor(budget / per request);
    0 when the weights (plus reserve) do not fit or a single request does not."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    budget = kv_budget_bytes(model, gpu, reserved_bytes, tensor_parallel=tensor_parallel)
    per_request = model.kv_bytes_for_tokens(
        context_tokens, kv_dtype, tensor_parallel=tensor_parallel
    )
    return max(budget, 0) // per_request


# -- a plan: the seeds' tables ---------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRow:
    context_tokens: int
    kv_bytes_per_request: int  # per GPU under tensor parallelism
    kv_share_of_weights: float  # KV of one request / weight bytes
    max_concurrency: int
    tpot_batch1_s: float
    tpot_at_max_s: float | None  # None when no request fits
    decode_tokens_per_s_at_max: float | None
    ttft_s: float
    ttft_with_attention_s: float


@dataclass(frozen=True)
class Plan:
    model: ModelArch
    gpu: GpuSpec
    tensor_parallel: int
    kv_dtype: str
    kv_element_bytes: int
    kv_bytes_per_token: int  # per GPU, uncapped
    weight_bytes: int  # whole model (each GPU holds weight_bytes / tensor_parallel)
    reserved_bytes: int
    kv_budget_bytes: int  # per GPU
    utilisation: float
    rows: tuple[PlanRow, ...]


def make_plan(
    model: ModelArch,
    gpu: GpuSpec,
    contexts: Sequence[int],
    *,
    kv_dtype: str = "auto",
    reserved_bytes: int = 10 * GiB,
    utilisation: float = 0.5,
    tensor_parallel: int = 1,
) -> Plan:
    """Every figure of the ``plan`` table for each context length."""
    if not contexts:
        raise ValueError("at least one context length is needed")
    element = kv_dtype_bytes(kv_dtype, model.dtype_bytes)
    budget = kv_budget_bytes(model, gpu, reserved_bytes, tensor_parallel=tensor_parallel)
    rows = []
    for context in contexts:
        per_request = model.kv_bytes_for_tokens(context, kv_dtype, tensor_parallel=tensor_parallel)
        n = max_concurrency(
            model, gpu, context, kv_dtype, reserved_bytes, tensor_parallel=tensor_parallel
        )
        tpot_max = (
            decode_step_time_s(
                model, gpu, n * context, kv_dtype, batch_size=n, tensor_parallel=tensor_parallel
            )
            if n
            else None
        )
        rows.append(
            PlanRow(
                context_tokens=context,
                kv_bytes_per_request=per_request,
                kv_share_of_weights=per_request * tensor_parallel / model.weight_bytes,
                max_concurrency=n,
                tpot_batch1_s=decode_step_time_s(
                    model, gpu, context, kv_dtype, tensor_parallel=tensor_parallel
                ),
                tpot_at_max_s=tpot_max,
                decode_tokens_per_s_at_max=n / tpot_max if tpot_max else None,
                ttft_s=prefill_time_s(
                    model, gpu, context, utilisation, tensor_parallel=tensor_parallel
                ),
                ttft_with_attention_s=prefill_time_s(
                    model,
                    gpu,
                    context,
                    utilisation,
                    tensor_parallel=tensor_parallel,
                    include_attention=True,
                ),
            )
        )
    return Plan(
        model=model,
        gpu=gpu,
        tensor_parallel=tensor_parallel,
        kv_dtype=kv_dtype,
        kv_element_bytes=element,
        kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype, tensor_parallel=tensor_parallel),
        weight_bytes=model.weight_bytes,
        reserved_bytes=reserved_bytes,
        kv_budget_bytes=budget,
        utilisation=utilisation,
        rows=tuple(rows),
    )


def _format_tokens(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 and tokens >= 1024 else str(tokens)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _describe_model(model: ModelArch) -> str:
    if model.is_mla:
        shape = f"{model.num_layers} layers x (kv_lora_rank {model.kv_lora_rank} + rope {model.qk_rope_head_dim})"
    else:
        shape = (
            f"{model.num_layers} layers x {model.num_kv_heads} KV heads"
            f" (of {model.num_attention_heads}) x {model.head_dim}"
        )
    if model.num_sliding_layers:
        shape += f", {model.num_sliding_layers} layers with a {model.sliding_window}-token window"
    params = f"{model.num_params / 1e9:.2f} B params"
    if model.num_active_params is not None:
        params += f" ({model.num_active_params / 1e9:.2f} B active)"
    return f"{model.name}  {model.attention_kind}  {shape}, {params}"


def render_plan(plan: Plan) -> str:
    """The plan as text tables."""
    m, g, tp = plan.model, plan.gpu, plan.tensor_parallel
    gpus = f"{tp} x {g.name}" if tp > 1 else g.name
    weights_per_gpu = math.ceil(plan.weight_bytes / tp)
    lines = [
        f"model    {_describe_model(m)}",
        f"weights  {format_bytes(plan.weight_bytes)}"
        + (f" ({format_bytes(weights_per_gpu)} per GPU)" if tp > 1 else "")
        + (
            " (set: quantised checkpoint or --weights-gb)"
            if m.weight_bytes_override
            else f" = params x {m.dtype_bytes} B"
        ),
        f"gpu      {gpus}: {format_bytes(g.memory_bytes)}, {g.bandwidth_bytes_per_s / TB_PER_S:g} TB/s,"
        f" {g.flops / TFLOPS:g} TFLOP/s dense bf16",
        f"kv       dtype {plan.kv_dtype} ({plan.kv_element_bytes} B/element):"
        f" {format_bytes(plan.kv_bytes_per_token)} per token" + (" per GPU" if tp > 1 else ""),
        f"memory   {format_bytes(g.memory_bytes)} - {format_bytes(weights_per_gpu)} weights"
        f" - {format_bytes(plan.reserved_bytes)} reserved = {format_bytes(plan.kv_budget_bytes)}"
        " for KV cache" + (" per GPU" if tp > 1 else ""),
        "",
    ]
    header = (
        f"{'context':>8}  {'KV/request':>11}  {'vs weights':>10}  {'max conc.':>9}  "
        f"{'TPOT@1 ms':>9}  {'TPOT@max ms':>11}  {'tok/s@max':>10}  {'TTFT s':>8}  {'+attn s':>8}"
    )
    lines += [header, "-" * len(header)]
    for row in plan.rows:
        tok_s = row.decode_tokens_per_s_at_max
        lines.append(
            f"{_format_tokens(row.context_tokens):>8}  {format_bytes(row.kv_bytes_per_request):>11}  "
            f"{row.kv_share_of_weights:>10.1%}  {row.max_concurrency:>9}  "
            f"{_ms(row.tpot_batch1_s):>9}  {_ms(row.tpot_at_max_s):>11}  "
            f"{'-' if tok_s is None else f'{tok_s:,.0f}':>10}  "
            f"{row.ttft_s:>8.3f}  {row.ttft_with_attention_s:>8.3f}"
        )
    lines += [
        "",
        "max conc. = floor(KV budget / KV per request); vLLM also caps the batch at --max-num-seqs.",
        "TPOT = (weights + KV of the batch) / bandwidth: a lower bound, at batch 1 and at max conc.",
        f"TTFT = 2 x {'active ' if m.num_active_params else ''}params x context /"
        f" (FLOP/s x {plan.utilisation:g}); +attn adds attention's quadratic FLOPs.",
        "Memory in binary units (GiB = 2^30 B); bandwidth and FLOP/s decimal (datasheets).",
    ]
    if plan.kv_budget_bytes <= 0:
        lines.append("The weights and the reserve alone exceed GPU memory: nothing fits.")
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan in raw units (bytes, seconds, FLOP/s) for machines."""
    model = dataclasses.asdict(plan.model)
    model["attention_kind"] = plan.model.attention_kind
    model["active_params"] = plan.model.active_params
    return {
        "model": model,
        "gpu": dataclasses.asdict(plan.gpu),
        "tensor_parallel": plan.tensor_parallel,
        "kv_dtype": plan.kv_dtype,
        "kv_element_bytes": plan.kv_element_bytes,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "weight_bytes": plan.weight_bytes,
        "reserved_bytes": plan.reserved_bytes,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "utilisation": plan.utilisation,
        "rows": [dataclasses.asdict(row) for row in plan.rows],
    }


def write_plan_png(plan: Plan, path: Path) -> None:
    """Two panels against context length: KV per request and max concurrency; TPOT and TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [row.context_tokens for row in plan.rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(
        contexts,
        [row.kv_bytes_per_request / GiB for row in plan.rows],
        "o-",
        label="KV / request (GiB)",
    )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context tokens")
    left.set_ylabel("GiB")
    twin = left.twinx()
    twin.plot(
        contexts,
        [row.max_concurrency for row in plan.rows],
        "s--",
        color="tab:red",
        label="max concurrency",
    )
    twin.set_ylabel("max concurrent requests")
    handles = left.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    left.legend(handles=handles, loc="upper center")
    left.set_title("capacity")
    right.plot(contexts, [row.tpot_batch1_s * 1e3 for row in plan.rows], "o-", label="TPOT @1 (ms)")
    right.plot(
        [row.context_tokens for row in plan.rows if row.tpot_at_max_s is not None],
        [row.tpot_at_max_s * 1e3 for row in plan.rows if row.tpot_at_max_s is not None],
        "s-",
        label="TPOT @max (ms)",
    )
    right.plot(contexts, [row.ttft_s * 1e3 for row in plan.rows], "^--", label="TTFT (ms)")
    right.set_xscale("log", base=2)
    for axes in (left, right):
        axes.set_xticks(contexts, [_format_tokens(c) for c in contexts])
        axes.minorticks_off()
    right.set_yscale("log")
    right.set_xlabel("context tokens")
    right.set_ylabel("ms")
    right.legend()
    right.set_title("latency bounds")
    gpus = (
        f"{plan.tensor_parallel} x {plan.gpu.name}" if plan.tensor_parallel > 1 else plan.gpu.name
    )
    fig.suptitle(f"{plan.model.name} on {gpus}, KV {plan.kv_dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- prefill/decode disaggregation: sizing a split ----------------------------------------------
#
# A disaggregated pool computes prompts on prefill GPUs and generates on decode GPUs, which pull
# the prompt's KV over a link (vLLM's NIXL connector). The three resources are sized apart:
#
# * prefill GPUs are compute-bound servers: a request of class i holds one for
#   S_i = prefill_time_s(prompt_i); offered load a = rate x E[S] GPUs. The wait before a
#   prefill starts is Erlang C's M/M/c mean, scaled by Allen-Cunneen's (1 + cs^2) / 2 for the
#   spread of S (long prompts among short ones make cs^2 large): Wq = C(c, a) x E[S] / (c - a)
#   x (1 + cs^2) / 2. vLLM prefills in chunks of max_num_batched_tokens and schedules running
#   requests before waiting ones (``v1/core/sched/scheduler.py``), so a long prompt's chunks fill
#   the step's token budget and a short prompt that arrives behind it waits: first come first
#   served per GPU, in effect. The router spreads requests over the GPUs as one queue would
#   (least queued prefill first); the mean wait is what is predicted.
# * the transfer: prompt KV bytes / link bytes per second (the decode side reads whole blocks).
# * decode GPUs are memory-bound: every step reads the weights and the batch's KV, so with b
#   sequences of mean context c per GPU, TPOT(b) = (W + b c k) / BW (``decode_step_time_s``).
#   Little's law gives the batch the output rate needs: b = (tokens/s per GPU) x TPOT(b), solved
#   for b: b = T W / (n BW - T c k) with T the fleet's output tokens/s and n decode GPUs. n is
#   the smallest that keeps TPOT(b) within the target and b x (prompt + output) tokens of KV
#   within the KV budget.
#
# TTFT = wait + prefill + transfer + one decode step (the decode side recomputes the last
# prompt token). The colocated comparison (every GPU does both) charges each decode step the
# prefill it shares a step with, so mean TPOT ~ decode step / (1 - prefill share of the GPUs):
# the interference disaggregation removes. Communication other than the KV pull, scheduling
# overheads and attention FLOPs are ignored; the predictions are means, not percentiles.

DEFAULT_LINK_BYTES_PER_S: Final = 25e9
"""200 Gb/s: one RDMA NIC, what a NIXL read of one worker's KV typically gets."""
DEFAULT_MAX_PREFILL_UTILISATION: Final = 0.7
"""Sizing keeps prefill GPUs at most this busy: the mean wait is a poor guide near saturation,
where bursts of long prompts queue for seconds."""


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a workload: its share of arrivals and its sizes in tokens."""

    name: str
    share: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not self.name or not 0 < self.share <= 1:
            raise ValueError(f"request class {self.name!r}: share must be in (0, 1]")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request class {self.name!r}: token counts must be >= 1")


@dataclass(frozen=True)
class PdWorkload:
    """Arrivals (Poisson, ``rate_per_s``), the request mix, and the latency targets."""

    rate_per_s: float
    classes: tuple[RequestClass, ...]
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.05

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0:
            raise ValueError(f"rate must be > 0, got {self.rate_per_s}")
        if not self.classes:
            raise ValueError("at least one request class is needed")
        if abs(sum(c.share for c in self.classes) - 1.0) > 1e-6:
            raise ValueError("request class shares must sum to 1")
        if not self.ttft_target_s > 0 or not self.tpot_target_s > 0:
            raise ValueError("TTFT and TPOT targets must be > 0")


@dataclass(frozen=True)
class ClassEstimate:
    name: str
    prefill_s: float
    transfer_s: float
    ttft_s: float
    """Mean: prefill wait + prefill + transfer + one decode step."""


@dataclass(frozen=True)
class PdEstimate:
    """What a split of ``prefill_gpus`` + ``decode_gpus`` does under a workload (means)."""

    prefill_gpus: int
    decode_gpus: int
    prefill_utilisation: float
    """Offered prefill load / prefill GPUs; >= 1: the prefill queue grows without bound."""
    prefill_wait_s: float
    """Mean wait before a prefill starts (inf when overloaded)."""
    decode_batch: float
    """Mean sequences decoding per decode GPU (inf when overloaded)."""
    decode_kv_share: float
    """Their KV (whole prompt + output) / the KV budget of one GPU."""
    tpot_s: float
    classes: tuple[ClassEstimate, ...]
    colocated_tpot_s: float
    """Mean TPOT if the same GPUs each did both (inf when overloaded)."""

    @property
    def stable(self) -> bool:
        return (self.prefill_utilisation < 1 and math.isfinite(self.decode_batch)
                and self.decode_kv_share <= 1)


@dataclass(frozen=True)
class PdPlan:
    model: ModelArch
    gpu: GpuSpec
    workload: PdWorkload
    link_bytes_per_s: float
    utilisation: float
    kv_dtype: str
    kv_budget_bytes: int
    max_prefill_utilisation: float
    sized: PdEstimate | None
    """The smallest split meeting both targets (None: none within ``max_gpus``)."""
    given: PdEstimate | None
    """The split asked for (``--pd-split``), if any."""


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``offered`` = lambda x E[S]."""
    if servers < 1:
        raise ValueError("servers must be >= 1")
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)  # a^c / c! / (1 - rho)
    return last / (total + last)


def estimate_pd(
    model: ModelArch,
    gpu: GpuSpec,
    workload: PdWorkload,
    prefill_gpus: int,
    decode_gpus: int,
    *,
    utilisation: float = 0.5,
    kv_dtype: str = "auto",
    reserved_bytes: int = 10 * GiB,
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
) -> PdEstimate:
    """Means of a P/D split under ``workload`` (the model is in the section's comment)."""
    if prefill_gpus < 1 or decode_gpus < 1:
        raise ValueError("a split needs at least one prefill and one decode GPU")
    if not link_bytes_per_s > 0:
        raise ValueError("link bandwidth must be > 0")
    lam, classes = workload.rate_per_s, workload.classes
    kv_token = model.kv_bytes_per_token(kv_dtype)
    service = [prefill_time_s(model, gpu, c.prompt_tokens, utilisation) for c in classes]
    mean_s = sum(c.share * s for c, s in zip(classes, service, strict=True))
    second = sum(c.share * s * s for c, s in zip(classes, service, strict=True))
    cs2 = second / (mean_s * mean_s) - 1 if mean_s > 0 else 0.0
    offered = lam * mean_s
    rho = offered / prefill_gpus
    wait = (math.inf if rho >= 1 else erlang_c(prefill_gpus, offered) * mean_s
            / (prefill_gpus - offered) * (1 + cs2) / 2)
    # Decode: fleet output tokens/s T, and the mean context of a decoding sequence weighted by
    # the tokens it generates (long outputs hold the batch longer).
    tokens_per_s = lam * sum(c.share * c.output_tokens for c in classes)
    weight = sum(c.share * c.output_tokens for c in classes)
    context = sum(c.share * c.output_tokens * (c.prompt_tokens + c.output_tokens / 2)
                  for c in classes) / weight
    held = sum(c.share * c.output_tokens * (c.prompt_tokens + c.output_tokens)
               for c in classes) / weight
    w_bytes, bw = model.weight_bytes, gpu.bandwidth_bytes_per_s
    denom = decode_gpus * bw - tokens_per_s * context * kv_token
    batch = tokens_per_s * w_bytes / denom if denom > 0 else math.inf
    budget = kv_budget_bytes(model, gpu, reserved_bytes)
    kv_share = batch * held * kv_token / budget if budget > 0 else math.inf
    tpot = (decode_step_time_s(model, gpu, round(batch * context), kv_dtype,
                               batch_size=max(1, round(batch)))
            if math.isfinite(batch) else math.inf)
    step1 = decode_step_time_s(model, gpu, round(context), kv_dtype)
    estimates = tuple(
        ClassEstimate(c.name, s, (t := c.prompt_tokens * kv_token / link_bytes_per_s),
                      wait + s + t + step1)
        for c, s in zip(classes, service, strict=True))
    total = prefill_gpus + decode_gpus
    shared = offered / total  # every GPU's share of time spent prefilling, colocated
    co_denom = total * bw * (1 - shared) - tokens_per_s * context * kv_token
    co_batch = tokens_per_s * w_bytes / co_denom if shared < 1 and co_denom > 0 else math.inf
    colocated = (decode_step_time_s(model, gpu, round(co_batch * context), kv_dtype,
                                    batch_size=max(1, round(co_batch))) / (1 - shared)
                 if math.isfinite(co_batch) else math.inf)
    return PdEstimate(prefill_gpus, decode_gpus, rho, wait, batch, kv_share, tpot, estimates,
                      colocated)


def size_pd(
    model: ModelArch,
    gpu: GpuSpec,
    workload: PdWorkload,
    *,
    utilisation: float = 0.5,
    kv_dtype: str = "auto",
    reserved_bytes: int = 10 * GiB,
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
    given: tuple[int, int] | None = None,
    max_prefill_utilisation: float = DEFAULT_MAX_PREFILL_UTILISATION,
    max_gpus: int = 1024,
) -> PdPlan:
    """The smallest prefill count whose mean TTFT of every class meets the target at no more
    than ``max_prefill_utilisation``, and the smallest decode count whose TPOT meets its target
    with the KV fitting; and, when ``given``, the estimate of that split."""
    if not 0 < max_prefill_utilisation < 1:
        raise ValueError("max prefill utilisation must be in (0, 1)")

    def estimate(p: int, d: int) -> PdEstimate:
        return estimate_pd(model, gpu, workload, p, d, utilisation=utilisation,
                           kv_dtype=kv_dtype, reserved_bytes=reserved_bytes,
                           link_bytes_per_s=link_bytes_per_s)

    # The two sides are independent (prefill GPUs do not change TPOT, decode GPUs not TTFT), so
    # each is the first count that meets its own target.
    prefill = next((p for p in range(1, max_gpus + 1)
                    if (e := estimate(p, max_gpus)).prefill_utilisation
                    <= max_prefill_utilisation
                    and max(c.ttft_s for c in e.classes) <= workload.ttft_target_s), None)
    decode = next((d for d in range(1, max_gpus + 1)
                   if (e := estimate(1, d)).tpot_s <= workload.tpot_target_s
                   and e.decode_kv_share <= 1), None)
    sized = estimate(prefill, decode) if prefill is not None and decode is not None else None
    return PdPlan(model, gpu, workload, link_bytes_per_s, utilisation, kv_dtype,
                  kv_budget_bytes(model, gpu, reserved_bytes), max_prefill_utilisation, sized,
                  estimate(*given) if given is not None else None)


def parse_mix(text: str) -> tuple[RequestClass, ...]:
    """``chat=0.8:200:200,long=0.2:16K:16``: NAME=SHARE:PROMPT_TOKENS:OUTPUT_TOKENS, K = 1024."""
    classes = []
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, rest = part.strip().partition("=")
        fields = rest.split(":")
        if not sep or len(fields) != 3:
            raise ValueError(f"bad request class {part.strip()!r}: want NAME=SHARE:PROMPT:OUTPUT,"
                             " e.g. long=0.2:16K:16")
        try:
            share = float(fields[0])
        except ValueError:
            raise ValueError(f"bad share in {part.strip()!r}") from None
        prompt, output = (parse_contexts(f)[0] for f in fields[1:])
        classes.append(RequestClass(name.strip(), share, prompt, output))
    if not classes:
        raise ValueError("no request classes given")
    return tuple(classes)


def _fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render_pd_estimate(e: PdEstimate) -> list[str]:
    lines = [
        f"  {e.prefill_gpus} prefill + {e.decode_gpus} decode GPUs:"
        f" prefill utilisation {e.prefill_utilisation:.0%}, mean prefill wait"
        f" {_fmt_s(e.prefill_wait_s)}; decode batch {e.decode_batch:.1f} per GPU"
        f" (KV {e.decode_kv_share:.0%} of the budget), TPOT {_fmt_s(e.tpot_s)}"
        + ("" if e.stable else "  OVERLOADED"),
    ]
    for c in e.classes:
        lines.append(f"    {c.name:<10} prefill {_fmt_s(c.prefill_s):>9}  transfer"
                     f" {_fmt_s(c.transfer_s):>9}  TTFT {_fmt_s(c.ttft_s):>9}")
    lines.append(f"    the same {e.prefill_gpus + e.decode_gpus} GPUs colocated (each does both):"
                 f" TPOT {_fmt_s(e.colocated_tpot_s)} (decode steps share the prefills)")
    return lines


def render_pd(plan: PdPlan) -> str:
    w = plan.workload
    mix = ", ".join(f"{c.name} {c.share:.0%} ({_format_tokens(c.prompt_tokens)} in,"
                    f" {c.output_tokens} out)" for c in w.classes)
    lines = [
        "prefill/decode split",
        f"  workload {w.rate_per_s:g} req/s: {mix}; targets TTFT {_fmt_s(w.ttft_target_s)},"
        f" TPOT {_fmt_s(w.tpot_target_s)}; link {plan.link_bytes_per_s * 8 / 1e9:g} Gb/s",
    ]
    if plan.sized is None:
        lines.append("  no split meets the targets (a single prompt's prefill or a batch of one"
                     " is already too slow for them)")
    else:
        lines.append("  sized (smallest counts meeting both targets, prefill at most"
                     f" {plan.max_prefill_utilisation:.0%} busy):")
        lines += render_pd_estimate(plan.sized)
    if plan.given is not None:
        lines.append("  asked:")
        lines += render_pd_estimate(plan.given)
    lines += [
        "  prefill: Erlang C wait x (1 + cs^2)/2 over prefill = 2 x params x prompt /"
        f" (FLOP/s x {plan.utilisation:g});",
        "  transfer = prompt KV bytes / link; decode batch from Little's law, TPOT ="
        " (weights + batch KV) / bandwidth;",
        "  means, not percentiles; TTFT = wait + prefill + transfer + one decode step.",
    ]
    return "\n".join(lines)


def _finite(x: Any) -> Any:
    """JSON has no infinity: an overloaded estimate's infinite figures become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def pd_estimate_to_json(e: PdEstimate) -> dict[str, Any]:
    data: dict[str, Any] = _finite(dataclasses.asdict(e) | {"stable": e.stable})
    return data


def pd_plan_to_json(plan: PdPlan) -> dict[str, Any]:
    def est(e: PdEstimate | None) -> Any:
        return None if e is None else pd_estimate_to_json(e)

    return {
        "workload": dataclasses.asdict(plan.workload),
        "link_bytes_per_s": plan.link_bytes_per_s,
        "utilisation": plan.utilisation,
        "kv_dtype": plan.kv_dtype,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "max_prefill_utilisation": plan.max_prefill_utilisation,
        "sized": est(plan.sized),
        "given": est(plan.given),
    }


# -- CLI -------------------------------------------------------------------------------------------

DEFAULT_CONTEXTS: Final = "2048,8192,32768,131072"
DEFAULT_PD_MIX: Final = "chat=0.85:200:200,long=0.15:16K:16"


def parse_contexts(text: str) -> list[int]:
    """``2048,8K,128k`` -> [2048, 8192, 131072] (K = 1024 tokens)."""
    contexts = []
    for part in text.split(","):
        item = part.strip().lower()
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.removesuffix("k")) * scale
        except ValueError:
            raise ValueError(f"bad context length {part.strip()!r}: want e.g. 8192 or 8K") from None
        if value < 1:
            raise ValueError(f"context length must be >= 1, got {part.strip()!r}")
        contexts.append(value)
    if not contexts:
        raise ValueError("no context lengths given")
    return contexts


def _gpu_from_args(args: argparse.Namespace) -> GpuSpec:
    custom = (args.gpu_memory_gb, args.gpu_bandwidth_tbs, args.gpu_tflops)
    if args.gpu is None:
        if None in custom:
            raise ValueError(
                "give --gpu PRESET, or all of --gpu-memory-gb, --gpu-bandwidth-tbs and --gpu-tflops"
            )
        base = GpuSpec("custom", 1, 1.0, 1.0)
    else:
        base = resolve_gpu(args.gpu)
    changes: dict[str, Any] = {}
    if args.gpu_memory_gb is not None:
        changes["memory_bytes"] = round(args.gpu_memory_gb * GiB)
    if args.gpu_bandwidth_tbs is not None:
        changes["bandwidth_bytes_per_s"] = args.gpu_bandwidth_tbs * TB_PER_S
    if args.gpu_tflops is not None:
        changes["flops"] = args.gpu_tflops * TFLOPS
    if changes and args.gpu is not None:
        changes["name"] = f"{base.name} (custom)"
    return dataclasses.replace(base, **changes)


def parse_split(text: str) -> tuple[int, int]:
    """``4+12`` -> (4, 12): prefill GPUs + decode GPUs."""
    p, sep, d = text.partition("+")
    try:
        split = (int(p), int(d))
    except ValueError:
        raise ValueError(f"bad split {text!r}: want PREFILL+DECODE, e.g. 4+12") from None
    if not sep or min(split) < 1:
        raise ValueError(f"bad split {text!r}: want PREFILL+DECODE, both >= 1, e.g. 4+12")
    return split


def _pd_from_args(args: argparse.Namespace, plan: Plan) -> PdPlan | None:
    """The P/D section when ``--pd-rate`` is given (single-GPU workers: tensor parallelism 1)."""
    rate = getattr(args, "pd_rate", None)
    if rate is None:
        return None
    if plan.tensor_parallel != 1:
        raise ValueError("the prefill/decode section sizes single-GPU workers: drop --tp")
    workload = PdWorkload(rate, parse_mix(args.pd_mix), args.pd_ttft_ms / 1e3,
                          args.pd_tpot_ms / 1e3)
    return size_pd(plan.model, plan.gpu, workload, utilisation=plan.utilisation,
                   kv_dtype=plan.kv_dtype, reserved_bytes=plan.reserved_bytes,
                   link_bytes_per_s=args.pd_link_gbps * 1e9 / 8,
                   given=parse_split(args.pd_split) if args.pd_split else None,
                   max_prefill_utilisation=args.pd_max_prefill_utilisation)


def run_plan(args: argparse.Namespace) -> int:
    """``kvgate plan``: print (and optionally chart) the plan; 2 on bad input."""
    try:
        model = load_model_arch(args.model)
        if args.weights_gb is not None:
            if args.weights_gb <= 0:
                raise ValueError(f"--weights-gb must be positive, got {args.weights_gb}")
            model = dataclasses.replace(model, weight_bytes_override=round(args.weights_gb * GiB))
        if args.reserved_gb < 0:
            raise ValueError(f"--reserved-gb must be >= 0, got {args.reserved_gb}")
        plan = make_plan(
            model,
            _gpu_from_args(args),
            parse_contexts(args.context),
            kv_dtype=args.kv_dtype,
            reserved_bytes=round(args.reserved_gb * GiB),
            utilisation=args.utilisation,
            tensor_parallel=args.tp,
        )
    except ValueError as exc:
        print(f"kvgate plan: error: {exc}", file=sys.stderr)
        return 2
    try:
        pd = _pd_from_args(args, plan)
    except ValueError as exc:
        print(f"kvgate plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = plan_to_json(plan)
        if pd is not None:
            data["disagg"] = pd_plan_to_json(pd)
        print(json.dumps(data, indent=2))
    else:
        print(render_plan(plan))
        if pd is not None:
            print()
            print(render_pd(pd))
    if args.png:
        write_plan_png(plan, Path(args.png))
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvgate plan`` to the CLI; it dispatches through ``args.func(args) -> int``."""
    parser = subparsers.add_parser(
        "plan",
        help="KV capacity plan: KV per request, max concurrency, TPOT/TTFT bounds",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--model",
        required=True,
        help="preset name, HF id of a preset, config.json or its directory",
    )
    parser.add_argument("--gpu", help=f"GPU preset ({', '.join(GPU_PRESETS)}; h100 = h100-80g)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, help="GPU memory in GiB (overrides the preset)"
    )
    parser.add_argument(
        "--gpu-bandwidth-tbs", type=float, help="memory bandwidth in TB/s (10^12 B/s)"
    )
    parser.add_argument("--gpu-tflops", type=float, help="dense bf16 TFLOP/s")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    parser.add_argument(
        "--context",
        default=DEFAULT_CONTEXTS,
        help=f"comma-separated context lengths, K = 1024 (default {DEFAULT_CONTEXTS})",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        help="KV cache dtype: auto (the model's), fp8, fp16, bf16, fp32",
    )
    parser.add_argument(
        "--reserved-gb",
        type=float,
        default=10.0,
        help="GiB per GPU kept for activations etc. (default 10)",
    )
    parser.add_argument(
        "--weights-gb", type=float, help="weight size in GiB, overriding params x dtype"
    )
    parser.add_argument(
        "--utilisation", type=float, default=0.5, help="prefill FLOP/s utilisation (default 0.5)"
    )
    pd = parser.add_argument_group(
        "prefill/decode split (printed when --pd-rate is given)")
    pd.add_argument("--pd-rate", type=float, help="requests per second (Poisson) to size for")
    pd.add_argument("--pd-mix", default=DEFAULT_PD_MIX,
                    help="request classes NAME=SHARE:PROMPT:OUTPUT tokens, K = 1024"
                         f" (default {DEFAULT_PD_MIX})")
    pd.add_argument("--pd-ttft-ms", type=float, default=2000.0,
                    help="mean TTFT target of every class (default 2000)")
    pd.add_argument("--pd-tpot-ms", type=float, default=50.0,
                    help="mean TPOT target (default 50)")
    pd.add_argument("--pd-link-gbps", type=float, default=DEFAULT_LINK_BYTES_PER_S * 8 / 1e9,
                    help="KV transfer link, Gb/s (default 200: one RDMA NIC)")
    pd.add_argument("--pd-max-prefill-utilisation", type=float,
                    default=DEFAULT_MAX_PREFILL_UTILISATION,
                    help="sizing keeps prefill GPUs at most this busy (default"
                         f" {DEFAULT_MAX_PREFILL_UTILISATION:g})")
    pd.add_argument("--pd-split", help="also estimate this split, PREFILL+DECODE, e.g. 4+12")
    parser.add_argument("--png", help="also write a chart to this PNG file")
    parser.add_argument(
        "--json", action="store_true", help="print JSON (bytes, seconds) instead of tables"
    )
    parser.set_defaults(func=run_plan)
