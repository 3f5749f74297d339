"""Federated learning: users' devices train locally and only model updates travel (issue #5).

    python -m app federate --model cnn --image-size 64 --rounds 5 --clients 10 --clients-per-round 5

**Clients are users.** The users in the snapshots (the Kafka key) are shuffled with `--seed` and
dealt into `--clients` groups; client *i* reads only its own users' rows from the snapshot files,
inside its actor, and holds out its newest `--val-fraction` by event time. A group's class mix is
whatever its users produce, so the federation is non-IID by construction. A train reply carries
one ArrayRecord (the update: local minus global weights, fp16 by default) and one MetricRecord;
an evaluate reply a MetricRecord only. `FederateReport.wire` counts the schema of every reply that
crossed back, so a test can check that no pixels did.

**Flower on our own Ray actors.** The client is a Flower `ClientApp` (`@client_app.train()`,
`@client_app.evaluate()`) keyed by Flower's simulation node config (`partition-id`,
`num-partitions`); the server a `ServerApp` driving `flwr.serverapp.strategy` strategies (FedAvg
weighted by examples, FedProx, FedMedian, FedTrimmedAvg, Krum; `DifferentialPrivacyServerSide-
FixedClipping` around them). Between the two runs `RayGrid`, our implementation of Flower's `Grid`
over a bounded pool of Ray actors, instead of `flwr.simulation.run_simulation`, because flwr
1.42's Ray backend (`flwr/server/superlink/fleet/vce/backend/raybackend.py`, `ray_actor.py`):
  - calls `ray.shutdown()` unconditionally when a simulation ends, which disconnects a caller that
    already had Ray up (the test session, `demo`, a notebook) and whatever it still runs on it;
  - sizes its pool from the cluster's *total* CPUs (`ray.nodes()`), not the free ones, so on a
    shared job cluster it queues behind Serve replicas and training workers;
  - puts an actor that died back into its pool, so one killed client fails later messages too;
  - waits with `ray.get` and no timeout, so a slow client holds its worker past the round deadline;
  - and `run_simulation` itself is deprecated in favour of `flwr run`.
Under `run_simulation` the same ClientApp and strategy give the same first round to the last digit
(checked by hand); the choice is only about who owns Ray and the actors. `federate` joins Ray
through `app.cluster.ray_session`: the job's cluster under `ray job submit`, the caller's when Ray
is already up, else a local one; it never shuts down a Ray it did not start.

**Before any Flower strategy sees an update** (`GuardedStrategy`): fp16 deltas become fp32 weights
(aggregation is fp32); an update with NaN/Inf, the wrong arrays, or a norm above
`--outlier-factor` × the round's median is rejected, counted and logged; a round left with fewer
than `--min-clients` updates is abandoned (the global model stays). Clients that die or miss
`--round-timeout-s` are dropped by `RayGrid`, which replaces their actors.

**Privacy.** `--dp-clip C` clips every update to norm C and `--dp-noise z` adds N(0, (zC/n)²) to
the mean (Flower's server-side fixed clipping; the server is trusted, as with Flower's client-side
variant). Weights are uniform under DP so one client moves the mean by at most C/n, and the
norm-outlier rule is off (the clip already bounds every update, and a median-relative rule would
let one client's update decide another's fate, which no accountant covers). Epsilon at
`--dp-delta` is composed per round by `GaussianAccountant` (RDP, no sampling amplification; Flower's
accounted mode needs the optional dp-accounting package and refuses any round that lost a client),
with the noise multiplier each round really had (z·m/n when m of n updates were aggregated). It is
reported for fedavg/fedprox only: medians and Krum do not have a mean's sensitivity.

**Resume.** The global model and history are checkpointed every round under
`<storage>/checkpoints/federated/<run-name>/round-NNNNN/` (state.json written last marks a round
complete); rerunning with the same `--run-name` continues after the last complete round. Client
sampling and DP noise are seeded per round, so a resumed run samples what an unbroken run would.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import random
import re
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator

import numpy as np
import ray
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, ErrorCode
from flwr.serverapp import GaussianPrivacyEvent, Grid, PrivacySpent, ServerApp
from flwr.serverapp import strategy as flwr_strategy
from torch import nn

from app import model as core
from app.config import ConfigError, Settings

log = logging.getLogger(__name__)

STRATEGIES = ("fedavg", "fedprox", "fedmedian", "fedtrimmedavg", "krum")
MEAN_STRATEGIES = ("fedavg", "fedprox")
UPDATE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
FAULTS = ("nan", "scale", "crash", "slow")
CLIENT_APP = "app.fl:client_app"


# ---------------------------------------------------------------- configuration


@dataclass(kw_only=True)
class FederateConfig:
    rounds: int = 5
    """Federated rounds in total; a resumed run continues up to this many."""
    clients: int = 10
    """Simulated clients; the snapshots' users are dealt into this many groups."""
    clients_per_round: int = 5
    """Clients sampled for training each round."""
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    """Client SGD learning rate (momentum 0.9, fresh optimiser every round)."""
    strategy: str = "fedavg"
    """fedavg (example-weighted), fedprox, fedmedian, fedtrimmedavg or krum."""
    mu: float = 0.01
    """FedProx proximal weight: the client adds mu/2·||w − w_global||² to its loss."""
    trimmed_beta: float = 0.2
    """FedTrimmedAvg: share cut from each tail."""
    krum_malicious: int = 0
    """Krum: number of malicious clients assumed."""
    dp_noise: float = 0.0
    """Gaussian noise multiplier z on the aggregate (needs --dp-clip); 0 clips without noise."""
    dp_clip: float | None = None
    """Clip each client's update to this L2 norm; None turns differential privacy off."""
    dp_delta: float = 1e-5
    """Delta at which epsilon is reported."""
    update_dtype: str = "fp16"
    """Precision of the updates clients send (fp16 or fp32); aggregation is always fp32."""
    min_clients: int | None = None
    """Fewest valid updates that make a round; None means half the clients per round (at least 1)."""
    round_timeout_s: float = 600.0
    """A client that has not answered this long after a round's start is dropped."""
    outlier_factor: float = 10.0
    """Reject updates whose norm exceeds this multiple of the round's median norm."""
    init_from: str | None = None
    """Registry alias (e.g. `champion`) whose model the run starts from; None starts fresh."""
    seed: int = 0
    snapshots: tuple[str, ...] | None = None
    """Snapshot ids; None means all of the topic's."""
    val_fraction: float = 0.2
    """Each client's newest share of records by event time, held out for evaluation."""
    evaluate_clients: int | None = None
    """Clients sampled for evaluation each round; None means all of them."""
    augment: bool = True
    num_cpus_per_client: float = 0.5
    """Logical CPUs per client actor (fractions pack several on a core)."""
    num_gpus_per_client: float = 0.0
    max_actors: int | None = None
    """Cap on the client actor pool; None means as many as free resources fit (≤ clients per round)."""
    run_name: str | None = None
    """Rerunning with the same name resumes from its last complete round."""
    inject_faults: tuple[str, ...] = ()
    """Fault injection for tests, `CLIENT:KIND` with KIND in nan, scale, crash, slow."""

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        require(self.rounds >= 1, f"--rounds must be >= 1, got {self.rounds}")
        require(self.clients >= 1, f"--clients must be >= 1, got {self.clients}")
        require(1 <= self.clients_per_round <= self.clients,
                f"--clients-per-round must be in 1..{self.clients}, got {self.clients_per_round}")
        if self.min_clients is None:
            self.min_clients = max(1, math.ceil(self.clients_per_round / 2))
        require(1 <= self.min_clients <= self.clients_per_round,
                f"--min-clients must be in 1..{self.clients_per_round}, got {self.min_clients}")
        require(self.local_epochs >= 1, f"--local-epochs must be >= 1, got {self.local_epochs}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.lr > 0, "--lr must be > 0")
        require(self.strategy in STRATEGIES, f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        require(self.mu >= 0, "--mu must be >= 0")
        require(self.strategy != "fedprox" or self.mu > 0, "--strategy fedprox needs --mu > 0")
        require(0 <= self.trimmed_beta < 0.5, "--trimmed-beta must be in [0, 0.5)")
        require(self.krum_malicious >= 0, "--krum-malicious must be >= 0")
        require(self.dp_noise >= 0, "--dp-noise must be >= 0")
        require(self.dp_clip is None or self.dp_clip > 0, "--dp-clip must be > 0")
        require(self.dp_noise == 0 or self.dp_clip is not None, "--dp-noise needs --dp-clip (the sensitivity)")
        require(0 < self.dp_delta < 1, "--dp-delta must be in (0, 1)")
        require(self.update_dtype in UPDATE_DTYPES, f"--update-dtype must be fp16 or fp32, got {self.update_dtype!r}")
        require(self.round_timeout_s > 0, "--round-timeout-s must be > 0")
        require(self.outlier_factor > 1, "--outlier-factor must be > 1")
        require(self.init_from is None or bool(self.init_from.strip()), "--init-from needs an alias, e.g. champion")
        require(0 < self.val_fraction < 1, "--val-fraction must be in (0, 1)")
        require(self.evaluate_clients is None or 1 <= self.evaluate_clients <= self.clients,
                f"--evaluate-clients must be in 1..{self.clients}")
        require(self.num_cpus_per_client > 0, "--num-cpus-per-client must be > 0")
        require(self.num_gpus_per_client >= 0, "--num-gpus-per-client must be >= 0")
        require(self.max_actors is None or self.max_actors >= 1, "--max-actors must be >= 1")
        require(self.run_name is None or bool(re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name)),
                "--run-name may hold only letters, digits, '.', '_' and '-'")
        for spec in self.inject_faults:
            client, _, kind = spec.partition(":")
            require(client.isdigit() and int(client) < self.clients and kind in FAULTS,
                    f"fault {spec!r}: expected CLIENT:KIND with CLIENT < {self.clients} and KIND in {', '.join(FAULTS)}")

    @property
    def dp(self) -> bool:
        return self.dp_clip is not None


@dataclass
class FederateReport:
    version: str
    run_id: str
    run_name: str
    metrics: dict
    """The final round's federated evaluation and totals."""
    history: list[dict]
    """One row per round: losses, accuracies, clients ok/failed/timed out/rejected, bytes, epsilon."""
    rounds_run: int
    """Rounds this call ran (fewer than `rounds` when it resumed)."""
    resumed_from: int
    classes: list[str]
    epsilon: float | None
    wire: dict[str, int]
    """Reply schemas (JSON: message type, array keys → dtype and shape, metric keys) → count."""
    checkpoint_dir: str
    init_version: str | None
    num_actors: int

    def __str__(self) -> str:
        last = self.history[-1]
        privacy = f", epsilon {self.epsilon:.2f}" if self.epsilon is not None else ""
        resumed = f" (resumed after round {self.resumed_from})" if self.resumed_from else ""
        return (f"registered v{self.version} (run {self.run_id}, federated {self.run_name}): "
                f"val_accuracy {self.metrics.get('val_accuracy', float('nan')):.3f} after {len(self.history)} rounds"
                f"{resumed}; {last['bytes_up'] / 1e6:.2f} MB up in the last round{privacy}")


# ---------------------------------------------------------------- the client's data and training


def read_snapshot_rows(snapshot_uris: Iterable[str], columns: list[str], row_filter=None):
    """Selected columns of the snapshots' Parquet files (those their manifests list), filtered."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs
    import ray.data  # noqa: F401  (registers Ray's tensor extension type for the image column)

    from app.data import MANIFEST

    tables = []
    for uri in snapshot_uris:
        fs, root = pafs.FileSystem.from_uri(uri)
        with fs.open_input_stream(f"{root}/{MANIFEST}") as stream:
            files = [f"{root}/{name}" for name in json.loads(stream.read())["files"]]
        tables.append(ds.dataset(files, format="parquet", filesystem=fs).to_table(columns=columns, filter=row_filter))
    return pa.concat_tables(tables)


def partition_users(users: Iterable[str], num_partitions: int, seed: int) -> list[list[str]]:
    """Distinct users shuffled by `seed` and dealt round-robin: each client holds whole users."""
    ordered = sorted(set(users))
    random.Random(seed).shuffle(ordered)
    return [ordered[i::num_partitions] for i in range(num_partitions)]


@lru_cache(maxsize=4)
def _user_partitions(snapshot_uris: tuple[str, ...], num_partitions: int, seed: int) -> list[list[str]]:
    keys = read_snapshot_rows(snapshot_uris, ["key"]).column("key").to_pylist()
    return partition_users((k for k in keys if k is not None), num_partitions, seed)


@dataclass
class ClientData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def load_client_data(snapshot_uris: tuple[str, ...], partition_id: int, num_partitions: int, seed: int,
                     classes: tuple[str, ...], val_fraction: float) -> ClientData:
    """This client's users' labelled rows; the newest `val_fraction` by event time validates."""
    import pyarrow.compute as pc

    from app.data import encode_labels

    users = _user_partitions(snapshot_uris, num_partitions, seed)[partition_id]
    table = read_snapshot_rows(snapshot_uris, ["image", "label", "event_time", "partition", "offset"],
                               pc.field("key").isin(users) & pc.field("label").isin(list(classes)))
    if table.num_rows == 0:
        raise ValueError(f"client {partition_id} ({len(users)} users) has no labelled records")
    table = table.sort_by([("event_time", "ascending"), ("partition", "ascending"), ("offset", "ascending")])
    images = torch.from_numpy(table.column("image").combine_chunks().to_numpy_ndarray().astype(np.float32, copy=False))
    labels = torch.from_numpy(encode_labels(table.column("label").to_pylist(), classes))
    cut = table.num_rows - int(table.num_rows * val_fraction)
    return ClientData(images[:cut], labels[:cut], images[cut:], labels[cut:])


class ProximalLoss(nn.Module):
    """FedProx's client objective: the task loss plus mu/2·||w − w_global||² over trainable weights."""

    def __init__(self, base: nn.Module, model: nn.Module, mu: float):
        super().__init__()
        self.base, self.mu = base, mu
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._anchor = [p.detach().clone() for p in self._params]

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        proximal = sum((p - a).pow(2).sum() for p, a in zip(self._params, self._anchor))
        return self.base(logits, targets) + 0.5 * self.mu * proximal


def _batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None,
             augment: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(y), generator=generator) if generator is not None else torch.arange(len(y))
    for start in range(0, len(y), batch_size):
        index = order[start:start + batch_size]
        inputs = x[index]
        if augment:
            from app.train import augment as augment_images

            inputs = augment_images(inputs, generator)
        yield inputs, y[index]


