"""The overhead benchmark's helpers: wrk's report, /proc CPU accounting of a process tree, the
streaming client's clock, summaries against direct, the verdicts, and the no-op backend's stream."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.bench import noop
from gateway.bench.isolation import CASE as ISOLATION_CASE
from gateway.bench.isolation import (
    FLOOD_CASE,
    FloodLoad,
    Isolation,
    Phase,
    flood_body,
    flood_text,
    isolations,
)
from gateway.bench.isolation import evaluate as evaluate_isolation
from gateway.bench.overhead.cli import build_parser, choose
from gateway.bench.overhead.cpu import (
    CLOCK_TICKS_PER_S,
    ProcStat,
    children_cpu_s,
    descendants,
    parse_machine_busy_ticks,
    parse_proc_stat,
    read_proc_stats,
    tree_cpu_s,
)
from gateway.bench.overhead.model import CASES, ISOLATION, Load, Round, Summary, targets
from gateway.bench.overhead.report import (
    finite,
    kernel_split,
    prediction,
    process_shares,
    split_cpu,
)
from gateway.bench.overhead.run import kvgate_config, rotated
from gateway.bench.overhead.streams import StreamClock, StreamTiming, stream_load
from gateway.bench.overhead.summary import evaluate, summarize
from gateway.bench.overhead.wrk import parse_wrk, wrk_argv

WRK_OUT = """\
Running 2s test @ http://127.0.0.1:1234/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.20ms  20.00ms   90.00%
    Req/Sec     5.00k   200.00     5.50k    80.00%
  Latency Distribution
     50%  850.00us
     75%    2.20ms
     90%    3.00ms
     99%    1.24s
  10000 requests in 2.00s, 3.00MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 5
