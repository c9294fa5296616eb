"""The simulator's Responses store (``gateway.sim.responses.ResponseStore``): vLLM's rules with
its store on and off (``VLLM_ENABLE_RESPONSES_API_STORE``)."""

from __future__ import annotations

import pytest

from gateway.sim.responses import NO_STORE_BACKGROUND, ResponsesRefused, ResponseStore


def test_without_its_store_a_worker_refuses_background_and_stores_nothing() -> None:
    store = ResponseStore(enabled=False)
    with pytest.raises(ResponsesRefused) as caught:
        store.turn({"input": "x", "background": True})
    assert (caught.value.status, str(caught.value)) == (400, NO_STORE_BACKGROUND)
    assert caught.value.type_ == "invalid_request_error"
    turn = store.turn({"input": "x"})
    assert not turn.store  # ``store`` silently ignored, as vLLM does
    store.save(turn, {"id": turn.response_id, "status": "completed", "output": []})
    with pytest.raises(ResponsesRefused) as missing:
        store.get(turn.response_id)
    assert missing.value.status == 404


def test_background_needs_store_and_a_request_id_names_the_response() -> None:
    store = ResponseStore()
    for unstored in (False, None):
        with pytest.raises(ResponsesRefused, match="only be used when `store` is true"):
            store.turn({"input": "x", "background": True, "store": unstored})
    turn = store.turn({"input": "x", "background": True, "request_id": "resp_given"})
    assert turn.background and turn.store and turn.response_id == "resp_given"


def test_a_cancelled_response_is_not_replaced_by_its_final_object() -> None:
    store = ResponseStore()
    turn = store.turn({"input": "x"})
    store.save(turn, {"id": turn.response_id, "status": "queued", "output": []})
    assert store.cancel(turn.response_id)["status"] == "cancelled"
    store.save(turn, {"id": turn.response_id, "status": "completed", "output": []})
    assert store.get(turn.response_id)["status"] == "cancelled"
    with pytest.raises(ResponsesRefused, match=r"Cannot cancel a synchronous response\."):
        store.cancel(turn.response_id)
