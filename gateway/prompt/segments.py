"""Incremental exact tokenization: the token ids of the text between added tokens, cached.

A chat template puts added (special) tokens between messages, and a Hugging Face ``tokenizers``
pipeline splits the text on its added tokens before anything else: the normalizer, the
pre-tokenizer and the model then run on each piece between them on its own. So the ids of a
piece depend only on its text (one exception below), and turn N of a growing conversation
repeats every piece of turn N-1: only its new text needs the model.

Steps, per prompt (``SegmentEncoder.encode``):

1. split the text on the added tokens exactly as ``tokenizers`` does (``AddedVocabulary``): first
   the tokens with ``normalized=False`` on the raw text, leftmost-longest, honouring ``lstrip`` /
   ``rstrip`` (they absorb the Unicode whitespace beside them); then, inside each remaining
   piece, the ``normalized=True`` tokens, which match the normalized text: without a normalizer
   that is the raw text and this module splits on them too, with one each piece is left whole
   (the tokenizer splits it the same way when it encodes the piece alone);
2. look each piece up in a bounded LRU keyed by its text (a dict: Python hashes the text, an
   equal text is verified, so there are no collisions); encode the misses in one
   ``encode_batch_fast`` call (which releases the GIL: the event loop runs meanwhile);
3. concatenate the ids of pieces and added tokens.

The exception: a ``Metaspace`` pre-tokenizer with ``prepend_scheme="first"`` prepends its
``▁`` only to the piece at offset 0 of the whole text. That piece is encoded with the tokenizer
as it is (and cached under a key of its own); every other piece with a copy whose scheme is
``"never"``, which is what ``"first"`` does to them.

Unsafe configurations are detected at load time (``unsafe_reason``) and the caller keeps
tokenizing whole prompts: a tokenizer that is not ``tokenizers``-backed; ``split_special_tokens``
(special tokens are then text, and matches are skipped mid-scan); an added token with
``single_word`` (its match depends on the characters around it); an added token that starts
with whitespace next to one with ``rstrip`` (the scan resumes inside the stripped whitespace);
BPE dropout (ids are random); a pre-tokenizer type this module does not know to be piece-local.
Prompts encoded with ``add_special_tokens=True`` always go whole (the post-processor adds
tokens around the whole sequence); the chat path encodes with ``False``, as vLLM does.

Cost: one regex scan of the text (~0.2 ms for a 128K-token prompt), one dict lookup per piece,
and a list extend of the cached ids (~0.3 ms for 128K ids), against ~140 ms for the whole
prompt; ``python -m gateway.bench.tokenize`` measures both, with ids compared. Memory: the
cache is bounded by its number of token ids; ids are stored as tuples of shared int objects
(one per vocabulary entry), so an id costs 8 bytes plus about 4 bytes of key text.
"""

from __future__ import annotations

import json
import logging
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.gil import SLICE_ITEMS, yield_gil

log = logging.getLogger(__name__)

DEFAULT_MAX_CACHED_TOKENS = 2_000_000  # ~16 MB of ids + ~8 MB of keys: fifteen 128K conversations

# What Rust's regex calls \s (Unicode White_Space), which AddedToken lstrip/rstrip absorb. Python's
# str.isspace() differs (it is true for U+001C..U+001F), so the set is spelled out.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000"
)
# Pre-tokenizers that work on each piece alone (Metaspace: see the module docstring).
_PIECE_LOCAL_PRE_TOKENIZERS = frozenset({
    "BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "FixedLength", "Metaspace",
    "Punctuation", "Sequence", "Split", "UnicodeScripts", "Whitespace", "WhitespaceSplit",
})


