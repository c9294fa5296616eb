"""KV arithmetic against the seed articles' worked figures (../shared/seeds/) and real configs.

Seed 000 = "KV Cache ... 长上下文的真实成本", 001 = "KV Cache 完全解析", 003 = "论坛助手" post.
Sizes are in binary units (KiB/MiB/GiB), "8K" = 8192 tokens: the convention under which the seeds'
figures come out exactly as they state them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gateway.kvmath import (
    FULL_ATTENTION,
    MODEL_PRESETS,
    SLIDING_ATTENTION,
    GiB,
    KiB,
    MiB,
    ModelArch,
    arch_from_hf_config,
    estimate_params,
    kv_dtype_bytes,
    load_model_arch,
    recomputed_kv_tokens_without_cache,
)

K = 1024

# Seed 000's "typical 7B": hidden 4096, 32 layers, 32 heads, head_dim 128, FP16, "7B" parameters.
SEED_7B_MHA = ModelArch(
    name="seed-7b-mha",
    num_layers=32,
    num_attention_heads=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_size=4096,
    num_params=7_000_000_000,
    dtype_bytes=2,
)
SEED_7B_GQA8 = dataclasses.replace(SEED_7B_MHA, name="seed-7b-gqa8", num_kv_heads=8)
SEED_WEIGHTS = 14 * GiB  # "7B 模型的 FP16 权重约 14 GB", used as GiB like every seed size


def write_config(directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


LLAMA_LIKE: dict[str, object] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


# -- seed 000: the 7B MHA worked example ---------------------------------------------------------


def test_seed_7b_mha_one_layer_holds_16_kib_per_token() -> None:
    # "单层单 token：2 × 32 × 128 × 2 字节 = 16 KB"
    assert SEED_7B_MHA.kv_bytes_per_token_per_layer() == 16 * KiB


def test_seed_7b_mha_holds_512_kib_per_token() -> None:
    # "全部 32 层：16 KB × 32 = 512 KB/token"
    assert SEED_7B_MHA.kv_bytes_per_token() == 512 * KiB == 524_288


@pytest.mark.parametrize(
    ("tokens", "expected_bytes", "share_of_14_gib_weights"),
    [
        (1 * K, 512 * MiB, 0.036),  # the seed prints 3.7% (512/14000: MB over decimal GB)
        (8 * K, 4 * GiB, 0.286),
        (32 * K, 16 * GiB, 1.143),  # "约 114%"
        (128 * K, 64 * GiB, 4.571),  # "约 457%"
    ],
)
def test_seed_7b_mha_context_table_matches_kv_totals_and_weight_shares(
    tokens: int, expected_bytes: int, share_of_14_gib_weights: float
) -> None:
    kv = SEED_7B_MHA.kv_bytes_for_tokens(tokens)
    assert kv == expected_bytes
    assert round(kv / SEED_WEIGHTS, 3) == share_of_14_gib_weights


@pytest.mark.parametrize(
    ("rounds", "expected"), [(1, 512 * MiB), (2, GiB), (4, 2 * GiB), (8, 4 * GiB)]
)
def test_conversation_growing_1k_tokens_per_round_reaches_seed_totals(
    rounds: int, expected: int
) -> None:
    # Seed 000 §2.3: 1K tokens a round, 512 KB/token.
    assert SEED_7B_MHA.kv_bytes_for_tokens(rounds * K) == expected


def test_gqa_with_8_kv_heads_holds_128_kib_per_token_and_1_gib_at_8k_4_gib_at_32k() -> None:
    # Seed 000 §2.2 and §4.1: "每层只有 8 个 KV 头 ... 4 KB ... 128 KB/token; 8K 1 GB; 32K 4 GB".
    assert SEED_7B_GQA8.kv_bytes_per_token_per_layer() == 4 * KiB
    assert SEED_7B_GQA8.kv_bytes_per_token() == 128 * KiB
    assert SEED_7B_GQA8.kv_bytes_for_tokens(8 * K) == GiB
    assert SEED_7B_GQA8.kv_bytes_for_tokens(32 * K) == 4 * GiB
    assert SEED_7B_GQA8.kv_bytes_per_token() * 4 == SEED_7B_MHA.kv_bytes_per_token()  # "1/4"


def test_mqa_with_one_kv_head_holds_a_32nd_of_mha() -> None:
    # Seed 000 §4.1: "MQA ... KV Cache 直接降到原来的 1/32".
    mqa = dataclasses.replace(SEED_7B_MHA, num_kv_heads=1)
    assert mqa.attention_kind == "MQA"
    assert mqa.kv_bytes_per_token() == 16 * KiB == SEED_7B_MHA.kv_bytes_per_token() // 32


def test_attention_kind_names_mha_gqa_mqa_and_mla() -> None:
    assert SEED_7B_MHA.attention_kind == "MHA"
    assert SEED_7B_GQA8.attention_kind == "GQA"
    assert MODEL_PRESETS["deepseek-v3"].attention_kind == "MLA"


def test_fp8_kv_cache_halves_a_16_bit_cache() -> None:
    # Seed 000 §4.2: "FP16 换成 INT8 或 FP8，KV Cache 减半".
    assert SEED_7B_MHA.kv_bytes_per_token("fp8") == 256 * KiB
    assert SEED_7B_MHA.kv_bytes_for_tokens(8 * K, "fp8_e4m3") == 2 * GiB
    assert SEED_7B_MHA.kv_bytes_for_tokens(8 * K, "int8") == 2 * GiB
    llama70 = MODEL_PRESETS["llama-3-70b"]
    assert llama70.kv_bytes_per_token("fp8") * 2 == llama70.kv_bytes_per_token("auto")


def test_recomputation_without_cache_is_about_half_s_squared() -> None:
    # Seed 000 §1.3: S = 1024 -> "约 52 万"; S = 8192 -> "超过 3300 万".
    assert recomputed_kv_tokens_without_cache(1024) == 523_776
    assert round(recomputed_kv_tokens_without_cache(1024), -4) == 520_000
    assert recomputed_kv_tokens_without_cache(8192) > 33_000_000
    assert 1024**2 // 2 == 524_288 and 8192**2 // 2 == 33_554_432  # the seed's S^2/2
    with pytest.raises(ValueError, match="generated_tokens"):
        recomputed_kv_tokens_without_cache(-1)


# -- seeds 001 and 003: Llama-3-70B and the 32 x 8 KV-head 7B --------------------------------------


def test_llama_3_70b_holds_320_kib_per_token_and_40_gib_at_128k() -> None:
    # Seed 001: "2 × 80 × 8 × 128 × 2 ≈ 327,680 字节 ≈ 320KB / token ... 128K → 约 40 GB".
    llama70 = MODEL_PRESETS["llama-3-70b"]
    assert (llama70.num_layers, llama70.num_kv_heads, llama70.head_dim) == (80, 8, 128)
    assert llama70.kv_bytes_per_token() == 327_680 == 320 * KiB
    assert llama70.kv_bytes_for_tokens(128 * K) == 40 * GiB
    assert round(llama70.kv_bytes_per_token() / MiB, 1) == 0.3  # seed 003: "≈ 0.3 MB/token"


def test_llama_3_70b_gqa_is_an_eighth_of_its_mha_equivalent() -> None:
    # Seed 001: "70B 从 64 个 Q 头压到 8 个 KV 头，缓存直接缩到 1/8".
    llama70 = MODEL_PRESETS["llama-3-70b"]
    mha = dataclasses.replace(llama70, num_kv_heads=llama70.num_attention_heads)
    assert mha.kv_bytes_per_token() == 8 * llama70.kv_bytes_per_token()


def test_llama_3_70b_seed_figures_that_use_decimal_thousands_of_tokens() -> None:
    """Seed 001's "8K → 约 2.6 GB" is 8,000 tokens in decimal GB; seed 003's "128K ≈ 39 GB" is
    128,000 tokens in GiB. With 8K = 8192 they are 2.5 GiB and 40 GiB (seed 001's own 128K figure)."""
    llama70 = MODEL_PRESETS["llama-3-70b"]
    assert round(llama70.kv_bytes_for_tokens(8_000) / 1e9, 1) == 2.6
    assert round(llama70.kv_bytes_for_tokens(128_000) / GiB) == 39
    assert llama70.kv_bytes_for_tokens(8 * K) == 2.5 * GiB


def test_seed_003_7b_with_8_kv_heads_holds_0_125_mib_per_token_and_16_gib_at_128k() -> None:
    # Seed 003: "7B 级模型（32 层 × 8 KV 头，Mistral 7B 同构）：约 0.125 MB/token，128K ≈ 16 GB".
    mistral = MODEL_PRESETS["mistral-7b-v0.1"]
    assert mistral.kv_bytes_per_token() == 0.125 * MiB
    assert SEED_7B_GQA8.kv_bytes_for_tokens(128 * K) == 16 * GiB


# -- sliding windows and per-layer patterns --------------------------------------------------------


def test_sliding_window_caps_mistral_kv_at_the_4096_token_window() -> None:
    # Seed 003: "Mistral 7B ... 窗口设为 4096，超出窗口的老 token KV 直接丢弃，显存占用恒定".
    mistral = MODEL_PRESETS["mistral-7b-v0.1"]
    assert mistral.sliding_window == 4096
    assert mistral.num_sliding_layers == 32
    assert mistral.kv_bytes_for_tokens(2048) == 2048 * 128 * KiB
    at_window = mistral.kv_bytes_for_tokens(4096)
    assert at_window == 512 * MiB
    assert mistral.kv_bytes_for_tokens(8 * K) == at_window
    assert mistral.kv_bytes_for_tokens(128 * K) == at_window  # not the 16 GiB of a full cache
    assert mistral.kv_bytes_per_token() * 128 * K == 16 * GiB  # per-token figure is uncapped


def test_gemma_2_alternates_local_and_global_layers_starting_with_local() -> None:
    gemma = MODEL_PRESETS["gemma-2-9b"]
    assert gemma.layer_kinds[:4] == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert gemma.num_sliding_layers == 21
    per_layer = 2 * 8 * 256 * 2
    assert gemma.kv_bytes_per_token() == 42 * per_layer == 336 * KiB
    assert gemma.kv_bytes_for_tokens(8 * K) == per_layer * (21 * 8 * K + 21 * 4096)
    assert gemma.kv_bytes_for_tokens(4096) == 42 * per_layer * 4096


def test_gpt_oss_per_layer_types_cap_only_the_sliding_layers() -> None:
    oss = MODEL_PRESETS["gpt-oss-20b"]
    assert oss.sliding_window == 128
    assert oss.num_sliding_layers == 12
    per_layer = 2 * 8 * 64 * 2
    assert oss.kv_bytes_per_token() == 24 * per_layer == 48 * KiB
    assert oss.kv_bytes_for_tokens(100) == 24 * per_layer * 100
    assert oss.kv_bytes_for_tokens(32 * K) == per_layer * (12 * 32 * K + 12 * 128)


def test_model_without_window_is_never_capped() -> None:
    llama8 = MODEL_PRESETS["llama-3-8b"]
    assert llama8.num_sliding_layers == 0
    assert llama8.kv_bytes_for_tokens(128 * K) == 128 * K * llama8.kv_bytes_per_token()


# -- MLA -------------------------------------------------------------------------------------------


def test_mla_caches_latent_plus_rope_key_per_layer_without_x2_or_heads() -> None:
    ds = MODEL_PRESETS["deepseek-v3"]
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.num_layers) == (512, 64, 61)
    assert ds.kv_bytes_per_token_per_layer() == (512 + 64) * 2
    assert ds.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert ds.kv_bytes_for_tokens(128 * K) == 70_272 * 128 * K  # 8.58 GiB at 128K
    assert ds.kv_bytes_per_token("fp8") == 61 * 576


