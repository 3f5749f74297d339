"""Ingest benchmarks (issue #3): Kafka read throughput, preprocessing images/s, streaming memory.

    .venv/bin/python bench/ingest.py                      # small defaults, a few minutes on 2 cores
    .venv/bin/python bench/ingest.py --records 50000 --pre-images 30000 --full-memory

1. read: probe the true ends + ingest's Ray Data read (`read_ranges` in `streaming_blocks`) iterated
   to the driver, vs a raw confluent-kafka consume loop over the same partitions and offset ranges
   (one consumer, counting records and value bytes). Also, for diagnosis, the app's own
   `read_partition_range` called partition by partition in this process. Goal ≥ 0.9×.
2. preprocess: the `Preprocessor` UDF in the `map_batches` actor pool `ingest` builds
   (`app.data.preprocess.preprocess_batches`: batch 64, from 1 up to one actor per CPU, 1 decode thread each;
   and, for reference, the previous default of 1 actor decoding in 2 threads), vs a plain
   `multiprocessing.Pool(2)` decoding with Pillow, resizing (bilinear, antialiased) and
   normalising with numpy, over the same encoded images: Ray's input blocks already in the object
   store (where ingest's read tasks leave them), the Pool's in its parent's memory. Wall time
   includes pool/actor start on both sides (the goal's ratio); a busy-window rate (first batch
   start to last batch end, timed inside the workers: a subclass of `Preprocessor` that only adds
   two timestamp columns) is printed too. Goal ≥ 1.0×. The plain in-process `preprocess()` rate
   (1 and 2 torch threads) is printed for reference.
3. memory: `python -m app ingest --image-size 32` in a child process over a topic of S and of L
   records (32 px synthetic images), peak PSS summed over the whole process tree (driver, GCS,
   raylet, Ray workers), alternating S and L. Goal L/S ≤ 1.2× (it streams).
4. storage: one whole `ingest()` of the same topic into local disk and into S3 (`--storage
   s3://…` with AWS_ENDPOINT_URL and keys set, else a moto server started here), alternating;
   records/s of each and the ratio. Against moto the ratio bounds Argus's own S3 overhead only
   loosely: the server is Python, in this process, on the same 2 cores.
5. decode memory (`bench/decode_memory.py`): the peak memory one preprocessing batch adds, for
   decompression bombs and for 1080 x 2400 screenshots, at batch 64 and 256, vs decoding the batch
   at full size first (the plain way, before #26). Goal ≤ 2 GB per actor at any batch size.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
import uuid

import _common as common
from _common import ROOT, alternate, goal_line, median_of, print_table

READ_GOAL, PRE_GOAL, MEM_GOAL = 0.9, 1.0, 1.2
DEFAULT_POOL = "ingest default: ≤ 1 actor per CPU, 1 decode thread"
ONE_ACTOR_POOL = "1 actor, 2 decode threads (info)"
PRE_BATCH = 64


# ---------------------------------------------------------------- 1. read throughput


def ray_read(bootstrap: str, topic: str, partitions: list[int], records_per_block: int) -> dict:
    """What ingest does before preprocessing: probe the true ends, then read every range with Ray Data."""
    import pyarrow.compute as pc

    from app.data.kafka import KafkaConnection
    from app.data.kafka_range import KafkaRangeDatasource, read_ranges, streaming_blocks
    from app.data.probe import probe_end_offsets

    started = time.perf_counter()
    kafka = KafkaConnection(bootstrap)
    ends = probe_end_offsets(kafka, topic, partitions)
    ranges = {p: (0, e) for p, e in ends.items() if e > 0}
    with streaming_blocks():
        dataset = read_ranges(KafkaRangeDatasource(kafka, topic, ranges, records_per_block, {}, 3_600_000))
    rows = size = 0
    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        rows += batch.num_rows
        size += pc.sum(pc.binary_length(batch["value"])).as_py() or 0
    return _rate(rows, size, time.perf_counter() - started)


def raw_read(bootstrap: str, topic: str, ranges: dict[int, tuple[int, int]], records_per_block: int) -> dict:
    """The plain baseline: one confluent-kafka consumer, assign the ranges, consume to their ends."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    started = time.perf_counter()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": 64 * 1024 * 1024,
            "message.max.bytes": 64 * 1024 * 1024,
        }
    )
    consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in ranges.items()])
    pending = {p for p, (start, end) in ranges.items() if end > start}
    rows = size = 0
    try:
        while pending:
            for message in consumer.consume(records_per_block, timeout=1.0):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(str(message.error()))
                    continue
                end = ranges[message.partition()][1]
                if message.offset() >= end:
                    continue
                rows += 1
                size += len(message.value())
                if message.offset() == end - 1:
                    pending.discard(message.partition())
    finally:
        consumer.close()
    return _rate(rows, size, time.perf_counter() - started)


