"""``kvgate serve --processes 2``: the admin answers one process keeps alone (the explain ring,
the accounting totals) are answered for the whole gateway, whichever process a question reaches
(``gateway.api.siblings``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.procs.kvgate import SIM_MODEL, GatewayProcess, SimProcess
from gateway.procs.process import ProcessSet
from tests.harness import explained

pytestmark = pytest.mark.timeout(180)

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SENT: list[str] = []  # every request id this module's chats got, from either process


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("processes-admin")
    with ProcessSet(tmp / "logs") as procs:
        sim = procs.start("sim", SimProcess(workers=2, time_scale=0.05), timeout_s=60)
        config: dict[str, Any] = {
            "listen": {"processes": 2},
            "models": [{"name": SIM_MODEL, "tokenizer": "simple"}],
            "pools": [{"name": "p", "max_context_tokens": 8192, "workers": sim.urls,
                       "policy": "kv_aware"}],
            "admin": {"token": ADMIN_TOKEN},
        }
        gw = procs.start("gateway", GatewayProcess(config, Path(tmp / "kvgate.yaml")),
                         timeout_s=90)
        yield gw.url


def served_by_both(gateway: str) -> list[str]:
    """Request ids of chats sent on fresh connections until both processes served some (the
    id starts with a prefix drawn by each process)."""
    ids: list[str] = []
    for i in range(400):
        r = httpx.post(gateway + "/v1/chat/completions", timeout=60, json={
            "model": SIM_MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": f"question {i} about the cache"}]})
        assert r.status_code == 200, r.text
        ids.append(r.headers["x-request-id"])
        SENT.append(ids[-1])
        if len({rid.rsplit("-", 1)[0] for rid in ids}) == 2 and len(ids) >= 8:
            return ids
    pytest.fail(f"400 fresh connections all reached one process: {ids[:3]}")


def test_every_request_is_explained_whichever_process_is_asked(gateway: str) -> None:
    ids = served_by_both(gateway)
    for rid in ids:
        # Each ask is a fresh connection too: it reaches either process.
        for _ in range(3):
            r = httpx.get(gateway + "/admin/routing/explain", params={"request_id": rid},
                          headers=ADMIN, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["request_id"] == rid

    unknown = httpx.get(gateway + "/admin/routing/explain", params={"request_id": "kvg-nope-1"},
                        headers=ADMIN, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "request_not_found"
    assert "each of this gateway's 2 processes" in unknown.json()["error"]["message"]
    # Without the admin token, the siblings are not asked on the caller's behalf.
    assert httpx.get(gateway + "/admin/routing/explain", params={"request_id": ids[0]},
                     timeout=30).status_code == 401


def test_accounting_adds_up_every_process(gateway: str) -> None:
    served_by_both(gateway)
    # Every chat this module sent, by either process, explained once ended (then counted).
    prompt_tokens = sum(explained(gateway, rid, ADMIN_TOKEN)["prompt_tokens"] for rid in SENT)
    for _ in range(3):  # fresh connections: either process answers, with the same totals
        totals = httpx.get(gateway + "/admin/routing/accounting", headers=ADMIN,
                           timeout=30).json()
        assert (totals["processes"], totals["processes_answered"]) == (2, 2)
        (pool,) = totals["data"]
        assert pool["prompt_tokens"] == prompt_tokens
        assert totals["requests_kept"] == len(SENT)


def test_the_sibling_header_limits_an_answer_to_the_process_reached(gateway: str) -> None:
    ids = served_by_both(gateway)
    local = [httpx.get(gateway + "/admin/routing/explain", params={"request_id": rid},
                       headers={**ADMIN, "x-kvgate-sibling": "1"}, timeout=30).status_code
             for rid in ids for _ in range(4)]
    assert set(local) <= {200, 404}
    assert 404 in local  # some asks reached the process that did not serve that request
