"""Benchmark: the cost of step 2 (tokenizing a prompt exactly as vLLM does), whole and incremental.

Two measurements, one run:

* **sweep**: a one-message chat of 1K-128K tokens, rendered and encoded whole (``encode_chat``
  with the segment cache off), for the HF tokenizer and the simple one: the cost of a prompt
  the gateway has never seen;
* **turn N**: a conversation of ``--turn-tokens`` tokens (alternating user/assistant messages of
  ~1K tokens) plus one new user message, as turn N of that conversation arrives after turn N-1
  was tokenized. Whole-prompt encoding against incremental encoding
  (``gateway.prompt.segments``: only the new message is encoded), each new message different,
  and their ids compared on every repetition that ran both; also the incremental encoder's first
  sight of the conversation (empty cache), which must cost no more than whole encoding.

Times are ``time.perf_counter`` around ``encode_chat`` (render + encode), p50/p99 over the
repetitions; ratios matter more than absolute times on a shared machine. The issue's target:
turn N of a 128K-token conversation in <= 3 ms p99.

Run: ``python -m gateway.bench.tokenize --tokenizer .cache/tiny-llama [--out results/tokenize]``;
prints tables, writes ``tokenize.json`` and ``tokenize.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.bench.stats import Distribution, distribution
from gateway.prompt.tokenizer import HFTokenizer, PromptTokenizer, SimpleTokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jumping frogs near an old river bank in late autumn light").split()

Chat = list[dict[str, str]]


def text_of(words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + str((i + seed) % 97) for i in range(words))


def prompt_of(tokenizer: PromptTokenizer, target_tokens: int) -> Chat:
    """A one-message chat whose rendered prompt has about ``target_tokens`` tokens."""
    words = 64
    while True:
        text = text_of(words)
        n = len(tokenizer.encode_chat([{"role": "user", "content": text}], {}))
        if n >= target_tokens:
            return [{"role": "user", "content": text}]
        words = max(words + 1, int(words * target_tokens / n * 1.02))


def conversation_of(tokenizer: PromptTokenizer, target_tokens: int,
                    message_tokens: int = 1024) -> Chat:
    """Alternating user/assistant messages, all different, of about ``target_tokens`` in all."""
    per_word = len(tokenizer.encode_text(text_of(1000), False)) / 1000
    words = max(1, int(message_tokens / per_word))
    count = max(1, round(target_tokens / message_tokens))
    return [{"role": ("user", "assistant")[i % 2], "content": text_of(words, seed=i)}
            for i in range(count)]


@dataclass(frozen=True)
class Timing:
    case: str
    tokens: int
    ms: Distribution


def _time(case: str, jobs: Sequence[tuple[PromptTokenizer, Chat]]) -> tuple[Timing, list[list[int]]]:
    """Each job's ``encode_chat`` timed in turn; the timings and the ids."""
    times, results = [], []
    for tok, messages in jobs:
        start = time.perf_counter()
        results.append(tok.encode_chat(messages, {}))
        times.append((time.perf_counter() - start) * 1000)
    ms = distribution(times)
    assert ms is not None
    return Timing(case, len(results[-1]), ms), results


def sweep(tokenizers: dict[str, PromptTokenizer], lengths: list[int],
          repeats: int) -> list[Timing]:
    return [_time(f"{name} whole", [(tok, prompt_of(tok, target))] * repeats)[0]
            for name, tok in tokenizers.items() for target in lengths]