@dataclass(frozen=True)
class AddedTokenSplitter:
    """One of ``tokenizers``' two added-token scans: leftmost-longest, then lstrip/rstrip."""

    pattern: re.Pattern[str]
    ids: Mapping[str, int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]

    @classmethod
    def of(cls, tokens: list[Any], backend: Any) -> AddedTokenSplitter | None:
        """``tokens``: ``tokenizers.AddedToken``s of ``backend``; None when there are none."""
        if not tokens:
            return None
        # Alternatives longest first: at the leftmost position that matches, re takes the first
        # alternative that matches, hence the longest (aho-corasick's LeftmostLongest).
        contents = sorted({t.content for t in tokens}, key=lambda c: (-len(c), c))
        return cls(
            pattern=re.compile("|".join(re.escape(c) for c in contents)),
            ids={c: int(backend.token_to_id(c)) for c in contents},
            lstrip=frozenset(t.content for t in tokens if t.lstrip),
            rstrip=frozenset(t.content for t in tokens if t.rstrip),
        )

    def split(self, text: str, begin: int, end: int) -> list[int | tuple[int, int]]:
        """``text[begin:end]`` as added-token ids and ``(start, stop)`` spans of the text between."""
        out: list[int | tuple[int, int]] = []
        offset = begin
        for match in self.pattern.finditer(text, begin, end):
            content = match.group()
            start, stop = match.span()
            if content in self.lstrip:
                while start > offset and text[start - 1] in _WHITESPACE:
                    start -= 1
            if content in self.rstrip:
                while stop < end and text[stop] in _WHITESPACE:
                    stop += 1
            if offset < start:
                out.append((offset, start))
            out.append(self.ids[content])
            offset = stop
        if offset < end:
            out.append((offset, end))
        return out


def unsafe_reason(config: Mapping[str, Any], added: Mapping[int, Any],
                  split_special_tokens: bool) -> str | None:
    """Why caching pieces could change the ids of this tokenizer, or None when it cannot.

    ``config``: the tokenizer's JSON (``Tokenizer.to_str()``); ``added``: its added tokens.
    """
    if split_special_tokens:
        return "split_special_tokens is set"
    single = sorted(t.content for t in added.values() if t.single_word)
    if single:
        return f"added tokens with single_word: {single[:3]}"
    if any(t.rstrip for t in added.values()):
        leading = sorted(t.content for t in added.values() if t.content[:1] in _WHITESPACE)
        if leading:
            return f"added tokens that start with whitespace, next to rstrip tokens: {leading[:3]}"
    model = config.get("model") or {}
    if model.get("dropout"):
        return "BPE dropout"
    unknown = sorted(set(_pre_tokenizer_types(config.get("pre_tokenizer"))) -
                     _PIECE_LOCAL_PRE_TOKENIZERS)
    if unknown:
        return f"pre-tokenizers not known to be piece-local: {unknown}"
    return None


def _pre_tokenizer_types(node: Any) -> Iterable[str]:
    if isinstance(node, Mapping):
        if isinstance(node.get("type"), str):
            yield node["type"]
        for child in node.get("pretokenizers") or ():
            yield from _pre_tokenizer_types(child)


def _prepend_never(node: Any) -> bool:
    """Turn every Metaspace ``prepend_scheme="first"`` below ``node`` into ``"never"``."""
    changed = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            changed = True
        for child in node.get("pretokenizers") or ():
            changed = _prepend_never(child) or changed
    return changed


