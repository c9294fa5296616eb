"""gateway.prompt.tokenizer.SimpleTokenizer and gateway.prompt.render with it.

The simulator and the gateway must produce the same ids for the same prompt (their block hashes
must agree), so the ids are pinned here: a change to them is a protocol change, not a refactor.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenizer import SIMPLE, SimpleTokenizer, load_tokenizer, message_text
from gateway.request import Endpoint, ParsedRequest, parse_body

TOK = SimpleTokenizer()


# --- encode_text ---------------------------------------------------------------------------------


def test_ids_are_pinned_across_versions_and_processes() -> None:
    assert TOK.encode_text("Hello, world!") == [1, 8482, 46, 5381, 28419, 7587]


def test_each_word_punctuation_mark_and_whitespace_run_is_one_token() -> None:
    # "Hello" "," " " "world" "!" ; "a" "  \n " "b" ; "x" "." "." "."
    assert len(TOK.encode_text("Hello, world!", add_special_tokens=False)) == 5
    assert len(TOK.encode_text("a  \n b", add_special_tokens=False)) == 3
    assert len(TOK.encode_text("x...", add_special_tokens=False)) == 4


def test_words_and_whitespace_runs_up_to_eight_characters_are_one_token() -> None:
    assert TOK.pieces("abcdefgh 12345678") == ["abcdefgh", " ", "12345678"]
    assert TOK.pieces("a" + " " * 8 + "b") == ["a", " " * 8, "b"]


def test_a_longer_run_is_cut_in_four_character_tokens_as_bpe_cuts_a_rare_word() -> None:
    assert TOK.pieces("abcdefghi") == ["abcd", "efgh", "i"]
    assert TOK.pieces("x" + " " * 9 + "y") == ["x", "    ", "    ", " ", "y"]
    assert TOK.pieces("antidisestablishment.") == ["anti", "dise", "stab", "lish", "ment", "."]


def test_a_one_megabyte_word_is_a_quarter_million_tokens() -> None:
    """Regression: a whole word was one token however long, so a 10 MB word counted 21 tokens
    and the demo served a prompt any real tokenizer counts in millions."""
    ids = TOK.encode_text("x" * 2**20, add_special_tokens=False)

    assert len(ids) == 2**20 // 4


def test_every_non_ascii_character_is_a_token_and_no_token_covers_more_than_8_bytes() -> None:
    text = "Ünïcödé 你好世界 🚀🚀 naïve tabs\t\t\t\t\t\t\t\t\tend " + "z" * 50

    pieces = TOK.pieces(text)

    assert "".join(pieces) == text
    assert TOK.pieces("你好世界") == ["你", "好", "世", "界"]
    assert max(len(p.encode()) for p in pieces) <= 8
    assert len(pieces) == len(TOK.encode_text(text, add_special_tokens=False))


def test_special_tokens_add_only_bos() -> None:
    plain = TOK.encode_text("some text", add_special_tokens=False)

    assert TOK.encode_text("some text") == [SimpleTokenizer.BOS, *plain]
    assert TOK.encode_text("some text", add_special_tokens=True)[0] == SimpleTokenizer.BOS
    assert SimpleTokenizer.BOS not in plain


def test_empty_text_is_only_bos_or_nothing() -> None:
    assert TOK.encode_text("") == [SimpleTokenizer.BOS]
    assert TOK.encode_text("", add_special_tokens=False) == []


def test_same_piece_same_id_and_different_instances_agree() -> None:
    text = "the cat saw the other cat"
    ids = SimpleTokenizer().encode_text(text, add_special_tokens=False)

    assert ids == TOK.encode_text(text, add_special_tokens=False)
    assert ids[0] == ids[6]  # "the"
    assert ids[2] == ids[10]  # "cat"
    assert ids[0] != ids[2]


def test_ids_stay_inside_the_vocabulary_above_the_reserved_specials() -> None:
    text = "Ünïcödé 你好 🚀 tabs\tand\nnewlines $%^&*() 12345 " * 20

    ids = TOK.encode_text(text, add_special_tokens=False)

    assert ids
    assert all(16 <= t < SimpleTokenizer.VOCAB_SIZE for t in ids)


def test_text_prefix_on_a_word_boundary_gives_a_token_prefix() -> None:
    """What makes prefix caching work: the same leading text gives the same leading tokens."""
    head = "You are a helpful assistant. "
    short = TOK.encode_text(head + "Summarise this.")
    long = TOK.encode_text(head + "Translate this paragraph into French, please.")
    head_ids = TOK.encode_text(head)

    assert short[: len(head_ids)] == long[: len(head_ids)] == head_ids


# --- chat ----------------------------------------------------------------------------------------

SYSTEM_USER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
]


def test_chat_renders_roles_and_the_generation_prompt_by_default() -> None:
    assert TOK.render_chat(SYSTEM_USER, {}) == (
        "<|system|>\nBe brief.\n<|end|>\n<|user|>\nHi!\n<|end|>\n<|assistant|>\n"
    )


def test_chat_without_generation_prompt_ends_after_the_last_message() -> None:
    text = TOK.render_chat(SYSTEM_USER, {"add_generation_prompt": False})

    assert text.endswith("<|user|>\nHi!\n<|end|>\n")


def test_continue_final_message_leaves_the_last_message_open_and_adds_no_generation_prompt() -> None:
    messages = [*SYSTEM_USER, {"role": "assistant", "content": "Hello, I"}]

    text = TOK.render_chat(messages, {"continue_final_message": True})

    assert text.endswith("<|assistant|>\nHello, I")


def test_continue_final_message_wins_over_an_explicit_generation_prompt() -> None:
    messages = [{"role": "assistant", "content": "Sure"}]

    text = TOK.render_chat(
        messages, {"continue_final_message": True, "add_generation_prompt": True}
    )

    assert text == "<|assistant|>\nSure"


def test_chat_content_parts_are_joined_and_null_content_is_empty() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "here"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]

    text = TOK.render_chat(messages, {"add_generation_prompt": False})

    assert text == "<|user|>\nlook\nhere\n<|end|>\n<|assistant|>\n\n<|end|>\n"


def test_message_text_of_each_content_form() -> None:
    assert message_text(None) == ""
    assert message_text("plain") == "plain"
    assert message_text(["a", {"text": "b"}, {"type": "image"}]) == "a\nb"
    assert message_text(42) == "42"


def test_encode_chat_is_bos_plus_the_rendered_text_without_specials() -> None:
    ids = TOK.encode_chat(SYSTEM_USER, {})

    assert ids == [SimpleTokenizer.BOS,
                   *TOK.encode_text(TOK.render_chat(SYSTEM_USER, {}), add_special_tokens=False)]
    assert ids.count(SimpleTokenizer.BOS) == 1


def test_chat_prompt_is_a_token_prefix_of_the_next_turns_prompt() -> None:
    """A conversation's next turn must reuse the KV blocks of the previous turn's prompt."""
    turn1 = [{"role": "user", "content": "What is KV cache?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Stored keys and values."},
             {"role": "user", "content": "Why does it grow?"}]

    first = TOK.encode_chat(turn1, {})
    second = TOK.encode_chat(turn2, {})

    assert second[: len(first)] == first
    assert len(second) > len(first)


def test_chat_with_add_special_tokens_encodes_bos_again_on_top_of_the_templates() -> None:
    """As vLLM with a real template: the template wrote BOS, the tokenizer adds its own."""
    plain = TOK.encode_chat(SYSTEM_USER, {})

    doubled = TOK.encode_chat(SYSTEM_USER, {"add_special_tokens": True})

    assert doubled == [SimpleTokenizer.BOS, *plain]
    assert TOK.encode_chat(SYSTEM_USER, {"add_special_tokens": False}) == plain


# --- pairs (cross-encoders) and token strings ---------------------------------------------------


def test_a_pair_is_bos_first_eos_second_eos() -> None:
    first, second = "what is kv", "a cache of keys"

    ids = TOK.encode_pair(first, second)

    assert ids == [*TOK.encode_text(first), SimpleTokenizer.EOS,
                   *TOK.encode_text(second, add_special_tokens=False), SimpleTokenizer.EOS]


def test_token_strings_name_the_specials_and_give_decodes_placeholder_otherwise() -> None:
    ids = [*TOK.encode_text("one two"), SimpleTokenizer.EOS, 3]

    strs = TOK.token_strings(ids)

    assert strs[0] == "<s>" and strs[-2] == "</s>" and strs[-1] == "<special_3>"
    assert strs[1:-2] == TOK.decode(ids).split(" ")
    assert TOK.token_strings([]) == []


# --- decode and identity -------------------------------------------------------------------------


def test_decode_gives_one_placeholder_word_per_non_special_token() -> None:
    ids = TOK.encode_text("one two", add_special_tokens=True)  # BOS one " " two

    words = TOK.decode(ids).split(" ")

    assert len(words) == 3
    assert all(w.startswith("w") for w in words)


def test_decode_skips_special_ids() -> None:
    assert TOK.decode([SimpleTokenizer.BOS, SimpleTokenizer.EOS]) == ""


def test_load_tokenizer_simple_gives_the_simple_tokenizer() -> None:
    tok = load_tokenizer(SIMPLE)

    assert isinstance(tok, SimpleTokenizer)
    assert tok.name == "simple"


# --- render.prompt_token_ids ---------------------------------------------------------------------


def _parsed(endpoint: Endpoint, **fields: Any) -> ParsedRequest:
    return parse_body(json.dumps({"model": "m", **fields}).encode(), endpoint,
                      default_max_tokens=1024)


def test_chat_request_gives_one_prompt_rendered_with_its_template_flags() -> None:
    parsed = _parsed(Endpoint.CHAT, messages=SYSTEM_USER, add_generation_prompt=False)

    assert prompt_token_ids(TOK, parsed) == [
        TOK.encode_chat(SYSTEM_USER, {"add_generation_prompt": False})
    ]


def test_completion_string_prompt_is_encoded_with_bos() -> None:
    parsed = _parsed(Endpoint.COMPLETIONS, prompt="Once upon")

    assert prompt_token_ids(TOK, parsed) == [TOK.encode_text("Once upon", True)]
    assert prompt_token_ids(TOK, parsed)[0][0] == SimpleTokenizer.BOS


def test_completion_with_add_special_tokens_false_has_no_bos() -> None:
    parsed = _parsed(Endpoint.COMPLETIONS, prompt="Once upon", add_special_tokens=False)

    assert prompt_token_ids(TOK, parsed) == [TOK.encode_text("Once upon", False)]


def test_completion_batch_of_strings_gives_one_prompt_per_string() -> None:
    parsed = _parsed(Endpoint.COMPLETIONS, prompt=["a b", "c"])

    assert prompt_token_ids(TOK, parsed) == [TOK.encode_text("a b"), TOK.encode_text("c")]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [([5, 6, 7], [[5, 6, 7]]), ([[5, 6], [7]], [[5, 6], [7]]), ([[9]], [[9]])],
    ids=["token-ids", "token-id-lists", "one-token-list"],
)
def test_completion_token_id_prompts_are_taken_as_they_are(
    prompt: Any, expected: list[list[int]]
) -> None:
    parsed = _parsed(Endpoint.COMPLETIONS, prompt=prompt)

    assert prompt_token_ids(TOK, parsed) == expected
