"""Model presets as Hugging Face ``config.json`` contents, for ``gateway.kvmath``.

Each entry holds the fields of the model's published ``config.json`` that the KV arithmetic and the
parameter estimate read (layers, heads, KV heads, head_dim, hidden and MLP sizes, vocabulary, dtype,
MLA / MoE / sliding-window / quantisation keys), copied from the model repository named in
``HF_IDS``. ``kvmath.MODEL_PRESETS`` is built by running these through ``arch_from_hf_config``,
so the presets exercise the same parser an operator's own ``config.json`` goes through.

They are Python literals rather than ``.json`` files so that they ship in every install: the
distribution declares no package data.

Where a key is set differently from the upstream file it says so in a comment.
"""

from __future__ import annotations

from typing import Final

HF_CONFIGS: Final[dict[str, dict[str, object]]] = {
    # The seeds' "typical 7B": MHA, 32 layers x 32 heads x 128, FP16 (hidden 4096).
    "llama-2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    },
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Seed 001's worked example: 80 layers x 8 KV heads x 128.
    "llama-3-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # GQA 7:1; sliding_window is set upstream but disabled by use_sliding_window=false.
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Seed 003's sliding-window example: every layer keeps only the last 4096 tokens.
    "mistral-7b-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Local (4096-token window) and global layers alternate, layer 0 local; the file has no
    # layer_types, the pattern comes from model_type gemma2. Upstream torch_dtype is float32; vLLM
    # serves it in bf16 (kvmath maps float32 to 2 bytes anyway).
    "gemma-2-9b": {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    # MoE (32 experts, top-4) with explicit per-layer types: 128-token sliding window on even layers.
    # Expert weights ship in MXFP4 (4-bit values + one 8-bit scale per 32 = 4.25 bits).
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "attention_bias": True,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    },
    # MLA (kv_lora_rank 512 + rope 64 per layer) and MoE (256 routed + 1 shared, top-8, first 3
    # layers dense). Weights ship in FP8 with 128x128 block scales. The multi-token-prediction
    # layer (num_nextn_predict_layers) is not counted: it only serves speculative decoding.
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    },
}

# Published parameter counts, used where kvmath's estimate is not exact. Gemma 2 has four norms per
# layer where the estimate counts two (a 0.003% difference).
NUM_PARAMS: Final[dict[str, int]] = {
    "gemma-2-9b": 9_241_705_984,
}

# Hugging Face repository ids (and same-architecture siblings) that resolve to each preset.
HF_IDS: Final[dict[str, tuple[str, ...]]] = {
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"),
    "llama-3-8b": (
        "meta-llama/Meta-Llama-3-8B",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
    ),
    "llama-3-70b": (
        "meta-llama/Meta-Llama-3-70B",
        "meta-llama/Meta-Llama-3-70B-Instruct",
        "meta-llama/Llama-3.1-70B",
        "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
    ),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    "mistral-7b-v0.1": ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1"),
    "gemma-2-9b": ("google/gemma-2-9b", "google/gemma-2-9b-it"),
    "gpt-oss-20b": ("openai/gpt-oss-20b",),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-0324"),
}