def test_mla_is_far_smaller_than_mha_over_the_same_heads() -> None:
    ds = MODEL_PRESETS["deepseek-v3"]
    mha_equivalent = 2 * ds.num_layers * ds.num_attention_heads * 128 * 2  # 128 heads x 128 dims
    assert mha_equivalent / ds.kv_bytes_per_token() == pytest.approx(56.9, abs=0.1)


def test_mla_latent_is_replicated_on_every_tensor_parallel_rank() -> None:
    ds = MODEL_PRESETS["deepseek-v3"]
    assert ds.kv_bytes_per_token(tensor_parallel=8) == ds.kv_bytes_per_token()


def test_tensor_parallel_splits_kv_heads_and_replicates_when_ranks_exceed_heads() -> None:
    llama70 = MODEL_PRESETS["llama-3-70b"]
    assert llama70.kv_bytes_per_token(tensor_parallel=2) == 160 * KiB
    assert llama70.kv_bytes_per_token(tensor_parallel=8) == 40 * KiB
    assert llama70.kv_bytes_per_token(tensor_parallel=16) == 40 * KiB  # one head per rank
    with pytest.raises(ValueError, match="tensor_parallel"):
        llama70.kv_bytes_per_token(tensor_parallel=0)


# -- dtypes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "model_bytes", "expected"),
    [
        ("auto", 2, 2),
        ("auto", 4, 4),
        ("fp8", 2, 1),
        ("fp8_e4m3", 2, 1),
        ("fp8_e5m2", 2, 1),
        ("FP16", 1, 2),
        ("bf16", 4, 2),
        ("bfloat16", 2, 2),
        ("fp32", 2, 4),
    ],
)
def test_kv_dtype_bytes_maps_names_to_element_sizes(
    kv_dtype: str, model_bytes: int, expected: int
) -> None:
    assert kv_dtype_bytes(kv_dtype, model_bytes) == expected