def local_train(model: nn.Module, data: ClientData, *, epochs: int, batch_size: int, lr: float, mu: float,
                seed: int, augment: bool, batches_hook=None, device: torch.device = torch.device("cpu")) -> dict:
    """`epochs` passes of SGD over the client's training rows, through the shared `train_epoch`."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    if mu > 0:
        loss_fn = ProximalLoss(loss_fn, model, mu)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    stats = {}
    for _ in range(epochs):
        batches = _batches(data.train_x, data.train_y, batch_size, generator, augment)
        stats = core.train_epoch(model, batches_hook(batches) if batches_hook else batches, optimizer, loss_fn,
                                 device=device)
    return stats


def local_evaluate(model: nn.Module, data: ClientData, num_classes: int, batch_size: int = 256,
                   device: torch.device = torch.device("cpu")) -> dict:
    return core.evaluate(model, _batches(data.val_x, data.val_y, batch_size, None, False), num_classes, device=device)


def exchanged_keys(model: nn.Module) -> list[str]:
    """The state entries that travel: parameters and BatchNorm statistics (not step counters)."""
    return [k for k, v in model.state_dict().items() if v.is_floating_point()]


def model_arrays(model: nn.Module) -> ArrayRecord:
    state = model.state_dict()
    return ArrayRecord({k: state[k].detach().float() for k in exchanged_keys(model)})


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """Load the global arrays into `model`; returns them as fp32 tensors (the update's origin)."""
    state = {k: torch.from_numpy(np.array(a.numpy(), dtype=np.float32)) for k, a in arrays.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ValueError(f"global arrays do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return state


def encode_update(model: nn.Module, origin: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (state[k].detach().float().cpu() - g).to(UPDATE_DTYPES[dtype]) for k, g in origin.items()}


# ---------------------------------------------------------------- the Flower ClientApp


client_app = ClientApp()

_MODELS: dict[tuple, nn.Module] = {}
_DATA: collections.OrderedDict[tuple, ClientData] = collections.OrderedDict()
_DATA_CACHE_SIZE = 8
"""Client datasets an actor keeps: memory stays bounded however many clients it serves."""


def _client_state(message: Message, context: Context) -> tuple[int, ConfigRecord, nn.Module, ClientData]:
    config = message.content["config"]
    partition = int(context.node_config[PARTITION_ID_KEY])
    key = (tuple(config["snapshots"]), partition, int(context.node_config[NUM_PARTITIONS_KEY]),
           int(config["seed"]), tuple(config["classes"]), float(config["val-fraction"]))
    if key in _DATA:
        _DATA.move_to_end(key)
    else:
        _DATA[key] = load_client_data(*key)
        while len(_DATA) > _DATA_CACHE_SIZE:
            _DATA.popitem(last=False)
    model_key = (str(config["arch"]), len(config["classes"]))
    if model_key not in _MODELS:  # on the actor's GPU when Ray gave it one (--num-gpus-per-client)
        _MODELS[model_key] = core.build_model(model_key[0], model_key[1]).to(core.local_device())
    return partition, config, _MODELS[model_key], _DATA[key]


def _fault(config: ConfigRecord, partition: int) -> str | None:
    for spec in config.get("faults", []):
        client, _, kind = str(spec).partition(":")
        if int(client) == partition:
            return kind
    return None


def _crash_after_first(batches):
    for batch in batches:
        yield batch
        log.error("fault injection: client actor exits mid-round")
        os._exit(1)


@client_app.train()
def client_train(message: Message, context: Context) -> Message:
    partition, config, model, data = _client_state(message, context)
    origin = load_arrays(model, message.content["arrays"])
    fault = _fault(config, partition)
    if fault == "slow":
        time.sleep(24 * 3600)
    seed = int(config["seed"]) * 1_000_003 + int(config["server-round"]) * 7919 + partition
    stats = local_train(model, data, epochs=int(config["local-epochs"]), batch_size=int(config["batch-size"]),
                        lr=float(config["lr"]), mu=float(config.get("proximal-mu", 0.0)), seed=seed,
                        augment=bool(config["augment"]), batches_hook=_crash_after_first if fault == "crash" else None,
                        device=core.local_device())
    update = encode_update(model, origin, str(config["update-dtype"]))
    if fault == "nan":
        update = {k: torch.full_like(v, float("nan")) for k, v in update.items()}
    elif fault == "scale":
        update = {k: v * 1000 for k, v in update.items()}
    metrics = MetricRecord({"num-examples": len(data.train_y), "train_loss": float(stats["loss"]),
                            "train_accuracy": float(stats["accuracy"])})
    return Message(RecordDict({"arrays": ArrayRecord(update), "metrics": metrics}), reply_to=message)


@client_app.evaluate()
def client_evaluate(message: Message, context: Context) -> Message:
    _, config, model, data = _client_state(message, context)
    load_arrays(model, message.content["arrays"])
    result = {"loss": 0.0, "accuracy": 0.0}
    if len(data.val_y):
        result = local_evaluate(model, data, len(config["classes"]), device=core.local_device())
    metrics = MetricRecord({"num-examples": len(data.val_y), "val_loss": float(result["loss"]),
                            "val_accuracy": float(result["accuracy"])})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


# ---------------------------------------------------------------- the fleet: Ray actors behind Flower's Grid


class _ClientActor:
    """One Ray actor: loads the ClientApp as a SuperNode would and runs the messages it is given."""

    def __init__(self, app_ref: str | ClientApp, threads: int):
        torch.set_num_threads(threads)
        if isinstance(app_ref, str):
            module, _, attribute = app_ref.partition(":")
            app_ref = getattr(importlib.import_module(module), attribute)
        self.app = app_ref

    def handle(self, metadata, content: RecordDict, context: Context) -> Message:
        return self.app(Message(content=content, metadata=metadata), context)


ClientActor = ray.remote(max_restarts=0)(_ClientActor)


def _error_reply(message: Message, code: int, reason: str) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=message)


def reply_schema(message: Message) -> str:
    """What a reply carried, without values: its type, arrays' keys/dtypes/shapes, records' keys/types."""
    content = message.content

    def kinds(records):
        return {name: {k: type(v).__name__ for k, v in record.items()} for name, record in records.items()}

    return json.dumps({"type": message.metadata.message_type,
                       "arrays": {name: {k: [a.dtype, list(a.shape)] for k, a in record.items()}
                                  for name, record in content.array_records.items()},
                       "metrics": kinds(content.metric_records), "configs": kinds(content.config_records)},
                      sort_keys=True)


def _array_bytes(content: RecordDict) -> int:
    return sum(record.count_bytes() for record in content.array_records.values())


class RayGrid(Grid):
    """Flower's `Grid` over a bounded pool of Ray actors that run the ClientApp.

    Messages wait for the next idle actor (the pool never grows with the number of clients). A
    `send_and_receive` deadline drops what has not answered and kills and replaces the actors still
    busy with it; an actor that dies is replaced too, so one bad client never poisons the pool.
    `last` holds what the latest call moved (bytes each way, failures, time-outs); `wire` counts
    the schema of every reply.
    """

    def __init__(self, num_nodes: int, *, num_actors: int, num_cpus: float, num_gpus: float = 0.0,
                 app_ref: str | ClientApp = CLIENT_APP, run_id: int = 0):
        from flwr.supercore.run import Run

        self._partition = {node_id: node_id - 1 for node_id in range(1, num_nodes + 1)}
        self._options = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self._app_ref, self._threads = app_ref, max(1, int(num_cpus))
        self.num_actors = num_actors
        self._idle = [self._spawn() for _ in range(num_actors)]
        self._queue: collections.deque = collections.deque()
        self._running: dict = {}  # ObjectRef → (actor, message)
        self._done: dict[str, Message] = {}
        self._run = Run.create_empty(run_id)
        self.wire: collections.Counter[str] = collections.Counter()
        self.last: dict = {}

    def _spawn(self):
        return ClientActor.options(**self._options).remote(self._app_ref, self._threads)

    # Grid API
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._partition)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, refs = [], {}
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if message.metadata.dst_node_id not in self._partition:
                raise ValueError(f"unknown node {message.metadata.dst_node_id}")
            # Messages of one round share their content: put it in the object store once.
            if id(message.content) not in refs:
                refs[id(message.content)] = ray.put(message.content)
            self._queue.append((message, refs[id(message.content)]))
            self.last["bytes_down"] = self.last.get("bytes_down", 0) + _array_bytes(message.content)
            ids.append(message.metadata.message_id)
        self._pump(0)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._pump(0)
        return [self._done.pop(i) for i in list(message_ids) if i in self._done]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        started = time.monotonic()
        self.last = {"sent": 0, "replied": 0, "failed": 0, "timed_out": 0, "bytes_up": 0, "bytes_down": 0}
        ids = list(self.push_messages(messages))
        self.last["sent"] = len(ids)
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
        self.last["seconds"] = time.monotonic() - started
        return replies

    # the pool
    def _context(self, node_id: int) -> Context:
        from flwr.app import UserConfig

        node_config = UserConfig({PARTITION_ID_KEY: self._partition[node_id], NUM_PARTITIONS_KEY: len(self._partition)})
        return Context(run_id=self._run.run_id, node_id=node_id, node_config=node_config, state=RecordDict(),
                       run_config=UserConfig())

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
            try:
                reply = ray.get(ref)
                self._idle.append(actor)
            except ray.exceptions.RayActorError as exc:
                log.warning("client %d: its actor died mid-round (%s); dropped, actor replaced",
                            self._partition[message.metadata.dst_node_id], type(exc).__name__)
                reply = _error_reply(message, ErrorCode.CLIENT_APP_CRASHED, f"client actor died: {type(exc).__name__}")
                self._idle.append(self._spawn())
            except ray.exceptions.RayTaskError as exc:
                log.warning("client %d raised: %s", self._partition[message.metadata.dst_node_id], exc.cause)
                reply = _error_reply(message, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(exc.cause))
                self._idle.append(actor)
            if reply.has_error():
                self.last["failed"] = self.last.get("failed", 0) + 1
            else:
                self.last["replied"] = self.last.get("replied", 0) + 1
                self.last["bytes_up"] = self.last.get("bytes_up", 0) + _array_bytes(reply.content)
                self.wire[reply_schema(reply)] += 1
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self._done[message.metadata.message_id] = reply

    def _expire(self, message_ids: set[str]) -> None:
        """Drop messages past their deadline: unstarted ones leave the queue, running ones lose their actor."""
        self._queue = collections.deque(item for item in self._queue if item[0].metadata.message_id not in message_ids)
        for ref, (actor, message) in list(self._running.items()):
            if message.metadata.message_id in message_ids:
                del self._running[ref]
                ray.kill(actor, no_restart=True)
                self._idle.append(self._spawn())
        for message_id in message_ids:
            self._done.pop(message_id, None)
        self.last["timed_out"] = self.last.get("timed_out", 0) + len(message_ids)
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


# ---------------------------------------------------------------- the server: guard, strategies, privacy


class GuardedStrategy(flwr_strategy.Strategy):
    """What the server does with updates before a Flower strategy aggregates them.

    Replies are taken in node order (deterministic sums); each update must hold exactly the global
    model's arrays, all finite; with three or more, a norm above `outlier_factor` × the median is
    rejected. Accepted fp16/fp32 deltas become fp32 weights (global + delta) with an aggregation
    `weight`: the client's example count, or 1 under differential privacy. Fewer than
    `min_clients` accepted updates abandon the round. `last` describes the latest round.
    """

    def __init__(self, inner: flwr_strategy.Strategy, *, min_clients: int, outlier_factor: float | None,
                 uniform_weights: bool):
        self.inner, self.min_clients = inner, min_clients
        self.outlier_factor, self.uniform_weights = outlier_factor, uniform_weights
        self._global: dict[str, np.ndarray] = {}
        self.last: dict = {}

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round, arrays, config, grid):
        self._global = {k: np.asarray(a.numpy(), dtype=np.float32) for k, a in arrays.items()}
        return self.inner.configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def _check(self, reply: Message) -> tuple[str | None, str, dict[str, np.ndarray], float]:
        """(rejection kind or None, why, fp32 delta, L2 norm) of one reply."""
        records = reply.content.array_records
        if list(records) != ["arrays"] or len(reply.content.metric_records) != 1:
            return "malformed", f"records {list(records)}", {}, 0.0
        record = records["arrays"]
        if set(record) != set(self._global):
            return "malformed", "its arrays are not the model's", {}, 0.0
        delta = {}
        for key, array in record.items():
            value = array.numpy()
            if value.dtype not in (np.float16, np.float32) or value.shape != self._global[key].shape:
                return "malformed", f"array {key} is {value.dtype}{list(value.shape)}", {}, 0.0
            delta[key] = value.astype(np.float32)
        if not all(np.isfinite(v).all() for v in delta.values()):
            return "non_finite", "NaN/Inf in the update", {}, 0.0
        return None, "", delta, math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))

    def aggregate_train(self, server_round, replies):
        replies = sorted(replies, key=lambda m: m.metadata.src_node_id)
        self.last = {"received": len(replies), "failed": sum(r.has_error() for r in replies), "rejected": {},
                     "accepted": 0, "abandoned": False}
        checked = []
        for reply in (r for r in replies if not r.has_error()):
            kind, why, delta, norm = self._check(reply)
            if kind:
                self._reject(server_round, reply, kind, why)
            else:
                checked.append((reply, delta, norm))
        if self.outlier_factor and len(checked) >= 3:
            median = float(np.median([norm for *_, norm in checked]))
            keep = []
            for reply, delta, norm in checked:
                if norm > self.outlier_factor * median:
                    self._reject(server_round, reply, "outlier",
                                 f"update norm {norm:.3g} > {self.outlier_factor:g} x the median {median:.3g}")
                else:
                    keep.append((reply, delta, norm))
            checked = keep
        self.last["accepted"] = len(checked)
        if len(checked) < self.min_clients:
            log.warning("round %d abandoned: %d valid update(s), fewer than --min-clients %d; the model stays",
                        server_round, len(checked), self.min_clients)
            self.last["abandoned"] = True
            return None, None
        for reply, delta, _ in checked:
            reply.content["arrays"] = ArrayRecord({k: Array(self._global[k] + delta[k]) for k in self._global})
            metrics = reply.content["metrics"]
            metrics["weight"] = 1.0 if self.uniform_weights else float(metrics["num-examples"])
        return self.inner.aggregate_train(server_round, [reply for reply, *_ in checked])

    def _reject(self, server_round: int, reply: Message, kind: str, why: str) -> None:
        self.last["rejected"][kind] = self.last["rejected"].get(kind, 0) + 1
        log.warning("round %d: update from node %d rejected (%s): %s", server_round, reply.metadata.src_node_id,
                    kind, why)

    def aggregate_evaluate(self, server_round, replies):
        valid = [r for r in replies if not r.has_error() and r.content.metric_records
                 and next(iter(r.content.metric_records.values())).get("num-examples", 0) > 0]
        for reply in valid:
            metrics = next(iter(reply.content.metric_records.values()))
            metrics["weight"] = float(metrics["num-examples"])
        return self.inner.aggregate_evaluate(server_round, valid) if valid else None


