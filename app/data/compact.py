"""Compaction: the parts `watch` commits, merged into one snapshot per window, exactly once.

    python -m app watch --compact-window-s 3600          # hourly snapshots (the default)
    python -m app watch --compact-max-records 50000      # or by size

A window is a span of part creation times (`--compact-window-s`); once it has closed (and the
parts cut inside it have had time to commit), its parts, consecutive in the ledger, are read
(verified against their manifests), rewritten as Parquet files of up to FILE_BYTES, and committed
as one snapshot whose manifest lists the parts in `supersedes`. That create-once manifest write is
the compaction's commit: before it the new folder is invisible (and removed by the next writer to
take the lease), after it readers skip the parts (`snapshot.live_manifests`), so every offset is
live once whether a kill lands before, during or after it. Superseded parts are deleted
`--compact-grace-s` later, for readers that listed them just before. Each watch runs this in a
thread, but only the one holding the topic's compaction lease compacts (two compacting one window
would each supersede its parts: every offset live twice); when it dies another takes the lease over.

A writer's folders carry its owner id (`-w<owner>`), that of its shared hold on the topic's lease,
so that a watch starting beside others removes only the uncommitted folders of writers that are gone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq

from app import metrics
from app.data.faults import fault
from app.data.integrity import verify_file
from app.data.lease import Lease, LeaseHeld, LeaseLost, SharedLease
from app.data.manifest import DataFile, Manifest, PartitionRange, live_manifests, new_snapshot_id
from app.data.snapshot import SnapshotStore
from app.retry import Backoff

log = logging.getLogger(__name__)

PART_SUFFIX = "-part"
"""A `watch` part's snapshot id ends so; compaction merges only those."""
SETTLE_S = 10.0
"""A window is compacted this long after it closes: a part cut just before the end commits after it."""
FILE_BYTES = 64 * 1024 * 1024
"""Rewritten Parquet files are cut at about this many bytes of input (bounds memory too)."""
CHECK_S = 2.0
FAILED_BACKOFF_CAP_S = 300.0
"""A compaction that keeps failing is retried at most this far apart (doubling from CHECK_S)."""
STUCK_AFTER = 5
"""Failures in a row after which a window is reported stuck (an error, not a warning)."""


class CompactionFailed(RuntimeError):
    """Compacting one window of parts failed; `window` names its first and last part."""

    def __init__(self, parts: list[Manifest], cause: BaseException):
        self.window = f"{parts[0].snapshot_id}..{parts[-1].snapshot_id} ({len(parts)} parts)"
        super().__init__(f"compacting {self.window}: {type(cause).__name__}: {cause}")


OWNER_TAG = "-w"


def new_part_id(owner: str) -> str:
    return f"{new_snapshot_id()}{OWNER_TAG}{owner}{PART_SUFFIX}"


def folder_owner(snapshot_id: str) -> str | None:
    """The owner id a folder's name carries (None: a bulk ingest's, or written before watchers shared)."""
    head, tag, owner = snapshot_id.removesuffix(PART_SUFFIX).rpartition(OWNER_TAG)
    return owner if tag and head else None


def remove_abandoned(snapshots: SnapshotStore, hold: SharedLease) -> list[str]:
    """Delete snapshot folders without a manifest whose writer is gone: every one not tagged with a
    live sharer of the topic's lease (a bulk ingest's cannot be live while `hold` is held)."""
    hold.check()
    live = {h.owner for h in hold.sharers()} | {hold.owner}
    return snapshots.remove_uncommitted(spare=lambda snapshot_id: folder_owner(snapshot_id) in live)


def _created(manifest: Manifest) -> float:
    return datetime.fromisoformat(manifest.created_at).timestamp()


def _shape(manifest: Manifest) -> tuple:
    """What every part of one compacted snapshot must share."""
    return (manifest.topic, manifest.image_size, manifest.pixels, manifest.source, manifest.features)


