"""Coordinated rollout: every replica of a Serve application switches to a new version together.

Each replica *prepares* the alias's version (loads it beside the one it serves) and reports every
poll to one `RolloutCoordinator` actor per application: its id, node, the version it serves, the
one it has prepared and its load error, if any. When every live replica (a fresh report from at
least as many replicas as Serve counts RUNNING) has prepared the same new version, the coordinator
schedules its activation at a wall time T, more than two poll intervals ahead, so that every replica
learns (version, T) from a report's answer before T. A replica then answers a request accepted at or
after T with the new version and one accepted before T with the old. Replicas on one host share one
clock, so no client ever sees new → old; across hosts this holds up to their clock skew.

Fail safe: a replica that cannot load a version keeps serving the old one (and says why in
/rollout and promote's failure); while the coordinator is unreachable replicas keep
serving what they serve and nothing activates. The coordinator keeps no state of its own that
matters: it lives as long as the replica that created it (so it goes with the application), and a
new one adopts the newest activation the replicas report. A replica that starts while a version is
active loads that one first; with no coordinator state it serves the alias's version.

Pure rules (`next_activation`, `RolloutState`, `unfinished`) are here without Ray, for unit tests;
`RolloutCoordinator` and `CoordinatorLink` are the thin Ray layer around them; `app.serve.promote`
moves the alias and waits on /rollout.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

NAMESPACE = "argus"


def activation_lead_s(poll_s: float) -> float:
    """How far ahead an activation is scheduled: two poll intervals (every replica reports, and so
    learns the activation, within one) plus room for a slow report on a loaded machine (a replica
    that learns it late serves the old version past T: seen at 2 s of room with 12 runnable
    processes on 2 cores)."""
    return 2 * poll_s + 4.0


def stale_after_s(poll_s: float) -> float:
    """A replica whose last report is older than this is not live (it died, or is wedged)."""
    return 3 * poll_s + 2.0


@dataclass(frozen=True)
class Plan:
    """Requests accepted at or after `at` (time.time()) get `version`; before, `previous`."""

    version: str
    at: float
    previous: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Plan | None:
        return cls(**data) if data else None


@dataclass(frozen=True)
class ReplicaReport:
    replica: str
    node: str
    serving: str | None
    """The version requests accepted now get."""
    prepared: str | None
    """A version loaded beside the served one, waiting for its activation."""
    alias_version: str | None
    error: str | None
    """Why the version the replica tried to prepare could not be loaded."""
    plan: Plan | None = None
    """The activation this replica knows: lets a new coordinator carry on where the last one was."""

    def ready_for(self, version: str) -> bool:
        return version in (self.prepared, self.serving)

    def to_dict(self) -> dict:
        return {**asdict(self), "plan": self.plan.to_dict() if self.plan else None}

    @classmethod
    def from_dict(cls, data: dict) -> ReplicaReport:
        return cls(**{**data, "plan": Plan.from_dict(data.get("plan"))})


def next_activation(
    live: list[ReplicaReport], running: int | None, plan: Plan | None, now: float, lead_s: float
) -> Plan | None:
    """The activation to schedule now, or None to leave things as they are.

    Only when every live replica has the same new version ready and reads the alias as that
    version, at least as many replicas have reported as Serve runs (one still starting has
    reported, so it counts), and no activation is pending (one at a time: a replica holds one
    prepared version). Requiring the alias too matters: a replica reports before it drops a
    prepared version for a newer alias, so nothing is scheduled on a version it is letting go."""
    if running is None or not live or len(live) < running:
        return None
    if plan is not None and now < plan.at:
        return None
    prepared = {r.prepared for r in live if r.prepared is not None}
    if len(prepared) != 1:
        return None  # nothing new, or replicas still converging on the alias
    (version,) = prepared
    if plan is not None and version == plan.version:
        return None
    if not all(r.ready_for(version) and r.alias_version == version for r in live):
        return None
    return Plan(version, now + lead_s, previous=plan.version if plan else None)


class RolloutState:
    """The coordinator's state and rules; time and Serve's RUNNING count come in as arguments."""

    def __init__(self, *, stale_s: float, lead_s: float, started_at: float):
        self.stale_s, self.lead_s, self.started_at = stale_s, lead_s, started_at
        self.plan: Plan | None = None
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}

    def live(self, now: float) -> list[tuple[ReplicaReport, float]]:
        return sorted(
            (pair for pair in self._reports.values() if now - pair[1] <= self.stale_s),
            key=lambda pair: pair[0].replica,
        )

    def ready(self, now: float, running: int | None) -> bool:
        """Whether this coordinator knows enough to tell a starting replica what to load: it has a
        plan, nothing else runs (a fresh application), or every live replica had time to report the
        activation it knows (a coordinator recreated next to running replicas)."""
        return self.plan is not None or running == 0 or now - self.started_at >= self.stale_s

    def report(self, report: ReplicaReport, now: float, running: int | None) -> dict:
        """Record a replica's report; answer with the activation every replica should follow."""
        self._reports[report.replica] = (report, now)
        for replica, (_, received) in list(self._reports.items()):
            if now - received > 10 * self.stale_s:
                del self._reports[replica]
        if report.plan is not None and (self.plan is None or report.plan.at > self.plan.at):
            self.plan = report.plan  # scheduled by an earlier coordinator of this application
        ready = self.ready(now, running)
        live = [r for r, _ in self.live(now)]
        if self.plan is None and ready:
            serving = {r.serving for r in live if r.serving is not None}
            if len(serving) == 1:
                self.plan = Plan(serving.pop(), now)
            elif not serving and report.alias_version is not None:
                self.plan = Plan(report.alias_version, now)  # a fresh application serves the alias
        scheduled = next_activation(live, running, self.plan, now, self.lead_s)
        if scheduled is not None:
            log.info(
                "every live replica (%d) has v%s ready: activating it in %.1fs (was v%s)",
                len(live),
                scheduled.version,
                scheduled.at - now,
                scheduled.previous,
            )
            self.plan = scheduled
        # How many replicas share the deployment's rate limit (the reporting ones, or Serve's count).
        replicas = max(len(live), running or 0)
        return {"plan": self.plan.to_dict() if self.plan else None, "ready": ready, "replicas": replicas}

    def snapshot(self, now: float, running: int | None) -> dict:
        """GET /rollout: the activation and every live replica's last report."""
        plan = self.plan
        return {
            "active_version": plan.version if plan else None,
            "activate_at": plan.at if plan else None,
            "previous_version": plan.previous if plan else None,
            "pending": bool(plan and now < plan.at),
            "now": now,
            "running_replicas": running,
            "replicas": [
                {
                    "replica": r.replica,
                    "node": r.node,
                    "serving": r.serving,
                    "prepared": r.prepared,
                    "alias_version": r.alias_version,
                    "error": r.error,
                    "age_s": round(now - received, 3),
                }
                for r, received in self.live(now)
            ],
        }


