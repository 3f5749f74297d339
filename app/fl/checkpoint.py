"""Per-round checkpoints of a federated run: `<root>/round-NNNNN/{model.safetensors, state.json}`.
state.json is written last, so its presence marks a round complete; the two newest are kept."""

from __future__ import annotations

import json
import logging

import torch
from safetensors.torch import load, save
from torch import nn

from app.storage import Store

log = logging.getLogger(__name__)


def save_checkpoint(root_uri: str, server_round: int, model: nn.Module, meta: dict, keep: int = 2) -> None:
    """round-NNNNN/{model.safetensors, state.json}; state.json goes last, so it marks completion."""
    store = Store.at(root_uri)
    directory = f"round-{server_round:05d}"
    weights = save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    store.write(f"{directory}/model.safetensors", weights)
    store.write(f"{directory}/state.json", json.dumps(meta, indent=1).encode())
    rounds = sorted(i.base_name for i in store.list() if i.base_name.startswith("round-"))
    for old in rounds[:-keep]:
        store.delete_dir(old)


def load_checkpoint(root_uri: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The latest complete round's weights and state, or None."""
    store = Store.at(root_uri)
    for name in sorted((i.base_name for i in store.list() if i.base_name.startswith("round-")), reverse=True):
        try:
            meta = json.loads(store.read(f"{name}/state.json"))
            return load(store.read(f"{name}/model.safetensors")), meta
        except FileNotFoundError:
            log.warning("checkpoint %s/%s is incomplete; trying an older one", root_uri, name)
    return None
