"""Server-sent events, incrementally: split a byte stream into whole events and classify them.

The relay forwards each event the moment its terminating blank line arrives, so a chunk that ends
mid-line is held only until the rest of that line comes; nothing is buffered whole.

Most events of a stream are token chunks that the gateway passes on untouched, so the relay
does not look at them one by one: ``SSESplitter.feed_block`` returns the complete events of a
chunk as one block (one ``rfind``), and ``only_tokens`` / ``tokens_prefix`` tell, with a few
substring searches over the block, how much of it is plain token chunks. Only the other events
(the first token, which marks TTFT; the usage chunk; ``[DONE]``, errors, comments) are split
off and classified: a substring test, plus a JSON parse for the rare events that carry
``usage``. Streaming 64 chunks per request, classifying every event cost about a quarter of the
gateway's CPU (py-spy, ``docs/results/profile_stream_before.svg``).

``SSESplitter.tokens_block`` is the same split asked without changing anything: the relay's
token lane (``gateway.upstream.relay.TokenLane``) takes a chunk only when it is token chunks
alone, and leaves anything else to ``feed_block`` on the relay's task.
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


@dataclass(frozen=True, init=False)
class Event:
    """(Its ``__init__`` is explicit: compiled, ``gateway.native``, as ``FoundUsage``'s.)"""

    raw: bytes  # the event as received (\r\n normalised to \n), terminator included
    kind: Kind
    usage: dict[str, Any] | None = None
    response_id: str | None = None  # a Responses stream's ``response.created``: the new id

    def __init__(self, raw: bytes, kind: Kind, usage: dict[str, Any] | None = None,
                 response_id: str | None = None) -> None:
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "usage", usage)
        object.__setattr__(self, "response_id", response_id)


class SSESplitter:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events in ``chunk`` (with what was held before), each with its terminator."""
        return split_events(self.feed_block(chunk))

    def feed_block(self, chunk: bytes) -> bytes:
        """The complete events in ``chunk`` (with what was held before) as one block of bytes,
        each with its terminator; empty when no event ended in it."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:  # after joining: a chunk may end between \r and \n
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n") + 2
        if end < 2:
            self._buf = buf
            return b""
        self._buf = buf[end:]
        return buf[:end]

    def tokens_block(self, chunk: bytes) -> tuple[bytes, bytes] | None:
        """What ``feed_block`` would return for ``chunk`` and what it would then hold, when
        that block is plain token chunks (``only_tokens``) or empty; None when an event in it
        needs a look. Nothing changes until ``hold`` is given the second part: a caller that
        cannot pass the block on leaves the chunk to ``feed_block``."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n") + 2
        if end < 2:
            return b"", buf
        if end == len(buf):
            return (buf, b"") if only_tokens(buf) else None
        block = buf[:end]
        return (block, buf[end:]) if only_tokens(block) else None

    def hold(self, rest: bytes) -> None:
        """Keep ``rest`` (from ``tokens_block``) for the next chunk."""
        self._buf = rest

    def tail(self) -> bytes:
        """Bytes received after the last complete event (an upstream that ended mid-event)."""
        tail, self._buf = self._buf, b""
        return tail


def split_events(block: bytes) -> list[bytes]:
    """The events of a block of complete events, each with its terminator."""
    events: list[bytes] = []
    start = 0
    while (end := block.find(b"\n\n", start)) >= 0:
        events.append(block[start : end + 2])
        start = end + 2
    return events


def only_tokens(block: bytes) -> bool:
    """True when every event of ``block`` (complete events) classifies as ``CONTENT`` without
    usage: each event is exactly one ``data:`` line, and no ``usage``, ``[DONE]`` or ``error``
    appears in the block. Five searches in C, against a split and a classify per event.

    False is no verdict (the text of a token may mention ``usage``): the caller classifies each
    event then.
    """
    events = block.count(b"\n\n")
    return (block.startswith(b"data:") and block.count(b"\n") == 2 * events
            and block.count(b"\n\ndata:") == events - 1 and b'"usage"' not in block
            and b"[DONE]" not in block and b'"error"' not in block)


def tokens_prefix(block: bytes) -> int:
    """How many leading bytes of ``block`` (complete events) are whole events that
    ``only_tokens`` accepts: the bytes before the event that first mentions ``usage``,
    ``[DONE]`` or ``error``, when those are plain token chunks; else 0.

    A stream's last read usually holds its last tokens, the usage chunk and ``[DONE]``: only the
    events from the usage chunk on need a look each.
    """
    marks = [i for i in (block.find(b'"usage"'), block.find(b"[DONE]"), block.find(b'"error"'))
             if i >= 0]
    end = block.rfind(b"\n\n", 0, min(marks)) + 2 if marks else len(block)
    return end if end > 1 and only_tokens(block[:end]) else 0


def classify(raw: bytes) -> Event:
    if raw.startswith(_RESPONSES_EVENTS):
        return _typed(raw)
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


_RESPONSES_EVENTS = (b"event: response.", b"event: error\n")
"""How the Responses API's events start (``_typed``); other named events go by their data."""
_ENDED = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
"""The Responses events that end a response: each carries it whole, with its ``usage``."""


def _typed(raw: bytes) -> Event:
    """An event of the Responses API (vLLM writes ``event: <type>`` then one ``data:`` line). A ``*.delta`` event is generated tokens (TTFT, TPOT); the one that ends
    the response carries the usage (``response.usage``); ``response.created`` the id of the
    response (the worker that sent it owns it); every other event (lifecycle, errors) is
    ``OTHER``. Only those last two are parsed, once per stream."""
    name = raw[6:raw.find(b"\n")].strip()
    if name.endswith(b".delta"):
        return Event(raw, Kind.CONTENT)
    if name != b"response.created" and name not in _ENDED:
        return Event(raw, Kind.OTHER)
    data = _data(raw)
    try:
        obj = orjson.loads(data) if data is not None else None
    except orjson.JSONDecodeError:
        obj = None
    response = obj.get("response") if isinstance(obj, dict) else None
    if not isinstance(response, dict):
        return Event(raw, Kind.OTHER)
    if name == b"response.created":
        rid = response.get("id")
        return Event(raw, Kind.OTHER, response_id=rid if isinstance(rid, str) else None)
    usage = response.get("usage")
    return Event(raw, Kind.USAGE, usage if isinstance(usage, dict) else None)


def _data(raw: bytes) -> bytes | None:
    # vLLM sends one `data:` line per event; join several as the SSE spec says.
    lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"
