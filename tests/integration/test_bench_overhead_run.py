"""The overhead benchmark run end to end on a small scale: kvgate and the two floors against
direct, one short round, with a flame graph of kvgate (``--profile``); the ``fresh`` case's wrk
script against a server that keeps what it sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from gateway.bench.overhead.cli import main
from gateway.bench.overhead.model import CHAT_BODY, FRESH_LUA, FRESH_WORDS, PROMPT
from gateway.bench.overhead.wrk import wrk_argv
from gateway.procs.net import LOOPBACK, free_port


def test_one_short_round_measures_kvgate_beside_direct_and_writes_its_flame_graph(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    rc = main(["--case", "short", "--target", "kvgate_rr_simple_p1", "--target", "python_floor",
               "--target", "kvgate_plumbing", "--duration-s", "1",
               "--rounds", "1", "--out", str(tmp_path), "--profile", str(tmp_path / "prof")],
              say=lines.append)
    assert rc == 0, "\n".join(lines)
    record = json.loads((tmp_path / "overhead.json").read_text())
    (case,) = record["cases"]
    summaries = {s["target"]: s for s in case["summaries"]}
    assert set(summaries) == {"direct", "kvgate_rr_simple_p1", "python_floor",
                              "kvgate_plumbing"}, case["skipped"]
    for name in ("kvgate_rr_simple_p1", "python_floor", "kvgate_plumbing"):
        measured = summaries[name]
        assert measured["requests_per_s"] > 0 and measured["errors"] == 0, name
        assert measured["router_cpu_us_per_request"] > 0, name
    # only kvgate is profiled: the floors are references, not the product
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "profile_short_kvgate_rr_simple_p1.svg"]
    svg = (tmp_path / "prof" / "profile_short_kvgate_rr_simple_p1.svg").read_text()
    assert svg.lstrip().startswith(("<?xml", "<svg")) and "dispatch" in svg
    assert (tmp_path / "overhead.png").stat().st_size > 0


def test_the_fresh_case_sends_a_valid_chat_with_a_new_user_message_every_time(
    tmp_path: Path,
) -> None:
    """wrk running ``FRESH_LUA`` against a server that keeps every body: each is ``CHAT_BODY``
    with another user message of about ``PROMPT``'s length, and no message comes twice."""
    bodies: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response({"ok": True})

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, LOOPBACK, port).start()
        script = tmp_path / "fresh.lua"
        script.write_text(FRESH_LUA)
        try:
            wrk = await asyncio.create_subprocess_exec(
                *wrk_argv(f"http://{LOOPBACK}:{port}", 1, 2, script),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await wrk.communicate()
            assert wrk.returncode == 0, out.decode()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
    assert len(bodies) > 50
    messages = []
    for raw in bodies:
        body = json.loads(raw)
        (message,) = body.pop("messages")
        assert body == {k: v for k, v in CHAT_BODY.items() if k != "messages"}
        assert message["role"] == "user"
        words = message["content"].split()
        assert len(words) == 9 and all(w in FRESH_WORDS for w in words[:8]), words
        messages.append(message["content"])
    assert len(set(messages)) == len(messages)
    assert 0.5 < sum(map(len, messages)) / len(messages) / len(PROMPT) < 2.0