def build_strategy(cfg: FederateConfig) -> GuardedStrategy:
    """The Flower strategy for `cfg.strategy`, in Flower's DP wrapper when clipping, behind the guard."""
    evaluate = cfg.evaluate_clients or cfg.clients
    common = {"fraction_train": cfg.clients_per_round / cfg.clients, "min_train_nodes": cfg.clients_per_round,
              "fraction_evaluate": evaluate / cfg.clients, "min_evaluate_nodes": evaluate,
              "min_available_nodes": cfg.clients_per_round, "weighted_by_key": "weight"}
    strategies = {
        "fedavg": lambda: flwr_strategy.FedAvg(**common),
        "fedprox": lambda: flwr_strategy.FedProx(**common, proximal_mu=cfg.mu),
        "fedmedian": lambda: flwr_strategy.FedMedian(**common),
        "fedtrimmedavg": lambda: flwr_strategy.FedTrimmedAvg(**common, beta=cfg.trimmed_beta),
        "krum": lambda: flwr_strategy.Krum(**common, num_malicious_nodes=cfg.krum_malicious),
    }
    inner = strategies[cfg.strategy]()
    if cfg.dp:
        inner = flwr_strategy.DifferentialPrivacyServerSideFixedClipping(inner, cfg.dp_noise, cfg.dp_clip,
                                                                        cfg.clients_per_round)
    return GuardedStrategy(inner, min_clients=cfg.min_clients, outlier_factor=None if cfg.dp else cfg.outlier_factor,
                           uniform_weights=cfg.dp)


