"""Prompt -> token ids, exactly as vLLM renders them.

vLLM (0.32) tokenizes an OpenAI request like this, and so does this module:

* chat: the model's chat template (compiled once: ``gateway.prompt.template``) is rendered to
  text with what vLLM hands it (``template_options``: ``add_generation_prompt``,
  ``continue_final_message``, ``tools``, ``documents``, ``reasoning_effort`` and the template
  variables of ``chat_template_kwargs``; a request's own template is refused); the text is
  encoded with ``add_special_tokens=False`` because the template writes BOS itself;
* completions: the prompt string is encoded with ``add_special_tokens=True``; a prompt given as
  token ids is taken as is.

Two tokenizers implement the same protocol: ``HFTokenizer`` (the model's own tokenizer, loaded with
``transformers`` from a local directory or a model id the operator configured) and
``SimpleTokenizer`` (deterministic, dependency-free, used by the simulated workers and the demo when
no real tokenizer is configured). The simulator and the gateway load the same one, so their token
counts, and therefore their block hashes, agree.

Cost: the Rust ``tokenizers`` encoder dominates: ~140 ms for a 128K-token prompt. ``HFTokenizer``
therefore encodes chat prompts incrementally (``gateway.prompt.segments``): turn N of a growing
conversation encodes only its new text, ~1 ms at 128K tokens, with identical ids
(``python -m gateway.bench.tokenize`` measures both). Given a ``max_tokens`` and a ``Deadline``,
both tokenizers stop early (``gateway.prompt.limits``): a text certainly longer than
``max_tokens`` is refused before it is encoded, and rendering + encoding stop at the deadline.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol

from gateway.prompt.limits import (
    Deadline,
    PromptTimeoutError,
    check_length,
    longest_token_chars,
)
from gateway.prompt.segments import DEFAULT_MAX_CACHED_TOKENS, SegmentEncoder
from gateway.prompt.template import ChatTemplate

log = logging.getLogger(__name__)

SIMPLE = "simple"


class PromptTooComplexError(ValueError):
    """The request's messages cannot be rendered by the chat template."""


