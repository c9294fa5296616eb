"""The Rust routers kvgate is compared with: SGLang's model gateway and vllm-router.

Each lives in its own virtual environment, never the gateway's::

    python3 -m venv .venv-sglang && .venv-sglang/bin/pip install sglang-router
    python3 -m venv .venv-vllm-router && .venv-vllm-router/bin/pip install vllm-router

and its binary is found, in this order, from an explicit path (a command-line flag), an
environment variable (``$KVGATE_SGLANG_ROUTER``, ``$KVGATE_VLLM_ROUTER``), ``PATH``, or that venv
under the repository root. A router is ready when a one-token chat completion through it is
answered 200 (it has found its workers). Both take ``--policy`` (``round_robin``, ``cache_aware``
...); ``cache_aware`` is what the routers benchmark runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.procs.net import LOOPBACK
from gateway.procs.process import REPO_ROOT, ManagedProcess, StartError

ArgvOf = Callable[[int, int, Sequence[str], str], list[str]]
"""(port, metrics port, worker URLs, policy) -> the router's arguments."""


@dataclass(frozen=True)
class PeerRouter:
    command: str
    """The binary's name (also its flag: ``--sglang-router``)."""
    dist: str
    """The PyPI distribution that installs it."""
    env_var: str
    venv: str
    """Its virtual environment, relative to the repository root."""
    argv_of: ArgvOf
    description: str

    def find(self, explicit: str | None = None) -> str | None:
        """The binary's path, or None when it is not installed where it is looked for."""
        for candidate in (explicit, os.environ.get(self.env_var), shutil.which(self.command),
                          str(REPO_ROOT / self.venv / "bin" / self.command)):
            if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
                return candidate
        return None

    def missing(self) -> StartError:
        return StartError(
            f"{self.command} not found (give --{self.command}, set ${self.env_var}, or install "
            f"it into its own venv: python3 -m venv {self.venv} && {self.venv}/bin/pip install "
            f"{self.dist})")

    def version(self, binary: str) -> str | None:
        """The installed distribution's version, asked of the Python next to the binary."""
        python = Path(binary).parent / "python"
        if not python.exists():
            return None
        try:
            out = subprocess.run(
                [str(python), "-c",
                 f"import importlib.metadata as m; print(m.version({self.dist!r}))"],
                capture_output=True, text=True, timeout=30, check=True)
        except (subprocess.SubprocessError, OSError):
            return None
        return out.stdout.strip() or None

    def process(self, binary: str, port: int, metrics_port: int, worker_urls: Sequence[str],
                model: str, policy: str = "cache_aware") -> ManagedProcess:
        """The router on ``port`` in front of ``worker_urls`` with ``policy``, ready once it
        serves ``model``."""
        url = f"http://{LOOPBACK}:{port}"
        return ManagedProcess([binary, *self.argv_of(port, metrics_port, worker_urls, policy)],
                              ready=lambda: chat_ok(url, model))


def chat_ok(url: str, model: str) -> bool:
    """A one-token chat completion through ``url`` is answered 200."""
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
    return r.status_code == 200


SGLANG_ROUTER = PeerRouter(
    "sglang-router", "sglang-router", "KVGATE_SGLANG_ROUTER", ".venv-sglang",
    lambda port, metrics_port, urls, policy: [
        "launch", "--host", LOOPBACK, "--port", str(port), "--worker-urls", *urls,
        "--policy", policy, "--prometheus-host", LOOPBACK,
        "--prometheus-port", str(metrics_port), "--log-level", "warn"],
    "SGLang model gateway (cache_aware with its defaults: cache threshold 0.3, balance abs 64 / "
    "rel 1.5)")

VLLM_ROUTER = PeerRouter(
    "vllm-router", "vllm-router", "KVGATE_VLLM_ROUTER", ".venv-vllm-router",
    lambda port, metrics_port, urls, policy: [
        "--host", LOOPBACK, "--port", str(port), "--worker-urls", *urls,
        "--policy", policy, "--prometheus-host", LOOPBACK,
        "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
        "--log-level", "warning"],
    "vllm-router (cache_aware tokenizes on the workers)")
