"""The compiled request path (``gateway.native``): used when built and fresh, never when stale."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway import native
from gateway.procs.process import REPO_ROOT, child_env


def _run(code: str, **env: str) -> list[str]:
    """``code`` in a fresh interpreter of this checkout; its output lines."""
    full = {k: v for k, v in os.environ.items() if k != native.ENV} | env
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, env=full,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_fingerprint_changes_with_any_edit_addition_or_removal(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    (pkg / "_native").mkdir()
    (pkg / "notes.txt").write_text("not source")
    seen = {native.fingerprint(pkg)}
    (pkg / "_native" / "x.py").write_text("built, not source\n")  # the build's own files
    (pkg / "notes.txt").write_text("still not source")
    assert native.fingerprint(pkg) in seen
    (pkg / "sub" / "b.py").write_text("B = 3\n")  # same size, later time
    os.utime(pkg / "sub" / "b.py", ns=(2**62, 2**62))
    seen.add(native.fingerprint(pkg))
    (pkg / "c.py").write_text("")
    seen.add(native.fingerprint(pkg))
    (pkg / "a.py").unlink()
    seen.add(native.fingerprint(pkg))
    assert len(seen) == 4


def test_a_stale_missing_or_partial_build_is_not_used(tmp_path: Path) -> None:
    """In a process where nothing was installed (``KVGATE_NATIVE=0`` at import), ``install`` on
    build directories that must not be used: the source stays."""
    lines = _run(f"""
        import os, sys
        from pathlib import Path
        from gateway import native
        os.environ.pop("{native.ENV}")
        build = Path({str(tmp_path)!r})
        print(native.install(build))                      # no stamp
        (build / "STAMP").write_text("1 2 3\\n")
        print(native.install(build))                      # another source's stamp
        (build / "STAMP").write_text(native.fingerprint() + "\\n")
        print(native.install(build))                      # fresh stamp, no extensions
        import gateway.routing.router as r
        print(r.__file__)
    """, **{native.ENV: "0"})
    assert lines[0].startswith("source (not built")
    assert lines[1].startswith("source (the build is older than the source")
    assert lines[2].startswith("source (the build is incomplete")
    assert lines[3].endswith("router.py")


def test_kvgate_native_0_imports_the_source() -> None:
    status, path = _run("""
        from gateway import native
        import gateway.dispatch as d
        print(native.status()); print(d.__file__)
    """, **{native.ENV: "0"})
    assert status == f"source ({native.ENV}=0)"
    assert path.endswith("dispatch.py")


def test_a_fresh_build_is_what_every_hot_module_is_imported_from() -> None:
    """The build in this checkout, as it is: fresh (``scripts/setup.sh`` built it and nothing
    changed since) -> every module of ``MODULES`` comes from its extension; otherwise every one
    from its source, and the status says why."""
    fresh = (native.STAMP.is_file() and native.STAMP.read_text().strip() == native.fingerprint()
             and bool(native.extension_files()))
    lines = _run(f"""
        import importlib
        from gateway import native
        print(native.status())
        for m in {native.MODULES!r}:
            print(importlib.import_module(m).__file__)
        # the hot path runs: the server's, the router's and the index's classes work
        from gateway.kvindex.index import BlockIndex
        from gateway.kvindex.hashing import block_hashes
        idx = BlockIndex(default_capacity_blocks=8)
        hs = block_hashes(list(range(64)), 16)
        idx.record_routed("w", hs)
        print(idx.match_prefix(hs, ["w", "v"]))
    """)
    status, files, answer = lines[0], lines[1:-1], lines[-1]
    assert len(files) == len(native.MODULES)
    if fresh:
        assert status.startswith("compiled")
        assert all(f.endswith(native.EXTENSION_SUFFIX) and "/_native/" in f for f in files), files
    else:
        assert status.startswith("source (")
        assert all(f.endswith(".py") for f in files), files
    assert answer == "{'w': 4, 'v': 0}"


def test_the_process_kit_passes_kvgate_native_on_and_drops_other_kvgate_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setenv("KVGATE_LISTEN__PORT", "1")
    env = child_env()
    assert env[native.ENV] == "0" and "KVGATE_LISTEN__PORT" not in env
