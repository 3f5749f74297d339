"""One writer at a time: a lease on storage, with a heartbeat and an expiry, on any filesystem.

    <storage>/leases/<name>/<generation>.json    {"owner", "host", "pid", "expires_at", ...}

The holder is the newest generation while it is live. Acquiring creates generation n + 1 with
`Store.write_new` (an O_EXCL-like create locally, `If-None-Match` on S3), so of two writers that
both saw generation n expire exactly one wins. The holder renews its expiry (`renew`) from a
thread and checks, before it commits, that no newer generation exists. A holder that died on this
host (its pid is gone) is expired at once, so a killed ingest's rerun need not wait out the TTL.
Expiry is judged by the lease's clock (`time.time` unless one is given), so tests move time
rather than sleep through it.

    <storage>/leases/<name>/shared/<owner>.json   a `SharedLease`: any number of holders at once

A shared lease excludes the exclusive one at the same root and nothing else: several `watch`
processes share a topic's lease (each also takes an exclusive lease per partition it reads, under
`partitions/<p>/`), while a bulk `ingest`, which takes the exclusive one, waits for all of them to
go, and they for it. Each side writes its record first and then looks for the other's, so of two
that start at once at least one sees the other and backs off (both may, and retry).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from app.storage import Store

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 30.0
SHARED = "shared"


class LeaseHeld(RuntimeError):
    """Another live writer holds the lease."""


class LeaseLost(RuntimeError):
    """This writer's lease expired or was taken over: it must not commit."""


@dataclass(frozen=True)
class Holder:
    owner: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float

    def alive(self, now: float) -> bool:
        if now >= self.expires_at:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False  # died on this host: its heartbeat will never come
            except PermissionError:
                pass
        return True

    def describe(self, now: float) -> str:
        return f"{self.owner} (pid {self.pid} on {self.host}, expires in {self.expires_at - now:.0f}s)"


