"""Planning cost as the Iceberg table's history grows (#25): the next ingest's start
(`ImageTable.committed`), a reader's file list for the current snapshot (train's plan) and one
more commit, after 10, 1,000 and 10,000 commits, with the table's upkeep (`app.data.maintenance`:
compaction and expiry every --upkeep-every commits, as `watch` will run it) against the same
history without upkeep (the plain baseline: PyIceberg's defaults, every snapshot kept).

    .venv/bin/python bench/history.py                       # 10 / 1,000 / 10,000 commits, local disk
    .venv/bin/python bench/history.py --sizes 10,300        # quicker

The baseline stops at --baseline-max commits: without expiry each commit rewrites a metadata file
holding every earlier snapshot, so building its history grows quadratically.
Goal: with upkeep, planning at the largest size ≤ 1.5× planning at 10 commits.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

from app.data.maintenance import compact, expire
from app.data.table import ImageTable

import _common  # noqa: F401  (puts the project on sys.path)

TOPIC = "behavior-images"
T0 = 1_767_225_600_000


def rows(offset: int) -> pa.Table:
    """One record: what a `watch` part of a quiet minute holds."""
    return pa.table(
        {
            "kafka_partition": pa.array([0], pa.int32()),
            "kafka_offset": pa.array([offset], pa.int64()),
            "user_id": [f"user-{offset % 97}"],
            "label": ["tap"],
            "event_time_ms": pa.array([T0 + offset * 60_000], pa.int64()),  # a part a minute
            "device_id": ["device-0"],
            "pixels": [np.full(8 * 8 * 3, offset % 256, np.uint8).tobytes()],
            "height": pa.array([8], pa.int32()),
            "width": pa.array([8], pa.int32()),
        }
    )


def median_s(action, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def grow(table: ImageTable, start: int, end: int, upkeep_every: int | None) -> None:
    for offset in range(start, end):
        table.commit(rows(offset), {0: (offset, offset + 1)}, 0, TOPIC)
        if upkeep_every and (offset + 1) % upkeep_every == 0:
            compact(table)
            expire(table, older_than_s=0)


def measure(table: ImageTable) -> dict[str, float]:
    committed = table.committed()[0]
    plan = median_s(table.committed)
    files = median_s(lambda: table.data_file_uris(table.current_snapshot_id()))
    started = time.perf_counter()
    table.commit(rows(committed), {0: (committed, committed + 1)}, 0, TOPIC)
    return {"ingest plan": plan, "train plan": files, "commit": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,1000,10000", help="history lengths, ascending")
    parser.add_argument("--upkeep-every", type=int, default=100)
    parser.add_argument("--baseline-max", type=int, default=1000)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    results: dict[str, dict[int, dict[str, float]]] = {"upkeep": {}, "plain": {}}
    for name, upkeep_every in (("upkeep", args.upkeep_every), ("plain", None)):
        with tempfile.TemporaryDirectory(prefix=f"history-{name}-") as storage:
            table = ImageTable.at(storage)
            built = 0
            for size in sizes:
                if name == "plain" and size > args.baseline_max:
                    break
                started = time.perf_counter()
                grow(table, built, size, upkeep_every)
                built = size + 1  # measure() commits one more
                results[name][size] = measure(table)
                snapshots = len(table.load().snapshots())
                print(
                    f"{name:>6} {size:>6} commits ({snapshots} snapshots kept, built in "
                    f"{time.perf_counter() - started:.0f} s): "
                    + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in results[name][size].items()),
                    flush=True,
                )

    first, last = sizes[0], sizes[-1]
    for step in ("ingest plan", "train plan", "commit"):
        ratio = results["upkeep"][last][step] / results["upkeep"][first][step]
        line = f"{step}: {first} → {last} commits with upkeep {ratio:.2f}×"
        plain = max(results["plain"])
        if plain > first:
            growth = results["plain"][plain][step] / results["plain"][first][step]
            line += f"; plain {first} → {plain}: {growth:.2f}×"
        print(line)
    worst = max(
        results["upkeep"][last][s] / results["upkeep"][first][s] for s in ("ingest plan", "train plan")
    )
    print(
        f"goal: planning at {last} commits ≤ 1.5× at {first}, with upkeep: {worst:.2f}× "
        f"({'PASS' if worst <= 1.5 else 'MISS'})"
    )


if __name__ == "__main__":
    main()
