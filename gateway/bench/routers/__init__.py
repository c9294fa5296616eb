"""Benchmark: kvgate's routing against competing routers on the same workers, one command each.

``python -m gateway.bench.routers --scenario NAME`` starts the workers, starts every contender in
front of them, runs ``kvgate bench``'s load generator against each contender in turn (same
requests, same arrival schedule, every worker's prefix cache reset before each contender, a fresh
prompt salt per contender), computes the hit-rate ceiling, prints one table per workload, checks
the issue's targets, stops everything it started, and writes under ``results/routers/NAME/``:
``routers.json`` (every number, the exact commands, skipped contenders and why), ``routers.png``
(hit rate against the ceiling, TTFT p50/p99 per contender; ``--replot`` redraws it from the
JSON), per workload ``WORKLOAD/bench.json`` and ``WORKLOAD/latency_cdf.png`` (``kvgate bench``'s
own files), and every process's log and every gateway's config under ``logs/``.

Scenarios (each about 5-10 minutes on 2 cores; ``--quick`` for a smoke run):

* ``vllm``: two real vLLM CPU servers (``gateway/procs/vllm.py``: ``$KVGATE_VLLM_PYTHON`` or
  ``.venv-vllm``, the tiny model in ``$KVGATE_TINY_MODEL`` or ``.cache/tiny-llama``,
  32-token blocks, KV events, one core each, a KV cache held to 192 blocks (6K tokens) per
  server with ``--num-gpu-blocks-override`` so that one server cannot hold all eight 1K-token
  prefixes but the two together can); shared-prefix (320 requests, 32-token questions), closed
  loop, 4 users, ``max_tokens`` 8. About 2 minutes.
* ``sim16``: sixteen simulated H100s (``kvgate sim`` in 4 processes, llama-3-8b@h100, 1,024
  16-token blocks per worker, ``--time-scale 8``: the modelled GPU runs 8x slower than real
  time so the 2 cores keep up; wall-clock TTFTs are 8x the modelled ones, ratios are not
  affected); shared-prefix (32 prefixes of 2K tokens, open loop 24 req/s: one worker holds 8
  prefixes, the fleet all of them many times over) and multiturn (the bench's default sessions,
  48 of them x 8 turns, 48 users, 64-token answers). About 7.5 minutes.
* ``isolation``: eight simulated H100s (time scale 2); the mixed workload (10 req/s, a quarter
  of them 16K-token prompts, the rest 200-token chats) against (a) two pools, 4 short-chat + 4
  long-context workers, (b) one pool of the same 8 workers, kv_aware, and (c) that pool with
  round_robin; then the short chats alone at the same short-chat rate (7.5 req/s). The target
  is (a)'s short-chat TTFT p99 with the flood within 1.2x of its value without. About 5
  minutes.
* ``tiers``: four simulated H100s with a CPU tier each (``--cpu-offload-blocks``), a working
  set 1.5x the fleet's GPU KV but within GPU + CPU; kvgate with lower tiers kept against
  kvgate with a GPU-only index (and the Rust routers when named): target warm TTFT p99 <= 0.5x
  the GPU-only index's (``scenario_tiers.py``).
* ``slo``: a mixed H100/A100 pool, interactive and batch classes with TTFT objectives;
  ``kv_aware`` alone against ``kv_aware`` with ``x-slo-ttft-ms`` sent: target attainment >= 95%
  with shed requests counted (``scenario_slo.py``).
* ``zipf_hot``: eight simulated H100s, 64 system prompts of 3K tokens with Zipf popularity near
  saturation; ``kv_aware`` with and without hot-prefix spreading against the Rust routers:
  target TTFT p90/p99 <= 0.7x the best of them, hit rate within 1 point of the ceiling
  (``scenario_zipf.py``).
* ``restart``: four simulated H100s holding 24 prefixes; each router stopped and started again:
  its hit rate in the first 2 s after it answers against its steady one, target >= 95% for
  kvgate with the workers' replay sockets (``scenario_restart.py``).

Contenders (``--contenders`` picks some):

* ``kvgate_kv``: ``kvgate serve``, policy ``kv_aware``, KV events from every worker (precise);
* ``kvgate_approx``: ``kv_aware`` without event endpoints (the gateway's routing history only);
* ``kvgate_rr``: ``round_robin``, the baseline;
* ``sglang_cache_aware``: SGLang's model gateway (PyPI ``sglang-router``), ``--policy cache_aware``;
* ``vllm_router_cache_aware``: PyPI ``vllm-router``, ``--policy cache_aware``.

The two Rust routers live in their own virtual environments, never the gateway's::

    python3 -m venv .venv-sglang && .venv-sglang/bin/pip install sglang-router
    python3 -m venv .venv-vllm-router && .venv-vllm-router/bin/pip install vllm-router

and are found through ``--sglang-router`` / ``--vllm-router``, ``$KVGATE_SGLANG_ROUTER`` /
``$KVGATE_VLLM_ROUTER``, ``PATH``, or those two venvs under the repository root
(``gateway/procs/peers.py``). A contender that is not installed or does not start is recorded
with the reason (its log's tail) and the run goes on without it.

The ceiling: every request of a contender's run sent, in the order it was sent, to one cache that
never evicts, with vLLM's rules (full blocks only, chained hashes, a fully cached prompt still
recomputes its last token). ``ceiling()`` does that on the token ids the gateway's tokenizer
gives for the exact bodies sent (salt included), at the workers' block size. It ignores that two
requests in flight together cannot share blocks neither has computed yet, so it is an upper bound.

TTFT p99 over all requests is, with a few dozen prefixes or sessions, the TTFT of the requests
that are *cold by construction* (the first of each prefix, every session's first turn: even the
ceiling's cache hits less than half of them) and compares cold starts, not routing; the tables
also give the *warm* p99, over the other requests, and the targets are checked on both.

Hit rates are the workers' own counters (``vllm:prefix_cache_hits_total`` /
``..._queries_total``, in tokens) read before and after each contender. For the kvgate gateways
the run also records ``kvgate_routing_decisions_total`` by reason and requests per worker; for
every contender, the prompt tokens each worker was asked for (its load share).

The parts: ``ceiling`` (the hit-rate ceiling, warm requests, counter deltas), ``targets`` (the
issue's targets as verdicts), ``workers`` and ``contenders`` (what each scenario starts, through
the process kit ``gateway/procs``), ``driver`` (one workload against every contender),
``report`` (tables, JSON, PNG), ``scenarios`` and ``cli`` (``python -m gateway.bench.routers``).
"""
