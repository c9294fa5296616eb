"""Health checks and worker scrapes done once for every gateway process: the leader's board.

With ``kvgate serve --processes N`` only the leader (process 0) probes ``/health``, reads
``/v1/models`` and scrapes ``/metrics``; N processes doing it would multiply that traffic by N.
After each round the leader replaces one small JSON file in the shared ``runtime_dir``
(write + ``os.replace``, so a reader sees the old board or the new one, never half of one); a
follower polls the file's identity (one ``stat``) every few hundred ms and, when it changed,
reads what each worker's checks and last scrape said.

A follower does not copy the leader's up/down verdict: it feeds the leader's check results into
its own circuit breaker as if it had run the checks itself (``WorkerReport.results_since``). Its
own request-path failures (connection refused, broken streams) still count there, as in a single
process, and are not shared: the shared checks already make every process see a dead worker, and
one process's unlucky connection should open only its own circuit.

A file rather than another mmapped table: the board changes every few seconds, holds strings
(the models a worker serves) and a dozen numbers per worker, and an atomic rename needs no
seqlock or memory-ordering argument.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.workers.worker import VllmStats


@dataclass(frozen=True)
class WorkerReport:
    """What the leader's checks and scrapes said about one worker so far."""

    checks: int = 0  # health checks done
    ok: bool = False  # the last one passed
    streak: int = 0  # checks in a row with that result, up to the last
    models: frozenset[str] | None = None
    models_read: bool = False
    scrapes: int = 0  # successful scrapes done
    stats: VllmStats = field(default_factory=VllmStats)
    adapters: Mapping[str, str] = field(default_factory=dict)  # LoRA adapter -> its base model

    def checked(self, ok: bool) -> WorkerReport:
        streak = self.streak + 1 if ok == self.ok and self.checks else 1
        return WorkerReport(self.checks + 1, ok, streak, self.models, self.models_read,
                            self.scrapes, self.stats, self.adapters)

    def results_since(self, seen_checks: int, cap: int) -> list[bool]:
        """The check results after the first ``seen_checks``, oldest first, at most ``cap`` of
        each kind: the last ``streak`` are known; earlier ones are taken as the opposite result
        (the one right before the streak was; older ones a follower polling faster than the
        checks run never misses)."""
        new = max(self.checks - seen_checks, 0)
        same = min(new, self.streak)
        return [not self.ok] * min(new - same, cap) + [self.ok] * min(same, cap)

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": self.checks, "ok": self.ok, "streak": self.streak,
            "models": sorted(self.models) if self.models is not None else None,
            "models_read": self.models_read, "scrapes": self.scrapes, "stats": asdict(self.stats),
            "adapters": dict(self.adapters),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkerReport:
        models = d["models"]
        return cls(int(d["checks"]), bool(d["ok"]), int(d["streak"]),
                   frozenset(models) if models is not None else None, bool(d["models_read"]),
                   int(d["scrapes"]), VllmStats(**d["stats"]),
                   {str(k): str(v) for k, v in (d.get("adapters") or {}).items()})


@dataclass(frozen=True)
class Board:
    generation: str  # one per leader process: a restarted leader counts checks from 0 again
    workers: dict[str, WorkerReport]


class HealthBoard:
    """The file. ``leader``: this process publishes; otherwise it reads. No I/O in here until
    ``publish``/``read_if_changed``."""

    def __init__(self, path: Path, leader: bool) -> None:
        self.path = path
        self.leader = leader
        self.generation = uuid.uuid4().hex
        self._seen: tuple[int, int, int] | None = None

    def publish(self, workers: dict[str, WorkerReport]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{self.generation}")
        body = {"generation": self.generation,
                "workers": {url: r.to_json() for url, r in workers.items()}}
        tmp.write_text(json.dumps(body, separators=(",", ":")))
        os.replace(tmp, self.path)

    def read_if_changed(self) -> Board | None:
        """The board, when the leader replaced it since the last call; None otherwise."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None  # no leader round yet
        # A new file each time: a reused inode with the same coarse mtime and size could hide
        # one version, and the leader's next round (one interval later) shows it.
        ident = (st.st_ino, st.st_mtime_ns, st.st_size)
        if ident == self._seen:
            return None
        try:
            body = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None  # replaced again while we opened it: the next poll reads the new one
        self._seen = ident
        return Board(str(body["generation"]),
                     {url: WorkerReport.from_json(r) for url, r in body["workers"].items()})
