"""One kit for the processes tests and benchmarks start: ports, readiness, children, teardown.

Tests (``tests/``) and benchmarks (``gateway/bench/``) start the same things: simulated workers,
real vLLM servers, ``kvgate serve`` with a config, the Rust routers kvgate is compared with, and
the odd Redis or Prometheus. Each lives here once:

- ``net``: free loopback ports (one, several distinct, or runs of consecutive ones) and
  ``wait_until`` / ``http_ok``, the polls every start-up waits on;
- ``process``: ``ManagedProcess``, a child in its own process group with its output in a log,
  started, waited for, paused, killed and stopped (SIGTERM to the group, SIGKILL after a grace)
  the same way everywhere, and ``ProcessSet``, the children of one run stopped together;
- ``kvgate``: ``kvgate serve`` (``GatewayProcess``) and ``kvgate sim`` (``SimProcess``, one or
  several simulated workers per process);
- ``vllm``: real vLLM CPU servers on the tiny test model (``start_vllm_servers``);
- ``peers``: the Rust routers (``sglang-router``, ``vllm-router``), found and started.

No path of one machine is written anywhere: the repository root is found from this package's
location, and binaries and virtual environments come from arguments, environment variables
(``KVGATE_VLLM_PYTHON``, ``KVGATE_TINY_MODEL``, ``KVGATE_SGLANG_ROUTER``,
``KVGATE_VLLM_ROUTER``) or ``PATH``, with repository-relative defaults (``.venv-vllm`` ...).
"""
