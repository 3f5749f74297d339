"""Per-round checkpoints of a federated run: `<root>/round-NNNNN/{model.safetensors, state.json}`.
state.json is written last, so its presence marks a round complete; the two newest are kept."""

from __future__ import annotations

import json
import logging

import pyarrow.fs as pafs
import torch
from safetensors.torch import load, save
from torch import nn

from app.storage import filesystem, write_file

log = logging.getLogger(__name__)


def save_checkpoint(root_uri: str, server_round: int, model: nn.Module, meta: dict, keep: int = 2) -> None:
    """round-NNNNN/{model.safetensors, state.json}; state.json goes last, so it marks completion."""
    fs, root = filesystem(root_uri)
    directory = f"{root}/round-{server_round:05d}"
    weights = save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    write_file(fs, f"{directory}/model.safetensors", weights)
    write_file(fs, f"{directory}/state.json", json.dumps(meta, indent=1).encode())
    rounds = sorted(
        i.base_name for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.startswith("round-")
    )
    for old in rounds[:-keep]:
        fs.delete_dir(f"{root}/{old}")


def load_checkpoint(root_uri: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The latest complete round's weights and state, or None."""
    fs, root = filesystem(root_uri)
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
