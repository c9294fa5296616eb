"""The simulated worker's Responses API: ``POST /v1/responses`` (streamed or not),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, as vLLM 0.32 serves them
with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``entrypoints/openai/responses/serving.py``).

* The conversation is vLLM's: ``instructions`` first, then, with ``previous_response_id``, the
  stored conversation's messages (its system ones dropped) and the previous output's text as an
  assistant message, then the new ``input`` (``gateway.prompt.render.responses_conversation``,
  the same flattening the gateway counts with).
* Stored responses live in this worker's memory only, like vLLM's: another worker answers 404
  to an id it did not make (``Response with id '...' not found.``), which is what the gateway's
  owner routing is for. A stored response is kept unless ``store`` is false; the store holds at
  most ``MAX_STORED`` (vLLM never forgets; a simulated fleet runs for hours).
* A stream is vLLM's event sequence for a text answer: ``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
  one ``response.output_text.delta`` per batch of tokens, the ``.done`` events, then
  ``response.completed`` (``incomplete`` status at the output limit) carrying the usage.
* ``background: true`` is served as vLLM serves it with the store on (``create_responses``,
  ``_run_background_request[_stream]``, ``cancel_responses``): the response is stored at once as
  ``queued`` (no output, no usage) and answered so (streamed: the events as they come, the
  generation going on if the client leaves), and generates in a task of its own; a retrieve
  shows ``queued`` until the final object replaces it (vLLM stores nothing in between), and a
  cancel marks it ``cancelled`` (kept so: the final object no longer replaces it) and aborts
  its generation, freeing its KV blocks. A cancel of a response that is not queued or running
  is vLLM's 400. ``background`` without ``store`` is vLLM's 400; a ``request_id`` in the body
  becomes the response's id, as in vLLM (the gateway names background responses so).
* The store is on unless the worker is built with ``ResponseStore(enabled=False)`` (vLLM
  without ``VLLM_ENABLE_RESPONSES_API_STORE``): then nothing is stored, every
  ``previous_response_id`` is a 404 and ``background`` is vLLM's 400 for a server without it.
* Message items carry ``phase: null`` wherever vLLM 0.32 writes one (its ``openai`` types'
  ``ResponseOutputMessage.phase``, serialised unset): in the output, and in the items of the
  ``response.output_item.added``/``.done`` events.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.prompt.render import UncountableContentError, responses_conversation

if TYPE_CHECKING:
    from gateway.sim.engine import RequestStream

MAX_STORED = 10_000
SERVING_ERROR = "invalid_request_error"
"""The error type of what vLLM's Responses serving refuses itself (``create_error_response``)."""
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ResponsesRefused(Exception):
    """What vLLM refuses, with its status, ``param`` and error type (the app turns it into its
    error): ``BadRequestError`` for a request its models refuse, ``invalid_request_error`` for
    what ``OpenAIServingResponses`` refuses itself (unknown ids, cancels, no store)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.type_ = type_


@dataclass(frozen=True)
class Turn:
    """One Responses request, ready to run: its id, the whole conversation vLLM renders, the
    template options, and the output limit field's value."""

    response_id: str
    messages: list[dict[str, Any]]
    options: dict[str, Any]
    store: bool
    background: bool = False


@dataclass(frozen=True)
class _Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


NO_STORE_BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the"
    " background mode. To enable these features, set the environment variable"
    " `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.")
"""vLLM's refusal of ``background`` when its store is off."""


