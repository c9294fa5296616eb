"""What a generation request asks of its answer, and each choice's text, as vLLM 0.32 makes them.

The engine produces token ids; vLLM's OpenAI layer turns them into answers. This module does
that part for the simulated worker:

* ``output_spec`` reads and validates, with vLLM's messages, what shapes the answer: ``n``,
  ``logprobs``/``top_logprobs``, ``stop``, ``echo``, ``stream_options``, ``tools`` with
  ``tool_choice``, ``response_format``. Anything else is the engine's (``seed``, ``ignore_eos``,
  ``min_tokens``) or ignored, as vLLM ignores fields it does not know.
* Structured outputs force the answer's text (``OutputSpec.script``), as vLLM's grammar forces
  a model's tokens: a JSON value valid for the schema (its required properties, enum and const
  values), the arguments of a named tool, ``[{"name", "parameters"}]`` for ``tool_choice:
  "required"``; the engine emits those tokens and then EOS (``SamplingSpec.forced_token_ids``).
  Tool choices need a worker run as vLLM with a tool parser (``SimWorkerConfig.tool_call_parser``,
  ``kvgate sim --tool-call-parser``; the demo's workers have one): without, vLLM refuses every
  tool choice but ``none`` (400, its messages). ``tool_choice: "auto"`` answers text.
* ``ChoiceText`` follows one choice's tokens: their text (the script's pieces, else the
  tokenizer's), stop strings (the text is cut before the first match, ``finish_reason`` "stop",
  ``stop_reason`` the string; while streaming, the last ``len(longest stop) - 1`` characters are
  held back, as vLLM's detokenizer does, so a stop string split across chunks never leaks), and
  logprobs in the shape of the route (chat: ``content`` entries with ``top_logprobs``;
  completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). Logprob
  values are deterministic per token and position: the sampled token is the most likely, the
  alternatives other vocabulary tokens.
* Prompt logprobs, as vLLM computes them (``prompt_logprobs``; ``echo`` with ``logprobs`` on
  completions, ``echo`` on chat, where ``top_logprobs`` defaults to 0): per prompt token after
  the first, the token (its logprob and a rank below the others) and the ``k`` most likely
  others, keyed by token id (``prompt_logprob_rows``); completions put them on each choice and,
  with ``echo`` and ``logprobs``, in front of the generated tokens' entries, chat on the answer.
  Such a request reads no prefix cache (``gateway.request.reads_prefix_cache``). vLLM refuses
  them on a stream; one that asks for them only through ``echo`` gets none on a stream here.

Cost: nothing for a request that asks none of this (no stop strings, no logprobs: ``add`` joins
the tokens' cached texts, as before).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.prompt.tokenizer import PromptTokenizer, SimpleTokenizer

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
_VOCAB_FOR_ALL = 32000  # what -1 (the whole vocabulary) asks for, always more than the maximum
_LOGPROB_FLOOR = -9999.0
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily
_LIKELIEST_SAMPLED = 0.3
"""How often a sampled (not greedy) token is the likeliest one: its completions ``top_logprobs``
then has ``k`` entries, not ``k + 1``, as real vLLM's answers do now and then."""


_NO_VALUE = object()


class SpecError(ValueError):
    """A request vLLM refuses (400); ``param`` names the field. The message ends as vLLM's
    validation errors do: ``(parameter=P)`` or ``(parameter=P, value=V)``."""

    def __init__(self, message: str, param: str | None, value: Any = _NO_VALUE) -> None:
        if param is not None:
            shown = "" if value is _NO_VALUE else f", value={value}"
            message = f"{message} (parameter={param}{shown})"
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OutputSpec:
    n: int
    logprobs: int | None
    """Alternatives per token (chat ``top_logprobs``, completions ``logprobs``); None: none."""
    stop: tuple[str, ...]
    echo: bool
    include_usage: bool
    continuous_usage: bool
    script: str | None = None
    """The text structured outputs force, or None."""
    tool_name: str | None = None
    """The tool a forced answer calls (named tool choice), None otherwise."""
    tool_required: bool = False
    prompt_logprobs: int | None = None
    """Alternatives per prompt token (vLLM's effective ``prompt_logprobs``); None: none."""
    echo_only: bool = False
    """Completions ``echo`` with ``max_tokens: 0``: the one token sampled is not shown."""
    greedy: bool = False
    """``temperature`` 0 (below vLLM's ``_SAMPLING_EPS``): each token is the likeliest."""