def test_unknown_kv_dtype_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="'int4'"):
        kv_dtype_bytes("int4", 2)
    with pytest.raises(ValueError, match="'nf4'"):
        SEED_7B_MHA.kv_bytes_per_token("nf4")


# -- parameter estimates and weights ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "hf_count"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b-v0.1", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
    ],
)
def test_param_estimate_matches_hugging_face_counts_exactly_for_dense_models(
    preset: str, hf_count: int
) -> None:
    assert MODEL_PRESETS[preset].num_params == hf_count
    assert MODEL_PRESETS[preset].active_params == hf_count


def test_param_estimate_for_gemma_2_is_within_a_thousandth_of_the_published_count() -> None:
    from gateway.presets import HF_CONFIGS

    estimate = estimate_params(HF_CONFIGS["gemma-2-9b"]).total
    assert estimate == pytest.approx(9_241_705_984, rel=1e-4)
    assert MODEL_PRESETS["gemma-2-9b"].num_params == 9_241_705_984


def test_deepseek_v3_estimate_is_671b_total_37b_active_and_fp8_weights() -> None:
    ds = MODEL_PRESETS["deepseek-v3"]
    assert ds.num_params / 1e9 == pytest.approx(671, abs=0.5)
    assert ds.active_params / 1e9 == pytest.approx(37.5, abs=0.5)
    assert ds.dtype_bytes == 2  # activations and an "auto" KV cache are bf16
    assert ds.weight_bytes / 1e9 == pytest.approx(673, abs=2)  # FP8 linear + bf16 embeddings


