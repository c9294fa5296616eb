"""``/tokenize`` answered by the gateway: the answer vLLM 0.32's own ``/tokenize`` gives.

vLLM (``entrypoints/serve/tokenize``) takes either ``prompt`` (a string, encoded with
``add_special_tokens``, default true) or ``messages`` (rendered with the server's chat template,
``add_generation_prompt`` default true, ``continue_final_message``, ``tools`` and
``chat_template_kwargs`` as for chat, then encoded with ``add_special_tokens``, default false:
true adds the tokenizer's specials on top of what the template wrote, e.g. a second BOS). It
answers ``{"count", "max_model_len", "tokens", "token_strs"}``: ``token_strs`` is null unless
``return_token_strs`` is true, then the tokenizer's ``convert_ids_to_tokens`` of the ids
(vocabulary entries such as ``Ġis``, not decoded text). The gateway's ``max_model_len`` is the
largest pool's ``max_context_tokens`` (set it to the workers' ``--max-model-len``).

The rendering and encoding are the chat route's (``gateway.prompt.tokenizer``), so the ids are the
ones the gateway counts for budgets. The work is bounded as the chat route's is
(``gateway.prompt.limits``): rendering stops at ``limits.tokenize_timeout_s``, and a text certainly
longer than ``max_model_len`` tokens is refused (400 ``context_length_exceeded``) before it is
encoded. vLLM puts no length limit on ``/tokenize``, but there it costs one tenant's worker; here
the tokenizing thread is every tenant's, and an encode cannot be interrupted: a 15 MB body held
it ~20 s and made ~9M ids (the deadline is checked before the encode, not during it). A text
the floor lets through is answered whole, its count possibly above ``max_model_len``.
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
    template options (``add_special_tokens`` among them, read by ``encode_chat``)."""

    body: Mapping[str, Any]
    prompt: str | None
    messages: tuple[Mapping[str, Any], ...]
    add_special_tokens: bool
    return_token_strs: bool = False


def tokenize_ids(tokenizer: PromptTokenizer, request: TokenizeInput,
                 timeout_s: float | None = None, max_tokens: int | None = None) -> list[int]:
    """The token ids vLLM's ``/tokenize`` answers for ``request``; ``max_tokens``: a text
    certainly longer is refused before it is encoded (``PromptTooLongError``)."""
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    if request.prompt is not None:
        return tokenizer.encode_text(request.prompt, request.add_special_tokens,
                                     max_tokens=max_tokens, deadline=deadline)
    options = {**request.body, "add_special_tokens": request.add_special_tokens}
    return tokenizer.encode_chat(vllm_conversation(request.messages), options,
                                 max_tokens=max_tokens, deadline=deadline)


def tokenize_answer(tokenizer: PromptTokenizer, request: TokenizeInput, max_model_len: int,
                    timeout_s: float | None = None) -> dict[str, Any]:
    """vLLM's ``/tokenize`` response body for ``request`` (a text certainly longer than
    ``max_model_len`` tokens refused unencoded: see the module docstring)."""
    ids = tokenize_ids(tokenizer, request, timeout_s, max_tokens=max_model_len)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.token_strings(ids) if request.return_token_strs else None}