class GaussianAccountant:
    """Privacy spent by Gaussian releases, composed in Rényi DP without sampling amplification.

    A release with noise multiplier z costs α/(2z²) at order α (Mironov 2017); releases add up, and
    the best order gives ε = S + 2·sqrt(S·ln(1/δ)) with S = Σ 1/(2z²). It has the shape of Flower's
    `PrivacyAccountant` (`compose`, `get_privacy_spent`), without the optional dp-accounting package.
    """

    def __init__(self, delta: float, noise_multipliers: Iterable[float] = ()):
        self.delta, self.noise_multipliers = delta, list(noise_multipliers)

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        self.noise_multipliers += [event.noise_multiplier] * count

    def get_privacy_spent(self) -> PrivacySpent:
        s = sum(1 / (2 * z * z) for z in self.noise_multipliers)
        epsilon = s + 2 * math.sqrt(s * math.log(1 / self.delta))
        return PrivacySpent(epsilon=epsilon, delta=self.delta, num_releases=len(self.noise_multipliers),
                            accounting_method="rdp-gaussian")


@contextlib.contextmanager
def _seeded(*parts: int):
    """Seed Python's and NumPy's global RNGs (Flower samples and adds DP noise with them), then restore."""
    saved = random.getstate(), np.random.get_state()
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def _postprocess(arrays: ArrayRecord) -> ArrayRecord:
    """fp32 global arrays; BatchNorm variances kept non-negative after DP noise (post-processing)."""
    out = {}
    for key, array in arrays.items():
        value = np.asarray(array.numpy(), dtype=np.float32)
        out[key] = Array(np.maximum(value, 0) if key.endswith("running_var") else value)
    return ArrayRecord(out)


