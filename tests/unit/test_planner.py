"""Capacity planner against the seed articles' worked examples, and the ``kvgate plan`` command.

Seed 000 §3 and §5.2 give the capacity, TPOT and TTFT examples reproduced here. Memory is in GiB
(the seeds' "GB" = 1024**3 bytes); bandwidth and FLOP/s are decimal except where a test reproduces
the seeds' own TPOT reading (GiB divided by "1000 GB/s").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from gateway.kvmath import MODEL_PRESETS, GiB, KiB, MiB, ModelArch, format_bytes
from gateway.planner import (
    GPU_PRESETS,
    GpuSpec,
    attention_flops,
    decode_step_time_s,
    kv_budget_bytes,
    make_plan,
    max_concurrency,
    parse_contexts,
    parse_profile,
    prefill_flops,
    prefill_time_s,
    register,
    resolve_gpu,
)

K = 1024

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
SEED_7B_MHA_14GIB = dataclasses.replace(SEED_7B_MHA, weight_bytes_override=14 * GiB)
SEED_7B_GQA8_14GIB = dataclasses.replace(SEED_7B_MHA_14GIB, num_kv_heads=8)
SEED_CARD = GpuSpec("seed-80g", 80 * GiB, 2.0e12, 300e12)  # "80 GB 显存的卡", "300 TFLOPS 级别"
SEED_RESERVED = 10 * GiB  # "激活值等各种开销预留 10 GB"


def seed_bandwidth_card(tb_per_s: float) -> GpuSpec:
    """The seeds' TPOT arithmetic divides GiB by TB/s as if 1 TB/s were 1000 GiB/s."""
    return dataclasses.replace(SEED_CARD, bandwidth_bytes_per_s=tb_per_s * 1000 * GiB)


# -- capacity --------------------------------------------------------------------------------------


def test_seed_80gb_card_leaves_56_gib_for_kv_after_14_gib_weights_and_10_reserved() -> None:
    # Seed 000 §3.4 / §5.2: "剩余约 56 GB" (and §3.1 "大约在 50 到 60 GB").
    assert kv_budget_bytes(SEED_7B_MHA_14GIB, SEED_CARD, SEED_RESERVED) == 56 * GiB


def test_seed_80gb_card_holds_14_concurrent_8k_requests_with_mha() -> None:
    # "MHA 配置下 8K 上下文单路 KV 4 GB，并发上限约 14 路"
    assert max_concurrency(SEED_7B_MHA_14GIB, SEED_CARD, 8 * K, reserved_bytes=SEED_RESERVED) == 14


def test_seed_80gb_card_holds_56_concurrent_8k_requests_with_8_kv_heads() -> None:
    # "换成 GQA 8 个 KV 头，8K 上下文单路 KV 1 GB，并发上限约 56 路" - four times MHA.
    assert max_concurrency(SEED_7B_GQA8_14GIB, SEED_CARD, 8 * K, reserved_bytes=SEED_RESERVED) == 56


def test_seed_80gb_card_holds_3_concurrent_32k_mha_requests() -> None:
    # "如果每条请求升到 32K 上下文，每条 KV 16 GB，只能并行 3 到 4 路" (56 / 16 = 3.5, floored).
    assert max_concurrency(SEED_7B_MHA_14GIB, SEED_CARD, 32 * K, reserved_bytes=SEED_RESERVED) == 3


def test_seed_concurrency_holds_with_weights_as_7e9_params_times_2_bytes() -> None:
    # 7e9 x 2 B = 14e9 B (13.04 GiB): the same answers, so the seeds' loose "14 GB" does not matter.
    assert max_concurrency(SEED_7B_MHA, SEED_CARD, 8 * K, reserved_bytes=SEED_RESERVED) == 14
    gqa = dataclasses.replace(SEED_7B_MHA, num_kv_heads=8)
    assert max_concurrency(gqa, SEED_CARD, 8 * K, reserved_bytes=SEED_RESERVED) == 56