Requests/sec:   5000.00
Transfer/sec:      1.50MB
"""


def test_wrk_report_gives_rate_percentiles_in_ms_and_every_error() -> None:
    load = parse_wrk(WRK_OUT)
    assert load.requests == 10000 and load.requests_per_s == 5000.0
    assert load.p50_ms == pytest.approx(0.85) and load.p99_ms == pytest.approx(1240.0)
    assert load.errors == 2 + 3 + 5


def test_wrk_report_without_errors_counts_none_and_a_truncated_report_raises() -> None:
    clean = "\n".join(ln for ln in WRK_OUT.splitlines() if "errors" not in ln
                      and "Non-2xx" not in ln)
    assert parse_wrk(clean).errors == 0
    with pytest.raises(ValueError, match="Requests/sec"):
        parse_wrk(WRK_OUT.replace("Requests/sec", "Reqs"))


def _stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0,
               cstime: int = 0) -> str:
    # fields 3.. : state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    #              utime stime cutime cstime priority ...
    return (f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 "
            f"{utime} {stime} {cutime} {cstime} 20 0 3 0 1234 0 0\n")


def test_proc_stat_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    stat = parse_proc_stat(_stat_line(42, "python -m (gw) x", 7, 100, 20, 3, 4))
    assert stat == ProcStat(pid=42, ppid=7, cpu_ticks=127, kernel_ticks=24)  # stime + cstime


def test_descendants_are_the_whole_tree_below_the_root_and_nothing_beside_it() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert descendants(parents, 10) == {10, 11, 12, 13}
    assert descendants(parents, 21) == {21}
    assert descendants(parents, 99) == {99}


def test_tree_cpu_sums_the_supervisor_and_its_children_in_seconds() -> None:
    stats = {
        1: ProcStat(1, 0, 10_000),
        10: ProcStat(10, 1, 100),  # supervisor
        11: ProcStat(11, 10, 250),  # gateway process
        12: ProcStat(12, 10, 150),  # gateway process
        20: ProcStat(20, 1, 999),  # the backend, beside it
    }
    assert tree_cpu_s(stats, 10) == pytest.approx(500 / CLOCK_TICKS_PER_S)
    kernel = {pid: replace(s, kernel_ticks=s.cpu_ticks // 10) for pid, s in stats.items()}
    assert tree_cpu_s(kernel, 10, kernel=True) == pytest.approx(50 / CLOCK_TICKS_PER_S)


def test_each_child_of_a_supervisor_is_read_with_its_own_tree_busiest_first() -> None:
    before = {10: ProcStat(10, 1, 100), 11: ProcStat(11, 10, 250), 12: ProcStat(12, 10, 150),
              13: ProcStat(13, 12, 10), 14: ProcStat(14, 10, 40), 20: ProcStat(20, 1, 999)}
    after = {10: ProcStat(10, 1, 120), 11: ProcStat(11, 10, 260), 12: ProcStat(12, 10, 170),
             13: ProcStat(13, 12, 40),  # a child of process 12: counted with it
             15: ProcStat(15, 10, 30),  # started between the readings (14 ended): left out
             20: ProcStat(20, 1, 5000)}
    spent = children_cpu_s(before, after, 10)
    assert spent == pytest.approx([50 / CLOCK_TICKS_PER_S, 10 / CLOCK_TICKS_PER_S])
    assert children_cpu_s(before, after, 20) == []  # no children: one process


def test_proc_stats_skip_non_processes_and_processes_that_vanished(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "stat").write_text(_stat_line(12, "noop", 1, 5, 5))
    (tmp_path / "13").mkdir()  # exited between listing and reading: no stat file
    assert read_proc_stats(tmp_path) == {12: ProcStat(12, 1, 10, 5)}


def test_machine_busy_time_leaves_out_idle_and_iowait() -> None:
    text = ("cpu  100 5 50 9000 40 3 2 1 7 0\n"
            "cpu0 50 2 25 4500 20 1 1 0 3 0\n"
            "intr 12345\n")
    assert parse_machine_busy_ticks(text) == 100 + 5 + 50 + 3 + 2 + 1


def test_tree_cpu_of_this_process_is_read_from_the_real_proc() -> None:
    busy = sum(i * i for i in range(200_000))
    assert busy > 0
    assert tree_cpu_s(read_proc_stats(), os.getpid()) > 0


def _sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def test_stream_clock_counts_content_events_split_anywhere_but_not_role_or_eos() -> None:
    role = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    token = b'{"choices":[{"index":0,"delta":{"content":"ok"}}]}'
    eos = b'{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}'
    stream = _sse(role, token, token, token, eos, b"[DONE]")
    clock = StreamClock(sent_s=1.0)
    cut = [0, 10, 90, 91, 150, 200, len(stream)]  # mid-event, mid-marker, mid-terminator
    for i, (a, b) in enumerate(itertools.pairwise(cut)):
        clock.feed(stream[a:b], now_s=2.0 + i)
    timing = clock.timing(end_s=9.0)
    assert clock.contents == 3 and timing.ok
    assert timing.ttft_s is not None and timing.ttft_s > 1.0
    assert timing.tpot_s is not None and timing.tpot_s > 0 and timing.e2e_s == 8.0


def test_stream_without_done_or_content_is_not_ok() -> None:
    clock = StreamClock(sent_s=0.0)
    clock.feed(_sse(b'{"choices":[{"delta":{"content":"ok"}}]}'), 0.5)
    assert not clock.timing(1.0).ok
    empty = StreamClock(sent_s=0.0)
    empty.feed(_sse(b"[DONE]"), 0.5)
    assert not empty.timing(1.0).ok


def test_stream_load_counts_failed_streams_as_errors_and_rates_only_good_ones() -> None:
    timings = [StreamTiming(0.1, 0.01, 0.7, True), StreamTiming(0.3, 0.01, 0.9, True),
               StreamTiming(None, None, 0.2, False)]
    load = stream_load(timings, wall_s=2.0)
    assert load.requests == 3 and load.errors == 1 and load.requests_per_s == 1.0
    assert load.ttft_p50_ms == pytest.approx(200.0) and load.tpot_p50_ms == pytest.approx(10.0)


def _round(target: str, rps: float, p50: float, p99: float, router: float | None,
           requests: int = 1000, index: int = 0) -> Round:
    return Round("short", target, index, Load(requests, 0, rps, p50, p99), wall_s=2.0,
                 router_cpu_s=router, backend_cpu_s=0.1, loadgen_cpu_s=0.05, machine_cpu_s=1.0,
                 router_kernel_cpu_s=None if router is None else router / 4)


def test_summary_takes_medians_against_direct_and_cpu_over_all_rounds() -> None:
    rounds = [_round("direct", 1000, 1.0, 5.0, None),
              _round("kvgate", 500, 3.0, 9.0, 0.2, index=0),
              _round("direct", 1200, 1.2, 6.0, None, index=1),
              _round("kvgate", 700, 5.0, 13.0, 0.4, index=1)]
    direct, kvgate = summarize(rounds)
    assert direct.target == "direct" and direct.router_cpu_us_per_request is None
    assert kvgate.requests_per_s == 600 and kvgate.ratio == pytest.approx(600 / 1100)
    assert kvgate.added_p50_ms == pytest.approx(4.0 - 1.1)
    assert kvgate.added_p99_ms == pytest.approx(11.0 - 5.5)
    assert kvgate.router_cpu_us_per_request == pytest.approx(0.6e6 / 2000)
    assert kvgate.router_kernel_cpu_us_per_request == pytest.approx(0.15e6 / 2000)
    assert direct.router_kernel_cpu_us_per_request is None
    assert kernel_split([direct, kvgate]) == ["  short  kvgate                    300 us/req =  225 "
                                              "user +  75 kernel"]
    assert kvgate.requests_per_s_per_core == pytest.approx(1e6 / 300)
    assert kvgate.router_cores == pytest.approx(0.6 / 4.0)
    assert kvgate.backend_cpu_us_per_request == pytest.approx(0.2e6 / 2000)
    assert kvgate.other_cores == pytest.approx((2.0 - 0.6 - 0.2 - 0.1) / 4.0)
    assert direct.other_cores == pytest.approx((2.0 - 0.2 - 0.1) / 4.0)


def test_the_busiest_process_share_is_over_all_rounds_and_only_for_several_processes() -> None:
    def rnd(index: int, split: tuple[float, ...]) -> Round:
        return Round("short", "kvgate_kv_hf_p2", index, Load(1000, 0, 500.0, 1.0, 2.0), 2.0,
                     sum(split) + 0.1, 0.1, 0.05, 1.0, split)
    lopsided, = summarize([rnd(0, (0.9, 0.1)), rnd(1, (0.5, 0.5))])
    assert lopsided.processes == 2
    assert lopsided.busiest_process_share == pytest.approx(1.4 / 2.0)
    one, = summarize([_round("kvgate_kv_hf_p1", 500, 3.0, 9.0, 0.2)])
    assert one.busiest_process_share is None and one.processes == 1
    assert process_shares([lopsided, one]) == [
        "  short    kvgate_kv_hf_p2        busiest of 2 processes: 70% of their CPU (even: 50%)"]


def test_the_supervisor_cpu_is_what_the_tree_spent_outside_its_children() -> None:
    # two rounds of 1,000 requests: 0.1 s and 0.3 s outside the children -> 200 us per request
    rounds = [Round("short", "kvgate_kv_hf_p2", 0, Load(1000, 0, 500.0, 1.0, 2.0), 2.0,
                    1.1, 0.1, 0.05, 1.0, (0.5, 0.5)),
              Round("short", "kvgate_kv_hf_p2", 1, Load(1000, 0, 500.0, 1.0, 2.0), 2.0,
                    1.3, 0.1, 0.05, 1.0, (0.5, 0.5))]
    two, = summarize(rounds)
    assert two.supervisor_cpu_us_per_request == pytest.approx(200.0)
    assert two.router_cpu_us_per_request == pytest.approx(1200.0)
    one, = summarize([_round("kvgate_kv_hf_p1", 500, 3.0, 9.0, 0.2)])
    assert one.supervisor_cpu_us_per_request is None


def test_the_prediction_says_where_a_supervisor_binds_before_the_cores() -> None:
    def summary(target: str, cpu_us: float, sup_us: float | None) -> Summary:
        return Summary("short", target, 1, 1000, 0, 1.0, None, 1.0, 2.0, None, None, None,
                       None, None, cpu_us, 10.0, 5.0, None, 0.1, 0.1, 0.0, None, 2, sup_us)
    lines = prediction([summary("one", 100.0, None), summary("bound", 100.0, 10.0),
                        summary("free", 100.0, 5.0)], cores=16)
    assert lines[0].endswith("~   160000 req/s on 16 cores")
    assert lines[1].endswith("its supervisor 10.0 us/req (one process): at most ~100000 req/s"
                             ", which binds first")
    assert lines[2].endswith("its supervisor 5.0 us/req (one process): at most ~200000 req/s")


def _summary(case: str, target: str, rps: float, ratio: float | None = None,
             added_p99: float | None = None, cpu_us: float | None = None,
             ttft_p99: float | None = None) -> Summary:
    return Summary(case, target, 1, 1000, 0, rps, ratio, 1.0, 2.0, None, added_p99, None,
                   ttft_p99, None, cpu_us, 10.0, 5.0, None, 0.1, 0.1, 0.0)


def test_kvgate_cpu_is_split_at_its_layers_only_where_the_layers_ran() -> None:
    summaries = [_summary("short", "direct", 9000),
                 _summary("short", "python_floor", 8000, cpu_us=26.0),
                 _summary("short", "kvgate_plumbing", 7000, cpu_us=51.0),
                 _summary("short", "kvgate_kv_hf_p1", 2500, cpu_us=386.0),
                 _summary("short", "vllm_router_rr", 8000, cpu_us=123.0),
                 _summary("delay20", "kvgate_plumbing", 5000, cpu_us=80.0),
                 _summary("delay20", "kvgate_rr_simple_p1", 3500, cpu_us=280.0),
                 _summary("stream", "kvgate_kv_hf_p1", 300, cpu_us=1700.0)]
    lines = split_cpu(summaries)
    assert [line.split() for line in lines] == [
        ["short", "kvgate_kv_hf_p1", "386", "us/req", "=", "51", "layers", "+", "335",
         "features", "(a", "bare", "Python", "proxy:", "26)"],
        ["delay20", "kvgate_rr_simple_p1", "280", "us/req", "=", "80", "layers", "+", "200",
         "features"]]


def test_verdicts_say_met_missed_and_not_run_for_every_target() -> None:
    summaries = [
        _summary("delay20", "direct", 6000, 1.0, 0.0),
        _summary("delay20", "kvgate_kv_hf_p1", 5600, 0.93, 4.0),
        _summary("delay20", "kvgate_kv_hf_p2", 5900, 0.98, 12.0),
        _summary("short", "vllm_router_rr", 9000, cpu_us=50.0),
        _summary("short", "kvgate_kv_hf_p1", 3000, cpu_us=90.0),
        _summary("short", "kvgate_kv_hf_p2", 2900, cpu_us=110.0),
        _summary("stream", "sglang_rr", 300, ttft_p99=100.0),
        _summary("stream", "vllm_router_rr", 300, ttft_p99=150.0),
        _summary("stream", "kvgate_kv_hf_p1", 300, ttft_p99=119.0),
    ]
    got = {(v.goal.split(":")[0], v.target): v.met for v in evaluate(summaries, processes=2)}
    assert got[("delay20", "kvgate_kv_hf_p1")] is True
    assert got[("delay20", "kvgate_kv_hf_p2")] is False  # p99 +12 ms
    assert got[("short", "kvgate_kv_hf_p1")] is True
    assert got[("short", "kvgate_kv_hf_p2")] is False  # 2.2x
    assert got[("stream", "kvgate_kv_hf_p1")] is True  # against the best, sglang's 100 ms
    assert got[("stream", "kvgate_kv_hf_p2")] is None
    assert got[("2 processes do not lose to 1 (req/s)", "kvgate_kv_hf_p2 in delay20")] is True
    assert got[("2 processes do not lose to 1 (req/s)", "kvgate_kv_hf_p2 in short")] is False
    assert got[("2 processes do not lose to 1 (req/s)", "kvgate_rr_simple_p2 in short")] is None


def test_json_has_null_where_a_percentile_had_no_values() -> None:
    assert finite({"a": [1.0, math.nan], "b": {"c": math.nan, "d": "x"}}) == {
        "a": [1.0, None], "b": {"c": None, "d": "x"}}


def test_rounds_rotate_so_every_target_leads_once() -> None:
    assert [rotated("abc", i)[0] for i in range(4)] == ["a", "b", "c", "a"]
    assert rotated([], 3) == []


def test_targets_chosen_by_name_always_include_direct_and_p2_means_n_processes() -> None:
    all_targets = targets(4)
    names = [t.name for t in choose(all_targets, ["kvgate_kv_hf_p2", "sglang_rr"], 4)]
    assert names == ["direct", "kvgate_kv_hf_p4", "sglang_rr"]
    assert [t.name for t in targets(1) if t.kind == "kvgate"] == [
        "kvgate_rr_simple_p1", "kvgate_kv_hf_p1"]
    assert [(t.name, t.policy) for t in targets(1) if t.kind == "floor"] == [
        ("python_floor", "bare"), ("kvgate_plumbing", "plumbing")]
    with pytest.raises(SystemExit, match="nope"):
        choose(all_targets, ["nope"], 4)


async def _call(app: Any, body: bytes) -> list[bytes]:
    sent: list[bytes] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            sent.append(msg["body"])

    await app({"type": "http", "path": "/v1/chat/completions"}, receive, send)
    return sent


def test_noop_stream_is_shaped_as_vllm_with_shared_decode_steps() -> None:
    app = noop.make_app(noop.NoopBehaviour(stream_chunks=8, chunk_interval_s=0.005))
    body = b'{"stream": true, "stream_options": {"include_usage": true}}'

    async def two_streams() -> list[list[bytes]]:
        return list(await asyncio.gather(_call(app, body), _call(app, body)))

    for parts in asyncio.run(two_streams()):
        stream = b"".join(parts)
        clock = StreamClock(0.0)
        clock.feed(stream, 1.0)
        assert clock.contents == 8 and clock.done
        assert b'"delta":{"role":"assistant","content":""}' in parts[0]
        assert b'"finish_reason":"stop"' in parts[-2]
        assert b'"completion_tokens":9' in parts[-2] and parts[-2].endswith(b"data: [DONE]\n\n")


def test_noop_decode_steps_wake_every_waiter_on_one_tick() -> None:
    steps = noop.DecodeSteps(0.01)

    async def waiters() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(steps.wait() for _ in range(50)))
        return loop.time() - t0

    elapsed = asyncio.run(waiters())
    assert 0.009 <= elapsed < 0.1 and not math.isnan(elapsed)


# -- the isolation case -------------------------------------------------------------------------


def test_isolation_is_a_case_by_name_only_and_kvgate_gets_a_long_pool_for_it() -> None:
    assert build_parser().parse_args(["--case", ISOLATION]).case == [ISOLATION]
    assert ISOLATION not in [c.name for c in CASES]
    (hf,) = [t for t in targets(2) if t.name == "kvgate_kv_hf_p1"]
    one = kvgate_config(hf, "http://b", 1, Path("tok"))
    two = kvgate_config(hf, "http://b", 1, Path("tok"), long_pool=("http://long", 163840))
    assert [p["name"] for p in one["pools"]] == ["fleet"]
    assert two["pools"][1] == {"name": "long", "max_context_tokens": 163840,
                               "policy": "kv_aware", "workers": [{"url": "http://long"}]}
    assert wrk_argv("http://g", 3, 16, Path("p.lua"))[-1] == "http://g/v1/chat/completions"


def test_flood_prompts_are_each_different_and_the_same_on_every_run() -> None:
    texts = [flood_text(i, 2000, 1.3) for i in range(3)]
    assert texts[0] == flood_text(0, 2000, 1.3)
    assert len(set(texts)) == 3 and texts[1].startswith("Request 1. ")
    assert len(texts[0].split()) == pytest.approx(2000 / 1.3, abs=3)
    assert orjson.loads(flood_body("x"))["messages"] == [{"role": "user", "content": "x"}]


def _phase(target: str, p50: float, p99: float, router: float | None,
           flood: FloodLoad | None) -> Phase:
    case = FLOOD_CASE if flood else ISOLATION_CASE
    rnd = Round(case.name, target, 0, Load(1000, 0, 500.0, p50, p99), wall_s=2.0,
                router_cpu_s=router, backend_cpu_s=0.1, loadgen_cpu_s=0.05, machine_cpu_s=1.0)
    return Phase(rnd, flood, 0.001 if flood else 0.0)


def _isolation_run(served: int) -> list[Isolation]:
    flood = FloodLoad(4, served, 4 - served, 0, 300.0, 500.0)
    phases = [_phase("direct", 20.0, 30.0, None, None), _phase("direct", 20.0, 32.0, None, flood),
              _phase("kvgate_kv_hf_p1", 25.0, 40.0, 0.4, None),
              _phase("kvgate_kv_hf_p1", 25.5, 50.0, 0.6, flood)]
    quiet = summarize([p.round for p in phases if p.flood is None])
    flooded = summarize([p.round for p in phases if p.flood is not None])
    return isolations(phases, quiet, flooded)


def test_isolation_compares_added_latency_per_phase_and_prices_a_long_prompt() -> None:
    (i,) = _isolation_run(served=4)
    assert (i.quiet_added_p50_ms, i.flood_added_p50_ms) == (5.0, 5.5)
    assert (i.quiet_added_p99_ms, i.flood_added_p99_ms) == (10.0, 18.0)
    assert i.ratio_p50 == pytest.approx(1.1) and i.ratio_p99 == pytest.approx(1.8)
    assert i.quiet_router_cpu_us_per_request == pytest.approx(400.0)
    assert i.router_cpu_ms_per_long_prompt == pytest.approx(0.2e3 / 4)  # 0.2 s more over 4


def test_isolation_verdicts_p50_and_p99_apart_and_missed_when_the_flood_was_refused() -> None:
    got = {(v.goal.split()[2], v.target): v.met
           for v in evaluate_isolation(_isolation_run(served=4),
                                       ["kvgate_kv_hf_p1", "kvgate_kv_hf_p2"])}
    assert got == {("p50", "kvgate_kv_hf_p1"): True, ("p99", "kvgate_kv_hf_p1"): False,
                   ("p50", "kvgate_kv_hf_p2"): None, ("p99", "kvgate_kv_hf_p2"): None}
    refused = evaluate_isolation(_isolation_run(served=3), ["kvgate_kv_hf_p1"])
    assert refused[0].met is False and "answered 3/4" in refused[0].detail
