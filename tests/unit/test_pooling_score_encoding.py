"""gateway.prompt.pooling: how a model's score and rerank requests become sequences.

A bi-encoder runs every query and document alone; a cross-encoder (``*ForSequenceClassification``)
runs each (query, document) pair as ONE sequence (vLLM 0.32's ``CrossEncoderIOProcessor``). The
encoding is read from the model's ``config.json`` as vLLM reads it. The simple tokenizer makes
every count here exact; ``tests/integration/test_pooling_cross_encoder.py`` proves the pair
encoding against the Hugging Face tokenizer's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelSettings
from gateway.prompt.pooling import (
    PoolingInputs,
    ScoreEncoding,
    pooling_token_ids,
    score_encoding,
    score_encoding_for,
)
from gateway.prompt.render import UncountableContentError
from gateway.prompt.tokenizer import SimpleTokenizer
from gateway.request import Endpoint, parse_body

TOK = SimpleTokenizer()
MAX_TOKENS = 4096
# What a config.json needs for the KV arithmetic of ``models[].architecture``.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 1000, "intermediate_size": 512, "torch_dtype": "bfloat16"}


def _inputs(endpoint: Endpoint, body: dict[str, Any]) -> PoolingInputs:
    parsed = parse_body(json.dumps({"model": "m", **body}).encode(), endpoint,
                        default_max_tokens=0)
    assert parsed.pooling is not None
    return parsed.pooling


def _ids(endpoint: Endpoint, body: dict[str, Any], scoring: ScoreEncoding) -> list[list[int]]:
    return pooling_token_ids(TOK, _inputs(endpoint, body), body, max_tokens=MAX_TOKENS,
                             scoring=scoring)


# --- which encoding a config.json means ----------------------------------------------------------


@pytest.mark.parametrize("config, want", [
    ({"architectures": ["BertForSequenceClassification"]}, ScoreEncoding.CROSS_ENCODER),
    ({"architectures": ["LlamaForSequenceClassification"]}, ScoreEncoding.CROSS_ENCODER),
    ({"architectures": ["Qwen3ForSequenceClassification"], "use_sep_token": False},
     ScoreEncoding.JOINED),
    ({"architectures": ["Qwen3ForSequenceClassification"], "use_pad_token": False,
      "use_sep_token": True}, ScoreEncoding.JOINED),  # the deprecated name wins, as in vLLM
    ({"architectures": ["BertModel"]}, ScoreEncoding.BI_ENCODER),
    ({"architectures": ["LlamaForCausalLM"]}, ScoreEncoding.BI_ENCODER),
    ({"architectures": ["JinaForRanking"]}, ScoreEncoding.OWN_PROMPT),
    ({"architectures": ["JinaVLForRanking"]}, ScoreEncoding.OWN_PROMPT),
    ({}, ScoreEncoding.BI_ENCODER),
    ({"architectures": []}, ScoreEncoding.BI_ENCODER),
    ({"architectures": "BertForSequenceClassification"}, ScoreEncoding.BI_ENCODER),
    ({"architectures": [7]}, ScoreEncoding.BI_ENCODER),
])
def test_score_encoding_follows_the_first_architecture(config: dict[str, Any],
                                                       want: ScoreEncoding) -> None:
    assert score_encoding(config) is want


def pooling_model(**fields: str) -> ModelSettings:
    return ModelSettings.model_validate({"name": "m", "runner": "pooling", **fields})


def _write_config(directory: Path, architecture: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps({"architectures": [architecture], **TINY_LLAMA}), encoding="utf-8")
    return path


def test_score_encoding_for_reads_the_tokenizer_directorys_config(tmp_path: Path) -> None:
    _write_config(tmp_path / "reranker", "XLMRobertaForSequenceClassification")
    model = pooling_model(tokenizer=str(tmp_path / "reranker"))

    assert score_encoding_for(model) is ScoreEncoding.CROSS_ENCODER


def test_an_architecture_config_file_overrides_the_tokenizer_directorys(tmp_path: Path) -> None:
    """The operator names the config.json of what the server really runs (e.g. a causal LM
    served with ``--convert classify``) through ``models[].architecture``."""
    _write_config(tmp_path / "tok", "Qwen3ForCausalLM")
    override = _write_config(tmp_path / "served", "Qwen3ForSequenceClassification")
    model = pooling_model(tokenizer=str(tmp_path / "tok"),
                          architecture=str(override))

    assert score_encoding_for(model) is ScoreEncoding.CROSS_ENCODER


def test_a_model_without_a_config_scores_as_a_bi_encoder() -> None:
    assert score_encoding_for(pooling_model()) is ScoreEncoding.BI_ENCODER
    preset = pooling_model(architecture="llama-3-8b")
    assert score_encoding_for(preset) is ScoreEncoding.BI_ENCODER


def test_an_unreadable_config_fails_at_start_naming_the_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    model = pooling_model(name="broken", tokenizer=str(tmp_path))

    with pytest.raises(ValueError, match="broken"):
        score_encoding_for(model)


# --- the sequences of each encoding --------------------------------------------------------------

QUERY = "what is kv"
DOCUMENTS = ["a cache of keys", "values too", "blocks"]
RERANK: dict[str, Any] = {"query": QUERY, "documents": DOCUMENTS}


def test_a_cross_encoder_runs_one_pair_sequence_per_document() -> None:
    ids = _ids(Endpoint.RERANK, RERANK, ScoreEncoding.CROSS_ENCODER)

    assert ids == [TOK.encode_pair(QUERY, d) for d in DOCUMENTS]


def test_a_cross_encoder_pairs_query_i_with_document_i_for_n_to_n_scores() -> None:
    body = {"queries": ["q one", "q two"], "documents": ["d one", "d two"]}

    ids = _ids(Endpoint.SCORE, body, ScoreEncoding.CROSS_ENCODER)

    assert ids == [TOK.encode_pair("q one", "d one"), TOK.encode_pair("q two", "d two")]


def test_a_cross_encoder_without_separator_joins_the_texts_with_special_tokens() -> None:
    ids = _ids(Endpoint.SCORE, {"text_1": "what is kv", "text_2": ["keys", "values"]},
               ScoreEncoding.JOINED)

    assert ids == [TOK.encode_text("what is kvkeys"), TOK.encode_text("what is kvvalues")]


def test_a_bi_encoder_still_runs_every_query_and_document_alone() -> None:
    ids = _ids(Endpoint.RERANK, RERANK, ScoreEncoding.BI_ENCODER)

    assert ids == [TOK.encode_text(t) for t in (QUERY, *DOCUMENTS)]


def test_the_pair_encoding_leaves_the_other_pooling_routes_alone() -> None:
    cross = _ids(Endpoint.EMBEDDINGS, {"input": DOCUMENTS}, ScoreEncoding.CROSS_ENCODER)

    assert cross == [TOK.encode_text(t) for t in DOCUMENTS]


def test_truncation_cuts_each_pair_sequence() -> None:
    """vLLM truncates the pair's one sequence (``truncate_prompt_tokens``), not each side."""
    full = _ids(Endpoint.RERANK, RERANK, ScoreEncoding.CROSS_ENCODER)

    cut = _ids(Endpoint.RERANK, {**RERANK, "truncate_prompt_tokens": 5},
               ScoreEncoding.CROSS_ENCODER)

    assert [len(s) for s in cut] == [min(5, len(s)) for s in full]
    assert min(len(s) for s in full) > 5  # the cut really cut every pair


def test_a_pair_longer_than_every_pool_counts_whole() -> None:
    """Only the sum of a pair's two texts tells whether it fits: each side alone does."""
    half = "w " * 1500  # 3000 tokens alone: each side fits 4096, the pair does not
    ids = _ids(Endpoint.RERANK, {"query": half, "documents": [half]}, ScoreEncoding.CROSS_ENCODER)

    assert len(ids) == 1 and len(ids[0]) > MAX_TOKENS


def test_score_on_a_model_with_its_own_prompt_is_refused_not_miscounted() -> None:
    with pytest.raises(UncountableContentError) as refused:
        _ids(Endpoint.RERANK, RERANK, ScoreEncoding.OWN_PROMPT)
    assert refused.value.param == "model"
