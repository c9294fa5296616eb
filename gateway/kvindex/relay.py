"""KV events for every gateway process when the workers connect to the gateway (bind mode).

In connect mode (the worker's PUB binds, the gateway connects) every process simply subscribes
itself: PUB fans out to any number of subscribers. In bind mode (the gateway binds one port per
worker and the worker's PUB connects to it) only one process can bind that port, so the leader
binds it, as a single process would, and re-publishes every frame it receives, unchanged, on a
unix socket in the shared ``runtime_dir``; followers subscribe there with the same subscriber
(ordering, gap detection, replay against the worker's own replay socket, all as before).

Why not the parent process fanning out, or every process binding with SO_REUSEPORT: the supervisor
knows nothing of workers (discovery adds them at run time), and a worker's PUB connects to one
address, so the kernel would hand its one connection to one process only. The cost is one
IPC hop for the followers (tens of microseconds per batch) and, while the leader restarts, a
follower sees a disconnect and starts that worker fresh, exactly as on a lost connection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from gateway.kvindex.events import KvEventsConfig


@dataclass(frozen=True)
class EventRelay:
    """Where bind-mode events are re-published, and whether this process binds (the leader)."""

    directory: Path
    leader: bool

    def endpoint(self, worker_id: str) -> str:
        name = hashlib.blake2b(worker_id.encode(), digest_size=8).hexdigest()
        return f"ipc://{self.directory / f'kv-events-{name}.sock'}"

    def follower_config(self, worker_id: str, config: KvEventsConfig) -> KvEventsConfig:
        """A follower's subscription: the leader's re-publishing socket instead of the bound port;
        replay still asks the worker itself."""
        return KvEventsConfig(self.endpoint(worker_id), config.replay_endpoint, config.topic,
                              bind=False)
