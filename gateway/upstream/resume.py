"""Mid-stream resume (``routing.resume_streams``, off by default): a chat stream whose worker dies
is continued on another worker of the pool, and the client sees one uninterrupted response.

Steps, when the upstream connection breaks after some tokens were relayed:

1. ``Transcript`` has kept what the client received: the stream's ``id``/``created``/``model``
   and the assistant text so far (only when resume is on: it costs a JSON parse per event);
2. ``resume_body`` re-sends the conversation with that partial text as a final assistant
   message, ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM renders
   the template up to the partial answer and generates its continuation), ``max_tokens`` reduced
   by the tokens already generated;
3. ``Splicer`` rewrites the new stream's events: the continuation's role-only first chunk is
   dropped (the client already had one), every chunk carries the original ``id``/``created``, and
   the usage chunk reports the original prompt and all generated tokens.

Cost: nothing unless enabled; then one JSON parse per relayed event, and on a failure one new
prefill of prompt + partial answer (much of it a prefix-cache hit on a worker that holds it).
At temperature 0 the continuation equals what the dead worker would have produced, provided the
partial text re-tokenizes to the same tokens (true for ordinary text with byte-level BPE).
Compared to: NVIDIA Dynamo migrates requests mid-stream; the other routers in
``../shared/notes/peers.md`` end the stream with an error, as kvgate does when this is off.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.prompt.tokenizer import PromptTokenizer


@dataclass
class Transcript:
    """What the client has received of a chat stream so far."""

    stream_id: str | None = None
    created: int | None = None
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, data: dict[str, Any]) -> None:
        if self.stream_id is None and isinstance(data.get("id"), str):
            self.stream_id = data["id"]
            created = data.get("created")
            self.created = created if isinstance(created, int) else None
        for choice in data.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str):
                self.text_parts.append(content)


def event_json(raw: bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` event, or None (``[DONE]``, comments, garbage)."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                return None
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
            return obj if isinstance(obj, dict) else None
    return None


def resume_body(forwarded: bytes, tokenizer: PromptTokenizer, partial: str) -> tuple[bytes, int]:
    """The continuation request, and how many tokens the partial answer counts.

    ``forwarded`` is the body the broken stream was sent with: it already asks for the usage
    chunk (and no per-chunk usage the client did not ask for) and carries the output limit the
    gateway reserved (``gateway.request``).
    """
    body = json.loads(forwarded)
    generated = len(tokenizer.encode_text(partial, add_special_tokens=False)) if partial else 0
    limits = [v for v in (body.get("max_completion_tokens"), body.get("max_tokens"))
              if isinstance(v, int)]
    if limits:
        # The partial answer re-tokenized can count more tokens than the model produced (a
        # random-weight model's byte fragments re-tokenize into more): the model cannot have
        # produced more than its limit, less the one token the continuation still asks for,
        # so the answer's usage never reads more than its limit.
        generated = min(generated, max(0, min(limits) - 1))
    body["messages"] = [*body["messages"], {"role": "assistant", "content": partial}]
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    for name in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(name), int):
            body[name] = max(1, body[name] - generated)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(), generated


@dataclass
class Splicer:
    """Rewrites the continuation stream's events so they read as the original stream's."""

    transcript: Transcript
    prompt_tokens: int
    generated_before: int
    _first: bool = True

    def rewrite(self, raw: bytes, data: dict[str, Any] | None) -> bytes | None:
        if data is None:
            return raw
        if self._first and _role_only(data):
            self._first = False
            return None
        self._first = False
        if self.transcript.stream_id is not None:
            data["id"] = self.transcript.stream_id
        if self.transcript.created is not None:
            data["created"] = self.transcript.created
        usage = data.get("usage")
        if isinstance(usage, dict):
            completion = int(usage.get("completion_tokens") or 0) + self.generated_before
            data["usage"] = {**usage, "prompt_tokens": self.prompt_tokens,
                             "completion_tokens": completion,
                             "total_tokens": self.prompt_tokens + completion}
        return b"data: " + orjson.dumps(data) + b"\n\n"


def _role_only(data: dict[str, Any]) -> bool:
    choices = data.get("choices") or []
    if len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta") or {}
    return isinstance(delta, dict) and "role" in delta and not delta.get("content")


Resumer = Callable[[str], tuple[bytes, int]]
