"""`RayGrid`: Flower's `Grid` over a bounded pool of our own Ray actors (why not Flower's Ray
backend: docs/federated.md). The one module that reaches into Flower's internals; the names it
relies on are pinned by tests/unit/test_fl_grid_internals.py, so a Flower upgrade fails there."""

from __future__ import annotations

import collections
import importlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import ray
import torch
from flwr.app import Context, Error, Message, RecordDict, UserConfig
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from app.fl.client_app import CLIENT_APP
from app.fl.config import FederateConfig

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0
"""How long a round's start waits for idle actors to prove they are alive (an idle one answers in ms)."""


# ---------------------------------------------------------------- Flower internals, in one place


def stamp_task_identity(run_id: int = 1, node_id: int = 0, task_id: int = 1) -> None:
    """Give this process the identity of a running ServerApp task: Flower stamps every instruction
    `Message` it creates with it (a SuperLink's runtime would set it; we have none)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id


def assign_message_id(message: Message, message_id: str) -> None:
    """Set a message's id, as a SuperLink does on delivery (Flower's Metadata has no setter for it)."""
    message.metadata.__dict__["_message_id"] = message_id


# ---------------------------------------------------------------- the actors


class _ClientActor:
    """One Ray actor: loads the ClientApp as a SuperNode would and runs the messages it is given."""

    def __init__(self, app_ref: str | ClientApp, threads: int):
        torch.set_num_threads(threads)
        if isinstance(app_ref, str):
            module, _, attribute = app_ref.partition(":")
            app_ref = getattr(importlib.import_module(module), attribute)
        self.app = app_ref

    def handle(self, metadata, content: RecordDict, context: Context) -> bytes:
        """The reply in Flower's wire format (protobuf), as a SuperNode sends it to a SuperLink."""
        reply = self.app(Message(content=content, metadata=metadata), context)
        return message_to_proto(reply).SerializeToString()

    def ping(self) -> bool:
        return True


ClientActor = ray.remote(max_restarts=0)(_ClientActor)


def _error_reply(message: Message, code: int, reason: str) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=message)


def _parse_reply(data: bytes, message: Message) -> Message:
    """A client's reply as the server may see it: records parsed from protobuf (never Python
    objects), and the routing metadata of the instruction it answers, as a SuperLink sets it, so a
    client cannot answer in another's name."""
    try:
        parsed = message_from_proto(ProtoMessage.FromString(data))
    except Exception as exc:  # protobuf's DecodeError, or records Flower cannot rebuild
        return _error_reply(message, ErrorCode.CLIENT_APP_CRASHED, f"unreadable reply: {type(exc).__name__}")
    return Message(parsed.error if parsed.has_error() else parsed.content, reply_to=message)


def reply_schema(message: Message) -> str:
    """What a reply carried, without values: its type, arrays' keys/dtypes/shapes, records' keys/types."""
    content = message.content

    def kinds(records):
        return {name: {k: type(v).__name__ for k, v in record.items()} for name, record in records.items()}

    return json.dumps(
        {
            "type": message.metadata.message_type,
            "arrays": {
                name: {k: [a.dtype, list(a.shape)] for k, a in record.items()}
                for name, record in content.array_records.items()
            },
            "metrics": kinds(content.metric_records),
            "configs": kinds(content.config_records),
        },
        sort_keys=True,
    )


def array_bytes(content: RecordDict) -> int:
    return sum(record.count_bytes() for record in content.array_records.values())


@dataclass
class RoundTraffic:
    """What one `send_and_receive` moved: messages out, replies and failures back, bytes each way."""

    sent: int = 0
    replied: int = 0
    failed: int = 0
    timed_out: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0


