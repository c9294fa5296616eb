"""gateway.workers.discovery, the pure part: EndpointSlice -> URLs, watch lines, slice state."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gateway.workers.discovery import (
    LineSplitter,
    SliceSet,
    WatchEvent,
    WatchFormatError,
    backoff_delays,
    parse_event,
    slice_urls,
)


def endpoint_slice(name: str, endpoints: list[tuple[str, bool | None]],
                   ports: list[dict[str, Any]] | None = None, address_type: str = "IPv4",
                   rv: str = "1") -> dict[str, Any]:
    """The shape of `kubectl get endpointslice -o json` for a Service with named ports."""
    eps = []
    for address, ready in endpoints:
        conditions: dict[str, Any] = {}
        if ready is not None:
            conditions = {"ready": ready, "serving": ready, "terminating": not ready}
        eps.append({"addresses": [address], "conditions": conditions,
                    "nodeName": "node-1", "targetRef": {"kind": "Pod", "name": f"pod-{address}"}})
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": rv,
                     "labels": {"kubernetes.io/service-name": "vllm-short", "kvgate.io/pool": "short-chat"}},
        "addressType": address_type,
        "endpoints": eps,
        "ports": ports if ports is not None else [
            {"name": "http", "port": 8000, "protocol": "TCP"},
            {"name": "kv-events", "port": 5557, "protocol": "TCP"},
        ],
    }


def test_ready_endpoints_become_urls_with_the_named_port() -> None:
    s = endpoint_slice("a", [("10.1.0.1", True), ("10.1.0.2", False), ("10.1.0.3", None)])
    assert slice_urls(s, "http") == {"http://10.1.0.1:8000", "http://10.1.0.3:8000"}
    assert slice_urls(s, "kv-events", scheme="tcp") == {"tcp://10.1.0.1:5557",
                                                        "tcp://10.1.0.3:5557"}


def test_slice_without_the_named_port_gives_no_urls() -> None:
    s = endpoint_slice("a", [("10.1.0.1", True)])
    assert slice_urls(s, "metrics") == frozenset()


def test_unnamed_single_port_is_used_when_no_name_is_asked() -> None:
    s = endpoint_slice("a", [("10.1.0.1", True)], ports=[{"port": 8000, "protocol": "TCP"}])
    assert slice_urls(s, None) == {"http://10.1.0.1:8000"}
    two = endpoint_slice("b", [("10.1.0.1", True)])
    assert slice_urls(two, None) == frozenset()  # ambiguous: two ports


def test_ipv6_addresses_are_bracketed_and_bad_addresses_skipped() -> None:
    s = endpoint_slice("a", [("fd00::1", True), ("not-an-ip", True)], address_type="IPv6")
    assert slice_urls(s, "http") == {"http://[fd00::1]:8000"}


def test_slice_with_no_endpoints_or_ports_is_empty() -> None:
    assert slice_urls({"metadata": {"name": "x"}, "endpoints": None, "ports": None}, "http") == set()


def test_parse_event_reads_type_object_and_resource_version() -> None:
    e = parse_event(b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"42"}}}')
    assert e.type == "ADDED" and e.resource_version == "42" and not e.gone


def test_parse_event_recognises_410_gone() -> None:
    e = parse_event(b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":'
                    b'"Failure","message":"too old resource version: 1 (5)","reason":"Expired",'
                    b'"code":410}}')
    assert e.gone


@pytest.mark.parametrize("line", [b"not json", b"[]", b'{"type": "ADDED"}', b'{"object": {}}'])
def test_parse_event_rejects_what_is_not_a_watch_event(line: bytes) -> None:
    with pytest.raises(WatchFormatError):
        parse_event(line)


def test_line_splitter_joins_chunks_and_splits_batches() -> None:
    s = LineSplitter()
    assert list(s.feed(b'{"a":')) == []
    assert list(s.feed(b'1}\n{"b":2}\n\n{"c"')) == [b'{"a":1}', b'{"b":2}']
    assert list(s.feed(b":3}\n")) == [b'{"c":3}']


def test_slice_set_follows_add_modify_delete_and_bookmark() -> None:
    state = SliceSet("http")
    state.replace_all([endpoint_slice("a", [("10.1.0.1", True)]),
                       endpoint_slice("b", [("10.1.0.2", True)])])
    assert state.urls() == {"http://10.1.0.1:8000", "http://10.1.0.2:8000"}
    state.apply(WatchEvent("MODIFIED", endpoint_slice("a", [("10.1.0.1", False)])))
    assert state.urls() == {"http://10.1.0.2:8000"}
    state.apply(WatchEvent("ADDED", endpoint_slice("c", [("10.1.0.3", True)])))
    state.apply(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "9"}}))
    state.apply(WatchEvent("DELETED", endpoint_slice("b", [])))
    assert state.urls() == {"http://10.1.0.3:8000"}


def test_same_address_in_two_slices_counts_until_both_drop_it() -> None:
    """During a rollout one address can briefly sit in two slices."""
    state = SliceSet("http")
    state.replace_all([endpoint_slice("a", [("10.1.0.1", True)]),
                       endpoint_slice("b", [("10.1.0.1", True)])])
    state.apply(WatchEvent("DELETED", endpoint_slice("a", [])))
    assert state.urls() == {"http://10.1.0.1:8000"}


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    delays = backoff_delays(0.5, 4.0, random.Random(1))
    got = [next(delays) for _ in range(6)]
    for value, base in zip(got, [0.5, 1, 2, 4, 4, 4], strict=True):
        assert 0.8 * base <= value <= 1.2 * base
