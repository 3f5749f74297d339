"""The Flower `ClientApp` of both engines: train and evaluate on one client's data. A client actor
of the simulation finds its users by Flower's simulation node config (`partition-id`,
`num-partitions`), with test fault injection; a device (`argus device`) its folder (`data-dir`)."""

from __future__ import annotations

import collections
import logging
import os
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from torch import nn

from app import model as core
from app.fl.device import DATA_DIR_KEY, load_device_data
from app.fl.privacy import clip_update
from app.fl.task import (
    SECURE_CLIP,
    SECURE_KEYS,
    ClientData,
    encode_update,
    load_arrays,
    load_client_data,
    local_evaluate,
    local_train,
)

log = logging.getLogger(__name__)

CLIENT_APP = "app.fl.client_app:client_app"
"""How an actor finds the ClientApp: imported by reference, as a SuperNode loads a FAB's app."""


def _secure_rounds(message: Message, context: Context, call_next) -> Message:
    """Flower's SecAgg+ client side for the train messages of a secure round (`app.fl.secure`);
    every other message as it is."""
    if (
        message.metadata.message_type == MessageType.TRAIN
        and RECORD_KEY_CONFIGS in message.content.config_records
    ):
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


client_app = ClientApp(mods=[_secure_rounds])
SECURE_FIT_CONFIG, SECURE_FIT_PARAMETERS = "fitins.config", "fitins.parameters"
"""Where a legacy FitIns (SecAgg+'s training message) keeps the round's config and arrays."""

_MODELS: dict[tuple, nn.Module] = {}
_DATA: collections.OrderedDict[tuple, ClientData] = collections.OrderedDict()
_DATA_CACHE_SIZE = 8
"""Client datasets an actor keeps: memory stays bounded however many clients it serves."""


def _client_state(config: ConfigRecord, context: Context) -> tuple[int, ConfigRecord, nn.Module, ClientData]:
    if DATA_DIR_KEY in context.node_config:  # a device (`argus device`): its own images
        partition = int(context.node_id) % 1_000_003  # varies the devices' shuffles
        key = (str(context.node_config[DATA_DIR_KEY]), tuple(config["classes"]), int(config["image-size"]))
        load = load_device_data
    else:  # a simulated client: its users' rows of the central table snapshot
        partition = int(context.node_config[PARTITION_ID_KEY])
        key = (
            tuple(config["data-files"]),
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


def _train(model: nn.Module, data: ClientData, config: ConfigRecord, partition: int, fault: str | None):
    if fault == "slow":
        time.sleep(24 * 3600)
    seed = int(config["seed"]) * 1_000_003 + int(config["server-round"]) * 7919 + partition
    return local_train(
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


def _secure_train(message: Message, context: Context) -> Message:
    """A secure round's training (`app.fl.secure`): the round's arrays and config arrive as legacy
    FitIns, the update leaves as a legacy FitRes of weight 1, clipped here under DP, for
    `secaggplus_mod` to mask (it clears the arrays from the reply before it leaves the device)."""
    config = message.content.config_records[SECURE_FIT_CONFIG]
    partition, _, model, data = _client_state(config, context)
    keys = list(config[SECURE_KEYS])
    values = parameters_to_ndarrays(
        compat.arrayrecord_to_parameters(
            message.content.array_records[SECURE_FIT_PARAMETERS], keep_input=True
        )
    )
    origin = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in zip(keys, values, strict=True)}
    model.load_state_dict(origin, strict=False)
    stats = _train(model, data, config, partition, None)
    delta = {k: v.numpy() for k, v in encode_update(model, origin, "fp32").items()}
    if SECURE_CLIP in config:
        delta = clip_update(delta, float(config[SECURE_CLIP]))
    reply = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters([np.asarray(delta[k], dtype=np.float32) for k in keys]),
        1,  # every device weighs the same: the sum's sensitivity is the clip
        {"train_loss": float(stats["loss"]), "train_accuracy": float(stats["accuracy"])},
    )
    return Message(compat.fitres_to_recorddict(reply, keep_input=True), reply_to=message)


@client_app.train()
def client_train(message: Message, context: Context) -> Message:
    if SECURE_FIT_CONFIG in message.content.config_records:
        return _secure_train(message, context)
    partition, config, model, data = _client_state(message.content["config"], context)
    origin = load_arrays(model, message.content["arrays"])
    fault = _fault(config, partition)
    stats = _train(model, data, config, partition, fault)
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
    _, config, model, data = _client_state(message.content["config"], context)
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
