"""sanitize_session_id: one rule for session ids in store keys and metric labels."""

from __future__ import annotations

import re

import pytest

from gateway.budgets.session_id import SESSION_ID_MAX_LEN, sanitize_session_id

SAFE = re.compile(r"[A-Za-z0-9._:@~-]+")


@pytest.mark.parametrize("raw", ["abc", "user-42", "team.a:job_7@host", "x" * SESSION_ID_MAX_LEN])
def test_safe_ids_are_kept_as_they_are(raw: str) -> None:
    assert sanitize_session_id(raw) == raw


@pytest.mark.parametrize("raw", [None, "", "   ", "\t\n"])
def test_missing_or_blank_id_is_anonymous(raw: str | None) -> None:
    assert sanitize_session_id(raw) is None


def test_surrounding_whitespace_is_stripped() -> None:
    assert sanitize_session_id("  abc ") == "abc"


@pytest.mark.parametrize(
    "raw", ["a b", "a/b", "ünïcödé", "x" * (SESSION_ID_MAX_LEN + 1), 'q"uote{}', "a\x00b"]
)
def test_unsafe_ids_become_safe_bounded_and_stable(raw: str) -> None:
    out = sanitize_session_id(raw)
    assert out is not None
    assert SAFE.fullmatch(out) and len(out) <= SESSION_ID_MAX_LEN
    assert sanitize_session_id(raw) == out
    assert sanitize_session_id(out) == out  # idempotent


def test_ids_differing_only_in_replaced_characters_stay_distinct() -> None:
    """A replace-and-truncate rule would merge these sessions' budgets."""
    assert sanitize_session_id("a b") != sanitize_session_id("a_b")
    assert sanitize_session_id("a b") != sanitize_session_id("a/b")
    long_a = "p" * 200 + "a"
    long_b = "p" * 200 + "b"
    assert sanitize_session_id(long_a) != sanitize_session_id(long_b)


def test_sanitized_id_keeps_a_readable_prefix() -> None:
    out = sanitize_session_id("user 42")
    assert out is not None and out.startswith("user_42~")
