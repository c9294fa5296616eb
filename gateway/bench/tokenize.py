"""Benchmark: the cost of step 2 (tokenizing a prompt exactly as vLLM does) at 1K-128K tokens.

For each target length it builds a chat prompt of that many tokens and times ``encode_chat``
(chat template render + encode) with ``time.perf_counter``: median and p90 of ``--repeats`` runs.
The gateway tokenizes every request, so this is the floor of its per-request CPU cost for long
prompts; the issue's budget is "well under 50 ms" at 32K tokens.

Run: ``python -m gateway.bench.tokenize --tokenizer .cache/tiny-llama [--out results/tokenize]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from gateway.prompt.tokenizer import PromptTokenizer, load_tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jumping frogs near an old river bank in late autumn light").split()


def prompt_of(tokenizer: PromptTokenizer, target_tokens: int) -> list[dict[str, str]]:
    """A one-message chat whose rendered prompt has about ``target_tokens`` tokens."""
    words = 64
    while True:
        text = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(words))
        n = len(tokenizer.encode_chat([{"role": "user", "content": text}], {}))
        if n >= target_tokens:
            return [{"role": "user", "content": text}]
        words = max(words + 1, int(words * target_tokens / n * 1.02))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=".cache/tiny-llama")
    parser.add_argument("--lengths", default="1024,8192,32768,131072")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/tokenize")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for source in (args.tokenizer, "simple"):
        tok = load_tokenizer(source)
        for target in (int(x) for x in args.lengths.split(",")):
            messages = prompt_of(tok, target)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                n = len(tok.encode_chat(messages, {}))
                times.append((time.perf_counter() - t0) * 1000)
            times.sort()
            rows.append({"tokenizer": source, "tokens": n,
                         "median_ms": statistics.median(times),
                         "p90_ms": times[int(len(times) * 0.9) - 1]})
    print(f"{'tokenizer':<24}{'tokens':>10}{'median ms':>12}{'p90 ms':>10}")
    for r in rows:
        print(f"{r['tokenizer'][-24:]:<24}{r['tokens']:>10}{r['median_ms']:>12.2f}"
              f"{r['p90_ms']:>10.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenize.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
