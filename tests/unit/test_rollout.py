"""The rollout rules (app/serve/rollout.py) without Ray: when an activation is scheduled, what a new
coordinator adopts, and when promote may call a rollout complete."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.serve.promote import PromoteConfig
from app.serve.rollout import (
    Plan,
    ReplicaReport,
    RolloutState,
    activation_lead_s,
    next_activation,
    stale_after_s,
    unfinished,
)

LEAD = 3.0


def report(replica: str, serving: str | None, prepared: str | None = None, **extra) -> ReplicaReport:
    fields = dict(node="node-a", alias_version=prepared or serving, error=None, plan=None)
    fields.update(extra)
    return ReplicaReport(replica=replica, serving=serving, prepared=prepared, **fields)


def test_activation_waits_for_every_live_replica_to_have_the_version_ready():
    active = Plan("1", at=0.0)
    two_ready = [report("a", "1", "2"), report("b", "1", "2")]
    assert next_activation(two_ready, 2, active, now=10.0, lead_s=LEAD) == Plan("2", 13.0, previous="1")
    assert next_activation([*two_ready, report("c", "1")], 3, active, 10.0, LEAD) is None
    # A third replica Serve runs but that has not reported (or has gone stale) holds it back too.
    assert next_activation(two_ready, 3, active, 10.0, LEAD) is None
    # One that already serves the version (it started on it) counts as ready.
    assert next_activation([*two_ready, report("c", "2")], 3, active, 10.0, LEAD).version == "2"


def test_no_activation_on_a_version_a_replicas_alias_has_left():
    # b prepared v2, then read the alias at v3 and reported before dropping v2 for it.
    moving_on = [report("a", "1", "2"), report("b", "1", "2", alias_version="3")]
    assert next_activation(moving_on, 2, Plan("1", 0.0), 10.0, LEAD) is None


def test_no_activation_while_one_is_pending_converging_or_unknown():
    ready = [report("a", "1", "3"), report("b", "1", "3")]
    assert next_activation(ready, 2, Plan("2", at=12.0, previous="1"), 10.0, LEAD) is None  # pending
    assert (
        next_activation([report("a", "1", "2"), report("b", "1", "3")], 2, Plan("1", 0.0), 10.0, LEAD) is None
    )
    assert next_activation(ready, None, Plan("1", 0.0), 10.0, LEAD) is None  # Serve's count unknown
    assert next_activation([], 0, Plan("1", 0.0), 10.0, LEAD) is None
    assert next_activation([report("a", "1"), report("b", "1")], 2, Plan("1", 0.0), 10.0, LEAD) is None


def test_the_lead_outlasts_two_polls_and_reports_go_stale_after_three():
    for poll_s in (0.5, 2.0):
        assert activation_lead_s(poll_s) > 2 * poll_s
        assert stale_after_s(poll_s) > 3 * poll_s


def test_a_fresh_application_serves_the_alias_and_later_replicas_get_what_is_active():
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=0.0)
    first = state.report(report("a", None, alias_version="1"), now=1.0, running=0)
    assert first == {"plan": Plan("1", 1.0).to_dict(), "ready": True, "replicas": 1}
    # The alias moves on before the second replica starts: it is still told to load v1.
    second = state.report(report("b", None, alias_version="2"), now=1.5, running=1)
    assert second["plan"]["version"] == "1"


def test_the_rollout_is_scheduled_once_and_reported_back_to_every_replica():
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=-60.0)  # past its start-up grace
    state.report(report("a", "1"), 1.0, 2)
    state.report(report("b", "1"), 1.0, 2)
    assert state.plan == Plan("1", 1.0)
    assert state.report(report("a", "1", "2"), 2.0, 2)["plan"]["version"] == "1"  # b not ready yet
    answer = state.report(report("b", "1", "2"), 2.5, 2)
    assert answer["plan"] == {"version": "2", "at": 5.5, "previous": "1"}
    assert state.report(report("a", "1", "2"), 3.0, 2)["plan"] == answer["plan"]
    snapshot = state.snapshot(4.0, 2)
    assert snapshot["active_version"] == "2" and snapshot["pending"] and snapshot["activate_at"] == 5.5
    assert [(r["replica"], r["prepared"], r["age_s"]) for r in snapshot["replicas"]] == [
        ("a", "2", 1.0),
        ("b", "2", 1.5),
    ]


def test_the_answer_counts_the_replicas_that_share_the_rate_limit():
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=-60.0)
    assert state.report(report("a", "1"), 1.0, None)["replicas"] == 1  # Serve's count unknown
    assert state.report(report("b", "1"), 1.5, 1)["replicas"] == 2  # b reports before Serve counts it
    assert state.report(report("a", "1"), 2.0, 3)["replicas"] == 3  # c runs, not yet reporting
    assert state.report(report("a", "1"), 9.0, 1)["replicas"] == 1  # b's report went stale


def test_a_dead_replicas_report_ages_out():
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=-60.0)
    state.report(report("gone", "1"), 1.0, 2)
    state.report(report("a", "1", "2"), 1.0, 2)
    state.report(report("b", "1", "2"), 2.0, 2)
    assert state.plan.version == "1"  # "gone" is still live and not ready
    state.report(report("a", "1", "2"), 6.5, 2)
    assert state.plan == Plan("2", 6.5 + LEAD, previous="1")
    assert [r["replica"] for r in state.snapshot(7.0, 2)["replicas"]] == ["a", "b"]


def test_a_new_coordinator_adopts_what_replicas_know_before_telling_a_starting_one():
    pending = Plan("2", at=105.0, previous="1")
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=100.0)
    # A replacement replica reports first: replicas are running, so it is told to wait.
    waiting = state.report(report("new", None, alias_version="3"), 100.5, 2)
    assert waiting == {"plan": None, "ready": False, "replicas": 2}
    answer = state.report(report("a", "1", "2", plan=pending), 101.0, 2)
    assert answer == {"plan": pending.to_dict(), "ready": True, "replicas": 2}
    # An older plan reported later does not replace the newer one.
    state.report(report("b", "1", "2", plan=Plan("1", 50.0)), 101.2, 2)
    assert state.plan == pending


def test_after_its_grace_a_new_coordinator_adopts_the_version_every_replica_serves():
    state = RolloutState(stale_s=5.0, lead_s=LEAD, started_at=100.0)
    state.report(report("a", "4"), 100.5, 2)
    assert state.plan is None
    state.report(report("b", "4"), 105.5, 2)
    assert state.plan == Plan("4", 105.5)


def snapshot_of(*replicas: dict, running: int = 2, active: str = "2") -> dict:
    base = dict(node="0123456789abcdef", prepared=None, alias_version="2", error=None, age_s=0.1)
    return {
        "active_version": active,
        "running_replicas": running,
        "replicas": [{**base, **r} for r in replicas],
    }


def test_a_rollout_is_complete_only_when_every_live_replica_serves_the_version():
    done = snapshot_of({"replica": "a", "serving": "2"}, {"replica": "b", "serving": "2"})
    assert unfinished(done, "2") == []
    broken = snapshot_of(
        {"replica": "a", "serving": "1", "error": "cannot load v2: SafetensorError: bad header"},
        {"replica": "b", "serving": "2"},
    )
    assert unfinished(broken, "2") == [
        "replica a (node 01234567) serves v1, error: cannot load v2: SafetensorError: bad header"
    ]
    assert unfinished(snapshot_of({"replica": "a", "serving": "2"}), "2") == [
        "1 running replica(s) have not reported"
    ]
    assert unfinished(snapshot_of(running=0), "2") == ["Serve reports no running replica"]
    assert unfinished(snapshot_of({"replica": "a", "serving": "2"}, running=1, active="1"), "2") == [
        "the coordinator has v1 active"
    ]


def test_promote_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="--timeout-s"):
        PromoteConfig(version="2", timeout_s=0)


def test_promote_with_a_bad_timeout_exits_2_with_one_line(cli):
    result = cli("promote", "2", "--timeout-s", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["argus: error: --timeout-s must be > 0, got 0.0"]
