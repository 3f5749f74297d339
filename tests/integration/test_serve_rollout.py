"""Coordinated rollout over real HTTP on 127.0.0.1 (app/serve/rollout.py): three replicas switch to a new
version together under traffic, a version that cannot load is never activated anywhere, and a
killed replica's replacement serves the active version."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from app import registry
from app.config import ServeConfig
from app.net import free_port
from app.serve.promote import forget_deployment, record_deployment, wait_for_rollout

from conftest import run_cli, settings_args
from served import CLIENTS, Traffic, sequential

REPLICAS = 3
# A kill fails only requests already running on that replica (Serve's router retries the ones it
# had not started): each client has one request in flight, so at most CLIENTS. Measured on the
# 2-core machine, four runs: 0, 1, 1 of ~3,000 and 2 of 2,496 requests (the proxy's plain-text
# 500s for the requests the killed replica was answering).
KILL_FAILURE_BOUND = CLIENTS


@pytest.fixture(scope="module")
def fleet(trained):
    """Three replicas on the session's model (only one Serve application fits the session's Ray)."""
    from ray import serve

    from app.serve import deploy

    settings, _, _, report, _ = trained
    registry.promote(settings.tracking_uri, settings.model_name, report.version)
    config = ServeConfig(http_port=free_port(), replicas=REPLICAS, poll_s=0.5, max_batch_size=8)
    url = deploy(settings, config, blocking=False)
    wait_for_rollout(url, report.version, timeout_s=240)
    yield url
    forget_deployment(settings)
    serve.shutdown()
    registry.promote(settings.tracking_uri, settings.model_name, report.version)


def register_copy(settings, version: str, training_kind: str) -> str:
    """A second registered version: the same weights under another card, from its own run."""
    current = registry.load(settings.tracking_uri, settings.model_name, version)
    with registry.start_run(settings.tracking_uri, registry.artifact_root(settings), training_kind) as run:
        card = dataclasses.replace(current.card, training_kind=training_kind)
        return registry.register(
            settings.tracking_uri, settings.model_name, run.info.run_id, current.model, card
        )


@pytest.fixture(scope="module")
def unloadable(trained):
    """A registered version whose weights were corrupted on disk after registering."""
    import mlflow

    settings, _, _, report, _ = trained
    version = register_copy(settings, report.version, "corrupted")
    source = mlflow.MlflowClient(settings.tracking_uri).get_model_version(settings.model_name, version).source
    (weights,) = Path(urlparse(source).path).rglob(registry.WEIGHTS_FILE)
    weights.write_bytes(b"these bytes are not safetensors")
    return version


ROLLOUT_TIMEOUT_S = 30
"""Above a replica's own worst case for /rollout: two coordinator calls of 5 s on a loaded machine."""


