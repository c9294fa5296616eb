"""gateway.prompt.template: the compiled template renders exactly what ``apply_chat_template`` does.

Generated conversations (null fields, reasoning fields under each of their names, content given
as text, tool calls, names), template variables from ``chat_template_kwargs`` (plain ones, ones
that override a special token, ones that name a parameter of ``apply_chat_template``), tools (JSON
objects, or something else), with and without a generation prompt or ``continue_final_message``:
the text, or the failure, is the same both ways. The templates are the tiny model's and one that
reads every field (a tools template next to the default one).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.procs.vllm import tiny_model_path
from gateway.prompt.template import ChatTemplate

RICH_DEFAULT = (
    "{{ bos_token }}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}\n"
    "{% if m.thinking %}<think>{{ m.thinking }}|{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] if m.content is defined else '(none)' }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c | tojson }}</call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if documents %}DOCS{% endif %}"
)
RICH_TOOLS = "TOOLS{{ tools | tojson }}" + RICH_DEFAULT


@functools.cache
def tokenizers() -> dict[str, Any]:
    tiny = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    rich = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    rich.chat_template = {"default": RICH_DEFAULT, "tool_use": RICH_TOOLS}
    return {"tiny-llama": tiny, "rich": rich}


@functools.cache
def template(name: str) -> ChatTemplate:
    return ChatTemplate(tokenizers()[name])


TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
REASONING = st.sampled_from(["reasoning_content", "thinking", "reasoning"])


@st.composite
def messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 5))):
        m: dict[str, Any] = {"role": draw(st.sampled_from(["system", "user", "assistant", "tool"])),
                             "content": draw(st.one_of(TEXT, st.none()))}
        if draw(st.booleans()):
            m[draw(REASONING)] = draw(st.one_of(TEXT, st.none()))
        if draw(st.booleans()):
            m["name"] = draw(st.one_of(TEXT, st.none()))
        if draw(st.booleans()):
            m["tool_calls"] = [{"id": draw(TEXT), "function": {"name": "f", "arguments": "{}"}}]
        out.append(m)
    return out


KWARGS = st.dictionaries(
    st.sampled_from(["greeting", "enable_thinking", "bos_token", "documents", "messages",
                     "tokenize", "padding"]),
    st.one_of(TEXT, st.booleans(), st.lists(st.fixed_dictionaries({"title": TEXT, "text": TEXT}),
                                            max_size=2)),
    max_size=2,
)
TOOLS = st.one_of(st.none(), st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                             "name": TEXT}), max_size=2),
                  st.just(["not a tool"]))


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        return "text", str(fn())
    except Exception as exc:  # the comparison is of failures too
        return "error", type(exc).__name__


@pytest.mark.parametrize("name", ["tiny-llama", "rich"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=messages(), kwargs=KWARGS, tools=TOOLS, generation=st.booleans(),
       continue_final=st.booleans())
def test_compiled_template_renders_what_apply_chat_template_renders(
    name: str, chat: list[dict[str, Any]], kwargs: dict[str, Any], tools: list[Any] | None,
    generation: bool, continue_final: bool,
) -> None:
    tok = tokenizers()[name]
    generation = generation and not continue_final
    expected = _outcome(lambda: tok.apply_chat_template(
        [dict(m) for m in chat], tools=tools, add_generation_prompt=generation,
        continue_final_message=continue_final, tokenize=False, **kwargs))
    got = _outcome(lambda: template(name).render(
        chat, tools=tools, add_generation_prompt=generation,
        continue_final_message=continue_final, kwargs=dict(kwargs)))
    assert got == expected


def test_render_leaves_the_request_messages_untouched() -> None:
    chat = [{"role": "assistant", "content": "a", "reasoning": "r", "name": None}]
    before = [dict(m) for m in chat]
    template("rich").render(chat, tools=None, add_generation_prompt=True,
                            continue_final_message=False, kwargs={})
    assert chat == before
