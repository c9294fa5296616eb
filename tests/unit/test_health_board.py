"""The leader's health board: what a follower replays of the leader's checks, and the file."""

from __future__ import annotations

from pathlib import Path

from gateway.workers.health_board import HealthBoard, WorkerReport
from gateway.workers.worker import VllmStats


def checked(*results: bool) -> WorkerReport:
    report = WorkerReport()
    for ok in results:
        report = report.checked(ok)
    return report


def test_streak_counts_the_last_results_of_one_kind() -> None:
    report = checked(True, False, False, True, True, True)
    assert (report.checks, report.ok, report.streak) == (6, True, 3)
    assert checked(False).streak == 1


def test_a_follower_replays_exactly_the_checks_it_has_not_seen_when_within_the_streak() -> None:
    report = checked(False, True, True)
    assert report.results_since(1, cap=10) == [True, True]
    assert report.results_since(3, cap=10) == []


def test_checks_before_the_streak_are_replayed_as_the_opposite_result_capped() -> None:
    report = checked(True, True, False, False, True)
    assert report.results_since(0, cap=3) == [False, False, False, True]
    assert report.results_since(0, cap=1) == [False, True]


def test_a_report_survives_the_file_and_a_follower_reads_each_version_once(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    leader, follower = HealthBoard(path, leader=True), HealthBoard(path, leader=False)
    assert follower.read_if_changed() is None  # no round yet
    report = WorkerReport(checks=3, ok=True, streak=2, models=frozenset({"m"}), models_read=True,
                          scrapes=1, stats=VllmStats(running=2, block_size_tokens=16))

    leader.publish({"http://w:1": report})
    board = follower.read_if_changed()

    assert board is not None
    assert (board.generation, board.workers) == (leader.generation, {"http://w:1": report})
    assert follower.read_if_changed() is None
    leader.publish({"http://w:1": report.checked(True)})
    again = follower.read_if_changed()
    assert again is not None and again.workers["http://w:1"].checks == 4