def app_reader_in_process(
    bootstrap: str, topic: str, ranges: dict[int, tuple[int, int]], records_per_block: int
) -> dict:
    """Diagnosis: the app's read_partition_range (Arrow blocks, headers parsed) without Ray."""
    import pyarrow.compute as pc

    from app.data.kafka import KafkaConnection
    from app.data.kafka_range import read_partition_range

    started = time.perf_counter()
    rows = size = 0
    for p, (start, end) in sorted(ranges.items()):
        reader = read_partition_range(
            KafkaConnection(bootstrap), topic, p, start, end, records_per_block, 0, 3_600_000
        )
        for table in reader:
            rows += table.num_rows
            size += pc.sum(pc.binary_length(table["value"])).as_py() or 0
    return _rate(rows, size, time.perf_counter() - started)


def _rate(rows: int, size: int, seconds: float) -> dict:
    return {
        "records": rows,
        "seconds": seconds,
        "records_per_s": rows / seconds,
        "MB_per_s": size / seconds / 1e6,
    }


# ---------------------------------------------------------------- 2. preprocessing


def raw_table(values: list[bytes], labels: list[str]):
    """Rows shaped like the Kafka read's output (RAW_SCHEMA), for the Preprocessor UDF."""
    import pyarrow as pa

    from app.data.kafka import RAW_SCHEMA

    n = len(values)
    columns = {
        "partition": [0] * n,
        "offset": list(range(n)),
        "kafka_timestamp": [0] * n,
        "key": ["user-0000"] * n,
        "value": values,
        "label": labels,
        "event_time": [0] * n,
        "device_id": ["dev-0000-1"] * n,
        "schema": ["ubi.v1"] * n,
        "header_error": [None] * n,
        "header_reason": [None] * n,
        "late": [False] * n,
        "gap_end": [None] * n,
    }
    return pa.Table.from_pydict(columns, schema=RAW_SCHEMA)


def _timed_preprocessor():
    """app.data.preprocess.Preprocessor, unchanged, plus when each batch started and ended (wall clock)."""
    import numpy as np

    from app.data.preprocess import Preprocessor

    class TimedPreprocessor(Preprocessor):
        def __call__(self, batch):
            started = time.time()
            out = super().__call__(batch)
            n = len(out["offset"])
            out["_t0"], out["_t1"] = np.full(n, started), np.full(n, time.time())
            return out

    return TimedPreprocessor


def ray_preprocess(
    values: list[bytes], labels: list[str], image_size: int, records_per_block: int, **ingest_options
) -> dict:
    """Preprocessor in the actor pool `ingest` builds (`app.data.preprocess.preprocess_batches`)."""
    import pyarrow.compute as pc
    import ray.data

    from app.config import IngestConfig, Settings
    from app.data.preprocess import preprocess_batches

    table = raw_table(values, labels)
    blocks = [table.slice(i, records_per_block) for i in range(0, len(values), records_per_block)]
    # Blocks in the object store, as ingest's Kafka read tasks leave them (the read is timed in
    # part 1); the Pool's input likewise starts in its parent's memory.
    source = ray.data.from_arrow(blocks).materialize()
    started = time.time()
    dataset = preprocess_batches(
        source, Settings(image_size=image_size), IngestConfig(**ingest_options), _timed_preprocessor()
    )
    rows, first, last = 0, float("inf"), 0.0
    # Blocks as the actors stored them (Arrow, zero-copy from the object store), as the write tasks take them.
    for block in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        rows += block.num_rows
        first, last = min(first, pc.min(block["_t0"]).as_py()), max(last, pc.max(block["_t1"]).as_py())
    return _image_rate(rows, started, time.time(), first, last)


