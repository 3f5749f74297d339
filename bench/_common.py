"""What the benchmarks share: a local Ray, an embedded broker, fast synthetic records, alternating
repeats with medians, a process-tree memory sampler, and the summary/goal lines.

Each bench compares Argus against a plain baseline *in the same run*, alternating the two so a
noisy neighbour slows both, and prints ratios of medians. Nothing here asserts on timings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/x.py` puts bench/, not the project, on sys.path

# On a loaded 2-core machine Ray's dashboard agent can take longer than the raylet's default
# wait for its ports, and the node then dies during start-up; benchmarks wait longer (this
# process and every child inherit it).
os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning; no GPUs here
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


# ---------------------------------------------------------------- services


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """A private local Ray sized like the CI machine; shut down on exit."""
    import ray

    from app.cluster import apply_serve_env

    apply_serve_env()  # Serve as Argus runs it
    for attempt in range(3):
        try:
            ray.init(
                address="local",  # a Ray of its own, never the cluster a `ray start` recorded
                num_cpus=num_cpus,
                include_dashboard=False,
                configure_logging=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
            )
            break
        except Exception as exc:  # "node timed out during startup" under heavy neighbour load
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            print(f"  (Ray did not start: {exc}; retrying)", flush=True)
            ray.shutdown()
    try:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def embedded_broker(storage: Path) -> Iterator[str]:
    from app.data.broker import EmbeddedBroker

    broker = EmbeddedBroker.create(storage).start()
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def synthetic_pool(unique: int, size: int, seed: int = 0) -> list:
    """`unique` distinct synthetic records; benches cycle through them (rendering is ~1 ms each)."""
    from app.data import synth

    return list(synth.generate(unique, seed=seed, size=size, corrupt_fraction=0.0))


def produce_records(bootstrap: str, topic: str, n: int, pool: list, partitions: int = 4) -> float:
    """Publish n records cycling through `pool` with Argus's own producer; returns seconds."""
    from app.data.kafka import KafkaConnection, ensure_topics
    from app.data.records import record_headers

    kafka = KafkaConnection(bootstrap)
    ensure_topics(kafka, topic, f"{topic}.dlq", partitions)
    producer = kafka.producer()
    started = time.perf_counter()
    failures: list = []
    try:
        for i in range(n):
            record = pool[i % len(pool)]
            future = producer.send(
                topic,
                key=record.user_id.encode(),
                value=record.value,
                headers=record_headers(record.label, record.event_time_ms, record.device_id),
            )
            future.add_errback(failures.append)
        producer.flush()
    finally:
        producer.close()
    if failures:
        raise RuntimeError(f"{len(failures)} records were not acknowledged: {failures[0]}")
    return time.perf_counter() - started


# ---------------------------------------------------------------- measuring


def alternate(runs: dict[str, Callable[[], dict]], repeats: int, label: str = "") -> dict[str, list[dict]]:
    """Run every callable once per round, in rotating order, `repeats` rounds; results per name."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(repeats):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            result = runs[name]()
            results[name].append(result)
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in result.items() if isinstance(v, (int, float)))
            print(
                f"  [{label}{' ' if label else ''}round {round_ + 1}/{repeats}] {name}: {shown}", flush=True
            )
    return results


def median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


class TreeMemorySampler:
    """Peak memory of a process and all its descendants (Ray's raylet, GCS and workers included).

    Samples /proc every `interval_s`. PSS (proportional set size) divides shared pages (the
    object store's /dev/shm, shared libraries) among the processes mapping them, so the sum over
    the tree counts each page once; the RSS sum is printed too and double-counts them. The object
    store's own footprint is the allocated size of the raylet's /dev/shm/plasma* file (tmpfs
    blocks): what Ray Data holds in flight, apart from the worker processes' fixed cost.
    """

    def __init__(self, root_pid: int, interval_s: float = 0.2):
        self.root_pid, self.interval_s = root_pid, interval_s
        self.peak_pss = self.peak_rss = self.peak_object_store = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-memory")

    def __enter__(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = descendants(self.root_pid)
            pss = rss = 0
            for pid in pids:
                p, r = _pss_rss(pid)
                pss, rss = pss + p, rss + r
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.peak_processes = max(self.peak_processes, len(pids))
            self.peak_object_store = max(self.peak_object_store, _object_store_bytes(pids))
            self._stop.wait(self.interval_s)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _object_store_bytes(pids: list[int]) -> int:
    """Allocated bytes of the plasma files mapped by the raylet(s) among `pids`."""
    seen, total = set(), 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"raylet/raylet" not in f.read().split(b"\0", 1)[0]:
                    continue
            directory = f"/proc/{pid}/map_files"
            for name in os.listdir(directory):
                if "plasma" in os.readlink(f"{directory}/{name}"):
                    st = os.stat(f"{directory}/{name}")
                    if st.st_ino not in seen:
                        seen.add(st.st_ino)
                        total += st.st_blocks * 512
        except OSError:
            continue
    return total


def _pss_rss(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes from /proc/<pid>/smaps_rollup; zeros if the process is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, rss


# ---------------------------------------------------------------- reporting


def machine_line() -> str:
    load = os.getloadavg()
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')} · {platform.processor() or platform.machine()} · "
        f"{os.cpu_count()} cores · load {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} · "
        f"python {platform.python_version()}"
    )


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in header]] + [[c if isinstance(c, str) else _fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print(
            "  "
            + "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
        )
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def goal_line(
    goal: str, measured: float, threshold: float, higher_is_better: bool = True, note: str = ""
) -> str:
    ok = measured >= threshold if higher_is_better else measured <= threshold
    sign = "≥" if higher_is_better else "≤"
    line = f"goal: {goal} {sign} {threshold:g}×: measured {measured:.2f}× ({'PASS' if ok else 'MISS'})"
    return f"{line}  {note}" if note else line


@contextlib.contextmanager
def s3_storage(uri: str | None) -> Iterator[str]:
    """`uri` as given (AWS_ENDPOINT_URL and keys from the environment), or, without one, a bucket
    on a moto S3 server started here on 127.0.0.1."""
    if uri:
        yield uri.rstrip("/")
        return
    from moto.server import ThreadedMotoServer

    from app.net import free_port
    from app.storage import s3_client

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per S3 request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
    )
    try:
        s3_client().create_bucket(Bucket="argus-bench")
        yield "s3://argus-bench/ingest"
    finally:
        server.stop()
