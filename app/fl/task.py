"""The client's side in plain PyTorch: its users' rows, local training and evaluation, and the
arrays that travel (no Ray, no Flower messages; `ArrayRecord` is only the container).

A simulated client reads its users' rows straight from the table snapshot's Parquet files, whose
URIs the server sends in the round's config. Images stay the uint8 pixels the table holds (a
quarter of float32's memory per client); each batch is augmented and normalised where it runs, as
centralised training does."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pyarrow.compute as pc
import torch
from flwr.app import ArrayRecord
from torch import nn

from app import model as core
from app.transform import augment as augment_images
from app.transform import encode_labels, normalize_pixels

UPDATE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
CPU = torch.device("cpu")
SECURE_KEYS = "array-keys"
"""A secure round's config entry naming the exchanged arrays in order (`app.fl.secure`): legacy
parameters carry no names."""
SECURE_CLIP = "secure-clip"
"""A secure round's config entry: the L2 norm each device clips its update to before masking it."""


def partition_users(users: Iterable[str], num_partitions: int, seed: int) -> list[list[str]]:
    """Distinct users shuffled by `seed` and dealt round-robin: each client holds whole users."""
    ordered = sorted(set(users))
    random.Random(seed).shuffle(ordered)
    return [ordered[i::num_partitions] for i in range(num_partitions)]


@lru_cache(maxsize=4)
def _user_partitions(data_files: tuple[str, ...], num_partitions: int, seed: int) -> list[list[str]]:
    from app.data.selection import read_rows

    # Every client of an actor deals the same users: read them once per table snapshot.
    users = read_rows(data_files, ["user_id"]).column("user_id").to_pylist()
    return partition_users((u for u in users if u is not None), num_partitions, seed)


@dataclass
class ClientData:
    train_x: torch.Tensor
    """uint8 pixels [N, 3, S, S], oldest first; so are `val_x` and the labels."""
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def labelled_rows(
    data_files: Iterable[str], classes: Iterable[str], row_filter=None
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(uint8 pixels [N, 3, S, S], class indices, event times) of the labelled rows of the table
    snapshot's `data_files` that pass `row_filter`, in event-time order (partition and offset
    break ties, so every reader sees one order)."""
    # Imported here: `app.data.selection` loads PyIceberg (~1 s), and a device, which starts a
    # ClientApp process per message, never reads the table.
    from app.data.selection import chw_images, read_rows

    classes = list(classes)
    labelled = pc.field("label").isin(classes)
    table = read_rows(
        list(data_files),
        ["pixels", "height", "width", "label", "event_time_ms", "kafka_partition", "kafka_offset"],
        labelled if row_filter is None else labelled & row_filter,
    )
    table = table.sort_by(
        [("event_time_ms", "ascending"), ("kafka_partition", "ascending"), ("kafka_offset", "ascending")]
    )
    if table.num_rows == 0:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), np.empty(0, np.int64)
    sizes = set(zip(table.column("height").to_pylist(), table.column("width").to_pylist()))
    if len(sizes) != 1:
        raise ValueError(f"rows of several image sizes {sorted(sizes)}: federated clients read one")
    height, width = sizes.pop()
    pixels = chw_images(table.column("pixels").to_pylist(), height, width)  # a writable copy, for torch
    labels = encode_labels(table.column("label").to_pylist(), classes)
    times = table.column("event_time_ms").to_numpy()
    return torch.from_numpy(pixels), torch.from_numpy(labels), times


def load_client_data(
    data_files: tuple[str, ...],
    partition_id: int,
    num_partitions: int,
    seed: int,
    classes: tuple[str, ...],
    val_from: int,
    test_from: int,
) -> ClientData:
    """This client's users' labelled rows before `test_from` (the central test slice never reaches
    a client); those from `val_from` on validate, as in centralised training's event-time split."""
    users = _user_partitions(data_files, num_partitions, seed)[partition_id]
    images, labels, times = labelled_rows(
        data_files, classes, pc.field("user_id").isin(users) & (pc.field("event_time_ms") < test_from)
    )
    if len(labels) == 0:
        raise ValueError(f"client {partition_id} ({len(users)} users) has no labelled records")
    cut = int(np.searchsorted(times, val_from, side="left"))
    return ClientData(images[:cut], labels[:cut], images[cut:], labels[cut:])