def rollout_state(url: str) -> dict:
    answer = requests.get(f"{url}/rollout", timeout=ROLLOUT_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def settled(url: str, version: str | None = None, timeout_s: float = 120) -> dict:
    """/rollout once every replica reports (and, given `version`, serves it with its alias read):
    on a loaded machine a late report leaves a replica out of the snapshot for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = rollout_state(url)
        replicas = state["replicas"]
        on_version = version is None or all(r["alias_version"] == r["serving"] == version for r in replicas)
        if len(replicas) == REPLICAS and on_version:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.5)


def promote_cli(settings, version: str, *extra: str):
    return run_cli("promote", version, *extra, *settings_args(settings), timeout=300)


def test_every_replica_switches_together_with_no_failed_request(trained, fleet):
    settings, _, _, _, _ = trained
    old = rollout_state(fleet)["active_version"]
    candidate = register_copy(settings, old, "federated")
    record_deployment(settings, fleet, foreground=True)  # as `serve` does: plain promote waits on it
    with Traffic(fleet) as traffic:
        traffic.wait_for_answers()  # every client has seen the old version
        promoted = promote_cli(settings, candidate)
        served_when_promote_returned = sequential(fleet, 1)
        traffic.wait_for_answers()  # and, after promote returned, the new one
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert f"every replica ({REPLICAS}) at {fleet} serves v{candidate}" in promoted.stdout
    assert served_when_promote_returned[0][0] == candidate

    assert traffic.failed == [], traffic.failed[:5]
    traffic.assert_switched_once(old, candidate)
    print(f"\n{sum(map(len, traffic.answers))} requests from {CLIENTS} clients during the rollout, 0 failed")

    after = sequential(fleet, 200)
    assert {version for version, _ in after} == {candidate}
    assert len({replica for _, replica in after}) == REPLICAS
    health = requests.get(f"{fleet}/healthz", timeout=10)
    assert health.json() == {"status": "ok", "model_version": candidate} and health.headers["X-Argus-Replica"]
    replicas = rollout_state(fleet)["replicas"]
    assert all(r["alias_version"] == r["serving"] == candidate and r["error"] is None for r in replicas)


def test_the_demo_reports_the_rollout_it_ran_under_traffic(trained, fleet):
    """The demo's rollout branch, which it takes only when the federated version beats the champion
    (so the demo's own test cannot count on it), over the real fleet: the alias moves under the
    demo's traffic, as `federate --promote-if-better` moves it, and the demo's line counts it."""
    from app.data import synth
    from app.ops.demo import Traffic as DemoTraffic
    from app.ops.demo import finish_rollout

    settings, _, _, _, _ = trained
    old = rollout_state(fleet)["active_version"]
    candidate = register_copy(settings, old, "federated")
    traffic = DemoTraffic(fleet, next(synth.generate(1, seed=3, size=32)).value)
    traffic.start()
    registry.promote(settings.tracking_uri, settings.model_name, candidate)
    line = finish_rollout(fleet, candidate, traffic)
    counted = re.fullmatch(
        r"(\d+) requests during the rollout, (\d+) failed; versions served in order: (.+)", line
    )
    assert counted, line
    assert int(counted.group(1)) > 0 and counted.group(2) == "0", line
    assert counted.group(3) == f"{old} → {candidate}", line


def test_a_version_that_cannot_load_is_never_activated(trained, fleet, unloadable):
    settings, _, _, _, _ = trained
    state = settled(fleet)
    active, replicas = state["active_version"], [r["replica"] for r in state["replicas"]]
    try:
        failed = promote_cli(settings, unloadable, "--wait-url", fleet, "--timeout-s", "15")
        assert failed.returncode == 1, failed.stderr[-3000:]
        line = failed.stderr.strip().splitlines()[-1]
        assert line.startswith(f"argus: promote failed: RolloutIncomplete: v{unloadable} is not served")
        for replica in replicas:
            assert f"replica {replica} (node" in line, line
        assert line.count(f"serves v{active}, error: cannot load v{unloadable}") == REPLICAS, line

        answered = sequential(fleet, 60)
        assert {version for version, _ in answered} == {active}
        assert {replica for _, replica in answered} == set(replicas)
        for _ in range(6):
            assert requests.get(f"{fleet}/healthz", timeout=10).json()["model_version"] == active
        # Every replica is behind its alias and says why, in /rollout (/healthz says only the version).
        for r in rollout_state(fleet)["replicas"]:
            assert r["serving"] == active and r["alias_version"] == unloadable, r
            assert f"cannot load v{unloadable}" in r["error"], r
    finally:
        restored = promote_cli(settings, active, "--wait-url", fleet, "--timeout-s", "60")
        assert restored.returncode == 0, restored.stderr[-3000:]
    settled(fleet, active)  # promote returned at once (all served it): the alias is read within a poll


def test_a_killed_replica_is_replaced_on_the_active_version(trained, fleet, unloadable):
    import ray

    from app.serve import APPLICATION, DEPLOYMENT

    settings, _, _, _, _ = trained
    state = settled(fleet)
    active, before = state["active_version"], {r["replica"] for r in state["replicas"]}
    victim = sorted(before)[0]
    # The alias points at a version that cannot load: a replacement that followed the alias rather
    # than the active version would fail to start, or answer with another version.
    registry.promote(settings.tracking_uri, settings.model_name, unloadable)
    try:
        with Traffic(fleet) as traffic:
            traffic.wait_for_answers()
            replica = ray.get_actor(f"SERVE_REPLICA::{APPLICATION}#{DEPLOYMENT}#{victim}", namespace="serve")
            ray.kill(replica, no_restart=True)
            deadline = time.monotonic() + 180
            live = []
            while time.monotonic() < deadline:
                # If the victim created the coordinator, it died too: /rollout may answer 503 until
                # a replica has created it again (promote's wait tolerates that the same way).
                try:
                    answer = requests.get(f"{fleet}/rollout", timeout=ROLLOUT_TIMEOUT_S)
                    live = answer.json()["replicas"] if answer.ok else []
                except requests.RequestException:
                    live = []
                ids = {r["replica"] for r in live}
                if len(live) == REPLICAS and victim not in ids and all(r["serving"] == active for r in live):
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"no replacement serving v{active} within 180s: {live}")
            replacement = ids - before
            assert len(replacement) == 1
            traffic.wait_for_replica(next(iter(replacement)))
    finally:
        registry.promote(settings.tracking_uri, settings.model_name, active)
    failed = traffic.failed
    total = sum(map(len, traffic.answers))
    print(
        f"\nkilled replica {victim} under {CLIENTS} clients: {len(failed)} of {total} requests failed",
        failed[:4],
    )
    assert len(failed) <= KILL_FAILURE_BOUND, failed
    served = [
        (version, replica)
        for client in traffic.answers
        for status, version, replica in client
        if status == 200
    ]
    assert {version for version, _ in served} == {active}
    assert replacement <= {replica for _, replica in served}
    health = [requests.get(f"{fleet}/healthz", timeout=10).json() for _ in range(12)]
    assert {h["model_version"] for h in health} == {active}
    wait_for_rollout(fleet, active, timeout_s=60)


def test_a_restarted_coordinator_carries_on_from_what_replicas_report(trained, fleet):
    import ray

    from app.serve import APPLICATION
    from app.serve.rollout import NAMESPACE, coordinator_name

    settings, _, _, _, _ = trained
    active = rollout_state(fleet)["active_version"]
    candidate = register_copy(settings, active, "after-restart")
    name = coordinator_name(APPLICATION, settings.tracking_uri, settings.model_name, "champion")
    with Traffic(fleet) as traffic:
        traffic.wait_for_answers()
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)  # back with no state
        promoted = promote_cli(settings, candidate, "--wait-url", fleet, "--timeout-s", "120")
        traffic.wait_for_answers()
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert traffic.failed == [], traffic.failed[:5]
    traffic.assert_switched_once(active, candidate)
    state = rollout_state(fleet)
    assert state["active_version"] == candidate and state["previous_version"] == active


def test_rollout_is_read_only_and_in_the_openapi_document(fleet):
    document = requests.get(f"{fleet}/openapi.json", timeout=10).json()
    assert set(document["paths"]["/rollout"]) == {"get"}
    assert {"200", "503"} <= set(document["paths"]["/rollout"]["get"]["responses"])
    refused = requests.post(f"{fleet}/rollout", timeout=10)
    assert refused.status_code == 405 and refused.json()["error"]
    assert refused.headers["X-Argus-Replica"]
