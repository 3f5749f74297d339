"""Redrive: the dead letters whose failure no longer applies, into the table, exactly once.

    python -m app redrive --classes normal,phishing_page,ransom_note   # after adding a class

Reads the dead-letter topic on the driver (dead letters are few) from each partition's log start to
its proven end, rebuilds the record each dead letter stands for (key, value or its stored payload,
the CONTRACT.md §1 headers, source coordinates) and cleans the ones that may pass now with ingest's
own preprocessing and flags (`--classes`, `--image-size`, `--max-record-bytes`, ...). A record goes
in only once: duplicate dead letters count once, offsets at or beyond the table's committed offset
belong to an ingest that has not committed yet, offsets below where a table made by `ingest --from`
begins were never its own, and offsets already rows of the snapshot this run planned from are left
alone; the commit lands only on that snapshot or on commits that cannot hold its offsets
(`commit_redrive`), else it plans again. Nothing is republished: what stays dead is
counted by reason, and the dead letters of an erased user's records from before the erasure stay
dead (`app.data.metadata.Erasures`).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitStateUnknownException
from pyiceberg.expressions import And, EqualTo, In, Or
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from app import metrics
from app.config import IngestConfig, Settings
from app.data import kafka
from app.data.catalog import dumps
from app.data.dead_letters import Candidate, DeadLetter, candidate, read_dead_letters, stored_payload
from app.data.erasure import erase_late
from app.data.faults import fault
from app.data.ingest import open_table
from app.data.metadata import (
    COMPACTED_KEY,
    FEATURES_WEIGHTS_KEY,
    RANGES_KEY,
    Erasures,
    carried_summary,
    committed_at,
    origin,
)
from app.data.preprocess import preprocess_batches
from app.data.records import user_digest
from app.data.sink import table_rows
from app.data.table import COMMIT_ATTEMPTS, ImageTable, OffsetConflict, append, check_topic
from app.errors import Reason
from app.storage import Store

log = logging.getLogger(__name__)

PLAN_ATTEMPTS = 5
"""Times a redrive plans again after a commit it cannot go past (another redrive, an erasure)."""
WRITE_BYTES = 128 * 1024 * 1024
"""Rows gathered on the driver before they are written as data files."""

RECORDS_KEY = "argus.redrive.records"
DLQ_TOPIC_KEY = "argus.redrive.dlq_topic"
STAYED_DEAD_KEY = "argus.redrive.stayed_dead"
"""JSON {reason: dead letters}: what this redrive left dead, and why."""

UNFAITHFUL = frozenset({Reason.BAD_HEADER, Reason.HEADER_TOO_LONG, Reason.ERASED})
"""Reasons whose dead letter does not hold the record as it was (an oversized field is left out, an
invalid event time replaced by the Kafka timestamp; an erased user's holds nothing of theirs):
rebuilt, the record would pass as something it never was, so it stays dead. Nothing a later run
configures changes these failures."""


@dataclass
class RedriveReport:
    dlq_topic: str
    read: int = 0
    """Dead letters read: every one is counted in exactly one of the fields below."""
    redriven: int = 0
    snapshot_id: int | None = None
    stayed_dead: Counter = field(default_factory=Counter)
    """{reason: dead letters left dead}, reasons as `app.errors.Reason` values."""
    in_table: int = 0
    """Already rows of the table (redriven before, or ingested by a rerun after a crash)."""
    duplicates: int = 0
    """Dead letters of a record another dead letter read here already stands for."""
    pending: int = 0
    """At or beyond the table's committed offset: an ingest that has not committed yet owns them."""
    before_start: int = 0
    """Below where a table made by `ingest --from` begins: records that were never the table's."""
    other_topics: int = 0
    seconds: float = 0.0

    def accounted(self) -> int:
        return (
            self.redriven
            + sum(self.stayed_dead.values())
            + self.in_table
            + self.duplicates
            + self.pending
            + self.before_start
            + self.other_topics
        )

    def __str__(self) -> str:
        into = f"into table snapshot {self.snapshot_id}" if self.snapshot_id else "(nothing committed)"
        dead = ", ".join(f"{reason} {n}" for reason, n in sorted(self.stayed_dead.items()))
        return (
            f"redriven {self.redriven} of {self.read} dead letters in {self.dlq_topic} {into}; "
            f"stayed dead {sum(self.stayed_dead.values())}{f' ({dead})' if dead else ''}; "
            f"already in the table {self.in_table}; duplicates {self.duplicates}; "
            f"owned by a pending ingest {self.pending}; before the table's start {self.before_start}; "
            f"other topics {self.other_topics}; "
            f"{self.seconds:.1f}s"
        )


def redrive(settings: Settings, cfg: IngestConfig, connection: kafka.KafkaConnection) -> RedriveReport:
    """`python -m app redrive`: read the dead letters, clean those whose failure may no longer
    apply as ingest would now, and commit the good ones as one table snapshot, exactly once."""
    started = time.perf_counter()
    table = open_table(settings, cfg)
    letters = read_dead_letters(connection, settings.dlq_topic)
    dlq = Store.at(settings.uri("dlq"))
    for attempt in range(1, PLAN_ATTEMPTS + 1):
        try:
            report = _redrive_once(settings, cfg, table, letters, dlq)
        except OffsetConflict as exc:
            log.warning(
                "redrive of %s: %s (attempt %d of %d)", settings.dlq_topic, exc, attempt, PLAN_ATTEMPTS
            )
            continue
        if report.accounted() != report.read:  # every dead letter read is in exactly one count
            raise RuntimeError(f"redrive accounted for {report.accounted()} of {report.read} dead letters")
        report.seconds = time.perf_counter() - started
        metrics.inc("argus_records_redriven", report.redriven, topic=settings.topic)
        for reason, count in report.stayed_dead.items():
            metrics.inc("argus_redrive_stayed_dead", count, topic=settings.topic, reason=reason)
        return report
    raise RuntimeError(
        f"redrive of {settings.dlq_topic}: {PLAN_ATTEMPTS} plans in a row lost to other writers"
    )


def _redrive_once(
    settings: Settings, cfg: IngestConfig, table: ImageTable, letters: list[DeadLetter], dlq: Store
) -> RedriveReport:
    report = RedriveReport(settings.dlq_topic, read=len(letters))
    state = table.load()
    base = state.current_snapshot()
    planned_from = base.snapshot_id if base else None
    check_topic(table.identifier, state, base, settings.topic)
    committed = committed_at(state, base)
    starts = origin(state)
    erasures = Erasures.of(state)
    candidates = _triage(letters, settings.topic, committed, starts, erasures, report)
    present = _present(table, planned_from, candidates)
    report.in_table = sum(1 for c in candidates if c.coordinates in present)
    candidates = [c for c in candidates if c.coordinates not in present]
    candidates = [c for c in candidates if _load_value(c, settings.topic, dlq, report)]
    if settings.classes is None and any(c.letter.reason() == Reason.UNKNOWN_LABEL for c in candidates):
        log.warning("redrive without --classes accepts every label, as ingest does")
    log.info(
        "redrive of %s: %d dead letters, %d to clean again (planned from table snapshot %s)",
        settings.dlq_topic,
        len(letters),
        len(candidates),
        planned_from,
    )
    if not candidates:
        return report

    files: list[DataFile] = []
    try:
        rows = _clean(settings, cfg, candidates, report)
        if not rows.num_rows:
            return report
        _write(table, rows, files)
        fault("after_write")
        offsets: dict[int, set[int]] = defaultdict(set)
        for p, o in zip(rows.column("kafka_partition").to_pylist(), rows.column("kafka_offset").to_pylist()):
            offsets[p].add(o)
        users = {user_digest(user) for user in rows.column("user_id").to_pylist()}
        details = {
            RECORDS_KEY: str(rows.num_rows),
            DLQ_TOPIC_KEY: settings.dlq_topic,
            STAYED_DEAD_KEY: dumps(dict(report.stayed_dead)),
        }
        if cfg.features:
            details[FEATURES_WEIGHTS_KEY] = cfg.weights or ""
        fault("before_commit")
        report.snapshot_id = commit_redrive(
            table, files, settings.topic, planned_from, dict(offsets), users, erasures, details
        )
    except CommitStateUnknownException:
        raise  # the catalog may hold the commit: its files must stay
    except BaseException:
        table.discard(files)
        raise
    fault("after_commit")
    report.redriven = rows.num_rows
    erase_late(table, erasures, files)
    return report


def _triage(
    letters: list[DeadLetter],
    topic: str,
    committed: dict[int, int],
    starts: dict[int, int],
    erasures: Erasures,
    report: RedriveReport,
) -> list[Candidate]:
    """The dead letters that may pass now, each once; the others counted in `report`."""
    seen: set[tuple[int, int]] = set()
    candidates = []
    for letter in letters:
        source = letter.source()
        if source is None:
            report.stayed_dead[Reason.BAD_HEADER] += 1  # no source: nothing it could be redriven as
            continue
        source_topic, partition, offset = source
        if source_topic != topic:
            report.other_topics += 1
            continue
        if (partition, offset) in seen:
            report.duplicates += 1  # an ingest rerun after a crash publishes its dead letters again
            continue
        seen.add((partition, offset))
        if offset >= committed.get(partition, 0):
            report.pending += 1
            continue
        if offset < starts.get(partition, 0):
            report.before_start += 1  # the DLQ is the topic's, shared by every table made from it
            continue
        if erasures.covers(letter.user, partition, offset):
            report.stayed_dead[Reason.ERASED] += 1
            continue
        reason = letter.reason()
        if reason in UNFAITHFUL:
            report.stayed_dead[reason] += 1
            continue
        candidates.append(candidate(letter, partition, offset))
    return candidates


def _event_date(row: dict) -> datetime.date | None:
    if row["header_error"] is not None or row["event_time"] is None:
        return None
    return datetime.datetime.fromtimestamp(row["event_time"] / 1000, datetime.UTC).date()


def _present(table: ImageTable, snapshot_id: int | None, candidates: list[Candidate]) -> set[tuple[int, int]]:
    """The candidates' coordinates that are rows of snapshot `snapshot_id`: a scan filtered on them
    and, where every candidate's event date is known, on those dates (files of other days are
    not read)."""
    if snapshot_id is None or not candidates:
        return set()
    wanted = {c.coordinates for c in candidates}
    by_partition: dict[int, set[int]] = defaultdict(set)
    for p, o in wanted:
        by_partition[p].add(o)
    match = functools.reduce(
        Or,
        [And(EqualTo("kafka_partition", p), In("kafka_offset", sorted(o))) for p, o in by_partition.items()],
    )
    dates = {_event_date(c.row) for c in candidates}
    if None not in dates:
        match = And(In("event_date", sorted(d.isoformat() for d in dates)), match)
    rows = (
        table.load()
        .scan(snapshot_id=snapshot_id, row_filter=match, selected_fields=("kafka_partition", "kafka_offset"))
        .to_arrow()
    )
    found = set(zip(rows.column("kafka_partition").to_pylist(), rows.column("kafka_offset").to_pylist()))
    return found & wanted


def _load_value(candidate: Candidate, topic: str, dlq: Store, report: RedriveReport) -> bool:
    """Put the record's value into its row: the dead letter's own, or its stored payload; False
    (counted as `bad_payload`, logged) when the payload cannot be trusted (`stored_payload`)."""
    letter = candidate.letter
    if "payload_uri" not in letter.headers:
        candidate.row["value"] = letter.value
        return True
    value = stored_payload(letter, topic, *candidate.coordinates, dlq)
    if isinstance(value, str):
        log.warning("dead letter of %s[%d]@%d stays dead: %s", topic, *candidate.coordinates, value)
        report.stayed_dead[Reason.BAD_PAYLOAD] += 1
        return False
    candidate.row["value"] = value
    return True


def _clean(
    settings: Settings, cfg: IngestConfig, candidates: list[Candidate], report: RedriveReport
) -> pa.Table:
    """The candidates through ingest's preprocessing (`preprocess_batches`: the same actor pool,
    transform and checks) → the table's rows of those that pass; the others counted by reason."""
    import ray.data

    raw = pa.Table.from_pylist([c.row for c in candidates], schema=kafka.RAW_SCHEMA)
    stamps = {c.coordinates: c.source_timestamp for c in candidates}
    cleaned = preprocess_batches(ray.data.from_arrow(raw), settings, cfg)
    parts = []
    for batch in cleaned.iter_batches(batch_size=None, batch_format="pyarrow"):
        errors = batch.column("error")
        report.stayed_dead.update(r for r in batch.column("reason").to_pylist() if r is not None)
        good = batch.filter(pc.is_null(errors))
        if not good.num_rows:
            continue
        rows = table_rows(good)
        # The record's Kafka timestamp where its dead letter carried it, else unknown (null).
        coordinates = zip(rows.column("kafka_partition").to_pylist(), rows.column("kafka_offset").to_pylist())
        original = pa.array([stamps[(p, o)] for p, o in coordinates], pa.int64())
        parts.append(
            rows.set_column(rows.schema.get_field_index("kafka_timestamp_ms"), "kafka_timestamp_ms", original)
        )
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts)


