"""Which model versions one replica holds, and when it switches: the replica's half of a rollout.

Each replica polls the alias (default `champion`) and *prepares* its version, loaded beside the one
it serves; `app/serve/rollout.py`'s coordinator activates a version on every replica at once, at a
wall time every replica knows beforehand, so a rollout drops no request and no client sees
new → old. A version that does not load is not activated anywhere: the replica keeps serving the
old one and says why (its report, and so /rollout)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app import metrics, registry
from app.serve import rollout

log = logging.getLogger(__name__)

RETRY_FAILED_LOAD_S = 30.0
"""A version that failed to load is tried again after this long (an artifact fixed in place)."""


class ReplicaVersions:
    """The served and the prepared version of one replica, kept in step with the rollout
    coordinator (reported to every `poll_s`) and the registry's alias (polled as often)."""

    def __init__(
        self,
        mlflow_uri: str,
        model_name: str,
        alias: str,
        poll_s: float,
        device,
        context,
        node: str,
        on_replica_count: Callable[[int], None] | None = None,
    ):
        self.mlflow_uri, self.model_name, self.alias, self.poll_s = mlflow_uri, model_name, alias, poll_s
        self.on_replica_count = on_replica_count
        """Called with the deployment's replica count at each coordinator answer (the rate limit's share)."""
        self.device, self.node = device, node
        self.replica = context.replica_id.unique_id
        self.serving: registry.LoadedModel | None = None
        """Answers requests accepted now."""
        self.prepared: registry.LoadedModel | None = None
        """Loaded beside `serving`, answering requests once the coordinator's activation time comes."""
        self.plan: rollout.Plan | None = None
        self.error: str | None = None
        self._failed_at: dict[str, float] = {}
        self._swap = threading.Lock()
        self._loading = threading.Lock()  # one load at a time: the alias poller or a health check
        self._coordinator_answered = threading.Event()
        self._coordinator_reachable = True
        self._link = rollout.CoordinatorLink(
            rollout.coordinator_name(context.app_name, mlflow_uri, model_name, alias), context, poll_s
        )
        self._stop = threading.Event()
        self.alias_version = registry.resolve(mlflow_uri, model_name, alias)

    def start(self) -> None:
        """Report, load what the coordinator says is active (else the alias's version), then follow."""
        # Report before loading anything: a starting replica counts as live, so no activation is
        # scheduled without it, and the first answer says what is active.
        threading.Thread(target=self._report_loop, daemon=True, name="rollout-reporter").start()
        if not self._coordinator_answered.wait(rollout.stale_after_s(self.poll_s) + 10):
            log.warning("no answer from the rollout coordinator: serving the alias's version")
        self._load_initial()
        threading.Thread(target=self._follow_alias, daemon=True, name="alias-poller").start()

    def stop(self) -> None:
        self._stop.set()

    def coordinator_state(self) -> dict:
        """What the coordinator knows of every live replica (GET /rollout)."""
        return self._link.call("snapshot", timeout_s=5.0)

    def model_for(self, accepted_at: float) -> registry.LoadedModel | None:
        """The version a request accepted at `accepted_at` (time.time()) gets: the prepared one
        from the activation's time on, which also makes it the served one."""
        plan, prepared = self.plan, self.prepared
        if plan is not None and prepared is not None and prepared.version == plan.version:
            if accepted_at >= plan.at:
                with self._swap:
                    if self.prepared is prepared:
                        previous, self.serving, self.prepared = self.serving, prepared, None
                        log.info("now serving v%s (was v%s)", prepared.version, previous and previous.version)
        return self.serving

    def prepare(self) -> None:
        """Load the wanted version beside the served one; on failure keep serving and say why."""
        with self._loading:
            self.alias_version = registry.resolve(self.mlflow_uri, self.model_name, self.alias)
            self.model_for(time.time())
            target = self._wanted()
            if target is None:
                return
            if self.prepared is not None and self.prepared.version != target:
                # The alias moved away from the prepared version. Tell the coordinator first (it
                # schedules nothing on a version a replica's alias has left) and learn whether that
                # version was scheduled meanwhile: if so, keep it for its activation.
                if not self._report_now() or self._wanted() != target:
                    return
                with self._swap:
                    self.prepared = None
            if self._has(target):
                self.error = None
                return
            failed_at = self._failed_at.get(target)
            if failed_at is not None and time.monotonic() - failed_at < RETRY_FAILED_LOAD_S:
                return
            try:
                loaded = self._load(target)
            except Exception as exc:
                self._failed_at[target] = time.monotonic()
                reason = (str(exc).strip().splitlines() or [""])[0][:300]
                self.error = f"cannot load v{target}: {type(exc).__name__}: {reason}"
                log.warning("%s; still serving v%s", self.error, self.serving and self.serving.version)
                return
            self._failed_at.pop(target, None)
            self.error = None
            with self._swap:
                if self.serving is None:
                    self.serving = loaded  # nothing served yet: nothing to be consistent with
                else:
                    self.prepared = loaded
            log.info("v%s prepared beside v%s", target, self.serving.version)

    def _load(self, version: str) -> registry.LoadedModel:
        loaded = registry.load(self.mlflow_uri, self.model_name, version)
        loaded.model.to(self.device)
        return loaded

    def _load_initial(self) -> None:
        plan = self.plan
        if plan is None:  # no coordinator state: the alias's version, directly
            if self.alias_version is not None:
                self.serving = self._load(self.alias_version)
        elif time.time() < plan.at and plan.previous:
            # Started while an activation is pending: the old version until its time, then the new.
            self.serving, self.prepared = self._load(plan.previous), self._load(plan.version)
        else:
            self.serving = self._load(plan.version)  # what every other replica serves
        log.info("replica %s serving v%s", self.replica, self.serving and self.serving.version)

    def _has(self, version: str) -> bool:
        return any(m is not None and m.version == version for m in (self.serving, self.prepared))

    def _report(self) -> rollout.ReplicaReport:
        serving, prepared = self.serving, self.prepared
        return rollout.ReplicaReport(
            replica=self.replica,
            node=self.node,
            serving=serving.version if serving else None,
            prepared=prepared.version if prepared else None,
            alias_version=self.alias_version,
            error=self.error,
            plan=self.plan,
        )

    def _report_now(self) -> bool:
        """Report to the coordinator and follow its answer; False when it is unreachable."""
        self.model_for(time.time())  # activate when due even without traffic, so reports are true
        # Every poll, so the gauge follows each activation and alias move (alert ArgusReplicaBehindAlias).
        serving, alias = self.serving, self.alias_version
        behind = alias is not None and (serving is None or serving.version != alias)
        metrics.set_gauge("argus_serve_replica_behind_alias", int(behind), replica=self.replica)
        try:
            answer = self._link.call("report", self._report().to_dict(), timeout_s=max(5.0, 2 * self.poll_s))
        except Exception as exc:  # fail safe: keep serving what this replica serves
            if self._coordinator_reachable:
                log.warning(
                    "rollout coordinator unreachable (%s): no version activates until it is back", exc
                )
            self._coordinator_reachable = False
            return False
        self._coordinator_reachable = True
        self._follow_plan(rollout.Plan.from_dict(answer["plan"]))
        if self.on_replica_count is not None and answer.get("replicas"):  # older coordinators: absent
            self.on_replica_count(answer["replicas"])
        if answer["ready"]:
            self._coordinator_answered.set()
        return True

    def _report_loop(self) -> None:
        while True:
            self._report_now()
            if self._stop.wait(self.poll_s):
                return

    def _follow_plan(self, plan: rollout.Plan | None) -> None:
        current = self.plan
        if plan is None or plan == current or (current is not None and plan.at < current.at):
            return  # a new coordinator that knows nothing yet, or an older plan: keep ours
        if self.serving is not None and time.time() >= plan.at and not self._has(plan.version):
            log.warning("learned of v%s's activation after its time: catching up", plan.version)
        log.info("v%s activates in %.1fs", plan.version, plan.at - time.time())
        self.plan = plan

    def _follow_alias(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.prepare()
            except Exception:  # a registry hiccup must not stop the replica serving what it has
                log.exception("could not follow alias %r", self.alias)

    def _wanted(self) -> str | None:
        """The version to have loaded next: the activation's (catching up), nothing while one is
        pending (its version holds the prepared slot), else the alias's."""
        plan = self.plan
        if plan is not None and not self._has(plan.version):
            return plan.version
        if plan is not None and time.time() < plan.at:
            return None
        return self.alias_version
