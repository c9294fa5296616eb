"""What a simulated worker's config resolves to, and how ``kvgate sim`` builds configs."""

from __future__ import annotations

import argparse

import pytest

from gateway.planner import parse_profile
from gateway.sim.cli import build_configs, register
from gateway.sim.config import SimWorkerConfig, derive_num_gpu_blocks, resolve
from gateway.sim.costmodel import LinearCostModel, PlannerCostModel


def test_cache_size_is_derived_from_gpu_memory_minus_weights() -> None:
    model, gpu = parse_profile("llama-3-8b@h100")
    res = resolve(SimWorkerConfig(profile="llama-3-8b@h100", block_size_tokens=16))
    free = gpu.memory_bytes * 0.9 - model.weight_bytes
    assert res.num_gpu_blocks == int(free // (model.kv_bytes_per_token() * 16))
    assert isinstance(res.cost, PlannerCostModel)
    # Llama-3-8B keeps 128 KiB of KV per token: an H100 holds a few hundred thousand tokens.
    assert 300_000 < res.num_gpu_blocks * 16 < 600_000


def test_explicit_blocks_and_cost_model_are_used_as_given() -> None:
    cost = LinearCostModel()
    res = resolve(SimWorkerConfig(num_gpu_blocks=100, block_size_tokens=32), cost)
    assert (res.num_gpu_blocks, res.cost) == (100, cost)


def test_max_model_len_is_shortened_to_what_the_cache_holds() -> None:
    res = resolve(SimWorkerConfig(num_gpu_blocks=9, block_size_tokens=16, max_model_len=4096))
    assert res.max_model_len == 8 * 16  # block 0 is the null block


def test_model_that_does_not_fit_the_gpu_is_refused() -> None:
    with pytest.raises(ValueError):
        derive_num_gpu_blocks(80 * 2**30, 100 * 2**30, 131072, 16)


@pytest.mark.parametrize(
    "bad",
    [
        {"num_gpu_blocks": 1},
        {"block_size_tokens": 0},
        {"time_scale": -1.0},
        {"eos_probability": 2.0},
        {"max_num_seqs": 0},
    ],
)
def test_invalid_configs_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SimWorkerConfig(**bad)  # type: ignore[arg-type]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["sim", *argv])


def test_cli_gives_each_worker_its_own_seed_and_kv_event_ports() -> None:
    args = parse(
        "--workers", "3", "--kv-events", "--kv-events-base-port", "6000", "--block-size", "32"
    )
    configs = build_configs(args)
    assert [c.seed for c in configs] == [0, 1, 2]
    assert [c.kv_events_endpoint for c in configs] == [
        "tcp://*:6000",
        "tcp://*:6002",
        "tcp://*:6004",
    ]
    assert [c.kv_replay_endpoint for c in configs] == [
        "tcp://*:6001",
        "tcp://*:6003",
        "tcp://*:6005",
    ]
    assert {c.block_size_tokens for c in configs} == {32}
    assert args.func is not None


def test_cli_connect_mode_and_free_ports() -> None:
    connect = build_configs(parse("--kv-events", "--kv-events-host", "gateway.local"))
    assert connect[0].kv_events_endpoint == "tcp://gateway.local:5557"
    free = build_configs(parse("--kv-events", "--kv-events-base-port", "0"))
    assert free[0].kv_events_endpoint == "tcp://127.0.0.1:*"
    assert free[0].kv_replay_endpoint == "tcp://127.0.0.1:*"
    assert build_configs(parse())[0].kv_events is False
