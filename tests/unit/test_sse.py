"""gateway.upstream.sse: splitting a byte stream into whole SSE events and classifying them."""

from __future__ import annotations

import json

import orjson
import pytest

from gateway.upstream.sse import (
    Kind,
    SSESplitter,
    classify,
    error_event,
    only_tokens,
    split_events,
    tokens_prefix,
)

CONTENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}\n\n'
)
CONTENT_2 = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"lo"},"logprobs":null,"finish_reason":"stop"}]}\n\n'
)
USAGE_DICT = {"prompt_tokens": 12, "total_tokens": 14, "completion_tokens": 2}
USAGE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[],"usage":' + json.dumps(USAGE_DICT).encode() + b"}\n\n"
)
DONE = b"data: [DONE]\n\n"
STREAM = CONTENT + CONTENT_2 + USAGE + DONE


def feed_all(splitter: SSESplitter, chunks: list[bytes]) -> list[bytes]:
    events: list[bytes] = []
    for chunk in chunks:
        events.extend(splitter.feed(chunk))
    return events


# --- splitting -----------------------------------------------------------------------------------


def test_one_chunk_with_several_events_yields_each_event_with_its_terminator() -> None:
    events = SSESplitter().feed(STREAM)

    assert events == [CONTENT, CONTENT_2, USAGE, DONE]


def test_chunk_ending_mid_line_is_held_until_the_event_completes() -> None:
    splitter = SSESplitter()
    cut = CONTENT.index(b"Hel")

    assert splitter.feed(CONTENT[:cut]) == []
    assert splitter.feed(CONTENT[cut:]) == [CONTENT]


def test_event_split_between_its_two_terminating_newlines_completes_on_the_second() -> None:
    splitter = SSESplitter()

    assert splitter.feed(CONTENT[:-1]) == []
    assert splitter.feed(b"\n" + CONTENT_2[:10]) == [CONTENT]
    assert splitter.feed(CONTENT_2[10:]) == [CONTENT_2]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_any_chunking_yields_the_same_events(size: int) -> None:
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]

    assert feed_all(SSESplitter(), chunks) == [CONTENT, CONTENT_2, USAGE, DONE]


def test_crlf_line_endings_are_split_into_events() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")

    events = SSESplitter().feed(crlf)

    assert [classify(e).kind for e in events] == [Kind.CONTENT, Kind.CONTENT, Kind.USAGE,
                                                   Kind.DONE]
    assert events[3].rstrip(b"\r\n") == b"data: [DONE]"


def test_crlf_event_split_between_cr_and_lf_still_ends_the_event() -> None:
    """A chunk boundary between `\\r` and `\\n` left `\\n\\r\\n` in the buffer: the event never
    ended, and it was later glued to the next event (two chunks relayed as one, late)."""
    crlf = STREAM.replace(b"\n", b"\r\n")
    first_end = crlf.index(b"\r\n\r\n") + 3  # just after the last \r of the first event

    splitter = SSESplitter()
    events = splitter.feed(crlf[:first_end]) + splitter.feed(crlf[first_end:])

    assert [classify(e).kind for e in events] == [Kind.CONTENT, Kind.CONTENT, Kind.USAGE,
                                                   Kind.DONE]


@pytest.mark.parametrize("size", [1, 3, 5])
def test_crlf_stream_in_any_chunking_yields_the_same_events(size: int) -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    chunks = [crlf[i : i + size] for i in range(0, len(crlf), size)]

    events = feed_all(SSESplitter(), chunks)

    assert len(events) == 4
    assert [classify(e).kind for e in events] == [Kind.CONTENT, Kind.CONTENT, Kind.USAGE,
                                                   Kind.DONE]


def test_comment_and_keep_alive_events_are_passed_through_as_other() -> None:
    stream = b": keep-alive\n\n" + CONTENT + b":\n\n"

    events = SSESplitter().feed(stream)

    assert events == [b": keep-alive\n\n", CONTENT, b":\n\n"]
    assert [classify(e).kind for e in events] == [Kind.OTHER, Kind.CONTENT, Kind.OTHER]


def test_empty_chunk_yields_nothing_and_keeps_the_held_bytes() -> None:
    splitter = SSESplitter()
    splitter.feed(CONTENT[:20])

    assert splitter.feed(b"") == []
    assert splitter.feed(CONTENT[20:]) == [CONTENT]


