"""kvgate serve | demo | sim | plan | bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gateway.config import ConfigError, load_settings


def _serve(args: argparse.Namespace) -> int:
    import math

    import uvicorn

    from gateway.app import create_app
    from gateway.server import GatewayServer, run, serve_until_signalled

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.listen.host
    port = args.port or settings.listen.port
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=args.log_level, access_log=False,
        timeout_graceful_shutdown=max(math.ceil(settings.shutdown.grace_s), 1),
    )
    server = GatewayServer(config, drain_delay_s=settings.shutdown.drain_delay_s,
                           on_drain=app.start_draining)
    run(serve_until_signalled(server), config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", "-c", help="YAML config file (KVGATE_* env overrides it)")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)
    for module in ("gateway.planner", "gateway.sim.cli", "gateway.demo", "gateway.bench.cli"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is noise
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
