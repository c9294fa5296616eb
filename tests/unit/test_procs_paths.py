"""Where the process kit finds vLLM's interpreter, the tiny model and the Rust routers: arguments,
then environment variables, then PATH, then repository-relative defaults; never a machine path."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.procs.peers import SGLANG_ROUTER
from gateway.procs.process import REPO_ROOT
from gateway.procs.vllm import tiny_model_path, vllm_python


def test_vllm_python_and_tiny_model_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_VLLM_PYTHON", str(tmp_path / "python"))
    monkeypatch.setenv("KVGATE_TINY_MODEL", str(tmp_path / "model"))
    assert vllm_python() == tmp_path / "python"
    assert tiny_model_path() == tmp_path / "model"


def test_vllm_python_and_tiny_model_default_to_the_repository(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("KVGATE_TINY_MODEL", raising=False)
    assert vllm_python() == REPO_ROOT / ".venv-vllm" / "bin" / "python"
    assert tiny_model_path() == REPO_ROOT / ".cache" / "tiny-llama"
    assert (REPO_ROOT / "gateway" / "procs").is_dir()


def _executable(path: Path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_peer_router_is_found_by_flag_before_environment_before_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flag = _executable(tmp_path / "flag")
    env = _executable(tmp_path / "env")
    (tmp_path / "bin").mkdir()
    on_path = _executable(tmp_path / "bin" / "sglang-router")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("KVGATE_SGLANG_ROUTER", env)
    assert SGLANG_ROUTER.find(flag) == flag
    assert SGLANG_ROUTER.find(None) == env
    monkeypatch.delenv("KVGATE_SGLANG_ROUTER")
    assert SGLANG_ROUTER.find(None) == on_path
    assert SGLANG_ROUTER.find(str(tmp_path / "missing")) == on_path


def test_a_missing_peer_router_says_how_to_install_it_in_its_own_venv() -> None:
    message = str(SGLANG_ROUTER.missing())
    assert "--sglang-router" in message and "$KVGATE_SGLANG_ROUTER" in message
    assert ".venv-sglang/bin/pip install sglang-router" in message
