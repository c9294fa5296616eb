"""gateway.sim.output: what a request asks of its answer, validated as vLLM 0.32 does, and each
choice's text (stop strings, logprobs, forced answers)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.prompt.tokenizer import SimpleTokenizer
from gateway.sim.output import (
    MAX_LOGPROBS,
    ChoiceText,
    OutputSpec,
    SpecError,
    chat_logprobs,
    completion_logprobs,
    echoed_completion_logprobs,
    example_value,
    output_spec,
    prompt_logprob_rows,
    script_tokens,
    vllm_prompt_logprobs,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris"]}, "days": {"type": "integer"}},
    "required": ["city"]}}}


def spec(chat: bool = True, **body: Any) -> OutputSpec:
    return output_spec(body, chat=chat, tool_parser=True)


def refused(chat: bool = True, tool_parser: bool = True, **body: Any) -> SpecError:
    with pytest.raises(SpecError) as exc:
        output_spec(body, chat=chat, tool_parser=tool_parser)
    return exc.value


# --- output_spec ---------------------------------------------------------------------------------


def test_a_plain_request_asks_for_nothing_special() -> None:
    assert spec() == OutputSpec(n=1, logprobs=None, stop=(), echo=False, include_usage=False,
                                continuous_usage=False)


def test_n_must_be_a_positive_integer_and_an_integral_float_counts() -> None:
    assert spec(n=2.0).n == 2
    assert str(refused(n=0)) == "n must be at least 1, got 0."  # vLLM names no parameter
    assert refused(n="2").param is None


def test_stream_options_without_stream_are_refused() -> None:
    err = refused(stream_options={"include_usage": True})

    assert err.param == "stream_options"
    assert str(err) == ("Stream options can only be defined when `stream=True`."
                        " (parameter=stream_options)")
    assert spec(stream=True, stream_options={"include_usage": True}).include_usage


def test_continuous_usage_needs_include_usage() -> None:
    options = {"continuous_usage_stats": True}
    assert not spec(stream=True, stream_options=options).continuous_usage
    assert spec(stream=True, stream_options={**options, "include_usage": True}).continuous_usage


def test_chat_top_logprobs_need_logprobs_and_at_most_twenty() -> None:
    assert refused(top_logprobs=2).param == "top_logprobs"
    assert refused(logprobs=True, top_logprobs=-2).param == "top_logprobs"
    assert str(refused(logprobs=True, top_logprobs=21)) == (
        "Requested sample logprobs of 21, which is greater than max allowed: 20"
        " (parameter=logprobs, value=21)")
    assert spec(logprobs=True).logprobs == 0
    assert spec(logprobs=True, top_logprobs=3).logprobs == 3
    assert spec(logprobs=True, top_logprobs=-1).logprobs == MAX_LOGPROBS
    assert spec(top_logprobs=0).logprobs is None


def test_completion_logprobs_is_the_number_of_alternatives() -> None:
    assert spec(chat=False, logprobs=0).logprobs == 0
    assert spec(chat=False, logprobs=5).logprobs == 5
    assert refused(chat=False, logprobs=21).param == "logprobs"


def test_stop_is_a_string_or_a_list_of_strings() -> None:
    assert spec(stop="\n").stop == ("\n",)
    assert spec(stop=["a", "", "b"]).stop == ("a", "b")
    assert refused(stop=[1]).param == "stop"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": ""}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_tool_and_format_requests_vllm_refuses(body: dict[str, Any], param: str) -> None:
    assert refused(**body).param == param


def test_a_named_tool_forces_its_arguments_and_required_forces_a_call_list() -> None:
    named = spec(tools=[WEATHER], tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}})
    required = spec(tools=[WEATHER], tool_choice="required")

    assert named.tool_name == "get_weather" and json.loads(named.script or "") == {"city": "Paris"}
    assert required.tool_required and required.tool_name is None
    assert json.loads(required.script or "") == [{"name": "get_weather",
                                                  "parameters": {"city": "Paris"}}]


def test_a_negative_temperature_is_refused() -> None:
    assert refused(temperature=-1).param == "temperature"
    assert spec(temperature=0).n == 1


@pytest.mark.parametrize(("choice", "message"), [
    (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be'
           " set"),
    ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
    ({"type": "function", "function": {"name": "get_weather"}},
     'tool_choice=function "get_weather" requires --tool-call-parser to be set'),
])
def test_without_a_tool_parser_every_tool_choice_but_none_is_refused_as_vllm_does(
    choice: Any, message: str
) -> None:
    body: dict[str, Any] = {"tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    err = refused(tool_parser=False, **body)

    assert str(err) == message and err.param is None
    assert output_spec({**body, "tool_choice": "none"}, chat=True).script is None


def test_auto_and_none_tool_choices_answer_text() -> None:
    assert spec(tools=[WEATHER]).script is None
    assert spec(tools=[WEATHER], tool_choice="none").script is None


def test_response_formats_force_json() -> None:
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    assert spec(response_format={"type": "json_object"}).script == "{}"
    assert json.loads(spec(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": schema}}).script or "") == {"city": "Paris"}
    assert spec(response_format={"type": "text"}).script is None
    assert spec(chat=False, response_format={"type": "json_object"}).script == "{}"


@pytest.mark.parametrize(("schema", "value"), [
    ({"type": "string", "minLength": 5}, "xxxxx"),
    ({"type": "integer", "minimum": 3}, 3),
    ({"type": "number", "exclusiveMinimum": 0}, 1.0),
    ({"type": "boolean"}, False),
    ({"type": ["null", "string"]}, "xxx"),
    ({"const": 7}, 7),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 0),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [0, 0]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, {}),
])
def test_example_values_are_valid_for_their_schema(schema: dict[str, Any], value: Any) -> None:
    assert example_value(schema) == value


def test_no_schema_a_client_sends_makes_the_forced_answer_large_or_fails() -> None:
    """A hostile schema: huge lengths, deep nesting, fields of the wrong type."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(1000):
        deep = {"type": "array", "items": deep, "minItems": 1}

    assert example_value({"type": "array", "items": {"type": "string", "minLength": 10**9},
                          "minItems": 10**9}) == ["x" * 64] * 64
    assert len(json.dumps(example_value(deep))) < 100
    assert example_value({"type": "object", "properties": [1], "required": "abc"}) == {}
    assert example_value({"type": "integer", "minimum": "many"}) == 0


