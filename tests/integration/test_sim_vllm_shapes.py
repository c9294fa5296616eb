"""The simulator answers in real vLLM's shapes: the same request sent to a real vLLM 0.32 server
(the session's ``vllm_servers``) and to a simulated worker serving the same model name, compared
by structure: status codes, keys, value types, list lengths the request fixes (choices, tokens,
alternatives), finish reasons, error types. Words differ (a real model against the simulator's
tokens) and are never compared; a stream is compared by its first chunk, its last chunks and the
set of chunk shapes in between (how many tokens share a chunk depends on timing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.procs.kvgate import SimProcess
from gateway.procs.vllm import VllmServer

MESSAGES = [{"role": "user", "content": "hello there"}]
WEATHER: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string",
                                                                     "enum": ["Paris"]}},
                           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ANSWER: dict[str, Any] = {"input": "hello there", "max_output_tokens": 3, "ignore_eos": True}
# A completions ``top_logprobs`` entry has one key per token: k + 1 (the sampled token and the
# k likeliest) or k where the sampled token is the likeliest, which only greedy sampling
# (``temperature: 0``) makes certain. Cases that show it sample greedily so that the real
# server's count is not chance.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}),
    "chat-n2-stream-usage": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "n": 2,
                                    "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}}),
    "chat-logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True,
                             "logprobs": True, "top_logprobs": 2, "temperature": 0}),
    "chat-logprobs-stream": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True,
                                    "logprobs": True, "top_logprobs": 2, "temperature": 0,
                                    "stream": True}),
    "completions-n2": (COMPLETIONS, {"prompt": "once upon", "max_tokens": 3, "n": 2,
                                     "ignore_eos": True}),
    "completions-n2-stream": (COMPLETIONS, {"prompt": "once upon", "max_tokens": 3, "n": 2,
                                            "ignore_eos": True, "stream": True}),
    "completions-logprobs": (COMPLETIONS, {"prompt": "once upon", "max_tokens": 2,
                                           "ignore_eos": True, "logprobs": 2,
                                           "temperature": 0}),
    "completions-logprobs-stream": (COMPLETIONS, {"prompt": "once upon", "max_tokens": 2,
                                                  "ignore_eos": True, "logprobs": 1,
                                                  "temperature": 0, "stream": True}),
    "completions-echo": (COMPLETIONS, {"prompt": "once upon", "max_tokens": 2,
                                       "ignore_eos": True, "echo": True}),
    "completions-continuous-usage": (COMPLETIONS, {
        "prompt": "once", "max_tokens": 2, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "tool-named": (CHAT, {"messages": MESSAGES, "max_tokens": 60, "tools": TOOLS,
                          "tool_choice": NAMED}),
    "tool-required": (CHAT, {"messages": MESSAGES, "max_tokens": 60, "tools": TOOLS,
                             "tool_choice": "required"}),
    "tool-auto": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
                         "tools": TOOLS}),
    "json-schema": (CHAT, {"messages": MESSAGES, "max_tokens": 60, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}),
    "refused-stream-options": (CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                      "stream_options": {"include_usage": True}}),
    "refused-top-logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "top_logprobs": 2}),
    "refused-too-many-logprobs": (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "logprobs": 21}),
    "refused-unknown-tool": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS,
                                    "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}}),
    "refused-unknown-model": (CHAT, {"model": "nope", "messages": MESSAGES}),
    "refused-too-long": (COMPLETIONS, {"prompt": list(range(100, 5100)), "max_tokens": 2}),
    "refused-cut-to-nothing": (COMPLETIONS, {"prompt": [100, 101, 102], "max_tokens": 2,
                                             "truncate_prompt_tokens": 0}),
    "refused-chat-cut-to-nothing": (CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                           "truncate_prompt_tokens": 0}),
    "responses": (RESPONSES, ANSWER),
    "responses-stream": (RESPONSES, {**ANSWER, "stream": True}),
    # the immediate answer (queued, no output) and a background stream's events
    "responses-background": (RESPONSES, {**ANSWER, "background": True}),
    "responses-background-stream": (RESPONSES, {**ANSWER, "background": True, "stream": True}),
    "refused-background-unstored": (RESPONSES, {**ANSWER, "background": True, "store": False}),
}
PROMPT = "once upon a time"
PROMPT_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions-prompt-logprobs": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2,
                                                  "ignore_eos": True, "prompt_logprobs": 2}),
    "completions-echo-logprobs": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2,
                                                "ignore_eos": True, "echo": True,
                                                "logprobs": 1, "temperature": 0}),
    "completions-echo-only-logprobs": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 0,
                                                     "echo": True, "logprobs": 0}),
    # a stream's first chunk of a choice: the prompt (its logprobs first) and its first tokens
    "completions-echo-logprobs-stream": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2,
                                                       "ignore_eos": True, "echo": True,
                                                       "logprobs": 1, "temperature": 0,
                                                       "stream": True}),
    "completions-echo-only-stream": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 0,
                                                   "echo": True, "logprobs": 0,
                                                   "stream": True}),
    "completions-echo-logprobs-n2": (COMPLETIONS, {"prompt": [PROMPT, "the end"],
                                                   "max_tokens": 1, "ignore_eos": True,
                                                   "echo": True, "logprobs": 0}),
    "chat-prompt-logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True,
                                    "prompt_logprobs": 1}),
    "chat-echo": (CHAT, {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True,
                         "echo": True}),
    "refused-prompt-logprobs-stream": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2,
                                                     "stream": True, "prompt_logprobs": 1}),
    "refused-prompt-logprobs-negative": (CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                                "prompt_logprobs": -2}),
    "refused-prompt-logprobs-all": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2,
                                                  "prompt_logprobs": -1}),
}
"""Cases whose answers list every prompt token: the simulator runs the server's tokenizer."""
KEPT = frozenset({"finish_reason", "object", "role", "type", "code", "index"})
"""Keys whose values are compared, not only their types."""
UNCOMPARED = frozenset({"stop_reason", "prompt_tokens_details"})
"""Keys compared by presence only: ``stop_reason`` is the EOS id where a model's generation
config lists it as a stop token; ``prompt_tokens_details`` holds what each has cached."""
DETAILS = ["--enable-prompt-tokens-details"]
"""The simulators are started as the session's servers are (``vllm_servers``)."""