def test_fp8_kv_doubles_concurrency() -> None:
    fp16 = max_concurrency(SEED_7B_MHA_14GIB, SEED_CARD, 8 * K, "auto", SEED_RESERVED)
    fp8 = max_concurrency(SEED_7B_MHA_14GIB, SEED_CARD, 8 * K, "fp8", SEED_RESERVED)
    assert (fp16, fp8) == (14, 28)


def test_a_single_128k_mha_request_does_not_fit_an_80gb_card() -> None:
    # Seed 000 §3.1: "128K 上下文，单路 KV 64 GB，单卡根本放不下".
    assert max_concurrency(SEED_7B_MHA_14GIB, SEED_CARD, 128 * K, reserved_bytes=SEED_RESERVED) == 0


def test_weights_larger_than_the_gpu_give_zero_concurrency_and_tensor_parallel_fixes_it() -> None:
    llama70 = MODEL_PRESETS["llama-3-70b"]
    h100 = GPU_PRESETS["h100-80g"]
    assert kv_budget_bytes(llama70, h100, SEED_RESERVED) < 0
    assert max_concurrency(llama70, h100, 8 * K, reserved_bytes=SEED_RESERVED) == 0
    # Two ranks: 65.7 GiB of weights and 160 KiB/token each -> 4.29 GiB / 1.25 GiB = 3.
    assert (
        max_concurrency(llama70, h100, 8 * K, reserved_bytes=SEED_RESERVED, tensor_parallel=2) == 3
    )


def test_sliding_window_model_concurrency_stops_shrinking_past_the_window() -> None:
    mistral = MODEL_PRESETS["mistral-7b-v0.1"]
    h100 = GPU_PRESETS["h100-80g"]
    at_8k = max_concurrency(mistral, h100, 8 * K, reserved_bytes=SEED_RESERVED)
    assert at_8k == max_concurrency(mistral, h100, 128 * K, reserved_bytes=SEED_RESERVED)
    assert at_8k == kv_budget_bytes(mistral, h100, SEED_RESERVED) // (512 * MiB)


# -- decode (TPOT) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "tb_per_s", "expected_ms"),
    [(8 * K, 3.0, 6.0), (8 * K, 2.0, 9.0), (32 * K, 3.0, 10.0), (32 * K, 2.0, 15.0)],
)
def test_decode_lower_bound_reproduces_seed_tpot_in_the_seeds_units(
    context: int, tb_per_s: float, expected_ms: float
) -> None:
    # Seed 000 §3.2: 14 + 4 = 18 GB -> "6 到 9 ms"; 14 + 16 = 30 GB -> "10 到 15 ms" at 2-3 TB/s.
    seconds = decode_step_time_s(SEED_7B_MHA_14GIB, seed_bandwidth_card(tb_per_s), context)
    assert seconds * 1e3 == pytest.approx(expected_ms)


def test_decode_lower_bound_with_datasheet_bandwidth_is_7_4_percent_above_the_seeds() -> None:
    at_3tbs = dataclasses.replace(SEED_CARD, bandwidth_bytes_per_s=3e12)
    seconds = decode_step_time_s(SEED_7B_MHA_14GIB, at_3tbs, 8 * K)
    assert seconds == pytest.approx(18 * GiB / 3e12)
    assert seconds * 1e3 == pytest.approx(6.44, abs=0.01)
    assert seconds / 0.006 == pytest.approx(GiB / 1e9)


def test_decode_step_reads_every_sequence_in_the_batch() -> None:
    card = seed_bandwidth_card(2.0)
    one = decode_step_time_s(SEED_7B_MHA_14GIB, card, 8 * K)
    fourteen = decode_step_time_s(SEED_7B_MHA_14GIB, card, 14 * 8 * K, batch_size=14)
    assert fourteen * 1e3 == pytest.approx((14 + 14 * 4) / 2)  # 70 GiB at 2000 GiB/s = 35 ms
    assert fourteen > one