class RayGrid(Grid):
    """Flower's `Grid` over a bounded pool of Ray actors that run the ClientApp.

    Messages wait for the next idle actor (the pool never grows with the number of clients). A
    `send_and_receive` deadline drops what has not answered and kills and replaces the actors still
    busy with it; an actor that dies is replaced too, so one bad client never poisons the pool.
    A replacement is made only where the cluster still has room: the actors of a lost node would
    otherwise wait for its CPUs, and every later round for them. Each round first regrows the pool
    to `num_actors` as room allows.
    `last` holds what the latest call moved (`RoundTraffic`); `wire` counts the schema of every reply.
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        num_actors: int,
        num_cpus: float,
        num_gpus: float = 0.0,
        app_ref: str | ClientApp = CLIENT_APP,
        run_id: int = 0,
    ):
        self._partition = {node_id: node_id - 1 for node_id in range(1, num_nodes + 1)}
        # SPREAD: clients are many devices; a node's loss then takes only its share of the pool.
        self._options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "scheduling_strategy": "SPREAD"}
        self._app_ref, self._threads = app_ref, max(1, int(num_cpus))
        self.num_actors = num_actors
        self._idle = [self._spawn() for _ in range(num_actors)]
        self._queue: collections.deque = collections.deque()
        self._running: dict = {}  # ObjectRef → (actor, message)
        self._done: dict[str, Message] = {}
        self._run = Run.create_empty(run_id)
        self.wire: collections.Counter[str] = collections.Counter()
        self.last = RoundTraffic()

    def _spawn(self):
        return ClientActor.options(**self._options).remote(self._app_ref, self._threads)

    def _room(self) -> int:
        """How many more actors the cluster's free resources fit now."""
        free = ray.available_resources()
        need = {"CPU": self._options["num_cpus"], "GPU": self._options["num_gpus"]}
        return min(int(free.get(r, 0.0) / amount + 1e-9) for r, amount in need.items() if amount)

    def _size(self) -> int:
        return len(self._idle) + len(self._running)

    def _replace(self) -> None:
        """An actor in place of one that is gone, if there is room for it now; else the pool shrinks
        (never below one actor) until a later round regrows it."""
        if self._size() == 0 or self._room() > 0:
            self._idle.append(self._spawn())
            log.info("client actor replaced")
        else:
            log.warning("no room for a replacement client actor: the pool shrinks to %d", self._size())

    def _prune_dead(self) -> None:
        """Drop idle actors that died while they waited (their node lost after their last message):
        a message sent to one would fail a client that a live actor could have run. A ping not yet
        answered proves nothing, so such an actor stays."""
        if not self._idle:
            return
        pings = {actor.ping.remote(): actor for actor in self._idle}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_TIMEOUT_S)
        dead = []
        for ref in answered:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(pings[ref])
        if dead:
            self._idle = [actor for actor in self._idle if all(actor is not d for d in dead)]
            log.warning("%d idle client actor(s) found dead: dropped", len(dead))

    def _regrow(self) -> None:
        missing = min(self.num_actors - self._size(), self._room())
        for _ in range(max(0, missing)):
            self._idle.append(self._spawn())
        if missing > 0:
            log.info("client actor pool regrown to %d", self._size())

    # Grid API
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._partition)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, refs = [], {}
        for message in messages:
            assign_message_id(message, uuid.uuid4().hex)
            if message.metadata.dst_node_id not in self._partition:
                raise ValueError(f"unknown node {message.metadata.dst_node_id}")
            # Messages of one round share their content: put it in the object store once.
            if id(message.content) not in refs:
                refs[id(message.content)] = ray.put(message.content)
            self._queue.append((message, refs[id(message.content)]))
            self.last.bytes_down += array_bytes(message.content)
            ids.append(message.metadata.message_id)
        self._pump(0)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._pump(0)
        return [self._done.pop(i) for i in list(message_ids) if i in self._done]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        started = time.monotonic()
        self.last = RoundTraffic()
        self._prune_dead()
        self._regrow()
        ids = list(self.push_messages(messages))
        self.last.sent = len(ids)
        waiting = set(ids)
        while waiting:
            remaining = None if timeout is None else started + timeout - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self._pump(remaining)
            waiting -= self._done.keys()
        if waiting:
            self._expire(waiting)
        replies = [self._done.pop(i) for i in ids if i in self._done]
        self.last.seconds = time.monotonic() - started
        return replies

    # the pool
    def _context(self, node_id: int) -> Context:
        node_config = UserConfig(
            {PARTITION_ID_KEY: self._partition[node_id], NUM_PARTITIONS_KEY: len(self._partition)}
        )
        return Context(
            run_id=self._run.run_id,
            node_id=node_id,
            node_config=node_config,
            state=RecordDict(),
            run_config=UserConfig(),
        )

    def _pump(self, wait: float | None) -> None:
        while self._queue and self._idle:
            (message, content), actor = self._queue.popleft(), self._idle.pop()
            ref = actor.handle.remote(message.metadata, content, self._context(message.metadata.dst_node_id))
            self._running[ref] = (actor, message)
        if not self._running:
            return
        ready, _ = ray.wait(list(self._running), num_returns=1, timeout=wait)
        if ready:  # take everything else that is ready too
            ready, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
        for ref in ready:
            actor, message = self._running.pop(ref)
            client = self._partition[message.metadata.dst_node_id]
            try:
                reply = _parse_reply(ray.get(ref), message)
                self._idle.append(actor)
            except ray.exceptions.RayActorError as exc:
                log.warning("client %d: its actor died mid-round (%s); dropped", client, type(exc).__name__)
                reply = _error_reply(
                    message, ErrorCode.CLIENT_APP_CRASHED, f"client actor died: {type(exc).__name__}"
                )
                ray.kill(actor, no_restart=True)  # an unreachable one may yet come back: it is gone
                self._replace()
            except ray.exceptions.RayTaskError as exc:
                log.warning("client %d raised: %s", client, exc.cause)
                reply = _error_reply(message, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(exc.cause))
                self._idle.append(actor)
            if reply.has_error():
                self.last.failed += 1
            else:
                self.last.replied += 1
                self.last.bytes_up += array_bytes(reply.content)
                self.wire[reply_schema(reply)] += 1
            assign_message_id(reply, uuid.uuid4().hex)
            self._done[message.metadata.message_id] = reply

    def _expire(self, message_ids: set[str]) -> None:
        """Drop messages past their deadline: unstarted ones leave the queue, running ones lose
        their actor."""
        self._queue = collections.deque(
            item for item in self._queue if item[0].metadata.message_id not in message_ids
        )
        for ref, (actor, message) in list(self._running.items()):
            if message.metadata.message_id in message_ids:
                del self._running[ref]
                ray.kill(actor, no_restart=True)
                self._replace()
        for message_id in message_ids:
            self._done.pop(message_id, None)
        self.last.timed_out += len(message_ids)
        log.warning("%d client(s) missed the round deadline: dropped", len(message_ids))

    def close(self) -> None:
        for actor in self._idle + [actor for actor, _ in self._running.values()]:
            ray.kill(actor, no_restart=True)
        self._idle, self._running, self._queue = [], {}, collections.deque()


def pool_size(cfg: FederateConfig) -> int:
    """Client actors that fit in the cluster's *free* CPUs (and GPUs) now, at most one per sampled client."""
    free = ray.available_resources()
    fit = int(free.get("CPU", 0.0) / cfg.num_cpus_per_client + 1e-9)
    if cfg.num_gpus_per_client > 0:
        fit = min(fit, int(free.get("GPU", 0.0) / cfg.num_gpus_per_client + 1e-9))
    return max(1, min(cfg.clients_per_round, cfg.max_actors or cfg.clients_per_round, fit))
