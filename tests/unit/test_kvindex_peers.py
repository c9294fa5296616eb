"""gateway.kvindex.peers: the allow-list of a bound KV-event socket, parsed and matched."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.config import ConfigError, build_settings
from gateway.kvindex.events import KvEventsConfig
from gateway.kvindex.peers import AllowList, peer_address


def test_allow_list_takes_addresses_networks_and_host_names() -> None:
    allowed = AllowList.of(["10.0.0.5", "10.1.0.0/16", "[fd00::1]", "vllm-0.vllm"])

    assert allowed.networks == (ipaddress.ip_network("10.0.0.5/32"),
                                ipaddress.ip_network("10.1.0.0/16"),
                                ipaddress.ip_network("fd00::1/128"))
    assert allowed.hosts == ("vllm-0.vllm",)


def test_empty_allow_list_is_loopback_only() -> None:
    allowed = AllowList.of([])

    assert allowed.hosts == ()
    ips = [peer_address(a) for a in ("127.0.0.1", "127.0.0.2", "::1", "10.0.0.1")]
    assert [any(ip in n for n in allowed.networks) for ip in ips] == [True, True, True, False]


def test_ipv4_seen_through_an_ipv6_socket_is_matched_as_ipv4() -> None:
    assert peer_address("::ffff:10.0.0.5") == ipaddress.ip_address("10.0.0.5")
    assert peer_address("") is None


@pytest.mark.parametrize("bad", ["", "10.0.0.0/33", "a b", "host:5557", "tcp://10.0.0.5"])
def test_a_bad_peer_is_refused_when_configured(bad: str) -> None:
    with pytest.raises(ValueError, match="not an address"):
        KvEventsConfig("tcp://*:5557", bind=True, peers=(bad,))
    with pytest.raises(ConfigError, match=r"kv_events\.bind_peers"):
        build_settings({"models": [{"name": "m", "tokenizer": "simple"}],
                        "pools": [{"name": "p", "max_context_tokens": 4096,
                                   "workers": ["http://w:8000"]}],
                        "kv_events": {"bind_peers": [bad]}})