class Lease:
    """Hold with `with Lease(store).held():`; `check()` before committing. `store` is the lease's
    own folder (e.g. `<storage>/leases/ingest-<topic>`)."""

    def __init__(self, store: Store, ttl_s: float | None = None, clock: Callable[[], float] = time.time):
        self.store = store
        self.ttl_s = ttl_s or float(os.environ.get("ARGUS_LEASE_TTL_S", DEFAULT_TTL_S))
        self.clock = clock
        self.owner = uuid.uuid4().hex[:12]
        self.generation: int | None = None
        self._acquired_at = 0.0
        self._stop = threading.Event()
        self._lost: str | None = None
        self._thread: threading.Thread | None = None

    def _generations(self) -> list[int]:
        names = [
            i.base_name.removesuffix(".json") for i in self.store.list() if i.base_name.endswith(".json")
        ]
        return sorted(int(name) for name in names if name.isdigit())

    @staticmethod
    def _name(generation: int) -> str:
        return f"{generation:012d}.json"

    def _read(self, generation: int) -> Holder | None:
        return self._read_record(self._name(generation))

    def _read_record(self, relative: str) -> Holder | None:
        try:
            return Holder(**json.loads(self.store.read(relative)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            log.warning("lease record %s is unreadable; treating it as expired", self.store.uri(relative))
            return None

    def _own_record(self) -> str:
        """The record this holder renews."""
        return self._name(self.generation)

    def _newest_live(self) -> Holder | None:
        """The exclusive holder, if it is live."""
        generations = self._generations()
        holder = self._read(generations[-1]) if generations else None
        return holder if holder is not None and holder.alive(self.clock()) else None

    def sharers(self) -> list[Holder]:
        """The live holders of the `SharedLease` at this root; dead ones' records are deleted."""
        live = []
        for info in self.store.list(SHARED):
            if not info.base_name.endswith(".json"):
                continue
            relative = f"{SHARED}/{info.base_name}"
            holder = self._read_record(relative)
            if holder is not None and holder.alive(self.clock()):
                live.append(holder)
            else:  # its writer is gone: a record nobody renews again
                with contextlib.suppress(FileNotFoundError, OSError):
                    self.store.delete(relative)
        return live

    def _record(self) -> bytes:
        """This writer's record, live for one more TTL."""
        holder = Holder(
            self.owner, socket.gethostname(), os.getpid(), self._acquired_at, self.clock() + self.ttl_s
        )
        return json.dumps(asdict(holder)).encode()

    def acquire(self) -> None:
        """Become the holder, or raise LeaseHeld naming the live one (or the sharers)."""
        self._lost = None
        self._acquired_at = self.clock()
        generations = self._generations()
        newest = generations[-1] if generations else 0
        holder = self._read(newest) if generations else None
        if holder is not None and holder.alive(self.clock()):
            raise LeaseHeld(f"held by {holder.describe(self.clock())}")
        if self.sharers():  # the common case, answered without writing a generation
            raise LeaseHeld(self._shared_by())
        if not self.store.write_new(self._name(newest + 1), self._record()):
            raise LeaseHeld("another writer acquired it at the same moment")
        self.generation = newest + 1
        if self.sharers():  # written before looking, so a sharer starting now sees this generation
            self.release()
            raise LeaseHeld(self._shared_by())
        for old in generations:  # earlier generations are history once a newer one exists
            with contextlib.suppress(FileNotFoundError, OSError):
                self.store.delete(self._name(old))

    def _shared_by(self) -> str:
        sharers = self.sharers()
        now = self.clock()
        return f"shared by {len(sharers)} watcher(s): {', '.join(h.describe(now) for h in sharers)}"

    def renew(self) -> None:
        """Extend this holder's expiry by one TTL from now; LeaseLost if it no longer holds it."""
        self.check()
        self.store.write(self._own_record(), self._record())

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLost as exc:
                self._lost = str(exc)
                return
            except Exception as exc:  # a storage hiccup: try again next beat, the expiry has slack
                log.warning("renewing lease %s failed: %s", self.store.uri(), exc)

    def check(self) -> None:
        """Raise LeaseLost unless this writer still holds the lease."""
        if self._lost:
            raise LeaseLost(self._lost)
        newer = [g for g in self._generations() if g > (self.generation or 0)]
        if newer:
            raise LeaseLost(f"lease {self.store.uri()} was taken over (generation {newer[-1]})")
        holder = self._read(self.generation)
        if holder is None or holder.owner != self.owner or holder.expires_at <= self.clock():
            raise LeaseLost(f"lease {self.store.uri()} expired before the commit")

    def release(self) -> None:
        """Expire this writer's generation (kept, so generations only grow) if it still holds it."""
        self._stop.set()
        if self.generation is None:
            return
        holder = self._read(self.generation)
        if holder is not None and holder.owner == self.owner:
            released = json.dumps({**asdict(holder), "expires_at": 0.0}).encode()
            self.store.write(self._own_record(), released)

    def hold(self) -> Lease:
        """Acquire (raising LeaseHeld when another writer is live) and renew until `release()`."""
        self.acquire()
        self._stop = threading.Event()  # a fresh one: this object may have held and released before
        self._thread = threading.Thread(
            target=self._heartbeat, args=(self._stop,), daemon=True, name="lease-heartbeat"
        )
        self._thread.start()
        return self

    @contextlib.contextmanager
    def held(self) -> Iterator[Lease]:
        """`hold()` while inside, then release."""
        self.hold()
        try:
            yield self
        finally:
            self.release()
            self._thread.join(timeout=5)


class SharedLease(Lease):
    """Held by any number of writers at once, never while the exclusive `Lease` at its root is."""

    def _own_record(self) -> str:
        return f"{SHARED}/{self.owner}.json"

    def acquire(self) -> None:
        self._lost = None
        self._acquired_at = self.clock()
        if not self.store.write_new(f"{SHARED}/{self.owner}.json", self._record()):
            raise LeaseHeld(f"owner id {self.owner} is taken")
        self.generation = 0  # holding; no generation of the exclusive lease is this writer's
        holder = self._newest_live()
        if holder is not None:  # written before looking: an exclusive writer starting now sees this
            self.release()
            raise LeaseHeld(f"held by {holder.describe(self.clock())}")

    def check(self) -> None:
        if self._lost:
            raise LeaseLost(self._lost)
        holder = self._read_record(self._own_record())
        if holder is None or holder.owner != self.owner or holder.expires_at <= self.clock():
            raise LeaseLost(f"shared lease {self.store.uri()} expired before the commit")

    def release(self) -> None:
        self._stop.set()
        if self.generation is not None:
            with contextlib.suppress(FileNotFoundError, OSError):
                self.store.delete(self._own_record())
