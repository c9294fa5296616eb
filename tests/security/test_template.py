"""The chat template, tried as a hostile client would (issue 12, item 3).

A gateway in front of a no-op worker serves three copies of the tiny model's tokenizer: its own
template (``tiny``), one that prints tools, documents and a custom variable (``rich``), and one
quadratic in the number of messages (``slow``: a model template that is slow on a large input).

* A template sent with the request (``chat_template``, or ``chat_template_kwargs.chat_template``)
  is refused as vLLM refuses it, so the count always comes from the model's template; a 2.6 KB
  body with a nested loop in it is refused at once while ``/health`` keeps answering.
* What vLLM passes still works and is counted: template variables, ``add_generation_prompt``,
  documents, tools.
* 10 MB of text is refused with 400 ``context_length_exceeded`` in well under a second, before
  it is tokenized (the floor in ``gateway.prompt.limits``).
* A slow model template is cut at ``limits.tokenize_timeout_s``: a clear 400, the event loop
  answering meanwhile, and the tokenizing slot free again for the next long prompt.
* The oracle: vLLM 0.32's own renderer (its GPU-less render server, on the ``rich`` copy) gives
  the same token ids as the gateway's prompt layer for every request it accepts, and refuses
  what the gateway refuses (but ``tokenize``, which the gateway refuses on purpose).
"""

from __future__ import annotations

import functools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.bench import noop
from gateway.config import build_settings
from gateway.procs.net import LOOPBACK, free_port, http_ok
from gateway.procs.process import ManagedProcess, ProcessSet, child_env
from gateway.procs.vllm import require_vllm_python, tiny_model_path
from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenizer import HFTokenizer
from gateway.request import Endpoint, parse_body
from tests.harness import answer_probe, serve_app

pytestmark = pytest.mark.timeout(120)

RICH = ("{{ bos_token }}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
        "{% if tools %}TOOLS{{ tools | tojson }}{% endif %}"
        "{% if documents %}DOCS{{ documents | tojson }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SLOW = ("{{ bos_token }}{% for a in messages %}{% for b in messages %}{{ b.role[0] }}{% endfor %}"
        "{{ a.content }}{% endfor %}")
NESTED_LOOP = ("{% for i in range(3000) %}{% for j in range(3000) %}{{ i * j }}{% endfor %}"
               "{% endfor %}")
TIMEOUT_S = 0.3
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box frogs "


def model_copy(root: Path, name: str, template: str) -> str:
    """The tiny model's tokenizer and config under ``root/name``, with ``template``."""
    target = root / name
    target.mkdir()
    for file in tiny_model_path().iterdir():
        if file.suffix == ".json":
            shutil.copy(file, target / file.name)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return str(target)


async def any_model_worker(scope: Scope, receive: Receive, send: Send) -> None:
    """The no-op worker, without a model list: the gateway takes it to serve every model."""
    if scope["type"] == "http" and scope["path"] == "/v1/models":
        await answer_probe(scope, send)
    else:
        await noop.app(scope, receive, send)


@pytest.fixture(scope="module")
def rich_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return model_copy(tmp_path_factory.mktemp("rich"), "rich", RICH)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, rich_model: str) -> Iterator[str]:
    root = tmp_path_factory.mktemp("templates")
    models = [{"name": "tiny", "tokenizer": str(tiny_model_path())},
              {"name": "rich", "tokenizer": rich_model},
              {"name": "slow", "tokenizer": model_copy(root, "slow", SLOW)}]
    with serve_app(any_model_worker) as worker:
        settings = build_settings({
            "models": models,
            "pools": [{"name": "p", "max_context_tokens": 100_000, "workers": [worker]}],
            "routing": {"default_max_tokens": 16},
            "health": {"interval_s": 0.2, "timeout_s": 30.0},
            "limits": {"max_body_bytes": 16 * 1024 * 1024, "tokenize_timeout_s": TIMEOUT_S},
        })
        with serve_app(create_app(settings)) as url:
            yield url


