"""The engine loop turns the cost model into real (scaled) time: TTFT, TPOT, queueing, idling."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

from gateway.planner import decode_step_time_s, parse_profile, prefill_time_s
from gateway.sim.costmodel import LinearCostModel, PlannerCostModel, step_time_s
from gateway.sim.engine import SimEngine, TokenEvent
from gateway.sim.scheduler import FINISH_LENGTH, SamplingSpec, Scheduler, SchedulerConfig, StepPlan

# A timer can fire late (a busy loop, other processes on a 2-core box), never early: the bounds
# are one-sided. Means over many steps stay tight because the engine keeps an ideal clock.
EARLY_S = 0.002
LATE_S = 0.05


def close_to(measured: float, expected: float) -> bool:
    return expected - EARLY_S <= measured <= expected + LATE_S


def median_itl(times: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def scheduler(num_gpu_blocks: int = 1024) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size_tokens=16))


async def timed(engine: SimEngine, rid: str, prompt_len: int, max_tokens: int) -> list[float]:
    """Submit one request; return the arrival-relative time of every token."""
    base = 1000 + 1000 * sum(map(ord, rid))  # distinct prompts: no prefix sharing between ids
    prompt = list(range(base, base + prompt_len))
    req = engine.scheduler.new_request(rid, prompt, SamplingSpec(max_tokens=max_tokens))
    t0 = time.monotonic()
    stream = engine.submit(req, t0)
    times: list[float] = []
    while True:
        batch = await stream.next_batch()
        now = time.monotonic() - t0
        times.extend([now] * len(batch))
        if not batch or batch[-1].finish_reason is not None:
            return times


async def test_idle_worker_ttft_is_the_prefill_time_and_tpot_the_decode_step_time() -> None:
    cost = LinearCostModel(prefill_s_per_token=1e-4, decode_base_s=0.02)
    engine = SimEngine(scheduler(), cost)
    engine.start()
    try:
        times = await timed(engine, "a", prompt_len=300, max_tokens=11)
    finally:
        await engine.stop()
    assert close_to(times[0], 0.030)
    assert abs(median_itl(times) - 0.020) < 0.002


async def test_planner_cost_model_sets_ttft_and_tpot_of_the_profile() -> None:
    model, gpu = parse_profile("llama-3-8b@h100")
    scale = 5.0  # slower than real time, so a ~5 ms decode step is measurable here
    engine = SimEngine(scheduler(), PlannerCostModel(model, gpu), time_scale=scale)
    engine.start()
    try:
        times = await timed(engine, "a", prompt_len=1000, max_tokens=11)
    finally:
        await engine.stop()
    ttft = prefill_time_s(model, gpu, 1000) * scale
    # Decode steps read 1001..1010 tokens of KV; their mean is the middle one.
    tpot = decode_step_time_s(model, gpu, 1005) * scale
    assert close_to(times[0], ttft)
    assert abs(median_itl(times) - tpot) / tpot < 0.1


async def test_time_scale_speeds_the_whole_timeline_up() -> None:
    cost = LinearCostModel(prefill_s_per_token=1e-3, decode_base_s=0.1)
    engine = SimEngine(scheduler(), cost, time_scale=0.1)
    engine.start()
    try:
        times = await timed(engine, "a", prompt_len=100, max_tokens=3)
    finally:
        await engine.stop()
    assert close_to(times[0], 0.010)
    assert close_to(times[-1], 0.030)


async def test_second_request_queues_behind_a_full_cache_until_the_first_finishes() -> None:
    cost = LinearCostModel(prefill_s_per_token=0.0, decode_base_s=0.01)
    # 8 usable blocks of 16: each 100-token request needs 7 blocks, so only one fits.
    engine = SimEngine(scheduler(num_gpu_blocks=9), cost)
    engine.start()
    try:
        first, second = await asyncio.gather(
            timed(engine, "a", prompt_len=100, max_tokens=5),
            timed(engine, "b", prompt_len=100, max_tokens=5),
        )
    finally:
        await engine.stop()
    # "b" starts only after "a" finished its 5 steps (1 prefill + 4 decodes).
    assert second[0] >= first[-1] - EARLY_S
    assert engine.scheduler.prefix_stats.hits == 0


async def test_batched_requests_share_decode_steps() -> None:
    cost = LinearCostModel(prefill_s_per_token=0.0, decode_base_s=0.02)
    engine = SimEngine(scheduler(), cost)
    engine.start()
    try:
        results = await asyncio.gather(*(timed(engine, f"r{i}", 20 + i, 5) for i in range(8)))
    finally:
        await engine.stop()
    # Eight requests in one batch take as long as one: a free prefill step + 4 decode steps.
    assert close_to(max(r[-1] for r in results), 0.08)
    assert engine.num_steps == 5


async def test_idle_engine_runs_no_steps() -> None:
    engine = SimEngine(scheduler(), LinearCostModel())
    engine.start()
    await asyncio.sleep(0.05)
    assert engine.num_steps == 0
    await engine.stop()


async def test_abort_mid_generation_closes_the_stream_and_frees_blocks() -> None:
    engine = SimEngine(scheduler(), LinearCostModel(decode_base_s=0.005))
    engine.start()
    try:
        req = engine.scheduler.new_request("a", list(range(40)), SamplingSpec(max_tokens=1000))
        stream = engine.submit(req)
        assert await stream.next_batch()
        engine.abort("a")
        while await stream.next_batch():
            pass
        await asyncio.sleep(0.02)
        assert engine.scheduler.kv.pool.num_free_blocks == 1023
        assert not engine.scheduler.has_unfinished()
    finally:
        await engine.stop()


async def test_request_finishes_with_length_after_max_tokens() -> None:
    engine = SimEngine(scheduler(), LinearCostModel(decode_base_s=0.0, prefill_s_per_token=0.0))
    engine.start()
    try:
        req = engine.scheduler.new_request("a", [1, 2, 3], SamplingSpec(max_tokens=7))
        stream = engine.submit(req)
        events: list[TokenEvent] = []
        while not events or events[-1].finish_reason is None:
            events.extend(await stream.next_batch())
    finally:
        await engine.stop()
    assert len(events) == 7 and events[-1].finish_reason == FINISH_LENGTH


def test_mixed_step_pays_prefill_and_decode() -> None:
    cost = LinearCostModel(
        prefill_s_per_token=0.001, decode_base_s=0.01, decode_s_per_kv_token=1e-5
    )
    plan = StepPlan(prefill_tokens=100, decode_kv_tokens=1000, num_decode_requests=2)
    assert abs(step_time_s(cost, plan) - (0.1 + 0.02)) < 1e-12
    assert step_time_s(cost, StepPlan(prefill_tokens=100)) == 0.1
