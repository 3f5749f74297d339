"""Shared fixtures: one real embedded broker and one real local Ray for the session; each test
gets its own topic and storage dir, so tests never see each other's records.

`make test` runs the suite in two pytest-xdist workers, a test file to each at a time
(`--dist loadfile`): each worker is a session of its own, with its own broker, Ray and servers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from app.config import SETTINGS_ENV, Settings
from app.data.broker import EmbeddedBroker
from app.data.records import record_headers

ROOT = Path(__file__).resolve().parents[1]
TEST_IMAGE_SIZE = 32
ERASED_LETTER_HEADERS = (
    "error",
    "error_reason",
    "source_topic",
    "source_partition",
    "source_offset",
    "source_timestamp",
)
"""All the headers an erased user's dead letter may carry: its coordinates and reason, nothing of theirs."""


def _own_ports() -> None:
    """Under pytest-xdist, this worker's share of the ports `free_port` draws, for it and the
    processes it starts (they inherit the environment): two workers never draw the same port."""
    from app import net

    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or net.PORT_RANGE_ENV in os.environ:
        return
    ports = net._below_ephemeral()
    share = len(ports) // int(count)
    low = ports.start + int(worker.removeprefix("gw")) * share
    os.environ[net.PORT_RANGE_ENV] = f"{low}-{low + share - 1}"
    net._below_ephemeral.cache_clear()


_own_ports()

# The longest files first, so that the two workers finish together: each takes the next file when
# it is done with one, and a long file started last would run on alone (`pytest_collection_modifyitems`).
LONGEST_FILES = (
    "test_multinode.py",
    "test_train.py",
    "test_fl_deployment.py",
    "test_jobs.py",
    "test_serve.py",
    "test_watch.py",
    "test_serve_autoscaling.py",
    "test_ingest.py",
    "test_s3.py",
    "test_bench_gpu.py",
    "test_serve_rollout.py",
    "test_demo.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Unit tests first (a red one shows in the first minutes), then the integration tests, the
    longest files first; within a file, the order it is written in."""

    def rank(item) -> tuple[int, int]:
        path = Path(str(item.fspath))
        if "unit" in path.parts:
            return (0, 0)
        name = path.name
        return (1, LONGEST_FILES.index(name)) if name in LONGEST_FILES else (2, 0)

    items.sort(key=rank)  # stable: files and tests otherwise keep their collected order


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    with EmbeddedBroker.create(tmp_path_factory.mktemp("broker")) as running:
        yield running.bootstrap_servers


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API server (moto) on 127.0.0.1, configured the standard way: AWS_ENDPOINT_URL,
    keys and region in the environment, which pyarrow, boto3 and MLflow all read. Set before Ray
    starts, so Ray's workers (ingest tasks, training workers, Serve replicas) inherit it too."""
    from moto.server import ThreadedMotoServer

    from app.net import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per S3 request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="argus-test",
        AWS_SECRET_ACCESS_KEY="argus-test",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
    )
    yield url
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh bucket on the S3 server; returns its name."""
    from app.storage import s3_client

    name = f"argus-{uuid.uuid4().hex[:10]}"
    s3_client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ray_cluster(s3_endpoint):
    """A local Ray sized like CI's machine; Ray Train's helpers and Serve share it. Yields the
    port of its Prometheus metrics endpoint."""
    import ray

    from app.cluster import apply_serve_env
    from app.net import free_port

    apply_serve_env()  # Serve as Argus runs it
    metrics_port = free_port()
    # Processes export metrics every second rather than every ten, so short tests see them. One
    # logical GPU: `--use-gpu` actor pools schedule, and torch, finding no CUDA, runs them on CPU.
    ray.init(
        address="local",  # a Ray of its own, whatever /tmp/ray/ray_current_cluster says
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        configure_logging=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    yield metrics_port
    ray.shutdown()


# Ray's metrics endpoint renders every series the session has made (Ray Data adds ~130 KB per
# dataset, so a scrape late in a full run takes seconds on loaded cores). Wait for each answer, one
# request at a time, rather than abandoning requests the agent still has to render.
SCRAPE_TIMEOUT_S = 180


def _samples(metrics_port: int, names, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, list[str]]:
    import requests

    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s).text
    return {n: [line for line in text.splitlines() if line.startswith((n + "{", n + " "))] for n in names}


def scrape(metrics_port: int, *names: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, list[str]]:
    """Poll Ray's Prometheus endpoint until every metric name has a sample; return their lines."""
    import requests

    deadline = time.monotonic() + timeout_s
    found: dict[str, list[str]] = {}
    late = None
    while time.monotonic() < deadline:
        try:
            found = _samples(metrics_port, names, max(1.0, deadline - time.monotonic()))
        except requests.RequestException as exc:
            late = exc
            time.sleep(1)
            continue
        if all(found.values()):
            return found
        time.sleep(1)
    missing = [n for n, lines in found.items() if not lines] or list(names)
    raise AssertionError(f"metrics never exported: {missing} (last scrape error: {late})")


