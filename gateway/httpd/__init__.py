"""A lean HTTP/1.1 server for ASGI 3 apps: what ``kvgate serve`` runs instead of uvicorn.

uvicorn (its httptools protocol, ``RequestResponseCycle`` and ASGI plumbing) was 13 % of a short
chat request's CPU in the gateway's profile, plus part of the asyncio share. This package keeps
what kvgate needs of it and nothing else: no WebSocket, no TLS, no proxy headers, no access log,
no reload. Per connection, the steps:

1. ``HttpConnection`` (an ``asyncio.Protocol``) feeds every byte to ``httptools``; a request head
   becomes an ASGI ``http`` scope and a ``Cycle``; the app runs in one task per request and no
   other task: timers are deadlines swept once a second by the server, ``receive`` waits on a
   future created only when nothing is buffered (a small body has usually arrived before the app
   asks for it, so the common request never waits);
2. the answer's head waits for the app's first body message in the same loop step and goes out
   with it (one ``write``, one syscall and one loopback segment where uvicorn makes two); a
   stream's head goes at the end of that step, no later than before; chunked encoding when the
   length is unknown, as uvicorn (the relay's whole answers have none);
3. keep-alive; pipelined requests are parsed and queued, started in order as each answer
   completes; ``Connection: close`` and HTTP/1.0 close after the answer.

What a hostile client meets (``HttpLimits``): a head over ``max_head_bytes`` gets 431, a
malformed request 400, a WebSocket upgrade 403, each on a connection then closed; a head not
complete within ``head_timeout_s`` of its first byte (slowloris) or of the connection, and a
keep-alive connection idle for ``keep_alive_s``, are closed. Reading pauses while a request's
unread body passes ``body_high_water_bytes`` (64 KiB as uvicorn: ``gateway.dispatch``'s
``EARLY_BODY_BYTES`` relies on it) and while a pipelined request waits; ``send`` waits while
the transport's write buffer is full, and a client that takes no byte of its answer for
``send_timeout_s`` (60 s, nginx's ``send_timeout``) is dropped: it stopped reading, and its
stream would hold a worker and a budget reservation for as long as it liked. A lost connection is ``http.disconnect`` to ``receive``
(at once when the body was read, as uvicorn: the dispatcher watches for it). An app that fails
before its answer started gets a plain 500, after it the connection is closed; no task
exception is left unhandled.

``HttpServer.serve`` runs the ``lifespan`` protocol (a failed startup raises ``StartupFailed``:
the process exits with ``STARTUP_FAILURE``, uvicorn's status 3, which ``gateway.supervisor``
reads), listens on ``host:port`` or an inherited socket, and on ``request_stop`` stops
accepting, closes idle connections, lets the requests in flight finish for ``grace_s`` (each
connection closed after its answer), cancels what remains and runs the lifespan shutdown;
``force_stop`` skips the waiting. ``gateway.server`` adds kvgate's signals and drain phase.

Cost, measured on this 2-core machine (shared with other work, so noisy; runs alternated,
medians), CPU from /proc per request:

- a trivial ASGI app, ``wrk -t1 -c32`` posting a small JSON body on loopback: uvicorn 0.54
  (httptools, uvloop) 28.5 us, this server 19.3 us (a third less). Of those 19 us the write
  syscall and the loop's epoll/recv are three quarters (py-spy); this package's Python the rest;
- the gateway (kv_aware, HF tokenizer, one process, 0 ms no-op backend, c=32; six alternated
  4 s rounds of each on the same tree): uvicorn 381 us, this server 369 us (-3 %; the paired
  rounds, 5 of 6 in its favour, say -8 %). In py-spy the server's frames fall from 18.7 % to
  14.7 % of the process. A small gain, under ``gateway.bench.overhead``'s noise here.

The trade-off is owning ~750 lines of protocol code that uvicorn's users test for free, kept
honest by ``tests/unit/test_httpd.py`` (raw bytes over real sockets, hostile clients first).

Modules: ``protocol`` (a connection and its requests), ``server`` (lifespan, listening,
deadlines, shutdown).
"""

from gateway.httpd.protocol import (
    ON_DISCONNECT,
    SEND_BODY_NOWAIT,
    App,
    HttpLimits,
    Message,
    Receive,
    Scope,
    Send,
)
from gateway.httpd.server import LISTEN_BACKLOG, STARTUP_FAILURE, HttpServer, StartupFailed

__all__ = ["LISTEN_BACKLOG", "ON_DISCONNECT", "SEND_BODY_NOWAIT", "STARTUP_FAILURE", "App", "HttpLimits",
           "HttpServer", "Message", "Receive", "Scope", "Send", "StartupFailed"]
