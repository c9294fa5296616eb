"""Prefill/decode disaggregation in the simulated worker: vLLM 0.32's NIXL connector (pull mode).

The protocol, as a router runs it (vLLM's disaggregated proxy examples, vllm-router):

1. **Prefill** on a producer: the request carries ``kv_transfer_params`` with
   ``do_remote_decode: true`` (and ``max_tokens: 1``). It runs as usual; when it finishes (length
   or stop, not abort) its blocks are *held*, still referenced (not free, not evictable), under a
   lease of ``kv_lease_duration_s``, and the answer's top-level ``kv_transfer_params`` says where
   they are, with vLLM's keys (``nixl/pull_scheduler.py`` ``request_finished``, plus
   ``remote_prefill_cached_tokens`` from ``v1/core/sched/scheduler.py``)::

       {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[ids...]],
        "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ..., "remote_port": ...,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": N,
        "remote_blocks_expiry_time": null, "transfer_mode": "pull",
        "remote_prefill_cached_tokens": K}

   ``remote_block_ids`` is one list per KV-cache group (one here), as vLLM 0.32 sends it; a flat
   list (older vLLM) is accepted on the way in. ``remote_host``/``remote_port`` are the
   simulator's own HTTP address: a pull is ``POST /sim/kv_transfer/pull`` there (NIXL's RDMA read
   plus its completion notification, in one call).
2. **Decode** on a consumer: the request carries those params back. Before it is queued, the
   consumer looks up its own prefix cache (block-aligned), reads the blocks it lacks (the last
   ``cdiv(prompt, block) - local_hit_blocks`` of the producer's, vLLM's ``_apply_prefix_caching``)
   and pays ``blocks x block_size x kv_bytes_per_token / kv_transfer_bytes_per_s`` modelled
   seconds for it, outside the engine's steps (NIXL reads asynchronously while the engine runs
   other requests); the producer then frees the blocks. Admission counts every prompt token as
   computed but the last, recomputed for its logits (``_update_waiting_for_remote_kv``), so TTFT
   is queueing + transfer + a one-token prefill step. The loaded blocks are cached and announced
   (``BlockStored``) as computed ones are, as vLLM's ``cache_blocks`` does.
3. A producer that nobody pulls from frees the blocks when the lease ends
   (``vllm:nixl_num_kv_expired_reqs``); a pull of unknown, expired or already pulled blocks is
   404. A failed load (unreachable producer, 404, params missing a field, fewer remote blocks than
   needed) follows ``kv_load_failure_policy``: ``fail`` (vLLM's default) answers 500
   ``Internal server error`` (streaming: an error event, then ``[DONE]``); ``recompute`` computes
   the prompt locally. vLLM 0.32 itself hangs or asserts on params missing a field
   (``pull_scheduler.py`` 59-65, 179-186); the sim fails the load instead.

Several engine requests in one HTTP request (``n`` > 1, a completions batch) each hold their
blocks, and the answer names the first one's, as vLLM's completions answer does
(``final_res_batch[0].kv_transfer_params``); the others expire. A consumer loads remote KV only
for a single prompt.

Trade-offs: the consumer pulls before its request is queued, where vLLM allocates the blocks
first and parks the request in ``WAITING_FOR_REMOTE_KVS`` (counted in
``vllm:num_requests_waiting`` here too); so a consumer with a full cache pulls before it waits,
not after. The lease is wall-clock time (a timeout, like vLLM's); the transfer is modelled time.
A pull costs one loopback HTTP call and no CPU per byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.sim.kvcache import SimLora
from gateway.sim.metrics import ConnectorMetrics
from gateway.sim.scheduler import SamplingSpec, Scheduler, SimRequest

log = logging.getLogger(__name__)

PULL_PATH = "/sim/kv_transfer/pull"
PULL_TIMEOUT_S = 10.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def transfer_bytes(num_blocks: int, block_size_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes a pull of ``num_blocks`` whole blocks moves (NIXL reads whole blocks)."""
    return num_blocks * block_size_tokens * kv_bytes_per_token


def transfer_time_s(num_bytes: int, bytes_per_s: float) -> float:
    """Modelled seconds to move ``num_bytes`` over the link (bandwidth-bound; no latency term)."""
    return num_bytes / bytes_per_s


