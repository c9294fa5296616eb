"""gateway.bench.workloads: deterministic, sized as asked, growing, sharing what they claim to share."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.bench.workloads import (
    WORDS,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    calibration_text,
)


def requests(spec: WorkloadSpec) -> list[BenchRequest]:
    return list(build_workload(spec).all_requests())


def n_words(r: BenchRequest) -> int:
    return sum(len(m.content.split()) for m in r.messages)


@pytest.mark.parametrize("name", ["multiturn", "shared-prefix", "doc-qa", "mixed", "sweep"])
def test_same_seed_gives_identical_requests_and_another_seed_different_text(name: str) -> None:
    spec = WorkloadSpec(name, seed=7, requests=24, lengths=(64, 128), per_length=3,
                        doc_tokens=300, prefix_tokens=200, long_tokens=500)
    assert requests(spec) == requests(spec)
    other = requests(dataclasses.replace(spec, seed=8))
    assert [r.messages for r in other] != [r.messages for r in requests(spec)]


@pytest.mark.parametrize("name", ["multiturn", "shared-prefix", "doc-qa", "mixed"])
def test_request_count_caps_the_workload_without_changing_the_requests_kept(name: str) -> None:
    spec = WorkloadSpec(name, sessions=4, doc_tokens=200, prefix_tokens=100, long_tokens=300)
    full = requests(spec)
    capped = requests(dataclasses.replace(spec, requests=10))
    assert len(capped) == 10
    assert capped == full[:10]
    assert [r.index for r in full] == list(range(len(full)))


def test_text_is_made_of_vocabulary_words() -> None:
    spec = WorkloadSpec("mixed", requests=5, long_tokens=300, short_tokens=50)
    vocab = set(WORDS)
    for r in requests(spec):
        body = r.messages[-1].content.split(". ", 1)[1]  # after the "Request N." marker
        assert set(body.split()) <= vocab
    assert set(calibration_text(100).split()) <= vocab
    assert calibration_text(100) == calibration_text(100)


def test_sizes_follow_tokens_per_word() -> None:
    one = requests(WorkloadSpec("mixed", requests=20, short_tokens=200, long_fraction=0.0))
    two = requests(WorkloadSpec("mixed", requests=20, short_tokens=200, long_fraction=0.0,
                                tokens_per_word=2.0))
    for a, b in zip(one, two, strict=True):
        assert 200 <= n_words(a) <= 204  # asked size + the "Request N." marker
        assert 100 <= n_words(b) <= 104
        assert a.approx_prompt_tokens == pytest.approx(200, abs=4)
        assert b.approx_prompt_tokens == pytest.approx(200, abs=8)


def test_multiturn_sessions_interleave_turn_by_turn_and_every_turn_extends_the_last() -> None:
    spec = WorkloadSpec("multiturn", sessions=3, turns=4, system_tokens=20,
                        first_user_tokens=30, turn_user_tokens=10, max_tokens=16)
    rs = requests(spec)
    assert len(rs) == 12
    assert [r.group for r in rs[:4]] == ["turn-1", "turn-1", "turn-1", "turn-2"]
    assert len({r.session_id for r in rs}) == 3
    by_index = {r.index: r for r in rs}
    for r in rs:
        if r.group == "turn-1":
            assert r.prev is None
            continue
        prev = by_index[r.prev] if r.prev is not None else None
        assert prev is not None and prev.session_id == r.session_id
        assert prev.index < r.index
        # the previous turn's messages, then its answer, then the new user message
        assert r.messages[: len(prev.messages)] == prev.messages
        assert r.messages[len(prev.messages)].role == "assistant"
        assert len(r.messages[len(prev.messages)].content.split()) == 16  # answer = max_tokens
        assert r.messages[len(prev.messages) + 1:] == r.new_messages
        assert r.approx_prompt_tokens == prev.approx_prompt_tokens + 16 + 10


def test_multiturn_sessions_start_with_distinct_system_prompts() -> None:
    rs = requests(WorkloadSpec("multiturn", sessions=5, turns=1))
    assert len({r.messages[0].content for r in rs}) == 5


def test_independent_workloads_send_as_many_requests_as_asked() -> None:
    spec = WorkloadSpec("shared-prefix", prefix_tokens=10)
    assert build_workload(spec).total == 200
    assert build_workload(dataclasses.replace(spec, requests=1000)).total == 1000


def test_multiturn_makes_enough_sessions_for_the_requests_asked() -> None:
    rs = requests(WorkloadSpec("multiturn", turns=4, requests=40))
    assert len(rs) == 40 and len({r.session_id for r in rs}) == 10


def test_shared_prefix_requests_share_a_few_system_prompts_and_ask_unique_questions() -> None:
    rs = requests(WorkloadSpec("shared-prefix", requests=60, prefixes=3, prefix_tokens=500,
                               question_tokens=20))
    systems = [r.messages[0].content for r in rs]
    assert len(set(systems)) == 3
    assert all(len(s.split()) >= 500 for s in systems)
    assert min(systems.count(s) for s in set(systems)) >= 10  # every prefix really is reused
    questions = [r.messages[1].content for r in rs]
    assert len(set(questions)) == 60
    # past their "Question N." marker the questions differ too
    assert len({" ".join(q.split()[2:6]) for q in questions}) == 60


def test_doc_qa_puts_the_same_document_before_each_question() -> None:
    rs = requests(WorkloadSpec("doc-qa", requests=10, docs=2, doc_tokens=400, question_tokens=10))
    docs = [r.messages[1].content.split("\n\n")[0] for r in rs]
    assert len(set(docs)) == 2
    assert docs[0] == docs[2] == docs[4]
    assert all(r.messages[0] == rs[0].messages[0] for r in rs)
    assert len({r.messages[1].content.split("\n\n")[1] for r in rs}) == 10
    assert all(r.approx_prompt_tokens >= 400 for r in rs)


def test_mixed_draws_long_and_short_prompts_at_the_ratio() -> None:
    rs = requests(WorkloadSpec("mixed", requests=400, long_fraction=0.25, long_tokens=1000,
                               short_tokens=50))
    longs = [r for r in rs if r.group == "long"]
    assert 70 <= len(longs) <= 130
    assert all(n_words(r) >= 1000 for r in longs)
    assert all(n_words(r) < 60 for r in rs if r.group == "short")
    assert len({r.messages[0].content for r in rs}) == 400


def test_sweep_has_one_phase_per_length_in_order_and_unique_prompts() -> None:
    w = build_workload(WorkloadSpec("sweep", lengths=(100, 200, 400), per_length=3))
    assert w.phases == (("100", 3), ("200", 3), ("400", 3))
    phase2 = list(w.requests(2))
    assert [r.group for r in phase2] == ["400"] * 3
    assert [r.index for r in phase2] == [6, 7, 8]
    assert all(400 <= n_words(r) <= 404 for r in phase2)
    assert len({r.messages[0].content[:40] for r in w.all_requests()}) == 9


def test_sweep_request_cap_keeps_the_shortest_lengths_first() -> None:
    w = build_workload(WorkloadSpec("sweep", lengths=(100, 200, 400), per_length=3, requests=5))
    assert w.phases == (("100", 3), ("200", 2))
    assert w.total == 5


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("nope")
    with pytest.raises(ValueError, match="long_fraction"):
        WorkloadSpec("mixed", long_fraction=1.5)
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec("multiturn", turns=0)
