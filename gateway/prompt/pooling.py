"""Step 2 for vLLM's pooling routes: the sequences a request runs, as token ids.

A pooling model (an embedding, reranker or classifier model, vLLM's ``--runner pooling``)
generates nothing: vLLM 0.32 runs each input of a request as its own sequence, one prefill, and
frees its KV when the sequence is pooled. What it runs (``entrypoints/pooling/*/protocol.py``,
``scoring/io_processor.py``):

* ``/v1/embeddings``, ``/classify``, ``/pooling``: ``input`` (a string, strings, token ids or
  arrays of token ids), each string encoded with ``add_special_tokens`` (default true), token
  ids taken as they are; or ``messages``, one conversation rendered with the server's chat
  template, ``add_generation_prompt`` false unless asked (the chat routes default to true) and
  encoded with ``add_special_tokens`` (default false: the template wrote them);
* ``/score``: two sides (``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``
  or ``text_1``/``text_2``), ``/rerank``: ``query`` and ``documents``; one query against each
  document, else pair by pair. How a pair becomes sequences is the model's ``ScoreEncoding``
  (vLLM's score type, from the pooling task its architecture serves: ``score_encoding``):

  - bi-encoder (an embedding model): every query and every document is one sequence encoded
    with special tokens, and the scores are cosines of their vectors;
  - cross-encoder (a reranker, ``*ForSequenceClassification``): each (query, document) pair is
    ONE sequence, ``tokenizer(query, text_pair=document)`` with the separator the tokenizer puts
    between a pair; a config with ``use_sep_token: false`` ("LLM as reranker") joins the two
    texts instead and encodes the join with special tokens;
* ``truncate_prompt_tokens`` cuts every sequence to that many tokens (-1: the model's length) on
  ``truncation_side`` (right, the default, keeps the first tokens).

The KV footprint of a request is the sum of its sequences' tokens: vLLM admits them together and
may prefill them in one batch, and none outlives the response (no decode follows), so that sum
is what the request can hold at once and only while it runs. vLLM's usage reports the tokens per
score pair instead (for a bi-encoder the query again with each document; for a cross-encoder
exactly the pair sequences): the reservation settles on it.

Not counted here (the request path refuses what it cannot count, 400 ``unsupported_content``):
media inputs, and score/rerank on models for which vLLM builds its own prompt (``JinaForRanking``,
``JinaVLForRanking``'s score template). Also unknown to the gateway: a server started with a
``--chat-template`` for scoring, or with ``--convert classify`` / ``--hf-overrides`` turning a
causal LM into a reranker; point ``models[].architecture`` at a ``config.json`` whose
``architectures`` name what the server really runs (``score_encoding_for``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gateway.config import ModelSettings
from gateway.prompt.limits import Deadline, Truncation, check_room
from gateway.prompt.render import UncountableContentError, vllm_conversation
from gateway.prompt.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


class ScoreEncoding(StrEnum):
    """How vLLM 0.32 turns the (query, document) pairs of ``/score`` and ``/rerank`` into
    sequences (``entrypoints/pooling/scoring/io_processor.py``)."""

    BI_ENCODER = "bi-encoder"  # every query and document alone (BiEncoderIOProcessor)
    CROSS_ENCODER = "cross-encoder"  # tokenizer(query, text_pair=document) (CrossEncoderIOProcessor)
    JOINED = "joined"  # a cross-encoder with use_sep_token false: tokenizer(query + document)
    OWN_PROMPT = "own-prompt"  # vLLM builds a model-specific prompt: not counted, refused


# vLLM's io_processor for these is its own (JinaRankingIOProcessor) or the model's score
# template (JinaVLForRanking.get_score_template): neither is reproduced here.
_OWN_PROMPT_ARCHITECTURES = frozenset({"JinaForRanking", "JinaVLForRanking"})


def score_encoding(config: Mapping[str, Any]) -> ScoreEncoding:
    """The score encoding of a model from its ``config.json``, by vLLM's rule: the first of
    ``architectures`` decides the pooling task (``ModelConfig.get_pooling_task``); a
    ``*ForSequenceClassification`` model serves ``classify``, which scores as a cross-encoder
    (``SCORE_TYPE_MAP``), with the tokenizer's pair separator unless ``use_sep_token`` (or the
    deprecated ``use_pad_token``) is false (``ModelConfig.use_sep_token``)."""
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    if not isinstance(first, str):
        return ScoreEncoding.BI_ENCODER
    if first in _OWN_PROMPT_ARCHITECTURES:
        return ScoreEncoding.OWN_PROMPT
    if not first.endswith("ForSequenceClassification"):
        return ScoreEncoding.BI_ENCODER
    use_sep = config.get("use_pad_token")
    if use_sep is None:
        use_sep = config.get("use_sep_token", True)
    return ScoreEncoding.CROSS_ENCODER if use_sep else ScoreEncoding.JOINED


def score_encoding_for(model: ModelSettings) -> ScoreEncoding:
    """The score encoding of a configured model: from the ``config.json`` that
    ``models[].architecture`` names (a file, or a directory holding one), else the one in the
    tokenizer directory; a bi-encoder when there is none (a preset, a hub id, ``simple``).
    Reads a file: call it where I/O belongs (``Services.start``)."""
    for source in (model.architecture, model.tokenizer):
        if source is None:
            continue
        path = Path(source).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"model {model.name}: cannot read {str(path)!r}: {exc}") from None
            encoding = score_encoding(config if isinstance(config, dict) else {})
            log.info("model %s scores as %s (%s)", model.name, encoding.value, path)
            return encoding
    return ScoreEncoding.BI_ENCODER


@dataclass(frozen=True, slots=True)
class PoolingInputs:
    """The sequences of one pooling request, before tokenization (``gateway.request`` parses
    them): strings to encode, token ids to take as they are, or one conversation."""

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    messages: tuple[Mapping[str, Any], ...] = ()
    add_special_tokens: bool = True
    truncation: Truncation | None = None  # None: no cut
    queries: int = 0  # score and rerank: the first ``queries`` texts are queries, then documents


def chat_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template options of a pooling request's ``messages``: vLLM's pooling chat requests
    default ``add_generation_prompt`` to false (the chat routes to true)."""
    return {**body, "add_generation_prompt": body.get("add_generation_prompt", False)}


