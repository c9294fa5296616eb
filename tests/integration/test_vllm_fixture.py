"""The real-vLLM fixture works, and the facts about vLLM 0.32 that the gateway relies on hold.

Facts recorded here (each asserted below):
- chat prompt ids = the tokenizer's chat template rendered to text (the template writes BOS itself),
  then encoded WITHOUT special tokens: exactly HF ``apply_chat_template(messages,
  add_generation_prompt=True, tokenize=True, return_dict=False)``;
- a message whose content is a list of text parts is templated as the parts joined with "\\n";
- completion prompt ids = ``tokenizer.encode(prompt)``, i.e. WITH special tokens (BOS prepended);
- ``/tokenize`` returns the same ids the engine uses, for ``messages`` and for ``prompt``;
- ``vllm:cache_config_info`` carries the real block size (32 here) and ``num_gpu_blocks``;
- a repeated prompt hits the prefix cache for its full blocks, never its last token:
  hits = floor((prompt_tokens - 1) / block_size) x block_size;
- KV events: a ``BlockStored`` map per new prompt with the prompt's full blocks and token ids, and the
  replay socket answers with buffered batches then seq -1.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
import zmq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway import promtext
from gateway.procs.vllm import VllmServer
from tests.harness import replayed_batches, zmq_handshakes
from tests.integration.conftest import BLOCK_SIZE_TOKENS, SERVED_MODEL_NAME

pytestmark = pytest.mark.vllm

HTTP_TIMEOUT_S = 120.0
EVENT_WAIT_S = 60.0

MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "You are a careful assistant who answers in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "How many tokens fit in one block of the prefix cache?"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    """The tiny model's tokenizer, loaded the way the gateway loads it (its own venv)."""
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return loaded


def _client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S)


def _chat_template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> list[int]:
    # transformers 5 returns a BatchEncoding unless return_dict=False (len() of that is 2).
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert isinstance(ids, list)
    token_ids = [token_id for token_id in ids if isinstance(token_id, int)]
    assert len(token_ids) == len(ids), ids
    return token_ids


def _long_prompt(min_words: int = 60) -> str:
    """A prompt whose first block is unique to this call, so nothing is cached before it is sent."""
    sentence = "the scheduler routes every request to the worker that already holds its prefix"
    words = sentence.split()
    body = " ".join(words[i % len(words)] for i in range(min_words))
    return f"Request {uuid.uuid4().hex}: {body}."


def _counter_total(metrics_text: str, sample_name: str) -> float:
    """Sum of a counter's samples over all label sets."""
    return promtext.value(metrics_text, sample_name) or 0.0


def _sample_labels(metrics_text: str, sample_name: str) -> list[dict[str, str]]:
    return [dict(labels) for labels in promtext.samples(metrics_text).get(sample_name, {})]


