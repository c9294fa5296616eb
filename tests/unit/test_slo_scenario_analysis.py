"""Where the ``slo`` scenario's misses come from: its breakdown per class, GPU and route reason,
and the model-time tool (``gateway.bench.routers.slo_model``): the oracle TTFT a miss is
judged by, and the causes it gives."""

from __future__ import annotations

import pytest

from gateway.bench.routers.scenario_slo import CLASSES, Record, RunResult, summarize
from gateway.bench.routers.slo_model import (
    ModelFleet,
    Outcome,
    oracle_ttft,
    pool_settings,
    simulate,
    summary,
)
from gateway.sim.costmodel import LinearCostModel
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig


def test_breakdown_counts_served_and_missed_per_class_gpu_and_reason() -> None:
    ts = 8.0
    objective_s = CLASSES[0].ttft_ms_modelled * ts / 1e3
    records = [
        Record("interactive", 20.0, 200, None, objective_s * 2, "http://a", "least_loaded"),
        Record("interactive", 21.0, 200, None, objective_s / 2, "http://a", "least_loaded"),
        Record("interactive", 22.0, 200, None, objective_s / 2, "http://h", "slo"),
        Record("interactive", 1.0, 200, None, objective_s * 2, "http://a", "slo"),  # warm-up
    ]
    s = summarize(RunResult("x", records), ts, 10.0, {"http://a": "a100", "http://h": "h100"})
    assert s["served_missed_by_class_gpu_reason"] == {
        "interactive on a100 (least_loaded)": [2, 1], "interactive on h100 (slo)": [1, 0]}


def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=4096))


def test_oracle_on_an_idle_worker_is_the_prompts_prefill() -> None:
    cost = LinearCostModel(prefill_s_per_token=1e-4, decode_base_s=0.01)
    assert oracle_ttft(scheduler(), cost, 0.0, 0.0, 1000, 8, 8192) == pytest.approx(0.1)


def test_oracle_waits_for_the_step_in_progress_and_shares_the_next_with_the_queue() -> None:
    """A 6K prompt waits ahead (FCFS): the next step prefills it and ours together (7K tokens,
    within the 8,192-token budget), after the 50 ms left of the step in progress."""
    cost = LinearCostModel(prefill_s_per_token=1e-4, decode_base_s=0.01)
    s = scheduler()
    s.add_request(s.new_request("ahead", list(range(16, 16 + 6144)),
                                SamplingSpec(max_tokens=4, ignore_eos=True)))
    ttft = oracle_ttft(s, cost, busy_until=0.05, now=0.0, prompt_tokens=1024, max_tokens=4,
                       budget=8192)
    assert ttft == pytest.approx(0.05 + 7168 * 1e-4)


def test_model_run_explains_every_miss_and_attains_more_with_objectives() -> None:
    """A short run of the scenario in model time: each miss gets a cause, and sending the
    objectives attains more than kv_aware alone (the premise and the policy, in miniature)."""
    fleet = ModelFleet(3, pool_settings())
    plain = simulate(fleet, duration_s=30.0, send_slo=False)
    with_slo = simulate(fleet, duration_s=30.0, send_slo=True)
    for outs in (plain, with_slo):
        missed = [o for o in outs if not o.met and not o.shed and o.ttft_s is not None]
        assert all(o.why in ("late_arrivals", "better_worker", "no_worker") for o in missed)
    a, b = summary(plain, 1.25), summary(with_slo, 1.25)
    assert b["attainment_shed_as_missed"] > a["attainment_shed_as_missed"]
    assert isinstance(with_slo[0], Outcome)


def test_model_with_two_gateway_processes_calibrates_each_from_its_own_share() -> None:
    """``--processes 2``: each request is routed by one of two routers over the same workers,
    as the scenario's gateway processes (the kernel spreads connections among them); each
    calibrates from the streams it routed, so both end up with warm workers of their own."""
    fleet = ModelFleet(3, pool_settings(), processes=2)
    assert len(fleet.routers) == 2 and fleet.routers[0] is not fleet.routers[1]
    outs = simulate(fleet, duration_s=30.0, explain=False)
    assert all(o.ttft_s is not None for o in outs if not o.shed)
    for router in fleet.routers:
        model = router.slo_model(fleet.pool.name)
        assert any(model.warm(u) for u in fleet.urls)
    one = ModelFleet(3, pool_settings())
    simulate(one, duration_s=30.0, explain=False)
    assert len(one.routers) == 1