def output_spec(body: Mapping[str, Any], *, chat: bool, tool_parser: bool = False) -> OutputSpec:
    """The answer ``body`` asks for; ``SpecError`` where vLLM answers 400. ``tool_parser``:
    the worker runs as vLLM with ``--enable-auto-tool-choice --tool-call-parser``; without,
    vLLM refuses every tool choice but ``none``."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if isinstance(n, float) and n.is_integer():
        n = int(n)  # pydantic's lax integers, as vLLM's request model takes them
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError(f"n must be at least 1, got {n}.", None)
    stream = bool(body.get("stream", False))
    raw_options = body.get("stream_options")
    if raw_options and not stream:
        raise SpecError("Stream options can only be defined when `stream=True`.",
                        "stream_options")
    options: Mapping[str, Any] = raw_options if isinstance(raw_options, Mapping) else {}
    include_usage = stream and bool(options.get("include_usage", False))
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and temperature < 0:
        raise SpecError(f"temperature must be non-negative, got {float(temperature)}.",
                        "temperature", float(temperature))
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    prompt_logprobs = _prompt_logprobs(body, chat=chat, stream=stream)
    script, tool_name, required = (_tool_answer(body, tool_parser) if chat
                                   else (None, None, False))
    if script is None:
        script = _format_answer(body.get("response_format"))
    return OutputSpec(
        n=n, logprobs=logprobs, stop=_stop(body.get("stop")), echo=bool(body.get("echo")),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats", False)),
        script=script, tool_name=tool_name, tool_required=required,
        prompt_logprobs=prompt_logprobs,
        echo_only=not chat and bool(body.get("echo")) and body.get("max_tokens") == 0,
        greedy=isinstance(temperature, int | float) and temperature < _SAMPLING_EPS,
    )


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int | float) or isinstance(top, bool)):
        raise SpecError("`top_logprobs` must be an integer.", "top_logprobs")
    if top is not None and top < 0 and top != -1:
        raise SpecError("`top_logprobs` must be a positive value or -1.", "top_logprobs")
    if top is not None and (top == -1 or top > 0) and not body.get("logprobs"):
        raise SpecError("when using `top_logprobs`, `logprobs` must be set to true.",
                        "top_logprobs")
    if not body.get("logprobs"):
        return None
    return _within_max(int(top or 0))


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    value = body.get("logprobs")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError("`logprobs` must be an integer.", "logprobs")
    if value < 0 and value != -1:
        raise SpecError("`logprobs` must be a positive value or -1.", "logprobs")
    return _within_max(value)


def _prompt_logprobs(body: Mapping[str, Any], *, chat: bool, stream: bool) -> int | None:
    """vLLM's effective ``prompt_logprobs``: the field, else with ``echo`` the route's logprobs
    (completions ``logprobs``; chat ``top_logprobs``, 0 when not given); its checks."""
    value = body.get("prompt_logprobs")
    if value is None:
        if not body.get("echo"):
            return None
        other = body.get("top_logprobs") if chat else body.get("logprobs")
        if chat:
            return int(other or 0)
        return None if other is None else min(max(int(other), 0), MAX_LOGPROBS)
    if not isinstance(value, int | float) or (isinstance(value, float)
                                              and not value.is_integer()):
        raise SpecError("`prompt_logprobs` must be an integer.", "prompt_logprobs", value)
    if stream and (value > 0 or value == -1):
        raise SpecError("`prompt_logprobs` are not available when `stream=True`.",
                        "prompt_logprobs")
    if value < 0 and value != -1:
        raise SpecError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs",
                        value)
    asked = _VOCAB_FOR_ALL if value == -1 else int(value)
    if asked > MAX_LOGPROBS:
        raise SpecError(f"Requested prompt logprobs of {asked}, which is greater than max"
                        f" allowed: {MAX_LOGPROBS}", "prompt_logprobs", asked)
    return asked


def _within_max(value: int) -> int:
    if value == -1:
        return MAX_LOGPROBS
    if value > MAX_LOGPROBS:
        raise SpecError(f"Requested sample logprobs of {value}, which is greater than max "
                        f"allowed: {MAX_LOGPROBS}", "logprobs", value)
    return value


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise SpecError("`stop` must be a string or a list of strings", "stop")


# -- structured outputs ---------------------------------------------------------------------------


def _tool_answer(body: Mapping[str, Any],
                 tool_parser: bool) -> tuple[str | None, str | None, bool]:
    """vLLM's ``check_tool_usage`` and its tool-parser checks, then the forced answer of a named
    or required tool choice."""
    tools = body.get("tools")
    if tools == []:
        raise SpecError("`tools` must not be an empty array. Either provide at least one tool "
                        "or omit the field entirely.", "tools")
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return None, None, False
    if tools is None:
        raise SpecError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    functions = _functions(tools)
    if choice == "auto":
        if not tool_parser:
            raise SpecError('"auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", None)
        return None, None, False
    if choice == "required":
        if not tool_parser:
            raise SpecError('tool_choice="required" requires --tool-call-parser to be set', None)
        calls = [{"name": name, "parameters": example_value(schema)}
                 for name, schema in functions[:1]]
        return json.dumps(calls, ensure_ascii=False), None, True
    if not isinstance(choice, Mapping):
        raise SpecError(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                        '"none", "auto" or "required" are supported.', "tool_choice")
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise SpecError(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                        f"{usage}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                        "tool_choice.function.name")
    schema = dict(functions).get(name)
    if name not in dict(functions):
        raise SpecError("The tool specified in `tool_choice` does not match any of the "
                        "specified `tools`", "tool_choice")
    if not tool_parser:
        raise SpecError(f'tool_choice=function "{name}" requires --tool-call-parser to be set',
                        None)
    return json.dumps(example_value(schema), ensure_ascii=False), name, False


def _functions(tools: Any) -> list[tuple[str, Any]]:
    if not isinstance(tools, list):
        raise SpecError("`tools` must be an array", "tools")
    out: list[tuple[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SpecError(f"tools[{i}] must have a `function` with a string `name`",
                            f"tools.{i}")
        out.append((function["name"], function.get("parameters")))
    return out


def _format_answer(response_format: Any) -> str | None:
    if not isinstance(response_format, Mapping):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return "{}"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None:
            raise SpecError("When response_format type is 'json_schema', the 'json_schema' "
                            "field must be provided.", "response_format")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, Mapping) else None
        return json.dumps(example_value(schema), ensure_ascii=False)
    return None


_MAX_SCHEMA_DEPTH = 16
_MAX_SCHEMA_LENGTH = 64  # a schema's minItems/minLength, capped: a request must not size it


def example_value(schema: Any, depth: int = 0) -> Any:
    """A small JSON value valid for ``schema``: its required properties only, the first enum
    value, ``const``, the first branch of ``anyOf``/``oneOf``, minimal lengths and bounds.
    Nesting deeper than 16 levels gives null, and lengths are capped at 64, so no schema a
    client sends can make the answer large."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return {} if depth == 0 else None
    depth += 1
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            return example_value(branches[0], depth)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        return {name: example_value(properties.get(name, {}), depth)
                for name in (required if isinstance(required, list) else [])
                if isinstance(name, str)}
    if kind == "array":
        return [example_value(schema.get("items", {}), depth)
                for _ in range(_length(schema.get("minItems")))]
    if kind == "string":
        return "x" * max(_length(schema.get("minLength")), 3)
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        low = low if isinstance(low, int | float) and not isinstance(low, bool) else 0
        value = max(low, 0) + (1 if "exclusiveMinimum" in schema else 0)
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return False
    return None


