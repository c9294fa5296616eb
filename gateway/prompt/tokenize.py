"""``/tokenize`` answered by the gateway: the token ids vLLM 0.32's own ``/tokenize`` returns.

vLLM (``entrypoints/serve/tokenize``) takes either ``prompt`` (a string, encoded with
``add_special_tokens``, default true) or ``messages`` (rendered with the server's chat template,
``add_generation_prompt`` default true, ``continue_final_message``, ``tools`` and
``chat_template_kwargs`` as for chat, then encoded without special tokens by default). It answers
``{"count", "max_model_len", "tokens", "token_strs"}``; the gateway's ``max_model_len`` is the
largest pool's ``max_context_tokens`` (set it to the workers' ``--max-model-len``).

The rendering and encoding are the chat route's (``gateway.prompt.tokenizer``), so the ids are the
ones the gateway counts for budgets. Not answered here (400, ``gateway.request``): ``messages``
with ``add_special_tokens`` true, and ``return_token_strs`` (the tokenizer protocol has no
id-to-token-string map). The work stops at ``limits.tokenize_timeout_s``; vLLM puts no length
limit on ``/tokenize``, so neither does the gateway beyond the body limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.prompt.limits import Deadline
from gateway.prompt.render import vllm_conversation
from gateway.prompt.tokenizer import PromptTokenizer


@dataclass(frozen=True, slots=True)
class TokenizeInput:
    """What a ``/tokenize`` request asks for: ``prompt`` text, or ``messages`` with the body's
    template options."""

    body: Mapping[str, Any]
    prompt: str | None
    messages: tuple[Mapping[str, Any], ...]
    add_special_tokens: bool


def tokenize_ids(tokenizer: PromptTokenizer, request: TokenizeInput,
                 timeout_s: float | None = None) -> list[int]:
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    if request.prompt is not None:
        return tokenizer.encode_text(request.prompt, request.add_special_tokens,
                                     deadline=deadline)
    return tokenizer.encode_chat(vllm_conversation(request.messages), request.body,
                                 deadline=deadline)
