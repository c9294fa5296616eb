"""Real vLLM for integration tests: a tiny local model and two CPU servers, started once per session.

Both fixtures are lazy: nothing is built or started unless a test asks for them. How a server is
configured and started (its own venv, prefix caching, 32-token blocks, KV events over ZMQ, OpenMP
threads pinned per server, retry when another process takes a port) is the process kit's
(``gateway/procs/vllm.py``), shared with the ``vllm`` router benchmark.

- ``tiny_model_dir``: ``.cache/tiny-llama`` (or ``$KVGATE_TINY_MODEL``), built by
  ``tests/fixtures/build_tiny_model.py`` with vLLM's interpreter when missing or built by another
  version of that script.
- ``vllm_servers``: two ``vllm.entrypoints.openai.api_server`` processes started in parallel,
  stopped at the end of the session (SIGTERM to each process group, SIGKILL after 15 s), with
  ``--enable-prompt-tokens-details`` (vLLM's ``usage.prompt_tokens_details.cached_tokens``).
- ``vllm_with_details``: the first of them, for the tests that compare the gateway's predicted
  cached tokens with vLLM's (a server of its own cost ~50 s of every run's start-up; the tests
  that share it use prompts of their own, so no test depends on what another left cached).
- ``noop_backend_url``: the overhead benchmark's no-op OpenAI backend (``gateway.bench.noop``,
  streams of 5 chunks), for the tests of the request path's own plumbing.

There is no skip anywhere: if vLLM cannot be built or started, the fixture fails with the server log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.procs.kvgate import noop_backend
from gateway.procs.net import free_port
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.vllm import VllmOptions, VllmServer, build_tiny_model, start_vllm_servers

SERVED_MODEL_NAME = "tiny"
NUM_SERVERS = 2
BLOCK_SIZE_TOKENS = 32
MAX_MODEL_LEN_TOKENS = 4096


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny local Llama model (tokenizer + config + bfloat16 weights), built if missing."""
    try:
        return build_tiny_model()
    except StartError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def vllm_servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two real vLLM servers serving the tiny model as "tiny", started in parallel; they report
    ``prompt_tokens_details.cached_tokens``."""
    options = VllmOptions(served_model_name=SERVED_MODEL_NAME,
                          block_size_tokens=BLOCK_SIZE_TOKENS,
                          max_model_len_tokens=MAX_MODEL_LEN_TOKENS, prompt_tokens_details=True)
    with ProcessSet(tmp_path_factory.mktemp("vllm-servers")) as procs:
        try:
            servers = start_vllm_servers(procs, NUM_SERVERS, options, tiny_model_dir)
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield servers


@pytest.fixture(scope="session")
def vllm_with_details(vllm_servers: list[VllmServer]) -> VllmServer:
    """A real vLLM server that reports ``prompt_tokens_details.cached_tokens``."""
    return vllm_servers[0]


@pytest.fixture(scope="session")
def noop_backend_url() -> Iterator[str]:
    """The no-op backend's URL; the process is stopped at the end of the session."""
    proc, url = noop_backend(free_port(), stream_chunks=5)
    proc.start(timeout_s=60)
    try:
        yield url
    finally:
        proc.stop()
