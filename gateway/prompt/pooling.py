"""Step 2 for vLLM's pooling routes: the sequences a request runs, as token ids.

A pooling model (an embedding, reranker or classifier model, vLLM's ``--runner pooling``)
generates nothing: vLLM 0.32 runs each input of a request as its own sequence, one prefill, and
frees its KV when the sequence is pooled. What it runs (``entrypoints/pooling/*/protocol.py``,
``scoring/io_processor.py``):

* ``/v1/embeddings``, ``/classify``, ``/pooling``: ``input`` (a string, strings, token ids or
  arrays of token ids), each string encoded with ``add_special_tokens`` (default true), token
  ids taken as they are; or ``messages``, one conversation rendered with the server's chat
  template, ``add_generation_prompt`` false unless asked (the chat routes default to true) and
  encoded without special tokens;
* ``/score``: two sides (``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``
  or ``text_1``/``text_2``), ``/rerank``: ``query`` and ``documents``. An embedding model scores
  as a bi-encoder: every query and every document is one sequence encoded with special tokens,
  and the scores are cosines of their vectors (one query against each document, else pair by
  pair);
* ``truncate_prompt_tokens`` cuts every sequence to that many tokens (-1: the model's length) on
  ``truncation_side`` (right, the default, keeps the first tokens).

The KV footprint of a request is the sum of its sequences' tokens: vLLM admits them together and
may prefill them in one batch, and none outlives the response (no decode follows), so that sum
is what the request can hold at once and only while it runs. vLLM's usage reports the tokens per
score pair instead (the query again with each document): the reservation settles on it.

Not counted here (the request path refuses what it cannot count): media inputs, and
cross-encoder rerankers (``*ForSequenceClassification``), which encode a query and a document as
one pair with the tokenizer's separator; the models served here are bi-encoders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.prompt.limits import Deadline, check_room
from gateway.prompt.render import vllm_conversation
from gateway.prompt.tokenizer import PromptTokenizer


@dataclass(frozen=True, slots=True)
class PoolingInputs:
    """The sequences of one pooling request, before tokenization (``gateway.request`` parses
    them): strings to encode, token ids to take as they are, or one conversation."""

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    messages: tuple[Mapping[str, Any], ...] = ()
    add_special_tokens: bool = True
    truncate_tokens: int | None = None  # None: no cut; -1: the model's length
    truncate_left: bool = False
    queries: int = 0  # score and rerank: the first ``queries`` texts are queries, then documents


def chat_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template options of a pooling request's ``messages``: vLLM's pooling chat requests
    default ``add_generation_prompt`` to false (the chat routes to true)."""
    return {**body, "add_generation_prompt": body.get("add_generation_prompt", False)}


def pooling_token_ids(tokenizer: PromptTokenizer, inputs: PoolingInputs, options: Mapping[str, Any],
                      *, max_tokens: int, timeout_s: float | None = None) -> list[list[int]]:
    """One list of token ids per sequence vLLM runs for ``inputs``; ``options``: the request
    body (template options of ``messages``). ``max_tokens``: the largest pool's context: a text
    certainly longer is refused before it is encoded, unless the request truncates it."""
    check_room(max_tokens)
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    cut = inputs.truncate_tokens
    bound = max_tokens if cut is None else None  # a truncated text may be any length
    if inputs.messages:
        ids = [tokenizer.encode_chat(vllm_conversation(inputs.messages), chat_options(options),
                                     max_tokens=bound, deadline=deadline)]
    elif inputs.texts:
        ids = [tokenizer.encode_text(t, inputs.add_special_tokens, max_tokens=bound,
                                     deadline=deadline) for t in inputs.texts]
    else:
        ids = [list(t) for t in inputs.token_ids]
    if cut is None:
        return ids
    keep = max_tokens if cut < 0 else cut
    return [s[-keep:] if inputs.truncate_left and keep else s[:keep] for s in ids]
