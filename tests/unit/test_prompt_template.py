"""gateway.prompt.template: the compiled template renders exactly what ``apply_chat_template`` does.

Generated conversations (null fields, reasoning fields under each of their names, content given
as text, tool calls, names), template variables (plain ones, ones that override a special token,
``messages``, which collides), documents, tools (JSON objects, or something else), with and
without a generation prompt or ``continue_final_message``: the text, or the failure, is the same
both ways. The templates are the tiny model's and one that reads every field (a tools template
next to the default one). Which variables a request sets is ``template_options``'
(test_prompt_options.py); what vLLM does beyond ``apply_chat_template`` (developer messages) and
the deadline are tested below.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.procs.vllm import tiny_model_path
from gateway.prompt.limits import Deadline, PromptTimeoutError
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
    st.sampled_from(["greeting", "enable_thinking", "bos_token", "messages"]),
    st.one_of(TEXT, st.booleans()),
    max_size=2,
)
DOCUMENTS = st.one_of(st.none(), st.lists(st.fixed_dictionaries({"title": TEXT, "text": TEXT}),
                                          max_size=2), st.just(["not a document"]))
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
@given(chat=messages(), kwargs=KWARGS, documents=DOCUMENTS, tools=TOOLS,
       generation=st.booleans(), continue_final=st.booleans(), deadline=st.booleans())
def test_compiled_template_renders_what_apply_chat_template_renders(
    name: str, chat: list[dict[str, Any]], kwargs: dict[str, Any], documents: list[Any] | None,
    tools: list[Any] | None, generation: bool, continue_final: bool, deadline: bool,
) -> None:
    tok = tokenizers()[name]
    generation = generation and not continue_final
    expected = _outcome(lambda: tok.apply_chat_template(
        [dict(m) for m in chat], tools=tools, documents=documents,
        add_generation_prompt=generation, continue_final_message=continue_final,
        tokenize=False, **kwargs))
    got = _outcome(lambda: template(name).render(
        chat, tools=tools, documents=documents, add_generation_prompt=generation,
        continue_final_message=continue_final, variables=dict(kwargs),
        deadline=Deadline.after(60) if deadline else None))
    assert got == expected


def render(name: str, chat: list[dict[str, Any]], **options: Any) -> str:
    return template(name).render(chat, **{
        "tools": None, "documents": None, "add_generation_prompt": False,
        "continue_final_message": False, "variables": {}, **options})


def test_render_leaves_the_request_messages_untouched() -> None:
    chat = [{"role": "assistant", "content": "a", "reasoning": "r", "name": None}]
    before = [dict(m) for m in chat]
    render("rich", chat, add_generation_prompt=True)
    assert chat == before


def test_developer_messages_become_one_leading_system_message_where_the_template_lacks_the_role(
) -> None:
    """vLLM's ``_convert_developer_to_system`` + ``_consolidate_system_messages`` (the ids were
    compared with vLLM 0.32's own renderer): the tiny template never names ``developer``."""
    chat: list[dict[str, Any]] = [{"role": "developer", "content": "dev", "tools": [{"x": 1}]},
            {"role": "system", "content": "sys"}, {"role": "user", "content": "u"},
            {"role": "system", "content": ""}]
    assert render("tiny-llama", chat) == render("tiny-llama", [
        {"role": "system", "content": "dev\n\nsys"}, {"role": "user", "content": "u"}])


def test_developer_messages_stay_where_the_template_names_the_role() -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}"
                         "{{ m.content }}|{% endfor %}")
    chat = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    assert ChatTemplate(tok).render(
        chat, tools=None, documents=None, add_generation_prompt=False,
        continue_final_message=False, variables={}) == "u|D:d|"


def test_only_variables_the_template_reads_are_passed() -> None:
    """vLLM's ``resolve_chat_template_kwargs``: a variable the template does not read is dropped
    (rendering is the same; ``messages`` collides only where the template reads it, as in vLLM)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    tok.chat_template = "{{ greeting }}{% for m in range(2) %}.{% endfor %}"
    ours = ChatTemplate(tok)
    assert ours.render([], tools=None, documents=None, add_generation_prompt=False,
                       continue_final_message=False,
                       variables={"greeting": "hi", "messages": "x", "other": 1}) == "hi.."


def test_a_slow_template_stops_at_its_deadline() -> None:
    """The model's own template can be slow on a large input (here: quadratic in the messages);
    with a deadline the render stops at the next chunk after it, not when it is done."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    tok.chat_template = ("{% for a in messages %}{% for b in messages %}{{ a.content }}"
                         "{% endfor %}{% endfor %}")
    chat = [{"role": "user", "content": "x"}] * 3000  # 9M chunks: many seconds whole
    started = time.perf_counter()
    with pytest.raises(PromptTimeoutError, match=r"limits\.tokenize_timeout_s"):
        ChatTemplate(tok).render(chat, tools=None, documents=None, add_generation_prompt=False,
                                 continue_final_message=False, variables={},
                                 deadline=Deadline.after(0.05))
    assert time.perf_counter() - started < 0.5
