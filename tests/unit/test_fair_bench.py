"""The fairness benchmark's own logic (``gateway.bench.fairness``): its phases, seeds, the
event-loop lag it samples and the gateways it configures."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from gateway.bench.fairness import (
    ACTIVE_WINDOW_S,
    BACKLOG_CHAT_TOKENS,
    CHAT_PHASE_FACTOR,
    CHAT_TOKENS,
    FLOOD_TOKENS,
    TENANTS,
    FairnessRun,
    HostCpu,
    Load,
    PhaseResult,
    TenantResult,
    Verdict,
    finished_short_long,
    gateway_config,
    judged_interval,
    load_run,
    load_spec,
    loop_lag_s,
    main,
    model_chats,
    model_report,
    parse_args,
    plan,
    records_in_model_time,
    report,
    tenant_seed,
    ttft_by_window,
    write_run,
)
from gateway.bench.stats import RequestRecord
from gateway.sim.metrics import SimMetrics


def test_tenant_seeds_differ_between_tenants_and_phases() -> None:
    """Regression: every load of a phase ran on the phase's one seed, so b's and c's Poisson
    arrivals were the same: each chat had a twin sent at the same instant, and the two shared
    an engine step on the one worker kept for them (the unexplained pairs in the p99 tail)."""
    seeds = [tenant_seed(phase, t) for phase, t in itertools.product(range(12), TENANTS)]
    assert len(set(seeds)) == len(seeds)


def test_quiet_and_the_judged_flood_run_longer_than_the_other_phases() -> None:
    phases = {name: duration for name, _, _, duration in plan(parse_args([]))}
    d = parse_args([]).duration_s
    assert phases["quiet"] == phases["flood/room"] == CHAT_PHASE_FACTOR * d
    assert phases["flood/forward"] == phases["flood/fifo"] == phases["flood/fair"] == d


def test_the_fair_flood_is_judged_and_runs_longer_when_room_is_not_run() -> None:
    phases = {name: duration for name, _, _, duration in plan(parse_args(["--gates", "fifo,fair"]))}
    d = parse_args([]).duration_s
    assert phases["flood/fair"] == CHAT_PHASE_FACTOR * d
    assert phases["flood/fifo"] == d


async def test_loop_lag_measures_a_blocked_event_loop() -> None:
    stop = asyncio.Event()
    sampling = asyncio.create_task(loop_lag_s(stop, tick_s=0.001))
    await asyncio.sleep(0.01)
    time.sleep(0.05)  # noqa: ASYNC251  (the point: the loop is blocked ~50 ms)
    await asyncio.sleep(0.01)
    stop.set()
    lags = await sampling
    assert max(lags) >= 0.04
    assert sorted(lags)[len(lags) // 2] < 0.04  # the other ticks were not


def test_only_the_room_gateways_keep_room_and_their_reserve_is_the_one_asked() -> None:
    room = gateway_config(["http://w"], "room", 8, reserve_workers=3)["limits"]
    assert room["reserve_workers"] == 3 and room["long_prompt_tokens"] > 0
    # the command line's default reserve is the one a gateway gets when none is asked
    default = gateway_config(["http://w"], "room", 8)["limits"]["reserve_workers"]
    assert default == parse_args([]).reserve_workers
    for gate in ("forward", "fifo", "fair"):
        limits = gateway_config(["http://w"], gate, 8)["limits"]
        assert "long_prompt_tokens" not in limits and "reserve_workers" not in limits


def test_a_larger_time_scale_runs_the_same_modelled_load_slower() -> None:
    """Rates and durations are model time: at scale 4 the chats arrive 4x less often over a 4x
    longer wall-clock phase (the same chats, the same modelled utilisation); a closed loop keeps
    its clients."""
    chats = Load("b", CHAT_TOKENS, 32, rate=4.0)
    flood = Load("a", FLOOD_TOKENS, 128, users=32)
    one, four = (load_spec("flood/room", chats, 30.0, 1, s) for s in (1.0, 4.0))
    assert one.rate == 4.0 and one.duration_s == 30.0
    assert four.rate == 1.0 and four.duration_s == 120.0
    assert four.drain_s == 4 * one.drain_s and four.timeout_s == 4 * one.timeout_s
    assert one.seed == four.seed and one.salt == four.salt  # the same arrivals, stretched
    closed = load_spec("flood/room", flood, 30.0, 1, 4.0)
    assert closed.rate is None and closed.concurrency == 32 and closed.duration_s == 120.0


def test_records_read_in_model_time() -> None:
    record = RequestRecord(index=0, group="b", status=200, error=None, scheduled_s=8.0,
                           sent_s=8.4, ttft_s=0.08, tpot_s=0.02, e2e_s=0.7, prompt_tokens=200,
                           completion_tokens=32, cached_tokens=0, approx_prompt_tokens=200,
                           chunks=32)
    [same] = records_in_model_time([record], 1.0)
    assert same == record
    [model] = records_in_model_time([record], 4.0)
    assert (model.scheduled_s, model.sent_s, model.ttft_s, model.tpot_s, model.e2e_s) == (
        2.0, 2.1, 0.02, 0.005, 0.175)
    assert model.prompt_tokens == 200 and model.completion_tokens == 32


def test_the_room_gateways_active_window_is_model_time() -> None:
    assert gateway_config(["http://w"], "room", 8)["limits"]["active_window_s"] == ACTIVE_WINDOW_S
    limits = gateway_config(["http://w"], "room", 8, time_scale=4.0)["limits"]
    assert limits["active_window_s"] == 4 * ACTIVE_WINDOW_S


def test_a_workers_finished_requests_split_into_chats_and_flood_prompts() -> None:
    metrics = SimMetrics("m", block_size_tokens=16, num_gpu_blocks=1000, max_model_len=32768)
    for prompt in [CHAT_TOKENS] * 5 + [BACKLOG_CHAT_TOKENS] * 2 + [FLOOD_TOKENS] * 3:
        metrics.request_finished(finished_reason="length", num_prompt_tokens=prompt,
                                 num_generation_tokens=32, max_tokens=32, e2e_s=1.0,
                                 queue_s=0.0, prefill_s=0.1, decode_s=0.9)
    assert finished_short_long(metrics.render().decode()) == (7, 3)


def test_the_judged_flood_follows_quiet_through_the_same_gateway() -> None:
    """b and c chat on the judged gateway when a's flood comes (run cold, a's first prompts land
    on every worker, the reserve included, and the chats sent before they end pay for it)."""
    for gates, judged in (([], "room"), (["--gates", "forward,fair,fifo"], "fair")):
        phases = [(name, gateway) for name, gateway, _, _ in plan(parse_args(gates))]
        assert phases[0] == ("quiet", judged)
        assert phases[1] == (f"flood/{judged}", judged)
    names = [name for name, _, _, _ in plan(parse_args([]))]
    assert names[:5] == ["quiet", "flood/room", "flood/forward", "flood/fifo", "flood/fair"]


def test_chats_confined_to_one_worker_share_its_steps_in_model_time_alone() -> None:
    """The model-only run: the same chats over one worker rather than four (the room's reserve of
    one, against the quiet phase's spread) share most prefill steps with another chat's decode,
    and their TTFT tail rises with no host in the way."""
    spread, confined = model_chats(4, 8.0, 60.0), model_chats(1, 8.0, 60.0)
    assert 400 < spread.chats < 600 and 400 < confined.chats < 600  # ~8/s for 60 s, all served
    assert confined.mixed_share > 0.5 > 0.1 > spread.mixed_share
    assert confined.ttft_p99_ms > 1.2 * spread.ttft_p99_ms
    assert confined.ttft_p50_ms > spread.ttft_p50_ms
    lines = model_report(2, 8.0, 30.0)
    assert [line.split()[0] for line in lines[2:]] == ["2", "1"]


def test_the_room_gateways_reserve_defaults_to_the_gateways_own_auto() -> None:
    assert parse_args([]).reserve_workers == "auto"
    assert gateway_config(["http://w"], "room", 8)["limits"]["reserve_workers"] == "auto"
    assert parse_args(["--reserve-workers", "2"]).reserve_workers == 2


def test_reserve_workers_refuses_anything_but_an_integer_or_auto() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--reserve-workers", "some"])


def test_chats_are_binned_by_when_they_were_sent() -> None:
    def chat(sent_s: float, ttft_s: float | None) -> RequestRecord:
        return RequestRecord(index=0, group="b", status=200 if ttft_s else 503,
                             error=None if ttft_s else "http_503", scheduled_s=sent_s,
                             sent_s=sent_s, ttft_s=ttft_s, tpot_s=None, e2e_s=None,
                             prompt_tokens=200, completion_tokens=32, cached_tokens=0,
                             approx_prompt_tokens=200, chunks=1)

    records = [chat(0.5, 0.030), chat(4.9, 0.012), chat(5.0, 0.011), chat(9.0, None),
               chat(12.0, 0.5)]
    assert ttft_by_window(records, 12.0) == [(0.0, 2, 30.0), (5.0, 1, 11.0), (10.0, 0, None)]


def test_model_chats_report_the_chats_in_flight() -> None:
    """Little's law: 8 chats/s of ~0.15-0.2 s each keep 1-2 in flight, whatever the workers;
    the auto reserve sizes itself on this count."""
    one, four = model_chats(1, 8.0, 60.0), model_chats(4, 8.0, 60.0)
    assert 0.8 < four.inflight < 2.0
    assert one.inflight > four.inflight  # crowded chats last longer


def test_the_judged_interval_compares_the_judged_flood_with_quiet() -> None:
    quiet = [float(i) for i in range(1, 301)]
    ttfts = {"quiet": quiet, "flood/room": [2 * x for x in quiet],
             "flood/fair": [10 * x for x in quiet]}
    lo, hi = judged_interval(["quiet", "flood/room", "flood/fair", "backlog/room"], ttfts) or (0, 0)
    assert lo <= 2.0 <= hi < 10  # room's flood, not fair's
    lo, hi = judged_interval(["quiet", "flood/fair"], ttfts) or (0, 0)
    assert lo <= 10.0 <= hi
    assert judged_interval(["quiet", "flood/room"], {"quiet": quiet}) is None  # not run


def _tenant(name: str, byte_s: float) -> TenantResult:
    return TenantResult(name, 10, 9, {"503": 1}, 11.0, 19.5, byte_s)


def test_a_written_run_reads_back_whole_and_is_drawn_again(tmp_path: Path) -> None:
    """``--replot`` draws ``fairness.png`` from ``fairness.json`` alone: every field of the run
    comes back as it was (tuples included), and the plot is drawn with the interval."""
    run = FairnessRun(
        {"duration_s": 60.0, "gates": ["room"]},
        [PhaseResult("quiet", "room", {"b": _tenant("b", 3.0), "c": _tenant("c", 2.0)},
                     1.0, 4.0, {"http://w0": (240, 0)}, [(0.0, 20, 12.0), (5.0, 21, None)],
                     {"sim": 0.9, "gateway": 0.4, "loadgen": 0.3, "machine": 1.8}),
         PhaseResult("flood/room", "room", {"a": _tenant("a", 900.0), "b": _tenant("b", 3.0)}),
         PhaseResult("backlog/room", "room", {t: _tenant(t, 240.0) for t in "abcd"})],
        {"quiet": 17.0, "flood/room": 19.0, "backlog/room": None},
        [Verdict("ratio", True, "17 -> 19 ms")], (1.07, 1.22))
    write_run(run, tmp_path)
    (tmp_path / "fairness.png").unlink()
    assert load_run(tmp_path / "fairness.json") == run
    assert parse_args(["--replot", "--out", str(tmp_path)]).replot
    assert main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "fairness.png").read_bytes()[:4] == b"\x89PNG"


def test_busy_cores_are_cpu_seconds_over_wall_seconds_and_are_reported() -> None:
    """Each phase says how many cores the simulator, the gateways, the load generator and the
    machine kept busy (CPU seconds between two reads over the wall seconds between them)."""
    before = HostCpu(100.0, {"sim": 10.0, "gateway": 4.0, "loadgen": 2.0, "machine": 30.0})
    after = HostCpu(110.0, {"sim": 19.5, "gateway": 8.0, "loadgen": 5.0, "machine": 49.0})
    cores = after.cores_since(before)
    assert cores == {"sim": 0.95, "gateway": 0.4, "loadgen": 0.3, "machine": 1.9}
    phase = PhaseResult("quiet", "room", {"b": _tenant("b", 3.0)}, host_cores=cores)
    run = FairnessRun({}, [phase], {"quiet": 19.5}, [], None)
    assert "  busy cores, quiet: sim 0.95, gateway 0.40, loadgen 0.30, machine 1.90" in report(run)


def test_each_simulated_worker_runs_in_its_own_process_unless_asked_one_for_all() -> None:
    assert parse_args([]).sim_processes == "per-worker"
    assert parse_args(["--sim-processes", "one"]).sim_processes == "one"
    with pytest.raises(SystemExit):
        parse_args(["--sim-processes", "two"])
