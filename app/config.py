"""Argus's one typed configuration: defaults in code, overridden by environment variables and
then CLI flags (CONTRACT.md §3), validated once here so a bad value stops the command with one
clear line (exit 2) before any Ray or Kafka work starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from app.data.kafka import KafkaConnection
from app.data.kafka_config import load_kafka_config
from app.errors import ConfigError
from app.net import host_port

MODELS = ("resnet50", "resnet18", "cnn")
AMP_MODES = ("auto", "off", "bf16", "fp16")
DEFAULT_TOPIC = "user_behavior_images"
DEFAULT_MODEL_NAME = "argus-behavior"
DEFAULT_TABLE = "argus.behavior_images"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True)
class Settings:
    """Options every command shares (CONTRACT.md §3)."""

    bootstrap_servers: str | None = None
    """Kafka bootstrap servers, `host:port[,host:port]`; None uses the embedded broker."""
    topic: str = DEFAULT_TOPIC
    """Topic of behaviour-image records; dead letters go to `<topic>.dlq`."""
    storage: str = "./argus-data"
    """Local path or pyarrow filesystem URI (s3://, hdfs://) for the table's warehouse and checkpoints."""
    mlflow_uri: str | None = None
    """MLflow tracking URI; None means a SQLite file under a local storage dir."""
    ray_address: str | None = None
    """Ray cluster address; None starts (or joins, under `ray job submit`) a local Ray."""
    image_size: int = 224
    """Side of the square images the models see."""
    model: str = "resnet50"
    """Architecture: resnet50, resnet18 or cnn (a small CNN for CPU runs)."""
    classes: tuple[str, ...] | None = None
    """Fixed class list; None means the sorted distinct labels of the training data."""
    partitions: int = 4
    """Partitions for topics Argus creates."""
    replication_factor: int = 1
    """Replication factor of topics Argus creates."""
    kafka_config: str | None = None
    """File of librdkafka properties (`security.protocol`, `ssl.*`, `sasl.*`, ...) applied to every
    Kafka client Argus creates; see `app.data.kafka_config.load_kafka_config`."""
    kafka_properties: dict[str, str] = dataclasses.field(default_factory=dict, init=False, repr=False)
    """`kafka_config`'s properties, parsed and checked once here."""
    model_name: str = DEFAULT_MODEL_NAME
    """Registered model name in MLflow."""
    catalog: str | None = None
    """Iceberg catalog URI (SQLAlchemy or REST); None: SQLite under a local storage dir."""
    table: str = DEFAULT_TABLE
    """The Iceberg table of behaviour images, `namespace.table`."""

    def __post_init__(self) -> None:
        _require(self.model in MODELS, f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        _require(8 <= self.image_size <= 1024, f"--image-size must be in 8..1024, got {self.image_size}")
        _require(self.partitions >= 1, f"--partitions must be >= 1, got {self.partitions}")
        _require(
            self.replication_factor >= 1, f"--replication-factor must be >= 1, got {self.replication_factor}"
        )
        _require(bool(self.topic.strip()), "--topic must not be empty")
        if self.classes is not None:
            _require(len(self.classes) >= 2, "--classes needs at least two class names")
            _require(len(set(self.classes)) == len(self.classes), "--classes has duplicates")
        if self.bootstrap_servers is not None:
            for server in self.bootstrap_servers.split(","):
                host_port(server)
        _require(
            len(self.table.split(".")) >= 2 and all(self.table.split(".")),
            f"--table must be namespace.table, got {self.table!r}",
        )
        for flag, uri in (
            ("--mlflow-uri", self.mlflow_uri),
            ("--storage", self.storage),
            ("--catalog", self.catalog),
        ):
            # A URI is logged, tagged in MLflow and part of `ray job submit` entrypoints.
            _require(
                urlsplit(uri or "").password is None,
                f"{flag} carries a password: give credentials through the environment "
                "(MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN; "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; the catalog database's own variables, e.g. "
                "PGPASSWORD), never in a URI",
            )
        if self.kafka_config is not None:
            self.kafka_properties = load_kafka_config(self.kafka_config)

    def kafka_connection(self, bootstrap_servers: str | None = None):
        """The `app.data.kafka.KafkaConnection` to `bootstrap_servers` (default: the configured ones) with
        `--kafka-config`'s properties: what every Kafka client Argus creates is built from."""
        servers = bootstrap_servers or self.bootstrap_servers
        _require(servers is not None, "no Kafka bootstrap servers configured")
        return KafkaConnection(servers, self.kafka_properties)

    @property
    def dlq_topic(self) -> str:
        return f"{self.topic}.dlq"

    @property
    def is_local_storage(self) -> bool:
        return "://" not in self.storage or self.storage.startswith("file://")

    @property
    def local_storage_path(self) -> Path:
        return Path(self.storage.removeprefix("file://")).resolve()

    @property
    def tracking_uri(self) -> str:
        if self.mlflow_uri:
            return self.mlflow_uri
        _require(self.is_local_storage, "--mlflow-uri is required when --storage is not a local path")
        return f"sqlite:///{self.local_storage_path / 'mlflow.db'}"

    def uri(self, *parts: str) -> str:
        """A path under the storage root, as a URI pyarrow understands."""
        root = str(self.local_storage_path) if self.is_local_storage else self.storage.rstrip("/")
        return "/".join([root, *parts])


@dataclass(kw_only=True)
class ProduceConfig:
    synthetic: int | None = None
    """Publish this many synthetic behaviour images."""
    from_dir: str | None = None
    """Publish real images laid out as DIR/<label>/<file>."""
    seed: int = 0
    users: int = 50
    source_image_size: int = 64
    """Side of the synthetic images as the 'device' captures them."""
    late_fraction: float = 0.05
    corrupt_fraction: float = 0.02
    linger_ms: int = 20
    batch_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        _require(
            (self.synthetic is None) != (self.from_dir is None),
            "produce needs exactly one of --synthetic N or --from-dir DIR",
        )
        if self.synthetic is not None:
            _require(self.synthetic >= 1, f"--synthetic must be >= 1, got {self.synthetic}")
        if self.from_dir is not None:
            _require(Path(self.from_dir).is_dir(), f"--from-dir {self.from_dir!r} is not a directory")
        _require(self.users >= 1, "--users must be >= 1")
        _require(0 <= self.late_fraction <= 1, "--late-fraction must be in [0, 1]")
        _require(0 <= self.corrupt_fraction <= 1, "--corrupt-fraction must be in [0, 1]")
        _require(self.source_image_size >= 8, "--source-image-size must be >= 8")


@dataclass(kw_only=True)
class IngestConfig:
    group: str = "argus-ingest"
    """Consumer group whose committed offsets mirror the table's (the table's are the truth)."""
    max_record_bytes: int = 10 * 1024 * 1024
    """Larger record values go to the dead-letter topic."""
    allowed_lateness_s: float = 3600.0
    """Records whose event time is this far behind the snapshot's watermark are flagged late."""
    features: str | None = None
    """`resnet50` adds a 2048-d feature column from a ResNet-50 backbone."""
    weights: str | None = None
    """Local path of backbone weights; absent means random initialisation, with a warning."""
    use_gpu: bool = False
    """Run preprocessing actors on GPUs (resize/normalise and features there)."""
    concurrency: int | None = None
    """Most preprocessing actors in the pool; default one per cluster CPU (per GPU with `use_gpu`)."""
    decode_threads: int | None = None
    """Threads decoding images in each preprocessing actor; default 1 on CPU, where there is an actor
    per core (more only contend for the GIL), and the cluster's CPUs per GPU for GPU actors."""
    batch_size: int = 64
    """Records per map_batches call."""
    records_per_block: int = 512
    """Records per block a Kafka read task yields: bounds memory, keeps the stream moving."""
    dlq_max_bytes: int = 1_000_000
    """Dead letters with a larger value go to `<storage>/dlq/` and the DLQ topic gets a pointer
    record (Kafka's default `max.message.bytes` is about 1 MB)."""
    strict: bool = False
    """Fail instead of continuing when retention deleted records before they were ingested."""
    keep_source: bool = False
    """Keep each record's encoded image in the snapshot (`source`): training at another
    `--image-size` then resizes from the snapshot, without needing Kafka's retention."""
    start_from: str | None = None
    """`--from`: where a table with no commit yet starts reading: `earliest` (the log start; what
    retention deleted before is not this table's loss) or a time (ISO 8601, or epoch ms): each
    partition's first record at or after it. None: offset 0, retention's deletions counted lost.
    A table that has commits resumes from them, whatever this says."""

    def __post_init__(self) -> None:
        if self.start_from is not None:
            start_time_ms(self.start_from)  # a bad value fails here, as a config error
        _require(self.max_record_bytes > 0, "--max-record-bytes must be > 0")
        _require(self.dlq_max_bytes > 0, "--dlq-max-bytes must be > 0")
        _require(self.allowed_lateness_s >= 0, "--allowed-lateness-s must be >= 0")
        _require(self.features in (None, "resnet50"), f"--features must be resnet50, got {self.features!r}")
        _require(self.concurrency is None or self.concurrency >= 1, "--concurrency must be >= 1")
        _require(self.decode_threads is None or self.decode_threads >= 1, "--decode-threads must be >= 1")
        _require(self.batch_size >= 1, "--batch-size must be >= 1")


def start_time_ms(start_from: str) -> int | None:
    """`--from`'s time in epoch ms; None for `earliest`."""
    if start_from == "earliest":
        return None
    if re.fullmatch(r"\d{1,15}", start_from):
        return int(start_from)
    try:
        moment = datetime.datetime.fromisoformat(start_from.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"--from must be earliest, an ISO 8601 time or epoch ms, got {start_from!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)  # Kafka timestamps are UTC
    return int(moment.timestamp() * 1000)


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 3
    batch_size: int = 32
    """Per-worker micro-batch size."""
    num_workers: int | tuple[int, int] = 2
    """Training workers, or a (min, max) range for an elastic worker group."""
    use_gpu: bool = False
    cpus_per_worker: float = 0.5
    """Logical CPUs per worker: a fraction leaves room for Ray Data on small machines."""
    amp: str = "auto"
    grad_accum: int = 1
    lr: float = 3e-3
    """Peak learning rate: reached after the warmup, then decayed along the cosine."""
    seed: int = 0
    snapshots: int | None = None
    """The table snapshot id to train on (`--snapshots ID`); None: the table's current snapshot."""
    val_fraction: float = 0.2
    """Newest share of records by event time held out: its older half validates (picks the epoch),
    its newest half tests (judges promotion); see `app.selection`."""
    balance: str = "weights"
    """Uneven classes: `weights` (class-weighted loss), `sampler` (oversample) or `none`."""
    augment: str = "light"
    """`none`, `light` (screenshots: no flips, mild zoom/shift, colour) or `strong`."""
    weight_decay: float = 0.05
    label_smoothing: float = 0.0
    warmup_fraction: float = 0.1
    """Share of the steps of linear warmup before the cosine decay."""
    weights: str | None = None
    """Local ResNet state dict the backbone starts from (resnet18/resnet50); every tensor must fit."""
    run_name: str | None = None
    """Rerunning with the same name resumes from its last checkpoint."""
    max_failures: int = 2
    resize_check_s: float = 60.0
    """How often an elastic group looks for room to grow (Ray Train's default); growing restarts
    it, with more workers, from its last checkpoint."""
    promote_if_better: bool = False
    """Move the serving alias to the new version only if it beats the champion on the test slice."""
    fail_at_epoch: int | None = None
    """Fault injection: rank 1 dies mid-way through this epoch on the first attempt."""

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        if isinstance(self.num_workers, str):
            low, _, high = self.num_workers.partition("-")
            _require(
                low.isdigit() and (not high or high.isdigit()),
                f"--num-workers must be N or MIN-MAX, got {self.num_workers!r}",
            )
            self.num_workers = (int(low), int(high)) if high else int(low)
        counts = self.num_workers if isinstance(self.num_workers, tuple) else (self.num_workers,)
        _require(
            min(counts) >= 1 and counts == tuple(sorted(counts)),
            f"--num-workers must be >= 1 (and MIN <= MAX), got {self.num_workers}",
        )
        _require(self.cpus_per_worker > 0, "--cpus-per-worker must be > 0")
        _require(self.resize_check_s > 0, "--resize-check-s must be > 0")
        _require(self.amp in AMP_MODES, f"--amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        _require(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        _require(self.lr > 0, "--lr must be > 0")
        _require(0 < self.val_fraction < 1, "--val-fraction must be in (0, 1)")
        _require(self.balance in ("weights", "sampler", "none"), "--balance must be weights, sampler or none")
        _require(self.augment in ("none", "light", "strong"), "--augment must be none, light or strong")
        _require(self.weight_decay >= 0, "--weight-decay must be >= 0")
        _require(0 <= self.label_smoothing < 1, "--label-smoothing must be in [0, 1)")
        _require(0 <= self.warmup_fraction < 1, "--warmup-fraction must be in [0, 1)")
        _require(self.max_failures >= 0, "--max-failures must be >= 0")
        _require(
            self.snapshots is None or type(self.snapshots) is int,  # bool is an int too
            f"--snapshots takes one table snapshot id (an integer), got {self.snapshots!r}",
        )

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


MAX_REPLICAS = 64


def parse_replicas(value: int | str) -> tuple[int, int] | None:
    """`serve --replicas`: N (fixed: (N, N)) or MIN-MAX (autoscaling); None if it is neither."""
    matched = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", str(value).strip())
    if matched is None:
        return None
    low, high = int(matched[1]), int(matched[2] or matched[1])
    return (low, high) if 1 <= low <= high <= MAX_REPLICAS else None


@dataclass(kw_only=True)
class ServeConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    replicas: int | str = 1
    """N replicas, or "MIN-MAX": Serve autoscaling between them (`parse_replicas`)."""
    proxy_location: str = "EveryNode"
    """Serve's HTTP proxies on every node (what a load balancer in front expects), or on the head
    only: nodes sharing one host would all bind the same port."""
    alias: str = "champion"
    detach: bool = False
    max_batch_size: int = 16
    batch_wait_timeout_s: float = 0.01
    max_body_bytes: int = 10 * 1024 * 1024
    poll_s: float = 2.0
    """How often replicas check the registry alias for a new version."""

    def __post_init__(self) -> None:
        _require(0 < self.http_port < 65536, f"--http-port must be in 1..65535, got {self.http_port}")
        _require(
            parse_replicas(self.replicas) is not None,
            f"--replicas must be N or MIN-MAX with 1 <= MIN <= MAX <= {MAX_REPLICAS}, got {self.replicas!r}",
        )
        _require(
            self.proxy_location in ("EveryNode", "HeadOnly"),
            f"--proxy-location must be EveryNode or HeadOnly, got {self.proxy_location!r}",
        )
        _require(self.max_batch_size >= 1, "--max-batch-size must be >= 1")
        _require(self.batch_wait_timeout_s >= 0, "--batch-wait-timeout-s must be >= 0")
        _require(self.max_body_bytes > 0, "--max-body-bytes must be > 0")


SETTINGS_ENV = {
    "KAFKA_BOOTSTRAP_SERVERS": "bootstrap_servers",
    "KAFKA_CONFIG": "kafka_config",
    "ARGUS_TOPIC": "topic",
    "ARGUS_STORAGE": "storage",
    "MLFLOW_TRACKING_URI": "mlflow_uri",
    "RAY_ADDRESS": "ray_address",
    "ARGUS_CATALOG": "catalog",
}
"""Environment variable → Settings field (CONTRACT.md §3). A process that starts Argus commands for
another broker, storage or registry drops these (`mlflow.set_tracking_uri` exports its own)."""


def env_defaults() -> dict:
    """Settings fields taken from the environment; flags override them."""
    return {name: os.environ[var] for var, name in SETTINGS_ENV.items() if os.environ.get(var)}


def from_namespace(cls, namespace, **overrides):
    """Build dataclass `cls` from the argparse attributes that share its field names."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(namespace).items() if k in names and v is not None}
    values.update(overrides)
    return cls(**values)


def build_settings(namespace) -> Settings:
    values = env_defaults()
    values.update(
        {
            k: v
            for k, v in vars(namespace).items()
            if k in {f.name for f in dataclasses.fields(Settings)} and v is not None
        }
    )
    if isinstance(values.get("classes"), str):
        values["classes"] = tuple(c.strip() for c in values["classes"].split(",") if c.strip())
    return Settings(**values)
