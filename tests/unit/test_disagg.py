"""Prefill/decode disaggregation, the pure parts: the pool's config, the registry's two lists, the
router's choice of prefill and decode workers, the two steps' bodies and the prefill answer.

Registry, workers and router are the real ones; the prefix index is the honest fake of
``test_router``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ConfigError, PolicyName, PoolSettings, TimeoutSettings, build_settings
from gateway.metrics import Metrics
from gateway.request import Endpoint, parse_body
from gateway.routing.kv_aware import KvAware
from gateway.routing.least_loaded import LeastLoaded
from gateway.routing.router import NoHealthyWorker, Router
from gateway.routing.types import RoutingRequest
from gateway.upstream.client import UpstreamClient
from gateway.upstream.context import Exchange, Upstream
from gateway.upstream.disagg import (
    PREFILL_KV_TRANSFER_PARAMS,
    DisaggPlacement,
    decode_body,
    kv_transfer_params,
    prefill_body,
    two_step,
    worker_error,
)
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import Worker
from tests.unit.test_router import FakePrefixIndex

P1, P2 = "http://p1:8000", "http://p2:8000"
D1, D2 = "http://d1:8000", "http://d2:8000"
PROMPT = tuple(range(64))


def settings(pools: list[dict[str, Any]]) -> Any:
    return build_settings({"models": [{"name": "m", "tokenizer": "simple"}], "pools": pools})


def disagg_pool(**extra: Any) -> dict[str, Any]:
    return {"name": "pd", "max_context_tokens": 4096, "workers": [D1, D2],
            "prefill_workers": [P1, P2], **extra}


# --- config ---------------------------------------------------------------------------------


def test_pool_with_prefill_workers_is_disaggregated_and_one_without_is_not() -> None:
    s = settings([disagg_pool(), {"name": "plain", "max_context_tokens": 8192,
                                  "workers": ["http://w:8000"]}])
    assert [p.disaggregated for p in s.pools] == [True, False]
    assert [w.url for w in s.pools[0].prefill_workers] == [P1, P2]  # bare URLs accepted


def test_disaggregated_pool_without_decode_workers_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="needs decode workers"):
        settings([{"name": "pd", "max_context_tokens": 4096, "prefill_workers": [P1]}])


def test_disaggregated_pool_with_discovered_decode_workers_is_accepted() -> None:
    s = settings([{"name": "pd", "max_context_tokens": 4096, "prefill_workers": [P1],
                   "discovery": {"namespace": "llm",
                                                "label_selector": "role=decode"}}])
    assert s.pools[0].disaggregated


@pytest.mark.parametrize("pools", [
    [disagg_pool(workers=[D1, P1])],  # a worker both decode and prefill
    [disagg_pool(), {"name": "other", "max_context_tokens": 8192, "workers": [D2],
                     "prefill_workers": [P1]}],  # a prefill worker of two pools
    [disagg_pool(), {"name": "other", "max_context_tokens": 8192, "workers": [P2]}],
], ids=["both-roles", "prefill-in-two-pools", "prefill-also-plain-worker"])
def test_worker_listed_twice_across_roles_or_pools_is_refused(pools: list[dict[str, Any]]) -> None:
    with pytest.raises(ConfigError, match="appears twice"):
        settings(pools)


# --- registry ---------------------------------------------------------------------------------


def up_registry(pools: list[PoolSettings]) -> WorkerRegistry:
    registry = WorkerRegistry(pools)
    for w in registry:
        w.healthy = True
    return registry


def test_registry_never_offers_a_prefill_worker_as_a_clients_worker() -> None:
    pools = settings([disagg_pool()]).pools
    registry = up_registry(pools)
    assert [w.url for w in registry.healthy("pd")] == [D1, D2]
    assert [w.url for w in registry.healthy_prefill("pd")] == [P1, P2]
    assert {w.url for w in registry} == {P1, P2, D1, D2}  # health checks, scrapes, events
    assert registry.get(P1) is not None and registry.get(P1).prefill  # type: ignore[union-attr]


def test_registry_healthy_prefill_leaves_out_down_workers() -> None:
    registry = up_registry(settings([disagg_pool()]).pools)
    registry.get(P1).healthy = False  # type: ignore[union-attr]
    assert [w.url for w in registry.healthy_prefill("pd")] == [P2]


# --- routing ----------------------------------------------------------------------------------


def router_for(pool: dict[str, Any], index: FakePrefixIndex | None = None,
               ) -> tuple[Router, PoolSettings, WorkerRegistry]:
    pools = settings([pool]).pools
    registry = up_registry(pools)
    policy = KvAware(pools[0].kv_aware) if pools[0].policy == PolicyName.KV_AWARE else LeastLoaded()
    return (Router(pools, registry, {"pd": policy}, spill=False, prefix_index=index),
            pools[0], registry)


def request(**extra: Any) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=len(PROMPT), max_tokens=16,
                          token_ids=PROMPT, **extra)


def test_route_chooses_the_decode_worker_among_decode_workers_only() -> None:
    router, _, _ = router_for(disagg_pool())
    assert {router.route(request()).worker.url for _ in range(8)} <= {D1, D2}


def test_prefill_goes_to_the_prefill_worker_holding_the_prefix() -> None:
    index = FakePrefixIndex(cached={P2: 48})
    router, pool, _ = router_for(disagg_pool(policy="kv_aware"), index)
    prefill = router.route_prefill(request(), pool)
    assert prefill.worker.url == P2
    assert prefill.decision.reason == "prefix_hit"
    assert prefill.decision.predicted_cached_tokens == 48
    assert (P2, PROMPT, 16) in index.routed  # the routing history names the prefill worker


def test_prefill_avoids_the_prefill_worker_with_prefill_queued() -> None:
    router, pool, registry = router_for(disagg_pool())
    registry.get(P1).inflight_prompt_tokens = 10_000  # type: ignore[union-attr]
    assert router.route_prefill(request(), pool).worker.url == P2


def test_prefill_retry_excludes_the_prefill_worker_that_failed() -> None:
    router, pool, _ = router_for(disagg_pool())
    assert router.route_prefill(request(), pool, exclude=[P1]).worker.url == P2


def test_no_healthy_prefill_worker_is_no_healthy_worker() -> None:
    router, pool, registry = router_for(disagg_pool())
    for url in (P1, P2):
        registry.get(url).healthy = False  # type: ignore[union-attr]
    with pytest.raises(NoHealthyWorker, match="prefill"):
        router.route_prefill(request(), pool)


def test_prefill_worker_at_the_pools_inflight_cap_is_not_chosen() -> None:
    router, pool, registry = router_for(disagg_pool(max_inflight_per_worker=2))
    registry.get(P2).inflight = 2  # type: ignore[union-attr]
    assert {router.route_prefill(request(), pool).worker.url for _ in range(4)} == {P1}


@pytest.mark.parametrize(("endpoint", "n", "ids", "expected"), [
    (Endpoint.CHAT, 1, PROMPT, True),
    (Endpoint.COMPLETIONS, 1, PROMPT, True),
    (Endpoint.CHAT, 2, PROMPT, False),  # each choice would pull the same blocks
    (Endpoint.COMPLETIONS, 1, (), False),  # a batch of prompts
    (Endpoint.RESPONSES, 1, PROMPT, False),
    (Endpoint.EMBEDDINGS, 1, PROMPT, False),
])
def test_only_single_prompt_single_choice_generation_runs_two_steps(
    endpoint: Endpoint, n: int, ids: tuple[int, ...], expected: bool,
) -> None:
    assert two_step(endpoint, n, ids) is expected


# --- bodies -----------------------------------------------------------------------------------


def test_prefill_body_asks_one_token_unstreamed_for_a_remote_decode() -> None:
    forward = json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "max_completion_tokens": 300,
        "min_tokens": 5, "n": 1, "temperature": 0.3, "seed": 2**70,
    }).encode()
    body = json.loads(prefill_body(forward))
    assert body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert (body["stream"], body["max_tokens"], body["max_completion_tokens"], body["n"]) == (
        False, 1, 1, 1)
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["temperature"] == 0.3 and body["seed"] == 2**70  # the rest as the client sent it


def test_prefill_body_adds_no_max_completion_tokens_when_the_body_has_none() -> None:
    body = json.loads(prefill_body(b'{"model":"m","prompt":"hi","max_tokens":50}'))
    assert body["max_tokens"] == 1 and "max_completion_tokens" not in body


def test_decode_body_is_the_forwarded_body_with_the_prefills_params_last() -> None:
    forward = b'{"model":"m","prompt":"hi","stream":true}\n'
    params = b'{"do_remote_prefill":true,"remote_port":5600}'
    body = decode_body(forward, params)
    assert json.loads(body) == {"model": "m", "prompt": "hi", "stream": True,
                                "kv_transfer_params": json.loads(params)}
    assert body.startswith(b'{"model":"m","prompt":"hi","stream":true,')


def test_decode_body_params_win_over_a_clients_own_kv_transfer_params() -> None:
    """The last duplicate key is what a JSON parser keeps: a client's own field (refused by the
    request parser anyway) can never steer the decode worker's pull."""
    forward = b'{"model":"m","prompt":"hi","kv_transfer_params":{"remote_host":"evil"}}'
    body = decode_body(forward, b'{"remote_host":"10.0.0.31"}')
    assert json.loads(body)["kv_transfer_params"] == {"remote_host": "10.0.0.31"}


