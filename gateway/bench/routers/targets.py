"""The issue's targets, checked on a workload's rows: hit rate against the ceiling and the best
competitor, TTFT p99 against round robin and the best competitor. Each check is a ``Verdict``
(met, missed, or not applicable when a number or a competitor is missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KVGATE_CONTENDERS = ("kvgate_kv", "kvgate_approx", "kvgate_rr")
PEER_CONTENDERS = ("sglang_cache_aware", "vllm_router_cache_aware")
CONTENDERS = KVGATE_CONTENDERS + PEER_CONTENDERS
COMPETITORS = PEER_CONTENDERS
"""The other routers: 'best competitor' in the targets means the best of these."""


@dataclass(frozen=True)
class Verdict:
    target: str
    value: float | None
    limit: float | None
    met: bool | None
    detail: str

    def line(self) -> str:
        state = {True: "met", False: "MISSED", None: "n/a"}[self.met]
        return f"  [{state:>6}] {self.target}: {self.detail}"


def at_most(target: str, value: float | None, limit: float | None, detail: str) -> Verdict:
    met = None if value is None or limit is None else value <= limit
    return Verdict(target, value, limit, met, detail)


def at_least(target: str, value: float | None, limit: float | None, detail: str) -> Verdict:
    met = None if value is None or limit is None else value >= limit
    return Verdict(target, value, limit, met, detail)


def hit_rate_verdicts(rows: Mapping[str, Mapping[str, Any]], ceiling_rate: float | None,
                      subject: str = "kvgate_kv") -> list[Verdict]:
    """Hit rate >= 95 % of the ceiling, and >= the best competitor's + 10 points."""
    mine = rows.get(subject, {}).get("hit_rate")
    out = [at_least(
        "hit rate >= 95% of the ceiling", mine,
        None if ceiling_rate is None else 0.95 * ceiling_rate,
        f"{subject} {fmt_pct(mine)} vs ceiling {fmt_pct(ceiling_rate)} = "
        f"{fmt_ratio(mine, ceiling_rate, pct=True)} of it",
    )]
    rivals: dict[str, float] = {n: float(r["hit_rate"]) for n, r in rows.items()
                                if n in COMPETITORS and r.get("hit_rate") is not None}
    if rivals:
        best = max(rivals, key=lambda n: rivals[n])
        out.append(at_least(
            "hit rate >= best competitor + 10 points", mine, rivals[best] + 0.10,
            f"{subject} {fmt_pct(mine)} vs {best} {fmt_pct(rivals[best])}: "
            f"{fmt_points(mine, rivals[best])}",
        ))
    else:
        out.append(Verdict("hit rate >= best competitor + 10 points", mine, None, None,
                           "no competitor ran"))
    return out


def ttft_verdicts(rows: Mapping[str, Mapping[str, Any]], subject: str = "kvgate_kv",
                  key: str = "ttft_p99_ms", label: str = "TTFT p99") -> list[Verdict]:
    """TTFT p99 <= 0.5x round robin's and <= 0.8x the best competitor's."""
    mine = rows.get(subject, {}).get(key)
    rr = rows.get("kvgate_rr", {}).get(key)
    out = [at_most(f"{label} <= 0.5x round robin", mine, None if rr is None else 0.5 * rr,
                   f"{subject} {fmt_ms(mine)} vs kvgate_rr {fmt_ms(rr)}: "
                   f"{fmt_ratio(mine, rr)}")]
    rivals: dict[str, float] = {n: float(r[key]) for n, r in rows.items()
                                if n in COMPETITORS and r.get(key) is not None}
    if rivals:
        best = min(rivals, key=lambda n: rivals[n])
        out.append(at_most(f"{label} <= 0.8x best competitor", mine, 0.8 * rivals[best],
                           f"{subject} {fmt_ms(mine)} vs {best} {fmt_ms(rivals[best])}: "
                           f"{fmt_ratio(mine, rivals[best])}"))
    else:
        out.append(Verdict(f"{label} <= 0.8x best competitor", mine, None, None,
                           "no competitor ran"))
    return out


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def fmt_ratio(a: float | None, b: float | None, pct: bool = False) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.1%}" if pct else f"{a / b:.2f}x"


def fmt_points(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{(a - b) * 100:+.1f} points"
