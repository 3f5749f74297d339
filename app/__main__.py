"""The CLI: `python -m app <command>` (also `argus <command>`), CONTRACT.md §3.

`COMMANDS` is the whole CLI: each command's flags and a handler that builds the typed
configuration (exit 2 with one line when it is bad) and calls one function of its stage module.
A failed run exits 1 with its cause. Stage modules are imported by their handlers, so `--help` and
bad arguments answer without importing Ray or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from app.config import (
    AMP_MODES,
    MODELS,
    ConfigError,
    IngestConfig,
    ProduceConfig,
    ServeConfig,
    Settings,
    TrainConfig,
    build_settings,
    check_reachable,
    from_namespace,
)

log = logging.getLogger("argus")


def _csv(text: str) -> tuple[str, ...] | None:
    return tuple(item for item in text.split(",") if item) or None


def _add_common(parser: argparse.ArgumentParser) -> None:
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
    group.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _add_produce(parser) -> None:
    parser.add_argument("--synthetic", type=int, metavar="N", help="publish N synthetic behaviour images")
    parser.add_argument("--from-dir", metavar="DIR", help="publish DIR/<label>/<image files>")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--users", type=int, help="synthetic users (default 50)")
    parser.add_argument("--source-image-size", type=int, help="side of synthetic images (default 64)")
    parser.add_argument("--late-fraction", type=float, help="share of records arriving late (default 0.05)")
    parser.add_argument("--corrupt-fraction", type=float, help="share of corrupt values (default 0.02)")
    parser.add_argument("--linger-ms", type=int, help="producer batching delay (default 20)")


def _add_ingest(parser) -> None:
    parser.add_argument("--group", help="consumer group (default argus-ingest)")
    parser.add_argument("--max-record-bytes", type=int, help="larger values go to the DLQ (default 10 MiB)")
    parser.add_argument(
        "--allowed-lateness-s", type=float, help="lateness flagged beyond this (default 3600)"
    )
    parser.add_argument("--features", choices=["resnet50"], help="add a 2048-d ResNet-50 feature column")
    parser.add_argument("--weights", help="local path of backbone weights (default: random, with a warning)")
    parser.add_argument("--use-gpu", action="store_true", default=None, help="preprocess on GPU actors")
    parser.add_argument(
        "--concurrency", type=int, help="most preprocessing actors (default: one per CPU, or per GPU)"
    )
    parser.add_argument(
        "--decode-threads", type=int, help="decode threads per actor (default 1, CPUs per GPU on GPU)"
    )


def _add_train(parser) -> None:
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="per-worker micro-batch (default 32)")
    parser.add_argument(
        "--num-workers", help="training workers, N or MIN-MAX for an elastic group (default 2)"
    )
    parser.add_argument("--use-gpu", action="store_true", default=None)
    parser.add_argument("--cpus-per-worker", type=float, help="logical CPUs per worker (default 0.5)")
    parser.add_argument("--amp", choices=AMP_MODES, help="mixed precision (auto: on with a GPU, off on CPU)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimiser step (default 1)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--snapshots", type=_csv, help="comma-separated snapshot ids (default: all)")
    parser.add_argument(
        "--val-fraction", type=float, help="newest share by event time held out (default 0.2)"
    )
    parser.add_argument(
        "--balance", choices=["weights", "sampler", "none"], help="uneven classes (default weights)"
    )
    parser.add_argument("--no-augment", dest="augment", action="store_false", default=None)
    parser.add_argument("--run-name", help="rerunning with the same name resumes it")
    parser.add_argument("--max-failures", type=int, help="worker failures to recover from (default 2)")
    parser.add_argument(
        "--promote-if-better",
        action="store_true",
        default=None,
        help="move the alias if the new version beats the champion on the newest event-time slice",
    )
    parser.add_argument("--fail-at-epoch", type=int, help=argparse.SUPPRESS)


def _add_federate(parser) -> None:
    parser.add_argument("--rounds", type=int, help="federated rounds (default 5)")
    parser.add_argument("--clients", type=int, help="simulated clients, each a group of users (default 10)")
    parser.add_argument("--clients-per-round", type=int, help="clients sampled per round (default 5)")
    parser.add_argument("--local-epochs", type=int, help="client epochs per round (default 1)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float, help="client SGD learning rate (default 0.05)")
    parser.add_argument(
        "--strategy", help="fedavg, fedprox, fedmedian, fedtrimmedavg or krum (default fedavg)"
    )
    parser.add_argument("--mu", type=float, help="FedProx proximal weight (default 0.01)")
    parser.add_argument("--dp-clip", type=float, help="clip each update to this L2 norm (enables DP)")
    parser.add_argument(
        "--dp-noise", type=float, help="Gaussian noise multiplier on the aggregate (needs --dp-clip)"
    )
    parser.add_argument("--dp-delta", type=float, help="delta at which epsilon is reported (default 1e-5)")
    parser.add_argument("--update-dtype", help="fp16 (default) or fp32 updates on the wire")
    parser.add_argument("--min-clients", type=int, help="fewest valid updates that make a round")
    parser.add_argument("--round-timeout-s", type=float, help="drop clients slower than this (default 600)")
    parser.add_argument("--init-from", help="start from the model behind this alias, e.g. champion")
    parser.add_argument("--snapshots", type=_csv, help="comma-separated snapshot ids (default: all)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--run-name", help="rerunning with the same name resumes after its last round")
    parser.add_argument(
        "--num-cpus-per-client", type=float, help="logical CPUs per client actor (default 0.5)"
    )


def _add_serve(parser) -> None:
    parser.add_argument("--http-host", help="default 127.0.0.1")
    parser.add_argument("--http-port", type=int, help="default 8000")
    parser.add_argument("--replicas", type=int, help="default 1")
    parser.add_argument("--alias", help="registry alias to serve (default champion)")
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--batch-wait-timeout-s", type=float)
    parser.add_argument("--max-body-bytes", type=int)
    parser.add_argument(
        "--detach",
        action="store_true",
        default=None,
        help="deploy onto the running cluster (--ray-address) and return",
    )


def _add_demo(parser) -> None:
    parser.add_argument(
        "--records", type=int, default=1200, help="synthetic records to publish (default 1200)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="federated rounds (default 3)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument(
        "--hold",
        action="store_true",
        help="keep Ray's dashboard and the Serve endpoint up at the end until Ctrl-C",
    )


def _add_broker(parser) -> None:
    parser.add_argument("--port", type=int, default=9092)


def _add_promote(parser) -> None:
    parser.add_argument("version")
    parser.add_argument("--alias", default="champion")
    parser.add_argument("--wait-url", help="wait until this endpoint's /healthz reports VERSION")


def _add_watch(parser) -> None:
    _add_ingest(parser)
    parser.add_argument("--lag-alert-s", type=float, help="alert threshold in seconds (default 5)")
    parser.add_argument("--interval-s", type=float, help="pause between micro-batches (default 5)")
    parser.add_argument("--pause-file", help="while this file exists, measure lag but do not ingest")
    parser.add_argument("--max-ticks", type=int, help="stop after this many micro-batches")


def _add_drift(parser) -> None:
    parser.add_argument("--window-s", type=float, help="recent traffic window (default 3600)")
    parser.add_argument("--threshold", type=float, help="PSI above this is drift (default 0.2)")
    parser.add_argument("--label-threshold", type=float, help="predicted-class PSI threshold (default 0.5)")
    parser.add_argument("--min-requests", type=int, help="fewest requests for a verdict (default 30)")
    parser.add_argument(
        "--retrain",
        action="store_true",
        default=None,
        help="on drift, submit ingest → train --promote-if-better as a Ray job",
    )
    parser.add_argument("--alias", help="the served alias (default champion)")


def _stop_event() -> threading.Event:
    """Set by SIGINT or SIGTERM: foreground commands end cleanly instead of dying mid-write."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _s, _f: stop.set())
    return stop