def test_gpt_oss_20b_estimate_is_20_9b_with_mxfp4_experts_in_12_8_gib() -> None:
    oss = MODEL_PRESETS["gpt-oss-20b"]
    assert oss.num_params / 1e9 == pytest.approx(20.91, abs=0.01)
    # The model card's 3.61B active leaves out the 0.58B input embedding; FLOPs here count it.
    assert (oss.active_params - 201_088 * 2880) / 1e9 == pytest.approx(3.61, abs=0.01)
    assert oss.weight_bytes / GiB == pytest.approx(12.8, abs=0.05)


def test_weight_bytes_are_params_times_dtype_unless_overridden() -> None:
    assert SEED_7B_MHA.weight_bytes == 14_000_000_000  # the seed's "7B x 2 = 14 GB"
    assert (
        dataclasses.replace(SEED_7B_MHA, weight_bytes_override=SEED_WEIGHTS).weight_bytes
        == 14 * GiB
    )


# -- config.json parsing and loading ---------------------------------------------------------------


def test_config_without_num_key_value_heads_is_mha(tmp_path: Path) -> None:
    arch = load_model_arch(str(write_config(tmp_path / "my-7b", LLAMA_LIKE)))
    assert arch.name == "my-7b"
    assert arch.num_kv_heads == 32
    assert arch.attention_kind == "MHA"
    assert arch.kv_bytes_per_token() == 512 * KiB
    assert arch.num_params == 6_738_415_616


