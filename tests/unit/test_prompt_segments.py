"""gateway.prompt.segments: incremental tokenization gives exactly the ids of whole-prompt encoding.

The property tests generate conversations (random roles, unicode, whitespace at the edges of
messages, text that contains added-token strings or halves of them, empty contents, tool and
system messages, content parts) and encode every turn of each, so later turns run against a
cache warmed by earlier ones, on three tokenizers:

* the tiny model's (``.cache/tiny-llama``: byte-level BPE, ChatML template, BOS written by the
  template, BOS-prepending post-processor);
* a byte-level BPE trained here, with ``add_prefix_space`` (applied to every piece), ``lstrip``
  and ``rstrip`` special tokens and a normalized (non-special) added token, no normalizer;
* a Metaspace BPE trained here with ``prepend_scheme="first"`` (only the piece at offset 0 gets
  the ``▁``), an NFKC normalizer and a normalized added token, and a template that does not
  start with a special token;
* a legacy Llama-2 style BPE (no pre-tokenizer; a normalizer that prepends ``▁`` to every
  piece), with a normalized added token: normalized tokens must not be split on the raw text.

Everything is built locally with the ``tokenizers`` trainers: nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.gil import SLICE_ITEMS
from gateway.procs.vllm import tiny_model_path
from gateway.prompt.segments import SegmentEncoder, unsafe_reason
from gateway.prompt.tokenizer import HFTokenizer, PromptTooComplexError

WORDS = ("the cache holds keys and values for every token of the prompt while the router "
         "sends each request to the worker that already has its prefix ; numbers 12 345 6789 "
         "héllo naïve café 你好 世界 🚀 tabs\tand\nnewlines").split(" ")


def _sentences(n: int = 400) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(n)]


def _wrap(tok: Tokenizer, template: str, bos: str, eos: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=template)


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.train_from_iterator(_sentences(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|begin|>", "<|eot|>", "<|header|>", "<|/header|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken("[INST]", rstrip=True, normalized=False),
                            AddedToken("[/INST]", lstrip=True, normalized=False)])
    tok.add_tokens([AddedToken("<tool>", normalized=True)])
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ '<|header|>' + m['role'] + '<|/header|>\n\n' + m['content'] + '<|eot|>' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|header|>assistant<|/header|>\n\n' }}{% endif %}"
    )
    return _wrap(tok, template, "<|begin|>", "<|eot|>")


def _mistral_like(normalizer: Any, pre_tokenizer: Any, bos: str, assistant_prefix: str) -> Any:
    """A BPE with ``[INST]`` turns, ``</s>`` after answers and a normalized ``<tool>`` token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(_sentences(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        show_progress=False))
    tok.add_tokens([AddedToken("<tool>", normalized=True)])
    template = (
        bos + "{% for m in messages %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ '" + assistant_prefix + "' + m['content'] + '</s>' }}{% endif %}"
        "{% endfor %}"
    )
    return _wrap(tok, template, "<s>", "</s>")


@functools.cache
def metaspace_first_bpe() -> Any:
    """The template starts with text, not a token: its first piece is at offset 0."""
    return _mistral_like(normalizers.NFKC(), pre_tokenizers.Metaspace(prepend_scheme="first"),
                         bos="", assistant_prefix="")


@functools.cache
def prepend_normalizer_bpe() -> Any:
    """Legacy Llama-2 / SentencePiece style: the normalizer prepends ▁ to every piece."""
    return _mistral_like(
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        None, bos="{{ bos_token }}", assistant_prefix=" ")


@functools.cache
def tiny_llama() -> Any:
    from transformers import AutoTokenizer

    path = tiny_model_path()
    # No skip: CI builds it (scripts/setup.sh --test); a missing model is a failed set-up.
    assert (path / "tokenizer.json").exists(), f"{path} is not built: run scripts/setup.sh --test"
    return AutoTokenizer.from_pretrained(str(path))


TOKENIZERS = {"tiny-llama": tiny_llama, "byte-level-bpe": byte_level_bpe,
              "metaspace-first": metaspace_first_bpe, "prepend-normalizer": prepend_normalizer_bpe}


@functools.cache
def pair(name: str, cache_tokens: int) -> tuple[HFTokenizer, HFTokenizer]:
    """(incremental, whole-prompt) over the same transformers tokenizer."""
    hf = TOKENIZERS[name]()
    incremental = HFTokenizer(name, hf, segment_cache_tokens=cache_tokens)
    assert incremental.incremental
    return incremental, HFTokenizer(name, hf, segment_cache_tokens=0)


# --- generated conversations ---------------------------------------------------------------------