# ---------------------------------------------------------------- handlers: config → one stage call


def _demo(settings: Settings, args) -> int:
    from app.demo import run_demo

    return run_demo(settings, args)


def _broker(settings: Settings, args) -> int:
    from app import broker

    settings.local_storage_path.mkdir(parents=True, exist_ok=True)
    return broker.run_foreground(settings.local_storage_path, args.port)


def _produce(settings: Settings, args) -> int:
    from app.broker import kafka_endpoint
    from app.produce import produce

    cfg = from_namespace(ProduceConfig, args)
    with kafka_endpoint(settings) as bootstrap:
        print(produce(settings, cfg, bootstrap))
    return 0


def _ingest(settings: Settings, args) -> int:
    from app.broker import kafka_endpoint
    from app.cluster import ray_session, require_local_gpu
    from app.ingest import ingest

    cfg = from_namespace(IngestConfig, args)
    require_local_gpu(settings, cfg.use_gpu)
    with kafka_endpoint(settings) as bootstrap, ray_session(settings):
        print(ingest(settings, cfg, bootstrap))
    return 0


def _watch(settings: Settings, args) -> int:
    from app.broker import kafka_endpoint
    from app.cluster import ray_session, require_local_gpu
    from app.watch import WatchConfig, watch

    cfg, ingest_cfg = from_namespace(WatchConfig, args), from_namespace(IngestConfig, args)
    require_local_gpu(settings, ingest_cfg.use_gpu)
    stop = _stop_event()
    with kafka_endpoint(settings) as bootstrap, ray_session(settings):
        alerts = watch(settings, cfg, ingest_cfg, bootstrap, stop)
    print(f"watch stopped after raising {alerts} lag alerts")
    return 0


