"""What one gateway process keeps alone, asked of its siblings (``kvgate serve --processes N``).

Most of the gateway's state is fleet-wide across its processes (budgets, load, health, KV
events, ``/metrics``); a few admin answers are not, because they are records of the requests one
process served: ``/admin/routing/explain`` (the ring of recent routed requests) and
``/admin/routing/accounting`` (each process's totals). Each process of a gateway of N also serves
its app on a unix socket in the runtime directory (``ProcessRole.sibling_socket``, opened by
``gateway.server.serve``; the directory is the gateway user's alone, mode 0700); a process that
cannot answer alone asks the others there, with the caller's own credentials, and a
``x-kvgate-sibling`` header that makes the asked process answer from its own state only (so a
question never travels further than one hop; a client that sends the header itself only gets
the process it reached).

A sibling that does not answer within ``SIBLING_TIMEOUT_S`` (restarting, stalled) is left out,
and the answer says how many processes were asked and how many answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.processes import ProcessRole

SIBLING_HEADER = "x-kvgate-sibling"
SIBLING_TIMEOUT_S = 2.0
FORWARDED_HEADERS = ("authorization",)  # the admin token (`require_admin`)


@dataclass(frozen=True)
class SiblingAnswers:
    """The siblings' answers to one question: (status, JSON body) for each that answered."""

    asked: int
    answers: list[tuple[int, Any]]


def asked_by_sibling(headers: Mapping[str, str]) -> bool:
    return headers.get(SIBLING_HEADER) == "1"


async def ask_siblings(role: ProcessRole, path: str, params: Mapping[str, str],
                       headers: Mapping[str, str]) -> SiblingAnswers:
    """GET ``path`` with ``params`` of every other process of this gateway, concurrently."""
    if role.count == 1:
        return SiblingAnswers(0, [])
    sent = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
    sent[SIBLING_HEADER] = "1"

    async def ask(index: int) -> tuple[int, Any] | None:
        transport = httpx.AsyncHTTPTransport(uds=str(role.sibling_socket(index)))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate",
                                     timeout=SIBLING_TIMEOUT_S) as client:
            try:
                r = await client.get(path, params=dict(params), headers=sent)
            except httpx.HTTPError:
                return None
        with contextlib.suppress(ValueError):
            return r.status_code, json.loads(r.content)
        return None

    found = await asyncio.gather(*(ask(i) for i in role.siblings))
    return SiblingAnswers(len(role.siblings), [a for a in found if a is not None])
