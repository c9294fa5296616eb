"""One case of the overhead benchmark: start the no-op backend and every target in front of it,
warm each up, then run the rounds (the order rotated each round), measuring load and CPU."""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gateway import native
from gateway.bench.overhead.cpu import (
    children_cpu_s,
    machine_cpu_s,
    read_proc_stats,
    rusage_cpu_s,
    tree_cpu_s,
)
from gateway.bench.overhead.model import (
    MODEL,
    START_TIMEOUT_S,
    WARMUP_S,
    Case,
    Load,
    Round,
    Target,
)
from gateway.bench.overhead.streams import run_streams
from gateway.bench.overhead.wrk import run_wrk
from gateway.procs.kvgate import (
    GatewayProcess,
    floor_proxy,
    noop_backend,
    serve_accepts_processes,
)
from gateway.procs.net import LOOPBACK, Ports, free_port
from gateway.procs.process import ManagedProcess, ProcessSet, StartError

T = TypeVar("T")


@dataclass(frozen=True)
class Running:
    target: Target
    url: str
    proc: ManagedProcess | None
    """The router's root process (None for ``direct``)."""
    version: str | None = None

    def about(self) -> dict[str, str | None]:
        """What the JSON records of it: enough to run it again by hand."""
        return {"description": self.target.description, "url": self.url,
                "command": None if self.proc is None else self.proc.command,
                "version": self.version}


def kvgate_config(target: Target, backend_url: str, port: int | None, hf_tokenizer: Path,
                  long_pool: tuple[str, int] | None = None) -> dict[str, Any]:
    """One pool of ``backend_url`` (8K tokens); with ``long_pool`` (a backend URL and its context
    limit in tokens) a second pool ``long`` for prompts too long for the first. Without ``port``
    the config names no listen address (``GatewayProcess`` chooses the port, and moves it when
    another process takes it before the gateway binds)."""
    tokenizer = str(hf_tokenizer) if target.tokenizer == "hf" else "simple"
    pools = [{"name": "fleet", "max_context_tokens": 8192, "policy": target.policy,
              "workers": [{"url": backend_url}]}]
    if long_pool is not None:
        url, max_context_tokens = long_pool
        pools.append({"name": "long", "max_context_tokens": max_context_tokens,
                      "policy": target.policy, "workers": [{"url": url}]})
    config: dict[str, Any] = {"models": [{"name": MODEL, "tokenizer": tokenizer}],
                              "pools": pools}
    if port is not None:
        config["listen"] = {"host": LOOPBACK, "port": port}
    return config


def start_target(procs: ProcessSet, ports: Ports, target: Target, backend_url: str,
                 hf_tokenizer: Path, peer_binaries: Mapping[str, str | None],
                 long_pool: tuple[str, int] | None = None) -> Running:
    """``target`` started in front of ``backend_url``; kvgate with ``long_pool`` as
    ``kvgate_config`` says."""
    if target.kind == "direct":
        return Running(target, backend_url, None)
    if target.kind == "floor":
        proc, url = floor_proxy(target.policy, ports.take(), backend_url)
        procs.start(target.name, proc, timeout_s=START_TIMEOUT_S)
        return Running(target, url, proc)
    if target.kind == "kvgate":
        accepts = serve_accepts_processes()
        if target.processes > 1 and not accepts:
            raise StartError("kvgate serve of this checkout does not accept --processes yet")
        gw = GatewayProcess(kvgate_config(target, backend_url, None, hf_tokenizer, long_pool),
                            procs.log_dir / f"{target.name}.yaml",
                            processes=target.processes if accepts else None)
        procs.start(target.name, gw, timeout_s=START_TIMEOUT_S)
        return Running(target, gw.url, gw)
    assert target.peer is not None
    binary = target.peer.find(peer_binaries.get(target.peer.command))
    if binary is None:
        raise target.peer.missing()
    port = ports.take()
    proc = target.peer.process(binary, port, ports.take(), [backend_url], MODEL, target.policy)
    procs.start(target.name, proc, timeout_s=START_TIMEOUT_S)
    return Running(target, f"http://{LOOPBACK}:{port}", proc, target.peer.version(binary))


def offer_load(case: Case, url: str, duration_s: float, script: Path) -> Load:
    if case.streaming:
        return run_streams(url, case.concurrency, duration_s)
    return run_wrk(url, max(1, round(duration_s)), case.concurrency, script)