def _train(settings: Settings, args) -> int:
    from app.cluster import ray_session, require_local_gpu
    from app.train import train

    cfg = from_namespace(TrainConfig, args)
    require_local_gpu(settings, cfg.use_gpu)
    with ray_session(settings):
        report = train(settings, cfg)
    print(
        f"registered {settings.model_name} v{report.version} (run {report.run_id}): "
        f"val_accuracy {report.metrics['val_accuracy']:.3f} after {report.epochs} epochs"
    )
    return 0


def _federate(settings: Settings, args) -> int:
    from app.fl import FederateConfig, federate

    print(federate(settings, from_namespace(FederateConfig, args)))
    return 0


def _serve(settings: Settings, args) -> int:
    from app.cluster import ray_session
    from app.serve import deploy

    cfg = from_namespace(ServeConfig, args)
    if cfg.detach:
        if not settings.ray_address:
            raise ConfigError("--detach needs a running cluster: pass --ray-address (or set RAY_ADDRESS)")
        with ray_session(settings):
            print(f"deployed on {deploy(settings, cfg, blocking=False)}")
        return 0
    stop = _stop_event()
    with ray_session(settings):
        from ray import serve

        url = deploy(settings, cfg, blocking=False)
        print(f"serving on {url} (POST /predict, GET /healthz, GET /model, /docs); Ctrl-C stops", flush=True)
        while not stop.wait(0.2):  # a timed wait lets the signal handler run promptly
            pass
        serve.shutdown()
    return 0


def _promote(settings: Settings, args) -> int:
    from app import registry
    from app.serve import wait_for_version

    registry.promote(settings.tracking_uri, settings.model_name, args.version, args.alias)
    print(f"{settings.model_name}@{args.alias} → v{args.version}")
    if args.wait_url:
        wait_for_version(args.wait_url.rstrip("/"), args.version)
        print(f"{args.wait_url} serves v{args.version}")
    return 0


def _drift(settings: Settings, args) -> int:
    from app.cluster import ray_session
    from app.drift import DriftConfig, drift

    cfg = from_namespace(DriftConfig, args)
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
    handler: Callable[[Settings, argparse.Namespace], int]
    add_options: Callable[[argparse.ArgumentParser], None] | None = None
    needs_kafka: bool = False
    """Fail at the edge (exit 2) when configured bootstrap servers do not answer."""


COMMANDS = {
    "demo": Command(
        "the whole job on embedded defaults: broker, produce, ingest, train, register, serve, "
        "a sample prediction",
        _demo,
        _add_demo,
        needs_kafka=True,
    ),
    "broker": Command("run the embedded Kafka-compatible broker in the foreground", _broker, _add_broker),
    "produce": Command(
        "publish records: --synthetic N or --from-dir DIR", _produce, _add_produce, needs_kafka=True
    ),
    "ingest": Command(
        "Kafka → Ray Data preprocessing → a new snapshot (offsets committed after it is durable)",
        _ingest,
        _add_ingest,
        needs_kafka=True,
    ),
    "train": Command(
        "Ray Train on snapshots → checkpoints → a new registered model version", _train, _add_train
    ),
    "federate": Command(
        "federated rounds with clients as Ray actors → a new registered version", _federate, _add_federate
    ),
    "serve": Command("deploy the Ray Serve application on the model alias", _serve, _add_serve),
    "promote": Command(
        "point the alias at VERSION; running replicas switch with no failed request", _promote, _add_promote
    ),
    "watch": Command(
        "keep ingesting in micro-batches; alert when end-to-end lag exceeds --lag-alert-s",
        _watch,
        _add_watch,
        needs_kafka=True,
    ),
    "drift": Command(
        "compare served traffic with the training snapshot; --retrain submits a job", _drift, _add_drift
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One clear line and exit 2, as CONTRACT.md §3 promises (argparse's default adds usage).
        self.exit(2, f"argus: error: {message} (see `argus {self.prog.split()[-1]} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="argus", description="Argus: train vision models on behaviour images from Kafka, with Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="<command>", parser_class=_Parser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        if command.add_options:
            command.add_options(sub)
        _add_common(sub)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("kafka", "urllib3", "alembic", "mlflow.store", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    command = COMMANDS[args.command]
    settings = build_settings(args)
    if settings.bootstrap_servers and command.needs_kafka:
        check_reachable(settings.bootstrap_servers)
    return command.handler(settings, args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    try:
        return run(args)
    except ConfigError as exc:
        print(f"argus: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("argus: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run: exit 1 with the cause, the traceback in the log
        log.debug("failure", exc_info=True)
        print(f"argus: {args.command} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
