"""The request path's hot modules compiled to C (mypyc), used when they are built and fresh.

Why: the gateway's CPU per request is Python work spread over ~40 functions (README, "The
gateway's own overhead"); compiling the modules a request runs through (``MODULES``: the server,
the upstream client and relay, dispatch, routing, the KV index, budgets, prompts, metrics) takes
the interpreter's dispatch out of them. The code is the same ``mypy --strict`` source; mypyc
turns it into one C extension per module plus one shared library (``GROUP``).

How it is used: ``scripts/build_native.py`` (run by ``scripts/setup.sh``) compiles ``MODULES``
into ``BUILD_DIR`` (``gateway/_native/``, not in git) and writes ``STAMP`` there last: a
fingerprint of every ``.py`` file of the package (count, sizes, modification times) taken
before compiling. ``install`` (called by ``gateway/__init__.py``, so every process of the
gateway, the simulator and the tests does it first) compares that fingerprint with the source
as it is now; when they match it puts a finder first on ``sys.meta_path`` that loads each of
``MODULES`` from its extension. When they do not (a file was edited, added or removed since the
build: compiled code inlines constants and layouts of the modules it imports, so any change may
matter), or when nothing was built, or ``KVGATE_NATIVE=0``, nothing is installed and every
module is imported from its source as before. So an edit is never shadowed by a stale build;
``scripts/build_native.py`` makes it fast again.

The extensions live apart from the source (not next to each ``.py``, where Python's default
finder would prefer them over the source whatever their age). ``status`` says which it is, and
``kvgate serve`` logs it at start.

Cost of the check: one ``os.scandir`` walk of the package (~200 files), ~1-2 ms per process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

PACKAGE_DIR: Final = Path(__file__).resolve().parent
BUILD_DIR: Final = PACKAGE_DIR / "_native"
STAMP: Final = BUILD_DIR / "STAMP"
GROUP: Final = "kvgate_native"
"""The shared library's module name is ``GROUP + "__mypyc"``."""
EXTENSION_SUFFIX: Final = importlib.machinery.EXTENSION_SUFFIXES[0]
ENV: Final = "KVGATE_NATIVE"
"""``0`` turns the compiled modules off (the source is imported) for a process and the children
that inherit its environment (the process kit's ``child_env`` keeps it)."""

MODULES: Final[tuple[str, ...]] = (
    "gateway.app",
    "gateway.auth",
    "gateway.backlog",
    "gateway.budgets.memory",
    "gateway.budgets.models",
    "gateway.budgets.service",
    "gateway.budgets.shared",
    "gateway.budgets.session_id",
    "gateway.dispatch",
    "gateway.httpd.protocol",
    "gateway.kvindex.hashing",
    "gateway.kvindex.index",
    "gateway.kvindex.service",
    "gateway.kvindex.siblings",
    "gateway.metrics",
    "gateway.overload",
    "gateway.prompt.limits",
    "gateway.prompt.render",
    "gateway.prompt.segments",
    "gateway.prompt.template",
    "gateway.prompt.tokenizer",
    "gateway.request",
    "gateway.routing.accounting",
    "gateway.routing.hot",
    "gateway.routing.kv_aware",
    "gateway.routing.router",
    "gateway.routing.types",
    "gateway.upstream.client",
    "gateway.upstream.context",
    "gateway.upstream.disagg",
    "gateway.upstream.headers",
    "gateway.upstream.hold",
    "gateway.upstream.outcome",
    "gateway.upstream.placement",
    "gateway.upstream.proxy",
    "gateway.upstream.relay",
    "gateway.upstream.sse",
    "gateway.workers.adapters",
    "gateway.workers.health",
    "gateway.workers.load_table",
    "gateway.workers.registry",
    "gateway.workers.worker",
)
"""What a request runs through (cProfile of the short path, ``gateway.bench.overhead.calls``).
Session 26 added the app's hot-path hand-off, the budget service (its unused
``asynccontextmanager`` dropped), API keys, limits, hot prefixes, headers and the worker registry,
health and adapters (-9% CPU per short request, paired A/B), and the routing values
(``gateway.routing.types``; the index protocols, ``runtime_checkable``, moved to
``gateway.routing.index_like``). Left as source: everything off the request path.

mypyc leaves a dataclass's generated ``__init__`` to the interpreter (mypyc issue 817), and a
frozen one sets each field through ``object.__setattr__`` from Python (~1.3 µs for
``RoutingRequest``): the values built on every request (the parsed request, the routing request,
candidates, costs, decisions and routes, reservations) declare ``init=False`` and an explicit
``__init__``, compiled; ``tests/unit/test_native_inits.py`` holds each to its fields."""

_state = "not installed"


def source_paths(modules: Sequence[str] = MODULES) -> list[Path]:
    """The ``.py`` file of each module (``gateway.a.b`` -> ``<package>/a/b.py``)."""
    return [PACKAGE_DIR.joinpath(*m.split(".")[1:]).with_suffix(".py") for m in modules]


def fingerprint(package_dir: Path = PACKAGE_DIR) -> str:
    """Count, total size and latest modification time (ns) of the package's ``.py`` files,
    ``_native`` and caches left out: any edit, addition or removal changes it."""
    count = size = latest = 0
    stack = [str(package_dir)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if e.name not in ("_native", "__pycache__"):
                        stack.append(e.path)
                elif e.name.endswith(".py"):
                    st = e.stat()
                    count += 1
                    size += st.st_size
                    latest = max(latest, st.st_mtime_ns)
    return f"{count} {size} {latest}"


def extension_files(build_dir: Path = BUILD_DIR) -> dict[str, Path]:
    """Module name -> its built extension, for ``MODULES`` and the shared library (empty when
    one is missing: a partial build is no build)."""
    files = {m: build_dir.joinpath(*m.split(".")).with_name(m.rsplit(".", 1)[-1]
                                                            + EXTENSION_SUFFIX)
             for m in MODULES}
    files[GROUP + "__mypyc"] = build_dir / (GROUP + "__mypyc" + EXTENSION_SUFFIX)
    return files if all(f.is_file() for f in files.values()) else {}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and only them) in ``BUILD_DIR``."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        f = self._files.get(fullname)
        if f is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(f))
        return importlib.util.spec_from_file_location(fullname, f, loader=loader)


def install(build_dir: Path = BUILD_DIR, package_dir: Path = PACKAGE_DIR) -> str:
    """Use the compiled modules if they are built and fresh (module docstring); returns
    ``status()``. Idempotent; must run before any of ``MODULES`` is imported."""
    global _state
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return _state
    if os.environ.get(ENV, "1") == "0":
        _state = f"source ({ENV}=0)"
        return _state
    try:
        stamp = (build_dir / STAMP.name).read_text().strip()
    except OSError:
        _state = "source (not built: scripts/build_native.py)"
        return _state
    if stamp != fingerprint(package_dir):
        _state = "source (the build is older than the source: scripts/build_native.py)"
        return _state
    files = extension_files(build_dir)
    if not files:
        _state = "source (the build is incomplete: scripts/build_native.py)"
        return _state
    sys.meta_path.insert(0, _Finder(files))
    _state = f"compiled ({len(MODULES)} modules, mypyc)"
    return _state


def status() -> str:
    """``compiled (...)`` or ``source (why)``: what ``install`` decided for this process."""
    return _state
