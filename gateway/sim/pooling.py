"""The simulated worker's pooling routes, for a worker configured ``runner: pooling``.

``/v1/embeddings``, ``/score`` (``/v1/score``), ``/rerank`` (``/v1/rerank``, ``/v2/rerank``),
``/classify`` and ``/pooling`` answer in vLLM 0.32's shapes (``entrypoints/pooling/*/protocol.py``)
with vectors that depend only on the token ids: each token id seeds a fixed random vector of
``EMBEDDING_DIM`` floats, a sequence's vector is their sum, L2-normalised (so equal inputs embed
equally, and inputs that share tokens point the same way). Scores are cosines of a query's and a
document's vectors (an embedding model scores as a bi-encoder); ``/classify`` has two classes,
``LABEL_0`` and ``LABEL_1``, from a softmax over the first two components.

The sequences and their token counts are the gateway's (``gateway.request`` parses the body,
``gateway.prompt.pooling`` tokenizes it): the sim charges what the gateway counts, and the
integration tests compare both with real vLLM. Usage is vLLM's: the tokens of every sequence
(for score and rerank, of every pair: the query again with each document). The requests do not
pass through the engine: a pooling request holds KV only for its one prefill, which the demo has
no need to model, so they show in neither ``/load`` nor ``/metrics``.
"""

from __future__ import annotations

import base64
import functools
import math
import random
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any

from gateway.errors import GatewayError
from gateway.prompt.limits import PromptTooLongError
from gateway.prompt.pooling import PoolingInputs, pooling_token_ids
from gateway.prompt.tokenizer import PromptTokenizer
from gateway.request import Endpoint, parse_body

EMBEDDING_DIM = 32
CLASS_LABELS = ("LABEL_0", "LABEL_1")
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
"""What vLLM does not serve for a pooling model (404, as for any unknown path)."""


class PoolingRefused(Exception):
    """A request vLLM refuses: ``status``, message, ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def pooling_answer(endpoint: Endpoint, raw: bytes, tokenizer: PromptTokenizer, model: str,
                   max_model_len: int) -> dict[str, Any]:
    """The response body of a pooling route for the request body ``raw``."""
    try:
        parsed = parse_body(raw, endpoint, default_max_tokens=0)
        assert parsed.pooling is not None
        sequences = pooling_token_ids(tokenizer, parsed.pooling, parsed.body,
                                      max_tokens=max_model_len)
    except GatewayError as exc:
        raise PoolingRefused(exc.status, exc.message, exc.param) from None
    except PromptTooLongError as exc:
        raise PoolingRefused(400, str(exc), "input") from None
    if parsed.model != model:
        raise PoolingRefused(404, f"The model `{parsed.model}` does not exist.", "model")
    longest = max(len(s) for s in sequences)
    if longest > max_model_len:
        raise PoolingRefused(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you"
            f" requested {longest} tokens in the input. Please reduce the length of the input.",
            "input")
    vectors = [embed(s) for s in sequences]
    head = {"object": "list", "created": int(time.time()), "model": model}
    if endpoint in (Endpoint.SCORE, Endpoint.RERANK):
        return _scored(endpoint, parsed.body, parsed.pooling, sequences, vectors, model)
    usage = _usage(sum(len(s) for s in sequences))
    if endpoint is Endpoint.EMBEDDINGS:
        fmt = parsed.body.get("encoding_format") or "float"
        data = [{"index": i, "object": "embedding", "embedding": _encoded(v, fmt)}
                for i, v in enumerate(vectors)]
        return {"id": f"embd-{uuid.uuid4().hex}", **head, "data": data, "usage": usage}
    if endpoint is Endpoint.CLASSIFY:
        data = [{"index": i, **_classes(v)} for i, v in enumerate(vectors)]
        return {"id": f"classify-{uuid.uuid4().hex}", **head, "data": data, "usage": usage}
    data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
    return {"id": f"pool-{uuid.uuid4().hex}", **head, "data": data, "usage": usage}


@functools.lru_cache(maxsize=65_536)
def _token_vector(token_id: int) -> tuple[float, ...]:
    rng = random.Random(token_id)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIM))


def embed(token_ids: Sequence[int]) -> list[float]:
    """The unit vector of a sequence (see the module docstring)."""
    total = [0.0] * EMBEDDING_DIM
    for t in token_ids:
        total = [a + b for a, b in zip(total, _token_vector(t), strict=True)]
    norm = math.sqrt(sum(a * a for a in total)) or 1.0
    return [a / norm for a in total]


def _scored(endpoint: Endpoint, body: dict[str, Any], inputs: PoolingInputs,
            sequences: list[list[int]], vectors: list[list[float]],
            model: str) -> dict[str, Any]:
    """Score and rerank: one query against every document, else query i against document i."""
    n_queries = inputs.queries
    n_docs = len(sequences) - n_queries
    pairs = [(0 if n_queries == 1 else i, n_queries + i) for i in range(n_docs)]
    scores = [sum(a * b for a, b in zip(vectors[q], vectors[d], strict=True)) for q, d in pairs]
    tokens = sum(len(sequences[q]) + len(sequences[d]) for q, d in pairs)
    if endpoint is Endpoint.SCORE:
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model, "data": data,
                "usage": _usage(tokens)}
    ranked = sorted(range(n_docs), key=lambda i: -scores[i])
    top_n = body.get("top_n") or n_docs
    results = [{"index": i, "document": {"text": inputs.texts[n_queries + i],
                                         "multi_modal": None},
                "relevance_score": scores[i]} for i in ranked[:top_n]]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


def _usage(tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``, or ``base64`` of little-endian float32 (vLLM's default ``embed_dtype``)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    if encoding_format != "float":
        raise PoolingRefused(400, f"unsupported encoding_format {encoding_format!r}",
                             "encoding_format")
    return vector


def _classes(vector: list[float]) -> dict[str, Any]:
    logits = vector[: len(CLASS_LABELS)]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    probs = [e / sum(exps) for e in exps]
    label = CLASS_LABELS[probs.index(max(probs))]
    return {"label": label, "probs": probs, "num_classes": len(CLASS_LABELS)}