class TemplateOptionError(PromptTooComplexError):
    """A template option vLLM refuses (a request's own template, ``tokenize`` ...); ``param``
    names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTokenizer(Protocol):
    """What the gateway (and the simulator) need from a tokenizer.

    ``max_tokens``: refuse (``PromptTooLongError``) a text certainly longer, before encoding it;
    ``deadline``: stop rendering and encoding there (``PromptTimeoutError``).
    """

    @property
    def name(self) -> str: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any], *,
        max_tokens: int | None = None, deadline: Deadline | None = None,
    ) -> list[int]:
        """Token ids of a chat request; ``options`` is the request body (template options)."""
        ...

    def encode_text(self, text: str, add_special_tokens: bool = True, *,
                    max_tokens: int | None = None, deadline: Deadline | None = None) -> list[int]:
        ...

    def encode_pair(self, text: str, text_pair: str, *, max_tokens: int | None = None,
                    deadline: Deadline | None = None) -> list[int]:
        """Token ids of ``text`` and ``text_pair`` as ONE sequence, with the special tokens
        the tokenizer puts around and between a pair: how vLLM encodes a (query, document)
        pair for a cross-encoder (``tokenizer(text=..., text_pair=...)``)."""
        ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id (``convert_ids_to_tokens``: not decoded text, e.g.
        ``Ġis`` for " is"), as vLLM's ``/tokenize`` answers ``token_strs``."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


# -- what vLLM 0.32 hands the chat template -----------------------------------------------------
#
# ``build_chat_params``, ``preprocess_chat``, ``validate_chat_template`` (renderers/
# online_renderer.py, entrypoints/openai/chat_completion/protocol.py) and
# ``safe_apply_chat_template`` / ``resolve_chat_template_kwargs`` (renderers/hf.py), with vLLM's
# defaults (no --trust-request-chat-template, no server-side template kwargs):
#
# 1. a request's own template, ``chat_template`` or ``chat_template_kwargs.chat_template`` not
#    null, is refused (400);
# 2. the request's ``add_generation_prompt`` (default true), ``continue_final_message`` (default
#    false), ``documents`` and ``reasoning_effort`` (with ``enable_thinking`` = effort != "none"
#    unless the kwargs set it) override ``chat_template_kwargs``; the kwargs' ``tools`` override
#    the request's (which vLLM's pydantic model re-serialises: ``_vllm_tool``); a value of null
#    or "auto" is dropped, as if absent (``merge_kwargs``);
# 3. the parameters of ``apply_chat_template`` are its own, not template variables: ``tokenize``
#    is refused (vLLM 0.32 means to refuse it but binds it first: with ``truncation`` and
#    ``max_length`` it would then cut the prompt vLLM holds below what the gateway counts);
#    ``return_assistant_tokens_mask`` fails there (it needs ``tokenize``), and ``conversation``
#    collides with vLLM's own argument (both 400 in vLLM); ``padding``, ``truncation``,
#    ``max_length``, ``return_tensors``, ``return_dict`` and ``tokenizer_kwargs`` do nothing
#    without ``tokenize``;
# 4. every other key is a template variable, passed when the template reads it
#    (``ChatTemplate.render``).

_UNSET = (None, "auto")
_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set."
    " Refused request with untrusted chat template.")
_WITHOUT_EFFECT = frozenset({"padding", "truncation", "max_length", "return_tensors",
                             "return_dict", "tokenizer_kwargs"})
_COLLIDING = frozenset({"conversation", "tokenizer", "model_config"})
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# pydantic's lax booleans, which vLLM's request model accepts.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """What the chat template is given besides the messages."""

    add_generation_prompt: bool
    continue_final_message: bool
    tools: Any = None
    documents: Any = None
    variables: Mapping[str, Any] = field(default_factory=dict)


_PLAIN = {(g, c): TemplateOptions(g, c) for g in (True, False) for c in (True, False)}
_OPTION_FIELDS = frozenset({"chat_template_kwargs", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tools", "documents", "reasoning_effort"})
"""The fields of a chat request ``template_options`` reads: absent, its defaults apply."""


def template_options(body: Mapping[str, Any]) -> TemplateOptions:
    """The template options of a chat request ``body``, by vLLM 0.32's rules (above);
    ``TemplateOptionError`` for what vLLM refuses."""
    if _OPTION_FIELDS.isdisjoint(body):
        # the usual request names none of them: one C call instead of seven lookups
        return _PLAIN[True, False]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TemplateOptionError("`chat_template_kwargs` must be an object",
                                  "chat_template_kwargs")
    if body.get("chat_template") is not None or (kwargs and kwargs.get("chat_template") is not None):
        raise TemplateOptionError(_UNTRUSTED_TEMPLATE, "chat_template")
    add_generation = _lax_bool(body.get("add_generation_prompt", True), "add_generation_prompt")
    continue_final = _lax_bool(body.get("continue_final_message", False),
                               "continue_final_message")
    tools, documents, effort = body.get("tools"), body.get("documents"), body.get("reasoning_effort")
    if not kwargs and tools is None and documents is None and effort is None:
        return _PLAIN[add_generation, continue_final]  # the usual request: nothing to resolve
    merged = {**(kwargs or {}), "tools": None if tools is None else _vllm_tools(tools)}
    if kwargs and kwargs.get("tools") not in _UNSET:
        merged["tools"] = kwargs["tools"]
    if documents is not None:
        merged["documents"] = _vllm_documents(documents)
    if effort is not None:
        if not (isinstance(effort, str) and effort in _REASONING_EFFORTS):
            raise TemplateOptionError(
                f"`reasoning_effort` must be one of {sorted(_REASONING_EFFORTS)}",
                "reasoning_effort")
        merged["reasoning_effort"] = effort
        if not (kwargs and "enable_thinking" in kwargs):
            merged["enable_thinking"] = effort != "none"
    variables = {k: v for k, v in merged.items() if v not in _UNSET}
    if variables.get("tokenize"):
        raise TemplateOptionError(
            "Found unexpected chat template kwargs from request: {'tokenize'}",
            "chat_template_kwargs")
    if variables.get("return_assistant_tokens_mask"):
        raise TemplateOptionError(
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`",
            "chat_template_kwargs")
    colliding = sorted(_COLLIDING.intersection(variables))
    if colliding:
        raise TemplateOptionError(
            f"chat_template_kwargs may not set {colliding[0]!r}: it is vLLM's own argument",
            "chat_template_kwargs")
    for name in ("tokenize", "return_assistant_tokens_mask", "add_generation_prompt",
                 "continue_final_message", *_WITHOUT_EFFECT):
        variables.pop(name, None)
    return TemplateOptions(add_generation, continue_final, variables.pop("tools", None),
                           variables.pop("documents", None), variables)


def _lax_bool(value: Any, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise TemplateOptionError(f"`{param}` must be a boolean", param)


def _vllm_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to
    the template: ``type``, ``function`` (``name``, ``description``, ``parameters``, then
    ``strict`` and ``defer_loading`` when set) and ``defer_loading`` when set; other keys
    dropped."""
    if not isinstance(tools, list):
        raise TemplateOptionError("`tools` must be an array", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (not isinstance(tool, Mapping) or tool.get("type", "function") != "function"
                or not isinstance(function, Mapping) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("description"), str | None)
                or not isinstance(function.get("parameters"), dict | None)):
            raise TemplateOptionError(
                f"tools[{i}] must be an object of type `function` with a `function` object"
                " (a string `name`, a string `description` and an object `parameters`)", param)
        dumped: dict[str, Any] = {"name": function["name"],
                                  "description": function.get("description"),
                                  "parameters": function.get("parameters")}
        deferred = _optional_bool(tool.get("defer_loading"), f"{param}.defer_loading")
        for key in ("strict", "defer_loading"):
            value = _optional_bool(function.get(key), f"{param}.function.{key}")
            if key == "defer_loading" and value is None:
                value = deferred  # vLLM's _propagate_defer_loading
            if value is not None:
                dumped[key] = value
        out.append({"type": "function", "function": dumped}
                   | ({} if deferred is None else {"defer_loading": deferred}))
    return out


