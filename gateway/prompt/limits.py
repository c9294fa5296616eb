"""What bounds the work of turning one prompt into token ids: a token floor and a deadline.

A request whose prompt cannot fit any pool is refused with 400 ``context_length_exceeded``; the
router decides that from the exact count, but 10 MB of text takes ~12 s to tokenize before that
answer. So the text is measured first, against a sound lower bound on its token count:

    tokens(text) >= ceil(len(text) / longest_token_chars)

where ``longest_token_chars`` is the longest vocabulary entry (added tokens included), in
characters, computed once at load (``longest_token_chars``). It holds when every character of
the text ends up inside some token whose string has at least as many characters as it covered:

* no normalizer, or only ones that never shorten the text (``Prepend``; ``Replace`` of a
  string by one at least as long): NFC, NFKC, ``Strip``, ``StripAccents`` ... can shorten it;
* a pre-tokenizer that keeps every character: ``ByteLevel`` (each byte becomes one character,
  and a character is at least one byte), ``Metaspace`` (a space becomes one ``▁``), ``Split``
  unless its behaviour is ``removed``, ``Digits``, ``Punctuation``, ``UnicodeScripts``,
  ``FixedLength``, a ``Sequence`` of them; ``Whitespace`` and the like drop whitespace;
* a model that cannot swallow a run of text into one token: BPE or Unigram with
  ``byte_fallback`` (``<0x41>`` covers one byte with six characters), or BPE behind ``ByteLevel``
  whose 256 byte characters are all in the vocabulary; not WordPiece (a word longer than its
  limit is one ``[UNK]``) nor a fused unknown token;
* no added token with ``lstrip``/``rstrip`` (each absorbs any run of whitespace beside it).

Elsewhere ``longest_token_chars`` says why not, the tokenizer logs it at load, and every prompt
is tokenized (the deadline below still bounds it). The check costs one ``len`` and a multiply.
The bound is loose by design (the tiny model: 13 characters per token, English ~4): it stops
what is certainly too long, and the router judges the rest on the exact count.

The deadline (``limits.tokenize_timeout_s``) bounds rendering and tokenizing one prompt. A
Python thread cannot be killed, so it is cooperative: the template is rendered chunk by chunk
(``Template.generate``) and the deadline checked after each chunk, and again before the text is
encoded. A thread past its deadline raises ``PromptTimeoutError`` at its next check and frees
its slot of the tokenizing pool; nothing is abandoned still running. An encode already started
runs to its end (the Rust encoder cannot be interrupted), but only on text the floor above let
through, so its time is bounded by the largest pool's context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Pre-tokenizers that keep every character of the text (``Split`` only unless it removes).
_KEEPING_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "FixedLength",
})
_BYTE_LEVEL_ALPHABET_SIZE = 256


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's ``truncate_prompt_tokens`` (keep that many of a prompt's tokens; -1: as many as
    the model's length allows) and ``truncation_side`` (``left`` keeps the last tokens, right
    the first; vLLM's default is left for generation models, right for pooling ones). A
    request that truncates is never refused as too long before it is encoded: any length of
    text may be cut to fit."""

    tokens: int
    left: bool = False

    def apply(self, ids: list[int], model_tokens: int) -> list[int]:
        """``ids`` cut as vLLM cuts them; ``model_tokens``: what -1 keeps."""
        keep = model_tokens if self.tokens < 0 else self.tokens
        if keep >= len(ids):
            return ids
        return ids[len(ids) - keep:] if self.left else ids[:keep]


class PromptTooLongError(ValueError):
    """The prompt certainly holds more tokens than the largest pool leaves it."""

    def __init__(self, min_tokens: int, max_tokens: int) -> None:
        super().__init__(
            "the request's max output tokens leave no room for a prompt in the largest pool;"
            " lower max_tokens" if max_tokens < 0 else
            f"the prompt holds at least {min_tokens} tokens, more than the {max_tokens} the"
            " largest pool leaves it after the request's max output tokens; shorten the prompt"
            " or max_tokens")
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens


