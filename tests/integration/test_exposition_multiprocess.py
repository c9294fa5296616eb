"""gateway.exposition in multiprocess mode: a departed worker's series leave /metrics although its
values stay in the files.

prometheus-client picks its value class (memory or mmap'd file) once, at import, from
``PROMETHEUS_MULTIPROC_DIR``; so each "gateway process" here is a real Python process given that
directory, as the supervisor's children are.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from gateway.exposition import MULTIPROCESS_DIR_ENV
from gateway.procs.process import child_env

PRELUDE = """
from prometheus_client import CollectorRegistry
from gateway.exposition import MultiProcessExposition
from gateway.metrics import Metrics
import os
from pathlib import Path
m = Metrics(CollectorRegistry())
for url in ("http://w1", "http://w2"):
    m.add_worker("p", url)
    m.child(m.requests, "p", url, "200").inc()
    m.child(m.ttft, "p", url).observe(0.1)
    m.child(m.worker_inflight, "p", url).set(1)
    m.worker_up.labels("p", url).set(1)
"""


def run_process(directory: Path, code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=child_env({MULTIPROCESS_DIR_ENV: str(directory)}),
        capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout


def test_departed_worker_leaves_every_process_metrics_though_its_values_stay_in_the_files(
    tmp_path: Path,
) -> None:
    """Regression: removal does not reach prometheus-client's multiprocess files, so with
    ``--processes N`` a removed worker's series, counters of dead processes included, stayed."""
    run_process(tmp_path, "")  # a process that served both workers and has since died
    body = run_process(tmp_path, """
        m.forget_worker("p", "http://w1")
        m.child(m.requests, "p", "http://w1", "200").inc()  # a request still finishing there
        print(MultiProcessExposition(m, Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])).render()
              .decode())
    """)

    assert 'worker="http://w1"' not in body
    # the other worker's counters still sum over both processes, the dead one included
    assert 'kvgate_requests_total{code="200",pool="p",worker="http://w2"} 2.0' in body
    assert 'kvgate_ttft_seconds_count{pool="p",worker="http://w2"} 2.0' in body
    assert 'kvgate_worker_up{pool="p",worker="http://w2"} 1.0' in body


def test_worker_back_under_the_same_url_continues_its_counters_in_multiprocess_mode(
    tmp_path: Path,
) -> None:
    body = run_process(tmp_path, """
        m.forget_worker("p", "http://w1")
        m.add_worker("p", "http://w1")
        m.child(m.requests, "p", "http://w1", "200").inc()
        print(MultiProcessExposition(m, Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])).render()
              .decode())
    """)

    # the file kept 1, the new child continues from it: never backwards for rate()
    assert 'kvgate_requests_total{code="200",pool="p",worker="http://w1"} 2.0' in body