class MetricsWatcher:
    """Scrapes Ray's Prometheus endpoint in a thread for as long as the `with` block runs and keeps
    every sample of the named metrics. Ray keeps a gauge on the endpoint for two report intervals
    after its last set, so a run's gauges are seen for certain only by watching while it runs."""

    def __init__(self, metrics_port: int, *names: str, match: str = ""):
        # `match` keeps only samples containing it (a topic, a run name): samples that earlier tests
        # left on the endpoint must not end the wait in `__exit__` before this test's arrive.
        self.metrics_port, self.names, self.match = metrics_port, names, match
        self.seen: dict[str, list[str]] = {n: [] for n in names}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import requests

        while True:
            try:
                for name, lines in _samples(self.metrics_port, self.names).items():
                    self.seen[name] += [line for line in lines if self.match in line]
            except requests.RequestException:  # the agent restarting; the next poll catches up
                pass
            if self._stop.wait(1):
                return

    def __enter__(self) -> MetricsWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # What was set just before the block ended is exported within one report interval.
        deadline = time.monotonic() + 5
        while not all(self.seen.values()) and time.monotonic() < deadline:
            time.sleep(0.25)
        self._stop.set()
        self._thread.join()


@pytest.fixture
def root(tmp_path) -> Path:
    """A test's storage root, as a local path (for tests that need no broker)."""
    return tmp_path / "data"


@pytest.fixture
def snapshots(root):
    """The snapshot folders (the old layout) under `root`."""
    from app.data.legacy import LegacySnapshots

    return LegacySnapshots.at(str(root))


