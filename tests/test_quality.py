"""The code base stays typed (mypy --strict) and linted (ruff): checked on every test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)


def test_ruff_finds_nothing() -> None:
    r = run("ruff", "check", "gateway", "tests")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_finds_nothing() -> None:
    r = run("mypy")  # files and strictness from pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