def test_tail_returns_the_unfinished_event_and_clears_it() -> None:
    splitter = SSESplitter()
    splitter.feed(CONTENT + CONTENT_2[:30])

    assert splitter.tail() == CONTENT_2[:30]
    assert splitter.tail() == b""
    assert splitter.feed(DONE) == [DONE]


def test_tail_is_empty_after_a_stream_that_ended_on_an_event_boundary() -> None:
    splitter = SSESplitter()
    splitter.feed(STREAM)

    assert splitter.tail() == b""


def test_feed_block_returns_the_complete_events_as_one_block_and_holds_the_rest() -> None:
    splitter = SSESplitter()
    cut = len(CONTENT) + 10

    assert splitter.feed_block(STREAM[:cut]) == CONTENT
    assert splitter.feed_block(STREAM[cut:-3]) == CONTENT_2 + USAGE
    assert splitter.feed_block(STREAM[-3:]) == DONE
    assert splitter.tail() == b""


@pytest.mark.parametrize("size", [1, 2, 5, 64])
def test_feed_block_in_any_chunking_yields_the_same_events_as_feed(size: int) -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    chunks = [crlf[i : i + size] for i in range(0, len(crlf), size)]
    splitter = SSESplitter()

    blocks = [splitter.feed_block(c) for c in chunks]

    assert [e for b in blocks for e in split_events(b)] == [CONTENT, CONTENT_2, USAGE, DONE]


def test_tokens_block_of_token_chunks_is_the_block_and_what_to_hold_changing_nothing() -> None:
    splitter = SSESplitter()
    splitter.feed_block(CONTENT[:7])  # an event's beginning, held

    assert splitter.tokens_block(CONTENT[7:] + CONTENT_2[:5]) == (CONTENT, CONTENT_2[:5])
    assert splitter.tokens_block(b"") == (b"", CONTENT[:7])  # nothing ended: all held
    assert splitter.feed_block(CONTENT[7:]) == CONTENT  # untouched until hold


def test_tokens_block_then_hold_splits_a_stream_as_feed_block_does() -> None:
    chunks = [CONTENT[:20], CONTENT[20:] + CONTENT_2[:3], CONTENT_2[3:]]
    splitter = SSESplitter()
    blocks = []
    for chunk in chunks:
        split = splitter.tokens_block(chunk)
        assert split is not None
        blocks.append(split[0])
        splitter.hold(split[1])

    assert b"".join(blocks) == CONTENT + CONTENT_2 and splitter.tail() == b""


@pytest.mark.parametrize("chunk", [USAGE, CONTENT_2 + DONE, b": keep-alive\n\n"],
                         ids=["usage", "done", "comment"])
def test_tokens_block_is_none_and_changes_nothing_when_an_event_needs_a_look(
        chunk: bytes) -> None:
    splitter = SSESplitter()
    splitter.feed_block(CONTENT[:7])

    assert splitter.tokens_block(CONTENT[7:] + chunk) is None
    assert splitter.feed_block(CONTENT[7:]) == CONTENT  # the held bytes are as they were


# --- which blocks need no look at each event ------------------------------------------------------


def test_block_of_plain_token_chunks_is_only_tokens() -> None:
    assert only_tokens(CONTENT)
    assert only_tokens(CONTENT + CONTENT_2 + CONTENT)
    # inside generated text the quotes are escaped: no "usage" key appears
    assert only_tokens(b'data: {"choices":[{"delta":{"content":"the \\"usage\\" key"}}]}\n\n')


@pytest.mark.parametrize("block", [
    CONTENT + USAGE, CONTENT + DONE, b": keep-alive\n\n" + CONTENT, CONTENT + b":\n\n",
    b"event: message\n" + CONTENT, b'data: {"choices":[],\ndata: "x":1}\n\n' + CONTENT,
    CONTENT + b'data: {"error":{"message":"boom"}}\n\n', b"retry: 10\n\n",
    b'data: {"choices":[{"delta":{"content":"usage"}}]}\n\n',
], ids=["usage", "done", "comment-first", "comment-last", "named-event", "multi-line-data",
        "error", "no-data", "usage-as-text"])
def test_block_with_any_other_event_is_not_only_tokens(block: bytes) -> None:
    """Every block ``only_tokens`` accepts classifies as content without usage, event by event;
    the ones it refuses are classified one by one (a token mentioning "usage" included)."""
    assert not only_tokens(block)


def test_only_tokens_agrees_with_classifying_each_event() -> None:
    for block in (CONTENT, CONTENT + CONTENT_2, CONTENT + USAGE, DONE, b":\n\n"):
        each = [classify(e) for e in split_events(block)]
        if only_tokens(block):
            assert all(e.kind is Kind.CONTENT and e.usage is None for e in each)