def script_tokens(tokenizer: PromptTokenizer, text: str) -> tuple[list[int], list[str]]:
    """The token ids of a forced answer and the text of each (the simple tokenizer cannot
    decode its ids back to text, so the text comes from the pieces it encoded)."""
    if isinstance(tokenizer, SimpleTokenizer):
        return tokenizer.encode_text(text, False), tokenizer.pieces(text)
    ids = tokenizer.encode_text(text, False)
    pieces: list[str] = []
    done = ""
    for end in range(1, len(ids) + 1):
        upto = tokenizer.decode(ids[:end])
        pieces.append(upto[len(done):])
        done = upto
    return ids, pieces


def _length(value: Any) -> int:
    return min(value, _MAX_SCHEMA_LENGTH) if isinstance(value, int) and value > 0 else 0


# -- one choice's text ----------------------------------------------------------------------------


class ChoiceText:
    """The text, stop and logprobs of one choice as its tokens arrive."""

    __slots__ = ("_greedy", "_hold", "_logprobs", "_longest_stop", "_pieces", "_sent", "_text", "_text_of",
                 "finished", "stop", "stop_reason", "tokens")

    def __init__(self, spec: OutputSpec, text_of: Callable[[int], str],
                 pieces: Sequence[str] = (), *, streaming: bool) -> None:
        self.stop = spec.stop
        self._logprobs = spec.logprobs
        self._greedy = spec.greedy
        self._text_of = text_of
        self._pieces = pieces
        self._longest_stop = max((len(s) for s in spec.stop), default=1)
        self._hold = self._longest_stop - 1 if streaming else 0
        self._text = ""
        self._sent = 0
        self.tokens = 0
        """Tokens counted in usage (those up to a stop string's end)."""
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The whole text so far (kept only for stop strings, logprobs and forced answers)."""
        return self._text

    def text_of(self, position: int, token_id: int) -> str:
        pieces = self._pieces
        return pieces[position] if position < len(pieces) else self._text_of(token_id)

    def add(self, token_ids: Sequence[int], finished: bool) -> tuple[str, list[Any] | None]:
        """The text to send for these new tokens, and their logprob entries (chat ``content``
        entries or completions rows, ``(token, logprob, top)``); marks ``finished`` on a stop
        string (the rest of the tokens are dropped) or when ``finished``."""
        if not self.stop and self._logprobs is None and not self._pieces:  # the usual request
            self.tokens += len(token_ids)
            self.finished = finished
            return "".join([self._text_of(t) for t in token_ids]), None
        rows: list[Any] | None = [] if self._logprobs is not None else None
        for token_id in token_ids:
            piece = self.text_of(self.tokens, token_id)
            if rows is not None:
                rows.append(self._row(self.tokens, token_id, piece))
            self.tokens += 1
            # A match can only end in the new piece: search from where it could start.
            start = len(self._text) - self._longest_stop + 1
            self._text += piece
            if self.stop and self._cut(max(start, 0)):
                finished = True
                break
        self.finished = finished
        end = len(self._text) if finished else max(self._sent, len(self._text) - self._hold)
        delta = self._text[self._sent:end]
        self._sent = end
        return delta, rows

    def _cut(self, start: int) -> bool:
        found = [(self._text.find(s, start), s) for s in self.stop]
        hits = [(at, s) for at, s in found if at >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self._text = self._text[:at]
        self.stop_reason = stop
        return True

    def _row(self, position: int, token_id: int, piece: str) -> tuple[str, float, list[Any]]:
        rng = random.Random(token_id * 1_000_003 + position)
        chosen = -rng.random() * 2.0
        # vLLM's: the sampled token, then the k likeliest tokens, one entry per token id (chat
        # shows the first k of these entries, completions all of them): k + 1 entries, or k
        # where the sampled token is the likeliest (always when greedy, else now and then).
        top: list[tuple[str, float]] = [(piece, chosen)]
        k = self._logprobs or 0
        likeliest = self._greedy or rng.random() < _LIKELIEST_SAMPLED
        while len(top) < k + (not likeliest or not k):
            alt = self._text_of(rng.randrange(16, 32000))
            top.append((alt, top[-1][1] - rng.random() * 2.0 - 0.01))
        return piece, chosen, top


def chat_logprobs(rows: list[Any], k: int) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs`` of ``ChoiceText.add``'s rows."""
    return {"content": [
        {"token": token, "logprob": max(lp, _LOGPROB_FLOOR), "bytes": list(token.encode()),
         "top_logprobs": [{"token": t, "logprob": max(v, _LOGPROB_FLOOR),
                           "bytes": list(t.encode())} for t, v in top[:k]]}
        for token, lp, top in rows
    ]}


