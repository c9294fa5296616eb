"""kvgate serve | demo | sim | plan | bench."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from gateway.config import ConfigError, load_settings


def _serve(args: argparse.Namespace) -> int:
    from gateway.processes import SINGLE_PROCESS
    from gateway.supervisor import Supervisor, die_with_supervisor, inherited

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.listen.host
    port = args.port or settings.listen.port
    child = inherited(os.environ)  # set when this is one of the processes of a supervisor
    processes = args.processes or settings.listen.process_count()
    if child is None and processes > 1:
        child_argv = [sys.executable, "-m", "gateway.cli", "serve", "--log-level", args.log_level]
        if args.config is not None:
            child_argv += ["--config", args.config]
        _exit_now(Supervisor(settings, host=host, port=port, count=processes,
                             child_argv=child_argv).run())

    from gateway.server import serve  # not imported by the supervisor: it serves nothing itself

    role, sock = child if child is not None else (SINGLE_PROCESS, None)
    if child is not None:
        die_with_supervisor(os.environ)
    serve(settings, host=host, port=port, log_level=args.log_level, role=role, sock=sock)
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End a served process at once, once it has drained (or failed to start).

    By then every connection is closed and every resource released by the app's shutdown; what
    is left is the interpreter's finalization, which frees every module and object one by one:
    0.3-1 s for a gateway process on an idle machine, several seconds on a loaded one (measured:
    3.5 s between a child's "Application shutdown complete" and its exit at a load of 5 on 2
    cores). A rolling update waits for that, and a supervisor for each of its processes in
    turn. Logs and standard streams are flushed first; nothing else runs at exit (no atexit
    handler of the gateway's own: the supervisor removes a process's metric files itself)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _processes(value: str) -> int:
    """``--processes``: an integer >= 1, or ``auto`` (the usable cores)."""
    from gateway.config import ListenSettings

    try:
        return ListenSettings.model_validate({"processes": value}).process_count()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 1 or 'auto', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", "-c", help="YAML config file (KVGATE_* env overrides it)")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument("--processes", type=_processes, metavar="N|auto",
                       help="override listen.processes: gateway processes serving the port")
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