FRAGMENTS = [
    "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin|>", "<|eot|>", "<|header|>", "[INST]",
    "[/INST]", "<tool>", "＜tool＞", "<unk>", "<|im_", "_end|>", "[/", "<", "|>",
    " ", "  ", "\n", "\n\n", "\t", " \n ", "\xa0", "\u3000", "\u2028", "\x1c", "\r\n",
    "hello", "world", "the", " the", "cache", "12", "345", "é", "e\u0301", "ﬁ", "你好", "🚀", "▁", "Ġ",
]
text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=10).map("".join)
content = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                   max_size=3))
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "user", "assistant"]),
    "content": content,
})
conversation = st.lists(message, min_size=1, max_size=6)
options = st.fixed_dictionaries({}, optional={"add_generation_prompt": st.booleans(),
                                              "continue_final_message": st.booleans()})


def _encode_chat(tok: HFTokenizer, messages: list[dict[str, Any]],
                 opts: dict[str, Any]) -> list[int] | str:
    try:
        return tok.encode_chat(messages, opts)
    except PromptTooComplexError:
        return "template failed"  # both paths must fail alike


CASES = [("tiny-llama", 2_000_000), ("byte-level-bpe", 2_000_000), ("byte-level-bpe", 40),
         ("metaspace-first", 2_000_000), ("prepend-normalizer", 2_000_000)]


@pytest.mark.parametrize(("name", "cache_tokens"), CASES,
                         ids=["tiny-llama", "byte-level-bpe", "byte-level-bpe-evicting",
                              "metaspace-first", "prepend-normalizer"])
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversation, opts=options)
def test_every_turn_of_a_conversation_gets_the_ids_of_whole_prompt_tokenization(
    name: str, cache_tokens: int, messages: list[dict[str, Any]], opts: dict[str, Any]
) -> None:
    incremental, whole = pair(name, cache_tokens)

    for turn in range(1, len(messages) + 1):
        assert (_encode_chat(incremental, messages[:turn], opts)
                == _encode_chat(whole, messages[:turn], opts))


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(raw=text)
def test_text_without_special_tokens_gets_the_ids_of_whole_encoding(name: str, raw: str) -> None:
    incremental, whole = pair(name, 2_000_000)

    assert incremental.encode_text(raw, False) == whole.encode_text(raw, False)
    assert incremental.encode_text(raw, True) == whole.encode_text(raw, True)


# --- the splitting rules, by example -------------------------------------------------------------


def test_lstrip_and_rstrip_tokens_absorb_the_whitespace_beside_them() -> None:
    encoder = SegmentEncoder(byte_level_bpe().backend_tokenizer)

    assert encoder.pieces("a [INST] \n b  [/INST] c") == [
        "a ", encoder.pieces("[INST]")[0], "b", encoder.pieces("[/INST]")[0], " c"]


def test_normalized_tokens_are_split_only_when_there_is_no_normalizer() -> None:
    plain = SegmentEncoder(byte_level_bpe().backend_tokenizer)
    nfkc = SegmentEncoder(metaspace_first_bpe().backend_tokenizer)

    assert len(plain.pieces("x<tool>y")) == 3
    assert nfkc.pieces("</s>x<tool>y") == [nfkc.pieces("</s>")[0], "x<tool>y"]


def test_metaspace_first_keys_the_piece_at_offset_zero_apart() -> None:
    """Metaspace prepend_scheme="first" prepends ▁ only at offset 0: "hi" there and after a
    special token are different ids, and must not share a cache entry."""
    encoder = SegmentEncoder(metaspace_first_bpe().backend_tokenizer)
    whole = metaspace_first_bpe().backend_tokenizer

    assert encoder.pieces("hi</s>hi")[0] == ("hi",)
    assert encoder.pieces("hi</s>hi")[2] == "hi"
    for prompt in ("hi</s>hi", "</s>hi", "hi", "hi</s>hi</s>hi"):
        assert encoder.encode(prompt) == whole.encode(prompt, add_special_tokens=False).ids