@pytest.fixture
def settings(tmp_path, broker) -> Settings:
    return Settings(
        bootstrap_servers=broker,
        topic=f"t-{uuid.uuid4().hex[:8]}",
        storage=str(tmp_path / "data"),
        image_size=TEST_IMAGE_SIZE,
        model="cnn",
        partitions=3,
    )


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment without the variables that would point a child at another test's
    broker, storage, MLflow or Ray (`mlflow.set_tracking_uri` exports MLFLOW_TRACKING_URI)."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    return {**env, **overrides}


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m app ARGS` in a subprocess, as a user would run it."""
    full_env = child_env(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """`argus ARGS` in this process (`app.__main__.main`), with exactly `env` of the Settings
    variables set: seconds faster than `run_cli` for what ends before Ray or Kafka work (argument
    and configuration errors). What `main` sets process-wide is restored after the test."""
    from app import cluster
    from app.__main__ import main

    monkeypatch.setattr(cluster, "_to_files", cluster._to_files)
    for name in ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "RAY_COLOR_PREFIX"):  # main's setdefault
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, env: dict[str, str] | None = None) -> CliResult:
        for name in SETTINGS_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            returncode = main(list(args))
        except SystemExit as exit:  # argparse's errors and --help
            returncode = exit.code
        captured = capsys.readouterr()
        return CliResult(returncode, captured.out, captured.err)

    return run


def missing_dependency(what: str) -> None:
    """Skip a test whose tool or file is absent here; under CI (`CI` set), where .ci/run provides
    every one, fail instead: a skip there would hide a part of the suite that never ran."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI runs every test)")
    pytest.skip(f"{what} (under CI this fails)")


def settings_args(settings: Settings) -> list[str]:
    return [
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic",
        settings.topic,
        "--storage",
        settings.storage,
        "--image-size",
        str(settings.image_size),
        "--model",
        settings.model,
        "--partitions",
        str(settings.partitions),
    ]


def table_args(settings: Settings) -> list[str]:
    """`--catalog` and `--table`, for the commands that read or write the table."""
    return [*(["--catalog", settings.catalog] if settings.catalog else []), "--table", settings.table]


TRAIN_GAUGES = ("ray_argus_train_loss", "ray_argus_train_images_per_second", "ray_argus_train_epoch_seconds")


class Trained(NamedTuple):
    settings: Settings
    snapshot: object
    train_config: object
    report: object
    train_gauges: dict[str, list[str]]  # every sample of TRAIN_GAUGES exported while it trained


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One `mlflow server` with basic auth and a user for Argus (tests/mlflow_server.py), shared by
    the session's tests of a registry behind HTTP."""
    from mlflow_server import start_mlflow_server

    with start_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture(scope="session")
def trained(tmp_path_factory, broker, ray_cluster):
    """One snapshot of synthetic records and one registered model, shared by train and serve tests."""
    from app.config import IngestConfig, ProduceConfig, TrainConfig
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.train import train

    settings = Settings(
        bootstrap_servers=broker,
        topic=f"t-{uuid.uuid4().hex[:8]}",
        storage=str(tmp_path_factory.mktemp("trained") / "data"),
        image_size=TEST_IMAGE_SIZE,
        model="cnn",
        partitions=2,
    )
    produce(
        settings,
        ProduceConfig(synthetic=480, seed=5, source_image_size=TEST_IMAGE_SIZE, corrupt_fraction=0.02),
        settings.kafka_connection(),
    )
    snapshot = ingest(settings, IngestConfig(), settings.kafka_connection())
    # Five epochs: under the cosine a 3-epoch model still confuses `normal` (recall 0.17), and
    # its skewed predictions alone would read as drift in the serve tests.
    train_config = TrainConfig(epochs=5, num_workers=2, batch_size=32, lr=3e-3, seed=11, max_failures=0)
    with MetricsWatcher(ray_cluster, *TRAIN_GAUGES) as watcher:
        report = train(settings, train_config)
    return Trained(settings, snapshot, train_config, report, watcher.seen)


def device_keys(directory: Path, names: list[str]) -> dict[str, Path]:
    """EC P-384 key pairs in OpenSSH format, as SuperNodes use: `<name>` (private), `<name>.pub`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory.mkdir(parents=True)
    keys = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP384R1())
        private = directory / name
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            )
        )
        private.chmod(0o600)
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        (directory / f"{name}.pub").write_bytes(public + f" {name}\n".encode())
        keys[name] = private
    return keys


def start_device(
    log_dir: Path, name: str, folder: Path, address: str, ca: Path, key: Path
) -> subprocess.Popen:
    """`argus device` for `folder`, its output in `log_dir/<name>.log`; SIGTERM stops it and its
    SuperNode's tree."""
    log = (log_dir / f"{name}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "app", "device", "--data-dir", str(folder), "--superlink", address,
         "--root-certificates", str(ca), "--auth-key", str(key)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env=child_env(PYTHONPATH=str(ROOT)),
    )  # fmt: skip


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate it signed for 127.0.0.1 and localhost (with its key), and an
    unrelated CA, as PEM files in `directory`: `ca`, `server_cert`, `server_key`, `wrong_ca`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: x509.Name, signer, extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    def authority(name: str) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        return key, certificate(
            name, key, issuer, key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
        )

    ca_key, ca = authority("Argus test CA")
    _, wrong_ca = authority("Some other CA")
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = certificate(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        [
            (x509.SubjectAlternativeName(names), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    pem = serialization.Encoding.PEM
    files = {
        "ca": ca.public_bytes(pem),
        "wrong_ca": wrong_ca.public_bytes(pem),
        "server_cert": server.public_bytes(pem),
        "server_key": server_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, content in files.items():
        paths[name] = directory / f"{name}.pem"
        paths[name].write_bytes(content)
    return paths


def send(settings, records) -> list[tuple[int, int]]:
    """Publish (key, value, label, event_time) through a batching producer, device `dev-1`;
    return (partition, offset)s."""
    producer = settings.kafka_connection().producer(linger_ms=50)
    futures = [
        producer.send(
            settings.topic, key=key.encode(), value=value, headers=record_headers(label, event_time, "dev-1")
        )
        for key, value, label, event_time in records
    ]
    producer.flush()
    producer.close()
    return [(f.get().partition, f.get().offset) for f in futures]
