"""gateway.prompt.limits: the token floor checked before encoding, and the deadline.

The floor must be sound (never above the real count, or a prompt that fits would be refused):
a property test on the tiny model's tokenizer, and the load-time analysis refusing the tokenizer
features that break it.
"""

from __future__ import annotations

import functools
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.procs.vllm import tiny_model_path
from gateway.prompt.limits import (
    Deadline,
    PromptTimeoutError,
    PromptTooLongError,
    check_length,
    longest_token_chars,
)
from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenizer import HFTokenizer, SimpleTokenizer


@functools.cache
def tiny() -> HFTokenizer:
    return HFTokenizer.load(str(tiny_model_path()))


def test_the_tiny_models_longest_token_is_its_divisor() -> None:
    assert tiny().longest_token_chars == len("Ġmilliseconds")


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=200)
       | st.lists(st.sampled_from([" ", "\n", "\t", "a", "<s>", "<|im_start|>", "é", "日"]),
                  max_size=200).map("".join))
def test_the_floor_never_exceeds_the_real_count(text: str) -> None:
    divisor = tiny().longest_token_chars
    assert divisor is not None
    assert len(tiny().encode_text(text, False)) >= math.ceil(len(text) / divisor)


def test_a_text_certainly_too_long_is_refused_before_it_is_encoded() -> None:
    """Regression: 10 MB of text took 11.7 s to tokenize before its 400."""
    text = "word " * 2_000_000
    started = time.perf_counter()
    with pytest.raises(PromptTooLongError) as err:
        tiny().encode_text(text, False, max_tokens=4096)
    assert time.perf_counter() - started < 0.1
    assert err.value.min_tokens == math.ceil(len(text) / 13)


def test_the_floor_refuses_only_beyond_max_tokens_times_the_divisor() -> None:
    check_length("x" * 40, 4, 10)
    with pytest.raises(PromptTooLongError, match="at least 11 tokens"):
        check_length("x" * 41, 4, 10)
    check_length("x" * 10**6, None, 10)  # no sound floor: no early refusal
    check_length("x" * 10**6, 4, None)


def test_no_prompt_is_tokenized_when_the_output_tokens_fill_the_largest_pool() -> None:
    """Whatever the tokenizer (the simple one has no floor): 10 MB of text with a max_tokens
    beyond every pool is refused before it is encoded."""
    parsed = SimpleNamespace(body={"prompt": "word " * 2_000_000}, is_chat=False)
    started = time.perf_counter()
    with pytest.raises(PromptTooLongError, match="lower max_tokens"):
        prompt_token_ids(SimpleTokenizer(), parsed, max_tokens=-1)
    assert time.perf_counter() - started < 0.1


def test_the_simple_tokenizer_has_no_floor() -> None:
    """One word is one token however long: the length of a text bounds nothing."""
    assert SimpleTokenizer().encode_text("x" * 10_000, False, max_tokens=1) != []


def added(content: str, *, lstrip: bool = False, rstrip: bool = False) -> Any:
    return SimpleNamespace(content=content, lstrip=lstrip, rstrip=rstrip)


BYTE_BPE = {"model": {"type": "BPE", "byte_fallback": True}, "normalizer": None,
            "pre_tokenizer": {"type": "Metaspace"}}


@pytest.mark.parametrize(("change", "reason"), [
    ({"normalizer": {"type": "NFC"}}, "normalizer may shorten"),
    ({"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "StripAccents"}]}}, "StripAccents"),
    ({"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
     "normalizer may shorten"),
    ({"pre_tokenizer": {"type": "Whitespace"}}, "pre-tokenizer may drop"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Removed"}]}}, "pre-tokenizer may drop"),
    ({"model": {"type": "WordPiece"}}, "WordPiece model"),
    ({"model": {"type": "BPE", "byte_fallback": False, "fuse_unk": True}}, "outside the vocab"),
])
def test_tokenizers_that_break_the_floor_get_none(change: dict[str, Any], reason: str) -> None:
    found = longest_token_chars({**BYTE_BPE, **change}, {"ab": 0, "abc": 1}, [])
    assert isinstance(found, str) and reason in found


def test_added_tokens_that_strip_whitespace_break_the_floor() -> None:
    found = longest_token_chars(BYTE_BPE, {"ab": 0}, [added("<|end|>", rstrip=True)])
    assert isinstance(found, str) and "<|end|>" in found


def test_a_sentencepiece_like_tokenizer_keeps_the_floor() -> None:
    config = {**BYTE_BPE, "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}, "pre_tokenizer": None}
    assert longest_token_chars(config, {"▁hello": 0, "<0x41>": 1}, [added("<s>")]) == 6


def test_a_deadline_passes_until_it_is_reached() -> None:
    Deadline.after(60).check()
    with pytest.raises(PromptTimeoutError, match=r"0\.01 s"):
        Deadline(time.monotonic() - 1, 0.01).check()
