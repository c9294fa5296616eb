"""Server-sent events, incrementally: split a byte stream into whole events and classify them.

The relay forwards each event the moment its terminating blank line arrives, so a chunk that ends
mid-line is held only until the rest of that line comes; nothing is buffered whole. Classifying an
event costs a substring test, plus a JSON parse only for the rare events that carry ``usage`` or
``error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson


class Kind(Enum):
    CONTENT = "content"  # carries choices (tokens)
    USAGE = "usage"  # the final chunk with "choices": [] and usage (include_usage)
    ERROR = "error"  # {"error": {...}} sent mid-stream
    DONE = "done"  # data: [DONE]
    OTHER = "other"  # comments, keep-alives, anything else


@dataclass(frozen=True)
class Event:
    raw: bytes  # the event as received (\r\n normalised to \n), terminator included
    kind: Kind
    usage: dict[str, Any] | None = None


class SSESplitter:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events in ``chunk`` (with what was held before), each with its terminator."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:  # after joining: a chunk may end between \r and \n
            buf = buf.replace(b"\r\n", b"\n")
        events: list[bytes] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            events.append(buf[start : end + 2])
            start = end + 2
        self._buf = buf[start:]
        return events

    def tail(self) -> bytes:
        """Bytes received after the last complete event (an upstream that ended mid-event)."""
        tail, self._buf = self._buf, b""
        return tail


def classify(raw: bytes) -> Event:
    data = _data(raw)
    if data is None:
        return Event(raw, Kind.OTHER)
    if data == b"[DONE]":
        return Event(raw, Kind.DONE)
    if b'"error"' in data and data.lstrip().startswith(b'{"error"'):
        return Event(raw, Kind.ERROR)
    if b'"usage"' in data:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Event(raw, Kind.OTHER)
        if isinstance(obj, dict):
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if not obj.get("choices"):
                    return Event(raw, Kind.USAGE, usage)
                return Event(raw, Kind.CONTENT, usage)
    return Event(raw, Kind.CONTENT)


def _data(raw: bytes) -> bytes | None:
    # vLLM sends one `data:` line per event; join several as the SSE spec says.
    lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"