class PromptTimeoutError(ValueError):
    """Rendering and tokenizing the prompt took longer than ``limits.tokenize_timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"rendering and tokenizing the prompt took longer than the gateway's limit of"
            f" {timeout_s:g} s (limits.tokenize_timeout_s); send a shorter or simpler prompt")
        self.timeout_s = timeout_s


@dataclass(frozen=True, slots=True, init=False)
class Deadline:
    """When the work on one prompt must stop (``time.monotonic()``)."""

    at: float
    timeout_s: float

    def __init__(self, at: float, timeout_s: float) -> None:
        object.__setattr__(self, "at", at)
        object.__setattr__(self, "timeout_s", timeout_s)

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        return cls(time.monotonic() + timeout_s, timeout_s)

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise PromptTimeoutError(self.timeout_s)


def check_room(max_tokens: int | None) -> None:
    """Raise ``PromptTooLongError`` when no prompt fits ``max_tokens``, whatever its length (so
    every tokenizer, even one without a floor, refuses before tokenizing)."""
    if max_tokens is not None and max_tokens < 0:
        raise PromptTooLongError(0, max_tokens)


def check_length(text: str, longest_token_chars: int | None, max_tokens: int | None) -> None:
    """Raise ``PromptTooLongError`` when ``text`` certainly holds more than ``max_tokens``."""
    if (max_tokens is not None and longest_token_chars is not None
            and len(text) > max_tokens * longest_token_chars):
        raise PromptTooLongError(math.ceil(len(text) / longest_token_chars), max_tokens)


def longest_token_chars(config: Mapping[str, Any], vocab: Mapping[str, int],
                        added: Iterable[Any]) -> int | str:
    """The longest entry of ``vocab`` in characters, or why the floor above is unsound here.

    ``config``: the tokenizer's JSON (``Tokenizer.to_str()``); ``vocab``: with added tokens;
    ``added``: its ``tokenizers.AddedToken``s.
    """
    stripping = sorted(t.content for t in added if t.lstrip or t.rstrip)
    if stripping:
        return f"added tokens absorb whitespace (lstrip/rstrip): {stripping[:3]}"
    shortening = [n for n in _nodes(config.get("normalizer"), "normalizers")
                  if not _lengthening_normalizer(n)]
    if shortening:
        return f"a normalizer may shorten the text: {shortening[0].get('type')}"
    pre = list(_nodes(config.get("pre_tokenizer"), "pretokenizers"))
    dropping = [n.get("type") for n in pre if n.get("type") not in _KEEPING_PRE_TOKENIZERS
                or str(n.get("behavior", "")).lower() == "removed"]
    if dropping:
        return f"a pre-tokenizer may drop text: {dropping[0]}"
    model = config.get("model") or {}
    byte_level = any(n.get("type") == "ByteLevel" for n in pre)
    if model.get("type") not in ("BPE", "Unigram"):
        return f"a {model.get('type')} model may cover a long run of text with one token"
    if not model.get("byte_fallback") and not (
            model.get("type") == "BPE" and byte_level and _has_byte_alphabet(vocab)):
        return "characters outside the vocabulary may be dropped or fused into one token"
    return max((len(token) for token in vocab), default=1) or 1


def _nodes(node: Any, children: str) -> Iterable[Mapping[str, Any]]:
    """A normalizer or pre-tokenizer and, for a ``Sequence``, its members, flattened."""
    if isinstance(node, Mapping):
        if node.get("type") == "Sequence":
            for child in node.get(children) or ():
                yield from _nodes(child, children)
        else:
            yield node


def _lengthening_normalizer(node: Mapping[str, Any]) -> bool:
    if node.get("type") == "Prepend":
        return True
    if node.get("type") == "Replace":
        pattern = node.get("pattern") or {}
        return ("String" in pattern and isinstance(node.get("content"), str)
                and len(node["content"]) >= len(pattern["String"]))
    return False


def _has_byte_alphabet(vocab: Mapping[str, int]) -> bool:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    return len(alphabet) == _BYTE_LEVEL_ALPHABET_SIZE and all(c in vocab for c in alphabet)
