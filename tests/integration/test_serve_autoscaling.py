"""Serve's replica count: `serve --replicas MIN-MAX` (autoscaling on ongoing requests) with a rollout
during the scale-up, and a rate limit that holds for the deployment whatever the count. Real Serve
on the session's Ray, real HTTP on 127.0.0.1, a real registry."""

from __future__ import annotations

import time

import pytest
import requests

from app.config import ServeConfig, parse_replicas

from conftest import run_cli
from served import Traffic, register_untrained, sequential, start, token_file

CLIENTS = 12
"""Back-to-back clients: 12 ongoing requests against a target of 2 a replica ask for 6 replicas."""


def running_replicas() -> int:
    from ray import serve

    from app.serve import APPLICATION

    deployment = serve.status().applications[APPLICATION].deployments["ArgusModel"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_until(done, timeout_s: float, failure: str) -> None:
    deadline = time.monotonic() + timeout_s  # generous: a loaded 2-core machine is slow, not wrong
    while not done():
        assert time.monotonic() < deadline, f"{failure} within {timeout_s:g}s"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(1, (1, 1)), ("3", (3, 3)), ("1-3", (1, 3)), ("2-2", (2, 2)), ("0-2", None), ("3-1", None),
     ("1-", None), ("-3", None), ("a-b", None), ("1-65", None), ("", None)],
)  # fmt: skip
def test_replicas_are_a_count_or_a_range(value, parsed):
    assert parse_replicas(value) == parsed
    if parsed is None:
        with pytest.raises(ValueError, match="--replicas must be N or MIN-MAX"):
            ServeConfig(replicas=value)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicas_scale_up_under_load_and_a_promote_during_it_reaches_every_one(tmp_path, ray_cluster):
    """From 1 replica to 3 under load, `promote` while replicas are being added: no request fails,
    no client sees new → old, `promote` returns once every replica serves the new version, and a
    replica that started during the rollout serves it too."""
    from ray import serve

    url, old, settings = start(tmp_path, num_replicas="1-3", max_batch_size=2, poll_s=0.5)
    try:
        assert running_replicas() == 1
        candidate = register_untrained(settings)  # not promoted yet: the alias stays on `old`
        with Traffic(url, clients=CLIENTS) as traffic:
            traffic.wait_for_answers()
            wait_until(lambda: running_replicas() >= 2, 240, "Serve never added a replica")
            promoted = run_cli(
                "promote", candidate, "--storage", settings.storage, "--wait-url", url, "--timeout-s", "240",
                timeout=300,
            )  # fmt: skip
            wait_until(lambda: running_replicas() == 3, 240, "Serve never reached 3 replicas")
            traffic.wait_for_answers()
            traffic.wait_for_answers()  # each client answered after the third replica ran
        assert promoted.returncode == 0, promoted.stderr[-3000:]
        assert f"serves v{candidate}" in promoted.stdout, promoted.stdout
        assert traffic.failed == [], traffic.failed[:5]
        traffic.assert_switched_once(old, candidate)
        print(f"\n{sum(map(len, traffic.answers))} requests from {CLIENTS} clients, 0 failed")

        after = sequential(url, 90)
        assert {version for version, _ in after} == {candidate}
        replicas = {replica for _, replica in after}
        assert len(replicas) == 3, replicas  # the late replica answers, with the new version
    finally:
        serve.shutdown()


@pytest.mark.slow
def test_the_rate_limit_holds_for_the_deployment_whatever_its_replica_count(tmp_path, ray_cluster):
    """Three replicas, one token at 0.2 requests/s with a burst of 3: requests spread over the
    replicas are admitted no more than the bucket allows the deployment (burst + rate × elapsed),
    not three times that, and the 429s name the deployment's rate."""
    from ray import serve

    from app.data import synth

    path, tokens = token_file(tmp_path, ["alice"])
    headers = {"Authorization": f"Bearer {tokens['alice']}", "Content-Type": "image/png"}
    limits = {"api_tokens": str(path), "rate_limit": 0.2, "rate_burst": 3}
    url, _, _ = start(tmp_path, num_replicas=3, poll_s=0.5, **limits)
    try:
        wait_until(
            lambda: len(requests.get(f"{url}/rollout", headers=headers, timeout=30).json()["replicas"]) == 3,
            240,
            "not every replica reported",
        )
        time.sleep(3)  # six reports each: every replica has had the coordinator's count since
        value = next(synth.generate(1, seed=4, size=32)).value
        started, answers = time.monotonic(), []
        for _ in range(30):
            answers.append(requests.post(f"{url}/predict", data=value, headers=headers, timeout=30))
        elapsed = time.monotonic() - started
        statuses = [answer.status_code for answer in answers]
        assert set(statuses) <= {200, 429}, statuses
        admitted = statuses.count(200)
        # Each replica keeping the whole bucket would admit up to 3 × this.
        assert 1 <= admitted <= 3 + 0.2 * elapsed, (admitted, elapsed)
        refused = next(answer for answer in answers if answer.status_code == 429)
        assert "0.2 requests/s" in refused.json()["error"] and int(refused.headers["Retry-After"]) >= 1
    finally:
        serve.shutdown()