# ---------------------------------------------------------------- checkpoints


def _fs(uri: str):
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(uri)


def save_checkpoint(root_uri: str, server_round: int, model: nn.Module, meta: dict, keep: int = 2) -> None:
    """round-NNNNN/{model.safetensors, state.json}; state.json goes last, so it marks completion."""
    import pyarrow.fs as pafs
    from safetensors.torch import save

    fs, root = _fs(root_uri)
    directory = f"{root}/round-{server_round:05d}"
    fs.create_dir(directory, recursive=True)
    with fs.open_output_stream(f"{directory}/model.safetensors") as stream:
        stream.write(save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}))
    with fs.open_output_stream(f"{directory}/state.json") as stream:
        stream.write(json.dumps(meta, indent=1).encode())
    rounds = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.startswith("round-"))
    for old in rounds[:-keep]:
        fs.delete_dir(f"{root}/{old}")


def load_checkpoint(root_uri: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The latest complete round's weights and state, or None."""
    import pyarrow.fs as pafs
    from safetensors.torch import load

    fs, root = _fs(root_uri)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    for name in sorted((i.base_name for i in infos if i.base_name.startswith("round-")), reverse=True):
        try:
            with fs.open_input_stream(f"{root}/{name}/state.json") as stream:
                meta = json.loads(stream.read())
            with fs.open_input_stream(f"{root}/{name}/model.safetensors") as stream:
                return load(stream.read()), meta
        except FileNotFoundError:
            log.warning("checkpoint %s/%s is incomplete; trying an older one", root_uri, name)
    return None


# ---------------------------------------------------------------- the ServerApp and the driver


@dataclass
class _Federation:
    """What the ServerApp's rounds need and leave behind."""

    cfg: FederateConfig
    model: nn.Module
    arrays: ArrayRecord
    classes: list[str]
    snapshot_uris: list[str]
    checkpoint_uri: str
    fingerprint: dict
    run_name: str = ""
    init_version: str | None = None
    start_round: int = 0
    history: list = dataclasses.field(default_factory=list)
    accountant: GaussianAccountant | None = None

    def client_config(self, server_round: int) -> ConfigRecord:
        cfg = self.cfg
        config = {"arch": self.fingerprint["arch"], "classes": list(self.classes), "snapshots": list(self.snapshot_uris),
                  "seed": cfg.seed, "val-fraction": cfg.val_fraction, "local-epochs": cfg.local_epochs,
                  "batch-size": cfg.batch_size, "lr": cfg.lr, "update-dtype": cfg.update_dtype, "augment": cfg.augment}
        if cfg.inject_faults:
            config["faults"] = list(cfg.inject_faults)
        return ConfigRecord(config)

    def end_round(self, server_round: int, arrays: ArrayRecord, row: dict) -> None:
        from app import metrics

        self.arrays = arrays
        self.history.append(row)
        metrics.set_gauge("argus_fl_round_seconds", row["round_seconds"], run=self.run_name)
        metrics.set_gauge("argus_fl_round_bytes", row["bytes_up"], run=self.run_name)
        load_arrays(self.model, arrays)
        save_checkpoint(self.checkpoint_uri, server_round, self.model, {
            "round": server_round, "history": self.history, "fingerprint": self.fingerprint,
            "init_version": self.init_version,
            "noise_multipliers": self.accountant.noise_multipliers if self.accountant else []})


def build_server_app(fed: _Federation, strategy: GuardedStrategy) -> ServerApp:
    """The rounds, as a Flower ServerApp: sample → train → guard + aggregate → evaluate → checkpoint."""
    from tqdm import tqdm

    server_app = ServerApp()
    cfg = fed.cfg

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = fed.arrays
        progress = tqdm(range(fed.start_round + 1, cfg.rounds + 1), desc="federated rounds", unit="round",
                        initial=fed.start_round, total=cfg.rounds)
        for server_round in progress:
            started = time.perf_counter()
            with _seeded(cfg.seed, server_round):  # the same clients and noise as an unbroken run
                messages = strategy.configure_train(server_round, arrays, fed.client_config(server_round), grid)
                replies = grid.send_and_receive(messages, timeout=cfg.round_timeout_s)
                train_wire = dict(grid.last)
                aggregated, train_metrics = strategy.aggregate_train(server_round, replies)
                guard = dict(strategy.last)
                if aggregated is not None:
                    arrays = _postprocess(aggregated)
                messages = strategy.configure_evaluate(server_round, arrays, fed.client_config(server_round), grid)
                evaluation = strategy.aggregate_evaluate(server_round, grid.send_and_receive(messages,
                                                                                            timeout=cfg.round_timeout_s))
            row = {"round": server_round, **{k: float(v) for k, v in (train_metrics or {}).items()
                                             if k in ("train_loss", "train_accuracy")},
                   **{k: float(v) for k, v in (evaluation or {}).items() if k in ("val_loss", "val_accuracy")},
                   "clients_sampled": train_wire["sent"], "clients_failed": train_wire["failed"],
                   "clients_timed_out": train_wire["timed_out"],
                   "updates_rejected": sum(guard["rejected"].values()), "updates_accepted": guard["accepted"],
                   "abandoned": int(guard["abandoned"]), "bytes_up": train_wire["bytes_up"],
                   "bytes_down": train_wire["bytes_down"], "round_seconds": time.perf_counter() - started}
            if fed.accountant is not None and not guard["abandoned"]:
                # the noise was calibrated for the sampled count; m accepted updates make it z·m/n
                z = cfg.dp_noise * guard["accepted"] / train_wire["sent"]
                fed.accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=guard["accepted"],
                                                            population_size=cfg.clients))
            if fed.accountant is not None:
                row["epsilon"] = fed.accountant.get_privacy_spent().epsilon
            fed.end_round(server_round, arrays, row)
            progress.set_postfix(val_acc=f"{row.get('val_accuracy', float('nan')):.3f}",
                                 ok=guard["accepted"], rejected=row["updates_rejected"],
                                 dropped=row["clients_failed"] + row["clients_timed_out"])
        progress.close()

    return server_app


