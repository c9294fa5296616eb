"""Step 2's token ids: the prompt of a parsed request, tokenized as vLLM will tokenize it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.prompt.limits import Deadline, check_room
from gateway.prompt.tokenizer import PromptTokenizer


class PromptRequest(Protocol):
    """What rendering reads of a request (``gateway.request.ParsedRequest``, a layer above)."""

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def is_chat(self) -> bool: ...


def prompt_token_ids(tokenizer: PromptTokenizer, parsed: PromptRequest, *,
                     max_tokens: int | None = None,
                     timeout_s: float | None = None) -> list[list[int]]:
    """One list of token ids per prompt (chat: always one; completions: one per batch entry).

    ``max_tokens``: a prompt certainly longer is refused before it is encoded
    (``PromptTooLongError``); ``timeout_s``: rendering and encoding stop that long after this
    call began (``PromptTimeoutError``). See ``gateway.prompt.limits``."""
    check_room(max_tokens)
    body = parsed.body
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    if parsed.is_chat:
        return [tokenizer.encode_chat(vllm_conversation(body["messages"]), body,
                                      max_tokens=max_tokens, deadline=deadline)]
    prompt: Any = body["prompt"]
    add_special = body.get("add_special_tokens", True) is not False
    if isinstance(prompt, str):
        return [tokenizer.encode_text(prompt, add_special, max_tokens=max_tokens,
                                      deadline=deadline)]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode_text(p, add_special, max_tokens=max_tokens, deadline=deadline)
                for p in prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


# -- message content normalisation --------------------------------------------------------------
#
# vLLM 0.32 does not hand a request's messages to the template as sent: ``parse_chat_messages``
# (``vllm/renderers/chat_utils.py``) rebuilds each one, and the gateway must render what vLLM
# renders to count what vLLM holds. For a template whose content format is "string" (vLLM
# detects it from the template; the text-only models served today):
#
# * content: a string, or parts joined with "\n": plain strings, ``text`` / ``input_text`` /
#   ``output_text`` (``text``), ``refusal`` (``refusal``), ``thinking`` (``thinking``),
#   ``tool_reference`` (``name``); a ``text``/``refusal`` part without its text is skipped;
#   null content is ""; a system message loses a leading ``x-anthropic-billing-header`` line;
# * the message keeps ``role``, ``content``, ``name`` and ``task`` (strings); an assistant its
#   ``tool_calls`` (arguments parsed from JSON into an object, ``{}`` when not one; an empty
#   list dropped) and ``reasoning`` (or ``reasoning_content``) under both names; a tool message
#   its ``tool_call_id``; a developer message its ``tools``; every other key is dropped.
#
# Media parts (``image_url``, ``input_audio``, ``video_url``, ``file``, embeddings, anything
# with a ``uuid`` ...) become tokens only in the model's multimodal processor (image patches,
# audio frames), which a text-only model does not have and the gateway could not run on its
# hot path: they are refused with a 400 naming the part, as is any part vLLM itself refuses.

_TEXT_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking", "tool_reference": "name"}
"""Part types vLLM reads as text, and the key holding the text."""
_SKIPPED_WITHOUT_TEXT = frozenset({"text", "refusal"})
_BILLING_HEADER = "x-anthropic-billing-header"


class UncountableContentError(ValueError):
    """A message content part the gateway cannot count as vLLM will; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def vllm_conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template (see above); each has a string
    ``role`` (``gateway.request`` checked it)."""
    return [_vllm_message(i, m) for i, m in enumerate(messages)]


def _vllm_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str) and not (role == "system" and content.startswith(_BILLING_HEADER)):
        text = content  # the common case: one text part, joined back to itself
    else:
        text = "\n".join(_texts(i, role, content))
    out: dict[str, Any] = {"role": role, "content": text}
    if len(message) == 2 and "content" in message:
        return out  # role and content only: nothing else to keep or drop
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and (calls := _tool_calls(i, calls)):
            out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    elif role == "developer":
        out["tools"] = message.get("tools")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _texts(i: int, role: str, content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[Any] = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise UncountableContentError(
            f"messages[{i}].content must be a string or an array of content parts",
            f"messages.{i}.content")
    if role == "system":
        parts = _without_billing_header(parts)
    texts: list[str] = []
    for j, part in enumerate(parts):
        text = part if isinstance(part, str) else _part_text(part, f"messages.{i}.content.{j}")
        if text is not None:
            texts.append(text)
    return texts


def _part_text(part: Any, param: str) -> str | None:
    if not isinstance(part, Mapping):
        raise UncountableContentError(f"content part {param} must be a string or an object",
                                      param)
    kind = part.get("type")
    field = _TEXT_FIELD.get(kind) if isinstance(kind, str) else None
    if field is None or part.get("uuid") is not None:
        what = f"of type `{kind}`" if isinstance(kind, str) else "without a string `type`"
        raise UncountableContentError(
            f"content part {param} {what} cannot be counted: the gateway budgets KV cache by"
            " the prompt's tokens and counts text parts only (the models it serves are"
            " text-only; image, audio, video, file and embedding parts would need the model's"
            " multimodal processor)", param)
    text = part.get(field)
    if text is None and kind in _SKIPPED_WITHOUT_TEXT:
        return None  # vLLM skips it too
    if not isinstance(text, str):
        raise UncountableContentError(
            f"content part {param} of type `{kind}` must have a string `{field}`", param)
    return text


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text parts."""
    out: list[Any] = []
    for part in parts:
        is_text_part = isinstance(part, Mapping) and part.get("type") == "text"
        text = part if isinstance(part, str) else part.get("text") if is_text_part else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant's tool calls as vLLM renders them: each function's ``arguments`` an object."""
    param = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise UncountableContentError(f"messages[{i}].tool_calls must be an array", param)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if (not isinstance(call, Mapping) or call.get("type", "function") != "function"
                or not isinstance(function, Mapping)):
            raise UncountableContentError(
                f"messages[{i}].tool_calls[{j}] must be an object of type `function` with a"
                " `function` object", f"{param}.{j}")
        out.append({**call, "function": {**function,
                                         "arguments": _arguments(function.get("arguments"))}})
    return out


def _arguments(arguments: Any) -> Any:
    """vLLM's rule: a JSON object string -> the object; empty, invalid or not an object -> {}."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)  # the standard library, as vLLM
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
