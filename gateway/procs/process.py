"""Child processes of a test or benchmark: started, waited for, stopped, never left behind.

A ``ManagedProcess`` is one child: its own session (so a signal to its group reaches whatever it
spawned, e.g. vLLM's engine processes), its output appended to a log file headed by the command,
the environment of ``child_env`` unless told otherwise, and a death signal (``PR_SET_PDEATHSIG``
on Linux) so it does not outlive a crashed test run or benchmark. Linux sends that signal when
the *thread* that started the child ends: start children from a thread that lives as long as
they should (the main thread, or the event loop's), never from a short-lived worker thread.

Readiness is a callable (``http_ok`` of a URL, a TCP poll, a protocol ping); ``wait_ready`` polls
it and raises ``StartError`` with the log's tail when the child exits or the time runs out.
Stopping is the same everywhere: SIGCONT (it may be paused), SIGTERM to the group, the leader
and then the group waited for until the grace ends, SIGKILL to what is left.

``ProcessSet`` holds the children of one run by name, logs in one folder, and stops them all in
reverse order of start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

from gateway import native
from gateway.procs.net import port_free, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this package runs from: the working directory of children, and the base of the
repository-relative defaults (``.venv-vllm``, ``.cache/tiny-llama``)."""
STOP_GRACE_S = 15.0
START_TIMEOUT_S = 60.0
"""How long a start waits for readiness by default: generous, since a loaded CI machine can stall
a child's imports for many seconds (a child that exits is reported at once, whatever this is)."""
START_ATTEMPTS = 3
PORT_IN_USE = "address already in use"
"""What a child's log says (in any case) when it could not bind its port: Python's ``OSError``
("[Errno 98] Address already in use") and asyncio's bind error both read so."""
LOG_TAIL_LINES = 80

# Resolved here, not in the child: between fork and exec the child should only make the call.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


class StartError(RuntimeError):
    """A child exited during start-up, did not get ready in time, or could not be found."""


