"""The overhead benchmark's vocabulary: the request it sends, its cases and targets, and the
values one round, one summary and one verdict are made of."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER, PeerRouter

MODEL = "noop"
PROMPT = "Say hello to the gateway benchmark, please."
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
STREAM_BODY = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
LUA = f"""
wrk.method = "POST"
wrk.body = '{json.dumps(CHAT_BODY, separators=(",", ":"))}'
wrk.headers["Content-Type"] = "application/json"
"""
FRESH_WORDS = ("gateway", "please", "hello", "summarize", "explain", "the", "a", "of", "why",
               "how", "cache", "prompt", "token", "model", "server", "worker", "request", "today",
               "short", "long", "answer", "question", "write", "poem", "about", "river",
               "mountain", "city", "history", "science", "music", "kernel", "budget", "tenant",
               "session", "stream", "quick", "brown", "fox", "lazy", "dog", "blue", "green",
               "seven", "twelve", "again", "with", "without", "under", "over", "before", "after",
               "list", "three", "ideas", "for", "my", "team", "meeting", "tomorrow", "and",
               "then", "translate", "French")
FRESH_LUA = f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local words = {{{", ".join(f'"{w}"' for w in FRESH_WORDS)}}}
local sent = 0
math.randomseed(os.time() + math.floor(os.clock() * 1e6))
request = function()
  sent = sent + 1
  local picked = {{}}
  for i = 1, 8 do picked[i] = words[math.random(#words)] end
  local text = table.concat(picked, " ") .. " " .. sent .. "."
  return wrk.format(nil, nil, nil, '{{"model":"{MODEL}","messages":[{{"role":"user","content":"'
    .. text .. '"}}],"max_tokens":16}}')
end
"""
"""``LUA``'s chat with a new user message on every request: eight words drawn from
``FRESH_WORDS`` and a count, about ``PROMPT``'s length. A gateway that tokenizes meets text it
has not seen, as with real traffic (``short`` repeats one prompt, whose pieces its tokenizer
caches; the Rust routers do not tokenize, so it costs them nothing more)."""
WARMUP_S = 2
START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Case:
    name: str
    backend_delay_ms: float
    concurrency: int
    description: str
    stream_chunks: int = 0
    """0: non-streaming chats from wrk; else streams of this many content chunks."""
    chunk_interval_ms: float = 0.0
    lua: str = LUA
    """wrk's script (non-streaming cases)."""
    default: bool = True
    """Run when no ``--case`` is named."""

    @property
    def streaming(self) -> bool:
        return self.stream_chunks > 0


CASES = (
    Case("short", 0.0, 32, "0 ms backend, wrk c=32, small non-streaming chat"),
    Case("delay20", 20.0, 128, "20 ms backend, wrk c=128, small non-streaming chat"),
    Case("stream", 0.0, 256, "256 concurrent streams of 64 chunks 10 ms apart",
         stream_chunks=64, chunk_interval_ms=10.0),
    Case("fresh", 0.0, 32, "0 ms backend, wrk c=32, small non-streaming chat, a new user "
         "message each time", lua=FRESH_LUA, default=False),
)
ISOLATION = "isolation"
"""The case of ``gateway.bench.isolation`` (short chats while 128K-token prompts flood the
gateway): run only when asked for by name."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    kind: Literal["direct", "floor", "kvgate", "peer"]
    policy: str = ""
    """kvgate and peers: the routing policy; ``floor``: the kind of ``gateway.bench.floor``."""
    tokenizer: str = ""
    """kvgate: ``simple`` or ``hf`` (the tiny model's tokenizer and chat template)."""
    processes: int = 1
    peer: PeerRouter | None = None


BARE = "python_floor"
"""The floor that is a bare Python proxy (``gateway.bench.floor``, kind ``bare``)."""
LAYERS = "kvgate_plumbing"
"""The floor that is kvgate's own server and client with a pass-through app: a kvgate target's
CPU per request beyond it is what its features cost."""


def targets(processes: int) -> list[Target]:
    """Every target, in the order of the tables."""
    out = [Target("direct", "the no-op backend itself", "direct"),
           Target(BARE, "a bare Python proxy (uvloop + httptools, no features)",
                  "floor", "bare"),
           Target(LAYERS, "kvgate's HTTP server and upstream client, a pass-through "
                  "app (no features)", "floor", "plumbing")]
    for policy, tok, label in (("round_robin", "simple", "rr_simple"), ("kv_aware", "hf", "kv_hf")):
        for n in sorted({1, processes}):
            out.append(Target(f"kvgate_{label}_p{n}",
                              f"kvgate {policy}, {tok} tokenizer, {n} process(es)",
                              "kvgate", policy, tok, n))
    out.append(Target("vllm_router_rr", "vllm-router round_robin", "peer", "round_robin",
                      peer=VLLM_ROUTER))
    for policy in ("round_robin", "cache_aware"):
        out.append(Target(f"sglang_{'rr' if policy == 'round_robin' else policy}",
                          f"sglang-router {policy}", "peer", policy, peer=SGLANG_ROUTER))
    return out


@dataclass(frozen=True)
class Load:
    """What the load generator saw in one round."""

    requests: int
    errors: int
    """Non-2xx answers, socket errors, streams without content or without ``[DONE]``."""
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None


@dataclass(frozen=True)
class Round:
    case: str
    target: str
    index: int
    load: Load
    wall_s: float
    router_cpu_s: float | None
    """None for ``direct``."""
    backend_cpu_s: float
    loadgen_cpu_s: float
    machine_cpu_s: float
    """Busy CPU of the whole machine (all cores) during the round."""
    router_processes_cpu_s: tuple[float, ...] = ()
    """CPU seconds of each child process of the router (a supervisor's), busiest first; empty
    for a router of one process."""
    router_kernel_cpu_s: float | None = None
    """The part of ``router_cpu_s`` spent in the kernel."""


@dataclass(frozen=True)
class Summary:
    """One target in one case: medians over rounds; CPU summed over rounds / requests."""

    case: str
    target: str
    rounds: int
    requests: int
    errors: int
    requests_per_s: float
    ratio: float | None
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    router_cpu_us_per_request: float | None
    backend_cpu_us_per_request: float
    loadgen_cpu_us_per_request: float
    router_cores: float | None
    backend_cores: float
    loadgen_cores: float
    other_cores: float
    busiest_process_share: float | None = None
    """For a router of several processes: the busiest one's part of their CPU, over all rounds
    (1 / N when the processes shared the work evenly)."""
    processes: int = 1
    supervisor_cpu_us_per_request: float | None = None
    """For a router of several processes: the CPU per request of what ran outside them (kvgate's
    supervisor, which hosts the shared budget store: one process whatever N is, so it bounds
    the whole gateway's rate at ``1e6 / this`` requests per second)."""
    router_kernel_cpu_us_per_request: float | None = None
    """The part of ``router_cpu_us_per_request`` spent in the kernel: its system calls, on
    loopback the receiver's TCP path and wake-up as well. It depends on the machine (a VM's
    cross-core wake-ups are dear) and on the rate (receivers that are busy need no wake-up),
    where the rest, user space, is the router's own code."""

    @property
    def requests_per_s_per_core(self) -> float | None:
        c = self.router_cpu_us_per_request
        return 1e6 / c if c else None


@dataclass(frozen=True)
class Verdict:
    goal: str
    target: str
    met: bool | None
    """None: not evaluated (a target it needs did not run)."""
    detail: str