def _write(table: ImageTable, rows: pa.Table, files: list[DataFile]) -> None:
    """`rows` as uncommitted data files, appended to `files` as they are written (a failure
    part-way leaves them there to discard), at most WRITE_BYTES of rows a call."""
    step = max(1, int(rows.num_rows * WRITE_BYTES / max(rows.nbytes, 1)))
    for start in range(0, rows.num_rows, step):
        files.extend(table.write_files(rows.slice(start, step)))


def commit_redrive(
    images: ImageTable,
    files: list[DataFile],
    topic: str,
    planned_from: int,
    offsets: dict[int, set[int]],
    users: set[str],
    erasures: Erasures,
    details: dict[str, str],
) -> int:
    """Append data files of records below the committed offsets (dead letters at `offsets`
    {partition: offsets}, of the users whose `user_digest`s are `users`, triaged under `erasures`),
    carrying the committed offsets, watermarks and topic forward unchanged; `details` (Argus keys)
    go into the summary. Returns the new snapshot's id.

    The caller proved `offsets` absent from snapshot `planned_from`. A commit since then that
    cannot have added them (an ingest of other offsets, a compaction) leaves that proof standing,
    so the append goes onto it; any other (another redrive, an erasure, another engine's), an
    erasure of one of `users` since `erasures`, or `planned_from` gone from the history raises
    OffsetConflict: nothing committed, plan again."""
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table = images.load()
        base = table.current_snapshot()
        check_topic(images.identifier, table, base, topic)
        moved = _moved_under_redrive(table, base, planned_from, offsets, users, erasures)
        if moved:
            raise OffsetConflict(f"table {images.identifier}: {moved}; nothing committed, plan again")
        snapshot_id = append(table, {**details, **carried_summary(table, base)}, files)
        if snapshot_id is not None:
            return snapshot_id
        log.info("redrive commit to %s lost a race (attempt %d)", images.identifier, attempt)
    raise OffsetConflict(
        f"table {images.identifier}: {COMMIT_ATTEMPTS} redrive commits in a row lost to other writers; "
        "nothing committed"
    )


def _moved_under_redrive(
    table: Table,
    base: Snapshot | None,
    planned_from: int,
    offsets: dict[int, set[int]],
    users: set[str],
    erasures: Erasures,
) -> str | None:
    """Why a redrive planned from `planned_from` may not commit onto `base`; None when it may."""
    erased = Erasures.of(table).since(erasures) & users
    if erased:
        return f"{len(erased)} of the redriven records' users were erased since it planned"
    for snapshot in ancestors_of(base, table.metadata):
        if snapshot.snapshot_id == planned_from:
            return None
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        if COMPACTED_KEY in summary:
            continue
        if RANGES_KEY not in summary:
            return (
                f"snapshot {snapshot.snapshot_id} since it planned is neither an ingest nor a "
                "compaction (another redrive, an erasure, another engine's commit)"
            )
        for p, (start, end) in json.loads(summary[RANGES_KEY]).items():
            if any(start <= o < end for o in offsets.get(int(p), ())):
                return f"snapshot {snapshot.snapshot_id} added offsets of partition {p} that it holds"
    return f"snapshot {planned_from}, which it planned from, is no longer in the table's history"
