"""Benchmark: what a router costs in front of a model server, kvgate side by side with the Rust
routers, in one run.

Steps, for each case: start the no-op backend (``gateway.bench.noop``) with the case's model
time, and every target in front of it on loopback: ``direct`` (no router), kvgate (round_robin
with the ``simple`` tokenizer, and kv_aware with the exact HF tokenizer and chat template of
``.cache/tiny-llama``; each as 1 process and as ``--processes N``), vllm-router (round_robin)
and sglang-router (round_robin and cache_aware), and two floors (``gateway.bench.floor``):
``python_floor``, a bare Python proxy on the same event loop (uvloop + httptools, no task, no
features: what any Python proxy pays per request), and ``kvgate_plumbing``, kvgate's own HTTP
server and upstream client joined by a pass-through app (what kvgate's layers pay before any
feature). kvgate's CPU per request minus ``kvgate_plumbing``'s is what its features cost
(parsing, tokenization, routing, budgets, metrics, hit accounting): printed per kvgate target
and case after the tables. Warm each up, then run ``--rounds`` rounds of
the same load against every target, the order rotated each round so that drift (other load,
thermal, the page cache) hits every target alike. Targets that cannot start are skipped with
the reason (a missing binary, a ``kvgate serve`` without ``--processes``); the run goes on.

Cases (``--case``, all but ``isolation`` by default):

- ``short``: 0 ms backend, wrk at 32 connections, a small non-streaming chat: the router's CPU
  per request, undiluted;
- ``delay20``: 20 ms backend, wrk at 128 connections: a fleet's worth of short chats;
- ``stream``: 256 concurrent streams of 64 chunks 10 ms apart (decode steps shared by all
  streams, as in a vLLM engine step), from a lean aiohttp client in this process that splits
  the SSE stream and counts content events without parsing JSON: TTFT p50/p99 and TPOT p50
  (wrk cannot see the first token);
- ``isolation`` (only when named): short chats at a 20 ms backend, c=16, without and with a
  flood of distinct ~128K-token prompts at 2/s to a second pool: the added latency of each
  phase, their ratio (target <= 1.2x) and the CPU per short request (``gateway.bench.isolation``).

How to read the table (one per case; medians over rounds):

- ``ratio``: req/s through the target / req/s direct. ``+p50``/``+p99``: latency added to direct's
  (for ``stream``: end to end of a whole stream; TTFT and TPOT have their own columns).
- ``router/backend/loadgen us/req``: CPU microseconds per request (user + system, from
  ``/proc/PID/stat``, summed over the process tree: kvgate's supervisor and its children, each
  process's threads; children that exited count through their parent's ``cutime``/``cstime``),
  taken before and after each round and divided by the requests served in it. wrk's CPU comes
  from ``getrusage(RUSAGE_CHILDREN)`` around it; the streaming client's from
  ``getrusage(RUSAGE_SELF)``. ``cores r/b/l/o`` is the same CPU divided by the round's wall
  time, and ``o`` the rest of the machine's busy CPU (``/proc/stat``: other processes, this
  benchmark's own bookkeeping): where the cores went. When they add up to the core count, the
  machine, not the router, set the throughput: read the CPU per request then, not the ratio; a
  large ``o`` means the machine was not quiet.
- The streaming client is not the bottleneck when its ``cores`` stay well under one (it is one
  Python thread) and direct's TPOT p50 stays at the backend's interval (10 ms): both printed.

What it predicts for a bigger gateway node: CPU per request is the figure that transfers. A
gateway process that spends C microseconds of CPU per request serves at most 1e6 / C requests per
second per core (``req/s/core``), so a 16-core gateway node running ``--processes 16`` tops out
near 16e6 / C req/s (printed for every router from the ``short`` case; an upper bound: it assumes
the processes scale linearly and the backends and clients run elsewhere). A gateway of several
processes has one more bound: its supervisor, which hosts the shared budget store for all of
them, is one process whatever N is, so the node serves at most 1e6 / S req/s where S is the
supervisor's CPU per request (printed beside, and said when it binds before the cores). The
ratio on this 2-core machine does not transfer: the backend and the load generator share the
cores. Nor does all of the CPU per request: it is printed again as user space (the router's own
code) plus kernel (``stime``: its system calls, and on loopback the receiver's TCP path and
wake-up, which a VM's cross-core interrupts make dear and which a slower router pays more of, its
receivers idling between its writes); the user-space part is the router's own.

Targets (printed met / missed / not run, every one, from the same run): kvgate kv_aware + HF at
``delay20`` keeps >= 0.9 of direct's throughput with added p99 <= 10 ms; its CPU per ``short``
request <= 2x vllm-router's; its ``stream`` TTFT p99 <= 1.2x the best Rust router's; kvgate with N
processes does not lose to 1 process (req/s, each case and configuration).

Output: the tables, ``overhead.json`` (every round, every summary, the verdicts) and
``overhead.png`` under ``--out``; the logs and configs of every process under ``--out``/logs.
``--profile [DIR]`` adds one unmeasured round per kvgate target under py-spy (``pip install
py-spy``; it samples the whole process tree at 200 Hz) and writes its flame graph,
``DIR/profile_<case>_<target>.svg`` (default DIR ``docs/results``).

Two companions for changes too small for this comparison to resolve (a few microseconds per
request move less than this machine's CPU figures drift between runs):
``python -m gateway.bench.overhead.ab --base DIR`` runs another checkout and this one side by
side in front of one backend in alternating pairs of rounds and reads the paired difference of
CPU per request; ``python -m gateway.bench.overhead.calls [--base DIR]`` counts the Python calls
per request of the app called in-process under cProfile (deterministic to a call or two).

Run (the full comparison takes about 20 minutes with the defaults):
``python -m gateway.bench.overhead [--case short|delay20|stream|isolation ...]
[--target NAME ...] [--duration-s 10] [--rounds 3] [--processes N] [--out results/overhead]``.
"""