def test_decode_batch_size_caps_each_sliding_window_sequence_separately() -> None:
    mistral = MODEL_PRESETS["mistral-7b-v0.1"]
    h100 = GPU_PRESETS["h100-80g"]
    four = decode_step_time_s(mistral, h100, 4 * 8 * K, batch_size=4)
    assert four == pytest.approx((mistral.weight_bytes + 4 * 512 * MiB) / 3.35e12)
    lumped = decode_step_time_s(mistral, h100, 4 * 8 * K)
    assert lumped == pytest.approx((mistral.weight_bytes + 512 * MiB) / 3.35e12)


def test_decode_with_tensor_parallel_reads_one_shard_per_gpu() -> None:
    llama70 = MODEL_PRESETS["llama-3-70b"]
    h100 = GPU_PRESETS["h100-80g"]
    seconds = decode_step_time_s(llama70, h100, 8 * K, tensor_parallel=4)
    assert seconds == pytest.approx((llama70.weight_bytes / 4 + 8 * K * 80 * KiB) / 3.35e12)


def test_decode_needs_about_two_flops_per_parameter_per_token() -> None:
    # Seed 000 §3.2: "大约就是 2 倍参数量的一次前向（7B 模型约 14 GFLOPs）".
    assert prefill_flops(SEED_7B_MHA, 1) == 14e9


# -- prefill (TTFT) --------------------------------------------------------------------------------


def test_prefill_of_8k_tokens_on_a_7b_model_is_about_115_tflop() -> None:
    # Seed 000 §3.3: "2 × 7e9 × 8192 ≈ 115 TFLOPs".
    flops = prefill_flops(SEED_7B_MHA, 8 * K)
    assert flops == 2 * 7e9 * 8192 == pytest.approx(114.688e12)
    assert round(flops / 1e12) == 115


def test_prefill_8k_takes_under_half_a_second_at_full_use_and_about_a_second_at_30_to_50() -> None:
    # "理论耗时不到半秒，但实际利用率往往只有 30% 到 50%，所以实际耗时往往在 1 秒甚至更高".
    assert prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, utilisation=1.0) == pytest.approx(
        0.3823, abs=1e-4
    )
    assert prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, utilisation=0.5) == pytest.approx(
        0.765, abs=1e-3
    )
    assert prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, utilisation=0.3) > 1.0


def test_prefill_time_grows_linearly_with_prompt_length() -> None:
    # "输入越长，这个值线性增长".
    short = prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K)
    assert prefill_time_s(SEED_7B_MHA, SEED_CARD, 16 * K) == pytest.approx(2 * short)


def test_prefill_of_moe_counts_active_parameters() -> None:
    ds = MODEL_PRESETS["deepseek-v3"]
    assert prefill_flops(ds, 1000) == 2.0 * ds.active_params * 1000
    assert prefill_flops(ds, 1000) < 0.06 * 2.0 * ds.num_params * 1000


def test_attention_flops_count_causal_pairs_and_cap_sliding_layers() -> None:
    tiny = dataclasses.replace(
        SEED_7B_MHA, num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=1
    )
    assert attention_flops(tiny, 3) == 4 * 6  # pairs (1 + 2 + 3), 4 FLOPs each
    windowed = dataclasses.replace(tiny, sliding_window=2)
    assert attention_flops(windowed, 3) == 4 * (1 + 2 + 2)
    llama8 = MODEL_PRESETS["llama-3-8b"]
    with_attention = prefill_flops(llama8, 128 * K, include_attention=True)
    assert with_attention / prefill_flops(llama8, 128 * K) == pytest.approx(3.14, abs=0.01)


def test_prefill_with_tensor_parallel_splits_the_flops() -> None:
    one = prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K)
    assert prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, tensor_parallel=4) == pytest.approx(
        one / 4
    )


# -- GPUs and profiles -----------------------------------------------------------------------------


def test_gpu_presets_carry_datasheet_numbers() -> None:
    a100, h100, h200 = GPU_PRESETS["a100-80g"], GPU_PRESETS["h100-80g"], GPU_PRESETS["h200-141g"]
    assert (a100.memory_bytes, a100.bandwidth_bytes_per_s, a100.flops) == (
        80 * GiB,
        2.039e12,
        312e12,
    )
    assert (h100.memory_bytes, h100.bandwidth_bytes_per_s, h100.flops) == (
        80 * GiB,
        3.35e12,
        989.5e12,
    )
    assert (h200.memory_bytes, h200.bandwidth_bytes_per_s, h200.flops) == (
        141 * GiB,
        4.8e12,
        989.5e12,
    )