def partition_sizes(
    data_files: tuple[str, ...],
    num_partitions: int,
    seed: int,
    classes: tuple[str, ...],
    val_from: int,
    test_from: int,
) -> list[tuple[int, int]]:
    """(training, validation) rows of each client, as `load_client_data` cuts them, read on the
    server without pixels: the aggregation weights come from these, not from what a client claims."""
    from app.data.selection import read_rows

    users = _user_partitions(data_files, num_partitions, seed)
    owner = {user: partition for partition, group in enumerate(users) for user in group}
    table = read_rows(
        data_files,
        ["user_id", "event_time_ms"],
        pc.field("label").isin(list(classes)) & (pc.field("event_time_ms") < test_from),
    )
    train, val = [0] * num_partitions, [0] * num_partitions
    for user, event_time in zip(
        table.column("user_id").to_pylist(), table.column("event_time_ms").to_pylist(), strict=True
    ):
        if user in owner:
            (train if event_time < val_from else val)[owner[user]] += 1
    return list(zip(train, val, strict=True))


class ProximalLoss(nn.Module):
    """FedProx's client objective: the task loss plus mu/2·||w − w_global||² over trainable weights."""

    def __init__(self, base: nn.Module, model: nn.Module, mu: float):
        super().__init__()
        self.base, self.mu = base, mu
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._anchor = [p.detach().clone() for p in self._params]

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        proximal = sum((p - a).pow(2).sum() for p, a in zip(self._params, self._anchor, strict=True))
        return self.base(logits, targets) + 0.5 * self.mu * proximal


def batches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    generator: torch.Generator | None,
    augment: str = "none",
    device: torch.device = CPU,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled (when given a generator) batches of uint8 pixels, moved to `device`, augmented by
    mode (`none`, `light`, `strong`) and normalised there."""
    order = torch.randperm(len(y), generator=generator) if generator is not None else torch.arange(len(y))
    for start in range(0, len(y), batch_size):
        index = order[start : start + batch_size]
        pixels = x[index].to(device, non_blocking=True)
        if augment != "none":
            pixels = augment_images(pixels, augment, generator)
        yield normalize_pixels(pixels), y[index].to(device, non_blocking=True)


def local_train(
    model: nn.Module,
    data: ClientData,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    mu: float,
    seed: int,
    augment: str,
    batches_hook=None,
    device: torch.device = CPU,
) -> dict:
    """`epochs` passes of SGD over the client's training rows, through the shared `train_epoch`."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    if mu > 0:
        loss_fn = ProximalLoss(loss_fn, model, mu)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    stats = {}
    for _ in range(epochs):
        epoch = batches(data.train_x, data.train_y, batch_size, generator, augment, device)
        stats = core.train_epoch(
            model, batches_hook(epoch) if batches_hook else epoch, optimizer, loss_fn, device=device
        )
    return stats


def evaluate_pixels(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    batch_size: int = 256,
    device: torch.device = CPU,
) -> dict:
    """`core.evaluate` over uint8 pixels, normalised batch by batch (clients' and the server's test)."""
    return core.evaluate(model, batches(x, y, batch_size, None, "none", device), num_classes, device=device)


def local_evaluate(
    model: nn.Module, data: ClientData, num_classes: int, batch_size: int = 256, device: torch.device = CPU
) -> dict:
    return evaluate_pixels(model, data.val_x, data.val_y, num_classes, batch_size, device)


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
        raise ValueError(
            f"global arrays do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return state


def encode_update(model: nn.Module, origin: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """local − global per exchanged array, in the wire precision `dtype` (fp16 or fp32)."""
    state = model.state_dict()
    return {k: (state[k].detach().float().cpu() - g).to(UPDATE_DTYPES[dtype]) for k, g in origin.items()}
