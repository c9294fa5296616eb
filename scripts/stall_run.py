"""Run pytest while stalling it for seconds at a time, to find tests that assume a quick machine.

Usage: ``.venv/bin/python scripts/stall_run.py [--stall-s 3] [--every-s 2-5] [--seed N]
[--target tree|main|children|random] [--match REGEX] [--runs K] TEST_PATH... [-- PYTEST_ARGS]``

Why: CI runs the suite on a loaded 2-core machine that stops a process for seconds (it has seen
~20 s); a test that passes alone then fails because it read a state a moment too early or let a
short timeout fire. Such a failure is rare on a quiet machine and near certain under injected
stalls, so a fix can be proven: fails under stalls before, passes under stalls after.

What it does: starts ``python -m pytest TEST_PATH... PYTEST_ARGS`` as a child, relays its output,
and, while it runs, waits a random ``--every-s`` (uniform in ``A-B``), then stops the chosen
processes with SIGSTOP for ``--stall-s``, then SIGCONTs them; again, until pytest exits. The
processes are found from ``/proc`` (every descendant of pytest, by parent pid); SIGSTOP stops
every thread of a process, so a gateway or simulated worker pytest runs in a thread stalls with
pytest. ``--target`` picks which processes stall, because different races show up:

* ``tree`` (default): pytest and every descendant: the whole machine stalls, as under load;
* ``main``: only pytest's own process (and the servers in its threads) while the children it
  started (``kvgate sim``/``kvgate serve``, Redis, vLLM) run on: a test reads a child's state late,
  or a child's timeout fires on a gateway that is not answering;
* ``children``: only pytest's descendants: a worker or gateway process stalls under a test that
  keeps running (health checks, connect and read timeouts, events that arrive late);
* ``random``: one of the three above, drawn per stall.

``--match REGEX`` narrows a stall to the processes whose command line matches (e.g.
``'kvgate sim'``). A process that was already stopped when a stall began (a test that SIGSTOPs a
worker on purpose) is left alone: it is neither stopped again nor continued.

Output: pytest's own, then one line per run: the stalls injected, the processes stopped, pytest's
summary line and exit code. ``--runs K`` runs pytest K times (seeds ``N``, ``N+1``, ...) and stops at
the first failing run. Exit code: pytest's (of the last run).

Cost: nothing while a process runs; each stall is one ``/proc`` walk and two signals per process.
Trade-off: stalls are injected from outside, so they land anywhere (also in pytest's own
bookkeeping), and they cannot separate threads of one process; a test that asserts latency on
purpose (a worker marked down within 2 s, a read timeout of ~1 s) may fail under a stall longer
than its bound, and that says nothing about the test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("tree", "main", "children")
# pytest's last line ("=== 1 failed, 2 passed in 3.04s ===", or without the "=" under -q).
SUMMARY = re.compile(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b.* in [0-9.]+s\b")


def children_of() -> dict[int, list[int]]:
    """Every process's children, by parent pid (one pass over ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
    return children


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid, or None once it has gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    """Every descendant of ``root``, parents before their children."""
    tree = children_of()
    found: list[int] = []
    todo = list(tree.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(tree.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Staller:
    """Stops and continues a process tree; remembers what it stopped so it continues only that."""

    root: int
    target: str
    match: re.Pattern[str] | None = None
    stalls: int = 0
    process_stops: int = 0
    stopped: list[int] = field(default_factory=list)

    def _stop(self, pid: int) -> None:
        stat = _stat(pid)
        if stat is None or stat[0] in "TtZX" or pid in self.stopped:
            return  # gone, a zombie, or stopped by someone else (a test's own SIGSTOP): left alone
        if self.match is not None and not self.match.search(_cmdline(pid)):
            return
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        self.stopped.append(pid)

    def stop(self, target: str) -> None:
        """Stop ``target``'s processes. The tree is walked again until no new process shows up:
        a process started between the walk and the signals is caught by the next walk (a stopped
        parent starts nothing more)."""
        if target in ("tree", "main"):
            self._stop(self.root)
        if target in ("tree", "children"):
            while True:
                new = [p for p in descendants(self.root) if p not in self.stopped]
                before = len(self.stopped)
                for pid in new:
                    self._stop(pid)
                if len(self.stopped) == before or target == "children":
                    break  # with pytest running, its children can come and go: one walk
        if self.stopped:
            self.stalls += 1
            self.process_stops += len(self.stopped)

    def resume(self) -> None:
        """Continue what ``stop`` stopped, children first (a parent resumed first could time out
        on a child not yet resumed)."""
        for pid in reversed(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


def parse_every(text: str) -> tuple[float, float]:
    """``"2-5"`` -> (2.0, 5.0); ``"3"`` -> (3.0, 3.0)."""
    low, _, high = text.partition("-")
    bounds = (float(low), float(high or low))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--every-s wants A-B with 0 < A <= B, got {text!r}")
    return bounds


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stalls: int
    process_stops: int
    summary: str


def run_once(pytest_args: Sequence[str], *, stall_s: float, every_s: tuple[float, float],
             seed: int, target: str, match: re.Pattern[str] | None) -> RunResult:
    """One pytest run under stalls; pytest's output is relayed as it comes."""
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
    summary: list[str] = []

    def relay() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if SUMMARY.search(line):
                summary.append(line.strip().strip("= "))

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    staller = Staller(child.pid, target, match)
    try:
        while True:
            try:
                child.wait(timeout=rng.uniform(*every_s))
                break
            except subprocess.TimeoutExpired:
                pass
            staller.stop(rng.choice(TARGETS) if target == "random" else target)
            time.sleep(stall_s)
            staller.resume()
    finally:
        staller.resume()
        if child.poll() is None:  # interrupted: do not leave pytest (and its servers) behind
            child.terminate()
            child.wait()
        relayer.join()
    return RunResult(child.returncode, staller.stalls, staller.process_stops,
                     summary[-1] if summary else "(no pytest summary line)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run pytest while SIGSTOPping it (and its process tree) for seconds at a time.",
        epilog="Arguments after '--' go to pytest unchanged.")
    parser.add_argument("paths", nargs="*", help="test paths (files, directories, node ids)")
    parser.add_argument("--stall-s", type=float, default=3.0, help="length of one stall (3)")
    parser.add_argument("--every-s", type=parse_every, default=(2.0, 5.0), metavar="A-B",
                        help="run time between stalls, uniform in A-B seconds (2-5)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: from time)")
    parser.add_argument("--target", choices=(*TARGETS, "random"), default="tree",
                        help="which processes a stall stops (tree)")
    parser.add_argument("--match", type=re.compile, default=None, metavar="REGEX",
                        help="stop only processes whose command line matches")
    parser.add_argument("--runs", type=int, default=1, help="runs, stopping at the first failure")
    args, extra = parser.parse_known_args(argv)
    if "--" in extra:
        extra.remove("--")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    code = 0
    for i in range(args.runs):
        result = run_once([*args.paths, *extra], stall_s=args.stall_s, every_s=args.every_s,
                          seed=seed + i, target=args.target, match=args.match)
        print(f"stall_run: run {i + 1}/{args.runs} seed {seed + i} target {args.target}: "
              f"{result.stalls} stalls of {args.stall_s:g} s, {result.process_stops} process "
              f"stops; pytest exit {result.exit_code}: {result.summary}", flush=True)
        code = result.exit_code
        if code != 0:
            break
    return code


if __name__ == "__main__":
    sys.exit(main())
