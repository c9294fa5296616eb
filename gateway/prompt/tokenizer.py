"""Prompt -> token ids, exactly as vLLM renders them.

vLLM (0.32) tokenizes an OpenAI request like this, and so does this module:

* chat: the model's chat template (compiled once: ``gateway.prompt.template``) is rendered to
  text with ``add_generation_prompt`` (default true), ``continue_final_message`` (default false)
  and any ``chat_template_kwargs``; the text is encoded with ``add_special_tokens=False`` because
  the template writes BOS itself;
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
(``python -m gateway.bench.tokenize`` measures both).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.prompt.segments import DEFAULT_MAX_CACHED_TOKENS, SegmentEncoder
from gateway.prompt.template import ChatTemplate

SIMPLE = "simple"


class PromptTooComplexError(ValueError):
    """The request's messages cannot be rendered by the chat template."""


class PromptTokenizer(Protocol):
    """What the gateway (and the simulator) need from a tokenizer."""

    @property
    def name(self) -> str: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
    ) -> list[int]:
        """Token ids of a chat request; ``options`` is the request body (template flags)."""
        ...

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def _template_options(options: Mapping[str, Any]) -> tuple[bool, bool, dict[str, Any]]:
    continue_final = bool(options.get("continue_final_message", False))
    add_generation = bool(options.get("add_generation_prompt", not continue_final))
    kwargs = options.get("chat_template_kwargs")
    return add_generation, continue_final, dict(kwargs) if isinstance(kwargs, Mapping) else {}


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
    encodes whole prompts.
    """

    def __init__(self, source: str, hf_tokenizer: Any, *,
                 segment_cache_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self._source = source
        self._tok = hf_tokenizer
        self._template = ChatTemplate(hf_tokenizer)
        self._segments = (SegmentEncoder.for_tokenizer(hf_tokenizer, name=source,
                                                       max_cached_tokens=segment_cache_tokens)
                          if segment_cache_tokens > 0 else None)

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
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
    ) -> list[int]:
        add_generation, continue_final, kwargs = _template_options(options)
        conversation = [_normalise_message(m) for m in messages]
        tools = options.get("tools")
        try:
            text = self._template.render(
                conversation,
                tools=tools if isinstance(tools, list) else None,
                add_generation_prompt=add_generation and not continue_final,
                continue_final_message=continue_final,
                kwargs=kwargs,
            )
        except Exception as exc:  # jinja errors, template raise_exception(), bad kwargs
            raise PromptTooComplexError(f"chat template failed: {exc}") from exc
        return self.encode_text(text, options.get("add_special_tokens", False) is True)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._segments is not None and not add_special_tokens:
            return self._segments.encode(text)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids)))


def _normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM flattens text-only content parts into one string before rendering the template.
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = message_text(content)
    return out


_WORD = re.compile(r"\w+|[^\w\s]|\s+")


class SimpleTokenizer:
    """A deterministic word/punctuation tokenizer with a fixed vocabulary size.

    Every word, punctuation mark and run of whitespace is one token whose id is a CRC32 of its
    text; ``decode`` cannot invert that, so it returns placeholder words. It exists so the
    simulator and the demo need no model files; token counts are roughly those of a real BPE
    tokenizer on English text (about 1.3 tokens per word).
    """

    VOCAB_SIZE = 32000
    CACHE_ENTRIES = 16_384  # ~2.5 MB; ids are cheap to recompute (crc32)
    BOS = 1
    EOS = 2
    _FIRST_ID = 16  # ids below are reserved for specials

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

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(p) for p in _WORD.findall(text)]
        return [self.BOS, *ids] if add_special_tokens else ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
        add_generation, continue_final, _ = _template_options(options)
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
        self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
    ) -> list[int]:
        return [self.BOS, *self.encode_text(self.render_chat(messages, options), False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(f"w{t % 997}" for t in token_ids if t >= self._FIRST_ID)


def load_tokenizer(source: str) -> PromptTokenizer:
    """``"simple"`` -> SimpleTokenizer; anything else is a local directory or a model id."""
    if source == SIMPLE:
        return SimpleTokenizer()
    return HFTokenizer.load(source)
