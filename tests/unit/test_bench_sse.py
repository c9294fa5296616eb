"""gateway.bench.loadgen.StreamParser and build_body: what the load generator reads and sends."""

from __future__ import annotations

import orjson
import pytest

from gateway.bench.loadgen import LoadSpec, StreamParser, build_body
from gateway.bench.workloads import BenchRequest, Message


def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
HEL = chunk({"content": "Hel"})
LO = chunk({"content": "lo"}, "stop")
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,' \
        b'"total_tokens":17,"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + HEL + LO + USAGE + DONE


def test_whole_stream_gives_first_and_last_token_times_usage_and_done() -> None:
    p = StreamParser(keep_text=True)
    p.feed(ROLE, 1.0)  # the role chunk carries no text: not the first token
    p.feed(HEL, 2.0)
    p.feed(LO + USAGE + DONE, 3.0)
    p.close(3.5)
    assert (p.first_token_s, p.last_token_s) == (2.0, 3.0)
    assert p.chunks == 2
    assert p.text == "Hello"
    assert p.completion_tokens == 5  # usage wins over the chunk count (chunks may merge tokens)
    assert p.usage is not None and p.usage["prompt_tokens_details"]["cached_tokens"] == 8
    assert p.done and p.finished and p.error is None


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_chunks_split_anywhere_parse_the_same(size: int) -> None:
    p = StreamParser(keep_text=True)
    for i in range(0, len(STREAM), size):
        p.feed(STREAM[i : i + size], float(i))
    p.close(float(len(STREAM)))
    assert p.text == "Hello" and p.chunks == 2 and p.done
    assert p.completion_tokens == 5
    # the first token arrives with the byte that completes the HEL event
    assert p.first_token_s == float(((len(ROLE) + len(HEL) - 1) // size) * size)


def test_crlf_line_endings_and_comments_are_understood() -> None:
    p = StreamParser(keep_text=True)
    p.feed(b": keep-alive\r\n\r\n" + HEL.replace(b"\n", b"\r\n"), 1.0)
    p.feed(DONE.replace(b"\n", b"\r\n"), 2.0)
    assert p.text == "Hel" and p.done


def test_completions_text_chunks_count_as_tokens() -> None:
    ev = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" a",' \
         b'"finish_reason":null}]}\n\n'
    p = StreamParser()
    p.feed(ev + ev, 1.0)
    assert p.chunks == 2 and p.first_token_s == 1.0
    assert p.completion_tokens == 2  # no usage: one token per text chunk


def test_error_event_mid_stream_is_reported() -> None:
    p = StreamParser()
    p.feed(HEL + b'data: {"error": {"message": "engine died", "code": 500}}\n\n', 1.0)
    assert p.error == "engine died"


def test_a_last_event_without_its_blank_line_still_counts() -> None:
    p = StreamParser()
    p.feed(HEL + b"data: [DONE]", 1.0)
    assert not p.done
    p.close(2.0)
    assert p.done


def test_garbage_data_lines_are_ignored() -> None:
    p = StreamParser()
    p.feed(b"data: {not json\n\ndata: [1, 2]\n\n" + HEL, 1.0)
    assert p.chunks == 1 and p.error is None


def req(**kw: object) -> BenchRequest:
    base: dict[str, object] = dict(
        index=0, group="g", messages=(Message("system", "sys"), Message("user", "q")),
        approx_prompt_tokens=2, max_tokens=32,
    )
    base.update(kw)
    return BenchRequest(**base)  # type: ignore[arg-type]


def test_chat_body_streams_with_usage_and_optional_ignore_eos() -> None:
    body = build_body(req(), req().messages, LoadSpec(model="m", ignore_eos=True))
    assert body["model"] == "m" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32 and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "system", "content": "sys"},
                                {"role": "user", "content": "q"}]
    assert "ignore_eos" not in build_body(req(), req().messages, LoadSpec(model="m"))


def test_completions_body_joins_the_messages_and_extra_body_is_merged() -> None:
    spec = LoadSpec(model="m", api="completions", extra_body={"temperature": 0})
    body = build_body(req(), req().messages, spec)
    assert body["prompt"] == "sys\n\nq" and "messages" not in body
    assert body["temperature"] == 0


def test_salt_goes_in_front_of_the_first_message_only() -> None:
    body = build_body(req(), req().messages, LoadSpec(model="m", salt="ab12"))
    assert body["messages"][0]["content"] == "[ab12] sys"
    assert body["messages"][1]["content"] == "q"
    spec = LoadSpec(model="m", api="completions", salt="ab12")
    assert build_body(req(), req().messages, spec)["prompt"] == "[ab12] sys\n\nq"