def _initial_model(settings: Settings, cfg: FederateConfig, classes: list[str]) -> tuple[nn.Module, str | None]:
    from app import registry

    torch.manual_seed(cfg.seed)
    if cfg.init_from is None:
        return core.build_model(settings.model, len(classes)), None
    version = registry.resolve(settings.tracking_uri, settings.model_name, cfg.init_from)
    if version is None:
        raise ConfigError(f"--init-from {cfg.init_from}: {settings.model_name}@{cfg.init_from} points at no version")
    loaded = registry.load(settings.tracking_uri, settings.model_name, version)
    card = loaded.card
    wanted = {"arch": settings.model, "classes": classes, "image_size": settings.image_size, "features": False}
    have = {"arch": card.arch, "classes": card.classes, "image_size": card.image_size, "features": card.features}
    differ = [f"{k} {have[k]!r} (this run: {wanted[k]!r})" for k in wanted if have[k] != wanted[k]]
    if differ:
        raise ConfigError(f"--init-from {cfg.init_from}: {settings.model_name} v{version} does not fit this run: "
                          + "; ".join(differ))
    return loaded.model.train(), version


def federate(settings: Settings, cfg: FederateConfig) -> FederateReport:
    """`python -m app federate`: rounds of Flower FL on Ray actors → checkpoints → a registered version."""
    from app.cluster import ray_session
    from app.data import snapshot_uri
    from app.train import select_snapshots

    try:
        manifests = select_snapshots(settings, cfg.snapshots)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    classes = list(settings.classes) if settings.classes else sorted({c for m in manifests for c in m["label_counts"]})
    if len(classes) < 2:
        raise ConfigError(f"federated training needs at least two classes; the snapshots have {classes}")
    snapshot_ids = [m["snapshot_id"] for m in manifests]
    uris = [snapshot_uri(settings, s) for s in snapshot_ids]
    users = len(set(read_snapshot_rows(uris, ["key"]).column("key").drop_null().to_pylist()))
    if cfg.clients > users:
        raise ConfigError(f"--clients {cfg.clients} but the snapshots hold {users} users; a client is at least one user")

    run_name = cfg.run_name or time.strftime("federate-%Y%m%d-%H%M%S")
    checkpoint_uri = settings.uri("checkpoints", "federated", run_name)
    fingerprint = {"arch": settings.model, "classes": classes, "image_size": settings.image_size,
                   "clients": cfg.clients, "snapshots": snapshot_ids, "seed": cfg.seed, "strategy": cfg.strategy,
                   "dp_noise": cfg.dp_noise, "dp_clip": cfg.dp_clip}
    checkpoint = load_checkpoint(checkpoint_uri)
    if checkpoint is None:
        model, init_version = _initial_model(settings, cfg, classes)
        start_round, history, noise_multipliers = 0, [], []
    else:
        state, meta = checkpoint
        if meta["fingerprint"] != fingerprint:
            changed = sorted(k for k in fingerprint if meta["fingerprint"].get(k) != fingerprint[k])
            raise ConfigError(f"run {run_name!r} was started with different {', '.join(changed)}; "
                              "pass a new --run-name to start over")
        model = core.build_model(settings.model, len(classes))
        model.load_state_dict(state)
        start_round, history, noise_multipliers = meta["round"], meta["history"], meta["noise_multipliers"]
        init_version = meta.get("init_version")
        log.info("resuming federated run %s after round %d", run_name, start_round)
    accounted = cfg.dp and cfg.dp_noise > 0 and cfg.strategy in MEAN_STRATEGIES
    if cfg.dp and cfg.dp_noise > 0 and not accounted:
        log.warning("--strategy %s with DP noise: epsilon is not reported (no mean, no accountant)", cfg.strategy)
    fed = _Federation(cfg=cfg, model=model, arrays=model_arrays(model), classes=classes, snapshot_uris=uris,
                      checkpoint_uri=checkpoint_uri, fingerprint=fingerprint, run_name=run_name,
                      init_version=init_version, start_round=start_round, history=history,
                      accountant=GaussianAccountant(cfg.dp_delta, noise_multipliers) if accounted else None)

    if fed.start_round < cfg.rounds:
        with ray_session(settings), _quiet_flower():
            from flwr.supercore.task_identity import TaskIdentity

            # Flower stamps instruction messages with the running task's identity.
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
            grid = RayGrid(cfg.clients, num_actors=pool_size(cfg), num_cpus=cfg.num_cpus_per_client,
                           num_gpus=cfg.num_gpus_per_client)
            try:
                build_server_app(fed, build_strategy(cfg))(grid=grid, context=Context(
                    run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
            finally:
                grid.close()
        wire, num_actors = dict(grid.wire), grid.num_actors
    else:
        log.info("run %s already finished %d rounds; registering its model", run_name, fed.start_round)
        wire, num_actors = {}, 0
    return _finish(settings, cfg, fed, run_name, manifests, wire, num_actors)


@contextlib.contextmanager
def _quiet_flower():
    """Flower logs every sampling and aggregation at INFO; keep its warnings, drop the chatter."""
    flower = logging.getLogger("flwr")
    level = flower.level
    if not log.isEnabledFor(logging.DEBUG):
        flower.setLevel(logging.WARNING)
    try:
        yield
    finally:
        flower.setLevel(level)


def _finish(settings: Settings, cfg: FederateConfig, fed: _Federation, run_name: str, manifests: list[dict],
            wire: dict, num_actors: int) -> FederateReport:
    """MLflow run (params, per-round metrics, curves) and a registered version, training kind `federated`."""
    from app import registry
    from app.plots import save_curves

    history = fed.history
    last = history[-1]
    epsilon = fed.accountant.get_privacy_spent().epsilon if fed.accountant else None
    metrics = {k: last[k] for k in ("val_accuracy", "val_loss", "train_loss") if k in last}
    metrics.update({"rounds": len(history), "clients": cfg.clients,
                    "bytes_up_total": sum(row["bytes_up"] for row in history)})
    if epsilon is not None:
        metrics["epsilon"] = epsilon
    lineage = [{"snapshot_id": m["snapshot_id"],
                "offsets": {p: {"start": o["start"], "end": o["end"]} for p, o in m["offsets"].items()}}
               for m in manifests]
    mlflow = registry._mlflow(settings.tracking_uri)
    experiment = registry.experiment_id(settings.tracking_uri, registry.artifact_root(settings))
    with mlflow.start_run(experiment_id=experiment, run_name=run_name) as run:
        params = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("snapshots", "inject_faults")}
        mlflow.log_params({**params, "model": settings.model, "image_size": settings.image_size,
                           "classes": ",".join(fed.classes), "snapshots": ",".join(m["snapshot_id"] for m in manifests),
                           "init_version": fed.init_version, "resumed_from": fed.start_round})
        mlflow.set_tags({"training_kind": "federated", "fl.checkpoints": fed.checkpoint_uri})
        for row in history:
            mlflow.log_metrics({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "round"},
                               step=row["round"])
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            save_curves(history, f"{directory}/curves.png", title=f"{run_name} ({settings.model}, {cfg.strategy})",
                        x="round")
            with open(f"{directory}/history.json", "w") as handle:
                json.dump(history, handle, indent=2)
            mlflow.log_artifacts(directory)
        run_id = run.info.run_id
    card = registry.ModelCard(arch=settings.model, classes=fed.classes, image_size=settings.image_size, features=False,
                              training_kind="federated", snapshots=lineage, metrics=metrics)
    version = registry.register(settings.tracking_uri, settings.model_name, run_id, fed.model.eval(), card)
    return FederateReport(version=version, run_id=run_id, run_name=run_name, metrics=metrics, history=history,
                          rounds_run=cfg.rounds - fed.start_round if fed.start_round < cfg.rounds else 0,
                          resumed_from=fed.start_round, classes=fed.classes, epsilon=epsilon, wire=wire,
                          checkpoint_dir=fed.checkpoint_uri, init_version=fed.init_version, num_actors=num_actors)
