"""Ingest's live progress lines: the records the snapshot's finished Parquet files hold so far."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.parquet as pq

from app.data.ingest import progress_lines
from app.storage import Store


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ingest: ")]


def _wait_for(caplog, text: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in _lines(caplog)):
        assert time.monotonic() < deadline, _lines(caplog)
        time.sleep(0.02)


def test_progress_counts_the_rows_of_each_file_once_as_files_appear(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="app.data.ingest")
    snapshot = tmp_path / "snap-1"  # not there yet when ingest starts writing
    with progress_lines(Store.at(str(snapshot)), offsets=50, interval_s=0.05):
        _wait_for(caplog, "0 of 50 offsets")
        (snapshot / "event_date=2026-12-01").mkdir(parents=True)
        pq.write_table(
            pa.table({"offset": list(range(20))}), snapshot / "event_date=2026-12-01/part-a-0000.parquet"
        )
        _wait_for(caplog, "20 of 50 offsets")
        (snapshot / "event_date=2026-12-01/part-a-0000.parquet.tmp").write_bytes(b"not parquet")
        pq.write_table(
            pa.table({"offset": list(range(25))}), snapshot / "event_date=2026-12-01/part-b-0000.parquet"
        )
        _wait_for(caplog, "45 of 50 offsets")
    stopped = len(_lines(caplog))
    time.sleep(0.2)
    assert len(_lines(caplog)) == stopped  # the block's end stops the lines


def test_an_unreadable_file_costs_lines_until_it_reads_never_the_block(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="app.data.ingest")
    (tmp_path / "part-a-0000.parquet").write_bytes(b"half a file")
    with progress_lines(Store.at(str(tmp_path)), offsets=10, interval_s=0.05):
        time.sleep(0.3)
        assert _lines(caplog) == []
        pq.write_table(pa.table({"offset": list(range(10))}), tmp_path / "part-a-0000.parquet")
        _wait_for(caplog, "10 of 10 offsets")