def python_argv(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS`` with this interpreter (the gateway's environment)."""
    return [sys.executable, "-m", module, *args]


def child_env(extra: Mapping[str, str] | None = None,
              drop: Sequence[str] = ("KVGATE_",)) -> dict[str, str]:
    """Our environment without the variables starting with ``drop`` (a stray ``KVGATE_*`` in the
    shell must not change the configuration under test), unbuffered output, plus ``extra``.
    ``KVGATE_NATIVE`` (compiled or source, ``gateway.native``) is not configuration: it is kept,
    so a child runs what its parent runs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(tuple(drop)) or k == native.ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _death_signal(sig: int) -> Callable[[], None]:
    def arm() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, sig)

    return arm


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(popens: Sequence[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's process group at once, SIGKILL what is left after ``grace_s``.

    The group can outlive its leader while children (vLLM's engine core) shut down, so after the
    leader exits the group itself is waited for until the grace ends."""
    for p in popens:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGCONT)
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline and _group_alive(p.pid):
            time.sleep(0.05)
        _signal_group(p.pid, signal.SIGKILL)
        p.wait()


class ManagedProcess:
    """One child process; see the module docstring."""

    def __init__(self, argv: Sequence[str], *, ready: Callable[[], object] | None = None,
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path = REPO_ROOT, death_signal: int = signal.SIGKILL,
                 stop_grace_s: float = 10.0) -> None:
        self.argv = list(argv)
        self.ready = ready
        self.log_path = log_path
        self.env = dict(env) if env is not None else child_env()
        self.cwd = cwd
        self.death_signal = death_signal
        self.stop_grace_s = stop_grace_s
        self.popen: subprocess.Popen[bytes] | None = None
        self._was_ready = False

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def start(self, wait: bool = True, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start (no-op when running); with ``wait``, wait until ready (and stop the child
        again when it does not get ready). A child that exits during start-up because another
        process took a port the kit chose for it is started again on other ports (see
        ``move_ports``)."""
        if self.alive:
            return
        self._spawn()
        if wait:
            self._wait_ready_or_move(timeout_s)

    def _spawn(self) -> None:
        if self.log_path is None:
            self.popen = self._popen(subprocess.DEVNULL)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as log:
                log.write(f"$ {self.command}\n".encode())
                log.flush()
                self.popen = self._popen(log)

    def _wait_ready_or_move(self, timeout_s: float) -> None:
        """``wait_ready``; after a port conflict, up to ``START_ATTEMPTS`` starts in all. Runs in
        the thread that started the child (a restart must come from it: see the docstring)."""
        attempt = 1
        while True:
            try:
                self.wait_ready(timeout_s)
                return
            except StartError:
                moved = (attempt < START_ATTEMPTS and not self.alive and not self._was_ready
                         and self.port_conflict() and self.move_ports())
                self.stop()
                if not moved:
                    raise
            except BaseException:
                self.stop()
                raise
            attempt += 1
            self._spawn()

    def port_conflict(self) -> bool:
        """The child that just exited could not bind a port: its log says so, or a port it was
        given is held by another process now."""
        return (PORT_IN_USE in self.log_tail(LOG_TAIL_LINES).lower()
                or not all(port_free(p) for p in self.chosen_ports()))

    def chosen_ports(self) -> Sequence[int]:
        """The ports the kit chose for this child (not its caller): those ``move_ports`` may
        change. None here; ``SimProcess`` and ``GatewayProcess`` override it."""
        return ()

    def move_ports(self) -> bool:
        """Choose other free ports in place of ``chosen_ports`` and rewrite ``argv`` (and the
        URLs) to match; False when there is nothing the kit may move (the default)."""
        return False

    def _popen(self, out: int | IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_death_signal(self.death_signal),
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until ``ready`` holds; ``StartError`` (with the log's tail) when the child
        exits first or ``timeout_s`` passes."""
        started = time.monotonic()
        if self.ready is None:
            return 0.0
        check = self.ready

        def ready() -> object:
            if not self.alive:
                raise StartError(f"{self.argv[:4]} exited with code {self.returncode} during "
                                 f"start-up:\n{self.log_tail()}")
            return check()

        try:
            wait_until(ready, timeout_s, f"{self.command[:200]}")
        except TimeoutError as exc:
            raise StartError(f"{exc}\n{self.log_tail()}") from None
        self._was_ready = True  # its ports are its own from now on: a restart keeps them
        return time.monotonic() - started

    def send_signal(self, sig: int) -> None:
        """``sig`` to the child itself (not its group)."""
        if self.alive:
            os.kill(self.pid, sig)

    def pause(self) -> None:
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL to the group (no chance to close anything), and reap."""
        if self.popen is not None:
            _signal_group(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM to the group, SIGKILL after ``timeout_s`` (default the grace); the exit code."""
        if self.popen is None:
            return None
        stop_group([self.popen], self.stop_grace_s if timeout_s is None else timeout_s)
        return self.popen.returncode

    def rss_bytes(self) -> int | None:
        """Resident set size from /proc (Linux); None when the process is gone."""
        if self.popen is None:
            return None
        try:
            status = Path(f"/proc/{self.popen.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None:
            return "(no log)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ManagedProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(processes: Sequence[ManagedProcess], timeout_s: float = START_TIMEOUT_S) -> None:
    """Start processes side by side (start-up is mostly imports), then wait for each (one that
    lost a port the kit chose is started again on others, as by ``start``)."""
    for p in processes:
        p.start(wait=False)
    for p in processes:
        p._wait_ready_or_move(timeout_s)


P = TypeVar("P", bound=ManagedProcess)


class ProcessSet:
    """The children of one run, by name, with their logs in ``log_dir``; ``stop_all`` ends them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: dict[str, ManagedProcess] = {}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def add(self, name: str, proc: P) -> P:
        """Own ``proc`` (its log moves under ``log_dir`` as NAME.log, written afresh)."""
        proc.log_path = self.log_path(name)
        with contextlib.suppress(FileNotFoundError):
            proc.log_path.unlink()
        self._procs[name] = proc
        return proc

    def start(self, name: str, proc: P, timeout_s: float = 60.0, wait: bool = True) -> P:
        """``add`` then start (waiting for readiness with ``wait``)."""
        self.add(name, proc).start(wait=wait, timeout_s=timeout_s)
        return proc

    def get(self, name: str) -> ManagedProcess:
        return self._procs[name]

    def tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        proc = self._procs.get(name)
        return "" if proc is None else proc.log_tail(lines)

    def stop(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.stop()

    def stop_all(self) -> None:
        procs = [p for p in reversed(self._procs.values()) if p.popen is not None]
        self._procs.clear()
        stop_group([p.popen for p in procs if p.popen is not None],
                   max((p.stop_grace_s for p in procs), default=STOP_GRACE_S))

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
