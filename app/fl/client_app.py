"""The Flower `ClientApp` of both engines: train and evaluate on one client's data. A client actor
of the simulation finds its users by Flower's simulation node config (`partition-id`,
`num-partitions`), with test fault injection; a device (`argus device`) its folder (`data-dir`)."""

from __future__ import annotations

import collections
import logging
import os
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from torch import nn

from app import model as core
from app.fl.device import DATA_DIR_KEY, load_device_data
from app.fl.task import ClientData, encode_update, load_arrays, load_client_data, local_evaluate, local_train

log = logging.getLogger(__name__)

CLIENT_APP = "app.fl.client_app:client_app"
"""How an actor finds the ClientApp: imported by reference, as a SuperNode loads a FAB's app."""

client_app = ClientApp()

_MODELS: dict[tuple, nn.Module] = {}
_DATA: collections.OrderedDict[tuple, ClientData] = collections.OrderedDict()
_DATA_CACHE_SIZE = 8
"""Client datasets an actor keeps: memory stays bounded however many clients it serves."""


def _client_state(message: Message, context: Context) -> tuple[int, ConfigRecord, nn.Module, ClientData]:
    config = message.content["config"]
    if DATA_DIR_KEY in context.node_config:  # a device (`argus device`): its own images
        partition = int(context.node_id) % 1_000_003  # varies the devices' shuffles
        key = (str(context.node_config[DATA_DIR_KEY]), tuple(config["classes"]), int(config["image-size"]))
        load = load_device_data
    else:  # a simulated client: its users' rows of the central snapshots
        partition = int(context.node_config[PARTITION_ID_KEY])
        key = (
            tuple(config["snapshots"]),
            partition,
            int(context.node_config[NUM_PARTITIONS_KEY]),
            int(config["seed"]),
            tuple(config["classes"]),
            int(config["val-from"]),
            int(config["test-from"]),
        )
        load = load_client_data
    if key in _DATA:
        _DATA.move_to_end(key)
    else:
        _DATA[key] = load(*key)
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
    stats = local_train(
        model,
        data,
        epochs=int(config["local-epochs"]),
        batch_size=int(config["batch-size"]),
        lr=float(config["lr"]),
        mu=float(config.get("proximal-mu", 0.0)),
        seed=seed,
        augment=str(config["augment"]),
        batches_hook=_crash_after_first if fault == "crash" else None,
        device=core.local_device(),
    )
    update = encode_update(model, origin, str(config["update-dtype"]))
    if fault == "nan":
        update = {k: torch.full_like(v, float("nan")) for k, v in update.items()}
    elif fault == "scale":
        update = {k: v * 1000 for k, v in update.items()}
    metrics = MetricRecord(
        {
            "num-examples": len(data.train_y),
            "train_loss": float(stats["loss"]),
            "train_accuracy": float(stats["accuracy"]),
        }
    )
    return Message(RecordDict({"arrays": ArrayRecord(update), "metrics": metrics}), reply_to=message)


@client_app.evaluate()
def client_evaluate(message: Message, context: Context) -> Message:
    _, config, model, data = _client_state(message, context)
    load_arrays(model, message.content["arrays"])
    result = {"loss": 0.0, "accuracy": 0.0}
    if len(data.val_y):
        result = local_evaluate(model, data, len(config["classes"]), device=core.local_device())
    metrics = MetricRecord(
        {
            "num-examples": len(data.val_y),
            "val_loss": float(result["loss"]),
            "val_accuracy": float(result["accuracy"]),
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=message)
