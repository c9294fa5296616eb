"""gateway.prompt.tokenizer.template_options: what the chat template is given, by vLLM 0.32's rules.

Every expectation here was compared with vLLM 0.32's own renderer (``vllm launch render`` on the
tiny model and on a copy whose template prints tools, documents and the reasoning variables):
the token ids were the same for every request vLLM accepts, and the gateway refuses what it
refuses; the one deliberate difference is ``tokenize`` (see ``template_options``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.procs.vllm import tiny_model_path
from gateway.prompt.tokenizer import (
    HFTokenizer,
    TemplateOptionError,
    TemplateOptions,
    template_options,
)

UNTRUSTED = "--trust-request-chat-template is not set"
RICH = ("{{ bos_token }}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
        "{% if tools %}TOOLS{{ tools | tojson }}{% endif %}"
        "{% if documents %}DOCS{{ documents | tojson }}{% endif %}"
        "{% if reasoning_effort is defined %}RE={{ reasoning_effort }}{% endif %}"
        "{% if enable_thinking is defined %}ET={{ enable_thinking }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@functools.cache
def rich() -> HFTokenizer:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    tok.chat_template = RICH
    return HFTokenizer("rich", tok)


def text(body: dict[str, Any]) -> str:
    return rich().decode(rich().encode_chat(MESSAGES, body))


@pytest.mark.parametrize("body", [
    {"chat_template": "{{ 'x' }}"},
    {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
    {"chat_template_kwargs": {"chat_template": "auto"}},  # vLLM refuses any non-null value
])
def test_a_template_sent_with_the_request_is_refused(body: dict[str, Any]) -> None:
    """Regression: ``chat_template_kwargs.chat_template`` replaced the model's template inside
    the gateway (a 619-token prompt counted as 1; a nested loop held the event loop 5.6 s)."""
    with pytest.raises(TemplateOptionError, match=UNTRUSTED) as err:
        template_options(body)
    assert err.value.param == "chat_template"


def test_a_null_template_in_the_kwargs_is_no_template() -> None:
    assert text({"chat_template_kwargs": {"chat_template": None}}) == text({})


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tokenize": True}, "chat_template_kwargs"),
    ({"tokenize": True, "truncation": True, "max_length": 3}, "chat_template_kwargs"),
    ({"return_assistant_tokens_mask": True}, "chat_template_kwargs"),
    ({"conversation": []}, "chat_template_kwargs"),
])
def test_parameters_of_apply_chat_template_vllm_cannot_honour_are_refused(
        kwargs: dict[str, Any], param: str) -> None:
    """``tokenize`` with ``truncation`` makes vLLM 0.32 cut the prompt it holds (to 3 tokens
    here) below what the gateway would count: refused, as vLLM's own check means to."""
    with pytest.raises(TemplateOptionError) as err:
        template_options({"chat_template_kwargs": kwargs})
    assert err.value.param == param


def test_parameters_without_effect_and_unset_values_are_dropped() -> None:
    opts = template_options({"chat_template_kwargs": {
        "padding": True, "truncation": True, "max_length": 2, "return_dict": True,
        "tokenize": False, "greeting": None, "other": "auto", "kept": 0}})
    assert opts.variables == {"kept": 0}


def test_the_request_fields_win_over_the_same_kwargs() -> None:
    opts = template_options({"add_generation_prompt": False, "chat_template_kwargs": {
        "add_generation_prompt": True, "continue_final_message": True}})
    assert (opts.add_generation_prompt, opts.continue_final_message) == (False, False)
    assert text({"chat_template_kwargs": {"add_generation_prompt": False}}).endswith(
        "<|im_start|>assistant\n")


def test_template_variables_reach_the_template_and_are_counted() -> None:
    plain, greeted = text({}), text({"chat_template_kwargs": {"greeting": "hello"}})
    assert greeted == plain.replace("<s>", "<s>[hello]", 1)
    assert text({"chat_template_kwargs": {"bos_token": "B"}}).startswith("B<|im_start|>")


