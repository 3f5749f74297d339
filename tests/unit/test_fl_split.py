"""The central event-time split in federated learning: the server judges every round's global model
on exactly the test slice, and no record of that slice reaches a client. The real ClientApp and
ServerApp run in this process over a grid that calls the ClientApp directly (no Ray)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict, UserConfig
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

from app import model as core
from app.config import Settings
from app.data.table import ImageTable
from app.errors import ConfigError
from app.fl import FederateConfig, central_test
from app.fl import client_app as client_module
from app.fl.grid import RoundTraffic, assign_message_id, stamp_task_identity
from app.fl.server_app import Federation, build_server_app, build_strategy
from app.fl.task import load_client_data, model_arrays
from app.selection import TEST, VALIDATION, EventTimeSplit

from snapshots import commit_snapshot

stamp_task_identity()  # as a running ServerApp has

CLASSES = ["a", "b", "c"]
RECORDS, USERS, SIZE = 120, 12, 16


def _snapshot(tmp_path) -> tuple[tuple[str, ...], np.ndarray]:
    """The data files of a committed table snapshot whose record i has every pixel equal to i, so
    any image names its record; the records' event times."""
    settings = Settings(storage=str(tmp_path / "data"), topic="t", image_size=SIZE, model="cnn")
    event_times = 1_000_000 + 1_000 * np.arange(RECORDS, dtype=np.int64)
    images = np.broadcast_to(
        np.arange(RECORDS, dtype=np.uint8).reshape(-1, 1, 1, 1), (RECORDS, 3, SIZE, SIZE)
    ).copy()
    keys = [f"user-{i % USERS}" for i in range(RECORDS)]
    labels = [CLASSES[i % 3] for i in range(RECORDS)]
    snapshot_id = commit_snapshot(settings, keys, labels, event_times, images)
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    return tuple(table.data_file_uris(snapshot_id)), event_times


def _ids(images: torch.Tensor) -> set[int]:
    return {int(v) for v in images[:, 0, 0, 0]}


class InProcessGrid:
    """What `build_server_app` asks of a grid, with each message handed straight to the ClientApp."""

    def __init__(self, num_nodes: int):
        self.num_nodes, self.last = num_nodes, RoundTraffic()

    def get_node_ids(self):
        return list(range(1, self.num_nodes + 1))

    def send_and_receive(self, messages, *, timeout=None):
        self.last = RoundTraffic()
        replies = []
        for message in messages:
            assign_message_id(message, uuid.uuid4().hex)
            node = message.metadata.dst_node_id
            config = UserConfig({PARTITION_ID_KEY: node - 1, NUM_PARTITIONS_KEY: self.num_nodes})
            context = Context(
                run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config=UserConfig()
            )
            reply = client_module.client_app(message, context)
            assign_message_id(reply, uuid.uuid4().hex)
            replies.append(reply)
        self.last.sent = self.last.replied = len(replies)
        return replies


def test_the_server_judges_every_round_on_exactly_the_test_slice_that_no_client_reads(tmp_path):
    files, event_times = _snapshot(tmp_path)
    torch.manual_seed(0)
    model = core.build_model("cnn", len(CLASSES))
    split, central = central_test(list(files), CLASSES, 0.2, model, torch.device("cpu"))

    assert split == EventTimeSplit.of(event_times, 0.2)  # the split centralised training cuts
    slices = split.slice_of(event_times)
    test_ids = set(np.flatnonzero(slices == TEST).tolist())
    assert test_ids and _ids(central.images) == test_ids
    assert central.images.dtype == torch.uint8 and len(central.labels) == len(test_ids)

    # Direct: each client's training rows precede val_from, its validation rows [val_from, test_from).
    clients = 3
    seen = set()
    for partition in range(clients):
        data = load_client_data(files, partition, clients, 0, tuple(CLASSES), split.val_from, split.test_from)
        assert data.train_x.dtype == torch.uint8
        train, val = _ids(data.train_x), _ids(data.val_x)
        assert all(slices[i] == VALIDATION for i in val) and all(
            event_times[i] < split.val_from for i in train
        )
        seen |= train | val
    assert seen == set(range(RECORDS)) - test_ids

    # Through the ServerApp: the hook runs after every round, each time on the same test rows.
    cfg = FederateConfig(
        rounds=2, clients=clients, clients_per_round=clients, batch_size=16, lr=0.01, augment="light"
    )
    fed = Federation(
        cfg=cfg,
        model=model,
        arrays=model_arrays(model),
        classes=CLASSES,
        data_files=list(files),
        checkpoint_uri=str(tmp_path / "checkpoints"),
        fingerprint={"arch": "cnn", "image_size": SIZE},
        val_from=split.val_from,
        test_from=split.test_from,
    )
    calls = []

    def evaluate_fn(server_round, arrays):
        calls.append((server_round, _ids(central.images)))
        result = central(server_round, arrays)
        calls[-1] += (result["test_accuracy"],)
        return result

    client_module._DATA.clear()
    build_server_app(fed, build_strategy(cfg), evaluate_fn=evaluate_fn)(
        grid=InProcessGrid(clients),
        context=Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
    )
    assert [(r, ids) for r, ids, _ in calls] == [(1, test_ids), (2, test_ids)]
    assert [row["test_accuracy"] for row in fed.history] == [accuracy for *_, accuracy in calls]
    assert all({"test_loss", "val_accuracy", "train_loss"} <= row.keys() for row in fed.history)
    assert len(client_module._DATA) == clients
    for data in client_module._DATA.values():  # what the ClientApp held while it trained and evaluated
        assert not (_ids(data.train_x) | _ids(data.val_x)) & test_ids
    # The registered model's test figure is the last round's, from the same rows.
    assert central(2, fed.arrays)["test_accuracy"] == fed.history[-1]["test_accuracy"]


def test_a_split_that_leaves_a_slice_empty_is_a_config_error(tmp_path):
    files, _ = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match="event-time split"):
        central_test(list(files), CLASSES, 0.001, core.build_model("cnn", 3), torch.device("cpu"))


def test_augment_is_a_mode_and_promotion_is_opt_in():
    assert FederateConfig().augment == "light" and FederateConfig().promote_if_better is False
    with pytest.raises(ConfigError, match="--augment"):
        FederateConfig(augment=True)


def test_client_batches_are_normalised_uint8_pixels_augmented_by_mode():
    from app.fl.task import batches
    from app.transform import normalize_pixels

    x = torch.randint(0, 256, (10, 3, SIZE, SIZE), dtype=torch.uint8)
    y = torch.arange(10)
    plain = list(batches(x, y, 4, None))
    assert [len(b) for b, _ in plain] == [4, 4, 2]
    assert torch.equal(torch.cat([b for b, _ in plain]), normalize_pixels(x))
    light = list(batches(x, y, 4, torch.Generator().manual_seed(1), "light"))
    order = torch.cat([t for _, t in light])
    assert sorted(order.tolist()) == list(range(10))
    augmented = torch.cat([b for b, _ in light])
    assert augmented.dtype == torch.float32 and not torch.allclose(augmented, normalize_pixels(x[order]))