def chat(gateway: str, model: str = "tiny", **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": WORDS * 40}])
    return httpx.post(gateway + "/v1/chat/completions",
                      json={"model": model, "max_tokens": 4, **body}, timeout=60)


def prompt_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvgate-prompt-tokens"])


def refused(r: httpx.Response, code: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


class LoopProbe:
    """``/health`` asked back to back from a thread while a request runs: the longest answer
    time is how long the gateway's event loop was held."""

    def __init__(self, gateway: str) -> None:
        self._url = gateway + "/health"
        self._stop = threading.Event()
        self.longest_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                client.get(self._url)
                self.longest_s = max(self.longest_s, time.perf_counter() - started)
                time.sleep(0.005)

    def __enter__(self) -> LoopProbe:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_template_in_the_request_is_refused_and_the_models_template_counts(
        gateway: str) -> None:
    """Regression: ``chat_template_kwargs.chat_template`` replaced the model's template, so a
    619-token prompt was counted (and budgeted) as 1 token."""
    honest = prompt_tokens(chat(gateway))
    assert honest == len(HFTokenizer.load(str(tiny_model_path())).encode_chat(
        [{"role": "user", "content": WORDS * 40}], {}))
    for body in ({"chat_template_kwargs": {"chat_template": "x"}}, {"chat_template": "x"}):
        error = refused(chat(gateway, **body), "invalid_template_option")
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
    assert prompt_tokens(chat(gateway, chat_template_kwargs={"chat_template": None})) == honest


def test_a_nested_loop_template_does_not_hold_the_event_loop(gateway: str) -> None:
    """Regression: a 2.6 KB body with a nested Jinja loop held ``/health`` for 5.6 s."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                            "chat_template_kwargs": {"chat_template": NESTED_LOOP * 28}}
    assert 2000 < len(json.dumps(body)) < 3000  # rendered inline, on the event loop, before
    with LoopProbe(gateway) as probe:
        started = time.perf_counter()
        refused(chat(gateway, **body), "invalid_template_option")
        took_s = time.perf_counter() - started
    assert took_s < 1.0
    assert probe.longest_s < 0.5


def test_apply_chat_template_parameters_are_not_template_variables(gateway: str) -> None:
    """``tokenize`` with ``truncation`` would make vLLM 0.32 hold a cut prompt while the gateway
    counted the whole one; ``conversation`` collides with vLLM's own argument."""
    cases: list[dict[str, Any]] = [{"tokenize": True, "truncation": True, "max_length": 3},
                                   {"conversation": []}]
    for kwargs in cases:
        assert refused(chat(gateway, chat_template_kwargs=kwargs),
                       "invalid_template_option")["param"] == "chat_template_kwargs"


def test_template_variables_and_generation_flags_still_work_and_are_counted(
        gateway: str) -> None:
    plain = prompt_tokens(chat(gateway, "rich"))
    assert prompt_tokens(chat(gateway, "rich", chat_template_kwargs={"unused": 1})) == plain
    greeted = prompt_tokens(chat(gateway, "rich",
                                 chat_template_kwargs={"greeting": "hello there"}))
    assert greeted > plain
    # The request's own add_generation_prompt decides, as in vLLM, not the kwargs' copy.
    without = prompt_tokens(chat(gateway, "rich", add_generation_prompt=False))
    assert without < plain
    assert prompt_tokens(chat(gateway, "rich",
                              chat_template_kwargs={"add_generation_prompt": False})) == plain


def test_documents_and_tools_are_rendered_and_counted(gateway: str) -> None:
    """Regression: ``documents`` were dropped from the count."""
    plain = prompt_tokens(chat(gateway, "rich"))
    documents = [{"title": "manual", "text": WORDS * 30}]
    tools = [{"type": "function", "function": {"name": "lookup", "description": WORDS * 30}}]
    assert prompt_tokens(chat(gateway, "rich", documents=documents)) > plain + 300
    assert prompt_tokens(chat(gateway, "rich", tools=tools, tool_choice="none")) > plain + 300


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_ten_megabytes_of_text_are_refused_before_tokenizing(gateway: str, route: str) -> None:
    """Regression: 10 MB of text took 11.7 s to tokenize before its 400."""
    text = "word " * 2_000_000
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": text}]}
                            if route == "chat" else {"prompt": text})
    with LoopProbe(gateway) as probe:
        started = time.perf_counter()
        r = httpx.post(f"{gateway}/v1/{'chat/completions' if route == 'chat' else route}",
                       json={"model": "tiny", "max_tokens": 4, **body}, timeout=60)
        took_s = time.perf_counter() - started
    assert took_s < 1.0
    assert probe.longest_s < 0.5
    assert "at least" in refused(r, "context_length_exceeded")["message"]


def test_ten_megabytes_with_an_output_limit_beyond_every_pool_are_not_tokenized(
        gateway: str) -> None:
    started = time.perf_counter()
    r = chat(gateway, messages=[{"role": "user", "content": "word " * 2_000_000}],
             max_tokens=1_000_000)
    assert time.perf_counter() - started < 1.0
    assert "lower max_tokens" in refused(r, "context_length_exceeded")["message"]


def test_a_slow_model_template_is_cut_at_the_deadline_and_frees_its_slot(gateway: str) -> None:
    """A long prompt goes to the tokenizing pool (one thread); a model template that is slow on
    it stops at ``tokenize_timeout_s`` instead of holding that thread until it is done, so the
    next long prompt is served at once."""
    many = [{"role": "user", "content": "hi"}] * 3000  # > 16 KB: the pool; 9M template steps
    with LoopProbe(gateway) as probe:
        started = time.perf_counter()
        error = refused(chat(gateway, "slow", messages=many), "prompt_timeout")
        took_s = time.perf_counter() - started
    assert "tokenize_timeout_s" in error["message"]
    assert took_s < TIMEOUT_S + 1.0
    assert probe.longest_s < 0.5
    long_but_simple = [{"role": "user", "content": WORDS * 300}]  # > 16 KB, one message
    started = time.perf_counter()
    assert prompt_tokens(chat(gateway, "slow", messages=long_but_simple)) > 4000
    assert time.perf_counter() - started < 1.0


# vLLM's GPU-less render server (``vllm launch render``), started without vLLM's CLI entry point
# (which reads a package version this CPU build does not register).
RENDER_SERVER = """
import sys, uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser
uvloop.run(run_launch_fastapi(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])))
"""
TOOLS = [{"type": "function", "function": {"name": "f", "extra": 1}, "x_extra": [1]},
         {"function": {"name": "g", "description": "d", "parameters": {"type": "object"},
                       "strict": "true"}, "defer_loading": True}]
ORACLE_BODIES: list[dict[str, Any]] = [
    {}, {"chat_template_kwargs": {"greeting": "hello"}},
    {"chat_template_kwargs": {"greeting": "auto", "other": None}},
    {"chat_template_kwargs": {"bos_token": "B", "unused": [1, 2]}},
    {"chat_template_kwargs": {"add_generation_prompt": False}}, {"add_generation_prompt": "no"},
    {"chat_template_kwargs": {"padding": True, "max_length": 2, "truncation": True}},
    {"chat_template_kwargs": {"chat_template": None}},
    {"chat_template_kwargs": {"chat_template": "x"}}, {"chat_template": "x"},
    {"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": {"conversation": []}},
    {"chat_template_kwargs": {"return_assistant_tokens_mask": True}},
    {"tools": TOOLS, "tool_choice": "none"}, {"chat_template_kwargs": {"tools": [{"k": 1}]}},
    {"tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"tools": None}},
    {"documents": [{"title": "t", "text": "x"}]},
    {"documents": [{"title": "t", "text": "x"}],
     "chat_template_kwargs": {"documents": [{"title": "k"}]}},
    {"chat_template_kwargs": {"documents": [{"title": "k"}]}}, {"documents": [{"a": 1}]},
    {"reasoning_effort": "none"}, {"reasoning_effort": "high"}, {"reasoning_effort": "auto"},
    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": "maybe"}},
    {"chat_template_kwargs": {"enable_thinking": None, "reasoning_effort": "low"}},
    {"continue_final_message": True, "add_generation_prompt": False},
    {"messages": [{"role": "developer", "content": "dev"}, {"role": "system", "content": "sys"},
                  {"role": "user", "content": "u"}]},
    {"messages": [{"role": "user", "content": "u"}, {"role": "developer", "content": "dev"}]},
]


@pytest.fixture(scope="module")
def vllm_renderer(tmp_path_factory: pytest.TempPathFactory, rich_model: str) -> Iterator[str]:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with ProcessSet(tmp_path_factory.mktemp("vllm-render")) as procs:
        procs.start("render", ManagedProcess(
            [str(require_vllm_python()), "-c", RENDER_SERVER, "--model", rich_model,
             "--served-model-name", "rich", "--host", LOOPBACK, "--port", str(port)],
            ready=functools.partial(http_ok, url + "/health", 2.0),
            env=child_env({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
                          drop=("KVGATE_", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"))),
            timeout_s=240)
        yield url


@pytest.mark.vllm
def test_the_template_inputs_are_vllms_own(vllm_renderer: str, rich_model: str) -> None:
    ours = HFTokenizer.load(rich_model)
    for extra in ORACLE_BODIES:
        body = {"model": "rich", "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}], **extra}
        r = httpx.post(vllm_renderer + "/v1/chat/completions/render", json=body, timeout=60)
        try:
            got: Any = prompt_token_ids(ours, parse_body(
                json.dumps(body).encode(), Endpoint.CHAT, default_max_tokens=16))[0]
        except ValueError as exc:  # the prompt layer's refusals
            got = type(exc).__name__
        expected = r.json()["token_ids"] if r.status_code == 200 else "refused"
        assert (got == expected) or (isinstance(got, str) and expected == "refused"), extra