def test_config_directory_loads_its_config_json(tmp_path: Path) -> None:
    write_config(tmp_path / "model-dir", {**LLAMA_LIKE, "num_key_value_heads": 8})
    arch = load_model_arch(str(tmp_path / "model-dir"))
    assert arch.name == "model-dir"
    assert arch.kv_bytes_per_token() == 128 * KiB


def test_config_explicit_head_dim_and_dtype_key_are_used() -> None:
    cfg = {**LLAMA_LIKE, "head_dim": 256, "num_key_value_heads": 4, "dtype": "bfloat16"}
    del cfg["torch_dtype"]
    arch = arch_from_hf_config(cfg, "x")
    assert arch.head_dim == 256
    assert arch.dtype_bytes == 2
    assert arch.kv_bytes_per_token() == 2 * 32 * 4 * 256 * 2


def test_float32_config_is_served_in_16_bits() -> None:
    arch = arch_from_hf_config({**LLAMA_LIKE, "torch_dtype": "float32"}, "x")
    assert arch.dtype_bytes == 2


def test_mla_config_keys_make_an_mla_arch() -> None:
    cfg = {
        **LLAMA_LIKE,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": None,
        "torch_dtype": "bfloat16",
    }
    arch = arch_from_hf_config(cfg, "deepseek-v2-lite-like")
    assert arch.is_mla
    assert arch.head_dim == 192
    assert arch.kv_bytes_per_token() == 27 * 576 * 2


def test_sliding_window_pattern_makes_every_nth_layer_global() -> None:
    cfg = {
        **LLAMA_LIKE,
        "num_hidden_layers": 12,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }
    arch = arch_from_hf_config(cfg, "gemma-3-like")
    assert arch.layer_kinds[5] == FULL_ATTENTION and arch.layer_kinds[11] == FULL_ATTENTION
    assert arch.num_sliding_layers == 10


def test_explicit_layer_types_win_and_all_full_layers_drop_the_window() -> None:
    types = [SLIDING_ATTENTION, FULL_ATTENTION] * 16
    arch = arch_from_hf_config({**LLAMA_LIKE, "sliding_window": 512, "layer_types": types}, "x")
    assert arch.num_sliding_layers == 16
    full = arch_from_hf_config(
        {**LLAMA_LIKE, "sliding_window": None, "layer_types": [FULL_ATTENTION] * 32}, "x"
    )
    assert full.num_sliding_layers == 0
    assert full.kv_bytes_for_tokens(10_000) == 10_000 * full.kv_bytes_per_token()


def test_qwen_window_is_ignored_when_use_sliding_window_is_false() -> None:
    qwen = MODEL_PRESETS["qwen2.5-7b"]
    assert qwen.sliding_window is None
    assert qwen.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 56 * KiB
    on = arch_from_hf_config(
        {**LLAMA_LIKE, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28},
        "qwen-swa",
    )
    assert on.layer_kinds[27] == FULL_ATTENTION and on.layer_kinds[28] == SLIDING_ATTENTION


def test_multimodal_config_reads_the_nested_text_config() -> None:
    text = {k: v for k, v in LLAMA_LIKE.items() if k != "torch_dtype"}
    arch = arch_from_hf_config({"torch_dtype": "bfloat16", "text_config": text}, "vlm")
    assert arch.num_layers == 32 and arch.dtype_bytes == 2


def test_moe_config_counts_all_experts_in_weights_and_top_k_in_active_params() -> None:
    cfg = {
        **LLAMA_LIKE,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 14336,
        "torch_dtype": "bfloat16",
    }
    arch = arch_from_hf_config(cfg, "mixtral-like")
    assert arch.num_params / 1e9 == pytest.approx(46.7, abs=0.1)  # Mixtral-8x7B: 46.7B
    assert arch.active_params / 1e9 == pytest.approx(12.9, abs=0.1)  # and 12.9B active


