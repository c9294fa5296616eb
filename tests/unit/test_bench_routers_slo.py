"""The ``slo`` scenario's pure parts: the arrival schedule and how attainment is counted."""

from __future__ import annotations

import pytest

from gateway.bench.routers.scenario_slo import (
    CLASSES,
    Record,
    RunResult,
    schedule,
    summarize,
    table,
)


def test_schedule_is_reproducible_and_mixes_the_classes_by_share() -> None:
    plan = schedule(rate=20.0, duration_s=100.0, seed=1)
    assert plan == schedule(rate=20.0, duration_s=100.0, seed=1)
    assert 1800 < len(plan) < 2200
    assert all(0 <= t < 100.0 for t, _ in plan)
    batch = sum(1 for _, c in plan if c.name == "batch") / len(plan)
    assert batch == pytest.approx(0.25, abs=0.03)


def test_attainment_counts_served_requests_and_reports_shed_apart() -> None:
    ts = 2.0
    interactive_s = CLASSES[0].ttft_ms_modelled * ts / 1e3
    records = [
        Record("interactive", 0.5, 200, None, interactive_s / 2),  # warm-up: not counted
        Record("interactive", 20.0, 200, None, interactive_s / 2),  # met
        Record("interactive", 21.0, 200, None, interactive_s * 2),  # missed
        Record("batch", 22.0, 503, "slo_unattainable"),  # shed
        Record("batch", 23.0, 502, "upstream_error"),  # an error: neither
    ]
    s = summarize(RunResult("x", records), ts, warmup_s=10.0)
    assert s["classes"]["interactive"]["requests"] == 2
    assert s["classes"]["interactive"]["attainment"] == 0.5
    assert s["classes"]["batch"]["shed"] == 1 and s["classes"]["batch"]["errors"] == 1
    assert s["attainment"] == 0.5
    assert s["attainment_shed_as_missed"] == pytest.approx(1 / 3)
    assert "interactive" in table({"x": s}) and "50.0%" in table({"x": s})