# --- the prefill's answer ---------------------------------------------------------------------


VLLM_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e-1", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.31",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull",
}


def answer(params: Any) -> bytes:
    return orjson.dumps({"id": "cmpl-1", "choices": [{"text": "x"}],
                         "kv_transfer_params": params})


def test_usable_kv_transfer_params_pass_on_verbatim() -> None:
    found = kv_transfer_params(answer(VLLM_PARAMS))
    assert found is not None and orjson.loads(found) == VLLM_PARAMS


def test_flat_block_id_list_of_older_vllm_is_usable() -> None:
    assert kv_transfer_params(answer({**VLLM_PARAMS, "remote_block_ids": [1, 2]})) is not None


@pytest.mark.parametrize("params", [
    None,  # a worker without a KV connector
    {**VLLM_PARAMS, "do_remote_prefill": False},
    {k: v for k, v in VLLM_PARAMS.items() if k != "remote_host"},
    {**VLLM_PARAMS, "remote_port": "5600"},
    {**VLLM_PARAMS, "remote_port": True},
    {**VLLM_PARAMS, "remote_block_ids": None},
    [VLLM_PARAMS],
], ids=["null", "no-remote-prefill", "no-host", "port-string", "port-bool", "no-blocks", "list"])
def test_unusable_kv_transfer_params_are_none(params: Any) -> None:
    assert kv_transfer_params(answer(params)) is None