def _pil_worker(chunk: list[bytes], size: int):
    """Plain baseline's unit of work: decode, RGB, resize (Pillow bilinear, antialiased), normalise."""
    import numpy as np
    from PIL import Image

    started = time.time()
    mean = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
    out = np.empty((len(chunk), 3, size, size), dtype=np.float32)
    for i, value in enumerate(chunk):
        image = Image.open(io.BytesIO(value)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
        out[i] = (chw - mean) / std
    return started, time.time(), out


def pool_preprocess(values: list[bytes], image_size: int, processes: int) -> dict:
    import functools
    import multiprocessing

    chunks = [values[i : i + PRE_BATCH] for i in range(0, len(values), PRE_BATCH)]
    started = time.time()
    rows, first, last = 0, float("inf"), 0.0
    # spawn, not fork: this process runs Ray's threads, and forking them is unsafe.
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for t0, t1, out in pool.imap(functools.partial(_pil_worker, size=image_size), chunks):
            rows += len(out)
            first, last = min(first, t0), max(last, t1)
    return _image_rate(rows, started, time.time(), first, last)


def in_process_preprocess(values: list[bytes], image_size: int, threads: int) -> dict:
    import torch

    from app.transform import preprocess

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.time()
        rows = sum(
            len(preprocess(values[i : i + PRE_BATCH], image_size)) for i in range(0, len(values), PRE_BATCH)
        )
        ended = time.time()
    finally:
        torch.set_num_threads(previous)
    return _image_rate(rows, started, ended, started, ended)


def _image_rate(rows: int, started: float, ended: float, first: float, last: float) -> dict:
    """Wall rate (start-up included) and busy rate (first batch start to last batch end)."""
    return {
        "images": rows,
        "seconds": ended - started,
        "images_per_s": rows / (ended - started),
        "busy_images_per_s": rows / (last - first),
        "startup_s": first - started,
    }


# ---------------------------------------------------------------- 3. memory


def ingest_child(bootstrap: str, topic: str, storage: str) -> dict:
    """`python -m app ingest` as a user runs it; peak memory of its whole process tree."""
    command = [
        sys.executable,
        "-m",
        "app",
        "ingest",
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--storage",
        storage,
        "--image-size",
        "32",
        "--partitions",
        "4",
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "KAFKA_BOOTSTRAP_SERVERS", "ARGUS_TOPIC", "ARGUS_STORAGE")
    }
    env["PYTHONPATH"] = str(ROOT)
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with common.TreeMemorySampler(process.pid) as sampler:
        stdout, stderr = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(f"ingest exited {process.returncode}: {stderr[-2000:]}")
    line = stdout.strip().splitlines()[-1]
    return {
        "seconds": time.perf_counter() - started,
        "peak_pss_MB": sampler.peak_pss / 2**20,
        "peak_rss_sum_MB": sampler.peak_rss / 2**20,
        "object_store_MB": sampler.peak_object_store / 2**20,
        "processes": sampler.peak_processes,
        "report": line,
    }


# ---------------------------------------------------------------- 4. storage: local disk vs S3


