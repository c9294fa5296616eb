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
* ``background`` is refused (400) as by vLLM without the store; cancel answers vLLM's 400 for a
  response that is not running in the background.
"""

from __future__ import annotations

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
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ResponsesRefused(Exception):
    """What vLLM refuses, with its status and ``param`` (the app turns it into its error)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Turn:
    """One Responses request, ready to run: its id, the whole conversation vLLM renders, the
    template options, and the output limit field's value."""

    response_id: str
    messages: list[dict[str, Any]]
    options: dict[str, Any]
    store: bool


@dataclass(frozen=True)
class _Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """vLLM's ``response_store`` + ``msg_store`` of one worker."""

    def __init__(self) -> None:
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    def turn(self, body: Mapping[str, Any]) -> Turn:
        """The request's conversation, with the stored one it continues (404 when unknown)."""
        if body.get("background"):
            raise ResponsesRefused(
                400, "This vLLM engine does not support `store=True` and therefore does not"
                " support the background mode.", "background")
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
                                       "response_id")
            head = 1 if body.get("instructions") else 0
            history = [m for m in stored.messages if m.get("role") != "system"]
            history += [{"role": "assistant", "content": part["text"]}
                        for item in stored.response["output"] if item["type"] == "message"
                        for part in item["content"]]
            messages = messages[:head] + history + messages[head:]
        return Turn(f"resp_{uuid.uuid4().hex}", messages, options,
                    store=body.get("store", True) is not False)

    def save(self, turn: Turn, response: dict[str, Any]) -> None:
        if not turn.store:
            return
        self._stored[turn.response_id] = _Stored(response, turn.messages)
        while len(self._stored) > MAX_STORED:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self._stored.get(response_id)
        if stored is None:
            raise ResponsesRefused(404, f"Response with id '{response_id}' not found.",
                                   "response_id")
        return stored.response

    def cancel(self, response_id: str) -> dict[str, Any]:
        self.get(response_id)  # 404 first, as vLLM
        raise ResponsesRefused(400, "Cannot cancel a synchronous response.", "response_id")


def response_object(turn: Turn, body: Mapping[str, Any], model: str, max_tokens: int, *,
                    status: str, text: str | None, usage: dict[str, Any] | None,
                    message_id: str) -> dict[str, Any]:
    """The response as vLLM's ``ResponsesResponse`` serialises (the fields clients read)."""
    output = [] if text is None else [{
        "id": message_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                       "logprobs": None}],
        "role": "assistant", "status": "completed", "type": "message"}]
    return {
        "id": turn.response_id, "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "model": model, "object": "response", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0), "tool_choice": "none", "tools": [],
        "top_p": body.get("top_p", 1.0), "background": False, "max_output_tokens": max_tokens,
        "max_tool_calls": None, "previous_response_id": body.get("previous_response_id"),
        "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
        "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
        "user": body.get("user"),
    }


def usage_of(stream: RequestStream, output_tokens: int) -> dict[str, Any]:
    prompt = stream.request.num_prompt_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": stream.request.num_cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
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
    item = {"id": message_id, "content": [], "role": "assistant", "status": "in_progress",
            "type": "message"}
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    await writer.event("response.output_item.added", {"item": item, "output_index": 0})
    await writer.event("response.content_part.added", {
        **where, "part": {"annotations": [], "text": "", "type": "output_text"}})

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
