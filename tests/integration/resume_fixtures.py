"""A TCP proxy that plays a worker dying mid-stream: it forwards a connection faithfully until the
worker has sent ``cut_after_events`` SSE events on it, then drops both sides (no FIN handshake
courtesy, no final chunk), as a crashed vLLM process would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from gateway.procs.net import free_port


class DyingProxy:
    def __init__(self, target_port: int, cut_after_events: int) -> None:
        self.target_port = target_port
        self.cut_after_events = cut_after_events
        self.port = free_port()
        self.cuts = 0
        self.armed = True
        self.delivered = b""  # what the dying worker's stream got through before the cut
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    count: bool, other: asyncio.StreamWriter) -> None:
        events = 0
        sent = b""
        try:
            while data := await reader.read(65536):
                if count and self.armed:
                    events += data.count(b"data: ")
                    if events >= self.cut_after_events:
                        self.delivered = sent
                        self.cuts += 1
                        self.armed = False  # one crash per test
                        for w in (writer, other):
                            w.transport.abort()
                        return
                if count:
                    sent += data
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(client_r, up_w, False, client_w),
                             self._pipe(up_r, client_w, True, up_w))

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        self._loop.run_until_complete(start())
        started.set()
        self._loop.run_forever()

    @contextlib.contextmanager
    def running(self) -> Iterator[DyingProxy]:
        started = threading.Event()
        thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        thread.start()
        started.wait(10)
        try:
            yield self
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(10)
