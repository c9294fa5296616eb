"""The same OpenAI-client checks against ``kvgate demo`` (simulated workers) and against the
gateway in front of real vLLM: what a client sees must not depend on which is behind the gateway.

Every test runs once per backend (the ``backend`` fixture): status codes, error codes, the
structure of answers (choices, logprobs, tool calls, usage), finish reasons. The demo runs as
the README starts it (``kvgate demo``, one worker per pool, ``--time-scale 0.01``); the real
backend is the session's two vLLM servers (``vllm_servers``) behind one pool of 4096 tokens.
A real model's words differ from the simulator's, so answers are compared by what a client may
rely on, never by their words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.demo import MODEL_NAME as DEMO_MODEL
from gateway.procs.net import free_port, http_ok, wait_until
from gateway.procs.process import ManagedProcess, python_argv
from gateway.procs.vllm import VllmServer
from tests.harness import serve_app

DEMO_LONG_POOL_TOKENS = 131072
VLLM_POOL_TOKENS = 4096
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    model: str
    max_context_tokens: int

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=120)


@pytest.fixture(scope="module", params=["demo", "vllm"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "demo":
        yield from _demo()
    else:
        yield from _vllm(request.getfixturevalue("vllm_servers"))


def _demo() -> Iterator[Backend]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    demo = ManagedProcess(
        python_argv("gateway.cli", "demo", "--port", str(port), "--time-scale", "0.01",
                    "--short-workers", "1", "--long-workers", "1"),
        ready=lambda: http_ok(url + "/ready"))
    with demo:
        demo.start(timeout_s=60)
        yield Backend("demo", url, DEMO_MODEL, DEMO_LONG_POOL_TOKENS)


def _vllm(servers: list[VllmServer]) -> Iterator[Backend]:
    settings = build_settings({
        "models": [{"name": servers[0].model_name, "tokenizer": str(servers[0].model_dir)}],
        "pools": [{"name": "all", "max_context_tokens": VLLM_POOL_TOKENS,
                   "workers": [s.url for s in servers]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "scrape_interval_s": 0.5},
    })
    with serve_app(create_app(settings)) as url:
        wait_until(lambda: httpx.get(url + "/v1/models").json()["data"] or None, 30,
                   "the gateway to see its workers")
        yield Backend("vllm", url, servers[0].model_name, VLLM_POOL_TOKENS)


def chat(b: Backend, **kwargs: Any) -> Any:
    return b.client().chat.completions.create(model=b.model, **{"messages": MESSAGES, **kwargs})


def error_of(exc: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = exc.value.response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return dict(body["error"])


# -- chat and completions, streaming and not ---------------------------------------------------------


def test_chat_answers_one_assistant_message_with_usage(backend: Backend) -> None:
    r = chat(backend, max_tokens=4, extra_body={"ignore_eos": True})

    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_chat_stream_with_include_usage_ends_with_a_usage_chunk(backend: Backend) -> None:
    chunks = list(chat(backend, max_tokens=4, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))

    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.usage is None for c in content)


def test_completions_streaming_and_not_agree_on_usage(backend: Backend) -> None:
    client = backend.client()
    done = client.completions.create(model=backend.model, prompt="Once upon a time",
                                     max_tokens=3, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=backend.model, prompt="Once upon a time", max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))

    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 3
    # vLLM writes the non-streamed usage whole and a stream's chunks without unset fields (its
    # prompt details' ``created_cache_tokens`` and ``multimodal_tokens``, null): compared unset
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.model_dump(exclude_none=True)
            == done.usage.model_dump(exclude_none=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)


# -- n > 1 ------------------------------------------------------------------------------------------


def test_n_2_gives_two_choices_in_chat_and_completions(backend: Backend) -> None:
    r = chat(backend, max_tokens=3, n=2, extra_body={"ignore_eos": True})
    c = backend.client().completions.create(model=backend.model, prompt="Hello", max_tokens=3, n=2,
                                            extra_body={"ignore_eos": True})

    assert [ch.index for ch in r.choices] == [0, 1] and [ch.index for ch in c.choices] == [0, 1]
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert c.usage is not None and c.usage.completion_tokens == 6


def test_n_2_stream_gives_each_choice_its_role_and_one_finish(backend: Backend) -> None:
    chunks = list(chat(backend, max_tokens=3, n=2, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))

    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert roles == [0, 1]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


# -- logprobs ---------------------------------------------------------------------------------------


def test_chat_logprobs_give_one_entry_per_token_with_the_top_alternatives(backend: Backend) -> None:
    r = chat(backend, max_tokens=3, logprobs=True, top_logprobs=2,
             extra_body={"ignore_eos": True})

    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 3
    for entry in logprobs.content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


def test_completions_logprobs_give_tokens_offsets_and_top_alternatives(backend: Backend) -> None:
    r = backend.client().completions.create(model=backend.model, prompt="Once upon", max_tokens=3,
                                            logprobs=2, extra_body={"ignore_eos": True})

    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.top_logprobs is not None and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


# -- tools and JSON ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", [
    "auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choices_are_refused_without_a_tool_parser(backend: Backend, tool_choice: Any) -> None:
    """Both run as vLLM does by default, without ``--tool-call-parser``: vLLM refuses every
    tool choice but ``none`` (``kvgate sim --tool-call-parser`` answers them)."""
    with pytest.raises(openai.BadRequestError) as exc:
        chat(backend, max_tokens=8, tools=[WEATHER], tool_choice=tool_choice)
    assert "--tool-call-parser" in error_of(exc)["message"]
    none = chat(backend, max_tokens=2, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls in (None, [])


def test_json_schema_response_format_answers_valid_json(backend: Backend) -> None:
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    r = chat(backend, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})

    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content or "")["city"] in ("Paris", "Rome")


# -- stop and seed ----------------------------------------------------------------------------------


def test_a_stop_string_cuts_the_answer_before_it(backend: Backend) -> None:
    client = backend.client()

    def complete(**kwargs: Any) -> Any:
        return client.completions.create(model=backend.model, prompt="Once upon a time",
                                         max_tokens=8, temperature=0, seed=3,
                                         extra_body={"ignore_eos": True}, **kwargs).choices[0]

    free = complete()
    stop = free.text[len(free.text) // 2:][:3]
    cut = complete(stop=[stop])

    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == free.text[: free.text.index(stop)]


def test_the_same_seed_gives_the_same_answer(backend: Backend) -> None:
    first = chat(backend, max_tokens=6, seed=11, temperature=1.0)
    again = chat(backend, max_tokens=6, seed=11, temperature=1.0)

    assert first.choices[0].message.content == again.choices[0].message.content


# -- errors -----------------------------------------------------------------------------------------


def test_an_unknown_model_is_404(backend: Backend) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        backend.client().chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert error_of(exc)["code"] == "model_not_found"


def test_a_prompt_too_long_for_every_pool_is_400_context_length_exceeded(backend: Backend) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        backend.client().completions.create(
            model=backend.model, prompt="hello " * backend.max_context_tokens, max_tokens=2)
    assert error_of(exc)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("bad", [
    {"stream_options": {"include_usage": True}},
    {"top_logprobs": 2},
    {"logprobs": True, "top_logprobs": 21},
    {"tools": []},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},
], ids=["stream-options-without-stream", "top-logprobs-without-logprobs",
        "too-many-top-logprobs", "empty-tools", "unknown-named-tool", "tool-choice-without-tools"])
def test_parameters_vllm_refuses_are_400(backend: Backend, bad: dict[str, Any]) -> None:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as exc:
        chat(backend, max_tokens=2, extra_body=bad)
    error = error_of(exc)
    assert error["message"] and time.monotonic() - started < 30