# --- ChoiceText ----------------------------------------------------------------------------------


def text_of(token_id: int) -> str:
    return f" t{token_id}"


def test_tokens_become_their_texts_and_count_in_usage() -> None:
    choice = ChoiceText(spec(), text_of, streaming=True)

    assert choice.add([1, 2], False) == (" t1 t2", None)
    assert choice.add([3], True) == (" t3", None)
    assert choice.tokens == 3 and choice.finished and choice.stop_reason is None


def test_a_stop_string_cuts_the_text_before_it_and_drops_the_tokens_after() -> None:
    choice = ChoiceText(spec(stop=["t3"]), text_of, streaming=False)

    delta, _ = choice.add([1, 2, 3, 4, 5], False)

    assert delta == " t1 t2 " and choice.finished and choice.stop_reason == "t3"
    assert choice.tokens == 3


def test_a_stream_holds_back_what_could_start_a_stop_string_split_over_chunks() -> None:
    """A stop string whose head was already sent would leak: the head is held back."""
    choice = ChoiceText(spec(stop=[" t2 t3"]), text_of, streaming=True)

    first, _ = choice.add([1, 2], False)
    second, _ = choice.add([3], False)

    assert first == " " and first + second == " t1"
    assert choice.finished and choice.stop_reason == " t2 t3"


def test_held_back_text_goes_out_when_the_choice_finishes() -> None:
    choice = ChoiceText(spec(stop=["zzzz"]), text_of, streaming=True)

    first, _ = choice.add([1], False)
    last, _ = choice.add([2], True)

    assert first + last == " t1 t2" and len(first) == len(" t1") - 3


def test_a_forced_answer_has_the_text_of_its_pieces() -> None:
    ids, pieces = script_tokens(SimpleTokenizer(), '{"city": "Paris"}')
    choice = ChoiceText(spec(), text_of, pieces, streaming=False)

    delta, _ = choice.add([*ids, 2], True)

    assert delta == '{"city": "Paris"}' + text_of(2)
    assert "".join(pieces) == '{"city": "Paris"}' and len(ids) == len(pieces)


def test_chat_logprobs_have_vllms_shape_and_the_asked_number_of_alternatives() -> None:
    choice = ChoiceText(spec(logprobs=True, top_logprobs=2), text_of, streaming=False)
    _, rows = choice.add([5, 6], True)

    content = chat_logprobs(rows or [], 2)["content"]

    assert [e["token"] for e in content] == [" t5", " t6"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] > entry["top_logprobs"][1]["logprob"]
    assert chat_logprobs(rows or [], 0)["content"][0]["top_logprobs"] == []


