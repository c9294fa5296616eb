"""A TCP proxy that plays a worker dying mid-stream: it forwards a connection faithfully until the
worker has sent ``cut_after_content_events`` SSE events with content on it, then drops both sides
(no FIN handshake courtesy, no final chunk), as a crashed vLLM process would.

The cut falls exactly after that event, however the worker's bytes were batched into reads: a
loaded vLLM may write many events at once, and cutting at the first read that crossed the count
(as this proxy once did) could drop the stream before any content got through.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Iterator

import orjson

from gateway.procs.net import free_port

# One SSE event as uvicorn writes it in a chunked response: the event, then the chunk's CRLF.
EVENT = re.compile(rb"data: ([^\n]*)\n\n(?:\r\n)?")


def has_content(payload: bytes) -> bool:
    """Whether a chat stream event carries text (the role chunk, the finish and usage chunks and
    ``[DONE]`` do not)."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    choices = data.get("choices") if isinstance(data, dict) else None
    delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
    return isinstance(delta, dict) and bool(delta.get("content"))


class EventCounter:
    """Reads a worker's response as it arrives and says where it must be cut: right after the
    ``cut_after``-th event with content, wherever the reads split the bytes."""

    def __init__(self, cut_after: int) -> None:
        self.cut_after = cut_after
        self.seen = b""  # everything the worker sent so far
        self.scanned = 0  # where in ``seen`` counting resumes
        self.counted = 0

    def feed(self, data: bytes) -> int | None:
        """How much of ``data`` goes through before the cut; None: all of it, no cut yet."""
        offset = len(self.seen)
        self.seen += data
        while (event := EVENT.search(self.seen, self.scanned)) is not None:
            self.scanned = event.end()
            if has_content(event.group(1)):
                self.counted += 1
                if self.counted == self.cut_after:
                    return self.scanned - offset
        return None


class DyingProxy:
    def __init__(self, target_port: int, cut_after_content_events: int) -> None:
        self.target_port = target_port
        self.cut_after_content_events = cut_after_content_events
        self.port = free_port()
        self.cuts = 0
        self.armed = True
        self.delivered = b""  # what the dying worker's stream got through before the cut
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    other: asyncio.StreamWriter, counter: EventCounter | None) -> None:
        """Copies ``reader`` to ``writer``; with a ``counter`` (worker -> client), while armed,
        only up to the cut, and then drops both connections."""
        try:
            while data := await reader.read(65536):
                cut = counter.feed(data) if counter is not None and self.armed else None
                writer.write(data if cut is None else data[:cut])
                await writer.drain()
                if counter is not None and cut is not None:
                    self.delivered = counter.seen[:len(counter.seen) - len(data) + cut]
                    self.cuts += 1
                    self.armed = False  # one crash per test
                    for w in (writer, other):
                        w.transport.abort()
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        this = asyncio.current_task()
        assert this is not None
        self._connections.add(this)
        this.add_done_callback(self._connections.discard)
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(
            self._pipe(client_r, up_w, client_w, None),
            self._pipe(up_r, client_w, up_w, EventCounter(self.cut_after_content_events)))

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        self._loop.run_until_complete(start())
        started.set()
        self._loop.run_forever()

    async def _close(self) -> None:
        """Stop listening and close every connection still open (each pipe closes its writer),
        so nothing is left for the garbage collector to find unclosed."""
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        await asyncio.sleep(0)  # the closed transports' connection_lost callbacks

    @contextlib.contextmanager
    def running(self) -> Iterator[DyingProxy]:
        started = threading.Event()
        thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        thread.start()
        started.wait(10)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(10)
            self._loop.close()