class ResponseStore:
    """vLLM's ``response_store`` + ``msg_store`` (+ ``background_tasks``) of one worker;
    ``enabled``: ``VLLM_ENABLE_RESPONSES_API_STORE``."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        # background responses generating now: their task and what aborts their generation
        self._running: dict[str, tuple[asyncio.Task[None], Callable[[], None]]] = {}

    def turn(self, body: Mapping[str, Any]) -> Turn:
        """The request's conversation, with the stored one it continues (404 when unknown)."""
        background = bool(body.get("background"))
        store = bool(body.get("store", True))
        if background and not store:  # ``ResponsesRequest.validate_background``
            raise ResponsesRefused(400, "background can only be used when `store` is true",
                                   "background")
        if not self.enabled:
            if background:
                raise ResponsesRefused(400, NO_STORE_BACKGROUND, "background",
                                       SERVING_ERROR)
            store = False  # vLLM ignores ``store`` silently without its store
        items = body.get("input")
        if not isinstance(items, str | list):
            raise ResponsesRefused(400, "`input` must be a string or a list of items", "input")
        try:
            messages, options = responses_conversation(body)
        except UncountableContentError as exc:
            raise ResponsesRefused(400, str(exc), exc.param) from exc
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self._stored.get(previous)
            if stored is None:
                raise ResponsesRefused(404, f"Response with id '{previous}' not found.",
                                       "response_id", SERVING_ERROR)
            head = 1 if body.get("instructions") else 0
            history = [m for m in stored.messages if m.get("role") != "system"]
            history += [{"role": "assistant", "content": part["text"]}
                        for item in stored.response["output"] if item["type"] == "message"
                        for part in item["content"]]
            messages = messages[:head] + history + messages[head:]
        rid = body.get("request_id")
        return Turn(rid if isinstance(rid, str) and rid else f"resp_{uuid.uuid4().hex}",
                    messages, options, store=store, background=background)

    def save(self, turn: Turn, response: dict[str, Any]) -> None:
        """Store the response (vLLM: not over one cancelled meanwhile)."""
        if not turn.store:
            return
        old = self._stored.get(turn.response_id)
        if old is not None and old.response["status"] == "cancelled":
            return
        self._stored[turn.response_id] = _Stored(response, turn.messages)
        while len(self._stored) > MAX_STORED:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self._stored.get(response_id)
        if stored is None:
            raise ResponsesRefused(404, f"Response with id '{response_id}' not found.",
                                   "response_id", SERVING_ERROR)
        return stored.response

    def cancel(self, response_id: str) -> dict[str, Any]:
        """vLLM's ``cancel_responses``: a queued or running response is marked ``cancelled``
        and its generation aborted (its KV blocks freed now); any other is a 400."""
        response = self.get(response_id)  # 404 first, as vLLM
        if response["status"] not in ("queued", "in_progress"):
            raise ResponsesRefused(400, "Cannot cancel a synchronous response.", "response_id",
                                   SERVING_ERROR)
        response["status"] = "cancelled"
        running = self._running.pop(response_id, None)
        if running is not None:
            task, abort = running
            abort()
            task.cancel()
        return response

    def running(self) -> int:
        """Background responses generating now."""
        return len(self._running)

    async def background(self, send: Send, turn: Turn, body: Mapping[str, Any], model: str,
                         max_tokens: int, stream: RequestStream,
                         token_text: Callable[[int], str], abort: Callable[[], None]) -> None:
        """Serve ``background: true``: the response stored as ``queued`` and answered so (a
        stream: its events relayed as they come), its generation in a task of its own that
        outlives this request; ``abort`` ends the generation (a cancel, or the task's end)."""
        queued = response_object(turn, body, model, max_tokens, status="queued", text=None,
                                 usage=None, message_id="")
        self._stored[turn.response_id] = _Stored(queued, turn.messages)
        feed = _Feed() if body.get("stream") else None
        task = asyncio.get_running_loop().create_task(
            self._generate(feed, turn, body, model, max_tokens, stream, token_text))
        self._running[turn.response_id] = (task, abort)

        def ended(_: asyncio.Task[None]) -> None:
            if self._running.get(turn.response_id, (None,))[0] is task:
                del self._running[turn.response_id]
            abort()

        task.add_done_callback(ended)
        if feed is None:
            data = orjson.dumps(queued)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data, "more_body": False})
        else:
            await feed.relay(send)

    async def _generate(self, feed: _Feed | None, turn: Turn, body: Mapping[str, Any],
                        model: str, max_tokens: int, stream: RequestStream,
                        token_text: Callable[[int], str]) -> None:
        try:
            if feed is not None:
                await stream_answer(EventWriter(feed.put), self, turn, body, model, max_tokens,
                                    stream, token_text)
                return
            final = await whole_answer(turn, body, model, max_tokens, stream, token_text)
            if final is not None:
                self.save(turn, final)
        finally:
            if feed is not None:
                feed.close()


class _Feed:
    """The ASGI messages of a background stream, kept as they are made and relayed to the
    client that created it (who may leave: the generation goes on)."""

    def __init__(self) -> None:
        self._messages: list[dict[str, Any]] = []
        self._more = asyncio.Event()
        self._closed = False

    async def put(self, message: dict[str, Any]) -> None:
        self._messages.append(message)
        self._more.set()

    def close(self) -> None:
        self._closed = True
        self._more.set()

    async def relay(self, send: Send) -> None:
        sent = 0
        while True:
            while sent < len(self._messages):
                await send(self._messages[sent])
                sent += 1
            if self._closed:
                last = self._messages[-1] if self._messages else None
                if last is None or last.get("more_body", False):  # cancelled mid-way: end it
                    if last is None:
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": SSE})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            self._more.clear()
            await self._more.wait()