@pytest.fixture(scope="module")
def sim(vllm_servers: list[VllmServer]) -> Iterator[str]:
    server = vllm_servers[0]
    proc = SimProcess(time_scale=0.01, extra_args=[
        "--model-name", server.model_name, "--max-model-len", "4096", *DETAILS])
    with proc:
        proc.start(timeout_s=60)
        yield proc.url


@pytest.fixture(scope="module")
def sim_with_tokenizer(vllm_servers: list[VllmServer]) -> Iterator[str]:
    server = vllm_servers[0]
    proc = SimProcess(time_scale=0.01, extra_args=[
        "--model-name", server.model_name, "--max-model-len", "4096", *DETAILS,
        "--tokenizer", str(server.model_dir)])
    with proc:
        proc.start(timeout_s=60)
        yield proc.url


def answer(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = httpx.post(url + path, json={"model": "tiny", **body}, timeout=300)
    if body.get("stream") and resp.status_code == 200:
        return 200, [json.loads(line[6:]) for line in resp.text.splitlines()
                     if line.startswith("data: {")]
    return resp.status_code, resp.json()


MODEL_DECIDES_THE_END = frozenset({"json-schema"})
"""Cases whose finish reason is the real model's doing: under a JSON schema the random-weight tiny
model may still be inside the object (whitespace, long strings) at ``max_tokens`` (``length``)
where the simulator closes it at once (``stop``); both are vLLM's reasons for that request."""


def shape(value: Any, key: str = "", *, streamed: bool = False) -> Any:
    """``value`` with every scalar replaced by its type name, except under ``KEPT`` keys; a list
    of scalars (token ids, bytes, offsets) by its item type; a completions ``top_logprobs``
    entry (token -> logprob) by its size. In a stream, which choice comes last is timing."""
    if key in UNCOMPARED:
        return "present"
    if key == "prompt_logprobs" and isinstance(value, list):  # per token: id -> its logprob
        return [None if v is None else
                {"entries": len(v), "shapes": sorted({json.dumps(shape(e), sort_keys=True)
                                                      for e in v.values()})} for v in value]
    if key == "top_logprobs" and isinstance(value, dict):
        return f"dict[str, float] of {len(value)}"
    if key == "bytes" and isinstance(value, list):
        return "list[int]"  # a token's UTF-8 bytes: empty for a token that decodes to nothing
    if isinstance(value, dict):
        return {k: shape(v, k, streamed=streamed) for k, v in value.items()
                if not (streamed and k == "index")}
    if isinstance(value, list):
        if value and not any(isinstance(v, dict | list) for v in value):
            return f"list[{'|'.join(sorted({type(v).__name__ for v in value}))}]"
        return [shape(v, key, streamed=streamed) for v in value]
    if key in KEPT:
        return value
    return type(value).__name__


def stream_shape(chunks: list[Any]) -> Any:
    shapes = [json.dumps(shape(c, streamed=True), sort_keys=True) for c in chunks]
    return {"first": shapes[0], "last": shapes[-1], "all": sorted(set(shapes))}


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_answers_in_vllms_shape(
    case: str, sim: str, vllm_servers: list[VllmServer]
) -> None:
    path, body = CASES[case]

    real_status, real = answer(vllm_servers[0].url, path, body)
    sim_status, simulated = answer(sim, path, body)

    assert sim_status == real_status, (real, simulated)
    if case in MODEL_DECIDES_THE_END:
        ends = {c["finish_reason"] for c in real["choices"] + simulated["choices"]}
        assert ends <= {"stop", "length"}, ends
        for choice in real["choices"] + simulated["choices"]:
            choice["finish_reason"] = "stop"
    if isinstance(real, list):
        assert stream_shape(simulated) == stream_shape(real)
    else:
        assert shape(simulated) == shape(real)


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_the_simulator_answers_prompt_logprobs_in_vllms_shape(
    case: str, sim_with_tokenizer: str, vllm_servers: list[VllmServer]
) -> None:
    """Every prompt token listed (the simulator tokenizes as the server does), each with as
    many alternatives as vLLM gives."""
    path, body = PROMPT_CASES[case]
    real_status, real = answer(vllm_servers[0].url, path, body)
    sim_status, simulated = answer(sim_with_tokenizer, path, body)
    assert sim_status == real_status, (real, simulated)
    if isinstance(real, list):
        assert stream_shape(simulated) == stream_shape(real)
    else:
        assert shape(simulated) == shape(real)
