"""CPU accounting of the overhead benchmark: a process tree's CPU seconds from ``/proc/PID/stat``
(children that exited count through their parent's ``cutime``/``cstime``), the whole machine's
busy CPU from ``/proc/stat``, and this process's own or its children's from ``getrusage``."""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    cpu_ticks: int
    """utime + stime + cutime + cstime: the process, its threads, its reaped children."""
    kernel_ticks: int = 0
    """stime + cstime: the part of ``cpu_ticks`` spent in the kernel (system calls: on loopback,
    the receiver's TCP path and its wake-up too)."""


def parse_proc_stat(text: str) -> ProcStat:
    """One ``/proc/PID/stat`` line. The command name (field 2) may hold spaces and parentheses,
    so the fields are counted from its last ``)``."""
    pid = int(text[:text.index(" ")])
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17
    return ProcStat(pid, int(rest[1]), sum(int(x) for x in rest[11:15]),
                    int(rest[12]) + int(rest[14]))


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a pid -> ppid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def read_proc_stats(proc: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every process's stat now; processes that end while being read are left out."""
    stats: dict[int, ProcStat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = parse_proc_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
    return stats


def tree_cpu_s(stats: Mapping[int, ProcStat], root: int, *, kernel: bool = False) -> float:
    """CPU seconds of ``root``'s process tree so far (``kernel``: in the kernel only)."""
    tree = descendants({pid: s.ppid for pid, s in stats.items()}, root)
    return sum(stats[pid].kernel_ticks if kernel else stats[pid].cpu_ticks
               for pid in tree if pid in stats) / CLOCK_TICKS_PER_S


def children_cpu_s(before: Mapping[int, ProcStat], after: Mapping[int, ProcStat],
                   root: int) -> list[float]:
    """CPU seconds each child of ``root`` (with its own tree) spent between the two readings,
    busiest first: how a supervisor's processes shared the work. Children in only one reading
    (started or ended between them) are left out."""
    spent = [tree_cpu_s(after, pid) - tree_cpu_s(before, pid)
             for pid, s in after.items() if s.ppid == root and pid in before]
    return sorted(spent, reverse=True)


def parse_machine_busy_ticks(text: str) -> int:
    """Busy ticks of all cores from ``/proc/stat``: its ``cpu`` line less idle and iowait (guest
    time is already inside user)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("cpu "))
    ticks = [int(x) for x in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4]


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> float:
    return parse_machine_busy_ticks(stat.read_text()) / CLOCK_TICKS_PER_S


def rusage_cpu_s(who: int) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime
