"""gateway.config: the YAML file, the KVGATE_* environment on top, and ConfigError for bad input."""

from __future__ import annotations

import copy
import os
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from pydantic import BaseModel

from gateway.config import (
    ConfigError,
    KvAwareSettings,
    PolicyName,
    Settings,
    build_settings,
    load_settings,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

VALID_YAML = textwrap.dedent(
    """\
    listen:
      host: 0.0.0.0
      port: 8080
    models:
      - name: llama-3-8b
        tokenizer: simple
    pools:
      - name: long
        max_context_tokens: 131072
        policy: round_robin
        workers:
          - url: http://10.0.0.9:8000/
            kv_events_endpoint: tcp://10.0.0.9:5557
      - name: short
        max_context_tokens: 8192
        workers:
          - http://10.0.0.5:8000
          - http://10.0.0.6:8000/
    routing:
      spill: false
      default_max_tokens: 256
    health:
      unhealthy_threshold: 3
    """
)


@pytest.fixture(autouse=True)
def _no_ambient_kvgate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KVGATE_* variable in the developer's shell must not leak into these tests."""
    for key in list(os.environ):
        if key.upper().startswith("KVGATE_"):
            monkeypatch.delenv(key)


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        path = tmp_path / "kvgate.yaml"
        path.write_text(text)
        return path

    return write


def minimal() -> dict[str, Any]:
    return {
        "models": [{"name": "m"}],
        "pools": [
            {"name": "short", "max_context_tokens": 4096, "workers": ["http://s1:8000"]},
            {"name": "long", "max_context_tokens": 32768, "workers": ["http://l1:8000"]},
        ],
    }


# --- loading -------------------------------------------------------------------------------------


def test_valid_yaml_file_loads_every_section(write_config: Callable[[str], Path]) -> None:
    s = load_settings(write_config(VALID_YAML))

    assert (s.listen.host, s.listen.port) == ("0.0.0.0", 8080)
    assert [m.name for m in s.models] == ["llama-3-8b"]
    assert [p.name for p in s.pools] == ["long", "short"]
    long_pool, short_pool = s.pools
    assert long_pool.policy == "round_robin"
    assert long_pool.workers[0].kv_events_endpoint == "tcp://10.0.0.9:5557"
    assert short_pool.policy == "least_loaded"  # the default
    assert s.routing.spill is False
    assert s.routing.default_max_tokens == 256
    assert s.health.unhealthy_threshold == 3
    assert s.health.healthy_threshold == 1  # untouched default


def test_worker_url_trailing_slash_is_removed(write_config: Callable[[str], Path]) -> None:
    s = load_settings(write_config(VALID_YAML))

    assert s.pools[0].workers[0].url == "http://10.0.0.9:8000"
    assert s.pools[1].workers[1].url == "http://10.0.0.6:8000"


def test_bare_url_strings_are_accepted_as_workers() -> None:
    data = minimal()
    data["pools"][0]["workers"] = ["http://a:8000", {"url": "https://b:8443"}]

    s = build_settings(data)

    workers = s.pools[0].workers
    assert [w.url for w in workers] == ["http://a:8000", "https://b:8443"]
    assert all(w.kv_events_endpoint is None for w in workers)


def test_kv_aware_weights_are_read_per_pool_and_default_elsewhere() -> None:
    data = minimal()
    data["pools"][0] |= {"policy": "kv_aware",
                         "kv_aware": {"active_request_tokens": 16, "kv_hard_limit": 0.9}}

    s = build_settings(data)

    short, long = s.pools
    assert (short.policy, short.kv_aware.active_request_tokens) == (PolicyName.KV_AWARE, 16)
    assert (short.kv_aware.kv_hard_limit, short.kv_aware.kv_soft_limit) == (0.9, 0.80)
    assert long.kv_aware == KvAwareSettings()


def test_settings_are_frozen() -> None:
    s = build_settings(minimal())

    with pytest.raises(pydantic.ValidationError):
        s.routing = s.routing.model_copy(update={"spill": False})


def test_no_file_and_environment_only_builds_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_MODELS", '[{"name": "env-model"}]')
    monkeypatch.setenv(
        "KVGATE_POOLS", '[{"name": "p", "max_context_tokens": 2048, "workers": ["http://w:1"]}]'
    )

    s = load_settings(None)

    assert [m.name for m in s.models] == ["env-model"]
    assert s.pools[0].workers[0].url == "http://w:1"


# --- environment over YAML -----------------------------------------------------------------------


def test_env_nested_field_overrides_yaml_and_keeps_yaml_siblings(
    write_config: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_LISTEN__PORT", "9001")

    s = load_settings(write_config(VALID_YAML))

    assert s.listen.port == 9001
    assert s.listen.host == "0.0.0.0"  # from YAML, not the default 127.0.0.1


def test_env_bool_overrides_yaml(
    write_config: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ROUTING__SPILL", "true")

    s = load_settings(write_config(VALID_YAML))

    assert s.routing.spill is True
    assert s.routing.default_max_tokens == 256


def test_env_list_as_json_replaces_yaml_list(
    write_config: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_MODELS", '[{"name": "a"}, {"name": "b"}]')

    s = load_settings(write_config(VALID_YAML))

    assert [m.name for m in s.models] == ["a", "b"]


def test_invalid_env_value_fails_with_config_error_naming_field(
    write_config: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_LISTEN__PORT", "70000")

    with pytest.raises(ConfigError, match=r"listen\.port"):
        load_settings(write_config(VALID_YAML))


# --- bad configs ---------------------------------------------------------------------------------


def _without_models(d: dict[str, Any]) -> None:
    del d["models"]


def _empty_models(d: dict[str, Any]) -> None:
    d["models"] = []


def _without_pools(d: dict[str, Any]) -> None:
    del d["pools"]


def _ftp_worker(d: dict[str, Any]) -> None:
    d["pools"][0]["workers"] = ["ftp://s1:8000"]


def _schemeless_worker_in_second_pool(d: dict[str, Any]) -> None:
    d["pools"][1]["workers"] = [{"url": "s1:8000"}]


def _duplicate_pool_name(d: dict[str, Any]) -> None:
    d["pools"][1]["name"] = "short"


def _duplicate_worker_url_across_pools(d: dict[str, Any]) -> None:
    # Same worker once with, once without the trailing slash: still the same worker.
    d["pools"][1]["workers"] = ["http://s1:8000/"]


def _duplicate_worker_url_in_one_pool(d: dict[str, Any]) -> None:
    d["pools"][0]["workers"] = ["http://s1:8000", "http://s1:8000"]


def _duplicate_model_name(d: dict[str, Any]) -> None:
    d["models"] = [{"name": "m"}, {"name": "m"}]


def _unknown_policy(d: dict[str, Any]) -> None:
    d["pools"][1]["policy"] = "random"


def _kv_aware_soft_limit_above_hard_limit(d: dict[str, Any]) -> None:
    d["pools"][0]["kv_aware"] = {"kv_soft_limit": 0.97}


def _negative_kv_aware_weight(d: dict[str, Any]) -> None:
    d["pools"][1]["kv_aware"] = {"active_request_tokens": -1}


def _kv_aware_limit_above_one(d: dict[str, Any]) -> None:
    d["pools"][0]["kv_aware"] = {"kv_hard_limit": 1.5}


def _unknown_kv_aware_weight(d: dict[str, Any]) -> None:
    d["pools"][0]["kv_aware"] = {"prefix_weight": 3}


def _negative_body_limit(d: dict[str, Any]) -> None:
    d["limits"] = {"max_body_bytes": -1}


def _zero_context_limit(d: dict[str, Any]) -> None:
    d["pools"][0]["max_context_tokens"] = 0


def _negative_saturation(d: dict[str, Any]) -> None:
    d["pools"][0]["saturation_inflight"] = -5


def _zero_healthy_threshold(d: dict[str, Any]) -> None:
    d["health"] = {"healthy_threshold": 0}


def _port_out_of_range(d: dict[str, Any]) -> None:
    d["listen"] = {"port": 65536}


def _unknown_top_level_key(d: dict[str, Any]) -> None:
    d["poolz"] = []


def _unknown_nested_key(d: dict[str, Any]) -> None:
    d["pools"][0]["max_context"] = 10


def _empty_model_name(d: dict[str, Any]) -> None:
    d["models"] = [{"name": ""}]


@pytest.mark.parametrize(
    ("mutate", "field_named"),
    [
        pytest.param(_without_models, r"models: Field required", id="without_models"),
        pytest.param(_empty_models, r"models:", id="empty_models"),
        pytest.param(_without_pools, r"pools: Field required", id="without_pools"),
        pytest.param(_ftp_worker, r"pools\.0\.workers\.0\.url: .*http://", id="ftp_worker"),
        pytest.param(_schemeless_worker_in_second_pool, r"pools\.1\.workers\.0\.url", id="schemeless_worker_in_second_pool"),
        pytest.param(_duplicate_pool_name, r"pools: duplicate pool name", id="duplicate_pool_name"),
        pytest.param(_duplicate_worker_url_across_pools, r"pools: worker http://s1:8000 appears twice", id="duplicate_worker_url_across_pools"),
        pytest.param(_duplicate_worker_url_in_one_pool, r"pools: worker http://s1:8000 appears twice", id="duplicate_worker_url_in_one_pool"),
        pytest.param(_duplicate_model_name, r"models: duplicate model name", id="duplicate_model_name"),
        pytest.param(_unknown_policy, r"pools\.1\.policy: .*'least_loaded'", id="unknown_policy"),
        pytest.param(_kv_aware_soft_limit_above_hard_limit, r"pools\.0\.kv_aware: .*kv_soft_limit \(0\.97\) must be below kv_hard_limit", id="kv_aware_soft_limit_above_hard_limit"),
        pytest.param(_negative_kv_aware_weight, r"pools\.1\.kv_aware\.active_request_tokens", id="negative_kv_aware_weight"),
        pytest.param(_kv_aware_limit_above_one, r"pools\.0\.kv_aware\.kv_hard_limit", id="kv_aware_limit_above_one"),
        pytest.param(_unknown_kv_aware_weight, r"pools\.0\.kv_aware\.prefix_weight: Extra inputs", id="unknown_kv_aware_weight"),
        pytest.param(_negative_body_limit, r"limits\.max_body_bytes", id="negative_body_limit"),
        pytest.param(_zero_context_limit, r"pools\.0\.max_context_tokens", id="zero_context_limit"),
        pytest.param(_negative_saturation, r"pools\.0\.saturation_inflight", id="negative_saturation"),
        pytest.param(_zero_healthy_threshold, r"health\.healthy_threshold", id="zero_healthy_threshold"),
        pytest.param(_port_out_of_range, r"listen\.port", id="port_out_of_range"),
        pytest.param(_unknown_top_level_key, r"poolz: Extra inputs are not permitted", id="unknown_top_level_key"),
        pytest.param(_unknown_nested_key, r"pools\.0\.max_context", id="unknown_nested_key"),
        pytest.param(_empty_model_name, r"models\.0\.name", id="empty_model_name"),
    ],
)
def test_bad_config_fails_with_config_error_naming_the_field(
    mutate: Callable[[dict[str, Any]], None], field_named: str
) -> None:
    data = copy.deepcopy(minimal())
    mutate(data)

    with pytest.raises(ConfigError, match=field_named):
        build_settings(data)


def test_config_error_is_not_a_raw_pydantic_error() -> None:
    """Operators see one short message per field, not pydantic's traceback-like dump."""
    data = minimal()
    del data["models"]

    with pytest.raises(ConfigError) as info:
        build_settings(data)

    assert not isinstance(info.value, pydantic.ValidationError)
    assert str(info.value).startswith("invalid configuration:")


@pytest.mark.parametrize("url", ["http://", "https:///", "http:///v1"])
def test_worker_url_without_host_is_refused(url: str) -> None:
    """`http://` passed the prefix check and became the worker URL `http:` (no host at all)."""
    data = minimal()
    data["pools"][0]["workers"] = [url]

    with pytest.raises(ConfigError, match=r"pools\.0\.workers\.0\.url"):
        build_settings(data)


@pytest.mark.parametrize(
    "text",
    ["- models\n- pools\n", "just a string\n", "42\n"],
    ids=["list", "string", "number"],
)
def test_yaml_that_is_not_a_mapping_fails_with_config_error(
    write_config: Callable[[str], Path], text: str
) -> None:
    path = write_config(text)

    with pytest.raises(ConfigError, match="top level must be a mapping") as info:
        load_settings(path)
    assert str(path) in str(info.value)


def test_malformed_yaml_fails_with_config_error_naming_the_file(
    write_config: Callable[[str], Path],
) -> None:
    path = write_config("models: [\n  - name: m\npools: {")

    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_settings(path)
    assert str(path) in str(info.value)


def test_empty_yaml_file_fails_naming_the_missing_fields(
    write_config: Callable[[str], Path],
) -> None:
    with pytest.raises(ConfigError, match="models: Field required"):
        load_settings(write_config(""))


def test_missing_file_fails_with_config_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    with pytest.raises(ConfigError, match="cannot read config file") as info:
        load_settings(path)
    assert str(path) in str(info.value)


def test_directory_instead_of_file_fails_with_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path)


def test_yaml_with_bad_field_fails_naming_the_field(write_config: Callable[[str], Path]) -> None:
    path = write_config(VALID_YAML.replace("policy: round_robin", "policy: fastest"))

    with pytest.raises(ConfigError, match=r"pools\.0\.policy"):
        load_settings(path)


# --- the shipped example -------------------------------------------------------------------------


def test_deploy_example_config_loads() -> None:
    path = REPO_ROOT / "deploy" / "config.example.yaml"
    assert path.is_file(), f"{path} is missing: the example config must ship with the repo"

    s = load_settings(path)

    assert isinstance(s, Settings)
    assert s.models
    assert s.pools
    assert all(w.url.startswith(("http://", "https://")) for p in s.pools for w in p.workers)


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        ann = field.annotation
        if typing.get_origin(ann) is list:
            (ann,) = typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths += _field_paths(ann, path + ".")
    return paths


def test_example_config_shows_every_settings_field() -> None:
    """deploy/config.example.yaml is the configuration reference: every field must appear in it
    (list items are checked through their first example entry; an empty list's items are shown in
    its comment). The walk used to skip list items, so the pools' fields went unchecked."""
    data = yaml.safe_load((REPO_ROOT / "deploy" / "config.example.yaml").read_text())

    def present(path: str) -> bool:
        node: object = data
        for part in path.split("."):
            if node == []:
                return True
            if isinstance(node, list):
                node = node[0]
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    missing = [p for p in _field_paths(Settings) if not present(p)]
    assert missing == []
