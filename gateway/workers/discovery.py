"""Worker discovery from Kubernetes: the ready endpoints of EndpointSlices matching a label selector.

``KubernetesDiscovery.run(on_change)`` keeps a set of worker URLs (``http://ip:port``, the port
picked by name) equal to the ready endpoints of every ``discovery.k8s.io/v1`` EndpointSlice in a
namespace that matches a label selector, and calls ``on_change`` with the new frozen set each time
it changes (and once after the first list, even if empty).

The steps, as every Kubernetes controller does them:

1. LIST the slices (``?labelSelector=``); the list's ``resourceVersion`` is where the watch starts.
2. WATCH from there (``?watch=1&resourceVersion=&allowWatchBookmarks=true``): one JSON event per
   line, ``ADDED``/``MODIFIED``/``DELETED`` replace or drop one slice, ``BOOKMARK`` only moves the
   resourceVersion on. Every event's resourceVersion is remembered.
3. The server ends a watch after ``timeoutSeconds``: watch again from the last resourceVersion.
4. ``410 Gone`` (as the watch's HTTP status, or as an ``ERROR`` event carrying a Status with code
   410): the resourceVersion is too old for the server's history; go back to 1 (a relist replaces
   the whole state, so slices deleted meanwhile disappear).
5. A connection error or any other failure: wait (exponential backoff with jitter, reset by the
   next success) and watch again from the last resourceVersion, or relist if there is none.

Cost: one long-lived HTTP request per gateway replica; each event re-parses one slice (at most 100
endpoints). What this replaces: DNS discovery of a headless Service sees addresses but not
readiness transitions as they happen, nor named ports.

Parsing (``slice_urls``, ``parse_event``, ``LineSplitter``, ``SliceSet``) is pure and separate from
the I/O in ``KubernetesDiscovery``. In a cluster the service account's token and CA are read from
the standard paths (the token again on every request, since bound tokens rotate); tests pass a
``base_url`` of a local fake API server instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import random
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SLICE_NAME_LABEL = "kubernetes.io/service-name"


# --- pure parsing -------------------------------------------------------------------------------

def _host(address: str, address_type: str) -> str:
    if address_type == "IPv6":
        return f"[{ipaddress.IPv6Address(address)}]"
    if address_type == "IPv4":
        return str(ipaddress.IPv4Address(address))
    return address  # FQDN


def slice_urls(obj: Mapping[str, Any], port_name: str | None, scheme: str = "http") -> frozenset[str]:
    """The URLs of the ready endpoints of one EndpointSlice.

    ``port_name`` picks the port from the slice's ``ports`` (``None``: the slice must have exactly
    one port). A slice without that port gives no URL. An endpoint whose ``conditions.ready`` is
    absent counts as ready, as the EndpointSlice API says consumers should read an unknown state;
    ``ready: false`` (not ready, or terminating) does not.
    """
    ports = obj.get("ports") or []
    if port_name is None:
        chosen = [p for p in ports if p.get("port") is not None]
        if len(chosen) != 1:
            return frozenset()
    else:
        chosen = [p for p in ports if p.get("name") == port_name and p.get("port") is not None]
        if not chosen:
            return frozenset()
    port = int(chosen[0]["port"])
    address_type = str(obj.get("addressType", "IPv4"))
    urls = set()
    for endpoint in obj.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            try:
                host = _host(str(address), address_type)
            except ValueError:
                log.warning("EndpointSlice %s: bad %s address %r",
                            obj.get("metadata", {}).get("name"), address_type, address)
                continue
            urls.add(f"{scheme}://{host}:{port}")
    return frozenset(urls)


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK | ERROR
    obj: Mapping[str, Any]

    @property
    def resource_version(self) -> str | None:
        rv = self.obj.get("metadata", {}).get("resourceVersion")
        return str(rv) if rv else None

    @property
    def gone(self) -> bool:
        """An ERROR event whose Status says 410: the watch's resourceVersion is too old."""
        return self.type == "ERROR" and self.obj.get("code") == 410


