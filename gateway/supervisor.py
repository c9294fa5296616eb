"""``kvgate serve --processes N``: N gateway processes on one port, one supervisor.

The supervisor serves no request itself. Its steps:

1. hold the port (``reserve``: bound with ``SO_REUSEPORT``, never listened on, so no connection
   waits on it) and create the runtime directory (a fresh private temporary directory, removed on
   exit) that the processes share: the Prometheus multiprocess directory (``MULTIPROCESS_DIR``),
   the shared budget store's socket, the shared-state files of ``gateway.workers`` and
   ``gateway.kvindex``;
2. with ``budgets.store: memory``, host the one store of the whole gateway
   (``gateway.budgets.shared``); with Redis every process talks to Redis as one process would;
3. start N children, each ``python -m gateway.cli serve`` with its ``ProcessRole`` and a socket
   of its own in its environment, bound to the port with ``SO_REUSEPORT`` and not yet listening
   (the supervisor keeps no copy): a child runs exactly the single-process server
   (``gateway.server.serve``) on it, and listens once its app has started. Each child is in its
   own session (a Ctrl-C at a terminal reaches the supervisor only, which forwards it once) and
   dies with the supervisor (``PR_SET_PDEATHSIG``);
4. a child that exits while the supervisor is not stopping is restarted with the same index (the
   leader stays the leader) after a backoff that doubles from ``RESTART_INITIAL_S`` to
   ``RESTART_MAX_S`` and starts over once a child has run ``RESTART_RESET_S``; its siblings keep
   serving meanwhile. Its Prometheus files stay (its counters still count) except the live
   gauges' (``mark_process_dead``). A child that could not start (``STARTUP_FAILURE``, uvicorn's
   status: the lifespan failed, e.g. a tokenizer that cannot load) would fail again: the
   supervisor stops the others and exits with that status, as one process would;
5. on SIGTERM or SIGINT, stop restarting and forward the signal to every child: each drains as
   one process does (``/ready`` 503 for ``shutdown.drain_delay_s``, then in-flight requests and
   streams get ``grace_s``); a second signal is forwarded too and stops the children at once.
   Exit 0 when every child exited 0.

Why a listening socket per process (``SO_REUSEPORT``) rather than one inherited by all: the
kernel then spreads new connections over the processes' accept queues (by a hash of each
connection's addresses), and a process takes connections only once it serves. With one shared
queue nothing spread them: each process's event loop raced for it, and a burst of connections
often went to one process, which kept them as long as the client kept them alive (a load
generator's, or a balancer's pool of kept-alive connections): measured with wrk's 128
connections on two processes, 4 against 500 ticks of CPU in one run of four, 490 against 208 in
two others (libuv's ``UV_TCP_SINGLE_ACCEPT`` did not change that). What this costs: the
connections waiting in a process's own queue when it dies are reset (the kernel does not move
them to the others unless ``net.ipv4.tcp_migrate_req`` is 1; a client's retry reaches a live
process), as are the connections a process had accepted, in either design; new connections go to
the processes still listening. And a second gateway started on the same port by the same user
could join the sockets: ``hold_port`` refuses a port where anything listens.

``--processes 1`` runs no supervisor at all: ``kvgate serve`` is then the single process itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.shared import SHARED_STORE_NAME, SharedBudgetServer, socket_path
from gateway.config import Settings
from gateway.exposition import MULTIPROCESS_DIR, MULTIPROCESS_DIR_ENV
from gateway.httpd import LISTEN_BACKLOG, STARTUP_FAILURE
from gateway.processes import ProcessRole

log = logging.getLogger(__name__)

LISTEN_FD_ENV = "KVGATE_LISTEN_FD"
"""The descriptor of a child's own socket (bound, listened on by the child), in its environment."""
SUPERVISOR_PID_ENV = "KVGATE_SUPERVISOR_PID"

RESTART_INITIAL_S = 0.5
RESTART_MAX_S = 10.0
RESTART_RESET_S = 30.0