class BadTransferParams(ValueError):
    """``kv_transfer_params`` asking for a remote prefill without a usable field."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode's prompt KV is: the producer's answer, sent back by the router."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    cached_tokens: int | None
    """The producer's prefix-cache hit (``remote_prefill_cached_tokens``), if it said."""

    @property
    def pull_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PULL_PATH}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids(value: Any) -> tuple[int, ...] | None:
    """vLLM 0.32's ``[[ids]]`` (one group) or an older flat ``[ids]``; None if neither."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, list) and value and all(_is_int(b) and b >= 0 for b in value):
        return tuple(value)
    return None


def remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The fields of a ``do_remote_prefill`` request; ``BadTransferParams`` names a bad one."""
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    host, port = params.get("remote_host"), params.get("remote_port")
    blocks = _block_ids(params.get("remote_block_ids"))
    if not isinstance(engine_id, str) or not engine_id:
        raise BadTransferParams("kv_transfer_params.remote_engine_id is missing or invalid")
    if not isinstance(request_id, str) or not request_id:
        raise BadTransferParams("kv_transfer_params.remote_request_id is missing or invalid")
    if not isinstance(host, str) or not host:
        raise BadTransferParams("kv_transfer_params.remote_host is missing or invalid")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadTransferParams("kv_transfer_params.remote_port is missing or invalid")
    if blocks is None:
        raise BadTransferParams("kv_transfer_params.remote_block_ids is missing or invalid")
    cached = params.get("remote_prefill_cached_tokens")
    ok_cached = isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0
    return RemotePrefill(engine_id=engine_id, request_id=request_id, host=host, port=port,
                         block_ids=blocks, cached_tokens=cached if ok_cached else None)