def test_completion_logprobs_have_offsets_and_at_least_the_sampled_token() -> None:
    choice = ChoiceText(spec(chat=False, logprobs=0), text_of, streaming=False)
    _, rows = choice.add([5, 66], True)

    lp, end = completion_logprobs(rows or [], 10)

    assert lp["tokens"] == [" t5", " t66"] and lp["text_offset"] == [10, 13] and end == 17
    assert [list(top) for top in lp["top_logprobs"]] == [[" t5"], [" t66"]]


def test_completion_top_logprobs_merge_the_sampled_token_when_it_is_the_likeliest() -> None:
    """vLLM's entries are one per token: the sampled one and the k likeliest, k + 1 entries, or
    k where the sampled token is the likeliest, as it always is when greedy."""
    tokens = list(range(16, 216))

    def sizes(**body: Any) -> list[int]:
        choice = ChoiceText(spec(chat=False, logprobs=2, **body), text_of, streaming=False)
        rows = choice.add(tokens, True)[1] or []
        tops = completion_logprobs(rows, 0)[0]["top_logprobs"]
        assert all(next(iter(top)) == row[0] for top, row in zip(tops, rows, strict=True))
        return [len(top) for top in tops]

    sampled = sizes()
    assert set(sampled) == {2, 3} and 0.15 < sampled.count(2) / len(sampled) < 0.45
    assert set(sizes(temperature=0)) == {2}
    assert set(sizes(temperature=1e-6)) == {2}
    assert set(sizes(temperature=0.5)) == {2, 3}


def test_logprobs_are_the_same_for_the_same_token_at_the_same_position() -> None:
    def rows() -> Any:
        return ChoiceText(spec(logprobs=True, top_logprobs=3), text_of,
                          streaming=False).add([9, 9], True)[1]

    first, again = rows(), rows()
    assert first == again and first[0][1] != first[1][1]


def test_prompt_logprobs_follow_vllms_rules() -> None:
    assert output_spec({"prompt_logprobs": 3}, chat=False).prompt_logprobs == 3
    assert output_spec({"echo": True, "logprobs": 2}, chat=False).prompt_logprobs == 2
    assert output_spec({"echo": True}, chat=False).prompt_logprobs is None
    assert output_spec({"echo": True}, chat=True).prompt_logprobs == 0  # top_logprobs: 0
    assert output_spec({"logprobs": 2}, chat=False).prompt_logprobs is None
    for body, message in (
        ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
        ({"prompt_logprobs": -2}, "must be a positive value or -1"),
        ({"prompt_logprobs": -1}, "greater than max allowed: 20"),
        ({"prompt_logprobs": 21}, "greater than max allowed: 20"),
        ({"prompt_logprobs": "1"}, "must be an integer"),
    ):
        with pytest.raises(SpecError) as err:
            output_spec(body, chat=False)
        assert message in str(err.value) and err.value.param == "prompt_logprobs"
    assert output_spec({"prompt_logprobs": 0, "stream": True}, chat=False).prompt_logprobs == 0


def test_prompt_logprob_rows_list_each_token_then_its_likeliest_others() -> None:
    tok = SimpleTokenizer()
    ids = tok.encode_text("the cat sat on the mat")
    rows = prompt_logprob_rows(ids, 3, lambda t: tok.decode([t]), range(16, 32000))
    assert rows[0] is None and len(rows) == len(ids)
    for token, row in zip(ids[1:], rows[1:], strict=True):
        assert row is not None and row[0][0] == token and len(row) == 4
        assert [rank for _, _, rank, _ in row[1:]] == [1, 2, 3] and row[0][2] > 3
        assert row[1][1] > row[2][1] > row[3][1] > row[0][1]  # rank 1 the likeliest
        assert len({t for t, _, _, _ in row}) == len({text for _, _, _, text in row}) == 4
    again = prompt_logprob_rows(ids, 3, lambda t: tok.decode([t]), range(16, 32000))
    assert again == rows
    shown = vllm_prompt_logprobs(rows)
    assert shown[0] is None
    assert shown[1] is not None
    assert set(shown[1]) == {str(t) for t, _, _, _ in rows[1] or ()}
    assert set(next(iter(shown[1].values()))) == {"logprob", "rank", "decoded_token"}


def test_echoed_completion_logprobs_put_the_prompt_first() -> None:
    tok = SimpleTokenizer()
    ids = tok.encode_text("a b c")
    rows = prompt_logprob_rows(ids, 1, lambda t: tok.decode([t]), range(16, 32000))
    generated = [("x", -0.5, [("x", -0.5), ("y", -1.0)])]
    out = echoed_completion_logprobs(ids, rows, lambda t: tok.decode([t]), generated)
    assert len(out["tokens"]) == len(ids) + 1
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["tokens"][-1] == "x" and out["text_offset"][0] == 0
    assert out["text_offset"] == sorted(out["text_offset"])
