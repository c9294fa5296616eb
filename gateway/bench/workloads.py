"""Workloads of ``kvgate bench``: deterministic request streams that exercise the KV cache.

Each workload is a function of a ``WorkloadSpec`` (seed included) that yields the same requests,
byte for byte, every time it is called, so ``--compare`` sends every target the same traffic. Every
request's text comes from its own ``random.Random`` seeded by (seed, workload, index), so a request
does not depend on how many were generated before it, and generation is lazy: a duration-bounded
run of a million requests never builds the ones it does not send.

Text is made of common lowercase English words separated by spaces, so every tokenizer counts it
sensibly (about one BPE token per word; two for kvgate's ``simple`` tokenizer, which counts the
spaces). Sizes are asked in tokens and turned into words with ``tokens_per_word``, which the CLI
measures on the target's ``/tokenize`` when it can. Unique texts start with a unique marker
(``Request 17.``), so two of them never share a KV block by accident; shared texts are identical
strings at the very start of the prompt, where prefix caching can find them.

The workloads, and what each is for:

* ``multiturn``: chat sessions that grow every turn (the previous answer and a new user message are
  appended, "slower with every turn"); sessions interleave turn by turn, each with its
  ``X-Session-ID``. The previous answer is a synthetic text of ``answer_tokens`` (so every target
  gets the same requests) unless the load generator is told to splice in the real answers.
* ``shared-prefix``: many users sharing a few long system prompts, each with a short unique
  question: the case prefix caching (and KV-aware routing) is made for.
* ``doc-qa``: a few long documents, many questions about each (document first, question last).
* ``mixed``: a flood of long and short unique prompts at a ratio: do short chats starve behind long
  prefills (the reason for pools)?
* ``sweep``: unique prompts of increasing length (2K, 4K, 8K, 16K ...), one phase per length, for
  the TTFT and TPOT vs prompt length curves of seed 000 section 5.1.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

WORKLOADS = ("multiturn", "shared-prefix", "doc-qa", "mixed", "sweep")
DEFAULT_REQUESTS = {"shared-prefix": 200, "doc-qa": 100, "mixed": 200}
"""Size of a workload of independent requests when no count is given."""

# Short, common words: one token each in the Llama/GPT BPE vocabularies (with the leading space).
WORDS = tuple(
    """the of and to in is was for on that with as by at from his her they this be are an
    or had not but what all were when we there can said which do their time if will way about
    many then them would like so these she long make thing see him two has look more day could
    go come did number sound no most people my over know water than call first who may down side
    been now find any new work part take get place made live where after back little only round
    man year came show every good me give our under name very through just form great think say
    help low line before turn cause same mean differ move right boy old too does tell sentence set
    three want air well also play small end put home read hand port large spell add even land
    here must big high such follow act why ask men change went light kind off need house picture
    try us again animal point mother world near build self earth father head stand own page should
    country found answer school grow study still learn plant cover food sun four thought let keep
    eye never last door between city tree cross since hard start might story saw far sea draw left
    late run while press close night real life few stop open seem together next white children
    begin got walk example ease paper often always music those both mark book letter until mile
    river car feet care second group carry took rain eat room friend began idea fish mountain
    north once base hear horse cut sure watch color face wood main enough plain girl usual young
    ready above ever red list though feel talk bird soon body dog family direct pose leave song
    measure state product black short numeral class wind question happen complete ship area half
    rock order fire south problem piece told knew pass farm top whole king size heard best hour
    better true during hundred am remember step early hold west ground interest reach fast five
    sing listen six table travel less morning ten simple several vowel toward war lay against
    pattern slow center love person money serve appear road map science rule govern pull cold
    notice voice fall power town fine certain fly unit lead cry dark machine note wait plan figure
    star box noun field rest correct able pound done beauty drive stood contain front teach week
    final gave green oh quick develop sleep warm free minute strong special mind behind clear tail
    produce fact street inch lot nothing course stay wheel full force blue object decide surface
    deep moon island foot yet busy test record boat common gold possible plane age dry wonder
    laugh thousand ago ran check game shape yes hot miss brought heat snow bed bring sit perhaps
    fill east weight language among""".split()
)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, independent of the API it is sent through."""

    index: int
    """Position in the workload (0-based); identical across targets."""
    group: str
    """What the report groups it under: ``turn-3``, ``long``, ``4096`` ..."""
    messages: tuple[Message, ...]
    """Chat messages; a completions request sends their contents joined by blank lines."""
    approx_prompt_tokens: int
    max_tokens: int
    session_id: str | None = None
    """Sent as ``X-Session-ID``."""
    prev: int | None = None
    """Index of the previous turn of the same session: sent only after that one finished."""
    new_messages: tuple[Message, ...] = ()
    """The messages this turn adds after the previous turn's answer (multiturn only)."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of every workload; each workload reads the ones it needs. Sizes in tokens."""

    name: str
    seed: int = 0
    requests: int | None = None
    """Number of requests (a cap for multiturn with explicit ``sessions`` and for sweep);
    None: the workload's default size."""
    max_tokens: int = 128
    tokens_per_word: float = 1.0
    # multiturn
    sessions: int | None = None
    """None: 16, or enough sessions for ``requests``."""
    turns: int = 8
    system_tokens: int = 200
    first_user_tokens: int = 300
    turn_user_tokens: int = 100
    answer_tokens: int | None = None
    """Synthetic answer length; None: ``max_tokens``."""
    # shared-prefix
    prefixes: int = 4
    prefix_tokens: int = 2000
    question_tokens: int = 64
    prefix_zipf_s: float = 0.0
    """Popularity of the prefixes: 0 uniform; s > 0 Zipf, prefix k (1-based) drawn with weight
    1/k^s (the routers benchmark's ``zipf_hot``)."""
    # doc-qa
    docs: int = 2
    doc_tokens: int = 8000
    # mixed
    long_tokens: int = 16000
    short_tokens: int = 200
    long_fraction: float = 0.1
    # sweep
    lengths: tuple[int, ...] = field(default=(2048, 4096, 8192, 16384))
    per_length: int = 5

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; one of {', '.join(WORKLOADS)}")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.tokens_per_word <= 0:
            raise ValueError("tokens_per_word must be > 0")
        if not 0.0 <= self.prefix_zipf_s <= 10.0:
            raise ValueError("prefix_zipf_s must be in [0, 10]")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")
        for name in ("turns", "prefixes", "docs", "per_length", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("lengths must be positive")


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    phases: tuple[tuple[str, int], ...]
    """(phase name, number of requests) in the order they run; only ``sweep`` has several."""

    @property
    def total(self) -> int:
        return sum(n for _, n in self.phases)

    def requests(self, phase: int = 0) -> Iterator[BenchRequest]:
        """The requests of one phase, generated lazily, identical on every call."""
        return _GENERATORS[self.spec.name](self.spec, phase, self._offset(phase),
                                           self.phases[phase][1])

    def all_requests(self) -> Iterator[BenchRequest]:
        for p in range(len(self.phases)):
            yield from self.requests(p)

    def _offset(self, phase: int) -> int:
        return sum(n for _, n in self.phases[:phase])


def build_workload(spec: WorkloadSpec) -> Workload:
    cap = spec.requests
    if spec.name == "sweep":
        phases = tuple((str(n), spec.per_length) for n in spec.lengths)
        if cap is not None:  # the cap bounds the whole sweep, earliest lengths first
            kept: list[tuple[str, int]] = []
            for name, n in phases:
                if cap <= 0:
                    break
                kept.append((name, min(n, cap)))
                cap -= n
            phases = tuple(kept)
        return Workload(spec, phases)
    if spec.name == "multiturn":
        natural = _sessions(spec) * spec.turns
        count = min(natural, cap) if cap is not None else natural
    else:  # independent requests: as many as asked
        count = cap if cap is not None else DEFAULT_REQUESTS[spec.name]
    return Workload(spec, ((spec.name, count),))


# -- text ------------------------------------------------------------------------------------------


def words(rng: random.Random, n_tokens: int, tokens_per_word: float) -> str:
    """About ``n_tokens`` tokens of words (at least one word)."""
    n = max(1, round(n_tokens / tokens_per_word))
    return " ".join(rng.choices(WORDS, k=n))


def calibration_text(n_words: int = 2000) -> str:
    """A fixed text of ``n_words`` words, to measure a tokenizer's tokens per word."""
    return " ".join(random.Random("kvgate-calibration").choices(WORDS, k=n_words))


def _rng(spec: WorkloadSpec, *key: object) -> random.Random:
    # String seeds hash with sha512: stable across runs and Python versions (unlike hash()).
    return random.Random(":".join(str(k) for k in (spec.seed, spec.name, *key)))


def _tokens(spec: WorkloadSpec, messages: tuple[Message, ...]) -> int:
    n_words = sum(len(m.content.split()) for m in messages)
    return round(n_words * spec.tokens_per_word)


# -- generators ------------------------------------------------------------------------------------


def _sessions(spec: WorkloadSpec) -> int:
    if spec.sessions is not None:
        return max(1, spec.sessions)
    if spec.requests is not None:
        return max(1, math.ceil(spec.requests / spec.turns))
    return 16


def _multiturn(spec: WorkloadSpec, phase: int, offset: int, n: int) -> Iterator[BenchRequest]:
    sessions = _sessions(spec)
    tpw = spec.tokens_per_word
    answer_tokens = spec.answer_tokens if spec.answer_tokens is not None else spec.max_tokens
    history: dict[int, tuple[Message, ...]] = {}
    messages: tuple[Message, ...]
    prev: int | None
    for i in range(n):
        turn, s = divmod(i, sessions)  # turn-major: every session's turn 1, then every turn 2 ...
        rng = _rng(spec, "session", s, "turn", turn)
        sid = f"bench-{spec.seed}-{s}"
        if turn == 0:
            system = Message("system", f"Session {s}. " + words(rng, spec.system_tokens, tpw))
            new = (Message("user", words(rng, spec.first_user_tokens, tpw)),)
            messages = (system, *new)
            prev = None
        else:
            answer = Message("assistant", words(rng, answer_tokens, tpw))
            new = (Message("user", words(rng, spec.turn_user_tokens, tpw)),)
            messages = (*history[s], answer, *new)
            prev = offset + i - sessions
        history[s] = messages
        yield BenchRequest(offset + i, f"turn-{turn + 1}", messages, _tokens(spec, messages),
                           spec.max_tokens, sid, prev, new)


def _shared_prefix(spec: WorkloadSpec, phase: int, offset: int, n: int) -> Iterator[BenchRequest]:
    tpw = spec.tokens_per_word
    prefixes = [
        Message("system", f"You are assistant {p}. " + words(_rng(spec, "prefix", p),
                                                             spec.prefix_tokens, tpw))
        for p in range(spec.prefixes)
    ]
    weights = ([1.0 / k ** spec.prefix_zipf_s for k in range(1, spec.prefixes + 1)]
               if spec.prefix_zipf_s > 0 else None)
    for i in range(n):
        rng = _rng(spec, "question", i)
        system = (prefixes[rng.randrange(spec.prefixes)] if weights is None
                  else rng.choices(prefixes, weights)[0])
        question = Message("user", f"Question {i}. " + words(rng, spec.question_tokens, tpw))
        messages = (system, question)
        yield BenchRequest(offset + i, spec.name, messages, _tokens(spec, messages),
                           spec.max_tokens)


def _doc_qa(spec: WorkloadSpec, phase: int, offset: int, n: int) -> Iterator[BenchRequest]:
    tpw = spec.tokens_per_word
    system = Message("system", "Answer the question about the document.")
    docs = [f"Document {d}. " + words(_rng(spec, "doc", d), spec.doc_tokens, tpw)
            for d in range(spec.docs)]
    for i in range(n):
        rng = _rng(spec, "question", i)
        doc = docs[i % spec.docs]
        question = f"Question {i}. " + words(rng, spec.question_tokens, tpw)
        messages = (system, Message("user", f"{doc}\n\n{question}"))
        yield BenchRequest(offset + i, spec.name, messages, _tokens(spec, messages),
                           spec.max_tokens)


def _mixed(spec: WorkloadSpec, phase: int, offset: int, n: int) -> Iterator[BenchRequest]:
    tpw = spec.tokens_per_word
    for i in range(n):
        rng = _rng(spec, "request", i)
        long = rng.random() < spec.long_fraction
        size = spec.long_tokens if long else spec.short_tokens
        messages = (Message("user", f"Request {i}. " + words(rng, size, tpw)),)
        yield BenchRequest(offset + i, "long" if long else "short", messages,
                           _tokens(spec, messages), spec.max_tokens)


def _sweep(spec: WorkloadSpec, phase: int, offset: int, n: int) -> Iterator[BenchRequest]:
    tpw = spec.tokens_per_word
    length = spec.lengths[phase]
    for j in range(n):
        i = offset + j
        rng = _rng(spec, "length", length, "request", j)
        messages = (Message("user", f"Request {i}. " + words(rng, length, tpw)),)
        yield BenchRequest(i, str(length), messages, _tokens(spec, messages), spec.max_tokens)


_GENERATORS = {
    "multiturn": _multiturn,
    "shared-prefix": _shared_prefix,
    "doc-qa": _doc_qa,
    "mixed": _mixed,
    "sweep": _sweep,
}