def unfinished(snapshot: dict, version: str) -> list[str]:
    """What keeps a rollout to `version` from being complete, one phrase each; empty when every
    live replica serves it."""
    problems = []
    for r in snapshot["replicas"]:
        if r["serving"] != version:
            detail = f"serves v{r['serving']}" if r["serving"] else "serves nothing"
            if r["prepared"]:
                detail += f", v{r['prepared']} prepared"
            if r["error"]:
                detail += f", error: {r['error']}"
            problems.append(f"replica {r['replica']} (node {r['node'][:8]}) {detail}")
    running = snapshot["running_replicas"]
    if not running:
        problems.append("Serve reports no running replica")
    elif len(snapshot["replicas"]) < running:
        problems.append(f"{running - len(snapshot['replicas'])} running replica(s) have not reported")
    if not problems and snapshot["active_version"] != version:
        problems.append(f"the coordinator has v{snapshot['active_version']} active")
    return problems


# ---------------------------------------------------------------- Ray: the coordinator and its link


class RolloutCoordinator:
    """One per Serve application (a named actor, num_cpus=0). Plain dicts cross its boundary."""

    def __init__(self, app: str, deployment: str, poll_s: float):
        self.app, self.deployment, self.poll_s = app, deployment, poll_s
        self.state = RolloutState(
            stale_s=stale_after_s(poll_s), lead_s=activation_lead_s(poll_s), started_at=time.time()
        )
        self._running: tuple[int | None, float] = (None, float("-inf"))

    def _running_replicas(self) -> int | None:
        """Serve's RUNNING replicas of the deployment (cached for half a poll); None if unknown,
        which schedules nothing."""
        count, at = self._running
        if time.monotonic() - at < self.poll_s / 2:
            return count
        try:
            from ray import serve

            application = serve.status().applications.get(self.app)
            deployment = application.deployments.get(self.deployment) if application else None
            count = deployment.replica_states.get("RUNNING", 0) if deployment else 0
        except Exception as exc:  # the controller restarting: decide nothing until it answers
            log.warning("serve.status() failed: %s", exc)
            count = None
        self._running = (count, time.monotonic())
        return count

    def report(self, report: dict) -> dict:
        return self.state.report(ReplicaReport.from_dict(report), time.time(), self._running_replicas())

    def snapshot(self) -> dict:
        return self.state.snapshot(time.time(), self._running_replicas())


def coordinator_name(app: str, mlflow_uri: str, model_name: str, alias: str) -> str:
    """Per application and registry: tests and clusters that reuse an application name for another
    registry never share a coordinator's version numbers. (Actor namespace: NAMESPACE.)"""
    scope = f"{mlflow_uri}|{model_name}|{alias}"
    return f"rollout-{app}-{hashlib.sha256(scope.encode()).hexdigest()[:12]}"


class CoordinatorLink:
    """A replica's handle on its application's coordinator, created on first use and looked up
    again after a failure (the actor dies with the replica that created it)."""

    def __init__(self, name: str, replica_context, poll_s: float):
        self.name, self.poll_s = name, poll_s
        self.app, self.deployment = replica_context.app_name, replica_context.deployment
        self._handle = None

    def call(self, method: str, *args, timeout_s: float) -> dict:
        import ray

        if self._handle is None:
            self._handle = (
                ray.remote(RolloutCoordinator)
                .options(
                    name=self.name,
                    namespace=NAMESPACE,
                    get_if_exists=True,
                    num_cpus=0,
                    max_restarts=-1,
                )
                .remote(self.app, self.deployment, self.poll_s)
            )
        try:
            return ray.get(getattr(self._handle, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            # Slow, not gone: keep the handle. Ray kills a (non-detached) coordinator once the replica
            # that created it drops it, and under load each new one timed out too (seen: 4 in a minute).
            raise
        except Exception:
            self._handle = None
            raise