@dataclass(frozen=True)
class Lease:
    """A finished prefill's blocks, held for a remote decode."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    """Tokens whose KV the blocks hold (vLLM's ``remote_num_tokens``)."""
    cached_tokens: int
    """The prefill's own prefix-cache hit (``remote_prefill_cached_tokens``)."""
    expires_at: float
    """``loop.time()`` when the blocks are freed unless pulled."""


class PullRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoadResult:
    """What a decode's pull gave: ``loaded`` False means the prompt is computed locally (no
    connector use, or ``recompute`` after a failure); ``failed`` with the ``fail`` policy."""

    loaded: bool
    failed: bool = False
    cached_tokens: int | None = None
    num_blocks: int = 0
    num_bytes: int = 0
    transfer_s: float = 0.0
    """Modelled transfer time (wall time is this times ``time_scale``)."""


NOT_LOADED = LoadResult(loaded=False)


class KVTransfer:
    """One worker's NIXL connector: the producer's leases and the consumer's pulls."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        block_size_tokens: int,
        kv_bytes_per_token: int,
        bytes_per_s: float,
        lease_s: float,
        time_scale: float,
        recompute_on_failure: bool,
        engine_id: str | None = None,
        host: str = "localhost",
        metrics: ConnectorMetrics | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_size_tokens = block_size_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bytes_per_s = bytes_per_s
        self.lease_s = lease_s
        self.time_scale = time_scale
        self.recompute_on_failure = recompute_on_failure
        self.engine_id = engine_id or str(uuid.uuid4())
        self.host = host
        self.port = 0
        """The HTTP port pulls reach; the fleet sets it (with ``host``) once it listens."""
        self.metrics = metrics
        self._wake = wake
        self._leases: dict[str, Lease] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._client: httpx.AsyncClient | None = None
        self.loading = 0
        """Pulls in progress (requests vLLM would count as waiting for remote KV)."""
        self.num_pulled = 0
        self.num_expired = 0

    # -- producer ---------------------------------------------------------------------------

    def hold(self, request: SimRequest) -> None:
        """Start the lease of a finished ``kv_hold`` request (the engine calls this)."""
        loop = asyncio.get_running_loop()
        rid = request.request_id
        self._leases[rid] = Lease(
            request_id=rid,
            block_ids=tuple(self.scheduler.held_block_ids(rid)),
            num_tokens=request.num_computed_tokens,
            cached_tokens=request.num_cached_tokens,
            expires_at=loop.time() + self.lease_s,
        )
        self._timers[rid] = loop.call_later(self.lease_s, self._expire, rid)

    def lease(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def params_for(self, request_id: str) -> dict[str, Any] | None:
        """The answer's ``kv_transfer_params`` for a held request (None: not held)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(lease.block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": lease.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": lease.num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": lease.cached_tokens,
        }

    def pull(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve a consumer's read: check it names held blocks, free them. ``PullRefused``
        with 404 for an unknown engine, request, an expired or an already pulled lease."""
        engine_id, request_id = body.get("remote_engine_id"), body.get("remote_request_id")
        wanted = _block_ids(body.get("remote_block_ids"))
        if not isinstance(engine_id, str) or not isinstance(request_id, str) or wanted is None:
            raise PullRefused(400, "remote_engine_id, remote_request_id (strings) and "
                                   "remote_block_ids (non-empty list of ints) are required")
        if engine_id != self.engine_id:
            raise PullRefused(404, f"unknown engine {engine_id!r}")
        lease = self._leases.get(request_id)
        if lease is None:
            raise PullRefused(404, f"no KV held for request {request_id!r} (unknown, expired "
                                   "or already pulled)")
        if not set(wanted) <= set(lease.block_ids):
            raise PullRefused(400, f"blocks not held for request {request_id!r}")
        self._release(request_id)
        self.num_pulled += 1
        return {"remote_request_id": request_id, "num_blocks": len(wanted),
                "num_tokens": lease.num_tokens}

    def _expire(self, request_id: str) -> None:
        if self._release(request_id):
            self.num_expired += 1
            log.info("KV lease of %s expired after %.1f s; blocks freed", request_id,
                     self.lease_s)
            if self.metrics is not None:
                self.metrics.kv_expired_reqs.inc()

    def _release(self, request_id: str) -> bool:
        self._leases.pop(request_id, None)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        released = self.scheduler.release_held(request_id)
        if released and self._wake is not None:
            self._wake()
        return released

    # -- consumer ---------------------------------------------------------------------------

    async def load(
        self, prompt_token_ids: Sequence[int], params: Mapping[str, Any],
        lora: SimLora | None = None, cache_salt: str | None = None,
    ) -> LoadResult:
        """Pull the prompt KV a ``do_remote_prefill`` request names; wait the transfer time."""
        try:
            remote = remote_prefill(params)
        except BadTransferParams as exc:
            log.warning("%s; the KV load fails", exc)
            return self._failed()
        bs = self.block_size_tokens
        probe = self.scheduler.new_request("kv-probe", prompt_token_ids,
                                           SamplingSpec(max_tokens=1), lora=lora,
                                           cache_salt=cache_salt)
        _, hit_tokens = self.scheduler.kv.get_computed_blocks(probe)
        num_blocks = _cdiv(len(prompt_token_ids), bs) - hit_tokens // bs
        if num_blocks > len(remote.block_ids):
            log.warning("decode needs %d blocks, the prefill worker supplied %d; the KV load "
                        "fails", num_blocks, len(remote.block_ids))
            return self._failed()
        num_bytes = transfer_bytes(num_blocks, bs, self.kv_bytes_per_token)
        model_s = transfer_time_s(num_bytes, self.bytes_per_s)
        t0 = time.monotonic()
        self.loading += 1
        try:
            await asyncio.sleep(model_s * self.time_scale)
            ok = await self._pull(remote, remote.block_ids[len(remote.block_ids) - num_blocks:])
        finally:
            self.loading -= 1
        if not ok:
            return self._failed()
        if self.metrics is not None:
            self.metrics.xfer_time.observe(time.monotonic() - t0)
            self.metrics.bytes_transferred.observe(num_bytes)
        return LoadResult(loaded=True, cached_tokens=remote.cached_tokens,
                          num_blocks=num_blocks, num_bytes=num_bytes, transfer_s=model_s)

    async def _pull(self, remote: RemotePrefill, block_ids: Sequence[int]) -> bool:
        if self._client is None:
            # trust_env off: a pull goes to the producer named, never through a proxy
            self._client = httpx.AsyncClient(timeout=PULL_TIMEOUT_S, trust_env=False)
        body = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id,
                "remote_block_ids": list(block_ids)}
        try:
            resp = await self._client.post(remote.pull_url, json=body)
        except httpx.HTTPError as exc:
            log.warning("KV pull from %s failed: %s", remote.pull_url, exc)
            return False
        if resp.status_code != 200:
            log.warning("KV pull from %s refused: %d %s", remote.pull_url, resp.status_code,
                        resp.text[:200])
            return False
        return True

    def _failed(self) -> LoadResult:
        if self.metrics is not None:
            self.metrics.failed_transfers.inc()
        return NOT_LOADED if self.recompute_on_failure else LoadResult(loaded=False, failed=True)

    async def close(self) -> None:
        """Free every held block and cancel the lease timers; close the pull client."""
        for request_id in list(self._leases):
            self._release(request_id)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None