def test_gpu_aliases_resolve_case_insensitively() -> None:
    assert resolve_gpu("h100") is GPU_PRESETS["h100-80g"]
    assert resolve_gpu("H200") is GPU_PRESETS["h200-141g"]
    assert resolve_gpu("A100-80GB") is GPU_PRESETS["a100-80g"]
    with pytest.raises(ValueError, match=r"unknown GPU 'tpu-v5'.*h100-80g"):
        resolve_gpu("tpu-v5")


def test_parse_profile_splits_model_and_gpu() -> None:
    model, gpu = parse_profile("llama-3-8b@h100")
    assert model is MODEL_PRESETS["llama-3-8b"] and gpu is GPU_PRESETS["h100-80g"]
    model, gpu = parse_profile("meta-llama/Llama-3.1-70B-Instruct@a100")
    assert model is MODEL_PRESETS["llama-3-70b"] and gpu is GPU_PRESETS["a100-80g"]


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ("llama-3-8b", "MODEL@GPU"),
        ("@h100", "MODEL@GPU"),
        ("llama-3-8b@", "MODEL@GPU"),
        ("llama-3-8b@tpu", "unknown GPU"),
        ("nope@h100", "neither a preset"),
    ],
)
def test_parse_profile_rejects_malformed_profiles(profile: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_profile(profile)


# -- bad input -------------------------------------------------------------------------------------


def test_planner_functions_reject_out_of_range_arguments() -> None:
    with pytest.raises(ValueError, match="utilisation"):
        prefill_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, utilisation=0)
    with pytest.raises(ValueError, match="batch_size"):
        decode_step_time_s(SEED_7B_MHA, SEED_CARD, 8 * K, batch_size=0)
    with pytest.raises(ValueError, match="context_tokens"):
        max_concurrency(SEED_7B_MHA, SEED_CARD, 0)
    with pytest.raises(ValueError, match="reserved_bytes"):
        max_concurrency(SEED_7B_MHA, SEED_CARD, 8 * K, reserved_bytes=-1)
    with pytest.raises(ValueError, match="tensor_parallel"):
        max_concurrency(SEED_7B_MHA, SEED_CARD, 8 * K, tensor_parallel=0)
    with pytest.raises(ValueError, match="positive"):
        GpuSpec("broken", 0, 1.0, 1.0)


def test_parse_contexts_accepts_k_suffix_as_1024() -> None:
    assert parse_contexts("2048, 8K,128k") == [2048, 8192, 131072]
    for bad in ("", "abc", "0", "8KB"):
        with pytest.raises(ValueError):
            parse_contexts(bad)


def test_format_bytes_uses_binary_units() -> None:
    assert format_bytes(512 * KiB) == "512 KiB"
    assert format_bytes(4 * GiB) == "4 GiB"
    assert format_bytes(55.04 * GiB) == "55.04 GiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(-2 * GiB) == "-2 GiB"


def test_make_plan_rows_match_the_functions() -> None:
    plan = make_plan(SEED_7B_MHA_14GIB, SEED_CARD, [8 * K, 128 * K], reserved_bytes=SEED_RESERVED)
    eight, long = plan.rows
    assert (eight.kv_bytes_per_request, eight.max_concurrency) == (4 * GiB, 14)
    assert eight.kv_share_of_weights == pytest.approx(4 / 14)
    assert eight.tpot_at_max_s == pytest.approx((14 + 56) * GiB / 2e12)
    assert long.max_concurrency == 0 and long.tpot_at_max_s is None


# -- the CLI ---------------------------------------------------------------------------------------


def run_plan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    captured = capsys.readouterr()
    return int(rc), captured.out, captured.err


def _row(out: str, context: str) -> list[str]:
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == context:
            return fields
    raise AssertionError(f"no row for {context} in:\n{out}")


