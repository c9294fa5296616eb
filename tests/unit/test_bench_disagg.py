"""The P/D benchmark's pure parts: its workload, the gateway configs of both layouts, the
measured window, the modelled-time conversion, the comparison cells and the prediction."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from gateway.bench.disagg import (
    LAYOUTS,
    LONG_OUTPUT,
    LONG_TOKENS,
    Cell,
    MixSpec,
    build_mix,
    gateway_config,
    in_model_time,
    lag_warnings,
    measured,
    parse_args,
    predict,
)
from gateway.bench.stats import RequestRecord
from gateway.config import build_settings


def record(scheduled_s: float, **kw: float | None) -> RequestRecord:
    return RequestRecord(index=0, group="chat", status=200, error=None, scheduled_s=scheduled_s,
                         sent_s=scheduled_s, ttft_s=kw.get("ttft_s", 0.2),
                         tpot_s=kw.get("tpot_s", 0.01), e2e_s=kw.get("e2e_s", 2.0),
                         prompt_tokens=200, completion_tokens=100, cached_tokens=None,
                         approx_prompt_tokens=200, chunks=100)


def test_mix_is_identical_on_every_call_and_across_builds() -> None:
    mix = MixSpec(50, seed=3, tokens_per_word=2.0)
    first = list(build_mix(mix).all_requests())
    assert first == list(build_mix(mix).all_requests()) == list(build_mix(mix).requests())
    assert build_mix(mix).total == 50


def test_mix_draws_sizes_within_each_class_range_with_unique_markers() -> None:
    requests = list(build_mix(MixSpec(400, long_fraction=0.2)).all_requests())
    groups = Counter(r.group for r in requests)
    assert set(groups) == {"chat", "long"} and 40 < groups["long"] < 130
    for r in requests:
        if r.group == "long":
            assert LONG_TOKENS[0] * 0.95 <= r.approx_prompt_tokens <= LONG_TOKENS[1] * 1.05
            assert LONG_OUTPUT[0] <= r.max_tokens <= LONG_OUTPUT[1]
        else:
            assert r.approx_prompt_tokens < 400 and 100 <= r.max_tokens <= 300
    assert len({r.messages[0].content.split(".")[0] for r in requests}) == 400


def test_mix_without_long_prompts_is_all_chat_and_the_planner_sees_one_class() -> None:
    mix = MixSpec(30, long_fraction=0.0)
    assert {r.group for r in build_mix(mix).all_requests()} == {"chat"}
    assert [c.name for c in mix.classes()] == ["chat"]


@pytest.mark.parametrize("bad", [{"requests": 0}, {"long_fraction": 1.5},
                                 {"chat_output": (300, 100)}])
def test_mix_refuses_impossible_sizes(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MixSpec(**{"requests": 10, **bad})  # type: ignore[arg-type]


def test_every_layout_is_a_valid_gateway_config_and_only_the_pd_ones_are_disaggregated(
        ) -> None:
    decode = [f"http://127.0.0.1:{9000 + i}" for i in range(12)]
    prefill = [f"http://127.0.0.1:{9100 + i}" for i in range(4)]
    mixed = build_settings(gateway_config(decode + prefill)).pools[0]
    pd = build_settings(gateway_config(decode, prefill)).pools[0]
    selective = build_settings(gateway_config(decode, prefill, 1024)).pools[0]
    assert not mixed.disaggregated and len(mixed.workers) == 16
    assert pd.disaggregated and len(pd.workers) == 12 and len(pd.prefill_workers) == 4
    assert (pd.remote_prefill_min_tokens, selective.remote_prefill_min_tokens) == (0, 1024)


def test_measured_window_leaves_out_the_warm_up_share() -> None:
    records = [record(t) for t in (0.0, 5.0, 15.0, 90.0)]
    assert [r.scheduled_s for r in measured(records, 100.0)] == [15.0, 90.0]


def test_model_time_divides_every_time_by_the_time_scale() -> None:
    r = in_model_time(record(10.0, ttft_s=0.4, tpot_s=0.02, e2e_s=4.0), 2.0)
    assert (r.scheduled_s, r.sent_s, r.ttft_s, r.tpot_s, r.e2e_s) == (5.0, 5.0, 0.2, 0.01, 2.0)
    assert in_model_time(record(1.0, ttft_s=None, tpot_s=None), 2.0).ttft_s is None


def test_cell_names_the_lower_layout_the_winner() -> None:
    assert Cell("chat", "tpot_p99", {"mixed": 11.4, "pd": 5.9}).winner == "pd"
    assert Cell("chat", "ttft_p50", {"mixed": 16.0, "pd": 32.0}).winner == "mixed"
    assert Cell("chat", "ttft_p50", {"mixed": 16.0, "pd": 32.0}).ratio("pd") == pytest.approx(2.0)
    assert Cell("chat", "ttft_p50", {"mixed": None, "pd": 32.0}).winner is None
    three = Cell("chat", "ttft_p99", {"mixed": 34.0, "pd": 670.0, "pd-selective": 30.0})
    assert three.winner == "pd-selective"
    assert three.ratio("pd-selective") == pytest.approx(30 / 34)


def test_prediction_at_the_default_load_is_stable_with_prefill_well_below_capacity() -> None:
    pred = predict(MixSpec(100), 16.0, 25e9)
    e = pred.estimate
    assert (e.prefill_gpus, e.decode_gpus) == (4, 12) and e.stable
    assert 0.2 < e.prefill_utilisation < 0.7
    assert math.isfinite(e.colocated_tpot_s) and e.colocated_tpot_s > e.tpot_s


def test_quick_shortens_the_run_and_layouts_are_checked(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    args = parse_args(["--quick", "--layouts", "pd"])
    assert args.duration_s == 20.0 and args.layouts == ["pd"]
    assert parse_args([]).layouts == list(LAYOUTS)
    with pytest.raises(SystemExit):
        parse_args(["--layouts", "mixed,colocated"])
    assert "--layouts" in capsys.readouterr().err


def test_lag_warnings_count_the_engines_falling_behind_and_a_missing_log_as_none(
        tmp_path: Path) -> None:
    log = tmp_path / "sim.log"
    log.write_text("start\nWARNING gateway.sim.engine: simulated engine fell 56 ms behind its"
                   " model clock: ...\nok\nfell 80 ms behind its model clock\n")
    assert lag_warnings(log) == 2
    assert lag_warnings(tmp_path / "missing.log") == 0
