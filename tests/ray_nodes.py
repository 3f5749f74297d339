"""Real multi-node Ray clusters on one host for tests: `ray start --head` and `ray start --address`,
each `--block` in its own process group with its own `--num-cpus` and a custom resource named after
the node, so work can be placed on a chosen node. A node is killed as a machine would die: SIGKILL
to its process group (raylet, object store, workers). With a `token`, every node runs Ray's token
authentication (`RAY_AUTH_MODE=token`) and this harness's own calls carry the token."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from app.cluster import SERVE_ENV
from app.net import free_port

from conftest import ROOT, child_env, missing_dependency

VENV_BIN = Path(sys.executable).parent


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    log: Path
    num_cpus: float

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalRayCluster:
    """A head node and any number of worker nodes. `address` is the GCS address (`--ray-address`),
    `dashboard` the URL `ray job submit` and the state API take."""

    log_dir: Path
    token: str = ""  # Ray's token authentication on every node when set
    address: str = ""
    dashboard: str = ""
    metrics_port: int = 0
    head_env: dict[str, str] = field(default_factory=dict)  # the head's own (e.g. RAY_REDIS_ADDRESS)
    nodes: dict[str, Node] = field(default_factory=dict)  # the started ones not killed
    _head_args: list[str] = field(default_factory=list, repr=False)
    started: list[Node] = field(default_factory=list)  # every node ever started
    # Short: Ray's socket paths have a length limit.
    temp_dir: str = field(default_factory=lambda: f"/tmp/argus-ray-{uuid.uuid4().hex[:6]}")

    def env(self) -> dict[str, str]:
        return child_env(
            PATH=f"{VENV_BIN}:{os.environ['PATH']}",
            PYTHONPATH=str(ROOT),
            RAY_USAGE_STATS_ENABLED="0",
            # The GCS declares a node dead after 5 failed health checks: one a second rather than
            # every 3 s, so a killed node is noticed in ~5 s instead of ~15-20 s. A killed raylet
            # fails them at once (connection refused); a busy one still has the default 10 s each.
            RAY_health_check_period_ms="1000",
            # Ray Train waits this long for a worker group's placement group. Its workers fail the
            # moment a node dies, seconds before the GCS declares the node dead, so the controller
            # first asks again for the group it had and waits out the whole default 60 s before it
            # settles for what is left. Here resources are there or not at once.
            RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10",
            # As app/cluster.py does for its own Ray: a loaded host's agents are slow to register.
            # It does not lengthen the raylet's fixed ~15 s wait for their port files (see _start).
            RAY_agent_register_timeout_ms="180000",
            **SERVE_ENV,
            **self.auth_env(),
        )

    def auth_env(self) -> dict[str, str]:
        """What a process needs to talk to this cluster: Ray reads the token from a file, so it
        never shows in a command line."""
        if not self.token:
            return {}
        token_file = self.log_dir / "ray-auth-token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}

    def headers(self) -> dict[str, str]:
        """This process's HTTP calls to the dashboard (its Ray may run without authentication)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start_head(self, num_cpus: float, *options: str, name: str = "head") -> Node:
        """The head node; `options` go to its `ray start` (e.g. `--object-store-memory=...`); one that
        dies while starting is started once more, on fresh ports."""

        def head_args() -> list[str]:
            gcs_port, dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
            self.address, self.dashboard = f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}"
            self._head_args = [
                "--head",
                f"--port={gcs_port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}",
                f"--ray-client-server-port={free_port()}",
                f"--temp-dir={self.temp_dir}",
                *options,
            ]
            return self._head_args

        node = self._start_head_twice(name, num_cpus, head_args, 120, "the head's job server")
        self.wait_for_nodes(1)
        return node

    def restart_head(self, name: str = "head") -> Node:
        """A new head node where a killed one was: the same ports, the same `head_env` (with GCS fault
        tolerance, the same Redis), so the nodes left reconnect to it."""
        assert name not in self.nodes, "kill the head first"
        num_cpus = next(n.num_cpus for n in self.started if n.name == name)
        # A session dir of its own: `ray start --head` refuses to start where the dead head's
        # ray_current_cluster names a GCS address that the worker's processes still use.
        args = [a for a in self._head_args if not a.startswith("--temp-dir=")]
        # Longer than a first start: the new GCS first reloads its tables from Redis and hears from
        # the nodes left (twice past 120 s on a loaded host, in clean-clone runs of 2026-12-05).
        return self._start_head_twice(
            name,
            num_cpus,
            lambda: [*args, f"--temp-dir={self.temp_dir}-{name}{len(self.started)}"],
            240,
            "the restarted head's job server",
        )

    def _start_head_twice(self, name: str, num_cpus: float, args, timeout_s: float, what: str) -> Node:
        """`ray start` with `args()`, and once more with fresh `args()` if it exits before the job
        server answers: on a host with both cores busy its Ray Client server can give up its fixed
        30 s wait for the raylet, or the raylet its fixed ~15 s wait for the dashboard agent's
        listen-port file (clean clones' runs, 2026-12-06), and `--block` then stops the whole node."""
        for attempt in (1, 2):
            node = self._start(name, num_cpus, args(), self.head_env, metrics_port=self.metrics_port)
            try:
                self._wait(self._job_server_answers, timeout_s, what)
                return node
            except AssertionError:
                if node.alive or attempt == 2:
                    raise
                print(f"ray start for {name} exited {node.process.returncode} while starting; once more")
                self._stop(self.nodes.pop(name))
        raise AssertionError(f"{name} did not start")  # unreachable: the second failure raised

    def add_node(self, name: str, num_cpus: float, env: dict[str, str] | None = None) -> Node:
        assert self.address, "start the head first"
        before = len(self.alive_node_ids())
        # A session dir of its own: nodes sharing one would share runtime_resources/, and a node's
        # runtime-env agent deletes a job's working dir there once its own workers are done with
        # it, under the job driver running on another node (seen: the driver's cwd vanished).
        # Numbered: a node started again under a killed one's name gets a fresh dir too.
        temp_dir = f"{self.temp_dir}-{name}{len(self.started)}"
        node = self._start(name, num_cpus, [f"--address={self.address}", f"--temp-dir={temp_dir}"], env)
        self.wait_for_nodes(before + 1)
        return node

    def _start(
        self,
        name: str,
        num_cpus: float,
        args: list[str],
        env: dict[str, str] | None = None,
        metrics_port: int | None = None,
    ) -> Node:
        log = self.log_dir / f"ray-{name}.log"
        process = subprocess.Popen(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps({f'node_{name}': 1})}",
                # The one fixed default port of every node: nodes on one host would share it.
                f"--dashboard-agent-listen-port={free_port()}",
                # The agents' other ports given too: left at 0, the raylet waits a fixed ~15 s for
                # the agent to write them to files, and dies when its imports take longer on a
                # busy host (a restarted head's dashboard agent first logged 20 s after its spawn).
                f"--dashboard-agent-grpc-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                f"--metrics-export-port={metrics_port or free_port()}",
                # Workers take OS-assigned ports: two raylets on one host share the default range.
                "--min-worker-port=0",
                "--max-worker-port=0",
                "--disable-usage-stats",
                *args,
            ],
            env={**self.env(), **(env or {})},
            stdout=open(log, "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        node = Node(name, process, log, num_cpus)
        self.nodes[name] = node
        self.started.append(node)
        return node

    def kill(self, name: str, noticed: bool = True) -> float:
        """SIGKILL the node's whole process group, as a lost machine; return when (time.time()) it
        died. `noticed`: return once the GCS's health checks have noticed (not for the head: its
        GCS dies with it)."""
        node = self.nodes.pop(name)
        killed_at = time.time()  # nothing between this and the kill: tests compare against it
        os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait(30)
        if noticed:
            self.wait_for_nodes(len(self.nodes))
        return killed_at

    def alive_node_ids(self) -> list[str]:
        from ray.util.state import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        try:
            client = StateApiClient(self.dashboard, headers=self.headers() or None)
            nodes = client.list(
                StateResource.NODES, options=ListApiOptions(timeout=10), raise_on_missing_output=False
            )
        except Exception:  # the dashboard still starting, or busy
            return []
        return [n.node_id for n in nodes if n.state == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        self._wait(lambda: len(self.alive_node_ids()) == count, timeout_s, f"{count} alive nodes")

    def _job_server_answers(self) -> bool:
        from ray.job_submission import JobSubmissionClient

        try:
            JobSubmissionClient(self.dashboard, headers=self.headers()).list_jobs()
            return True
        except Exception:
            return False

    def _wait(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            dead = {n.name: n.process.returncode for n in self.nodes.values() if not n.alive}
            assert not dead, f"ray start exited {dead}: see {[str(self.nodes[d].log) for d in dead]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(1)

    @staticmethod
    def _stop(node: Node) -> None:
        # Also where `ray start` itself is gone (a start that failed or timed out): its raylet and
        # agents may live on in its group.
        try:
            os.killpg(node.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.process.wait()

    def clear(self) -> None:
        """Back to the head alone and idle, for the next test sharing it: every job stopped, Serve
        shut down, every other node stopped."""
        import requests
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.dashboard, headers=self.headers())
        running = [job.submission_id for job in client.list_jobs() if not job.status.is_terminal()]
        for job_id in running:
            client.stop_job(job_id)

        def stopped() -> bool:
            return all(client.get_job_status(job_id).is_terminal() for job_id in running)

        self._wait(stopped, 120, "jobs to stop")
        # `serve shutdown`'s call: the dashboard shuts Serve down where it runs, and does nothing where not.
        serve_api = f"{self.dashboard}/api/serve/applications/"
        requests.delete(serve_api, headers=self.headers(), timeout=120).raise_for_status()
        for name in [name for name in self.nodes if name != "head"]:
            self._stop(self.nodes.pop(name))
        self.wait_for_nodes(1)

    def shutdown(self) -> None:
        """SIGKILL each node's process group, workers first: a test's cluster keeps nothing worth a
        graceful stop, and `ray start --block` takes ~30 s to stop on SIGTERM."""
        for node in sorted(self.nodes.values(), key=lambda n: n.name == "head"):
            self._stop(node)
        self.nodes.clear()
        for directory in Path("/tmp").glob(f"{Path(self.temp_dir).name}*"):
            shutil.rmtree(directory, ignore_errors=True)


@dataclass
class RedisServer:
    """Debian's `redis-server` on 127.0.0.1, in memory only: the store of a head's GCS fault tolerance."""

    process: subprocess.Popen
    port: int

    @classmethod
    def start(cls, log_dir: Path) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            missing_dependency("redis-server not found: apt-get install redis-server (.ci/run does)")
        port = free_port()
        process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
            stdout=open(log_dir / "redis.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        server = cls(process, port)
        deadline = time.monotonic() + 30
        while not server.answers():
            assert process.poll() is None, (
                f"redis-server exited {process.returncode}: see {log_dir}/redis.log"
            )
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.1)
        return server

    def answers(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def head_env(self, namespace: str) -> dict[str, str]:
        """A head's GCS keeps its tables here, under `namespace` (the same for each head restarted)."""
        return {"RAY_REDIS_ADDRESS": f"127.0.0.1:{self.port}", "RAY_external_storage_namespace": namespace}

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def submit(dashboard: str, *command: str, env: dict[str, str] | None = None) -> str:
    """`ray job submit --working-dir . --no-wait -- python -m app ...`, as the README shows; the job id.
    `env`: the submitting process's environment (e.g. a cluster's `auth_env()`) over this one's."""
    result = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", ".", "--no-wait"]
        + ["--", "python", "-m", "app", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return next(
        line.split("'")[1]
        for line in (result.stdout + result.stderr).splitlines()
        if "submitted successfully" in line
    )


def wait_for_job(
    dashboard: str, job_id: str, timeout_s: float = 600, headers: dict[str, str] | None = None
) -> str:
    """Wait for the job to end; assert it succeeded; its logs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard, headers=headers)
    deadline = time.monotonic() + timeout_s
    while (status := client.get_job_status(job_id)) not in {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
    }:
        assert time.monotonic() < deadline, f"job {job_id} {status}: {client.get_job_logs(job_id)[-3000:]}"
        time.sleep(0.5)  # a status call is cheap; each job's end is waited for ~1 s less on average
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)[-4000:]
    return client.get_job_logs(job_id)