def test_tokens_prefix_ends_before_the_usage_chunk() -> None:
    assert tokens_prefix(CONTENT + CONTENT_2 + USAGE + DONE) == len(CONTENT + CONTENT_2)


def test_tokens_prefix_is_the_whole_block_of_token_chunks() -> None:
    assert tokens_prefix(CONTENT + CONTENT_2) == len(CONTENT + CONTENT_2)


@pytest.mark.parametrize("block", [USAGE + CONTENT, DONE, b": ping\n\n" + CONTENT + USAGE,
                                   CONTENT + b":\n\n" + USAGE])
def test_tokens_prefix_is_zero_when_what_precedes_the_first_mark_is_not_plain_tokens(
    block: bytes,
) -> None:
    assert tokens_prefix(block) == 0


# --- classifying ---------------------------------------------------------------------------------


def test_done_is_classified_done() -> None:
    assert classify(DONE).kind is Kind.DONE
    assert classify(b"data:[DONE]\n\n").kind is Kind.DONE


def test_content_chunk_is_content_without_usage() -> None:
    event = classify(CONTENT)

    assert event.kind is Kind.CONTENT
    assert event.usage is None
    assert event.raw == CONTENT


def test_final_usage_chunk_with_empty_choices_is_usage_and_carries_it() -> None:
    event = classify(USAGE)

    assert event.kind is Kind.USAGE
    assert event.usage == USAGE_DICT


def test_content_chunk_carrying_continuous_usage_stays_content_with_its_usage() -> None:
    raw = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
    )

    event = classify(raw)

    assert event.kind is Kind.CONTENT
    assert event.usage == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_content_chunk_with_null_usage_is_content_without_usage() -> None:
    raw = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}\n\n'

    event = classify(raw)

    assert (event.kind, event.usage) == (Kind.CONTENT, None)


def test_word_usage_inside_generated_text_does_not_make_a_usage_event() -> None:
    raw = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"the \\"usage\\" key"}}]}\n\n'
    )

    assert classify(raw).kind is Kind.CONTENT


def test_mid_stream_error_event_is_classified_error() -> None:
    raw = (
        b'data: {"error": {"object": "error", "message": "engine dead", '
        b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
    )

    assert classify(raw).kind is Kind.ERROR


def test_error_event_is_found_among_other_events_in_one_chunk() -> None:
    err = b'data: {"error":{"message":"boom","type":"BadRequestError","code":400}}\n\n'

    events = SSESplitter().feed(CONTENT + err + DONE)

    assert [classify(e).kind for e in events] == [Kind.CONTENT, Kind.ERROR, Kind.DONE]


def test_event_without_data_line_is_other() -> None:
    assert classify(b"event: ping\nid: 3\n\n").kind is Kind.OTHER
    assert classify(b"retry: 1000\n\n").kind is Kind.OTHER


def test_event_with_named_type_and_data_is_classified_by_its_data() -> None:
    assert classify(b"event: message\n" + DONE).kind is Kind.DONE


def test_data_split_over_several_lines_is_joined_before_classifying() -> None:
    raw = b'data: {"id":"c","choices":[],\ndata: "usage":{"prompt_tokens":1,"total_tokens":1}}\n\n'

    event = classify(raw)

    assert event.kind is Kind.USAGE
    assert event.usage == {"prompt_tokens": 1, "total_tokens": 1}


def test_malformed_json_mentioning_usage_is_not_fatal() -> None:
    event = classify(b'data: {"usage": {"prompt_tokens": \n\n')

    assert event.kind is Kind.OTHER
    assert event.usage is None


# --- the gateway's own error event ---------------------------------------------------------------


def test_error_event_is_one_openai_shaped_sse_event_that_classifies_as_error() -> None:
    raw = error_event("worker went away", "upstream_disconnected")

    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n\n") == 1
    assert orjson.loads(raw[len(b"data: "):]) == {
        "error": {"message": "worker went away", "type": "upstream_error", "param": None,
                  "code": "upstream_disconnected"}
    }
    assert SSESplitter().feed(raw) == [raw]
    assert classify(raw).kind is Kind.ERROR


def test_error_event_with_newlines_in_the_message_stays_one_event() -> None:
    raw = error_event("line one\n\nline two", "x")

    assert SSESplitter().feed(raw) == [raw]