def test_both_servers_serve_the_tiny_model(vllm_servers: list[VllmServer]) -> None:
    assert len(vllm_servers) == 2
    assert len({server.port for server in vllm_servers}) == 2
    for server in vllm_servers:
        response = httpx.get(f"{server.url}/v1/models", timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200
        assert [model["id"] for model in response.json()["data"]] == [SERVED_MODEL_NAME]
        assert [model.id for model in _client(server).models.list()] == [SERVED_MODEL_NAME]
        assert server.model_name == SERVED_MODEL_NAME
        assert server.block_size_tokens == BLOCK_SIZE_TOKENS
        assert server.log_path.exists()


def test_chat_prompt_tokens_equal_chat_template_encoded_without_special_tokens(
    vllm_servers: list[VllmServer], tokenizer: PreTrainedTokenizerBase
) -> None:
    server = vllm_servers[0]
    expected_ids = _chat_template_ids(tokenizer, MESSAGES)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert isinstance(rendered, str)
    # The template writes BOS itself; encoding adds nothing more, so there is exactly one BOS.
    assert rendered.startswith(str(tokenizer.bos_token))
    assert tokenizer.encode(rendered, add_special_tokens=False) == expected_ids
    assert expected_ids.count(tokenizer.bos_token_id) == 1

    completion = _client(server).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        temperature=0.0,
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(expected_ids)

    tokenized = httpx.post(
        f"{server.url}/tokenize",
        json={"model": SERVED_MODEL_NAME, "messages": MESSAGES, "add_generation_prompt": True},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    assert tokenized["tokens"] == expected_ids


def test_chat_content_parts_are_joined_with_newlines_before_templating(
    vllm_servers: list[VllmServer], tokenizer: PreTrainedTokenizerBase
) -> None:
    """For a template that takes string content, vLLM joins a message's text parts with "\\n"."""
    server = vllm_servers[0]
    parts = ["Summarize the error logs.", "Then list the busy workers."]
    expected_ids = _chat_template_ids(tokenizer, [{"role": "user", "content": "\n".join(parts)}])

    completion = _client(server).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": part} for part in parts]}],
        max_tokens=1,
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(expected_ids)


def test_completion_prompt_tokens_equal_encode_with_special_tokens(
    vllm_servers: list[VllmServer], tokenizer: PreTrainedTokenizerBase
) -> None:
    server = vllm_servers[1]
    prompt = "The operator measures the latency numbers carefully before lunch."
    expected_ids = tokenizer.encode(prompt)  # add_special_tokens=True: BOS first
    assert expected_ids[0] == tokenizer.bos_token_id
    assert expected_ids[1:] == tokenizer.encode(prompt, add_special_tokens=False)

    completion = _client(server).completions.create(
        model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0.0
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(expected_ids)

    tokenized = httpx.post(
        f"{server.url}/tokenize",
        json={"model": SERVED_MODEL_NAME, "prompt": prompt},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    assert tokenized["tokens"] == expected_ids


def test_metrics_report_the_configured_block_size(vllm_servers: list[VllmServer]) -> None:
    for server in vllm_servers:
        text = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        infos = _sample_labels(text, "vllm:cache_config_info")
        assert len(infos) == 1, infos
        assert infos[0]["block_size"] == str(BLOCK_SIZE_TOKENS)
        assert int(infos[0]["num_gpu_blocks"]) > 0
        assert infos[0]["enable_prefix_caching"] == "True"
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        ):
            assert _sample_labels(text, name), f"{name} missing from {server.url}/metrics"


def test_repeated_long_prompt_hits_prefix_cache_for_full_blocks_except_last_token(
    vllm_servers: list[VllmServer],
) -> None:
    server = vllm_servers[0]
    client = _client(server)
    prompt = _long_prompt()

    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        return _counter_total(text, "vllm:prefix_cache_hits_total")

    before = hits()
    first = client.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=1)
    after_first = hits()
    second = client.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=1)
    after_second = hits()

    assert first.usage is not None and second.usage is not None
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 2 * BLOCK_SIZE_TOKENS
    assert after_first == before  # a new, unique prompt hits nothing
    expected_hits = (prompt_tokens - 1) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert after_second - after_first == expected_hits


def _decode_events(payload: bytes) -> list[dict[str, Any]]:
    """A KVEventBatch is [ts, events, dp_rank]; each event a map with "type" (older vLLMs: tagged
    arrays, which this test would reject, on purpose: it records what 0.32 sends)."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) >= 2, batch
    events = batch[1]
    assert isinstance(events, list)
    for event in events:
        assert isinstance(event, dict), event
    return events


def test_kv_events_publish_block_stored_with_prompt_tokens_and_replay_them(
    vllm_servers: list[VllmServer], tokenizer: PreTrainedTokenizerBase
) -> None:
    server = vllm_servers[1]
    prompt = _long_prompt()
    prompt_ids = tokenizer.encode(prompt)
    full_blocks = len(prompt_ids) // BLOCK_SIZE_TOKENS
    assert full_blocks >= 2

    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, server.kv_events_topic.encode())
        with zmq_handshakes(sub) as handshake:
            sub.connect(server.kv_events_endpoint)
            handshake(60)  # PUB/SUB slow joiner: what is published before it is lost

        _client(server).completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=1)

        # Follow the chain of BlockStored events from the prompt's first block (no parent) until
        # every full block of the prompt is covered; events of other requests do not match it.
        expected_tokens = prompt_ids[: full_blocks * BLOCK_SIZE_TOKENS]
        stored_tokens: list[int] = []
        stored_seqs: list[int] = []
        last_hash: Any = None

        def batches() -> Iterator[list[bytes]]:
            """Live, then, if the chain is not complete by then, what replay still holds: the
            publisher takes in a subscription whose handshake is done on its own time, and may
            have sent the first batches before (``tests.harness.next_batch``)."""
            deadline = time.monotonic() + EVENT_WAIT_S / 2
            while (left := deadline - time.monotonic()) > 0:
                if sub.poll(int(left * 1000)):
                    yield sub.recv_multipart()
            yield from replayed_batches(server.kv_replay_endpoint, 0)

        for topic, seq, payload in batches():
            assert topic == server.kv_events_topic.encode()
            for event in _decode_events(payload):
                if event["type"] != "BlockStored" or event["parent_block_hash"] != last_hash:
                    continue
                token_ids = event["token_ids"]
                start = len(stored_tokens)
                if token_ids != expected_tokens[start : start + len(token_ids)]:
                    continue
                assert event["block_size"] == BLOCK_SIZE_TOKENS
                assert len(token_ids) == len(event["block_hashes"]) * BLOCK_SIZE_TOKENS
                stored_tokens.extend(token_ids)
                stored_seqs.append(int.from_bytes(seq, "big"))
                last_hash = event["block_hashes"][-1]
            if len(stored_tokens) == len(expected_tokens):
                break
        assert stored_tokens == expected_tokens, "no BlockStored chain for the prompt"

        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.kv_replay_endpoint)
        dealer.send_multipart([b"", stored_seqs[0].to_bytes(8, "big")])
        replayed: list[int] = []
        while True:
            assert dealer.poll(int(EVENT_WAIT_S * 1000)), "replay socket did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq_number = int.from_bytes(seq, "big", signed=True)
            if seq_number == -1:
                break
            assert topic == server.kv_events_topic.encode()
            _decode_events(payload)
            replayed.append(seq_number)
        assert replayed and replayed[0] == stored_seqs[0]
    finally:
        context.destroy(linger=0)
