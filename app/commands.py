"""The CLI's commands (CONTRACT.md §3): each parses → typed config → one call into a stage.

`COMMANDS` is the table `python -m app` is built from: each command's help, its flags (an adder of
`app.options` or `app.model_options`), the typed configs they fill, as `module:Class`, and a
handler that gets the settings, the parsed flags and one instance of each config, and calls one
function of its stage module. Stage modules are imported inside the handlers, so `--help` answers
without importing Ray or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from app import model_options, options
from app.config import Settings
from app.errors import ConfigError

log = logging.getLogger("argus")


# How long `serve` may take to stop after Ctrl-C or SIGTERM (Serve's own graceful shutdown waits
# up to 30 s) before it prints every thread's stack and exits 1.
SERVE_STOP_GRACE_S = 120.0


def _stop_event(grace_s: float | None = None) -> threading.Event:
    """Set by SIGINT or SIGTERM: foreground commands end cleanly instead of dying mid-write. With
    `grace_s`, a stop that hangs (in Ray's or Serve's shutdown) still ends the process that long
    after the signal, with every thread's stack on stderr to say where it hung, and exit 1."""
    stop = threading.Event()

    def request_stop(_signum, _frame) -> None:
        if grace_s is not None and not stop.is_set():
            faulthandler.dump_traceback_later(grace_s, exit=True)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return stop


# ---------------------------------------------------------------- handlers: configs → one stage call


def _demo(settings: Settings, args) -> int:
    from app.ops.demo import run_demo

    return run_demo(settings, args)


def _broker(settings: Settings, args) -> int:
    from app.data import broker

    settings.local_storage_path.mkdir(parents=True, exist_ok=True)
    return broker.run_foreground(settings.local_storage_path, args.port)


def _produce(settings: Settings, args, cfg) -> int:
    from app.data.broker import kafka_endpoint
    from app.data.produce import produce

    with kafka_endpoint(settings) as kafka:
        print(produce(settings, cfg, kafka))
    return 0


def _ingest(settings: Settings, args, cfg) -> int:
    from app.cluster import ray_session, require_local_gpu
    from app.data.broker import kafka_endpoint
    from app.data.ingest import ingest

    require_local_gpu(settings, cfg.use_gpu)
    with kafka_endpoint(settings) as kafka, ray_session(settings):
        print(ingest(settings, cfg, kafka))
    return 0


def _redrive(settings: Settings, args, cfg) -> int:
    from app.cluster import ray_session, require_local_gpu
    from app.data.broker import kafka_endpoint
    from app.data.redrive import redrive

    require_local_gpu(settings, cfg.use_gpu)
    with kafka_endpoint(settings) as kafka, ray_session(settings):
        print(redrive(settings, cfg, kafka))
    return 0


def _migrate(settings: Settings, args) -> int:
    from app.data.legacy import LegacySnapshots
    from app.data.migrate import migrate

    snapshots = LegacySnapshots.at(settings.uri())
    print(migrate(snapshots, settings.storage, settings.catalog, settings.table, settings.topic))
    return 0


def _log_ends(settings: Settings) -> dict[int, int] | None:
    """The topic's proven log ends, recorded with an erasure: the user's records below them are the
    erased ones. None where no broker holds the topic (none configured or running, or unreachable):
    the erasure then covers every record of the user, later ones too."""
    from app.data import probe
    from app.data.broker import recorded_broker

    servers = settings.bootstrap_servers
    if not servers and settings.is_local_storage:
        servers = recorded_broker(settings.local_storage_path)
    if not servers:
        return None
    try:
        connection = settings.kafka_connection(servers)
        ends = probe.probe_partitions(
            connection, settings.topic, probe.partitions_of(connection, settings.topic)
        )
    except Exception as exc:  # the erasure must not wait on Kafka: it then covers every record
        log.warning("erase: the topic's ends could not be read (%s); every record of the user is erased", exc)
        return None
    return {p: end.end for p, end in ends.items()}