def test_answer_that_is_not_json_has_no_kv_transfer_params() -> None:
    assert kv_transfer_params(b"<html>bad gateway</html>") is None


def test_worker_error_reads_vllms_error_object() -> None:
    error = {"error": {"message": "too long", "type": "BadRequestError", "param": "messages",
                       "code": 400}}
    assert worker_error(400, orjson.dumps(error)) == ("too long", error)


@pytest.mark.parametrize("body", [b"Internal Server Error", b'{"error": "flat"}', b"[1]"])
def test_worker_error_of_a_body_that_is_not_an_error_object_is_generic(body: bytes) -> None:
    assert worker_error(500, body) == ("the prefill worker answered 500", None)


def test_discovered_prefill_workers_join_the_prefill_list_and_leave_it() -> None:
    pools = settings([disagg_pool(prefill_discovery={"namespace": "llm",
                                                     "label_selector": "role=prefill"})]).pools
    registry = up_registry(pools)
    discovery = pools[0].prefill_discovery
    assert discovery is not None
    added, _ = registry.set_discovered("pd", frozenset({"http://10.0.0.9:8000"}), discovery,
                                       prefill=True)
    assert [w.prefill for w in added] == [True]
    added[0].healthy = True
    assert "http://10.0.0.9:8000" in [w.url for w in registry.healthy_prefill("pd")]
    assert "http://10.0.0.9:8000" not in [w.url for w in registry.healthy("pd")]
    _, removed = registry.set_discovered("pd", frozenset(), discovery, prefill=True)
    assert [w.url for w in removed] == ["http://10.0.0.9:8000"]
    assert [w.url for w in registry.prefill_workers("pd")] == [P1, P2]


def test_pool_with_prefill_discovery_alone_is_disaggregated() -> None:
    s = settings([{"name": "pd", "max_context_tokens": 4096, "workers": [D1],
                   "prefill_discovery": {"namespace": "llm", "label_selector": "role=prefill"}}])
    assert s.pools[0].disaggregated


class NoHealth:
    def report_failure(self, worker: Worker) -> None: ...

    def report_request_ok(self, worker: Worker) -> None: ...