def plan_groups(
    manifests: list[Manifest],
    topic: str,
    window_s: float | None,
    max_records: int | None,
    now: float,
    settle_s: float = SETTLE_S,
) -> list[list[Manifest]]:
    """Runs of live parts to compact, each consecutive in the ledger: per closed window, and (with
    `max_records`) as soon as a run holds that many records."""
    parts = [m for m in live_manifests(manifests) if m.topic == topic and m.snapshot_id.endswith(PART_SUFFIX)]
    parts.sort(key=lambda m: (m.created_at, m.snapshot_id))
    groups: list[list[Manifest]] = []
    run: list[Manifest] = []
    ends: dict[int, int] = {}

    def window(m: Manifest) -> float | None:
        return None if window_s is None else _created(m) // window_s

    def flush(closed: bool) -> None:
        nonlocal run, ends
        if run and (closed or (max_records and sum(m.records for m in run) >= max_records)):
            groups.append(run)
        run, ends = [], {}

    for m in parts:
        follows = all(ends.get(p, r.start) == r.start for p, r in m.offsets.items())
        if run and (window(m) != window(run[0]) or _shape(m) != _shape(run[0]) or not follows):
            # A run ends at a window's end, or where anything else (a bulk ingest) sits between.
            flush(closed=window_s is not None and now >= (window(run[0]) + 1) * window_s + settle_s)
        run.append(m)
        ends.update({p: r.end for p, r in m.offsets.items()})
        if max_records and sum(x.records for x in run) >= max_records:
            flush(closed=True)
    if run:
        closed = window_s is not None and now >= (window(run[0]) + 1) * window_s + settle_s
        flush(closed)
    return [g for g in groups if len(g) > 1]  # one part alone is already one manifest


def merged_offsets(parts: list[Manifest]) -> dict[int, PartitionRange]:
    out: dict[int, PartitionRange] = {}
    for m in parts:
        for p, r in m.offsets.items():
            prev = out.get(p)
            if prev is None:
                out[p] = r
                continue
            if r.start != prev.end:
                raise RuntimeError(f"partition {p}: part {m.snapshot_id} starts at {r.start}, not {prev.end}")
            marks = [w for w in (prev.watermark, r.watermark) if w is not None]
            out[p] = PartitionRange(
                prev.start,
                r.end,
                prev.records + r.records,
                prev.dlq + r.dlq,
                max(marks) if marks else None,
                prev.skipped + r.skipped,
                prev.lost + r.lost,
            )
    return out


def compact(
    snapshots: SnapshotStore, parts: list[Manifest], fences: tuple[Lease, ...] = (), owner: str | None = None
) -> Manifest:
    """Rewrite `parts` as one snapshot and commit it (see the module docstring), if every lease of
    `fences` is still held just before."""
    snapshot_id = new_snapshot_id() + (f"{OWNER_TAG}{owner}" if owner else "")
    folder = snapshots.folder(snapshot_id)
    files: list[DataFile] = []
    pending: dict[str, list[pa.Table]] = {}
    sizes: Counter = Counter()

    def flush(date_dir: str) -> None:
        tables = pending.pop(date_dir, [])
        if not tables:
            return
        buffer = pa.BufferOutputStream()
        pq.write_table(pa.concat_tables(tables), buffer)
        relative = f"{date_dir}/part-{len(files):05d}.parquet"
        digest = folder.write(relative, buffer.getvalue().to_pybytes())
        files.append(DataFile(relative, digest.size, digest.sha256))
        sizes[date_dir] = 0

    for part in parts:
        for listed in part.files:
            data = verify_file(snapshots.folder(part.snapshot_id), listed)
            date_dir = listed.path.split("/")[0]
            pending.setdefault(date_dir, []).append(pq.read_table(pa.BufferReader(data)))
            sizes[date_dir] += len(data)
            if sizes[date_dir] >= FILE_BYTES:
                flush(date_dir)
    for date_dir in sorted(pending):
        flush(date_dir)

    first = parts[0]
    offsets = merged_offsets(parts)
    labels: Counter = Counter()
    errors: Counter = Counter()
    for m in parts:
        labels.update(m.label_counts)
        errors.update(m.dlq_errors)
    lows = [m.event_time.get("min") for m in parts if m.event_time.get("min") is not None]
    highs = [m.event_time.get("max") for m in parts if m.event_time.get("max") is not None]
    manifest = dataclasses.replace(
        first,
        snapshot_id=snapshot_id,
        created_at=datetime.now(UTC).isoformat(),
        offsets=offsets,
        records=sum(m.records for m in parts),
        dlq=sum(m.dlq for m in parts),
        dlq_errors=dict(errors),
        classes=sorted({c for m in parts for c in m.classes}),
        label_counts=dict(sorted(labels.items())),
        event_time={
            **first.event_time,
            "min": min(lows) if lows else None,
            "max": max(highs) if highs else None,
            "late_records": sum(m.event_time.get("late_records", 0) for m in parts),
        },
        value_bytes=sum(m.value_bytes for m in parts),
        files=sorted(files, key=lambda f: f.path),
        supersedes=[m.snapshot_id for m in parts],
    )
    if sum(r.records for r in offsets.values()) != manifest.records:
        raise RuntimeError("compaction: the parts' counts disagree with their offsets; nothing committed")
    for lease in fences:
        lease.check()
    fault("before_compact_manifest")
    if not snapshots.commit(manifest):
        raise RuntimeError(f"snapshot {snapshot_id} already has a manifest: another writer used this id")
    metrics.inc("argus_compactions", topic=manifest.topic)
    log.info(
        "compacted %d parts (%d records) into %s: offsets %s",
        len(parts),
        manifest.records,
        snapshot_id,
        {p: (r.start, r.end) for p, r in sorted(offsets.items())},
    )
    return manifest


