"""The planner's prefill/decode section: queueing, transfer and decode sizing against hand-worked
numbers, the sizing search, and ``kvgate plan --pd-*``."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from gateway.kvmath import load_model_arch
from gateway.planner import (
    PdWorkload,
    RequestClass,
    decode_step_time_s,
    erlang_c,
    estimate_pd,
    parse_mix,
    parse_split,
    pd_estimate_to_json,
    prefill_time_s,
    register,
    resolve_gpu,
    size_pd,
)

MODEL = load_model_arch("llama-3-8b")
H100 = resolve_gpu("h100")
KV_TOKEN = MODEL.kv_bytes_per_token()
CHAT = RequestClass("chat", 0.85, 200, 200)
LONG = RequestClass("long", 0.15, 16384, 16)


def workload(rate: float = 12.0, **targets: float) -> PdWorkload:
    return PdWorkload(rate, (CHAT, LONG), **targets)


def test_erlang_c_of_one_server_is_its_utilisation() -> None:
    assert erlang_c(1, 0.3) == pytest.approx(0.3)


def test_erlang_c_matches_the_textbook_value_for_two_servers() -> None:
    # M/M/2 at a = 1 (rho 0.5): C = (a^2/2 / (1 - rho)) / (1 + a + a^2/2 / (1 - rho)) = 1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)


def test_erlang_c_is_one_when_offered_load_reaches_the_servers() -> None:
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(4, 0.0) == 0.0


def test_prefill_utilisation_is_rate_times_mean_prefill_over_prefill_gpus() -> None:
    e = estimate_pd(MODEL, H100, workload(), 4, 12)
    mean_s = 0.85 * prefill_time_s(MODEL, H100, 200) + 0.15 * prefill_time_s(MODEL, H100, 16384)
    assert e.prefill_utilisation == pytest.approx(12.0 * mean_s / 4)


def test_transfer_time_is_prompt_kv_bytes_over_the_link() -> None:
    e = estimate_pd(MODEL, H100, workload(), 4, 12, link_bytes_per_s=25e9)
    long = next(c for c in e.classes if c.name == "long")
    assert long.transfer_s == pytest.approx(16384 * KV_TOKEN / 25e9)


def test_ttft_adds_wait_prefill_transfer_and_one_decode_step() -> None:
    e = estimate_pd(MODEL, H100, workload(), 4, 12)
    for c in e.classes:
        assert c.ttft_s > e.prefill_wait_s + c.prefill_s + c.transfer_s
        assert c.ttft_s - (e.prefill_wait_s + c.prefill_s + c.transfer_s) < 0.01


def test_decode_batch_satisfies_littles_law_at_its_own_tpot() -> None:
    e = estimate_pd(MODEL, H100, workload(rate=40.0), 4, 3)
    tokens_per_s_per_gpu = 40.0 * (0.85 * 200 + 0.15 * 16) / 3
    assert e.decode_batch == pytest.approx(tokens_per_s_per_gpu * e.tpot_s, rel=0.02)


def test_colocated_tpot_exceeds_disaggregated_when_prefills_share_the_steps() -> None:
    e = estimate_pd(MODEL, H100, workload(rate=16.0), 4, 12)
    assert e.colocated_tpot_s > e.tpot_s


def test_prefill_overload_is_reported_unstable_with_infinite_wait() -> None:
    e = estimate_pd(MODEL, H100, workload(rate=100.0), 1, 12)
    assert e.prefill_utilisation > 1 and math.isinf(e.prefill_wait_s) and not e.stable


def test_sizing_picks_the_smallest_counts_that_meet_both_targets() -> None:
    w = workload(rate=30.0, ttft_target_s=1.0, tpot_target_s=0.006)
    plan = size_pd(MODEL, H100, w)
    assert plan.sized is not None
    p, d = plan.sized.prefill_gpus, plan.sized.decode_gpus
    assert max(c.ttft_s for c in plan.sized.classes) <= 1.0 and plan.sized.tpot_s <= 0.006
    fewer_prefill = estimate_pd(MODEL, H100, w, p - 1, d) if p > 1 else None
    assert fewer_prefill is None or not (
        fewer_prefill.prefill_utilisation < 1
        and max(c.ttft_s for c in fewer_prefill.classes) <= 1.0)
    assert d == 1 or estimate_pd(MODEL, H100, w, p, d - 1).tpot_s > 0.006


def test_sizing_finds_nothing_when_one_decode_step_misses_the_tpot_target() -> None:
    floor = decode_step_time_s(MODEL, H100, 0)
    plan = size_pd(MODEL, H100, workload(tpot_target_s=floor / 2), max_gpus=64)
    assert plan.sized is None


def test_mix_parses_names_shares_and_k_suffixed_tokens() -> None:
    assert parse_mix("chat=0.8:200:200, long=0.2:16K:16") == (
        RequestClass("chat", 0.8, 200, 200), RequestClass("long", 0.2, 16384, 16))


@pytest.mark.parametrize("text", ["chat", "chat=0.5:200", "chat=x:1:1", "chat=0.5:0:1", ""])
def test_mix_refuses_malformed_classes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_mix(text)


def test_workload_refuses_shares_that_do_not_sum_to_one() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        PdWorkload(1.0, (RequestClass("a", 0.5, 1, 1),))


@pytest.mark.parametrize("text", ["4", "4+0", "a+b", "+3"])
def test_split_refuses_anything_but_two_positive_counts(text: str) -> None:
    with pytest.raises(ValueError):
        parse_split(text)


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_plan_prints_the_pd_section_only_when_a_rate_is_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--model", "llama-3-8b", "--gpu", "h100"]) == 0
    assert "prefill/decode split" not in capsys.readouterr().out
    assert _run(["plan", "--model", "llama-3-8b", "--gpu", "h100", "--pd-rate", "12",
                 "--pd-split", "4+12"]) == 0
    out = capsys.readouterr().out
    assert "prefill/decode split" in out and "4 prefill + 12 decode GPUs" in out


def test_plan_json_carries_the_pd_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--model", "llama-3-8b", "--gpu", "h100", "--json", "--pd-rate", "12",
                 "--pd-split", "4+12"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["disagg"]["given"]["prefill_gpus"] == 4
    assert data["disagg"]["sized"]["stable"] is True


def test_plan_answers_2_on_a_bad_mix(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--model", "llama-3-8b", "--gpu", "h100", "--pd-rate", "1",
                 "--pd-mix", "chat=1:200"]) == 2
    assert "bad request class" in capsys.readouterr().err


def test_sizing_keeps_prefill_gpus_below_the_utilisation_cap_even_when_ttft_allows_more() -> None:
    w = workload(rate=16.0, ttft_target_s=30.0)
    loose = size_pd(MODEL, H100, w, max_prefill_utilisation=0.99)
    capped = size_pd(MODEL, H100, w, max_prefill_utilisation=0.5)
    assert loose.sized is not None and capped.sized is not None
    assert capped.sized.prefill_utilisation <= 0.5 < loose.sized.prefill_utilisation
    assert capped.sized.prefill_gpus > loose.sized.prefill_gpus


def test_overloaded_estimate_serialises_to_strict_json_with_nulls() -> None:
    e = estimate_pd(MODEL, H100, workload(rate=100.0), 1, 12)
    text = json.dumps(pd_estimate_to_json(e), allow_nan=False)
    data = json.loads(text)
    assert data["prefill_wait_s"] is None and data["stable"] is False
    assert all(c["ttft_s"] is None for c in data["classes"])
