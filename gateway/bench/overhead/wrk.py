"""wrk as the overhead benchmark's load generator for non-streaming chats: its command line, a
run, and its ``--latency`` report parsed into a ``Load``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from gateway.bench.overhead.model import Load


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if not m:
        raise ValueError(f"not a wrk duration: {value!r}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[m.group(2)]
    return float(m.group(1)) * scale


def _field(pattern: str, out: str) -> re.Match[str]:
    m = re.search(pattern, out, re.M)
    if m is None:
        raise ValueError(f"wrk output without {pattern!r}:\n{out}")
    return m


def parse_wrk(out: str) -> Load:
    """wrk's ``--latency`` report."""
    requests = int(_field(r"^\s*(\d+) requests in", out).group(1))
    rps = float(_field(r"^Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(_field(r"^\s+50%\s+(\S+)", out).group(1))
    p99 = _ms(_field(r"^\s+99%\s+(\S+)", out).group(1))
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    return Load(requests, errors, rps, p50, p99)


def wrk_argv(url: str, duration_s: int, connections: int, script: Path) -> list[str]:
    """wrk posting ``script``'s chat to ``url`` for ``duration_s`` with a latency report."""
    return ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script),
            f"{url}/v1/chat/completions"]


def run_wrk(url: str, duration_s: int, connections: int, script: Path) -> Load:
    out = subprocess.run(wrk_argv(url, duration_s, connections, script),
                         check=True, capture_output=True, text=True).stdout
    return parse_wrk(out)