def _optional_bool(value: Any, param: str) -> bool | None:
    return None if value is None else _lax_bool(value, param)


def _vllm_documents(documents: Any) -> Any:
    """vLLM's ``documents: list[dict[str, str]]``."""
    if not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
            for d in documents)):
        raise TemplateOptionError("`documents` must be an array of objects of strings",
                                  "documents")
    return documents


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, or a list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


class HFTokenizer:
    """The model's own Hugging Face tokenizer and chat template.

    Text encoded without special tokens (every chat prompt) goes through a ``SegmentEncoder``
    (``gateway.prompt.segments``): the same ids, but only text not seen in a recent prompt is
    encoded. ``segment_cache_tokens=0``, or a tokenizer whose configuration makes that unsafe,
    encodes whole prompts. ``longest_token_chars`` is the floor's divisor
    (``gateway.prompt.limits``), None where the floor would be unsound (logged).
    """

    def __init__(self, source: str, hf_tokenizer: Any, *,
                 segment_cache_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self._source = source
        self._tok = hf_tokenizer
        self._template = ChatTemplate(hf_tokenizer)
        self._segments = (SegmentEncoder.for_tokenizer(hf_tokenizer, name=source,
                                                       max_cached_tokens=segment_cache_tokens)
                          if segment_cache_tokens > 0 else None)
        self.longest_token_chars = _longest_token_chars(hf_tokenizer, source)

    @classmethod
    def load(cls, source: str, *, local_files_only: bool = False) -> HFTokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
        return cls(source, tok)

    @property
    def incremental(self) -> bool:
        """Whether text without special tokens is encoded piece by piece from the cache."""
        return self._segments is not None

    @property
    def name(self) -> str:
        return self._source

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any], *,
        max_tokens: int | None = None, deadline: Deadline | None = None,
    ) -> list[int]:
        opts = template_options(options)
        conversation = [_normalise_message(m) for m in messages]
        try:
            text = self._template.render(
                conversation,
                tools=opts.tools,
                documents=opts.documents,
                add_generation_prompt=opts.add_generation_prompt
                and not opts.continue_final_message,
                continue_final_message=opts.continue_final_message,
                variables=opts.variables,
                deadline=deadline,
            )
        except PromptTimeoutError:
            raise
        except Exception as exc:  # jinja errors, template raise_exception(), bad variables
            raise PromptTooComplexError(f"chat template failed: {exc}") from exc
        return self.encode_text(text, options.get("add_special_tokens", False) is True,
                                max_tokens=max_tokens, deadline=deadline)

    def encode_text(self, text: str, add_special_tokens: bool = True, *,
                    max_tokens: int | None = None, deadline: Deadline | None = None) -> list[int]:
        check_length(text, self.longest_token_chars, max_tokens)
        if deadline is not None:
            deadline.check()
        if self._segments is not None and not add_special_tokens:
            return self._segments.encode(text)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, text_pair: str, *, max_tokens: int | None = None,
                    deadline: Deadline | None = None) -> list[int]:
        check_length(text + text_pair, self.longest_token_chars, max_tokens)
        if deadline is not None:
            deadline.check()
        return list(self._tok(text, text_pair=text_pair, add_special_tokens=True)["input_ids"])

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(token_ids))]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids)))


