"""kvgate: a KV-cache-aware OpenAI-compatible gateway in front of vLLM workers."""

from gateway import native

native.install()  # the compiled request path when it is built and fresh (gateway/native.py)
