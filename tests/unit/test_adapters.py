"""Models, aliases and LoRA adapters (issue 14): config checks, alias resolution at parse time,
the catalog, adapter-aware candidates and placement, per-adapter prefix keys (routed history and
KV events), and the simulator's LoRA events. Real objects throughout (registry, workers, index,
applier); the HTTP side is proven on simulated workers in tests/integration/test_lora_sim.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ConfigError, PoolSettings, build_settings
from gateway.kvindex.events import BlockStored, EventApplier, adapter_root
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.metrics import Metrics
from gateway.request import Endpoint, parse_body
from gateway.routing.router import NoHealthyWorker, Router
from gateway.routing.types import Candidate, Decision, RoutingRequest
from gateway.sim.kvcache import BlockStored as SimStored
from gateway.sim.kvcache import SimLora, block_hashes_for, none_hash
from gateway.sim.kvevents import event_to_wire
from gateway.workers.adapters import AdapterError, AdapterLoader, ModelCatalog, Target
from gateway.workers.health import HealthMonitor
from gateway.workers.registry import WorkerRegistry
from gateway.workers.vllm_metrics import parse_vllm_metrics
from gateway.workers.worker import Worker
from tests.harness import read_asgi_body, serve_app


def settings(**extra: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "llama", "adapters": [{"name": "sql", "path": "/a/sql"}]},
                   {"name": "qwen"}],
        "pools": [{"name": "p", "max_context_tokens": 4096,
                   "workers": ["http://w1", "http://w2"]}],
        **extra,
    }


# -- config ---------------------------------------------------------------------------------


def test_aliases_to_a_model_or_a_configured_adapter_are_accepted() -> None:
    s = build_settings(settings(model_aliases={"gpt-4o": "llama", "gpt-sql": "sql"}))
    assert s.model_aliases == {"gpt-4o": "llama", "gpt-sql": "sql"}


@pytest.mark.parametrize("aliases", [
    {"llama": "qwen"},  # an alias that is a served model would hide it
    {"sql": "llama"},  # an alias that is an adapter's name would hide the adapter
    {"gpt-4o": "nope"},  # an alias to nothing
])
def test_bad_aliases_are_refused_at_start(aliases: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="model_aliases"):
        build_settings(settings(model_aliases=aliases))


def test_an_adapter_named_like_a_model_or_twice_is_refused() -> None:
    data = settings()
    data["models"][1]["adapters"] = [{"name": "llama", "path": "/a/x"}]
    with pytest.raises(ConfigError, match="adapter name"):
        build_settings(data)
    data["models"][1]["adapters"] = [{"name": "sql", "path": "/a/x"}]
    with pytest.raises(ConfigError, match="adapter name"):
        build_settings(data)


# -- parse time -----------------------------------------------------------------------------


def test_an_alias_is_resolved_once_and_the_forwarded_body_names_the_served_model() -> None:
    raw = b'{"model":"gpt-4o","prompt":"hi","seed":123456789012345678901234567890}'
    parsed = parse_body(raw, Endpoint.COMPLETIONS, default_max_tokens=16,
                        aliases={"gpt-4o": "llama"})
    assert parsed.model == "llama"
    forwarded = json.loads(parsed.forward)
    assert forwarded["model"] == "llama"
    assert forwarded["seed"] == 123456789012345678901234567890  # wide ints survive


def test_a_served_name_is_forwarded_byte_for_byte() -> None:
    raw = b'{"model":"llama","prompt":"hi"}'
    parsed = parse_body(raw, Endpoint.COMPLETIONS, default_max_tokens=16,
                        aliases={"gpt-4o": "llama"})
    assert parsed.forward is raw


# -- catalog --------------------------------------------------------------------------------


def registry(*workers: tuple[str, dict[str, str]]) -> WorkerRegistry:
    pool = PoolSettings.model_validate({"name": "p", "max_context_tokens": 4096,
                                        "workers": [url for url, _ in workers]})
    reg = WorkerRegistry([pool])
    for url, adapters in workers:
        w = reg.get(url)
        assert w is not None
        w.healthy = True
        w.models = frozenset({"llama", *adapters})
        w.adapters = adapters
    return reg


def test_the_catalog_resolves_models_configured_and_discovered_adapters() -> None:
    s = build_settings(settings())
    reg = registry(("http://w1", {"ops": "llama", "stray": "mistral"}), ("http://w2", {}))
    catalog = ModelCatalog(s.models, reg)
    assert catalog.resolve("llama") == Target("llama")
    assert catalog.resolve("sql") == Target("llama", "sql")  # configured, loaded nowhere
    assert catalog.resolve("ops") == Target("llama", "ops")  # listed by a worker
    # An adapter of a model the gateway does not serve is unknown, as is a name nobody lists.
    assert catalog.resolve("stray") is None
    assert catalog.resolve("nope") is None
    assert catalog.loaded_adapters() == {"ops": "llama"}


def test_an_adapter_of_a_down_worker_is_not_known() -> None:
    s = build_settings(settings())
    reg = registry(("http://w1", {"ops": "llama"}))
    w = reg.get("http://w1")
    assert w is not None
    w.healthy = False
    assert ModelCatalog(s.models, reg).resolve("ops") is None


# -- routing --------------------------------------------------------------------------------


class First:
    name = "first"

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        return Decision(candidates[0].worker_id, "first_pick")


def router(reg: WorkerRegistry, index: PrefixIndex | None = None) -> Router:
    pool = PoolSettings.model_validate({"name": "p", "max_context_tokens": 4096,
                                        "workers": [w.url for w in reg]})
    return Router([pool], reg, {"p": First()}, spill=False, prefix_index=index)


def test_an_adapter_request_goes_only_to_a_worker_holding_it_for_that_model() -> None:
    # w1 lists "ops" as an adapter of another model: not a candidate for llama's "ops".
    reg = registry(("http://w1", {"ops": "qwen"}), ("http://w2", {"ops": "llama"}))
    r = router(reg)
    req = RoutingRequest(model="llama", prompt_tokens=10, max_tokens=10, adapter="ops")
    assert r.route(req).worker.url == "http://w2"
    with pytest.raises(NoHealthyWorker):
        r.route(RoutingRequest(model="llama", prompt_tokens=10, max_tokens=10, adapter="sql"))
    # the base model still goes anywhere
    base = RoutingRequest(model="llama", prompt_tokens=10, max_tokens=10)
    assert r.route(base).worker.url == "http://w1"


def test_place_chooses_among_eligible_workers_and_records_nothing() -> None:
    reg = registry(("http://w1", {}), ("http://w2", {}))
    index = PrefixIndex(BlockIndex())
    r = router(reg, index)
    req = RoutingRequest(model="llama", prompt_tokens=64, max_tokens=10,
                         token_ids=tuple(range(64)), adapter="sql")
    placed = r.place(req, lambda w: w.url == "http://w2")
    assert placed is not None and placed.url == "http://w2"
    assert index.cached_and_pending(req.token_ids, [("http://w2", 16)], "sql") == {
        "http://w2": (0, 0)}
    assert r.place(req, lambda w: False) is None


# -- prefix keys per adapter ----------------------------------------------------------------


def test_routed_history_is_kept_per_adapter() -> None:
    index = PrefixIndex(BlockIndex())
    tokens = tuple(range(200, 264))
    index.record_routed("w", tokens, 16, "sql")
    assert index.cached_and_pending(tokens, [("w", 16)], "sql")["w"][0] == 48
    assert index.cached_and_pending(tokens, [("w", 16)])["w"][0] == 0  # not the base model's
    assert index.cached_and_pending(tokens, [("w", 16)], "ops")["w"][0] == 0
    index.record_routed("w", tokens, 16)
    assert index.cached_and_pending(tokens, [("w", 16)])["w"][0] == 48


def lora_stored(hashes: list[int], tokens: list[int], name: str | None,
                extra: tuple[object, ...] | None = None, parent: int | None = None,
                lora_id: int | None = 1) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), 4, lora_id=lora_id, medium="GPU",
                       lora_name=name, extra_keys=extra)


def test_lora_events_are_kept_under_their_adapter_only() -> None:
    index = BlockIndex()
    applier = EventApplier("w", index, 4)
    tokens = list(range(8))
    applier.apply([lora_stored([1, 2], tokens, "sql", extra=(("sql",), ("sql",)))])
    applier.apply([lora_stored([3], [8, 9, 10, 11], "sql", extra=(("sql",),), parent=2)])
    mine = block_hashes([*tokens, 8, 9, 10, 11], 4, adapter_root("sql"))
    assert index.match_prefix(mine, ["w"]) == {"w": 3}
    assert index.match_prefix(block_hashes(tokens, 4), ["w"]) == {"w": 0}
    assert index.match_prefix(block_hashes(tokens, 4, adapter_root("ops")), ["w"]) == {"w": 0}


def test_lora_blocks_with_other_extra_keys_or_no_name_are_skipped() -> None:
    index = BlockIndex()
    applier = EventApplier("w", index, 4)
    # the second block also carries an image: not a text prompt's hit, even for the adapter
    applier.apply([lora_stored([1, 2], list(range(8)), "sql",
                               extra=(("sql",), ("sql", "img0", 0)))])
    assert index.match_prefix(block_hashes(list(range(8)), 4, adapter_root("sql")),
                              ["w"]) == {"w": 1}
    assert applier.counts["skipped_extra_keys"] == 1
    applier.apply([lora_stored([5], [1, 2, 3, 4], None, lora_id=7)])  # no name to key it by
    assert applier.counts["skipped_lora"] == 1


def test_adapter_roots_differ_from_each_other_and_from_the_plain_chain() -> None:
    assert adapter_root("a") != adapter_root("b")
    assert adapter_root("a") not in block_hashes(list(b"a"), 1)


# -- the simulator --------------------------------------------------------------------------


def test_the_simulator_hashes_and_announces_an_adapters_blocks_as_vllm() -> None:
    lora = SimLora("sql", 3, "/a/sql")
    root = none_hash("seed")
    tokens = list(range(32))
    assert block_hashes_for(tokens, 16, root, lora.extra_keys) != block_hashes_for(
        tokens, 16, root)
    wire = event_to_wire(SimStored((1, 2), None, tuple(tokens), 16, lora))
    assert (wire["lora_name"], wire["lora_id"]) == ("sql", 3)
    assert wire["extra_keys"] == [("sql",), ("sql",)]
    plain = event_to_wire(SimStored((1,), None, tuple(tokens[:16]), 16))
    assert (plain["lora_name"], plain["lora_id"], plain["extra_keys"]) == (None, None, [None])


# -- loading --------------------------------------------------------------------------------


async def test_an_unconfigured_adapter_is_never_loaded() -> None:
    s = build_settings(settings())
    loader = AdapterLoader(s.models, session=None, timeout_s=1.0)  # type: ignore[arg-type]
    assert not loader.configured("ops")
    with pytest.raises(AdapterError) as err:
        await loader.ensure_loaded(Target("llama", "ops"), lambda eligible: None)
    assert (err.value.status, err.value.code) == (404, "model_not_found")


async def test_a_full_pool_with_every_adapter_busy_is_refused_503() -> None:
    data = settings()
    data["models"][0]["max_loaded_per_worker"] = 1
    s = build_settings(data)
    loader = AdapterLoader(s.models, session=None, timeout_s=1.0)  # type: ignore[arg-type]
    w = Worker(url="http://w1", pool="p", healthy=True, adapters={"other": "llama"})
    workers = [w]

    def place(eligible: Any) -> Worker | None:
        return next((x for x in workers if eligible(x)), None)

    # "other" is not configured: the gateway could not load it again, so never unloads it
    with pytest.raises(AdapterError) as err:
        await loader.ensure_loaded(Target("llama", "sql"), place)
    assert (err.value.status, err.value.code) == (503, "adapter_slots_busy")


def test_in_flight_counts_go_back_to_nothing() -> None:
    s = build_settings(settings())
    loader = AdapterLoader(s.models, session=None, timeout_s=1.0)  # type: ignore[arg-type]
    loader.routed("http://w1", "sql")
    loader.routed("http://w1", "sql")
    assert loader.inflight("http://w1", "sql") == 2
    loader.finished("http://w1", "sql")
    loader.finished("http://w1", "sql")
    assert loader.inflight("http://w1", "sql") == 0



def test_lora_metrics_mark_a_worker_whose_adapters_are_watched() -> None:
    """vLLM exports ``vllm:lora_requests_info`` only with LoRA enabled: such a worker's model
    list is re-read at every scrape, another's (no adapters configured) only when it comes up."""
    with_lora = ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
                 'waiting_lora_adapters=""} 1.7e9\n')
    assert parse_vllm_metrics(with_lora).lora_enabled
    assert not parse_vllm_metrics("vllm:num_requests_running 1\n").lora_enabled