def test_turn_n_encodes_only_the_text_it_adds() -> None:
    hf = byte_level_bpe()
    encoder = SegmentEncoder(hf.backend_tokenizer)
    whole = pair("byte-level-bpe", 2_000_000)[1]
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is the KV cache?"},
               {"role": "assistant", "content": "The keys and values of every token."}]
    turn = [*history, {"role": "user", "content": "Why does it grow?"}]

    def render(messages: list[dict[str, str]]) -> str:
        return str(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    previous = encoder.encode(render(history))
    cached = encoder.cached_tokens
    assert encoder.encode(render(history)) == previous
    assert encoder.cached_tokens == cached  # all hits

    ids = encoder.encode(render(turn))

    assert ids == whole.encode_chat(turn, {})
    # Only the new message's text was encoded (and cached): "[INST] " and " [/INST]" are tokens
    # that strip the spaces around it.
    assert encoder.cached_tokens - cached == len(whole.encode_text("Why does it grow?", False))


def test_the_cache_stays_within_its_token_bound() -> None:
    encoder = SegmentEncoder(byte_level_bpe().backend_tokenizer, max_cached_tokens=100)
    backend = byte_level_bpe().backend_tokenizer

    for i in range(50):
        prompt = f"<|begin|>message number {i} about the cache<|eot|>"
        assert encoder.encode(prompt) == backend.encode(prompt, add_special_tokens=False).ids
        assert encoder.cached_tokens <= 100


def test_cached_ids_are_the_shared_int_objects_for_any_number_of_ids() -> None:
    """The cache stores each id as the encoder's one int object per vocabulary entry (8 bytes
    an id, module docstring), whether a piece encodes to many ids, one or none."""
    encoder = SegmentEncoder(byte_level_bpe().backend_tokenizer)
    backend = byte_level_bpe().backend_tokenizer
    text = "message number 1234567 about the cache " * 40
    for prompt in (text, "a", "", f"<|begin|>{text}<|eot|>x"):
        ids = encoder.encode(prompt)
        assert ids == backend.encode(prompt, add_special_tokens=False).ids
        assert all(i is encoder._ints[i] for i in ids)
    assert all(i is encoder._ints[i] for cached in encoder._cache.values() for i in cached)


def test_a_long_piece_gets_its_ids_a_slice_at_a_time_with_the_gil_given_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``SLICE_ITEMS`` ids, the shared ints are picked a slice at a time with the GIL given
    to the event loop in between (``gateway.gil``): the same ids, the same shared objects."""
    import gateway.prompt.segments as segments
    yields: list[int] = []
    monkeypatch.setattr(segments, "yield_gil", lambda: yields.append(1))
    encoder = SegmentEncoder(byte_level_bpe().backend_tokenizer)
    backend = byte_level_bpe().backend_tokenizer
    text = " ".join(f"message {i} about the cache" for i in range(SLICE_ITEMS // 4))
    ids = encoder.encode(text)
    expected = backend.encode(text, add_special_tokens=False).ids
    assert len(expected) > 2 * SLICE_ITEMS
    assert ids == expected
    assert all(i is encoder._ints[i] for i in ids)
    assert len(yields) == -(-len(expected) // SLICE_ITEMS) - 1


# --- configurations that fall back to whole-prompt tokenization ----------------------------------


def _config_and_added(tok: Tokenizer) -> tuple[dict[str, Any], dict[int, Any]]:
    return json.loads(tok.to_str()), tok.get_added_tokens_decoder()


def test_a_safe_tokenizer_has_no_unsafe_reason() -> None:
    assert unsafe_reason(*_config_and_added(byte_level_bpe().backend_tokenizer), False) is None


def test_split_special_tokens_is_unsafe() -> None:
    reason = unsafe_reason(*_config_and_added(byte_level_bpe().backend_tokenizer), True)

    assert reason == "split_special_tokens is set"


def test_single_word_tokens_are_unsafe() -> None:
    tok = Tokenizer.from_str(byte_level_bpe().backend_tokenizer.to_str())
    tok.add_tokens([AddedToken("cachebox", single_word=True)])

    assert "single_word" in str(unsafe_reason(*_config_and_added(tok), False))


def test_tokens_starting_with_whitespace_next_to_rstrip_tokens_are_unsafe() -> None:
    tok = Tokenizer.from_str(byte_level_bpe().backend_tokenizer.to_str())  # has rstrip [INST]
    tok.add_tokens([AddedToken("  indent", normalized=False)])

    assert "whitespace" in str(unsafe_reason(*_config_and_added(tok), False))


def test_bpe_dropout_and_unknown_pre_tokenizers_are_unsafe() -> None:
    config, added = _config_and_added(byte_level_bpe().backend_tokenizer)

    assert unsafe_reason({**config, "model": {**config["model"], "dropout": 0.1}}, added,
                         False) == "BPE dropout"
    assert "Novel" in str(unsafe_reason({**config, "pre_tokenizer": {"type": "Sequence",
                                         "pretokenizers": [{"type": "Novel"}]}}, added, False))


def test_an_unsafe_tokenizer_encodes_whole_prompts() -> None:
    hf = _wrap(Tokenizer.from_str(byte_level_bpe().backend_tokenizer.to_str()),
               "{{ messages[0]['content'] }}", "<|begin|>", "<|eot|>")
    hf.backend_tokenizer.add_tokens([AddedToken("cachebox", single_word=True)])

    tok = HFTokenizer("single-word", hf)

    assert not tok.incremental
    assert tok.encode_chat([{"role": "user", "content": "a cachebox b"}], {}) == hf.encode(
        "a cachebox b", add_special_tokens=False)
