"""The replicas' traffic log, read by `python -m app drift` (app/ops/drift.py): per request the
time, version, predicted label, class probabilities and statistics of the transformed image."""

import json
import logging
import threading
import time

import torch

from app.transform import image_statistics

log = logging.getLogger(__name__)


class TrafficLog:
    """What each replica saw, for `python -m app drift`: per request the time, version, predicted
    label, the probability of every class (card order) and per-channel statistics of the
    transformed image.

    Written through the storage layer, so one way serves a local dir, S3 and HDFS: object stores
    cannot append, so rows are buffered and each flush writes one new, immutable JSON-lines object
    `<replica>-<start>-<seq>.jsonl` (every FLUSH_S, sooner at FLUSH_ROWS), from a thread: a put to
    S3 must not stall the event loop that answers requests."""

    FLUSH_S = 2.0
    FLUSH_ROWS = 256
    MAX_BUFFERED = 65536
    """Rows held while the store is unreachable; beyond, the oldest are dropped (logged)."""

    def __init__(self, root: str, replica: str):
        from app.storage import Store

        self._store = Store.at(root)
        # The start time keeps a restarted replica's objects apart from its predecessor's.
        self._prefix, self._seq = f"{replica}-{int(time.time() * 1000)}", 0
        self._rows: list[str] = []
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="traffic-log")
        self._thread.start()

    def record(self, tensor: torch.Tensor, answer: dict) -> None:
        row = {
            "time": time.time(),
            "model_version": answer["model_version"],
            "label": answer["label"],
            "probabilities": [round(p, 4) for p in answer["scores"].values()],
            **image_statistics(tensor),
        }
        with self._lock:
            self._rows.append(json.dumps(row))
            if len(self._rows) > self.MAX_BUFFERED:
                del self._rows[: len(self._rows) - self.MAX_BUFFERED]
                log.warning("traffic log: storage unreachable, dropping the oldest rows")
            if len(self._rows) >= self.FLUSH_ROWS:
                self._wake.set()

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        name = f"{self._prefix}-{self._seq:06d}.jsonl"
        try:
            self._store.write(name, ("\n".join(rows) + "\n").encode())
            self._seq += 1
        except Exception as exc:  # the store is down: keep the rows for the next try, keep serving
            log.warning(
                "traffic log: cannot write %s: %s: %s", self._store.uri(name), type(exc).__name__, exc
            )
            with self._lock:
                self._rows[:0] = rows

    def close(self) -> None:
        """Write what is buffered and stop (replica shutdown)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)  # within Serve's graceful shutdown (20 s by default)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.FLUSH_S)
            self._wake.clear()
            self.flush()
        self.flush()