_PR_SET_PDEATHSIG = 1


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A socket on ``host:port`` as uvicorn would bind it; with ``reuse_port`` one of several
    on the port (``SO_REUSEPORT``: the kernel spreads connections over those listening);
    without ``listen`` bound only (it takes no connection until listened on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def hold_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket on ``host:port`` (``port`` 0: a free one), refused (``OSError``)
    when any server listens there already. ``SO_REUSEPORT`` alone would let a second gateway of
    the same user join the first one's sockets and silently take half of its connections, so
    the port is first bound without it: that fails while anything listens on the port."""
    with bind(host, port, listen=False) as probe:
        return bind(host, probe.getsockname()[1], reuse_port=True, listen=False)


def inherited(env: Mapping[str, str]) -> tuple[ProcessRole, socket.socket] | None:
    """In a child of the supervisor: its role and its own socket; ``None`` elsewhere."""
    fd = env.get(LISTEN_FD_ENV)
    if fd is None:
        return None
    return ProcessRole.from_env(env), socket.socket(fileno=int(fd))


def die_with_supervisor(env: Mapping[str, str]) -> None:
    """In a child: be sent SIGTERM when the supervisor dies, so that no orphan keeps serving the
    port (it drains and exits as on any SIGTERM)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != env.get(SUPERVISOR_PID_ENV):  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs ``count`` children of ``child_argv`` on one port; see the module docstring."""

    def __init__(self, settings: Settings, *, host: str, port: int, count: int,
                 child_argv: Sequence[str]) -> None:
        self._settings = settings
        self._host = host
        self._port = port
        self._count = count
        self._child_argv = list(child_argv)
        self._children: dict[int, asyncio.subprocess.Process] = {}
        self._exit_codes: dict[int, int] = {}
        self._stopping = asyncio.Event()
        self._signals = 0

    def run(self) -> int:
        """Serve until signalled and every child has exited; the exit status of ``kvgate``.

        On uvloop when installed, as the children: the shared budget store answers every
        request's reserve and release, and costs about 15 % less CPU there."""
        try:
            import uvloop
        except ImportError:
            return asyncio.run(self._main())
        return uvloop.run(self._main())

    async def _main(self) -> int:
        try:
            reserve = hold_port(self._host, self._port)
        except OSError as exc:
            log.error("kvgate: cannot listen on %s:%d: %s", self._host, self._port, exc)
            return STARTUP_FAILURE
        self._port = reserve.getsockname()[1]  # the port chosen, when asked for any (0)
        runtime_dir = Path(tempfile.mkdtemp(prefix="kvgate-"))
        (runtime_dir / MULTIPROCESS_DIR).mkdir()
        budgets = None
        if self._settings.budgets.store == "memory":
            budgets = SharedBudgetServer(MemoryBudgetStore(name=SHARED_STORE_NAME),
                                         socket_path(runtime_dir))
        loop = asyncio.get_running_loop()
        try:
            if budgets is not None:
                await budgets.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
            log.info("kvgate: %d processes on %s:%d (supervisor pid %d, runtime dir %s)",
                     self._count, self._host, self._port, os.getpid(), runtime_dir)
            await asyncio.gather(*(self._keep(i, runtime_dir) for i in range(self._count)))
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            reserve.close()
            if budgets is not None:
                await budgets.close()
            shutil.rmtree(runtime_dir, ignore_errors=True)
        failed = {i: rc for i, rc in self._exit_codes.items() if rc != 0}
        if failed:
            log.warning("kvgate: processes exited uncleanly: %s", failed)
        return STARTUP_FAILURE if STARTUP_FAILURE in failed.values() else int(bool(failed))

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("kvgate: %s: draining %d processes", sig.name, len(self._children))
        self._stop(sig)

    def _stop(self, sig: signal.Signals) -> None:
        self._stopping.set()  # nothing is restarted any more
        for child in self._children.values():
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(sig)

    def _child_env(self, index: int, runtime_dir: Path, fd: int) -> dict[str, str]:
        role = ProcessRole(index=index, count=self._count, runtime_dir=runtime_dir)
        return {**os.environ, **role.to_env(), LISTEN_FD_ENV: str(fd),
                SUPERVISOR_PID_ENV: str(os.getpid()),
                MULTIPROCESS_DIR_ENV: str(runtime_dir / MULTIPROCESS_DIR)}

    async def _keep(self, index: int, runtime_dir: Path) -> None:
        """Run child ``index`` until the supervisor stops, restarting it when it dies."""
        loop = asyncio.get_running_loop()
        delay = RESTART_INITIAL_S
        while not self._stopping.is_set():
            # The child's own socket, which it listens on once it serves; closed here once the
            # child has it, so that it closes (and takes no more connections) when the child dies.
            with bind(self._host, self._port, reuse_port=True, listen=False) as sock:
                fd = sock.fileno()
                child = await asyncio.create_subprocess_exec(
                    *self._child_argv, env=self._child_env(index, runtime_dir, fd),
                    pass_fds=(fd,), start_new_session=True)
            self._children[index] = child
            if self._stopping.is_set():  # signalled while it was starting
                child.send_signal(signal.SIGTERM)
            started = loop.time()
            rc = await child.wait()
            _forget_metrics(child.pid, runtime_dir / MULTIPROCESS_DIR)
            if self._stopping.is_set():
                # Killed by the signal itself: it was still importing, before its handlers.
                self._exit_codes[index] = 0 if rc in (-signal.SIGTERM, -signal.SIGINT) else rc
                return
            if rc == STARTUP_FAILURE:
                log.error("kvgate: process %d (pid %d) could not start; stopping", index, child.pid)
                self._exit_codes[index] = rc
                self._stop(signal.SIGTERM)
                return
            if loop.time() - started >= RESTART_RESET_S:
                delay = RESTART_INITIAL_S
            log.warning("kvgate: process %d (pid %d) exited with %d; restarting it in %.1f s",
                        index, child.pid, rc, delay)
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except TimeoutError:
                delay = min(delay * 2, RESTART_MAX_S)


def _forget_metrics(pid: int, metrics_dir: Path) -> None:
    """Drop a dead child's live gauges (its counters and histograms keep counting)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]