def completion_logprobs(rows: list[Any], offset: int) -> tuple[dict[str, Any], int]:
    """vLLM's ``CompletionLogProbs`` of ``ChoiceText.add``'s rows, whose first token starts at
    character ``offset`` of the choice's text; and the offset after them."""
    offsets: list[int] = []
    for token, _, _ in rows:
        offsets.append(offset)
        offset += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(lp, _LOGPROB_FLOOR) for _, lp, _ in rows],
        "tokens": [token for token, _, _ in rows],
        "top_logprobs": [{t: max(v, _LOGPROB_FLOOR) for t, v in top} for _, _, top in rows],
    }, offset


PromptRow = list[tuple[int, float, int, str]] | None
"""One prompt token's logprobs: (token id, logprob, rank, text), the token itself first; None
for the first token (nothing precedes it)."""


def prompt_logprob_rows(prompt_ids: Sequence[int], k: int, text_of: Callable[[int], str],
                        pool: Sequence[int]) -> list[PromptRow]:
    """Each prompt token's logprobs as vLLM computes them for ``prompt_logprobs: k``: the token
    (a rank below the ``k`` others unless it is the likeliest) and the ``k`` most likely others
    (ranks 1..k, each likelier than the last). Deterministic per token and position; the others
    are ids from ``pool`` (the vocabulary, or for a real tokenizer the prompt's own ids, the only
    ones the simulator knows are valid), distinct in id and text; fewer where it runs out."""
    rows: list[PromptRow] = [None] if prompt_ids else []
    for position in range(1, len(prompt_ids)):
        token = prompt_ids[position]
        rng = random.Random(token * 1_000_003 + position * 7 + 1)
        piece = text_of(token)
        chosen = -3.0 - rng.random() * 6.0
        others: list[tuple[int, str]] = []
        ids, texts = {token}, {piece}
        for alt in rng.sample(pool, min(len(pool), 4 * k + 4)) if k else ():
            if len(others) == k:
                break
            text = text_of(alt)
            if alt not in ids and text not in texts:
                ids.add(alt)
                texts.add(text)
                others.append((alt, text))
        row = [(token, chosen, len(others) + 1 + rng.randrange(2000), piece)]
        logprob = chosen
        for rank in range(len(others), 0, -1):  # likelier towards rank 1
            logprob += 0.01 + rng.random()
            alt, text = others[rank - 1]
            row.append((alt, logprob, rank, text))
        row[1:] = sorted(row[1:], key=lambda e: e[2])
        rows.append(row)
    return rows


