"""Continuous batching in the simulator follows vLLM's scheduler, step by step."""

from __future__ import annotations

import zlib

from gateway.sim.kvcache import BlockStored
from gateway.sim.scheduler import (
    FINISH_LENGTH,
    FINISH_STOP,
    RequestStatus,
    SamplingSpec,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepOutput,
)


def make(
    num_gpu_blocks: int = 64,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    record_events: bool = False,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    """A scheduler with 4-token blocks, so small prompts exercise block boundaries."""
    config = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size_tokens=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        record_events=record_events,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config)


def add(
    s: Scheduler,
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    eos_probability: float = 0.0,
) -> SimRequest:
    spec = SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        eos_probability=eos_probability,
        seed=zlib.crc32(rid.encode()),
    )
    req = s.new_request(rid, prompt, spec)
    s.add_request(req)
    return req


def step(s: Scheduler) -> list[StepOutput]:
    return s.update_from_output(s.schedule())


def run(s: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while s.has_unfinished() and steps < limit:
        step(s)
        steps += 1
    return steps


def test_idle_request_prefills_in_one_step_then_decodes_one_token_per_step() -> None:
    s = make()
    req = add(s, "a", list(range(10)), max_tokens=3)
    plan = s.schedule()
    assert plan.prefill_tokens == 10 and plan.num_decode_requests == 0
    out = s.update_from_output(plan)
    assert [o.first_token for o in out] == [True]
    plan = s.schedule()
    assert plan.prefill_tokens == 0 and plan.num_decode_requests == 1
    assert plan.decode_kv_tokens == 11
    s.update_from_output(plan)
    (last,) = step(s)
    assert last.finish_reason == FINISH_LENGTH
    assert req.num_output_tokens == 3 and not s.has_unfinished()
    assert s.kv.pool.num_free_blocks == 63


def test_long_prompt_is_chunked_by_max_num_batched_tokens() -> None:
    s = make(max_num_batched_tokens=8)
    add(s, "a", list(range(20)), max_tokens=1)
    prefill = []
    while s.has_unfinished():
        plan = s.schedule()
        prefill.append(plan.prefill_tokens)
        out = s.update_from_output(plan)
        assert bool(out) == (len(prefill) == 3)  # the token comes with the last chunk only
    assert prefill == [8, 8, 4]


def test_long_prefill_token_threshold_caps_a_prefill_only_when_others_run_or_wait() -> None:
    """vLLM's ``long_prefill_token_threshold``: a long prompt alone uses the whole budget; with
    another request in the engine its chunk per step is capped, so a short prompt arriving
    behind it is computed in the next step instead of after the long prompt's last chunk."""
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add(s, "long", list(range(200)), max_tokens=1)
    assert s.schedule().prefill_tokens == 64  # alone: nobody to starve
    add(s, "short", list(range(500, 510)), max_tokens=1)
    plan = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == [
        ("long", 8), ("short", 8)]  # both capped; the short one's last 2 tokens next step
    s.update_from_output(plan)
    plan = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == [
        ("long", 8), ("short", 2)]
    (out,) = s.update_from_output(plan)
    assert out.request.request_id == "short" and out.first_token


def test_decodes_are_scheduled_before_new_prefills_within_the_token_budget() -> None:
    s = make(max_num_batched_tokens=10)
    add(s, "a", list(range(8)), max_tokens=5)
    step(s)
    add(s, "b", list(range(100, 120)), max_tokens=1)
    plan = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens, c.is_decode) for c in plan.chunks] == [
        ("a", 1, True),
        ("b", 9, False),
    ]


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", [i] * 5, max_tokens=10)
    step(s)
    assert s.num_running == 2 and s.num_waiting == 1


def test_request_waits_when_blocks_run_out_and_starts_when_one_finishes() -> None:
    s = make(num_gpu_blocks=6)  # 5 usable blocks of 4 tokens
    add(s, "big", list(range(12)), max_tokens=2)  # 3 blocks, a 4th for its decode
    add(s, "next", list(range(50, 59)), max_tokens=1)  # 3 blocks: does not fit beside "big"
    step(s)
    assert s.num_running == 1 and s.waiting[0].request_id == "next"
    (out,) = step(s)  # "big" finishes, its blocks are freed after the step
    assert out.finish_reason == FINISH_LENGTH
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["next"]


def test_waiting_queue_is_first_come_first_served_head_blocks_smaller_requests() -> None:
    s = make(num_gpu_blocks=6)
    add(s, "running", list(range(8)), max_tokens=50)
    step(s)
    add(s, "huge", list(range(100, 116)), max_tokens=1)  # 4 blocks: does not fit now
    add(s, "tiny", [7], max_tokens=1)  # would fit, but waits behind "huge"
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["running"]


