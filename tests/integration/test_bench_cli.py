"""``kvgate bench`` end to end over real sockets: the no-op backend, a recording fake, the simulator.

The CLI runs in-process (``main(argv)``), against servers on loopback ports; outputs are read back
from ``--out``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from gateway import cli as kvgate_cli
from gateway.bench import cli as bench_cli
from gateway.bench import noop
from gateway.bench.loadgen import calibrate_tokens_per_word
from gateway.sim import SimFleet, SimWorkerConfig
from tests.harness import answer_probe, read_asgi_body, serve_app

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    with serve_app(noop.app) as url:
        yield url


class Recorder:
    """The no-op backend, optionally slowed down, remembering every completion request."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await noop.app(scope, receive, send)
            return
        body = await read_asgi_body(receive)
        if scope["method"] == "POST":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.requests.append((headers, orjson.loads(body)))
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await noop.app(scope, replay, send)


async def usage_counts_words(scope: Scope, receive: Receive, send: Send) -> None:
    """A server without /tokenize whose usage says 3 tokens a word plus 10 for the template."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await answer_probe(scope, send)
        return
    body = await read_asgi_body(receive)
    status, answer = 404, b"{}"
    if scope["path"] == "/v1/chat/completions":
        n_words = len(orjson.loads(body)["messages"][0]["content"].split())
        status = 200
        answer = orjson.dumps({"usage": {"prompt_tokens": 10 + 3 * n_words}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


async def test_tokens_per_word_falls_back_to_the_usage_of_two_probe_requests() -> None:
    with serve_app(usage_counts_words) as url:
        measured = await calibrate_tokens_per_word([url], "m", probe_url=url)
    assert measured == (3.0, f"measured by usage from {url}")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = bench_cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_two_targets_writes_json_png_and_a_side_by_side_table(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli([
        "--compare", f"direct={backend}", f"again={backend}", "--workload", "shared-prefix",
        "--requests", "6", "--prefix-tokens", "50", "--max-tokens", "8", "--concurrency", "2",
        "--out", str(tmp_path), "--progress",
    ], capsys)
    assert rc == 0, out + err
    assert "model noop" in out  # found on GET /v1/models
    assert "tokens/word 1.00 (assumed;" in out  # noop: no /tokenize, usage always 1 token
    table = out[out.index("== comparison"):].splitlines()
    assert table[1].split()[0] == "target"
    assert table[2].startswith("direct") and table[3].startswith("again")
    assert "x)" in table[3] and "x)" not in table[2]  # ratios to the first target
    assert "\r" in err and "direct" in err  # the progress line

    data = json.loads((tmp_path / "bench.json").read_text())
    assert [t["name"] for t in data["targets"]] == ["direct", "again"]
    assert data["config"]["workload"]["name"] == "shared-prefix"
    for t in data["targets"]:
        assert len(t["records"]) == 6
        assert t["summary"]["ok"] == 6 and t["summary"]["errors"] == {}
        assert t["summary"]["ttft_s"]["p50"] > 0
        rec = t["records"][0]
        assert rec["completion_tokens"] == 5 and rec["chunks"] == 4  # noop: 4 chunks, usage 5
        assert rec["tpot_s"] is not None
        assert t["prefix_cache"] is None  # no --worker-url
    assert (tmp_path / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "curves.png").exists()  # one group only


def test_kvgate_bench_multiturn_sends_sessions_usage_and_real_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = Recorder()
    with serve_app(recorder) as url:
        rc = kvgate_cli.main([
            "bench", "--url", url, "--model", "noop", "--workload", "multiturn",
            "--sessions", "2", "--turns", "3", "--concurrency", "4", "--ignore-eos",
            "--real-answers", "--max-tokens", "16", "--tokens-per-word", "1",
            "--header", "X-Extra: yes", "--out", str(tmp_path), "--no-progress",
        ])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(recorder.requests) == 6
    by_session: dict[str, list[dict[str, Any]]] = {}
    for headers, body in recorder.requests:
        assert headers["x-extra"] == "yes"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 16
        by_session.setdefault(headers["x-session-id"], []).append(body)
    assert len(by_session) == 2
    salts = {b["messages"][0]["content"].split("]")[0] for _, b in recorder.requests}
    assert len(salts) == 1 and salts.pop().startswith("[")  # one salt for the whole run
    for bodies in by_session.values():
        # every turn is sent after the previous one: its history ends with the real answer
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        assert bodies[1]["messages"][2] == {"role": "assistant", "content": "okokokok"}
        assert bodies[2]["messages"][:4] == bodies[1]["messages"]
    for group in ("turn-1", "turn-2", "turn-3"):
        assert group in out
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_open_loop_stops_at_the_duration_and_cancels_what_outlives_the_drain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve_app(Recorder(delay_s=0.4)) as url:
        rc, out, _ = run_cli([
            "--url", url, "--workload", "mixed", "--short-tokens", "20", "--long-fraction", "0",
            "--rate", "40", "--duration-s", "0.6", "--drain-s", "0.1", "--requests", "1000",
            "--out", str(tmp_path), "--no-plots", "--tokens-per-word", "1",
        ], capsys)
    assert rc == 0, out
    assert "open loop 40.0/s" in out
    records = json.loads((tmp_path / "bench.json").read_text())["targets"][0]["records"]
    assert 5 < len(records) < 60  # about 0.6 s x 40/s, not 1000
    assert all(r["scheduled_s"] < 0.6 for r in records)
    errors = {r["error"] for r in records}
    assert errors == {None, "cancelled"}
    assert all(r["ttft_s"] >= 0.35 for r in records if r["error"] is None)
    assert not (tmp_path / "latency_cdf.png").exists()


def test_unreachable_target_is_counted_as_errors_and_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run_cli([
        "--url", "http://127.0.0.1:9", "--model", "m", "--workload", "doc-qa", "--requests",
        "3", "--doc-tokens", "20", "--out", str(tmp_path), "--no-plots",
    ], capsys)
    assert rc == 1
    assert "errors: connection_error=3" in out


def test_bad_arguments_are_refused_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.main(["--workload", "mixed"]) == 2
    assert "give --url" in capsys.readouterr().err
    assert bench_cli.main(["--url", "http://a", "--compare", "b=http://b"]) == 2
    assert "not both" in capsys.readouterr().err
    for bad in (["--compare", "nourl"], ["--extra-body", "[1]"], ["--lengths", "2k,x"]):
        with pytest.raises(SystemExit):
            bench_cli.main(["--url", "http://a", *bad])


@dataclasses.dataclass
class ThreadedFleet:
    urls: list[str]


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[ThreadedFleet]:
    """Two simulated workers on their own event loop in a thread (the CLI runs its own loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = SimWorkerConfig(time_scale=0.02, num_gpu_blocks=4096, max_model_len=32768)
    fleet = SimFleet([config, dataclasses.replace(config, seed=1)])
    try:
        urls = asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(60)
        yield ThreadedFleet(list(urls))
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def test_shared_prefix_on_two_simulated_workers_reads_a_fleet_hit_rate(
    sim_fleet: ThreadedFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w0, w1 = sim_fleet.urls
    rc, out, err = run_cli([
        "--compare", f"w0={w0}", f"w1={w1}", "--workload", "shared-prefix", "--requests", "12",
        "--prefixes", "2", "--prefix-tokens", "400", "--max-tokens", "8", "--ignore-eos",
        "--worker-url", w0, w1,
        "--reset-url", f"{w0}/reset_prefix_cache", f"{w1}/reset_prefix_cache",
        "--out", str(tmp_path), "--no-plots",
    ], capsys)
    assert rc == 0, out + err
    assert f"measured on {w0}/tokenize" in out
    assert "fleet prefix-cache hit rate" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    for t in data["targets"]:
        assert t["summary"]["ok"] == 12
        assert t["reset_ok"] is True
        cache = t["prefix_cache"]
        assert set(cache["workers"]) == {w0, w1}
        # 2 prefixes of ~400 tokens computed once, then reused by 10 requests
        assert 0.5 < cache["hit_rate"] < 1.0
        # sizes are in tokens: the simple tokenizer's 2 tokens per word were measured
        assert all(400 < r["prompt_tokens"] < 550 for r in t["records"])
        assert all(r["completion_tokens"] == 8 for r in t["records"])
    rates = [t["prefix_cache"]["hit_rate"] for t in data["targets"]]
    assert rates[0] == pytest.approx(rates[1])  # the reset made both start cold


def test_sweep_on_a_simulated_worker_draws_ttft_against_prompt_length(
    sim_fleet: ThreadedFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli([
        "--url", sim_fleet.urls[0], "--workload", "sweep", "--lengths", "1k,4k",
        "--per-length", "2", "--max-tokens", "4", "--ignore-eos", "--out", str(tmp_path),
    ], capsys)
    assert rc == 0, out + err
    groups = json.loads((tmp_path / "bench.json").read_text())["targets"][0]["groups"]
    assert list(groups) == ["1024", "4096"]
    assert groups["4096"]["prompt_tokens_mean"] > 3 * groups["1024"]["prompt_tokens_mean"]
    assert groups["4096"]["ttft_s"]["p50"] > groups["1024"]["ttft_s"]["p50"]  # longer prefill
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(("salt", "second_is_warm"), [("auto", False), ("none", True)])
def test_salt_keeps_a_second_target_on_the_same_worker_from_starting_warm(
    sim_fleet: ThreadedFleet, tmp_path: Path, capsys: pytest.CaptureFixture[str], salt: str,
    second_is_warm: bool,
) -> None:
    w0 = sim_fleet.urls[0]
    rc, out, err = run_cli([
        "--compare", f"first={w0}", f"second={w0}", "--workload", "doc-qa", "--requests", "6",
        "--docs", "1", "--doc-tokens", "600", "--max-tokens", "4", "--concurrency", "1",
        "--worker-url", w0, "--salt", salt, "--out", str(tmp_path), "--no-plots",
    ], capsys)
    assert rc == 0, out + err
    first, second = (t["prefix_cache"]["hit_rate"]
                     for t in json.loads((tmp_path / "bench.json").read_text())["targets"])
    assert first < 0.9  # the document was computed once, then reused 5 times
    if second_is_warm:
        assert second > 0.95  # everything, the first request included, was already cached
    else:
        assert second == pytest.approx(first, abs=0.02)