def pooling_token_ids(tokenizer: PromptTokenizer, inputs: PoolingInputs, options: Mapping[str, Any],
                      *, max_tokens: int, timeout_s: float | None = None,
                      scoring: ScoreEncoding = ScoreEncoding.BI_ENCODER) -> list[list[int]]:
    """One list of token ids per sequence vLLM runs for ``inputs``; ``options``: the request
    body (template options of ``messages``). ``max_tokens``: the largest pool's context: a text
    certainly longer is refused before it is encoded, unless the request truncates it.
    ``scoring``: the model's score encoding (score and rerank requests only)."""
    check_room(max_tokens)
    deadline = Deadline.after(timeout_s) if timeout_s is not None else None
    cut = inputs.truncation
    bound = max_tokens if cut is None else None  # a truncated text may be any length
    if inputs.queries and scoring is not ScoreEncoding.BI_ENCODER:
        ids = _pair_ids(tokenizer, inputs, scoring, bound, deadline)
    elif inputs.messages:
        ids = [tokenizer.encode_chat(vllm_conversation(inputs.messages), chat_options(options),
                                     max_tokens=bound, deadline=deadline)]
    elif inputs.texts:
        ids = [tokenizer.encode_text(t, inputs.add_special_tokens, max_tokens=bound,
                                     deadline=deadline) for t in inputs.texts]
    else:
        ids = [list(t) for t in inputs.token_ids]
    if cut is None:
        return ids
    return [cut.apply(s, max_tokens) for s in ids]


def _pair_ids(tokenizer: PromptTokenizer, inputs: PoolingInputs, scoring: ScoreEncoding,
              bound: int | None, deadline: Deadline | None) -> list[list[int]]:
    """A cross-encoder's sequences: one per (query, document) pair, the one query with each
    document or query i with document i (``gateway.request`` checked the sides are 1:N or N:N)."""
    if scoring is ScoreEncoding.OWN_PROMPT:
        raise UncountableContentError(
            "score and rerank on this model cannot be counted by the gateway: vLLM builds the"
            " model's own scoring prompt for it", "model")
    queries, documents = inputs.texts[:inputs.queries], inputs.texts[inputs.queries:]
    pairs = [(queries[0] if len(queries) == 1 else queries[i], d) for i, d in enumerate(documents)]
    if scoring is ScoreEncoding.JOINED:
        return [tokenizer.encode_text(q + d, True, max_tokens=bound, deadline=deadline)
                for q, d in pairs]
    return [tokenizer.encode_pair(q, d, max_tokens=bound, deadline=deadline) for q, d in pairs]
