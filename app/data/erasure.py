"""Erasing one user (`argus erase --user ID`, CONTRACT.md §3) from a table, its history and what
Argus can reach outside it, and keeping the user's records that Kafka still holds out for good.

    report = erase_user(table, "user-17", ends)      # rows gone from every snapshot still kept
    erase_late(table, planned, files)                # a writer's check after its commit

Kafka cannot delete one user's records: they stay in the topic and the dead-letter topic until
retention deletes them. So the table records the erasure with the topic's log ends
(`app.data.metadata.Erasures`), and every writer leaves the user's records below those ends out:
ingest and watch make them dead letters that hold nothing of the user, redrive leaves them dead, and
a table made later from the topic takes the erasures over (`inherit_erasures`).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import EqualTo
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.snapshots import Snapshot

from app.data.catalog import dumps
from app.data.maintenance import SWAP_ATTEMPTS, expire_ids, read_files, swap
from app.data.metadata import ERASED_PREFIX, Erasures, carried_summary, erasure_ends
from app.data.records import dead_letter_folder, user_digest
from app.data.table import ImageTable
from app.errors import ConfigError
from app.storage import Store

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EraseConfig:
    user: str = ""
    """The user whose rows go: their Kafka record key (`user_id` in the table)."""

    def __post_init__(self):
        if not self.user:
            raise ConfigError("erase needs --user ID")


@dataclass
class ErasureReport:
    user_id: str
    rows: int = 0
    files_rewritten: int = 0
    snapshots_expired: list[int] = field(default_factory=list)
    files_deleted: int = 0
    dead_letter_payloads: int | None = None
    """Payloads deleted from `<storage>/dlq/` (None: not looked at)."""
    ends: dict[int, int] | None = None
    """The topic's log ends recorded with the erasure (None: every record of the user, none asked)."""

    def __str__(self) -> str:
        if not self.rows and not self.snapshots_expired:
            return (
                f"erase: no rows of user {self.user_id!r} in the table; recorded as erased, so "
                "their records and dead letters in Kafka stay out of it"
            )
        return (
            f"erase: {self.rows} rows of user {self.user_id!r} deleted "
            f"({self.files_rewritten} files rewritten); "
            f"{len(self.snapshots_expired)} older table snapshots that held them expired, "
            f"{self.files_deleted} files deleted"
        )

    def outside_the_table(self) -> str:
        """What an erasure leaves outside the table, said with every erasure."""
        payloads = (
            f"{self.dead_letter_payloads} dead-letter payloads deleted from storage; "
            if self.dead_letter_payloads is not None
            else ""
        )
        through = (
            f"below the topic's ends {self.ends}"
            if self.ends is not None
            else "all of them, later ones too (no broker was asked for the topic's ends)"
        )
        return (
            f"outside the table: {payloads}served traffic logs hold no user ids; the topic's and the "
            "dead-letter topic's records stay until retention deletes them, and ingest, watch and "
            f"redrive keep the user's records out of the table: {through}"
        )


def erase_dead_letters(dlq: Store, user_id: str) -> int:
    """Delete `user_id`'s dead-letter payloads under `<storage>/dlq/<topic>/` (every topic);
    how many objects went."""
    folder = dead_letter_folder(user_id)
    deleted = 0
    if not dlq.exists():
        return 0
    for topic in dlq.list():
        if topic.type != pafs.FileType.Directory:
            continue
        mine = dlq.child(topic.base_name, folder)
        if mine.exists():
            deleted += sum(1 for info in mine.list(recursive=True) if info.type == pafs.FileType.File)
            mine.delete_dir()
    return deleted


def record_erasure(images: ImageTable, user_id: str, ends: dict[int, int] | None) -> None:
    """Record `user_id` as erased in the table's properties (`ERASED_PREFIX` + its `user_digest`:
    the date and the topic's log `ends`, see `app.data.metadata.Erasures`), so that ingest, watch and
    redrive keep the records Kafka still holds of the user out of the table."""
    key = ERASED_PREFIX + user_digest(user_id)
    record = _erasure_record(datetime.datetime.now(datetime.UTC).date().isoformat(), ends)
    for attempt in range(1, SWAP_ATTEMPTS + 1):
        txn = images.load().transaction()
        txn.set_properties({key: record})
        try:
            txn.commit_transaction()
            return
        except CommitFailedException as exc:
            log.info(
                "recording the erasure in %s lost a race (attempt %d): %s", images.identifier, attempt, exc
            )
    raise CommitFailedException(f"erasure record: {SWAP_ATTEMPTS} swaps in a row lost to other writers")


