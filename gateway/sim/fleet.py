"""Many simulated workers in one process and one asyncio loop.

Each worker gets its own listening socket and its own ``uvicorn.Server`` (started with
``startup``/``shutdown``, not ``serve``, so no server installs signal handlers or runs its own
0.1 s tick loop); one fleet-wide task refreshes their ``Date`` headers once a second. Workers
share one tokenizer per tokenizer source and one ZMQ context (one I/O thread) for their KV-event
sockets. An idle fleet therefore wakes about once a second in total; the engines sleep on events.

Measured numbers (idle and loaded CPU) are in the docstring of ``gateway.sim``;
``python -m gateway.sim.measure`` reproduces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence

import httpx
import uvicorn
import zmq

from gateway.prompt.tokenizer import PromptTokenizer, load_tokenizer
from gateway.sim.config import SimWorkerConfig
from gateway.sim.costmodel import CostModel
from gateway.sim.worker import SimWorker

log = logging.getLogger(__name__)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only when it does, and
    # without it Nagle holds a stream's first token behind the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


HEALTH_TIMEOUT_S = 30.0
"""The fleet's own health check at start (see ``SimFleet.start``)."""


class SimFleet:
    def __init__(
        self,
        configs: Sequence[SimWorkerConfig],
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        *,
        cost_models: Sequence[CostModel | None] | None = None,
    ) -> None:
        if ports is not None and len(ports) != len(configs):
            raise ValueError("one port per worker config")
        if cost_models is not None and len(cost_models) != len(configs):
            raise ValueError("one cost model (or None) per worker config")
        self.configs = list(configs)
        self.host = host
        self._ports = list(ports) if ports is not None else [0] * len(configs)
        self._cost_models = list(cost_models) if cost_models is not None else [None] * len(configs)
        self.urls: list[str] = []
        self.workers: list[SimWorker] = []
        self._servers: list[uvicorn.Server] = []
        self._sockets: list[socket.socket] = []
        self._zmq: zmq.Context[zmq.Socket[bytes]] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._started = False

    async def start(self) -> list[str]:
        if self._started:
            return self.urls
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self.urls

    async def _start(self) -> None:
        if any(c.kv_events for c in self.configs):
            self._zmq = zmq.Context()
        tokenizers: dict[str, PromptTokenizer] = {}
        for config, cost in zip(self.configs, self._cost_models, strict=True):
            tok = tokenizers.get(config.tokenizer)
            if tok is None:
                tok = tokenizers[config.tokenizer] = load_tokenizer(config.tokenizer)
            self.workers.append(SimWorker(config, tokenizer=tok, cost=cost, zmq_context=self._zmq))
        url_host = f"[{self.host}]" if ":" in self.host else self.host
        for worker, port in zip(self.workers, self._ports, strict=True):
            sock = _listen(self.host, port)
            self._sockets.append(sock)
            uconfig = uvicorn.Config(
                worker.app,
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan="off",
                proxy_headers=False,
                server_header=True,
                timeout_graceful_shutdown=1,
                timeout_keep_alive=30,
            )
            uconfig.load()
            server = uvicorn.Server(uconfig)
            server.lifespan = uconfig.lifespan_class(uconfig)
            await server.on_tick(0)  # sets the Date header
            await server.startup(sockets=[sock])
            self._servers.append(server)
            port = sock.getsockname()[1]
            self.urls.append(f"http://{url_host}:{port}")
            # the address a producer's kv_transfer_params send the decode side to
            worker.set_address("127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host,
                               port)
        for worker in self.workers:
            await worker.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="sim-fleet-tick")
        # Served by this very loop: only a stall of the whole process makes it slow, so the
        # timeout is a generous bound, not a readiness criterion.
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
            for url in self.urls:
                (await client.get(f"{url}/health")).raise_for_status()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for server in self._servers:
                await server.on_tick(0)

    async def stop(self) -> None:
        """Stop engines, HTTP servers and sockets; safe to call twice."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        workers, self.workers = self.workers, []
        for worker in workers:
            await worker.stop()
        servers, self._servers = self._servers, []
        await asyncio.gather(
            *(s.shutdown(sockets=[]) for s in servers if s.started), return_exceptions=True
        )
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        self.urls = []
        self._started = False

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
