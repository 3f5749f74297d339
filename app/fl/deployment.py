"""The deployment engine: the same rounds over real devices, through Flower's deployment runtime.

    python -m app federate --engine deployment --superlink 10.0.0.5:9093 --root-certificates ca.pem
    python -m app device --data-dir DIR --superlink 10.0.0.5:9093 --root-certificates ca.pem --auth-key KEY

`federate_on_devices` (the `federate` command's side) writes the run's job (settings and config) to
the storage, submits the Flower app in `fab/` to the SuperLink (starting one for the run when given
its certificate and key, and registering `--device-keys`) and reads back the report. The app's
ServerApp (`server_app`, run by the SuperLink's SuperExec) reads the job and calls `federate` with
the SuperLink's grid: the rounds, guard, privacy, central test-slice evaluation, checkpoints,
registration and `--promote-if-better` are the simulation's own lines. Its ClientApp is the
simulation's `client_app`, which trains on a device's own folder (`app.fl.device`)."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from app.config import Settings
from app.fl.config import FederateConfig, FederateReport
from app.fl.grid import RoundTraffic, array_bytes, reply_schema
from app.fl.superlink import FlowerControl, SuperLink
from app.selection import Verdict
from app.storage import Store

log = logging.getLogger(__name__)

FAB_DIR = Path(__file__).with_name("fab")
"""The Flower app submitted to the SuperLink: a pyproject.toml naming this module's ServerApp and
the simulation's ClientApp, which the SuperLink's and the devices' Argus installs provide."""
JOB_FILE, RESULT_FILE = "job.json", "result.json"
RUN_MARGIN_S = 600.0
"""How long `flwr run` may take beyond the rounds' own deadlines: devices joining, app start-up,
the central evaluation and registration."""


def job_folder(settings: Settings, run_name: str) -> str:
    return settings.uri("federated", run_name)


class DeviceGrid(Grid):
    """Flower's grid to the SuperLink's devices, counting what each `send_and_receive` moved (`last`,
    as `RayGrid` does) and the schema of every reply (`wire`). Replies arrive as Flower parsed them
    from protobuf (never Python objects); the guard checks each before it counts."""

    num_actors = 0

    def __init__(self, grid: Grid):
        self._grid = grid
        self.wire: collections.Counter[str] = collections.Counter()
        self.last = RoundTraffic()

    @property
    def run(self):
        return self._grid.run

    def set_run(self, run_id: int) -> None:
        self._grid.set_run(run_id)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        started = time.monotonic()
        self.last = RoundTraffic(sent=len(messages), bytes_down=sum(array_bytes(m.content) for m in messages))
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if reply.has_error():
                self.last.failed += 1
                continue
            self.last.replied += 1
            self.last.bytes_up += array_bytes(reply.content)
            self.wire[reply_schema(reply)] += 1
        self.last.timed_out = len(messages) - len(replies)
        self.last.seconds = time.monotonic() - started
        return replies


# ---------------------------------------------------------------- the job, both sides


def _fields(instance) -> dict:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}


def write_job(settings: Settings, cfg: FederateConfig) -> str:
    """The run's settings and config as JSON in its folder on the storage; the job's URI."""
    folder = Store.at(job_folder(settings, cfg.run_name))
    if folder.exists(RESULT_FILE):
        folder.delete(RESULT_FILE)  # a resumed run's report is the new one
    folder.write(JOB_FILE, json.dumps({"settings": _fields(settings), "federate": _fields(cfg)}).encode())
    return folder.uri(JOB_FILE)


def read_job(uri: str) -> tuple[Settings, FederateConfig]:
    folder, _, name = uri.rpartition("/")
    job = json.loads(Store.at(folder).read(name))
    settings = job["settings"]
    if settings.get("classes") is not None:
        settings["classes"] = tuple(settings["classes"])
    cfg = job["federate"]
    if cfg.get("inject_faults") is not None:
        cfg["inject_faults"] = tuple(cfg["inject_faults"])
    return Settings(**settings), FederateConfig(**cfg)


def _report_from(data: dict) -> FederateReport:
    verdict = data.pop("verdict")
    return FederateReport(**data, verdict=Verdict(**verdict) if verdict else None)


# ---------------------------------------------------------------- the ServerApp


server_app = ServerApp()


@server_app.main()
def _serve_rounds(grid: Grid, context: Context) -> None:
    """Run on the SuperLink's side: the job's `federate` over the devices; its report (or its error)
    in the job's folder, since SuperExec keeps no output of this process."""
    from app.fl import federate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = str(context.run_config["job"])
    folder = Store.at(job.rpartition("/")[0])
    try:
        settings, cfg = read_job(job)
        report = federate(settings, cfg, grid=DeviceGrid(grid))
        result = {"report": dataclasses.asdict(report)}
    except Exception as exc:
        log.exception("the federated run failed")
        result = {"error": f"{type(exc).__name__}: {exc}"}
    folder.write(RESULT_FILE, json.dumps(result, default=float).encode())


# ---------------------------------------------------------------- the `federate` command's side


def federate_on_devices(settings: Settings, cfg: FederateConfig) -> FederateReport:
    """`federate --engine deployment`: submit the run to the SuperLink (started here for the run
    when `cfg` names its certificate) and wait for the ServerApp's report."""
    cfg = dataclasses.replace(cfg, run_name=cfg.run_name or time.strftime("federate-%Y%m%d-%H%M%S"))
    job = write_job(settings, cfg)
    home = Path(tempfile.mkdtemp(prefix="argus-flwr-"))
    superlink = None
    try:
        if cfg.superlink_certfile:
            superlink = SuperLink(
                cfg.superlink,
                cfg.superlink_certfile,
                cfg.superlink_keyfile,
                cfg.root_certificates,
                home / "link",
            ).start()
        control = FlowerControl(cfg.superlink, cfg.root_certificates, home / "cli")
        if cfg.device_keys:
            keys = sorted(Path(cfg.device_keys).glob("*.pub"))
            for key in keys:
                control.register(key)
            log.info("registered %d device key(s) from %s", len(keys), cfg.device_keys)
        log.info(
            "run %s submitted to the SuperLink at %s; waiting for %d devices",
            cfg.run_name,
            cfg.superlink,
            cfg.clients_per_round,
        )
        control.run(FAB_DIR, {"job": job}, timeout_s=cfg.rounds * 2 * cfg.round_timeout_s + RUN_MARGIN_S)
    except BaseException:
        if superlink is not None:
            log.error("the SuperLink's log: %s", superlink.log_path)
            superlink.stop()
            superlink = None
        raise
    finally:
        if superlink is not None:
            superlink.stop()
    shutil.rmtree(home, ignore_errors=True)
    folder = Store.at(job_folder(settings, cfg.run_name))
    if not folder.exists(RESULT_FILE):
        raise RuntimeError(f"the ServerApp of run {cfg.run_name} ended without a report in {folder.uri()}")
    result = json.loads(folder.read(RESULT_FILE))
    if "error" in result:
        raise RuntimeError(f"the ServerApp of run {cfg.run_name} failed: {result['error']}")
    return _report_from(result["report"])
