"""`kvgate demo`, the README's first command: it starts, serves, and stops cleanly."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from gateway.procs.net import free_port


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_demo_serves_openai_clients_and_stops_cleanly(stop_signal: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--time-scale", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            line = proc.stdout.readline()
            assert line, "demo exited early:\n" + "".join(lines)
            lines.append(line)
        banner = "".join(lines)
        assert f"http://127.0.0.1:{port}" in banner and "curl" in banner

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="sim-llama-3-8b", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5)
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        long = client.completions.create(model="sim-llama-3-8b", prompt="word " * 9000,
                                         max_tokens=2)
        assert long.usage is not None and long.usage.prompt_tokens > 8192
        # One 1 MiB word: 262,144 tokens by the simple tokenizer (BPE-like), beyond 128K.
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="sim-llama-3-8b", prompt="x" * 2**20, max_tokens=2)
        assert refused.value.code == "context_length_exceeded"

        proc.send_signal(stop_signal)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "kvgate demo stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_refuses_a_taken_port_before_starting_workers() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "kvgate demo stopped" not in done.stdout