def _erase(settings: Settings, args, cfg) -> int:
    from app.data.erasure import erase_dead_letters, erase_user
    from app.data.table import ImageTable
    from app.storage import Store

    # A storage without the table holds none of the user's rows: say so rather than create one.
    images = ImageTable.at(settings.storage, settings.catalog, settings.table, create=False)
    ends = _log_ends(settings)
    report = erase_user(images, cfg.user, ends)
    report.dead_letter_payloads = erase_dead_letters(Store.at(settings.uri("dlq")), cfg.user)
    print(report)
    # A user is erased from every table of the topic: `ingest --from` made the others from it.
    for sibling in images.siblings(settings.topic):
        print(f"{sibling.identifier}: {erase_user(sibling, cfg.user, ends)}")
    print(report.outside_the_table())
    return 0


def _watch(settings: Settings, args, cfg, ingest_cfg) -> int:
    from app.cluster import ray_session, require_local_gpu
    from app.data.broker import kafka_endpoint
    from app.data.watch import watch

    require_local_gpu(settings, ingest_cfg.use_gpu)
    with kafka_endpoint(settings) as kafka, ray_session(settings):
        # Handlers set after ray.init: Ray's own SIGTERM handler would abort the process (exit -6).
        alerts = watch(settings, cfg, ingest_cfg, kafka, _stop_event())
    print(f"watch stopped after raising {alerts} lag alerts")
    return 0


def _lag(settings: Settings, args, cfg) -> int:
    from app.cluster import ray_session
    from app.data.backlog import run_lag
    from app.data.broker import kafka_endpoint

    with kafka_endpoint(settings) as kafka, ray_session(settings):  # Ray: the gauges' endpoint
        backlog = run_lag(settings, cfg, kafka, _stop_event())
    for entry in backlog:
        print(f"{settings.topic} {entry}")
    return 0


def _train(settings: Settings, args, cfg) -> int:
    from app.cluster import ray_session, require_local_gpu
    from app.train import train

    require_local_gpu(settings, cfg.use_gpu)
    if cfg.weights:  # a file that does not fit the backbone fails here, in one line, not in the workers
        from app.model import build_model

        build_model(settings.model, 2, weights=cfg.weights)
    with ray_session(settings):
        report = train(settings, cfg)
    print(
        f"registered {settings.model_name} v{report.version} (run {report.run_id}): "
        f"val_accuracy {report.metrics['val_accuracy']:.3f}, test_accuracy "
        f"{report.metrics['test_accuracy']:.3f} after {report.epochs} epochs"
    )
    if report.verdict is not None:
        outcome = "promoted" if report.verdict.promoted else "not promoted"
        print(f"v{report.version} {outcome}: {report.verdict.reason}")
    return 0


def _federate(settings: Settings, args, cfg) -> int:
    from app.fl import federate

    print(federate(settings, cfg))
    return 0


def _device(settings: Settings, args, cfg) -> int:
    from app.fl.device import run_device

    return run_device(cfg)


def _serve(settings: Settings, args, cfg, policy) -> int:
    from app import serve
    from app.cluster import ray_session
    from app.serve.access import TOKENS_ENV

    if not policy.api_tokens and os.environ.get(TOKENS_ENV):  # --api-tokens wins over the environment
        policy = dataclasses.replace(policy, api_tokens=os.environ[TOKENS_ENV])
    policy.check_host(cfg.http_host)  # before Ray starts: an open API off loopback is a bad argument
    if cfg.detach:
        if not settings.ray_address:
            raise ConfigError("--detach needs a running cluster: pass --ray-address (or set RAY_ADDRESS)")
        with ray_session(settings):
            print(f"deployed on {serve.deploy_detached(settings, cfg, policy)}")
        return 0
    with ray_session(settings):
        # Handlers set after ray.init: Ray's own SIGTERM handler would abort the process (exit -6).
        serve.serve_until(settings, cfg, _stop_event(SERVE_STOP_GRACE_S), policy)
    return 0


def _promote(settings: Settings, args, cfg) -> int:
    from app.serve.promote import promote

    print(promote(settings, cfg))
    return 0


