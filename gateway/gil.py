"""Giving the event loop the GIL back while a tokenizing thread works (issue 11, isolation).

A long prompt is tokenized in a thread (``gateway.prompt.pool``), and the tokenizer's Rust
encoding runs without the GIL; what comes after it does not: the ids turned into Python ints
(``SegmentEncoder``), packed and hashed block by block (``PrefixIndex.hash_ahead``), ~10 ms of
GIL for a 128K-token prompt. The event loop that wants the GIL meanwhile waits, and so does every
short chat on it. Two things bound that wait:

- ``SWITCH_INTERVAL_S``: a thread waiting for the GIL asks its holder to drop it after this long
  (CPython's ``sys.setswitchinterval``, 5 ms by default). The holder drops it at its next check:
  interpreted code checks between bytecodes, compiled code (``gateway._native``) and a C call
  only where they block or call back into Python.
- ``yield_gil`` between slices of a long piece of work in a thread: a point where the holder
  blocks for no time, so a drop asked for is honoured there, also in compiled code. Without one,
  the 8,150 block hashes of a 128K-token prompt ran as one compiled loop holding the GIL ~4 ms.

With both, the loop waits about one interval plus one slice. When no thread works, neither costs
anything: the interval only matters to a thread that waits for the GIL. Measured with
``python -m gateway.bench.overhead --case isolation`` (README, "Isolation").
"""

from __future__ import annotations

import sys
import time
from typing import Final

SWITCH_INTERVAL_S: Final = 0.0005
"""The GIL switch interval of a gateway process (``install``)."""

SLICE_ITEMS: Final = 32_768
"""Ids turned into shared ints per GIL slice (``SegmentEncoder``): ~0.3 ms."""

SLICE_BLOCKS: Final = 256
"""Blocks hashed per GIL slice (``PrefixIndex.hash_ahead``): ~0.15 ms compiled, 0.4 from source."""


def install() -> None:
    """Set the process's GIL switch interval (a gateway process, at start)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def yield_gil() -> None:
    """Release the GIL for no time: a thread waiting for it (the event loop) that asked for it
    takes it here."""
    time.sleep(0)