def delete_superseded(snapshots: SnapshotStore, manifests: list[Manifest], grace_s: float, now: float) -> int:
    """Remove parts superseded more than `grace_s` ago (`SnapshotStore.delete`)."""
    present = {m.snapshot_id for m in manifests}
    removed = 0
    for m in manifests:
        if not m.supersedes or now - _created(m) < grace_s:
            continue
        for part_id in m.supersedes:
            if part_id in present:
                snapshots.delete(part_id)
                removed += 1
    return removed


def compact_once(
    snapshots: SnapshotStore,
    topic: str,
    cfg,
    fences: tuple[Lease, ...] = (),
    owner: str | None = None,
    now: float | None = None,
) -> list[str]:
    """One pass: compact every due run of parts, then delete parts superseded long enough ago."""
    now = time.time() if now is None else now
    manifests = snapshots.manifests()
    done = []
    for group in plan_groups(manifests, topic, cfg.compact_window_s, cfg.compact_max_records, now):
        try:
            done.append(compact(snapshots, group, fences, owner).snapshot_id)
        except LeaseLost:
            raise
        except Exception as exc:
            raise CompactionFailed(group, exc) from exc
    if done:
        manifests, now = snapshots.manifests(), max(now, time.time())
    delete_superseded(snapshots, manifests, cfg.compact_grace_s, now)
    return done


class Compactor:
    """`compact_once` every CHECK_S in a thread beside the watch's pipeline, while this watch holds
    the topic's compaction lease (`compact/` under the topic's lease; tried every CHECK_S while
    another watch holds it). A pass that fails is retried with backoff (`app.retry.Backoff`): a
    window that keeps failing is re-read ever less often and, after STUCK_AFTER failures in a row,
    reported stuck, with `argus_compaction_failures` counting every failure."""

    def __init__(self, snapshots: SnapshotStore, topic: str, cfg, hold: SharedLease, stop: threading.Event):
        self.snapshots, self.topic, self.cfg, self.hold, self.stop = snapshots, topic, cfg, hold, stop
        self.lease = Lease(hold.store.child("compact"), ttl_s=hold.ttl_s)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="compactor")

    def start(self) -> None:
        if self.cfg.compact_window_s is not None or self.cfg.compact_max_records is not None:
            self._thread.start()

    def _done(self, wait_s: float = CHECK_S) -> bool:
        return self._closed.wait(wait_s) or self.stop.is_set()

    def _run(self) -> None:
        fences = (self.lease, self.hold)
        backoff = Backoff(base_s=CHECK_S, cap_s=FAILED_BACKOFF_CAP_S)
        while not self._done():
            try:
                with self.lease.held():
                    log.info("compacting %s (this watch holds the compaction lease)", self.topic)
                    remove_abandoned(self.snapshots, self.hold)  # a compactor that died left its folder
                    while True:
                        wait_s = CHECK_S
                        try:
                            compact_once(self.snapshots, self.topic, self.cfg, fences, self.hold.owner)
                            backoff.succeeded()
                        except LeaseLost:
                            raise
                        except Exception as exc:  # the next pass retries from what is committed
                            wait_s = backoff.failed()
                            metrics.inc("argus_compaction_failures", topic=self.topic)
                            stuck = backoff.failures >= STUCK_AFTER
                            log.log(
                                logging.ERROR if stuck else logging.WARNING,
                                "compaction of %s failed %d times in a row%s, next try in %.0f s: %s",
                                self.topic,
                                backoff.failures,
                                " (stuck)" if stuck else "",
                                wait_s,
                                exc,
                                exc_info=backoff.failures == 1,  # the traceback once, not every retry
                            )
                        if self._done(wait_s):
                            return
            except LeaseHeld:
                continue  # another watch compacts; this one takes over when that one's lease expires
            except LeaseLost as exc:
                log.warning("compaction of %s stopped: %s", self.topic, exc)

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
