"""Step 2's token ids: the prompt of a parsed request, tokenized as vLLM will tokenize it."""

from __future__ import annotations

from typing import Any, Protocol

from gateway.prompt.tokenizer import PromptTokenizer


class PromptRequest(Protocol):
    """What rendering reads of a request (``gateway.request.ParsedRequest``, a layer above)."""

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def is_chat(self) -> bool: ...


def prompt_token_ids(tokenizer: PromptTokenizer, parsed: PromptRequest) -> list[list[int]]:
    """One list of token ids per prompt (chat: always one; completions: one per batch entry)."""
    body = parsed.body
    if parsed.is_chat:
        return [tokenizer.encode_chat(body["messages"], body)]
    prompt: Any = body["prompt"]
    add_special = body.get("add_special_tokens", True) is not False
    if isinstance(prompt, str):
        return [tokenizer.encode_text(prompt, add_special)]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode_text(p, add_special) for p in prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]