def _longest_token_chars(hf_tokenizer: Any, source: str) -> int | None:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        found: int | str = "not a tokenizers-backed (fast) tokenizer"
    else:
        found = longest_token_chars(json.loads(backend.to_str()),
                                    backend.get_vocab(with_added_tokens=True),
                                    backend.get_added_tokens_decoder().values())
    if isinstance(found, str):
        log.info("tokenizer %s: no early length check before tokenizing (%s)", source, found)
        return None
    return found


def _normalise_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    # vLLM flattens text-only content parts into one string before rendering the template. A
    # message without parts is used as it is (no copy: nothing after this writes to it).
    content = message.get("content")
    if not isinstance(content, list):
        return message
    out = dict(message)
    out["content"] = message_text(content)
    return out


# A run of ASCII letters/digits/underscores, or of ASCII whitespace, is one piece up to 8
# characters and is cut in 4-character pieces beyond (the lookbehind makes "up to 8" apply to
# the whole run only); every other character (punctuation, anything non-ASCII) is a piece.
_WORD = re.compile(
    r"(?<![A-Za-z0-9_])[A-Za-z0-9_]{1,8}(?![A-Za-z0-9_])|[A-Za-z0-9_]{1,4}"
    r"|(?<![ \t\n\r\f\v])[ \t\n\r\f\v]{1,8}(?![ \t\n\r\f\v])|[ \t\n\r\f\v]{1,4}"
    r"|[^A-Za-z0-9_ \t\n\r\f\v]")


