"""A Serve endpoint for HTTP tests that need no trained model: an untrained cnn registered in a
fresh MLflow (real registry, real replicas, real HTTP on 127.0.0.1), deployed the way `serve run`
and a RayService deploy it, through `build_app`'s arguments."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from pathlib import Path

import requests

from app import registry
from app.config import Settings
from app.data import synth
from app.model import build_model
from app.net import free_port

CLASSES = ["credential_prompt", "normal", "phishing_page"]
CLIENTS = 8


def register_untrained(settings: Settings) -> str:
    card = registry.ModelCard(
        arch="cnn",
        classes=CLASSES,
        image_size=settings.image_size,
        features=False,
        training_kind="ddp",
        lineage={},
        metrics={},
    )
    with registry.start_run(settings.tracking_uri, registry.artifact_root(settings), "untrained") as run:
        model = build_model("cnn", len(CLASSES))
        return registry.register(settings.tracking_uri, settings.model_name, run.info.run_id, model, card)


def token_file(directory: Path, names: list[str]) -> tuple[Path, dict[str, str]]:
    """A token file with one fresh token per name: the first half plain, the rest as sha256: lines."""
    import hashlib

    tokens = {name: f"{name}-{secrets.token_urlsafe(16)}" for name in names}
    lines = [
        token if i % 2 == 0 else f"sha256:{hashlib.sha256(token.encode()).hexdigest()}"
        for i, token in enumerate(tokens.values())
    ]
    path = directory / "tokens.txt"
    path.write_text("# test tokens\n" + "\n".join(lines) + "\n")
    return path, tokens


def start(directory: Path, **args) -> tuple[str, str, Settings]:
    """Serve on a free 127.0.0.1 port with `build_app(args)`; returns (url, served version, settings)."""
    from ray import serve

    from app.serve import APPLICATION, build_app, wait_for_version

    settings = Settings(storage=str(directory / "data"), image_size=32, model="cnn", topic=uuid.uuid4().hex)
    version = register_untrained(settings)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app({"mlflow_uri": settings.tracking_uri, "poll_s": 0.5, **args}),
        name=APPLICATION,
        route_prefix="/",
        blocking=False,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_version(url, version, timeout_s=180)
    return url, version, settings


class Traffic:
    """CLIENTS threads, each posting its own PNG back to back (or `pause_s` apart) and keeping its
    answers in order as (status, model_version or error, replica)."""

    def __init__(self, url: str, clients: int = CLIENTS, pause_s: float = 0.0):
        self.url, self.pause_s = url, pause_s
        self.answers: list[list[tuple[int, str, str | None]]] = [[] for _ in range(clients)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, index: int) -> None:
        value = next(synth.generate(1, seed=100 + index, size=48)).value
        session = requests.Session()
        while not self._stop.is_set():
            try:
                response = session.post(
                    f"{self.url}/predict", data=value, headers={"Content-Type": "image/png"}, timeout=60
                )
                try:
                    body = response.json()
                    outcome = body.get("model_version") or body.get("error", "")
                except ValueError:  # not from a replica: the proxy's own error page
                    outcome = response.text[:200]
                self.answers[index].append(
                    (response.status_code, outcome, response.headers.get("X-Argus-Replica"))
                )
            except requests.RequestException as exc:
                self.answers[index].append((0, repr(exc), None))
            self._stop.wait(self.pause_s)

    def wait_for_answers(self, timeout_s: float = 120) -> None:
        """Until every client has had one more answer than now (so each sees what is served now)."""
        counts = [len(answers) for answers in self.answers]
        self._wait(
            lambda: all(len(answers) > count for answers, count in zip(self.answers, counts)),
            timeout_s,
            "not every client was answered",
        )

    def wait_for_replica(self, replica: str, timeout_s: float = 120) -> None:
        """Until some client has had a 200 from `replica` (Serve's router has picked it up)."""
        self._wait(
            lambda: any(a[0] == 200 and a[2] == replica for answers in self.answers for a in list(answers)),
            timeout_s,
            f"no request reached replica {replica}",
        )

    @staticmethod
    def _wait(done, timeout_s: float, failure: str) -> None:
        deadline = time.monotonic() + timeout_s  # generous: a loaded 2-core machine is slow, not wrong
        while not done():
            assert time.monotonic() < deadline, f"{failure} within {timeout_s:g}s"
            time.sleep(0.1)

    @property
    def failed(self) -> list[tuple[int, str, str | None]]:
        return [a for client in self.answers for a in client if a[0] != 200]

    def assert_switched_once(self, old: str, new: str) -> None:
        """Every client saw `old`, then `new`, and never `old` again after `new`."""
        for client, answers in enumerate(self.answers):
            versions = [version for _, version, _ in answers]
            assert old in versions and new in versions, (client, versions)  # it spanned the rollout
            switch = versions.index(new)
            assert set(versions[:switch]) == {old} and set(versions[switch:]) == {new}, (
                f"client {client} saw new → old: {versions}"
            )

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def sequential(url: str, count: int) -> list[tuple[str, str]]:
    """`count` requests one after another: (model_version, replica) of each, all 200."""
    value = next(synth.generate(1, seed=7, size=48)).value
    session, seen = requests.Session(), []
    for _ in range(count):
        response = session.post(
            f"{url}/predict", data=value, headers={"Content-Type": "image/png"}, timeout=60
        )
        assert response.status_code == 200, response.text
        seen.append((response.json()["model_version"], response.headers["X-Argus-Replica"]))
    return seen
