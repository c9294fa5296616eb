"""``resume_body``: the continuation request of a broken stream, and how many tokens its
partial answer counts toward the answer's usage."""

from __future__ import annotations

import json

from gateway.prompt.tokenizer import load_tokenizer
from gateway.upstream.resume import resume_body

SIMPLE = load_tokenizer("simple")


def _body(**limits: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, **limits}).encode()


def test_the_continuation_asks_for_what_is_left_of_the_limit() -> None:
    partial = "one two three"  # 5 tokens with the simple tokenizer (words and spaces)
    body, generated = resume_body(_body(max_tokens=40), SIMPLE, partial)
    sent = json.loads(body)
    assert generated == 5
    assert sent["max_tokens"] == 35
    assert sent["messages"][-1] == {"role": "assistant", "content": partial}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False


def test_a_partial_answer_that_re_tokenizes_past_the_limit_counts_one_token_less() -> None:
    """A partial answer can re-tokenize into more tokens than the model produced; the answer's
    usage (partial + continuation) then still reads the limit, not more."""
    partial = " ".join(["word"] * 30)  # 59 tokens with the simple tokenizer
    for limits in ({"max_tokens": 40}, {"max_completion_tokens": 40},
                   {"max_tokens": 50, "max_completion_tokens": 40}):
        body, generated = resume_body(_body(**limits), SIMPLE, partial)
        sent = json.loads(body)
        assert generated == 39
        assert all(sent[name] >= 1 for name in limits)
        assert generated + min(sent[name] for name in limits) == 40


def test_without_a_limit_the_partial_answer_counts_what_it_re_tokenizes_to() -> None:
    body, generated = resume_body(_body(), SIMPLE, " ".join(["word"] * 30))
    assert generated == 59
    assert "max_tokens" not in json.loads(body)