def response_object(turn: Turn, body: Mapping[str, Any], model: str, max_tokens: int, *,
                    status: str, text: str | None, usage: dict[str, Any] | None,
                    message_id: str) -> dict[str, Any]:
    """The response as vLLM's ``ResponsesResponse`` serialises (the fields clients read)."""
    output: list[dict[str, Any]] = [] if text is None else [{
        "id": message_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                       "logprobs": None}],
        "role": "assistant", "status": "completed", "type": "message", "phase": None}]
    return {
        "id": turn.response_id, "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "model": model, "object": "response", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0), "tool_choice": "none", "tools": [],
        "top_p": body.get("top_p", 1.0), "background": bool(body.get("background")), "max_output_tokens": max_tokens,
        "max_tool_calls": None, "previous_response_id": body.get("previous_response_id"),
        "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
        "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
        "user": body.get("user"),
        "presence_penalty": float(body.get("presence_penalty") or 0.0),
        "frequency_penalty": float(body.get("frequency_penalty") or 0.0),
        "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
        "output_messages": None,
    }


def usage_of(stream: RequestStream, output_tokens: int) -> dict[str, Any]:
    prompt = stream.request.num_prompt_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": stream.request.num_cached_tokens,
                                     "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output_tokens}


class EventWriter:
    """vLLM's SSE framing of Responses events: ``event: <type>``, one ``data:`` line, and a
    ``sequence_number`` counting from 0."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._sequence = 0

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": SSE})

    async def event(self, type_: str, fields: Mapping[str, Any], *, last: bool = False) -> None:
        data = orjson.dumps({**fields, "sequence_number": self._sequence, "type": type_})
        self._sequence += 1
        await self._send({"type": "http.response.body", "more_body": not last,
                          "body": b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n"})


async def stream_answer(writer: EventWriter, store: ResponseStore, turn: Turn,
                        body: Mapping[str, Any], model: str, max_tokens: int,
                        stream: RequestStream, token_text: Callable[[int], str]) -> None:
    """Stream one answer as vLLM's events, stored before its last event (vLLM stores it before
    ``response.completed`` goes out, so a client's next turn finds it)."""
    message_id = f"msg_{uuid.uuid4().hex}"
    created = response_object(turn, body, model, max_tokens, status="in_progress", text=None,
                              usage=None, message_id=message_id)
    await writer.start()
    await writer.event("response.created", {"response": created})
    await writer.event("response.in_progress", {"response": created})
    item: dict[str, Any] = {"id": message_id, "content": [], "role": "assistant",
                            "status": "in_progress", "type": "message", "phase": None}
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    await writer.event("response.output_item.added", {"item": item, "output_index": 0})
    await writer.event("response.content_part.added", {
        **where, "part": {"annotations": [], "text": "", "type": "output_text",
                          "logprobs": []}})

    async def on_delta(delta: str) -> None:
        await writer.event("response.output_text.delta", {**where, "delta": delta,
                                                          "logprobs": []})

    answer = await _generated(stream, token_text, on_delta)
    if answer is None:
        return  # aborted: the client is gone
    text, tokens, status = answer
    final = response_object(turn, body, model, max_tokens, status=status, text=text,
                            usage=usage_of(stream, tokens), message_id=message_id)
    await writer.event("response.output_text.done", {**where, "text": text, "logprobs": []})
    await writer.event("response.content_part.done", {**where, "part": final["output"][0][
        "content"][0]})
    await writer.event("response.output_item.done", {"item": final["output"][0],
                                                     "output_index": 0})
    store.save(turn, final)
    await writer.event("response.completed", {"response": final}, last=True)


async def whole_answer(turn: Turn, body: Mapping[str, Any], model: str, max_tokens: int,
                       stream: RequestStream,
                       token_text: Callable[[int], str]) -> dict[str, Any] | None:
    """The answer as one response object (the caller stores it); None when aborted."""

    async def ignore(delta: str) -> None:
        pass

    answer = await _generated(stream, token_text, ignore)
    if answer is None:
        return None
    text, tokens, status = answer
    return response_object(turn, body, model, max_tokens, status=status, text=text,
                           usage=usage_of(stream, tokens), message_id=f"msg_{uuid.uuid4().hex}")


async def _generated(stream: RequestStream, token_text: Callable[[int], str],
                     on_delta: Callable[[str], Awaitable[None]]) -> tuple[str, int, str] | None:
    """The answer's text, its token count and its status, each batch of tokens handed to
    ``on_delta`` as it comes; None when the request was aborted."""
    parts: list[str] = []
    finish = None
    tokens = 0
    while finish is None:
        batch = await stream.next_batch()
        if not batch:
            return None
        finish = batch[-1].finish_reason
        tokens += len(batch)
        parts.append("".join(token_text(e.token_id) for e in batch))
        await on_delta(parts[-1])
    return "".join(parts), tokens, "incomplete" if finish == "length" else "completed"