def test_plan_cli_prints_llama_3_8b_on_h100_tables(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_plan_cli(["--model", "llama-3-8b", "--gpu", "h100-80g"], capsys)
    assert rc == 0, err
    assert "128 KiB per token" in out
    assert "80 GiB - 14.96 GiB weights - 10 GiB reserved = 55.04 GiB for KV cache" in out
    assert _row(out, "8K")[:5] == ["8K", "1", "GiB", "6.7%", "55"]
    assert _row(out, "128K")[:5] == ["128K", "16", "GiB", "107.0%", "3"]
    for context in ("2K", "32K"):
        _row(out, context)


def test_plan_cli_reproduces_the_seed_7b_tables_from_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    }
    path = tmp_path / "seed-7b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config), encoding="utf-8")
    argv = ["--model", str(path), "--gpu-memory-gb", "80", "--gpu-bandwidth-tbs", "2",
            "--gpu-tflops", "300", "--weights-gb", "14", "--reserved-gb", "10",
            "--context", "1K,8K,32K,128K"]  # fmt: skip
    rc, out, err = run_plan_cli(argv, capsys)
    assert rc == 0, err
    assert "512 KiB per token" in out
    assert "= 56 GiB for KV cache" in out
    assert _row(out, "1K")[1:5] == ["512", "MiB", "3.6%", "112"]
    assert _row(out, "8K")[1:5] == ["4", "GiB", "28.6%", "14"]
    assert _row(out, "32K")[1:5] == ["16", "GiB", "114.3%", "3"]
    assert _row(out, "128K")[1:6] == ["64", "GiB", "457.1%", "0", _row(out, "128K")[5]]
    assert _row(out, "128K")[6] == "-"  # nothing fits: no TPOT at max concurrency


def test_plan_cli_fp8_and_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100",
        "--kv-dtype",
        "fp8",
        "--context",
        "8K",
        "--json",
    ]
    rc, out, err = run_plan_cli(argv, capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 64 * KiB
    assert data["gpu"]["name"] == "h100-80g"
    assert data["rows"][0]["kv_bytes_per_request"] == GiB // 2
    assert data["rows"][0]["max_concurrency"] == 110


def test_plan_cli_tensor_parallel_fits_llama_3_70b(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_plan_cli(
        ["--model", "llama-3-70b", "--gpu", "h100", "--tp", "2", "--context", "8K"], capsys
    )
    assert rc == 0, err
    assert "2 x h100-80g" in out and "160 KiB per token per GPU" in out
    assert _row(out, "8K")[4] == "3"


def test_plan_cli_reports_when_weights_alone_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_plan_cli(
        ["--model", "deepseek-v3", "--gpu", "h200", "--context", "8K"], capsys
    )
    assert rc == 0
    assert "nothing fits" in out
    assert _row(out, "8K")[4] == "0"


def test_plan_cli_writes_a_png_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    rc, _, err = run_plan_cli(["--model", "gemma-2-9b", "--gpu", "a100", "--png", str(png)], capsys)
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3-8b"], "give --gpu PRESET"),
        (["--model", "llama-3-8b", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--model", "nope", "--gpu", "h100"], "'nope' is neither a preset"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--context", "8X"], "bad context length '8X'"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--kv-dtype", "int4"], "'int4'"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--weights-gb", "-1"], "--weights-gb"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--reserved-gb", "-1"], "--reserved-gb"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--utilisation", "2"], "utilisation"),
    ],
)
def test_plan_cli_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_plan_cli(argv, capsys)
    assert rc == 2
    assert out == ""
    assert message in err


def test_plan_cli_custom_gpu_fields_override_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100",
        "--gpu-memory-gb",
        "94",
        "--context",
        "8K",
        "--json",
    ]
    rc, out, err = run_plan_cli(argv, capsys)
    assert rc == 0, err
    gpu = json.loads(out)["gpu"]
    assert gpu["memory_bytes"] == 94 * GiB and gpu["bandwidth_bytes_per_s"] == 3.35e12
