"""Prove vLLM's prefill/decode (P/D) two-step protocol end to end on two real CPU vLLM servers.

Usage: ``.venv/bin/python scripts/pd_vllm_probe.py [--save-fixtures DIR] [--log-dir DIR]``
(exit 0: every check passed; 1: a check failed; 2: the servers could not be started, e.g. NIXL is
not installed in vLLM's venv: ``.venv-vllm/bin/pip install nixl``).

What it does:

1. starts two servers on the tiny model with ``gateway.procs.vllm.start_vllm_servers`` and
   ``VllmOptions(kv_roles=("kv_producer", "kv_consumer"), prompt_tokens_details=True)``, side by
   side: each with vLLM's NIXL connector on host memory (``--kv-transfer-config
   {"kv_connector": "NixlConnector", "kv_role": ..., "kv_buffer_device": "cpu"}``) and its own
   NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``: where the decode side fetches
   the prefill side's agent metadata before it reads blocks over UCX);
2. for ``/v1/chat/completions`` (decode streamed, with ``stream_options.include_usage``) and for
   ``/v1/completions`` (not streamed): the **prefill step** to the producer (the client's body with
   ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``stream: false``, ``max_tokens: 1``,
   ``max_completion_tokens: 1`` when present, no ``stream_options``), then the **decode step** to
   the consumer (the client's body plus the ``kv_transfer_params`` the prefill answered);
3. checks that the prefill answer carries ``kv_transfer_params`` with ``do_remote_prefill: true``
   and the producer's NIXL side channel; that the consumer took the prompt from the transfer, not by
   computing it (its ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grows by
   the prompt's tokens, ``{source="local_compute"}`` does not grow, no failed NIXL transfer); and
   that the P/D text equals the producer's own greedy answer to the plain request;
4. sends the completions prompt through P/D again: the producer's prefix cache now holds it, and
   the consumer's ``usage.prompt_tokens_details.cached_tokens`` reports the producer's hit (vLLM
   copies it through ``kv_transfer_params.remote_prefill_cached_tokens``).

Cost: two servers at ~1.3 GB RSS each; start-up ~100 s on 2 cores (both start in parallel), the
exchanges a few seconds. Trade-off: a probe, not a test; it asserts what real vLLM does so that the
gateway's fakes can copy it (``--save-fixtures`` writes the exchanges as JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.procs.net import LOOPBACK
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.vllm import (
    VllmOptions,
    VllmServer,
    build_tiny_model,
    kv_transfer_config,
    start_vllm_servers,
)

MODEL = "tiny"
REQUEST_TIMEOUT_S = 120.0
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
"""What the router sends to the prefill worker (as vLLM's disaggregated proxy examples do)."""
PROMPT_TEXT = ("the quick brown fox jumps over the lazy dog and then runs far away into the deep "
               "green forest where the old trees stand ") * 7
"""About 300 tokens of the tiny model: several 32-token blocks and a partial one."""


@dataclass
class Report:
    """What the run found: passed checks, failed checks and the exchanges (for fixtures)."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    exchanges: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> bool:
        (self.passed if ok else self.failed).append(what)
        print(("  ok   " if ok else "  FAIL ") + what, flush=True)
        return ok


KV_ROLES = ("kv_producer", "kv_consumer")
"""Server 0 prefills, server 1 decodes."""
SERVER_NAME = "vllm-pd"
"""The servers' names in the process set (and their logs'): vllm-pd-0, vllm-pd-1."""


def start_pair(procs: ProcessSet, model_dir: Path) -> tuple[VllmServer, VllmServer]:
    """A prefill (producer) and a decode (consumer) server, started in parallel, ready."""
    options = VllmOptions(served_model_name=MODEL, prompt_tokens_details=True, kv_roles=KV_ROLES)
    prefill, decode = start_vllm_servers(procs, 2, options, model_dir, name=SERVER_NAME)
    return prefill, decode


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill step's body: one token, not streamed, with the "decode remotely" marker."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def metric(client: httpx.Client, server: VllmServer, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``server`` whose labels include ``labels``."""
    total = 0.0
    for line in client.get(server.url + "/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


def decode_counters(client: httpx.Client, decode: VllmServer) -> dict[str, float]:
    by_source = "vllm:prompt_tokens_by_source_total"
    return {
        "external_kv_transfer": metric(client, decode, by_source, source="external_kv_transfer"),
        "local_compute": metric(client, decode, by_source, source="local_compute"),
        "local_cache_hit": metric(client, decode, by_source, source="local_cache_hit"),
        "nixl_failed": metric(client, decode, "vllm:nixl_num_failed_transfers_total"),
        "nixl_bytes": metric(client, decode, "vllm:nixl_bytes_transferred_sum"),
    }


def sse_text_and_usage(lines: list[str]) -> tuple[str, dict[str, Any] | None]:
    text, usage = "", None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        for choice in chunk.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        usage = chunk.get("usage") or usage
    return text, usage


def answer_text(response: Mapping[str, Any]) -> str:
    choice = response["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def check_prefill_answer(report: Report, name: str, answer: Mapping[str, Any],
                         prefill: VllmServer) -> dict[str, Any] | None:
    kvp = answer.get("kv_transfer_params")
    if not report.check(isinstance(kvp, dict), f"{name}: prefill answer has kv_transfer_params"):
        return None
    assert isinstance(kvp, dict)
    blocks = kvp.get("remote_block_ids")
    report.check(kvp.get("do_remote_prefill") is True and kvp.get("do_remote_decode") is False,
                 f"{name}: do_remote_prefill true, do_remote_decode false")
    report.check(isinstance(blocks, list) and bool(blocks)
                 and all(isinstance(g, list) and all(isinstance(b, int) for b in g)
                         for g in blocks),
                 f"{name}: remote_block_ids is a list of KV-cache groups of block ids: {blocks}")
    host, port = kvp.get("remote_host"), kvp.get("remote_port")
    report.check(host == LOOPBACK and port == prefill.nixl_side_channel_port,
                 f"{name}: remote_host/remote_port ({host}:{port}) are the producer's NIXL side"
                 " channel")
    report.check(isinstance(kvp.get("remote_engine_id"), str)
                 and isinstance(kvp.get("remote_request_id"), str),
                 f"{name}: remote_engine_id and remote_request_id are strings")
    return kvp


def run_case(client: httpx.Client, report: Report, name: str, path: str, body: dict[str, Any],
             prefill: VllmServer, decode: VllmServer) -> None:
    print(f"{name}: POST {path}", flush=True)
    before = decode_counters(client, decode)
    pre_req = prefill_body(body)
    started = time.perf_counter()
    pre = client.post(prefill.url + path, json=pre_req)
    prefill_s = time.perf_counter() - started
    if not report.check(pre.status_code == 200, f"{name}: prefill step 200 "
                        f"({pre.status_code}, {prefill_s:.2f} s)"):
        print(pre.text[:2000])
        return
    kvp = check_prefill_answer(report, name, pre.json(), prefill)
    if kvp is None:
        return
    dec_req = decode_body(body, kvp)
    started = time.perf_counter()
    exchange: dict[str, Any] = {"prefill_request": pre_req, "prefill_response": pre.json(),
                                "decode_request": dec_req}
    if body.get("stream"):
        with client.stream("POST", decode.url + path, json=dec_req) as stream:
            status = stream.status_code
            lines = [line for line in stream.iter_lines() if line]
        text, usage = sse_text_and_usage(lines)
        exchange["decode_sse_lines"] = lines
    else:
        dec = client.post(decode.url + path, json=dec_req)
        status = dec.status_code
        text = answer_text(dec.json()) if status == 200 else ""
        usage = dec.json().get("usage") if status == 200 else None
        exchange["decode_response"] = dec.json()
    decode_s = time.perf_counter() - started
    report.exchanges[name] = exchange
    if not report.check(status == 200, f"{name}: decode step {status} ({decode_s:.2f} s)"):
        print(json.dumps(exchange)[-2000:])
        return
    after = decode_counters(client, decode)
    delta = {k: after[k] - before[k] for k in after}
    prompt_tokens = pre.json()["usage"]["prompt_tokens"]
    print(f"  decode-side counters: {delta}; usage {usage}", flush=True)
    report.check(delta["external_kv_transfer"] == prompt_tokens and delta["local_compute"] == 0,
                 f"{name}: the consumer took all {prompt_tokens} prompt tokens from the transfer "
                 f"(external {delta['external_kv_transfer']:.0f}, "
                 f"computed {delta['local_compute']:.0f})")
    report.check(delta["nixl_failed"] == 0 and delta["nixl_bytes"] > 0,
                 f"{name}: NIXL moved {delta['nixl_bytes']:.0f} bytes, no failed transfer")
    plain_body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    plain = client.post(prefill.url + path, json=plain_body)
    report.check(plain.status_code == 200 and answer_text(plain.json()) == text,
                 f"{name}: P/D text equals the producer's own greedy answer: {text!r}")


def run_prefill_hit_case(client: httpx.Client, report: Report, prefill: VllmServer,
                         decode: VllmServer) -> None:
    """The same prompt twice through P/D: the second prefill is a producer-side prefix hit, and
    the consumer reports that hit (not its own) as ``cached_tokens``."""
    name = "producer-hit"
    body = {"model": MODEL, "prompt": "again " + PROMPT_TEXT, "max_tokens": 4, "temperature": 0}
    print(f"{name}: POST /v1/completions twice", flush=True)
    cached: list[tuple[int, int]] = []
    for _ in range(2):
        pre = client.post(prefill.url + "/v1/completions", json=prefill_body(body)).json()
        dec = client.post(decode.url + "/v1/completions",
                          json=decode_body(body, pre["kv_transfer_params"])).json()
        cached.append((pre["usage"]["prompt_tokens_details"]["cached_tokens"],
                       dec["usage"]["prompt_tokens_details"]["cached_tokens"]))
    (p1, d1), (p2, d2) = cached
    report.check(p1 == d1 == 0 and p2 > 0 and d2 == p2,
                 f"{name}: consumer cached_tokens mirrors the producer's: first {p1}/{d1}, "
                 f"second {p2}/{d2} (producer/consumer)")


def save_fixtures(report: Report, out_dir: Path, version: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    chat = report.exchanges.get("chat")
    if chat is not None:
        (out_dir / "vllm_prefill_request.json").write_text(
            json.dumps(chat["prefill_request"], indent=2) + "\n")
        (out_dir / "vllm_prefill_response.json").write_text(
            json.dumps(chat["prefill_response"], indent=2) + "\n")
    exchange = {"vllm_version": version,
                "connector": {"prefill": kv_transfer_config(KV_ROLES[0]),
                              "decode": kv_transfer_config(KV_ROLES[1])},
                **report.exchanges}
    (out_dir / "vllm_pd_exchange.json").write_text(json.dumps(exchange, indent=2) + "\n")
    print(f"fixtures written under {out_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--save-fixtures", type=Path, default=None,
                        help="write the exchanges as JSON fixtures into this folder")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        model_dir = build_tiny_model()
    except StartError as exc:
        print(exc, file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-vllm-probe-"))
    report = Report()
    with ProcessSet(log_dir) as procs, httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        try:
            prefill, decode = start_pair(procs, model_dir)
        except StartError as exc:
            print(f"servers did not start (logs under {log_dir}):\n{exc}", file=sys.stderr)
            return 2
        print(f"servers ready in {time.monotonic() - t0:.0f} s: prefill {prefill.url}, "
              f"decode {decode.url} (logs under {log_dir})", flush=True)
        version = client.get(prefill.url + "/version").json().get("version", "?")
        try:
            run_case(client, report, "chat", "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": PROMPT_TEXT}],
                      "max_completion_tokens": 12, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}}, prefill, decode)
            run_case(client, report, "completions", "/v1/completions",
                     {"model": MODEL, "prompt": "once more " + PROMPT_TEXT, "max_tokens": 12,
                      "temperature": 0}, prefill, decode)
            run_prefill_hit_case(client, report, prefill, decode)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            report.check(False, f"exchange broke: {type(exc).__name__}: {exc}")
        if report.failed:
            for name in (f"{SERVER_NAME}-0", f"{SERVER_NAME}-1"):
                print(f"--- {name} log tail ---\n{procs.tail(name, 40)}")
    if args.save_fixtures is not None and report.exchanges:
        save_fixtures(report, args.save_fixtures, version)
    print(f"{len(report.passed)} checks passed, {len(report.failed)} failed, "
          f"{time.monotonic() - t0:.0f} s in all (vLLM {version})")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
