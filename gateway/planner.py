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


# -- CLI -------------------------------------------------------------------------------------------

DEFAULT_CONTEXTS: Final = "2048,8192,32768,131072"


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
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print(render_plan(plan))
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
    parser.add_argument("--png", help="also write a chart to this PNG file")
    parser.add_argument(
        "--json", action="store_true", help="print JSON (bytes, seconds) instead of tables"
    )
    parser.set_defaults(func=run_plan)
