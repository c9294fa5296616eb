"""Which gateway process this is, when `kvgate serve --processes N` runs N of them on one port.

The supervisor (``gateway.supervisor``) starts each child with its role in the environment; a child
reads it back with ``ProcessRole.from_env``. Everything that must stay gateway-wide (budgets, worker
load, health checks, KV events, ``/metrics``) looks at the role: with ``count == 1`` there is nothing
to share and the gateway behaves as a single process; otherwise the leader (index 0) does the work
done once for all, and the shared files live in ``runtime_dir``. A restarted child gets the index of
the one it replaces, so the leader is restarted as the leader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INDEX_ENV = "KVGATE_PROCESS_INDEX"
COUNT_ENV = "KVGATE_PROCESS_COUNT"
RUNTIME_DIR_ENV = "KVGATE_RUNTIME_DIR"


@dataclass(frozen=True)
class ProcessRole:
    index: int = 0
    """0 .. count-1; the leader is index 0."""
    count: int = 1
    runtime_dir: Path | None = None
    """One directory shared by all processes of this gateway (shared memory files, unix sockets,
    the prometheus multiprocess directory); None when count == 1."""

    @property
    def leader(self) -> bool:
        return self.index == 0

    def sibling_socket(self, index: int) -> Path:
        """The unix socket on which process ``index`` serves the gateway's app to its siblings
        (``gateway.api.siblings``: what one process keeps alone, asked of the others)."""
        if self.runtime_dir is None:
            raise ValueError("a single gateway process has no siblings")
        return self.runtime_dir / f"process-{index}.sock"

    @property
    def siblings(self) -> list[int]:
        """The other processes' indices (none for a single process)."""
        return [i for i in range(self.count) if i != self.index]

    def to_env(self) -> dict[str, str]:
        env = {INDEX_ENV: str(self.index), COUNT_ENV: str(self.count)}
        if self.runtime_dir is not None:
            env[RUNTIME_DIR_ENV] = str(self.runtime_dir)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProcessRole:
        """The role the supervisor gave this process; ``ProcessRole()`` when none was given."""
        if INDEX_ENV not in env:
            return cls()
        runtime_dir = env.get(RUNTIME_DIR_ENV)
        return cls(index=int(env[INDEX_ENV]), count=int(env.get(COUNT_ENV, "1")),
                   runtime_dir=Path(runtime_dir) if runtime_dir else None)


SINGLE_PROCESS = ProcessRole()
"""The role of a gateway that runs as one process (``kvgate serve --processes 1``, tests, demo)."""
