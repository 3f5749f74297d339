"""The CLI's shared flags and the data commands' flags (CONTRACT.md §3): `add_common` (every
command), `add_table` (every command that reads or writes the table) and one adder per data
command: produce, ingest, redrive, watch, lag, erase, migrate, broker. The model commands' flags are
in `app.model_options`. Each adder only declares flags; defaults live in the typed configs of
`app.config`, so a flag left out means "the config's default".
"""

from __future__ import annotations

import argparse

from app.config import MODELS


def add_common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shared options (each also read from the environment)")
    group.add_argument(
        "--bootstrap-servers",
        help="Kafka host:port[,...] (KAFKA_BOOTSTRAP_SERVERS); unset: the embedded broker",
    )
    group.add_argument(
        "--topic", help="topic of behaviour images (ARGUS_TOPIC; default user_behavior_images)"
    )
    group.add_argument(
        "--storage", help="local path or s3:// / hdfs:// URI (ARGUS_STORAGE; default ./argus-data)"
    )
    group.add_argument(
        "--mlflow-uri", help="MLflow tracking URI (MLFLOW_TRACKING_URI; default SQLite in storage)"
    )
    group.add_argument("--ray-address", help="Ray cluster address (RAY_ADDRESS; unset: local Ray)")
    group.add_argument("--image-size", type=int, help="square image side the model sees (default 224)")
    group.add_argument("--model", help=f"one of {', '.join(MODELS)} (default resnet50)")
    group.add_argument("--classes", help="comma-separated class names (default: discovered from the data)")
    group.add_argument("--partitions", type=int, help="partitions of topics Argus creates (default 4)")
    group.add_argument(
        "--replication-factor", type=int, help="replication factor of topics Argus creates (default 1)"
    )
    group.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="librdkafka properties (security.protocol, ssl.*, sasl.*) for every Kafka client (KAFKA_CONFIG)",
    )
    group.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_produce(parser) -> None:
    parser.add_argument("--synthetic", type=int, metavar="N", help="publish N synthetic behaviour images")
    parser.add_argument("--from-dir", metavar="DIR", help="publish DIR/<label>/<image files>")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--users", type=int, help="synthetic users (default 50)")
    parser.add_argument("--source-image-size", type=int, help="side of synthetic images (default 64)")
    parser.add_argument("--late-fraction", type=float, help="share of records arriving late (default 0.05)")
    parser.add_argument("--corrupt-fraction", type=float, help="share of corrupt values (default 0.02)")
    parser.add_argument("--linger-ms", type=int, help="producer batching delay (default 20)")


def add_ingest(parser, *, start: bool = True) -> None:
    add_table(parser)
    if start:  # a watch resumes a table; it starts a new one where a first ingest's --from did
        parser.add_argument(
            "--from",
            dest="start_from",
            metavar="earliest|TIME",
            help="where a new table starts: earliest (the log start) or a time, ISO 8601 or epoch ms "
            "(default: offset 0, what retention deleted counted lost); a table with commits resumes",
        )
    parser.add_argument("--group", help="consumer group (default argus-ingest)")
    add_cleaning(parser)
    parser.add_argument(
        "--allowed-lateness-s", type=float, help="lateness flagged beyond this (default 3600)"
    )
    parser.add_argument(
        "--dlq-max-bytes", type=int, help="larger dead letters go to <storage>/dlq/, a pointer to the topic"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="fail when retention deleted records before they were ingested (default: record and go on)",
    )


def add_cleaning(parser) -> None:
    """What decides the row a record becomes (or why it is a dead letter), besides the shared
    `--classes` and `--image-size`: `ingest`, `watch` and `redrive` clean records alike."""
    parser.add_argument("--max-record-bytes", type=int, help="larger values go to the DLQ (default 10 MiB)")
    parser.add_argument("--features", choices=["resnet50"], help="add a 2048-d ResNet-50 feature column")
    parser.add_argument("--weights", help="local path of backbone weights (default: random, with a warning)")
    parser.add_argument("--use-gpu", action="store_true", default=None, help="preprocess on GPU actors")
    parser.add_argument(
        "--concurrency", type=int, help="most preprocessing actors (default: one per CPU, or per GPU)"
    )
    parser.add_argument(
        "--decode-threads", type=int, help="decode threads per actor (default 1, CPUs per GPU on GPU)"
    )
    parser.add_argument(
        "--keep-source",
        action="store_true",
        default=None,
        help="keep each encoded image in the snapshot, so training at another --image-size needs no Kafka",
    )


def add_redrive(parser) -> None:
    add_table(parser)
    add_cleaning(parser)


def add_broker(parser) -> None:
    parser.add_argument("--port", type=int, default=9092)


def add_watch(parser) -> None:
    add_ingest(parser, start=False)
    parser.add_argument("--lag-alert-s", type=float, help="alert threshold in seconds (default 5)")
    parser.add_argument(
        "--lag-alert-for-s",
        type=float,
        help="alert only once lag stayed above the threshold this long (default 1)",
    )
    parser.add_argument(
        "--interval-s", type=float, help="least time between two micro-batch cuts (default 0)"
    )
    parser.add_argument(
        "--max-batch-delay-s",
        type=float,
        help="cut a micro-batch once its first record waited this long (default 1)",
    )
    parser.add_argument(
        "--max-batch-records",
        type=int,
        help="cut a micro-batch once it holds this many offsets (default 2000)",
    )
    parser.add_argument("--max-in-flight", type=int, help="micro-batches written at once (default 2)")
    parser.add_argument("--pause-file", help="while this file exists, measure lag but do not ingest")
    parser.add_argument("--max-ticks", type=int, help="stop after committing this many micro-batches")
    parser.add_argument(
        "--compact-interval-s",
        type=float,
        help="between two upkeeps of the table: compaction, snapshot expiry, orphan removal, run by "
        "the group's watch holding partition 0 (default 300; 0: none in this watch)",
    )
    parser.add_argument(
        "--expire-after-s",
        type=float,
        help="table snapshots older than this expire, but those registered versions name (default 7 days)",
    )
    parser.add_argument(
        "--keep-snapshots",
        type=int,
        help="at most this many newest table snapshots stay, besides those registered versions name "
        "and those running readers hold (default 20)",
    )
    parser.add_argument(
        "--orphan-after-s",
        type=float,
        help="files no table snapshot names are deleted once this old (default 3 days, at least 3600)",
    )
    parser.add_argument(
        "--session-timeout-s",
        type=float,
        help="consumer group session: a silent watch's partitions move to the others after this (default 6)",
    )


def add_lag(parser) -> None:
    add_table(parser)
    parser.add_argument("--interval-s", type=float, help="seconds between two measurements (default 15)")
    parser.add_argument(
        "--once", action="store_true", default=None, help="measure, print and export once, then exit"
    )


def add_table(parser) -> None:
    """The Iceberg table's location: every command that reads or writes the table takes these."""
    parser.add_argument(
        "--catalog",
        help="Iceberg catalog: a SQLAlchemy URI or an http(s) REST catalog (ARGUS_CATALOG; "
        "default sqlite:///<storage>/catalog.db, required when --storage is not a local path)",
    )
    parser.add_argument("--table", help="the table, namespace.table (default argus.behavior_images)")


def add_erase(parser) -> None:
    add_table(parser)
    parser.add_argument("--user", help="the user (their records' Kafka key) whose rows to delete")


def add_migrate(parser) -> None:
    add_table(parser)
