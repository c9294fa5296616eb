"""KV-cache arithmetic: how many bytes of KV cache a token, a request and a batch hold.

Formulas
--------
A standard attention layer caches, for every token, one key and one value vector per KV head::

    per layer, per token  = 2 x num_kv_heads x head_dim x bytes_per_element          (MHA, GQA, MQA)
    per token             = 2 x num_layers x num_kv_heads x head_dim x bytes_per_element

MHA has as many KV heads as query heads, GQA fewer (Llama-3-70B: 64 query heads, 8 KV heads, so an
eighth of the MHA cache), MQA one. MLA (DeepSeek-V2/V3) caches one compressed latent of
``kv_lora_rank`` elements plus the decoupled RoPE key of ``qk_rope_head_dim`` elements, shared by
every head, so there is no x2 and no head multiplier::

    MLA per layer, per token = (kv_lora_rank + qk_rope_head_dim) x bytes_per_element

A request of T tokens holds ``sum over layers of per_layer x T_layer`` where T_layer = T on a
full-attention layer and min(T, sliding_window) on a sliding-window layer (such a layer keeps only
the last ``sliding_window`` tokens' K/V). ``kv_bytes_per_token`` is the uncapped per-token figure;
``kv_bytes_for_tokens`` applies the cap. The bytes per element are the KV cache dtype's: ``auto``
is the model dtype (vLLM's ``--kv-cache-dtype auto``), FP8 is one byte, which halves a 16-bit cache.

Under tensor parallelism each rank holds ceil(num_kv_heads / tp) KV heads (vLLM replicates a KV head
when there are more ranks than heads) and, for MLA, the whole latent (it is not split by head);
``tensor_parallel`` selects that per-GPU view.

Units
-----
Bytes are bytes. Memory sizes use binary units, KiB = 2**10, MiB = 2**20, GiB = 2**30, and "8K
tokens" means 8 x 1024 = 8192. The seed articles write "KB/GB" and say to divide by 1024**3; under
this convention their worked figures come out exactly as stated (512 KiB/token, 4 GiB at 8K, 64 GiB
at 128K, 320 KiB/token and 40 GiB at 128K for Llama-3-70B). Bandwidth and FLOP/s (``planner``)
are decimal, as datasheets state them.

Assumptions and what they are compared to
-----------------------------------------
* The cache is counted at token granularity. vLLM allocates 16-token blocks, so a request holds up
  to 15 tokens' worth more; a sliding-window layer keeps about one block more than its window.
* ``num_params`` drives weight bytes and prefill FLOPs. When a config does not carry it,
  ``estimate_params`` counts embeddings (+ an untied LM head), attention projections (q/k/v/o, or
  MLA's low-rank projections), gated MLPs (three hidden x intermediate matrices: SwiGLU/GeGLU),
  MoE routed experts, shared experts and routers, and two norms per layer. It leaves out biases
  other than attention biases, rotary buffers, attention sinks, multi-token-prediction layers and
  vision towers. It reproduces Hugging Face's exact counts for Llama-2-7B (6,738,415,616),
  Llama-3-8B (8,030,261,248), Llama-3-70B (70,553,706,496), Mistral-7B (7,241,732,096) and
  Qwen2.5-7B (7,615,616,512), and DeepSeek-V3's published 671B.
* MoE models also get ``num_active_params`` (routed experts counted top_k / n_experts), which the
  planner uses for FLOPs; weights always count every expert.
* Quantised checkpoints (``quantization_config``: fp8, mxfp4, gptq/awq ``bits``,
  compressed-tensors ``num_bits``) get ``weight_bytes_override``: quantised linear layers at their
  width, embeddings and norms at the model dtype, scales ignored (< 1% for FP8 block scales, ~4% for
  4-bit group-128 formats).
* A ``float32`` config dtype is taken as 2 bytes: vLLM's ``--dtype auto`` serves float32
  checkpoints in 16 bits.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gateway.presets import HF_CONFIGS, HF_IDS, NUM_PARAMS

log = logging.getLogger(__name__)

KiB: Final = 1024
MiB: Final = 1024**2
GiB: Final = 1024**3
TiB: Final = 1024**4


def format_bytes(n: float) -> str:
    """Binary units, at most two decimals: ``512 KiB``, ``4 GiB``, ``55.04 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            text = f"{n / size:.2f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{n:.0f} B"


FULL_ATTENTION: Final = "full_attention"
SLIDING_ATTENTION: Final = "sliding_attention"
LAYER_TYPES: Final = (FULL_ATTENTION, SLIDING_ATTENTION)