class SegmentEncoder:
    """Exact ``encode(text, add_special_tokens=False)`` of a ``tokenizers.Tokenizer``, by pieces.

    Thread-safe: the gateway encodes on the event loop and in its tokenization pool at once.
    """

    def __init__(self, backend: Any, *, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        """``backend``: a ``tokenizers.Tokenizer`` that ``unsafe_reason`` found safe."""
        from tokenizers import Tokenizer

        config = json.loads(backend.to_str())
        # Copies, so truncation/padding set on the original (transformers sets them per call)
        # cannot reach these.
        self._first = Tokenizer.from_str(json.dumps(config))
        self._first_differs = _prepend_never(config.get("pre_tokenizer"))
        self._rest = Tokenizer.from_str(json.dumps(config)) if self._first_differs else self._first
        for tok in (self._first, self._rest):
            tok.no_truncation()
            tok.no_padding()
        added = list(backend.get_added_tokens_decoder().values())
        self._raw = AddedTokenSplitter.of([t for t in added if not t.normalized], backend)
        # Normalized tokens match the normalized text: without a normalizer that is the raw text.
        self._normalized = (AddedTokenSplitter.of([t for t in added if t.normalized], backend)
                            if config.get("normalizer") is None else None)
        vocab = backend.get_vocab(with_added_tokens=True)
        self._ints = tuple(range(max(vocab.values(), default=0) + 1))
        self._max_tokens = max_cached_tokens
        self._cache: OrderedDict[str | tuple[str], tuple[int, ...]] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any, *, name: str,
                      max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> SegmentEncoder | None:
        """The encoder for a ``transformers`` tokenizer, or None (logged) where it would be unsafe."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            reason: str | None = "not a tokenizers-backed (fast) tokenizer"
        else:
            reason = unsafe_reason(json.loads(backend.to_str()), backend.get_added_tokens_decoder(),
                                   bool(getattr(hf_tokenizer, "split_special_tokens", False)))
        if reason is not None:
            log.info("tokenizer %s: whole-prompt tokenization (%s)", name, reason)
            return None
        return cls(backend, max_cached_tokens=max_cached_tokens)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    def pieces(self, text: str) -> list[int | str | tuple[str]]:
        """``text`` as added-token ids and the text between them. Where Metaspace treats the
        piece at offset 0 apart, that piece is a 1-tuple: a cache key of its own."""
        spans = (self._raw.split(text, 0, len(text)) if self._raw is not None
                 else [(0, len(text))] if text else [])
        if self._normalized is not None:
            normalized = self._normalized
            spans = [part for span in spans
                     for part in ([span] if isinstance(span, int) else normalized.split(text, *span))]
        out: list[int | str | tuple[str]] = []
        for span in spans:
            if isinstance(span, int):
                out.append(span)
            elif span[0] == 0 and self._first_differs:
                out.append((text[: span[1]],))
            else:
                out.append(text[span[0]:span[1]])
        return out

    def encode(self, text: str) -> list[int]:
        pieces = self.pieces(text)
        found: dict[str | tuple[str], tuple[int, ...]] = {}
        with self._lock:
            for piece in pieces:
                if not isinstance(piece, int) and piece not in found:
                    ids = self._cache.get(piece)
                    if ids is not None:
                        self._cache.move_to_end(piece)
                        found[piece] = ids
        misses = [p for p in dict.fromkeys(p for p in pieces if not isinstance(p, int))
                  if p not in found]
        if misses:
            found.update(self._encode_misses(misses))
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                out.extend(found[piece])
        return out

    def _shared(self, ids: list[int]) -> tuple[int, ...]:
        """``ids`` as a tuple of the shared int objects (module docstring, "Memory").
        ``itemgetter`` picks them in one C loop: 2.5 ms for 193K ids where ``map`` of the
        tuple's ``__getitem__`` took 8-12, all of it holding the GIL, so the event loop waited
        as long for every long prompt a tokenizing thread encoded (issue 11, isolation); past
        ``gateway.gil.SLICE_ITEMS`` ids, a slice at a time with ``yield_gil`` in between."""
        n = len(ids)
        if n > SLICE_ITEMS:  # a slice at a time, the event loop given the GIL in between
            ints, picked = self._ints, []
            for start in range(0, n, SLICE_ITEMS):
                if start:
                    yield_gil()
                picked += operator.itemgetter(*ids[start:start + SLICE_ITEMS])(ints)
            return tuple(picked)
        if n > 1:
            shared: tuple[int, ...] = operator.itemgetter(*ids)(self._ints)
            return shared
        return (self._ints[ids[0]],) if ids else ()

    def _encode_misses(self, misses: list[str | tuple[str]]) -> dict[str | tuple[str], tuple[int, ...]]:
        shared = self._shared
        rest = [p for p in misses if isinstance(p, str)]
        encoded: dict[str | tuple[str], tuple[int, ...]] = {}
        if rest:
            for piece, enc in zip(rest, self._rest.encode_batch_fast(rest, add_special_tokens=False),
                                  strict=True):
                encoded[piece] = shared(enc.ids)
        for first in (p for p in misses if isinstance(p, tuple)):
            enc = self._first.encode_batch_fast([first[0]], add_special_tokens=False)[0]
            encoded[first] = shared(enc.ids)
        with self._lock:
            for key, ids in encoded.items():
                if len(ids) > self._max_tokens or key in self._cache:
                    continue
                self._cache[key] = ids
                self._cached_tokens += len(ids)
            while self._cached_tokens > self._max_tokens:
                self._cached_tokens -= len(self._cache.popitem(last=False)[1])
        return encoded
