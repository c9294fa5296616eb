"""gateway.upstream.headers: a pool's request headers, built once per pool."""

from __future__ import annotations

from pathlib import Path

from gateway.config import PoolSettings
from gateway.upstream.headers import JSON_HEADERS, credential, json_headers


def _pool(name: str, key_file: Path | None = None) -> PoolSettings:
    return PoolSettings.model_validate(
        {"name": name, "max_context_tokens": 4096, "workers": ["http://w:8000"],
         "upstream_api_key_file": None if key_file is None else str(key_file)})


def test_pool_with_a_key_sends_its_credential_with_json_and_alone_on_a_get(
    tmp_path: Path,
) -> None:
    key = tmp_path / "key"
    key.write_text(" s3cret\n")
    pool = _pool("keyed", key)
    assert dict(json_headers(pool)) == {"content-type": "application/json",
                                        "authorization": "Bearer s3cret"}
    assert dict(credential(pool)) == {"authorization": "Bearer s3cret"}


def test_pool_without_a_key_sends_only_the_content_type() -> None:
    pool = _pool("open")
    assert dict(json_headers(pool)) == dict(JSON_HEADERS)
    assert dict(credential(pool)) == {}


def test_headers_are_built_once_per_pool_and_never_shared_between_pools(
    tmp_path: Path,
) -> None:
    """The cache is keyed by the settings object: the same pool gets the same mapping back (no
    read of the pydantic private attribute per request), another pool, even with an equal
    name, gets its own credential."""
    a_key, b_key = tmp_path / "a", tmp_path / "b"
    a_key.write_text("key-a")
    b_key.write_text("key-b")
    a, b = _pool("same", a_key), _pool("same", b_key)
    assert json_headers(a) is json_headers(a)
    assert credential(a) is credential(a)
    assert json_headers(b)["authorization"] == "Bearer key-b"
    assert json_headers(a)["authorization"] == "Bearer key-a"