def test_documents_are_rendered_and_counted_the_request_field_first() -> None:
    docs = [{"title": "t", "text": "x" * 50}]
    assert f"DOCS{json.dumps(docs)}" in text({"documents": docs})
    assert f"DOCS{json.dumps(docs)}" in text(
        {"documents": docs, "chat_template_kwargs": {"documents": [{"title": "k"}]}})
    assert 'DOCS[{"title": "k"}]' in text({"chat_template_kwargs": {"documents": [{"title": "k"}]}})
    assert (len(rich().encode_chat(MESSAGES, {"documents": docs}))
            > len(rich().encode_chat(MESSAGES, {})) + 10)


def test_tools_are_rendered_as_vllm_reserialises_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "extra": 1}, "x_extra": [1]},
             {"function": {"name": "g", "description": "d", "parameters": {"type": "object"},
                           "strict": "true"}, "defer_loading": True}]
    assert template_options({"tools": tools}).tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "d",
                                          "parameters": {"type": "object"}, "strict": True,
                                          "defer_loading": True}, "defer_loading": True}]
    assert 'TOOLS[{"type": "function"' in text({"tools": tools})


def test_kwargs_tools_replace_the_request_tools_unless_unset() -> None:
    tools = [{"function": {"name": "q"}}]
    assert template_options({"tools": tools, "chat_template_kwargs": {"tools": [{"k": 1}]}}
                            ).tools == [{"k": 1}]
    assert template_options({"tools": tools, "chat_template_kwargs": {"tools": "auto"}}
                            ).tools == [{"type": "function", "function": {
                                "name": "q", "description": None, "parameters": None}}]


@pytest.mark.parametrize(("body", "variables"), [
    ({"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": "maybe"}},
     {"reasoning_effort": "low", "enable_thinking": "maybe"}),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": None}},
     {"reasoning_effort": "low"}),
])
def test_reasoning_effort_is_a_template_variable_with_enable_thinking(
        body: dict[str, Any], variables: dict[str, Any]) -> None:
    assert template_options(body).variables == variables


@pytest.mark.parametrize(("body", "param"), [
    ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
    ({"reasoning_effort": "auto"}, "reasoning_effort"),
    ({"reasoning_effort": ["high"]}, "reasoning_effort"),
    ({"add_generation_prompt": None}, "add_generation_prompt"),
    ({"tools": [{"type": "function", "function": {"name": 1}}]}, "tools.0"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"documents": [{"a": 1}]}, "documents"),
])
def test_options_vllm_does_not_validate_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(TemplateOptionError) as err:
        template_options(body)
    assert err.value.param == param


@pytest.mark.parametrize(("value", "expected"), [("no", False), ("TRUE", True), (0, False),
                                                 (1.0, True)])
def test_booleans_are_read_as_vllm_reads_them(value: Any, expected: bool) -> None:
    assert template_options({"add_generation_prompt": value}).add_generation_prompt is expected


def test_a_body_without_option_fields_gets_the_defaults() -> None:
    assert template_options({"model": "m", "messages": MESSAGES, "max_tokens": 4}) == \
        TemplateOptions(add_generation_prompt=True, continue_final_message=False)


@pytest.mark.parametrize("field", [
    {"chat_template_kwargs": {"greeting": "x"}},
    {"add_generation_prompt": False},
    {"continue_final_message": True},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"documents": [{"title": "t", "text": "x"}]},
    {"reasoning_effort": "high"},
])
def test_each_option_field_alone_changes_the_options(field: dict[str, Any]) -> None:
    """A body naming none of the option fields takes a shortcut to the defaults: every field
    ``template_options`` reads must still count when it comes alone (a field missing from the
    shortcut's set would be silently ignored)."""
    body = {"model": "m", "messages": MESSAGES, **field}
    assert template_options(body) != template_options({"model": "m", "messages": MESSAGES})


def test_a_request_template_alone_is_still_refused() -> None:
    with pytest.raises(TemplateOptionError, match=UNTRUSTED):
        template_options({"model": "m", "messages": MESSAGES, "chat_template": "{{ 1 }}"})
