"""The simulated worker's HTTP API, against a started SimFleet, with httpx and the openai client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionUserMessageParam

from gateway import promtext
from gateway.prompt.tokenizer import load_tokenizer
from gateway.sim import SimFleet, SimWorkerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

MESSAGES = [{"role": "user", "content": "Tell me about paged attention and prefix caching. " * 8}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    fleet = SimFleet(
        [
            SimWorkerConfig(model_name="sim-a", time_scale=0.02, tool_call_parser="pythonic"),
            SimWorkerConfig(
                model_name="sim-b",
                num_gpu_blocks=64,
                max_model_len=512,
                time_scale=0.02,
                enable_prompt_tokens_details=True,
            ),
        ]
    )
    await fleet.start()
    yield fleet
    await fleet.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def sse(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request; the decoded ``data:`` payloads, ``[DONE]`` as a string."""
    out: list[Any] = []
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def test_health_and_models_list_the_served_model(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[1]
    assert (await client.get(f"{url}/health")).status_code == 200
    models = (await client.get(f"{url}/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        "sim-b",
        "model",
        "vllm",
        512,
    )


async def test_chat_completion_returns_vllm_body_with_usage(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = {"model": "sim-a", "messages": MESSAGES, "max_tokens": 5}
    resp = await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)
    assert resp.status_code == 200
    out = resp.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    prompt_len = len(load_tokenizer("simple").encode_chat(MESSAGES, body))
    assert out["usage"] == {
        "prompt_tokens": prompt_len,
        "total_tokens": prompt_len + 5,
        "completion_tokens": 5,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def test_chat_stream_sends_role_then_content_then_finish_then_done(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    events = await sse(
        client,
        f"{fleet.urls[0]}/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "stream": True},
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text.split()) == 4


async def test_include_usage_adds_a_final_chunk_with_empty_choices(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = {
        "messages": MESSAGES,
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await sse(client, f"{fleet.urls[0]}/v1/chat/completions", body)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3
    assert all("usage" not in c for c in events[:-2])


async def test_max_completion_tokens_wins_over_max_tokens(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 2}
    out = (await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)).json()
    assert out["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("fields", "generated"),
    [
        pytest.param({}, 16, id="default-16"),
        pytest.param({"max_completion_tokens": 1}, 16, id="max_completion_tokens-ignored"),
        pytest.param({"max_completion_tokens": 1, "max_tokens": 20}, 20, id="max_tokens"),
        pytest.param({"max_tokens": 0, "echo": True}, 1, id="echo-without-generation"),
    ],
)
async def test_completions_output_limit_follows_vllm(
    fleet: SimFleet, client: httpx.AsyncClient, fields: dict[str, Any], generated: int
) -> None:
    body = {"prompt": [5, 6, 7], "ignore_eos": True, **fields}
    out = (await client.post(f"{fleet.urls[0]}/v1/completions", json=body)).json()
    assert out["usage"]["completion_tokens"] == generated


async def test_n_choices_and_prompt_batches_generate_every_sequence(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[0]}/v1/completions"
    body = {"prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 4, "ignore_eos": True}
    out = (await client.post(url, json=body)).json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert len({c["text"] for c in out["choices"][:3]}) == 3  # each choice its own tokens
    assert out["usage"] == {"prompt_tokens": 5, "total_tokens": 5 + 24, "completion_tokens": 24,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    events = await sse(client, f"{fleet.urls[0]}/v1/chat/completions",
                       {"messages": MESSAGES, "n": 2, "max_tokens": 3, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}})
    assert events[-2]["usage"]["completion_tokens"] == 6
    indices = {c["choices"][0]["index"] for c in events[:-2]}
    assert indices == {0, 1}


async def test_media_content_part_is_refused_as_vllm_refuses_it_for_a_text_only_model(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    resp = await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages.0.content.1"


async def test_unknown_fields_and_ignore_eos_are_accepted(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0.3,
        "top_k": 5,
        "whatever": {"x": 1},
    }
    resp = await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)
    assert resp.status_code == 200


async def test_completions_stream_and_non_stream(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[0]}/v1/completions"
    out = (await client.post(url, json={"prompt": "Once upon a time", "max_tokens": 3})).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(
        load_tokenizer("simple").encode_text("Once upon a time")
    )
    body = {
        "prompt": [1, 2, 3, 4, 5],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await sse(client, url, body)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}
    texts = [c["choices"][0]["text"] for c in events[:-2]]
    assert len("".join(texts).split()) == 3
    assert events[0]["choices"][0].keys() >= {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
    }


async def test_same_request_generates_the_same_text(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[0]}/v1/completions"
    a = (await client.post(url, json={"prompt": "same seed", "max_tokens": 6, "seed": 7})).json()
    b = (await client.post(url, json={"prompt": "same seed", "max_tokens": 6, "seed": 7})).json()
    c = (await client.post(url, json={"prompt": "same seed", "max_tokens": 6, "seed": 8})).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] != c["choices"][0]["text"]


async def test_tokenize_uses_the_gateway_tokenizer(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    tok = load_tokenizer("simple")
    url = f"{fleet.urls[1]}/tokenize"
    chat = (await client.post(url, json={"model": "sim-b", "messages": MESSAGES})).json()
    assert chat == {
        "count": len(chat["tokens"]),
        "max_model_len": 512,
        "tokens": tok.encode_chat(MESSAGES, {}),
        "token_strs": None,
    }
    text = (
        await client.post(url, json={"prompt": "hello world", "return_token_strs": True})
    ).json()
    assert text["tokens"] == tok.encode_text("hello world")
    assert len(text["token_strs"]) == text["count"]


async def test_metrics_carry_vllm_names_and_count_prefix_hits_in_tokens(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[1]
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    for _ in range(2):
        resp = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200
    text = (await client.get(f"{url}/metrics")).text
    samples = promtext.samples(text)
    labels = (("engine", "0"), ("model_name", "sim-b"))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert labels in samples.get(name, {}), name
    info = [dict(ls) for ls in samples["vllm:cache_config_info"]]
    assert len(info) == 1 and info[0]["block_size"] == "16" and info[0]["num_gpu_blocks"] == "64"
    assert samples["vllm:kv_cache_usage_perc"][labels] == 0.0
    # Two identical 50-token prompts: the second hits 3 blocks = 48 tokens.
    assert samples["vllm:prefix_cache_hits_total"][labels] >= 48
    assert samples["vllm:prefix_cache_queries_total"][labels] >= 100
    assert samples["vllm:generation_tokens_total"][labels] >= 4


async def test_prompt_tokens_details_report_cached_tokens_when_enabled(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[1]}/v1/completions"
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks
    await client.post(url, json={"prompt": prompt, "max_tokens": 1})
    out = (await client.post(url, json={"prompt": prompt, "max_tokens": 1})).json()
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_chunks_carry_no_prompt_details_the_final_usage_does(
    fleet: SimFleet, client: httpx.AsyncClient, path: str
) -> None:
    """vLLM 0.32 builds each continuous usage chunk's usage from the three counts alone."""
    body: dict[str, Any] = {"model": "sim-b", "max_tokens": 3, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}}
    body |= ({"prompt": "once"} if path == "/v1/completions" else {"messages": MESSAGES})
    chunks = [c for c in await sse(client, fleet.urls[1] + path, body) if c != "[DONE]"]
    *running, final = chunks
    assert running and all(set(c["usage"]) == {"prompt_tokens", "completion_tokens",
                                               "total_tokens"} for c in running)
    assert final["choices"] == [] and "cached_tokens" in final["usage"]["prompt_tokens_details"]


async def test_a_cache_salt_caches_the_prompt_for_that_salt_only_as_vllm(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[1]}/v1/completions"
    prompt = list(range(400, 440))  # 40 tokens: 2 full blocks

    async def cached(**salt: str) -> int:
        out = (await client.post(url, json={"prompt": prompt, "max_tokens": 1, **salt})).json()
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert await cached(cache_salt="s1") == 0
    assert await cached(cache_salt="s1") == 32
    assert await cached(cache_salt="s2") == 0
    assert await cached() == 0
    assert await cached() == 32
    for bad in ("", 3, "a/b"):
        resp = await client.post(url, json={"prompt": prompt, "max_tokens": 1, "cache_salt": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
        assert "Parameter 'cache_salt' must be" in resp.json()["error"]["message"]


async def test_a_request_for_its_prompts_logprobs_reads_no_cache_as_vllm(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    """vLLM computes the whole prompt of a request that asks for its logprobs (its
    ``skip_reading_prefix_cache``), and caches its blocks all the same."""
    url = f"{fleet.urls[1]}/v1/completions"
    prompt = list(range(500, 540))  # 40 tokens: 2 full blocks

    async def cached(**fields: Any) -> int:
        out = (await client.post(url, json={"prompt": prompt, "max_tokens": 1, **fields})).json()
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert await cached() == 0
    assert await cached(echo=True, logprobs=0) == 0
    assert await cached(prompt_logprobs=1) == 0
    assert await cached(echo=True) == 32
    chat = f"{fleet.urls[1]}/v1/chat/completions"
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
    for echo, hit in ((False, False), (True, False), (False, True)):
        out = (await client.post(chat, json={"messages": messages, "max_tokens": 1,
                                             "echo": echo})).json()
        assert (out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is hit, echo


async def test_unknown_model_is_404_and_too_long_prompt_is_400(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[1]}/v1/completions"
    resp = await client.post(url, json={"model": "nope", "prompt": "x"})
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "NotFoundError"
    resp = await client.post(url, json={"prompt": list(range(600))})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == 400 and "maximum context length is 512" in err["message"]
    resp = await client.post(url, json={"prompt": "x", "n": 0})
    assert resp.status_code == 400
    resp = await client.post(url, content=b"{not json")
    assert resp.status_code == 400


async def test_client_disconnect_aborts_the_request_and_frees_its_blocks(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[1]
    worker = fleet.workers[1]
    body = {"prompt": list(range(1000, 1100)), "max_tokens": 400, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            break
        assert worker.scheduler.num_running == 1
    for _ in range(100):
        if not worker.scheduler.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert not worker.scheduler.has_unfinished()
    assert worker.scheduler.kv.pool.usage == 0.0


async def test_openai_client_streams_chat_from_the_sim(fleet: SimFleet) -> None:
    client = openai.AsyncOpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused")
    try:
        messages: list[ChatCompletionUserMessageParam] = [
            {"role": "user", "content": MESSAGES[0]["content"]}
        ]
        stream = await client.chat.completions.create(
            model="sim-a",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        text = ""
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
        assert usage is not None and usage.completion_tokens == 4
        assert len(text.split()) == 4
        resp = await client.completions.create(model="sim-a", prompt="hi", max_tokens=2)
        assert resp.usage is not None and resp.usage.completion_tokens == 2
    finally:
        await client.close()


async def test_the_choices_of_a_stream_are_interleaved_as_vllm_sends_them(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    """Regression: choice 1 was sent only once choice 0 had finished."""
    events = await sse(client, f"{fleet.urls[0]}/v1/chat/completions",
                       {"messages": MESSAGES, "n": 2, "max_tokens": 8, "ignore_eos": True,
                        "stream": True})
    chunks = [c["choices"][0] for c in events[:-1]]
    roles = [c["index"] for c in chunks if "role" in c["delta"]]
    first_finish = next(i for i, c in enumerate(chunks) if c["finish_reason"] is not None)

    assert roles == [0, 1] and chunks[:2] == [
        {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None} for k in (0, 1)]
    assert {c["index"] for c in chunks[2:first_finish]} == {0, 1}
    assert sorted(c["index"] for c in chunks if c["finish_reason"] == "length") == [0, 1]


async def test_a_stop_string_ends_the_choice_and_frees_its_engine_request(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[0]}/v1/completions"
    body = {"prompt": "stop here", "max_tokens": 50, "ignore_eos": True, "seed": 1}
    free = (await client.post(url, json=body)).json()["choices"][0]["text"]
    stop = free.split()[2]
    worker = fleet.workers[0]

    for stream in (False, True):
        resp = await client.post(url, json={**body, "stop": stop, "stream": stream})
        if stream:
            chunks = [orjson.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            last = chunks[-1]["choices"][0]
        else:
            last = resp.json()["choices"][0]
            text = last["text"]
        assert text == free[: free.index(stop)]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert not worker.scheduler.has_unfinished()


async def test_echo_puts_the_prompt_before_the_answer(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = f"{fleet.urls[0]}/v1/completions"
    out = (await client.post(url, json={"prompt": ["one", "two"], "max_tokens": 2,
                                         "echo": True})).json()
    events = await sse(client, url, {"prompt": "one", "max_tokens": 2, "echo": True,
                                     "stream": True})

    assert [c["text"].split()[0] for c in out["choices"]] == ["one", "two"]
    assert events[0]["choices"][0]["text"].startswith("one ")


async def test_an_echoed_stream_carries_what_the_whole_answer_does(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    """As vLLM streams ``echo``: a choice's first chunk holds the prompt, its logprobs first (the
    first token's None), and the first tokens; ``max_tokens: 0`` shows the prompt alone. The
    chunks joined equal the answer without streaming (greedy: the same tokens)."""
    url = f"{fleet.urls[0]}/v1/completions"
    for extra in ({"max_tokens": 3, "ignore_eos": True}, {"max_tokens": 0}):
        body = {"prompt": "one two three", "echo": True, "logprobs": 1, "temperature": 0,
                **extra}
        whole = (await client.post(url, json=body)).json()["choices"][0]
        events = await sse(client, url, {**body, "stream": True})
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]  # [DONE] last

        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            joined = [x for c in chunks for x in c["logprobs"][field]]
            assert joined == whole["logprobs"][field], field
    assert whole["text"] == "one two three" and chunks[-1]["finish_reason"] == "length"


async def test_tools_and_json_formats_force_answers_valid_for_their_schema(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    url = f"{fleet.urls[0]}/v1/chat/completions"
    named = (await client.post(url, json={
        "messages": MESSAGES, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}}})).json()
    required = (await client.post(url, json={
        "messages": MESSAGES, "tools": [tool], "tool_choice": "required"})).json()
    formatted = (await client.post(url, json={
        "messages": MESSAGES, "response_format": {"type": "json_object"}})).json()

    (call,) = named["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and "q" in orjson.loads(call["function"]["arguments"])
    assert named["choices"][0]["finish_reason"] == "stop"
    assert required["choices"][0]["finish_reason"] == "tool_calls"
    assert required["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert orjson.loads(formatted["choices"][0]["message"]["content"]) == {}
    events = await sse(client, url, {"messages": MESSAGES, "tools": [tool], "stream": True,
                                     "tool_choice": {"type": "function",
                                                     "function": {"name": "lookup"}}})
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in events[1:-1]]
    first, *rest = [c[0] for c in calls if c]
    assert (first["type"], first["function"]["name"]) == ("function", "lookup")
    arguments = first["function"]["arguments"] + "".join(c["function"]["arguments"] for c in rest)
    assert "q" in orjson.loads(arguments)


async def test_without_a_tool_parser_tool_choices_are_refused_as_vllm_refuses_them(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    url = f"{fleet.urls[1]}/v1/chat/completions"
    refused = await client.post(url, json={"messages": MESSAGES, "tools": [tool]})
    served = await client.post(url, json={"messages": MESSAGES, "tools": [tool], "max_tokens": 2,
                                           "tool_choice": "none"})

    assert refused.status_code == 400 and "--tool-call-parser" in refused.text
    assert served.status_code == 200