def test_newest_running_request_is_preempted_when_decode_needs_a_block() -> None:
    s = make(num_gpu_blocks=5)  # 4 usable blocks
    old = add(s, "old", [1, 1, 1, 1, 1, 1, 1], max_tokens=20)  # 2 blocks
    new = add(s, "new", [2, 2, 2, 2, 2, 2, 2], max_tokens=20)  # 2 blocks
    step(s)  # both prefilled: 7 prompt tokens + 1 generated each
    step(s)  # both decode token 8: their second blocks are now full, all 4 blocks in use
    plan = s.schedule()  # both need a third block for token 9; only "old" can get it
    assert plan.preempted == [new]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert [c.request for c in plan.chunks] == [old]
    assert s.waiting[0] is new and s.num_preemptions == 1


def test_preempted_request_resumes_with_its_outputs_and_hits_its_cached_blocks() -> None:
    s = make(num_gpu_blocks=5)
    add(s, "old", [1] * 7, max_tokens=3)
    new = add(s, "new", [2] * 7, max_tokens=3)
    step(s)
    step(s)
    plan = s.schedule()
    assert plan.preempted == [new]
    s.update_from_output(plan)
    outputs_before = list(new.output_token_ids)
    queries_before = s.prefix_stats.queries
    run(s)
    assert new.finish_reason == FINISH_LENGTH
    assert new.output_token_ids[: len(outputs_before)] == outputs_before
    assert new.num_output_tokens == 3
    # The re-admission looked up prompt + outputs; vLLM counts it apart from first admissions.
    assert s.prefix_stats.queries == queries_before
    assert s.prefix_stats.preempted_requests == 1
    assert s.prefix_stats.preempted_hits > 0


def test_prefix_hits_are_counted_in_tokens_once_per_first_admission() -> None:
    s = make()
    add(s, "a", list(range(10)), max_tokens=1)
    run(s)
    add(s, "b", list(range(10)), max_tokens=1)
    run(s)
    assert (s.prefix_stats.queries, s.prefix_stats.hits) == (20, 8)
    assert s.prefix_stats.requests == 2


def test_cached_prefix_is_not_charged_as_prefill() -> None:
    s = make()
    add(s, "a", list(range(10)), max_tokens=1)
    run(s)
    add(s, "b", list(range(10)), max_tokens=1)
    assert s.schedule().prefill_tokens == 2


def test_block_filled_by_generated_tokens_is_stored_with_them() -> None:
    s = make(record_events=True)
    req = add(s, "a", [5, 6, 7], max_tokens=3)
    run(s)
    stored = [e for e in s.take_events() if isinstance(e, BlockStored)]
    # Token 4 (the first generated one) completes block 0 when it is fed back in step 2.
    assert [e.token_ids for e in stored] == [(5, 6, 7, req.output_token_ids[0])]


def test_generated_tokens_are_deterministic_per_seed() -> None:
    def tokens(seed: int) -> list[int]:
        s = make()
        req = s.new_request("x", [1, 2, 3], SamplingSpec(max_tokens=8, seed=seed))
        s.add_request(req)
        run(s)
        return req.output_token_ids

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_eos_ends_a_request_early_only_when_configured_and_not_ignored() -> None:
    s = make()
    never = add(s, "never", [1, 2], max_tokens=30)
    eos = add(s, "eos", [3, 4], max_tokens=30, eos_probability=1.0, min_tokens=3)
    ignored = add(s, "ignored", [5, 6], max_tokens=30, eos_probability=1.0, ignore_eos=True)
    run(s)
    assert never.num_output_tokens == 30 and never.finish_reason == FINISH_LENGTH
    assert eos.num_output_tokens == 3 and eos.finish_reason == FINISH_STOP
    assert ignored.num_output_tokens == 30


def test_abort_frees_the_request_blocks() -> None:
    s = make()
    add(s, "a", list(range(10)), max_tokens=100)
    step(s)
    assert s.kv.pool.num_free_blocks < 63
    s.abort_request("a")
    assert s.kv.pool.num_free_blocks == 63 and not s.has_unfinished()


def test_request_stops_at_max_model_len() -> None:
    s = make(max_model_len=12)
    req = add(s, "a", list(range(10)), max_tokens=100)
    run(s)
    assert req.num_tokens == 12 and req.finish_reason == FINISH_LENGTH
