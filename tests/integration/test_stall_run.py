"""``scripts/stall_run.py``: pytest runs under stalls of its whole process tree, a test's own stopped
process stays stopped, and the tool answers pytest's exit code and summary."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A process that sees a stall: it exits 0 once its clock jumps by at least 0.5 s between two of its
# 10-ms steps (it was stopped), 1 if that never happens within 120 s.
SEES_STALL = textwrap.dedent("""
    import sys, time
    last = time.monotonic()
    end = last + 120
    while last < end:
        time.sleep(0.01)
        now = time.monotonic()
        if now - last >= 0.5:
            sys.exit(0)
        last = now
    sys.exit(1)
""")

MODULE = textwrap.dedent(f"""
    import os, signal, subprocess, sys

    SEES_STALL = {SEES_STALL!r}

    def test_a_child_process_is_stalled():
        assert subprocess.run([sys.executable, "-c", SEES_STALL], timeout=300).returncode == 0

    def test_a_process_the_test_stopped_stays_stopped():
        sleeper = subprocess.Popen(["sleep", "600"])
        try:
            os.kill(sleeper.pid, signal.SIGSTOP)
            while open(f"/proc/{{sleeper.pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                pass
            # Stalls pass over both (this process sees one in its child) ...
            for _ in range(2):
                assert subprocess.run([sys.executable, "-c", SEES_STALL],
                                      timeout=300).returncode == 0
            # ... and the sleeper is still stopped: the tool did not continue it.
            state = open(f"/proc/{{sleeper.pid}}/stat").read().rsplit(")", 1)[1].split()[0]
            assert state == "T"
        finally:
            sleeper.kill()
            sleeper.wait()

    def test_fails():
        assert False
""")


def test_stall_run_stalls_the_tree_keeps_stopped_processes_and_answers_pytests_exit(
        tmp_path: Path) -> None:
    (tmp_path / "test_stalled.py").write_text(MODULE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stall_run.py"), "--stall-s", "0.7",
         "--every-s", "0.2-0.5", "--seed", "7", "test_stalled.py", "--", "-p", "no:cacheprovider"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # pytest's: one test fails on purpose
    assert "2 passed" in out and "1 failed" in out, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("stall_run:")]
    assert "seed 7 target tree" in line and "1 failed, 2 passed" in line, line
    stalls = int(line.split(": ", 2)[2].split()[0])
    assert stalls >= 3, line
