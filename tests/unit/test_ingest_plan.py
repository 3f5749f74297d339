"""What an ingest reads (app.data.plan): from the ledger's end, or from the log start where the
topic's retention deleted records no ingest read; what was lost is reported, or fails --strict."""

from __future__ import annotations

import logging

import pytest

from app.data.plan import plan, report_lost
from app.data.probe import PartitionEnds


def test_reads_from_the_ledger_end_to_the_proven_end_and_drops_partitions_with_nothing_new():
    probed = {0: PartitionEnds(0, 50, 50), 1: PartitionEnds(0, 20, 19), 2: PartitionEnds(0, 7, 7)}
    pending = plan({0: 30, 1: 0, 2: 7}, probed, {0: 123})
    assert pending.ranges == {0: (30, 50), 1: (0, 20)} and pending.lost == {}
    assert pending.visible_ends == {0: 50, 1: 19} and pending.watermarks == {0: 123}


def test_records_retention_deleted_unread_are_lost_and_reading_starts_at_the_log_start():
    probed = {0: PartitionEnds(40, 50, 50), 1: PartitionEnds(25, 25, 25), 2: PartitionEnds(5, 9, 9)}
    pending = plan({0: 30, 1: 10, 2: 6}, probed, {})
    assert pending.ranges == {0: (40, 50), 1: (25, 25), 2: (6, 9)}  # partition 1: all of it lost
    assert pending.lost == {0: 10, 1: 15}


def test_lost_records_are_an_error_line_or_with_strict_a_failure(caplog):
    pending = plan({0: 30}, {0: PartitionEnds(40, 50, 50)}, {})
    with caplog.at_level(logging.ERROR, logger="app.data.plan"):
        report_lost("t", pending, strict=False)
    assert (
        "10 records of t were deleted by the topic's retention" in caplog.text and "p0:[30,40)" in caplog.text
    )
    with pytest.raises(RuntimeError, match=r"p0:\[30,40\)\); --strict: nothing written"):
        report_lost("t", pending, strict=True)