def ingest_into(bootstrap: str, topic: str, storage: str) -> dict:
    """One whole `ingest()` of the topic into an empty storage (this process's Ray)."""
    from app.config import IngestConfig, Settings
    from app.data.ingest import ingest
    from app.data.kafka import KafkaConnection

    catalog = None if "://" not in storage else f"sqlite:///{tempfile.mkdtemp(prefix='catalog-')}/catalog.db"
    settings = Settings(
        topic=topic, storage=storage, catalog=catalog, image_size=32, model="cnn", partitions=4
    )
    started = time.perf_counter()
    report = ingest(settings, IngestConfig(), KafkaConnection(bootstrap))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "records_per_s": (report.records + report.dlq) / seconds,
        "files": report.records,
    }


def storage_part(args, bootstrap: str, tmp, s3_root: str, tables: list, goals: list) -> None:
    """The same topic ingested into local disk and into S3, alternating: the table's data and
    metadata files on S3 (the catalog a local SQLite file) against local disk."""
    topic = f"bench-storage-{uuid.uuid4().hex[:6]}"
    pool32 = common.synthetic_pool(500, 32, seed=5)
    common.produce_records(bootstrap, topic, args.storage_records, pool32)
    print(f"\n== storage: ingest of {args.storage_records} records (32 px) into local disk vs S3")
    runs = alternate(
        {
            "local disk": lambda: ingest_into(bootstrap, topic, str(tmp / f"local-{uuid.uuid4().hex[:6]}")),
            "S3": lambda: ingest_into(bootstrap, topic, f"{s3_root}/{uuid.uuid4().hex[:6]}"),
        },
        args.repeats,
        "storage",
    )
    rows = [[name, median_of(r, "records_per_s"), median_of(r, "seconds")] for name, r in runs.items()]
    tables.append(
        (f"storage: whole ingest, median of {args.repeats}", ["storage", "records/s", "wall s"], rows)
    )
    ratio = median_of(runs["S3"], "records_per_s") / median_of(runs["local disk"], "records_per_s")
    where = "the given endpoint" if args.storage else "moto, a Python S3 server sharing these 2 cores"
    goals.append(f"ingest into S3 vs local disk: {ratio:.2f}× (info; S3 is {where})")


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=100_000, help="records for the read benchmark")
    parser.add_argument("--source-size", type=int, default=64, help="synthetic image side in the read topic")
    parser.add_argument(
        "--pre-images", type=int, default=60_000, help="images for the preprocessing benchmark"
    )
    parser.add_argument("--in-process-images", type=int, default=500, help="images for the in-process rate")
    parser.add_argument("--pre-source-size", type=int, default=128, help="side of the images preprocessed")
    parser.add_argument(
        "--image-size", type=int, default=64, help="--image-size the preprocessing resizes to"
    )
    parser.add_argument("--mem-records", default="2000,10000", help="small,large record counts for memory")
    parser.add_argument("--full-memory", action="store_true", help="memory at the issue's 10000,50000")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the read and preprocess runs")
    parser.add_argument("--mem-repeats", type=int, default=2, help="rounds of the memory runs")
    parser.add_argument("--records-per-block", type=int, default=512)
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: read,preprocess,memory,storage,decode"
    )
    parser.add_argument(
        "--storage",
        help="s3:// URI for the storage part (endpoint and keys from AWS_*; default: a moto server)",
    )
    parser.add_argument("--storage-records", type=int, default=5000, help="records for the storage part")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    small, large = (
        (10_000, 50_000) if args.full_memory else tuple(int(x) for x in args.mem_records.split(","))
    )
    print(f"bench/ingest.py · {common.machine_line()}")
    goals: list[str] = []
    tables: list[tuple] = []

    # The S3 server's environment must be set before Ray starts, so its workers inherit it.
    with (
        common.scratch_dir("argus-bench-ingest-") as tmp,
        common.embedded_broker(tmp) as bootstrap,
        common.s3_storage(args.storage) as s3_root,
    ):
        if "memory" not in skip:
            # First, before this process holds a Ray: the children start their own.
            print(
                f"\n== memory: `python -m app ingest --image-size 32` over {small} vs {large} records "
                "(32 px synthetic)"
                f"{'' if args.full_memory else ' — scaled down; --full-memory for 10k vs 50k'}"
            )
            pool32 = common.synthetic_pool(500, 32, seed=3)
            topics = {}
            for n in (small, large):
                topics[n] = f"bench-mem-{n}-{uuid.uuid4().hex[:6]}"
                seconds = common.produce_records(bootstrap, topics[n], n, pool32)
                print(f"  produced {n} records to {topics[n]} in {seconds:.1f}s")
            memory = alternate(
                {
                    f"{n} records": (
                        lambda n=n: ingest_child(
                            bootstrap, topics[n], str(tmp / f"store-{n}-{uuid.uuid4().hex[:6]}")
                        )
                    )
                    for n in (small, large)
                },
                args.mem_repeats,
                "memory",
            )
            rows = []
            for name, results in memory.items():
                rows.append(
                    [
                        name,
                        median_of(results, "peak_pss_MB"),
                        median_of(results, "peak_rss_sum_MB"),
                        median_of(results, "object_store_MB"),
                        median_of(results, "processes"),
                        median_of(results, "seconds"),
                    ]
                )
                print(f"  {name}: {results[-1]['report']}")
            small_mb = median_of(memory[f"{small} records"], "peak_pss_MB")
            large_mb = median_of(memory[f"{large} records"], "peak_pss_MB")
            ratio = large_mb / small_mb
            store_ratio = median_of(memory[f"{large} records"], "object_store_MB") / max(
                median_of(memory[f"{small} records"], "object_store_MB"), 1e-9
            )
            payload = sum(len(r.value) for r in pool32) / len(pool32) + 3 * 32 * 32 * 4
            print(
                f"  {large - small} more records added {large_mb - small_mb:.0f} MB of peak PSS: "
                f"{(large_mb - small_mb) * 2**20 / (large - small) / 1024:.1f} KiB per record, against "
                f"{payload / 1024:.1f} KiB of value + 32 px float image per record were it all held at once"
            )
            tables.append(
                (
                    f"memory: peaks over the ingest process tree (median of {args.mem_repeats})",
                    ["run", "peak PSS MB", "RSS sum MB", "object store MB", "processes", "wall s"],
                    rows,
                )
            )
            scale = (
                ""
                if args.full_memory
                else f" (scaled down to {small} vs {large}; --full-memory for 10k vs 50k)"
            )
            goals.append(
                goal_line(
                    f"peak memory {large} vs {small} records",
                    ratio,
                    MEM_GOAL,
                    higher_is_better=False,
                    note=f"(object store peak {store_ratio:.2f}×){scale}",
                )
            )

        with common.local_ray(num_cpus=2):
            import ray.data

            ray.data.DataContext.get_current().enable_progress_bars = False
            if "read" not in skip:
                topic = f"bench-read-{uuid.uuid4().hex[:6]}"
                print(f"\n== read: {args.records} records of {args.source_size} px images, 4 partitions")
                pool = common.synthetic_pool(min(args.records, 1000), args.source_size, seed=1)
                seconds = common.produce_records(bootstrap, topic, args.records, pool)
                print(f"  produced {args.records} records in {seconds:.1f}s")
                from app.data.kafka import KafkaConnection
                from app.data.probe import partitions_of, probe_end_offsets

                kafka = KafkaConnection(bootstrap)
                partitions = partitions_of(kafka, topic)
                ranges = {p: (0, e) for p, e in probe_end_offsets(kafka, topic, partitions).items()}
                rpb = args.records_per_block
                ray_read(bootstrap, topic, partitions, rpb)  # warm Ray's workers and imports once
                read = alternate(
                    {
                        "Ray Data (probe + KafkaRange)": lambda: ray_read(bootstrap, topic, partitions, rpb),
                        "raw confluent-kafka loop": lambda: raw_read(bootstrap, topic, ranges, rpb),
                        "app reader, no Ray (info)": lambda: app_reader_in_process(
                            bootstrap, topic, ranges, rpb
                        ),
                    },
                    args.repeats,
                    "read",
                )
                for results in read.values():
                    assert all(r["records"] == args.records for r in results), results
                rows = [
                    [name, median_of(r, "records_per_s"), median_of(r, "MB_per_s"), median_of(r, "seconds")]
                    for name, r in read.items()
                ]
                tables.append(
                    (
                        f"read: {args.records} records (median of {args.repeats})",
                        ["reader", "records/s", "MB/s", "s"],
                        rows,
                    )
                )
                ratio = median_of(read["Ray Data (probe + KafkaRange)"], "records_per_s") / median_of(
                    read["raw confluent-kafka loop"], "records_per_s"
                )
                goals.append(goal_line("ingest read vs raw confluent-kafka", ratio, READ_GOAL))

            if "preprocess" not in skip:
                print(
                    f"\n== preprocess: {args.pre_images} images, "
                    f"{args.pre_source_size} px → {args.image_size} px"
                )
                pool = common.synthetic_pool(256, args.pre_source_size, seed=2)
                values = [pool[i % len(pool)].value for i in range(args.pre_images)]
                labels = [pool[i % len(pool)].label for i in range(args.pre_images)]
                rpb = args.records_per_block
                ray_preprocess(values[:512], labels[:512], args.image_size, rpb)  # warm workers once
                pre = alternate(
                    {
                        DEFAULT_POOL: lambda: ray_preprocess(values, labels, args.image_size, rpb),
                        ONE_ACTOR_POOL: lambda: ray_preprocess(
                            values, labels, args.image_size, rpb, concurrency=1, decode_threads=2
                        ),
                        "multiprocessing.Pool(2) Pillow+numpy": lambda: pool_preprocess(
                            values, args.image_size, 2
                        ),
                        "in-process preprocess(), 1 torch thread (info)": lambda: in_process_preprocess(
                            values[: args.in_process_images], args.image_size, 1
                        ),
                        "in-process preprocess(), 2 torch threads (info)": lambda: in_process_preprocess(
                            values[: args.in_process_images], args.image_size, 2
                        ),
                    },
                    args.repeats,
                    "preprocess",
                )
                rows = [
                    [
                        name,
                        median_of(r, "images_per_s"),
                        median_of(r, "busy_images_per_s"),
                        median_of(r, "startup_s"),
                        median_of(r, "seconds"),
                    ]
                    for name, r in pre.items()
                ]
                tables.append(
                    (
                        f"preprocess: {args.pre_source_size}→{args.image_size} px "
                        f"(median of {args.repeats}); "
                        "busy = first batch start to last batch end",
                        ["pipeline", "images/s", "busy img/s", "start-up s", "wall s"],
                        rows,
                    )
                )

                def vs_pool(name: str, key: str = "images_per_s") -> float:
                    return median_of(pre[name], key) / median_of(
                        pre["multiprocessing.Pool(2) Pillow+numpy"], key
                    )

                busy, one_actor = vs_pool(DEFAULT_POOL, "busy_images_per_s"), vs_pool(ONE_ACTOR_POOL)
                goals.append(
                    goal_line(
                        "preprocessing images/s (ingest's pool) vs Pool(2)",
                        vs_pool(DEFAULT_POOL),
                        PRE_GOAL,
                        note=f"(busy-window {busy:.2f}×; 1 actor × 2 threads {one_actor:.2f}×)",
                    )
                )

            if "storage" not in skip:
                storage_part(args, bootstrap, tmp, s3_root, tables, goals)

    if "decode" not in skip:
        import decode_memory

        print("\n== decode memory: one preprocessing batch of bombs, of screenshots (bench/decode_memory.py)")
        rows, decode_goals = decode_memory.run()
        tables.append(
            ("peak memory one batch adds", ["images", "batch", "how", "peak added MB", "decoded"], rows)
        )
        goals.extend(decode_goals)

    print("\n== summary")
    for title, header, rows in tables:
        print_table(title, header, rows)
    print()
    for line in goals:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
