"""Who may publish KV events to a socket the gateway binds (bind mode): a ZAP handler with an
allow-list per socket.

In bind mode the gateway's SUB socket listens and the worker's PUB connects to it, so without a
check anyone who reaches the port can feed the prefix index (false cache hits steer traffic) or
reset it. ZeroMQ's answer is ZAP (RFC 27): a socket given a ``ZAP_DOMAIN`` asks the handler
bound at ``inproc://zeromq.zap.01`` of its context about every incoming connection, before any
message of it is read, and the handler answers 200 or 400 from the peer's IP address. This
module is that handler, one per ZMQ context (libzmq allows one), with an allow-list per domain:
each bound subscriber gets its own domain, so the worker allowed on one port cannot publish on
another worker's. pyzmq's ``Authenticator`` has one list for the whole context, hence our own
(the protocol is one six-frame request and one reply per connection).

An allow-list holds IP addresses, CIDR networks and host names; a name is resolved (without
blocking the loop) when a connection asks and kept ``RESOLVE_TTL_S``, so a worker whose address
changes behind its name is still let in. Empty: loopback only (a worker on the same host).

What it is not: authentication of the worker. vLLM's publisher speaks ZMQ's NULL mechanism (no
CURVE keys), so the peer's address is all there is; on a network where addresses can be taken
over, connect mode (the gateway connects to the worker's PUB) is the one to use. Unix sockets
(``ipc://``) are guarded by their file's permissions instead and never reach the handler.

Cost: nothing per message; one handler round trip per connection (plus a DNS lookup when a name
must be resolved again).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from gateway.config import parse_peer

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by libzmq: one handler per context
RESOLVE_TTL_S = 30.0
RESOLVE_TIMEOUT_S = 2.0
LOOPBACK = ("127.0.0.0/8", "::1")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AllowList:
    """Peers allowed to connect: networks (an address is a /32 or /128) and host names."""

    networks: tuple[IpNetwork, ...]
    hosts: tuple[str, ...]

    @classmethod
    def of(cls, peers: Iterable[str]) -> AllowList:
        """Parse ``peers`` (addresses, CIDR networks, host names); empty: loopback only."""
        parsed = [parse_peer(spec) for spec in tuple(peers) or LOOPBACK]
        return cls(tuple(p for p in parsed if not isinstance(p, str)),
                   tuple(p for p in parsed if isinstance(p, str)))


def peer_address(text: str) -> IpAddress | None:
    """The address a connection comes from as ZAP gives it; IPv4 seen through an IPv6 socket
    (``::ffff:10.0.0.5``) as IPv4. None when it is no IP address."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class PeerGate:
    """The ZAP handler of one ZMQ context. See the module docstring.

    The constructor does no I/O; ``open()`` binds the handler and starts its task (it must run
    before any socket with a domain binds: libzmq lets connections in when no handler answers);
    ``close_nowait()`` stops it and returns the task to await.
    """

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self._context = context
        self._domains: dict[str, AllowList] = {}
        self._next = 0
        self._resolved: dict[str, tuple[float, frozenset[IpAddress]]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.refused: Counter[str] = Counter()  # by domain

    def open(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self._context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._socket = sock
        self._task = loop.create_task(self._serve(sock), name="kv-events-zap")

    def close_nowait(self) -> list[asyncio.Task[None]]:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        return [task] if task is not None else []

    def allow(self, peers: Iterable[str]) -> str:
        """A new domain whose connections must come from ``peers``; set it as the socket's
        ``ZAP_DOMAIN`` before binding."""
        self._next += 1
        domain = f"kv-events-{self._next}"
        self._domains[domain] = AllowList.of(peers)
        return domain

    def forget(self, domain: str) -> None:
        self._domains.pop(domain, None)
        self.refused.pop(domain, None)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                request = await sock.recv_multipart()
            except zmq.ZMQError:  # closed
                return
            # [version, request id, domain, address, identity, mechanism, credentials...]
            if len(request) < 6 or request[0] != b"1.0":
                reply = [b"1.0", request[1] if len(request) > 1 else b"", b"400",
                         b"malformed ZAP request", b"", b""]
            else:
                domain = request[2].decode(errors="replace")
                address = request[3].decode(errors="replace")
                try:
                    ok = await self._admits(domain, address)
                except Exception:  # a bug here must not leave every later handshake unanswered
                    log.exception("kv events (%s): checking %s failed; refused", domain, address)
                    ok = False
                reply = [b"1.0", request[1], b"200" if ok else b"400",
                         b"OK" if ok else b"not an allowed peer", b"", b""]
            try:
                await sock.send_multipart(reply)
            except zmq.ZMQError:
                return

    async def _admits(self, domain: str, address: str) -> bool:
        allowed = self._domains.get(domain)
        peer = peer_address(address)
        if allowed is not None and peer is not None:
            if any(peer in net for net in allowed.networks):
                return True
            for host in allowed.hosts:
                if peer in await self._resolve(host):
                    return True
        n = self.refused[domain] = self.refused[domain] + 1
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th ... : a stranger knocking must not flood logs
            log.warning("kv events (%s): refused a connection from %s, not an allowed peer"
                        " (kv_events.bind_peers); %d so far", domain, address or "?", n)
        return False

    async def _resolve(self, host: str) -> frozenset[IpAddress]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        cached = self._resolved.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        found: frozenset[IpAddress] = frozenset()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            found = frozenset(a for info in infos if (a := peer_address(str(info[4][0]))))
        self._resolved[host] = (now + RESOLVE_TTL_S, found)
        return found
