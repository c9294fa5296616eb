"""Python calls per request: the gateway's ASGI app called in this process (no server, no
socket on the client side) against the no-op backend in another, under ``cProfile``.

Steps: start the no-op backend; build the app of ``kvgate_config`` (the overhead benchmark's
one-pool config: ``kv_aware`` with the tiny model's HF tokenizer and chat template, or
``round_robin`` with the ``simple`` tokenizer) and run its lifespan; wait until ``/ready``;
send ``--warmup`` requests unmeasured (caches, the worker's first scrape, the connection pool),
then ``--requests`` requests one after another with the profiler on (on uvloop, as ``gateway.server`` runs); print the calls per
request and the functions with the most calls (``--top``), and write them as JSON.

Why a count and not a time: on this shared 2-core machine a CPU time moves by more than most
changes of the request path measure (``gateway.bench.overhead.ab`` pairs two checkouts to read
the time). The number of Python calls per request is deterministic to within a call or two
(periodic work: health checks, scrapes, metrics of a slow loop turn), and each call costs about
the same on one interpreter, so it tells whether a change removed work before any timing does.
It is not the CPU: C functions (the tokenizer, orjson, the socket writes) count once per call
whatever they cost, and the server's own work (``gateway.httpd``) is not in it.

Run: ``python -m gateway.bench.overhead.calls [--policy kv_aware|round_robin] [--stream]
[--requests 2000] [--out results/calls.json]``; ``--base DIR`` runs the same measurement
with the code of another checkout (a subprocess with ``DIR`` first on its path) and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway import server
from gateway.bench.overhead.model import CHAT_BODY, STREAM_BODY, Target
from gateway.bench.overhead.run import kvgate_config
from gateway.httpd.protocol import ON_DISCONNECT
from gateway.procs.kvgate import noop_backend
from gateway.procs.net import LOOPBACK, free_port
from gateway.procs.process import REPO_ROOT, child_env
from gateway.procs.vllm import tiny_model_path

READY_TIMEOUT_S = 60.0
_RUN_THIS = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"


def _scope(method: str, path: str, body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "",
            "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "client": (LOOPBACK, 1), "server": (LOOPBACK, 80),
            # as ``gateway.httpd`` offers it: the proxy registers for the client's disconnect
            # instead of watching ``receive`` (a timer per request under other servers)
            "extensions": {ON_DISCONNECT: _ignore_disconnect}}


def _ignore_disconnect(callback: object) -> None:
    """The server's ``kvgate.on_disconnect``: these clients never leave."""


async def _call(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request through the ASGI app; its status (the body is read and dropped)."""
    sent = False
    status = 0
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(method, path, body), receive, send)
    done.set()
    return status


async def measure(policy: str, tokenizer: str, stream: bool, requests: int, warmup: int,
                  backend_url: str, hf_tokenizer: Path) -> dict[str, Any]:
    from gateway.app import create_app
    from gateway.config import build_settings

    target = Target("calls", "", "kvgate", policy, tokenizer)
    settings = build_settings(kvgate_config(target, backend_url, free_port(), hf_tokenizer))
    app = create_app(settings)
    body = orjson.dumps(STREAM_BODY if stream else CHAT_BODY)
    async with app.api.router.lifespan_context(app.api):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while await _call(app, "GET", "/ready") != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway did not get ready")
            await asyncio.sleep(0.1)
        for _ in range(warmup):
            await _call(app, "POST", "/v1/chat/completions", body)
        profiler = cProfile.Profile()
        failed = 0
        profiler.enable()
        for _ in range(requests):
            failed += await _call(app, "POST", "/v1/chat/completions", body) != 200
        profiler.disable()
    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[1] for v in raw.values())  # primitive and recursive calls alike
    top = sorted(raw.items(), key=lambda kv: kv[1][1], reverse=True)
    return {"policy": policy, "tokenizer": tokenizer, "stream": stream, "requests": requests,
            "failed": failed, "calls_per_request": total / requests,
            "top": [{"function": f"{Path(f).name}:{line}({name})",
                     "calls_per_request": v[1] / requests}
                    for (f, line, name), v in top[:60]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.overhead.calls",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=("kv_aware", "round_robin"), default="kv_aware")
    parser.add_argument("--stream", action="store_true", help="streamed chats (64 chunks)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--hf-tokenizer", type=Path, default=tiny_model_path(),
                        help="tokenizer + chat template directory of kv_aware")
    parser.add_argument("--base", type=Path, default=None,
                        help="another checkout: measured the same way, printed beside this one")
    parser.add_argument("--out", type=Path, default=None, help="write the result(s) as JSON")
    parser.add_argument("--backend-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokenizer = "hf" if args.policy == "kv_aware" else "simple"
    own: list[str] = ["--policy", args.policy, "--requests", str(args.requests),
                      "--warmup", str(args.warmup),
                      "--hf-tokenizer", str(args.hf_tokenizer.resolve())] + (["--stream"] if args.stream else [])
    if args.backend_url is not None:  # a measurement of its own (``--base``'s subprocess)
        result: dict[str, Any] = {}

        async def run() -> None:
            result.update(await measure(args.policy, tokenizer, args.stream, args.requests,
                                        args.warmup, args.backend_url, args.hf_tokenizer))

        server.run(run())  # uvloop, as the gateway's server runs
        if args.json:
            print(json.dumps(result))
        return 0
    noop, url = noop_backend(free_port(), stream_chunks=64)
    results: dict[str, dict[str, Any]] = {}
    noop.start(timeout_s=READY_TIMEOUT_S)
    try:
        runs = ([("base", args.base)] if args.base else []) + [("this", REPO_ROOT)]
        for name, root in runs:
            # this file run with ``root``'s package first on the path (``-c``: the working
            # directory), so a checkout without this module is measured the same way
            out = subprocess.run(
                [sys.executable, "-c", _RUN_THIS, *own, "--backend-url", url, "--json"],
                cwd=root, env=child_env({"PYTHONPATH": str(root)}),
                capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        noop.stop()
    for name in sorted(results, key=lambda n: n != "base"):
        r = results[name]
        print(f"{name}: {r['calls_per_request']:.1f} Python calls per request "
              f"({r['policy']}, {'stream' if r['stream'] else 'short chat'}, {r['requests']} "
              f"requests, {r['failed']} failed)")
        for t in r["top"][:args.top]:
            print(f"  {t['calls_per_request']:7.2f}  {t['function']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