_KV_DTYPE_BYTES: Final[dict[str, int]] = {
    # vLLM --kv-cache-dtype names
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "bfloat16": 2,
    # the seeds' INT8 and common spellings
    "int8": 1,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "fp32": 4,
    "float32": 4,
}

_MODEL_DTYPE_BYTES: Final[dict[str, int]] = {
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    # vLLM --dtype auto serves float32 checkpoints in 16 bits (bf16 for Gemma, fp16 otherwise).
    "float32": 2,
    "float": 2,
    "fp32": 2,
}


def kv_dtype_bytes(kv_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per KV element: ``auto`` is the model dtype; fp8 variants (and int8) 1; fp16/bf16 2;
    fp32 4. Raises ``ValueError`` naming an unknown dtype."""
    key = kv_dtype.strip().lower()
    if key == "auto":
        if model_dtype_bytes <= 0:
            raise ValueError(f"model dtype bytes must be positive, got {model_dtype_bytes}")
        return model_dtype_bytes
    try:
        return _KV_DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(["auto", *sorted(_KV_DTYPE_BYTES)])
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; known: {known}") from None


def recomputed_kv_tokens_without_cache(generated_tokens: int) -> int:
    """Tokens whose K/V a cache-less decoder recomputes while generating ``generated_tokens``:
    step t recomputes the t - 1 earlier ones, S(S - 1)/2 in all, about S**2 / 2 (seed 000: ~520
    thousand at S = 1024, over 33 million at 8192)."""
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens must be >= 0, got {generated_tokens}")
    return generated_tokens * (generated_tokens - 1) // 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ModelArch:
    """The parts of a model's architecture that KV memory, weight memory and FLOPs depend on."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # MHA: == heads; GQA: fewer; MQA: 1
    head_dim: int  # MLA: qk_nope_head_dim + qk_rope_head_dim (the query/key head width)
    hidden_size: int
    num_params: int  # total parameters: weight bytes and prefill FLOPs come from this
    dtype_bytes: int  # model (weight and activation) dtype bytes, 2 for bf16/fp16
    kv_lora_rank: int | None = None  # MLA (DeepSeek-V2/V3): latent dim
    qk_rope_head_dim: int | None = None  # MLA: decoupled rope key dim
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer: "full_attention" | "sliding_attention"
    num_active_params: int | None = None  # MoE: parameters a token passes through; None = all
    weight_bytes_override: int | None = None  # quantised checkpoint or measured size

    def __post_init__(self) -> None:
        positive = {
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "num_params": self.num_params,
            "dtype_bytes": self.dtype_bytes,
        }
        for field_name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{self.name}: {field_name} must be positive, got {value}")
        if self.num_kv_heads > self.num_attention_heads:
            raise ValueError(
                f"{self.name}: num_kv_heads ({self.num_kv_heads}) exceeds"
                f" num_attention_heads ({self.num_attention_heads})"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")
        for field_name, opt in (
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("sliding_window", self.sliding_window),
            ("num_active_params", self.num_active_params),
            ("weight_bytes_override", self.weight_bytes_override),
        ):
            if opt is not None and opt <= 0:
                raise ValueError(f"{self.name}: {field_name} must be positive, got {opt}")
        if self.num_active_params is not None and self.num_active_params > self.num_params:
            raise ValueError(f"{self.name}: num_active_params exceeds num_params")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"{self.name}: layer_types has {len(self.layer_types)} entries"
                    f" for {self.num_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(
                    f"{self.name}: unsupported layer type(s) {unknown}; known: {list(LAYER_TYPES)}"
                )
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{self.name}: sliding_attention layers need a sliding_window")

    # -- structure -------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_kind(self) -> str:
        """``MLA``, ``MHA`` (KV heads == heads), ``MQA`` (one KV head) or ``GQA``."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention type: the explicit ``layer_types``, else every layer sliding
        when ``sliding_window`` is set, else every layer full."""
        if self.layer_types is not None:
            return self.layer_types
        kind = SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION
        return (kind,) * self.num_layers

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for kind in self.layer_kinds if kind == SLIDING_ATTENTION)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: ``num_active_params`` for MoE, else all."""
        return self.num_active_params if self.num_active_params is not None else self.num_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the GPU(s): the override when set, else num_params x dtype_bytes."""
        if self.weight_bytes_override is not None:
            return self.weight_bytes_override
        return self.num_params * self.dtype_bytes

    # -- KV arithmetic ---------------------------------------------------------------------------

    def kv_heads_per_rank(self, tensor_parallel: int = 1) -> int:
        """KV heads one tensor-parallel rank caches: ceil(kv_heads / tp), at least one."""
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        return _ceil_div(self.num_kv_heads, tensor_parallel)

    def kv_bytes_per_token_per_layer(
        self, kv_dtype: str = "auto", *, tensor_parallel: int = 1
    ) -> int:
        """One layer's KV bytes for one token (on one rank when ``tensor_parallel`` > 1)."""
        element = kv_dtype_bytes(kv_dtype, self.dtype_bytes)
        heads = self.kv_heads_per_rank(tensor_parallel)
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is not None:
            # The latent is shared by all heads and replicated on every rank.
            return (self.kv_lora_rank + self.qk_rope_head_dim) * element
        return 2 * heads * self.head_dim * element

    def kv_bytes_per_token(self, kv_dtype: str = "auto", *, tensor_parallel: int = 1) -> int:
        """KV bytes one token adds across all layers, with no sliding-window cap."""
        per_layer = self.kv_bytes_per_token_per_layer(kv_dtype, tensor_parallel=tensor_parallel)
        return self.num_layers * per_layer

    def kv_bytes_for_tokens(
        self, tokens: int, kv_dtype: str = "auto", *, tensor_parallel: int = 1
    ) -> int:
        """KV bytes a sequence of ``tokens`` holds: sliding-window layers capped at the window."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        per_layer = self.kv_bytes_per_token_per_layer(kv_dtype, tensor_parallel=tensor_parallel)
        sliding = self.num_sliding_layers
        full = self.num_layers - sliding
        capped = min(tokens, self.sliding_window) if self.sliding_window is not None else tokens
        return per_layer * (full * tokens + sliding * capped)


# -- parameter estimate ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamEstimate:
    """A config's parameters by part (see the module docstring for what is counted)."""

    embedding: int  # input embedding
    lm_head: int  # output projection; 0 when tied to the embedding
    attention: int  # all layers' attention projections (and attention biases)
    mlp: int  # dense MLPs, shared experts and routers: every token passes through them
    experts: int  # routed experts, all of them
    active_experts: int  # routed experts one token passes through (top_k of n per MoE layer)
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.experts + self.norms

    @property
    def active(self) -> int:
        return self.total - self.experts + self.active_experts

    @property
    def linear(self) -> int:
        """Parameters in linear layers, the ones weight quantisation applies to."""
        return self.attention + self.mlp + self.experts