def vllm_prompt_logprobs(rows: Sequence[PromptRow]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` (per token: id -> logprob, rank, decoded token)."""
    return [None if row is None else
            {str(t): {"logprob": max(lp, _LOGPROB_FLOOR), "rank": rank, "decoded_token": text}
             for t, lp, rank, text in row} for row in rows]


def echoed_completion_logprobs(prompt_ids: Sequence[int], rows: Sequence[PromptRow],
                               text_of: Callable[[int], str],
                               generated: list[Any]) -> dict[str, Any]:
    """A completions ``logprobs`` with ``echo``: the prompt's tokens first (the first with no
    logprob), then the generated ones' (``ChoiceText.add``'s rows); offsets run over the
    tokens' texts, special tokens included, as vLLM counts them."""
    offsets, tokens, values, tops = [], [], [], []
    offset = 0
    for token, row in zip(prompt_ids, rows, strict=True):
        piece = text_of(token) if row is None else row[0][3]
        offsets.append(offset)
        offset += len(piece)
        tokens.append(piece)
        values.append(None if row is None else max(row[0][1], _LOGPROB_FLOOR))
        tops.append(None if row is None else
                    {text: max(lp, _LOGPROB_FLOOR) for _, lp, _, text in row})
    after, _ = completion_logprobs(generated, offset)
    return {"text_offset": offsets + after["text_offset"],
            "token_logprobs": values + after["token_logprobs"],
            "tokens": tokens + after["tokens"], "top_logprobs": tops + after["top_logprobs"]}