def test_prefill_worker_is_held_from_routing_so_a_burst_spreads_over_prefill_workers() -> None:
    """A burst is routed before any of its requests runs: the prefill each one adds must be
    counted on its prefill worker at once, as the decode worker's request is."""
    router, pool, _ = router_for(disagg_pool())
    timeouts = TimeoutSettings.model_validate({})
    upstream = Upstream(None, UpstreamClient(), router.route,  # type: ignore[arg-type]
                        Metrics(CollectorRegistry()), NoHealth(), timeouts, router.route_prefill)
    parsed = parse_body(b'{"model":"m","prompt":"hi","max_tokens":16}', Endpoint.COMPLETIONS,
                        default_max_tokens=16)
    rreq = request()
    route, first = router.route(rreq), router.route_prefill(rreq, pool)
    DisaggPlacement(upstream, Exchange(parsed, rreq, 0.0, None, prefill=first), route, timeouts)
    assert (first.worker.inflight, first.worker.inflight_prompt_tokens) == (1, len(PROMPT))
    assert (route.worker.inflight, route.worker.inflight_prompt_tokens) == (1, 0)  # it pulls
    assert router.route_prefill(rreq, pool).worker is not first.worker


async def test_decode_hold_reports_the_pull_once_at_the_first_token_and_never_at_release() -> None:
    """The relay ends a hold's prefill at the first token (the pull is done) and ``release``
    ends it too (a decode that failed, or a move to another decode worker): only the first
    may start the budget shrink, and only once per request."""
    router, pool, _ = router_for(disagg_pool())
    timeouts = TimeoutSettings.model_validate({})
    upstream = Upstream(None, UpstreamClient(), router.route,  # type: ignore[arg-type]
                        Metrics(CollectorRegistry()), NoHealth(), timeouts, router.route_prefill)
    parsed = parse_body(b'{"model":"m","prompt":"hi","max_tokens":16}', Endpoint.COMPLETIONS,
                        default_max_tokens=16)
    rreq = request()
    shrinks: list[str] = []

    async def shrink() -> None:
        shrinks.append("shrunk")

    def placement() -> DisaggPlacement:
        p = DisaggPlacement(upstream, Exchange(parsed, rreq, 0.0, None,
                                               prefill=router.route_prefill(rreq, pool)),
                            router.route(rreq), timeouts)
        p.on_pulled = shrink
        return p

    failed = placement()
    failed.hold.release()  # the decode failed before its first token
    failed.prefill_hold.release()
    assert failed.pulled_task is None

    served = placement()
    served.hold.prefill_done()  # the first token
    served.hold.prefill_done()
    served._move_to(router.route(rreq, [served.route.worker.url]), 0)  # resumed elsewhere
    served.hold.prefill_done()
    served.hold.release()
    served.prefill_hold.release()
    assert served.pulled_task is not None
    await served.pulled_task
    assert shrinks == ["shrunk"]


# -- real vLLM's answers, recorded by scripts/pd_vllm_probe.py (vLLM 0.32, NIXL on CPU) ----------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_steps_match_what_real_vllm_was_sent_and_answered(route: str) -> None:
    """The prefill body the gateway writes is the one real vLLM answered with usable params, and
    those params (``remote_block_ids`` one list per KV-cache group) reach the decode body as
    real vLLM got them."""
    exchange = json.loads((FIXTURES / "vllm_pd_exchange.json").read_text())[route]
    sent = exchange["prefill_request"]
    client = {k: v for k, v in sent.items() if k not in ("kv_transfer_params", "n")}
    client.update(stream=True, stream_options={"include_usage": True}, max_tokens=8)
    if "max_completion_tokens" in client:
        client["max_completion_tokens"] = 8
    assert orjson.loads(prefill_body(orjson.dumps(client))) == sent
    params = kv_transfer_params(json.dumps(exchange["prefill_response"]).encode())
    assert params is not None
    assert orjson.loads(params) == exchange["decode_request"]["kv_transfer_params"]
    assert all(isinstance(group, list) for group in orjson.loads(params)["remote_block_ids"])


def test_a_real_prefill_answer_without_a_nixl_connector_is_not_usable() -> None:
    """vLLM's example (shared-storage) connector answers ``kv_transfer_params: null``: nothing
    to pass on, a 502 ``prefill_no_kv_transfer`` rather than a decode that computes blindly."""
    answer = (FIXTURES / "vllm_prefill_response_example_connector.json").read_bytes()
    assert kv_transfer_params(answer) is None
    assert kv_transfer_params((FIXTURES / "vllm_prefill_response.json").read_bytes()) is not None