class SimpleTokenizer:
    """A deterministic word/punctuation tokenizer with a fixed vocabulary size.

    The rule (``pieces``): a word of ASCII letters, digits and underscores, or a run of ASCII
    whitespace, is one token up to 8 characters; a longer run is cut into 4-character tokens,
    as BPE cuts a rare long word into sub-words of about 4 bytes; every punctuation mark and
    every non-ASCII character (at most 4 bytes in UTF-8) is a token of its own. So no token
    covers more than 8 bytes, and a 10 MB word is 2.5M tokens, not one. Each token's id is a
    CRC32 of its text; ``decode`` cannot invert that, so it returns placeholder words. It exists
    so the simulator and the demo need no model files. Against a BPE tokenizer (Llama 3):
    English prose counts about twice as many tokens (a space is a token of its own here, about
    2 tokens per word), a long word or a run of random letters about as many, CJK text about as
    many (one per character). So the demo refuses prose as too long at about half the length
    real vLLM would, and never serves a prompt a real tokenizer would count far longer.
    """

    # Final: class constants, readable on the class, also when compiled (mypyc makes a plain
    # class attribute an instance slot)
    VOCAB_SIZE: Final = 32000
    CACHE_ENTRIES: Final = 16_384  # ~2.5 MB; ids are cheap to recompute (crc32)
    BOS: Final = 1
    EOS: Final = 2
    _FIRST_ID: Final = 16  # ids below are reserved for specials
    # literal ids, not BOS and EOS: a compiled class body (mypyc) cannot read its own names
    _SPECIAL_STRINGS: ClassVar[Mapping[int, str]] = {1: "<s>", 2: "</s>"}

    def __init__(self) -> None:
        self._cache: dict[str, int] = {}

    @property
    def name(self) -> str:
        return SIMPLE

    def _id(self, piece: str) -> int:
        tid = self._cache.get(piece)
        if tid is None:
            tid = self._FIRST_ID + zlib.crc32(piece.encode()) % (self.VOCAB_SIZE - self._FIRST_ID)
            if len(self._cache) >= self.CACHE_ENTRIES:
                self._cache.clear()  # bounded memory; the common words come back at once
            self._cache[piece] = tid
        return tid

    @staticmethod
    def pieces(text: str) -> list[str]:
        """The text of each token of ``text`` (the class docstring's rule), in order."""
        return _WORD.findall(text)

    def encode_text(self, text: str, add_special_tokens: bool = True, *,
                    max_tokens: int | None = None, deadline: Deadline | None = None) -> list[int]:
        """``max_tokens`` is not checked early (the router judges the exact count)."""
        if deadline is not None:
            deadline.check()
        ids = [self._id(p) for p in _WORD.findall(text)]
        return [self.BOS, *ids] if add_special_tokens else ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
        opts = template_options(options)
        add_generation, continue_final = opts.add_generation_prompt, opts.continue_final_message
        parts: list[str] = []
        for i, m in enumerate(messages):
            role = str(m.get("role", "user"))
            text = message_text(m.get("content"))
            last = i == len(messages) - 1
            parts.append(f"<|{role}|>\n{text}" + ("" if continue_final and last else "\n<|end|>\n"))
        if add_generation and not continue_final:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any], *,
        max_tokens: int | None = None, deadline: Deadline | None = None,
    ) -> list[int]:
        """BOS (as a template writes it) + the rendered text; ``add_special_tokens: true`` in
        ``options`` encodes the text with BOS once more, as vLLM does with a real template."""
        text = self.render_chat(messages, options)
        add_special = options.get("add_special_tokens", False) is True
        return [self.BOS, *self.encode_text(text, add_special, max_tokens=max_tokens,
                                            deadline=deadline)]

    def encode_pair(self, text: str, text_pair: str, *, max_tokens: int | None = None,
                    deadline: Deadline | None = None) -> list[int]:
        """``BOS text EOS text_pair EOS``, the shape of a BERT pair (``[CLS] A [SEP] B [SEP]``)."""
        first = self.encode_text(text, True, max_tokens=max_tokens, deadline=deadline)
        return [*first, self.EOS, *self.encode_text(text_pair, False), self.EOS]

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """``<s>``, ``</s>``, ``<special_N>`` for the reserved ids, else ``decode``'s placeholder
        word: the text of an id is not kept (ids are hashes)."""
        return [self._SPECIAL_STRINGS.get(t, f"<special_{t}>") if t < self._FIRST_ID
                else f"w{t % 997}" for t in token_ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(f"w{t % 997}" for t in token_ids if t >= self._FIRST_ID)


def load_tokenizer(source: str) -> PromptTokenizer:
    """``"simple"`` -> SimpleTokenizer; anything else is a local directory or a model id."""
    if source == SIMPLE:
        return SimpleTokenizer()
    return HFTokenizer.load(source)