def _drift(settings: Settings, args, cfg) -> int:
    from app.cluster import ray_session
    from app.ops.drift import drift

    # A dashboard (http://) address is for job submission; the statistics run on a local Ray.
    local = (
        dataclasses.replace(settings, ray_address=None)
        if (settings.ray_address or "").startswith("http")
        else settings
    )
    with ray_session(local):
        print(drift(settings, cfg))
    return 0


@dataclass(frozen=True)
class Command:
    help: str
    handler: Callable[..., int]
    """Called with the settings, the parsed flags and one instance of each of `configs`."""
    add_options: Callable[[argparse.ArgumentParser], None] | None = None
    configs: tuple[str, ...] = ()
    """The typed configs its flags fill, as `module:Class` (imported when the command runs)."""
    needs_kafka: bool = False
    """Fail at the edge (exit 2) when configured bootstrap servers do not answer."""


COMMANDS = {
    "demo": Command(
        "the whole job on embedded defaults: broker, produce, ingest, train, register, serve, "
        "a sample prediction",
        _demo,
        model_options.add_demo,
        needs_kafka=True,
    ),
    "broker": Command(
        "run the embedded Kafka-compatible broker in the foreground", _broker, options.add_broker
    ),
    "produce": Command(
        "publish records: --synthetic N or --from-dir DIR",
        _produce,
        options.add_produce,
        ("app.config:ProduceConfig",),
        needs_kafka=True,
    ),
    "ingest": Command(
        "Kafka → Ray Data preprocessing → one commit of the Iceberg table, offsets and rows together",
        _ingest,
        options.add_ingest,
        ("app.config:IngestConfig",),
        needs_kafka=True,
    ),
    "train": Command(
        "Ray Train on a table snapshot → checkpoints → a new registered model version",
        _train,
        model_options.add_train,
        ("app.config:TrainConfig",),
    ),
    "federate": Command(
        "federated rounds (clients as Ray actors, or devices over TLS) → a new registered version",
        _federate,
        model_options.add_federate,
        ("app.fl.config:FederateConfig",),
    ),
    "device": Command(
        "a federated-learning device: trains on --data-dir DIR/<label>/* and talks to a SuperLink over TLS",
        _device,
        model_options.add_device,
        ("app.fl.device:DeviceConfig",),
    ),
    "serve": Command(
        "deploy the Ray Serve application on the model alias",
        _serve,
        model_options.add_serve,
        ("app.config:ServeConfig", "app.serve.access:AccessConfig"),
    ),
    "promote": Command(
        "point the alias at VERSION; waits until every replica of a running deployment serves it",
        _promote,
        model_options.add_promote,
        ("app.serve.promote:PromoteConfig",),
    ),
    "watch": Command(
        "keep ingesting in micro-batches; alert when end-to-end lag exceeds --lag-alert-s",
        _watch,
        options.add_watch,
        ("app.data.watch:WatchConfig", "app.config:IngestConfig"),
        needs_kafka=True,
    ),
    "lag": Command(
        "export each partition's backlog (log end − the table's committed offset) and its oldest "
        "record's age, with or without a watch",
        _lag,
        options.add_lag,
        ("app.data.backlog:LagConfig",),
        needs_kafka=True,
    ),
    "redrive": Command(
        "ingests the dead letters whose failure no longer applies, exactly once",
        _redrive,
        options.add_redrive,
        ("app.config:IngestConfig",),
        needs_kafka=True,
    ),
    "migrate": Command(
        "import snapshot folders of the old layout into the Iceberg table, once",
        _migrate,
        options.add_migrate,
    ),
    "erase": Command(
        "delete one user's rows from the Iceberg table, its history included, and say what went",
        _erase,
        options.add_erase,
        ("app.data.erasure:EraseConfig",),
    ),
    "drift": Command(
        "compare served traffic with the training snapshot; --retrain submits a job",
        _drift,
        model_options.add_drift,
        ("app.ops.drift:DriftConfig",),
    ),
}
