"""Simulated vLLM workers: the API, metrics and KV events of vLLM 0.32, without a GPU.

A simulated worker answers what the gateway (and competing routers) ask of a vLLM server:
``/v1/chat/completions`` and ``/v1/completions`` (SSE or not), ``/v1/models``, ``/health``,
``/tokenize``, ``/metrics`` with vLLM's metric names, and KV-cache events over ZMQ in vLLM's wire
format. Inside, it runs vLLM's scheduling and prefix-caching rules on a paged KV cache, and an
engine loop that sleeps for each step's modelled duration. Uses: the ``kvgate demo``, capacity
planning, and benchmarks with many workers on a laptop.

Modules, inside out:

* ``kvcache``   paged blocks, chained block hashes (vLLM's own sha256), ref counts, LRU eviction;
* ``scheduler`` continuous batching, chunked prefill, recompute preemption (pure, no clock);
* ``costmodel`` step time from the planner's roofline formulas (prefill compute, decode memory);
* ``engine``    the asyncio loop that runs steps in scaled real time and streams tokens;
* ``metrics``   vLLM's Prometheus metrics on a per-worker registry;
* ``kvevents``  KV events encoded byte-for-byte like vLLM's msgspec structs, PUB + replay ROUTER;
* ``kvtransfer`` prefill/decode disaggregation as vLLM's NIXL connector runs it
                (``kv_transfer_params``, held blocks under a lease, pulls priced by link bandwidth);
* ``output``    what a request asks of its answer (n, logprobs, stop, echo, tools, JSON), vLLM's
                checks and shapes;
* ``api``       the OpenAI/vLLM HTTP surface as a bare ASGI app;
* ``worker``    one worker; ``fleet`` many in one process; ``cli`` is ``kvgate sim``.

Public API: ``SimWorkerConfig`` (``gateway.sim.config``), ``SimFleet`` (``gateway.sim.fleet``),
``register`` (``gateway.sim.cli``).

Fidelity, checked against a real vLLM 0.32 CPU server (tiny Llama, 32-token blocks, 12 blocks,
one sequence of 16 requests with repeats, extensions, a fully cached prompt and evictions):
equal ``prefix_cache_queries``/``prefix_cache_hits`` after every request, the same
``BlockStored``/``BlockRemoved`` sequence, identical block hashes for prompt blocks (with the same
hash seed); only blocks holding generated tokens differ, because the tokens do.

Measured on the 2-core dev box (``python -m gateway.sim.measure``; llama-3-8b@h100, time_scale 1):

* 16 workers in one process: start in about 0.5 s, 60 MB RSS, idle CPU 0.0-0.5 % of one core;
* 16 workers, one streaming client each (512-token prompts, 64 tokens): about 3,100 tokens/s
  streamed for 20 % of one core; four clients each: about 9,000 tokens/s for 32 %;
* one request on an idle worker, client side: TPOT within 0.3 % of ``decode_step_time_s``;
  TTFT is ``prefill_time_s`` plus 3-10 ms of HTTP, JSON and hashing (+38 % at 256 tokens,
  +10 % at 1K, +4 % at 4K, +2 % at 16K).

Limits: one process runs one event loop, so about 10-15K engine steps per second in total; a
``time_scale`` that asks for more (e.g. 0.1 with 16 busy workers, each step ~0.5 ms) falls behind
its model clock, which the engine logs once. Run several fleets in separate processes instead.
"""

from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet

__all__ = ["SimFleet", "SimWorkerConfig"]