class WatchFormatError(ValueError):
    """A watch line that is not a JSON watch event."""


def parse_event(line: bytes) -> WatchEvent:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise WatchFormatError(f"not JSON: {line[:200]!r}") from exc
    if (not isinstance(data, dict) or not isinstance(data.get("type"), str)
            or not isinstance(data.get("object"), dict)):
        raise WatchFormatError(f"not a watch event: {line[:200]!r}")
    return WatchEvent(data["type"], data["object"])


class LineSplitter:
    """Bytes in, complete lines out (a watch event may arrive in several chunks, or several
    events in one). No line length limit: one slice of 100 endpoints is tens of KiB."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line


@dataclass
class SliceSet:
    """The ready URLs of every slice, by slice name."""

    port_name: str | None
    scheme: str = "http"
    slices: dict[str, frozenset[str]] = field(default_factory=dict)

    def urls(self) -> frozenset[str]:
        out: set[str] = set()
        for urls in self.slices.values():
            out |= urls
        return frozenset(out)

    def replace_all(self, items: list[Mapping[str, Any]]) -> None:
        self.slices = {_name(o): slice_urls(o, self.port_name, self.scheme) for o in items}

    def apply(self, event: WatchEvent) -> None:
        if event.type in ("ADDED", "MODIFIED"):
            self.slices[_name(event.obj)] = slice_urls(event.obj, self.port_name, self.scheme)
        elif event.type == "DELETED":
            self.slices.pop(_name(event.obj), None)


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def backoff_delays(initial_s: float, max_s: float, rng: random.Random) -> Iterator[float]:
    """initial, 2x, 4x ... up to max, each with +-20% jitter so replicas do not reconnect in step."""
    delay = initial_s
    while True:
        yield delay * rng.uniform(0.8, 1.2)
        delay = min(delay * 2, max_s)


# --- I/O ----------------------------------------------------------------------------------------

class _Gone(Exception):
    """410: relist."""


class KubernetesDiscovery:
    """Lists and watches EndpointSlices; see the module docstring.

    ``base_url``: the API server (``https://host:port``); ``None`` for in-cluster, from
    ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``. ``token_path``/``ca_path``: the
    service account's files (defaults: the in-cluster paths, used when they exist).
    The constructor does no I/O.
    """

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port_name: str | None = "http",
        *,
        base_url: str | None = None,
        token_path: Path | None = SERVICE_ACCOUNT_DIR / "token",
        ca_path: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt",
        scheme: str = "http",
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        request_timeout_s: float = 10.0,
        seed: int | None = None,
    ) -> None:
        self.namespace = namespace
        self.label_selector = label_selector
        self._base_url = base_url
        self._token_path = token_path
        self._ca_path = ca_path
        self._watch_timeout_s = watch_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._request_timeout_s = request_timeout_s
        self._rng = random.Random(seed)
        self._state = SliceSet(port_name, scheme)
        self._resource_version: str | None = None
        self._last_emitted: frozenset[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._inner: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def urls(self) -> frozenset[str]:
        return self._state.urls()

    def _api_base(self) -> str:
        if self._base_url is not None:
            return self._base_url.rstrip("/")
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("KubernetesDiscovery: no base_url and not in a cluster"
                               " (KUBERNETES_SERVICE_HOST is unset)")
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{port}"

    def _collection_url(self) -> str:
        return (f"{self._api_base()}/apis/discovery.k8s.io/v1/namespaces/"
                f"{quote(self.namespace, safe='')}/endpointslices")

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_path is not None and self._token_path.exists():
            headers["Authorization"] = f"Bearer {self._token_path.read_text().strip()}"
        return headers

    def _ssl(self) -> ssl.SSLContext | bool:
        if self._ca_path is not None and self._ca_path.exists():
            return ssl.create_default_context(cafile=str(self._ca_path))
        return True

    async def run(self, on_change: Callable[[frozenset[str]], None]) -> None:
        """Discover until ``close()``. ``on_change`` gets every new set of ready URLs."""
        if self._closed:
            return
        self._inner = asyncio.create_task(self._loop(on_change))
        try:
            await self._inner
        except asyncio.CancelledError:
            if not self._closed:
                raise  # run() itself was cancelled: _inner was cancelled with it
        finally:
            self._inner = None

    async def close(self) -> None:
        self._closed = True
        if self._inner is not None:
            self._inner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._inner
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self, on_change: Callable[[frozenset[str]], None]) -> None:
        self._session = self._session or aiohttp.ClientSession(trust_env=False)
        delays = backoff_delays(*self._backoff, self._rng)
        while not self._closed:
            try:
                if self._resource_version is None:
                    await self._list(on_change)
                    delays = backoff_delays(*self._backoff, self._rng)
                # Returns when the server ends the watch (timeoutSeconds): watch again, at once
                # if it delivered anything, else after a pause (a server that ends every watch
                # at once must not make this a busy loop).
                if await self._watch(on_change):
                    delays = backoff_delays(*self._backoff, self._rng)
                else:
                    await asyncio.sleep(next(delays))
            except _Gone:
                log.info("EndpointSlice watch: resourceVersion %s is gone, relisting",
                         self._resource_version)
                self._resource_version = None
            # ValueError: a body that is not JSON or not the expected shape (WatchFormatError).
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                delay = next(delays)
                log.warning("EndpointSlice discovery (%s, %s): %s; retrying in %.1f s",
                            self.namespace, self.label_selector, exc or type(exc).__name__, delay)
                await asyncio.sleep(delay)

    def _emit(self, on_change: Callable[[frozenset[str]], None]) -> None:
        urls = self._state.urls()
        if urls != self._last_emitted:
            self._last_emitted = urls
            on_change(urls)

    async def _list(self, on_change: Callable[[frozenset[str]], None]) -> None:
        assert self._session is not None
        async with self._session.get(
            self._collection_url(),
            params={"labelSelector": self.label_selector},
            headers=self._headers(),
            ssl=self._ssl(),
            timeout=aiohttp.ClientTimeout(total=self._request_timeout_s),
        ) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, r.history, status=r.status,
                    message=f"list EndpointSlices: {(await r.text())[:200]}")
            body = await r.json(content_type=None)
        if not isinstance(body, dict) or not isinstance(body.get("items") or [], list):
            raise WatchFormatError(f"not an EndpointSliceList: {str(body)[:200]}")
        items = body.get("items") or []
        self._state.replace_all(items)
        self._resource_version = str(body.get("metadata", {}).get("resourceVersion") or "") or None
        self._emit(on_change)

    async def _watch(self, on_change: Callable[[frozenset[str]], None]) -> bool:
        """One watch request; True when it delivered at least one event."""
        assert self._session is not None
        params = {
            "labelSelector": self.label_selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        if self._resource_version is not None:
            params["resourceVersion"] = self._resource_version
        # No total timeout: the server ends the watch. A silent connection for longer than the
        # watch itself (bookmarks arrive about every minute) is a dead one.
        timeout = aiohttp.ClientTimeout(total=None, connect=self._request_timeout_s,
                                        sock_read=self._watch_timeout_s + 30)
        got_event = False
        async with self._session.get(self._collection_url(), params=params,
                                     headers=self._headers(), ssl=self._ssl(),
                                     timeout=timeout) as r:
            if r.status == 410:
                raise _Gone()
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, r.history, status=r.status,
                    message=f"watch EndpointSlices: {(await r.text())[:200]}")
            lines = LineSplitter()
            async for chunk in r.content.iter_any():
                for line in lines.feed(chunk):
                    event = parse_event(line)
                    if event.gone:
                        raise _Gone()
                    if event.type == "ERROR":
                        raise WatchFormatError(f"watch error: {event.obj.get('message')}")
                    got_event = True
                    if event.resource_version is not None:
                        self._resource_version = event.resource_version
                    self._state.apply(event)
                    self._emit(on_change)
        return got_event