def turn_n(hf: Any, source: str, target_tokens: int, repeats: int,
           whole_repeats: int) -> tuple[list[Timing], bool]:
    """Rows (whole, incremental cold, incremental turn N) and whether every compared id matched."""
    whole = HFTokenizer(source, hf, segment_cache_tokens=0)
    history = conversation_of(whole, target_tokens)

    def turn(i: int) -> Chat:
        return [*history, {"role": "user", "content": f"question {i}: " + text_of(80, seed=i)}]

    # A new encoder (an empty cache) for each: the gateway's first sight of a conversation.
    cold = [(HFTokenizer(source, hf), turn(-1 - i)) for i in range(min(whole_repeats, 5))]
    cold_row = _time("incremental, empty cache", cold)[0]
    incremental = HFTokenizer(source, hf)
    incremental.encode_chat(history, {})  # turn N-1 tokenized the conversation so far
    inc_row, inc_ids = _time("incremental, turn N",
                             [(incremental, turn(i)) for i in range(repeats)])
    whole_row, whole_ids = _time("whole prompt", [(whole, turn(i)) for i in range(whole_repeats)])
    identical = all(a == b for a, b in zip(inc_ids, whole_ids, strict=False))
    return [whole_row, cold_row, inc_row], identical


def _print(title: str, rows: list[Timing]) -> None:
    print(f"\n{title}\n{'case':<36}{'tokens':>10}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for r in rows:
        print(f"{r.case[-36:]:<36}{r.tokens:>10}{r.ms.count:>6}{r.ms.p50:>10.2f}{r.ms.p99:>10.2f}")


def _plot(sweep_rows: list[Timing], turn_rows: list[Timing], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for case in dict.fromkeys(r.case for r in sweep_rows):
        rows = [r for r in sweep_rows if r.case == case]
        left.plot([r.tokens for r in rows], [r.ms.p50 for r in rows], marker="o", label=case)
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="p50 ms",
             title="one new prompt, whole encoding")
    left.legend(fontsize=8)
    x = range(len(turn_rows))
    right.bar([i - 0.2 for i in x], [r.ms.p50 for r in turn_rows], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [r.ms.p99 for r in turn_rows], 0.4, label="p99")
    right.axhline(3.0, color="red", linewidth=0.8, linestyle="--", label="target p99 3 ms")
    right.set_xticks(list(x), [r.case for r in turn_rows], fontsize=8)
    right.set(yscale="log", ylabel="ms",
              title=f"turn N of a {turn_rows[0].tokens}-token conversation")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=".cache/tiny-llama")
    parser.add_argument("--lengths", default="1024,8192,32768,131072")
    parser.add_argument("--repeats", type=int, default=15, help="per sweep length")
    parser.add_argument("--turn-tokens", type=int, default=131072)
    parser.add_argument("--turn-repeats", type=int, default=200,
                        help="incremental turns timed (each with a new user message)")
    parser.add_argument("--whole-repeats", type=int, default=30,
                        help="whole-prompt turns timed and compared id for id")
    parser.add_argument("--out", default="results/tokenize")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizers: dict[str, PromptTokenizer] = {
        args.tokenizer: HFTokenizer(args.tokenizer, hf, segment_cache_tokens=0),
        "simple": SimpleTokenizer(),
    }
    sweep_rows = sweep(tokenizers, [int(x) for x in args.lengths.split(",")], args.repeats)
    turn_rows, identical = turn_n(hf, args.tokenizer, args.turn_tokens, args.turn_repeats,
                                  args.whole_repeats)

    _print("one new prompt, encoded whole", sweep_rows)
    _print(f"turn N of a conversation ({args.tokenizer})", turn_rows)
    whole, inc = turn_rows[0], turn_rows[-1]
    print(f"whole / incremental: p50 {whole.ms.p50 / inc.ms.p50:.0f}x, "
          f"p99 {whole.ms.p99 / inc.ms.p99:.0f}x; ids identical: {identical}; "
          f"target p99 <= 3 ms: {'met' if inc.ms.p99 <= 3.0 else 'MISSED'}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenize.json").write_text(json.dumps({
        "tokenizer": args.tokenizer,
        "sweep": [asdict(r) for r in sweep_rows],
        "turn_n": {"rows": [asdict(r) for r in turn_rows], "ids_identical": identical},
    }, indent=2))
    _plot(sweep_rows, turn_rows, out / "tokenize.png")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
