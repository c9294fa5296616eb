"""Step 2's token ids: the prompt of a parsed request, tokenized as vLLM will tokenize it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.prompt.limits import Deadline, Truncation, check_room
from gateway.prompt.tokenizer import PromptTokenizer


class PromptRequest(Protocol):
    """What rendering reads of a request (``gateway.request.ParsedRequest``, a layer above)."""

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def is_chat(self) -> bool: ...

    @property
    def is_responses(self) -> bool: ...

    @property
    def truncation(self) -> Truncation | None: ...


def prompt_token_ids(tokenizer: PromptTokenizer, parsed: PromptRequest, *,
                     max_tokens: int | None = None,
                     timeout_s: float | None = None) -> list[list[int]]:
    """One list of token ids per prompt (chat: always one; completions: one per batch entry),
    cut as the request's ``truncation`` asks (-1: to ``max_tokens``).

    ``max_tokens``: a prompt certainly longer is refused before it is encoded
    (``PromptTooLongError``), unless it is truncated; ``timeout_s``: rendering and encoding
    stop that long after this call began (``PromptTimeoutError``). See
    ``gateway.prompt.limits``."""
    check_room(max_tokens)
    cut = parsed.truncation
    if cut is None:
        return _prompt_token_ids(tokenizer, parsed, max_tokens, timeout_s)
    ids = _prompt_token_ids(tokenizer, parsed, None, timeout_s)
    return [cut.apply(p, max_tokens if max_tokens is not None else len(p)) for p in ids]


def _prompt_token_ids(tokenizer: PromptTokenizer, parsed: PromptRequest, max_tokens: int | None,
                      timeout_s: float | None) -> list[list[int]]:
    body = parsed.body
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    if parsed.is_chat:
        return [tokenizer.encode_chat(vllm_conversation(body["messages"]), body,
                                      max_tokens=max_tokens, deadline=deadline)]
    if parsed.is_responses:
        messages, options = responses_conversation(body)
        return [tokenizer.encode_chat(vllm_conversation(messages), options,
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


# -- Responses: ``instructions`` + ``input`` as the chat template sees them ---------------------
#
# vLLM 0.32 builds a Responses request's conversation (non-harmony models) in
# ``construct_input_messages`` (``entrypoints/openai/responses/utils.py``) and renders it as a
# chat request (``preprocess_chat``), so its messages then pass ``vllm_conversation`` as chat's:
#
# * ``instructions``, when not empty: a system message first;
# * with ``previous_response_id``: the stored conversation's messages (its system ones dropped)
#   and the previous output's texts as assistant messages come next. The gateway does not hold
#   them: it counts them from the response-owner map (``gateway.budgets.owners``);
# * ``input``: a string is one user message; items, in order:
#   - a message with a role: as sent (its content parts read as in chat), except an assistant
#     one, whose text (a string, or its first part's ``text``) fills the previous assistant
#     message when that has no content yet;
#   - ``function_call`` / ``custom_tool_call``: a tool call of the previous assistant message
#     (a new one when there is none); a namespaced name as ``<namespace>__<name>``, a custom
#     call's input as ``{"input": ...}``;
#   - ``reasoning``: ``reasoning`` of the previous assistant message when it has none (its first
#     content text, else its first summary text); ``encrypted_content`` is refused, as by vLLM;
#   - ``function_call_output`` / ``custom_tool_call_output``: a tool message;
#   - any other item is refused (vLLM: "Unsupported input item type").
# * template options: ``add_generation_prompt``, unless the last input item is an unfinished
#   message or reasoning item (status ``in_progress`` / ``incomplete``), which is continued
#   (``continue_final_message``); ``reasoning.effort`` as ``reasoning_effort``;
#   ``chat_template_kwargs``; the ``function`` tools in chat form. Built-in tools (web search,
#   MCP ...) are never shown to the model and are dropped, as by vLLM; namespace and custom
#   tools (which vLLM rewrites into function shims) are refused as not counted.
# * the rendered text is encoded with the tokenizer's special tokens: a Responses request's
#   ``build_tok_params`` leaves ``add_special_tokens`` at ``TokenizeParams``' default (true),
#   where chat's sets it false, so a template that writes the BOS itself gets a second one.

_UNFINISHED = ("in_progress", "incomplete")


def responses_conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages vLLM renders for a Responses request (without a previous response's turns),
    and the template options, in the shape of a chat body (``encode_chat``'s ``options``)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        continue_final = False
    else:
        for i, item in enumerate(items):
            _add_item(messages, i, item)
        last = items[-1] if items else None
        continue_final = (isinstance(last, Mapping)
                          and last.get("type", "message") in ("message", "reasoning")
                          and last.get("status") in _UNFINISHED)
    reasoning = body.get("reasoning")
    return messages, {
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "reasoning_effort": reasoning.get("effort") if isinstance(reasoning, Mapping) else None,
        "tools": _function_tools(body.get("tools")),
        "add_special_tokens": True,
    }


def _add_item(messages: list[dict[str, Any]], i: int, item: Any) -> None:
    """Append input item ``i`` to ``messages`` (or fold it into the last assistant message)."""
    param = f"input.{i}"
    if not isinstance(item, Mapping):
        raise UncountableContentError(f"input[{i}] must be an object", param)
    kind = item.get("type")
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _item_tool_call(i, item)
        if prev is None:
            messages.append({"role": "assistant", "tool_calls": [call]})
        elif prev.get("tool_calls") is None:
            prev["tool_calls"] = [call]
        else:
            prev["tool_calls"].append(call)
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise UncountableContentError("Encrypted content is not supported.", param)
        reasoning = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "reasoning": reasoning})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"),
                         "tool_call_id": item.get("call_id")})
    elif item.get("role") == "assistant" and (text := _assistant_text(item)) is not None:
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif isinstance(item.get("role"), str):
        messages.append(dict(item))
    else:
        raise UncountableContentError(f"Unsupported input item type: {kind}", param)


def _item_tool_call(i: int, item: Mapping[str, Any]) -> dict[str, Any]:
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise UncountableContentError(
            f"input[{i}] must have a string `name` and `call_id`", f"input.{i}")
    arguments: Any
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    else:
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise UncountableContentError(f"input[{i}].arguments must be a string",
                                          f"input.{i}.arguments")
        if isinstance(namespace := item.get("namespace"), str) and namespace:
            name = f"{namespace}__{name}"
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], Mapping):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _assistant_text(item: Mapping[str, Any]) -> str | None:
    content = item.get("content")
    return content if isinstance(content, str) else _first_text(content)


def _function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools the template is shown, in chat form (vLLM: ``construct_tool_dicts``)."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for j, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            out.append({"type": "function",
                        "function": {k: v for k, v in tool.items() if k != "type"}})
        elif kind in ("namespace", "custom") or not isinstance(kind, str):
            raise UncountableContentError(
                f"tools[{j}] of type `{kind}` cannot be counted by the gateway (vLLM rewrites"
                " it into a function shim the gateway does not reproduce): declare it as a"
                " `function` tool", f"tools.{j}")
    return out or None
