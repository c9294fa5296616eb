"""The garbage collector's share of a gateway's CPU, measured inside the gateway under load.

Why inside. The collector's pauses are invisible from outside (they are part of the process's
CPU like any other work) and the in-process call counter (``gateway.bench.overhead.calls``)
calls the ASGI app without the server, so it misses what the server's objects do to the
collector: session 13 found nearly all of the ~10 µs of GC per short request there (a reference
cycle per request in ``gateway.httpd``'s ``Cycle``). So ``gateway.bench.overhead.ab --gc``
starts each gateway with this probe installed before ``gateway.cli`` runs (``boot_argv``): the
gateway's code, either checkout's, is not changed by it.

What it records: ``gc.callbacks`` timing every collection with ``perf_counter`` (a collection
runs synchronously in the thread that triggered it, so its wall time is its CPU, barring
preemption, which hits both sides of a pair alike), per generation: collections, seconds, the
longest since the last snapshot, objects collected (unreachable cycles found). The cost: two
Python calls per collection, a few per 1,000 requests. On ``SIGNAL`` the probe writes a
snapshot (``GcStats`` as JSON, with a sequence number) to its file; ``snapshot`` sends the
signal and waits for the new file, so the counts bracket a round exactly.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

SIGNAL = signal.SIGUSR1
GENERATIONS = 3
SNAPSHOT_TIMEOUT_S = 20.0
"""How long ``snapshot`` waits for the gateway's answer: the handler runs on the gateway's main
thread when it next runs Python (the event loop wakes for it), so only a stalled machine
delays it."""


@dataclass(frozen=True)
class GcStats:
    """Per generation (index 0-2): collections, their seconds, the longest one, the objects
    they found unreachable. Cumulative, except ``max_s``: since the previous snapshot."""

    seq: int
    collections: tuple[int, ...]
    seconds: tuple[float, ...]
    max_s: tuple[float, ...]
    collected: tuple[int, ...]

    def since(self, before: GcStats) -> GcStats:
        """What happened between ``before`` and this snapshot (``max_s`` as this one's)."""
        return GcStats(self.seq,
                       tuple(a - b for a, b in zip(self.collections, before.collections, strict=True)),
                       tuple(a - b for a, b in zip(self.seconds, before.seconds, strict=True)),
                       self.max_s,
                       tuple(a - b for a, b in zip(self.collected, before.collected, strict=True)))

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GcStats:
        return cls(int(data["seq"]), tuple(data["collections"]), tuple(data["seconds"]),
                   tuple(data["max_s"]), tuple(data["collected"]))


def install(path: str) -> None:
    """In the process to measure, before its work starts: time every collection, and write a
    snapshot to ``path`` on ``SIGNAL``."""
    collections = [0] * GENERATIONS
    seconds = [0.0] * GENERATIONS
    max_s = [0.0] * GENERATIONS
    collected = [0] * GENERATIONS
    started = [0.0]
    seq = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        g = info["generation"]
        collections[g] += 1
        seconds[g] += took
        collected[g] += info["collected"]
        if took > max_s[g]:
            max_s[g] = took

    def on_signal(signum: int, frame: FrameType | None) -> None:
        seq[0] += 1
        data = {"seq": seq[0], "collections": collections, "seconds": seconds,
                "max_s": max_s, "collected": collected}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        max_s[:] = [0.0] * GENERATIONS

    gc.callbacks.append(on_gc)
    signal.signal(SIGNAL, on_signal)


def read(path: Path) -> GcStats | None:
    try:
        return GcStats.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        return None


def snapshot(pid: int, path: Path) -> GcStats:
    """Ask the probed process ``pid`` for a snapshot and wait for it."""
    before = read(path)
    os.kill(pid, SIGNAL)
    deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
    while True:
        now = read(path)
        if now is not None and (before is None or now.seq > before.seq):
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"no GC snapshot from pid {pid} in {SNAPSHOT_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


_BOOT = ("import runpy, sys; runpy.run_path({probe!r})['install']({out!r}); "
         "sys.argv = ['kvgate', *sys.argv[1:]]; "
         "runpy.run_module('gateway.cli', run_name='__main__', alter_sys=True)")


def boot_argv(out: Path, *args: str) -> list[str]:
    """``python -m gateway.cli ARGS`` with the probe installed first, writing to ``out``. As
    with ``-m``, the working directory comes first on the path (``-c``), so the checkout the
    process runs in is the one imported; the probe is loaded from this file by its path, so a
    checkout without it is measured the same way."""
    boot = _BOOT.format(probe=str(Path(__file__).resolve()), out=str(out))
    return [sys.executable, "-c", boot, *args]
