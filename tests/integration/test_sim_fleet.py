"""Many simulated workers in one process: startup, idle cost, shutdown, and the ``kvgate sim`` CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.procs.net import free_ports
from gateway.sim import SimFleet, SimWorkerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


async def test_sixteen_workers_start_in_one_process_serve_and_idle_cheaply() -> None:
    base = SimWorkerConfig(time_scale=0.05, kv_events=True, kv_replay_endpoint="tcp://127.0.0.1:*")
    configs = [dataclasses.replace(base, model_name=f"sim-{i}", seed=i) for i in range(16)]
    fleet = SimFleet(configs)
    t0 = time.monotonic()
    urls = await fleet.start()
    startup_s = time.monotonic() - t0
    try:
        assert len(set(urls)) == 16
        async with httpx.AsyncClient(timeout=10) as client:

            async def one(i: int, url: str) -> str:
                body = {
                    "model": f"sim-{i}",
                    "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 8,
                }
                resp = await client.post(f"{url}/v1/chat/completions", json=body)
                assert resp.status_code == 200
                model: str = resp.json()["model"]
                return model

            models = await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))
        assert models == [f"sim-{i}" for i in range(16)]
        await asyncio.sleep(0.3)
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)
        idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        print(
            f"\n16 workers: startup {startup_s:.2f} s, idle CPU {idle_cpu * 100:.2f}% of one core"
        )
        assert idle_cpu < 0.05
        assert all(w.engine.num_steps > 0 for w in fleet.workers)
    finally:
        await fleet.stop()


async def test_stop_is_idempotent_and_releases_the_ports() -> None:
    ports = free_ports(2)
    fleet = SimFleet([SimWorkerConfig(), SimWorkerConfig()], ports=ports)
    assert fleet.urls == []  # the constructor does no I/O
    urls = await fleet.start()
    assert urls == [f"http://127.0.0.1:{p}" for p in ports]
    await fleet.stop()
    await fleet.stop()
    again = SimFleet([SimWorkerConfig(), SimWorkerConfig()], ports=ports)
    assert await again.start() == urls
    await again.stop()


async def test_start_fails_cleanly_when_a_port_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        fleet = SimFleet([SimWorkerConfig()], ports=[taken.getsockname()[1]])
        with pytest.raises(OSError):
            await fleet.start()
    assert fleet.urls == [] and fleet.workers == []


def test_kvgate_sim_prints_urls_and_exits_on_sigterm() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "sim", "--workers", "2", "--port", "0", "--kv-events", "--kv-events-base-port", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            lines = [proc.stdout.readline() for _ in range(2)]
            urls = [line.split()[0] for line in lines]
            assert all(u.startswith("http://127.0.0.1:") for u in urls), lines
            assert all("kv_events=tcp://" in line for line in lines)
            for url in urls:
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