def inherit_erasures(images: ImageTable, topic: str) -> int:
    """Record in `images`, a table new to `topic`, the erasures of the other tables that hold it:
    the user's records, which Kafka still holds, must not come back through a replay into a second
    table. Returns how many users it recorded."""
    inherited: dict[str, str] = {}
    for sibling in images.siblings(topic):
        for key, value in sibling.load().properties.items():
            if key.startswith(ERASED_PREFIX):
                inherited[key] = _wider(inherited.get(key), value)
    own = images.load().properties
    missing = {k: v for k, v in inherited.items() if own.get(k) != v}
    if missing:
        txn = images.load().transaction()
        txn.set_properties(missing)
        txn.commit_transaction()
        log.info("table %s: %d erased users of topic %s recorded", images.identifier, len(missing), topic)
    return len(missing)


def _wider(first: str | None, second: str) -> str:
    """One erasure record of a user that covers what two do (no ends: every record)."""
    if first is None:
        return second
    a, b = erasure_ends(first), erasure_ends(second)
    if a is None or b is None:
        return first if a is None else second
    date = max(json.loads(first)["date"], json.loads(second)["date"])
    return _erasure_record(date, {p: max(a.get(p, 0), b.get(p, 0)) for p in a.keys() | b.keys()})


def _erasure_record(date: str, ends: dict[int, int] | None) -> str:
    record: dict = {"date": date}
    if ends is not None:
        record["ends"] = {str(p): end for p, end in sorted(ends.items())}
    return dumps(record)


def erase_late(images: ImageTable, planned: Erasures, files: Iterable[DataFile]) -> list[str]:
    """After a commit of `files` whose writer read the erasures `planned`: a user erased since may
    have rows in them (the erasure looked for rows before the commit landed), so erase them again.
    Returns the users erased again."""
    table = images.load()
    now = Erasures.of(table)
    late = now.since(planned)
    files = list(files)
    if not late or not files:
        return []
    held: set[str] = set()
    for data_file in files:
        with table.io.new_input(data_file.file_path).open() as stream:
            held.update(pq.read_table(stream, columns=["user_id"]).column("user_id").to_pylist())
    users = sorted(user for user in held if user_digest(user) in late)
    for user in users:
        log.warning("a user was erased while a commit of theirs was under way: erasing their new rows")
        erase_user(images, user, now.ends[user_digest(user)])
    return users


def erase_user(images: ImageTable, user_id: str, ends: dict[int, int] | None = None) -> ErasureReport:
    """Delete every row of `user_id`: from the current snapshot (files rewritten without them), then
    from history, by expiring every older snapshot that still holds one (a registered version's
    included, and one a running reader pinned: the erasure outranks both) and deleting the files
    only those needed.

    The user is recorded as erased first (`record_erasure`), before the rows are looked for: every
    writer checks for new records after it commits (`erase_late`; a redrive also as it commits), so
    however the two interleave, none of the user's erased records stays in the table."""
    report = ErasureReport(user_id, ends=ends)
    match = EqualTo("user_id", user_id)
    record_erasure(images, user_id, ends)

    def change(table: Table, base: Snapshot) -> Transaction | None:
        # Statistics only narrow the files down; each candidate is read to count what it holds.
        tasks = table.scan(snapshot_id=base.snapshot_id, row_filter=match).plan_files()
        held = [
            pc.sum(pc.equal(read_files(table, [t.file]).column("user_id"), user_id)).as_py() or 0
            for t in tasks
        ]
        report.rows, report.files_rewritten = sum(held), sum(1 for n in held if n)
        if not report.rows:
            return None
        txn = table.transaction()
        txn.delete(match, snapshot_properties={**carried_summary(table, base), "argus.erased.user": "1"})
        return txn

    swap(images, "erasure", change)

    def holding(table: Table) -> set[int]:
        """Snapshots with a live file that holds a row of the user."""
        tainted: dict[str, bool] = {}
        ids = set()
        for snapshot in table.snapshots():
            for task in table.scan(snapshot_id=snapshot.snapshot_id, row_filter=match).plan_files():
                path = task.file.file_path
                if path not in tainted:
                    users = read_files(table, [task.file]).column("user_id")
                    tainted[path] = bool(pc.any(pc.equal(users, user_id)).as_py())
                if tainted[path]:
                    ids.add(snapshot.snapshot_id)
                    break
        return ids

    report.snapshots_expired, report.files_deleted = expire_ids(images, holding, overrule_readers=True)
    left = holding(images.load())
    if left:  # only the current snapshot can be left: a writer committed the user's rows meanwhile
        log.warning(
            "erase: user %r has rows again in snapshot(s) %s, committed meanwhile", user_id, sorted(left)
        )
    log.info("%s", report)
    return report
