"""`python -m app demo` (the README's `make demo`): the whole path once, on embedded defaults.

Embedded broker → synthetic records → Ray Data ingest → Iceberg table → Ray Train (2 CPU workers,
small CNN, 64 px) → MLflow registry → Ray Serve on 127.0.0.1 → predictions over HTTP →
federated fine-tuning (Flower clients on Ray actors) with `--promote-if-better` → a rollout to the
federated version under steady traffic, counting failed requests, only if it beat the champion on
the test slice (else one line saying which version stays and why). The Ray dashboard runs
alongside (its URL is printed first); `--hold` keeps the dashboard and the endpoint up at the end
until Ctrl-C. It uses `<storage>/demo` as its own sandbox and stops everything it started.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import threading
import time

import numpy as np

from app.cluster import ray_session
from app.config import IngestConfig, ProduceConfig, ServeConfig, Settings, TrainConfig
from app.data.broker import EmbeddedBroker

log = logging.getLogger(__name__)

DEMO_IMAGE_SIZE = 64
DEMO_MODEL = "cnn"


def _step(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def run_demo(settings: Settings, args) -> int:
    """Run every stage; print what each did and how long it took."""
    import requests

    from app.data import synth
    from app.data.ingest import ingest
    from app.data.produce import produce
    from app.fl import FederateConfig, federate
    from app.serve import deploy, wait_for_version
    from app.train import train

    overrides = {"storage": str(settings.local_storage_path / "demo")}
    if args.image_size is None:
        overrides["image_size"] = DEMO_IMAGE_SIZE
    if args.model is None:
        overrides["model"] = DEMO_MODEL
    settings = dataclasses.replace(settings, **overrides)
    if not settings.mlflow_uri:
        shutil.rmtree(settings.local_storage_path, ignore_errors=True)  # the demo's own sandbox
    settings.local_storage_path.mkdir(parents=True, exist_ok=True)
    timings = {}
    started = time.perf_counter()
    held_s = 0.0

    broker = None
    bootstrap = settings.bootstrap_servers
    if not bootstrap:
        t = _step("starting the embedded Kafka-compatible broker")
        broker = EmbeddedBroker.create(settings.local_storage_path).start()
        bootstrap = broker.bootstrap_servers
        timings["broker"] = time.perf_counter() - t
        print(f"broker on {bootstrap} (pid {broker.process.pid}, log {broker.log_path})")
    kafka = settings.kafka_connection(bootstrap)
    try:
        t = _step(f"producing {args.records} synthetic behaviour images to {settings.topic}")
        print(produce(settings, ProduceConfig(synthetic=args.records, seed=7), kafka))
        timings["produce"] = time.perf_counter() - t

        with ray_session(settings, dashboard=True) as dashboard_url:
            print(
                f"Ray dashboard: {dashboard_url or 'not started (see the warning above)'} — jobs, actors, "
                "Ray Data operators, Train workers and Serve replicas, live while the demo runs",
                flush=True,
            )
            t = _step("ingesting with Ray Data: Kafka → preprocess → one Iceberg table commit")
            print(ingest(settings, IngestConfig(), kafka))
            timings["ingest"] = time.perf_counter() - t

            t = _step(f"training with Ray Train: {settings.model}, 2 CPU workers, {args.epochs} epochs")
            report = train(settings, TrainConfig(epochs=args.epochs, num_workers=2, batch_size=32, lr=3e-3))
            print(
                f"registered {settings.model_name} v{report.version}: val_accuracy "
                f"{report.metrics['val_accuracy']:.3f} (chance {1 / len(report.classes):.3f}); "
                f"rank checksums equal ({report.checksum[:12]}…)"
            )
            timings["train"] = time.perf_counter() - t

            t = _step("serving with Ray Serve on 127.0.0.1")
            url = deploy(settings, ServeConfig(http_port=args.http_port), blocking=False)
            version = wait_for_version(url)
            sample = next(synth.generate(1, seed=12345, classes=report.classes, size=DEMO_IMAGE_SIZE))
            answer = requests.post(
                f"{url}/predict", data=sample.value, headers={"Content-Type": "image/png"}, timeout=30
            )
            answer.raise_for_status()
            body = answer.json()
            top = np.argsort(list(body["scores"].values()))[::-1][:3]
            names = list(body["scores"])
            print(
                f"POST {url}/predict (a {sample.label!r} image) → {answer.status_code} "
                f"label={body['label']!r} model_version={body['model_version']}"
            )
            print("   top scores: " + ", ".join(f"{names[i]} {body['scores'][names[i]]:.2f}" for i in top))
            timings["serve"] = time.perf_counter() - t
            assert version == body["model_version"]

            t = _step(
                "federated fine-tuning: Flower clients as Ray actors, users as clients, FedAvg; "
                "promoted only if better than the champion on the test slice"
            )
            traffic = Traffic(url, sample.value)
            try:
                # The alias moves inside federate (only to a better model): traffic runs from just before.
                federated = federate(
                    settings,
                    FederateConfig(
                        rounds=args.rounds,
                        clients=8,
                        clients_per_round=4,
                        init_from="champion",
                        seed=7,
                        promote_if_better=True,
                    ),
                    before_promotion=traffic.start,
                )
                print(federated)  # its last line: promoted, or which version stays and why
                timings["federate"] = time.perf_counter() - t
                verdict = federated.verdict
                if verdict.promoted:
                    t = _step(f"rolling out v{federated.version} under steady traffic")
                    print(f"{settings.model_name}@champion → v{federated.version}")
                    print(finish_rollout(url, federated.version, traffic))
                    timings["rollout"] = time.perf_counter() - t
                    outcome = f"serving federated v{federated.version}: {verdict.reason}"
                else:
                    outcome = (
                        f"serving v{verdict.champion_version}, federated v{federated.version} not rolled "
                        f"out: {verdict.reason}"
                    )
            finally:
                traffic.stop()
            if args.hold:
                held_s = _hold(url, dashboard_url)
            from ray import serve

            serve.shutdown()
    finally:
        if broker is not None:
            broker.stop()
    total = time.perf_counter() - started - held_s
    print("\n== done in {:.0f}s ({})".format(total, ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())))
    print(outcome)
    print(f"table, checkpoints and logs: {settings.local_storage_path}")
    if not args.hold:
        print(
            "Ray dashboard and Serve stopped with the demo: `python -m app demo --hold` keeps them up, "
            "or run the stages as jobs on `ray start --head` (README, 'Running on a Ray cluster')"
        )
    print(
        f"MLflow UI: `mlflow ui --backend-store-uri {settings.tracking_uri}` "
        "(runs, metrics, registered versions)"
    )
    curves = sorted(
        settings.local_storage_path.glob("mlartifacts/*/artifacts/curves.png"),
        key=lambda p: p.stat().st_mtime,
    )
    for path in curves:  # the demo's sandbox holds its runs' artifacts: centralised training, then federated
        print(f"curves: {path}")
    return 0


def finish_rollout(url: str, version: str, traffic: Traffic) -> str:
    """Once every replica serves `version`, stop the traffic that ran through the alias move and
    say how it went: requests, failures, and the versions in the order clients saw them."""
    from app.serve import wait_for_version

    wait_for_version(url, version)
    time.sleep(1.0)  # some answers from the new version
    answers = traffic.stop()
    failed = sum(1 for status, _ in answers if status != 200)
    served = [v for _, v in answers]
    return (
        f"{len(answers)} requests during the rollout, {failed} failed; versions served in "
        f"order: {' → '.join(dict.fromkeys(served))}"
    )


def _hold(url: str, dashboard_url: str | None) -> float:
    """`--hold`: keep Ray, its dashboard and the Serve endpoint up until Ctrl-C or SIGTERM; return
    the seconds held."""

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    # Both set here: libraries loaded on the way (Flower's among them) install their own handlers.
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    started = time.perf_counter()
    print(
        f"\n== holding until Ctrl-C: Ray dashboard {dashboard_url or '(not started)'}, "
        f"POST {url}/predict, GET {url}/model",
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        print("stopping Serve, Ray and the broker", flush=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return time.perf_counter() - started


class Traffic:
    """Predictions posted back to back from a thread while the alias may move; every answer's
    (status, model_version) is kept."""

    def __init__(self, url: str, image: bytes):
        self.url, self.image = url, image
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._post, daemon=True)
        self._thread.start()
        time.sleep(1.0)  # some answers from the version served before

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.answers

    def _post(self) -> None:
        import requests

        while not self._stop.is_set():
            try:
                response = requests.post(
                    f"{self.url}/predict", data=self.image, headers={"Content-Type": "image/png"}, timeout=30
                )
                self.answers.append((response.status_code, response.json().get("model_version", "?")))
            except requests.RequestException as exc:
                self.answers.append((0, type(exc).__name__))