_MISSING: Final = object()


def _get_int(cfg: Mapping[str, object], key: str, default: object = _MISSING) -> int:
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ValueError(f"config has no {key!r}")
        if not isinstance(default, int):
            raise TypeError(f"default for {key!r} must be an int")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config {key!r} must be an integer, got {value!r}")
    return value


def _get_opt_int(cfg: Mapping[str, object], key: str) -> int | None:
    if cfg.get(key) is None:
        return None
    return _get_int(cfg, key)


def _first_int(cfg: Mapping[str, object], *keys: str) -> int | None:
    for key in keys:
        value = _get_opt_int(cfg, key)
        if value is not None:
            return value
    return None


def _model_type(cfg: Mapping[str, object]) -> str:
    value = cfg.get("model_type")
    return value.lower() if isinstance(value, str) else ""


def _head_dim(cfg: Mapping[str, object], hidden: int, heads: int) -> int:
    explicit = _get_opt_int(cfg, "head_dim")
    if explicit is not None:
        return explicit
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads; set head_dim")
    return hidden // heads


def _moe_layers(cfg: Mapping[str, object], num_layers: int) -> list[bool]:
    """Which layers carry routed experts (DeepSeek and Qwen-MoE conventions; else all)."""
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        first_dense = _get_int(cfg, "first_k_dense_replace", 0)
        freq = _get_int(cfg, "moe_layer_freq", 1)
        return [i >= first_dense and i % freq == 0 for i in range(num_layers)]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        step = _get_int(cfg, "decoder_sparse_step", 1)
        raw = cfg.get("mlp_only_layers") or []
        dense_only = set(raw) if isinstance(raw, list) else set()
        return [i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
    return [True] * num_layers


def estimate_params(config: Mapping[str, object]) -> ParamEstimate:
    """Count a decoder's parameters from its ``config.json`` (approximations: module docstring)."""
    cfg = _text_config(config)
    hidden = _get_int(cfg, "hidden_size")
    layers = _get_int(cfg, "num_hidden_layers")
    heads = _get_int(cfg, "num_attention_heads")
    kv_heads = _get_int(cfg, "num_key_value_heads", heads)
    vocab = _get_int(cfg, "vocab_size")
    intermediate = _get_int(cfg, "intermediate_size")
    tied = cfg.get("tie_word_embeddings", True) is not False  # HF's default is tied

    kv_lora = _get_opt_int(cfg, "kv_lora_rank")
    if kv_lora is not None:
        rope = _get_int(cfg, "qk_rope_head_dim")
        nope = _get_int(cfg, "qk_nope_head_dim")
        v_dim = _get_int(cfg, "v_head_dim")
        q_lora = _get_opt_int(cfg, "q_lora_rank")
        if q_lora is not None:
            q_proj = hidden * q_lora + q_lora + q_lora * heads * (nope + rope)
        else:
            q_proj = hidden * heads * (nope + rope)
        kv_proj = hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
        attention_per_layer = q_proj + kv_proj + heads * v_dim * hidden
    else:
        head_dim = _head_dim(cfg, hidden, heads)
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        attention_per_layer = 2 * hidden * q_width + 2 * hidden * kv_width
        if cfg.get("attention_bias") is True:
            attention_per_layer += q_width + 2 * kv_width + hidden
        elif _model_type(cfg) in ("qwen2", "qwen2_moe"):  # q/k/v biases, no o bias
            attention_per_layer += q_width + 2 * kv_width

    n_experts = _first_int(cfg, "n_routed_experts", "num_local_experts", "num_experts") or 0
    dense_mlp = 3 * hidden * intermediate
    mlp = experts = active_experts = 0
    if n_experts > 0:
        top_k = _first_int(cfg, "num_experts_per_tok", "experts_per_token")
        if top_k is None:
            raise ValueError("MoE config has no 'num_experts_per_tok' / 'experts_per_token'")
        expert = 3 * hidden * (_get_opt_int(cfg, "moe_intermediate_size") or intermediate)
        shared = _get_int(cfg, "n_shared_experts", 0) * expert
        shared += 3 * hidden * _get_int(cfg, "shared_expert_intermediate_size", 0)
        for is_moe in _moe_layers(cfg, layers):
            if is_moe:
                mlp += shared + hidden * n_experts  # shared experts + router
                experts += n_experts * expert
                active_experts += min(top_k, n_experts) * expert
            else:
                mlp += dense_mlp
    else:
        mlp = layers * dense_mlp

    return ParamEstimate(
        embedding=vocab * hidden,
        lm_head=0 if tied else vocab * hidden,
        attention=layers * attention_per_layer,
        mlp=mlp,
        experts=experts,
        active_experts=active_experts,
        norms=(2 * layers + 1) * hidden,
    )


def _quantised_weight_bytes(
    cfg: Mapping[str, object], params: ParamEstimate, num_params: int, dtype_bytes: int
) -> int | None:
    """Weight bytes of a quantised checkpoint, or None when the config declares no quantisation."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    method = str(qc.get("quant_method", "")).lower()
    # Parts not quantised stay at the model dtype; scale num_params' excess over the estimate
    # (e.g. a published count) onto them.
    unquantised = max(num_params - params.linear, 0)
    if method in ("fp8", "fbgemm_fp8"):
        return params.linear + unquantised * dtype_bytes
    if method == "mxfp4":  # experts only: 4-bit values + one 8-bit scale per 32 values
        rest = max(num_params - params.experts, 0)
        return math.ceil(params.experts * 4.25 / 8) + rest * dtype_bytes
    bits: object = qc.get("bits", qc.get("w_bit"))
    if bits is None and method == "compressed-tensors":
        groups = qc.get("config_groups")
        for group in groups.values() if isinstance(groups, Mapping) else ():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and isinstance(weights.get("num_bits"), int):
                bits = weights["num_bits"]
                break
    if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
        return math.ceil(params.linear * bits / 8) + unquantised * dtype_bytes
    log.warning(
        "quantization method %r not understood; weights counted at %d bytes/param (an upper"
        " bound; pass a measured size with weight_bytes_override / --weights-gb)",
        method,
        dtype_bytes,
    )
    return None


# -- config.json parsing ---------------------------------------------------------------------------


def _text_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """The language model's config: multimodal configs nest it under ``text_config``."""
    nested = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(nested, Mapping):
        merged: dict[str, object] = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(nested)
        return merged
    return config


def _dtype_bytes(cfg: Mapping[str, object]) -> int:
    raw = cfg.get("torch_dtype", cfg.get("dtype"))
    if raw is None:
        return 2  # nothing is served in fp32; 16 bits is vLLM's choice for an unstated dtype
    name = str(raw).lower().removeprefix("torch.")
    try:
        return _MODEL_DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(
            f"unknown model dtype {raw!r}; known: {', '.join(sorted(_MODEL_DTYPE_BYTES))}"
        ) from None


def _sliding_window_and_layer_types(
    cfg: Mapping[str, object], num_layers: int
) -> tuple[int | None, tuple[str, ...] | None]:
    window = _get_opt_int(cfg, "sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2/3 ship a window they do not use
        window = None
    raw_types = cfg.get("layer_types")
    if raw_types is not None:
        if not isinstance(raw_types, list | tuple) or not all(
            isinstance(t, str) for t in raw_types
        ):
            raise ValueError(f"config 'layer_types' must be a list of strings, got {raw_types!r}")
        types = tuple(str(t) for t in raw_types)
        return (window if SLIDING_ATTENTION in types else None), types
    if window is None:
        return None, None
    pattern = _get_opt_int(cfg, "sliding_window_pattern")
    if pattern is not None:  # Gemma 3: every pattern-th layer is global
        kinds = [
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        ]
        return window, tuple(kinds)
    if _model_type(cfg) == "gemma2":  # local and global alternate, layer 0 local
        kinds = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
        return window, tuple(kinds)
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        first_sliding = _get_int(cfg, "max_window_layers")  # Qwen2: layers from here on slide
        kinds = [
            SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)
        ]
        return window, tuple(kinds)
    return window, None


def arch_from_hf_config(
    config: Mapping[str, object], name: str, *, num_params: int | None = None
) -> ModelArch:
    """A ``ModelArch`` from a Hugging Face ``config.json`` mapping.

    Reads ``num_key_value_heads`` (absent: MHA), ``head_dim`` (absent: hidden / heads),
    ``torch_dtype`` or ``dtype``, MLA's ``kv_lora_rank`` / ``qk_rope_head_dim``, and
    ``sliding_window`` with ``layer_types``, ``sliding_window_pattern``, Gemma 2's alternation or
    Qwen's ``use_sliding_window`` / ``max_window_layers``. ``num_params`` defaults to
    ``estimate_params``; MoE and quantised configs also get active params and weight bytes.
    Raises ``ValueError`` naming a missing or malformed key.
    """
    cfg = _text_config(config)
    try:
        layers = _get_int(cfg, "num_hidden_layers")
        heads = _get_int(cfg, "num_attention_heads")
        kv_heads = _get_int(cfg, "num_key_value_heads", heads)
        hidden = _get_int(cfg, "hidden_size")
        dtype_bytes = _dtype_bytes(cfg)
        kv_lora = _get_opt_int(cfg, "kv_lora_rank")
        rope: int | None = None
        if kv_lora is not None:
            rope = _get_int(cfg, "qk_rope_head_dim")
            head_dim = _get_int(cfg, "qk_nope_head_dim") + rope
        else:
            head_dim = _head_dim(cfg, hidden, heads)
        window, layer_types = _sliding_window_and_layer_types(cfg, layers)
        params = estimate_params(cfg)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    total = num_params if num_params is not None else params.total
    active: int | None = None
    if params.experts:
        active = max(total - params.experts + params.active_experts, 1)
    return ModelArch(
        name=name,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        num_params=total,
        dtype_bytes=dtype_bytes,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        sliding_window=window,
        layer_types=layer_types,
        num_active_params=active,
        weight_bytes_override=_quantised_weight_bytes(cfg, params, total, dtype_bytes),
    )


# -- presets and loading ---------------------------------------------------------------------------

MODEL_PRESETS: Final[dict[str, ModelArch]] = {
    preset: arch_from_hf_config(config, preset, num_params=NUM_PARAMS.get(preset))
    for preset, config in HF_CONFIGS.items()
}

_ALIASES: Final[dict[str, str]] = {
    alias.lower(): preset for preset, ids in HF_IDS.items() for alias in ids
}


def model_preset(name: str) -> ModelArch | None:
    """The preset called ``name`` (case-insensitive; Hugging Face ids too), or None."""
    key = name.strip().lower()
    preset = MODEL_PRESETS.get(key) or MODEL_PRESETS.get(_ALIASES.get(key, ""))
    return preset


def load_model_arch(source: str) -> ModelArch:
    """A preset name (or its Hugging Face id), a path to a ``config.json``, or a directory that
    holds one. Raises ``ValueError`` saying which of these ``source`` failed to be."""
    preset = model_preset(source)
    if preset is not None:
        return preset
    path = Path(source).expanduser()
    if path.is_dir():
        directory, path = path, path / "config.json"
        if not path.is_file():
            raise ValueError(f"directory {str(directory)!r} has no config.json")
        name = directory.resolve().name
    elif path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    else:
        raise ValueError(
            f"model {source!r} is neither a preset ({', '.join(sorted(MODEL_PRESETS))})"
            " nor an existing config.json file or directory"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r} as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return arch_from_hf_config(config, name or path.stem)