def test_quantised_configs_shrink_weight_bytes() -> None:
    dense = arch_from_hf_config(LLAMA_LIKE, "fp16")
    fp8 = arch_from_hf_config({**LLAMA_LIKE, "quantization_config": {"quant_method": "fp8"}}, "fp8")
    awq = arch_from_hf_config(
        {**LLAMA_LIKE, "quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"
    )
    ct = arch_from_hf_config(
        {
            **LLAMA_LIKE,
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 8}}},
            },
        },
        "ct",
    )
    embeddings = 2 * 32000 * 4096 + 65 * 4096
    assert fp8.weight_bytes == (dense.num_params - embeddings) + embeddings * 2
    assert ct.weight_bytes == fp8.weight_bytes
    assert awq.weight_bytes == (dense.num_params - embeddings) // 2 + embeddings * 2
    assert fp8.kv_bytes_per_token() == dense.kv_bytes_per_token()  # KV stays at the model dtype


def test_unknown_quantisation_falls_back_to_dtype_weights(caplog: pytest.LogCaptureFixture) -> None:
    arch = arch_from_hf_config({**LLAMA_LIKE, "quantization_config": {"quant_method": "nf4x"}}, "q")
    assert arch.weight_bytes == arch.num_params * 2
    assert "nf4x" in caplog.text


def test_presets_resolve_by_hugging_face_id_and_case_insensitively() -> None:
    assert load_model_arch("meta-llama/Meta-Llama-3-8B-Instruct") is MODEL_PRESETS["llama-3-8b"]
    assert load_model_arch("Llama-3-70B") is MODEL_PRESETS["llama-3-70b"]


def test_required_presets_exist() -> None:
    for name in (
        "llama-2-7b",
        "llama-3-8b",
        "llama-3-70b",
        "qwen2.5-7b",
        "deepseek-v3",
        "mistral-7b-v0.1",
        "gemma-2-9b",
        "gpt-oss-20b",
    ):
        assert MODEL_PRESETS[name].name == name
    assert MODEL_PRESETS["llama-2-7b"].kv_bytes_per_token() == SEED_7B_MHA.kv_bytes_per_token()


# -- bad input -------------------------------------------------------------------------------------


def test_load_model_arch_rejects_unknown_names_naming_the_presets() -> None:
    with pytest.raises(ValueError, match=r"'no-such-model'.*llama-3-8b"):
        load_model_arch("no-such-model")


def test_load_model_arch_rejects_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_model_arch(str(tmp_path))


def test_load_model_arch_rejects_invalid_json_and_non_objects(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="as JSON"):
        load_model_arch(str(bad))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_arch(str(listed))


def test_config_missing_a_key_names_the_key_and_model(tmp_path: Path) -> None:
    cfg = {k: v for k, v in LLAMA_LIKE.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match=r"broken: config has no 'num_hidden_layers'"):
        load_model_arch(str(write_config(tmp_path / "broken", cfg)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": "32"}, "must be an integer"),
        ({"torch_dtype": "int3"}, "unknown model dtype 'int3'"),
        ({"layer_types": [FULL_ATTENTION] * 3}, "3 entries for 32 layers"),
        ({"layer_types": ["linear_attention"] * 32}, "unsupported layer type"),
        ({"layer_types": [SLIDING_ATTENTION] * 32}, "need a sliding_window"),
        ({"hidden_size": 4100}, "not a multiple"),
        ({"num_local_experts": 8}, "num_experts_per_tok"),
        ({"num_key_value_heads": 64}, "exceeds"),
    ],
)
def test_malformed_configs_raise_value_error(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**LLAMA_LIKE, **changes}, "bad")


def test_model_arch_rejects_non_positive_sizes_and_half_mla() -> None:
    with pytest.raises(ValueError, match="num_layers must be positive"):
        dataclasses.replace(SEED_7B_MHA, num_layers=0)
    with pytest.raises(ValueError, match="MLA needs both"):
        dataclasses.replace(SEED_7B_MHA, kv_lora_rank=512)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        SEED_7B_MHA.kv_bytes_for_tokens(-1)
