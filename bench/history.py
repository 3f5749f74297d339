"""The Iceberg table's costs (#25).

1. History: planning as the table's history grows. The next ingest's start
   (`ImageTable.committed`), a reader's file list for the current snapshot (train's plan) and one
   more commit, after 10, 1,000 and 10,000 commits, with the table's upkeep
   (`app.data.maintenance`: compaction and expiry every --upkeep-every commits, as `watch` runs it
   with its defaults: snapshots older than a week or beyond the newest --keep-snapshots expire)
   against the same history without upkeep (the plain baseline: PyIceberg's defaults, every
   snapshot kept). The baseline stops at --baseline-max commits: without expiry each commit
   rewrites a metadata file holding every earlier snapshot, so building its history grows
   quadratically. Goal: with upkeep, planning at the largest size ≤ 1.5× planning at 10 commits.
2. Write: the same preprocessed rows (--write-image-size px, default 224; --write-rows per commit)
   committed to the table (`ImageTable.commit`: Parquet files by event date, then one catalog
   commit with the offsets) against a plain `pyarrow.parquet.write_to_dataset` partitioned by
   event date, alternating, --repeats rounds. Goal: the table's rows/s ≥ 0.8× the plain write's
   at the largest size (a bulk ingest's one commit); the smaller size shows a commit's fixed cost.

    .venv/bin/python bench/history.py                       # 10 / 1,000 / 10,000 commits, local disk
    .venv/bin/python bench/history.py --sizes 10,300        # quicker
    .venv/bin/python bench/history.py --s3                  # the warehouse on a moto S3 server here
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app.data.maintenance import compact, expire
from app.data.table import ImageTable
from app.data.watch import WatchConfig

import _common as common  # (puts the project on sys.path first)

TOPIC = "behavior-images"
WATCH = WatchConfig()
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
            compact(table)  # what `watch`'s upkeep runs, with its defaults
            expire(table, older_than_s=WATCH.expire_after_s, max_snapshots=WATCH.keep_snapshots)


def measure(table: ImageTable) -> dict[str, float]:
    committed = table.committed()[0]
    plan = median_s(table.committed)
    files = median_s(lambda: table.data_file_uris(table.current_snapshot_id()))
    started = time.perf_counter()
    table.commit(rows(committed), {0: (committed, committed + 1)}, 0, TOPIC)
    return {"ingest plan": plan, "train plan": files, "commit": time.perf_counter() - started}


def open_table(root: str, name: str, catalog_dir: str) -> ImageTable:
    """A fresh table under `root` (local or s3://), its SQLite catalog in `catalog_dir`."""
    if "://" not in root:
        return ImageTable.at(f"{root}/{name}")
    return ImageTable.at(f"{root}/{name}", catalog=f"sqlite:///{catalog_dir}/{name}.db")


def write_rows(count: int, first_offset: int, size: int = 32) -> pa.Table:
    """`count` preprocessed `size` px records over two event dates."""
    offsets = np.arange(first_offset, first_offset + count)
    rng = np.random.default_rng(first_offset)
    return pa.table(
        {
            "kafka_partition": pa.array(np.zeros(count), pa.int32()),
            "kafka_offset": pa.array(offsets, pa.int64()),
            "user_id": [f"user-{o % 97}" for o in offsets],
            "label": ["tap"] * count,
            "event_time_ms": pa.array(T0 + (offsets % 2) * 86_400_000, pa.int64()),
            "device_id": ["device-0"] * count,
            "pixels": [rng.integers(0, 256, size * size * 3, dtype=np.uint8).tobytes() for _ in offsets],
            "height": pa.array(np.full(count, size), pa.int32()),
            "width": pa.array(np.full(count, size), pa.int32()),
        }
    )


def write_part(args, root: str, catalog_dir: str) -> str:
    """Part 2: rows/s of table commits vs a plain partitioned Parquet write of the same rows, at
    each of --write-rows per commit. The goal is judged at the largest: a bulk ingest commits once
    for all it read, and a commit's fixed cost (manifest, manifest list, metadata file, the
    catalog's swap: ~25-35 ms here) is what the smaller sizes show."""
    import pyarrow.fs as pafs

    ratios = {}
    for count in (int(c) for c in args.write_rows.split(",")):
        table = open_table(root, f"write-{count}", catalog_dir)
        plain_fs, plain_root = pafs.FileSystem.from_uri(
            f"{root}/plain-{count}" if "://" in root else f"file://{root}/plain-{count}"
        )
        batches = [write_rows(count, i * count, args.write_image_size) for i in range(args.repeats)]
        state = {"table": 0, "plain": 0}

        def to_table() -> dict:
            rows = batches[state["table"]]
            start = state["table"] * count
            began = time.perf_counter()
            table.commit(rows, {0: (start, start + rows.num_rows)}, 0, TOPIC)
            state["table"] += 1
            return {"rows_per_s": rows.num_rows / (time.perf_counter() - began)}

        def to_plain() -> dict:
            rows = batches[state["plain"]]
            began = time.perf_counter()
            dates = pc.cast(pc.cast(rows.column("event_time_ms"), pa.timestamp("ms", tz="UTC")), pa.date32())
            pq.write_to_dataset(
                rows.append_column("event_date", dates),
                plain_root,
                partition_cols=["event_date"],
                filesystem=plain_fs,
                basename_template=f"part-{state['plain']}-{{i}}.parquet",
            )
            state["plain"] += 1
            return {"rows_per_s": rows.num_rows / (time.perf_counter() - began)}

        runs = common.alternate({"table": to_table, "plain": to_plain}, args.repeats, f"write {count}")
        mine = common.median_of(runs["table"], "rows_per_s")
        plain = common.median_of(runs["plain"], "rows_per_s")
        ratios[count] = mine / plain
        print(
            f"write of {count} rows ({args.write_image_size} px) per commit: table {mine:.0f} rows/s, "
            f"plain {plain:.0f} rows/s, {ratios[count]:.2f}×"
        )
    largest = max(ratios)
    return common.goal_line(
        f"table commit rows/s vs plain write_to_dataset at {largest} rows a commit", ratios[largest], 0.8
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,1000,10000", help="history lengths, ascending")
    parser.add_argument("--upkeep-every", type=int, default=100)
    parser.add_argument("--baseline-max", type=int, default=1000)
    parser.add_argument("--write-rows", default="500,2000", help="rows per commit in part 2, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of part 2")
    parser.add_argument(
        "--write-image-size", type=int, default=224, help="image side of part 2's rows (Argus's default)"
    )
    parser.add_argument("--s3", action="store_true", help="the warehouse on a moto S3 server started here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="history-") as local:
        if args.s3:
            with common.s3_storage(None) as root:
                run(args, root, local)
        else:
            run(args, local, local)


def run(args, root: str, catalog_dir: str) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"storage: {root}")
    write_goal = write_part(args, root, catalog_dir)

    results: dict[str, dict[int, dict[str, float]]] = {"upkeep": {}, "plain": {}}
    for name, upkeep_every in (("upkeep", args.upkeep_every), ("plain", None)):
        table = open_table(root, f"history-{name}", catalog_dir)
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
    print(write_goal)


if __name__ == "__main__":
    main()