def measure(case: Case, running: Running, backend: ManagedProcess, index: int,
            duration_s: float, script: Path) -> Round:
    """One round against one target, with the CPU of router, backend and load generator."""
    who = resource.RUSAGE_SELF if case.streaming else resource.RUSAGE_CHILDREN
    before, machine_before = read_proc_stats(), machine_cpu_s()
    load_before, t0 = rusage_cpu_s(who), time.perf_counter()
    load = offer_load(case, running.url, duration_s, script)
    load_after, wall = rusage_cpu_s(who), time.perf_counter() - t0
    after, machine_after = read_proc_stats(), machine_cpu_s()
    router: float | None = None
    kernel: float | None = None
    split: tuple[float, ...] = ()
    if running.proc is not None:
        pid = running.proc.pid
        router = tree_cpu_s(after, pid) - tree_cpu_s(before, pid)
        kernel = tree_cpu_s(after, pid, kernel=True) - tree_cpu_s(before, pid, kernel=True)
        split = tuple(children_cpu_s(before, after, pid))
    return Round(case.name, running.target.name, index, load, wall, router,
                 tree_cpu_s(after, backend.pid) - tree_cpu_s(before, backend.pid),
                 load_after - load_before, machine_after - machine_before, split, kernel)


def rotated(items: Sequence[T], index: int) -> list[T]:
    """Round ``index``'s order: each round starts one target later."""
    k = index % len(items) if items else 0
    return [*items[k:], *items[:k]]


@dataclass(frozen=True)
class CaseRun:
    case: Case
    rounds: list[Round]
    started: dict[str, dict[str, str | None]]
    skipped: dict[str, str]


def run_case(case: Case, chosen: Sequence[Target], args: argparse.Namespace,
             log_dir: Path) -> CaseRun:
    skipped: dict[str, str] = {}
    log_dir.mkdir(parents=True, exist_ok=True)
    with ProcessSet(log_dir) as procs:
        script = log_dir / "post.lua"
        script.write_text(case.lua)
        ports = Ports(free_port())
        noop, backend_url = noop_backend(
            ports.take(), case.backend_delay_ms,
            stream_chunks=max(case.stream_chunks, 1), chunk_interval_ms=case.chunk_interval_ms)
        procs.start("noop", noop, timeout_s=START_TIMEOUT_S)
        running: list[Running] = []
        for target in chosen:
            try:
                running.append(start_target(procs, ports, target, backend_url,
                                            args.hf_tokenizer, vars(args)))
            except StartError as exc:
                skipped[target.name] = str(exc).strip()
                procs.stop(target.name)
                print(f"overhead: {case.name}: {target.name} skipped: "
                      f"{str(exc).strip().splitlines()[0]}", flush=True)
        for r in running:
            offer_load(case, r.url, WARMUP_S, script)
        rounds: list[Round] = []
        for i in range(args.rounds):
            for r in rotated(running, i):
                rnd = measure(case, r, noop, i, args.duration_s, script)
                rounds.append(rnd)
                print(f"overhead: {case.name} round {i + 1}/{args.rounds} {r.target.name:<20} "
                      f"{rnd.load.requests_per_s:9.0f} req/s  errors {rnd.load.errors}",
                      flush=True)
        if args.profile is not None:
            for r in running:
                if r.proc is not None and r.target.kind == "kvgate":
                    profile(case, r, args, script, args.profile)
    return CaseRun(case, rounds, {r.target.name: r.about() for r in running}, skipped)


PY_SPY_RATE_HZ = 200


def profile(case: Case, running: Running, args: argparse.Namespace, script: Path,
            out_dir: Path) -> Path | None:
    """A flame graph of ``running`` (its whole process tree) under the case's load, from an
    extra round after the measured ones (py-spy's sampling would tax the measured CPU):
    ``profile_<case>_<target>.svg`` in ``out_dir``. None, said, when py-spy is missing. A
    gateway running compiled (``gateway.native``: this checkout's build, which the gateway
    imports too) has no Python frames for its request path: py-spy then unwinds native stacks
    (``--native``, which pauses the process per sample: the round is not measured anyway) and
    names the compiled functions (``dispatch___Dispatcher___handle``)."""
    beside = Path(sys.executable).parent / "py-spy"  # the venv's, whether or not on PATH
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None or running.proc is None:
        print("overhead: --profile needs py-spy (pip install py-spy)", flush=True)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    svg = out_dir / f"profile_{case.name}_{running.target.name}.svg"
    duration_s = max(1, round(args.duration_s))
    with subprocess.Popen(
        [spy, "record", "--pid", str(running.proc.pid), "--subprocesses",
         "--native" if native.status().startswith("compiled") else "--nonblocking",
         "--rate", str(PY_SPY_RATE_HZ), "--duration", str(duration_s), "--output", str(svg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    ) as recorder:
        time.sleep(0.5)  # attached before the load starts
        offer_load(case, running.url, duration_s, script)
        _, err = recorder.communicate(timeout=duration_s + 60)
    if recorder.returncode != 0 or not svg.exists():
        print(f"overhead: py-spy failed on {running.target.name}: {err.strip()[-300:]}",
              flush=True)
        return None
    print(f"overhead: {case.name}: flame graph of {running.target.name} in {svg}", flush=True)
    return svg