async def test_no_worker_for_the_base_model_is_503_no_healthy_worker_not_slots_busy() -> None:
    s = build_settings(settings())
    loader = AdapterLoader(s.models, session=None, timeout_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(AdapterError) as err:
        await loader.ensure_loaded(Target("llama", "sql"), lambda eligible: None)
    assert (err.value.status, err.value.code) == (503, "no_healthy_worker")


class LoraWorker:
    """A worker's adapter routes, as vLLM answers them, where requests to ``hold`` wait for
    ``release`` (their change is made after it): the window in which a load is under way, made
    as long as a test needs."""

    def __init__(self, loaded: Sequence[str], hold: str = "/v1/unload_lora_adapter") -> None:
        self.loaded = list(loaded)
        self.hold = hold
        self.held = threading.Event()
        self.release = threading.Event()
        self.loads: list[str] = []
        self.unloads: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_asgi_body(receive)
        path = scope["path"]
        if path == self.hold:
            self.held.set()
            await asyncio.to_thread(self.release.wait, 10)
        if path == "/v1/models":
            answer: Any = {"object": "list", "data": [{"id": "llama", "parent": None}] + [
                {"id": a, "parent": "llama"} for a in self.loaded]}
        elif path == "/v1/unload_lora_adapter":
            name = json.loads(body)["lora_name"]
            self.unloads.append(name)
            if name in self.loaded:
                self.loaded.remove(name)
            answer = "ok"
        elif path == "/v1/load_lora_adapter":
            name = json.loads(body)["lora_name"]
            self.loads.append(name)
            self.loaded.append(name)
            answer = "ok"
        else:
            answer = {}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


@contextlib.asynccontextmanager
async def lora_fleet(fake: LoraWorker) -> AsyncIterator[tuple[Worker, HealthMonitor,
                                                               AdapterLoader]]:
    """One worker (``fake``) as the gateway sees it: read by the health monitor (which re-reads
    its adapters at every scrape), loaded on by the loader, with at most 2 adapters."""
    with serve_app(fake, ready_path="/v1/models") as url:
        s = build_settings({
            "models": [{"name": "llama", "max_loaded_per_worker": 2, "adapters": [
                {"name": n, "path": f"/a/{n}"} for n in ("v", "w", "b", "c")]}],
            "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [url]}]})
        registry = WorkerRegistry(s.pools)
        (worker,) = registry
        async with aiohttp.ClientSession() as client:
            monitor = HealthMonitor(registry, client, s.health, Metrics(CollectorRegistry()),
                                    watch_adapters=True)
            await monitor.check_all()
            assert worker.healthy and set(worker.adapters) == set(fake.loaded)
            yield worker, monitor, AdapterLoader(s.models, client, timeout_s=10.0)


async def test_a_models_read_during_an_unload_cannot_let_a_second_load_overfill_the_worker(
        ) -> None:
    """CI caught a worker with 3 adapters where 2 are allowed: a scrape's read of /v1/models
    landed between an unload sent and done, listed the victim again, and a second load picked
    the same victim. Reads overlapping a load are now dropped."""
    fake = LoraWorker(["v", "w"])
    async with lora_fleet(fake) as (worker, monitor, loader):
        def place(eligible: Any) -> Worker | None:
            return worker if eligible(worker) else None

        loader.routed(worker.url, "w")  # busy: "v" is the only adapter that may go
        first = asyncio.create_task(loader.ensure_loaded(Target("llama", "b"), place))
        assert await asyncio.to_thread(fake.held.wait, 10)
        await monitor.scrape_all()  # the worker still lists "v": its unload is not done
        assert "v" not in worker.adapters
        with pytest.raises(AdapterError) as err:
            await loader.ensure_loaded(Target("llama", "c"), place)
        assert err.value.code == "adapter_slots_busy"
        fake.release.set()
        assert await first is worker
        await monitor.scrape_all()
    assert sorted(fake.loaded) == ["b", "w"] and fake.loads == ["b"]
    assert set(worker.adapters) == {"b", "w"}


async def test_a_load_whose_client_left_is_finished_and_counted() -> None:
    """The load runs on its own: cancelled with its client, the worker went on loading the
    adapter while the gateway counted no slot for it, and a next load overfilled the worker."""
    fake = LoraWorker(["w"], hold="/v1/load_lora_adapter")
    async with lora_fleet(fake) as (worker, _, loader):
        def place(eligible: Any) -> Worker | None:
            return worker if eligible(worker) else None

        asker = asyncio.create_task(loader.ensure_loaded(Target("llama", "b"), place))
        assert await asyncio.to_thread(fake.held.wait, 10)
        asker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asker
        fake.release.set()
        for _ in range(200):
            if "b" in worker.adapters:
                break
            await asyncio.sleep(0.02)
        assert set(worker.adapters) == {"b", "w"}
        loader.routed(worker.url, "w")
        await loader.ensure_loaded(Target("llama", "c"), place)  # in b's place
    assert fake.loads == ["b", "c"] and sorted(fake.loaded) == ["c", "w"]


async def test_a_loaded_adapter_is_not_unloaded_before_its_requests_are_routed() -> None:
    """Between a load's end and its requests' routing, the adapter has no request in flight;
    a load for another adapter then took it as its victim (the requests found it gone)."""
    fake = LoraWorker(["w"], hold="/v1/load_lora_adapter")
    async with lora_fleet(fake) as (worker, _, loader):
        def place(eligible: Any) -> Worker | None:
            return worker if eligible(worker) else None

        async def ask() -> None:  # as dispatch does: routed at once once loaded
            loader.routed((await loader.ensure_loaded(Target("llama", "b"), place)).url, "b")

        async def race() -> None:  # another load, as soon as the gateway lists "b"
            for _ in range(100_000):  # each loop step: the first one where it is listed
                if "b" in worker.adapters:
                    break
                await asyncio.sleep(0)
            await loader.ensure_loaded(Target("llama", "c"), place)

        loader.routed(worker.url, "w")
        asker = asyncio.create_task(ask())
        assert await asyncio.to_thread(fake.held.wait, 10)
        racer = asyncio.create_task(race())
        fake.release.set()
        await asker
        with pytest.raises(AdapterError) as err:
            await racer
        assert err.value.code == "adapter_slots_busy"
    assert fake.loads == ["b"] and sorted(fake.loaded) == ["b", "w"]


async def test_two_loads_chosen_in_one_loop_step_take_different_victims() -> None:
    """CI caught a worker with 3 adapters where 2 are allowed: the victim was dropped from the
    gateway's list only once the load's task ran, so a second load chosen before then (the
    same loop step) took the same victim; both unloaded it and both loaded."""
    fake = LoraWorker(["v", "w"], hold="none")
    async with lora_fleet(fake) as (worker, monitor, loader):
        def place(eligible: Any) -> Worker | None:
            return worker if eligible(worker) else None

        await asyncio.gather(loader.ensure_loaded(Target("llama", "b"), place),
                             loader.ensure_loaded(Target("llama", "c"), place))
        await monitor.scrape_all()
    assert sorted(fake.unloads) == ["v", "w"] and sorted(fake.loaded) == ["b", "c"]
    assert set(worker.adapters) == {"b", "c"}
