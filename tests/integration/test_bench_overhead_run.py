"""The overhead benchmark run end to end on a small scale: kvgate and the two floors against
direct, one short round, with a flame graph of kvgate (``--profile``)."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.bench.overhead.cli import main


def test_one_short_round_measures_kvgate_beside_direct_and_writes_its_flame_graph(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    rc = main(["--case", "short", "--target", "kvgate_rr_simple_p1", "--target", "python_floor",
               "--target", "kvgate_plumbing", "--duration-s", "1",
               "--rounds", "1", "--out", str(tmp_path), "--profile", str(tmp_path / "prof")],
              say=lines.append)
    assert rc == 0, "\n".join(lines)
    record = json.loads((tmp_path / "overhead.json").read_text())
    (case,) = record["cases"]
    summaries = {s["target"]: s for s in case["summaries"]}
    assert set(summaries) == {"direct", "kvgate_rr_simple_p1", "python_floor",
                              "kvgate_plumbing"}, case["skipped"]
    for name in ("kvgate_rr_simple_p1", "python_floor", "kvgate_plumbing"):
        measured = summaries[name]
        assert measured["requests_per_s"] > 0 and measured["errors"] == 0, name
        assert measured["router_cpu_us_per_request"] > 0, name
    # only kvgate is profiled: the floors are references, not the product
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "profile_short_kvgate_rr_simple_p1.svg"]
    svg = (tmp_path / "prof" / "profile_short_kvgate_rr_simple_p1.svg").read_text()
    assert svg.lstrip().startswith(("<?xml", "<svg")) and "dispatch" in svg
    assert (tmp_path / "overhead.png").stat().st_size > 0
