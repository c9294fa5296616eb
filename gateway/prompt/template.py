"""A model's chat template, compiled once and rendered directly: the text vLLM renders, at half
the cost of ``apply_chat_template`` per request.

``transformers``' ``apply_chat_template`` caches the compiled Jinja template, but every call
still deep-copies the conversation twice (``_message_objects_to_dicts``, ``_plain_template_data``:
they turn pydantic objects, dataclasses and media into plain data, which a parsed JSON body
already is), rebuilds ``special_tokens_map`` and validates its many options. Per request, the
steps here are:

1. the template for the request (the model's tools template when ``tools`` is given), compiled
   once by the function ``apply_chat_template`` compiles with (same sandbox, filters, globals),
   with the names of the variables it reads and whether it names the ``developer`` role;
2. the messages as vLLM 0.32's ``safe_apply_chat_template`` hands them over: where the template
   does not name the ``developer`` role, developer messages become system messages and every
   system message is merged into one at the start;
3. only the request's template variables the template reads pass (vLLM's
   ``resolve_chat_template_kwargs``; ``gateway.prompt.tokenizer.template_options`` resolved
   which variables the request sets), over the special tokens;
4. the messages as ``apply_chat_template`` hands them to the template: keys whose value is null
   dropped, the reasoning fields aliased (``reasoning_content`` / ``thinking`` / ``reasoning``);
5. the template's compiled render function on one context dict (what ``Template.render`` does,
   less its copy of the globals and keywords per call: 10.4 -> 4.3 us for one short message),
   with a ``Deadline`` checked after each chunk (``gateway.prompt.limits``).

The template is always the model's: a request's own template is refused before this module is
reached (``template_options``), because a template is code and runs here.

Cost, one short message, tiny-llama's template: 57 us through ``apply_chat_template``, 27 us
here (about 6% of the gateway's CPU per short chat), before step 5 took ~6 us more off it. A compiled engine in Rust (minijinja) would
render faster still but is not Jinja2: filters and whitespace rules differ, and the token ids
must stay identical to vLLM's.

What the direct path does not reproduce goes through ``apply_chat_template`` itself, so the text
is the same either way: ``continue_final_message`` (its tag-and-strip dance) and tools that are
not JSON objects (it raises for them). That path has no deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2.meta
from transformers.utils.chat_template_utils import _compile_jinja_template

from gateway.prompt.limits import Deadline

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning goes by, the one templates read first (transformers'
``_alias_reasoning_fields``)."""

_FIXED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""The variables every render sets itself: a request's template variables may not name them."""


@dataclass(frozen=True)
class _Compiled:
    template: Any  # jinja2.Template
    variables: frozenset[str]  # what it reads: vLLM passes only these from the request
    names_developer: bool  # vLLM's ``_detect_developer_role_support``
    base: Mapping[str, Any]  # the template's globals, then the special tokens over them
    globals: dict[str, Any]  # the template's globals (a ChainMap in jinja2) as one plain dict


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each message as ``apply_chat_template`` hands it to the template: its null fields
    dropped, and a reasoning given under any of ``_REASONING_FIELDS`` also set as
    ``reasoning_content`` (and ``thinking``, which gpt-oss templates read), as transformers'
    ``_alias_reasoning_fields`` does; in one compiled pass instead of two (the property test of
    ``tests/unit/test_prompt_template.py`` holds it to ``apply_chat_template``)."""
    chat: list[dict[str, Any]] = []
    for m in messages:
        message = {k: v for k, v in m.items() if v is not None}
        for key in _REASONING_FIELDS:
            reasoning = message.get(key)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
                break
        chat.append(message)
    return chat


class ChatTemplate:
    """Renders chat prompts with a Hugging Face tokenizer's chat template(s)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self._special_tokens = dict(hf_tokenizer.special_tokens_map)
        self._compiled: dict[bool, _Compiled] = {}  # with tools? -> the compiled template

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Any, documents: Any,
        add_generation_prompt: bool, continue_final_message: bool,
        variables: Mapping[str, Any], deadline: Deadline | None = None,
    ) -> str:
        """The prompt text; ``variables``: the request's template variables (``template_options``),
        of which those the template reads are passed."""
        compiled = self._compiled_for(tools is not None)
        if not compiled.names_developer and any(m.get("role") == "developer" for m in messages):
            messages = _developer_as_system(messages)
        passed = ({k: v for k, v in variables.items() if k in compiled.variables}
                  if variables else {})
        if continue_final_message or (tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools))):
            return str(self._tok.apply_chat_template(
                list(messages), tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **passed))
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        chat = _template_messages(messages)
        # ``Template.render`` without its per-call copies: the context's variables are one
        # dict, built over the template's globals and the special tokens merged once
        # (``_Compiled.base``), and shared as the context's parent (jinja2 otherwise copies
        # the globals and the call's keywords into a new dict each call). An error propagates
        # as the same exception, only without jinja2's traceback rewriting.
        if passed and not _FIXED.isdisjoint(passed):
            # as the keyword call did (vLLM's, through transformers, too): the template fails
            raise TypeError(f"render() got multiple values for {sorted(_FIXED & passed.keys())}")
        context = {**compiled.base, **passed} if passed else {**compiled.base}
        context.update(messages=chat, tools=tools, documents=documents,
                       add_generation_prompt=add_generation_prompt)
        template = compiled.template
        # ``template.new_context(context, shared=True)`` builds this, after two wrapper calls
        # and a walk of the template's ChainMap of globals (for the context's ``globals_keys``)
        # in interpreted code each call; the plain dict of the same globals gives the same keys.
        env = template.environment
        chunks = template.root_render_func(env.context_class(
            env, context, template.name, template.blocks, globals=compiled.globals))
        if deadline is None:
            return "".join(chunks)
        out: list[str] = []
        for chunk in chunks:
            deadline.check()
            out.append(chunk)
        return "".join(out)

    def _compiled_for(self, with_tools: bool) -> _Compiled:
        compiled = self._compiled.get(with_tools)
        if compiled is None:
            source = self._tok.get_chat_template(None, [] if with_tools else None)
            template = _compile_jinja_template(source)
            compiled = _Compiled(
                template,
                frozenset(jinja2.meta.find_undeclared_variables(template.environment.parse(source))),
                '"developer"' in source or "'developer'" in source,
                {**template.globals, **self._special_tokens},
                dict(template.globals),
            )
            self._compiled[with_tools] = compiled
        return compiled


def _developer_as_system(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages``."""
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m.get("role") == "developer" else m for m in messages]
    contents: list[str] = []
    others: list[Mapping[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m.get("role") != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(contents)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            contents.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]
